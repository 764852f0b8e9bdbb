//! The multi-tensor kernels' twins on host memory. Each tensor the
//! optimizer names gets an address in a host address space, with a gap after
//! it and nothing at 0; a launch runs every block of the table as the kernels
//! do (the entry found by the kernels' search, one chunk of it a block) and
//! reads and writes only through the table's addresses, each checked to fall
//! inside a tensor of the launch. The arithmetic is `optim.cu`'s, line for
//! line, in f32 without fused multiply-adds, as the kernels are compiled.
//! What the kernels wrote goes back into the tensors in place.

use std::cell::RefCell;

use candle_core::{bail, CpuStorage, DType, InplaceOp1, Layout, Result, Storage, Tensor};

use super::{entry_of_block, Entry, Kernel, Launch, Launcher};

/// The first tensor's address: 0 stays the null that a kernel must not read.
const FIRST_ADDRESS: u64 = 1 << 12;
/// Bytes left unmapped after each tensor, so that an address one tensor off
/// lands in no tensor.
const GAP: u64 = 256;
const F32_BYTES: u64 = 4;

/// A tensor's values at its address.
struct Region {
    tensor: Tensor,
    start: u64,
    values: Vec<f32>,
    written: bool,
}

impl Region {
    fn end(&self) -> u64 {
        self.start + self.values.len() as u64 * F32_BYTES
    }
}

/// The reference's address space: the tensors named since the last launch.
#[derive(Default)]
pub(super) struct Host {
    regions: RefCell<Vec<Region>>,
}

impl Launcher for Host {
    fn address(&self, t: &Tensor) -> Result<u64> {
        if t.dtype() != DType::F32 {
            bail!("multi-tensor update: a tensor is {:?}, not f32", t.dtype())
        }
        let values = {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else { bail!("multi-tensor update (reference): a tensor is not on the CPU") };
            let Some((from, to)) = layout.contiguous_offsets() else { bail!("multi-tensor update: a tensor is not contiguous") };
            cpu.as_slice::<f32>()?[from..to].to_vec()
        };
        let mut regions = self.regions.borrow_mut();
        let start = regions.last().map_or(FIRST_ADDRESS, |r| (r.end() + GAP).next_multiple_of(GAP));
        regions.push(Region { tensor: t.clone(), start, values, written: false });
        Ok(start)
    }

    fn launch(&self, launch: Launch<'_>) -> Result<()> {
        let Launch { kernel, table, blocks, chunk, floats, ints } = launch;
        let mut memory = Memory { regions: std::mem::take(&mut *self.regions.borrow_mut()) };
        let update = Update::of(kernel, floats, ints)?;
        for block in 0..blocks {
            let e = &table[entry_of_block(table, block)];
            let start = (block - e.first_block) * chunk;
            let end = (start + chunk).min(e.len);
            for i in start..end {
                update.element(e, i, &mut memory)?;
            }
        }
        for region in memory.regions.iter().filter(|r| r.written) {
            region.tensor.inplace_op1(&Overwrite(&region.values))?;
        }
        Ok(())
    }
}

struct Memory {
    regions: Vec<Region>,
}

impl Memory {
    /// The region and index of element `i` of the array at `address`.
    fn find(&mut self, address: u64, i: u64) -> Result<(&mut Region, usize)> {
        let byte = address + i * F32_BYTES;
        match self.regions.iter_mut().find(|r| (r.start..r.end()).contains(&byte)) {
            Some(r) if (byte - r.start).is_multiple_of(F32_BYTES) => {
                let index = ((byte - r.start) / F32_BYTES) as usize;
                Ok((r, index))
            }
            Some(_) => bail!("multi-tensor update: address {byte:#x} is not aligned to an f32 of its tensor"),
            None => bail!("multi-tensor update: address {byte:#x} (element {i} of {address:#x}) is in no tensor of the launch"),
        }
    }

    fn load(&mut self, address: u64, i: u64) -> Result<f32> {
        let (region, index) = self.find(address, i)?;
        Ok(region.values[index])
    }

