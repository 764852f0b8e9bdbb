//! Whether a peak fits a card: comfortably, tightly or not at all. Both the
//! fit report and the search for fixes judge by it.

use std::fmt;

use serde::Serialize;

use crate::gpus::Card;

/// Below this share of the card left free, a fit is called tight: the
/// allocator's fragmentation and a few stray tensors can eat it.
pub const COMFORT: f64 = 0.10;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Fits,
    /// Fits with less than 10% of the card to spare.
    Tight,
    DoesNotFit,
}

/// The most a comfortable configuration may peak at on `device`.
pub fn target_bytes(device: &Card) -> u64 {
    (device.usable_bytes as f64 * (1.0 - COMFORT)) as u64
}

pub fn verdict(peak: u64, device: &Card) -> Verdict {
    if peak <= target_bytes(device) {
        Verdict::Fits
    } else if peak <= device.usable_bytes {
        Verdict::Tight
    } else {
        Verdict::DoesNotFit
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Fits => "fits",
            Verdict::Tight => "fits, but tight",
            Verdict::DoesNotFit => "does not fit",
        })
    }
}
