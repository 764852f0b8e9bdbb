//! `vramlab check-ops`: every op of [`crate::ops`] at the zoo models' shapes
//! and the optimizers' updates, on a target (the CPU, the device passes on
//! the reference primitives, a device) against a reference; and `vramlab
//! check-dist`, a step spread over processes against one process's. It
//! sits above the ops and the trainer it checks; neither imports it.
//!
//! # The room
//!
//! `vramlab check-ops`, above the ops and the trainer it checks (neither imports it): every op at
//! the zoo's shapes, forward and each gradient, f32 and f16, against candle's composition on the
//! CPU, and against our CPU ops on the reference primitives and on CUDA (`ops.rs`); the optimizers'
//! updates against the CPU's fused ones (`updates.rs`); a step spread over processes against one
//! process's on the same samples (`dist.rs`).

mod dist;
mod ops;
mod updates;

pub use dist::{same_step, SameStep};
pub use ops::{
    check_every_op, normalised_error, tolerance, Check, CheckError, CheckOptions, CheckTarget, CheckedDtype, OpsReport, Pass, Tolerance,
};
pub use updates::check_updates;

/// Every op's checks in `options.dtypes`, and, where f32 is among them, the
/// optimizers' updates (f32 master weights).
pub fn check_ops(target: &CheckTarget, options: &CheckOptions) -> Result<OpsReport, CheckError> {
    let mut report = check_every_op(target, options)?;
    if options.dtypes.contains(&CheckedDtype::F32) {
        report.add(check_updates(target));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The multi-tensor updates' twins run on the reference, with the ops'
    /// device passes, and agree with the CPU's fused updates.
    #[test]
    fn the_reference_checks_the_optimizers_updates_too() {
        let options = CheckOptions { batch: 2, res: CheckOptions::MIN_RES, dtypes: vec![CheckedDtype::F32] };
        let report = check_ops(&CheckTarget::Reference, &options).unwrap();
        let updates: Vec<&Check> = report.checks.iter().filter(|c| c.pass == Pass::Step).collect();
        assert_eq!(updates.len(), 4);
        assert!(updates.iter().all(|c| c.ok), "{updates:#?}");
        let on_cpu = check_ops(&CheckTarget::Cpu, &options).unwrap();
        assert_eq!(report.checks.len(), on_cpu.checks.len(), "the same checks as on the CPU");
    }

    #[test]
    fn no_update_is_checked_without_f32() {
        let options = CheckOptions { batch: 2, res: CheckOptions::MIN_RES, dtypes: vec![CheckedDtype::F16] };
        let report = check_ops(&CheckTarget::Cpu, &options).unwrap();
        assert!(report.checks.iter().all(|c| c.pass != Pass::Step));
    }
}
