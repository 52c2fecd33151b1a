"""The experts' block-scaled e4m3 forward through the C API (mok._cuda_kernels: quantize_rows,
quantize_weights, experts_forward_fp8) against plain torch on the dequantized operands; skipped
where there is no Hopper GPU or the sm_90a library is not built (tools/gpu.sh runs it)."""

from __future__ import annotations

from typing import Any

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


def _fp8_rows(t: torch.Tensor) -> torch.Tensor:
    """t [n, c] bf16 as its 1 x 128 block-scaled e4m3 values (fp32)."""
    return testing.dequantize_e4m3_rows(*_cuda_kernels.quantize_rows(t.contiguous()))


def _fp8_layer(p: testing.MoeProblem) -> torch.Tensor:
    """The fp8 layer in torch on the dequantized operands: x rows and h quantized 1 x 128, the
    weights 128 x 128; g, u and each expert's output rounded where the kernels round (h and the
    rows to bf16), the combine in fp32 over j in order, the shared expert the same way."""
    def weights(w: torch.Tensor) -> torch.Tensor:
        return testing.dequantize_e4m3_blocks(*_cuda_kernels.quantize_weights(w if w.dim() == 3 else w.unsqueeze(0)))

    def expert(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
        xq = _fp8_rows(x)
        h = testing.swiglu(xq @ wg.t(), xq @ wu.t(), p.swiglu_limit).to(torch.bfloat16)
        return (_fp8_rows(h) @ wd.t()).to(torch.bfloat16).float()

    wg, wu, wd = weights(p.w_gate), weights(p.w_up), weights(p.w_down)
    T, K = p.topk_idx.shape
    slots = torch.zeros(T, K, p.x.shape[1], device=p.x.device)
    for e in range(wg.shape[0]):
        t, j = (p.topk_idx == e).nonzero(as_tuple=True)
        if t.numel():
            slots[t, j] = expert(p.x[t], wg[e], wu[e], wd[e])
    y = (slots * p.topk_w.float().unsqueeze(-1)).sum(dim=1)
    if p.shared is not None:
        sg, su, sd = (weights(w)[0] for w in p.shared)
        y = y + expert(p.x, sg, su, sd)
    return y


@pytest.mark.parametrize("limit", [None, 7.0])
def test_fp8_layer_matches_torch_on_the_dequantized_operands(limit: float | None) -> None:
    """mok.moe(config=MoeConfig(precision="fp8")) without autograd (the fp8 megakernel, one rank)
    against the fp8 layer in torch; reruns bit for bit; the bf16 layer differs by e4m3's error."""
    import mok

    p = testing.random_problem(300, 8, 512, 256, 2, shared_intermediate=256, swiglu_limit=limit, seed=11,
                               device="cuda")
    cfg = mok.MoeConfig(precision="fp8")
    args = (p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, p.shared)
    with torch.no_grad():
        y = mok.moe(*args, swiglu_limit=limit, config=cfg)
        again = mok.moe(*args, swiglu_limit=limit, config=cfg)
        bf16 = mok.moe(*args, swiglu_limit=limit)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert torch.equal(y, again)
    err = testing.relative_error(y.float(), _fp8_layer(p))
    print(f"fp8 layer: rel error {err:.2e} against torch on the dequantized operands, "
          f"{testing.relative_error(y.float(), bf16.float()):.2e} against the bf16 layer")
    assert err < 1e-2
    assert 0.01 < testing.relative_error(y.float(), bf16.float()) < 0.15  # e4m3's 3 mantissa bits


@pytest.mark.parametrize("precision", ["fp8", "fp8_dgrad"])
def test_fp8_layer_requantizes_a_changed_weight(precision: str) -> None:
    """The fp8 weight operands are cached per weight version (at fp8_dgrad the codes and the
    transposes, from one pass): doubling w_down in place (exact in e4m3 with power-of-two scales)
    doubles y exactly, without autograd and in training, and dx with it (through W_down^T at
    fp8_dgrad)."""
    import mok

    p = testing.random_problem(200, 4, 256, 128, 2, seed=12, device="cuda")
    cfg = mok.MoeConfig(precision=precision)
    with torch.no_grad():
        y = mok.moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, config=cfg)
        p.w_down.mul_(2)
        doubled = mok.moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, config=cfg)
    assert torch.equal(doubled, y * 2)
    x = p.x.detach().clone().requires_grad_(True)
    dy = torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(4)).to(y.dtype)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        out = mok.moe(x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, config=cfg)
        out.backward(dy)
        assert x.grad is not None
        return out.detach(), x.grad.clone()

    y1, dx1 = step()
    with torch.no_grad():
        p.w_down.mul_(2)
    y2, dx2 = step()
    assert torch.equal(y2, y1 * 2)
    assert torch.equal(dx2, dx1 * 2)
    # One cache entry kind per precision, for no_grad and training calls alike: at fp8_dgrad the
    # weights' codes come only from the pass that writes the transposes too.
    from mok import _cuda_layer

    kinds = _cuda_layer.fp8_cache_kinds(p.w_down)
    assert kinds == ({"dgrad"} if precision == "fp8_dgrad" else {"codes"})


