#!/usr/bin/env bash
# Builds the `vramlab` binary with the `cuda` feature on a machine without a
# GPU, for a GPU machine without a Rust toolchain (scripts/gpu_check.sh runs
# it there). The CUDA 13.0 compiler and libraries come from NVIDIA's PyPI
# wheels (scripts/cuda_env.sh); the build goes to $CUDA_TARGET_DIR (default
# target/cuda), the stripped binary to $GPU_DIST (default .gpu/vramlab) and
# compressed beside it (.gpu/vramlab.xz, what travels).
#
# The binary links libcuda.so.1 (the driver's) and libcudnn.so.9 (cuDNN 9),
# which stubs with their functions' names stand in for at link time, and
# CUDA 13's libcudart, libcublas, libcublasLt, libcurand and libnvrtc, all
# found at run time through LD_LIBRARY_PATH.
#
# It takes long (candle-kernels compiles every kernel with nvcc): it is not
# part of the normal build or of the test command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

say() { printf '\n==> %s\n' "$*"; }

. "$ROOT/scripts/cuda_env.sh"

DIST="${GPU_DIST:-$ROOT/.gpu}"
LINK="$CARGO_TARGET_DIR/link"
mkdir -p "$LINK" "$DIST"

say "the libraries the linker asks for by their plain names ($LINK)"
for library in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
    [ -e "$CUDA_ROOT/lib/$library" ] || { echo "missing $CUDA_ROOT/lib/$library" >&2; exit 1; }
    ln -sf "$CUDA_ROOT/lib/$library" "$LINK/${library%%.so*}.so"
done
cudarc="$(cargo metadata --format-version 1 --locked --features vramlab/cuda |
    python3 -c 'import json, os, sys; print(next(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"))')"
# Stubs with the functions' names stand in for the libraries no wheel here
# ships, at link time only: the driver's libcuda.so.1, cuDNN 9's
# libcudnn.so.9 and, for `--features mpi,nccl`, NCCL's libnccl.so.2 (the GPU
# machine's torch venv has the real ones).
stub() { # name soname sys-module pattern
    grep -ohE "\\bfn $4[A-Za-z0-9_]+\\(" "$cudarc/src/$3/sys/mod.rs" | sed -E 's/fn (.*)\(/void \1(void) {}/' | sort -u >"$LINK/$1_stub.c"
    cc -shared -fPIC -Wl,-soname,"$2" -o "$LINK/$1.so" "$LINK/$1_stub.c"
    echo "$1.so stub ($2): $(wc -l <"$LINK/$1_stub.c") functions"
}
stub libcuda libcuda.so.1 driver cu
stub libcudnn libcudnn.so.9 cudnn cudnn
stub libnccl libnccl.so.2 nccl nccl
export LIBRARY_PATH="$LINK${LIBRARY_PATH:+:$LIBRARY_PATH}"

say "cargo build of vramlab with the cuda feature (compute capability $CUDA_COMPUTE_CAP, target dir $CARGO_TARGET_DIR)"
cargo build --release --locked -p vramlab --features cuda --bin vramlab "$@"

strip -o "$DIST/vramlab" "$CARGO_TARGET_DIR/release/vramlab"
say "$DIST/vramlab: $(($(stat -c %s "$DIST/vramlab") >> 20)) MiB; it needs:"
readelf -d "$DIST/vramlab" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/  \1/p'
# Candle's PTX and kernel library make the binary larger than what travels
# to the GPU machine; compressed it is a tenth (gpu_check.sh unpacks it there).
xz -T0 -6 -c "$DIST/vramlab" >"$DIST/vramlab.xz"
size=$(stat -c %s "$DIST/vramlab.xz")
say "$DIST/vramlab.xz: $((size >> 20)) MiB, the file to carry"
if [ "$size" -gt $((48 << 20)) ]; then
    echo "$DIST/vramlab.xz is over 48 MiB: with the working tree it would not fit the 64 MiB that travels" >&2
    exit 1
fi
