use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::*;

/// A gradient store holding exactly the given gradients.
pub(crate) fn grad_store(entries: &[(&Var, &[f32])]) -> GradStore {
    let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
    for (var, _) in entries {
        loss = (loss + var.as_tensor().sum_all().unwrap()).unwrap();
    }
    let mut grads = loss.backward().unwrap();
    for (var, g) in entries {
        let g = Tensor::from_slice(g, var.shape(), &Device::Cpu).unwrap();
        grads.insert(var, g);
    }
    grads
}

fn var(values: &[f32]) -> Var {
    Var::from_slice(values, values.len(), &Device::Cpu).unwrap()
}

fn values(var: &Var) -> Vec<f32> {
    var.as_tensor().flatten_all().unwrap().to_vec1().unwrap()
}

fn assert_close(actual: &[f32], expected: &[f64], tolerance: f64) {
    assert_eq!(actual.len(), expected.len());
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let error = (a as f64 - e).abs() / e.abs().max(1.0);
        assert!(error < tolerance, "element {i}: got {a}, expected {e} (relative error {error:e})");
    }
}

const START: [f32; 3] = [1.0, -2.0, 0.5];
const GRADS: [[f32; 3]; 3] = [[0.5, -1.0, 2.0], [-0.25, 0.75, 1.5], [1.0, 0.1, -3.0]];

/// Runs `optimizer` over GRADS from START and returns the parameters after each step.
fn trajectory(build: impl FnOnce(Vec<Var>) -> Box<dyn Optimizer>) -> Vec<Vec<f32>> {
    let p = var(&START);
    let mut optimizer = build(vec![p.clone()]);
    GRADS
        .iter()
        .map(|g| {
            optimizer.step(&grad_store(&[(&p, g)])).unwrap();
            values(&p)
        })
        .collect()
}

/// PyTorch's SGD written out in f64.
fn sgd_reference(c: &SgdConfig) -> Vec<Vec<f64>> {
    let mut p: Vec<f64> = START.iter().map(|&x| x as f64).collect();
    let mut buf: Option<Vec<f64>> = None;
    let mut out = vec![];
    for g in GRADS {
        let d: Vec<f64> = (0..3).map(|i| g[i] as f64 + c.weight_decay * p[i]).collect();
        let step: Vec<f64> = if c.momentum != 0.0 {
            let b: Vec<f64> = match &buf {
                None => d.clone(),
                Some(b) => (0..3).map(|i| c.momentum * b[i] + (1.0 - c.dampening) * d[i]).collect(),
            };
            let s = if c.nesterov { (0..3).map(|i| d[i] + c.momentum * b[i]).collect() } else { b.clone() };
            buf = Some(b);
            s
        } else {
            d
        };
        for i in 0..3 {
            p[i] -= c.lr * step[i];
        }
        out.push(p.clone());
    }
    out
}

/// PyTorch's Adam (`decoupled = false`) and AdamW written out in f64.
fn adam_reference(c: &AdamConfig, decoupled: bool) -> Vec<Vec<f64>> {
    let mut p: Vec<f64> = START.iter().map(|&x| x as f64).collect();
    let (mut m, mut v, mut max_v) = (vec![0.0; 3], vec![0.0; 3], vec![0.0f64; 3]);
    let mut out = vec![];
    for (t, g) in GRADS.iter().enumerate() {
        let t = (t + 1) as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        for i in 0..3 {
            let mut g = g[i] as f64;
            if decoupled {
                p[i] *= 1.0 - c.lr * c.weight_decay;
            } else {
                g += c.weight_decay * p[i];
            }
            m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g;
            v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * g * g;
            max_v[i] = max_v[i].max(v[i]);
            let v_used = if c.amsgrad { max_v[i] } else { v[i] };
            p[i] -= c.lr / bc1 * m[i] / (v_used.sqrt() / bc2.sqrt() + c.eps);
        }
        out.push(p.clone());
    }
    out
}

fn sgd_configs() -> Vec<SgdConfig> {
    let base = SgdConfig { lr: 0.1, ..SgdConfig::default() };
    vec![
        base.clone(),
        SgdConfig { weight_decay: 0.01, ..base.clone() },
        SgdConfig { momentum: 0.9, dampening: 0.1, weight_decay: 0.01, ..base.clone() },
        SgdConfig { momentum: 0.9, weight_decay: 0.01, nesterov: true, ..base },
    ]
}

