//! Max-pooling on the CPU: a direct kernel whose forward reduces each
//! window's rows over whole input rows first, and whose backward finds each
//! window's first maximum again (no index tensor is kept alive between
//! forward and backward).

use candle_core::WithDType;
use multiversion::multiversion;

use super::super::pool_geometry::Geometry;
use super::floats::{par_chunks_from, par_filled};

impl Geometry {
    /// Input rows (or columns) of output `o`'s window along an axis of `size`.
    fn span(&self, o: usize, size: usize) -> std::ops::Range<usize> {
        let start = o * self.stride;
        start.saturating_sub(self.padding)..(start + self.kernel).saturating_sub(self.padding).min(size)
    }

    /// Index in `plane` of the first maximum of output `(oh, ow)`'s window;
    /// a NaN wins over any number, as in PyTorch.
    fn argmax<T: WithDType>(&self, plane: &[T], oh: usize, ow: usize) -> Option<usize> {
        let (rows, cols) = (self.span(oh, self.height), self.span(ow, self.width));
        if rows.is_empty() || cols.is_empty() {
            return None;
        }
        let mut best_index = rows.start * self.width + cols.start;
        let mut best = plane[best_index];
        for ih in rows {
            let row = ih * self.width;
            for (i, &v) in plane[row + cols.start..row + cols.end].iter().enumerate() {
                if v > best {
                    best = v;
                    best_index = row + cols.start + i;
                }
                #[allow(clippy::eq_op)]
                if v != v {
                    return Some(row + cols.start + i);
                }
            }
        }
        Some(best_index)
    }

    /// One plane's outputs: each window's rows reduced first, element by
    /// element over whole input rows (a loop the compiler vectorises), then
    /// the window's columns of that row.
    fn forward_plane<T: WithDType>(&self, plane: &[T], out: &mut [T], rows_max: &mut [T]) {
        let w = self.width;
        for (oh, out_row) in out.chunks_exact_mut(self.out_w).enumerate() {
            let rows = self.span(oh, self.height);
            if rows.is_empty() {
                out_row.fill(T::from_f64(f64::NEG_INFINITY));
                continue;
            }
            rows_max.copy_from_slice(&plane[rows.start * w..][..w]);
            for ih in rows.start + 1..rows.end {
                fold_larger(rows_max, &plane[ih * w..][..w]);
            }
            for (ow, o) in out_row.iter_mut().enumerate() {
                *o = rows_max[self.span(ow, w)].iter().copied().reduce(larger).unwrap_or(T::from_f64(f64::NEG_INFINITY));
            }
        }
    }

    pub(in crate::ops) fn forward<T: WithDType>(&self, x: &[T]) -> Vec<T> {
        let planes = self.batch * self.channels;
        par_chunks_from(
            planes * self.out_plane(),
            self.out_plane(),
            T::zero(),
            || vec![T::zero(); self.width],
            |rows_max, i, out| self.forward_plane(&x[i * self.in_plane()..][..self.in_plane()], out, rows_max),
        )
    }

    pub(in crate::ops) fn grad_input<T: WithDType>(&self, x: &[T], dy: &[T]) -> Vec<T> {
        par_filled(self.batch * self.channels * self.in_plane(), self.in_plane(), T::zero(), |i, dx_plane| {
            let plane = &x[i * self.in_plane()..][..self.in_plane()];
            let dy_plane = &dy[i * self.out_plane()..][..self.out_plane()];
            for (j, g) in dy_plane.iter().enumerate() {
                if let Some(k) = self.argmax(plane, j / self.out_w, j % self.out_w) {
                    dx_plane[k] += *g;
                }
            }
        })
    }
}

/// `maxima[i] = larger(maxima[i], row[i])`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn fold_larger<T: WithDType>(maxima: &mut [T], row: &[T]) {
    maxima.iter_mut().zip(row).for_each(|(m, &v)| *m = larger(*m, v));
}

/// The larger of `a` and `b`, a NaN in either winning.
#[allow(clippy::eq_op)]
#[inline(always)]
fn larger<T: PartialOrd>(a: T, b: T) -> T {
    if b > a || b != b {
        b
    } else {
        a
    }
}
