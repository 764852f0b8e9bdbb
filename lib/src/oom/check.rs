use serde::Serialize;

use crate::gpus::Card;
use crate::ledger::validation::card_caveat;
use crate::ledger::{estimate, Cards, Ledger, LedgerError, Levers, Mode, Shard, StepConfig};
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
    /// A step spread over several cards: the same samples on one card,
    /// then one card's ledger at each sharding stage.
    pub sharding: Option<Sharding>,
}

/// One card's ledger of a step spread over several, at every sharding
/// stage, beside the same samples on a single card.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sharding {
    /// The cards' samples on one card, `None` where one card cannot take
    /// them (a batch over the largest vramlab costs).
    pub single_card: Option<Ledger>,
    /// One ledger per stage, in [`Shard::ALL`]'s order.
    pub stages: Vec<Ledger>,
}

impl Sharding {
    fn of(spec: &ModelSpec, config: &StepConfig, device: &Card) -> Result<Sharding, LedgerError> {
        let cards = config.levers.cards;
        let single = StepConfig {
            batch: config.batch * cards.count,
            levers: Levers { cards: Cards::default(), ..config.levers.clone() },
            ..config.clone()
        };
        let stages = Shard::ALL
            .into_iter()
            .map(|shard| {
                let levers = Levers { cards: Cards { shard, ..cards }, ..config.levers.clone() };
                estimate(spec, &StepConfig { levers, ..config.clone() }, device)
            })
            .collect::<Result<_, _>>()?;
        Ok(Sharding { single_card: estimate(spec, &single, device).ok(), stages })
    }
}

/// Estimates `config` on `device`, judges the fit and, unless it fits
/// comfortably, searches for ranked fixes.
pub fn check(spec: &ModelSpec, config: &StepConfig, device: &Card) -> Result<CheckReport, LedgerError> {
    let ledger = estimate(spec, config, device)?;
    let verdict = verdict(ledger.peak.bytes, device);
    let fixes = if verdict == Verdict::Fits || config.mode == Mode::Inference { Vec::new() } else { search(spec, config, device) };
    let sharding = if config.levers.cards.several() { Some(Sharding::of(spec, config, device)?) } else { None };
    Ok(CheckReport {
        headroom_bytes: device.usable_bytes as i64 - ledger.peak.bytes as i64,
        target_bytes: target_bytes(device),
        ledger,
        verdict,
        fixes,
        card_caveat: card_caveat(device),
        sharding,
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
