//! `vramlab smoke [--device cpu|cuda]`

use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SmokeDevice {
    Cpu,
    Cuda,
}

/// Checks that everything a project needs works on this machine
#[derive(Debug, Clone, Parser)]
#[command(name = "smoke", about = "Check the loader, a training step with each lever and the simulated budget on this machine")]
pub struct SmokeArgs {
    /// Where the training steps run (cuda needs a build with the cuda feature)
    #[arg(long, value_enum, default_value_t = SmokeDevice::Cpu)]
    pub device: SmokeDevice,
}
