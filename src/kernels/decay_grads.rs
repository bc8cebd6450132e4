//! The per-position gradients of the gated delta rule's chunked backward pass, those of the log-decays `g` and
//! the rates `β` (`deltanet::decay_grads`), as one CubeCL kernel for burn's CubeCL backends (CUDA, Vulkan)
//! with and without burn-fusion.
//!
//! As tensor ops they are five rows' dot products, the decays' row and column sums and a reverse cumulative
//! sum: some twenty kernels a DeltaNet layer, most of them a lone product followed by a lone reduction, since
//! burn-fusion 0.21 scores a reduction fused with a single op before it no better than the op alone
//! (docs/BENCHMARKS.md, "The DeltaNet's decay gradients as one kernel"). Here a cube per chunk does all of it: unit `i` takes row `i`'s dot products and its row and
//! column of the decays' gradient, the units share the end gaps' sum, and each unit sums the chunk's tail
//! for the reverse cumulative sum. `deltanet::decay_grads` is the reference it is tested against
//! (tests/vulkan_backend.rs).

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

use super::{float_tensor, grid_row, outputs, register_custom, register_float_outputs, row_grid};
use crate::models::deltanet::DecayGradInputs;

/// One cube of `size` units per chunk; all tensors f32, contiguous, batch, heads and chunks flattened:
/// the key-wide pairs `[chunks, C, dk]`, the value-wide pair `[chunks, C, dv]`, `d_gap` `[chunks, C, C]`,
/// `to_end`, `from_start` and both outputs `[chunks, C]`, `d_chunk_decay` `[chunks]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn chunk_decay_grads_kernel(
    d_k_decayed: &Tensor<f32>,
    k: &Tensor<f32>,
    d_q_decayed: &Tensor<f32>,
    q: &Tensor<f32>,
    neg_d_keys_from_start: &Tensor<f32>,
    k_beta: &Tensor<f32>,
    d_k_beta: &Tensor<f32>,
    d_v_beta: &Tensor<f32>,
    v: &Tensor<f32>,
    d_gap: &Tensor<f32>,
    to_end: &Tensor<f32>,
    from_start: &Tensor<f32>,
    d_chunk_decay: &Tensor<f32>,
    d_g: &mut Tensor<f32>,
    d_beta: &mut Tensor<f32>,
    chunks: u32,
    #[comptime] size: usize,
    #[comptime] dk: usize,
    #[comptime] dv: usize,
    #[comptime] _revision: u64,
) {
    let chunk = grid_row();
    // Whole cubes leave: the chunk is the cube's, so no unit waits at a barrier another has left.
    if chunk >= chunks as usize {
        terminate!();
    }
    let i = UNIT_POS_X as usize;
    let position = chunk * size + i;
    let (keys, values) = (position * dk, position * dv);
    let mut end_gap = 0.0f32;
    let mut start = 0.0f32;
    let mut rate = 0.0f32;
    for d in 0..dk {
        let at = keys + d;
        end_gap += d_k_decayed[at] * k[at];
        start += d_q_decayed[at] * q[at] - neg_d_keys_from_start[at] * k_beta[at];
        rate += d_k_beta[at] * k[at];
    }
    for e in 0..dv {
        rate += d_v_beta[values + e] * v[values + e];
    }
    let gaps = chunk * size * size;
    let mut gap_row = 0.0f32;
    let mut gap_column = 0.0f32;
    for j in 0..size {
        gap_row += d_gap[gaps + i * size + j];
        gap_column += d_gap[gaps + j * size + i];
    }
    end_gap *= to_end[position];

    let mut end_gaps = SharedMemory::<f32>::new(size);
    let mut cums = SharedMemory::<f32>::new(size);
    end_gaps[i] = end_gap;
    sync_cube();
    let mut last = 0.0f32;
    for j in 0..size {
        last += end_gaps[j];
    }
    // The chunk's decay is `from_start` at its last position, and every `to_end` reads `cum` there.
    if i == size - 1 {
        start += d_chunk_decay[chunk];
    }
    let mut cum = gap_row - gap_column - end_gap + start * from_start[position];
    if i == size - 1 {
        cum += last;
    }
    cums[i] = cum;
    sync_cube();
    // cum = cumsum(g) within the chunk, so dg is the reverse cumulative sum of d cum.
    let mut tail = 0.0f32;
    for j in i..size {
        tail += cums[j];
    }
    d_g[position] = tail;
    d_beta[position] = rate;
}

/// The per-position gradients as a backend primitive: `DecayGradInputs` on the backend, as primitives in its
/// field order, to `[d g, d β]` `[batch, heads, chunks, C]`.
pub trait DecayGradsKernel: Backend {
    fn decay_grads(inputs: [FloatTensor<Self>; INPUTS]) -> [FloatTensor<Self>; 2];
}

/// The fields of `DecayGradInputs`.
const INPUTS: usize = 13;

