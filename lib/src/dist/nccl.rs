//! [`Collective`] over NCCL, one process a card: the gradients' buckets
//! summed on the cards themselves. Written against cudarc's NCCL bindings
//! and built with the `nccl` feature; it has never run, for want of a
//! machine with two cards.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::{Comm, Id, ReduceOp};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Storage, Tensor};

use super::{Collective, DistError};

/// This process's place in an NCCL communicator, on its card.
pub struct Nccl {
    comm: Comm,
    device: CudaDevice,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no
// two calls on it run at once; the trainer makes its calls from one thread
// at a time.
unsafe impl Send for Nccl {}

impl Nccl {
    /// A new communicator's id: made by one process (rank 0) and handed to
    /// the others, as bytes ([`Nccl::id_bytes`]) through another channel
    /// (MPI under `mpirun`).
    pub fn new_id() -> Result<Id, DistError> {
        Id::new().map_err(nccl("making a communicator's id"))
    }

    /// An id's bytes, to hand to the other processes.
    pub fn id_bytes(id: &Id) -> Vec<u8> {
        id.internal().iter().map(|&c| c as u8).collect()
    }

    /// The id whose bytes [`Nccl::id_bytes`] gave.
    pub fn id_from_bytes(bytes: &[u8]) -> Result<Id, DistError> {
        let mut internal = [0 as std::ffi::c_char; 128];
        if bytes.len() != internal.len() {
            return Err(DistError::Message(bytes.len()));
        }
        for (to, &from) in internal.iter_mut().zip(bytes) {
            *to = from as std::ffi::c_char;
        }
        Ok(Id::uninit(internal))
    }

    /// Joins the communicator of `id` as process `rank` of `ranks`, on
    /// `device`'s stream; every process of the communicator must join.
    pub fn join(device: &CudaDevice, rank: usize, ranks: usize, id: Id) -> Result<Nccl, DistError> {
        let comm = Comm::from_rank(device.cuda_stream(), rank, ranks, id).map_err(nccl("joining the communicator"))?;
        Ok(Nccl { comm, device: device.clone() })
    }
}

fn nccl(doing: &'static str) -> impl Fn(candle_core::cuda_backend::cudarc::nccl::result::NcclError) -> DistError {
    move |error| DistError::Nccl(format!("{doing}: {error:?}"))
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn ranks(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_sum(&self, bucket: &Tensor) -> Result<Tensor, DistError> {
        let bad = || DistError::Bucket { dtype: bucket.dtype(), shape: bucket.dims().to_vec() };
        if bucket.rank() != 1 || bucket.dtype() != DType::F32 || !bucket.is_contiguous() {
            return Err(bad());
        }
        let len = bucket.elem_count();
        let (storage, layout) = bucket.storage_and_layout();
        let Storage::Cuda(cuda) = &*storage else { return Err(bad()) };
        let start = layout.start_offset();
        let sent = cuda.as_cuda_slice::<f32>()?.slice(start..start + len);
        let mut sum = self.device.alloc_zeros::<f32>(len)?;
        self.comm.all_reduce(&sent, &mut sum, &ReduceOp::Sum).map_err(nccl("summing a bucket"))?;
        let storage = CudaStorage::wrap_cuda_slice(sum, self.device.clone());
        debug_assert_eq!(storage.dtype(), DType::F32);
        Ok(Tensor::from_storage(Storage::Cuda(storage), len, BackpropOp::none(), false))
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let ranks = self.ranks();
        let len = u64::try_from(bytes.len()).map_err(|_| DistError::Message(bytes.len()))?;
        let mine = self.device.clone_htod(&[len])?;
        let mut lens = self.device.alloc_zeros::<u64>(ranks)?;
        self.comm.all_gather(&mine, &mut lens).map_err(nccl("gathering the reports' lengths"))?;
        let lens = self.device.clone_dtoh(&lens)?;
        let longest = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut padded = bytes.to_vec();
        padded.resize(longest.max(1), 0);
        let mine = self.device.clone_htod(&padded)?;
        let mut all = self.device.alloc_zeros::<u8>(padded.len() * ranks)?;
        self.comm.all_gather(&mine, &mut all).map_err(nccl("gathering the reports"))?;
        let all = self.device.clone_dtoh(&all)?;
        Ok(all.chunks(padded.len()).zip(lens).map(|(report, len)| report[..len as usize].to_vec()).collect())
    }
}
