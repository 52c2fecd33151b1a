"""The scaling table: time per token as the expert-parallel size R grows at a fixed number of tokens
per rank, from the result JSONs of runs at different R (``bench.run``, one file per R or several).

    python -m bench.scaling results_1gpu.json results_2gpu.json results_4gpu.json --out scaling.md

For every (preset, tokens per rank, routing, pass, impl) measured at more than one R it prints the
median time of the slowest rank, the time per token of the whole group (median / (R * T)), the
weak-scaling efficiency against the smallest R measured (its time over this one's: 1.0 when R
ranks take as long for R times the tokens) and the speedup over a baseline impl measured at the
same R (``--baseline``, default torch_a2a; blank where it was not measured).

Rows per expert (T * R * k / E on balanced routing) grow with R at a fixed T: each GPU holds E / R
experts and receives T * k rows. Larger groups run the grouped GEMMs closer to the dense rate, so
an efficiency above 1.0 means bigger GEMMs, not faster communication."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from .presets import PRESETS


def rows(paths: list[Path]) -> list[dict[str, object]]:
    """Every measured layer case of the files (status ok and correct)."""
    out: list[dict[str, object]] = []
    for path in paths:
        data = json.loads(path.read_text())
        for case in data.get("cases", []):
            if case.get("kind") == "layer" and case.get("status") == "ok" and case.get("correct"):
                out.append({**case, "source": path.name})
    return out


def rows_per_expert(preset: str, tokens: int, ranks: int) -> str:
    """T * R * k / E: the rows each local expert gets on balanced routing ('' for an unknown preset)."""
    p = PRESETS.get(preset)
    return f"{tokens * ranks * p.topk / p.E:.0f}" if p else ""


def table(cases: list[dict[str, object]], baseline: str = "torch_a2a") -> str:
    groups: dict[tuple[object, ...], dict[int, dict[str, object]]] = defaultdict(dict)
    for c in cases:
        key = (c["preset"], c["tokens_per_rank"], c["routing"], c["pass"], c["impl"], c["precision"])
        groups[key][int(c["ranks"])] = c  # type: ignore[arg-type]
    lines = ["| preset | tokens per rank | routing | pass | impl | R | rows per expert | median ms | ns per token | "
             f"efficiency vs smallest R | x vs {baseline} |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for key in sorted(groups, key=lambda k: tuple(str(v) for v in k)):
        by_r = groups[key]
        if len(by_r) < 2:
            continue
        preset, tokens, routing, pass_, impl, precision = key
        base_r = min(by_r)
        base_ms = float(by_r[base_r]["median_ms"])  # type: ignore[arg-type]
        against = groups.get((preset, tokens, routing, pass_, baseline, precision), {})
        for r in sorted(by_r):
            ms = float(by_r[r]["median_ms"])  # type: ignore[arg-type]
            ns_per_token = ms * 1e6 / (r * int(tokens))  # type: ignore[call-overload]
            speedup = f"{float(against[r]['median_ms']) / ms:.2f}" if r in against else ""  # type: ignore[arg-type]
            per_expert = rows_per_expert(str(preset), int(tokens), r) if routing == "balanced" else ""  # type: ignore[call-overload]
            lines.append(f"| {preset} | {tokens} | {routing} | {pass_} | {impl} | {r} | {per_expert} | {ms:.3f} | "
                         f"{ns_per_token:.1f} | {base_ms / ms:.2f} | {speedup} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="bench.run result JSONs")
    ap.add_argument("--out", type=Path, help="write the markdown table here (default: print it)")
    ap.add_argument("--baseline", default="torch_a2a", help="impl whose time at the same R each row is compared with")
    args = ap.parse_args()
    text = table(rows(args.results), args.baseline)
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
