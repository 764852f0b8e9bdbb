//! The CUDA device's memory (feature `cuda`): candle allocates through
//! `cuMemAllocAsync` from the device's default memory pool, whose attributes
//! give what PyTorch calls allocated (used) and reserved, current and
//! high-water; the driver gives free and total.
//!
//! In the kernel's cell process the memory thread answers for the device
//! the cells use ([`CellDevice`]), and `%mem` shows it beside the host.

use std::ffi::c_void;
use std::sync::Arc;

use serde::Serialize;

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaContext, DriverError};

use super::answer::{concat, split, DEVICE_WORDS, MEMORY_WORDS};
use super::error::MemoryError;
use super::region::Request;
use crate::render::Table;
use crate::units::{grouped, human};

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

impl CudaMemory {
    /// Reserved but not in use: the pool's idle cache.
    pub fn idle(&self) -> u64 {
        self.reserved.saturating_sub(self.used)
    }
}

/// What trimming the pool did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CudaEmptyCache {
    pub before: CudaMemory,
    pub after: CudaMemory,
}

impl CudaEmptyCache {
    /// Bytes the pool gave back to the device.
    pub fn released(&self) -> u64 {
        self.before.reserved.saturating_sub(self.after.reserved)
    }
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
        let cuda_device = device.as_cuda_device().map_err(|e| MemoryError::Cuda { what: "the device", reason: e.to_string() })?;
        CudaProbe::for_context(Arc::clone(cuda_device.cuda_stream().context()))
    }

    /// The probe of `context`'s device; measures the context's size once, now.
    pub fn for_context(context: Arc<CudaContext>) -> Result<CudaProbe, MemoryError> {
        context.bind_to_thread().map_err(cuda("binding the context"))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: writes the device's default pool handle into `pool`.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, context.cu_device()) }.result().map_err(cuda("cuDeviceGetDefaultMemPool"))?;
        let mut probe = CudaProbe { context, pool, context_bytes: 0 };
        let first = probe.sample()?;
        probe.context_bytes = first.total.saturating_sub(first.free).saturating_sub(first.reserved);
        Ok(probe)
    }

    /// The probe of the first device this process already works on (its
    /// primary context is active); `None` while the process has not used
    /// CUDA. Never initialises CUDA or creates a context itself: a process
    /// that has not touched the GPU stays as it is.
    pub fn in_use() -> Result<Option<CudaProbe>, MemoryError> {
        let count = match result::device::get_count() {
            Ok(count) => count,
            Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NOT_INITIALIZED)) => return Ok(None),
            Err(err) => return Err(cuda("cuDeviceGetCount")(err)),
        };
        for ordinal in 0..count {
            let device = result::device::get(ordinal).map_err(cuda("cuDeviceGet"))?;
            let (mut flags, mut active) = (0u32, 0i32);
            // SAFETY: a device handle from cuDeviceGet; both outputs are plain integers.
            unsafe { sys::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active) }
                .result()
                .map_err(cuda("cuDevicePrimaryCtxGetState"))?;
            if active != 0 {
                let context = CudaContext::new(ordinal as usize).map_err(cuda("retaining the primary context"))?;
                return CudaProbe::for_context(context).map(Some);
            }
        }
        Ok(None)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.context.ordinal()
    }

    fn attribute(&self, attribute: sys::CUmemPool_attribute) -> Result<u64, MemoryError> {
        let mut value: u64 = 0;
        // SAFETY: these pool attributes are 64-bit values written to `value`.
        unsafe { result::mem_pool::get_attribute(self.pool, attribute, &mut value as *mut u64 as *mut c_void) }
            .map_err(cuda("cuMemPoolGetAttribute"))?;
        Ok(value)
    }

    fn set_attribute(&self, attribute: sys::CUmemPool_attribute, mut value: u64) -> Result<(), MemoryError> {
        // SAFETY: as above; the driver reads a 64-bit value.
        unsafe { result::mem_pool::set_attribute(self.pool, attribute, &mut value as *mut u64 as *mut c_void) }
            .map_err(cuda("cuMemPoolSetAttribute"))
    }

    pub fn sample(&self) -> Result<CudaMemory, MemoryError> {
        use sys::CUmemPool_attribute::*;
        let (free, total) = self.context.mem_get_info().map_err(cuda("cuMemGetInfo"))?;
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

    /// A reading once the device has finished the work queued so far: candle
    /// frees in stream order, so before that `used` still counts freed tensors.
    pub fn settled(&self) -> Result<CudaMemory, MemoryError> {
        self.context.synchronize().map_err(cuda("cuCtxSynchronize"))?;
        self.sample()
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
        unsafe { result::mem_pool::trim_to(self.pool, 0) }.map_err(cuda("cuMemPoolTrimTo"))?;
        Ok(CudaEmptyCache { before, after: self.sample()? })
    }
}

