"""The CPU backend: the layer through the C++ reference stages, expert parallelism over torch.distributed.

Every arithmetic step is a C++ stage of ``include/mok/core/reference.h`` (bf16 rounding points,
fixed reduction orders); Python only moves rows, which is exact. So a rank's results are bitwise
those of the C++ reference run over R emulated ranks, whatever R is and however the processes are
laid out. Activations cross as bf16 (every value that crosses is bf16-representable); the stages
compute on float32 copies.

One pass, per rank (see :mod:`mok._dist` for the exchange contract):

- build_schedule: all-gather every rank's ``topk_idx``; C++ builds the rows this rank's experts
  compute, in canonical order (global token, then j); this rank's ``send_order`` groups its own slots
  by destination.
- forward: x rows go to the experts' ranks, ``experts_forward``, the unweighted expert outputs come
  back into per-(token, j) slots, shared expert over all T rows, ``combine_epilogue``.
- backward: dy rows (unscaled) and router weights go to the experts' ranks, ``experts_backward``,
  dx rows and d(router weight) come back into per-(token, j) slots, shared expert backward,
  ``dispatch_grad_epilogue``. Weight gradients are fp32 from C++, returned in each weight's dtype.

Every collective step starts with :func:`mok._dist.agree`, so input that one rank rejects makes every
rank raise instead of leaving the others waiting.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from . import _checks, _dist
from ._ext import _C

__all__ = ["build_schedule", "forward", "backward", "recompute_forward_context"]

Tensor = torch.Tensor


class _Schedule(NamedTuple):
    expert_offsets: Tensor  # [El+1] int64
    row_src_rank: Tensor  # [M] int32
    row_src_slot: Tensor  # [M] int32
    recv_order: Tensor  # [M] int64
    recv_counts: Tensor  # [R] int64
    send_order: Tensor  # [T*k] int64: routed slots by expert, then the empty ones (id -1)
    send_counts: Tensor  # [R] int64

    def routed_slots(self) -> Tensor:
        """The slots that are sent (send_order without the empty slots at its end)."""
        return self.send_order[:int(self.send_counts.sum())]

    def slot_ids(self) -> Tensor:
        """[T*k] int32 for the epilogues: 0 where a slot is routed, -1 where it is empty."""
        ids = torch.zeros(self.send_order.shape[0], dtype=torch.int32)
        ids[self.send_order[int(self.send_counts.sum()):]] = -1
        return ids


def _empty(*shape: int) -> Tensor:
    """float32 scratch, whatever torch's default dtype is."""
    return torch.empty(*shape, dtype=torch.float32)


def _np(t: Tensor):  # noqa: ANN202  (numpy view sharing t's memory)
    return t.detach().contiguous().numpy()


def _as_f32(t: Tensor) -> Tensor:
    """A float32 copy (exact for bf16 values)."""
    return t.detach().to(torch.float32).contiguous()


def _weights_f32(w: Tensor) -> Tensor:
    """The weight as the bf16 kernels use it: rounded to bf16 (a no-op for bf16), held as float32."""
    return w.detach().to(torch.bfloat16).to(torch.float32).contiguous()


def _ep_values(shape: _checks.LayerShape, swiglu_limit: float | None) -> dict[str, float | int | None]:
    return {
        "tokens per rank (T)": shape.tokens,
        "hidden (H)": shape.hidden,
        "intermediate (I)": shape.intermediate,
        "top-k (k)": shape.topk,
        "local experts (El)": shape.local_experts,
        "shared intermediate (Is)": shape.shared_intermediate,
        "swiglu_limit": swiglu_limit,
    }


def _validate_desc(shape: _checks.LayerShape, ranks: int, swiglu_limit: float | None) -> None:
    _C.MoeDesc(tokens_per_rank=shape.tokens, hidden=shape.hidden, intermediate=shape.intermediate,
               num_experts=shape.local_experts * ranks, topk=shape.topk, ranks=ranks,
               shared_intermediate=shape.shared_intermediate, swiglu_limit=swiglu_limit).validate()


_WEIGHT_NAMES = ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")


