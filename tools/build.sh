#!/usr/bin/env bash
# Configures and builds MoK (the core, the mok program, the tests; the sm_90a kernels when nvcc
# is found). Extra arguments go to CMake's configure step.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$MOK_BUILD/CMakeCache.txt" ]; then
  cmake -S "$MOK_ROOT" -B "$MOK_BUILD" "${generator[@]}" "$@"
elif [ $# -gt 0 ]; then
  cmake -S "$MOK_ROOT" -B "$MOK_BUILD" "$@"
fi
cmake --build "$MOK_BUILD" -j "$MOK_JOBS"
