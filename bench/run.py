"""Run a case table: ceilings first, then every (case, impl, pass), checked against the reference, then timed.

    python -m bench.run --cases TABLE[:FILTER] --out bench/results/NAME.json [--smoke]
    torchrun --standalone --nproc-per-node=2 -m bench.run --cases baselines_2gpu --out ...

Writes NAME.json (rewritten after every case, so a run cut short keeps what it measured) and
NAME.log (the raw log of rank 0). Rows of cases whose rank count differs from the world size are
not run. The run never stops on a failing case: every (case, impl) is wrapped, its ranks agree on
ok / skipped / error through an all-reduce, and errors are recorded with their message.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from mok.testing import relative_error

from . import REPO_ROOT
from .cases import PASSES, Case, select_cases, with_passes
from .ceilings import measure_ceilings
from .cost import Cost, experts_cost, floor_of, layer_cost
from .impls import BenchContext, ImplSpec, Runner, Skip, impls_for, load_impls
from .presets import get_preset
from .problems import (
    EXPERTS_GRAD_NAMES,
    LAYER_GRAD_NAMES,
    Expected,
    build_experts_problem,
    build_layer_problem,
    experts_problem_bytes,
    experts_reference,
    layer_problem_bytes,
    layer_reference,
    layer_routing,
    routing_load,
)
from .runtime import (
    GPU_TIMING,
    SMOKE_TIMING,
    Runtime,
    TimingPolicy,
    init_runtime,
    measure,
)

log = logging.getLogger("bench")

SCHEMA_VERSION = 1
TOLERANCE = 2e-2  # relative L2 error of bf16 impls against the fp32 reference, per output and gradient
# fp8 cases (block-scaled or row-wise e4m3: 3 mantissa bits on x, the weights and h) against the same
# fp32 reference: about 7% on y (mok run --precision fp8 checks the same bound).
FP8_TOLERANCE = 0.12


def tolerance(case: Case) -> float:
    """The check's bound for a case's outputs against the fp32 reference."""
    return FP8_TOLERANCE if case.precision != "bf16" else TOLERANCE
MEMORY_FRACTION = 0.9  # a case or impl runs only if its estimate fits in this fraction of free memory

OK, SKIPPED, ERROR = 0, 1, 2
STATUS_NAMES = {OK: "ok", SKIPPED: "skipped", ERROR: "error"}
T = TypeVar("T")
ROUTED_WEIGHT_GRADS = ("d_w_gate", "d_w_up", "d_w_down")


# ---------------------------------------------------------------------------------------------
# Rank agreement
# ---------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    status: int
    value: Any
    message: str


def agreed_step(rt: Runtime, what: str, fn: Callable[[], T]) -> StepResult:
    """Run ``fn`` on every rank; all ranks then agree on the worst outcome and see every rank's message.

    A Skip anywhere skips everywhere, an exception anywhere is an error everywhere: no rank goes on
    alone into collectives that the others will not join.
    """
    status, value, message = OK, None, ""
    try:
        value = fn()
    except Skip as exc:
        status, message = SKIPPED, str(exc)
    except Exception as exc:
        status, message = ERROR, f"{type(exc).__name__}: {exc}"
        log.debug("rank %d: %s failed:\n%s", rt.rank, what, traceback.format_exc())
        if rt.rank != 0:
            print(f"[rank {rt.rank}] {what} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        _release_memory()
    worst = int(rt.all_max([status])[0])
    if worst != OK:
        messages = rt.all_gather_object(message)
        distinct = {m for m in messages if m}
        if len(distinct) == 1:
            message = distinct.pop()
        else:
            message = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m)
        value = None
    return StepResult(worst, value, message)


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Results document
# ---------------------------------------------------------------------------------------------


def _commit() -> str:
    # The device copy of the tree carries a stale .git (or none): tools/gpu.sh passes the real one.
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return os.environ.get("MOK_COMMIT", "unknown")


def _command(rt: Runtime) -> str:
    args = "python -m bench.run " + shlex.join(sys.argv[1:])
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ:
        return f"torchrun --standalone --nproc-per-node={rt.world_size} -m bench.run " + shlex.join(sys.argv[1:])
    return args


def _device_name(rt: Runtime) -> str:
    if rt.is_cuda:
        return torch.cuda.get_device_name(rt.device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def _finite_or_none(x: float | None) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------


@dataclass
class CaseSetup:
    problem: Any
    expected: Expected
    grad_names: tuple[str, ...]
    costs: dict[str, Cost]
    load_summary: dict[str, Any]


def _plan_case(case: Case, rt: Runtime) -> Any:
    """Routing (layer) and the memory check, before anything big is allocated. Raises Skip if it won't fit."""
    preset = get_preset(case.preset)
    free = rt.free_memory_bytes()
    if case.kind == "layer":
        topk_idx, topk_w = layer_routing(case, preset, rt.rank)
        load = routing_load(rt, topk_idx, preset)
        need = layer_problem_bytes(case, preset, load)
        plan: Any = (topk_idx, topk_w, load)
    else:
        need = experts_problem_bytes(case, preset)
        plan = None
    if free is not None and need > MEMORY_FRACTION * free:
        raise Skip(f"inputs + reference need ~{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    return plan


def _setup_case(case: Case, rt: Runtime, plan: Any) -> CaseSetup:
    """Inputs, reference and declared costs of a case."""
    preset = get_preset(case.preset)
    if case.kind == "layer":
        topk_idx, topk_w, load = plan
        problem = build_layer_problem(case, rt, topk_idx, topk_w, load)
        expected = layer_reference(problem, rt)
        costs = {p: layer_cost(preset, case.tokens_per_rank or 0, load, p) for p in PASSES}
        summary = {
            "rows_per_rank": [load.rows_received(r) for r in range(load.ranks)],
            "remote_rows_in": [load.remote_in(r) for r in range(load.ranks)],
            "max_rows_per_expert": load.max_rows_per_expert,
        }
        names = LAYER_GRAD_NAMES[: len(problem.grad_targets)]
        summary["weight_grads_checked_experts"] = len(expected.weight_grad_experts)
    else:
        problem = build_experts_problem(case, rt)
        expected = experts_reference(problem)
        costs = {p: experts_cost(preset, problem.counts, p) for p in PASSES}
        summary = {
            "rows_total": sum(problem.counts),
            "rows_max_expert": max(problem.counts),
            "rows_min_expert": min(problem.counts),
            "weight_grads_checked_experts": len(expected.weight_grad_experts),
        }
        names = EXPERTS_GRAD_NAMES
    return CaseSetup(problem, expected, names, costs, summary)


def _check(runner: Runner, setup: CaseSetup, with_backward: bool) -> dict[str, float]:
    """Relative L2 error of the output (and gradients) against the reference, per tensor."""
    state = runner.forward()
    errors = {"y": relative_error(runner.output(state), setup.expected.y)}
    if with_backward and runner.backward is not None:
        grads = runner.backward(state)
        kept = setup.expected.weight_grad_experts
        for name, grad in zip(setup.grad_names, grads):
            if name not in setup.expected.grads:
                continue
            if grad is not None and name in ROUTED_WEIGHT_GRADS and len(kept) != grad.shape[0]:
                grad = grad[kept]  # the reference kept a sample of experts
            errors[name] = math.nan if grad is None else relative_error(grad, setup.expected.grads[name])
        del grads
    del state
    return errors


def _timed_pass(rt: Runtime, runner: Runner, pass_name: str, policy: TimingPolicy) -> Any:
    if pass_name == "forward":
        return measure(rt, lambda _: runner.forward(), policy)
    if pass_name == "backward":
        return measure(rt, runner.backward, policy, prepare=runner.forward)
    return measure(rt, lambda _: runner.backward(runner.forward()), policy)


def _base_row(case: Case, spec: ImplSpec, pass_name: str) -> dict[str, Any]:
    row: dict[str, Any] = {
        "kind": case.kind,
        "preset": case.preset,
        "ranks": case.ranks,
        "tokens_per_rank": case.tokens_per_rank,
        "rows_per_expert": case.rows_per_expert,
        "local_experts": case.local_experts,
        "precision": case.precision,
        "pass": pass_name,
        "routing": case.routing,
        "impl": spec.name,
        "baseline": spec.is_baseline,
        "status": "ok",
        "correct": None,
        "median_ms": None,
        "tflops": None,
        "hbm_gbps": None,
        "nvlink_gbps": None,
        "floor_ms": None,
        "floor_bound": None,
        "time_over_floor": None,
    }
    return row


def _fill_timing(row: dict[str, Any], timing: Any, cost: Cost, ceilings: dict[str, Any]) -> None:
    seconds = timing.median_ms * 1e-3
    floor = floor_of(cost, ceilings)
    row.update(
        median_ms=timing.median_ms,
        min_ms=timing.min_ms,
        max_ms=timing.max_ms,
        rank_median_ms=timing.rank_median_ms,
        iterations=timing.iterations,
        warmup=timing.warmup,
        tflops=cost.flops / seconds / 1e12 if seconds > 0 else None,
        hbm_gbps=cost.hbm_bytes / seconds / 1e9 if seconds > 0 else None,
        nvlink_gbps=cost.nvlink_bytes / seconds / 1e9 if seconds > 0 and cost.nvlink_bytes else None,
        flops=cost.flops,
        hbm_bytes=cost.hbm_bytes,
        nvlink_bytes=cost.nvlink_bytes,
        floor_ms=floor.ms,
        floor_bound=floor.bound,
        time_over_floor=timing.median_ms / floor.ms if floor.ms else None,
    )


def _profile_pass(rt: Runtime, runner: Runner, pass_name: str, out_dir: Path, label: str, iters: int = 5) -> None:
    """Where a pass's device time goes: `iters` more runs of it (a backward's forward included)
    under the torch profiler, one table of kernels by device time per rank (development aid, not
    a result: the profiler serializes nothing but adds its own launches' cost)."""
    from torch.profiler import ProfilerActivity, profile

    def once() -> None:
        if pass_name == "forward":
            runner.forward()
        else:
            runner.backward(runner.forward())

    once()
    rt.barrier()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.is_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            once()
        rt.barrier()
    out_dir.mkdir(parents=True, exist_ok=True)
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in label)
    table = prof.key_averages().table(sort_by="self_device_time_total" if rt.is_cuda else "self_cpu_time_total", row_limit=30, max_name_column_width=90)
    (out_dir / f"profile_{safe}_rank{rt.rank}.txt").write_text(
        f"{label}: {iters} runs of the {pass_name} pass (times are totals over the runs)\n{table}\n")


