//! Running cells: streaming, errors that keep the kernel and its variables,
//! interrupts, a dying cell process, input over stdin and live displays.

mod common;

use std::time::{Duration, Instant};

use common::Kernel;
use jupyter_protocol::{
    CompleteRequest, ExecuteRequest, InputReply, InterruptRequest, JupyterMessageContent, KernelInfoRequest, ReplyStatus,
};

#[tokio::test(flavor = "multi_thread")]
async fn output_streams_while_the_cell_runs() {
    let mut kernel = Kernel::start().await;
    let run = kernel
        .execute(
            "println!(\"first\");\nstd::thread::sleep(std::time::Duration::from_millis(1500));\n\
             eprintln!(\"to stderr\");\nprintln!(\"second\");",
        )
        .await;
    assert_eq!(run.reply.status, ReplyStatus::Ok);
    assert_eq!(run.stdout(), "first\nsecond\n");
    assert_eq!(run.stderr(), "to stderr\n");
    let first_at = run
        .received
        .iter()
        .find(|(_, m)| matches!(&m.content, JupyterMessageContent::StreamContent(s) if s.text.contains("first")))
        .map(|(t, _)| *t)
        .unwrap();
    let idle_at = run.received.last().unwrap().0;
    assert!(idle_at - first_at >= Duration::from_millis(1000), "the first line must arrive before the cell ends");
}

/// rust-analyzer loads on a thread of its own from the kernel's start: a cell that defines no
/// variable compiles meanwhile, and what needs the analysis waits for it and gets it right.
#[tokio::test(flavor = "multi_thread")]
async fn cells_sent_at_once_after_the_start_run_while_rust_analyzer_loads() {
    let mut kernel = Kernel::start().await;
    assert_eq!(kernel.execute("1 + 1").await.result_text().as_deref(), Some("2"));
    let defined = kernel.execute("let words = vec![String::from(\"a\"), String::from(\"bc\")];").await;
    assert_eq!(defined.reply.status, ReplyStatus::Ok, "{:?}", defined.error());
    let total = kernel.execute("words.iter().map(|w| w.len()).sum::<usize>()").await;
    assert_eq!(total.result_text().as_deref(), Some("3"));
    let code = "words[0].le";
    let reply = kernel.shell_request(CompleteRequest { code: code.into(), cursor_pos: code.len() }).await;
    let JupyterMessageContent::CompleteReply(completion) = reply.content else { panic!("expected complete_reply") };
    assert!(completion.matches.iter().any(|m| m == "len()"), "{:?}", completion.matches);
}

#[tokio::test(flavor = "multi_thread")]
async fn panics_and_compile_errors_keep_the_variables() {
    let mut kernel = Kernel::start().await;
    kernel.execute("let kept = 41;").await;

    let panicked = kernel.execute("let mine = 1;\npanic!(\"boom {}\", kept);").await;
    assert_eq!(panicked.reply.status, ReplyStatus::Error);
    assert_eq!(panicked.types(), vec!["error"], "only the error is shown: no raw panic text on stderr");
    let error = panicked.error().unwrap();
    assert_eq!((error.ename.as_str(), error.evalue.as_str()), ("panic", "boom 41"));
    assert!(error.traceback[0].contains("panic") && error.traceback[0].contains("in this cell: boom 41"), "{:?}", error.traceback);
    assert!(
        error.traceback.iter().all(|l| !l.contains("run_user_code")),
        "evcxr's wrappers are not the user's code: {:?}",
        error.traceback
    );

    let broken = kernel.execute("let x: u32 = \"text\";").await;
    let error = broken.error().unwrap();
    assert_eq!(error.ename, "CompilationError");
    assert!(error.evalue.contains("mismatched types"), "{}", error.evalue);
    assert!(error.traceback.iter().any(|l| l.contains("let x: u32 = \"text\";")), "{:?}", error.traceback);

    assert_eq!(kernel.execute("kept + 1").await.result_text().as_deref(), Some("42"));
    let vars = kernel.execute(":vars").await;
    assert!(vars.result_text().unwrap().contains("kept"));
}

