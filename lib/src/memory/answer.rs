//! The memory thread's answer to a [`Request`](super::region::Request) and
//! its words in the region's answer slots: the one place that says which
//! word is which. The kernel and its cell process are the same build, so the
//! words carry no version of their own; a change in their number changes the
//! counters' layout, and with it their `MAGIC`.

#[cfg(feature = "cuda")]
use super::cuda::CudaMemory;
use super::host::HostMemory;

const HEAP_WORDS: usize = 5;
/// Words of an answer: the heap's, then (feature `cuda`) the CUDA device's.
#[cfg(not(feature = "cuda"))]
pub(crate) const WORDS: usize = HEAP_WORDS;
#[cfg(feature = "cuda")]
pub(crate) const WORDS: usize = HEAP_WORDS + DEVICE_WORDS;

/// What the cell process measured for a request: its heap after the request
/// and before it (they differ for `EmptyCache`), and with the `cuda` feature
/// the CUDA device its cells use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Answer {
    /// Bytes the allocator holds, RSS and its high-water mark, after the request.
    pub(crate) held: u64,
    pub(crate) rss: u64,
    pub(crate) hwm: u64,
    /// Bytes the allocator held, and RSS, before it.
    pub(crate) held_before: u64,
    pub(crate) rss_before: u64,
    #[cfg(feature = "cuda")]
    pub(crate) cuda: DeviceAnswer,
}

impl Answer {
    /// The heap's readings `before` and `after` the request.
    pub(crate) fn of_heap(before: &HostMemory, after: &HostMemory) -> Answer {
        Answer {
            held: after.held,
            rss: after.rss,
            hwm: after.hwm,
            held_before: before.held,
            rss_before: before.rss,
            #[cfg(feature = "cuda")]
            cuda: DeviceAnswer::NotInUse,
        }
    }

    pub(crate) fn to_words(self) -> [u64; WORDS] {
        let heap = [self.held, self.rss, self.hwm, self.held_before, self.rss_before];
        #[cfg(not(feature = "cuda"))]
        {
            heap
        }
        #[cfg(feature = "cuda")]
        {
            concat(heap, self.cuda.to_words())
        }
    }

    pub(crate) fn from_words(words: [u64; WORDS]) -> Answer {
        #[cfg(not(feature = "cuda"))]
        let heap = words;
        #[cfg(feature = "cuda")]
        let (heap, device): ([u64; HEAP_WORDS], [u64; DEVICE_WORDS]) = split(words);
        let [held, rss, hwm, held_before, rss_before] = heap;
        Answer {
            held,
            rss,
            hwm,
            held_before,
            rss_before,
            #[cfg(feature = "cuda")]
            cuda: DeviceAnswer::from_words(device),
        }
    }
}

/// The CUDA device's part of an answer.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum DeviceAnswer {
    /// The cell process has not used CUDA yet.
    #[default]
    NotInUse,
    /// Reading the device failed in the cell process (an answer carries no
    /// text: `CudaProbe::in_use()` in a cell shows the driver's error).
    Failed,
    /// The pool of device `ordinal` after the request and before it.
    Read { ordinal: usize, after: CudaMemory, before: CudaMemory },
}

/// A status word (which of [`DeviceAnswer`]'s kinds), the device's ordinal,
/// then the reading after the request and the one before.
#[cfg(feature = "cuda")]
const DEVICE_WORDS: usize = 2 + 2 * MEMORY_WORDS;
#[cfg(feature = "cuda")]
const MEMORY_WORDS: usize = 7;

#[cfg(feature = "cuda")]
const NOT_IN_USE: u64 = 0;
#[cfg(feature = "cuda")]
const READ: u64 = 1;
#[cfg(feature = "cuda")]
const FAILED: u64 = 2;

#[cfg(feature = "cuda")]
impl DeviceAnswer {
    fn to_words(self) -> [u64; DEVICE_WORDS] {
        let none = [0; 2 * MEMORY_WORDS];
        match self {
            DeviceAnswer::NotInUse => concat([NOT_IN_USE, 0], none),
            DeviceAnswer::Failed => concat([FAILED, 0], none),
            DeviceAnswer::Read { ordinal, after, before } => {
                let readings: [u64; 2 * MEMORY_WORDS] = concat(memory_words(&after), memory_words(&before));
                concat([READ, ordinal as u64], readings)
            }
        }
    }

    fn from_words(words: [u64; DEVICE_WORDS]) -> DeviceAnswer {
        let ([status, ordinal], readings): ([u64; 2], [u64; 2 * MEMORY_WORDS]) = split(words);
        match status {
            READ => {
                let (after, before): ([u64; MEMORY_WORDS], [u64; MEMORY_WORDS]) = split(readings);
                DeviceAnswer::Read { ordinal: ordinal as usize, after: memory_of(after), before: memory_of(before) }
            }
            FAILED => DeviceAnswer::Failed,
            _ => DeviceAnswer::NotInUse,
        }
    }
}

#[cfg(feature = "cuda")]
fn memory_words(m: &CudaMemory) -> [u64; MEMORY_WORDS] {
    [m.used, m.used_high, m.reserved, m.reserved_high, m.free, m.total, m.context]
}

#[cfg(feature = "cuda")]
fn memory_of([used, used_high, reserved, reserved_high, free, total, context]: [u64; MEMORY_WORDS]) -> CudaMemory {
    CudaMemory { used, used_high, reserved, reserved_high, free, total, context }
}

/// `a`, then `b`: the words of an answer's parts, as the whole's.
#[cfg(feature = "cuda")]
fn concat<const A: usize, const B: usize, const C: usize>(a: [u64; A], b: [u64; B]) -> [u64; C] {
    const { assert!(A + B == C, "an answer's parts do not fill its words") };
    let mut words = [0; C];
    words[..A].copy_from_slice(&a);
    words[A..].copy_from_slice(&b);
    words
}

/// The first `A` words and the `B` after them: the words of an answer's parts.
#[cfg(feature = "cuda")]
fn split<const A: usize, const B: usize, const C: usize>(words: [u64; C]) -> ([u64; A], [u64; B]) {
    const { assert!(A + B == C, "an answer's parts do not fill its words") };
    let (mut a, mut b) = ([0; A], [0; B]);
    a.copy_from_slice(&words[..A]);
    b.copy_from_slice(&words[A..]);
    (a, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_survives_its_words_and_no_words_are_no_reading() {
        let heap = |held, rss, hwm| HostMemory { exact: true, in_use: 0, held, peak: None, rss, hwm, allocations: None, budget: None };
        let answer = Answer::of_heap(&heap(4, 5, 6), &heap(1, 2, 3));
        assert_eq!((answer.held, answer.rss, answer.hwm, answer.held_before, answer.rss_before), (1, 2, 3, 4, 5));
        assert_eq!(Answer::from_words(answer.to_words()), answer);
        assert_eq!(Answer::from_words([0; WORDS]), Answer::default());
    }
}
