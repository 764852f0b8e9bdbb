use std::fmt;

use serde::{Deserialize, Serialize};

/// The arithmetic a training step runs in.
///
/// With mixed precision the master weights, gradients and optimizer state stay
/// in f32; convolutions and matmuls run on half-precision copies, and
/// batch-norm runs in f32 (candle-nn's `forward_train` rejects half inputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    #[value(name = "f32")]
    F32,
    #[value(name = "f16")]
    F16Amp,
    #[value(name = "bf16")]
    Bf16Amp,
}

impl Precision {
    /// Bytes per element of the activations flowing between layers.
    pub fn compute_bytes(self) -> u64 {
        match self {
            Precision::F32 => 4,
            Precision::F16Amp | Precision::Bf16Amp => 2,
        }
    }

    pub fn is_mixed(self) -> bool {
        self != Precision::F32
    }

    /// The dtype convolutions and matmuls run in.
    pub fn compute_dtype(self) -> candle_core::DType {
        match self {
            Precision::F32 => candle_core::DType::F32,
            Precision::F16Amp => candle_core::DType::F16,
            Precision::Bf16Amp => candle_core::DType::BF16,
        }
    }

    /// The flag value that selects it (`f32`, `f16`, `bf16`).
    pub fn flag(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16Amp => "f16",
            Precision::Bf16Amp => "bf16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::F16Amp => "f16 mixed precision",
            Precision::Bf16Amp => "bf16 mixed precision",
        })
    }
}

/// Bytes of one f32 element: master weights, gradients, optimizer state, BN internals.
pub const F32_BYTES: u64 = 4;
