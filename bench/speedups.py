"""The speedup table: MoK's time against each baseline measured in the same run, per case, from
the result JSONs of ``bench.run`` (the issue's targets are ratios to baseline (a) ``torch_a2a``
and to the best baseline measured).

    python -m bench.speedups results.json [more.json ...] [--impl mok] [--baseline torch_a2a] --out speedups.md

One row per (pass, tokens per rank, routing, preset, R) where the impl was measured correct: its
median ms (slowest rank) and TFLOP/s, each baseline's median ms, the ratio baseline / impl for
``--baseline`` and for the best correct baseline of that case ("vs best"; MoK's own other rows,
such as ``mok_gemms``, are shown but never best). A baseline that failed
or was wrong is shown as "-" and not counted as best; a case where the impl failed is left out. A
case measured in several files takes its row from the last file given.

``--targets`` prints the issue's targets instead: forward 2.0x baseline (a) and 1.5x the best
baseline, backward 1.6x and 1.3x; per case whether both are met, and where not, the time that
would meet them and the share of the measured dense bf16 rate (the JSON's ceilings) that time
implies for the case's FLOPs, beside MoK's own share, the floor (the largest of the GEMM, HBM and
NVLink times at the measured rates, and which one), MoK's time and the needed time over the floor,
and MoK's time over its expert GEMMs alone (``mok_gemms``) where that impl ran. A target needing
less than the floor (needs over floor < 1x) cannot be met by any implementation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


# (times baseline (a), times the best baseline) per pass: the speed targets.
TARGETS = {"forward": (2.0, 1.5), "backward": (1.6, 1.3)}


def _groups(paths: list[Path]) -> tuple[dict[tuple, dict[str, dict]], list[str], set[str], float | None]:
    """Cases by (pass, T, routing, preset, R) and impl; impls in order of appearance; those that are
    not baselines (a case's "baseline": false, as MoK's own rows); the last measured dense rate."""
    groups: dict[tuple, dict[str, dict]] = {}
    order: list[str] = []
    not_baselines: set[str] = set()
    dense = None
    for path in paths:
        data = json.loads(path.read_text())
        dense = (data.get("ceilings") or {}).get("bf16_tflops") or dense
        for c in data.get("cases", []):
            if c.get("kind") != "layer":
                continue
            key = (c["pass"], c["tokens_per_rank"], c["routing"], c["preset"], c["ranks"])
            groups.setdefault(key, {})[c["impl"]] = c
            if c["impl"] not in order:
                order.append(c["impl"])
            if c.get("baseline") is False:
                not_baselines.add(c["impl"])
    return groups, order, not_baselines, dense


def _ok(c: dict | None) -> bool:
    return c is not None and c.get("status") == "ok" and bool(c.get("correct"))


def table(paths: list[Path], impl: str = "mok", baseline: str = "torch_a2a") -> str:
    groups, order, others, _ = _groups(paths)
    order = [b for b in order if b != impl]
    head = ["pass", "T/rank", "routing", "preset", "R", f"{impl} ms", f"{impl} TF/s"] + [f"{b} ms" for b in order]
    head += [f"vs {baseline}", "vs best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 4 + "---:|" * (len(head) - 4)]
    for key, impls in groups.items():
        mine = impls.get(impl)
        if not _ok(mine):
            continue
        ms = mine["median_ms"]
        cells = [str(k) for k in key] + [f"{ms:.2f}", f"{mine['tflops']:.0f}"]
        cells += [f"{impls[b]['median_ms']:.2f}" if _ok(impls.get(b)) else "-" for b in order]
        base = impls.get(baseline)
        cells.append(f"{base['median_ms'] / ms:.2f}x" if _ok(base) else "-")
        best = [impls[b]["median_ms"] for b in order if b not in others and _ok(impls.get(b))]
        cells.append(f"{min(best) / ms:.2f}x" if best else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def targets(paths: list[Path], impl: str = "mok", baseline: str = "torch_a2a",
            gemms_impl: str = "mok_gemms") -> str:
    """The targets table (module doc). The dense rate is the last JSON's measured one."""
    groups, order, others, dense = _groups(paths)
    baselines = [b for b in order if b not in others | {impl, gemms_impl}]
    head = ["pass", "T/rank", "routing", "preset", "R", f"{impl} ms", "% dense", f"vs {baseline}", "vs best",
            "met", "needs ms", "needs % dense", "floor ms", "over floor", "needs over floor", "over GEMMs alone"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 4 + "---:|" * (len(head) - 4)]
    for key, impls in groups.items():
        mine = impls.get(impl)
        if not _ok(mine) or key[0] not in TARGETS:
            continue
        ms = mine["median_ms"]
        want_a, want_best = TARGETS[key[0]]
        base = impls.get(baseline)
        best = min((impls[b]["median_ms"] for b in baselines if _ok(impls.get(b))), default=None)
        needs = [t / w for t, w in ((base["median_ms"] if _ok(base) else None, want_a), (best, want_best)) if t]
        need = min(needs) if needs else None
        flops = mine.get("flops")

        def share(t: float | None) -> str:
            return f"{flops / (t * 1e9) / dense:.0%}" if flops and dense and t else "-"

        gemms = impls.get(gemms_impl)
        cells = [str(k) for k in key] + [f"{ms:.2f}", share(ms)]
        cells.append(f"{base['median_ms'] / ms:.2f}x / {want_a:.1f}x" if _ok(base) else "-")
        cells.append(f"{best / ms:.2f}x / {want_best:.1f}x" if best else "-")
        cells.append("-" if need is None else "yes" if ms <= need else "no")
        cells += [f"{need:.2f}" if need else "-", share(need)]
        floor = mine.get("floor_ms")
        cells.append(f"{floor:.2f} ({mine.get('floor_bound', '?')})" if floor else "-")
        cells.append(f"{ms / floor:.2f}x" if floor else "-")
        cells.append(f"{need / floor:.2f}x" if floor and need else "-")
        cells.append(f"{ms / gemms['median_ms']:.2f}x" if _ok(gemms) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    note = f"\nDense bf16 rate measured in the run: {dense:.0f} TFLOP/s.\n" if dense else ""
    return "\n".join(lines) + "\n" + note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--impl", default="mok")
    ap.add_argument("--baseline", default="torch_a2a")
    ap.add_argument("--targets", action="store_true", help="the issue's targets per case (module doc)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    text = (targets if args.targets else table)(args.results, args.impl, args.baseline)
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
