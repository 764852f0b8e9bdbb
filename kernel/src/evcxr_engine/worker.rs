//! The engine thread: evcxr's context, the jobs it runs, and what a cell's
//! run becomes.

use std::collections::BTreeSet;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use evcxr::{BuildProgress, CommandContext, EvalCallbacks, EvalContext};
use jupyter_protocol::Stdio;
use vramlab::memory::CellProbe;
use vramlab::render::Bundle;

use super::build_notice::BuildNotice;
use super::library::{self, Library};
use super::process::cell_process_command;
use super::pump::Pump;
use super::traceback::{compilation_error, interrupted_error, process_died, returned_error};
use super::{Job, Running};
use crate::engine::{panic_text, Completion, ExecuteJob, Output};
use crate::final_value::FinalValue;
use crate::outcome::{CellError, Outcome};
use crate::slot::BuildSlot;

/// Measured on 2 cores, the machine the README's timings are for.
const FIRST_BUILD: &str = "about 5 minutes on 2 cores";

const PANIC_HOOK_CELL: &str = include_str!("../../assets/panic_hook.rs");

pub(super) struct Worker {
    ctx: CommandContext,
    pump: Pump,
    slot: BuildSlot,
    library: Library,
    running: Arc<Running>,
    memory: Option<Arc<CellProbe>>,
    final_value: FinalValue,
}

impl Worker {
    pub(super) fn run(slot: BuildSlot, library: Library, jobs: Receiver<Job>, running: Arc<Running>, memory: Option<Arc<CellProbe>>) {
        match Self::start(slot, library, running, memory) {
            Ok(mut worker) => jobs.into_iter().for_each(|job| worker.handle(job)),
            Err(why) => Self::refuse_all(jobs, why),
        }
    }

    pub(super) fn start(
        slot: BuildSlot,
        library: Library,
        running: Arc<Running>,
        memory: Option<Arc<CellProbe>>,
    ) -> Result<Worker, String> {
        // Before evcxr's first compile, which reads the build directory's cargo
        // configuration: another checkout sharing the cache may have left its own.
        if let Some(workspace) = library.dir.as_ref().and_then(|d| d.parent()) {
            slot.patch_dependencies(workspace);
        }
        let command = cell_process_command().map(|mut command| {
            if let Some(probe) = &memory {
                probe.share_with(&mut command);
            }
            command
        });
        let (ctx, outputs) = command
            .and_then(EvalContext::with_subprocess_command)
            .map(|(eval, outputs)| (CommandContext::with_eval_context(eval), outputs))
            .map_err(|err| format!("the Rust engine (evcxr) failed to start: {err}"))?;
        let final_value = FinalValue::default();
        let mut worker = Worker { ctx, pump: Pump::start(outputs), slot, library, running, memory, final_value };
        // One compile for both, and the first: a toolchain that cannot build this cannot build any
        // cell, so it is said as the engine's failure to start, in every cell.
        let prepare = format!("{}\n{PANIC_HOOK_CELL}", worker.final_value.definition());
        worker.ctx.execute(&prepare).map_err(|err| format!("the Rust engine (evcxr) failed to start: its first compile failed: {err}"))?;
        Ok(worker)
    }

    pub(super) fn refuse_all(jobs: Receiver<Job>, why: String) {
        log::error!("{why}");
        for job in jobs {
            match job {
                Job::Execute(_, tx) => drop(tx.send(Err(CellError::new("EngineUnavailable", why.clone(), vec![why.clone()])))),
                Job::Complete(_, _, tx) => drop(tx.send(Err(why.clone()))),
                Job::Inspect(_, _, tx) => drop(tx.send(Err(why.clone()))),
            }
        }
    }

