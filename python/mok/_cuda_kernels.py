"""ctypes glue to the sm_90a expert kernels (``libmok_cuda_capi.so``, built by CMake with CUDA).

Thin by design: tensors pass their data pointers and the current CUDA stream; shapes are checked
here, the kernels' own ``can_implement`` checks the rest and its message comes back as an error.
Set ``MOK_CUDA_LIB`` to the library's path, or build it at ``build/cuda/`` of the repository.
"""

from __future__ import annotations

import ctypes
import math
import os
from functools import lru_cache
from pathlib import Path

import torch

ROW_ALIGN = 128  # mirrors mok::cuda::kRowAlign; checked against the library at load


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    candidates = [os.environ.get("MOK_CUDA_LIB", "")]
    root = Path(__file__).resolve().parents[2]
    candidates += [str(root / d / "cuda" / "libmok_cuda_capi.so") for d in ("build", "build-cuda", "build-gpu")]
    for path in candidates:
        if path and Path(path).is_file():
            lib = ctypes.CDLL(path)
            break
    else:
        raise ImportError("libmok_cuda_capi.so not found (build with CUDA, or set MOK_CUDA_LIB)")
    lib.mok_cuda_experts_forward.restype = ctypes.c_int
    lib.mok_cuda_experts_forward.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 8 + [
        ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_quantize_rows_e4m3.restype = ctypes.c_int
    lib.mok_cuda_quantize_rows_e4m3.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_quantize_blocks_e4m3.restype = ctypes.c_int
    lib.mok_cuda_quantize_blocks_e4m3.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
        ctypes.c_void_p] * 3 + [ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_experts_forward_fp8.restype = ctypes.c_int
    lib.mok_cuda_experts_forward_fp8.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 14 + [
        ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_experts_backward.restype = ctypes.c_int
    lib.mok_cuda_experts_backward.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 17 + [
        ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p,
        ctypes.c_int]
    lib.mok_cuda_experts_backward_fp8_dgrad.restype = ctypes.c_int
    # 4 sizes, 13 tensors (offsets .. d_w_down), d_w_bf16, has_limit, limit, status, 4 transposes,
    # the scratch and the stream, then the error buffer.
    lib.mok_cuda_experts_backward_fp8_dgrad.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 13 + [
        ctypes.c_int, ctypes.c_int, ctypes.c_float] + [ctypes.c_void_p] * 7 + [ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_fp8_dgrad_scratch_bytes.restype = ctypes.c_int64
    lib.mok_cuda_fp8_dgrad_scratch_bytes.argtypes = [ctypes.c_int64] * 3
    lib.mok_cuda_quantize_blocks_e4m3_transposed.restype = ctypes.c_int
    lib.mok_cuda_quantize_blocks_e4m3_transposed.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
        ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_copy_bytes.restype = ctypes.c_int
    lib.mok_cuda_copy_bytes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_symmetric_layout.restype = None
    lib.mok_cuda_symmetric_layout.argtypes = [ctypes.c_int64] * 4 + [ctypes.POINTER(ctypes.c_int64)]
    lib.mok_cuda_forward_create.restype = ctypes.c_void_p
    lib.mok_cuda_forward_create.argtypes = [ctypes.c_int64] * 7 + [
        ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_double, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_backward_run.restype = ctypes.c_int
    # handle, bases, then 10 tensors and events, d_w_bf16, replay, 6 context buffers, the fp8 replay's
    # 4 gate|up weight buffers (codes, scales), fp8_dgrad's 4 transposes and the stream, then the
    # error buffer.
    lib.mok_cuda_backward_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_void_p] * 10 + [
        ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 15 + [ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_forward_context_rows.restype = ctypes.c_int64
    lib.mok_cuda_forward_context_rows.argtypes = [ctypes.c_void_p]
    lib.mok_cuda_forward_destroy.restype = None
    lib.mok_cuda_forward_destroy.argtypes = [ctypes.c_void_p]
    lib.mok_cuda_forward_run.restype = ctypes.c_int
    # handle, bases, then 5 tensors and an event, 6 context buffers, schedule_given and the stream,
    # then the error buffer.
    lib.mok_cuda_forward_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_void_p] * 12 + [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_forward_run_fp8.restype = ctypes.c_int
    # handle, bases, then 6 weight tensors, y_shared, its event, y, 6 context buffers, schedule_given
    # and the stream, then the error buffer.
    lib.mok_cuda_forward_run_fp8.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)] + [
        ctypes.c_void_p] * 15 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_schedule_run.restype = ctypes.c_int
    # handle, bases, offsets, rows, src_rank, src_slot, send_counts, recv_counts, the stream, then the error buffer.
    lib.mok_cuda_schedule_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_void_p] * 7 + [
        ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_forward_row_capacity.restype = ctypes.c_int64
    lib.mok_cuda_forward_row_capacity.argtypes = [ctypes.c_void_p]
    lib.mok_cuda_forward_check.restype = ctypes.c_int
    lib.mok_cuda_forward_check.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.mok_cuda_dw_partial_blocks.restype = ctypes.c_int64
    lib.mok_cuda_dw_partial_blocks.argtypes = [ctypes.c_int64]
    lib.mok_cuda_row_align.restype = ctypes.c_int
    lib.mok_cuda_status_message.restype = ctypes.c_char_p
    lib.mok_cuda_status_message.argtypes = [ctypes.c_int]
    if lib.mok_cuda_row_align() != ROW_ALIGN:
        raise ImportError(f"libmok_cuda_capi row alignment {lib.mok_cuda_row_align()} != {ROW_ALIGN}")
    return lib


def available() -> bool:
    try:
        _lib()
        return torch.cuda.is_available()
    except (ImportError, OSError):
        return False


def padded_offsets(counts: list[int]) -> list[int]:
    """Start offsets of each expert's segment (and the end), each a multiple of ROW_ALIGN."""
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + (n + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN)
    return offsets


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _event(e: "torch.cuda.Event | None") -> int | None:
    """The cudaEvent_t of a recorded torch event (torch creates it at the first record)."""
    if e is None:
        return None
    if not e.cuda_event:
        raise ValueError("the ready event was never recorded: record it after the shared expert's kernels")
    return int(e.cuda_event)


def experts_forward(x_rows: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                    w_down: torch.Tensor, *, h: torch.Tensor, y: torch.Tensor, gu: torch.Tensor | None = None,
                    swiglu_limit: float | None = None, status: torch.Tensor | None = None, which: int = 0) -> None:
    """h = act(x W_gate^T, x W_up^T), y = h W_down^T on rows grouped by expert (offsets [El+1] int32,
    multiples of ROW_ALIGN, on the device). Writes h, y (and gu); asynchronous on the current stream.
    ``which``: 0 = both GEMMs, 1 = gate/up + SwiGLU only, 2 = down only (from h)."""
    if which not in (0, 1, 2):
        raise ValueError(f"which must be 0, 1 or 2, got {which}")
    El, I, H = w_gate.shape
    rows = x_rows.shape[0]
    for name, t, shape in (("x_rows", x_rows, (rows, H)), ("w_gate", w_gate, (El, I, H)), ("w_up", w_up, (El, I, H)),
                           ("w_down", w_down, (El, H, I)),
                           ("h", h, (rows, I)), ("y", y, (rows, H))) + ((("gu", gu, (rows, 2 * I)),) if gu is not None else ()):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CUDA tensor")
    if offsets.dtype != torch.int32 or offsets.shape != (El + 1,) or not offsets.is_cuda:
        raise ValueError(f"offsets must be int32 [{El + 1}] on the GPU, got {offsets.dtype} {tuple(offsets.shape)}")
    error = ctypes.create_string_buffer(512)
    rc = _lib().mok_cuda_experts_forward(
        rows, H, I, El, _ptr(offsets), _ptr(x_rows), _ptr(w_gate), _ptr(w_up), _ptr(w_down), _ptr(gu), _ptr(h), _ptr(y),
        int(swiglu_limit is not None), float(swiglu_limit or 0.0), _ptr(status),
        torch.cuda.current_stream().cuda_stream, which, error, len(error))
    if rc != 0:
        raise ValueError(error.value.decode())


def quantize_rows(x: torch.Tensor, *, k_major: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 rows of x [rows, cols] bf16: (codes [rows, cols] float8_e4m3fn, scales f32), one
    power-of-two scale per row and 128 columns: [ceil(cols / 128), rows] when k_major (what
    experts_forward_fp8 reads), else [rows, ceil(cols / 128)]. x = codes * scale within e4m3's precision.
    x must be finite (a NaN or infinity is not refused: its block's codes and scale are meaningless)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, cols], got shape {tuple(x.shape)}")
    rows, cols = x.shape
    _check_tensors((("x", x, (rows, cols), torch.bfloat16),))
    blocks = math.ceil(cols / 128)
    codes = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((blocks, rows) if k_major else (rows, blocks), dtype=torch.float32, device=x.device)
    error = ctypes.create_string_buffer(512)
    with torch.cuda.device(x.device):  # the kernel runs on the tensors' device, whichever is current
        rc = _lib().mok_cuda_quantize_rows_e4m3(_ptr(x), rows, cols, _ptr(codes), _ptr(scales), int(k_major), None,
                                                torch.cuda.current_stream(x.device).cuda_stream, error, len(error))
    if rc != 0:
        raise ValueError(error.value.decode())
    return codes, scales


def quantize_weights(w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 of each plane of w [planes, rows, cols] bf16 (an expert's matrix a plane):
    (codes float8_e4m3fn, scales f32 [planes, ceil(rows / 128), ceil(cols / 128)]), one power-of-two
    scale per 128 x 128 block; into ``out`` (codes, scales) when given, which it returns."""
    if w.dim() != 3:
        raise ValueError(f"w must be [planes, rows, cols], got shape {tuple(w.shape)}")
    planes, rows, cols = w.shape
    _check_tensors((("w", w, (planes, rows, cols), torch.bfloat16),))
    scale_shape = (planes, math.ceil(rows / 128), math.ceil(cols / 128))
    if out is None:
        codes = torch.empty((planes, rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
        scales = torch.empty(scale_shape, dtype=torch.float32, device=w.device)
    else:
        codes, scales = out
        _check_tensors((("codes", codes, (planes, rows, cols), torch.float8_e4m3fn),
                        ("scales", scales, scale_shape, torch.float32)), w.device)
    error = ctypes.create_string_buffer(512)
    with torch.cuda.device(w.device):
        rc = _lib().mok_cuda_quantize_blocks_e4m3(_ptr(w), planes, rows, cols, _ptr(codes), _ptr(scales),
                                                  torch.cuda.current_stream(w.device).cuda_stream, error, len(error))
    if rc != 0:
        raise ValueError(error.value.decode())
    return codes, scales


def _fp8_weight_specs(w_gate: tuple[torch.Tensor, torch.Tensor], w_up: tuple[torch.Tensor, torch.Tensor],
                      w_down: tuple[torch.Tensor, torch.Tensor] | None, El: int, H: int, I: int) -> list[tuple]:
    """The _check_tensors specs of the weights as :func:`quantize_weights` gives them: codes
    [El, I, H] (W_gate, W_up) and [El, H, I] (W_down, when given) float8_e4m3fn, with their 128 x 128
    block scales."""
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    gate_up_scales, down_scales = (El, math.ceil(I / 128), math.ceil(H / 128)), (El, math.ceil(H / 128), math.ceil(I / 128))
    specs = [("w_gate codes", w_gate[0], (El, I, H), e4m3), ("w_gate scales", w_gate[1], gate_up_scales, f32),
             ("w_up codes", w_up[0], (El, I, H), e4m3), ("w_up scales", w_up[1], gate_up_scales, f32)]
    if w_down is not None:
        specs += [("w_down codes", w_down[0], (El, H, I), e4m3), ("w_down scales", w_down[1], down_scales, f32)]
    return specs


def experts_forward_fp8(x: tuple[torch.Tensor, torch.Tensor], offsets: torch.Tensor,
                        w_gate: tuple[torch.Tensor, torch.Tensor], w_up: tuple[torch.Tensor, torch.Tensor],
                        w_down: tuple[torch.Tensor, torch.Tensor], *, h: torch.Tensor, y: torch.Tensor,
                        h_codes: tuple[torch.Tensor, torch.Tensor], gu: torch.Tensor | None = None,
                        swiglu_limit: float | None = None, status: torch.Tensor | None = None) -> None:
    """experts_forward on block-scaled e4m3 operands: x = quantize_rows(x_rows) (k-major), each weight
    = quantize_weights(w); writes h and y (bf16), h_codes = (codes, k-major scales) of h (down's
    input), and gu when given. hidden and intermediate are multiples of 128. Asynchronous on the
    current stream; rows at or past offsets[El] are not touched."""
    (xq, xs), (wgq, wgs), (wuq, wus), (wdq, wds), (hq, hs) = x, w_gate, w_up, w_down, h_codes
    El, I, H = wgq.shape
    rows = xq.shape[0]
    dev = xq.device
    specs = [("x codes", xq, (rows, H), torch.float8_e4m3fn), ("x scales", xs, (math.ceil(H / 128), rows), torch.float32),
             *_fp8_weight_specs(w_gate, w_up, w_down, El, H, I),
             ("h", h, (rows, I), torch.bfloat16), ("y", y, (rows, H), torch.bfloat16),
             ("h codes", hq, (rows, I), torch.float8_e4m3fn), ("h scales", hs, (math.ceil(I / 128), rows), torch.float32)]
    if gu is not None:
        specs.append(("gu", gu, (rows, 2 * I), torch.bfloat16))
    _check_tensors(tuple(specs), dev)
    if offsets.dtype != torch.int32 or offsets.shape != (El + 1,) or offsets.device != dev:
        raise ValueError(f"offsets must be int32 [{El + 1}] on {dev}, got {offsets.dtype} {tuple(offsets.shape)} "
                         f"on {offsets.device}")
    error = ctypes.create_string_buffer(512)
    with torch.cuda.device(dev):
        rc = _lib().mok_cuda_experts_forward_fp8(
            rows, H, I, El, _ptr(offsets), _ptr(xq), _ptr(xs), _ptr(wgq), _ptr(wgs), _ptr(wuq), _ptr(wus), _ptr(wdq),
            _ptr(wds), _ptr(gu), _ptr(h), _ptr(hq), _ptr(hs), _ptr(y), int(swiglu_limit is not None),
            float(swiglu_limit or 0.0), _ptr(status), torch.cuda.current_stream(dev).cuda_stream, error, len(error))
    if rc != 0:
        raise ValueError(error.value.decode())


def check_addressable(name: str, t: torch.Tensor, device: torch.device) -> None:
    """A tensor the kernels read by its address: on ``device``, dense and 16-byte aligned."""
    if t.device != device or not t.is_contiguous() or t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must be a contiguous, 16-byte aligned tensor on {device} (the kernels read it by "
                         f"address), got strides {t.stride()} at offset {t.storage_offset()} on {t.device}")


def _check_tensors(specs: tuple[tuple[str, torch.Tensor, tuple[int, ...], torch.dtype], ...],
                   device: torch.device | None = None) -> None:
    for name, t, shape, dtype in specs:
        if device is not None and isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CUDA tensor")


class BackwardScratch:
    """The scratch rows of experts_backward (dg|du, w*h, d topk_w partials), allocated once per shape."""

    def __init__(self, rows: int, intermediate: int, device: torch.device) -> None:
        blocks = int(_lib().mok_cuda_dw_partial_blocks(intermediate))
        self.dgu = torch.empty(rows, 2 * intermediate, dtype=torch.bfloat16, device=device)
        self.hw = torch.empty(rows, intermediate, dtype=torch.bfloat16, device=device)
        self.dw_partial = torch.empty(rows, blocks, dtype=torch.float32, device=device)


def _grad_dtype(d_w_gate: torch.Tensor) -> torch.dtype:
    """The weight gradients' element type, from d_w_gate: fp32, or bf16 (written by the kernels,
    half the bytes). The other two must match (_check_tensors says so)."""
    if d_w_gate.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"d_w_gate must be float32 or bfloat16, got {d_w_gate.dtype}")
    return d_w_gate.dtype


def experts_backward(x_rows: torch.Tensor, offsets: torch.Tensor, gu: torch.Tensor, h: torch.Tensor,
                     dy: torch.Tensor, row_weight: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                     w_down: torch.Tensor, *, dx: torch.Tensor, d_row_weight: torch.Tensor, d_w_gate: torch.Tensor,
                     d_w_up: torch.Tensor, d_w_down: torch.Tensor, scratch: BackwardScratch,
                     swiglu_limit: float | None = None, status: torch.Tensor | None = None, which: int = 0) -> None:
    """The backward of experts_forward on the same rows (row_weight: each row's router weight, 0 for
    padding rows): dx, d row weight and the weight gradients (fp32, or bf16 when d_w_* are), in a
    fixed reduction order. Asynchronous on the current stream. ``which``: 0 = all of it, 1 = the
    dgrad steps only (dx, d row weight, scratch), 2 = the weight gradients only (from the scratch a
    dgrad call left); 3 and 4 = the dgrad's launches apart (dh with the SwiGLU backward; dx)."""
    if which not in (0, 1, 2, 3, 4):
        raise ValueError(f"which must be 0 to 4, got {which}")
    El, I, H = w_gate.shape
    rows = x_rows.shape[0]
    bf16, f32 = torch.bfloat16, torch.float32
    gw = _grad_dtype(d_w_gate)
    _check_tensors((
        ("x_rows", x_rows, (rows, H), bf16), ("gu", gu, (rows, 2 * I), bf16), ("h", h, (rows, I), bf16),
        ("dy", dy, (rows, H), bf16), ("row_weight", row_weight, (rows,), f32),
        ("w_gate", w_gate, (El, I, H), bf16), ("w_up", w_up, (El, I, H), bf16), ("w_down", w_down, (El, H, I), bf16),
        ("dx", dx, (rows, H), bf16), ("d_row_weight", d_row_weight, (rows,), f32),
        ("d_w_gate", d_w_gate, (El, I, H), gw), ("d_w_up", d_w_up, (El, I, H), gw),
        ("d_w_down", d_w_down, (El, H, I), gw), ("scratch.dgu", scratch.dgu, (rows, 2 * I), bf16),
        ("scratch.hw", scratch.hw, (rows, I), bf16),
        ("scratch.dw_partial", scratch.dw_partial, (rows, int(_lib().mok_cuda_dw_partial_blocks(I))), f32)))
    if offsets.dtype != torch.int32 or offsets.shape != (El + 1,) or not offsets.is_cuda:
        raise ValueError(f"offsets must be int32 [{El + 1}] on the GPU, got {offsets.dtype} {tuple(offsets.shape)}")
    error = ctypes.create_string_buffer(512)
    rc = _lib().mok_cuda_experts_backward(
        rows, H, I, El, _ptr(offsets), _ptr(x_rows), _ptr(gu), _ptr(h), _ptr(dy), _ptr(row_weight), _ptr(w_gate),
        _ptr(w_up), _ptr(w_down), _ptr(scratch.dgu), _ptr(scratch.hw), _ptr(scratch.dw_partial), _ptr(dx),
        _ptr(d_row_weight), _ptr(d_w_gate), _ptr(d_w_up), _ptr(d_w_down), int(gw == bf16),
        int(swiglu_limit is not None),
        float(swiglu_limit or 0.0), _ptr(status), torch.cuda.current_stream().cuda_stream, which, error, len(error))
    if rc != 0:
        raise ValueError(error.value.decode())


def quantize_transposed(w_down: torch.Tensor | None = None, w_gate: torch.Tensor | None = None,
                        w_up: torch.Tensor | None = None, *,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None,
                        plain: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 dgrad's weight operands, block-scaled e4m3 of the weights' transposes (a 128 x 128
    block's scale is its transpose's: the codes are quantize_weights', moved): either
    W_down^T [El, I, H] from w_down [El, H, I] bf16, with scales [El, I / 128, H / 128]; or
    [W_gate^T | W_up^T] [El, H, 2I] from w_gate and w_up [El, I, H] bf16, with scales
    [El, H / 128, 2I / 128]. Into ``out`` (codes, scales) when given, which it returns. ``plain``:
    (codes, scales) for each given weight, shaped as :func:`quantize_weights` makes them, written
    in the same pass (each weight read once for both layouts)."""
    if (w_down is None) == (w_gate is None) or (w_gate is None) != (w_up is None):
        raise ValueError("give w_down alone, or w_gate and w_up")
    planes_of = [w_down] if w_down is not None else [w_gate, w_up]
    names = ("w_down",) if w_down is not None else ("w_gate", "w_up")
    first = planes_of[0]
    if first.dim() != 3:
        raise ValueError(f"the weights must be [planes, rows, cols], got shape {tuple(first.shape)}")
    planes, rows, cols = first.shape
    _check_tensors(tuple((name, w, (planes, rows, cols), torch.bfloat16) for name, w in zip(names, planes_of)))
    if rows % 128 or cols % 128:
        raise ValueError(f"the weights' rows and columns must be multiples of 128, got {rows} x {cols}")
    ld = rows * len(planes_of)
    shape, scale_shape = (planes, cols, ld), (planes, cols // 128, ld // 128)
    if out is None:
        codes = torch.empty(shape, dtype=torch.float8_e4m3fn, device=first.device)
        scales = torch.empty(scale_shape, dtype=torch.float32, device=first.device)
    else:
        codes, scales = out
        _check_tensors((("codes", codes, shape, torch.float8_e4m3fn), ("scales", scales, scale_shape, torch.float32)),
                       first.device)
    if plain is not None:
        if len(plain) != len(planes_of):
            raise ValueError(f"plain must hold (codes, scales) for each of {', '.join(names)}, got {len(plain)}")
        _check_tensors(tuple(spec for name, (c, sc) in zip(names, plain) for spec in (
            (f"{name}'s codes", c, (planes, rows, cols), torch.float8_e4m3fn),
            (f"{name}'s scales", sc, (planes, rows // 128, cols // 128), torch.float32))), first.device)
    error = ctypes.create_string_buffer(512)
    with torch.cuda.device(first.device):
        for i, w in enumerate(planes_of):
            plain_codes, plain_scales = (None, None) if plain is None else (_ptr(plain[i][0]), _ptr(plain[i][1]))
            rc = _lib().mok_cuda_quantize_blocks_e4m3_transposed(
                _ptr(w), planes, rows, cols, plain_codes, plain_scales, _ptr(codes), _ptr(scales), ld, i * rows,
                torch.cuda.current_stream(first.device).cuda_stream, error, len(error))
            if rc != 0:
                raise ValueError(error.value.decode())
    return codes, scales


Quantized = tuple[torch.Tensor, torch.Tensor]  # (codes float8_e4m3fn, f32 scales)


def quantize_for_dgrad(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                       out: tuple[tuple[Quantized, Quantized, Quantized], tuple[Quantized, Quantized]] | None = None
                       ) -> tuple[tuple[Quantized, Quantized, Quantized], tuple[Quantized, Quantized]]:
    """All of precision fp8_dgrad's weight operands, each weight read once: ((codes, scales) of w_gate,
    w_up and w_down as :func:`quantize_weights` gives them, (W_down^T, [W_gate^T | W_up^T]) as
    :func:`quantize_transposed` gives them). Into ``out`` (the same nesting) when given: the
    result holds its tensors."""
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if w.dim() != 3 or w.shape[1] % 128 or w.shape[2] % 128:
            raise ValueError(f"{name} must be [planes, rows, cols] with rows and columns multiples of 128, got "
                             f"shape {tuple(w.shape)}")
    El, I, H = w_gate.shape
    if tuple(w_down.shape) != (El, H, I):
        raise ValueError(f"w_down must be [El, H, I] = {(El, H, I)} beside w_gate {tuple(w_gate.shape)}, got "
                         f"{tuple(w_down.shape)}")
    if out is not None and (len(out) != 2 or len(out[0]) != 3 or len(out[1]) != 2):
        raise ValueError("out must be ((codes, scales) x 3 weights, (codes, scales) x 2 transposes)")
    if out is None:
        plain = tuple((torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
                       torch.empty(w.shape[0], w.shape[1] // 128, w.shape[2] // 128, dtype=torch.float32,
                                   device=w.device)) for w in (w_gate, w_up, w_down))
        transposes: tuple[Quantized | None, Quantized | None] = (None, None)
    else:
        plain, transposes = out
    down_t = quantize_transposed(w_down, out=transposes[0], plain=(plain[2],))
    gate_up_t = quantize_transposed(w_gate=w_gate, w_up=w_up, out=transposes[1], plain=(plain[0], plain[1]))
    return (plain[0], plain[1], plain[2]), (down_t, gate_up_t)


def fp8_dgrad_scratch(rows: int, hidden: int, intermediate: int, device: torch.device) -> torch.Tensor:
    """The scratch of :func:`experts_backward_fp8_dgrad` for `rows` rows (dy's and dg|du's codes and
    scales, the d row weight partials), uint8."""
    n = int(_lib().mok_cuda_fp8_dgrad_scratch_bytes(rows, hidden, intermediate))
    return torch.empty(n, dtype=torch.uint8, device=device)


def experts_backward_fp8_dgrad(x_rows: torch.Tensor, offsets: torch.Tensor, gu: torch.Tensor, h: torch.Tensor,
                               dy: torch.Tensor, row_weight: torch.Tensor,
                               w_down_t: tuple[torch.Tensor, torch.Tensor],
                               w_gate_up_t: tuple[torch.Tensor, torch.Tensor], *, dx: torch.Tensor,
                               d_row_weight: torch.Tensor, d_w_gate: torch.Tensor, d_w_up: torch.Tensor,
                               d_w_down: torch.Tensor, scratch: BackwardScratch, dgrad_scratch: torch.Tensor,
                               swiglu_limit: float | None = None, status: torch.Tensor | None = None) -> None:
    """experts_backward at precision fp8_dgrad: dh and dx on block-scaled e4m3 (dy's and dg|du's rows
    quantized 1 x 128; the weights' transposes from :func:`quantize_transposed`), the SwiGLU
    backward, d row weight and the weight gradients as experts_backward computes them (scratch's
    dgu and hw; its dw_partial unused). dgrad_scratch: :func:`fp8_dgrad_scratch` of these rows.
    Asynchronous on the current stream."""
    (wdt, wdts), (wgut, wguts) = w_down_t, w_gate_up_t
    El, I, H = wdt.shape
    rows = x_rows.shape[0]
    bf16, f32, e4m3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
    gw = _grad_dtype(d_w_gate)
    need = int(_lib().mok_cuda_fp8_dgrad_scratch_bytes(rows, H, I))
    _check_tensors((
        ("x_rows", x_rows, (rows, H), bf16), ("gu", gu, (rows, 2 * I), bf16), ("h", h, (rows, I), bf16),
        ("dy", dy, (rows, H), bf16), ("row_weight", row_weight, (rows,), f32),
        ("w_down_t codes", wdt, (El, I, H), e4m3), ("w_down_t scales", wdts, (El, I // 128, H // 128), f32),
        ("w_gate_up_t codes", wgut, (El, H, 2 * I), e4m3),
        ("w_gate_up_t scales", wguts, (El, H // 128, 2 * I // 128), f32),
        ("dx", dx, (rows, H), bf16), ("d_row_weight", d_row_weight, (rows,), f32),
        ("d_w_gate", d_w_gate, (El, I, H), gw), ("d_w_up", d_w_up, (El, I, H), gw),
        ("d_w_down", d_w_down, (El, H, I), gw), ("scratch.dgu", scratch.dgu, (rows, 2 * I), bf16),
        ("scratch.hw", scratch.hw, (rows, I), bf16), ("dgrad_scratch", dgrad_scratch, (need,), torch.uint8)))
    if offsets.dtype != torch.int32 or offsets.shape != (El + 1,) or not offsets.is_cuda:
        raise ValueError(f"offsets must be int32 [{El + 1}] on the GPU, got {offsets.dtype} {tuple(offsets.shape)}")
    error = ctypes.create_string_buffer(512)
    rc = _lib().mok_cuda_experts_backward_fp8_dgrad(
        rows, H, I, El, _ptr(offsets), _ptr(x_rows), _ptr(gu), _ptr(h), _ptr(dy), _ptr(row_weight),
        _ptr(scratch.dgu), _ptr(scratch.hw), _ptr(dx), _ptr(d_row_weight), _ptr(d_w_gate), _ptr(d_w_up),
        _ptr(d_w_down), int(gw == bf16), int(swiglu_limit is not None), float(swiglu_limit or 0.0), _ptr(status),
        _ptr(wdt), _ptr(wdts), _ptr(wgut), _ptr(wguts), _ptr(dgrad_scratch), torch.cuda.current_stream().cuda_stream,
        error, len(error))
    if rc != 0:
        raise ValueError(error.value.decode())


def copy_bytes(dst_ptr: int, src_ptr: int, nbytes: int, blocks: int = 0) -> None:
    """An SM copy between raw device addresses (either may be a peer's symmetric-memory address) on
    the current stream; 16-byte aligned pointers and size. For the harness's NVLink ceilings."""
    error = ctypes.create_string_buffer(256)
    rc = _lib().mok_cuda_copy_bytes(dst_ptr, src_ptr, nbytes, blocks, torch.cuda.current_stream().cuda_stream,
                                    error, len(error))
    if rc != 0:
        raise ValueError(error.value.decode())


LAYOUT_FIELDS = ("total", "x", "topk_idx", "topk_w", "combine", "dy", "dx_slots", "dw_slots", "signals")


def symmetric_layout(tokens: int, hidden: int, topk: int, ranks: int) -> dict[str, int]:
    """Byte offsets of one rank's symmetric buffer (mok::SymmetricLayout) and its total size."""
    out = (ctypes.c_int64 * len(LAYOUT_FIELDS))()
    _lib().mok_cuda_symmetric_layout(tokens, hidden, topk, ranks, out)
    return dict(zip(LAYOUT_FIELDS, list(out)))


def _raise(rc: int, error: ctypes.Array) -> None:
    """rc 1: the arguments were refused (ValueError); rc 2: an earlier call failed, or CUDA did."""
    if rc == 1:
        raise ValueError(error.value.decode())
    if rc != 0:
        raise RuntimeError(f"mok fused forward: {error.value.decode()}")


def symmetric_view(buffer: torch.Tensor, layout: dict[str, int], name: str, dtype: torch.dtype,
                   shape: tuple[int, ...]) -> torch.Tensor:
    """Region ``name`` of a rank's symmetric buffer (uint8, laid out by :func:`symmetric_layout`)
    as a ``dtype`` tensor of ``shape``."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return buffer[layout[name]: layout[name] + nbytes].view(dtype).view(shape)


class Context:
    """What a training forward keeps for its backward (allocated per call from torch's allocator,
    saved by autograd): the schedule, and with ``rows`` every routed row's x, h and g|u. Without
    rows (a replay context) the forward runs in the handle's ring and the backward replays the
    rows into buffers it allocates for that call only (:meth:`FusedForward.backward`). An fp8
    forward's context keeps h and g|u but no x rows: its backward pulls the bf16 rows again."""

    def __init__(self, fused: "FusedForward", device: torch.device, rows: bool = True) -> None:
        cap = fused.row_capacity
        self.replay = not rows
        self.x_rows = self.h = self.gu = None
        if rows:
            self.x_rows, self.h, self.gu = fused.row_buffers(device)
        self.offsets = torch.empty(fused.local_experts + 1, dtype=torch.int32, device=device)
        self.src_rank = torch.empty(cap, dtype=torch.int32, device=device)
        self.src_slot = torch.empty(cap, dtype=torch.int32, device=device)

    @classmethod
    def of(cls, replay: bool, x_rows: torch.Tensor | None, h: torch.Tensor | None, gu: torch.Tensor | None,
           offsets: torch.Tensor, src_rank: torch.Tensor, src_slot: torch.Tensor) -> "Context":
        """A context from tensors a forward filled (the traceable op hands them over as its outputs;
        the eager layer's backward gets them back from autograd's saved tensors)."""
        context = cls.__new__(cls)
        context.replay = replay
        context.x_rows, context.h, context.gu = x_rows, h, gu
        context.offsets, context.src_rank, context.src_slot = offsets, src_rank, src_slot
        return context

    def pointers(self) -> list[int | None]:
        return [None if t is None else t.data_ptr()
                for t in (self.x_rows, self.h, self.gu, self.offsets, self.src_rank, self.src_slot)]


class FusedForward:
    """One rank's fused MoE forward (the megakernel with its schedule, barrier and combine).

    Local buffers are allocated once here, on the current device; the symmetric buffers (one per
    rank, laid out by :func:`symmetric_layout`) belong to the caller, whose x, topk_idx (int32) and
    topk_w must be written into this rank's before every :meth:`run`. Every rank of the group
    must make the same sequence of calls. Errors of a call (a rank that never came, a bad expert
    id) are sticky and reported by :meth:`check`, which synchronizes.
    """

    def __init__(self, *, ranks: int, rank: int, tokens: int, hidden: int, intermediate: int, num_experts: int,
                 topk: int, swiglu_limit: float | None = None, comm_sms: int = 0, minibatch_rows: int = 0,
                 ring_rows: int = 0, fused_backward: int = -1, keep_rows: bool = False, fp8: bool = False,
                 fp8_dgrad: bool = False, timeout_s: float = 10.0) -> None:
        """fp8: the block-scaled fp8 forward (:meth:`run_fp8`); fp8_dgrad (with fp8): its backward's
        data gradients on e4m3 too (the stage kernels, whatever fused_backward says)."""
        self._handle = None
        if fp8_dgrad and not fp8:
            raise ValueError("fp8_dgrad is the backward of an fp8 forward: give fp8=True")
        plan = ctypes.create_string_buffer(4096)
        error = ctypes.create_string_buffer(512)
        handle = _lib().mok_cuda_forward_create(
            ranks, rank, tokens, hidden, intermediate, num_experts, topk, int(swiglu_limit is not None),
            float(swiglu_limit or 0.0), comm_sms, minibatch_rows, ring_rows, fused_backward, int(keep_rows),
            2 if fp8_dgrad else int(fp8),
            timeout_s,
            plan,
            len(plan), error, len(error))
        if not handle:
            raise ValueError(error.value.decode())
        self._handle = handle
        self.plan = plan.value.decode()
        self.ranks, self.tokens, self.hidden, self.intermediate, self.topk = ranks, tokens, hidden, intermediate, topk
        self.local_experts = num_experts // ranks
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.keep_rows = keep_rows
        self.fp8 = fp8
        self.fp8_dgrad = fp8_dgrad
        self.row_capacity = int(_lib().mok_cuda_forward_row_capacity(handle))
        self.context_rows = int(_lib().mok_cuda_forward_context_rows(handle))

    def _check_bases(self, bases: list[int], device: torch.device) -> None:
        if not self._handle:  # a null handle would reach the C API as a null pointer
            raise RuntimeError("mok: this workspace was released (mok.clear_workspace_cache): get a new one "
                               "(mok.get_workspace; mok.moe makes its own at its next call)")
        if len(bases) != self.ranks:
            raise ValueError(f"bases has {len(bases)} addresses, expected one per rank ({self.ranks})")
        if device != self.device:
            raise ValueError(f"tensors are on {device}, but this FusedForward was made on {self.device}")

    def new_context(self, device: torch.device, *, replay: bool = False) -> Context:
        """A context for one training forward: every row kept, or (``replay``) only the schedule."""
        if not self.keep_rows:
            raise ValueError("this FusedForward was made without keep_rows: it keeps no context")
        return Context(self, device, rows=not replay)

    def row_buffers(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """x_rows [context rows, H], h [context rows, I], g|u [context rows, 2I], bf16, uninitialized
        (fp8: x_rows is None, the handle pulls them into its own buffer)."""
        def rows(n: int) -> torch.Tensor:
            return torch.empty(self.context_rows, n, dtype=torch.bfloat16, device=device)

        I = self.intermediate
        return (None if self.fp8 else rows(self.hidden)), rows(I), rows(2 * I)

    def run(self, bases: list[int], w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, y: torch.Tensor,
            *, y_shared: torch.Tensor | None = None, y_shared_ready: torch.cuda.Event | None = None,
            context: Context | None = None, schedule_given: bool = False) -> None:
        """Asynchronous on the current stream. bases: every rank's symmetric buffer address.
        y_shared_ready: an event recorded after y_shared on another stream; only the combine at the
        end of the call waits for it. context (keep_rows only): where this call keeps what its
        backward needs. schedule_given: the context's schedule holds this call's schedule already
        (:meth:`schedule` built it from the topk_idx every rank has written again); not rebuilt."""
        T, H, I = self.tokens, self.hidden, self.intermediate
        El = self.local_experts
        bf16 = torch.bfloat16
        self._check_bases(bases, y.device)
        specs = [("w_gate", w_gate, (El, I, H), bf16), ("w_up", w_up, (El, I, H), bf16),
                 ("w_down", w_down, (El, H, I), bf16), ("y", y, (T, H), bf16)]
        if y_shared is not None:
            specs.append(("y_shared", y_shared, (T, H), bf16))
        _check_tensors(tuple(specs), device=y.device)
        table = (ctypes.c_int64 * self.ranks)(*bases)
        error = ctypes.create_string_buffer(512)
        ctx = context.pointers() if context is not None else [None] * 6
        rc = _lib().mok_cuda_forward_run(self._handle, table, _ptr(w_gate), _ptr(w_up), _ptr(w_down), _ptr(y_shared),
                                         _event(y_shared_ready), _ptr(y), *ctx, int(schedule_given),
                                         torch.cuda.current_stream().cuda_stream, error, len(error))
        _raise(rc, error)

    def run_fp8(self, bases: list[int], w_gate: tuple[torch.Tensor, torch.Tensor],
                w_up: tuple[torch.Tensor, torch.Tensor], w_down: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor,
                *, y_shared: torch.Tensor | None = None, y_shared_ready: torch.cuda.Event | None = None,
                context: Context | None = None, schedule_given: bool = False) -> None:
        """The block-scaled fp8 forward (a FusedForward made with ``fp8``): each weight as
        :func:`quantize_weights` gives it, (codes float8_e4m3fn, 128 x 128 block scales); the call
        quantizes this rank's x (in its symmetric buffer) itself. Otherwise as :meth:`run`; its
        context (keep_rows) keeps h and g|u for :meth:`backward`, which runs the bf16 backward on
        them (the bf16 weights; the quantization passes gradients straight through). Asynchronous
        on the current stream."""
        T, H, I = self.tokens, self.hidden, self.intermediate
        El = self.local_experts
        self._check_bases(bases, y.device)
        specs = [*_fp8_weight_specs(w_gate, w_up, w_down, El, H, I), ("y", y, (T, H), torch.bfloat16)]
        if y_shared is not None:
            specs.append(("y_shared", y_shared, (T, H), torch.bfloat16))
        _check_tensors(tuple(specs), device=y.device)
        table = (ctypes.c_int64 * self.ranks)(*bases)
        error = ctypes.create_string_buffer(512)
        ctx = context.pointers() if context is not None else [None] * 6
        rc = _lib().mok_cuda_forward_run_fp8(
            self._handle, table, _ptr(w_gate[0]), _ptr(w_gate[1]), _ptr(w_up[0]), _ptr(w_up[1]), _ptr(w_down[0]),
            _ptr(w_down[1]), _ptr(y_shared), _event(y_shared_ready), _ptr(y), *ctx, int(schedule_given),
            torch.cuda.current_stream().cuda_stream, error, len(error))
        _raise(rc, error)

    def schedule(self, bases: list[int], offsets: torch.Tensor, rows: torch.Tensor, src_rank: torch.Tensor,
                 src_slot: torch.Tensor, send_counts: torch.Tensor | None = None,
                 recv_counts: torch.Tensor | None = None) -> None:
        """This rank's schedule alone (keep_rows), one call of the sequence every rank makes: every
        rank has written its topk_idx into its symmetric buffer. offsets [El+1], rows [El] (each
        expert's real rows), src_rank and src_slot [row capacity] (-1 past the real rows), int32: a
        context's schedule that a :meth:`run` with ``schedule_given`` runs on. Optional, int64
        [ranks]: send_counts (this rank's slots routed to each rank's experts) and recv_counts (the
        schedule's rows pulled from each rank). Asynchronous."""
        El, cap, R, i32, i64 = self.local_experts, self.row_capacity, self.ranks, torch.int32, torch.int64
        self._check_bases(bases, offsets.device)
        counts = tuple((name, t, (R,), i64) for name, t in (("send_counts", send_counts), ("recv_counts", recv_counts))
                       if t is not None)
        _check_tensors((("offsets", offsets, (El + 1,), i32), ("rows", rows, (El,), i32),
                        ("src_rank", src_rank, (cap,), i32), ("src_slot", src_slot, (cap,), i32)) + counts,
                       device=offsets.device)
        table = (ctypes.c_int64 * self.ranks)(*bases)
        error = ctypes.create_string_buffer(512)
        rc = _lib().mok_cuda_schedule_run(self._handle, table, _ptr(offsets), _ptr(rows), _ptr(src_rank),
                                          _ptr(src_slot), _ptr(send_counts), _ptr(recv_counts),
                                          torch.cuda.current_stream().cuda_stream, error, len(error))
        _raise(rc, error)

    def backward(self, bases: list[int], w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                 dx: torch.Tensor, d_topk_w: torch.Tensor, d_w_gate: torch.Tensor, d_w_up: torch.Tensor,
                 d_w_down: torch.Tensor, context: Context, dx_shared: torch.Tensor | None = None,
                 dx_shared_ready: torch.cuda.Event | None = None,
                 fp8_gate_up: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 fp8_transposes: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> None:
        """The backward of the :meth:`run` that kept ``context``: every rank has written its dy,
        topk_w and that run's topk_idx (whose empty slots, id -1, the dx sum and d topk_w skip) into its
        symmetric buffer (and its x too when the context is a replay one: the rows
        are then pulled and gate|up run again, into buffers that live for this call only; or an
        fp8 one: the bf16 rows are pulled again, w_* are the bf16 weights, and a replay reruns the
        fp8 gate|up with ``fp8_gate_up`` = (W_gate, W_up) as :meth:`run_fp8` took them). Weight
        gradients are fp32, or bf16 when d_w_* are (the kernels write them, half the bytes).
        dx_shared is added in the fp32 dx sum (one rounding); dx_shared_ready: an event recorded
        after it on another stream, which only that sum waits for. On an fp8_dgrad handle
        ``fp8_transposes`` = (W_down^T, [W_gate^T | W_up^T]) from :func:`quantize_transposed`.
        Asynchronous."""
        T, H, I = self.tokens, self.hidden, self.intermediate
        El = self.local_experts
        bf16, f32 = torch.bfloat16, torch.float32
        gw = _grad_dtype(d_w_gate)
        self._check_bases(bases, dx.device)
        specs = [("w_gate", w_gate, (El, I, H), bf16), ("w_up", w_up, (El, I, H), bf16),
                 ("w_down", w_down, (El, H, I), bf16), ("dx", dx, (T, H), bf16),
                 ("d_topk_w", d_topk_w, (T, self.topk), f32),
                 ("d_w_gate", d_w_gate, (El, I, H), gw), ("d_w_up", d_w_up, (El, I, H), gw),
                 ("d_w_down", d_w_down, (El, H, I), gw)]
        if dx_shared is not None:
            specs.append(("dx_shared", dx_shared, (T, H), bf16))
        _check_tensors(tuple(specs), device=dx.device)
        table = (ctypes.c_int64 * self.ranks)(*bases)
        error = ctypes.create_string_buffer(512)
        ctx = context.pointers()
        # The replayed rows: held until the call's kernels are queued on this stream, then given back
        # to torch's cache (stream-ordered, like any temporary).
        replayed = self.row_buffers(dx.device) if context.replay else ()
        if replayed:
            ctx[:3] = [None if t is None else t.data_ptr() for t in replayed]
        gate_up = [None] * 4
        if self.fp8 and context.replay:
            if fp8_gate_up is None:
                raise ValueError("an fp8 replay reruns the fp8 gate|up: give fp8_gate_up (W_gate and W_up as run_fp8 "
                                 "took them)")
            (wgq, wgs), (wuq, wus) = fp8_gate_up
            El, I, H = self.local_experts, self.intermediate, self.hidden
            _check_tensors(tuple(_fp8_weight_specs(fp8_gate_up[0], fp8_gate_up[1], None, El, H, I)), device=dx.device)
            gate_up = [wgq.data_ptr(), wgs.data_ptr(), wuq.data_ptr(), wus.data_ptr()]
        transposes = [None] * 4
        if self.fp8_dgrad:
            if fp8_transposes is None:
                raise ValueError("an fp8_dgrad backward reads the weights' e4m3 transposes: give fp8_transposes "
                                 "(quantize_transposed of w_down, and of w_gate with w_up)")
            (wdt, wdts), (wgut, wguts) = fp8_transposes
            e4m3 = torch.float8_e4m3fn
            _check_tensors((("W_down^T codes", wdt, (El, I, H), e4m3),
                            ("W_down^T scales", wdts, (El, I // 128, H // 128), f32),
                            ("[W_gate^T | W_up^T] codes", wgut, (El, H, 2 * I), e4m3),
                            ("[W_gate^T | W_up^T] scales", wguts, (El, H // 128, 2 * I // 128), f32)), device=dx.device)
            transposes = [wdt.data_ptr(), wdts.data_ptr(), wgut.data_ptr(), wguts.data_ptr()]
        elif fp8_transposes is not None:
            raise ValueError("fp8_transposes are for a FusedForward made with fp8_dgrad=True")
        rc = _lib().mok_cuda_backward_run(
            self._handle, table, _ptr(w_gate), _ptr(w_up), _ptr(w_down), _ptr(dx_shared), _event(dx_shared_ready),
            _ptr(dx), _ptr(d_topk_w),
            _ptr(d_w_gate), _ptr(d_w_up), _ptr(d_w_down), int(gw == bf16), int(context.replay), *ctx, *gate_up,
            *transposes, torch.cuda.current_stream().cuda_stream, error, len(error))
        del replayed
        _raise(rc, error)

    def check(self) -> None:
        """Raises RuntimeError naming the rank and the wait (or the bad expert id) if a call failed."""
        if not self._handle:
            return  # released (mok.clear_workspace_cache): its status went with it
        message = ctypes.create_string_buffer(1024)
        if _lib().mok_cuda_forward_check(self._handle, message, len(message)) != 0:
            raise RuntimeError(f"mok fused forward: {message.value.decode()}")

    def close(self) -> None:
        if self._handle:
            _lib().mok_cuda_forward_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
