//! The other vramlab processes on this machine and what each holds: the
//! `nvidia-smi` step of the investigation for a simulated card, where the
//! commonest real case is two notebooks open at once.
//!
//! A kernel keeps its cell process's counters in a memfd; through
//! `/proc/PID/fd` another process of the same user maps it and reads the
//! cell process's exact bytes in use and its budget without running code there.

use std::fs;
use std::path::Path;

use serde::Serialize;

use super::budget::Budget;
use super::host::status_rss;
use super::region::Region;
use crate::render::{Bundle, Render, Table};
use crate::units::human;

/// What a vramlab process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A Jupyter kernel (it holds rust-analyzer and the compiler's cache, no tensors).
    Kernel,
    /// A kernel's cell process: where the notebook's tensors live.
    CellProcess,
    /// The `vramlab` command.
    Command,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Kernel => "kernel",
            Role::CellProcess => "cell process",
            Role::Command => "vramlab command",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VramlabProcess {
    pub pid: u32,
    pub role: Role,
    /// The kernel that started a cell process.
    pub parent: u32,
    pub rss: u64,
    /// Heap bytes in use, counted exactly, where this process can read them:
    /// a cell process through its kernel's counters, this process itself.
    pub in_use: Option<u64>,
    /// Its simulated card, when it has set one.
    pub budget: Option<Budget>,
    /// This process, the cell process of this kernel, or the kernel of this cell process.
    pub is_self: bool,
}

/// Every vramlab process alive on this machine that this user can see.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Processes {
    pub processes: Vec<VramlabProcess>,
}

/// Reads `/proc` for the vramlab kernels, cell processes and commands alive now.
pub fn processes() -> Processes {
    let me = std::process::id();
    let Ok(entries) = fs::read_dir("/proc") else { return Processes { processes: Vec::new() } };
    let mut found: Vec<VramlabProcess> =
        entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()).filter_map(|pid| describe(pid, me)).collect();
    // A kernel's counters give its cell process's heap, exactly.
    let kernels: Vec<(u32, Option<CellCounters>)> =
        found.iter().filter(|p| p.role == Role::Kernel).map(|p| (p.pid, cell_counters(p.pid))).collect();
    for (kernel, counters) in kernels {
        let Some((cell, in_use, budget)) = counters else { continue };
        if let Some(process) = found.iter_mut().find(|p| p.pid == cell) {
            process.in_use = Some(in_use);
            process.budget = budget;
            process.is_self |= kernel == me;
        }
    }
    let mut my_kernel = None;
    // A kernel holds no tensors: its own heap (rust-analyzer's) is left out; its RSS is shown.
    if let Some(process) = found.iter_mut().find(|p| p.pid == me && p.role != Role::Kernel) {
        let memory = super::host::HostMemory::sample();
        process.in_use = memory.exact.then_some(memory.in_use);
        process.budget = memory.budget;
        my_kernel = (process.role == Role::CellProcess).then_some(process.parent);
    }
    if let Some(kernel) = found.iter_mut().find(|p| Some(p.pid) == my_kernel) {
        kernel.is_self = true;
    }
    // Each cell process right after its kernel.
    found.sort_by_key(|p| if p.role == Role::CellProcess && p.parent != 0 { (p.parent, 1) } else { (p.pid, 0) });
    Processes { processes: found }
}

fn describe(pid: u32, me: u32) -> Option<VramlabProcess> {
    let exe = fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let name = exe.file_name()?.to_str()?.trim_end_matches(" (deleted)");
    let role = match name {
        "vramlab-kernel" if is_cell_process(pid) => Role::CellProcess,
        "vramlab-kernel" => Role::Kernel,
        "vramlab" => Role::Command,
        _ => return None,
    };
    let parent = fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0);
    Some(VramlabProcess { pid, role, parent, rss: status_rss(pid).0, in_use: None, budget: None, is_self: pid == me })
}

