//! The host's "allocated vs reserved": bytes in live heap blocks, bytes the
//! allocator holds from the OS, the exact peak, and the process's RSS.

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::answer::Answer;
use super::budget::Budget;
use super::counters::{self, Counters};
use super::region::{self, Region, Request, REGION_BYTES, REGION_FD_ENV};
use crate::units::human;

/// One reading of a process's heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMemory {
    /// True when `in_use` and `peak` come from the allocation counters
    /// (every allocation counted as it happens); false when sampled from
    /// glibc's statistics, which miss short peaks.
    pub exact: bool,
    /// Bytes in live heap blocks: the CPU's `memory_allocated`.
    pub in_use: u64,
    /// Bytes the allocator holds from the OS, in use or free: the CPU's
    /// `memory_reserved`.
    pub held: u64,
    /// The most `in_use` has been since the last reset; `None` when not exact.
    pub peak: Option<u64>,
    /// Resident set size, and its high-water mark, from `/proc/PID/status`.
    pub rss: u64,
    pub hwm: u64,
    /// Heap allocations made so far; `None` when not exact.
    pub allocations: Option<u64>,
    /// The simulated device budget, when one is set.
    pub budget: Option<Budget>,
}

/// What giving held memory back did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmptyCache {
    pub before: HostMemory,
    pub after: HostMemory,
}

impl EmptyCache {
    /// Bytes returned to the OS.
    pub fn released(&self) -> u64 {
        self.before.held.saturating_sub(self.after.held)
    }
}

impl HostMemory {
    /// Reads this process's heap now.
    pub fn sample() -> HostMemory {
        let counters = counters::find();
        let heap = Heap::read();
        let (rss, hwm) = rss_in_status(Path::new("/proc/self/status"));
        match counters {
            Some(c) => HostMemory {
                exact: true,
                in_use: c.in_use(),
                held: heap.held,
                peak: Some(c.peak()),
                rss,
                hwm,
                allocations: Some(c.allocations()),
                budget: Budget::in_counters(c),
            },
            None => {
                HostMemory { exact: false, in_use: heap.in_use, held: heap.held, peak: None, rss, hwm, allocations: None, budget: None }
            }
        }
    }

    /// Starts a new peak from what is in use now; returns the reading after.
    pub fn reset_peak() -> HostMemory {
        if let Some(c) = counters::find() {
            c.reset_peak();
        }
        HostMemory::sample()
    }

    /// Starts the library's window for the peak of a step or a phase, from
    /// what is in use now. The user's peak (since [`HostMemory::reset_peak`])
    /// is left as it is. False when this process does not count its allocations.
    pub(crate) fn open_window() -> bool {
        counters::find().map(|c| c.open_window()).is_some()
    }

    /// The most in use since [`HostMemory::open_window`]; `None` when not exact.
    pub(crate) fn window_peak() -> Option<u64> {
        counters::find().map(|c| c.window_peak())
    }

    /// Gives the heap's free memory back to the OS (`malloc_trim(0)`): the
    /// CPU's `empty_cache`. Returns the readings before and after.
    pub fn empty_cache() -> EmptyCache {
        let before = HostMemory::sample();
        trim();
        EmptyCache { before, after: HostMemory::sample() }
    }

    /// Held but not in use: the allocator's idle cache.
    pub fn idle(&self) -> u64 {
        self.held.saturating_sub(self.in_use)
    }
}

impl fmt::Display for HostMemory {
    /// One `print_mem` line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "in use {} | held {}", human(self.in_use), human(self.held))?;
        if let Some(peak) = self.peak {
            write!(f, " | peak {}", human(peak))?;
        }
        write!(f, " | RSS {} (high-water {})", human(self.rss), human(self.hwm))?;
        if let Some(budget) = self.budget {
            write!(
                f,
                " | simulated budget {} ({} of it CUDA context, {} cuDNN workspace)",
                human(budget.usable),
                human(budget.context),
                human(budget.workspace)
            )?;
        }
        if !self.exact {
            f.write_str(" (sampled, not exact: this process does not count its allocations)")?;
        }
        Ok(())
    }
}

/// glibc's view of its heap (all arenas).
#[derive(Debug, Clone, Copy, Default)]
struct Heap {
    in_use: u64,
    held: u64,
}

impl Heap {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn read() -> Heap {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let info = unsafe { libc::mallinfo2() };
        Heap { in_use: (info.uordblks + info.hblkhd) as u64, held: (info.arena + info.hblkhd) as u64 }
    }

    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    fn read() -> Heap {
        Heap::default()
    }
}

/// Free memory at the top of a heap beyond this is returned to the system.
const RETURN_FREE_ABOVE: i32 = 256 << 20;

/// Makes glibc keep freed tensor buffers for the next step instead of
/// returning them: a training step frees and reallocates the same sizes,
/// and memory handed back comes again as fresh pages the kernel must zero
/// (a sixth of a ResNet step's time on 2 threads). So every block comes
/// from a heap, where freed memory is reused: glibc would map a block of
/// over 32 MiB on its own (its largest threshold) and unmap it when freed,
/// and EfficientNet-B0's 112x112 maps at batch 8 are 38 MiB. Every thread
/// allocates from the one heap (glibc would give rayon's threads heaps of
/// their own, of 64 MiB at most, which shrink and grow again as a step's
/// buffers move between threads: ResNet18 b8@224 on 2 threads faulted in
/// twice the pages). `%mem --empty-cache` (`malloc_trim`) still returns it all.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's tuning parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, RETURN_FREE_ABOVE);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Lets glibc map blocks of over 32 MiB on their own again, as it did
/// before [`install`] stopped it: for a process that keeps serving rather
/// than training (the kernel itself, whose few large blocks are
/// long-lived), where reusing freed large blocks buys nothing.
pub fn map_large_blocks() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's tuning parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, GLIBC_MMAP_MAX);
        libc::mallopt(libc::M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD);
    }
}

