//! The f32 slice arithmetic shared by the CPU backend's loop kernels (`cpu_attention`, `cpu_deltanet`):
//! a dot product in eight interleaved lanes, `y += a·x`, row access, and a tensor's host values.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// `Σ aᵢ bᵢ` in eight interleaved partial sums (which the compiler keeps in vector registers).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    let mut lanes = [0.0f32; 8];
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `y += a · x`.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Row `i` of a `[rows, d]` slice.
pub fn row<T>(x: &[T], i: usize, d: usize) -> &[T] {
    &x[i * d..(i + 1) * d]
}

/// Row `i` of a `[rows, d]` slice, mutably.
pub fn row_mut<T>(x: &mut [T], i: usize, d: usize) -> &mut [T] {
    &mut x[i * d..(i + 1) * d]
}

/// The host values of an f32 tensor, row-major (a strided view is copied out in its logical order).
pub fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().into_vec::<f32>().expect("an f32 tensor (checked by the caller)")
}
