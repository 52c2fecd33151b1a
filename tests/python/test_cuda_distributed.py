"""mok.moe over an expert-parallel group of 2 GPUs (NCCL + torch symmetric memory): the fused
forward and its backward (bf16, and fp8 against the reference's fp8 layer) on every rank against the C++ reference over the same emulated ranks,
bitwise the same on a rerun, and bitwise the same as the whole batch on one GPU (results do not
depend on the number of ranks); the explicit passes on a GPU workspace give mok.moe's bits; a CUDA graph of a
training step replays bitwise as eager calls. Skipped without two sm_90 GPUs and the sm_90a library
(tools/gpu.sh runs it on the 2-GPU machine).
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

mok = pytest.importorskip("mok")
from mok import _cuda_kernels, testing  # noqa: E402

import test_distributed as td  # noqa: E402  (the CPU suite's problems and C++ reference)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
         and all(torch.cuda.get_device_capability(d) == (9, 0) for d in range(2)) and _cuda_kernels.available()),
    reason="needs two sm_90 GPUs and libmok_cuda_capi.so",
)

CASES = [
    td.Case("uniform_shared", 300, 8, 512, 256, 4, shared=128),
    td.Case("all_to_one_clamped_recomputed", 257, 4, 512, 256, 2, limit=0.75, routing="all_to_one",
            save_context=False),
    td.Case("one_token", 1, 4, 256, 128, 2),
    td.Case("empty_slots_shared", 300, 8, 512, 256, 4, shared=128, routing="masked"),
    td.Case("no_tokens", 0, 4, 256, 128, 2, shared=64),
    # fp8: the fp8 megakernel pulls e4m3 rows over NVLink; its backward pulls the bf16 rows again.
    td.Case("zipf_shared_clamped_fp8", 300, 8, 512, 256, 4, shared=128, limit=7.0, routing="zipf", precision="fp8"),
    # fp8_dgrad: that forward, the backward's data gradients on e4m3 (the stage kernels).
    td.Case("uniform_shared_fp8_dgrad", 300, 8, 512, 256, 4, shared=128, precision="fp8_dgrad"),
]
NAMES = ("y", "dx", "d_topk_w", "d_gate", "d_up", "d_down")
SHARED = ("d_shared_gate", "d_shared_up", "d_shared_down")


def run_layer(case: td.Case, p: td.GlobalProblem, group: dist.ProcessGroup | None, rank: int,
              size: int) -> dict[str, torch.Tensor]:
    """This rank's y and gradients through mok.moe on its GPU (rank/size within `group`)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    El = p.weights[0].shape[0] // size
    mine = slice(rank * El, (rank + 1) * El)
    x = p.x[rank].to(dev).requires_grad_()
    w = p.topk_w[rank].to(dev).requires_grad_()
    weights = [t[mine].to(dev, torch.bfloat16).contiguous().requires_grad_() for t in p.weights]
    shared = [t.to(dev, torch.bfloat16).requires_grad_() for t in p.shared] if p.shared else None
    y = mok.moe(x, p.topk_idx[rank].to(dev), w, *weights, tuple(shared) if shared else None,
                swiglu_limit=case.limit, group=group, save_context=case.save_context,
                config=mok.MoeConfig(precision=case.precision))
    y.backward(p.dy[rank].to(dev))
    from mok import _cuda_layer

    _cuda_layer.check()  # a timed-out wait or a bad expert id is an error here, not garbage
    out = {"y": y, "dx": x.grad, "d_topk_w": w.grad, "d_gate": weights[0].grad, "d_up": weights[1].grad,
           "d_down": weights[2].grad}
    if shared:
        out.update(zip(SHARED, (t.grad for t in shared)))
    return {k: v.detach().clone() for k, v in out.items()}


