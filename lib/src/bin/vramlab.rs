//! `vramlab`: the command-line twin of the `%summary` and `%oomcheck` magics,
//! and the data pipeline's commands (`synth`, `preprocess`, `train`, `bench loader`).

use std::process::ExitCode;

use clap::{Args, ColorChoice, Parser, Subcommand};
use serde::Serialize;
use vramlab::cli::{
    run_oomcheck, run_summary, BenchLoaderArgs, LearnArgs, MeasureArgs, OomcheckArgs, PreprocessArgs, SummaryArgs, SynthArgs, TrainRunArgs,
    TrainSetup, UsageError,
};
use vramlab::data::{bench_loader, preprocess};
use vramlab::learn::{fit_folder_on, fit_segmentation, LearnError, LearnReport, SegmentReport};
use vramlab::render::Render;
use vramlab::units::human;

// Every heap allocation of this process is counted, so that measurements
// made here are exact (vramlab::memory::HostMemory).
vramlab::install_allocation_counters!();

#[derive(Parser)]
#[command(name = "vramlab", version, color = ColorChoice::Never, about = "GPU memory in image training: the ledger, before anything runs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Per-layer shapes, parameters, saved-for-backward bytes and MACs of a zoo model
    Summary(WithJson<SummaryArgs>),
    /// Will a training step fit? The five bills, the peak, and ranked fixes
    Oomcheck(WithJson<OomcheckArgs>),
    /// Write the synthetic leaf-disease dataset (ImageFolder layout + manifest.csv), and its lesion masks with --masks
    Synth(WithJson<SynthArgs>),
    /// Resize an ImageFolder offline to a short side and save compressed JPEGs
    Preprocess(WithJson<PreprocessArgs>),
    /// Run real training steps: every bill predicted and measured, and both peaks
    Measure(WithJson<MeasureArgs>),
    /// Train a zoo model on an image folder through the loader: validation accuracy per class against the baselines
    Train(WithJson<LearnArgs>),
    /// Check that the loader, a training step with each lever and the memory readings work on this machine
    Smoke(WithJson<vramlab::cli::SmokeArgs>),
    /// Hold memory on a simulated card, as another program on the same GPU would, until stopped
    ///
    /// Every process that simulates a card of the same size is on the same card: a notebook's training
    /// step then has what this one holds (its CUDA context, cuDNN workspace and --bytes) the less, and
    /// the out-of-memory investigation names it. Prints one line once it holds the memory.
    Hold(vramlab::cli::HoldArgs),
    /// Check every op at the zoo's shapes, forward and each gradient, in f32 and f16, against a reference
    ///
    /// On the CPU the reference is candle's own composition of each op, computed in f32 from the same
    /// inputs; on CUDA it is our CPU implementation of the op in the same dtype. A tensor's error is
    /// max|a - b| / max|b| over its elements (b the reference), and passes within a tolerance per dtype
    /// (f32 1e-4, f16 5e-3), printed under the table. Exit status 1 when any check fails.
    CheckOps(WithJson<vramlab::cli::CheckOpsArgs>),
    /// Benchmarks on this machine
    #[command(subcommand)]
    Bench(Bench),
    /// Under `mpirun -np N`: check that N processes, each on its part of every batch, compute the
    /// weights one process computes on the whole batches
    ///
    /// Each process trains --steps on its --batch of the same synthetic batches (--cards N --batch B: N x B
    /// samples a step), then rank 0 trains alone on the whole batches and compares every weight.
    /// Exit status 1 when they differ by more than --tolerance.
    CheckDist(WithJson<vramlab::cli::CheckDistArgs>),
}

#[derive(Subcommand)]
enum Bench {
    /// Time real training steps of a zoo model on synthetic images (seconds, after warm-up)
    Train(WithJson<TrainRunArgs>),
    /// One pass of the data loader (decode, resize, flip, normalise): images/s
    Loader(WithJson<BenchLoaderArgs>),
    /// Host-to-device copies from pageable and page-locked memory (pin_memory): MB/s
    #[cfg(feature = "cuda")]
    H2d(WithJson<vramlab::cli::BenchH2dArgs>),
}

