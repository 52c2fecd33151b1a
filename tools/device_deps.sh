#!/usr/bin/env bash
# The dependencies the device tool carries, trimmed to fit its 64 MiB (tracked tree ~36 MB):
# .devdeps/ (ignored) holds
#   cutlass/include  the CUTLASS/CuTe headers this tree's CUDA sources include (nvcc -M over every
#                    .cu/.cpp under cuda/; about 6 of the wheel's 26 MB), from .deps (tools/setup.sh);
#   gtest/           GoogleTest's headers and static libraries, from .deps/gtest or the system's
#                    libgtest-dev (the GPU image has none);
#   pybind11/, pypkgs/  from .deps where setup.sh put them (mok._C and pytest on the GPU machine).
# tools/gpu.sh uses .devdeps where .deps is absent. The header list is this tree's: an A/B with an
# older tree (tools/ab_trees.sh) needs the older tree to include no header this one does not.
#   bash tools/device_deps.sh          # then carry [".devdeps"] (and ".ab" for an A/B)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"
src="$ROOT/.deps"
dst="$ROOT/.devdeps"
[ -f "$src/cutlass/include/cute/tensor.hpp" ] || { echo "device_deps: run tools/setup.sh first (.deps/cutlass)"; exit 1; }
cutlass="$(cd "$src/cutlass/include" && pwd -P)"
gtest_inc=""
if [ -f "$src/gtest/include/gtest/gtest.h" ]; then gtest_inc="$src/gtest/include"
elif [ -f /usr/include/gtest/gtest.h ]; then gtest_inc=/usr/include; fi

# Every header a CUDA source includes (make-style dependency lists, parsed by Python: escaped
# spaces, real paths), kept where it lies under the CUTLASS include folder.
list="$(mktemp)"
trap 'rm -f "$list"' EXIT
for f in $(git ls-files 'cuda/*.cu' 'cuda/*.cpp'); do
  nvcc -std=c++17 -arch=sm_90a -M -I cuda/include -I include -I "$cutlass" ${gtest_inc:+-I "$gtest_inc"} "$f" \
    >> "$list" 2> "$list.err" || { echo "device_deps: nvcc -M failed on $f:"; tail -5 "$list.err"; rm -f "$list.err"; exit 1; }
done
rm -f "$list.err"
headers="$(python3 - "$list" "$cutlass" <<'PY'
import os, re, sys
text = open(sys.argv[1]).read().replace("\\\n", " ")
root = os.path.realpath(sys.argv[2])
found = set()
for token in re.split(r"(?<!\\)\s+", text):
    path = token.replace("\\ ", " ").rstrip(":")
    if path and os.path.isfile(path):
        real = os.path.realpath(path)
        if real.startswith(root + os.sep):
            found.add(os.path.relpath(real, root))
print("\n".join(sorted(found)))
PY
)"
[ -n "$headers" ] || { echo "device_deps: no CUTLASS header found in the sources' dependencies"; exit 1; }

rm -rf "$dst" && mkdir -p "$dst/cutlass/include"
(cd "$cutlass" && while IFS= read -r h; do cp --parents "$h" "$dst/cutlass/include/"; done <<< "$headers")
if [ -d "$src/gtest/include" ]; then
  cp -r "$src/gtest" "$dst/gtest"
elif [ -f /usr/include/gtest/gtest.h ] && [ -f /usr/lib/x86_64-linux-gnu/libgtest.a ]; then
  mkdir -p "$dst/gtest/include" "$dst/gtest/lib"
  cp -r /usr/include/gtest "$dst/gtest/include/"
  cp /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a "$dst/gtest/lib/"
else
  echo "device_deps: warning: no GoogleTest (.deps/gtest or libgtest-dev): the GPU tests will not build there"
fi
for d in pybind11 pypkgs; do
  if [ -d "$src/$d" ]; then cp -r "$src/$d" "$dst/$d"; else echo "device_deps: warning: no .deps/$d (mok._C or pytest on the GPU machine)"; fi
done
echo ".devdeps: $(du -sh "$dst" | cut -f1) ($(find "$dst/cutlass" -type f | wc -l) CUTLASS headers)"
