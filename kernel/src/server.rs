//! The Jupyter side of the kernel: sockets, signatures, one task per
//! channel, busy/idle, execution counts and replies. Cells are run by an
//! [`Engine`]; this module only keeps the protocol's books.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use futures::FutureExt;
use jupyter_protocol::{
    CodeMirrorMode, CommInfoReply, CompleteReply, ConnectionInfo, ExecuteInput, ExecuteReply, ExecuteRequest, ExecutionCount,
    ExecutionState, HelpLink, HistoryReply, InputRequest, InspectReply, InterruptReply, IsCompleteReply, JupyterMessage,
    JupyterMessageContent, KernelInfoReply, LanguageInfo, Media, Payload, ReplyError, ReplyStatus, ShutdownReply, Status, Stdio,
    UnknownMessage,
};
use jupyter_zmq_client::{Connection, KernelHeartbeatConnection, RouterRecvConnection, RouterSendConnection};
use tokio::sync::{mpsc, Notify};
use vramlab::render::Bundle;
use zeromq::{RepSocket, RouterSocket, Socket, SocketOptions, SocketRecv, SocketSend, XPubSocket};

use crate::cell::{self, Segment};
use crate::display;
use crate::engine::{panic_text, Engine, ExecuteJob, InputFn, Output};
use crate::history::History;
use crate::iopub::Iopub;
use crate::is_complete;
use crate::magic::{self, Invocation};
use crate::outcome::CellError;
use crate::wire::{Incoming, Verifier};

pub const PROTOCOL_VERSION: &str = "5.3";

/// Serves the kernel until a shutdown request. A peer that sends a message
/// (or a frame) larger than `max_message_bytes` is disconnected before that
/// much is allocated.
pub async fn serve(info: ConnectionInfo, engine: Arc<dyn Engine>, max_message_bytes: usize) -> anyhow::Result<()> {
    let session = uuid::Uuid::new_v4().to_string();
    let sockets = Sockets::bind(&info, &session, max_message_bytes).await?;
    let iopub = Iopub::start(sockets.iopub);
    let (input_tx, input_rx) = mpsc::unbounded_channel();
    let kernel = Arc::new(Kernel {
        engine,
        iopub,
        verifier: Verifier::new(&info.key),
        inputs: input_tx,
        input_cancelled: Arc::new(Notify::new()),
        cancel_input: Arc::new(AtomicBool::new(false)),
        execution_count: Mutex::new(0),
        history: Mutex::new(History::default()),
        shutdown: Notify::new(),
    });
    tokio::spawn(heartbeat(sockets.heartbeat));
    tokio::spawn(stdin_loop(Arc::clone(&kernel), sockets.stdin, input_rx));
    let (shell_send, shell_recv) = sockets.shell.split();
    let (control_send, control_recv) = sockets.control.split();
    tokio::spawn(shell_loop(Arc::clone(&kernel), shell_recv, shell_send));
    tokio::spawn(control_loop(Arc::clone(&kernel), control_recv, control_send));
    tokio::spawn(interrupt_on_sigint(Arc::clone(&kernel)));
    kernel.iopub.send(Status { execution_state: ExecutionState::Starting }.into());
    kernel.shutdown.notified().await;
    kernel.iopub.flush().await;
    Ok(())
}

struct Sockets {
    shell: jupyter_zmq_client::KernelShellConnection,
    control: jupyter_zmq_client::KernelControlConnection,
    stdin: jupyter_zmq_client::KernelStdinConnection,
    iopub: jupyter_zmq_client::KernelIoPubXPubConnection,
    heartbeat: jupyter_zmq_client::KernelHeartbeatConnection,
}

