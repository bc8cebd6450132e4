//! The RMSNorm's and the L2 norm's output and gradients on a backend, through `ModelBackend`'s primitives
//! (kiln's kernels on the CubeCL backends) or through the tensor ops they replace: what the norm kernel tests
//! compare.

use burn::tensor::{FloatDType, Tensor};
use kiln::models::ModelBackend;
use kiln::models::layers::{l2_normalize, l2_normalize_backward};
use kiln::models::ops::{NormKind, rms_norm_backward, rms_norm_forward};

use super::parity::{spread, values};

/// A norm's input `[a, b, width]` in `dtype`, weight in `weight_dtype` and output gradient in the output's
/// dtype (f32 where a plain norm's f32 weight promotes a half-precision input), deterministic.
pub fn norm_inputs<B: ModelBackend>(
    [a, b, width]: [usize; 3],
    kind: NormKind,
    [dtype, weight_dtype]: [FloatDType; 2],
    device: &B::Device,
) -> (Tensor<B, 3>, Tensor<B, 1>, Tensor<B, 3>) {
    let count = a * b * width;
    let three = |seed, scale: f32, dtype| {
        kiln::backend::host_tensor::<B, 1>(spread(count, seed, -scale, scale), [count], dtype, device)
            .reshape([a, b, width])
    };
    let out_dtype = FloatDType::from(kind.output_dtype(dtype.into(), weight_dtype.into()));
    let weight = kiln::backend::host_tensor::<B, 1>(spread(width, 9, 0.5, 1.5), [width], weight_dtype, device);
    (three(10, 3.0, dtype), weight, three(11, 1.0, out_dtype))
}

/// The RMSNorm's output and gradients (x, weight) through `ModelBackend`'s primitives of `B`.
pub fn norm_parts<B: ModelBackend>(dims: [usize; 3], kind: NormKind, dtypes: [FloatDType; 2]) -> [Vec<f32>; 3] {
    let (x, weight, grad) = norm_inputs::<B>(dims, kind, dtypes, &Default::default());
    let out = B::rms_norm(x.clone(), weight.clone(), 1e-6, kind);
    let (grad_x, grad_weight) = B::rms_norm_grads(x, weight, 1e-6, kind, grad);
    [values(out), values(grad_x), values(grad_weight)]
}

/// The same through the tensor ops the kernels replace (`ops::rms_norm_forward`, `rms_norm_backward`).
pub fn norm_parts_by_tensor_ops<B: ModelBackend>(
    dims: [usize; 3],
    kind: NormKind,
    dtypes: [FloatDType; 2],
) -> [Vec<f32>; 3] {
    let (x, weight, grad) = norm_inputs::<B>(dims, kind, dtypes, &Default::default());
    let out = rms_norm_forward(x.clone(), weight.clone(), 1e-6, kind);
    let (grad_x, grad_weight) = rms_norm_backward(x, weight, 1e-6, kind, grad);
    [values(out), values(grad_x), values(grad_weight)]
}

/// An L2 norm's input `[a, b, width]` in `dtype` (small, so that `d x` is of order 1) and output gradient
/// in f32 (its output's dtype), deterministic.
fn l2_inputs<B: ModelBackend>([a, b, width]: [usize; 3], dtype: FloatDType) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let count = a * b * width;
    let device = Default::default();
    let three = |seed, scale: f32, dtype| {
        kiln::backend::host_tensor::<B, 1>(spread(count, seed, -scale, scale), [count], dtype, &device)
            .reshape([a, b, width])
    };
    (three(12, 0.5, dtype), three(13, 1.0, FloatDType::F32))
}

/// The L2 norm's output and input gradient through `ModelBackend`'s primitives of `B`.
pub fn l2_parts<B: ModelBackend>(dims: [usize; 3], dtype: FloatDType) -> [Vec<f32>; 2] {
    let (x, grad) = l2_inputs::<B>(dims, dtype);
    let out = B::l2_norm(x.clone(), 1e-6);
    [values(out), values(B::l2_norm_grads(x, 1e-6, grad))]
}

/// The same through the tensor ops the kernels replace (`layers::l2_normalize`, `l2_normalize_backward`).
pub fn l2_parts_by_tensor_ops<B: ModelBackend>(dims: [usize; 3], dtype: FloatDType) -> [Vec<f32>; 2] {
    let (x, grad) = l2_inputs::<B>(dims, dtype);
    let out = l2_normalize(x.clone(), 1e-6);
    [values(out), values(l2_normalize_backward(x, 1e-6, grad))]
}
