//! Winograd's minimal filtering (Lavin and Gray, "Fast Algorithms for
//! Convolutional Neural Networks", 2016) for dense 3x3 stride-1
//! convolutions on the CPU.
//!
//! Forward, each 2x2 block of outputs is F(2x2, 3x3): the 4x4 input tile
//! under it and the 3x3 kernel are each turned into 16 numbers, multiplied
//! pointwise and summed over the input channels (16 gemms, one per number),
//! and turned back into the 2x2 outputs: 16 multiplications where the
//! direct convolution (and im2col) does 36. The input gradient is the same
//! convolution of the output gradient by the flipped, transposed kernel.
//! The weight gradient is F(3x3, 2x2): the 4x4 input tile against the 2x2
//! block of output gradient over it, summed over every tile of the batch in
//! the transformed domain (16 gemms) and turned into the 3x3 taps once.
//!
//! The transforms are exact up to rounding: they add, subtract and halve.

use std::mem::MaybeUninit;
use std::ops::Range;

use multiversion::multiversion;
use rayon::prelude::*;

use super::super::conv_geometry::Geometry;
use super::super::ConvScratch;
use super::gemm::{matmul, take, Mat, Plan};
use super::gemm_packing::{self, Strides};

/// Numbers of a transformed tile, and gemms per pass.
const TILE: usize = 16;

/// Tiles a chunk of small images aims for (stacked side by side in one
/// product). ResNet18 b32@64, 1 thread: 0.357 s a step at 64, 0.366 at 128,
/// 0.367 at 256, 0.383 at 512.
const CHUNK_TILES: usize = 64;

/// Tiles of a large image taken at a time: it caps a worker's buffers
/// (16 values per tile and channel, 4x the image's bytes) on large maps.
/// A ResNet's 56x56 maps (784 tiles) are taken whole: bands of 64 tiles
/// made ResNet18 b8@224 3% slower (gemm's products grow too thin).
const BAND_TILES: usize = 1024;

/// Tiles each thread must have for the transforms and the 16 weight
/// gradient sums a kernel (im2col's: 9) to pay: ResNet18 b8@224's 7x7
/// layers on 2 threads have 64 and keep im2col.
const MIN_TILES_PER_THREAD: usize = 128;

/// With fewer channels on either side, im2col stays (its speed against
/// Winograd's was measured from 64 channels up only).
const MIN_CHANNELS: usize = 16;

/// Outputs narrower than this keep im2col: a 2x2 output is one tile per
/// image, and its transforms cost more than the multiplications saved
/// (ResNet18 b32@64, whose last stage is 2x2: 0.403 s a step through
/// Winograd, 0.360 without).
const MIN_OUTPUT_SIDE: usize = 4;

/// Whether [`forward`], [`grad_input`] and [`grad_weight`] take this convolution.
/// Padding up to 2 keeps the input gradient's convolution (padded `2 - padding`) of the same kind.
pub(in crate::ops) fn applies(g: &Geometry) -> bool {
    g.groups == 1
        && (g.kernel_h, g.kernel_w, g.stride) == (3, 3, 1)
        && g.padding <= 2
        && g.channels >= MIN_CHANNELS
        && g.out_channels >= MIN_CHANNELS
        && g.out_h.min(g.out_w) >= MIN_OUTPUT_SIDE
        && g.batch.div_ceil(rayon::current_num_threads().max(1)) * Tiles::of(g).per_image() >= MIN_TILES_PER_THREAD
}

/// How one image's output is cut into 2x2 tiles (the last row and column
/// of tiles overhang an odd output), and the tiles into bands of rows.
#[derive(Debug, Clone, Copy)]
struct Tiles {
    rows: usize,
    cols: usize,
    /// Tile rows a large image is taken in at a time (about [`BAND_TILES`]
    /// tiles), which caps a worker's buffers; smaller images are taken
    /// whole (and stacked).
    band: usize,
}

impl Tiles {
    fn of(g: &Geometry) -> Self {
        let (rows, cols) = (g.out_h.div_ceil(2), g.out_w.div_ceil(2));
        Self { rows, cols, band: BAND_TILES.div_ceil(cols).min(rows) }
    }

    fn per_image(&self) -> usize {
        self.rows * self.cols
    }

    fn bands(&self) -> impl Iterator<Item = Range<usize>> {
        let (rows, band) = (self.rows, self.band);
        (0..rows).step_by(band).map(move |i| i..(i + band).min(rows))
    }

