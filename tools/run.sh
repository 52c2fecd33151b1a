#!/usr/bin/env bash
# The main job: build MoK and run one MoE layer forward and backward with `mok run`, on the GPU
# when there is one (and the CUDA backend is built), else on the CPU backend; it checks the result
# against the fp64 reference and prints a timing table. Extra arguments go to `mok run`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bash "$MOK_ROOT/tools/setup.sh" --build-only
bash "$MOK_ROOT/tools/build.sh" >/dev/null
exec "$MOK_BUILD/mok" run --preset small --ranks 2 --tokens 256 "$@"
