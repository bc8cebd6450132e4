//! Block-wise 8-bit storage of AdamW's moments (`moments = "q8"`), as bitsandbytes' 8-bit optimizers keep
//! them (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"): the values are cut into
//! blocks of 256, each block is divided by its largest magnitude, and every value is stored as the index
//! (one byte) of the nearest of the 256 codes of the dynamic tree map — signed for the first moment,
//! unsigned for the second, which is never negative. The map's codes are dense near the block's maximum and
//! spread over seven decades below it, so small moments keep a few significant digits instead of flushing
//! to zero as a linear 8-bit scale would (a second moment flushed to zero turns its update into `m / eps`).
//!
//! Quantization runs as tensor ops on any backend: a value's decade and position inside it give a
//! candidate code arithmetically; the candidate and its two neighbours are looked up in the map and the
//! nearest wins, which is the nearest code exactly even where the float arithmetic of the candidate lands
//! one code off (at the edges of decades). Storage per value: one byte, plus one f32 scale per block.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Int, IntDType, Tensor, TensorData};

use crate::backend::{host_tensor, zeros_in};

/// Values per block, each block with its own scale (bitsandbytes' block size for its 8-bit optimizers).
pub const BLOCK: usize = 256;

/// Tensors with fewer values keep f32 moments (norm weights, biases: a negligible share of the memory),
/// as bitsandbytes' `min_8bit_size`.
pub const MIN_ELEMENTS: usize = 4096;

/// Blocks quantized at once: bounds the f32 temporaries of one quantization to 64 MiB each, whatever the
/// tensor's size (an MoE layer's fused expert weights hold hundreds of millions of values).
const BLOCKS_AT_ONCE: usize = 1 << 16;

/// The dynamic tree map's decades: codes from 10⁻⁷ up to 1 of the block's largest magnitude.
const DECADES: i32 = 7;

/// Which of the two dynamic maps a moment is stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Map {
    /// For values of either sign (the first moment): 127 magnitudes of each sign, zero and 1.
    Signed,
    /// For values never negative (the second moment): 254 magnitudes, zero and 1.
    Unsigned,
}

impl Map {
    /// Codes in decade `i` (of `0..DECADES`, covering `[10^(i-7), 10^(i-6)]`): doubling from decade to decade,
    /// twice as many in the unsigned map, which needs no sign bit.
    fn codes_in_decade(self, i: i32) -> usize {
        match self {
            Map::Signed => 1 << i,
            Map::Unsigned => 2 << i,
        }
    }

    /// The magnitudes of decade `i`, ascending: the midpoints of `codes_in_decade(i)` equal steps from 0.1 to 1,
    /// times `10^(i-6)`.
    fn decade(self, i: i32) -> impl Iterator<Item = f64> {
        let n = self.codes_in_decade(i);
        let scale = 10f64.powi(i - (DECADES - 1));
        (0..n).map(move |j| scale * (0.1 + (j as f64 + 0.5) * 0.9 / n as f64))
    }

    /// The 256 codes, ascending (bitsandbytes' `create_dynamic_map(signed, 7, 8)`).
    pub fn codes(self) -> Vec<f32> {
        let magnitudes: Vec<f64> = (0..DECADES).flat_map(|i| self.decade(i)).collect();
        let mut codes: Vec<f64> = match self {
            Map::Signed => magnitudes.iter().rev().map(|m| -m).collect(),
            Map::Unsigned => Vec::new(),
        };
        codes.push(0.0);
        codes.extend(&magnitudes);
        codes.push(1.0);
        codes.into_iter().map(|c| c as f32).collect()
    }

    /// The index of the smallest positive magnitude in `codes()` (zero sits just below it).
    fn first_positive(self) -> f64 {
        match self {
            Map::Signed => 128.0,
            Map::Unsigned => 1.0,
        }
    }
}

/// A tensor's values in 8 bits: `codes[b, i]` indexes `map.codes()`, times `absmax[b]` (the block's largest
/// magnitude, 0 for an all-zero block). The last block is padded with zeros up to `BLOCK`.
#[derive(Debug, Clone)]
pub struct Blocks<B: Backend> {
    /// `[blocks, BLOCK]` code indices, stored as u8.
    pub codes: Tensor<B, 2, Int>,
    /// `[blocks, 1]` scales in f32.
    pub absmax: Tensor<B, 2>,
}

