"""The scaling table: time per token as the expert-parallel size R grows at a fixed number of tokens
per rank, from the result JSONs of runs at different R (``bench.run``, one file per R or several).

    python -m bench.scaling results_1gpu.json results_2gpu.json results_4gpu.json --out scaling.md

For every (preset, tokens per rank, routing, pass, impl) measured at more than one R it prints the
median time of the slowest rank, the time per token of the whole group (median / (R * T)) and the
weak-scaling efficiency against the smallest R measured (its time over this one's: 1.0 when R
ranks take as long for R times the tokens)."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def rows(paths: list[Path]) -> list[dict[str, object]]:
    """Every measured layer case of the files (status ok and correct)."""
    out: list[dict[str, object]] = []
    for path in paths:
        data = json.loads(path.read_text())
        for case in data.get("cases", []):
            if case.get("kind") == "layer" and case.get("status") == "ok" and case.get("correct"):
                out.append({**case, "source": path.name})
    return out


def table(cases: list[dict[str, object]]) -> str:
    groups: dict[tuple[object, ...], dict[int, dict[str, object]]] = defaultdict(dict)
    for c in cases:
        key = (c["preset"], c["tokens_per_rank"], c["routing"], c["pass"], c["impl"], c["precision"])
        groups[key][int(c["ranks"])] = c  # type: ignore[arg-type]
    lines = ["| preset | tokens per rank | routing | pass | impl | R | median ms | ns per token | "
             "efficiency vs smallest R |",
             "|---|---:|---|---|---|---:|---:|---:|---:|"]
    for key in sorted(groups, key=lambda k: tuple(str(v) for v in k)):
        by_r = groups[key]
        if len(by_r) < 2:
            continue
        preset, tokens, routing, pass_, impl, _ = key
        base_r = min(by_r)
        base_ms = float(by_r[base_r]["median_ms"])  # type: ignore[arg-type]
        for r in sorted(by_r):
            ms = float(by_r[r]["median_ms"])  # type: ignore[arg-type]
            ns_per_token = ms * 1e6 / (r * int(tokens))  # type: ignore[call-overload]
            lines.append(f"| {preset} | {tokens} | {routing} | {pass_} | {impl} | {r} | {ms:.3f} | "
                         f"{ns_per_token:.1f} | {base_ms / ms:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="bench.run result JSONs")
    ap.add_argument("--out", type=Path, help="write the markdown table here (default: print it)")
    args = ap.parse_args()
    text = table(rows(args.results))
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
