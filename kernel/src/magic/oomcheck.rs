use vramlab::cli::{parse, OomcheckModuleArgs, OomcheckOfArgs, UsageError};
use vramlab::render::Bundle;

use super::{Context, Invocation, Kind, Magic};

pub const MAGIC: Magic = Magic {
    name: "oomcheck",
    kind: Kind::Line,
    summary: "will this training step fit on this GPU? the five bills, the peak, and ranked fixes",
    usage: "%oomcheck MODEL --batch B --res R [--channels C] [--amp f16|bf16] [--opt adam|adamw|sgd|sgd-momentum|adam8bit]\n\
            \x20         [--accum N] [--ckpt none|stages|layer3,layer4] [--layers lean|plain] [--gpu NAME|8GiB|cpu]\n\
            \x20         [--cards N [--shard none|optimizer|gradients|parameters] [--bucket-mb 25] [--sync-bn]]\n\
            \x20         [--sweep batch=8..64|res=128..512 | --brief | --fixes]\n\
            \x20         [--classes N] [--eval] [--workers W [--prefetch P] [--source WxH] [--host-ram 32GiB] [--host]]\n\
            %oomcheck --spec FILE.json --batch B --res R [the same flags]   (a model spec saved as JSON)\n\
            %oomcheck VARIABLE --batch B [--res R] [--amp ...] [--opt ...] [--accum N] [--ckpt ...] [--layers ...] [--gpu ...] [--cards ...] [--sweep ...|--brief|--fixes] [--eval]\n\
            \x20         (a Network or Trainer built in a cell: its spec, input and levers unless a flag overrides one)\n\
            %oomcheck VARIABLE --input SHAPE [--gpu ...] [--opt ...]   (any model, measured in real steps at small batches and\n\
            \x20         extrapolated: a Network, a Trainer, a candle Module or a closure; SHAPE such as 32x3x224x224 or 64x784)\n\
            %oomcheck --last-error   (the investigation of the cell process's last out-of-memory error, again)",
    run,
};

/// `--last-error` asks the cell process, where the failed step's record is,
/// and so does a cell's variable, where it lives (its flags checked here
/// first, so that a bad one stops before anything compiles); a zoo model or
/// a spec file is a configuration, judged here.
fn run(context: &Context<'_>, args: &[String]) -> Result<Invocation, String> {
    match args {
        [only] if only == LAST_ERROR => Ok(Invocation::Evaluate("vramlab::diagnose::last_error()?".to_owned())),
        _ if args.iter().any(|a| a == LAST_ERROR) => Err(format!("{LAST_ERROR} takes no other argument")),
        [target, rest @ ..] if !target.starts_with('-') && super::means_a_variable(context, target, rest, true, false)? => {
            let help = if super::asks_for_input(rest) {
                parse::<OomcheckModuleArgs>("%oomcheck VARIABLE", rest).map_err(|UsageError(e)| e)?.err()
            } else {
                parse::<OomcheckOfArgs>("%oomcheck VARIABLE", rest).map_err(|UsageError(e)| e)?.err()
            };
            if let Some(help) = help {
                return Ok(Invocation::Show(Bundle::plain(help)));
            }
            Ok(Invocation::Evaluate(super::of_variable(target, "vramlab_oomcheck", rest)))
        }
        _ => vramlab::cli::oomcheck(args).map(Invocation::Show).map_err(|e| e.0),
    }
}

const LAST_ERROR: &str = "--last-error";

#[cfg(test)]
mod tests {
    use super::*;

    /// The usage is what `%help oomcheck` and every usage error show: it
    /// must name each flag the parser takes, and none it does not.
    #[test]
    fn the_usage_names_every_flag_of_the_parser_and_no_other() {
        use clap::CommandFactory;
        let command = vramlab::cli::OomcheckArgs::command();
        let measured = vramlab::cli::OomcheckModuleArgs::command();
        let mut accepted: Vec<String> = command
            .get_arguments()
            .chain(measured.get_arguments())
            .filter_map(|a| a.get_long())
            .filter(|long| !matches!(*long, "help" | "version"))
            .map(|long| format!("--{long}"))
            .collect();
        accepted.sort();
        accepted.dedup();
        let mut listed: Vec<String> = MAGIC
            .usage
            .split_whitespace()
            .map(|word| word.trim_start_matches('[').trim_end_matches(']'))
            .filter(|word| word.starts_with("--") && *word != LAST_ERROR)
            .map(String::from)
            .collect();
        accepted.sort();
        listed.sort();
        listed.dedup();
        assert_eq!(listed, accepted);
        for positional in command.get_positionals() {
            assert!(MAGIC.usage.contains(&positional.get_id().as_str().to_uppercase()), "{}", positional.get_id());
        }
    }

