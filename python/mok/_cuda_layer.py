"""The GPU path of :func:`mok.functional.moe`: the fused forward (the megakernel) and its backward,
through the C API (:mod:`mok._cuda_kernels`), with torch autograd around them.

One workspace per (expert-parallel group, shapes, device): a symmetric buffer per rank (torch
symmetric memory, rendezvous on the group; a plain device buffer without a group) and one C API
handle (the planner's sizes, the backward's scratch). Every call writes this rank's x, topk_idx,
topk_w (and, in the backward, dy) into the symmetric buffer, then makes one call; the ranks meet at
the call's start barrier, so every rank of the group must make the same sequence of calls (one
epoch sequence per workspace). What a forward keeps for its backward (schedule, x rows, h, g|u)
is allocated per call from torch's allocator and saved by autograd, so layers sharing a workspace
do not collide. The shared expert runs on the same expert kernels, as one expert whose rows are
all the tokens; its output enters the combine, its dx the call's fp32 dx sum.

Errors inside a call (a rank that never came, an expert id out of range) are sticky in the
handle and raised by :func:`check` (it synchronizes). A forward without autograd keeps nothing. A
training forward keeps every routed row's x, h and g|u (about rows * (H + 3I) * 2 bytes per layer);
with ``save_context=False`` it keeps only x and its schedule, runs in the planner's ring, and the
backward replays the rows: it pulls them again and reruns gate|up + SwiGLU (not the down GEMM or
the combine), the same bits as a kept context. An fp8 training forward keeps h, g|u and x (its
workspace's e4m3 ring is the row capacity); its backward pulls the bf16 rows again and runs the
bf16 backward on them. At fp8_dgrad that backward's data gradients run on e4m3 (stage kernels),
with the weights' transposes quantized once per weight version, as the forward's codes are.

No host sync and no allocation outside torch's allocator happen in a call, so a training step can
be captured in a CUDA graph (``torch.cuda.graph``) after a warm-up call that made the workspace;
the calls count their epochs on the device, so every replay meets the peers' replays at the
barriers like a new call. Every rank must replay the same sequence, and errors of replays are
raised by :func:`check` (the host runs no code in a replay).

What the ranks agree on: a workspace's shapes and plan, once, when it is made (a host sync). A
later call is not compared across ranks (that would cost a host sync per call): a rank whose
shapes changed alone makes a new workspace and waits in its agreement, while the others reach
their start barrier and time out naming it. With no tokens (T = 0, which must then hold on every
rank) nothing is called at all.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from . import _cuda_kernels as kernels
from . import _dist

Tensor = torch.Tensor


@dataclass(frozen=True)
class _Key:
    group_name: str
    tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    swiglu_limit: float | None
    device: int
    plan: tuple[tuple[str, int], ...] = ()  # overrides of the planner (comm_sms, minibatch_rows, ring_rows,
    #                                         fused_backward)
    fp8: bool = False  # the block-scaled fp8 forward (its backward: bf16, on the fp8 forward's h and g|u)
    fp8_dgrad: bool = False  # with fp8 (training): the backward's data gradients on e4m3 too (stage kernels)
    # The handle keeps rows for backwards. Always at bf16 (one workspace serves training and
    # no_grad calls); at fp8 only for training calls, whose ring holds every row (the row
    # capacity in e4m3, h, the scales): no_grad fp8 calls get a workspace of their own in the
    # planner's ring, without the backward's scratch.
    keep_rows: bool = True

    def shapes(self) -> tuple[object, ...]:
        return (self.group_name, self.tokens, self.hidden, self.intermediate, self.num_experts, self.topk, self.device,
                self.fp8, self.fp8_dgrad, self.keep_rows)


def _keeps_rows(fp8: bool, needs_grad: bool) -> bool:
    return needs_grad or not fp8


def needs_grad(*tensors: object) -> bool:
    """Whether a call on these inputs records autograd (grad mode on and any input requires grad)."""
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _key(group_name: str, x: Tensor, w_gate: Tensor, topk: int, swiglu_limit: float | None,
         plan: dict[str, int] | None, precision: str = "bf16", training: bool = True) -> _Key:
    """The workspace key of a call at ``precision`` ("bf16", "fp8" or "fp8_dgrad"; fp8_dgrad's
    no_grad calls share fp8's workspace: only a backward differs)."""
    El, I, H = w_gate.shape
    fp8 = precision in ("fp8", "fp8_dgrad")
    return _Key(group_name, x.shape[0], H, I, El * _dist.resolve(group_name).size, topk, swiglu_limit,
                x.device.index or 0, tuple(sorted((plan or {}).items())), fp8, precision == "fp8_dgrad" and training,
                _keeps_rows(fp8, training))


class _Workspace:
    def __init__(self, key: _Key, ep: _dist.EpGroup) -> None:
        T, H, k, R = key.tokens, key.hidden, key.topk, ep.size
        device = torch.device("cuda", key.device)
        # Every rank's buffers are laid out from these: a rank with other values would read the
        # wrong places. Checked once per workspace (a host sync), not per call.
        plan = dict(key.plan)
        _dist.agree(ep, "cuda_workspace", lambda: {
            "tokens per rank": T, "hidden": H, "intermediate": key.intermediate, "experts": key.num_experts,
            "topk": k, "swiglu_limit": key.swiglu_limit, "MoeConfig comm_sms": plan.get("comm_sms"),
            "MoeConfig minibatch_rows": plan.get("minibatch_rows"), "MoeConfig ring_rows": plan.get("ring_rows"),
            "MoeConfig fused_backward": plan.get("fused_backward"),
            "MoeConfig precision": "fp8_dgrad" if key.fp8_dgrad else "fp8" if key.fp8 else "bf16",
            "training (keeps rows)": key.keep_rows})
        self.layout = kernels.symmetric_layout(T, H, k, R)
        total = self.layout["total"]
        if ep.size == 1:
            self.buffer = torch.zeros(total, dtype=torch.uint8, device=device)
            self.handle = None
            self.bases = [self.buffer.data_ptr()]
        else:
            import torch.distributed._symmetric_memory as symm_mem

            try:
                symm_mem.enable_symm_mem_for_group(ep.name)
            except Exception:  # not needed on newer torch
                pass
            self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=device).zero_()
            try:
                self.handle = symm_mem.rendezvous(self.buffer, ep.pg)
            except Exception as error:  # noqa: BLE001  (re-raised with what to do)
                raise RuntimeError(
                    f"mok: torch symmetric memory over the expert-parallel group failed ({error}); the "
                    "megakernel's ranks must share one NVLink domain: for a group over several nodes, give "
                    "config=mok.MoeConfig(domain_size=<ranks per NVLink domain>)") from error
            self.bases = [int(self.handle.buffer_ptrs[r]) for r in range(R)]
            # Every rank's zeros are in place before any rank's first call writes a flag into them.
            torch.cuda.synchronize(device)
            torch.distributed.barrier(group=ep.pg)
        self.fused = kernels.FusedForward(ranks=R, rank=ep.rank, tokens=T, hidden=H, intermediate=key.intermediate,
                                          num_experts=key.num_experts, topk=k, swiglu_limit=key.swiglu_limit,
                                          keep_rows=key.keep_rows, fp8=key.fp8, fp8_dgrad=key.fp8_dgrad,
                                          **dict(key.plan))
        self.x = self._view("x", torch.bfloat16, (T, H))
        self.topk_idx = self._view("topk_idx", torch.int32, (T, k))
        self.topk_w = self._view("topk_w", torch.float32, (T, k))
        self.dy = self._view("dy", torch.bfloat16, (T, H))

    def _view(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        return kernels.symmetric_view(self.buffer, self.layout, name, dtype, shape)


_WORKSPACES: dict[_Key, _Workspace] = {}


def _refuse_in_capture(what: str) -> None:
    """A workspace (and the shared expert's row tables) is made by the first call of its shapes:
    it allocates, copies from the host and synchronizes the ranks, none of which a CUDA graph
    capture allows. Refused by name before anything runs."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"mok: {what} of these shapes is made by the first call, which cannot run inside a CUDA "
                           "graph capture (it allocates and synchronizes the ranks): make one call with these shapes "
                           "before capturing")


def workspace(group_name: str, x: Tensor, w_gate: Tensor, topk: int, swiglu_limit: float | None,
              plan: dict[str, int] | None = None, precision: str = "bf16", training: bool = True) -> _Workspace:
    key = _key(group_name, x, w_gate, topk, swiglu_limit, plan, precision, training)
    ws = _WORKSPACES.get(key)
    if ws is None:
        _refuse_in_capture("the workspace")
        ws = _Workspace(key, _dist.resolve(group_name))
        _WORKSPACES[key] = ws
    return ws


def has_workspace(group_name: str, x: object, w_gate: object, topk_w: object, precision: str = "bf16",
                  training: bool = True) -> bool:
    """Whether a call of these shapes on this group has made its workspace here already (so the
    peers are past that workspace's agreement), as far as the inputs tell: True when they do not
    (an input without a shape)."""
    try:
        shapes = _key(group_name, x, w_gate, topk_w.shape[1], None, None, precision,  # type: ignore[arg-type,attr-defined]
                      training).shapes()
    except (AttributeError, IndexError, TypeError, ValueError):
        return True
    return any(k.shapes() == shapes for k in _WORKSPACES)


def clear() -> None:
    """Drops every workspace (their C API handles and buffers)."""
    for ws in _WORKSPACES.values():
        ws.fused.close()
    _WORKSPACES.clear()
    _SHARED_ROWS.clear()
    _FP8_WEIGHTS.clear()
    _FP8_IN_GRAPHS.clear()


def check() -> None:
    """Raises RuntimeError naming the rank and the wait if any call of any workspace failed (syncs)."""
    for ws in _WORKSPACES.values():
        ws.fused.check()


def _bf16(w: Tensor) -> Tensor:
    return w if w.dtype == torch.bfloat16 else w.to(torch.bfloat16)


def _run_forward(ws: _Workspace, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor,
                 w_down: Tensor, y_shared: Tensor | None, context: kernels.Context | None,
                 fp8_codes: tuple[Any, Any, Any] | None = None, schedule_given: bool = False) -> Tensor:
    """One fused forward: the inputs into this rank's symmetric buffer, then the megakernel (at fp8
    the call quantizes x; the weights' codes are ``fp8_codes``, from _fp8_operands). With a context it also
    keeps what its backward needs (the rows, h and g|u; at fp8 h and g|u; the g|u save costs
    time); without one it keeps nothing. schedule_given: the context's schedule is this
    topk_idx's (FusedForward.schedule built it), and the call does not build it again."""
    ws.x.copy_(x)
    ws.topk_idx.copy_(topk_idx)
    ws.topk_w.copy_(topk_w)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    y_shared = None if y_shared is None else y_shared.contiguous()
    if ws.fused.fp8:
        assert fp8_codes is not None
        ws.fused.run_fp8(ws.bases, *fp8_codes, y, y_shared=y_shared, context=context, schedule_given=schedule_given)
    else:
        ws.fused.run(ws.bases, _bf16(w_gate), _bf16(w_up), _bf16(w_down), y, y_shared=y_shared, context=context,
                     schedule_given=schedule_given)
    return y


def _layer_fp8_operands(ws: _Workspace, w_gate: Tensor, w_up: Tensor, w_down: Tensor, s_gate: Tensor | None,
                        s_up: Tensor | None, s_down: Tensor | None) -> tuple[Any, Any]:
    """The routed and the shared experts' e4m3 operands (_fp8_operands) at the workspace's precision,
    each (None, None) where there is none (a bf16 workspace, no shared expert)."""
    if not ws.fused.fp8:
        return (None, None), (None, None)
    precision = "fp8_dgrad" if ws.fused.fp8_dgrad else "fp8"
    shared = s_gate is not None and s_up is not None and s_down is not None
    return (_fp8_operands(w_gate, w_up, w_down, precision),
            _fp8_operands(s_gate, s_up, s_down, precision) if shared else (None, None))  # type: ignore[arg-type]


def _training_forward(ws: _Workspace, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor,
                      w_down: Tensor, s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None,
                      swiglu_limit: float | None, save_context: bool, context: kernels.Context | None = None
                      ) -> tuple[Tensor, kernels.Context, tuple[Tensor | None, ...], Any, Any]:
    """A training forward (what _FusedMoe, the traceable op and the explicit forward run): (y, the
    context its backward reads, the shared expert's kept (x rows, g|u, h) or Nones, the routed and
    the shared experts' e4m3 operands at fp8 or (None, None)). save_context=False keeps x and the
    schedule only; the backward replays the rows (less memory between the passes, a faster
    forward, the same bits; at fp8 the replay quantizes the pulled rows and reruns the fp8
    gate|up). ``context``: a kept context whose schedule holds this topk_idx's (the explicit
    passes' build_schedule), which the call runs on instead of building one."""
    schedule_given = context is not None
    if context is None:
        context = ws.fused.new_context(x.device, replay=not save_context)
    shared = s_gate is not None and s_up is not None and s_down is not None
    operands, shared_operands = _layer_fp8_operands(ws, w_gate, w_up, w_down, s_gate, s_up, s_down)
    y_shared = None
    kept: tuple[Tensor | None, ...] = (None, None, None)
    if shared:  # before the call: its cooperative megakernel leaves no SM to run beside
        rows, y_shared = _shared_expert_forward(x, s_gate, s_up, s_down, swiglu_limit, fp8_codes=shared_operands[0])
        assert rows is not None
        kept = rows
    y = _run_forward(ws, x, topk_idx, topk_w, w_gate, w_up, w_down, y_shared, context, operands[0], schedule_given)
    return y, context, kept, operands, shared_operands


def _training_backward(ws: _Workspace, context: kernels.Context, dy: Tensor | None, x: Tensor | None,
                       topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                       s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None,
                       shared_rows: tuple[Tensor, ...], swiglu_limit: float | None, operands: Any,
                       shared_operands: Any) -> tuple[Tensor, ...]:
    """The backward of a _training_forward: (dx, d topk_w, d w_gate, d w_up, d w_down, then the
    shared expert's three gradients or Nones). topk_idx: that forward's routing (written into the
    buffer again: another call may have replaced it); x: needed by a replay context and at fp8 (its
    rows are pulled again), else may be None."""
    T, H = ws.x.shape
    device = topk_w.device
    if dy is None:  # still run: the other ranks' backward needs this rank's part
        dy = torch.zeros(T, H, dtype=torch.bfloat16, device=device)
    dy = dy.contiguous()
    replay = context.replay
    shared_grads: tuple[Tensor | None, ...] = (None, None, None)
    dx_shared = None
    if s_gate is not None and s_up is not None and s_down is not None:
        dx_shared, *grads = _shared_expert_backward(shared_rows, s_gate, s_up, s_down, dy,  # type: ignore[arg-type]
                                                    swiglu_limit, transposes=shared_operands[1])
        shared_grads = tuple(grads)
    if replay or ws.fused.fp8:  # every rank's x is pulled again
        assert x is not None
        ws.x.copy_(x)
    ws.dy.copy_(dy)
    ws.topk_w.copy_(topk_w)
    ws.topk_idx.copy_(topk_idx)  # the dx sum and d topk_w skip its empty slots
    El, I, _ = w_gate.shape
    dx = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    d_topk_w = torch.empty(topk_w.shape, dtype=torch.float32, device=device)
    # The kernels write bf16 weight gradients for bf16 weights (no fp32 copy to convert), else fp32.
    grad = torch.bfloat16 if w_gate.dtype == w_up.dtype == w_down.dtype == torch.bfloat16 else torch.float32
    d_gate = torch.empty(El, I, H, dtype=grad, device=device)
    d_up = torch.empty(El, I, H, dtype=grad, device=device)
    d_down = torch.empty(El, H, I, dtype=grad, device=device)
    fp8_gate_up = operands[0][:2] if ws.fused.fp8 and replay else None
    ws.fused.backward(ws.bases, _bf16(w_gate), _bf16(w_up), _bf16(w_down), dx=dx, d_topk_w=d_topk_w,
                      d_w_gate=d_gate, d_w_up=d_up, d_w_down=d_down, context=context,
                      dx_shared=dx_shared, fp8_gate_up=fp8_gate_up, fp8_transposes=operands[1])
    return (dx, d_topk_w, d_gate.to(w_gate.dtype), d_up.to(w_up.dtype), d_down.to(w_down.dtype), *shared_grads)


class _FusedMoe(torch.autograd.Function):
    """The routed experts through the C API and, when given, the shared expert on MoK's expert
    kernels (one expert whose rows are all the tokens). With ``fp8`` both forwards are block-scaled
    e4m3 and keep their g|u and h; the backward is the bf16 one on those, with the bf16 weights
    (the quantization passes gradients straight through, as the CPU oracle's fp8 layer defines
    it), and pulls the bf16 x rows again. The shared expert's dx enters the call's
    fixed-order fp32 dx sum (one rounding, not a bf16 add afterwards). On an fp8_dgrad workspace the
    routed and the shared experts' data gradients are on block-scaled e4m3 (ref::layer_backward at
    that precision). Its backward runs before the
    call, on the same stream: on a side stream beside the routed backward it was slower (2 H200s,
    8192 tokens per rank: Kimi K2 31.5 ms against 29.9, DeepSeek-V4 36.9 against 33.8; its GEMMs
    take SMs the routed persistent kernels count on)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None, swiglu_limit: float | None,
                ws: _Workspace, save_context: bool) -> Tensor:
        y, context, kept, operands, shared_operands = _training_forward(
            ws, x, topk_idx, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit, save_context)
        ctx.ws, ctx.replay, ctx.swiglu_limit = ws, context.replay, swiglu_limit
        # The weights' e4m3 operands stay with the call (a weight changed in place in between fails
        # autograd's saved-tensor check, so they stay the weights'; inside a CUDA graph the
        # forward's captured quantization is the one the backward reads).
        ctx.fp8_operands, ctx.shared_fp8_operands = operands, shared_operands
        # x only where the backward reads it: the replay and the fp8 backward pull it again, the
        # shared expert's rows hold it.
        # The backward writes this call's topk_idx into the buffer again (another call may have
        # replaced it): a private copy, so the caller may reuse its routing tensor in between.
        # The context's rows and schedule are saved tensors too, so that saved-tensor hooks see
        # them: activation checkpointing drops them after the forward (and its recompute makes
        # them again), save_on_cpu moves them; autograd frees them after the backward unless the
        # graph is retained (the backward only reads them: a second backward gives the first's bits).
        ctx.save_for_backward(ws.topk_idx.clone(), topk_w, w_gate, w_up, w_down,
                              x if context.replay or ws.fused.fp8 else None, s_gate, s_up, s_down, context.x_rows,
                              context.h, context.gu, context.offsets, context.src_rank, context.src_slot, *kept)
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    @once_differentiable  # (the kernels' gradients carry no graph: a double backward raises)
    def backward(ctx: Any, dy: Tensor | None) -> tuple[Any, ...]:
        (topk_idx, topk_w, w_gate, w_up, w_down, x, s_gate, s_up, s_down, x_rows, h, gu, offsets, src_rank, src_slot,
         *shared_rows) = ctx.saved_tensors
        # A saved-tensor hook decided what came back; the kernels read these by address.
        for name, t in (("x_rows", x_rows), ("h", h), ("gu", gu), ("offsets", offsets), ("src_rank", src_rank),
                        ("src_slot", src_slot)):
            if t is not None:
                kernels.check_addressable(f"mok: the saved context's {name}, as a saved-tensor hook gave it back,",
                                          t, topk_w.device)
        context = kernels.Context.of(ctx.replay, x_rows, h, gu, offsets, src_rank, src_slot)
        with torch.cuda.device(topk_w.device):
            dx, d_topk_w, *weight_grads = _training_backward(
                ctx.ws, context, dy, x, topk_idx, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down,
                tuple(shared_rows), ctx.swiglu_limit, ctx.fp8_operands, ctx.shared_fp8_operands)
        return (dx, None, d_topk_w, *weight_grads, None, None, None)


_SHARED_ROWS: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}


def shared_row_count(tokens: int) -> int:
    """The shared expert's rows: every token, rounded up to the kernels' row alignment."""
    return -(-tokens // kernels.ROW_ALIGN) * kernels.ROW_ALIGN


def _shared_rows(tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The shared expert as one expert of the grouped kernels: its offsets [0, rows] (int32, rows
    = tokens rounded up to the kernels' row alignment) and its rows' weights (1, 0 for padding).
    Made once per (device, tokens): no host-to-device copy per call."""
    key = (device.index or 0, tokens)
    if key not in _SHARED_ROWS:
        _refuse_in_capture("the shared expert's row table")
        rows = shared_row_count(tokens)
        offsets = torch.tensor([0, rows], dtype=torch.int32, device=device)
        weight = torch.zeros(rows, dtype=torch.float32, device=device)
        weight[:tokens] = 1.0
        _SHARED_ROWS[key] = (offsets, weight)
    return _SHARED_ROWS[key]


def _padded(t: Tensor, rows: int) -> Tensor:
    """t [T, n] bf16 with zero rows appended up to `rows` (t itself when T == rows)."""
    if t.shape[0] == rows:
        return t.contiguous()
    out = torch.zeros(rows, t.shape[1], dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def _shared_weights(s_gate: Tensor, s_up: Tensor, s_down: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The shared expert's weights as one expert's: [1, Is, H], [1, Is, H], [1, H, Is], bf16."""
    return tuple(w.to(torch.bfloat16).contiguous().unsqueeze(0) for w in (s_gate, s_up, s_down))  # type: ignore[return-value]


def _shared_expert_forward(x: Tensor, s_gate: Tensor, s_up: Tensor, s_down: Tensor, swiglu_limit: float | None,
                           keep: bool = True, fp8_codes: tuple[Any, Any, Any] | None = None
                           ) -> tuple[tuple[Tensor, Tensor, Tensor] | None, Tensor]:
    """The shared expert on MoK's expert kernels (one expert, every token a row; gate|up with the
    fused SwiGLU, then down; given the weights' ``fp8_codes`` (_fp8_operands), on block-scaled
    e4m3, experts_forward_fp8, as the routed experts of an fp8 call): (x rows in bf16, g|u, h) kept
    for _shared_expert_backward when ``keep``, and y_shared."""
    T, H = x.shape
    offsets, weight = _shared_rows(T, x.device)
    rows = weight.shape[0]  # T rounded up to the row alignment, as _shared_rows made them
    Is = s_gate.shape[0]
    x_rows = _padded(x.to(torch.bfloat16), rows)
    h = torch.empty(rows, Is, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(rows, H, dtype=torch.bfloat16, device=x.device)
    gu = torch.empty(rows, 2 * Is, dtype=torch.bfloat16, device=x.device) if keep else None
    if fp8_codes is not None:
        h_codes = (torch.empty(rows, Is, dtype=torch.float8_e4m3fn, device=x.device),
                   torch.empty(Is // 128, rows, dtype=torch.float32, device=x.device))
        kernels.experts_forward_fp8(kernels.quantize_rows(x_rows), offsets, *fp8_codes, h=h, y=y, h_codes=h_codes,
                                    gu=gu, swiglu_limit=swiglu_limit)
    else:
        kernels.experts_forward(x_rows, offsets, *_shared_weights(s_gate, s_up, s_down), h=h, y=y, gu=gu,
                                swiglu_limit=swiglu_limit)
    return ((x_rows, gu, h) if gu is not None else None), y[:T]


def _shared_expert_backward(saved: tuple[Tensor, Tensor, Tensor], s_gate: Tensor, s_up: Tensor, s_down: Tensor,
                            dy: Tensor, swiglu_limit: float | None,
                            transposes: tuple[Any, Any] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx, d s_gate, d s_up, d s_down of the shared expert on MoK's expert kernels (the dh GEMM with
    the fused SwiGLU backward, dx, the weight gradients; fixed reduction order; given fp8_dgrad's
    weight ``transposes`` (_fp8_operands), dh and dx on block-scaled e4m3, as the routed experts').
    The weight gradients in the weights' dtypes."""
    x_rows, gu, h = saved
    rows, H = x_rows.shape
    T = dy.shape[0]
    offsets, weight = _shared_rows(T, dy.device)
    wg, wu, wd = _shared_weights(s_gate, s_up, s_down)
    Is = wg.shape[1]
    bf16 = torch.bfloat16
    grad = bf16 if s_gate.dtype == s_up.dtype == s_down.dtype == bf16 else torch.float32
    dx = torch.empty(rows, H, dtype=bf16, device=dy.device)
    d_weight = torch.empty(rows, dtype=torch.float32, device=dy.device)
    d_gate = torch.empty(1, Is, H, dtype=grad, device=dy.device)
    d_up = torch.empty(1, Is, H, dtype=grad, device=dy.device)
    d_down = torch.empty(1, H, Is, dtype=grad, device=dy.device)
    scratch = kernels.BackwardScratch(rows, Is, dy.device)
    if transposes is not None:
        kernels.experts_backward_fp8_dgrad(x_rows, offsets, gu, h, _padded(dy, rows), weight,
                                           *transposes, dx=dx, d_row_weight=d_weight,
                                           d_w_gate=d_gate, d_w_up=d_up, d_w_down=d_down, scratch=scratch,
                                           dgrad_scratch=kernels.fp8_dgrad_scratch(rows, H, Is, dy.device),
                                           swiglu_limit=swiglu_limit)
    else:
        kernels.experts_backward(x_rows, offsets, gu, h, _padded(dy, rows), weight, wg, wu, wd, dx=dx,
                                 d_row_weight=d_weight, d_w_gate=d_gate, d_w_up=d_up, d_w_down=d_down,
                                 scratch=scratch, swiglu_limit=swiglu_limit)
    return (dx[:T], d_gate[0].to(s_gate.dtype), d_up[0].to(s_up.dtype), d_down[0].to(s_down.dtype))


# The fp8 layer's weight operands, quantized once per weight tensor(s) and version (a step that
# changes a weight in place bumps its version): (kind, _fp8_key(weight), ...) -> (weak references
# to the weights' owners, their (data_ptr, shape, dtype, version), the quantized operands). kind
# "codes": a weight's (codes, scales) (precision fp8's forward); "dgrad": fp8_dgrad's, the three
# weights' codes and the transposes of W_down and of W_gate with W_up from one pass over each
# weight (_fp8_dgrad_operands). A view (a slice of a stacked parameter, the unsqueezed shared
# expert of the domains path) is keyed by the tensor it views and its place in it, so a new view
# of the same place finds the entry; the entry goes when an owner does. (Keyed by id: a
# WeakKeyDictionary compares tensors with ==, which is elementwise.)
_FP8_WEIGHTS: dict[tuple[object, ...], tuple[tuple[weakref.ref, ...], tuple[object, ...], Any]] = {}
# Entries whose codes a CUDA graph requantizes on every replay: key -> the buffers the graphs
# write, held while the weights live (a graph keeps raw addresses). A replay can change a weight
# without a version bump (an optimizer step in the graph), so an eager call never trusts them.
_FP8_IN_GRAPHS: dict[tuple[object, ...], Any] = {}


def _planes(w: Tensor) -> Tensor:
    """w [planes, rows, cols] (or one plane [rows, cols], the shared expert's) as bf16 planes."""
    return _bf16(w if w.dim() == 3 else w.unsqueeze(0)).contiguous()


def _owner(w: Tensor) -> Tensor:
    """The tensor that owns w's memory: w, or the tensor w is a view of (views share its version
    counter, so its in-place changes bump theirs)."""
    return w if w._base is None else w._base


def _fp8_key(w: Tensor) -> tuple[object, ...]:
    """A weight's part of an fp8 cache key: its owner and, for a view, where in the owner it lies."""
    return (id(_owner(w)), w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype)


def fp8_cache_kinds(w: Tensor) -> set[str]:
    """The kinds of the fp8 cache entries that hold ``w``'s operands (tests and diagnostics)."""
    part = _fp8_key(w)
    return {key[0] for key in _FP8_WEIGHTS if part in key[1:]}


def _cached_fp8(kind: str, weights: tuple[Tensor, ...], quantize: Any) -> Any:
    """quantize(out) of ``weights`` (out: None, or the cached buffers to write), cached per version.
    Inside a CUDA graph capture the quantization is captured into the cached buffers (made by the
    warm-up call), so every replay quantizes the weights' values at that time."""
    key = (kind, *(_fp8_key(w) for w in weights))
    owners = tuple(_owner(w) for w in weights)
    stamps = tuple((w.data_ptr(), tuple(w.shape), w.dtype, w._version) for w in weights)
    cached = _FP8_WEIGHTS.get(key)
    same_tensors = cached is not None and all(ref() is o for ref, o in zip(cached[0], owners)) and all(
        old[:3] == new[:3] for old, new in zip(cached[1], stamps))
    if torch.cuda.is_current_stream_capturing():
        if cached is None or not same_tensors:
            raise RuntimeError("mok: an fp8 layer quantizes its weights into buffers made by its first forward, "
                               "which cannot run inside a CUDA graph capture: run one training step with these "
                               "weights before capturing")
        _FP8_IN_GRAPHS[key] = cached[2]
        return quantize(cached[2])
    if key in _FP8_IN_GRAPHS:  # a graph owns the cached buffers: fresh codes, not cached
        return quantize(None)
    if same_tensors and cached is not None and cached[1] == stamps:
        return cached[2]
    q = quantize(None)

    def forget(_: object, key: tuple[object, ...] = key) -> None:
        _FP8_WEIGHTS.pop(key, None)
        _FP8_IN_GRAPHS.pop(key, None)

    _FP8_WEIGHTS[key] = (tuple(weakref.ref(o, forget) for o in owners), stamps, q)
    return q


def _fp8_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [planes, rows, cols] (or one plane [rows, cols], the shared expert's) as block-scaled e4m3
    (kernels.quantize_weights: [planes, rows, cols] codes, block scales), cached per version."""
    return _cached_fp8("codes", (w,), lambda out: kernels.quantize_weights(_planes(w), out=out))


def _fp8_dgrad_operands(w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Any:
    """Precision fp8_dgrad's weight operands, each weight read once for both layouts
    (kernels.quantize_for_dgrad): ((the forward's codes of w_gate, w_up, w_down), (W_down^T,
    [W_gate^T | W_up^T])) in block-scaled e4m3 (each weight [planes, rows, cols], or one plane, the
    shared expert's), cached per version as the forward's codes are."""
    return _cached_fp8("dgrad", (w_gate, w_up, w_down), lambda out: kernels.quantize_for_dgrad(
        _planes(w_gate), _planes(w_up), _planes(w_down), out=out))


def _fp8_operands(w_gate: Tensor, w_up: Tensor, w_down: Tensor, precision: str) -> tuple[Any, Any]:
    """A layer's (or the shared expert's) e4m3 weight operands at ``precision``, cached per version:
    at "fp8" (the three weights' codes, None), each weight's own entry; at "fp8_dgrad"
    _fp8_dgrad_operands (the codes and the backward's transposes, from one pass)."""
    if precision == "fp8_dgrad":
        return _fp8_dgrad_operands(w_gate, w_up, w_down)
    return (_fp8_weight(w_gate), _fp8_weight(w_up), _fp8_weight(w_down)), None


def _check_device(x: Tensor) -> None:
    if not kernels.available():
        raise NotImplementedError("mok: the CUDA kernels (libmok_cuda_capi.so, sm_90a) are not built or not "
                                  "loadable here; use CPU tensors or build with CUDA")
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        raise NotImplementedError(f"mok: the CUDA kernels need an sm_90 (Hopper) GPU; {x.device} is "
                                  f"sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))}")


def _inference_forward(ws: _Workspace, x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor,
                       w_down: Tensor, s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None,
                       swiglu_limit: float | None, precision: str) -> Tensor:
    """A forward that keeps nothing (no_grad). At fp8_dgrad it takes the training calls' operands:
    one cache entry for both kinds of call."""
    fp8 = precision in ("fp8", "fp8_dgrad")
    y_shared = None
    if s_gate is not None and s_up is not None and s_down is not None:
        shared_codes = _fp8_operands(s_gate, s_up, s_down, precision)[0] if fp8 else None
        _, y_shared = _shared_expert_forward(x, s_gate, s_up, s_down, swiglu_limit, keep=False, fp8_codes=shared_codes)
    codes = _fp8_operands(w_gate, w_up, w_down, precision)[0] if fp8 else None
    return _run_forward(ws, x, topk_idx, topk_w, w_gate, w_up, w_down, y_shared, None, codes)


def moe(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
        s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None, swiglu_limit: float | None,
        group_name: str, save_context: bool = True, plan: dict[str, int] | None = None,
        precision: str = "bf16") -> Tensor:
    """The checked inputs of :func:`mok.functional.moe` on the GPU. Without autograd (no_grad, or
    no input that requires grad) the forward keeps no context at all. ``plan``: the planner's
    overrides resolved from a MoeConfig (comm_sms, minibatch_rows, ring_rows, fused_backward)."""
    _check_device(x)
    leaves = [t for t in (x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down) if t is not None]
    training = needs_grad(*leaves)
    if x.shape[0] == 0:
        # No tokens (T is the same on every rank, so none anywhere): nothing moves. y is empty and
        # every gradient is zero, through a graph that touches every input.
        y = torch.zeros(x.shape, dtype=torch.bfloat16, device=x.device)
        if not training:
            return y
        return y + (torch.stack([t.sum().float() for t in leaves]).sum() * 0).to(torch.bfloat16)
    with torch.cuda.device(x.device):  # the handle, its buffers and the stream are x's device's
        ws = workspace(group_name, x, w_gate, topk_w.shape[1], swiglu_limit, plan, precision, training)
        args = (x.contiguous(), topk_idx.contiguous(), topk_w.contiguous(), w_gate, w_up, w_down)
        if not training:
            return _inference_forward(ws, *args, s_gate, s_up, s_down, swiglu_limit, precision)
        return _FusedMoe.apply(*args, s_gate, s_up, s_down, swiglu_limit, ws, save_context)


# ---------------------------------------------------------------------------------------------
# The traceable form (torch.ops.mok.gpu_moe / gpu_moe_backward, mok/_cuda_ops.py): the same
# forward and backward, with everything the backward reads handed over as tensors
# ---------------------------------------------------------------------------------------------

# What op_forward returns after y, in order (placeholders of 0 elements where a call keeps none).
OP_SAVED = ("topk_idx", "x_rows", "h", "gu", "offsets", "src_rank", "src_slot", "shared_gu", "shared_h")


def op_forward(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
               s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None, swiglu_limit: float | None,
               group_name: str, save_context: bool, plan: dict[str, int] | None, precision: str,
               training: bool) -> list[Tensor]:
    """[y, *OP_SAVED]: moe()'s forward on contiguous inputs, training as the caller traced it (a
    compiled graph runs its forward without grad mode, so the op cannot ask autograd)."""
    _check_device(x)

    def none() -> Tensor:
        return torch.empty(0, dtype=torch.bfloat16, device=x.device)

    def none_int() -> Tensor:
        return torch.empty(0, dtype=torch.int32, device=x.device)

    placeholders = [none_int(), none(), none(), none(), none_int(), none_int(), none_int(), none(), none()]
    if x.shape[0] == 0:
        return [torch.zeros(x.shape, dtype=torch.bfloat16, device=x.device), *placeholders]
    with torch.cuda.device(x.device):
        ws = workspace(group_name, x, w_gate, topk_w.shape[1], swiglu_limit, plan, precision, training)
        if not training:
            return [_inference_forward(ws, x, topk_idx, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down,
                                       swiglu_limit, precision), *placeholders]
        y, context, kept, _, _ = _training_forward(ws, x, topk_idx, topk_w, w_gate, w_up, w_down, s_gate, s_up,
                                                   s_down, swiglu_limit, save_context)
        # The shared expert's x rows are x (padded): the backward makes them again rather than
        # return an alias of an input.
        _, shared_gu, shared_h = kept
        return [y, ws.topk_idx.clone(), *(t if t is not None else none() for t in (context.x_rows, context.h,
                                                                                  context.gu)),
                context.offsets, context.src_rank, context.src_slot,
                *(t if t is not None else none() for t in (shared_gu, shared_h))]


def op_backward(dy: Tensor | None, x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                s_gate: Tensor | None, s_up: Tensor | None, s_down: Tensor | None, saved: list[Tensor],
                swiglu_limit: float | None, group_name: str, save_context: bool, plan: dict[str, int] | None,
                precision: str) -> list[Tensor]:
    """[dx, d topk_w, d w_gate, d w_up, d w_down, d s_gate, d s_up, d s_down] (the shared ones of 0
    elements without a shared expert) of the op_forward that returned ``saved`` (its OP_SAVED).
    The weights' e4m3 operands come from the cache again: the forward's, unless a weight changed
    in between (which autograd's saved-tensor check refuses)."""
    _check_device(x)
    shared = s_gate is not None and s_up is not None and s_down is not None
    if x.shape[0] == 0:
        zeros = [torch.zeros_like(t) for t in (x, topk_w, w_gate, w_up, w_down)]
        zeros[0] = zeros[0].to(torch.bfloat16)
        return zeros + ([torch.zeros_like(t) for t in (s_gate, s_up, s_down)] if shared  # type: ignore[arg-type]
                        else [torch.empty(0, dtype=torch.float32, device=x.device) for _ in range(3)])
    topk_idx, x_rows, h, gu, offsets, src_rank, src_slot, shared_gu, shared_h = saved
    with torch.cuda.device(x.device):
        ws = workspace(group_name, x, w_gate, topk_w.shape[1], swiglu_limit, plan, precision, True)
        context = kernels.Context.of(not save_context, x_rows if x_rows.numel() else None,
                                     h if h.numel() else None, gu if gu.numel() else None, offsets, src_rank, src_slot)
        operands, shared_operands = _layer_fp8_operands(ws, w_gate, w_up, w_down, s_gate, s_up, s_down)
        shared_rows: tuple[Tensor, ...] = ()
        if shared:
            shared_rows = (_padded(x.to(torch.bfloat16), shared_gu.shape[0]), shared_gu, shared_h)
        dx, d_topk_w, *grads = _training_backward(ws, context, dy, x, topk_idx, topk_w, w_gate, w_up, w_down, s_gate,
                                                  s_up, s_down, shared_rows, swiglu_limit, operands, shared_operands)
    return [dx, d_topk_w, *(g if g is not None else torch.empty(0, dtype=torch.float32, device=x.device)
                            for g in grads)]
