"""The torch.library ops in every mode: opcheck, fake tensors (CPU and CUDA devices, no GPU needed),
torch.compile(fullgraph=True) forward and backward, bitwise equal to eager."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import mok  # noqa: E402
from mok import testing  # noqa: E402

OPS = ("build_schedule", "forward", "backward", "recompute_forward_context")


def test_ops_are_registered_once_with_schemas() -> None:
    for name in OPS:
        schema = str(getattr(torch.ops.mok, name).default._schema)
        assert schema.startswith(f"mok::{name}("), schema
    assert "Tensor[] schedule" in str(torch.ops.mok.forward.default._schema)
    assert "float? swiglu_limit" in str(torch.ops.mok.forward.default._schema)
    for name in ("gpu_moe", "gpu_moe_backward"):  # the GPU layer's traced form (CUDA kernels only)
        assert str(getattr(torch.ops.mok, name).default._schema).startswith(f"mok::{name}(")


@pytest.mark.parametrize("shared, limit, tokens, save_context", [(0, None, 7, True), (4, 0.8, 9, True),
                                                                 (4, None, 0, True), (0, None, 5, False)])
def test_opcheck(shared: int, limit: float | None, tokens: int, save_context: bool) -> None:
    p = testing.random_problem(tokens, 4, 16, 8, 2, shared_intermediate=shared, swiglu_limit=limit, seed=tokens)
    s = list(p.shared) if p.shared else [None, None, None]
    schedule = list(torch.ops.mok.build_schedule(p.topk_idx, 4, ""))
    torch.library.opcheck(mok.ops.build_schedule, (p.topk_idx, 4, ""))

    def grad(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().clone().requires_grad_()

    torch.library.opcheck(mok.ops.forward, (grad(p.x), grad(p.topk_w), grad(p.w_gate), grad(p.w_up), grad(p.w_down),
                                            *(grad(t) for t in s), schedule, limit, "", save_context))
    y, *context = torch.ops.mok.forward(p.x, p.topk_w, p.w_gate, p.w_up, p.w_down, *s, schedule, limit, "", True)
    dy = torch.randn_like(y)
    torch.library.opcheck(mok.ops.backward, (dy, p.x, p.topk_w, p.w_gate, p.w_up, p.w_down, *s, schedule, context,
                                             limit, ""))
    torch.library.opcheck(mok.ops.recompute_forward_context, (p.x, p.w_gate, p.w_up, p.w_down, *s, schedule, 2,
                                                              limit, ""))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fake_tensors(device: str) -> None:
    """Shapes, dtypes and devices propagate through the layer and its backward on fake tensors."""
    T, E, H, I, k, Is = 12, 8, 32, 16, 2, 8
    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
        topk_idx = torch.empty(T, k, dtype=torch.int64, device=device)
        topk_w = torch.empty(T, k, dtype=torch.float32, device=device, requires_grad=True)
        weights = [torch.empty(s, device=device, requires_grad=True) for s in ((E, I, H), (E, I, H), (E, H, I))]
        shared = tuple(torch.empty(s, dtype=torch.bfloat16, device=device, requires_grad=True)
                       for s in ((Is, H), (Is, H), (H, Is)))
        y = mok.moe(x, topk_idx, topk_w, *weights, shared)
        assert (tuple(y.shape), y.dtype, y.device.type) == ((T, H), torch.bfloat16, device)
        # With planner overrides too: fake CUDA tensors need no GPU (the GPU op's planner runs with it).
        tuned = mok.moe(x, topk_idx, topk_w, *weights, shared, config=mok.MoeConfig(minibatch_rows=128))
        assert (tuple(tuned.shape), tuned.dtype, tuned.device.type) == ((T, H), torch.bfloat16, device)
        schedule = torch.ops.mok.build_schedule(topk_idx, E, "")
        assert [t.dtype for t in schedule] == [torch.int64, torch.int32, torch.int32, torch.int64, torch.int64,
                                               torch.int64, torch.int64]
        assert tuple(schedule[0].shape) == (E + 1,) and tuple(schedule[5].shape) == (T * k,)
        if device == "cpu":  # the autograd engine needs a real GPU to run a CUDA backward, even a fake one
            y.sum().backward()
            grads = [x.grad, topk_w.grad] + [w.grad for w in weights + list(shared)]
        else:
            _, *context = torch.ops.mok.forward(x, topk_w, *weights, *shared, list(schedule), None, "", True)
            grads = torch.ops.mok.backward(torch.empty_like(y), x, topk_w, *weights, *shared, list(schedule),
                                           context, None, "")
        for g, t in zip(grads, [x, topk_w] + weights + list(shared)):
            assert (g.shape, g.dtype, g.device.type) == (t.shape, t.dtype, device)
        # The GPU layer's traced form on the same fake tensors: the op and its backward.
        if device == "cuda":
            check_gpu_op_fakes(x, topk_idx, topk_w, weights, shared)
        # The fake implementations run the same checks as the real ones.
        with pytest.raises(TypeError, match="x must be bfloat16"):
            mok.moe(x.float(), topk_idx, topk_w, *weights)


def test_compile_fullgraph_is_bitwise_eager() -> None:
    """mok.moe under torch.compile(fullgraph=True), dynamic shapes, forward and backward, with and
    without a saved context: the same bits as eager."""
    p = testing.random_problem(10, 8, 32, 16, 2, shared_intermediate=8, swiglu_limit=2.0, seed=3)
    params = [t.float().requires_grad_() for t in (p.w_gate, p.w_up, p.w_down, *p.shared)]
    x = p.x.clone().requires_grad_()
    topk_w = p.topk_w.clone().requires_grad_()

    def loss(x: torch.Tensor, topk_w: torch.Tensor, save_context: bool) -> torch.Tensor:
        y = mok.moe(x, p.topk_idx, topk_w, *params[:3], tuple(params[3:]), swiglu_limit=2.0,
                    save_context=save_context)
        return y.float().square().sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True)
    results = []
    for fn, save_context in ((loss, True), (compiled, True), (compiled, False)):
        value = fn(x, topk_w, save_context)
        value.backward()
        results.append([value.detach()] + [t.grad.clone() for t in [x, topk_w] + params])
        for t in [x, topk_w] + params:
            t.grad = None
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_compiled_module_trains() -> None:
    """The module with its router compiles in one graph, forward and backward, and matches eager
    (up to the router's fused softmax, which inductor may round differently)."""
    torch.manual_seed(0)
    m = mok.MoE(8, 32, 16, 2, shared_intermediate=8, router="softmax")
    x = torch.randn(2, 5, 32)
    compiled = torch.compile(m, fullgraph=True)
    y_eager, y_compiled = m(x), compiled(x)
    assert y_compiled.shape == x.shape and y_compiled.dtype == torch.float32
    assert testing.relative_error(y_compiled, y_eager) < 1e-2
    y_compiled.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_compiled_layer_keeps_the_token_count_symbolic() -> None:
    """Under torch.compile(dynamic=True) calls with other token counts reuse one graph: the input
    checks do not format the traced sizes (that fixed T and recompiled for every count)."""
    import torch._dynamo

    p = testing.random_problem(16, 4, 32, 16, 2, seed=4)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda x, idx, w: mok.moe(x, idx, w, p.w_gate, p.w_up, p.w_down), fullgraph=True,
                             dynamic=True, backend="aot_eager")
    for T in (10, 12, 14, 16):
        y = compiled(p.x[:T], p.topk_idx[:T], p.topk_w[:T])
        assert torch.equal(y, mok.moe(p.x[:T], p.topk_idx[:T], p.topk_w[:T], p.w_gate, p.w_up, p.w_down))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("config,match", [(mok.MoeConfig(precision="fp16"), "MoeConfig.precision must be one of"),
                                          (mok.MoeConfig(comm_sms=-5), "MoeConfig.comm_sms must be >= 0"),
                                          (mok.MoeConfig(precision="fp8"), "needs whole 128-column scale blocks")])
