//! The allocation counters installed in a real executable (this test binary).

use std::sync::Mutex;

use vramlab::candle::{DType, Device, Tensor};
use vramlab::memory::{self, Budget, HostMemory};

vramlab::install_allocation_counters!();

/// Tests share one process-wide heap: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn setup() -> std::sync::MutexGuard<'static, ()> {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(memory::install);
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

const MIB: u64 = 1 << 20;
/// glibc serves a 64 MiB block with mmap: the block rounds up to a page plus its header.
const ROUNDING: u64 = 64 * 1024;

#[test]
fn a_tensor_moves_in_use_by_its_size_and_dropping_it_gives_it_back() {
    let _guard = setup();
    let before = HostMemory::sample();
    assert!(before.exact, "{before}");
    let tensor = Tensor::zeros((16, 1024, 1024), DType::F32, &Device::Cpu).unwrap();
    let during = HostMemory::sample();
    let grew = during.in_use - before.in_use;
    assert!((64 * MIB..64 * MIB + ROUNDING).contains(&grew), "grew by {grew}");
    assert!(during.peak.unwrap() >= during.in_use);
    drop(tensor);
    let after = HostMemory::sample();
    assert!(after.in_use < before.in_use + ROUNDING, "{before} / {after}");
    assert!(after.peak.unwrap() >= before.in_use + 64 * MIB, "the peak remembers the tensor");
    let reset = HostMemory::reset_peak();
    assert!(reset.peak.unwrap() < before.in_use + ROUNDING, "{reset}");
}

#[test]
fn a_short_peak_is_caught_between_samples() {
    let _guard = setup();
    let start = HostMemory::reset_peak();
    {
        let burst = vec![1u8; 32 << 20];
        std::hint::black_box(&burst);
    }
    let end = HostMemory::sample();
    // The threads of an earlier test's pool may still be exiting and freeing
    // their buffers: the burst stood on the lower of the two levels.
    assert!(end.peak.unwrap() >= start.in_use.min(end.in_use) + 32 * MIB, "{start} / {end}");
}

#[test]
fn empty_cache_gives_the_pages_of_free_blocks_back() {
    let _guard = setup();
    // Blocks under glibc's mmap threshold live in the heap; the last one pins
    // the heap's top, so freeing the others leaves their pages with the allocator.
    let mut blocks: Vec<Vec<u8>> = (0..512).map(|i| vec![(i % 250 + 1) as u8; 64 * 1024]).collect();
    let pin = blocks.pop();
    drop(blocks);
    let emptied = HostMemory::empty_cache();
    assert!(emptied.after.rss + 16 * MIB <= emptied.before.rss, "{emptied:?}");
    assert!(emptied.after.held <= emptied.before.held, "{emptied:?}");
    drop(pin);
}

#[test]
fn the_allocation_past_the_budget_raises_the_cuda_shaped_error() {
    let _guard = setup();
    let in_use = HostMemory::sample().in_use;
    let (context, workspace) = (vramlab::gpus::GENERIC_CONTEXT_BYTES, vramlab::ops::CUDNN_WORKSPACE_BYTES);
    let device = memory::cpu_with_budget(&format!("{}MiB", (in_use + context + workspace) / MIB + 48)).unwrap();
    assert_eq!(memory::check_budget(), Ok(()));
    let fits = Tensor::zeros((8, 1024, 1024), DType::F32, &device).unwrap();
    assert_eq!(memory::check_budget(), Ok(()), "32 MiB fit in 48");
    let too_much = Tensor::zeros((8, 1024, 1024), DType::F32, &device).unwrap();
    let oom = memory::check_budget().unwrap_err();
    assert!((32 * MIB..32 * MIB + ROUNDING).contains(&oom.requested), "{oom}");
    assert!(oom.in_use >= in_use + 32 * MIB, "{oom}");
    assert!(oom.to_string().contains("tried to allocate 32.0 MiB") && oom.to_string().contains("simulated"), "{oom}");
    assert_eq!(
        (oom.budget.context, oom.budget.workspace),
        (context, workspace),
        "a bare size holds a typical CUDA context and cuDNN's workspace, as %oomcheck --gpu counts them"
    );
    let again = memory::check_budget().unwrap_err();
    assert_eq!((again.requested, again.in_use), (oom.requested, oom.in_use), "still over the budget: the same error");
    drop(too_much);
    assert_eq!(memory::check_budget(), Ok(()), "back under the budget");
    drop(fits);
    memory::set_budget(None).unwrap();
    assert_eq!(memory::budget(), None);
    assert!(Budget::parse("0GiB").is_err());
}