fn adam_configs() -> Vec<AdamConfig> {
    let base = AdamConfig { lr: 0.1, ..AdamConfig::default() };
    vec![
        base.clone(),
        AdamConfig { weight_decay: 0.1, ..base.clone() },
        AdamConfig { weight_decay: 0.1, amsgrad: true, ..base.clone() },
        // beta1 < 0.5 takes lerp's other branch.
        AdamConfig { beta1: 0.3, beta2: 0.9, eps: 1e-3, ..base },
    ]
}

fn adamw_config(c: &AdamConfig) -> AdamWConfig {
    AdamWConfig { lr: c.lr, beta1: c.beta1, beta2: c.beta2, eps: c.eps, weight_decay: c.weight_decay, amsgrad: c.amsgrad }
}

fn check_trajectory(actual: Vec<Vec<f32>>, expected: Vec<Vec<f64>>, what: &str) {
    for (step, (a, e)) in actual.iter().zip(&expected).enumerate() {
        let error = a.iter().zip(e).map(|(&a, &e)| (a as f64 - e).abs() / e.abs().max(1.0)).fold(0.0, f64::max);
        assert!(error < 1e-6, "{what}, step {}: got {a:?}, expected {e:?}", step + 1);
    }
}

#[test]
fn sgd_matches_the_formulas_on_both_paths() {
    for c in sgd_configs() {
        let expected = sgd_reference(&c);
        let fused = trajectory(|v| Box::new(Sgd::new(v, c.clone()).unwrap()));
        let unfused = trajectory(|v| Box::new(Sgd::new(v, c.clone()).unwrap().unfused()));
        check_trajectory(fused, expected.clone(), &format!("fused {c:?}"));
        check_trajectory(unfused, expected, &format!("tensor ops {c:?}"));
    }
}

#[test]
fn adam_and_adamw_match_the_formulas_on_both_paths() {
    for c in adam_configs() {
        let expected = adam_reference(&c, false);
        let fused = trajectory(|v| Box::new(Adam::new(v, c.clone()).unwrap()));
        let unfused = trajectory(|v| Box::new(Adam::new(v, c.clone()).unwrap().unfused()));
        check_trajectory(fused, expected.clone(), &format!("fused Adam {c:?}"));
        check_trajectory(unfused, expected, &format!("tensor-op Adam {c:?}"));

        let w = adamw_config(&c);
        let expected = adam_reference(&c, true);
        let fused = trajectory(|v| Box::new(AdamW::new(v, w.clone()).unwrap()));
        let unfused = trajectory(|v| Box::new(AdamW::new(v, w.clone()).unwrap().unfused()));
        check_trajectory(fused, expected.clone(), &format!("fused AdamW {c:?}"));
        check_trajectory(unfused, expected, &format!("tensor-op AdamW {c:?}"));
    }
}

#[test]
fn the_first_adam_step_moves_each_weight_by_about_lr() {
    // With bias correction m_hat / sqrt(v_hat) = g / |g| on step one.
    let p = var(&START);
    let mut adam = Adam::new(vec![p.clone()], AdamConfig::default()).unwrap();
    adam.step(&grad_store(&[(&p, &GRADS[0])])).unwrap();
    let moved: Vec<f32> = values(&p).iter().zip(START).map(|(a, b)| b - a).collect();
    assert_close(&moved, &[1e-3, -1e-3, 1e-3], 1e-6);
}

/// Parameters large enough for several parallel chunks of the fused kernels.
fn big_problem(n: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let wave = |k: usize, phase: f32| -> Vec<f32> { (0..n).map(|i| ((i * 7919 + k * 104729) as f32 * 1e-4 + phase).sin()).collect() };
    (wave(0, 0.3), (1..=3).map(|k| wave(k, 1.1)).collect())
}

fn run_big(optimizer: &mut dyn Optimizer, p: &Var, grads: &[Vec<f32>]) -> Vec<f32> {
    for g in grads {
        optimizer.step(&grad_store(&[(p, g)])).unwrap();
    }
    values(p)
}

