"""Each expert GEMM of MoK against ``torch._grouped_mm`` on the same grouped rows, one GPU.

The ``experts`` cases of ``bench.run`` time the whole MLP (both GEMMs forward, the whole backward);
this times each GEMM step alone, as the expert-kernel issue asks ("every grouped GEMM >= 1.0x
torch._grouped_mm"), in one process on one GPU, with each output checked against torch's before it
is timed:

====================  ======================================  ===========================================
step                  MoK (one launch unless said)            torch
====================  ======================================  ===========================================
gate_up               [g|u] = x [W_gate; W_up]^T, SwiGLU       [g|u] = one _grouped_mm on [W_gate; W_up]
                      fused (h and g|u stored, as training)
down                  y = h W_down^T                           y = _grouped_mm
dgrad                 dh = dy W_down, SwiGLU backward fused,   dh = _grouped_mm, dx = _grouped_mm over
                      then dx = dg W_gate + du W_up (2)        [dg|du] and [W_gate; W_up] (2)
dgrad_act             the same                                 the same with the SwiGLU backward between,
                                                               as autograd runs it (silu, silu_backward,
                                                               products, cat; no clamp)
dh_act, dx            dgrad's two launches apart               dgrad_act's dh GEMM with the SwiGLU
                                                               backward; its dx GEMM
wgrad                 dW_gate, dW_up, dW_down per expert,      d[W_gate; W_up] = one _grouped_mm over
                      bf16, fixed order (3)                    [dg|du]^T x, dW_down = _grouped_mm (2)
====================  ======================================  ===========================================

MoK's steps do more than torch's (the SwiGLU and its backward fused, three weight-gradient
launches where torch takes two): the ratio is torch's time over MoK's. Rows per expert are
multiples of 128 so both see the same rows (MoK pads each expert to 128 rows).

Two more steps, asked for by name (``--steps fwd_fp8,fwd_fp8_vs_bf16``; hidden and intermediate
multiples of 128), time the whole forward on e4m3 operands, MoK's ``experts_forward_fp8``
(block scales: 1 x 128 rows, 128 x 128 weights; h quantized inside) against:

====================  ==========================================================================
fwd_fp8               torch's fp8 forward with row-wise scales: ``torch._scaled_grouped_mm`` for
                      gate|up, the SwiGLU, h quantized row-wise in torch, ``_scaled_grouped_mm``
fwd_fp8_vs_bf16       torch's bf16 forward: ``_grouped_mm``, the SwiGLU, ``_grouped_mm``
====================  ==========================================================================

x and the weights are quantized once, outside the timing (in the layer a rank quantizes x before
the dispatch, and the weights once per step). MoK's y is checked against the bf16 forward's with
the e4m3 tolerance (--fp8-tolerance).

    python -m bench.gemms --out bench/results/<dir>/gemms_1gpu_h200.md   [--presets ...] [--rows 512,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mok import testing

from .impls._common import grouped_swiglu_mlp_e4m3, rowwise_e4m3
from .presets import get_preset

PRESETS = ("kimi-k2", "deepseek-v4-pro", "qwen3.5-397b", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b")
STEPS = ("gate_up", "down", "dgrad", "dgrad_act", "dh_act", "dx", "wgrad")
FP8_STEPS = ("fwd_fp8", "fwd_fp8_vs_bf16")  # by name only (not every preset has whole 128-blocks)


def step_flops(step: str, rows: int, hidden: int, intermediate: int) -> float:
    """FLOPs of a step's GEMMs (the fused elementwise work is not counted)."""
    mhi = float(rows) * hidden * intermediate
    return {"gate_up": 4 * mhi, "down": 2 * mhi, "dgrad": 6 * mhi, "dgrad_act": 6 * mhi, "dh_act": 2 * mhi,
            "dx": 4 * mhi, "wgrad": 6 * mhi, "fwd_fp8": 6 * mhi, "fwd_fp8_vs_bf16": 6 * mhi}[step]


