#!/usr/bin/env bash
# Runs every test that needs no GPU: the C++ suites and CLI checks (ctest), then the Python ones.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bash "$MOK_ROOT/tools/setup.sh"
bash "$MOK_ROOT/tools/build.sh"
start=$(date +%s)
(cd "$MOK_BUILD" && ctest --output-on-failure -j "$MOK_JOBS")
echo "ctest: $(( $(date +%s) - start )) s"
if [ -d "$MOK_ROOT/tests/python" ]; then
  start=$(date +%s)
  (cd "$MOK_ROOT" && PYTHONPATH="$MOK_ROOT/python:$MOK_ROOT${PYTHONPATH:+:$PYTHONPATH}" \
     "$MOK_VENV/bin/python" -m pytest -q tests/python)
  echo "pytest: $(( $(date +%s) - start )) s"
fi
