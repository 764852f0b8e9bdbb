//! Moves the cell process's output to iopub as it arrives: stream text,
//! live display frames, and the panic reports of the hook.

use std::time::Duration;

use crossbeam_channel::{select, Receiver, Sender};
use evcxr::EvalContextOutputs;
use jupyter_protocol::Stdio;
use vramlab::render::DisplayFrame;

use super::traceback::PanicReport;
use crate::engine::Output;

/// What the panic hook (assets/panic_hook.rs) puts before its JSON report.
const PANIC_PREFIX: &str = "\u{1e}vramlab:panic ";
/// How long stderr must stay quiet after a cell ends before the cell is
/// reported done: the cell's last stderr lines travel on their own pipe.
const STDERR_SETTLE: Duration = Duration::from_millis(2);

// Boxed: an output is many times larger than a detach.
enum PumpCommand {
    Attach(Box<Output>),
    Detach(Sender<PumpReport>),
}

#[derive(Default)]
pub(super) struct PumpReport {
    pub(super) panic: Option<PanicReport>,
}

/// Moves the cell process's output to iopub as it arrives.
pub(super) struct Pump {
    commands: Sender<PumpCommand>,
}

impl Pump {
    pub(super) fn start(outputs: EvalContextOutputs) -> Pump {
        let (commands, receiver) = crossbeam_channel::unbounded();
        std::thread::Builder::new()
            .name("cell-output".into())
            .spawn(move || PumpState::default().run(outputs, receiver))
            .expect("spawning the output thread");
        Pump { commands }
    }

    pub(super) fn attach(&self, output: Output) {
        let _ = self.commands.send(PumpCommand::Attach(Box::new(output)));
    }

    /// Waits until everything the cell printed has been published.
    pub(super) fn detach(&self) -> PumpReport {
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
                        self.output = Some(*output);
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
