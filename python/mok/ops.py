"""MoK's operators, registered once with ``torch.library``: ``torch.ops.mok.*``.

Each op has a schema (inferred from the annotations below), a CPU implementation (the C++
reference stages, :mod:`mok._cpu`), a CUDA implementation, and a fake implementation (shapes only)
for FakeTensor, ``torch.compile(fullgraph=True)`` and ``torch.library.opcheck``. ``mok::forward``
has its backward registered with ``register_autograd``.

The stages run on the CPU backend. Their CUDA implementations check the inputs like every
implementation does (so mixed devices still raise ValueError), then raise NotImplementedError
naming the GPU path: on CUDA tensors the layer is one fused call, ``mok.moe`` / ``mok.MoE`` (the
megakernel; traced as ``torch.ops.mok.gpu_moe``, mok/_cuda_ops.py). Nothing ever falls back to a
different computation.

Ops (schedule = the 7 tensors of :class:`mok.functional.Schedule`, context = the 5 tensors of
:class:`mok.functional.ForwardContext`; ``group_name`` is the process group's name, ``""`` for none):

- ``build_schedule(topk_idx, num_experts, group_name) -> schedule``  (collective over the group)
- ``forward(x, topk_w, w_gate, w_up, w_down, s_gate?, s_up?, s_down?, schedule, swiglu_limit?,
  group_name, save_context) -> (y, *context)``  (context tensors have 0 rows without save_context)
- ``backward(dy, x, topk_w, w_gate, w_up, w_down, s_gate?, s_up?, s_down?, schedule, context,
  swiglu_limit?, group_name) -> (dx, d_topk_w, d_w_gate, d_w_up, d_w_down, d_s_gate, d_s_up, d_s_down)``
  (shared gradients are empty tensors without a shared expert)
- ``recompute_forward_context(x, w_gate, w_up, w_down, s_gate?, s_up?, s_down?, schedule, topk,
  swiglu_limit?, group_name) -> context``
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.library import custom_op

from . import _checks, _cpu, _dist

__all__ = ["build_schedule", "forward", "backward", "recompute_forward_context", "OPS"]

Tensor = torch.Tensor
_NUM_SCHEDULE = 7


# ---------------------------------------------------------------------------------------------
# Shapes (fake implementations); also the checks the CUDA stubs run first
# ---------------------------------------------------------------------------------------------


def _check_schedule_args(topk_idx: Tensor, num_experts: int, group_name: str) -> int:
    _checks.check_tensor(topk_idx, "topk_idx", _checks.INDEX_DTYPES, (("T", None), ("k", None)))
    ranks = _dist.resolve(group_name).size
    if num_experts < 1 or num_experts % ranks != 0:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of the expert-parallel group size {ranks}")
    return ranks


def _check_forward_args(x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                        s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None, schedule: Sequence[Tensor],
                        swiglu_limit: float | None, *_: Any) -> _checks.LayerShape:
    shape = _checks.check_layer(x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit)
    _checks.check_schedule(schedule, shape)
    return shape


def _check_backward_args(dy: Tensor, x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                         s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None, schedule: Sequence[Tensor],
                         context: Sequence[Tensor], swiglu_limit: float | None, *_: Any) -> _checks.LayerShape:
    shape = _check_forward_args(x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, schedule, swiglu_limit)
    _checks.check_tensor(dy, "dy", (torch.bfloat16,), (("T", shape.tokens), ("H", shape.hidden)), x.device)
    _checks.check_context(context, shape, schedule[1].shape[0])
    return shape


def _check_recompute_args(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, s_gate: Tensor | None,
                          s_up: Tensor | None, s_down: Tensor | None, schedule: Sequence[Tensor], topk: int,
                          swiglu_limit: float | None, *_: Any) -> _checks.LayerShape:
    shape = _checks.check_layer(x, None, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit, topk=topk)
    _checks.check_schedule(schedule, shape)
    return shape


def _schedule_meta(topk_idx: Tensor, num_experts: int, group_name: str) -> tuple[Tensor, ...]:
    ranks = _check_schedule_args(topk_idx, num_experts, group_name)
    tokens, topk = topk_idx.shape
    # The rows this rank's experts receive depend on every rank's routing: a data-dependent size.
    rows = torch.library.get_ctx().new_dynamic_size()
    i32, i64 = torch.int32, torch.int64
    return (
        topk_idx.new_empty(num_experts // ranks + 1, dtype=i64),
        topk_idx.new_empty(rows, dtype=i32),
        topk_idx.new_empty(rows, dtype=i32),
        topk_idx.new_empty(rows, dtype=i64),
        topk_idx.new_empty(ranks, dtype=i64),
        topk_idx.new_empty(tokens * topk, dtype=i64),
        topk_idx.new_empty(ranks, dtype=i64),
    )


def _context_meta(x: Tensor, shape: _checks.LayerShape, rows: Any, tokens: Any) -> tuple[Tensor, ...]:
    H, I, Is = shape.hidden, shape.intermediate, shape.shared_intermediate
    bf16 = torch.bfloat16
    return (x.new_empty(rows, H, dtype=bf16), x.new_empty(rows, 2 * I, dtype=bf16), x.new_empty(rows, I, dtype=bf16),
            x.new_empty(tokens, 2 * Is, dtype=bf16), x.new_empty(tokens, Is, dtype=bf16))


def _forward_meta(x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, s_gate: Tensor | None,
                  s_up: Tensor | None, s_down: Tensor | None, schedule: Sequence[Tensor], swiglu_limit: float | None,
                  group_name: str, save_context: bool) -> tuple[Tensor, ...]:
    shape = _check_forward_args(x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, schedule, swiglu_limit)
    y = x.new_empty(shape.tokens, shape.hidden, dtype=torch.bfloat16)
    if not save_context:  # every context tensor has 0 rows
        return (y, *_context_meta(x, shape, 0, 0))
    return (y, *_context_meta(x, shape, schedule[1].shape[0], shape.tokens))


def _backward_meta(dy: Tensor, x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                   s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None, schedule: Sequence[Tensor],
                   context: Sequence[Tensor], swiglu_limit: float | None, group_name: str) -> tuple[Tensor, ...]:
    shape = _check_backward_args(dy, x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, schedule, context,
                                 swiglu_limit)
    shared: tuple[Tensor, ...]
    if s_gate is not None and s_up is not None and s_down is not None:
        shared = (torch.empty_like(s_gate), torch.empty_like(s_up), torch.empty_like(s_down))
    else:
        shared = tuple(x.new_empty(0, dtype=torch.float32) for _ in range(3))
    return (x.new_empty(shape.tokens, shape.hidden, dtype=torch.bfloat16),
            topk_w.new_empty(shape.tokens, shape.topk, dtype=torch.float32),
            torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down), *shared)


def _recompute_meta(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, s_gate: Tensor | None,
                    s_up: Tensor | None, s_down: Tensor | None, schedule: Sequence[Tensor], topk: int,
                    swiglu_limit: float | None, group_name: str) -> tuple[Tensor, ...]:
    shape = _check_recompute_args(x, w_gate, w_up, w_down, s_gate, s_up, s_down, schedule, topk, swiglu_limit)
    return _context_meta(x, shape, schedule[1].shape[0], shape.tokens)


# ---------------------------------------------------------------------------------------------
# The ops: CPU implementations
# ---------------------------------------------------------------------------------------------

_T7 = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@custom_op("mok::build_schedule", mutates_args=(), device_types="cpu")
def build_schedule(topk_idx: Tensor, num_experts: int, group_name: str) -> _T7:
    """Collective: the rows this rank's experts compute (canonical order) and this rank's send order."""
    return tuple(_cpu.build_schedule(topk_idx, num_experts, group_name))  # type: ignore[return-value]


@custom_op("mok::forward", mutates_args=(), device_types="cpu")
def forward(x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, s_gate: Tensor | None,
            s_up: Tensor | None, s_down: Tensor | None, schedule: Sequence[Tensor], swiglu_limit: float | None,
            group_name: str, save_context: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Collective: y [T,H] bf16 and the forward context."""
    y, context = _cpu.forward(x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, tuple(schedule), swiglu_limit,
                              group_name, save_context)
    return (y, *context)


