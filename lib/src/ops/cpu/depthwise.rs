//! Depthwise convolution (`groups == channels`, output channel `oc` reads input
//! channel `oc / multiplier`) as direct loops over zero-padded planes, one
//! plane per rayon task.
//!
//! Each tap is one long multiply-add over the whole plane, not one per output
//! row (EfficientNet's late maps are 14 and 7 wide, shorter than a vector):
//! outputs are computed on a grid as wide as the padded row, so that the
//! input a tap reads for the whole grid is one contiguous run starting at the
//! tap's offset, and the few columns past the output's width are dropped.
//! With a stride, the padded plane is kept as `stride x stride` phases (phase
//! `(qr, qc)` holds rows `qr, qr + stride, ...` and columns `qc, qc + stride,
//! ...`), which makes every tap a contiguous run again. The per-plane loops
//! are compiled for AVX-512 and for AVX2 too, and pick one at run time.

use multiversion::multiversion;
use rayon::prelude::*;

use super::super::conv_geometry::Geometry;
use super::floats::par_chunks_from;

/// The padded plane in phases: `stride * stride` planes of `rows x width`.
#[derive(Debug, Clone, Copy)]
struct Phases {
    stride: usize,
    rows: usize,
    width: usize,
}

impl Phases {
    fn of(g: &Geometry) -> Self {
        let (padded_h, padded_w) = (g.height + 2 * g.padding, g.width + 2 * g.padding);
        Self { stride: g.stride, rows: padded_h.div_ceil(g.stride), width: padded_w.div_ceil(g.stride) }
    }

    /// The phases and one row more: the grid's last columns read a few
    /// values past the last phase's end.
    fn len(&self) -> usize {
        (self.stride * self.stride * self.rows + 1) * self.width
    }

    /// Where padded position (`row`, `col`) is. Output (`oh`, `ow`) of tap
    /// (`kh`, `kw`) reads `at(kh, kw) + oh * width + ow`.
    fn at(&self, row: usize, col: usize) -> usize {
        let s = self.stride;
        (((row % s) * s + col % s) * self.rows + row / s) * self.width + col / s
    }

    /// The output grid's length: `out_h` rows of the phases' width.
    fn grid(&self, g: &Geometry) -> usize {
        g.out_h * self.width
    }
}

/// `plane` (H x W) with `padding` zeros around it, in phases, into `buf`.
fn pad_plane(g: &Geometry, phases: Phases, plane: &[f32], buf: &mut Vec<f32>) {
    let (s, p) = (g.stride, g.padding);
    buf.clear();
    buf.resize(phases.len(), 0.0);
    for (ih, row) in plane.chunks_exact(g.width).enumerate() {
        if s == 1 {
            buf[phases.at(ih + p, p)..][..g.width].copy_from_slice(row);
            continue;
        }
        // The input columns that land in each phase column, from the first.
        for first in (0..s).filter(|&first| first < g.width) {
            let dst = &mut buf[phases.at(ih + p, first + p)..];
            row[first..].iter().step_by(s).zip(dst).for_each(|(v, d)| *d = *v);
        }
    }
}

/// Copies a plane's rows onto the grid's rows, leaving its extra columns as they are.
fn rows_onto_grid(g: &Geometry, phases: Phases, plane: &[f32], grid: &mut [f32]) {
    for (row, dst) in plane.chunks_exact(g.out_w).zip(grid.chunks_exact_mut(phases.width)) {
        dst[..g.out_w].copy_from_slice(row);
    }
}

fn multiplier(g: &Geometry) -> usize {
    g.out_channels / g.channels
}

fn taps(g: &Geometry) -> usize {
    g.kernel_h * g.kernel_w
}

/// Tap offsets into the phases, in the kernel's row-major order.
fn tap_offsets(g: &Geometry, phases: Phases) -> impl Iterator<Item = usize> + '_ {
    (0..g.kernel_h).flat_map(move |kh| (0..g.kernel_w).map(move |kw| phases.at(kh, kw)))
}

/// `grid += kernel[t] * padded[offset[t]..]` for each tap in order.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn forward_taps(offsets: &[usize], kernel: &[f32], padded: &[f32], grid: &mut [f32]) {
    for (&offset, &weight) in offsets.iter().zip(kernel) {
        let src = &padded[offset..][..grid.len()];
        grid.iter_mut().zip(src).for_each(|(d, v)| *d += weight * v);
    }
}

/// `dpad[offset[t]..] += kernel[t] * dgrid` for each tap in order.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn grad_input_taps(offsets: &[usize], kernel: &[f32], dgrid: &[f32], dpad: &mut [f32]) {
    for (&offset, &weight) in offsets.iter().zip(kernel) {
        let dst = &mut dpad[offset..][..dgrid.len()];
        dst.iter_mut().zip(dgrid).for_each(|(d, v)| *d += weight * v);
    }
}

