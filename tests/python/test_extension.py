"""mok._C, the binding of the C++ core: descriptor, planner, schedule, stage functions, and its array checks."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from mok import _C  # noqa: E402


def desc(**overrides: object) -> _C.MoeDesc:
    fields = dict(tokens_per_rank=6, hidden=16, intermediate=8, num_experts=4, topk=2, ranks=2)
    fields.update(overrides)
    return _C.MoeDesc(**fields)


def test_desc_fields_and_printing() -> None:
    d = desc(shared_intermediate=4, swiglu_limit=7.0)
    d.validate()
    assert (d.tokens_per_rank, d.hidden, d.intermediate, d.num_experts, d.topk, d.ranks) == (6, 16, 8, 4, 2, 2)
    assert d.local_experts == 2 and d.precision == "bf16"
    assert str(d) == "T=6 H=16 I=8 E=4 k=2 R=2 shared=4 limit=7 bf16"
    assert d == desc(shared_intermediate=4, swiglu_limit=7.0) and d != desc()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_experts=3), "num_experts=3 must be divisible by ranks=2"),
        (dict(topk=0), "topk must be >= 1, got 0"),
        (dict(tokens_per_rank=-1), "tokens_per_rank must be >= 0, got -1"),
        (dict(hidden=0), "hidden must be in"),
        (dict(swiglu_limit=-1.0), "swiglu_limit must be a finite value > 0"),
    ],
)
def test_desc_validate_names_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        desc(**overrides).validate()


def test_unknown_precision_and_device_raise_value_error() -> None:
    with pytest.raises(ValueError, match="precision 'fp4'"):
        desc(precision="fp4")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        _C.DeviceFacts.find("tpu")


def test_plan_reports_sizes_and_reasons() -> None:
    d = desc(tokens_per_rank=2048, hidden=7168, intermediate=2048, num_experts=384, topk=8, ranks=8,
             shared_intermediate=2048)
    p = _C.plan(d, _C.DeviceFacts.find("h200"))
    ws = p["workspace_bytes"]
    assert ws["total"] == ws["symmetric"] + ws["schedule"] + ws["ring"] > 0
    assert p["ring_rows"] % p["minibatch_rows"] == 0 and p["minibatch_rows"] % 128 == 0
    assert p["comm_sms"] + p["compute_sms"] == 132
    assert "minibatch" in p["explanation"] and "ring" in p["explanation"]
    # 8 ranks x 2048 tokens x top-8 over 384 experts: 341.3 rows per expert, 384 in 128-row tiles.
    assert abs(p["rows_per_expert"] - 8 * 2048 * 8 / 384) < 1e-9 and p["padded_rows_per_expert"] == 384
    assert abs(p["padding_share"] - (1 - 8 * 2048 * 8 / 384 / 384)) < 1e-12
    given = _C.plan(d, _C.DeviceFacts.find("h200"), minibatch_rows=256, ring_rows=1024, comm_sms=8)
    assert (given["minibatch_rows"], given["ring_rows"], given["comm_sms"]) == (256, 1024, 8)
    with pytest.raises(ValueError, match="minibatch_rows must be a positive multiple"):
        _C.plan(d, _C.DeviceFacts.find("h200"), minibatch_rows=100)


def canonical_rows(topk_idx: np.ndarray, dest: int, local_experts: int) -> list[tuple[int, int, int]]:
    """(local expert, src_rank, slot) of every row routed to dest, sorted the canonical way."""
    ranks, tokens, k = topk_idx.shape
    rows = []
    for r in range(ranks):
        for t in range(tokens):
            for j in range(k):
                e = int(topk_idx[r, t, j]) - dest * local_experts
                if 0 <= e < local_experts:
                    rows.append((e, r * tokens + t, j, r, t * k + j))
    rows.sort()
    return [(e, r, slot) for e, _, _, r, slot in rows]


@pytest.mark.parametrize("ranks, tokens, experts, k", [(1, 5, 4, 2), (3, 7, 6, 3), (2, 0, 4, 1), (4, 3, 4, 4)])
def test_schedule_is_canonical(ranks: int, tokens: int, experts: int, k: int) -> None:
    rng = np.random.default_rng(ranks * 100 + tokens)
    topk_idx = rng.integers(0, experts, size=(ranks, tokens, k), dtype=np.int32)  # duplicates included
    d = desc(tokens_per_rank=tokens, num_experts=experts, topk=k, ranks=ranks)
    El = experts // ranks
    for dest in range(ranks):
        offsets, src_rank, src_slot = _C.build_rank_schedule(d, dest, topk_idx)
        expected = canonical_rows(topk_idx, dest, El)
        assert list(offsets) == [sum(1 for e, _, _ in expected if e < i) for i in range(El + 1)]
        assert [(int(r), int(s)) for r, s in zip(src_rank, src_slot)] == [(r, s) for _, r, s in expected]


def test_schedule_rejects_bad_expert_ids_and_arrays() -> None:
    d = desc(tokens_per_rank=2, num_experts=4, topk=2, ranks=2)
    idx = np.zeros((2, 2, 2), dtype=np.int32)
    idx[1, 1, 0] = 4
    with pytest.raises(ValueError, match=r"topk_idx\[rank 1\]\[token 1\]\[0\] = 4 is out of range \[0, 4\)"):
        _C.build_rank_schedule(d, 0, idx)
    with pytest.raises(ValueError, match="topk_idx must be a int32 array, got int64"):
        _C.build_rank_schedule(d, 0, idx.astype(np.int64))
    with pytest.raises(ValueError, match="topk_idx has 4 elements, expected 8"):
        _C.build_rank_schedule(d, 0, idx[:1])


def test_stage_arrays_are_checked_not_converted() -> None:
    """A converted copy of an output would silently drop the result: wrong arrays raise instead."""
    H, I, M = 8, 4, 3
    w = np.zeros((1, I, H), dtype=np.float32)
    wd = np.zeros((1, H, I), dtype=np.float32)
    offsets = np.array([0, M], dtype=np.int64)
    x = np.zeros((M, H), dtype=np.float32)
    h, y = np.zeros((M, I), dtype=np.float32), np.zeros((M, H), dtype=np.float32)
    _C.experts_forward(H, I, None, w, w, wd, 1, offsets, x, None, h, y)
    with pytest.raises(ValueError, match="y must be a float32 array, got float64"):
        _C.experts_forward(H, I, None, w, w, wd, 1, offsets, x, None, h, y.astype(np.float64))
    with pytest.raises(ValueError, match="y must be C-contiguous"):
        _C.experts_forward(H, I, None, w, w, wd, 1, offsets, x, None, h, np.zeros((H, M), dtype=np.float32).T)
    readonly = y.copy()
    readonly.setflags(write=False)
    with pytest.raises(ValueError, match="y must be writeable"):
        _C.experts_forward(H, I, None, w, w, wd, 1, offsets, x, None, h, readonly)
    with pytest.raises(ValueError, match="x has 24 elements, expected 32"):
        _C.experts_forward(H, I, None, w, w, wd, 1, np.array([0, 4], dtype=np.int64), x, None, h, y)


def test_stages_compose_to_the_reference_layer() -> None:
    """One rank: gather (by the schedule), experts_forward, scatter, combine_epilogue == layer_forward."""
    rng = np.random.default_rng(0)
    T, H, I, E, k = 5, 16, 8, 4, 2
    bf16 = lambda a: torch.from_numpy(a.astype(np.float32)).bfloat16().float().numpy()  # noqa: E731
    x = bf16(rng.standard_normal((T, H)))
    idx = rng.integers(0, E, size=(1, T, k), dtype=np.int32)
    topk_w = rng.random((T, k)).astype(np.float32)
    gate, up = bf16(rng.standard_normal((E, I, H)) / 4), bf16(rng.standard_normal((E, I, H)) / 4)
    down = bf16(rng.standard_normal((E, H, I)) / 3)
    d = desc(tokens_per_rank=T, hidden=H, intermediate=I, num_experts=E, topk=k, ranks=1)
    offsets, _, src_slot = _C.build_rank_schedule(d, 0, idx)
    rows = np.ascontiguousarray(x[src_slot // k])
    M = rows.shape[0]
    gu, h, y_rows = (np.zeros((M, n), dtype=np.float32) for n in (2 * I, I, H))
    _C.experts_forward(H, I, None, gate, up, down, E, offsets, rows, gu, h, y_rows)
    slots = np.zeros((T * k, H), dtype=np.float32)
    slots[src_slot] = y_rows
    y = np.zeros((T, H), dtype=np.float32)
    _C.combine_epilogue(T, H, k, None, slots, topk_w, y)
    ref = _C.reference_layer(d, [x], [idx[0]], [topk_w], gate, up, down, None, None, None,
                             [np.zeros((T, H), dtype=np.float32)])
    assert np.array_equal(y.reshape(-1), ref["y"][0])


def test_cpu_threads_do_not_change_bits() -> None:
    rng = np.random.default_rng(1)
    T, H, I, E, k = 9, 24, 12, 3, 2
    d = desc(tokens_per_rank=T, hidden=H, intermediate=I, num_experts=E, topk=k, ranks=1)
    args = (d, [rng.standard_normal(T * H).astype(np.float32)], [rng.integers(0, E, T * k, dtype=np.int32)],
            [rng.random(T * k).astype(np.float32)], *(rng.standard_normal(E * I * H).astype(np.float32) for _ in range(3)),
            None, None, None, [rng.standard_normal(T * H).astype(np.float32)])
    try:
        _C.set_cpu_threads(1)
        one = _C.reference_layer(*args)
        _C.set_cpu_threads(3)
        three = _C.reference_layer(*args)
    finally:
        _C.set_cpu_threads(0)  # back to every hardware thread
    for name in ("y", "dx", "d_topk_w"):
        assert np.array_equal(one[name][0], three[name][0]), name
    for name in ("d_gate", "d_up", "d_down"):
        assert np.array_equal(one[name], three[name]), name
