//! The softmax rows of the chunked attention (`attention::chunked_attention`) as CubeCL kernels, for burn's
//! CubeCL backends (CUDA, Vulkan) with and without burn-fusion; the matmuls around them stay burn's.
//!
//! As tensor ops, a chunk's scores `[batch, kv_heads, len · group, keys]` pass through device memory about
//! a dozen times per step in f32: cast and scale, the additive document mask, the max, `exp`, the sum, the
//! probabilities, then again in the backward pass (burn's reductions do not fuse a broadcast operand, so each
//! intermediate is written out). At sequence 4096 that is a gigabyte per attention layer and pass. Here the
//! forward reads each row of `q kᵀ` once in the inputs' dtype and writes its probabilities and log-sum-exp;
//! the backward reads `q kᵀ` and `dO Vᵀ` once and writes the probabilities and the scores' gradient. The mask
//! is not a tensor: a key is seen when it is not in the query's future, lies within its window (sliding-window
//! layers) and carries the query's document id.
//!
//! One cube per score row; its units stride over the keys. `attention::softmax_rows` and
//! `attention::score_grads` are the references they are tested against (tests/vulkan_backend.rs).
//!
//! The backward pass's third kernel adds each chunk's key and value gradients into the whole sequence's in
//! place, both in one launch (`attention::add_key_grads`, its reference: a slice, an addition and a slice
//! write each, four kernels a chunk).

// cubecl's prelude has its own `Tensor` (a kernel argument): burn's is `BurnTensor` here.
use burn::tensor::Tensor as BurnTensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::stream::Operation;
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, TensorIr};
use cubecl::prelude::*;

use super::{
    LOWEST, cube_log_sum_exp, exp_sum_add, float_tensor, grid_row, outputs, register_custom, register_float_outputs,
    row_grid, writable,
};
use crate::models::attention::{ChunkRows, DocumentAttention};

/// Units per cube (one score row): a power of two, for the tree reduction.
const UNITS: u32 = 128;

/// What both kernels know of their chunk: `rows` score rows of `keys` keys, `len` queries from `start`,
/// each query's `group` heads in consecutive rows (each batch row holds `rows_per_batch` = kv heads × len ×
/// group rows, of sequences of `seq` tokens), keys from `first`, the most keys a query sees (`u32::MAX`: no
/// window), and the scores' scale.
#[derive(CubeLaunch, CubeType)]
struct ChunkArgs {
    rows: u32,
    keys: u32,
    len: u32,
    group: u32,
    rows_per_batch: u32,
    seq: u32,
    start: u32,
    first: u32,
    window: u32,
    scale: f32,
}

/// Where a cube's score row sits: its index among the chunk's rows, the offset of its batch row in the
/// document ids, its query's position, the last key index it may see (its own position; later keys are
/// future), and its index among the whole sequence's query rows (`[batch, kv_heads, seq · group]`, where
/// the backward pass reads its log-sum-exp and `δ`).
#[derive(CubeType)]
struct RowPlace {
    row: usize,
    batch_offset: usize,
    query: usize,
    last_key: usize,
    sequence_row: usize,
}

/// The running cube's row (`kernels::row_grid`) in the chunk.
#[cube]
fn row_place(args: &ChunkArgs) -> RowPlace {
    let row = grid_row();
    let group = args.group as usize;
    let head_rows = args.len as usize * group;
    let query = args.start as usize + row % head_rows / group;
    RowPlace {
        row,
        batch_offset: row / args.rows_per_batch as usize * args.seq as usize,
        query,
        last_key: query - args.first as usize,
        sequence_row: row / head_rows * args.seq as usize * group + args.start as usize * group + row % head_rows,
    }
}

/// Whether key index `key` (position `first + key`) is one the row's query sees: not in its future (the
/// caller's bound, `key <= last_key`), within its window and of the query's document.
#[cube]
fn sees<I: Numeric>(docs: &Tensor<I>, place: &RowPlace, args: &ChunkArgs, key: usize) -> bool {
    place.last_key - key < args.window as usize
        && docs[place.batch_offset + args.first as usize + key] == docs[place.batch_offset + place.query]
}

