"""Baseline (b): ``torch.ops.symm_mem.all_to_all_vdev`` dispatch/combine + ``torch._grouped_mm``, no host sync.

``all_to_all_vdev(input, out, in_splits, out_splits_offsets, group_name)`` (torch 2.11, NVSHMEM
backend) exchanges rows of symmetric tensors with the splits on the device: ``in_splits [R]`` int64
rows to each peer; it writes ``out_splits_offsets [2,R]`` (rows received from each peer, and their
exclusive-prefix offsets). Received rows are packed in source-rank order starting at row 0.

Because sizes never reach the host, every buffer is sized for the worst case ``R*T*k`` rows; rows
past the received total are padding that carries a sentinel expert id, sorts last, and lies past
the grouped GEMMs' last offset (never read). Per forward:
1. sort the (token, j) slots by global expert id (destination rank, then local expert);
2. dispatch: x rows plus their local expert id (packed in 16 extra int16 columns of each row, so one
   exchange carries both), then sort the received rows by expert on the device;
3. grouped gate/up GEMMs, SwiGLU, grouped down GEMM;
4. combine: rows go back to their sources with ``in_splits`` = the received counts, landing in the
   order they were sent; put them in slot order; fp32 weighted sum plus the shared expert.
The backward runs the same exchanges reversed (custom autograd functions below).

Invariant: before a rank writes its send buffer, every rank has finished the previous exchange
(receivers pull from the senders' buffers, and peers write our split counters), so each exchange
starts with a stream-ordered barrier (a one-element NCCL all-reduce; no host sync).
"""

from __future__ import annotations

from typing import Any

import torch

from ..cost import BF16_BYTES
from . import BenchContext, Runner, Skip, autograd_runner, register_impl
from ._common import (
    grouped_swiglu_mlp,
    layer_activation_bytes,
    shared_expert,
    weighted_slot_sum,
)

META_COLS = 32  # 64 bytes per row for the local expert id (see the block-split note in SymmWorkspace)
MIN_BUFFER_BYTES = 8 << 20
WORKSPACE_KEY = "symm_a2a.workspace"


def _rows_capacity(problem_or_case: Any, ranks: int, preset: Any) -> int:
    tokens = problem_or_case.tokens_per_rank
    return ranks * tokens * preset.topk


def workspace_bytes_for(case: Any, preset: Any) -> int:
    """Bytes of the send + recv buffers a case needs (worst case: every slot of every rank lands here)."""
    return 2 * _rows_capacity(case, case.ranks, preset) * (preset.H + META_COLS) * BF16_BYTES


