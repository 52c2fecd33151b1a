"""bench/train.py, the end-to-end training-step benchmark, on the CPU: both layers train the same
model from the same parameters, the first losses agree, and a layer that computes something else
is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import train


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
    monkeypatch.setattr(train, "torch_moe", lambda moe, x: 3.0 * real(moe, x))
    with pytest.raises(RuntimeError, match="first-step losses differ"):
        train.main(["--smoke", "--device", "cpu"])
