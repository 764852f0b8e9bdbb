//! The memory thread's answer to a request (`region.rs`) and
//! its words in the region's answer slots: the one place that says which
//! word is which. The kernel and its cell process are the same build, so the
//! words carry no version of their own; a change in their number changes the
//! counters' layout, and with it their `MAGIC`.

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
    /// The CUDA device's part, in the words `cuda::DeviceAnswer` reads.
    #[cfg(feature = "cuda")]
    pub(crate) device: [u64; DEVICE_WORDS],
}

impl Answer {
    pub(crate) fn to_words(self) -> [u64; WORDS] {
        let heap = [self.held, self.rss, self.hwm, self.held_before, self.rss_before];
        #[cfg(not(feature = "cuda"))]
        {
            heap
        }
        #[cfg(feature = "cuda")]
        {
            concat(heap, self.device)
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
            device,
        }
    }
}

/// A status word (which of `cuda::DeviceAnswer`'s kinds), the device's
/// ordinal, then the reading after the request and the one before.
#[cfg(feature = "cuda")]
pub(crate) const DEVICE_WORDS: usize = 2 + 2 * MEMORY_WORDS;
/// Words of one reading of the CUDA pool.
#[cfg(feature = "cuda")]
pub(crate) const MEMORY_WORDS: usize = 7;

/// `a`, then `b`: the words of an answer's parts, as the whole's.
#[cfg(feature = "cuda")]
pub(crate) fn concat<const A: usize, const B: usize, const C: usize>(a: [u64; A], b: [u64; B]) -> [u64; C] {
    const { assert!(A + B == C, "an answer's parts do not fill its words") };
    let mut words = [0; C];
    words[..A].copy_from_slice(&a);
    words[A..].copy_from_slice(&b);
    words
}

/// The first `A` words and the `B` after them: the words of an answer's parts.
#[cfg(feature = "cuda")]
pub(crate) fn split<const A: usize, const B: usize, const C: usize>(words: [u64; C]) -> ([u64; A], [u64; B]) {
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
        let answer = Answer {
            held: 1,
            rss: 2,
            hwm: 3,
            held_before: 4,
            rss_before: 5,
            #[cfg(feature = "cuda")]
            device: [7; DEVICE_WORDS],
        };
        assert_eq!(Answer::from_words(answer.to_words()), answer);
        assert_eq!(Answer::from_words([0; WORDS]), Answer::default());
    }
}
