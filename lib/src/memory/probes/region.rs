//! The shared region: the counters in its first page, then the latest
//! published snapshot, then the values every copy of the crate in the
//! process shares (`shared.rs`). The kernel creates it as a
//! memfd that the cell process inherits and maps; both then read and write
//! the same bytes.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::answer::Answer;
use super::counters::{Counters, HEADER_BYTES, MAGIC};
use super::error::MemoryError;

/// The environment variable that names the region's file descriptor in the
/// cell process.
pub const REGION_FD_ENV: &str = "VRAMLAB_MEM_FD";
/// Region size. Pages are touched only as written: the snapshot area costs
/// memory only for the bytes of the snapshot.
pub(crate) const REGION_BYTES: usize = 4 << 20;
/// The shared values' area, at the end of the region: its sequence and
/// length words, then the bytes.
const SHARED_BYTES: usize = 1 << 20;
pub(crate) const SHARED_CAPACITY: usize = SHARED_BYTES - 16;
pub(crate) const SNAPSHOT_CAPACITY: usize = REGION_BYTES - HEADER_BYTES - SHARED_BYTES;

/// A mapping of the region.
pub struct Region {
    base: *mut u8,
}

// SAFETY: the region is only accessed through atomics and the seqlock below.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// A new region backed by a memfd, and the memfd (close-on-exec; clear
    /// the flag in the one child that should inherit it).
    pub fn create() -> Result<(Region, OwnedFd), MemoryError> {
        let io = |what: &'static str| {
            let err = std::io::Error::last_os_error();
            move || MemoryError::Region { what, reason: err.to_string() }
        };
        // SAFETY: a NUL-terminated name; the returned fd is ours.
        let raw = unsafe { libc::memfd_create(c"vramlab-memory".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io("memfd_create")());
        }
        // SAFETY: `raw` is a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscall on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), REGION_BYTES as libc::off_t) } != 0 {
            return Err(io("ftruncate")());
        }
        let region = Region::map(fd.as_raw_fd())?;
        region.counters().magic.store(MAGIC, Ordering::Relaxed);
        region.counters().region_bytes.store(REGION_BYTES as u64, Ordering::Relaxed);
        Ok((region, fd))
    }

    /// Maps the region behind an inherited descriptor.
    pub fn map(fd: RawFd) -> Result<Region, MemoryError> {
        // SAFETY: a shared mapping of a descriptor we were given; failure is checked.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), REGION_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if base == libc::MAP_FAILED {
            return Err(MemoryError::Region { what: "mmap", reason: std::io::Error::last_os_error().to_string() });
        }
        Ok(Region { base: base as *mut u8 })
    }

    /// A region private to this process (no other process reads it).
    pub(crate) fn anonymous() -> Result<Region, MemoryError> {
        // SAFETY: an anonymous mapping; failure is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                REGION_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(MemoryError::Region { what: "mmap", reason: std::io::Error::last_os_error().to_string() });
        }
        Ok(Region { base: base as *mut u8 })
    }

    pub(crate) fn counters(&self) -> &Counters {
        // SAFETY: the mapping is at least HEADER_BYTES, page aligned, zero
        // filled when new (a valid `Counters`: all atomics) and lives as long as self.
        unsafe { &*(self.base as *const Counters) }
    }

    /// Keeps the mapping for the rest of the process and returns its counters.
    pub(crate) fn leak(self) -> &'static Counters {
        let counters = self.base as *const Counters;
        std::mem::forget(self);
        // SAFETY: never unmapped from here on.
        unsafe { &*counters }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.base as *mut c_void, REGION_BYTES) };
    }
}

fn region_base(counters: &Counters) -> Option<*mut u8> {
    (counters.region_bytes.load(Ordering::Relaxed) as usize == REGION_BYTES).then_some(counters as *const Counters as *mut u8)
}

/// An area written whole and read whole under a seqlock (odd while writing).
struct Area<'a> {
    seq: &'a AtomicU64,
    len: &'a AtomicU64,
    bytes: *mut u8,
    capacity: usize,
}

