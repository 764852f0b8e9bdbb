//! When a step runs out of memory: the lesson's seven-step investigation
//! (section 4.2), run on this process for the step that failed.
//!
//! Steps 4, 5 and 7 run real steps: a fresh trainer of the same model and
//! levers, on synthetic batches of the same shape, given the room the failed
//! step had (the card's budget less what the process held besides that
//! trainer), so that a configuration that runs here also runs as
//! `vramlab measure ... --budget` in a process of its own. Their time is
//! bounded by [`Limits`]; what was skipped is said, with why.

use std::time::Instant;

use candle_core::{DType, Tensor};
use serde::Serialize;

use crate::gpus::Card;
use crate::ledger::{estimate, measure_flags, BillKind, Ledger, Levers, Mode, StepConfig};
use crate::memory::{Budget, HostMemory, OutOfMemory, Processes};
use crate::models::{Network, Precision, Shape};
use crate::oom::{search, Fix, FixCost, FixKind};
use crate::render::{Bundle, Composer, Render, Table};
use crate::train::{last_step_oom, OptimizerConfig, StepOom, TrainConfig, Trainer};
use crate::units::human;

/// How much the investigation may run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Seconds for all the real steps together; a trial that would start
    /// after them is skipped. `VRAMLAB_DIAGNOSIS_SECONDS` overrides the default of 120.
    pub seconds: f64,
    /// Fixes verified with a real step, cheapest first.
    pub fixes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        let seconds = std::env::var("VRAMLAB_DIAGNOSIS_SECONDS").ok().and_then(|s| s.parse().ok()).filter(|s: &f64| *s >= 0.0);
        Limits { seconds: seconds.unwrap_or(120.0), fixes: 3 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// What the step found, without a verdict.
    Found,
    /// Ruled out.
    Clear,
    /// A cause, or part of one.
    Problem,
    /// Not run, and why is in the finding.
    Skipped,
    /// Fixes were found and at least one ran where the failed step ran.
    Remedied,
    /// No fix was found.
    Unremedied,
    /// Fixes were found, and none of those tried ran where the failed step ran.
    Unverified,
}

/// One step of the investigation and what it found on this process.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub name: String,
    pub finding: String,
    /// The finding in a line, for the brief report.
    pub brief: String,
    pub outcome: Outcome,
}

/// A real step run for the investigation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Trial {
    pub config: StepConfig,
    /// It ran without running out of memory.
    pub ran: bool,
    /// The most it held of the card at once: its trainer and batches (what
    /// was in use before it left out) and, on a simulated card, the context.
    pub peak_bytes: Option<u64>,
    /// The card it was given: the failed step's room and the context.
    pub card_bytes: Option<u64>,
    pub loss: Option<f32>,
    pub steps: usize,
    pub seconds: f64,
    pub error: Option<String>,
}

/// A fix from the ledger, and whether a real step confirmed it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckedFix {
    pub kind: FixKind,
    pub change: String,
    /// The `vramlab measure` flags of the whole fixed configuration, all but
    /// `--model` and `--budget`; `None` when measure cannot express its input.
    pub flags: Option<String>,
    pub predicted_peak_bytes: u64,
    /// The measured peak when verified, the prediction otherwise.
    pub peak_bytes: u64,
    /// A real step of this configuration ran within the failed step's room.
    pub verified: bool,
    /// What happened when it was tried, or why it was not.
    pub check: String,
    pub cost: FixCost,
}

/// The investigation of one out-of-memory error.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diagnosis {
    pub message: String,
    pub requested_bytes: Option<u64>,
    /// The phase of the step in progress, when a trainer raised it.
    pub phase: Option<String>,
    pub growing: Option<BillKind>,
    pub steps: Vec<Finding>,
    pub fixes: Vec<CheckedFix>,
    /// The command that reproduces the failed step in a process of its own.
    pub reproduce: Option<String>,
    pub processes: Processes,
    pub seconds: f64,
}

/// The last report shown, kept where every cell's copy of the crate sees it.
const SHOWN: &str = "last_diagnosis";

#[derive(Serialize, serde::Deserialize)]
struct Shown {
    message: String,
    report: Bundle,
}

/// The investigation for an error whose text is `message`: the trainer's
/// step when it raised it, the budget's bare error otherwise. Kept, so that
/// [`last_error`] shows it again without running the steps twice.
pub fn diagnose(message: &str, limits: &Limits) -> Diagnosis {
    let step = last_step_oom().filter(|s| message.contains(&s.message) || s.message.contains(message.trim()));
    let diagnosis = match step {
        Some(step) => Investigation::of_step(&step, limits).run(),
        None => {
            Investigation::of_error(message, crate::memory::last_out_of_memory().filter(|o| message.contains(&o.to_string())), limits).run()
        }
    };
    crate::memory::shared::store(SHOWN, Some(&Shown { message: diagnosis.message.clone(), report: diagnosis.bundle() }));
    diagnosis
}

/// How much of the investigation the kernel shows under a failed cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Detail {
    /// Every step's finding in full, and the fixes' table.
    #[default]
    Full,
    /// One line a step and a fix; `%oomcheck --last-error` shows the rest.
    Brief,
}

const DETAIL: &str = "diagnosis_detail";

