"""The GPU path of mok.moe (the fused forward and its backward through the C API) against the
pure-torch reference; skipped where there is no Hopper GPU or the sm_90a library is not built
(tools/gpu.sh runs it on the H200s)."""

from __future__ import annotations

import re

import pytest
import torch

mok = pytest.importorskip("mok")
from mok import _cuda_kernels  # noqa: E402
from mok import testing  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and _cuda_kernels.available()),
    reason="needs an sm_90 GPU and libmok_cuda_capi.so",
)


def _run(p: testing.MoeProblem, dy: torch.Tensor, save_context: bool = True,
         config: mok.MoeConfig | None = None) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in (p.x, p.topk_w, p.w_gate, p.w_up, p.w_down)]
    shared = [t.detach().clone().requires_grad_(True) for t in p.shared] if p.shared is not None else None
    y = mok.moe(leaves[0], p.topk_idx, leaves[1], *leaves[2:], shared, swiglu_limit=p.swiglu_limit,
                save_context=save_context, config=config)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves] + ([t.grad for t in shared] if shared else [])


@pytest.mark.parametrize("shared_intermediate,limit,routing", [(256, None, "uniform"), (0, 0.75, "zipf"),
                                                              (256, None, "masked")])
def test_matches_the_reference_and_is_bitwise_stable(shared_intermediate: int, limit: float | None,
                                                    routing: str) -> None:
    p = testing.random_problem(300, 16, 512, 256, 4, shared_intermediate=shared_intermediate, swiglu_limit=limit,
                               routing=routing, seed=3, device="cuda")
    dy = torch.randn(300, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(9)).to(torch.bfloat16)
    first = _run(p, dy)
    from mok import _cuda_layer

    _cuda_layer.check()
    ref = testing.moe_reference_grads(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, dy, shared=p.shared,
                                      swiglu_limit=limit)
    expected = [ref.y, ref.d_x, ref.d_topk_w, ref.d_w_gate, ref.d_w_up, ref.d_w_down]
    for name, got, want in zip(["y", "dx", "d_topk_w", "dW_gate", "dW_up", "dW_down"], first, expected):
        assert got is not None and torch.isfinite(got.float()).all(), name
        err = testing.relative_error(got, want)
        assert err < 2e-2, f"{name}: rel error {err}"
    again = _run(p, dy)
    for name, a, b in zip(["y", "dx", "d_topk_w", "dW_gate", "dW_up", "dW_down"], first, again):
        assert torch.equal(a, b), f"{name} differs between two runs"


def test_recomputed_context_and_inference_give_the_same_bits() -> None:
    """save_context=False (the forward keeps x and the schedule; the backward replays the rows), also
    with a ring of one minibatch (far fewer rows than routed), and a no_grad forward (no context, no
    g|u save) give bitwise the training forward's y and gradients."""
    p = testing.random_problem(200, 16, 512, 256, 4, shared_intermediate=128, swiglu_limit=0.75, routing="zipf",
                               seed=11, device="cuda")
    dy = torch.randn(200, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(4)).to(torch.bfloat16)
    kept = _run(p, dy, save_context=True)
    recomputed = _run(p, dy, save_context=False)
    small_ring = _run(p, dy, save_context=False, config=mok.MoeConfig(minibatch_rows=128, ring_rows=128))
    with torch.no_grad():
        inference = mok.moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, p.shared,
                            swiglu_limit=p.swiglu_limit)
    from mok import _cuda_layer

    _cuda_layer.check()
    names = ["y", "dx", "d_topk_w", "dW_gate", "dW_up", "dW_down", "dS_gate", "dS_up", "dS_down"]
    for name, a, b, c in zip(names, kept, recomputed, small_ring):
        assert a is not None and b is not None and torch.equal(a, b), f"{name}: save_context=False differs"
        assert c is not None and torch.equal(a, c), f"{name}: save_context=False with a one-minibatch ring differs"
    assert torch.equal(kept[0], inference), "the no_grad forward differs from the training forward"


