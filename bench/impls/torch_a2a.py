"""Baseline (a): NCCL ``all_to_all_single`` dispatch/combine + permute + ``torch._grouped_mm`` SwiGLU MLP.

The TorchTitan/Megatron "alltoall" path. Per forward:
1. sort the (token, j) slots by global expert id — that groups them by destination rank, then by
   local expert; count slots per (rank, expert);
2. exchange the counts with ``all_to_all_single`` and copy the splits to the host (the one host
   sync NCCL's variable-size all-to-all needs);
3. dispatch the x rows with ``all_to_all_single``; received rows come ordered (source rank, expert),
   permute them to (expert, source rank) for the grouped GEMMs;
4. grouped gate/up GEMMs, SwiGLU, grouped down GEMM; un-permute; combine with ``all_to_all_single``;
5. un-sort to slot order and take the fp32 weighted sum over j, plus the shared expert.
Backward is autograd through all of it (the all-to-alls' backward is the reverse all-to-all).
At one rank steps 2-4's exchange and permutation fall away (no host sync): the sorted slots are
already grouped by expert.

gloo implements ``all_to_all_single`` on CPU tensors, so the smoke mode runs the same exchange.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from . import BenchContext, Runner, Skip, autograd_runner, register_impl
from ._common import (
    grouped_swiglu_mlp,
    grouped_swiglu_mlp_fp8,
    inverse_permutation,
    layer_activation_bytes,
    rowwise_e4m3_planes,
    shared_expert,
    weighted_slot_sum,
)


class _AllToAllRows(torch.autograd.Function):
    """Rows exchanged with all_to_all_single; the backward sends gradients back the same way reversed."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        out = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        d_rows = d_out.new_empty((sum(in_splits),) + tuple(d_out.shape[1:]))
        dist.all_to_all_single(d_rows, d_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return d_rows, None, None, None


def alltoall_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                 experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shared_out: torch.Tensor | None,
                 local_experts: int, group: Any) -> torch.Tensor:
    """Baseline (a)'s layer on this rank's tokens ``x [T,H]`` routed by global expert ids ``topk_idx
    [T,k]`` (expert e on rank e // local_experts) with weights ``topk_w``: ``experts(x_sorted, offs)``
    runs this rank's experts on rows grouped by expert (end offsets ``offs``); ``shared_out`` is
    added in the weighted sum. ``group``: the expert-parallel group (None or size 1: no exchange)."""
    R = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    El, k, device = local_experts, topk_idx.shape[1], x.device
    with torch.no_grad():
        flat_expert = topk_idx.reshape(-1)
        # Global expert ids sort slots by destination rank (contiguous placement), then by local expert.
        slot_order = torch.sort(flat_expert, stable=True).indices
        send_counts = torch.bincount(flat_expert, minlength=R * El).view(R, El)
        if R > 1:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=group)  # [src, local expert]
            host = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # host sync
            send_splits, recv_splits = host[0], host[1]
            num_recv = sum(recv_splits)
            # Received rows are ordered (source rank, local expert); regroup them by expert.
            expert_of_row = torch.repeat_interleave(
                torch.arange(El, device=device).repeat(R), recv_counts.reshape(-1), output_size=num_recv
            )
            expert_order = torch.sort(expert_of_row, stable=True).indices
        else:  # one rank: the sorted slots are the expert groups already; no exchange, no host sync
            recv_counts, num_recv = send_counts, flat_expert.numel()
        offs = torch.cumsum(recv_counts.sum(0), 0).to(torch.int32)

    x_send = x.index_select(0, slot_order // k)
    x_sorted = x_send
    if R > 1:
        x_sorted = _AllToAllRows.apply(x_send, recv_splits, send_splits, group).index_select(0, expert_order)
    if num_recv == 0:
        # No rows for our experts: one padding row past every group keeps the GEMMs non-empty.
        x_sorted = torch.cat([x_sorted, x_sorted.new_zeros(1, x_sorted.shape[1])])
    y_sorted = experts(x_sorted, offs)[:num_recv]
    y_back = y_sorted
    if R > 1:
        y_recv = y_sorted.index_select(0, inverse_permutation(expert_order))
        y_back = _AllToAllRows.apply(y_recv, send_splits, recv_splits, group)
    y_slots = y_back.index_select(0, inverse_permutation(slot_order))
    return weighted_slot_sum(y_slots, topk_w, shared_out)


def _memory_bytes(problem: Any, ctx: BenchContext) -> int:
    return layer_activation_bytes(problem, problem.load.max_rows_received())


@register_impl("torch_a2a", "layer", memory_bytes=_memory_bytes,
               description="NCCL all_to_all_single + permute + torch._grouped_mm SwiGLU + all_to_all_single")
def build(problem: Any, ctx: BenchContext) -> Runner:
    if problem.case.precision not in ("bf16", "fp8"):
        raise Skip(f"precision {problem.case.precision} not implemented in the torch baseline")
    p = problem
    El = p.local_experts
    group = ctx.runtime.group
    device = p.x.device
    fp8 = p.case.precision == "fp8"
    if fp8:  # row-wise e4m3 weights, quantized once (outside the timed passes); the forward only
        with torch.no_grad():
            w_gate_up = rowwise_e4m3_planes(p.w_gate, p.w_up)
            w_down8 = rowwise_e4m3_planes(p.w_down)
            shared8 = None
            if p.shared is not None:
                s_gate, s_up, s_down = (w.unsqueeze(0) for w in p.shared)
                shared8 = (rowwise_e4m3_planes(s_gate, s_up), rowwise_e4m3_planes(s_down))

    def experts(x_sorted: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if fp8:
            return grouped_swiglu_mlp_fp8(x_sorted, offs, w_gate_up, w_down8, p.swiglu_limit)
        return grouped_swiglu_mlp(x_sorted, offs, p.w_gate, p.w_up, p.w_down, p.swiglu_limit)

    def shared_out() -> torch.Tensor | None:
        if not fp8 or shared8 is None:
            return shared_expert(p.x, p.shared, p.swiglu_limit)
        T = p.x.shape[0]
        offs = torch.tensor([T], dtype=torch.int32, device=device)
        return grouped_swiglu_mlp_fp8(p.x, offs, shared8[0], shared8[1], p.swiglu_limit)

    def forward() -> torch.Tensor:
        return alltoall_moe(p.x, p.topk_idx, p.topk_w, experts, shared_out(), El, group)

    if fp8:
        def forward_fp8() -> torch.Tensor:
            with torch.no_grad():
                return forward()

        return Runner(forward=forward_fp8, output=lambda y: y, backward=None,
                      no_backward_reason="torch's row-wise fp8 layer is timed forward only (no fp8 backward built here)")
    return autograd_runner(p, forward)