def _through(value: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """value's numbers with path's gradient (straight through)."""
    return path + (value - path).detach()


def _fp8_training_reference(p: testing.MoeProblem, dy: torch.Tensor) -> list[torch.Tensor]:
    """y and the gradients of the fp8 layer as the CPU oracle defines them (ref::layer_backward at
    fp8_block): y is the fp8 layer's (_fp8_layer); the gradients are the bf16 layer's graph, with
    the unquantized weights and x, evaluated at the fp8 forward's g and u (the quantization passes
    gradients straight through). fp32 throughout. Returns y, dx, d topk_w, dW_gate, dW_up, dW_down
    and, with a shared expert, its three."""
    def weights(w: torch.Tensor) -> torch.Tensor:
        return testing.dequantize_e4m3_blocks(*_cuda_kernels.quantize_weights(w.detach().to(torch.bfloat16)))

    leaves = [t.detach().float().requires_grad_(True) for t in (p.x, p.topk_w, p.w_gate, p.w_up, p.w_down)]
    shared = [t.detach().float().requires_grad_(True) for t in p.shared] if p.shared is not None else []
    x, topk_w, wg, wu, wd = leaves
    qg, qu = weights(p.w_gate), weights(p.w_up)

    def expert(rows: torch.Tensor, g_w: torch.Tensor, u_w: torch.Tensor, d_w: torch.Tensor, g_q: torch.Tensor,
               u_q: torch.Tensor) -> torch.Tensor:
        xq = _fp8_rows(rows.detach().to(torch.bfloat16))
        g = _through(xq @ g_q.t(), rows @ g_w.t())
        u = _through(xq @ u_q.t(), rows @ u_w.t())
        return testing.swiglu(g, u, p.swiglu_limit).to(torch.bfloat16).float() @ d_w.t()

    T, K = p.topk_idx.shape
    slots = torch.zeros(T, K, x.shape[1], device=x.device)
    for e in range(wg.shape[0]):
        t, j = (p.topk_idx == e).nonzero(as_tuple=True)
        if t.numel():
            slots[t, j] = expert(x[t], wg[e], wu[e], wd[e], qg[e], qu[e])
    path = (slots * topk_w.unsqueeze(-1)).sum(dim=1)
    if shared:
        sg, su, sd = shared
        path = path + expert(x, sg, su, sd, weights(sg.unsqueeze(0))[0], weights(su.unsqueeze(0))[0])
    y = _through(_fp8_layer(p), path)
    y.backward(dy.float())
    return [y.detach()] + [t.grad for t in leaves + shared]  # type: ignore[misc]


def _train(p: testing.MoeProblem, dy: torch.Tensor, cfg: object, save_context: bool = True) -> list[torch.Tensor]:
    import mok

    leaves = [t.detach().clone().requires_grad_(True) for t in (p.x, p.topk_w, p.w_gate, p.w_up, p.w_down)]
    shared = [t.detach().clone().requires_grad_(True) for t in p.shared] if p.shared is not None else []
    y = mok.moe(leaves[0], p.topk_idx, leaves[1], *leaves[2:], shared or None, swiglu_limit=p.swiglu_limit,
                config=cfg, save_context=save_context)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves + shared]  # type: ignore[misc]


