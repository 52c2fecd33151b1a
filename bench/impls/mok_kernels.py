"""Our kernels through their C API (``libmok_cuda_capi.so``, loaded by ``mok._cuda_kernels``).

- ``layer``: the fused forward (the megakernel with its barrier, schedule and combine) and its
  backward (the planner's path: the backward megakernel or the stage kernels) over one torch
  symmetric-memory buffer per rank; ``mok_gemms``: the same rows' expert GEMMs alone.
- ``experts``: the sm_90a expert GEMMs, forward and backward, on pre-grouped rows.

Skipped with the reason where the library is not built or there is no sm_90a GPU.
"""

from __future__ import annotations

import os

from types import ModuleType
from typing import Any

import torch

from . import BenchContext, Runner, Skip, register_impl
from ._common import shared_expert

SYMM_KEY = "mok.symmetric"


def _plan_overrides() -> dict[str, int]:
    """Plan knobs for sweeps: ``MOK_BENCH_PLAN="comm=8,minibatch=1920,ring=7680,fused_backward=1,replay=1"``
    (absent: the planner's choice). tools/gpu.sh's sweep names each result file after its plan. With a
    backward the kept context replaces the ring, so ``ring`` then changes nothing, unless ``replay=1``:
    the forward keeps only its schedule (in the ring) and the backward replays the rows."""
    import os

    names = {"comm": "comm_sms", "minibatch": "minibatch_rows", "ring": "ring_rows", "fused_backward": "fused_backward",
             "replay": "replay"}
    out: dict[str, int] = {}
    for term in filter(None, (t.strip() for t in os.environ.get("MOK_BENCH_PLAN", "").split(","))):
        key, _, value = term.partition("=")
        if key not in names or not value.isdigit():
            raise ValueError(f"MOK_BENCH_PLAN: {term!r} is not one of comm=N, minibatch=N, ring=N, fused_backward=0|1, "
                             "replay=0|1")
        out[names[key]] = int(value)
    return out


def _layer_symmetric_bytes(case: Any, kernels: ModuleType) -> int:
    from ..presets import get_preset

    preset = get_preset(case.preset)
    return kernels.symmetric_layout(case.tokens_per_rank or 0, preset.H, preset.topk, case.ranks)["total"]


def _fresh_signals(buffer: torch.Tensor, layout: dict[str, int], ctx: BenchContext) -> None:
    """A new handle starts its epochs at 1: the signal lines of its layout (where an earlier case's
    flags or data may sit) are zeroed on every rank before any rank's first call."""
    buffer[layout["signals"]: layout["x"]].zero_()  # the signal lines come first
    torch.cuda.synchronize()
    ctx.runtime.barrier()