def run_explicit(case: td.Case, p: td.GlobalProblem, rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's y and gradients through the explicit passes on a GPU workspace of the group:
    build_schedule, forward, recompute_forward_context, backward (on the recomputed context)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    El = p.weights[0].shape[0] // size
    mine = slice(rank * El, (rank + 1) * El)
    x, w, dy = p.x[rank].to(dev), p.topk_w[rank].to(dev), p.dy[rank].to(dev)
    weights = [t[mine].to(dev, torch.bfloat16).contiguous() for t in p.weights]
    shared = tuple(t.to(dev, torch.bfloat16) for t in p.shared) if p.shared else None
    Is = shared[0].shape[0] if shared else 0
    ws = mok.create_workspace(mok.MoeConfig(precision=case.precision), dist.group.WORLD, device=dev,
                              num_local_tokens=case.tokens, hidden=x.shape[1], intermediate=weights[0].shape[1],
                              num_experts=p.weights[0].shape[0], topk=w.shape[1], shared_intermediate=Is,
                              swiglu_limit=case.limit)
    s = mok.build_schedule(ws, p.topk_idx[rank].to(dev))
    # The schedule's counts, made on the device by its call, against the routing every rank holds.
    E = p.weights[0].shape[0]
    ids = [t.long().flatten() for t in p.topk_idx]
    routed = [i[(i >= 0) & (i < E)] for i in ids]
    send = torch.bincount(routed[rank] // El, minlength=size)
    recv = torch.tensor([int(((r >= rank * El) & (r < (rank + 1) * El)).sum()) for r in routed])
    local = torch.cat(routed)
    local = local[(local >= rank * El) & (local < (rank + 1) * El)] - rank * El
    per_expert = torch.bincount(local, minlength=El)
    assert torch.equal(s.tokens_per_expert.cpu().long(), per_expert), f"rank {rank}: tokens_per_expert"
    assert torch.equal(s.send_counts.cpu(), send), f"rank {rank}: send_counts {s.send_counts.tolist()}, want {send.tolist()}"
    assert torch.equal(s.recv_counts.cpu(), recv), f"rank {rank}: recv_counts {s.recv_counts.tolist()}, want {recv.tolist()}"
    y, _ = mok.forward(ws, s, x, w, *weights, shared)
    ctx = mok.recompute_forward_context(ws, s, x, *weights, shared)
    g = mok.backward(ws, s, ctx, dy, x, w, *weights, shared)
    ws.check()
    out = {"y": y, "dx": g.d_x, "d_topk_w": g.d_topk_w, "d_gate": g.d_w_gate, "d_up": g.d_w_up, "d_down": g.d_w_down}
    if shared:
        out.update(zip(SHARED, (g.d_s_gate, g.d_s_up, g.d_s_down)))
    return out


def relative_error(actual: torch.Tensor, expected: np.ndarray) -> float:
    a = actual.detach().float().cpu().reshape(-1)
    e = torch.from_numpy(np.ascontiguousarray(expected)).float().reshape(-1)
    assert a.shape == e.shape, f"{tuple(a.shape)} vs {tuple(e.shape)}"
    assert bool(torch.isfinite(a).all()), "not finite"
    scale = float(e.norm())
    return float((a - e).norm()) / scale if scale > 0 else float(a.norm())


def merged(p: td.GlobalProblem) -> td.GlobalProblem:
    """The same global batch as one rank's: every rank's tokens in rank order."""
    cat = lambda ts: [torch.cat(ts)]  # noqa: E731
    return td.GlobalProblem(cat(p.x), cat(p.topk_idx), cat(p.topk_w), cat(p.dy), p.weights, p.shared)


def check_case(case: td.Case, rank: int, size: int) -> None:
    p = td.make_problem(case, size, seed=13)
    ours = run_layer(case, p, dist.group.WORLD, rank, size)
    where = f"case {case.name}, rank {rank} of {size}"
    ref = td.reference(case, p, size)
    El = p.weights[0].shape[0] // size
    for name in NAMES + (SHARED if case.shared else ()):
        err = relative_error(ours[name], td.reference_part(ref, p, name, rank, size))
        assert err < 2e-2, f"{where}: {name} relative error {err:.3g} against the C++ reference"
    again = run_layer(case, p, dist.group.WORLD, rank, size)
    for name, a in ours.items():
        assert torch.equal(a, again[name]), f"{where}: {name} differs between two runs"
    explicit = run_explicit(case, p, rank, size)
    for name, a in ours.items():
        assert torch.equal(a, explicit[name]), f"{where}: {name} of the explicit passes differs from mok.moe's"
    # The whole batch on this GPU alone, all experts local: the same bits for this rank's tokens and
    # experts, the shared expert's y and dx included (it runs on the expert kernels, where a row's
    # outputs do not depend on the other rows); its weight gradient there sums every rank's tokens
    # and is not compared.
    one = run_layer(case, merged(p), None, 0, 1)
    T = case.tokens
    for name in ("y", "dx", "d_topk_w"):
        assert torch.equal(ours[name], one[name][rank * T:(rank + 1) * T]), f"{where}: {name} differs from R=1"
    for name in ("d_gate", "d_up", "d_down"):
        assert torch.equal(ours[name], one[name][rank * El:(rank + 1) * El]), f"{where}: {name} differs from R=1"


def check_non_finite_on_one_rank(rank: int, size: int) -> None:
    """A NaN in rank 1's x is named by every rank's check(), and every rank's next call refuses to
    run (no rank left waiting at a barrier); clearing the workspaces on every rank recovers."""
    from mok import _cuda_layer

    case = td.Case("nan_on_rank1", 64, 4, 256, 128, 2)
    p = td.make_problem(case, size, seed=12)
    dev = torch.device("cuda", torch.cuda.current_device())
    El = p.weights[0].shape[0] // size
    weights = [t[rank * El:(rank + 1) * El].to(dev, torch.bfloat16).contiguous() for t in p.weights]
    x = p.x[rank].to(dev).clone()
    if rank == 1:
        x[5, 7] = float("nan")
    group = dist.group.WORLD
    mok.clear_workspace_cache()
    mok.moe(x, p.topk_idx[rank].to(dev), p.topk_w[rank].to(dev), *weights, group=group)
    with pytest.raises(RuntimeError, match=r"x\[rank 1\]\[token 5\]\[7\] is not finite \(nan\)"):
        _cuda_layer.check()
    with pytest.raises(RuntimeError, match="an earlier call failed"):
        mok.moe(p.x[rank].to(dev), p.topk_idx[rank].to(dev), p.topk_w[rank].to(dev), *weights, group=group)
    mok.clear_workspace_cache()
    dist.barrier()


def check_graph_replays(rank: int, size: int) -> None:
    """Forward and backward captured into one CUDA graph on every rank (after a warm-up call) and
    replayed on new inputs: each replay equals an eager call bit for bit. The calls count their
    epochs on the device, so the ranks' replays meet at their barriers like new calls."""
    from mok import _cuda_layer

    case = CASES[0]
    dev = torch.device("cuda", torch.cuda.current_device())
    El = td.make_problem(case, size, seed=21).weights[0].shape[0] // size

    def local(q: td.GlobalProblem) -> list[torch.Tensor]:  # this rank's inputs, in `static` order
        mine = slice(rank * El, (rank + 1) * El)
        return [q.x[rank].to(dev), q.topk_idx[rank].to(dev), q.topk_w[rank].to(dev),
                *(t[mine].to(dev, torch.bfloat16).contiguous() for t in q.weights),
                *(t.to(dev, torch.bfloat16) for t in q.shared), q.dy[rank].to(dev)]

    static = [t.clone() for t in local(td.make_problem(case, size, seed=21))]
    x, idx, w, wg, wu, wd, sg, su, sd, dy = static
    leaves = [t.requires_grad_() for t in (x, w, wg, wu, wd, sg, su, sd)]

    def step() -> list[torch.Tensor]:
        y = mok.moe(x, idx, w, wg, wu, wd, (sg, su, sd), swiglu_limit=case.limit, group=dist.group.WORLD)
        return [y.detach()] + list(torch.autograd.grad(y, leaves, dy))

    graph, captured = testing.capture_after_warm_up(step)
    names = NAMES + SHARED
    for seed in (22, 23):
        q = td.make_problem(case, size, seed=seed)
        with torch.no_grad():
            for dst, src in zip(static, local(q)):
                dst.copy_(src)
        for out in captured:
            out.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
        _cuda_layer.check()
        eager = run_layer(case, q, dist.group.WORLD, rank, size)
        for name, got in zip(names, captured):
            assert torch.equal(got, eager[name]), f"rank {rank}, seed {seed}: {name} of the replay differs from eager"
    dist.barrier()


def worker(rank: int, size: int, init_file: str, result_dir: str) -> None:
    with td.rank_report(rank, result_dir):
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", rank))
        for case in CASES:
            check_case(case, rank, size)
        check_graph_replays(rank, size)
        check_non_finite_on_one_rank(rank, size)
        dist.barrier()


def test_expert_parallel_on_two_gpus() -> None:
    td.spawn_ranks(worker, 2, timeout_s=240)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 or more GPUs (nvidia-h200-x4 / -x8)")
def test_expert_parallel_on_every_gpu() -> None:
    """The same cases with one rank per GPU of the machine (4 or 8)."""
    td.spawn_ranks(worker, torch.cuda.device_count(), timeout_s=400)
