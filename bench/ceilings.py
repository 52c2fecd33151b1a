"""Machine ceilings measured at the start of every run: the rates the floors are computed from.

- ``bf16_tflops``: dense bf16 matmul, 8192^3, random data, median of several.
- ``hbm_gbps``: device-to-device copy of 1 GiB, counting bytes read + written.
- ``nvlink_read_gbps`` / ``nvlink_write_gbps``: per direction, through torch symmetric memory. Every
  rank runs an SM copy kernel at the same time: read = from its neighbour's buffer into a local
  one, write = from a local buffer into the neighbour's. With every rank doing it, each link
  direction carries one stream, so bytes / time is the per-direction rate. The kernel of record is
  mok's copy on the raw peer addresses (``handle.buffer_ptrs``) where the library is built, else a
  torch elementwise op; torch's and the copy engine's (``Tensor.copy_``) rates are recorded beside
  it, each only if its data check passed. Null on one GPU.

In smoke mode (CPU) only a quick matmul and memcpy rate are taken, marked ``measured_on: "cpu"``.
"""

from __future__ import annotations

import statistics
import traceback
from typing import Any, Callable

import torch

from .runtime import Runtime

NVLINK_BUFFER_BYTES = 256 * 1024 * 1024  # 268 MB

# Symmetric buffers live until the process exits: freeing one may be collective (nvshmem_free), and
# ranks must not do that at different times through the caching allocator.
_KEEP_ALIVE: list[object] = []


def _median_ms(rt: Runtime, fn: Callable[[], object], warmup: int, iters: int, all_ranks: bool) -> float:
    """Median over iterations of the slowest rank's time (all_ranks) or of this rank's time."""
    from .runtime import _time_iterations  # the same timer the cases use

    _time_iterations(rt, lambda _: fn(), None, warmup)
    mine = torch.tensor(_time_iterations(rt, lambda _: fn(), None, iters), dtype=torch.float64, device=rt.device)
    if all_ranks:
        mine = rt.all_gather_tensor(mine.unsqueeze(0)).max(dim=0).values
    return statistics.median(mine.tolist())


def _matmul_tflops(rt: Runtime, n: int, warmup: int, iters: int) -> float:
    a = torch.randn(n, n, device=rt.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=rt.device, dtype=torch.bfloat16)
    ms = _median_ms(rt, lambda: a @ b, warmup, iters, all_ranks=False)
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def _copy_gbps(rt: Runtime, nbytes: int, warmup: int, iters: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=rt.device).fill_(1)
    dst = torch.empty_like(src)
    ms = _median_ms(rt, lambda: dst.copy_(src), warmup, iters, all_ranks=False)
    return 2.0 * nbytes / (ms * 1e-3) / 1e9


def _mok_copy() -> Callable[[int, int, int], None] | None:
    """The SM copy of mok's C API on raw device addresses, or None where the library is not built."""
    try:
        from .impls.mok_kernels import _cuda_kernels

        return _cuda_kernels().copy_bytes
    except Exception:
        return None