def test_a_second_backward_through_a_retained_graph_gives_the_first_gradients() -> None:
    """retain_graph=True: the context stays with the graph (the backward only reads it), so a
    second backward gives the first's gradients bit for bit, with kept rows and with replayed ones."""
    p = testing.random_problem(96, 8, 256, 128, 2, seed=31, device="cuda")
    dy = torch.randn(96, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(6)).to(torch.bfloat16)
    for save_context in (True, False):
        x = p.x.detach().clone().requires_grad_(True)
        w_down = p.w_down.detach().clone().requires_grad_(True)
        y = mok.moe(x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, w_down, save_context=save_context)
        y.backward(dy, retain_graph=True)
        first = (x.grad.clone(), w_down.grad.clone())
        x.grad = w_down.grad = None
        _poison_free_memory()
        y.backward(dy)
        assert torch.equal(x.grad, first[0]) and torch.equal(w_down.grad, first[1]), \
            f"save_context={save_context}: the second backward's gradients differ from the first's"
    from mok import _cuda_layer

    _cuda_layer.check()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_activation_checkpointing_and_saved_tensor_hooks_give_the_same_bits(precision: str) -> None:
    """The layer inside torch.utils.checkpoint (non-reentrant: the context is dropped after the
    forward and made again in the backward; reentrant: a no_grad forward, then a training one) and
    under save_on_cpu gives the plain call's y and gradients bit for bit; non-reentrant, the
    forward keeps none of its routed rows."""
    p = testing.random_problem(300, 16, 512, 256, 4, shared_intermediate=128, routing="zipf", seed=41, device="cuda")
    dy = torch.randn(300, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(7)).to(torch.bfloat16)
    config = mok.MoeConfig(precision=precision)

    def run(mode: str) -> tuple[list[torch.Tensor], int]:
        leaves = [t.detach().clone().requires_grad_(True) for t in (p.x, p.topk_w, p.w_gate, p.w_up, p.w_down)]
        shared = [t.detach().clone().requires_grad_(True) for t in p.shared]

        def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return mok.moe(x, p.topk_idx, w, *leaves[2:], shared, config=config)

        _poison_free_memory()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = testing.forward_with_saved_tensors(mode, layer, leaves[0], leaves[1])
        kept = torch.cuda.memory_allocated() - before
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves + shared], kept

    run("plain")  # the workspace and the fp8 weight cache made outside the measured forwards
    plain, kept_plain = run("plain")
    names = ["y", "dx", "d_topk_w", "dW_gate", "dW_up", "dW_down", "dS_gate", "dS_up", "dS_down"]
    for mode in testing.SAVED_TENSOR_MODES[1:]:
        got, kept = run(mode)
        for name, a, b in zip(names, plain, got):
            assert b is not None and torch.equal(a, b), f"{mode}: {name} differs from the plain call's"
        if mode == "non_reentrant":  # the routed rows (at least R*T*k rows of h) are not kept
            assert kept_plain - kept >= 300 * 4 * 256 * 2, f"checkpointed forward kept {kept} bytes, plain {kept_plain}"
    from mok import _cuda_layer

    _cuda_layer.check()


def test_an_expert_id_out_of_range_is_named() -> None:
    p = testing.random_problem(64, 8, 256, 128, 2, seed=5, device="cuda")
    bad = p.topk_idx.clone()
    bad[7, 1] = 8
    from mok import _cuda_layer

    _cuda_layer.clear()
    mok.moe(p.x, bad, p.topk_w, p.w_gate, p.w_up, p.w_down)
    with pytest.raises(RuntimeError, match=r"topk_idx\[rank 0\]\[token 7\]\[1\] = 8 is out of range"):
        _cuda_layer.check()
    # The workspace stays failed: the next call raises too, without a device sync of its own.
    with pytest.raises(RuntimeError, match="an earlier call failed"):
        mok.moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down)
    _cuda_layer.clear()


def test_a_non_finite_input_is_named() -> None:
    """NaN in x, or infinity in topk_w or dy, is found on the device (no host sync) and named by
    check() and by the next call, as the CPU path names it at once."""
    from mok import _cuda_layer

    p = testing.random_problem(64, 8, 256, 128, 2, seed=8, device="cuda")
    x = p.x.clone()
    x[9, 17] = float("nan")
    _cuda_layer.clear()
    mok.moe(x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down)
    with pytest.raises(RuntimeError, match=re.escape("x[rank 0][token 9][17] is not finite (nan)")):
        _cuda_layer.check()
    with pytest.raises(RuntimeError, match="an earlier call failed"):
        mok.moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down)
    mok.clear_workspace_cache()  # the public way out of a failed workspace
    mok.moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down)
    _cuda_layer.check()
    w = p.topk_w.clone()
    w[5, 1] = float("inf")
    mok.moe(p.x, p.topk_idx, w, p.w_gate, p.w_up, p.w_down)
    with pytest.raises(RuntimeError, match=re.escape("topk_w[rank 0][token 5][1] is not finite (inf)")):
        _cuda_layer.check()
    _cuda_layer.clear()
    leaf = p.x.clone().requires_grad_(True)
    y = mok.moe(leaf, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down)
    dy = torch.ones_like(y)
    dy[2, 3] = float("-inf")
    y.backward(dy)
    with pytest.raises(RuntimeError, match=re.escape("dy[rank 0][token 2][3] is not finite (-inf)")):
        _cuda_layer.check()
    _cuda_layer.clear()