    fn handle(&mut self, job: Job) {
        // evcxr's own invariants may panic; one bad request must not end the engine.
        let guarded = |f: &mut dyn FnMut()| {
            if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(f)) {
                log::error!("internal error in the Rust engine: {}", panic_text(&*panic));
            }
        };
        match job {
            Job::Execute(job, tx) => {
                let mut outcome = None;
                guarded(&mut || outcome = Some(self.execute(&job)));
                let outcome = outcome.unwrap_or_else(|| {
                    Err(CellError::new("InternalError", "the Rust engine failed on this cell; the kernel goes on", vec![]))
                });
                let _ = tx.send(outcome);
            }
            Job::Complete(code, cursor, tx) => {
                let mut result = Err("completion failed".to_owned());
                guarded(&mut || {
                    result = self.ctx.completions(&code, cursor).map_err(|e| e.to_string()).map(|c| Completion {
                        kinds: c.completions.iter().map(|c| c.kind.to_owned()).collect(),
                        matches: c.completions.into_iter().map(|c| c.code).collect(),
                        start: c.start_offset,
                        end: c.end_offset,
                    })
                });
                let _ = tx.send(result);
            }
            Job::Inspect(code, cursor, tx) => {
                let mut result = Err("inspection failed".to_owned());
                guarded(&mut || result = self.inspect(&code, cursor));
                let _ = tx.send(result);
            }
        }
    }

    fn inspect(&mut self, code: &str, cursor: usize) -> Result<Option<Bundle>, String> {
        let end = identifier_end(code, cursor);
        let (plain, html) = self.ctx.hover_at(code, end).map_err(|e| e.to_string())?;
        if plain.trim().is_empty() {
            return Ok(None);
        }
        Ok(Some(Bundle::plain(plain).with("text/html", html)))
    }

    fn execute(&mut self, job: &ExecuteJob) -> Outcome {
        if job.code.lines().any(|l| l.trim() == ":quit") {
            return Err(CellError::new(
                "UsageError",
                ":quit would end the kernel without telling Jupyter; use the front end's Shut Down or Restart",
                vec![],
            ));
        }
        crate::syntax::check(&job.code)?;
        if !self.library.loaded && library::wants_library(&job.code) && !job.code.contains(":dep vramlab") {
            self.load_library(&job.output)?;
        }
        let after = self.final_value.after(&job.code);
        if after.settings != self.final_value {
            self.final_value = after.settings;
            self.define_final_value();
        }
        let variables_before: BTreeSet<String> = self.ctx.variables_and_types().map(|(name, _)| name.to_owned()).collect();
        self.pump.attach(job.output.clone());
        *self.running.process.lock().unwrap_or_else(|e| e.into_inner()) = Some(self.ctx.process_handle());
        self.running.interrupted.store(false, Ordering::SeqCst);
        let input = job.input.clone();
        let dependencies = BuildNotice::on_first_dependency(&job.output, "Building the crates this cell depends on");
        let mut callbacks = EvalCallbacks {
            input_reader: &move |request| match &input {
                Some(ask) => ask(&request.prompt, request.is_password).unwrap_or_default(),
                None => String::new(),
            },
            build_progress: &|progress| dependencies.report(progress),
        };
        let ctx = &mut self.ctx;
        let mut run = || ctx.execute_with_callbacks(&job.code, &mut callbacks);
        let result = match &self.memory {
            Some(probe) => probe.measure(run),
            None => run(),
        };
        *self.running.process.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.running.variables.lock().unwrap_or_else(|e| e.into_inner()) =
            self.ctx.variables_and_types().map(|(name, _)| name.to_owned()).collect();
        dependencies.finish(if result.is_ok() { "Built the crates this cell depends on" } else { "The build stopped" });
        let report = self.pump.detach();
        if after.cleared {
            self.define_final_value();
        }
        let interrupted = self.running.interrupted.swap(false, Ordering::SeqCst);
        match result {
            Ok(_) if interrupted => Err(interrupted_error(&variables_before)),
            Ok(outputs) => match (report.panic, outputs.user_error.clone()) {
                (Some(panic), _) => Err(panic.into_error()),
                (None, Some(error)) => Err(returned_error(error)),
                (None, None) => {
                    if outputs.timing.is_some() {
                        job.output.stream(Stdio::Stdout, timing_line(&outputs));
                    }
                    Ok((!outputs.content_by_mime_type.is_empty()).then(|| bundle_of(outputs.content_by_mime_type)))
                }
            },
            Err(evcxr::Error::SubprocessTerminated(_)) if interrupted => Err(interrupted_error(&variables_before)),
            Err(evcxr::Error::SubprocessTerminated(detail)) => Err(process_died(&variables_before, &detail)),
            Err(evcxr::Error::CompilationErrors(errors)) => Err(compilation_error(&errors, &job.code)),
            Err(other) => Err(CellError::new("Error", other.to_string(), vec![other.to_string()])),
        }
    }

    fn define_final_value(&mut self) {
        if let Err(err) = self.ctx.execute(&self.final_value.definition()) {
            log::error!("could not define how final values are shown: {err}");
        }
    }

    /// Adds the `vramlab` crate to the cells' dependencies, with a notice
    /// that follows cargo while it builds.
    fn load_library(&mut self, output: &Output) -> Result<(), CellError> {
        let Some(command) = self.library.dep_command() else {
            return match self.library.missing_message() {
                Some(message) => Err(CellError::new("LibraryUnavailable", message.clone(), vec![message])),
                None => Ok(()),
            };
        };
        let built_before = self.slot.has_compiled("vramlab");
        // A second notebook beside a first: the slot where the library was
        // built is held, and this kernel starts from a copy of that build.
        let copied = match self.slot.busy_with("vramlab").filter(|_| !built_before).map(Path::to_owned) {
            Some(busy) => match self.slot.copy_build_from(&busy) {
                Ok(bytes) => Some((busy, bytes)),
                Err(err) => {
                    log::warn!("could not copy the build in {}: {err}", busy.display());
                    None
                }
            },
            None => None,
        };
        let headline = if built_before {
            "Loading vramlab, built for the cells before".to_owned()
        } else if let Some((busy, bytes)) = &copied {
            format!(
                "Loading vramlab for the cells into {}: another running kernel holds {}, where they were built, and this \
                 kernel starts from a copy of that build ({})",
                self.slot.dir().display(),
                busy.display(),
                vramlab::units::human(*bytes)
            )
        } else if let Some(busy) = self.slot.busy_with("vramlab") {
            format!(
                "Building vramlab and candle for the cells ({FIRST_BUILD}): another running kernel holds {}, where they are \
                 built, and its build could not be copied into {}",
                busy.display(),
                self.slot.dir().display()
            )
        } else {
            format!(
                "Building vramlab and candle for the cells, once: {FIRST_BUILD}; restarts and later kernels reuse it \
                 (`vramlab-kernel build-cells` does it ahead of time)"
            )
        };
        let mut notice = BuildNotice::now(output, headline);
        if built_before || copied.is_some() {
            notice = notice.when_compiling(format!(
                "Rebuilding vramlab for the cells: its sources or dependencies changed since they were built here \
                 (a few minutes for vramlab alone, up to {FIRST_BUILD} when candle changed)"
            ));
        }
        let built = self.build_library(&command, &|progress| notice.report(progress));
        notice.finish(if built.is_ok() { "vramlab ready" } else { "vramlab could not be built" });
        built.map_err(|err| {
            let text = match &err {
                evcxr::Error::CompilationErrors(errors) => errors.iter().map(|e| e.rendered()).collect::<Vec<_>>().join("\n"),
                other => other.to_string(),
            };
            CellError::new("LibraryUnavailable", format!("the vramlab library could not be built: {err}"), vec![text])
        })?;
        self.library.loaded = true;
        Ok(())
    }

    /// Builds the `vramlab` crate for the cells ahead of the first cell that
    /// uses it; `None` when the library's folder is not known.
    pub(super) fn build_library_ahead(&mut self, progress: &dyn Fn(BuildProgress)) -> Option<Result<(), evcxr::Error>> {
        let command = self.library.dep_command()?;
        Some(self.build_library(&command, progress))
    }

    fn build_library(&mut self, dep_command: &str, progress: &dyn Fn(BuildProgress)) -> Result<(), evcxr::Error> {
        if let Some(workspace_lock) = self.library.dir.as_ref().and_then(|d| d.parent()).map(|w| w.join("Cargo.lock")) {
            if workspace_lock.exists() {
                self.slot.pin_dependencies(&workspace_lock);
            }
        }
        let mut callbacks = EvalCallbacks { build_progress: progress, ..EvalCallbacks::default() };
        self.ctx.execute_with_callbacks(dep_command, &mut callbacks).map(drop)
    }
}

