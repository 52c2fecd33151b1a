#!/usr/bin/env bash
# Where a CUDA source's kernels spill registers, by source line, without a GPU (about 40 s for
# megakernel.cu). The build fails on any spill (ptxas -Werror) and names only the kernel; this
# compiles the translation unit as the build does, into a cubin and without -Werror, prints
# ptxas's spill warnings, then lists each spill store and load (STL/LDL) of the disassembly with
# the source line it came from: the innermost line, and the line of the kernel body it is inlined
# into. (How session 16 found the forward's epilogue spills and the comm warps'.)
#   bash tools/spill_check.sh [cuda/src/megakernel.cu] [build dir: build-cuda]
# Needs a configured CUDA build (tools/test.sh makes build-cuda) and nvdisasm: $NVDISASM, on
# PATH or in the CUDA toolkit, else the nvidia-cuda-nvdisasm wheel from PyPI (unpacked once under
# ~/.cache/mok-nvdisasm). (Triton's nvdisasm 12.8 reads nvcc 13's cubins without its dataflow
# analysis; spills are then found by their STL/LDL alone.)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$(cd "$ROOT" && realpath "${1:-cuda/src/megakernel.cu}")"
BUILD="$(cd "$ROOT" && realpath "${2:-build-cuda}")"
VENV="${MOK_VENV:-$HOME/.cache/mok-venv}"

[ -f "$BUILD/build.ninja" ] || { echo "spill_check: no ninja build in $BUILD (run tools/test.sh first)" >&2; exit 2; }
cmd="$(ninja -C "$BUILD" -t commands 2>/dev/null | grep -F -- "-c $SRC -o" | tail -1 || true)"
[ -n "$cmd" ] || { echo "spill_check: $BUILD does not compile $SRC" >&2; exit 2; }

nvdisasm="${NVDISASM:-$(command -v nvdisasm || true)}"
if [ -z "$nvdisasm" ] && [ -x /usr/local/cuda/bin/nvdisasm ]; then nvdisasm=/usr/local/cuda/bin/nvdisasm; fi
cache="$HOME/.cache/mok-nvdisasm"
if [ -z "$nvdisasm" ]; then
  found="$(find "$cache" -name nvdisasm -type f 2>/dev/null | head -1 || true)"
  if [ -z "$found" ] && [ -x "$VENV/bin/pip" ]; then
    mkdir -p "$cache"
    "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$cache" \
      "nvidia-cuda-nvdisasm>=13" > /dev/null 2>&1 &&
      python3 -m zipfile -e "$(ls "$cache"/nvidia_cuda_nvdisasm-*.whl | head -1)" "$cache/x" && chmod -R u+x "$cache/x"
    found="$(find "$cache" -name nvdisasm -type f 2>/dev/null | head -1 || true)"
  fi
  nvdisasm="$found"
fi
if [ -z "$nvdisasm" ]; then
  nvdisasm="$(ls "$VENV"/lib/python3*/site-packages/triton/backends/nvidia/bin/nvdisasm 2>/dev/null | head -1 || true)"
fi
[ -n "$nvdisasm" ] || { echo "spill_check: no nvdisasm (set NVDISASM)" >&2; exit 2; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The build's command, made to write a cubin: no dependency file, spills warned but not fatal.
cubin_cmd="$(echo "$cmd" | sed -E "s# -MD -MT [^ ]+ -MF [^ ]+##; s#,-Werror##; s# -c $SRC -o [^ ]+# -cubin $SRC -o $work/k.cubin#")"
(cd "$BUILD" && eval "$cubin_cmd") 2> "$work/ptxas.txt" || { cat "$work/ptxas.txt" >&2; exit 1; }
grep -i "spill" "$work/ptxas.txt" | sed 's/^ptxas warning : //' || echo "no spills"

"$nvdisasm" -gi -c "$work/k.cubin" > "$work/k.sass" 2> /dev/null
# Per spill instruction: its kernel, the innermost source line and the outermost "inlined at"
# line of the latest line-info block before it.
awk '
  /^\.text\./ { kernel = substr($1, 7); sub(/:$/, "", kernel) }
  /\/\/## File/ {
    if (!in_block) { inner = ""; outer = "" }
    in_block = 1
    line = $0
    sub(/^[ \t]*\/\/## File "/, "", line)
    split(line, parts, /", line /)
    file = parts[1]; sub(/.*\//, "", file)
    n = parts[2]; sub(/ .*/, "", n)
    here = file ":" n
    if (inner == "") inner = here
    outer = here
    next
  }
  / (STL|LDL)(\.[A-Z0-9.]+)? / {  # local memory: spills (the build also refuses any other local use)
    op = ($0 ~ / STL/) ? "store" : "load"
    printf "%-6s %-28s at %-34s (in %s)\n", op, inner, outer, kernel
  }
  { in_block = 0 }
' "$work/k.sass" | sort | uniq -c | sort -rn
