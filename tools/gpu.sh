#!/usr/bin/env bash
# The one GPU script: build with CUDA, run the GPU tests, the sanitizers and the benchmarks, with
# every log under $OUT (the device tool brings that folder back). Run from the repository root on
# a machine with H200s, carrying .devdeps (tools/device_deps.sh: CUTLASS headers, GoogleTest, pybind11, pytest):
#   MOK_GPU_STEPS="build tests sanitize bench_experts bench_1gpu" bash tools/gpu.sh
# Env: MOK_GTEST_FILTER, MOK_SANITIZE_FILTER (the GPU tests run under compute-sanitizer), MOK_TEST_ENV (VAR=value settings for the GPU test binary only), MOK_TIMING_ARGS,
# MOK_BENCH_BUDGET(_2GPU), MOK_BENCH_CASES_1GPU / _2GPU (e.g. "baselines_2gpu:tokens=8192", "fp8_1gpu"),
# MOK_BENCH_IMPLS (bench_1gpu: e.g. "mok,torch_a2a"), MOK_BENCH_IMPLS_2GPU (bench_2gpu: e.g.
# "mok,mok_domains,torch_a2a"; mok_domains runs only when named), MOK_DEADLINE_S.
# Steps: build (MOK_BUILD_TARGETS: only those; MOK_BUILD_DIR, MOK_CUDA_FLAGS), sass, tests, pytest (mok._C + tests/python/test_cuda_{layer,distributed,fp8}.py, test_domains.py's GPU tests), timing, mk_timing
# (the fused forward against its GEMMs alone, MOK_MK_TIMING_ARGS), sanitize,
# bench_experts, bench_gemms (each expert GEMM against torch._grouped_mm), bench_1gpu, train (bench/train.py, MOK_TRAIN_RUNS), bench_2gpu (needs 2 GPUs), ncu (stall samples per SASS line), sweep_2gpu (MOK_SWEEP_PLANS, below),
# scaling (the layer at R = 1, 2, 4, 8 GPUs as far as the machine goes, then bench.scaling's table).
# MOK_COREDUMP=1: a GPU exception in any step writes a small core dump (no memory images), and at
# the end cuda-gdb names the faulting kernel, line and registers of each in coredump_*.txt (how
# session 14 found the graph backward's illegal address).
# MOK_NPROC: processes (GPUs) of bench_2gpu and sweep_2gpu (default 2; 4 or 8 on nvidia-h200-x4 / -x8
# with MOK_SWEEP_CASES / MOK_BENCH_CASES_2GPU from baselines_4gpu / baselines_8gpu).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# Everything is written under $LOGS; at the end the device tool's $OUT gets the summary, the
# result JSONs and one archive of the rest (the tool brings back at most 8 files).
OUT="${OUT:-/tmp/mok-gpu-out}"
LOGS="$(mktemp -d /tmp/mok-gpu.XXXX)"
mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${MOK_BUILD_DIR:-$ROOT/build-gpu}"
# The dependencies: .deps (tools/setup.sh), or its trimmed copy .devdeps (tools/device_deps.sh),
# which fits the device tool's 64 MiB beside the tracked tree.
# MOK_DEPS names another folder of the same layout.
if [ -n "${MOK_DEPS:-}" ]; then
  DEPS="$MOK_DEPS"
elif [ -f "$ROOT/.deps/cutlass/include/cute/tensor.hpp" ]; then
  DEPS="$ROOT/.deps"
else
  DEPS="$ROOT/.devdeps"
