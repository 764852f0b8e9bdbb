//! The activation a lean op applies after its batch-norm.

use candle_core::{Result, Tensor};

/// The activation after a batch-norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Identity,
    Relu,
    Silu,
}

impl Activation {
    /// The activation as the plain layers run it: candle's op on a tensor.
    pub fn forward(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Identity => Ok(x.clone()),
            Activation::Relu => x.relu(),
            Activation::Silu => super::silu(x),
        }
    }
}