/// Sets how much the investigations shown from now on in this process say.
pub fn set_detail(detail: Detail) {
    crate::memory::shared::store(DETAIL, Some(&detail));
}

/// What the kernel shows under a cell whose step ran out of memory: the
/// investigation in the detail [`set_detail`] chose. The whole report is
/// kept for [`last_error`] either way.
pub fn investigate(message: &str, limits: &Limits) -> Bundle {
    let diagnosis = diagnose(message, limits);
    match crate::memory::shared::load(DETAIL).unwrap_or_default() {
        Detail::Full => diagnosis.bundle(),
        Detail::Brief => diagnosis.brief(),
    }
}

/// There is no out-of-memory error to investigate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no out-of-memory error in this process yet: the investigation appears under the cell whose step fails, and here after it")]
pub struct NoError;

/// The investigation of this process's last out-of-memory error: the one
/// already shown, or run now (an error raised outside a trainer included).
pub fn last_error() -> Result<Bundle, NoError> {
    let shown: Option<Shown> = crate::memory::shared::load(SHOWN);
    let latest = last_step_oom().map(|s| s.message).or_else(|| crate::memory::last_out_of_memory().map(|o| o.to_string()));
    match (shown, latest) {
        (Some(shown), Some(latest)) if shown.message.contains(&latest) || latest.contains(&shown.message) => Ok(shown.report),
        (_, Some(latest)) => Ok(diagnose(&latest, &Limits::default()).bundle()),
        (Some(shown), None) => Ok(shown.report),
        (None, None) => Err(NoError),
    }
}

struct Investigation<'a> {
    message: String,
    simulated: Option<OutOfMemory>,
    step: Option<&'a StepOom>,
    limits: Limits,
}

impl<'a> Investigation<'a> {
    fn of_step(step: &'a StepOom, limits: &Limits) -> Self {
        Investigation { message: step.message.clone(), simulated: step.simulated.clone(), step: Some(step), limits: *limits }
    }

    fn of_error(message: &str, simulated: Option<OutOfMemory>, limits: &Limits) -> Investigation<'static> {
        Investigation { message: message.trim().to_owned(), simulated, step: None, limits: *limits }
    }

    fn run(self) -> Diagnosis {
        let started = Instant::now();
        let deadline = started + std::time::Duration::from_secs_f64(self.limits.seconds);
        let processes = crate::memory::processes();
        let memory = HostMemory::sample();
        let budget = self.simulated.as_ref().map(|o| o.budget).or(memory.budget);
        let tenants = budget.map_or_else(Vec::new, |b| crate::memory::tenants(b.usable));
        let shared = tenants.iter().map(|t| t.bytes).sum::<u64>();
        let mut others = processes.finding();
        let mut others_brief = first_clause(&others);
        if !tenants.is_empty() {
            let named: Vec<String> = tenants
                .iter()
                .map(|t| {
                    let what = processes.processes.iter().find(|p| p.pid == t.pid).map_or("process".to_owned(), |p| p.role.to_string());
                    format!("{what} {} holds {}", t.pid, human(t.bytes))
                })
                .collect();
            others = format!(
                "on this simulated card: {} (each its own CUDA context and cuDNN workspace, and its tensors), {} in all; {others}",
                named.join(", "),
                human(shared)
            );
            others_brief = format!("on this simulated card: {}", named.join(", "));
        }
        if self.step.is_some_and(|s| s.cuda.is_some()) {
            others.push_str(&match nvidia_smi() {
                Some(apps) if apps.is_empty() => "; nvidia-smi lists no compute process on the GPU".to_owned(),
                Some(apps) => {
                    format!("; nvidia-smi's compute processes (pid, name, memory): {}", apps.lines().collect::<Vec<_>>().join("; "))
                }
                None => "; nvidia-smi did not run here, so the GPU's other processes are unknown".to_owned(),
            });
        }
        let mut steps = vec![
            self.failed_allocation(),
            Finding {
                name: "2. who else holds the device".into(),
                finding: others,
                brief: others_brief,
                outcome: if !tenants.is_empty() { Outcome::Problem } else { Outcome::Clear },
            },
        ];
        // What the card's other processes hold is not this step's to use: the fixes are ranked for the rest.
        let card = budget.map(|b| {
            let card = b.device();
            Card { usable_bytes: card.usable_bytes.saturating_sub(shared), ..card }
        });
        let failed = self.step.map(step_config);
        let ledger = match (self.step, &failed, &card) {
            (Some(step), Some(config), Some(card)) => estimate(&step.spec, config, card).ok(),
            _ => None,
        };
        steps.push(summary(&memory, budget, ledger.as_ref()));
        let mut fixes = Vec::new();
        match (self.step, failed) {
            (Some(step), Some(failed)) => {
                let room = budget.map(|b| b.room().saturating_sub(step.outside));
                let mut trials = Trials { step, room, deadline };
                let one =
                    trials.run(&StepConfig { batch: 1, levers: Levers { accumulation: 1, ..failed.levers.clone() }, ..failed.clone() });
                steps.push(batch_one(one.as_ref(), &failed, ledger.as_ref()));
                steps.push(precision_off(&mut trials, &failed, one.as_ref()));
                steps.push(host_side(&memory));
                if let Some(card) = &card {
                    fixes = verified_fixes(&mut trials, &step.spec, &failed, card, self.limits.fixes);
                }
                steps.push(fixes_finding(&fixes, &failed, card.is_some(), shared));
                crate::train::remember_step_oom(step);
            }
            _ => {
                let why = "the error was raised outside a trainer's step, so there is no step to run again; \
                           %oomcheck MODEL --batch B --res R --gpu CARD predicts the fixes of a configuration";
                steps.push(skipped("4. batch 1", why));
                steps.push(skipped("5. mixed precision off", why));
                steps.push(host_side(&memory));
                steps.push(skipped("7. ranked fixes", why));
            }
        }
        let reproduce = match (self.step, budget) {
            // `vramlab measure` runs zoo models only.
            (Some(step), Some(budget)) if step.spec.name.parse::<crate::models::ModelName>().is_ok() => {
                measure_flags(&step_config(step), step.spec.num_classes)
                    .map(|flags| format!("vramlab measure --model {} {flags} --budget {}", step.spec.name, budget.name()))
            }
            _ => None,
        };
        Diagnosis {
            message: self.message.clone(),
            requested_bytes: self.simulated.as_ref().map(|o| o.requested),
            phase: self.step.map(|s| s.phase_name.clone()),
            growing: self.step.map(|s| s.phase.growing_bill()),
            steps,
            fixes,
            reproduce,
            processes,
            seconds: started.elapsed().as_secs_f64(),
        }
    }

    fn failed_allocation(&self) -> Finding {
        let name = "1. the failed allocation".to_owned();
        let phase = self.step.map_or(String::new(), |s| format!(" during {}", s.phase_name));
        let brief = match &self.simulated {
            Some(oom) => format!("tried to allocate {}{phase}, with {} of the card left", human(oom.requested), human(oom.free())),
            None => format!("the error does not say how much was asked for{phase}"),
        };
        let finding = match (&self.simulated, self.step) {
            (Some(oom), step) => {
                let during = step.map_or(String::new(), |s| format!(" during {}, when {}", s.phase_name, s.phase.what_grows()));
                let others = if oom.others > 0 { format!(", {} other processes", human(oom.others)) } else { String::new() };
                format!(
                    "tried to allocate {}{during}; {} of the card's {} were taken ({} CUDA context, {} cuDNN workspace{others}, {} in use), \
                     leaving {}",
                    human(oom.requested),
                    human(oom.budget.held_by_card() + oom.others + oom.in_use),
                    human(oom.budget.usable),
                    human(oom.budget.context),
                    human(oom.budget.workspace),
                    human(oom.in_use),
                    human(oom.free())
                )
            }
            (None, Some(step)) => format!(
                "the device's own error, which does not name its size: \"{}\", in {}, when {}",
                first_line(&step.message),
                step.phase_name,
                step.phase.what_grows()
            ),
            (None, None) => format!("\"{}\": the error does not say how much was asked for", first_line(&self.message)),
        };
        Finding { name, finding, brief, outcome: Outcome::Found }
    }
}