#[test]
fn fused_and_tensor_paths_agree_on_large_tensors() {
    let n = 100_003;
    let (start, grads) = big_problem(n);
    let fresh = || Var::from_slice(&start, (n,), &Device::Cpu).unwrap();
    for c in sgd_configs() {
        let (a, b) = (fresh(), fresh());
        let fused = run_big(&mut Sgd::new(vec![a.clone()], c.clone()).unwrap(), &a, &grads);
        let plain = run_big(&mut Sgd::new(vec![b.clone()], c.clone()).unwrap().unfused(), &b, &grads);
        let expected: Vec<f64> = plain.iter().map(|&x| x as f64).collect();
        assert_close(&fused, &expected, 1e-6);
    }
    for c in adam_configs() {
        let (a, b) = (fresh(), fresh());
        let fused = run_big(&mut Adam::new(vec![a.clone()], c.clone()).unwrap(), &a, &grads);
        let plain = run_big(&mut Adam::new(vec![b.clone()], c.clone()).unwrap().unfused(), &b, &grads);
        let expected: Vec<f64> = plain.iter().map(|&x| x as f64).collect();
        assert_close(&fused, &expected, 1e-6);
    }
}

#[test]
fn a_parameter_without_gradient_is_skipped() {
    let configs: Vec<OptimizerConfig> = vec![
        OptimizerConfig::Sgd(SgdConfig { lr: 0.1, momentum: 0.9, ..SgdConfig::default() }),
        OptimizerConfig::Adam(AdamConfig::default()),
        OptimizerConfig::AdamW(AdamWConfig::default()),
        OptimizerConfig::Adam8bit(Adam8bitConfig::default()),
    ];
    for config in configs {
        let (a, b) = (var(&START), var(&START));
        let mut optimizer = config.build(vec![a.clone(), b.clone()]).unwrap();
        optimizer.step(&grad_store(&[(&a, &GRADS[0])])).unwrap();
        assert_eq!(values(&b), START, "{config:?}");
        assert_ne!(values(&a), START, "{config:?}");
        // Only the stepped parameter has state.
        let one = optimizer.state_bytes();
        assert!(one > 0, "{config:?}");
        // b's first step is a first step: it lands where a's first step did.
        let after_first = values(&a);
        optimizer.step(&grad_store(&[(&b, &GRADS[0])])).unwrap();
        assert_eq!(values(&b), after_first, "{config:?}");
        assert_eq!(values(&a), after_first, "{config:?}");
        assert_eq!(optimizer.state_bytes(), 2 * one, "{config:?}");
    }
}

#[test]
fn state_bytes_are_measured_from_the_buffers() {
    let n = 10_000;
    let small = 100;
    let params = || vec![Var::zeros(n, DType::F32, &Device::Cpu).unwrap(), Var::zeros(small, DType::F32, &Device::Cpu).unwrap()];
    let stepped = |config: OptimizerConfig| {
        let vars = params();
        let mut optimizer = config.build(vars.clone()).unwrap();
        assert_eq!(optimizer.state_bytes(), 0, "state is created on the first step");
        let ones_n = vec![1.0f32; n];
        let ones_small = vec![1.0f32; small];
        optimizer.step(&grad_store(&[(&vars[0], &ones_n), (&vars[1], &ones_small)])).unwrap();
        optimizer.state_bytes()
    };
    let total = n + small;
    assert_eq!(stepped(OptimizerConfig::for_kind(ledger::OptimizerKind::Sgd, 0.1)), 0);
    assert_eq!(stepped(OptimizerConfig::for_kind(ledger::OptimizerKind::SgdMomentum, 0.1)), 4 * total);
    let adam = stepped(OptimizerConfig::for_kind(ledger::OptimizerKind::Adam, 0.1));
    assert_eq!(adam, 8 * total);
    let amsgrad = stepped(OptimizerConfig::Adam(AdamConfig { amsgrad: true, ..AdamConfig::default() }));
    assert_eq!(amsgrad, 12 * total);
    // 8-bit: one byte per element of m and of v, one f32 absmax per 2048-value block
    // of each (10000 values: 5 blocks); the 100-element tensor keeps f32 moments.
    let eight_bit = stepped(OptimizerConfig::for_kind(ledger::OptimizerKind::Adam8bit, 0.1));
    assert_eq!(eight_bit, 2 * n + 2 * 5 * 4 + 8 * small);
    assert_eq!(eight_bit, 20_840);
    assert_eq!(adam, 80_800);
    // About a quarter of Adam's.
    let ratio = eight_bit as f64 / adam as f64;
    assert!((0.25..0.26).contains(&ratio), "{ratio}");
}

