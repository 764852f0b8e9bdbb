//! bitsandbytes' dynamic 8-bit data type and block-wise quantisation.

/// The 256 values an 8-bit code stands for, sorted ascending, as bitsandbytes'
/// `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)` builds them:
/// for each decade `10^-6 .. 10^0` the midpoints of an evenly split `[0.1, 1]`
/// (twice as many splits per decade upward), plus 0 and 1. The signed map
/// mirrors them below zero (no -1); the unsigned map spends that half on
/// twice the resolution.
///
/// Encoding finds the nearest value through a table indexed by the top 16 bits
/// of the input's order-preserving bit pattern, then two branch-free midpoint
/// comparisons: a binary search per element was the 8-bit step's bottleneck.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicMap {
    values: [f32; 256],
    /// `midpoints[c]` lies between `values[c]` and `values[c + 1]`; infinite past the last.
    midpoints: [f32; 255 + MIDPOINTS_PER_BUCKET],
    /// For each 16-bit bucket of order keys, the nearest code to its lowest value.
    first_code: Box<[u8]>,
}

/// The most midpoints one 16-bit bucket holds: a bucket spans at most 2^-7 of
/// its lowest value, and neighbouring values of both maps are at least
/// 0.9/128 (0.7%) of the larger apart.
const MIDPOINTS_PER_BUCKET: usize = 2;

/// The f32's bits, remapped so that unsigned order is numeric order.
#[inline]
fn order_key(x: f32) -> u32 {
    let bits = x.to_bits();
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

fn from_order_key(key: u32) -> f32 {
    if key & 0x8000_0000 != 0 {
        f32::from_bits(key & 0x7fff_ffff)
    } else {
        f32::from_bits(!key)
    }
}

impl DynamicMap {
    /// For the first moment, which has a sign.
    pub fn signed() -> Self {
        DynamicMap::build(true)
    }

    /// For the second moment, never negative.
    pub fn unsigned() -> Self {
        DynamicMap::build(false)
    }

    fn build(signed: bool) -> Self {
        const EXPONENT_BITS: i32 = 7;
        let mut data: Vec<f32> = Vec::with_capacity(256);
        for i in 0..EXPONENT_BITS {
            let splits = if signed { 1usize << i } else { 1usize << (i + 1) };
            let scale = 10f32.powi(i - (EXPONENT_BITS - 1));
            // torch.linspace(0.1, 1, splits + 1) in f32, then neighbour means.
            let step = 0.9f32 / splits as f32;
            let boundary = |k: usize| 0.1f32 + step * k as f32;
            for k in 0..splits {
                let mean = (boundary(k) + boundary(k + 1)) / 2.0;
                data.push(scale * mean);
                if signed {
                    data.push(-scale * mean);
                }
            }
        }
        data.push(0.0);
        data.push(1.0);
        data.sort_by(f32::total_cmp);
        let mut values = [0f32; 256];
        values.copy_from_slice(&data);
        let mut midpoints = [f32::INFINITY; 255 + MIDPOINTS_PER_BUCKET];
        for (c, mid) in midpoints.iter_mut().take(255).enumerate() {
            *mid = (values[c] + values[c + 1]) / 2.0;
        }
        let first_code = (0..1u32 << 16)
            .map(|bucket| {
                let lowest = from_order_key(bucket << 16);
                midpoints.partition_point(|&m| m < lowest) as u8
            })
            .collect();
        DynamicMap { values, midpoints, first_code }
    }

    pub fn values(&self) -> &[f32; 256] {
        &self.values
    }

    #[inline]
    pub fn decode(&self, code: u8) -> f32 {
        self.values[code as usize]
    }

    /// The code of the value nearest to `x` (which should lie in [-1, 1]);
    /// halfway between two values, the lower.
    #[inline]
    pub fn encode(&self, x: f32) -> u8 {
        let mut code = self.first_code[(order_key(x) >> 16) as usize] as usize;
        for _ in 0..MIDPOINTS_PER_BUCKET {
            code += usize::from(self.midpoints[code] < x);
        }
        code as u8
    }

    /// Quantises one block: each value is divided by the block's largest
    /// magnitude, which is returned, and replaced by the nearest code.
    pub fn quantize_block(&self, values: &[f32], codes: &mut [u8]) -> f32 {
        let absmax = values.iter().fold(0f32, |max, v| max.max(v.abs()));
        let inverse = if absmax > 0.0 { 1.0 / absmax } else { 0.0 };
        for (code, &v) in codes.iter_mut().zip(values) {
            *code = self.encode(v * inverse);
        }
        absmax
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_bucket_holds_more_midpoints_than_encode_steps_over() {
        for map in [DynamicMap::signed(), DynamicMap::unsigned()] {
            let midpoints = &map.midpoints[..255];
            for bucket in 0..(1u32 << 16) - 1 {
                let low = from_order_key(bucket << 16);
                let high = from_order_key((bucket + 1) << 16);
                let inside = midpoints.iter().filter(|&&m| low <= m && m < high).count();
                assert!(inside <= MIDPOINTS_PER_BUCKET, "bucket {bucket} [{low}, {high}) holds {inside}");
            }
        }
    }
}
