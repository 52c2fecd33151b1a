# Sourced by the tools: where the build and the Python environment live.
# The virtual environment sits at a stable path outside the checkout, so a fresh clone (and CI)
# reuses the large PyTorch download.
MOK_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MOK_BUILD="${MOK_BUILD:-$MOK_ROOT/build}"
MOK_VENV="${MOK_VENV:-$HOME/.cache/mok-venv}"
MOK_JOBS="${MOK_JOBS:-$(nproc)}"