/// The GPU's compute processes as `nvidia-smi` lists them, when it runs.
fn nvidia_smi() -> Option<String> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"])
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or(text)
}

fn skipped(name: &str, why: &str) -> Finding {
    Finding {
        name: name.to_owned(),
        finding: format!("skipped: {why}"),
        brief: format!("skipped: {}", first_clause(why)),
        outcome: Outcome::Skipped,
    }
}

fn step_config(step: &StepOom) -> StepConfig {
    StepConfig { batch: step.batch, input: step.input, levers: step.config.levers(step.layers), mode: Mode::Training }
}

/// Step 3: PyTorch's `memory_summary`, for this process.
fn summary(memory: &HostMemory, budget: Option<Budget>, ledger: Option<&Ledger>) -> Finding {
    let mut finding = format!(
        "now that the failed step has let go of its tensors: in use {}, held by the allocator {}",
        human(memory.in_use),
        human(memory.held)
    );
    if let Some(peak) = memory.peak {
        finding.push_str(&format!(", peak {} (during the failed step)", human(peak)));
    }
    if let Some(budget) = budget {
        finding.push_str(&format!(
            "; on the simulated {} card ({} context, {} cuDNN workspace): largest free block {} (the budget counts bytes and does not fragment; memory::SimulatedCard models a caching allocator that does)",
            human(budget.usable),
            human(budget.context),
            human(budget.workspace),
            human(budget.room().saturating_sub(memory.in_use))
        ));
    }
    if let Some(card) = crate::memory::card_stats() {
        finding.push_str(&format!("; the process's simulated card (caching allocator): {card}"));
    }
    if let Some(ledger) = ledger {
        let at_peak = crate::memory::Prediction::from_ledger(ledger).bills;
        let bill = |kind: BillKind| human(at_peak.get(kind));
        finding.push_str(&format!(
            "; the ledger for this step: parameters {}, optimizer state {}, activations {}, input {}, context and workspace {}: peak {} against {} usable",
            bill(BillKind::Parameters),
            bill(BillKind::OptimizerState),
            bill(BillKind::Activations),
            bill(BillKind::InputBatch),
            bill(BillKind::ContextAndWorkspace),
            human(ledger.peak.bytes),
            human(ledger.device.usable_bytes)
        ));
    }
    let mut brief = format!("in use {}, held {}", human(memory.in_use), human(memory.held));
    if let Some(peak) = memory.peak {
        brief.push_str(&format!(", peak {} during the failed step", human(peak)));
    }
    if let Some(ledger) = ledger {
        brief.push_str(&format!("; the ledger's peak {} against {} usable", human(ledger.peak.bytes), human(ledger.device.usable_bytes)));
    }
    Finding { name: "3. memory summary".into(), finding, brief, outcome: Outcome::Found }
}

