//! Will it fit? The fit check, ranked fixes, and sweeps.

mod check;
mod fixes;
mod host;
mod sweep;
mod verdict;

pub use check::{check, CheckReport, Sharding};
pub(crate) use fixes::bn_risk;
pub use fixes::{search, Fix, FixCost, FixKind, Risk};
pub use host::{host_check, HostReport, HOST_SHARE_LIMIT};
pub use sweep::{sweep, Axis, Sweep, SweepParseError, SweepPoint, SweepSpec};
pub use verdict::{target_bytes, verdict, Verdict, COMFORT};

#[cfg(test)]
mod tests;
