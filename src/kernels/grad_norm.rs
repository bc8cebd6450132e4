//! The global gradient norm's sum of squares over every parameter's gradient (`train::optim::OptimizerOps`) as
//! one CubeCL launch per few dozen tensors, for burn's CubeCL backends (CUDA, Vulkan) with and without
//! burn-fusion.
//!
//! As tensor ops every gradient costs three kernels (its f32 squares written out in full, a zero fill, an
//! atomic whole-tensor sum): on lavapipe, this kernel took LFM2-350M's step from 1,940 kernels to 1,450 and
//! Qwen3.5-0.8B's from 6,041 to 5,058. Here one kernel reads the gradients of up to `MAX_TENSORS` parameters in their own dtype: each cube
//! sums the squares of a stretch of one tensor into its slot of a partial-sum vector (at most about
//! 16k slots however large the model), which one reduction then adds. No atomics: the sum's order
//! is fixed, so it is the same from run to run.
//! `optim::squared_sums_in_order` is the reference it is tested against (tests/vulkan_backend.rs).

use burn::tensor::Tensor as BurnTensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::stream::Operation;
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer};
use cubecl::prelude::*;

use super::{
    CubeLayout, UNITS, cube_sum, float_tensor, grid_row, outputs, register_custom, register_float_outputs, row_grid,
};
use crate::models::ops::column_sums;

/// Tensors one launch reads at most (each is a binding of its own; devices bound them, `max_bindings`).
const MAX_TENSORS: usize = 32;
/// Cubes `base + c` for `c` in the grid: cube `k` sums the squares of values `(k − starts[i]) · per_cube …`
/// of tensor `i`, where `starts[i] ≤ k < starts[i + 1]`, into `partials[k]`.
#[cube(launch)]
fn squared_sums_kernel<F: Float>(
    tensors: &Sequence<Tensor<F>>,
    starts: Sequence<u32>,
    partials: &mut Tensor<f32>,
    base: u32,
    per_cube: u32,
    #[comptime] _revision: u64,
    #[define(F)] _dtype: StorageType,
) {
    let per_cube = per_cube as usize;
    let cube = base as usize + grid_row();
    let count = comptime![tensors.len()];
    let mut squares = 0.0f32;
    #[unroll]
    for i in 0..count {
        let start = *starts.index(i) as usize;
        let end = *starts.index(comptime![i + 1]) as usize;
        if cube >= start && cube < end {
            let values = tensors.index(i);
            let first = (cube - start) * per_cube;
            let mut last = first + per_cube;
            if last > values.len() {
                last = values.len();
            }
            let mut at = first + UNIT_POS_X as usize;
            while at < last {
                let v = f32::cast_from(values[at]);
                squares += v * v;
                at += UNITS;
            }
        }
    }
    // Every unit of every cube reaches the sum's barriers (cubes past the last start add nothing).
    let total = cube_sum(squares, UNITS);
    if UNIT_POS_X == 0 && cube < partials.len() {
        partials[cube] = total;
    }
}

/// The kernel as a backend primitive: the partial sums `[cubes]` (f32) of `Σ x²` over `tensors`, all of one
/// float dtype, in as many launches as the device's bindings take.
pub trait SquaredSumsKernel: Backend {
    fn squared_sum_partials(tensors: Vec<FloatTensor<Self>>) -> FloatTensor<Self>;
}

