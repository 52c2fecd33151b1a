"""Pieces shared by the torch baselines: grouped expert MLP, shared expert, weighted slot sum, memory model."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from mok.testing import swiglu

from ..cost import BF16_BYTES, weight_bytes


def grouped_swiglu_mlp(
    x_sorted: torch.Tensor,
    offs: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """Routed experts on rows grouped by expert: ``torch._grouped_mm`` + torch SwiGLU + ``torch._grouped_mm``.

    ``offs [El]`` int32 are the groups' end offsets; rows at or past ``offs[-1]`` are outside every
    group: their outputs (and input gradients) are undefined and must not be read.
    torch 2.11 implements ``_grouped_mm`` for bf16 on the CPU too, so the smoke mode runs this same path.
    """
    gate = torch._grouped_mm(x_sorted, w_gate.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x_sorted, w_up.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(swiglu(gate, up, swiglu_limit), w_down.transpose(-2, -1), offs=offs)


def rowwise_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's row-wise fp8: one fp32 scale per row (amax / 448) over the last dimension."""
    scale = t.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def rowwise_e4m3_planes(*parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rowwise_e4m3` of each plane of ``parts`` ([planes, rows_i, cols] each) stacked along the
    rows ([planes, sum rows_i, cols] codes, [planes, sum rows_i] scales), one plane at a time: the
    fp32 temporaries of all the experts' weights at once did not fit (Kimi K2's 384 experts on one
    GPU asked for 42 GiB)."""
    planes, cols = parts[0].shape[0], parts[0].shape[-1]
    rows = sum(p.shape[1] for p in parts)
    codes = torch.empty(planes, rows, cols, dtype=torch.float8_e4m3fn, device=parts[0].device)
    scales = torch.empty(planes, rows, dtype=torch.float32, device=parts[0].device)
    for e in range(planes):
        codes[e], scales[e] = rowwise_e4m3(torch.cat([p[e] for p in parts]))
    return codes, scales


def grouped_swiglu_mlp_fp8(
    x_sorted: torch.Tensor,
    offs: torch.Tensor,
    w_gate_up: tuple[torch.Tensor, torch.Tensor],
    w_down: tuple[torch.Tensor, torch.Tensor],
    swiglu_limit: float | None,
) -> torch.Tensor:
    """Routed experts in torch's row-wise fp8 (forward only): x rows and h quantized per row,
    ``torch._scaled_grouped_mm`` for gate|up and down. ``w_gate_up``: :func:`rowwise_e4m3_planes` of
    W_gate and W_up (stacked per expert: [El, 2I, H]); ``w_down``: of W_down. As :func:`grouped_swiglu_mlp`
    otherwise."""
    return grouped_swiglu_mlp_e4m3(rowwise_e4m3(x_sorted), offs, w_gate_up, w_down, swiglu_limit)


def grouped_swiglu_mlp_e4m3(
    x8: tuple[torch.Tensor, torch.Tensor],
    offs: torch.Tensor,
    w_gate_up: tuple[torch.Tensor, torch.Tensor],
    w_down: tuple[torch.Tensor, torch.Tensor],
    swiglu_limit: float | None,
) -> torch.Tensor:
    """:func:`grouped_swiglu_mlp_fp8` on rows already quantized (``x8``: :func:`rowwise_e4m3` of them)."""
    I = w_gate_up[0].shape[1] // 2
    a = torch._scaled_grouped_mm(x8[0], w_gate_up[0].transpose(-2, -1), x8[1], w_gate_up[1], offs=offs,
                                 out_dtype=torch.bfloat16)
    h8, h8s = rowwise_e4m3(swiglu(a[:, :I], a[:, I:], swiglu_limit))
    return torch._scaled_grouped_mm(h8, w_down[0].transpose(-2, -1), h8s, w_down[1], offs=offs,
                                    out_dtype=torch.bfloat16)


def shared_expert(x: torch.Tensor, shared: tuple[torch.Tensor, ...] | None, swiglu_limit: float | None) -> torch.Tensor | None:
    """The replicated shared expert on this rank's tokens, in bf16 (plain torch)."""
    if shared is None:
        return None
    s_gate, s_up, s_down = shared
    return F.linear(swiglu(F.linear(x, s_gate), F.linear(x, s_up), swiglu_limit), s_down)


class WeightedSlotSum(torch.autograd.Function):
    """``y[t] = shared[t] + sum_j w[t,j] * y_slots[t*k + j]`` in fp32 (fixed j order), cast to bf16.

    Saves only the bf16 slot rows and the fp32 weights; fp32 temporaries are one [T,H] slice at a time.
    """

    @staticmethod
    def forward(ctx: Any, y_slots: torch.Tensor, topk_w: torch.Tensor, shared_out: torch.Tensor | None) -> torch.Tensor:
        T, k = topk_w.shape
        slots = y_slots.view(T, k, -1)
        acc = shared_out.float() if shared_out is not None else torch.zeros(T, slots.shape[-1], device=y_slots.device)
        for j in range(k):
            acc += slots[:, j].float() * topk_w[:, j : j + 1]
        ctx.save_for_backward(y_slots, topk_w)
        ctx.has_shared = shared_out is not None
        return acc.to(y_slots.dtype)

    @staticmethod
    def backward(ctx: Any, d_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        y_slots, topk_w = ctx.saved_tensors
        T, k = topk_w.shape
        slots = y_slots.view(T, k, -1)
        d_y32 = d_y.float()
        d_slots = torch.empty_like(slots)
        d_w = torch.empty_like(topk_w)
        for j in range(k):
            d_slots[:, j] = d_y32 * topk_w[:, j : j + 1]
            d_w[:, j] = (slots[:, j].float() * d_y32).sum(dim=-1)
        return d_slots.view_as(y_slots), d_w, d_y if ctx.has_shared else None


def weighted_slot_sum(y_slots: torch.Tensor, topk_w: torch.Tensor, shared_out: torch.Tensor | None) -> torch.Tensor:
    return WeightedSlotSum.apply(y_slots, topk_w, shared_out)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def layer_activation_bytes(problem: Any, expert_rows: int) -> int:
    """Peak device bytes of an autograd layer baseline processing ``expert_rows`` rows, fwd + bwd.

    Forward keeps x_sorted, gate, up, act (N*(H+3I)) and the T*k slot rows; backward adds the weight
    gradients and a transient copy of every [N,*] gradient; plus 25% for allocator slack.
    """
    p = problem.preset
    T, k, H, I = problem.x.shape[0], p.topk, p.H, p.I
    N = expert_rows
    saved = (N * (H + 3 * I) + T * k * H) * BF16_BYTES
    transient = (N * (3 * H + 3 * I) + 3 * T * k * H) * BF16_BYTES + 2 * T * H * 4
    grads = weight_bytes(p, problem.local_experts) + 2 * T * H * BF16_BYTES
    return int(1.25 * (saved + transient + grads))
