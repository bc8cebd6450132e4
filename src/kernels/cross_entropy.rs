//! The rows of the chunked cross-entropy (`train::linear_ce`) as one CubeCL kernel: from a chunk's logits
//! `[rows, vocab]` in the compute dtype, each row's negative log-likelihood and, when the gradients are
//! wanted, `dlogits = coef · (softmax − onehot(target))` in the logits' dtype.
//!
//! As tensor ops (`linear_ce::cross_entropy_rows`, the reference) the chunk passes through device memory
//! about ten times in f32 — the cast, the shift by the row maximum, the exponentials, their sum, the
//! quotient, the scatter of the target's term, the cast back — since burn's reductions do not fuse a
//! broadcast operand: with a 65k–248k vocabulary that is 10–40 GB a step at 4,096 tokens. The kernel reads
//! each row twice (an online maximum and sum, then the gradient) and writes the gradient once.

use burn::tensor::Tensor as BurnTensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::stream::Operation;
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer};
use cubecl::prelude::*;

use super::{
    LOWEST, cube_log_sum_exp, exp_sum_add, float_tensor, grid_row, outputs, register_custom, register_float_outputs,
    row_grid,
};

/// Units per cube (one row of logits): a power of two, for the tree reduction.
const UNITS: u32 = 256;

/// One cube per row: `nll[row] = log Σ exp(x) − x[target]` and, with `with_grads`,
/// `dlogits[row, j] = coef[row] · (exp(x_j − lse) − [j = target])`, in f32 from logits in `F`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn cross_entropy_rows_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    coef: &Tensor<f32>,
    nll: &mut Tensor<f32>,
    dlogits: &mut Tensor<F>,
    rows: u32,
    vocab: u32,
    #[comptime] with_grads: bool,
    #[comptime] _revision: u64,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = grid_row();
    // Whole cubes leave: the row is the cube's, so no unit waits at a barrier another has left.
    if row >= rows as usize {
        terminate!();
    }
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let vocab = vocab as usize;
    let base = row * vocab;

    let mut max = f32::new(LOWEST);
    let mut sum = 0.0f32;
    let mut j = unit;
    while j < vocab {
        exp_sum_add(&mut max, &mut sum, f32::cast_from(logits[base + j]));
        j += units;
    }
    let log_sum = cube_log_sum_exp(max, sum, UNITS as usize);
    // Targets are checked against the vocabulary before training (`train::trainer`); the bound only keeps a
    // bad one from reading another row.
    let target = u32::cast_from(targets[row]) as usize;
    if unit == 0 {
        let mut picked = 0.0f32;
        if target < vocab {
            picked = f32::cast_from(logits[base + target]);
        }
        nll[row] = log_sum - picked;
    }

    if with_grads {
        let scale = coef[row];
        let mut j = unit;
        while j < vocab {
            let mut p = (f32::cast_from(logits[base + j]) - log_sum).exp();
            if j == target {
                p -= 1.0;
            }
            dlogits[base + j] = F::cast_from(scale * p);
            j += units;
        }
    }
}

/// The kernel as a backend primitive: logits `[rows, vocab]`, targets `[rows, 1]`, coefficients `[rows, 1]`
/// in f32 → `[nll [rows, 1] f32, dlogits]`: `[rows, vocab]` in the logits' dtype with `with_grads`, else a
/// `[1, 1]` placeholder never written.
pub trait CrossEntropyRowsKernel: Backend {
    fn cross_entropy_rows(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        coef: FloatTensor<Self>,
        with_grads: bool,
    ) -> [FloatTensor<Self>; 2];
}

/// `train::linear_ce::CrossEntropyRows` on a CubeCL backend: one kernel launch.
pub fn cross_entropy_rows<B: CrossEntropyRowsKernel>(
    logits: BurnTensor<B, 2>,
    targets: BurnTensor<B, 2, Int>,
    coef: BurnTensor<B, 2>,
    with_grads: bool,
) -> (BurnTensor<B, 2>, Option<BurnTensor<B, 2>>) {
    let [nll, dlogits] = B::cross_entropy_rows(
        logits.into_primitive().tensor(),
        targets.into_primitive(),
        coef.into_primitive().tensor(),
        with_grads,
    )
    .map(float_tensor);
    (nll, with_grads.then_some(dlogits))
}