def _checked_layer(step: str, group: _dist.EpGroup, schedule: tuple[Tensor, ...], x: Tensor, topk_w: Tensor | None,
                   weights: tuple[Tensor | None, ...], swiglu_limit: float | None, topk: int | None = None,
                   more_checks: Callable[[_checks.LayerShape], None] | None = None) -> _checks.LayerShape:
    """Local checks, then agreement of every rank on their outcome and on the layer's shape."""
    checked: list[_checks.LayerShape] = []

    def check() -> _dist.Values:
        shape = _checks.check_layer(x, topk_w, *weights, swiglu_limit, topk=topk)
        _checks.check_schedule(schedule, shape)
        if schedule[4].shape[0] != group.size:
            raise ValueError(f"the schedule was built for {schedule[4].shape[0]} ranks, the group has {group.size}")
        if more_checks is not None:
            more_checks(shape)
        _validate_desc(shape, group.size, swiglu_limit)
        # Values last: NaN or infinite inputs would give NaN outputs (and NaN weight gradients for
        # every row of an expert), so they are named instead.
        for name, t in (("x", x), ("topk_w", topk_w)) + tuple(zip(_WEIGHT_NAMES, weights)):
            if t is not None:
                _checks.check_finite(t, name)
        checked.append(shape)
        return _ep_values(shape, swiglu_limit)

    _dist.agree(group, step, check)
    return checked[0]


