//! Turning raw ZeroMQ frames into typed messages, with every way that can
//! fail named, so the server can log what was wrong and carry on.

use jupyter_protocol::{Header, JupyterMessage, JupyterMessageContent};
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
    #[error("{msg_type}: content is not valid: {source}")]
    Content { msg_type: String, source: serde_json::Error },
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
    let content: serde_json::Value =
        serde_json::from_slice(&raw.jparts[3]).map_err(|source| DecodeError::Json { part: "content", source })?;
    let content = JupyterMessageContent::from_type_and_content(&header.msg_type, content)
        .map_err(|source| DecodeError::Content { msg_type: header.msg_type.clone(), source })?;
    let metadata =
        serde_json::from_slice(&raw.jparts[2]).map_err(|source| DecodeError::Json { part: "metadata", source })?;
    Ok(JupyterMessage {
        zmq_identities: raw.zmq_identities,
        // An empty parent header (`{}`) is not a Header: that is the spec's "no parent".
        parent_header: serde_json::from_slice(&raw.jparts[1]).ok(),
        header,
        metadata,
        content,
        buffers: raw.jparts[4..].to_vec(),
        channel: None,
    })
}