    /// Rows of the zero-padded input a band reads (tile row `i` reads rows `2i..2i + 4`).
    fn padded_rows(&self) -> usize {
        2 * self.band + 2
    }

    /// Even (or odd) columns of a padded input row.
    fn pairs(&self) -> usize {
        self.cols + 1
    }

    /// Floats of the padded, deinterleaved band [`transform_input`] builds.
    fn plane_len(&self) -> usize {
        self.padded_rows() * 2 * self.pairs()
    }

    /// Floats of the row transforms kept between a plane's two passes, or
    /// of the output transform's sums.
    fn rows_len(&self) -> usize {
        (self.padded_rows() * 4).max(12 * self.band) * self.cols
    }
}

/// A worker's buffers, grown to its largest chunk and reused.
#[derive(Default)]
struct Buffers {
    /// A band's transformed input: 16 matrices of `channels x tiles`, rows [`pitch`] apart.
    input: Vec<f32>,
    /// The other operand or the products: 16 matrices of `out_channels x tiles`, rows [`pitch`] apart.
    other: Vec<f32>,
    plane: Vec<f32>,
    rows: Vec<f32>,
}

impl Buffers {
    fn bytes(g: &Geometry, tiles: Tiles, chunk_tiles: usize) -> u64 {
        let floats = TILE * (g.channels + g.out_channels) * pitch(chunk_tiles) + tiles.plane_len() + tiles.rows_len();
        (floats * size_of::<f32>()) as u64
    }
}

// Inlined into the callers compiled for AVX-512 or AVX2 (as a function of
// their own they are compiled for SSE2: 4 lanes), each operand cut to the
// destination's length so that the loop has no bounds checks.
#[inline(always)]
fn zip2(dst: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) {
    let n = dst.len();
    let (a, b) = (&a[..n], &b[..n]);
    for i in 0..n {
        dst[i] = f(a[i], b[i]);
    }
}

#[inline(always)]
fn zip3(dst: &mut [f32], a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) {
    let n = dst.len();
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    for i in 0..n {
        dst[i] = f(a[i], b[i], c[i]);
    }
}

/// `Bᵀ d` of F(2, 3) on a column of four: shared by F(3, 2), whose last
/// row of `G` carries the sign instead.
#[inline(always)]
fn input_rows(out: [&mut [f32]; 4], d: [&[f32]; 4]) {
    let [o0, o1, o2, o3] = out;
    zip2(o0, d[0], d[2], |a, b| a - b);
    zip2(o1, d[1], d[2], |a, b| a + b);
    zip2(o2, d[2], d[1], |a, b| a - b);
    zip2(o3, d[1], d[3], |a, b| a - b);
}

/// Writes the 16 transformed values of every tile in `band` (tile rows)
/// of one plane (`height x width`, zero-padded by `padding`) into `v`:
/// value `xi` of the band's tile `t` goes to `v[xi * matrix + t]`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn transform_input(
    g_in: (usize, usize, usize),
    tiles: Tiles,
    band: Range<usize>,
    plane: &[f32],
    bufs: (&mut Vec<f32>, &mut Vec<f32>),
    v: &mut [f32],
    matrix: usize,
) {
    let (height, width, padding) = g_in;
    let (pairs, cols, n) = (tiles.pairs(), tiles.cols, band.len());
    let padded = take(bufs.0, (2 * n + 2) * 2 * pairs);
    padded.fill(0.0);
    // Even and odd columns apart, so that each transform below is a run of vector operations.
    for (r, row) in padded.chunks_exact_mut(2 * pairs).enumerate() {
        let Some(y) = (2 * band.start + r).checked_sub(padding).filter(|&y| y < height) else { continue };
        let src = &plane[y * width..][..width];
        let (even, odd) = row.split_at_mut(pairs);
        let shift = padding / 2;
        let (first, second) = if padding % 2 == 0 { (&mut even[shift..], &mut odd[shift..]) } else { (odd, &mut even[1..]) };
        deinterleave(src, first, second);
    }
    let rows = take(bufs.1, 4 * (2 * n + 2) * cols);
    let block = (2 * n + 2) * cols;
    for (r, row) in padded.chunks_exact(2 * pairs).enumerate() {
        let (even, odd) = row.split_at(pairs);
        let at = parity_split(r, n + 1, cols);
        input_rows(four_rows(rows, [0, 1, 2, 3].map(|b| b * block + at), cols), [&even[..cols], &odd[..cols], &even[1..], &odd[1..]]);
    }
    let span = n * cols;
    for b in 0..4 {
        let (even, odd) = rows[b * block..][..block].split_at(block / 2);
        let d = [&even[..span], &odd[..span], &even[cols..][..span], &odd[cols..][..span]];
        input_rows(four_rows(v, [0, 1, 2, 3].map(|a| (a * 4 + b) * matrix), span), d);
    }
}

