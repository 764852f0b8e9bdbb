use vramlab::cli::{parse, MemArgs, UsageError};
use vramlab::memory::plot;
use vramlab::render::{Bundle, Composer, Render};

use super::{Context, Invocation, Kind, Magic};

pub const MAGIC: Magic = Magic {
    name: "mem",
    kind: Kind::Line,
    summary: "the cell process's memory: in use, held, peak, RSS, free/total, bills predicted vs measured; %%mem measures a cell",
    usage: "%mem [--reset-peak] [--empty-cache] [--plot | --brief]  |  %mem --last-cell  |  %mem --processes\n\
            %%mem   (first line of a cell: run the cell, then show its peak and net change)",
    run,
};

/// The Rust part of a `%%mem` cell, with the magic line that reports on it.
pub const CELL_REPORT: &str = "--last-cell";

/// `%mem`, read from the cell process's counters without running a cell.
fn run(context: &Context<'_>, argv: &[String]) -> Result<Invocation, String> {
    let args = match parse::<MemArgs>("%mem", argv).map_err(|UsageError(e)| e)? {
        Ok(args) => args,
        Err(help) => return Ok(Invocation::Show(Bundle::plain(help))),
    };
    if args.processes {
        return Ok(Invocation::Show(vramlab::memory::processes().bundle()));
    }
    let probe = context.probe.ok_or("this kernel could not set up its memory counters (see its log)")?;
    if args.last_cell {
        let usage = probe.last_cell().ok_or("no cell measured yet (or the cell process restarted during it)")?;
        return Ok(Invocation::Show(usage.bundle()));
    }
    let report = probe.report(args.reset_peak, args.empty_cache).map_err(|e| e.to_string())?;
    let bundle = if args.plot {
        Composer::new().part(&report.bundle()).part(&plot(report.snapshot.as_ref())).finish()
    } else if args.brief {
        Bundle::plain(report.brief())
    } else {
        report.bundle()
    };
    Ok(Invocation::Show(bundle))
}

#[cfg(test)]
mod tests {
    use vramlab::memory::CellProbe;

    use super::*;

    #[test]
    fn bad_arguments_are_a_short_usage_error() {
        let err = run(&Context::default(), &["--bogus".into()]).unwrap_err();
        assert!(err.contains("--bogus") && err.lines().count() <= 6 && !err.contains("panicked"), "{err}");
        let err = run(&Context::default(), &["--last-cell".into(), "--plot".into()]).unwrap_err();
        assert!(err.contains("cannot be used with"), "{err}");
        let Ok(Invocation::Show(help)) = run(&Context::default(), &["--help".into()]) else { panic!("expected help") };
        assert!(help.text().contains("--empty-cache") && help.text().contains("--brief"));
        let err = run(&Context::default(), &["--brief".into(), "--plot".into()]).unwrap_err();
        assert!(err.contains("cannot be used with"), "{err}");
    }

    #[test]
    fn without_counters_it_says_so() {
        let err = run(&Context::default(), &[]).unwrap_err();
        assert!(err.contains("could not set up its memory counters"), "{err}");
    }

    #[test]
    fn a_probe_whose_process_has_not_started_says_so() {
        let probe = CellProbe::create().unwrap();
        let context = Context { probe: Some(&probe), ..Context::default() };
        assert!(run(&context, &[]).unwrap_err().contains("has not started"));
        assert!(run(&context, &["--last-cell".into()]).unwrap_err().contains("no cell measured yet"));
    }
}
