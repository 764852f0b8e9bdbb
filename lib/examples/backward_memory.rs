//! Measures what one layer's backward holds beyond the graph, in multiples
//! of its input, with the exact allocation counters: the numbers behind the
//! `backward_bytes` rules in `vramlab::models` (rules.rs).
//!
//!     cargo run --release -p vramlab --example backward_memory

use vramlab::candle::{DType, Device, Result, Tensor, Var};
use vramlab::memory::HostMemory;
use vramlab::ops::{self, ConvParams};

vramlab::install_allocation_counters!();

type Layer<'a> = (&'a str, Box<dyn Fn(&Tensor) -> Result<Tensor> + 'a>);

/// Peak in use during backward, above what was in use before it, in units
/// of the layer's input; the input is a graph node (not a `Var`), as inside a network.
fn transient(x: &Var, dtype: DType, layer: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<f64> {
    let input = x.as_tensor().affine(1.0, 0.0)?.to_dtype(dtype)?;
    let loss = layer(&input)?.to_dtype(DType::F32)?.sum_all()?;
    let before = HostMemory::sample().in_use;
    HostMemory::reset_peak();
    let grads = loss.backward()?;
    let after = HostMemory::sample();
    drop(grads);
    let unit = (input.elem_count() * dtype.size_in_bytes()) as f64;
    Ok((after.peak.unwrap_or(after.in_use) as f64 - before as f64) / unit)
}

fn main() -> Result<()> {
    vramlab::memory::install();
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1., (32, 32, 32, 32), &dev)?)?;
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.1, (32, 32, 3, 3), &dev)?)?;
    let gamma = Var::from_tensor(&Tensor::ones(32, DType::F32, &dev)?)?;
    let beta = Var::from_tensor(&Tensor::zeros(32, DType::F32, &dev)?)?;
    let same = ConvParams { stride: 1, padding: 1, groups: 1 };
    let conv = |t: &Tensor| ops::conv2d(t, &w.as_tensor().to_dtype(t.dtype())?, same);
    let bn = |t: &Tensor| Ok(ops::batch_norm_train(t, gamma.as_tensor(), beta.as_tensor(), 1e-5)?.y);
    let layers: Vec<Layer> = vec![
        ("nothing (the harness)", Box::new(|t: &Tensor| Ok(t.clone()))),
        ("conv 3x3", Box::new(conv)),
        ("batch-norm", Box::new(bn)),
        ("max-pool 3x3/2", Box::new(|t: &Tensor| ops::max_pool2d(t, 3, 2, 1))),
        ("relu", Box::new(|t: &Tensor| t.relu())),
        ("silu", Box::new(|t: &Tensor| ops::silu(t))),
        ("x * gate", Box::new(|t: &Tensor| t.broadcast_mul(&t.mean_keepdim(3)?.mean_keepdim(2)?.exp()?))),
        ("conv, batch-norm, relu", Box::new(|t: &Tensor| bn(&conv(t)?)?.relu())),
    ];
    println!("backward's peak above what was in use, in units of the layer's input (b32, 32x32x32)");
    println!("{:24} {:>6} {:>6}", "layer", "f32", "f16");
    for (name, layer) in &layers {
        let f32 = transient(&x, DType::F32, layer.as_ref())?;
        let f16 = transient(&x, DType::F16, layer.as_ref())?;
        println!("{name:24} {f32:6.2} {f16:6.2}");
    }

    let big = Var::from_tensor(&Tensor::randn(0f32, 0.1, (512, 512, 3, 3), &dev)?)?;
    let small = Var::from_tensor(&Tensor::randn(0f32, 1., (16, 512, 2, 2), &dev)?)?;
    println!("\nbackward's peak per weight of a 512x512x3x3 conv on a small map, its f32 gradient included (bytes)");
    for dtype in [DType::F32, DType::F16] {
        let input = small.as_tensor().affine(1.0, 0.0)?.to_dtype(dtype)?;
        let loss = ops::conv2d(&input, &big.as_tensor().to_dtype(dtype)?, same)?.to_dtype(DType::F32)?.sum_all()?;
        let before = HostMemory::sample().in_use;
        HostMemory::reset_peak();
        let grads = loss.backward()?;
        let after = HostMemory::sample();
        drop(grads);
        let per_weight = (after.peak.unwrap_or(after.in_use) as f64 - before as f64) / big.elem_count() as f64;
        println!("{dtype:?}: {per_weight:.2}");
    }
    Ok(())
}
