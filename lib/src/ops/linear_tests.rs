//! The linear layer against candle's `matmul` + `broadcast_add`.

use candle_core::{DType, Tensor, Var};

use super::linear::{composed, Geometry};
use super::tests::{randn, relative_error};
use super::*;

/// `(leading dims of x, in features, out features)`.
type Case = (&'static [usize], usize, usize);

const CASES: [Case; 12] = [
    (&[1], 1, 1),       // one row, one feature either side
    (&[7], 5, 192),     // few rows and inputs
    (&[591], 192, 768), // ViT-Tiny's MLP up, 3 images of 197 tokens
    (&[591], 768, 192), // and down
    (&[3, 197], 192, 768),
    (&[3, 197], 768, 192),
    (&[1], 1000, 5),    // one row: gemm's vector product
    (&[7], 768, 1000),  // a classifier head
    (&[1, 7], 1, 1000), // one input feature
    (&[3, 197], 5, 1),  // one output feature
    (&[7], 1000, 768),
    (&[591], 1, 5),
];

fn operands(&(leading, inputs, outputs): &Case) -> (Tensor, Tensor, Tensor) {
    let x = randn(&[leading, &[inputs]].concat());
    (x, (randn(&[outputs, inputs]) * 0.1).unwrap(), randn(&[outputs]))
}

fn reference(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
    let g = Geometry::of_dims(x.dims(), weight.dims(), bias.map(Tensor::dims)).unwrap();
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

/// `op` against `expected` on every case, with and without a bias, the
/// input scaled by `scale`: the output and every gradient within `tolerance`.
fn matches_forward_and_backward(
    op: impl Fn(&Tensor, &Tensor, Option<&Tensor>) -> Tensor,
    expected: impl Fn(&Tensor, &Tensor, Option<&Tensor>) -> Tensor,
    scale: f64,
    tolerance: f32,
) {
    for case in &CASES {
        let (x, weight, bias) = operands(case);
        let x = (x * scale).unwrap();
        for bias in [Some(&bias), None] {
            let r = randn(&[case.0, &[case.2]].concat());
            let (expected_out, expected_grads) = output_and_gradients((&x, &weight, bias), &r, &expected);
            let (out, grads) = output_and_gradients((&x, &weight, bias), &r, &op);
            let with = if bias.is_some() { "with bias" } else { "without bias" };
            assert_eq!(out.dims(), expected_out.dims(), "{case:?} {with}");
            let err = relative_error(&out, &expected_out);
            assert!(err < tolerance, "{case:?} {with}: output off by {err}");
            for (name, (ours, expected)) in ["x", "weight", "bias"].iter().zip(grads.iter().zip(&expected_grads)) {
                let (Some(ours), Some(expected)) = (ours, expected) else { continue };
                assert_eq!(ours.dims(), expected.dims(), "{case:?} {with}: gradient of {name}");
                let err = relative_error(ours, expected);
                assert!(err < tolerance, "{case:?} {with}: gradient of {name} off by {err}");
            }
        }
    }
}

#[test]
fn linear_matches_candle_ops_forward_and_backward() {
    matches_forward_and_backward(|x, w, b| linear(x, w, b).unwrap(), reference, 1.0, 1e-5);
}

#[test]
fn linear_computes_no_gradient_for_an_untracked_input() {
    let (x, weight, bias) = operands(&(&[3, 11], 24, 40));
    let (weight, bias) = (Var::from_tensor(&weight).unwrap(), Var::from_tensor(&bias).unwrap());
    let y = linear(&x, weight.as_tensor(), Some(bias.as_tensor())).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&x).is_none(), "x is a plain tensor: no gradient");
    let expected = reference(&x, weight.as_tensor(), Some(bias.as_tensor())).sum_all().unwrap().backward().unwrap();
    for t in [weight.as_tensor(), bias.as_tensor()] {
        assert!(relative_error(grads.get(t).unwrap(), expected.get(t).unwrap()) < 1e-5);
    }
    // Only the input tracked: neither parameter gets one.
    let x = Var::from_tensor(&x).unwrap();
    let grads = linear(x.as_tensor(), &weight.as_tensor().detach(), Some(&bias.as_tensor().detach()))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(grads.get(x.as_tensor()).is_some());
    assert!(grads.get(weight.as_tensor()).is_none() && grads.get(bias.as_tensor()).is_none());
}

