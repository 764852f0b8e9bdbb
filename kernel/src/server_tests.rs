//! The server against a scripted engine: protocol bookkeeping without evcxr.

use std::sync::Arc;
use std::time::Duration;

use jupyter_protocol::{
    ConnectionInfo, ExecuteRequest, ExecutionState, JupyterMessage, JupyterMessageContent, KernelInfoRequest, ReplyStatus, ShutdownRequest,
    Stdio, Transport,
};
use jupyter_zmq_client::{
    create_client_control_connection, create_client_iopub_connection, create_client_shell_connection_with_identity,
    peer_identity_for_session, ClientIoPubConnection,
};
use tokio::sync::oneshot;
use vramlab::memory::CellProbe;
use vramlab::render::Bundle;

use crate::engine::{Completion, Engine, ExecuteJob};
use crate::outcome::{CellError, Outcome};

/// Runs each line: `print:TEXT` streams, `fail:MESSAGE` fails after 300 ms, and
/// any other line is the cell's result. The cell `panic` panics in the
/// server's own task, as a bug in the kernel would.
struct Scripted;

impl Engine for Scripted {
    fn execute(&self, job: ExecuteJob) -> oneshot::Receiver<Outcome> {
        assert_ne!(job.code, "panic", "the scripted engine was told to panic");
        let (tx, rx) = oneshot::channel();
        std::thread::spawn(move || {
            let mut outcome = Ok(None);
            for line in job.code.lines() {
                if let Some(text) = line.strip_prefix("print:") {
                    job.output.stream(Stdio::Stdout, format!("{text}\n"));
                } else if let Some(message) = line.strip_prefix("fail:") {
                    std::thread::sleep(Duration::from_millis(300));
                    outcome = Err(CellError::new("ScriptedError", message, vec![message.to_owned()]));
                    break;
                } else {
                    outcome = Ok(Some(Bundle::plain(line)));
                }
            }
            let _ = tx.send(outcome);
        });
        rx
    }

    fn complete(&self, _: String, _: usize) -> oneshot::Receiver<Result<Completion, String>> {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(Ok(Completion::default()));
        rx
    }

    fn inspect(&self, _: String, _: usize) -> oneshot::Receiver<Result<Option<Bundle>, String>> {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(Ok(None));
        rx
    }

    fn interrupt(&self) -> bool {
        false
    }

    fn probe(&self) -> Option<&CellProbe> {
        None
    }

    fn variables(&self) -> Vec<String> {
        Vec::new()
    }
}

async fn start() -> (ConnectionInfo, tokio::task::JoinHandle<anyhow::Result<()>>) {
    let ip = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    let ports = jupyter_zmq_client::peek_ports(ip, 5).await.unwrap();
    let info = ConnectionInfo {
        ip: ip.to_string(),
        transport: Transport::TCP,
        shell_port: ports[0],
        iopub_port: ports[1],
        stdin_port: ports[2],
        control_port: ports[3],
        hb_port: ports[4],
        key: "secret".into(),
        signature_scheme: "hmac-sha256".into(),
        kernel_name: None,
    };
    let server = tokio::spawn(crate::server::serve(info.clone(), Arc::new(Scripted), 1 << 20));
    (info, server)
}

