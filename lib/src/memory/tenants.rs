//! A simulated card shared by processes, as one GPU is: every process that
//! simulates a card of the same size is on the same card, and what the others
//! hold there (each its own CUDA context and cuDNN workspace, and its
//! tensors) is not free for this one. The commonest real case is two
//! notebooks open at once; `vramlab hold` stands in for any other program.
//!
//! Each process writes what it holds to a file named by its pid in the card's
//! folder (`$TMPDIR/vramlab-simulated-cards/<usable bytes>/`) and reads the
//! others' at most every [`REREAD_MS`], at a budget check; files of processes
//! that have ended are skipped and removed.

use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{SystemTime, UNIX_EPOCH};

use super::counters::Counters;

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
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_file(&path);
                return None;
            }
            let bytes = std::fs::read_to_string(&path).ok()?.trim().parse().ok()?;
            Some(Tenant { pid, bytes })
        })
        .collect();
    found.sort_by_key(|t| t.pid);
    found
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
        let _ = std::fs::write(dir.join(std::process::id().to_string()), held.to_string());
    }
    counters.others.store(tenants(card).iter().map(|t| t.bytes).sum(), Relaxed);
}

/// Takes this process off the card of `usable` bytes.
pub(crate) fn leave(usable: u64) {
    let _ = std::fs::remove_file(card_dir(usable).join(std::process::id().to_string()));
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
        std::fs::write(dir.join(parent.to_string()), "4096").unwrap();
        std::fs::write(dir.join("4194303"), "1").unwrap();
        std::fs::write(dir.join(std::process::id().to_string()), "7").unwrap();
        assert_eq!(tenants(usable), [Tenant { pid: parent, bytes: 4096 }], "this process and the ended one are not others");
        assert!(!dir.join("4194303").exists(), "an ended process's file is removed");
        assert!(tenants(usable + 1).is_empty(), "another size is another card");
        leave(usable);
        assert!(!dir.join(std::process::id().to_string()).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
