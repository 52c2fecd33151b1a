"""Pure-torch reference of the MoK layer, and the seeded problem generators used by tests and `bench/`.

Nothing here imports a compiled extension: this module is the oracle that runs anywhere torch runs.

The layer, per rank ``r`` of ``R`` (expert-parallel group)::

    expert_e(x) = w_down[e] @ act(w_gate[e] @ x, w_up[e] @ x)
    act(g, u)   = silu(g) * u                                   (swiglu_limit is None)
                = silu(min(g, L)) * clamp(u, -L, L)             (swiglu_limit = L, gpt-oss style)
    y[t]        = shared(x[t]) + sum_j topk_w[t, j] * expert_{topk_idx[t, j]}(x[t])

Every (token, j) slot counts, duplicate expert ids within a token included. Experts are placed
contiguously: rank ``r`` owns global experts ``[r * El, (r + 1) * El)``.

Entry points:

- :func:`moe_reference` — differentiable single-rank reference (all experts in ``w_*``, or a contiguous
  slice of them via ``first_expert``: slots routed elsewhere contribute nothing).
- :func:`moe_reference_grads` — the same forward plus an explicit backward, one expert at a time,
  without an autograd graph, so it scales to benchmark shapes.
- :func:`moe_reference_ep` — R ranks emulated in one process (per-rank lists in, per-rank lists out).
- :func:`make_routing`, :func:`random_problem` — seeded routings (balanced, uniform, zipf, all-to-one,
  duplicates) and whole problems with O(1) activations.
- :func:`relative_error` — the tolerance metric ``||actual - expected|| / ||expected||``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence, TypeVar

import torch
import torch.nn.functional as F

SharedWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(s_gate [Is,H], s_up [Is,H], s_down [H,Is]) of the shared expert, replicated on every rank."""

__all__ = [
    "SharedWeights",
    "MoeGrads",
    "MoeProblem",
    "ROUTINGS",
    "swiglu",
    "swiglu_backward",
    "expert_mlp",
    "expert_mlp_with_grads",
    "moe_reference",
    "moe_reference_grads",
    "moe_reference_ep",
    "make_routing",
    "route_balanced",
    "route_uniform",
    "route_zipf",
    "route_all_to_one",
    "route_with_duplicates",
    "zipf_popularity",
    "random_topk_weights",
    "random_expert_weights",
    "random_shared_weights",
    "random_problem",
    "capture_after_warm_up",
    "SAVED_TENSOR_MODES",
    "forward_with_saved_tensors",
    "relative_error",
    "dequantize_e4m3_rows",
    "dequantize_e4m3_blocks",
]


# ---------------------------------------------------------------------------------------------
# Activation and one expert
# ---------------------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with a limit ``L``: ``silu(min(gate, L)) * clamp(up, -L, L)``."""
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.silu(gate) * up


