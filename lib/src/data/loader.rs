//! The DataLoader: a seeded sampler, worker threads that each build whole
//! batches, a bounded prefetch queue per worker, and a gauge of the host
//! memory all of it holds.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::{Device, Tensor};
use crossbeam_channel::{bounded, Receiver};
use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::seq::SliceRandom;

use super::footprint::{HostFootprint, LoaderShape};
use super::{rng_for, DataError, Rng};

/// The random stream that orders samples (augmentation streams are numbered from 1 << 32).
const ORDER_STREAM: u64 = 0;

/// One transformed sample: normalised CHW pixels, its label and, for
/// segmentation, the class of each pixel.
#[derive(Debug, Clone)]
pub struct Example {
    pub pixels: Vec<f32>,
    /// Channels, height, width.
    pub shape: [usize; 3],
    pub label: u32,
    /// Height x width class indices, rows top to bottom, aligned with `pixels`.
    pub mask: Option<Vec<u8>>,
    pub timing: LoadTiming,
}

/// Where a sample's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct LoadTiming {
    pub encoded_bytes: u64,
    pub decode_seconds: f64,
    pub transform_seconds: f64,
    /// Pixels the decoder produced (after any DCT downscale).
    pub decoded_pixels: u64,
}

impl LoadTiming {
    pub fn add(&mut self, other: &LoadTiming) {
        self.encoded_bytes += other.encoded_bytes;
        self.decode_seconds += other.decode_seconds;
        self.transform_seconds += other.transform_seconds;
        self.decoded_pixels += other.decoded_pixels;
    }
}

/// Samples loaded on demand by index.
pub trait Dataset: Send + Sync + 'static {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The class of sample `index`, without loading it.
    fn label(&self, index: usize) -> u32;

    /// Loads and transforms sample `index`; `rng` drives the augmentation and
    /// `gauge` is told about large temporary buffers.
    fn load(&self, index: usize, rng: &mut Rng, gauge: &MemoryGauge) -> Result<Example, DataError>;

    /// Whether each sample carries a class per pixel (a segmentation mask).
    fn has_masks(&self) -> bool {
        false
    }

    /// What names sample `index` in messages (a path for files).
    fn describe(&self, index: usize) -> String {
        format!("sample {index}")
    }
}

/// Bytes held by batches and decode buffers the loader has made and not yet
/// released: current and peak. Cloning shares the gauge.
#[derive(Debug, Clone, Default)]
pub struct MemoryGauge {
    current: Arc<AtomicI64>,
    peak: Arc<AtomicI64>,
}

impl MemoryGauge {
    pub fn new() -> Self {
        MemoryGauge::default()
    }

    /// Counts `bytes` until the returned lease is dropped.
    pub fn hold(&self, bytes: usize) -> GaugeLease {
        let now = self.current.fetch_add(bytes as i64, Ordering::SeqCst) + bytes as i64;
        self.peak.fetch_max(now, Ordering::SeqCst);
        crate::memory::loader_held(bytes as i64);
        GaugeLease { gauge: self.clone(), bytes: bytes as i64 }
    }

    pub fn current(&self) -> u64 {
        self.current.load(Ordering::SeqCst).max(0) as u64
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst).max(0) as u64
    }

    /// Starts a new peak from the current value.
    pub fn reset_peak(&self) {
        self.peak.store(self.current.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

/// Bytes counted by a [`MemoryGauge`] while this lives.
#[derive(Debug)]
pub struct GaugeLease {
    gauge: MemoryGauge,
    bytes: i64,
}

impl Drop for GaugeLease {
    fn drop(&mut self) {
        self.gauge.current.fetch_sub(self.bytes, Ordering::SeqCst);
        crate::memory::loader_held(-self.bytes);
    }
}

/// Which samples an epoch visits, in which order.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Sampler {
    /// Every sample once; shuffled by the loader's seed and the epoch when `shuffle` is set.
    #[default]
    All,
    /// `num_samples` draws with replacement, sample i with probability
    /// `weights[i] / sum`: inverse class frequency balances an imbalanced set.
    Weighted { weights: Vec<f64>, num_samples: usize },
}

/// One process's part of every epoch when several train together (PyTorch's
/// `DistributedSampler`): the epoch's order, the same on every process (the
/// seed is shared), padded from its start to a multiple of `ranks`, then
/// every `ranks`-th sample from `rank` on. Every process takes as many
/// batches, which their exchanges need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub rank: usize,
    pub ranks: usize,
}

