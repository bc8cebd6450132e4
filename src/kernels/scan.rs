//! The scan across chunks of the gated delta rule (`deltanet::ChunkRecurrence`, both passes) as one CubeCL
//! kernel, for burn's CubeCL backends (CUDA, Vulkan) with and without burn-fusion. As tensor ops the scan
//! costs about nine kernel launches per 64-token chunk and pass (two matmuls, slices, element-wise ops):
//! ~600 per DeltaNet layer and pass at sequence 4096, each waiting on the last. Here one launch runs every
//! chunk: a cube owns `TILE` columns of one head's `[dk, dv]` state — the columns evolve independently, as
//! each column of `c_n` only reads its own column of the state — keeps them in shared memory, and walks the
//! chunks in order. `deltanet::recurrence_by_chunk` is the reference it is tested against
//! (tests/vulkan_backend.rs).

// cubecl's prelude has its own `Tensor` (a kernel argument): burn's is `BurnTensor` here.
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

use super::{float_tensor, outputs, register_custom, register_float_outputs};
use crate::models::deltanet::{ChunkRecurrence, Direction, RecurrenceOut};

/// State columns per cube. With `UNITS`, the knob to turn once the device profile shows the kernel's time:
/// Qwen3.5-0.8B gets 16 heads × 16 tiles = 256 cubes of 128 units, each walking 64 chunks in turn.
const TILE: usize = 8;
/// Units per cube: they stride over the tile's state entries and corrections.
const UNITS: u32 = 128;

/// One cube: columns `CUBE_POS_X · TILE ..` of head `CUBE_POS_Y`'s state, through every chunk. All tensors
/// f32, contiguous, batch and heads flattened: `reads`, `writes` `[BH, N, C, dk]`, `base`, `corrections`
/// `[BH, N, C, dv]`, `decay` `[BH, N]`, `extra`, `states` `[BH, N, dk, dv]`, `initial`, `last` `[BH, dk, dv]`.
#[cube(launch)]
// `has_extra` is known when the kernel compiles, `column < dv` only when it runs: not one condition.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn chunk_recurrence_kernel(
    reads: &Tensor<f32>,
    base: &Tensor<f32>,
    writes: &Tensor<f32>,
    decay: &Tensor<f32>,
    extra: &Tensor<f32>,
    initial: &Tensor<f32>,
    states: &mut Tensor<f32>,
    corrections: &mut Tensor<f32>,
    last: &mut Tensor<f32>,
    chunks: u32,
    dv: u32,
    #[comptime] dk: usize,
    #[comptime] size: usize,
    #[comptime] backward: bool,
    #[comptime] has_extra: bool,
    #[comptime] _revision: u64,
) {
    let head = CUBE_POS_Y as usize;
    let first_column = CUBE_POS_X as usize * TILE;
    let units = CUBE_DIM_X as usize;
    let unit = UNIT_POS_X as usize;
    let chunks = chunks as usize;
    let dv = dv as usize;
    let mut state = SharedMemory::<f32>::new(dk * TILE);
    let mut correction = SharedMemory::<f32>::new(size * TILE);

    let mut e = unit;
    while e < dk * TILE {
        let column = first_column + e % TILE;
        let mut value = 0.0f32;
        if column < dv {
            value = initial[(head * dk + e / TILE) * dv + column];
        }
        state[e] = value;
        e += units;
    }
    sync_cube();

    for step in 0..chunks {
        let n = if backward { chunks - 1 - step } else { step };
        let chunk = head * chunks + n;

        // The state this chunk is entered with.
        store_columns(&state, states, chunk, first_column, dv, dk);

        // c = base ∓ R S, one (position, column) per unit.
        let mut e = unit;
        while e < size * TILE {
            let position = e / TILE;
            let offset = e % TILE;
            let column = first_column + offset;
            let row = (chunk * size + position) * dk;
            let mut read = 0.0f32;
            for k in 0..dk {
                read += reads[row + k] * state[k * TILE + offset];
            }
            let mut value = 0.0f32;
            if column < dv {
                let at = (chunk * size + position) * dv + column;
                if backward {
                    value = base[at] + read;
                } else {
                    value = base[at] - read;
                }
                corrections[at] = value;
            }
            correction[e] = value;
            e += units;
        }
        sync_cube();

        // S ← a S (+ extra) ± Qᵀ c, one state entry per unit.
        let a = decay[chunk];
        let mut e = unit;
        while e < dk * TILE {
            let k = e / TILE;
            let offset = e % TILE;
            let column = first_column + offset;
            let mut written = 0.0f32;
            for position in 0..size {
                written += writes[(chunk * size + position) * dk + k] * correction[position * TILE + offset];
            }
            let mut next = a * state[e];
            if has_extra {
                if column < dv {
                    next += extra[(chunk * dk + k) * dv + column];
                }
            }
            if backward {
                next -= written;
            } else {
                next += written;
            }
            state[e] = next;
            e += units;
        }
        sync_cube();
    }

    store_columns(&state, last, head, first_column, dv, dk);
}