def test_compiled_layer_checks_the_config(config: mok.MoeConfig, match: str) -> None:
    """Traced calls check the MoeConfig's values as eager calls do (only the planner itself waits for
    the run), so a bad one cannot slip through a compiled graph."""
    p = testing.random_problem(8, 4, 32, 16, 2, seed=5)
    with pytest.raises(Exception, match=match):
        torch.compile(lambda x: mok.moe(x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, config=config),
                      fullgraph=True, backend="aot_eager")(p.x)
    good = mok.MoeConfig(minibatch_rows=128, fused_backward=False)  # and a good one traces in one graph
    y = torch.compile(lambda x: mok.moe(x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, config=good),
                      fullgraph=True, backend="aot_eager")(p.x)
    assert torch.equal(y, mok.moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down))


def test_gpu_op_resolves_the_config_as_the_layer_does() -> None:
    """The GPU op's config ints give the planner's overrides that mok.moe's own check gives."""
    from mok import _checks, _cuda_ops, functional

    p = testing.random_problem(300, 8, 256, 128, 2, seed=6)
    shape = _checks.check_layer(p.x, p.topk_w, p.w_gate, p.w_up, p.w_down, None, None, None, None)
    for config in (None, mok.MoeConfig(), mok.MoeConfig(minibatch_rows=128, ring_rows=256),
                   mok.MoeConfig(fused_backward=False, comm_sms=0)):
        want = functional._plan_overrides(config, shape, 1, None, p.x.device)
        got = _cuda_ops._plan(_cuda_ops.config_ints(config), p.x, p.topk_w, p.w_gate, p.w_up, p.w_down, None, None,
                              None, None, "")
        assert got == want, config
    assert _cuda_ops._plan(_cuda_ops.config_ints(mok.MoeConfig(minibatch_rows=128)), p.x, p.topk_w, p.w_gate,
                           p.w_up, p.w_down, None, None, None, None, "")["minibatch_rows"] == 128


