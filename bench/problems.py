"""Inputs and references of a case, per rank.

Seeds: the routing popularity (zipf) and nothing else depends on the case seed alone, so it is the
same model on every rank; tokens, router weights, activations and each rank's experts are seeded
by (case seed, rank). Weights have std 1/sqrt(fan_in) so activations stay O(1) (mok.testing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mok import testing

from .cases import Case
from .cost import BF16_BYTES, RoutingLoad, weight_bytes
from .presets import Preset, get_preset
from .runtime import Runtime

LAYER_GRAD_NAMES = ("d_x", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_s_gate", "d_s_up", "d_s_down")
EXPERTS_GRAD_NAMES = ("d_x", "d_w_gate", "d_w_up", "d_w_down")
REFERENCE_WEIGHT_GRAD_BYTES = 2 << 30  # the reference keeps fp32 weight gradients of at most this many bytes


def _seed(case: Case, rank: int, stream: int) -> int:
    return (case.seed * 1_000_003 + rank * 7_919 + stream) % (2**63)


# ---------------------------------------------------------------------------------------------
# Layer problems
# ---------------------------------------------------------------------------------------------


@dataclass
class LayerProblem:
    """One rank's share of a layer case. Tensors that receive gradients have requires_grad set."""

    case: Case
    preset: Preset
    rank: int
    ranks: int
    x: torch.Tensor  # [T,H] bf16
    topk_idx: torch.Tensor  # [T,k] int64, global expert ids
    topk_w: torch.Tensor  # [T,k] fp32
    w_gate: torch.Tensor  # [El,I,H] bf16, global experts [rank*El, (rank+1)*El)
    w_up: torch.Tensor  # [El,I,H] bf16
    w_down: torch.Tensor  # [El,H,I] bf16
    shared: testing.SharedWeights | None  # replicated shared expert
    d_y: torch.Tensor  # [T,H] bf16, the upstream gradient used by every backward
    load: RoutingLoad

    @property
    def local_experts(self) -> int:
        return self.w_gate.shape[0]

    @property
    def first_expert(self) -> int:
        return self.rank * self.local_experts

    @property
    def swiglu_limit(self) -> float | None:
        return self.preset.swiglu_limit

    @property
    def grad_targets(self) -> list[torch.Tensor]:
        """Tensors whose gradients a backward returns, in LAYER_GRAD_NAMES order."""
        return [self.x, self.topk_w, self.w_gate, self.w_up, self.w_down] + (list(self.shared) if self.shared else [])


def layer_routing(case: Case, preset: Preset, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx [T,k] int64, topk_w [T,k] fp32) of this rank's tokens, on the CPU."""
    gen = torch.Generator().manual_seed(_seed(case, rank, 1))
    kwargs: dict[str, object] = {}
    if case.routing == "zipf":
        # Popularity is a property of the model: seeded by the case only, the same on every rank.
        kwargs["popularity"] = testing.zipf_popularity(preset.E, generator=torch.Generator().manual_seed(case.seed))
    topk_idx = testing.make_routing(case.routing, case.tokens_per_rank or 0, preset.E, preset.topk, generator=gen, **kwargs)
    topk_w = testing.random_topk_weights(case.tokens_per_rank or 0, preset.topk, generator=gen)
    return topk_idx, topk_w


def routing_load(rt: Runtime, topk_idx: torch.Tensor, preset: Preset) -> RoutingLoad:
    """The global slot-count matrix send[src][dst] and the busiest expert's rows, gathered from every rank."""
    local_experts = preset.E // rt.world_size
    per_expert = torch.bincount(topk_idx.reshape(-1), minlength=preset.E)
    gathered = rt.all_gather_tensor(per_expert.to(rt.device).unsqueeze(0)).cpu()  # [R (src), E]
    send = gathered.view(rt.world_size, rt.world_size, local_experts).sum(-1)  # [src, dst]
    return RoutingLoad([[int(v) for v in row] for row in send.tolist()], int(gathered.sum(0).max()))


def layer_problem_bytes(case: Case, preset: Preset, load: RoutingLoad) -> int:
    """Device bytes of the problem and its reference (kept results plus the reference's peak temporaries)."""
    T, H, I, k, R = case.tokens_per_rank or 0, preset.H, preset.I, preset.topk, case.ranks
    El = preset.E // R
    weights = weight_bytes(preset, El)
    inputs = 2 * T * H * BF16_BYTES + 2 * T * k * 8
    reference_kept = 2 * T * H * 4 + min(2 * weights, REFERENCE_WEIGHT_GRAD_BYTES + 3 * I * H * 4)
    rows_per_expert_max = load.max_rows_per_expert
    reference_peak = (
        2 * R * T * H * BF16_BYTES  # gathered x, d_y
        + 2 * R * T * H * 4  # partial y, d_x
        + rows_per_expert_max * (4 * H + 6 * I) * 4  # one expert's rows in fp32
        + T * (4 * H + 6 * preset.shared_I) * 4  # the shared expert on this rank's tokens
    )
    return weights + inputs + reference_kept + reference_peak


