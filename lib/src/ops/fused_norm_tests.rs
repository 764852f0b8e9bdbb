//! The lean ops against the plain layers' ops they replace, and against
//! finite differences.

use candle_core::{DType, Device, Tensor, Var};

use super::tests::{randn, relative_error, tensor, values};
use super::*;

/// Half precision rounds each stored tensor; the two paths round at the same
/// places, but sum in different orders where a gradient is added up (bf16
/// keeps 8 bits of mantissa, f16 11).
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 1e-2,
        _ => 5e-2,
    }
}

const ACTIVATIONS: [Activation; 3] = [Activation::Identity, Activation::Relu, Activation::Silu];
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[derive(Debug, Clone, Copy)]
enum Consumer {
    Nothing,
    /// `(out_channels, kernel, stride, padding, groups)`; groups 0 means depthwise.
    Conv(usize, usize, usize, usize, usize),
    MaxPool(usize, usize, usize),
}

const CONSUMERS: [Consumer; 6] = [
    Consumer::Nothing,
    Consumer::Conv(5, 3, 1, 1, 1),
    Consumer::Conv(6, 1, 2, 0, 1),
    Consumer::Conv(0, 3, 2, 1, 0),
    Consumer::Conv(4, 3, 1, 1, 2),
    Consumer::MaxPool(3, 2, 1),
];