/// `sums[t][j] += dgrid[start + j] * padded[offset[t] + start + j]` over the
/// grid in runs of `run`: one running sum per tap and position in a run, so
/// that the reduction is element-wise work on a few kilobytes.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn grad_weight_taps(offsets: &[usize], padded: &[f32], dgrid: &[f32], run: usize, sums: &mut [f32]) {
    for (start, dy) in (0..).step_by(run).zip(dgrid.chunks(run)) {
        for (&offset, tap_sums) in offsets.iter().zip(sums.chunks_exact_mut(run)) {
            let src = &padded[offset + start..][..dy.len()];
            tap_sums.iter_mut().zip(dy).zip(src).for_each(|((a, d), v)| *a += d * v);
        }
    }
}

/// Positions a weight gradient's running sums cover per tap.
const SUM_RUN: usize = 512;

pub(in crate::ops) fn forward(g: &Geometry, x: &[f32], w: &[f32]) -> Vec<f32> {
    let (op, phases) = (g.out_plane(), Phases::of(g));
    let offsets: Vec<usize> = tap_offsets(g, phases).collect();
    let state = || (Vec::new(), Vec::new());
    par_chunks_from(g.batch * g.out_channels * op, op, 0.0, state, |(padded, grid), i, out_plane| {
        let (n, oc) = (i / g.out_channels, i % g.out_channels);
        let c = oc / multiplier(g);
        pad_plane(g, phases, &x[(n * g.channels + c) * g.in_plane()..][..g.in_plane()], padded);
        grid.clear();
        grid.resize(phases.grid(g), 0.0);
        forward_taps(&offsets, &w[oc * taps(g)..][..taps(g)], padded, grid);
        for (dst, row) in out_plane.chunks_exact_mut(g.out_w).zip(grid.chunks_exact(phases.width)) {
            dst.copy_from_slice(&row[..g.out_w]);
        }
    })
}

pub(in crate::ops) fn grad_input(g: &Geometry, dy: &[f32], w: &[f32]) -> Vec<f32> {
    let (op, phases, p) = (g.out_plane(), Phases::of(g), g.padding);
    let offsets: Vec<usize> = tap_offsets(g, phases).collect();
    let mult = multiplier(g);
    let state = || (Vec::new(), Vec::new());
    par_chunks_from(g.batch * g.channels * g.in_plane(), g.in_plane(), 0.0, state, |(dpad, dgrid), i, dx_plane| {
        let (n, c) = (i / g.channels, i % g.channels);
        dpad.clear();
        dpad.resize(phases.len(), 0.0);
        // The grid's extra columns stay zero: they add nothing to the input's gradient.
        dgrid.clear();
        dgrid.resize(phases.grid(g), 0.0);
        for oc in c * mult..(c + 1) * mult {
            rows_onto_grid(g, phases, &dy[(n * g.out_channels + oc) * op..][..op], dgrid);
            grad_input_taps(&offsets, &w[oc * taps(g)..][..taps(g)], dgrid, dpad);
        }
        for (ih, dst) in dx_plane.chunks_exact_mut(g.width).enumerate() {
            if phases.stride == 1 {
                dst.copy_from_slice(&dpad[phases.at(ih + p, p)..][..g.width]);
            } else {
                dst.iter_mut().enumerate().for_each(|(iw, d)| *d = dpad[phases.at(ih + p, iw + p)]);
            }
        }
    })
}

pub(in crate::ops) fn grad_weight(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let (op, phases) = (g.out_plane(), Phases::of(g));
    let offsets: Vec<usize> = tap_offsets(g, phases).collect();
    let run = SUM_RUN.min(phases.grid(g)).max(1);
    let mut dw = vec![0f32; g.out_channels * taps(g)];
    dw.par_chunks_mut(taps(g)).enumerate().for_each_init(
        || (Vec::new(), Vec::new(), Vec::new()),
        |(padded, dgrid, sums): &mut (Vec<f32>, Vec<f32>, Vec<f32>), (oc, dw_kernel)| {
            let c = oc / multiplier(g);
            sums.clear();
            sums.resize(taps(g) * run, 0.0);
            dgrid.clear();
            dgrid.resize(phases.grid(g), 0.0);
            for n in 0..g.batch {
                pad_plane(g, phases, &x[(n * g.channels + c) * g.in_plane()..][..g.in_plane()], padded);
                rows_onto_grid(g, phases, &dy[(n * g.out_channels + oc) * op..][..op], dgrid);
                grad_weight_taps(&offsets, padded, dgrid, run, sums);
            }
            for (d, tap_sums) in dw_kernel.iter_mut().zip(sums.chunks_exact(run)) {
                *d = tap_sums.iter().sum();
            }
        },
    );
    dw
}
