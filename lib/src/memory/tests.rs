use std::time::Duration;

use super::probes::answer::Answer;
use super::probes::counters::Counters;
use super::probes::region::{self, Region, Request};
use super::*;
use crate::render::Render;

fn snapshot() -> Snapshot {
    let predicted = BillBytes { parameters: 100 << 20, activations: 200 << 20, ..Default::default() };
    let mut measured = predicted;
    measured.activations = 210 << 20;
    Snapshot {
        label: "small-cnn, batch 8".into(),
        predicted: Some(Prediction {
            bills: predicted,
            peak: 300 << 20,
            phases: vec![PredictedPhase { name: "forward".into(), resident: 250 << 20, peak: 300 << 20 }],
        }),
        measured: Some(Measurement {
            bills: measured,
            peak: 310 << 20,
            phases: vec![
                MeasuredPhase { name: "input copy".into(), bills: BillBytes { parameters: 100 << 20, ..Default::default() } },
                MeasuredPhase { name: "forward".into(), bills: measured },
            ],
        }),
    }
}

#[test]
fn budgets_are_sizes_or_cards_never_the_host() {
    let (context, workspace) = (crate::gpus::GENERIC_CONTEXT_BYTES, crate::ops::CUDNN_WORKSPACE_BYTES);
    assert_eq!(Budget::parse("8GiB").unwrap(), Budget { usable: 8 << 30, context, workspace });
    assert_eq!(Budget::parse("512MiB").unwrap().room(), (512 << 20) - context - workspace);
    let laptop = Budget::parse("rtx4060-laptop").unwrap();
    let card = crate::gpus::Card::parse("rtx4060-laptop").unwrap();
    assert_eq!((laptop.usable, laptop.context), (card.usable_bytes, card.context_bytes), "the card %oomcheck --gpu judges");
    let err = Budget::parse("cpu").unwrap_err().to_string();
    assert!(err.contains("no budget to simulate"), "{err}");
    for (text, names) in [
        ("0", "give a unit"),
        ("0GiB", "positive"),
        ("300MiB", "nothing for training"),
        ("364MiB", "300 MiB CUDA context and 64.0 MiB cuDNN workspace"),
        ("-1GiB", "-1GiB"),
        ("nonsense", "nonsense"),
        ("rtx9999", "rtx9999"),
    ] {
        let err = Budget::parse(text).unwrap_err().to_string();
        assert!(err.starts_with(&format!("budget `{text}`:")) && err.contains(names) && err.lines().count() == 1, "{err}");
    }
}

#[test]
fn out_of_memory_reads_like_cuda_and_says_it_is_simulated() {
    let oom = OutOfMemory {
        requested: 64 << 20,
        in_use: 500 << 20,
        held: 530 << 20,
        budget: Budget { usable: 876 << 20, context: 300 << 20, workspace: 64 << 20 },
        others: 0,
        phase: None,
    };
    assert_eq!(
        oom.to_string(),
        "out of memory (simulated device budget, CPU): tried to allocate 64.0 MiB; budget 876 MiB, of which 300 MiB CUDA context, 64.0 MiB cuDNN workspace and 500 MiB in use; 530 MiB held by the host allocator"
    );
    assert_eq!(oom.free(), 12 << 20);
    assert!(oom.clone().during("forward layer3").to_string().contains("tried to allocate 64.0 MiB during forward layer3; budget"));
    let shared = OutOfMemory { others: 8 << 20, ..oom.clone() };
    assert!(shared.to_string().contains("64.0 MiB cuDNN workspace, 8.00 MiB other processes on this card and 500 MiB in use"));
    assert_eq!(shared.free(), 4 << 20);
    let candle: candle_core::Error = oom.into();
    assert!(candle.to_string().contains("tried to allocate 64.0 MiB"));
}

