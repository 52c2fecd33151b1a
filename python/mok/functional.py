"""MoK's functional API: workspace -> schedule -> forward -> backward, and the autograd-aware :func:`moe`.

Two levels:

- :func:`moe` — one call, differentiable (gradients for x, topk_w and every weight), works under
  ``torch.compile(fullgraph=True)``: on the CPU through the ``torch.ops.mok`` stages, on CUDA
  tensors as one op, ``torch.ops.mok.gpu_moe`` (the fused GPU layer). This is what
  :class:`mok.MoE` uses.
- The explicit passes (CPU tensors), for frameworks that run their own backward or checkpoint
  activations::

      ws = mok.get_workspace(None, group, device=x.device, num_local_tokens=T, hidden=H,
                             intermediate=I, num_experts=E, topk=k)
      schedule = mok.build_schedule(ws, topk_idx)
      y, ctx = mok.forward(ws, schedule, x, topk_w, w_gate, w_up, w_down)
      ...                                  # optionally drop ctx and later:
      ctx = mok.recompute_forward_context(ws, schedule, x, w_gate, w_up, w_down)
      grads = mok.backward(ws, schedule, ctx, dy, x, topk_w, w_gate, w_up, w_down)

Conventions (per rank r of the expert-parallel group of R ranks; R = 1 without a group):

- ``x`` bf16 ``[T,H]``; ``topk_idx`` int32/int64 ``[T,k]`` global expert ids, -1 for an empty slot;
  ``topk_w`` fp32 ``[T,k]``.
- Rank r owns experts ``[r*El, (r+1)*El)``: ``w_gate, w_up [El,I,H]``, ``w_down [El,H,I]``; the
  optional shared expert ``shared = (s_gate [Is,H], s_up [Is,H], s_down [H,Is])``, replicated.
- Weights are bf16 or fp32; the layer computes with them rounded to bf16 (fp32 parameters act as
  master weights) and returns each weight's gradient in that weight's dtype (computed in fp32).
- ``y`` and ``dx`` are bf16; ``d_topk_w`` fp32. Results are bitwise deterministic and do not depend
  on R: the CPU path equals the C++ reference (``include/mok/core/reference.h``) bit for bit.
- Every call with a group is collective: all ranks make the same calls with the same shapes.
  Bad input on one rank raises on every rank (naming that rank), never hangs the others. (On the
  GPU a call after the first of its shapes checks locally; the one-domain layer's peers then stop
  at its bounded start barrier, the several-domains layer's wait in the exchange until the process
  group's timeout.)
- The shared expert's and the router's gradients are this rank's contribution (as for any
  replicated parameter); the routed experts' gradients already include every rank's tokens, so
  data-parallel gradient averaging must not sum them again over the expert-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import torch
import torch.distributed as dist

from . import _checks, _dist
from . import _cuda_ops  # registers torch.ops.mok.gpu_moe*
from . import ops as _ops  # noqa: F401  (registers torch.ops.mok.*)
from ._ext import _C

__all__ = [
    "MoeConfig",
    "Workspace",
    "Schedule",
    "ForwardContext",
    "Gradients",
    "get_workspace",
    "create_workspace",
    "clear_workspace_cache",
    "build_schedule",
    "forward",
    "backward",
    "recompute_forward_context",
    "moe",
]

Tensor = torch.Tensor
_R = TypeVar("_R")
SharedWeights = tuple[Tensor, Tensor, Tensor]


@dataclass(frozen=True)
class MoeConfig:
    """Overrides of the planner's choices (``None``: the planner's default, see ``Workspace.explanation``),
    the experts' precision and the NVLink domains of the group.

    The planner's fields shape the GPU megakernel's pipeline; results do not depend on them.
    ``domain_size`` does (its own rounding of each domain's partial sum: mok/_domains.py).
    ``precision`` does: None or "bf16" (the default), or "fp8": block-scaled e4m3 experts (1 x 128
    scales on x and h, 128 x 128 on the weights, each k-block promoted into fp32; the fp8 megakernel
    pulls half the bytes). fp8 runs on the GPU, with hidden and intermediate multiples of 128; the
    weights are quantized once per weight version. Its backward is the bf16 one on the fp8
    forward's own g|u and h with the bf16 weights (the quantization passes gradients straight
    through); with save_context=False the backward pulls the rows again, quantizes them and reruns
    the fp8 gate|up (the same bits as a kept context). "fp8_dgrad": fp8's forward, and the
    backward's two data-gradient GEMMs (dh = dy W_down, dx = [dg|du] [W_gate; W_up]) on block-scaled
    e4m3 too (dy and dg|du quantized 1 x 128, the weights' transposes 128 x 128, written in the pass
    that makes the forward's codes and cached with them per weight version); the weight gradients
    stay bf16 GEMMs. In training the weights change at every step, so every step quantizes them:
    fp8 and fp8_dgrad pay off with large experts (on one H200, fp8_dgrad trained Kimi K2's and
    Mixtral's shapes 1.06-1.08x faster than bf16) and not with small ones (Qwen3-30B-A3B: level
    with bf16; bench/results/2026-12-01-h200-session25). Its backward runs as
    stage kernels (the backward megakernel is bf16; fused_backward does not apply). A training call's
    ring holds every row (ring_rows then changes nothing; no_grad calls run in the planned ring).
    In a CUDA graph, the weights' quantization is captured too (after the warm-up call).
    """

    comm_sms: int | None = None  # SMs that only move data (None/0: 3 warps of every CTA pull the rows)
    minibatch_rows: int | None = None  # rows per minibatch, a multiple of the 128-row tile
    ring_rows: int | None = None  # rows the ring token buffer holds, a multiple of minibatch_rows
    ring_budget_bytes: int | None = None  # the ring's byte budget when ring_rows is not given
    # The GPU backward as one megakernel launch (True) or as stage kernels (False): the same bits.
    fused_backward: bool | None = None
    precision: str | None = None  # None / "bf16", "fp8" (GPU; bf16 backward) or "fp8_dgrad" (GPU; e4m3 data gradients)
    # Ranks per NVLink domain when the group spans several (nodes): the layer runs in two levels,
    # an all-gather / all-to-all across domains through the group's engine (NCCL) and the
    # megakernel within each (mok/_domains.py). None: one domain. Must divide the group's size.
    domain_size: int | None = None


# MoeConfig's field names, once: traced code (torch.compile) cannot call dataclasses.fields on a class.
_CONFIG_FIELDS = tuple(f.name for f in fields(MoeConfig))


class Schedule(NamedTuple):
    """The routing schedule of one pass on this rank (from :func:`build_schedule`).

    As destination: the M rows this rank's experts compute, grouped by local expert in canonical
    order (global token ``src_rank*T + t``, then j). As source: the order in which this rank's
    ``T*k`` (token, j) slots leave, grouped by destination rank.

    On a GPU workspace the schedule is built on the device, sized for any routing (the host does
    not learn M): ``expert_offsets`` int32 with each expert's rows starting at a multiple of 128
    (padding rows after its real ones), ``row_src_rank`` / ``row_src_slot`` [row capacity] with
    -1 for padding, ``expert_rows`` each expert's real rows, ``topk_idx`` the routing (int32);
    ``recv_order`` and ``send_order`` are empty (the GPU pulls rows and pushes results: nothing is
    sent in an order). See mok/_cuda_explicit.py.
    """

    expert_offsets: Tensor  # [El+1] int64: local expert e computes rows [offsets[e], offsets[e+1])
    row_src_rank: Tensor  # [M] int32: the rank each row comes from
    row_src_slot: Tensor  # [M] int32: its slot t*k + j there
    recv_order: Tensor  # [M] int64: the schedule row of each received row (rows arrive by source rank)
    recv_counts: Tensor  # [R] int64: rows received from each rank
    send_order: Tensor  # [T*k] int64: this rank's slots in the order they are sent, empty slots (id -1) last
    send_counts: Tensor  # [R] int64: rows sent to each rank (their sum: the routed slots)
    expert_rows: Tensor | None = None  # GPU: [El] int32, the real rows of each local expert (None on the CPU)
    topk_idx: Tensor | None = None  # GPU: [T,k] int32, the routing the passes write again (None on the CPU)

    @property
    def num_rows(self) -> int:
        """M, the rows this rank's experts compute (on a GPU workspace this synchronizes)."""
        if self.expert_rows is not None:
            return int(self.expert_rows.sum())
        return self.row_src_rank.shape[0]

    @property
    def tokens_per_expert(self) -> Tensor:
        """[El] int64: rows per local expert."""
        if self.expert_rows is not None:
            return self.expert_rows.long()
        return self.expert_offsets[1:] - self.expert_offsets[:-1]


# The fields the CPU backend's ops take (the GPU's two more are its own).
_CPU_SCHEDULE_FIELDS = 7


class ForwardContext(NamedTuple):
    """What the backward needs from the forward, all bf16 (the values the GPU path stores)."""

    x_rows: Tensor  # [M,H] the dispatched token rows
    gate_up: Tensor  # [M,2I] gate | up projections
    hidden: Tensor  # [M,I] act(gate, up)
    shared_gate_up: Tensor  # [T,2Is] (Is = 0 without a shared expert)
    shared_hidden: Tensor  # [T,Is]


class Gradients(NamedTuple):
    """Every gradient of the layer. Weight gradients are in their weight's dtype; shared ones None
    without a shared expert."""

    d_x: Tensor  # [T,H] bf16
    d_topk_w: Tensor  # [T,k] fp32
    d_w_gate: Tensor  # [El,I,H]
    d_w_up: Tensor  # [El,I,H]
    d_w_down: Tensor  # [El,H,I]
    d_s_gate: Tensor | None  # [Is,H]
    d_s_up: Tensor | None  # [Is,H]
    d_s_down: Tensor | None  # [H,Is]


@dataclass(frozen=True, eq=False)
class Workspace:
    """One layer shape on one expert-parallel group: the validated problem, the plan, the buffers.

    Sizes come from the C++ planner (``plan``); Python does no offset arithmetic. On a GPU the
    workspace holds the C API handle (``gpu``: the planner's ring, the schedule's scratch, the
    backward's) and its ``symmetric`` buffer (torch symmetric memory over the group, which peers
    address); the CPU backend exchanges through torch.distributed and holds none. One workspace
    serves every layer of that shape; calls that share it run one at a time, in the same order on
    every rank.
    """

    desc: Any  # mok._C.MoeDesc
    config: MoeConfig
    plan: dict[str, Any]
    group_name: str
    rank: int
    device: torch.device
    buffers: dict[str, Tensor] = field(default_factory=dict)  # a GPU workspace's symmetric buffer
    gpu: Any = None  # on a GPU: the C API handle and the symmetric buffer (mok._cuda_layer._Workspace)

    @property
    def ranks(self) -> int:
        return int(self.desc.ranks)

    @property
    def num_experts(self) -> int:
        return int(self.desc.num_experts)

    @property
    def local_experts(self) -> int:
        return int(self.desc.local_experts)

    @property
    def first_expert(self) -> int:
        """The global id of this rank's first expert."""
        return self.rank * self.local_experts

    @property
    def explanation(self) -> str:
        """The planner's reasons, in plain text."""
        return str(self.plan["explanation"])

    def check(self) -> None:
        """Raises RuntimeError naming the rank and the wait (or the bad expert id, the NaN) if a GPU
        call of this workspace failed; synchronizes. The CPU backend raises in the call itself."""
        if self.gpu is not None:
            self.gpu.fused.check()

    def __repr__(self) -> str:
        return (f"Workspace({self.desc}, rank {self.rank} of {self.ranks}, {self.device}, "
                f"{_format_bytes(self.plan['workspace_bytes']['total'])})")


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


# ---------------------------------------------------------------------------------------------
# Workspace
# ---------------------------------------------------------------------------------------------

_WORKSPACES: dict[tuple[Any, ...], Workspace] = {}


def _device_facts(device: torch.device) -> Any:
    if device.type == "cpu":
        return _C.DeviceFacts.find("cpu")
    if device.type == "cuda":
        # The same facts as the C API's plan (planner.h: facts_for_gpu).
        props = torch.cuda.get_device_properties(device)
        return _C.DeviceFacts.for_gpu(props.name, props.multi_processor_count, props.total_memory)
    raise ValueError(f"mok: device {device} is not supported (cpu or cuda)")


def _check_config(config: object) -> None:
    if not isinstance(config, MoeConfig):
        raise TypeError(f"config must be a mok.MoeConfig or None, got {type(config).__name__}")
    for name in _CONFIG_FIELDS:
        value = getattr(config, name)
        if name == "fused_backward":
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"MoeConfig.fused_backward must be a bool or None, got {type(value).__name__}")
        elif name == "precision":
            if value not in PRECISIONS:
                raise ValueError(f"MoeConfig.precision must be one of {PRECISIONS}, got {value!r}")
        elif name == "domain_size":
            _int_or_none(value, "MoeConfig.domain_size")
            if value is not None and value < 1:
                raise ValueError(f"MoeConfig.domain_size must be >= 1, got {value}")
        else:
            _int_or_none(value, f"MoeConfig.{name}")
            if value is not None and value < 0:
                raise ValueError(f"MoeConfig.{name} must be >= 0 (or None), got {value}")


