"""The pure-torch reference in ``mok.testing`` against a naive per-token fp64 loop (CPU, seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from mok import testing  # noqa: E402  (path set above; mok.testing imports no compiled code)


def naive_layer(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: testing.SharedWeights | None,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """The layer's definition written out token by token, slot by slot, in fp64 (differentiable)."""

    def act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if swiglu_limit is not None:
            g = torch.clamp(g, max=swiglu_limit)
            u = torch.clamp(u, -swiglu_limit, swiglu_limit)
        return g * torch.sigmoid(g) * u

    def d(t: torch.Tensor) -> torch.Tensor:
        return t.double()

    rows = []
    for t in range(x.shape[0]):
        xt = d(x[t])
        yt = torch.zeros_like(xt)
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[t, j])
            h = act(d(w_gate[e]) @ xt, d(w_up[e]) @ xt)
            yt = yt + d(topk_w[t, j]) * (d(w_down[e]) @ h)
        if shared is not None:
            s_gate, s_up, s_down = (d(w) for w in shared)
            yt = yt + s_down @ act(s_gate @ xt, s_up @ xt)
        rows.append(yt)
    if not rows:
        return torch.zeros(0, x.shape[1], dtype=torch.float64)
    return torch.stack(rows)


CASES = [
    # (name, T, E, H, I, k, shared_I, swiglu_limit, routing)
    ("base", 7, 6, 16, 12, 2, 8, None, "uniform"),
    ("one_token", 1, 4, 16, 8, 2, 8, None, "uniform"),
    ("top1", 9, 5, 16, 8, 1, 0, None, "uniform"),
    ("clamped", 8, 4, 16, 8, 3, 8, 0.4, "uniform"),
    ("no_shared", 6, 4, 8, 8, 2, 0, None, "balanced"),
    ("duplicates", 7, 4, 8, 8, 3, 4, None, "duplicates"),
    ("all_to_one", 5, 6, 8, 8, 2, 0, 0.5, "all_to_one"),
    ("zipf", 10, 8, 8, 8, 3, 0, None, "zipf"),
    ("no_tokens", 0, 4, 8, 8, 2, 4, None, "uniform"),
]


def make_problem(T: int, E: int, H: int, I: int, k: int, shared_I: int, limit: float | None, routing: str, seed: int = 0):
    p = testing.random_problem(
        T, E, H, I, k, shared_intermediate=shared_I, swiglu_limit=limit, routing=routing, seed=seed
    )
    # Scale x up so that some gate/up values cross a small clamp limit.
    p.x = (p.x.float() * 2).to(torch.bfloat16)
    return p


