//! Dense and grouped convolution on the CPU: im2col + gemm forward, gemm +
//! col2im for the input gradient, gemm against the im2col matrix for the
//! weight gradient. Small images are stacked into one wider matrix so that
//! late, spatially tiny layers still make gemm-sized products; chunks of
//! images run on rayon's threads. 3x3 stride-1 convolutions with enough
//! work go through [`winograd`] instead, which shares the chunking and gemm,
//! and the weight gradient of small padded maps through [`taps`].

use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use super::conv_geometry::Geometry;
use super::cuda::{self, Primitives, Reference};
use super::floats::{f32_view, init_with, storage_from_f32};
use super::gemm_packing::{self, Strides};
use super::{checked_gradients, ConvScratch};
use super::{depthwise, taps, winograd};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

/// Outputs `o` in `lo..hi` read inside the input along one axis (`0 <= o *
/// stride + offset - padding < size`); the others read padding.
pub(super) fn valid_outputs(offset: usize, size: usize, outputs: usize, padding: usize, stride: usize) -> (usize, usize) {
    let lo = padding.saturating_sub(offset).div_ceil(stride);
    let hi = match (size + padding).checked_sub(offset + 1) {
        Some(last) => (last / stride + 1).min(outputs),
        None => 0,
    };
    (lo.min(hi), hi)
}

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

/// A matrix inside a slice: element `(i, j)` is `data[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy)]
pub(super) struct Mat<'a> {
    pub data: &'a [f32],
    pub row_stride: usize,
    pub col_stride: usize,
}

impl Mat<'_> {
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.row_stride + (cols - 1) * self.col_stride < self.data.len()
    }
}

/// `dst (m x n, laid out as `dst_strides` say) (+)= lhs (m x k) * rhs (k x n)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul(
    dst: &mut [f32],
    dst_strides: Strides,
    (m, n, k): (usize, usize, usize),
    lhs: Mat,
    rhs: Mat,
    accumulate: bool,
    parallelism: Parallelism,
) {
    let dst_fits = Mat { data: dst, row_stride: dst_strides.row, col_stride: dst_strides.col }.fits(m, n);
    // Bounds of the raw pointers handed to gemm below.
    assert!(lhs.fits(m, k) && rhs.fits(k, n) && dst_fits);
    // SAFETY: the assertion keeps every element gemm reads or writes inside
    // the three slices, and `dst` is borrowed mutably, so it overlaps neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_strides.col as isize,
            dst_strides.row as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Columns a chunk of stacked images aims for: wide enough for gemm to run
/// at speed on 2x2 feature maps, narrow enough to keep the im2col buffer small.
const CHUNK_COLUMNS: usize = 512;

/// How a batch is cut into chunks of images and where the threads go:
/// across chunks when there are enough of them, else inside gemm.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    batch: usize,
    pub images: usize,
    chunks: usize,
    threads: usize,
    across_chunks: bool,
}

impl Plan {
    pub fn new(batch: usize, out_plane: usize) -> Self {
        Self::aiming(batch, out_plane, CHUNK_COLUMNS)
    }

    /// Chunks of about `columns` columns, at `per_image` columns an image.
    pub fn aiming(batch: usize, per_image: usize, columns: usize) -> Self {
        let threads = rayon::current_num_threads().max(1);
        let wanted = columns.div_ceil(per_image.max(1)).max(1);
        let fair = batch.div_ceil(threads).max(1);
        // As many chunks as a multiple of the threads, so that no thread is
        // left with one more chunk than the others (8 images of 14x14 on two
        // threads: 4 chunks of 2, not 3 of 3, 3 and 2).
        let chunks = batch.div_ceil(wanted.min(fair)).next_multiple_of(threads);
        let images = batch.div_ceil(chunks).max(1);
        let chunks = batch.div_ceil(images);
        Self { batch, images, chunks, threads, across_chunks: threads == 1 || chunks >= threads }
    }

    pub fn gemm_parallelism(&self) -> Parallelism {
        if self.across_chunks {
            Parallelism::None
        } else {
            Parallelism::Rayon(self.threads)
        }
    }

    /// The threads that take chunks, each a contiguous run of them.
    pub fn workers(&self) -> usize {
        if self.across_chunks {
            self.threads.min(self.chunks).max(1)
        } else {
            1
        }
    }