/// Deterministic values in [-1, 1) from a linear congruential generator.
fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn eight_bit_adam_tracks_adam_on_a_regression() {
    // y = X w*: 256 samples of 128 features into 64 outputs; w has 8192 weights (4 blocks).
    let device = Device::Cpu;
    let x = Tensor::from_vec(uniform(256 * 128, 1), (256, 128), &device).unwrap();
    let w_true = Tensor::from_vec(uniform(64 * 128, 2), (64, 128), &device).unwrap();
    let y = x.matmul(&w_true.t().unwrap()).unwrap();
    let loss_of = |w: &Var| -> Tensor {
        let pred = x.matmul(&w.as_tensor().t().unwrap()).unwrap();
        (pred - &y).unwrap().sqr().unwrap().mean_all().unwrap()
    };
    let train = |optimizer: &mut dyn Optimizer, w: &Var| -> Vec<f32> {
        (0..150)
            .map(|_| {
                let loss = loss_of(w);
                optimizer.step(&loss.backward().unwrap()).unwrap();
                loss.to_scalar::<f32>().unwrap()
            })
            .collect()
    };
    let w_adam = Var::zeros((64, 128), DType::F32, &device).unwrap();
    let w_8bit = Var::zeros((64, 128), DType::F32, &device).unwrap();
    let config = AdamConfig { lr: 0.02, ..AdamConfig::default() };
    let mut adam = Adam::new(vec![w_adam.clone()], config).unwrap();
    let mut eight = Adam8bit::new(vec![w_8bit.clone()], Adam8bitConfig { lr: 0.02, ..Adam8bitConfig::default() }).unwrap();
    let adam_losses = train(&mut adam, &w_adam);
    let eight_losses = train(&mut eight, &w_8bit);
    let first = adam_losses[0];
    let (adam_last, eight_last) = (adam_losses[149], eight_losses[149]);
    assert!(adam_last < first * 0.01, "Adam: {first} -> {adam_last}");
    // Along the way the two curves stay together.
    for (step, (a, e)) in adam_losses.iter().zip(&eight_losses).enumerate().step_by(10) {
        assert!((a - e).abs() <= 0.1 * a.max(first * 1e-3), "step {step}: Adam {a}, 8-bit {e}");
    }
    assert!(eight_last < 1.5 * adam_last, "8-bit Adam: {first} -> {eight_last}, Adam {adam_last}");
    let distance =
        (w_adam.as_tensor() - w_8bit.as_tensor()).unwrap().sqr().unwrap().sum_all().unwrap().sqrt().unwrap().to_scalar::<f32>().unwrap();
    let size = w_adam.as_tensor().sqr().unwrap().sum_all().unwrap().sqrt().unwrap().to_scalar::<f32>().unwrap();
    assert!(distance < 0.02 * size, "weights differ by {distance} (norm {size})");
}

#[test]
fn eight_bit_adam_without_quantisation_is_adamw() {
    // Every tensor below min_8bit_size keeps f32 moments: then it is AdamW exactly.
    let c = AdamConfig { lr: 0.1, weight_decay: 0.1, ..AdamConfig::default() };
    let expected = adam_reference(&c, true);
    let actual =
        trajectory(|v| Box::new(Adam8bit::new(v, Adam8bitConfig { lr: 0.1, weight_decay: 0.1, ..Adam8bitConfig::default() }).unwrap()));
    check_trajectory(actual, expected, "8-bit Adam with f32 moments");
}

