"""The layer over several NVLink domains (``MoeConfig(domain_size=L)``, mok/_domains.py) on the CPU
backend: R gloo ranks as D = R / L domains, the inter-domain hop through gloo and the one-domain
layer within each (the same Python code runs NCCL and the megakernel on GPUs).

Checked on every rank against the one-domain layer over the same group (itself bitwise the C++
reference, tests/python/test_distributed.py): y, dx and the weight gradients within the bf16
bound (each domain's partial sum is rounded once more), d topk_w bit for bit (a slot's is computed
once, in its expert's domain); reruns give the same bits; bad input raises on every rank. With two
or more sm_90 GPUs the same checks run over NCCL with the megakernel in each domain (one GPU per
rank; tools/gpu.sh runs them on the 2-GPU machine).
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import mok  # noqa: E402
import test_distributed as td  # noqa: E402
from mok import _C, _domains, testing  # noqa: E402

CASES = [
    td.Case("uniform_shared", 9, 2, 24, 12, 3, shared=8),
    td.Case("empty_slots_clamped", 11, 2, 16, 8, 3, limit=0.5, routing="masked"),
    td.Case("all_tokens_to_domain0", 6, 2, 16, 8, 2, routing="all_to_one", save_context=False),
    td.Case("no_tokens", 0, 2, 16, 8, 2, shared=4),
]
GRADS = ("dx", "d_gate", "d_up", "d_down", "d_shared_gate", "d_shared_up", "d_shared_down")


def run(case: td.Case, p: td.GlobalProblem, rank: int, size: int, domain_size: int | None,
        device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    El = p.weights[0].shape[0] // size
    mine = slice(rank * El, (rank + 1) * El)
    wdtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # (fp32 holding bf16 values on the CPU)
    x = p.x[rank].to(device).requires_grad_()
    w = p.topk_w[rank].to(device).requires_grad_()
    weights = [t[mine].to(device, wdtype).contiguous().requires_grad_() for t in p.weights]
    shared = [t.to(device, wdtype).requires_grad_() for t in p.shared] if p.shared else None
    config = mok.MoeConfig(domain_size=domain_size, precision=case.precision)
    y = mok.moe(x, p.topk_idx[rank].to(device), w, *weights, tuple(shared) if shared else None,
                swiglu_limit=case.limit, group=dist.group.WORLD, save_context=case.save_context, config=config)
    y.backward(p.dy[rank].to(device))
    if device.type == "cuda":
        from mok import _cuda_layer

        _cuda_layer.check()  # a timed-out wait or a bad expert id is an error here
    out = {"y": y.detach(), "dx": x.grad, "d_topk_w": w.grad, "d_gate": weights[0].grad, "d_up": weights[1].grad,
           "d_down": weights[2].grad}
    if shared:
        out.update(d_shared_gate=shared[0].grad, d_shared_up=shared[1].grad, d_shared_down=shared[2].grad)
    return {k: v.detach().cpu() for k, v in out.items()}


def check_case(case: td.Case, rank: int, size: int, domain_size: int,
               device: torch.device = torch.device("cpu")) -> None:
    p = td.make_problem(case, size, seed=3)
    flat = run(case, p, rank, size, None, device)
    ours = run(case, p, rank, size, domain_size, device)
    where = f"case {case.name}, rank {rank} of {size}, domains of {domain_size}"
    assert ours["y"].dtype == torch.bfloat16 and ours["dx"].dtype == torch.bfloat16, where
    td.assert_bitwise(f"{where}: d_topk_w", ours["d_topk_w"], flat["d_topk_w"].float().numpy())
    for name in ("y",) + GRADS:
        if name not in flat:
            continue
        assert ours[name] is not None and ours[name].shape == flat[name].shape, f"{where}: {name}"
        err = testing.relative_error(ours[name], flat[name])
        assert err <= 1e-2, f"{where}: {name} rel error {err:.3e} against the one-domain layer"
    again = run(case, p, rank, size, domain_size, device)
    for name, value in ours.items():
        td.assert_bitwise(f"{where}: {name} on a rerun", again[name], value.float().numpy())


def check_bad_domain_size(rank: int, size: int) -> None:
    case = td.Case("bad", 4, 2, 16, 8, 2)
    p = td.make_problem(case, size, seed=1)
    El = p.weights[0].shape[0] // size
    weights = [t[rank * El:(rank + 1) * El] for t in p.weights]
    td.expect_error("a domain size that does not divide R", ValueError, f"must divide the expert-parallel group's "
                    f"{size} ranks", lambda: mok.moe(p.x[rank], p.topk_idx[rank], p.topk_w[rank], *weights,
                                                     group=dist.group.WORLD, config=mok.MoeConfig(domain_size=3)))
    # One rank's bad expert id: every rank raises (no rank waits in the exchange).
    idx = p.topk_idx[rank].clone()
    if rank == 1:
        idx[2, 1] = 99
    message = "topk_idx[2, 1] = 99 is not an expert id" if rank == 1 else "rank 1"
    td.expect_error("a bad expert id", ValueError, message,
                    lambda: mok.moe(p.x[rank], idx, p.topk_w[rank], *weights, group=dist.group.WORLD,
                                    config=mok.MoeConfig(domain_size=1)))
    # A NaN weight on one rank, checked before the exchange: every rank raises.
    bad = [w.clone() for w in weights]
    if rank == 1:
        bad[0][0, 1, 2] = float("nan")
    td.expect_error("a NaN weight", ValueError, "w_gate[0][1][2] is not finite" if rank == 1 else "rank 1",
                    lambda: mok.moe(p.x[rank], p.topk_idx[rank], p.topk_w[rank], *bad, group=dist.group.WORLD,
                                    config=mok.MoeConfig(domain_size=1)))
    # Options every domain must share: the SwiGLU limit.
    td.expect_error("different SwiGLU limits", ValueError, "disagree on swiglu_limit",
                    lambda: mok.moe(p.x[rank], p.topk_idx[rank], p.topk_w[rank], *weights, group=dist.group.WORLD,
                                    swiglu_limit=None if rank == 0 else 0.5, config=mok.MoeConfig(domain_size=1)))
    # A NaN in one rank's dy: every rank's backward raises before the exchange.
    x = p.x[rank].clone().requires_grad_()
    y = mok.moe(x, p.topk_idx[rank], p.topk_w[rank], *weights, group=dist.group.WORLD,
                config=mok.MoeConfig(domain_size=1))
    dy = p.dy[rank].clone()
    if rank == 1:
        dy[3, 4] = float("nan")
    td.expect_error("a NaN in dy", ValueError, "dy[3][4] is not finite" if rank == 1 else "rank 1",
                    lambda: y.backward(dy))
    # Without a group, or with a size that does not divide R: named.
    td.expect_error("domain_size without a group", ValueError, "must divide the expert-parallel group's 1 ranks",
                    lambda: mok.moe(p.x[rank], p.topk_idx[rank], p.topk_w[rank], *(t for t in p.weights),
                                    config=mok.MoeConfig(domain_size=2)))


def worker(rank: int, size: int, init_file: str, result_dir: str, domain_size: int) -> None:
    with td.rank_report(rank, result_dir):
        torch.set_num_threads(1)
        _C.set_cpu_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60))
        for case in CASES:
            check_case(case, rank, size, domain_size)
        # The calls took the two-level path: it made its subgroups (looked up here, not made), of the
        # asked sizes.
        assert (dist.group.WORLD.group_name, domain_size) in _domains._GROUPS
        within, across = _domains.subgroups(dist.group.WORLD, domain_size)
        assert (dist.get_world_size(within), dist.get_world_size(across)) == (domain_size, size // domain_size)
        assert len(_domains._GROUPS) == 1
        check_bad_domain_size(rank, size)
        # The module takes the same path from its config.
        m = mok.MoE(2 * size, 16, 8, 2, router="softmax", group=dist.group.WORLD,
                    config=mok.MoeConfig(domain_size=domain_size))
        m(torch.randn(5, 16)).square().mean().backward()
        assert m.w_gate.grad is not None and bool(torch.isfinite(m.w_gate.grad).all())
        dist.barrier()


@pytest.mark.parametrize("size,domain_size", [(2, 1), (4, 2), (4, 1)])
def test_domains_over_gloo(size: int, domain_size: int) -> None:
    td.spawn_ranks(worker, size, domain_size)


# On GPUs: the megakernel within each domain, NCCL across (bf16, and fp8 at shapes it takes).
CUDA_CASES = [
    td.Case("uniform_shared", 300, 4, 512, 256, 4, shared=128),
    td.Case("empty_slots_recomputed", 257, 4, 256, 128, 3, routing="masked", save_context=False),
    td.Case("zipf_fp8_dgrad", 300, 4, 512, 256, 4, shared=128, limit=7.0, routing="zipf", precision="fp8_dgrad"),
]


def cuda_worker(rank: int, size: int, init_file: str, result_dir: str, domain_size: int) -> None:
    with td.rank_report(rank, result_dir):
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", rank))
        for case in CUDA_CASES:
            check_case(case, rank, size, domain_size, torch.device("cuda", rank))
        dist.barrier()


def shared_gpu_worker(rank: int, size: int, init_file: str, result_dir: str) -> None:
    """Ranks sharing one GPU over gloo, each rank its own domain (the megakernel at R = 1 in each,
    the exchange staged through the host): against the C++ reference over the same ranks, which
    the one-domain layer cannot run here (its symmetric memory needs a GPU per rank)."""
    with td.rank_report(rank, result_dir):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=120))
        device = torch.device("cuda", 0)
        for case in CUDA_CASES:
            p = td.make_problem(case, size, seed=5)
            ours = run(case, p, rank, size, 1, device)
            ref = td.reference(case, p, size)
            where = f"case {case.name}, rank {rank} of {size} sharing one GPU"
            shared = ("d_shared_gate", "d_shared_up", "d_shared_down") if case.shared else ()
            for name in ("y", "dx", "d_topk_w", "d_gate", "d_up", "d_down") + shared:
                want = td.reference_part(ref, p, name, rank, size)
                err = testing.relative_error(ours[name].float().reshape(-1), torch.from_numpy(want).reshape(-1))
                assert err < 2e-2, f"{where}: {name} rel error {err:.3e} against the C++ reference"
            again = run(case, p, rank, size, 1, device)
            for name, value in ours.items():
                assert torch.equal(again[name], value), f"{where}: {name} differs on a rerun"
        dist.barrier()


def test_domains_sharing_one_gpu() -> None:
    if _gpus() < 1:
        pytest.skip("needs an sm_90 GPU and libmok_cuda_capi.so")
    td.spawn_ranks(shared_gpu_worker, 2, timeout_s=300)


def _gpus() -> int:
    from mok import _cuda_kernels

    if not (torch.cuda.is_available() and _cuda_kernels.available()):
        return 0
    return sum(torch.cuda.get_device_capability(d) == (9, 0) for d in range(torch.cuda.device_count()))


@pytest.mark.parametrize("size,domain_size", [(2, 1), (4, 2)])
def test_domains_on_gpus(size: int, domain_size: int) -> None:
    if _gpus() < size:
        pytest.skip(f"needs {size} sm_90 GPUs and libmok_cuda_capi.so")
    td.spawn_ranks(cuda_worker, size, domain_size, timeout_s=300)
