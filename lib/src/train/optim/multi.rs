//! Multi-tensor updates: every parameter of a model in one kernel launch on
//! CUDA (`lib/kernels/optim.cu`), where the per-tensor path launches several
//! kernels and allocates temporaries for each parameter. The table the
//! kernels read and its blocks are laid out here, tested without a GPU.

/// Elements one CUDA block updates.
pub(super) const CHUNK: u64 = 1 << 14;

/// One tensor of an update, as the kernels read it (`struct Entry` in
/// `kernels/optim.cu`, field for field): device addresses of the f32
/// parameter, its gradient and up to three state tensors, its length, the
/// first block that updates it, its own step's Adam constants, and whether it
/// is its first step (SGD's momentum buffer starts as the gradient).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Entry {
    pub param: u64,
    pub grad: u64,
    pub state: [u64; 3],
    pub len: u64,
    pub first_block: u64,
    pub step_size: f32,
    pub bias_correction2_sqrt: f32,
    pub first: u32,
    pub reserved: u32,
}

/// Drops the empty tensors and sets each entry's first block, `chunk`
/// elements a block, in order; returns the blocks in all.
pub(super) fn lay_out(entries: &mut Vec<Entry>, chunk: u64) -> u64 {
    entries.retain(|e| e.len > 0);
    let mut next = 0;
    for e in entries.iter_mut() {
        e.first_block = next;
        next += e.len.div_ceil(chunk);
    }
    next
}

