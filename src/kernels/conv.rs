//! The causal depthwise convolution (`layers::causal_depthwise_conv` and its backward pass: LFM2's short
//! convolutions, Qwen3.5's DeltaNet conv) as CubeCL kernels, for burn's CubeCL backends (CUDA, Vulkan) with
//! and without burn-fusion.
//!
//! As tensor ops each lag is a shifted read (`select`), a mask and a product, and the backward pass adds a
//! weight-gradient reduction per tap: about 15 kernels a layer's backward pass on the fused backend, most
//! of them reading the whole input or gradient again, and f32 copies of both. Here the forward pass is one
//! kernel and the backward pass one kernel and a sum over its blocks' shares of the weight gradient. A unit
//! owns one channel of a block of consecutive tokens, so no unit waits on another. The arithmetic is the
//! tensor ops' in f32, rounded once to the input's dtype; only the order of the weight gradient's sums
//! differs. Tested against them (tests/vulkan_backend.rs,
//! tests/vulkan_half.rs).
//!
//! Gated (`gated`, LFM2's short convolution `C ⊙ conv(B ⊙ x)` on its in-projection `B | C | x`), the kernels
//! read the three parts from the projection's rows and apply both gates themselves: the forward pass writes
//! the gated output alone, and the backward pass recomputes `B ⊙ x` and the conv's output at each token and
//! writes the projection's whole gradient `d B | d C | d x`. As tensor ops the gates cost a layer ~7 more
//! kernels (the products, their gradients, the split's three writes) and keep two more activations a token
//! (`B ⊙ x` and the conv's output) for the backward pass.

use burn::tensor::Tensor as BurnTensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::stream::Operation;
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer};
use cubecl::prelude::*;

use super::{float_tensor, grid_row, outputs, register_custom, register_float_outputs, row_grid};
use crate::models::layers::ConvShifts;
use crate::models::ops::column_sums;

/// Tokens per cube in the forward pass.
const FORWARD_TOKENS: usize = 32;
/// Tokens per cube in the backward pass: its share of the weight gradient sums them before it is written,
/// so the shares are `taps` f32 values per channel for every 128 tokens (25 MB for a 6,144-channel conv
/// over 32,768 tokens with 4 taps).
const BACKWARD_TOKENS: usize = 128;

/// What both kernels know: `tokens` rows (`batch · seq`) of `channels` values, rows of `seq` tokens, the
/// cubes a block of tokens takes across the channels, and the tokens a cube takes.
#[derive(CubeLaunch, CubeType)]
struct ConvArgs {
    tokens: u32,
    seq: u32,
    channels: u32,
    groups: u32,
    tokens_per_cube: u32,
}

/// Where the running unit works: its channel, its block's first token and one past its last, and whether
/// it has work (a channel and tokens, not past them).
#[cube]
fn unit_span(args: &ConvArgs) -> (usize, usize, usize, bool) {
    let cube = grid_row();
    let groups = args.groups as usize;
    let channel = (cube % groups) * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let per_cube = args.tokens_per_cube as usize;
    let first = (cube / groups) * per_cube;
    let tokens = args.tokens as usize;
    let mut last = first + per_cube;
    if last > tokens {
        last = tokens;
    }
    (channel, first, last, channel < args.channels as usize && first < tokens)
}

/// How many tokens back `token` may read: its reach (`ConvShifts::reach`, its position in its document
/// capped at the lags), and never past its row's start.
#[cube]
fn lags_back(reach: &Tensor<f32>, token: usize, seq: usize) -> usize {
    let mut back = u32::cast_from(reach[token]) as usize;
    let in_row = token % seq;
    if back > in_row {
        back = in_row;
    }
    back
}

/// The conv's input at `token`, `channel`, in f32: `x` itself, or gated, `B ⊙ x` from the projection's row
/// `B | C | x` (`3 · channels` wide).
#[cube]
fn conv_input<F: Float>(x: &Tensor<F>, token: usize, channel: usize, channels: usize, #[comptime] gated: bool) -> f32 {
    if comptime!(gated) {
        let row = token * 3 * channels;
        f32::cast_from(x[row + channel]) * f32::cast_from(x[row + 2 * channels + channel])
    } else {
        f32::cast_from(x[token * channels + channel])
    }
}

/// The output gate at `token`, `channel`: gated, `C` from the projection's row; else 1.
#[cube]
fn output_gate<F: Float>(x: &Tensor<F>, token: usize, channel: usize, channels: usize, #[comptime] gated: bool) -> f32 {
    let mut gate = 1.0f32;
    if comptime!(gated) {
        gate = f32::cast_from(x[token * 3 * channels + channels + channel]);
    }
    gate
}

