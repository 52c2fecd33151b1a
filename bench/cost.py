"""What each case declares: FLOPs, HBM bytes and NVLink bytes, and the floor they imply.

Per rank r, forward, bf16 (2 bytes per element)::

    flops      = 6 * rows_r * H * I + 6 * T * H * Is           rows_r = (token, j) slots routed to r's experts
    hbm_bytes  = weights (3*El*I*H + 3*Is*H) * 2               read once
               + 2 * T * H * 2                                 x in, y out
               + 2 * rows_r * H * 2                            dispatch buffer: written, then read by the GEMM
               + 2 * T * k * H * 2                             combine buffer: written, then read by the sum
    nvlink     = (remote_in_r + remote_out_r) * H * 2          per direction: dispatch brings remote_in rows in
                                                               and sends remote_out rows out; combine reverses both
Backward counts 2x the forward's FLOPs and HBM bytes (weights read and their gradients written,
two dgrad GEMMs per wgrad GEMM) and the same NVLink bytes again (dy pulled, dx pushed).
Slots are counted per (token, j), as the baselines send them (no per-rank deduplication).

Declared numbers (TFLOP/s, GB/s columns) use the mean over ranks, so that with balanced routing
``flops = 6*T*k*H*I + 6*T*H*Is``. The floor uses the busiest rank, because the slowest rank sets
the time: ``floor_ms = max(flops / bf16 rate, hbm_bytes / HBM rate, nvlink_bytes / NVLink rate)``
with the rates measured at the start of the run (the faster of NVLink read/write, so it stays a
lower bound).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .presets import Preset

BF16_BYTES = 2


@dataclass(frozen=True)
class RoutingLoad:
    """Slot counts between ranks: ``send[src][dst]`` = (token, j) slots of src's tokens routed to dst's experts."""

    send: list[list[int]]
    max_rows_per_expert: int  # most slots (all ranks' tokens) routed to one expert

    @property
    def ranks(self) -> int:
        return len(self.send)

    def rows_received(self, r: int) -> int:
        return sum(self.send[src][r] for src in range(self.ranks))

    def remote_in(self, r: int) -> int:
        return self.rows_received(r) - self.send[r][r]

    def remote_out(self, r: int) -> int:
        return sum(self.send[r]) - self.send[r][r]

    def max_rows_received(self) -> int:
        return max(self.rows_received(r) for r in range(self.ranks))


@dataclass(frozen=True)
class Cost:
    """Declared work of one pass: mean over ranks, and the busiest rank's (for the floor)."""

    flops: float
    hbm_bytes: float
    nvlink_bytes: float
    busiest_flops: float
    busiest_hbm_bytes: float
    busiest_nvlink_bytes: float

    def scaled(self, factor: float, nvlink_factor: float) -> "Cost":
        return Cost(
            self.flops * factor,
            self.hbm_bytes * factor,
            self.nvlink_bytes * nvlink_factor,
            self.busiest_flops * factor,
            self.busiest_hbm_bytes * factor,
            self.busiest_nvlink_bytes * nvlink_factor,
        )

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))


def _pass_cost(forward: Cost, pass_name: str) -> Cost:
    backward = forward.scaled(2.0, 1.0)
    if pass_name == "forward":
        return forward
    if pass_name == "backward":
        return backward
    if pass_name == "both":
        return forward + backward
    raise ValueError(f"unknown pass {pass_name!r}")


def weight_bytes(preset: Preset, local_experts: int) -> int:
    return (3 * local_experts * preset.I * preset.H + 3 * preset.shared_I * preset.H) * BF16_BYTES


def layer_cost(preset: Preset, tokens_per_rank: int, load: RoutingLoad, pass_name: str) -> Cost:
    H, I, Is, k = preset.H, preset.I, preset.shared_I, preset.topk
    T = tokens_per_rank
    R = load.ranks
    El = preset.E // R
    per_rank: list[tuple[float, float, float]] = []
    for r in range(R):
        rows = load.rows_received(r)
        flops = 6.0 * rows * H * I + 6.0 * T * H * Is
        hbm = weight_bytes(preset, El) + (2 * T * H + 2 * rows * H + 2 * T * k * H) * BF16_BYTES
        nvlink = (load.remote_in(r) + load.remote_out(r)) * H * BF16_BYTES
        per_rank.append((flops, float(hbm), float(nvlink)))
    mean = [sum(v[i] for v in per_rank) / R for i in range(3)]
    busiest = [max(v[i] for v in per_rank) for i in range(3)]
    return _pass_cost(Cost(*mean, *busiest), pass_name)


def experts_cost(preset: Preset, counts: list[int], pass_name: str) -> Cost:
    """Grouped expert MLP on pre-grouped rows: 6*M*H*I FLOPs; weights + rows in + rows out of HBM."""
    rows = sum(counts)
    flops = 6.0 * rows * preset.H * preset.I
    hbm = float(3 * len(counts) * preset.I * preset.H * BF16_BYTES + 2 * rows * preset.H * BF16_BYTES)
    return _pass_cost(Cost(flops, hbm, 0.0, flops, hbm, 0.0), pass_name)


@dataclass(frozen=True)
class Floor:
    ms: float | None
    bound: str | None  # "compute", "hbm" or "nvlink": which term sets the floor


def floor_of(cost: Cost, ceilings: dict[str, object]) -> Floor:
    """Lower bound on the time of a pass from the measured machine rates (None if none measured)."""
    terms: dict[str, float] = {}
    tflops = ceilings.get("bf16_tflops")
    if isinstance(tflops, (int, float)) and tflops > 0:
        terms["compute"] = cost.busiest_flops / (tflops * 1e12)
    hbm = ceilings.get("hbm_gbps")
    if isinstance(hbm, (int, float)) and hbm > 0:
        terms["hbm"] = cost.busiest_hbm_bytes / (hbm * 1e9)
    link_rates = [
        v for v in (ceilings.get("nvlink_read_gbps"), ceilings.get("nvlink_write_gbps"))
        if isinstance(v, (int, float)) and v > 0
    ]
    if cost.busiest_nvlink_bytes > 0 and link_rates:
        terms["nvlink"] = cost.busiest_nvlink_bytes / (max(link_rates) * 1e9)
    if not terms:
        return Floor(None, None)
    bound = max(terms, key=lambda name: terms[name])
    return Floor(terms[bound] * 1e3, bound)
