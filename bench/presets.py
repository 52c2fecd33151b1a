"""Model shape presets (DESIGN.md's shape table), as data.

Field names (E, H, I, topk, shared_I, swiglu_limit) are shared with the C++ preset table; a CI test
compares the two, so keep names and values in sync with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Preset:
    """One MoE layer shape: routed experts E, hidden H, expert intermediate I, top-k, shared expert width."""

    name: str
    E: int  # routed experts (global)
    H: int  # hidden size
    I: int  # routed expert intermediate size  # noqa: E741
    topk: int
    shared_I: int  # shared expert intermediate size; 0 = no shared expert
    swiglu_limit: float | None = None  # gpt-oss style clamp; None = plain SwiGLU

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("kimi-k2", E=384, H=7168, I=2048, topk=8, shared_I=2048),
        Preset("glm-5.2", E=256, H=6144, I=2048, topk=8, shared_I=2048),
        Preset("qwen3.5-397b", E=512, H=4096, I=1024, topk=10, shared_I=1024),
        Preset("deepseek-v4-pro", E=384, H=7168, I=3072, topk=6, shared_I=3072),
        Preset("deepseek-v3", E=256, H=7168, I=2048, topk=8, shared_I=2048),
        Preset("qwen3-30b-a3b", E=128, H=2048, I=768, topk=8, shared_I=0),
        Preset("gpt-oss-120b", E=128, H=2880, I=2880, topk=4, shared_I=0, swiglu_limit=7.0),
        Preset("mixtral-8x7b", E=8, H=4096, I=14336, topk=2, shared_I=0),
        Preset("small", E=16, H=512, I=256, topk=4, shared_I=256),
        Preset("tiny", E=8, H=128, I=64, topk=2, shared_I=64),
    )
}

MODEL_PRESETS: tuple[str, ...] = tuple(n for n in PRESETS if n not in ("small", "tiny"))
"""The real-model rows of the table (no test shapes)."""


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
