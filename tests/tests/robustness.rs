//! The kernel against a hostile or clumsy client: thousands of malformed,
//! forged, replayed and oversized inputs on its sockets, raw TCP that lies
//! about frame sizes, and a front end that dies. Through all of it the kernel
//! must keep answering, run nothing forged and nothing twice, and exit when
//! its parent is gone.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::Kernel;
use jupyter_protocol::{JupyterMessageContent, KernelInfoRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{Socket, SocketRecv, SocketSend};

const KEY: &str = "fuzz-key";
const SEED: u64 = 0x5eed_1234_abcd_0001;
const INPUTS: usize = 10_000;
/// A small cap, so that an oversized message is cheap to send.
const CAP: usize = 1 << 20;

/// xorshift64*: seeded, so a failure can be replayed from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    /// Text with the characters parsers trip over: NUL, quotes, backslashes,
    /// multi-byte and bidirectional characters, a BOM.
    fn text(&mut self) -> String {
        const PIECES: &[&str] = &[
            "a",
            "Z",
            "0",
            " ",
            "\n",
            "\t",
            "\"",
            "\\",
            "{",
            "}",
            "(",
            "]",
            ";",
            "%",
            ":",
            "é",
            "日本",
            "🦀",
            "\u{0}",
            "\u{202e}",
            "\u{feff}",
            "\u{10ffff}",
            "let",
            "fn",
            "%lsmagic",
            "\u{7f}",
        ];
        (0..self.below(24)).map(|_| *self.pick(PIECES)).collect()
    }

    fn json(&mut self, depth: usize) -> serde_json::Value {
        use serde_json::Value;
        match self.below(if depth == 0 { 5 } else { 7 }) {
            0 => Value::Null,
            1 => Value::Bool(self.chance(50)),
            2 => match self.below(4) {
                0 => (self.next() as i64).into(),
                1 => (-(self.below(1000) as i64)).into(),
                2 => serde_json::json!(if f64::from_bits(self.next()).is_finite() { 1e308 } else { -0.5 }),
                _ => u64::MAX.into(),
            },
            3 | 4 => Value::String(self.text()),
            5 => Value::Array((0..self.below(4)).map(|_| self.json(depth - 1)).collect()),
            _ => {
                // Never `restart`: a valid shutdown_request would end the test.
                const KEYS: &[&str] = &[
                    "code",
                    "cursor_pos",
                    "silent",
                    "store_history",
                    "n",
                    "hist_access_type",
                    "detail_level",
                    "value",
                    "comm_id",
                    "target_name",
                    "x",
                ];
                Value::Object((0..self.below(4)).map(|_| ((*self.pick(KEYS)).to_owned(), self.json(depth - 1))).collect())
            }
        }
    }
}

fn sign(key: &str, parts: &[&[u8]]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key.as_bytes());
    let mut ctx = ring::hmac::Context::with_key(&key);
    parts.iter().for_each(|p| ctx.update(p));
    data_encoding::HEXLOWER.encode(ctx.sign().as_ref())
}

fn header(msg_type: &str, msg_id: &str) -> String {
    serde_json::json!({
        "msg_id": msg_id, "username": "fuzz", "session": "fuzz", "date": chrono::Utc::now().to_rfc3339(),
        "msg_type": msg_type, "version": "5.3",
    })
    .to_string()
}

fn message(parts: Vec<Vec<u8>>) -> zeromq::ZmqMessage {
    zeromq::ZmqMessage::try_from(parts.into_iter().map(Bytes::from).collect::<Vec<_>>()).unwrap()
}

/// A complete message: delimiter, signature made with `key`, the four JSON parts.
fn signed_with(key: &str, header: &str, content: &[u8]) -> zeromq::ZmqMessage {
    let parts: [&[u8]; 4] = [header.as_bytes(), b"{}", b"{}", content];
    let mut frames = vec![b"<IDS|MSG>".to_vec(), sign(key, &parts).into_bytes()];
    frames.extend(parts.iter().map(|p| p.to_vec()));
    message(frames)
}