impl Sockets {
    async fn bind(info: &ConnectionInfo, session: &str, max: usize) -> anyhow::Result<Sockets> {
        let connection = |socket| Connection::new(socket, &info.key, session);
        Ok(Sockets {
            shell: connection(bind::<RouterSocket>("shell", info.shell_url(), info, info.shell_port, max).await?),
            control: connection(bind::<RouterSocket>("control", info.control_url(), info, info.control_port, max).await?),
            stdin: connection(bind::<RouterSocket>("stdin", info.stdin_url(), info, info.stdin_port, max).await?),
            iopub: Connection::new(bind::<XPubSocket>("iopub", info.iopub_url(), info, info.iopub_port, max).await?, &info.key, session),
            heartbeat: KernelHeartbeatConnection { socket: bind::<RepSocket>("heartbeat", info.hb_url(), info, info.hb_port, max).await? },
        })
    }
}

/// A socket listening at `url` that disconnects a peer sending more than `max_message_bytes` at once.
async fn bind<S: Socket>(name: &str, url: String, info: &ConnectionInfo, port: u16, max_message_bytes: usize) -> anyhow::Result<S> {
    let mut options = SocketOptions::default();
    options.max_message_size(max_message_bytes);
    let mut socket = S::with_options(options);
    socket.bind(&url).await.with_context(|| format!("cannot listen on the {name} port {}:{port} (is it in use?)", info.ip))?;
    Ok(socket)
}

struct Kernel {
    engine: Arc<dyn Engine>,
    iopub: Iopub,
    verifier: Verifier,
    inputs: mpsc::UnboundedSender<InputAsk>,
    input_cancelled: Arc<Notify>,
    cancel_input: Arc<AtomicBool>,
    execution_count: Mutex<usize>,
    history: Mutex<History>,
    shutdown: Notify,
}

/// What the shell loop should do after a request.
#[derive(PartialEq)]
enum After {
    Continue,
    /// A cell failed with stop_on_error: abort the execute requests already queued.
    AbortQueued,
}

