"""The explicit passes on CUDA tensors: :func:`mok.build_schedule`, :func:`mok.forward`,
:func:`mok.recompute_forward_context` and :func:`mok.backward` on a GPU workspace, through the
same kind of C API handle and the same kernels as :func:`mok.moe` (:mod:`mok._cuda_layer`), with
the same bits.

A GPU workspace owns its handle (keep_rows: it keeps contexts), its symmetric buffer over the
group and its epoch sequence, apart from the layer's (so explicit calls and mok.moe calls mix).
Each pass is one call of the sequence every rank of the group makes in the same order
(build_schedule, forward, recompute_forward_context, backward: one epoch each); the host never
waits for the device.

What differs from the CPU backend, where the schedule has the exact row count M (the host knows it):
- The schedule is built on the device, in a call of its own (a start barrier, every rank's routing
  read, an end barrier), into tensors sized for any routing: ``expert_offsets`` [El+1] int32 with
  each expert's rows starting at a multiple of 128 (the kernels' row tile), ``row_src_rank`` and
  ``row_src_slot`` [row capacity] int32 with -1 for padding rows. ``expert_rows`` [El] int32 holds
  each expert's real rows and ``topk_idx`` the routing (int32) the forward and backward write
  again. ``send_counts`` and ``recv_counts`` are computed on the device; ``recv_order`` and
  ``send_order`` are empty: the GPU pulls the rows and pushes the results, nothing is sent in an
  order. The forward runs on this schedule (it does not build one).
- The context's routed rows are [context rows, ...] (the row capacity rounded up to the minibatch),
  each row at its schedule position; rows past an expert's real rows are padding. At fp8 the
  context keeps no x rows (``x_rows`` has 0 rows): the backward pulls x again.
- Errors found on the device (an expert id out of range, a NaN, a peer that never came) are
  sticky in the workspace: raised by a later call once the device has reported them ("an earlier
  call failed") and by :meth:`mok.Workspace.check`, which synchronizes. A check that fails on one
  rank raises there only: the others are not waiting in an agreement but at their call's start
  barrier, which times out naming that rank.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _cuda_kernels as kernels
from . import _cuda_layer, _dist

Tensor = torch.Tensor


def make(ep: _dist.EpGroup, desc: Any, device: torch.device, plan: dict[str, int] | None,
         precision: str) -> _cuda_layer._Workspace | None:
    """The GPU side of an explicit workspace (collective: the ranks agree on it); None without
    tokens (T = 0 on every rank: nothing is ever called)."""
    _cuda_layer._check_device(torch.empty(0, device=device))
    if desc.tokens_per_rank == 0:
        return None
    limit = None if desc.swiglu_limit is None else float(desc.swiglu_limit)
    fp8 = precision in ("fp8", "fp8_dgrad")
    key = _cuda_layer._Key(ep.name, int(desc.tokens_per_rank), int(desc.hidden), int(desc.intermediate),
                           int(desc.num_experts), int(desc.topk), limit, device.index or 0,
                           tuple(sorted((plan or {}).items())), fp8, precision == "fp8_dgrad", True)
    with torch.cuda.device(device):
        return _cuda_layer._Workspace(key, ep)


def _empty(rows: int, cols: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    return torch.empty(rows, cols, dtype=dtype, device=device)


def build_schedule(ws: Any, gpu: _cuda_layer._Workspace | None, topk_idx: Tensor) -> tuple[Tensor, ...]:
    """The Schedule's fields (functional.Schedule, the CUDA layout in this module's docstring)."""
    device, R, El = ws.device, ws.ranks, ws.local_experts
    k = topk_idx.shape[1]
    i32, i64 = torch.int32, torch.int64
    if gpu is None:  # no tokens
        return (torch.zeros(El + 1, dtype=i32, device=device), torch.empty(0, dtype=i32, device=device),
                torch.empty(0, dtype=i32, device=device), torch.empty(0, dtype=i64, device=device),
                torch.zeros(R, dtype=i64, device=device), torch.empty(0, dtype=i64, device=device),
                torch.zeros(R, dtype=i64, device=device), torch.zeros(El, dtype=i32, device=device),
                torch.empty(0, k, dtype=i32, device=device))
    fused = gpu.fused
    cap, T = fused.row_capacity, topk_idx.shape[0]
    # The int32 fields in one allocation, each at a 16-byte boundary; the counts in another (few
    # launches: a build_schedule is host-bound).
    sizes = (El + 1, El, cap, cap, T * k)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + (n + 3) // 4 * 4)
    with torch.cuda.device(device):
        ints = torch.empty(starts[-1], dtype=i32, device=device)
        offsets, rows, src_rank, src_slot, flat = (ints[a:a + n] for a, n in zip(starts, sizes))
        routing = flat.view(T, k)
        routing.copy_(topk_idx)
        gpu.topk_idx.copy_(routing)
        counts = torch.empty(2, R, dtype=i64, device=device)
        send_counts, recv_counts = counts[0], counts[1]
        # The device counts the rows sent to (pulled by) each rank and received from (pulled from) each.
        fused.schedule(gpu.bases, offsets, rows, src_rank, src_slot, send_counts, recv_counts)
    none = torch.empty(0, dtype=i64, device=device)
    return offsets, src_rank, src_slot, none, recv_counts, none.clone(), send_counts, rows, routing


def check_schedule(ws: Any, gpu: _cuda_layer._Workspace | None, schedule: Any) -> None:
    """A schedule from build_schedule on this workspace (sizes, dtypes, device), before a pass reads it."""
    if schedule.topk_idx is None or schedule.expert_rows is None:
        raise ValueError("schedule was built for CPU tensors: build it on this GPU workspace (mok.build_schedule)")
    cap = 0 if gpu is None else gpu.fused.row_capacity
    T, k, El = ws.desc.tokens_per_rank, ws.desc.topk, ws.local_experts
    for name, t, shape in (("expert_offsets", schedule.expert_offsets, (El + 1,)),
                           ("row_src_rank", schedule.row_src_rank, (cap,)),
                           ("row_src_slot", schedule.row_src_slot, (cap,)), ("expert_rows", schedule.expert_rows, (El,)),
                           ("topk_idx", schedule.topk_idx, (T, k))):
        _check_buffer(ws, f"schedule.{name}", t, shape, torch.int32, "a schedule from mok.build_schedule")


def check_context(ws: Any, gpu: _cuda_layer._Workspace | None, context: Any) -> None:
    """A context from forward (or recompute_forward_context) on this workspace."""
    T, H, I, Is = ws.desc.tokens_per_rank, ws.desc.hidden, ws.desc.intermediate, ws.desc.shared_intermediate
    rows = 0 if gpu is None else gpu.fused.context_rows
    x_rows = 0 if gpu is None or gpu.fused.fp8 else rows
    for name, t, shape in (("x_rows", context.x_rows, (x_rows, H)), ("gate_up", context.gate_up, (rows, 2 * I)),
                           ("hidden", context.hidden, (rows, I)), ("shared_gate_up", context.shared_gate_up, (T, 2 * Is)),
                           ("shared_hidden", context.shared_hidden, (T, Is))):
        _check_buffer(ws, f"context.{name}", t, shape, torch.bfloat16, "a context from mok.forward")


def _check_buffer(ws: Any, name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, made_by: str) -> None:
    """A schedule or context tensor the kernels will read by its address: ``shape``, ``dtype``, on
    the workspace's device, dense and 16-byte aligned (``made_by``: what makes a right one)."""
    if not isinstance(t, Tensor) or t.dtype != dtype or tuple(t.shape) != shape or t.device != ws.device:
        got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} is {got}, expected {shape} {str(dtype).removeprefix('torch.')} on {ws.device}: "
                         f"{made_by} on this workspace")
    kernels.check_addressable(name, t, ws.device)


