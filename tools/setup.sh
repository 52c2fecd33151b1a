#!/usr/bin/env bash
# Installs what building and testing MoK needs on a fresh Debian machine (CI's kind):
# the C++ toolchain and GoogleTest from Debian, and a Python environment with PyTorch (pinned to
# the GPU machine's 2.11), the CUTLASS/CuTe headers (nvidia-cutlass wheel, pinned) and pytest.
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

if [ ! -x "$MOK_VENV/bin/python" ]; then
  echo "setup: creating the Python environment at $MOK_VENV"
  python3 -m venv "$MOK_VENV"
fi
if ! "$MOK_VENV/bin/python" -c "import torch, numpy, pytest, matplotlib, tqdm, cutlass_library" 2>/dev/null; then
  echo "setup: installing Python packages into $MOK_VENV (PyTorch is a large download, once)"
  "$MOK_VENV/bin/pip" install -q --disable-pip-version-check -r "$MOK_ROOT/requirements.txt"
fi

# CUTLASS/CuTe headers for the sm_90a kernels, from the pinned nvidia-cutlass wheel, into .deps/
# (ignored by git; the GPU script carries it to the device machine).
if command -v nvcc >/dev/null && [ ! -f "$MOK_ROOT/.deps/cutlass/include/cute/tensor.hpp" ]; then
  src="$("$MOK_VENV/bin/python" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')"
  echo "setup: copying CUTLASS headers from $src"
  mkdir -p "$MOK_ROOT/.deps/cutlass"
  rm -rf "$MOK_ROOT/.deps/cutlass/include"
  cp -r "$src" "$MOK_ROOT/.deps/cutlass/include"
fi