/// The next authentic message. Forged, replayed and unreadable ones are
/// logged and dropped; an authentic request whose content does not fit its
/// type comes back as [`Incoming::Malformed`], so that it can be answered.
async fn read(socket: &mut RouterRecvConnection, channel: &str, verifier: &Verifier) -> Incoming {
    loop {
        match socket.socket.recv().await {
            Ok(frames) => match verifier.decode(frames) {
                Ok(incoming) => return incoming,
                Err(err) => log::warn!("{channel}: dropped a message: {err}"),
            },
            Err(err) => {
                // A receive error concerns one peer (zeromq drops it); the socket goes on.
                log::warn!("{channel}: receive failed: {err}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// An error reply of the request's reply type, so the client is told what was
/// wrong instead of waiting for a reply that never comes. None for a message
/// that is not a request.
fn error_reply(request: &JupyterMessage, ename: &str, problem: &str) -> Option<JupyterMessage> {
    let reply_type = request.header.msg_type.strip_suffix("_request")?;
    let evalue = format!("{}: {problem}", request.header.msg_type);
    let content = serde_json::json!({
        "status": "error",
        "ename": ename,
        "evalue": evalue,
        "traceback": [evalue],
    });
    Some(UnknownMessage { msg_type: format!("{reply_type}_reply"), content }.as_child_of(request))
}

async fn reply(socket: &mut RouterSendConnection, channel: &str, message: JupyterMessage) {
    if let Err(err) = socket.send(message).await {
        log::warn!("{channel}: could not send a reply: {err}");
    }
}

async fn shell_loop(kernel: Arc<Kernel>, mut recv: RouterRecvConnection, mut send: RouterSendConnection) {
    loop {
        let incoming = read(&mut recv, "shell", &kernel.verifier).await;
        if kernel.serve_shell(incoming, &mut send).await == After::AbortQueued {
            kernel.abort_queued(&mut recv, &mut send).await;
        }
    }
}

async fn control_loop(kernel: Arc<Kernel>, mut recv: RouterRecvConnection, mut send: RouterSendConnection) {
    loop {
        let request = match read(&mut recv, "control", &kernel.verifier).await {
            Incoming::Request(request) => request,
            Incoming::Malformed { request, problem } => {
                kernel.answer_malformed(&request, &problem, &mut send, "control").await;
                continue;
            }
        };
        kernel.status(&request, ExecutionState::Busy);
        let handled = AssertUnwindSafe(kernel.handle_control(&request, &mut send)).catch_unwind().await;
        match handled {
            Ok(Control::Continue) => {}
            Ok(Control::Shutdown) => return,
            Err(panic) => kernel.answer_panic(&request, panic_text(&*panic), &mut send, "control").await,
        }
        kernel.status(&request, ExecutionState::Idle);
    }
}

enum Control {
    Continue,
    Shutdown,
}

async fn interrupt_on_sigint(kernel: Arc<Kernel>) {
    // Front ends that interrupt by signal reach the same path as interrupt_request.
    while tokio::signal::ctrl_c().await.is_ok() {
        kernel.interrupt();
    }
}

async fn heartbeat(mut socket: jupyter_zmq_client::KernelHeartbeatConnection) {
    loop {
        match socket.socket.recv().await {
            Ok(ping) => {
                if let Err(err) = socket.socket.send(ping).await {
                    log::warn!("heartbeat: could not answer: {err}");
                }
            }
            Err(err) => {
                log::warn!("heartbeat: receive failed: {err}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

struct InputAsk {
    prompt: String,
    password: bool,
    parent: JupyterMessage,
    answer: std::sync::mpsc::Sender<Option<String>>,
}

/// Asks the front end for input when a cell wants it. The socket is read at
/// all times, so that garbage is dropped as it comes and a reply to an
/// earlier, cancelled request is never taken for the answer to a later one.
async fn stdin_loop(kernel: Arc<Kernel>, socket: jupyter_zmq_client::KernelStdinConnection, mut asks: mpsc::UnboundedReceiver<InputAsk>) {
    let (mut send, mut recv) = socket.split();
    let mut waiting: Option<(String, std::sync::mpsc::Sender<Option<String>>)> = None;
    loop {
        tokio::select! {
            Some(ask) = asks.recv() => {
                // The request goes to the client that sent the cell: its shell identities.
                let request = InputRequest { prompt: ask.prompt, password: ask.password }.as_child_of(&ask.parent);
                let id = request.header.msg_id.clone();
                match send.send(request).await {
                    Ok(()) => waiting = Some((id, ask.answer)),
                    Err(err) => {
                        log::warn!("stdin: could not ask for input: {err}");
                        let _ = ask.answer.send(None);
                    }
                }
            }
            message = read(&mut recv, "stdin", &kernel.verifier) => match message {
                Incoming::Request(JupyterMessage { content: JupyterMessageContent::InputReply(reply), parent_header, .. }) => {
                    let parent = parent_header.map(|h| h.msg_id);
                    match waiting.take() {
                        Some((id, answer)) if parent.as_deref() == Some(id.as_str()) => drop(answer.send(Some(reply.value))),
                        still => {
                            log::warn!("stdin: an input_reply to no pending request was dropped");
                            waiting = still;
                        }
                    }
                }
                Incoming::Request(other) => log::warn!("stdin: expected input_reply, got {}", other.message_type()),
                Incoming::Malformed { request, problem } => log::warn!("stdin: {} is not valid: {problem}", request.message_type()),
            },
            _ = kernel.input_cancelled.notified(), if waiting.is_some() => {
                if let Some((_, answer)) = waiting.take() {
                    let _ = answer.send(None);
                }
            }
        }
    }
}

impl Kernel {
    fn status(&self, parent: &JupyterMessage, state: ExecutionState) {
        self.iopub.send(Status { execution_state: state }.as_child_of(parent));
    }

    fn interrupt(&self) {
        self.cancel_input.store(true, Ordering::SeqCst);
        self.input_cancelled.notify_waiters();
        if !self.engine.interrupt() {
            log::info!("interrupt: no cell was running");
        }
    }

    /// One shell message, answered whatever it holds: a panic while handling
    /// it is logged and answered as an error, and the loop goes on.
    async fn serve_shell(&self, incoming: Incoming, send: &mut RouterSendConnection) -> After {
        let request = match incoming {
            Incoming::Request(request) => request,
            Incoming::Malformed { request, problem } => {
                self.answer_malformed(&request, &problem, send, "shell").await;
                return After::Continue;
            }
        };
        self.status(&request, ExecutionState::Busy);
        let after = match AssertUnwindSafe(self.handle_shell(&request, send)).catch_unwind().await {
            Ok(after) => after,
            Err(panic) => {
                self.answer_panic(&request, panic_text(&*panic), send, "shell").await;
                After::Continue
            }
        };
        self.status(&request, ExecutionState::Idle);
        after
    }

    async fn handle_shell(&self, request: &JupyterMessage, send: &mut RouterSendConnection) -> After {
        let mut after = After::Continue;
        let answer = match &request.content {
            JupyterMessageContent::KernelInfoRequest(_) => Some(kernel_info().as_child_of(request)),
            JupyterMessageContent::ExecuteRequest(execute) => {
                let (answer, failed) = self.execute(execute, request).await;
                if failed && execute.stop_on_error {
                    after = After::AbortQueued;
                }
                Some(answer.as_child_of(request))
            }
            JupyterMessageContent::CompleteRequest(complete) => {
                Some(self.complete(&complete.code, complete.cursor_pos).await.as_child_of(request))
            }
            JupyterMessageContent::InspectRequest(inspect) => {
                Some(self.inspect(&inspect.code, inspect.cursor_pos).await.as_child_of(request))
            }
            JupyterMessageContent::IsCompleteRequest(check) => {
                let verdict = is_complete::check(&check.code);
                Some(IsCompleteReply { status: verdict.status, indent: verdict.indent }.as_child_of(request))
            }
            JupyterMessageContent::HistoryRequest(history) => {
                let entries = self.history.lock().unwrap_or_else(|e| e.into_inner()).answer(history);
                Some(HistoryReply { history: entries, status: ReplyStatus::Ok, error: None }.as_child_of(request))
            }
            JupyterMessageContent::CommInfoRequest(_) => Some(CommInfoReply::default().as_child_of(request)),
            JupyterMessageContent::CommOpen(_) | JupyterMessageContent::CommMsg(_) | JupyterMessageContent::CommClose(_) => {
                log::info!("shell: this kernel has no comm targets; `{}` ignored", request.message_type());
                None
            }
            other => {
                log::warn!("shell: unknown or unsupported message type `{}`; ignored", other.message_type());
                None
            }
        };
        if let Some(answer) = answer {
            reply(send, "shell", answer).await;
        }
        after
    }

    async fn handle_control(&self, request: &JupyterMessage, send: &mut RouterSendConnection) -> Control {
        let answer = match &request.content {
            JupyterMessageContent::KernelInfoRequest(_) => Some(kernel_info().as_child_of(request)),
            JupyterMessageContent::InterruptRequest(_) => {
                self.interrupt();
                Some(InterruptReply { status: ReplyStatus::Ok, error: None }.as_child_of(request))
            }
            JupyterMessageContent::ShutdownRequest(shutdown) => {
                self.interrupt();
                let answer = ShutdownReply { restart: shutdown.restart, status: ReplyStatus::Ok, error: None };
                reply(send, "control", answer.as_child_of(request)).await;
                self.status(request, ExecutionState::Idle);
                self.shutdown.notify_one();
                return Control::Shutdown;
            }
            other => {
                log::warn!("control: `{}` is not handled here; ignored", other.message_type());
                None
            }
        };
        if let Some(answer) = answer {
            reply(send, "control", answer).await;
        }
        Control::Continue
    }

    /// An authentic request whose content does not fit its type.
    async fn answer_malformed(&self, request: &JupyterMessage, problem: &str, send: &mut RouterSendConnection, channel: &str) {
        log::warn!("{channel}: {}: content is not valid: {problem}", request.header.msg_type);
        self.status(request, ExecutionState::Busy);
        if let Some(answer) = error_reply(request, "MalformedMessage", problem) {
            reply(send, channel, answer).await;
        }
        self.status(request, ExecutionState::Idle);
    }

    async fn answer_panic(&self, request: &JupyterMessage, text: String, send: &mut RouterSendConnection, channel: &str) {
        log::error!("{channel}: internal error while handling {}: {text}", request.header.msg_type);
        if let Some(answer) = error_reply(request, "InternalError", &format!("the kernel failed on this request ({text}); it goes on")) {
            reply(send, channel, answer).await;
        }
    }

    /// After a failed cell with stop_on_error: execute requests that were sent
    /// before the failure was reported are answered `aborted`; the first
    /// request sent after it ends the aborting.
    async fn abort_queued(&self, recv: &mut RouterRecvConnection, send: &mut RouterSendConnection) {
        let mut failed_at = chrono::Utc::now();
        while let Ok(queued) = tokio::time::timeout(Duration::from_millis(1), read(recv, "shell", &self.verifier)).await {
            let (Incoming::Request(request) | Incoming::Malformed { request, .. }) = &queued;
            let sent_before = request.header.date < failed_at;
            if sent_before && matches!(request.content, JupyterMessageContent::ExecuteRequest(_)) {
                self.status(request, ExecutionState::Busy);
                // Without an execution_count, as ipykernel sends it: front ends then show the
                // cell as never run (`[ ]`), not with the failed cell's number.
                let aborted = UnknownMessage { msg_type: "execute_reply".into(), content: serde_json::json!({"status": "aborted"}) };
                reply(send, "shell", aborted.as_child_of(request)).await;
                self.status(request, ExecutionState::Idle);
                continue;
            }
            if self.serve_shell(queued, send).await == After::AbortQueued {
                failed_at = chrono::Utc::now();
            } else if !sent_before {
                return;
            }
        }
    }

    /// Runs a cell; returns the reply and whether the cell failed.
    async fn execute(&self, execute: &ExecuteRequest, request: &JupyterMessage) -> (ExecuteReply, bool) {
        let store = execute.store_history && !execute.silent;
        let count = {
            let mut count = self.execution_count.lock().unwrap_or_else(|e| e.into_inner());
            if store {
                *count += 1;
            }
            *count
        };
        if !execute.silent {
            self.iopub.send(ExecuteInput { code: execute.code.clone(), execution_count: ExecutionCount::new(count) }.as_child_of(request));
        }
        if store {
            self.history.lock().unwrap_or_else(|e| e.into_inner()).record(count, &execute.code);
        }
        self.cancel_input.store(false, Ordering::SeqCst);
        let output = Output::new(self.iopub.clone(), request.clone());
        let mut payload = Vec::new();
        let input = execute.allow_stdin.then(|| self.input_fn(request));
        let result = self.run_cell(&execute.code, &output, input, &mut payload).await;
        let reply = |status, error: Option<&CellError>| ExecuteReply {
            status,
            execution_count: ExecutionCount::new(count),
            payload: payload.clone(),
            user_expressions: Some(Default::default()),
            error: error.map(|e| Box::new(ReplyError { ename: e.ename.clone(), evalue: e.evalue.clone(), traceback: e.traceback.clone() })),
        };
        match result {
            Ok(value) => {
                if let Some(value) = value.filter(|_| !execute.silent) {
                    self.iopub.send(display::execute_result(&value, count, request));
                    if store {
                        self.history.lock().unwrap_or_else(|e| e.into_inner()).set_output(count, value.text());
                    }
                }
                (reply(ReplyStatus::Ok, None), false)
            }
            Err(error) => {
                if !execute.silent {
                    self.iopub.send(display::error(&error, request));
                    if vramlab::train::is_out_of_memory(&error.evalue) {
                        self.investigate(&error, &output).await;
                    }
                }
                (reply(ReplyStatus::Error, Some(&error)), true)
            }
        }
    }

    /// Under a cell that ran out of memory, the lesson's investigation, run
    /// in the cell process where the failed trainer's record is.
    async fn investigate(&self, error: &CellError, output: &Output) {
        let code = format!("vramlab::diagnose::investigate({:?}, &vramlab::diagnose::Limits::default())", error.evalue);
        let job = ExecuteJob { code, output: output.clone(), input: None };
        match self.engine.execute(job).await {
            Ok(Ok(Some(report))) => output.display(&report),
            Ok(Ok(None)) => log::warn!("the out-of-memory investigation showed nothing"),
            Ok(Err(failed)) => output.stream(Stdio::Stderr, format!("the out-of-memory investigation failed: {}\n", failed.evalue)),
            Err(_) => {}
        }
    }

    /// Runs each segment of a cell in order. Values of all but the last are
    /// shown as they come; the last is the cell's result.
    async fn run_cell(
        &self,
        code: &str,
        output: &Output,
        input: Option<InputFn>,
        payload: &mut Vec<Payload>,
    ) -> Result<Option<Bundle>, CellError> {
        let segments = cell::split(code).map_err(|e| CellError::new("UsageError", e.to_string(), vec![e.to_string()]))?;
        let mut value: Option<Bundle> = None;
        for segment in segments {
            if let Some(shown) = value.take() {
                output.display(&shown);
            }
            value = match segment {
                Segment::Rust(code) => {
                    let job = ExecuteJob { code, output: output.clone(), input: input.clone() };
                    self.engine.execute(job).await.map_err(|_| engine_stopped())??
                }
                Segment::Magic { name, args } => {
                    let variables = self.engine.variables();
                    let context = magic::Context { probe: self.engine.probe(), variables: &variables };
                    self.invoke(magic::run(&context, &name, &args)?, output, payload).await?
                }
                Segment::CellMagic { name, .. } => self.invoke(magic::run_cell(&name)?, output, payload).await?,
            };
        }
        Ok(value)
    }

    async fn invoke(&self, invocation: Invocation, output: &Output, payload: &mut Vec<Payload>) -> Result<Option<Bundle>, CellError> {
        match invocation {
            Invocation::Show(bundle) => Ok(Some(bundle)),
            Invocation::Evaluate(code) => {
                let job = ExecuteJob { code, output: output.clone(), input: None };
                self.engine.execute(job).await.map_err(|_| engine_stopped())?
            }
            Invocation::PageDocs(path) => {
                let docs = self.engine.inspect(path.clone(), path.len()).await.map_err(|_| engine_stopped())?;
                match docs {
                    Ok(Some(docs)) => {
                        payload.push(Payload::Page { data: display::media(&docs), start: 0 });
                        Ok(None)
                    }
                    Ok(None) => Err(CellError::new("NotFound", format!("no documentation found for `{path}`"), vec![])),
                    Err(err) => Err(CellError::new("NotFound", format!("documentation lookup for `{path}` failed: {err}"), vec![])),
                }
            }
        }
    }

    fn input_fn(&self, request: &JupyterMessage) -> InputFn {
        let asks = self.inputs.clone();
        let cancelled = Arc::clone(&self.cancel_input);
        let parent = request.clone();
        Arc::new(move |prompt: &str, password: bool| {
            let (answer, wait) = std::sync::mpsc::channel();
            let ask = InputAsk { prompt: prompt.to_owned(), password, parent: parent.clone(), answer };
            asks.send(ask).ok()?;
            loop {
                match wait.recv_timeout(Duration::from_millis(50)) {
                    Ok(value) => return value,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !cancelled.load(Ordering::SeqCst) => continue,
                    Err(_) => return None,
                }
            }
        })
    }

    async fn complete(&self, code: &str, cursor_pos: usize) -> CompleteReply {
        let cursor = byte_offset(code, cursor_pos);
        match self.engine.complete(code.to_owned(), cursor).await {
            Ok(Ok(found)) => {
                let (start, end) = (char_offset(code, found.start), char_offset(code, found.end));
                // JupyterLab shows each match's kind from this (ipykernel's) metadata.
                let types: Vec<serde_json::Value> = found
                    .matches
                    .iter()
                    .zip(&found.kinds)
                    .map(|(text, kind)| serde_json::json!({"start": start, "end": end, "text": text, "type": kind}))
                    .collect();
                let mut metadata = serde_json::Map::new();
                metadata.insert("_jupyter_types_experimental".into(), types.into());
                CompleteReply { matches: found.matches, cursor_start: start, cursor_end: end, metadata, ..Default::default() }
            }
            Ok(Err(err)) => {
                log::info!("completion failed: {err}");
                CompleteReply { cursor_start: cursor_pos, cursor_end: cursor_pos, ..Default::default() }
            }
            Err(_) => CompleteReply { status: ReplyStatus::Error, error: Some(Box::new(stopped_reply())), ..Default::default() },
        }
    }

    async fn inspect(&self, code: &str, cursor_pos: usize) -> InspectReply {
        let found = match self.engine.inspect(code.to_owned(), byte_offset(code, cursor_pos)).await {
            Ok(Ok(found)) => found,
            Ok(Err(err)) => {
                log::info!("inspection failed: {err}");
                None
            }
            Err(_) => return InspectReply { status: ReplyStatus::Error, error: Some(Box::new(stopped_reply())), ..Default::default() },
        };
        InspectReply {
            found: found.is_some(),
            data: found.as_ref().map(display::media).unwrap_or_else(|| Media::new(vec![])),
            metadata: Default::default(),
            status: ReplyStatus::Ok,
            error: None,
        }
    }
}

fn engine_stopped() -> CellError {
    let e = stopped_reply();
    CellError::new(&e.ename, e.evalue, e.traceback)
}

fn stopped_reply() -> ReplyError {
    ReplyError { ename: "EngineStopped".into(), evalue: "the Rust engine thread has stopped; restart the kernel".into(), traceback: vec![] }
}

/// Jupyter counts cursor positions in Unicode code points; Rust in bytes.
fn byte_offset(code: &str, chars: usize) -> usize {
    code.char_indices().nth(chars).map_or(code.len(), |(i, _)| i)
}

fn char_offset(code: &str, bytes: usize) -> usize {
    code.get(..bytes.min(code.len())).map_or(0, |s| s.chars().count())
}

pub fn kernel_info() -> KernelInfoReply {
    let link = |text: &str, url: &str| HelpLink { text: text.into(), url: url.into() };
    KernelInfoReply {
        status: ReplyStatus::Ok,
        protocol_version: PROTOCOL_VERSION.into(),
        implementation: "vramlab".into(),
        implementation_version: env!("CARGO_PKG_VERSION").into(),
        language_info: LanguageInfo {
            name: "rust".into(),
            version: env!("VRAMLAB_RUSTC_VERSION").into(),
            mimetype: Some("text/rust".into()),
            file_extension: Some(".rs".into()),
            pygments_lexer: Some("rust".into()),
            codemirror_mode: Some(CodeMirrorMode::Simple("rust".into())),
            nbconvert_exporter: None,
        },
        banner: format!(
            "vramlab {}: Rust cells (evcxr, rustc {}) with GPU-memory magics; %lsmagic lists them",
            env!("CARGO_PKG_VERSION"),
            env!("VRAMLAB_RUSTC_VERSION")
        ),
        help_links: vec![
            link("The Rust standard library", "https://doc.rust-lang.org/std/"),
            link("The Rust book", "https://doc.rust-lang.org/book/"),
            link("evcxr (cells, :dep)", "https://github.com/evcxr/evcxr/blob/main/COMMON.md"),
            link("candle", "https://docs.rs/candle-core/"),
        ],
        debugger: false,
        error: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_offsets_convert_between_code_points_and_bytes() {
        let code = "let é = vec";
        assert_eq!(byte_offset(code, 4), 4);
        assert_eq!(byte_offset(code, 5), 6, "é takes two bytes");
        assert_eq!(byte_offset(code, 100), code.len());
        assert_eq!(char_offset(code, 6), 5);
    }
}
