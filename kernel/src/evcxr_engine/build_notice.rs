//! How a build is followed. In a cell, while cargo builds dependencies for
//! it: one output, updated in place, with the units built out of the total,
//! the crates being compiled and the time so far; a display, not stderr, so
//! front ends do not draw it as an error. On a terminal, for `build-cells`:
//! the same counts on stderr.

use std::cell::RefCell;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use evcxr::BuildProgress;
use vramlab::render::{escape_html, Bundle, DisplayFrame, FrameKind};

use crate::engine::Output;

const REDRAW_EVERY: Duration = Duration::from_millis(250);

pub(super) struct BuildNotice<'a> {
    output: &'a Output,
    id: String,
    started: Instant,
    state: RefCell<State>,
}

#[derive(Default)]
struct State {
    headline: String,
    /// Replaces the headline once cargo compiles something.
    when_compiling: Option<String>,
    shown: bool,
    last_drawn: Option<Instant>,
    progress: Option<BuildProgress>,
}

impl<'a> BuildNotice<'a> {
    /// A notice that appears only once cargo compiles a dependency: a cell
    /// whose dependencies are all built shows nothing.
    pub(super) fn on_first_dependency(output: &'a Output, headline: impl Into<String>) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let id = format!("vramlab-build-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let state = State { headline: headline.into(), ..State::default() };
        BuildNotice { output, id, started: Instant::now(), state: RefCell::new(state) }
    }

    /// A notice shown at once.
    pub(super) fn now(output: &'a Output, headline: impl Into<String>) -> Self {
        let notice = Self::on_first_dependency(output, headline);
        notice.draw(&mut notice.state.borrow_mut());
        notice
    }

    /// The headline to show instead once cargo compiles something: loading
    /// what was built before turned out to need a rebuild.
    pub(super) fn when_compiling(self, headline: impl Into<String>) -> Self {
        self.state.borrow_mut().when_compiling = Some(headline.into());
        self
    }

    pub(super) fn report(&self, progress: BuildProgress) {
        let mut state = self.state.borrow_mut();
        let compiles = !progress.compiling.is_empty();
        if compiles {
            if let Some(headline) = state.when_compiling.take() {
                state.headline = headline;
            }
        }
        state.progress = Some(progress);
        let due = state.last_drawn.is_none_or(|at| at.elapsed() >= REDRAW_EVERY);
        if (state.shown || compiles) && due {
            self.draw(&mut state);
        }
    }

    /// Replaces the notice, if it was shown, by its last line.
    pub(super) fn finish(&self, outcome: &str) {
        let state = self.state.borrow();
        if state.shown {
            let text = format!("{outcome} ({})", elapsed(self.started.elapsed()));
            let html = format!("<div style=\"font-family:monospace\">{}</div>", escape_html(&text));
            self.send(FrameKind::Update, Bundle::plain(text).with("text/html", html));
        }
    }

    fn draw(&self, state: &mut State) {
        let kind = if state.shown { FrameKind::Update } else { FrameKind::Display };
        state.shown = true;
        state.last_drawn = Some(Instant::now());
        self.send(kind, self.bundle(&state.headline, state.progress.as_ref()));
    }

    fn bundle(&self, headline: &str, progress: Option<&BuildProgress>) -> Bundle {
        let took = elapsed(self.started.elapsed());
        let Some(progress) = progress else {
            let html = format!("<div style=\"font-family:monospace\">{} ({took})</div>", escape_html(headline));
            return Bundle::plain(format!("{headline} ({took})")).with("text/html", html);
        };
        let counts = counts(progress, self.started.elapsed());
        let html = format!(
            "<div style=\"font-family:monospace\">{}<br><progress value=\"{}\" max=\"{}\" style=\"width:40%\"></progress> {}</div>",
            escape_html(headline),
            progress.finished,
            progress.total.max(1),
            escape_html(&counts),
        );
        Bundle::plain(format!("{headline}\n{counts}")).with("text/html", html)
    }

    fn send(&self, kind: FrameKind, data: Bundle) {
        self.output.frame(DisplayFrame { kind, display_id: Some(self.id.clone()), data });
    }
}

/// Cargo's progress on stderr: redrawn in place on a terminal, otherwise a
/// line for every tenth of the build or every half minute, for logs.
pub(super) struct TerminalProgress {
    started: Instant,
    redraw: bool,
    last: Mutex<(usize, Instant)>,
}

impl TerminalProgress {
    pub(super) fn new() -> Self {
        let started = Instant::now();
        TerminalProgress { started, redraw: std::io::stderr().is_terminal(), last: Mutex::new((0, started)) }
    }

    pub(super) fn report(&self, progress: &BuildProgress) {
        let line = format!("  {}", counts(progress, self.started.elapsed()));
        if self.redraw {
            eprint!("\r\x1b[2K{line}");
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let step = (progress.total / 10).max(1);
        if progress.finished >= last.0 + step || last.1.elapsed() >= Duration::from_secs(30) {
            *last = (progress.finished, Instant::now());
            eprintln!("{line}");
        }
    }

    pub(super) fn finish(&self) {
        if self.redraw {
            eprintln!();
        }
    }
}

/// `12/180 crates built, 3 min 05 s, compiling a, b`.
fn counts(progress: &BuildProgress, took: Duration) -> String {
    let compiling = match progress.compiling.as_slice() {
        [] => String::new(),
        names => format!(", compiling {}", names.join(", ")),
    };
    format!("{}/{} crates built, {}{compiling}", progress.finished, progress.total, elapsed(took))
}

/// `4.2 s`, `3 min 05 s`.
fn elapsed(took: Duration) -> String {
    let secs = took.as_secs_f64();
    if secs < 60.0 {
        format!("{secs:.1} s")
    } else {
        format!("{} min {:02} s", took.as_secs() / 60, took.as_secs() % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_in_seconds_then_minutes() {
        assert_eq!(elapsed(Duration::from_millis(4_240)), "4.2 s");
        assert_eq!(elapsed(Duration::from_secs(185)), "3 min 05 s");
    }
}
