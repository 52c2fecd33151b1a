"""Expert parallelism on the CPU path: R = 1, 2, 3, 4 processes over gloo.

Every rank's output and gradients are bitwise those of the C++ reference run in one process over R
emulated ranks (``mok._C.reference_layer``), and bitwise those of the same global batch on one rank
(the layer does not depend on R). Bad input on one rank raises on every rank, naming that rank, and
the group stays usable. Subgroups, the module, the explicit passes and torch.compile run under a group.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import mok  # noqa: E402
from mok import _C, testing  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    experts_per_rank: int
    hidden: int
    intermediate: int
    topk: int
    shared: int = 0
    limit: float | None = None
    routing: str = "uniform"
    save_context: bool = True
    precision: str = "bf16"  # "fp8", "fp8_dgrad": the GPU suites' cases only (the CPU layer is bf16)


CASES = [
    Case("uniform_shared", 9, 2, 24, 12, 2, shared=8),
    Case("one_expert_per_rank_top1", 7, 1, 16, 8, 1),
    Case("all_tokens_to_rank0", 6, 2, 16, 8, 2, routing="all_to_one"),
    Case("empty_slots_shared", 11, 2, 16, 8, 3, shared=4, routing="masked"),
    Case("clamped_recomputed", 8, 2, 16, 12, 2, shared=4, limit=0.5, save_context=False),
    Case("one_token_odd_sizes", 1, 3, 17, 5, 3, shared=3),
    Case("no_tokens", 0, 2, 16, 8, 2, shared=4),
]


@dataclass
class GlobalProblem:
    """Every rank's inputs and the global weights: built identically on every process from the seed."""

    x: list[torch.Tensor]
    topk_idx: list[torch.Tensor]
    topk_w: list[torch.Tensor]
    dy: list[torch.Tensor]
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # all E experts, fp32 holding bf16 values
    shared: tuple[torch.Tensor, ...] | None


def make_problem(case: Case, ranks: int, seed: int = 0) -> GlobalProblem:
    g = torch.Generator().manual_seed(seed)
    E = case.experts_per_rank * ranks
    k = min(case.topk, E)
    x = [torch.randn(case.tokens, case.hidden, generator=g).bfloat16() for _ in range(ranks)]
    idx = [testing.make_routing(case.routing, case.tokens, E, k, generator=g) for _ in range(ranks)]
    w = [testing.random_topk_weights(case.tokens, k, generator=g) for _ in range(ranks)]
    dy = [torch.randn(case.tokens, case.hidden, generator=g).bfloat16() for _ in range(ranks)]
    weights = tuple(t.float() for t in testing.random_expert_weights(E, case.hidden, case.intermediate, generator=g))
    shared = None
    if case.shared:
        shared = tuple(t.float() for t in testing.random_shared_weights(case.hidden, case.shared, generator=g))
    return GlobalProblem(x, idx, w, dy, weights, shared)  # type: ignore[arg-type]


def reference(case: Case, p: GlobalProblem, ranks: int) -> dict[str, Any]:
    """The C++ reference over `ranks` emulated ranks (ranks=1: the whole batch as one rank's)."""
    f32 = lambda t: t.float().contiguous().numpy()  # noqa: E731
    R = len(p.x)
    group = R // ranks
    cat = lambda ts, r: torch.cat(ts[r * group:(r + 1) * group])  # noqa: E731
    x = [cat(p.x, r) for r in range(ranks)]
    desc = _C.MoeDesc(tokens_per_rank=x[0].shape[0], hidden=case.hidden, intermediate=case.intermediate,
                      num_experts=p.weights[0].shape[0], topk=p.topk_idx[0].shape[1], ranks=ranks,
                      shared_intermediate=case.shared, swiglu_limit=case.limit, precision=case.precision)
    shared = [f32(t) for t in p.shared] if p.shared else [None] * 3
    return _C.reference_layer(desc, [f32(t) for t in x], [cat(p.topk_idx, r).int().contiguous().numpy()
                                                          for r in range(ranks)],
                              [f32(cat(p.topk_w, r)) for r in range(ranks)], *(f32(w) for w in p.weights), *shared,
                              [f32(cat(p.dy, r)) for r in range(ranks)])


WEIGHT_GRADS = ("d_gate", "d_up", "d_down")


