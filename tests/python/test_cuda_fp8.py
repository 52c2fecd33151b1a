"""The experts' block-scaled e4m3 forward through the C API (mok._cuda_kernels: quantize_rows,
quantize_weights, experts_forward_fp8) against plain torch on the dequantized operands; skipped
where there is no Hopper GPU or the sm_90a library is not built (tools/gpu.sh runs it)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("mok")
from mok import _cuda_kernels  # noqa: E402
from mok import testing  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and _cuda_kernels.available()),
    reason="needs an sm_90 GPU and libmok_cuda_capi.so",
)


@pytest.mark.parametrize("limit", [None, 0.75])
def test_fp8_forward_matches_torch_on_the_dequantized_operands(limit: float | None) -> None:
    gen = torch.Generator("cuda").manual_seed(5)
    H, I, counts = 512, 256, [100, 0, 300]
    El = len(counts)
    offsets = _cuda_kernels.padded_offsets(counts)
    rows = offsets[-1] + 128  # slack past the experts: never written
    x = torch.zeros(rows, H, device="cuda", dtype=torch.bfloat16)
    for e, n in enumerate(counts):
        x[offsets[e]:offsets[e] + n] = torch.randn(n, H, device="cuda", generator=gen).to(torch.bfloat16)
    w = [(torch.randn(El, a, b, device="cuda", generator=gen) / b ** 0.5).to(torch.bfloat16)
         for a, b in ((I, H), (I, H), (H, I))]
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")

    xq = _cuda_kernels.quantize_rows(x)
    assert testing.relative_error(testing.dequantize_e4m3_rows(*xq), x.float()) < 0.04  # e4m3: 3 mantissa bits
    wq = [_cuda_kernels.quantize_weights(t) for t in w]
    poison = float("nan")
    h = torch.full((rows, I), poison, device="cuda", dtype=torch.bfloat16)
    y = torch.full((rows, H), poison, device="cuda", dtype=torch.bfloat16)
    gu = torch.full((rows, 2 * I), poison, device="cuda", dtype=torch.bfloat16)
    hq = (torch.empty(rows, I, device="cuda", dtype=torch.float8_e4m3fn),
          torch.empty(I // 128, rows, device="cuda", dtype=torch.float32))
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    _cuda_kernels.experts_forward_fp8(xq, off, *wq, h=h, y=y, h_codes=hq, gu=gu, swiglu_limit=limit, status=status)
    torch.cuda.synchronize()
    assert status.item() == 0
    m = offsets[-1]
    assert torch.isnan(y[m:].float()).all() and torch.isnan(h[m:].float()).all(), "rows past the experts were written"

    # torch on the dequantized operands (per expert): g|u, h, then y from the kernel's own h codes.
    xd = testing.dequantize_e4m3_rows(*xq)
    wg, wu, wd = (testing.dequantize_e4m3_blocks(*q) for q in wq)
    hd = testing.dequantize_e4m3_rows(*hq)
    for e in range(El):
        a, b = offsets[e], offsets[e + 1]
        if a == b:
            continue
        g, u = xd[a:b] @ wg[e].t(), xd[a:b] @ wu[e].t()
        assert testing.relative_error(gu[a:b, :I].float(), g) < 1e-2
        assert testing.relative_error(gu[a:b, I:].float(), u) < 1e-2
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        assert testing.relative_error(h[a:b].float(), torch.nn.functional.silu(g) * u) < 1e-2
        assert testing.relative_error(hd[a:b], h[a:b].float()) < 0.04
        assert testing.relative_error(y[a:b].float(), hd[a:b] @ wd[e].t()) < 1e-2

    again = torch.full_like(y, poison)
    _cuda_kernels.experts_forward_fp8(xq, off, *wq, h=h, y=again, h_codes=hq, gu=gu, swiglu_limit=limit)
    assert torch.equal(again[:m], y[:m]), "a rerun differs"


def test_fp8_forward_refuses_bad_arguments_by_name() -> None:
    x = torch.randn(128, 192, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="x must be"):
        _cuda_kernels.quantize_rows(x[0])
    with pytest.raises(TypeError, match="must be torch.bfloat16"):
        _cuda_kernels.quantize_rows(x.float())
    w = [_cuda_kernels.quantize_weights(torch.randn(1, a, b, device="cuda").to(torch.bfloat16))
         for a, b in ((192, 192), (192, 192), (192, 192))]
    xq = _cuda_kernels.quantize_rows(x)
    h = torch.empty(128, 192, device="cuda", dtype=torch.bfloat16)
    hq = (torch.empty(128, 192, device="cuda", dtype=torch.float8_e4m3fn),
          torch.empty(2, 128, device="cuda", dtype=torch.float32))
    off = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    # 192 is not whole 128-column scale blocks: the library's own check names it.
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 128"):
        _cuda_kernels.experts_forward_fp8(xq, off, *w, h=h, y=h.clone(), h_codes=hq)
    with pytest.raises(ValueError, match="offsets must be int32"):
        _cuda_kernels.experts_forward_fp8(xq, off.long(), *w, h=h, y=h.clone(), h_codes=hq)