/// `OptimizerOps::squared_norm` on a CubeCL backend: a launch per dtype and `MAX_TENSORS` tensors, one
/// reduction of each dtype's partial sums, their sum. `None` for no tensors.
pub fn squared_norm<B: SquaredSumsKernel>(tensors: Vec<FloatTensor<B>>) -> Option<BurnTensor<B, 1>> {
    let mut by_dtype: Vec<(DType, Vec<FloatTensor<B>>)> = Vec::new();
    for t in tensors {
        let dtype = t.dtype();
        match by_dtype.iter_mut().find(|(d, _)| *d == dtype) {
            Some((_, group)) => group.push(t),
            None => by_dtype.push((dtype, vec![t])),
        }
    }
    by_dtype
        .into_iter()
        .map(|(_, group)| {
            let partials = float_tensor::<B, 1>(B::squared_sum_partials(group));
            let cubes = partials.dims()[0];
            column_sums(partials.reshape([cubes, 1]))
        })
        .reduce(|a, b| a + b)
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> SquaredSumsKernel for CubeBackend<R, F, I, BT> {
    fn squared_sum_partials(tensors: Vec<FloatTensor<Self>>) -> FloatTensor<Self> {
        let first = tensors.first().expect("squared sums of at least one tensor");
        let (client, device, dtype) = (first.client.clone(), first.device.clone(), first.dtype);
        assert!(tensors.iter().all(|t| t.dtype == dtype), "squared sums of one dtype per launch");
        let lens: Vec<usize> = tensors.iter().map(|t| t.shape().num_elements()).collect();
        let layout = CubeLayout::new(&lens);
        let partials =
            empty_device_contiguous_dtype::<R>(client.clone(), device, Shape::new([layout.cubes()]), DType::F32);
        let mut tensors = tensors.into_iter();
        for launch in layout.launches(1, client.properties().hardware.max_bindings, MAX_TENSORS) {
            // The order of the values does not change their sum: a gradient whose buffer holds just its own
            // values (a transposed one, say) is read as it lies; anything else is copied first.
            let group: SequenceArg<R, _> = tensors
                .by_ref()
                .take(launch.tensors.len())
                .map(|t| if t.is_contiguous_buffer() { t } else { into_contiguous(t) })
                .map(|t| t.into_tensor_arg())
                .collect();
            squared_sums_kernel::launch::<R>(
                &client,
                row_grid(launch.cubes),
                CubeDim::new_1d(UNITS as u32),
                group,
                launch.starts.into_iter().collect(),
                partials.clone().into_tensor_arg(),
                launch.base,
                launch.per_cube,
                super::REVISION,
                dtype.into(),
            );
        }
        partials
    }
}

/// The kernel as one custom operation of burn-fusion's stream: fusion runs it on the backend under it.
#[derive(Debug, Clone)]
struct FusedSquaredSums<B> {
    desc: CustomOpIr,
    _backend: std::marker::PhantomData<B>,
}

impl<B: FusionBackend + SquaredSumsKernel> Operation<B::FusionRuntime> for FusedSquaredSums<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let tensors = self.desc.inputs.iter().map(|t| handles.get_float_tensor::<B>(t)).collect();
        register_float_outputs::<B>(handles, &self.desc.outputs, [B::squared_sum_partials(tensors)]);
    }
}

impl<B: FusionBackend + SquaredSumsKernel> SquaredSumsKernel for Fusion<B> {
    fn squared_sum_partials(tensors: Vec<FloatTensor<Self>>) -> FloatTensor<Self> {
        let lens: Vec<usize> = tensors.iter().map(|t| t.shape().num_elements()).collect();
        let total = CubeLayout::new(&lens).cubes();
        let [partials] = outputs(register_custom::<B, _>(
            "kiln_squared_sums",
            tensors,
            &[(Shape::new([total]), DType::F32)],
            |desc| FusedSquaredSums::<B> { desc, _backend: std::marker::PhantomData },
        ));
        partials
    }
}

/// The launches CUDA makes (`cuda_source`): gradients in f32 and bf16, a full launch of tensors and a short
/// last one.
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, scalars, settings, tensor, tensors};
    let mut variants = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        for count in [MAX_TENSORS, 3] {
            variants.push(Variant::new(
                format!("squared sums {dtype:?}, {count} tensors"),
                squared_sums_kernel::SquaredSumsKernel::<Runtime>::new(
                    settings(UNITS as u32),
                    client.clone(),
                    tensors(count),
                    scalars(count + 1),
                    tensor(),
                    (),
                    (),
                    super::REVISION,
                    dtype.into(),
                ),
            ));
        }
    }
    variants
}
