//! Our networks against torchvision's on the same weights: the state dict
//! `scripts/torchvision_reference.py` gave torchvision's network is built
//! here from the same integer hash, written to a safetensors file under
//! torchvision's names and loaded. The script recorded torchvision's answer
//! in float64 (`fixtures/torchvision/MODEL.json`): the logits in evaluation
//! and training mode, the loss and every parameter's gradient. Our float32
//! step, in the plain layers and the lean ones, must be as close to it as
//! torchvision's own float32 step is (within 4x its error, which the script
//! also recorded), or within 1e-5 of the logits and 1e-4 of each gradient
//! where torchvision's error is smaller than that. The U-Net's reference is
//! `scripts/unet_twin.py`, its PyTorch twin, with per-pixel labels.

use std::path::Path;

use serde::Deserialize;
use vramlab::candle::{DType, Device, Tensor};
use vramlab::models::{Layers, ModelName, Network, Op, Pass, Shape};

#[derive(Deserialize)]
struct Reference {
    batch: usize,
    res: usize,
    classes: usize,
    labels: Vec<u32>,
    /// A segmentation network's labels are a map per sample (`batch x H x W`).
    labels_shape: Option<Vec<usize>>,
    /// Where the logits are a map, each sample's row holds every
    /// `logits_stride`-th of its values, and the norms each sample's whole.
    logits_stride: Option<usize>,
    eval_logits_norms: Option<Vec<f64>>,
    train_logits_norms: Option<Vec<f64>>,
    state_dict: Vec<Entry>,
    eval_logits: Vec<Vec<f64>>,
    train_logits: Vec<Vec<f64>>,
    loss: f64,
    gradient_floor: f64,
    torch_f32: TorchF32,
    grads: Vec<Grad>,
}

/// How far torchvision's float32 step is from its float64 one.
#[derive(Deserialize)]
struct TorchF32 {
    logits_error: f64,
    worst_gradient_error: f64,
    worst_gradient: String,
}

#[derive(Deserialize)]
struct Entry {
    name: String,
    shape: Vec<usize>,
    sum: f64,
}

#[derive(Deserialize)]
struct Grad {
    name: String,
    norm: f64,
    stride: usize,
    samples: Vec<f64>,
}

fn fnv1a(name: &str) -> u64 {
    name.bytes().fold(0x811C_9DC5u64, |h, byte| ((h ^ u64::from(byte)) * 0x0100_0193) & 0xFFFF_FFFF)
}

/// `count` values in [-1, 1) from `name`, as the script computes them.
fn pattern(name: &str, count: usize) -> impl Iterator<Item = f64> {
    let seed = fnv1a(name);
    (0..count as u64).map(move |i| {
        let mut h = (i.wrapping_mul(2_654_435_761).wrapping_add(seed)) & 0xFFFF_FFFF;
        h ^= h >> 16;
        h = (h * 0x045D_9F3B) & 0xFFFF_FFFF;
        h ^= h >> 16;
        h as f64 / 4_294_967_296.0 * 2.0 - 1.0
    })
}

fn entry(name: &str, shape: &[usize]) -> Tensor {
    let count = shape.iter().product();
    if name.ends_with("num_batches_tracked") {
        return Tensor::zeros(shape, DType::I64, &Device::Cpu).unwrap();
    }
    let fan_in: usize = shape.iter().skip(1).product();
    let scale = |u: f64| -> f64 {
        if name.ends_with("running_var") {
            1.0 + 0.25 * (u + 1.0)
        } else if name.ends_with("running_mean") {
            0.1 * u
        } else if shape.len() >= 2 {
            u * (3.0 / fan_in as f64).sqrt()
        } else if name.ends_with("weight") {
            1.0 + 0.2 * u
        } else {
            0.1 * u
        }
    };
    let values: Vec<f32> = pattern(name, count).map(|u| scale(u) as f32).collect();
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
}

