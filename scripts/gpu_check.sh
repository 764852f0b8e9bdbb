#!/usr/bin/env bash
# On a GPU machine: runs scripts/gpu_check.py with the python that has
# PyTorch ($PYTHON, else /opt/torch/.venv's, else python3), writing its JSON
# into $OUT (or --out). The binary is scripts/build_cuda.sh's .gpu/vramlab
# (unpacked from .gpu/vramlab.xz, the file that travels, when it is not there);
# it finds CUDA 13's libraries in that python's NVIDIA wheels.
#
#   bash scripts/gpu_check.sh [--budget 480] [--only smoke measure ...]
#   bash scripts/gpu_check.sh --device cpu --binary target/release/vramlab   # a rehearsal without a GPU
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ -x /opt/torch/.venv/bin/python3 ] && PYTHON=/opt/torch/.venv/bin/python3
fi
if [ ! -e "$ROOT/.gpu/vramlab" ] && [ -e "$ROOT/.gpu/vramlab.xz" ]; then
    echo "unpacking $ROOT/.gpu/vramlab.xz"
    "$PYTHON" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$ROOT/.gpu/vramlab.xz" "$ROOT/.gpu/vramlab"
    chmod +x "$ROOT/.gpu/vramlab"
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"