/// Forward: `y[t, c] = Σ_{lag ≤ back(t)} w[c, taps − 1 − lag] · x[t − lag, c]`, in f32, written in `F`; gated,
/// `C[t, c] · y[t, c]` with `B ⊙ x` for `x`.
#[cube(launch)]
fn causal_conv_kernel<F: Float, W: Float>(
    x: &Tensor<F>,
    kernel: &Tensor<W>,
    reach: &Tensor<f32>,
    out: &mut Tensor<F>,
    args: ConvArgs,
    #[comptime] taps: usize,
    #[comptime] gated: bool,
    #[comptime] _revision: u64,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let (channel, first, last, active) = unit_span(&args);
    if !active {
        terminate!();
    }
    let (channels, seq) = (args.channels as usize, args.seq as usize);
    let mut token = first;
    while token < last {
        let back = lags_back(reach, token, seq);
        let mut sum = 0.0f32;
        #[unroll]
        for lag in 0..taps {
            if lag <= back {
                let w = f32::cast_from(kernel[channel * taps + taps - 1 - lag]);
                sum += w * conv_input(x, token - lag, channel, channels, gated);
            }
        }
        out[token * channels + channel] = F::cast_from(sum * output_gate(x, token, channel, channels, gated));
        token += 1;
    }
}

/// Backward, in f32: `d x[t, c] = Σ_lag w[c, taps − 1 − lag] · g[t + lag, c]` over the lags whose token
/// `t + lag` reads `t`, written in `F`; and the block's `Σ_t g[t, c] · x[t − lag, c]` over its tokens that read
/// `lag` back, into `shares[block, c, taps − 1 − lag]` (f32). Gated, `g` is the gated output's gradient times
/// `C` and `x` is `B ⊙ x`; the row written is `d B = d u · x`, `d C = g · y`, `d x = d u · B` (`d u` the sum
/// above, `y` the conv's output recomputed).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn causal_conv_grads_kernel<F: Float, W: Float>(
    x: &Tensor<F>,
    kernel: &Tensor<W>,
    reach: &Tensor<f32>,
    grad: &Tensor<F>,
    grad_x: &mut Tensor<F>,
    shares: &mut Tensor<f32>,
    args: ConvArgs,
    #[comptime] taps: usize,
    #[comptime] units: usize,
    #[comptime] gated: bool,
    #[comptime] _revision: u64,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let (channel, first, last, active) = unit_span(&args);
    if !active {
        terminate!();
    }
    let (channels, seq, tokens) = (args.channels as usize, args.seq as usize, args.tokens as usize);
    // The unit's own slots only: no barrier needed around them.
    let mut partials = SharedMemory::<f32>::new(units * taps);
    let slot = UNIT_POS_X as usize * taps;
    #[unroll]
    for lag in 0..taps {
        partials[slot + lag] = 0.0;
    }
    let mut token = first;
    while token < last {
        let g_out = f32::cast_from(grad[token * channels + channel]);
        let g = g_out * output_gate(x, token, channel, channels, gated);
        let back = lags_back(reach, token, seq);
        let mut dx = 0.0f32;
        let mut y = 0.0f32;
        #[unroll]
        for lag in 0..taps {
            let w = f32::cast_from(kernel[channel * taps + taps - 1 - lag]);
            let ahead = token + lag;
            if ahead < tokens && lag <= lags_back(reach, ahead, seq) {
                let g_ahead = f32::cast_from(grad[ahead * channels + channel]);
                dx += w * g_ahead * output_gate(x, ahead, channel, channels, gated);
            }
            if lag <= back {
                let input = conv_input(x, token - lag, channel, channels, gated);
                partials[slot + lag] += g * input;
                y += w * input;
            }
        }
        if comptime!(gated) {
            let row = token * 3 * channels;
            let (b, x_in) = (f32::cast_from(x[row + channel]), f32::cast_from(x[row + 2 * channels + channel]));
            grad_x[row + channel] = F::cast_from(dx * x_in);
            grad_x[row + channels + channel] = F::cast_from(g_out * y);
            grad_x[row + 2 * channels + channel] = F::cast_from(dx * b);
        } else {
            grad_x[token * channels + channel] = F::cast_from(dx);
        }
        token += 1;
    }
    let block = first / args.tokens_per_cube as usize;
    #[unroll]
    for lag in 0..taps {
        shares[(block * channels + channel) * taps + taps - 1 - lag] = partials[slot + lag];
    }
}

