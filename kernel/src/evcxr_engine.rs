//! The evcxr engine on its own thread: cells, completion, inspection,
//! interrupts, and the output pump that streams a cell's output while it runs.

use std::collections::BTreeSet;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{select, Receiver, Sender};
use evcxr::{CommandContext, CompilationError, EvalCallbacks, EvalContext, EvalContextOutputs};
use jupyter_protocol::Stdio;
use serde::Deserialize;
use tokio::sync::oneshot;
use vramlab::memory::CellProbe;
use vramlab::render::{Bundle, DisplayFrame};

use crate::engine::{panic_text, CellError, Completion, Engine, ExecuteJob, Outcome, Output};
use crate::final_value::FinalValue;
use crate::install::LIB_ENV;
use crate::slot::BuildSlot;

const PANIC_PREFIX: &str = "\u{1e}vramlab:panic ";
const PANIC_HOOK_CELL: &str = include_str!("../assets/panic_hook.rs");
/// How long stderr must stay quiet after a cell ends before the cell is
/// reported done: the cell's last stderr lines travel on their own pipe.
const STDERR_SETTLE: Duration = Duration::from_millis(2);

enum Job {
    Execute(ExecuteJob, oneshot::Sender<Outcome>),
    Complete(String, usize, oneshot::Sender<Result<Completion, String>>),
    Inspect(String, usize, oneshot::Sender<Result<Option<Bundle>, String>>),
}

/// The cell process of the cell now running, so that an interrupt can stop it.
#[derive(Default)]
struct Running {
    process: Mutex<Option<Arc<Mutex<Child>>>>,
    interrupted: AtomicBool,
}

pub struct EvcxrEngine {
    jobs: Sender<Job>,
    running: Arc<Running>,
}

impl EvcxrEngine {
    /// Takes a build directory and starts the engine thread. The evcxr
    /// context itself is created on that thread (a few seconds), so the
    /// kernel answers kernel_info at once; cells wait for it.
    pub fn start() -> anyhow::Result<EvcxrEngine> {
        let slot = BuildSlot::acquire()?;
        // Read by evcxr when it creates its context; set before any other thread runs.
        std::env::set_var("EVCXR_TMPDIR", slot.dir());
        let library = Library::locate();
        let memory = match CellProbe::create() {
            Ok(probe) => {
                let probe = Arc::new(probe);
                crate::magic::mem::attach(Arc::clone(&probe));
                Some(probe)
            }
            Err(err) => {
                log::warn!("%mem will not work: {err}");
                None
            }
        };
        let (jobs, receiver) = crossbeam_channel::unbounded();
        let running = Arc::new(Running::default());
        let worker_running = Arc::clone(&running);
        std::thread::Builder::new()
            .name("evcxr".into())
            .spawn(move || Worker::run(slot, library, receiver, worker_running, memory))?;
        Ok(EvcxrEngine { jobs, running })
    }

    fn submit<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Job) -> oneshot::Receiver<T> {
        let (tx, rx) = oneshot::channel();
        if self.jobs.send(make(tx)).is_err() {
            log::error!("the evcxr engine thread has stopped");
        }
        rx
    }
}

impl Engine for EvcxrEngine {
    fn execute(&self, job: ExecuteJob) -> oneshot::Receiver<Outcome> {
        self.submit(|tx| Job::Execute(job, tx))
    }

    fn complete(&self, code: String, cursor: usize) -> oneshot::Receiver<Result<Completion, String>> {
        self.submit(|tx| Job::Complete(code, cursor, tx))
    }

    fn inspect(&self, code: String, cursor: usize) -> oneshot::Receiver<Result<Option<Bundle>, String>> {
        self.submit(|tx| Job::Inspect(code, cursor, tx))
    }

    fn interrupt(&self) -> bool {
        let process = self.running.process.lock().unwrap_or_else(|e| e.into_inner());
        let Some(process) = process.as_ref() else { return false };
        self.running.interrupted.store(true, Ordering::SeqCst);
        let mut child = process.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(err) = child.kill() {
            log::warn!("could not stop the cell process: {err}");
        }
        true
    }
}

/// Where the `vramlab` crate is, for cells that use it without `:dep`.
struct Library {
    dir: Option<PathBuf>,
    loaded: bool,
}