def reference_part(ref: dict[str, Any], p: GlobalProblem, name: str, rank: int, size: int) -> np.ndarray:
    """Rank ``rank`` of ``size``'s part of a reference output (from :func:`reference` over ``size``
    ranks): its tokens' y, dx, d topk_w or shared-expert gradient, or its experts' rows of a routed
    weight gradient (the reference's are global)."""
    if name not in WEIGHT_GRADS:
        return ref[name][rank]
    El = p.weights[0].shape[0] // size
    return ref[name].reshape(p.weights[WEIGHT_GRADS.index(name)].shape)[rank * El:(rank + 1) * El]


def assert_bitwise(what: str, actual: torch.Tensor, expected: np.ndarray) -> None:
    a = actual.detach().float().reshape(-1)
    e = torch.from_numpy(np.ascontiguousarray(expected)).reshape(-1)
    assert a.shape == e.shape, f"{what}: {tuple(a.shape)} vs {tuple(e.shape)}"
    diff = a != e
    if bool(diff.any()):
        i = int(diff.nonzero()[0])
        raise AssertionError(f"{what}: not bitwise equal; first difference at flat index {i}: "
                             f"{float(a[i])} vs {float(e[i])}")


def run_layer(case: Case, p: GlobalProblem, group: dist.ProcessGroup | None, rank: int, size: int) -> dict[str, Any]:
    """This rank's y and gradients through mok.moe over `group` (rank/size within it)."""
    El = p.weights[0].shape[0] // size
    mine = slice(rank * El, (rank + 1) * El)
    x = p.x[rank].clone().requires_grad_()
    w = p.topk_w[rank].clone().requires_grad_()
    weights = [t[mine].clone().requires_grad_() for t in p.weights]
    shared = [t.clone().requires_grad_() for t in p.shared] if p.shared else None
    y = mok.moe(x, p.topk_idx[rank], w, *weights, tuple(shared) if shared else None, swiglu_limit=case.limit,
                group=group, save_context=case.save_context)
    y.backward(p.dy[rank])
    out = {"y": y, "dx": x.grad, "d_topk_w": w.grad, "d_gate": weights[0].grad, "d_up": weights[1].grad,
           "d_down": weights[2].grad}
    if shared:
        out.update(d_shared_gate=shared[0].grad, d_shared_up=shared[1].grad, d_shared_down=shared[2].grad)
    return out


def check_against_references(case: Case, p: GlobalProblem, ours: dict[str, Any], rank: int, size: int,
                             label: str) -> None:
    T = case.tokens
    for ranks in (size, 1):  # R emulated ranks, and the whole batch on one rank
        ref = reference(case, p, ranks)
        where = f"{label} case {case.name}, rank {rank} of {size}, reference over {ranks} rank(s)"
        for name, width in (("y", case.hidden), ("dx", case.hidden), ("d_topk_w", p.topk_idx[0].shape[1])):
            # One emulated rank holds every rank's tokens, in rank order.
            expected = ref[name][rank] if ranks == size else ref[name][0][rank * T * width:(rank + 1) * T * width]
            assert_bitwise(f"{where}: {name}", ours[name], expected)
        for name in WEIGHT_GRADS:
            assert_bitwise(f"{where}: {name}", ours[name], reference_part(ref, p, name, rank, size))
        if case.shared and ranks == size:  # the shared expert's gradient is this rank's own tokens' part
            for name in ("d_shared_gate", "d_shared_up", "d_shared_down"):
                assert_bitwise(f"{where}: {name}", ours[name], ref[name][rank])


def expect_error(what: str, error: type, message: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except error as e:
        assert message in str(e), f"{what}: {type(e).__name__} {e!r} does not mention {message!r}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{what}: expected {error.__name__} mentioning {message!r}, got {type(e).__name__}: {e}")
    raise AssertionError(f"{what}: expected {error.__name__} mentioning {message!r}, nothing was raised")