impl Area<'_> {
    fn snapshot(counters: &Counters) -> Option<Area<'_>> {
        let base = region_base(counters)?;
        Some(Area {
            seq: &counters.snapshot_seq,
            len: &counters.snapshot_len,
            bytes: base.wrapping_add(HEADER_BYTES),
            capacity: SNAPSHOT_CAPACITY,
        })
    }

    fn shared(counters: &Counters) -> Option<Area<'_>> {
        let start = region_base(counters)?.wrapping_add(REGION_BYTES - SHARED_BYTES);
        // SAFETY: two aligned words inside the mapping, which lives as long as the counters.
        let (seq, len) = unsafe { (&*(start as *const AtomicU64), &*(start.wrapping_add(8) as *const AtomicU64)) };
        Some(Area { seq, len, bytes: start.wrapping_add(16), capacity: SHARED_CAPACITY })
    }

    fn write(&self, bytes: &[u8]) -> Result<(), MemoryError> {
        if bytes.len() > self.capacity {
            return Err(MemoryError::SnapshotTooLarge { bytes: bytes.len(), capacity: self.capacity });
        }
        let start = loop {
            let now = self.seq.load(Ordering::Relaxed);
            if now.is_multiple_of(2) && self.seq.compare_exchange(now, now + 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                break now;
            }
            std::hint::spin_loop();
        };
        fence(Ordering::Release);
        // SAFETY: the area holds `capacity` bytes; readers retry if they race us.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.bytes, bytes.len()) };
        self.len.store(bytes.len() as u64, Ordering::Relaxed);
        self.seq.store(start + 2, Ordering::Release);
        Ok(())
    }

    fn read(&self) -> Option<Vec<u8>> {
        for _ in 0..1000 {
            let before = self.seq.load(Ordering::Acquire);
            if !before.is_multiple_of(2) {
                std::hint::spin_loop();
                continue;
            }
            let len = (self.len.load(Ordering::Relaxed) as usize).min(self.capacity);
            let mut out = vec![0u8; len];
            // SAFETY: within the area; a torn copy is detected by the sequence below.
            unsafe { std::ptr::copy_nonoverlapping(self.bytes, out.as_mut_ptr(), len) };
            fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) == before {
                return (len > 0).then_some(out);
            }
        }
        None
    }
}

/// Writes `bytes` as the region's snapshot.
pub(crate) fn write_snapshot(counters: &Counters, bytes: &[u8]) -> Result<(), MemoryError> {
    Area::snapshot(counters).ok_or(MemoryError::NoRegion)?.write(bytes)
}

/// The region's snapshot bytes, or `None` when nothing was published.
pub(crate) fn read_snapshot(counters: &Counters) -> Option<Vec<u8>> {
    Area::snapshot(counters)?.read()
}

/// Writes the shared values' bytes.
pub(crate) fn write_shared(counters: &Counters, bytes: &[u8]) -> Result<(), MemoryError> {
    Area::shared(counters).ok_or(MemoryError::NoRegion)?.write(bytes)
}

/// The shared values' bytes, or `None` when none was written.
pub(crate) fn read_shared(counters: &Counters) -> Option<Vec<u8>> {
    Area::shared(counters)?.read()
}

/// What one process asks of the process that owns the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum Request {
    Sample = 1,
    EmptyCache = 2,
    /// Start the CUDA pool's high-water marks again (the host's peak is
    /// reset from the kernel, in the shared counters).
    #[cfg(feature = "cuda")]
    ResetPeak = 3,
}

/// Asks the owner of `counters` to run `request` and waits up to `within`
/// for its answer. One requester at a time (the caller serialises).
pub(crate) fn ask(counters: &Counters, request: Request, within: Duration) -> Option<Answer> {
    let seq = counters.request.load(Ordering::Relaxed).wrapping_add(1);
    counters.request_kind.store(request as u64, Ordering::Relaxed);
    counters.request.store(seq, Ordering::Release);
    futex_wake(&counters.request);
    let deadline = Instant::now() + within;
    loop {
        let answered = counters.answered.load(Ordering::Acquire);
        if answered == seq {
            let words = counters.answer.each_ref().map(|slot| slot.load(Ordering::Relaxed));
            fence(Ordering::Acquire);
            return (counters.answered.load(Ordering::Relaxed) == seq).then(|| Answer::from_words(words));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        futex_wait(&counters.answered, answered, left);
    }
}

/// The owner's side: answers requests forever with `answer`.
pub(crate) fn serve(counters: &'static Counters, mut answer: impl FnMut(Request) -> Answer) -> ! {
    loop {
        let asked = counters.request.load(Ordering::Acquire);
        if asked == counters.answered.load(Ordering::Relaxed) {
            futex_wait(&counters.request, asked, Duration::from_secs(3600));
            continue;
        }
        let request = match counters.request_kind.load(Ordering::Relaxed) {
            2 => Request::EmptyCache,
            #[cfg(feature = "cuda")]
            3 => Request::ResetPeak,
            _ => Request::Sample,
        };
        for (slot, word) in counters.answer.iter().zip(answer(request).to_words()) {
            slot.store(word, Ordering::Relaxed);
        }
        counters.answered.store(asked, Ordering::Release);
        futex_wake(&counters.answered);
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, within: Duration) {
    let timeout = libc::timespec { tv_sec: within.as_secs() as libc::time_t, tv_nsec: within.subsec_nanos() as libc::c_long };
    // SAFETY: FUTEX_WAIT on a live u32 in a shared mapping (not PRIVATE: the
    // waker may be another process); spurious returns are handled by callers.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &timeout as *const libc::timespec, 0usize, 0u32);
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live u32.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
    }
}
