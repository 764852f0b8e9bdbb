use candle_core::{DType, Device, Tensor};

use super::descriptors::{biased_from_unbiased, ConvDims, Element, NormDims, PoolDims, TensorDims};
use super::plan::{choose, Candidate, ConvKey, ConvPass, Math, PlanCache};
use super::WORKSPACE_BYTES;
use crate::ops::conv_geometry::Geometry as ConvGeometry;
use crate::ops::pool::Geometry as PoolGeometry;
use crate::ops::{ConvParams, OpError};

fn conv(x: [usize; 4], w: [usize; 4], stride: usize, padding: usize, groups: usize) -> ConvDims {
    ConvDims::of(&ConvGeometry::of_dims(x, w, ConvParams { stride, padding, groups }).unwrap()).unwrap()
}

#[test]
fn packed_strides_are_nchw() {
    let t = TensorDims::packed("test", [32, 64, 56, 48]).unwrap();
    assert_eq!(t.dims, [32, 64, 56, 48]);
    assert_eq!(t.strides, [64 * 56 * 48, 56 * 48, 48, 1]);
    assert_eq!(t.elements(), 32 * 64 * 56 * 48);
}

#[test]
fn tensors_past_int_dimensions_are_refused_by_name() {
    let err = TensorDims::packed("conv2d", [1024, 1024, 64, 64]).unwrap_err();
    assert!(matches!(err, OpError::TooLargeForCudnn { op: "conv2d", .. }), "{err}");
    assert!(err.to_string().contains("2^31"));
    assert!(TensorDims::packed("conv2d", [usize::MAX, 2, 1, 1]).is_err());
}

#[test]
fn the_resnet_stem_has_its_output_and_padding() {
    let d = conv([32, 3, 224, 224], [64, 3, 7, 7], 2, 3, 1);
    assert_eq!(d.y.dims, [32, 64, 112, 112]);
    assert_eq!(d.filter, [64, 3, 7, 7]);
    assert_eq!((d.padding, d.stride, d.dilation, d.groups), ([3, 3], [2, 2], [1, 1], 1));
}

#[test]
fn a_depthwise_layer_is_one_grouped_call() {
    // EfficientNet-B0's stage-3 depthwise 5x5 stride 2 over 144 channels.
    let d = conv([8, 144, 56, 56], [144, 1, 5, 5], 2, 2, 144);
    assert_eq!(d.groups, 144);
    assert_eq!(d.filter, [144, 1, 5, 5]);
    assert_eq!(d.y.dims, [8, 144, 28, 28]);
}

#[test]
fn a_grouped_filter_holds_the_channels_of_one_group() {
    let d = conv([2, 64, 8, 8], [128, 16, 3, 3], 1, 1, 4);
    assert_eq!(d.filter, [128, 16, 3, 3]);
    assert_eq!(d.groups, 4);
    assert_eq!(d.y.dims, [2, 128, 8, 8]);
}

#[test]
fn the_max_pool_window_matches_the_cpu_geometry() {
    let x = Tensor::zeros((32, 64, 112, 112), DType::F32, &Device::Cpu).unwrap();
    let g = PoolGeometry::new(&x, 3, 2, 1).unwrap();
    let d = PoolDims::of(&g).unwrap();
    assert_eq!(d.y.dims, [32, 64, 56, 56]);
    assert_eq!((d.window, d.padding, d.stride), ([3, 3], [1, 1], [2, 2]));
    assert_eq!(d.x.dims, [32, 64, 112, 112]);
}

#[test]
fn batch_norm_counts_per_channel_and_unbiases_by_its_count() {
    let d = NormDims::of("batch_norm_train", [4, 16, 5, 5]).unwrap();
    assert_eq!(d.per_channel.dims, [1, 16, 1, 1]);
    assert_eq!(d.x.dims, [4, 16, 5, 5]);
    let (sum_sq, count) = (99.0f64, 4 * 5 * 5);
    assert!((sum_sq / (count as f64 - 1.0) * biased_from_unbiased(count) - sum_sq / count as f64).abs() < 1e-12);
}

