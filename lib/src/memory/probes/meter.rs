//! What a training step's memory is read from: the host's allocation
//! counters for a step on the CPU, the device's memory pool (feature `cuda`)
//! for a step on a CUDA GPU. Either gives the bytes in use now and the most
//! in use since a window was opened, so the trainer measures both the same way.

use candle_core::Device;

use super::error::MemoryError;
use super::host::HostMemory;

/// The memory a step on one device allocates from.
#[derive(Clone)]
pub enum StepMeter {
    /// The heap, through the allocation counters (exact only where they are installed).
    Host,
    /// The CUDA device's default pool, read after the device has finished
    /// the work queued so far (candle frees in stream order).
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<super::cuda::CudaProbe>),
    /// A device whose memory vramlab cannot read (Metal).
    Unmetered,
}

impl std::fmt::Debug for StepMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.source())
    }
}

impl StepMeter {
    /// The meter of the memory `device` allocates from.
    pub fn for_device(device: &Device) -> Result<StepMeter, MemoryError> {
        match device {
            Device::Cpu => Ok(StepMeter::Host),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Ok(StepMeter::Cuda(std::sync::Arc::new(super::cuda::CudaProbe::new(device)?))),
            _ => Ok(StepMeter::Unmetered),
        }
    }

    /// Whether every byte is counted, peaks included: the host with its
    /// allocation counters, or the CUDA pool.
    pub fn exact(&self) -> bool {
        match self {
            StepMeter::Host => HostMemory::sample().exact,
            #[cfg(feature = "cuda")]
            StepMeter::Cuda(_) => true,
            StepMeter::Unmetered => false,
        }
    }

    /// Bytes of live allocations now.
    pub fn in_use(&self) -> Result<u64, MemoryError> {
        match self {
            StepMeter::Host => Ok(HostMemory::sample().in_use),
            #[cfg(feature = "cuda")]
            StepMeter::Cuda(probe) => Ok(probe.settled()?.used),
            StepMeter::Unmetered => Ok(0),
        }
    }

    /// Starts the window for the peak of a step or a phase from what is in
    /// use now; the host's user peak (`%mem --reset`'s) is left alone.
    pub fn open_window(&self) -> Result<(), MemoryError> {
        match self {
            StepMeter::Host => {
                HostMemory::open_window();
                Ok(())
            }
            #[cfg(feature = "cuda")]
            StepMeter::Cuda(probe) => probe.reset_peak().map(drop),
            StepMeter::Unmetered => Ok(()),
        }
    }

    /// The most in use since [`StepMeter::open_window`]; `None` where peaks are not counted.
    pub fn window_peak(&self) -> Result<Option<u64>, MemoryError> {
        match self {
            StepMeter::Host => Ok(HostMemory::window_peak()),
            #[cfg(feature = "cuda")]
            StepMeter::Cuda(probe) => Ok(Some(probe.settled()?.used_high)),
            StepMeter::Unmetered => Ok(None),
        }
    }

    /// Bytes the device holds for this process outside the allocations the
    /// meter counts: on CUDA the driver's in-use bytes beyond the pool (the
    /// context, loaded kernels, cuBLAS's workspace); nothing on the host.
    pub fn outside_pool(&self) -> Result<u64, MemoryError> {
        match self {
            StepMeter::Host | StepMeter::Unmetered => Ok(0),
            #[cfg(feature = "cuda")]
            StepMeter::Cuda(probe) => {
                let now = probe.settled()?;
                Ok(now.total.saturating_sub(now.free).saturating_sub(now.reserved))
            }
        }
    }

    /// How the figures were read, for the tables that show them.
    pub fn source(&self) -> &'static str {
        match self {
            StepMeter::Host => "the host's allocation counters (exact; the host has no CUDA context)",
            #[cfg(feature = "cuda")]
            StepMeter::Cuda(_) => {
                "the CUDA pool's used bytes after a device synchronisation at each phase's end; \
                 context and workspace include the driver's in-use bytes outside the pool"
            }
            StepMeter::Unmetered => "nothing: this device's memory is not read",
        }
    }
}