@pytest.mark.parametrize("shared_intermediate,limit,routing", [(256, None, "uniform"), (0, 7.0, "zipf")])
def test_fp8_training_matches_the_straight_through_reference_bit_for_bit_on_a_rerun(
        shared_intermediate: int, limit: float | None, routing: str) -> None:
    """mok.moe(config=MoeConfig(precision="fp8")) with autograd: the fp8 forward keeps its h and
    g|u, the backward pulls the bf16 rows again and runs the bf16 backward. y and every gradient
    against the straight-through reference in fp32; a rerun and save_context=False (the replay)
    give the same bits; the training forward's y is the no_grad forward's."""
    import mok
    from mok import _cuda_layer

    p = testing.random_problem(300, 8, 512, 256, 2, shared_intermediate=shared_intermediate, swiglu_limit=limit,
                               routing=routing, seed=17, device="cuda")
    dy = torch.randn(300, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(torch.bfloat16)
    cfg = mok.MoeConfig(precision="fp8")
    first = _train(p, dy, cfg)
    again = _train(p, dy, cfg)
    replayed = _train(p, dy, cfg, save_context=False)  # the rows pulled again, the fp8 gate|up rerun
    with torch.no_grad():
        inference = mok.moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, p.shared, swiglu_limit=limit,
                            config=cfg)
    _cuda_layer.check()
    names = ["y", "dx", "d_topk_w", "dW_gate", "dW_up", "dW_down", "dS_gate", "dS_up", "dS_down"]
    ref = _fp8_training_reference(p, dy)
    assert len(first) == len(ref)
    for name, got, want in zip(names, first, ref):
        assert got is not None and torch.isfinite(got.float()).all(), name
        err = testing.relative_error(got.float(), want)
        print(f"fp8 training {name}: rel error {err:.2e} against the straight-through reference")
        assert err < 2e-2, f"{name}: rel error {err}"
    for name, a, b, c in zip(names, first, again, replayed):
        assert torch.equal(a, b), f"{name} differs between two runs"
        assert torch.equal(a, c), f"{name} differs with save_context=False (the fp8 replay)"
    assert torch.equal(first[0], inference), "the training forward's y differs from the no_grad forward's"
    # Training and no_grad calls at fp8 have workspaces of their own (the training one's ring holds
    # every row; the no_grad one keeps no rows and no backward scratch).
    assert {(k.fp8, k.keep_rows) for k in _cuda_layer._WORKSPACES if k.tokens == 300} >= {(True, True), (True, False)}


@pytest.mark.parametrize("precision", ["fp8", "fp8_dgrad"])
def test_a_cuda_graph_of_an_fp8_training_step_requantizes_the_weights_on_every_replay(precision: str) -> None:
    """fp8's weight codes are cached per weight version, but a graph cannot see versions: inside a
    capture the quantization is captured into the cached buffers, so a replay after an in-place
    weight update (an optimizer step) runs on the updated weights. Each replay's y and gradients
    equal an eager step's bit for bit (the eager step then quantizes afresh: a graph owns those
    buffers), and the update shows in y."""
    import mok

    p = testing.random_problem(128, 4, 256, 128, 2, shared_intermediate=128, seed=19, device="cuda")
    cfg = mok.MoeConfig(precision=precision)  # fp8_dgrad: the weights' transposes are captured too
    dy = torch.randn(128, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(8)).to(torch.bfloat16)
    x, w, wg, wu, wd = (t.detach().clone().requires_grad_(True) for t in (p.x, p.topk_w, p.w_gate, p.w_up, p.w_down))
    shared = tuple(t.detach().clone().requires_grad_(True) for t in p.shared)
    leaves = [x, w, wg, wu, wd, *shared]

    def step() -> list[torch.Tensor]:
        y = mok.moe(x, p.topk_idx, w, wg, wu, wd, shared, config=cfg)
        return [y.detach()] + list(torch.autograd.grad(y, leaves, dy))

    graph, captured = testing.capture_after_warm_up(step)
    before = step()
    for update in range(2):
        with torch.no_grad():
            wd.mul_(2)  # exact in e4m3 with power-of-two scales
            wg.add_(0.01 * (update + 1))
        for out in captured:
            out.fill_(float("nan"))
        graph.replay()
        eager = step()
        from mok import _cuda_layer

        _cuda_layer.check()
        for i, (got, want) in enumerate(zip(captured, eager)):
            assert torch.equal(got, want), f"output {i} of replay {update} differs from an eager step"
        assert not torch.equal(captured[0], before[0]), "the replay ran on the old weights"


