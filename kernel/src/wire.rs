//! Turning raw ZeroMQ frames into typed messages, with every way that can
//! fail named, so the server can log what was wrong and carry on.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use jupyter_protocol::{Header, JupyterMessage, JupyterMessageContent, UnknownMessage};
use jupyter_zmq_client::RawMessage;
use ring::hmac;

/// How many signatures the kernel remembers to refuse replays: jupyter_client's
/// `Session.digest_history_size`. A replay of a message older than that many
/// authentic messages is not recognised.
pub const DIGEST_HISTORY: usize = 1 << 16;

const DELIMITER: &[u8] = b"<IDS|MSG>";

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("bad or missing signature, or malformed framing: {0}")]
    Frames(#[from] jupyter_zmq_client::RuntimeError),
    #[error("a replay: this signature was already received (msg_id {msg_id:?})")]
    Replayed { msg_id: String },
    #[error("header is not valid JSON for a Jupyter header: {0}")]
    Header(serde_json::Error),
    #[error("{part} is not valid JSON: {source}")]
    Json { part: &'static str, source: serde_json::Error },
}

/// An authentic message: either one whose content fits its type, or one whose
/// content does not, kept so that the sender can be told what was wrong.
#[derive(Debug)]
pub enum Incoming {
    Request(JupyterMessage),
    Malformed { request: JupyterMessage, problem: String },
}

/// Checks signatures and refuses a signature seen before, for every channel
/// of one kernel (jupyter_client's `Session` does the same for its peers).
pub struct Verifier {
    key: Option<hmac::Key>,
    seen: Mutex<DigestHistory>,
}

impl Verifier {
    /// An empty key means no signing, as in the connection file.
    pub fn new(key: &str) -> Verifier {
        let key = (!key.is_empty()).then(|| hmac::Key::new(hmac::HMAC_SHA256, key.as_bytes()));
        Verifier { key, seen: Mutex::new(DigestHistory::default()) }
    }

    pub fn decode(&self, frames: zeromq::ZmqMessage) -> Result<Incoming, DecodeError> {
        let signature = frames.iter().skip_while(|f| f.as_ref() != DELIMITER).nth(1).cloned();
        // Verifies the HMAC over header, parent header, metadata and content.
        let raw = RawMessage::from_multipart(frames, &self.key)?;
        let header: Header = serde_json::from_slice(&raw.jparts[0]).map_err(DecodeError::Header)?;
        if let (Some(_), Some(signature)) = (&self.key, signature) {
            let fresh = self.seen.lock().unwrap_or_else(|e| e.into_inner()).insert(&signature);
            if !fresh {
                return Err(DecodeError::Replayed { msg_id: header.msg_id });
            }
        }
        let mut content: serde_json::Value =
            serde_json::from_slice(&raw.jparts[3]).map_err(|source| DecodeError::Json { part: "content", source })?;
        fill_defaults(&header.msg_type, &mut content);
        let metadata = serde_json::from_slice(&raw.jparts[2]).map_err(|source| DecodeError::Json { part: "metadata", source })?;
        let typed = JupyterMessageContent::from_type_and_content(&header.msg_type, content.clone());
        let mut message = JupyterMessage {
            zmq_identities: raw.zmq_identities,
            // An empty parent header (`{}`) is not a Header: that is the spec's "no parent".
            parent_header: serde_json::from_slice(&raw.jparts[1]).ok(),
            content: JupyterMessageContent::UnknownMessage(UnknownMessage { msg_type: header.msg_type.clone(), content }),
            header,
            metadata,
            buffers: raw.jparts[4..].to_vec(),
            channel: None,
        };
        match typed {
            Ok(typed) => {
                message.content = typed;
                Ok(Incoming::Request(message))
            }
            Err(source) => Ok(Incoming::Malformed { problem: source.to_string(), request: message }),
        }
    }
}

/// The signatures of the last [`DIGEST_HISTORY`] authentic messages: about
/// 10 MB when full. Each is a copy: a received frame's bytes share the buffer
/// they were read into, which a kept slice would keep alive.
#[derive(Default)]
struct DigestHistory {
    set: HashSet<Box<[u8]>>,
    order: VecDeque<Box<[u8]>>,
}

impl DigestHistory {
    /// False when `signature` was already there.
    fn insert(&mut self, signature: &[u8]) -> bool {
        if !self.set.insert(signature.into()) {
            return false;
        }
        self.order.push_back(signature.into());
        if self.order.len() > DIGEST_HISTORY {
            if let Some(oldest) = self.order.pop_front() {
                self.set.remove(&oldest);
            }
        }
        true
    }
}

/// Fields that clients may leave out, with the values ipykernel assumes.
/// jupyter_client's `history()`, for one, sends only the arguments it was given.
fn fill_defaults(msg_type: &str, content: &mut serde_json::Value) {
    let defaults = match msg_type {
        "history_request" => serde_json::json!({
            "output": false, "raw": true, "session": 0, "start": 0, "stop": 0,
            "n": 0, "pattern": "*", "unique": false,
        }),
        _ => return,
    };
    if let (Some(content), serde_json::Value::Object(defaults)) = (content.as_object_mut(), defaults) {
        for (key, value) in defaults {
            content.entry(key).or_insert(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signed(key: &str, msg_type: &str, content: &str) -> zeromq::ZmqMessage {
        let header = format!(
            r#"{{"msg_id":"m1","username":"u","session":"s","date":"2026-01-01T00:00:00Z","msg_type":"{msg_type}","version":"5.3"}}"#
        );
        let parts = [header.as_bytes(), b"{}", b"{}", content.as_bytes()];
        let mac = hmac::Key::new(hmac::HMAC_SHA256, key.as_bytes());
        let mut ctx = hmac::Context::with_key(&mac);
        parts.iter().for_each(|p| ctx.update(p));
        let signature: String = ctx.sign().as_ref().iter().map(|b| format!("{b:02x}")).collect();
        let mut frames = vec![bytes::Bytes::from_static(b"peer"), DELIMITER.into(), signature.into_bytes().into()];
        frames.extend(parts.iter().map(|p| bytes::Bytes::copy_from_slice(p)));
        zeromq::ZmqMessage::try_from(frames).unwrap()
    }

    #[test]
    fn history_requests_get_ipykernels_defaults() {
        let mut content = serde_json::json!({"hist_access_type": "search", "pattern": "6 * ?"});
        fill_defaults("history_request", &mut content);
        let parsed = JupyterMessageContent::from_type_and_content("history_request", content).unwrap();
        assert!(matches!(
            parsed,
            JupyterMessageContent::HistoryRequest(jupyter_protocol::HistoryRequest::Search { n: 0, unique: false, .. })
        ));
    }

    #[test]
    fn a_signature_is_accepted_once() {
        let verifier = Verifier::new("key");
        let message = signed("key", "kernel_info_request", "{}");
        assert!(matches!(verifier.decode(message.clone()), Ok(Incoming::Request(_))));
        assert!(matches!(verifier.decode(message), Err(DecodeError::Replayed { msg_id }) if msg_id == "m1"));
    }

    #[test]
    fn unsigned_kernels_keep_no_history() {
        let verifier = Verifier::new("");
        let message = signed("", "kernel_info_request", "{}");
        assert!(matches!(verifier.decode(message.clone()), Ok(Incoming::Request(_))));
        assert!(matches!(verifier.decode(message), Ok(Incoming::Request(_))));
    }

    #[test]
    fn content_of_the_wrong_json_type_is_malformed_not_a_panic() {
        let verifier = Verifier::new("key");
        for (msg_type, content) in [("is_complete_request", "[]"), ("execute_request", "7"), ("teleport_request", "null")] {
            match verifier.decode(signed("key", msg_type, content)) {
                Ok(Incoming::Malformed { problem, .. }) => assert!(!problem.is_empty()),
                Ok(Incoming::Request(m)) => assert_eq!(m.header.msg_type, "teleport_request", "{msg_type}"),
                Err(err) => panic!("{msg_type}: {err}"),
            }
        }
    }

    #[test]
    fn the_history_forgets_the_oldest_beyond_its_size() {
        let mut history = DigestHistory::default();
        for i in 0..=DIGEST_HISTORY {
            assert!(history.insert(i.to_string().as_bytes()));
        }
        assert_eq!(history.order.len(), DIGEST_HISTORY);
        assert!(history.insert(b"0"), "the oldest was forgotten");
        assert!(!history.insert(DIGEST_HISTORY.to_string().as_bytes()));
    }
}
