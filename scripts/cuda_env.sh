# Sourced by check_cuda.sh and build_cuda.sh: the CUDA 13.0 toolkit from
# NVIDIA's PyPI wheels (scripts/cuda-requirements.txt) in a venv at $CUDA_VENV
# (default .venv-cuda), and the environment candle-kernels and cudarc build
# with. Expects ROOT and say().
#
# CUDA_COMPUTE_CAP defaults to 90 (Hopper: H100/H200, the cards the lessons
# target): candle-kernels compiles its PTX and its static kernel library for
# this one architecture, and without a GPU it cannot ask nvidia-smi.

CUDA_VENV="${CUDA_VENV:-$ROOT/.venv-cuda}"
REQUIREMENTS="$ROOT/scripts/cuda-requirements.txt"

if [ ! -x "$CUDA_VENV/bin/python" ]; then
    say "creating the CUDA toolkit venv ($CUDA_VENV)"
    python3 -m venv "$CUDA_VENV"
fi
if ! cmp -s "$REQUIREMENTS" "$CUDA_VENV/.cuda-requirements.txt"; then
    say "installing the CUDA compiler, headers and libraries ($REQUIREMENTS)"
    "$CUDA_VENV/bin/python" -m pip install -q -r "$REQUIREMENTS"
    cp "$REQUIREMENTS" "$CUDA_VENV/.cuda-requirements.txt"
fi

CUDA_ROOT="$("$CUDA_VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
export CUDA_ROOT CUDA_PATH="$CUDA_ROOT" CUDA_HOME="$CUDA_ROOT"
export PATH="$CUDA_ROOT/bin:$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-$ROOT/target/cuda}"
nvcc --version | tail -n 2
