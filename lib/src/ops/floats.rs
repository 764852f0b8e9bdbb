//! CPU storage in and out of the f32 buffers the kernels compute in.

use std::borrow::Cow;
use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::OpError;

/// The contiguous elements of `storage` as f32: borrowed for f32, converted
/// for f16 and bf16.
pub(super) fn f32_view<'a>(op: &'static str, storage: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [f32]>> {
    let (start, end) = layout.contiguous_offsets().ok_or(OpError::NotContiguous { op })?;
    Ok(match storage {
        CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
        CpuStorage::F16(v) => Cow::Owned(widened(&v[start..end])),
        CpuStorage::BF16(v) => Cow::Owned(widened(&v[start..end])),
        other => Err(OpError::UnsupportedDType { op, dtype: other.dtype() })?,
    })
}

/// `values` stored as `dtype` (one of f32, f16, bf16).
pub(super) fn storage_from_f32(op: &'static str, values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(values),
        DType::F16 => CpuStorage::F16(narrowed(&values, half::f16::ZERO)),
        DType::BF16 => CpuStorage::BF16(narrowed(&values, half::bf16::ZERO)),
        dtype => Err(OpError::UnsupportedDType { op, dtype })?,
    })
}

/// Elements a conversion task takes: under mixed precision every op widens
/// its half input and narrows its result, and on one thread those passes
/// left the others waiting.
const CONVERT_CHUNK: usize = 1 << 15;

/// Half-precision values as f32, converted on rayon's threads.
fn widened<H: Copy + Send + Sync>(values: &[H]) -> Vec<f32>
where
    [H]: HalfFloatSliceExt,
{
    par_filled(values.len(), CONVERT_CHUNK, 0.0, |i, part| values[i * CONVERT_CHUNK..][..part.len()].convert_to_f32_slice(part))
}

/// f32 values as half precision (rounded to nearest, ties to even), converted on rayon's threads.
fn narrowed<H: Copy + Send + Sync>(values: &[f32], zero: H) -> Vec<H>
where
    [H]: HalfFloatSliceExt,
{
    par_filled(values.len(), CONVERT_CHUNK, zero, |i, part| part.convert_from_f32_slice(&values[i * CONVERT_CHUNK..][..part.len()]))
}

/// `part` set to `value`, as the initialised slice it now is.
pub(super) fn init_with<T: Copy>(part: &mut [MaybeUninit<T>], value: T) -> &mut [T] {
    part.fill(MaybeUninit::new(value));
    // SAFETY: every element was written just above, and `MaybeUninit<T>` has
    // the layout of `T`.
    unsafe { &mut *(part as *mut [MaybeUninit<T>] as *mut [T]) }
}

/// `len` elements made chunk by chunk (`chunk` long, the last shorter) by
/// `fill(state, i, chunk)` on rayon's threads, each chunk set to `zero`
/// first by the thread that fills it: a zeroed allocation is one more pass
/// over the whole buffer, on the calling thread alone. `init` makes a
/// thread's `state`, as in `for_each_init`.
pub(super) fn par_chunks_from<T: Copy + Send + Sync, S>(
    len: usize,
    chunk: usize,
    zero: T,
    init: impl Fn() -> S + Sync + Send,
    fill: impl Fn(&mut S, usize, &mut [T]) + Sync + Send,
) -> Vec<T> {
    let mut values = Vec::with_capacity(len);
    values.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .enumerate()
        .for_each_init(init, |state, (i, part)| fill(state, i, init_with(part, zero)));
    // SAFETY: the chunks cover the first `len` elements, each written by `init_with`.
    unsafe { values.set_len(len) };
    values
}

/// [`par_chunks_from`] for a fill that keeps no state of its own.
pub(super) fn par_filled<T: Copy + Send + Sync>(len: usize, chunk: usize, zero: T, fill: impl Fn(usize, &mut [T]) + Sync + Send) -> Vec<T> {
    par_chunks_from(len, chunk, zero, || (), |_, i, part| fill(i, part))
}