def run_case(case: Case, rt: Runtime, ctx: BenchContext, ceilings: dict[str, Any], impl_names: list[str] | None,
             policy: TimingPolicy, progress: Any, profile_dir: Path | None = None) -> list[dict[str, Any]]:
    specs = impls_for(case.kind, impl_names)
    rows: list[dict[str, Any]] = []
    case_start = time.perf_counter()

    # Phases are separate agreed steps: a rank that skips must not leave the others alone inside
    # the next phase's collectives.
    setup_step = agreed_step(rt, f"plan of {case.label}", lambda: _plan_case(case, rt))
    if setup_step.status == OK:
        plan = setup_step.value
        setup_step = agreed_step(rt, f"setup of {case.label}", lambda: _setup_case(case, rt, plan))
        del plan
    if setup_step.status != OK:
        for spec in specs:
            for pass_name in case.passes:
                row = _base_row(case, spec, pass_name)
                row["status"] = STATUS_NAMES[setup_step.status]
                row["correct"] = False if setup_step.status == ERROR else None
                row["skip_reason" if setup_step.status == SKIPPED else "error"] = setup_step.message
                rows.append(row)
                progress.update(1)
        log.info("%s: %s (%s)", case.label, STATUS_NAMES[setup_step.status], setup_step.message)
        return rows
    setup: CaseSetup = setup_step.value
    setup_s = time.perf_counter() - case_start
    wants_backward = any(p in ("backward", "both") for p in case.passes)

    for spec in specs:
        impl_start = time.perf_counter()

        def check_memory(spec: ImplSpec = spec) -> None:
            if spec.memory_bytes is not None and rt.is_cuda:
                need = spec.memory_bytes(setup.problem, ctx)
                free = rt.free_memory_bytes() or 0
                if need > MEMORY_FRACTION * free:
                    raise Skip(f"needs ~{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")

        build_step = agreed_step(rt, f"{spec.name} memory check on {case.label}", check_memory)
        if build_step.status == OK:
            build_step = agreed_step(rt, f"{spec.name} build on {case.label}", lambda spec=spec: spec.build(setup.problem, ctx))
        runner: Runner | None = build_step.value
        check_step = StepResult(build_step.status, None, build_step.message)
        correct: bool | None = None
        errors: dict[str, float] = {}
        if build_step.status == OK and runner is not None:
            check_step = agreed_step(
                rt, f"{spec.name} check on {case.label}", lambda runner=runner: _check(runner, setup, wants_backward)
            )
            if check_step.status == OK:
                errors = check_step.value
                names = sorted(errors)
                worst = rt.all_max([e if math.isfinite(e) else math.inf for e in (errors[n] for n in names)])
                errors = dict(zip(names, worst))
                correct = all(math.isfinite(e) and e <= tolerance(case) for e in errors.values())

        for pass_name in case.passes:
            row = _base_row(case, spec, pass_name)
            row["load"] = setup.load_summary
            if check_step.status != OK:
                row["status"] = STATUS_NAMES[check_step.status]
                row["correct"] = False if check_step.status == ERROR else None
                row["skip_reason" if check_step.status == SKIPPED else "error"] = check_step.message
                rows.append(row)
                progress.update(1)
                continue
            if pass_name != "forward" and runner is not None and runner.backward is None:
                row["status"] = "skipped"
                row["skip_reason"] = runner.no_backward_reason or "no backward"
                rows.append(row)
                progress.update(1)
                _log_row(case, row)
                continue
            row["correct"] = correct
            row["check_errors"] = {k: _finite_or_none(v) for k, v in errors.items()}
            row["tolerance"] = tolerance(case)
            assert runner is not None
            pass_start = time.perf_counter()
            timed = agreed_step(
                rt, f"{spec.name} {pass_name} on {case.label}",
                lambda runner=runner, pass_name=pass_name: _timed_pass(rt, runner, pass_name, policy),
            )
            if timed.status == OK:
                _fill_timing(row, timed.value, setup.costs[pass_name], ceilings)
            else:
                row["status"] = STATUS_NAMES[timed.status]
                row["skip_reason" if timed.status == SKIPPED else "error"] = timed.message
            row["elapsed_s"] = time.perf_counter() - pass_start
            if timed.status == OK and profile_dir is not None:
                profiled = agreed_step(rt, f"{spec.name} {pass_name} profile on {case.label}",
                                       lambda runner=runner, pass_name=pass_name: _profile_pass(
                                           rt, runner, pass_name, profile_dir, f"{case.label}_{spec.name}_{pass_name}"))
                if profiled.status != OK:
                    log.warning("%s %s on %s: no profile (%s)", spec.name, pass_name, case.label, profiled.message)
            rows.append(row)
            progress.update(1)
            _log_row(case, row)
        # Every reference to the runner dropped before the cache is emptied (build_step holds it
        # too): else its buffers stay allocated through the next impl's memory check, which then
        # skips impls that would fit (likely why session 14 call 8 skipped mok_graph on deepseek-v4 after mok).
        del runner, build_step, check_step
        _release_memory()
        log.debug("%s %s: %.1f s", case.label, spec.name, time.perf_counter() - impl_start)

    log.info("%s: done in %.1f s (setup + reference %.1f s)", case.label, time.perf_counter() - case_start, setup_s)
    return rows


