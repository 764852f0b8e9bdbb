#!/usr/bin/env bash
# Compile-checks the `cuda` feature (vramlab and the kernel, every target) on a
# machine without a GPU or a CUDA toolkit. nvcc and the CUDA headers come from
# NVIDIA's PyPI wheels (scripts/cuda_env.sh); the check builds in
# $CUDA_TARGET_DIR (default target/cuda) so the normal build stays as it is.
#
# Nothing is linked or run: scripts/build_cuda.sh links the binary.
#
# Extra arguments go to cargo, e.g. `scripts/check_cuda.sh clippy` runs clippy
# instead of check.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

say() { printf '\n==> %s\n' "$*"; }

. "$ROOT/scripts/cuda_env.sh"

subcommand="${1:-check}"
[ $# -gt 0 ] && shift
say "cargo $subcommand with the cuda feature (compute capability $CUDA_COMPUTE_CAP, target dir $CARGO_TARGET_DIR)"
cargo "$subcommand" --release --locked --workspace \
    --features vramlab/cuda,vramlab-kernel/cuda --all-targets "$@"