def build_layer_problem(case: Case, rt: Runtime, topk_idx: torch.Tensor, topk_w: torch.Tensor, load: RoutingLoad) -> LayerProblem:
    preset = get_preset(case.preset)
    T, H = case.tokens_per_rank or 0, preset.H
    El = preset.E // rt.world_size
    dev_gen = torch.Generator(device=rt.device).manual_seed(_seed(case, rt.rank, 2))
    x = torch.randn(T, H, generator=dev_gen, device=rt.device, dtype=torch.bfloat16)
    d_y = torch.randn(T, H, generator=dev_gen, device=rt.device, dtype=torch.bfloat16)
    w_gate, w_up, w_down = testing.random_expert_weights(El, H, preset.I, generator=dev_gen, device=rt.device)
    shared = None
    if preset.shared_I > 0:
        # The shared expert is replicated: the same values on every rank.
        shared_gen = torch.Generator(device=rt.device).manual_seed(_seed(case, 0, 3))
        shared = testing.random_shared_weights(H, preset.shared_I, generator=shared_gen, device=rt.device)
        shared = tuple(w.requires_grad_(True) for w in shared)  # type: ignore[assignment]
    return LayerProblem(
        case=case,
        preset=preset,
        rank=rt.rank,
        ranks=rt.world_size,
        x=x.requires_grad_(True),
        topk_idx=topk_idx.to(rt.device),
        topk_w=topk_w.to(rt.device).requires_grad_(True),
        w_gate=w_gate.requires_grad_(True),
        w_up=w_up.requires_grad_(True),
        w_down=w_down.requires_grad_(True),
        shared=shared,
        d_y=d_y,
        load=load,
    )


@dataclass
class Expected:
    """Reference output and gradients (named as LAYER_GRAD_NAMES / EXPERTS_GRAD_NAMES).

    Routed weight gradients cover the local experts in ``weight_grad_experts`` only (all of them
    unless that would exceed REFERENCE_WEIGHT_GRAD_BYTES); compare ``grad[weight_grad_experts]``.
    """

    y: torch.Tensor
    grads: dict[str, torch.Tensor]
    weight_grad_experts: list[int]


