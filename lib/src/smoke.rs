//! `vramlab smoke`: on a new machine, does everything a project needs work
//! here? The loader on a small synthetic folder, a ResNet-18 step with each
//! lever (its measured peak beside the ledger's), the lesson's own check
//! (ResNet-18 trained from the folder through the loader with mixed precision
//! and accumulation together, its last step measured), and then on the CPU the
//! simulated budget failing a step where the ledger says it will, on a CUDA
//! GPU the device pool's readings following a tensor of known size. Each
//! check keeps the figure behind its verdict.
//!
//! # The room
//!
//! `vramlab smoke`: the loader, a step with each lever, the levers and the loader together in a
//! short run from a folder, and the memory readings (the simulated budget on the CPU, the pool's
//! probes on CUDA) checked on this machine.

use std::time::Instant;

use candle_core::Device;
use serde::Serialize;

use crate::data::{DataLoader, ImageFolder, LeafDiseaseSynth, LoaderConfig, OnError, Transforms};
use crate::gpus::Card;
use crate::ledger::{estimate, Checkpointing, Levers, StepConfig};
use crate::memory::{Budget, HostMemory};
use crate::models::{ModelName, Precision};
use crate::render::{Bundle, Render, Table};
use crate::train::{is_out_of_memory, measure_train, BenchSpec, Comparison, TrainConfig, TrainError};
use crate::units::human;

/// A step passes when its measured peak is within this share of the ledger's.
pub const PEAK_TOLERANCE: f64 = 0.10;
/// The budget checks give the step this share of its predicted peak, and then this much more.
const TIGHT: f64 = 0.8;
const ROOMY: f64 = 1.25;
/// Small enough for two CPU cores: ResNet-18's every stage, batch 8 at 64x64.
const BATCH: usize = 8;
const RES: usize = 64;
const PHOTOS: usize = 24;

/// One check: what it tried, whether it worked, and the figure behind that.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SmokeCheck {
    pub name: String,
    pub passed: bool,
    pub figure: String,
    pub seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SmokeReport {
    pub device: String,
    pub checks: Vec<SmokeCheck>,
}

impl SmokeReport {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }

    pub fn table(&self) -> Table {
        let passed = self.checks.iter().filter(|c| c.passed).count();
        let mut table = Table::new(["check", "result", "figure", "seconds"])
            .title(format!("vramlab smoke on {}: {passed} of {} passed", self.device, self.checks.len()))
            .right_align(&[3]);
        for check in &self.checks {
            let result = if check.passed { "pass" } else { "FAIL" };
            table.push_row([check.name.clone(), result.to_owned(), check.figure.clone(), format!("{:.1}", check.seconds)]);
        }
        table.note(format!("A step passes when it runs and its measured peak is within {:.0}% of the ledger's.", 100.0 * PEAK_TOLERANCE))
    }
}

crate::render::shown_as_bundles!(SmokeReport);

impl Render for SmokeReport {
    fn bundle(&self) -> Bundle {
        self.table().bundle()
    }
}

/// Runs every check on `device`; a check that fails does not stop the others.
pub fn smoke(device: &Device) -> SmokeReport {
    let mut checks = vec![timed("loader on a synthetic leaf folder", loader)];
    let levers = [
        ("ResNet-18 step, f32", TrainConfig::default()),
        ("ResNet-18 step, f16 mixed precision", TrainConfig { precision: Precision::F16Amp, ..TrainConfig::default() }),
        ("ResNet-18 step, 2 accumulation steps", TrainConfig { accumulation: 2, ..TrainConfig::default() }),
        ("ResNet-18 step, checkpointing stages", TrainConfig { checkpointing: Checkpointing::Stages, ..TrainConfig::default() }),
    ];
    for (name, config) in levers {
        checks.push(timed(name, || step(device, config)));
    }
    checks.push(timed("ResNet-18 trained from a folder: the loader, f16 and 2 accumulation steps at once", || combined(device)));
    if device.is_cpu() {
        checks.push(timed("simulated budget below the predicted peak: out of memory", || budget(device, TIGHT)));
        checks.push(timed("simulated budget above the predicted peak: the step fits", || budget(device, ROOMY)));
    }
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        checks.push(timed("CUDA pool probes follow a 64 MiB tensor", || pool(device)));
    }
    SmokeReport { device: device_name(device), checks }
}

fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => format!("the CPU ({} threads)", candle_core::utils::get_num_threads()),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("CUDA device {gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("Metal device {gpu_id}"),
    }
}

fn timed(name: &str, check: impl FnOnce() -> Result<String, String>) -> SmokeCheck {
    let started = Instant::now();
    let (passed, figure) = match check() {
        Ok(figure) => (true, figure),
        Err(figure) => (false, figure),
    };
    SmokeCheck { name: name.to_owned(), passed, figure, seconds: started.elapsed().as_secs_f64() }
}

