//! The RMSNorms (`ops::rms_norm_forward`, `ops::rms_norm_backward`: LFM2's plain, Qwen3.5's zero-centered
//! and Gemma 4's f32-scaled form, every layer's norms and the attention's q/k norms) as CubeCL kernels, for burn's
//! CubeCL backends (CUDA, Vulkan) with and without burn-fusion.
//!
//! As tensor ops the forward pass is a reduction and an element-wise kernel, the backward pass three
//! reductions (the row statistics, the projection, the weight gradient down the rows) and element-wise
//! kernels between them, each reading the rows again and some writing f32 copies of them. Here the forward
//! pass is one kernel (a cube per row: the sum of squares, then the scaled row) and the backward pass one
//! kernel over blocks of rows (per row both sums in one pass, then `d x`, and the block's share of `d w`) and
//! a sum over the blocks' shares. The arithmetic is the tensor ops' in f32 with their roundings to the
//! input's dtype; only the order of the sums differs. Tested against them (tests/vulkan_backend.rs).
//!
//! The L2 norm of Qwen3.5's DeltaNet q and k (`layers::l2_normalize`, `l2_normalize_backward`: no weight,
//! a sum where the RMSNorm takes a mean, the output in f32) runs the same way: a cube per row forward and
//! backward, where the tensor ops make a reduction each way that burn-fusion leaves unfused and, backward, a
//! second one (`Σ g · y`) that it runs as a chain of reductions.

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

use super::{cube_sum, float_tensor, grid_row, outputs, register_custom, register_float_outputs, row_grid};
use crate::models::ops::{NormKind, column_sums};

/// Rows per cube in the backward pass: its share of the weight gradient sums them before it is written.
const ROWS_PER_CUBE: usize = 16;

/// What both kernels know: `rows` rows of `width` values, and the norm's epsilon.
#[derive(CubeLaunch, CubeType)]
struct NormArgs {
    rows: u32,
    width: u32,
    eps: f32,
}

/// Units per cube for rows of `width`: a power of two (the tree sums) from 32 to 256, so that narrow rows
/// (the attention's q/k norms are 64–256 wide) leave few units idle.
fn units_for(width: usize) -> usize {
    width.next_power_of_two().clamp(32, 256)
}

/// The norm's scale of a column in f32: `w`, or `1 + w` (zero-centered: `adds_one`).
#[cube]
fn scale_of<W: Float>(weight: &Tensor<W>, column: usize, #[comptime] adds_one: bool) -> f32 {
    let mut scale = f32::cast_from(weight[column]);
    if adds_one {
        scale += 1.0;
    }
    scale
}

/// What the scale multiplies, from `x̂` in f32: `cast(x̂)` in the input's dtype `F` (plain: `rounds_first`,
/// as transformers rounds before LFM2's weight), or `x̂` (scaled in f32: zero-centered, Gemma's).
#[cube]
fn scaled_value<F: Float>(normed: f32, #[comptime] rounds_first: bool) -> f32 {
    let mut value = normed;
    if rounds_first {
        value = f32::cast_from(F::cast_from(normed));
    }
    value
}

/// `1 / sqrt(Σx² + eps)` of the row of `width` values at `base` (the L2 norm's), or with the mean of the
/// squares (`averages`: the RMSNorm's), summed by the cube's `units` units in f32.
#[cube]
fn inverse_norm<F: Float>(
    x: &Tensor<F>,
    base: usize,
    width: usize,
    eps: f32,
    #[comptime] averages: bool,
    #[comptime] units: usize,
) -> f32 {
    let mut squares = 0.0f32;
    let mut column = UNIT_POS_X as usize;
    while column < width {
        let v = f32::cast_from(x[base + column]);
        squares += v * v;
        column += units;
    }
    let mut sum = cube_sum(squares, units);
    if averages {
        sum /= width as f32;
    }
    1.0 / (sum + eps).sqrt()
}