/// `ModelBackend::delta_rule_decay_grads` on a CubeCL backend: every chunk's in one kernel launch.
pub fn decay_grads<B: DecayGradsKernel>(x: DecayGradInputs<B>) -> [burn::tensor::Tensor<B, 4>; 2] {
    // In `DecayGradInputs`' order: the rows whose dot products it takes, `d_gap`, the per-position decays.
    let rows = [x.d_k_decayed, x.k, x.d_q_decayed, x.q, x.neg_d_keys_from_start, x.k_beta, x.d_k_beta, x.d_v_beta, x.v];
    let rows = rows.into_iter().chain([x.d_gap]).map(|t| t.into_primitive().tensor());
    let positions = [x.to_end, x.from_start, x.d_chunk_decay].into_iter().map(|t| t.into_primitive().tensor());
    let all: Vec<_> = rows.chain(positions).collect();
    let Ok(inputs) = <[_; INPUTS]>::try_from(all) else { unreachable!("DecayGradInputs has {INPUTS} fields") };
    B::decay_grads(inputs).map(float_tensor)
}

/// `[batch, heads, chunks, C]`, the outputs' shape, from the keys' `[batch, heads, chunks, C, dk]`.
fn output_shape(keys: &Shape) -> Shape {
    let [b, h, n, c, _] = keys.dims::<5>();
    [b, h, n, c].into()
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> DecayGradsKernel for CubeBackend<R, F, I, BT> {
    fn decay_grads(inputs: [FloatTensor<Self>; INPUTS]) -> [FloatTensor<Self>; 2] {
        for t in &inputs {
            assert_eq!(t.dtype, DType::F32, "the decay gradients run in f32; an input is {:?}", t.dtype);
        }
        let keys = inputs[1].shape();
        let [b, h, n, size, dk] = keys.dims::<5>();
        let dv = inputs[8].shape().dims::<5>()[4];
        let chunks = b * h * n;
        let (client, device) = (inputs[1].client.clone(), inputs[1].device.clone());
        let [d_g, d_beta] = [0, 1].map(|_| {
            empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), output_shape(&keys), DType::F32)
        });
        if chunks > 0 {
            let [
                d_k_decayed,
                k,
                d_q_decayed,
                q,
                neg_d_keys_from_start,
                k_beta,
                d_k_beta,
                d_v_beta,
                v,
                d_gap,
                to_end,
                from_start,
                d_chunk_decay,
            ] = inputs.map(into_contiguous);
            chunk_decay_grads_kernel::launch::<R>(
                &client,
                row_grid(chunks),
                CubeDim::new_1d(u32::try_from(size).expect("a chunk of at most a cube's units")),
                d_k_decayed.into_tensor_arg(),
                k.into_tensor_arg(),
                d_q_decayed.into_tensor_arg(),
                q.into_tensor_arg(),
                neg_d_keys_from_start.into_tensor_arg(),
                k_beta.into_tensor_arg(),
                d_k_beta.into_tensor_arg(),
                d_v_beta.into_tensor_arg(),
                v.into_tensor_arg(),
                d_gap.into_tensor_arg(),
                to_end.into_tensor_arg(),
                from_start.into_tensor_arg(),
                d_chunk_decay.into_tensor_arg(),
                d_g.clone().into_tensor_arg(),
                d_beta.clone().into_tensor_arg(),
                u32::try_from(chunks).expect("a chunk count that fits in u32"),
                size,
                dk,
                dv,
                super::REVISION,
            );
        }
        [d_g, d_beta]
    }
}

/// The kernel as one custom operation of burn-fusion's stream: fusion runs it on the backend under it.
#[derive(Debug, Clone)]
struct FusedDecayGrads<B> {
    desc: CustomOpIr,
    _backend: std::marker::PhantomData<B>,
}

impl<B: FusionBackend + DecayGradsKernel> Operation<B::FusionRuntime> for FusedDecayGrads<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let inputs: [FloatTensor<B>; INPUTS] =
            std::array::from_fn(|i| handles.get_float_tensor::<B>(&self.desc.inputs[i]));
        register_float_outputs::<B>(handles, &self.desc.outputs, B::decay_grads(inputs));
    }
}

impl<B: FusionBackend + DecayGradsKernel> DecayGradsKernel for Fusion<B> {
    fn decay_grads(inputs: [FloatTensor<Self>; INPUTS]) -> [FloatTensor<Self>; 2] {
        let shape = output_shape(&inputs[1].shape());
        let shapes = [(shape.clone(), DType::F32), (shape, DType::F32)];
        outputs(register_custom::<B, _>("kiln_decay_grads", inputs.into(), &shapes, |desc| FusedDecayGrads::<B> {
            desc,
            _backend: std::marker::PhantomData,
        }))
    }
}

/// The launches CUDA makes (`cuda_source`): Qwen3.5's key and value widths 128 and the tiny model's 16, in
/// chunks of 64.
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, settings, tensor};
    [128, 16]
        .map(|width| {
            Variant::new(
                format!("decay gradients dk = dv = {width}, chunks of 64"),
                chunk_decay_grads_kernel::ChunkDecayGradsKernel::<Runtime>::new(
                    settings(64),
                    client.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    (),
                    64,
                    width,
                    width,
                    super::REVISION,
                ),
            )
        })
        .into()
}
