"""The expert-parallel group as the CPU backend sees it: rank agreement and row exchange over gloo.

Ops carry the group by name (``str``), the way torch's functional collectives do, so that their
schemas stay plain; ``""`` means no group (one rank, nothing exchanged).

Exchange contract (what :mod:`mok._cpu` relies on). A rank's routed slots ``t*k + j`` in
``send_order`` (sorted by global expert id, then slot) are grouped by destination rank, because
rank ``d`` owns the contiguous experts ``[d*El, (d+1)*El)``; inside each group they are in the
destination's canonical schedule order restricted to this source. So one ``all_to_all_single``
moves every routed row, and the receiver puts the rows of source ``r`` into its schedule rows
whose ``src_rank == r``, in order (``recv_order``). The way back is the same exchange reversed.
Empty slots (expert id -1) come last in ``send_order`` and are never sent: the first
``send_counts.sum()`` entries are the routed ones.
Gloo implements ``all_to_all_single`` with uneven splits on CPU tensors (bf16 included) in
torch >= 2.10, so no all_gather fallback is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["EpGroup", "group_name_of", "resolve", "agree", "report_failure", "dispatch_rows", "combine_rows",
           "all_gather_rows"]

# agree() gathers a fixed-size record from every rank: [step, status, 14 values]. The fixed size
# means two ranks that reached different agree() calls still exchange matching tensors, and the
# step tag turns that into an error instead of a silent mix-up.
_RECORD = 16
_STATUS_OK, _STATUS_VALUE_ERROR, _STATUS_TYPE_ERROR = 0, 1, 2
_STEPS = ("get_workspace", "build_schedule", "forward", "backward", "recompute_forward_context", "cuda_workspace",
          "domains")


@dataclass(frozen=True)
class EpGroup:
    """This process's place in the expert-parallel group (``name == ""``: one rank, no group).

    Holds the group's name, not the ProcessGroup: nothing in mok keeps a process group alive past
    ``destroy_process_group`` (a gloo group destroyed at interpreter exit can abort the process)."""

    name: str
    rank: int
    size: int

    @property
    def pg(self) -> dist.ProcessGroup | None:
        return c10d._resolve_process_group(self.name) if self.name else None

    def describe(self, group_rank: int) -> str:
        g = group_rank if not self.name else dist.get_global_rank(self.pg, group_rank)
        return f"rank {group_rank}" if g == group_rank else f"rank {group_rank} (global rank {g})"


def group_name_of(group: dist.ProcessGroup | None) -> str:
    """The name ops carry for ``group``; ``""`` for ``None`` (no expert parallelism)."""
    if group is None:
        return ""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return group.group_name


def resolve(name: str) -> EpGroup:
    """The group an op was given by name."""
    if not name:
        return EpGroup("", 0, 1)
    if not dist.is_initialized():
        raise ValueError(f"mok: expert-parallel group {name!r} given, but torch.distributed is not initialized")
    pg = c10d._resolve_process_group(name)
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError(f"mok: this process (global rank {dist.get_rank()}) is not in the expert-parallel group {name!r}")
    return EpGroup(name, rank, dist.get_world_size(pg))


# The words a record may hold (a precision), as -2, -3, ...: no valid number is negative.
_WORDS = ("bf16", "fp8", "fp8_dgrad")


def _encode(value: float | int | str | None) -> float:
    # Records are float64: integers up to 2**53 are exact; None (an absent swiglu_limit) is -1,
    # which no valid value takes, and the known words -2 - their index.
    if value is None:
        return -1.0
    if isinstance(value, str):
        if value not in _WORDS:
            raise AssertionError(f"agree(): no encoding for the word {value!r}")
        return -2.0 - _WORDS.index(value)
    return float(value)


Values = dict[str, float | int | str | None]


def agree(group: EpGroup, step: str, check: Callable[[], Values]) -> None:
    """Makes every rank of the group raise, or none: bad input on one rank never hangs the others.

    ``check`` runs this rank's local checks and returns the values (shapes, options) that must be
    equal on every rank. If it raises TypeError or ValueError on any rank, that rank re-raises its
    own error and every other rank raises the same type naming that rank and its message. If the
    values differ, every rank raises ValueError naming the field and each rank's value.
    """
    try:
        values = check()
    except (TypeError, ValueError) as error:
        report_failure(group, step, error)
        raise
    _exchange(group, step, None, values)


def report_failure(group: EpGroup, step: str, error: Exception) -> None:
    """This rank's local checks for ``step`` failed with ``error``: tells the other ranks, which are
    in that step's :func:`agree` (they raise, naming this rank). The caller raises ``error``."""
    _exchange(group, step, error, {})


