#!/usr/bin/env bash
# Memory traffic of chosen kernels, from the hardware counters (no replay of source counters):
# DRAM bytes read and written, L2 sectors by operation and miss, the L2 and SM throughput.
#   tools/ncu_metrics.sh OUT_FILE KERNEL_REGEX LAUNCH_SKIP PROGRAM [ARGS...]
# One line per metric of the first matching launch after LAUNCH_SKIP of them. Needs ncu (the GPU
# machine); run after tools/gpu.sh built the program.
set -uo pipefail
out="$1" regex="$2" skip="$3"; shift 3
metrics=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum
metrics+=,lts__t_sectors_op_read_lookup_miss.sum,lts__t_sectors_op_atom.sum,lts__t_sectors_op_red.sum
metrics+=,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,gpu__time_duration.sum
metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
ncu --kernel-name-base demangled -k "regex:$regex" -s "$skip" -c 1 --metrics "$metrics" --csv --page raw "$@" > "$out" 2>&1
