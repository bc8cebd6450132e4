//! The causal depthwise convolution's output and gradients on a backend, through `ModelBackend`'s
//! primitives (kiln's kernels on the CubeCL backends) or through the tensor ops they replace: what the conv
//! kernel tests compare.

use burn::tensor::{FloatDType, Tensor};
use kiln::models::layers::{ConvShifts, causal_depthwise_conv, causal_depthwise_conv_backward};
use kiln::models::{ModelBackend, SequenceLayout};

use super::parity::{spread, values};

/// A conv case: rows packed with documents of these lengths (the rest of a row is padding) in rows of `seq`
/// tokens, `channels` wide, with a kernel of `taps`.
#[derive(Debug, Clone)]
pub struct ConvCase {
    pub docs: Vec<Vec<u32>>,
    pub seq: usize,
    pub channels: usize,
    pub taps: usize,
}

/// The case's input, kernel and output gradient in `dtype`, deterministic, and its shifts.
fn conv_inputs<B: ModelBackend>(
    case: &ConvCase,
    dtype: FloatDType,
) -> (Tensor<B, 3>, Tensor<B, 2>, Tensor<B, 3>, ConvShifts<B>) {
    let device = Default::default();
    let layout = SequenceLayout::from_doc_lengths(&case.docs, case.seq);
    let dims = [layout.batch, case.seq, case.channels];
    let count = dims.iter().product();
    let three = |seed, scale: f32| {
        kiln::backend::host_tensor::<B, 1>(spread(count, seed, -scale, scale), [count], dtype, &device).reshape(dims)
    };
    let taps = [case.channels, case.taps];
    let kernel = kiln::backend::host_tensor::<B, 2>(spread(taps[0] * taps[1], 7, -1.0, 1.0), taps, dtype, &device);
    let shifts = ConvShifts::new(&layout, case.taps - 1, &device);
    (three(12, 2.0), kernel, three(13, 1.0), shifts)
}

/// The conv's output and gradients (x, kernel) through `ModelBackend`'s primitives of `B`.
pub fn conv_parts<B: ModelBackend>(case: &ConvCase, dtype: FloatDType) -> [Vec<f32>; 3] {
    let (x, kernel, grad, shifts) = conv_inputs::<B>(case, dtype);
    let out = B::causal_conv(x.clone(), kernel.clone(), &shifts);
    let (grad_x, grad_kernel) = B::causal_conv_grads(x, kernel, &shifts, grad);
    [values(out), values(grad_x), values(grad_kernel)]
}

/// The same through the tensor ops the kernels replace (`layers::causal_depthwise_conv` and its backward).
pub fn conv_parts_by_tensor_ops<B: ModelBackend>(case: &ConvCase, dtype: FloatDType) -> [Vec<f32>; 3] {
    let (x, kernel, grad, shifts) = conv_inputs::<B>(case, dtype);
    let out = causal_depthwise_conv(x.clone(), kernel.clone(), &shifts);
    let (grad_x, grad_kernel) = causal_depthwise_conv_backward(x, kernel, &shifts, grad);
    [values(out), values(grad_x), values(grad_kernel)]
}

/// LFM2's gated conv `C ⊙ conv(B ⊙ x)` on a projection `B | C | x` (`3 · channels` wide) of the case: output
/// and gradients (projection, kernel) through `ModelBackend::gated_conv` (kiln's gated kernels on the CubeCL
/// backends).
pub fn gated_conv_parts<B: ModelBackend>(case: &ConvCase, dtype: FloatDType) -> [Vec<f32>; 3] {
    let (bcx, kernel, grad, shifts) = gated_inputs::<B>(case, dtype);
    let out = B::gated_conv(bcx.clone(), kernel.clone(), &shifts);
    let (grad_bcx, grad_kernel) = B::gated_conv_grads(bcx, kernel, &shifts, grad);
    [values(out), values(grad_bcx), values(grad_kernel)]
}

/// The same through tensor ops: the parts cut out, their products and the tensor-op conv and its backward.
pub fn gated_conv_parts_by_tensor_ops<B: ModelBackend>(case: &ConvCase, dtype: FloatDType) -> [Vec<f32>; 3] {
    let (bcx, kernel, grad, shifts) = gated_inputs::<B>(case, dtype);
    let part = |i: usize| bcx.clone().narrow(2, i * case.channels, case.channels);
    let (b, c, x) = (part(0), part(1), part(2));
    let u = b.clone() * x.clone();
    let y = causal_depthwise_conv(u.clone(), kernel.clone(), &shifts);
    let out = c.clone() * y.clone();
    let (grad_u, grad_kernel) = causal_depthwise_conv_backward(u, kernel, &shifts, grad.clone() * c);
    let grad_bcx = Tensor::cat(vec![grad_u.clone() * x, grad * y, grad_u * b], 2);
    [values(out), values(grad_bcx), values(grad_kernel)]
}

/// A gated case's projection `[batch, seq, 3 · channels]`, kernel, output gradient and shifts.
fn gated_inputs<B: ModelBackend>(
    case: &ConvCase,
    dtype: FloatDType,
) -> (Tensor<B, 3>, Tensor<B, 2>, Tensor<B, 3>, ConvShifts<B>) {
    let wide = ConvCase { channels: 3 * case.channels, ..case.clone() };
    let (bcx, _, _, shifts) = conv_inputs::<B>(&wide, dtype);
    let (_, kernel, grad, _) = conv_inputs::<B>(case, dtype);
    (bcx, kernel, grad, shifts)
}

/// The cases the kernel tests run: LFM2's 3 taps and Qwen3.5's 4, one document a row and rows packed with
/// documents shorter than the taps and padding, channels that leave a cube part-filled and more than one
/// cube wide, and more tokens than a backward block (128) so that the weight gradient sums blocks' shares.
pub fn conv_cases() -> Vec<ConvCase> {
    vec![
        ConvCase { docs: vec![vec![9]], seq: 9, channels: 16, taps: 3 },
        ConvCase { docs: vec![vec![2, 1, 4], vec![6]], seq: 8, channels: 40, taps: 4 },
        ConvCase { docs: vec![vec![100, 60, 3], vec![1, 150, 20]], seq: 200, channels: 300, taps: 3 },
        ConvCase { docs: vec![vec![300]], seq: 300, channels: 64, taps: 4 },
    ]
}
