"""The layer on one process (no expert-parallel group): forward and every gradient.

Tolerance policy (STYLE.md 8): against an fp64 evaluation of the same bf16 inputs (``mok.testing``),
y within 1e-2 relative error (the bf16 bound of ``include/mok/core/compare.h``) and every gradient
within 2x the error of the same layer computed in plain torch at bf16 (``mok.testing`` with
``compute_dtype=bfloat16``). Against the C++ reference (``mok._C.reference_layer``), and between
reruns and between the API's entry points: bitwise.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import mok  # noqa: E402
from mok import _C, testing  # noqa: E402

GRAD_NAMES = ("d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_s_gate", "d_s_up", "d_s_down")


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    experts: int
    hidden: int
    intermediate: int
    topk: int
    shared: int = 0
    limit: float | None = None
    routing: str = "uniform"
    seed: int = 0

    def problem(self) -> testing.MoeProblem:
        return testing.random_problem(self.tokens, self.experts, self.hidden, self.intermediate, self.topk,
                                      shared_intermediate=self.shared, swiglu_limit=self.limit,
                                      routing=self.routing, seed=self.seed)

    def output_grad(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + 100)
        return torch.randn(self.tokens, self.hidden, generator=g).bfloat16()


# The adversarial shapes of the foundation issue, plus seeded random ones.
CASES = [
    Case("basic", 16, 8, 32, 24, 2),
    Case("shared_expert_zipf", 12, 4, 24, 16, 2, shared=16, routing="zipf"),
    Case("one_token", 1, 4, 16, 8, 2, shared=8),
    Case("sizes_off_every_tile", 37, 6, 19, 13, 3, shared=7),
    Case("top1", 10, 5, 16, 8, 1),
    Case("every_token_to_one_expert_set", 9, 8, 16, 8, 2, routing="all_to_one"),
    Case("every_token_to_expert_0", 8, 4, 16, 8, 1, shared=4, routing="all_to_one"),
    Case("mostly_empty_experts", 3, 16, 16, 8, 2),
    Case("clamped_swiglu", 20, 4, 16, 12, 2, shared=8, limit=0.5),
    Case("duplicate_ids", 8, 4, 16, 8, 3, routing="duplicates"),
    Case("empty_slots", 21, 6, 16, 8, 3, shared=8, routing="masked"),
    Case("topk_above_experts", 7, 3, 16, 8, 5, routing="duplicates"),
    Case("topk_equals_experts", 6, 3, 16, 8, 3),
    Case("no_tokens", 0, 4, 16, 8, 2, shared=8),
] + [
    Case(f"random_T{t}_E{e}_H{h}_I{i}_k{min(k, e)}_Is{s}", int(t), int(e), int(h), int(i), int(min(k, e)),
         shared=int(s), seed=seed)
    for seed, (t, e, h, i, k, s) in enumerate(
        np.random.default_rng(2024).integers([1, 1, 1, 1, 1, 0], [40, 9, 40, 30, 5, 20], size=(4, 6)), start=10)
]


def describe_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    a, e = actual.detach().double(), expected.detach().double()
    diff = (a - e).abs()
    if diff.numel() == 0:
        return "empty"
    worst = np.unravel_index(int(torch.nan_to_num(diff, nan=float("inf")).argmax()), tuple(diff.shape))
    return f"worst at {tuple(int(i) for i in worst)}: {float(a[worst])} vs {float(e[worst])}"


def assert_bitwise(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    a, e = actual.detach(), expected.detach()
    if a.dtype != e.dtype:
        a, e = a.double(), e.double()
    same = (a == e) | (a.isnan() & e.isnan())
    if not bool(same.all()):
        first = tuple(int(i) for i in (~same).nonzero()[0])
        raise AssertionError(f"{what}: not bitwise equal; first difference at {first}: "
                             f"{float(a[first])} vs {float(e[first])}")


def run_autograd(case: Case, p: testing.MoeProblem, dy: torch.Tensor, weight_dtype: torch.dtype = torch.float32,
                 save_context: bool = True, x: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
    """y and every gradient through mok.moe (autograd), weights held in weight_dtype."""
    x = (p.x if x is None else x).detach().clone().requires_grad_()
    topk_w = p.topk_w.clone().requires_grad_()
    weights = [w.to(weight_dtype).requires_grad_() for w in (p.w_gate, p.w_up, p.w_down)]
    shared = [w.to(weight_dtype).requires_grad_() for w in p.shared] if p.shared else None
    y = mok.moe(x, p.topk_idx, topk_w, *weights, tuple(shared) if shared else None, swiglu_limit=case.limit,
                save_context=save_context)
    y.backward(dy)
    grads = [x.grad, topk_w.grad, *(w.grad for w in weights)] + ([w.grad for w in shared] if shared else [None] * 3)
    return {"y": y, **dict(zip(GRAD_NAMES, grads))}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_torch_reference(case: Case) -> None:
    p, dy = case.problem(), case.output_grad()
    ours = run_autograd(case, p, dy)
    kwargs = dict(shared=p.shared, swiglu_limit=case.limit)
    oracle = testing.moe_reference_grads(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, dy,
                                         compute_dtype=torch.float64, **kwargs)
    plain = testing.moe_reference_grads(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, dy,
                                        compute_dtype=torch.bfloat16, **kwargs)

    def fields(g: testing.MoeGrads) -> dict[str, torch.Tensor | None]:
        shared = g.d_shared if g.d_shared is not None else (None, None, None)
        return dict(zip(("y",) + GRAD_NAMES, (g.y, g.d_x, g.d_topk_w, g.d_w_gate, g.d_w_up, g.d_w_down, *shared)))

    expected, baseline = fields(oracle), fields(plain)
    assert ours["y"].dtype == torch.bfloat16 and ours["d_x"].dtype == torch.bfloat16
    for name, value in ours.items():
        if expected[name] is None:
            assert value is None, name
            continue
        err = testing.relative_error(value, expected[name])
        bound = 1e-2 if name == "y" else 2 * testing.relative_error(baseline[name], expected[name])
        assert err <= bound, (f"{case}: {name} rel error {err:.3e} > bound {bound:.3e}; "
                              f"{describe_mismatch(value, expected[name])}")


def reference_layer(case: Case, p: testing.MoeProblem, dy: torch.Tensor) -> dict[str, np.ndarray]:
    f32 = lambda t: t.float().contiguous().numpy()  # noqa: E731
    desc = _C.MoeDesc(tokens_per_rank=case.tokens, hidden=case.hidden, intermediate=case.intermediate,
                      num_experts=case.experts, topk=case.topk, ranks=1, shared_intermediate=case.shared,
                      swiglu_limit=case.limit)
    shared = [f32(w) for w in p.shared] if p.shared else [None] * 3
    out = _C.reference_layer(desc, [f32(p.x)], [p.topk_idx.int().contiguous().numpy()], [f32(p.topk_w)],
                             f32(p.w_gate), f32(p.w_up), f32(p.w_down), *shared, [f32(dy)])
    return {"y": out["y"][0], "d_x": out["dx"][0], "d_topk_w": out["d_topk_w"][0], "d_w_gate": out["d_gate"],
            "d_w_up": out["d_up"], "d_w_down": out["d_down"],
            **({"d_s_gate": out["d_shared_gate"][0], "d_s_up": out["d_shared_up"][0],
                "d_s_down": out["d_shared_down"][0]} if p.shared else {})}


@pytest.mark.parametrize("case", CASES[:14], ids=lambda c: c.name)
def test_bitwise_equal_to_cpp_reference(case: Case) -> None:
    p, dy = case.problem(), case.output_grad()
    ours = run_autograd(case, p, dy)
    for name, ref in reference_layer(case, p, dy).items():
        value = ours[name]
        assert value is not None
        assert_bitwise(f"{case.name} {name}", value.float().reshape(-1), torch.from_numpy(ref))


def test_reruns_and_entry_points_are_bitwise_identical() -> None:
    """Autograd with and without a saved context, the explicit passes and a rerun: the same bits."""
    case = Case("determinism", 23, 6, 20, 12, 2, shared=10, limit=1.0, routing="zipf", seed=3)
    p, dy = case.problem(), case.output_grad()
    first = run_autograd(case, p, dy)
    again = run_autograd(case, p, dy)
    recomputed = run_autograd(case, p, dy, save_context=False)

    ws = mok.get_workspace(None, None, device="cpu", num_local_tokens=case.tokens, hidden=case.hidden,
                           intermediate=case.intermediate, num_experts=case.experts, topk=case.topk,
                           shared_intermediate=case.shared, swiglu_limit=case.limit)
    weights = [w.float() for w in (p.w_gate, p.w_up, p.w_down)]
    shared = tuple(w.float() for w in p.shared)
    schedule = mok.build_schedule(ws, p.topk_idx)
    y, ctx = mok.forward(ws, schedule, p.x, p.topk_w, *weights, shared)
    rebuilt = mok.recompute_forward_context(ws, schedule, p.x, *weights, shared)
    for name, a, b in zip(ctx._fields, ctx, rebuilt):
        assert_bitwise(f"recomputed context {name}", a, b)
    grads = mok.backward(ws, schedule, ctx, dy, p.x, p.topk_w, *weights, shared)
    explicit = {"y": y, **grads._asdict()}
    for other_name, other in (("rerun", again), ("save_context=False", recomputed), ("explicit passes", explicit)):
        for name, value in first.items():
            assert value is not None and other[name] is not None
            assert_bitwise(f"{other_name} {name}", other[name], value)


def test_weight_dtypes() -> None:
    """bf16 weights give bf16 gradients: the fp32 ones rounded; the forward is the same either way."""
    case = Case("bf16_weights", 11, 4, 16, 8, 2, shared=8, seed=4)
    p, dy = case.problem(), case.output_grad()
    fp32 = run_autograd(case, p, dy, torch.float32)
    bf16 = run_autograd(case, p, dy, torch.bfloat16)
    for name in ("y", "d_x", "d_topk_w"):
        assert_bitwise(name, bf16[name], fp32[name])
    for name in GRAD_NAMES[2:]:
        assert bf16[name].dtype == torch.bfloat16
        assert_bitwise(name, bf16[name], fp32[name].bfloat16())


def test_strided_activations_are_accepted() -> None:
    case = Case("strided", 9, 4, 16, 8, 2, seed=6)
    p, dy = case.problem(), case.output_grad()
    wide = torch.zeros(case.tokens, 2 * case.hidden, dtype=torch.bfloat16)
    wide[:, ::2] = p.x
    x_view = wide[:, ::2]
    assert not x_view.is_contiguous()
    idx_view = p.topk_idx.t().contiguous().t()
    w_view = p.topk_w.t().contiguous().t()
    assert not idx_view.is_contiguous() and not w_view.is_contiguous()
    expected = run_autograd(case, p, dy)
    x = x_view.detach().requires_grad_()
    weights = [w.float().requires_grad_() for w in (p.w_gate, p.w_up, p.w_down)]
    y = mok.moe(x, idx_view, w_view, *weights)
    assert_bitwise("y", y, expected["y"])
    y.backward(dy.t().contiguous().t())
    assert_bitwise("d_x", x.grad, expected["d_x"])


def test_int32_and_int64_routing_agree() -> None:
    case = Case("index_dtype", 7, 4, 16, 8, 2, seed=8)
    p = case.problem()
    weights = [w.float() for w in (p.w_gate, p.w_up, p.w_down)]
    y64 = mok.moe(p.x, p.topk_idx.long(), p.topk_w, *weights)
    y32 = mok.moe(p.x, p.topk_idx.int(), p.topk_w, *weights)
    assert_bitwise("y", y32, y64)


def test_workspace_plan_and_cache() -> None:
    kwargs = dict(device="cpu", num_local_tokens=64, hidden=32, intermediate=16, num_experts=8, topk=2)
    ws = mok.get_workspace(None, None, **kwargs)
    assert mok.get_workspace(None, None, **kwargs) is ws
    assert mok.create_workspace(None, None, **kwargs) is not ws
    assert (ws.ranks, ws.num_experts, ws.local_experts, ws.first_expert) == (1, 8, 8, 0)
    assert "minibatch" in ws.explanation and ws.plan["workspace_bytes"]["total"] > 0
    assert ws.buffers == {}  # the CPU backend exchanges through torch.distributed
    custom = mok.get_workspace(mok.MoeConfig(minibatch_rows=256, ring_rows=512), None, **kwargs)
    assert custom is not ws and (custom.plan["minibatch_rows"], custom.plan["ring_rows"]) == (256, 512)
    mok.clear_workspace_cache()
    assert mok.get_workspace(None, None, **kwargs) is not ws
    schedule = mok.build_schedule(ws, torch.zeros(64, 2, dtype=torch.int64))
    assert schedule.num_rows == 128 and schedule.tokens_per_expert.tolist() == [128] + [0] * 7


@pytest.mark.parametrize("save_context", [True, False])
def test_activation_checkpointing_gives_the_same_bits(save_context: bool) -> None:
    """The layer inside torch.utils.checkpoint (non-reentrant and reentrant) and under save_on_cpu
    gives the plain call's y and gradients bit for bit (the GPU twin: test_cuda_layer.py)."""
    p = testing.random_problem(64, 8, 32, 16, 2, shared_intermediate=16, routing="zipf", seed=5)
    dy = torch.randn(64, 32, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)

    def run(mode: str) -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_(True) for t in (p.x, p.topk_w, p.w_gate, p.w_up, p.w_down)]
        shared = [t.detach().clone().requires_grad_(True) for t in p.shared]

        def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return mok.moe(x, p.topk_idx, w, *leaves[2:], shared, save_context=save_context)

        y = testing.forward_with_saved_tensors(mode, layer, leaves[0], leaves[1])
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves + shared]

    plain = run("plain")
    for mode in testing.SAVED_TENSOR_MODES[1:]:
        for i, (a, b) in enumerate(zip(plain, run(mode))):
            assert b is not None and torch.equal(a, b), f"{mode}: output {i} differs from the plain call's"