/// Forward: `probs[row, j] = exp(S[row, j]·scale − lse[row])` over the keys the row's query sees (0
/// elsewhere), `lse[row] = log Σ exp(S·scale)` over them, in f32 from `scores` in `F`; `lse` is the whole
/// sequence's, written at the row's place in it (`RowPlace::sequence_row`).
#[cube(launch)]
fn softmax_rows_kernel<F: Float, I: Numeric>(
    scores: &Tensor<F>,
    docs: &Tensor<I>,
    probs: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    args: ChunkArgs,
    #[comptime] _revision: u64,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let place = row_place(&args);
    // Whole cubes leave: the row is the cube's, so no unit waits at a barrier another has left.
    if place.row >= args.rows as usize {
        terminate!();
    }
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let base = place.row * args.keys as usize;

    // Each unit's running maximum and sum of exponentials over its keys, then the cube's.
    let mut max = f32::new(LOWEST);
    let mut sum = 0.0f32;
    let mut key = unit;
    while key <= place.last_key {
        if sees::<I>(docs, &place, &args, key) {
            exp_sum_add(&mut max, &mut sum, f32::cast_from(scores[base + key]) * args.scale);
        }
        key += units;
    }
    let log_sum = cube_log_sum_exp(max, sum, UNITS as usize);
    if unit == 0 {
        lse[place.sequence_row] = log_sum;
    }

    let mut key = unit;
    while key < args.keys as usize {
        let mut p = 0.0f32;
        // `key < keys` keeps the document id read in bounds whether or not `&&` short-circuits here.
        if key <= place.last_key && sees::<I>(docs, &place, &args, key) {
            p = (f32::cast_from(scores[base + key]) * args.scale - log_sum).exp();
        }
        probs[base + key] = F::cast_from(p);
        key += units;
    }
}

/// Backward: `probs = exp(S·scale − lse)` (0 where unseen) and `grad_scores = probs · (dP − δ) · scale`, per
/// element in f32, written in `F`; `lse` and `δ` are the whole sequence's (`RowPlace::sequence_row`).
#[cube(launch)]
fn score_grads_kernel<F: Float, I: Numeric>(
    scores: &Tensor<F>,
    grad_probs: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    docs: &Tensor<I>,
    probs: &mut Tensor<F>,
    grad_scores: &mut Tensor<F>,
    args: ChunkArgs,
    #[comptime] _revision: u64,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let place = row_place(&args);
    if place.row >= args.rows as usize {
        terminate!();
    }
    let base = place.row * args.keys as usize;
    let log_sum = lse[place.sequence_row];
    let row_delta = delta[place.sequence_row];
    let mut key = UNIT_POS_X as usize;
    while key < args.keys as usize {
        let at = base + key;
        let mut p = 0.0f32;
        // `key < keys` keeps the document id read in bounds whether or not `&&` short-circuits here.
        if key <= place.last_key && sees::<I>(docs, &place, &args, key) {
            p = (f32::cast_from(scores[at]) * args.scale - log_sum).exp();
        }
        probs[at] = F::cast_from(p);
        grad_scores[at] = F::cast_from(p * (f32::cast_from(grad_probs[at]) - row_delta) * args.scale);
        key += CUBE_DIM_X as usize;
    }
}

/// Backward: a chunk's key and value gradients added into the whole sequence's, in place and in f32:
/// `grad_k[b, h, first + j, c] += part_k[b, h, j, c]`, the same for `v`; a unit an element of the part, whose
/// `[batch · kv_heads]` heads hold `part_head` elements each, the whole's `whole_head` from `offset`.
#[cube(launch)]
fn add_key_grads_kernel<F: Float>(
    grad_k: &mut Tensor<f32>,
    grad_v: &mut Tensor<f32>,
    part_k: &Tensor<F>,
    part_v: &Tensor<F>,
    part_head: u32,
    whole_head: u32,
    offset: u32,
    #[comptime] _revision: u64,
    #[define(F)] _dtype: StorageType,
) {
    let at = grid_row() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if at < part_k.len() {
        let part_head = part_head as usize;
        let whole = at / part_head * whole_head as usize + offset as usize + at % part_head;
        grad_k[whole] += f32::cast_from(part_k[at]);
        grad_v[whole] += f32::cast_from(part_v[at]);
    }
}