/// Where row `r` of a band's rows goes when its even rows (`half` of them)
/// are laid out before its odd ones, `cols` to a row: tile row `i` then
/// reads its four rows as runs over every tile of the band, starting at
/// `i * cols` in the even, odd, even and odd halves (the last two a row on).
fn parity_split(r: usize, half: usize, cols: usize) -> usize {
    ((r % 2) * half + r / 2) * cols
}

/// Runs `transform(plane, v, matrix)` on every plane of a chunk's images
/// (`planes` planes of `plane_len` floats an image), each writing its
/// band's `per_image` tiles at its place in the 16 matrices of `v`: plane
/// `p` of image `j` from `p * pitch + j * per_image`, each matrix
/// `planes * pitch` long.
fn each_plane(
    images: &[f32],
    planes: usize,
    plane_len: usize,
    (per_image, pitch): (usize, usize),
    v: &mut [f32],
    mut transform: impl FnMut(&[f32], &mut [f32], usize),
) {
    for (j, image) in images.chunks_exact(planes * plane_len).enumerate() {
        for (p, plane) in image.chunks_exact(plane_len).enumerate() {
            transform(plane, &mut v[p * pitch + j * per_image..], planes * pitch);
        }
    }
}

/// The distance between two channels' rows of a chunk's `tiles` transformed
/// values: an odd number of cache lines. At a power of two (an image of
/// 64x64 is 1024 tiles, 4 KiB) every row falls in the same sets of the L1
/// cache, and gemm's packing of 32 rows ran 2.8x slower.
fn pitch(tiles: usize) -> usize {
    const LINE: usize = 64 / size_of::<f32>();
    let lines = tiles.div_ceil(LINE);
    (lines + 1 - lines % 2) * LINE
}

/// `src`'s even elements into `even`, its odd ones into `odd`.
fn deinterleave(src: &[f32], even: &mut [f32], odd: &mut [f32]) {
    let pairs = src.chunks_exact(2);
    if let [last] = pairs.remainder() {
        even[src.len() / 2] = *last;
    }
    for ((pair, e), o) in pairs.zip(even).zip(odd) {
        *e = pair[0];
        *o = pair[1];
    }
}

/// Four disjoint runs of `len` at increasing offsets of `v`.
#[inline(always)]
fn four_rows(v: &mut [f32], at: [usize; 4], len: usize) -> [&mut [f32]; 4] {
    let (a, rest) = v[at[0]..].split_at_mut(at[1] - at[0]);
    let (b, rest) = rest.split_at_mut(at[2] - at[1]);
    let (c, d) = rest.split_at_mut(at[3] - at[2]);
    [&mut a[..len], &mut b[..len], &mut c[..len], &mut d[..len]]
}

/// Kernels transformed together: each step below is then a vector
/// operation over a block, and each transformed value a contiguous run.
const KERNEL_BLOCK: usize = 64;

type Block = [f32; KERNEL_BLOCK];

/// `G k` of F(2x2, 3x3) on a column of three blocks.
fn kernel_column(k: [&Block; 3]) -> [Block; 4] {
    let mut out = [[0f32; KERNEL_BLOCK]; 4];
    for j in 0..KERNEL_BLOCK {
        let (k0, k1, k2) = (k[0][j], k[1][j], k[2][j]);
        out[0][j] = k0;
        out[1][j] = (k0 + k1 + k2) * 0.5;
        out[2][j] = (k0 - k1 + k2) * 0.5;
        out[3][j] = k2;
    }
    out
}