def leaves(p: testing.MoeProblem, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    tensors = [p.x, p.topk_w, p.w_gate, p.w_up, p.w_down] + (list(p.shared) if p.shared else [])
    return [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in tensors]


def call_reference(tensors: list[torch.Tensor], p: testing.MoeProblem, compute_dtype: torch.dtype) -> torch.Tensor:
    x, w, wg, wu, wd, *shared = tensors
    return testing.moe_reference(
        x, p.topk_idx, w, wg, wu, wd, shared=tuple(shared) if shared else None,
        swiglu_limit=p.swiglu_limit, compute_dtype=compute_dtype,
    )


def call_naive(tensors: list[torch.Tensor], p: testing.MoeProblem) -> torch.Tensor:
    x, w, wg, wu, wd, *shared = tensors
    return naive_layer(x, p.topk_idx, w, wg, wu, wd, tuple(shared) if shared else None, p.swiglu_limit)


def grads_of(out: torch.Tensor, tensors: list[torch.Tensor], d_y: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, tensors, d_y.to(out.dtype), allow_unused=True))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return testing.relative_error(a.double(), b.double())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_and_grads_match_naive_fp64(case):
    _, T, E, H, I, k, shared_I, limit, routing = case
    p = make_problem(T, E, H, I, k, shared_I, limit, routing)
    d_y = torch.randn(T, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    naive_in = leaves(p, torch.float64)
    naive_out = call_naive(naive_in, p)
    naive_grads = grads_of(naive_out, naive_in, d_y) if T > 0 else None

    # fp64 compute on fp64 inputs: same math, different order -> agree to rounding.
    ref64_in = leaves(p, torch.float64)
    ref64_out = call_reference(ref64_in, p, torch.float64)
    assert ref64_out.dtype == torch.float64
    assert ref64_out.shape == (T, H)
    assert rel(ref64_out, naive_out) < 1e-12 or T == 0

    # fp32 compute on the bf16 problem (the shipped default), output cast back to bf16.
    ref32_in = leaves(p)
    ref32_out = call_reference(ref32_in, p, torch.float32)
    assert ref32_out.dtype == torch.bfloat16
    if T == 0:
        return
    assert rel(ref32_out, naive_out) < 1e-2  # bf16 output rounding dominates

    ref64_grads = grads_of(ref64_out, ref64_in, d_y)
    ref32_grads = grads_of(ref32_out, ref32_in, d_y)
    names = ["x", "topk_w", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"]
    for name, g_naive, g64, g32 in zip(names, naive_grads, ref64_grads, ref32_grads):
        assert g64 is not None and g32 is not None, name
        assert g64.shape == g_naive.shape, name
        assert rel(g64, g_naive) < 1e-12, f"{name}: fp64 reference grad differs from naive"
        assert rel(g32, g_naive) < 1e-2, f"{name}: fp32 reference grad differs from naive"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_explicit_backward_matches_autograd(case):
    _, T, E, H, I, k, shared_I, limit, routing = case
    p = make_problem(T, E, H, I, k, shared_I, limit, routing, seed=3)
    d_y = torch.randn(T, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    tensors = leaves(p, torch.float64)
    out = call_reference(tensors, p, torch.float64)
    expected = grads_of(out, tensors, d_y) if T > 0 else [torch.zeros_like(t) for t in tensors]

    x, w, wg, wu, wd, *shared = (t.detach() for t in tensors)
    got = testing.moe_reference_grads(
        x, p.topk_idx, w, wg, wu, wd, d_y, shared=tuple(shared) if shared else None,
        swiglu_limit=limit, compute_dtype=torch.float64,
    )
    assert rel(got.y, out) < 1e-12 or T == 0
    got_list = [got.d_x, got.d_topk_w, got.d_w_gate, got.d_w_up, got.d_w_down] + (list(got.d_shared) if got.d_shared else [])
    for g, e in zip(got_list, expected):
        assert g.shape == e.shape
        assert rel(g, e) < 1e-12 or (T == 0 and float(g.abs().max(initial=0)) == 0)

    # Keeping the weight gradients of a few experts only: same values, in the requested order.
    kept = [E - 1, 0]
    some = testing.moe_reference_grads(
        x, p.topk_idx, w, wg, wu, wd, d_y, shared=tuple(shared) if shared else None,
        swiglu_limit=limit, compute_dtype=torch.float64, weight_grad_experts=kept,
    )
    assert torch.equal(some.d_w_gate, got.d_w_gate[kept]) and torch.equal(some.d_w_down, got.d_w_down[kept])
    assert torch.equal(some.d_x, got.d_x)


def test_gradcheck_fp64_tiny():
    p = testing.random_problem(3, 3, 4, 3, 2, shared_intermediate=2, swiglu_limit=0.7, routing="duplicates", seed=5)
    tensors = leaves(p, torch.float64)

    def fn(*ts: torch.Tensor) -> torch.Tensor:
        return call_reference(list(ts), p, torch.float64)

    assert torch.autograd.gradcheck(fn, tuple(tensors), eps=1e-6, atol=1e-7)


def test_ep_emulation_equals_single_rank_and_partials_sum():
    R, T, E, H, I, k = 2, 6, 4, 8, 8, 2
    El = E // R
    problems = [make_problem(T, E, H, I, k, 0, None, "uniform", seed=10 + r) for r in range(R)]
    # Rank r owns the global experts [r*El, (r+1)*El): slice one global expert table.
    global_w = problems[0]
    shared = testing.random_shared_weights(H, 4, generator=torch.Generator().manual_seed(7))
    per_rank = lambda w: [w[r * El : (r + 1) * El] for r in range(R)]  # noqa: E731
    ep_out = testing.moe_reference_ep(
        [p.x for p in problems], [p.topk_idx for p in problems], [p.topk_w for p in problems],
        per_rank(global_w.w_gate), per_rank(global_w.w_up), per_rank(global_w.w_down), shared=shared,
    )
    for r, p in enumerate(problems):
        single = testing.moe_reference(
            p.x, p.topk_idx, p.topk_w, global_w.w_gate, global_w.w_up, global_w.w_down, shared=shared
        )
        assert torch.equal(ep_out[r], single)
        # Sum of per-rank partial contributions (first_expert) + shared == full layer.
        partial = sum(
            testing.moe_reference(
                p.x, p.topk_idx, p.topk_w, global_w.w_gate[q * El : (q + 1) * El],
                global_w.w_up[q * El : (q + 1) * El], global_w.w_down[q * El : (q + 1) * El],
                first_expert=q * El,
            ).float()
            for q in range(R)
        )
        shared_part = testing.moe_reference(
            p.x, p.topk_idx, torch.zeros_like(p.topk_w), global_w.w_gate, global_w.w_up, global_w.w_down, shared=shared
        ).float()
        assert rel(partial + shared_part, single.float()) < 1e-2


def test_routings_have_the_promised_shape():
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    T, E, k = 256, 16, 4
    for name in testing.ROUTINGS:
        idx = testing.make_routing(name, T, E, k, generator=gen())
        assert idx.shape == (T, k) and idx.dtype == torch.int64, name
        assert int(idx.min()) >= (-1 if name == "masked" else 0) and int(idx.max()) < E, name
        assert torch.equal(idx, testing.make_routing(name, T, E, k, generator=gen())), f"{name} not seeded"
        if name != "duplicates":
            assert all(len({e for e in row if e >= 0}) == sum(e >= 0 for e in row) for row in idx.tolist()), \
                f"{name}: ids within a token must be distinct"

    counts = torch.bincount(testing.route_balanced(T, E, k, generator=gen()).reshape(-1), minlength=E)
    assert torch.all(counts == T * k // E)

    assert torch.equal(testing.route_all_to_one(T, E, k), torch.arange(k).expand(T, k))

    zipf_counts = torch.bincount(testing.route_zipf(4096, 64, 8, generator=gen()).reshape(-1), minlength=64)
    assert zipf_counts.max() > 3 * zipf_counts.float().mean(), "zipf routing should be visibly skewed"

    masked = testing.route_masked(T, E, k, generator=gen())
    empty = masked < 0
    assert bool(empty[4::5].all()) and 0.2 < float(empty[empty.sum(-1) < k].float().mean()) < 0.3

    dup = testing.route_with_duplicates(T, E, k, generator=gen())
    assert any(len(set(row)) < k for row in dup.tolist())

    w = testing.random_topk_weights(T, k, generator=gen())
    assert torch.allclose(w.sum(-1), torch.ones(T)) and bool((w > 0).all())


def test_zipf_popularity_is_shared_across_ranks():
    pop = testing.zipf_popularity(32, generator=torch.Generator().manual_seed(1))
    a = testing.route_zipf(512, 32, 4, popularity=pop, generator=torch.Generator().manual_seed(2))
    b = testing.route_zipf(512, 32, 4, popularity=pop, generator=torch.Generator().manual_seed(3))
    hot = int(pop.argmax())
    assert (a == hot).any(dim=1).float().mean() > 0.3 and (b == hot).any(dim=1).float().mean() > 0.3


def test_weights_keep_activations_order_one():
    p = testing.random_problem(256, 8, 256, 128, 2, shared_intermediate=64, routing="uniform")
    y = p.reference().float()
    assert 0.05 < float(y.std()) < 5.0


def test_bad_shapes_are_rejected():
    p = testing.random_problem(4, 4, 8, 4, 2)
    with pytest.raises(ValueError, match="w_down"):
        testing.moe_reference(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down.transpose(1, 2))
    with pytest.raises(ValueError, match="topk_w"):
        testing.moe_reference(p.x, p.topk_idx, p.topk_w[:, :1], p.w_gate, p.w_up, p.w_down)
    with pytest.raises(ValueError, match="distinct"):
        testing.route_balanced(4, 2, 3)


def test_relative_error_metric():
    a = torch.tensor([3.0, 4.0])
    assert testing.relative_error(a, a) == 0.0
    assert testing.relative_error(torch.zeros(2), a) == pytest.approx(1.0)
    assert testing.relative_error(torch.tensor([float("nan"), 0.0]), a) != testing.relative_error(a, a)
    assert testing.relative_error(a, a, chunk_elems=1) == 0.0
