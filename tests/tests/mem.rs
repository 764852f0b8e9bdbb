//! `%mem` and `%%mem`: the cell process's heap, read from its allocation
//! counters without running code there.

mod common;

use common::{Execution, Kernel};
use jupyter_protocol::ReplyStatus;

const MIB: u64 = 1 << 20;
/// What evcxr itself allocates around a cell (loading the cell's library,
/// storing its variables), on top of what the cell's own code allocates.
const CELL_OVERHEAD: u64 = MIB;

/// The bytes column of a row of `%mem`'s table.
fn row(run: &Execution, name: &str) -> u64 {
    let text = run.result_text().unwrap_or_else(|| panic!("no %mem result: {:?}", run.error()));
    let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no `{name}` row in\n{text}"));
    let bytes = line[name.len()..].split_whitespace().next().unwrap();
    bytes.replace(',', "").parse().unwrap_or_else(|_| panic!("`{bytes}` in {line}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn mem_follows_a_tensor_exactly_and_answers_without_running_a_cell() {
    let mut kernel = Kernel::start().await;
    let loaded = kernel.execute("use vramlab::candle::{DType, Device, Tensor};").await;
    assert_eq!(loaded.reply.status, ReplyStatus::Ok, "{:?}", loaded.error());

    let before = kernel.execute("%mem").await;
    let again = kernel.execute("%mem").await;
    assert_eq!(row(&before, "allocations"), row(&again, "allocations"), "%mem must not run code in the cell process");
    assert!(before.result_text().unwrap().contains("every allocation counted"));

    kernel.execute("let t = Tensor::zeros((16, 1024, 1024), DType::F32, &Device::Cpu).unwrap();").await;
    let with_tensor = kernel.execute("%mem").await;
    let grew = row(&with_tensor, "in use") - row(&before, "in use");
    assert!((64 * MIB..64 * MIB + CELL_OVERHEAD).contains(&grew), "a 64 MiB tensor moved in use by {grew}");
    assert!(row(&with_tensor, "peak") >= row(&with_tensor, "in use"));

    kernel.execute("drop(t);").await;
    let dropped = kernel.execute("%mem").await;
    let fell = row(&with_tensor, "in use") - row(&dropped, "in use");
    assert!((64 * MIB - CELL_OVERHEAD..64 * MIB + CELL_OVERHEAD).contains(&fell), "dropping it gave back {fell}");
    assert!(row(&dropped, "peak") >= row(&before, "in use") + 64 * MIB, "the peak remembers the tensor");

    let reset = kernel.execute("%mem --reset-peak").await;
    assert!(row(&reset, "peak") < row(&dropped, "in use") + CELL_OVERHEAD, "{:?}", reset.result_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mem_cell_shows_its_peak_and_net_change() {
    let mut kernel = Kernel::start().await;
    let run = kernel
        .execute("%%mem\nlet kept = vec![1u8; 8 << 20];\n{ let burst = std::hint::black_box(vec![1u8; 32 << 20]); burst.len() }")
        .await;
    assert_eq!(run.reply.status, ReplyStatus::Ok, "{:?}", run.error());
    assert!(run.types().contains(&"display_data"), "the cell's own value is shown first: {:?}", run.types());
    let text = run.result_text().unwrap();
    assert!(text.starts_with("peak memory:"), "{text}");
    let mib_after = |marker: &str| -> f64 {
        let rest = text.split(marker).nth(1).unwrap_or_else(|| panic!("no `{marker}` in {text}"));
        assert!(rest.split(' ').nth(1) == Some("MiB"), "{text}");
        rest.split(' ').next().unwrap().parse().unwrap()
    };
    // Evcxr loading the cell's library adds a little to what the cell allocates.
    assert!((40.0..41.0).contains(&mib_after("(+")), "8 MiB kept and a 32 MiB burst: {text}");
    assert!((8.0..9.0).contains(&mib_after("net change: +")), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_arguments_are_a_short_usage_error_and_the_kernel_goes_on() {
    let mut kernel = Kernel::start().await;
    kernel.execute("let warm = 1;").await;
    let bad = kernel.execute("%mem --no-such-flag").await;
    let error = bad.error().expect("a usage error");
    assert_eq!(error.ename, "UsageError");
    assert!(error.evalue.contains("--no-such-flag") && error.traceback.len() <= 3, "{error:?}");
    let conflicting = kernel.execute("%%mem --plot\nlet x = 1;").await;
    assert_eq!(conflicting.error().map(|e| e.ename.as_str()), Some("UsageError"));
    assert!(kernel.is_running());
    let fine = kernel.execute("%mem --empty-cache").await;
    assert!(fine.result_text().unwrap().contains("empty_cache (malloc_trim): held"), "{:?}", fine.result_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_simulated_budget_raises_the_cuda_shaped_error_and_mem_shows_the_registered_bills() {
    let mut kernel = Kernel::start().await;
    let cell = "let in_use = vramlab::memory::HostMemory::sample().in_use;\n\
                let device = vramlab::memory::cpu_with_budget(&format!(\"{}MiB\", (in_use + vramlab::gpus::GENERIC_CONTEXT_BYTES + vramlab::ops::CUDNN_WORKSPACE_BYTES) / (1 << 20) + 48)).unwrap();\n\
                let a = vramlab::candle::Tensor::zeros((8, 1024, 1024), vramlab::candle::DType::F32, &device).unwrap();\n\
                vramlab::memory::check_budget().unwrap();\n\
                let b = vramlab::candle::Tensor::zeros((8, 1024, 1024), vramlab::candle::DType::F32, &device).unwrap();\n\
                vramlab::memory::check_budget().unwrap_err().to_string()";
    let run = kernel.execute(cell).await;
    let text = run.result_text().unwrap_or_else(|| panic!("{:?}", run.error()));
    assert!(text.contains("out of memory (simulated device budget, CPU): tried to allocate 32.0 MiB"), "{text}");
    let mem = kernel.execute("%mem").await;
    assert!(mem.result_text().unwrap().contains("simulated device budget"), "{:?}", mem.result_text());

    let publish = "use vramlab::memory::*;\n\
                   let mut bills = BillBytes::default();\n\
                   bills.activations = 100 << 20;\n\
                   let measured = Measurement { bills: BillBytes { activations: 110 << 20, ..bills }, peak: 110 << 20,\n\
                       phases: vec![MeasuredPhase { name: \"forward\".into(), bills }] };\n\
                   let predicted = Prediction { bills, peak: 100 << 20, phases: vec![PredictedPhase { name: \"forward\".into(), resident: 0, peak: 100 << 20 }] };\n\
                   publish(&Snapshot { label: \"a test step\".into(), predicted: Some(predicted), measured: Some(measured) }).unwrap();";
    let published = kernel.execute(publish).await;
    assert_eq!(published.reply.status, ReplyStatus::Ok, "{:?}", published.error());
    let mem = kernel.execute("%mem --plot").await;
    let text = mem.result_text().unwrap();
    assert!(text.contains("registered: a test step") && text.contains("+10.0%"), "{text}");
    assert!(text.contains("last step's samples"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn training_and_measuring_leave_the_users_peak_alone() {
    let mut kernel = Kernel::start().await;
    let setup = kernel
        .execute(
            "use vramlab::candle::Device;\nuse vramlab::models::{ModelName, Network, Shape};\nuse vramlab::train::*;\n\
             let (x, y) = Stripes::new(4, 16).generate(8, 0, &Device::Cpu).unwrap();\n\
             let mut trainer = Trainer::new(Network::new(&ModelName::SmallCnn.spec(4), Shape::map(3, 16, 16), &Device::Cpu, 0).unwrap(), TrainConfig::default()).unwrap();",
        )
        .await;
    assert_eq!(setup.reply.status, ReplyStatus::Ok, "{:?}", setup.error());
    kernel.execute("%mem --reset-peak").await;
    let burst = kernel.execute("{ let burst = std::hint::black_box(vec![1u8; 96 << 20]); burst.len() }").await;
    assert_eq!(burst.reply.status, ReplyStatus::Ok, "{:?}", burst.error());
    let before = kernel.execute("%mem").await;
    assert!(row(&before, "peak") >= row(&before, "in use") + 96 * MIB, "{:?}", before.result_text());

    let trained = kernel
        .execute("let report = trainer.step(&[(x.clone(), y.clone())], 0).unwrap();\nlet measured = trainer.measure_step(&[(x.clone(), y.clone())], 0).unwrap();\n(report.memory.unwrap().peak, measured.peak)")
        .await;
    assert_eq!(trained.reply.status, ReplyStatus::Ok, "{:?}", trained.error());
    let after = kernel.execute("%mem").await;
    assert!(
        row(&after, "peak") >= row(&before, "peak"),
        "a step reset the user's peak: {:?} then {:?}",
        before.result_text(),
        after.result_text()
    );
    // The step's own peak is its own: far below the burst before it.
    let text = trained.result_text().unwrap();
    let step_peaks: Vec<u64> = text.trim_matches(|c| c == '(' || c == ')').split(", ").map(|v| v.trim().parse().unwrap()).collect();
    assert!(step_peaks.iter().all(|&p| p < row(&before, "in use") + 96 * MIB), "a step's peak includes the earlier burst: {text}");
}
