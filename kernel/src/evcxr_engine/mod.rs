//! The evcxr engine on its own thread: cells, completion, inspection and
//! interrupts. The worker runs evcxr; the pump streams a cell's output while it
//! runs; the traceback module turns what went wrong into what Jupyter shows.
//!
//! The evcxr engine: the handle and `build-cells` (`mod.rs`), the engine thread (`worker.rs`), the
//! library lookup (`library.rs`: the `:dep` lines for `vramlab` and, at its locked versions,
//! `candle-core` and `candle-nn`), the cell-process command, the notice that follows cargo while a
//! cell's dependencies build (`build_notice.rs`, one display updated in place from evcxr's
//! `BuildProgress`), tracebacks and the output pump.
//!
//! Rust goes to the engine thread: `syntax::check`, then evcxr. Only a cell with a top-level `let`
//! asks rust-analyzer for the new variables' types; rust-analyzer loads on a thread of its own from
//! the start and after each change of the cells' dependencies (patches/README.md), so other cells
//! compile without waiting for it. A warm cell is compiled by rustc alone, with the command cargo
//! last ran for the cells' crate, until the dependencies, their sources or cargo's configuration
//! change, and without the stored `use` items it cannot need; the cells' crate alone is compiled
//! without LTO (patches/README.md, ninth to eleventh changes). The pump publishes the cell
//! process's output as it comes; framed display lines from `vramlab::render` become live displays.

mod build_notice;
mod library;
mod process;
mod pump;
mod traceback;
mod worker;

use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context};
use crossbeam_channel::Sender;
use tokio::sync::oneshot;
use vramlab::memory::CellProbe;
use vramlab::render::Bundle;

use crate::engine::{Completion, Engine, ExecuteJob};
use crate::outcome::Outcome;
use crate::slot::BuildSlot;

use build_notice::TerminalProgress;
use library::Library;
use worker::Worker;

// Boxed: an execution carries its request, many times larger than the others.
enum Job {
    Execute(Box<ExecuteJob>, oneshot::Sender<Outcome>),
    Complete(String, usize, oneshot::Sender<Result<Completion, String>>),
    Inspect(String, usize, oneshot::Sender<Result<Option<Bundle>, String>>),
}

/// What the server reads of the worker between jobs: the cell process of the
/// cell now running, so that an interrupt can stop it, and the variables the
/// cells keep, so that a magic knows a variable from a zoo model's name.
#[derive(Default)]
struct Running {
    process: Mutex<Option<Arc<Mutex<Child>>>>,
    interrupted: AtomicBool,
    variables: Mutex<Vec<String>>,
}

pub struct EvcxrEngine {
    jobs: Sender<Job>,
    running: Arc<Running>,
    probe: Option<Arc<CellProbe>>,
}

impl EvcxrEngine {
    /// Takes a build directory and starts the engine thread. The evcxr
    /// context itself is created on that thread (a few seconds), so the
    /// kernel answers kernel_info at once; cells wait for it.
    pub fn start() -> anyhow::Result<EvcxrEngine> {
        // A cache that cannot be used is said in every cell, not only in the server's log.
        let slot = BuildSlot::acquire().map_err(|err| format!("{err:#}"));
        if let Ok(slot) = &slot {
            // Read by evcxr when it creates its context; set before any other thread runs.
            std::env::set_var("EVCXR_TMPDIR", slot.dir());
        }
        let library = Library::locate();
        let probe = match CellProbe::create() {
            Ok(probe) => Some(Arc::new(probe)),
            Err(err) => {
                log::warn!("%mem will not work: {err}");
                None
            }
        };
        let (jobs, receiver) = crossbeam_channel::unbounded();
        let running = Arc::new(Running::default());
        let worker_running = Arc::clone(&running);
        let worker_probe = probe.clone();
        std::thread::Builder::new().name("evcxr".into()).spawn(move || match slot {
            Ok(slot) => Worker::run(slot, library, receiver, worker_running, worker_probe),
            Err(why) => Worker::refuse_all(receiver, why),
        })?;
        Ok(EvcxrEngine { jobs, running, probe })
    }

    fn submit<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Job) -> oneshot::Receiver<T> {
        let (tx, rx) = oneshot::channel();
        if self.jobs.send(make(tx)).is_err() {
            log::error!("the evcxr engine thread has stopped");
        }
        rx
    }
}

/// Builds the library for the cells in the first free build slot, as the first
/// cell that uses it would, printing cargo's progress: a kernel started later
/// with that slot only loads it.
pub fn build_cells() -> anyhow::Result<()> {
    let slot = BuildSlot::acquire()?;
    let dir = slot.dir().to_owned();
    // Read by evcxr when it creates its context; no other thread runs yet.
    std::env::set_var("EVCXR_TMPDIR", &dir);
    eprintln!("building the vramlab library for notebook cells in {}", dir.display());
    let started = Instant::now();
    let mut worker = Worker::start(slot, Library::locate(), Arc::default(), None).map_err(anyhow::Error::msg)?;
    let terminal = TerminalProgress::new();
    let built = worker.build_library_ahead(&|progress| terminal.report(&progress));
    match built {
        None => bail!("the vramlab library was not found (set {})", crate::install::LIB_ENV),
        Some(result) => result.with_context(|| format!("the vramlab library could not be built for the cells in {}", dir.display()))?,
    }
    terminal.finish();
    eprintln!(
        "the cells' library is built ({:.0} s); kernels that take this build directory load it in seconds",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

impl Engine for EvcxrEngine {
    fn execute(&self, job: ExecuteJob) -> oneshot::Receiver<Outcome> {
        self.submit(|tx| Job::Execute(Box::new(job), tx))
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

    fn probe(&self) -> Option<&CellProbe> {
        self.probe.as_deref()
    }

    fn variables(&self) -> Vec<String> {
        self.running.variables.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}
