//! CPU storage in and out of the f32 buffers the kernels compute in.

use std::borrow::Cow;
use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::super::OpError;
use super::CHUNK;

/// The contiguous elements of `storage` as f32: borrowed for f32, converted
/// for f16 and bf16.
pub(in crate::ops) fn f32_view<'a>(op: &'static str, storage: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [f32]>> {
    let (start, end) = layout.contiguous_offsets().ok_or(OpError::NotContiguous { op })?;
    Ok(match storage {
        CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
        CpuStorage::F16(v) => Cow::Owned(widened(&v[start..end])),
        CpuStorage::BF16(v) => Cow::Owned(widened(&v[start..end])),
        other => Err(OpError::UnsupportedDType { op, dtype: other.dtype() })?,
    })
}

/// `len` zeros, written on rayon's threads. A zeroed allocation of fresh
/// pages has them faulted in one at a time wherever they are first written,
/// inside gemm (an input gradient of 6304 x 768 floats on 2 threads: 19 ms,
/// 15.5 ms with its pages touched here first).
pub(in crate::ops) fn zeros(len: usize) -> Vec<f32> {
    par_filled(len, CONVERT_CHUNK, 0.0, |_, _| {})
}

/// `rows` copies of the contiguous elements of `storage` one after another,
/// as f32, written on rayon's threads: a half-precision vector is converted
/// straight into each copy, without an f32 copy of its own.
pub(in crate::ops) fn rows_of(op: &'static str, storage: &CpuStorage, layout: &Layout, rows: usize) -> Result<Vec<f32>> {
    let (start, end) = layout.contiguous_offsets().ok_or(OpError::NotContiguous { op })?;
    Ok(match storage {
        CpuStorage::F32(v) => repeated(&v[start..end], rows, |row, dst| dst.copy_from_slice(row)),
        CpuStorage::F16(v) => repeated(&v[start..end], rows, |row, dst| row.convert_to_f32_slice(dst)),
        CpuStorage::BF16(v) => repeated(&v[start..end], rows, |row, dst| row.convert_to_f32_slice(dst)),
        other => Err(OpError::UnsupportedDType { op, dtype: other.dtype() })?,
    })
}

/// `rows` copies of `row` converted by `convert`, a task taking whole rows.
fn repeated<T: Sync>(row: &[T], rows: usize, convert: impl Fn(&[T], &mut [f32]) + Sync + Send) -> Vec<f32> {
    let width = row.len();
    if width == 0 {
        return Vec::new();
    }
    let chunk = (CONVERT_CHUNK / width).max(1) * width;
    par_filled(rows * width, chunk, 0.0, |_, part| part.chunks_exact_mut(width).for_each(|dst| convert(row, dst)))
}

/// `values` stored as `dtype` (one of f32, f16, bf16).
pub(in crate::ops) fn storage_from_f32(op: &'static str, values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
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
pub(in crate::ops) fn init_with<T: Copy>(part: &mut [MaybeUninit<T>], value: T) -> &mut [T] {
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
pub(in crate::ops) fn par_chunks_from<T: Copy + Send + Sync, S>(
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
pub(in crate::ops) fn par_filled<T: Copy + Send + Sync>(
    len: usize,
    chunk: usize,
    zero: T,
    fill: impl Fn(usize, &mut [T]) + Sync + Send,
) -> Vec<T> {
    par_chunks_from(len, chunk, zero, || (), |_, i, part| fill(i, part))
}

/// Rounds f32 values to what a tensor of `dtype` stores, as the plain ops do
/// when they write a half-precision result.
pub(in crate::ops) fn round_to(dtype: DType, values: &mut [f32]) {
    if matches!(dtype, DType::F16 | DType::BF16) {
        values.par_chunks_mut(CHUNK).for_each(|c| round_to_serial(dtype, c));
    }
}

/// [`round_to`] on one thread: a block at a time through a buffer on the
/// stack and the half crate's slice conversions (F16C where the CPU has
/// it). A buffer on the heap per call was 18% of an f16 ResNet18 step on
/// 2 threads: the calls are per plane and per chunk, and every allocation
/// passes the process's shared counters.
pub(in crate::ops) fn round_to_serial(dtype: DType, values: &mut [f32]) {
    match dtype {
        DType::F16 => round_through(values, half::f16::ZERO),
        DType::BF16 => round_through(values, half::bf16::ZERO),
        _ => {}
    }
}

/// `values` rounded to the half type of `zero` and back, through a block on the stack.
fn round_through<H: Copy>(values: &mut [f32], zero: H)
where
    [H]: half::slice::HalfFloatSliceExt,
{
    use half::slice::HalfFloatSliceExt;
    const BLOCK: usize = 1024;
    let mut half = [zero; BLOCK];
    for block in values.chunks_mut(BLOCK) {
        let half = &mut half[..block.len()];
        half.convert_from_f32_slice(block);
        half.convert_to_f32_slice(block);
    }
}