def test_fp8_training_matches_the_cpp_oracle_on_one_rank() -> None:
    """The fp8 layer's y and every gradient (routed and shared) against the C++ reference's fp8
    layer (ref::layer_forward / layer_backward at fp8_block: the CPU oracle), every expert on this
    GPU, clamped, zipf routing."""
    import test_cuda_distributed as tcd  # its run_layer and comparison (the 2-GPU suite runs the same case)
    import test_distributed as td

    case = td.Case("fp8_one_rank", 300, 8, 512, 256, 4, shared=128, limit=7.0, routing="zipf", precision="fp8")
    p = td.make_problem(case, 1, seed=13)
    _expect_near_the_cpp_oracle(case, p, tcd.run_layer(case, p, None, 0, 1))


def _expect_near_the_cpp_oracle(case: Any, p: Any, ours: dict[str, torch.Tensor]) -> None:
    """y and every gradient of one rank's run (every expert on it) within 1e-2 of the C++ reference
    layer at the case's precision."""
    import test_cuda_distributed as tcd
    import test_distributed as td

    ref = td.reference(case, p, 1)
    for name in tcd.NAMES + tcd.SHARED:
        err = tcd.relative_error(ours[name], td.reference_part(ref, p, name, 0, 1))
        print(f"{case.precision} training {name}: rel error {err:.2e} against the C++ {case.precision} oracle")
        assert err < 1e-2, f"{name}: relative error {err:.3g} against the C++ {case.precision} reference"


@pytest.mark.parametrize("save_context", [True, False])
def test_fp8_dgrad_training_matches_the_cpp_oracle_on_one_rank(save_context: bool) -> None:
    """precision="fp8_dgrad": the fp8 forward, and the backward's data gradients (routed and shared)
    on block-scaled e4m3 with the weights' transposes cached per version. y and every gradient
    against the C++ reference's fp8_dgrad layer (ref::layer_backward with experts_backward_fp8_dgrad),
    the kept context and the replay (save_context=False); a rerun gives the same bits; dx is not
    fp8's (bf16 data gradients) bit for bit, only near it."""
    import test_cuda_distributed as tcd
    import test_distributed as td

    case = td.Case("fp8_dgrad_one_rank", 300, 8, 512, 256, 4, shared=128, limit=7.0, routing="zipf",
                   precision="fp8_dgrad", save_context=save_context)
    p = td.make_problem(case, 1, seed=29)
    ours = tcd.run_layer(case, p, None, 0, 1)
    again = tcd.run_layer(case, p, None, 0, 1)
    _expect_near_the_cpp_oracle(case, p, ours)
    for name in tcd.NAMES + tcd.SHARED:
        assert torch.equal(ours[name], again[name]), f"{name} differs between two runs"
    fp8 = tcd.run_layer(td.Case("fp8", 300, 8, 512, 256, 4, shared=128, limit=7.0, routing="zipf", precision="fp8",
                                save_context=save_context), p, None, 0, 1)
    assert torch.equal(ours["y"], fp8["y"]), "fp8_dgrad's forward is fp8's"
    assert not torch.equal(ours["dx"], fp8["dx"]), "fp8_dgrad's dx is fp8's (bf16 data gradients)"
    assert tcd.relative_error(ours["dx"], fp8["dx"].float().cpu().numpy()) < 0.1


