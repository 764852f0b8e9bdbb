//! The loader's host memory: batches in flight times their size, plus the
//! images each worker is decoding. The lesson's second kind of OOM (4.3).

use serde::Serialize;

/// The settings that decide the loader's host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LoaderShape {
    pub batch_size: usize,
    /// One sample: channels, height, width (f32 values).
    pub sample: [usize; 3],
    pub num_workers: usize,
    pub prefetch: usize,
    /// The largest source image a worker decodes: width, height (8-bit RGB).
    pub source: (u32, u32),
    /// Whether each sample carries a label per pixel (a segmentation mask)
    /// rather than one label.
    pub masks: bool,
}

/// What those settings hold on the host at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HostFootprint {
    pub shape: LoaderShape,
    /// One batch: images as f32 plus u32 labels (one per sample, or one per
    /// pixel with masks).
    pub batch_bytes: u64,
    /// Batches that can exist at once: per worker its queue plus the one it
    /// is building, and the one the training loop holds.
    pub batches_in_flight: u64,
    /// One decoded source image (and its mask, a byte a pixel), while a
    /// worker transforms it.
    pub decode_bytes_per_worker: u64,
    /// Everything above together.
    pub total_bytes: u64,
}

impl LoaderShape {
    /// Saturates rather than wraps: settings too large to count hold more
    /// than any host has.
    pub fn footprint(&self) -> HostFootprint {
        let values = self.sample.iter().fold(1u64, |n, &d| n.saturating_mul(d as u64));
        let labels = if self.masks { (self.sample[1] as u64).saturating_mul(self.sample[2] as u64) } else { 1 };
        let batch_bytes = (self.batch_size as u64).saturating_mul(values.saturating_add(labels).saturating_mul(4));
        let builders = self.num_workers.max(1) as u64;
        let batches_in_flight = if self.num_workers == 0 {
            1
        } else {
            (self.num_workers as u64).saturating_mul((self.prefetch as u64).saturating_add(1)).saturating_add(1)
        };
        let bytes_per_source_pixel = if self.masks { 4 } else { 3 };
        let decode_bytes_per_worker = (self.source.0 as u64 * self.source.1 as u64).saturating_mul(bytes_per_source_pixel);
        HostFootprint {
            shape: *self,
            batch_bytes,
            batches_in_flight,
            decode_bytes_per_worker,
            total_bytes: batches_in_flight.saturating_mul(batch_bytes).saturating_add(builders.saturating_mul(decode_bytes_per_worker)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_batches_grow_with_workers_times_prefetch() {
        let shape = LoaderShape { batch_size: 32, sample: [3, 224, 224], num_workers: 4, prefetch: 2, source: (4000, 3000), masks: false };
        let f = shape.footprint();
        assert_eq!(f.batch_bytes, 32 * (3 * 224 * 224 * 4 + 4));
        assert_eq!(f.batches_in_flight, 4 * 3 + 1);
        assert_eq!(f.decode_bytes_per_worker, 36_000_000);
        assert_eq!(f.total_bytes, 13 * f.batch_bytes + 4 * 36_000_000);
        let inline = LoaderShape { num_workers: 0, ..shape }.footprint();
        assert_eq!(inline.batches_in_flight, 1);
        assert_eq!(inline.total_bytes, f.batch_bytes + 36_000_000);
        let wide = LoaderShape { num_workers: 16, prefetch: 4, ..shape }.footprint();
        assert!(wide.total_bytes > 5 * f.total_bytes);
    }

    #[test]
    fn masks_add_a_label_per_pixel_to_each_batch_and_a_byte_per_pixel_to_each_decode() {
        let shape = LoaderShape { batch_size: 16, sample: [3, 128, 128], num_workers: 2, prefetch: 2, source: (640, 480), masks: true };
        let f = shape.footprint();
        assert_eq!(f.batch_bytes, 16 * (3 * 128 * 128 + 128 * 128) * 4);
        assert_eq!(f.decode_bytes_per_worker, 640 * 480 * 4);
        let classified = LoaderShape { masks: false, ..shape }.footprint();
        assert_eq!(f.batch_bytes - classified.batch_bytes, 16 * (128 * 128 - 1) * 4);
    }
}
