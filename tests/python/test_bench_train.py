"""bench/train.py, the end-to-end training-step benchmark, on the CPU: both layers train the same
model from the same parameters, the first losses agree, and a layer that computes something else
is caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import train

REPO = Path(__file__).resolve().parents[2]


def test_smoke_rows_and_json(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    rows = train.main(["--smoke", "--device", "cpu", "--out", str(out)])
    assert [r.impl for r in rows] == ["mok", "torch"]
    mok_row, torch_row = rows
    assert torch_row.speedup_vs_torch == pytest.approx(1.0)
    assert mok_row.first_loss == pytest.approx(torch_row.first_loss, rel=2e-3)
    # Random tokens over a 256-symbol vocabulary: an untrained model's loss is near ln(256).
    assert abs(mok_row.first_loss - torch.log(torch.tensor(256.0)).item()) < 1.0
    assert all(r.step_ms > 0 and r.tokens == 64 for r in rows)
    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "cpu" and len(data["rows"]) == 2
    assert {r["impl"] for r in data["rows"]} == {"mok", "torch"}


def test_profile_prints_each_copys_top_entries(capsys: pytest.CaptureFixture[str]) -> None:
    """--profile N: one more step of each copy under torch.profiler, its N top entries printed (MoK's
    forward and backward among the smoke model's on the CPU); the timed rows are unchanged in form."""
    rows = train.main(["--smoke", "--device", "cpu", "--profile", "4"])
    printed = capsys.readouterr().out
    assert "### tiny, mok (bf16): one step's top 4 entries by self time" in printed
    assert "### tiny, torch (bf16): one step's top 4 entries by self time" in printed
    mok_table = printed.split("### tiny, mok")[1].split("### tiny, torch")[0]
    assert "mok::" in mok_table  # the layer's own ops are what the smoke step spends most in
    assert [r.impl for r in rows] == ["mok", "torch"]


def test_the_models_share_their_parameters_and_the_layers_their_math() -> None:
    """One block's MoE through both layers on the same input gives the same output (bf16 rounding)."""
    torch.manual_seed(3)
    p = train.get_preset("tiny")
    block = train.Block(p, p.E, torch.device("cpu"), torch.bfloat16, None)
    x = torch.randn(40, p.H, dtype=torch.bfloat16)
    y_mok = block.moe(x).float()
    y_torch = train.torch_moe(block.moe, x).float()
    assert torch.linalg.norm(y_mok - y_torch) <= 2e-2 * torch.linalg.norm(y_torch)


def test_a_wrong_layer_fails_the_loss_check(monkeypatch: pytest.MonkeyPatch) -> None:
    real = train.torch_moe
    monkeypatch.setattr(train, "torch_moe", lambda moe, x, group=None: 3.0 * real(moe, x, group))
    with pytest.raises(RuntimeError, match="first-step losses differ"):
        train.main(["--smoke", "--device", "cpu"])


def test_two_ranks_over_gloo(tmp_path: Path) -> None:
    """Under torchrun the ranks are one expert-parallel group: MoK's layer over it, the baseline's
    all_to_all_single over gloo; rank 0 writes the rows, with the group's tokens per second."""
    out = tmp_path / "train2.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "bench.train", "--smoke", "--device", "cpu", "--out", str(out)],
                   cwd=REPO, env=env, check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["ranks"]) for r in rows] == [("mok", 2), ("torch", 2)]
    assert rows[0]["first_loss"] == pytest.approx(rows[1]["first_loss"], rel=2e-3)
    assert rows[0]["tokens_per_s"] == pytest.approx(2 * rows[0]["tokens"] / (rows[0]["step_ms"] / 1e3), rel=1e-6)


def test_compiled_blocks_train_alike() -> None:
    """--compile both: eager and compiled copies (every block under torch.compile, MoK's layer traced
    as ops) train in turn in one process; every first-step loss agrees (main raises otherwise), the
    rows say which copy, and each compiled row's speedup is against the compiled torch copy."""
    rows = train.main(["--smoke", "--device", "cpu", "--compile", "both"])
    assert [(r.impl, r.compiled) for r in rows] == [("mok", False), ("torch", False), ("mok", True), ("torch", True)]
    assert all(r.first_loss == pytest.approx(rows[1].first_loss, rel=2e-3) for r in rows)
    assert rows[2].speedup_vs_torch == pytest.approx(rows[3].step_ms / rows[2].step_ms, rel=1e-9)
    assert rows[0].speedup_vs_torch == pytest.approx(rows[1].step_ms / rows[0].step_ms, rel=1e-9)