#[derive(Args)]
struct WithJson<T: Args> {
    #[command(flatten)]
    args: T,
    /// Print the result as JSON (every amount in bytes) instead of text
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    vramlab::memory::install();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            // Help and version go to stdout with success; usage errors to stderr.
            let _ = err.print();
            return if err.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    if let Command::Train(cmd) = &cli.command {
        if let (Some(_), Err(err)) = (&cmd.args.masks, cmd.args.levers.on_one_card("segmentation (--masks)")) {
            eprintln!("error: {err}");
            return ExitCode::from(2);
        }
    }
    let printed = match &cli.command {
        Command::Summary(cmd) => {
            run_summary(&cmd.args).and_then(|summary| emit(cmd.json, &summary, || summary.table(cmd.args.depth).to_string()))
        }
        Command::Oomcheck(cmd) => run_oomcheck(&cmd.args).and_then(|result| emit(cmd.json, &result, || result.bundle().text().to_owned())),
        Command::Measure(cmd) => match measure(&cmd.args) {
            Ok((comparison, None)) => emit(cmd.json, &comparison, || comparison.table().to_string()),
            Ok((comparison, Some(rank))) => emit_rank(cmd.json, rank, &comparison, || comparison.table().to_string()),
            Err(Measured::OutOfMemory(error)) => return out_of_memory(&error, cmd.json),
            Err(Measured::Usage(error)) => Err(error),
        },
        Command::Smoke(cmd) => return smoke(&cmd.args, cmd.json),
        Command::Hold(args) => hold(args),
        Command::CheckOps(cmd) => return check_ops(&cmd.args, cmd.json),
        Command::Bench(Bench::Train(cmd)) => bench_train(&cmd.args).and_then(|(report, rank)| match rank {
            None => emit(cmd.json, &report, || report_text(&report)),
            Some(rank) => emit_rank(cmd.json, rank, &report, || report_text(&report)),
        }),
        Command::CheckDist(cmd) => return check_dist(&cmd.args, cmd.json),
        Command::Synth(cmd) => data_error(cmd.args.run()).and_then(|written| emit(cmd.json, &written, || written.text(&cmd.args))),
        Command::Preprocess(cmd) => {
            let a = &cmd.args;
            data_error(preprocess(&a.src, &a.out, a.short_side, a.quality))
                .and_then(|report| emit(cmd.json, &report, || report.bundle().text().to_owned()))
        }
        Command::Train(cmd) => match &cmd.args.masks {
            Some(masks) => segment(&cmd.args, masks)
                .map_err(|e| UsageError(e.to_string()))
                .and_then(|report| emit(cmd.json, &report, || format!("{}\n{}", report.epoch_table(), report.table()))),
            None => train(&cmd.args).and_then(|report| match report {
                Some(report) => emit(cmd.json, &report, || format!("{}\n{}", report.epoch_table(), report.table())),
                None => Ok(()),
            }),
        },
        Command::Bench(Bench::Loader(cmd)) => data_error(bench_loader(&cmd.args.root, &cmd.args.config()))
            .and_then(|result| emit(cmd.json, &result, || result.bundle().text().to_owned())),
        #[cfg(feature = "cuda")]
        Command::Bench(Bench::H2d(cmd)) => bench_h2d(&cmd.args).and_then(|result| {
            emit(cmd.json, &result, || {
                format!(
                    "host-to-device, {} MB per copy, median of {}: pageable {:.0} MB/s, page-locked {:.0} MB/s ({:.2}x), \
                     staged through page-locked (the loader's pin_memory) {:.0} MB/s\n",
                    result.bytes as f64 / 1e6,
                    result.repeats,
                    result.pageable_mb_per_s,
                    result.pinned_mb_per_s,
                    result.pinned_mb_per_s / result.pageable_mb_per_s,
                    result.staged_mb_per_s
                )
            })
        }),
    };
    match printed {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::from(2)
        }
    }
}

#[cfg(feature = "cuda")]
fn bench_h2d(args: &vramlab::cli::BenchH2dArgs) -> Result<vramlab::data::H2dBench, UsageError> {
    let device = vramlab::candle::Device::new_cuda(args.device).map_err(|e| UsageError(format!("CUDA device {}: {e}", args.device)))?;
    data_error(vramlab::data::bench_h2d(&device, (args.mib << 20) as usize, args.repeats as usize))
}

fn data_error<T>(result: Result<T, vramlab::data::DataError>) -> Result<T, UsageError> {
    result.map_err(|e| UsageError(e.to_string()))
}