/// Forward, one cube per row: `out = scaled(x · r)` with `r = 1 / sqrt(mean(x²) + eps)`, written in `O`
/// (the input's dtype, or f32 for a plain norm with an f32 weight on a half-precision input).
#[cube(launch)]
fn rms_norm_kernel<F: Float, W: Float, O: Float>(
    x: &Tensor<F>,
    weight: &Tensor<W>,
    out: &mut Tensor<O>,
    args: NormArgs,
    #[comptime] adds_one: bool,
    #[comptime] rounds_first: bool,
    #[comptime] units: usize,
    #[comptime] _revision: u64,
    #[define(F, W, O)] _dtypes: [StorageType; 3],
) {
    let row = grid_row();
    // Whole cubes leave: the row is the cube's, so no unit waits at a barrier another has left.
    if row >= args.rows as usize {
        terminate!();
    }
    let width = args.width as usize;
    let base = row * width;
    let inverse = inverse_norm(x, base, width, args.eps, true, units);
    let mut column = UNIT_POS_X as usize;
    while column < width {
        let normed = f32::cast_from(x[base + column]) * inverse;
        let value = scaled_value::<F>(normed, rounds_first) * scale_of::<W>(weight, column, adds_one);
        out[base + column] = O::cast_from(value);
        column += units;
    }
}

/// Backward, one cube per `ROWS_PER_CUBE` rows. With `s` the scale (`w`, or `1 + w`) and `n` what it
/// multiplies: `d x = r · (g s − x̂ · mean(g s · x̂))` in `F`, and the block's `Σ g · n` over its rows into
/// row `block` of `weight_shares` `[blocks, width]` (f32).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_grads_kernel<F: Float, W: Float, O: Float>(
    x: &Tensor<F>,
    weight: &Tensor<W>,
    grad: &Tensor<O>,
    grad_x: &mut Tensor<F>,
    weight_shares: &mut Tensor<f32>,
    args: NormArgs,
    #[comptime] adds_one: bool,
    #[comptime] rounds_first: bool,
    #[comptime] units: usize,
    #[comptime] width: usize,
    #[comptime] _revision: u64,
    #[define(F, W, O)] _dtypes: [StorageType; 3],
) {
    let block = grid_row();
    let rows = args.rows as usize;
    if block * ROWS_PER_CUBE >= rows {
        terminate!();
    }
    let unit = UNIT_POS_X as usize;
    // Each unit adds to its own columns only: no barrier needed around it.
    let mut share = SharedMemory::<f32>::new(width);
    let mut column = unit;
    while column < width {
        share[column] = 0.0;
        column += units;
    }
    for r in 0..ROWS_PER_CUBE {
        let row = block * ROWS_PER_CUBE + r;
        // The same for every unit of the cube, so all of them reach the sums' barriers or none.
        if row < rows {
            let base = row * width;
            let mut squares = 0.0f32;
            let mut dot = 0.0f32;
            let mut column = unit;
            while column < width {
                let v = f32::cast_from(x[base + column]);
                squares += v * v;
                dot += scale_of::<W>(weight, column, adds_one) * f32::cast_from(grad[base + column]) * v;
                column += units;
            }
            let inverse = 1.0 / (cube_sum(squares, units) / width as f32 + args.eps).sqrt();
            let projection = cube_sum(dot, units) * inverse / width as f32;
            let mut column = unit;
            while column < width {
                let normed = f32::cast_from(x[base + column]) * inverse;
                let g = f32::cast_from(grad[base + column]);
                let scaled_grad = g * scale_of::<W>(weight, column, adds_one);
                grad_x[base + column] = F::cast_from((scaled_grad - normed * projection) * inverse);
                share[column] += g * scaled_value::<F>(normed, rounds_first);
                column += units;
            }
        }
    }
    let mut column = unit;
    while column < width {
        weight_shares[block * width + column] = share[column];
        column += units;
    }
}

