//! A configuration written as the command-line flags that reproduce it:
//! `oomcheck`'s for a configuration, `vramlab measure`'s for a step to run.
//! Kept beside the configuration, below everything that shows them (the
//! investigation, the reports); `cli`'s tests parse every fix's flags back.

use super::{Checkpointing, Mode, StepConfig};
use crate::models::{Layers, Shape};

/// The `oomcheck MODEL` flags of `config`; `None` for an input that is not
/// square, which `--res` cannot say.
pub fn oomcheck_flags(config: &StepConfig) -> Option<String> {
    let (c, side) = square(config.input)?;
    let mut flags = format!("--batch {} --res {side}", config.batch);
    if c != 3 {
        flags.push_str(&format!(" --channels {c}"));
    }
    flags.push_str(&levers(config));
    if config.mode == Mode::Inference {
        flags.push_str(" --eval");
    }
    Some(flags)
}

/// The `vramlab measure` flags of a training `config` of a model with
/// `classes` outputs (all but `--model` and `--budget`); `None` where measure
/// cannot run it: inference, or an input that is not square RGB.
pub fn measure_flags(config: &StepConfig, classes: usize) -> Option<String> {
    match (square(config.input)?, config.mode) {
        ((3, side), Mode::Training) => Some(format!("--batch {} --res {side} --classes {classes}{}", config.batch, levers(config))),
        _ => None,
    }
}

fn square(input: Shape) -> Option<(usize, usize)> {
    match input {
        Shape::Map { c, h, w } if h == w => Some((c, h)),
        _ => None,
    }
}

/// Precision, optimizer (training only), accumulation, checkpointing and
/// the layers where they are not the default.
fn levers(config: &StepConfig) -> String {
    let mut flags = String::new();
    if config.precision.is_mixed() {
        flags.push_str(&format!(" --amp {}", config.precision.flag()));
    }
    if config.mode == Mode::Training {
        flags.push_str(&format!(" --opt {}", config.optimizer.flag()));
    }
    if config.accumulation > 1 {
        flags.push_str(&format!(" --accum {}", config.accumulation));
    }
    if config.checkpointing != Checkpointing::None {
        flags.push_str(&format!(" --ckpt {}", config.checkpointing));
    }
    if config.layers != Layers::default() {
        flags.push_str(&format!(" --layers {}", config.layers.flag()));
    }
    flags
}