#[test]
fn snapshots_are_published_in_the_shared_region() {
    let _guard = setup();
    let snapshot = memory::Snapshot { label: "test".into(), predicted: None, measured: None };
    memory::publish(&snapshot).unwrap();
    assert_eq!(memory::published(), Some(snapshot));
}

/// A rayon pool of `threads` kept for the whole test binary: a dropped
/// pool's threads exit on their own time and free their gemm slabs then,
/// in the middle of another test's measurement.
fn pool_of(threads: usize) -> &'static rayon::ThreadPool {
    static POOLS: [std::sync::OnceLock<rayon::ThreadPool>; 2] = [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    POOLS[threads - 1].get_or_init(|| rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap())
}

#[test]
fn a_convolution_allocates_the_scratch_the_ledger_counts_for_it() {
    use vramlab::ops::{self, ConvParams};
    let _guard = setup();
    let conv = |stride, padding| ConvParams { stride, padding, groups: 1 };
    // Cut into chunks of images across the threads, one image inside a
    // threaded gemm, stacked tiny maps, and a pointwise conv read in place;
    // the 3x3 stride-1 ones through Winograd's transforms.
    let cases = [
        ([32, 64, 16, 16], [64, 64, 3, 3], conv(1, 1)),
        ([2, 64, 56, 56], [64, 64, 3, 3], conv(1, 1)),
        ([1, 3, 224, 224], [64, 3, 7, 7], conv(2, 3)),
        ([16, 256, 4, 4], [512, 256, 3, 3], conv(2, 1)),
        ([8, 128, 28, 28], [256, 128, 1, 1], conv(1, 0)),
    ];
    for threads in [1, 2] {
        // The scratch follows rayon's pool: the prediction and the run both see this one.
        let pool = pool_of(threads);
        for (x_dims, w_dims, params) in cases {
            let x = Tensor::randn(0f32, 1.0, x_dims.as_slice(), &Device::Cpu).unwrap();
            let w = Tensor::randn(0f32, 0.1, w_dims.as_slice(), &Device::Cpu).unwrap();
            // The first product on each thread also allocates gemm's per-thread slab, kept for good:
            // every thread runs one (a convolution started on a thread runs part of it there; one
            // started from outside the pool might leave a thread idle if the other took all the chunks).
            pool.broadcast(|_| drop(ops::conv2d(&x, &w, params).unwrap()));
            let (predicted, measured) = pool.install(|| {
                let before = HostMemory::reset_peak();
                let y = ops::conv2d(&x, &w, params).unwrap();
                let peak = HostMemory::sample().peak.unwrap();
                let predicted = ops::conv2d_scratch(x_dims, w_dims, params).unwrap().forward;
                (predicted, peak - before.in_use - (y.elem_count() * 4) as u64)
            });
            let slack = 4096 + predicted / 200;
            let case = format!("{x_dims:?} * {w_dims:?} on {threads} thread(s): predicted {predicted} B, measured {measured} B");
            // With two threads the chunks' buffers meet only when both threads are busy at once.
            if threads == 1 {
                assert!(measured.abs_diff(predicted) <= slack, "{case}");
            } else {
                assert!(measured <= predicted + slack, "{case}");
            }
        }
    }
}