#[tokio::test(flavor = "multi_thread")]
async fn final_values_show_after_one_compile_and_follow_fmt_and_types() {
    let mut kernel = Kernel::start().await;
    let timing = kernel.execute(":timing").await;
    assert_eq!(timing.result_text().as_deref().map(str::trim_end), Some("Timing: true"));
    let sum = kernel.execute("1 + 1").await;
    assert_eq!(sum.result_text().as_deref(), Some("2"));
    let took = sum.stdout();
    assert!(took.starts_with("Took ") && took.contains("Final compile"), "{took}");
    assert!(!took.contains("Fallback"), "a Debug value needs no second compile: {took}");

    kernel
        .execute(
            "#[derive(Debug)] struct Point { x: i32 }
let word = String::from(\"kept\");",
        )
        .await;
    assert_eq!(kernel.execute("word").await.result_text().as_deref(), Some("\"kept\""));
    assert_eq!(kernel.execute("word.len()").await.result_text().as_deref(), Some("4"), "the value was borrowed, not moved");
    // A cell's leading commands apply to its own value.
    let pretty = kernel.execute(":fmt {:#?}\nPoint { x: 1 }").await.result_text().unwrap();
    assert!(pretty.ends_with("\nPoint {\n    x: 1,\n}"), "{pretty}");
    let hex = kernel.execute(":fmt {:x}\n255").await;
    assert!(hex.result_text().unwrap().ends_with("\nff"), "other formats take evcxr's own path: {:?}", hex.result_text());
    assert!(hex.stdout().contains("Fallback"), "{}", hex.stdout());
    let typed = kernel.execute(":fmt\n:types\nvec![1u8]").await.result_text().unwrap();
    assert!(typed.ends_with("\n: Vec<u8> = [1]"), "{typed}");
    kernel.execute(":types").await;

    struct_without_debug_is_a_compile_error(&mut kernel).await;
    kernel.execute(":clear").await;
    let after_clear = kernel.execute("[1.5f32, 2.0]").await;
    assert_eq!(after_clear.result_text().as_deref(), Some("[1.5, 2.0]"));
    assert!(!after_clear.stdout().contains("Fallback"), "{}", after_clear.stdout());
}

async fn struct_without_debug_is_a_compile_error(kernel: &mut Kernel) {
    let run = kernel.execute("struct Opaque;\nOpaque").await;
    let error = run.error().expect("a value without Debug cannot be shown");
    assert_eq!(error.ename, "CompilationError");
    assert!(error.evalue.contains("Debug"), "{}", error.evalue);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_cell_process_is_reported_and_replaced() {
    let mut kernel = Kernel::start().await;
    kernel.execute("let doomed = 1;\nfn still_here() -> u8 { 7 }").await;
    let died = kernel.execute("std::process::abort();").await;
    let error = died.error().expect("an error for the dead process");
    assert_eq!(error.ename, "CellProcessDied");
    assert!(error.evalue.contains("died"), "{}", error.evalue);
    let traceback = error.traceback.join("\n");
    assert!(traceback.contains("SIGABRT") || traceback.contains("signal: 6"), "{traceback}");
    assert!(traceback.contains("Variables lost: doomed"), "{traceback}");
    assert_eq!(kernel.execute("still_here()").await.result_text().as_deref(), Some("7"));
    let gone = kernel.execute("doomed").await;
    assert_eq!(gone.error().unwrap().ename, "CompilationError");
}

#[tokio::test(flavor = "multi_thread")]
async fn interrupt_stops_a_runaway_loop_and_control_stays_responsive() {
    let mut kernel = Kernel::start().await;
    kernel.execute("let survivor = 5; fn helper() -> i32 { 3 }").await;
    let request = kernel.message(ExecuteRequest::new("let mut n: u64 = 0;\nloop { n = n.wrapping_add(1); }".into()));
    let id = request.header.msg_id.clone();
    kernel.shell.send(request).await.unwrap();
    // Let it compile and start spinning.
    tokio::time::sleep(Duration::from_secs(8)).await;

    let asked = Instant::now();
    let info = kernel.control_request(KernelInfoRequest {}).await;
    assert!(matches!(info.content, JupyterMessageContent::KernelInfoReply(_)));
    let answered = asked.elapsed();
    assert!(answered < Duration::from_millis(100), "kernel_info on control took {answered:?} during a cell");

    let reply = kernel.control_request(InterruptRequest {}).await;
    assert!(matches!(reply.content, JupyterMessageContent::InterruptReply(_)));
    let received = kernel.iopub_until_idle(&id, Duration::from_secs(30)).await;
    let error = received
        .iter()
        .find_map(|(_, m)| match &m.content {
            JupyterMessageContent::ErrorOutput(e) => Some(e.clone()),
            _ => None,
        })
        .expect("the interrupted cell reports an error");
    assert_eq!(error.ename, "Interrupted");
    assert!(error.traceback.iter().any(|l| l.contains("Variables lost: survivor")), "{:?}", error.traceback);
    assert_eq!(kernel.execute("helper()").await.result_text().as_deref(), Some("3"), "items survive");
}

#[tokio::test(flavor = "multi_thread")]
async fn cells_can_ask_for_input_over_stdin() {
    let mut kernel = Kernel::start().await;
    let dep = kernel.execute(":dep evcxr_input = \"1\"").await;
    assert_eq!(dep.reply.status, ReplyStatus::Ok, "{:?}", dep.error());
    let request = kernel.message(ExecuteRequest {
        allow_stdin: true,
        ..ExecuteRequest::new("let name = evcxr_input::get_string(\"name? \");\nformat!(\"hello {name}\")".into())
    });
    let id = request.header.msg_id.clone();
    kernel.shell.send(request).await.unwrap();
    let asked = tokio::time::timeout(Duration::from_secs(300), kernel.stdin.read()).await.unwrap().unwrap();
    let JupyterMessageContent::InputRequest(input) = &asked.content else { panic!("expected input_request") };
    assert_eq!(input.prompt, "name? ");
    assert!(!input.password);
    let answer = InputReply { value: "vram".into(), ..Default::default() };
    kernel.stdin.send(answer.as_child_of(&asked)).await.unwrap();
    let received = kernel.iopub_until_idle(&id, Duration::from_secs(60)).await;
    let result = received.iter().find_map(|(_, m)| match &m.content {
        JupyterMessageContent::ExecuteResult(r) => serde_json::to_value(&r.data).unwrap()["text/plain"].as_str().map(str::to_owned),
        _ => None,
    });
    assert_eq!(result.as_deref(), Some("\"hello vram\""));
}

#[tokio::test(flavor = "multi_thread")]
async fn vramlab_renders_live_displays_and_rich_results() {
    let mut kernel = Kernel::start().await;
    let progress = kernel
        .execute(
            "use vramlab::render::{Progress, Table};\n\
             let mut bar = Progress::new(\"steps\", 3).min_interval(std::time::Duration::ZERO);\n\
             for _ in 0..3 { bar.inc(1); std::thread::sleep(std::time::Duration::from_millis(50)); }\n\
             bar.finish();\n\
             Table::new([\"layer\", \"params\"]).row([\"conv1\", \"9408\"])",
        )
        .await;
    assert_eq!(progress.reply.status, ReplyStatus::Ok, "{:?}", progress.error());
    // The first cell that uses the library may also show the library's notice.
    let shown = displays(&progress).into_iter().find(|(kind, _, text)| *kind == "display" && text.starts_with("steps"));
    let (_, display_id, _) = shown.expect("a display_data with a display_id for the bar");
    let updates: Vec<String> = progress
        .outputs
        .iter()
        .filter_map(|m| match &m.content {
            JupyterMessageContent::UpdateDisplayData(u) if u.transient.display_id.as_deref() == Some(display_id.as_str()) => {
                serde_json::to_value(&u.data).unwrap()["text/plain"].as_str().map(str::to_owned)
            }
            _ => None,
        })
        .collect();
    assert!(updates.len() >= 3, "{updates:?}");
    assert!(updates.last().unwrap().contains("3/3 (100%)"));
    let result = progress.outputs.iter().find_map(|m| match &m.content {
        JupyterMessageContent::ExecuteResult(r) => Some(serde_json::to_value(&r.data).unwrap()),
        _ => None,
    });
    let result = result.expect("the table is the cell's result");
    assert!(result["text/html"].as_str().unwrap().contains("<td style=\"text-align:left\">conv1</td>"));
    assert!(result["text/plain"].as_str().unwrap().contains("conv1"));
    assert!(progress.stdout().is_empty(), "frames must not leak into stdout: {}", progress.stdout());
}

#[tokio::test(flavor = "multi_thread")]
async fn summary_shows_the_layer_table_of_a_model_built_in_a_cell() {
    let mut kernel = Kernel::start().await;
    let built = kernel
        .execute(
            "use vramlab::models::{small_cnn, Network, Shape};\n\
             let net = Network::new(&small_cnn(10), Shape::map(3, 32, 32), &vramlab::candle::Device::Cpu, 0).unwrap();",
        )
        .await;
    assert_eq!(built.reply.status, ReplyStatus::Ok, "{:?}", built.error());
    let summary = kernel.execute("%summary net --batch 8 --depth 1").await;
    assert_eq!(summary.reply.status, ReplyStatus::Ok, "{:?}", summary.error());
    let table = summary.result_text().unwrap();
    assert!(table.contains("block1") && table.contains("8x32x16x16"), "{table}");
    let params = kernel.execute("net.param_count()").await.result_text().unwrap();
    let grouped = params.as_bytes().rchunks(3).rev().map(|c| std::str::from_utf8(c).unwrap()).collect::<Vec<_>>().join(",");
    assert!(table.contains(&grouped), "{table} should show {grouped} parameters");

    let missing = kernel.execute("%summary no_such_model").await;
    assert_eq!(missing.reply.status, ReplyStatus::Error);
    assert!(missing.error().unwrap().evalue.contains("no_such_model"), "{:?}", missing.error());
    let bad = kernel.execute("%summary net --input 0x3x8x8").await;
    assert_eq!(bad.error().unwrap().ename, "UsageError");
    assert!(kernel.execute("net.param_count() > 0").await.result_text().as_deref() == Some("true"), "the model survives");
}

fn compiled_artifacts(name: &str) -> Vec<(std::path::PathBuf, std::time::SystemTime)> {
    fn walk(dir: &std::path::Path, prefix: &str, found: &mut Vec<(std::path::PathBuf, std::time::SystemTime)>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, prefix, found);
            } else if entry.file_name().to_string_lossy().starts_with(prefix) && path.extension().is_some_and(|e| e == "rlib") {
                found.push((path.clone(), entry.metadata().unwrap().modified().unwrap()));
            }
        }
    }
    let mut found = Vec::new();
    walk(&common::cache_dir(), &format!("lib{name}-"), &mut found);
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_kernel_does_not_recompile_its_dependencies() {
    let code = ":dep evcxr_input = \"1\"\nevcxr_input::GET_CMD.len() > 0";
    {
        let mut kernel = Kernel::start().await;
        assert_eq!(kernel.execute(code).await.result_text().as_deref(), Some("true"));
    }
    let before = compiled_artifacts("evcxr_input");
    assert!(!before.is_empty(), "evcxr_input was compiled into the kernel's build cache");
    let mut restarted = Kernel::start().await;
    let started = Instant::now();
    assert_eq!(restarted.execute(code).await.result_text().as_deref(), Some("true"));
    let elapsed = started.elapsed();
    assert_eq!(compiled_artifacts("evcxr_input"), before, "nothing recompiled after the restart ({elapsed:?})");
}

