//! `vramlab check-ops`'s arguments.

use clap::{Parser, ValueEnum};

use super::DeviceArg;
use crate::checks::{CheckOptions, CheckTarget, CheckedDtype};

/// Where `check-ops` runs the ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum CheckDevice {
    /// Our CPU kernels, against candle's composed ops in f32
    #[default]
    Cpu,
    /// The ops' CUDA passes on the reference primitives (cuDNN's calls computed on the host), against our CPU kernels
    Reference,
    /// The ops' CUDA passes on cuDNN (a build with the cuda feature), against our CPU kernels
    Cuda,
}

impl CheckDevice {
    /// The check's target, or why it cannot run here.
    pub fn target(self) -> Result<CheckTarget, String> {
        match self {
            CheckDevice::Cpu => Ok(CheckTarget::Cpu),
            CheckDevice::Reference => Ok(CheckTarget::Reference),
            CheckDevice::Cuda => DeviceArg::Cuda.open().map(CheckTarget::Device),
        }
    }
}

/// The dtypes `check-ops` runs the ops in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum CheckDtypes {
    F32,
    F16,
    /// f32, then f16
    #[default]
    All,
}

impl CheckDtypes {
    pub fn dtypes(self) -> Vec<CheckedDtype> {
        match self {
            CheckDtypes::F32 => vec![CheckedDtype::F32],
            CheckDtypes::F16 => vec![CheckedDtype::F16],
            CheckDtypes::All => CheckedDtype::ALL.to_vec(),
        }
    }
}

/// Checks every op at the zoo's shapes against a reference
#[derive(Debug, Clone, Parser)]
#[command(name = "check-ops", about = "Check every op at the zoo's shapes, forward and each gradient, against a reference")]
pub struct CheckOpsArgs {
    /// Where the ops run
    #[arg(long, value_enum, default_value_t = CheckDevice::Cpu)]
    pub device: CheckDevice,
    /// Images per batch (2 to 8)
    #[arg(long, default_value_t = CheckOptions::DEFAULT_BATCH)]
    pub batch: usize,
    /// Input side the zoo's spatial sizes are scaled from: 224 gives the models' own (32 to 224)
    #[arg(long, default_value_t = CheckOptions::DEFAULT_RES)]
    pub res: usize,
    /// The dtypes the ops run in
    #[arg(long, value_enum, default_value_t = CheckDtypes::All)]
    pub dtype: CheckDtypes,
}

impl CheckOpsArgs {
    pub fn options(&self) -> CheckOptions {
        CheckOptions { batch: self.batch, res: self.res, dtypes: self.dtype.dtypes() }
    }
}