fn batch_one(trial: Option<&Trial>, failed: &StepConfig, ledger: Option<&Ledger>) -> Finding {
    let name = "4. batch 1".to_owned();
    let Some(trial) = trial else { return skipped(&name, SKIPPED_FOR_TIME) };
    let state = ledger.map(|l| {
        let at_peak = crate::memory::Prediction::from_ledger(l).bills;
        at_peak.get(BillKind::Parameters) + at_peak.get(BillKind::OptimizerState)
    });
    if trial.ran {
        Finding {
            name,
            finding: format!(
                "batch 1 runs where the failed step ran ({}): the model, its gradients and optimizer state fit; \
                 what does not is what grows with the batch of {}, its activations: the fixes below shrink them",
                trial.describe_peak(),
                failed.batch
            ),
            brief: format!(
                "batch 1 runs{}: what grows with the batch of {} does not fit",
                trial.peak_bytes.map_or(String::new(), |p| format!(", peak {}", human(p))),
                failed.batch
            ),
            outcome: Outcome::Clear,
        }
    } else {
        Finding {
            name,
            finding: format!(
                "batch 1 fails too ({}): the problem is the parameters, their gradients and optimizer state{} or the context, not the data; \
                 no batch size fixes it: SGD or 8-bit Adam, a smaller model, or a larger card",
                trial.error.as_deref().map_or("out of memory", first_line),
                state.map_or(String::new(), |s| format!(" (the ledger: {})", human(s)))
            ),
            brief: "batch 1 fails too: the model's state or the context does not fit, whatever the batch".to_owned(),
            outcome: Outcome::Problem,
        }
    }
}

fn precision_off(trials: &mut Trials<'_>, failed: &StepConfig, mixed_one: Option<&Trial>) -> Finding {
    let name = "5. mixed precision off";
    if !failed.levers.precision.is_mixed() {
        return skipped(name, "the step ran in f32: there is no mixed precision to turn off (step 7 tries turning it on)");
    }
    let f32_one = trials.run(&StepConfig {
        batch: 1,
        levers: Levers { accumulation: 1, precision: Precision::F32, ..failed.levers.clone() },
        ..failed.clone()
    });
    let (Some(mixed_one), Some(f32_one)) = (mixed_one, f32_one) else { return skipped(name, SKIPPED_FOR_TIME) };
    let finite = |t: &Trial| t.loss.is_some_and(f32::is_finite);
    let brief = match (finite(mixed_one), finite(&f32_one)) {
        (true, true) => "both give a finite loss: mixed precision is not what breaks this step".to_owned(),
        (false, true) => format!("the loss is finite in f32 but not with {}", failed.levers.precision),
        (_, false) => "the loss is not finite even in f32".to_owned(),
    };
    let behaviour = match (finite(mixed_one), finite(&f32_one)) {
        (true, true) => format!(
            "both give a finite loss ({} with {}, {} in f32): mixed precision is not what breaks this step",
            mixed_one.loss.map_or("-".into(), |l| format!("{l:.4}")),
            failed.levers.precision,
            f32_one.loss.map_or("-".into(), |l| format!("{l:.4}"))
        ),
        (false, true) => {
            format!(
                "the loss is finite in f32 but not with {}: an op misbehaves in half precision; keep it in f32",
                failed.levers.precision
            )
        }
        (_, false) => "the loss is not finite even in f32: the problem is not half precision".to_owned(),
    };
    Finding {
        name: name.to_owned(),
        finding: format!(
            "batch 1 in f32 {}, with {} {}; {behaviour}",
            if f32_one.ran { format!("runs ({})", f32_one.describe_peak()) } else { "fails".to_owned() },
            failed.levers.precision,
            if mixed_one.ran { format!("runs ({})", mixed_one.describe_peak()) } else { "fails".to_owned() },
        ),
        brief,
        outcome: if finite(&f32_one) && !finite(mixed_one) { Outcome::Problem } else { Outcome::Clear },
    }
}