def _symmetric(problem: Any, ctx: BenchContext, kernels: ModuleType) -> tuple[torch.Tensor, list[int]]:
    """One symmetric buffer for every mok case of the run, sized for the largest (allocated once and
    kept: freeing symmetric memory may be collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    need = _layer_symmetric_bytes(problem.case, kernels)
    held = ctx.resources.get(SYMM_KEY)
    if held is None:
        sizes = [_layer_symmetric_bytes(c, kernels) for c in ctx.cases
                 if c.kind == "layer" and c.ranks == ctx.runtime.world_size]
        total = max(sizes + [need])
        try:
            symm_mem.enable_symm_mem_for_group(ctx.runtime.group.group_name)
        except Exception:  # not needed on newer torch
            pass
        buffer = symm_mem.empty(total, dtype=torch.uint8, device=ctx.runtime.device).zero_()
        handle = symm_mem.rendezvous(buffer, ctx.runtime.group)
        held = (buffer, [int(handle.buffer_ptrs[r]) for r in range(ctx.runtime.world_size)], handle)
        ctx.resources[SYMM_KEY] = held
        ctx.runtime.barrier()
    if need > held[0].numel():
        raise Skip(f"needs {need / 1e9:.1f} GB of symmetric memory, {held[0].numel() / 1e9:.1f} GB allocated")
    return held[0], held[1]


def _symmetric_inputs(problem: Any, ctx: BenchContext, kernels: ModuleType
                      ) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's symmetric buffer (fresh signals) and every rank's base address, with the views
    a call's inputs are written into: x, topk_idx, topk_w, dy."""
    p = problem
    T, H, k = p.x.shape[0], p.preset.H, p.preset.topk
    buffer, bases = _symmetric(p, ctx, kernels)
    layout = kernels.symmetric_layout(T, H, k, p.ranks)
    _fresh_signals(buffer, layout, ctx)

    def view(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return kernels.symmetric_view(buffer, layout, name, dtype, shape)

    return bases, (view("x", torch.bfloat16, (T, H)), view("topk_idx", torch.int32, (T, k)),
                   view("topk_w", torch.float32, (T, k)), view("dy", torch.bfloat16, (T, H)))


def _grad_dtype() -> torch.dtype:
    """The weight gradients' type: bf16 by default, the baselines' (torch._grouped_mm's gradients of
    bf16 weights are bf16); ``MOK_BENCH_GRAD=fp32`` for fp32 (the figures before session 5)."""
    return torch.float32 if os.environ.get("MOK_BENCH_GRAD", "bf16") == "fp32" else torch.bfloat16


def _layer_memory_bytes(problem: Any, ctx: BenchContext) -> int:
    """The handle's local buffers (rows kept for the backward, its scratch), the weight gradients
    and at fp8 the quantized weights, plus 25%; the symmetric buffer is allocated once for the run."""
    p = problem
    T, H, I, k, R, El = p.x.shape[0], p.preset.H, p.preset.I, p.preset.topk, p.ranks, p.local_experts
    cap = R * T * k + El * 127
    rows = cap * (2 * 2 * H + 5 * 2 * I + 16)  # x and dy rows (dx is pushed from its GEMM: no rows)
    grads = 3 * El * I * H * _grad_dtype().itemsize
    weights = 0
    if p.case.precision != "bf16":  # per row the codes of x and h and the bf16 x rows pulled again; the e4m3 weights
        rows += cap * (H + I + 2 * H)
        weights = 3 * El * I * H
    if p.case.precision == "fp8_dgrad":  # the transposes, and per row dy's and dg|du's codes
        rows += cap * (H + 2 * I + 16)
        weights += 3 * El * I * H
    return int(1.25 * (rows + grads + weights))


@register_impl("mok", "layer", is_baseline=False, memory_bytes=_layer_memory_bytes,
               description="MoK fused forward (megakernel) + backward (the planner's: megakernel or stage kernels) "
                           "over symmetric memory")
def build_layer(problem: Any, ctx: BenchContext) -> Runner:
    """Through the C API: every rank writes x, topk_idx and topk_w (and dy for the backward) into
    its symmetric buffer and makes one call per pass. The forward is the megakernel (barrier,
    schedule, fused dispatch + experts + combine push, combine); it keeps its rows when the case
    has a backward, which runs on the same buffers (the planner's path: the backward megakernel or
    the stage kernels). The shared expert runs on MoK's expert kernels as mok.moe runs it (before
    the call in each pass, dx_shared summed by the call; MOK_BENCH_SHARED below).

    At precision fp8 as mok.moe(config=MoeConfig(precision="fp8")) runs it: the weights quantized
    once (outside the timed passes), the call quantizing x itself, the shared expert on
    experts_forward_fp8 before the call; the backward is the bf16 one on the fp8 forward's h and
    g|u (every rank writes x again: the call pulls the bf16 rows). At fp8_dgrad the backward's data
    gradients on e4m3 too (the stage kernels; the weights' transposes quantized once, outside the
    timed passes, as mok.moe caches them per weight version)."""
    if not ctx.runtime.is_cuda:
        raise Skip("the MoK kernels need an sm_90a GPU (the CPU path is the C++ reference, not benchmarked)")
    if problem.case.precision not in ("bf16", "fp8", "fp8_dgrad"):
        raise Skip(f"precision {problem.case.precision} not implemented yet")
    kernels = _cuda_kernels()
    p = problem
    fp8 = p.case.precision != "bf16"
    dgrad8 = p.case.precision == "fp8_dgrad"
    T, H, k, R = p.x.shape[0], p.preset.H, p.preset.topk, p.ranks
    bases, (x_in, idx_in, w_in, dy_in) = _symmetric_inputs(p, ctx, kernels)
    with_backward = any(ps in ("backward", "both") for ps in p.case.passes)
    plan = _plan_overrides()
    replay = bool(plan.pop("replay", 0))
    fused = kernels.FusedForward(ranks=R, rank=p.rank, tokens=T, hidden=H, intermediate=p.preset.I,
                                 num_experts=p.preset.E, topk=k, swiglu_limit=p.swiglu_limit, keep_rows=with_backward,
                                 fp8=fp8, fp8_dgrad=dgrad8 and with_backward, **plan)
    dev = p.x.device
    y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    w_gate, w_up, w_down = p.w_gate.detach(), p.w_up.detach(), p.w_down.detach()
    weights_fp8 = [kernels.quantize_weights(w.to(torch.bfloat16).contiguous()) for w in (w_gate, w_up, w_down)] \
        if fp8 else []
    transposes = (kernels.quantize_transposed(w_down.to(torch.bfloat16).contiguous()),
                  kernels.quantize_transposed(w_gate=w_gate.to(torch.bfloat16).contiguous(),
                                              w_up=w_up.to(torch.bfloat16).contiguous())) \
        if dgrad8 and with_backward else None
    El, I = w_gate.shape[0], p.preset.I
    dx = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    d_topk_w = torch.empty(T, k, dtype=torch.float32, device=dev)
    d_w = [torch.empty(shape, dtype=_grad_dtype(), device=dev)
           for shape in ((El, I, H), (El, I, H), (El, H, I))] if with_backward else []

    context = fused.new_context(dev, replay=replay) if with_backward else None

    # The shared expert as mok.moe runs it (mok._cuda_layer): on MoK's expert kernels, its forward
    # before the call (its rows kept), its backward before the call on the same stream, dx_shared
    # entering the call's dx sum. MOK_BENCH_SHARED=overlap: its backward on a side stream beside the
    # routed one, the call's dx sum waiting for an event (measured slower, session 10);
    # MOK_BENCH_SHARED=torch: its forward and backward as torch ops (cuBLAS), serial (the yardstick).
    from mok import _cuda_layer

    side = torch.cuda.Stream(dev)
    shared_mode = os.environ.get("MOK_BENCH_SHARED", "mok")
    if shared_mode not in ("mok", "overlap", "torch"):
        raise ValueError(f"MOK_BENCH_SHARED={shared_mode!r} is not one of mok, overlap, torch")
    if fp8 and shared_mode == "torch":
        raise Skip("MOK_BENCH_SHARED=torch: the shared expert in torch is bf16 (the fp8 row runs it in fp8)")
    shared_w = [t.detach() for t in p.shared] if p.shared is not None else None
    # Its e4m3 operands as the layer takes them (_cuda_layer._layer_fp8_operands): the codes for the
    # forward, and at fp8_dgrad with a backward the transposes for its data gradients.
    shared_codes = shared_transposes = None
    if fp8 and shared_w is not None and shared_mode != "torch":
        shared_precision = "fp8_dgrad" if dgrad8 and with_backward else "fp8"
        shared_codes, shared_transposes = _cuda_layer._fp8_operands(*shared_w, shared_precision)

    def forward() -> tuple[torch.Tensor, Any]:
        x_in.copy_(p.x.detach())
        idx_in.copy_(p.topk_idx)
        w_in.copy_(p.topk_w.detach())
        saved = y_shared = None
        if shared_w is not None:
            if shared_mode == "torch":
                saved, y_shared = _torch_shared_forward(p.x.detach(), *shared_w, p.swiglu_limit)
            else:
                saved, y_shared = _cuda_layer._shared_expert_forward(p.x.detach(), *shared_w, p.swiglu_limit,
                                                                     keep=with_backward, fp8_codes=shared_codes)
        if fp8:
            fused.run_fp8(bases, *weights_fp8, y, y_shared=y_shared, context=context)
        else:
            fused.run(bases, w_gate, w_up, w_down, y, y_shared=y_shared, context=context)
        return y, saved

    def output(state: tuple[torch.Tensor, Any]) -> torch.Tensor:
        fused.check()  # a timed-out wait or a bad expert id is an error, not a number
        return state[0]

    if not with_backward:
        return Runner(forward=forward, output=output, backward=None,
                      no_backward_reason="this case has no backward pass")
    calls = [0]

    def backward(state: tuple[torch.Tensor, Any]) -> list[torch.Tensor | None]:
        _, saved = state
        main = torch.cuda.current_stream()
        d_shared: list[torch.Tensor | None] = []
        dx_shared = ready = None
        serial_shared = shared_mode != "overlap"
        if saved is not None:
            stream = main if serial_shared else side
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                if shared_mode == "torch":
                    dx_shared, *d_shared = _torch_shared_backward(p.x.detach(), *shared_w, *saved, p.d_y,
                                                                  p.swiglu_limit)
                else:
                    dx_shared, *d_shared = _cuda_layer._shared_expert_backward(saved, *shared_w, p.d_y,
                                                                                p.swiglu_limit,
                                                                                transposes=shared_transposes)
            if not serial_shared:
                ready = torch.cuda.Event()
                ready.record(side)
                for t in (dx_shared, *d_shared):
                    t.record_stream(main)
        if replay or fp8:  # every rank's x is pulled again
            x_in.copy_(p.x.detach())
        dy_in.copy_(p.d_y)
        w_in.copy_(p.topk_w.detach())
        fused.backward(bases, w_gate, w_up, w_down, dx=dx, d_topk_w=d_topk_w, d_w_gate=d_w[0], d_w_up=d_w[1],
                       d_w_down=d_w[2], context=context, dx_shared=dx_shared, dx_shared_ready=ready,
                       fp8_gate_up=(weights_fp8[0], weights_fp8[1]) if fp8 and replay else None,
                       fp8_transposes=transposes)
        if not serial_shared and saved is not None:
            main.wait_stream(side)
        calls[0] += 1
        if calls[0] == 1:  # the correctness check's call: a failed wait is an error (timed calls do not sync)
            fused.check()
        return [dx, d_topk_w, *d_w, *d_shared]

    return Runner(forward=forward, output=output, backward=backward)


def _torch_shared_forward(x: torch.Tensor, s_gate: torch.Tensor, s_up: torch.Tensor, s_down: torch.Tensor,
                          swiglu_limit: float | None) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(g, u) and y_shared of the shared expert as torch ops (cuBLAS)."""
    import torch.nn.functional as F
    from mok.testing import swiglu

    g, u = F.linear(x, s_gate), F.linear(x, s_up)
    return (g, u), F.linear(swiglu(g, u, swiglu_limit), s_down)


def _torch_shared_backward(x: torch.Tensor, s_gate: torch.Tensor, s_up: torch.Tensor, s_down: torch.Tensor,
                           g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor,
                           swiglu_limit: float | None) -> tuple[torch.Tensor, ...]:
    """dx, d s_gate, d s_up, d s_down of the shared expert as torch ops (the SwiGLU backward in fp32)."""
    from mok.testing import swiglu, swiglu_backward

    h = swiglu(g, u, swiglu_limit)
    dh = dy @ s_down
    dg, du = (t.to(torch.bfloat16) for t in swiglu_backward(g.float(), u.float(), dh.float(), swiglu_limit))
    dx = torch.cat([dg, du], dim=1) @ torch.cat([s_gate, s_up], dim=0)
    return dx, dg.t() @ x, du.t() @ x, dy.t() @ h


def _torch_memory_bytes(problem: Any, ctx: BenchContext) -> int:
    """The `mok` row's local buffers and gradients, plus the workspace's own symmetric buffer."""
    p = problem
    layout = _cuda_kernels().symmetric_layout(p.x.shape[0], p.preset.H, p.preset.topk, p.ranks)
    return _layer_memory_bytes(problem, ctx) + int(layout["total"])


@register_impl("mok_torch", "layer", is_baseline=False, memory_bytes=_torch_memory_bytes,
               description="mok.moe through torch autograd: what a PyTorch user runs (its workspace cache, "
                           "the weight gradients in the weights' dtype)")
def build_layer_torch(problem: Any, ctx: BenchContext) -> Runner:
    """The `mok` row's kernels as a PyTorch user gets them: ``mok.moe`` on the bench's group, and
    ``torch.autograd.grad`` for the backward (a fresh forward before each, as for every impl). What
    it adds over `mok`: the workspace lookup, the copies into the symmetric buffer, and the weight
    gradients returned in the weights' dtype."""
    return _moe_runner(problem, ctx, None)


@register_impl("mok_domains", "layer", is_baseline=False, by_default=False,
               memory_bytes=lambda problem, ctx: problem.ranks * _torch_memory_bytes(problem, ctx),
               description="mok.moe with every rank its own NVLink domain (MoeConfig(domain_size=1)): the "
                           "several-nodes path, NCCL all-gather and all-to-all across, the megakernel at R = 1")
def build_layer_domains(problem: Any, ctx: BenchContext) -> Runner:
    """What the layer over several NVLink domains costs against the one-domain megakernel on the same
    GPUs: each rank a domain, so every token crosses by NCCL (over NVLink here, over the network
    between nodes) and each GPU runs the megakernel alone on the R*T gathered tokens."""
    if problem.ranks < 2:
        raise Skip("one rank is one domain: nothing crosses")
    return _moe_runner(problem, ctx, 1)


def _moe_runner(problem: Any, ctx: BenchContext, domain_size: int | None) -> Runner:
    """mok.moe and torch.autograd.grad on the bench's group, with ``MoeConfig(domain_size=...)``."""
    if not ctx.runtime.is_cuda:
        raise Skip("the MoK kernels need an sm_90a GPU")
    if problem.case.precision not in ("bf16", "fp8", "fp8_dgrad"):
        raise Skip(f"precision {problem.case.precision} not implemented yet")
    try:
        import mok
        from mok import _cuda_layer

        moe = mok.moe  # needs the package's compiled extension (tools/gpu.sh's pytest step builds it)
    except Exception as error:
        raise Skip(f"mok.moe is not importable here ({type(error).__name__}: {error})") from error
    mok.clear_workspace_cache()  # the earlier cases' workspaces (each case has its own shapes)

    p = problem
    group = ctx.runtime.group if p.ranks > 1 else None
    with_backward = any(ps in ("backward", "both") for ps in p.case.passes)
    config = mok.MoeConfig(precision=p.case.precision, domain_size=domain_size)

    def forward() -> torch.Tensor:
        with torch.set_grad_enabled(with_backward):
            return moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down,
                       None if p.shared is None else tuple(p.shared), swiglu_limit=p.swiglu_limit, group=group,
                       config=config)

    def output(y: torch.Tensor) -> torch.Tensor:
        _cuda_layer.check()  # a timed-out wait or a bad expert id is an error, not a number
        return y.detach()

    if not with_backward:
        return Runner(forward=forward, output=output, backward=None,
                      no_backward_reason="this case has no backward pass")

    def backward(y: torch.Tensor) -> list[torch.Tensor | None]:
        return list(torch.autograd.grad(y, p.grad_targets, p.d_y))

    return Runner(forward=forward, output=output, backward=backward)


