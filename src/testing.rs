//! Helpers shared by the unit tests that hold an op to its reference computation.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

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
