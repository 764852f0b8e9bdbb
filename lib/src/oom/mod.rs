//! Will it fit? The fit check, ranked fixes, and sweeps.

mod fit;
mod fixes;
mod host;
mod sweep;

pub use fit::{check, target_bytes, verdict, FitReport, Verdict, COMFORT};
pub use fixes::{search, Fix, FixCost, FixKind, Risk};
pub use host::{host_check, HostReport, HOST_SHARE_LIMIT};
pub use sweep::{sweep, Axis, Sweep, SweepParseError, SweepPoint, SweepSpec};

#[cfg(test)]
mod tests;