@pytest.mark.parametrize("precision,save_context,limit,routing,planner", [
    (None, True, None, "uniform", {}), (None, False, 0.75, "zipf", {}), ("fp8_dgrad", True, 7.0, "masked", {}),
    ("fp8", False, None, "zipf", {}), (None, True, None, "zipf", {"minibatch_rows": 128, "fused_backward": False})])
def test_torch_compile_holds_the_gpu_layer_in_its_graph(precision: str | None, save_context: bool,
                                                         limit: float | None, routing: str,
                                                         planner: dict[str, object]) -> None:
    """torch.compile(fullgraph=True) of two GPU layers in a row (shared workspaces, other ops around
    them) traces them as torch.ops.mok.gpu_moe, no graph break: the compiled y and every gradient
    are the eager call's bits, training and no_grad, and a second compiled step repeats them. The
    planner's overrides reach the op (resolved when it runs)."""
    torch._dynamo.reset()  # `layers` is one code object for every case: its entries would pass the recompile limit
    config = mok.MoeConfig(precision=precision, **planner)  # type: ignore[arg-type]
    p = testing.random_problem(200, 8, 256, 128, 2, shared_intermediate=128, swiglu_limit=limit, routing=routing,
                               seed=21, device="cuda")
    q = testing.random_problem(200, 8, 256, 128, 2, swiglu_limit=limit, routing="uniform", seed=22, device="cuda")
    dy = torch.randn(200, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).to(torch.bfloat16)

    def layers(x: torch.Tensor, w: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor,
               sg: torch.Tensor, su: torch.Tensor, sd: torch.Tensor, w2: torch.Tensor, wg2: torch.Tensor,
               wu2: torch.Tensor, wd2: torch.Tensor) -> torch.Tensor:
        h = mok.moe(x * 1.0, p.topk_idx, w, wg, wu, wd, (sg, su, sd), swiglu_limit=limit, save_context=save_context,
                    config=config)
        return mok.moe(h + x, q.topk_idx, w2 * 0.5, wg2, wu2, wd2, swiglu_limit=limit, save_context=save_context,
                       config=config) * 1.0

    inputs = (p.x, p.topk_w, p.w_gate, p.w_up, p.w_down, *p.shared, q.topk_w, q.w_gate, q.w_up, q.w_down)
    names = ["y", "dx", "d_topk_w", "dW_gate", "dW_up", "dW_down", "dS_gate", "dS_up", "dS_down", "d_topk_w 2",
             "dW_gate 2", "dW_up 2", "dW_down 2"]
    compiled = torch.compile(layers, fullgraph=True)
    results = []
    from mok import _cuda_layer

    for i, fn in enumerate((layers, compiled, compiled)):
        if i == 1:  # the compiled calls make their own workspaces (looked up when the op runs)
            _cuda_layer.check()
            _cuda_layer.clear()
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        y = fn(*leaves)
        y.backward(dy)
        with torch.no_grad():
            y_inference = fn(*inputs)
        results.append([y.detach()] + [t.grad for t in leaves] + [y_inference])
    _cuda_layer.check()
    for other in results[1:]:
        for name, a, b in zip(names + ["y (no_grad)"], results[0], other):
            assert b is not None and torch.equal(a, b), f"{name}: compiled differs from eager"
    if planner:
        assert any(dict(key.plan).get("minibatch_rows") == 128 for key in _cuda_layer._WORKSPACES), \
            "the config did not reach the compiled calls' workspace"


