#!/usr/bin/env bash
# Installs what building and testing MoK needs on a fresh Debian machine (CI's kind): the C++
# toolchain and GoogleTest from Debian, the CUTLASS/CuTe headers (pinned nvidia-cutlass wheel) when
# nvcc is there, and (unless --build-only) a Python environment with PyTorch (pinned to the GPU
# machine's 2.11) and pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(g++)
command -v ninja >/dev/null || need_apt+=(ninja-build)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
command -v python3 >/dev/null || need_apt+=(python3)
python3 -c "import venv, ensurepip" 2>/dev/null || need_apt+=(python3-venv)
[ -n "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)" ] &&
  [ -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || need_apt+=(python3-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} from Debian"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null && SUDO="sudo" || { echo "setup: need root (or sudo) to install ${need_apt[*]}"; exit 1; }
  fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

# CUTLASS/CuTe headers for the sm_90a kernels, from the pinned nvidia-cutlass wheel (downloaded,
# not installed: only its headers are used) into .deps/ (ignored by git; the GPU script carries it).
CUTLASS_WHEEL="nvidia-cutlass==4.2.0.0"
if command -v nvcc >/dev/null && [ ! -f "$MOK_ROOT/.deps/cutlass/include/cute/tensor.hpp" ]; then
  echo "setup: fetching the CUTLASS headers ($CUTLASS_WHEEL)"
  rm -rf "$MOK_ROOT/.deps/wheels" "$MOK_ROOT/.deps/cutlass"
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: "$CUTLASS_WHEEL" \
    -d "$MOK_ROOT/.deps/wheels"
  python3 - "$MOK_ROOT" <<'PY'
import pathlib, sys, zipfile
root = pathlib.Path(sys.argv[1])
wheel = next((root / ".deps" / "wheels").glob("nvidia_cutlass-*.whl"))
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = root / ".deps" / "cutlass" / "include" / name[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
PY
fi

# The Python environment (tests, benchmarks, the package); `--build-only` skips it.
[ "${1:-}" = "--build-only" ] && exit 0
if [ ! -x "$MOK_VENV/bin/python" ]; then
  echo "setup: creating the Python environment at $MOK_VENV"
  python3 -m venv "$MOK_VENV"
fi
if ! "$MOK_VENV/bin/python" -c "import torch, numpy, pytest, matplotlib, tqdm, pybind11" 2>/dev/null; then
  echo "setup: installing Python packages into $MOK_VENV (PyTorch is a large download, once)"
  "$MOK_VENV/bin/pip" install -q --disable-pip-version-check -r "$MOK_ROOT/requirements.txt"
fi


# pybind11's headers and CMake files for the GPU machine, which has no internet: tools/gpu.sh builds
# mok._C there from .deps/pybind11 (carried with .deps).
if command -v nvcc >/dev/null && [ ! -f "$MOK_ROOT/.deps/pybind11/share/cmake/pybind11/pybind11Config.cmake" ]; then
  src="$("$MOK_VENV/bin/python" -c 'import os, pybind11; print(os.path.dirname(pybind11.__file__))')"
  rm -rf "$MOK_ROOT/.deps/pybind11" && cp -r "$src" "$MOK_ROOT/.deps/pybind11"
fi

# pytest (pure Python) for the GPU machine's python3, which may not have it: tools/gpu.sh puts
# .deps/pypkgs on PYTHONPATH for its pytest step when python3 cannot import pytest.
if command -v nvcc >/dev/null && [ ! -d "$MOK_ROOT/.deps/pypkgs/pytest" ]; then
  site="$("$MOK_VENV/bin/python" -c 'import os, pytest; print(os.path.dirname(os.path.dirname(pytest.__file__)))')"
  mkdir -p "$MOK_ROOT/.deps/pypkgs"
  for pkg in pytest _pytest pluggy iniconfig packaging py.py; do
    if [ -e "$site/$pkg" ]; then cp -r "$site/$pkg" "$MOK_ROOT/.deps/pypkgs/"; fi
  done
fi
