//! Stochastic rounding of AdamW's f32 updates into bf16 (or f16) parameters, for training without f32 master
//! copies (`[train.adamw] masters = "stochastic"`: 4 bytes a parameter less, the footprint of PyTorch's plain
//! bf16 AdamW). Rounding to nearest would drop every update smaller than half a bf16 step (1/512 to 1/256
//! of the weight), so a weight stops moving once the learning rate has decayed; rounding up or down with the
//! probabilities that make the expectation the f32 value keeps those updates on average.
//!
//! The noise is a pure function of a key (the optimizer step and the parameter's place in the model) and
//! each value's coordinates, hashed with integer tensor ops on the device: a resumed run draws what the
//! uninterrupted one drew, data-parallel replicas round alike, and nothing depends on a backend's global
//! random state. The hash keeps every intermediate value within 31 bits, so backends with 32-bit integers
//! (CUDA, Vulkan) and 64-bit ones (the CPU) compute the same bits; `mix31` is its host form.

use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, FloatDType, Int, Tensor};

const MASK31: u32 = 0x7FFF_FFFF;
/// Odd multipliers below 2^31 (a product with a 31-bit value stays below 2^62 in 64-bit integers); kiln's
/// AdamW kernel hashes with them too.
pub(crate) const MUL1: u32 = 0x21F0_AAAD;
pub(crate) const MUL2: u32 = 0x735A_2D39;

/// A bijection on 31-bit values that spreads every input bit over the output (xor-shifts and odd
/// multiplications modulo 2^31). The host form of `mix31_tensor`.
pub fn mix31(x: u32) -> u32 {
    let mut x = x & MASK31;
    x ^= x >> 16;
    x = x.wrapping_mul(MUL1) & MASK31;
    x ^= x >> 15;
    x = x.wrapping_mul(MUL2) & MASK31;
    x ^ (x >> 15)
}

/// `mix31` of every value of `x` (each within 31 bits, non-negative).
fn mix31_tensor<B: Backend, const D: usize>(x: Tensor<B, D, Int>) -> Tensor<B, D, Int> {
    let low31 = |t: Tensor<B, D, Int>| t.bitwise_and_scalar(MASK31.elem());
    let shifted_xor = |t: Tensor<B, D, Int>, s: u32| t.clone().bitwise_xor(t.bitwise_right_shift_scalar(s.elem()));
    let x = low31(shifted_xor(x, 16).mul_scalar(MUL1));
    let x = low31(shifted_xor(x, 15).mul_scalar(MUL2));
    shifted_xor(x, 15)
}

/// The key of one parameter's noise at optimizer step `step` (from 1): the step and the parameter's place in
/// the model's order, mixed so that neighbouring steps and parameters start far apart.
pub fn noise_key(step: usize, ordinal: usize) -> u32 {
    mix31(mix31(step as u32) ^ ordinal as u32)
}

/// Values uniform in [0, 1) at a resolution of 2^-16 (the bits the bit-level form of stochastic rounding
/// adds below a bf16), in f32, shaped `dims`: each value hashed from `key` and its coordinates one axis at a
/// time, so no flat index can overflow 31 bits whatever the tensor's size.
pub fn noise<B: Backend, const D: usize>(dims: [usize; D], key: u32, device: &B::Device) -> Tensor<B, D> {
    let mut hash = Tensor::<B, D, Int>::full([1; D], (key & MASK31) as i64, device);
    for (axis, &len) in dims.iter().enumerate() {
        let mut shape = [1; D];
        shape[axis] = len;
        let index = Tensor::<B, 1, Int>::arange(0..len as i64, device).reshape(shape);
        let mut wide = hash.dims();
        wide[axis] = len;
        hash = mix31_tensor(hash.expand(wide).bitwise_xor(index));
    }
    // Two bytes of the hash's top bits, each exact in any float dtype (the device's default may be bf16).
    let byte = |shift: u32| {
        hash.clone()
            .bitwise_right_shift_scalar(shift.elem())
            .bitwise_and_scalar(0xFFu32.elem())
            .float()
            .cast(FloatDType::F32)
    };
    (byte(23) * 256.0 + byte(15)) / 65536.0
}

/// How far `stochastic_round` reaches from the nearest value toward the neighbour in `dtype`: a share of the
/// nearest value's magnitude (0.6 of a step, `0.6·2^-bits` for its significand bits below the leading one),
/// and at least a least reach (f16's subnormals are evenly spaced 2^-24 apart; bf16 shares f32's range, 0).
/// `None` for dtypes stochastic rounding does not apply to. kiln's AdamW kernel takes the same pair.
pub(crate) fn reach(dtype: FloatDType) -> Option<(f32, f32)> {
    match dtype {
        FloatDType::BF16 => Some((0.6 * 2f32.powi(-7), 0.0)),
        FloatDType::F16 => Some((0.6 * 2f32.powi(-10), 0.6 * 2f32.powi(-24))),
        _ => None,
    }
}

