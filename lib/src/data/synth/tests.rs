use std::collections::HashMap;

use super::*;
use crate::data::{
    decode_bytes, decode_file, group_split, histogram_baseline, preprocess, DataLoader, DecodeOptions, ImageFolder, LoaderConfig, Manifest,
    OnError, Transforms,
};

fn tiny(images: usize, seed: u64) -> LeafDiseaseSynth {
    LeafDiseaseSynth::new(images, seed)
        .with_sizes(vec![SizeShare { width: 48, height: 32, share: 0.7 }, SizeShare { width: 96, height: 64, share: 0.3 }])
}

#[test]
fn the_default_plan_is_imbalanced_grouped_and_mixed_in_size() {
    let synth = LeafDiseaseSynth::default();
    let plan = synth.plan().unwrap();
    assert_eq!(plan.len(), 3000);
    let counts = synth.class_counts();
    assert_eq!(counts.len(), 12);
    let (max, min) = (*counts.iter().max().unwrap(), *counts.iter().min().unwrap());
    assert!(max >= 8 * min, "imbalance {max}/{min}");
    let mut class_of_plant = HashMap::new();
    for p in &plan {
        assert_eq!(*class_of_plant.entry(p.plant).or_insert(p.class), p.class, "a plant has one disease");
    }
    assert!(class_of_plant.len() < 1500, "several photos per plant");
    let huge = plan.iter().filter(|p| p.width == 4000).count();
    assert!((200..400).contains(&huge), "{huge} photos at 4000x3000");
    assert!(plan.iter().any(|p| p.width == 224));
    assert!(plan.iter().any(|p| p.orientation == 6) && plan.iter().any(|p| p.orientation == 1));
    let qualities: std::collections::BTreeSet<u8> = plan.iter().map(|p| p.quality).collect();
    assert!(qualities.len() > 20);
    assert_eq!(plan, synth.plan().unwrap());
    assert!(LeafDiseaseSynth::new(5, 0).plan().is_err());
}

#[test]
fn generation_is_deterministic_and_writes_an_image_folder_with_a_manifest() {
    let (a, b, c) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let manifest = tiny(40, 7).generate(a.path()).unwrap();
    tiny(40, 7).generate(b.path()).unwrap();
    tiny(40, 8).generate(c.path()).unwrap();
    assert_eq!(manifest.entries.len(), 40);
    let mut differs = false;
    for e in &manifest.entries {
        let bytes = std::fs::read(a.path().join(&e.path)).unwrap();
        assert_eq!(bytes, std::fs::read(b.path().join(&e.path)).unwrap(), "{}", e.path.display());
        assert_eq!(bytes.len() as u64, e.bytes);
        differs |= std::fs::read(c.path().join(&e.path)).map(|other| other != bytes).unwrap_or(true);
    }
    assert!(differs, "another seed gives other photos");
    assert_eq!(Manifest::read(a.path()).unwrap(), manifest);

    let folder = ImageFolder::open(a.path(), OnError::Fail).unwrap();
    assert_eq!(folder.classes, CLASSES.to_vec());
    assert_eq!(folder.items.len(), 40);
    assert!(folder.items.iter().all(|i| i.group.is_some()));
    for e in manifest.entries.iter().filter(|e| e.orientation == 6).take(2) {
        assert!(e.width < e.height, "stored turned");
        let d = decode_file(&a.path().join(&e.path), DecodeOptions::default()).unwrap();
        assert!(d.image.width() > d.image.height(), "decoded upright");
    }
}

#[test]
fn a_disease_changes_only_the_leaf_and_in_its_own_colour() {
    let synth = LeafDiseaseSynth::new(600, 1).with_size(320, 240);
    let plan = synth.plan().unwrap();
    let class = |name: &str| CLASSES.iter().position(|c| *c == name).unwrap();
    let mut differs = 0;
    for photo in plan.iter().filter(|p| CLASSES[p.class] == "healthy").take(4) {
        // The same plant, framing and light, with another disease.
        let healthy = synth.render(&PhotoPlan { class: class("healthy"), ..photo.clone() }).unwrap().mean_rgb();
        let rust = synth.render(&PhotoPlan { class: class("rust"), ..photo.clone() }).unwrap().mean_rgb();
        let mildew = synth.render(&PhotoPlan { class: class("powdery_mildew"), ..photo.clone() }).unwrap().mean_rgb();
        assert!(rust[0] - rust[1] > healthy[0] - healthy[1], "rust is redder: {rust:?} vs {healthy:?}");
        assert!(mildew[2] > healthy[2], "mildew is whiter: {mildew:?} vs {healthy:?}");
        differs += 1;
    }
    assert_eq!(differs, 4);
}