async fn until_idle(iopub: &mut ClientIoPubConnection, id: &str) -> Vec<JupyterMessage> {
    let mut seen = Vec::new();
    loop {
        let message = tokio::time::timeout(Duration::from_secs(10), iopub.read()).await.unwrap().unwrap();
        if message.parent_header.as_ref().map(|h| h.msg_id.as_str()) != Some(id) {
            continue;
        }
        let idle = matches!(&message.content, JupyterMessageContent::Status(s) if s.execution_state == ExecutionState::Idle);
        seen.push(message);
        if idle {
            return seen;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn busy_idle_counts_abort_and_shutdown() {
    let (info, server) = start().await;
    let session = "client-session";
    let mut iopub = create_client_iopub_connection(&info, "", session).await.unwrap();
    let welcome = tokio::time::timeout(Duration::from_secs(10), iopub.read()).await.unwrap().unwrap();
    assert_eq!(welcome.message_type(), "iopub_welcome");
    let mut shell =
        create_client_shell_connection_with_identity(&info, session, peer_identity_for_session(session).unwrap()).await.unwrap();

    let request = JupyterMessage::new(ExecuteRequest::new("print:hi\nvalue".into()), None);
    let id = request.header.msg_id.clone();
    shell.send(request).await.unwrap();
    let types: Vec<String> = until_idle(&mut iopub, &id).await.iter().map(|m| m.message_type().to_owned()).collect();
    assert_eq!(types, ["status", "execute_input", "stream", "execute_result", "status"]);
    let JupyterMessageContent::ExecuteReply(reply) = shell.read().await.unwrap().content else { panic!() };
    assert_eq!((reply.status, reply.execution_count.value()), (ReplyStatus::Ok, 1));

    // A failing cell with stop_on_error aborts the requests queued behind it.
    let failing = JupyterMessage::new(ExecuteRequest { stop_on_error: true, ..ExecuteRequest::new("fail:no".into()) }, None);
    let queued = JupyterMessage::new(ExecuteRequest::new("never".into()), None);
    shell.send(failing).await.unwrap();
    shell.send(queued).await.unwrap();
    let JupyterMessageContent::ExecuteReply(failed) = shell.read().await.unwrap().content else { panic!() };
    assert_eq!(failed.status, ReplyStatus::Error);
    assert_eq!(failed.execution_count.value(), 2);
    let JupyterMessageContent::ExecuteReply(aborted) = shell.read().await.unwrap().content else { panic!() };
    assert_eq!(aborted.status, ReplyStatus::Aborted);

    // After the queue drains, cells run again.
    shell.send(JupyterMessage::new(ExecuteRequest::new("again".into()), None)).await.unwrap();
    let JupyterMessageContent::ExecuteReply(again) = shell.read().await.unwrap().content else { panic!() };
    assert_eq!((again.status, again.execution_count.value()), (ReplyStatus::Ok, 3));

    let mut control = create_client_control_connection(&info, session).await.unwrap();
    control.send(JupyterMessage::new(KernelInfoRequest {}, None)).await.unwrap();
    assert_eq!(control.read().await.unwrap().message_type(), "kernel_info_reply");
    control.send(JupyterMessage::new(ShutdownRequest { restart: true }, None)).await.unwrap();
    let JupyterMessageContent::ShutdownReply(shutdown) = control.read().await.unwrap().content else { panic!() };
    assert!(shutdown.restart);
    tokio::time::timeout(Duration::from_secs(5), server).await.unwrap().unwrap().unwrap();
}

const KEY: &str = "secret";

fn sign(parts: &[&[u8]]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, KEY.as_bytes());
    let mut ctx = ring::hmac::Context::with_key(&key);
    parts.iter().for_each(|p| ctx.update(p));
    ctx.sign().as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// A signed message of `msg_type` with `content` as it is, ready to send from a DEALER.
fn signed(msg_type: &str, content: &str) -> (String, zeromq::ZmqMessage) {
    let id = uuid::Uuid::new_v4().to_string();
    let header = format!(
        r#"{{"msg_id":"{id}","username":"u","session":"s","date":"2026-01-01T00:00:00Z","msg_type":"{msg_type}","version":"5.3"}}"#
    );
    let parts: [&[u8]; 4] = [header.as_bytes(), b"{}", b"{}", content.as_bytes()];
    let mut frames = vec![bytes::Bytes::from_static(b"<IDS|MSG>"), sign(&parts).into_bytes().into()];
    frames.extend(parts.iter().map(|p| bytes::Bytes::copy_from_slice(p)));
    (id, zeromq::ZmqMessage::try_from(frames).unwrap())
}

async fn dealer(url: &str) -> zeromq::DealerSocket {
    use zeromq::Socket;
    let mut socket = zeromq::DealerSocket::new();
    socket.connect(url).await.unwrap();
    socket
}

/// The reply's header type and content, or None when nothing came within a second.
/// The next message on `socket`, waiting long enough for a loaded machine.
async fn answer(socket: &mut zeromq::DealerSocket) -> Option<(String, serde_json::Value)> {
    answer_within(socket, Duration::from_secs(10)).await
}

/// Whether `socket` stays silent for a second: what a dropped request gets.
async fn no_answer(socket: &mut zeromq::DealerSocket) -> bool {
    answer_within(socket, Duration::from_secs(1)).await.is_none()
}

async fn answer_within(socket: &mut zeromq::DealerSocket, within: Duration) -> Option<(String, serde_json::Value)> {
    use zeromq::SocketRecv;
    let frames = tokio::time::timeout(within, socket.recv()).await.ok()?.unwrap();
    let parts: Vec<&[u8]> = frames.iter().map(|p| p.as_ref()).collect();
    let at = parts.iter().position(|p| *p == b"<IDS|MSG>").unwrap();
    let header: serde_json::Value = serde_json::from_slice(parts[at + 2]).unwrap();
    Some((header["msg_type"].as_str().unwrap().to_owned(), serde_json::from_slice(parts[at + 5]).unwrap()))
}

#[tokio::test(flavor = "multi_thread")]
async fn content_of_any_wrong_type_gets_an_error_reply_and_the_loops_go_on() {
    use zeromq::SocketSend;
    let (info, _server) = start().await;
    let mut shell = dealer(&info.shell_url()).await;
    let mut control = dealer(&info.control_url()).await;
    let wrong = ["[]", "7", "\"text\"", "null", "true", r#"{"code": ["not", "a", "string"], "cursor_pos": -1, "hist_access_type": 5}"#];
    let shell_requests = [
        "execute_request",
        "complete_request",
        "inspect_request",
        "is_complete_request",
        "history_request",
        "comm_info_request",
        "kernel_info_request",
    ];
    let control_requests = ["kernel_info_request", "interrupt_request", "shutdown_request"];
    for content in wrong {
        let requests = shell_requests.iter().map(|t| (false, *t)).chain(control_requests.iter().map(|t| (true, *t)));
        for (on_control, msg_type) in requests {
            let socket = if on_control { &mut control } else { &mut shell };
            socket.send(signed(msg_type, content).1).await.unwrap();
            let (reply_type, reply) = answer(socket).await.unwrap_or_else(|| panic!("no reply to {msg_type} with content {content}"));
            assert_eq!(reply_type, msg_type.replace("_request", "_reply"), "{content}");
            // Requests with no fields (kernel_info, comm_info, interrupt) read anything as empty;
            // shutdown_request needs `restart`.
            if reply["status"] == "error" {
                assert_eq!(reply["ename"], "MalformedMessage", "{msg_type} {content}: {reply}");
            } else {
                assert!(
                    matches!(msg_type, "kernel_info_request" | "comm_info_request" | "interrupt_request"),
                    "{msg_type} {content}: {reply}"
                );
            }
        }
        // Messages that are not requests are dropped and logged, without a reply.
        for msg_type in ["comm_open", "comm_msg", "comm_close", "input_reply", "execute_reply"] {
            shell.send(signed(msg_type, content).1).await.unwrap();
        }
        assert!(no_answer(&mut shell).await, "{content}: only requests are answered");
    }
    shell.send(signed("execute_request", r#"{"code": "still here", "silent": false, "store_history": true}"#).1).await.unwrap();
    let (_, reply) = answer(&mut shell).await.expect("the shell loop goes on");
    assert_eq!(reply["status"], "ok");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_request_runs_once() {
    use zeromq::SocketSend;
    let (info, _server) = start().await;
    let mut shell = dealer(&info.shell_url()).await;
    let (_, request) = signed("execute_request", r#"{"code": "value", "silent": false, "store_history": true}"#);
    for _ in 0..3 {
        shell.send(request.clone()).await.unwrap();
    }
    let (_, reply) = answer(&mut shell).await.unwrap();
    assert_eq!((reply["status"].as_str(), reply["execution_count"].as_u64()), (Some("ok"), Some(1)));
    assert!(no_answer(&mut shell).await, "the replays were dropped");
    shell.send(signed("execute_request", r#"{"code": "value", "silent": false, "store_history": true}"#).1).await.unwrap();
    assert_eq!(answer(&mut shell).await.unwrap().1["execution_count"], 2, "a fresh request still runs");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_aborted_after_a_failure_carries_no_execution_count() {
    use zeromq::SocketSend;
    let (info, _server) = start().await;
    let mut shell = dealer(&info.shell_url()).await;
    let failing = r#"{"code": "fail:no", "silent": false, "store_history": true, "stop_on_error": true}"#;
    shell.send(signed("execute_request", failing).1).await.unwrap();
    shell.send(signed("execute_request", r#"{"code": "never", "silent": false, "store_history": true}"#).1).await.unwrap();
    let (_, failed) = answer(&mut shell).await.unwrap();
    assert_eq!((failed["status"].as_str(), failed["execution_count"].as_u64()), (Some("error"), Some(1)));
    let (reply_type, aborted) = answer(&mut shell).await.unwrap();
    assert_eq!(reply_type, "execute_reply");
    assert_eq!(aborted, serde_json::json!({"status": "aborted"}));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panic_while_handling_a_request_is_an_error_reply() {
    use zeromq::SocketSend;
    let (info, _server) = start().await;
    let mut shell = dealer(&info.shell_url()).await;
    shell.send(signed("execute_request", r#"{"code": "panic", "silent": false, "store_history": true}"#).1).await.unwrap();
    let (reply_type, reply) = answer(&mut shell).await.expect("an answer to the request that panicked");
    assert_eq!((reply_type.as_str(), reply["ename"].as_str()), ("execute_reply", Some("InternalError")));
    assert!(reply["evalue"].as_str().unwrap().contains("told to panic"), "{reply}");
    shell.send(signed("execute_request", r#"{"code": "after", "silent": false, "store_history": true}"#).1).await.unwrap();
    assert_eq!(answer(&mut shell).await.unwrap().1["status"], "ok");
}
