//! The phases of one step, named once. The ledger walks them to predict, the
//! trainer runs and samples them, and a measurement pairs the two by phase,
//! so a prediction cannot pair with the wrong measurement.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::bill::BillKind;
use super::levers::{Cards, Checkpointing, OptimizerKind, Shard};
use super::step_config::{Mode, StepConfig};
use super::LedgerError;

/// One phase of a step, in the order [`StepPlan::phases`] gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepPhase {
    /// The model (and in training the optimizer state) on the device.
    Loaded,
    InputCopied,
    /// Stage `stage`'s forward; the last stage's includes the loss.
    Forward {
        stage: usize,
    },
    /// A checkpointed stage run again during its segment's backward.
    Recompute {
        stage: usize,
    },
    /// The backward of segment `segment` (see [`StepPlan::segments`]).
    Backward {
        segment: usize,
    },
    GraphDropped,
    /// The micro-batch's gradients added into the accumulated ones.
    Accumulated,
    /// On several cards accumulating micro-batches, once their gradients
    /// are summed: the gradients all-reduced (averaged over the cards), a
    /// bucket at a time; ZeRO-2 keeps this card's part of them. Without
    /// accumulation each backward phase exchanges its own.
    GradientsReduced,
    OptimizerStep,
    /// ZeRO-1 and ZeRO-2: each card's updated part of the weights gathered
    /// by every card, a bucket at a time.
    WeightsGathered,
    StepDone,
}

impl StepPhase {
    pub fn is_forward(self) -> bool {
        matches!(self, StepPhase::Forward { .. })
    }

    /// The bill that grows while the phase runs.
    pub fn growing_bill(self) -> BillKind {
        match self {
            StepPhase::InputCopied => BillKind::InputBatch,
            StepPhase::Forward { .. } | StepPhase::Recompute { .. } => BillKind::Activations,
            StepPhase::Backward { .. } | StepPhase::Accumulated => BillKind::Parameters,
            StepPhase::OptimizerStep => BillKind::OptimizerState,
            StepPhase::Loaded
            | StepPhase::GraphDropped
            | StepPhase::GradientsReduced
            | StepPhase::WeightsGathered
            | StepPhase::StepDone => BillKind::ContextAndWorkspace,
        }
    }

    /// What grows in that phase, as a clause in a learner's words.
    pub fn what_grows(self) -> &'static str {
        match self {
            StepPhase::InputCopied => "the input batch is copied in",
            StepPhase::Recompute { .. } => "a checkpointed stage's activations are recomputed",
            StepPhase::Forward { .. } => "the activations forward keeps for backward grow",
            StepPhase::Backward { .. } | StepPhase::Accumulated => {
                "the gradients (parameters bill) grow while forward's activations are not yet all freed"
            }
            StepPhase::OptimizerStep => "the optimizer state (made at the first step) and the update's temporaries grow",
            StepPhase::GradientsReduced | StepPhase::WeightsGathered => "a bucket the cards exchange is added",
            StepPhase::Loaded | StepPhase::GraphDropped | StepPhase::StepDone => "only the workspace grows",
        }
    }
}

/// Stages that run backward together: a run of plain stages, or one
/// checkpointed stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub start: usize,
    pub end: usize,
    pub checkpointed: bool,
}

impl Segment {
    pub fn stages(&self) -> Range<usize> {
        self.start..self.end
    }
}

/// The phases of one step of a model with named stages, under one
/// configuration's checkpointing, accumulation and optimizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    mode: Mode,
    stages: Vec<String>,
    checkpointed: Vec<bool>,
    segments: Vec<Segment>,
    accumulation: usize,
    optimizer: OptimizerKind,
    cards: Cards,
}

impl StepPlan {
    /// The plan of `config`'s step through `stages`.
    pub fn of(stages: &[&str], config: &StepConfig) -> Result<StepPlan, LedgerError> {
        match config.mode {
            Mode::Training => {
                let plan = StepPlan::training(stages, &config.levers.checkpointing, config.levers.accumulation, config.levers.optimizer)?;
                Ok(plan.on(config.levers.cards))
            }
            Mode::Inference => Ok(StepPlan::inference(stages)),
        }
    }