/// The cube's columns of its state into matrix `matrix` of `out` (`[.., dk, dv]`).
#[cube]
fn store_columns(
    state: &SharedMemory<f32>,
    out: &mut Tensor<f32>,
    matrix: usize,
    first_column: usize,
    dv: usize,
    #[comptime] dk: usize,
) {
    let mut e = UNIT_POS_X as usize;
    while e < dk * TILE {
        let column = first_column + e % TILE;
        if column < dv {
            out[(matrix * dk + e / TILE) * dv + column] = state[e];
        }
        e += CUBE_DIM_X as usize;
    }
}

/// The scan as a backend primitive: the inputs of a `ChunkRecurrence` (`extra` absent forwards), returning
/// `[states, corrections, last]`.
pub trait ChunkScanKernel: Backend {
    fn chunk_scan(inputs: ScanPrimitives<Self>, direction: Direction) -> [FloatTensor<Self>; 3];
}

/// A `ChunkRecurrence`'s tensors as backend primitives.
pub struct ScanPrimitives<B: Backend> {
    pub reads: FloatTensor<B>,
    pub base: FloatTensor<B>,
    pub writes: FloatTensor<B>,
    pub decay: FloatTensor<B>,
    pub extra: Option<FloatTensor<B>>,
    pub initial: FloatTensor<B>,
}

/// `ModelBackend::chunk_recurrence` on a CubeCL backend: the scan in one kernel launch.
pub fn chunk_recurrence<B: ChunkScanKernel>(rec: ChunkRecurrence<B>) -> RecurrenceOut<B> {
    let primitive = |t: BurnTensor<B, 5>| t.into_primitive().tensor();
    let inputs = ScanPrimitives {
        reads: primitive(rec.reads),
        base: primitive(rec.base),
        writes: primitive(rec.writes),
        decay: rec.decay.into_primitive().tensor(),
        extra: rec.extra.map(primitive),
        initial: rec.initial.into_primitive().tensor(),
    };
    let [states, corrections, last] = B::chunk_scan(inputs, rec.direction);
    RecurrenceOut { states: float_tensor(states), corrections: float_tensor(corrections), last: float_tensor(last) }
}

