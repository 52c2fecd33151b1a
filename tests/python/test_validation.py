"""Bad input raises TypeError (wrong type or dtype) or ValueError (anything else), naming the problem."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import mok  # noqa: E402
from mok import testing  # noqa: E402

T, E, H, I, K, IS = 6, 4, 16, 8, 2, 8


def problem() -> dict[str, Any]:
    p = testing.random_problem(T, E, H, I, K, shared_intermediate=IS, seed=1)
    return dict(x=p.x, topk_idx=p.topk_idx, topk_w=p.topk_w, w_gate=p.w_gate, w_up=p.w_up, w_down=p.w_down,
                shared=p.shared)


def call_moe(**changes: Any) -> torch.Tensor:
    args = problem()
    args.update(changes)
    swiglu_limit = args.pop("swiglu_limit", None)
    return mok.moe(args["x"], args["topk_idx"], args["topk_w"], args["w_gate"], args["w_up"], args["w_down"],
                   args["shared"], swiglu_limit=swiglu_limit)


BAD_MOE_INPUTS: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], type, str]] = [
    ("x dtype", lambda a: dict(x=a["x"].float()), TypeError, "x must be bfloat16, got torch.float32"),
    ("x type", lambda a: dict(x=a["x"].tolist()), TypeError, "x must be a torch.Tensor, got list"),
    ("topk_w dtype", lambda a: dict(topk_w=a["topk_w"].bfloat16()), TypeError,
     "topk_w must be float32, got torch.bfloat16"),
    ("topk_idx dtype", lambda a: dict(topk_idx=a["topk_idx"].float()), TypeError,
     "topk_idx must be int32 or int64, got torch.float32"),
    ("weight dtype", lambda a: dict(w_up=a["w_up"].half()), TypeError,
     "w_up must be bfloat16 or float32, got torch.float16"),
    ("x shape", lambda a: dict(x=a["x"].unsqueeze(0)), ValueError, "x must have shape [T, H], got (1, 6, 16)"),
    ("w_up shape", lambda a: dict(w_up=a["w_up"][:, :-1]), ValueError,
     "w_up must have shape [El=4, I=8, H=16], got (4, 7, 16)"),
    ("w_down shape", lambda a: dict(w_down=a["w_down"].transpose(1, 2).contiguous()), ValueError,
     "w_down must have shape [El=4, H=16, I=8], got (4, 8, 16)"),
    ("w_gate hidden", lambda a: dict(w_gate=a["w_gate"][..., :-1].contiguous()), ValueError,
     "w_gate must have shape [El, I, H=16], got (4, 8, 15)"),
    ("top-k mismatch", lambda a: dict(topk_w=torch.ones(T, K + 1)), ValueError,
     "top-k mismatch: topk_idx has k=2 columns, topk_w has k=3"),
    ("topk_w tokens", lambda a: dict(topk_w=a["topk_w"][:-1]), ValueError, "topk_w must have shape [T=6, k]"),
    ("topk_idx tokens", lambda a: dict(topk_idx=a["topk_idx"][:-1]), ValueError,
     "topk_idx has 5 rows, x has T=6 tokens"),
    ("expert id too large", lambda a: dict(topk_idx=a["topk_idx"].index_fill(0, torch.tensor([3]), E)), ValueError,
     "topk_idx[3, 0] = 4 is not an expert id in [0, 4)"),
    ("negative expert id", lambda a: dict(topk_idx=a["topk_idx"].index_fill(0, torch.tensor([0]), -2)), ValueError,
     "topk_idx[0, 0] = -2 is not an expert id in [0, 4) nor -1 (no expert)"),
    ("strided weight", lambda a: dict(w_down=a["w_down"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "w_down must be contiguous (row-major [El=4, H=16, I=8])"),
    ("device", lambda a: dict(w_gate=a["w_gate"].to("meta")), ValueError,
     "w_gate is on meta but x is on cpu; every tensor of the layer must be on one device"),
    ("shared arity", lambda a: dict(shared=a["shared"][:2]), TypeError,
     "shared must be None or a (s_gate, s_up, s_down) tuple of tensors"),
    ("shared partial", lambda a: dict(shared=(a["shared"][0], None, a["shared"][2])), ValueError,
     "the shared expert needs all three of s_gate, s_up, s_down (or none)"),
    ("shared shape", lambda a: dict(shared=(a["shared"][0], a["shared"][1][:-1], a["shared"][2])), ValueError,
     "s_up must have shape [Is=8, H=16], got (7, 16)"),
    ("limit value", lambda a: dict(swiglu_limit=-1.0), ValueError, "swiglu_limit must be a finite value > 0"),
    ("limit type", lambda a: dict(swiglu_limit="7"), TypeError, "swiglu_limit must be a float or None, got str"),
    ("NaN in x", lambda a: dict(x=a["x"].index_put((torch.tensor([4]), torch.tensor([9])),
                                                    torch.tensor(float("nan"), dtype=torch.bfloat16))),
     ValueError, "x[4][9] is not finite (nan)"),
    ("inf in topk_w", lambda a: dict(topk_w=a["topk_w"].index_fill(0, torch.tensor([2]), float("-inf"))), ValueError,
     "topk_w[2][0] is not finite (-inf)"),
    ("NaN in a weight", lambda a: dict(w_down=a["w_down"].index_fill(2, torch.tensor([5]), float("nan"))), ValueError,
     "w_down[0][0][5] is not finite (nan)"),
    ("inf in the shared expert", lambda a: dict(shared=(a["shared"][0], a["shared"][1].index_fill(0, torch.tensor([7]),
                                                                                                   float("inf")),
                                                        a["shared"][2])), ValueError, "s_up[7][0] is not finite (inf)"),
]


@pytest.mark.parametrize("name, change, error, message", BAD_MOE_INPUTS, ids=[b[0] for b in BAD_MOE_INPUTS])
def test_moe_rejects(name: str, change: Callable[[dict[str, Any]], dict[str, Any]], error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call_moe(**change(problem()))


def test_module_rejects() -> None:
    m = mok.MoE(E, H, I, K)
    x = torch.randn(T, H)
    with pytest.raises(TypeError, match="this MoE has no router"):
        m(x)
    with pytest.raises(TypeError, match="pass both topk_idx and topk_w, or neither"):
        m(x, torch.zeros(T, K, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be bfloat16 or float32"):
        m(x.half(), torch.zeros(T, K, dtype=torch.int64), torch.ones(T, K))
    with pytest.raises(ValueError, match=re.escape("x must be [..., H=16], got (6, 15)")):
        m(x[:, 1:], torch.zeros(T, K, dtype=torch.int64), torch.ones(T, K))
    with pytest.raises(ValueError, match="topk_idx must be \\[..., k\\] with the leading shape of x"):
        m(x, torch.zeros(T + 1, K, dtype=torch.int64), torch.ones(T, K))
    with pytest.raises(ValueError, match="router must be None, 'softmax', 'sigmoid'"):
        mok.MoE(E, H, I, K, router="relu")
    with pytest.raises(ValueError, match="topk=5 must be <= num_experts=4"):
        mok.MoE(E, H, I, 5)
    with pytest.raises(TypeError, match="hidden must be an int, got float"):
        mok.MoE(E, 16.0, I, K)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the router is for E=8"):
        mok.MoE(E, H, I, K, router=mok.TopKRouter(H, 8, K))
    with pytest.raises(ValueError, match="num_experts=6 must be divisible by num_groups=4"):
        mok.TopKRouter(H, 6, K, num_groups=4)


def test_functional_api_rejects() -> None:
    a = problem()
    kwargs = dict(device="cpu", num_local_tokens=T, hidden=H, intermediate=I, num_experts=E, topk=K,
                  shared_intermediate=IS)
    ws = mok.get_workspace(None, None, **kwargs)
    with pytest.raises(TypeError, match="num_local_tokens must be an int, got float"):
        mok.get_workspace(None, None, **{**kwargs, "num_local_tokens": 6.0})
    with pytest.raises(ValueError, match="topk must be >= 1, got 0"):
        mok.get_workspace(None, None, **{**kwargs, "topk": 0})
    with pytest.raises(TypeError, match="config must be a mok.MoeConfig or None, got dict"):
        mok.get_workspace({}, None, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="minibatch_rows must be a positive multiple of the row tile 128"):
        mok.get_workspace(mok.MoeConfig(minibatch_rows=100), None, **kwargs)
    with pytest.raises(ValueError, match=re.escape("topk_idx must have shape [T=6, k=2], got (5, 2)")):
        mok.build_schedule(ws, a["topk_idx"][:-1])
    schedule = mok.build_schedule(ws, a["topk_idx"])
    with pytest.raises(TypeError, match="workspace must be a mok.Workspace"):
        mok.forward(None, schedule, a["x"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"], a["shared"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="schedule must be a mok.Schedule"):
        mok.forward(ws, tuple(schedule), a["x"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"], a["shared"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"the inputs have Is \(shared intermediate\) = 0, the workspace was made for 8"):
        mok.forward(ws, schedule, a["x"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"])
    other = mok.get_workspace(None, None, **{**kwargs, "num_local_tokens": T - 1})
    with pytest.raises(ValueError, match=r"the inputs have T \(tokens\) = 6, the workspace was made for 5"):
        mok.forward(other, schedule, a["x"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"], a["shared"])
    y, ctx = mok.forward(ws, schedule, a["x"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"], a["shared"])
    with pytest.raises(TypeError, match="dy must be bfloat16, got torch.float32"):
        mok.backward(ws, schedule, ctx, y.float(), a["x"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"],
                     a["shared"])
    with pytest.raises(ValueError, match=re.escape("context.x_rows must have shape")):
        bad = ctx._replace(x_rows=ctx.x_rows[:-1])
        mok.backward(ws, schedule, bad, y, a["x"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"], a["shared"])
    with pytest.raises(ValueError, match="the inputs are on meta, the workspace on cpu"):
        mok.forward(ws, schedule, *(t.to("meta") for t in (a["x"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"])),
                    tuple(t.to("meta") for t in a["shared"]))
    with pytest.raises(ValueError, match="precision='fp8' runs on the GPU only"):
        mok.get_workspace(mok.MoeConfig(precision="fp8"), None, **kwargs)
    with pytest.raises(ValueError, match="the schedule is for 4 local experts, the weights have El=2"):
        torch.ops.mok.forward(a["x"], a["topk_w"], a["w_gate"][:2], a["w_up"][:2], a["w_down"][:2], None, None, None,
                              list(schedule)[:7], None, "", True)


def test_cuda_stage_checks_then_names_the_gpu_path() -> None:
    """The stages' CUDA implementations run the shared checks, then raise NotImplementedError naming
    the GPU layer (no silent fallback)."""
    a = problem()
    schedule = list(torch.ops.mok.build_schedule(a["topk_idx"], E, ""))
    forward_args = (a["x"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"], *a["shared"], schedule, None, "", True)
    cuda_forward = mok.ops._cuda_refused("forward", mok.ops.OPS["forward"][2])
    with pytest.raises(NotImplementedError, match=re.escape(
            "torch.ops.mok.forward (a stage of the CPU backend's explicit passes) runs on CPU tensors only; on the GPU "
            "the explicit passes are mok.build_schedule / mok.forward / mok.backward on a GPU workspace")):
        cuda_forward(*forward_args)
    with pytest.raises(ValueError, match="w_up is on meta but x is on cpu"):
        cuda_forward(a["x"], a["topk_w"], a["w_gate"], a["w_up"].to("meta"), *forward_args[4:])
    for name, (op, _, check) in mok.ops.OPS.items():
        assert callable(check)
        assert op._backend_fns.get("cuda") is not None, f"{name} has no CUDA implementation registered"


def test_moe_config_is_checked_and_changes_no_bit() -> None:
    """mok.moe(config=...) / mok.MoE(config=...): the planner's overrides are checked on every device
    (the CPU stages do not use them) and change no result."""
    a = problem()
    args = (a["x"], a["topk_idx"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"], a["shared"])
    plain = mok.moe(*args)
    tuned = mok.moe(*args, config=mok.MoeConfig(minibatch_rows=128, ring_rows=256))
    assert torch.equal(plain, tuned)
    assert torch.equal(plain, mok.moe(*args, config=mok.MoeConfig(fused_backward=True)))
    with pytest.raises(TypeError, match="MoeConfig.fused_backward must be a bool or None, got int"):
        mok.moe(*args, config=mok.MoeConfig(fused_backward=1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="minibatch_rows must be a positive multiple of the row tile 128, got 100"):
        mok.moe(*args, config=mok.MoeConfig(minibatch_rows=100))
    with pytest.raises(ValueError, match="ring_rows must be a positive multiple of minibatch_rows=128, got 200"):
        mok.moe(*args, config=mok.MoeConfig(minibatch_rows=128, ring_rows=200))
    with pytest.raises(TypeError, match="MoeConfig.comm_sms must be an int or None, got float"):
        mok.moe(*args, config=mok.MoeConfig(comm_sms=1.5))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a mok.MoeConfig or None, got dict"):
        mok.moe(*args, config={"comm_sms": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a mok.MoeConfig or None, got int"):
        mok.MoE(E, H, I, K, config=3)  # type: ignore[arg-type]
    m = mok.MoE(E, H, I, K, config=mok.MoeConfig(minibatch_rows=100))
    with pytest.raises(ValueError, match="minibatch_rows must be a positive multiple"):
        m(torch.randn(T, H), a["topk_idx"], a["topk_w"])


def test_fp8_precision_is_checked_and_runs_on_the_gpu_only() -> None:
    """MoeConfig(precision=...): an unknown precision, and fp8 with partial 128-column scale blocks,
    are refused by name; fp8 on CPU tensors says it runs on the GPU only (no silent bf16 result)."""
    a = problem()
    args = (a["x"], a["topk_idx"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"], a["shared"])
    with pytest.raises(ValueError, match=r"MoeConfig.precision must be one of \(None, 'bf16', 'fp8', 'fp8_dgrad'\), "
                                         "got 'fp16'"):
        mok.moe(*args, config=mok.MoeConfig(precision="fp16"))
    with pytest.raises(ValueError, match="precision='fp8' needs whole 128-column scale blocks: hidden 16, "
                                         "intermediate 8, shared intermediate 8 is not a multiple of 128"):
        mok.moe(*args, config=mok.MoeConfig(precision="fp8"))
    assert torch.equal(mok.moe(*args), mok.moe(*args, config=mok.MoeConfig(precision="bf16")))
    p = testing.random_problem(4, 4, 128, 128, 2, shared_intermediate=128, seed=3)
    for precision in ("fp8", "fp8_dgrad"):
        with pytest.raises(NotImplementedError, match=f"precision='{precision}' runs on the GPU only"):
            mok.moe(p.x, p.topk_idx, p.topk_w, p.w_gate, p.w_up, p.w_down, p.shared,
                    config=mok.MoeConfig(precision=precision))
    with pytest.raises(ValueError, match="precision='fp8_dgrad' needs whole 128-column scale blocks"):
        mok.moe(*args, config=mok.MoeConfig(precision="fp8_dgrad"))


def test_a_non_finite_gradient_is_named() -> None:
    """NaN in dy (the backward's input) is named like NaN in the forward's inputs."""
    a = problem()
    x = a["x"].clone().requires_grad_(True)
    y = mok.moe(x, a["topk_idx"], a["topk_w"], a["w_gate"], a["w_up"], a["w_down"], a["shared"])
    dy = torch.ones_like(y)
    dy[1, 3] = float("nan")
    with pytest.raises(ValueError, match=re.escape("dy[1][3] is not finite (nan)")):
        y.backward(dy)
