"""MoK benchmark harness: one case-table-driven runner for our kernels and the baselines.

Run from the repository root::

    python -m bench.run --cases smoke --smoke --out bench/results/smoke.json
    torchrun --standalone --nproc-per-node=2 -m bench.run --cases baselines_2gpu --out bench/results/b2.json
    python -m bench.render bench/results/b2.json

See bench/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# `mok.testing` (the pure-torch reference) lives in python/; make it importable without installing.
_python_dir = str(REPO_ROOT / "python")
if _python_dir not in sys.path:
    sys.path.insert(0, _python_dir)