def _log_row(case: Case, row: dict[str, Any]) -> None:
    if row["status"] != "ok":
        log.info("%s | %-16s %-8s %s: %s", case.label, row["impl"], row["pass"], row["status"],
                 row.get("error") or row.get("skip_reason"))
        return
    def fmt(v: Any, spec: str) -> str:
        return format(v, spec) if isinstance(v, (int, float)) else "-"
    log.info(
        "%s | %-16s %-8s %s ms  %s TFLOP/s  %s GB/s HBM  %s GB/s NVLink  floor %s ms (%s)  x%s  correct=%s  [%.1f s]",
        case.label, row["impl"], row["pass"], fmt(row["median_ms"], ".3f"), fmt(row["tflops"], ".1f"),
        fmt(row["hbm_gbps"], ".0f"), fmt(row["nvlink_gbps"], ".0f"), fmt(row["floor_ms"], ".3f"),
        row["floor_bound"], fmt(row["time_over_floor"], ".2f"), row["correct"], row.get("elapsed_s", 0.0),
    )


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def _choose_symm_backend(requested: str, rt: Runtime, wants_nvshmem: bool) -> dict[str, Any]:
    """Pick the symmetric-memory backend before anything allocates symmetric memory (it cannot change later)."""
    info: dict[str, Any] = {"requested": requested, "backend": None, "error": None}
    if not rt.is_cuda:
        return info
    import torch.distributed._symmetric_memory as symm_mem

    choice = requested
    if requested == "auto":
        choice = "NVSHMEM" if wants_nvshmem and symm_mem.is_nvshmem_available() else "CUDA"
    try:
        symm_mem.set_backend(choice)
        info["backend"] = choice
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
        info["backend"] = symm_mem.get_backend(rt.device)
    return info