def test_traced_gpu_layer_refuses_bad_inputs_at_trace_time() -> None:
    """Traced calls check the inputs' metadata as eager calls do: a wrong dtype raises TypeError
    naming the tensor (under fullgraph=True dynamo reports it as the exception it observed), before
    anything runs."""
    p = testing.random_problem(64, 4, 128, 128, 2, seed=3, device="cuda")

    def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return mok.moe(x, p.topk_idx, w, p.w_gate, p.w_up, p.w_down)

    with pytest.raises(TypeError, match="topk_w must be float32, got torch.float64"):
        torch.compile(layer)(p.x, p.topk_w.double())
    with pytest.raises(Exception, match="topk_w must be float32, got torch.float64"):
        torch.compile(layer, fullgraph=True)(p.x, p.topk_w.double())


def test_plan_overrides_change_no_bit() -> None:
    """A MoeConfig reaches the megakernel (its own workspace: other comm CTAs, minibatch and ring;
    the backward as one megakernel launch or as stage kernels) and changes neither y nor any
    gradient."""
    p = testing.random_problem(300, 16, 512, 256, 4, routing="zipf", seed=17, device="cuda")
    dy = torch.randn(300, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).to(torch.bfloat16)
    results = []
    for config in (None, mok.MoeConfig(comm_sms=3, minibatch_rows=128, ring_rows=256),
                   mok.MoeConfig(fused_backward=True, minibatch_rows=256), mok.MoeConfig(fused_backward=False)):
        y, *grads = _run(p, dy, config=config)
        with torch.no_grad():
            y_inference = mok.moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, config=config)
        results.append([y, y_inference, *grads])
    from mok import _cuda_layer

    _cuda_layer.check()
    assert any(dict(key.plan).get("minibatch_rows") == 128 for key in _cuda_layer._WORKSPACES), \
        "the config did not reach the workspace"
    assert any(dict(key.plan).get("fused_backward") == 1 for key in _cuda_layer._WORKSPACES), \
        "fused_backward did not reach the workspace"
    for other in results[1:]:
        for name, a, b in zip(["y", "y (no_grad)", "dx", "d_topk_w", "dW_gate", "dW_up", "dW_down"], results[0], other):
            assert b is not None and torch.equal(a, b), f"{name}: differs under the config"


def test_a_first_call_inside_a_cuda_graph_capture_is_refused_by_name() -> None:
    """The first call of a shape makes its workspace (allocations, host copies, a sync of the
    ranks), which a capture cannot hold: refused with a message that says to make one call first,
    before anything is queued; after that warm-up the same call captures."""
    mok.clear_workspace_cache()  # no workspace (or shared row table) of these shapes cached yet
    T, E, H, I, k = 136, 8, 256, 128, 2
    p = testing.random_problem(T, E, H, I, k, shared_intermediate=128, seed=7, device="cuda")
    args = (p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, tuple(p.shared))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="make one call with these shapes before capturing"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                mok.moe(*args)
        want = mok.moe(*args)  # the warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = mok.moe(*args)
    got.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_a_cuda_graph_of_forward_and_backward_replays_the_eager_bits() -> None:
    """No host sync and no allocation outside torch's graph pool in a step: mok.moe's forward and
    backward (one rank, with a shared expert) capture into one CUDA graph, and each replay on new
    inputs (new routing too) copied into the captured tensors gives bitwise an eager run's y and
    gradients."""
    T, E, H, I, k = 256, 16, 512, 256, 4

    def problem(seed: int) -> tuple[testing.MoeProblem, torch.Tensor]:
        p = testing.random_problem(T, E, H, I, k, shared_intermediate=128, routing="zipf", seed=seed, device="cuda")
        dy = torch.randn(T, H, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + 100))
        return p, dy.to(torch.bfloat16)

    p, dy = problem(1)
    inputs = [t.detach().clone() for t in (p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, *p.shared, dy)]
    x, topk_idx, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, dy_in = inputs
    leaves = [t.requires_grad_(True) for t in (x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down)]

    def step() -> list[torch.Tensor]:
        y = mok.moe(x, topk_idx, topk_w, w_gate, w_up, w_down, (s_gate, s_up, s_down))
        return [y.detach()] + list(torch.autograd.grad(y, leaves, dy_in))

    graph, captured = testing.capture_after_warm_up(step)
    from mok import _cuda_layer

    names = ["y", "dx", "d_topk_w", "dW_gate", "dW_up", "dW_down", "dS_gate", "dS_up", "dS_down"]
    for seed in (2, 3):
        q, dq = problem(seed)
        with torch.no_grad():
            for dst, src in zip(inputs, (q.x, q.topk_idx, q.topk_w, q.w_gate, q.w_up, q.w_down, *q.shared, dq)):
                dst.copy_(src)
        for out in captured:
            out.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
        eager = _run(q, dq)
        _cuda_layer.check()
        for name, got, want in zip(names, captured, eager):
            assert want is not None and torch.equal(got, want), f"seed {seed}: {name} of the replay differs from eager"


