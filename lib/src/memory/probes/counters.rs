//! The allocation counters: one `#[repr(C)]` block of atomics that the
//! interposed `malloc` family updates on every call. In the cell process the
//! block lives in a shared mapping, so the kernel reads it without running
//! code there.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

use super::answer;

/// "vramlab" and a layout version: a block of another layout is not read.
/// The `cuda` feature adds answer slots, so its layout has its own number.
#[cfg(not(feature = "cuda"))]
pub(crate) const MAGIC: u64 = 0x7672_616d_6c61_6205;
#[cfg(feature = "cuda")]
pub(crate) const MAGIC: u64 = 0x7672_616d_6c61_6285;
/// The exported symbol through which code in shared libraries (notebook
/// cells) finds the executable's counters.
pub(crate) const SYMBOL: &std::ffi::CStr = c"vramlab_alloc_counters";

/// Bytes of the shared region given to the counters and requests; the
/// published snapshot follows them.
pub(crate) const HEADER_BYTES: usize = 4096;

/// What the allocator shims count, plus the request slots through which
/// another process asks this one for what only it can measure (mallinfo2,
/// malloc_trim).
#[repr(C)]
pub struct Counters {
    pub(crate) magic: AtomicU64,
    pub(crate) pid: AtomicU64,
    /// Bytes of the shared region (0: the counters are not in one).
    pub(crate) region_bytes: AtomicU64,
    pub(crate) in_use: AtomicU64,
    pub(crate) peak: AtomicU64,
    /// The peak since the last mark (`%%mem`), kept apart from `peak` so
    /// that measuring a cell leaves the user's peak alone.
    pub(crate) mark_peak: AtomicU64,
    pub(crate) allocations: AtomicU64,
    /// The simulated card's usable bytes; 0 when none.
    pub(crate) budget: AtomicU64,
    /// The part of the budget its CUDA context holds before any tensor: in
    /// use from the start, as on the card.
    pub(crate) context: AtomicU64,
    /// The first allocation that took `in_use` past the budget (0: none
    /// since the last check) and what was in use before it.
    pub(crate) over_request: AtomicU64,
    pub(crate) over_in_use: AtomicU64,
    /// The overrun last reported (0: none). While set, the program is
    /// handling that error, and allocations it makes meanwhile are not new
    /// overruns; falling back under the budget clears it.
    pub(crate) over_reported: AtomicU64,
    pub(crate) request: AtomicU32,
    pub(crate) answered: AtomicU32,
    pub(crate) request_kind: AtomicU64,
    pub(crate) answer: [AtomicU64; answer::WORDS],
    pub(crate) snapshot_seq: AtomicU64,
    pub(crate) snapshot_len: AtomicU64,
    /// Bytes the data loaders of the process hold (batches queued, decode
    /// buffers), and the most they have held.
    pub(crate) loader_held: AtomicU64,
    pub(crate) loader_peak: AtomicU64,
    /// The peak since the library last opened a window of its own (a
    /// training step, a measured phase), kept apart from `peak` so that
    /// training and measuring leave the user's peak alone. Last, so that a
    /// region written by an older build reads the same up to here.
    pub(crate) window_peak: AtomicU64,
    /// The part of the budget cuDNN's workspace holds, as on the card from
    /// its first convolution; after `window_peak` for the same reason.
    pub(crate) workspace: AtomicU64,
    /// What the other processes simulating the same card hold on it (their
    /// contexts, workspaces and tensors), as last read; after `workspace`.
    pub(crate) others: AtomicU64,
    /// When `others` was last read, in milliseconds since the epoch.
    pub(crate) others_read_ms: AtomicU64,
    /// The simulated card this process is on, by its usable bytes (0: none):
    /// the budget as the user set it, which the investigation's trials narrow.
    pub(crate) card: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Counters>() <= HEADER_BYTES);