    /// The same plan with its step spread over `cards`. Where the cards
    /// exchange the gradients during backward, it runs one stage at a
    /// time, so that each stage's gradients go as soon as they are made.
    pub fn on(self, cards: Cards) -> StepPlan {
        let mut plan = StepPlan { cards, ..self };
        if plan.reduces_in_backward() {
            plan.segments = (0..plan.stages.len())
                .map(|stage| Segment { start: stage, end: stage + 1, checkpointed: plan.is_checkpointed(stage) })
                .collect();
        }
        plan
    }

    pub fn training(
        stages: &[&str],
        checkpointing: &Checkpointing,
        accumulation: usize,
        optimizer: OptimizerKind,
    ) -> Result<StepPlan, LedgerError> {
        let checkpointed = checkpointing.resolve_names(stages)?;
        Ok(StepPlan {
            mode: Mode::Training,
            stages: stages.iter().map(|&s| s.to_owned()).collect(),
            segments: segments(&checkpointed),
            checkpointed,
            accumulation,
            optimizer,
            cards: Cards::default(),
        })
    }

    /// Forward only: no graph, nothing recomputed.
    pub fn inference(stages: &[&str]) -> StepPlan {
        let checkpointed = vec![false; stages.len()];
        StepPlan {
            mode: Mode::Inference,
            stages: stages.iter().map(|&s| s.to_owned()).collect(),
            segments: segments(&checkpointed),
            checkpointed,
            accumulation: 1,
            optimizer: OptimizerKind::Sgd,
            cards: Cards::default(),
        }
    }

    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    pub fn is_checkpointed(&self, stage: usize) -> bool {
        self.checkpointed.get(stage).copied().unwrap_or(false)
    }

    /// Consecutive plain stages form one segment; each checkpointed stage is
    /// its own. Backward runs them last to first.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Every phase of the step, in the order it runs.
    pub fn phases(&self) -> Vec<StepPhase> {
        let mut phases = vec![StepPhase::Loaded, StepPhase::InputCopied];
        phases.extend((0..self.stages.len()).map(|stage| StepPhase::Forward { stage }));
        if self.mode == Mode::Inference {
            return phases;
        }
        phases.extend((0..self.segments.len()).rev().map(|segment| StepPhase::Backward { segment }));
        phases.push(StepPhase::GraphDropped);
        if self.accumulation > 1 {
            phases.push(StepPhase::Accumulated);
        }
        if self.all_reduces() {
            phases.push(StepPhase::GradientsReduced);
        }
        phases.push(StepPhase::OptimizerStep);
        if self.gathers_updated_weights() {
            phases.push(StepPhase::WeightsGathered);
        }
        phases.push(StepPhase::StepDone);
        phases
    }

    /// Several cards exchange each backward segment's gradients inside its
    /// phase, once the segment is done, as DDP reduces a bucket once
    /// backward has made it: all-reduced (DDP, ZeRO-1), each reduced to the
    /// card that updates it (ZeRO-2), reduce-scattered (ZeRO-3). With
    /// accumulation, DDP to ZeRO-2 wait until the micro-batches' gradients
    /// are summed.
    pub fn reduces_in_backward(&self) -> bool {
        self.cards.several() && (self.accumulation == 1 || self.cards.shard == Shard::Parameters)
    }

    /// Whether segment `segment`'s backward starts from the gradient that
    /// reached its output as it is (`Tensor::backward_with`), not from a
    /// scalar root: a plain segment below another plain one, which only
    /// several cards make.
    pub fn starts_from_gradient(&self, segment: usize) -> bool {
        let plain = |i: usize| self.segments.get(i).is_some_and(|s| !s.checkpointed);
        plain(segment) && plain(segment + 1)
    }

    /// Several cards reduce the gradients once backward is done and the
    /// micro-batches' gradients are summed.
    pub fn all_reduces(&self) -> bool {
        self.cards.several() && !self.reduces_in_backward()
    }