/// The cell process's side: finds the device its cells work on (once they
/// use one) and answers the kernel's requests for it.
#[derive(Default)]
pub(crate) struct CellDevice {
    probe: Option<CudaProbe>,
}

impl CellDevice {
    /// The device's part of the answer to `request`.
    pub(crate) fn read(&mut self, request: Request) -> DeviceAnswer {
        if self.probe.is_none() {
            match CudaProbe::in_use() {
                Ok(probe) => self.probe = probe,
                Err(_) => return DeviceAnswer::Failed,
            }
        }
        let Some(probe) = &self.probe else { return DeviceAnswer::NotInUse };
        let reading = match request {
            Request::Sample => probe.sample().map(|m| (m, m)),
            Request::ResetPeak => probe.reset_peak().map(|m| (m, m)),
            Request::EmptyCache => probe.empty_cache().map(|e| (e.before, e.after)),
        };
        match reading {
            Ok((before, after)) => DeviceAnswer::Read { ordinal: probe.ordinal(), after, before },
            Err(_) => DeviceAnswer::Failed,
        }
    }
}

/// The CUDA device's part of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum DeviceAnswer {
    /// The cell process has not used CUDA yet.
    #[default]
    NotInUse,
    /// Reading the device failed in the cell process (an answer carries no
    /// text: `CudaProbe::in_use()` in a cell shows the driver's error).
    Failed,
    /// The pool of device `ordinal` after the request and before it.
    Read { ordinal: usize, after: CudaMemory, before: CudaMemory },
}

const NOT_IN_USE: u64 = 0;
const READ: u64 = 1;
const FAILED: u64 = 2;

impl DeviceAnswer {
    pub(crate) fn to_words(self) -> [u64; DEVICE_WORDS] {
        let none = [0; 2 * MEMORY_WORDS];
        match self {
            DeviceAnswer::NotInUse => concat([NOT_IN_USE, 0], none),
            DeviceAnswer::Failed => concat([FAILED, 0], none),
            DeviceAnswer::Read { ordinal, after, before } => {
                let readings: [u64; 2 * MEMORY_WORDS] = concat(memory_words(&after), memory_words(&before));
                concat([READ, ordinal as u64], readings)
            }
        }
    }

    pub(crate) fn from_words(words: [u64; DEVICE_WORDS]) -> DeviceAnswer {
        let ([status, ordinal], readings): ([u64; 2], [u64; 2 * MEMORY_WORDS]) = split(words);
        match status {
            READ => {
                let (after, before): ([u64; MEMORY_WORDS], [u64; MEMORY_WORDS]) = split(readings);
                DeviceAnswer::Read { ordinal: ordinal as usize, after: memory_of(after), before: memory_of(before) }
            }
            FAILED => DeviceAnswer::Failed,
            _ => DeviceAnswer::NotInUse,
        }
    }
}

fn memory_words(m: &CudaMemory) -> [u64; MEMORY_WORDS] {
    [m.used, m.used_high, m.reserved, m.reserved_high, m.free, m.total, m.context]
}

fn memory_of([used, used_high, reserved, reserved_high, free, total, context]: [u64; MEMORY_WORDS]) -> CudaMemory {
    CudaMemory { used, used_high, reserved, reserved_high, free, total, context }
}

/// What `%mem` knows about the cell process's CUDA device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum CellCuda {
    /// The cell process has not used CUDA yet.
    NotInUse,
    /// Reading the device failed in the cell process (the answer carries no
    /// text: `CudaProbe::in_use()` in a cell shows the driver's error).
    Failed,
    Read {
        ordinal: usize,
        memory: CudaMemory,
        /// What `--empty-cache` did to the pool, when asked.
        emptied: Option<CudaEmptyCache>,
    },
}

