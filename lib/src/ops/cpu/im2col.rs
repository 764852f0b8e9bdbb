//! Dense and grouped convolution on the CPU: im2col + gemm forward, gemm +
//! col2im for the input gradient, gemm against the im2col matrix for the
//! weight gradient. Small images are stacked into one wider matrix so that
//! late, spatially tiny layers still make gemm-sized products; chunks of
//! images run on rayon's threads.

use rayon::prelude::*;

use super::super::conv_geometry::{valid_outputs, Geometry};
use super::super::ConvScratch;
use super::gemm::{matmul, take, transpose, Mat, Plan};
use super::gemm_packing::{self, Strides};

/// `dst[j] = src[j * stride]`; stride 2 (most strided convolutions) spelled
/// out, so that the compiler vectorises it.
fn copy_strided(dst: &mut [f32], src: &[f32], stride: usize) {
    match stride {
        1 => dst.copy_from_slice(&src[..dst.len()]),
        2 => dst.iter_mut().zip(src.chunks(2)).for_each(|(d, pair)| *d = pair[0]),
        _ => dst.iter_mut().zip(src.iter().step_by(stride)).for_each(|(d, v)| *d = *v),
    }
}

/// `dst[j * stride] += src[j]`.
fn add_strided(dst: &mut [f32], src: &[f32], stride: usize) {
    match stride {
        1 => dst.iter_mut().zip(src).for_each(|(d, v)| *d += v),
        2 => dst.chunks_mut(2).zip(src).for_each(|(pair, v)| pair[0] += v),
        _ => dst.iter_mut().step_by(stride).zip(src).for_each(|(d, v)| *d += v),
    }
}

/// How patches are copied between an image and the im2col matrix: row by
/// row for wide outputs (each row one copy of every `stride`-th input),
/// through a table of input offsets for narrow ones, where per-row work
/// would dominate (a 2x2 map has rows of two).
enum Patches {
    Rows,
    /// For each tap `(kh, kw)` and output position, the offset read in the
    /// input plane; `PADDING` where the tap falls on the zero border.
    Table(Vec<usize>),
}

const PADDING: usize = usize::MAX;

/// Outputs narrower than this go through the offset table.
const TABLE_BELOW_WIDTH: usize = 16;

impl Patches {
    fn uses_table(g: &Geometry) -> bool {
        g.out_w < TABLE_BELOW_WIDTH
    }

    /// The bytes of the offset table [`new`](Self::new) builds.
    fn table_bytes(g: &Geometry) -> u64 {
        if Self::uses_table(g) {
            (g.kernel_h * g.kernel_w * g.out_plane() * size_of::<usize>()) as u64
        } else {
            0
        }
    }

    fn new(g: &Geometry) -> Self {
        if !Self::uses_table(g) {
            return Patches::Rows;
        }
        let (s, p) = (g.stride, g.padding);
        let mut table = Vec::with_capacity(g.kernel_h * g.kernel_w * g.out_plane());
        for kh in 0..g.kernel_h {
            for kw in 0..g.kernel_w {
                for oh in 0..g.out_h {
                    for ow in 0..g.out_w {
                        let (ih, iw) = ((oh * s + kh).wrapping_sub(p), (ow * s + kw).wrapping_sub(p));
                        table.push(if ih < g.height && iw < g.width { ih * g.width + iw } else { PADDING });
                    }
                }
            }
        }
        Patches::Table(table)
    }

    /// Writes the patches of one image's group (`in_per_group x H x W`) into
    /// `col` (`patch` rows of `row_stride`), columns `column..column + out_plane`.
    fn im2col(&self, g: &Geometry, x: &[f32], col: &mut [f32], row_stride: usize, column: usize) {
        let Patches::Table(table) = self else {
            return im2col_rows(g, x, col, row_stride, column);
        };
        let (taps, op) = (g.kernel_h * g.kernel_w, g.out_plane());
        for (c, plane) in x.chunks_exact(g.in_plane()).enumerate() {
            for (t, offsets) in table.chunks_exact(op).enumerate() {
                let row = &mut col[(c * taps + t) * row_stride + column..][..op];
                for (d, &i) in row.iter_mut().zip(offsets) {
                    *d = plane.get(i).copied().unwrap_or(0.0);
                }
            }
        }
    }

    /// Adds the columns `column..column + out_plane` of `col` back onto the
    /// input positions they were read from (`dx` is one image's group).
    fn col2im(&self, g: &Geometry, col: &[f32], strides: Strides, column: usize, dx: &mut [f32]) {
        let Patches::Table(table) = self else {
            return col2im_rows(g, col, strides.row, column, dx);
        };
        let (taps, op) = (g.kernel_h * g.kernel_w, g.out_plane());
        for (c, plane) in dx.chunks_exact_mut(g.in_plane()).enumerate() {
            for (t, offsets) in table.chunks_exact(op).enumerate() {
                let first = (c * taps + t) * strides.row + column * strides.col;
                for (k, &i) in offsets.iter().enumerate() {
                    if let Some(d) = plane.get_mut(i) {
                        *d += col[first + k * strides.col];
                    }
                }
            }
        }
    }

