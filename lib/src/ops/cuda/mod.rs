//! The ops' device bodies: convolutions (forward and both gradients,
//! grouped in one call), batch-norm, max-pooling, the activations and the
//! residual add, each keeping for backward what the op keeps on the CPU.
//!
//! `passes` is written once against the primitives of `primitives`, which
//! have two implementations: cuDNN on a card (`cudnn`, the cuda feature)
//! and a reference on host memory (`reference`) that computes what each
//! cuDNN call is documented to compute. `descriptors` is what the passes
//! ask of the device as plain data, `plan` how cuDNN runs a convolution.
//! Everything but `cudnn` compiles and runs without a GPU:
//! `check-ops --device reference` runs every op's device passes here.

mod algorithms;
mod descriptors;
mod passes;
#[cfg(any(feature = "cuda", test))]
mod plan;
mod primitives;
mod reference;

#[cfg(feature = "cuda")]
mod cudnn;

#[cfg(test)]
mod tests;

use candle_core::Tensor;

pub use algorithms::{ConvAlgorithm, CudnnPlans, WORKSPACE_BYTES};
pub(super) use passes::{Attention, AttentionKeeps as KeepsOnDevice, BatchNorm, Consumer, DeviceSaves, LayerNorm, Lean, Linear};
pub(super) use reference::Reference;
pub use reference::{allocations, on_reference, Allocations};

pub(super) use primitives::Primitives;

#[cfg(feature = "cuda")]
pub use cudnn::conv_algorithms;
#[cfg(feature = "cuda")]
pub(super) use cudnn::Cudnn;

/// Where a pass on a CPU tensor runs: our CPU kernels, or, inside
/// [`on_reference`], the device passes on the reference primitives.
pub fn on_the_reference() -> bool {
    reference::active()
}

/// A device body: the primitives a pass runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Body {
    Reference,
    #[cfg(feature = "cuda")]
    Cuda,
}

impl Body {
    /// The device body a tensor's passes run on; `None` for our CPU kernels.
    pub fn of(t: &Tensor) -> Option<Body> {
        #[cfg(feature = "cuda")]
        if t.device().is_cuda() {
            return Some(Body::Cuda);
        }
        (t.device().is_cpu() && on_the_reference()).then_some(Body::Reference)
    }
}

/// Runs `$pass::<P>` with `P` the primitives of `$body`, the same
/// arguments for either.
macro_rules! on_body {
    ($body:expr, $pass:ident ( $($arg:expr),* $(,)? )) => {
        match $body {
            $crate::ops::cuda::Body::Reference => $pass::<$crate::ops::cuda::Reference>($($arg),*),
            #[cfg(feature = "cuda")]
            $crate::ops::cuda::Body::Cuda => $pass::<$crate::ops::cuda::Cudnn>($($arg),*),
        }
    };
}
pub(super) use on_body;

pub(super) use passes::{
    attention_backward, attention_forward, batch_norm_backward, batch_norm_forward, conv_forward, conv_input_gradient,
    conv_transpose_bias_gradient, conv_transpose_forward, conv_transpose_input_gradient, conv_transpose_weight_gradient,
    conv_weight_gradient, forward, forward_with_bias, gelu_backward, gelu_forward, gelu_linear_input_gradient, layer_norm_backward,
    layer_norm_forward, linear_bias_gradient, linear_forward_fused, linear_input_gradient, linear_weight_gradient_fused, max_pool_backward,
    max_pool_forward, norm_act_backward, norm_act_forward, norm_add_act_backward, norm_add_act_forward, norm_linear_forward,
    saved_statistics, silu_backward, silu_forward,
};
