use vramlab::cli::{parse, SummaryModuleArgs, SummaryOfArgs, UsageError};
use vramlab::render::Bundle;

use super::{Context, Invocation, Kind, Magic};

pub const MAGIC: Magic = Magic {
    name: "summary",
    kind: Kind::Line,
    summary: "a model's layer table: output shape, parameters, bytes saved for backward, MACs",
    usage: "%summary MODEL [--input 32x3x224x224] [--dtype f32|f16|bf16] [--depth 1|2|3] [--eval] [--classes N] [--layers lean|plain]\n\
            %summary --spec FILE.json [the same flags]   (a model spec saved as JSON)\n\
            %summary VARIABLE [--batch N] [--dtype f32|f16|bf16] [--depth 1|2|3] [--eval]   (a Network or Trainer: its spec's table)\n\
            %summary VARIABLE --input SHAPE [--opt adam|adamw|sgd|sgd-momentum|adam8bit]   (any model, measured: a Network, a Trainer,\n\
            \x20         a candle Module or a closure from &Tensor to Result<Tensor>; SHAPE such as 32x3x224x224, or 64x784 for an MLP)\n\
            MODEL: resnet18, resnet34, resnet50, efficientnet-b0, small-cnn, vit-tiny, vit-small, unet; VARIABLE: a model built in a cell",
    run,
};

/// A zoo model is summarised here; a cell's variable is summarised in the
/// cell process, where it lives, by a one-line cell.
fn run(_: &Context<'_>, args: &[String]) -> Result<Invocation, String> {
    let Some(target) = args.first().filter(|a| !a.starts_with('-')) else {
        return vramlab::cli::summary(args).map(Invocation::Show).map_err(|e| e.0);
    };
    if super::names_a_zoo_model(target) || !is_identifier(target) {
        return vramlab::cli::summary(args).map(Invocation::Show).map_err(|e| e.0);
    }
    let rest = &args[1..];
    let help = if super::asks_for_input(rest) {
        parse::<SummaryModuleArgs>("%summary VARIABLE", rest).map_err(|UsageError(e)| e)?.err()
    } else {
        parse::<SummaryOfArgs>("%summary VARIABLE", rest).map_err(|UsageError(e)| e)?.err()
    };
    if let Some(help) = help {
        return Ok(Invocation::Show(Bundle::plain(help)));
    }
    Ok(Invocation::Evaluate(super::of_variable(target, "vramlab_summary", rest)))
}

fn is_identifier(word: &str) -> bool {
    let mut chars = word.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_table_and_names_bad_models() {
        let Ok(Invocation::Show(bundle)) = (MAGIC.run)(&Context::default(), &["resnet18".into(), "--depth".into(), "1".into()]) else {
            panic!("expected a table")
        };
        assert!(bundle.get("text/html").is_some());
        assert!(bundle.text().contains("11,689,512"), "{}", bundle.text());
        let err = (MAGIC.run)(&Context::default(), &["resnet19".into()]).unwrap_err();
        assert!(err.contains("resnet18") && !err.contains("\u{1b}["), "{err}");
    }

    #[test]
    fn a_variable_becomes_a_cell_and_bad_flags_stop_before_compiling() {
        let Ok(Invocation::Evaluate(code)) = (MAGIC.run)(&Context::default(), &["net".into(), "--depth".into(), "1".into()]) else {
            panic!("expected a cell")
        };
        assert_eq!(
            code,
            r#"({ use vramlab::cli::{ByModule as _, ByNothing as _, BySpec as _}; (&&vramlab::cli::Target(&net, "net")).vramlab_summary(&["--depth", "1"]) })?"#
        );
        let Ok(Invocation::Evaluate(code)) = (MAGIC.run)(&Context::default(), &["mlp".into(), "--input".into(), "64x784".into()]) else {
            panic!("expected a cell")
        };
        assert!(code.ends_with(r#".vramlab_summary(&["--input", "64x784"]) })?"#), "{code}");
        // The measured flags are checked here too, before anything compiles.
        let err = (MAGIC.run)(&Context::default(), &["net".into(), "--input".into(), "64".into()]).unwrap_err();
        assert!(err.contains("at least one more dimension"), "{err}");
        let err =
            (MAGIC.run)(&Context::default(), &["net".into(), "--input".into(), "8x784".into(), "--depth".into(), "1".into()]).unwrap_err();
        assert!(err.contains("--depth"), "{err}");
    }
}