#[test]
fn half_precision_runs_on_tensor_cores_and_f32_as_pytorch_does() {
    assert_eq!(Element::of("conv2d", DType::F16).unwrap().math(), Math::TensorCores);
    assert_eq!(Element::of("conv2d", DType::BF16).unwrap().math(), Math::TensorCores);
    assert_eq!(Element::of("conv2d", DType::F32).unwrap().math(), Math::DefaultAllowingTf32);
    assert!(matches!(Element::of("conv2d", DType::F64), Err(OpError::UnsupportedDType { op: "conv2d", dtype: DType::F64 })));
}

fn candidate(algo: u32, supported: bool, workspace: u64) -> Candidate<u32> {
    Candidate { algo, supported, workspace }
}

#[test]
fn the_heuristics_first_choice_is_taken_when_it_fits() {
    let c = [candidate(1, true, 8 << 20), candidate(0, true, 0)];
    let choice = choose(&c, WORKSPACE_BYTES).unwrap();
    assert_eq!((choice.algo, choice.rank, choice.workspace), (1, 0, 8 << 20));
}

#[test]
fn an_algorithm_over_the_workspace_or_unsupported_is_passed_over() {
    let c = [candidate(6, true, WORKSPACE_BYTES + 1), candidate(5, false, 0), candidate(1, true, WORKSPACE_BYTES), candidate(0, true, 0)];
    let choice = choose(&c, WORKSPACE_BYTES).unwrap();
    assert_eq!((choice.algo, choice.rank), (1, 2));
}

#[test]
fn no_fitting_algorithm_is_none() {
    assert_eq!(choose(&[candidate(6, true, 1 << 30), candidate(5, false, 0)], WORKSPACE_BYTES), None);
    assert_eq!(choose::<u32>(&[], WORKSPACE_BYTES), None);
}

#[test]
fn a_plan_is_made_once_per_pass_shape_and_element() {
    let dims = conv([8, 64, 56, 56], [64, 64, 3, 3], 1, 1, 1);
    let key = |pass, element| ConvKey { pass, dims, element };
    let mut cache: PlanCache<ConvKey, usize> = PlanCache::default();
    let mut made = 0;
    let mut make = |_: &ConvKey| -> Result<usize, ()> {
        made += 1;
        Ok(made)
    };
    for _ in 0..3 {
        for pass in [ConvPass::Forward, ConvPass::InputGradient, ConvPass::WeightGradient] {
            cache.get_or_make(key(pass, Element::F32), &mut make).unwrap();
        }
    }
    cache.get_or_make(key(ConvPass::Forward, Element::F16), &mut make).unwrap();
    assert_eq!(cache.made(), 4);
    assert_eq!(*cache.get_or_make(key(ConvPass::InputGradient, Element::F32), &mut make).unwrap(), 2);
}

#[test]
fn a_failed_plan_is_not_cached() {
    let dims = conv([1, 8, 8, 8], [8, 8, 3, 3], 1, 1, 1);
    let key = ConvKey { pass: ConvPass::Forward, dims, element: Element::F32 };
    let mut cache: PlanCache<ConvKey, u8> = PlanCache::default();
    assert_eq!(cache.get_or_make(key, |_| Err::<u8, &str>("no algorithm")), Err("no algorithm"));
    assert_eq!(cache.made(), 0);
    assert_eq!(cache.get_or_make(key, |_| Ok::<u8, &str>(7)), Ok(&7));
    assert_eq!(cache.made(), 1);
}

mod reference {
    use candle_core::{Device, Tensor};

    use super::super::descriptors::{Element, NormDims, PoolDims, TensorDims};
    use super::super::primitives::{At, ConvCall, NormCall, PoolGrads, Primitives};
    use super::super::reference::{on_reference, HostBuffer, Reference};
    use super::super::Body;
    use super::conv;
    use crate::ops::pool::Geometry as PoolGeometry;
    use crate::ops::OpError;