/// Fast cells only: magics the kernel answers itself and cells that do not parse.
const CODES: &[&str] = &[
    "%lsmagic",
    "%help oomcheck",
    "}}}",
    "let = ;",
    "%oomcheck resnet50 --batch 4294967296 --res 65535",
    "%nosuchmagic",
    "%oomcheck resnet18 --batch 8 --res 64 --gpu 8GiB",
    "%summary resnet18 --depth 1 --input 1x3x64x64",
];

#[derive(Default)]
struct Ledger {
    /// Authentic execute requests sent, by msg_id.
    authentic: HashSet<String>,
    forged: HashSet<String>,
    replays: usize,
    by_family: HashMap<&'static str, usize>,
}

enum Channel {
    Shell,
    Control,
}

struct Input {
    family: &'static str,
    channel: Channel,
    message: zeromq::ZmqMessage,
}

const SHELL_TYPES: &[&str] = &[
    "execute_request",
    "execute_request",
    "execute_request",
    "is_complete_request",
    "history_request",
    "comm_info_request",
    "kernel_info_request",
    "comm_open",
    "comm_msg",
    "comm_close",
    "input_reply",
    "teleport_request",
    "execute_reply",
    "",
];
const CONTROL_TYPES: &[&str] = &["kernel_info_request", "interrupt_request", "shutdown_request", "debug_request", "execute_request"];

fn generate(rng: &mut Rng, ledger: &mut Ledger, sent: &mut Vec<zeromq::ZmqMessage>) -> Input {
    let channel = if rng.chance(25) { Channel::Control } else { Channel::Shell };
    let types = match channel {
        Channel::Shell => SHELL_TYPES,
        Channel::Control => CONTROL_TYPES,
    };
    let msg_type = *rng.pick(types);
    let msg_id = uuid::Uuid::new_v4().to_string();
    let head = header(msg_type, &msg_id);
    let (family, message) = match rng.below(12) {
        0 => (
            "random frames",
            message(
                (0..1 + rng.below(8))
                    .map(|_| {
                        let n = rng.below(64);
                        rng.bytes(n)
                    })
                    .collect(),
            ),
        ),
        1 => {
            let parts = rng.below(4);
            let mut frames = vec![b"<IDS|MSG>".to_vec(), b"00".to_vec()];
            frames.extend((0..parts).map(|_| b"{}".to_vec()));
            ("too few parts", message(frames))
        }
        2 => ("no delimiter", message(vec![head.clone().into_bytes(), b"{}".to_vec(), b"{}".to_vec(), b"{}".to_vec()])),
        3 => {
            let signature = match rng.below(3) {
                0 => "zz-not-hex".to_owned(),
                1 => String::new(),
                _ => data_encoding::HEXLOWER.encode(&rng.bytes(32)),
            };
            let frames = vec![
                b"<IDS|MSG>".to_vec(),
                signature.into_bytes(),
                head.clone().into_bytes(),
                b"{}".to_vec(),
                b"{}".to_vec(),
                b"{}".to_vec(),
            ];
            ("bad or missing signature", message(frames))
        }
        4 => {
            // Forged: signed with another key; an execute that would show on iopub if run.
            let head = header("execute_request", &msg_id);
            ledger.forged.insert(msg_id.clone());
            let content = serde_json::json!({"code": "%lsmagic", "silent": false, "store_history": true}).to_string();
            ("forged", signed_with("not-the-key", &head, content.as_bytes()))
        }
        5 => {
            let part = rng.below(4);
            let mut parts: Vec<Vec<u8>> = vec![head.clone().into_bytes(), b"{}".to_vec(), b"{}".to_vec(), b"{}".to_vec()];
            parts[part] = match rng.below(3) {
                0 => b"{not json".to_vec(),
                1 => {
                    let n = rng.below(40);
                    rng.bytes(n)
                }
                _ => rng.text().into_bytes(),
            };
            let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
            let mut frames = vec![b"<IDS|MSG>".to_vec(), sign(KEY, &refs).into_bytes()];
            frames.extend(parts);
            ("bad JSON, signed", message(frames))
        }
        6 if !sent.is_empty() => {
            ledger.replays += 1;
            ("replay", sent[rng.below(sent.len())].clone())
        }
        7 => {
            // A header of the wrong types.
            let head = serde_json::json!({"msg_id": rng.json(1), "msg_type": rng.json(1), "date": rng.json(1), "session": 5}).to_string();
            ("header of wrong types", signed_with(KEY, &head, b"{}"))
        }
        8 | 9 if msg_type == "execute_request" => {
            let content = serde_json::json!({
                "code": *rng.pick(CODES), "silent": rng.chance(20), "store_history": rng.chance(80),
                "stop_on_error": rng.chance(10), "allow_stdin": false,
            })
            .to_string();
            ledger.authentic.insert(msg_id.clone());
            let signed = signed_with(KEY, &head, content.as_bytes());
            sent.push(signed.clone());
            ("valid execute", signed)
        }
        _ => {
            // Valid JSON of the wrong types (or, by chance, the right ones).
            let content = match msg_type {
                // Only shapes that can never be a valid shutdown (`[false]` is one: serde reads
                // a struct from a sequence of its fields).
                "shutdown_request" => serde_json::Value::String(rng.text()),
                _ => rng.json(3),
            };
            if msg_type == "execute_request" {
                ledger.authentic.insert(msg_id.clone());
            }
            let signed = signed_with(KEY, &head, content.to_string().as_bytes());
            sent.push(signed.clone());
            ("valid JSON, wrong types", signed)
        }
    };
    if sent.len() > 64 {
        sent.remove(0);
    }
    *ledger.by_family.entry(family).or_default() += 1;
    Input { family, channel, message }
}

