//! Any candle model, measured: the bills extrapolated from small batches
//! against a step measured directly at the large one, with the allocation
//! counters installed in this test binary.

use std::sync::Mutex;

use vramlab::candle::{DType, Device, Module, ModuleT, Tensor};
use vramlab::candle_nn::{self, VarBuilder, VarMap};
use vramlab::ledger::OptimizerKind;
use vramlab::measured::{self, Forward, Measured, Scenario, MEASURED_BATCHES};
use vramlab::models::{ModelName, Network, Pass, Shape};

vramlab::install_allocation_counters!();

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn setup() -> std::sync::MutexGuard<'static, ()> {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(vramlab::memory::install);
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// ResNet-18 as a learner writes it with candle-nn (CIFAR's stem: a 3x3
/// convolution and no max-pool, whose 3x3 stride-2 window candle cannot
/// differentiate).
struct Block {
    conv1: candle_nn::Conv2d,
    bn1: candle_nn::BatchNorm,
    conv2: candle_nn::Conv2d,
    bn2: candle_nn::BatchNorm,
    shortcut: Option<(candle_nn::Conv2d, candle_nn::BatchNorm)>,
}

fn conv(cin: usize, cout: usize, k: usize, stride: usize, vb: VarBuilder) -> vramlab::candle::Result<candle_nn::Conv2d> {
    let config = candle_nn::Conv2dConfig { padding: k / 2, stride, ..Default::default() };
    candle_nn::conv2d_no_bias(cin, cout, k, config, vb)
}

