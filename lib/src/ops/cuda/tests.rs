use candle_core::{DType, Device, Tensor};

use super::plan::{
    biased_from_unbiased, choose, Candidate, ConvDims, ConvKey, ConvPass, Element, Math, NormDims, PlanCache, PoolDims, TensorDims,
};
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
