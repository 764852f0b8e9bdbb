//! `--device cpu|cuda` of `smoke`, `measure` and `bench train`, and
//! `vramlab smoke`'s arguments.

use clap::{Parser, ValueEnum};

use crate::candle::Device;

/// Where a command's training steps run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum DeviceArg {
    #[default]
    Cpu,
    /// CUDA device 0, or under mpirun the process's rank on its machine (needs a build with the cuda feature)
    Cuda,
}

impl DeviceArg {
    /// The candle device, or why it cannot be had here.
    pub fn open(self) -> Result<Device, String> {
        let ordinal = local_rank();
        match self {
            DeviceArg::Cpu => Ok(Device::Cpu),
            DeviceArg::Cuda if !cfg!(feature = "cuda") => Err(format!(
                "CUDA device {ordinal}: this vramlab was built without the cuda feature (scripts/build_cuda.sh builds one with it)"
            )),
            DeviceArg::Cuda => Device::new_cuda(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e}")),
        }
    }
}

/// This process's rank among those `mpirun` started on this machine (Open
/// MPI's and MPICH's variables), 0 outside mpirun: one card a process.
fn local_rank() -> usize {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"].iter().find_map(|name| std::env::var(name).ok()?.parse().ok()).unwrap_or(0)
}

/// Checks that everything a project needs works on this machine
#[derive(Debug, Clone, Parser)]
#[command(name = "smoke", about = "Check the loader, a training step with each lever and the device's memory readings on this machine")]
pub struct SmokeArgs {
    /// Where the training steps run (cuda needs a build with the cuda feature)
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
}

/// `vramlab hold`: another program on a simulated card
#[derive(Debug, Clone, Parser)]
#[command(name = "hold", about = "Hold memory on a simulated card, as another program on the same GPU would, until stopped")]
pub struct HoldArgs {
    /// The simulated card, as a notebook's `cpu_with_budget` names it (rtx4060-laptop, 700MiB)
    #[arg(long)]
    pub card: String,
    /// Tensor bytes to hold besides the CUDA context and cuDNN workspace every process pays (0, 200MiB)
    #[arg(long, value_parser = bytes_or_none, default_value = "0MiB")]
    pub bytes: u64,
    /// Seconds to hold it before ending by itself
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub seconds: u64,
}

/// A size, or none at all (`0`, `0MiB`).
fn bytes_or_none(text: &str) -> Result<u64, String> {
    let number = text.trim().trim_end_matches(|c: char| c.is_ascii_alphabetic()).trim();
    if number.parse::<f64>().is_ok_and(|n| n == 0.0) {
        return Ok(0);
    }
    crate::units::parse_bytes(text).map_err(|e| e.to_string())
}