def test_fp8_dgrad_transposes_are_the_forward_codes_moved() -> None:
    """kernels.quantize_transposed: W_down^T's codes and scales are quantize_weights' of W_down,
    transposed per plane; [W_gate^T | W_up^T] the two side by side; kernels.quantize_for_dgrad gives
    both layouts from one pass. Bad shapes are refused by name."""
    g = torch.Generator("cuda").manual_seed(5)
    wg, wu, wd = (torch.randn(3, r, c, device="cuda", generator=g).to(torch.bfloat16)
                  for r, c in ((256, 384), (256, 384), (384, 256)))
    codes, scales = _cuda_kernels.quantize_weights(wd)
    t_codes, t_scales = _cuda_kernels.quantize_transposed(wd)
    assert torch.equal(t_codes.view(torch.uint8), codes.view(torch.uint8).transpose(1, 2).contiguous())
    assert torch.equal(t_scales, scales.transpose(1, 2).contiguous())
    gu_codes, gu_scales = _cuda_kernels.quantize_transposed(w_gate=wg, w_up=wu)
    for half, w in enumerate((wg, wu)):
        c, s = _cuda_kernels.quantize_weights(w)
        assert torch.equal(gu_codes.view(torch.uint8)[:, :, half * 256:(half + 1) * 256],
                           c.view(torch.uint8).transpose(1, 2))
        assert torch.equal(gu_scales[:, :, half * 2:(half + 1) * 2], s.transpose(1, 2))
    # All of fp8_dgrad's operands in one pass over each weight: the same codes, scales and
    # transposes, into poisoned buffers and into fresh ones.
    fresh = _cuda_kernels.quantize_for_dgrad(wg, wu, wd)

    def poison(q: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # NaN codes and scales
        return (torch.full(q[0].shape, 0xFF, dtype=torch.uint8, device=q[0].device).view(torch.float8_e4m3fn),
                torch.full_like(q[1], float("nan")))

    poisoned = tuple(poison(q) for q in fresh[0]), tuple(poison(q) for q in fresh[1])
    into = _cuda_kernels.quantize_for_dgrad(wg, wu, wd, out=poisoned)
    assert into[0][0][0] is poisoned[0][0][0] and into[1][1][1] is poisoned[1][1][1]
    for got in (fresh, into):
        for w, (c, s) in zip((wg, wu, wd), got[0]):
            want_c, want_s = _cuda_kernels.quantize_weights(w)
            assert torch.equal(c.view(torch.uint8), want_c.view(torch.uint8)) and torch.equal(s, want_s)
        assert torch.equal(got[1][0][0].view(torch.uint8), t_codes.view(torch.uint8))
        assert torch.equal(got[1][0][1], t_scales)
        assert torch.equal(got[1][1][0].view(torch.uint8), gu_codes.view(torch.uint8))
        assert torch.equal(got[1][1][1], gu_scales)
    with pytest.raises(ValueError, match="w_up must be .* multiples of 128"):
        _cuda_kernels.quantize_for_dgrad(wg, wu[:, :200].contiguous(), wd)
    with pytest.raises(ValueError, match="w_gate's codes"):
        _cuda_kernels.quantize_transposed(w_gate=wg, w_up=wu, plain=((fresh[0][2]), fresh[0][1]))
    with pytest.raises(ValueError, match="give w_down alone, or w_gate and w_up"):
        _cuda_kernels.quantize_transposed(wd, w_gate=wg, w_up=wu)
    with pytest.raises(ValueError, match="multiples of 128"):
        _cuda_kernels.quantize_transposed(wd[:, :200].contiguous())


def test_fp8_cache_finds_a_new_view_of_the_same_weight() -> None:
    """A weight given as a view (the domains path's unsqueezed shared expert, a slice of a stacked
    parameter) is quantized once per version: a new view of the same place finds the cached
    operands, views of other places get their own (each the quantization of its own values), an
    in-place change of the viewed tensor quantizes again, and the entries go with that tensor."""
    import gc

    from mok import _cuda_layer

    g = torch.Generator("cuda").manual_seed(9)
    calls: list[int] = []
    quantize = _cuda_kernels.quantize_weights

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return quantize(*args, **kwargs)

    stacked = torch.randn(2, 256, 128, device="cuda", generator=g).to(torch.bfloat16)
    plane = torch.randn(256, 128, device="cuda", generator=g).to(torch.bfloat16)
    before = len(_cuda_layer._FP8_WEIGHTS)
    mp = pytest.MonkeyPatch()
    mp.setattr(_cuda_kernels, "quantize_weights", counted)
    try:
        first = _cuda_layer._fp8_weight(plane.unsqueeze(0))
        assert _cuda_layer._fp8_weight(plane.unsqueeze(0)) is first and len(calls) == 1
        halves = [_cuda_layer._fp8_weight(stacked[i:i + 1]) for i in range(2)]
        assert len(calls) == 3 and halves[0] is not halves[1]
        assert _cuda_layer._fp8_weight(stacked[1:2]) is halves[1] and len(calls) == 3
        for i, (codes, scales) in enumerate(halves):
            want_c, want_s = quantize(stacked[i:i + 1].contiguous())
            assert torch.equal(codes.view(torch.uint8), want_c.view(torch.uint8)) and torch.equal(scales, want_s)
        assert _cuda_layer.fp8_cache_kinds(stacked[0:1]) == {"codes"}
        stacked.mul_(2)  # the views' version moves with the stacked tensor's
        codes, scales = _cuda_layer._fp8_weight(stacked[0:1])
        assert len(calls) == 4 and torch.equal(scales, halves[0][1] * 2)
        assert torch.equal(codes.view(torch.uint8), halves[0][0].view(torch.uint8))
    finally:
        mp.undo()
    del stacked, plane, first, halves, codes, scales
    gc.collect()
    assert len(_cuda_layer._FP8_WEIGHTS) == before