/// The kernels as backend primitives on `x` `[tokens, channels]` (gated: the projection's rows `[tokens,
/// 3 · channels]`), `kernel` `[channels, taps]`, each token's reach `[tokens]` (f32) and rows of `seq` tokens:
/// `causal_conv` returns the output `[tokens, channels]`, `causal_conv_grads` `[d x, the blocks' shares of
/// d kernel]` (d x shaped as `x`; the shares `[blocks, channels · taps]`, f32).
pub trait ConvKernels: Backend {
    fn causal_conv(
        x: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        reach: FloatTensor<Self>,
        seq: usize,
        gated: bool,
    ) -> FloatTensor<Self>;

    fn causal_conv_grads(
        x: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        reach: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        seq: usize,
        gated: bool,
    ) -> [FloatTensor<Self>; 2];
}

/// `x` `[batch, seq, width]` as `[tokens, width]`, the kernel's taps checked against the shifts'.
fn conv_operands<B: Backend>(
    x: BurnTensor<B, 3>,
    kernel: &BurnTensor<B, 2>,
    shifts: &ConvShifts<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let [batch, seq, width] = x.dims();
    assert!(
        kernel.dims()[1] <= shifts.max_lag() + 1,
        "a conv kernel of {} taps over shifts of {} lags",
        kernel.dims()[1],
        shifts.max_lag()
    );
    let reach = shifts.reach().clone().into_primitive().tensor();
    (x.reshape([batch * seq, width]).into_primitive().tensor(), reach)
}

/// The conv's channels for an input `width` wide: gated, a third of the projection.
fn channels_of(width: usize, gated: bool) -> usize {
    if gated { width / 3 } else { width }
}

/// `ModelBackend::causal_conv` on a CubeCL backend: one kernel launch.
pub fn causal_conv<B: ConvKernels>(
    x: BurnTensor<B, 3>,
    kernel: BurnTensor<B, 2>,
    shifts: &ConvShifts<B>,
) -> BurnTensor<B, 3> {
    conv_forward(x, kernel, shifts, false)
}

/// `ModelBackend::gated_conv` on a CubeCL backend: one kernel launch on the projection `B | C | x`.
pub fn gated_conv<B: ConvKernels>(
    bcx: BurnTensor<B, 3>,
    kernel: BurnTensor<B, 2>,
    shifts: &ConvShifts<B>,
) -> BurnTensor<B, 3> {
    conv_forward(bcx, kernel, shifts, true)
}

fn conv_forward<B: ConvKernels>(
    x: BurnTensor<B, 3>,
    kernel: BurnTensor<B, 2>,
    shifts: &ConvShifts<B>,
    gated: bool,
) -> BurnTensor<B, 3> {
    let [batch, seq, width] = x.dims();
    let (x, reach) = conv_operands(x, &kernel, shifts);
    let out: BurnTensor<B, 2> = float_tensor(B::causal_conv(x, kernel.into_primitive().tensor(), reach, seq, gated));
    out.reshape([batch, seq, channels_of(width, gated)])
}

/// `ModelBackend::causal_conv_grads` on a CubeCL backend: one kernel launch and the sum of the blocks'
/// shares.
pub fn causal_conv_grads<B: ConvKernels>(
    x: BurnTensor<B, 3>,
    kernel: BurnTensor<B, 2>,
    shifts: &ConvShifts<B>,
    grad: BurnTensor<B, 3>,
) -> (BurnTensor<B, 3>, BurnTensor<B, 2>) {
    if x.shape().num_elements() == 0 {
        return crate::models::layers::causal_depthwise_conv_backward(x, kernel, shifts, grad);
    }
    conv_backward(x, kernel, shifts, grad, false)
}

/// `ModelBackend::gated_conv_grads` on a CubeCL backend: one kernel launch writing the projection's whole
/// gradient, and the sum of the blocks' shares.
pub fn gated_conv_grads<B: ConvKernels + crate::models::ModelBackend>(
    bcx: BurnTensor<B, 3>,
    kernel: BurnTensor<B, 2>,
    shifts: &ConvShifts<B>,
    grad: BurnTensor<B, 3>,
) -> (BurnTensor<B, 3>, BurnTensor<B, 2>) {
    if bcx.shape().num_elements() == 0 {
        return crate::models::layers::gated_conv_backward(bcx, kernel, shifts, grad);
    }
    conv_backward(bcx, kernel, shifts, grad, true)
}

