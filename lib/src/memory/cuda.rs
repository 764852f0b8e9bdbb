//! The CUDA device's memory (feature `cuda`): candle allocates through
//! `cuMemAllocAsync` from the device's default memory pool, whose attributes
//! give what PyTorch calls allocated (used) and reserved, current and
//! high-water; the driver gives free and total.

use std::ffi::c_void;
use std::sync::Arc;

use serde::Serialize;

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaContext, DriverError};

use super::MemoryError;

/// One reading of the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CudaMemory {
    /// Bytes of live allocations from the pool (`memory_allocated`), and their high-water mark.
    pub used: u64,
    pub used_high: u64,
    /// Bytes the pool holds from the device (`memory_reserved`), and their high-water mark.
    pub reserved: u64,
    pub reserved_high: u64,
    /// The driver's free and total bytes for the whole device (every process).
    pub free: u64,
    pub total: u64,
    /// What was in use outside the pool when the probe was made: the CUDA
    /// context, cuBLAS workspace, loaded modules (and other processes).
    pub context: u64,
}

/// What trimming the pool did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CudaEmptyCache {
    pub before: CudaMemory,
    pub after: CudaMemory,
}

/// The memory pool of one CUDA device.
pub struct CudaProbe {
    context: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
    context_bytes: u64,
}

// SAFETY: the pool handle is a driver object usable from any thread once the
// context is bound, which every method does first.
unsafe impl Send for CudaProbe {}
unsafe impl Sync for CudaProbe {}

fn cuda(what: &'static str) -> impl Fn(DriverError) -> MemoryError {
    move |err| MemoryError::Cuda { what, reason: err.to_string() }
}

impl CudaProbe {
    /// The probe of the device behind a candle `Device::Cuda`; measures the
    /// context's size once, now.
    pub fn new(device: &candle_core::Device) -> Result<CudaProbe, MemoryError> {
        let cuda_device = device
            .as_cuda_device()
            .map_err(|e| MemoryError::Cuda { what: "the device", reason: e.to_string() })?;
        let context = Arc::clone(cuda_device.cuda_stream().context());
        context.bind_to_thread().map_err(cuda("binding the context"))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: writes the device's default pool handle into `pool`.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, context.cu_device()) }
            .result()
            .map_err(cuda("cuDeviceGetDefaultMemPool"))?;
        let mut probe = CudaProbe { context, pool, context_bytes: 0 };
        let first = probe.sample()?;
        probe.context_bytes = first.total.saturating_sub(first.free).saturating_sub(first.reserved);
        Ok(probe)
    }

    fn attribute(&self, attribute: sys::CUmemPool_attribute) -> Result<u64, MemoryError> {
        let mut value: u64 = 0;
        // SAFETY: these pool attributes are 64-bit values written to `value`.
        unsafe { sys::cuMemPoolGetAttribute(self.pool, attribute, &mut value as *mut u64 as *mut c_void) }
            .result()
            .map_err(cuda("cuMemPoolGetAttribute"))?;
        Ok(value)
    }

    fn set_attribute(&self, attribute: sys::CUmemPool_attribute, mut value: u64) -> Result<(), MemoryError> {
        // SAFETY: as above; the driver reads a 64-bit value.
        unsafe { sys::cuMemPoolSetAttribute(self.pool, attribute, &mut value as *mut u64 as *mut c_void) }
            .result()
            .map_err(cuda("cuMemPoolSetAttribute"))
    }

    pub fn sample(&self) -> Result<CudaMemory, MemoryError> {
        use sys::CUmemPool_attribute::*;
        self.context.bind_to_thread().map_err(cuda("binding the context"))?;
        let (free, total) = result::mem_get_info().map_err(cuda("cuMemGetInfo"))?;
        Ok(CudaMemory {
            used: self.attribute(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: self.attribute(CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved: self.attribute(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: self.attribute(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            free: free as u64,
            total: total as u64,
            context: self.context_bytes,
        })
    }

    /// Starts both high-water marks again from the current values.
    pub fn reset_peak(&self) -> Result<CudaMemory, MemoryError> {
        use sys::CUmemPool_attribute::*;
        self.context.bind_to_thread().map_err(cuda("binding the context"))?;
        // Setting a high-water attribute to zero resets it to the current value.
        self.set_attribute(CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
        self.set_attribute(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)?;
        self.sample()
    }

    /// How much freed memory the pool keeps instead of returning it at the
    /// next synchronisation: `u64::MAX` makes it a cache like PyTorch's, 0
    /// (the driver's default) returns everything.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<(), MemoryError> {
        self.context.bind_to_thread().map_err(cuda("binding the context"))?;
        self.set_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, bytes)
    }

    /// `empty_cache`: waits for the device, then gives every unused byte of
    /// the pool back (`cuMemPoolTrimTo(pool, 0)`).
    pub fn empty_cache(&self) -> Result<CudaEmptyCache, MemoryError> {
        self.context.synchronize().map_err(cuda("cuCtxSynchronize"))?;
        let before = self.sample()?;
        // SAFETY: trims our device's default pool; live allocations are kept.
        unsafe { sys::cuMemPoolTrimTo(self.pool, 0) }.result().map_err(cuda("cuMemPoolTrimTo"))?;
        Ok(CudaEmptyCache { before, after: self.sample()? })
    }
}
