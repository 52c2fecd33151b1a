"""examples/train_tiny_lm.py still runs end to end (a few steps; the full run makes examples/loss.png)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_tiny_lm_smoke(tmp_path: Path) -> None:
    out = tmp_path / "loss.png"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train_tiny_lm.py"), "--steps", "4",
                             "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "identical losses at every step" in result.stdout
    assert out.stat().st_size > 10_000
