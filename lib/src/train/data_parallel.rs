//! A trainer's step spread over several processes: the gradients averaged
//! over them a bucket at a time once backward is done, and under ZeRO-1
//! and ZeRO-2 each process updating its own parameters and handing them to
//! the others; with `--sync-bn`, batch-norm's statistics summed over them.

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};

use crate::dist::{owners, Collective, DistError};
use crate::ledger::{Cards, Shard};
use crate::models::Network;
use crate::ops::ProcessSum;

/// The collective, shared by the trainer and the batch-norms it synchronises.
struct Shared(Mutex<Box<dyn Collective>>);

impl Shared {
    fn all_reduce_sum(&self, bucket: &Tensor) -> std::result::Result<Tensor, DistError> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).all_reduce_sum(bucket)
    }
}

impl ProcessSum for Shared {
    fn sum(&self, values: Vec<f32>) -> Result<Vec<f32>> {
        let len = values.len();
        self.all_reduce_sum(&Tensor::from_vec(values, len, &Device::Cpu)?).map_err(candle_core::Error::wrap)?.to_vec1()
    }
}

/// The processes a trainer's step is spread over, and which parameters
/// each updates.
pub(crate) struct DataParallel {
    collective: Arc<Shared>,
    rank: usize,
    cards: Cards,
    /// For each parameter of the network, in [`Network::params`]'s order,
    /// the rank that keeps its optimizer state and updates it.
    owners: Vec<usize>,
}

impl DataParallel {
    pub fn new(net: &Network, cards: Cards, collective: Box<dyn Collective>) -> std::result::Result<DataParallel, DistError> {
        if collective.ranks() != cards.count {
            return Err(DistError::Ranks { cards: cards.count, launched: collective.ranks() });
        }
        if cards.shard == Shard::Parameters {
            return Err(DistError::NotRun("--shard parameters (ZeRO-3)"));
        }
        if cards.sync_batch_norm && !net.device().is_cpu() {
            return Err(DistError::NotRun("--sync-bn on a card"));
        }
        let sizes: Vec<usize> = net.params().iter().map(|p| p.var.elem_count()).collect();
        let rank = collective.rank();
        Ok(DataParallel { owners: owners(&sizes, cards.count), collective: Arc::new(Shared(Mutex::new(collective))), rank, cards })
    }

    /// With `--sync-bn`, the sum batch-norm's statistics are to be taken through.
    pub fn batch_norm_sum(&self) -> Option<Arc<dyn ProcessSum>> {
        self.cards.sync_batch_norm.then(|| Arc::clone(&self.collective) as Arc<dyn ProcessSum>)
    }