/// The kernels as backend primitives: `attention_probs` returns `[probs, lse]`, `score_grads`
/// `[probs, grad_scores]` (shapes and meaning as `ModelBackend::attention_probs` and `attention_score_grads`).
pub trait AttentionRowKernels: Backend {
    fn attention_probs(
        scores: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        docs: IntTensor<Self>,
        rows: ChunkRows,
    ) -> [FloatTensor<Self>; 2];

    fn score_grads(inputs: ScoreGradInputs<Self>, rows: ChunkRows) -> [FloatTensor<Self>; 2];

    /// `[grad_k, grad_v]` with `parts` added at keys `first..` (`ModelBackend::attention_add_key_grads`).
    fn add_key_grads(
        grads: [FloatTensor<Self>; 2],
        parts: [FloatTensor<Self>; 2],
        first: usize,
    ) -> [FloatTensor<Self>; 2];
}

/// `score_grads`' tensors as backend primitives.
pub struct ScoreGradInputs<B: Backend> {
    pub scores: FloatTensor<B>,
    pub grad_probs: FloatTensor<B>,
    pub lse: FloatTensor<B>,
    pub delta: FloatTensor<B>,
    pub docs: IntTensor<B>,
}

/// `ModelBackend::attention_probs` on a CubeCL backend: one kernel launch, the log-sum-exp written into the
/// whole sequence's in place where its buffer is held nowhere else.
pub fn attention_probs<B: AttentionRowKernels>(
    scores: BurnTensor<B, 4>,
    lse: BurnTensor<B, 4>,
    docs: &DocumentAttention<B>,
    rows: ChunkRows,
) -> [BurnTensor<B, 4>; 2] {
    let ids = docs.ids().clone().into_primitive();
    B::attention_probs(scores.into_primitive().tensor(), lse.into_primitive().tensor(), ids, rows).map(float_tensor)
}

/// `ModelBackend::attention_score_grads` on a CubeCL backend: one kernel launch.
pub fn attention_score_grads<B: AttentionRowKernels>(
    [scores, grad_probs, lse, delta]: [BurnTensor<B, 4>; 4],
    docs: &DocumentAttention<B>,
    rows: ChunkRows,
) -> [BurnTensor<B, 4>; 2] {
    let primitive = |t: BurnTensor<B, 4>| t.into_primitive().tensor();
    let inputs = ScoreGradInputs {
        scores: primitive(scores),
        grad_probs: primitive(grad_probs),
        lse: primitive(lse),
        delta: primitive(delta),
        docs: docs.ids().clone().into_primitive(),
    };
    B::score_grads(inputs, rows).map(float_tensor)
}

/// `ModelBackend::attention_add_key_grads` on a CubeCL backend: one kernel launch for both, in place where the
/// gradients' buffers are held nowhere else.
pub fn attention_add_key_grads<B: AttentionRowKernels>(
    grads: [BurnTensor<B, 4>; 2],
    parts: [BurnTensor<B, 4>; 2],
    first: usize,
) -> [BurnTensor<B, 4>; 2] {
    let primitive = |t: BurnTensor<B, 4>| t.into_primitive().tensor();
    B::add_key_grads(grads.map(primitive), parts.map(primitive), first).map(float_tensor)
}

/// Units per cube of the element-wise `add_key_grads_kernel`.
const ADD_UNITS: u32 = 256;

/// The grid and `ChunkArgs` of a chunk, from the scores' shape and the document ids'.
fn chunk_launch<R: Runtime>(scores: &Shape, docs: &Shape, chunk: ChunkRows) -> (CubeCount, ChunkArgsLaunch<R>) {
    let [batch, kv_heads, group_rows, keys] = scores.dims::<4>();
    let seq = docs.dims::<2>()[1];
    assert_eq!(keys, chunk.keys(), "the attention chunk's scores span its keys");
    assert_eq!(group_rows, chunk.len * chunk.group, "the attention chunk's scores hold a row per query and head");
    let rows = batch * kv_heads * group_rows;
    let narrow = |n: usize| u32::try_from(n).expect("attention chunk sizes fit in u32");
    let args = ChunkArgsLaunch::new(
        narrow(rows),
        narrow(keys),
        narrow(chunk.len),
        narrow(chunk.group),
        narrow(kv_heads * group_rows),
        narrow(seq),
        narrow(chunk.start),
        narrow(chunk.first),
        chunk.window.map_or(u32::MAX, narrow),
        chunk.scale as f32,
    );
    (row_grid(rows), args)
}