@register_impl("mok_graph", "layer", is_baseline=False, memory_bytes=_layer_memory_bytes,
               description="MoK as `mok`, each pass captured once in a CUDA graph and replayed (no host in the loop)")
def build_layer_graph(problem: Any, ctx: BenchContext) -> Runner:
    """The `mok` row's passes (the same calls, the same buffers) captured once each in a CUDA graph
    after two eager forwards and backwards, then replayed: what a training loop that captures its
    steps gets. Possible because a call makes no host sync and counts its epochs on the device
    (every rank replays the same sequence, so the replays meet at the barriers as new calls). Not
    done for the baselines: baseline (a)'s all-to-all sizes go through the host, so it cannot be
    captured; the speedup tables compare the eager `mok` row."""
    if problem.case.precision != "bf16":
        raise Skip(f"precision {problem.case.precision}: the graph row is not wired (the eager `mok` row is)")
    eager = build_layer(problem, ctx)
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream(problem.x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):  # the warm-up torch asks for (and the eager backward's one check)
        for _ in range(2):
            state = eager.forward()
            if eager.backward is not None:
                eager.backward(state)
            del state
    main.wait_stream(side)
    torch.cuda.synchronize(problem.x.device)
    forward_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(forward_graph):
        captured_state = eager.forward()
    backward_graph = torch.cuda.CUDAGraph()
    captured_grads: list[torch.Tensor | None] = []
    if eager.backward is not None:
        with torch.cuda.graph(backward_graph):  # its own pool; reads the forward graph's outputs
            captured_grads = list(eager.backward(captured_state))

    # The graphs hold raw addresses of `eager`'s buffers (its context, outputs and scratch, made
    # outside the graphs' pools): the closures keep `eager` alive, or torch's allocator would hand
    # that memory to later tensors while the graphs still use it (session 13's illegal address).
    def forward() -> Any:
        assert eager is not None
        forward_graph.replay()
        return captured_state

    def backward(state: Any) -> list[torch.Tensor | None]:
        assert eager is not None
        backward_graph.replay()  # `state` is always captured_state
        return captured_grads

    if eager.backward is None:
        return Runner(forward=forward, output=eager.output, backward=None, no_backward_reason=eager.no_backward_reason)
    return Runner(forward=forward, output=eager.output, backward=backward)


