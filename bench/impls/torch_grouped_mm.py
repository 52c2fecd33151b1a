"""Expert-GEMM baseline: ``torch._grouped_mm`` + torch SwiGLU + ``torch._grouped_mm`` on pre-grouped rows."""

from __future__ import annotations

from typing import Any

import torch

from ..cost import BF16_BYTES
from . import BenchContext, Runner, Skip, autograd_runner, register_impl
from ._common import grouped_swiglu_mlp


def _memory_bytes(problem: Any, ctx: BenchContext) -> int:
    M, H, I = problem.x.shape[0], problem.preset.H, problem.preset.I
    weights = 3 * len(problem.counts) * I * H * BF16_BYTES
    return int(1.25 * (weights + M * (4 * H + 6 * I) * BF16_BYTES))


@register_impl("torch_grouped_mm", "experts", memory_bytes=_memory_bytes,
               description="torch._grouped_mm gate/up + torch SwiGLU + torch._grouped_mm down, rows pre-grouped")
def build(problem: Any, ctx: BenchContext) -> Runner:
    if problem.case.precision != "bf16":
        raise Skip(f"precision {problem.case.precision} not implemented in the torch baseline")
    p = problem

    def forward() -> torch.Tensor:
        return grouped_swiglu_mlp(p.x, p.offs, p.w_gate, p.w_up, p.w_down, p.swiglu_limit)

    return autograd_runner(p, forward)