    /// How the input gradient's column matrix (`patch x cols`) is laid out:
    /// column-major through the offset table, so that gemm reads the
    /// transposed weight (column-major) as it is (ResNet18's 2x2 layers at
    /// batch 32: 11.5 ms a pass row-major, 5.3 ms column-major, 1 thread);
    /// the row-by-row copies need rows.
    fn gradient_strides(g: &Geometry, cols: usize) -> Strides {
        if Self::uses_table(g) {
            Strides::column_major(g.patch())
        } else {
            Strides::row_major(cols)
        }
    }
}

/// [`Patches::im2col`] by output rows, each one copy.
fn im2col_rows(g: &Geometry, x: &[f32], col: &mut [f32], row_stride: usize, column: usize) {
    let (p, s, w, ow_n) = (g.padding, g.stride, g.width, g.out_w);
    for c in 0..g.in_per_group() {
        let plane = &x[c * g.in_plane()..][..g.in_plane()];
        for kh in 0..g.kernel_h {
            let (oh_lo, oh_hi) = valid_outputs(kh, g.height, g.out_h, p, s);
            for kw in 0..g.kernel_w {
                let (ow_lo, ow_hi) = valid_outputs(kw, w, ow_n, p, s);
                let r = (c * g.kernel_h + kh) * g.kernel_w + kw;
                let row = &mut col[r * row_stride + column..][..g.out_plane()];
                for (oh, dst) in row.chunks_exact_mut(ow_n).enumerate() {
                    if oh < oh_lo || oh >= oh_hi || ow_lo == ow_hi {
                        dst.fill(0.0);
                        continue;
                    }
                    let src = &plane[(oh * s + kh - p) * w..][..w];
                    dst[..ow_lo].fill(0.0);
                    dst[ow_hi..].fill(0.0);
                    copy_strided(&mut dst[ow_lo..ow_hi], &src[ow_lo * s + kw - p..], s);
                }
            }
        }
    }
}

/// [`Patches::col2im`] by output rows.
fn col2im_rows(g: &Geometry, col: &[f32], row_stride: usize, column: usize, dx: &mut [f32]) {
    let (p, s, w, ow_n) = (g.padding, g.stride, g.width, g.out_w);
    let in_plane = g.in_plane();
    for c in 0..g.in_per_group() {
        let plane = &mut dx[c * in_plane..][..in_plane];
        for kh in 0..g.kernel_h {
            let (oh_lo, oh_hi) = valid_outputs(kh, g.height, g.out_h, p, s);
            for kw in 0..g.kernel_w {
                let (ow_lo, ow_hi) = valid_outputs(kw, w, ow_n, p, s);
                if ow_lo == ow_hi {
                    continue;
                }
                let r = (c * g.kernel_h + kh) * g.kernel_w + kw;
                let row = &col[r * row_stride + column..][..g.out_plane()];
                for oh in oh_lo..oh_hi {
                    let dst = &mut plane[(oh * s + kh - p) * w..][..w];
                    add_strided(&mut dst[ow_lo * s + kw - p..], &row[oh * ow_n + ow_lo..oh * ow_n + ow_hi], s);
                }
            }
        }
    }
}

/// Buffers a thread reuses from chunk to chunk. Every user overwrites what it
/// takes, so they are grown but never cleared: zeroing megabytes per image
/// would cost as much as the copies it precedes.
#[derive(Default)]
struct Scratch {
    col: Vec<f32>,
    stacked: Vec<f32>,
}

/// Copies rows `first_row..first_row + rows` of each of `images` consecutive
/// `per_image`-element blocks of `src` (rows `width` long) side by side:
/// row `r` of the result holds image 0's row, then image 1's, ...
fn stack_images(src: &[f32], per_image: usize, first_row: usize, rows: usize, width: usize, images: usize, dst: &mut [f32]) {
    let cols = images * width;
    for j in 0..images {
        for r in 0..rows {
            dst[r * cols + j * width..][..width].copy_from_slice(&src[j * per_image + (first_row + r) * width..][..width]);
        }
    }
}