/// Quantizes `values` (any float dtype, computed in f32) in `map`.
pub fn quantize<B: Backend>(values: Tensor<B, 1>, map: Map) -> Blocks<B> {
    let len = values.dims()[0];
    let device = values.device();
    let blocks = len.div_ceil(BLOCK).max(1);
    let mut flat = values.cast(FloatDType::F32);
    if blocks * BLOCK > len {
        flat = Tensor::cat(vec![flat, zeros_in::<B, 1>([blocks * BLOCK - len], FloatDType::F32, &device)], 0);
    }
    let rows = flat.reshape([blocks, BLOCK]);
    let table = host_tensor::<B, 1>(map.codes(), [BLOCK], FloatDType::F32, &device);
    let (mut codes, mut scales) = (Vec::new(), Vec::new());
    for start in (0..blocks).step_by(BLOCKS_AT_ONCE) {
        let part = rows.clone().narrow(0, start, BLOCKS_AT_ONCE.min(blocks - start));
        let (c, s) = quantize_rows(part, &table, map);
        codes.push(c);
        scales.push(s);
    }
    Blocks { codes: Tensor::cat(codes, 0), absmax: Tensor::cat(scales, 0) }
}

/// Blocks `[rows, BLOCK]` in f32 → their code indices (u8) and scales `[rows, 1]`.
fn quantize_rows<B: Backend>(rows: Tensor<B, 2>, table: &Tensor<B, 1>, map: Map) -> (Tensor<B, 2, Int>, Tensor<B, 2>) {
    let absmax = rows.clone().abs().max_dim(1);
    // Scaled by the reciprocal and clamped, as bitsandbytes does; an all-zero block by 1 (its values are all
    // code zero either way).
    let divisor = absmax.clone().mask_fill(absmax.clone().equal_elem(0.0), 1.0);
    let x = (rows * divisor.recip()).clamp(-1.0, 1.0);
    let magnitude = x.clone().abs();
    let decade = (magnitude.clone().clamp_min(1e-30).log() / std::f64::consts::LN_10).floor().add_scalar(DECADES);
    let decade = decade.clamp(0.0, f64::from(DECADES - 1));
    let scale = (decade.clone() - f64::from(DECADES - 1)).mul_scalar(std::f64::consts::LN_10).exp();
    let per_decade = map.codes_in_decade(0) as f64;
    let count = (decade.mul_scalar(std::f64::consts::LN_2).exp() * per_decade).round();
    // The code whose step of the decade holds the value, then its rank among all magnitudes: the decades
    // below hold `count - per_decade` of them (1 + 2 + … or 2 + 4 + …).
    let step = ((magnitude / scale - 0.1) * count.clone() / 0.9).floor().clamp_min(0.0).min_pair(count.clone() - 1.0);
    let rank = count - per_decade + step;
    let first = map.first_positive();
    let candidate = match map {
        Map::Signed => (rank.clone() + first).mask_where(x.clone().lower_elem(0.0), rank.neg() + (first - 2.0)),
        Map::Unsigned => rank + first,
    };
    // A non-finite moment (its block scale NaN or infinite) still gets an index inside the map, so the
    // lookups stay in bounds; the scale keeps the value non-finite, and the run stops on its loss.
    let candidate = candidate.clone().mask_fill(candidate.is_nan(), first);
    let nearest = nearest_code(x, candidate, table);
    (nearest.cast(IntDType::U8), absmax)
}

/// Among the codes at `candidate - 1`, `candidate` and `candidate + 1`, the index of the one nearest `x`.
fn nearest_code<B: Backend>(x: Tensor<B, 2>, candidate: Tensor<B, 2>, table: &Tensor<B, 1>) -> Tensor<B, 2> {
    let shape = x.dims();
    let last = (BLOCK - 1) as f64;
    let distance = |index: &Tensor<B, 2>| {
        let code = table.clone().select(0, index.clone().reshape([-1]).int()).reshape(shape);
        (code - x.clone()).abs()
    };
    let mut best_distance = distance(&candidate);
    let mut best = candidate.clone();
    for offset in [-1.0, 1.0] {
        let index = (candidate.clone() + offset).clamp(0.0, last);
        let d = distance(&index);
        let closer = d.clone().lower(best_distance.clone());
        best = best.mask_where(closer.clone(), index);
        best_distance = best_distance.mask_where(closer, d);
    }
    best
}

/// The first `len` f32 values of `blocks` (the padding dropped).
pub fn dequantize<B: Backend>(blocks: &Blocks<B>, map: Map, len: usize) -> Tensor<B, 1> {
    let device = blocks.absmax.device();
    let [rows, width] = blocks.codes.dims();
    let table = host_tensor::<B, 1>(map.codes(), [BLOCK], FloatDType::F32, &device);
    let codes = table.select(0, blocks.codes.clone().reshape([-1]).cast(IntDType::I32)).reshape([rows, width]);
    (codes * blocks.absmax.clone()).reshape([rows * width]).narrow(0, 0, len)
}