def _poison_free_memory(nbytes: int = 1 << 30) -> None:
    """Fills a block of torch's caching allocator with NaN bytes and frees it: the tensors a call
    allocates next come from it, so an element a kernel never writes shows as NaN."""
    block = torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del block


@pytest.mark.parametrize("precision,shared_intermediate,limit,routing", [
    (None, 128, 0.75, "zipf"), (None, 0, None, "masked"), ("fp8", 128, None, "uniform"),
    ("fp8_dgrad", 128, 7.0, "masked")])
def test_explicit_passes_give_the_layers_bits(precision: str | None, shared_intermediate: int, limit: float | None,
                                              routing: str) -> None:
    """mok.build_schedule -> mok.forward -> mok.recompute_forward_context -> mok.backward on a GPU
    workspace: y and every gradient are mok.moe's bits (autograd, same handle kernels), twice over
    freshly poisoned memory; the schedule is the CPU backend's rows in the GPU's padded layout, its
    counts the routing's; the recomputed context equals the forward's on every real row."""
    T, E, H, I, k = 300, 16, 512, 256, 4
    config = mok.MoeConfig(precision=precision)
    p = testing.random_problem(T, E, H, I, k, shared_intermediate=shared_intermediate, swiglu_limit=limit,
                               routing=routing, seed=5, device="cuda")
    dy = torch.randn(T, H, device="cuda", generator=torch.Generator("cuda").manual_seed(6)).to(torch.bfloat16)
    expected = _run(p, dy, config=config)
    ws = mok.get_workspace(config, None, device="cuda", num_local_tokens=T, hidden=H, intermediate=I, num_experts=E,
                           topk=k, shared_intermediate=shared_intermediate, swiglu_limit=limit)
    weights = (p.w_gate, p.w_up, p.w_down)
    names = ["y", "d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"] + (
        ["d_s_gate", "d_s_up", "d_s_down"] if p.shared else [])
    for attempt in range(2):
        _poison_free_memory()
        s = mok.build_schedule(ws, p.topk_idx)
        y, ctx = mok.forward(ws, s, p.x, p.topk_w, *weights, p.shared)
        rebuilt = mok.recompute_forward_context(ws, s, p.x, *weights, p.shared)
        g = mok.backward(ws, s, ctx, dy, p.x, p.topk_w, *weights, p.shared)
        ws.check()
        got = [y, *g]
        for name, a, b in zip(names, got, expected):
            assert a is not None and torch.equal(a, b), f"attempt {attempt}: {name} differs from mok.moe's"
        if not p.shared:
            assert g.d_s_gate is None and g.d_s_up is None and g.d_s_down is None
    # The schedule: the CPU backend's rows, each expert's at a multiple of 128 on the GPU.
    cpu_ws = mok.get_workspace(None, None, device="cpu", num_local_tokens=T, hidden=H, intermediate=I, num_experts=E,
                               topk=k)
    cpu = mok.build_schedule(cpu_ws, p.topk_idx.cpu())
    offsets = s.expert_offsets.cpu().long()
    assert torch.equal(s.tokens_per_expert.cpu(), cpu.tokens_per_expert)
    assert s.num_rows == cpu.num_rows and int(s.send_counts.sum()) == cpu.num_rows
    assert torch.equal(s.recv_counts.cpu(), cpu.recv_counts) and torch.equal(s.send_counts.cpu(), cpu.send_counts)
    assert bool((offsets % 128 == 0).all()) and s.recv_order.numel() == 0 and s.send_order.numel() == 0
    assert torch.equal(s.topk_idx.cpu(), p.topk_idx.cpu().int())
    real = torch.cat([torch.arange(int(offsets[e]), int(offsets[e]) + int(cpu.tokens_per_expert[e]))
                      for e in range(E)])
    assert torch.equal(s.row_src_slot.cpu()[real], cpu.row_src_slot)
    assert torch.equal(s.row_src_rank.cpu()[real], cpu.row_src_rank)
    padding = torch.ones(s.row_src_slot.shape[0], dtype=torch.bool)
    padding[real] = False
    assert bool((s.row_src_slot.cpu()[padding] == -1).all()) and bool((s.row_src_rank.cpu()[padding] == -1).all())
    # The recomputed context: the forward's on every real row (padding rows are unspecified).
    for name in ("x_rows", "gate_up", "hidden"):
        a, b = getattr(ctx, name), getattr(rebuilt, name)
        if a.shape[0]:
            assert torch.equal(a[real.cuda()], b[real.cuda()]), f"recomputed context {name} differs"
    for name in ("shared_gate_up", "shared_hidden"):
        assert torch.equal(getattr(ctx, name), getattr(rebuilt, name)), f"recomputed context {name} differs"
    assert ctx.x_rows.shape[0] == (0 if precision else ctx.hidden.shape[0])


