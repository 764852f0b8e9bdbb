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
fn run(context: &Context<'_>, args: &[String]) -> Result<Invocation, String> {
    let Some(target) = args.first().filter(|a| !a.starts_with('-')) else {
        return vramlab::cli::summary(args).map(Invocation::Show).map_err(|e| e.0);
    };
    let rest = &args[1..];
    if !super::means_a_variable(context, target, rest, parse::<SummaryModuleArgs>("%summary VARIABLE", rest).is_ok(), true)? {
        return vramlab::cli::summary(args).map(Invocation::Show).map_err(|e| e.0);
    }
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

    /// A learner's variable named as a zoo model is theirs when they give it an input; the zoo's
    /// model is theirs to ask for with its own flags.
    #[test]
    fn a_kept_variable_named_as_a_zoo_model_is_measured_with_input() {
        let variables = ["resnet18".to_owned(), "efficientnet_b0".to_owned()];
        let context = Context { variables: &variables, ..Context::default() };
        let args = |words: &[&str]| -> Vec<String> { words.iter().map(|w| w.to_string()).collect() };
        let Ok(Invocation::Evaluate(code)) = (MAGIC.run)(&context, &args(&["resnet18", "--input", "8x3x64x64"])) else {
            panic!("expected a cell")
        };
        assert!(code.contains(r#"Target(&resnet18, "resnet18")"#), "{code}");
        let Ok(Invocation::Evaluate(code)) = (MAGIC.run)(&context, &args(&["efficientnet_b0", "--input", "8x3x64x64"])) else {
            panic!("expected a cell")
        };
        assert!(code.contains("Target(&efficientnet_b0"), "{code}");
        let Ok(Invocation::Show(zoo)) = (MAGIC.run)(&context, &args(&["resnet18", "--depth", "1"])) else {
            panic!("expected the zoo's table")
        };
        assert!(zoo.text().contains("11,689,512"), "{}", zoo.text());
        // Flags only the zoo's table takes pick the zoo's model, input or not.
        let Ok(Invocation::Show(zoo)) = (MAGIC.run)(&context, &args(&["resnet18", "--input", "1x3x224x224", "--depth", "1"])) else {
            panic!("expected the zoo's table")
        };
        assert!(zoo.text().contains("11,689,512"), "{}", zoo.text());
        // The zoo's table takes an input shape too.
        let Ok(Invocation::Show(zoo)) = (MAGIC.run)(&Context::default(), &args(&["resnet18", "--input", "1x3x224x224", "--depth", "1"]))
        else {
            panic!("expected the zoo's table")
        };
        assert!(zoo.text().contains("11,689,512"), "{}", zoo.text());
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
