//! A simulated card shared by processes, as one GPU is: every process that
//! simulates a card of the same size is on the same card, and what the others
//! hold there (each its own CUDA context and cuDNN workspace, and its
//! tensors) is not free for this one. The commonest real case is two
//! notebooks open at once; `vramlab hold` stands in for any other program.
//!
//! Each process writes what it holds, and when it started, to a file named by
//! its pid in the card's folder (`$TMPDIR/vramlab-simulated-cards/<usable
//! bytes>/`) and reads the others' at most every [`REREAD_MS`], at a budget
//! check. Files of processes that have ended are skipped and removed: a pid
//! that is gone, a zombie (its parent never reaped it, as in a container
//! whose first process reaps nothing), or a pid reused by a process that
//! started at another time.

use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::memory::probes::counters::Counters;

/// How often a process rereads the others' holdings (the budget's checks run
/// after every layer; the files need not be read that often).
const REREAD_MS: u64 = 100;

/// Another process on the same simulated card and what it holds there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenant {
    pub pid: u32,
    pub bytes: u64,
}

fn card_dir(usable: u64) -> PathBuf {
    std::env::temp_dir().join("vramlab-simulated-cards").join(usable.to_string())
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The other live processes on a card of `usable` bytes.
pub fn tenants(usable: u64) -> Vec<Tenant> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir(card_dir(usable)) else { return Vec::new() };
    let mut found: Vec<Tenant> = entries
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let pid: u32 = path.file_name()?.to_str()?.parse().ok()?;
            if pid == me {
                return None;
            }
            let written = std::fs::read_to_string(&path).ok()?;
            let mut fields = written.split_whitespace().map(str::parse::<u64>);
            let (bytes, started) = (fields.next().and_then(Result::ok), fields.next().and_then(Result::ok));
            match (bytes, started) {
                (Some(bytes), Some(started)) if running_since(pid) == Some(started) => Some(Tenant { pid, bytes }),
                _ => {
                    let _ = std::fs::remove_file(&path);
                    None
                }
            }
        })
        .collect();
    found.sort_by_key(|t| t.pid);
    found
}

/// When a running process started (clock ticks after boot), or `None` when
/// `pid` is not a running process: gone, or a zombie.
fn running_since(pid: u32) -> Option<u64> {
    let (state, started) = state_and_start(pid)?;
    (state != "Z" && state != "X").then_some(started)
}

/// A process's state letter and start time: `/proc/PID/stat`'s 3rd and 22nd fields.
fn state_and_start(pid: u32) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses; the fields after it are fixed.
    let mut after_name = stat.rsplit_once(')')?.1.split_whitespace();
    let state = after_name.next()?.to_owned();
    Some((state, after_name.nth(18)?.parse().ok()?))
}

/// Writes what this process holds on its card (its context, workspace and
/// tensors) and reads what the others hold into the counters, unless that was
/// done less than [`REREAD_MS`] ago and `now` is false.
pub(crate) fn refresh(counters: &Counters, now: bool) {
    let card = counters.card.load(Relaxed);
    if card == 0 {
        return;
    }
    let at = now_ms();
    if !now && at.saturating_sub(counters.others_read_ms.load(Relaxed)) < REREAD_MS {
        return;
    }
    counters.others_read_ms.store(at, Relaxed);
    let held = counters.in_use() + counters.context.load(Relaxed) + counters.workspace.load(Relaxed);
    let dir = card_dir(card);
    if std::fs::create_dir_all(&dir).is_ok() {
        let me = std::process::id();
        let started = running_since(me).unwrap_or(0);
        let _ = std::fs::write(dir.join(me.to_string()), format!("{held} {started}"));
    }
    counters.others.store(tenants(card).iter().map(|t| t.bytes).sum(), Relaxed);
}

/// Takes this process off the card of `usable` bytes, and the card's folder
/// off the disk when no other process is on it.
pub(crate) fn leave(usable: u64) {
    let dir = card_dir(usable);
    let _ = std::fs::remove_file(dir.join(std::process::id().to_string()));
    let _ = std::fs::remove_dir(dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_live_process_on_the_same_card_is_read_and_an_ended_one_is_removed() {
        let usable = 987_654_321_u64 + u64::from(std::process::id());
        let dir = card_dir(usable);
        std::fs::create_dir_all(&dir).unwrap();
        let parent = std::os::unix::process::parent_id();
        let parent_started = running_since(parent).unwrap();
        std::fs::write(dir.join(parent.to_string()), format!("4096 {parent_started}")).unwrap();
        std::fs::write(dir.join("4194303"), "1 1").unwrap();
        std::fs::write(dir.join(std::process::id().to_string()), "7 1").unwrap();
        assert_eq!(tenants(usable), [Tenant { pid: parent, bytes: 4096 }], "this process and the ended one are not others");
        assert!(!dir.join("4194303").exists(), "an ended process's file is removed");
        assert!(tenants(usable + 1).is_empty(), "another size is another card");

        std::fs::write(dir.join(parent.to_string()), format!("4096 {}", parent_started + 1)).unwrap();
        assert!(tenants(usable).is_empty(), "a pid now running another process is not the tenant that wrote it");
        assert!(!dir.join(parent.to_string()).exists());

        let mut child = std::process::Command::new("true").spawn().unwrap();
        let zombie = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while running_since(zombie).is_some() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let (state, started) = state_and_start(zombie).expect("the child stays in /proc until it is reaped");
        assert_eq!(state, "Z");
        std::fs::write(dir.join(zombie.to_string()), format!("4096 {started}")).unwrap();
        assert!(tenants(usable).is_empty(), "a process that has ended but was never reaped holds nothing");
        child.wait().unwrap();

        leave(usable);
        assert!(!dir.exists(), "the last process to leave a card takes its folder away");
    }
}
