#!/usr/bin/env bash
# An A/B of a compile-time switch on the expert kernels, on one GPU in one call: builds
# expert_kernels_timing without (A) and with (B) the CUDA define MOK_AB_DEFINE through
# tools/gpu.sh's build step, then runs A, B, A, B on the shapes of MOK_TIMING_ARGS
# ("H I experts rows_per_expert ..."). Logs under $OUT.
#   MOK_AB_DEFINE=MOK_SOME_SWITCH MOK_TIMING_ARGS="7168 2048 192 341" bash tools/ab_timing.sh
set -uo pipefail
OUT="${OUT:-/tmp/mok-ab-out}"; mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; cd "$ROOT"
build() {  # side, extra CUDA flags
  MOK_GPU_STEPS=build MOK_BUILD_TARGETS=expert_kernels_timing MOK_BUILD_DIR="$ROOT/build-ab-$1" MOK_CUDA_FLAGS="$2" \
    OUT="$OUT/build-$1" bash tools/gpu.sh > /dev/null
}
build a "" & a=$!
build b "-D${MOK_AB_DEFINE:?}" & b=$!
wait $a && wait $b || { echo "build failed (logs: $OUT/build-a, $OUT/build-b)"; exit 1; }
for round in 1 2; do
  for v in a b; do
    echo "== $v (round $round)$([ $v = b ] && echo " -D$MOK_AB_DEFINE")" | tee -a "$OUT/ab.log"
    timeout 120 "build-ab-$v/cuda/expert_kernels_timing" ${MOK_TIMING_ARGS:-} 2>&1 | tee -a "$OUT/ab.log"
  done
done