/// The entry that block `block` updates, found as the kernels find it: the
/// last whose first block is at most `block`.
#[cfg(test)]
fn entry_of_block(entries: &[Entry], block: u64) -> usize {
    let (mut lo, mut hi) = (0, entries.len() - 1);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if entries[mid].first_block <= block {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(feature = "cuda")]
pub(super) mod device {
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{DType, Device, Result, Storage, Tensor, Var};

    use super::{lay_out, Entry, CHUNK};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/optim.ptx"));
    const MODULE: &str = "vramlab_optim";
    const THREADS: u32 = 256;

    /// The CUDA device every one of `vars` is on, as contiguous f32 tensors;
    /// `None` where any is not.
    pub fn device_of(vars: &[Var]) -> Option<CudaDevice> {
        let first = match vars.first()?.device() {
            Device::Cuda(dev) => dev.clone(),
            _ => return None,
        };
        vars.iter()
            .all(|v| v.dtype() == DType::F32 && v.is_contiguous() && matches!(v.device(), Device::Cuda(d) if d.id() == first.id()))
            .then_some(first)
    }

    /// The entry of `var`, updated from its contiguous gradient `g`; its
    /// state and constants are the optimizer's to set.
    pub fn entry(var: &Var, g: &Tensor) -> Result<Entry> {
        Ok(Entry { param: address(var.as_tensor())?, grad: address(g)?, len: var.elem_count() as u64, ..Entry::default() })
    }

    /// The device address of a contiguous f32 CUDA tensor's first element.
    pub fn address(t: &Tensor) -> Result<u64> {
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

    /// Uploads the table and launches `kernel` over every block of it, with
    /// the kernel's own arguments after the table, its length and `CHUNK`:
    /// its floats, then its ints, the order every kernel declares them in.
    fn launch(dev: &CudaDevice, kernel: &str, mut entries: Vec<Entry>, push: impl FnOnce(&mut Vec<f32>, &mut Vec<i32>)) -> Result<()> {
        let blocks = lay_out(&mut entries, CHUNK);
        if blocks == 0 {
            return Ok(());
        }
        let blocks =
            u32::try_from(blocks).map_err(|_| candle_core::Error::msg("multi-tensor update: more blocks than one launch takes"))?;
        // The table as bytes: `Entry` is `repr(C)` with no padding.
        let bytes = unsafe { std::slice::from_raw_parts(entries.as_ptr().cast::<u8>(), std::mem::size_of_val(entries.as_slice())) };
        let table = dev.cuda_stream().clone_htod(bytes).map_err(candle_core::Error::wrap)?;
        let (mut floats, mut ints) = (Vec::new(), Vec::new());
        push(&mut floats, &mut ints);
        let func = dev.get_or_load_custom_func(kernel, MODULE, PTX)?;
        let count = entries.len() as i32;
        let mut args = func.builder();
        args.arg(&table).arg(&count).arg(&CHUNK);
        for f in &floats {
            args.arg(f);
        }
        for i in &ints {
            args.arg(i);
        }
        let config = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        unsafe { args.launch(config) }.map_err(candle_core::Error::wrap)?;
        Ok(())
    }

    /// SGD's hyperparameters as the kernel takes them.
    pub struct SgdArgs {
        pub lr: f32,
        pub momentum: f32,
        pub keep: f32,
        pub weight_decay: f32,
        pub nesterov: bool,
    }

    pub fn sgd(dev: &CudaDevice, entries: Vec<Entry>, a: SgdArgs) -> Result<()> {
        launch(dev, "sgd_f32", entries, |floats, ints| {
            floats.extend([a.lr, a.momentum, a.keep, a.weight_decay]);
            ints.push(i32::from(a.nesterov));
        })
    }

    /// Adam's step-independent hyperparameters as the kernel takes them.
    pub struct AdamArgs {
        pub one_minus_beta1: f32,
        pub beta2: f32,
        pub one_minus_beta2: f32,
        pub eps: f32,
        pub weight_decay: f32,
        pub shrink: f32,
        pub decoupled: bool,
        pub amsgrad: bool,
    }

    pub fn adam(dev: &CudaDevice, entries: Vec<Entry>, a: AdamArgs) -> Result<()> {
        launch(dev, "adam_f32", entries, |floats, ints| {
            floats.extend([a.one_minus_beta1, a.beta2, a.one_minus_beta2, a.eps, a.weight_decay, a.shrink]);
            ints.extend([i32::from(a.decoupled), i32::from(a.amsgrad)]);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(lens: &[u64]) -> Vec<Entry> {
        lens.iter().map(|&len| Entry { len, ..Entry::default() }).collect()
    }

    #[test]
    fn the_table_is_laid_out_as_the_kernels_read_it() {
        // 7 u64 fields, then 2 f32 and 2 u32: 72 bytes, no padding.
        assert_eq!(std::mem::size_of::<Entry>(), 72);
        assert_eq!(std::mem::align_of::<Entry>(), 8);
        assert_eq!(std::mem::offset_of!(Entry, first_block), 48);
        assert_eq!(std::mem::offset_of!(Entry, step_size), 56);
        assert_eq!(std::mem::offset_of!(Entry, first), 64);
    }

    #[test]
    fn every_block_updates_one_chunk_of_one_tensor() {
        let mut table = entries(&[10, 0, 64, 3, 1, 65]);
        let blocks = lay_out(&mut table, 16);
        assert_eq!(table.len(), 5, "the empty tensor is dropped");
        assert_eq!(table.iter().map(|e| e.first_block).collect::<Vec<_>>(), [0, 1, 5, 6, 7]);
        assert_eq!(blocks, 12);
        // Each element of each tensor is covered by exactly one block.
        let mut covered: Vec<Vec<u32>> = table.iter().map(|e| vec![0; e.len as usize]).collect();
        for block in 0..blocks {
            let t = entry_of_block(&table, block);
            let start = (block - table[t].first_block) * 16;
            for i in start..(start + 16).min(table[t].len) {
                covered[t][i as usize] += 1;
            }
        }
        assert!(covered.iter().all(|c| c.iter().all(|&n| n == 1)), "{covered:?}");
    }

    #[test]
    fn resnet50_s_parameters_fit_one_launch() {
        // 161 tensors, 25.6 M values: about 1,600 blocks of 16,384.
        let mut table = entries(&[25_557_032 / 161; 161]);
        let blocks = lay_out(&mut table, CHUNK);
        assert!((25_557_032 / CHUNK..2_000).contains(&blocks), "{blocks}");
        assert_eq!(entry_of_block(&table, blocks - 1), 160);
    }
}
