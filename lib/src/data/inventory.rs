//! What a folder of photos holds before anything trains: photos per class,
//! the resolution mix and photos per plant, read from the files' headers.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::folder::ImageFolder;
use super::DataError;
use crate::render::{Chart, Series, Table};
use crate::units::human;

/// One photo as its header describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct InventoryEntry {
    pub label: u32,
    /// The plant (or the photo's own group when the folder has no manifest).
    pub group: u64,
    /// As stored (an EXIF rotation swaps them on display, not in memory).
    pub width: u32,
    pub height: u32,
    pub file_bytes: u64,
}

impl InventoryEntry {
    /// The photo decoded at full size, as RGB bytes.
    pub fn decoded_bytes(&self) -> u64 {
        self.width as u64 * self.height as u64 * 3
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Inventory {
    pub classes: Vec<String>,
    pub entries: Vec<InventoryEntry>,
}

impl ImageFolder {
    /// Reads every photo's header (not its pixels): a few milliseconds per thousand photos.
    pub fn inventory(&self) -> Result<Inventory, DataError> {
        let groups = self.groups();
        let entries = self
            .items
            .iter()
            .zip(groups)
            .map(|(item, group)| {
                let decode_error = |e: image::ImageError| DataError::Decode { path: item.path.clone(), message: e.to_string() };
                let (width, height) = image::ImageReader::open(&item.path)
                    .map_err(DataError::io("opening", &item.path))?
                    .with_guessed_format()
                    .map_err(DataError::io("reading", &item.path))?
                    .into_dimensions()
                    .map_err(decode_error)?;
                let file_bytes = std::fs::metadata(&item.path).map_err(DataError::io("reading", &item.path))?.len();
                Ok(InventoryEntry { label: item.label, group, width, height, file_bytes })
            })
            .collect::<Result<_, DataError>>()?;
        Ok(Inventory { classes: self.classes.clone(), entries })
    }
}

impl Inventory {
    fn plants(&self) -> BTreeMap<u64, usize> {
        let mut plants = BTreeMap::new();
        for e in &self.entries {
            *plants.entry(e.group).or_default() += 1;
        }
        plants
    }

    /// The most photos of one class over the fewest.
    pub fn imbalance(&self) -> f64 {
        let counts = self.class_counts();
        let (lo, hi) = counts.iter().fold((usize::MAX, 0), |(lo, hi), &n| (lo.min(n), hi.max(n)));
        hi as f64 / lo.max(1) as f64
    }

    fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.classes.len()];
        for e in &self.entries {
            counts[e.label as usize] += 1;
        }
        counts
    }

    /// The photo that costs the most to decode at full size.
    pub fn largest(&self) -> Option<&InventoryEntry> {
        self.entries.iter().max_by_key(|e| e.decoded_bytes())
    }

    /// Per class: photos, plants, share and mean file size.
    pub fn class_table(&self) -> Table {
        let mut table = Table::new(["#", "class", "photos", "plants", "share", "mean file"])
            .title(format!(
                "{} photos of {} plants in {} classes; the largest class has {:.1}x the photos of the smallest",
                self.entries.len(),
                self.plants().len(),
                self.classes.len(),
                self.imbalance()
            ))
            .right_align(&[0, 2, 3, 4, 5]);
        let total = self.entries.len().max(1) as f64;
        for (c, name) in self.classes.iter().enumerate() {
            let of_class: Vec<&InventoryEntry> = self.entries.iter().filter(|e| e.label as usize == c).collect();
            let plants: BTreeSet<u64> = of_class.iter().map(|e| e.group).collect();
            let bytes: u64 = of_class.iter().map(|e| e.file_bytes).sum();
            table.push_row([
                c.to_string(),
                name.clone(),
                of_class.len().to_string(),
                plants.len().to_string(),
                format!("{:.1}%", 100.0 * of_class.len() as f64 / total),
                human(bytes / of_class.len().max(1) as u64),
            ]);
        }
        table
    }

    /// Photos per class as bars, numbered as in [`Inventory::class_table`].
    pub fn class_chart(&self) -> Chart {
        Chart::new("photos per class")
            .x_label("class (numbered as in the table)")
            .y_label("photos")
            .series(Series::bars("photos", self.class_counts().into_iter().enumerate().map(|(c, n)| (c as f64, n as f64))))
    }