def _exchange(group: EpGroup, step: str, error: Exception | None, values: Values) -> None:
    if group.size == 1:
        return
    if len(values) > _RECORD - 2:
        raise AssertionError("agree(): too many values for one record")
    record = torch.zeros(_RECORD, dtype=torch.float64)
    record[0] = _STEPS.index(step)
    if error is not None:
        record[1] = _STATUS_TYPE_ERROR if isinstance(error, TypeError) else _STATUS_VALUE_ERROR
    elif values:
        record[2 : 2 + len(values)] = torch.tensor([_encode(v) for v in values.values()], dtype=torch.float64)
    gathered = all_gather_rows(group, record.view(1, _RECORD)).view(group.size, _RECORD)

    steps = gathered[:, 0].to(torch.int64).tolist()
    if any(s != steps[0] for s in steps):
        where = ", ".join(f"{group.describe(r)} in {_STEPS[s]}" for r, s in enumerate(steps))
        raise ValueError(f"mok.{step}: the ranks of the expert-parallel group are out of step ({where}); "
                         "every rank must make the same mok calls with the same shapes")
    statuses = gathered[:, 1].to(torch.int64).tolist()
    failed = [r for r, s in enumerate(statuses) if s != _STATUS_OK]
    if failed:
        messages: list[str | None] = [None] * group.size
        dist.all_gather_object(messages, None if error is None else str(error), group=group.pg)
        if error is not None:
            return  # the caller raises its own error
        r = failed[0]
        cls = TypeError if statuses[r] == _STATUS_TYPE_ERROR else ValueError
        raise cls(f"mok.{step}: {group.describe(r)} of the expert-parallel group rejected its inputs: {messages[r]}")
    for i, name in enumerate(values):
        column = gathered[:, 2 + i].tolist()
        if any(v != column[0] for v in column):
            shown = ", ".join(f"{group.describe(r)}: {_show(v)}" for r, v in enumerate(column))
            raise ValueError(f"mok.{step}: the ranks of the expert-parallel group disagree on {name} ({shown}); "
                             "every rank must pass the same shapes and options")


def _show(v: float) -> str:
    if v == -1.0:
        return "None"
    if v <= -2.0 and v == int(v) and int(-2 - v) < len(_WORDS):
        return repr(_WORDS[int(-2 - v)])
    return str(int(v)) if v == int(v) else repr(v)


def _collective_device(group: EpGroup, t: torch.Tensor) -> torch.device:
    """Where a collective on ``group`` can take ``t``: its own device, or the current GPU for a CPU
    tensor on a group without a CPU backend (NCCL)."""
    if t.device.type != "cpu" or "gloo" in str(dist.get_backend(group.pg)):
        return t.device
    return torch.device("cuda", torch.cuda.current_device())


def all_gather_rows(group: EpGroup, rows: torch.Tensor) -> torch.Tensor:
    """``[R * n, ...]``: every rank's ``rows [n, ...]`` (same n everywhere), in group rank order."""
    rows = rows.contiguous()
    if group.size == 1:
        return rows
    device = _collective_device(group, rows)
    moved = rows.to(device)
    out = moved.new_empty((group.size * rows.shape[0],) + tuple(rows.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group.pg)
    return out.to(rows.device)


def _all_to_all(group: EpGroup, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    if group.size == 1:
        return send
    recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=group.pg)
    return recv


def dispatch_rows(group: EpGroup, per_slot_rows: torch.Tensor, send_counts: torch.Tensor,
                  recv_counts: torch.Tensor, recv_order: torch.Tensor) -> torch.Tensor:
    """Source -> destination: ``per_slot_rows [n, w]`` (the n routed slots, in ``send_order``) become
    this rank's schedule rows ``[M, w]``, in canonical order. Exact (data movement only)."""
    recv = _all_to_all(group, per_slot_rows, send_counts.tolist(), recv_counts.tolist())
    rows = recv.new_empty((recv_order.shape[0],) + tuple(recv.shape[1:]))
    rows[recv_order] = recv
    return rows


def combine_rows(group: EpGroup, rows: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor,
                 recv_order: torch.Tensor, send_order: torch.Tensor) -> torch.Tensor:
    """Destination -> source: schedule rows ``[M, w]`` go back to the (token, j) slots they came from;
    returns this rank's ``[T*k, w]`` slots: each routed slot written once, the empty ones (expert id
    -1, last in ``send_order``) zero. Exact (data movement only)."""
    back = _all_to_all(group, rows.index_select(0, recv_order), recv_counts.tolist(), send_counts.tolist())
    slots = back.new_zeros((send_order.shape[0],) + tuple(back.shape[1:]))
    slots[send_order[:back.shape[0]]] = back
    return slots
