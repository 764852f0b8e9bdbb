use std::time::Duration;

use rand::Rng as _;

use super::*;

/// Samples whose pixels are their index plus one random draw; `fail` never
/// loads; samples from `masked_from` on carry a mask of pixel classes.
struct Numbers {
    n: usize,
    fail: Option<usize>,
    odd_shape: Option<usize>,
    masked_from: Option<usize>,
}

impl Numbers {
    fn new(n: usize) -> Self {
        Numbers { n, fail: None, odd_shape: None, masked_from: None }
    }
}

impl Dataset for Numbers {
    fn len(&self) -> usize {
        self.n
    }

    fn label(&self, index: usize) -> u32 {
        (index % 3) as u32
    }

    fn load(&self, index: usize, rng: &mut Rng, gauge: &MemoryGauge) -> Result<Example, DataError> {
        if self.fail == Some(index) {
            return Err(DataError::Decode { path: format!("img{index}.jpg").into(), message: "corrupt".into() });
        }
        let _decode = gauge.hold(1000);
        let side = if self.odd_shape == Some(index) { 3 } else { 2 };
        let noise: f32 = rng.random();
        let masked = self.masked_from.is_some_and(|from| index >= from);
        Ok(Example {
            pixels: vec![index as f32 + noise; 3 * side * side],
            shape: [3, side, side],
            label: self.label(index),
            mask: masked.then(|| (0..side * side).map(|p| ((index + p) % 3) as u8).collect()),
            timing: LoadTiming { encoded_bytes: 10, ..Default::default() },
        })
    }
}