/// The output shapes `[states, corrections, last]` for `reads` `[b, h, n, c, dk]` and `base` `[.., dv]`.
fn output_shapes(reads: &Shape, base: &Shape) -> [Shape; 3] {
    let [b, h, n, c, dk] = reads.dims::<5>();
    let dv = base.dims::<5>()[4];
    [Shape::new([b, h, n, dk, dv]), Shape::new([b, h, n, c, dv]), Shape::new([b, h, dk, dv])]
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> ChunkScanKernel for CubeBackend<R, F, I, BT> {
    fn chunk_scan(inputs: ScanPrimitives<Self>, direction: Direction) -> [FloatTensor<Self>; 3] {
        let ScanPrimitives { reads, base, writes, decay, extra, initial } = inputs;
        let named = [("reads", &reads), ("base", &base), ("writes", &writes), ("decay", &decay), ("initial", &initial)];
        for (name, t) in named.into_iter().chain(extra.as_ref().map(|t| ("extra", t))) {
            assert_eq!(t.dtype, DType::F32, "the chunk scan runs in f32; its {name} tensor is {:?}", t.dtype);
        }
        let [b, h, chunks, size, dk] = reads.shape().dims::<5>();
        let dv = base.shape().dims::<5>()[4];
        let shapes = output_shapes(&reads.shape(), &base.shape());
        let (client, device) = (reads.client.clone(), reads.device.clone());
        let [states, corrections, last] =
            shapes.map(|shape| empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), shape, DType::F32));
        let has_extra = extra.is_some();
        // Never read without `has_extra`; its own buffer, as a binding may not alias an output's.
        let extra = extra.unwrap_or_else(|| {
            empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), [1].into(), DType::F32)
        });
        let columns = dv.div_ceil(TILE) as u32;
        chunk_recurrence_kernel::launch::<R>(
            &client,
            CubeCount::Static(columns, (b * h) as u32, 1),
            CubeDim::new_1d(UNITS),
            into_contiguous(reads).into_tensor_arg(),
            into_contiguous(base).into_tensor_arg(),
            into_contiguous(writes).into_tensor_arg(),
            into_contiguous(decay).into_tensor_arg(),
            into_contiguous(extra).into_tensor_arg(),
            into_contiguous(initial).into_tensor_arg(),
            states.clone().into_tensor_arg(),
            corrections.clone().into_tensor_arg(),
            last.clone().into_tensor_arg(),
            chunks as u32,
            dv as u32,
            dk,
            size,
            direction == Direction::Backward,
            has_extra,
            super::REVISION,
        );
        [states, corrections, last]
    }
}

/// The kernel as one custom operation of burn-fusion's stream: fusion runs it on the backend under it.
#[derive(Debug, Clone)]
struct FusedChunkScan<B> {
    desc: CustomOpIr,
    direction: Direction,
    _backend: std::marker::PhantomData<B>,
}

impl<B: FusionBackend + ChunkScanKernel> Operation<B::FusionRuntime> for FusedChunkScan<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let mut get = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
        let primitives = ScanPrimitives {
            reads: get(0),
            base: get(1),
            writes: get(2),
            decay: get(3),
            initial: get(4),
            extra: (inputs.len() > 5).then(|| get(5)),
        };
        let results = B::chunk_scan(primitives, self.direction);
        register_float_outputs::<B>(handles, outputs, results);
    }
}

impl<B: FusionBackend + ChunkScanKernel> ChunkScanKernel for Fusion<B> {
    fn chunk_scan(inputs: ScanPrimitives<Self>, direction: Direction) -> [FloatTensor<Self>; 3] {
        let ScanPrimitives { reads, base, writes, decay, extra, initial } = inputs;
        let shapes = output_shapes(&reads.shape(), &base.shape()).map(|shape| (shape, DType::F32));
        let mut tensors = vec![reads, base, writes, decay, initial];
        tensors.extend(extra);
        outputs(register_custom::<B, _>("kiln_chunk_scan", tensors, &shapes, |desc| FusedChunkScan::<B> {
            desc,
            direction,
            _backend: std::marker::PhantomData,
        }))
    }
}

/// The launches CUDA makes (`cuda_source`): Qwen3.5's key width 128 and the tiny model's 16 in chunks of 64,
/// both directions, with and without the extra term.
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, settings, tensor};
    let mut variants = Vec::new();
    for dk in [128, 16] {
        for backward in [false, true] {
            for has_extra in [false, true] {
                variants.push(Variant::new(
                    format!("chunk recurrence dk {dk}, backward {backward}, extra {has_extra}"),
                    chunk_recurrence_kernel::ChunkRecurrenceKernel::<Runtime>::new(
                        settings(UNITS),
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
                        (),
                        (),
                        dk,
                        64,
                        backward,
                        has_extra,
                        super::REVISION,
                    ),
                ));
            }
        }
    }
    variants
}