def check_bad_input_raises_everywhere(rank: int, size: int) -> None:
    """One rank's bad input: every rank raises (the culprit its own error, the others naming it)."""
    case = Case("errors", 4, 2, 16, 8, 2)
    p = make_problem(case, size, seed=7)
    world = dist.group.WORLD
    last = size - 1
    El = 2

    def call(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, weights: list[torch.Tensor]) -> Any:
        return mok.moe(x, idx, w, *weights, group=world)

    weights = [t[rank * El:(rank + 1) * El] for t in p.weights]
    x, idx, w = p.x[rank], p.topk_idx[rank], p.topk_w[rank]

    bad_idx = idx.clone()
    if rank == last:
        bad_idx[1, 1] = 2 * size
    msg = (f"topk_idx[1, 1] = {2 * size} is not an expert id" if rank == last
           else f"rank {last} of the expert-parallel group rejected its inputs: topk_idx[1, 1]")
    expect_error("expert id out of range on one rank", ValueError, msg, lambda: call(x, bad_idx, w, weights))

    bad_x = x.float() if rank == last else x
    msg = "x must be bfloat16" if rank == last else f"rank {last} of the expert-parallel group rejected its inputs"
    expect_error("wrong dtype on one rank", TypeError, msg, lambda: call(bad_x, idx, w, weights))

    if size > 1:
        short = slice(0, 3 if rank == last else 4)
        expect_error("different T on one rank", ValueError, "disagree on tokens per rank (T)",
                     lambda: call(x[short], idx[short], w[short], weights))
        wide = [torch.cat([t, t], dim=1).contiguous() if rank == last else t for t in weights[:2]] + [weights[2]]
        if rank == last:
            wide[2] = torch.cat([weights[2], weights[2]], dim=2).contiguous()
        expect_error("different I on one rank", ValueError, "disagree on intermediate (I)",
                     lambda: call(x, idx, w, wide))
        kwargs = dict(device="cpu", num_local_tokens=4, hidden=16, num_experts=2 * size, topk=2)
        expect_error("different workspace on one rank", ValueError, "disagree on intermediate",
                     lambda: mok.get_workspace(None, world, intermediate=8 + (rank == last), **kwargs))
    # The group is still usable: a good call completes on every rank.
    call(x, idx, w, weights)


def check_explicit_passes_and_module(rank: int, size: int) -> None:
    """The explicit passes and mok.MoE under the group give the autograd path's bits."""
    case = Case("explicit", 5, 2, 16, 8, 2, shared=4)
    p = make_problem(case, size, seed=3)
    world = dist.group.WORLD
    ours = run_layer(case, p, world, rank, size)
    ws = mok.get_workspace(None, world, device="cpu", num_local_tokens=5, hidden=16, intermediate=8,
                           num_experts=2 * size, topk=2, shared_intermediate=4)
    assert (ws.ranks, ws.rank, ws.first_expert) == (size, rank, 2 * rank)
    mine = [t[2 * rank:2 * rank + 2] for t in p.weights]
    schedule = mok.build_schedule(ws, p.topk_idx[rank])
    y, ctx = mok.forward(ws, schedule, p.x[rank], p.topk_w[rank], *mine, p.shared)
    again = mok.recompute_forward_context(ws, schedule, p.x[rank], *mine, p.shared)
    for a, b in zip(ctx, again):
        assert torch.equal(a, b)
    grads = mok.backward(ws, schedule, ctx, p.dy[rank], p.x[rank], p.topk_w[rank], *mine, p.shared)
    for name, value in (("y", y), ("dx", grads.d_x), ("d_topk_w", grads.d_topk_w), ("d_gate", grads.d_w_gate),
                        ("d_shared_down", grads.d_s_down)):
        assert torch.equal(value, ours[name]), f"explicit passes, rank {rank}: {name}"

    m = mok.MoE(2 * size, 16, 8, 2, shared_intermediate=4, group=world)
    assert (m.local_experts, m.first_expert) == (2, 2 * rank)
    with torch.no_grad():
        for param, full in zip((m.w_gate, m.w_up, m.w_down), p.weights):
            param.copy_(full[2 * rank:2 * rank + 2])
        for param, full in zip((m.shared_gate, m.shared_up, m.shared_down), p.shared or ()):
            param.copy_(full)
    y_module = m(p.x[rank], p.topk_idx[rank], p.topk_w[rank])
    assert torch.equal(y_module, ours["y"])
    y_module.backward(p.dy[rank])
    assert torch.equal(m.w_down.grad, ours["d_down"])

    # The same layer swapped in from a model's per-expert modules: this rank takes its experts.
    def linear(weight: torch.Tensor) -> torch.nn.Linear:
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            layer.weight.copy_(weight)
        return layer

    def expert(g: torch.Tensor, u: torch.Tensor, d: torch.Tensor) -> torch.nn.Module:
        return torch.nn.ModuleDict({"gate_proj": linear(g), "up_proj": linear(u), "down_proj": linear(d)})

    experts = [expert(*(w[e] for w in p.weights)) for e in range(2 * size)]
    swapped = mok.MoE.from_experts(experts, 2, shared_expert=expert(*p.shared), group=world, dtype=torch.float32)
    assert (swapped.local_experts, swapped.first_expert) == (2, 2 * rank)
    assert torch.equal(swapped(p.x[rank], p.topk_idx[rank], p.topk_w[rank]), ours["y"])


