"""MoK (Mixture-of-Kittens): a deterministic mixture-of-experts layer for PyTorch.

``mok.MoE`` is a drop-in ``nn.Module`` (routed SwiGLU experts, an optional shared expert and an
optional router); ``mok.moe`` the same layer as a differentiable function; ``mok.get_workspace`` ->
``mok.build_schedule`` -> ``mok.forward`` -> ``mok.backward`` the explicit passes. The ops are
``torch.ops.mok.*`` (:mod:`mok.ops`). ``mok.testing`` is a pure-torch reference of the layer that
needs no compiled code. See python/README.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

try:
    from . import _ext  # noqa: F401  (mok._C, the compiled extension)
except ImportError as _exc:
    # mok.testing (pure torch) stays importable without the extension; everything else says why
    # it is missing when first used.
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None
    from . import ops
    from .functional import (
        ForwardContext,
        Gradients,
        MoeConfig,
        Schedule,
        Workspace,
        backward,
        build_schedule,
        clear_workspace_cache,
        create_workspace,
        forward,
        get_workspace,
        moe,
        recompute_forward_context,
    )
    from .layer import MoE, TopKRouter

__all__ = [
    "MoE",
    "TopKRouter",
    "moe",
    "MoeConfig",
    "Workspace",
    "Schedule",
    "ForwardContext",
    "Gradients",
    "get_workspace",
    "create_workspace",
    "clear_workspace_cache",
    "build_schedule",
    "forward",
    "backward",
    "recompute_forward_context",
    "ops",
    "testing",
]


def __getattr__(name: str) -> object:
    if name == "testing":
        import importlib

        return importlib.import_module(".testing", __name__)
    if _IMPORT_ERROR is not None and name in __all__:
        raise ImportError(f"mok.{name} needs the compiled extension: {_IMPORT_ERROR}") from _IMPORT_ERROR
    raise AttributeError(f"module 'mok' has no attribute {name!r}")