def sampled_experts(rows_per_expert: list[int], per_expert_bytes: int) -> list[int]:
    """Local experts whose weight gradients the reference keeps: all if they fit the budget, else the
    busiest, the least busy (often empty) and evenly spaced others."""
    num = len(rows_per_expert)
    keep = max(2, REFERENCE_WEIGHT_GRAD_BYTES // max(per_expert_bytes, 1))
    if keep >= num:
        return list(range(num))
    busiest = max(range(num), key=rows_per_expert.__getitem__)
    least_busy = min(range(num), key=rows_per_expert.__getitem__)
    by_priority = [busiest, least_busy] + [i * num // keep for i in range(keep)]
    return sorted(list(dict.fromkeys(by_priority))[:keep])


def layer_reference(problem: LayerProblem, rt: Runtime) -> Expected:
    """The layer in fp32 with an all-gather / reduce-scatter decomposition (independent of any a2a).

    Every rank applies its own experts to all ranks' tokens (mok.testing.moe_reference_grads with
    first_expert = rank * El), the partial outputs and token gradients are summed across ranks and
    each rank keeps its own tokens; the shared expert is applied locally.
    """
    p = problem
    with torch.no_grad():
        x_all = rt.all_gather_tensor(p.x.detach())
        idx_all = rt.all_gather_tensor(p.topk_idx)
        local_rows = torch.bincount(idx_all.reshape(-1), minlength=p.preset.E)[p.first_expert : p.first_expert + p.local_experts]
        kept = sampled_experts(local_rows.tolist(), 3 * p.preset.I * p.preset.H * 4)
        w_all = rt.all_gather_tensor(p.topk_w.detach())
        d_y_all = rt.all_gather_tensor(p.d_y)
        routed = testing.moe_reference_grads(
            x_all, idx_all, w_all, p.w_gate.detach(), p.w_up.detach(), p.w_down.detach(), d_y_all,
            swiglu_limit=p.swiglu_limit, first_expert=p.first_expert, weight_grad_experts=kept,
        )
        del x_all, idx_all, w_all, d_y_all
        y = rt.reduce_scatter_sum(routed.y)
        d_x = rt.reduce_scatter_sum(routed.d_x)
        d_topk_w = rt.reduce_scatter_sum(routed.d_topk_w)
        grads = {"d_topk_w": d_topk_w, "d_w_gate": routed.d_w_gate, "d_w_up": routed.d_w_up, "d_w_down": routed.d_w_down}
        del routed
        if p.shared is not None:
            out, d_x_shared, dsg, dsu, dsd, _ = testing.expert_mlp_with_grads(
                p.x.detach().float(), *(w.detach() for w in p.shared), p.d_y.float(), p.swiglu_limit
            )
            y += out
            d_x += d_x_shared
            grads.update(d_s_gate=dsg, d_s_up=dsu, d_s_down=dsd)
        grads["d_x"] = d_x
    return Expected(y=y, grads=grads, weight_grad_experts=kept)


# ---------------------------------------------------------------------------------------------
# Expert-GEMM problems (one GPU, rows already grouped by expert)
# ---------------------------------------------------------------------------------------------


@dataclass
class ExpertsProblem:
    case: Case
    preset: Preset
    x: torch.Tensor  # [M,H] bf16, rows grouped by expert (expert 0's rows first)
    counts: list[int]  # rows per expert, sum M
    offs: torch.Tensor  # [El] int32 on device: cumulative row counts (end offsets), torch._grouped_mm's `offs`
    expert_of_row: torch.Tensor  # [M] int64
    w_gate: torch.Tensor  # [El,I,H]
    w_up: torch.Tensor
    w_down: torch.Tensor  # [El,H,I]
    d_y: torch.Tensor  # [M,H]

    @property
    def swiglu_limit(self) -> float | None:
        return self.preset.swiglu_limit

    @property
    def grad_targets(self) -> list[torch.Tensor]:
        return [self.x, self.w_gate, self.w_up, self.w_down]


def experts_counts(case: Case, preset: Preset) -> list[int]:
    """Rows per expert, summing to local_experts * rows_per_expert.

    balanced: equal; zipf: proportional to a Zipf(1.2) popularity (largest remainders rounding);
    all_to_one: everything on expert 0.
    """
    El = case.local_experts or 1
    total = El * (case.rows_per_expert or 0)
    if case.routing == "balanced":
        return [total // El + (1 if e < total % El else 0) for e in range(El)]
    if case.routing == "all_to_one":
        return [total] + [0] * (El - 1)
    if case.routing == "zipf":
        p = testing.zipf_popularity(El, generator=torch.Generator().manual_seed(case.seed))
        exact = (p * total).tolist()
        counts = [int(v) for v in exact]
        by_remainder = sorted(range(El), key=lambda e: exact[e] - counts[e], reverse=True)
        for e in by_remainder[: total - sum(counts)]:
            counts[e] += 1
        return counts
    raise ValueError(f"experts cases support balanced, zipf, all_to_one; got {case.routing!r}")


def experts_problem_bytes(case: Case, preset: Preset) -> int:
    counts = experts_counts(case, preset)
    M, H, I = sum(counts), preset.H, preset.I
    weights = 3 * len(counts) * I * H * BF16_BYTES
    reference_grads = min(2 * weights, REFERENCE_WEIGHT_GRAD_BYTES + 3 * I * H * 4)
    return weights + 2 * M * H * BF16_BYTES + 2 * M * H * 4 + reference_grads + max(counts) * (4 * H + 6 * I) * 4


def build_experts_problem(case: Case, rt: Runtime) -> ExpertsProblem:
    preset = get_preset(case.preset)
    counts = experts_counts(case, preset)
    M, H = sum(counts), preset.H
    dev_gen = torch.Generator(device=rt.device).manual_seed(_seed(case, 0, 4))
    x = torch.randn(M, H, generator=dev_gen, device=rt.device, dtype=torch.bfloat16)
    d_y = torch.randn(M, H, generator=dev_gen, device=rt.device, dtype=torch.bfloat16)
    w_gate, w_up, w_down = testing.random_expert_weights(len(counts), H, preset.I, generator=dev_gen, device=rt.device)
    counts_t = torch.tensor(counts, dtype=torch.int64)
    return ExpertsProblem(
        case=case,
        preset=preset,
        x=x.requires_grad_(True),
        counts=counts,
        offs=torch.cumsum(counts_t, 0).to(torch.int32).to(rt.device),
        expert_of_row=torch.repeat_interleave(torch.arange(len(counts)), counts_t).to(rt.device),
        w_gate=w_gate.requires_grad_(True),
        w_up=w_up.requires_grad_(True),
        w_down=w_down.requires_grad_(True),
        d_y=d_y,
    )


def experts_reference(problem: ExpertsProblem) -> Expected:
    """Rows through their expert in fp32: the layer reference with k = 1, weight 1, no shared expert."""
    p = problem
    M = p.x.shape[0]
    kept = sampled_experts(p.counts, 3 * p.preset.I * p.preset.H * 4)
    ref = testing.moe_reference_grads(
        p.x.detach(), p.expert_of_row.unsqueeze(1), torch.ones(M, 1, device=p.x.device),
        p.w_gate.detach(), p.w_up.detach(), p.w_down.detach(), p.d_y, swiglu_limit=p.swiglu_limit,
        weight_grad_experts=kept,
    )
    grads = {"d_x": ref.d_x, "d_w_gate": ref.d_w_gate, "d_w_up": ref.d_w_up, "d_w_down": ref.d_w_down}
    return Expected(y=ref.y, grads=grads, weight_grad_experts=kept)
