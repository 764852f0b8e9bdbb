//! bitsandbytes' dynamic 8-bit data type and block-wise quantisation.

/// The 256 values an 8-bit code stands for, sorted ascending, as bitsandbytes'
/// `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)` builds them:
/// for each decade `10^-6 .. 10^0` the midpoints of an evenly split `[0.1, 1]`
/// (twice as many splits per decade upward), plus 0 and 1. The signed map
/// mirrors them below zero (no -1); the unsigned map spends that half on
/// twice the resolution.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicMap {
    values: [f32; 256],
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
            let splits = if signed {
                1usize << i
            } else {
                1usize << (i + 1)
            };
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
        DynamicMap { values }
    }

    pub fn values(&self) -> &[f32; 256] {
        &self.values
    }

    #[inline]
    pub fn decode(&self, code: u8) -> f32 {
        self.values[code as usize]
    }

    /// The code of the value nearest to `x` (which should lie in [-1, 1]).
    #[inline]
    pub fn encode(&self, x: f32) -> u8 {
        let above = self.values.partition_point(|&v| v < x);
        let code = match above {
            0 => 0,
            256 => 255,
            i if x - self.values[i - 1] <= self.values[i] - x => i - 1,
            i => i,
        };
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
