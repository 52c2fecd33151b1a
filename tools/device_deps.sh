#!/usr/bin/env bash
# The dependencies the device tool carries, trimmed to fit its 64 MiB (tracked tree ~33 MB):
# .devdeps/ (ignored) holds the CUTLASS/CuTe headers that the CUDA sources include (found with
# nvcc -M over every .cu file; 6 of the wheel's 26 MB), GoogleTest, pybind11 and pytest, all
# copied from .deps (tools/setup.sh). tools/gpu.sh uses .devdeps where .deps is absent.
#   bash tools/device_deps.sh          # then carry [".devdeps"] (and ".ab" for an A/B)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
src="$ROOT/.deps"
dst="$ROOT/.devdeps"
[ -f "$src/cutlass/include/cute/tensor.hpp" ] || { echo "device_deps: run tools/setup.sh first (.deps)"; exit 1; }
rm -rf "$dst" && mkdir -p "$dst/cutlass/include"
list="$(mktemp)"
for f in $(git ls-files 'cuda/*.cu' 'cuda/*.cpp' 'python/csrc/*.cpp'); do
  deps="$(nvcc -std=c++17 -arch=sm_90a -M -I cuda/include -I include -isystem "$src/cutlass/include" \
            -isystem "$src/gtest/include" -isystem "$src/pybind11/include" $(python3 -c 'import sysconfig; print("-I" + sysconfig.get_paths()["include"])') "$f" 2>&1)" ||
    { echo "device_deps: nvcc -M failed on $f:"; echo "$deps" | tail -5; exit 1; }
  echo "$deps" | tr ' \\' '\n\n' | grep -o "$src/cutlass/include/.*" >> "$list" || true
done
sort -u "$list" | sed "s|^$src/cutlass/include/||" | (cd "$src/cutlass/include" && xargs cp --parents -t "$dst/cutlass/include")
rm -f "$list"
for d in gtest pybind11 pypkgs; do [ -d "$src/$d" ] && cp -r "$src/$d" "$dst/$d"; done
echo ".devdeps: $(du -sh "$dst" | cut -f1) ($(find "$dst/cutlass" -type f | wc -l) CUTLASS headers)"