fn bundle_of(content: std::collections::HashMap<String, String>) -> Bundle {
    content.into_iter().fold(Bundle::default(), |bundle, (mime, text)| {
        let is_json = mime == "application/json" || mime.ends_with("+json");
        match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(value) if is_json => bundle.with(&mime, value),
            _ => bundle.with(&mime, text),
        }
    })
}

/// What `:timing` shows: the whole evaluation, then evcxr's phases (`Final
/// compile (rustc)` for rustc run alone, `(cargo)` for a build through cargo; a
/// `Fallback` phase is a compile that failed and was redone).
fn timing_line(outputs: &evcxr::EvalOutputs) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let phases: Vec<String> = outputs.phases.iter().map(|p| format!("{} {:.0} ms", p.name, ms(p.duration))).collect();
    format!("Took {:.0} ms: {}\n", outputs.timing.map_or(0.0, ms), phases.join(", "))
}

fn identifier_end(code: &str, cursor: usize) -> usize {
    let cursor = cursor.min(code.len());
    code[cursor..].char_indices().find(|(_, c)| !(c.is_alphanumeric() || *c == '_')).map_or(code.len(), |(i, _)| cursor + i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inspection_extends_to_the_end_of_the_word() {
        assert_eq!(identifier_end("Vec::new()", 2), 3);
        assert_eq!(identifier_end("Vec::new()", 5), 8);
        assert_eq!(identifier_end("abc", 3), 3);
    }

    #[test]
    fn json_bundles_are_values_and_text_stays_text() {
        let mut content = std::collections::HashMap::new();
        content.insert("text/plain".to_owned(), "{\"a\":1}".to_owned());
        content.insert("application/json".to_owned(), "{\"a\":1}".to_owned());
        let bundle = bundle_of(content);
        assert_eq!(bundle.text(), "{\"a\":1}");
        assert_eq!(bundle.get("application/json").unwrap()["a"], 1);
    }
}
