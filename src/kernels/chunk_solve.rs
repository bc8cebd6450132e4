//! The chunk solve of the gated delta rule's chunked form, `T = (I + L)⁻¹` for every chunk's strictly lower
//! `L` (`deltanet::unit_lower_inverse`), as one CubeCL kernel for burn's CubeCL backends (CUDA, Vulkan) with
//! and without burn-fusion.
//!
//! As tensor ops the solve is recursive block doubling: log₂ C rounds of two batched matmuls and an
//! element-wise kernel (17 kernels at C = 64), run in the forward pass and again in the backward pass of
//! every DeltaNet layer. Here one launch solves every chunk by forward substitution: a cube per chunk holds
//! `L` in shared memory and unit `j` computes column `j` of `T`, `T[i][j] = −Σ_{j ≤ m < i} L[i][m] T[m][j]`
//! below the unit diagonal. Both are exact solves, equal up to f32 rounding; `deltanet::unit_lower_inverse`
//! is the reference it is tested against (tests/vulkan_backend.rs).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::stream::Operation;
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer};
use cubecl::prelude::*;

use super::{float_tensor, grid_row, outputs, register_custom, register_float_outputs, row_grid};

/// One cube of `size` units per matrix of `lower` `[matrices, size, size]` (f32, contiguous, strictly lower:
/// what is on and above the diagonal is not read); writes `inverse` in the same layout.
#[cube(launch)]
fn unit_lower_inverse_kernel(
    lower: &Tensor<f32>,
    inverse: &mut Tensor<f32>,
    matrices: u32,
    #[comptime] size: usize,
    #[comptime] _revision: u64,
) {
    let matrix = grid_row();
    // Whole cubes leave: the matrix is the cube's, so no unit waits at a barrier another has left.
    if matrix >= matrices as usize {
        terminate!();
    }
    let column = UNIT_POS_X as usize;
    let base = matrix * size * size;
    let mut l = SharedMemory::<f32>::new(size * size);
    // Each unit reads and writes only its own column of it: no barrier after the one below.
    let mut t = SharedMemory::<f32>::new(size * size);
    let mut e = column;
    while e < size * size {
        l[e] = lower[base + e];
        e += size;
    }
    sync_cube();

    for i in 0..size {
        let mut value = 0.0f32;
        if i == column {
            value = 1.0;
        } else if i > column {
            let mut sum = 0.0f32;
            for m in column..i {
                sum += l[i * size + m] * t[m * size + column];
            }
            value = -sum;
        }
        t[i * size + column] = value;
        inverse[base + i * size + column] = value;
    }
}

/// The solve as a backend primitive: `lower` `[batch, heads, chunks, C, C]` in f32 to its `(I + L)⁻¹`.
pub trait ChunkSolveKernel: Backend {
    fn unit_lower_inverse(lower: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// `ModelBackend::unit_lower_inverse` on a CubeCL backend: every chunk's solve in one kernel launch.
pub fn unit_lower_inverse<B: ChunkSolveKernel>(lower: burn::tensor::Tensor<B, 5>) -> burn::tensor::Tensor<B, 5> {
    float_tensor(B::unit_lower_inverse(lower.into_primitive().tensor()))
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> ChunkSolveKernel for CubeBackend<R, F, I, BT> {
    fn unit_lower_inverse(lower: FloatTensor<Self>) -> FloatTensor<Self> {
        assert_eq!(lower.dtype, DType::F32, "the chunk solve runs in f32; its input is {:?}", lower.dtype);
        let shape = lower.shape();
        let [batch, heads, chunks, rows, size] = shape.dims::<5>();
        assert_eq!(rows, size, "the chunk solve takes square matrices, not {rows}×{size}");
        let matrices = batch * heads * chunks;
        let (client, device) = (lower.client.clone(), lower.device.clone());
        let inverse = empty_device_contiguous_dtype::<R>(client.clone(), device, shape, DType::F32);
        if matrices > 0 {
            unit_lower_inverse_kernel::launch::<R>(
                &client,
                row_grid(matrices),
                CubeDim::new_1d(u32::try_from(size).expect("a chunk of at most a cube's units")),
                into_contiguous(lower).into_tensor_arg(),
                inverse.clone().into_tensor_arg(),
                u32::try_from(matrices).expect("a chunk count that fits in u32"),
                size,
                super::REVISION,
            );
        }
        inverse
    }
}

/// The kernel as one custom operation of burn-fusion's stream: fusion runs it on the backend under it.
#[derive(Debug, Clone)]
struct FusedChunkSolve<B> {
    desc: CustomOpIr,
    _backend: std::marker::PhantomData<B>,
}

impl<B: FusionBackend + ChunkSolveKernel> Operation<B::FusionRuntime> for FusedChunkSolve<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let lower = handles.get_float_tensor::<B>(&self.desc.inputs[0]);
        register_float_outputs::<B>(handles, &self.desc.outputs, [B::unit_lower_inverse(lower)]);
    }
}

impl<B: FusionBackend + ChunkSolveKernel> ChunkSolveKernel for Fusion<B> {
    fn unit_lower_inverse(lower: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = lower.shape();
        let [inverse] =
            outputs(register_custom::<B, _>("kiln_unit_lower_inverse", vec![lower], &[(shape, DType::F32)], |desc| {
                FusedChunkSolve::<B> { desc, _backend: std::marker::PhantomData }
            }));
        inverse
    }
}

/// The launches CUDA makes (`cuda_source`): the DeltaNet's chunks of 64 and the tiny models' smaller ones.
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, settings, tensor};
    [64, 16]
        .map(|size| {
            Variant::new(
                format!("chunk solve {size}×{size}"),
                unit_lower_inverse_kernel::UnitLowerInverseKernel::<Runtime>::new(
                    settings(size as u32),
                    client.clone(),
                    tensor(),
                    tensor(),
                    (),
                    size,
                    super::REVISION,
                ),
            )
        })
        .into()
}