def check_agreement_on_words(rank: int, size: int) -> None:
    """The GPU workspace's agreement carries the precision as a word: equal words pass, different
    ones are named (the CPU path never sends a word, so this is its only test without GPUs)."""
    from mok import _dist

    ep = _dist.resolve(dist.group.WORLD.group_name)
    _dist.agree(ep, "cuda_workspace", lambda: {"MoeConfig precision": "fp8_dgrad", "swiglu_limit": None})
    if size > 1:
        expect_error("different precisions", ValueError, "disagree on MoeConfig precision (rank 0: 'bf16', rank 1: 'fp8'",
                     lambda: _dist.agree(ep, "cuda_workspace",
                                         lambda: {"MoeConfig precision": "bf16" if rank == 0 else "fp8"}))


def check_subgroups(rank: int, size: int) -> None:
    """Two EP subgroups of 2 ranks ({0,2} and {1,3}), each its own layer: each equals its reference."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    sub_rank, sub_size = dist.get_rank(mine), dist.get_world_size(mine)
    assert sub_size == 2
    case = Case("subgroup", 6, 2, 16, 8, 2, shared=4)
    p = make_problem(case, sub_size, seed=10 + rank % 2)
    ours = run_layer(case, p, mine, sub_rank, sub_size)
    check_against_references(case, p, ours, sub_rank, sub_size, f"subgroup {rank % 2}")
    m = mok.MoE(4, 16, 8, 2, router="softmax", group=mine)
    y = m(torch.randn(3, 16))
    y.sum().backward()
    assert m.w_gate.grad is not None and f"rank {sub_rank} of 2" in repr(m)


def check_compile(rank: int, size: int) -> None:
    case = Case("compile", 5, 2, 16, 8, 2)
    p = make_problem(case, size, seed=5)
    weights = [t[2 * rank:2 * rank + 2] for t in p.weights]
    world = dist.group.WORLD

    def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return mok.moe(x, p.topk_idx[rank], w, *weights, group=world)

    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(p.x[rank], p.topk_w[rank]), layer(p.x[rank], p.topk_w[rank]))


@contextlib.contextmanager
def rank_report(rank: int, result_dir: str) -> Iterator[None]:
    """The body of a spawned rank: a rank that dies in native code still says where (its Python stack
    goes to rank<r>.err, and so does the traceback of an exception), and its process group is
    destroyed at the end (nothing may hold it past its destruction: an abort at exit otherwise)."""
    fault_log = open(Path(result_dir, f"rank{rank}.err"), "w")  # noqa: SIM115  (open until the process ends)
    faulthandler.enable(fault_log)
    try:
        yield
    except BaseException:
        fault_log.write(traceback.format_exc())
        fault_log.flush()
        raise
    finally:
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(worker: Callable[..., None], size: int, *args: Any, timeout_s: float = 240) -> None:
    """Runs ``worker(rank, size, init_file, result_dir, *args)`` in `size` spawned processes and
    fails naming the ranks' errors (from :func:`rank_report`) if one fails or they hang."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(worker, args=(size, init_file, tmp, *args), nprocs=size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise AssertionError(f"R={size}: the ranks did not finish within {timeout_s} s (a hang?)")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            errors = "\n".join(f"--- {f}:\n{Path(tmp, f).read_text()}" for f in sorted(os.listdir(tmp))
                               if f.endswith(".err"))
            raise AssertionError(f"R={size}: a rank failed ({e}):\n{errors}") from None
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.terminate()


def worker(rank: int, size: int, init_file: str, result_dir: str, with_compile: bool) -> None:
    with rank_report(rank, result_dir):
        torch.set_num_threads(1)
        _C.set_cpu_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60))
        world = dist.group.WORLD
        for case in CASES:
            p = make_problem(case, size)
            ours = run_layer(case, p, world, rank, size)
            check_against_references(case, p, ours, rank, size, "world")
        check_bad_input_raises_everywhere(rank, size)
        check_agreement_on_words(rank, size)
        check_explicit_passes_and_module(rank, size)
        if size == 4:
            check_subgroups(rank, size)
        if with_compile:
            check_compile(rank, size)
            torch._dynamo.reset()  # compiled code holds the process group: let it go before destroying it
        dist.barrier()


def run_ranks(size: int, with_compile: bool = False, timeout_s: float = 240) -> None:
    spawn_ranks(worker, size, with_compile, timeout_s=timeout_s)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_expert_parallel_over_gloo(size: int) -> None:
    run_ranks(size, with_compile=size == 2)
