//! The gemm the CPU kernels share: a matrix view inside a slice, one product
//! through the gemm crate, the plan that cuts a batch into chunks of images
//! for the threads, and the small copies around products.

use std::mem::MaybeUninit;

use gemm::Parallelism;
use rayon::prelude::*;

use super::floats::init_with;
use super::gemm_packing::Strides;

/// A matrix inside a slice: element `(i, j)` is `data[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy)]
pub(in crate::ops) struct Mat<'a> {
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
pub(in crate::ops) fn matmul(
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
pub(in crate::ops) struct Plan {
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

pub(in crate::ops) fn take(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    &mut buffer[..len]
}

/// `dst[c * dst_stride + r] = src[r * src_stride + c]` for the `rows x cols`
/// matrix in `src`, in tiles that stay in the L1 cache.
pub(in crate::ops) fn transpose(src: &[f32], src_stride: usize, dst: &mut [f32], dst_stride: usize, rows: usize, cols: usize) {
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

/// The linear layer's products: each is one gemm threaded inside over rayon's threads. Cutting
/// the rows across the threads instead ran as fast (6304 rows, 192 -> 768
/// and back, on 2 threads) but has each thread pack the weight. The
/// transposed convolution's products are threaded the same way, one
/// sample's buffer at a time whatever the threads.
pub(in crate::ops) fn parallelism() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        threads => Parallelism::Rayon(threads),
    }
}

pub(in crate::ops) fn row_major(data: &[f32], width: usize) -> Mat<'_> {
    Mat { data, row_stride: width, col_stride: 1 }
}

/// The transpose of a row-major matrix of rows `width` long, read in place.
pub(in crate::ops) fn transposed(data: &[f32], width: usize) -> Mat<'_> {
    Mat { data, row_stride: 1, col_stride: width }
}