    /// The chunks worker `t` of [`workers`](Self::workers) takes.
    pub fn chunks_of(&self, t: usize) -> std::ops::Range<usize> {
        let workers = self.workers();
        t * self.chunks / workers..(t + 1) * self.chunks / workers
    }

    /// A result of `per_image` floats per image, made by `f(scratch,
    /// first_image, chunk)` on each chunk of `per_image * images` of it, the
    /// chunk zeroed first. Each worker zeroes its chunks just before it
    /// fills them, in its own cache (a zeroed allocation would be one more
    /// pass over the whole result, on one thread), and grows one scratch
    /// for all its chunks.
    pub fn map_chunks<S: Default>(&self, per_image: usize, f: impl Fn(&mut S, usize, &mut [f32]) + Sync + Send) -> Vec<f32> {
        // SAFETY: `init_with` writes every element of the chunk.
        unsafe { self.map_chunks_uninit(per_image, |scratch, first, chunk| f(scratch, first, init_with(chunk, 0.0))) }
    }

    /// [`map_chunks`](Self::map_chunks) for an `f` that writes every element of its chunk itself.
    ///
    /// # Safety
    /// `f` must write every element of the chunk it is given.
    pub unsafe fn map_chunks_uninit<S: Default>(
        &self,
        per_image: usize,
        f: impl Fn(&mut S, usize, &mut [MaybeUninit<f32>]) + Sync + Send,
    ) -> Vec<f32> {
        let total = self.batch * per_image;
        let len = (per_image * self.images).max(1);
        let mut result = Vec::with_capacity(total);
        let run = |t: usize, part: &mut [MaybeUninit<f32>]| {
            let mut scratch = S::default();
            let first = self.chunks_of(t).start;
            for (i, chunk) in part.chunks_mut(len).enumerate() {
                f(&mut scratch, (first + i) * self.images, chunk);
            }
        };
        let mut rest = &mut result.spare_capacity_mut()[..total];
        let mut parts = Vec::with_capacity(self.workers());
        for t in 0..self.workers() {
            let (part, tail) = rest.split_at_mut((self.chunks_of(t).len() * len).min(rest.len()));
            parts.push((t, part));
            rest = tail;
        }
        if let [(t, part)] = parts.as_mut_slice() {
            run(*t, part);
        } else {
            parts.into_par_iter().for_each(|(t, part)| run(t, part));
        }
        // SAFETY: the workers' parts cover the first `total` elements, and `f`
        // wrote every element of each chunk of them.
        unsafe { result.set_len(total) };
        result
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

pub(super) fn take(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    &mut buffer[..len]
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

fn forward(g: &Geometry, x: &[f32], w: &[f32]) -> Vec<f32> {
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

fn grad_input(g: &Geometry, dy: &[f32], w: &[f32]) -> Vec<f32> {
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

/// `dst[c * dst_stride + r] = src[r * src_stride + c]` for the `rows x cols`
/// matrix in `src`, in tiles that stay in the L1 cache.
pub(super) fn transpose(src: &[f32], src_stride: usize, dst: &mut [f32], dst_stride: usize, rows: usize, cols: usize) {
    const TILE: usize = 32;
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for c in c0..(c0 + TILE).min(cols) {
                for r in r0..(r0 + TILE).min(rows) {
                    dst[c * dst_stride + r] = src[r * src_stride + c];
                }
            }
        }
    }
}

fn grad_weight(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
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

/// What each pass of [`convolve`] allocates beyond its operands and result,
/// for the algorithm it takes. The depthwise loop allocates none.
pub(super) fn scratch(g: &Geometry) -> ConvScratch {
    if g.is_depthwise() || g.batch == 0 {
        return ConvScratch::default();
    }
    let passes = if winograd::applies(g) { winograd::scratch(g) } else { im2col_scratch(g) };
    if taps::applies(g) {
        ConvScratch { weight_gradient: taps::weight_gradient_scratch(g), ..passes }
    } else {
        passes
    }
}

/// [`scratch`] for the im2col passes: the offset table of the patches,
/// each busy thread's column and stacking buffers and gemm's packing, and in
/// the weight gradient the per-thread partial sums beyond the one that
/// becomes the result.
fn im2col_scratch(g: &Geometry) -> ConvScratch {
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

/// The convolution of `x` by `w`, dense, grouped or depthwise.
pub(super) fn convolve(g: &Geometry, x: &[f32], w: &[f32]) -> Vec<f32> {
    if g.is_depthwise() {
        depthwise::forward(g, x, w)
    } else if winograd::applies(g) {
        winograd::forward(g, x, w)
    } else {
        forward(g, x, w)
    }
}

/// The input gradient of [`convolve`] for the output gradient `dy`.
pub(super) fn convolve_grad_input(g: &Geometry, dy: &[f32], w: &[f32]) -> Vec<f32> {
    if g.is_depthwise() {
        depthwise::grad_input(g, dy, w)
    } else if winograd::applies(g) {
        winograd::grad_input(g, dy, w)
    } else {
        grad_input(g, dy, w)
    }
}

/// The weight gradient of [`convolve`] for the output gradient `dy`.
pub(super) fn convolve_grad_weight(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    if g.is_depthwise() {
        depthwise::grad_weight(g, x, dy)
    } else if taps::applies(g) {
        taps::grad_weight(g, x, dy)
    } else if winograd::applies(g) {
        winograd::grad_weight(g, x, dy)
    } else {
        grad_weight(g, x, dy)
    }
}

/// The convolution as a candle op: `x` and `weight` in, output out, and a
/// backward made of the two ops below.
pub(super) struct Conv2d(pub Geometry);

impl CustomOp2 for Conv2d {
    fn name(&self) -> &'static str {
        "conv2d"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return cuda::forward::<Reference, 2>(self.name(), [(s1, l1), (s2, l2)], |p, [x, w]| cuda::conv_forward(p, &self.0, x, w));
        }
        let g = &self.0;
        let x = f32_view(self.name(), s1, l1)?;
        let w = f32_view(self.name(), s2, l2)?;
        let out = convolve(g, &x, &w);
        Ok((storage_from_f32(self.name(), out, s1.dtype())?, g.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::forward::<cuda::Cudnn, 2>(self.name(), [(s1, l1), (s2, l2)], |p, [x, w]| cuda::conv_forward(p, &self.0, x, w))
    }

    fn bwd(&self, x: &Tensor, weight: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let grad_x = if x.track_op() { Some(grad.apply_op2_no_bwd(weight, &Conv2dGradInput(self.0))?) } else { None };
        let grad_w = if weight.track_op() { Some(x.apply_op2_no_bwd(&grad, &Conv2dGradWeight(self.0))?) } else { None };
        let [grad_x, grad_w] = checked_gradients(self.name(), [x, weight], [grad_x, grad_w])?;
        Ok((grad_x, grad_w))
    }
}

/// `(grad_out, weight) -> grad_x`.
pub(super) struct Conv2dGradInput(pub Geometry);

impl Conv2dGradInput {
    fn on_device<P: Primitives>(&self, operands: [(&P::Storage, &Layout); 2]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, 2>("conv2d-grad-input", operands, |p, [dy, w]| cuda::conv_input_gradient(p, &self.0, dy, w))
    }
}

impl CustomOp2 for Conv2dGradInput {
    fn name(&self) -> &'static str {
        "conv2d-grad-input"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(s1, l1), (s2, l2)]);
        }
        let g = &self.0;
        let dy = f32_view(self.name(), s1, l1)?;
        let w = f32_view(self.name(), s2, l2)?;
        let dx = convolve_grad_input(g, &dy, &w);
        Ok((storage_from_f32(self.name(), dx, s1.dtype())?, g.in_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2)])
    }
}

/// `(x, grad_out) -> grad_weight`.
pub(super) struct Conv2dGradWeight(pub Geometry);

impl Conv2dGradWeight {
    fn on_device<P: Primitives>(&self, operands: [(&P::Storage, &Layout); 2]) -> Result<(P::Storage, Shape)> {
        cuda::forward::<P, 2>("conv2d-grad-weight", operands, |p, [x, dy]| cuda::conv_weight_gradient(p, &self.0, x, dy))
    }
}

impl CustomOp2 for Conv2dGradWeight {
    fn name(&self) -> &'static str {
        "conv2d-grad-weight"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if cuda::on_the_reference() {
            return self.on_device::<Reference>([(s1, l1), (s2, l2)]);
        }
        let g = &self.0;
        let x = f32_view(self.name(), s1, l1)?;
        let dy = f32_view(self.name(), s2, l2)?;
        let dw = convolve_grad_weight(g, &x, &dy);
        Ok((storage_from_f32(self.name(), dw, s1.dtype())?, g.weight_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        self.on_device::<cuda::Cudnn>([(s1, l1), (s2, l2)])
    }
}