async fn dealer(url: &str) -> zeromq::DealerSocket {
    let mut socket = zeromq::DealerSocket::new();
    socket.connect(url).await.unwrap();
    socket
}

/// Reads whatever replies are waiting, so no queue grows without bound.
async fn drain(socket: &mut zeromq::DealerSocket) -> usize {
    let mut count = 0;
    while let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(2), socket.recv()).await {
        count += 1;
    }
    count
}

/// Every iopub message received so far, by the msg_id of its parent.
async fn drain_iopub(kernel: &mut Kernel, inputs_by_parent: &mut HashMap<String, usize>) {
    while let Ok(read) = tokio::time::timeout(Duration::from_millis(2), kernel.iopub.read()).await {
        let Ok(message) = read else { continue };
        if message.message_type() == "execute_input" {
            let parent = message.parent_header.map(|h| h.msg_id).unwrap_or_default();
            *inputs_by_parent.entry(parent).or_default() += 1;
        }
    }
}

/// A signed kernel_info_request on shell and on control, each answered within 2 s.
async fn answers_within_2s(kernel: &mut Kernel, after: usize) {
    for on_control in [false, true] {
        let request = kernel.message(KernelInfoRequest {});
        let id = request.header.msg_id.clone();
        let started = Instant::now();
        if on_control {
            kernel.control.send(request).await.unwrap();
        } else {
            kernel.shell.send(request).await.unwrap();
        }
        loop {
            let left = Duration::from_secs(2).saturating_sub(started.elapsed());
            let read = if on_control {
                tokio::time::timeout(left, kernel.control.read()).await
            } else {
                tokio::time::timeout(left, kernel.shell.read()).await
            };
            let reply =
                read.unwrap_or_else(|_| panic!("no kernel_info_reply within 2 s after {after} inputs (control: {on_control})")).unwrap();
            if reply.parent_header.as_ref().map(|h| h.msg_id.as_str()) == Some(id.as_str()) {
                assert!(matches!(reply.content, JupyterMessageContent::KernelInfoReply(_)));
                break;
            }
        }
    }
}

/// The 64-byte ZMTP 3.0 greeting of a NULL-mechanism client.
fn greeting() -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0];
    let mut mechanism = b"NULL".to_vec();
    mechanism.resize(20, 0);
    g.extend(mechanism);
    g.push(0);
    g.resize(64, 0);
    g
}

/// A READY command saying "DEALER", so that what follows is read as messages.
fn ready() -> Vec<u8> {
    let mut body = vec![5];
    body.extend(b"READY");
    body.push(11);
    body.extend(b"Socket-Type");
    body.extend(6u32.to_be_bytes());
    body.extend(b"DEALER");
    let mut frame = vec![0x04, body.len() as u8];
    frame.extend(body);
    frame
}