#[test]
fn dynamic_maps_are_bitsandbytes_maps() {
    let signed = DynamicMap::signed();
    let unsigned = DynamicMap::unsigned();
    for map in [&signed, &unsigned] {
        let v = map.values();
        assert!(v.windows(2).all(|w| w[0] < w[1]), "sorted and distinct");
        assert_eq!(v[255], 1.0);
        // Every code decodes to a value that encodes back to it.
        for code in 0..=255u8 {
            assert_eq!(map.encode(map.decode(code)), code);
        }
    }
    // Signed: 127 magnitudes each side of 0; the most negative is -(1 - 0.9/64/2) ...
    assert_eq!(signed.values().iter().filter(|&&x| x < 0.0).count(), 127);
    assert!((signed.values()[0] + 0.992_968_75).abs() < 1e-6, "{}", signed.values()[0]);
    // ... and the smallest positive is 1e-6 x the mean of [0.1, 1].
    assert!((signed.values()[128] - 0.55e-6).abs() < 1e-12, "{}", signed.values()[128]);
    // Unsigned: 0, then 254 positive values from 1e-6 x 0.325 up.
    assert_eq!(unsigned.values()[0], 0.0);
    assert!((unsigned.values()[1] - 0.325e-6).abs() < 1e-12);
    assert!((unsigned.values()[254] - (1.0 - 0.9 / 256.0)).abs() < 1e-6);
    assert_eq!(signed.encode(-5.0), 0);
    assert_eq!(unsigned.encode(5.0), 255);
}

#[test]
fn encoding_finds_the_nearest_value() {
    for map in [DynamicMap::signed(), DynamicMap::unsigned()] {
        let nearest = |x: f32| map.values().iter().map(|&v| (x - v).abs()).fold(f32::INFINITY, f32::min);
        let probes = uniform(200_000, 3)
            .into_iter()
            .enumerate()
            // Spread over magnitudes from 1 down to 1e-9.
            .map(|(i, u)| u * 10f32.powi(-((i % 10) as i32)));
        let values = *map.values();
        let midpoints: Vec<f32> = values.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
        for x in probes.chain(values).chain(midpoints) {
            let code = map.encode(x);
            let distance = (x - map.decode(code)).abs();
            // Exactly halfway, either neighbour is nearest up to rounding.
            let tie = 1e-6 * x.abs();
            assert!(distance <= nearest(x) + tie, "x = {x}: code {code} is {distance} away, nearest {}", nearest(x));
        }
    }
}

#[test]
fn block_quantisation_keeps_values_within_half_a_code_gap() {
    let map = DynamicMap::signed();
    let values: Vec<f32> = (0..2048).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
    let mut codes = vec![0u8; values.len()];
    let absmax = map.quantize_block(&values, &mut codes);
    let largest = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert_eq!(absmax, largest);
    for (&v, &code) in values.iter().zip(&codes) {
        let decoded = map.decode(code) * absmax;
        // Near 1 the signed codes are 0.9/64 apart: half of that, scaled.
        assert!((decoded - v).abs() <= 0.9 / 128.0 * absmax + 1e-6, "{v} -> {decoded}");
    }
    let mut zero_codes = vec![0u8; 16];
    assert_eq!(map.quantize_block(&[0.0; 16], &mut zero_codes), 0.0);
    assert!(zero_codes.iter().all(|&c| map.decode(c) == 0.0));
}

#[test]
fn bad_hyperparameters_are_refused_by_name() {
    let nesterov = Sgd::new(vec![], SgdConfig { momentum: 0.9, dampening: 0.1, nesterov: true, ..SgdConfig::default() });
    let message = nesterov.err().unwrap().to_string();
    assert!(message.contains("Nesterov") && message.contains("dampening 0.1"), "{message}");

    let beta = Adam::new(vec![], AdamConfig { beta1: 1.0, ..AdamConfig::default() });
    let message = beta.err().unwrap().to_string();
    assert_eq!(message, "Adam: beta1 = 1 is invalid: it must be in [0, 1)");

    let lr = AdamW::new(vec![], AdamWConfig { lr: -0.1, ..AdamWConfig::default() });
    assert!(lr.err().unwrap().to_string().starts_with("AdamW: lr = -0.1"));

    let half = Var::zeros(8, DType::F16, &Device::Cpu).unwrap();
    let message = Adam8bit::new(vec![half], Adam8bitConfig::default()).err().unwrap().to_string();
    assert!(message.contains("parameter 0 (shape [8]) is F16"), "{message}");
}