def build_schedule(topk_idx: Tensor, num_experts: int, group_name: str) -> _Schedule:
    group = _dist.resolve(group_name)

    def check() -> _dist.Values:
        _checks.check_tensor(topk_idx, "topk_idx", _checks.INDEX_DTYPES, (("T", None), ("k", None)))
        tokens, topk = topk_idx.shape
        if num_experts < 1 or num_experts % group.size != 0:
            raise ValueError(f"num_experts={num_experts} must be a positive multiple of the expert-parallel "
                             f"group size {group.size}")
        _checks.check_expert_ids(topk_idx, num_experts)
        # The schedule depends on T, k, E and R only; H and I are placeholders.
        _C.MoeDesc(tokens_per_rank=tokens, hidden=1, intermediate=1, num_experts=num_experts, topk=topk,
                   ranks=group.size).validate()
        return {"tokens per rank (T)": tokens, "top-k (k)": topk, "num_experts (E)": num_experts}

    _dist.agree(group, "build_schedule", check)
    tokens, topk = topk_idx.shape
    idx = topk_idx.detach().to(torch.int32).contiguous()
    every_rank = _dist.all_gather_rows(group, idx)  # [R*T, k], rank-major
    desc = _C.MoeDesc(tokens_per_rank=tokens, hidden=1, intermediate=1, num_experts=num_experts, topk=topk,
                      ranks=group.size)
    offsets, src_rank, src_slot = _C.build_rank_schedule(desc, group.rank, _np(every_rank))
    row_src_rank = torch.from_numpy(src_rank)
    flat = idx.reshape(-1).to(torch.int64)
    routed = flat >= 0
    local_experts = num_experts // group.size
    return _Schedule(
        expert_offsets=torch.from_numpy(offsets),
        row_src_rank=row_src_rank,
        row_src_slot=torch.from_numpy(src_slot),
        recv_order=torch.sort(row_src_rank, stable=True).indices,
        recv_counts=torch.bincount(row_src_rank.to(torch.int64), minlength=group.size),
        # Empty slots (-1) sort after every expert: the routed slots come first.
        send_order=torch.sort(torch.where(routed, flat, num_experts), stable=True).indices,
        send_counts=torch.bincount(flat[routed] // local_experts, minlength=group.size),
    )


class _Context(NamedTuple):
    x_rows: Tensor  # [M,H] bf16
    gate_up: Tensor  # [M,2I] bf16
    hidden: Tensor  # [M,I] bf16
    shared_gate_up: Tensor  # [T,2Is] bf16
    shared_hidden: Tensor  # [T,Is] bf16


def _routed_forward(group: _dist.EpGroup, s: _Schedule, shape: _checks.LayerShape, x: Tensor,
                    weights: tuple[Tensor, ...], swiglu_limit: float | None,
                    keep_gate_up: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """x rows to the experts' ranks and the routed experts: (x_rows bf16, y_rows f32, gu f32, h f32)."""
    k, H, I, El = shape.topk, shape.hidden, shape.intermediate, shape.local_experts
    per_slot = x.index_select(0, torch.div(s.routed_slots(), k, rounding_mode="floor"))
    x_rows = _dist.dispatch_rows(group, per_slot, s.send_counts, s.recv_counts, s.recv_order)
    M = x_rows.shape[0]
    gu = _empty(M, 2 * I) if keep_gate_up else None
    h = _empty(M, I)
    y_rows = _empty(M, H)
    w_gate, w_up, w_down = (_weights_f32(w) for w in weights[:3])
    _C.experts_forward(H, I, swiglu_limit, _np(w_gate), _np(w_up), _np(w_down), El, _np(s.expert_offsets),
                       _np(_as_f32(x_rows)), None if gu is None else _np(gu), _np(h), _np(y_rows))
    return x_rows, y_rows, gu, h


def _shared_forward(shape: _checks.LayerShape, x32: Tensor, shared: tuple[Tensor, ...],
                    swiglu_limit: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """The shared expert: experts_forward with one expert over all T rows: (y_shared, gu, h), f32."""
    T, H, Is = shape.tokens, shape.hidden, shape.shared_intermediate
    gu, h, y = _empty(T, 2 * Is), _empty(T, Is), _empty(T, H)
    s_gate, s_up, s_down = (_weights_f32(w) for w in shared)
    _C.experts_forward(H, Is, swiglu_limit, _np(s_gate), _np(s_up), _np(s_down), 1,
                       _np(torch.tensor([0, T], dtype=torch.int64)), _np(x32), _np(gu), _np(h), _np(y))
    return y, gu, h


def _empty_context(shape: _checks.LayerShape) -> _Context:
    bf16 = torch.bfloat16
    H, I, Is = shape.hidden, shape.intermediate, shape.shared_intermediate
    return _Context(torch.empty(0, H, dtype=bf16), torch.empty(0, 2 * I, dtype=bf16), torch.empty(0, I, dtype=bf16),
                    torch.empty(0, 2 * Is, dtype=bf16), torch.empty(0, Is, dtype=bf16))


def forward(x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, s_gate: Tensor | None,
            s_up: Tensor | None, s_down: Tensor | None, schedule: tuple[Tensor, ...], swiglu_limit: float | None,
            group_name: str, save_context: bool) -> tuple[Tensor, _Context]:
    group = _dist.resolve(group_name)
    weights = (w_gate, w_up, w_down, s_gate, s_up, s_down)
    shape = _checked_layer("forward", group, schedule, x, topk_w, weights, swiglu_limit)
    s = _Schedule(*schedule)
    T, H, k = shape.tokens, shape.hidden, shape.topk
    x = x.detach().contiguous()

    x_rows, y_rows, gu, h = _routed_forward(group, s, shape, x, weights, swiglu_limit, keep_gate_up=save_context)
    # The unweighted expert outputs go back into this rank's (token, j) slots (bf16 values: exact).
    slots = _as_f32(_dist.combine_rows(group, y_rows.to(torch.bfloat16), s.send_counts, s.recv_counts,
                                       s.recv_order, s.send_order))
    y_shared = shared_gu = shared_h = None
    if shape.shared_intermediate > 0:
        y_shared, shared_gu, shared_h = _shared_forward(shape, _as_f32(x), weights[3:], swiglu_limit)
    y = _empty(T, H)
    _C.combine_epilogue(T, H, k, None if y_shared is None else _np(y_shared), _np(slots),
                        _np(topk_w.detach().contiguous()), _np(y), _np(s.slot_ids()))

    if not save_context:
        return y.to(torch.bfloat16), _empty_context(shape)
    bf16 = torch.bfloat16
    assert gu is not None
    context = _Context(
        x_rows,
        gu.to(bf16),
        h.to(bf16),
        # [T, 2*Is] and [T, Is] with Is = 0 when there is no shared expert (outputs never alias).
        torch.empty(T, 0, dtype=bf16) if shared_gu is None else shared_gu.to(bf16),
        torch.empty(T, 0, dtype=bf16) if shared_h is None else shared_h.to(bf16),
    )
    return y.to(bf16), context


def recompute_forward_context(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, s_gate: Tensor | None,
                              s_up: Tensor | None, s_down: Tensor | None, schedule: tuple[Tensor, ...], topk: int,
                              swiglu_limit: float | None, group_name: str) -> _Context:
    """The forward's context again, bitwise (same stages, same inputs), for activation checkpointing.

    The C++ stage computes the down projection too (its output is dropped here), hence w_down."""
    group = _dist.resolve(group_name)
    weights = (w_gate, w_up, w_down, s_gate, s_up, s_down)
    shape = _checked_layer("recompute_forward_context", group, schedule, x, None, weights, swiglu_limit, topk=topk)
    s = _Schedule(*schedule)
    x = x.detach().contiguous()
    x_rows, _, gu, h = _routed_forward(group, s, shape, x, weights, swiglu_limit, keep_gate_up=True)
    bf16 = torch.bfloat16
    T, Is = shape.tokens, shape.shared_intermediate
    shared_gu = torch.empty(T, 0, dtype=bf16)
    shared_h = torch.empty(T, 0, dtype=bf16)
    if Is > 0:
        _, sgu, sh = _shared_forward(shape, _as_f32(x), weights[3:], swiglu_limit)
        shared_gu, shared_h = sgu.to(bf16), sh.to(bf16)
    assert gu is not None
    return _Context(x_rows, gu.to(bf16), h.to(bf16), shared_gu, shared_h)


def backward(dy: Tensor, x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
             s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None, schedule: tuple[Tensor, ...],
             context: tuple[Tensor, ...], swiglu_limit: float | None, group_name: str) -> tuple[Tensor, ...]:
    """(dx bf16, d_topk_w f32, d_w_gate, d_w_up, d_w_down, d_s_gate, d_s_up, d_s_down); weight gradients in
    their weight's dtype, shared ones empty when there is no shared expert."""
    group = _dist.resolve(group_name)
    weights = (w_gate, w_up, w_down, s_gate, s_up, s_down)

    def check_dy_and_context(shape: _checks.LayerShape) -> None:
        _checks.check_tensor(dy, "dy", (torch.bfloat16,), (("T", shape.tokens), ("H", shape.hidden)), x.device)
        _checks.check_context(context, shape, schedule[1].shape[0])
        _checks.check_finite(dy, "dy")

    shape = _checked_layer("backward", group, schedule, x, topk_w, weights, swiglu_limit,
                           more_checks=check_dy_and_context)
    s, ctx = _Schedule(*schedule), _Context(*context)
    T, H, I, k = shape.tokens, shape.hidden, shape.intermediate, shape.topk
    El, Is = shape.local_experts, shape.shared_intermediate
    dy = dy.detach().contiguous()
    topk_w = topk_w.detach().contiguous()

    # dy rows (unscaled) and each row's router weight go to the experts' ranks.
    routed = s.routed_slots()
    token_of_slot = torch.div(routed, k, rounding_mode="floor")
    dy_rows = _dist.dispatch_rows(group, dy.index_select(0, token_of_slot), s.send_counts, s.recv_counts,
                                  s.recv_order)
    row_w = _dist.dispatch_rows(group, topk_w.reshape(-1, 1).index_select(0, routed), s.send_counts,
                                s.recv_counts, s.recv_order)
    M = dy_rows.shape[0]
    dx_rows, d_row_w = _empty(M, H), _empty(M)
    d_gate, d_up, d_down = _empty(El, I, H), _empty(El, I, H), _empty(El, H, I)
    w32 = [_weights_f32(w) for w in (w_gate, w_up, w_down)]
    _C.experts_backward(H, I, swiglu_limit, *(_np(w) for w in w32), El, _np(s.expert_offsets),
                        _np(_as_f32(ctx.x_rows)), _np(_as_f32(ctx.gate_up)), _np(_as_f32(ctx.hidden)),
                        _np(_as_f32(dy_rows)), _np(row_w.reshape(-1)), _np(dx_rows), _np(d_row_w),
                        _np(d_gate), _np(d_up), _np(d_down))
    # dx rows (bf16 values: exact) and d(router weight) go back into this rank's (token, j) slots.
    dx_slots = _as_f32(_dist.combine_rows(group, dx_rows.to(torch.bfloat16), s.send_counts, s.recv_counts,
                                          s.recv_order, s.send_order))
    d_topk_w = _dist.combine_rows(group, d_row_w.reshape(-1, 1), s.send_counts, s.recv_counts, s.recv_order,
                                  s.send_order).reshape(T, k)

    dx_shared = None
    d_shared: tuple[Tensor, ...] = (_empty(0), _empty(0), _empty(0))
    if Is > 0:
        assert s_gate is not None and s_up is not None and s_down is not None
        dx_shared = _empty(T, H)
        ds_gate, ds_up, ds_down = _empty(Is, H), _empty(Is, H), _empty(H, Is)
        sw32 = [_weights_f32(w) for w in (s_gate, s_up, s_down)]
        # The shared expert is one expert over all T rows, each with router weight 1.
        _C.experts_backward(H, Is, swiglu_limit, *(_np(w) for w in sw32), 1,
                            _np(torch.tensor([0, T], dtype=torch.int64)), _np(_as_f32(x)),
                            _np(_as_f32(ctx.shared_gate_up)), _np(_as_f32(ctx.shared_hidden)), _np(_as_f32(dy)),
                            _np(torch.ones(T, dtype=torch.float32)), _np(dx_shared), None, _np(ds_gate),
                            _np(ds_up), _np(ds_down))
        d_shared = (ds_gate.to(s_gate.dtype), ds_up.to(s_up.dtype), ds_down.to(s_down.dtype))
    dx = _empty(T, H)
    _C.dispatch_grad_epilogue(T, H, k, None if dx_shared is None else _np(dx_shared), _np(dx_slots), _np(dx),
                              _np(s.slot_ids()))
    return (dx.to(torch.bfloat16), d_topk_w, d_gate.to(w_gate.dtype), d_up.to(w_up.dtype), d_down.to(w_down.dtype),
            *d_shared)
