//! `root/class/*.{jpg,png}` datasets (ImageFolder, PlantVillage's layout)
//! and the on-demand image dataset the loader reads.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::decode::{decode_file, DecodeOptions, Decoder};
use super::loader::{Dataset, Example, LoadTiming, MemoryGauge};
use super::manifest::Manifest;
use super::transform::Transforms;
use super::{DataError, Rng};

/// File extensions read as images (compared without case).
pub const IMAGE_EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

/// One image file and its class (and plant, when a manifest says).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageItem {
    pub path: PathBuf,
    pub label: u32,
    /// The plant (or leaf) the photo shows; photos of one group must stay in one split.
    pub group: Option<u64>,
}

/// What to do with a file that is not a readable image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnError {
    /// Stop with an error naming the file.
    #[default]
    Fail,
    /// Leave it out and list it in [`ImageFolder::skipped`].
    Skip,
}

/// The images under `root/class/`, classes in sorted order (their index is the label).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageFolder {
    pub root: PathBuf,
    pub classes: Vec<String>,
    pub items: Vec<ImageItem>,
    /// Files left out, with why.
    pub skipped: Vec<(PathBuf, String)>,
}

impl ImageFolder {
    /// Lists `root/class/*` without decoding. Hidden files (`.DS_Store`,
    /// macOS's `._` copies) are always skipped; files with other extensions
    /// and class folders without an image are skipped or fail, by policy.
    /// Groups come from `root/manifest.csv` when present.
    pub fn open(root: &Path, policy: OnError) -> Result<Self, DataError> {
        let mut folders: Vec<String> = Vec::new();
        for entry in std::fs::read_dir(root).map_err(DataError::io("listing", root))? {
            let entry = entry.map_err(DataError::io("listing", root))?;
            if entry.path().is_dir() && !is_hidden(&entry.path()) {
                folders.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        folders.sort();
        let mut classes = Vec::with_capacity(folders.len());
        let mut items = Vec::new();
        let mut skipped = Vec::new();
        for class in folders {
            let dir = root.join(&class);
            let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
                .map_err(DataError::io("listing", &dir))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect();
            files.sort();
            let label = classes.len() as u32;
            let before = items.len();
            for path in files {
                let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
                if is_hidden(&path) {
                    skipped.push((path, "hidden file (such as .DS_Store), not a photo".into()));
                } else if IMAGE_EXTENSIONS.contains(&ext.as_str()) {
                    items.push(ImageItem { path, label, group: None });
                } else if policy == OnError::Fail {
                    return Err(DataError::Decode { path, message: "not an image file (expected .jpg, .jpeg or .png)".into() });
                } else {
                    skipped.push((path, "not an image file (expected .jpg, .jpeg or .png)".into()));
                }
            }
            if items.len() > before {
                classes.push(class);
            } else if policy == OnError::Fail {
                return Err(DataError::EmptyClass { dir });
            } else {
                skipped.push((dir, "class folder without an image (.jpg, .jpeg or .png): left out of the classes".into()));
            }
        }
        if items.is_empty() {
            return Err(DataError::Empty { root: root.to_owned() });
        }
        let mut folder = ImageFolder { root: root.to_owned(), classes, items, skipped };
        if let Some(manifest) = Manifest::read_if_present(root)? {
            folder.attach_groups(&manifest);
        }
        Ok(folder)
    }

    fn attach_groups(&mut self, manifest: &Manifest) {
        let groups: std::collections::HashMap<&Path, u64> = manifest.entries.iter().map(|e| (e.path.as_path(), e.group)).collect();
        for item in &mut self.items {
            let relative = item.path.strip_prefix(&self.root).unwrap_or(&item.path);
            item.group = groups.get(relative).copied();
        }
    }

    /// Decodes every image once (at 1/8 scale where possible) and, by
    /// policy, fails on the first unreadable one or moves the unreadable ones to `skipped`.
    pub fn verify(&mut self, policy: OnError) -> Result<(), DataError> {
        let options = DecodeOptions { decoder: Decoder::TurboJpeg, min_short_side: Some(1) };
        let mut kept = Vec::with_capacity(self.items.len());
        for item in self.items.drain(..) {
            match decode_file(&item.path, options) {
                Ok(_) => kept.push(item),
                Err(err) if policy == OnError::Skip => self.skipped.push((item.path.clone(), err.to_string())),
                Err(err) => return Err(err),
            }
        }
        self.items = kept;
        if self.items.is_empty() {
            return Err(DataError::Empty { root: self.root.clone() });
        }
        Ok(())
    }

    pub fn labels(&self) -> Vec<u32> {
        self.items.iter().map(|i| i.label).collect()
    }

    /// Group ids; an image without one is its own group.
    pub fn groups(&self) -> Vec<u64> {
        self.items.iter().enumerate().map(|(i, item)| item.group.unwrap_or(u64::MAX - i as u64)).collect()
    }

    /// Images per class.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.classes.len()];
        for item in &self.items {
            counts[item.label as usize] += 1;
        }
        counts
    }

    /// The images at `indices`, as a dataset with `transforms`.
    pub fn dataset(&self, indices: &[usize], transforms: Transforms) -> ImageDataset {
        ImageDataset::new(indices.iter().map(|&i| self.items[i].clone()).collect(), transforms)
    }

    /// Every image, as a dataset with `transforms`.
    pub fn all(&self, transforms: Transforms) -> ImageDataset {
        ImageDataset::new(self.items.clone(), transforms)
    }
}

/// Images read from disk when asked for (never all in memory), decoded,
/// transformed and normalised.
#[derive(Debug, Clone)]
pub struct ImageDataset {
    pub items: Vec<ImageItem>,
    pub transforms: Transforms,
    pub decoder: Decoder,
}

impl ImageDataset {
    pub fn new(items: Vec<ImageItem>, transforms: Transforms) -> Self {
        ImageDataset { items, transforms, decoder: Decoder::default() }
    }

    pub fn with_decoder(mut self, decoder: Decoder) -> Self {
        self.decoder = decoder;
        self
    }
}

impl Dataset for ImageDataset {
    fn len(&self) -> usize {
        self.items.len()
    }

    fn label(&self, index: usize) -> u32 {
        self.items[index].label
    }

    fn describe(&self, index: usize) -> String {
        self.items[index].path.display().to_string()
    }

    fn load(&self, index: usize, rng: &mut Rng, gauge: &MemoryGauge) -> Result<Example, DataError> {
        let item = &self.items[index];
        let options = DecodeOptions { decoder: self.decoder, min_short_side: self.transforms.decode_hint() };
        let decoded = decode_file(&item.path, options)?;
        let _decoded_bytes = gauge.hold(decoded.image.bytes());
        let started = Instant::now();
        let decoded_pixels = decoded.image.width() as u64 * decoded.image.height() as u64;
        let image = self.transforms.apply(decoded.image, rng)?;
        let shape = [3, image.height() as usize, image.width() as usize];
        let mut pixels = vec![0.0f32; shape.iter().product()];
        self.transforms.to_tensor_into(&image, &mut pixels)?;
        Ok(Example {
            pixels,
            shape,
            label: item.label,
            mask: None,
            timing: LoadTiming {
                encoded_bytes: decoded.encoded_bytes as u64,
                decode_seconds: decoded.seconds,
                transform_seconds: started.elapsed().as_secs_f64(),
                decoded_pixels,
            },
        })
    }
}

/// Finder's `.DS_Store`, macOS's `._photo.jpg` resource forks, other dotfiles.
fn is_hidden(path: &Path) -> bool {
    path.file_name().is_some_and(|name| name.to_string_lossy().starts_with('.'))
}
