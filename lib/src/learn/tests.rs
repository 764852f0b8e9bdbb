use rand::Rng as _;

use super::*;
use crate::data::{group_split, rng_for, ImageFolder, OnError};

/// `per_class` noisy 24x24 PNGs of two colours: a task any CNN learns in a few dozen steps.
fn two_colours(root: &std::path::Path, per_class: usize) {
    for (c, (class, rgb)) in [("green", [40.0, 160.0, 50.0]), ("red", [200.0, 60.0, 40.0])].into_iter().enumerate() {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for i in 0..per_class {
            let mut rng = rng_for(3, c as u64, i as u64);
            let image = image::RgbImage::from_fn(24, 24, |_, _| {
                image::Rgb([0, 1, 2].map(|k| (rgb[k] + rng.random_range(-50.0..50.0f32)).clamp(0.0, 255.0) as u8))
            });
            image.save(root.join(class).join(format!("{i:03}.png"))).unwrap();
        }
    }
}

fn open_and_split(root: &std::path::Path) -> (ImageFolder, crate::data::Split) {
    let folder = ImageFolder::open(root, OnError::Fail).unwrap();
    let split = group_split(&folder.labels(), &folder.groups(), 0.25, 0).unwrap();
    (folder, split)
}

/// Two epochs of batch 4 at 16x16 with Adam, one worker, no baseline.
fn quick() -> LearnConfig {
    LearnConfig {
        res: 16,
        epochs: 2,
        batch_size: 4,
        optimizer: OptimizerConfig::for_kind(crate::ledger::OptimizerKind::Adam, 0.01),
        workers: 1,
        baseline: false,
        ..LearnConfig::default()
    }
}

#[test]
fn the_trainer_learns_through_the_loader() {
    let dir = tempfile::tempdir().unwrap();
    two_colours(dir.path(), 64);
    let (folder, split) = open_and_split(dir.path());
    let config = quick();
    let mut steps = 0;
    let report = fit_folder(&folder, &split, &config, &Device::Cpu, &mut |e| steps += matches!(e, TrainEvent::Step(_)) as usize).unwrap();
    assert_eq!(steps, 2 * (split.train.len() / 4), "every full batch of both epochs was a step");
    assert_eq!(report.epochs.len(), 2);
    assert!(report.epochs[1].train_loss < report.epochs[0].train_loss, "{:?}", report.epochs);
    assert!(report.val_accuracy >= 0.9, "chance is 0.5: {report:?}");
    assert_eq!(report.per_class.iter().map(|s| s.val_images).sum::<usize>(), split.val.len());
    assert!(report.per_class.iter().all(|s| s.symptom.is_none() && s.baseline_accuracy.is_none()));
    assert!(report.table().to_string().contains("small-cnn at 16x16, 2 epochs"));
}

#[test]
fn the_loader_as_a_batch_source_gives_its_batches_and_names_a_broken_file() {
    let dir = tempfile::tempdir().unwrap();
    two_colours(dir.path(), 5);
    let folder = ImageFolder::open(dir.path(), OnError::Fail).unwrap();
    let broken = folder.items[7].path.clone();
    std::fs::write(&broken, b"not a png").unwrap();
    let config = LoaderConfig { batch_size: 4, num_workers: 1, ..LoaderConfig::default() };
    let mut loader = DataLoader::new(folder.all(Transforms::resize(8)), config).unwrap();
    assert_eq!(BatchSource::batches_per_epoch(&loader), 3);
    let expected = loader.batches(1);
    let mut seen = 0;
    let mut failure = None;
    for (position, batch) in BatchSource::epoch(&mut loader, 1).enumerate() {
        match batch {
            Ok((images, labels)) => {
                assert_eq!(images.dims(), &[4, 3, 8, 8]);
                let labels = labels.to_vec1::<u32>().unwrap();
                assert_eq!(labels, expected[position].iter().map(|&i| folder.items[i].label).collect::<Vec<_>>());
                seen += 1;
            }
            Err(err) => failure = Some(err.to_string()),
        }
    }
    let failure = failure.expect("the broken file ends the epoch with an error");
    assert!(failure.contains(&broken.display().to_string()), "{failure}");
    assert!(seen < 3);
}

#[test]
fn mixed_precision_and_accumulation_reach_the_trainer_and_the_confusion_matrix_counts_every_validation_photo() {
    let dir = tempfile::tempdir().unwrap();
    two_colours(dir.path(), 48);
    let (folder, split) = open_and_split(dir.path());
    let config = LearnConfig { accumulation: 2, precision: Precision::F16Amp, cosine: true, ..quick() };
    let mut steps = Vec::new();
    let report = fit_folder(&folder, &split, &config, &Device::Cpu, &mut |e| {
        if let TrainEvent::Step(s) = e {
            steps.push((s.samples, s.loss_scale, s.learning_rate));
        }
    })
    .unwrap();
    assert_eq!(steps.len(), 2 * (split.train.len() / 4 / 2), "one step per two micro-batches");
    assert!(steps.iter().all(|&(samples, scale, _)| samples == 8 && scale.is_some()), "{steps:?}");
    let rates: Vec<f64> = steps.iter().map(|s| s.2).collect();
    assert!(rates.windows(2).all(|w| w[1] < w[0]), "the cosine only falls: {rates:?}");
    assert!(rates[rates.len() - 1] < 0.1 * 0.01 + 1e-12, "it ends near zero: {rates:?}");
    assert_eq!(report.confusion.len(), 2);
    assert_eq!(report.confusion.iter().flatten().sum::<usize>(), split.val.len());
    let diagonal: usize = (0..2).map(|c| report.confusion[c][c]).sum();
    assert_eq!(diagonal as f64 / split.val.len() as f64, report.val_accuracy);
    assert!(report.table().to_string().contains("small-cnn at 16x16, f16 mixed precision, 2 x 4 accumulated, 2 epochs"));
    let confusion = report.confusion_table().to_string();
    assert!(confusion.contains("0 green") && confusion.contains("1 red"), "{confusion}");

    let one_short = LearnConfig { accumulation: split.train.len(), ..config };
    let err = fit_folder(&folder, &split, &one_short, &Device::Cpu, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("cannot fill one optimizer step"), "{err}");
}