#[test]
fn linear_in_half_precision_stays_in_its_dtype_close_to_f32() {
    // Rows of y written directly, and y^T written and transposed.
    let cases: [Case; 2] = [(&[2, 19], 96, 40), (&[3], 64, 48)];
    for case @ (leading, _, outputs) in cases {
        for (dtype, tolerance) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
            let (x, weight, bias) = operands(&case);
            let [x, weight, bias] = [x, weight, bias].map(|t| t.to_dtype(dtype).unwrap());
            let r = randn(&[leading, &[outputs]].concat()).to_dtype(dtype).unwrap();
            let to32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let (out, grads) = output_and_gradients((&x, &weight, Some(&bias)), &r, |x, w, b| linear(x, w, b).unwrap());
            let f32s = (&to32(&x), &to32(&weight), Some(&to32(&bias)));
            let (out32, grads32) = output_and_gradients(f32s, &to32(&r), |x, w, b| linear(x, w, b).unwrap());
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
fn linear_in_other_dtypes_goes_through_candle_ops() {
    let (x, weight, bias) = operands(&(&[2, 9], 12, 7));
    let [x, weight, bias] = [x, weight, bias].map(|t| t.to_dtype(DType::F64).unwrap());
    let ours = linear(&x, &weight, Some(&bias)).unwrap();
    assert_eq!((ours.dtype(), ours.dims()), (DType::F64, [2, 9, 7].as_slice()));
    assert!(relative_error(&ours, &reference(&x, &weight, Some(&bias))) < 1e-12);
    assert!(matches!(linear_scratch(4, 3, 2, DType::F64), Err(OpError::UnsupportedDType { op: "linear", dtype: DType::F64 })));
}

#[test]
fn linear_scratch_counts_buffers_copies_and_packing() {
    // Small products take gemm's paths that pack nothing; no pass of f32 copies anything.
    assert_eq!(linear_scratch(1, 3, 7, DType::F32).unwrap(), LinearScratch::default());
    // A few rows write y^T first: a buffer of the output's size at least.
    assert!(linear_scratch(32, 512, 1000, DType::F32).unwrap().forward >= 32 * 1000 * 4);
    // The bias gradient sums the output gradient's columns in place.
    let s = linear_scratch(32 * 197, 192, 768, DType::F32).unwrap();
    assert_eq!(s.bias_gradient, 0);
    // Half precision adds at least the f32 copy of each pass's result.
    let h = linear_scratch(32 * 197, 192, 768, DType::BF16).unwrap();
    assert!(h.forward >= (32 * 197 * 768 * 4) as u64 && h.bias_gradient >= 768 * 4, "{h:?}");
    assert!(h.input_gradient >= s.input_gradient && h.weight_gradient >= s.weight_gradient, "{h:?} / {s:?}");
}

fn error_text<T>(r: std::result::Result<T, impl std::fmt::Display>) -> String {
    r.err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn linear_refuses_bad_operands_by_name() {
    let (x, weight, bias) = operands(&(&[4], 6, 3));
    let text = error_text(linear(&randn(&[6]), &weight, None));
    assert!(text.contains("linear: input [6] must have 2 dimensions or more"), "{text}");
    let text = error_text(linear(&x, &randn(&[3, 5]), None));
    assert!(text.contains("linear: weight [3, 5] is not out x 6") && text.contains("input [4, 6]"), "{text}");
    let text = error_text(linear(&x, &randn(&[18]), None));
    assert!(text.contains("linear: weight [18] is not out x 6"), "{text}");
    let text = error_text(linear(&x, &weight, Some(&randn(&[4]))));
    assert!(text.contains("linear: bias [4] does not hold one value per output of weight [3, 6]"), "{text}");
    let text = error_text(linear(&x, &weight, Some(&randn(&[1, 3]))));
    assert!(text.contains("linear: bias [1, 3] does not hold one value"), "{text}");
    let text = error_text(linear(&x, &weight.to_dtype(DType::F16).unwrap(), Some(&bias)));
    assert!(text.contains("linear: input is F32 but the other operand is F16"), "{text}");
    let text = error_text(linear(&x.to_dtype(DType::BF16).unwrap(), &weight.to_dtype(DType::BF16).unwrap(), Some(&bias)));
    assert!(text.contains("linear: input is BF16 but the other operand is F32"), "{text}");
}

/// `linear(gelu(x))` as candle's `gelu_erf` and the composed linear layer compute it.
fn composed_gelu_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
    reference(&x.gelu_erf().unwrap(), weight, bias)
}

#[test]
fn gelu_linear_matches_candles_gelu_then_linear_forward_and_backward() {
    // Our erf is within 1.5e-7 of candle's: on a single value that is a relative error of 1e-5 or so.
    matches_forward_and_backward(|x, w, b| gelu_linear(x, w, b).unwrap(), composed_gelu_linear, 2.0, 1e-4);
}

#[test]
fn gelu_linear_in_half_precision_stays_in_its_dtype_close_to_f32() {
    let case: Case = (&[2, 19], 96, 40);
    for (dtype, tolerance) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
        let (x, weight, bias) = operands(&case);
        let to32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let [x, weight, bias] = [x, weight, bias].map(|t| t.to_dtype(dtype).unwrap());
        let r = randn(&[2, 19, 40]).to_dtype(dtype).unwrap();
        let (out, grads) = output_and_gradients((&x, &weight, Some(&bias)), &r, |x, w, b| gelu_linear(x, w, b).unwrap());
        let f32s = (&to32(&x), &to32(&weight), Some(&to32(&bias)));
        let (out32, grads32) = output_and_gradients(f32s, &to32(&r), |x, w, b| gelu_linear(x, w, b).unwrap());
        assert_eq!(out.dtype(), dtype);
        assert!(relative_error(&out, &out32) < tolerance, "{dtype:?}: output");
        for (ours, f32s) in grads.iter().zip(&grads32) {
            let (ours, f32s) = (ours.as_ref().unwrap(), f32s.as_ref().unwrap());
            assert_eq!(ours.dtype(), dtype);
            assert!(relative_error(ours, f32s) < tolerance, "{dtype:?}: gradient");
        }
    }
}

/// The device passes (GELU's kernel, cuBLAS's products, the bias calls), on
/// the reference primitives, give what the CPU op gives and allocate, beside
/// each result, one buffer of the input's size: the GELU forward and in the
/// weight gradient, the product's gradient before GELU's backward in the
/// input gradient.
#[test]
fn gelu_linear_on_the_reference_primitives_matches_the_cpu() {
    use super::cuda::{allocations, on_reference};
    for case in [CASES[1], CASES[3], CASES[5]] {
        for dtype in [DType::F32, DType::F16] {
            let (x, weight, bias) = operands(&case);
            let [x, weight, bias] = [x, weight, bias].map(|t| t.to_dtype(dtype).unwrap());
            let r = randn(&[case.0, &[case.2]].concat()).to_dtype(dtype).unwrap();
            let tolerance = if dtype == DType::F32 { 1e-5 } else { 5e-3 };
            for bias in [Some(&bias), None] {
                let op = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| gelu_linear(x, w, b).unwrap();
                let (expected, expected_grads) = output_and_gradients((&x, &weight, bias), &r, op);
                let ((out, grads), used) = on_reference(|| allocations(|| output_and_gradients((&x, &weight, bias), &r, op)));
                let what = format!("{case:?} {dtype:?} bias {}", bias.is_some());
                assert!(relative_error(&out, &expected) < tolerance, "{what}: forward");
                for (g, e) in grads.iter().zip(&expected_grads) {
                    let (Some(g), Some(e)) = (g, e) else { continue };
                    assert!(relative_error(g, e) < tolerance, "{what}: gradient");
                }
                assert_eq!(used.left, 0, "{what}: nothing kept beyond candle's storages");
                let bytes = |t: &Tensor| (t.elem_count() * dtype.size_in_bytes()) as u64;
                let most = (2 * bytes(&x)).max(bytes(&x) + bytes(&out)).max(bytes(&x) + bytes(&weight));
                assert_eq!(used.peak, most, "{what}: {used:?}");
            }
        }
    }
}

/// `linear(x) + residual` as candle's ops compute it.
fn composed_residual(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, residual: &Tensor, gelu: bool) -> Tensor {
    let y = if gelu { composed_gelu_linear(x, weight, bias) } else { reference(x, weight, bias) };
    (y + residual).unwrap()
}

/// The output and the gradients of `sum(out * r)` with respect to each operand (`None` where it takes none).
fn output_and_gradients_of(
    operands: &[Option<&Tensor>],
    r: &Tensor,
    op: impl Fn(&[Option<&Tensor>]) -> Tensor,
) -> (Tensor, Vec<Option<Tensor>>) {
    let vars: Vec<_> = operands.iter().map(|t| t.map(|t| Var::from_tensor(t).unwrap())).collect();
    let tensors: Vec<Option<&Tensor>> = vars.iter().map(|v| v.as_ref().map(Var::as_tensor)).collect();
    let out = op(&tensors);
    let grads = (&out * r).unwrap().sum_all().unwrap().backward().unwrap();
    (out, tensors.iter().map(|t| t.map(|t| grads.get(t).unwrap().clone())).collect())
}

fn assert_close(
    what: &str,
    (out, grads): &(Tensor, Vec<Option<Tensor>>),
    (expected, expected_grads): &(Tensor, Vec<Option<Tensor>>),
    tolerance: f32,
) {
    assert_eq!(out.dims(), expected.dims(), "{what}");
    let err = relative_error(out, expected);
    assert!(err < tolerance, "{what}: output off by {err}");
    for (i, (ours, theirs)) in grads.iter().zip(expected_grads).enumerate() {
        let (Some(ours), Some(theirs)) = (ours, theirs) else { continue };
        assert_eq!(ours.dims(), theirs.dims(), "{what}: gradient {i}");
        let err = relative_error(ours, theirs);
        assert!(err < tolerance, "{what}: gradient {i} off by {err}");
    }
}

#[test]
fn linear_residual_adds_the_residual_and_passes_it_the_outputs_gradient() {
    for case in &CASES {
        let (x, weight, bias) = operands(case);
        let residual = randn(&[case.0, &[case.2]].concat());
        let r = randn(&[case.0, &[case.2]].concat());
        for gelu in [false, true] {
            for bias in [Some(&bias), None] {
                let what = format!("{case:?} gelu {gelu} bias {}", bias.is_some());
                let expected = output_and_gradients_of(&[Some(&x), Some(&weight), bias, Some(&residual)], &r, |t| {
                    composed_residual(t[0].unwrap(), t[1].unwrap(), t[2], t[3].unwrap(), gelu)
                });
                let ours = output_and_gradients_of(&[Some(&x), Some(&weight), bias, Some(&residual)], &r, |t| {
                    let f = if gelu { gelu_linear_residual } else { linear_residual };
                    f(t[0].unwrap(), t[1].unwrap(), t[2], t[3].unwrap()).unwrap()
                });
                assert_close(&what, &ours, &expected, if gelu { 1e-4 } else { 1e-5 });
            }
        }
    }
    let (x, weight, bias) = operands(&CASES[1]);
    let text = error_text(linear_residual(&x, &weight, Some(&bias), &randn(&[7, 5])));
    assert!(text.contains("[7, 5]") && text.contains("[7, 192]"), "{text}");
}

fn norm_operands(features: usize) -> (Tensor, Tensor) {
    ((randn(&[features]) * 0.3).unwrap().affine(1.0, 1.0).unwrap(), (randn(&[features]) * 0.3).unwrap())
}

#[test]
fn norm_linear_matches_candles_layer_norm_then_linear() {
    for case in &CASES {
        let (x, weight, bias) = operands(case);
        let x = ((x * 2.0).unwrap() + 0.5).unwrap();
        let (norm_weight, norm_bias) = norm_operands(case.1);
        let r = randn(&[case.0, &[case.2]].concat());
        for bias in [Some(&bias), None] {
            let what = format!("{case:?} bias {}", bias.is_some());
            let all = [Some(&x), Some(&norm_weight), Some(&norm_bias), Some(&weight), bias];
            let expected = output_and_gradients_of(&all, &r, |t| {
                super::norm_linear::plain(t[0].unwrap(), t[1].unwrap(), t[2].unwrap(), 1e-6, t[3].unwrap(), t[4]).unwrap()
            });
            let ours = output_and_gradients_of(&all, &r, |t| {
                norm_linear(t[0].unwrap(), t[1].unwrap(), t[2].unwrap(), 1e-6, t[3].unwrap(), t[4]).unwrap()
            });
            // A single feature normalises to zero: its layer-norm's input gradient is rounding alone.
            let tolerance = if case.1 == 1 { 1e-3 } else { 1e-4 };
            assert_close(&what, &ours, &expected, tolerance);
        }
    }
}

#[test]
fn norm_linear_in_half_precision_is_the_plain_ops_in_half_precision() {
    let case: Case = (&[2, 19], 96, 40);
    for dtype in [DType::F16, DType::BF16] {
        let (x, weight, bias) = operands(&case);
        let [x, weight, bias] = [x, weight, bias].map(|t| t.to_dtype(dtype).unwrap());
        let (norm_weight, norm_bias) = norm_operands(96);
        let r = randn(&[2, 19, 40]).to_dtype(dtype).unwrap();
        let all = [Some(&x), Some(&norm_weight), Some(&norm_bias), Some(&weight), Some(&bias)];
        let expected = output_and_gradients_of(&all, &r, |t| {
            linear(&layer_norm(t[0].unwrap(), t[1].unwrap(), t[2].unwrap(), 1e-6).unwrap(), t[3].unwrap(), t[4]).unwrap()
        });
        let ours = output_and_gradients_of(&all, &r, |t| {
            norm_linear(t[0].unwrap(), t[1].unwrap(), t[2].unwrap(), 1e-6, t[3].unwrap(), t[4]).unwrap()
        });
        assert_eq!(ours.0.dtype(), dtype);
        // The same arithmetic, the normalised input rounded where the plain layer-norm stores it.
        assert_close(&format!("{dtype:?}"), &ours, &expected, 1e-6);
    }
}

/// The device passes of `norm_linear` (our layer-norm kernel, cuBLAS's
/// product, the bias call) and of the residual ops (the bias call, then
/// cuDNN's add into the output), on the reference primitives, give what the
/// CPU ops give, keep nothing beyond candle's storages, and hold, beside a
/// pass's result, the normalised or activated input where the rules say:
/// `norm_linear` forward (its backward runs the plain ops, each pass one
/// result), the GELU forward, in the input gradient and in the weight gradient.
#[test]
fn norm_linear_and_linear_residual_on_the_reference_primitives_match_the_cpu() {
    use super::cuda::{allocations, on_reference};
    for case in [CASES[1], CASES[3], CASES[5]] {
        for dtype in [DType::F32, DType::F16] {
            let (x, weight, bias) = operands(&case);
            let [x, weight, bias] = [x, weight, bias].map(|t| t.to_dtype(dtype).unwrap());
            let residual = randn(&[case.0, &[case.2]].concat()).to_dtype(dtype).unwrap();
            let (norm_weight, norm_bias) = norm_operands(case.1);
            let r = randn(&[case.0, &[case.2]].concat()).to_dtype(dtype).unwrap();
            let tolerance = if dtype == DType::F32 { 1e-4 } else { 5e-3 };
            let norm = [Some(&x), Some(&norm_weight), Some(&norm_bias), Some(&weight), Some(&bias)];
            let norm_op =
                |t: &[Option<&Tensor>]| norm_linear(t[0].unwrap(), t[1].unwrap(), t[2].unwrap(), 1e-6, t[3].unwrap(), t[4]).unwrap();
            let adding = [Some(&x), Some(&weight), Some(&bias), Some(&residual)];
            let adding_op = |t: &[Option<&Tensor>]| gelu_linear_residual(t[0].unwrap(), t[1].unwrap(), t[2], t[3].unwrap()).unwrap();
            let bytes = |t: &Tensor| (t.elem_count() * dtype.size_in_bytes()) as u64;
            let (x_bytes, out_bytes, weight_bytes) = (bytes(&x), bytes(&residual), bytes(&weight));
            // The layer-norm's backward makes its weight and bias gradients in f32 beside the input's.
            let norm_peak = (x_bytes + out_bytes).max(weight_bytes).max(x_bytes + 2 * case.1 as u64 * 4);
            let adding_peak = (x_bytes + out_bytes).max(2 * x_bytes).max(x_bytes + weight_bytes);
            for (name, all, op, peak) in [
                ("norm_linear", &norm[..], &norm_op as &dyn Fn(&[Option<&Tensor>]) -> Tensor, norm_peak),
                ("gelu_linear_residual", &adding[..], &adding_op, adding_peak),
            ] {
                let what = format!("{name} {case:?} {dtype:?}");
                let expected = output_and_gradients_of(all, &r, op);
                let (ours, used) = on_reference(|| allocations(|| output_and_gradients_of(all, &r, op)));
                assert_close(&what, &ours, &expected, tolerance);
                assert_eq!(used.left, 0, "{what}: nothing kept beyond candle's storages");
                assert_eq!(used.peak, peak, "{what}: {used:?}");
            }
        }
    }
}