/// Sends `bytes` on a raw TCP connection and waits for the kernel to close it.
async fn raw_tcp(port: u16, bytes: &[u8]) -> bool {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let _ = stream.write_all(bytes).await;
    let mut buffer = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            _ => {}
        }
    }
    false
}

/// What raw TCP peers send: a greeting, then a frame header that claims
/// 2^62 bytes (as a message or as a command), or random bytes.
fn raw_inputs(rng: &mut Rng) -> Vec<(&'static str, Vec<u8>)> {
    let huge = (1u64 << 62).to_be_bytes();
    let mut message_frame = greeting();
    message_frame.extend(ready());
    message_frame.push(0x02);
    message_frame.extend(huge);
    let mut command_frame = greeting();
    command_frame.push(0x06);
    command_frame.extend(huge);
    let mut over_cap = greeting();
    over_cap.extend(ready());
    over_cap.push(0x03);
    over_cap.extend((CAP as u64 + 1).to_be_bytes());
    let mut random = greeting();
    random.extend(rng.bytes(512));
    vec![
        ("message frame of 2^62 bytes", message_frame),
        ("command frame of 2^62 bytes", command_frame),
        ("frame over the cap", over_cap),
        ("random bytes after the greeting", random),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_malformed_inputs_leave_the_kernel_answering_and_running_nothing_forged() {
    // Every dropped input is logged as a warning: ten thousand lines.
    let mut kernel = Kernel::start_with(KEY, &["--max-message-size", "1MiB"], &[("RUST_LOG", "error")]).await;
    // The first cell waits for the engine's own preparation; afterwards every cell the fuzzer sends is fast.
    kernel.execute("}}}").await;
    let mut rng = Rng(SEED);
    let mut ledger = Ledger::default();
    let mut sent = Vec::new();
    let mut shell = dealer(&kernel.info.shell_url()).await;
    let mut control = dealer(&kernel.info.control_url()).await;
    let mut inputs_by_parent = HashMap::new();
    let mut replies = 0;
    let started = Instant::now();
    for i in 0..INPUTS {
        let input = generate(&mut rng, &mut ledger, &mut sent);
        let socket = match input.channel {
            Channel::Shell => &mut shell,
            Channel::Control => &mut control,
        };
        socket.send(input.message).await.unwrap_or_else(|e| panic!("input {i} ({}): {e}", input.family));
        if i % 250 == 249 {
            replies += drain(&mut shell).await + drain(&mut control).await;
            drain_iopub(&mut kernel, &mut inputs_by_parent).await;
            answers_within_2s(&mut kernel, i + 1).await;
        }
        if i % 2000 == 1999 {
            // An oversized message from a connection of its own, which the kernel drops.
            let mut big = dealer(&kernel.info.shell_url()).await;
            let head = header("execute_request", "too-big");
            big.send(signed_with(KEY, &head, &vec![b' '; CAP + 1])).await.unwrap();
            for (name, bytes) in raw_inputs(&mut rng) {
                let port = if rng.chance(50) { kernel.info.shell_port } else { kernel.info.control_port };
                assert!(raw_tcp(port, &bytes).await, "the kernel kept a connection that sent {name}");
            }
            answers_within_2s(&mut kernel, i + 1).await;
        }
    }
    // Let the last replies and iopub messages arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    replies += drain(&mut shell).await + drain(&mut control).await;
    drain_iopub(&mut kernel, &mut inputs_by_parent).await;
    answers_within_2s(&mut kernel, INPUTS).await;
    eprintln!(
        "{INPUTS} inputs in {:.1} s, {replies} replies, {} replays; by family: {:?}",
        started.elapsed().as_secs_f64(),
        ledger.replays,
        ledger.by_family
    );

    for (parent, count) in &inputs_by_parent {
        assert!(!ledger.forged.contains(parent), "a forged execute_request ran ({parent})");
        assert!(ledger.authentic.contains(parent) || parent.is_empty(), "an execute_input for a request never sent ({parent})");
        assert_eq!(*count, 1, "request {parent} ran {count} times: a replay was executed");
    }
    assert!(inputs_by_parent.len() > 50, "only {} authentic cells ran: the fuzzer sends too few valid ones", inputs_by_parent.len());
    assert!(ledger.replays > 300 && ledger.forged.len() > 300, "{} replays, {} forged", ledger.replays, ledger.forged.len());
    assert!(kernel.is_running(), "the kernel process died");
    assert!(kernel.heartbeat_ok().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn frames_over_the_cap_drop_the_connection_not_the_kernel() {
    let mut kernel = Kernel::start_with(KEY, &["--max-message-size", "1MiB"], &[]).await;
    let mut rng = Rng(SEED ^ 1);
    let ports = [
        ("shell", kernel.info.shell_port),
        ("control", kernel.info.control_port),
        ("stdin", kernel.info.stdin_port),
        ("heartbeat", kernel.info.hb_port),
        ("iopub", kernel.info.iopub_port),
    ];
    let mut kept = Vec::new();
    for (socket, port) in ports {
        for (name, bytes) in raw_inputs(&mut rng) {
            if !raw_tcp(port, &bytes).await {
                kept.push(format!("{socket}: {name}"));
            }
        }
    }
    assert!(kept.is_empty(), "the kernel kept connections that sent {kept:?}");
    // A signed request just over the cap is dropped with its connection; one under it runs.
    let mut big = dealer(&kernel.info.shell_url()).await;
    let over = serde_json::json!({"code": format!("%lsmagic{}", " ".repeat(CAP)), "silent": false, "store_history": true}).to_string();
    big.send(signed_with(KEY, &header("execute_request", "over"), over.as_bytes())).await.unwrap();
    // The dropped connection may end the receive with an error; what must not come is a message.
    let answer = tokio::time::timeout(Duration::from_secs(2), big.recv()).await;
    assert!(!matches!(answer, Ok(Ok(_))), "no reply to a message over the cap");
    let under = kernel.execute(&format!("%lsmagic{}", " ".repeat(CAP / 2))).await;
    assert!(under.result_text().unwrap().contains("%oomcheck"));
    assert!(kernel.is_running() && kernel.heartbeat_ok().await);
    answers_within_2s(&mut kernel, 0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kernel_whose_parent_dies_exits() {
    let dir = tempfile::tempdir().unwrap();
    let info = common::free_connection_info(KEY).await;
    let file = dir.path().join("kernel.json");
    std::fs::write(&file, serde_json::to_string(&info).unwrap()).unwrap();
    // A parent that starts the kernel, says its pid, and waits: Jupyter's place.
    let mut parent = std::process::Command::new("sh")
        .arg("-c")
        .arg("\"$0\" --connection-file \"$1\" & echo $!; wait")
        .arg(common::kernel_binary())
        .arg(&file)
        .env("VRAMLAB_CACHE_DIR", common::cache_dir())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(parent.stdout.take().unwrap()), &mut line).unwrap();
    let kernel_pid: u32 = line.trim().parse().unwrap();
    let alive = |pid: u32| {
        std::path::Path::new(&format!("/proc/{pid}")).exists()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
    };
    let mut heartbeat = jupyter_zmq_client::create_client_heartbeat_connection(&info).await.unwrap();
    let up = Instant::now();
    while tokio::time::timeout(Duration::from_secs(1), heartbeat.single_heartbeat()).await.is_err() {
        assert!(up.elapsed() < Duration::from_secs(30), "the kernel never answered its heartbeat");
    }
    // The cell process evcxr starts must go too.
    let children = |pid: u32| -> Vec<u32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|p| {
                let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
                stat.rsplit_once(") ").and_then(|(_, rest)| rest.split(' ').nth(1)?.parse::<u32>().ok()) == Some(pid)
            })
            .collect()
    };
    let mut cell_processes = children(kernel_pid);
    while cell_processes.is_empty() {
        assert!(up.elapsed() < Duration::from_secs(60), "the kernel started no cell process");
        tokio::time::sleep(Duration::from_millis(100)).await;
        cell_processes = children(kernel_pid);
    }
    parent.kill().unwrap();
    parent.wait().unwrap();
    let killed = Instant::now();
    while alive(kernel_pid) || cell_processes.iter().any(|&p| alive(p)) {
        assert!(killed.elapsed() < Duration::from_secs(5), "the kernel or its cell process outlived the parent by 5 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("the kernel exited {:.1} s after its parent", killed.elapsed().as_secs_f64());
}