impl CellCuda {
    /// What the device's part of an answer to `request` says, in its words.
    pub(crate) fn from_answer(request: Request, words: [u64; DEVICE_WORDS]) -> CellCuda {
        match DeviceAnswer::from_words(words) {
            DeviceAnswer::Read { ordinal, after, before } => CellCuda::Read {
                ordinal,
                memory: after,
                emptied: (request == Request::EmptyCache).then_some(CudaEmptyCache { before, after }),
            },
            DeviceAnswer::Failed => CellCuda::Failed,
            DeviceAnswer::NotInUse => CellCuda::NotInUse,
        }
    }

    /// The device's table, or the line saying why there is none.
    pub fn table(&self) -> Result<Table, &'static str> {
        let (ordinal, m) = match self {
            CellCuda::Read { ordinal, memory, .. } => (ordinal, memory),
            CellCuda::NotInUse => {
                return Err("CUDA: the cell process has not used a GPU yet (a cell that creates a CUDA device starts one).")
            }
            CellCuda::Failed => {
                return Err("CUDA: reading the device failed in the cell process; run vramlab::memory::cuda::CudaProbe::in_use() in a cell to see the driver's error.")
            }
        };
        let mut table = Table::new(["", "bytes", "size", "what"])
            .title(format!("CUDA device {ordinal}: the memory pool of cuMemAllocAsync"))
            .right_align(&[1, 2]);
        let mut row = |name: &str, bytes: u64, what: &str| {
            table.push_row([name.to_owned(), grouped(bytes), human(bytes), what.to_owned()]);
        };
        row("used", m.used, "live tensors (memory_allocated)");
        row("used peak", m.used_high, "high-water mark since the last reset (max_memory_allocated)");
        row("reserved", m.reserved, "held by the pool (memory_reserved)");
        row("reserved peak", m.reserved_high, "high-water mark since the last reset (max_memory_reserved)");
        row("idle in the pool", m.idle(), "reserved but not used");
        row("context and others", m.context, "outside the pool when first read: CUDA context, cuBLAS workspace, modules, other processes");
        table.push_row([
            "free / total".to_owned(),
            format!("{} / {}", grouped(m.free), grouped(m.total)),
            format!("{} / {}", human(m.free), human(m.total)),
            "the driver's view of the whole device".to_owned(),
        ]);
        Ok(table)
    }

    /// The line saying what `--empty-cache` did to the pool, when asked.
    pub fn headline(&self) -> Option<String> {
        let CellCuda::Read { emptied: Some(e), .. } = self else { return None };
        Some(format!(
            "empty_cache (cuMemPoolTrimTo): reserved {} -> {}, device free {} -> {}; used stays {}",
            human(e.before.reserved),
            human(e.after.reserved),
            human(e.before.free),
            human(e.after.free),
            human(e.after.used)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::probes::answer::{Answer, WORDS};

    #[test]
    fn a_reading_survives_the_answer_slots_and_renders_as_the_pool_table() {
        let after = CudaMemory {
            used: 1 << 30,
            used_high: 3 << 30,
            reserved: 2 << 30,
            reserved_high: 4 << 30,
            free: 100 << 30,
            total: 141 << 30,
            context: 600 << 20,
        };
        let before = CudaMemory { reserved: 5 << 30, free: 97 << 30, ..after };
        let answer = Answer { device: DeviceAnswer::Read { ordinal: 1, after, before }.to_words(), ..Answer::default() };
        let device = Answer::from_words(answer.to_words()).device;
        let read = CellCuda::from_answer(Request::EmptyCache, device);
        assert_eq!(read, CellCuda::Read { ordinal: 1, memory: after, emptied: Some(CudaEmptyCache { before, after }) });
        assert_eq!(CellCuda::from_answer(Request::Sample, device), CellCuda::Read { ordinal: 1, memory: after, emptied: None });
        let text = read.table().unwrap().to_string();
        assert!(text.contains("CUDA device 1") && text.contains("1.00 GiB") && text.contains("600 MiB"), "{text}");
        assert!(read.headline().unwrap().contains("reserved 5.00 GiB -> 2.00 GiB"));
        assert_eq!(CellCuda::from_answer(Request::Sample, Answer::from_words([0; WORDS]).device), CellCuda::NotInUse);
        assert!(CellCuda::NotInUse.table().unwrap_err().contains("not used a GPU"));
    }
}
