//! In-place element-wise updates of contiguous f32 CPU tensors, spread over
//! the rayon pool: one pass over memory per updated tensor, no temporaries.

use candle_core::{bail, CpuStorage, InplaceOp2, InplaceOp3, Layout, Result, Tensor};
use rayon::prelude::*;

/// Elements per parallel work item: large enough to amortise scheduling.
const CHUNK: usize = 1 << 15;

fn view<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> Result<&'a [f32]> {
    let Some((start, end)) = layout.contiguous_offsets() else { bail!("{op}: source is not contiguous") };
    Ok(&storage.as_slice::<f32>()?[start..end])
}

fn view_mut<'a>(storage: &'a mut CpuStorage, layout: &Layout, op: &str) -> Result<&'a mut [f32]> {
    let Some((start, end)) = layout.contiguous_offsets() else { bail!("{op}: destination is not contiguous") };
    match storage {
        CpuStorage::F32(values) => Ok(&mut values[start..end]),
        _ => bail!("{op}: destination is not f32"),
    }
}

fn check_len(op: &str, dst: usize, src: usize) -> Result<()> {
    if dst != src {
        bail!("{op}: destination has {dst} elements, source {src}")
    }
    Ok(())
}

/// `dst[i] = f(dst[i], a[i])` in place.
struct Update2<F> {
    name: &'static str,
    f: F,
}

impl<F: Fn(&mut f32, f32) + Sync> InplaceOp2 for Update2<F> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, a: &CpuStorage, al: &Layout) -> Result<()> {
        let dst = view_mut(dst, dl, self.name)?;
        let a = view(a, al, self.name)?;
        check_len(self.name, dst.len(), a.len())?;
        dst.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK)).for_each(|(d, a)| d.iter_mut().zip(a).for_each(|(d, &a)| (self.f)(d, a)));
        Ok(())
    }
}

/// `dst[i] = f(dst[i], a[i], b[i])` in place.
struct Update3<F> {
    name: &'static str,
    f: F,
}

impl<F: Fn(&mut f32, f32, f32) + Sync> InplaceOp3 for Update3<F> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, a: &CpuStorage, al: &Layout, b: &CpuStorage, bl: &Layout) -> Result<()> {
        let dst = view_mut(dst, dl, self.name)?;
        let a = view(a, al, self.name)?;
        let b = view(b, bl, self.name)?;
        check_len(self.name, dst.len(), a.len())?;
        check_len(self.name, dst.len(), b.len())?;
        dst.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .zip(b.par_chunks(CHUNK))
            .for_each(|((d, a), b)| d.iter_mut().zip(a.iter().zip(b)).for_each(|(d, (&a, &b))| (self.f)(d, a, b)));
        Ok(())
    }
}

/// Updates `dst` in place from `a`; all contiguous f32 on the CPU.
pub(super) fn update2(name: &'static str, dst: &Tensor, a: &Tensor, f: impl Fn(&mut f32, f32) + Sync) -> Result<()> {
    dst.inplace_op2(a, &Update2 { name, f })
}

/// Updates `dst` in place from `a` and `b`; all contiguous f32 on the CPU.
pub(super) fn update3(name: &'static str, dst: &Tensor, a: &Tensor, b: &Tensor, f: impl Fn(&mut f32, f32, f32) + Sync) -> Result<()> {
    dst.inplace_op3(a, b, &Update3 { name, f })
}
