//! `pin_memory`: page-locked staging for host-to-device copies.
//!
//! A copy from ordinary (pageable) host memory to a CUDA device goes through
//! the driver's own page-locked bounce buffer, chunk by chunk, and the caller
//! waits for it. From page-locked memory the device reads the bytes itself
//! (DMA) at the full bus rate, and the copy is queued on the stream instead
//! of waited for. With the `cuda` feature and [`LoaderConfig::pin_memory`],
//! [`DataLoader::to_device`] copies each batch's images into a reused
//! page-locked buffer and sends them from there.
//!
//! On the CPU there is no device copy to speed up: `pin_memory` is accepted
//! and does nothing ([`Pinning::NoOp`]).

use std::fmt;

use candle_core::{Device, Tensor};

use super::loader::{Batch, DataLoader, Dataset, LoaderConfig};
use super::DataError;

/// What `pin_memory` does for batches sent to one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Pinning {
    /// `pin_memory` is off: batches go to the device from pageable memory.
    Off,
    /// Images go to the CUDA device through page-locked staging.
    PageLocked,
    /// `pin_memory` is on but the device is not a CUDA device (or this build
    /// lacks the `cuda` feature): nothing to pin, nothing changes.
    NoOp,
}

impl fmt::Display for Pinning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Pinning::Off => "pin_memory off",
            Pinning::PageLocked => "pin_memory: images staged in page-locked memory for the CUDA copy",
            Pinning::NoOp => "pin_memory: no effect here (it speeds up copies to a CUDA device; batches for the CPU stay where they are)",
        })
    }
}

impl LoaderConfig {
    /// What [`pin_memory`](LoaderConfig::pin_memory) does for batches sent to `device`.
    pub fn pinning(&self, device: &Device) -> Pinning {
        match (self.pin_memory, device.is_cuda() && cfg!(feature = "cuda")) {
            (false, _) => Pinning::Off,
            (true, true) => Pinning::PageLocked,
            (true, false) => Pinning::NoOp,
        }
    }
}

impl<D: Dataset> DataLoader<D> {
    /// Copies `batch` to `device`, through page-locked staging when the
    /// config asks for `pin_memory` and `device` is a CUDA device; otherwise
    /// the same as [`Batch::to_device`].
    pub fn to_device(&self, batch: &Batch, device: &Device) -> Result<(Tensor, Tensor), DataError> {
        #[cfg(feature = "cuda")]
        if let (Pinning::PageLocked, Device::Cuda(cuda)) = (self.config().pinning(device), device) {
            let images = staging::copy(&batch.images, cuda)?;
            let labels = batch.labels.to_device(device).map_err(|source| DataError::Tensor {
                op: "to_device",
                shape: batch.labels.dims().to_vec(),
                source,
            })?;
            return Ok((images, labels));
        }
        batch.to_device(device)
    }
}

#[cfg(feature = "cuda")]
pub use staging::bench_h2d;

/// Host-to-device copy speed, pageable against page-locked.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct H2dBench {
    pub bytes: usize,
    pub repeats: usize,
    /// From a CPU tensor in ordinary memory (`Tensor::to_device`).
    pub pageable_mb_per_s: f64,
    /// From a buffer already page-locked (the DMA alone).
    pub pinned_mb_per_s: f64,
    /// The loader's path: copy into the kept page-locked buffer, then the DMA.
    pub staged_mb_per_s: f64,
}

/// PyTorch's copies in the same run: `tensor.to("cuda")` from pageable and from pinned memory.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct TorchH2d {
    pub pageable_mb_per_s: f64,
    pub pinned_mb_per_s: f64,
}

/// A GPU run's host-to-device copies as `scripts/gpu_check.sh` recorded
/// them (its `h2d.json` and `env.json`), so that a machine without a GPU
/// shows what one measured instead of quoting it.
#[derive(Debug, Clone, PartialEq)]
pub struct H2dRecord {
    pub gpu: String,
    pub date: String,
    pub vramlab: H2dBench,
    pub torch: Option<TorchH2d>,
}

impl H2dRecord {
    /// Reads `dir/h2d.json` and `dir/env.json`.
    pub fn read(dir: &std::path::Path) -> Result<H2dRecord, DataError> {
        #[derive(serde::Deserialize)]
        struct Run {
            json: H2dBench,
        }
        #[derive(serde::Deserialize)]
        struct Copies {
            vramlab: Run,
            torch: Option<TorchH2d>,
        }
        #[derive(serde::Deserialize)]
        struct Env {
            gpu: Option<String>,
            date: String,
        }
        fn json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T, DataError> {
            let text = std::fs::read_to_string(path).map_err(DataError::io("reading", path))?;
            serde_json::from_str(&text).map_err(|e| DataError::invalid("H2dRecord::read", format!("{}: {e}", path.display())))
        }
        let copies: Copies = json(&dir.join("h2d.json"))?;
        let env: Env = json(&dir.join("env.json"))?;
        Ok(H2dRecord {
            gpu: env.gpu.unwrap_or_else(|| "an unnamed GPU".to_owned()),
            date: env.date,
            vramlab: copies.vramlab.json,
            torch: copies.torch,
        })
    }

