//! The server against a scripted engine: protocol bookkeeping without evcxr.

use std::sync::Arc;
use std::time::Duration;

use jupyter_protocol::{
    ConnectionInfo, ExecuteRequest, ExecutionState, JupyterMessage, JupyterMessageContent, KernelInfoRequest,
    ReplyStatus, ShutdownRequest, Stdio, Transport,
};
use jupyter_zmq_client::{
    create_client_control_connection, create_client_iopub_connection, create_client_shell_connection_with_identity,
    peer_identity_for_session, ClientIoPubConnection,
};
use tokio::sync::oneshot;
use vramlab::render::Bundle;

use crate::engine::{CellError, Completion, Engine, ExecuteJob, Outcome};

/// Runs each line: `print:TEXT` streams, `fail:MESSAGE` fails after 300 ms, and
/// any other line is the cell's result.
struct Scripted;

impl Engine for Scripted {
    fn execute(&self, job: ExecuteJob) -> oneshot::Receiver<Outcome> {
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
    let server = tokio::spawn(crate::server::serve(info.clone(), Arc::new(Scripted)));
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
        create_client_shell_connection_with_identity(&info, session, peer_identity_for_session(session).unwrap())
            .await
            .unwrap();

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