def swiglu_backward(
    gate: torch.Tensor, up: torch.Tensor, d_act: torch.Tensor, swiglu_limit: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`swiglu` w.r.t. ``gate`` and ``up`` given ``d_act``.

    Clamp gradients follow ``torch.clamp``: they pass where the input lies inside the closed
    interval ``[min, max]`` and are zero outside it.
    """
    gate_c, up_c = gate, up
    if swiglu_limit is not None:
        gate_c = gate.clamp(max=swiglu_limit)
        up_c = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    sig = torch.sigmoid(gate_c)
    silu = gate_c * sig
    d_silu = sig * (1 + gate_c * (1 - sig))
    d_gate = d_act * up_c * d_silu
    d_up = d_act * silu
    if swiglu_limit is not None:
        d_gate = d_gate * (gate <= swiglu_limit)
        d_up = d_up * ((up >= -swiglu_limit) & (up <= swiglu_limit))
    return d_gate, d_up


def expert_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """One SwiGLU expert on rows ``x[n,H]`` with ``w_gate/w_up [I,H]``, ``w_down [H,I]``, in x's dtype."""
    dtype = x.dtype
    gate = x @ w_gate.to(dtype).t()
    up = x @ w_up.to(dtype).t()
    return swiglu(gate, up, swiglu_limit) @ w_down.to(dtype).t()


# ---------------------------------------------------------------------------------------------
# Shape validation
# ---------------------------------------------------------------------------------------------


def _check_layer_args(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: SharedWeights | None,
) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T,H], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx must be [T={num_tokens},k], got {tuple(topk_idx.shape)}")
    if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
        raise ValueError(f"topk_idx must be an integer tensor, got {topk_idx.dtype}")
    if topk_w.shape != topk_idx.shape:
        raise ValueError(f"topk_w {tuple(topk_w.shape)} must match topk_idx {tuple(topk_idx.shape)}")
    if w_gate.dim() != 3 or w_gate.shape[2] != hidden:
        raise ValueError(f"w_gate must be [E,I,H={hidden}], got {tuple(w_gate.shape)}")
    num_experts, intermediate, _ = w_gate.shape
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up {tuple(w_up.shape)} must match w_gate {tuple(w_gate.shape)}")
    if w_down.shape != (num_experts, hidden, intermediate):
        raise ValueError(
            f"w_down must be [E={num_experts},H={hidden},I={intermediate}], got {tuple(w_down.shape)}"
        )
    if shared is not None:
        s_gate, s_up, s_down = shared
        if s_gate.dim() != 2 or s_gate.shape[1] != hidden or s_up.shape != s_gate.shape:
            raise ValueError(
                f"shared gate/up must be [Is,H={hidden}], got {tuple(s_gate.shape)}, {tuple(s_up.shape)}"
            )
        if s_down.shape != (hidden, s_gate.shape[0]):
            raise ValueError(f"shared down must be [H={hidden},Is={s_gate.shape[0]}], got {tuple(s_down.shape)}")


class _SlotsByExpert(NamedTuple):
    """The (token, j) slots of a routing grouped by local expert, in canonical order.

    ``slots[starts[e]:starts[e] + counts[e]]`` are the flat slot ids ``t * k + j`` routed to local
    expert ``e``, ascending (token, then j): the order the design's schedule uses.
    """

    slots: torch.Tensor  # [n_local] int64, flat slot ids t*k + j
    counts: list[int]  # [El]
    starts: list[int]  # [El]


