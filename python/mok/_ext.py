"""The compiled extension ``mok._C``, loaded once, with an error that says how to build it."""

from __future__ import annotations

import importlib

try:
    _C = importlib.import_module("mok._C")
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "mok._C, MoK's compiled extension, is not built or does not load "
        f"({exc}). Install the package with `pip install .` from the repository root, or build it in "
        "place with `cmake -S . -B build -DMOK_BUILD_PYTHON=ON -DPython_EXECUTABLE=$(which python) && "
        "cmake --build build` and put python/ on PYTHONPATH. (mok.testing works without it.)"
    ) from exc

__all__ = ["_C"]
