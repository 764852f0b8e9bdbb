use std::fmt;

use serde::{Deserialize, Serialize};

/// The shape of one sample's activation: a feature map, a flat vector, or a
/// sequence of tokens (a transformer's, `n` tokens of `d` features).
///
/// Batch is kept out of the shape on purpose: every per-layer cost is
/// computed per sample and multiplied by the batch only when a ledger asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Shape {
    Map { c: usize, h: usize, w: usize },
    Flat { features: usize },
    Tokens { n: usize, d: usize },
}

impl Shape {
    pub fn map(c: usize, h: usize, w: usize) -> Self {
        Shape::Map { c, h, w }
    }

    pub fn elems(&self) -> u64 {
        match *self {
            Shape::Map { c, h, w } => (c * h * w) as u64,
            Shape::Flat { features } => features as u64,
            Shape::Tokens { n, d } => (n * d) as u64,
        }
    }

    /// Channels of a map, features of a vector or of each token.
    pub fn channels(&self) -> usize {
        match *self {
            Shape::Map { c, .. } => c,
            Shape::Flat { features } => features,
            Shape::Tokens { d, .. } => d,
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Shape::Map { c, h, w } => write!(f, "{c}x{h}x{w}"),
            Shape::Flat { features } => write!(f, "{features}"),
            Shape::Tokens { n, d } => write!(f, "{n} tokens x {d}"),
        }
    }
}