#[test]
fn folder_policy_reports_non_images_and_corrupt_files_by_path() {
    let dir = tempfile::tempdir().unwrap();
    tiny(24, 3).generate(dir.path()).unwrap();
    let notes = dir.path().join("rust").join("notes.txt");
    std::fs::write(&notes, "field notes").unwrap();
    let err = ImageFolder::open(dir.path(), OnError::Fail).unwrap_err().to_string();
    assert!(err.contains("notes.txt"), "{err}");
    let mut folder = ImageFolder::open(dir.path(), OnError::Skip).unwrap();
    assert_eq!(folder.skipped.len(), 1);
    let broken = folder.items[3].path.clone();
    std::fs::write(&broken, b"\xFF\xD8\xFF\xE0 broken").unwrap();
    let err = folder.clone().verify(OnError::Fail).unwrap_err().to_string();
    assert!(err.contains(&broken.display().to_string()), "{err}");
    folder.verify(OnError::Skip).unwrap();
    assert_eq!(folder.items.len(), 23);
    assert!(folder.skipped.iter().any(|(p, _)| *p == broken));
    assert!(ImageFolder::open(&dir.path().join("missing"), OnError::Skip).is_err());
}

#[test]
fn hidden_files_are_skipped_and_an_empty_class_is_named_or_left_out() {
    let dir = tempfile::tempdir().unwrap();
    tiny(24, 3).generate(dir.path()).unwrap();
    let classes = ImageFolder::open(dir.path(), OnError::Fail).unwrap().classes;
    std::fs::write(dir.path().join(&classes[0]).join(".DS_Store"), b"\0\0\0\x01Bud1").unwrap();
    std::fs::write(dir.path().join(&classes[1]).join("._leaf.jpg"), b"\0\x05\x16\x07").unwrap();
    std::fs::create_dir(dir.path().join(".thumbnails")).unwrap();
    let folder = ImageFolder::open(dir.path(), OnError::Fail).unwrap();
    assert_eq!(folder.classes, classes, "a hidden folder is no class");
    assert_eq!(folder.items.len(), 24);
    assert_eq!(folder.skipped.len(), 2, "{:?}", folder.skipped);

    let empty = dir.path().join("zz-unlabelled");
    std::fs::create_dir(&empty).unwrap();
    let err = ImageFolder::open(dir.path(), OnError::Fail).unwrap_err().to_string();
    assert!(err.contains("zz-unlabelled") && err.contains("has no image"), "{err}");
    let folder = ImageFolder::open(dir.path(), OnError::Skip).unwrap();
    assert_eq!(folder.classes, classes);
    assert!(folder.skipped.iter().any(|(path, why)| *path == empty && why.contains("left out")), "{:?}", folder.skipped);
}

#[test]
fn the_loader_reads_the_generated_folder_into_normalised_batches() {
    let dir = tempfile::tempdir().unwrap();
    tiny(30, 5).generate(dir.path()).unwrap();
    let folder = ImageFolder::open(dir.path(), OnError::Fail).unwrap();
    let split = group_split(&folder.labels(), &folder.groups(), 0.25, 0).unwrap();
    let train = folder.dataset(&split.train, Transforms::train(24));
    let loader = DataLoader::new(train, LoaderConfig { batch_size: 8, num_workers: 2, ..LoaderConfig::default() }).unwrap();
    let mut seen = 0;
    for batch in loader.epoch(0) {
        let batch = batch.unwrap();
        assert_eq!(&batch.images.dims()[1..], &[3, 24, 24]);
        let values = batch.images.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(values.iter().all(|v| (-2.2..=2.7).contains(v)));
        assert!(batch.timing.decode_seconds > 0.0 && batch.timing.encoded_bytes > 0);
        seen += batch.len();
    }
    assert_eq!(seen, split.train.len());
}

#[test]
fn preprocessing_resizes_to_the_short_side_and_carries_the_manifest() {
    let (src, out) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let synth =
        tiny(20, 2).with_sizes(vec![SizeShare { width: 120, height: 90, share: 0.5 }, SizeShare { width: 40, height: 30, share: 0.5 }]);
    synth.generate(src.path()).unwrap();
    let report = preprocess(src.path(), out.path(), 45, 85).unwrap();
    assert_eq!(report.images, 20);
    assert!(report.kept_size > 0 && report.kept_size < 20);
    let manifest = Manifest::read(out.path()).unwrap();
    for e in &manifest.entries {
        let d = decode_file(&out.path().join(&e.path), DecodeOptions::default()).unwrap();
        assert_eq!((d.image.width(), d.image.height()), (e.width, e.height));
        assert!(e.width.min(e.height) <= 45 && e.width > e.height, "upright, short side at most 45");
        assert_eq!(e.orientation, 1);
    }
    assert!(preprocess(src.path(), out.path(), 0, 85).is_err());
}