/// Trains with a progress bar on stderr. Under `mpirun` with `--cards N`,
/// the N processes train together and rank 0 alone shows the progress and
/// the report (`None` on the others).
fn train(args: &LearnArgs) -> Result<Option<LearnReport>, UsageError> {
    let learn = |e: &dyn std::fmt::Display| UsageError(e.to_string());
    let config = args.config();
    let (collective, kept) = if config.cards.several() { start_mpi().map(|(c, k)| (Some(c), Some(k)))? } else { (None, None) };
    if let Some(launched) = kept.as_ref().map(|k| k.ranks()).filter(|&n| n != config.cards.count) {
        return Err(learn(&vramlab::dist::DistError::Ranks { cards: config.cards.count, launched }));
    }
    let first = kept.as_ref().is_none_or(|k| k.rank() == 0);
    let (folder, split) = args.open().map_err(|e| learn(&e))?;
    let steps = args.epochs * (split.train.len().div_ceil(config.cards.count) / args.batch);
    let mut progress = first.then(|| vramlab::train::ProgressView::new(format!("train {}", args.model.as_str()), steps as u64));
    let mut show = |event: &vramlab::train::TrainEvent| {
        if let Some(progress) = &mut progress {
            progress.on_event(event);
        }
    };
    let report = fit_folder_on(&folder, &split, &config, &vramlab::candle::Device::Cpu, collective, &mut show).map_err(|e| learn(&e))?;
    if let Some(mut progress) = progress {
        progress.finish();
    }
    Ok(first.then_some(report))
}

fn segment(args: &LearnArgs, masks: &std::path::Path) -> Result<SegmentReport, LearnError> {
    let (folder, split) = args.open_segmentation(masks)?;
    let steps = args.epochs * (split.train.len() / args.batch);
    let mut progress = vramlab::train::ProgressView::new(format!("train {}", args.model.as_str()), steps as u64);
    let report = fit_segmentation(&folder, &split, &args.config(), &vramlab::candle::Device::Cpu, &mut |event| progress.on_event(event));
    progress.finish();
    report
}

fn emit<T: Serialize>(json: bool, value: &T, text: impl FnOnce() -> String) -> Result<(), UsageError> {
    if json {
        let out = serde_json::to_string_pretty(value).map_err(|e| UsageError(format!("cannot write JSON: {e}")))?;
        println!("{out}");
    } else {
        print!("{}", text());
    }
    Ok(())
}

fn spec(setup: &TrainSetup, warmup: usize, steps: usize) -> vramlab::train::BenchSpec {
    vramlab::train::BenchSpec {
        model: setup.model,
        classes: setup.classes(),
        batch: setup.batch,
        res: setup.res,
        config: setup.train_config(),
        layers: setup.levers().layers,
        warmup,
        steps,
        seed: setup.seed,
    }
}

/// This process among those `mpirun` started: a handle on their
/// collective, kept beside the trainer's to gather the reports.
struct Rank {
    collective: Box<dyn vramlab::dist::Collective>,
}

/// Two handles on the processes' collective: the trainer's, and one kept
/// to gather their reports.
type Handles = (Box<dyn vramlab::dist::Collective>, Box<dyn vramlab::dist::Collective>);

/// The processes `setup`'s step is spread over, under `mpirun`: on the host
/// through MPI, on cards through NCCL; `None` on one card.
fn spread(setup: &TrainSetup, device: &vramlab::candle::Device) -> Result<Option<(vramlab::train::Spread, Rank)>, UsageError> {
    let cards = setup.levers().cards;
    if !cards.several() {
        return setup.levers.on_one_card("one card").map(|()| None).map_err(UsageError);
    }
    let (collective, kept) = if device.is_cpu() { start_mpi()? } else { start_nccl(device)? };
    Ok(Some((vramlab::train::Spread { cards, collective }, Rank { collective: kept })))
}

/// NCCL on this process's card, its communicator's id handed out over MPI,
/// which gathers the reports.
#[cfg(all(feature = "mpi", feature = "nccl"))]
fn start_nccl(device: &vramlab::candle::Device) -> Result<Handles, UsageError> {
    use vramlab::dist::{Collective as _, Mpi, Nccl};
    let usage = |e: vramlab::dist::DistError| UsageError(e.to_string());
    let vramlab::candle::Device::Cuda(card) = device else {
        return Err(UsageError("NCCL runs on CUDA devices".to_owned()));
    };
    let mpi = Mpi::start().map_err(usage)?;
    let id = if mpi.rank() == 0 { Nccl::id_bytes(&Nccl::new_id().map_err(usage)?) } else { Vec::new() };
    let ids = mpi.all_gather_bytes(&id).map_err(usage)?;
    let nccl = Nccl::join(card, mpi.rank(), mpi.ranks(), Nccl::id_from_bytes(&ids[0]).map_err(usage)?).map_err(usage)?;
    Ok((Box::new(nccl), Box::new(mpi)))
}