/// Step 6: the second kind of OOM, in host RAM.
fn host_side(memory: &HostMemory) -> Finding {
    let host = Card::host().ok();
    let total = crate::memory::host_total();
    let loader_text = match crate::data::loader_usage() {
        None => "no data loader was made in this process".to_owned(),
        Some(l) => format!(
            "its data loaders hold {} now (at most {}); the last made has {} worker{} x prefetch {} of batch {}{}",
            human(l.held),
            human(l.peak),
            l.workers,
            if l.workers == 1 { "" } else { "s" },
            l.prefetch,
            l.batch_size,
            l.host_budget.map_or(String::new(), |b| format!(", host budget {}", human(b)))
        ),
    };
    let share = total.map(|t| memory.rss as f64 / t as f64);
    let verdict = if share.is_some_and(|s| s > 0.5) { "the host, not the card, is what runs out" } else { "host RAM is not the problem" };
    let brief = format!("RSS {}{}: {verdict}", human(memory.rss), total.map_or(String::new(), |t| format!(" of {} host RAM", human(t))));
    let finding = format!(
        "this process's RSS is {} (high-water {}){}{}; {loader_text}{}",
        human(memory.rss),
        human(memory.hwm),
        total.map_or(String::new(), |t| format!(" of {} host RAM", human(t))),
        host.map_or(String::new(), |h| format!(", {} available", human(h.usable_bytes))),
        if share.is_some_and(|s| s > 0.5) {
            ": the host, not the card, is what runs out; lower the loader's workers x prefetch, or use workers 0 to check the code first"
        } else {
            ": host RAM is not the problem"
        }
    );
    Finding {
        name: "6. host side".into(),
        finding,
        brief,
        outcome: if share.is_some_and(|s| s > 0.5) { Outcome::Problem } else { Outcome::Clear },
    }
}

fn verified_fixes(
    trials: &mut Trials<'_>,
    spec: &crate::models::ModelSpec,
    failed: &StepConfig,
    card: &Card,
    verify: usize,
) -> Vec<CheckedFix> {
    let mut runnable = 0;
    search(spec, failed, card)
        .into_iter()
        .map(|fix| {
            let flags = measure_flags(&fix.config, trials.step.spec.num_classes);
            let several = fix.config.levers.cards.several();
            let rank = runnable;
            runnable += usize::from(!several);
            let (verified, peak_bytes, check) = if several {
                (false, fix.peak_bytes, "not run: it takes several cards, and this process runs one".to_owned())
            } else if rank >= verify {
                (false, fix.peak_bytes, format!("not run: only the {verify} cheapest are verified"))
            } else {
                match trials.run(&fix.config) {
                    None => (false, fix.peak_bytes, format!("not run: {SKIPPED_FOR_TIME}")),
                    Some(trial) if trial.ran => {
                        (true, trial.peak_bytes.unwrap_or(fix.peak_bytes), format!("verified: {}", trial.describe_peak()))
                    }
                    Some(trial) => {
                        (false, fix.peak_bytes, format!("failed: {}", trial.error.as_deref().map_or("out of memory", first_line)))
                    }
                }
            };
            let Fix { kind, change, peak_bytes: predicted_peak_bytes, cost, .. } = fix;
            CheckedFix { kind, change, flags, predicted_peak_bytes, peak_bytes, verified, check, cost }
        })
        .collect()
}

fn fixes_finding(fixes: &[CheckedFix], failed: &StepConfig, simulated: bool, shared: u64) -> Finding {
    let name = "7. ranked fixes";
    if !simulated {
        return skipped(name, "the fixes are judged against a simulated card's budget; on CUDA, %oomcheck --gpu with this card ranks them");
    }
    let verified = fixes.iter().filter(|f| f.verified).count();
    if fixes.is_empty() {
        let finding = if shared > 0 {
            format!(
                "the ledger finds no configuration of this model that fits in what the card's other processes leave ({} of it is \
                 theirs): stop them, or a smaller model or a larger card",
                human(shared)
            )
        } else {
            "the ledger finds no configuration of this model that fits this card: a smaller model or a larger card".to_owned()
        };
        let brief = if shared > 0 {
            "no configuration fits what the card's other processes leave: stop them first"
        } else {
            "no configuration of this model fits this card"
        };
        return Finding { name: name.to_owned(), finding, brief: brief.to_owned(), outcome: Outcome::Unremedied };
    }
    Finding {
        name: name.to_owned(),
        finding: format!(
            "the ledger finds {} fix{} that fit{} the card with 10% to spare, cheapest first (accuracy risk, then a changed effective batch, then time): {}; \
             {verified} of them verified with real steps where the failed step ran. {}",
            fixes.len(),
            if fixes.len() == 1 { "" } else { "es" },
            if fixes.len() == 1 { "s" } else { "" },
            fixes.iter().map(|f| f.change.as_str()).collect::<Vec<_>>().join("; "),
            lesson_levers(fixes, failed)
        ),
        brief: format!(
            "{} fix{} with 10% to spare, {verified} verified by real steps",
            fixes.len(),
            if fixes.len() == 1 { "" } else { "es" }
        ),
        outcome: match verified {
            0 if fixes.iter().all(|f| f.check.starts_with("not run")) => Outcome::Skipped,
            0 => Outcome::Unverified,
            _ => Outcome::Remedied,
        },
    }
}

/// Where the lesson's three levers, in its order, stand in the ranking.
fn lesson_levers(fixes: &[CheckedFix], failed: &StepConfig) -> String {
    let levers = [(FixKind::MixedPrecision, "AMP"), (FixKind::Accumulation, "accumulation"), (FixKind::Checkpointing, "checkpointing")];
    let placed: Vec<String> = levers
        .iter()
        .map(|&(kind, lever)| match fixes.iter().position(|fix| fix.kind == kind) {
            Some(rank) => format!("{lever} is #{}", rank + 1),
            None if kind == FixKind::MixedPrecision && failed.levers.precision.is_mixed() => format!("{lever} was already on"),
            None => format!("{lever} alone does not fit"),
        })
        .collect();
    format!("The lesson's levers, in its order: {}", placed.join("; "))
}

