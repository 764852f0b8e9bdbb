//! A Jupyter client for driving the built kernel binary over ZeroMQ.

#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use jupyter_protocol::{ConnectionInfo, ExecuteReply, ExecuteRequest, JupyterMessage, JupyterMessageContent, Transport};
use jupyter_zmq_client::{
    create_client_control_connection, create_client_heartbeat_connection, create_client_iopub_connection,
    create_client_shell_connection_with_identity, create_client_stdin_connection_with_identity, peer_identity_for_session,
    ClientControlConnection, ClientHeartbeatConnection, ClientIoPubConnection, ClientShellConnection, ClientStdinConnection,
};

/// The kernel binary built by the same `cargo test --release` run.
pub fn kernel_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("VRAMLAB_KERNEL_BIN") {
        return PathBuf::from(path);
    }
    let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join(profile).join("vramlab-kernel")
}

/// Build directories shared by the test kernels, so a warm build serves every
/// test. Outside the workspace: evcxr cannot build inside another Cargo project.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("VRAMLAB_CACHE_DIR").map(PathBuf::from).unwrap_or_else(|| std::env::temp_dir().join("vramlab-test-cache"))
}

pub async fn free_connection_info(key: &str) -> ConnectionInfo {
    let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let ports = jupyter_zmq_client::peek_ports(ip, 5).await.expect("free ports");
    ConnectionInfo {
        ip: ip.to_string(),
        transport: Transport::TCP,
        shell_port: ports[0],
        iopub_port: ports[1],
        stdin_port: ports[2],
        control_port: ports[3],
        hb_port: ports[4],
        key: key.to_owned(),
        signature_scheme: "hmac-sha256".into(),
        kernel_name: Some("vramlab".into()),
    }
}

pub struct Kernel {
    pub child: Child,
    pub info: ConnectionInfo,
    pub session: String,
    pub shell: ClientShellConnection,
    pub control: ClientControlConnection,
    pub iopub: ClientIoPubConnection,
    pub stdin: ClientStdinConnection,
    pub heartbeat: ClientHeartbeatConnection,
    _dir: tempfile::TempDir,
}

pub struct Execution {
    pub reply: ExecuteReply,
    /// iopub messages for the request between busy and idle, without status.
    pub outputs: Vec<JupyterMessage>,
    pub received: Vec<(Instant, JupyterMessage)>,
}

impl Execution {
    pub fn stdout(&self) -> String {
        self.stream("stdout")
    }

    pub fn stderr(&self) -> String {
        self.stream("stderr")
    }

    fn stream(&self, name: &str) -> String {
        self.outputs
            .iter()
            .filter_map(|m| match &m.content {
                JupyterMessageContent::StreamContent(s) if serde_json::to_value(&s.name).unwrap() == name => Some(s.text.clone()),
                _ => None,
            })
            .collect()
    }

    pub fn types(&self) -> Vec<&str> {
        self.outputs.iter().map(|m| m.message_type()).collect()
    }

    pub fn result_text(&self) -> Option<String> {
        self.outputs.iter().find_map(|m| match &m.content {
            JupyterMessageContent::ExecuteResult(r) => {
                serde_json::to_value(&r.data).ok().and_then(|v| v["text/plain"].as_str().map(str::to_owned))
            }
            _ => None,
        })
    }

    pub fn error(&self) -> Option<&jupyter_protocol::ErrorOutput> {
        self.outputs.iter().find_map(|m| match &m.content {
            JupyterMessageContent::ErrorOutput(e) => Some(e),
            _ => None,
        })
    }
}

impl Kernel {
    pub async fn start() -> Kernel {
        Self::start_with_key(&uuid::Uuid::new_v4().to_string()).await
    }

    pub async fn start_with_key(key: &str) -> Kernel {
        Self::start_with(key, &[], &[]).await
    }

