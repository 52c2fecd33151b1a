"""Benchmark case tables.

A :class:`Case` is one problem: a kind, a preset, a rank count, a size and a routing. The harness
builds its inputs and its reference once, then runs every registered implementation of that kind
(``bench/impls``) for every pass of the case; each (case, impl, pass) becomes one result row.

Kinds:
- ``layer``: the whole MoE layer per rank (dispatch, routed experts, shared expert, combine) with
  ``tokens_per_rank`` tokens on each of ``ranks`` ranks.
- ``experts``: the routed expert MLP alone on one GPU, on rows already grouped by expert:
  ``local_experts`` experts with ``rows_per_expert`` rows on average.

Select with ``--cases TABLE[:FILTER]``, FILTER being ``field=value[|value...]`` pairs joined by
commas, e.g. ``baselines_2gpu:preset=kimi-k2|mixtral-8x7b,tokens=2048`` (``\\|`` works as ``|``; a value no
case has is an error). Filter fields: kind,
preset, ranks, tokens, rows, experts, routing, precision.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Iterable

from .presets import MODEL_PRESETS, PRESETS

PASSES: tuple[str, ...] = ("forward", "backward", "both")
KINDS: tuple[str, ...] = ("layer", "experts")
PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "fp8_dgrad")  # fp8: MoK's 1x128 / 128x128 block scales, torch's row-wise


@dataclass(frozen=True)
class Case:
    kind: str
    preset: str
    ranks: int
    routing: str
    passes: tuple[str, ...] = ("forward", "backward")
    precision: str = "bf16"
    tokens_per_rank: int | None = None  # kind == "layer"
    rows_per_expert: int | None = None  # kind == "experts": mean rows per local expert
    local_experts: int | None = None  # kind == "experts"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}")
        if any(p not in PASSES for p in self.passes):
            raise ValueError(f"passes must be among {PASSES}, got {self.passes}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.kind == "layer":
            if self.tokens_per_rank is None or self.tokens_per_rank < 0:
                raise ValueError("a layer case needs tokens_per_rank >= 0")
            if PRESETS[self.preset].E % self.ranks:
                raise ValueError(f"{self.preset}: E={PRESETS[self.preset].E} is not divisible by R={self.ranks}")
        else:
            if self.ranks != 1:
                raise ValueError("experts cases run on one GPU (ranks=1)")
            if not self.rows_per_expert or not self.local_experts:
                raise ValueError("an experts case needs rows_per_expert and local_experts")

    @property
    def label(self) -> str:
        """Short human-readable name, unique within a table."""
        if self.kind == "layer":
            size = f"R={self.ranks} T={self.tokens_per_rank}"
        else:
            size = f"El={self.local_experts} rows/expert={self.rows_per_expert}"
        return f"{self.kind} {self.preset} {size} {self.routing} {self.precision}"

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["passes"] = list(self.passes)
        return d


def _layer_cases(
    presets: Iterable[str], ranks: int, tokens: Iterable[int], routings: Iterable[str]
) -> list[Case]:
    return [
        Case("layer", p, ranks, r, tokens_per_rank=t)
        for t in tokens
        for p in presets
        for r in routings
    ]


def _baselines(ranks: int) -> list[Case]:
    cases = _layer_cases(MODEL_PRESETS, ranks, (2048, 8192, 32768), ("balanced",))
    cases += _layer_cases(("kimi-k2", "qwen3-30b-a3b"), ranks, (8192,), ("zipf", "all_to_one"))
    return cases


def _fp8(ranks: int) -> list[Case]:
    # The layer in fp8 (MoK's block-scaled megakernel, its backward the bf16 one on the fp8
    # forward's h and g|u; torch's row-wise fp8 baseline, forward only), on the presets whose hidden
    # and intermediate sizes are whole 128-column blocks. Each shape also in bf16, so that one run
    # compares the two precisions too. fp8_dgrad: MoK's layer with the backward's data gradients on
    # e4m3 too (the stage kernels); the torch baselines skip it.
    presets = ("kimi-k2", "deepseek-v4-pro", "qwen3.5-397b")
    return [
        Case("layer", p, ranks, r, tokens_per_rank=t, precision=precision, passes=("forward", "backward"))
        for t in (2048, 8192)
        for p in presets
        for r in ("balanced", "zipf")
        for precision in ("fp8", "fp8_dgrad", "bf16")
    ]


def _experts_1gpu() -> list[Case]:
    # Local expert count of an EP8 deployment (E/8), rows per expert from decode-ish to training sizes.
    presets = ("kimi-k2", "qwen3.5-397b", "deepseek-v4-pro", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b")
    return [
        Case("experts", p, 1, routing, rows_per_expert=rows, local_experts=max(1, PRESETS[p].E // 8))
        for rows in (64, 256, 1024, 4096)
        for p in presets
        for routing in ("balanced", "zipf")
    ]


def _smoke() -> list[Case]:
    both = ("forward", "backward", "both")
    cases: list[Case] = []
    for ranks in (1, 2):
        cases += [
            Case("layer", "tiny", ranks, "balanced", passes=both, tokens_per_rank=32),
            Case("layer", "tiny", ranks, "zipf", tokens_per_rank=24),
            Case("layer", "tiny", ranks, "all_to_one", tokens_per_rank=16),
            Case("layer", "tiny", ranks, "uniform", tokens_per_rank=1),
        ]
    cases += [
        Case("experts", "tiny", 1, "balanced", rows_per_expert=16, local_experts=4),
        Case("experts", "tiny", 1, "zipf", rows_per_expert=8, local_experts=4),
    ]
    return cases


TABLES: dict[str, list[Case]] = {
    "smoke": _smoke(),
    "baselines_1gpu": _baselines(1),
    "baselines_2gpu": _baselines(2),
    "baselines_4gpu": _baselines(4),
    "baselines_8gpu": _baselines(8),
    "experts_1gpu": _experts_1gpu(),
    "fp8_1gpu": _fp8(1),
    "fp8_2gpu": _fp8(2),
}
TABLES["all_1gpu"] = TABLES["baselines_1gpu"] + TABLES["experts_1gpu"]

_FILTER_FIELDS = {
    "kind": "kind",
    "preset": "preset",
    "ranks": "ranks",
    "tokens": "tokens_per_rank",
    "rows": "rows_per_expert",
    "experts": "local_experts",
    "routing": "routing",
    "precision": "precision",
}


def select_cases(spec: str) -> list[Case]:
    """Cases of ``TABLE[:FILTER]`` (see the module docstring)."""
    name, _, filter_text = spec.partition(":")
    if name not in TABLES:
        raise KeyError(f"unknown case table {name!r}; known: {', '.join(TABLES)}")
    cases = TABLES[name]
    for term in filter(None, (t.strip() for t in filter_text.split(","))):
        key, eq, values = term.partition("=")
        if not eq or key not in _FILTER_FIELDS:
            raise ValueError(f"bad filter term {term!r}; use field=value with field in {sorted(_FILTER_FIELDS)}")
        # "\|" as "|": a pipe escaped for a shell (left in by double quotes) still separates.
        wanted = set(values.replace("\\|", "|").split("|"))
        have = {str(getattr(c, _FILTER_FIELDS[key])) for c in cases}
        unmatched = sorted(wanted - have)
        if unmatched:  # a misspelt value would otherwise drop its cases without a word
            raise ValueError(f"filter {term!r}: no case of {name} left has {key} {', '.join(map(repr, unmatched))}; "
                             f"there are {', '.join(sorted(have))}")
        cases = [c for c in cases if str(getattr(c, _FILTER_FIELDS[key])) in wanted]
    return cases


def with_passes(cases: list[Case], passes: tuple[str, ...] | None) -> list[Case]:
    """Override every case's passes (``--passes``)."""
    if not passes:
        return cases
    return [replace(c, passes=passes) for c in cases]
