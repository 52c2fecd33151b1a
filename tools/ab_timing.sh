#!/usr/bin/env bash
# A/B of a compile-time switch on the expert kernels, on one GPU in one call: builds
# expert_kernels_timing without (A) and with (B) the CUDA define MOK_AB_DEFINE, then runs A, B, A, B
# on the shapes of MOK_TIMING_ARGS ("H I experts rows_per_expert ..."). Logs under $OUT.
#   MOK_AB_DEFINE=MOK_SOME_SWITCH MOK_TIMING_ARGS="7168 2048 192 341" bash tools/ab_timing.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/mok-ab-out}"; mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; cd "$ROOT"
gtest_args=(); [ -f /usr/include/gtest/gtest.h ] || gtest_args=(-DGTEST_ROOT="$ROOT/.deps/gtest")
build() {  # dir, extra CUDA flags
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DCUTLASS_INCLUDE_DIR="$ROOT/.deps/cutlass/include" \
    "${gtest_args[@]}" -DCMAKE_CUDA_FLAGS="$2" > "$OUT/build_$(basename "$1").log" 2>&1 &&
    cmake --build "$1" -j "$(nproc)" --target expert_kernels_timing >> "$OUT/build_$(basename "$1").log" 2>&1
}
build build-ab-a "" & a=$!
build build-ab-b "-D${MOK_AB_DEFINE:?}" & b=$!
wait $a && wait $b || { echo "build failed"; tail -20 "$OUT"/build_*.log; exit 1; }
for round in 1 2; do
  for v in a b; do
    echo "== $v (round $round)$([ $v = b ] && echo " -D$MOK_AB_DEFINE")" | tee -a "$OUT/ab.log"
    timeout 120 "build-ab-$v/cuda/expert_kernels_timing" ${MOK_TIMING_ARGS:-} 2>&1 | tee -a "$OUT/ab.log"
  done
done