#[test]
fn the_colour_baseline_learns_something_from_the_generated_set() {
    let dir = tempfile::tempdir().unwrap();
    LeafDiseaseSynth::new(480, 11).with_size(96, 72).generate(dir.path()).unwrap();
    let folder = ImageFolder::open(dir.path(), OnError::Fail).unwrap();
    let split = group_split(&folder.labels(), &folder.groups(), 0.25, 0).unwrap();
    let report = histogram_baseline(&folder, &split).unwrap();
    assert!(report.train_accuracy > report.majority_accuracy + 0.2, "{report:?}");
    assert!(report.val_accuracy > 1.5 / 12.0, "better than chance: {report:?}");
}

/// FNV-1a: a fingerprint that stays the same across Rust releases.
fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

#[test]
fn the_photos_stay_the_bytes_the_notebooks_were_made_with() {
    let small = LeafDiseaseSynth::new(480, 11).with_size(96, 96);
    let plan = small.plan().unwrap();
    let mixed = LeafDiseaseSynth::new(40, 5);
    let turned = &mixed.plan().unwrap()[24];
    assert_eq!((turned.width, turned.height, turned.orientation), (1600, 1200, 6));
    let photos = [
        (small.encode(&plan[0]).unwrap(), 1625, 0xed26_92ea_419b_8753),
        (small.encode(&plan[200]).unwrap(), 1303, 0x5683_e4d9_6abd_7bb7),
        (small.encode(&plan[479]).unwrap(), 2471, 0x7397_231a_9232_93d9),
        (mixed.encode(turned).unwrap(), 52842, 0x9603_1d40_78bc_6322),
    ];
    for (i, (bytes, len, print)) in photos.into_iter().enumerate() {
        assert_eq!((bytes.len(), fingerprint(&bytes)), (len, print), "photo {i} changed: every generated dataset would change with it");
    }
}

/// The canvas of a photo drawn with and without its plant's spots.
fn with_and_without_spots(synth: &LeafDiseaseSynth, plan: &PhotoPlan) -> (RgbImage, RgbImage) {
    let scene = Scene::new(&mut rng_for(synth.seed, 3, plan.index as u64));
    let (w, h) = plan.canvas_size();
    let spotted = draw(&Plant::new(synth.seed, plan.plant, plan.class), &scene, w, h).unwrap();
    let bare = Plant { spots: Vec::new(), ..Plant::new(synth.seed, plan.plant, plan.class) };
    (spotted, draw(&bare, &scene, w, h).unwrap())
}

#[test]
fn a_mask_marks_exactly_where_the_lesions_are_drawn() {
    let synth = LeafDiseaseSynth::new(480, 11).with_size(96, 96);
    let plan = synth.plan().unwrap();
    let mut lesion_photos = [0usize; 12];
    for class in 0..CLASSES.len() {
        let symptom = Symptom::of(CLASSES[class]).unwrap();
        for photo in plan.iter().filter(|p| p.class == class).take(4) {
            let (spotted, bare) = with_and_without_spots(&synth, photo);
            let mask = synth.mask(photo).unwrap();
            assert_eq!((mask.width(), mask.height()), (96, 96));
            let mut lesion = 0;
            for y in 0..96 {
                for x in 0..96 {
                    let (marked, coloured) = (mask.get(x, y) == 1, spotted.pixel(x, y) != bare.pixel(x, y));
                    assert!(mask.get(x, y) <= 1);
                    assert!(!marked || coloured, "{}: ({x}, {y}) is marked but no lesion colours it", photo.relative_path().display());
                    if matches!(CLASSES[class], "rust" | "septoria_spot") {
                        assert_eq!(marked, coloured, "{}: ({x}, {y}): these lesions have no halo", photo.relative_path().display());
                    }
                    lesion += usize::from(marked);
                }
            }
            if symptom == Symptom::Discolouration {
                assert_eq!(lesion, 0, "{}", photo.relative_path().display());
                assert_eq!(spotted, bare, "colour-only classes draw no lesion");
            }
            lesion_photos[class] += usize::from(lesion > 0);
        }
        if matches!(symptom, Symptom::Spots | Symptom::Blotches) {
            assert!(lesion_photos[class] >= 3, "{}: {} of 4 photos show a lesion", CLASSES[class], lesion_photos[class]);
        }
    }
}

