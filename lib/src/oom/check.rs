use serde::Serialize;

use crate::gpus::Card;
use crate::ledger::validation::card_caveat;
use crate::ledger::{estimate, Ledger, LedgerError, Mode, StepConfig};
use crate::models::ModelSpec;
use crate::units::{human, percent};

use super::fixes::{search, Fix};
use super::verdict::{target_bytes, verdict, Verdict};

/// A ledger checked against its device, with fixes when it doesn't fit comfortably.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckReport {
    pub ledger: Ledger,
    pub verdict: Verdict,
    /// Usable memory minus the peak; negative when it doesn't fit.
    pub headroom_bytes: i64,
    /// What fixes aim under: the usable memory less 10%.
    pub target_bytes: u64,
    /// Ranked, cheapest first; empty when it fits comfortably.
    pub fixes: Vec<Fix>,
    /// How the rules behind a card's figures were last checked on a card
    /// (`ledger::validation`); `None` on the CPU and where a card run confirmed them.
    pub card_caveat: Option<String>,
}

/// Estimates `config` on `device`, judges the fit and, unless it fits
/// comfortably, searches for ranked fixes.
pub fn check(spec: &ModelSpec, config: &StepConfig, device: &Card) -> Result<CheckReport, LedgerError> {
    let ledger = estimate(spec, config, device)?;
    let verdict = verdict(ledger.peak.bytes, device);
    let fixes = if verdict == Verdict::Fits || config.mode == Mode::Inference { Vec::new() } else { search(spec, config, device) };
    Ok(CheckReport {
        headroom_bytes: device.usable_bytes as i64 - ledger.peak.bytes as i64,
        target_bytes: target_bytes(device),
        ledger,
        verdict,
        fixes,
        card_caveat: card_caveat(device),
    })
}

impl CheckReport {
    /// One sentence: the verdict, the peak, the card, the margin.
    pub fn verdict_line(&self) -> String {
        let peak = self.ledger.peak.bytes;
        let device = &self.ledger.device;
        let margin = self.headroom_bytes.unsigned_abs();
        match self.verdict {
            Verdict::Fits => format!(
                "FITS: peak {} on {} leaves {} ({}) free.",
                human(peak),
                device,
                human(margin),
                percent(margin, device.usable_bytes)
            ),
            Verdict::Tight => format!(
                "FITS, BUT TIGHT: peak {} on {} leaves only {} ({}) free; fragmentation can take that.",
                human(peak),
                device,
                human(margin),
                percent(margin, device.usable_bytes)
            ),
            Verdict::DoesNotFit => format!("DOES NOT FIT: peak {} on {} is {} over.", human(peak), device, human(margin)),
        }
    }
}
