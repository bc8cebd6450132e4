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

/// Forward: `y[t, c] = Σ_{lag ≤ back(t)} w[c, taps − 1 − lag] · x[t − lag, c]`, in f32, written in `F`.
#[cube(launch)]
fn causal_conv_kernel<F: Float, W: Float>(
    x: &Tensor<F>,
    kernel: &Tensor<W>,
    reach: &Tensor<f32>,
    out: &mut Tensor<F>,
    args: ConvArgs,
    #[comptime] taps: usize,
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
                sum += w * f32::cast_from(x[(token - lag) * channels + channel]);
            }
        }
        out[token * channels + channel] = F::cast_from(sum);
        token += 1;
    }
}

/// Backward, in f32: `d x[t, c] = Σ_lag w[c, taps − 1 − lag] · g[t + lag, c]` over the lags whose token
/// `t + lag` reads `t`, written in `F`; and the block's `Σ_t g[t, c] · x[t − lag, c]` over its tokens that read
/// `lag` back, into `shares[block, c, taps − 1 − lag]` (f32).
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
        let g = f32::cast_from(grad[token * channels + channel]);
        let back = lags_back(reach, token, seq);
        let mut dx = 0.0f32;
        #[unroll]
        for lag in 0..taps {
            let w = f32::cast_from(kernel[channel * taps + taps - 1 - lag]);
            let ahead = token + lag;
            if ahead < tokens && lag <= lags_back(reach, ahead, seq) {
                dx += w * f32::cast_from(grad[ahead * channels + channel]);
            }
            if lag <= back {
                partials[slot + lag] += g * f32::cast_from(x[(token - lag) * channels + channel]);
            }
        }
        grad_x[token * channels + channel] = F::cast_from(dx);
        token += 1;
    }
    let block = first / args.tokens_per_cube as usize;
    #[unroll]
    for lag in 0..taps {
        shares[(block * channels + channel) * taps + taps - 1 - lag] = partials[slot + lag];
    }
}

/// The kernels as backend primitives on `x` `[tokens, channels]`, `kernel` `[channels, taps]`, each token's
/// reach `[tokens]` (f32) and rows of `seq` tokens: `causal_conv` returns the output, `causal_conv_grads`
/// `[d x, the blocks' shares of d kernel]` (`[blocks, channels · taps]`, f32).
pub trait ConvKernels: Backend {
    fn causal_conv(
        x: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        reach: FloatTensor<Self>,
        seq: usize,
    ) -> FloatTensor<Self>;

    fn causal_conv_grads(
        x: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        reach: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        seq: usize,
    ) -> [FloatTensor<Self>; 2];
}

/// `x` `[batch, seq, channels]` as `[tokens, channels]`, the kernel's taps checked against the shifts'.
fn conv_operands<B: Backend>(
    x: BurnTensor<B, 3>,
    kernel: &BurnTensor<B, 2>,
    shifts: &ConvShifts<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let [batch, seq, channels] = x.dims();
    assert!(
        kernel.dims()[1] <= shifts.max_lag() + 1,
        "a conv kernel of {} taps over shifts of {} lags",
        kernel.dims()[1],
        shifts.max_lag()
    );
    let reach = shifts.reach().clone().into_primitive().tensor();
    (x.reshape([batch * seq, channels]).into_primitive().tensor(), reach)
}

/// `ModelBackend::causal_conv` on a CubeCL backend: one kernel launch.
pub fn causal_conv<B: ConvKernels>(
    x: BurnTensor<B, 3>,
    kernel: BurnTensor<B, 2>,
    shifts: &ConvShifts<B>,
) -> BurnTensor<B, 3> {
    let dims = x.dims();
    let (x, reach) = conv_operands(x, &kernel, shifts);
    let out: BurnTensor<B, 2> = float_tensor(B::causal_conv(x, kernel.into_primitive().tensor(), reach, dims[1]));
    out.reshape(dims)
}