    /// A kernel started with `args` after its connection file and `envs` set.
    pub async fn start_with(key: &str, args: &[&str], envs: &[(&str, &str)]) -> Kernel {
        let dir = tempfile::tempdir().unwrap();
        let info = free_connection_info(key).await;
        let file = dir.path().join("kernel.json");
        std::fs::write(&file, serde_json::to_string(&info).unwrap()).unwrap();
        let child = Command::new(kernel_binary())
            .arg("--connection-file")
            .arg(&file)
            .args(args)
            .env("VRAMLAB_CACHE_DIR", cache_dir())
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .spawn()
            .expect("start the kernel binary (built by cargo test --release)");
        let session = uuid::Uuid::new_v4().to_string();
        let identity = peer_identity_for_session(&session).unwrap();
        let iopub = create_client_iopub_connection(&info, "", &session).await.unwrap();
        let shell = create_client_shell_connection_with_identity(&info, &session, identity.clone()).await.unwrap();
        let stdin = create_client_stdin_connection_with_identity(&info, &session, identity).await.unwrap();
        let control = create_client_control_connection(&info, &session).await.unwrap();
        let heartbeat = create_client_heartbeat_connection(&info).await.unwrap();
        let mut kernel = Kernel { child, info, session, shell, control, iopub, stdin, heartbeat, _dir: dir };
        // The kernel is up once it answers; iopub is subscribed once the welcome arrives.
        kernel.wait_for_welcome().await;
        kernel
    }

    async fn wait_for_welcome(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no iopub_welcome within 30 s");
            if let Ok(Ok(message)) = tokio::time::timeout(left, self.iopub.read()).await {
                if message.message_type() == "iopub_welcome" {
                    return;
                }
            }
        }
    }

    pub fn message(&self, content: impl Into<JupyterMessageContent>) -> JupyterMessage {
        JupyterMessage::new(content.into(), None).with_session(&self.session)
    }

    /// Sends on shell and returns the reply to that request.
    pub async fn shell_request(&mut self, content: impl Into<JupyterMessageContent>) -> JupyterMessage {
        let request = self.message(content);
        let id = request.header.msg_id.clone();
        self.shell.send(request).await.unwrap();
        self.shell_reply(&id, Duration::from_secs(60)).await
    }

    pub async fn shell_reply(&mut self, id: &str, within: Duration) -> JupyterMessage {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let reply =
                tokio::time::timeout(left, self.shell.read()).await.unwrap_or_else(|_| panic!("no shell reply within {within:?}")).unwrap();
            if reply.parent_header.as_ref().map(|h| h.msg_id.as_str()) == Some(id) {
                return reply;
            }
        }
    }

    pub async fn control_request(&mut self, content: impl Into<JupyterMessageContent>) -> JupyterMessage {
        let request = self.message(content);
        let id = request.header.msg_id.clone();
        self.control.send(request).await.unwrap();
        loop {
            let reply = tokio::time::timeout(Duration::from_secs(10), self.control.read()).await.unwrap().unwrap();
            if reply.parent_header.as_ref().map(|h| h.msg_id.as_str()) == Some(id.as_str()) {
                return reply;
            }
        }
    }

    pub async fn execute(&mut self, code: &str) -> Execution {
        // The first cell that uses vramlab compiles it and its dependencies into a
        // cold cache: about ten minutes on 2 cores.
        self.execute_request(ExecuteRequest::new(code.to_owned()), Duration::from_secs(1800)).await
    }

    pub async fn execute_request(&mut self, request: ExecuteRequest, within: Duration) -> Execution {
        let request = self.message(request);
        let id = request.header.msg_id.clone();
        self.shell.send(request).await.unwrap();
        let received = self.iopub_until_idle(&id, within).await;
        let reply = match self.shell_reply(&id, Duration::from_secs(10)).await.content {
            JupyterMessageContent::ExecuteReply(reply) => reply,
            other => panic!("expected execute_reply, got {}", other.message_type()),
        };
        let outputs = received
            .iter()
            .filter(|(_, m)| m.message_type() != "status")
            .filter(|(_, m)| m.message_type() != "execute_input")
            .map(|(_, m)| m.clone())
            .collect();
        Execution { reply, outputs, received }
    }

    /// Every iopub message whose parent is `id`, up to its idle status.
    pub async fn iopub_until_idle(&mut self, id: &str, within: Duration) -> Vec<(Instant, JupyterMessage)> {
        let deadline = Instant::now() + within;
        let mut received = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let message = tokio::time::timeout(left, self.iopub.read())
                .await
                .unwrap_or_else(|_| panic!("request {id} not idle within {within:?}"))
                .unwrap();
            if message.parent_header.as_ref().map(|h| h.msg_id.as_str()) != Some(id) {
                continue;
            }
            let idle = matches!(&message.content, JupyterMessageContent::Status(s)
                if s.execution_state == jupyter_protocol::ExecutionState::Idle);
            received.push((Instant::now(), message));
            if idle {
                return received;
            }
        }
    }

    pub async fn heartbeat_ok(&mut self) -> bool {
        matches!(tokio::time::timeout(Duration::from_secs(5), self.heartbeat.single_heartbeat()).await, Ok(Ok(())))
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
