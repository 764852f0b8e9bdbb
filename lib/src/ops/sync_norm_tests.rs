//! Batch-norm synchronised over two processes (here two threads, each with
//! half the batch) computes what one batch-norm computes over the whole
//! batch: the same output, input gradient and statistics, and weight and
//! bias gradients that add up to the whole batch's.

use std::sync::{Arc, Barrier, Mutex};

use candle_core::{Device, Tensor, Var};

use super::tests::{randn, relative_error};
use super::*;

/// Two threads' values summed: each puts its own in its slot, and both
/// read both once both are there.
struct Exchange {
    barrier: Barrier,
    slots: Mutex<[Vec<f32>; 2]>,
}

struct Rank(Arc<Exchange>, usize);

impl ProcessSum for Rank {
    fn sum(&self, values: Vec<f32>) -> candle_core::Result<Vec<f32>> {
        let Rank(exchange, rank) = self;
        exchange.slots.lock().unwrap()[*rank] = values;
        exchange.barrier.wait();
        let sum = {
            let slots = exchange.slots.lock().unwrap();
            slots[0].iter().zip(&slots[1]).map(|(a, b)| a + b).collect()
        };
        exchange.barrier.wait();
        Ok(sum)
    }
}

#[derive(Debug, Clone, Copy)]
enum Which {
    BatchNorm,
    NormAct,
    /// With a projection's batch-norm on the residual.
    NormAddAct,
}

/// The inputs, in the batch dimension where they have one: `z`, the
/// residual's `x`, and `r`, which weighs the output in the loss
/// `sum(y * r)`; then the batch-norms' weights and biases.
struct Inputs {
    z: Tensor,
    x: Tensor,
    r: Tensor,
    params: [Tensor; 4],
}

/// What one run gives: the output, the statistics' means and variances,
/// the gradients of `z` and `x`, and those of the parameters.
struct Run {
    y: Tensor,
    stats: Vec<(Tensor, Tensor, usize)>,
    batch_grads: [Tensor; 2],
    param_grads: Vec<Tensor>,
}

fn run(which: Which, inputs: &Inputs) -> Run {
    let [z, x] = [&inputs.z, &inputs.x].map(|t| Var::from_tensor(t).unwrap());
    let params = inputs.params.clone().map(|t| Var::from_tensor(&t).unwrap());
    let norm = |i: usize| Norm { weight: params[2 * i].as_tensor(), bias: params[2 * i + 1].as_tensor(), eps: 1e-5 };
    let (y, stats) = match which {
        Which::BatchNorm => {
            let out = batch_norm_train(&z, norm(0).weight, norm(0).bias, 1e-5).unwrap();
            (out.y, vec![out.stats])
        }
        Which::NormAct => {
            let out = norm_act(&z, norm(0), Activation::Relu, Then::Nothing).unwrap();
            (out.y, out.stats)
        }
        Which::NormAddAct => {
            let out = norm_add_act(&z, norm(0), Residual::Norm(x.as_tensor(), norm(1)), Activation::Relu).unwrap();
            (out.y, out.stats)
        }
    };
    let grads = (&y * &inputs.r).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |v: &Var| grads.get(v.as_tensor()).cloned().unwrap_or_else(|| v.as_tensor().zeros_like().unwrap());
    let used = match which {
        Which::NormAddAct => 4,
        _ => 2,
    };
    Run {
        y,
        stats: stats.into_iter().map(|s| (s.mean, s.var, s.count)).collect(),
        batch_grads: [grad(&z), grad(&x)],
        param_grads: params[..used].iter().map(grad).collect(),
    }
}

fn half(t: &Tensor, rank: usize) -> Tensor {
    let n = t.dim(0).unwrap() / 2;
    t.narrow(0, rank * n, n).unwrap()
}

#[test]
fn two_halves_synchronised_compute_the_whole_batchs_batch_norm() {
    // Odd maps, and 1x1 maps (ResNet's last stage at 32 px): 4 values a channel on each half.
    for dims in [[6, 5, 7, 3], [8, 5, 1, 1]] {
        two_halves_of(dims);
    }
}

fn two_halves_of(dims: [usize; 4]) {
    let c = dims[1];
    let whole = Inputs {
        z: ((randn(&dims) * 2.0).unwrap() + 0.5).unwrap(),
        x: (randn(&dims) - 1.0).unwrap(),
        r: randn(&dims),
        params: [randn(&[c]), randn(&[c]), randn(&[c]), randn(&[c])],
    };
    for which in [Which::BatchNorm, Which::NormAct, Which::NormAddAct] {
        let alone = run(which, &whole);
        let exchange = Arc::new(Exchange { barrier: Barrier::new(2), slots: Mutex::new([Vec::new(), Vec::new()]) });
        let halves: Vec<Run> = std::thread::scope(|scope| {
            let ranks = (0..2).map(|rank| {
                let (exchange, whole) = (Arc::clone(&exchange), &whole);
                scope.spawn(move || {
                    let part =
                        Inputs { z: half(&whole.z, rank), x: half(&whole.x, rank), r: half(&whole.r, rank), params: whole.params.clone() };
                    synchronised(Arc::new(Rank(exchange, rank)), || run(which, &part))
                })
            });
            ranks.collect::<Vec<_>>().into_iter().map(|h| h.join().unwrap()).collect()
        });
        let joined = |f: &dyn Fn(&Run) -> Tensor| Tensor::cat(&[f(&halves[0]), f(&halves[1])], 0).unwrap();
        let close = |what: &str, a: &Tensor, b: &Tensor| {
            let error = relative_error(a, b);
            assert!(error < 2e-6, "{which:?} on {dims:?}, {what}: relative error {error}");
        };
        close("output", &joined(&|r| r.y.clone()), &alone.y);
        close("input gradient", &joined(&|r| r.batch_grads[0].clone()), &alone.batch_grads[0]);
        close("residual's gradient", &joined(&|r| r.batch_grads[1].clone()), &alone.batch_grads[1]);
        for (i, whole_grad) in alone.param_grads.iter().enumerate() {
            close("parameter gradients, added", &(&halves[0].param_grads[i] + &halves[1].param_grads[i]).unwrap(), whole_grad);
        }
        for part in &halves {
            for ((mean, var, count), (whole_mean, whole_var, whole_count)) in part.stats.iter().zip(&alone.stats) {
                close("mean", mean, whole_mean);
                close("variance", var, whole_var);
                assert_eq!(count, whole_count, "{which:?} on {dims:?}: the whole batch's count, for the running variance");
            }
        }
    }
}

#[test]
fn outside_the_host_kernels_synchronisation_is_refused_by_name() {
    let never = Arc::new(Exchange { barrier: Barrier::new(1), slots: Mutex::new([Vec::new(), Vec::new()]) });
    let x = randn(&[2, 3, 4, 4]).to_dtype(candle_core::DType::F64).unwrap();
    let (w, b) =
        (Tensor::ones(3, candle_core::DType::F64, &Device::Cpu).unwrap(), Tensor::zeros(3, candle_core::DType::F64, &Device::Cpu).unwrap());
    let err = synchronised(Arc::new(Rank(never, 0)), || batch_norm_train(&x, &w, &b, 1e-5)).unwrap_err().to_string();
    assert!(err.contains("--sync-bn") && err.contains("F64 on the host"), "{err}");
    // Outside `synchronised`, the same batch-norm runs on candle's ops.
    assert!(batch_norm_train(&x, &w, &b, 1e-5).is_ok());
}
