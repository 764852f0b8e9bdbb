//! The evcxr engine on its own thread: cells, completion, inspection and
//! interrupts. The worker runs evcxr; the pump streams a cell's output while it
//! runs; the traceback module turns what went wrong into what Jupyter shows.

mod library;
mod process;
mod pump;
mod traceback;
mod worker;

use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::Sender;
use tokio::sync::oneshot;
use vramlab::memory::CellProbe;
use vramlab::render::Bundle;

use crate::engine::{Completion, Engine, ExecuteJob};
use crate::outcome::Outcome;
use crate::slot::BuildSlot;

use library::Library;
use worker::Worker;

// Boxed: an execution carries its request, many times larger than the others.
enum Job {
    Execute(Box<ExecuteJob>, oneshot::Sender<Outcome>),
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
    probe: Option<Arc<CellProbe>>,
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
        std::thread::Builder::new()
            .name("evcxr".into())
            .spawn(move || Worker::run(slot, library, receiver, worker_running, worker_probe))?;
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
}