/// A second notebook opened beside a first: its kernel finds the build slot
/// where the library was built held, takes one of its own, copies that
/// build into it and loads the library from the copy (seconds where a build
/// is 4 to 5 minutes on 2 cores: BENCHMARKS.md), saying so.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_kernel_beside_the_first_loads_the_library_from_a_copy_of_its_build() {
    // A cache of its own, whose first slot holds the library the test command's set-up built (a
    // copy): the shared test cache may hold more built slots from earlier runs.
    let cache = tempfile::tempdir().unwrap();
    let slot = cache.path().join("evcxr/slot-0");
    std::fs::create_dir_all(&slot).unwrap();
    let built = common::cache_dir().join("evcxr/slot-0/target");
    let copied = std::process::Command::new("cp").arg("-a").arg(&built).arg(&slot).status().unwrap();
    assert!(copied.success(), "the set-up's build of the library in {}", built.display());
    let envs = [("VRAMLAB_CACHE_DIR", cache.path().to_str().unwrap())];
    let uses_library = "vramlab::units::human(1 << 20).ends_with(\"MiB\")";
    let mut first = Kernel::start_with(&uuid::Uuid::new_v4().to_string(), &[], &envs).await;
    let loaded = first.execute(uses_library).await;
    assert_eq!(loaded.result_text().as_deref(), Some("true"), "{:?}", loaded.error());
    let mut second = Kernel::start_with(&uuid::Uuid::new_v4().to_string(), &[], &envs).await;
    let run = second.execute(uses_library).await;
    assert_eq!(run.result_text().as_deref(), Some("true"), "{:?}", run.error());
    let shown = displays(&run);
    let headline = &shown.first().expect("a notice while the library loads").2;
    assert!(headline.contains("another running kernel holds") && headline.contains("a copy of that build"), "{headline}");
    assert!(shown.last().unwrap().2.contains("vramlab ready"), "{shown:?}");
    assert_eq!(first.execute("1 + 1").await.result_text().as_deref(), Some("2"), "the first kernel goes on");
}

