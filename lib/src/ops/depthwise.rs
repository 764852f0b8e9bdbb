//! Depthwise convolution (`groups == channels`, output channel `oc` reads input
//! channel `oc / multiplier`) as direct loops over zero-padded planes, one
//! plane per rayon task. The inner loops run along an output row, so stride 1
//! vectorises.

use rayon::prelude::*;

use super::conv_geometry::Geometry;
use super::floats::par_chunks_from;

fn padded_size(g: &Geometry) -> (usize, usize) {
    (g.height + 2 * g.padding, g.width + 2 * g.padding)
}

/// `plane` (H x W) with `padding` zeros around it, into `buf`.
fn pad_plane(g: &Geometry, plane: &[f32], buf: &mut Vec<f32>) {
    let (hp, wp) = padded_size(g);
    buf.clear();
    buf.resize(hp * wp, 0.0);
    for (ih, row) in plane.chunks_exact(g.width).enumerate() {
        buf[(ih + g.padding) * wp + g.padding..][..g.width].copy_from_slice(row);
    }
}

fn multiplier(g: &Geometry) -> usize {
    g.out_channels / g.channels
}

fn taps(g: &Geometry) -> usize {
    g.kernel_h * g.kernel_w
}

/// `dst[i] += scale * src[i * stride]`.
fn axpy_strided(dst: &mut [f32], scale: f32, src: &[f32], stride: usize) {
    if stride == 1 {
        dst.iter_mut().zip(src).for_each(|(d, v)| *d += scale * v);
    } else {
        dst.iter_mut().zip(src.iter().step_by(stride)).for_each(|(d, v)| *d += scale * v);
    }
}

pub(super) fn forward(g: &Geometry, x: &[f32], w: &[f32]) -> Vec<f32> {
    let (_, wp) = padded_size(g);
    let (op, ow_n, s) = (g.out_plane(), g.out_w, g.stride);
    par_chunks_from(g.batch * g.out_channels * op, op, 0.0, Vec::new, |padded, i, out_plane| {
        let (n, oc) = (i / g.out_channels, i % g.out_channels);
        let c = oc / multiplier(g);
        pad_plane(g, &x[(n * g.channels + c) * g.in_plane()..][..g.in_plane()], padded);
        let kernel = &w[oc * taps(g)..][..taps(g)];
        for (oh, dst) in out_plane.chunks_exact_mut(ow_n).enumerate() {
            for kh in 0..g.kernel_h {
                let row = &padded[(oh * s + kh) * wp..];
                for kw in 0..g.kernel_w {
                    axpy_strided(dst, kernel[kh * g.kernel_w + kw], &row[kw..], s);
                }
            }
        }
    })
}

pub(super) fn grad_input(g: &Geometry, dy: &[f32], w: &[f32]) -> Vec<f32> {
    let (_, wp) = padded_size(g);
    let (op, ow_n, s, p) = (g.out_plane(), g.out_w, g.stride, g.padding);
    let mult = multiplier(g);
    par_chunks_from(g.batch * g.channels * g.in_plane(), g.in_plane(), 0.0, Vec::new, |dpad: &mut Vec<f32>, i, dx_plane| {
        let (n, c) = (i / g.channels, i % g.channels);
        let (hp, _) = padded_size(g);
        dpad.clear();
        dpad.resize(hp * wp, 0.0);
        for oc in c * mult..(c + 1) * mult {
            let kernel = &w[oc * taps(g)..][..taps(g)];
            let dy_plane = &dy[(n * g.out_channels + oc) * op..][..op];
            for (oh, dy_row) in dy_plane.chunks_exact(ow_n).enumerate() {
                for kh in 0..g.kernel_h {
                    for kw in 0..g.kernel_w {
                        let weight = kernel[kh * g.kernel_w + kw];
                        let row = &mut dpad[(oh * s + kh) * wp + kw..];
                        if s == 1 {
                            row.iter_mut().zip(dy_row).for_each(|(d, v)| *d += weight * v);
                        } else {
                            row.iter_mut().step_by(s).zip(dy_row).for_each(|(d, v)| *d += weight * v);
                        }
                    }
                }
            }
        }
        for (ih, dst) in dx_plane.chunks_exact_mut(g.width).enumerate() {
            dst.copy_from_slice(&dpad[(ih + p) * wp + p..][..g.width]);
        }
    })
}

pub(super) fn grad_weight(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let (_, wp) = padded_size(g);
    let (op, ow_n, s) = (g.out_plane(), g.out_w, g.stride);
    let mut dw = vec![0f32; g.out_channels * taps(g)];
    dw.par_chunks_mut(taps(g)).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(padded, sums): &mut (Vec<f32>, Vec<f32>), (oc, dw_kernel)| {
            let c = oc / multiplier(g);
            // One running sum per tap and output column: the reduction over a
            // row becomes element-wise work that vectorises.
            sums.clear();
            sums.resize(taps(g) * ow_n, 0.0);
            for n in 0..g.batch {
                pad_plane(g, &x[(n * g.channels + c) * g.in_plane()..][..g.in_plane()], padded);
                let dy_plane = &dy[(n * g.out_channels + oc) * op..][..op];
                for (oh, dy_row) in dy_plane.chunks_exact(ow_n).enumerate() {
                    for kh in 0..g.kernel_h {
                        let row = &padded[(oh * s + kh) * wp..];
                        for kw in 0..g.kernel_w {
                            let tap_sums = &mut sums[(kh * g.kernel_w + kw) * ow_n..][..ow_n];
                            if s == 1 {
                                tap_sums.iter_mut().zip(dy_row).zip(&row[kw..]).for_each(|((a, d), v)| *a += d * v);
                            } else {
                                tap_sums.iter_mut().zip(dy_row).zip(row[kw..].iter().step_by(s)).for_each(|((a, d), v)| *a += d * v);
                            }
                        }
                    }
                }
            }
            for (d, tap_sums) in dw_kernel.iter_mut().zip(sums.chunks_exact(ow_n)) {
                *d = tap_sums.iter().sum();
            }
        },
    );
    dw
}