/// The whole sequence's `what` per query row, `[batch, kv_heads, seq · group, 1]` in f32, for chunk rows
/// of `scores`' shape.
fn f32_per_row<R: CubeRuntime>(
    t: CubeTensor<R>,
    scores: &Shape,
    seq: usize,
    rows: ChunkRows,
    what: &str,
) -> CubeTensor<R> {
    assert_eq!(t.dtype, DType::F32, "the attention kernels take the {what} in f32, not {:?}", t.dtype);
    let [batch, kv_heads, ..] = scores.dims::<4>();
    let expected = Shape::new([batch, kv_heads, seq * rows.group, 1]);
    assert_eq!(t.shape(), expected, "the attention kernels take the whole sequence's {what}");
    into_contiguous(t)
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> AttentionRowKernels for CubeBackend<R, F, I, BT> {
    fn attention_probs(
        scores: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        docs: IntTensor<Self>,
        rows: ChunkRows,
    ) -> [FloatTensor<Self>; 2] {
        let (count, args) = chunk_launch::<R>(&scores.shape(), &docs.shape(), rows);
        let seq = docs.shape().dims::<2>()[1];
        let lse = writable(f32_per_row(lse, &scores.shape(), seq, rows, "log-sum-exp"));
        let (client, device, dtype) = (scores.client.clone(), scores.device.clone(), scores.dtype);
        let probs = empty_device_contiguous_dtype::<R>(client.clone(), device, scores.shape(), dtype);
        let doc_dtype = docs.dtype;
        softmax_rows_kernel::launch::<R>(
            &client,
            count,
            CubeDim::new_1d(UNITS),
            into_contiguous(scores).into_tensor_arg(),
            into_contiguous(docs).into_tensor_arg(),
            probs.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            args,
            super::REVISION,
            [dtype.into(), doc_dtype.into()],
        );
        [probs, lse]
    }

    fn score_grads(inputs: ScoreGradInputs<Self>, rows: ChunkRows) -> [FloatTensor<Self>; 2] {
        let ScoreGradInputs { scores, grad_probs, lse, delta, docs } = inputs;
        let (count, args) = chunk_launch::<R>(&scores.shape(), &docs.shape(), rows);
        let (shape, seq) = (scores.shape(), docs.shape().dims::<2>()[1]);
        assert_eq!(grad_probs.dtype, scores.dtype, "the attention kernels take dP in the scores' dtype");
        let (client, device, dtype) = (scores.client.clone(), scores.device.clone(), scores.dtype);
        let [probs, grad_scores] =
            [0, 1].map(|_| empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), scores.shape(), dtype));
        let doc_dtype = docs.dtype;
        score_grads_kernel::launch::<R>(
            &client,
            count,
            CubeDim::new_1d(UNITS),
            into_contiguous(scores).into_tensor_arg(),
            into_contiguous(grad_probs).into_tensor_arg(),
            f32_per_row(lse, &shape, seq, rows, "log-sum-exp").into_tensor_arg(),
            f32_per_row(delta, &shape, seq, rows, "rowsum(dO ⊙ O)").into_tensor_arg(),
            into_contiguous(docs).into_tensor_arg(),
            probs.clone().into_tensor_arg(),
            grad_scores.clone().into_tensor_arg(),
            args,
            super::REVISION,
            [dtype.into(), doc_dtype.into()],
        );
        [probs, grad_scores]
    }

    fn add_key_grads(
        grads: [FloatTensor<Self>; 2],
        parts: [FloatTensor<Self>; 2],
        first: usize,
    ) -> [FloatTensor<Self>; 2] {
        let [grad_k, grad_v] = grads.map(writable);
        let [part_k, part_v] = parts.map(into_contiguous);
        let whole = grad_k.shape();
        let [batch, kv_heads, seq, d] = whole.dims::<4>();
        let [.., keys, part_d] = part_k.shape().dims::<4>();
        assert!(
            grad_v.shape() == whole && part_v.shape() == part_k.shape() && grad_k.dtype == DType::F32,
            "the attention's key and value gradients: f32 [{batch}, {kv_heads}, {seq}, {d}] and parts alike"
        );
        assert!(
            part_d == d && first + keys <= seq,
            "a chunk's keys {first}..{} past the sequence's {seq}",
            first + keys
        );
        assert_eq!(part_v.dtype, part_k.dtype, "the chunk's key and value gradients in one dtype");
        let narrow = |n: usize| u32::try_from(n).expect("attention gradient sizes fit in u32");
        let elements = batch * kv_heads * keys * d;
        let (client, dtype) = (grad_k.client.clone(), part_k.dtype);
        add_key_grads_kernel::launch::<R>(
            &client,
            row_grid(elements.div_ceil(ADD_UNITS as usize)),
            CubeDim::new_1d(ADD_UNITS),
            grad_k.clone().into_tensor_arg(),
            grad_v.clone().into_tensor_arg(),
            part_k.into_tensor_arg(),
            part_v.into_tensor_arg(),
            narrow(keys * d),
            narrow(seq * d),
            narrow(first * d),
            super::REVISION,
            dtype.into(),
        );
        [grad_k, grad_v]
    }
}

