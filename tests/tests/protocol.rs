//! The kernel's protocol bookkeeping, driven over ZeroMQ like a front end.

mod common;

use std::time::Duration;

use common::Kernel;
use jupyter_protocol::{
    CommInfoRequest, CompleteRequest, ExecuteRequest, HistoryEntry, HistoryRequest, InspectRequest, IsCompleteReplyStatus,
    IsCompleteRequest, JupyterMessageContent, KernelInfoRequest, Payload, ReplyStatus, UnknownMessage,
};

#[tokio::test(flavor = "multi_thread")]
async fn kernel_info_counts_history_and_queries() {
    let mut kernel = Kernel::start().await;

    for reply in [kernel.shell_request(KernelInfoRequest {}).await, kernel.control_request(KernelInfoRequest {}).await] {
        let JupyterMessageContent::KernelInfoReply(info) = reply.content else { panic!("expected kernel_info_reply") };
        assert_eq!(info.language_info.name, "rust");
        assert_eq!(info.language_info.file_extension.as_deref(), Some(".rs"));
        assert_eq!(info.protocol_version, "5.3");
        assert!(!info.help_links.is_empty());
    }
    assert!(kernel.heartbeat_ok().await);

    let first = kernel.execute("1 + 1").await;
    assert_eq!(first.reply.status, ReplyStatus::Ok);
    assert_eq!(first.reply.execution_count.value(), 1, "execution counts start at 1");
    assert_eq!(first.result_text().as_deref(), Some("2"));
    let input = first.received.iter().find_map(|(_, m)| match &m.content {
        JupyterMessageContent::ExecuteInput(i) => Some(i.clone()),
        _ => None,
    });
    assert_eq!(input.map(|i| (i.code, i.execution_count.value())), Some(("1 + 1".to_owned(), 1)));

    let silent =
        kernel.execute_request(ExecuteRequest { silent: true, ..ExecuteRequest::new("2 + 2".into()) }, Duration::from_secs(120)).await;
    assert_eq!(silent.reply.execution_count.value(), 1, "silent cells do not count");
    assert!(silent.received.iter().all(|(_, m)| !matches!(m.message_type(), "execute_input" | "execute_result")));
    let unstored = kernel
        .execute_request(ExecuteRequest { store_history: false, ..ExecuteRequest::new("3 + 3".into()) }, Duration::from_secs(120))
        .await;
    assert_eq!(unstored.reply.execution_count.value(), 1, "store_history=false does not count");
    assert_eq!(unstored.result_text().as_deref(), Some("6"));
    assert_eq!(kernel.execute("4 + 4").await.reply.execution_count.value(), 2);

    let reply = kernel.shell_request(HistoryRequest::Tail { n: 10, output: true, raw: true }).await;
    let JupyterMessageContent::HistoryReply(tail) = reply.content else { panic!("expected history_reply") };
    let stored: Vec<(usize, String, String)> = tail
        .history
        .iter()
        .map(|e| match e {
            HistoryEntry::InputOutput(_, n, (i, o)) => (*n, i.clone(), o.clone()),
            HistoryEntry::Input(..) => panic!("asked for output"),
        })
        .collect();
    assert_eq!(stored, vec![(1, "1 + 1".into(), "2".into()), (2, "4 + 4".into(), "8".into())]);
    let reply = kernel.shell_request(HistoryRequest::Search { pattern: "4*".into(), unique: true, output: false, raw: true, n: 5 }).await;
    let JupyterMessageContent::HistoryReply(found) = reply.content else { panic!("expected history_reply") };
    assert_eq!(found.history.len(), 1);

    for (code, status) in [
        ("let v = vec![1, 2];", IsCompleteReplyStatus::Complete),
        ("fn f() {\n    let x = (1,", IsCompleteReplyStatus::Incomplete),
        ("let s = \"unterminated", IsCompleteReplyStatus::Incomplete),
        ("let x = (1, 2];", IsCompleteReplyStatus::Invalid),
    ] {
        let reply = kernel.shell_request(IsCompleteRequest { code: code.into() }).await;
        let JupyterMessageContent::IsCompleteReply(verdict) = reply.content else { panic!("expected is_complete_reply") };
        assert_eq!(verdict.status, status, "{code}");
    }

    let code = "std::mem::swa";
    let reply = kernel.shell_request(CompleteRequest { code: code.into(), cursor_pos: code.len() }).await;
    let JupyterMessageContent::CompleteReply(completion) = reply.content else { panic!("expected complete_reply") };
    assert!(completion.matches.iter().any(|m| m.starts_with("swap(")), "{:?}", completion.matches);
    assert_eq!(completion.cursor_start, "std::mem::".len());
    assert_eq!(completion.cursor_end, code.len());

    let reply = kernel.shell_request(InspectRequest { code: "Vec::with_capacity".into(), cursor_pos: 5, detail_level: Some(0) }).await;
    let JupyterMessageContent::InspectReply(inspected) = reply.content else { panic!("expected inspect_reply") };
    assert!(inspected.found, "rust-analyzer should document Vec::with_capacity");

    let reply = kernel.shell_request(CommInfoRequest { target_name: None }).await;
    let JupyterMessageContent::CommInfoReply(comms) = reply.content else { panic!("expected comm_info_reply") };
    assert!(comms.comms.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn magics_run_in_the_kernel() {
    let mut kernel = Kernel::start().await;

    let listed = kernel.execute("%lsmagic").await;
    assert_eq!(listed.reply.status, ReplyStatus::Ok);
    let text = listed.result_text().unwrap();
    assert!(text.contains("%lsmagic") && text.contains("%help") && text.contains("%doc"), "{text}");

    let help = kernel.execute("%help doc").await;
    assert!(help.result_text().unwrap().starts_with("%doc: "));

    // An absurd configuration is a one-line error at once, and the kernel lives on.
    let absurd = kernel.execute("%oomcheck resnet50 --batch 4294967296 --res 65535").await;
    let error = absurd.error().expect("an error output");
    assert_eq!(error.ename, "UsageError");
    assert_eq!(error.evalue, "batch 4294967296 is over the largest vramlab costs, 65536");
    assert!(kernel.execute("%lsmagic").await.result_text().is_some());

    let unknown = kernel.execute("%lsmagik").await;
    assert_eq!(unknown.reply.status, ReplyStatus::Error);
    let error = unknown.error().unwrap();
    assert_eq!(error.ename, "UsageError");
    assert!(error.evalue.contains("did you mean %lsmagic?"), "{}", error.evalue);

    let mixed = kernel.execute("let a = 20;\n%help lsmagic\na + 1").await;
    assert_eq!(mixed.types(), vec!["display_data", "execute_result"]);
    assert_eq!(mixed.result_text().as_deref(), Some("21"));

    let docs = kernel.execute("%doc Vec::with_capacity").await;
    assert_eq!(docs.reply.status, ReplyStatus::Ok);
    match docs.reply.payload.as_slice() {
        [Payload::Page { data, .. }] => {
            let text = serde_json::to_value(data).unwrap()["text/plain"].as_str().unwrap().to_owned();
            assert!(text.contains("with_capacity"), "{text}");
        }
        other => panic!("expected one page payload, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_messages_are_dropped_and_the_kernel_survives() {
    let mut kernel = Kernel::start().await;
    kernel.execute("let guard = 7;").await;

    // A request signed with the wrong key is never executed.
    let mut forged = jupyter_zmq_client::create_client_shell_connection_with_identity(
        &jupyter_protocol::ConnectionInfo { key: "not-the-key".into(), ..kernel.info.clone() },
        &kernel.session,
        jupyter_zmq_client::peer_identity_for_session("forger").unwrap(),
    )
    .await
    .unwrap();
    let forged_request = kernel.message(ExecuteRequest::new("let guard = 8;".into()));
    forged.send(forged_request).await.unwrap();
    // An unsigned request is dropped too.
    let mut unsigned = jupyter_zmq_client::create_client_shell_connection_with_identity(
        &jupyter_protocol::ConnectionInfo { key: String::new(), ..kernel.info.clone() },
        &kernel.session,
        jupyter_zmq_client::peer_identity_for_session("unsigned").unwrap(),
    )
    .await
    .unwrap();
    unsigned.send(kernel.message(ExecuteRequest::new("let guard = 9;".into()))).await.unwrap();
    assert!(tokio::time::timeout(Duration::from_secs(2), forged.read()).await.is_err(), "no reply to a forged request");

    // Malformed frames: no delimiter, too few parts, JSON that is not JSON, a known
    // type with the wrong content; each signed correctly where a signature applies.
    let mut raw = <zeromq::DealerSocket as zeromq::Socket>::new();
    zeromq::Socket::connect(&mut raw, &kernel.info.shell_url()).await.unwrap();
    let sign = |parts: &[&[u8]]| {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, kernel.info.key.as_bytes());
        let mut ctx = ring::hmac::Context::with_key(&key);
        parts.iter().for_each(|p| ctx.update(p));
        data_encoding::HEXLOWER.encode(ctx.sign().as_ref())
    };
    let header = |t: &str| {
        format!(r#"{{"msg_id":"m-{t}","username":"u","session":"s","date":"2026-01-01T00:00:00Z","msg_type":"{t}","version":"5.3"}}"#)
    };
    let bad_json_header = header("execute_request");
    let bad_content_header = header("execute_request");
    let frames: Vec<Vec<Vec<u8>>> = vec![
        vec![b"garbage".to_vec()],
        vec![b"<IDS|MSG>".to_vec(), b"sig".to_vec(), b"{}".to_vec()],
        vec![
            b"<IDS|MSG>".to_vec(),
            sign(&[bad_json_header.as_bytes(), b"{}", b"{}", b"{not json"]).into_bytes(),
            bad_json_header.clone().into_bytes(),
            b"{}".to_vec(),
            b"{}".to_vec(),
            b"{not json".to_vec(),
        ],
        vec![
            b"<IDS|MSG>".to_vec(),
            sign(&[bad_content_header.as_bytes(), b"{}", b"{}", br#"{"code": 5}"#]).into_bytes(),
            bad_content_header.clone().into_bytes(),
            b"{}".to_vec(),
            b"{}".to_vec(),
            br#"{"code": 5}"#.to_vec(),
        ],
    ];
    for parts in frames {
        let message = zeromq::ZmqMessage::try_from(parts.into_iter().map(bytes::Bytes::from).collect::<Vec<_>>()).unwrap();
        zeromq::SocketSend::send(&mut raw, message).await.unwrap();
    }
    // Only the authentic request with content of the wrong shape is answered:
    // an error reply that says what was wrong.
    let answer = tokio::time::timeout(Duration::from_secs(10), zeromq::SocketRecv::recv(&mut raw)).await.unwrap().unwrap();
    let parts: Vec<&[u8]> = answer.iter().map(|p| p.as_ref()).collect();
    let delimiter = parts.iter().position(|p| *p == b"<IDS|MSG>").unwrap();
    let header: serde_json::Value = serde_json::from_slice(parts[delimiter + 2]).unwrap();
    let content: serde_json::Value = serde_json::from_slice(parts[delimiter + 5]).unwrap();
    assert_eq!(header["msg_type"], "execute_reply");
    assert_eq!((content["status"].as_str(), content["ename"].as_str()), (Some("error"), Some("MalformedMessage")));
    assert!(content["evalue"].as_str().unwrap().contains("invalid type: integer `5`"), "{content}");
    assert!(tokio::time::timeout(Duration::from_secs(1), zeromq::SocketRecv::recv(&mut raw)).await.is_err(), "one reply only");
    // An unknown message type gets no reply but busy/idle, and the loop goes on.
    let unknown = kernel.message(UnknownMessage { msg_type: "teleport_request".into(), content: serde_json::json!({}) });
    let unknown_id = unknown.header.msg_id.clone();
    kernel.shell.send(unknown).await.unwrap();
    let statuses = kernel.iopub_until_idle(&unknown_id, Duration::from_secs(30)).await;
    assert_eq!(statuses.len(), 2);

    let after = kernel.execute("guard").await;
    assert_eq!(after.result_text().as_deref(), Some("7"), "forged and unsigned cells must not have run");
    assert!(kernel.is_running());
    assert!(kernel.heartbeat_ok().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn shutdown_replies_then_ends_the_process() {
    let mut kernel = Kernel::start().await;
    kernel.execute("let x = 1;").await;
    let reply = kernel.control_request(jupyter_protocol::ShutdownRequest { restart: true }).await;
    let JupyterMessageContent::ShutdownReply(shutdown) = reply.content else { panic!("expected shutdown_reply") };
    assert!(shutdown.restart && shutdown.status == ReplyStatus::Ok);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while kernel.is_running() {
        assert!(std::time::Instant::now() < deadline, "the kernel process did not exit after shutdown");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(kernel.child.wait().unwrap().code(), Some(0));
}
