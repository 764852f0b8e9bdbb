use candle_core::{DType, Device, Tensor, Var};

use super::*;

/// `(batch, channels, height, width, out_channels, kernel, stride, padding, groups)`.
type Case = (usize, usize, usize, usize, usize, usize, usize, usize, usize);

const CASES: [Case; 16] = [
    (2, 3, 7, 9, 4, 3, 1, 1, 1),   // odd, non-square input
    (3, 4, 8, 8, 6, 3, 2, 1, 1),   // stride 2
    (1, 8, 5, 5, 8, 1, 1, 0, 1),   // pointwise, one image
    (3, 8, 7, 7, 16, 1, 2, 0, 1),  // 1x1 stride-2 shortcut
    (2, 6, 9, 7, 6, 3, 2, 0, 2),   // grouped
    (2, 4, 11, 10, 4, 3, 1, 1, 4), // depthwise
    (2, 4, 11, 10, 8, 5, 2, 2, 4), // depthwise, 2 outputs per channel, 5x5 stride 2
    (5, 16, 2, 2, 32, 3, 1, 1, 1), // 2x2 maps: images stacked into one product
    (4, 3, 13, 13, 8, 7, 2, 3, 1), // 7x7 stride-2 stem
    (3, 5, 6, 6, 4, 2, 3, 1, 1),   // even kernel, stride above kernel
    (2, 3, 18, 17, 4, 3, 1, 1, 1), // wide rows: copied row by row
    (3, 4, 16, 16, 6, 1, 1, 0, 1), // pointwise, two images stacked
    (2, 8, 21, 37, 8, 3, 2, 1, 8), // depthwise 3x3 stride 2, rows longer than a vector
    (2, 3, 37, 35, 8, 7, 2, 3, 1), // wide stem: rows copied at stride 2
    (2, 8, 33, 33, 8, 3, 2, 1, 1), // wide stride 2: the input gradient added back row by row
    (2, 4, 49, 52, 6, 3, 3, 1, 1), // wide stride 3
];

thread_local! {
    /// Each test (a thread of its own) draws the same values on every run,
    /// so that a tolerance met once is met always.
    static DRAWS: std::cell::RefCell<rand_chacha::ChaCha8Rng> = std::cell::RefCell::new(rand::SeedableRng::seed_from_u64(39));
}

/// Standard normal values in `dims`, from this test's seeded stream.
pub(super) fn randn(dims: &[usize]) -> Tensor {
    let len = dims.iter().product();
    let values: Vec<f32> = DRAWS.with(|rng| {
        let mut rng = rng.borrow_mut();
        (0..len).map(|_| rand_distr::Distribution::sample(&rand_distr::StandardNormal, &mut *rng)).collect()
    });
    Tensor::from_vec(values, dims, &Device::Cpu).unwrap()
}

pub(super) fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// `values` in `like`'s shape, on the CPU.
pub(super) fn tensor(values: Vec<f32>, like: &Tensor) -> Tensor {
    Tensor::from_vec(values, like.dims(), &Device::Cpu).unwrap()
}

fn case_tensors(&(n, c, h, w, o, k, _, _, groups): &Case) -> (Tensor, Tensor) {
    (randn(&[n, c, h, w]), randn(&[o, c / groups, k, k]))
}

fn params(&(.., stride, padding, groups): &Case) -> ConvParams {
    ConvParams { stride, padding, groups }
}

fn reference_conv(x: &Tensor, w: &Tensor, p: ConvParams) -> Tensor {
    x.conv2d(w, p.padding, p.stride, 1, p.groups).unwrap()
}