/// evcxr starts the cell process as the kernel binary again, marked in its environment.
fn is_cell_process(pid: u32) -> bool {
    fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| env.split(|&b| b == 0).any(|var| var == b"EVCXR_IS_RUNTIME=1"))
}

/// A cell process's pid, heap in use and budget.
type CellCounters = (u32, u64, Option<Budget>);

/// The cell process's pid, heap in use and budget, from the counters `kernel` shares with it.
fn cell_counters(kernel: u32) -> Option<CellCounters> {
    let fds = fs::read_dir(format!("/proc/{kernel}/fd")).ok()?;
    fds.filter_map(|fd| fd.ok()).find_map(|fd| {
        let target = fs::read_link(fd.path()).ok()?;
        target.to_str()?.starts_with("/memfd:vramlab-memory").then(|| read_counters(&fd.path()))?
    })
}

fn read_counters(path: &Path) -> Option<CellCounters> {
    use std::os::fd::AsRawFd;
    let file = fs::OpenOptions::new().read(true).write(true).open(path).ok()?;
    let region = Region::map(file.as_raw_fd()).ok()?;
    let counters = region.counters();
    (counters.magic.load(std::sync::atomic::Ordering::Relaxed) == super::counters::MAGIC)
        .then(|| (counters.pid(), counters.in_use(), Budget::in_counters(counters)))
}

impl Processes {
    /// The others: every process but this one and, in a kernel, its own cell process.
    pub fn others(&self) -> impl Iterator<Item = &VramlabProcess> {
        self.processes.iter().filter(|p| !p.is_self)
    }

    /// One sentence for the investigation's second step.
    pub fn finding(&self) -> String {
        let others: Vec<&VramlabProcess> = self.others().collect();
        if others.is_empty() {
            return "no other vramlab process is running on this machine: nothing else competes for the card".to_owned();
        }
        let with_tensors: Vec<String> = others
            .iter()
            .filter(|p| p.role != Role::Kernel)
            .map(|p| format!("{} {} ({} in use)", p.role, p.pid, human(p.in_use.unwrap_or(p.rss))))
            .collect();
        let kernels = others.iter().filter(|p| p.role == Role::Kernel).count();
        format!(
            "{} other vramlab process{} on this machine ({kernels} kernel{}{}){}; on one GPU each would hold its own CUDA context and cache: close the notebooks you are not using",
            others.len(),
            if others.len() == 1 { "" } else { "es" },
            if kernels == 1 { "" } else { "s" },
            if with_tensors.is_empty() { String::new() } else { format!(", holding tensors: {}", with_tensors.join(", ")) },
            match others.iter().filter_map(|p| p.in_use).sum::<u64>() {
                0 => String::new(),
                total => format!("; {} in use between them", human(total)),
            }
        )
    }

    pub fn table(&self) -> Table {
        let mut table = Table::new(["pid", "what", "started by", "heap in use", "RSS", "simulated card"])
            .title("vramlab processes on this machine")
            .right_align(&[0, 3, 4]);
        for p in &self.processes {
            table.push_row([
                format!("{}{}", p.pid, if p.is_self { " (this notebook)" } else { "" }),
                p.role.to_string(),
                if p.role == Role::CellProcess { format!("kernel {}", p.parent) } else { String::new() },
                p.in_use.map_or("-".to_owned(), human),
                human(p.rss),
                p.budget.map_or("-".to_owned(), |b| {
                    format!("{} ({} context, {} cuDNN workspace)", human(b.usable), human(b.context), human(b.workspace))
                }),
            ]);
        }
        table.note(
            "The nvidia-smi of a simulated card: heap in use is exact where the counters can be read (a cell process through its kernel); \
             a kernel holds rust-analyzer and the compiler, not tensors.",
        )
    }
}

crate::render::shown_as_bundles!(Processes);

impl Render for Processes {
    fn bundle(&self) -> Bundle {
        self.table().bundle()
    }
}
