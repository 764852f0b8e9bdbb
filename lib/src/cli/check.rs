//! `vramlab check-ops`'s arguments.

use clap::{Parser, ValueEnum};

use super::DeviceArg;
use crate::ops::check::{CheckOptions, CheckedDtype};

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
    /// Where the ops run: on cpu they are compared with candle's composed ops in f32, on cuda (a build with the cuda feature) with ours on the CPU
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
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