/// The L2 norm's forward pass, one cube per row: `out = x · r` with `r = 1 / sqrt(Σx² + eps)`, in `O`
/// (f32, as `layers::l2_normalize` computes it).
#[cube(launch)]
fn l2_norm_kernel<F: Float, O: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<O>,
    args: NormArgs,
    #[comptime] units: usize,
    #[comptime] _revision: u64,
    #[define(F, O)] _dtypes: [StorageType; 2],
) {
    let row = grid_row();
    if row >= args.rows as usize {
        terminate!();
    }
    let width = args.width as usize;
    let base = row * width;
    let inverse = inverse_norm(x, base, width, args.eps, false, units);
    let mut column = UNIT_POS_X as usize;
    while column < width {
        out[base + column] = O::cast_from(f32::cast_from(x[base + column]) * inverse);
        column += units;
    }
}

/// The L2 norm's backward pass, one cube per row: with `y = x · r`, `d x = r · (g − y · Σ(g · y))` in `F`
/// (`layers::l2_normalize_backward`; `Σ(g · y)` summed as `r · Σ(g · x)`).
#[cube(launch)]
fn l2_norm_grads_kernel<F: Float, O: Float>(
    x: &Tensor<F>,
    grad: &Tensor<O>,
    grad_x: &mut Tensor<F>,
    args: NormArgs,
    #[comptime] units: usize,
    #[comptime] _revision: u64,
    #[define(F, O)] _dtypes: [StorageType; 2],
) {
    let row = grid_row();
    if row >= args.rows as usize {
        terminate!();
    }
    let width = args.width as usize;
    let base = row * width;
    let mut squares = 0.0f32;
    let mut dot = 0.0f32;
    let mut column = UNIT_POS_X as usize;
    while column < width {
        let v = f32::cast_from(x[base + column]);
        squares += v * v;
        dot += f32::cast_from(grad[base + column]) * v;
        column += units;
    }
    let inverse = 1.0 / (cube_sum(squares, units) + args.eps).sqrt();
    let projection = cube_sum(dot, units) * inverse;
    let mut column = UNIT_POS_X as usize;
    while column < width {
        let normed = f32::cast_from(x[base + column]) * inverse;
        let g = f32::cast_from(grad[base + column]);
        grad_x[base + column] = F::cast_from((g - normed * projection) * inverse);
        column += units;
    }
}

