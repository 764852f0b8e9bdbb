//! The weight gradient of a dense stride-1 convolution on a small padded
//! map, tap by tap: one gemm per kernel tap and run of outputs that tap
//! reads inside the input, so the products with the zero border are never
//! made. On a 2x2 map a 3x3 kernel with padding 1 has 16 real products of
//! 36, which im2col + gemm computes all of.
//!
//! Input and output gradient are laid out position by position, the images
//! of a position together and channels innermost (`[position][image][channel]`):
//! the outputs a tap reads inside the input along a row, for every image,
//! are then one run of rows, and so are the inputs it reads. The threads
//! share the output channels, in blocks whose sums stay in the L2 cache, so
//! no thread keeps a partial sum of the whole weight (the im2col path's
//! per-thread sums of 512 x 4,608 made it slower on 2 threads than on 1).
//! It takes these maps' weight gradient from Winograd as well (256 channels
//! of 4x4 maps, batch 32, 1 thread: 4.5 ms against 6.1). The forward and
//! the input gradient stay with im2col or Winograd: tap by tap they need the
//! kernels rearranged or read strided, which cost more than the padding's
//! products on these maps.

use gemm::Parallelism;

use super::super::conv_geometry::valid_outputs;
use super::super::conv_geometry::Geometry;
use super::floats::par_chunks_from;
use super::gemm::{matmul, transpose, Mat};
use super::gemm_packing::{self, Strides};

/// At most this share of the im2col products real (the rest read padding):
/// 2x2 maps (0.44) and 4x4 maps (0.69) under a 3x3 kernel go tap by tap;
/// 7x7 (0.82) and 8x8 maps (0.84) gain nothing from it and keep im2col or
/// Winograd.
const MAX_REAL_SHARE: f64 = 0.75;

/// Fewer channels than this on either side make gemms too thin to pay.
const MIN_CHANNELS: usize = 16;

pub(in crate::ops) fn applies(g: &Geometry) -> bool {
    g.groups == 1
        && g.stride == 1
        && g.padding > 0
        && !g.is_pointwise()
        && g.channels >= MIN_CHANNELS
        && g.out_channels >= MIN_CHANNELS
        && real_share(g) <= MAX_REAL_SHARE
}

/// The share of the im2col products that multiply an input, not padding.
fn real_share(g: &Geometry) -> f64 {
    let read = |kernel: usize, size: usize, outputs: usize| -> usize {
        (0..kernel).map(|k| valid_outputs(k, size, outputs, g.padding, 1)).map(|(lo, hi)| hi - lo).sum()
    };
    let rows = read(g.kernel_h, g.height, g.out_h) as f64 / (g.kernel_h * g.out_h) as f64;
    let cols = read(g.kernel_w, g.width, g.out_w) as f64 / (g.kernel_w * g.out_w) as f64;
    rows * cols
}

/// Outputs `output..output + len` (positions in the output plane) that tap
/// `tap` computes from inputs `input..input + len` of the input plane.
#[derive(Debug, Clone, Copy)]
struct Run {
    tap: usize,
    output: usize,
    input: usize,
    len: usize,
}

/// Every tap's runs, tap by tap: one per output row it reads inside the
/// input, or one for all of them where it reads whole rows of an input as
/// wide as the output (the centre column of taps at "same" padding).
fn runs(g: &Geometry) -> Vec<Run> {
    let mut runs = Vec::new();
    for kh in 0..g.kernel_h {
        let (h0, h1) = valid_outputs(kh, g.height, g.out_h, g.padding, 1);
        for kw in 0..g.kernel_w {
            let (w0, w1) = valid_outputs(kw, g.width, g.out_w, g.padding, 1);
            if h0 == h1 || w0 == w1 {
                continue;
            }
            let tap = kh * g.kernel_w + kw;
            let at = |oh: usize| Run {
                tap,
                output: oh * g.out_w + w0,
                input: (oh + kh - g.padding) * g.width + w0 + kw - g.padding,
                len: w1 - w0,
            };
            if w1 - w0 == g.out_w && g.out_w == g.width {
                runs.push(Run { len: (h1 - h0) * g.out_w, ..at(h0) });
            } else {
                runs.extend((h0..h1).map(at));
            }
        }
    }
    runs
}

/// `images` planes of `channels x positions` (`src`) in
/// `[position][image][channel]` layout.
fn by_positions(src: &[f32], images: usize, channels: usize, positions: usize) -> Vec<f32> {
    let mut dst = vec![0f32; src.len()];
    for (b, image) in src.chunks_exact(channels * positions).enumerate() {
        transpose(image, positions, &mut dst[b * channels..], images * channels, channels, positions);
    }
    dst
}

/// Output channels a thread sums at a time: as many as keep their `in x
/// taps` gradients within this many bytes, which stay in the L2 cache while
/// every run adds to them (512 channels of 2x2 maps: 2.3 ms on 2 threads at
/// 1 MiB, 3.0 ms at 64 KiB, 3.2 ms at 4 MiB).
const BLOCK_BYTES: usize = 1 << 20;

