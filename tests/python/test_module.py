"""mok.MoE and mok.TopKRouter: parameters, routing, drop-in shapes and dtypes, a real training loop,
and the usage example of python/README.md, run as written."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

import mok  # noqa: E402
from mok import testing  # noqa: E402


def test_parameters_and_state_dict() -> None:
    m = mok.MoE(8, 16, 12, 2, shared_intermediate=6, router="softmax")
    shapes = {name: tuple(p.shape) for name, p in m.named_parameters()}
    assert shapes == {"w_gate": (8, 12, 16), "w_up": (8, 12, 16), "w_down": (8, 16, 12), "shared_gate": (6, 16),
                      "shared_up": (6, 16), "shared_down": (16, 6), "router.weight": (8, 16)}
    assert mok.MoE(8, 16, 12, 2).shared_gate is None
    twin = mok.MoE(8, 16, 12, 2, shared_intermediate=6, router="softmax")
    twin.load_state_dict(m.state_dict())
    x = torch.randn(5, 16)
    assert torch.equal(twin(x), m(x))
    assert "num_experts=8" in repr(m) and "shared_intermediate=6" in repr(m)
    assert mok.MoE(4, 16, 8, 2, dtype=torch.bfloat16).w_gate.dtype == torch.bfloat16


def test_softmax_router() -> None:
    torch.manual_seed(0)
    router = mok.TopKRouter(16, 8, 3, score="softmax", norm_topk_prob=False)
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    idx, w = router(x)
    probs = torch.softmax(x.float() @ router.weight.t(), dim=-1)
    expected_w, expected_idx = probs.topk(3, dim=-1)
    assert torch.equal(idx, expected_idx) and torch.allclose(w, expected_w)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    normed = mok.TopKRouter(16, 8, 3)
    normed.load_state_dict(router.state_dict())
    assert torch.allclose(normed(x)[1], expected_w / expected_w.sum(-1, keepdim=True))


def test_deepseek_style_sigmoid_router() -> None:
    """Sigmoid scores, a score-correction bias for selection only, group-limited routing, scaling."""
    torch.manual_seed(1)
    E, G, topk_groups, k = 8, 4, 2, 2
    router = mok.TopKRouter(16, E, k, score="sigmoid", bias=True, correction_bias=True, num_groups=G,
                            topk_groups=topk_groups, routed_scaling_factor=2.5)
    with torch.no_grad():
        router.bias.normal_()
        router.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, E))
    x = torch.randn(6, 16)
    idx, w = router(x)
    scores = torch.sigmoid(x @ router.weight.t() + router.bias)
    choice = scores + router.e_score_correction_bias
    group_score = choice.view(6, G, E // G).topk(2, dim=-1).values.sum(-1)
    groups = group_score.topk(topk_groups, dim=-1).indices
    allowed = torch.zeros(6, G, dtype=torch.bool).scatter_(1, groups, True).repeat_interleave(E // G, dim=1)
    expected_idx = choice.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices
    chosen = scores.gather(1, expected_idx)
    assert torch.equal(idx, expected_idx)
    assert torch.allclose(w, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    assert "e_score_correction_bias" in dict(router.named_buffers())
    w.sum().backward()
    assert router.weight.grad is not None and router.bias.grad is not None


def test_module_is_the_functional_layer() -> None:
    """forward(x) with a router == forward(x, router(x)) == mok.moe on the same tensors, bitwise;
    [B,S,H] fp32 input comes back as [B,S,H] fp32."""
    torch.manual_seed(2)
    m = mok.MoE(6, 16, 8, 2, shared_intermediate=4, swiglu_limit=3.0, router="sigmoid")
    x = torch.randn(3, 4, 16)
    y = m(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    rows = x.reshape(-1, 16)
    idx, w = m.router(rows)
    assert torch.equal(m(x, idx.view(3, 4, 2), w.view(3, 4, 2)), y)
    y_fn = mok.moe(rows.bfloat16(), idx, w, m.w_gate, m.w_up, m.w_down, (m.shared_gate, m.shared_up, m.shared_down),
                   swiglu_limit=3.0)
    assert torch.equal(y_fn.float().view(3, 4, 16), y)
    xb = x.bfloat16()
    assert m(xb).dtype == torch.bfloat16


class _Expert(torch.nn.Module):
    """An expert as models write it (Hugging Face Qwen-MoE / DeepSeek naming, or Mixtral's w1/w3/w2)."""

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str] = ("gate_proj", "up_proj",
                                                                                   "down_proj")) -> None:
        super().__init__()
        self.names = names
        setattr(self, names[0], torch.nn.Linear(hidden, intermediate, bias=False))
        setattr(self, names[1], torch.nn.Linear(hidden, intermediate, bias=False))
        setattr(self, names[2], torch.nn.Linear(intermediate, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = (getattr(self, n) for n in self.names)
        return d(F.silu(g(x)) * u(x))


def test_from_experts_swaps_a_models_experts() -> None:
    """MoE.from_experts copies a model's per-expert MLPs (and shared expert): its output is the
    model's own top-k sum over those modules, in both namings; the copies are independent."""
    torch.manual_seed(7)
    E, H, I, k = 6, 16, 12, 2
    for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        experts = torch.nn.ModuleList(_Expert(H, I, names) for _ in range(E))
        shared = _Expert(H, 8, names)
        m = mok.MoE.from_experts(experts, k, gate=names[0], up=names[1], down=names[2], shared_expert=shared)
        assert (m.num_experts, m.hidden, m.intermediate, m.shared_intermediate) == (E, H, I, 8)
        x = torch.randn(10, H)
        idx = torch.stack([torch.randperm(E)[:k] for _ in range(10)])
        w = torch.softmax(torch.randn(10, k), dim=-1)
        with torch.no_grad():
            want = shared(x) + torch.stack([sum(w[t, j] * experts[int(idx[t, j])](x[t]) for j in range(k))
                                            for t in range(10)])
            got = m(x, idx, w)
        assert testing.relative_error(got, want) < 2e-2
        with torch.no_grad():
            experts[0].get_submodule(names[0]).weight.zero_()
        assert m.w_gate[0].abs().sum() > 0, "from_experts must copy the weights, not alias them"


def test_from_experts_names_what_does_not_fit() -> None:
    experts = [_Expert(16, 8) for _ in range(4)]
    with pytest.raises(ValueError, match=r"experts\[0\] has no gate projection 'w1'"):
        mok.MoE.from_experts(experts, 2, gate="w1")
    biased = _Expert(16, 8)
    biased.up_proj = torch.nn.Linear(16, 8, bias=True)
    with pytest.raises(ValueError, match=r"experts\[3\].up_proj has a bias"):
        mok.MoE.from_experts(experts[:3] + [biased], 2)
    with pytest.raises(ValueError, match=r"experts\[2\] is \[I=4, H=16\]"):
        mok.MoE.from_experts(experts[:2] + [_Expert(16, 4)], 2)
    with pytest.raises(ValueError, match="at least one expert"):
        mok.MoE.from_experts([], 2)


def test_gradients_reach_every_parameter_and_match_the_reference() -> None:
    torch.manual_seed(3)
    m = mok.MoE(4, 16, 8, 2, shared_intermediate=8, router="softmax")
    x = torch.randn(9, 16, requires_grad=True)
    m(x).square().sum().backward()
    ours = {name: p.grad.clone() for name, p in m.named_parameters()}
    d_x = x.grad.clone()

    x.grad = None
    m.zero_grad()
    idx, w = m.router(x)
    y = testing.moe_reference(x.bfloat16(), idx, w, m.w_gate, m.w_up, m.w_down,
                              (m.shared_gate, m.shared_up, m.shared_down), compute_dtype=torch.float64)
    y.float().square().sum().backward()
    for name, p in m.named_parameters():
        err = testing.relative_error(ours[name], p.grad)
        assert err < 2e-2, f"{name}: rel error {err:.3e}"
    assert testing.relative_error(d_x, x.grad) < 2e-2


def test_training_loop_reduces_loss() -> None:
    """Optimizer steps on a small regression task: the loss goes down, and a rerun gives the same losses."""

    def train() -> list[float]:
        torch.manual_seed(4)
        teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        model = torch.nn.Sequential(torch.nn.LayerNorm(16), mok.MoE(8, 16, 24, 2, shared_intermediate=8,
                                                                    router="softmax"))
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
        losses = []
        for _ in range(40):
            x = torch.randn(64, 16)
            with torch.no_grad():
                target = teacher(x)
            loss = F.mse_loss(model(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    losses = train()
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert train() == losses


def readme_example() -> str:
    text = (ROOT / "python" / "README.md").read_text()
    match = re.search(r"<!-- usage -->\s*```python\n(.*?)```", text, re.S)
    assert match, "python/README.md has no usage example marked <!-- usage -->"
    return match.group(1)


def test_readme_usage_example_runs_as_written() -> None:
    code = readme_example()
    assert len(code.strip().splitlines()) <= 6
    exec(compile(code, "python/README.md", "exec"), {})
