"""Implementation registry: every module in this package registers the implementations it provides.

An implementation is a function ``build(problem, ctx) -> Runner`` registered with
:func:`register_impl` under a name (the ``impl`` column of the results) and a case kind
(``"layer"`` or ``"experts"``). Adding one is adding a file here; nothing else changes.

``build`` may raise :class:`Skip` (the impl cannot run this case on this machine: missing package,
unsupported precision, too little memory); the reason is recorded and the run goes on. Any other
exception is recorded as an error of that (case, impl). Modules outside this package can register
impls too: name them in the environment variable ``MOK_BENCH_EXTRA_IMPLS`` (comma-separated).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


class Skip(Exception):
    """This implementation does not run for this case here; the message says why."""


@dataclass
class Runner:
    """One implementation bound to one problem.

    ``forward()`` runs one forward pass and returns an opaque state (keeping whatever the backward
    needs, e.g. the autograd graph). ``output(state)`` is the layer output ``y``. ``backward(state)``
    runs one backward pass with ``problem.d_y`` and returns the gradients of ``problem.grad_targets``
    in order (None where an input gets none). Each state is used for at most one backward.
    """

    forward: Callable[[], Any]
    output: Callable[[Any], torch.Tensor]
    backward: Callable[[Any], Sequence[torch.Tensor | None]] | None
    # Why there is no backward (backward is None): its rows are skipped with this reason, the
    # forward is still checked and timed.
    no_backward_reason: str = ""


@dataclass
class BenchContext:
    """What impls may use besides the problem: the runtime, run options and resources kept across cases."""

    runtime: Any  # bench.runtime.Runtime
    options: Any  # argparse.Namespace of bench.run
    cases: list[Any] = field(default_factory=list)  # every case selected for this run (to size shared resources)
    resources: dict[str, Any] = field(default_factory=dict)  # e.g. a symmetric-memory workspace


@dataclass(frozen=True)
class ImplSpec:
    name: str
    kind: str  # "layer" | "experts"
    build: Callable[[Any, BenchContext], Runner]
    is_baseline: bool  # baselines are what "ratio to the best baseline" compares against
    memory_bytes: Callable[[Any, "BenchContext"], int] | None  # device bytes beyond the problem; None = unknown
    description: str
    by_default: bool = True  # False: runs only when named (--impls), e.g. a study, not the benchmark of record


IMPLS: dict[str, ImplSpec] = {}


def register_impl(
    name: str,
    kind: str,
    *,
    is_baseline: bool = True,
    memory_bytes: Callable[[Any, BenchContext], int] | None = None,
    description: str = "",
    by_default: bool = True,
) -> Callable[[Callable[[Any, BenchContext], Runner]], Callable[[Any, BenchContext], Runner]]:
    """Decorator registering ``build`` as implementation ``name`` of case kind ``kind``."""
    if kind not in ("layer", "experts"):
        raise ValueError(f"unknown kind {kind!r}")

    def decorate(build: Callable[[Any, BenchContext], Runner]) -> Callable[[Any, BenchContext], Runner]:
        key = f"{kind}:{name}"
        if key in IMPLS:
            raise ValueError(f"implementation {name!r} registered twice for kind {kind!r}")
        summary = description or (build.__doc__ or "").strip().split("\n")[0]
        IMPLS[key] = ImplSpec(name, kind, build, is_baseline, memory_bytes, summary, by_default)
        return build

    return decorate


EXTRA_IMPLS_ENV = "MOK_BENCH_EXTRA_IMPLS"

# Modules imported first, so that rows and plots list the baselines in this order; others follow by name.
PREFERRED_ORDER = ("torch_a2a", "symm_a2a", "deepep", "torch_grouped_mm", "mok_kernels")


def load_impls() -> dict[str, ImplSpec]:
    """Import every module of this package (each registers its impls) and return the registry."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    names.sort(key=lambda n: (PREFERRED_ORDER.index(n) if n in PREFERRED_ORDER else len(PREFERRED_ORDER), n))
    for name in names:
        importlib.import_module(f"{__name__}.{name}")
    # Out-of-tree impls: comma-separated importable module names that call register_impl.
    for module in filter(None, os.environ.get(EXTRA_IMPLS_ENV, "").split(",")):
        importlib.import_module(module.strip())
    return IMPLS


def impls_for(kind: str, names: Sequence[str] | None = None) -> list[ImplSpec]:
    """Registered impls of a kind in registration order: those named in ``names``, or without names
    every one registered ``by_default``."""
    specs = [s for s in IMPLS.values() if s.kind == kind]
    if names:
        return [s for s in specs if s.name in names]
    return [s for s in specs if s.by_default]


def autograd_runner(problem: Any, forward: Callable[[], torch.Tensor]) -> Runner:
    """Runner for an implementation written with torch autograd: backward = autograd.grad with d_y."""
    targets = problem.grad_targets

    def backward(y: torch.Tensor) -> Sequence[torch.Tensor | None]:
        return torch.autograd.grad(y, targets, problem.d_y, allow_unused=True)

    return Runner(forward=forward, output=lambda y: y, backward=backward)
