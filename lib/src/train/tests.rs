use candle_core::{DType, Device, Tensor};

use super::*;
use crate::ledger::{self, Checkpointing, StepPlan};
use crate::models::{Conv2d, Layer, ModelName, ModelSpec, Network, Op, Pass, Shape, Stage};
use crate::render::Render;

fn net(name: ModelName, classes: usize, res: usize) -> Network {
    Network::new(&name.spec(classes), Shape::map(3, res, res), &Device::Cpu, 3).unwrap()
}

fn max_relative_error(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let diff = (&a - &b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
    let scale = b.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
    diff / scale.max(1e-12)
}

fn assert_same_grads(net: &Network, a: &Gradients, b: &Gradients, tolerance: f64) {
    for named in net.params() {
        let ga = a.grads.get(named.var.as_tensor()).unwrap_or_else(|| panic!("{}: no grad", named.name));
        let gb = b.grads.get(named.var.as_tensor()).unwrap_or_else(|| panic!("{}: no grad", named.name));
        let err = max_relative_error(ga, gb);
        assert!(err < tolerance, "{}: relative error {err:e}", named.name);
    }
}

fn buffers(net: &Network) -> Vec<Vec<f32>> {
    net.buffers().iter().filter(|b| b.var.dtype() == DType::F32).map(|b| b.var.to_vec1::<f32>().unwrap()).collect()
}

#[test]
fn checkpointed_gradients_equal_plain_gradients() {
    for (name, res, policy) in [
        (ModelName::SmallCnn, 16, Checkpointing::Stages),
        (ModelName::Resnet18, 32, Checkpointing::Stages),
        (ModelName::Resnet18, 32, Checkpointing::Segments(vec!["layer2".into(), "layer3".into()])),
        (ModelName::EfficientnetB0, 32, Checkpointing::Segments(vec!["stem".into(), "stage4".into()])),
    ] {
        let plain_net = net(name, 5, res);
        let ckpt_net = net(name, 5, res);
        let (x, y) = Stripes::new(5, res).generate(4, 1, &Device::Cpu).unwrap();
        let pass = Pass::train(DType::F32);
        let plain = forward_backward(&plain_net, &x, &y, pass, &plan(&plain_net, &Checkpointing::None), 1.0).unwrap();
        let plan = plan(&ckpt_net, &policy);
        let ckpt = forward_backward(&ckpt_net, &x, &y, pass, &plan, 1.0).unwrap();
        assert_eq!(plain.loss.to_scalar::<f32>().unwrap(), ckpt.loss.to_scalar::<f32>().unwrap(), "{}", name.as_str());
        assert_same_grads(&plain_net, &plain, &ckpt_with(&plain_net, &ckpt_net, &ckpt), 1e-5);
        assert_eq!(buffers(&plain_net), buffers(&ckpt_net), "{}: running statistics move once", name.as_str());
    }
}

fn plan(net: &Network, checkpointing: &Checkpointing) -> StepPlan {
    StepPlan::training(&net.stage_names(), checkpointing, 1, ledger::OptimizerKind::Sgd).unwrap()
}

/// Re-keys `ckpt`'s gradients (of `from`'s parameters) to `to`'s parameters, by name.
fn ckpt_with(to: &Network, from: &Network, ckpt: &Gradients) -> Gradients {
    let mut grads = candle_core::backprop::GradStore::default();
    for (a, b) in to.params().iter().zip(from.params()) {
        assert_eq!(a.name, b.name);
        if let Some(g) = ckpt.grads.get(b.var.as_tensor()) {
            grads.insert(a.var.as_tensor(), g.clone());
        }
    }
    Gradients { loss: ckpt.loss.clone(), correct: ckpt.correct.clone(), samples: ckpt.samples, labels: ckpt.labels, grads }
}

#[test]
fn an_unknown_stage_is_named_with_the_valid_ones() {
    let net = net(ModelName::Resnet18, 5, 32);
    let err =
        StepPlan::training(&net.stage_names(), &Checkpointing::Segments(vec!["layer9".into()]), 1, ledger::OptimizerKind::Sgd).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("layer9") && text.contains("layer4"), "{text}");
}