impl Counters {
    const fn new() -> Counters {
        Counters {
            magic: AtomicU64::new(MAGIC),
            pid: AtomicU64::new(0),
            region_bytes: AtomicU64::new(0),
            in_use: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            mark_peak: AtomicU64::new(0),
            allocations: AtomicU64::new(0),
            budget: AtomicU64::new(0),
            context: AtomicU64::new(0),
            over_request: AtomicU64::new(0),
            over_in_use: AtomicU64::new(0),
            over_reported: AtomicU64::new(0),
            request: AtomicU32::new(0),
            answered: AtomicU32::new(0),
            request_kind: AtomicU64::new(0),
            answer: [const { AtomicU64::new(0) }; answer::WORDS],
            snapshot_seq: AtomicU64::new(0),
            snapshot_len: AtomicU64::new(0),
            loader_held: AtomicU64::new(0),
            loader_peak: AtomicU64::new(0),
            window_peak: AtomicU64::new(0),
            workspace: AtomicU64::new(0),
            others: AtomicU64::new(0),
            others_read_ms: AtomicU64::new(0),
            card: AtomicU64::new(0),
        }
    }

    /// What the card holds before any tensor of the process: its context and
    /// workspace, and what other processes on the same card hold.
    fn held_by_card(&self) -> u64 {
        self.context.load(Relaxed) + self.workspace.load(Relaxed) + self.others.load(Relaxed)
    }

    #[inline]
    pub(crate) fn allocated(&self, bytes: u64) {
        let now = self.in_use.fetch_add(bytes, Relaxed) + bytes;
        self.allocations.fetch_add(1, Relaxed);
        if now > self.peak.load(Relaxed) {
            self.peak.fetch_max(now, Relaxed);
        }
        if now > self.mark_peak.load(Relaxed) {
            self.mark_peak.fetch_max(now, Relaxed);
        }
        if now > self.window_peak.load(Relaxed) {
            self.window_peak.fetch_max(now, Relaxed);
        }
        let budget = self.budget.load(Relaxed);
        if budget != 0
            && now + self.held_by_card() > budget
            && self.over_reported.load(Relaxed) == 0
            && self.over_request.compare_exchange(0, bytes, Relaxed, Relaxed).is_ok()
        {
            self.over_in_use.store(now - bytes, Relaxed);
        }
    }

    #[inline]
    pub(crate) fn freed(&self, bytes: u64) {
        // Blocks allocated before the counters were attached are freed
        // through them too; never wrap below zero.
        let before = self.in_use.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(bytes))).unwrap_or(0);
        if self.over_reported.load(Relaxed) != 0 && before.saturating_sub(bytes) + self.held_by_card() <= self.budget.load(Relaxed) {
            self.over_reported.store(0, Relaxed);
        }
    }

    pub(crate) fn in_use(&self) -> u64 {
        self.in_use.load(Relaxed)
    }

    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Relaxed)
    }

    pub(crate) fn allocations(&self) -> u64 {
        self.allocations.load(Relaxed)
    }

    pub(crate) fn reset_peak(&self) {
        self.peak.store(self.in_use(), Relaxed);
    }

    /// Starts a measurement window; returns the bytes in use at its start.
    pub(crate) fn mark(&self) -> u64 {
        let now = self.in_use();
        self.mark_peak.store(now, Relaxed);
        now
    }

    pub(crate) fn mark_peak(&self) -> u64 {
        self.mark_peak.load(Relaxed)
    }

    /// Starts the library's own measurement window from what is in use now.
    pub(crate) fn open_window(&self) {
        self.window_peak.store(self.in_use(), Relaxed);
    }

    pub(crate) fn window_peak(&self) -> u64 {
        self.window_peak.load(Relaxed)
    }

    /// The simulated card's usable bytes and the shares of them its context
    /// and cuDNN's workspace hold (`Budget`'s words); usable 0 when none is set.
    pub(crate) fn budget_words(&self) -> [u64; 3] {
        [self.budget.load(Relaxed), self.context.load(Relaxed), self.workspace.load(Relaxed)]
    }

    /// Sets the simulated card's words, forgetting any overrun of the last.
    pub(crate) fn set_budget_words(&self, [usable, context, workspace]: [u64; 3]) {
        self.over_request.store(0, Relaxed);
        self.over_reported.store(0, Relaxed);
        self.context.store(context, Relaxed);
        self.workspace.store(workspace, Relaxed);
        self.budget.store(usable, Relaxed);
    }

    /// The allocation that took the process past its budget and the bytes
    /// in use before it: the first since the last report, or, while the
    /// process is still over the budget, the one reported last.
    pub(crate) fn take_overrun(&self) -> Option<(u64, u64)> {
        let pending = self.over_request.swap(0, Relaxed);
        // Judged again with what the card's other processes hold now: an
        // allocation judged while a process that has since ended still
        // counted did not overrun.
        if pending != 0 && self.over_in_use.load(Relaxed) + pending + self.held_by_card() > self.budget.load(Relaxed) {
            self.over_reported.store(pending, Relaxed);
            return Some((pending, self.over_in_use.load(Relaxed)));
        }
        let reported = self.over_reported.load(Relaxed);
        if reported == 0 {
            return None;
        }
        if self.in_use() + self.held_by_card() > self.budget.load(Relaxed) {
            return Some((reported, self.over_in_use.load(Relaxed)));
        }
        self.over_reported.store(0, Relaxed);
        None
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid.load(Relaxed) as u32
    }

    /// Copies every count of `from` (the counters before attaching).
    pub(crate) fn adopt(&self, from: &Counters) {
        for (to, from) in [
            (&self.in_use, &from.in_use),
            (&self.peak, &from.peak),
            (&self.mark_peak, &from.mark_peak),
            (&self.allocations, &from.allocations),
            (&self.budget, &from.budget),
            (&self.context, &from.context),
            (&self.workspace, &from.workspace),
        ] {
            to.store(from.load(Relaxed), Relaxed);
        }
        self.over_request.store(0, Relaxed);
        self.over_reported.store(0, Relaxed);
        self.snapshot_len.store(0, Relaxed);
        self.request_kind.store(0, Relaxed);
        self.answered.store(self.request.load(Relaxed), Relaxed);
        self.magic.store(MAGIC, Relaxed);
    }
}