/// `G g Gᵀ` of F(2x2, 3x3) for each of the `kernels` 3x3 kernels of `w`:
/// value `xi` of kernel `k` at `xi * kernels + k`. Runs of kernels go to
/// rayon's threads.
fn transform_weights(w: &[f32], kernels: usize) -> Vec<f32> {
    let mut u = Vec::with_capacity(TILE * kernels);
    let mut values: Vec<_> = u.spare_capacity_mut()[..TILE * kernels].chunks_exact_mut(kernels).map(|v| v.chunks_mut(KERNEL_RUN)).collect();
    let runs: Vec<Vec<&mut [MaybeUninit<f32>]>> =
        (0..kernels.div_ceil(KERNEL_RUN)).map(|_| values.iter_mut().filter_map(Iterator::next).collect()).collect();
    runs.into_par_iter().enumerate().for_each(|(r, mut run)| {
        let first = r * KERNEL_RUN;
        for start in (0..run[0].len()).step_by(KERNEL_BLOCK) {
            let n = KERNEL_BLOCK.min(run[0].len() - start);
            let mut taps = [[0f32; KERNEL_BLOCK]; 9];
            for (j, k) in w[(first + start) * 9..][..n * 9].chunks_exact(9).enumerate() {
                for (tap, &value) in taps.iter_mut().zip(k) {
                    tap[j] = value;
                }
            }
            let rows = [0, 1, 2].map(|r| kernel_column([&taps[3 * r], &taps[3 * r + 1], &taps[3 * r + 2]]));
            for b in 0..4 {
                for (a, transformed) in kernel_column([&rows[0][b], &rows[1][b], &rows[2][b]]).iter().enumerate() {
                    for (dst, &value) in run[a * 4 + b][start..][..n].iter_mut().zip(transformed) {
                        dst.write(value);
                    }
                }
            }
        }
    });
    // SAFETY: the runs cover every kernel of the 16 values, and each wrote all of its own.
    unsafe { u.set_len(TILE * kernels) };
    u
}

/// Kernels one thread transforms at a time.
const KERNEL_RUN: usize = 64 * KERNEL_BLOCK;

/// `Aᵀ m` of F(3x3, 2x2) on a column of four blocks.
fn gradient_column(m: [&Block; 4]) -> [Block; 3] {
    let mut out = [[0f32; KERNEL_BLOCK]; 3];
    for j in 0..KERNEL_BLOCK {
        let (m0, m1, m2, m3) = (m[0][j], m[1][j], m[2][j], m[3][j]);
        out[0][j] = m0 + m1 + m2;
        out[1][j] = m1 - m2;
        out[2][j] = m1 + m2 + m3;
    }
    out
}

/// The 3x3 weight gradient `Aᵀ m A` of each kernel from its 16 sums, the
/// total of `partials` (value `xi` of kernel `(o, c)` at `xi * kernels +
/// o * row + c * col` for the `strides` [`grad_weight`] accumulated them
/// in), as `out x in x 3 x 3`, runs of kernels on rayon's threads.
fn weight_gradient_from_sums(partials: &[Vec<f32>], strides: Strides, kernels: usize) -> Vec<f32> {
    // Where kernel `k = o * in + c` sits in the sums.
    let in_n = if strides.row == 1 { kernels / strides.col } else { strides.row };
    let position = |k: usize| (k / in_n) * strides.row + (k % in_n) * strides.col;
    let mut dw = vec![0f32; 9 * kernels];
    dw.par_chunks_mut(9 * KERNEL_RUN).enumerate().for_each(|(r, run)| {
        for (b, taps) in run.chunks_mut(9 * KERNEL_BLOCK).enumerate() {
            let first = r * KERNEL_RUN + b * KERNEL_BLOCK;
            let n = taps.len() / 9;
            let mut positions = [0usize; KERNEL_BLOCK];
            if strides.col != 1 {
                for (j, p) in positions[..n].iter_mut().enumerate() {
                    *p = position(first + j);
                }
            }
            let mut m = [[0f32; KERNEL_BLOCK]; TILE];
            for (xi, block) in m.iter_mut().enumerate() {
                for partial in partials {
                    let sums = &partial[xi * kernels..][..kernels];
                    if strides.col == 1 {
                        block[..n].iter_mut().zip(&sums[first..first + n]).for_each(|(m, s)| *m += s);
                    } else {
                        block[..n].iter_mut().zip(&positions[..n]).for_each(|(m, &p)| *m += sums[p]);
                    }
                }
            }
            let rows = [0, 1, 2, 3].map(|a| gradient_column([&m[a * 4], &m[a * 4 + 1], &m[a * 4 + 2], &m[a * 4 + 3]]));
            for kw in 0..3 {
                let column = gradient_column([&rows[0][kw], &rows[1][kw], &rows[2][kw], &rows[3][kw]]);
                for (j, kernel) in taps.chunks_exact_mut(9).enumerate() {
                    for (kh, values) in column.iter().enumerate() {
                        kernel[kh * 3 + kw] = values[j];
                    }
                }
            }
        }
    });
    dw
}

