use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::{escape_html, Bundle, Render};

/// Start of a stdout line that carries a [`DisplayFrame`] to the kernel.
///
/// The record separator makes a collision with ordinary program output
/// practically impossible; the kernel strips such lines from the stream.
pub const FRAME_PREFIX: &str = "\u{1e}vramlab:display ";

/// The variable the kernel sets for its cell process, so that live displays
/// know a notebook is listening and fall back to plain text otherwise.
const KERNEL_ENV: &str = "VRAMLAB_KERNEL";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FrameKind {
    /// A new output (display_data).
    Display,
    /// Replace the output that has this frame's display id (update_display_data).
    Update,
    /// Clear the cell's outputs (clear_output); `wait` defers until the next output.
    Clear { wait: bool },
}

/// One live display event, sent by a cell while it runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DisplayFrame {
    pub kind: FrameKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_id: Option<String>,
    #[serde(default)]
    pub data: Bundle,
}

impl DisplayFrame {
    /// The stdout line that carries this frame, newline included.
    pub fn to_line(&self) -> String {
        // A frame is plain data: serialising it cannot fail.
        let json = serde_json::to_string(self).unwrap_or_default();
        format!("{FRAME_PREFIX}{json}\n")
    }

    /// Parses a stdout line (without its newline); `None` if it is not a frame.
    pub fn parse_line(line: &str) -> Option<Result<DisplayFrame, serde_json::Error>> {
        line.strip_prefix(FRAME_PREFIX).map(serde_json::from_str)
    }

    fn emit(&self) {
        if in_kernel() {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(self.to_line().as_bytes());
            let _ = out.flush();
        } else if !matches!(self.kind, FrameKind::Clear { .. }) {
            println!("{}", self.data.text());
        }
    }
}

fn in_kernel() -> bool {
    std::env::var_os(KERNEL_ENV).is_some()
}

/// Shows a value now, as its own output, while the cell goes on.
pub fn display(value: &impl Render) -> DisplayHandle {
    let handle = DisplayHandle { id: new_display_id() };
    DisplayFrame { kind: FrameKind::Display, display_id: Some(handle.id.clone()), data: value.bundle() }.emit();
    handle
}

/// Clears the cell's outputs; with `wait`, only once the next output arrives
/// (which avoids flicker in animations).
pub fn clear_output(wait: bool) {
    DisplayFrame { kind: FrameKind::Clear { wait }, display_id: None, data: Bundle::default() }.emit();
}

/// An output shown by [`display`] that can be replaced in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DisplayHandle {
    id: String,
}

impl DisplayHandle {
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn update(&self, value: &impl Render) {
        DisplayFrame { kind: FrameKind::Update, display_id: Some(self.id.clone()), data: value.bundle() }.emit();
    }
}

