//! A configuration written as the command-line flags that reproduce it:
//! `oomcheck`'s for a configuration, `vramlab measure`'s for a step to run.
//! Kept beside the configuration, below everything that shows them (the
//! investigation, the reports); `cli`'s tests parse every fix's flags back.

use super::{Mode, StepConfig};
use crate::models::Shape;

/// The `oomcheck MODEL` flags of `config`; `None` for an input that is not
/// square, which `--res` cannot say.
pub fn oomcheck_flags(config: &StepConfig) -> Option<String> {
    let (c, side) = square(config.input)?;
    let mut flags = format!("--batch {} --res {side}", config.batch);
    if c != 3 {
        flags.push_str(&format!(" --channels {c}"));
    }
    flags.push_str(&config.levers.flags(config.mode));
    if config.mode == Mode::Inference {
        flags.push_str(" --eval");
    }
    Some(flags)
}

/// The `vramlab measure` flags of a training `config` of a model with
/// `classes` outputs (all but `--model` and `--budget`); `None` where measure
/// cannot run it: inference, an input that is not square RGB, or a step
/// spread over several cards.
pub fn measure_flags(config: &StepConfig, classes: usize) -> Option<String> {
    if config.levers.cards.several() {
        return None;
    }
    match (square(config.input)?, config.mode) {
        ((3, side), Mode::Training) => {
            Some(format!("--batch {} --res {side} --classes {classes}{}", config.batch, config.levers.flags(config.mode)))
        }
        _ => None,
    }
}

fn square(input: Shape) -> Option<(usize, usize)> {
    match input {
        Shape::Map { c, h, w } if h == w => Some((c, h)),
        _ => None,
    }
}
