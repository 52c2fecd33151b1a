"""Baseline (c): DeepEP intranode dispatch/combine + ``torch._grouped_mm``, when ``deep_ep`` is importable.

Written against DeepEP's ``deep_ep.Buffer`` (v1 normal-mode) API: ``get_dispatch_layout``,
``dispatch`` (one copy of a token per destination rank, with its top-k ids made rank-local, -1
elsewhere) and ``combine`` (sums the per-rank partial outputs). The expert side expands received
tokens to (token, j) rows, runs the grouped SwiGLU MLP, weights rows by their router weight in fp32
and sums them per received token before the combine. Backward: dispatch's backward is a combine
(also of the router-weight gradients), combine's backward is a cached dispatch.

Not exercised in CI (no DeepEP build there); the first GPU run with deep_ep installed validates it
against the reference like every other impl.
"""

from __future__ import annotations

from typing import Any

import torch

from . import BenchContext, Runner, Skip, autograd_runner, register_impl
from ._common import grouped_swiglu_mlp, layer_activation_bytes, shared_expert

BUFFER_KEY = "deepep.buffer"


def _deep_ep() -> Any:
    try:
        import deep_ep  # type: ignore[import-not-found]
    except Exception as exc:
        raise Skip(f"deep_ep is not importable here ({type(exc).__name__}: {exc})") from None
    api = ("get_dispatch_layout", "dispatch", "combine")
    if not all(hasattr(deep_ep, "Buffer") and hasattr(deep_ep.Buffer, n) for n in api):
        raise Skip("deep_ep has no v1 Buffer API (get_dispatch_layout/dispatch/combine)")
    return deep_ep


def _buffer(deep_ep: Any, ctx: BenchContext, hidden: int) -> Any:
    """One Buffer for the run, sized for the widest hidden size of the selected cases."""
    from ..presets import get_preset

    cached = ctx.resources.get(BUFFER_KEY)
    if cached is not None and cached[1] >= hidden:
        return cached[0]
    group, R = ctx.runtime.group, ctx.runtime.world_size
    widest = max([hidden] + [get_preset(c.preset).H for c in ctx.cases if c.kind == "layer" and c.ranks == R])
    num_nvl_bytes = 0
    for config in (deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R)):
        num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(widest * 2, R))
    buffer = deep_ep.Buffer(group, num_nvl_bytes, 0)
    ctx.resources[BUFFER_KEY] = (buffer, widest)
    return buffer


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor, buffer: Any, num_experts: int, box: dict
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, recv_counts, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_w, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        )
        box["handle"], box["recv_counts"] = handle, recv_counts
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx

    @staticmethod
    def backward(ctx: Any, d_recv_x: torch.Tensor, d_recv_w: torch.Tensor, _: Any) -> tuple[Any, ...]:
        d_x, d_w, _ = ctx.buffer.combine(d_recv_x.contiguous(), ctx.handle, topk_weights=d_recv_w.contiguous())
        return d_x, d_w, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_recv: torch.Tensor, buffer: Any, handle: Any) -> torch.Tensor:  # type: ignore[override]
        combined, _, _ = buffer.combine(y_recv, handle)
        ctx.buffer, ctx.handle = buffer, handle
        return combined

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[Any, ...]:
        d_recv, *_ = ctx.buffer.dispatch(d_out.contiguous(), handle=ctx.handle)
        return d_recv, None, None


def _memory_bytes(problem: Any, ctx: BenchContext) -> int:
    return layer_activation_bytes(problem, problem.load.max_rows_received())


@register_impl("deepep", "layer", memory_bytes=_memory_bytes,
               description="DeepEP intranode dispatch/combine + torch._grouped_mm SwiGLU")
def build(problem: Any, ctx: BenchContext) -> Runner:
    if not ctx.runtime.is_cuda:
        raise Skip("DeepEP needs CUDA GPUs")
    if problem.ranks < 2:
        raise Skip("DeepEP intranode kernels need at least 2 ranks")
    if problem.case.precision != "bf16":
        raise Skip(f"precision {problem.case.precision} not wired for DeepEP here")
    deep_ep = _deep_ep()
    p = problem
    buffer = _buffer(deep_ep, ctx, p.preset.H)
    idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
    topk_idx = p.topk_idx.to(idx_dtype)
    El = p.local_experts

    def forward() -> torch.Tensor:
        box: dict[str, Any] = {}
        recv_x, recv_w, recv_idx = _Dispatch.apply(p.x, p.topk_w, topk_idx, buffer, p.preset.E, box)
        with torch.no_grad():
            token, j = torch.nonzero(recv_idx >= 0, as_tuple=True)  # (received token, slot) rows for our experts
            expert = recv_idx[token, j].long()
            expert_order = torch.sort(expert, stable=True).indices
            token, j = token[expert_order], j[expert_order]
            offs = torch.cumsum(torch.bincount(expert, minlength=El), 0).to(torch.int32)
        y_sorted = grouped_swiglu_mlp(recv_x.index_select(0, token), offs, p.w_gate, p.w_up, p.w_down, p.swiglu_limit)
        weighted = y_sorted.float() * recv_w[token, j].unsqueeze(-1)
        y_recv = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device).index_add(0, token, weighted)
        y = _Combine.apply(y_recv.to(recv_x.dtype), buffer, box["handle"])
        shared = shared_expert(p.x, p.shared, p.swiglu_limit)
        return y if shared is None else (y.float() + shared.float()).to(y.dtype)

    return autograd_runner(p, forward)
