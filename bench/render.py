"""Turn a results JSON into a markdown table and PNG plots.

    python -m bench.render bench/results/NAME.json [--out-dir DIR]

Writes NAME.md and NAME_throughput_<group>.png / NAME_vs_best_<group>.png next to the JSON (or in
--out-dir), one plot per (kind, pass, ranks, routing) with one panel per preset:
- throughput: TFLOP/s against tokens per rank (layer) or rows per expert (experts), one line per impl;
- vs best: the best correct baseline's time over each impl's time (> 1 = faster than every baseline).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

GROUP_FIELDS = ("kind", "preset", "ranks", "tokens_per_rank", "rows_per_expert", "local_experts", "precision", "pass", "routing")
PLOT_FIELDS = ("kind", "pass", "ranks", "routing")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _key(row: dict[str, Any], fields: Iterable[str]) -> tuple[Any, ...]:
    return tuple(row.get(f) for f in fields)


def best_baseline_ms(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], float]:
    """Per problem and pass: the fastest baseline that ran and was correct."""
    best: dict[tuple[Any, ...], float] = {}
    for r in rows:
        if r.get("baseline") and r.get("status") == "ok" and r.get("correct") and r.get("median_ms"):
            k = _key(r, GROUP_FIELDS)
            best[k] = min(best.get(k, math.inf), r["median_ms"])
    return best


def vs_best(row: dict[str, Any], best: dict[tuple[Any, ...], float]) -> float | None:
    b = best.get(_key(row, GROUP_FIELDS))
    if b is None or not row.get("median_ms") or row.get("status") != "ok":
        return None
    return b / row["median_ms"]


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) and math.isfinite(v) else "–"


def _routing(r: dict[str, Any]) -> str:
    """The routing cell, with the precision when it is not bf16 (e.g. "zipf fp8")."""
    precision = r.get("precision", "bf16")
    return f"{r.get('routing')}" + ("" if precision == "bf16" else f" {precision}")


def _size(row: dict[str, Any]) -> str:
    if row.get("kind") == "experts":
        return f"{row.get('local_experts')}×{row.get('rows_per_expert')}"
    return str(row.get("tokens_per_rank"))


def _min_ms(row: dict[str, Any]) -> str:
    """The fastest iteration, with `!` when the median is more than 10% above it."""
    low, median = row.get("min_ms"), row.get("median_ms")
    if not low or not median:
        return "–"
    return f"{low:.3f}" + (" !" if median > 1.1 * low else "")


def markdown(doc: dict[str, Any]) -> str:
    rows = doc.get("cases", [])
    best = best_baseline_ms(rows)
    c = doc.get("ceilings", {})
    lines = [
        f"# MoK benchmark: {doc.get('case_table', '')}",
        "",
        f"- device: {doc.get('device')} × {doc.get('world_size')} (GPUs: {doc.get('num_gpus')})",
        f"- commit: `{doc.get('commit')}`; torch {doc.get('torch')}, CUDA {doc.get('cuda')}, NCCL {doc.get('nccl')}",
        f"- command: `{doc.get('command')}`",
        f"- ceilings (measured on {c.get('measured_on')}): bf16 {_fmt(c.get('bf16_tflops'), '.1f')} TFLOP/s, "
        f"HBM {_fmt(c.get('hbm_gbps'), '.0f')} GB/s, NVLink read {_fmt(c.get('nvlink_read_gbps'), '.0f')} / "
        f"write {_fmt(c.get('nvlink_write_gbps'), '.0f')} GB/s per direction",
        f"- timing: median over iterations of the slowest rank; {doc.get('timing')}",
        f"- correctness: relative L2 error vs the fp32 reference ≤ {doc.get('tolerance')} for y and every gradient "
        "(fp8 rows, marked in the routing column: each row's own bound, 0.12)",
        f"- summary: {doc.get('summary')}; elapsed {_fmt(doc.get('elapsed_s'), '.0f')} s",
        "",
        "`×floor` = time / max(FLOPs / bf16 rate, HBM bytes / HBM rate, NVLink bytes / NVLink rate) "
        "(busiest rank); `vs best` = best correct baseline time / this time; `min ms` = the fastest iteration "
        "of the slowest rank (marked `!` when the median is over 10% above it: an unsteady timing).",
    ]
    by_section: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_section[(r.get("kind", "layer"), r.get("pass", ""))].append(r)
    for (kind, pass_name), section in by_section.items():
        size_header = "T/rank" if kind == "layer" else "El×rows"
        lines += [
            "",
            f"## {kind} — {pass_name}",
            "",
            f"| preset | R | {size_header} | routing | impl | ms | TFLOP/s | HBM GB/s | NVLink GB/s "
            "| floor ms | ×floor | vs best | correct | min ms |",
            "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        not_run: dict[tuple[str, str, str], list[str]] = defaultdict(list)
        for r in section:
            if r.get("status") != "ok":
                reason = (r.get("error") or r.get("skip_reason") or "").replace("\n", " ")
                not_run[(r.get("impl", ""), r.get("status", ""), reason)].append(
                    f"{r.get('preset')} R={r.get('ranks')} {_size(r)} {_routing(r)}"
                )
                continue
            floor = f"{_fmt(r.get('floor_ms'), '.3f')} ({r.get('floor_bound') or '–'})"
            correct = {True: "yes", False: "**NO**", None: "–"}[r.get("correct")]
            cells = [
                _fmt(r.get("median_ms"), ".3f"), _fmt(r.get("tflops"), ".4g"), _fmt(r.get("hbm_gbps"), ".4g"),
                _fmt(r.get("nvlink_gbps"), ".4g"), floor, _fmt(r.get("time_over_floor"), ".2f"),
                _fmt(vs_best(r, best), ".2f"), correct, _min_ms(r),
            ]
            head = f"| {r.get('preset')} | {r.get('ranks')} | {_size(r)} | {_routing(r)} | {r.get('impl')} | "
            lines.append(head + " | ".join(cells) + " |")
        if not_run:
            lines += ["", "Not run:"]
            for (impl, status, reason), which in not_run.items():
                shown = ", ".join(which[:4]) + (f", … ({len(which)} cases)" if len(which) > 4 else "")
                lines.append(f"- {impl} {status}: {reason} — {shown}")
    return "\n".join(lines) + "\n"


def _slug(parts: Iterable[Any]) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "_".join(str(p) for p in parts))


def plots(doc: dict[str, Any], stem: Path) -> list[Path]:
    """Throughput and vs-best plots; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc.get("cases", []) if r.get("status") == "ok" and r.get("median_ms")]
    best = best_baseline_ms(doc.get("cases", []))
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[_key(r, PLOT_FIELDS)].append(r)
    written: list[Path] = []
    for gkey, grows in sorted(groups.items(), key=lambda kv: str(kv[0])):
        kind = gkey[0]
        x_field = "tokens_per_rank" if kind == "layer" else "rows_per_expert"
        presets = list(dict.fromkeys(r["preset"] for r in grows))
        for metric in ("throughput", "vs_best"):
            ncols = min(4, len(presets))
            nrows = math.ceil(len(presets) / ncols)
            fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.3 * nrows), squeeze=False)
            any_point = False
            for ax, preset in zip(axes.flat, presets):
                series: dict[str, list[tuple[float, float]]] = defaultdict(list)
                for r in grows:
                    if r["preset"] != preset:
                        continue
                    y = r.get("tflops") if metric == "throughput" else vs_best(r, best)
                    if y is None or r.get(x_field) is None:
                        continue
                    series[r["impl"]].append((r[x_field], y))
                for impl, pts in sorted(series.items()):
                    pts.sort()
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
                    any_point = True
                if metric == "vs_best":
                    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
                ax.set_xscale("log", base=2)
                ax.set_title(preset, fontsize=9)
                ax.set_xlabel("tokens per rank" if kind == "layer" else "rows per expert", fontsize=8)
                ax.set_ylabel("TFLOP/s" if metric == "throughput" else "best baseline time / time", fontsize=8)
                ax.tick_params(labelsize=7)
                if series:
                    ax.legend(fontsize=7)
            for ax in list(axes.flat)[len(presets):]:
                ax.axis("off")
            if not any_point:
                plt.close(fig)
                continue
            kind_, pass_name, ranks, routing = gkey
            fig.suptitle(f"{kind_} {pass_name}, R={ranks}, {routing} — {doc.get('device')}", fontsize=10)
            fig.tight_layout()
            path = stem.parent / f"{stem.name}_{metric}_{_slug(gkey)}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def render(path: Path, out_dir: Path | None = None) -> tuple[Path, list[Path]]:
    doc = load(path)
    stem = (out_dir or path.parent) / path.stem
    stem.parent.mkdir(parents=True, exist_ok=True)
    md_path = stem.with_suffix(".md")
    md_path.write_text(markdown(doc))
    return md_path, plots(doc, stem)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.render", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("results", type=Path, nargs="+", help="results JSON file(s)")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    for path in args.results:
        md_path, pngs = render(path, args.out_dir)
        print(f"{md_path}")
        for p in pngs:
            print(f"{p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
