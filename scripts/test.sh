#!/usr/bin/env bash
# Every test: formatting and lints, the Rust unit and end-to-end tests (the kernel binary driven
# over ZeroMQ), the ops' check on the CPU and of their CUDA passes on the
# reference primitives, then jupyter_kernel_test, papermill and the notebooks,
# JupyterLab in headless Chromium, jupyter console and the rendered HTML.
# One build cache for every kernel the tests start, so the library that cells
# use is compiled once, by set-up (kernel tests run one at a time for the same
# reason). It must lie outside this Cargo workspace for evcxr to build there.
export VRAMLAB_CACHE_DIR="${TMPDIR:-/tmp}/vramlab-test-cache"
source "$(dirname "$0")/setup.sh"

# Headless Chromium for the JupyterLab test: Debian's package, which Playwright drives
# (Playwright's own browser download is not used).
if ! command -v chromium >/dev/null 2>&1; then
    say "installing chromium"
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; else sudo apt-get update -qq && sudo apt-get install -y -qq chromium; fi
fi

say "cargo fmt --check, cargo clippy"
for component in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$component" || rustup component add "$component"
done
cargo fmt --check
# In the release profile, so the build scripts' outputs (libjpeg-turbo's) are the build's.
cargo clippy --release --locked --workspace --all-targets --features vramlab/mpi -- -D warnings

say "cargo test"
cargo test --release --locked --workspace --features vramlab/mpi -- --test-threads=1
"${CARGO_TARGET_DIR:-$ROOT/target}/release/vramlab" check-ops --device cpu
# The ops' CUDA passes on the reference primitives: everything the CUDA path decides, without a card.
"${CARGO_TARGET_DIR:-$ROOT/target}/release/vramlab" check-ops --device reference

say "Jupyter clients: jupyter_kernel_test, kernelspec, notebooks"
.venv/bin/python -m pytest -q -rs --durations=15 tests/python