/// The kernels as backend primitives on `[rows, width]` tensors: `rms_norm` returns the normalized rows,
/// `rms_norm_grads` `[d x, the blocks' shares of d w]` (`[rows / ROWS_PER_CUBE, width]`, f32); `l2_norm`
/// the L2-normalized rows in f32, `l2_norm_grads` `d x` in `x`'s dtype.
pub trait NormKernels: Backend {
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64, kind: NormKind) -> FloatTensor<Self>;

    fn rms_norm_grads(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
        kind: NormKind,
    ) -> [FloatTensor<Self>; 2];

    fn l2_norm(x: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;

    fn l2_norm_grads(x: FloatTensor<Self>, grad: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;
}

/// `x` `[.., width]` as `[rows, width]`.
fn rows_of<B: Backend, const D: usize>(x: BurnTensor<B, D>) -> FloatTensor<B> {
    let width = x.dims()[D - 1];
    x.reshape([-1, width as i64]).into_primitive().tensor()
}

/// `ModelBackend::rms_norm` on a CubeCL backend: one kernel launch.
pub fn rms_norm<B: NormKernels, const D: usize>(
    x: BurnTensor<B, D>,
    weight: BurnTensor<B, 1>,
    eps: f64,
    kind: NormKind,
) -> BurnTensor<B, D> {
    let dims = x.dims();
    let out: BurnTensor<B, 2> = float_tensor(B::rms_norm(rows_of(x), weight.into_primitive().tensor(), eps, kind));
    out.reshape(dims)
}

/// `ModelBackend::rms_norm_grads` on a CubeCL backend: one kernel launch and the sum of the blocks' shares.
pub fn rms_norm_grads<B: NormKernels, const D: usize>(
    x: BurnTensor<B, D>,
    weight: BurnTensor<B, 1>,
    eps: f64,
    kind: NormKind,
    grad: BurnTensor<B, D>,
) -> (BurnTensor<B, D>, BurnTensor<B, 1>) {
    let dims = x.dims();
    if x.shape().num_elements() == 0 {
        return crate::models::ops::rms_norm_backward(x, weight, eps, kind, grad);
    }
    let weight_dtype = FloatDType::from(weight.dtype());
    let [grad_x, shares] = B::rms_norm_grads(rows_of(x), weight.into_primitive().tensor(), rows_of(grad), eps, kind);
    let grad_x: BurnTensor<B, 2> = float_tensor(grad_x);
    let shares: BurnTensor<B, 2> = float_tensor(shares);
    (grad_x.reshape(dims), column_sums(shares).cast(weight_dtype))
}

/// `ModelBackend::l2_norm` on a CubeCL backend: one kernel launch.
pub fn l2_norm<B: NormKernels, const D: usize>(x: BurnTensor<B, D>, eps: f64) -> BurnTensor<B, D> {
    let dims = x.dims();
    let out: BurnTensor<B, 2> = float_tensor(B::l2_norm(rows_of(x), eps));
    out.reshape(dims)
}

/// `ModelBackend::l2_norm_grads` on a CubeCL backend: one kernel launch.
pub fn l2_norm_grads<B: NormKernels, const D: usize>(
    x: BurnTensor<B, D>,
    eps: f64,
    grad: BurnTensor<B, D>,
) -> BurnTensor<B, D> {
    let dims = x.dims();
    let grad_x: BurnTensor<B, 2> = float_tensor(B::l2_norm_grads(rows_of(x), rows_of(grad), eps));
    grad_x.reshape(dims)
}

/// The rows of the weight-gradient shares for `rows` rows: one per backward cube (one at least, so that the
/// tensor exists when there are no rows).
fn share_rows(rows: usize) -> usize {
    rows.div_ceil(ROWS_PER_CUBE).max(1)
}

/// `[rows, width]` of a kernel input, and the arguments both kernels take.
fn norm_args<R: Runtime>(shape: &Shape, eps: f64) -> (usize, usize, NormArgsLaunch<R>) {
    let [rows, width] = shape.dims::<2>();
    let narrow = |n: usize| u32::try_from(n).expect("a norm's rows and width fit in u32");
    (rows, width, NormArgsLaunch::new(narrow(rows), narrow(width), eps as f32))
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> NormKernels for CubeBackend<R, F, I, BT> {
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64, kind: NormKind) -> FloatTensor<Self> {
        let (rows, width, args) = norm_args::<R>(&x.shape(), eps);
        let (client, device) = (x.client.clone(), x.device.clone());
        let dtypes = [x.dtype, weight.dtype, kind.output_dtype(x.dtype, weight.dtype)];
        let out = empty_device_contiguous_dtype::<R>(client.clone(), device, x.shape(), dtypes[2]);
        if rows > 0 {
            let units = units_for(width);
            rms_norm_kernel::launch::<R>(
                &client,
                row_grid(rows),
                CubeDim::new_1d(units as u32),
                into_contiguous(x).into_tensor_arg(),
                into_contiguous(weight).into_tensor_arg(),
                out.clone().into_tensor_arg(),
                args,
                kind.adds_one(),
                kind.rounds_first(),
                units,
                super::REVISION,
                dtypes.map(Into::into),
            );
        }
        out
    }

    fn rms_norm_grads(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
        kind: NormKind,
    ) -> [FloatTensor<Self>; 2] {
        let (rows, width, args) = norm_args::<R>(&x.shape(), eps);
        let (client, device) = (x.client.clone(), x.device.clone());
        assert_eq!(
            grad.dtype,
            kind.output_dtype(x.dtype, weight.dtype),
            "the norm's gradient is in its output's dtype"
        );
        let dtypes = [x.dtype, weight.dtype, grad.dtype];
        let blocks = share_rows(rows);
        let grad_x = empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), x.shape(), x.dtype);
        let shares =
            empty_device_contiguous_dtype::<R>(client.clone(), device, Shape::new([blocks, width]), DType::F32);
        if rows > 0 {
            let units = units_for(width);
            rms_norm_grads_kernel::launch::<R>(
                &client,
                row_grid(blocks),
                CubeDim::new_1d(units as u32),
                into_contiguous(x).into_tensor_arg(),
                into_contiguous(weight).into_tensor_arg(),
                into_contiguous(grad).into_tensor_arg(),
                grad_x.clone().into_tensor_arg(),
                shares.clone().into_tensor_arg(),
                args,
                kind.adds_one(),
                kind.rounds_first(),
                units,
                width,
                super::REVISION,
                dtypes.map(Into::into),
            );
        }
        [grad_x, shares]
    }

    fn l2_norm(x: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let (rows, width, args) = norm_args::<R>(&x.shape(), eps);
        let (client, device) = (x.client.clone(), x.device.clone());
        let dtypes = [x.dtype, DType::F32];
        let out = empty_device_contiguous_dtype::<R>(client.clone(), device, x.shape(), DType::F32);
        if rows > 0 {
            let units = units_for(width);
            l2_norm_kernel::launch::<R>(
                &client,
                row_grid(rows),
                CubeDim::new_1d(units as u32),
                into_contiguous(x).into_tensor_arg(),
                out.clone().into_tensor_arg(),
                args,
                units,
                super::REVISION,
                dtypes.map(Into::into),
            );
        }
        out
    }

    fn l2_norm_grads(x: FloatTensor<Self>, grad: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let (rows, width, args) = norm_args::<R>(&x.shape(), eps);
        let (client, device) = (x.client.clone(), x.device.clone());
        let dtypes = [x.dtype, grad.dtype];
        let grad_x = empty_device_contiguous_dtype::<R>(client.clone(), device, x.shape(), x.dtype);
        if rows > 0 {
            let units = units_for(width);
            l2_norm_grads_kernel::launch::<R>(
                &client,
                row_grid(rows),
                CubeDim::new_1d(units as u32),
                into_contiguous(x).into_tensor_arg(),
                into_contiguous(grad).into_tensor_arg(),
                grad_x.clone().into_tensor_arg(),
                args,
                units,
                super::REVISION,
                dtypes.map(Into::into),
            );
        }
        grad_x
    }
}

