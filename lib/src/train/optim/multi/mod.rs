//! Multi-tensor updates: every parameter of a model in one kernel launch,
//! where the per-tensor path launches several kernels and allocates
//! temporaries for each parameter. The table the kernels read, its blocks
//! and the kernels' arguments are laid out here once, for two launchers: our
//! kernels on a card (`lib/kernels/optim.cu`, [`cuda`], the cuda feature)
//! and their twins on host memory ([`reference`]), which read the same table
//! through the same addresses, so that everything but the card's arithmetic
//! runs in `vramlab check-ops --device reference`.

#[cfg(feature = "cuda")]
mod cuda;
mod reference;

use candle_core::{DType, Result, Tensor, Var};

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

/// The kernels of `optim.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kernel {
    Sgd,
    Adam,
}

impl Kernel {
    /// Its name in `optim.cu`.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Sgd => "sgd_f32",
            Kernel::Adam => "adam_f32",
        }
    }
}

/// One launch as both launchers take it: the laid-out table, its blocks, and
/// the kernel's own arguments after the table, its length and the chunk, its
/// floats, then its ints, the order every kernel declares them in.
pub(super) struct Launch<'a> {
    pub kernel: Kernel,
    pub table: &'a [Entry],
    pub blocks: u64,
    pub chunk: u64,
    pub floats: &'a [f32],
    pub ints: &'a [i32],
}

/// Where the kernels run: the addresses they read a tensor at, and the launch.
pub(super) trait Launcher {
    /// The address of the first element of `t`, a contiguous f32 tensor on
    /// this launcher's device, valid until the launch has been queued.
    fn address(&self, t: &Tensor) -> Result<u64>;

