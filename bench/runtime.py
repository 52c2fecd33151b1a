"""Process group, device and collective helpers, and the iteration timer.

One :class:`Runtime` per process. On GPUs every rank drives ``cuda:LOCAL_RANK`` with NCCL (plus gloo
for CPU-side objects); in smoke mode everything runs on the CPU with gloo. A process started
without torchrun is a one-rank group, so code paths are the same at R = 1.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- collectives (every rank must call them in the same order) -------------------------------

    def barrier(self) -> None:
        """Host-side barrier: returns once every rank reached it and the device drained."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def stream_barrier(self) -> None:
        """Barrier ordered on the current stream (no host sync on GPUs): later work starts after all ranks got here."""
        if self.world_size == 1:
            return
        if self.is_cuda:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
        else:
            dist.barrier(group=self.group)

    def _reduce(self, values: Sequence[float], op: dist.ReduceOp) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def all_max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def all_min(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MIN)

    def all_gather_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``[world_size * n, ...]``: every rank's tensor stacked along dim 0 in rank order."""
        t = t.contiguous()
        if self.world_size == 1:
            return t.clone()
        out = t.new_empty((self.world_size * t.shape[0],) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(out, t, group=self.group)
        return out

    def reduce_scatter_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of ``t [world_size * n, ...]``; rank r gets rows ``[r*n, (r+1)*n)``."""
        t = t.contiguous()
        if self.world_size == 1:
            return t
        out = t.new_empty((t.shape[0] // self.world_size,) + tuple(t.shape[1:]))
        dist.reduce_scatter_tensor(out, t, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    # -- memory ------------------------------------------------------------------------------------

    def free_memory_bytes(self) -> int | None:
        """Device memory free for new tensors (after emptying the caching allocator); None on the CPU."""
        if not self.is_cuda:
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free)


def init_runtime(smoke: bool, timeout_s: float) -> Runtime:
    """Initialise the process group from torchrun's environment (or as a one-rank group)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    timeout = datetime.timedelta(seconds=timeout_s)
    if smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: run with --smoke for the CPU plumbing test")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # NCCL for device tensors, gloo for CPU objects; a hung collective aborts after `timeout`.
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", rank=rank, world_size=world_size, timeout=timeout, device_id=device
        )
    group = dist.group.WORLD
    assert group is not None
    return Runtime(rank=rank, world_size=world_size, device=device, group=group)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@dataclass
class TimingPolicy:
    """Warm-up, then iterations bounded by a per-measurement time budget."""

    warmup: int
    min_iters: int
    max_iters: int
    budget_s: float


GPU_TIMING = TimingPolicy(warmup=3, min_iters=5, max_iters=50, budget_s=1.0)
SMOKE_TIMING = TimingPolicy(warmup=1, min_iters=2, max_iters=3, budget_s=0.05)


def _time_iterations(
    rt: Runtime, run: Callable[[Any], Any], prepare: Callable[[], Any] | None, iters: int
) -> list[float]:
    """Per-iteration milliseconds on this rank; each iteration starts after a barrier of all ranks.

    ``prepare()`` (untimed, e.g. a fresh forward before a timed backward) produces run's argument.
    On GPUs the window is measured with CUDA events on the current stream.
    """
    times: list[float] = []
    if rt.is_cuda:
        events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for _ in range(iters):
            arg = prepare() if prepare else None
            rt.stream_barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            result = run(arg)
            end.record()
            del arg, result
            events.append((start, end))
        torch.cuda.synchronize(rt.device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(iters):
            arg = prepare() if prepare else None
            rt.stream_barrier()
            t0 = time.perf_counter()
            result = run(arg)
            times.append((time.perf_counter() - t0) * 1e3)
            del arg, result
    return times


@dataclass
class Timing:
    median_ms: float  # median over iterations of the slowest rank's time
    min_ms: float
    max_ms: float
    iterations: int
    warmup: int
    rank_median_ms: list[float]  # each rank's own median


def measure(
    rt: Runtime,
    run: Callable[[Any], Any],
    policy: TimingPolicy,
    prepare: Callable[[], Any] | None = None,
) -> Timing:
    """Warm up, choose the iteration count (same on every rank), time, and reduce over ranks."""
    warm = _time_iterations(rt, run, prepare, policy.warmup)
    per_iter_ms = rt.all_max([statistics.median(warm) if warm else 0.0])[0]
    wanted = int(policy.budget_s * 1e3 / max(per_iter_ms, 1e-3))
    iters = max(policy.min_iters, min(policy.max_iters, wanted))
    mine = torch.tensor(_time_iterations(rt, run, prepare, iters), dtype=torch.float64, device=rt.device)
    all_ranks = rt.all_gather_tensor(mine.unsqueeze(0))  # [R, iters]
    slowest = all_ranks.max(dim=0).values.tolist()
    return Timing(
        median_ms=statistics.median(slowest),
        min_ms=min(slowest),
        max_ms=max(slowest),
        iterations=iters,
        warmup=policy.warmup,
        rank_median_ms=[statistics.median(row) for row in all_ranks.tolist()],
    )
