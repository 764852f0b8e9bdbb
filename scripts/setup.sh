#!/usr/bin/env bash
# Everything the lessons and the tests need on a fresh machine: cmake and nasm
# (system packages), the rust-src component (evcxr's rust-analyzer reads it), a
# Python venv with the Jupyter clients, the release build, the kernelspec
# inside the venv, and the library built for notebook cells.
# Sourced by scripts/lessons.sh and scripts/test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Each stage is timed: `say` closes the one before it with its seconds, and the
# command ends (or stops) with its total.
stage=""
stage_started=$SECONDS
end_stage() {
    if [ -n "$stage" ]; then printf '    (%s: %d s)\n' "$stage" $((SECONDS - stage_started)); fi
    stage=""
}
say() {
    end_stage
    stage="$*"
    stage_started=$SECONDS
    printf '\n==> %s\n' "$*"
}
trap 'end_stage; printf "\n==> %d min %02d s in all\n" $((SECONDS / 60)) $((SECONDS % 60))' EXIT

if ! rustup component list --installed 2>/dev/null | grep -q '^rust-src'; then
    say "installing the rust-src component"
    rustup component add rust-src
fi

# System packages, with apt-get as root or through sudo: cmake and nasm build
# libjpeg-turbo (the JPEG decoder, with its SIMD code) during the cargo build;
# Open MPI runs several processes as several cards (`mpirun`), and its bindings
# are generated with libclang.
missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v nasm >/dev/null 2>&1 || missing+=(nasm)
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || missing+=(libopenmpi-dev)
# (grep -q would close the pipe early, and pipefail would count ldconfig's SIGPIPE as a failure.)
[ -n "$(ldconfig -p 2>/dev/null | grep 'libclang[-.0-9]*\.so')" ] || missing+=(libclang-dev)
if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
    missing+=(python3-venv)
fi
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq "${missing[@]}"; else sudo apt-get update -qq && sudo apt-get install -y -qq "${missing[@]}"; fi
fi

if [ ! -x .venv/bin/python ]; then
    say "creating the Python venv (.venv)"
    python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import jupyter_client, jupyter_kernel_test, nbclient, nbformat, pytest; from papermill.translators import papermill_translators as t; t.find_translator("vramlab", "rust")' >/dev/null 2>&1; then
    say "installing the Jupyter clients into .venv"
    .venv/bin/pip install --quiet --disable-pip-version-check -r scripts/requirements.txt
fi
if ! .venv/bin/python -c 'import jupyterlab, playwright, jupyter_console, pexpect, nbconvert' >/dev/null 2>&1; then
    say "installing JupyterLab, jupyter console, nbconvert and Playwright into .venv"
    .venv/bin/pip install --quiet --disable-pip-version-check -r scripts/frontend-requirements.txt
fi

say "building (release; the first build takes about 11 minutes on 2 cores)"
cargo build --release --locked --workspace --bins --features vramlab/mpi

KERNEL_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/vramlab-kernel"
say "installing the kernelspec into .venv"
VIRTUAL_ENV="$ROOT/.venv" "$KERNEL_BIN" install --sys-prefix

# Cells link the library as evcxr builds it (its own profile and flags), which
# shares nothing with the build above; without this the first notebook cell
# that uses vramlab would do it.
say "building vramlab for notebook cells (the first time about 5 minutes on 2 cores; then seconds)"
"$KERNEL_BIN" build-cells
export PATH="$ROOT/.venv/bin:$PATH"