#[test]
fn attention_keeps_and_allocates_what_it_says() {
    use vramlab::candle::Var;
    use vramlab::ops::{self, AttentionKeeps};
    let _guard = setup();
    // `(batch, tokens, dim, heads)`: batches cut across the threads, and one
    // image whose products are threaded inside gemm.
    let cases = [(4, 197, 192, 3), (1, 65, 64, 2), (3, 50, 48, 1)];
    for threads in [1, 2] {
        let pool = pool_of(threads);
        for (batch, tokens, dim, heads) in cases {
            for dtype in [DType::F32, DType::F16] {
                let x = Tensor::randn(0f32, 1.0, (batch, tokens, 3 * dim), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                let x = Var::from_tensor(&x).unwrap();
                let mut kept = Vec::new();
                for keeps in [AttentionKeeps::Probabilities, AttentionKeeps::RowStatistics] {
                    let run = || ops::attention(x.as_tensor(), heads, keeps).unwrap();
                    // gemm's per-thread slab, kept for good, on every thread first.
                    pool.broadcast(|_| drop(run().backward().unwrap()));
                    // The scratch follows rayon's pool: the prediction and the run both see this one.
                    let (predicted, measured_kept, forward, backward) = pool.install(|| {
                        let predicted = ops::attention_scratch(batch, tokens, dim, heads, dtype, keeps).unwrap();
                        let before = HostMemory::reset_peak();
                        let y = run();
                        let after = HostMemory::sample();
                        let out = (y.elem_count() * dtype.size_in_bytes()) as u64;
                        let measured_kept = after.in_use - before.in_use - out;
                        let forward = after.peak.unwrap() - after.in_use;
                        // The backward starts from a gradient of ones and ends with the input's gradient.
                        let before = HostMemory::reset_peak();
                        let grads = y.backward().unwrap();
                        let peak = HostMemory::sample().peak.unwrap();
                        drop(grads);
                        (predicted, measured_kept, forward, peak - before.in_use - out - 3 * out)
                    });
                    let keeps_bytes = keeps.bytes(batch, tokens, heads, dtype);
                    let case = format!(
                        "{batch}x{tokens}x{dim}, {heads} heads, {dtype:?}, {keeps:?} on {threads} thread(s): \
                         kept {measured_kept} B of {keeps_bytes}, forward {forward} B of {}, backward {backward} B of {}",
                        predicted.forward, predicted.backward
                    );
                    assert!(measured_kept.abs_diff(keeps_bytes) <= 4096, "{case}");
                    for (measured, predicted) in [(forward, predicted.forward), (backward, predicted.backward)] {
                        let slack = 4096 + predicted / 200;
                        // With two threads the workers' buffers meet only when both are busy at once.
                        if threads == 1 {
                            assert!(measured.abs_diff(predicted) <= slack, "{case}");
                        } else {
                            assert!(measured <= predicted + slack, "{case}");
                        }
                    }
                    kept.push(measured_kept);
                }
                let shape = format!("{batch}x{tokens}x{dim}, {heads} heads, {dtype:?} on {threads} thread(s)");
                assert!(kept[1] < kept[0], "{shape}: row statistics keep {} B, probabilities {} B", kept[1], kept[0]);
                // Without gradients nothing is kept, and the forward allocates as with row statistics.
                let (predicted, kept, forward) = pool.install(|| {
                    let predicted = ops::attention_scratch(batch, tokens, dim, heads, dtype, AttentionKeeps::RowStatistics).unwrap();
                    let before = HostMemory::reset_peak();
                    let y = ops::attention(&x.as_tensor().detach(), heads, AttentionKeeps::Probabilities).unwrap();
                    let after = HostMemory::sample();
                    let out = (y.elem_count() * dtype.size_in_bytes()) as u64;
                    (predicted.forward, after.in_use - before.in_use - out, after.peak.unwrap() - after.in_use)
                });
                assert!(kept <= 1024, "{shape} without gradients: kept {kept} B");
                if threads == 1 {
                    assert!(
                        forward.abs_diff(predicted) <= 4096 + predicted / 200,
                        "{shape} without gradients: forward {forward} B of {predicted}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_linear_ops_keep_their_output_alone_and_allocate_what_they_say() {
    use vramlab::candle::Var;
    use vramlab::ops::{self, Fused, Reads};
    let _guard = setup();
    // `(leading dims of x, in features, out features)`: ViT-Tiny's MLP up and
    // down on two images, and a classifier head on 32 rows.
    let cases: [(&[usize], usize, usize); 3] = [(&[2, 197], 192, 768), (&[2, 197], 768, 192), (&[32], 512, 1000)];
    // The linear layer, and the ones that read its input through a GELU or a layer-norm or add a
    // residual, as the lean transformer runs them.
    let fused = |reads, adds_residual| Fused { reads, adds_residual };
    let kinds = [
        ("linear", fused(Reads::Input, false)),
        ("gelu_linear", fused(Reads::Gelu, false)),
        ("linear_residual", fused(Reads::Input, true)),
        ("gelu_linear_residual", fused(Reads::Gelu, true)),
        ("norm_linear", fused(Reads::Norm, false)),
    ];
    for ((name, fused), threads) in kinds.into_iter().flat_map(|kind| [1, 2].map(|threads| (kind, threads))) {
        let pool = pool_of(threads);
        for (leading, inputs, outputs) in cases {
            for dtype in [DType::F32, DType::F16] {
                let rows: usize = leading.iter().product();
                let randn = |dims: &[usize]| Tensor::randn(0f32, 1.0, dims, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                let operands = [randn(&[leading, &[inputs]].concat()), randn(&[outputs, inputs]), randn(&[outputs])];
                let residual = randn(&[leading, &[outputs]].concat());
                let norm =
                    [Tensor::ones(inputs, DType::F32, &Device::Cpu).unwrap(), Tensor::zeros(inputs, DType::F32, &Device::Cpu).unwrap()];
                let apply = |x: &Tensor, w: &Tensor, b: &Tensor| match (fused.reads, fused.adds_residual) {
                    (Reads::Input, false) => ops::linear(x, w, Some(b)),
                    (Reads::Gelu, false) => ops::gelu_linear(x, w, Some(b)),
                    (Reads::Input, true) => ops::linear_residual(x, w, Some(b), &residual),
                    (Reads::Gelu, true) => ops::gelu_linear_residual(x, w, Some(b), &residual),
                    (Reads::Norm, _) => ops::norm_linear(x, &norm[0], &norm[1], 1e-6, w, Some(b)),
                };
                let vars = operands.each_ref().map(|t| Var::from_tensor(t).unwrap());
                // The operands with the gradients `tracked` asks for, detached before any measurement.
                let with_gradients = |tracked: [bool; 3]| {
                    let [x, w, b] = [0, 1, 2].map(|i| if tracked[i] { vars[i].as_tensor().clone() } else { vars[i].as_tensor().detach() });
                    move || apply(&x, &w, &b).unwrap()
                };
                let all = with_gradients([true; 3]);
                // gemm's per-thread slab, kept for good, on every thread first.
                pool.broadcast(|_| drop(all().backward().unwrap()));
                let size = |elements: usize| (elements * dtype.size_in_bytes()) as u64;
                let out = size(rows * outputs);
                let case = format!("{name} {leading:?} x {inputs} -> {outputs}, {dtype:?} on {threads} thread(s)");
                // The scratch follows rayon's pool: the prediction and the runs all see this one.
                let (predicted, kept, forward, candle_kept) = pool.install(|| {
                    let predicted = ops::fused_linear_scratch(fused, rows, inputs, outputs, dtype).unwrap();
                    let before = HostMemory::reset_peak();
                    let y = all();
                    let after = HostMemory::sample();
                    let (kept, forward) = (after.in_use - before.in_use, after.peak.unwrap() - after.in_use);
                    drop(y);
                    let [x, w, b] = vars.each_ref().map(Var::as_tensor);
                    let before = HostMemory::sample();
                    let x = match fused.reads {
                        Reads::Input => x.clone(),
                        Reads::Gelu => x.gelu_erf().unwrap(),
                        Reads::Norm => ops::layer_norm(x, &norm[0], &norm[1], 1e-6).unwrap(),
                    };
                    let y = x.reshape((rows, inputs)).unwrap().matmul(&w.t().unwrap()).unwrap().broadcast_add(b).unwrap();
                    let y = if fused.adds_residual { (y.reshape(residual.shape()).unwrap() + &residual).unwrap() } else { y };
                    let candle_kept = HostMemory::sample().in_use - before.in_use;
                    drop((x, y));
                    (predicted, kept, forward, candle_kept)
                });
                // The norm's weight and bias, stacked, are kept with the output.
                let stacked = if fused.reads == Reads::Norm { 2 * inputs as u64 * 4 } else { 0 };
                assert!(kept.abs_diff(out + stacked) <= 4096, "{case}: the graph holds {kept} B after the forward, the output is {out} B");
                // candle's ops keep the GELU's or layer-norm's output and the sum too, where there are.
                let transformed = if fused.reads == Reads::Input { 0 } else { size(rows * inputs) };
                let candle_expected = 2 * out + transformed + if fused.adds_residual { out } else { 0 };
                assert!(
                    candle_kept.abs_diff(candle_expected) <= 4096,
                    "{case}: candle's ops hold {candle_kept} B where they keep {candle_expected} B"
                );
                // Each gradient alone: its pass's scratch beyond the output's gradient (ones) and the one it returns.
                // A layer-norm's backward runs the plain ops one after the other, whose rules the
                // measure matrix holds to the counters on whole steps.
                let passes = if fused.reads == Reads::Norm {
                    Vec::new()
                } else {
                    vec![
                        ([true, false, false], size(rows * inputs), predicted.input_gradient),
                        ([false, true, false], size(outputs * inputs), predicted.weight_gradient),
                        ([false, false, true], size(outputs), predicted.bias_gradient),
                        ([true; 3], size(rows * inputs + outputs * inputs + outputs), predicted.most()),
                    ]
                };
                // `(pass, operands with gradients, measured, predicted, exact)`: with two threads gemm's threads
                // meet only when both are busy at once, and the whole backward holds the largest
                // pass's scratch only where that pass comes last.
                let mut measured = vec![("forward", [true; 3], forward, predicted.forward, threads == 1)];
                for (tracked, gradients, predicted) in passes {
                    let y = with_gradients(tracked)();
                    let peak = pool.install(|| {
                        let before = HostMemory::reset_peak();
                        let grads = y.backward().unwrap();
                        let peak = HostMemory::sample().peak.unwrap();
                        drop(grads);
                        peak - before.in_use
                    });
                    measured.push(("backward", tracked, peak - out - gradients, predicted, threads == 1 && tracked != [true; 3]));
                }
                for (pass, tracked, measured, predicted, exact) in measured {
                    let slack = 4096 + predicted / 200;
                    let what = format!("{case}, {pass} with gradients for {tracked:?}: measured {measured} B, predicted {predicted} B");
                    if exact {
                        assert!(measured.abs_diff(predicted) <= slack, "{what}");
                    } else {
                        assert!(measured <= predicted + slack, "{what}");
                    }
                }
            }
        }
    }
}

#[test]
fn conv_transpose2d_keeps_its_output_alone_and_allocates_what_it_says() {
    use vramlab::candle::Var;
    use vramlab::ops;
    let _guard = setup();
    // `(x dims, out channels, kernel)`: a U-Net's up-convolutions (the deepest
    // and a shallow one), a wide weight of 512 x 256 x 2 x 2 on a 4x4 map,
    // one pixel, and kernel 3.
    let cases: [([usize; 4], usize, usize); 5] =
        [([2, 128, 8, 8], 64, 2), ([2, 32, 32, 32], 16, 2), ([2, 512, 4, 4], 256, 2), ([4, 256, 1, 1], 128, 2), ([2, 24, 9, 7], 12, 3)];
    for threads in [1, 2] {
        let pool = pool_of(threads);
        for (x_dims, outputs, k) in cases {
            for dtype in [DType::F32, DType::F16] {
                let [n, c, h, w] = x_dims;
                let randn = |dims: &[usize]| Tensor::randn(0f32, 1.0, dims, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                let operands = [randn(&x_dims), randn(&[c, outputs, k, k]), randn(&[outputs])];
                let vars = operands.each_ref().map(|t| Var::from_tensor(t).unwrap());
                // The operands with the gradients `tracked` asks for, detached before any measurement.
                let with_gradients = |tracked: [bool; 3], biased: bool| {
                    let [x, w, b] = [0, 1, 2].map(|i| if tracked[i] { vars[i].as_tensor().clone() } else { vars[i].as_tensor().detach() });
                    move || ops::conv_transpose2d(&x, &w, biased.then_some(&b), k).unwrap()
                };
                // gemm's per-thread slab, kept for good, on every thread first.
                pool.broadcast(|_| drop(with_gradients([true; 3], true)().backward().unwrap()));
                let size = |elements: usize| (elements * dtype.size_in_bytes()) as u64;
                let out = size(n * outputs * k * h * k * w);
                let case = format!("{x_dims:?} -> {outputs}, kernel {k}, {dtype:?} on {threads} thread(s)");
                for biased in [true, false] {
                    let all = with_gradients([true; 3], biased);
                    let case = format!("{case}{}", if biased { "" } else { " without bias" });
                    // The scratch follows rayon's pool: the prediction and the runs all see this one.
                    let (predicted, kept, forward, candle_kept) = pool.install(|| {
                        let predicted = ops::conv_transpose2d_scratch(x_dims, outputs, k, dtype).unwrap();
                        let before = HostMemory::reset_peak();
                        let y = all();
                        let after = HostMemory::sample();
                        let (kept, forward) = (after.in_use - before.in_use, after.peak.unwrap() - after.in_use);
                        drop(y);
                        let [x, w, b] = vars.each_ref().map(Var::as_tensor);
                        let before = HostMemory::sample();
                        let y = x.conv_transpose2d(w, 0, 0, k, 1).unwrap();
                        let y = if biased { y.broadcast_add(&b.reshape((1, outputs, 1, 1)).unwrap()).unwrap() } else { y };
                        let candle_kept = HostMemory::sample().in_use - before.in_use;
                        drop(y);
                        (predicted, kept, forward, candle_kept)
                    });
                    assert!(kept.abs_diff(out) <= 4096, "{case}: the graph holds {kept} B after the forward, the output is {out} B");
                    let candle_outputs = if biased { 2 } else { 1 };
                    assert!(
                        candle_kept.abs_diff(candle_outputs * out) <= 4096,
                        "{case}: candle's conv_transpose2d (+ add) hold {candle_kept} B, {candle_outputs} output(s) of {out} B"
                    );
                    // Each gradient alone: its pass's scratch beyond the output's gradient (ones) and the one it returns.
                    let mut passes = vec![
                        ([true, false, false], size(n * c * h * w), predicted.input_gradient),
                        ([false, true, false], size(c * outputs * k * k), predicted.weight_gradient),
                    ];
                    if biased {
                        passes.push(([false, false, true], size(outputs), predicted.bias_gradient));
                        passes.push(([true; 3], size(n * c * h * w + c * outputs * k * k + outputs), predicted.most()));
                    }
                    // `(pass, operands with gradients, measured, predicted, exact)`: with two threads gemm's threads
                    // meet only when both are busy at once, and the whole backward holds the largest
                    // pass's scratch only where that pass comes last.
                    let mut measured = vec![("forward", [true; 3], forward, predicted.forward, threads == 1)];
                    for (tracked, gradients, predicted) in passes {
                        let y = with_gradients(tracked, biased)();
                        let peak = pool.install(|| {
                            let before = HostMemory::reset_peak();
                            let grads = y.backward().unwrap();
                            let peak = HostMemory::sample().peak.unwrap();
                            drop(grads);
                            peak - before.in_use
                        });
                        measured.push(("backward", tracked, peak - out - gradients, predicted, threads == 1 && tracked != [true; 3]));
                    }
                    for (pass, tracked, measured, predicted, exact) in measured {
                        let slack = 4096 + predicted / 200;
                        let what = format!("{case}, {pass} with gradients for {tracked:?}: measured {measured} B, predicted {predicted} B");
                        if exact {
                            assert!(measured.abs_diff(predicted) <= slack, "{what}");
                        } else {
                            assert!(measured <= predicted + slack, "{what}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_step_past_the_budget_is_remembered_at_the_phase_that_crossed_it() {
    use vramlab::ledger::{BillKind, StepPhase};
    use vramlab::models::{small_cnn, Network, Shape};
    use vramlab::train::{last_step_oom, Stripes, TrainConfig, Trainer};
    let _guard = setup();
    let net = Network::new(&small_cnn(10), Shape::map(3, 64, 64), &Device::Cpu, 0).unwrap();
    let mut trainer = Trainer::new(net, TrainConfig::default()).unwrap();
    let batch = Stripes::new(10, 64).generate(32, 0, &Device::Cpu).unwrap();
    let activations = trainer.predict(32).unwrap().bill(BillKind::Activations).bytes;
    let in_use = HostMemory::sample().in_use;
    let (context, workspace) = (vramlab::gpus::GENERIC_CONTEXT_BYTES, vramlab::ops::CUDNN_WORKSPACE_BYTES);
    memory::cpu_with_budget(&format!("{}MiB", (in_use + context + workspace + activations / 2) / MIB)).unwrap();
    let error = trainer.step(&[batch], 0).unwrap_err().to_string();
    let oom = last_step_oom();
    memory::set_budget(None).unwrap();
    let oom = oom.unwrap_or_else(|| panic!("the step is not remembered: {error}"));
    assert!(matches!(oom.phase, StepPhase::Forward { .. } | StepPhase::Backward { .. }), "{:?}: {error}", oom.phase);
    assert!(error.contains(&format!("during {}", oom.phase_name)), "remembered at {}: {error}", oom.phase_name);
}