fn conv_backward<B: ConvKernels>(
    x: BurnTensor<B, 3>,
    kernel: BurnTensor<B, 2>,
    shifts: &ConvShifts<B>,
    grad: BurnTensor<B, 3>,
    gated: bool,
) -> (BurnTensor<B, 3>, BurnTensor<B, 2>) {
    let dims = x.dims();
    let (kernel_dtype, kernel_dims) = (FloatDType::from(kernel.dtype()), kernel.dims());
    let (x, reach) = conv_operands(x, &kernel, shifts);
    let grad = grad.reshape([dims[0] * dims[1], channels_of(dims[2], gated)]).into_primitive().tensor();
    let [grad_x, shares] = B::causal_conv_grads(x, kernel.into_primitive().tensor(), reach, grad, dims[1], gated);
    let grad_x: BurnTensor<B, 3> = float_tensor::<B, 2>(grad_x).reshape(dims);
    let grad_kernel = column_sums(float_tensor::<B, 2>(shares)).reshape(kernel_dims).cast(kernel_dtype);
    (grad_x, grad_kernel)
}

/// Units per cube for `channels`: a power of two from 32 to 256, so that few units of a narrow conv idle.
fn units_for(channels: usize) -> usize {
    channels.next_power_of_two().clamp(32, 256)
}

/// The blocks of the backward pass's shares for `tokens` tokens (one at least, so that the tensor exists).
fn share_blocks(tokens: usize) -> usize {
    tokens.div_ceil(BACKWARD_TOKENS).max(1)
}

/// A launch over `tokens` of `channels` in blocks of `tokens_per_cube`: its units per cube, its cubes and
/// its arguments.
fn conv_launch<R: Runtime>(
    tokens: usize,
    channels: usize,
    seq: usize,
    tokens_per_cube: usize,
) -> (usize, usize, ConvArgsLaunch<R>) {
    let units = units_for(channels);
    let groups = channels.div_ceil(units);
    let cubes = tokens.div_ceil(tokens_per_cube) * groups;
    let narrow = |n: usize| u32::try_from(n).expect("a conv's tokens and channels fit in u32");
    let args = ConvArgsLaunch::new(
        narrow(tokens),
        narrow(seq.max(1)),
        narrow(channels),
        narrow(groups),
        narrow(tokens_per_cube),
    );
    (units, cubes, args)
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> ConvKernels for CubeBackend<R, F, I, BT> {
    fn causal_conv(
        x: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        reach: FloatTensor<Self>,
        seq: usize,
        gated: bool,
    ) -> FloatTensor<Self> {
        let (client, device) = (x.client.clone(), x.device.clone());
        let [tokens, width] = x.shape().dims::<2>();
        let channels = channels_of(width, gated);
        let out = empty_device_contiguous_dtype::<R>(client.clone(), device, Shape::new([tokens, channels]), x.dtype);
        let (units, cubes, args) = conv_launch::<R>(tokens, channels, seq, FORWARD_TOKENS);
        if cubes > 0 {
            let dtypes = [x.dtype, kernel.dtype];
            let taps = kernel.shape().dims::<2>()[1];
            causal_conv_kernel::launch::<R>(
                &client,
                row_grid(cubes),
                CubeDim::new_1d(units as u32),
                into_contiguous(x).into_tensor_arg(),
                into_contiguous(kernel).into_tensor_arg(),
                into_contiguous(reach).into_tensor_arg(),
                out.clone().into_tensor_arg(),
                args,
                taps,
                gated,
                super::REVISION,
                dtypes.map(Into::into),
            );
        }
        out
    }

    fn causal_conv_grads(
        x: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        reach: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        seq: usize,
        gated: bool,
    ) -> [FloatTensor<Self>; 2] {
        assert_eq!(grad.dtype, x.dtype, "the conv's gradient is in its output's dtype, the input's");
        let (client, device) = (x.client.clone(), x.device.clone());
        let [tokens, width] = x.shape().dims::<2>();
        let channels = channels_of(width, gated);
        let taps = kernel.shape().dims::<2>()[1];
        let grad_x = empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), x.shape(), x.dtype);
        let share_shape = Shape::new([share_blocks(tokens), channels * taps]);
        let shares = empty_device_contiguous_dtype::<R>(client.clone(), device, share_shape, DType::F32);
        let (units, cubes, args) = conv_launch::<R>(tokens, channels, seq, BACKWARD_TOKENS);
        if cubes > 0 {
            let dtypes = [x.dtype, kernel.dtype];
            causal_conv_grads_kernel::launch::<R>(
                &client,
                row_grid(cubes),
                CubeDim::new_1d(units as u32),
                into_contiguous(x).into_tensor_arg(),
                into_contiguous(kernel).into_tensor_arg(),
                into_contiguous(reach).into_tensor_arg(),
                into_contiguous(grad).into_tensor_arg(),
                grad_x.clone().into_tensor_arg(),
                shares.clone().into_tensor_arg(),
                args,
                taps,
                units,
                gated,
                super::REVISION,
                dtypes.map(Into::into),
            );
        }
        [grad_x, shares]
    }
}

