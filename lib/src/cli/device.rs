//! `--device cpu|cuda` of `smoke`, `measure` and `bench train`, and
//! `vramlab smoke`'s arguments.

use clap::{Parser, ValueEnum};

use crate::candle::Device;

/// Where a command's training steps run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum DeviceArg {
    #[default]
    Cpu,
    /// CUDA device 0 (needs a build with the cuda feature)
    Cuda,
}

impl DeviceArg {
    /// The candle device, or why it cannot be had here.
    pub fn open(self) -> Result<Device, String> {
        match self {
            DeviceArg::Cpu => Ok(Device::Cpu),
            DeviceArg::Cuda if !cfg!(feature = "cuda") => {
                Err("CUDA device 0: this vramlab was built without the cuda feature (scripts/build_cuda.sh builds one with it)".into())
            }
            DeviceArg::Cuda => Device::new_cuda(0).map_err(|e| format!("CUDA device 0: {e}")),
        }
    }
}

/// Checks that everything a project needs works on this machine
#[derive(Debug, Clone, Parser)]
#[command(name = "smoke", about = "Check the loader, a training step with each lever and the device's memory readings on this machine")]
pub struct SmokeArgs {
    /// Where the training steps run (cuda needs a build with the cuda feature)
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
}