/// The counters before a process attaches its shared region (and for good
/// in a process without one): `malloc` runs long before `main`.
static BOOT: Counters = Counters::new();
static ACTIVE: AtomicPtr<Counters> = AtomicPtr::new(std::ptr::null_mut());
/// Set when the allocator shims of this copy of the crate are the ones
/// installed in the executable.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The counters the shims update.
#[inline]
pub(crate) fn active() -> &'static Counters {
    let ptr = ACTIVE.load(Relaxed);
    if ptr.is_null() {
        &BOOT
    } else {
        // SAFETY: only `switch_to` stores here, with a mapping never unmapped.
        unsafe { &*ptr }
    }
}

/// Moves counting into `region` (at least `HEADER_BYTES`, mapped for the
/// life of the process). Call before other threads start: allocations made
/// between the copy and the switch would be missed.
pub(crate) fn switch_to(region: &'static Counters) {
    region.adopt(&BOOT);
    ACTIVE.store(region as *const Counters as *mut Counters, Relaxed);
}

pub(crate) fn mark_installed() {
    INSTALLED.store(true, Relaxed);
}

/// What the exported symbol returns.
pub fn exported() -> *const c_void {
    active() as *const Counters as *const c_void
}

/// The counters of this process, wherever this copy of the crate was linked:
/// in the executable with the shims, or in a cell's shared library that
/// finds them through the executable's exported symbol.
pub(crate) fn find() -> Option<&'static Counters> {
    if INSTALLED.load(Relaxed) {
        return Some(active());
    }
    let lookup = *LOOKUP.get_or_init(|| {
        // SAFETY: dlsym with a NUL-terminated name; the symbol, when present, is
        // the function the install macro exports, of this signature.
        let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, SYMBOL.as_ptr()) };
        (!symbol.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, extern "C" fn() -> *const c_void>(symbol) })
    });
    let counters = lookup?() as *const Counters;
    // SAFETY: the exported function returns the executable's live counters.
    let counters = unsafe { &*counters };
    (counters.magic.load(Relaxed) == MAGIC).then_some(counters)
}

static LOOKUP: OnceLock<Option<extern "C" fn() -> *const c_void>> = OnceLock::new();