/// Runs real steps for the investigation, each in the failed step's room.
struct Trials<'a> {
    step: &'a StepOom,
    room: Option<u64>,
    deadline: Instant,
}

/// A trial's out-of-memory error said against the card: the trial's budget is the card's less what
/// the process held besides the failed step, counted from the trial's start, a figure of no card.
/// The room is what the card left the trial once its other processes' share is taken.
fn in_the_failed_steps_room(oom: &OutOfMemory, card: Budget, room: u64) -> String {
    let room = room.saturating_sub(oom.others);
    let phase = oom.phase.as_deref().map_or(String::new(), |phase| format!(" during {phase}"));
    let others = if oom.others > 0 { format!(", {} other processes", human(oom.others)) } else { String::new() };
    format!(
        "out of memory (simulated device budget, CPU): tried to allocate {}{phase}, with the room the failed step had, {} of the {} card \
         ({} CUDA context, {} cuDNN workspace{others})",
        human(oom.requested),
        human(room),
        human(card.usable),
        human(card.context),
        human(card.workspace)
    )
}

/// At most this many steps a trial: the first creates the optimizer state,
/// the second runs with it; f16's loss scaler may skip some first.
const TRIAL_STEPS: usize = 4;

impl Trials<'_> {
    /// The trial of `config`; `None` once the investigation's time is spent.
    fn run(&mut self, config: &StepConfig) -> Option<Trial> {
        if Instant::now() >= self.deadline {
            return None;
        }
        let budget = crate::memory::budget();
        let context = budget.map_or(0, |b| b.held_by_card());
        let card_bytes = self.room.map(|room| room + context);
        let mut trial =
            Trial { config: config.clone(), ran: false, peak_bytes: None, card_bytes, loss: None, steps: 0, seconds: 0.0, error: None };
        let started = Instant::now();
        let start = HostMemory::sample().in_use;
        let trial_budget =
            budget.zip(self.room).map(|(card, room)| (card, room, Budget { usable: start + room + card.held_by_card(), ..card }));
        if let Some((_, _, trial_budget)) = trial_budget {
            let _ = crate::memory::set_trial_budget(Some(trial_budget));
        }
        let result = self.steps(config, start);
        if budget.is_some() {
            let _ = crate::memory::set_trial_budget(budget);
        }
        match result {
            Ok((steps, loss, peak)) => {
                trial.ran = true;
                trial.steps = steps;
                trial.loss = Some(loss);
                trial.peak_bytes = peak.map(|p| p + context);
            }
            Err(error) => {
                let in_the_room = crate::memory::last_out_of_memory()
                    .zip(trial_budget)
                    .filter(|(oom, (_, _, trial))| oom.budget == *trial && crate::train::is_out_of_memory(&error.to_string()));
                trial.error = Some(match in_the_room {
                    Some((oom, (card, room, _))) => in_the_failed_steps_room(&oom, card, room),
                    None => error.to_string(),
                });
            }
        }
        trial.seconds = started.elapsed().as_secs_f64();
        Some(trial)
    }

    fn steps(&self, config: &StepConfig, start: u64) -> Result<(usize, f32, Option<u64>), crate::train::TrainError> {
        let step = self.step;
        let device = step.device()?;
        let net = Network::with_layers(&step.spec, config.input, &device, 0, config.levers.layers)?;
        let mut train = TrainConfig {
            precision: config.levers.precision,
            accumulation: config.levers.accumulation,
            checkpointing: config.levers.checkpointing.clone(),
            ..step.config.clone()
        };
        if train.optimizer.kind() != config.levers.optimizer {
            train.optimizer = OptimizerConfig::for_kind(config.levers.optimizer, step.config.optimizer.learning_rate());
        }
        // Memory does not depend on the loss scale; a small first scale spares the skipped steps.
        train.scaler.init_scale = 1024.0;
        train.schedule = None;
        let mut trainer = Trainer::new(net, train)?;
        let micro_batches = (0..config.levers.accumulation)
            .map(|i| synthetic_batch(config.batch, config.input, step.spec.num_classes, &device, i as u64))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let (mut peak, mut loss, mut applied) = (None::<u64>, f32::NAN, false);
        let mut steps = 0;
        while steps < TRIAL_STEPS && !(applied && steps >= 2) {
            let report = trainer.step(&micro_batches, 0)?;
            steps += 1;
            applied |= !report.skipped;
            loss = report.loss;
            if let Some(memory) = report.memory {
                peak = Some(peak.unwrap_or(0).max(memory.peak.saturating_sub(start)));
            }
        }
        Ok((steps, loss, peak))
    }
}

const SKIPPED_FOR_TIME: &str = "the investigation's time for real steps was spent (VRAMLAB_DIAGNOSIS_SECONDS)";

impl Trial {
    fn describe_peak(&self) -> String {
        let peak = self.peak_bytes.map_or("peak not counted".to_owned(), |p| format!("peak {}", human(p)));
        let steps = format!("{} step{}, {:.1} s", self.steps, if self.steps == 1 { "" } else { "s" }, self.seconds);
        match self.card_bytes {
            Some(card) => format!("{peak} of {}, context and workspace included; {steps}", human(card)),
            None => format!("{peak}; {steps}"),
        }
    }
}

