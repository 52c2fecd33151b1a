"""What the explicit passes cost against mok.moe on one GPU: the same layer, the same inputs,
timed in one process, the two taking turns.

- ``moe``: ``mok.moe`` forward and backward through autograd (the forward builds its schedule);
- ``explicit``: ``mok.build_schedule`` (a call of its own) -> ``mok.forward`` -> ``mok.backward``;
- ``schedule``: ``mok.build_schedule`` alone;
- ``moe_forward``: ``mok.moe``'s training forward alone (its context dropped).

Printed: median milliseconds over the timed iterations (the harness's timer, ``bench.runtime.measure``:
CUDA events around each iteration, launched back to back), and the bits of y and dx of the two paths
compared; and each one's host time (the CPU's time to launch one call in steady state, the device held busy
meanwhile: near the device time, the path is host-bound). ``--profile DIR`` also writes each one's kernels by device time (torch profiler) and its
host time by Python function (cProfile).

    python -m bench.explicit --preset qwen3-30b-a3b --tokens 8192 [--profile DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

import mok
from mok import testing

from .presets import get_preset
from .runtime import GPU_TIMING, Runtime, init_runtime, measure


def host_ms(fn: Callable[[], None], calls: int = 5, rounds: int = 3) -> float:
    """Host milliseconds of one ``fn()`` in steady state: ``calls`` calls launched back to back while
    the device is held busy by a sleep kernel (so the CPU never waits for it), their time divided
    by ``calls``; the median of ``rounds``. A call that waits for the device shows the sleep (~0.2 s)."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # about 0.2 s of device cycles
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) * 1e3 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_profile(fn: Callable[[], None], path: Path, label: str, calls: int = 20) -> None:
    """Where the host's time of ``calls`` calls goes (cProfile, the autograd backward on this thread),
    launched behind a sleep kernel so that the CPU never waits for the device."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{label}: {calls} calls, host time by function (cProfile)\n{text.getvalue()}\n")


def profile(fn: Callable[[], None], path: Path, label: str, iters: int = 5) -> None:
    """``iters`` calls of ``fn`` under the torch profiler: its kernels and ops by device time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{label}: {iters} calls (times are totals over the calls)\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--profile", type=Path, default=None, help="also write each one's kernel table here")
    args = parser.parse_args()
    rt: Runtime = init_runtime(smoke=False, timeout_s=300)
    shape = get_preset(args.preset)
    T, E, H, I, k = args.tokens, shape.E, shape.H, shape.I, shape.topk
    p = testing.random_problem(T, E, H, I, k, seed=1, device="cuda")
    dy = torch.randn(T, H, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).to(torch.bfloat16)
    weights = [w.detach().clone().requires_grad_(True) for w in (p.w_gate, p.w_up, p.w_down)]
    x = p.x.detach().clone().requires_grad_(True)
    w = p.topk_w.detach().clone().requires_grad_(True)
    ws = mok.get_workspace(None, None, device="cuda", num_local_tokens=T, hidden=H, intermediate=I, num_experts=E,
                           topk=k)
    out: dict[str, torch.Tensor] = {}

    def moe() -> None:
        y = mok.moe(x, p.topk_idx, w, *weights)
        y.backward(dy)
        out["moe"] = y.detach()
        out["moe dx"] = x.grad  # type: ignore[assignment]
        for t in (x, w, *weights):  # fresh gradients each time, as the explicit passes make them (no accumulation)
            t.grad = None

    def explicit() -> None:
        s = mok.build_schedule(ws, p.topk_idx)
        y, ctx = mok.forward(ws, s, p.x, p.topk_w, p.w_gate, p.w_up, p.w_down)
        g = mok.backward(ws, s, ctx, dy, p.x, p.topk_w, p.w_gate, p.w_up, p.w_down)
        out["explicit"], out["explicit dx"] = y, g.d_x

    def moe_forward() -> None:  # the training forward alone (its context dropped)
        out["moe forward"] = mok.moe(x, p.topk_idx, w, *weights).detach()

    def schedule() -> None:
        mok.build_schedule(ws, p.topk_idx)

    fns = {"moe": moe, "explicit": explicit, "schedule": schedule, "moe_forward": moe_forward}
    for fn in fns.values():  # warm-up: workspaces, kernels
        fn()
    results: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(3):  # turns, so that clocks treat them alike
        for name, fn in fns.items():
            results[name].append(measure(rt, lambda _arg, fn=fn: fn(), GPU_TIMING).median_ms)
    host = {name: host_ms(fn) for name, fn in fns.items()}
    ws.check()
    if args.profile is not None:
        for name, fn in fns.items():
            profile(fn, args.profile / f"explicit_{args.preset}_{T}_{name}.txt", f"{args.preset} {T} tokens: {name}")
            host_profile(fn, args.profile / f"host_{args.preset}_{T}_{name}.txt", f"{args.preset} {T} tokens: {name}")
    print(f"{args.preset}, {T} tokens, one GPU, the harness's timer x 3 turns (median of the turns' medians)")
    for name, values in results.items():
        print(f"  {name:11s} {statistics.median(values):8.3f} ms   turns {', '.join(f'{v:.3f}' for v in values)}"
              f"   host {host[name]:.3f} ms")
    print(f"  explicit / moe: {statistics.median(results['explicit']) / statistics.median(results['moe']):.3f}")
    print(f"  y bitwise equal: {torch.equal(out['moe'], out['explicit'])}; "
          f"dx bitwise equal: {torch.equal(out['moe dx'], out['explicit dx'])}")


if __name__ == "__main__":
    main()
