"""Expert parallelism across NVLink domains: the layer over D domains of L ranks each.

Symmetric memory (the megakernel's pull and push) reaches the GPUs of one NVLink domain only. A
larger expert-parallel group of R = D x L ranks runs as two levels (``MoeConfig(domain_size=L)``):
rank ``r = d*L + l`` is rank l of domain d and owns experts ``[r*El, (r+1)*El)``, so domain d owns
``[d*L*El, (d+1)*L*El)``. Two kinds of subgroups: ``within`` (the L ranks of a domain: the
megakernel's group) and ``across`` (the D ranks with the same l: the inter-domain hop, through
the process group's engine, NCCL on GPUs, gloo on the CPU).

Forward on rank (d, l), fixed sizes, no host synchronization on the GPU after the first call of
a shape (its agreement over the group, in mok/functional.py):
  1. across: every rank's x [T,H], topk_idx and topk_w reach rank l of every domain (one
     all-gather each), so rank (d, l) holds the D*T tokens of the ranks (s, l), s = 0..D-1.
  2. within: the one-domain layer (:func:`mok.moe` over ``within``) on those D*T tokens, with
     the expert ids of other domains made empty slots (-1: no row, no GEMM work) and this domain's
     made domain-local. A token that needs no expert here costs its copies and nothing else.
  3. across: domain d's partial y of each source's tokens goes back to it (one all-to-all), and
     ``y = bf16(y_shared + partial_0 + ... + partial_{D-1})``, in fp32 in domain order.
The backward is the reverse (autograd through the three steps): dy all-gathered, the one-domain
backward, dx and d topk_w back by all-to-all and summed in domain order in fp32 (a slot's
d topk_w comes from its expert's domain alone: the sum is exact).

Results are deterministic and, like the one-domain layer, independent of the minibatch and ring;
they are not the one-domain layer's bits: each domain's partial sum is rounded to bf16 before the
sum over domains (one more rounding per domain). The all-gather sends every token to every
domain, needed or not: with top-8 routing over 2 domains nearly every token needs both; over many
domains a variable-size exchange would move fewer bytes (and would need the counts on the host,
or NVSHMEM's device-side all-to-all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import _dist

Tensor = torch.Tensor

# (group name, domain size) -> the names of this rank's (within, across) subgroups. Names, not
# ProcessGroups: nothing here keeps a group alive past destroy_process_group (see _dist.EpGroup).
_GROUPS: dict[tuple[str, int], tuple[str, str]] = {}


def subgroups(group: dist.ProcessGroup, domain_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(within, across) for this rank of ``group``, made once per (group, domain size). Only the
    group's ranks take part (``use_local_synchronization``), each in its two subgroups."""
    key = (_dist.group_name_of(group), domain_size)
    if key in _GROUPS:
        try:
            within_pg, across_pg = (c10d._resolve_process_group(name) for name in _GROUPS[key])
            return within_pg, across_pg
        except Exception:  # noqa: BLE001  (destroyed with its world: make them again)
            del _GROUPS[key]
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    domains = len(ranks) // domain_size
    within = [ranks[d * domain_size:(d + 1) * domain_size] for d in range(domains)]
    across = [ranks[l::domain_size] for l in range(domain_size)]
    mine: dict[str, dist.ProcessGroup] = {}
    # Each rank creates its own two subgroups only (local synchronization: members alone meet).
    for name, lists in (("within", within), ("across", across)):
        for members in lists:
            if ranks[me] in members:
                pg = dist.new_group(members, use_local_synchronization=True)
                assert pg is not None
                mine[name] = pg
    _GROUPS[key] = (_dist.group_name_of(mine["within"]), _dist.group_name_of(mine["across"]))
    return mine["within"], mine["across"]


def _staged(across: dist.ProcessGroup, t: Tensor) -> bool:
    """GPU tensors over a gloo group go through host memory (NCCL takes them as they are)."""
    return t.is_cuda and dist.get_backend(across) == dist.Backend.GLOO


def _all_gather(across: dist.ProcessGroup, t: Tensor) -> Tensor:
    """[D, *t.shape]: block s is rank s of ``across``'s t."""
    if _staged(across, t):
        return _all_gather(across, t.cpu()).to(t.device)
    out = t.new_empty((dist.get_world_size(across),) + tuple(t.shape))
    if dist.get_backend(across) == dist.Backend.NCCL:
        dist.all_gather_into_tensor(out, t.contiguous(), group=across)
    else:
        dist.all_gather(list(out.unbind(0)), t.contiguous(), group=across)
    return out


