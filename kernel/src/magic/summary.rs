use super::{Invocation, Kind, Magic};

pub const MAGIC: Magic = Magic {
    name: "summary",
    kind: Kind::Line,
    summary: "a model's layer table: output shape, parameters, bytes saved for backward, MACs",
    usage: "%summary MODEL [--input 32x3x224x224] [--dtype f32|f16|bf16] [--depth 1|2|3] [--eval] [--classes N]\n\
            MODEL: resnet18, resnet34, resnet50, efficientnet-b0, small-cnn",
    run: |args| vramlab::cli::summary(args).map(Invocation::Show).map_err(|e| e.0),
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_table_and_names_bad_models() {
        let Ok(Invocation::Show(bundle)) = (MAGIC.run)(&["resnet18".into(), "--depth".into(), "1".into()]) else {
            panic!("expected a table")
        };
        assert!(bundle.get("text/html").is_some());
        assert!(bundle.text().contains("11,689,512"), "{}", bundle.text());
        let err = (MAGIC.run)(&["resnet19".into()]).unwrap_err();
        assert!(err.contains("resnet18") && !err.contains("\u{1b}["), "{err}");
    }
}
