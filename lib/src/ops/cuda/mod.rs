//! The ops' device bodies: convolutions (forward and both gradients,
//! grouped in one call), batch-norm, max-pooling, the activations and the
//! residual add, each keeping for backward what the op keeps on the CPU.
//!
//! `passes` is written once against the primitives of `primitives`, which
//! have two implementations: cuDNN on a card (`cudnn`, the cuda feature)
//! and a reference on host memory (`reference`) that computes what each
//! cuDNN call is documented to compute. `plan` is the descriptors as plain
//! data. Everything but `cudnn` compiles and runs without a GPU:
//! `check-ops --device reference` runs every op's device passes here.

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

pub(super) use passes::{BatchNorm, Consumer, Lean};
pub use reference::on_reference;
use reference::HostBuffer;
pub(super) use reference::Reference;

use passes::Saved;
pub(super) use primitives::Primitives;

/// The one workspace each device keeps for cuDNN, allocated whole on the
/// first convolution: every algorithm is chosen among those that fit it, so
/// the ledger counts exactly this. 64 MiB is under 1% of the lesson's 8 GB
/// card; whether cuDNN's heuristics keep their first choice for every zoo
/// convolution within it is what `conv_algorithms` reports on a GPU.
pub const WORKSPACE_BYTES: u64 = 64 << 20;

/// A convolution plan: the pass, the shapes, the algorithm cuDNN's
/// heuristics gave and the workspace it uses.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ConvAlgorithm {
    pub pass: &'static str,
    pub input: [i32; 4],
    pub filter: [i32; 4],
    pub groups: i32,
    pub element: String,
    pub algorithm: String,
    pub math: String,
    /// Where it stood in the heuristics' order: 0 where it is their first
    /// choice, more where those before it needed more workspace.
    pub rank: usize,
    pub workspace_bytes: u64,
}

/// The convolution plans of a run on CUDA, for `bench train`'s report.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CudnnPlans {
    pub algorithms: Vec<ConvAlgorithm>,
    /// Plans made during the timed steps: none once the warm-up has seen every shape.
    pub made_while_timed: usize,
}

#[cfg(feature = "cuda")]
pub use cudnn::conv_algorithms;
#[cfg(feature = "cuda")]
pub(super) use cudnn::Cudnn;

/// What the batch-norms of one op saved on each device body, for its backward.
#[derive(Default, Clone)]
pub(super) struct DeviceSaves {
    reference: Saved<HostBuffer>,
    #[cfg(feature = "cuda")]
    cuda: Saved<candle_core::CudaStorage>,
}

/// Where a pass on a CPU tensor runs: our CPU kernels, or, inside
/// [`on_reference`], the device passes on the reference primitives.
pub(super) fn on_the_reference() -> bool {
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
    batch_norm_backward, batch_norm_forward, conv_forward, conv_input_gradient, conv_weight_gradient, forward, max_pool_backward,
    max_pool_forward, norm_act_backward, norm_act_forward, norm_add_act_backward, norm_add_act_forward, saved_statistics, silu_backward,
    silu_forward,
};
