//! The up-convolution against candle's `conv_transpose2d` + `broadcast_add`.

use candle_core::{DType, Tensor, Var};

use super::conv_transpose::{composed, Geometry};
use super::tests::{randn, relative_error};
use super::*;

/// `(batch, channels, height, width, out channels, kernel)`.
type Case = (usize, usize, usize, usize, usize, usize);

const CASES: [Case; 12] = [
    (1, 1, 1, 1, 1, 2),    // one pixel, one channel either side
    (2, 3, 5, 7, 4, 2),    // odd, non-square
    (2, 128, 8, 8, 64, 2), // a U-Net's deepest up-convolution
    (2, 32, 16, 16, 16, 2),
    (3, 64, 1, 1, 64, 2), // one pixel: gemm's vector product
    (2, 5, 17, 13, 3, 3), // kernel 3
    (1, 1, 17, 17, 64, 2),
    (2, 64, 3, 2, 1, 2), // one output channel
    (4, 7, 4, 9, 9, 3),
    (1, 16, 17, 1, 8, 2), // one column
    (2, 2, 1, 17, 5, 3),  // one row
    (1, 48, 9, 11, 40, 2),
];

fn operands(&(n, c, h, w, o, k): &Case) -> (Tensor, Tensor, Tensor) {
    (randn(&[n, c, h, w]), (randn(&[c, o, k, k]) * 0.1).unwrap(), randn(&[o]))
}

fn reference(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, kernel: usize) -> Tensor {
    let g = Geometry::of_dims(x.dims(), weight.dims(), bias.map(Tensor::dims), kernel).unwrap();
    composed(x, weight, bias, &g).unwrap()
}

/// The output and the gradients of `sum(out * r)` with respect to x, the
/// weight and the bias (`None` where there is none).
fn output_and_gradients(
    (x, weight, bias): (&Tensor, &Tensor, Option<&Tensor>),
    r: &Tensor,
    op: impl Fn(&Tensor, &Tensor, Option<&Tensor>) -> Tensor,
) -> (Tensor, Vec<Option<Tensor>>) {
    let vars: Vec<_> = [Some(x), Some(weight), bias].into_iter().map(|t| t.map(|t| Var::from_tensor(t).unwrap())).collect();
    let [x, weight, bias] = [0, 1, 2].map(|i| vars[i].as_ref().map(Var::as_tensor));
    let out = op(x.unwrap(), weight.unwrap(), bias);
    let grads = (&out * r).unwrap().sum_all().unwrap().backward().unwrap();
    (out, [x, weight, bias].into_iter().map(|t| t.map(|t| grads.get(t).unwrap().clone())).collect())
}

fn output_dims(&(n, _, h, w, o, k): &Case) -> [usize; 4] {
    [n, o, k * h, k * w]
}

#[test]
fn conv_transpose2d_matches_candle_ops_forward_and_backward() {
    for case in &CASES {
        let (x, weight, bias) = operands(case);
        let k = case.5;
        for bias in [Some(&bias), None] {
            let r = randn(&output_dims(case));
            let (expected_out, expected_grads) = output_and_gradients((&x, &weight, bias), &r, |x, w, b| reference(x, w, b, k));
            let (out, grads) = output_and_gradients((&x, &weight, bias), &r, |x, w, b| conv_transpose2d(x, w, b, k).unwrap());
            let with = if bias.is_some() { "with bias" } else { "without bias" };
            assert_eq!(out.dims(), expected_out.dims(), "{case:?} {with}");
            let err = relative_error(&out, &expected_out);
            assert!(err < 1e-5, "{case:?} {with}: output off by {err}");
            for (name, (ours, expected)) in ["x", "weight", "bias"].iter().zip(grads.iter().zip(&expected_grads)) {
                let (Some(ours), Some(expected)) = (ours, expected) else { continue };
                assert_eq!(ours.dims(), expected.dims(), "{case:?} {with}: gradient of {name}");
                let err = relative_error(ours, expected);
                assert!(err < 1e-4, "{case:?} {with}: gradient of {name} off by {err}");
            }
        }
    }
}