/// Turns the products of the tiles in `band` of one output plane (value
/// `xi` of the band's tile `t` at `m[xi * matrix + t]`) into their outputs
/// (of `out_h x out_w`) with `Aᵀ m A`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn transform_output(
    out_size: (usize, usize),
    tiles: Tiles,
    band: Range<usize>,
    m: &[f32],
    matrix: usize,
    rows: &mut Vec<f32>,
    out: &mut [MaybeUninit<f32>],
) {
    let (out_h, out_w) = out_size;
    let (cols, span) = (tiles.cols, band.len() * tiles.cols);
    let s = take(rows, 12 * span);
    let (sums, pairs) = s.split_at_mut(8 * span);
    for b in 0..4 {
        let m = [0, 1, 2, 3].map(|a| &m[(a * 4 + b) * matrix..][..span]);
        let (s0, s1) = sums[2 * b * span..][..2 * span].split_at_mut(span);
        zip3(s0, m[0], m[1], m[2], |a, b, c| a + b + c);
        zip3(s1, m[1], m[2], m[3], |a, b, c| a - b - c);
    }
    for u in 0..2 {
        let s = [0, 1, 2, 3].map(|b| &sums[(2 * b + u) * span..][..span]);
        let (even, odd) = pairs[2 * u * span..][..2 * span].split_at_mut(span);
        zip3(even, s[0], s[1], s[2], |a, b, c| a + b + c);
        zip3(odd, s[1], s[2], s[3], |a, b, c| a - b - c);
    }
    for (i, tile_row) in band.enumerate() {
        for u in 0..2.min(out_h - 2 * tile_row) {
            let [even, odd] = [0, 1].map(|parity| &pairs[(2 * u + parity) * span + i * cols..][..cols]);
            let row = &mut out[(2 * tile_row + u) * out_w..][..out_w];
            if let [last] = row.chunks_exact_mut(2).into_remainder() {
                last.write(even[out_w / 2]);
            }
            for ((pair, &e), &o) in row.chunks_exact_mut(2).zip(even).zip(odd) {
                pair[0].write(e);
                pair[1].write(o);
            }
        }
    }
}

/// Tiles per image and the plan of chunks, with the chunk's tile count.
fn plan(g: &Geometry) -> (Tiles, Plan) {
    let tiles = Tiles::of(g);
    (tiles, Plan::aiming(g.batch, tiles.per_image(), CHUNK_TILES))
}

/// The convolution of `x` by `w` (`out x in x 3 x 3`).
pub(in crate::ops) fn forward(g: &Geometry, x: &[f32], w: &[f32]) -> Vec<f32> {
    let (o_n, c_n) = (g.out_channels, g.channels);
    let u = transform_weights(w, o_n * c_n);
    convolve_transformed(g, x, |xi| Mat { data: &u[xi * o_n * c_n..][..o_n * c_n], row_stride: c_n, col_stride: 1 })
}

