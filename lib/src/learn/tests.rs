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
fn a_vision_transformer_learns_through_the_loader() {
    let dir = tempfile::tempdir().unwrap();
    two_colours(dir.path(), 48);
    let (folder, split) = open_and_split(dir.path());
    let config = LearnConfig {
        model: ModelName::VitTiny,
        res: 32,
        epochs: 3,
        batch_size: 8,
        optimizer: OptimizerConfig::for_kind(crate::ledger::OptimizerKind::AdamW, 3e-4),
        ..quick()
    };
    let report = fit_folder(&folder, &split, &config, &Device::Cpu, &mut |_| ()).unwrap();
    assert!(report.epochs[2].train_loss < report.epochs[0].train_loss, "{:?}", report.epochs);
    assert!(report.val_accuracy >= 0.9, "chance is 0.5: {report:?}");
    assert!(report.table().to_string().contains("vit-tiny at 32x32, 3 epochs"));
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

/// `count` noisy 32x32 green PNGs, each with a red rectangle somewhere, and
/// masks marking the rectangle (class 1): a segmentation any U-Net learns in
/// a few dozen steps.
fn red_patches(root: &std::path::Path, masks: &std::path::Path, count: usize) {
    std::fs::create_dir_all(root.join("leaf")).unwrap();
    std::fs::create_dir_all(masks.join("leaf")).unwrap();
    for i in 0..count {
        let mut rng = rng_for(4, 0, i as u64);
        let (x0, y0) = (rng.random_range(0..20u32), rng.random_range(0..20u32));
        let (w, h) = (rng.random_range(4..12u32), rng.random_range(4..12u32));
        let inside = |x: u32, y: u32| (x0..x0 + w).contains(&x) && (y0..y0 + h).contains(&y);
        let image = image::RgbImage::from_fn(32, 32, |x, y| {
            let rgb = if inside(x, y) { [200.0, 60.0, 40.0] } else { [40.0, 160.0, 50.0] };
            image::Rgb([0, 1, 2].map(|k| (rgb[k] + rng.random_range(-40.0..40.0f32)).clamp(0.0, 255.0) as u8))
        });
        image.save(root.join("leaf").join(format!("{i:03}.png"))).unwrap();
        let classes = (0..32 * 32).map(|p| inside(p % 32, p / 32) as u8).collect();
        crate::data::Mask::new(32, 32, classes).unwrap().write_png(&masks.join("leaf").join(format!("{i:03}.png"))).unwrap();
    }
}

#[test]
fn a_unet_learns_to_segment_through_the_loader_and_a_classifier_is_refused_masks() {
    let dir = tempfile::tempdir().unwrap();
    let (root, masks) = (dir.path().join("images"), dir.path().join("masks"));
    red_patches(&root, &masks, 80);
    let folder = crate::data::SegmentationFolder::open(&root, &masks, 2, OnError::Fail).unwrap();
    let split = group_split(&folder.labels(), &folder.groups(), 0.25, 0).unwrap();
    let config = LearnConfig { model: ModelName::Unet, res: 32, epochs: 4, batch_size: 8, ..quick() };
    let report = fit_segmentation(&folder, &split, &config, &Device::Cpu, &mut |_| {}).unwrap();
    assert_eq!(report.classes, ["not_lesion", "lesion"]);
    assert_eq!(report.commonest_class, 0);
    let lesion = report.val_iou[1].unwrap();
    assert!(lesion > 0.5, "lesion IoU {lesion:.3}, the trivial mask's 0");
    assert!(
        report.val_pixel_accuracy > report.trivial_pixel_accuracy(),
        "{} vs {}",
        report.val_pixel_accuracy,
        report.trivial_pixel_accuracy()
    );
    let shares: f64 = report.val_pixel_shares.iter().sum();
    assert!((shares - 1.0).abs() < 1e-9, "{shares}");
    assert_eq!(report.epochs.len(), 4);
    assert_eq!(report.epochs[3].val_iou, report.val_iou);

    let classifier = LearnConfig { model: ModelName::SmallCnn, ..config.clone() };
    let err = fit_segmentation(&folder, &split, &classifier, &Device::Cpu, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("small-cnn gives one label per image"), "{err}");
    let images = ImageFolder::open(&root, OnError::Fail).unwrap();
    let err = fit_folder(&images, &split, &config, &Device::Cpu, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("unet labels each pixel: train it on a folder with masks"), "{err}");
}