#[test]
fn conv_transpose2d_reads_strided_operands() {
    let case = (2, 6, 5, 4, 3, 2);
    let (x, weight, bias) = operands(&case);
    // The same values, laid out transposed and read through strides.
    let x_t = x.transpose(2, 3).unwrap().contiguous().unwrap().transpose(2, 3).unwrap();
    let w_t = weight.transpose(0, 1).unwrap().contiguous().unwrap().transpose(0, 1).unwrap();
    assert!(!x_t.is_contiguous() && !w_t.is_contiguous());
    let ours = conv_transpose2d(&x_t, &w_t, Some(&bias), 2).unwrap();
    assert!(relative_error(&ours, &reference(&x, &weight, Some(&bias), 2)) < 1e-5);
}

#[test]
fn conv_transpose2d_computes_gradients_only_for_tracked_operands() {
    let case = (3, 12, 6, 5, 8, 2);
    let (x, weight, bias) = operands(&case);
    let (weight, bias) = (Var::from_tensor(&weight).unwrap(), Var::from_tensor(&bias).unwrap());
    let y = conv_transpose2d(&x, weight.as_tensor(), Some(bias.as_tensor()), 2).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&x).is_none(), "x is a plain tensor: no gradient");
    let expected = reference(&x, weight.as_tensor(), Some(bias.as_tensor()), 2).sum_all().unwrap().backward().unwrap();
    for t in [weight.as_tensor(), bias.as_tensor()] {
        assert!(relative_error(grads.get(t).unwrap(), expected.get(t).unwrap()) < 1e-4);
    }
    // Only the input tracked: neither parameter gets one.
    let x = Var::from_tensor(&x).unwrap();
    let grads = conv_transpose2d(x.as_tensor(), &weight.as_tensor().detach(), Some(&bias.as_tensor().detach()), 2)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(grads.get(x.as_tensor()).is_some());
    assert!(grads.get(weight.as_tensor()).is_none() && grads.get(bias.as_tensor()).is_none());
    // Only the bias tracked.
    let grads = conv_transpose2d(&x.as_tensor().detach(), &weight.as_tensor().detach(), Some(bias.as_tensor()), 2)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(grads.get(bias.as_tensor()).is_some());
    assert!(grads.get(x.as_tensor()).is_none() && grads.get(weight.as_tensor()).is_none());
}

#[test]
fn conv_transpose2d_in_half_precision_stays_in_its_dtype_close_to_f32() {
    let cases: [Case; 2] = [(2, 40, 7, 9, 24, 2), (3, 16, 5, 4, 12, 3)];
    for case in cases {
        let k = case.5;
        for (dtype, tolerance) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
            let (x, weight, bias) = operands(&case);
            let [x, weight, bias] = [x, weight, bias].map(|t| t.to_dtype(dtype).unwrap());
            let r = randn(&output_dims(&case)).to_dtype(dtype).unwrap();
            let to32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let (out, grads) = output_and_gradients((&x, &weight, Some(&bias)), &r, |x, w, b| conv_transpose2d(x, w, b, k).unwrap());
            // candle's ops in f32 on the same rounded values.
            let f32s = (&to32(&x), &to32(&weight), Some(&to32(&bias)));
            let (out32, grads32) = output_and_gradients(f32s, &to32(&r), |x, w, b| reference(x, w, b, k));
            assert_eq!(out.dtype(), dtype);
            let err = relative_error(&out, &out32);
            assert!(err < tolerance, "{case:?} {dtype:?}: output off by {err}");
            for (name, (ours, f32s)) in ["x", "weight", "bias"].iter().zip(grads.iter().zip(&grads32)) {
                let (ours, f32s) = (ours.as_ref().unwrap(), f32s.as_ref().unwrap());
                assert_eq!(ours.dtype(), dtype, "gradient of {name}");
                let err = relative_error(ours, f32s);
                assert!(err < tolerance, "{case:?} {dtype:?}: gradient of {name} off by {err}");
            }
        }
    }
}

#[test]
fn conv_transpose2d_in_other_dtypes_goes_through_candle_ops() {
    let (x, weight, bias) = operands(&(2, 3, 4, 5, 6, 2));
    let [x, weight, bias] = [x, weight, bias].map(|t| t.to_dtype(DType::F64).unwrap());
    let ours = conv_transpose2d(&x, &weight, Some(&bias), 2).unwrap();
    assert_eq!((ours.dtype(), ours.dims()), (DType::F64, [2, 6, 8, 10].as_slice()));
    assert!(relative_error(&ours, &reference(&x, &weight, Some(&bias), 2)) < 1e-12);
    let refused = conv_transpose2d_scratch([2, 3, 4, 5], 6, 2, DType::F64);
    assert!(matches!(refused, Err(OpError::UnsupportedDType { op: "conv_transpose2d", dtype: DType::F64 })));
}

