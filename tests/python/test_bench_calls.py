"""The GPU benchmark code (bench/impls/mok_kernels.py, bench/gemms.py) calls the package's private
GPU helpers (mok._cuda_layer, mok._cuda_kernels and its FusedForward handle), which only a GPU run
executes (the CPU tests give gemms a torch stand-in). This test binds every such call's arguments
to the helper's current signature on the CPU, so a renamed or removed parameter fails here instead
of in the next GPU benchmark (session 30 found `_shared_expert_forward(..., fp8=...)` raising
there since the parameter became `fp8_codes`).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

pytest.importorskip("torch")
from mok import _cuda_kernels, _cuda_layer  # noqa: E402  (pure Python: importable without a GPU)

BENCH = Path(__file__).resolve().parents[2] / "bench"

# What each receiver name stands for, per file.
_LAYER = lambda name: getattr(_cuda_layer, name)  # noqa: E731
_KERNELS = lambda name: getattr(_cuda_kernels, name)  # noqa: E731
_HANDLE = lambda name: getattr(_cuda_kernels.FusedForward, name)  # noqa: E731
FILES = {
    "impls/mok_kernels.py": {"_cuda_layer": _LAYER, "kernels": _KERNELS, "fused": _HANDLE},
    "gemms.py": {"k": _KERNELS},
}


def _calls() -> list[tuple[str, int, str, str, ast.Call]]:
    out = []
    for file, receivers in FILES.items():
        for node in ast.walk(ast.parse((BENCH / file).read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in receivers):
                out.append((file, node.lineno, node.func.value.id, node.func.attr, node))
    return out


def _problems(file: str, receiver: str, name: str, call: ast.Call) -> list[str]:
    try:
        target = FILES[file][receiver](name)
    except AttributeError:
        return [f"{receiver}.{name} does not exist"]
    if inspect.isclass(target):
        target = target.__init__
    params = list(inspect.signature(target).parameters.values())
    if receiver == "fused" or inspect.isfunction(target) and params and params[0].name == "self":
        params = params[1:]  # (bound method, or a class's __init__)
    kinds = {p.kind for p in params}
    problems = []
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                       inspect.Parameter.KEYWORD_ONLY)}
        problems += [f"no parameter {kw.arg!r}" for kw in call.keywords if kw.arg is not None and kw.arg not in names]
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    if not starred and inspect.Parameter.VAR_POSITIONAL not in kinds:
        positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        if len(call.args) > len(positional):
            problems.append(f"{len(call.args)} positional arguments, at most {len(positional)} taken")
    return problems


def test_the_benchmark_calls_private_gpu_helpers_at_all():
    names = {(receiver, name) for _, _, receiver, name, _ in _calls()}
    # (If the benchmark stops calling them, this test has nothing left to guard: drop it then.)
    assert ("_cuda_layer", "_shared_expert_forward") in names
    assert ("fused", "backward") in names
    assert ("k", "experts_backward") in names


@pytest.mark.parametrize("file,line,receiver,name,call", _calls(),
                         ids=lambda v: str(v) if isinstance(v, (int, str)) else "")
def test_each_private_gpu_call_of_the_benchmark_matches_its_signature(file, line, receiver, name, call):
    problems = _problems(file, receiver, name, call)
    assert not problems, f"bench/{file}:{line}: {receiver}.{name}: " + "; ".join(problems)