/// The convolution `g` with the transformed kernels: `kernels(xi)` is the
/// `out x in` matrix of their value `xi`.
fn convolve_transformed<'a>(g: &Geometry, x: &[f32], kernels: impl Fn(usize) -> Mat<'a> + Sync) -> Vec<f32> {
    let (tiles, plan) = plan(g);
    let (c_n, o_n) = (g.channels, g.out_channels);
    let (x_image, out_image) = (c_n * g.in_plane(), o_n * g.out_plane());
    let parallelism = plan.gemm_parallelism();
    // SAFETY: the output transforms write every output of the chunk's images.
    unsafe {
        plan.map_chunks_uninit(out_image, |bufs: &mut Buffers, n0, out_chunk| {
            let nb = out_chunk.len() / out_image;
            for band in tiles.bands() {
                let per_image = band.len() * tiles.cols;
                let (t_n, pitch) = (nb * per_image, pitch(nb * per_image));
                let v = take(&mut bufs.input, TILE * c_n * pitch);
                each_plane(&x[n0 * x_image..][..nb * x_image], c_n, g.in_plane(), (per_image, pitch), v, |plane, v, matrix| {
                    transform_input(
                        (g.height, g.width, g.padding),
                        tiles,
                        band.clone(),
                        plane,
                        (&mut bufs.plane, &mut bufs.rows),
                        v,
                        matrix,
                    )
                });
                let m = take(&mut bufs.other, TILE * o_n * pitch);
                for xi in 0..TILE {
                    let rhs = Mat { data: &v[xi * c_n * pitch..][..c_n * pitch], row_stride: pitch, col_stride: 1 };
                    matmul(
                        &mut m[xi * o_n * pitch..][..o_n * pitch],
                        Strides::row_major(pitch),
                        (o_n, t_n, c_n),
                        kernels(xi),
                        rhs,
                        false,
                        parallelism,
                    );
                }
                for (j, image) in out_chunk.chunks_exact_mut(out_image).enumerate() {
                    for (o, plane) in image.chunks_exact_mut(g.out_plane()).enumerate() {
                        let m = &m[o * pitch + j * per_image..];
                        transform_output((g.out_h, g.out_w), tiles, band.clone(), m, o_n * pitch, &mut bufs.rows, plane);
                    }
                }
            }
        })
    }
}

/// The convolution whose forward is the input gradient of `g`'s: the output
/// gradient in, padded so that a 3x3 window reaches every input it came from.
fn transposed(g: &Geometry) -> Geometry {
    Geometry {
        channels: g.out_channels,
        height: g.out_h,
        width: g.out_w,
        out_channels: g.channels,
        padding: 2 - g.padding,
        out_h: g.height,
        out_w: g.width,
        ..*g
    }
}

/// The input gradient of [`forward`] for the output gradient `dy`: the
/// convolution by `w` rotated by 180 degrees and transposed (`in x out`).
/// Rotating a kernel swaps the first and last of its four transformed rows
/// and columns, so the forward's transformed kernels serve, read
/// transposed.
pub(in crate::ops) fn grad_input(g: &Geometry, dy: &[f32], w: &[f32]) -> Vec<f32> {
    const ROTATED: [usize; 4] = [3, 1, 2, 0];
    let (o_n, c_n) = (g.out_channels, g.channels);
    let u = transform_weights(w, o_n * c_n);
    let kernels = |xi: usize| {
        let data = &u[(ROTATED[xi / 4] * 4 + ROTATED[xi % 4]) * o_n * c_n..][..o_n * c_n];
        Mat { data, row_stride: 1, col_stride: c_n }
    };
    convolve_transformed(&transposed(g), dy, kernels)
}

/// `G' dy G'ᵀ` of F(3x3, 2x2) (with `Bᵀ` as in F(2x2, 3x3), so `G'`'s
/// last row is negated) of every 2x2 tile of one output-gradient plane,
/// in `band`, written as [`transform_input`] writes.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn transform_gradient(
    out_size: (usize, usize),
    tiles: Tiles,
    band: Range<usize>,
    plane: &[f32],
    bufs: (&mut Vec<f32>, &mut Vec<f32>),
    v: &mut [f32],
    matrix: usize,
) {
    let (out_h, out_w) = out_size;
    let (cols, n) = (tiles.cols, band.len());
    let split = take(bufs.0, 2 * n * 2 * cols);
    split.fill(0.0);
    let first = 2 * band.start;
    for (src, row) in plane.chunks_exact(out_w).take(out_h).skip(first).zip(split.chunks_exact_mut(2 * cols)) {
        let (even, odd) = row.split_at_mut(cols);
        deinterleave(src, even, odd);
    }
    let rows = take(bufs.1, 4 * 2 * n * cols);
    let block = 2 * n * cols;
    for (r, row) in split.chunks_exact(2 * cols).enumerate() {
        let (even, odd) = row.split_at(cols);
        let at = parity_split(r, n, cols);
        gradient_rows(four_rows(rows, [0, 1, 2, 3].map(|b| b * block + at), cols), even, odd);
    }
    for b in 0..4 {
        let (top, bottom) = rows[b * block..][..block].split_at(block / 2);
        gradient_rows(four_rows(v, [0, 1, 2, 3].map(|a| (a * 4 + b) * matrix), block / 2), top, bottom);
    }
}