fn batch_norm_free() -> ModelSpec {
    let conv = |out| Op::Conv2d(Conv2d { bias: true, ..Conv2d::new(out, 3, 1, 1) });
    ModelSpec {
        name: "conv-relu".into(),
        num_classes: 3,
        stages: vec![
            Stage {
                name: "features".into(),
                layers: vec![
                    Layer::new("conv1", conv(8)),
                    Layer::new("relu1", Op::Relu),
                    Layer::new("pool", Op::MaxPool2d { kernel: 3, stride: 2, padding: 1 }),
                    Layer::new("conv2", conv(16)),
                    Layer::new("relu2", Op::Relu),
                ],
            },
            Stage {
                name: "head".into(),
                layers: vec![
                    Layer::new("avgpool", Op::GlobalAvgPool),
                    Layer::new("flatten", Op::Flatten),
                    Layer::new("fc", Op::Linear { out_features: 3, bias: true }),
                ],
            },
        ],
    }
}

#[test]
fn accumulated_micro_batches_equal_one_large_batch() {
    let net = Network::new(&batch_norm_free(), Shape::map(3, 12, 12), &Device::Cpu, 5).unwrap();
    let (x, y) = Stripes::new(3, 12).generate(12, 2, &Device::Cpu).unwrap();
    let pass = Pass::train(DType::F32);
    let plan = plan(&net, &Checkpointing::None);
    let whole = forward_backward(&net, &x, &y, pass, &plan, 1.0).unwrap();
    let n = 4;
    let mut acc = candle_core::backprop::GradStore::default();
    for i in 0..n {
        let xs = x.narrow(0, i * 3, 3).unwrap();
        let ys = y.narrow(0, i * 3, 3).unwrap();
        let part = forward_backward(&net, &xs, &ys, pass, &plan, 1.0 / n as f64).unwrap();
        accumulate(&mut acc, &net, part.grads).unwrap();
    }
    let summed = Gradients { loss: whole.loss.clone(), correct: whole.correct.clone(), samples: 12, labels: 12, grads: acc };
    assert_same_grads(&net, &summed, &whole, 1e-5);
}

#[test]
fn mixed_precision_gradients_reach_the_f32_master_weights() {
    let net = net(ModelName::SmallCnn, 4, 16);
    let (x, y) = Stripes::new(4, 16).generate(4, 3, &Device::Cpu).unwrap();
    let out = forward_backward(&net, &x, &y, Pass::train(DType::F16), &plan(&net, &Checkpointing::None), 1024.0).unwrap();
    for named in net.params() {
        let g = out.grads.get(named.var.as_tensor()).unwrap();
        assert_eq!(g.dtype(), DType::F32, "{}", named.name);
    }
    assert!(out.loss.to_scalar::<f32>().unwrap().is_finite());
}

fn train_stripes(precision: crate::models::Precision) -> (f64, Trainer) {
    let device = Device::Cpu;
    let task = Stripes::new(4, 16);
    let (x, y) = task.generate(384, 11, &device).unwrap();
    let (vx, vy) = task.generate(256, 12, &device).unwrap();
    let net = Network::new(&ModelName::SmallCnn.spec(4), Shape::map(3, 16, 16), &device, 1).unwrap();
    let config =
        TrainConfig { precision, optimizer: OptimizerConfig::for_kind(crate::ledger::OptimizerKind::Adam, 3e-3), ..TrainConfig::default() };
    let mut trainer = Trainer::new(net, config).unwrap();
    let mut train = InMemory::new(x, y, 32).shuffled(5);
    let mut val = InMemory::new(vx, vy, 128);
    trainer.fit(&mut train, Some(&mut val), 3, &mut |_| {}).unwrap();
    let accuracy = trainer.history().final_accuracy().unwrap();
    (accuracy, trainer)
}

