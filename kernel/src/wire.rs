//! Turning raw ZeroMQ frames into typed messages, with every way that can
//! fail named, so the server can log what was wrong and carry on.

use jupyter_protocol::{Header, JupyterMessage, JupyterMessageContent, UnknownMessage};
use jupyter_zmq_client::RawMessage;
use ring::hmac;

/// The largest message the kernel accepts; larger ones are dropped unread.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("message of {0} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("bad or missing signature, or malformed framing: {0}")]
    Frames(#[from] jupyter_zmq_client::RuntimeError),
    #[error("header is not valid JSON for a Jupyter header: {0}")]
    Header(serde_json::Error),
    /// The message is authentic but its content does not fit its type. It
    /// comes back as an `UnknownMessage`, so the sender can get an error reply.
    #[error("{}: content is not valid: {source}", .request.header.msg_type)]
    Content { request: Box<JupyterMessage>, source: serde_json::Error },
    #[error("{part} is not valid JSON: {source}")]
    Json { part: &'static str, source: serde_json::Error },
}

pub fn decode(frames: zeromq::ZmqMessage, key: &Option<hmac::Key>) -> Result<JupyterMessage, DecodeError> {
    let size: usize = frames.iter().map(|f| f.len()).sum();
    if size > MAX_MESSAGE_BYTES {
        return Err(DecodeError::TooLarge(size));
    }
    // Verifies the HMAC over header, parent header, metadata and content.
    let raw = RawMessage::from_multipart(frames, key)?;
    let header: Header = serde_json::from_slice(&raw.jparts[0]).map_err(DecodeError::Header)?;
    let mut content: serde_json::Value =
        serde_json::from_slice(&raw.jparts[3]).map_err(|source| DecodeError::Json { part: "content", source })?;
    fill_defaults(&header.msg_type, &mut content);
    let metadata =
        serde_json::from_slice(&raw.jparts[2]).map_err(|source| DecodeError::Json { part: "metadata", source })?;
    let mut message = JupyterMessage {
        zmq_identities: raw.zmq_identities,
        // An empty parent header (`{}`) is not a Header: that is the spec's "no parent".
        parent_header: serde_json::from_slice(&raw.jparts[1]).ok(),
        content: JupyterMessageContent::UnknownMessage(UnknownMessage {
            msg_type: header.msg_type.clone(),
            content: content.clone(),
        }),
        header,
        metadata,
        buffers: raw.jparts[4..].to_vec(),
        channel: None,
    };
    match JupyterMessageContent::from_type_and_content(&message.header.msg_type, content) {
        Ok(typed) => {
            message.content = typed;
            Ok(message)
        }
        Err(source) => Err(DecodeError::Content { request: Box::new(message), source }),
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

    #[test]
    fn history_requests_get_ipykernels_defaults() {
        let mut content = serde_json::json!({"hist_access_type": "search", "pattern": "6 * ?"});
        fill_defaults("history_request", &mut content);
        let parsed = JupyterMessageContent::from_type_and_content("history_request", content).unwrap();
        assert!(matches!(parsed, JupyterMessageContent::HistoryRequest(jupyter_protocol::HistoryRequest::Search { n: 0, unique: false, .. })));
    }
}