/// `|a - b| / |b|` over all elements, in f32; `|a - b|` where `b` is all
/// zeros, so that `a` must then be zero too. The inputs are random, and a
/// rare draw zeroes a whole small output (every channel of a 4-channel map
/// under ReLU): dividing by its norm failed the lean ops' tests once in
/// about a hundred runs.
pub(super) fn relative_error(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    let diff = (&a - &b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
    let norm = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}

#[test]
fn conv_forward_matches_candle() {
    for case in &CASES {
        let (x, w) = case_tensors(case);
        let ours = conv2d(&x, &w, params(case)).unwrap();
        let reference = reference_conv(&x, &w, params(case));
        assert_eq!(ours.dims(), reference.dims(), "{case:?}");
        let err = relative_error(&ours, &reference);
        assert!(err < 1e-5, "{case:?}: relative error {err}");
    }
}

/// Gradients of `sum(conv(x, w) * r)` from a convolution function.
fn conv_grads(conv: impl Fn(&Tensor, &Tensor) -> Tensor, x: &Tensor, w: &Tensor, r: &Tensor) -> (Tensor, Tensor) {
    let (xv, wv) = (Var::from_tensor(x).unwrap(), Var::from_tensor(w).unwrap());
    let loss = (conv(xv.as_tensor(), wv.as_tensor()) * r).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    (grads.get(xv.as_tensor()).unwrap().clone(), grads.get(wv.as_tensor()).unwrap().clone())
}

/// candle's backward gets the input gradient's shape wrong when the stride
/// leaves the last columns unread (W = 10 here): that case is checked against
/// finite differences only.
const CANDLE_BACKWARD_FAILS: Case = CASES[6];

#[test]
fn conv_backward_matches_candle() {
    for case in CASES.iter().filter(|c| **c != CANDLE_BACKWARD_FAILS) {
        let (x, w) = case_tensors(case);
        let p = params(case);
        let r = randn(reference_conv(&x, &w, p).dims());
        let (gx, gw) = conv_grads(|x, w| conv2d(x, w, p).unwrap(), &x, &w, &r);
        let (rx, rw) = conv_grads(|x, w| reference_conv(x, w, p), &x, &w, &r);
        let (ex, ew) = (relative_error(&gx, &rx), relative_error(&gw, &rw));
        assert!(ex < 1e-4 && ew < 1e-4, "{case:?}: grad x {ex}, grad w {ew}");
    }
}

/// The loss is linear in each operand, so a central difference of any step
/// is exact up to rounding: this checks the backward without candle's.
#[test]
fn conv_backward_matches_finite_differences() {
    for case in CASES {
        let (x, w) = case_tensors(&case);
        let p = params(&case);
        let r = randn(reference_conv(&x, &w, p).dims());
        // Summed in f64, with a large step, to keep rounding far below the tolerance.
        let r64 = r.to_dtype(DType::F64).unwrap();
        let loss = |x: &Tensor, w: &Tensor| -> f64 {
            let y = conv2d(x, w, p).unwrap().to_dtype(DType::F64).unwrap();
            (y * &r64).unwrap().sum_all().unwrap().to_scalar().unwrap()
        };
        let (gx, gw) = conv_grads(|x, w| conv2d(x, w, p).unwrap(), &x, &w, &r);
        for (operand, grad, is_x) in [(&x, &gx, true), (&w, &gw, false)] {
            let flat = values(operand);
            let grad = values(grad);
            for i in (0..flat.len()).step_by(flat.len() / 7 + 1) {
                let shifted = |delta: f32| {
                    let mut v = flat.clone();
                    v[i] += delta;
                    let t = tensor(v, operand);
                    if is_x {
                        loss(&t, &w)
                    } else {
                        loss(&x, &t)
                    }
                };
                let numeric = ((shifted(4.0) - shifted(-4.0)) / 8.0) as f32;
                let scale = grad[i].abs().max(1.0);
                assert!((numeric - grad[i]).abs() / scale < 1e-4, "{case:?} element {i}: {numeric} vs {}", grad[i]);
            }
        }
    }
}

#[test]
fn conv_runs_in_half_precision() {
    for dtype in [DType::F16, DType::BF16] {
        for case in [CASES[0], CASES[5], CASES[7]] {
            let (x, w) = case_tensors(&case);
            let p = params(&case);
            let (xh, wh) = (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap());
            let ours = conv2d(&xh, &wh, p).unwrap();
            assert_eq!(ours.dtype(), dtype);
            // The reference sees the same rounded inputs, computed in f32.
            let (xr, wr) = (xh.to_dtype(DType::F32).unwrap(), wh.to_dtype(DType::F32).unwrap());
            let err = relative_error(&ours, &reference_conv(&xr, &wr, p));
            assert!(err < 1e-2, "{dtype:?} {case:?}: relative error {err}");

            let r = randn(ours.dims());
            let (gx, gw) = conv_grads(|x, w| conv2d(x, w, p).unwrap(), &xh, &wh, &r.to_dtype(dtype).unwrap());
            let (rx, rw) = conv_grads(|x, w| reference_conv(x, w, p), &xr, &wr, &r);
            assert_eq!((gx.dtype(), gw.dtype()), (dtype, dtype));
            let (ex, ew) = (relative_error(&gx, &rx), relative_error(&gw, &rw));
            assert!(ex < 2e-2 && ew < 2e-2, "{dtype:?} {case:?}: grad x {ex}, grad w {ew}");
        }
    }
}

#[test]
fn conv_skips_the_input_gradient_of_a_plain_tensor() {
    let case = CASES[0];
    let (x, w) = case_tensors(&case);
    let wv = Var::from_tensor(&w).unwrap();
    let grads = conv2d(&x, wv.as_tensor(), params(&case)).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&x).is_none());
    assert_eq!(grads.get(wv.as_tensor()).unwrap().dims(), w.dims());
}

