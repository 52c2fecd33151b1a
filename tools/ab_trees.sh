#!/usr/bin/env bash
# An A/B of two commits in one device call: this tree, then an older one, through the same
# tools/gpu.sh settings (each tree with its own gpu.sh and build), logs under $OUT/a and $OUT/b.
#
# Here (the CPU machine):   bash tools/ab_trees.sh prepare 44bed8e      # writes .ab/44bed8e (ignored)
# On the device (carry [".devdeps", ".ab"]):
#   MOK_AB_TREE=.ab/44bed8e MOK_GPU_STEPS="build sweep_2gpu" MOK_SWEEP_PASSES=backward ... bash tools/ab_trees.sh run
# MOK_DEADLINE_S is split between the two runs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
case "${1:-}" in
  prepare)
    commit="${2:?a commit}"
    rm -rf ".ab/$commit" && mkdir -p ".ab/$commit"
    git archive "$commit" -- . ":(exclude)bench/results" | tar -x -C ".ab/$commit"
    echo "$commit" > ".ab/$commit/.commit"
    echo ".ab/$commit: $(du -sh ".ab/$commit" | cut -f1)"
    ;;
  run)
    tree="${MOK_AB_TREE:?MOK_AB_TREE=.ab/<commit>}"
    out="${OUT:-/tmp/mok-ab-out}"
    half=$(( ${MOK_DEADLINE_S:-540} / 2 ))
    mkdir -p "$out/a" "$out/b"
    OUT="$out/a" MOK_DEADLINE_S="$half" bash tools/gpu.sh; a=$?
    # An older tree's gpu.sh knows only .deps: give it whichever gpu.sh here would use.
    deps="$ROOT/.deps"; [ -f "$deps/cutlass/include/cute/tensor.hpp" ] || deps="$ROOT/.devdeps"
    ln -sfn "$deps" "$tree/.deps"
    (cd "$tree" && OUT="$out/b" MOK_DEADLINE_S="$half" MOK_COMMIT="$(cat .commit)" bash tools/gpu.sh); b=$?
    echo "== A (this tree): exit $a; B ($tree): exit $b"
    for side in a b; do echo "== $side"; cat "$out/$side/summary.txt" 2>/dev/null | grep -v "^==.*steps" | tail -30; done
    ;;
  *)
    echo "usage: tools/ab_trees.sh prepare <commit> | run   (see the header)"; exit 2
    ;;
esac
