"""Input checks shared by the public API, the ops' real implementations and their fake ones.

Metadata only (dtype, shape, device, layout), so they run on fake tensors under ``torch.compile``
as well. Wrong types and dtypes raise TypeError, everything else ValueError; every message names
the tensor, what was expected and what came.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["LayerShape", "check_layer", "check_tensor", "check_schedule", "check_context", "check_swiglu_limit"]

ACTIVATION_DTYPE = torch.bfloat16
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class LayerShape:
    tokens: int  # T, this rank's tokens
    hidden: int  # H
    intermediate: int  # I, of each routed expert
    local_experts: int  # El
    topk: int  # k
    shared_intermediate: int  # Is, 0 = no shared expert


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else " or ".join(names)


def check_tensor(t: object, name: str, dtypes: Sequence[torch.dtype], dims: Sequence[tuple[str, object]],
                 device: torch.device | None = None, contiguous: bool = False) -> torch.Tensor:
    """``t`` is a tensor of one of ``dtypes`` with shape ``dims`` ((label, size or None) per dim)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_names(dtypes)}, got {t.dtype}")
    def spec() -> str:  # made only to raise: formatting a traced size would make torch.compile fix it
        return "[" + ", ".join(label if size is None else f"{label}={size}" for label, size in dims) + "]"

    if t.dim() != len(dims):
        raise ValueError(f"{name} must have shape {spec()}, got {tuple(t.shape)}")
    for i, (_, size) in enumerate(dims):
        if size is not None and t.shape[i] != size:
            raise ValueError(f"{name} must have shape {spec()}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; every tensor of the layer must be on one device")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major {spec()}), got strides {t.stride()}; "
                         "pass weight.contiguous() (weights are not copied behind your back)")
    return t


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Raises ValueError naming the first id that is neither an expert of ``[0, num_experts)`` nor -1
    (an empty slot); a host check (the GPU layer checks its ids on the device)."""
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        t, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"topk_idx[{t}, {j}] = {int(topk_idx[t, j])} is not an expert id in [0, {num_experts}) "
                         "nor -1 (no expert)")


def check_finite(t: torch.Tensor, name: str) -> None:
    """Raises ValueError naming the first NaN or infinite element of t (the CPU path: a host check)."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{name}{''.join(f'[{i}]' for i in where)} is not finite ({float(t[tuple(where)])}); "
                         f"NaN and infinite inputs are not accepted")


def check_swiglu_limit(swiglu_limit: object) -> None:
    if swiglu_limit is None:
        return
    if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float)):
        raise TypeError(f"swiglu_limit must be a float or None, got {type(swiglu_limit).__name__}")
    if not 0 < swiglu_limit < math.inf:  # (comparisons, not math.isfinite: traceable on a symbolic float; NaN fails)
        raise ValueError(f"swiglu_limit must be a finite value > 0 (or None), got {swiglu_limit}")