/// Which of the kernels a `FusedNorm` runs.
#[derive(Debug, Clone, Copy)]
enum NormOp {
    Rms(NormKind),
    RmsGrads(NormKind),
    L2,
    L2Grads,
}

/// A kernel as one custom operation of burn-fusion's stream: fusion runs it on the backend under it.
#[derive(Debug, Clone)]
struct FusedNorm<B> {
    desc: CustomOpIr,
    eps: f64,
    op: NormOp,
    _backend: std::marker::PhantomData<B>,
}

impl<B: FusionBackend + NormKernels> Operation<B::FusionRuntime> for FusedNorm<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let mut get = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
        let eps = self.eps;
        match self.op {
            NormOp::Rms(kind) => {
                let (x, weight) = (get(0), get(1));
                register_float_outputs::<B>(handles, outputs, [B::rms_norm(x, weight, eps, kind)]);
            }
            NormOp::RmsGrads(kind) => {
                let (x, weight, grad) = (get(0), get(1), get(2));
                register_float_outputs::<B>(handles, outputs, B::rms_norm_grads(x, weight, grad, eps, kind));
            }
            NormOp::L2 => {
                let x = get(0);
                register_float_outputs::<B>(handles, outputs, [B::l2_norm(x, eps)]);
            }
            NormOp::L2Grads => {
                let (x, grad) = (get(0), get(1));
                register_float_outputs::<B>(handles, outputs, [B::l2_norm_grads(x, grad, eps)]);
            }
        }
    }
}

/// Registers `op` on `inputs` with outputs `shapes` in burn-fusion's stream.
fn fused_norm<B: FusionBackend + NormKernels>(
    name: &'static str,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    shapes: &[(Shape, DType)],
    eps: f64,
    op: NormOp,
) -> Vec<FloatTensor<Fusion<B>>> {
    register_custom::<B, _>(name, inputs, shapes, |desc| FusedNorm::<B> {
        desc,
        eps,
        op,
        _backend: std::marker::PhantomData,
    })
}