impl Part {
    fn of(self, mut order: Vec<usize>) -> Vec<usize> {
        let total = order.len().div_ceil(self.ranks) * self.ranks;
        let padding: Vec<usize> = order.iter().copied().cycle().take(total - order.len()).collect();
        order.extend(padding);
        order.into_iter().skip(self.rank).step_by(self.ranks).collect()
    }
}

impl Sampler {
    /// Weights of 1 / (count of the sample's class): every class drawn equally often.
    pub fn balanced(labels: &[u32]) -> Sampler {
        let classes = labels.iter().max().map_or(0, |&m| m as usize + 1);
        let mut counts = vec![0usize; classes];
        for &l in labels {
            counts[l as usize] += 1;
        }
        let weights = labels.iter().map(|&l| 1.0 / counts[l as usize] as f64).collect();
        Sampler::Weighted { weights, num_samples: labels.len() }
    }
}

/// The loader's arguments; PyTorch's names and defaults where they exist.
#[derive(Debug, Clone, PartialEq)]
pub struct LoaderConfig {
    pub batch_size: usize,
    pub shuffle: bool,
    pub seed: u64,
    /// Threads building batches; 0 builds them on the caller's thread.
    pub num_workers: usize,
    /// Finished batches each worker may queue ahead (PyTorch's prefetch_factor).
    pub prefetch: usize,
    /// Drops the last, short batch.
    pub drop_last: bool,
    pub sampler: Sampler,
    /// A sample that fails to load is dropped from its batch (and reported
    /// in [`Batch::skipped`]) instead of ending the epoch with an error.
    pub skip_errors: bool,
    /// [`DataLoader::to_device`] sends images to a CUDA device through
    /// page-locked staging (feature `cuda`); a no-op on the CPU. See [`Pinning`](super::Pinning).
    pub pin_memory: bool,
    /// Host RAM the loader may hold (queued batches and decode buffers):
    /// past it, the worker that crossed it is killed and the epoch fails, as
    /// the system's OOM killer ends a PyTorch worker ("DataLoader worker is
    /// killed by signal"). `None`: no limit but the machine's.
    pub host_budget: Option<u64>,
    /// This process's part of every epoch, when several processes train
    /// together; `None`: the whole epoch.
    pub part: Option<Part>,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            batch_size: 32,
            shuffle: true,
            seed: 0,
            num_workers: 0,
            prefetch: 2,
            drop_last: false,
            sampler: Sampler::All,
            skip_errors: false,
            pin_memory: false,
            host_budget: None,
            part: None,
        }
    }
}

/// A batch on the host (or moved to a device with [`Batch::to_device`]).
#[derive(Debug)]
pub struct Batch {
    /// N x C x H x W, f32, normalised.
    pub images: Tensor,
    /// N labels, u32; N x H x W class indices, u32, when the samples carry masks.
    pub labels: Tensor,
    /// Dataset indices of the samples, in order.
    pub indices: Vec<usize>,
    /// Position of the batch in its epoch.
    pub position: usize,
    pub timing: LoadTiming,
    /// Samples that failed to load and were left out, with the reason.
    pub skipped: Vec<String>,
    _lease: Option<GaugeLease>,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// Copies images and labels to `device` (the host copy is released when this batch drops).
    pub fn to_device(&self, device: &Device) -> Result<(Tensor, Tensor), DataError> {
        let move_to =
            |t: &Tensor| t.to_device(device).map_err(|source| DataError::Tensor { op: "to_device", shape: t.dims().to_vec(), source });
        Ok((move_to(&self.images)?, move_to(&self.labels)?))
    }
}

pub struct DataLoader<D: Dataset> {
    dataset: Arc<D>,
    config: LoaderConfig,
    gauge: MemoryGauge,
}