pub(in crate::ops) fn forward(g: &Geometry, x: &[f32], w: &[f32]) -> Vec<f32> {
    let (op, patch, og, cg) = (g.out_plane(), g.patch(), g.out_per_group(), g.in_per_group());
    let x_image = g.channels * g.in_plane();
    let out_image = g.out_channels * op;
    let plan = Plan::new(g.batch, op);
    let parallelism = plan.gemm_parallelism();
    let patches = Patches::new(g);
    plan.map_chunks(out_image, |scratch: &mut Scratch, n0, out_chunk| {
        let nb = out_chunk.len() / out_image;
        let cols = nb * op;
        let direct_input = g.is_pointwise() && nb == 1;
        let col = take(&mut scratch.col, if direct_input { 0 } else { patch * cols });
        let stacked = take(&mut scratch.stacked, if nb > 1 { og * cols } else { 0 });
        for grp in 0..g.groups {
            let rhs = if direct_input {
                Mat { data: &x[n0 * x_image + grp * cg * g.in_plane()..][..cg * g.in_plane()], row_stride: op, col_stride: 1 }
            } else {
                for j in 0..nb {
                    let image = &x[(n0 + j) * x_image + grp * cg * g.in_plane()..][..cg * g.in_plane()];
                    patches.im2col(g, image, col, cols, j * op);
                }
                Mat { data: col, row_stride: cols, col_stride: 1 }
            };
            let lhs = Mat { data: &w[grp * og * patch..][..og * patch], row_stride: patch, col_stride: 1 };
            if nb == 1 {
                matmul(&mut out_chunk[grp * og * op..][..og * op], Strides::row_major(op), (og, op, patch), lhs, rhs, false, parallelism);
            } else {
                matmul(stacked, Strides::row_major(cols), (og, cols, patch), lhs, rhs, false, parallelism);
                for j in 0..nb {
                    for o in 0..og {
                        out_chunk[(j * g.out_channels + grp * og + o) * op..][..op].copy_from_slice(&stacked[o * cols + j * op..][..op]);
                    }
                }
            }
        }
    })
}

pub(in crate::ops) fn grad_input(g: &Geometry, dy: &[f32], w: &[f32]) -> Vec<f32> {
    let (op, patch, og, cg) = (g.out_plane(), g.patch(), g.out_per_group(), g.in_per_group());
    let x_image = g.channels * g.in_plane();
    let out_image = g.out_channels * op;
    let plan = Plan::new(g.batch, op);
    let parallelism = plan.gemm_parallelism();
    let patches = Patches::new(g);
    plan.map_chunks(x_image, |scratch: &mut Scratch, n0, dx_chunk| {
        let nb = dx_chunk.len() / x_image;
        let cols = nb * op;
        let direct_output = g.is_pointwise() && nb == 1;
        let dcol = take(&mut scratch.col, if direct_output { 0 } else { patch * cols });
        let stacked = take(&mut scratch.stacked, if nb > 1 { og * cols } else { 0 });
        for grp in 0..g.groups {
            let rhs = if nb == 1 {
                Mat { data: &dy[n0 * out_image + grp * og * op..][..og * op], row_stride: op, col_stride: 1 }
            } else {
                stack_images(&dy[n0 * out_image..], out_image, grp * og, og, op, nb, stacked);
                Mat { data: stacked, row_stride: cols, col_stride: 1 }
            };
            // The transposed weight of the group: element (r, o) is w[o * patch + r].
            let lhs = Mat { data: &w[grp * og * patch..][..og * patch], row_stride: 1, col_stride: patch };
            if direct_output {
                let dst = &mut dx_chunk[grp * cg * g.in_plane()..][..cg * g.in_plane()];
                matmul(dst, Strides::row_major(op), (patch, op, og), lhs, rhs, false, parallelism);
            } else {
                let strides = Patches::gradient_strides(g, cols);
                matmul(dcol, strides, (patch, cols, og), lhs, rhs, false, parallelism);
                for j in 0..nb {
                    let image = &mut dx_chunk[j * x_image + grp * cg * g.in_plane()..][..cg * g.in_plane()];
                    patches.col2im(g, dcol, strides, j * op, image);
                }
            }
        }
    })
}

/// How the weight gradient of one group (`out_per_group x patch`) is laid
/// out while it accumulates. gemm packs its operand of patches, the largest
/// one, unless the product's rows are few and it is column-major: so where
/// there are few output channels and more taps (64 channels, 576 taps:
/// 1.8x as fast) the sums are kept column-major and transposed once at the
/// end. With more channels the gain is a few percent, less than the
/// transposition costs.
fn weight_gradient_strides(g: &Geometry) -> Strides {
    if g.out_per_group() <= COLUMN_MAJOR_MAX_ROWS && g.out_per_group() < g.patch() {
        Strides::column_major(g.out_per_group())
    } else {
        Strides::row_major(g.patch())
    }
}

const COLUMN_MAJOR_MAX_ROWS: usize = 128;