def test_explicit_passes_refuse_what_does_not_fit_the_gpu_workspace() -> None:
    """A CPU schedule, a context of another shape, CPU tensors and a bad expert id on a GPU
    workspace: each a clear error, before anything runs or (the id, found on the device) from the
    workspace's check and its next call."""
    T, E, H, I, k = 64, 4, 256, 128, 2
    p = testing.random_problem(T, E, H, I, k, seed=8, device="cuda")
    kwargs = dict(num_local_tokens=T, hidden=H, intermediate=I, num_experts=E, topk=k)
    ws = mok.create_workspace(None, None, device="cuda", **kwargs)
    weights = (p.w_gate, p.w_up, p.w_down)
    cpu_schedule = mok.build_schedule(mok.get_workspace(None, None, device="cpu", **kwargs), p.topk_idx.cpu())
    with pytest.raises(ValueError, match="schedule was built for CPU tensors"):
        mok.forward(ws, cpu_schedule, p.x, p.topk_w, *weights)
    with pytest.raises(ValueError, match="the inputs are on cpu, the workspace on cuda:0"):
        mok.forward(ws, cpu_schedule, p.x.cpu(), p.topk_w.cpu(), *(w.cpu() for w in weights))
    s = mok.build_schedule(ws, p.topk_idx)
    y, ctx = mok.forward(ws, s, p.x, p.topk_w, *weights)
    with pytest.raises(ValueError, match=re.escape("context.gate_up is (")):
        mok.backward(ws, s, ctx._replace(gate_up=ctx.gate_up[:-1]), y, p.x, p.topk_w, *weights)
    with pytest.raises(ValueError, match="schedule.row_src_rank is"):
        mok.forward(ws, s._replace(row_src_rank=s.row_src_rank[:-1]), p.x, p.topk_w, *weights)
    ws.check()
    bad = p.topk_idx.clone()
    bad[7, 1] = E + 3
    mok.build_schedule(ws, bad)
    with pytest.raises(RuntimeError, match=re.escape(f"topk_idx[rank 0][token 7][1] = {E + 3} is out of range")):
        ws.check()
    with pytest.raises(RuntimeError, match="an earlier call failed"):
        mok.build_schedule(ws, p.topk_idx)


def test_explicit_passes_without_tokens() -> None:
    """T = 0 on a GPU workspace: nothing is called; an empty y and zero gradients."""
    H, I, E, k = 256, 128, 4, 2
    p = testing.random_problem(8, E, H, I, k, shared_intermediate=128, seed=9, device="cuda")
    ws = mok.create_workspace(None, None, device="cuda", num_local_tokens=0, hidden=H, intermediate=I, num_experts=E,
                              topk=k, shared_intermediate=128)
    x, idx, w = p.x[:0], p.topk_idx[:0], p.topk_w[:0]
    s = mok.build_schedule(ws, idx)
    assert s.num_rows == 0 and s.tokens_per_expert.tolist() == [0] * E
    y, ctx = mok.forward(ws, s, x, w, p.w_gate, p.w_up, p.w_down, p.shared)
    g = mok.backward(ws, s, ctx, y, x, w, p.w_gate, p.w_up, p.w_down, p.shared)
    assert y.shape == (0, H) and g.d_x.shape == (0, H)
    for name in ("d_w_gate", "d_w_up", "d_w_down", "d_s_gate", "d_s_up", "d_s_down"):
        assert not bool(getattr(g, name).any()), name