def balanced_counts(local_experts: int, rows_per_expert: int) -> list[int]:
    if rows_per_expert % 128:
        raise ValueError(f"rows per expert must be a multiple of 128 (MoK's segment alignment), got {rows_per_expert}")
    return [rows_per_expert] * local_experts


@dataclass
class Row:
    preset: str
    local_experts: int
    rows_per_expert: int
    step: str
    mok_ms: float
    torch_ms: float
    flops: float
    rel_error: float
    dense_tflops: float
    schedule: str = "default"

    @property
    def ratio(self) -> float:
        return self.torch_ms / self.mok_ms

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12


def render(rows: list[Row], header: str) -> str:
    """A markdown table: both times, TF/s, the ratio and MoK's fraction of the dense rate."""
    out = [header, "",
           "| preset | El x rows | step | MoK ms | torch ms | MoK TF/s | torch TF/s | torch / MoK | MoK / dense | rel error |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        step = r.step if r.schedule == "default" else f"{r.step} ({r.schedule})"
        out.append(f"| {r.preset} | {r.local_experts} x {r.rows_per_expert} | {step} | {r.mok_ms:.3f} | "
                   f"{r.torch_ms:.3f} | {r.tflops(r.mok_ms):.0f} | {r.tflops(r.torch_ms):.0f} | {r.ratio:.2f} | "
                   f"{r.tflops(r.mok_ms) / r.dense_tflops:.0%} | {r.rel_error:.1e} |")
    return "\n".join(out) + "\n"


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def median_ms(fn: Callable[[], object], iters: int, warmup: int = 3, device: torch.device | None = None) -> float:
    """Median of per-call times, the calls enqueued back to back (one synchronization at the end,
    as bench.runtime's timer): the host's launch overhead overlaps the previous call instead of
    being timed on an idle GPU. On the CPU (the plumbing test), wall-clock per call."""
    for _ in range(warmup):
        fn()
    if device is not None and device.type == "cpu":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def dense_tflops(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2.0 * n**3 / (median_ms(lambda: a @ b, iters) * 1e-3) / 1e12


def run_shape(preset_name: str, rows_per_expert: int, dense: float, iters: int, tolerance: float,
              kernels: Any = None, device: str = "cuda", steps: tuple[str, ...] = STEPS,
              schedule: str = "default", fp8_tolerance: float = 0.08) -> list[Row]:
    """Every step of one shape: checked, then timed. ``kernels`` is mok._cuda_kernels (the default);
    the CPU plumbing test passes a torch stand-in with the same calls."""
    if kernels is None:
        from mok import _cuda_kernels as kernels
    k = kernels

    p = get_preset(preset_name)
    El, H, I = max(1, p.E // 8), p.H, p.I
    counts = balanced_counts(El, rows_per_expert)
    M = sum(counts)
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(zlib.crc32(f"{preset_name} {rows_per_expert}".encode()))
    bf = torch.bfloat16

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale).to(bf)

    x, dy = randn(M, H), randn(M, H)
    w_gate, w_up = randn(El, I, H, scale=H**-0.5), randn(El, I, H, scale=H**-0.5)
    w_down = randn(El, H, I, scale=I**-0.5)
    w_gu = torch.cat([w_gate, w_up], dim=1)  # [El, 2I, H]: torch's one gate|up GEMM
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    offs = ends.to(torch.int32).to(dev)  # torch: the groups' end offsets
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32).to(dev)  # MoK: El + 1 starts
    gu, h, y = (torch.empty(M, n, dtype=bf, device=dev) for n in (2 * I, I, H))
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    scratch = k.BackwardScratch(M, I, dev)
    row_weight = torch.ones(M, dtype=torch.float32, device=dev)
    dx, d_row_weight = torch.empty(M, H, dtype=bf, device=dev), torch.empty(M, dtype=torch.float32, device=dev)
    d_w = [torch.empty(shape, dtype=bf, device=dev) for shape in ((El, I, H), (El, I, H), (El, H, I))]
    limit = p.swiglu_limit
    fwd = dict(h=h, y=y, gu=gu, swiglu_limit=limit, status=status)
    bwd = dict(dx=dx, d_row_weight=d_row_weight, d_w_gate=d_w[0], d_w_up=d_w[1], d_w_down=d_w[2], scratch=scratch,
               swiglu_limit=limit, status=status)

    def mok_gate_up() -> None:
        k.experts_forward(x, offsets, w_gate, w_up, w_down, which=1, **fwd)

    def mok_down() -> None:
        k.experts_forward(x, offsets, w_gate, w_up, w_down, which=2, **fwd)

    def mok_dgrad() -> None:
        k.experts_backward(x, offsets, gu, h, dy, row_weight, w_gate, w_up, w_down, which=1, **bwd)

    def mok_wgrad() -> None:
        k.experts_backward(x, offsets, gu, h, dy, row_weight, w_gate, w_up, w_down, which=2, **bwd)

    def torch_gate_up() -> torch.Tensor:
        return torch._grouped_mm(x, w_gu.transpose(-2, -1), offs=offs)

    def torch_down() -> torch.Tensor:
        return torch._grouped_mm(h, w_down.transpose(-2, -1), offs=offs)

    def torch_dgrad() -> tuple[torch.Tensor, torch.Tensor]:
        dh = torch._grouped_mm(dy, w_down, offs=offs)
        return dh, torch._grouped_mm(scratch.dgu, w_gu, offs=offs)

    def torch_dh_act() -> torch.Tensor:
        dh = torch._grouped_mm(dy, w_down, offs=offs)
        g, u = gu[:, :I], gu[:, I:]
        du = dh * torch.nn.functional.silu(g)
        dg = torch.ops.aten.silu_backward(dh * u, g)
        return torch.cat([dg, du], dim=1)

    def torch_dx() -> torch.Tensor:
        return torch._grouped_mm(scratch.dgu, w_gu, offs=offs)

    def torch_dgrad_act() -> torch.Tensor:
        return torch._grouped_mm(torch_dh_act(), w_gu, offs=offs)

    def mok_dh_act() -> None:
        k.experts_backward(x, offsets, gu, h, dy, row_weight, w_gate, w_up, w_down, which=3, **bwd)

    def mok_dx() -> None:
        k.experts_backward(x, offsets, gu, h, dy, row_weight, w_gate, w_up, w_down, which=4, **bwd)

    def torch_wgrad() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch._grouped_mm(scratch.dgu.t(), x, offs=offs), torch._grouped_mm(dy.t(), scratch.hw, offs=offs))

    fp8_calls: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    fp8_errors: dict[str, float] = {}
    if any(step in FP8_STEPS for step in steps):
        if H % 128 or I % 128:
            raise ValueError(f"{preset_name}: the fp8 steps need hidden and intermediate multiples of 128, got {H}, {I}")
        xq = k.quantize_rows(x)
        wq = [k.quantize_weights(w) for w in (w_gate, w_up, w_down)]
        hq = (torch.empty(M, I, dtype=torch.float8_e4m3fn, device=dev), torch.empty(I // 128, M, device=dev))

        def mok_fwd_fp8() -> None:
            k.experts_forward_fp8(xq, offsets, *wq, h=h, y=y, h_codes=hq, gu=gu, swiglu_limit=limit, status=status)

        x8, wgu8, wd8 = rowwise_e4m3(x), rowwise_e4m3(w_gu), rowwise_e4m3(w_down)

        def torch_fwd_fp8() -> torch.Tensor:
            return grouped_swiglu_mlp_e4m3(x8, offs, wgu8, wd8, limit)

        def torch_fwd_bf16() -> torch.Tensor:
            a = torch._grouped_mm(x, w_gu.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(testing.swiglu(a[:, :I], a[:, I:], limit), w_down.transpose(-2, -1), offs=offs)

        y.fill_(float("nan"))
        mok_fwd_fp8()
        want = torch_fwd_bf16()
        fp8_errors["fwd_fp8"] = fp8_errors["fwd_fp8_vs_bf16"] = rel_error(y, want)  # MoK's, checked below
        try:  # torch's fp8 grouped GEMM: its y against the same bf16 forward, for the record
            print(f"{preset_name} {El}x{rows_per_expert}: fp8 y against the bf16 forward's, relative L2 error: "
                  f"MoK {fp8_errors['fwd_fp8']:.3e}, torch row-wise {rel_error(torch_fwd_fp8(), want):.3e}", flush=True)
            fp8_calls["fwd_fp8"] = (mok_fwd_fp8, torch_fwd_fp8)
        except (RuntimeError, NotImplementedError) as e:
            print(f"{preset_name}: torch._scaled_grouped_mm is not usable here ({e}); fwd_fp8 is skipped",
                  file=sys.stderr)
        fp8_calls["fwd_fp8_vs_bf16"] = (mok_fwd_fp8, torch_fwd_bf16)

    # Each MoK step runs first on fresh (poisoned) outputs, and every output it writes is checked:
    # its GEMMs' against torch's on the same inputs, its fused elementwise work (SwiGLU, its
    # backward, d row weight) against mok.testing's fp32 formulas on torch's GEMM outputs.
    out: list[Row] = []
    for t in (gu, h, y, dx, *d_w, scratch.dgu, scratch.hw, d_row_weight):
        t.fill_(float("nan"))
    mok_gate_up()
    t_gu = torch_gate_up().float()
    err_gate_up = max(rel_error(gu, t_gu), rel_error(h, testing.swiglu(t_gu[:, :I], t_gu[:, I:], limit)))
    mok_down()
    err_down = rel_error(y, torch_down())
    mok_dgrad()
    # dh_act: dg|du from torch's dh and the saved g|u; w*h with w = 1 is h; d row weight = sum dh*h.
    t_dh = torch._grouped_mm(dy, w_down, offs=offs).float()
    t_dg, t_du = testing.swiglu_backward(gu[:, :I].float(), gu[:, I:].float(), t_dh, limit)
    err_dh_act = max(rel_error(scratch.dgu, torch.cat([t_dg, t_du], dim=1)), rel_error(scratch.hw, h),
                     rel_error(d_row_weight, (t_dh * h.float()).sum(dim=1)))
    err_dx = rel_error(dx, torch_dgrad()[1])
    mok_wgrad()
    t_wgu, t_wd = torch_wgrad()
    err_wgrad = max(rel_error(d_w[0], t_wgu[:, :I]), rel_error(d_w[1], t_wgu[:, I:]), rel_error(d_w[2], t_wd))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if int(status.item()) != 0:
        raise RuntimeError(f"{preset_name} {rows_per_expert}: MoK's status word is {int(status.item())}")
    # dgrad is its two launches, dh_act and dx; dgrad_act times the same MoK call as dgrad.
    err_dgrad = max(err_dh_act, err_dx)
    errors = dict(gate_up=err_gate_up, down=err_down, dgrad=err_dgrad, dgrad_act=err_dgrad, dh_act=err_dh_act,
                  dx=err_dx, wgrad=err_wgrad)
    calls = dict(gate_up=(mok_gate_up, torch_gate_up), down=(mok_down, torch_down), dgrad=(mok_dgrad, torch_dgrad),
                 dgrad_act=(mok_dgrad, torch_dgrad_act), dh_act=(mok_dh_act, torch_dh_act), dx=(mok_dx, torch_dx),
                 wgrad=(mok_wgrad, torch_wgrad))
    errors |= fp8_errors
    calls |= fp8_calls
    for step in steps:  # the steps asked for (the name once held the table of calls: every step ran)
        if step not in calls:
            continue  # an fp8 baseline torch cannot run here (said above)
        limit_here = fp8_tolerance if step in FP8_STEPS else tolerance
        if not errors[step] <= limit_here:  # NaN fails too
            raise RuntimeError(f"{preset_name} {El}x{rows_per_expert} {step}: MoK differs from torch "
                               f"(relative L2 error {errors[step]:.3e} > {limit_here})")
        ours, theirs = calls[step]
        # Interleaved twice: the power cap moves the clocks between measurements.
        mok_times, torch_times = [], []
        for _ in range(2):
            mok_times.append(median_ms(ours, iters, device=dev))
            torch_times.append(median_ms(theirs, iters, device=dev))
        out.append(Row(preset_name, El, rows_per_expert, step, min(mok_times), min(torch_times),
                       step_flops(step, M, H, I), errors[step], dense, schedule))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--rows", default="512,1024,4096", help="rows per expert (multiples of 128)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--steps", default=",".join(STEPS), help="which of " + ",".join(STEPS + FP8_STEPS))
    ap.add_argument("--schedules", default="default",
                    help="the expert kernels' schedules to time, one after the other on each shape: default (each "
                         "launch's own), or cooperative / pingpong for all (MOK_EXPERT_SCHEDULE); a '+rows' suffix "
                         "times the weight gradients in the rows tile order (MOK_WGRAD_TILES=rows; default columns); "
                         "torch is timed again beside each")
    ap.add_argument("--tolerance", type=float, default=0.02, help="relative L2 error allowed against torch")
    ap.add_argument("--fp8-tolerance", type=float, default=0.08,
                    help="the fp8 steps' relative L2 error allowed against torch's bf16 forward (e4m3: 3 mantissa bits)")
    ap.add_argument("--out", type=Path, required=True, help="the markdown table; the JSON goes next to it")
    args = ap.parse_args(argv)
    steps = tuple(args.steps.split(","))
    schedules = args.schedules.split(",")
    unknown = [s for s in steps if s not in STEPS + FP8_STEPS] + [
        s for s in schedules if s.removesuffix("+rows") not in ("default", "cooperative", "pingpong")]
    if unknown:
        ap.error(f"unknown step or schedule: {', '.join(unknown)}")
    try:  # every shape checked before the first is timed
        for rpe in args.rows.split(","):
            balanced_counts(1, int(rpe))
    except ValueError as e:
        ap.error(f"--rows: {e}")
    if not torch.cuda.is_available():
        print("bench.gemms needs a GPU (the MoK kernels are sm_90a)", file=sys.stderr)
        return 2
    dense = dense_tflops()
    rows: list[Row] = []
    for rpe in (int(r) for r in args.rows.split(",")):
        for preset in args.presets.split(","):
            for schedule in schedules:
                # The launchers read MOK_EXPERT_SCHEDULE and MOK_WGRAD_TILES on every call.
                kernels = schedule.removesuffix("+rows")
                if kernels == "default":
                    os.environ.pop("MOK_EXPERT_SCHEDULE", None)
                else:
                    os.environ["MOK_EXPERT_SCHEDULE"] = kernels
                if schedule.endswith("+rows"):
                    os.environ["MOK_WGRAD_TILES"] = "rows"
                else:
                    os.environ.pop("MOK_WGRAD_TILES", None)
                shape_rows = run_shape(preset, rpe, dense, args.iters, args.tolerance, steps=steps, schedule=schedule,
                                       fp8_tolerance=args.fp8_tolerance)
                for row in shape_rows:
                    rows.append(row)
                    print(f"{row.preset:16s} {row.local_experts:3d} x {row.rows_per_expert:5d} {row.step:8s} {row.schedule:11s} "
                          f"mok {row.mok_ms:8.3f} ms  torch {row.torch_ms:8.3f} ms  torch/mok {row.ratio:5.2f}  "
                          f"mok {row.tflops(row.mok_ms):5.0f} TF/s ({row.tflops(row.mok_ms) / dense:.0%} of dense)", flush=True)
    header = (f"# Expert GEMMs, MoK against torch._grouped_mm ({torch.cuda.get_device_name()}, torch {torch.__version__})\n\n"
              f"Dense bf16 rate measured in the same run: {dense:.0f} TF/s. Balanced rows; each time is the lower of two "
              f"interleaved medians of {args.iters} iterations; outputs checked against torch first.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(rows, header))
    args.out.with_suffix(".json").write_text(json.dumps(
        {"dense_tflops": dense, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]}, indent=1))
    print(render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
