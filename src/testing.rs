//! Helpers shared by the unit tests that hold an op to its reference computation.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

/// A tensor's values as f32.
pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().expect("a float tensor")
}

/// Every value of `got` within `tolerance` × the largest magnitude of `reference` (which must not be all
/// zero: that would check nothing).
pub fn assert_close(what: &str, got: &[f32], reference: &[f32], tolerance: f32) {
    assert_eq!(got.len(), reference.len(), "{what}: lengths");
    let scale = reference.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(scale > 0.0, "{what}: an all-zero reference checks nothing");
    for (i, (x, y)) in got.iter().zip(reference).enumerate() {
        assert!((x - y).abs() <= tolerance * scale, "{what}[{i}]: {x} vs reference {y} (scale {scale})");
    }
}

/// A `shape` tensor of normal draws from a generator of its own, seeded with `seed`. The backend's
/// generator is process-wide: tests running at once re-seed and draw from it under each other, and burn's
/// composed backward passes were seen to go wrong on leaves drawn that way while other threads did the
/// same (the ops' own gradients stayed right), which made the comparisons flaky. Rarer failures remained
/// with concurrent tests even so (2 full unit-test runs in 40), none serially: `make test` runs one test
/// at a time.
pub fn normal<B: Backend, const D: usize>(
    shape: [usize; D],
    mean: f32,
    std: f32,
    seed: u64,
    device: &B::Device,
) -> Tensor<B, D> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dist = Normal::new(mean, std).expect("a finite, non-negative deviation");
    let values: Vec<f32> = (0..shape.iter().product()).map(|_| dist.sample(&mut rng)).collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}