/// A kernel as one custom operation of burn-fusion's stream: fusion runs it on the backend under it.
#[derive(Debug, Clone)]
struct FusedConv<B> {
    desc: CustomOpIr,
    seq: usize,
    grads: bool,
    gated: bool,
    _backend: std::marker::PhantomData<B>,
}

impl<B> FusedConv<B> {
    /// What makes the operation from its description in `register_custom`.
    fn maker(seq: usize, grads: bool, gated: bool) -> impl FnOnce(CustomOpIr) -> Self {
        move |desc| FusedConv { desc, seq, grads, gated, _backend: std::marker::PhantomData }
    }
}

impl<B: FusionBackend + ConvKernels> Operation<B::FusionRuntime> for FusedConv<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let mut get = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
        let (x, kernel, reach) = (get(0), get(1), get(2));
        let (seq, gated) = (self.seq, self.gated);
        if self.grads {
            let grad = get(3);
            register_float_outputs::<B>(handles, outputs, B::causal_conv_grads(x, kernel, reach, grad, seq, gated));
        } else {
            register_float_outputs::<B>(handles, outputs, [B::causal_conv(x, kernel, reach, seq, gated)]);
        }
    }
}

impl<B: FusionBackend + ConvKernels> ConvKernels for Fusion<B> {
    fn causal_conv(
        x: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        reach: FloatTensor<Self>,
        seq: usize,
        gated: bool,
    ) -> FloatTensor<Self> {
        let [tokens, width] = x.shape().dims::<2>();
        let out = (Shape::new([tokens, channels_of(width, gated)]), x.dtype());
        let [y] = outputs(register_custom::<B, _>(
            "kiln_causal_conv",
            vec![x, kernel, reach],
            &[out],
            FusedConv::<B>::maker(seq, false, gated),
        ));
        y
    }

    fn causal_conv_grads(
        x: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        reach: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        seq: usize,
        gated: bool,
    ) -> [FloatTensor<Self>; 2] {
        let [tokens, width] = x.shape().dims::<2>();
        let taps = kernel.shape().dims::<2>()[1];
        let share_shape = Shape::new([share_blocks(tokens), channels_of(width, gated) * taps]);
        let shapes = [(x.shape(), x.dtype()), (share_shape, DType::F32)];
        let inputs = vec![x, kernel, reach, grad];
        let maker = FusedConv::<B>::maker(seq, true, gated);
        outputs(register_custom::<B, _>("kiln_causal_conv_grads", inputs, &shapes, maker))
    }
}

/// The launches CUDA makes (`cuda_source`): inputs in f32 and bf16 with kernels in their dtype or f32, LFM2's
/// three taps (gated) and Qwen3.5's four (plain), over narrow and wide channels.
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, settings, tensor};
    let args = || ConvArgsCompilationArg { tokens: (), seq: (), channels: (), groups: (), tokens_per_cube: () };
    let mut variants = Vec::new();
    for (x, kernel) in [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::BF16, DType::F32)] {
        let dtypes = [x.into(), kernel.into()];
        for (taps, channels) in [(3, 1024), (4, 6144), (3, 48)] {
            let units = units_for(channels);
            let gated = taps == 3;
            let name = format!("causal conv {x:?}/{kernel:?} {taps} taps, {channels} channels, gated: {gated}");
            variants.push(Variant::new(
                format!("{name} forward"),
                causal_conv_kernel::CausalConvKernel::<Runtime>::new(
                    settings(units as u32),
                    client.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    args(),
                    taps,
                    gated,
                    super::REVISION,
                    dtypes,
                ),
            ));
            variants.push(Variant::new(
                format!("{name} backward"),
                causal_conv_grads_kernel::CausalConvGradsKernel::<Runtime>::new(
                    settings(units as u32),
                    client.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    args(),
                    taps,
                    units,
                    gated,
                    super::REVISION,
                    dtypes,
                ),
            ));
        }
    }
    variants
}