#[test]
fn mixed_precision_training_reaches_the_f32_accuracy() {
    let (f32_accuracy, _) = train_stripes(crate::models::Precision::F32);
    let (f16_accuracy, trainer) = train_stripes(crate::models::Precision::F16Amp);
    assert!(f32_accuracy > 0.9, "the task is learnable: f32 reached {f32_accuracy}");
    assert!((f32_accuracy - f16_accuracy).abs() <= 0.02, "f32 {f32_accuracy} vs f16 {f16_accuracy}");
    let scales: Vec<f64> = trainer.history().steps().filter_map(|s| s.loss_scale).collect();
    assert_eq!(scales.len(), 36);
}

/// The report's applied norm is read off the clipped gradients, not derived
/// from the limit: under it when clipping engages, the norm itself when not.
#[test]
fn a_clipped_step_reports_the_norm_it_applied() {
    let (x, y) = Stripes::new(4, 16).generate(8, 3, &Device::Cpu).unwrap();
    for (max_norm, engages) in [(1e-3, true), (1e6, false)] {
        let mut trainer =
            Trainer::new(net(ModelName::SmallCnn, 4, 16), TrainConfig { clip_norm: Some(max_norm), ..TrainConfig::default() }).unwrap();
        let report = trainer.step(&[(x.clone(), y.clone())], 0).unwrap();
        let (before, applied) = (report.grad_norm.unwrap(), report.applied_grad_norm.unwrap());
        if engages {
            assert!(before > max_norm && (applied - max_norm).abs() < max_norm * 1e-3, "{before} clipped to {applied}");
        } else {
            assert!((applied - before).abs() < before * 1e-6, "{before} left alone, applied {applied}");
        }
    }
    let mut unclipped = Trainer::new(net(ModelName::SmallCnn, 4, 16), TrainConfig::default()).unwrap();
    let report = unclipped.step(&[(x, y)], 0).unwrap();
    assert_eq!((report.grad_norm, report.applied_grad_norm), (None, None));
}

#[test]
fn bf16_on_the_cpu_is_refused_before_any_step() {
    let net = net(ModelName::SmallCnn, 4, 16);
    let config = TrainConfig { precision: crate::models::Precision::Bf16Amp, ..TrainConfig::default() };
    let err = Trainer::new(net, config).unwrap_err().to_string();
    assert!(err.contains("bf16") && err.contains("f16 mixed precision"), "{err}");
}

#[test]
fn a_step_wants_as_many_micro_batches_as_the_accumulation() {
    let net = net(ModelName::SmallCnn, 4, 16);
    let config = TrainConfig { accumulation: 2, ..TrainConfig::default() };
    let mut trainer = Trainer::new(net, config).unwrap();
    let batch = Stripes::new(4, 16).generate(4, 1, &Device::Cpu).unwrap();
    let err = trainer.step(&[batch], 0).unwrap_err().to_string();
    assert!(err.contains("needs 2 micro-batches"), "{err}");
}

/// A source that counts the batches it has handed out.
struct Counting {
    inner: InMemory,
    produced: std::rc::Rc<std::cell::Cell<usize>>,
}

impl BatchSource for Counting {
    fn batches_per_epoch(&self) -> usize {
        self.inner.batches_per_epoch()
    }

    fn epoch(&mut self, epoch: usize) -> Box<dyn Iterator<Item = candle_core::Result<(Tensor, Tensor)>> + '_> {
        let produced = self.produced.clone();
        Box::new(self.inner.epoch(epoch).inspect(move |_| produced.set(produced.get() + 1)))
    }
}

#[test]
fn fit_takes_batches_as_it_trains_not_a_whole_epoch_first() {
    let (x, y) = Stripes::new(4, 16).generate(96, 3, &Device::Cpu).unwrap();
    let produced = std::rc::Rc::new(std::cell::Cell::new(0));
    let mut source = Counting { inner: InMemory::new(x, y, 16), produced: produced.clone() };
    let config = TrainConfig { accumulation: 2, ..TrainConfig::default() };
    let mut trainer = Trainer::new(net(ModelName::SmallCnn, 4, 16), config).unwrap();
    let mut seen = Vec::new();
    trainer
        .fit(&mut source, None, 1, &mut |event| {
            if let TrainEvent::Step(step) = event {
                seen.push((step.step, produced.get()));
            }
        })
        .unwrap();
    // Each optimizer step has taken exactly its two micro-batches, no more.
    assert_eq!(seen, vec![(1, 2), (2, 4), (3, 6)]);
}

