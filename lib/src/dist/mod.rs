//! Several processes training one model, each on its own card (or its own
//! share of the host) with its own batch: data parallelism on an existing
//! collective library.
//!
//! The room: [`Collective`], what the trainer needs of the library (one
//! sum over the processes); [`Mpi`] on the host, launched with `mpirun`
//! (feature `mpi`); `Nccl` on cards (feature `nccl`, with `cuda`; never
//! run); [`owners`], which parameter each process updates
//! when the optimizer state is sharded (PyTorch's `ZeroRedundancyOptimizer`
//! partition). The trainer's side is `train/data_parallel.rs`; the proof
//! that a spread step is one process's step on all the samples,
//! `checks::same_step`.

use std::ops::Range;

use candle_core::Tensor;

#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(feature = "mpi")]
pub use mpi::Mpi;
#[cfg(feature = "nccl")]
pub use nccl::Nccl;

#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("a bucket to exchange must be a 1-D f32 tensor on the host, got {dtype:?} of shape {shape:?}")]
    Bucket { dtype: candle_core::DType, shape: Vec<usize> },
    #[error("--cards {cards} takes {cards} processes, and this run has {launched}: launch it with `mpirun -np {cards}`")]
    Ranks { cards: usize, launched: usize },
    #[error("a report of {0} bytes is too long to gather")]
    Message(usize),
    #[error("NCCL, {0}")]
    Nccl(String),
    #[error("MPI is already initialised in this process")]
    AlreadyStarted,
    #[error("{0}: vramlab costs it (oomcheck --cards), but does not run it yet")]
    NotRun(&'static str),
    #[error(
        "{0} has batch-norm, whose statistics are each process's own (DDP's): its weights differ from one process's by design; \
         add --sync-bn to normalise by every process's batch, or check a model without batch-norm (vit-tiny, vit-small)"
    )]
    BatchNorm(String),
}

/// What data parallelism needs of a collective library: the processes'
/// count, this one's place among them, and the sum over all of them.
pub trait Collective: Send {
    /// This process's rank, from 0.
    fn rank(&self) -> usize;

    /// The processes taking part.
    fn ranks(&self) -> usize;

    /// The element-wise sum of every process's `bucket`: a 1-D f32 tensor
    /// of the same length on each. Every process gets the sum.
    fn all_reduce_sum(&self, bucket: &Tensor) -> Result<Tensor, DistError>;

    /// Every process's `bytes` (of any length), in rank order, on every
    /// process: reports, not tensors.
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError>;
}

/// Items of `bytes` each (gradients, in the network's order) in buckets
/// of at most `cap` bytes (a larger item alone), filled from the last item
/// back: the order backward makes gradients in, as DDP fills its buckets.
/// Each bucket is its items' indices.
pub fn buckets(bytes: &[u64], cap: u64) -> Vec<Range<usize>> {
    let mut buckets: Vec<Range<usize>> = Vec::new();
    let mut filled = 0;
    for (i, &item) in bytes.iter().enumerate().rev() {
        match buckets.last_mut() {
            Some(bucket) if filled + item <= cap => {
                bucket.start = i;
                filled += item;
            }
            _ => {
                buckets.push(i..i + 1);
                filled = item;
            }
        }
    }
    buckets
}

/// For each of `sizes` (the parameters' element counts, in the network's
/// order), the rank that keeps its optimizer state and updates it: the
/// largest first, each to the rank with the fewest elements so far, as
/// PyTorch's `ZeroRedundancyOptimizer` partitions them.
pub fn owners(sizes: &[usize], ranks: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
    let mut load = vec![0usize; ranks.max(1)];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let rank = (0..load.len()).min_by_key(|&r| load[r]).unwrap_or(0);
        owner[i] = rank;
        load[rank] += sizes[i];
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_parameters_go_first_to_the_least_loaded_rank() {
        assert_eq!(owners(&[10, 40, 30, 20], 2), [0, 0, 1, 1]);
        let sizes = [4, 4, 4, 4, 4, 4];
        let owner = owners(&sizes, 3);
        for rank in 0..3 {
            assert_eq!(owner.iter().filter(|&&o| o == rank).count(), 2);
        }
        assert_eq!(owners(&[7, 3], 1), [0, 0]);
    }

    #[test]
    fn buckets_fill_from_the_last_item_and_a_larger_item_goes_alone() {
        assert_eq!(buckets(&[4, 4, 8, 3, 30, 5, 5], 10), [5..7, 4..5, 3..4, 2..3, 0..2]);
        assert_eq!(buckets(&[1, 2, 3], 10), vec![Range { start: 0, end: 3 }]);
        assert_eq!(buckets(&[], 10), Vec::<Range<usize>>::new());
    }
}