def _setup_logging(rt: Runtime, log_path: Path | None, verbose: bool) -> None:
    from tqdm import tqdm

    class TqdmHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            tqdm.write(self.format(record), file=sys.stderr)

    log.setLevel(logging.DEBUG)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    if rt.is_main:
        console = TqdmHandler()
        console.setLevel(logging.DEBUG if verbose else logging.INFO)
        console.setFormatter(fmt)
        log.addHandler(console)
        if log_path is not None:
            file_handler = logging.FileHandler(log_path, mode="w")
            file_handler.setLevel(logging.DEBUG)
            file_handler.setFormatter(fmt)
            log.addHandler(file_handler)
    else:
        log.addHandler(logging.NullHandler())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cases", required=True, help="TABLE[:FILTER], e.g. baselines_2gpu:preset=kimi-k2,tokens=2048")
    ap.add_argument("--out", type=Path, help="results JSON path (default bench/results/<table>.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing test: gloo, CPU timers, quick CPU ceilings")
    ap.add_argument("--impls", default="", help="comma-separated impl names to run (default: all registered)")
    ap.add_argument("--passes", default="", help="comma-separated passes overriding the table's (forward,backward,both)")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="stop starting new cases after this many seconds (0 = no limit); later cases are recorded as skipped")
    ap.add_argument("--iter-budget-s", type=float, default=None, help="timed seconds per (case, impl, pass) (default 1.0 GPU)")
    ap.add_argument("--symm-backend", choices=("auto", "CUDA", "NVSHMEM"), default="auto",
                    help="symmetric-memory backend: auto = NVSHMEM when symm_a2a will run and NVSHMEM is available")
    ap.add_argument("--symm-workspace-gb", type=float, default=20.0,
                    help="most memory the symm_a2a send/recv buffers may take (allocated once, kept for the run)")
    ap.add_argument("--collective-timeout-s", type=float, default=240.0,
                    help="a collective that waits longer aborts the run (results so far are already written)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="also write each timed pass's kernels by device time (torch profiler) under this folder")
    ap.add_argument("--list", action="store_true", help="print the selected cases and impls, run nothing")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    registry = load_impls()
    impl_names = [n for n in args.impls.split(",") if n] or None
    passes = tuple(p for p in args.passes.split(",") if p) or None
    cases = with_passes(select_cases(args.cases), passes)

    if args.list:
        for case in cases:
            print(f"{case.label}  passes={','.join(case.passes)}")
        for spec in registry.values():
            print(f"impl {spec.kind}:{spec.name}  {spec.description}")
        return 0

    table = args.cases.partition(":")[0]
    out: Path = args.out or REPO_ROOT / "bench" / "results" / f"{table}.json"
    started = time.time()
    rt = init_runtime(args.smoke, args.collective_timeout_s)
    if rt.is_main:
        out.parent.mkdir(parents=True, exist_ok=True)
    _setup_logging(rt, out.with_suffix(".log") if rt.is_main else None, args.verbose)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32

    runnable = [c for c in cases if c.ranks == rt.world_size]
    for ranks in sorted({c.ranks for c in cases} - {rt.world_size}):
        n = sum(1 for c in cases if c.ranks == ranks)
        log.info("not run here: %d case(s) need %d rank(s) (this run has %d)", n, ranks, rt.world_size)
    wants_symm = any(c.kind == "layer" for c in runnable) and (impl_names is None or "symm_a2a" in impl_names)
    symm_info = _choose_symm_backend(args.symm_backend, rt, wants_symm)

    policy = SMOKE_TIMING if args.smoke else GPU_TIMING
    if args.iter_budget_s is not None:
        policy = TimingPolicy(policy.warmup, policy.min_iters, policy.max_iters, args.iter_budget_s)

    log.info("device %s x%d, torch %s, cuda %s, symmetric memory %s", _device_name(rt), rt.world_size,
             torch.__version__, torch.version.cuda, symm_info)
    log.info("measuring ceilings ...")
    ceilings = measure_ceilings(rt, args.smoke)
    log.info("ceilings: %s", {k: v for k, v in ceilings.items() if k != "errors"})
    if ceilings.get("errors"):
        log.info("ceiling errors: %s", {k: v for k, v in ceilings["errors"].items() if not k.endswith("_traceback")})

    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "device": _device_name(rt),
        "num_gpus": rt.world_size if rt.is_cuda else 0,
        "world_size": rt.world_size,
        "commit": _commit(),
        "command": _command(rt),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if rt.is_cuda else None,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "smoke": args.smoke,
        "case_table": args.cases,
        "symmetric_memory": symm_info,
        "timing": vars(policy),
        "tolerance": TOLERANCE,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "ceilings": ceilings,
        "impls": {key: spec.description for key, spec in registry.items()},
        "cases": [],
    }
    if rt.is_main:
        _write_json(out, doc)

    from tqdm import tqdm

    total = sum(len(impls_for(c.kind, impl_names)) * len(c.passes) for c in runnable)
    progress = tqdm(total=total, desc="bench", unit="row", file=sys.stderr, disable=not rt.is_main, dynamic_ncols=True)
    ctx = BenchContext(runtime=rt, options=args, cases=runnable)
    for case in runnable:
        over_budget = args.time_budget_s > 0 and time.time() - started > args.time_budget_s
        if rt.all_max([1.0 if over_budget else 0.0])[0] > 0:
            for spec in impls_for(case.kind, impl_names):
                for pass_name in case.passes:
                    row = _base_row(case, spec, pass_name)
                    row.update(status="skipped", skip_reason=f"time budget of {args.time_budget_s:.0f} s used up")
                    doc["cases"].append(row)
                    progress.update(1)
            continue
        progress.set_postfix_str(case.label)
        doc["cases"].extend(run_case(case, rt, ctx, ceilings, impl_names, policy, progress, args.profile))
        _release_memory()  # the case's tensors died with run_case's frame
        if rt.is_main:
            doc["elapsed_s"] = time.time() - started
            _write_json(out, doc)
    progress.close()

    doc["elapsed_s"] = time.time() - started
    doc["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    counts = {s: sum(1 for r in doc["cases"] if r["status"] == s) for s in ("ok", "skipped", "error")}
    incorrect = sum(1 for r in doc["cases"] if r["status"] == "ok" and r["correct"] is False)
    doc["summary"] = {**counts, "incorrect": incorrect}
    if rt.is_main:
        _write_json(out, doc)
        log.info("wrote %s (%s, %d incorrect) in %.0f s", out, counts, incorrect, doc["elapsed_s"])
    rt.barrier()
    if rt.is_cuda and rt.world_size > 1:
        # Symmetric-memory buffers (the symm_a2a workspace, the NVLink ceiling's) are kept to the end:
        # under NVSHMEM, freeing them or destroying the group at exit hung a finished run for minutes
        # (its JSON already written). Everything is on disk and every rank is past the barrier.
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)
    ctx.resources.clear()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
