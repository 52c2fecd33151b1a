"""The speedup table: MoK's time against each baseline measured in the same run, per case, from
the result JSONs of ``bench.run`` (the issue's targets are ratios to baseline (a) ``torch_a2a``
and to the best baseline measured).

    python -m bench.speedups results.json [more.json ...] [--impl mok] [--baseline torch_a2a] --out speedups.md

One row per (pass, tokens per rank, routing, preset, R) where the impl was measured correct: its
median ms (slowest rank) and TFLOP/s, each baseline's median ms, the ratio baseline / impl for
``--baseline`` and for the best correct baseline of that case ("vs best"). A baseline that failed
or was wrong is shown as "-" and not counted as best; a case where the impl failed is left out. A
case measured in several files takes its row from the last file given."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def table(paths: list[Path], impl: str = "mok", baseline: str = "torch_a2a") -> str:
    groups: dict[tuple, dict[str, dict]] = {}
    order: list[str] = []
    for path in paths:
        for c in json.loads(path.read_text()).get("cases", []):
            if c.get("kind") != "layer":
                continue
            key = (c["pass"], c["tokens_per_rank"], c["routing"], c["preset"], c["ranks"])
            groups.setdefault(key, {})[c["impl"]] = c
            if c["impl"] != impl and c["impl"] not in order:
                order.append(c["impl"])

    def ok(c: dict | None) -> bool:
        return c is not None and c.get("status") == "ok" and bool(c.get("correct"))

    head = ["pass", "T/rank", "routing", "preset", "R", f"{impl} ms", f"{impl} TF/s"] + [f"{b} ms" for b in order]
    head += [f"vs {baseline}", "vs best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 4 + "---:|" * (len(head) - 4)]
    for key, impls in groups.items():
        mine = impls.get(impl)
        if not ok(mine):
            continue
        ms = mine["median_ms"]
        cells = [str(k) for k in key] + [f"{ms:.2f}", f"{mine['tflops']:.0f}"]
        cells += [f"{impls[b]['median_ms']:.2f}" if ok(impls.get(b)) else "-" for b in order]
        base = impls.get(baseline)
        cells.append(f"{base['median_ms'] / ms:.2f}x" if ok(base) else "-")
        best = [impls[b]["median_ms"] for b in order if ok(impls.get(b))]
        cells.append(f"{min(best) / ms:.2f}x" if best else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--impl", default="mok")
    ap.add_argument("--baseline", default="torch_a2a")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    text = table(args.results, args.impl, args.baseline)
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