/// What one run gives: the output, the statistics, and the gradients of
/// `sum(y * r)` with respect to z, the batch-norm's weight and bias and the
/// consumer's weight (when there is one).
struct Run {
    outputs: Vec<(&'static str, Tensor)>,
}

struct Case {
    z: Tensor,
    gamma: Tensor,
    beta: Tensor,
    kernel: Option<(Tensor, ConvParams)>,
    r: Tensor,
}

fn case(dims: [usize; 4], consumer: Consumer, dtype: DType) -> (Case, Option<(usize, usize, usize)>) {
    let c = dims[1];
    let z = ((randn(&dims) * 2.0).unwrap() + 0.5).unwrap().to_dtype(dtype).unwrap();
    let (gamma, beta) = (randn(&[c]), randn(&[c]));
    let (kernel, pool) = match consumer {
        Consumer::Nothing => (None, None),
        Consumer::Conv(o, k, stride, padding, groups) => {
            let (groups, o) = if groups == 0 { (c, c) } else { (groups, o) };
            let w = (randn(&[o, c / groups, k, k]) * 0.3).unwrap().to_dtype(dtype).unwrap();
            (Some((w, ConvParams { stride, padding, groups })), None)
        }
        Consumer::MaxPool(k, s, p) => (None, Some((k, s, p))),
    };
    let probe = Case { z: z.clone(), gamma: gamma.clone(), beta: beta.clone(), kernel: kernel.clone(), r: z.clone() };
    let out_dims = plain(&probe, Activation::Relu, pool).y.dims().to_vec();
    let r = randn(&out_dims).to_dtype(dtype).unwrap();
    (Case { z, gamma, beta, kernel, r }, pool)
}

fn plain(c: &Case, act: Activation, pool: Option<(usize, usize, usize)>) -> Lean {
    let bn = batch_norm_train(&c.z, &c.gamma, &c.beta, 1e-5).unwrap();
    let a = act.forward(&bn.y).unwrap();
    let y = match (&c.kernel, pool) {
        (Some((w, p)), _) => conv2d(&a, w, *p).unwrap(),
        (None, Some((k, s, p))) => max_pool2d(&a, k, s, p).unwrap(),
        (None, None) => a,
    };
    Lean { y, stats: vec![bn.stats] }
}

fn run(c: &Case, op: impl Fn(&Tensor, &Tensor, &Tensor, Option<&Tensor>) -> Lean) -> Run {
    let z = Var::from_tensor(&c.z).unwrap();
    let (gamma, beta) = (Var::from_tensor(&c.gamma).unwrap(), Var::from_tensor(&c.beta).unwrap());
    let w = c.kernel.as_ref().map(|(w, _)| Var::from_tensor(w).unwrap());
    let out = op(z.as_tensor(), gamma.as_tensor(), beta.as_tensor(), w.as_ref().map(|w| w.as_tensor()));
    let grads = (&out.y * &c.r).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |v: &Var| grads.get(v.as_tensor()).unwrap().clone();
    let mut outputs = vec![("y", out.y.clone()), ("mean", out.stats[0].mean.clone()), ("var", out.stats[0].var.clone())];
    outputs.extend([("grad z", grad(&z)), ("grad gamma", grad(&gamma)), ("grad beta", grad(&beta))]);
    if let Some(w) = &w {
        outputs.push(("grad conv weight", grad(w)));
    }
    Run { outputs }
}

fn assert_close(what: &str, lean: &Run, reference: &Run, tol: f32) {
    assert_eq!(lean.outputs.len(), reference.outputs.len(), "{what}");
    for ((name, a), (_, e)) in lean.outputs.iter().zip(&reference.outputs) {
        assert_eq!((a.dims(), a.dtype()), (e.dims(), e.dtype()), "{what} {name}");
        let err = relative_error(a, e);
        assert!(err < tol, "{what} {name}: relative error {err}");
    }
}

#[test]
fn norm_act_matches_the_plain_layers_for_every_consumer_activation_and_dtype() {
    for dtype in DTYPES {
        for consumer in CONSUMERS {
            for act in ACTIVATIONS {
                let (c, pool) = case([3, 4, 7, 6], consumer, dtype);
                let then = match (&c.kernel, pool) {
                    (Some((_, p)), _) => (true, *p),
                    _ => (false, ConvParams { stride: 1, padding: 0, groups: 1 }),
                };
                let lean = run(&c, |z, g, b, w| {
                    let then = match (w, pool) {
                        (Some(w), _) => Then::Conv { weight: w, params: then.1 },
                        (None, Some((kernel, stride, padding))) => Then::MaxPool { kernel, stride, padding },
                        (None, None) => Then::Nothing,
                    };
                    norm_act(z, Norm { weight: g, bias: b, eps: 1e-5 }, act, then).unwrap()
                });
                let reference = run(&c, |z, g, b, w| {
                    let case =
                        Case { z: z.clone(), gamma: g.clone(), beta: b.clone(), kernel: w.map(|w| (w.clone(), then.1)), r: c.r.clone() };
                    plain(&case, act, pool)
                });
                assert_close(&format!("{dtype:?} {consumer:?} {act:?}"), &lean, &reference, tolerance(dtype));
            }
        }
    }
}

fn residual_run(c: &Case, x: &Tensor, projected: bool, act: Activation, lean: bool) -> Run {
    let (z, x) = (Var::from_tensor(&c.z).unwrap(), Var::from_tensor(x).unwrap());
    let (gamma, beta) = (Var::from_tensor(&c.gamma).unwrap(), Var::from_tensor(&c.beta).unwrap());
    let (side_gamma, side_beta) =
        (Var::from_tensor(&(&c.gamma * 0.5).unwrap()).unwrap(), Var::from_tensor(&c.beta.neg().unwrap()).unwrap());
    let norm = Norm { weight: gamma.as_tensor(), bias: beta.as_tensor(), eps: 1e-5 };
    let side = Norm { weight: side_gamma.as_tensor(), bias: side_beta.as_tensor(), eps: 1e-5 };
    let out = if lean {
        let residual = if projected { Residual::Norm(x.as_tensor(), side) } else { Residual::Identity(x.as_tensor()) };
        norm_add_act(z.as_tensor(), norm, residual, act).unwrap()
    } else {
        let body = batch_norm_train(z.as_tensor(), norm.weight, norm.bias, 1e-5).unwrap();
        let mut stats = vec![body.stats];
        let residual = if projected {
            let bn = batch_norm_train(x.as_tensor(), side.weight, side.bias, 1e-5).unwrap();
            stats.push(bn.stats);
            bn.y
        } else {
            x.as_tensor().clone()
        };
        Lean { y: act.forward(&(body.y + residual).unwrap()).unwrap(), stats }
    };
    let grads = (&out.y * &c.r).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |v: &Var| grads.get(v.as_tensor()).unwrap().clone();
    let mut outputs =
        vec![("y", out.y.clone()), ("grad z", grad(&z)), ("grad x", grad(&x)), ("grad gamma", grad(&gamma)), ("grad beta", grad(&beta))];
    for s in &out.stats {
        outputs.extend([("mean", s.mean.clone()), ("var", s.var.clone())]);
    }
    if projected {
        outputs.extend([("grad side gamma", grad(&side_gamma)), ("grad side beta", grad(&side_beta))]);
    }
    Run { outputs }
}

#[test]
fn norm_add_act_matches_the_plain_layers_with_identity_and_projected_residuals() {
    for dtype in DTYPES {
        for projected in [false, true] {
            for act in [Activation::Relu, Activation::Identity] {
                let (c, _) = case([3, 5, 6, 6], Consumer::Nothing, dtype);
                let x = ((randn(&[3, 5, 6, 6]) * 1.5).unwrap() - 0.3).unwrap().to_dtype(dtype).unwrap();
                let lean = residual_run(&c, &x, projected, act, true);
                let reference = residual_run(&c, &x, projected, act, false);
                assert_close(&format!("{dtype:?} projected {projected} {act:?}"), &lean, &reference, tolerance(dtype));
            }
        }
    }
}

/// A central difference of the f32 loss, summed in f64, at a few elements of
/// each operand: the backward checked without candle's.
#[test]
fn lean_gradients_match_finite_differences() {
    let dims = [2, 3, 5, 5];
    let (c, _) = case(dims, Consumer::Conv(4, 3, 2, 1, 1), DType::F32);
    let x = randn(&dims);
    let (w, p) = c.kernel.clone().unwrap();
    let loss = |z: &Tensor, gamma: &Tensor, w: &Tensor, x: &Tensor| -> f64 {
        let norm = Norm { weight: gamma, bias: &c.beta, eps: 1e-5 };
        let conv = norm_act(z, norm, Activation::Silu, Then::Conv { weight: w, params: p }).unwrap().y;
        let merged = norm_add_act(z, norm, Residual::Identity(x), Activation::Relu).unwrap().y;
        let r = c.r.to_dtype(DType::F64).unwrap();
        let a = (conv.to_dtype(DType::F64).unwrap() * r).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        let b = merged.to_dtype(DType::F64).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        a + 0.1 * b
    };
    let vars = [&c.z, &c.gamma, &w, &x].map(|t| Var::from_tensor(t).unwrap());
    let [z, gamma, wv, xv] = &vars;
    let norm = Norm { weight: gamma.as_tensor(), bias: &c.beta, eps: 1e-5 };
    let conv = norm_act(z.as_tensor(), norm, Activation::Silu, Then::Conv { weight: wv.as_tensor(), params: p }).unwrap().y;
    let merged = norm_add_act(z.as_tensor(), norm, Residual::Identity(xv.as_tensor()), Activation::Relu).unwrap().y;
    let total = ((conv * &c.r).unwrap().sum_all().unwrap() + (merged.sqr().unwrap().sum_all().unwrap() * 0.1).unwrap()).unwrap();
    let grads = total.backward().unwrap();
    for (index, var) in vars.iter().enumerate() {
        let flat = values(var.as_tensor());
        let grad = values(grads.get(var.as_tensor()).unwrap());
        for i in (0..flat.len()).step_by(flat.len() / 6 + 1) {
            let shifted = |delta: f32| {
                let mut v = flat.clone();
                v[i] += delta;
                let t = tensor(v, var.as_tensor());
                let mut operands = [c.z.clone(), c.gamma.clone(), w.clone(), x.clone()];
                operands[index] = t;
                loss(&operands[0], &operands[1], &operands[2], &operands[3])
            };
            let step = 1e-2;
            let numeric = (shifted(step) - shifted(-step)) / (2.0 * step as f64);
            let analytic = grad[i] as f64;
            let scale = analytic.abs().max(1.0);
            assert!((numeric - analytic).abs() / scale < 2e-2, "operand {index} element {i}: {numeric} vs {analytic}");
        }
    }
}

#[test]
fn a_batch_norm_weight_of_zero_gives_finite_gradients() {
    let dims = [2, 3, 4, 4];
    let (mut c, _) = case(dims, Consumer::Conv(3, 3, 1, 1, 1), DType::F32);
    c.gamma = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
    let p = c.kernel.as_ref().unwrap().1;
    let lean = run(&c, |z, g, b, w| {
        norm_act(z, Norm { weight: g, bias: b, eps: 1e-5 }, Activation::Relu, Then::Conv { weight: w.unwrap(), params: p }).unwrap()
    });
    for (name, t) in &lean.outputs {
        let values = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        assert!(values.iter().all(|v| v.is_finite()), "{name} is not finite");
    }
    let grad_z = &lean.outputs[3].1;
    assert_eq!(grad_z.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "no gradient reaches z through a zero weight");
}

fn error_text(r: candle_core::Result<Lean>) -> String {
    r.err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn lean_ops_refuse_bad_operands_by_name() {
    let z = randn(&[2, 3, 4, 4]);
    let (g, b) = (randn(&[3]), randn(&[3]));
    let text = error_text(norm_act(&z, Norm { weight: &randn(&[4]), bias: &b, eps: 1e-5 }, Activation::Relu, Then::Nothing));
    assert!(text.contains("norm_act: weight must hold one value per channel (3), got shape [4]"), "{text}");
    let text =
        error_text(norm_add_act(&z, Norm { weight: &g, bias: &b, eps: 1e-5 }, Residual::Identity(&randn(&[2, 3, 2, 2])), Activation::Relu));
    assert!(text.contains("residual [2, 3, 2, 2] does not match the block's output [2, 3, 4, 4]"), "{text}");
    let w = randn(&[5, 3, 3, 3]).to_dtype(DType::F16).unwrap();
    let then = Then::Conv { weight: &w, params: ConvParams { stride: 1, padding: 1, groups: 1 } };
    let text = error_text(norm_act(&z, Norm { weight: &g, bias: &b, eps: 1e-5 }, Activation::Relu, then));
    assert!(text.contains("input is F32 but the other operand is F16"), "{text}");
}