#[test]
fn a_step_runs_every_phase_the_ledger_predicts_in_its_order() {
    for (accumulation, checkpointing) in
        [(1, Checkpointing::None), (2, Checkpointing::Stages), (3, Checkpointing::Segments(vec!["layer2".into()]))]
    {
        let net = net(ModelName::Resnet18, 4, 32);
        let config = TrainConfig { accumulation, checkpointing: checkpointing.clone(), ..TrainConfig::default() };
        let mut trainer = Trainer::new(net, config).unwrap();
        let micro_batches: Vec<_> =
            (0..accumulation).map(|seed| Stripes::new(4, 32).generate(2, seed as u64, &Device::Cpu).unwrap()).collect();
        let mut ran = Vec::new();
        trainer.step_watched(&micro_batches, 0, &mut [&mut |phase, _| ran.push(phase)]).unwrap();
        let predicted: Vec<_> = trainer.predict(2).unwrap().timeline.iter().map(|p| p.phase).collect();
        assert_eq!(predicted[0], ledger::StepPhase::Loaded);
        assert_eq!(ran, predicted[1..], "accumulation {accumulation}, checkpointing {checkpointing}");
    }
}

#[test]
fn live_curves_follow_a_run_step_by_step_and_epoch_by_epoch() {
    let task = Stripes::new(4, 16);
    let (x, y) = task.generate(64, 3, &Device::Cpu).unwrap();
    let (vx, vy) = task.generate(32, 4, &Device::Cpu).unwrap();
    let mut trainer = Trainer::new(net(ModelName::SmallCnn, 4, 16), TrainConfig::default()).unwrap();
    let mut curves = LiveCurves::new("stripes").reference("chance", 0.25);
    let history = trainer
        .fit(&mut InMemory::new(x, y, 16), Some(&mut InMemory::new(vx, vy, 32)), 2, &mut |event| curves.on_event(event))
        .unwrap()
        .clone();
    let losses: Vec<(f64, f64)> = history.steps().map(|s| (s.step as f64, s.loss as f64)).collect();
    assert_eq!(losses.len(), 8);
    let described = curves.loss_chart().bundle().text().to_owned();
    for (step, loss) in &losses {
        assert!(described.contains(&format!("({step}, {loss})")), "step {step} missing from {described}");
    }
    let accuracy = curves.accuracy_chart().bundle().text().to_owned();
    let val: Vec<f64> = history.evals().map(|e| 100.0 * e.accuracy).collect();
    assert!(accuracy.contains(&format!("validation: (1, {}) (2, {})", val[0], val[1])), "{accuracy}");
    assert!(accuracy.contains("chance: (0, 25)"), "{accuracy}");
    let shown = curves.bundle();
    assert!(shown.text().starts_with("stripes: 2 epochs, 8 steps"), "{}", shown.text());
    assert_eq!(shown.get("text/html").and_then(|h| h.as_str()).map(|h| h.matches("<svg").count()), Some(2));
}

#[test]
fn segmentation_cross_entropy_is_the_mean_over_every_pixel() {
    let device = Device::Cpu;
    let logits = Tensor::new(&[[[[2.0f32, -1.0], [0.5, 0.0]], [[0.0, 1.0], [0.5, 3.0]]]], &device).unwrap();
    let labels = Tensor::new(&[[[0u32, 1], [1, 0]]], &device).unwrap();
    let loss = cross_entropy(&logits, &labels).unwrap().to_scalar::<f32>().unwrap();
    let pixel = |right: f32, wrong: f32| -(right - (right.exp() + wrong.exp()).ln());
    let expected = (pixel(2.0, 0.0) + pixel(1.0, -1.0) + pixel(0.5, 0.5) + pixel(0.0, 3.0)) / 4.0;
    assert!((loss - expected).abs() < 1e-6, "{loss} vs {expected}");
    let err = cross_entropy(&logits, &Tensor::new(&[0u32], &device).unwrap()).unwrap_err().to_string();
    assert!(err.contains("logits [1, 2, 2, 2] need labels [1, 2, 2] (one per pixel), got [1]"), "{err}");
}

