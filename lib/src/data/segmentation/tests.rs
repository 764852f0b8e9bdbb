use std::path::Path;

use super::*;
use crate::data::{DataLoader, LeafDiseaseSynth, LoaderConfig, SizeShare, Transform, MASK_CLASSES};

/// Photos under `dir/photos`, their masks under `dir/photos_masks`.
fn generated(dir: &Path, synth: &LeafDiseaseSynth) -> (PathBuf, PathBuf) {
    let (photos, masks) = (dir.join("photos"), dir.join("photos_masks"));
    synth.generate(&photos).unwrap();
    synth.generate_masks(&masks).unwrap();
    (photos, masks)
}

fn open(photos: &Path, masks: &Path) -> Result<SegmentationFolder, DataError> {
    SegmentationFolder::open(photos, masks, MASK_CLASSES.len() as u32, OnError::Fail)
}

fn loader(dataset: SegmentationDataset) -> DataLoader<SegmentationDataset> {
    DataLoader::new(dataset, LoaderConfig { batch_size: 8, shuffle: false, num_workers: 2, ..LoaderConfig::default() }).unwrap()
}

#[test]
fn batches_carry_each_photos_mask_as_n_by_h_by_w_labels() {
    let dir = tempfile::tempdir().unwrap();
    let (photos, masks) = generated(dir.path(), &LeafDiseaseSynth::new(36, 3).with_size(96, 96));
    let mut folder = open(&photos, &masks).unwrap();
    folder.verify(OnError::Fail).unwrap();
    assert_eq!(folder.items.len(), 36);
    assert_eq!(folder.classes.len(), 12);
    assert!(folder.items.iter().all(|i| i.image.group.is_some()));
    assert_eq!(folder.labels().len(), 36);

    let same_size = loader(folder.all(Transforms::resize(96)));
    let mut lesion = 0;
    for batch in same_size.epoch(0) {
        let batch = batch.unwrap();
        assert_eq!(batch.labels.dims(), &[batch.len(), 96, 96]);
        let labels = batch.labels.flatten_from(1).unwrap().to_vec2::<u32>().unwrap();
        for (row, &index) in labels.iter().zip(&batch.indices) {
            let mask = Mask::read_png(&folder.items[index].mask).unwrap();
            assert!(row.iter().zip(mask.classes()).all(|(&a, &b)| a == b as u32), "{}", folder.items[index].mask.display());
            lesion += mask.count(1);
        }
    }
    assert!(lesion > 0);

    // Decoded at half size in the DCT domain, then cropped, flipped and turned.
    let train = loader(folder.all(Transforms::train(48)));
    for batch in train.epoch(0) {
        let batch = batch.unwrap();
        assert_eq!(batch.images.dims(), &[batch.len(), 3, 48, 48]);
        assert_eq!(batch.labels.dims(), &[batch.len(), 48, 48]);
        let labels = batch.labels.flatten_all().unwrap().to_vec1::<u32>().unwrap();
        assert!(labels.iter().all(|&c| c <= 1));
        assert!(batch.timing.decoded_pixels < batch.len() as u64 * 96 * 96);
    }
}

#[test]
fn a_photo_decoded_smaller_than_its_mask_keeps_its_lesions_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let synth = LeafDiseaseSynth::new(12, 6).with_sizes(vec![SizeShare { width: 640, height: 480, share: 1.0 }]);
    let (photos, masks) = generated(dir.path(), &synth);
    let folder = open(&photos, &masks).unwrap();
    let resize = Transforms::new(vec![Transform::Resize { width: 64, height: 64 }]);
    for batch in loader(folder.all(resize)).epoch(0) {
        let batch = batch.unwrap();
        assert!(batch.timing.decoded_pixels <= batch.len() as u64 * 160 * 120, "decoded at a quarter of 640x480");
        let labels = batch.labels.flatten_from(1).unwrap().to_vec2::<u32>().unwrap();
        for (row, &index) in labels.iter().zip(&batch.indices) {
            let direct = Mask::read_png(&folder.items[index].mask).unwrap().resize(64, 64).unwrap();
            let agree = row.iter().zip(direct.classes()).filter(|(&a, &b)| a == b as u32).count();
            assert!(agree as f64 >= 0.98 * 64.0 * 64.0, "{}: {agree} of 4096 pixels agree", folder.items[index].mask.display());
        }
    }
}

