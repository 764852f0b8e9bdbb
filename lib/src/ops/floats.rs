//! CPU storage in and out of the f32 buffers the kernels compute in.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result};
use half::slice::HalfFloatSliceExt;

use super::OpError;

/// The contiguous elements of `storage` as f32: borrowed for f32, converted
/// for f16 and bf16.
pub(super) fn f32_view<'a>(op: &'static str, storage: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [f32]>> {
    let (start, end) = layout.contiguous_offsets().ok_or(OpError::NotContiguous { op })?;
    Ok(match storage {
        CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
        CpuStorage::F16(v) => Cow::Owned(v[start..end].to_f32_vec()),
        CpuStorage::BF16(v) => Cow::Owned(v[start..end].to_f32_vec()),
        other => Err(OpError::UnsupportedDType { op, dtype: other.dtype() })?,
    })
}

/// `values` stored as `dtype` (one of f32, f16, bf16).
pub(super) fn storage_from_f32(op: &'static str, values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(values),
        DType::F16 => CpuStorage::F16(half::vec::HalfFloatVecExt::from_f32_slice(&values)),
        DType::BF16 => CpuStorage::BF16(half::vec::HalfFloatVecExt::from_f32_slice(&values)),
        dtype => Err(OpError::UnsupportedDType { op, dtype })?,
    })
}
