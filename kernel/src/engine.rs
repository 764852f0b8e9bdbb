//! What the server needs from whatever runs cells: the evcxr engine in the
//! kernel, a scripted one in the server's own tests.

use std::sync::Arc;

use jupyter_protocol::{JupyterMessage, Stdio};
use tokio::sync::oneshot;
use vramlab::memory::CellProbe;
use vramlab::render::{Bundle, DisplayFrame};

use crate::display;
use crate::iopub::Iopub;
use crate::outcome::Outcome;

/// Where a running cell's output goes: iopub, as children of its request.
#[derive(Clone)]
pub struct Output {
    iopub: Iopub,
    parent: JupyterMessage,
}

impl Output {
    pub fn new(iopub: Iopub, parent: JupyterMessage) -> Self {
        Output { iopub, parent }
    }

    pub fn stream(&self, name: Stdio, text: String) {
        self.send(display::stream(name, text, &self.parent));
    }

    pub fn frame(&self, frame: DisplayFrame) {
        self.send(display::frame(frame, &self.parent));
    }

    pub fn display(&self, bundle: &Bundle) {
        self.send(display::display_data(bundle, None, &self.parent));
    }

    fn send(&self, message: JupyterMessage) {
        self.iopub.send(message);
    }
}

/// Asks the front end for a line of input (prompt, is_password); `None` when
/// the front end cannot answer or the cell was interrupted.
pub type InputFn = Arc<dyn Fn(&str, bool) -> Option<String> + Send + Sync>;

pub struct ExecuteJob {
    pub code: String,
    pub output: Output,
    pub input: Option<InputFn>,
}

/// The message of a caught panic.
pub fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Completion candidates, with the byte range of the code they replace.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Completion {
    pub matches: Vec<String>,
    /// The kind of each match (function, struct, ...), in the same order.
    pub kinds: Vec<String>,
    pub start: usize,
    pub end: usize,
}

pub trait Engine: Send + Sync + 'static {
    fn execute(&self, job: ExecuteJob) -> oneshot::Receiver<Outcome>;
    /// `cursor` is a byte offset into `code`.
    fn complete(&self, code: String, cursor: usize) -> oneshot::Receiver<Result<Completion, String>>;
    /// Documentation for the expression at `cursor` (a byte offset), if any.
    fn inspect(&self, code: String, cursor: usize) -> oneshot::Receiver<Result<Option<Bundle>, String>>;
    /// Stops the running cell. Returns false when no cell was running.
    fn interrupt(&self) -> bool;
    /// The memory counters of the process the cells run in, for `%mem`;
    /// `None` where they could not be set up.
    fn probe(&self) -> Option<&CellProbe>;
    /// The names of the variables the cells keep, as of the last cell that finished.
    fn variables(&self) -> Vec<String>;
}
