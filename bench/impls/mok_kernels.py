"""Our kernels, through the ``mok`` package: skipped with a message until its GPU ops are importable.

The layer adapter follows the functional API of the reference system (``get_workspace`` ->
``build_schedule`` -> ``forward`` -> ``backward``, REFERENCE.md §1.1), which DESIGN.md plans for
``mok.functional``; when the real API lands, adjust ``_layer_runner`` (and add ``_experts_runner``)
and nothing else in the harness. Anything the adapter cannot find is a Skip with the reason.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from . import BenchContext, Runner, Skip, register_impl

LAYER_API = ("get_workspace", "build_schedule", "forward", "backward")
EXPERTS_API = ("expert_mlp_forward", "expert_mlp_backward")


def _mok_functional(required: tuple[str, ...]) -> ModuleType:
    try:
        import mok.functional as functional  # type: ignore[import-not-found]
    except Exception as exc:  # not built, or built without GPU ops
        raise Skip(f"mok GPU ops not importable ({type(exc).__name__}: {exc})") from None
    missing = [name for name in required if not hasattr(functional, name)]
    if missing:
        raise Skip(f"mok.functional has no {', '.join(missing)} yet")
    return functional


@register_impl("mok", "layer", is_baseline=False, description="MoK megakernel (mok.functional)")
def build_layer(problem: Any, ctx: BenchContext) -> Runner:
    if not ctx.runtime.is_cuda:
        raise Skip("the MoK kernels need an sm_90a GPU (the CPU path is the C++ reference, not benchmarked)")
    # The package's ops raise NotImplementedError on CUDA tensors until the megakernel lands; the
    # adapter below follows the reference system's argument order and must be moved to mok's
    # functional API (mok.get_workspace / build_schedule / forward / backward) when it does.
    raise Skip("the MoK layer on the GPU (the megakernel) has not landed yet")


def _layer_runner(functional: ModuleType, problem: Any, ctx: BenchContext) -> Runner:
    p = problem
    config = functional.MoKConfig() if hasattr(functional, "MoKConfig") else None
    workspace = functional.get_workspace(
        config, ctx.runtime.group, device=p.x.device, num_local_tokens=p.x.shape[0],
        hidden_size=p.preset.H, topk=p.preset.topk,
    )
    # Argument order of the reference API: shared gate, up, down, then routed gate, up, down.
    shared = tuple(w.detach() for w in p.shared) if p.shared is not None else (None, None, None)
    weights = (*shared, p.w_gate.detach(), p.w_up.detach(), p.w_down.detach())

    def forward() -> Any:
        schedule = functional.build_schedule(workspace, config, p.topk_idx, num_local_experts=p.local_experts)
        y, fwd_ctx = functional.forward(
            config, workspace, schedule, p.x.detach(), p.topk_w.detach(), *weights, swiglu_limit=p.swiglu_limit
        )
        return y, schedule, fwd_ctx

    def backward(state: Any) -> list[torch.Tensor | None]:
        _, schedule, fwd_ctx = state
        (d_x, d_w, d_gate, d_up, d_down, d_s_gate, d_s_up, d_s_down) = functional.backward(
            config, workspace, schedule, fwd_ctx, p.d_y, p.x.detach(), p.topk_w.detach(), *weights,
            swiglu_limit=p.swiglu_limit,
        )
        grads = [d_x, d_w, d_gate, d_up, d_down]
        return grads + ([d_s_gate, d_s_up, d_s_down] if p.shared is not None else [])

    return Runner(forward=forward, output=lambda state: state[0], backward=backward)


def _cuda_kernels() -> ModuleType:
    """mok._cuda_kernels, also when the package's compiled extension is not built (it needs none)."""
    try:
        import mok._cuda_kernels as kernels  # type: ignore[import-not-found]
    except Exception:
        import importlib.util
        from pathlib import Path

        path = Path(__file__).resolve().parents[2] / "python" / "mok" / "_cuda_kernels.py"
        spec = importlib.util.spec_from_file_location("mok_cuda_kernels", path)
        if spec is None or spec.loader is None:
            raise Skip(f"{path} not found") from None
        kernels = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kernels)
    if not kernels.available():
        raise Skip("libmok_cuda_capi.so (the sm_90a expert kernels) is not built here")
    return kernels


@register_impl("mok", "experts", is_baseline=False, description="MoK sm_90a grouped expert GEMMs (SwiGLU fused)")
def build_experts(problem: Any, ctx: BenchContext) -> Runner:
    """The same grouped rows as torch_grouped_mm, laid out as the MoK schedule lays them out: each
    expert's segment starts at a multiple of 128 rows (zero padding rows). The layout is built once,
    outside the timed region (in the layer, the dispatch writes rows there directly); the timed
    forward is the two kernels alone."""
    if not ctx.runtime.is_cuda:
        raise Skip("the MoK kernels need an sm_90a GPU")
    kernels = _cuda_kernels()
    p = problem
    El, I, H = p.w_gate.shape
    starts = kernels.padded_offsets(p.counts)
    rows = max(starts[-1], 1)
    dev = p.x.device
    # Row r of expert e sits at starts[e] + r.
    src_start = [0]
    for n in p.counts:
        src_start.append(src_start[-1] + n)
    index = torch.cat([torch.arange(starts[e], starts[e] + n, device=dev) for e, n in enumerate(p.counts)]) \
        if sum(p.counts) else torch.zeros(0, dtype=torch.int64, device=dev)
    x_rows = torch.zeros(rows, H, dtype=torch.bfloat16, device=dev)
    x_rows[index] = p.x.detach()
    offsets = torch.tensor(starts, dtype=torch.int32, device=dev)
    h = torch.empty(rows, I, dtype=torch.bfloat16, device=dev)
    y = torch.empty(rows, H, dtype=torch.bfloat16, device=dev)
    gu = torch.empty(rows, 2 * I, dtype=torch.bfloat16, device=dev)
    w_gate, w_up, w_down = p.w_gate.detach(), p.w_up.detach(), p.w_down.detach()
    # Backward: dy at the same padded rows, router weight 1 on real rows and 0 on padding rows (the
    # experts case has no router), fp32 weight gradients.
    dy_rows = torch.zeros(rows, H, dtype=torch.bfloat16, device=dev)
    dy_rows[index] = p.d_y
    row_weight = torch.zeros(rows, dtype=torch.float32, device=dev)
    row_weight[index] = 1.0
    grads = {name: torch.empty(shape, dtype=torch.float32, device=dev)
             for name, shape in (("gate", (El, I, H)), ("up", (El, I, H)), ("down", (El, H, I)))}
    dx = torch.empty(rows, H, dtype=torch.bfloat16, device=dev)
    d_row_weight = torch.empty(rows, dtype=torch.float32, device=dev)
    scratch = kernels.BackwardScratch(rows, I, dev)

    def forward() -> Any:
        kernels.experts_forward(x_rows, offsets, w_gate, w_up, w_down, h=h, y=y, gu=gu, swiglu_limit=p.swiglu_limit)
        return y

    def backward(state: Any) -> list[torch.Tensor | None]:
        kernels.experts_backward(x_rows, offsets, gu, h, dy_rows, row_weight, w_gate, w_up, w_down, dx=dx,
                                 d_row_weight=d_row_weight, d_w_gate=grads["gate"], d_w_up=grads["up"],
                                 d_w_down=grads["down"], scratch=scratch, swiglu_limit=p.swiglu_limit)
        return [dx[index], grads["gate"], grads["up"], grads["down"]]

    return Runner(forward=forward, output=lambda state: state[index], backward=backward)