    pub fn cards(&self) -> Cards {
        self.cards
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether this process updates parameter `i`: every one under DDP,
    /// its own under ZeRO-1 and ZeRO-2.
    fn updates(&self, i: usize) -> bool {
        self.cards.shard == Shard::None || self.owners[i] == self.rank
    }

    /// The parameters this process's optimizer updates.
    pub fn updated_vars(&self, net: &Network) -> Vec<Var> {
        net.params().iter().enumerate().filter(|&(i, _)| self.updates(i)).map(|(_, p)| p.var.clone()).collect()
    }

    /// The parameters' indices in buckets of at most the bucket size (a
    /// larger parameter alone), the last parameters first: the order
    /// backward makes their gradients in, as DDP buckets them.
    fn buckets(&self, net: &Network) -> Vec<Vec<usize>> {
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut filled = 0u64;
        for (i, param) in net.params().iter().enumerate().rev() {
            let bytes = param.var.elem_count() as u64 * 4;
            match buckets.last_mut() {
                Some(bucket) if filled + bytes <= self.cards.bucket_bytes => bucket.push(i),
                _ => {
                    buckets.push(vec![i]);
                    filled = 0;
                }
            }
            filled += bytes;
        }
        buckets
    }

    /// Replaces each gradient in `grads` by its average over the processes.
    pub fn reduce(&self, grads: &mut GradStore, net: &Network) -> std::result::Result<(), DistError> {
        let params = net.params();
        let scale = 1.0 / self.cards.count as f64;
        for bucket in self.buckets(net) {
            let parts = bucket
                .iter()
                .map(|&i| {
                    let var = params[i].var.as_tensor();
                    match grads.get(var) {
                        Some(g) => g.to_dtype(DType::F32)?.flatten_all(),
                        None => Tensor::zeros(var.elem_count(), DType::F32, var.device()),
                    }
                })
                .collect::<Result<Vec<_>>>()?;
            let sum = self.collective.all_reduce_sum(&Tensor::cat(&parts, 0)?)?;
            drop(parts);
            let mut offset = 0;
            for &i in &bucket {
                let var = params[i].var.as_tensor();
                let n = var.elem_count();
                if grads.get(var).is_some() {
                    let averaged = (sum.narrow(0, offset, n)?.reshape(var.shape())? * scale)?;
                    grads.insert(var, averaged);
                }
                offset += n;
            }
        }
        Ok(())
    }

    /// Under ZeRO-2, drops the gradients of the parameters other processes update.
    pub fn keep_own(&self, grads: &mut GradStore, net: &Network) {
        if self.cards.shard != Shard::Gradients {
            return;
        }
        for (i, param) in net.params().iter().enumerate() {
            if !self.updates(i) {
                grads.remove(param.var.as_tensor());
            }
        }
    }

    /// Without `--sync-bn`, every process takes rank 0's running
    /// statistics, as DDP broadcasts its buffers: the statistics of each
    /// process's own batches would otherwise drift apart, and the processes
    /// would evaluate differently. With it they are the same everywhere.
    pub fn share_buffers(&self, net: &Network) -> std::result::Result<(), DistError> {
        let buffers: Vec<&Var> = net.buffers().iter().map(|b| &b.var).filter(|v| v.dtype().is_float()).collect();
        if buffers.is_empty() || self.cards.sync_batch_norm {
            return Ok(());
        }
        let given: Vec<(&Var, bool)> = buffers.into_iter().map(|v| (v, self.rank == 0)).collect();
        self.take_given(&given)
    }

    /// Under ZeRO-1 and ZeRO-2, every process's updated parameters on
    /// every process, a bucket at a time: each gives its own, zeros for
    /// the others', and the sum is the whole bucket.
    pub fn gather_weights(&self, net: &Network) -> std::result::Result<(), DistError> {
        if self.cards.shard == Shard::None {
            return Ok(());
        }
        let params = net.params();
        for bucket in self.buckets(net) {
            let given: Vec<(&Var, bool)> = bucket.iter().map(|&i| (&params[i].var, self.updates(i))).collect();
            self.take_given(&given)?;
        }
        Ok(())
    }

    /// Each of `vars` as the process that gives it (`true` on that one) has
    /// it, on every process: each fills in what it gives, zeros for the
    /// rest, and the sum over the processes is all of them.
    fn take_given(&self, vars: &[(&Var, bool)]) -> std::result::Result<(), DistError> {
        let Some((first, _)) = vars.first() else { return Ok(()) };
        let len = vars.iter().map(|(v, _)| v.elem_count()).sum();
        let mut made = vec![0f32; len];
        let mut offset = 0;
        for (var, gives) in vars {
            if *gives {
                made[offset..offset + var.elem_count()].copy_from_slice(&var.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
            offset += var.elem_count();
        }
        let made = Tensor::from_vec(made, len, first.device())?;
        let sum = self.collective.all_reduce_sum(&made)?;
        drop(made);
        let mut offset = 0;
        for (var, gives) in vars {
            let n = var.elem_count();
            if !gives {
                var.set(&sum.narrow(0, offset, n)?.reshape(var.shape())?.to_dtype(var.dtype())?)?;
            }
            offset += n;
        }
        Ok(())
    }
}