fn synthetic_batch(
    batch: usize,
    input: Shape,
    classes: usize,
    device: &candle_core::Device,
    seed: u64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let Shape::Map { c, h, w } = input else {
        return Err(candle_core::Error::Msg(format!("a step needs an image input, got {input}")));
    };
    let images = Tensor::randn(0f32, 1f32, (batch, c, h, w), device)?;
    let labels: Vec<u32> = (0..batch as u64).map(|i| ((i + seed) % classes.max(1) as u64) as u32).collect();
    let labels = Tensor::from_vec(labels, batch, device)?.to_dtype(DType::U32)?;
    Ok((images, labels))
}

impl Diagnosis {
    /// The seven steps as a table.
    pub fn steps_table(&self) -> Table {
        let mut table = Table::new(["step", "what it found on this process"]).title("The OOM investigation (lesson 4.2)");
        for step in &self.steps {
            table.push_row([format!("{}{}", step.name, step.outcome.mark()), step.finding.clone()]);
        }
        table.note(format!("{:.1} s, real steps included", self.seconds))
    }

    pub fn fixes_table(&self) -> Table {
        let mut table = Table::new(["#", "fix", "measure flags", "predicted peak", "measured peak", "check"])
            .title("Ranked fixes (cheapest first)")
            .right_align(&[0, 3, 4]);
        for (i, fix) in self.fixes.iter().enumerate() {
            table.push_row([
                (i + 1).to_string(),
                fix.change.clone(),
                fix.flags.clone().unwrap_or_else(|| "-".into()),
                human(fix.predicted_peak_bytes),
                if fix.verified { human(fix.peak_bytes) } else { "-".into() },
                fix.check.clone(),
            ]);
        }
        let verified = "Verified: real steps of that configuration ran on the card the failed step had (its budget less what the process held besides that trainer); \
                        peaks include the card's CUDA context and cuDNN workspace.";
        table.note(match &self.reproduce {
            Some(command) => format!("{verified} The failed step again, in a process of its own: {command}"),
            None => verified.to_owned(),
        })
    }

    /// One line: what failed, where.
    pub fn headline(&self) -> String {
        let what = self.requested_bytes.map_or("Out of memory".to_owned(), |r| format!("Out of memory: tried to allocate {}", human(r)));
        match &self.phase {
            Some(phase) => format!("{what} during {phase}. What the investigation found:"),
            None => format!("{what}. What the investigation found:"),
        }
    }
}

impl Render for Diagnosis {
    fn bundle(&self) -> Bundle {
        let mut composer = Composer::new().headline(&self.headline(), "#b00020").html_only(&self.steps_table().bundle());
        if !self.fixes.is_empty() {
            composer = composer.html_only(&self.fixes_table().bundle());
        }
        let html = composer.finish();
        Bundle::plain(self.to_string()).with("text/html", html.get("text/html").cloned().unwrap_or_default())
    }
}

impl Diagnosis {
    pub fn evcxr_display(&self) {
        self.bundle().print_as_cell_result();
    }
}

impl Diagnosis {
    /// Each step and each fix in a line: what a reader needs to act, with
    /// the way to the whole report.
    pub fn brief(&self) -> Bundle {
        let mut steps = Table::new(["step", "found"]).title(self.headline());
        for step in &self.steps {
            steps.push_row([format!("{}{}", step.name, step.outcome.mark()), step.brief.clone()]);
        }
        let mut fixes = Table::new(["#", "fix", "predicted peak", "measured peak"]).right_align(&[0, 2, 3]);
        for (i, fix) in self.fixes.iter().enumerate() {
            let measured = match (fix.verified, fix.check.starts_with("failed")) {
                (true, _) => human(fix.peak_bytes),
                (false, true) => "failed".to_owned(),
                (false, false) => "not run".to_owned(),
            };
            fixes.push_row([(i + 1).to_string(), fix.change.clone(), human(fix.predicted_peak_bytes), measured]);
        }
        let whole = format!("({:.1} s, real steps included.) The whole report: %oomcheck --last-error", self.seconds);
        let fixes = (!self.fixes.is_empty()).then_some(fixes);
        let text = match &fixes {
            Some(fixes) => format!("{steps}\n{fixes}{whole}\n"),
            None => format!("{steps}{whole}\n"),
        };
        let mut composer = Composer::new().html_only(&steps.bundle());
        if let Some(fixes) = &fixes {
            composer = composer.html_only(&fixes.bundle());
        }
        let html = composer.html_only(&Bundle::plain(whole.clone())).finish();
        Bundle::plain(text).with("text/html", html.get("text/html").cloned().unwrap_or_default())
    }
}

/// A sentence's opening: up to the first semicolon, colon or parenthesis
/// after a few words, and never more than a line.
fn first_clause(finding: &str) -> String {
    const LONGEST: usize = 110;
    let cut = finding
        .char_indices()
        .skip(24)
        .find(|&(i, c)| matches!(c, ';' | ':' | '(') && (c == '(' || finding[i + 1..].starts_with(' ')))
        .map_or(finding.len(), |(i, _)| i);
    let clause = finding[..cut].trim_end();
    if clause.chars().count() <= LONGEST {
        return clause.to_owned();
    }
    let end = clause.char_indices().nth(LONGEST - 1).map_or(clause.len(), |(i, _)| i);
    let end = clause[..end].rfind(' ').unwrap_or(end);
    format!("{}...", &clause[..end])
}