#[test]
fn the_report_puts_bills_side_by_side_with_their_difference() {
    let memory = HostMemory {
        exact: true,
        in_use: 64 << 20,
        held: 80 << 20,
        peak: Some(128 << 20),
        rss: 90 << 20,
        hwm: 140 << 20,
        allocations: Some(10),
        budget: Some(Budget { usable: (1 << 30) + (364 << 20), context: 300 << 20, workspace: 64 << 20 }),
    };
    let report = MemReport {
        pid: 42,
        memory,
        host: Some((1 << 30, 2 << 30)),
        snapshot: Some(snapshot()),
        emptied: None,
        peak_reset: false,
        card: None,
        #[cfg(feature = "cuda")]
        cuda: super::probes::cuda::CellCuda::NotInUse,
    };
    let text = report.bundle().text().to_owned();
    assert!(text.contains("cell process 42"), "{text}");
    assert!(text.contains("16.0 MiB"), "idle = held - in use: {text}");
    assert!(text.contains("960 MiB / 1.36 GiB"), "budget free/total, the context and the workspace in use: {text}");
    assert!(text.contains("+5.0%"), "activations 210 vs 200: {text}");
    assert!(text.contains("+3.3%"), "peak 310 vs 300: {text}");
    assert!(text.contains("simulated"), "{text}");
    assert_eq!(
        report.brief(),
        "in use 64.0 MiB | held 80.0 MiB | peak 128 MiB | RSS 90.0 MiB (high-water 140 MiB) | simulated budget 1.36 GiB \
         (300 MiB of it CUDA context, 64.0 MiB cuDNN workspace)\nregistered: small-cnn, batch 8: peak predicted 300 MiB, measured 310 MiB (+3.3%)\n"
    );
    let reset = MemReport { peak_reset: true, ..report };
    let text = reset.bundle().text().to_owned();
    assert!(text.contains("(unchanged; %mem shows its bills)") && !text.contains("+3.3%"), "an action names the step once: {text}");
    let plain = MemReport { snapshot: None, ..reset }.bundle().text().to_owned();
    assert!(plain.contains("No prediction or measurement registered"), "{plain}");
}

#[test]
fn the_plot_stacks_measured_bills_under_the_prediction() {
    let bundle = plot(Some(&snapshot()));
    let html = bundle.get("text/html").and_then(|h| h.as_str()).unwrap();
    assert!(html.contains("<svg") && html.contains("predicted peak since the previous sample"), "{html}");
    assert!(bundle.text().contains("input copy"), "{}", bundle.text());
    assert!(plot(None).text().starts_with("No step timeline registered"));
    let no_phases = Snapshot { measured: None, ..snapshot() };
    assert!(plot(Some(&no_phases)).text().starts_with("No step timeline registered"));
}

#[test]
fn a_phase_that_frees_memory_is_predicted_to_peak_at_what_the_phase_before_left() {
    let phase = |name: &str, resident: u64, peak: u64| PredictedPhase { name: name.into(), resident: resident << 20, peak: peak << 20 };
    let bills = |in_use: u64, peak: u64| BillBytes {
        activations: in_use << 20,
        context_and_workspace: (peak - in_use) << 20,
        ..Default::default()
    };
    let snapshot = Snapshot {
        label: "step".into(),
        predicted: Some(Prediction {
            bills: BillBytes::default(),
            peak: 295 << 20,
            phases: vec![phase("backward", 270, 295), phase("optimizer step", 270, 270), phase("step done", 180, 180)],
        }),
        measured: Some(Measurement {
            bills: BillBytes::default(),
            peak: 295 << 20,
            phases: vec![
                MeasuredPhase { name: "backward".into(), bills: bills(270, 295) },
                MeasuredPhase { name: "step done".into(), bills: bills(180, 270) },
            ],
        }),
    };
    let text = timeline_table(&snapshot).unwrap().to_string();
    let done = text.lines().find(|l| l.contains("step done")).unwrap();
    let figures: Vec<&str> = done.split_whitespace().filter(|w| w.chars().all(|c| c.is_ascii_digit())).collect();
    assert_eq!(figures, ["2", "180", "180", "270", "270"], "in use after 180 both; peak since the sample before 270 both: {text}");
}

#[test]
fn cell_usage_reports_peak_and_net_change() {
    let usage = CellUsage { before: 10 << 20, after: 8 << 20, peak: 74 << 20 };
    assert_eq!(usage.increment(), 64 << 20);
    assert_eq!(usage.net(), -(2 << 20));
    assert_eq!(
        usage.bundle().text(),
        "peak memory: 74.0 MiB (+64.0 MiB during the cell), net change: -2.00 MiB (in use 10.0 MiB -> 8.00 MiB)\n"
    );
}

fn region() -> &'static Counters {
    let counters = Region::anonymous().unwrap().leak();
    counters.region_bytes.store(region::REGION_BYTES as u64, std::sync::atomic::Ordering::Relaxed);
    counters
}

#[test]
fn snapshots_round_trip_through_a_region_and_too_large_ones_are_refused() {
    let counters = region();
    assert!(region::read_snapshot(counters).is_none());
    let bytes = serde_json::to_vec(&snapshot()).unwrap();
    region::write_snapshot(counters, &bytes).unwrap();
    assert_eq!(region::read_snapshot(counters).unwrap(), bytes);
    let huge = vec![b' '; region::SNAPSHOT_CAPACITY + 1];
    assert!(matches!(region::write_snapshot(counters, &huge), Err(MemoryError::SnapshotTooLarge { .. })));
}

