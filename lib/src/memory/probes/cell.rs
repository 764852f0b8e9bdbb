//! The kernel's view of its cell process: the counters read straight from
//! the shared region (no code runs in the cell process for them), and the
//! few readings only that process can make, asked of its memory thread.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;

use super::answer::Answer;
use super::budget::Budget;
use super::error::MemoryError;
use super::host::{status_rss, EmptyCache, HostMemory};
use super::region::{self, Region, Request};
use super::snapshot::{self, Snapshot};

/// How long the cell process's memory thread gets to answer. It answers in
/// microseconds even while a cell runs; silence means the process is gone.
const ANSWER_WITHIN: Duration = Duration::from_millis(500);

/// A region for a child process to count its allocations in, and the reader.
pub struct CellProbe {
    pub(crate) region: Region,
    fd: OwnedFd,
    asking: Mutex<()>,
    last_cell: Mutex<Option<CellUsage>>,
}

/// What a cell did to memory (`%%mem`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CellUsage {
    /// Bytes in use before and after the cell.
    pub before: u64,
    pub after: u64,
    /// The most in use while it ran.
    pub peak: u64,
}

impl CellUsage {
    /// The peak above the starting point.
    pub fn increment(&self) -> u64 {
        self.peak.saturating_sub(self.before)
    }

    /// What the cell left allocated (negative when it freed more).
    pub fn net(&self) -> i64 {
        self.after as i64 - self.before as i64
    }
}

/// The start of a `%%mem` measurement.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    pid: u32,
    before: u64,
}

impl CellProbe {
    pub fn create() -> Result<CellProbe, MemoryError> {
        let (region, fd) = Region::create()?;
        Ok(CellProbe { region, fd, asking: Mutex::new(()), last_cell: Mutex::new(None) })
    }

    /// Makes the process `command` starts count into this region: it
    /// inherits the descriptor (and only it: the descriptor stays
    /// close-on-exec for every other child) and is told its number.
    pub fn share_with(&self, command: &mut std::process::Command) {
        let fd: RawFd = self.fd.as_raw_fd();
        command.env(super::region::REGION_FD_ENV, fd.to_string());
        // SAFETY: runs in the forked child before exec and only calls fcntl,
        // which is async-signal-safe.
        unsafe {
            command.pre_exec(move || {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }

    /// The process counting into the region, once it has started.
    pub fn pid(&self) -> Option<u32> {
        Some(self.region.counters().pid()).filter(|&pid| pid != 0)
    }

    pub(crate) fn started(&self) -> Result<u32, MemoryError> {
        self.pid().ok_or(MemoryError::NotStarted)
    }

    pub(crate) fn ask(&self, request: Request) -> Result<Answer, MemoryError> {
        let pid = self.started()?;
        let _one_at_a_time = self.asking.lock().unwrap_or_else(|e| e.into_inner());
        region::ask(self.region.counters(), request, ANSWER_WITHIN).ok_or(MemoryError::NoAnswer { pid })
    }

    pub(crate) fn reading(&self, answer: Answer) -> HostMemory {
        let c = self.region.counters();
        HostMemory {
            exact: true,
            in_use: c.in_use(),
            held: answer.held,
            peak: Some(c.peak()),
            rss: answer.rss,
            hwm: answer.hwm,
            allocations: Some(c.allocations()),
            budget: Budget::in_counters(c),
        }
    }

    /// The cell process's heap now.
    pub fn sample(&self) -> Result<HostMemory, MemoryError> {
        let answer = self.ask(Request::Sample)?;
        Ok(self.reading(answer))
    }

    /// Bytes in use, read from the counters alone.
    pub fn in_use(&self) -> Result<u64, MemoryError> {
        self.started()?;
        Ok(self.region.counters().in_use())
    }

    /// RSS and its high-water mark, read from `/proc` alone.
    pub fn rss(&self) -> Result<(u64, u64), MemoryError> {
        Ok(status_rss(self.started()?))
    }

    pub fn reset_peak(&self) -> Result<HostMemory, MemoryError> {
        self.started()?;
        self.region.counters().reset_peak();
        self.sample()
    }

    /// `malloc_trim(0)` in the cell process, with the readings around it.
    pub fn empty_cache(&self) -> Result<EmptyCache, MemoryError> {
        Ok(self.emptied(self.ask(Request::EmptyCache)?))
    }

    pub(crate) fn emptied(&self, answer: Answer) -> EmptyCache {
        let after = self.reading(answer);
        let before = HostMemory { held: answer.held_before, rss: answer.rss_before, ..after };
        EmptyCache { before, after }
    }

    /// Starts measuring a cell.
    pub fn mark(&self) -> Result<Mark, MemoryError> {
        let pid = self.started()?;
        Ok(Mark { pid, before: self.region.counters().mark() })
    }

    /// What happened since `mark`; `None` when the cell process was
    /// replaced in between (its counts started again from zero).
    pub fn since(&self, mark: &Mark) -> Option<CellUsage> {
        let c = self.region.counters();
        (self.pid() == Some(mark.pid)).then(|| CellUsage { before: mark.before, after: c.in_use(), peak: c.mark_peak().max(mark.before) })
    }

    /// Runs `cell` (code executing in the cell process) and keeps what it
    /// did to memory for [`last_cell`](Self::last_cell).
    pub fn measure<T>(&self, cell: impl FnOnce() -> T) -> T {
        let mark = self.mark().ok();
        let result = cell();
        *self.last_cell.lock().unwrap_or_else(|e| e.into_inner()) = mark.and_then(|mark| self.since(&mark));
        result
    }

    /// The peak and net change of the last measured cell; `None` before the
    /// first, or when the cell process was replaced during it.
    pub fn last_cell(&self) -> Option<CellUsage> {
        *self.last_cell.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The latest snapshot the cell process published.
    pub fn snapshot(&self) -> Result<Option<Snapshot>, MemoryError> {
        region::read_snapshot(self.region.counters()).map(|bytes| snapshot::decode(&bytes)).transpose()
    }
}
