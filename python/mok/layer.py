"""``mok.MoE``, the drop-in ``nn.Module``, and ``mok.TopKRouter``.

The module holds state only (parameters, the group, options); the computation is
:func:`mok.functional.moe`, i.e. the ``torch.ops.mok`` ops and their registered autograd.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import _checks, _dist
from .functional import MoeConfig, _checked, _moe

__all__ = ["MoE", "TopKRouter"]

Tensor = torch.Tensor


def _positive_int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class TopKRouter(nn.Module):
    """Scores every expert for each token and keeps the top k: ``(topk_idx int64 [N,k], topk_w fp32 [N,k])``.

    - ``score="softmax"`` (Mixtral, Qwen-MoE): ``p = softmax(x W^T + b)``.
    - ``score="sigmoid"`` (DeepSeek-V3): ``p = sigmoid(x W^T + b)``.

    Selection ranks ``p + correction_bias`` when ``correction_bias=True`` (DeepSeek-V3's aux-loss-free
    balancing: a buffer ``e_score_correction_bias`` [E] that the trainer adjusts; it receives no
    gradient and does not enter the weights). With ``num_groups > 1`` tokens first pick the
    ``topk_groups`` groups of experts with the largest sum of their two best scores, then experts
    inside them (DeepSeek-V3's group-limited routing). The weights are ``p`` at the chosen experts,
    renormalised to sum to 1 when ``norm_topk_prob``, times ``routed_scaling_factor``. Computed in
    fp32 whatever x's dtype; gradients flow to ``weight`` (and ``bias``) through the weights.
    """

    def __init__(self, hidden: int, num_experts: int, topk: int, *, score: str = "softmax", bias: bool = False,
                 correction_bias: bool = False, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 num_groups: int = 1, topk_groups: int = 1, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.hidden = _positive_int(hidden, "hidden")
        self.num_experts = _positive_int(num_experts, "num_experts")
        self.topk = _positive_int(topk, "topk")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
        self.num_groups = _positive_int(num_groups, "num_groups")
        self.topk_groups = _positive_int(topk_groups, "topk_groups")
        if num_experts % num_groups != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by num_groups={num_groups}")
        if topk_groups > num_groups:
            raise ValueError(f"topk_groups={topk_groups} must be <= num_groups={num_groups}")
        if topk > topk_groups * (num_experts // num_groups):
            raise ValueError(f"topk={topk} is more than the {topk_groups * (num_experts // num_groups)} experts "
                             f"in topk_groups={topk_groups} groups")
        self.score = score
        self.norm_topk_prob = bool(norm_topk_prob)
        self.routed_scaling_factor = float(routed_scaling_factor)
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, **factory))
        self.bias = nn.Parameter(torch.empty(num_experts, **factory)) if bias else None
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's initialisation
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [N, H={self.hidden}], got {tuple(x.shape)}")
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(x.float(), self.weight.float(), bias)
        scores = torch.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)
        choice = scores.detach()
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias
        if self.num_groups > 1:
            per_group = choice.view(choice.shape[0], self.num_groups, -1)
            group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_groups, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per_group.shape[-1], dim=1), float("-inf"))
        topk_idx = choice.topk(self.topk, dim=-1).indices
        topk_w = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            topk_w = topk_w * self.routed_scaling_factor
        return topk_idx, topk_w

    def extra_repr(self) -> str:
        parts = [f"hidden={self.hidden}", f"num_experts={self.num_experts}", f"topk={self.topk}",
                 f"score={self.score}", f"norm_topk_prob={self.norm_topk_prob}"]
        if self.bias is not None:
            parts.append("bias=True")
        if self.e_score_correction_bias is not None:
            parts.append("correction_bias=True")
        if self.num_groups > 1:
            parts.append(f"num_groups={self.num_groups}, topk_groups={self.topk_groups}")
        if self.routed_scaling_factor != 1.0:
            parts.append(f"routed_scaling_factor={self.routed_scaling_factor}")
        return ", ".join(parts)


class MoE(nn.Module):
    """A mixture-of-experts block: routed SwiGLU experts, an optional shared expert, an optional router.

    ``forward(x)`` (with a router) or ``forward(x, topk_idx, topk_w)`` (routing from outside);
    ``x [..., H]`` bf16 or fp32. The layer computes in bf16 (the GPU kernels' precision; on the
    GPU ``config=MoeConfig(precision="fp8")`` runs the experts' forward on block-scaled e4m3, and
    ``"fp8_dgrad"`` the backward's data gradients too) and returns y in x's dtype and shape. See
    :func:`mok.functional.moe` for the exact semantics.

    Expert parallelism: with ``group`` (any process group, subgroups included; None: all experts on
    this process) of R ranks, this module holds the ``E/R`` experts ``[rank*E/R, (rank+1)*E/R)``
    of its rank; the router and the shared expert are replicated. Every rank of the group must run
    the module in step. The routed experts' gradients already sum over every rank's tokens.

    Parameters (``dtype``: the parameters' dtype, default torch's; fp32 parameters act as master
    weights, rounded to bf16 for the computation, with fp32 gradients):
    ``w_gate``, ``w_up`` [El,I,H], ``w_down`` [El,H,I]; ``shared_gate``, ``shared_up`` [Is,H],
    ``shared_down`` [H,Is] when ``shared_intermediate > 0``; ``router.weight`` [E,H] when routed here.

    ``router``: None, ``"softmax"``, ``"sigmoid"``, or a :class:`TopKRouter` for the DeepSeek-style
    options (linear bias, score-correction bias, group-limited routing, scaling).
    ``save_context=False`` recomputes the forward's intermediates in the backward (activation
    checkpointing; the same gradients, bitwise; on the GPU the backward replays the dispatch and
    gate|up of the routed rows). ``config`` (a :class:`mok.MoeConfig`) overrides the
    planner's comm SMs, minibatch and ring of the GPU megakernel; results do not depend on it.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, topk: int, *, shared_intermediate: int = 0,
                 swiglu_limit: float | None = None, group: dist.ProcessGroup | None = None,
                 router: str | TopKRouter | None = None, save_context: bool = True, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, config: MoeConfig | None = None) -> None:
        super().__init__()
        self.num_experts = _positive_int(num_experts, "num_experts")
        self.hidden = _positive_int(hidden, "hidden")
        self.intermediate = _positive_int(intermediate, "intermediate")
        self.topk = _positive_int(topk, "topk")
        self.shared_intermediate = _positive_int(shared_intermediate, "shared_intermediate", minimum=0)
        if topk > num_experts:
            raise ValueError(f"topk={topk} must be <= num_experts={num_experts}")
        _checks.check_swiglu_limit(swiglu_limit)
        self.swiglu_limit = None if swiglu_limit is None else float(swiglu_limit)
        self.save_context = bool(save_context)
        if config is not None and not isinstance(config, MoeConfig):
            raise TypeError(f"config must be a mok.MoeConfig or None, got {type(config).__name__}")
        self.config = config
        # The group is kept by name (what the ops take); rank and size are fixed at construction.
        self.group_name = _dist.group_name_of(group)
        self.ep_size = 1 if group is None else dist.get_world_size(group)
        self.ep_rank = 0 if group is None else dist.get_rank(group)
        if num_experts % self.ep_size != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by the expert-parallel group size "
                             f"{self.ep_size}")
        self.local_experts = num_experts // self.ep_size

        factory = {"dtype": dtype, "device": device}
        El, H, I, Is = self.local_experts, hidden, intermediate, shared_intermediate
        self.w_gate = nn.Parameter(torch.empty(El, I, H, **factory))
        self.w_up = nn.Parameter(torch.empty(El, I, H, **factory))
        self.w_down = nn.Parameter(torch.empty(El, H, I, **factory))
        if Is > 0:
            self.shared_gate = nn.Parameter(torch.empty(Is, H, **factory))
            self.shared_up = nn.Parameter(torch.empty(Is, H, **factory))
            self.shared_down = nn.Parameter(torch.empty(H, Is, **factory))
        else:
            self.shared_gate = self.shared_up = self.shared_down = None

        self.router: TopKRouter | None
        if router is None or isinstance(router, TopKRouter):
            self.router = router
        elif router in ("softmax", "sigmoid"):
            self.router = TopKRouter(hidden, num_experts, topk, score=router, device=device)
        else:
            raise ValueError(f"router must be None, 'softmax', 'sigmoid' or a mok.TopKRouter, got {router!r}")
        if self.router is not None and (self.router.num_experts, self.router.topk, self.router.hidden) != (
                num_experts, topk, hidden):
            raise ValueError(f"the router is for E={self.router.num_experts}, k={self.router.topk}, "
                             f"H={self.router.hidden}; this MoE has E={num_experts}, k={topk}, H={hidden}")
        self.reset_parameters()

    @classmethod
    def from_experts(cls, experts: Sequence[nn.Module], topk: int, *, gate: str = "gate_proj", up: str = "up_proj",
                     down: str = "down_proj", shared_expert: nn.Module | None = None,
                     swiglu_limit: float | None = None, group: dist.ProcessGroup | None = None,
                     router: str | TopKRouter | None = None, save_context: bool = True,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     config: MoeConfig | None = None) -> MoE:
        """A MoE with the weights of an existing layer's experts, to swap it into a model.

        ``experts`` lists all E experts in global order, each a SwiGLU MLP
        ``down(silu(gate(x)) * up(x))`` of three bias-free ``nn.Linear`` submodules named ``gate``,
        ``up`` and ``down`` (Hugging Face's Qwen-MoE and DeepSeek naming by default; Mixtral's is
        ``gate="w1", up="w3", down="w2"``). ``shared_expert``, if any, has the same form. With a
        ``group`` of R ranks this rank takes its E/R experts. The weights are copied (in ``dtype``,
        default the experts' dtype); the router is as in the constructor, so a model's own router
        can keep routing and pass ``topk_idx``, ``topk_w`` to :meth:`forward`.
        """
        experts = list(experts)
        if not experts:
            raise ValueError("experts must list at least one expert")

        def mlp_weights(module: nn.Module, what: str) -> tuple[Tensor, Tensor, Tensor]:
            weights = []
            for role, name in (("gate", gate), ("up", up), ("down", down)):
                linear = getattr(module, name, None)
                weight = getattr(linear, "weight", None)
                if not isinstance(weight, Tensor) or weight.dim() != 2:
                    raise ValueError(f"{what} has no {role} projection {name!r} with a 2-d weight (pass {role}=...)")
                if getattr(linear, "bias", None) is not None:
                    raise ValueError(f"{what}.{name} has a bias; MoE experts are bias-free SwiGLU MLPs")
                weights.append(weight)
            g, u, d = weights
            if g.shape != u.shape or d.shape != (g.shape[1], g.shape[0]):
                raise ValueError(f"{what}: {gate} {tuple(g.shape)}, {up} {tuple(u.shape)} and {down} {tuple(d.shape)} "
                                 f"are not a SwiGLU MLP (gate and up [I, H], down [H, I])")
            return g, u, d

        routed = [mlp_weights(e, f"experts[{i}]") for i, e in enumerate(experts)]
        intermediate, hidden = routed[0][0].shape
        for i, (g, _, _) in enumerate(routed):
            if g.shape != (intermediate, hidden):
                raise ValueError(f"experts[{i}] is [I={g.shape[0]}, H={g.shape[1]}]; experts[0] is "
                                 f"[I={intermediate}, H={hidden}]")
        shared = mlp_weights(shared_expert, "shared_expert") if shared_expert is not None else None
        if shared is not None and shared[0].shape[1] != hidden:
            raise ValueError(f"shared_expert has H={shared[0].shape[1]}, the experts H={hidden}")
        module = cls(len(experts), hidden, intermediate, topk, shared_intermediate=shared[0].shape[0] if shared else 0,
                     swiglu_limit=swiglu_limit, group=group, router=router, save_context=save_context,
                     dtype=dtype if dtype is not None else routed[0][0].dtype,
                     device=device if device is not None else routed[0][0].device, config=config)
        mine = routed[module.first_expert:module.first_expert + module.local_experts]
        with torch.no_grad():
            for target, index in ((module.w_gate, 0), (module.w_up, 1), (module.w_down, 2)):
                target.copy_(torch.stack([w[index].detach().to(target.device) for w in mine]))
            if shared is not None:
                for target, weight in zip((module.shared_gate, module.shared_up, module.shared_down), shared):
                    target.copy_(weight.detach())
        return module

    @property
    def first_expert(self) -> int:
        """The global id of this rank's first expert."""
        return self.ep_rank * self.local_experts

    def reset_parameters(self) -> None:
        """Weights ~ N(0, 1/fan_in), so activations stay O(1) (the router keeps nn.Linear's init)."""
        with torch.no_grad():
            for w, fan_in in ((self.w_gate, self.hidden), (self.w_up, self.hidden), (self.w_down, self.intermediate),
                              (self.shared_gate, self.hidden), (self.shared_up, self.hidden),
                              (self.shared_down, self.shared_intermediate)):
                if w is not None:
                    w.normal_(0.0, 1.0 / math.sqrt(fan_in))

    def forward(self, x: Tensor, topk_idx: Tensor | None = None, topk_w: Tensor | None = None) -> Tensor:
        # With a group, a local failure is reported to the other ranks too (they raise, naming this one).
        _checked(self.group_name, "build_schedule", lambda: self._check_inputs(x, topk_idx, topk_w))
        rows = x.reshape(-1, self.hidden)
        if topk_idx is None or topk_w is None:
            assert self.router is not None
            topk_idx, topk_w = self.router(rows)
        else:
            topk_idx = topk_idx.reshape(-1, topk_idx.shape[-1])
            topk_w = topk_w.reshape(-1, topk_w.shape[-1])
        shared = None
        if self.shared_gate is not None:
            shared = (self.shared_gate, self.shared_up, self.shared_down)
        y = _moe(rows.to(torch.bfloat16), topk_idx, topk_w, self.w_gate, self.w_up, self.w_down, shared,
                 self.swiglu_limit, self.group_name, self.ep_size, self.save_context, self.config)
        return y.to(x.dtype).reshape(x.shape)

    def _check_inputs(self, x: object, topk_idx: object, topk_w: object) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"x must be bfloat16 or float32 (the layer computes in bf16), got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.hidden:
            raise ValueError(f"x must be [..., H={self.hidden}], got {tuple(x.shape)}")
        if topk_idx is None and topk_w is None:
            if self.router is None:
                raise TypeError("MoE.forward needs topk_idx and topk_w: this MoE has no router")
            return
        if topk_idx is None or topk_w is None:
            raise TypeError("pass both topk_idx and topk_w, or neither (to route with the module's router)")
        for name, t in (("topk_idx", topk_idx), ("topk_w", topk_w)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() < 1 or t.shape[:-1] != x.shape[:-1]:
                raise ValueError(f"{name} must be [..., k] with the leading shape of x {tuple(x.shape[:-1])}, "
                                 f"got {tuple(t.shape)}")

    def extra_repr(self) -> str:
        parts = [f"num_experts={self.num_experts}", f"hidden={self.hidden}", f"intermediate={self.intermediate}",
                 f"topk={self.topk}"]
        if self.shared_intermediate:
            parts.append(f"shared_intermediate={self.shared_intermediate}")
        if self.swiglu_limit is not None:
            parts.append(f"swiglu_limit={self.swiglu_limit}")
        if self.ep_size > 1:
            parts.append(f"experts [{self.first_expert}, {self.first_expert + self.local_experts}) on rank "
                         f"{self.ep_rank} of {self.ep_size}")
        if not self.save_context:
            parts.append("save_context=False")
        return ", ".join(parts)