def _context(schedule: Any, x_rows: Tensor | None, h: Tensor, gu: Tensor) -> kernels.Context:
    return kernels.Context.of(False, x_rows, h, gu, schedule.expert_offsets, schedule.row_src_rank,
                              schedule.row_src_slot)


def forward(ws: Any, gpu: _cuda_layer._Workspace | None, schedule: Any, x: Tensor, topk_w: Tensor, w_gate: Tensor,
            w_up: Tensor, w_down: Tensor, s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None
            ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """(y, the ForwardContext's fields): the megakernel on the given schedule, keeping every row."""
    T, H = x.shape
    I, Is = ws.desc.intermediate, ws.desc.shared_intermediate
    device = ws.device
    if gpu is None:  # no tokens
        return (torch.zeros(0, H, dtype=torch.bfloat16, device=device),
                (_empty(0, H, device), _empty(0, 2 * I, device), _empty(0, I, device), _empty(0, 2 * Is, device),
                 _empty(0, Is, device)))
    limit = None if ws.desc.swiglu_limit is None else float(ws.desc.swiglu_limit)
    with torch.cuda.device(device):
        x_rows, h, gu = gpu.fused.row_buffers(device)
        context = _context(schedule, x_rows, h, gu)
        y, _, kept, _, _ = _cuda_layer._training_forward(gpu, x.contiguous(), schedule.topk_idx, topk_w.contiguous(),
                                                         w_gate, w_up, w_down, s_gate, s_up, s_down, limit, True,
                                                         context=context)
        _, shared_gu, shared_h = kept
        shared = ((shared_gu[:T], shared_h[:T]) if shared_gu is not None and shared_h is not None
                  else (_empty(T, 0, device), _empty(T, 0, device)))
    return y, (x_rows if x_rows is not None else _empty(0, H, device), gu, h, *shared)


def backward(ws: Any, gpu: _cuda_layer._Workspace | None, schedule: Any, context: Any, dy: Tensor, x: Tensor,
             topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, s_gate: Tensor | None,
             s_up: Tensor | None, s_down: Tensor | None) -> tuple[Tensor | None, ...]:
    """Every gradient (the Gradients' fields; the shared expert's None without one)."""
    shared = s_gate is not None and s_up is not None and s_down is not None
    if gpu is None:  # no tokens: every gradient is zero
        zeros = [torch.zeros_like(t) for t in (x, topk_w, w_gate, w_up, w_down)]
        zeros[0] = zeros[0].to(torch.bfloat16)
        return (*zeros, *((torch.zeros_like(t) for t in (s_gate, s_up, s_down)) if shared  # type: ignore[arg-type]
                          else (None, None, None)))
    limit = None if ws.desc.swiglu_limit is None else float(ws.desc.swiglu_limit)
    device = ws.device
    with torch.cuda.device(device):
        kept = _context(schedule, context.x_rows if context.x_rows.numel() else None, context.hidden,
                        context.gate_up)
        operands, shared_operands = _cuda_layer._layer_fp8_operands(gpu, w_gate, w_up, w_down, s_gate, s_up, s_down)
        shared_rows: tuple[Tensor, ...] = ()
        if shared:
            rows = _cuda_layer.shared_row_count(x.shape[0])
            shared_rows = tuple(_cuda_layer._padded(t, rows) for t in (x.to(torch.bfloat16), context.shared_gate_up,
                                                                        context.shared_hidden))
        return _cuda_layer._training_backward(gpu, kept, dy, x.contiguous(), schedule.topk_idx, topk_w.contiguous(),
                                              w_gate, w_up, w_down, s_gate, s_up, s_down, shared_rows, limit,
                                              operands, shared_operands)
