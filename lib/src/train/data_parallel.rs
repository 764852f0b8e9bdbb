//! A trainer's step spread over several processes: the gradients averaged
//! over them a bucket at a time as backward makes them, and under ZeRO-1
//! and ZeRO-2 each process updating its own parameters and handing them to
//! the others; with `--sync-bn`, batch-norm's statistics summed over them.

use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};

use crate::dist::{self, owners, Collective, DistError};
use crate::ledger::{Cards, Shard};
use crate::models::Network;
use crate::ops::ProcessSum;

/// The collective, shared by the trainer and the batch-norms it synchronises.
struct Shared(Mutex<Box<dyn Collective>>);

impl Shared {
    fn all_reduce_sum(&self, bucket: &Tensor) -> std::result::Result<Tensor, DistError> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).all_reduce_sum(bucket)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> std::result::Result<Vec<Vec<u8>>, DistError> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).all_gather_bytes(bytes)
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

    /// `params` (indices into [`Network::params`]) in DDP's buckets
    /// ([`dist::buckets`]).
    fn buckets(&self, net: &Network, params: Range<usize>) -> Vec<Range<usize>> {
        let bytes: Vec<u64> = net.params()[params.clone()].iter().map(|p| p.var.elem_count() as u64 * 4).collect();
        dist::buckets(&bytes, self.cards.bucket_bytes).into_iter().map(|b| b.start + params.start..b.end + params.start).collect()
    }

    /// Replaces the gradients of `params` in `grads` by their average over
    /// the processes, a bucket at a time; under ZeRO-2 this process keeps
    /// only those of the parameters it updates. The trainer calls it for
    /// each backward segment's parameters as the segment ends, or for all
    /// of them once the micro-batches' gradients are summed.
    pub fn reduce(&self, grads: &mut GradStore, net: &Network, params: Range<usize>) -> std::result::Result<(), DistError> {
        let all = net.params();
        let scale = 1.0 / self.cards.count as f64;
        for bucket in self.buckets(net, params) {
            let parts = bucket
                .clone()
                .map(|i| {
                    let var = all[i].var.as_tensor();
                    match grads.get(var) {
                        Some(g) => g.to_dtype(DType::F32)?.flatten_all(),
                        None => Tensor::zeros(var.elem_count(), DType::F32, var.device()),
                    }
                })
                .collect::<Result<Vec<_>>>()?;
            let sum = self.collective.all_reduce_sum(&Tensor::cat(&parts, 0)?)?;
            drop(parts);
            let mut offset = 0;
            for i in bucket {
                let var = all[i].var.as_tensor();
                let n = var.elem_count();
                if self.divides_gradients() && !self.updates(i) {
                    grads.remove(var);
                } else if grads.get(var).is_some() {
                    let averaged = (sum.narrow(0, offset, n)?.reshape(var.shape())? * scale)?;
                    grads.insert(var, averaged);
                }
                offset += n;
            }
        }
        Ok(())
    }

    /// Whether the gradients are divided among the processes once reduced
    /// (ZeRO-2), so that what is computed from all of them (the norm that
    /// clipping uses, whether one is not finite) takes every process's part.
    fn divides_gradients(&self) -> bool {
        self.cards.shard == Shard::Gradients
    }

    /// The `norm_type`-norm of all the reduced gradients, from this
    /// process's `own` norm of those it holds.
    pub fn norm(&self, own: f64, norm_type: f64) -> std::result::Result<f64, DistError> {
        if !self.divides_gradients() {
            return Ok(own);
        }
        let norms = self.collective.all_gather_bytes(&own.to_le_bytes())?;
        let norms =
            norms.iter().map(|bytes| bytes.as_slice().try_into().map(f64::from_le_bytes).map_err(|_| DistError::Message(bytes.len())));
        let norms = norms.collect::<std::result::Result<Vec<f64>, _>>()?;
        Ok(if norm_type == f64::INFINITY {
            norms.into_iter().fold(0.0, f64::max)
        } else {
            norms.into_iter().map(|n| n.powf(norm_type)).sum::<f64>().powf(1.0 / norm_type)
        })
    }

    /// Whether any process found a gradient that is not finite, from
    /// whether this one did among those it holds.
    pub fn any_not_finite(&self, own: bool) -> std::result::Result<bool, DistError> {
        if !self.divides_gradients() {
            return Ok(own);
        }
        Ok(self.collective.all_gather_bytes(&[u8::from(own)])?.iter().any(|found| found.first() == Some(&1)))
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
        for bucket in self.buckets(net, 0..params.len()) {
            let given: Vec<(&Var, bool)> = bucket.map(|i| (&params[i].var, self.updates(i))).collect();
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