/// The settings of the last loader made in this process and what all its
/// loaders hold, for the OOM investigation's host step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoaderUsage {
    pub workers: usize,
    pub prefetch: usize,
    pub batch_size: usize,
    pub host_budget: Option<u64>,
    /// Bytes of batches and decode buffers the process's loaders hold now, and at most.
    pub held: u64,
    pub peak: u64,
}

const LAST_LOADER: &str = "last_loader";

/// The last loader made in this process (in any cell), with what the
/// loaders hold; `None` when none was made or the process does not count.
pub fn loader_usage() -> Option<LoaderUsage> {
    let (held, peak) = crate::memory::loader_bytes()?;
    let last: LoaderUsage = crate::memory::shared::load(LAST_LOADER)?;
    Some(LoaderUsage { held, peak, ..last })
}

impl<D: Dataset> DataLoader<D> {
    pub fn new(dataset: D, config: LoaderConfig) -> Result<Self, DataError> {
        if config.batch_size == 0 {
            return Err(DataError::invalid("DataLoader", "batch_size must be at least 1"));
        }
        if config.prefetch == 0 && config.num_workers > 0 {
            return Err(DataError::invalid("DataLoader", "prefetch must be at least 1 when num_workers > 0"));
        }
        if dataset.is_empty() {
            return Err(DataError::invalid("DataLoader", "the dataset has no samples"));
        }
        if let Some(Part { rank, ranks }) = config.part {
            if rank >= ranks {
                return Err(DataError::invalid(
                    "DataLoader",
                    format!("part {rank} of {ranks}: a rank counts from 0 to one less than the ranks"),
                ));
            }
        }
        if let Sampler::Weighted { weights, .. } = &config.sampler {
            if weights.len() != dataset.len() {
                return Err(DataError::invalid("DataLoader", format!("{} sampler weights for {} samples", weights.len(), dataset.len())));
            }
            WeightedIndex::new(weights).map_err(|e| DataError::invalid("weighted sampler", e.to_string()))?;
        }
        if config.host_budget == Some(0) {
            return Err(DataError::invalid("DataLoader", "a host budget of 0 bytes holds no batch; give a size, or None for no limit"));
        }
        let settings = LoaderUsage {
            workers: config.num_workers,
            prefetch: config.prefetch,
            batch_size: config.batch_size,
            host_budget: config.host_budget,
            held: 0,
            peak: 0,
        };
        crate::memory::shared::store(LAST_LOADER, Some(&settings));
        Ok(DataLoader { dataset: Arc::new(dataset), config, gauge: MemoryGauge::new() })
    }

    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// Batch and decode-buffer bytes held now and at peak.
    pub fn gauge(&self) -> &MemoryGauge {
        &self.gauge
    }