impl Library {
    fn locate() -> Library {
        let dir = std::env::var_os(LIB_ENV)
            .map(PathBuf::from)
            .or_else(|| Some(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../lib"))))
            .filter(|d| d.join("Cargo.toml").exists())
            .and_then(|d| d.canonicalize().ok());
        if dir.is_none() {
            log::warn!("the vramlab library was not found (set {LIB_ENV}); cells must add it with :dep");
        }
        Library { dir, loaded: false }
    }

    fn dep_command(&self) -> Option<String> {
        let dir = self.dir.as_ref()?;
        // A kernel built for CUDA gives its cells CUDA tensors too.
        let features = if cfg!(feature = "cuda") { ", features = [\"cuda\"]" } else { "" };
        Some(format!(":dep vramlab = {{ path = {:?}{features} }}", dir.display().to_string()))
    }
}

struct Worker {
    ctx: CommandContext,
    pump: Pump,
    slot: BuildSlot,
    library: Library,
    running: Arc<Running>,
    memory: Option<Arc<CellProbe>>,
    final_value: FinalValue,
}

impl Worker {
    fn run(slot: BuildSlot, library: Library, jobs: Receiver<Job>, running: Arc<Running>, memory: Option<Arc<CellProbe>>) {
        let command = cell_process_command().map(|mut command| {
            if let Some(probe) = &memory {
                probe.share_with(&mut command);
            }
            command
        });
        let (ctx, outputs) = match command.and_then(EvalContext::with_subprocess_command) {
            Ok((eval, outputs)) => (CommandContext::with_eval_context(eval), outputs),
            Err(err) => return Self::refuse_all(jobs, format!("the Rust engine (evcxr) failed to start: {err}")),
        };
        let final_value = FinalValue::default();
        let mut worker = Worker { ctx, pump: Pump::start(outputs), slot, library, running, memory, final_value };
        // One compile for both: the start of the first cell waits for it.
        let prepare = format!("{}\n{PANIC_HOOK_CELL}", worker.final_value.definition());
        if let Err(err) = worker.ctx.execute(&prepare) {
            log::error!("could not prepare the cell process (panic hook, final values): {err}");
        }
        for job in jobs {
            worker.handle(job);
        }
    }

    fn refuse_all(jobs: Receiver<Job>, why: String) {
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
        let guarded = |f: &mut dyn FnMut() -> ()| {
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
        if !self.library.loaded && job.code.contains("vramlab") {
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
        let mut callbacks = EvalCallbacks {
            input_reader: &move |request| match &input {
                Some(ask) => ask(&request.prompt, request.is_password).unwrap_or_default(),
                None => String::new(),
            },
        };
        let ctx = &mut self.ctx;
        let mut run = || ctx.execute_with_callbacks(&job.code, &mut callbacks);
        let result = match &self.memory {
            Some(probe) => probe.measure(run),
            None => run(),
        };
        *self.running.process.lock().unwrap_or_else(|e| e.into_inner()) = None;
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

    /// Adds the `vramlab` crate to the cells' dependencies, telling the user
    /// when that means a long first build.
    fn load_library(&mut self, output: &Output) -> Result<(), CellError> {
        let Some(command) = self.library.dep_command() else { return Ok(()) };
        let note = if self.slot.has_compiled("vramlab") {
            "Loading vramlab (compiled by an earlier kernel; a few seconds)...\n".to_owned()
        } else {
            "Building vramlab and candle for this kernel's cells. The first build takes a few minutes; \
             restarts and later kernels reuse it.\n"
                .to_owned()
        };
        output.stream(Stdio::Stderr, note);
        if let Some(workspace_lock) = self.library.dir.as_ref().and_then(|d| d.parent()).map(|w| w.join("Cargo.lock")) {
            if workspace_lock.exists() {
                self.slot.pin_dependencies(&workspace_lock);
            }
        }
        let started = Instant::now();
        self.ctx.execute(&command).map_err(|err| {
            let text = match &err {
                evcxr::Error::CompilationErrors(errors) => errors.iter().map(|e| e.rendered()).collect::<Vec<_>>().join("\n"),
                other => other.to_string(),
            };
            CellError::new("LibraryUnavailable", format!("the vramlab library could not be built: {err}"), vec![text])
        })?;
        self.library.loaded = true;
        output.stream(Stdio::Stderr, format!("vramlab ready ({:.1} s).\n", started.elapsed().as_secs_f64()));
        Ok(())
    }
}

/// The cell process: this binary again, able to load the standard library
/// that cells link to. Cargo writes each cell library's RUNPATH relative to
/// the `deps` directory, but evcxr loads it from the directory above, so
/// when the build directory and the toolchain share a parent (as
/// `~/.cache` and `~/.rustup` do) that RUNPATH misses by one level.
fn cell_process_command() -> Result<std::process::Command, evcxr::Error> {
    let mut command = std::process::Command::new(std::env::current_exe()?);
    let sysroot = std::process::Command::new("rustc").args(["--print", "sysroot"]).output()?;
    if !sysroot.status.success() {
        return Err(evcxr::Error::Message("`rustc --print sysroot` failed: is a Rust toolchain installed?".into()));
    }
    let std_dir = PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim())
        .join("lib/rustlib")
        .join(env!("VRAMLAB_TARGET"))
        .join("lib");
    let mut paths = vec![std_dir];
    paths.extend(std::env::var_os("LD_LIBRARY_PATH").iter().flat_map(std::env::split_paths));
    if let Ok(joined) = std::env::join_paths(paths) {
        command.env("LD_LIBRARY_PATH", joined);
    }
    Ok(command)
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

/// What `:timing` shows: the whole evaluation, then evcxr's phases (a
/// `Fallback` phase is a compile that failed and was redone).
fn timing_line(outputs: &evcxr::EvalOutputs) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let phases: Vec<String> = outputs.phases.iter().map(|p| format!("{} {:.0} ms", p.name, ms(p.duration))).collect();
    format!("Took {:.0} ms: {}\n", outputs.timing.map_or(0.0, ms), phases.join(", "))
}

fn identifier_end(code: &str, cursor: usize) -> usize {
    let cursor = cursor.min(code.len());
    code[cursor..]
        .char_indices()
        .find(|(_, c)| !(c.is_alphanumeric() || *c == '_'))
        .map_or(code.len(), |(i, _)| cursor + i)
}

fn list(names: &BTreeSet<String>) -> String {
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.iter().cloned().collect::<Vec<_>>().join(", ")
    }
}

const KEPT: &str = "Kept: functions, types, `use` statements and :dep crates defined so far.";

fn interrupted_error(lost: &BTreeSet<String>) -> CellError {
    CellError::new(
        "Interrupted",
        "the cell was interrupted; its process was stopped and started again",
        vec![
            "\x1b[1;31mInterrupted\x1b[0m: the cell process was stopped and started again.".into(),
            format!("Variables lost: {}.", list(lost)),
            KEPT.into(),
        ],
    )
}

fn process_died(lost: &BTreeSet<String>, detail: &str) -> CellError {
    let status = detail.lines().last().unwrap_or(detail).trim().to_owned();
    let mut traceback = vec![format!("\x1b[1;31mThe cell process died\x1b[0m: {status}")];
    traceback.extend(detail.lines().rev().skip(1).collect::<Vec<_>>().into_iter().rev().map(str::to_owned));
    traceback.push(format!("Variables lost: {}.", list(lost)));
    traceback.push(KEPT.into());
    traceback.push("A new cell process has started: the next cell runs normally.".into());
    CellError::new("CellProcessDied", format!("the cell process died ({status}); its variables were lost"), traceback)
}

/// A cell that returned early through `?`.
fn returned_error(error: evcxr::UserError) -> CellError {
    let traceback = vec![
        format!("\x1b[1;31m{}\x1b[0m: {}", error.type_name, error.message),
        "returned by `?` in this cell.".into(),
        "Variables from earlier cells are kept; those this cell was defining are not.".into(),
    ];
    CellError::new(&error.type_name, error.message, traceback)
}

fn compilation_error(errors: &[CompilationError], code: &str) -> CellError {
    let lines: Vec<&str> = code.lines().collect();
    let mut traceback = Vec::new();
    for error in errors {
        let code_tag = error.code().map(|c| format!("[{c}]")).unwrap_or_default();
        traceback.push(format!("\x1b[1;31merror{code_tag}\x1b[0m: {}", error.message()));
        for spanned in error.spanned_messages() {
            let Some(span) = spanned.span else { continue };
            traceback.push(format!("  --> cell:{}:{}", span.start_line, span.start_column));
            if let Some(source) = lines.get(span.start_line.saturating_sub(1)) {
                let width = if span.end_line == span.start_line {
                    span.end_column.saturating_sub(span.start_column).max(1)
                } else {
                    source.chars().count().saturating_sub(span.start_column.saturating_sub(1)).max(1)
                };
                traceback.push(format!("   | {source}"));
                traceback.push(format!(
                    "   | {}\x1b[1;31m{}\x1b[0m {}",
                    " ".repeat(span.start_column.saturating_sub(1)),
                    "^".repeat(width),
                    spanned.label
                ));
            }
        }
        for help in error.help() {
            traceback.push(format!("   = help: {help}"));
        }
        if let Some(hint) = error.evcxr_extra_hint() {
            traceback.push(format!("   = hint: {hint}"));
        }
    }
    let first = errors.first().map(|e| e.message()).unwrap_or_else(|| "the cell did not compile".into());
    let evalue = match errors.len() {
        0 | 1 => first,
        n => format!("{first} (and {} more)", n - 1),
    };
    CellError::new("CompilationError", evalue, traceback)
}

/// A panic reported by the hook installed in the cell process.
#[derive(Debug, Deserialize)]
struct PanicReport {
    thread: String,
    cell_thread: bool,
    message: String,
    location: String,
    backtrace: String,
}

impl PanicReport {
    /// Where the panic happened, in the user's terms: evcxr compiles a cell
    /// into a generated `src/lib.rs`, whose line numbers are not the cell's.
    fn place(&self) -> String {
        if self.location.starts_with("src/lib.rs:") {
            "in this cell".to_owned()
        } else {
            format!("at {}", self.location)
        }
    }

    fn into_error(self) -> CellError {
        let mut traceback = vec![format!("\x1b[1;31mpanic\x1b[0m {}: {}", self.place(), self.message)];
        let frames = user_frames(&self.backtrace);
        if !frames.is_empty() {
            traceback.push("backtrace (cell code):".into());
            traceback.extend(frames);
        }
        traceback.push("Variables from earlier cells are kept; those this cell was defining are not.".into());
        CellError::new("panic", self.message, traceback)
    }

    fn as_stderr(&self) -> String {
        format!("thread '{}' panicked {}:\n{}\n", self.thread, self.place(), self.message)
    }
}

/// The frames of a backtrace that belong to cell code, not to the standard
/// library or evcxr's machinery.
fn user_frames(backtrace: &str) -> Vec<String> {
    let machinery = [
        "std::", "core::", "alloc::", "evcxr", "__rust", "rust_begin_unwind", "<alloc::", "<core::", "<std::", "_start",
        "__libc", "vramlab_kernel::", "main", "run_user_code", "ctx::run_user_code",
    ];
    backtrace
        .lines()
        .map(str::trim)
        .filter_map(|line| line.split_once(": ").filter(|(n, _)| n.chars().all(|c| c.is_ascii_digit())).map(|(_, f)| f))
        .filter(|frame| !machinery.iter().any(|m| frame.starts_with(m)))
        .take(12)
        // Cells compile into a crate named `ctx`.
        .map(|frame| format!("  {}", frame.strip_prefix("ctx::").unwrap_or(frame)))
        .collect()
}

enum PumpCommand {
    Attach(Output),
    Detach(Sender<PumpReport>),
}

#[derive(Default)]
struct PumpReport {
    panic: Option<PanicReport>,
}

/// Moves the cell process's output to iopub as it arrives.
struct Pump {
    commands: Sender<PumpCommand>,
}

impl Pump {
    fn start(outputs: EvalContextOutputs) -> Pump {
        let (commands, receiver) = crossbeam_channel::unbounded();
        std::thread::Builder::new()
            .name("cell-output".into())
            .spawn(move || PumpState::default().run(outputs, receiver))
            .expect("spawning the output thread");
        Pump { commands }
    }

    fn attach(&self, output: Output) {
        let _ = self.commands.send(PumpCommand::Attach(output));
    }

    /// Waits until everything the cell printed has been published.
    fn detach(&self) -> PumpReport {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.commands.send(PumpCommand::Detach(tx)).is_err() {
            return PumpReport::default();
        }
        rx.recv().unwrap_or_default()
    }
}

#[derive(Default)]
struct PumpState {
    output: Option<Output>,
    panic: Option<PanicReport>,
}

impl PumpState {
    fn run(mut self, outputs: EvalContextOutputs, commands: Receiver<PumpCommand>) {
        loop {
            select! {
                recv(outputs.stdout) -> line => match line {
                    Ok(line) => self.stdout(line, &outputs.stdout),
                    Err(_) => return,
                },
                recv(outputs.stderr) -> line => match line {
                    Ok(line) => self.stderr(line, &outputs.stderr),
                    Err(_) => return,
                },
                recv(commands) -> command => match command {
                    Ok(PumpCommand::Attach(output)) => {
                        self.output = Some(output);
                        self.panic = None;
                    }
                    Ok(PumpCommand::Detach(reply)) => {
                        // evcxr hands over the cell's stdout before returning; stderr
                        // comes on its own pipe, so wait until it has been quiet briefly.
                        while let Ok(line) = outputs.stdout.try_recv() {
                            self.stdout(line, &outputs.stdout);
                        }
                        while let Ok(line) = outputs.stderr.recv_timeout(STDERR_SETTLE) {
                            self.stderr(line, &outputs.stderr);
                        }
                        let _ = reply.send(PumpReport { panic: self.panic.take() });
                    }
                    Err(_) => return,
                },
            }
        }
    }

    fn stdout(&mut self, first: String, more: &Receiver<String>) {
        let mut batch = String::new();
        let mut next = Some(first);
        while let Some(line) = next.take() {
            if let Some(frame) = DisplayFrame::parse_line(&line) {
                self.flush(Stdio::Stdout, &mut batch);
                match frame {
                    Ok(frame) => self.with_output(|o| o.frame(frame)),
                    Err(err) => log::warn!("a malformed display frame from a cell was dropped: {err}"),
                }
            } else if let Some(json) = line.strip_prefix(PANIC_PREFIX) {
                self.flush(Stdio::Stdout, &mut batch);
                match serde_json::from_str::<PanicReport>(json) {
                    Ok(report) if report.cell_thread => self.panic = Some(report),
                    Ok(report) => self.with_output(|o| o.stream(Stdio::Stderr, report.as_stderr())),
                    Err(err) => log::warn!("a malformed panic report was dropped: {err}"),
                }
            } else {
                batch.push_str(&line);
                batch.push('\n');
            }
            if batch.len() < 64 * 1024 {
                next = more.try_recv().ok();
            }
        }
        self.flush(Stdio::Stdout, &mut batch);
    }

    fn stderr(&mut self, first: String, more: &Receiver<String>) {
        let mut batch = first + "\n";
        while batch.len() < 64 * 1024 {
            match more.try_recv() {
                Ok(line) => {
                    batch.push_str(&line);
                    batch.push('\n');
                }
                Err(_) => break,
            }
        }
        self.flush(Stdio::Stderr, &mut batch);
    }

    fn flush(&self, name: Stdio, batch: &mut String) {
        if !batch.is_empty() {
            let text = std::mem::take(batch);
            self.with_output(|o| o.stream(name, text));
        }
    }

    fn with_output(&self, f: impl FnOnce(&Output)) {
        match &self.output {
            Some(output) => f(output),
            None => log::debug!("cell output with no cell to attach it to was dropped"),
        }
    }
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
    fn backtraces_keep_only_cell_frames() {
        let bt = "   0: std::backtrace::Backtrace::force_capture\n             at /rustc/x/library/std/src/backtrace.rs:1\n   \
                  1: run_user_code_3::{{closure}}\n   2: user_code_3::divide\n   3: core::ops::function::FnOnce::call_once\n   \
                  4: vramlab_kernel::main\n   5: main\n   6: ctx::run_user_code_1::{{closure}}\n   7: ctx::area\n";
        assert_eq!(user_frames(bt), vec!["  user_code_3::divide", "  area"]);
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