fn block_rows(g: &Geometry) -> usize {
    let row_bytes = g.kernel_h * g.kernel_w * g.channels * size_of::<f32>();
    let fair = g.out_channels.div_ceil(rayon::current_num_threads().max(1));
    (BLOCK_BYTES / row_bytes).clamp(1, fair.max(1))
}

/// The weight gradient for the output gradient `dy`.
pub(in crate::ops) fn grad_weight(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let (c_n, o_n, taps, b_n) = (g.channels, g.out_channels, g.kernel_h * g.kernel_w, g.batch);
    let xs = by_positions(x, b_n, c_n, g.in_plane());
    let dys = by_positions(dy, b_n, o_n, g.out_plane());
    let runs = runs(g);
    let (row, rows) = (taps * c_n, block_rows(g));
    par_chunks_from(
        o_n * row,
        rows * row,
        0.0,
        || (),
        |_, block, dw| {
            let (first, rows) = (block * rows, dw.len() / row);
            for run in &runs {
                let lhs = Mat { data: &dys[run.output * b_n * o_n + first..], row_stride: 1, col_stride: o_n };
                let rhs = Mat { data: &xs[run.input * b_n * c_n..], row_stride: c_n, col_stride: 1 };
                let dims = (rows, c_n, run.len * b_n);
                matmul(&mut dw[run.tap..], Strides { row, col: taps }, dims, lhs, rhs, true, Parallelism::None);
            }
        },
    )
}

/// What [`grad_weight`] allocates beyond its operands and result: the
/// input and output gradient in positions layout, and for each busy thread
/// what gemm packs for one product (the output gradient's run for the
/// block's channels; the input's run is read in place).
pub(in crate::ops) fn weight_gradient_scratch(g: &Geometry) -> u64 {
    let taps = g.kernel_h * g.kernel_w;
    let rows = block_rows(g);
    let busy = g.out_channels.div_ceil(rows).min(rayon::current_num_threads().max(1)) as u64;
    let packing = runs(g)
        .iter()
        .map(|r| {
            let (dst, lhs, rhs) =
                (Strides { row: taps * g.channels, col: taps }, Strides::column_major(g.out_channels), Strides::row_major(g.channels));
            gemm_packing::packing_bytes((rows, g.channels, r.len * g.batch), dst, lhs, rhs, Parallelism::None)
        })
        .max()
        .unwrap_or(0);
    let positions = g.batch * (g.channels * g.in_plane() + g.out_channels * g.out_plane());
    (positions * size_of::<f32>()) as u64 + busy * packing
}

#[cfg(test)]
mod tests {
    use candle_core::Var;

    use super::*;
    use crate::ops::tests::{randn, relative_error, tensor, values};
    use crate::ops::ConvParams;

    /// `(batch, channels, height, width, out_channels, kernel, padding)`.
    const CASES: [(usize, usize, usize, usize, usize, usize, usize); 6] = [
        (5, 16, 2, 2, 24, 3, 1), // ResNet's last stage: odd batch, chunks of unequal size
        (3, 24, 4, 4, 16, 3, 1), // whole rows in one run for the centre column
        (2, 16, 2, 5, 16, 3, 1), // not square: rows of one run each
        (4, 16, 1, 1, 32, 3, 1), // only the centre tap reads the input
        (2, 16, 3, 3, 16, 5, 2), // 5x5 kernel
        (3, 32, 1, 1, 16, 5, 3), // output wider than the input, taps that read only padding
    ];

    #[test]
    fn the_weight_gradient_matches_candle() {
        for (n, c, h, w, o, k, padding) in CASES {
            let (x, kernel) = (randn(&[n, c, h, w]), randn(&[o, c, k, k]));
            let g = Geometry::new(&x, &kernel, ConvParams { stride: 1, padding, groups: 1 }).unwrap();
            let (xv, kv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&kernel).unwrap());
            let y = xv.as_tensor().conv2d(kv.as_tensor(), padding, 1, 1, 1).unwrap();
            let dy = randn(y.dims());
            let grads = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
            let reference = grads.get(&kv).unwrap();
            let ours = tensor(grad_weight(&g, &values(&x), &values(&dy)), reference);
            let err = relative_error(&ours, reference);
            assert!(err < 1e-5, "weight gradient of {:?}: relative error {err}", (n, c, h, w, o, k, padding));
        }
    }

    #[test]
    fn only_small_padded_maps_go_tap_by_tap() {
        let geometry =
            |x: [usize; 4], o, stride, padding| Geometry::of_dims(x, [o, x[1], 3, 3], ConvParams { stride, padding, groups: 1 }).unwrap();
        assert!(applies(&geometry([32, 512, 2, 2], 512, 1, 1)));
        assert!(applies(&geometry([32, 256, 4, 4], 256, 1, 1)));
        assert!(!applies(&geometry([8, 512, 7, 7], 512, 1, 1)), "7x7: 82% of the products are real");
        assert!(!applies(&geometry([32, 256, 4, 4], 512, 2, 1)), "stride 2");
        assert!(!applies(&geometry([32, 256, 4, 4], 256, 1, 0)), "unpadded");
        assert!(!applies(&geometry([32, 8, 2, 2], 512, 1, 1)), "8 input channels");
    }
}