/// Which kernel a fused custom operation runs, with what it knows of its chunk.
#[derive(Debug, Clone, Copy)]
enum AttentionKernel {
    /// On `[scores, lse, docs]`.
    Probs(ChunkRows),
    /// On `[scores, grad_probs, lse, delta, docs]`.
    ScoreGrads(ChunkRows),
    /// On `[grad_k, grad_v, part_k, part_v]`, the parts' first key.
    AddKeyGrads(usize),
}

impl AttentionKernel {
    fn name(self) -> &'static str {
        match self {
            AttentionKernel::Probs(_) => "kiln_attention_probs",
            AttentionKernel::ScoreGrads(_) => "kiln_attention_score_grads",
            AttentionKernel::AddKeyGrads(_) => "kiln_attention_add_key_grads",
        }
    }
}

/// A kernel as one custom operation of burn-fusion's stream: fusion runs it on the backend under it. An
/// input's last use hands its buffer over, so what a kernel writes in place (the log-sum-exp, the key and
/// value sums) is written there; an earlier use gets a copy.
#[derive(Debug, Clone)]
struct FusedAttentionKernel<B> {
    desc: CustomOpIr,
    kernel: AttentionKernel,
    _backend: std::marker::PhantomData<B>,
}

impl<B: FusionBackend + AttentionRowKernels> Operation<B::FusionRuntime> for FusedAttentionKernel<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let results = match self.kernel {
            AttentionKernel::Probs(rows) => {
                let [scores, lse] = first_floats::<B, 2>(handles, inputs);
                B::attention_probs(scores, lse, last_ints::<B>(handles, inputs), rows)
            }
            AttentionKernel::ScoreGrads(rows) => {
                let [scores, grad_probs, lse, delta] = first_floats::<B, 4>(handles, inputs);
                let docs = last_ints::<B>(handles, inputs);
                B::score_grads(ScoreGradInputs { scores, grad_probs, lse, delta, docs }, rows)
            }
            AttentionKernel::AddKeyGrads(first) => {
                let [grad_k, grad_v, part_k, part_v] = first_floats::<B, 4>(handles, inputs);
                B::add_key_grads([grad_k, grad_v], [part_k, part_v], first)
            }
        };
        register_float_outputs::<B>(handles, outputs, results);
    }
}

type FusionHandles<B> = HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// A custom operation's first `N` inputs, floats.
fn first_floats<B: FusionBackend, const N: usize>(
    handles: &mut FusionHandles<B>,
    inputs: &[TensorIr],
) -> [FloatTensor<B>; N] {
    std::array::from_fn(|i| handles.get_float_tensor::<B>(&inputs[i]))
}