/// The U-Net learns the striped bands of the segmentation task from a few
/// hundred small images: each class's IoU far above what labelling every
/// pixel with one class gives (its share of the pixels, about a half).
#[test]
fn a_unet_learns_to_segment_the_striped_bands() {
    let device = Device::Cpu;
    let task = Stripes::new(2, 32);
    let (x, y) = task.generate_regions(256, 21, &device).unwrap();
    let (vx, vy) = task.generate_regions(64, 22, &device).unwrap();
    let net = Network::new(&ModelName::Unet.spec(2), Shape::map(3, 32, 32), &device, 3).unwrap();
    let config = TrainConfig { optimizer: OptimizerConfig::for_kind(crate::ledger::OptimizerKind::Adam, 3e-3), ..TrainConfig::default() };
    let mut trainer = Trainer::new(net, config).unwrap();
    let mut train = InMemory::new(x, y, 16).shuffled(5);
    let mut val = InMemory::new(vx, vy.clone(), 64);
    trainer.fit(&mut train, Some(&mut val), 3, &mut |_| {}).unwrap();
    let eval = trainer.history().evals().last().unwrap().clone();
    let share = vy.to_dtype(DType::F32).unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap() as f64;
    let trivial = share.max(1.0 - share);
    assert!(eval.iou.iter().all(|iou| iou.unwrap() > trivial + 0.2), "IoU {:?}, one class for every pixel {trivial:.3}", eval.iou);
    assert!(eval.accuracy > 0.9, "pixel accuracy {}", eval.accuracy);
    assert_eq!(eval.samples, 64);
    let ones = vy.sum_all().unwrap().to_scalar::<u32>().unwrap() as u64;
    assert_eq!(eval.labelled, [64 * 32 * 32 - ones, ones], "the pixels each class labels");
}

/// Two threads as two processes: each puts its part in its slot, and both
/// read both once both are there.
struct Threads {
    rank: usize,
    exchange: std::sync::Arc<(std::sync::Barrier, std::sync::Mutex<[Vec<u8>; 2]>)>,
}

impl Threads {
    fn exchange(&self, mine: Vec<u8>) -> [Vec<u8>; 2] {
        let (barrier, slots) = &*self.exchange;
        slots.lock().unwrap()[self.rank] = mine;
        barrier.wait();
        let both = slots.lock().unwrap().clone();
        barrier.wait();
        both
    }
}

impl crate::dist::Collective for Threads {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        2
    }

    fn all_reduce_sum(&self, bucket: &Tensor) -> Result<Tensor, crate::dist::DistError> {
        let mine = bucket.to_vec1::<f32>()?.iter().flat_map(|v| v.to_le_bytes()).collect();
        let [a, b] = self.exchange(mine);
        let value = |bytes: &[u8]| f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let sum: Vec<f32> = a.chunks(4).zip(b.chunks(4)).map(|(a, b)| value(a) + value(b)).collect();
        Ok(Tensor::new(sum, &Device::Cpu)?)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, crate::dist::DistError> {
        Ok(self.exchange(bytes.to_vec()).into())
    }
}