def _nvlink_gbps(rt: Runtime, warmup: int, iters: int) -> dict[str, Any]:
    """Per-direction peer read/write rates; every rank reads from / writes to rank+1 at the same time.

    Two SM paths: mok's copy kernel on the raw peer address from ``handle.buffer_ptrs`` (what the
    megakernel uses; preferred where the library is built), and torch elementwise ops on
    ``handle.get_buffer``. Each path is timed, then checked with a clean write: a path whose check
    fails on any rank is dropped (its error recorded), and the verdict is agreed by all ranks before
    anyone raises, so no rank waits in a collective the others skipped.
    """
    import torch.distributed._symmetric_memory as symm_mem

    numel = NVLINK_BUFFER_BYTES // 2
    group_name = rt.group.group_name
    try:
        symm_mem.enable_symm_mem_for_group(group_name)
    except Exception:  # deprecated / unnecessary on newer torch
        pass
    symm_buf = symm_mem.empty(numel, dtype=torch.bfloat16, device=rt.device).fill_(rt.rank)
    handle = symm_mem.rendezvous(symm_buf, rt.group)
    _KEEP_ALIVE.extend((symm_buf, handle))
    peer = (rt.rank + 1) % rt.world_size
    left = (rt.rank - 1) % rt.world_size
    remote = handle.get_buffer(peer, (numel,), torch.bfloat16)
    local = torch.empty(numel, dtype=torch.bfloat16, device=rt.device).fill_(rt.rank)
    peer_ptr = int(handle.buffer_ptrs[peer])
    info: dict[str, Any] = {
        "nvlink_pointers": {
            "get_buffer_is_buffer_ptrs": remote.data_ptr() == peer_ptr,
            "peer_ptr_is_local": peer_ptr == symm_buf.data_ptr(),
        }
    }
    rt.barrier()

    def rate(fn: Callable[[], object]) -> float:
        ms = _median_ms(rt, fn, warmup, iters, all_ranks=True)
        return NVLINK_BUFFER_BYTES / (ms * 1e-3) / 1e9

    def write_check(write: Callable[[], object], sign: float) -> tuple[bool, tuple[float, float]]:
        # Every rank writes its rank (times `sign`: the torch path writes negated values) into its
        # right neighbour's buffer; ours must then hold our left neighbour's. Agreed by all ranks.
        symm_buf.fill_(-1.0)
        local.fill_(rt.rank)
        rt.barrier()
        write()
        torch.cuda.synchronize()
        rt.barrier()
        seen = (float(symm_buf[0]), float(symm_buf[-1]))
        expected = float(sign * left)
        ok = rt.all_min([1.0 if seen == (expected, expected) else 0.0])[0] >= 1.0
        return ok, seen

    paths: dict[str, dict[str, Callable[[], object]]] = {}
    copy = _mok_copy()
    if copy is not None:
        paths["mok_copy"] = {
            "read": lambda: copy(local.data_ptr(), peer_ptr, NVLINK_BUFFER_BYTES),
            "write": lambda: copy(peer_ptr, local.data_ptr(), NVLINK_BUFFER_BYTES),
        }
    # Elementwise ops (an SM kernel; a copy_ would be a cudaMemcpy): read pulls, write pushes.
    paths["torch"] = {"read": lambda: torch.neg(remote, out=local), "write": lambda: torch.neg(local, out=remote)}
    paths["copy_engine"] = {"read": lambda: local.copy_(remote), "write": lambda: remote.copy_(local)}
    # Which path every rank can use is agreed collectively: the same sequence of collectives on all.
    have_copy = rt.all_min([1.0 if copy is not None else 0.0])[0] >= 1.0
    if not have_copy:
        paths.pop("mok_copy", None)
    for name, fns in paths.items():
        read, write = rate(fns["read"]), rate(fns["write"])
        ok, seen = write_check(fns["write"], -1.0 if name == "torch" else 1.0)
        if ok:
            info[f"nvlink_read_gbps_{name}"] = read
            info[f"nvlink_write_gbps_{name}"] = write
        else:
            info.setdefault("nvlink_path_errors", {})[name] = (
                f"peer write check failed on some rank (this rank saw {seen} from rank {left}); "
                f"timed {read:.0f}/{write:.0f} GB/s dropped")
    for name in ("mok_copy", "torch"):  # the SM path of record: mok's kernel, else torch's
        if f"nvlink_read_gbps_{name}" in info:
            info["nvlink_read_gbps"] = info[f"nvlink_read_gbps_{name}"]
            info["nvlink_write_gbps"] = info[f"nvlink_write_gbps_{name}"]
            info["nvlink_path"] = name
            break
    else:
        raise RuntimeError(f"no NVLink path passed its peer write check: {info.get('nvlink_path_errors')}")
    return info


def measure_ceilings(rt: Runtime, smoke: bool) -> dict[str, Any]:
    """All ceilings; a measurement that fails is null, with its error under ``errors``."""
    ceilings: dict[str, Any] = {
        "bf16_tflops": None,
        "hbm_gbps": None,
        "nvlink_read_gbps": None,
        "nvlink_write_gbps": None,
        "measured_on": "cpu" if smoke else "cuda",
        "errors": {},
    }

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        try:
            value = fn()
            if isinstance(value, dict):
                ceilings.update(value)
            else:
                ceilings[name] = value
        except Exception as exc:  # recorded, never fatal
            ceilings["errors"][name] = f"{type(exc).__name__}: {exc}"
            ceilings["errors"][name + "_traceback"] = traceback.format_exc(limit=4)

    if smoke:
        attempt("bf16_tflops", lambda: _matmul_tflops(rt, 256, 1, 3))
        attempt("hbm_gbps", lambda: _copy_gbps(rt, 32 << 20, 1, 3))
        ceilings["note"] = "CPU smoke run: quick matmul and memcpy rates, no NVLink"
    else:
        attempt("bf16_tflops", lambda: _matmul_tflops(rt, 8192, 3, 10))
        attempt("hbm_gbps", lambda: _copy_gbps(rt, 1 << 30, 3, 10))
        if rt.world_size > 1:
            attempt("nvlink", lambda: _nvlink_gbps(rt, 2, 8))
        # Every rank must agree that the nvlink measurement ran (it holds collectives).
        rt.barrier()
    # Rates are per rank; report the slowest rank's (same machine, so they should agree).
    for key in ("bf16_tflops", "hbm_gbps", "nvlink_read_gbps", "nvlink_write_gbps"):
        value = ceilings.get(key)
        lowest = rt.all_min([value if isinstance(value, (int, float)) else -1.0])[0]
        ceilings[key] = lowest if lowest >= 0 else None
    return ceilings