/// `x` (f32) rounded into `dtype` stochastically with `u` (uniform in [0, 1), `noise`): to one of the two
/// values of `dtype` around it, the farther one with probability `distance / gap`, so that the expected result
/// is `x`. Values `dtype` holds exactly stay as they are; non-finite values round to nearest. Other dtypes
/// than bf16 and f16 get `x` cast to them.
///
/// Computed with casts and f32 arithmetic only: `nearest` is `x` rounded to nearest, and the neighbour on
/// `x`'s side of it is what the cast makes of `nearest ± 0.6·|nearest|·2^-bits` — 0.6 of a step here, of
/// twice the step below a power of two, in either case well inside the neighbour's rounding interval.
pub fn stochastic_round<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    dtype: FloatDType,
    u: Tensor<B, D>,
) -> Tensor<B, D> {
    let Some((scale, least)) = reach(dtype) else { return x.cast(dtype) };
    let x = x.cast(FloatDType::F32);
    let nearest = x.clone().cast(dtype).cast(FloatDType::F32);
    let past = x - nearest.clone();
    let reach = (nearest.clone().abs() * scale).clamp_min(least);
    let other = (nearest.clone() + past.clone().sign() * reach).cast(dtype).cast(FloatDType::F32);
    let gap = (other.clone() - nearest.clone()).abs();
    // past = 0 gives 0/0 (no move); a zero gap with past ≠ 0 gives +∞, and `other` is `nearest` then.
    let move_probability = past.abs() / gap;
    let take = u.lower(move_probability).bool_and(other.clone().is_finite());
    nearest.mask_where(take, other).cast(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::{IntDType, TensorData};

    type B = Flex;

    fn values<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
        t.cast(FloatDType::F32).into_data().convert::<f32>().to_vec::<f32>().expect("f32 values")
    }

    #[test]
    fn the_tensor_hash_is_the_host_hash_in_64_and_32_bit_integers() {
        let device = Default::default();
        let inputs: Vec<i64> =
            [0u32, 1, 2, 3, 255, 65_535, 1 << 20, 0x7FFF_FFFE, MASK31, 0x1234_5678].iter().map(|&x| x as i64).collect();
        let expected: Vec<i64> = inputs.iter().map(|&x| mix31(x as u32) as i64).collect();
        let wide = Tensor::<B, 1, Int>::from_data(TensorData::new(inputs.clone(), [inputs.len()]), &device);
        let narrow = wide.clone().cast(IntDType::I32);
        for (name, t) in [("i64", wide), ("i32", narrow)] {
            let got: Vec<i64> = mix31_tensor(t).into_data().convert::<i64>().to_vec::<i64>().expect("ints");
            assert_eq!(got, expected, "{name}");
        }
        // A bijection on 31 bits: no two of 2^16 consecutive inputs collide.
        let mut seen: Vec<u32> = (0..1u32 << 16).map(|x| mix31(x * 7919)).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 1 << 16);
    }

    #[test]
    fn noise_is_a_function_of_key_and_coordinates_and_close_to_uniform() {
        let device = Default::default();
        let a = values(noise::<B, 2>([256, 300], noise_key(1, 0), &device));
        assert_eq!(a, values(noise::<B, 2>([256, 300], noise_key(1, 0), &device)), "same key, same noise");
        let b = values(noise::<B, 2>([256, 300], noise_key(2, 0), &device));
        let c = values(noise::<B, 2>([256, 300], noise_key(1, 1), &device));
        let same = |x: &[f32], y: &[f32]| x.iter().zip(y).filter(|(p, q)| p == q).count();
        // Two independent 16-bit draws agree about once in 65,536.
        assert!(same(&a, &b) < 20 && same(&a, &c) < 20, "{} {}", same(&a, &b), same(&a, &c));
        let n = a.len() as f64;
        assert!(a.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = a.iter().map(|&u| u as f64).sum::<f64>() / n;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
        // Sixteen bins hold n/16 each within 5 standard deviations.
        let mut bins = [0usize; 16];
        a.iter().for_each(|&u| bins[(u * 16.0) as usize] += 1);
        let (expected, sd) = (n / 16.0, (n / 16.0 * 15.0 / 16.0).sqrt());
        assert!(bins.iter().all(|&k| (k as f64 - expected).abs() < 5.0 * sd), "{bins:?}");
        // Horizontal and vertical neighbours uncorrelated.
        let centred: Vec<f64> = a.iter().map(|&u| u as f64 - mean).collect();
        let var = centred.iter().map(|x| x * x).sum::<f64>();
        for step in [1, 300] {
            let cov: f64 = centred.iter().zip(&centred[step..]).map(|(x, y)| x * y).sum();
            assert!((cov / var).abs() < 0.02, "lag {step}: {}", cov / var);
        }
        // Ranks 1 and 3 draw too.
        assert_eq!(values(noise::<B, 1>([5], 9, &device)).len(), 5);
        assert_eq!(values(noise::<B, 3>([2, 3, 4], 9, &device)).len(), 24);
    }

    /// The two values of `dtype` around `x`, from the host's conversions.
    fn neighbours(x: f32, dtype: FloatDType) -> (f32, f32) {
        let round = |v: f32| match dtype {
            FloatDType::BF16 => half::bf16::from_f32(v).to_f32(),
            _ => half::f16::from_f32(v).to_f32(),
        };
        let nearest = round(x);
        let mut other = nearest;
        let mut delta = nearest.abs().max(1e-30) * 1e-4;
        while other == nearest && x != nearest {
            other = round(nearest + (x - nearest).signum() * delta);
            delta *= 1.5;
        }
        (nearest.min(other), nearest.max(other))
    }

    #[test]
    fn rounds_to_a_neighbour_without_bias() {
        let device = Default::default();
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            // Values between representable ones at several magnitudes and signs, just above and below powers of
            // two, in f16's subnormal range, and exact ones.
            let targets = [1.0f32 + 1e-3, -3.3e-2, 0.5 - 1e-4, 2.0 + 5e-3, 7.77e-5, -6.1e-6, 1.0, 0.0, 0.75];
            let copies = 20_000;
            let x: Vec<f32> = targets.iter().flat_map(|&t| std::iter::repeat_n(t, copies)).collect();
            let shape = [targets.len(), copies];
            let xt = Tensor::<B, 2>::from_data(TensorData::new(x, shape), &device);
            let rounded = values(stochastic_round(xt, dtype, noise::<B, 2>(shape, 77, &device)));
            for (i, &t) in targets.iter().enumerate() {
                let row = &rounded[i * copies..(i + 1) * copies];
                let (lo, hi) = neighbours(t, dtype);
                assert!(row.iter().all(|&r| r == lo || r == hi), "{dtype:?} {t}: {lo} {hi} {:?}", &row[..4]);
                let mean = row.iter().map(|&r| r as f64).sum::<f64>() / copies as f64;
                // The mean of Bernoulli draws between lo and hi within 5 standard deviations of t.
                let p = if hi > lo { (t - lo) as f64 / (hi - lo) as f64 } else { 0.0 };
                let sd = (hi - lo) as f64 * (p * (1.0 - p) / copies as f64).sqrt();
                assert!((mean - t as f64).abs() <= 5.0 * sd + 1e-12, "{dtype:?} {t}: mean {mean}, lo {lo}, hi {hi}");
            }
        }
    }

    #[test]
    fn keeps_updates_that_rounding_to_nearest_drops() {
        // A weight of 1.0 in bf16 moved by −1e-4 a step for 200 steps (a bf16 step at 1.0 is 2^-7 below it
        // 2^-8): to nearest it never moves; stochastically its values average 1 − 0.02.
        let device = Default::default();
        let n = 4096;
        let mut nearest = Tensor::<B, 1>::ones([n], &device).cast(FloatDType::BF16);
        let mut stochastic = nearest.clone();
        for step in 1..=200 {
            nearest = (nearest.cast(FloatDType::F32) - 1e-4).cast(FloatDType::BF16);
            let moved = stochastic.cast(FloatDType::F32) - 1e-4;
            stochastic = stochastic_round(moved, FloatDType::BF16, noise::<B, 1>([n], noise_key(step, 0), &device));
        }
        assert!(values(nearest).iter().all(|&w| w == 1.0));
        let mean = values(stochastic).iter().map(|&w| w as f64).sum::<f64>() / n as f64;
        assert!((mean - 0.98).abs() < 1e-3, "mean {mean}");
    }

    #[test]
    fn non_finite_and_f32_values_pass_through() {
        let device = Default::default();
        let x = Tensor::<B, 1>::from_data([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3.0e38, 1.0e-3], &device);
        let u = noise::<B, 1>([5], 3, &device);
        let r = values(stochastic_round(x.clone(), FloatDType::BF16, u.clone()));
        assert!(r[0].is_nan() && r[1] == f32::INFINITY && r[2] == f32::NEG_INFINITY, "{r:?}");
        assert!(r[3].is_finite() && (r[3] - 3.0e38).abs() / 3.0e38 < 1e-2 && (r[4] - 1e-3).abs() < 1e-5, "{r:?}");
        assert_eq!(values(stochastic_round(x, FloatDType::F32, u))[4], 1.0e-3);
    }
}