/// The output shapes `[nll, dlogits]` for logits `[rows, vocab]` in `dtype`.
fn output_shapes(logits: &Shape, dtype: DType, with_grads: bool) -> [(Shape, DType); 2] {
    let [rows, vocab] = logits.dims::<2>();
    let grads = if with_grads { Shape::new([rows, vocab]) } else { Shape::new([1, 1]) };
    [(Shape::new([rows, 1]), DType::F32), (grads, dtype)]
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> CrossEntropyRowsKernel
    for CubeBackend<R, F, I, BT>
{
    fn cross_entropy_rows(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        coef: FloatTensor<Self>,
        with_grads: bool,
    ) -> [FloatTensor<Self>; 2] {
        assert_eq!(coef.dtype, DType::F32, "the cross-entropy kernel takes its coefficients in f32");
        let [rows, vocab] = logits.shape().dims::<2>();
        let (client, device, dtype) = (logits.client.clone(), logits.device.clone(), logits.dtype);
        let [nll, dlogits] = output_shapes(&logits.shape(), dtype, with_grads)
            .map(|(shape, dtype)| empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), shape, dtype));
        let narrow = |n: usize| u32::try_from(n).expect("a logits chunk's sizes fit in u32");
        let target_dtype = targets.dtype;
        cross_entropy_rows_kernel::launch::<R>(
            &client,
            row_grid(rows),
            CubeDim::new_1d(UNITS),
            into_contiguous(logits).into_tensor_arg(),
            into_contiguous(targets).into_tensor_arg(),
            into_contiguous(coef).into_tensor_arg(),
            nll.clone().into_tensor_arg(),
            dlogits.clone().into_tensor_arg(),
            narrow(rows),
            narrow(vocab),
            with_grads,
            super::REVISION,
            [dtype.into(), target_dtype.into()],
        );
        [nll, dlogits]
    }
}

/// The kernel as one custom operation of burn-fusion's stream: fusion runs it on the backend under it.
#[derive(Debug, Clone)]
struct FusedCrossEntropyRows<B> {
    desc: CustomOpIr,
    with_grads: bool,
    _backend: std::marker::PhantomData<B>,
}

impl<B: FusionBackend + CrossEntropyRowsKernel> Operation<B::FusionRuntime> for FusedCrossEntropyRows<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let logits = handles.get_float_tensor::<B>(&inputs[0]);
        let targets = handles.get_int_tensor::<B>(&inputs[1]);
        let coef = handles.get_float_tensor::<B>(&inputs[2]);
        let results = B::cross_entropy_rows(logits, targets, coef, self.with_grads);
        register_float_outputs::<B>(handles, outputs, results);
    }
}

impl<B: FusionBackend + CrossEntropyRowsKernel> CrossEntropyRowsKernel for Fusion<B> {
    fn cross_entropy_rows(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        coef: FloatTensor<Self>,
        with_grads: bool,
    ) -> [FloatTensor<Self>; 2] {
        let shapes = output_shapes(&logits.shape(), logits.dtype(), with_grads);
        let inputs = vec![logits, targets, coef];
        outputs(register_custom::<B, _>(
            "kiln_cross_entropy_rows",
            inputs,
            &shapes,
            |desc| FusedCrossEntropyRows::<B> { desc, with_grads, _backend: std::marker::PhantomData },
        ))
    }
}

/// The launches CUDA makes (`cuda_source`): logits in f32 and bf16, targets in i32, with and without
/// gradients.
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, settings, tensor};
    let mut variants = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        for with_grads in [true, false] {
            variants.push(Variant::new(
                format!("cross-entropy rows {dtype:?}, gradients {with_grads}"),
                cross_entropy_rows_kernel::CrossEntropyRowsKernel::<Runtime>::new(
                    settings(UNITS),
                    client.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    (),
                    (),
                    with_grads,
                    super::REVISION,
                    [dtype.into(), DType::I32.into()],
                ),
            ));
        }
    }
    variants
}
