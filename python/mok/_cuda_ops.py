"""The GPU layer as ``torch.ops.mok.gpu_moe`` / ``gpu_moe_backward``: what :func:`mok.moe` calls on
CUDA tensors inside ``torch.compile``, so the compiled graph holds the layer (no graph break,
``fullgraph=True`` works). Eager calls keep the autograd Function of :mod:`mok._cuda_layer`; both
run the same forward and backward (``_training_forward`` / ``_training_backward``), so they give the
same bits.

The op returns, after y, every tensor its backward reads (``_cuda_layer.OP_SAVED``: the routing
copy, the kept rows, h, g|u, the schedule, the shared expert's g|u and h; 0-element placeholders
where a call keeps none), because a compiled graph saves tensors, not Python objects. Their row
counts are the workspace's (the planner's), unknown while tracing: the fake implementation gives
them as data-dependent sizes. The workspace itself (symmetric memory, the C handle) is looked up by
shapes at run time, as in eager calls, so its first call makes it and agrees over the group there.

``config`` is the MoeConfig's planner fields as ints (-1: not given), resolved by the planner when
the op runs (the planner is a C++ call that tracing cannot see).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.library import custom_op

Tensor = torch.Tensor

# MoeConfig fields the op takes, in order (-1 for None; fused_backward 0 / 1).
CONFIG_FIELDS = ("comm_sms", "minibatch_rows", "ring_rows", "ring_budget_bytes", "fused_backward")


def config_ints(config: Any) -> list[int]:
    """The planner fields of a checked MoeConfig (or None) as the op's ints (functional._check_config
    refuses negative values, so -1 means only "not given")."""
    values = [getattr(config, name, None) if config is not None else None for name in CONFIG_FIELDS]
    return [-1 if v is None else int(v) for v in values]


def _plan(config: Sequence[int], x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
          s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None, swiglu_limit: float | None,
          group_name: str) -> dict[str, int] | None:
    from . import _checks, _dist, functional

    values = {name: (None if v < 0 else (bool(v) if name == "fused_backward" else int(v)))
              for name, v in zip(CONFIG_FIELDS, config)}
    if all(v is None for v in values.values()):
        return None
    shape = _checks.check_layer(x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit)
    return functional._plan_overrides(functional.MoeConfig(**values), shape, _dist.resolve(group_name).size,
                                      swiglu_limit, x.device)


@custom_op("mok::gpu_moe", mutates_args=(), device_types="cuda")
def gpu_moe(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
            s_gate: Optional[Tensor], s_up: Optional[Tensor], s_down: Optional[Tensor], swiglu_limit: Optional[float],
            group_name: str, save_context: bool, config: Sequence[int], precision: str,
            training: bool) -> list[Tensor]:
    from . import _cuda_layer

    plan = _plan(config, x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit, group_name)
    return _cuda_layer.op_forward(x, topk_idx, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit,
                                  group_name, save_context, plan, precision, training)


@gpu_moe.register_kernel("cpu")
def _(x: Tensor, *args: Any) -> list[Tensor]:
    raise NotImplementedError("mok: torch.ops.mok.gpu_moe is the GPU layer's traced form (CUDA tensors); on CPU "
                              "tensors call mok.moe, which runs the CPU stages")


@gpu_moe.register_fake
def _(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
      s_gate: Optional[Tensor], s_up: Optional[Tensor], s_down: Optional[Tensor], swiglu_limit: Optional[float],
      group_name: str, save_context: bool, config: Sequence[int], precision: str, training: bool) -> list[Tensor]:
    T, H = x.shape
    k = topk_idx.shape[1]
    El, I, _ = w_gate.shape
    bf16, i32 = torch.bfloat16, torch.int32

    def new(*shape: Any, dtype: torch.dtype = bf16) -> Tensor:
        return x.new_empty(shape, dtype=dtype)

    y = new(T, H)
    if T == 0 or not training:
        return [y, new(0, dtype=i32), new(0), new(0), new(0), new(0, dtype=i32), new(0, dtype=i32), new(0, dtype=i32),
                new(0), new(0)]
    # The workspace's row capacity and kept rows: data-dependent sizes, each made only where an
    # output has it (tracing refuses a size that no output carries).
    ctx = torch.library.get_ctx()
    capacity = ctx.new_dynamic_size()
    x_rows, h, gu = new(0), new(0), new(0)
    if save_context:  # a replay context keeps the schedule only
        rows = ctx.new_dynamic_size()
        h, gu = new(rows, I), new(rows, 2 * I)
        if precision not in ("fp8", "fp8_dgrad"):  # an fp8 backward pulls the bf16 rows again
            x_rows = new(rows, H)
    if s_gate is not None and s_up is not None and s_down is not None:
        from ._cuda_layer import shared_row_count

        shared_rows, Is = shared_row_count(T), s_gate.shape[0]
        shared = [new(shared_rows, 2 * Is), new(shared_rows, Is)]
    else:
        shared = [new(0), new(0)]
    return [y, new(T, k, dtype=i32), x_rows, h, gu, new(El + 1, dtype=i32), new(capacity, dtype=i32),
            new(capacity, dtype=i32), *shared]


@custom_op("mok::gpu_moe_backward", mutates_args=(), device_types="cuda")
def gpu_moe_backward(dy: Tensor, x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                     s_gate: Optional[Tensor], s_up: Optional[Tensor], s_down: Optional[Tensor], saved: list[Tensor],
                     swiglu_limit: Optional[float], group_name: str, save_context: bool, config: Sequence[int],
                     precision: str) -> list[Tensor]:
    from . import _cuda_layer

    plan = _plan(config, x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit, group_name)
    return _cuda_layer.op_backward(dy, x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, saved, swiglu_limit,
                                   group_name, save_context, plan, precision)


@gpu_moe_backward.register_kernel("cpu")
def _(dy: Tensor, *args: Any) -> list[Tensor]:
    raise NotImplementedError("mok: torch.ops.mok.gpu_moe_backward is the GPU layer's traced backward (CUDA "
                              "tensors); on CPU tensors call mok.moe, which runs the CPU stages")


@gpu_moe_backward.register_fake
def _(dy: Tensor, x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, s_gate: Optional[Tensor],
      s_up: Optional[Tensor], s_down: Optional[Tensor], saved: list[Tensor], swiglu_limit: Optional[float],
      group_name: str, save_context: bool, config: Sequence[int], precision: str) -> list[Tensor]:
    grads = [x.new_empty(x.shape, dtype=torch.bfloat16), torch.empty_like(topk_w)]
    grads += [torch.empty_like(w) for w in (w_gate, w_up, w_down)]
    if s_gate is not None and s_up is not None and s_down is not None:
        return grads + [torch.empty_like(w) for w in (s_gate, s_up, s_down)]
    return grads + [x.new_empty(0, dtype=torch.float32) for _ in range(3)]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[Tensor]) -> None:
    (x, _, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit, group_name, save_context, config,
     precision, _) = inputs
    ctx.options = (swiglu_limit, group_name, save_context, list(config), precision)
    ctx.shared = s_gate is not None
    ctx.save_for_backward(x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, *output[1:])


def _backward(ctx: Any, grads: list[Tensor | None]) -> tuple[Any, ...]:
    x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, *saved = ctx.saved_tensors
    dy = grads[0]
    if dy is None:  # still run: the other ranks' backward needs this rank's part
        dy = torch.zeros(x.shape, dtype=torch.bfloat16, device=x.device)
    dx, d_topk_w, d_gate, d_up, d_down, d_s_gate, d_s_up, d_s_down = torch.ops.mok.gpu_moe_backward(
        dy, x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, saved, *ctx.options)
    shared = (d_s_gate, d_s_up, d_s_down) if ctx.shared else (None, None, None)
    return (dx, None, d_topk_w, d_gate, d_up, d_down, *shared) + (None,) * 6


gpu_moe.register_autograd(_backward, setup_context=_setup_context)