    /// Each path's speed, vramlab's beside PyTorch's.
    pub fn table(&self) -> crate::render::Table {
        let gb = |mb: f64| format!("{:.1} GB/s", mb / 1000.0);
        let torch = |pick: fn(&TorchH2d) -> f64| self.torch.as_ref().map_or("-".to_owned(), |t| gb(pick(t)));
        let v = &self.vramlab;
        crate::render::Table::new(["host memory", "vramlab", "PyTorch"])
            .title(format!(
                "host-to-device copies of {} on the {} ({}), median of {}",
                crate::units::human(v.bytes as u64),
                self.gpu,
                self.date,
                v.repeats
            ))
            .right_align(&[1, 2])
            .row(["pageable".to_owned(), gb(v.pageable_mb_per_s), torch(|t| t.pageable_mb_per_s)])
            .row(["page-locked (pinned)".to_owned(), gb(v.pinned_mb_per_s), torch(|t| t.pinned_mb_per_s)])
            .row(["staged through page-locked, as the loader does".to_owned(), gb(v.staged_mb_per_s), "-".to_owned()])
    }
}

#[cfg(feature = "cuda")]
mod staging {
    use std::sync::Mutex;
    use std::time::Instant;

    use candle_core::cuda_backend::cudarc::driver::{DriverError, PinnedHostSlice};
    use candle_core::cuda_backend::{CudaDevice, CudaStorage};
    use candle_core::op::BackpropOp;
    use candle_core::{Device, Storage, Tensor};

    use super::H2dBench;

    use crate::data::DataError;

    /// Page-locked buffers kept for reuse: allocating one (`cuMemHostAlloc`)
    /// takes milliseconds, and a loader sends batches of one size.
    static BUFFERS: Mutex<Vec<PinnedHostSlice<f32>>> = Mutex::new(Vec::new());
    /// Buffers kept at most (a few batch sizes, several devices).
    const KEEP: usize = 4;

    fn driver<'a>(op: &'static str, shape: &'a [usize]) -> impl FnOnce(DriverError) -> DataError + 'a {
        move |err| DataError::Tensor { op, shape: shape.to_vec(), source: candle_core::Error::Cuda(Box::new(err)) }
    }

    fn tensor<'a>(op: &'static str, shape: &'a [usize]) -> impl FnOnce(candle_core::Error) -> DataError + 'a {
        move |source| DataError::Tensor { op, shape: shape.to_vec(), source }
    }

    /// A buffer of exactly `len` values in `device`'s context: a kept one or a new one.
    fn take(len: usize, device: &CudaDevice, shape: &[usize]) -> Result<PinnedHostSlice<f32>, DataError> {
        let context = device.cuda_stream().context().clone();
        let mut kept = BUFFERS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = kept.iter().position(|b| b.len() == len && **b.context() == *context) {
            return Ok(kept.swap_remove(i));
        }
        drop(kept);
        // SAFETY: the buffer is written in full before anything reads it.
        unsafe { context.alloc_pinned::<f32>(len) }.map_err(driver("allocating page-locked memory", shape))
    }

    fn give_back(buffer: PinnedHostSlice<f32>) {
        let mut kept = BUFFERS.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() == KEEP {
            kept.remove(0);
        }
        kept.push(buffer);
    }