/// A custom operation's last input, the document ids.
fn last_ints<B: FusionBackend>(handles: &mut FusionHandles<B>, inputs: &[TensorIr]) -> IntTensor<B> {
    handles.get_int_tensor::<B>(&inputs[inputs.len() - 1])
}

/// Registers `kernel` on `floats` (and then `docs`, where it reads them) in burn-fusion's stream.
fn register_kernel<B: FusionBackend + AttentionRowKernels>(
    kernel: AttentionKernel,
    floats: Vec<FloatTensor<Fusion<B>>>,
    docs: Option<IntTensor<Fusion<B>>>,
    shapes: [(Shape, DType); 2],
) -> [FloatTensor<Fusion<B>>; 2] {
    let inputs = floats.into_iter().chain(docs).collect();
    outputs(register_custom::<B, _>(kernel.name(), inputs, &shapes, |desc| FusedAttentionKernel::<B> {
        desc,
        kernel,
        _backend: std::marker::PhantomData,
    }))
}

impl<B: FusionBackend + AttentionRowKernels> AttentionRowKernels for Fusion<B> {
    fn attention_probs(
        scores: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        docs: IntTensor<Self>,
        rows: ChunkRows,
    ) -> [FloatTensor<Self>; 2] {
        let outputs = [(scores.shape(), scores.dtype()), (lse.shape(), DType::F32)];
        register_kernel::<B>(AttentionKernel::Probs(rows), vec![scores, lse], Some(docs), outputs)
    }

    fn score_grads(inputs: ScoreGradInputs<Self>, rows: ChunkRows) -> [FloatTensor<Self>; 2] {
        let ScoreGradInputs { scores, grad_probs, lse, delta, docs } = inputs;
        let (shape, dtype) = (scores.shape(), scores.dtype());
        let floats = vec![scores, grad_probs, lse, delta];
        register_kernel::<B>(
            AttentionKernel::ScoreGrads(rows),
            floats,
            Some(docs),
            [(shape.clone(), dtype), (shape, dtype)],
        )
    }

    fn add_key_grads(
        grads: [FloatTensor<Self>; 2],
        parts: [FloatTensor<Self>; 2],
        first: usize,
    ) -> [FloatTensor<Self>; 2] {
        let shapes = [0, 1].map(|i| (grads[i].shape(), grads[i].dtype()));
        let floats = grads.into_iter().chain(parts).collect();
        register_kernel::<B>(AttentionKernel::AddKeyGrads(first), floats, None, shapes)
    }
}

/// The launches CUDA makes (`cuda_source`): scores in f32 and bf16, document ids in i32.
#[cfg(all(test, feature = "vulkan"))]
pub(super) fn cuda_variants(client: &super::cuda_source::Client) -> Vec<super::cuda_source::Variant> {
    use super::cuda_source::{Runtime, Variant, settings, tensor};
    let args = || ChunkArgsCompilationArg {
        rows: (),
        keys: (),
        len: (),
        group: (),
        rows_per_batch: (),
        seq: (),
        start: (),
        first: (),
        window: (),
        scale: (),
    };
    let mut variants = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        variants.push(Variant::new(
            format!("attention key and value gradients {dtype:?}"),
            add_key_grads_kernel::AddKeyGradsKernel::<Runtime>::new(
                settings(ADD_UNITS),
                client.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                super::REVISION,
                dtype.into(),
            ),
        ));
        let dtypes = [dtype.into(), DType::I32.into()];
        variants.push(Variant::new(
            format!("attention softmax rows {dtype:?}"),
            softmax_rows_kernel::SoftmaxRowsKernel::<Runtime>::new(
                settings(UNITS),
                client.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                args(),
                super::REVISION,
                dtypes,
            ),
        ));
        variants.push(Variant::new(
            format!("attention score grads {dtype:?}"),
            score_grads_kernel::ScoreGradsKernel::<Runtime>::new(
                settings(UNITS),
                client.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                args(),
                super::REVISION,
                dtypes,
            ),
        ));
    }
    variants
}