/// `G' d` of F(3x3, 2x2) on a column of two (`e` above `o`).
#[inline(always)]
fn gradient_rows(out: [&mut [f32]; 4], e: &[f32], o: &[f32]) {
    let [o0, o1, o2, o3] = out;
    o0.copy_from_slice(e);
    zip2(o1, e, o, |a, b| (a + b) * 0.5);
    zip2(o2, e, o, |a, b| (a - b) * 0.5);
    zip2(o3, o, o, |a, _| -a);
}

/// How the weight gradient's `out x in` sums are laid out: column-major
/// when there are few output channels, so that gemm reads the transformed
/// input (the largest operand) as it is (64 channels: 1.4x as fast); with
/// more, scattering column-major sums into the weight gradient's
/// `out x in x 3 x 3` order costs more than gemm gains.
fn sums_strides(g: &Geometry) -> Strides {
    if g.out_channels <= COLUMN_MAJOR_MAX_OUT {
        Strides::column_major(g.out_channels)
    } else {
        Strides::row_major(g.channels)
    }
}

const COLUMN_MAJOR_MAX_OUT: usize = 128;

/// The weight gradient of [`forward`] for the output gradient `dy`.
pub(in crate::ops) fn grad_weight(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let (tiles, plan) = plan(g);
    let (c_n, o_n) = (g.channels, g.out_channels);
    let (x_image, out_image) = (c_n * g.in_plane(), o_n * g.out_plane());
    let parallelism = plan.gemm_parallelism();
    let accumulate_chunk = |bufs: &mut Buffers, chunk: usize, sums: &mut [f32]| {
        let n0 = chunk * plan.images;
        let nb = plan.images.min(g.batch - n0);
        for band in tiles.bands() {
            let per_image = band.len() * tiles.cols;
            let (t_n, pitch) = (nb * per_image, pitch(nb * per_image));
            let v = take(&mut bufs.input, TILE * c_n * pitch);
            each_plane(&x[n0 * x_image..][..nb * x_image], c_n, g.in_plane(), (per_image, pitch), v, |plane, v, matrix| {
                transform_input((g.height, g.width, g.padding), tiles, band.clone(), plane, (&mut bufs.plane, &mut bufs.rows), v, matrix)
            });
            let d = take(&mut bufs.other, TILE * o_n * pitch);
            each_plane(&dy[n0 * out_image..][..nb * out_image], o_n, g.out_plane(), (per_image, pitch), d, |plane, d, matrix| {
                transform_gradient((g.out_h, g.out_w), tiles, band.clone(), plane, (&mut bufs.plane, &mut bufs.rows), d, matrix)
            });
            for xi in 0..TILE {
                let lhs = Mat { data: &d[xi * o_n * pitch..][..o_n * pitch], row_stride: pitch, col_stride: 1 };
                let rhs = Mat { data: &v[xi * c_n * pitch..][..c_n * pitch], row_stride: 1, col_stride: pitch };
                matmul(&mut sums[xi * o_n * c_n..][..o_n * c_n], sums_strides(g), (o_n, c_n, t_n), lhs, rhs, true, parallelism);
            }
        }
    };
    let kernels = o_n * c_n;
    // One sum per worker over its run of chunks, added at the end.
    let partial = |t: usize| {
        let (mut sums, mut bufs) = (vec![0f32; TILE * kernels], Buffers::default());
        plan.chunks_of(t).for_each(|chunk| accumulate_chunk(&mut bufs, chunk, &mut sums));
        sums
    };
    let partials = (0..plan.workers()).into_par_iter().map(partial).collect::<Vec<_>>();
    weight_gradient_from_sums(&partials, sums_strides(g), kernels)
}

/// What each pass allocates beyond its operands and result (as
/// [`super::conv::scratch`] counts im2col's): the transformed kernels,
/// each busy worker's buffers and gemm's packing, and in the weight
/// gradient every worker's sums.
pub(in crate::ops) fn scratch(g: &Geometry) -> ConvScratch {
    let (c_n, o_n) = (g.channels, g.out_channels);
    let kernels = (o_n * c_n * size_of::<f32>()) as u64;
    let transformed = TILE as u64 * kernels;
    let row = Strides::row_major;
    let input_pass = workers(&transposed(g), |t, p| ((c_n, t, o_n), [row(p), row(o_n), row(p)]), 0);
    ConvScratch {
        forward: transformed + workers(g, |t, p| ((o_n, t, c_n), [row(p), row(c_n), row(p)]), 0),
        input_gradient: transformed + input_pass,
        weight_gradient: workers(g, |t, p| ((o_n, c_n, t), [sums_strides(g), row(p), Strides::column_major(p)]), transformed),
    }
}

