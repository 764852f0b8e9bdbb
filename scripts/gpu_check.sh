#!/usr/bin/env bash
# On a GPU machine: runs scripts/gpu_check.py with the python that has
# PyTorch ($PYTHON, else /opt/torch/.venv's, else python3), writing its JSON
# into $OUT (or --out). The binary is scripts/build_cuda.sh's $GPU_DIST/vramlab
# (.gpu/vramlab by default), unpacked on every run from $GPU_DIST/vramlab.xz,
# the file that travels, where that is there: a warm machine keeps the last
# call's unpacked binary, and the build that travelled with this call is the
# one to run. Its size and sha256 are printed (env.json records them too). It
# finds CUDA 13's libraries in that python's NVIDIA wheels.
#
#   bash scripts/gpu_check.sh [--budget 480] [--only smoke measure ...]
#   bash scripts/gpu_check.sh --device cpu --small --binary target/release/vramlab   # a rehearsal without a GPU
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIST="${GPU_DIST:-$ROOT/.gpu}"
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ -x /opt/torch/.venv/bin/python3 ] && PYTHON=/opt/torch/.venv/bin/python3
fi
if [ -e "$DIST/vramlab.xz" ]; then
    echo "unpacking $DIST/vramlab.xz"
    # Beside the binary, then renamed over it: an unpacking cut short leaves the old binary or none, never half of one.
    "$PYTHON" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$DIST/vramlab.xz" "$DIST/.vramlab.partial"
    chmod +x "$DIST/.vramlab.partial"
    mv -f "$DIST/.vramlab.partial" "$DIST/vramlab"
fi
if [ -e "$DIST/vramlab" ]; then
    echo "$DIST/vramlab: $(stat -c %s "$DIST/vramlab") bytes, sha256 $(sha256sum "$DIST/vramlab" | cut -d' ' -f1)"
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"