@custom_op("mok::backward", mutates_args=(), device_types="cpu")
def backward(dy: Tensor, x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
             s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None, schedule: Sequence[Tensor],
             context: Sequence[Tensor], swiglu_limit: float | None,
             group_name: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Collective: every gradient of the layer (weight gradients in their weight's dtype)."""
    return _cpu.backward(dy, x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, tuple(schedule),  # type: ignore[return-value]
                         tuple(context), swiglu_limit, group_name)


@custom_op("mok::recompute_forward_context", mutates_args=(), device_types="cpu")
def recompute_forward_context(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, s_gate: Tensor | None,
                              s_up: Tensor | None, s_down: Tensor | None, schedule: Sequence[Tensor], topk: int,
                              swiglu_limit: float | None,
                              group_name: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Collective: the forward context again, bitwise equal to the one forward returned."""
    return tuple(_cpu.recompute_forward_context(x, w_gate, w_up, w_down, s_gate, s_up, s_down,  # type: ignore[return-value]
                                                tuple(schedule), topk, swiglu_limit, group_name))


# name: (op, fake implementation, the checks every implementation starts with)
OPS = {
    "build_schedule": (build_schedule, _schedule_meta, _check_schedule_args),
    "forward": (forward, _forward_meta, _check_forward_args),
    "backward": (backward, _backward_meta, _check_backward_args),
    "recompute_forward_context": (recompute_forward_context, _recompute_meta, _check_recompute_args),
}


# ---------------------------------------------------------------------------------------------
# CUDA: the stages run on the CPU backend; the GPU layer is one fused call (mok/_cuda_ops.py)
# ---------------------------------------------------------------------------------------------


def _cuda_refused(name: str, check: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(*args: Any) -> Any:
        check(*args)  # a CPU tensor among CUDA ones is still a ValueError
        raise NotImplementedError(
            f"mok: torch.ops.mok.{name} (a stage of the CPU backend's explicit passes) runs on CPU tensors only; "
            "on the GPU the explicit passes are mok.build_schedule / mok.forward / mok.backward on a GPU workspace "
            "(mok.get_workspace(device='cuda')), and the layer is mok.moe / mok.MoE (the megakernel, its backward "
            "through autograd, traceable by torch.compile)")

    return kernel


for _name, (_op, _fake, _check) in OPS.items():
    _op.register_fake(_fake)
    _op.register_kernel("cuda", _cuda_refused(_name, _check))


# ---------------------------------------------------------------------------------------------
# Autograd of mok::forward
# ---------------------------------------------------------------------------------------------

# Saved tensors, by name: the inputs the backward reads, the schedule, and (when the forward kept
# it) the context.
_SAVED_INPUTS = ("x", "topk_w", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    (x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, schedule, swiglu_limit, group_name,
     save_context) = inputs
    context = output[1:]
    ctx.save_for_backward(x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, *schedule,
                          *(context if save_context else ()))
    ctx.swiglu_limit = swiglu_limit
    ctx.group_name = group_name
    ctx.save_context = save_context
    ctx.topk = topk_w.shape[1]
    ctx.mark_non_differentiable(*context)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dy: Tensor | None, *_context_grads: Any) -> tuple[Any, ...]:
    saved = ctx.saved_tensors
    named = dict(zip(_SAVED_INPUTS, saved))
    schedule = list(saved[len(_SAVED_INPUTS) : len(_SAVED_INPUTS) + _NUM_SCHEDULE])
    context = list(saved[len(_SAVED_INPUTS) + _NUM_SCHEDULE :])
    if dy is None:  # still run: with a group, the other ranks' backward needs this rank's part
        dy = torch.zeros(named["x"].shape, dtype=torch.bfloat16, device=named["x"].device)
    weights = tuple(named[n] for n in _SAVED_INPUTS[2:])
    if not ctx.save_context:  # activation checkpointing: rebuild the context, bitwise the forward's
        context = list(torch.ops.mok.recompute_forward_context(named["x"], *weights, schedule, ctx.topk,
                                                               ctx.swiglu_limit, ctx.group_name))
    grads = torch.ops.mok.backward(dy.contiguous(), named["x"], named["topk_w"], *weights, schedule, context,
                                   ctx.swiglu_limit, ctx.group_name)
    d_x, d_topk_w, d_gate, d_up, d_down, d_s_gate, d_s_up, d_s_down = grads
    has_shared = named["s_gate"] is not None
    return (d_x, d_topk_w, d_gate, d_up, d_down,
            d_s_gate if has_shared else None, d_s_up if has_shared else None, d_s_down if has_shared else None,
            [None] * _NUM_SCHEDULE, None, None, None)


forward.register_autograd(_backward, setup_context=_setup_context)