#[test]
fn a_mask_fits_its_photo_through_enlargement_jpeg_and_exif_orientation() {
    let synth = LeafDiseaseSynth::new(480, 11).with_size(1200, 900);
    let plan = synth.plan().unwrap().into_iter().find(|p| CLASSES[p.class] == "rust").unwrap();
    assert_eq!(plan.canvas_size(), (960, 720), "drawn smaller, then enlarged");
    let mask = synth.mask(&plan).unwrap();
    assert_eq!((mask.width(), mask.height()), (1200, 900));
    let (spotted, bare) = with_and_without_spots(&synth, &plan);
    let (spotted, bare) = (spotted.resize(1200, 900).unwrap(), bare.resize(1200, 900).unwrap());
    let (mut both, mut either) = (0u64, 0u64);
    for y in 0..900 {
        for x in 0..1200 {
            let coloured = (0..3).map(|c| spotted.pixel(x, y)[c].abs_diff(bare.pixel(x, y)[c]) as u32).sum::<u32>() > 40;
            let marked = mask.get(x, y) == 1;
            both += u64::from(marked && coloured);
            either += u64::from(marked || coloured);
        }
    }
    let iou = both as f64 / either as f64;
    assert!(mask.count(1) > 2000 && iou > 0.9, "{} lesion pixels, IoU with the drawn lesions {iou:.3}", mask.count(1));

    let upright = synth.render(&plan).unwrap();
    for orientation in [1, 3, 6, 8] {
        let turned = PhotoPlan { orientation, ..plan.clone() };
        let bytes = synth.encode(&turned).unwrap();
        let decoded = decode_bytes(&bytes, &turned.relative_path(), DecodeOptions::default()).unwrap();
        assert_eq!(decoded.upright_size, (1200, 900));
        assert_eq!(synth.mask(&turned).unwrap(), mask, "the mask is of the upright photo, whatever the file stores");
        let error = upright.pixels().iter().zip(decoded.image.pixels()).map(|(&a, &b)| a.abs_diff(b) as f64).sum::<f64>()
            / upright.pixels().len() as f64;
        assert!(error < 8.0, "orientation {orientation}: the decoded photo is {error:.1} levels from the upright one");
    }
}

#[test]
fn masks_are_written_beside_the_photos_and_measure_the_lesion_share() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let synth = LeafDiseaseSynth::new(480, 11).with_size(96, 96);
    let share = synth.generate_masks(a.path()).unwrap();
    assert_eq!(synth.generate_masks(b.path()).unwrap(), share);
    assert_eq!(synth.lesion_share().unwrap(), share);
    for plan in synth.plan().unwrap() {
        let path = a.path().join(plan.mask_path());
        assert_eq!(path.extension().unwrap(), "png");
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes, std::fs::read(b.path().join(plan.mask_path())).unwrap(), "same settings, same bytes");
        assert_eq!(Mask::read_png(&path).unwrap(), synth.mask(&plan).unwrap());
    }
    assert_eq!(share.photos, synth.class_counts());
    for (class, name) in CLASSES.iter().enumerate() {
        let lesion_share = share.class_share(class);
        match Symptom::of(name).unwrap() {
            Symptom::Discolouration => {
                assert_eq!((share.lesion_pixels[class], share.empty_masks[class]), (0, share.photos[class]), "{name}")
            }
            Symptom::Healthy => assert!(lesion_share < 0.001, "{name}: {lesion_share}"),
            Symptom::Spots | Symptom::Blotches => {
                assert!(lesion_share > 0.002, "{name}: {lesion_share}");
                assert!(
                    share.empty_masks[class] * 5 <= share.photos[class],
                    "{name}: {} of {} without a lesion",
                    share.empty_masks[class],
                    share.photos[class]
                );
            }
        }
    }
    assert!((0.01..0.1).contains(&share.share()), "{}", share.table());
    assert!((share.share() - share.mean_photo_share()).abs() < 1e-9, "one size: both shares agree");
    let text = share.table().to_string();
    assert!(text.contains("rust") && text.contains("pixel accuracy"), "{text}");
}

#[test]
fn masks_are_made_without_the_photos_and_checked_against_them() {
    let dir = tempfile::tempdir().unwrap();
    let synth = tiny(30, 4);
    let masks = dir.path().join("masks");
    synth.generate_masks(&masks).unwrap();
    assert!(!dir.path().join(CLASSES[0]).exists(), "no photo written");
    let photos = dir.path().join("photos");
    let manifest = synth.generate(&photos).unwrap();
    synth.check_manifest(&manifest, &photos).unwrap();
    for entry in &manifest.entries {
        let decoded = decode_file(&photos.join(&entry.path), DecodeOptions::default()).unwrap();
        let mask = Mask::read_png(&masks.join(&entry.path).with_extension("png")).unwrap();
        assert_eq!((mask.width(), mask.height()), (decoded.image.width(), decoded.image.height()), "{}", entry.path.display());
    }
    let err = tiny(30, 5).check_manifest(&manifest, &photos).unwrap_err().to_string();
    assert!(err.contains("manifest.csv") && err.contains("other settings"), "{err}");
}
