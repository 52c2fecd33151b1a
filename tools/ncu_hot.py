"""Hot SASS lines of an `ncu --page source --csv --print-source sass` export: the lines holding
the most warp-stall samples, with their share, and the samples summed per opcode.
    python3 tools/ncu_hot.py ncu_source.csv [lines]
"""
import collections
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, newline="") as f:
        lines = [row for row in csv.reader(f)]
    start = next((i for i, row in enumerate(lines) if any("Warp Stall Sampling (All" in c for c in row)), None)
    if start is None:
        print("no 'Warp Stall Sampling' column; first lines:")
        for row in lines[:5]:
            print(row)
        return
    header = lines[start]
    rows = [r for r in lines[start + 1:] if len(r) == len(header)]
    col = next(i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c)
    src = next((i for i, c in enumerate(header) if c == "Source"), 1)
    addr = next((i for i, c in enumerate(header) if c == "Address"), 0)
    reasons = [i for i, c in enumerate(header) if c.lower().startswith("stall") or "stall_" in c.lower()]
    total = sum(number(r[col]) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples")
    per_op = collections.Counter()
    for r in rows:
        op = r[src].strip().split()
        op = [w for w in op if not w.startswith("@")]
        per_op[op[0] if op else "?"] += number(r[col])
    print("samples per opcode:")
    for op, n in per_op.most_common(15):
        print(f"  {100 * n / total:5.1f}%  {op}")
    print(f"hottest {top} lines:")
    for r in sorted(rows, key=lambda r: -number(r[col]))[:top]:
        why = ", ".join(f"{header[i]}={r[i]}" for i in reasons if number(r[i]) > 0.05 * number(r[col]))
        print(f"  {100 * number(r[col]) / total:5.1f}%  {r[addr]}  {r[src].strip()[:70]}  {why[:160]}")


if __name__ == "__main__":
    main()
