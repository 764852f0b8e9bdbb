//! The ops' CPU bodies and what they share: the convolution's kernels
//! (im2col and gemm, Winograd, tap by tap, depthwise) and the choice among
//! them, the gemm plan, the model of gemm's packing buffers, SiLU's vectorised `e^x`,
//! and the conversions between candle's storages and the f32 buffers the
//! kernels compute in.

pub(super) mod conv;
pub(super) mod depthwise;
pub(super) mod floats;
pub(super) mod gemm;
pub(super) mod gemm_packing;
mod im2col;
pub(super) mod pool;
pub(super) mod silu;
pub(super) mod taps;
pub(super) mod winograd;

/// Elements per task of the elementwise passes.
pub(super) const CHUNK: usize = 1 << 14;