def check_layer(x: object, topk_w: object, w_gate: object, w_up: object, w_down: object,
                s_gate: object, s_up: object, s_down: object, swiglu_limit: object,
                topk_idx: object = None, topk: int | None = None) -> LayerShape:
    """The layer's inputs, as the functional API and the ops take them.

    x bf16 [T,H]; topk_w fp32 [T,k]; topk_idx int32/int64 [T,k] (when given); routed weights bf16
    or fp32, contiguous: w_gate, w_up [El,I,H], w_down [El,H,I]; the shared expert's s_gate, s_up
    [Is,H], s_down [H,Is] all three or none. Activations may be strided (they are copied if so).
    Without ``topk_w`` (the recompute), ``topk`` gives k.
    """
    check_tensor(x, "x", (ACTIVATION_DTYPE,), (("T", None), ("H", None)))
    assert isinstance(x, torch.Tensor)
    device = x.device
    tokens, hidden = x.shape
    check_tensor(w_gate, "w_gate", WEIGHT_DTYPES, (("El", None), ("I", None), ("H", hidden)), device, contiguous=True)
    assert isinstance(w_gate, torch.Tensor)
    local_experts, intermediate, _ = w_gate.shape
    check_tensor(w_up, "w_up", WEIGHT_DTYPES, (("El", local_experts), ("I", intermediate), ("H", hidden)), device,
                 contiguous=True)
    check_tensor(w_down, "w_down", WEIGHT_DTYPES, (("El", local_experts), ("H", hidden), ("I", intermediate)), device,
                 contiguous=True)
    if topk_w is not None or topk is None:
        check_tensor(topk_w, "topk_w", (torch.float32,), (("T", tokens), ("k", None)), device)
        assert isinstance(topk_w, torch.Tensor)
        topk = topk_w.shape[1]
    if topk_idx is not None:
        check_tensor(topk_idx, "topk_idx", INDEX_DTYPES, (("T", None), ("k", None)), device)
        assert isinstance(topk_idx, torch.Tensor)
        if topk_idx.shape[1] != topk:
            raise ValueError(f"top-k mismatch: topk_idx has k={topk_idx.shape[1]} columns, topk_w has k={topk}")
        if topk_idx.shape[0] != tokens:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows, x has T={tokens} tokens")
    shared = (s_gate, s_up, s_down)
    if any(s is None for s in shared) and not all(s is None for s in shared):
        raise ValueError("the shared expert needs all three of s_gate, s_up, s_down (or none)")
    shared_intermediate = 0
    if s_gate is not None:
        check_tensor(s_gate, "s_gate", WEIGHT_DTYPES, (("Is", None), ("H", hidden)), device, contiguous=True)
        assert isinstance(s_gate, torch.Tensor)
        shared_intermediate = s_gate.shape[0]
        check_tensor(s_up, "s_up", WEIGHT_DTYPES, (("Is", shared_intermediate), ("H", hidden)), device, contiguous=True)
        check_tensor(s_down, "s_down", WEIGHT_DTYPES, (("H", hidden), ("Is", shared_intermediate)), device,
                     contiguous=True)
    check_swiglu_limit(swiglu_limit)
    return LayerShape(tokens, hidden, intermediate, local_experts, topk, shared_intermediate)


def check_schedule(schedule: Sequence[object], shape: LayerShape) -> None:
    """The schedule's tensors (see :class:`mok.functional.Schedule`) fit a layer of ``shape``."""
    names = ("expert_offsets", "row_src_rank", "row_src_slot", "recv_order", "recv_counts", "send_order", "send_counts")
    dtypes = (torch.int64, torch.int32, torch.int32, torch.int64, torch.int64, torch.int64, torch.int64)
    if len(schedule) != len(names):
        raise ValueError(f"a schedule has {len(names)} tensors, got {len(schedule)}")
    for t, name, dtype in zip(schedule, names, dtypes):
        check_tensor(t, f"schedule.{name}", (dtype,), (("n", None),))
    offsets, _, _, _, recv_counts, send_order, send_counts = schedule
    assert isinstance(offsets, torch.Tensor) and isinstance(send_order, torch.Tensor)
    assert isinstance(recv_counts, torch.Tensor) and isinstance(send_counts, torch.Tensor)
    if offsets.shape[0] != shape.local_experts + 1:
        raise ValueError(f"the schedule is for {offsets.shape[0] - 1} local experts, the weights have "
                         f"El={shape.local_experts}")
    if send_order.shape[0] != shape.tokens * shape.topk:
        raise ValueError(f"the schedule is for {send_order.shape[0]} routed slots, the inputs have "
                         f"T*k={shape.tokens}*{shape.topk}")
    if recv_counts.shape[0] != send_counts.shape[0]:
        raise ValueError("schedule.recv_counts and schedule.send_counts must both have one entry per rank")


def check_context(context: Sequence[object], shape: LayerShape, rows: object) -> None:
    """A saved forward context (see :class:`mok.functional.ForwardContext`) fits ``shape`` and the schedule's rows."""
    if len(context) != 5:
        raise ValueError(f"a forward context has 5 tensors, got {len(context)}")
    T, H, I, Is = shape.tokens, shape.hidden, shape.intermediate, shape.shared_intermediate
    specs = (
        ("x_rows", (("M", rows), ("H", H))),
        ("gate_up", (("M", rows), ("2I", 2 * I))),
        ("hidden", (("M", rows), ("I", I))),
        ("shared_gate_up", (("T", T), ("2Is", 2 * Is))),
        ("shared_hidden", (("T", T), ("Is", Is))),
    )
    for t, (name, dims) in zip(context, specs):
        check_tensor(t, f"context.{name}", (ACTIVATION_DTYPE,), dims)