def _all_to_all(across: dist.ProcessGroup, blocks: Tensor) -> Tensor:
    """[D, ...] -> [D, ...]: block s goes to rank s of ``across``; block s of the result came from it."""
    if _staged(across, blocks):
        return _all_to_all(across, blocks.cpu()).to(blocks.device)
    out = torch.empty_like(blocks)
    dist.all_to_all_single(out, blocks.contiguous(), group=across)
    return out


def _ordered_sum(blocks: Tensor, base: Tensor | None, dtype: torch.dtype) -> Tensor:
    """base + blocks[0] + ... + blocks[D-1] in fp32, in that order, rounded once to dtype."""
    acc = torch.zeros(blocks.shape[1:], dtype=torch.float32, device=blocks.device) if base is None else base.float()
    for block in blocks.unbind(0):
        acc = acc + block.float()
    return acc.to(dtype)


class _Gather(torch.autograd.Function):
    """Forward: every ``across`` rank's t, [D, *t.shape]. Backward: each block's gradient back to
    its rank, summed there in rank order (fp32, one rounding)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, across: dist.ProcessGroup) -> Tensor:
        ctx.across = across
        return _all_gather(across, t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[Any, ...]:
        assert grad is not None
        return _ordered_sum(_all_to_all(ctx.across, grad), None, grad.dtype), None


class _Combine(torch.autograd.Function):
    """Forward: partials [D, T, H] (block s: this domain's partial y of ``across`` rank s's tokens)
    go back to their ranks; y = base + the D partials received, fp32 in order, one rounding.
    Backward: ``check_dy(dy)`` (over the whole group), then every rank's dy to every domain (an
    all-gather); base gets dy."""

    @staticmethod
    def forward(ctx: Any, partials: Tensor, base: Tensor | None, across: dist.ProcessGroup,
                check_dy: Callable[[Tensor], None]) -> Tensor:
        ctx.across, ctx.has_base, ctx.check_dy = across, base is not None, check_dy
        return _ordered_sum(_all_to_all(across, partials), base, partials.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor | None) -> tuple[Any, ...]:
        assert dy is not None
        dy = dy.contiguous()
        ctx.check_dy(dy)
        return _all_gather(ctx.across, dy), (dy if ctx.has_base else None), None, None


def moe(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
        shared: Sequence[Tensor] | None, group: dist.ProcessGroup, domain_size: int, one_domain: Any,
        check_dy: Callable[[Tensor], None]) -> Tensor:
    """The layer over ``group`` as domains of ``domain_size`` ranks (checked by the caller on every
    rank). ``one_domain(x, idx, w, w_gate, w_up, w_down, shared, group)`` is the one-domain layer
    (:func:`mok.moe` with the call's SwiGLU limit, save_context and config); ``check_dy(dy)`` checks
    the backward's dy before any exchange (the caller's agreement over the whole group)."""
    within, across = subgroups(group, domain_size)
    domains = dist.get_world_size(across)
    d = dist.get_rank(group) // domain_size
    T, H = x.shape
    k = topk_idx.shape[1]
    experts_per_domain = w_gate.shape[0] * domain_size
    # 1. Every rank (s, l)'s tokens to rank l of every domain.
    x_in = _Gather.apply(x.contiguous(), across).reshape(domains * T, H)
    w_in = _Gather.apply(topk_w.contiguous(), across).reshape(domains * T, k)
    idx_in = _all_gather(across, topk_idx.contiguous()).reshape(domains * T, k)
    # This domain's ids made local, other domains' empty; an id that is no expert's stays as it is,
    # out of the one-domain call's range, which names it (on the GPU: its sticky error, no host sync;
    # the position it names is the token's among the D*T gathered ones).
    local = idx_in - d * experts_per_domain
    ours = (local >= 0) & (local < experts_per_domain)
    valid = (idx_in >= -1) & (idx_in < domains * experts_per_domain)
    idx_in = torch.where(ours, local, torch.where(valid, torch.full_like(local, -1), idx_in))
    # 2. This domain's experts on them (the shared expert runs once, at the source, below).
    partials = one_domain(x_in, idx_in, w_in, w_gate, w_up, w_down, None, within)
    y_shared = None
    if shared is not None:
        # The shared expert as the one expert of a one-rank layer: every token to it with weight 1.
        # (At fp8 its codes are cached per version even so: the cache keys a view by what it views.)
        ones = torch.ones(T, 1, dtype=torch.float32, device=x.device)
        first = torch.zeros(T, 1, dtype=topk_idx.dtype, device=x.device)
        y_shared = one_domain(x, first, ones, *(w.unsqueeze(0) for w in shared), None, None)
    # 3. The partials back to their sources, summed in domain order.
    return _Combine.apply(partials.reshape(domains, T, H), y_shared, across, check_dy)
