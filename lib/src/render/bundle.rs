use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A set of representations of one value, keyed by MIME type.
///
/// Text formats hold a JSON string; `application/json` and the other `+json`
/// types hold any JSON value. `text/plain` should always be present so that
/// every front end can show something.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Bundle(pub BTreeMap<String, Value>);

impl Bundle {
    /// A bundle with only a `text/plain` representation.
    pub fn plain(text: impl Into<String>) -> Self {
        Bundle::default().with("text/plain", text.into())
    }

    /// Adds (or replaces) one representation.
    pub fn with(mut self, mime: &str, content: impl Into<Value>) -> Self {
        self.0.insert(mime.to_owned(), content.into());
        self
    }

    pub fn get(&self, mime: &str) -> Option<&Value> {
        self.0.get(mime)
    }

    /// The `text/plain` representation, or an empty string.
    pub fn text(&self) -> &str {
        self.get("text/plain").and_then(Value::as_str).unwrap_or("")
    }

    /// Shows the bundle as a notebook cell's result, every representation.
    pub fn evcxr_display(&self) {
        self.print_as_cell_result();
    }

    /// Writes the bundle in evcxr's rich-output format on stdout: one
    /// `EVCXR_BEGIN_CONTENT` block per MIME type. evcxr collects these blocks
    /// from a cell's final value into the execution result.
    pub fn print_as_cell_result(&self) {
        let mut out = String::new();
        for (mime, content) in &self.0 {
            let body = match content {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            out.push_str("EVCXR_BEGIN_CONTENT ");
            out.push_str(mime);
            out.push('\n');
            out.push_str(&body);
            out.push_str("\nEVCXR_END_CONTENT\n");
        }
        print!("{out}");
    }
}

/// Something that can be shown as a rich value in a notebook.
pub trait Render {
    fn bundle(&self) -> Bundle;
}

impl Render for Bundle {
    fn bundle(&self) -> Bundle {
        self.clone()
    }
}
