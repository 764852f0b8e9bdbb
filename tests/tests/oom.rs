//! A cell that runs out of memory: the error, the investigation under it, and
//! a kernel whose variables survive.

mod common;

use common::Kernel;
use jupyter_protocol::{JupyterMessageContent, ReplyStatus};

fn displayed_text(run: &common::Execution) -> Vec<String> {
    run.outputs
        .iter()
        .filter_map(|m| match &m.content {
            JupyterMessageContent::DisplayData(d) => {
                serde_json::to_value(&d.data).ok().and_then(|v| v["text/plain"].as_str().map(str::to_owned))
            }
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cell_that_runs_out_of_memory_gets_the_investigation_and_the_kernel_goes_on() {
    let mut kernel = Kernel::start().await;
    let setup = "use vramlab::{memory::*, models::*, train::*};\n\
                 let kept = 41;\n\
                 let device = vramlab::candle::Device::Cpu;\n\
                 let net = Network::new(&ModelName::SmallCnn.spec(10), Shape::map(3, 64, 64), &device, 0).unwrap();\n\
                 let mut trainer = Trainer::new(net, TrainConfig::default()).unwrap();\n\
                 let batch = Stripes::new(10, 64).generate(64, 0, &device).unwrap();\n\
                 let peak = trainer.predict(64).unwrap().peak.bytes;\n\
                 let in_use = HostMemory::sample().in_use;\n\
                 cpu_with_budget(&format!(\"{}MiB\", (in_use + vramlab::gpus::GENERIC_CONTEXT_BYTES + vramlab::ops::CUDNN_WORKSPACE_BYTES + peak / 2) >> 20)).unwrap();";
    let ran = kernel.execute(setup).await;
    assert_eq!(ran.reply.status, ReplyStatus::Ok, "{:?}", ran.error());

    let failed = kernel.execute("trainer.step(&[batch.clone()], 0)?;").await;
    assert_eq!(failed.reply.status, ReplyStatus::Error);
    let error = failed.error().expect("an error output");
    assert!(error.evalue.contains("out of memory (simulated device budget, CPU): tried to allocate"), "{}", error.evalue);
    let types = failed.types();
    let error_at = types.iter().position(|t| *t == "error").unwrap();
    let report_at = types.iter().position(|t| *t == "display_data").unwrap_or_else(|| panic!("no report: {types:?}"));
    assert!(report_at > error_at, "the report comes under the error: {types:?}");
    let report = displayed_text(&failed).join("\n");
    for step in [
        "1. the failed allocation",
        "2. who else holds the device",
        "3. memory summary",
        "4. batch 1",
        "5. mixed precision off",
        "6. host side",
        "7. ranked fixes",
    ] {
        assert!(report.contains(step), "{step} missing:\n{report}");
    }
    assert!(report.contains("during forward") || report.contains("during backward"), "the phase:\n{report}");
    assert!(report.contains("verified: peak"), "at least one fix verified:\n{report}");
    assert!(!report.contains("stack backtrace"), "{report}");

    let again = kernel.execute("%oomcheck --last-error").await;
    let again_text = again.result_text().unwrap_or_else(|| panic!("{:?}", again.error()));
    assert!(again_text.starts_with("Out of memory: tried to allocate") && again_text.contains("\n7. ranked fixes"), "{again_text}");
    let html = again.outputs.iter().find_map(|m| match &m.content {
        JupyterMessageContent::ExecuteResult(r) => {
            serde_json::to_value(&r.data).ok().and_then(|v| v["text/html"].as_str().map(str::to_owned))
        }
        _ => None,
    });
    assert!(html.is_some_and(|h| h.contains("<table")), "the report shows as tables");

    let brief =
        kernel.execute("vramlab::diagnose::set_detail(vramlab::diagnose::Detail::Brief);\ntrainer.step(&[batch.clone()], 0)?;").await;
    assert_eq!(brief.reply.status, ReplyStatus::Error);
    let short = displayed_text(&brief).join("\n");
    assert!(short.starts_with("Out of memory: tried to allocate") && short.contains("7. ranked fixes"), "{short}");
    assert!(
        short.ends_with("The whole report: %oomcheck --last-error\n") && short.lines().count() < 20,
        "one line a step and a fix:\n{short}"
    );
    let whole = kernel.execute("%oomcheck --last-error").await;
    let whole = whole.result_text().unwrap_or_else(|| panic!("{:?}", whole.error()));
    assert!(whole.contains("memory::SimulatedCard models a caching allocator") && !short.contains("SimulatedCard"), "{whole}");

    let survived = kernel.execute("kept + 1").await;
    assert_eq!(survived.result_text().as_deref(), Some("42"), "{:?}", survived.error());
    let processes = kernel.execute("%mem --processes").await;
    let table = processes.result_text().unwrap_or_else(|| panic!("{:?}", processes.error()));
    assert!(table.contains("cell process") && table.contains("(this notebook)"), "{table}");
    let value = kernel.execute("vramlab::memory::processes()").await;
    let shown = value.result_text().unwrap_or_else(|| panic!("{:?}", value.error()));
    assert!(shown.starts_with("vramlab processes on this machine"), "a report as a cell's value shows as itself, not its Debug: {shown}");
}