    /// The samples epoch `epoch` visits, in order: the same for any number
    /// of workers; with a [`Part`], this process's part of it.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let whole = self.whole_order(epoch);
        match self.config.part {
            Some(part) => part.of(whole),
            None => whole,
        }
    }

    fn whole_order(&self, epoch: u64) -> Vec<usize> {
        let mut rng = rng_for(self.config.seed, ORDER_STREAM, epoch);
        match &self.config.sampler {
            Sampler::All => {
                let mut order: Vec<usize> = (0..self.dataset.len()).collect();
                if self.config.shuffle {
                    order.shuffle(&mut rng);
                }
                order
            }
            Sampler::Weighted { weights, num_samples } => match WeightedIndex::new(weights) {
                Ok(dist) => (0..*num_samples).map(|_| dist.sample(&mut rng)).collect(),
                Err(_) => Vec::new(),
            },
        }
    }

    /// The samples of each batch of epoch `epoch`.
    pub fn batches(&self, epoch: u64) -> Vec<Vec<usize>> {
        let order = self.order(epoch);
        order
            .chunks(self.config.batch_size)
            .filter(|chunk| !self.config.drop_last || chunk.len() == self.config.batch_size)
            .map(<[usize]>::to_vec)
            .collect()
    }

    /// Batches per epoch (this process's, with a [`Part`]).
    pub fn len(&self) -> usize {
        let whole = match &self.config.sampler {
            Sampler::All => self.dataset.len(),
            Sampler::Weighted { num_samples, .. } => *num_samples,
        };
        let n = self.config.part.map_or(whole, |part| whole.div_ceil(part.ranks));
        if self.config.drop_last {
            n / self.config.batch_size
        } else {
            n.div_ceil(self.config.batch_size)
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host memory this loader's settings imply for samples of `sample`
    /// (C, H, W) decoded from images of up to `source` pixels (width, height).
    pub fn footprint(&self, sample: [usize; 3], source: (u32, u32)) -> HostFootprint {
        LoaderShape {
            batch_size: self.config.batch_size,
            sample,
            num_workers: self.config.num_workers,
            prefetch: self.config.prefetch,
            source,
            masks: self.dataset.has_masks(),
        }
        .footprint()
    }

    /// Iterates over the batches of epoch `epoch`; dropping the iterator stops the workers.
    pub fn epoch(&self, epoch: u64) -> Epoch {
        let plan = Arc::new(EpochPlan {
            batches: self.batches(epoch),
            seed: self.config.seed,
            epoch,
            skip_errors: self.config.skip_errors,
            gauge: self.gauge.clone(),
            host_budget: self.config.host_budget,
            workers: self.config.num_workers,
            prefetch: self.config.prefetch,
        });
        let workers = self.config.num_workers;
        if workers == 0 {
            let dataset: Arc<dyn Dataset> = self.dataset.clone();
            return Epoch { plan, next: 0, source: Source::Inline(dataset) };
        }
        let mut receivers = Vec::with_capacity(workers);
        let mut handles = Vec::with_capacity(workers);
        for worker in 0..workers {
            let (tx, rx) = bounded(self.config.prefetch);
            let (dataset, plan) = (self.dataset.clone(), plan.clone());
            handles.push(std::thread::spawn(move || {
                for position in (worker..plan.batches.len()).step_by(workers) {
                    let batch = plan.build(&*dataset, position);
                    let failed = batch.is_err();
                    if tx.send(batch).is_err() || failed {
                        return;
                    }
                }
            }));
            receivers.push(rx);
        }
        Epoch { plan, next: 0, source: Source::Workers { receivers, handles } }
    }
}

struct EpochPlan {
    batches: Vec<Vec<usize>>,
    seed: u64,
    epoch: u64,
    skip_errors: bool,
    gauge: MemoryGauge,
    host_budget: Option<u64>,
    workers: usize,
    prefetch: usize,
}

impl EpochPlan {
    /// The host budget's kill: the worker building batch `position` took the loader past it.
    fn within_host_budget(&self, position: usize) -> Result<(), DataError> {
        match self.host_budget {
            Some(budget) if self.gauge.current() > budget => Err(DataError::WorkerKilled {
                worker: position % self.workers.max(1),
                held: self.gauge.current(),
                budget,
                workers: self.workers,
                prefetch: self.prefetch,
            }),
            _ => Ok(()),
        }
    }

    fn build(&self, dataset: &dyn Dataset, position: usize) -> Result<Batch, DataError> {
        let indices = &self.batches[position];
        let mut timing = LoadTiming::default();
        let mut skipped = Vec::new();
        let mut kept = Vec::with_capacity(indices.len());
        let mut pixels: Vec<f32> = Vec::new();
        let mut labels = Vec::with_capacity(indices.len());
        let mut masks: Vec<u32> = Vec::new();
        let mut shape: Option<[usize; 3]> = None;
        let mut masked = false;
        let mut lease: Option<GaugeLease> = None;
        for (slot, &index) in indices.iter().enumerate() {
            // One stream per sample position: augmentation does not depend on which worker runs it.
            let mut rng = rng_for(self.seed, (self.epoch.wrapping_add(1) << 32) | position as u64, slot as u64);
            let example = match dataset.load(index, &mut rng, &self.gauge) {
                Ok(example) => example,
                Err(err) if self.skip_errors => {
                    skipped.push(err.to_string());
                    continue;
                }
                Err(err) => return Err(err),
            };
            self.within_host_budget(position)?;
            match shape {
                None => {
                    shape = Some(example.shape);
                    masked = example.mask.is_some();
                    let values = indices.len() * example.shape.iter().product::<usize>();
                    pixels.reserve_exact(values);
                    let labels_per_sample = if masked { example.shape[1] * example.shape[2] } else { 1 };
                    if masked {
                        masks.reserve_exact(indices.len() * labels_per_sample);
                    }
                    lease = Some(self.gauge.hold(values * 4 + indices.len() * labels_per_sample * 4));
                    self.within_host_budget(position)?;
                }
                Some(first) if first != example.shape => {
                    return Err(DataError::invalid(
                        "collate",
                        format!(
                            "{} is {:?} but the batch's first sample is {first:?}: resize or crop to one size",
                            dataset.describe(index),
                            example.shape
                        ),
                    ))
                }
                Some(_) => {}
            }
            match (&example.mask, masked) {
                (Some(mask), true) if mask.len() == example.shape[1] * example.shape[2] => masks.extend(mask.iter().map(|&c| c as u32)),
                (Some(mask), true) => {
                    return Err(DataError::invalid(
                        "collate",
                        format!(
                            "{}'s mask holds {} values for a {}x{} image",
                            dataset.describe(index),
                            mask.len(),
                            example.shape[2],
                            example.shape[1]
                        ),
                    ))
                }
                (None, false) => labels.push(example.label),
                (Some(_), false) | (None, true) => {
                    let (this, first) = if masked { ("no mask", "one") } else { ("a mask", "none") };
                    return Err(DataError::invalid(
                        "collate",
                        format!(
                            "{} carries {this} but the batch's first sample carries {first}: \
                             a batch is all segmentation samples (labels N x H x W) or all class samples (labels N)",
                            dataset.describe(index)
                        ),
                    ));
                }
            }
            timing.add(&example.timing);
            pixels.extend_from_slice(&example.pixels);
            kept.push(index);
        }
        let [c, h, w] = shape.unwrap_or([3, 1, 1]);
        let dims = (kept.len(), c, h, w);
        let images = Tensor::from_vec(pixels, dims, &Device::Cpu).map_err(|source| DataError::Tensor {
            op: "collate images",
            shape: vec![dims.0, c, h, w],
            source,
        })?;
        let labels = if masked {
            Tensor::from_vec(masks, (kept.len(), h, w), &Device::Cpu).map_err(|source| DataError::Tensor {
                op: "collate masks",
                shape: vec![kept.len(), h, w],
                source,
            })?
        } else {
            Tensor::from_vec(labels, kept.len(), &Device::Cpu).map_err(|source| DataError::Tensor {
                op: "collate labels",
                shape: vec![kept.len()],
                source,
            })?
        };
        Ok(Batch { images, labels, indices: kept, position, timing, skipped, _lease: lease })
    }
}

enum Source {
    Inline(Arc<dyn Dataset>),
    Workers { receivers: Vec<Receiver<Result<Batch, DataError>>>, handles: Vec<JoinHandle<()>> },
}

/// The batches of one epoch, in order.
pub struct Epoch {
    plan: Arc<EpochPlan>,
    next: usize,
    source: Source,
}

impl Epoch {
    /// Batches in this epoch.
    pub fn len(&self) -> usize {
        self.plan.batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.plan.batches.is_empty()
    }
}

impl Iterator for Epoch {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        let position = self.next;
        if position >= self.plan.batches.len() {
            return None;
        }
        self.next += 1;
        let batch = match &self.source {
            Source::Inline(dataset) => self.plan.build(&**dataset, position),
            Source::Workers { receivers, .. } => {
                let worker = position % receivers.len();
                receivers[worker].recv().unwrap_or(Err(DataError::WorkerLost { worker, batch: position }))
            }
        };
        if batch.is_err() {
            self.next = self.plan.batches.len();
        }
        Some(batch)
    }
}

impl Drop for Epoch {
    fn drop(&mut self) {
        if let Source::Workers { receivers, handles } = &mut self.source {
            receivers.clear();
            for handle in handles.drain(..) {
                let _ = handle.join();
            }
        }
    }
}

#[cfg(test)]
mod tests;