fn new_display_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("vramlab-{}-{nanos:x}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A progress bar that updates in place: live in a notebook, `\r`-redrawn on
/// a terminal. Redraws at most every `min_interval` (100 ms by default) and
/// always on [`Progress::finish`].
#[derive(Debug)]
pub struct Progress {
    label: String,
    total: u64,
    done: u64,
    message: String,
    started: Instant,
    last_drawn: Option<Instant>,
    min_interval: Duration,
    handle: Option<DisplayHandle>,
}

impl Progress {
    pub fn new(label: impl Into<String>, total: u64) -> Self {
        let mut progress = Progress {
            label: label.into(),
            total,
            done: 0,
            message: String::new(),
            started: Instant::now(),
            last_drawn: None,
            min_interval: Duration::from_millis(100),
            handle: None,
        };
        progress.draw();
        progress
    }

    /// Sets the shortest time between two redraws.
    pub fn min_interval(mut self, interval: Duration) -> Self {
        self.min_interval = interval;
        self
    }

    pub fn inc(&mut self, steps: u64) {
        self.set(self.done.saturating_add(steps));
    }

    pub fn set(&mut self, done: u64) {
        self.done = done.min(self.total);
        self.maybe_draw();
    }

    /// Text shown after the counts, e.g. the current loss.
    pub fn set_message(&mut self, message: impl Into<String>) {
        self.message = message.into();
        self.maybe_draw();
    }

    pub fn finish(&mut self) {
        self.done = self.total;
        self.draw();
        if !in_kernel() {
            eprintln!();
        }
    }

    pub fn position(&self) -> u64 {
        self.done
    }

    fn maybe_draw(&mut self) {
        let due = self.last_drawn.is_none_or(|t| t.elapsed() >= self.min_interval);
        if due || self.done == self.total {
            self.draw();
        }
    }

    fn draw(&mut self) {
        self.last_drawn = Some(Instant::now());
        if !in_kernel() {
            eprint!("\r{}", self.line());
            return;
        }
        match &self.handle {
            Some(handle) => handle.update(self),
            None => self.handle = Some(display(self)),
        }
    }

    fn fraction(&self) -> f64 {
        if self.total == 0 {
            1.0
        } else {
            self.done as f64 / self.total as f64
        }
    }

    fn rate(&self) -> f64 {
        let secs = self.started.elapsed().as_secs_f64();
        if secs > 0.0 {
            self.done as f64 / secs
        } else {
            0.0
        }
    }

    fn line(&self) -> String {
        const WIDTH: usize = 30;
        let filled = (self.fraction() * WIDTH as f64).round() as usize;
        let mut line = format!(
            "{} [{}{}] {}/{} ({:.0}%) {:.1} it/s",
            self.label,
            "#".repeat(filled),
            ".".repeat(WIDTH - filled),
            self.done,
            self.total,
            self.fraction() * 100.0,
            self.rate()
        );
        if !self.message.is_empty() {
            line.push_str(" | ");
            line.push_str(&self.message);
        }
        line
    }
}

impl Render for Progress {
    fn bundle(&self) -> Bundle {
        let html = format!(
            "<div><span style=\"font-family:monospace\">{}</span> \
             <progress value=\"{}\" max=\"{}\" style=\"width:40%\"></progress> \
             <span style=\"font-family:monospace\">{}/{} ({:.0}%) {:.1} it/s{}</span></div>",
            escape_html(&self.label),
            self.done,
            self.total.max(1),
            self.done,
            self.total,
            self.fraction() * 100.0,
            self.rate(),
            if self.message.is_empty() { String::new() } else { format!(" | {}", escape_html(&self.message)) },
        );
        Bundle::plain(self.line()).with("text/html", html)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_through_a_stdout_line() {
        let frame = DisplayFrame {
            kind: FrameKind::Update,
            display_id: Some("id-1".into()),
            data: Bundle::plain("a\nb").with("text/html", "<b>x</b>"),
        };
        let line = frame.to_line();
        assert_eq!(line.matches('\n').count(), 1, "a frame must be one line");
        let parsed = DisplayFrame::parse_line(line.trim_end_matches('\n')).unwrap().unwrap();
        assert_eq!(parsed, frame);
    }

    #[test]
    fn ordinary_lines_are_not_frames() {
        assert!(DisplayFrame::parse_line("vramlab:display {}").is_none());
        assert!(DisplayFrame::parse_line(&format!("{FRAME_PREFIX}not json")).unwrap().is_err());
    }

    #[test]
    fn progress_text_shows_counts_and_message() {
        let progress = Progress {
            label: "epoch 1".into(),
            total: 4,
            done: 1,
            message: "loss 0.5".into(),
            started: Instant::now(),
            last_drawn: None,
            min_interval: Duration::ZERO,
            handle: None,
        };
        let text = progress.bundle().text().to_owned();
        assert!(text.starts_with("epoch 1 [########......................] 1/4 (25%)"), "{text}");
        assert!(text.ends_with("| loss 0.5"));
    }

    #[test]
    fn display_ids_are_unique() {
        assert_ne!(new_display_id(), new_display_id());
    }
}
