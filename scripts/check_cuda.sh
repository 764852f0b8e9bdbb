#!/usr/bin/env bash
# Compile-checks the `cuda` feature (vramlab and the kernel, every target) on a
# machine without a GPU or a CUDA toolkit. nvcc and the CUDA headers come from
# NVIDIA's PyPI wheels (scripts/cuda-requirements.txt, CUDA 13.0) in a venv at
# $CUDA_VENV (default .venv-cuda); the check builds in $CUDA_TARGET_DIR
# (default target/cuda) so the normal build stays as it is.
#
# Nothing is linked or run: on a GPU machine, build with its own toolkit
# (`cargo build --release -p vramlab-kernel --features cuda`).
#
# CUDA_COMPUTE_CAP defaults to 90 (Hopper: H100/H200, the cards the lessons
# target): candle-kernels compiles its PTX and its static kernel library for
# this one architecture, and without a GPU it cannot ask nvidia-smi.
#
# Extra arguments go to cargo, e.g. `scripts/check_cuda.sh clippy` runs clippy
# instead of check.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

say() { printf '\n==> %s\n' "$*"; }

CUDA_VENV="${CUDA_VENV:-$ROOT/.venv-cuda}"
REQUIREMENTS="$ROOT/scripts/cuda-requirements.txt"

if [ ! -x "$CUDA_VENV/bin/python" ]; then
    say "creating the CUDA toolkit venv ($CUDA_VENV)"
    python3 -m venv "$CUDA_VENV"
fi
if ! cmp -s "$REQUIREMENTS" "$CUDA_VENV/.cuda-requirements.txt"; then
    say "installing the CUDA compiler and headers ($REQUIREMENTS)"
    "$CUDA_VENV/bin/python" -m pip install -q -r "$REQUIREMENTS"
    cp "$REQUIREMENTS" "$CUDA_VENV/.cuda-requirements.txt"
fi

CUDA_ROOT="$("$CUDA_VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
export CUDA_ROOT CUDA_PATH="$CUDA_ROOT" CUDA_HOME="$CUDA_ROOT"
export PATH="$CUDA_ROOT/bin:$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-$ROOT/target/cuda}"
nvcc --version | tail -n 2

subcommand="${1:-check}"
[ $# -gt 0 ] && shift
say "cargo $subcommand with the cuda feature (compute capability $CUDA_COMPUTE_CAP, target dir $CARGO_TARGET_DIR)"
cargo "$subcommand" --release --locked --workspace \
    --features vramlab/cuda,vramlab-kernel/cuda --all-targets "$@"
