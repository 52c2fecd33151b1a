#!/usr/bin/env bash
# Memory traffic of one kernel launch, from hardware counters only (no source-counter replay):
# DRAM bytes read and written, L2 sectors by operation and the read misses, the sectors the SMs
# read (TMA and loads), L2 and tensor-pipe utilization. How session 17 compared the forward
# megakernel's L2 reads with its GEMMs alone.
#   tools/ncu_metrics.sh OUT_FILE KERNEL_REGEX LAUNCH_SKIP PROGRAM [ARGS...]
# OUT_FILE gets ncu's raw CSV (one row for the first launch matching KERNEL_REGEX after skipping
# LAUNCH_SKIP matching ones; a column per metric); stdout gets one summary line. Needs ncu (the GPU
# machine); run after tools/gpu.sh built the program.
set -uo pipefail
out="$1" regex="$2" skip="$3"; shift 3
metrics=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum
metrics+=,lts__t_sectors_op_read_lookup_miss.sum,lts__t_sectors_op_atom.sum,lts__t_sectors_op_red.sum
metrics+=,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,gpu__time_duration.sum
metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
ncu --kernel-name-base demangled -k "regex:$regex" -s "$skip" -c 1 --metrics "$metrics" --csv --page raw "$@" > "$out" 2>&1
python3 - "$out" <<'PY'
import csv, io, sys
lines = open(sys.argv[1]).read().splitlines()
start = [i for i, l in enumerate(lines) if l.startswith('"ID"')]
if not start:
    sys.exit(f"ncu_metrics: no profiled launch in {sys.argv[1]}")
rows = list(csv.reader(io.StringIO("\n".join(lines[start[0]:]))))
d = dict(zip(rows[0], rows[2]))
n = lambda k: float(d[k].replace(",", ""))
gb = lambda k: n(k) * 32 / 1e9  # sectors
print(f"{d.get('Kernel Name', '?')}: {n('gpu__time_duration.sum') / 1e6:.2f} ms | "
      f"DRAM read {n('dram__bytes_read.sum') / 1e9:.2f} GB, write {n('dram__bytes_write.sum') / 1e9:.2f} GB | "
      f"L2 read {gb('lts__t_sectors_op_read.sum'):.1f} GB (miss {gb('lts__t_sectors_op_read_lookup_miss.sum'):.1f}, "
      f"from SMs {gb('lts__t_sectors_srcunit_tex_op_read.sum'):.1f}), write {gb('lts__t_sectors_op_write.sum'):.2f} GB | "
      f"L2 {n('lts__throughput.avg.pct_of_peak_sustained_elapsed'):.0f}%, "
      f"tensor {n('sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed'):.0f}%")
PY