/// `ModelBackend::causal_conv_grads` on a CubeCL backend: one kernel launch and the sum of the blocks'
/// shares.
pub fn causal_conv_grads<B: ConvKernels>(
    x: BurnTensor<B, 3>,
    kernel: BurnTensor<B, 2>,
    shifts: &ConvShifts<B>,
    grad: BurnTensor<B, 3>,
) -> (BurnTensor<B, 3>, BurnTensor<B, 2>) {
    let dims = x.dims();
    if x.shape().num_elements() == 0 {
        return crate::models::layers::causal_depthwise_conv_backward(x, kernel, shifts, grad);
    }
    let (kernel_dtype, kernel_dims) = (FloatDType::from(kernel.dtype()), kernel.dims());
    let (x, reach) = conv_operands(x, &kernel, shifts);
    let grad = grad.reshape([dims[0] * dims[1], dims[2]]).into_primitive().tensor();
    let [grad_x, shares] = B::causal_conv_grads(x, kernel.into_primitive().tensor(), reach, grad, dims[1]);
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

/// A launch over `[tokens, channels]` in blocks of `tokens_per_cube`: its units per cube, its cubes and
/// its arguments.
fn conv_launch<R: Runtime>(shape: &Shape, seq: usize, tokens_per_cube: usize) -> (usize, usize, ConvArgsLaunch<R>) {
    let [tokens, channels] = shape.dims::<2>();
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
    ) -> FloatTensor<Self> {
        let (client, device) = (x.client.clone(), x.device.clone());
        let out = empty_device_contiguous_dtype::<R>(client.clone(), device, x.shape(), x.dtype);
        let (units, cubes, args) = conv_launch::<R>(&x.shape(), seq, FORWARD_TOKENS);
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
    ) -> [FloatTensor<Self>; 2] {
        assert_eq!(grad.dtype, x.dtype, "the conv's gradient is in its output's dtype, the input's");
        let (client, device) = (x.client.clone(), x.device.clone());
        let [tokens, channels] = x.shape().dims::<2>();
        let taps = kernel.shape().dims::<2>()[1];
        let grad_x = empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), x.shape(), x.dtype);
        let share_shape = Shape::new([share_blocks(tokens), channels * taps]);
        let shares = empty_device_contiguous_dtype::<R>(client.clone(), device, share_shape, DType::F32);
        let (units, cubes, args) = conv_launch::<R>(&x.shape(), seq, BACKWARD_TOKENS);
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
    _backend: std::marker::PhantomData<B>,
}

impl<B> FusedConv<B> {
    /// What makes the operation from its description in `register_custom`.
    fn maker(seq: usize, grads: bool) -> impl FnOnce(CustomOpIr) -> Self {
        move |desc| FusedConv { desc, seq, grads, _backend: std::marker::PhantomData }
    }
}

impl<B: FusionBackend + ConvKernels> Operation<B::FusionRuntime> for FusedConv<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let mut get = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
        let (x, kernel, reach) = (get(0), get(1), get(2));
        if self.grads {
            let grad = get(3);
            register_float_outputs::<B>(handles, outputs, B::causal_conv_grads(x, kernel, reach, grad, self.seq));
        } else {
            register_float_outputs::<B>(handles, outputs, [B::causal_conv(x, kernel, reach, self.seq)]);
        }
    }
}

impl<B: FusionBackend + ConvKernels> ConvKernels for Fusion<B> {
    fn causal_conv(
        x: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        reach: FloatTensor<Self>,
        seq: usize,
    ) -> FloatTensor<Self> {
        let out = (x.shape(), x.dtype());
        let [y] = outputs(register_custom::<B, _>(
            "kiln_causal_conv",
            vec![x, kernel, reach],
            &[out],
            FusedConv::<B>::maker(seq, false),
        ));
        y
    }

    fn causal_conv_grads(
        x: FloatTensor<Self>,
        kernel: FloatTensor<Self>,
        reach: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        seq: usize,
    ) -> [FloatTensor<Self>; 2] {
        let [tokens, channels] = x.shape().dims::<2>();
        let taps = kernel.shape().dims::<2>()[1];
        let shapes = [(x.shape(), x.dtype()), (Shape::new([share_blocks(tokens), channels * taps]), DType::F32)];
        let inputs = vec![x, kernel, reach, grad];
        outputs(register_custom::<B, _>("kiln_causal_conv_grads", inputs, &shapes, FusedConv::<B>::maker(seq, true)))
    }
}

/// The launches CUDA makes (`cuda_source`): inputs in f32 and bf16 with kernels in their dtype or f32, LFM2's
/// three taps and Qwen3.5's four, over narrow and wide channels.
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, settings, tensor};
    let args = || ConvArgsCompilationArg { tokens: (), seq: (), channels: (), groups: (), tokens_per_cube: () };
    let mut variants = Vec::new();
    for (x, kernel) in [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::BF16, DType::F32)] {
        let dtypes = [x.into(), kernel.into()];
        for (taps, channels) in [(3, 1024), (4, 6144), (3, 48)] {
            let units = units_for(channels);
            let name = format!("causal conv {x:?}/{kernel:?} {taps} taps, {channels} channels");
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
                    super::REVISION,
                    dtypes,
                ),
            ));
        }
    }
    variants
}
