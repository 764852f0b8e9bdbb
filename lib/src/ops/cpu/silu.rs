//! SiLU's slices and the vectorised `e^x` they and the other elementwise
//! kernels use: the formulas candle's `silu` and its backward use, with
//! `e^x` computed by a polynomial the compiler turns into SIMD code instead
//! of one call of the C library's `expf` per element (a tenth of an
//! EfficientNet-B0 step). The slice functions are compiled for AVX-512, for
//! AVX2 with FMA and for the baseline, and pick one at run time.

use multiversion::multiversion;

/// `values[i] = v / (1 + e^-v)`, as candle's `silu` computes it.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
pub(in crate::ops) fn silu_in_place(values: &mut [f32]) {
    for v in values {
        *v /= 1.0 + exp(-*v);
    }
}

/// `exp_neg[i] = e^-x[i]`.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
pub(in crate::ops) fn exp_of_negated(x: &[f32], exp_neg: &mut [f32]) {
    for (&v, e) in x.iter().zip(exp_neg.iter_mut()) {
        *e = exp(-v);
    }
}

/// `exp_neg[i] = e^-pre[i]` and `out[i] = pre[i] / (1 + exp_neg[i])`: the
/// activation, and what its derivative reads again.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
pub(in crate::ops) fn silu_keeping_exp(pre: &[f32], exp_neg: &mut [f32], out: &mut [f32]) {
    for ((&p, e), o) in pre.iter().zip(exp_neg.iter_mut()).zip(out.iter_mut()) {
        *e = exp(-p);
        *o = p / (1.0 + *e);
    }
}

/// `grad[i] *= s * (1 - out[i]) + out[i]` with `s = 1 / (exp_neg[i] + 1)`,
/// the sigmoid: SiLU's derivative as candle's backward computes it, from
/// [`silu_keeping_exp`]'s two outputs (`out` as the forward stored it).
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
pub(in crate::ops) fn silu_backward(grad: &mut [f32], exp_neg: &[f32], out: &[f32]) {
    for ((d, &e), &o) in grad.iter_mut().zip(exp_neg).zip(out) {
        let sigmoid = 1.0 / (e + 1.0);
        *d *= sigmoid * (1.0 - o) + o;
    }
}

/// `e^x` within 2 ulp of the correctly rounded value, `inf` above 88.72 and
/// 0 (through the subnormals) below -103.9, with no branch and no call, so
/// that loops over it vectorise. Cephes' `expf`: `x = n ln 2 + r` with `|r|
/// <= ln 2 / 2`, `e^r` by its degree-7 polynomial, `2^n` as two
/// exponent-field scalings so that the product may go subnormal or infinite
/// as IEEE multiplication does.
#[inline(always)]
pub(in crate::ops) fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that `n * LN2_HIGH` is exact for every n reached here.
    const LN2_HIGH: f32 = 0.693_359_4;
    const LN2_LOW: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds an f32 to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-104.0, 89.0);
    let rounded = x * LOG2_E + ROUND;
    let n = rounded - ROUND;
    let r = x - n * LN2_HIGH - n * LN2_LOW;
    let r2 = r * r;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let e_r = p * r2 + r + 1.0;
    // n's integer from the rounding sum's low bits: `as i32` saturates,
    // which the compiler does not vectorise.
    let n = rounded.to_bits() as i32 - ROUND.to_bits() as i32;
    let half = n >> 1;
    e_r * two_to(half) * two_to(n - half)
}

/// `2^n` for `-126 <= n <= 127`, by its exponent field.
#[inline(always)]
fn two_to(n: i32) -> f32 {
    f32::from_bits(((n + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        if a == b {
            return 0;
        }
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_of_the_c_library_everywhere_it_is_finite() {
        let mut worst = (0, 0.0);
        let mut x = -103.0f32;
        while x < 88.7 {
            let error = ulps(exp(x), x.exp());
            if error > worst.0 {
                worst = (error, x);
            }
            x += 0.000_37;
        }
        assert!(worst.0 <= 2, "{} ulp at {}", worst.0, worst.1);
    }

    #[test]
    fn exp_overflows_and_underflows_as_the_c_library_does() {
        for x in [89.0, 100.0, f32::INFINITY] {
            assert_eq!(exp(x), f32::INFINITY, "{x}");
        }
        for x in [-104.0, -200.0, f32::NEG_INFINITY] {
            assert_eq!(exp(x), 0.0, "{x}");
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-100.0) > 0.0 && exp(-100.0) < f32::MIN_POSITIVE, "subnormal below -87.3");
    }

    #[test]
    fn silu_and_its_derivative_match_candles_scalar_formulas() {
        let pre: Vec<f32> = (0..4099).map(|i| (i as f32 - 2049.0) * 0.05).collect();
        let mut values = pre.clone();
        silu_in_place(&mut values);
        let (mut e, mut out) = (vec![0.0; pre.len()], vec![0.0; pre.len()]);
        silu_keeping_exp(&pre, &mut e, &mut out);
        let mut grad = vec![1.5; pre.len()];
        silu_backward(&mut grad, &e, &out);
        for (i, &p) in pre.iter().enumerate() {
            let scalar = p / (1.0 + (-p).exp());
            let derivative = 1.0 / ((-p).exp() + 1.0) * (1.0 - scalar) + scalar;
            assert!(ulps(values[i], scalar) <= 4 || (values[i] - scalar).abs() < 1e-30, "silu({p})");
            assert_eq!(values[i], out[i], "the two forward paths agree at {p}");
            assert!((grad[i] - 1.5 * derivative).abs() <= 1e-6 * (1.5 * derivative).abs().max(1.0), "silu'({p})");
        }
    }
}