def _group_slots_by_expert(topk_idx: torch.Tensor, first_expert: int, num_local_experts: int) -> _SlotsByExpert:
    local_expert = topk_idx.reshape(-1).long() - first_expert
    is_local = (local_expert >= 0) & (local_expert < num_local_experts)
    # Non-local slots get key num_local_experts and sort after every local expert.
    key = torch.where(is_local, local_expert, torch.full_like(local_expert, num_local_experts))
    order = torch.sort(key, stable=True).indices
    counts_all = torch.bincount(key, minlength=num_local_experts + 1).tolist()
    counts = counts_all[:num_local_experts]
    starts = [0] * num_local_experts
    running = 0
    for e, n in enumerate(counts):
        starts[e] = running
        running += n
    return _SlotsByExpert(order[:running], counts, starts)


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def moe_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: SharedWeights | None = None,
    swiglu_limit: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    first_expert: int = 0,
) -> torch.Tensor:
    """Differentiable reference of the layer on one rank holding experts ``[first_expert, first_expert + El)``.

    With ``first_expert=0`` and ``El = E`` this is the whole layer (R = 1). Slots routed to experts
    outside the held range contribute nothing, so the sum over ranks of
    ``moe_reference(..., w_*[rank], first_expert=rank*El, shared=None)`` plus the shared expert is the
    full layer (see :func:`moe_reference_ep`).

    Every input is upcast to ``compute_dtype``; the routed terms are summed per token in fixed j order
    and the result is cast back to ``x.dtype``. Gradients flow to x, topk_w and all weights.
    """
    _check_layer_args(x, topk_idx, topk_w, w_gate, w_up, w_down, shared)
    num_tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    grouped = _group_slots_by_expert(topk_idx, first_expert, w_gate.shape[0])
    x_c = x.to(compute_dtype)

    rows_per_expert: list[torch.Tensor] = []
    for e, count in enumerate(grouped.counts):
        if count == 0:
            continue
        slots = grouped.slots[grouped.starts[e] : grouped.starts[e] + count]
        rows_per_expert.append(
            expert_mlp(x_c.index_select(0, slots // topk), w_gate[e], w_up[e], w_down[e], swiglu_limit)
        )
    # One row per (token, j) slot; slots routed elsewhere stay zero.
    per_slot = torch.zeros(num_tokens * topk, hidden, dtype=compute_dtype, device=x.device)
    if rows_per_expert:
        per_slot = per_slot.index_copy(0, grouped.slots, torch.cat(rows_per_expert))
    weighted = per_slot.view(num_tokens, topk, hidden) * topk_w.to(compute_dtype).unsqueeze(-1)
    y = weighted.sum(dim=1)
    if shared is not None:
        y = y + expert_mlp(x_c, *shared, swiglu_limit=swiglu_limit)
    return y.to(x.dtype)


class MoeGrads(NamedTuple):
    """Output and gradients of the layer for a given ``dy``, as computed by :func:`moe_reference_grads`."""

    y: torch.Tensor  # [T,H] compute dtype
    d_x: torch.Tensor  # [T,H] compute dtype
    d_topk_w: torch.Tensor  # [T,k] compute dtype
    d_w_gate: torch.Tensor  # [El,I,H] weight_grad_dtype (or [len(weight_grad_experts),I,H])
    d_w_up: torch.Tensor  # [El,I,H] weight_grad_dtype
    d_w_down: torch.Tensor  # [El,H,I] weight_grad_dtype
    d_shared: SharedWeights | None  # weight_grad_dtype


def expert_mlp_with_grads(
    x_rows: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    d_out_rows: torch.Tensor,
    swiglu_limit: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward and explicit backward of one SwiGLU expert, in x_rows' dtype.

    Returns (out_rows, d_x_rows, d_w_gate, d_w_up, d_w_down, act) where ``d_out_rows`` is the
    gradient w.r.t. ``out_rows``.
    """
    dtype = x_rows.dtype
    wg, wu, wd = w_gate.to(dtype), w_up.to(dtype), w_down.to(dtype)
    gate = x_rows @ wg.t()
    up = x_rows @ wu.t()
    act = swiglu(gate, up, swiglu_limit)
    out = act @ wd.t()
    d_w_down = d_out_rows.t() @ act
    d_act = d_out_rows @ wd
    d_gate, d_up = swiglu_backward(gate, up, d_act, swiglu_limit)
    d_w_gate = d_gate.t() @ x_rows
    d_w_up = d_up.t() @ x_rows
    d_x_rows = d_gate @ wg + d_up @ wu
    return out, d_x_rows, d_w_gate, d_w_up, d_w_down, act


def moe_reference_grads(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    d_y: torch.Tensor,
    shared: SharedWeights | None = None,
    swiglu_limit: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    first_expert: int = 0,
    weight_grad_dtype: torch.dtype | None = None,
    weight_grad_experts: Sequence[int] | None = None,
) -> MoeGrads:
    """Forward and explicit backward of :func:`moe_reference`, one expert at a time, no autograd graph.

    Same semantics and arguments as :func:`moe_reference` plus ``d_y [T,H]``. Peak extra memory is
    one expert's rows in ``compute_dtype`` and the outputs, which makes it usable at benchmark
    shapes (the autograd reference keeps every upcast weight alive). ``y``, ``d_x`` and ``d_topk_w``
    are returned in ``compute_dtype``; weight gradients in ``weight_grad_dtype`` (default: compute
    dtype; bf16 halves their memory at a rounding cost of 2^-9 relative). ``weight_grad_experts``
    (local indices) keeps the weight gradients of those experts only, in that order — every expert
    is still computed, so ``d_x`` and ``d_topk_w`` stay complete.
    """
    _check_layer_args(x, topk_idx, topk_w, w_gate, w_up, w_down, shared)
    if d_y.shape != x.shape:
        raise ValueError(f"d_y {tuple(d_y.shape)} must match x {tuple(x.shape)}")
    grad_dtype = weight_grad_dtype or compute_dtype
    num_tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    device = x.device
    grouped = _group_slots_by_expert(topk_idx, first_expert, w_gate.shape[0])
    flat_w = topk_w.reshape(-1).to(compute_dtype)

    y = torch.zeros(num_tokens, hidden, dtype=compute_dtype, device=device)
    d_x = torch.zeros_like(y)
    d_topk_w = torch.zeros(num_tokens * topk, dtype=compute_dtype, device=device)
    kept = list(range(w_gate.shape[0])) if weight_grad_experts is None else [int(e) for e in weight_grad_experts]
    slot_of_expert = {e: i for i, e in enumerate(kept)}
    d_w_gate = torch.zeros((len(kept),) + tuple(w_gate.shape[1:]), dtype=grad_dtype, device=device)
    d_w_up = torch.zeros((len(kept),) + tuple(w_up.shape[1:]), dtype=grad_dtype, device=device)
    d_w_down = torch.zeros((len(kept),) + tuple(w_down.shape[1:]), dtype=grad_dtype, device=device)

    with torch.no_grad():
        for e, count in enumerate(grouped.counts):
            if count == 0:
                continue
            slots = grouped.slots[grouped.starts[e] : grouped.starts[e] + count]
            tokens = slots // topk
            slot_w = flat_w.index_select(0, slots).unsqueeze(-1)  # [n,1]
            x_rows = x.index_select(0, tokens).to(compute_dtype)
            d_y_rows = d_y.index_select(0, tokens).to(compute_dtype)
            # The layer scales each expert output by its slot weight: d(out) = w * dy.
            out, d_x_rows, dwg, dwu, dwd, _ = expert_mlp_with_grads(
                x_rows, w_gate[e], w_up[e], w_down[e], slot_w * d_y_rows, swiglu_limit
            )
            y.index_add_(0, tokens, slot_w * out)
            d_topk_w.index_copy_(0, slots, (d_y_rows * out).sum(dim=-1))
            d_x.index_add_(0, tokens, d_x_rows)
            if e in slot_of_expert:
                d_w_gate[slot_of_expert[e]] = dwg.to(grad_dtype)
                d_w_up[slot_of_expert[e]] = dwu.to(grad_dtype)
                d_w_down[slot_of_expert[e]] = dwd.to(grad_dtype)

        d_shared: SharedWeights | None = None
        if shared is not None:
            x_c = x.to(compute_dtype)
            out, d_x_rows, dwg, dwu, dwd, _ = expert_mlp_with_grads(
                x_c, *shared, d_y.to(compute_dtype), swiglu_limit
            )
            y += out
            d_x += d_x_rows
            d_shared = (dwg.to(grad_dtype), dwu.to(grad_dtype), dwd.to(grad_dtype))

    return MoeGrads(y, d_x, d_topk_w.view(num_tokens, topk), d_w_gate, d_w_up, d_w_down, d_shared)


def moe_reference_ep(
    x: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    topk_w: Sequence[torch.Tensor],
    w_gate: Sequence[torch.Tensor],
    w_up: Sequence[torch.Tensor],
    w_down: Sequence[torch.Tensor],
    shared: SharedWeights | None = None,
    swiglu_limit: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """R expert-parallel ranks emulated in one process: per-rank inputs in, per-rank outputs out.

    Rank r holds ``x[r] [T_r,H]``, ``topk_idx[r]`` (global expert ids), ``topk_w[r]`` and its
    ``El = E / R`` experts ``w_*[r]``. Because placement is contiguous, concatenating the ranks'
    weights in rank order gives the global expert table, and concatenating the tokens gives one
    single-rank problem; the output is split back by ``T_r``. Gradients flow to every per-rank
    tensor. The shared expert is replicated, so its gradient here is the sum over ranks of what
    each rank computes from its own tokens.
    """
    num_ranks = len(x)
    for name, seq in (("topk_idx", topk_idx), ("topk_w", topk_w), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if len(seq) != num_ranks:
            raise ValueError(f"{name} has {len(seq)} ranks, x has {num_ranks}")
    tokens_per_rank = [t.shape[0] for t in x]
    y = moe_reference(
        torch.cat(list(x)),
        torch.cat(list(topk_idx)),
        torch.cat(list(topk_w)),
        torch.cat(list(w_gate)),
        torch.cat(list(w_up)),
        torch.cat(list(w_down)),
        shared=shared,
        swiglu_limit=swiglu_limit,
        compute_dtype=compute_dtype,
    )
    return list(torch.split(y, tokens_per_rank))


# ---------------------------------------------------------------------------------------------
# Routings: all return topk_idx [T,k] int64 of global expert ids, on the CPU unless `device` says otherwise
# ---------------------------------------------------------------------------------------------


def _check_routing_args(num_tokens: int, num_experts: int, topk: int, distinct: bool) -> None:
    if num_tokens < 0 or num_experts < 1 or topk < 1:
        raise ValueError(f"bad routing shape: T={num_tokens}, E={num_experts}, k={topk}")
    if distinct and topk > num_experts:
        raise ValueError(f"{topk} distinct experts per token need E >= k, got E={num_experts}")


def route_balanced(
    num_tokens: int, num_experts: int, topk: int, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Every expert gets ``T*k/E`` slots (exactly when E divides T*k, else within one); distinct ids per token.

    Slot ``s = t*k + j`` of a shuffled token order goes to ``expert_perm[s % E]``: k consecutive
    values mod E are distinct because k <= E.
    """
    _check_routing_args(num_tokens, num_experts, topk, distinct=True)
    expert_perm = torch.randperm(num_experts, generator=generator)
    token_perm = torch.randperm(num_tokens, generator=generator)
    slot = token_perm.unsqueeze(1) * topk + torch.arange(topk).unsqueeze(0)
    return expert_perm[slot % num_experts]


def route_uniform(
    num_tokens: int, num_experts: int, topk: int, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """k distinct experts per token, drawn uniformly at random (balanced on average only)."""
    _check_routing_args(num_tokens, num_experts, topk, distinct=True)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    return scores.topk(topk, dim=1).indices


def zipf_popularity(
    num_experts: int, exponent: float = 1.2, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Expert popularity ``p[e] ∝ 1 / rank(e)^s`` with ranks assigned by a seeded permutation.

    The permutation stands for the model: it must be the same on every EP rank (seed it with the
    case, not the rank), so that hot experts land on random ranks.
    """
    ranks = torch.randperm(num_experts, generator=generator).double() + 1.0
    weights = ranks.pow(-exponent)
    return weights / weights.sum()


def route_zipf(
    num_tokens: int,
    num_experts: int,
    topk: int,
    *,
    exponent: float = 1.2,
    popularity: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The skew of a real router: k distinct experts per token drawn without replacement from a Zipf law.

    Sampling without replacement uses the Gumbel-top-k trick: ``topk(log p + Gumbel)``.
    ``popularity`` defaults to :func:`zipf_popularity` drawn from ``generator``.
    """
    _check_routing_args(num_tokens, num_experts, topk, distinct=True)
    if popularity is None:
        popularity = zipf_popularity(num_experts, exponent, generator=generator)
    if popularity.shape != (num_experts,):
        raise ValueError(f"popularity must be [E={num_experts}], got {tuple(popularity.shape)}")
    uniform = torch.rand(num_tokens, num_experts, generator=generator, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
    return (popularity.log().unsqueeze(0) + gumbel).topk(topk, dim=1).indices


def route_all_to_one(
    num_tokens: int, num_experts: int, topk: int, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Worst-case skew: every token goes to the same k distinct experts ``0..k-1`` (all on rank 0 when El >= k)."""
    _check_routing_args(num_tokens, num_experts, topk, distinct=True)
    return torch.arange(topk).unsqueeze(0).expand(num_tokens, topk).contiguous()


def route_with_duplicates(
    num_tokens: int, num_experts: int, topk: int, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Ids drawn independently with replacement, from few experts, so tokens repeat experts (each slot counts)."""
    _check_routing_args(num_tokens, num_experts, topk, distinct=False)
    pool = max(1, min(num_experts, topk))  # a small pool makes repeats frequent
    return torch.randint(0, pool, (num_tokens, topk), generator=generator)


def route_masked(
    num_tokens: int, num_experts: int, topk: int, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Zipf routing with empty slots (id -1, no expert): each slot with probability 1/4, and every
    slot of every 5th token (tokens that reach no expert, as masked or padding tokens do)."""
    idx = route_zipf(num_tokens, num_experts, topk, generator=generator)
    empty = torch.rand(num_tokens, topk, generator=generator) < 0.25
    empty[4::5] = True
    return idx.masked_fill(empty, -1)


RoutingFn = Callable[..., torch.Tensor]
ROUTINGS: dict[str, RoutingFn] = {
    "balanced": route_balanced,
    "uniform": route_uniform,
    "zipf": route_zipf,
    "all_to_one": route_all_to_one,
    "duplicates": route_with_duplicates,
    "masked": route_masked,
}


def make_routing(
    name: str,
    num_tokens: int,
    num_experts: int,
    topk: int,
    *,
    generator: torch.Generator | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """Routing ``name`` (a key of :data:`ROUTINGS`) as ``topk_idx [T,k]`` int64 on the CPU."""
    if name not in ROUTINGS:
        raise ValueError(f"unknown routing {name!r}; known: {sorted(ROUTINGS)}")
    return ROUTINGS[name](num_tokens, num_experts, topk, generator=generator, **kwargs)


def random_topk_weights(
    num_tokens: int, topk: int, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Router weights ``[T,k]`` fp32: softmax of standard-normal logits (positive, each row sums to 1)."""
    logits = torch.randn(num_tokens, topk, generator=generator)
    return torch.softmax(logits, dim=-1)


# ---------------------------------------------------------------------------------------------
# Weights and whole problems
# ---------------------------------------------------------------------------------------------


def random_expert_weights(
    num_experts: int,
    hidden: int,
    intermediate: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_gate [E,I,H], w_up [E,I,H], w_down [E,H,I]) with std 1/sqrt(fan_in): activations stay O(1).

    ``generator`` must live on ``device``; numbers are drawn directly in ``dtype`` (no fp32 copy of
    benchmark-sized weights).
    """
    def normal(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
        w = torch.randn(shape, generator=generator, device=device, dtype=dtype)
        return w.mul_(1.0 / math.sqrt(fan_in))

    return (
        normal((num_experts, intermediate, hidden), hidden),
        normal((num_experts, intermediate, hidden), hidden),
        normal((num_experts, hidden, intermediate), intermediate),
    )


def random_shared_weights(
    hidden: int,
    shared_intermediate: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> SharedWeights:
    """(s_gate [Is,H], s_up [Is,H], s_down [H,Is]) with std 1/sqrt(fan_in)."""
    w_gate, w_up, w_down = random_expert_weights(
        1, hidden, shared_intermediate, generator=generator, dtype=dtype, device=device
    )
    return (w_gate[0], w_up[0], w_down[0])


@dataclass
class MoeProblem:
    """One single-rank layer problem (all E experts local)."""

    x: torch.Tensor  # [T,H]
    topk_idx: torch.Tensor  # [T,k] int64
    topk_w: torch.Tensor  # [T,k] fp32
    w_gate: torch.Tensor  # [E,I,H]
    w_up: torch.Tensor  # [E,I,H]
    w_down: torch.Tensor  # [E,H,I]
    shared: SharedWeights | None
    swiglu_limit: float | None

    def reference(self, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:func:`moe_reference` on this problem."""
        return moe_reference(
            self.x, self.topk_idx, self.topk_w, self.w_gate, self.w_up, self.w_down,
            shared=self.shared, swiglu_limit=self.swiglu_limit, compute_dtype=compute_dtype,
        )


def random_problem(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    topk: int,
    *,
    shared_intermediate: int = 0,
    swiglu_limit: float | None = None,
    routing: str = "uniform",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> MoeProblem:
    """A seeded single-rank problem: x ~ N(0,1), weights with std 1/sqrt(fan_in), routing by name.

    The same seed gives the same problem on the same device type. ``shared_intermediate=0`` means no
    shared expert.
    """
    device = torch.device(device)
    cpu_gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    topk_idx = make_routing(routing, num_tokens, num_experts, topk, generator=cpu_gen).to(device)
    topk_w = random_topk_weights(num_tokens, topk, generator=cpu_gen).to(device)
    x = torch.randn(num_tokens, hidden, generator=dev_gen, device=device).to(dtype)
    w_gate, w_up, w_down = random_expert_weights(
        num_experts, hidden, intermediate, generator=dev_gen, dtype=dtype, device=device
    )
    shared = None
    if shared_intermediate > 0:
        shared = random_shared_weights(hidden, shared_intermediate, generator=dev_gen, dtype=dtype, device=device)
    return MoeProblem(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit)


_T = TypeVar("_T")


def capture_after_warm_up(step: Callable[[], _T]) -> tuple[torch.cuda.CUDAGraph, _T]:
    """``step`` run once on a side stream (the warm-up torch asks for before a capture: a layer's
    workspace made, its kernels loaded), then captured into a CUDA graph on the current device:
    the graph and what the captured ``step`` returned (tensors every replay writes again)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


SAVED_TENSOR_MODES = ("plain", "non_reentrant", "reentrant", "save_on_cpu")
"""The ways training code keeps a forward's saved tensors (forward_with_saved_tensors)."""


def forward_with_saved_tensors(mode: str, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """``fn(*args)`` as training code may run it, ``mode`` one of SAVED_TENSOR_MODES: plainly,
    inside ``torch.utils.checkpoint`` (non-reentrant: saved tensors dropped after the forward and
    made again by a recompute in the backward; reentrant: a no_grad forward, then a training one in
    the backward), or under ``torch.autograd.graph.save_on_cpu``."""
    if mode == "plain":
        return fn(*args)
    if mode == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            return fn(*args)
    if mode not in SAVED_TENSOR_MODES:
        raise ValueError(f"mode must be one of {SAVED_TENSOR_MODES}, got {mode!r}")
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=mode == "reentrant")


# ---------------------------------------------------------------------------------------------
# Tolerance metric
# ---------------------------------------------------------------------------------------------


def dequantize_e4m3_rows(codes: torch.Tensor, scales_k_major: torch.Tensor) -> torch.Tensor:
    """The values block-scaled e4m3 rows stand for (fp32): codes [rows, cols] times their 1 x 128
    block's scale, the scales k-block major [ceil(cols / 128), rows] (``_cuda_kernels.quantize_rows``)."""
    return codes.float() * scales_k_major.t().repeat_interleave(128, dim=1)[:, : codes.shape[1]]


def dequantize_e4m3_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The values of block-scaled e4m3 planes (fp32): codes [planes, rows, cols] times their 128 x 128
    block's scale, scales [planes, ceil(rows / 128), ceil(cols / 128)] (``_cuda_kernels.quantize_weights``)."""
    s = scales.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
    return codes.float() * s[:, : codes.shape[1], : codes.shape[2]]


def relative_error(actual: torch.Tensor, expected: torch.Tensor, chunk_elems: int = 1 << 26) -> float:
    """``||actual - expected||_2 / ||expected||_2`` accumulated in fp64 over chunks (no full-size temporaries).

    Returns 0 when both are all-zero, ``inf`` when only ``expected`` is, ``nan`` if anything is non-finite.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    a = actual.detach().reshape(-1)
    b = expected.detach().reshape(-1)
    diff_sq = 0.0
    ref_sq = 0.0
    for start in range(0, a.numel(), chunk_elems):
        a_c = a[start : start + chunk_elems].double()
        b_c = b[start : start + chunk_elems].double()
        diff_sq += float(torch.sum((a_c - b_c) ** 2))
        ref_sq += float(torch.sum(b_c**2))
    if not (math.isfinite(diff_sq) and math.isfinite(ref_sq)):
        return math.nan
    if ref_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else math.inf
    return math.sqrt(diff_sq / ref_sq)