/// The report as text: the headline, each step wrapped under its name, the fixes' table.
impl std::fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}\n", self.headline())?;
        let wrap = textwrap::Options::new(100).initial_indent("   ").subsequent_indent("   ");
        for step in &self.steps {
            writeln!(f, "{}{}", step.name, step.outcome.mark())?;
            writeln!(f, "{}", textwrap::fill(&step.finding, &wrap))?;
        }
        writeln!(f, "({:.1} s, real steps included)", self.seconds)?;
        if !self.fixes.is_empty() {
            write!(f, "\n{}", self.fixes_table())?;
        }
        Ok(())
    }
}

impl Outcome {
    fn mark(self) -> &'static str {
        match self {
            Outcome::Found => "",
            Outcome::Clear => " (ruled out)",
            Outcome::Problem => " (a cause)",
            Outcome::Skipped => " (skipped)",
            Outcome::Remedied => " (verified by real steps)",
            Outcome::Unremedied => " (no fix found)",
            Outcome::Unverified => " (none verified)",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oom::Risk;

    /// The kernel investigates every cell error that reads as an
    /// out-of-memory error: saying that there is none must not read as one.
    #[test]
    fn no_error_yet_does_not_read_as_an_out_of_memory_error() {
        assert!(!crate::train::is_out_of_memory(&super::NoError.to_string()));
    }

    fn fix(kind: FixKind) -> CheckedFix {
        let cost =
            FixCost { extra_time_pct: 0, accuracy_risk: Risk::None, effective_batch: 32, effective_batch_kept: true, note: String::new() };
        CheckedFix {
            kind,
            change: format!("{kind:?}"),
            flags: None,
            predicted_peak_bytes: 0,
            peak_bytes: 0,
            verified: true,
            check: String::new(),
            cost,
        }
    }

    #[test]
    fn a_brief_finding_is_its_first_clause_within_a_line() {
        assert_eq!(
            first_clause("no other vramlab process is running on this machine: nothing else competes for the card"),
            "no other vramlab process is running on this machine"
        );
        assert_eq!(
            first_clause("on this simulated card: vramlab command 22103 holds 364 MiB (each its own CUDA context)"),
            "on this simulated card: vramlab command 22103 holds 364 MiB"
        );
        assert_eq!(first_clause("batch 1 runs where the failed step ran"), "batch 1 runs where the failed step ran");
        let long = "word ".repeat(40);
        let cut = first_clause(&long);
        assert!(cut.ends_with("...") && cut.chars().count() <= 113, "{cut}");
    }

    #[test]
    fn the_brief_report_has_a_line_a_step_and_a_fix_and_names_the_whole() {
        let diagnosis = Diagnosis {
            message: "out of memory".into(),
            requested_bytes: Some(32 << 20),
            phase: Some("backward head".into()),
            growing: None,
            steps: vec![
                Finding {
                    name: "1. the failed allocation".into(),
                    finding: "tried to allocate 32.0 MiB; more".into(),
                    brief: "tried to allocate 32.0 MiB".into(),
                    outcome: Outcome::Found,
                },
                Finding {
                    name: "2. who else holds the device".into(),
                    finding: "no other vramlab process is running here: nothing else competes".into(),
                    brief: "no other vramlab process is running here".into(),
                    outcome: Outcome::Clear,
                },
            ],
            fixes: vec![fix(FixKind::Accumulation)],
            reproduce: None,
            processes: Processes { processes: Vec::new() },
            seconds: 1.5,
        };
        let text = diagnosis.brief().text().to_owned();
        assert!(text.starts_with("Out of memory: tried to allocate 32.0 MiB during backward head."), "{text}");
        assert!(text.contains("2. who else holds the device (ruled out)  no other vramlab process is running here"), "{text}");
        assert!(text.contains("Accumulation") && text.ends_with("The whole report: %oomcheck --last-error\n"), "{text}");
        assert!(!text.contains("nothing else") && !text.contains("more"), "{text}");
        assert_eq!(text.lines().count(), 10, "{text}");
    }

    /// The sentence says where each of the lesson's levers stands in the ranking shown above it.
    #[test]
    fn the_lesson_levers_are_placed_by_the_ranking() {
        let f32_step = StepConfig::training(128, 64);
        let ranked = [fix(FixKind::Accumulation), fix(FixKind::LargestBatch), fix(FixKind::Checkpointing)];
        assert_eq!(
            lesson_levers(&ranked, &f32_step),
            "The lesson's levers, in its order: AMP alone does not fit; accumulation is #1; checkpointing is #3"
        );
        let amp_step = StepConfig { levers: Levers { precision: Precision::F16Amp, ..f32_step.levers.clone() }, ..f32_step };
        assert_eq!(
            lesson_levers(&[fix(FixKind::SmallerResolution)], &amp_step),
            "The lesson's levers, in its order: AMP was already on; accumulation alone does not fit; checkpointing alone does not fit"
        );
    }
}