fn loader() -> Result<String, String> {
    let (_dir, folder) = synthetic_folder(PHOTOS, 7)?;
    let config = LoaderConfig { batch_size: BATCH, num_workers: 2, ..LoaderConfig::default() };
    let loader = DataLoader::new(folder.all(Transforms::resize(RES as u32)), config).map_err(|e| e.to_string())?;
    let (mut images, mut batches) = (0, 0);
    for batch in loader.epoch(0) {
        let batch = batch.map_err(|e| e.to_string())?;
        let dims = batch.images.dims().to_vec();
        if dims[1..] != [3, RES, RES] {
            return Err(format!("a batch of shape {dims:?}, not N x 3 x {RES} x {RES}"));
        }
        images += dims[0];
        batches += 1;
    }
    let photos = folder.labels().len();
    if images != photos {
        return Err(format!("{images} of {photos} photos came out of the loader"));
    }
    Ok(format!("{images} photos of {} classes in {batches} batches, 2 workers", folder.classes.len()))
}

/// `photos` synthetic leaf photos in a temporary folder, kept while the directory lives.
fn synthetic_folder(photos: usize, seed: u64) -> Result<(tempfile::TempDir, ImageFolder), String> {
    let dir = tempfile::tempdir().map_err(|e| format!("no temporary directory: {e}"))?;
    LeafDiseaseSynth::new(photos, seed).generate(dir.path()).map_err(|e| e.to_string())?;
    let folder = ImageFolder::open(dir.path(), OnError::Fail).map_err(|e| e.to_string())?;
    Ok((dir, folder))
}

fn spec(config: TrainConfig) -> BenchSpec {
    BenchSpec {
        model: ModelName::Resnet18,
        classes: 4,
        batch: BATCH,
        res: RES,
        config,
        layers: crate::models::Layers::Lean,
        warmup: 2,
        steps: 1,
        seed: 0,
    }
}

fn step(device: &Device, config: TrainConfig) -> Result<String, String> {
    let (_, comparison) = measure_train(&spec(config), device).map_err(|e| e.to_string())?;
    judge(&comparison)
}

fn judge(comparison: &Comparison) -> Result<String, String> {
    let error = comparison.peak_error_percent().unwrap_or(f64::INFINITY);
    let figure =
        format!("peak {} measured, {} predicted ({error:+.1}%)", human(comparison.measured_peak), human(comparison.predicted_peak));
    if error.abs() <= 100.0 * PEAK_TOLERANCE {
        Ok(figure)
    } else {
        Err(figure)
    }
}

/// Photos of the combined run: three optimizer steps of 2 x 8.
const COMBINED_PHOTOS: usize = 48;

/// The lesson's check on a new machine (5.3c): ResNet-18 trained on a
/// synthetic folder through the loader, with f16 mixed precision and
/// accumulation at once; every step but the last as training runs, the last
/// measured against the ledger.
fn combined(device: &Device) -> Result<String, String> {
    use crate::models::{Network, Shape};
    use crate::train::Trainer;
    let text = |e: &dyn std::fmt::Display| e.to_string();
    let (_dir, folder) = synthetic_folder(COMBINED_PHOTOS, 11)?;
    let config = LoaderConfig { batch_size: BATCH, num_workers: 2, shuffle: true, drop_last: true, ..LoaderConfig::default() };
    let loader = DataLoader::new(folder.all(Transforms::resize(RES as u32)), config).map_err(|e| text(&e))?;
    let net = Network::new(&ModelName::Resnet18.spec(folder.classes.len()), Shape::map(3, RES, RES), device, 0).map_err(|e| text(&e))?;
    let train = TrainConfig { precision: Precision::F16Amp, accumulation: 2, ..TrainConfig::default() };
    let mut trainer = Trainer::new(net, train).map_err(|e| text(&e))?;
    let batches: Vec<_> = loader.epoch(0).map(|b| b.and_then(|b| b.to_device(device))).collect::<Result<_, _>>().map_err(|e| text(&e))?;
    let steps: Vec<&[_]> = batches.chunks_exact(2).collect();
    let (last, earlier) = steps.split_last().ok_or_else(|| format!("{} batches: not enough for one step of 2", batches.len()))?;
    let mut losses = Vec::new();
    for micro_batches in earlier {
        let report = trainer.step(micro_batches, 0).map_err(|e| text(&e))?;
        losses.push(report.loss);
    }
    let (measured, comparison) = trainer.measure_and_compare(last).map_err(|e| text(&e))?;
    losses.push(measured.report.loss);
    if let Some(loss) = losses.iter().find(|l| !l.is_finite()) {
        return Err(format!("a step's loss was {loss}"));
    }
    let losses: Vec<String> = losses.iter().map(|l| format!("{l:.3}")).collect();
    let scale = measured.report.loss_scale.map_or(String::new(), |s| format!(", loss scale {s}"));
    let steps =
        format!("{} steps of 2 x {BATCH} from {} photos, 2 workers; loss {}{scale}", steps.len(), folder.items.len(), losses.join(", "));
    judge(&comparison).map(|figure| format!("{steps}; last step's {figure}")).map_err(|figure| format!("{steps}; last step's {figure}"))
}

