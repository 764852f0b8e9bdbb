//! candle-nn's fused layer-norm, RMS-norm and last-dimension softmax (the patched candle-nn) carry
//! gradients: where an operand takes part in one, each computes through its composition, so the
//! gradients of a model built with them are those of the composed ops, and inference on plain
//! tensors keeps the fused kernels.

use vramlab::candle::{DType, Device, Tensor, Var, D};
use vramlab::candle_nn::ops;

fn close(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn fused_norms_and_softmax_give_the_gradients_of_their_compositions() {
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1., (4, 6, 16), &dev).unwrap()).unwrap();
    let alpha = Var::from_tensor(&Tensor::randn(1f32, 0.1, 16, &dev).unwrap()).unwrap();
    let beta = Var::from_tensor(&Tensor::randn(0f32, 0.1, 16, &dev).unwrap()).unwrap();
    let weights = Tensor::randn(0f32, 1., (4, 6, 16), &dev).unwrap();
    type Op<'a> = (&'a str, Box<dyn Fn() -> vramlab::candle::Result<Tensor> + 'a>, Box<dyn Fn() -> vramlab::candle::Result<Tensor> + 'a>);
    let cases: Vec<Op> = vec![
        ("layer_norm", Box::new(|| ops::layer_norm(&x, &alpha, &beta, 1e-5)), Box::new(|| ops::layer_norm_slow(&x, &alpha, &beta, 1e-5))),
        ("rms_norm", Box::new(|| ops::rms_norm(&x, &alpha, 1e-5)), Box::new(|| ops::rms_norm_slow(&x, &alpha, 1e-5))),
        ("softmax_last_dim", Box::new(|| ops::softmax_last_dim(&x)), Box::new(|| ops::softmax(&x, D::Minus1))),
    ];
    for (name, fused, composed) in cases {
        let (fused, composed) = (fused().unwrap(), composed().unwrap());
        assert!(close(&fused, &composed) < 1e-5, "{name}: values");
        let g_fused = (&fused * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let g_composed = (&composed * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        for (operand, var) in [("x", &x), ("alpha", &alpha), ("beta", &beta)] {
            match (g_fused.get(var.as_tensor()), g_composed.get(var.as_tensor())) {
                (Some(a), Some(b)) => assert!(close(a, b) < 1e-5, "{name}: the gradient of {operand}"),
                (None, None) => {}
                (found, _) => panic!("{name}: the gradient of {operand} is {}", if found.is_some() { "extra" } else { "missing" }),
            }
        }
    }
    // Plain tensors (inference on loaded weights) take the fused kernels, with no graph.
    let plain = ops::layer_norm(&x.as_tensor().detach(), &alpha.as_tensor().detach(), &beta.as_tensor().detach(), 1e-5).unwrap();
    assert!(!plain.track_op());
    assert_eq!(plain.dtype(), DType::F32);
}