    /// `images` (f32 on the CPU) to `device` through a page-locked buffer.
    /// The device copy is queued on the device's stream; the buffer is
    /// reused only after it (cudarc records an event for it).
    pub(super) fn copy(images: &Tensor, device: &CudaDevice) -> Result<Tensor, DataError> {
        let shape = images.dims();
        let staged = {
            let (storage, layout) = images.storage_and_layout();
            match (&*storage, layout.contiguous_offsets()) {
                (Storage::Cpu(cpu), Some((start, end))) => {
                    let mut buffer = take(end - start, device, shape)?;
                    let all = cpu.as_slice::<f32>().map_err(tensor("pinned staging", shape))?;
                    buffer.as_mut_slice().map_err(driver("waiting for the staging buffer", shape))?.copy_from_slice(&all[start..end]);
                    Some(buffer)
                }
                _ => None,
            }
        };
        // Not contiguous f32 on the CPU: the plain copy (after the storage lock above is released).
        let Some(values) = staged else {
            return images.to_device(&Device::Cuda(device.clone())).map_err(tensor("to_device", shape));
        };
        let on_device = device.clone_htod(&values).map_err(tensor("copy from page-locked memory", shape))?;
        give_back(values);
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(on_device, device.clone()));
        Ok(Tensor::from_storage(storage, images.shape().clone(), BackpropOp::none(), false))
    }

    /// Times `repeats` copies of `bytes` (rounded down to whole f32) to
    /// `device` each way, after one untimed copy each; the median, in MB/s
    /// (10^6 bytes), waiting for the device after every copy.
    pub fn bench_h2d(device: &Device, bytes: usize, repeats: usize) -> Result<H2dBench, DataError> {
        let Device::Cuda(cuda) = device else {
            return Err(DataError::invalid("bench h2d", "needs a CUDA device"));
        };
        if repeats == 0 || bytes < 4 {
            return Err(DataError::invalid("bench h2d", "needs at least 4 bytes and one repeat"));
        }
        let len = bytes / 4;
        let shape = [len];
        let host = Tensor::arange(0u32, len as u32, &Device::Cpu)
            .and_then(|t| t.to_dtype(candle_core::DType::F32))
            .map_err(tensor("bench h2d: host tensor", &shape))?;
        let sync = || device.synchronize().map_err(tensor("synchronize", &shape));
        let time = |copy: &mut dyn FnMut() -> Result<(), DataError>| -> Result<f64, DataError> {
            copy()?;
            sync()?;
            let mut seconds = Vec::with_capacity(repeats);
            for _ in 0..repeats {
                let started = Instant::now();
                copy()?;
                sync()?;
                seconds.push(started.elapsed().as_secs_f64());
            }
            seconds.sort_by(f64::total_cmp);
            Ok((len * 4) as f64 / 1e6 / seconds[repeats / 2])
        };
        let pageable = time(&mut || host.to_device(device).map(drop).map_err(tensor("to_device", &shape)))?;
        let mut pinned = take(len, cuda, &shape)?;
        {
            let (storage, _) = host.storage_and_layout();
            if let Storage::Cpu(cpu) = &*storage {
                let values = cpu.as_slice::<f32>().map_err(tensor("bench h2d", &shape))?;
                pinned.as_mut_slice().map_err(driver("filling page-locked memory", &shape))?.copy_from_slice(values);
            }
        }
        let direct = time(&mut || cuda.clone_htod(&pinned).map(drop).map_err(tensor("copy from page-locked memory", &shape)))?;
        give_back(pinned);
        let staged = time(&mut || copy(&host, cuda).map(drop))?;
        Ok(H2dBench { bytes: len * 4, repeats, pageable_mb_per_s: pageable, pinned_mb_per_s: direct, staged_mb_per_s: staged })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Example, LoadTiming, MemoryGauge, Rng};

    #[test]
    fn a_gpu_runs_copies_are_read_from_its_json_and_a_missing_one_is_named() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../benchmarks/h200-2026-12-04");
        let record = H2dRecord::read(&dir).unwrap();
        assert_eq!(record.gpu, "NVIDIA H200");
        assert!(record.vramlab.pinned_mb_per_s > record.vramlab.pageable_mb_per_s);
        let text = record.table().to_string();
        assert!(text.contains("NVIDIA H200") && text.contains("page-locked (pinned)") && text.contains("GB/s"), "{text}");
        let err = H2dRecord::read(&dir.join("nowhere")).unwrap_err().to_string();
        assert!(err.contains("nowhere"), "{err}");
    }

    struct Ramp;

    impl Dataset for Ramp {
        fn len(&self) -> usize {
            6
        }

        fn label(&self, index: usize) -> u32 {
            index as u32 % 2
        }

        fn load(&self, index: usize, _rng: &mut Rng, _gauge: &MemoryGauge) -> Result<Example, DataError> {
            let pixels = (0..12).map(|i| (index * 12 + i) as f32).collect();
            Ok(Example { pixels, shape: [3, 2, 2], label: self.label(index), mask: None, timing: LoadTiming::default() })
        }
    }

    #[test]
    fn pin_memory_is_accepted_and_changes_nothing_on_the_cpu() {
        let config =
            |pin_memory| LoaderConfig { batch_size: 4, shuffle: true, seed: 5, num_workers: 2, pin_memory, ..LoaderConfig::default() };
        let plain = DataLoader::new(Ramp, config(false)).unwrap();
        let pinned = DataLoader::new(Ramp, config(true)).unwrap();
        assert_eq!(pinned.config().pinning(&Device::Cpu), Pinning::NoOp);
        assert_eq!(plain.config().pinning(&Device::Cpu), Pinning::Off);
        assert!(Pinning::NoOp.to_string().contains("no effect"));
        let mut batches = 0;
        for (a, b) in plain.epoch(0).zip(pinned.epoch(0)) {
            let (a, b) = (a.unwrap(), b.unwrap());
            let (a_images, a_labels) = plain.to_device(&a, &Device::Cpu).unwrap();
            let (b_images, b_labels) = pinned.to_device(&b, &Device::Cpu).unwrap();
            assert_eq!(a.indices, b.indices);
            assert_eq!(a_images.dims(), b_images.dims());
            assert_eq!(
                a_images.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                b_images.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
            assert_eq!(a_labels.to_vec1::<u32>().unwrap(), b_labels.to_vec1::<u32>().unwrap());
            batches += 1;
        }
        assert_eq!(batches, 2);
    }
}