#[cfg(not(all(feature = "mpi", feature = "nccl")))]
fn start_nccl(_: &vramlab::candle::Device) -> Result<Handles, UsageError> {
    Err(UsageError(
        "several cards run under mpirun through NCCL, and this vramlab was built without it: scripts/build_cuda.sh --features mpi,nccl"
            .to_owned(),
    ))
}

/// Two handles on one MPI world: one for the trainer, one to keep.
#[cfg(feature = "mpi")]
fn start_mpi() -> Result<Handles, UsageError> {
    let mpi = vramlab::dist::Mpi::start().map_err(|e| UsageError(e.to_string()))?;
    Ok((Box::new(mpi.clone()), Box::new(mpi)))
}

#[cfg(not(feature = "mpi"))]
fn start_mpi() -> Result<Handles, UsageError> {
    Err(UsageError("several cards run under MPI, and this vramlab was built without it: cargo build --release --features mpi".to_owned()))
}

fn bench_train(args: &TrainRunArgs) -> Result<(vramlab::train::BenchReport, Option<Rank>), UsageError> {
    let device = args.setup.device.open().map_err(UsageError)?;
    let (spread, rank) = spread(&args.setup, &device)?.unzip();
    let report = vramlab::train::bench_train_over(&spec(&args.setup, args.warmup, args.steps), &device, spread);
    report.map(|report| (report, rank)).map_err(|e| UsageError(e.to_string()))
}

/// Under `mpirun`: every rank's result printed by rank 0, in rank order,
/// each after a line naming its rank, or as one line of JSON with the rank
/// and its process id beside it. (Printed by each rank, two long lines
/// could interleave in `mpirun`'s output.)
fn emit_rank<T: Serialize>(json: bool, rank: Rank, value: &T, text: impl FnOnce() -> String) -> Result<(), UsageError> {
    let collective = rank.collective;
    let (rank, ranks) = (collective.rank(), collective.ranks());
    let out = if json {
        let line = serde_json::json!({ "rank": rank, "ranks": ranks, "pid": std::process::id(), "result": value });
        serde_json::to_string(&line).map_err(|e| UsageError(format!("cannot write JSON: {e}")))? + "\n"
    } else {
        format!("rank {rank} of {ranks}:\n{}", text())
    };
    let every = collective.all_gather_bytes(out.as_bytes()).map_err(|e| UsageError(e.to_string()))?;
    if rank != 0 {
        return Ok(());
    }
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    every
        .iter()
        .try_for_each(|report| stdout.write_all(report))
        .and_then(|()| stdout.flush())
        .map_err(|e| UsageError(format!("cannot write: {e}")))
}

/// Exit status 0 when the spread weights match one process's, 1 when not,
/// 2 on a usage error.
fn check_dist(args: &vramlab::cli::CheckDistArgs, json: bool) -> ExitCode {
    let usage = |err: &dyn std::fmt::Display| {
        eprintln!("error: {err}");
        ExitCode::from(2)
    };
    let cards = args.setup.levers().cards;
    if !cards.several() || args.setup.device != vramlab::cli::DeviceArg::Cpu {
        return usage(&"check-dist runs on the host with --cards 2 or more, under mpirun -np N");
    }
    let collective = match start_mpi() {
        Ok((collective, _)) => collective,
        Err(err) => return usage(&err),
    };
    let spec = spec(&args.setup, 0, args.steps);
    match vramlab::checks::same_step(&spec, cards, collective, args.steps, args.tolerance) {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(found)) => {
            if let Err(err) = emit(json, &found, || format!("{}\n", found.line())) {
                return usage(&err);
            }
            if found.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(err) => usage(&err),
    }
}

enum Measured {
    Usage(UsageError),
    OutOfMemory(String),
}

