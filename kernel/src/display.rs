//! MIME bundles and live display frames as iopub messages.

use jupyter_protocol::{
    ClearOutput, DisplayData, ErrorOutput, ExecuteResult, ExecutionCount, JupyterMessage, Media, Stdio, StreamContent, Transient,
    UpdateDisplayData,
};
use vramlab::render::{Bundle, DisplayFrame, FrameKind};

use crate::outcome::CellError;

pub fn media(bundle: &Bundle) -> Media {
    // Media's own deserializer knows every MIME type's shape; text types are
    // strings and `+json` types are values in both.
    serde_json::from_value(serde_json::json!(bundle.0)).unwrap_or_else(|err| {
        log::warn!("bundle could not be converted to Jupyter media: {err}");
        Media::new(vec![jupyter_protocol::MediaType::Plain(bundle.text().to_owned())])
    })
}

pub fn stream(name: Stdio, text: String, parent: &JupyterMessage) -> JupyterMessage {
    StreamContent { name, text }.as_child_of(parent)
}

pub fn display_data(bundle: &Bundle, display_id: Option<String>, parent: &JupyterMessage) -> JupyterMessage {
    DisplayData { data: media(bundle), metadata: Default::default(), transient: display_id.map(|id| Transient { display_id: Some(id) }) }
        .as_child_of(parent)
}

pub fn execute_result(bundle: &Bundle, count: usize, parent: &JupyterMessage) -> JupyterMessage {
    ExecuteResult {
        execution_count: ExecutionCount::new(count),
        data: media(bundle),
        metadata: Default::default(),
        // The schema wants an object here; `None` would be sent as null.
        transient: Some(Transient { display_id: None }),
    }
    .as_child_of(parent)
}

pub fn error(err: &CellError, parent: &JupyterMessage) -> JupyterMessage {
    ErrorOutput { ename: err.ename.clone(), evalue: err.evalue.clone(), traceback: err.traceback.clone() }.as_child_of(parent)
}

/// A live frame from a cell becomes display_data, update_display_data or clear_output.
pub fn frame(frame: DisplayFrame, parent: &JupyterMessage) -> JupyterMessage {
    match (frame.kind, frame.display_id) {
        (FrameKind::Display, id) => display_data(&frame.data, id, parent),
        (FrameKind::Update, Some(id)) => {
            UpdateDisplayData { data: media(&frame.data), metadata: Default::default(), transient: Transient { display_id: Some(id) } }
                .as_child_of(parent)
        }
        // An update that names no output can only be shown as a new one.
        (FrameKind::Update, None) => display_data(&frame.data, None, parent),
        (FrameKind::Clear { wait }, _) => ClearOutput { wait }.as_child_of(parent),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jupyter_protocol::{JupyterMessageContent, KernelInfoRequest, MediaType};

    fn parent() -> JupyterMessage {
        JupyterMessage::new(KernelInfoRequest {}, None)
    }

    #[test]
    fn bundles_keep_every_representation() {
        let bundle = Bundle::plain("t").with("text/html", "<b>t</b>").with("application/json", serde_json::json!({"a": 1}));
        let media = media(&bundle);
        assert!(media.content.iter().any(|m| matches!(m, MediaType::Plain(t) if t == "t")));
        assert!(media.content.iter().any(|m| matches!(m, MediaType::Html(h) if h == "<b>t</b>")));
        assert!(media.content.iter().any(|m| matches!(m, MediaType::Json(j) if j["a"] == 1)));
    }

    #[test]
    fn frames_map_to_the_three_live_messages() {
        let update = DisplayFrame { kind: FrameKind::Update, display_id: Some("p".into()), data: Bundle::plain("50%") };
        match frame(update, &parent()).content {
            JupyterMessageContent::UpdateDisplayData(u) => assert_eq!(u.transient.display_id.as_deref(), Some("p")),
            other => panic!("expected update_display_data, got {}", other.message_type()),
        }
        let shown = DisplayFrame { kind: FrameKind::Display, display_id: Some("p".into()), data: Bundle::plain("0%") };
        assert_eq!(frame(shown, &parent()).message_type(), "display_data");
        let clear = DisplayFrame { kind: FrameKind::Clear { wait: true }, display_id: None, data: Bundle::default() };
        match frame(clear, &parent()).content {
            JupyterMessageContent::ClearOutput(c) => assert!(c.wait),
            other => panic!("expected clear_output, got {}", other.message_type()),
        }
    }
}