#[test]
fn conv_f64_uses_candle() {
    let case = CASES[4];
    let (x, w) = case_tensors(&case);
    let (x, w) = (x.to_dtype(DType::F64).unwrap(), w.to_dtype(DType::F64).unwrap());
    let ours = conv2d(&x, &w, params(&case)).unwrap();
    assert_eq!(ours.dtype(), DType::F64);
    assert!(relative_error(&ours, &reference_conv(&x, &w, params(&case))) < 1e-12);
}

fn error_text(r: candle_core::Result<Tensor>) -> String {
    r.err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn conv_rejects_bad_shapes_by_name() {
    let p = ConvParams { stride: 1, padding: 0, groups: 1 };
    let x = randn(&[2, 6, 5, 5]);
    let text = error_text(conv2d(&x, &randn(&[4, 3, 3, 3]), p));
    assert!(text.contains("expects 3 input channels") && text.contains("gives 6"), "{text}");
    let text = error_text(conv2d(&x, &randn(&[4, 3, 3, 3]), ConvParams { groups: 4, ..p }));
    assert!(text.contains("6 input channels are not divisible by 4 groups"), "{text}");
    let text = error_text(conv2d(&x, &randn(&[4, 6, 7, 7]), p));
    assert!(text.contains("7x7 window does not fit the 5x5 input"), "{text}");
    let text = error_text(conv2d(&x, &randn(&[4, 6, 3, 3]), ConvParams { stride: 0, ..p }));
    assert!(text.contains("stride must be at least 1"), "{text}");
    let text = error_text(conv2d(&randn(&[6, 5, 5]), &randn(&[4, 6, 3, 3]), p));
    assert!(text.contains("input must have 4 dimensions"), "{text}");
    let text = error_text(conv2d(&x, &randn(&[4, 6, 3, 3]).to_dtype(DType::F16).unwrap(), p));
    assert!(text.contains("F32 but the other operand is F16"), "{text}");
}

/// candle's own pooling of the input padded with -inf.
fn reference_pool(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Tensor {
    pool::max_pool2d_composed(x, pool::Geometry::new(x, kernel, stride, padding).unwrap()).unwrap()
}

const POOLS: [(usize, usize, usize, usize, usize); 6] = [
    // (height, width, kernel, stride, padding)
    (7, 7, 3, 2, 1),
    (8, 9, 3, 2, 1),
    (8, 8, 2, 2, 0),
    (6, 5, 3, 1, 1),
    (10, 11, 3, 3, 0),
    (5, 5, 5, 2, 2),
];

#[test]
fn max_pool_forward_matches_candle() {
    for (h, w, k, s, p) in POOLS {
        let x = randn(&[2, 3, h, w]);
        let ours = max_pool2d(&x, k, s, p).unwrap();
        let composed = reference_pool(&x, k, s, p);
        assert_eq!(ours.dims(), composed.dims());
        assert_eq!(relative_error(&ours, &composed), 0.0, "{h}x{w} k{k} s{s} p{p}");
        // candle's own kernel on an explicitly padded input.
        let padded = pool::pad_neg_inf(&pool::pad_neg_inf(&x, 2, p, p).unwrap(), 3, p, p).unwrap();
        let candle = padded.max_pool2d_with_stride(k, s).unwrap();
        assert_eq!(relative_error(&ours, &candle), 0.0, "{h}x{w} k{k} s{s} p{p}");
    }
}

fn pool_grad(pool: impl Fn(&Tensor) -> Tensor, x: &Tensor, r: &Tensor) -> Tensor {
    let xv = Var::from_tensor(x).unwrap();
    let loss = (pool(xv.as_tensor()) * r).unwrap().sum_all().unwrap();
    loss.backward().unwrap().get(xv.as_tensor()).unwrap().clone()
}

#[test]
fn max_pool_backward_matches_composed_maximum() {
    for (h, w, k, s, p) in POOLS {
        let x = randn(&[2, 3, h, w]);
        let r = randn(max_pool2d(&x, k, s, p).unwrap().dims());
        let ours = pool_grad(|x| max_pool2d(x, k, s, p).unwrap(), &x, &r);
        let composed = pool_grad(|x| reference_pool(x, k, s, p), &x, &r);
        assert!(relative_error(&ours, &composed) < 1e-6, "{h}x{w} k{k} s{s} p{p}");
    }
}

#[test]
fn max_pool_gradient_adds_up_where_windows_overlap() {
    // The 9 at (2, 2) is the maximum of all four 3x3 stride-2 windows.
    let mut v = vec![0f32; 25];
    v[12] = 9.0;
    let x = Tensor::from_vec(v, (1, 1, 5, 5), &Device::Cpu).unwrap();
    let grad = pool_grad(|x| max_pool2d(x, 3, 2, 0).unwrap(), &x, &Tensor::ones((1, 1, 2, 2), DType::F32, &Device::Cpu).unwrap());
    let grad = values(&grad);
    assert_eq!(grad[12], 4.0);
    assert_eq!(grad.iter().sum::<f32>(), 4.0);
}

#[test]
fn max_pool_propagates_nan() {
    let mut v = vec![1f32; 16];
    v[5] = f32::NAN;
    let x = Tensor::from_vec(v, (1, 1, 4, 4), &Device::Cpu).unwrap();
    let out = values(&max_pool2d(&x, 2, 2, 0).unwrap());
    assert!(out[0].is_nan());
    assert_eq!(&out[1..], &[1.0, 1.0, 1.0]);
}

#[test]
fn max_pool_runs_in_half_precision() {
    for dtype in [DType::F16, DType::BF16] {
        let x = randn(&[2, 3, 9, 9]).to_dtype(dtype).unwrap();
        let ours = max_pool2d(&x, 3, 2, 1).unwrap();
        assert_eq!(ours.dtype(), dtype);
        let reference = max_pool2d(&x.to_dtype(DType::F32).unwrap(), 3, 2, 1).unwrap();
        assert_eq!(relative_error(&ours, &reference), 0.0);
        let r = randn(ours.dims()).to_dtype(dtype).unwrap();
        let grad = pool_grad(|x| max_pool2d(x, 3, 2, 1).unwrap(), &x, &r);
        assert_eq!((grad.dtype(), grad.dims()), (dtype, x.dims()));
    }
}

#[test]
fn max_pool_rejects_bad_windows_by_name() {
    let x = randn(&[1, 2, 4, 4]);
    let text = error_text(max_pool2d(&x, 3, 2, 2));
    assert!(text.contains("padding 2 exceeds half the kernel 3"), "{text}");
    let text = error_text(max_pool2d(&x, 5, 1, 0));
    assert!(text.contains("5x5 window does not fit the 4x4 input"), "{text}");
    let text = error_text(max_pool2d(&x, 2, 0, 0));
    assert!(text.contains("stride must be at least 1"), "{text}");
}

/// Output, statistics and the three gradients of `sum(y * r)`.
fn batch_norm_run(bn: impl Fn(&Tensor, &Tensor, &Tensor) -> BatchNormTrain, x: &Tensor, w: &Tensor, b: &Tensor, r: &Tensor) -> Vec<Tensor> {
    let vars = [x, w, b].map(|t| Var::from_tensor(t).unwrap());
    let out = bn(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor());
    let grads = (&out.y * r).unwrap().sum_all().unwrap().backward().unwrap();
    let mut all = vec![out.y.clone(), out.stats.mean.clone(), out.stats.var.clone()];
    all.extend(vars.iter().map(|v| grads.get(v.as_tensor()).unwrap().clone()));
    all
}

#[test]
fn batch_norm_matches_composed_forward_and_backward() {
    for dims in [[4, 3, 5, 7], [2, 8, 1, 3], [3, 16, 6, 6]] {
        let c = dims[1];
        let x = ((randn(&dims) * 3.0).unwrap() + 2.0).unwrap();
        let (w, b, r) = (randn(&[c]), randn(&[c]), randn(&dims));
        let ours = batch_norm_run(|x, w, b| batch_norm_train(x, w, b, 1e-5).unwrap(), &x, &w, &b, &r);
        let count = dims[0] * dims[2] * dims[3];
        let reference = batch_norm_run(|x, w, b| norm::composed(x, w, b, 1e-5, count).unwrap(), &x, &w, &b, &r);
        for (name, (a, e)) in ["y", "mean", "var", "grad x", "grad weight", "grad bias"].iter().zip(ours.iter().zip(&reference)) {
            assert_eq!(a.dims(), e.dims(), "{dims:?} {name}");
            let err = relative_error(a, e);
            assert!(err < 1e-4, "{dims:?} {name}: relative error {err}");
        }
    }
}

#[test]
fn batch_norm_keeps_half_precision_activations() {
    let dims = [4, 6, 5, 5];
    let x = randn(&dims).to_dtype(DType::F16).unwrap();
    let (w, b) = (randn(&[6]), randn(&[6]));
    let out = batch_norm_train(&x, &w, &b, 1e-5).unwrap();
    assert_eq!((out.y.dtype(), out.stats.mean.dtype(), out.stats.count), (DType::F16, DType::F32, 100));
    let reference = norm::composed(&x.to_dtype(DType::F32).unwrap(), &w, &b, 1e-5, 100).unwrap();
    assert!(relative_error(&out.y, &reference.y) < 1e-2);
    let r = randn(&dims).to_dtype(DType::F16).unwrap();
    let grads = batch_norm_run(|x, w, b| batch_norm_train(x, w, b, 1e-5).unwrap(), &x, &w, &b, &r);
    assert_eq!((grads[3].dtype(), grads[4].dtype()), (DType::F16, DType::F32));
}

#[test]
fn batch_norm_rejects_bad_shapes_by_name() {
    let x = randn(&[2, 3, 4, 4]);
    let text = error_text(batch_norm_train(&x, &randn(&[4]), &randn(&[3]), 1e-5).map(|o| o.y));
    assert!(text.contains("weight must hold one value per channel (3), got shape [4]"), "{text}");
    let text = error_text(batch_norm_train(&randn(&[1, 3, 1, 1]), &randn(&[3]), &randn(&[3]), 1e-5).map(|o| o.y));
    assert!(text.contains("fewer than 2 values per channel"), "{text}");
}

#[test]
fn a_gradient_in_another_shape_or_dtype_than_its_operand_is_refused_by_name() {
    let (x, w) = (randn(&[2, 3]), randn(&[3]));
    let ok = checked_gradients("test_op", [&x, &w], [Some(randn(&[2, 3])), None]).unwrap();
    assert!(ok[0].is_some() && ok[1].is_none());
    let err = checked_gradients("norm_act", [&x, &w], [None, Some(randn(&[1, 3]))]).unwrap_err().to_string();
    assert!(err.contains("norm_act: the backward made a F32 gradient of [1, 3] for operand 1, a F32 tensor of [3]"), "{err}");
    let half = randn(&[3]).to_dtype(DType::F16).unwrap();
    let err = checked_gradients("conv2d", [&w], [Some(half)]).unwrap_err().to_string();
    assert!(err.contains("F16 gradient of [3] for operand 0, a F32 tensor"), "{err}");
}