    /// Each resolution (either orientation): photos, and what one costs decoded at full size.
    pub fn size_table(&self) -> Table {
        let mut sizes: BTreeMap<(u32, u32), usize> = BTreeMap::new();
        for e in &self.entries {
            *sizes.entry((e.width.max(e.height), e.width.min(e.height))).or_default() += 1;
        }
        let mut table = Table::new(["resolution", "photos", "share", "decoded (RGB u8)"])
            .title(format!("{} resolutions", sizes.len()))
            .right_align(&[1, 2, 3]);
        let total = self.entries.len().max(1) as f64;
        for ((long, short), n) in sizes.into_iter().rev() {
            table.push_row([
                format!("{long}x{short}"),
                n.to_string(),
                format!("{:.1}%", 100.0 * n as f64 / total),
                human(long as u64 * short as u64 * 3),
            ]);
        }
        table
    }

    /// How many plants have 1, 2, 3, ... photos.
    pub fn plant_table(&self) -> Table {
        let mut by_size: BTreeMap<usize, usize> = BTreeMap::new();
        let plants = self.plants();
        for &photos in plants.values() {
            *by_size.entry(photos).or_default() += 1;
        }
        let mut table = Table::new(["photos of the plant", "plants", "photos"])
            .title(format!("{} plants, {:.1} photos each on average", plants.len(), self.entries.len() as f64 / plants.len().max(1) as f64))
            .right_align(&[0, 1, 2]);
        for (photos, n) in by_size {
            table.push_row([photos.to_string(), n.to_string(), (photos * n).to_string()]);
        }
        table
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{LeafDiseaseSynth, OnError};

    #[test]
    fn the_inventory_reads_every_header_and_agrees_with_the_generator() {
        let dir = tempfile::tempdir().unwrap();
        let manifest = LeafDiseaseSynth::new(48, 7).generate(dir.path()).unwrap();
        let folder = ImageFolder::open(dir.path(), OnError::Fail).unwrap();
        let inventory = folder.inventory().unwrap();
        assert_eq!(inventory.entries.len(), manifest.entries.len());
        let mut from_headers: Vec<(u32, u32, u64)> = inventory.entries.iter().map(|e| (e.width, e.height, e.file_bytes)).collect();
        let mut generated: Vec<(u32, u32, u64)> = manifest.entries.iter().map(|e| (e.width, e.height, e.bytes)).collect();
        from_headers.sort_unstable();
        generated.sort_unstable();
        assert_eq!(from_headers, generated);
        let plants: BTreeSet<u64> = manifest.entries.iter().map(|e| e.group).collect();
        let plant_table = inventory.plant_table();
        assert!(plant_table.to_string().contains(&format!("{} plants", plants.len())), "{plant_table}");
        let photos: usize = plant_table.rows().iter().map(|r| r[2].parse::<usize>().unwrap()).sum();
        assert_eq!(photos, 48);
        let largest = inventory.largest().unwrap();
        assert_eq!(largest.decoded_bytes(), manifest.entries.iter().map(|e| e.width as u64 * e.height as u64 * 3).max().unwrap());
        assert_eq!(inventory.class_table().rows().len(), folder.classes.len());
    }

    #[test]
    fn the_split_table_counts_each_side_and_names_a_class_validation_lacks() {
        let dir = tempfile::tempdir().unwrap();
        LeafDiseaseSynth::new(60, 3).generate(dir.path()).unwrap();
        let folder = ImageFolder::open(dir.path(), OnError::Fail).unwrap();
        let labels = folder.labels();
        let split = crate::data::group_split(&labels, &folder.groups(), 0.2, 0).unwrap();
        let table = folder.split_table(&split);
        let counted: usize = table.rows().iter().map(|r| r[1].parse::<usize>().unwrap() + r[3].parse::<usize>().unwrap()).sum();
        assert_eq!(counted, labels.len());
        let first = labels[split.val[0]];
        let without =
            crate::data::Split { train: split.train.clone(), val: split.val.iter().copied().filter(|&i| labels[i] != first).collect() };
        let note = folder.split_table(&without).to_string();
        assert!(note.contains(&format!("Not validated: {}", folder.classes[first as usize])), "{note}");
    }

    #[test]
    fn a_file_whose_header_cannot_be_read_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("healthy")).unwrap();
        image::RgbImage::new(4, 3).save(dir.path().join("healthy/a.png")).unwrap();
        std::fs::write(dir.path().join("healthy/b.jpg"), b"not a jpeg").unwrap();
        let folder = ImageFolder::open(dir.path(), OnError::Fail).unwrap();
        let err = folder.inventory().unwrap_err().to_string();
        assert!(err.contains("b.jpg"), "{err}");
    }
}