    fn launch(&self, launch: Launch<'_>) -> Result<()>;
}

/// The launcher for `vars`: our kernels on the CUDA device every one of them
/// is on, or their twins on the reference where this thread runs the device
/// passes there (`ops::on_reference`); `None` where the vars are not all
/// contiguous f32 on one such device.
pub(super) fn launcher_for(vars: &[Var]) -> Option<Box<dyn Launcher>> {
    let first = vars.first()?;
    let f32_contiguous = vars.iter().all(|v| v.dtype() == DType::F32 && v.is_contiguous() && v.device().same_device(first.device()));
    if !f32_contiguous {
        return None;
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = first.device() {
        return Some(Box::new(cuda::Card(dev.clone())));
    }
    (first.device().is_cpu() && crate::ops::on_the_reference()).then(|| Box::new(reference::Host::default()) as Box<dyn Launcher>)
}

/// The entry of `var`, updated from its contiguous gradient `g`; its state
/// and constants are the optimizer's to set.
pub(super) fn entry(launcher: &dyn Launcher, var: &Var, g: &Tensor) -> Result<Entry> {
    Ok(Entry { param: launcher.address(var.as_tensor())?, grad: launcher.address(g)?, len: var.elem_count() as u64, ..Entry::default() })
}

fn launch(launcher: &dyn Launcher, kernel: Kernel, mut entries: Vec<Entry>, floats: &[f32], ints: &[i32]) -> Result<()> {
    let blocks = lay_out(&mut entries, CHUNK);
    if blocks == 0 {
        return Ok(());
    }
    launcher.launch(Launch { kernel, table: &entries, blocks, chunk: CHUNK, floats, ints })
}

/// SGD's hyperparameters as the kernel takes them.
pub(super) struct SgdArgs {
    pub lr: f32,
    pub momentum: f32,
    pub keep: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
}

pub(super) fn sgd(launcher: &dyn Launcher, entries: Vec<Entry>, a: SgdArgs) -> Result<()> {
    launch(launcher, Kernel::Sgd, entries, &[a.lr, a.momentum, a.keep, a.weight_decay], &[i32::from(a.nesterov)])
}

/// Adam's step-independent hyperparameters as the kernel takes them.
pub(super) struct AdamArgs {
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub shrink: f32,
    pub decoupled: bool,
    pub amsgrad: bool,
}

pub(super) fn adam(launcher: &dyn Launcher, entries: Vec<Entry>, a: AdamArgs) -> Result<()> {
    let floats = [a.one_minus_beta1, a.beta2, a.one_minus_beta2, a.eps, a.weight_decay, a.shrink];
    launch(launcher, Kernel::Adam, entries, &floats, &[i32::from(a.decoupled), i32::from(a.amsgrad)])
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

    mod on_the_reference {
        use candle_core::{Device, Tensor, Var};

        use super::super::reference::Host;
        use super::super::*;

        fn var(values: &[f32]) -> Var {
            Var::from_tensor(&Tensor::new(values, &Device::Cpu).unwrap()).unwrap()
        }

        fn plain_sgd(lr: f32) -> SgdArgs {
            SgdArgs { lr, momentum: 0.0, keep: 1.0, weight_decay: 0.0, nesterov: false }
        }

        #[test]
        fn the_launcher_is_the_reference_only_inside_it() {
            let vars = [var(&[1.0, 2.0])];
            assert!(launcher_for(&vars).is_none(), "CPU tensors take the CPU's fused updates");
            assert!(crate::ops::on_reference(|| launcher_for(&vars).is_some()));
            let half = Var::from_tensor(&vars[0].as_tensor().to_dtype(DType::F16).unwrap()).unwrap();
            assert!(crate::ops::on_reference(|| launcher_for(&[half]).is_none()), "the kernels take f32 only");
        }

        #[test]
        fn a_launch_updates_the_tensors_in_place_through_their_addresses() {
            let host = Host::default();
            let p = var(&[1.0; 40_000]);
            let g = Tensor::new(&[2.0f32; 40_000], &Device::Cpu).unwrap();
            let update = entry(&host, &p, &g).unwrap();
            sgd(&host, vec![update], plain_sgd(0.5)).unwrap();
            let after: Vec<f32> = p.as_tensor().to_vec1().unwrap();
            assert!(after.iter().all(|&v| v == 0.0), "every block of three wrote its chunk");
            assert_eq!(g.to_vec1::<f32>().unwrap()[0], 2.0, "the gradient is read, not written");
        }

        #[test]
        fn an_address_in_no_tensor_of_the_launch_is_an_error() {
            let host = Host::default();
            let p = var(&[1.0, 2.0, 3.0]);
            let g = Tensor::new(&[1.0f32, 1.0, 1.0], &Device::Cpu).unwrap();
            let mut update = entry(&host, &p, &g).unwrap();
            update.grad = update.param + 3 * 4;
            let err = sgd(&host, vec![update], plain_sgd(0.1)).unwrap_err().to_string();
            assert!(err.contains("in no tensor of the launch"), "{err}");
            assert_eq!(p.as_tensor().to_vec1::<f32>().unwrap(), [1.0, 2.0, 3.0], "a failed launch writes nothing back");
        }

        #[test]
        fn a_null_state_read_is_an_error() {
            let host = Host::default();
            let p = var(&[1.0]);
            let g = Tensor::new(&[1.0f32], &Device::Cpu).unwrap();
            let update = entry(&host, &p, &g).unwrap();
            let args = SgdArgs { momentum: 0.9, ..plain_sgd(0.1) };
            let err = sgd(&host, vec![update], args).unwrap_err().to_string();
            assert!(err.contains("0x0"), "{err}");
        }

        #[test]
        fn arguments_the_kernel_does_not_declare_are_refused() {
            let host = Host::default();
            let p = var(&[1.0]);
            let g = Tensor::new(&[1.0f32], &Device::Cpu).unwrap();
            let update = entry(&host, &p, &g).unwrap();
            let err = launch(&host, Kernel::Adam, vec![update], &[0.1, 0.9], &[0]).unwrap_err().to_string();
            assert!(err.contains("adam_f32") && err.contains("2 floats"), "{err}");
        }
    }
}