    #[test]
    fn a_variable_becomes_a_cell_and_bad_flags_stop_before_compiling() {
        let argv: Vec<String> = ["net", "--batch", "512", "--gpu", "rtx4060-laptop"].map(String::from).into();
        assert_eq!(
            (MAGIC.run)(&Context::default(), &argv),
            Ok(Invocation::Evaluate(
                r#"({ use vramlab::cli::{ByModule as _, ByNothing as _, BySpec as _}; (&&vramlab::cli::Target(&net, "net")).vramlab_oomcheck(&["--batch", "512", "--gpu", "rtx4060-laptop"]) })?"#.into()
            ))
        );
        let err =
            (MAGIC.run)(&Context::default(), &["mine".into(), "--input".into(), "32x3x224x224".into(), "--gpu".into(), "rtx4091".into()])
                .unwrap_err();
        assert!(err.contains("rtx4090"), "{err}");
        let err = (MAGIC.run)(&Context::default(), &["mine".into(), "--input".into(), "8x3x32x32".into(), "--batch".into(), "8".into()])
            .unwrap_err();
        assert!(err.contains("--batch"), "the batch is the input's first dimension: {err}");
        let err = (MAGIC.run)(&Context::default(), &["net".into(), "--batch".into(), "0".into()]).unwrap_err();
        assert!(err.contains("--batch"), "{err}");
        let err = (MAGIC.run)(&Context::default(), &["net".into(), "--classes".into(), "10".into()]).unwrap_err();
        assert!(err.contains("--classes"), "{err}");
        // A near miss of a zoo name is judged here, with the valid names.
        let err =
            (MAGIC.run)(&Context::default(), &["resnet19".into(), "--batch".into(), "8".into(), "--res".into(), "64".into()]).unwrap_err();
        assert!(err.contains("resnet18"), "{err}");
        let err =
            (MAGIC.run)(&Context::default(), &["unte".into(), "--batch".into(), "8".into(), "--res".into(), "64".into()]).unwrap_err();
        assert!(err.contains("unet"), "{err}");
    }

    #[test]
    fn a_kept_variable_named_as_a_zoo_model_is_measured_with_input() {
        let variables = ["resnet18".to_owned()];
        let context = Context { variables: &variables, ..Context::default() };
        let argv: Vec<String> = ["resnet18", "--input", "32x3x224x224", "--gpu", "rtx4060-laptop"].map(String::from).into();
        let Ok(Invocation::Evaluate(code)) = (MAGIC.run)(&context, &argv) else { panic!("expected a cell") };
        assert!(code.contains(r#"Target(&resnet18, "resnet18")"#), "{code}");
        let zoo: Vec<String> = ["resnet18", "--batch", "32", "--res", "224", "--gpu", "rtx4060-laptop"].map(String::from).into();
        assert!(matches!((MAGIC.run)(&context, &zoo), Ok(Invocation::Show(_))));
        let err = (MAGIC.run)(&Context::default(), &argv).unwrap_err();
        assert!(err.contains("no variable of the cells is named `resnet18`") && !err.contains("  "), "{err}");
    }

    #[test]
    fn the_last_error_is_asked_of_the_cell_process_and_takes_nothing_else() {
        assert_eq!(
            (MAGIC.run)(&Context::default(), &[LAST_ERROR.into()]),
            Ok(Invocation::Evaluate("vramlab::diagnose::last_error()?".into()))
        );
        let err = (MAGIC.run)(&Context::default(), &["resnet18".into(), LAST_ERROR.into()]).unwrap_err();
        assert!(err.contains("takes no other argument"), "{err}");
    }

    #[test]
    fn reports_a_verdict_with_a_chart_and_short_usage_errors() {
        let argv: Vec<String> = ["resnet50", "--batch", "128", "--res", "224", "--gpu", "rtx4060-laptop"].map(String::from).into();
        let Ok(Invocation::Show(bundle)) = (MAGIC.run)(&Context::default(), &argv) else { panic!("expected a report") };
        assert!(bundle.text().contains("DOES NOT FIT"), "{}", bundle.text());
        assert!(bundle.get("text/html").and_then(|h| h.as_str()).is_some_and(|h| h.contains("<svg")));
        let err =
            (MAGIC.run)(&Context::default(), &["resnet50".into(), "--batch".into(), "0".into(), "--res".into(), "224".into()]).unwrap_err();
        assert!(err.lines().count() <= 6 && !err.contains("panicked"), "{err}");
    }
}