    /// Several cards that keep whole weights but update only their part.
    pub fn gathers_updated_weights(&self) -> bool {
        self.cards.several() && matches!(self.cards.shard, Shard::Optimizer | Shard::Gradients)
    }

    /// The phase that runs after `phase`; a recompute belongs to its
    /// segment's backward.
    pub fn after(&self, phase: StepPhase) -> Option<StepPhase> {
        let phase = match phase {
            StepPhase::Recompute { stage } => StepPhase::Backward { segment: self.segment_of(stage)? },
            phase => phase,
        };
        let phases = self.phases();
        let index = phases.iter().position(|&p| p == phase)?;
        phases.get(index + 1).copied()
    }

    fn segment_of(&self, stage: usize) -> Option<usize> {
        self.segments.iter().position(|s| s.stages().contains(&stage))
    }

    /// The phase's name as the ledger's timeline, the trainer's samples and
    /// an out-of-memory error show it.
    pub fn name(&self, phase: StepPhase) -> String {
        match phase {
            StepPhase::Loaded if self.mode == Mode::Inference => "model loaded".to_owned(),
            StepPhase::Loaded => "model and optimizer state loaded".to_owned(),
            StepPhase::InputCopied => "input batch copied to the device".to_owned(),
            StepPhase::Forward { stage } => {
                let loss = self.mode == Mode::Training && stage + 1 == self.stages.len();
                format!("forward {}{}", self.stage_name(stage), if loss { " and loss" } else { "" })
            }
            StepPhase::Recompute { stage } => format!("backward {}, recomputing its forward", self.stage_name(stage)),
            StepPhase::Backward { segment } => {
                let stages = self.segments.get(segment).map_or(0..0, Segment::stages);
                let exchanged = match self.cards.shard {
                    _ if !self.reduces_in_backward() => "",
                    Shard::None | Shard::Optimizer => ", gradients all-reduced",
                    Shard::Gradients => ", gradients reduced to their cards",
                    Shard::Parameters => ", gradients reduce-scattered",
                };
                format!("backward {}{exchanged}", self.stages[stages].join(", "))
            }
            StepPhase::GraphDropped => "loss and graph dropped".to_owned(),
            StepPhase::Accumulated => "gradients added to the accumulator".to_owned(),
            StepPhase::GradientsReduced if self.cards.shard == Shard::Gradients => {
                format!("gradients reduced over {} cards, this card's part kept", self.cards.count)
            }
            StepPhase::GradientsReduced => format!("gradients all-reduced over {} cards", self.cards.count),
            StepPhase::OptimizerStep if self.cards.shard > Shard::None => format!("{} step on this card's part", self.optimizer),
            StepPhase::OptimizerStep => format!("{} step", self.optimizer),
            StepPhase::WeightsGathered => format!("updated weights gathered from {} cards", self.cards.count),
            StepPhase::StepDone => "step done, batch and gradients freed".to_owned(),
        }
    }

    fn stage_name(&self, stage: usize) -> &str {
        self.stages.get(stage).map_or("?", String::as_str)
    }
}