fn collect(loader: &DataLoader<Numbers>, epoch: u64) -> Vec<(Vec<usize>, Vec<f32>)> {
    loader
        .epoch(epoch)
        .map(|b| {
            let b = b.unwrap();
            (b.indices.clone(), b.images.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect()
}

fn config(workers: usize) -> LoaderConfig {
    LoaderConfig { batch_size: 4, num_workers: workers, seed: 9, ..LoaderConfig::default() }
}

#[test]
fn order_and_augmentation_do_not_depend_on_the_number_of_workers() {
    let inline = collect(&DataLoader::new(Numbers::new(22), config(0)).unwrap(), 1);
    for workers in [1, 2, 3] {
        let threaded = collect(&DataLoader::new(Numbers::new(22), config(workers)).unwrap(), 1);
        assert_eq!(inline, threaded, "{workers} workers");
    }
    let seen: std::collections::BTreeSet<usize> = inline.iter().flat_map(|(i, _)| i.clone()).collect();
    assert_eq!(seen.len(), 22);
    assert_eq!(inline.len(), 6);
    let other_epoch = collect(&DataLoader::new(Numbers::new(22), config(0)).unwrap(), 2);
    assert_ne!(inline, other_epoch, "each epoch reshuffles");
}

#[test]
fn batches_are_tensors_with_labels_and_drop_last_drops_the_short_one() {
    let loader = DataLoader::new(Numbers::new(10), LoaderConfig { drop_last: true, shuffle: false, ..config(2) }).unwrap();
    assert_eq!(loader.len(), 2);
    let batches: Vec<Batch> = loader.epoch(0).map(Result::unwrap).collect();
    assert_eq!(batches.len(), 2);
    assert_eq!(batches[0].images.dims(), &[4, 3, 2, 2]);
    assert_eq!(batches[0].labels.to_vec1::<u32>().unwrap(), vec![0, 1, 2, 0]);
    assert_eq!(batches[1].indices, vec![4, 5, 6, 7]);
    assert_eq!(batches[0].timing.encoded_bytes, 40);
    let keep = DataLoader::new(Numbers::new(10), LoaderConfig { shuffle: false, ..config(0) }).unwrap();
    assert_eq!(keep.epoch(0).last().unwrap().unwrap().len(), 2);
}

#[test]
fn weighted_sampler_balances_classes() {
    let labels: Vec<u32> = (0..400).map(|i| if i < 360 { 0 } else { 1 }).collect();
    let sampler = Sampler::balanced(&labels);
    let loader = DataLoader::new(Numbers::new(400), LoaderConfig { sampler, ..config(0) }).unwrap();
    let order = loader.order(0);
    assert_eq!(order.len(), 400);
    let rare = order.iter().filter(|&&i| i >= 360).count();
    assert!((150..250).contains(&rare), "rare class drawn {rare} of 400");
    assert_eq!(order, loader.order(0));
    let bad = LoaderConfig { sampler: Sampler::Weighted { weights: vec![1.0; 3], num_samples: 5 }, ..config(0) };
    assert!(DataLoader::new(Numbers::new(4), bad).is_err());
}

#[test]
fn a_failing_sample_ends_the_epoch_or_is_skipped_by_policy() {
    for workers in [0, 2] {
        let failing = Numbers { fail: Some(5), ..Numbers::new(12) };
        let loader = DataLoader::new(failing, LoaderConfig { shuffle: false, ..config(workers) }).unwrap();
        let results: Vec<_> = loader.epoch(0).collect();
        assert_eq!(results.len(), 2, "stops after the error");
        assert!(results[1].as_ref().unwrap_err().to_string().contains("img5.jpg"));

        let failing = Numbers { fail: Some(5), ..Numbers::new(12) };
        let loader = DataLoader::new(failing, LoaderConfig { shuffle: false, skip_errors: true, ..config(workers) }).unwrap();
        let batches: Vec<Batch> = loader.epoch(0).map(Result::unwrap).collect();
        assert_eq!(batches[1].indices, vec![4, 6, 7]);
        assert!(batches[1].skipped[0].contains("img5.jpg"));
    }
}

#[test]
fn mixed_sample_sizes_are_a_clear_error() {
    let odd = Numbers { odd_shape: Some(2), ..Numbers::new(8) };
    let loader = DataLoader::new(odd, LoaderConfig { shuffle: false, ..config(0) }).unwrap();
    let err = loader.epoch(0).next().unwrap().unwrap_err().to_string();
    assert!(err.contains("sample 2") && err.contains("[3, 3, 3]"), "{err}");
}

#[test]
fn measured_host_memory_reaches_workers_times_prefetch_and_stays_under_the_estimate() {
    let (workers, prefetch) = (2, 3);
    let loader = DataLoader::new(Numbers::new(64), LoaderConfig { prefetch, ..config(workers) }).unwrap();
    let batch_bytes = 4 * (3 * 2 * 2 * 4 + 4) as u64;
    let mut epoch = loader.epoch(0);
    let first = epoch.next().unwrap().unwrap();
    // A slow training step: the queues fill up meanwhile.
    std::thread::sleep(Duration::from_millis(300));
    let peak = loader.gauge().peak();
    drop(first);
    let estimate = loader.footprint([3, 2, 2], (1000, 1)).batches_in_flight * batch_bytes + workers as u64 * 1000;
    assert!(peak >= (workers * prefetch) as u64 * batch_bytes, "peak {peak}");
    assert!(peak <= estimate, "peak {peak} above the estimate {estimate}");
    drop(epoch);
    assert_eq!(loader.gauge().current(), 0, "dropping the epoch releases every batch");
}

#[test]
fn stopping_early_joins_the_workers() {
    let loader = DataLoader::new(Numbers::new(200), config(2)).unwrap();
    let mut epoch = loader.epoch(0);
    assert!(epoch.next().unwrap().is_ok());
    drop(epoch);
    assert!(DataLoader::new(Numbers::new(4), LoaderConfig { batch_size: 0, ..config(0) }).is_err());
    assert!(DataLoader::new(Numbers::new(0), config(0)).is_err());
}

#[test]
fn a_host_budget_kills_the_worker_that_crosses_it_and_fewer_workers_fit() {
    let budget = 2000;
    let config = |workers| LoaderConfig { host_budget: Some(budget), num_workers: workers, prefetch: 4, ..config(workers) };
    let mut inline = DataLoader::new(Numbers::new(200), config(0)).unwrap().epoch(0);
    assert!(inline.all(|batch| batch.is_ok()), "one batch and one decode at a time fit in {budget} bytes");
    let loader = DataLoader::new(Numbers::new(200), config(4)).unwrap();
    let mut failure = None;
    for batch in loader.epoch(0) {
        // A slow training step: the workers fill their queues meanwhile.
        std::thread::sleep(Duration::from_millis(20));
        if let Err(err) = batch {
            failure = Some(err);
            break;
        }
    }
    let err = failure.expect("4 workers x prefetch 4 queue more than the host budget").to_string();
    assert!(err.starts_with("DataLoader worker ") && err.contains("was killed"), "{err}");
    assert!(err.contains("4 workers x prefetch 4") && err.contains("not the GPU's"), "{err}");
    assert!(DataLoader::new(Numbers::new(4), LoaderConfig { host_budget: Some(0), ..config(0) }).is_err());
}

#[test]
fn samples_with_masks_give_n_by_h_by_w_labels() {
    let masked = Numbers { masked_from: Some(0), ..Numbers::new(10) };
    let loader = DataLoader::new(masked, LoaderConfig { shuffle: false, ..config(2) }).unwrap();
    let batches: Vec<Batch> = loader.epoch(0).map(Result::unwrap).collect();
    assert_eq!(batches[0].images.dims(), &[4, 3, 2, 2]);
    assert_eq!(batches[0].labels.dims(), &[4, 2, 2]);
    assert_eq!(batches[0].labels.dtype(), candle_core::DType::U32);
    assert_eq!(batches[1].labels.to_vec3::<u32>().unwrap()[1], vec![vec![2, 0], vec![1, 2]], "sample 5, rows of its mask");
    assert_eq!(batches[2].labels.dims(), &[2, 2, 2]);
}

#[test]
fn a_batch_mixing_samples_with_and_without_masks_is_an_error_naming_the_sample() {
    let mixed = Numbers { masked_from: Some(2), ..Numbers::new(8) };
    let loader = DataLoader::new(mixed, LoaderConfig { shuffle: false, ..config(0) }).unwrap();
    let err = loader.epoch(0).next().unwrap().unwrap_err().to_string();
    assert!(err.contains("sample 2 carries a mask") && err.contains("first sample carries none"), "{err}");
    let apart = Numbers { masked_from: Some(4), ..Numbers::new(8) };
    let loader = DataLoader::new(apart, LoaderConfig { shuffle: false, ..config(0) }).unwrap();
    let dims: Vec<Vec<usize>> = loader.epoch(0).map(|b| b.unwrap().labels.dims().to_vec()).collect();
    assert_eq!(dims, vec![vec![4], vec![4, 2, 2]], "each batch is of one kind");
}

/// Two processes' parts of an epoch: the same number of samples each, every
/// sample of the epoch in one of them, the shortfall padded from the
/// epoch's start, and the same shuffle on both (a shared seed).
#[test]
fn each_process_takes_its_part_of_the_same_shuffled_epoch() {
    let part = |rank| {
        let config = LoaderConfig { batch_size: 2, part: Some(Part { rank, ranks: 2 }), ..LoaderConfig::default() };
        DataLoader::new(Numbers::new(11), config).unwrap()
    };
    let whole = DataLoader::new(Numbers::new(11), LoaderConfig { batch_size: 2, ..LoaderConfig::default() }).unwrap();
    for epoch in 0..3 {
        let (first, second) = (part(0).order(epoch), part(1).order(epoch));
        assert_eq!((first.len(), second.len()), (6, 6));
        let order = whole.order(epoch);
        let mut interleaved: Vec<usize> = first.iter().zip(&second).flat_map(|(a, b)| [*a, *b]).collect();
        assert_eq!(interleaved.pop(), Some(order[0]), "the twelfth sample pads from the epoch's start");
        assert_eq!(interleaved, order);
    }
    assert_eq!((part(0).len(), part(1).len()), (3, 3));
    let past = LoaderConfig { part: Some(Part { rank: 2, ranks: 2 }), ..LoaderConfig::default() };
    let Err(err) = DataLoader::new(Numbers::new(11), past) else { panic!("a rank past the ranks is refused") };
    assert!(err.to_string().contains("part 2 of 2"), "{err}");
}