pub(in crate::ops) fn grad_weight(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let (op, patch, og, cg) = (g.out_plane(), g.patch(), g.out_per_group(), g.in_per_group());
    let x_image = g.channels * g.in_plane();
    let out_image = g.out_channels * op;
    let plan = Plan::new(g.batch, op);
    let parallelism = plan.gemm_parallelism();
    let patches = Patches::new(g);
    let weights = g.out_channels * patch;
    let sums = weight_gradient_strides(g);
    let accumulate_chunk = |scratch: &mut Scratch, chunk: usize, dw: &mut [f32]| {
        let n0 = chunk * plan.images;
        let nb = plan.images.min(g.batch - n0);
        let cols = nb * op;
        let direct_input = g.is_pointwise() && nb == 1;
        let col = take(&mut scratch.col, if direct_input { 0 } else { patch * cols });
        let stacked = take(&mut scratch.stacked, if nb > 1 { og * cols } else { 0 });
        for grp in 0..g.groups {
            let col_t = if direct_input {
                let data = &x[n0 * x_image + grp * cg * g.in_plane()..][..cg * g.in_plane()];
                Mat { data, row_stride: 1, col_stride: op }
            } else {
                for j in 0..nb {
                    let image = &x[(n0 + j) * x_image + grp * cg * g.in_plane()..][..cg * g.in_plane()];
                    patches.im2col(g, image, col, cols, j * op);
                }
                Mat { data: col, row_stride: 1, col_stride: cols }
            };
            let dy_g = if nb == 1 {
                Mat { data: &dy[n0 * out_image + grp * og * op..][..og * op], row_stride: op, col_stride: 1 }
            } else {
                stack_images(&dy[n0 * out_image..], out_image, grp * og, og, op, nb, stacked);
                Mat { data: stacked, row_stride: cols, col_stride: 1 }
            };
            let dst = &mut dw[grp * og * patch..][..og * patch];
            matmul(dst, sums, (og, patch, cols), dy_g, col_t, true, parallelism);
        }
    };
    // One partial sum per worker over its run of chunks, added at the end.
    let partial = |t: usize| {
        let (mut dw, mut scratch) = (vec![0f32; weights], Scratch::default());
        plan.chunks_of(t).for_each(|chunk| accumulate_chunk(&mut scratch, chunk, &mut dw));
        dw
    };
    let mut partials = (0..plan.workers()).into_par_iter().map(partial).collect::<Vec<_>>().into_iter();
    let mut dw = partials.next().unwrap_or_else(|| vec![0f32; weights]);
    for partial in partials {
        dw.par_chunks_mut(ADD_RUN).zip(partial.par_chunks(ADD_RUN)).for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
    }
    if sums.row != 1 {
        return dw;
    }
    let mut row_major = vec![0f32; weights];
    for (dst, src) in row_major.chunks_exact_mut(og * patch).zip(dw.chunks_exact(og * patch)) {
        transpose(src, og, dst, patch, patch, og);
    }
    row_major
}

/// Floats of the partial sums one thread adds at a time.
const ADD_RUN: usize = 1 << 14;

/// What the im2col passes allocate: the offset table of the patches,
/// each busy thread's column and stacking buffers and gemm's packing, and in
/// the weight gradient the per-thread partial sums beyond the one that
/// becomes the result.
pub(in crate::ops) fn scratch(g: &Geometry) -> ConvScratch {
    let (op, patch, og) = (g.out_plane(), g.patch(), g.out_per_group());
    let plan = Plan::new(g.batch, op);
    let parallelism = plan.gemm_parallelism();
    let nb = plan.images.min(g.batch);
    let cols = nb * op;
    let col = if g.is_pointwise() && nb == 1 { 0 } else { patch * cols };
    let stacked = if nb > 1 { og * cols } else { 0 };
    let buffers = ((col + stacked) * size_of::<f32>()) as u64;
    let table = Patches::table_bytes(g);
    let busy = plan.workers() as u64;
    let weight_bytes = (g.out_channels * patch * size_of::<f32>()) as u64;
    let sums = weight_gradient_strides(g);
    // Every worker's partial but the one that becomes the result, and the
    // row-major copy when the sums were kept column-major.
    let partials = (busy - 1) * weight_bytes + if sums.row == 1 { weight_bytes } else { 0 };
    let pass = |dims, dst, lhs, rhs| table + busy * (buffers + gemm_packing::packing_bytes(dims, dst, lhs, rhs, parallelism));
    ConvScratch {
        forward: pass((og, cols, patch), Strides::row_major(cols), Strides::row_major(patch), Strides::row_major(cols)),
        input_gradient: pass((patch, cols, og), Patches::gradient_strides(g, cols), Strides::column_major(patch), Strides::row_major(cols)),
        weight_gradient: pass((og, patch, cols), sums, Strides::row_major(cols), Strides::column_major(cols)) + partials,
    }
}