impl Block {
    fn new(cin: usize, cout: usize, stride: usize, vb: VarBuilder) -> vramlab::candle::Result<Block> {
        let shortcut = if stride != 1 || cin != cout {
            Some((conv(cin, cout, 1, stride, vb.pp("down.0"))?, candle_nn::batch_norm(cout, 1e-5, vb.pp("down.1"))?))
        } else {
            None
        };
        Ok(Block {
            conv1: conv(cin, cout, 3, stride, vb.pp("conv1"))?,
            bn1: candle_nn::batch_norm(cout, 1e-5, vb.pp("bn1"))?,
            conv2: conv(cout, cout, 3, 1, vb.pp("conv2"))?,
            bn2: candle_nn::batch_norm(cout, 1e-5, vb.pp("bn2"))?,
            shortcut,
        })
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> vramlab::candle::Result<Tensor> {
        let y = self.bn1.forward_t(&self.conv1.forward(x)?, true)?.relu()?;
        let y = self.bn2.forward_t(&self.conv2.forward(&y)?, true)?;
        let shortcut = match &self.shortcut {
            Some((conv, bn)) => bn.forward_t(&conv.forward(x)?, true)?,
            None => x.clone(),
        };
        (y + shortcut)?.relu()
    }
}

struct ResNet18 {
    stem: candle_nn::Conv2d,
    bn: candle_nn::BatchNorm,
    blocks: Vec<Block>,
    fc: candle_nn::Linear,
}

impl ResNet18 {
    fn new(classes: usize, vb: VarBuilder) -> vramlab::candle::Result<ResNet18> {
        let mut blocks = Vec::new();
        let mut cin = 64;
        for (i, cout) in [64, 128, 256, 512].into_iter().enumerate() {
            let stride = if i == 0 { 1 } else { 2 };
            blocks.push(Block::new(cin, cout, stride, vb.pp(format!("layer{}.0", i + 1)))?);
            blocks.push(Block::new(cout, cout, 1, vb.pp(format!("layer{}.1", i + 1)))?);
            cin = cout;
        }
        Ok(ResNet18 {
            stem: conv(3, 64, 3, 1, vb.pp("conv1"))?,
            bn: candle_nn::batch_norm(64, 1e-5, vb.pp("bn1"))?,
            blocks,
            fc: candle_nn::linear(512, classes, vb.pp("fc"))?,
        })
    }
}

impl Module for ResNet18 {
    fn forward(&self, x: &Tensor) -> vramlab::candle::Result<Tensor> {
        let mut x = self.bn.forward_t(&self.stem.forward(x)?, true)?.relu()?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        self.fc.forward(&x.mean((2, 3))?)
    }
}

/// The peak extrapolated from the small batches against the peak of a step
/// measured at `batch`, in percent of the measured one.
fn extrapolation_error(forward: Forward<'_>, sample: &[usize], batch: usize) -> (Measured, f64) {
    let small = measured::measure(forward, sample, OptimizerKind::Adam).unwrap();
    let direct = measured::measure_at(forward, sample, OptimizerKind::Adam, &[batch]).unwrap();
    let extrapolated = small.peak_at(batch, Scenario::default()).bills.total();
    let measured = direct.peak_at(batch, Scenario::default()).bills.total();
    let error = (extrapolated as f64 - measured as f64) / measured as f64 * 100.0;
    println!("{sample:?} at batch {batch}: extrapolated {extrapolated} B, measured {measured} B, {error:+.2}%");
    (small, error)
}

#[test]
fn a_candle_nn_resnet18_extrapolates_within_5_percent_and_its_graph_is_what_the_counters_saw() {
    let _guard = setup();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = ResNet18::new(10, vb).unwrap();
    // candle-nn's batch-norm keeps its running statistics as variables too, updated by forward.
    let trained = || -> Vec<(String, vramlab::candle::Var)> {
        let mut vars: Vec<_> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .filter(|(name, _)| !name.contains("running_"))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars
    };
    let values = || -> Vec<Vec<f32>> { trained().iter().map(|(_, v)| v.flatten_all().unwrap().to_vec1().unwrap()).collect() };
    let weights = values();
    let forward = |x: &Tensor| model.forward(x);
    let (small, error) = extrapolation_error(&forward, &[3, 32, 32], 32);
    assert!(error.abs() <= 5.0, "{error:+.2}%");
    assert!(weights == values(), "the measured updates leave the weights as they were");
    for step in &small.steps {
        let (graph, counters) = (step.kept.held(), step.kept_by_counters);
        assert!(graph.abs_diff(counters) <= counters / 50 + (64 << 10), "batch {}: graph {graph} B, counters {counters} B", step.batch);
        assert!(step.kept.read() < graph, "candle's graph holds inputs of adds that backward does not read");
        assert!(step.kept.by_op.windows(2).all(|w| w[0].read >= w[1].read), "the largest readers first: {:?}", step.kept.by_op);
        // Batch-norm's first ops (a mean, a subtraction) do not read the convolution's output in backward.
        assert!(step.kept.by_op.iter().any(|k| k.op == "conv2d" && k.read == 0 && k.held > 0), "{:?}", step.kept.by_op);
    }
    assert_eq!(small.steps.iter().map(|s| s.batch).collect::<Vec<_>>(), MEASURED_BATCHES);
    assert_eq!(small.steps[0].parameters, 4 * trained().iter().map(|(_, v)| v.elem_count() as u64).sum::<u64>());
}

#[test]
fn zoo_networks_through_their_specs_extrapolate_within_5_percent() {
    let _guard = setup();
    for (model, res) in [(ModelName::Resnet18, 32), (ModelName::SmallCnn, 32)] {
        let net = Network::new(&model.spec(10), Shape::map(3, res, res), &Device::Cpu, 0).unwrap();
        // Batch-norm's running statistics stay as they were: the steps measure, they do not train.
        let pass = Pass { update_stats: false, ..Pass::train(DType::F32) };
        let forward = |x: &Tensor| net.forward(x, pass);
        let (_, error) = extrapolation_error(&forward, &[3, res, res], 32);
        assert!(error.abs() <= 5.0, "{model}: {error:+.2}%");
    }
}

#[test]
fn an_mlp_closure_is_measured_and_a_bad_input_names_the_problem() {
    let _guard = setup();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let (l1, l2) = (candle_nn::linear(784, 256, vb.pp("l1")).unwrap(), candle_nn::linear(256, 10, vb.pp("l2")).unwrap());
    let forward = |x: &Tensor| l2.forward(&l1.forward(x)?.relu()?);
    let (small, error) = extrapolation_error(&forward, &[784], 64);
    assert!(error.abs() <= 5.0, "{error:+.2}%");
    assert_eq!(small.loss, measured::Loss::CrossEntropy { classes: 10 });
    let wrong_rank = measured::measure(&forward, &[3, 28, 28], OptimizerKind::Adam).unwrap_err().to_string();
    assert!(wrong_rank.starts_with("the model's forward failed on a batch of shape 2x3x28x28: "), "{wrong_rank}");
    assert_eq!(wrong_rank.lines().count(), 1, "{wrong_rank}");
    let panics = |_: &Tensor| -> vramlab::candle::Result<Tensor> { panic!("not this input") };
    let panicked = measured::measure(&panics, &[784], OptimizerKind::Adam).unwrap_err().to_string();
    assert!(panicked.contains("it panicked: not this input"), "{panicked}");
    let absurd = measured::measure(&forward, &[100_000, 100_000], OptimizerKind::Adam).unwrap_err().to_string();
    assert!(absurd.starts_with("a step at batch 8 (its batch alone 298 GiB) needs about") && absurd.contains("more than the"), "{absurd}");
}