#[test]
fn conv_transpose2d_scratch_counts_buffers_copies_and_packing() {
    let floats = |count: usize| (count * 4) as u64;
    // One sample's shuffled buffer in each gemm pass, nothing for the bias gradient in f32.
    let s = conv_transpose2d_scratch([8, 128, 8, 8], 64, 2, DType::F32).unwrap();
    let sample = floats(64 * 4 * 64);
    assert!(s.forward >= sample && s.input_gradient >= sample && s.weight_gradient >= sample, "{s:?}");
    assert_eq!(s.bias_gradient, 0);
    // In f32 the batch changes it only through the threads it keeps busy: each holds its own
    // buffer and packing, and in the weight gradient its own sum, all but one added in after.
    let on = |threads: usize, batch: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| conv_transpose2d_scratch([batch, 128, 8, 8], 64, 2, DType::F32).unwrap())
    };
    let (one, two) = (on(1, 8), on(2, 8));
    assert_eq!(on(1, 1), one);
    assert_eq!((two.forward, two.input_gradient), (2 * one.forward, 2 * one.input_gradient));
    assert_eq!(two.weight_gradient, 2 * one.weight_gradient + floats(128 * 64 * 4));
    assert!(on(2, 1).forward < two.forward, "a lone sample keeps one thread's buffer");
    // One pixel, one channel: products too small to pack anything.
    assert_eq!(conv_transpose2d_scratch([1, 1, 1, 1], 1, 2, DType::F32).unwrap().forward, floats(4));
    // Half precision adds at least the f32 copy of each pass's result.
    let h = conv_transpose2d_scratch([8, 128, 8, 8], 64, 2, DType::F16).unwrap();
    assert!(h.forward >= floats(8 * 64 * 16 * 16) && h.bias_gradient >= floats(64), "{h:?}");
    assert!(h.input_gradient >= s.input_gradient && h.weight_gradient >= s.weight_gradient, "{h:?} / {s:?}");
    assert_eq!(h.most(), h.forward.max(h.input_gradient).max(h.weight_gradient).max(h.bias_gradient));
    assert!(matches!(conv_transpose2d_scratch([1, 2, 3, 4], 5, 0, DType::F32), Err(OpError::Zero { .. })));
}

#[test]
fn conv_transpose2d_takes_empty_shapes() {
    // No sample, no row, no input channel (the bias alone) and no output channel.
    for case in [(0, 3, 4, 4, 2, 2), (2, 3, 0, 4, 2, 2), (2, 0, 3, 4, 2, 3), (2, 3, 3, 4, 0, 2)] {
        let (x, weight, bias) = operands(&case);
        let r = randn(&output_dims(&case));
        let (out, grads) = output_and_gradients((&x, &weight, Some(&bias)), &r, |x, w, b| conv_transpose2d(x, w, b, case.5).unwrap());
        assert_eq!(out.dims(), output_dims(&case), "{case:?}");
        assert!(relative_error(&out, &reference(&x, &weight, Some(&bias), case.5)) < 1e-6, "{case:?}");
        for (grad, operand) in grads.iter().zip([&x, &weight, &bias]) {
            assert_eq!(grad.as_ref().unwrap().dims(), operand.dims(), "{case:?}");
        }
    }
}