/// glibc's default for `M_MMAP_MAX`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const GLIBC_MMAP_MAX: i32 = 65536;

/// glibc's largest mmap threshold on 64-bit (`DEFAULT_MMAP_THRESHOLD_MAX`).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const LARGEST_MMAP_THRESHOLD: i32 = 32 << 20;

fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim is safe to call at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Counts `bytes` (negative: released) as held by a data loader of this
/// process, whichever cell's copy of the crate made it.
pub fn loader_held(bytes: i64) {
    let Some(c) = counters::find() else { return };
    let now = if bytes >= 0 {
        c.loader_held.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed) + bytes as u64
    } else {
        let freed = bytes.unsigned_abs();
        c.loader_held
            .fetch_update(std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed, |v| Some(v.saturating_sub(freed)))
            .unwrap_or(0)
            .saturating_sub(freed)
    };
    c.loader_peak.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
}

/// Bytes the process's data loaders hold now and at most; `None` without the counters.
pub fn loader_bytes() -> Option<(u64, u64)> {
    counters::find()
        .map(|c| (c.loader_held.load(std::sync::atomic::Ordering::Relaxed), c.loader_peak.load(std::sync::atomic::Ordering::Relaxed)))
}

/// The host's RAM (`MemTotal` of `/proc/meminfo`), when readable.
pub fn host_total() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// VmRSS and VmHWM of process `pid`, in bytes (0 when unreadable).
pub(crate) fn status_rss(pid: u32) -> (u64, u64) {
    rss_in_status(Path::new(&format!("/proc/{pid}/status")))
}

/// VmRSS and VmHWM of a `/proc/.../status` file, read into the stack: the
/// cell process's memory thread reads its own, and an allocation of its
/// would show in the counters it reports (`%mem` must not move them).
fn rss_in_status(path: &Path) -> (u64, u64) {
    let mut buffer = [0u8; 8192];
    let Ok(mut file) = File::open(path) else { return (0, 0) };
    let mut len = 0;
    while len < buffer.len() {
        match file.read(&mut buffer[len..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => len += n,
        }
    }
    let status = String::from_utf8_lossy(&buffer[..len]);
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The memory thread's answer about the heap: glibc's statistics, around
/// `malloc_trim` (and `empty_card`, the simulated card's cache) when asked.
fn host_answer(request: Request, empty_card: fn()) -> Answer {
    let before = HostMemory::sample();
    if request == Request::EmptyCache {
        empty_card();
        trim();
        return heap_answer(&before, &HostMemory::sample());
    }
    heap_answer(&before, &before)
}

/// The heap's readings `before` and `after` a request, as the memory thread answers them.
pub(crate) fn heap_answer(before: &HostMemory, after: &HostMemory) -> Answer {
    Answer {
        held: after.held,
        rss: after.rss,
        hwm: after.hwm,
        held_before: before.held,
        rss_before: before.rss,
        #[cfg(feature = "cuda")]
        device: super::cuda::DeviceAnswer::NotInUse.to_words(),
    }
}

/// [`crate::memory::install`]: the counters, and in the kernel's cell
/// process the memory thread, which calls `empty_card` on `EmptyCache`.
pub(crate) fn install(empty_card: fn()) {
    counters::mark_installed();
    keep_freed_memory();
    let inherited = std::env::var(REGION_FD_ENV).ok().and_then(|fd| fd.parse::<i32>().ok());
    // Processes a cell starts must not attach to the same region.
    std::env::remove_var(REGION_FD_ENV);
    let shared = inherited.and_then(|fd| {
        let region = Region::map(fd);
        // SAFETY: closing the inherited descriptor; the mapping stays valid.
        unsafe { libc::close(fd) };
        region.ok()
    });
    let serve = shared.is_some();
    let Some(region) = shared.or_else(|| Region::anonymous().ok()) else { return };
    let counters: &'static Counters = region.leak();
    counters.region_bytes.store(REGION_BYTES as u64, std::sync::atomic::Ordering::Relaxed);
    counters::switch_to(counters);
    counters.pid.store(u64::from(std::process::id()), std::sync::atomic::Ordering::Relaxed);
    if serve {
        let spawned = std::thread::Builder::new().name("vramlab-memory".into()).spawn(move || {
            #[cfg(not(feature = "cuda"))]
            let answer = move |request| host_answer(request, empty_card);
            #[cfg(feature = "cuda")]
            let answer = {
                let mut device = super::cuda::CellDevice::default();
                move |request| Answer { device: device.read(request).to_words(), ..host_answer(request, empty_card) }
            };
            region::serve(counters, answer)
        });
        if let Err(err) = spawned {
            eprintln!("vramlab: %mem cannot read glibc's statistics in this process: {err}");
        }
    }
}

/// The address the exported `vramlab_alloc_counters` symbol returns.
#[doc(hidden)]
pub fn counters_address() -> *const std::ffi::c_void {
    counters::exported()
}
