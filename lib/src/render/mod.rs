//! Rendering to MIME bundles, independent of Jupyter.
//!
//! A cell's value renders as a [`Bundle`] (MIME type to content). Inside a
//! Rust kernel cell, types here implement `evcxr_display`, so a final value
//! becomes a rich result, and [`display`] / [`DisplayHandle`] emit framed lines
//! on stdout that the kernel turns into live `display_data` and
//! `update_display_data` messages while the cell is still running.

mod bundle;
mod chart;
mod compose;
mod live;
mod table;

pub use bundle::{Bundle, Render};
pub use chart::{Chart, ChartError, Series, SeriesKind};
pub use compose::Composer;
pub use live::{clear_output, display, DisplayFrame, DisplayHandle, FrameKind, Progress, FRAME_PREFIX};
pub use table::{Align, Table};

/// Escapes text for inclusion in HTML.
pub fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Each report shows as its bundle when it is a cell's value: evcxr calls an
/// inherent `evcxr_display` first, before the `Debug` fallback every type has.
/// Invoked beside each report's type.
macro_rules! shown_as_bundles {
    ($($report:ty),* $(,)?) => {
        $(impl $report {
            pub fn evcxr_display(&self) {
                $crate::render::Render::bundle(self).print_as_cell_result();
            }
        })*
    };
}

pub(crate) use shown_as_bundles;