    fn store(&mut self, address: u64, i: u64, value: f32) -> Result<()> {
        let (region, index) = self.find(address, i)?;
        region.values[index] = value;
        region.written = true;
        Ok(())
    }
}

/// A kernel with its arguments, read in the order the kernel declares them.
enum Update {
    Sgd {
        lr: f32,
        momentum: f32,
        keep: f32,
        weight_decay: f32,
        nesterov: bool,
    },
    Adam {
        one_minus_beta1: f32,
        beta2: f32,
        one_minus_beta2: f32,
        eps: f32,
        weight_decay: f32,
        shrink: f32,
        decoupled: bool,
        amsgrad: bool,
    },
}

impl Update {
    fn of(kernel: Kernel, floats: &[f32], ints: &[i32]) -> Result<Self> {
        match (kernel, floats, ints) {
            (Kernel::Sgd, &[lr, momentum, keep, weight_decay], &[nesterov]) => {
                Ok(Update::Sgd { lr, momentum, keep, weight_decay, nesterov: nesterov != 0 })
            }
            (Kernel::Adam, &[one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, shrink], &[decoupled, amsgrad]) => {
                Ok(Update::Adam {
                    one_minus_beta1,
                    beta2,
                    one_minus_beta2,
                    eps,
                    weight_decay,
                    shrink,
                    decoupled: decoupled != 0,
                    amsgrad: amsgrad != 0,
                })
            }
            _ => bail!("{}: given {} floats and {} ints, not the kernel's arguments", kernel.name(), floats.len(), ints.len()),
        }
    }

    /// What one thread of the kernel does for element `i` of entry `e`.
    fn element(&self, e: &Entry, i: u64, m: &mut Memory) -> Result<()> {
        match *self {
            Update::Sgd { lr, momentum, keep, weight_decay, nesterov } => {
                let p = m.load(e.param, i)?;
                let mut d = if weight_decay != 0.0 { m.load(e.grad, i)? + weight_decay * p } else { m.load(e.grad, i)? };
                if momentum != 0.0 {
                    let b = if e.first != 0 { d } else { m.load(e.state[0], i)? * momentum + keep * d };
                    m.store(e.state[0], i, b)?;
                    d = if nesterov { d + momentum * b } else { b };
                }
                m.store(e.param, i, p + -lr * d)
            }
            Update::Adam { one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, shrink, decoupled, amsgrad } => {
                let p = m.load(e.param, i)?;
                let g = if !decoupled && weight_decay != 0.0 { m.load(e.grad, i)? + weight_decay * p } else { m.load(e.grad, i)? };
                let first_moment = lerp(m.load(e.state[0], i)?, g, one_minus_beta1);
                let mut v = m.load(e.state[1], i)? * beta2 + one_minus_beta2 * g * g;
                m.store(e.state[0], i, first_moment)?;
                m.store(e.state[1], i, v)?;
                if amsgrad {
                    let mut most = m.load(e.state[2], i)?;
                    if v.is_nan() || v > most {
                        most = v;
                    }
                    m.store(e.state[2], i, most)?;
                    v = most;
                }
                m.store(e.param, i, p * shrink + -e.step_size * first_moment / (v.sqrt() / e.bias_correction2_sqrt + eps))
            }
        }
    }
}

/// The kernels' `lerp`, torch.lerp's CPU kernel (exact at both ends).
fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    if weight.abs() < 0.5 {
        start + weight * (end - start)
    } else {
        end - (end - start) * (1.0 - weight)
    }
}

/// Writes a region's values back into its tensor's storage.
struct Overwrite<'a>(&'a [f32]);

impl InplaceOp1 for Overwrite<'_> {
    fn name(&self) -> &'static str {
        "multi-tensor update (reference)"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let (Some((from, to)), CpuStorage::F32(values)) = (layout.contiguous_offsets(), storage) else {
            bail!("multi-tensor update: a written tensor is no longer contiguous f32")
        };
        values[from..to].copy_from_slice(self.0);
        Ok(())
    }
}