fn reference(model: &str) -> Reference {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torchvision").join(format!("{model}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn sum(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
}

/// The largest difference from `expected`, relative to its largest magnitude.
fn relative_error(found: &[f64], expected: &[f64]) -> f64 {
    assert_eq!(found.len(), expected.len());
    let scale = expected.iter().fold(0f64, |m, v| m.max(v.abs())).max(f64::MIN_POSITIVE);
    found.iter().zip(expected).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / scale
}

fn flat(rows: &[Vec<f64>]) -> Vec<f64> {
    rows.iter().flatten().copied().collect()
}

/// Builds `model` with `layers`, loads torchvision's state dict through
/// safetensors and compares everything the script recorded.
fn compare(model: ModelName, torchvision: &str, layers: Layers) {
    let r = reference(torchvision);
    let device = Device::Cpu;
    let input = Shape::map(3, r.res, r.res);
    // The script sets dropout to 0 in torchvision's network, so training is deterministic.
    let mut spec = model.spec(r.classes);
    for layer in spec.stages.iter_mut().flat_map(|stage| stage.layers.iter_mut()) {
        if let Op::Dropout { p } = &mut layer.op {
            *p = 0.0;
        }
    }
    let net = Network::with_layers(&spec, input, &device, 0, layers).unwrap();
    assert_eq!(net.layers(), layers, "the CPU runs both kinds of layers");

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{torchvision}.safetensors"));
    let state: std::collections::HashMap<String, Tensor> =
        r.state_dict.iter().map(|e| (e.name.clone(), entry(&e.name, &e.shape))).collect();
    for e in &r.state_dict {
        let built = sum(&state[&e.name]);
        assert!((built - e.sum).abs() <= 1e-9 * e.sum.abs().max(1.0), "{}: built {built}, torchvision {}", e.name, e.sum);
    }
    vramlab::candle::safetensors::save(&state, &path).unwrap();
    net.load(&path).unwrap();

    let count = r.batch * 3 * r.res * r.res;
    let x: Vec<f32> = pattern("input", count).map(|u| u as f32).collect();
    let x = Tensor::from_vec(x, (r.batch, 3, r.res, r.res), &device).unwrap();
    let labels_shape = r.labels_shape.clone().unwrap_or(vec![r.batch]);
    let labels = Tensor::from_vec(r.labels.clone(), labels_shape, &device).unwrap();

    let values = |t: &Tensor| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let eval_logits = net.forward(&x, Pass::eval(DType::F32)).unwrap();
    let logits = net.forward(&x, Pass::train(DType::F32)).unwrap();
    let loss = vramlab::train::cross_entropy(&logits, &labels).unwrap();
    let found_loss = loss.to_scalar::<f32>().unwrap() as f64;
    let grads = loss.backward().unwrap();

    let stride = r.logits_stride.unwrap_or(1);
    let sampled = |t: &Tensor| -> (Vec<f64>, Vec<f64>) {
        let rows = t.flatten_from(1).unwrap();
        let (samples, norms) =
            (0..r.batch).map(|n| values(&rows.get(n).unwrap())).fold((Vec::new(), Vec::new()), |(mut s, mut norms), row| {
                norms.push(row.iter().map(|v| v * v).sum::<f64>().sqrt());
                s.extend(row.iter().step_by(stride).copied());
                (s, norms)
            });
        (samples, norms)
    };
    let ((eval, eval_norms), (train, train_norms)) = (sampled(&eval_logits), sampled(&logits));
    let mut logits_error = relative_error(&eval, &flat(&r.eval_logits)).max(relative_error(&train, &flat(&r.train_logits)));
    for (found, expected) in [(eval_norms, &r.eval_logits_norms), (train_norms, &r.train_logits_norms)] {
        if let Some(expected) = expected {
            logits_error = logits_error.max(relative_error(&found, expected));
        }
    }
    let logits_bound = (4.0 * r.torch_f32.logits_error).max(1e-5);
    assert!(
        logits_error <= logits_bound,
        "{torchvision} {layers:?}: logits differ by {logits_error:e} of their largest (torchvision's float32: {:e})",
        r.torch_f32.logits_error
    );
    assert!((found_loss - r.loss).abs() <= logits_bound * r.loss.abs(), "{torchvision}: loss {found_loss} against {}", r.loss);

    let ours: std::collections::HashMap<String, &vramlab::models::Named> = {
        let names = vramlab::models::torchvision_names(net.params().iter().map(|p| p.name.as_str()));
        names.into_iter().zip(net.params()).collect()
    };
    assert_eq!(ours.len(), r.grads.len(), "{torchvision}: parameters");
    let mut worst = (0f64, String::new());
    for g in &r.grads {
        let param = ours.get(&g.name).unwrap_or_else(|| panic!("{torchvision}: no parameter `{}`", g.name));
        let grad = values(grads.get(param.var.as_tensor()).unwrap_or_else(|| panic!("no gradient for `{}`", g.name)));
        let norm = grad.iter().map(|v| v * v).sum::<f64>().sqrt();
        let samples: Vec<f64> = grad.iter().step_by(g.stride).take(g.samples.len()).copied().collect();
        // The norm and the samples, over the gradient's norm (or the floor,
        // for gradients that are exactly zero but for rounding).
        let largest = samples.iter().zip(&g.samples).fold((norm - g.norm).abs(), |m, (a, b)| m.max((a - b).abs()));
        let error = largest / g.norm.max(r.gradient_floor);
        if error > worst.0 {
            worst = (error, g.name.clone());
        }
    }
    let (torch_worst, torch_name) = (r.torch_f32.worst_gradient_error, &r.torch_f32.worst_gradient);
    assert!(
        worst.0 <= (4.0 * torch_worst).max(1e-4),
        "{torchvision} {layers:?}: the gradient of `{}` differs by {:e} of its norm (torchvision's float32: {torch_worst:e}, `{torch_name}`)",
        worst.1,
        worst.0
    );
    eprintln!(
        "{torchvision} {layers:?}: logits {logits_error:.1e}, worst gradient {:.1e} (`{}`); torchvision's float32 {:.1e} and {torch_worst:.1e} (`{torch_name}`)",
        worst.0, worst.1, r.torch_f32.logits_error
    );
}

#[test]
fn resnet18_computes_what_torchvision_computes() {
    for layers in [Layers::Plain, Layers::Lean] {
        compare(ModelName::Resnet18, "resnet18", layers);
    }
}

#[test]
fn resnet50_computes_what_torchvision_computes() {
    for layers in [Layers::Plain, Layers::Lean] {
        compare(ModelName::Resnet50, "resnet50", layers);
    }
}

#[test]
fn efficientnet_b0_computes_what_torchvision_computes() {
    for layers in [Layers::Plain, Layers::Lean] {
        compare(ModelName::EfficientnetB0, "efficientnet_b0", layers);
    }
}

#[test]
fn vit_tiny_computes_what_torchvision_computes() {
    for layers in [Layers::Plain, Layers::Lean] {
        compare(ModelName::VitTiny, "vit_tiny", layers);
    }
}

#[test]
fn unet_computes_what_its_pytorch_twin_computes() {
    for layers in [Layers::Plain, Layers::Lean] {
        compare(ModelName::Unet, "unet", layers);
    }
}