impl<B: Backend> Blocks<B> {
    /// The number of blocks.
    pub fn block_count(&self) -> usize {
        self.absmax.dims()[0]
    }

    /// The code indices and scales as host f32 values (a training-state file's `.q8` and `.absmax`).
    pub fn to_host(&self) -> (Vec<f32>, Vec<f32>) {
        let codes = self.codes.clone().into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default();
        let scales = self.absmax.clone().into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default();
        (codes, scales)
    }

    /// Blocks from the host values `to_host` wrote: an error when there is not one scale per `BLOCK` codes
    /// or a code is not an index of the map.
    pub fn from_host(codes: &[f32], scales: &[f32], device: &B::Device) -> Result<Self, String> {
        let blocks = scales.len();
        if blocks == 0 || codes.len() != blocks * BLOCK {
            return Err(format!(
                "an 8-bit moment needs {BLOCK} codes per block scale, found {} codes and {blocks} scales",
                codes.len()
            ));
        }
        let bytes = codes
            .iter()
            .map(|&c| (c.fract() == 0.0 && (0.0..=255.0).contains(&c)).then_some(c as u8))
            .collect::<Option<Vec<u8>>>()
            .ok_or("an 8-bit moment's code is not an integer from 0 to 255")?;
        Ok(Blocks {
            codes: Tensor::from_data(TensorData::new(bytes, [blocks, BLOCK]), (device, DType::U8)),
            absmax: host_tensor::<B, 2>(scales.to_vec(), [blocks, 1], FloatDType::F32, device),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::testing::{normal, values};

    /// The nearest code index by brute force, as bitsandbytes' reference quantizer finds it.
    fn nearest_by_search(x: f32, codes: &[f32]) -> usize {
        let mut best = 0;
        for (i, c) in codes.iter().enumerate() {
            if (c - x).abs() < (codes[best] - x).abs() {
                best = i;
            }
        }
        best
    }

    fn quantize_host(data: Vec<f32>, map: Map) -> (Vec<f32>, Vec<f32>) {
        let n = data.len();
        quantize(Tensor::<Cpu, 1>::from_data(TensorData::new(data, [n]), &Default::default()), map).to_host()
    }

    #[test]
    fn the_maps_are_sorted_and_hold_zero_and_one() {
        for map in [Map::Signed, Map::Unsigned] {
            let codes = map.codes();
            assert_eq!(codes.len(), 256);
            assert!(codes.windows(2).all(|w| w[0] < w[1]), "{map:?} not strictly ascending");
            assert_eq!((codes[map.first_positive() as usize - 1], codes[255]), (0.0, 1.0));
        }
        assert!((Map::Signed.codes()[0] + 0.99296875).abs() < 1e-7);
        assert!((Map::Unsigned.codes()[1] - 3.25e-7).abs() < 1e-12);
        assert!((Map::Signed.codes()[128] - 5.5e-7).abs() < 1e-12);
    }

    /// Every value lands on the nearest code, at the decades' edges, the codes themselves and the midpoints
    /// between them included, where the candidate's float arithmetic is most likely to be a code off.
    #[test]
    fn quantization_picks_the_nearest_code() {
        for map in [Map::Signed, Map::Unsigned] {
            let codes = map.codes();
            let mut probes: Vec<f32> = vec![0.0, 1.0, 1e-9, 2.75e-7, 0.5, 0.999];
            for w in codes.windows(2) {
                let mid = (w[0] + w[1]) / 2.0;
                probes.extend([w[0], mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1)]);
            }
            for e in -7..=0 {
                let edge = 10f32.powi(e);
                probes.extend([edge, edge * 1.000_001, edge * 0.999_999]);
            }
            probes.retain(|p| p.abs() <= 1.0 && (map == Map::Signed || *p >= 0.0));
            if map == Map::Signed {
                let negatives: Vec<f32> = probes.iter().map(|p| -p).collect();
                probes.extend(negatives);
            }
            // One block holding 1.0 keeps the scale at 1, so each probe is quantized as it is.
            for chunk in probes.chunks(BLOCK - 1) {
                let mut block = vec![1.0];
                block.extend(chunk);
                let (got, scales) = quantize_host(block.clone(), map);
                assert_eq!(scales[0], 1.0);
                for (x, code) in block.iter().zip(&got) {
                    let want = nearest_by_search(*x, &codes);
                    let (got_value, want_value) = (codes[*code as usize], codes[want]);
                    assert!(
                        (got_value - x).abs() <= (want_value - x).abs(),
                        "{map:?}: {x} → code {code} ({got_value}), nearest is {want} ({want_value})"
                    );
                }
            }
        }
    }

    #[test]
    fn round_trip_error_is_bounded_by_the_maps_steps() {
        let device = Default::default();
        // Three blocks and a partial one: values spread over five decades, and a block of zeros.
        let mut data = values(normal::<Cpu, 1>([3 * BLOCK + 17], 0.0, 1.0, 3, &device));
        for (i, x) in data.iter_mut().enumerate() {
            *x *= 10f32.powi(-((i % 5) as i32));
        }
        data[BLOCK..2 * BLOCK].iter_mut().for_each(|x| *x = 0.0);
        let squares: Vec<f32> = data.iter().map(|x| x * x).collect();
        for (map, input) in [(Map::Signed, data), (Map::Unsigned, squares)] {
            let n = input.len();
            let blocks = quantize(Tensor::<Cpu, 1>::from_data(TensorData::new(input.clone(), [n]), &device), map);
            assert_eq!(blocks.codes.dims(), [4, BLOCK]);
            let back = values(dequantize(&blocks, map, n));
            assert_eq!(back.len(), n);
            let (_, scales) = blocks.to_host();
            assert_eq!(scales[1], 0.0);
            for (i, (x, y)) in input.iter().zip(&back).enumerate() {
                let absmax = scales[i / BLOCK];
                // Within half a code step of the value's decade (the step of the decade above for the
                // few values below the lowest one), and never a non-tiny value flushed to zero.
                let relative = f64::from(x.abs()) / f64::from(absmax.max(f32::MIN_POSITIVE));
                let decade = (relative.log10().floor() as i32 + DECADES).clamp(0, DECADES - 1);
                let step = 0.9 * 10f64.powi(decade - (DECADES - 1)) / map.codes_in_decade(decade) as f64;
                let bound = step / 2.0 * f64::from(absmax) * 1.0001 + 1e-30;
                assert!(f64::from((x - y).abs()) <= bound, "{map:?}[{i}] {x} → {y} (scale {absmax})");
                if relative > 3e-7 {
                    assert!(y.abs() > 0.0 && y.signum() == x.signum(), "{map:?}[{i}] {x} → {y}");
                }
            }
        }
    }

    /// A NaN or infinite value leaves its block non-finite (the run's loss then stops it) and every code an
    /// index of the map; the other blocks are untouched.
    #[test]
    fn non_finite_values_stay_non_finite_within_their_block() {
        let mut data = vec![0.5f32; 2 * BLOCK];
        data[3] = f32::NAN;
        data[BLOCK + 1] = f32::INFINITY;
        data[BLOCK + 2] = 0.25;
        for map in [Map::Signed, Map::Unsigned] {
            let n = data.len();
            let blocks =
                quantize(Tensor::<Cpu, 1>::from_data(TensorData::new(data.clone(), [n]), &Default::default()), map);
            let (codes, _) = blocks.to_host();
            assert!(codes.iter().all(|c| (0.0..=255.0).contains(c)), "{map:?}: {codes:?}");
            let back = values(dequantize(&blocks, map, n));
            assert!(back[..BLOCK].iter().any(|x| !x.is_finite()), "{map:?}: the NaN block came back finite");
            assert!(back[BLOCK..].iter().any(|x| !x.is_finite()), "{map:?}: the infinite block came back finite");
        }
    }

    #[test]
    fn blocks_round_trip_through_the_host_exactly_and_bad_files_are_refused() {
        let device = Default::default();
        let data = values(normal::<Cpu, 1>([BLOCK + 5], 0.0, 1.0, 4, &device));
        let blocks = quantize(Tensor::<Cpu, 1>::from_data(TensorData::new(data, [BLOCK + 5]), &device), Map::Signed);
        let (codes, scales) = blocks.to_host();
        let again = Blocks::<Cpu>::from_host(&codes, &scales, &device).unwrap();
        assert_eq!((again.codes.dtype(), again.block_count()), (DType::U8, 2));
        assert_eq!(again.to_host(), (codes.clone(), scales.clone()));
        let back = |b: &Blocks<Cpu>| values(dequantize(b, Map::Signed, BLOCK + 5));
        assert_eq!(back(&again), back(&blocks));
        let err = Blocks::<Cpu>::from_host(&codes, &scales[..1], &device).unwrap_err();
        assert!(err.contains("256 codes per block scale, found 512 codes and 1 scales"), "{err}");
        let mut bad = codes;
        bad[7] = 256.0;
        assert!(Blocks::<Cpu>::from_host(&bad, &scales, &device).unwrap_err().contains("0 to 255"));
    }
}