/// The texts of a cell's display_data and update_display_data outputs, with their display ids.
fn displays(run: &common::Execution) -> Vec<(&'static str, String, String)> {
    run.outputs
        .iter()
        .filter_map(|m| {
            let (kind, data, transient) = match &m.content {
                JupyterMessageContent::DisplayData(d) => ("display", serde_json::to_value(&d.data).ok()?, d.transient.clone()?),
                JupyterMessageContent::UpdateDisplayData(u) => ("update", serde_json::to_value(&u.data).ok()?, u.transient.clone()),
                _ => return None,
            };
            Some((kind, transient.display_id?, data["text/plain"].as_str()?.to_owned()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dependency_build_shows_cargos_progress_in_one_display_updated_in_place() {
    let cache = tempfile::tempdir().unwrap();
    let key = uuid::Uuid::new_v4().to_string();
    let mut kernel = Kernel::start_with(&key, &[], &[("VRAMLAB_CACHE_DIR", cache.path().to_str().unwrap())]).await;
    let run = kernel.execute(":dep itoa = \"1\"\nitoa::Buffer::new().format(1234).len()").await;
    assert_eq!(run.result_text().as_deref(), Some("4"), "{:?}", run.error());
    let shown = displays(&run);
    let (kind, id, first) = shown.first().cloned().expect("a notice while the dependency builds");
    assert_eq!(kind, "display");
    assert!(first.starts_with("Building the crates this cell depends on") && first.contains("crates built"), "{first}");
    assert!(shown[1..].iter().all(|(kind, other, _)| *kind == "update" && *other == id), "one output, updated: {shown:?}");
    let last = &shown.last().unwrap().2;
    assert!(last.starts_with("Built the crates this cell depends on ("), "{last}");
    assert!(run.stderr().is_empty(), "nothing on stderr: {}", run.stderr());

    let again = kernel.execute("itoa::Buffer::new().format(7).len()").await;
    assert!(displays(&again).is_empty(), "a cell whose dependencies are built shows no notice: {:?}", displays(&again));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_moved_library_is_named_in_the_cell_that_uses_it() {
    let key = uuid::Uuid::new_v4().to_string();
    let mut kernel = Kernel::start_with(&key, &[], &[("VRAMLAB_LIB", "/moved/checkout/lib")]).await;
    let run = kernel.execute("use vramlab::units;").await;
    assert_eq!(run.reply.status, ReplyStatus::Error);
    let error = run.error().expect("an error output");
    assert_eq!(error.ename, "LibraryUnavailable");
    assert!(error.evalue.contains("/moved/checkout/lib") && error.evalue.contains("vramlab-kernel install"), "{}", error.evalue);
    assert_eq!(kernel.execute("1 + 1").await.result_text().as_deref(), Some("2"), "the kernel goes on");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_build_cache_that_cannot_be_written_is_named_in_every_cell() {
    let dir = tempfile::tempdir().unwrap();
    let not_a_directory = dir.path().join("cache");
    std::fs::write(&not_a_directory, b"").unwrap();
    let key = uuid::Uuid::new_v4().to_string();
    let mut kernel = Kernel::start_with(&key, &[], &[("VRAMLAB_CACHE_DIR", not_a_directory.to_str().unwrap())]).await;
    for code in ["1 + 1", "let x = 2;"] {
        let run = kernel.execute(code).await;
        assert_eq!(run.reply.status, ReplyStatus::Error, "{code}");
        let error = run.error().expect("an error output");
        assert!(error.evalue.contains("cannot write the build cache") && error.evalue.contains("VRAMLAB_CACHE_DIR"), "{}", error.evalue);
    }
    assert!(kernel.is_running() && kernel.heartbeat_ok().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_question_mark_error_or_a_cell_that_is_not_rust_fails_the_cell() {
    let mut kernel = Kernel::start().await;
    kernel.execute("let kept = 5;").await;

    let returned = kernel.execute("let lost = 1;\nlet text = std::fs::read_to_string(\"/nonexistent/file\")?;").await;
    assert_eq!(returned.reply.status, ReplyStatus::Error, "a `?` error is a failed cell");
    let error = returned.error().expect("an error output");
    assert_eq!(error.ename, "std::io::error::Error");
    assert!(error.evalue.contains("No such file or directory"), "{}", error.evalue);
    assert!(error.traceback.iter().any(|l| l.contains("`?`")), "{:?}", error.traceback);
    assert_eq!(returned.reply.error.as_ref().map(|e| e.ename.as_str()), Some("std::io::error::Error"));
    assert!(!returned.stderr().contains("No such file or directory"), "the error is shown once, not also on stderr: {}", returned.stderr());

    for code in ["}}}", "let = ;"] {
        let invalid = kernel.execute(code).await;
        assert_eq!(invalid.reply.status, ReplyStatus::Error, "{code}");
        let error = invalid.error().unwrap_or_else(|| panic!("{code}: no error output"));
        assert_eq!(error.ename, "SyntaxError", "{code}");
        assert!(error.traceback.iter().any(|l| l.starts_with("  --> cell:1:")), "{code}: {:?}", error.traceback);
    }

    // A multi-line message survives the trip, and the cell's new variables are dropped, not earlier ones.
    let custom = kernel.execute("let n: i32 = \"x\".parse().map_err(|e| format!(\"line one\\nline two: {e}\"))?;").await;
    let error = custom.error().unwrap();
    assert_eq!(
        (error.ename.as_str(), error.evalue.as_str()),
        ("alloc::string::String", "line one\nline two: invalid digit found in string")
    );
    assert_eq!(kernel.execute("kept").await.result_text().as_deref(), Some("5"));
    let vars = kernel.execute(":vars").await.result_text().unwrap();
    assert!(vars.contains("kept") && !vars.contains("lost"), "{vars}");
}

/// Every cell library links its own copy of candle; tensors made in two
/// cells must still have different ids, or backprop adds one tensor's
/// gradient to another's (patches/candle-core). The patches reach the cells
/// even when another checkout sharing the build cache left its own paths.
#[tokio::test(flavor = "multi_thread")]
async fn a_trainer_built_in_one_cell_trains_in_the_next() {
    if let Some(cache) = std::env::var_os("VRAMLAB_CACHE_DIR") {
        let config = std::path::Path::new(&cache).join("evcxr/.cargo");
        std::fs::create_dir_all(&config).unwrap();
        std::fs::write(config.join("config.toml"), "[patch.crates-io.candle-core]\npath = \"/another/checkout/patches/candle-core\"\n")
            .unwrap();
    }
    let mut kernel = Kernel::start().await;
    let first = kernel.execute("use vramlab::candle::{DType, Device, Tensor};\nlet a = Tensor::zeros(1, DType::F32, &Device::Cpu)?;").await;
    assert_eq!(first.reply.status, ReplyStatus::Ok, "{:?}", first.error());
    let notice = displays(&first).last().map(|(_, _, text)| text.clone()).unwrap_or_default();
    assert!(notice.starts_with("vramlab ready ("), "the library's notice ends ready, as a display: {notice}");
    assert!(!first.stderr().contains("vramlab"), "the notice is not on stderr: {}", first.stderr());
    let ids = kernel.execute("let b = Tensor::zeros(1, DType::F32, &Device::Cpu)?; a.id() != b.id()").await;
    assert_eq!(ids.result_text().as_deref(), Some("true"), "{:?}", ids.error());
    let build = "use vramlab::{models::*, train::*};\n\
                 let net = Network::new(&ModelName::SmallCnn.spec(4), Shape::map(3, 16, 16), &Device::Cpu, 0)?;\n\
                 let mut trainer = Trainer::new(net, TrainConfig::default())?;\n\
                 let batch = Stripes::new(4, 16).generate(8, 0, &Device::Cpu)?;";
    let built = kernel.execute(build).await;
    assert_eq!(built.reply.status, ReplyStatus::Ok, "{:?}", built.error());
    let stepped = kernel.execute("trainer.step(&[batch.clone()], 0)?.loss.is_finite()").await;
    assert_eq!(stepped.result_text().as_deref(), Some("true"), "{:?}", stepped.error().map(|e| &e.evalue));
}

/// candle-nn's model-building code, cell by cell, as candle's own examples write it: the crates by
/// their own names, a `VarBuilder` at the top level (its type holds a trait object and a lifetime),
/// a struct built with `?` in its fields, `impl Module`, an optimizer from candle-nn, and a
/// training loop in a later cell over the variables the earlier ones kept.
#[tokio::test(flavor = "multi_thread")]
async fn candle_nn_models_train_in_cells_as_candles_examples_write_them() {
    let mut kernel = Kernel::start().await;
    let started = Instant::now();
    let imports = kernel
        .execute(
            "use candle_core::{DType, Device, Tensor};\n\
             use candle_nn::{Conv2d, Linear, Module, Optimizer, VarBuilder, VarMap};",
        )
        .await;
    assert_eq!(imports.reply.status, ReplyStatus::Ok, "{:?}", imports.error());
    eprintln!("the first cell naming candle_core and candle_nn took {:.1} s", started.elapsed().as_secs_f64());

    let setup = kernel
        .execute(
            "let dev = Device::Cpu;\n\
             let varmap = VarMap::new();\n\
             let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);",
        )
        .await;
    assert_eq!(setup.reply.status, ReplyStatus::Ok, "{:?}", setup.error());

    let model_code = "struct Net { conv: Conv2d, fc: Linear }\n\
                      impl Net {\n\
                          fn new(vb: VarBuilder) -> candle_core::Result<Self> {\n\
                              Ok(Self {\n\
                                  conv: candle_nn::conv2d(1, 4, 3, Default::default(), vb.pp(\"conv\"))?,\n\
                                  fc: candle_nn::linear(4 * 6 * 6, 3, vb.pp(\"fc\"))?,\n\
                              })\n\
                          }\n\
                      }\n\
                      impl Module for Net {\n\
                          fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {\n\
                              self.conv.forward(xs)?.relu()?.flatten_from(1)?.apply(&self.fc)\n\
                          }\n\
                      }";
    let model = kernel.execute(model_code).await;
    assert_eq!(model.reply.status, ReplyStatus::Ok, "{:?}", model.error());

    // The line that used to fail ("cannot find trait `SimpleBackend`", or a wrong message about
    // `?` with one on the same line).
    let built = kernel
        .execute(
            "let model = Net::new(vb.clone())?;\n\
             let head_vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev); let head = candle_nn::linear(3, 3, head_vb.pp(\"head\"))?;\n\
             let mut opt = candle_nn::SGD::new(varmap.all_vars(), 0.1)?;\n\
             let xs = Tensor::randn(0f32, 1., (8, 1, 8, 8), &dev)?;\n\
             let ys = Tensor::new(&[0u32, 1, 2, 0, 1, 2, 0, 1], &dev)?;",
        )
        .await;
    assert_eq!(built.reply.status, ReplyStatus::Ok, "{:?}", built.error());

    let trained = kernel
        .execute(
            "let mut losses = Vec::new();\n\
             for _step in 0..8 {\n\
                 let logits = head.forward(&model.forward(&xs)?)?;\n\
                 let loss = candle_nn::loss::cross_entropy(&logits, &ys)?;\n\
                 opt.backward_step(&loss)?;\n\
                 losses.push(loss.to_scalar::<f32>()?);\n\
             }\n\
             losses.len()",
        )
        .await;
    assert_eq!(trained.result_text().as_deref(), Some("8"), "{:?}", trained.error());
    let fell = kernel.execute("losses[7] < losses[0]").await;
    assert_eq!(fell.result_text().as_deref(), Some("true"), "{:?} {:?}", fell.error(), kernel.execute("losses").await.result_text());

    // AdamW over the same variables, in a later cell: the model and the batch were kept.
    let adam = kernel
        .execute(
            "let mut adam = candle_nn::AdamW::new(varmap.all_vars(), candle_nn::ParamsAdamW { lr: 0.01, ..Default::default() })?;\n\
             let loss = candle_nn::loss::cross_entropy(&head.forward(&model.forward(&xs)?)?, &ys)?;\n\
             adam.backward_step(&loss)?;\n\
             varmap.all_vars().len()",
        )
        .await;
    assert_eq!(adam.result_text().as_deref(), Some("6"), "conv and fc and head, weight and bias each: {:?}", adam.error());
}

/// A variable whose type no cell could name is refused with what to write instead, and the
/// kernel and the variables kept before it go on.
#[tokio::test(flavor = "multi_thread")]
async fn a_variable_of_a_type_no_cell_can_name_is_refused_with_what_to_write() {
    let mut kernel = Kernel::start().await;
    kernel.execute("let kept = 41;").await;
    kernel.execute("mod shop { mod sealed { pub struct Receipt(pub u32); } pub fn buy() -> sealed::Receipt { sealed::Receipt(7) } }").await;
    let refused = kernel.execute("let receipt = shop::buy();\nlet n: u32 = \"2\".parse()?;").await;
    let error = refused.error().expect("the variable cannot be kept");
    assert!(
        error.evalue.contains("`receipt`")
            && error.evalue.contains("shop::sealed::Receipt")
            && error.evalue.contains("let receipt: ")
            && error.evalue.contains("inside a block"),
        "{}",
        error.evalue
    );
    assert!(!error.evalue.contains("`?`"), "the `?` is not the problem: {}", error.evalue);
    let in_block = kernel.execute("{ let receipt = shop::buy(); receipt.0 }").await;
    assert_eq!(in_block.result_text().as_deref(), Some("7"), "{:?}", in_block.error());
    assert_eq!(kernel.execute("kept + 1").await.result_text().as_deref(), Some("42"));
}

/// `%summary` and `%oomcheck` on a candle model in a cell measure it, and whatever is not a model,
/// or a model whose forward fails at the input asked for, is a one-line usage error that leaves the
/// kernel and the learner's variables as they were.
#[tokio::test(flavor = "multi_thread")]
async fn the_magics_measure_a_candle_module_and_refuse_what_is_not_a_model_in_one_line() {
    let mut kernel = Kernel::start().await;
    let built = kernel
        .execute(
            "use candle_core::{DType, Device};\n\
             use candle_nn::{Module, VarBuilder, VarMap};\n\
             let varmap = VarMap::new();\n\
             let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);\n\
             let mlp = candle_nn::seq().add(candle_nn::linear(784, 64, vb.pp(\"fc1\"))?).add_fn(|x| x.relu()).add(candle_nn::linear(64, 10, vb.pp(\"fc2\"))?);\n\
             let count = 7usize;",
        )
        .await;
    assert_eq!(built.reply.status, ReplyStatus::Ok, "{:?}", built.error());

    let summary = kernel.execute("%summary mlp --input 16x784").await;
    assert_eq!(summary.reply.status, ReplyStatus::Ok, "{:?}", summary.error());
    let text = summary.result_text().unwrap();
    assert!(text.contains("measured") && text.contains("matmul"), "{text}");
    let check = kernel.execute("%oomcheck mlp --input 4096x784 --gpu 8GiB").await;
    assert_eq!(check.reply.status, ReplyStatus::Ok, "{:?}", check.error());
    let text = check.result_text().unwrap();
    assert!(text.contains("FITS") && text.contains("extrapolated"), "{text}");

    for (cell, names) in [
        ("%oomcheck count --input 8x784", "count"),
        ("%summary mlp --input 8x3x32x32", "forward"),
        ("%oomcheck mlp --input 8", "BATCHxDIMS"),
    ] {
        let failed = kernel.execute(cell).await;
        let error = failed.error().unwrap_or_else(|| panic!("{cell} should fail"));
        let first = error.evalue.lines().next().unwrap_or_default();
        assert!(first.contains(names) && error.evalue.lines().count() <= 3, "{cell}: {}", error.evalue);
        assert!(!error.evalue.contains("trait") && !error.evalue.contains("panicked"), "{cell}: {}", error.evalue);
    }
    let kept = kernel.execute("count + varmap.all_vars().len()").await;
    assert_eq!(kept.result_text().as_deref(), Some("11"), "the variables survive: {:?}", kept.error());
}

/// Every form of `use` a file takes works in a cell as it would there, and
/// what it names stays named in later cells and items: renames inside
/// braces, `self` renamed, nested braces, braces with no path before them,
/// globs, `pub use`, `_`, and `use` inside a block.
#[tokio::test(flavor = "multi_thread")]
async fn every_form_of_use_works_in_cells_as_in_a_file() {
    let mut kernel = Kernel::start().await;
    let cells = [
        ("use std::collections::{self as coll, BTreeMap as Tree};", None),
        ("coll::HashSet::<u8>::new().len() + Tree::<u8, u8>::new().len()", Some("0")),
        ("use {std::fmt::Write as _, std::cmp::{self, Ordering}};", None),
        ("let mut text = String::new(); write!(text, \"{}\", cmp::max(3, 4)).unwrap(); text", Some("\"4\"")),
        ("format!(\"{:?}\", 1.cmp(&2) == Ordering::Less)", Some("\"true\"")),
        ("use std::sync::{{atomic::{self, AtomicU8}}, Arc};", None),
        ("fn shared() -> Arc<AtomicU8> { Arc::new(AtomicU8::new(7)) }", None),
        ("shared().load(atomic::Ordering::Relaxed)", Some("7")),
        ("pub use std::iter::{self as it};", None),
        ("it::repeat(2).take(3).sum::<i32>()", Some("6")),
        ("use std::f64::consts::*;", None),
        ("(PI * 100.0).round() as i64", Some("314")),
        ("{ use std::num::NonZeroU8 as Nz; Nz::new(5).unwrap().get() }", Some("5")),
    ];
    for (code, expected) in cells {
        let run = kernel.execute(code).await;
        assert_eq!(run.reply.status, ReplyStatus::Ok, "{code}: {:?}", run.error());
        if let Some(expected) = expected {
            assert_eq!(run.result_text().as_deref(), Some(expected), "{code}");
        }
    }
}

/// The compiler a cell's `:timing` line names: `cargo`, or `rustc` run alone as cargo last ran it.
fn compiled_by(run: &common::Execution) -> &'static str {
    let took = run.stdout();
    if took.contains("Final compile (rustc)") {
        "rustc"
    } else if took.contains("Final compile (cargo)") {
        "cargo"
    } else {
        panic!("no compile in {took:?}")
    }
}

/// A warm cell is compiled by rustc alone, as cargo compiled the cell before it; whatever cargo
/// would act on sends the cell to cargo again: a `:dep` added, a path dependency's source
/// changed. A cell that names none of the stored `use` items compiles without them, and one
/// that may need them (a trait's method, a path) gets them all.
#[tokio::test(flavor = "multi_thread")]
async fn warm_cells_skip_cargo_until_the_dependencies_or_their_sources_change() {
    let tiny = tempfile::tempdir().unwrap();
    std::fs::create_dir(tiny.path().join("src")).unwrap();
    std::fs::write(tiny.path().join("Cargo.toml"), "[package]\nname = \"tiny\"\nversion = \"0.1.0\"\nedition = \"2021\"\n").unwrap();
    let source = |value: u32| {
        format!(
            "pub fn value() -> u32 {{ {value} }}\npub trait Twice {{ fn twice(&self) -> u32; }}\n\
             impl Twice for u32 {{ fn twice(&self) -> u32 {{ self * 2 }} }}\n"
        )
    };
    std::fs::write(tiny.path().join("src/lib.rs"), source(1)).unwrap();

    let mut kernel = Kernel::start().await;
    kernel.execute(":timing").await;
    let ok = |run: &common::Execution, code: &str| assert_eq!(run.reply.status, ReplyStatus::Ok, "{code}: {:?}", run.error());
    let warm = kernel.execute("1 + 1").await;
    assert_eq!((warm.result_text().as_deref(), compiled_by(&warm)), (Some("2"), "rustc"), "{}", warm.stdout());

    let dep = format!(":dep tiny = {{ path = {:?} }}\ntiny::value()", tiny.path().display().to_string());
    let added = kernel.execute(&dep).await;
    ok(&added, &dep);
    assert_eq!((added.result_text().as_deref(), compiled_by(&added)), (Some("1"), "cargo"), "a :dep goes to cargo");
    for code in ["use tiny::{value, Twice};", "let n: u32 = 21;"] {
        ok(&kernel.execute(code).await, code);
    }
    for (code, expected) in [("1 + 1", "2"), ("value()", "1"), ("n.twice()", "42"), ("n", "21")] {
        let run = kernel.execute(code).await;
        ok(&run, code);
        assert_eq!((run.result_text().as_deref(), compiled_by(&run)), (Some(expected), "rustc"), "{code}: {}", run.stdout());
    }

    // The path dependency's source changes: cargo rebuilds it, and the cells see the new code.
    std::fs::write(tiny.path().join("src/lib.rs"), source(2)).unwrap();
    let changed = kernel.execute("value()").await;
    ok(&changed, "value()");
    assert_eq!((changed.result_text().as_deref(), compiled_by(&changed)), (Some("2"), "cargo"), "{}", changed.stdout());
    let after = kernel.execute("value() + n.twice()").await;
    assert_eq!((after.result_text().as_deref(), compiled_by(&after)), (Some("44"), "rustc"), "{}", after.stdout());

    // An error in the cell is the cell's error, and the next cell still skips cargo.
    let wrong = kernel.execute("1 + \"a\"").await;
    let error = wrong.error().expect("a type error");
    assert_eq!(error.ename, "CompilationError", "{error:?}");
    let next = kernel.execute("value()").await;
    assert_eq!((next.result_text().as_deref(), compiled_by(&next)), (Some("2"), "rustc"), "{}", next.stdout());

    // A second :dep (a crate from the registry) after cells compiled by rustc alone takes effect.
    let itoa = kernel.execute(":dep itoa = \"1\"\nitoa::Buffer::new().format(1234).len()").await;
    assert_eq!((itoa.result_text().as_deref(), compiled_by(&itoa)), (Some("4"), "cargo"), "{:?}", itoa.error());
    let again = kernel.execute("itoa::Buffer::new().format(7).len() + value() as usize").await;
    assert_eq!((again.result_text().as_deref(), compiled_by(&again)), (Some("3"), "rustc"), "{}", again.stdout());
}