/// A step of ResNet-18 on a simulated card that gives it `share` of the
/// ledger's predicted peak beyond what the process already holds: below 1 it
/// must fail with an out-of-memory error, above 1 it must run.
fn budget(device: &Device, share: f64) -> Result<String, String> {
    let spec = spec(TrainConfig::default());
    let config =
        StepConfig { levers: Levers { optimizer: spec.config.optimizer.kind(), ..Levers::default() }, ..StepConfig::training(BATCH, RES) };
    let host = Card::host().map_err(|e| e.to_string())?;
    let predicted = estimate(&spec.model.spec(spec.classes), &config, &host).map_err(|e| e.to_string())?.peak.bytes;
    let held = HostMemory::sample().in_use;
    let room = (predicted as f64 * share) as u64;
    crate::memory::set_budget(Some(Budget { usable: held + room, context: 0, workspace: 0 })).map_err(|e| e.to_string())?;
    let result = measure_train(&spec, device);
    crate::memory::set_budget(None).map_err(|e| e.to_string())?;
    crate::train::clear_last_step_oom();
    let expected = if share < 1.0 { "out of memory" } else { "the step to fit" };
    let figure = format!("{} of room for a predicted peak of {}: expected {expected}", human(room), human(predicted));
    match (result, share < 1.0) {
        (Err(error), true) if out_of_memory(&error) => Ok(format!("{figure}, got it")),
        (Ok(_), false) => Ok(format!("{figure}, it fit")),
        (Err(error), _) => Err(format!("{figure}; got: {error}")),
        (Ok((_, comparison)), true) => Err(format!("{figure}; the step ran, peak {}", human(comparison.measured_peak))),
    }
}

/// The pool's readings around one tensor of known size: used rises by it
/// and falls back once it is dropped, the high-water mark and the reserve
/// cover what is used, `empty_cache` never grows the reserve, and the driver's
/// free memory is within its total.
#[cfg(feature = "cuda")]
fn pool(device: &Device) -> Result<String, String> {
    use crate::memory::cuda::CudaProbe;
    const BYTES: u64 = 64 << 20;
    const SLACK: u64 = 2 << 20;
    let read = |e: crate::memory::MemoryError| e.to_string();
    let probe = CudaProbe::new(device).map_err(read)?;
    let before = probe.settled().map_err(read)?;
    let tensor = candle_core::Tensor::zeros(BYTES as usize / 4, candle_core::DType::F32, device).map_err(|e| e.to_string())?;
    let holding = probe.settled().map_err(read)?;
    drop(tensor);
    let after = probe.settled().map_err(read)?;
    let trimmed = probe.empty_cache().map_err(read)?;
    let rose = holding.used.saturating_sub(before.used);
    let fell = holding.used.saturating_sub(after.used);
    let mut wrong = Vec::new();
    if !(BYTES..=BYTES + SLACK).contains(&rose) {
        wrong.push(format!("used rose by {}", human(rose)));
    }
    if !(BYTES..=BYTES + SLACK).contains(&fell) {
        wrong.push(format!("used fell by {} once it was dropped", human(fell)));
    }
    if holding.used_high < holding.used || holding.reserved < holding.used {
        wrong.push(format!(
            "high-water {} and reserved {} below used {}",
            human(holding.used_high),
            human(holding.reserved),
            human(holding.used)
        ));
    }
    if trimmed.after.reserved > trimmed.before.reserved {
        wrong.push(format!("empty_cache grew reserved from {} to {}", human(trimmed.before.reserved), human(trimmed.after.reserved)));
    }
    if holding.free > holding.total {
        wrong.push(format!("free {} above total {}", human(holding.free), human(holding.total)));
    }
    let figure = format!(
        "used +{} then -{}; reserved {} while held; empty_cache gave back {}; context {}; {} free of {}",
        human(rose),
        human(fell),
        human(holding.reserved),
        human(trimmed.released()),
        human(holding.context),
        human(holding.free),
        human(holding.total)
    );
    if wrong.is_empty() {
        Ok(figure)
    } else {
        Err(format!("{}: {figure}", wrong.join("; ")))
    }
}

fn out_of_memory(error: &TrainError) -> bool {
    matches!(error, TrainError::OutOfMemory(_)) || is_out_of_memory(&error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_failed_check_fails_the_report_and_shows_its_figure() {
        let check = |name: &str, passed| SmokeCheck { name: name.to_owned(), passed, figure: format!("{name} figure"), seconds: 0.5 };
        let report = SmokeReport { device: "the CPU".into(), checks: vec![check("loader", true), check("step", false)] };
        assert!(!report.passed());
        let text = report.table().to_string();
        assert!(text.contains("1 of 2 passed") && text.contains("FAIL") && text.contains("step figure"), "{text}");
        assert!(SmokeReport { checks: vec![check("loader", true)], ..report }.passed());
    }
}