class SymmWorkspace:
    """Symmetric send/recv buffers and split counters, allocated once and reused by every case.

    Block-split note: all_to_all_vdev sizes its grid from the input tensor's bytes and, in the
    torch versions we read, splits each peer's bytes evenly over ``blocks / R`` blocks, asserting
    that the division is exact. Handing it a view of the whole buffer (>= 8 MiB, so the grid is
    always its maximum of 64 blocks) with rows whose byte size is a multiple of 64 makes every split
    exact: ``rows * row_bytes`` is then divisible by 64 / R.
    """

    def __init__(self, runtime: Any, capacity_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.runtime = runtime
        self.group_name = runtime.group.group_name
        R, device = runtime.world_size, runtime.device
        numel = max(capacity_bytes // 2, MIN_BUFFER_BYTES) // BF16_BYTES
        try:
            symm_mem.enable_symm_mem_for_group(self.group_name)
        except Exception:  # not needed on newer torch
            pass
        self.send = symm_mem.empty(numel, dtype=torch.bfloat16, device=device).zero_()
        self.recv = symm_mem.empty(numel, dtype=torch.bfloat16, device=device).zero_()
        self.in_splits = symm_mem.empty(R, dtype=torch.int64, device=device).zero_()
        self.out_splits_offsets = symm_mem.empty((2, R), dtype=torch.int64, device=device).zero_()
        for t in (self.send, self.recv, self.in_splits, self.out_splits_offsets):
            symm_mem.rendezvous(t, runtime.group)
        self.capacity_bytes = 2 * numel * BF16_BYTES
        runtime.barrier()

    def _rows(self, buffer: torch.Tensor, width: int) -> torch.Tensor:
        if (width * BF16_BYTES) % 64:
            raise ValueError(f"row of {width} bf16 is not a multiple of 64 bytes")
        rows = buffer.numel() // width
        return buffer[: rows * width].view(rows, width)

    def send_rows(self, rows: int, width: int) -> torch.Tensor:
        return self._rows(self.send, width)[:rows]

    def exchange(self, width: int, in_splits: torch.Tensor, recv_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Send rows from the top of the send buffer (``in_splits[r]`` rows to rank r, in rank order).

        Returns (the first ``recv_rows`` rows of the recv buffer, rows received from each source);
        received rows are packed from row 0 in source-rank order.
        """
        self.in_splits.copy_(in_splits)
        recv = self._rows(self.recv, width)
        torch.ops.symm_mem.all_to_all_vdev(
            self._rows(self.send, width), recv, self.in_splits, self.out_splits_offsets, self.group_name
        )
        return recv[:recv_rows], self.out_splits_offsets[0].clone()

    def barrier(self) -> None:
        self.runtime.stream_barrier()


class _SymmDispatch(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,  # [T,H]
        src_token: torch.Tensor,  # [n] token of each send row (send rows sorted by destination, then expert)
        local_expert: torch.Tensor,  # [n] destination-local expert id of each send row
        send_counts: torch.Tensor,  # [R] rows to each destination rank
        ws: SymmWorkspace,
        num_local_experts: int,
        capacity: int,  # rows: the most this rank can receive
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n, H = src_token.numel(), x.shape[1]
        width = H + META_COLS
        ws.barrier()
        send = ws.send_rows(n, width)
        send[:, :H].copy_(x.index_select(0, src_token))
        send[:, H].view(torch.int16).copy_(local_expert.to(torch.int16))
        recv, recv_counts = ws.exchange(width, send_counts, capacity)
        row = torch.arange(capacity, device=x.device)
        expert = torch.where(
            row < recv_counts.sum(), recv[:, H].view(torch.int16).long(), torch.full_like(row, num_local_experts)
        )
        expert_order = torch.sort(expert, stable=True).indices  # padding rows (sentinel) last
        counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=x.device)
        counts.index_add_(0, expert, torch.ones_like(expert))
        offs = torch.cumsum(counts[:num_local_experts], 0).to(torch.int32)
        x_sorted = recv[:, :H].index_select(0, expert_order)  # [capacity, H]
        ctx.save_for_backward(src_token, expert_order, recv_counts)
        ctx.ws, ctx.num_tokens = ws, x.shape[0]
        ctx.mark_non_differentiable(offs, expert_order, recv_counts)
        return x_sorted, offs, expert_order, recv_counts

    @staticmethod
    def backward(ctx: Any, d_x_sorted: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        src_token, expert_order, recv_counts = ctx.saved_tensors
        ws: SymmWorkspace = ctx.ws
        capacity, H = d_x_sorted.shape
        ws.barrier()
        ws.send_rows(capacity, H).index_copy_(0, expert_order, d_x_sorted)  # back to arrival order
        recv, _ = ws.exchange(H, recv_counts, capacity)  # rows land in their send order
        d_x = torch.zeros(ctx.num_tokens, H, dtype=d_x_sorted.dtype, device=d_x_sorted.device)
        d_x.index_add_(0, src_token, recv[: src_token.numel()])
        return d_x, None, None, None, None, None, None


class _SymmCombine(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        y_sorted: torch.Tensor,  # [capacity, H] expert outputs, rows grouped by expert
        expert_order: torch.Tensor,
        recv_counts: torch.Tensor,
        send_counts: torch.Tensor,
        slot_order: torch.Tensor,  # [n]: slot id of each send row
        ws: SymmWorkspace,
    ) -> torch.Tensor:
        capacity, H = y_sorted.shape
        n = slot_order.numel()
        ws.barrier()
        ws.send_rows(capacity, H).index_copy_(0, expert_order, y_sorted)
        recv, _ = ws.exchange(H, recv_counts, capacity)
        y_slots = torch.empty(n, H, dtype=y_sorted.dtype, device=y_sorted.device)
        y_slots.index_copy_(0, slot_order, recv[:n])
        ctx.save_for_backward(expert_order, send_counts, slot_order)
        ctx.ws, ctx.capacity = ws, capacity
        return y_slots

    @staticmethod
    def backward(ctx: Any, d_y_slots: torch.Tensor) -> tuple[Any, ...]:
        expert_order, send_counts, slot_order = ctx.saved_tensors
        ws: SymmWorkspace = ctx.ws
        n, H = d_y_slots.shape
        ws.barrier()
        ws.send_rows(n, H).copy_(d_y_slots.index_select(0, slot_order))
        recv, _ = ws.exchange(H, send_counts, ctx.capacity)
        return recv.index_select(0, expert_order), None, None, None, None, None


def _workspace(problem: Any, ctx: BenchContext) -> SymmWorkspace:
    """The shared workspace, sized once for the largest selected case within --symm-workspace-gb."""
    ws = ctx.resources.get(WORKSPACE_KEY)
    need = workspace_bytes_for(problem.case, problem.preset)
    limit = int(ctx.options.symm_workspace_gb * 1e9)
    if ws is None:
        from ..presets import get_preset

        needs = [
            workspace_bytes_for(c, get_preset(c.preset))
            for c in ctx.cases
            if c.kind == "layer" and c.ranks == ctx.runtime.world_size
        ]
        ws = SymmWorkspace(ctx.runtime, min(max(needs + [need]), limit))
        ctx.resources[WORKSPACE_KEY] = ws
    if need > ws.capacity_bytes:
        raise Skip(
            f"needs {need / 1e9:.1f} GB of symmetric workspace, {ws.capacity_bytes / 1e9:.1f} GB allocated (--symm-workspace-gb)"
        )
    return ws


def _memory_bytes(problem: Any, ctx: BenchContext) -> int:
    activations = layer_activation_bytes(problem, _rows_capacity(problem.case, problem.ranks, problem.preset))
    if WORKSPACE_KEY in ctx.resources:
        return activations
    return activations + min(workspace_bytes_for(problem.case, problem.preset), int(ctx.options.symm_workspace_gb * 1e9))


@register_impl("symm_a2a", "layer", memory_bytes=_memory_bytes,
               description="symm_mem all_to_all_vdev dispatch/combine (NVSHMEM, no host sync) + torch._grouped_mm")
def build(problem: Any, ctx: BenchContext) -> Runner:
    rt = ctx.runtime
    if not rt.is_cuda:
        raise Skip("all_to_all_vdev needs CUDA GPUs with the NVSHMEM symmetric-memory backend")
    if problem.case.precision != "bf16":
        raise Skip(f"precision {problem.case.precision} not implemented in the torch baseline")
    import torch.distributed._symmetric_memory as symm_mem

    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        raise Skip("this torch build has no torch.ops.symm_mem.all_to_all_vdev")
    backend = symm_mem.get_backend(rt.device)
    if backend != "NVSHMEM":
        raise Skip(f"all_to_all_vdev needs the NVSHMEM symmetric-memory backend; this run uses {backend!r} (--symm-backend)")
    if problem.local_experts > 32767:
        raise Skip("local expert ids travel as int16")
    if (problem.preset.H * BF16_BYTES) % 64:
        raise Skip(f"H={problem.preset.H}: rows must be a multiple of 64 bytes for all_to_all_vdev's block split")
    return layer_runner(problem, _workspace(problem, ctx))


def layer_runner(problem: Any, ws: SymmWorkspace) -> Runner:
    """The baseline on one problem with a given workspace (any object with SymmWorkspace's methods)."""
    p = problem
    R, El, k = p.ranks, p.local_experts, p.preset.topk
    capacity = _rows_capacity(p.case, R, p.preset)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            flat_expert = p.topk_idx.reshape(-1)
            slot_order = torch.sort(flat_expert, stable=True).indices
            sorted_expert = flat_expert.index_select(0, slot_order)
            dest = sorted_expert // El
            send_counts = torch.zeros(R, dtype=torch.int64, device=flat_expert.device)
            send_counts.index_add_(0, dest, torch.ones_like(dest))
        x_sorted, offs, expert_order, recv_counts = _SymmDispatch.apply(
            p.x, slot_order // k, sorted_expert - dest * El, send_counts, ws, El, capacity
        )
        y_sorted = grouped_swiglu_mlp(x_sorted, offs, p.w_gate, p.w_up, p.w_down, p.swiglu_limit)
        y_slots = _SymmCombine.apply(y_sorted, expert_order, recv_counts, send_counts, slot_order, ws)
        return weighted_slot_sum(y_slots, p.topk_w, shared_expert(p.x, p.shared, p.swiglu_limit))

    return autograd_runner(p, forward)
