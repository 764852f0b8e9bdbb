//! `manifest.csv` beside the class folders: one row per image with its
//! class, plant (group), size and how it was stored.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::DataError;

pub const MANIFEST_FILE: &str = "manifest.csv";
const HEADER: &str = "path,class,group,width,height,bytes,quality,orientation";

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ManifestEntry {
    /// Relative to the dataset root: `class/file.jpg`.
    pub path: PathBuf,
    pub class: String,
    pub group: u64,
    /// Stored size (before EXIF orientation).
    pub width: u32,
    pub height: u32,
    pub bytes: u64,
    pub quality: u8,
    /// EXIF orientation tag, 1 when upright.
    pub orientation: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct Manifest {
    pub entries: Vec<ManifestEntry>,
}

impl Manifest {
    pub fn write(&self, root: &Path) -> Result<(), DataError> {
        let mut text = String::from(HEADER);
        text.push('\n');
        for e in &self.entries {
            let _ = writeln!(
                text,
                "{},{},{},{},{},{},{},{}",
                e.path.display(),
                e.class,
                e.group,
                e.width,
                e.height,
                e.bytes,
                e.quality,
                e.orientation
            );
        }
        let path = root.join(MANIFEST_FILE);
        std::fs::write(&path, text).map_err(DataError::io("writing", path))
    }

    pub fn read(root: &Path) -> Result<Manifest, DataError> {
        let path = root.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(DataError::io("reading", &path))?;
        let mut lines = text.lines().enumerate();
        match lines.next() {
            Some((_, header)) if header.trim() == HEADER => {}
            _ => return Err(DataError::Manifest { path, line: 1, message: format!("expected the header `{HEADER}`") }),
        }
        let mut entries = Vec::new();
        for (i, line) in lines.filter(|(_, l)| !l.trim().is_empty()) {
            let bad = |message: String| DataError::Manifest { path: path.clone(), line: i + 1, message };
            let fields: Vec<&str> = line.split(',').collect();
            let [rel, class, group, width, height, bytes, quality, orientation] = fields[..] else {
                return Err(bad(format!("expected 8 fields, found {}", fields.len())));
            };
            let num = |name: &str, v: &str| v.trim().parse::<u64>().map_err(|_| bad(format!("{name} `{v}` is not a whole number")));
            entries.push(ManifestEntry {
                path: PathBuf::from(rel),
                class: class.to_owned(),
                group: num("group", group)?,
                width: num("width", width)? as u32,
                height: num("height", height)? as u32,
                bytes: num("bytes", bytes)?,
                quality: num("quality", quality)? as u8,
                orientation: num("orientation", orientation)? as u8,
            });
        }
        Ok(Manifest { entries })
    }

    pub fn read_if_present(root: &Path) -> Result<Option<Manifest>, DataError> {
        if root.join(MANIFEST_FILE).is_file() {
            Manifest::read(root).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Images per class name, in first-seen order.
    pub fn class_counts(&self) -> Vec<(String, usize)> {
        let mut counts: Vec<(String, usize)> = Vec::new();
        for e in &self.entries {
            match counts.iter_mut().find(|(c, _)| *c == e.class) {
                Some((_, n)) => *n += 1,
                None => counts.push((e.class.clone(), 1)),
            }
        }
        counts
    }

    pub fn total_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_bad_lines() {
        let dir = std::env::temp_dir().join(format!("vramlab-manifest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let manifest = Manifest {
            entries: vec![ManifestEntry {
                path: PathBuf::from("rust/p0001_1.jpg"),
                class: "rust".into(),
                group: 1,
                width: 640,
                height: 480,
                bytes: 1234,
                quality: 85,
                orientation: 6,
            }],
        };
        manifest.write(&dir).unwrap();
        assert_eq!(Manifest::read(&dir).unwrap(), manifest);
        std::fs::write(dir.join(MANIFEST_FILE), format!("{HEADER}\na,b,c,1,2,3,4,5\n")).unwrap();
        let err = Manifest::read(&dir).unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("group `c`"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
