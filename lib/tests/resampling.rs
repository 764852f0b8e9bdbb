//! candle's 2D pooling and nearest upsampling backward (the patched
//! candle-core) against PyTorch's: `scripts/resampling_reference.py` pooled
//! inputs full of ties with
//! `max_pool2d` and `avg_pool2d` for windows and strides that differ,
//! overlap, leave gaps or leave rows unread, and recorded the gradient each
//! input element gets (`fixtures/resampling.json`); and it resized inputs
//! with nearest upsampling by factors that are not integers, or differ. Max pooling's values are
//! exact in float32, so candle's must be the same numbers; average pooling's
//! divide by the window's size, and agree within float32's rounding.

use std::path::Path;

use serde::Deserialize;
use vramlab::candle::{Device, Tensor, Var};

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
    upsampling: Vec<Upsampling>,
}

#[derive(Deserialize)]
struct Upsampling {
    name: String,
    input_shape: Vec<usize>,
    target: (usize, usize),
    input: Vec<f32>,
    output: Vec<f32>,
    grad_output: Vec<f32>,
    grad_input: Vec<f32>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    mode: String,
    input_shape: Vec<usize>,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    input: Vec<f32>,
    output_shape: Vec<usize>,
    output: Vec<f32>,
    grad_output: Vec<f32>,
    grad_input: Vec<f32>,
}

fn fixture() -> Fixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/resampling.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// candle's pooling of `case`, and the gradient its input gets when `grad_output` arrives.
fn pool(case: &Case) -> vramlab::candle::Result<(Vec<f32>, Vec<f32>)> {
    let x = Var::from_vec(case.input.clone(), case.input_shape.clone(), &Device::Cpu)?;
    let padded = x.pad_with_same(2, case.padding.0, case.padding.0)?.pad_with_same(3, case.padding.1, case.padding.1)?;
    let y = match case.mode.as_str() {
        "max" => padded.max_pool2d_with_stride(case.kernel, case.stride)?,
        "avg" => padded.avg_pool2d_with_stride(case.kernel, case.stride)?,
        mode => panic!("unknown mode {mode}"),
    };
    assert_eq!(y.dims(), case.output_shape.as_slice(), "{}: output shape", case.name);
    let arriving = Tensor::from_vec(case.grad_output.clone(), y.shape(), &Device::Cpu)?;
    let grads = (&y * &arriving)?.sum_all()?.backward()?;
    let grad = grads.get(x.as_tensor()).expect("the input has a gradient");
    Ok((y.flatten_all()?.to_vec1()?, grad.flatten_all()?.to_vec1()?))
}

#[test]
fn pooling_gradients_are_pytorchs_for_every_window_and_stride() {
    let fixture = fixture();
    assert!(fixture.cases.iter().any(|c| c.mode == "max" && c.kernel != c.stride));
    let unpadded_max = fixture.cases.iter().filter(|c| c.mode == "max" && c.padding == (0, 0) && c.kernel != (1, 1));
    for case in unpadded_max {
        assert!(tied_windows(case) > 0, "{}: no window holds its maximum twice", case.name);
    }
    for case in &fixture.cases {
        let (output, grad_input) = pool(case).unwrap_or_else(|e| panic!("{} ({}): {e}", case.name, case.mode));
        // A maximum and the sums of 1/8ths are exact; an average divides by the window's size.
        let tolerance = if case.mode == "max" { 0.0 } else { 1e-6 };
        let same = |a: f32, b: f32| (a - b).abs() <= tolerance * b.abs().max(1.0);
        let forward_differs = (0..output.len()).find(|&i| !same(output[i], case.output[i]));
        assert!(forward_differs.is_none(), "{} ({}): forward differs at {forward_differs:?}", case.name, case.mode);
        let differ: Vec<usize> = (0..grad_input.len()).filter(|&i| !same(grad_input[i], case.grad_input[i])).collect();
        assert!(
            differ.is_empty(),
            "{} ({}): {} of {} input gradients differ from PyTorch's, first at {}: {} against {}",
            case.name,
            case.mode,
            differ.len(),
            grad_input.len(),
            differ[0],
            grad_input[differ[0]],
            case.grad_input[differ[0]],
        );
    }
}

/// Windows whose maximum occurs more than once in them: where a rule that splits the gradient
/// among ties, or picks another maximum, would differ from PyTorch's.
fn tied_windows(case: &Case) -> usize {
    let [n, c, h, w] = case.input_shape[..] else { panic!("{}: not 4D", case.name) };
    let (oh, ow) = ((h - case.kernel.0) / case.stride.0 + 1, (w - case.kernel.1) / case.stride.1 + 1);
    let at = |plane: usize, i: usize, j: usize| case.input[plane * h * w + i * w + j];
    let mut tied = 0;
    for plane in 0..n * c {
        for (i, j) in (0..oh).flat_map(|i| (0..ow).map(move |j| (i, j))) {
            let window: Vec<f32> = (0..case.kernel.0)
                .flat_map(|a| (0..case.kernel.1).map(move |b| (a, b)))
                .map(|(a, b)| at(plane, i * case.stride.0 + a, j * case.stride.1 + b))
                .collect();
            let max = window.iter().copied().fold(f32::MIN, f32::max);
            tied += usize::from(window.iter().filter(|v| **v == max).count() > 1);
        }
    }
    tied
}

#[test]
fn nearest_upsampling_gradients_are_pytorchs_for_every_size() {
    for case in fixture().upsampling {
        let x = Var::from_vec(case.input.clone(), case.input_shape.clone(), &Device::Cpu).unwrap();
        let y = x.upsample_nearest2d(case.target.0, case.target.1).unwrap();
        assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), case.output, "{}: forward", case.name);
        let arriving = Tensor::from_vec(case.grad_output.clone(), y.shape(), &Device::Cpu).unwrap();
        let grads = (&y * &arriving).unwrap().sum_all().unwrap().backward().unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let grad = grads.get(x.as_tensor()).expect("the input has a gradient").flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(grad, case.grad_input, "{}: the input's gradient", case.name);
    }
}
