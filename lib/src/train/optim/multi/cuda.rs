//! The multi-tensor kernels of `lib/kernels/optim.cu` on candle's stream.

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result, Storage, Tensor};

use super::{Launch, Launcher};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/optim.ptx"));
const MODULE: &str = "vramlab_optim";
const THREADS: u32 = 256;

/// A CUDA device.
pub(super) struct Card(pub CudaDevice);

impl Launcher for Card {
    fn address(&self, t: &Tensor) -> Result<u64> {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cuda) = &*storage else { candle_core::bail!("multi-tensor update: a tensor is not on CUDA") };
        if !layout.is_contiguous() {
            candle_core::bail!("multi-tensor update: a tensor is not contiguous")
        }
        let slice = cuda.as_cuda_slice::<f32>()?;
        let stream = cuda.device.cuda_stream();
        let (base, _record) = slice.device_ptr(&stream);
        Ok(base + (layout.start_offset() * DType::F32.size_in_bytes()) as u64)
    }

    /// Uploads the table and launches the kernel over every block of it.
    fn launch(&self, launch: Launch<'_>) -> Result<()> {
        let Launch { kernel, table, blocks, chunk, floats, ints } = launch;
        let blocks =
            u32::try_from(blocks).map_err(|_| candle_core::Error::msg("multi-tensor update: more blocks than one launch takes"))?;
        // The table as bytes: `Entry` is `repr(C)` with no padding.
        let bytes = unsafe { std::slice::from_raw_parts(table.as_ptr().cast::<u8>(), std::mem::size_of_val(table)) };
        let table_on_card = self.0.cuda_stream().clone_htod(bytes).map_err(candle_core::Error::wrap)?;
        let func = self.0.get_or_load_custom_func(kernel.name(), MODULE, PTX)?;
        let count = table.len() as i32;
        let mut args = func.builder();
        args.arg(&table_on_card).arg(&count).arg(&chunk);
        for f in floats {
            args.arg(f);
        }
        for i in ints {
            args.arg(i);
        }
        let config = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        unsafe { args.launch(config) }.map_err(candle_core::Error::wrap)?;
        Ok(())
    }
}