fn segments(checkpointed: &[bool]) -> Vec<Segment> {
    let mut segments: Vec<Segment> = Vec::new();
    for (stage, &checkpointed) in checkpointed.iter().enumerate() {
        match segments.last_mut() {
            Some(last) if !checkpointed && !last.checkpointed => last.end = stage + 1,
            _ => segments.push(Segment { start: stage, end: stage + 1, checkpointed }),
        }
    }
    segments
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAGES: [&str; 4] = ["stem", "layer1", "layer2", "head"];

    fn plan(checkpointing: Checkpointing, accumulation: usize) -> StepPlan {
        StepPlan::training(&STAGES, &checkpointing, accumulation, OptimizerKind::Adam).unwrap()
    }

    #[test]
    fn checkpointed_stages_are_segments_of_their_own() {
        let plan = plan(Checkpointing::Segments(vec!["layer1".into()]), 1);
        let segments: Vec<_> = plan.segments().iter().map(|s| (s.stages(), s.checkpointed)).collect();
        assert_eq!(segments, [(0..1, false), (1..2, true), (2..4, false)]);
        let names: Vec<String> = plan.phases().into_iter().map(|p| plan.name(p)).collect();
        assert_eq!(
            names,
            [
                "model and optimizer state loaded",
                "input batch copied to the device",
                "forward stem",
                "forward layer1",
                "forward layer2",
                "forward head and loss",
                "backward layer2, head",
                "backward layer1",
                "backward stem",
                "loss and graph dropped",
                "Adam step",
                "step done, batch and gradients freed",
            ]
        );
    }

    #[test]
    fn several_cards_run_backward_a_stage_at_a_time_each_from_its_gradient() {
        let cards = Cards { count: 2, ..Cards::default() };
        let spread = plan(Checkpointing::Segments(vec!["layer1".into()]), 1).on(cards);
        let segments: Vec<_> = spread.segments().iter().map(|s| (s.stages(), s.checkpointed)).collect();
        assert_eq!(segments, [(0..1, false), (1..2, true), (2..3, false), (3..4, false)]);
        let from_gradient: Vec<bool> = (0..4).map(|i| spread.starts_from_gradient(i)).collect();
        assert_eq!(from_gradient, [false, false, true, false], "only a plain stage below a plain one");
        assert!(spread.reduces_in_backward() && !spread.all_reduces());
        let accumulating = plan(Checkpointing::None, 2).on(cards);
        assert_eq!(accumulating.segments().len(), 1, "accumulating, backward stays in one piece");
        assert!(accumulating.all_reduces() && !accumulating.starts_from_gradient(0));
    }

    #[test]
    fn accumulation_adds_its_phase_and_inference_stops_after_forward() {
        let accumulating = plan(Checkpointing::None, 4);
        let phases = accumulating.phases();
        let at = phases.iter().position(|&p| p == StepPhase::Accumulated).unwrap();
        assert_eq!(phases[at - 1], StepPhase::GraphDropped);
        assert_eq!(phases[at + 1], StepPhase::OptimizerStep);

        let inference = StepPlan::inference(&STAGES);
        assert_eq!(inference.phases().last(), Some(&StepPhase::Forward { stage: 3 }));
        assert_eq!(inference.name(StepPhase::Forward { stage: 3 }), "forward head");
        assert_eq!(inference.name(StepPhase::Loaded), "model loaded");
    }

    #[test]
    fn a_recompute_is_followed_by_what_follows_its_backward() {
        let plan = plan(Checkpointing::Stages, 1);
        assert_eq!(plan.after(StepPhase::Recompute { stage: 0 }), Some(StepPhase::GraphDropped));
        assert_eq!(plan.after(StepPhase::Forward { stage: 3 }), Some(StepPhase::Backward { segment: 3 }));
        assert_eq!(plan.after(StepPhase::StepDone), None);
        assert_eq!(plan.name(StepPhase::Recompute { stage: 1 }), "backward layer1, recomputing its forward");
    }

    #[test]
    fn no_two_phases_share_a_name() {
        for checkpointing in [Checkpointing::None, Checkpointing::Stages, Checkpointing::Segments(vec!["stem".into(), "layer2".into()])] {
            let plan = plan(checkpointing, 2);
            let mut names: Vec<String> = plan.phases().into_iter().map(|p| plan.name(p)).collect();
            names.extend((0..STAGES.len()).map(|stage| plan.name(StepPhase::Recompute { stage })));
            let distinct: std::collections::HashSet<&String> = names.iter().collect();
            assert_eq!(distinct.len(), names.len(), "{names:?}");
        }
    }

    #[test]
    fn an_unknown_stage_is_named_with_the_valid_ones() {
        let err = StepPlan::training(&STAGES, &Checkpointing::Segments(vec!["layer9".into()]), 1, OptimizerKind::Sgd).unwrap_err();
        assert_eq!(err.to_string(), "cannot checkpoint `layer9`: no such stage; stages: stem, layer1, layer2, head");
    }
}