/// Holds `--bytes` (written, so that they are resident) on the simulated card until the time is up.
fn hold(args: &vramlab::cli::HoldArgs) -> Result<(), UsageError> {
    let usage = |e: &dyn std::fmt::Display| UsageError(e.to_string());
    let budget = vramlab::memory::Budget::parse(&args.card).map_err(|e| usage(&e))?;
    // Started from a notebook, it ends with the notebook's process rather than holding the card for its full time.
    // SAFETY: prctl with PR_SET_PDEATHSIG reads only its integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
    let held = vec![1u8; args.bytes as usize];
    vramlab::memory::set_budget(Some(budget)).map_err(|e| usage(&e))?;
    println!(
        "pid {} holds {} on the simulated {} card: {} CUDA context, {} cuDNN workspace and {} of tensors, for {} s",
        std::process::id(),
        human(budget.held_by_card() + args.bytes),
        human(budget.usable),
        human(budget.context),
        human(budget.workspace),
        human(args.bytes),
        args.seconds
    );
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    std::thread::sleep(std::time::Duration::from_secs(args.seconds));
    drop(held);
    vramlab::memory::set_budget(None).map_err(|e| usage(&e))
}

fn measure(args: &MeasureArgs) -> Result<(vramlab::train::Comparison, Option<Rank>), Measured> {
    let usage = |e: &dyn std::fmt::Display| Measured::Usage(UsageError(e.to_string()));
    if args.budget.is_some() && args.setup.device != vramlab::cli::DeviceArg::Cpu {
        return Err(usage(&"--budget simulates a card on the CPU; on a GPU the card's own memory is the budget"));
    }
    let device = args.setup.device.open().map_err(|e| usage(&e))?;
    if let Some(budget) = &args.budget {
        let budget = vramlab::memory::Budget::parse(budget).map_err(|e| usage(&e))?;
        vramlab::memory::set_budget(Some(budget)).map_err(|e| usage(&e))?;
    }
    let (spread, rank) = spread(&args.setup, &device).map_err(Measured::Usage)?.unzip();
    let measured = vramlab::train::measure_train_over(&spec(&args.setup, args.warmup, 1), &device, spread);
    measured.map(|(_, comparison)| (comparison, rank)).map_err(|e| match e {
        vramlab::train::TrainError::OutOfMemory(_) => Measured::OutOfMemory(e.to_string()),
        e if vramlab::train::is_out_of_memory(&e.to_string()) => Measured::OutOfMemory(e.to_string()),
        e => usage(&e),
    })
}

/// The checks' table (or JSON); exit status 1 when any failed, 2 when the
/// device cannot be opened.
fn smoke(args: &vramlab::cli::SmokeArgs, json: bool) -> ExitCode {
    let device = match args.device.open() {
        Ok(device) => device,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::from(2);
        }
    };
    let report = vramlab::smoke::smoke(&device);
    if let Err(err) = emit(json, &report, || report.table().to_string()) {
        eprintln!("error: {err}");
        return ExitCode::from(2);
    }
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The checks' table (or JSON) and its summary; exit status 1 when any
/// failed, 2 when the device cannot be opened or a size is out of range.
fn check_ops(args: &vramlab::cli::CheckOpsArgs, json: bool) -> ExitCode {
    let usage = |err: &dyn std::fmt::Display| {
        eprintln!("error: {err}");
        ExitCode::from(2)
    };
    let target = match args.device.target() {
        Ok(target) => target,
        Err(err) => return usage(&err),
    };
    let report = match vramlab::checks::check_ops(&target, &args.options()) {
        Ok(report) => report,
        Err(err) => return usage(&err),
    };
    if let Err(err) = emit(json, &report, || report.table().to_string()) {
        return usage(&err);
    }
    if report.all_passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The step ran out of memory: the error, then the investigation, as text
/// or JSON; exit status 1 (2 is for usage errors).
fn out_of_memory(error: &str, json: bool) -> ExitCode {
    eprintln!("error: {error}");
    let diagnosis = vramlab::diagnose::diagnose(error, &vramlab::diagnose::Limits::default());
    let printed = emit(json, &serde_json::json!({ "error": error, "oom": diagnosis }), || diagnosis.to_string());
    if let Err(err) = printed {
        eprintln!("error: {err}");
    }
    ExitCode::from(1)
}

fn report_text(report: &vramlab::train::BenchReport) -> String {
    let mut text = format!(
        "{} batch {} at {}x{}, {}, {}, accumulation {}, checkpointing {}: median step {:.3} s ({:.1} images/s, {} threads)\n",
        report.model,
        report.batch,
        report.res,
        report.res,
        report.precision,
        report.optimizer,
        report.accumulation,
        report.checkpointing,
        report.median_seconds,
        report.images_per_second,
        report.threads,
    );
    if let Some(peak) = report.peak_bytes {
        text.push_str(&format!("peak in use during a step: {}\n", vramlab::units::human(peak)));
    }
    text
}