    fn at(buffer: &HostBuffer) -> At<'_, HostBuffer> {
        At { buffer, offset: 0 }
    }

    fn op_error(e: candle_core::Error) -> String {
        e.to_string()
    }

    #[test]
    fn a_pass_runs_on_the_reference_only_inside_its_scope() {
        let x = Tensor::zeros((1, 1, 2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert_eq!(Body::of(&x), None);
        assert_eq!(on_reference(|| Body::of(&x)), Some(Body::Reference));
        assert_eq!(Body::of(&x), None, "the scope ends with the closure");
        let caught = std::panic::catch_unwind(|| on_reference(|| panic!("a failing check")));
        assert!(caught.is_err());
        assert_eq!(Body::of(&x), None, "and with a panic inside it");
    }

    #[test]
    fn a_new_buffer_reads_as_nan_until_written() {
        let buffer = Reference.alloc(Element::F32, 4).unwrap();
        assert!(buffer.values().iter().all(|v| v.is_nan()));
        assert_eq!(Reference.zeros_f32(3).unwrap().values(), [0.0; 3]);
    }

    #[test]
    fn values_are_stored_rounded_to_the_buffers_element() {
        let buffer = HostBuffer::of(Element::F16, &[1.0 + 1e-4, 3.0]);
        assert_eq!(buffer.values(), [1.0, 3.0]);
    }

    #[test]
    fn a_descriptor_past_its_buffer_is_refused_by_name() {
        let d = conv([1, 2, 4, 4], [3, 2, 3, 3], 1, 1, 1);
        let (x, w, y) = (
            HostBuffer::of(Element::F32, &[0.0; 31]),
            HostBuffer::of(Element::F32, &[0.0; 54]),
            Reference.alloc(Element::F32, 48).unwrap(),
        );
        let err = op_error(Reference.convolve(d, Element::F32, ConvCall::Forward { x: at(&x), w: at(&w), y: at(&y) }).unwrap_err());
        assert!(err.contains("conv2d") && err.contains("element 32 of a buffer of 31"), "{err}");
        let offset = At { buffer: &y, offset: 1 };
        let x = HostBuffer::of(Element::F32, &[0.0; 32]);
        let err = op_error(Reference.convolve(d, Element::F32, ConvCall::Forward { x: at(&x), w: at(&w), y: offset }).unwrap_err());
        assert!(err.contains("element 49 of a buffer of 48"), "{err}");
    }

    #[test]
    fn a_convolution_whose_output_does_not_follow_from_its_input_is_refused() {
        let mut d = conv([1, 2, 4, 4], [3, 2, 3, 3], 1, 1, 1);
        d.y = TensorDims::packed("conv2d", [1, 3, 3, 4]).unwrap();
        let (x, w, y) = (
            HostBuffer::of(Element::F32, &[0.0; 32]),
            HostBuffer::of(Element::F32, &[0.0; 54]),
            Reference.alloc(Element::F32, 36).unwrap(),
        );
        let err = Reference.convolve(d, Element::F32, ConvCall::Forward { x: at(&x), w: at(&w), y: at(&y) }).unwrap_err();
        assert!(err.to_string().contains("a descriptor cuDNN would refuse: output [1, 3, 3, 4]"), "{err}");
    }

    #[test]
    fn an_element_type_other_than_the_calls_is_refused() {
        let d = conv([1, 1, 2, 2], [1, 1, 1, 1], 1, 0, 1);
        let (x, w, y) =
            (HostBuffer::of(Element::F16, &[0.0; 4]), HostBuffer::of(Element::F32, &[1.0]), Reference.alloc(Element::F32, 4).unwrap());
        let err = Reference.convolve(d, Element::F32, ConvCall::Forward { x: at(&x), w: at(&w), y: at(&y) }).unwrap_err();
        assert!(err.to_string().contains("F16"), "{err}");
    }

    #[test]
    fn a_grouped_convolution_reads_only_its_groups_channels() {
        // Two groups of one channel: each output is its own input times its weight.
        let d = conv([1, 2, 1, 2], [2, 1, 1, 1], 1, 0, 2);
        let (x, w, y) = (
            HostBuffer::of(Element::F32, &[1.0, 2.0, 3.0, 4.0]),
            HostBuffer::of(Element::F32, &[10.0, 100.0]),
            Reference.alloc(Element::F32, 4).unwrap(),
        );
        Reference.convolve(d, Element::F32, ConvCall::Forward { x: at(&x), w: at(&w), y: at(&y) }).unwrap();
        assert_eq!(y.values(), [10.0, 20.0, 300.0, 400.0]);
        let dx = Reference.alloc(Element::F32, 4).unwrap();
        Reference.convolve(d, Element::F32, ConvCall::InputGradient { dy: at(&y), w: at(&w), dx: at(&dx) }).unwrap();
        assert_eq!(dx.values(), [100.0, 200.0, 30000.0, 40000.0]);
        let dw = Reference.alloc(Element::F32, 2).unwrap();
        Reference.convolve(d, Element::F32, ConvCall::WeightGradient { x: at(&x), dy: at(&y), dw: at(&dw) }).unwrap();
        assert_eq!(dw.values(), [1.0 * 10.0 + 2.0 * 20.0, 3.0 * 300.0 + 4.0 * 400.0]);
    }

    /// cuDNN's max-pool backward sends a window's gradient where `x` equals
    /// `y`: a `y` one rounding away from every `x` of its window loses it.
    #[test]
    fn max_pools_backward_loses_a_window_whose_output_is_not_its_inputs_maximum() {
        let input = Tensor::zeros((1, 1, 2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let d = PoolDims::of(&PoolGeometry::new(&input, 2, 2, 0).unwrap()).unwrap();
        let x = HostBuffer::of(Element::F32, &[0.5, 2.0, 1.0, -1.0]);
        let (y, dy, dx) =
            (Reference.alloc(Element::F32, 1).unwrap(), HostBuffer::of(Element::F32, &[7.0]), Reference.alloc(Element::F32, 4).unwrap());
        Reference.max_pool(d, Element::F32, at(&x), at(&y), None).unwrap();
        assert_eq!(y.values(), [2.0]);
        Reference.max_pool(d, Element::F32, at(&x), at(&y), Some(PoolGrads { dy: at(&dy), dx: at(&dx) })).unwrap();
        assert_eq!(dx.values(), [0.0, 7.0, 0.0, 0.0]);
        let off = HostBuffer::of(Element::F32, &[2.0f32.next_up()]);
        Reference.max_pool(d, Element::F32, at(&x), at(&off), Some(PoolGrads { dy: at(&dy), dx: at(&dx) })).unwrap();
        assert_eq!(dx.values(), [0.0; 4], "no x equals y: the gradient is gone");
    }

    #[test]
    fn batch_norm_under_cudnns_least_epsilon_is_refused() {
        let dims = NormDims::of("batch_norm_train", [2, 1, 1, 2]).unwrap();
        let call = NormCall { dims, element: Element::F32, eps: 1e-6 };
        let (x, p, y) = (
            HostBuffer::of(Element::F32, &[1.0, 2.0, 3.0, 4.0]),
            HostBuffer::of(Element::F32, &[1.0]),
            Reference.alloc(Element::F32, 4).unwrap(),
        );
        let err = Reference.batch_norm(call, at(&x), at(&p), at(&p), at(&y), true).err().unwrap();
        assert!(err.to_string().contains("epsilon 0.000001 is under cuDNN's least"), "{err}");
        let stats = Reference.batch_norm(NormCall { eps: 1e-5, ..call }, at(&x), at(&p), at(&p), at(&y), true).unwrap().unwrap();
        assert_eq!(stats.mean.values(), [2.5]);
        assert!((stats.unbiased_var.values()[0] - 5.0 / 3.0).abs() < 1e-6, "the running variance is the unbiased one");
        assert!((stats.inv_std.values()[0] - 1.0 / (1.25f32 + 1e-5).sqrt()).abs() < 1e-6);
    }

    #[test]
    fn reference_errors_name_the_op() {
        let err = OpError::PastBuffer { op: "max_pool2d", end: 9, len: 8 };
        assert_eq!(err.to_string(), "max_pool2d: a descriptor reaches element 9 of a buffer of 8");
    }
}
