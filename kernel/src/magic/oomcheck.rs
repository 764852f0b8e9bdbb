use super::{Invocation, Kind, Magic};

pub const MAGIC: Magic = Magic {
    name: "oomcheck",
    kind: Kind::Line,
    summary: "will this training step fit on this GPU? the five bills, the peak, and ranked fixes",
    usage: "%oomcheck MODEL --batch B --res R [--amp f16|bf16] [--opt adam|adamw|sgd|sgd-momentum|adam8bit]\n\
            \x20         [--accum N] [--ckpt none|stages|layer3,layer4] [--gpu NAME|8GiB|cpu] [--sweep batch=8..64|res=128..512]\n\
            \x20         [--classes N] [--eval]",
    run: |args| vramlab::cli::oomcheck(args).map(Invocation::Show).map_err(|e| e.0),
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_a_verdict_with_a_chart_and_short_usage_errors() {
        let argv: Vec<String> = ["resnet50", "--batch", "64", "--res", "224", "--gpu", "rtx4060-laptop"].map(String::from).into();
        let Ok(Invocation::Show(bundle)) = (MAGIC.run)(&argv) else { panic!("expected a report") };
        assert!(bundle.text().contains("DOES NOT FIT"), "{}", bundle.text());
        assert!(bundle.get("text/html").and_then(|h| h.as_str()).is_some_and(|h| h.contains("<svg")));
        let err = (MAGIC.run)(&["resnet50".into(), "--batch".into(), "0".into(), "--res".into(), "224".into()]).unwrap_err();
        assert!(err.lines().count() <= 6 && !err.contains("panicked"), "{err}");
    }
}