impl<B: FusionBackend + NormKernels> NormKernels for Fusion<B> {
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64, kind: NormKind) -> FloatTensor<Self> {
        let out = (x.shape(), kind.output_dtype(x.dtype(), weight.dtype()));
        let [normed] = outputs(fused_norm::<B>("kiln_rms_norm", vec![x, weight], &[out], eps, NormOp::Rms(kind)));
        normed
    }

    fn rms_norm_grads(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
        kind: NormKind,
    ) -> [FloatTensor<Self>; 2] {
        let [rows, width] = x.shape().dims::<2>();
        let shapes = [(x.shape(), x.dtype()), (Shape::new([share_rows(rows), width]), DType::F32)];
        outputs(fused_norm::<B>("kiln_rms_norm_grads", vec![x, weight, grad], &shapes, eps, NormOp::RmsGrads(kind)))
    }

    fn l2_norm(x: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let out = (x.shape(), DType::F32);
        let [normed] = outputs(fused_norm::<B>("kiln_l2_norm", vec![x], &[out], eps, NormOp::L2));
        normed
    }

    fn l2_norm_grads(x: FloatTensor<Self>, grad: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let out = (x.shape(), x.dtype());
        let [grad_x] = outputs(fused_norm::<B>("kiln_l2_norm_grads", vec![x, grad], &[out], eps, NormOp::L2Grads));
        grad_x
    }
}

/// The launches CUDA makes (`cuda_source`): the three norm kinds over inputs and weights in f32 and bf16, rows as
/// narrow as the q/k norms' and as wide as LFM2.5-1.2B's.
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, settings, tensor};
    let mut variants = Vec::new();
    for kind in [NormKind::Plain, NormKind::ZeroCentered, NormKind::ScaledInF32] {
        for (x, weight) in [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::BF16, DType::F32)] {
            let dtypes: [StorageType; 3] = [x, weight, kind.output_dtype(x, weight)].map(Into::into);
            for width in [64, 2048] {
                let units = units_for(width);
                let args = || NormArgsCompilationArg { rows: (), width: (), eps: () };
                let name = format!("rms_norm {kind:?} {x:?}/{weight:?} width {width}");
                variants.push(Variant::new(
                    format!("{name} forward"),
                    rms_norm_kernel::RmsNormKernel::<Runtime>::new(
                        settings(units as u32),
                        client.clone(),
                        tensor(),
                        tensor(),
                        tensor(),
                        args(),
                        kind.adds_one(),
                        kind.rounds_first(),
                        units,
                        super::REVISION,
                        dtypes,
                    ),
                ));
                variants.push(Variant::new(
                    format!("{name} backward"),
                    rms_norm_grads_kernel::RmsNormGradsKernel::<Runtime>::new(
                        settings(units as u32),
                        client.clone(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        args(),
                        kind.adds_one(),
                        kind.rounds_first(),
                        units,
                        width,
                        super::REVISION,
                        dtypes,
                    ),
                ));
            }
        }
    }
    // The L2 norm's: Qwen3.5's key width (128) and a narrow one with idle units.
    for x in [DType::F32, DType::BF16] {
        let dtypes: [StorageType; 2] = [x, DType::F32].map(Into::into);
        for width in [16, 128] {
            let units = units_for(width);
            let args = || NormArgsCompilationArg { rows: (), width: (), eps: () };
            let name = format!("l2_norm {x:?} width {width}");
            variants.push(Variant::new(
                format!("{name} forward"),
                l2_norm_kernel::L2NormKernel::<Runtime>::new(
                    settings(units as u32),
                    client.clone(),
                    tensor(),
                    tensor(),
                    args(),
                    units,
                    super::REVISION,
                    dtypes,
                ),
            ));
            variants.push(Variant::new(
                format!("{name} backward"),
                l2_norm_grads_kernel::L2NormGradsKernel::<Runtime>::new(
                    settings(units as u32),
                    client.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    args(),
                    units,
                    super::REVISION,
                    dtypes,
                ),
            ));
        }
    }
    variants
}
