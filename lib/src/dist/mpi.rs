//! [`Collective`] over MPI, for processes launched with `mpirun -np N`.

use candle_core::{DType, Device, Storage, Tensor};
use std::sync::Arc;

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::{Threading, Universe};
use mpi::traits::{Communicator, CommunicatorCollectives};

use super::{Collective, DistError};

/// The MPI world of this process: every process `mpirun` started. Its
/// clones share one MPI, finished when the last is dropped.
#[derive(Clone)]
pub struct Mpi {
    universe: Arc<Universe>,
}

impl Mpi {
    /// Starts MPI. The trainer calls it from one thread at a time, which
    /// need not be the main one (a step runs on one of rayon's threads).
    pub fn start() -> Result<Mpi, DistError> {
        let (universe, _) = mpi::initialize_with_threading(Threading::Serialized).ok_or(DistError::AlreadyStarted)?;
        Ok(Mpi { universe: Arc::new(universe) })
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.universe.world().rank() as usize
    }

    fn ranks(&self) -> usize {
        self.universe.world().size() as usize
    }

    fn all_reduce_sum(&self, bucket: &Tensor) -> Result<Tensor, DistError> {
        let bad = || DistError::Bucket { dtype: bucket.dtype(), shape: bucket.dims().to_vec() };
        if bucket.rank() != 1 || bucket.dtype() != DType::F32 || !bucket.is_contiguous() {
            return Err(bad());
        }
        let (storage, layout) = bucket.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else { return Err(bad()) };
        let start = layout.start_offset();
        let sent = &cpu.as_slice::<f32>()?[start..start + bucket.elem_count()];
        let mut sum = vec![0f32; sent.len()];
        self.universe.world().all_reduce_into(sent, &mut sum[..], SystemOperation::sum());
        let len = sum.len();
        Ok(Tensor::from_vec(sum, len, &Device::Cpu)?)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let world = self.universe.world();
        let too_long = || DistError::Message(bytes.len());
        let len = i32::try_from(bytes.len()).map_err(|_| too_long())?;
        let mut lens = vec![0i32; world.size() as usize];
        world.all_gather_into(&len, &mut lens[..]);
        let mut starts = Vec::with_capacity(lens.len());
        let mut total = 0i32;
        for &n in &lens {
            starts.push(total);
            total = total.checked_add(n).ok_or_else(too_long)?;
        }
        let mut all = vec![0u8; total as usize];
        world.all_gather_varcount_into(bytes, &mut PartitionMut::new(&mut all[..], &lens[..], &starts[..]));
        Ok(starts.iter().zip(&lens).map(|(&start, &n)| all[start as usize..(start + n) as usize].to_vec()).collect())
    }
}