/// Bytes the busy workers of a pass over `g` hold at once: each its
/// buffers, gemm's packing for the product `gemm` gives for a chunk of `t`
/// tiles at pitch `p` (dimensions, then the strides of destination, left
/// and right), and `sums`.
fn workers(g: &Geometry, gemm: impl Fn(usize, usize) -> ((usize, usize, usize), [Strides; 3]), sums: u64) -> u64 {
    let (tiles, plan) = plan(g);
    let t_n = plan.images.min(g.batch) * tiles.band * tiles.cols;
    let (dims, [dst, lhs, rhs]) = gemm(t_n, pitch(t_n));
    let packing = gemm_packing::packing_bytes(dims, dst, lhs, rhs, plan.gemm_parallelism());
    plan.workers() as u64 * (Buffers::bytes(g, tiles, t_n) + packing + sums)
}

#[cfg(test)]
mod tests {
    use candle_core::Var;

    use super::*;
    use crate::ops::tests::{randn, relative_error, tensor, values};
    use crate::ops::ConvParams;

    /// `(batch, channels, height, width, out_channels, padding)`.
    const CASES: [(usize, usize, usize, usize, usize, usize); 5] = [
        (3, 16, 9, 11, 24, 1),  // odd output: the last tiles overhang
        (2, 24, 8, 7, 16, 0),   // unpadded
        (5, 16, 2, 2, 32, 2),   // padded by 2, images stacked
        (1, 32, 4, 5, 136, 1),  // more kernels than one thread's run, row-major sums
        (1, 16, 66, 65, 16, 1), // an image taken in two bands of tile rows
    ];

    /// Each pass against candle's convolution and its autograd, whatever
    /// [`applies`] would choose for these shapes.
    #[test]
    fn the_three_passes_match_candle() {
        for (n, c, h, w, o, padding) in CASES {
            let (x, k) = (randn(&[n, c, h, w]), randn(&[o, c, 3, 3]));
            let g = Geometry::new(&x, &k, ConvParams { stride: 1, padding, groups: 1 }).unwrap();
            let (xv, kv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&k).unwrap());
            let y = xv.as_tensor().conv2d(kv.as_tensor(), padding, 1, 1, 1).unwrap();
            let dy = randn(y.dims());
            let grads = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
            let checks = [
                ("forward", forward(&g, &values(&x), &values(&k)), y.clone()),
                ("input gradient", grad_input(&g, &values(&dy), &values(&k)), grads.get(&xv).unwrap().clone()),
                ("weight gradient", grad_weight(&g, &values(&x), &values(&dy)), grads.get(&kv).unwrap().clone()),
            ];
            for (pass, ours, reference) in checks {
                let err = relative_error(&tensor(ours, &reference), &reference);
                assert!(err < 1e-5, "{pass} of {:?}: relative error {err}", (n, c, h, w, o, padding));
            }
        }
    }

    #[test]
    fn channel_rows_lie_an_odd_number_of_cache_lines_apart() {
        for (tiles, expected) in [(1, 16), (16, 16), (17, 48), (64, 80), (784, 784), (1024, 1040)] {
            assert_eq!(pitch(tiles), expected, "{tiles} tiles");
        }
    }

    #[test]
    fn small_strided_or_thin_convolutions_keep_im2col() {
        let geometry =
            |x: [usize; 4], o, stride| Geometry::of_dims(x, [o, x[1], 3, 3], ConvParams { stride, padding: 1, groups: 1 }).unwrap();
        assert!(applies(&geometry([8, 64, 56, 56], 64, 1)));
        assert!(!applies(&geometry([8, 64, 56, 56], 64, 2)), "stride 2");
        assert!(!applies(&geometry([8, 8, 56, 56], 64, 1)), "8 input channels");
        assert!(!applies(&geometry([512, 64, 2, 2], 64, 1)), "2x2 outputs");
        assert!(!applies(&geometry([1, 64, 8, 8], 64, 1)), "16 tiles in all");
    }
}