def test_gpu_op_on_cpu_tensors_names_the_layer() -> None:
    p = testing.random_problem(8, 4, 32, 16, 2, seed=7)
    with pytest.raises(NotImplementedError, match="gpu_moe is the GPU layer's traced form"):
        torch.ops.mok.gpu_moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, None, None, None, None, "",
                              True, [-1] * 5, "bf16", False)


def check_gpu_op_fakes(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, weights: list[torch.Tensor],
                       shared: tuple[torch.Tensor, ...]) -> None:
    """torch.ops.mok.gpu_moe (what torch.compile traces on CUDA tensors) on fake tensors: y, then
    what its backward reads (mok._cuda_layer.OP_SAVED), kept or 0-element by precision and
    save_context, the row counts data-dependent; gpu_moe_backward gives each input's gradient."""
    from mok import _cuda_layer

    T, H = x.shape
    k = topk_idx.shape[1]
    El, I, _ = weights[0].shape
    Is = shared[0].shape[0]
    config = [-1] * 5
    for precision, save_context, training in (("bf16", True, True), ("bf16", False, True), ("fp8", True, True),
                                              ("fp8_dgrad", False, True), ("bf16", True, False)):
        out = torch.ops.mok.gpu_moe(x, topk_idx, topk_w, *weights, *shared, None, "", save_context, config, precision,
                                    training)
        assert len(out) == 1 + len(_cuda_layer.OP_SAVED)
        assert (tuple(out[0].shape), out[0].dtype) == ((T, H), torch.bfloat16)
        saved = dict(zip(_cuda_layer.OP_SAVED, out[1:]))
        if not training:
            assert all(t.numel() == 0 for t in saved.values())
            continue
        assert (tuple(saved["topk_idx"].shape), saved["topk_idx"].dtype) == ((T, k), torch.int32)
        assert tuple(saved["offsets"].shape) == (El + 1,)
        assert saved["src_rank"].dtype == saved["src_slot"].dtype == torch.int32
        kept = {"x_rows": save_context and precision == "bf16", "h": save_context, "gu": save_context}
        for name, width in (("x_rows", H), ("h", I), ("gu", 2 * I)):
            t = saved[name]
            assert (t.dim(), t.shape[-1]) == (2, width) if kept[name] else t.numel() == 0, (precision, name)
        assert tuple(saved["shared_gu"].shape) == (128, 2 * Is) and tuple(saved["shared_h"].shape) == (128, Is)
        grads = torch.ops.mok.gpu_moe_backward(torch.empty_like(out[0]), x, topk_w, *weights, *shared, out[1:], None,
                                               "", save_context, config, precision)
        for g, t in zip(grads, [x, topk_w] + weights + list(shared)):
            assert (g.shape, g.dtype, g.device) == (t.shape, t.dtype if t is not x else torch.bfloat16, t.device)