fn error_text<T>(r: std::result::Result<T, impl std::fmt::Display>) -> String {
    r.err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn conv_transpose2d_refuses_bad_operands_by_name() {
    let (x, weight, bias) = operands(&(2, 3, 4, 5, 6, 2));
    let text = error_text(conv_transpose2d(&randn(&[3, 4, 5]), &weight, None, 2));
    assert!(text.contains("conv_transpose2d: input must have 4 dimensions (N x C x H x W), got [3, 4, 5]"), "{text}");
    let text = error_text(conv_transpose2d(&x, &randn(&[4, 6, 2, 2]), None, 2));
    assert!(text.contains("conv_transpose2d: weight [4, 6, 2, 2] is not 3 x out x 2 x 2") && text.contains("input [2, 3, 4, 5]"), "{text}");
    let text = error_text(conv_transpose2d(&x, &randn(&[3, 6, 3, 3]), None, 2));
    assert!(text.contains("conv_transpose2d: weight [3, 6, 3, 3] is not 3 x out x 2 x 2"), "{text}");
    let text = error_text(conv_transpose2d(&x, &randn(&[3, 6, 2, 1]), None, 2));
    assert!(text.contains("conv_transpose2d: weight [3, 6, 2, 1] is not 3 x out x 2 x 2"), "{text}");
    let text = error_text(conv_transpose2d(&x, &randn(&[3, 24]), None, 2));
    assert!(text.contains("conv_transpose2d: weight [3, 24] is not 3 x out x 2 x 2"), "{text}");
    let text = error_text(conv_transpose2d(&x, &weight, None, 0));
    assert!(text.contains("conv_transpose2d: kernel must be at least 1"), "{text}");
    let text = error_text(conv_transpose2d(&x, &weight, Some(&randn(&[5])), 2));
    assert!(text.contains("conv_transpose2d: bias must hold one value per channel (6), got shape [5]"), "{text}");
    let text = error_text(conv_transpose2d(&x, &weight, Some(&randn(&[1, 6])), 2));
    assert!(text.contains("conv_transpose2d: bias must hold one value per channel (6), got shape [1, 6]"), "{text}");
    let text = error_text(conv_transpose2d(&x, &weight.to_dtype(DType::F16).unwrap(), Some(&bias), 2));
    assert!(text.contains("conv_transpose2d: input is F32 but the other operand is F16"), "{text}");
    let half = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let text = error_text(conv_transpose2d(&half(&x), &half(&weight), Some(&bias), 2));
    assert!(text.contains("conv_transpose2d: input is BF16 but the other operand is F32"), "{text}");
    let text = error_text(conv_transpose2d(&x.to_dtype(DType::F64).unwrap(), &weight, None, 2));
    assert!(text.contains("conv_transpose2d: input is F64 but the other operand is F32"), "{text}");
}

/// The device passes (the transposed convolution through cuDNN's calls of
/// the convolution it transposes), run on the reference primitives, give
/// what the CPU op gives, in f32 and f16, with and without a bias; they
/// allocate only the output (or each gradient), and keep nothing.
#[test]
fn conv_transpose2d_on_the_reference_primitives_matches_the_cpu() {
    use super::cuda::{allocations, on_reference};
    for case in [CASES[1], CASES[5], CASES[8], CASES[11]] {
        let k = case.5;
        for dtype in [DType::F32, DType::F16] {
            let (x, weight, bias) = operands(&case);
            let [x, weight, bias] = [x, weight, bias].map(|t| t.to_dtype(dtype).unwrap());
            let r = randn(&output_dims(&case)).to_dtype(dtype).unwrap();
            let tolerance = if dtype == DType::F32 { 1e-5 } else { 5e-3 };
            for bias in [Some(&bias), None] {
                let op = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| conv_transpose2d(x, w, b, k).unwrap();
                let (expected, expected_grads) = output_and_gradients((&x, &weight, bias), &r, op);
                let ((out, grads), used) = on_reference(|| allocations(|| output_and_gradients((&x, &weight, bias), &r, op)));
                let what = format!("{case:?} {dtype:?} bias {}", bias.is_some());
                assert_eq!(out.dtype(), dtype, "{what}");
                let err = relative_error(&out, &expected);
                assert!(err < tolerance, "{what}: forward error {err}");
                for (i, (g, e)) in grads.iter().zip(&expected_grads).enumerate() {
                    let (Some(g), Some(e)) = (g, e) else { continue };
                    assert_eq!(g.dims(), e.dims(), "{what}: gradient {i}");
                    let err = relative_error(g, e);
                    assert!(err < tolerance, "{what}: gradient {i} error {err}");
                }
                assert_eq!(used.left, 0, "{what}: nothing kept beyond candle's storages");
                let bytes = |t: &Tensor| (t.elem_count() * dtype.size_in_bytes()) as u64;
                assert!(used.peak >= bytes(&out) && used.peak <= bytes(&x).max(bytes(&out)).max(bytes(&weight)), "{what}: {used:?}");
            }
        }
    }
}
