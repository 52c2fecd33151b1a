#!/usr/bin/env bash
# Configures and builds MoK: the core, the mok program, the tests, the sm_90a kernels when nvcc is
# found, and the Python extension mok._C (written into python/mok/) when the Python environment
# of tools/setup.sh exists. Extra arguments go to CMake's configure step.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
args=("$@")
if [ -x "$MOK_VENV/bin/python" ] && "$MOK_VENV/bin/python" -c "import pybind11" 2>/dev/null; then
  args+=(-DMOK_BUILD_PYTHON=ON -DPython_EXECUTABLE="$MOK_VENV/bin/python")
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$MOK_BUILD/CMakeCache.txt" ]; then
  cmake -S "$MOK_ROOT" -B "$MOK_BUILD" "${generator[@]}" "${args[@]}"
elif [ ${#args[@]} -gt 0 ]; then
  cmake -S "$MOK_ROOT" -B "$MOK_BUILD" "${args[@]}" > /dev/null
fi
cmake --build "$MOK_BUILD" -j "$MOK_JOBS"