fi
STEPS="${MOK_GPU_STEPS:-build sass tests sanitize bench_experts}"
COMMIT="${MOK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export MOK_COMMIT="$COMMIT" MOK_CUDA_LIB="$BUILD/cuda/libmok_cuda_capi.so"
export PYTHONPATH="$ROOT/python:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
status=0
# The device tool kills a call at 600 s and then brings nothing back: every step's timeout is cut
# to what is left before MOK_DEADLINE_S (default 540 s after the start), and the logs are copied to
# $OUT after each step.
START_S=$(date +%s)
DEADLINE_S=$(( START_S + ${MOK_DEADLINE_S:-540} ))
left() { local l=$(( DEADLINE_S - $(date +%s) )); local want=$1; (( l < want )) && want=$l; (( want < 1 )) && want=1; echo "$want"; }
publish() {
  cp "$LOGS/summary.txt" "$OUT/" 2>/dev/null
  for f in "$LOGS"/*.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" . 2>/dev/null
}
trap '[ -n "${CLOCKS_PID:-}" ] && kill "$CLOCKS_PID" 2>/dev/null; publish' EXIT
log() { echo "== $(date +%T) $*" | tee -a "$LOGS/summary.txt"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }

if [ "${MOK_COREDUMP:-0}" = 1 ]; then
  CORES="$(mktemp -d /tmp/mok-cores.XXXX)"  # beside $LOGS: a dump must not enter the archive
  export CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 CUDA_COREDUMP_FILE="$CORES/cudacore.%p" \
    CUDA_COREDUMP_GENERATION_FLAGS="skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,skip_local_memory,skip_constbank_memory"
fi
log "commit $COMMIT steps: $STEPS"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv > "$LOGS/nvidia-smi.txt" 2>&1
# SM clocks, power and throttle reasons every 250 ms for the whole call (clocks.csv): whether a
# timing moved with the clocks (a busier kernel before it can leave the GPU at a lower clock).
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 250 > "$LOGS/clocks.csv" 2>&1 &
CLOCKS_PID=$!

if has build; then
  gtest_args=()
  [ -f /usr/include/gtest/gtest.h ] || gtest_args=(-DGTEST_ROOT="$DEPS/gtest")
  if cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON \
       -DCUTLASS_INCLUDE_DIR="$DEPS/cutlass/include" "${gtest_args[@]}" \
       ${MOK_CUDA_FLAGS:+-DCMAKE_CUDA_FLAGS="$MOK_CUDA_FLAGS"} > "$LOGS/build.log" 2>&1 &&
     cmake --build "$BUILD" -j "$(nproc)" ${MOK_BUILD_TARGETS:+--target $MOK_BUILD_TARGETS} >> "$LOGS/build.log" 2>&1; then
    log "build ok"
  else
    log "build FAILED"; tail -40 "$LOGS/build.log"; exit 1
  fi
fi

if has sass; then
  cuobjdump --dump-sass "$BUILD/cuda/libmok_cuda.a" > "$LOGS/sass.txt" 2>&1
  log "sass: $(grep -c HGMMA "$LOGS/sass.txt") HGMMA, $(grep -c -E 'LDL|STL' "$LOGS/sass.txt") LDL/STL"
fi

if has tests; then
  # Hard timeouts everywhere a kernel runs: a deadlocked pipeline must end the step, not the call.
  if timeout --kill-after=10 "$(left "${MOK_TEST_TIMEOUT:-240}")" env ${MOK_TEST_ENV:-} "$BUILD/cuda/mok_cuda_tests" \
       --gtest_filter="${MOK_GTEST_FILTER:-*}" > "$LOGS/gpu_tests.log" 2>&1; then
    log "gpu tests ok"
  else
    status=1; log "gpu tests FAILED (exit $?; 124 = timed out)"
  fi
  grep -E "^\[ +(OK|FAILED) +\]|rel error|Failure|Expected|Which is|differs|timed out" "$LOGS/gpu_tests.log" | tail -40
  # `mok run` on the GPU (every rank emulated on one device): each run must exit 0 and end in PASS.
  while read -r run_args; do
    out="$(timeout --kill-after=10 "$(left 120)" "$BUILD/mok" run --backend cuda $run_args 2>&1)"; rc=$?
    printf '$ mok run --backend cuda %s\n%s\n\n' "$run_args" "$out" >> "$LOGS/mok_run_cuda.log"
    if [ "$rc" -eq 0 ] && [ "$(printf '%s\n' "$out" | tail -1)" = "PASS" ]; then
      log "mok run --backend cuda $run_args: PASS"
    else
      status=1; log "mok run --backend cuda $run_args: FAILED (exit $rc)"; printf '%s\n' "$out" | tail -25
    fi
  done <<'RUNS'
--preset small --ranks 2 --tokens 300 --runs 5
--preset small --ranks 1 --tokens 1000 --routing balanced --runs 3
--preset small --ranks 4 --tokens 513 --routing uniform --runs 3
--preset tiny --ranks 4 --tokens 9 --routing one_expert --runs 3
--preset small --ranks 2 --tokens 300 --routing masked --runs 3
--preset tiny --ranks 2 --tokens 0
--preset tiny --limit 0.5 --ranks 8 --tokens 5 --runs 2
--preset small --ranks 2 --tokens 300 --runs 3 --precision fp8
--preset small --ranks 4 --tokens 513 --routing uniform --runs 3 --precision fp8
--preset small --ranks 1 --tokens 1000 --routing balanced --limit 7 --runs 2 --precision fp8
--preset small --ranks 2 --tokens 0 --precision fp8
--preset small --ranks 2 --tokens 300 --runs 3 --precision fp8_dgrad
--preset small --ranks 1 --tokens 1000 --routing balanced --limit 7 --runs 2 --precision fp8_dgrad
--preset small --ranks 4 --tokens 9 --routing one_expert --runs 2 --precision fp8_dgrad
--preset small --ranks 2 --tokens 300 --routing masked --runs 2 --precision fp8_dgrad
RUNS
  grep -A12 -m1 "^pass " "$LOGS/mok_run_cuda.log" | tee -a "$LOGS/summary.txt"
fi

# mok._C for the machine's python3 (pybind11 carried in .devdeps): the pytest and train steps.
build_python_ext() {
  cmake -S . -B "$ROOT/build-py" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_CUDA=ON -DMOK_BUILD_TESTS=OFF \
    -DMOK_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" \
    -Dpybind11_DIR="$DEPS/pybind11/share/cmake/pybind11" \
    -DCUTLASS_INCLUDE_DIR="$DEPS/cutlass/include" > "$LOGS/pybuild.log" 2>&1 &&
    timeout --kill-after=10 "$(left 300)" cmake --build "$ROOT/build-py" -j "$(nproc)" --target mok_python >> "$LOGS/pybuild.log" 2>&1
}

# mok._C importable: already, or built now (the bench_1gpu and train steps; pytest always builds it).
python_ext_ready() { python3 -c "import mok._C" 2>/dev/null || build_python_ext; }

if has pytest; then
  # mok._C, then the Python GPU tests.
  if build_python_ext; then
    python3 -c "import pytest" 2>/dev/null || export PYTHONPATH="$DEPS/pypkgs:$PYTHONPATH"  # carried by setup.sh
    # 360 s for the 2-GPU machine; the every-GPU case adds up to 400 s on 4 and 8 GPUs.
    pytest_s=360; (( $(nvidia-smi -L 2>/dev/null | wc -l) >= 4 )) && pytest_s=760
    if timeout --kill-after=10 "$(left $pytest_s)" python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda_layer.py tests/python/test_cuda_distributed.py tests/python/test_cuda_fp8.py \
         tests/python/test_domains.py::test_domains_sharing_one_gpu tests/python/test_domains.py::test_domains_on_gpus \
         > "$LOGS/pytest_gpu.log" 2>&1; then
      log "python gpu tests ok"
    else
      status=1; log "python gpu tests FAILED"
    fi
    tail -15 "$LOGS/pytest_gpu.log"
  else
    status=1; log "python extension build FAILED"; tail -20 "$LOGS/pybuild.log"
  fi
fi

if has timing; then
  timeout --kill-after=10 "$(left 180)" "$BUILD/cuda/expert_kernels_timing" ${MOK_TIMING_ARGS:-} > "$LOGS/timing.log" 2>&1 || status=1
  log "timing:"; cat "$LOGS/timing.log" | tee -a "$LOGS/summary.txt"
fi

if has mk_timing; then
  timeout --kill-after=10 "$(left 180)" "$BUILD/cuda/megakernel_timing" ${MOK_MK_TIMING_ARGS:-} > "$LOGS/megakernel_timing.log" 2>&1 || status=1
  log "megakernel timing:"; cat "$LOGS/megakernel_timing.log" | tee -a "$LOGS/summary.txt"
fi

if has ncu; then
  # Where the cycles of a kernel go: stall reasons, memory traffic and per-SASS-line stall samples
  # of its first launch, for each regex of MOK_NCU_KERNEL (';'-separated; one report each) in the
  # program MOK_NCU_BIN (default the expert kernels' timing, shape MOK_TIMING_ARGS; e.g.
  # MOK_NCU_BIN=megakernel_timing MOK_TIMING_ARGS="7168 2048 192 8 8192 1 0 0").
  IFS=';' read -ra ncu_kernels <<< "${MOK_NCU_KERNEL:-SwiGluEpilogue}"
  for i in "${!ncu_kernels[@]}"; do
    rep="$LOGS/ncu$i"
    timeout --kill-after=10 "$(left 240)" ncu --kernel-name-base demangled -k "regex:${ncu_kernels[$i]}" -c 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section SourceCounters \
      --section SchedulerStats -o "$rep" "$BUILD/cuda/${MOK_NCU_BIN:-expert_kernels_timing}" \
      ${MOK_TIMING_ARGS:-2880 2880 16 4096} > "${rep}_run.log" 2>&1 || status=1
    ncu -i "$rep.ncu-rep" --page details > "${rep}_details.txt" 2>&1
    ncu -i "$rep.ncu-rep" --page raw --csv > "${rep}_raw.csv" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "${rep}_source.csv" 2>&1
    python3 tools/ncu_hot.py "${rep}_source.csv" > "${rep}_hot.txt" 2>&1
    log "ncu ${ncu_kernels[$i]}:"
    grep -E "Duration|Throughput|Hit Rate|Cycles Per Issued|Stall" "${rep}_details.txt" | head -24 | tee -a "$LOGS/summary.txt"
    head -40 "${rep}_hot.txt" | tee -a "$LOGS/summary.txt"
    publish
  done
fi

if has sanitize; then
  for tool in memcheck racecheck; do
    if timeout --kill-after=10 "$(left 180)" compute-sanitizer --tool "$tool" --error-exitcode 3 "$BUILD/cuda/mok_cuda_tests" \
         --gtest_filter="${MOK_SANITIZE_FILTER:-*Megakernel*R1_balanced*:*MegakernelBackward*R1_zipf*:*small_balanced*:*widths_not_multiple_of_tile*:*BadOffsets*:Precision.*:*RoutingSchedule*balanced_R2*:*RoutingScheduleStatus*:*RoutingRows*one_token*:*RoutingEpilogues*k4_shared*}" \
         > "$LOGS/sanitize_$tool.log" 2>&1 &&
       timeout --kill-after=10 "$(left 120)" compute-sanitizer --tool "$tool" --error-exitcode 3 "$BUILD/mok" run --backend cuda --preset tiny --ranks 2 \
         --tokens 130 --runs 1 --fused off >> "$LOGS/sanitize_$tool.log" 2>&1 &&
       # The fused forward on one rank: the sanitizer serializes kernels, so ranks sharing a GPU
       # could not meet at the barrier; one rank still runs every kernel of the call.
       timeout --kill-after=10 "$(left 120)" compute-sanitizer --tool "$tool" --error-exitcode 3 "$BUILD/mok" run --backend cuda --preset tiny --ranks 1 \
         --tokens 300 --runs 1 >> "$LOGS/sanitize_$tool.log" 2>&1; then
      log "compute-sanitizer $tool clean"
    else
      status=1; log "compute-sanitizer $tool FAILED"; tail -20 "$LOGS/sanitize_$tool.log"
    fi
  done
fi

if has bench_experts; then
  timeout --kill-after=10 "$(left $(( ${MOK_BENCH_BUDGET:-200} + 120 )))" python3 -m bench.run --cases experts_1gpu \
    --passes forward,backward --out "$LOGS/experts_1gpu_h200.json" --time-budget-s "${MOK_BENCH_BUDGET:-200}" \
    > "$LOGS/experts_1gpu_h200.log" 2>&1 || status=1
  python3 -m bench.render "$LOGS/experts_1gpu_h200.json" >> "$LOGS/experts_1gpu_h200.log" 2>&1 || true
  publish; log "bench experts done"; tail -5 "$LOGS/experts_1gpu_h200.log"
fi

if has bench_gemms; then  # each expert GEMM against torch._grouped_mm (MOK_GEMMS_ARGS: e.g. "--rows 4096")
  timeout --kill-after=10 "$(left 300)" python3 -m bench.gemms --out "$LOGS/gemms_1gpu_h200.md" ${MOK_GEMMS_ARGS:-} \
    > "$LOGS/gemms_1gpu_h200.log" 2>&1 || status=1
  publish; log "bench gemms done"; tail -3 "$LOGS/gemms_1gpu_h200.log"
fi

if has bench_1gpu; then
  python_ext_ready || true  # (mok's impl imports the package)
  timeout --kill-after=10 "$(left $(( ${MOK_BENCH_BUDGET:-200} + 120 )))" python3 -m bench.run --cases "${MOK_BENCH_CASES_1GPU:-baselines_1gpu}" ${MOK_BENCH_IMPLS:+--impls "$MOK_BENCH_IMPLS"} \
    --out "$LOGS/baselines_1gpu_h200.json" --time-budget-s "${MOK_BENCH_BUDGET:-200}" \
    > "$LOGS/baselines_1gpu_h200.log" 2>&1 || status=1
  python3 -m bench.render "$LOGS/baselines_1gpu_h200.json" >> "$LOGS/baselines_1gpu_h200.log" 2>&1 || true
  publish; log "bench 1gpu done"; tail -5 "$LOGS/baselines_1gpu_h200.log"
fi

if has train; then
  # The end-to-end training step (bench/train.py: a decoder of attention + MoE blocks, MoK's layer
  # against the torch layer on the same parameters and batches, steps alternating), one GPU, or
  # MOK_NPROC > 1: torchrun over that many (one expert-parallel group);
  # MOK_TRAIN_RUNS: ';'-separated argument lists, one bench.train run each.
  if python_ext_ready; then
    IFS=';' read -ra train_runs <<< "${MOK_TRAIN_RUNS:---presets qwen3-30b-a3b --layers 4;--presets mixtral-8x7b --layers 2}"
    for i in "${!train_runs[@]}"; do
      launcher=(python3); (( ${MOK_NPROC:-1} > 1 )) && launcher=(torchrun --standalone --nproc-per-node "$MOK_NPROC")
      # shellcheck disable=SC2086  # each entry is an argument list
      timeout --kill-after=10 "$(left 240)" "${launcher[@]}" -m bench.train ${train_runs[$i]} --out "$LOGS/train_$i.json" \
        > "$LOGS/train_$i.log" 2>&1 || status=1
      log "train ${train_runs[$i]}:"; tail -8 "$LOGS/train_$i.log" | tee -a "$LOGS/summary.txt"
      publish
    done
  else
    status=1; log "python extension build FAILED"; tail -20 "$LOGS/pybuild.log"
  fi
fi

if has bench_2gpu; then
  # A hard timeout on top of the harness's own budget: a stuck collective must not eat the call.
  budget="${MOK_BENCH_BUDGET_2GPU:-${MOK_BENCH_BUDGET:-330}}"
  timeout --kill-after=10 "$(left $((budget + 150)))" torchrun --standalone --nproc-per-node="${MOK_NPROC:-2}" -m bench.run \
    --cases "${MOK_BENCH_CASES_2GPU:-baselines_2gpu}" ${MOK_BENCH_IMPLS_2GPU:+--impls "$MOK_BENCH_IMPLS_2GPU"} \
    --out "$LOGS/baselines_2gpu_h200.json" --time-budget-s "$budget" \
    > "$LOGS/baselines_2gpu_h200.log" 2>&1 || { status=1; log "bench 2gpu exited non-zero (timeout: 124)"; }
  python3 -m bench.render "$LOGS/baselines_2gpu_h200.json" >> "$LOGS/baselines_2gpu_h200.log" 2>&1 || true
  publish; log "bench 2gpu done"; tail -5 "$LOGS/baselines_2gpu_h200.log"
fi

if has sweep_2gpu; then
  # Plan sweeps of the fused layer (bench/impls/mok_kernels.py: MOK_BENCH_PLAN), one torchrun per
  # entry: MOK_SWEEP_PLANS="comm=8;default;default NCCL_DEBUG=INFO" (a plan or
  # "default", then optional VAR=value settings for that run; unset: "default" alone), cases MOK_SWEEP_CASES, impls MOK_SWEEP_IMPLS;
  # MOK_SWEEP_PROFILE=1: each timed pass's kernels by device time (torch profiler) under profile_<plan>/.
  # MOK_SWEEP_TIMEOUT: seconds one torchrun may take (default 200).
  IFS=';' read -ra entries <<< "${MOK_SWEEP_PLANS:-default}"  # unset: the planner's plan alone
  for entry in "${entries[@]}"; do
    read -r plan settings <<< "$entry"
    [ "$plan" = "default" ] && plan=""  # the planner's choices
    tag="$(echo "$entry" | tr ',= ' '___')"
    env ${settings:-} MOK_BENCH_PLAN="$plan" timeout --kill-after=10 "$(left "${MOK_SWEEP_TIMEOUT:-200}")" torchrun --standalone --nproc-per-node="${MOK_NPROC:-2}" -m bench.run \
      --cases "${MOK_SWEEP_CASES:-baselines_2gpu:tokens=8192,routing=balanced}" --impls "${MOK_SWEEP_IMPLS:-mok,mok_gemms}" \
      --passes "${MOK_SWEEP_PASSES:-forward}" --out "$LOGS/sweep_$tag.json" --iter-budget-s 0.5 \
      ${MOK_SWEEP_PROFILE:+--profile "$LOGS/profile_$tag"} > "$LOGS/sweep_$tag.log" 2>&1 || { status=1; log "sweep $entry exited non-zero"; }
    log "sweep $entry:"
    python3 -m bench.render "$LOGS/sweep_$tag.json" > /dev/null 2>&1
    grep -E "^\| [a-z]" "$LOGS/sweep_$tag.md" | grep -v "^| preset" | cut -d'|' -f2,6,7,8,14,15 | tee -a "$LOGS/summary.txt"
    publish
  done
fi

if has scaling; then
  # Issue #7's scaling table: the same cases at every R in MOK_SCALING_RANKS (default 1 2 4 8, up to
  # the GPUs present), one torchrun each, MOK_SCALING_CASES filtering baselines_<R>gpu (default
  # tokens=2048|8192,routing=balanced), impls MOK_SCALING_IMPLS; then time per token by R.
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  files=()
  for R in ${MOK_SCALING_RANKS:-1 2 4 8}; do
    (( R <= gpus )) || { log "scaling: R=$R skipped ($gpus GPUs)"; continue; }
    timeout --kill-after=10 "$(left "${MOK_SWEEP_TIMEOUT:-200}")" torchrun --standalone --nproc-per-node="$R" -m bench.run \
      --cases "baselines_${R}gpu:${MOK_SCALING_CASES:-tokens=2048|8192,routing=balanced}" \
      --impls "${MOK_SCALING_IMPLS:-mok,torch_a2a}" --passes forward,backward --out "$LOGS/scaling_R$R.json" \
      --iter-budget-s 0.5 > "$LOGS/scaling_R$R.log" 2>&1 || { status=1; log "scaling R=$R exited non-zero"; }
    [ -f "$LOGS/scaling_R$R.json" ] && files+=("$LOGS/scaling_R$R.json")
    log "scaling R=$R done"
    publish
  done
  if (( ${#files[@]} > 0 )); then
    python3 -m bench.scaling "${files[@]}" --out "$LOGS/scaling.md" >> "$LOGS/summary.txt" 2>&1 || status=1
    cat "$LOGS/scaling.md" >> "$LOGS/summary.txt" 2>/dev/null
    publish
  fi
fi

for core in "${CORES:-/nonexistent}"/cudacore.*; do  # MOK_COREDUMP=1: each dump read, then dropped (too big to bring back)
  [ -f "$core" ] || continue
  timeout --kill-after=5 "$(left 90)" cuda-gdb -batch -ex "target cudacore $core" -ex "info cuda kernels" -ex bt \
    -ex 'x/8i $pc-64' -ex "info registers" > "$LOGS/coredump_$(basename "$core").txt" 2>&1
  log "GPU core dump $(basename "$core"): $(grep -m1 -E 'exception was triggered|CUDA Exception' "$LOGS/coredump_$(basename "$core").txt")"
  rm -f "$core"
done
log "exit $status"
rm -f "$LOGS/sass.txt.gz"; gzip -f "$LOGS/sass.txt" 2>/dev/null
exit $status