#[test]
fn a_missing_mask_is_named_with_its_image_or_skipped_by_policy() {
    let dir = tempfile::tempdir().unwrap();
    let (photos, masks) = generated(dir.path(), &LeafDiseaseSynth::new(24, 2).with_size(64, 48));
    let folder = open(&photos, &masks).unwrap();
    let gone = folder.items[5].clone();
    std::fs::remove_file(&gone.mask).unwrap();
    let err = open(&photos, &masks).unwrap_err().to_string();
    assert!(err.contains(&gone.image.path.display().to_string()) && err.contains(&gone.mask.display().to_string()), "{err}");
    assert!(err.contains("missing"), "{err}");
    let kept = SegmentationFolder::open(&photos, &masks, 2, OnError::Skip).unwrap();
    assert_eq!(kept.items.len(), 23);
    assert!(kept.skipped.iter().any(|(path, why)| *path == gone.image.path && why.contains("no mask")), "{:?}", kept.skipped);

    let err = open(&photos, &dir.path().join("nowhere")).unwrap_err().to_string();
    assert!(err.contains("nowhere") && err.contains("not a directory"), "{err}");
    assert!(SegmentationFolder::open(&photos, &masks, 0, OnError::Skip).is_err());
}

#[test]
fn two_photos_that_would_share_one_mask_are_named_or_one_is_skipped_by_policy() {
    let dir = tempfile::tempdir().unwrap();
    let (photos, masks) = generated(dir.path(), &LeafDiseaseSynth::new(24, 2).with_size(64, 48));
    let original = open(&photos, &masks).unwrap().items[3].image.path.clone();
    let twin = original.with_extension(if original.extension().is_some_and(|e| e == "png") { "jpg" } else { "png" });
    std::fs::copy(&original, &twin).unwrap();
    let err = open(&photos, &masks).unwrap_err().to_string();
    for path in [&original, &twin] {
        assert!(err.contains(&path.display().to_string()), "{err}");
    }
    assert!(err.contains("rename one"), "{err}");
    let kept = SegmentationFolder::open(&photos, &masks, 2, OnError::Skip).unwrap();
    assert_eq!(kept.items.len(), 24);
    assert_eq!(kept.skipped.len(), 1, "{:?}", kept.skipped);
}

#[test]
fn a_mask_of_another_size_or_with_unknown_classes_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (photos, masks) = generated(dir.path(), &LeafDiseaseSynth::new(24, 2).with_size(64, 48));
    let folder = open(&photos, &masks).unwrap();
    let (small, odd) = (folder.items[3].clone(), folder.items[9].clone());
    Mask::filled(50, 40, 0).unwrap().write_png(&small.mask).unwrap();
    let mut classes = vec![0u8; 64 * 48];
    classes[64 * 2 + 7] = 2;
    Mask::new(64, 48, classes).unwrap().write_png(&odd.mask).unwrap();

    let err = folder.clone().verify(OnError::Fail).unwrap_err().to_string();
    assert!(err.contains(&small.mask.display().to_string()) && err.contains(&small.image.path.display().to_string()), "{err}");
    assert!(err.contains("50x40") && err.contains("64x48"), "{err}");
    let mut checked = folder.clone();
    checked.verify(OnError::Skip).unwrap();
    assert_eq!(checked.items.len(), 22);
    let why = &checked.skipped.iter().find(|(path, _)| *path == odd.image.path).unwrap().1;
    assert!(why.contains("(7, 2)") && why.contains("class 2") && why.contains("2 classes"), "{why}");

    let one = |item: &SegmentationItem| {
        let dataset = SegmentationDataset::new(vec![item.clone()], 2, Transforms::resize(32));
        dataset.load(0, &mut crate::data::rng_for(0, 0, 0), &MemoryGauge::new()).unwrap_err().to_string()
    };
    assert!(one(&small).contains("50x40"), "{}", one(&small));
    assert!(one(&odd).contains("class 2"), "{}", one(&odd));
    assert!(SegmentationDataset::new(vec![odd.clone()], 3, Transforms::resize(32))
        .load(0, &mut crate::data::rng_for(0, 0, 0), &MemoryGauge::new())
        .is_ok());
}