PRECISIONS = (None, "bf16", "fp8", "fp8_dgrad")


def _precision(config: MoeConfig | None) -> str:
    """The experts' precision a (checked) config asks for: "bf16", "fp8" or "fp8_dgrad"."""
    return config.precision if config is not None and config.precision in ("fp8", "fp8_dgrad") else "bf16"


def _plan(desc: Any, device: torch.device, config: MoeConfig) -> dict[str, Any]:
    """The planner's choices for ``desc`` on ``device`` under ``config``'s overrides."""
    return _C.plan(desc, _device_facts(device), comm_sms=config.comm_sms, minibatch_rows=config.minibatch_rows,
                   ring_rows=config.ring_rows, ring_budget_bytes=config.ring_budget_bytes,
                   fused_backward=config.fused_backward)


def _int_or_none(value: object, name: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")


def _resolved(device: torch.device | str) -> torch.device:
    """``device`` with the current CUDA device's index where it names none."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def create_workspace(config: MoeConfig | None, group: dist.ProcessGroup | None, *, device: torch.device | str,
                     num_local_tokens: int, hidden: int, intermediate: int, num_experts: int, topk: int,
                     shared_intermediate: int = 0, swiglu_limit: float | None = None) -> Workspace:
    """A new workspace (uncached); collective over ``group``. See :func:`get_workspace`."""
    config = MoeConfig() if config is None else config
    ep = _dist.resolve(_dist.group_name_of(group))
    device = _resolved(device)
    sizes = dict(num_local_tokens=num_local_tokens, hidden=hidden, intermediate=intermediate,
                 num_experts=num_experts, topk=topk, shared_intermediate=shared_intermediate)
    descs: list[Any] = []

    def check() -> _dist.Values:
        _check_config(config)
        if config.domain_size not in (None, ep.size):
            raise ValueError(f"MoeConfig.domain_size={config.domain_size}: the explicit passes run one NVLink domain; "
                             "the layer over several domains is mok.moe / mok.MoE")
        if _precision(config) != "bf16" and device.type != "cuda":
            raise ValueError(f"MoeConfig.precision={config.precision!r} runs on the GPU only; the CPU "
                             f"reference of the fp8 layer is `mok run --precision {config.precision}` (C++)")
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        _checks.check_swiglu_limit(swiglu_limit)
        desc = _C.MoeDesc(tokens_per_rank=num_local_tokens, hidden=hidden, intermediate=intermediate,
                          num_experts=num_experts, topk=topk, ranks=ep.size, shared_intermediate=shared_intermediate,
                          swiglu_limit=swiglu_limit)
        desc.validate()
        descs.append(desc)
        values: _dist.Values = dict(sizes)
        values["swiglu_limit"] = swiglu_limit
        values.update({f"MoeConfig.{name}": getattr(config, name) for name in _CONFIG_FIELDS})
        return values

    _dist.agree(ep, "get_workspace", check)
    assert isinstance(config, MoeConfig)
    desc = descs[0]

    plan = _plan(desc, device, config)
    if device.type != "cuda":
        return Workspace(desc, config, plan, ep.name, ep.rank, device)
    from . import _cuda_explicit

    overrides = _overrides(plan) if _overrides_planner(config) else None
    gpu = _cuda_explicit.make(ep, desc, device, overrides, _precision(config))
    buffers = {} if gpu is None else {"symmetric": gpu.buffer}
    return Workspace(desc, config, plan, ep.name, ep.rank, device, buffers, gpu)


def get_workspace(config: MoeConfig | None, group: dist.ProcessGroup | None, *, device: torch.device | str,
                  num_local_tokens: int, hidden: int, intermediate: int, num_experts: int, topk: int,
                  shared_intermediate: int = 0, swiglu_limit: float | None = None) -> Workspace:
    """The workspace for one layer shape on ``group`` (``None``: no expert parallelism), cached.

    Collective over ``group`` the first time a shape is asked for: every rank must ask for the
    same shape (ValueError naming the field otherwise). ``config`` overrides the planner's choices.
    """
    if config is not None and not isinstance(config, MoeConfig):  # rejected on every rank, below
        return create_workspace(config, group, device=device, num_local_tokens=num_local_tokens, hidden=hidden,
                                intermediate=intermediate, num_experts=num_experts, topk=topk,
                                shared_intermediate=shared_intermediate, swiglu_limit=swiglu_limit)
    # Values with their types: 6.0 must not find the workspace of 6 (it gets rejected, on every rank).
    values = (num_local_tokens, hidden, intermediate, num_experts, topk, shared_intermediate, swiglu_limit, config)
    key = (_dist.group_name_of(group), str(_resolved(device))) + tuple((type(v), v) for v in values)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = create_workspace(config, group, device=device, num_local_tokens=num_local_tokens, hidden=hidden,
                              intermediate=intermediate, num_experts=num_experts, topk=topk,
                              shared_intermediate=shared_intermediate, swiglu_limit=swiglu_limit)
        _WORKSPACES[key] = ws
    return ws


def clear_workspace_cache() -> None:
    """Forgets every cached workspace (their buffers are freed when no longer referenced), the GPU
    layer's included: a GPU workspace whose call failed stays failed until this runs on every rank.
    A CUDA graph that captured calls keeps the addresses of their workspace's buffers: do not clear
    the cache while such a graph may still be replayed. The layer over several domains agrees on its
    shapes again at its next call."""
    _WORKSPACES.clear()
    _DOMAIN_AGREEMENTS.clear()
    import sys

    gpu_layer = sys.modules.get(f"{__package__}._cuda_layer")  # loaded only once a GPU call was made
    if gpu_layer is not None:
        gpu_layer.clear()


# ---------------------------------------------------------------------------------------------
# The explicit passes
# ---------------------------------------------------------------------------------------------


def _unpack_shared(shared: object) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    if shared is None:
        return None, None, None
    if not isinstance(shared, (tuple, list)) or len(shared) != 3:
        raise TypeError("shared must be None or a (s_gate, s_up, s_down) tuple of tensors")
    return shared[0], shared[1], shared[2]


def _check_workspace(ws: object) -> Workspace:
    if not isinstance(ws, Workspace):
        raise TypeError(f"workspace must be a mok.Workspace (from mok.get_workspace), got {type(ws).__name__}")
    return ws


def _check_against_workspace(ws: Workspace, shape: _checks.LayerShape) -> None:
    d = ws.desc
    expected = (("T (tokens)", d.tokens_per_rank, shape.tokens), ("H (hidden)", d.hidden, shape.hidden),
                ("I (intermediate)", d.intermediate, shape.intermediate), ("k (top-k)", d.topk, shape.topk),
                ("El (local experts)", d.local_experts, shape.local_experts),
                ("Is (shared intermediate)", d.shared_intermediate, shape.shared_intermediate))
    for name, want, got in expected:
        if want != got:
            raise ValueError(f"the inputs have {name} = {got}, the workspace was made for {want} ({d}); "
                             "get a workspace for this shape with mok.get_workspace")


def _schedule_list(schedule: object) -> list[Tensor]:
    """The CPU ops' schedule tensors."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a mok.Schedule (from mok.build_schedule), got {type(schedule).__name__}")
    return list(schedule)[:_CPU_SCHEDULE_FIELDS]


def _checked(group_name: str, step: str, check: Callable[[], _R], report: bool = True) -> _R:
    """Runs the local checks of a collective call. With a group, a failure is first reported to the
    other ranks, which are waiting in that step's agreement: they raise too, naming this rank.
    ``report`` False: the others wait in no agreement (a GPU workspace's passes: they reach their
    start barrier and time out naming this rank), so the failure is only raised here."""
    if torch.compiler.is_compiling() or not report:  # traced on every rank alike; errors surface at trace time
        return check()
    try:
        return check()
    except (TypeError, ValueError) as error:
        _dist.report_failure(_dist.resolve(group_name), step, error)
        raise


def build_schedule(workspace: Workspace, topk_idx: Tensor) -> Schedule:
    """The routing schedule of one pass; collective. ``topk_idx`` int32/int64 ``[T,k]``, global expert ids
    in ``[0, E)`` or -1 (an empty slot; ValueError naming the first id that is neither; on a GPU
    workspace the device finds it, and ``workspace.check()`` or a later call raises RuntimeError
    naming it)."""
    ws = _check_workspace(workspace)
    _checked(ws.group_name, "build_schedule", lambda: _checks.check_tensor(
        topk_idx, "topk_idx", _checks.INDEX_DTYPES, (("T", ws.desc.tokens_per_rank), ("k", ws.desc.topk)), ws.device),
        report=ws.device.type != "cuda")
    if ws.device.type == "cuda":
        from . import _cuda_explicit

        return Schedule(*_cuda_explicit.build_schedule(ws, ws.gpu, topk_idx))
    return Schedule(*torch.ops.mok.build_schedule(topk_idx.contiguous(), ws.num_experts, ws.group_name))


def _check_pass(ws: Workspace, schedule: object, x: object, topk_w: object, weights: tuple[object, ...],
                shared: object, topk: int | None = None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    s_gate, s_up, s_down = _unpack_shared(shared)
    shape = _checks.check_layer(x, topk_w, *weights, s_gate, s_up, s_down, ws.desc.swiglu_limit, topk=topk)
    _check_against_workspace(ws, shape)
    assert isinstance(x, Tensor)
    if x.device != ws.device:
        raise ValueError(f"the inputs are on {x.device}, the workspace on {ws.device}: get a workspace for "
                         f"{x.device} with mok.get_workspace")
    _schedule_list(schedule)
    if ws.device.type == "cuda":
        from . import _cuda_explicit

        _cuda_explicit.check_schedule(ws, ws.gpu, schedule)
    elif isinstance(schedule, Schedule) and schedule.topk_idx is not None:
        raise ValueError("schedule was built on a GPU workspace; this workspace is on the CPU")
    return s_gate, s_up, s_down


def forward(workspace: Workspace, schedule: Schedule, x: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor,
            w_down: Tensor, shared: SharedWeights | None = None) -> tuple[Tensor, ForwardContext]:
    """``(y [T,H] bf16, context)``; collective. Not recorded by autograd (see :func:`moe` for that)."""
    ws = _check_workspace(workspace)
    s_gate, s_up, s_down = _checked(ws.group_name, "forward", lambda: _check_pass(
        ws, schedule, x, topk_w, (w_gate, w_up, w_down), shared), report=ws.device.type != "cuda")
    if ws.device.type == "cuda":
        from . import _cuda_explicit

        with torch.no_grad():
            y, context = _cuda_explicit.forward(ws, ws.gpu, schedule, x, topk_w, w_gate, w_up, w_down, s_gate, s_up,
                                                s_down)
        return y, ForwardContext(*context)
    with torch.no_grad():
        y, *context = torch.ops.mok.forward(x.contiguous(), topk_w.contiguous(), w_gate, w_up, w_down, s_gate, s_up,
                                            s_down, _schedule_list(schedule), ws.desc.swiglu_limit, ws.group_name, True)
    return y, ForwardContext(*context)


def recompute_forward_context(workspace: Workspace, schedule: Schedule, x: Tensor, w_gate: Tensor, w_up: Tensor,
                              w_down: Tensor, shared: SharedWeights | None = None) -> ForwardContext:
    """The context :func:`forward` returned, recomputed bitwise (for activation checkpointing); collective.
    ``w_down`` is needed because the C++ stage computes the down projection along (it is dropped);
    on a GPU workspace this is a whole forward (its y dropped)."""
    ws = _check_workspace(workspace)
    s_gate, s_up, s_down = _checked(ws.group_name, "recompute_forward_context", lambda: _check_pass(
        ws, schedule, x, None, (w_gate, w_up, w_down), shared, topk=ws.desc.topk), report=ws.device.type != "cuda")
    if ws.device.type == "cuda":
        from . import _cuda_explicit

        ones = torch.ones(x.shape[0], ws.desc.topk, dtype=torch.float32, device=x.device)  # any finite weights
        with torch.no_grad():
            _, context = _cuda_explicit.forward(ws, ws.gpu, schedule, x, ones, w_gate, w_up, w_down, s_gate, s_up,
                                                s_down)
        return ForwardContext(*context)
    with torch.no_grad():
        context = torch.ops.mok.recompute_forward_context(x.contiguous(), w_gate, w_up, w_down, s_gate, s_up, s_down,
                                                          _schedule_list(schedule), ws.desc.topk, ws.desc.swiglu_limit,
                                                          ws.group_name)
    return ForwardContext(*context)


def backward(workspace: Workspace, schedule: Schedule, context: ForwardContext, dy: Tensor, x: Tensor,
             topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
             shared: SharedWeights | None = None) -> Gradients:
    """Every gradient for ``dy = dL/dy`` (bf16 ``[T,H]``); collective."""
    ws = _check_workspace(workspace)

    def check() -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        if not isinstance(context, ForwardContext):
            raise TypeError(f"context must be a mok.ForwardContext (from mok.forward), got {type(context).__name__}")
        _checks.check_tensor(dy, "dy", (torch.bfloat16,), (("T", ws.desc.tokens_per_rank), ("H", ws.desc.hidden)),
                             ws.device)
        checked = _check_pass(ws, schedule, x, topk_w, (w_gate, w_up, w_down), shared)
        if ws.device.type == "cuda":
            from . import _cuda_explicit

            _cuda_explicit.check_context(ws, ws.gpu, context)
        return checked

    s_gate, s_up, s_down = _checked(ws.group_name, "backward", check, report=ws.device.type != "cuda")
    if ws.device.type == "cuda":
        from . import _cuda_explicit

        with torch.no_grad():
            return Gradients(*_cuda_explicit.backward(ws, ws.gpu, schedule, context, dy, x, topk_w, w_gate, w_up,
                                                      w_down, s_gate, s_up, s_down))
    with torch.no_grad():
        grads = torch.ops.mok.backward(dy.contiguous(), x.contiguous(), topk_w.contiguous(), w_gate, w_up, w_down,
                                       s_gate, s_up, s_down, _schedule_list(schedule), list(context),
                                       ws.desc.swiglu_limit, ws.group_name)
    d_x, d_topk_w, d_gate, d_up, d_down, d_s_gate, d_s_up, d_s_down = grads
    if s_gate is None:
        d_s_gate = d_s_up = d_s_down = None
    return Gradients(d_x, d_topk_w, d_gate, d_up, d_down, d_s_gate, d_s_up, d_s_down)


# ---------------------------------------------------------------------------------------------
# The autograd-aware layer
# ---------------------------------------------------------------------------------------------


def moe(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
        shared: SharedWeights | None = None, *, swiglu_limit: float | None = None,
        group: dist.ProcessGroup | None = None, save_context: bool = True,
        config: MoeConfig | None = None) -> Tensor:
    """The MoE layer after the router, differentiable: ``y [T,H]`` bf16.

    ``y[t] = shared(x[t]) + sum_j topk_w[t,j] * expert_{topk_idx[t,j]}(x[t])`` with SwiGLU experts
    (clamped at ``swiglu_limit``, gpt-oss style, when given). Gradients flow to x, topk_w and every
    weight. ``group``: the expert-parallel process group (any group, subgroups included; None: all
    experts local). ``save_context=False`` keeps only the inputs (and on the GPU the routing schedule)
    and recomputes the forward's intermediates in the backward: on the GPU it replays the dispatch
    and gate|up only (bitwise the same gradients, less memory between the passes). ``config`` overrides
    the planner's comm SMs, minibatch and ring for the GPU megakernel (checked on every device;
    results do not depend on it).
    """
    ranks = 1 if group is None else dist.get_world_size(group)
    return _moe(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit, _dist.group_name_of(group), ranks,
                save_context, config)


@torch.compiler.disable
def _moe_domains(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                 shared: Sequence[Tensor] | None, swiglu_limit: float | None, group_name: str, ranks: int,
                 save_context: bool, config: MoeConfig) -> Tensor:
    """The layer over several NVLink domains (``config.domain_size`` ranks each; mok/_domains.py).
    A graph break under torch.compile (its exchanges and agreements run as eager code)."""
    from . import _domains

    ep = _dist.resolve(group_name)
    on_gpu = isinstance(x, Tensor) and x.is_cuda

    def check() -> _dist.Values:
        s_gate, s_up, s_down, shape, _ = _check_moe(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit,
                                                    config, ranks)
        L = config.domain_size
        assert L is not None
        if not on_gpu:
            # The values, here over the whole group: inside the domains' calls a bad value would
            # raise in one domain while the others wait in the exchange. (On the GPU they are the
            # calls' sticky device errors: no host sync.)
            _checks.check_expert_ids(topk_idx, shape.local_experts * ranks)
            for t, name in ((x, "x"), (topk_w, "topk_w"), (w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down"),
                            (s_gate, "shared w_gate"), (s_up, "shared w_up"), (s_down, "shared w_down")):
                if t is not None:
                    _checks.check_finite(t, name)
        return {"tokens per rank (T)": shape.tokens, "hidden (H)": shape.hidden,
                "intermediate (I)": shape.intermediate, "local experts (El)": shape.local_experts,
                "top-k (k)": shape.topk, "shared intermediate": shape.shared_intermediate,
                "swiglu_limit": swiglu_limit, "MoeConfig.precision": _precision(config), "MoeConfig.domain_size": L}

    # On the GPU the first call of these shapes and options agrees over the group (a host sync),
    # later ones check locally, as the one-domain layer does (_moe_cuda).
    key = (group_name, tuple(x.shape), tuple(topk_idx.shape), tuple(w_gate.shape),
           tuple(tuple(w.shape) for w in shared) if isinstance(shared, (tuple, list)) else None, swiglu_limit,
           config, str(x.device))
    if on_gpu and key in _DOMAIN_AGREEMENTS:
        check()
    else:
        _dist.agree(ep, "domains", check)
        if on_gpu:
            _DOMAIN_AGREEMENTS.add(key)
    inner = replace(config, domain_size=None)

    def check_dy(dy: Tensor) -> None:  # the backward's dy, over the whole group (the CPU's host check)
        if not dy.is_cuda:
            _dist.agree(ep, "domains", lambda: (_checks.check_finite(dy, "dy"), {})[1])

    def one_domain(x_: Tensor, idx: Tensor, w: Tensor, wg: Tensor, wu: Tensor, wd: Tensor,
                   shared_: SharedWeights | None, within: dist.ProcessGroup | None) -> Tensor:
        if within is not None and dist.get_world_size(within) == 1:
            within = None
        return moe(x_, idx, w, wg, wu, wd, shared_, swiglu_limit=swiglu_limit, group=within,
                   save_context=save_context, config=inner)

    assert ep.pg is not None and config.domain_size is not None
    return _domains.moe(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, ep.pg, config.domain_size, one_domain,
                        check_dy)


_DOMAIN_AGREEMENTS: set[tuple[object, ...]] = set()


def _is_fake(t: Tensor) -> bool:
    """FakeTensors (shape propagation, torch.compile tracing) take the ops path, whose fake
    implementations give the shapes; only real GPU tensors go to the C API."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or torch._guards.detect_fake_mode(t) is not None


def _moe(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
         shared: Sequence[Tensor] | None, swiglu_limit: float | None, group_name: str, ranks: int,
         save_context: bool, config: MoeConfig | None = None) -> Tensor:
    args = (x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit, group_name, ranks, save_context, config)
    domain_size = config.domain_size if isinstance(config, MoeConfig) else None
    if isinstance(domain_size, int) and not isinstance(domain_size, bool) and domain_size >= 1 and ranks % domain_size:
        def bad_domain_size() -> None:
            raise ValueError(f"MoeConfig.domain_size={domain_size} must divide the expert-parallel group's {ranks} "
                             "ranks")
        _checked(group_name, "build_schedule", bad_domain_size)
    if domain_size is not None and domain_size != ranks and group_name:
        return _moe_domains(*args)
    if isinstance(x, Tensor) and x.is_cuda:
        return _moe_cuda(*args)
    return _moe_ops(*args)


def _moe_cuda(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
              shared: Sequence[Tensor] | None, swiglu_limit: float | None, group_name: str, ranks: int,
              save_context: bool, config: MoeConfig | None) -> Tensor:
    """The GPU layer: the fused forward (megakernel) and its backward through the C API. Eager calls
    run it through an autograd Function; traced ones (torch.compile, FakeTensors) through the op
    torch.ops.mok.gpu_moe (mok/_cuda_ops.py), whose autograd runs the same backward."""
    if torch.compiler.is_compiling() or _is_fake(x):
        return _moe_cuda_op(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit, group_name, ranks,
                            save_context, config)
    return _moe_cuda_eager(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit, group_name, ranks,
                           save_context, config)


def _moe_cuda_op(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                 shared: Sequence[Tensor] | None, swiglu_limit: float | None, group_name: str, ranks: int,
                 save_context: bool, config: MoeConfig | None) -> Tensor:
    """The traced GPU layer: the checks on the inputs' metadata (at trace time), then one op. The
    planner's overrides and the workspace are resolved when the op runs."""
    s_gate, s_up, s_down, _, _ = _check_moe(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit, config,
                                            ranks, resolve=False)
    from . import _cuda_layer

    training = _cuda_layer.needs_grad(x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down)
    outputs = torch.ops.mok.gpu_moe(x.contiguous(), topk_idx.contiguous(), topk_w.contiguous(), w_gate, w_up, w_down,
                                    s_gate, s_up, s_down, None if swiglu_limit is None else float(swiglu_limit),
                                    group_name, save_context, _cuda_ops.config_ints(config), _precision(config),
                                    training)
    return outputs[0]


@torch.compiler.disable
def _moe_cuda_eager(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                    shared: Sequence[Tensor] | None, swiglu_limit: float | None, group_name: str, ranks: int,
                    save_context: bool, config: MoeConfig | None) -> Tensor:
    """The eager GPU layer (torch.compile never traces into it: it dispatches to _moe_cuda_op first)."""
    from . import _cuda_layer

    def check() -> tuple[Tensor | None, Tensor | None, Tensor | None, _checks.LayerShape, dict[str, int] | None]:
        return _check_moe(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit, config, ranks)

    precision = _precision(config) if isinstance(config, MoeConfig) else "bf16"
    training = _cuda_layer.needs_grad(x, topk_w, w_gate, w_up, w_down,
                                      *(shared if isinstance(shared, (tuple, list)) else ()))
    if _cuda_layer.has_workspace(group_name, x, w_gate, topk_w, precision, training) or x.shape[0] == 0:
        # The peers are past this workspace's agreement and go straight into the fused call: this
        # rank raises alone, and they raise at its start barrier, naming this rank. A report to
        # them would wait in a collective they never enter. (With no tokens nobody makes a
        # workspace, so nobody listens either.)
        s_gate, s_up, s_down, _, plan = check()
    else:  # the first call of these shapes: the peers are in its agreement and raise too
        s_gate, s_up, s_down, _, plan = _checked(group_name, "cuda_workspace", check)

    return _cuda_layer.moe(x, topk_idx, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down,
                           None if swiglu_limit is None else float(swiglu_limit), group_name, save_context, plan,
                           precision)


def _check_moe(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
               shared: Sequence[Tensor] | None, swiglu_limit: float | None, config: MoeConfig | None,
               ranks: int, resolve: bool = True) -> tuple[Tensor | None, Tensor | None, Tensor | None,
                                                          _checks.LayerShape, dict[str, int] | None]:
    s_gate, s_up, s_down = _unpack_shared(shared)
    shape = _checks.check_layer(x, topk_w, w_gate, w_up, w_down, s_gate, s_up, s_down, swiglu_limit,
                                topk_idx=topk_idx)
    # Traced code (and the GPU op's caller, resolve=False) checks the config's types and values but
    # does not run the planner (a C++ call; the CPU stages' results do not depend on it, and the GPU
    # op resolves it when it runs).
    plan = _plan_overrides(config, shape, ranks, swiglu_limit, x.device,
                           resolve=resolve and not torch.compiler.is_compiling())
    return s_gate, s_up, s_down, shape, plan


def _plan_overrides(config: MoeConfig | None, shape: _checks.LayerShape, ranks: int, swiglu_limit: float | None,
                    device: torch.device, resolve: bool = True) -> dict[str, int] | None:
    """The planner's comm SMs, minibatch and ring for this layer under ``config`` (None: no config,
    the planner's defaults). Bad values raise ValueError naming them, on every device. ``resolve``
    False: the checks only (types, precision, scale blocks, no negative value), None."""
    if config is None:
        return None
    _check_config(config)
    if _precision(config) != "bf16":
        bad = {name: n for name, n in (("hidden", shape.hidden), ("intermediate", shape.intermediate),
                                       ("shared intermediate", shape.shared_intermediate)) if n % 128 != 0}
        if bad:
            raise ValueError(f"mok.moe: precision={_precision(config)!r} needs whole 128-column scale blocks: "
                             + ", ".join(f"{name} {n}" for name, n in bad.items()) + " is not a multiple of 128")
    if not resolve:
        return None
    if not _overrides_planner(config):
        return None  # the planner's defaults: the same workspace as no config
    # T = 0 runs nothing, but its config is checked as for one token.
    desc = _C.MoeDesc(tokens_per_rank=max(shape.tokens, 1), hidden=shape.hidden, intermediate=shape.intermediate,
                      num_experts=shape.local_experts * ranks, topk=shape.topk, ranks=ranks,
                      shared_intermediate=shape.shared_intermediate, swiglu_limit=swiglu_limit)
    try:
        plan = _plan(desc, device, config)
    except ValueError as error:
        raise ValueError(f"mok.moe: config {config}: {error}") from None
    if shape.tokens == 0:
        return None
    return _overrides(plan)


def _overrides_planner(config: MoeConfig) -> bool:
    """Whether a config sets any of the planner's fields (else the GPU layer's workspace is the default one)."""
    return any(getattr(config, name) is not None for name in _CONFIG_FIELDS if name not in ("precision", "domain_size"))


def _overrides(plan: dict[str, Any]) -> dict[str, int]:
    """The GPU handle's planner fields, as the planner resolved them under ``config``."""
    return {"comm_sms": int(plan["comm_sms"]), "minibatch_rows": int(plan["minibatch_rows"]),
            "ring_rows": int(plan["ring_rows"]), "fused_backward": int(plan["fused_backward"])}


def _moe_ops(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
             shared: Sequence[Tensor] | None, swiglu_limit: float | None, group_name: str, ranks: int,
             save_context: bool, config: MoeConfig | None = None) -> Tensor:
    """The layer through the torch.ops.mok stages (CPU tensors, and shapes for FakeTensors). The
    stages' results do not depend on config; it is checked all the same."""
    s_gate, s_up, s_down, shape, _ = _checked(group_name, "build_schedule", lambda: _check_moe(
        x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit, config, ranks))
    if _precision(config) != "bf16" and not _is_fake(x):
        raise NotImplementedError(f"mok.moe: precision={_precision(config)!r} runs on the GPU only (the fp8 "
                                  "megakernel); these tensors are on the CPU. The CPU reference of the fp8 layer is "
                                  f"`mok run --precision {_precision(config)}` (C++)")
    if swiglu_limit is not None:
        swiglu_limit = float(swiglu_limit)
    schedule = torch.ops.mok.build_schedule(topk_idx.contiguous(), shape.local_experts * ranks, group_name)
    y, *_ = torch.ops.mok.forward(x.contiguous(), topk_w.contiguous(), w_gate, w_up, w_down, s_gate, s_up, s_down,
                                  list(schedule), swiglu_limit, group_name, save_context)
    return y