/// A process's weights and running statistics, each flattened.
type Held = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Each of two threads trains `steps` on its own images, spread over both
/// with `cards`; what each holds after.
fn two_threads(cards: ledger::Cards, config: &TrainConfig, steps: usize) -> Vec<Held> {
    let exchange = std::sync::Arc::new((std::sync::Barrier::new(2), std::sync::Mutex::new([Vec::new(), Vec::new()])));
    std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let exchange = std::sync::Arc::clone(&exchange);
                // Each in a pool of its own, as each process has: in a shared pool a
                // thread waiting inside one step's parallel op could take up the
                // other step, and wait for the exchange with a step it holds up.
                let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
                scope.spawn(move || {
                    pool.install(|| {
                        let collective = Box::new(Threads { rank, exchange });
                        let mut trainer = Trainer::spread_over(net(ModelName::SmallCnn, 4, 16), config.clone(), cards, collective).unwrap();
                        for step in 0..steps {
                            let batch = Stripes::new(4, 16).generate(4, (10 * step + rank) as u64, &Device::Cpu).unwrap();
                            trainer.step(&[batch], 0).unwrap();
                        }
                        let weights =
                            trainer.net().params().iter().map(|p| p.var.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
                        (weights, buffers(trainer.net()))
                    })
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

#[test]
fn spread_processes_keep_the_same_weights_and_running_statistics() {
    let cards = ledger::Cards { count: 2, ..ledger::Cards::default() };
    // Each process's batch-norm normalises by its own batch; both then take rank 0's running statistics.
    let own = two_threads(cards, &TrainConfig::default(), 2);
    assert_eq!(own[0], own[1]);
    // Synchronised, the statistics are the two batches' together, and differ from each process's own.
    let synchronised = two_threads(ledger::Cards { sync_batch_norm: true, ..cards }, &TrainConfig::default(), 2);
    assert_eq!(synchronised[0], synchronised[1]);
    assert_ne!(synchronised[0].1, own[0].1);
}

/// ZeRO-2 divides each stage's gradients among the processes as its
/// backward ends, so clipping takes its norm over every process's part:
/// the step is DDP's, where every process holds every gradient.
#[test]
fn zero2_clips_by_the_norm_of_every_process_part() {
    let config = TrainConfig { clip_norm: Some(0.05), ..TrainConfig::default() };
    let cards = |shard| ledger::Cards { count: 2, shard, bucket_bytes: 4 << 10, ..ledger::Cards::default() };
    let ddp = two_threads(cards(ledger::Shard::None), &config, 2);
    let zero2 = two_threads(cards(ledger::Shard::Gradients), &config, 2);
    assert_eq!(zero2[0].0, zero2[1].0);
    let unclipped = two_threads(cards(ledger::Shard::None), &TrainConfig::default(), 2);
    let largest =
        |a: &Held, b: &Held| a.0.iter().zip(&b.0).flat_map(|(a, b)| a.iter().zip(b).map(|(a, b)| (a - b).abs())).fold(0f32, f32::max);
    assert!(largest(&ddp[0], &unclipped[0]) > 1e-3, "the clipping bites");
    assert!(largest(&ddp[0], &zero2[0]) < 1e-6, "ZeRO-2 differs from DDP by {}", largest(&ddp[0], &zero2[0]));
}

/// Under ZeRO-2 each process holds only its part of the reduced gradients:
/// what is computed from all of them takes every part, a gradient that is
/// not finite in one part stops every process's step, and the norm is
/// every part's. Under DDP each process holds them all and asks no one.
#[test]
fn zero2_processes_agree_on_what_their_parts_hold() {
    let exchange = std::sync::Arc::new((std::sync::Barrier::new(2), std::sync::Mutex::new([Vec::new(), Vec::new()])));
    let agreed = |shard| {
        std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let exchange = std::sync::Arc::clone(&exchange);
                    scope.spawn(move || {
                        let cards = ledger::Cards { count: 2, shard, ..ledger::Cards::default() };
                        let spread = super::data_parallel::DataParallel::new(
                            &net(ModelName::SmallCnn, 4, 16),
                            cards,
                            Box::new(Threads { rank, exchange }),
                        )
                        .unwrap();
                        let own_norm = [3.0, 4.0][rank];
                        (
                            spread.any_not_finite(rank == 0).unwrap(),
                            spread.norm(own_norm, 2.0).unwrap(),
                            spread.norm(own_norm, f64::INFINITY).unwrap(),
                        )
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).collect::<Vec<_>>()
        })
    };
    assert_eq!(agreed(ledger::Shard::Gradients), [(true, 5.0, 4.0), (true, 5.0, 4.0)]);
    assert_eq!(agreed(ledger::Shard::None), [(true, 3.0, 3.0), (false, 4.0, 4.0)]);
}