#[test]
fn requests_are_answered_by_the_serving_thread_and_silence_times_out() {
    let counters = region();
    assert_eq!(region::ask(counters, Request::Sample, Duration::from_millis(20)), None);
    std::thread::spawn(move || region::serve(counters, |request| Answer { held: request as u64, rss: 7, ..Answer::default() }));
    let answer = region::ask(counters, Request::EmptyCache, Duration::from_secs(5)).unwrap();
    assert_eq!((answer.held, answer.rss), (2, 7));
    let answer = region::ask(counters, Request::Sample, Duration::from_secs(5)).unwrap();
    assert_eq!((answer.held, answer.rss), (1, 7));
}

#[test]
fn counters_count_blocks_track_the_peak_and_flag_the_first_overrun() {
    let counters = region();
    Budget::set_in(Some(Budget { usable: 1100, context: 60, workspace: 40 }), counters);
    counters.allocated(600);
    assert_eq!(counters.take_overrun(), None);
    counters.allocated(500);
    counters.allocated(10);
    assert_eq!(counters.take_overrun(), Some((500, 600)), "the first allocation past the budget");
    counters.allocated(10);
    assert_eq!(counters.take_overrun(), Some((500, 600)), "still over: the same error, not the allocations made meanwhile");
    counters.freed(400);
    assert_eq!(counters.take_overrun(), None, "back under the budget");
    counters.allocated(300);
    assert_eq!(counters.take_overrun(), Some((300, 720)), "a new overrun");
    counters.freed(300);
    counters.freed(1110);
    assert_eq!((counters.in_use(), counters.peak()), (0, 1120));
    counters.reset_peak();
    assert_eq!(counters.peak(), 0);
    counters.freed(5);
    assert_eq!(counters.in_use(), 0, "never below zero");
}

#[test]
fn without_counters_probes_sample_and_say_so() {
    let sample = HostMemory::sample();
    assert!(!sample.exact && sample.peak.is_none());
    assert!(sample.rss > 0 && sample.held > 0);
    assert!(sample.to_string().contains("not exact"), "{sample}");
    assert!(matches!(set_budget(Some(Budget { usable: 1 << 30, context: 0, workspace: 0 })), Err(MemoryError::NotCounting { .. })));
    assert_eq!(check_budget(), Ok(()));
    publish(&snapshot()).unwrap();
    assert_eq!(published(), Some(snapshot()));
}

#[test]
fn the_process_card_keeps_its_blocks_between_calls_and_empties_its_cache() {
    install_card(SimulatedCard::new(1 << 30));
    let a = card_allocate(300 << 20).unwrap();
    let b = card_allocate(300 << 20).unwrap();
    card_free(a).unwrap();
    let stats = card_stats().unwrap();
    assert_eq!((stats.allocated, stats.reserved), (300 << 20, 600 << 20), "a freed block stays cached: {stats}");
    let err = card_allocate_outside(600 << 20).unwrap_err();
    assert!(matches!(&err, CardError::OutOfMemory(oom) if oom.fragmented()), "{err}");
    assert_eq!(card_empty_cache(), 300 << 20);
    assert!(card_allocate_outside(600 << 20).is_ok(), "the emptied cache gave its segment back to the device");
    assert!(matches!(card_free(a), Err(CardError::Pool(_))), "freed twice");
    card_free(b).unwrap();
    remove_card();
    assert!(matches!(card_allocate(1), Err(CardError::NoCard)));
    assert_eq!(card_empty_cache(), 0);
}

#[test]
fn what_other_processes_on_the_card_hold_narrows_the_budget_and_an_ended_one_no_longer_counts() {
    use std::sync::atomic::Ordering::Relaxed;
    let counters = region();
    Budget::set_in(Some(Budget { usable: 100 << 20, context: 10 << 20, workspace: 0 }), counters);
    counters.others.store(50 << 20, Relaxed);
    counters.allocated(45 << 20);
    counters.others.store(0, Relaxed);
    assert_eq!(counters.take_overrun(), None, "judged again once the other process has ended, 45 + 10 MiB fit");
    counters.others.store(50 << 20, Relaxed);
    counters.allocated(1 << 20);
    assert_eq!(counters.take_overrun(), Some((1 << 20, 45 << 20)), "46 + 10 + 50 MiB do not fit in 100");
}