#[test]
fn a_gradient_of_the_wrong_shape_is_an_error() {
    let p = var(&START);
    let mut sgd = Sgd::new(vec![p.clone()], SgdConfig::default()).unwrap();
    let mut grads = grad_store(&[(&p, &GRADS[0])]);
    grads.insert(&p, Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap());
    let message = sgd.step(&grads).err().unwrap().to_string();
    assert_eq!(message, "gradient of parameter 0 has shape [4], the parameter has [3]");
}

#[test]
fn configs_build_the_optimizer_they_name() {
    for kind in [
        ledger::OptimizerKind::Sgd,
        ledger::OptimizerKind::SgdMomentum,
        ledger::OptimizerKind::Adam,
        ledger::OptimizerKind::AdamW,
        ledger::OptimizerKind::Adam8bit,
    ] {
        let config = OptimizerConfig::for_kind(kind, 0.05);
        assert_eq!(config.kind(), kind);
        let optimizer = config.build(vec![var(&START)]).unwrap();
        assert_eq!(optimizer.learning_rate(), 0.05);
        assert_eq!(optimizer.vars().len(), 1);
        assert_eq!(optimizer.name(), kind.to_string().replace("SGD with momentum", "SGD"));
    }
}

#[test]
fn the_learning_rate_can_be_changed_between_steps() {
    let p = var(&[1.0]);
    let mut sgd = Sgd::new(vec![p.clone()], SgdConfig::default()).unwrap();
    sgd.set_learning_rate(0.5);
    assert_eq!(sgd.learning_rate(), 0.5);
    sgd.step(&grad_store(&[(&p, &[1.0])])).unwrap();
    assert_eq!(values(&p), [0.5]);
}

/// Produced with torch 2.15 (CPU, f32): a `Parameter` at START, then for each g in
/// GRADS `p.grad = torch.tensor(g); opt.step()`, then `p.tolist()`, for
/// `SGD(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)`,
/// `SGD(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)`,
/// `Adam(lr=0.1, weight_decay=0.1, amsgrad=True)` and `AdamW(lr=0.1, weight_decay=0.1)`.
const TORCH_SGD: [f64; 3] = [0.812084972858429, -1.8558995723724365, -0.030352585017681122];
const TORCH_NESTEROV: [f64; 3] = [0.6981891989707947, -1.863038182258606, -0.025717856362462044];
const TORCH_ADAM_AMSGRAD: [f64; 3] = [0.7815044522285461, -1.8440237045288086, 0.30047866702079773];
const TORCH_ADAMW: [f64; 3] = [0.7801105380058289, -1.8319604396820068, 0.29035547375679016];

#[test]
fn three_steps_land_where_torch_lands() {
    let sgd = SgdConfig { lr: 0.1, momentum: 0.9, dampening: 0.1, weight_decay: 0.01, ..SgdConfig::default() };
    let nesterov = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01, nesterov: true, ..SgdConfig::default() };
    let adam = AdamConfig { lr: 0.1, weight_decay: 0.1, amsgrad: true, ..AdamConfig::default() };
    let adamw = AdamWConfig { lr: 0.1, weight_decay: 0.1, ..AdamWConfig::default() };
    let cases: Vec<(OptimizerConfig, [f64; 3])> = vec![
        (OptimizerConfig::Sgd(sgd), TORCH_SGD),
        (OptimizerConfig::Sgd(nesterov), TORCH_NESTEROV),
        (OptimizerConfig::Adam(adam), TORCH_ADAM_AMSGRAD),
        (OptimizerConfig::AdamW(adamw), TORCH_ADAMW),
    ];
    for (config, expected) in cases {
        let last = trajectory(|v| config.build(v).unwrap()).pop().unwrap();
        // Within f32 rounding of the intermediates (torch's kernels fuse some
        // multiply-adds): the third weight cancels from 0.5 to about -0.03.
        for (a, e) in last.iter().zip(expected) {
            let error = (*a as f64 - e).abs() / e.abs().max(1.0);
            assert!(error < 1e-7, "{config:?}: {last:?} vs torch {expected:?} ({error:e})");
        }
    }
}