@register_impl("mok_gemms", "layer", is_baseline=False, memory_bytes=_layer_memory_bytes,
               description="MoK expert GEMMs alone on the rows the fused forward gathered (no communication)")
def build_layer_gemms(problem: Any, ctx: BenchContext) -> Runner:
    """The yardstick of the fused forward's overlap (issue: within 1.15x of the expert-GEMM-only
    time of the same rows): one fused forward keeps its schedule and rows, then the timed pass is
    the two expert kernels on exactly those rows (and the shared expert, which the `mok` row runs
    too)."""
    if not ctx.runtime.is_cuda:
        raise Skip("the MoK kernels need an sm_90a GPU")
    if problem.case.precision != "bf16":
        raise Skip(f"precision {problem.case.precision} not implemented yet")
    kernels = _cuda_kernels()
    p = problem
    T, H, I, k, R = p.x.shape[0], p.preset.H, p.preset.I, p.preset.topk, p.ranks
    buffer, bases = _symmetric(p, ctx, kernels)
    layout = kernels.symmetric_layout(T, H, k, R)
    _fresh_signals(buffer, layout, ctx)

    def view(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return kernels.symmetric_view(buffer, layout, name, dtype, shape)

    fused = kernels.FusedForward(ranks=R, rank=p.rank, tokens=T, hidden=H, intermediate=I, num_experts=p.preset.E,
                                 topk=k, swiglu_limit=p.swiglu_limit, keep_rows=True,
                                 **{k_: v for k_, v in _plan_overrides().items() if k_ != "replay"})  # GEMMs only
    context = fused.new_context(p.x.device)
    w_gate, w_up, w_down = p.w_gate.detach(), p.w_up.detach(), p.w_down.detach()
    y = torch.empty(T, H, dtype=torch.bfloat16, device=p.x.device)
    view("x", torch.bfloat16, (T, H)).copy_(p.x.detach())
    view("topk_idx", torch.int32, (T, k)).copy_(p.topk_idx)
    view("topk_w", torch.float32, (T, k)).copy_(p.topk_w.detach())
    y_shared = shared_expert(p.x.detach(), None if p.shared is None else tuple(w.detach() for w in p.shared),
                             p.swiglu_limit)
    fused.run(bases, w_gate, w_up, w_down, y, y_shared=y_shared, context=context)
    fused.check()
    h = torch.empty_like(context.h)
    y_rows = torch.empty_like(context.x_rows)
    # The same work as the fused forward of this case, minus its communication: the g|u save only
    # where the case has a backward (the `mok` row then keeps a context), and the shared expert.
    save_gu = any(ps in ("backward", "both") for ps in p.case.passes)
    shared = None if p.shared is None else tuple(w.detach() for w in p.shared)

    def forward() -> torch.Tensor:
        kernels.experts_forward(context.x_rows, context.offsets, w_gate, w_up, w_down, h=h, y=y_rows,
                                gu=context.gu if save_gu else None, swiglu_limit=p.swiglu_limit)
        shared_expert(p.x.detach(), shared, p.swiglu_limit)
        return y_rows

    def output(state: torch.Tensor) -> torch.Tensor:
        # The GEMMs alone must reproduce the fused run's h on every scheduled row, bit for bit; the
        # y checked against the reference is then the fused run's (with R > 1 the rows' outputs
        # belong to other ranks' tokens).
        used = int(context.offsets[-1])
        if not torch.equal(h[:used], context.h[:used]):
            raise RuntimeError("the expert GEMMs alone do not reproduce the fused forward's h bit for bit")
        return y

    return Runner(forward=forward, output=output, backward=None,
                  no_backward_reason="a forward yardstick only")


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
    # experts case has no router), weight gradients of _grad_dtype().
    dy_rows = torch.zeros(rows, H, dtype=torch.bfloat16, device=dev)
    dy_rows[index] = p.d_y
    row_weight = torch.zeros(rows, dtype=torch.float32, device=dev)
    row_weight[index] = 1.0
    grads = {name: torch.empty(shape, dtype=_grad_dtype(), device=dev)
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
