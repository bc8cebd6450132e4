//! The model ops that go through the backend (`ModelBackend`), so that autodiff backends record each as one
//! op with a backward pass written by hand instead of burn's composition, which keeps every intermediate:
//! full-sequence attention (`attention`: no `[heads, seq, seq]` scores kept), a gated MLP's gate
//! `act(gate) · up`, SwiGLU's or GeGLU's (keeps its two inputs instead of also every intermediate of the
//! activation: `σ(gate)` and `silu(gate)`, or GELU's cube, tanh and sums), the RMSNorms
//! (keep the input and weight instead of an f32 copy of the input and the normalized rows; the statistics
//! are recomputed in the backward pass), the causal depthwise convolution (keeps its input instead of each
//! lag's shifted and masked copies; the CubeCL backends run it as kernels, `kernels::conv`), LFM2's gated
//! convolution `C ⊙ conv(B ⊙ x)` (keeps the projection alone, not `B ⊙ x` and the conv's output; one kernel
//! each way on the CubeCL backends, gates included), the L2 norm of
//! Qwen3.5's q and k (keeps its input, not an f32 copy), RoPE (keeps the tables alone; its gradient
//! `grad·cos + (grad·sin)[swap]` gathers where burn's scatters into zeros), the MoE's grouped expert matmul (one weight
//! gradient for all experts instead of a full-size one per expert slice), Qwen3.5's gated delta rule (`deltanet`: the
//! inputs and chunk states kept, the chunk solve recomputed), the split of a fused projection into its
//! parts (`split_last`: one gradient for the whole projection, each part written into it, instead of one
//! zero-filled full-size gradient per part, summed) and the projections themselves (`projection`: the weight
//! gradient as one matmul over all rows, `xᵀ·g`, where burn's `linear` takes one per batch row and sums them:
//! a `[batch, in, out]` tensor, and a reduction kernel a projection even at batch 1). The ops cheap to run
//! again carry their forward pass for activation checkpointing (`record_recomputable`), which recomputes a
//! layer from its kept input (`ModelBackend::layer_output`). Plain backends run the same forward without a
//! graph. `set_reference_ops` switches autodiff backends back to burn's compositions
//! on the thread that records the graph: the A/B switch for measuring what the ops buy, or for ruling them
//! out when a run misbehaves.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::activation::{sigmoid, silu, tanh};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Tensor, TensorMetadata, TensorPrimitive};

use super::attention::{
    AttentionForward, ChunkRows, DocumentAttention, add_key_grads, chunked_attention, chunked_attention_backward,
    scaled_softmax_attention, score_grads, softmax_rows_into, tracked_document_attention,
};
use super::deltanet::{
    self, ChunkPlan, ChunkRecurrence, ChunkedScan, DecayGradInputs, RecurrenceOut, ScanInputs, tracked_gated_delta_rule,
};
use super::experts::{grouped_matmul_backward, grouped_matmul_forward};
use super::layers::{
    ConvShifts, RopeTables, apply_rope, apply_rope_backward, causal_depthwise_conv, causal_depthwise_conv_backward,
    gated_conv, gated_conv_backward, l2_normalize, l2_normalize_backward,
};
use crate::backend::zeros_in;

thread_local! {
    static REFERENCE_OPS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// With `true`, autodiff backends record burn's plain compositions instead of the hand-written ops: one
/// softmax over the full `[seq, seq]` mask, `act(gate) · up`, the composed RMSNorms, L2 norms, RoPE and
/// convolution, one matmul per expert slice, the chunked delta rule as tensor ops, `narrow` per part of a
/// fused projection, and the cross-entropy of full logits (`train::linear_ce`). Same results to rounding;
/// more memory. Off by default. Per thread: the ops are chosen where the graph is recorded (the trainer's
/// thread), and a process that trains on several threads at once (the test harness) switches one run only.
pub fn set_reference_ops(on: bool) {
    REFERENCE_OPS.with(|flag| flag.set(on));
}

/// Whether `set_reference_ops(true)` is in force on this thread.
pub fn reference_ops() -> bool {
    REFERENCE_OPS.with(std::cell::Cell::get)
}

/// A backend the models run on.
pub trait ModelBackend: Backend {
    /// `softmax(q kᵀ / √d + causal same-document mask) v` for queries `[batch, heads, seq, d]` and keys,
    /// values `[batch, kv_heads, seq, d]` (each kv head serving `heads / kv_heads` consecutive query
    /// heads); returns `[batch, heads, seq, d]` in the queries' dtype. Exact, one chunk of queries at a
    /// time (`attention::chunked_attention`).
    fn document_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        docs: &DocumentAttention<Self>,
    ) -> Tensor<Self, 4> {
        Self::attention_forward(q, k, v, docs).out
    }

    /// `softmax(q kᵀ · scale + mask) v` over an additive mask `[batch, 1, seq, keys]` (cached decoding's
    /// attention over its cache; `attention::scaled_softmax_attention`, on the CPU in f32 `cpu_attention`).
    fn masked_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        mask: &Tensor<Self, 4>,
        scale: f64,
    ) -> Tensor<Self, 4> {
        scaled_softmax_attention(q, k, v, mask, scale)
    }

    /// Writes `rows [batch, heads, n, d]` into positions `at..at + n` of a decoding cache `[batch, heads,
    /// capacity, d]` and returns the cache: burn's `slice_assign`, which the CubeCL backends do in place when
    /// the cache's buffer is not shared (on the CPU in f32, `cpu_attention::write_cache_rows`).
    fn write_cache_rows(cache: Tensor<Self, 4>, at: usize, rows: Tensor<Self, 4>) -> Tensor<Self, 4> {
        write_cache_rows_composed(cache, at, rows)
    }

    /// `document_attention` with what its backward pass needs: the output and each query's log-sum-exp
    /// (`attention::chunked_attention`; the CPU backend in f32 runs `cpu_attention` instead).
    fn attention_forward(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        docs: &DocumentAttention<Self>,
    ) -> AttentionForward<Self> {
        chunked_attention(q, k, v, docs)
    }

    /// The gradients `(dq, dk, dv)` of `attention_forward` for the output gradient `grad_out`
    /// (`attention::chunked_attention_backward`; on the CPU in f32, `cpu_attention`).
    fn attention_backward(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        docs: &DocumentAttention<Self>,
        forward: AttentionForward<Self>,
        grad_out: Tensor<Self, 4>,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>, Tensor<Self, 4>) {
        chunked_attention_backward(q, k, v, docs, forward, grad_out)
    }

    /// One attention chunk's probabilities from its unscaled scores `q kᵀ` `[batch, kv_heads, len · group,
    /// keys]`: the softmax of `S/√d` over the keys each query may see, in the scores' dtype; and the whole
    /// sequence's log-sum-exp `lse` `[batch, kv_heads, seq · group, 1]` (f32) with the chunk's rows written
    /// (`attention::softmax_rows_into`; the CubeCL backends run one kernel, `kernels::attention`, which writes
    /// them in place).
    fn attention_probs(
        scores: Tensor<Self, 4>,
        lse: Tensor<Self, 4>,
        docs: &DocumentAttention<Self>,
        rows: ChunkRows,
    ) -> [Tensor<Self, 4>; 2] {
        softmax_rows_into(scores, lse, docs, rows)
    }

    /// The backward pass's probabilities and score gradients of one attention chunk, from the whole
    /// sequence's log-sum-exp and `δ` `[batch, kv_heads, seq · group, 1]` (`attention::score_grads`; the
    /// CubeCL backends run one kernel, `kernels::attention`).
    fn attention_score_grads(
        scores: Tensor<Self, 4>,
        grad_probs: Tensor<Self, 4>,
        lse: Tensor<Self, 4>,
        delta: Tensor<Self, 4>,
        docs: &DocumentAttention<Self>,
        rows: ChunkRows,
    ) -> [Tensor<Self, 4>; 2] {
        score_grads(scores, grad_probs, lse, delta, docs, rows)
    }

    /// The backward pass's key and value gradients of one attention chunk, `[batch, kv_heads, keys, d]` for keys
    /// `first..first + keys`, added into the whole sequence's `[batch, kv_heads, seq, d]` (f32): as tensor ops
    /// (`attention::add_key_grads`) a slice, an addition and a slice write each; the CubeCL backends run one
    /// kernel for both, in place (`kernels::attention`).
    fn attention_add_key_grads(
        grads: [Tensor<Self, 4>; 2],
        parts: [Tensor<Self, 4>; 2],
        first: usize,
    ) -> [Tensor<Self, 4>; 2] {
        add_key_grads(grads, parts, first)
    }

    /// `x · weight` over the last dimension of `x` for a weight `[in, out]`: a projection without its bias, as
    /// burn's `linear` computes it (on CUDA with `KILN_MATMUL=cublas`, one cuBLAS product over all rows,
    /// `kernels::cublas`).
    fn projection<const D: usize>(x: Tensor<Self, D>, weight: Tensor<Self, 2>) -> Tensor<Self, D> {
        burn::tensor::module::linear(x, weight, None)
    }

    /// `v` `[n]` repeated along the leading dimensions of `dims` (whose last is `n`): a bias or a per-channel
    /// parameter meeting every row. As one autodiff op its gradient is the output gradient's `column_sums`,
    /// folded, where burn's broadcast backward reduces each leading dimension with one `sum_dim`: on CUDA
    /// without burn's autotune that is a thread per 4 channels reading every row (Qwen3.5's `dt_bias` and
    /// `A_log`: 4 threads over 4096 rows each, twice a DeltaNet layer).
    fn broadcast_rows<const D: usize>(v: Tensor<Self, 1>, dims: [usize; D]) -> Tensor<Self, D> {
        v.unsqueeze::<D>().expand(dims)
    }

    /// `lhs · rhs` over the last two dimensions, batch dimensions broadcast, as burn's `matmul` computes it:
    /// the products inside the ops (the projections' gradients, the attention's chunks, the loss's head, the
    /// MoE's experts). On CUDA with `KILN_MATMUL=cublas`, cuBLAS computes them (`kernels::cublas`).
    fn matmul<const D: usize>(lhs: Tensor<Self, D>, rhs: Tensor<Self, D>) -> Tensor<Self, D> {
        lhs.matmul(rhs)
    }

    /// A gated MLP's gate `act(gate) · up` (SwiGLU, GeGLU), in the inputs' dtype (`glu_forward`; the CPU
    /// backend in f32: one pass, `cpu_elementwise`).
    fn glu<const D: usize>(gate: Tensor<Self, D>, up: Tensor<Self, D>, act: GateActivation) -> Tensor<Self, D> {
        glu_forward(gate, up, act)
    }

    /// The gradients `(d gate, d up)` of `glu` for the output gradient `grad` (`glu_backward`).
    fn glu_grads<const D: usize>(
        gate: Tensor<Self, D>,
        up: Tensor<Self, D>,
        grad: Tensor<Self, D>,
        act: GateActivation,
    ) -> (Tensor<Self, D>, Tensor<Self, D>) {
        glu_backward(gate, up, grad, act)
    }

    /// RMSNorm over the last dimension as transformers computes it (`NormKind` says which form). The
    /// CubeCL backends run it as one kernel (`kernels::norm`).
    fn rms_norm<const D: usize>(
        x: Tensor<Self, D>,
        weight: Tensor<Self, 1>,
        eps: f64,
        kind: NormKind,
    ) -> Tensor<Self, D> {
        rms_norm_forward(x, weight, eps, kind)
    }

    /// The gradients of `rms_norm` with respect to `x` and `weight` for the output gradient `grad`
    /// (`rms_norm_backward`; the CubeCL backends' kernel, `kernels::norm`).
    fn rms_norm_grads<const D: usize>(
        x: Tensor<Self, D>,
        weight: Tensor<Self, 1>,
        eps: f64,
        kind: NormKind,
        grad: Tensor<Self, D>,
    ) -> (Tensor<Self, D>, Tensor<Self, 1>) {
        rms_norm_backward(x, weight, eps, kind, grad)
    }

    /// `x / sqrt(Σx² + eps)` over the last dimension, in f32 (`layers::l2_normalize`; Qwen3.5's DeltaNet
    /// q and k). The CubeCL backends run it as one kernel (`kernels::norm`).
    fn l2_norm<const D: usize>(x: Tensor<Self, D>, eps: f64) -> Tensor<Self, D> {
        l2_normalize(x, eps)
    }

    /// The gradient of `l2_norm` with respect to `x` for the output gradient `grad`
    /// (`layers::l2_normalize_backward`; the CubeCL backends' kernel, `kernels::norm`).
    fn l2_norm_grads<const D: usize>(x: Tensor<Self, D>, eps: f64, grad: Tensor<Self, D>) -> Tensor<Self, D> {
        l2_normalize_backward(x, eps, grad)
    }

    /// The causal depthwise convolution over each document (`layers::causal_depthwise_conv`; LFM2's short
    /// convolutions and Qwen3.5's DeltaNet conv).
    fn causal_conv(x: Tensor<Self, 3>, kernel: Tensor<Self, 2>, shifts: &ConvShifts<Self>) -> Tensor<Self, 3> {
        causal_depthwise_conv(x, kernel, shifts)
    }

    /// The gradients of `causal_conv` with respect to `x` and `kernel` for the output gradient `grad`
    /// (`layers::causal_depthwise_conv_backward`; the CubeCL backends' kernel, `kernels::conv`).
    fn causal_conv_grads(
        x: Tensor<Self, 3>,
        kernel: Tensor<Self, 2>,
        shifts: &ConvShifts<Self>,
        grad: Tensor<Self, 3>,
    ) -> (Tensor<Self, 3>, Tensor<Self, 2>) {
        causal_depthwise_conv_backward(x, kernel, shifts, grad)
    }

    /// LFM2's gated short convolution `C ⊙ conv(B ⊙ x)` on its in-projection `bcx` `[batch, seq, 3 · hidden]`
    /// (`B | C | x`): `layers::gated_conv` (the split, the products and `causal_conv`); the CubeCL backends'
    /// conv kernel applies both gates itself (`kernels::conv`). As one autodiff op it keeps `bcx` alone for
    /// the backward pass, not `B ⊙ x` and the conv's output as well.
    fn gated_conv(bcx: Tensor<Self, 3>, kernel: Tensor<Self, 2>, shifts: &ConvShifts<Self>) -> Tensor<Self, 3> {
        gated_conv(bcx, kernel, shifts)
    }

    /// The gradients of `gated_conv` with respect to `bcx` and `kernel` for the output gradient `grad`
    /// (`layers::gated_conv_backward`; the CubeCL backends' kernel writes `d B | d C | d x` at once).
    fn gated_conv_grads(
        bcx: Tensor<Self, 3>,
        kernel: Tensor<Self, 2>,
        shifts: &ConvShifts<Self>,
        grad: Tensor<Self, 3>,
    ) -> (Tensor<Self, 3>, Tensor<Self, 2>) {
        gated_conv_backward(bcx, kernel, shifts, grad)
    }

    /// Rows grouped by expert times each group's weights: `x` `[n, in]` holds `counts[e]` consecutive rows
    /// for expert `e`, `weights` is `[experts, in, out]`; returns `[n, out]` (the MoE's grouped matmul: a
    /// matmul per expert, `experts::grouped_matmul_forward`; the CubeCL backends batch the experts,
    /// `experts::batched_forward`).
    fn grouped_matmul(x: Tensor<Self, 2>, weights: Tensor<Self, 3>, counts: &[usize]) -> Tensor<Self, 2> {
        grouped_matmul_forward(x, weights, counts)
    }

    /// The gradients `(d x, d weights)` of `grouped_matmul` for the output gradient `grad`
    /// (`experts::grouped_matmul_backward`; the CubeCL backends batch the experts, `experts::batched_backward`).
    fn grouped_matmul_grads(
        x: Tensor<Self, 2>,
        weights: Tensor<Self, 3>,
        counts: &[usize],
        grad: Tensor<Self, 2>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 3>) {
        grouped_matmul_backward(x, weights, counts, grad)
    }

    /// The gated delta rule from an empty state over whole sequences (Qwen3.5's DeltaNet core in training
    /// and the full forward pass): outputs `[batch, heads, seq, dv]` in f32 (`delta_rule_scan`).
    fn gated_delta_rule(inputs: ScanInputs<Self>, plan: &ChunkPlan<Self>) -> Tensor<Self, 4> {
        Self::delta_rule_scan(inputs, plan, None).out
    }

    /// The gated delta rule from `initial` (a decoding cache's state; none: empty) with the state each chunk
    /// starts from, which the backward pass needs, and the last (`deltanet::chunked_scan`; the CPU backend in
    /// f32 runs `cpu_deltanet`'s token loops instead).
    fn delta_rule_scan(
        inputs: ScanInputs<Self>,
        plan: &ChunkPlan<Self>,
        initial: Option<Tensor<Self, 4>>,
    ) -> ChunkedScan<Self> {
        deltanet::chunked_scan(inputs, plan, initial)
    }

    /// The gradients of `delta_rule_scan`'s outputs for `grad_out`, as `ScanInputs` in the inputs' dtypes
    /// (`deltanet::chunked_backward`; on the CPU in f32, `cpu_deltanet`).
    fn delta_rule_backward(
        inputs: ScanInputs<Self>,
        plan: &ChunkPlan<Self>,
        chunk_states: Tensor<Self, 5>,
        grad_out: Tensor<Self, 4>,
    ) -> ScanInputs<Self> {
        deltanet::chunked_backward(inputs, plan, chunk_states, grad_out)
    }

    /// The per-position gradients of the log-decays and rates in the chunked form's backward pass
    /// (`deltanet::decay_grads`, tensor ops); the CubeCL backends run them as one kernel
    /// (`kernels::decay_grads`).
    fn delta_rule_decay_grads(inputs: DecayGradInputs<Self>, plan: &ChunkPlan<Self>) -> [Tensor<Self, 4>; 2] {
        deltanet::decay_grads(inputs, plan)
    }

    /// `(I + L)⁻¹` for every chunk's strictly lower `L` `[batch, heads, chunks, C, C]` in f32, the chunked
    /// form's triangular solve (`deltanet::unit_lower_inverse`, block doubling). The CubeCL backends solve
    /// by forward substitution in one kernel (`kernels::chunk_solve`).
    fn unit_lower_inverse(lower: Tensor<Self, 5>, plan: &ChunkPlan<Self>) -> Tensor<Self, 5> {
        deltanet::unit_lower_inverse(lower, plan)
    }

    /// The scan across chunks of the gated delta rule's chunked form, in either pass: the one sequential
    /// part of it, as tensor ops a chunk at a time (`deltanet::recurrence_by_chunk`). The CubeCL backends
    /// run it as one kernel (`kernels::scan`).
    fn chunk_recurrence(rec: ChunkRecurrence<Self>) -> RecurrenceOut<Self> {
        deltanet::recurrence_by_chunk(rec)
    }

    /// RoPE on `x` `[batch, heads, seq, head_dim]`: `x·cos + x[swap]·sin` (`layers::apply_rope`; the CPU
    /// backend in f32 makes one pass, `cpu_elementwise::rope`).
    fn rope(x: Tensor<Self, 4>, tables: &RopeTables<Self>) -> Tensor<Self, 4> {
        apply_rope(x, tables)
    }

    /// The gradient of `rope` for the output gradient `grad` (`layers::apply_rope_backward`).
    fn rope_grad(grad: Tensor<Self, 4>, tables: &RopeTables<Self>) -> Tensor<Self, 4> {
        apply_rope_backward(grad, tables)
    }

    /// One part's gradient `grad` added into its `range` of the split tensor's last dimension: into `whole`
    /// (the gradient the parts before it wrote), or into zeros of `dims` for the first (`split_last`'s
    /// backward pass, `add_part_composed`; on the CPU in f32 one pass, `cpu_elementwise::add_part`).
    fn add_part<const D: usize>(
        whole: Option<Tensor<Self, D>>,
        dims: [usize; D],
        range: std::ops::Range<usize>,
        grad: Tensor<Self, D>,
    ) -> Tensor<Self, D> {
        add_part_composed(whole, dims, range, grad)
    }

    /// `x` cut along its last dimension into consecutive parts of the given widths, which sum to it (a fused
    /// projection's parts: LFM2's B | C | x and experts' gate | up, Qwen3.5's q | k | v, per-head
    /// query | gate and the partial RoPE's rotated | passed dims). The CPU backend copies each part out
    /// contiguous (`cpu_elementwise::contiguous`): its element-wise ops walk a strided view element by element.
    fn split_last<const D: usize, const N: usize>(x: Tensor<Self, D>, widths: [usize; N]) -> [Tensor<Self, D>; N] {
        narrow_last(x, widths)
    }

    /// A layer's output, the residual stream `h` the next layer reads: itself. Under activation
    /// checkpointing the one tensor of a layer the backward pass keeps, from which it recomputes the
    /// layer's dropped activations (autodiff backends record a compute-bound identity: burn's balanced
    /// checkpointing keeps the outputs of compute-bound ops and recomputes memory-bound ones back to them).
    fn layer_output<const D: usize>(h: Tensor<Self, D>) -> Tensor<Self, D> {
        h
    }
}

/// `split_last` as burn composes it: one `narrow` per part.
pub fn narrow_last<B: Backend, const D: usize, const N: usize>(
    x: Tensor<B, D>,
    widths: [usize; N],
) -> [Tensor<B, D>; N] {
    part_ranges(widths, x.dims()[D - 1]).map(|range| x.clone().narrow(D - 1, range.start, range.len()))
}

/// `ModelBackend::add_part` as burn composes it: a zero-filled gradient with the part's slice assigned, or
/// the part's slice of `whole` plus `grad`, assigned back.
pub fn add_part_composed<B: Backend, const D: usize>(
    whole: Option<Tensor<B, D>>,
    dims: [usize; D],
    range: std::ops::Range<usize>,
    grad: Tensor<B, D>,
) -> Tensor<B, D> {
    let mut ranges = dims.map(|d| 0..d);
    ranges[D - 1] = range;
    match whole {
        None => zeros_in(dims, grad.dtype().into(), &grad.device()).slice_assign(ranges, grad),
        Some(whole) => {
            let sum = whole.clone().slice(ranges.clone()) + grad;
            whole.slice_assign(ranges, sum)
        }
    }
}

/// Where each part of `widths` lies along a dimension of size `total`, which they must cover.
fn part_ranges<const N: usize>(widths: [usize; N], total: usize) -> [std::ops::Range<usize>; N] {
    assert_eq!(widths.iter().sum::<usize>(), total, "the parts cover the split dimension");
    let mut start = 0;
    widths.map(|width| {
        start += width;
        start - width..start
    })
}

/// The three HF RMSNorms. All normalize in f32: `x̂ = x / sqrt(mean(x²) + eps)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// LFM2's `cast(x̂) · w` (the product in the weight's dtype when it is the input's, else in f32, as
    /// torch promotes an f32 weight).
    Plain,
    /// Qwen3.5's zero-centered `cast(x̂ · (1 + w))`, scaled in f32.
    ZeroCentered,
    /// Gemma 4's `cast(x̂ · w)`, scaled in f32.
    ScaledInF32,
}

impl NormKind {
    /// The dtype of the norm's output for an input and a weight in these dtypes: the input's, or f32 where a
    /// plain norm's f32 weight promotes a half-precision input (as `rms_norm_forward` computes it).
    pub fn output_dtype(self, x: DType, weight: DType) -> DType {
        if self == NormKind::Plain && weight != x { DType::F32 } else { x }
    }

    /// Whether the weight is stored as an offset from 1 (`1 + w` scales).
    pub fn adds_one(self) -> bool {
        self == NormKind::ZeroCentered
    }

    /// Whether `x̂` is rounded to the input's dtype before the scale multiplies it (else the product is in f32).
    pub fn rounds_first(self) -> bool {
        self == NormKind::Plain
    }
}

/// The RMSNorm forward pass, the composition transformers runs.
pub fn rms_norm_forward<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
    kind: NormKind,
) -> Tensor<B, D> {
    let dtype = x.dtype();
    // Each f32 view of x is cast where it is used (see `f32_of`).
    let variance = f32_of(&x).powf_scalar(2.0).mean_dim(D - 1);
    let normed = f32_of(&x) * (variance + eps).sqrt().recip();
    match kind {
        NormKind::Plain if weight.dtype() == dtype => normed.cast(dtype) * weight.unsqueeze::<D>(),
        NormKind::Plain => normed.cast(dtype).cast(FloatDType::F32) * weight.cast(FloatDType::F32).unsqueeze::<D>(),
        NormKind::ZeroCentered => (normed * (weight.cast(FloatDType::F32) + 1.0).unsqueeze::<D>()).cast(dtype),
        NormKind::ScaledInF32 => (normed * weight.cast(FloatDType::F32).unsqueeze::<D>()).cast(dtype),
    }
}

/// Gradients of `rms_norm_forward` with respect to `x` and `weight` (in their dtypes) for the output
/// gradient `grad`, in f32 from `x` alone (the statistics are recomputed, not kept): with `s` the scale
/// (`w`, or `1 + w`) and `n` what multiplies it (`cast(x̂)`, or `x̂`), `d w = Σ grad · n` over every row,
/// `d x̂ = grad · s`, `d x = r · (d x̂ − x̂ · mean(d x̂ · x̂))` with `r = 1 / sqrt(mean(x²) + eps)`.
pub fn rms_norm_backward<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
    kind: NormKind,
    grad: Tensor<B, D>,
) -> (Tensor<B, D>, Tensor<B, 1>) {
    let (x_dtype, weight_dtype) = (FloatDType::from(x.dtype()), FloatDType::from(weight.dtype()));
    let width = weight.dims()[0];
    // The elementwise terms are recomputed for each reduction and after them, never kept (see `f32_of`).
    let inv = (f32_of(&x).powf_scalar(2.0).mean_dim(D - 1) + eps).sqrt().recip();
    let normed = || f32_of(&x) * inv.clone();
    let weight = weight.cast(FloatDType::F32);
    let scale = if kind.adds_one() { weight + 1.0 } else { weight }.unsqueeze::<D>();
    // The plain form multiplies the weight with x̂ rounded to the input's dtype.
    let multiplied = if kind.rounds_first() { normed().cast(x_dtype).cast(FloatDType::F32) } else { normed() };
    let grad_weight = column_sums((f32_of(&grad) * multiplied).reshape([-1, width as i64]));
    let grad_normed = || f32_of(&grad) * scale.clone();
    let projection = (grad_normed() * normed()).mean_dim(D - 1);
    let grad_x = (grad_normed() - normed() * projection) * inv.clone();
    (grad_x.cast(x_dtype), grad_weight.cast(weight_dtype))
}

/// `Σ` over the rows of `x` `[rows, width]`, as `[width]`, folded `COLUMN_FOLD` rows at a time: groups of
/// that many consecutive rows are summed into one row, and the group sums again, until one group is left (a
/// remainder of fewer rows is summed apart and added at the end). Why not one `sum_dim(0)`:
/// - burn 0.21 without its `autotune` feature (kiln's CUDA build) runs every reduction with cubek's unit
///   routine, one thread per output vector of 4 that reads the whole reduced axis in turn: a q/k norm's weight
///   gradient (`[131_072, 64]` for LFM2.5-1.2B at sequence 4096) was 16 threads reading 131,072 rows each,
///   one dependent load a row, where folded each thread reads at most `COLUMN_FOLD` rows;
/// - burn 0.21's reductions along a dimension longer than about 65,530 drop the rest on wgpu (lavapipe, fused
///   and unfused: `sum_dim(0)` of `[70_000, 1]` misses its last 4,500 rows; a whole-tensor `sum` is right).
pub fn column_sums<B: Backend>(mut x: Tensor<B, 2>) -> Tensor<B, 1> {
    let width = x.dims()[1];
    let mut remainders = Vec::new();
    loop {
        let rows = x.dims()[0];
        if rows <= COLUMN_FOLD {
            break;
        }
        let (groups, whole) = (rows / COLUMN_FOLD, rows / COLUMN_FOLD * COLUMN_FOLD);
        if whole < rows {
            remainders.push(x.clone().narrow(0, whole, rows - whole).sum_dim(0));
            x = x.narrow(0, 0, whole);
        }
        x = x.reshape([groups, COLUMN_FOLD, width]).sum_dim(1).reshape([groups, width]);
    }
    let sums = x.sum_dim(0);
    match remainders.into_iter().reduce(|sum, rest| sum + rest) {
        Some(rest) => sums + rest,
        None => sums,
    }
    .reshape([width])
}

/// The rows `column_sums` sums at once (a power of two: sequences of 4096 tokens fold in whole groups).
pub const COLUMN_FOLD: usize = 64;

/// `ModelBackend::write_cache_rows` as burn's `slice_assign`.
pub fn write_cache_rows_composed<B: Backend>(cache: Tensor<B, 4>, at: usize, rows: Tensor<B, 4>) -> Tensor<B, 4> {
    let [batch, heads, n, d] = rows.dims();
    cache.slice_assign([0..batch, 0..heads, at..at + n, 0..d], rows)
}

/// `x` in f32, as a new cast at each use. A half-precision input cast once and reused after a reduction
/// becomes an output that burn's fused reduction writes, and a fused reduction whose layout reference is such
/// an output panics on burn's device thread (tracel-ai/burn#5292; the first GPU session hit it in every
/// training step). Recomputing the cast costs a read of `x` in a fused kernel that reads it anyway.
pub fn f32_of<B: Backend, const D: usize>(x: &Tensor<B, D>) -> Tensor<B, D> {
    x.clone().cast(FloatDType::F32)
}

impl<B: ModelBackend, C: CheckpointStrategy> ModelBackend for Autodiff<B, C> {
    fn document_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        docs: &DocumentAttention<Self>,
    ) -> Tensor<Self, 4> {
        if reference_ops() {
            let mask = docs.full_mask(FloatDType::from(q.dtype()));
            let scale = docs.scale(q.dims()[3]);
            return scaled_softmax_attention(q, k, v, &mask, scale);
        }
        tracked_document_attention(q, k, v, docs)
    }

    fn broadcast_rows<const D: usize>(v: Tensor<Self, 1>, dims: [usize; D]) -> Tensor<Self, D> {
        if reference_ops() {
            return v.unsqueeze::<D>().expand(dims);
        }
        let v = v.into_primitive().tensor();
        let forward = move |[v]: [FloatTensor<B>; 1]| {
            B::broadcast_rows(Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(v)), dims).into_primitive().tensor()
        };
        let output = record_recomputable::<C, _, _, _, _, _>(BroadcastRowsBackward, [&v], forward, |_| ());
        Tensor::from_primitive(TensorPrimitive::Float(output))
    }

    fn projection<const D: usize>(x: Tensor<Self, D>, weight: Tensor<Self, 2>) -> Tensor<Self, D> {
        if reference_ops() {
            return burn::tensor::module::linear(x, weight, None);
        }
        record_binary(ProjectionBackward::<D>, x, weight, (), |x, weight| B::projection(x, weight))
    }

    fn glu<const D: usize>(gate: Tensor<Self, D>, up: Tensor<Self, D>, act: GateActivation) -> Tensor<Self, D> {
        if reference_ops() {
            return glu_forward(gate, up, act);
        }
        record_binary(GluBackward::<D>, gate, up, act, move |gate, up| B::glu(gate, up, act))
    }

    fn rms_norm<const D: usize>(
        x: Tensor<Self, D>,
        weight: Tensor<Self, 1>,
        eps: f64,
        kind: NormKind,
    ) -> Tensor<Self, D> {
        if reference_ops() {
            return rms_norm_forward(x, weight, eps, kind);
        }
        record_binary(RmsNormBackward::<D>, x, weight, (eps, kind), move |x, weight| B::rms_norm(x, weight, eps, kind))
    }

    fn l2_norm<const D: usize>(x: Tensor<Self, D>, eps: f64) -> Tensor<Self, D> {
        if reference_ops() {
            return l2_normalize(x, eps);
        }
        let x = x.into_primitive().tensor();
        let forward = move |[x]: [FloatTensor<B>; 1]| {
            B::l2_norm(Tensor::<B, D>::from_primitive(TensorPrimitive::Float(x)), eps).into_primitive().tensor()
        };
        let output = record_recomputable::<C, _, _, _, _, _>(L2NormBackward::<D>, [&x], forward, |[x]| (x, eps));
        Tensor::from_primitive(TensorPrimitive::Float(output))
    }

    fn rope(x: Tensor<Self, 4>, tables: &RopeTables<Self>) -> Tensor<Self, 4> {
        if reference_ops() {
            return apply_rope(x, tables);
        }
        let tables = tables.inner();
        let x = x.into_primitive().tensor();
        let kept = tables.clone();
        let forward = move |[x]: [FloatTensor<B>; 1]| {
            B::rope(Tensor::from_primitive(TensorPrimitive::Float(x)), &kept).into_primitive().tensor()
        };
        let out = forward([x.primitive.clone()]);
        // The backward pass needs the tables alone: the input is not checkpointed for it, only for a
        // recomputation of the output.
        let retro = RetroOp { inputs: [x.node.id], forward, backend: PhantomData::<B> };
        let prepared = RopeBackward.prepare::<C>([x.node.clone()]).memory_bound().retro_forward(retro).parents([&x]);
        let output = match prepared.stateful() {
            OpsKind::Tracked(prep) => prep.finish(tables, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        Tensor::from_primitive(TensorPrimitive::Float(output))
    }

    fn causal_conv(x: Tensor<Self, 3>, kernel: Tensor<Self, 2>, shifts: &ConvShifts<Self>) -> Tensor<Self, 3> {
        if reference_ops() {
            return causal_depthwise_conv(x, kernel, shifts);
        }
        let shifts = shifts.inner();
        let kept = shifts.clone();
        record_binary(CausalConvBackward, x, kernel, shifts, move |x, kernel| B::causal_conv(x, kernel, &kept))
    }

    fn gated_conv(bcx: Tensor<Self, 3>, kernel: Tensor<Self, 2>, shifts: &ConvShifts<Self>) -> Tensor<Self, 3> {
        if reference_ops() {
            return gated_conv(bcx, kernel, shifts);
        }
        let shifts = shifts.inner();
        let kept = shifts.clone();
        record_binary(GatedConvBackward, bcx, kernel, shifts, move |bcx, kernel| B::gated_conv(bcx, kernel, &kept))
    }

    fn grouped_matmul(x: Tensor<Self, 2>, weights: Tensor<Self, 3>, counts: &[usize]) -> Tensor<Self, 2> {
        if reference_ops() {
            return grouped_matmul_forward(x, weights, counts);
        }
        let kept = counts.to_vec();
        record_binary(GroupedMatmulBackward, x, weights, counts.to_vec(), move |x, weights| {
            B::grouped_matmul(x, weights, &kept)
        })
    }

    fn gated_delta_rule(inputs: ScanInputs<Self>, plan: &ChunkPlan<Self>) -> Tensor<Self, 4> {
        if reference_ops() {
            return deltanet::chunked(inputs, plan, None).0;
        }
        tracked_gated_delta_rule(inputs, plan)
    }

    fn split_last<const D: usize, const N: usize>(x: Tensor<Self, D>, widths: [usize; N]) -> [Tensor<Self, D>; N] {
        if reference_ops() {
            return narrow_last(x, widths);
        }
        let leaf = x.is_require_grad();
        let x = x.into_primitive().tensor();
        let inner = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(x.primitive.clone()));
        let dims = inner.dims();
        let written = Arc::new(AtomicBool::new(false));
        let mut parts = B::split_last(inner, widths).into_iter();
        part_ranges(widths, dims[D - 1]).map(|range| {
            let part = parts.next().expect("a part per width").into_primitive().tensor();
            let retro = RetroNarrow::<B, D> { input: x.node.id, range: range.clone(), backend: PhantomData };
            let prepared = SplitPartBackward::<D>
                .prepare::<C>([x.node.clone()])
                .memory_bound()
                .retro_forward(retro)
                .parents([&x])
                .stateful();
            let out = match prepared {
                OpsKind::Tracked(prep) => prep.finish(SplitPart { dims, range, leaf, written: written.clone() }, part),
                OpsKind::UnTracked(prep) => prep.finish(part),
            };
            Tensor::from_primitive(TensorPrimitive::Float(out))
        })
    }

    fn layer_output<const D: usize>(h: Tensor<Self, D>) -> Tensor<Self, D> {
        let h = h.into_primitive().tensor();
        let out = h.primitive.clone();
        let output = LayerOutputBackward.prepare::<C>([h.node.clone()]).compute_bound().stateless(out);
        Tensor::from_primitive(TensorPrimitive::Float(output))
    }
}

/// Records `out`, computed on the inner backend from `inputs`, as one autodiff op whose backward pass is
/// `op`'s; its state is `state` of the inputs' checkpoint ids (kept or recomputed as the checkpointing
/// strategy says). Untracked inputs record nothing and build no state. The op is compute-bound: its output
/// is kept under any strategy (attention, the delta rule, the loss: what a layer's recomputation would
/// redo at the most cost). Called as `record_op::<C, _, _, _, _>`: the tensors do not name the strategy.
pub(super) fn record_op<C, B, Op, S, const N: usize>(
    op: Op,
    inputs: [&FloatTensor<Autodiff<B, C>>; N],
    out: FloatTensor<B>,
    state: impl FnOnce([NodeId; N]) -> S,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    Op: Backward<B, N, State = S>,
    S: Clone + Send + std::fmt::Debug + 'static,
{
    finish_op(op.prepare::<C>(inputs.map(|t| t.node.clone())).compute_bound().stateful(), inputs, out, state)
}

/// `record_op` for an op whose output `forward` recomputes cheaply from its inputs (norms, projections,
/// gates, convolutions, RoPE): memory-bound, so that under burn's balanced checkpointing
/// (`--activation-checkpointing`) its output is dropped after the forward pass and recomputed from its
/// inputs when the backward pass first needs it, back to the layer's kept input (`ModelBackend::layer_output`).
/// Without checkpointing burn treats it as compute-bound, and nothing changes. Called as
/// `record_recomputable::<C, _, _, _, _, _>`.
fn record_recomputable<C, B, Op, S, F, const N: usize>(
    op: Op,
    inputs: [&FloatTensor<Autodiff<B, C>>; N],
    forward: F,
    state: impl FnOnce([NodeId; N]) -> S,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    Op: Backward<B, N, State = S>,
    S: Clone + Send + std::fmt::Debug + 'static,
    F: Fn([FloatTensor<B>; N]) -> FloatTensor<B> + Send + 'static,
{
    let out = forward(inputs.map(|t| t.primitive.clone()));
    let retro = RetroOp { inputs: inputs.map(|t| t.node.id), forward, backend: PhantomData::<B> };
    let prepared = op.prepare::<C>(inputs.map(|t| t.node.clone())).memory_bound().retro_forward(retro).parents(inputs);
    finish_op(prepared.stateful(), inputs, out, state)
}

/// Ends a prepared op: tracked, with `state` of the inputs' checkpoint ids; untracked, the output alone.
fn finish_op<C, B, Op, S, const N: usize>(
    prepared: OpsKind<Op, B, S, C, N>,
    inputs: [&FloatTensor<Autodiff<B, C>>; N],
    out: FloatTensor<B>,
    state: impl FnOnce([NodeId; N]) -> S,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    Op: Backward<B, N, State = S>,
    S: Clone + Send + std::fmt::Debug + 'static,
{
    match prepared {
        OpsKind::Tracked(mut prep) => {
            let ids = inputs.map(|t| prep.checkpoint(t));
            prep.finish(state(ids), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// A recomputable op's forward pass, run again on its inputs as the checkpointer holds or recomputes them.
struct RetroOp<B, F, const N: usize> {
    inputs: [NodeId; N],
    forward: F,
    backend: PhantomData<B>,
}

impl<B, F, const N: usize> std::fmt::Debug for RetroOp<B, F, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetroOp").field("inputs", &self.inputs).finish_non_exhaustive()
    }
}

impl<B, F, const N: usize> RetroForward for RetroOp<B, F, N>
where
    B: Backend,
    F: Fn([FloatTensor<B>; N]) -> FloatTensor<B> + Send + 'static,
{
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let inputs = self.inputs.map(|id| states.get_state::<FloatTensor<B>>(&id));
        states.save(out_node, (self.forward)(inputs));
    }
}

/// Records `forward`, run on the inner backend, as one recomputable autodiff op of the inputs `a` and `b`
/// whose backward pass is `op`'s, with both inputs and `extra` as its state (`record_recomputable`).
fn record_binary<B, C, Op, E, const DA: usize, const DB: usize, const DO: usize>(
    op: Op,
    a: Tensor<Autodiff<B, C>, DA>,
    b: Tensor<Autodiff<B, C>, DB>,
    extra: E,
    forward: impl Fn(Tensor<B, DA>, Tensor<B, DB>) -> Tensor<B, DO> + Send + 'static,
) -> Tensor<Autodiff<B, C>, DO>
where
    B: Backend,
    C: CheckpointStrategy,
    Op: Backward<B, 2, State = (NodeId, NodeId, E)>,
    E: Clone + Send + std::fmt::Debug + 'static,
{
    let (a, b) = (a.into_primitive().tensor(), b.into_primitive().tensor());
    let inner = |t: FloatTensor<B>| TensorPrimitive::Float(t);
    let forward = move |[a, b]: [FloatTensor<B>; 2]| {
        forward(Tensor::from_primitive(inner(a)), Tensor::from_primitive(inner(b))).into_primitive().tensor()
    };
    let output = record_recomputable::<C, _, _, _, _, _>(op, [&a, &b], forward, |[a, b]| (a, b, extra));
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backward pass of an op `record_binary` recorded: the two inputs' gradients from `gradients` (inputs,
/// extra state, output gradient), registered for the inputs that need one.
fn backward_binary<B: Backend, E, const DA: usize, const DB: usize, const DO: usize>(
    ops: Ops<(NodeId, NodeId, E), 2>,
    grads: &mut Gradients,
    checkpointer: &mut Checkpointer,
    gradients: impl FnOnce(Tensor<B, DA>, Tensor<B, DB>, E, Tensor<B, DO>) -> (Tensor<B, DA>, Tensor<B, DB>),
) {
    let (a, b, extra) = ops.state;
    let [parent_a, parent_b] = ops.parents;
    let grad = grads.consume::<B>(&ops.node);
    if parent_a.is_none() && parent_b.is_none() {
        return;
    }
    let tensor = |t: FloatTensor<B>| TensorPrimitive::Float(t);
    let (grad_a, grad_b) = gradients(
        Tensor::from_primitive(tensor(checkpointer.retrieve_node_output(a))),
        Tensor::from_primitive(tensor(checkpointer.retrieve_node_output(b))),
        extra,
        Tensor::from_primitive(tensor(grad)),
    );
    if let Some(node) = parent_a {
        grads.register::<B>(node.id, grad_a.into_primitive().tensor());
    }
    if let Some(node) = parent_b {
        grads.register::<B>(node.id, grad_b.into_primitive().tensor());
    }
}

#[derive(Debug)]
struct BroadcastRowsBackward;

impl<B: ModelBackend> Backward<B, 1> for BroadcastRowsBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node) = parent else { return };
        let shape = grad.shape();
        let width = shape[shape.num_dims() - 1];
        let rows = shape.num_elements() / width.max(1);
        let dtype = FloatDType::from(grad.dtype());
        // Summed in f32 whatever the vector's dtype: the folds' partial sums are rounded once, at the end.
        let grad = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::float_reshape(grad, [rows, width].into())));
        grads.register::<B>(node.id, column_sums(grad.cast(FloatDType::F32)).cast(dtype).into_primitive().tensor());
    }
}

#[derive(Debug)]
struct L2NormBackward<const D: usize>;

impl<B: ModelBackend, const D: usize> Backward<B, 1> for L2NormBackward<D> {
    /// The input through the checkpointer, eps.
    type State = (NodeId, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let (x, eps) = ops.state;
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node) = parent else { return };
        let x: FloatTensor<B> = checkpointer.retrieve_node_output(x);
        let grad_x = B::l2_norm_grads(
            Tensor::<B, D>::from_primitive(TensorPrimitive::Float(x)),
            eps,
            Tensor::<B, D>::from_primitive(TensorPrimitive::Float(grad)),
        );
        grads.register::<B>(node.id, grad_x.into_primitive().tensor());
    }
}

#[derive(Debug)]
struct RopeBackward;

impl<B: ModelBackend> Backward<B, 1> for RopeBackward {
    type State = RopeTables<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node) = parent else { return };
        let grad_x = B::rope_grad(Tensor::from_primitive(TensorPrimitive::Float(grad)), &ops.state);
        grads.register::<B>(node.id, grad_x.into_primitive().tensor());
    }
}

/// `layer_output`'s identity: the gradient passes through.
#[derive(Debug)]
struct LayerOutputBackward;

impl<B: Backend> Backward<B, 1> for LayerOutputBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = parent {
            grads.register::<B>(node.id, grad);
        }
    }
}

#[derive(Debug)]
struct CausalConvBackward;

impl<B: ModelBackend> Backward<B, 2> for CausalConvBackward {
    /// The input and the kernel through the checkpointer, the layout's shifts.
    type State = (NodeId, NodeId, ConvShifts<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        backward_binary(ops, grads, checkpointer, |x, kernel, shifts, grad| {
            B::causal_conv_grads(x, kernel, &shifts, grad)
        });
    }
}

#[derive(Debug)]
struct GatedConvBackward;

impl<B: ModelBackend> Backward<B, 2> for GatedConvBackward {
    /// The projection `B | C | x` and the kernel through the checkpointer, the layout's shifts.
    type State = (NodeId, NodeId, ConvShifts<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        backward_binary(ops, grads, checkpointer, |bcx, kernel, shifts, grad| {
            B::gated_conv_grads(bcx, kernel, &shifts, grad)
        });
    }
}

#[derive(Debug)]
struct GroupedMatmulBackward;

impl<B: ModelBackend> Backward<B, 2> for GroupedMatmulBackward {
    /// The rows and the weights through the checkpointer, the rows per expert.
    type State = (NodeId, NodeId, Vec<usize>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        backward_binary(ops, grads, checkpointer, |x, weights, counts, grad: Tensor<B, 2>| {
            B::grouped_matmul_grads(x, weights, &counts, grad)
        });
    }
}

/// One part of a `split_last`, as its backward pass needs it.
#[derive(Debug, Clone)]
struct SplitPart<const D: usize> {
    /// The split tensor's shape.
    dims: [usize; D],
    /// The part's place along the last dimension.
    range: std::ops::Range<usize>,
    /// Whether the split tensor is a leaf: burn keeps a leaf's gradient when it is read, so the parts
    /// cannot take it out to write into.
    leaf: bool,
    /// Shared by the parts of one split: set once a part has registered a gradient for the split tensor.
    written: Arc<AtomicBool>,
}

#[derive(Debug)]
struct SplitPartBackward<const D: usize>;

impl<B: ModelBackend, const D: usize> Backward<B, 1> for SplitPartBackward<D> {
    type State = SplitPart<D>;

    /// The first part to run registers a zero gradient for the whole tensor with its own slice written in
    /// (added to whatever other consumers of the tensor registered); each later part takes that gradient
    /// out and adds its slice in place. Parts that are not used never run, and leave zeros. All parts run
    /// before the split tensor's own backward step, which is the first to read the whole gradient.
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let part = ops.state;
        let [parent] = ops.parents;
        let grad = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(grads.consume::<B>(&ops.node)));
        let Some(node) = parent else { return };
        let whole = if part.leaf || !part.written.swap(true, Ordering::Relaxed) {
            None
        } else {
            Some(Tensor::<B, D>::from_primitive(TensorPrimitive::Float(grads.consume::<B>(&node))))
        };
        let whole = B::add_part(whole, part.dims, part.range, grad);
        grads.register::<B>(node.id, whole.into_primitive().tensor());
    }
}

/// Recomputes a part of a `split_last` from the split tensor when checkpointing dropped it.
#[derive(Debug)]
struct RetroNarrow<B: Backend, const D: usize> {
    input: NodeId,
    range: std::ops::Range<usize>,
    backend: PhantomData<B>,
}

impl<B: Backend, const D: usize> RetroForward for RetroNarrow<B, D> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let x: FloatTensor<B> = states.get_state(&self.input);
        let part =
            Tensor::<B, D>::from_primitive(TensorPrimitive::Float(x)).narrow(D - 1, self.range.start, self.range.len());
        states.save(out_node, part.into_primitive().tensor());
    }
}

/// The activation of a gated MLP's gate, `act(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateActivation {
    /// SwiGLU (LFM2, Qwen3.5): `silu(gate) = gate · σ(gate)`, composed in the inputs' dtype as burn does.
    Silu,
    /// GeGLU (Gemma 4's `gelu_pytorch_tanh`): `0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))`, computed in f32
    /// and rounded once to the gate's dtype, as torch's kernel computes it in half precision.
    GeluTanh,
}

/// `√(2/π)`, the tanh approximation of GELU's scale.
pub const GELU_TANH_SCALE: f64 = 0.797_884_560_802_865_4;
/// The cubic term's coefficient in the tanh approximation of GELU.
pub const GELU_TANH_CUBIC: f64 = 0.044715;

/// `gelu_tanh(x)` composed in the input's dtype.
pub fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    x.clone() * (gelu_tanh_tanh(x.clone(), x.powi_scalar(3)) + 1.0) * 0.5
}

/// `tanh(√(2/π)·(x + 0.044715·x³))`, the one term GELU's value and slope share, given `x³` as each computes
/// it. Gemma's training on the fused backend follows the CPU's within 1e-4 only with the forward's `x³` from
/// `powi_scalar(3)`: the same GELU with `x · x²` moved its third loss by 2.7e-4 (tests/vulkan_backend.rs).
fn gelu_tanh_tanh<B: Backend, const D: usize>(x: Tensor<B, D>, cube: Tensor<B, D>) -> Tensor<B, D> {
    tanh((x + cube * GELU_TANH_CUBIC) * GELU_TANH_SCALE)
}

/// The gate `act(gate) · up` as burn composes it.
pub fn glu_forward<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
    act: GateActivation,
) -> Tensor<B, D> {
    match act {
        GateActivation::Silu => silu(gate) * up,
        GateActivation::GeluTanh => {
            let dtype = FloatDType::from(gate.dtype());
            gelu_tanh(gate.cast(FloatDType::F32)).cast(dtype) * up
        }
    }
}

/// Gradients of `act(gate) · up` for the output gradient `grad`, in f32 and returned in the inputs' dtypes:
/// `d up = grad · act(gate)`, `d gate = grad · up · act'(gate)`, where `silu' = σ · (1 + gate · (1 − σ))` and
/// `gelu_tanh' = ½(1 + t) + ½·gate·(1 − t²)·√(2/π)·(1 + 3·0.044715·gate²)` with `t` the tanh.
pub fn glu_backward<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
    grad: Tensor<B, D>,
    act: GateActivation,
) -> (Tensor<B, D>, Tensor<B, D>) {
    let (gate_dtype, up_dtype) = (FloatDType::from(gate.dtype()), FloatDType::from(up.dtype()));
    let gate = gate.cast(FloatDType::F32);
    let grad = grad.cast(FloatDType::F32);
    let up = up.cast(FloatDType::F32);
    let (grad_up, grad_gate) = match act {
        GateActivation::Silu => {
            let sig = sigmoid(gate.clone());
            let grad_up = grad.clone() * gate.clone() * sig.clone();
            (grad_up, grad * up * sig.clone() * ((gate * (sig.neg() + 1.0)) + 1.0))
        }
        GateActivation::GeluTanh => {
            let square = gate.clone().powi_scalar(2);
            let t = gelu_tanh_tanh(gate.clone(), gate.clone() * square.clone());
            let half_one_plus_t = (t.clone() + 1.0) * 0.5;
            let slope = (t.powi_scalar(2).neg() + 1.0) * (square * (3.0 * GELU_TANH_CUBIC) + 1.0) * GELU_TANH_SCALE;
            let derivative = half_one_plus_t.clone() + gate.clone() * slope * 0.5;
            (grad.clone() * gate * half_one_plus_t, grad * up * derivative)
        }
    };
    (grad_gate.cast(gate_dtype), grad_up.cast(up_dtype))
}

#[derive(Debug)]
struct ProjectionBackward<const D: usize>;

impl<B: ModelBackend, const D: usize> Backward<B, 2> for ProjectionBackward<D> {
    /// The input and the weight, through the checkpointer.
    type State = (NodeId, NodeId, ());

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        backward_binary(ops, grads, checkpointer, |x, weight, (), grad: Tensor<B, D>| {
            projection_backward(x, weight, grad)
        });
    }
}

/// The gradients `(dx, dweight)` of `x · weight` for the output gradient `grad`: `dx = grad · weightᵀ` as burn
/// computes it, and `dweight = xᵀ · grad` with every leading dimension of `x` and `grad` taken as rows, so one
/// matmul sums over the batch inside its accumulator.
pub fn projection_backward<B: ModelBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    grad: Tensor<B, D>,
) -> (Tensor<B, D>, Tensor<B, 2>) {
    let [d_in, d_out] = weight.dims();
    let rows = x.dims()[..D - 1].iter().product();
    let grad_x = B::matmul(grad.clone(), weight.transpose().unsqueeze::<D>());
    let grad_weight = B::matmul(x.reshape([rows, d_in]).transpose(), grad.reshape([rows, d_out]));
    (grad_x, grad_weight)
}

#[derive(Debug)]
struct GluBackward<const D: usize>;

impl<B: ModelBackend, const D: usize> Backward<B, 2> for GluBackward<D> {
    /// The gate and up inputs, through the checkpointer, and the activation.
    type State = (NodeId, NodeId, GateActivation);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        backward_binary(ops, grads, checkpointer, |gate, up, act, grad: Tensor<B, D>| {
            B::glu_grads(gate, up, grad, act)
        });
    }
}

#[derive(Debug)]
struct RmsNormBackward<const D: usize>;

impl<B: ModelBackend, const D: usize> Backward<B, 2> for RmsNormBackward<D> {
    /// The input and the weight through the checkpointer, eps and the form.
    type State = (NodeId, NodeId, (f64, NormKind));

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        backward_binary(ops, grads, checkpointer, |x, weight, (eps, kind), grad: Tensor<B, D>| {
            B::rms_norm_grads(x, weight, eps, kind, grad)
        });
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::backend::AutodiffBackend;

    use super::*;
    use crate::backend::{Cpu, CpuTrain, CpuTrainCheckpointed};
    use crate::testing::{assert_close, normal, values};

    /// Output and input gradients of `Σ glu(gate, up, act) ⊙ R` through the op and through burn's
    /// composition of the activation in the inputs' dtype, `act(gate) * up`, on the same leaves.
    fn both<B: ModelBackend + AutodiffBackend>(
        dtype: FloatDType,
        act: GateActivation,
    ) -> ([Vec<f32>; 3], [Vec<f32>; 3]) {
        let device = Default::default();
        let leaf = |seed: u64| normal::<B, 3>([2, 5, 7], 0.0, 2.0, seed, &device).cast(dtype).require_grad();
        let (gate, up, weights) = (leaf(1), leaf(2), leaf(3).detach());
        let run = |out: Tensor<B, 3>| {
            let grads = (out.clone() * weights.clone()).sum().backward();
            let grad = |t: &Tensor<B, 3>| values(t.grad(&grads).expect("a gradient"));
            [values(out), grad(&gate), grad(&up)]
        };
        let composed = match act {
            GateActivation::Silu => silu(gate.clone()),
            GateActivation::GeluTanh => gelu_tanh(gate.clone()),
        };
        (run(B::glu(gate.clone(), up.clone(), act)), run(composed * up.clone()))
    }

    /// Every row counted once, whether the rows fold in whole groups, leave a remainder at one level or at
    /// several, or fit one group; against f64 sums on the host.
    #[test]
    fn column_sums_add_every_row_once() {
        let device = Default::default();
        let f = COLUMN_FOLD;
        for rows in [1, 7, f, f + 1, f * f, f * f + 3, f * f * 2 + f + 5, 70_000] {
            for width in [1, 3] {
                let x = normal::<Cpu, 2>([rows, width], 0.5, 1.0, rows as u64, &device);
                let host = values(x.clone());
                let expected: Vec<f32> = (0..width)
                    .map(|c| host.iter().skip(c).step_by(width).map(|&v| f64::from(v)).sum::<f64>() as f32)
                    .collect();
                // f32 sums of N values of about 0.5 ± 1: a few ulps of N / 2 at most, folded.
                assert_close(&format!("{rows} × {width}"), &values(column_sums(x)), &expected, 1e-5);
            }
        }
    }

    /// The op's output and gradient against burn's broadcast of the same leaf, in f32 and in bf16 (whose
    /// gradient the op sums in f32), with and without checkpointing.
    fn broadcast_rows_against_burns<B: ModelBackend + AutodiffBackend>(dtype: FloatDType, tolerance: f32) {
        let device = Default::default();
        let dims = [2, 70, 5];
        let v = normal::<B, 1>([5], 0.0, 1.0, 7, &device).cast(dtype).require_grad();
        let r = normal::<B, 3>(dims, 0.0, 1.0, 8, &device).cast(dtype);
        let run = |out: Tensor<B, 3>| {
            let grads = (out.clone().cast(FloatDType::F32) * r.clone().cast(FloatDType::F32)).sum().backward();
            [values(out), values(v.grad(&grads).expect("a gradient"))]
        };
        let [out, grad] = run(B::broadcast_rows(v.clone(), dims));
        let [burns_out, burns_grad] = run(v.clone().unsqueeze::<3>().expand(dims));
        assert_eq!(out, burns_out, "{dtype:?}: the output is the vector on every row");
        assert_close(&format!("{dtype:?}: d v"), &grad, &burns_grad, tolerance);
    }

    #[test]
    fn broadcast_rows_sums_its_gradient_over_every_row() {
        broadcast_rows_against_burns::<CpuTrain>(FloatDType::F32, 1e-6);
        broadcast_rows_against_burns::<CpuTrainCheckpointed>(FloatDType::F32, 1e-6);
        // 140 rows: burn's sum rounds to bf16 once as well; the two orders may differ by an ulp.
        broadcast_rows_against_burns::<CpuTrain>(FloatDType::BF16, 1.0 / 128.0);
    }

    const NAMES: [&str; 3] = ["output", "d gate", "d up"];

    #[test]
    fn gated_activations_and_their_backward_equal_the_composition() {
        for act in [GateActivation::Silu, GateActivation::GeluTanh] {
            let (op, composed) = both::<CpuTrain>(FloatDType::F32, act);
            for (name, (a, b)) in NAMES.iter().zip(op.iter().zip(&composed)) {
                assert_close(&format!("{act:?} {name}"), a, b, 1e-6);
            }
            let (op, composed) = both::<CpuTrainCheckpointed>(FloatDType::F32, act);
            for (name, (a, b)) in NAMES.iter().zip(op.iter().zip(&composed)) {
                assert_close(&format!("{act:?} {name}, checkpointed"), a, b, 1e-6);
            }
        }
    }

    #[test]
    fn gated_activations_in_bf16_round_the_gradients_once() {
        let (op, composed) = both::<CpuTrain>(FloatDType::BF16, GateActivation::Silu);
        assert_eq!(op[0], composed[0], "SwiGLU's forward is the composition");
        // The op computes the gradients in f32 and rounds once; the composition rounds after every product,
        // so the two differ by up to a few bf16 ulps (2⁻⁸ relative each).
        for (name, (a, b)) in NAMES.iter().zip(op.iter().zip(&composed)).skip(1) {
            assert_close(name, a, b, 1.0 / 64.0);
        }
        // GeGLU's forward rounds the f32 GELU once where the composition rounds each of its eight ops: they
        // differ by a bf16 ulp here and there (measured: 1/370 of the largest output, 1/225 of the largest
        // gate gradient).
        let (op, composed) = both::<CpuTrain>(FloatDType::BF16, GateActivation::GeluTanh);
        for (name, (a, b)) in NAMES.iter().zip(op.iter().zip(&composed)) {
            assert_close(&format!("GeGLU {name}"), a, b, 1.0 / 128.0);
        }
    }

    /// GeGLU's forward in bf16 is torch's: the GELU in f32, rounded once, times `up` rounded once.
    #[test]
    fn geglu_in_bf16_rounds_the_f32_gelu_once() {
        let device = Default::default();
        let tensor = |seed: u64| normal::<Cpu, 2>([3, 8], 0.0, 3.0, seed, &device);
        let (gate, up) = (tensor(4).cast(FloatDType::BF16), tensor(5).cast(FloatDType::BF16));
        let got = values(CpuTrain::glu(
            Tensor::from_inner(gate.clone()).require_grad(),
            Tensor::from_inner(up.clone()),
            GateActivation::GeluTanh,
        ));
        let want: Vec<f32> = values(gate)
            .iter()
            .zip(values(up))
            .map(|(&g, u)| {
                let gelu = 0.5 * g * (1.0 + (0.797_884_6 * (g + 0.044715 * g * g * g)).tanh());
                half::bf16::from_f32(half::bf16::from_f32(gelu).to_f32() * u).to_f32()
            })
            .collect();
        assert_eq!(got, want);
    }

    /// Output and gradients (x, weight) of `Σ (x · w) ⊙ R` through the op and through burn's `linear`, for
    /// `x` of a batch of 3 rows of 5 tokens (burn sums the 3 rows' weight gradients, the op takes one matmul).
    fn projections<B: ModelBackend + AutodiffBackend>(dtype: FloatDType) -> ([Vec<f32>; 3], [Vec<f32>; 3]) {
        let device = Default::default();
        let x = normal::<B, 3>([3, 5, 12], 0.0, 1.0, 21, &device).cast(dtype).require_grad();
        let weight = normal::<B, 2>([12, 7], 0.0, 0.3, 22, &device).cast(dtype).require_grad();
        let weights = normal::<B, 3>([3, 5, 7], 0.0, 1.0, 23, &device);
        let run = |out: Tensor<B, 3>| {
            let grads = (out.clone().cast(FloatDType::F32) * weights.clone()).sum().backward();
            [values(out), values(x.grad(&grads).expect("d x")), values(weight.grad(&grads).expect("d w"))]
        };
        let op = run(B::projection(x.clone(), weight.clone()));
        let burns = run(burn::tensor::module::linear(x.clone(), weight.clone(), None));
        (op, burns)
    }

    #[test]
    fn projections_and_their_backward_equal_burns_linear() {
        for (dtype, tolerance) in [(FloatDType::F32, 1e-6), (FloatDType::BF16, 1.0 / 128.0)] {
            for (op, burns) in [projections::<CpuTrain>(dtype), projections::<CpuTrainCheckpointed>(dtype)] {
                assert_eq!(op[0], burns[0], "{dtype:?}: the forward is burn's");
                assert_eq!(op[1], burns[1], "{dtype:?}: d x is burn's");
                // One matmul over the 15 rows against burn's three of 5 rows summed: equal up to the order
                // of the additions in f32, and in bf16 up to the rounding of each row's share before the sum.
                assert_close(&format!("{dtype:?} d weight"), &op[2], &burns[2], tolerance);
            }
        }
    }

    /// Output and gradients (x, weight) of `Σ rms_norm(x, w) ⊙ R` through the op and through the
    /// composition, for an input in `x_dtype` and a weight in `weight_dtype` (near 1, or near 0 for the
    /// zero-centered form, as trained).
    fn norms<B: ModelBackend + AutodiffBackend>(
        kind: NormKind,
        x_dtype: FloatDType,
        weight_dtype: FloatDType,
    ) -> ([Vec<f32>; 3], [Vec<f32>; 3]) {
        let device = Default::default();
        let x = normal::<B, 3>([2, 5, 16], 0.5, 2.0, 7, &device).cast(x_dtype).require_grad();
        let centre = if kind.adds_one() { 0.0 } else { 1.0 };
        let weight = normal::<B, 1>([16], centre, 0.3, 8, &device).cast(weight_dtype).require_grad();
        let weights = normal::<B, 3>([2, 5, 16], 0.0, 1.0, 9, &device);
        let run = |out: Tensor<B, 3>| {
            let grads = (out.clone().cast(FloatDType::F32) * weights.clone()).sum().backward();
            [values(out), values(x.grad(&grads).expect("d x")), values(weight.grad(&grads).expect("d w"))]
        };
        let op = run(B::rms_norm(x.clone(), weight.clone(), 1e-6, kind));
        let composed = run(rms_norm_forward(x.clone(), weight.clone(), 1e-6, kind));
        (op, composed)
    }

    const NORM_NAMES: [&str; 3] = ["output", "d x", "d weight"];

    #[test]
    fn rms_norms_and_their_backward_equal_the_composition() {
        use FloatDType::{BF16, F32};
        // (form, input dtype, weight dtype, gradient tolerance): f32 to rounding; bf16 to two bf16 ulps
        // (the op rounds its gradients once, the composition after each product); Qwen3.5's DeltaNet norm
        // keeps an f32 weight under bf16 inputs. In f32 the CPU backend's forward is a loop over the rows
        // (`cpu_elementwise`), within rounding of the composition; in bf16 it is the composition itself.
        let cases = [
            (NormKind::Plain, F32, F32, 1e-6),
            (NormKind::ZeroCentered, F32, F32, 1e-6),
            (NormKind::Plain, BF16, BF16, 1.0 / 128.0),
            (NormKind::ZeroCentered, BF16, BF16, 1.0 / 128.0),
            (NormKind::Plain, BF16, F32, 1.0 / 128.0),
            (NormKind::ScaledInF32, F32, F32, 1e-6),
            (NormKind::ScaledInF32, BF16, BF16, 1.0 / 128.0),
        ];
        for (kind, x_dtype, weight_dtype, tolerance) in cases {
            let (op, composed) = norms::<CpuTrain>(kind, x_dtype, weight_dtype);
            let case = format!("{kind:?} {x_dtype:?}/{weight_dtype:?}");
            if x_dtype == F32 {
                assert_close(&format!("{case} output"), &op[0], &composed[0], 1e-6);
            } else {
                assert_eq!(op[0], composed[0], "{case}: the forward is the composition");
            }
            for (name, (a, b)) in NORM_NAMES.iter().zip(op.iter().zip(&composed)).skip(1) {
                assert_close(&format!("{case} {name}"), a, b, tolerance);
            }
        }
        let (op, composed) = norms::<CpuTrainCheckpointed>(NormKind::ZeroCentered, F32, F32);
        for (name, (a, b)) in NORM_NAMES.iter().zip(op.iter().zip(&composed)) {
            assert_close(&format!("checkpointed {name}"), a, b, 1e-6);
        }
    }

    /// Output and input gradient of `Σ l2_norm(x) ⊙ R` through the op and the composition.
    fn l2<B: ModelBackend + AutodiffBackend>(dtype: FloatDType) -> ([Vec<f32>; 2], [Vec<f32>; 2]) {
        let device = Default::default();
        let x = normal::<B, 4>([2, 3, 4, 16], 0.2, 1.0, 3, &device).cast(dtype).require_grad();
        let r = normal::<B, 4>([2, 3, 4, 16], 0.0, 1.0, 4, &device);
        let run = |out: Tensor<B, 4>| {
            let grads = (out.clone() * r.clone()).sum().backward();
            [values(out), values(x.grad(&grads).expect("d x"))]
        };
        (run(B::l2_norm(x.clone(), 1e-6)), run(super::super::layers::l2_normalize(x.clone(), 1e-6)))
    }

    #[test]
    fn the_l2_norm_and_its_backward_equal_the_composition() {
        for (dtype, tolerance) in [(FloatDType::F32, 1e-6), (FloatDType::BF16, 1.0 / 128.0)] {
            let (op, composed) = l2::<CpuTrain>(dtype);
            assert_eq!(op[0], composed[0], "{dtype:?}: the forward is the composition");
            assert_close(&format!("{dtype:?} d x"), &op[1], &composed[1], tolerance);
        }
        let (op, composed) = l2::<CpuTrainCheckpointed>(FloatDType::F32);
        assert_close("checkpointed d x", &op[1], &composed[1], 1e-6);
    }

    /// A conv as a function of its input, kernel and shifts.
    type ConvForm<'a, B> = &'a dyn Fn(Tensor<B, 3>, Tensor<B, 2>, &ConvShifts<B>) -> Tensor<B, 3>;

    /// A conv's output under `forms`, each on the same input `[rows, seq, width]` and kernel `[channels, taps]`
    /// (from `seed`), with the gradients (x, kernel) of `Σ f(x, w) ⊙ R`, for rows packed with documents of
    /// `lengths` in `seq` tokens.
    fn conv_forms<B: ModelBackend + AutodiffBackend>(
        lengths: &[Vec<u32>],
        seq: usize,
        dtype: FloatDType,
        [width, channels, taps]: [usize; 3],
        seed: u64,
        forms: [ConvForm<B>; 2],
    ) -> [[Vec<f32>; 3]; 2] {
        let device = Default::default();
        let layout = super::super::SequenceLayout::from_doc_lengths(lengths, seq);
        let shifts = ConvShifts::<B>::new(&layout, taps - 1, &device);
        let x = normal::<B, 3>([lengths.len(), seq, width], 0.0, 1.0, seed, &device).cast(dtype).require_grad();
        let kernel = normal::<B, 2>([channels, taps], 0.0, 0.5, seed + 1, &device).cast(dtype).require_grad();
        let r = normal::<B, 3>([lengths.len(), seq, channels], 0.0, 1.0, seed + 2, &device);
        forms.map(|form| {
            let out = form(x.clone(), kernel.clone(), &shifts);
            let grads = (out.clone().cast(FloatDType::F32) * r.clone()).sum().backward();
            [values(out), values(x.grad(&grads).expect("d x")), values(kernel.grad(&grads).expect("d kernel"))]
        })
    }

    /// The causal conv through the op and the composition, a kernel of 4 taps over 6 channels.
    fn convs<B: ModelBackend + AutodiffBackend>(
        lengths: &[Vec<u32>],
        seq: usize,
        dtype: FloatDType,
    ) -> ([Vec<f32>; 3], [Vec<f32>; 3]) {
        let [op, composed] = conv_forms::<B>(
            lengths,
            seq,
            dtype,
            [6, 6, 4],
            9,
            [&|x, kernel, shifts| B::causal_conv(x, kernel, shifts), &causal_depthwise_conv],
        );
        (op, composed)
    }

    #[test]
    fn the_causal_conv_and_its_backward_equal_the_composition() {
        // Packed documents (including ones shorter than the kernel), padding, and a row shorter than it.
        let cases: [(&[Vec<u32>], usize); 2] = [(&[vec![4, 5], vec![2, 3, 1, 2]], 10), (&[vec![2]], 2)];
        for (lengths, seq) in cases {
            let (op, composed) = convs::<CpuTrain>(lengths, seq, FloatDType::F32);
            assert_eq!(op[0], composed[0], "the forward is the composition");
            for (name, (a, b)) in ["output", "d x", "d kernel"].iter().zip(op.iter().zip(&composed)).skip(1) {
                assert_close(&format!("seq {seq} {name}"), a, b, 1e-6);
            }
        }
        let (op, composed) = convs::<CpuTrainCheckpointed>(&[vec![3, 7]], 10, FloatDType::F32);
        for (name, (a, b)) in ["output", "d x", "d kernel"].iter().zip(op.iter().zip(&composed)) {
            assert_close(&format!("checkpointed {name}"), a, b, 1e-6);
        }
        // bf16: the op sums in f32 and rounds once; the composition rounds after every product.
        let (op, composed) = convs::<CpuTrain>(&[vec![4, 5], vec![9]], 10, FloatDType::BF16);
        assert_eq!(op[0], composed[0]);
        for (name, (a, b)) in ["output", "d x", "d kernel"].iter().zip(op.iter().zip(&composed)).skip(1) {
            assert_close(&format!("bf16 {name}"), a, b, 1.0 / 64.0);
        }
    }

    /// LFM2's gated conv through the op and through the ops its layer recorded before it (the split, both
    /// products and the conv op, each its own autodiff op), LFM2's 3 taps over 5 channels.
    fn gated_convs<B: ModelBackend + AutodiffBackend>(
        lengths: &[Vec<u32>],
        seq: usize,
        dtype: FloatDType,
    ) -> ([Vec<f32>; 3], [Vec<f32>; 3]) {
        let separate = |bcx, kernel, shifts: &ConvShifts<B>| {
            let [b, c, x] = B::split_last(bcx, [5; 3]);
            c * B::causal_conv(b * x, kernel, shifts)
        };
        let [op, separate] = conv_forms::<B>(
            lengths,
            seq,
            dtype,
            [15, 5, 3],
            19,
            [&|bcx, kernel, shifts| B::gated_conv(bcx, kernel, shifts), &separate],
        );
        (op, separate)
    }

    #[test]
    fn the_gated_conv_equals_lfm2s_separate_ops_bit_for_bit_in_f32() {
        // The same products in the same order: equal to the bit, so the CPU's training steps did not move.
        for (lengths, seq) in [(&[vec![4, 5], vec![2, 3, 1, 2]][..], 10), (&[vec![2]][..], 2)] {
            let (op, separate) = gated_convs::<CpuTrain>(lengths, seq, FloatDType::F32);
            assert_eq!(op, separate, "seq {seq}");
        }
        let (op, separate) = gated_convs::<CpuTrainCheckpointed>(&[vec![3, 7]], 10, FloatDType::F32);
        assert_eq!(op, separate, "checkpointed");
        let (op, separate) = gated_convs::<CpuTrain>(&[vec![4, 5], vec![9]], 10, FloatDType::BF16);
        assert_eq!(op, separate, "bf16");
    }

    /// Output and gradients (rows, weights) of `Σ grouped_matmul(x, W) ⊙ R` through the op and through the
    /// composition, with an expert that gets no rows.
    fn grouped<B: ModelBackend + AutodiffBackend>(dtype: FloatDType) -> ([Vec<f32>; 3], [Vec<f32>; 3]) {
        let device = Default::default();
        let counts = [3, 0, 2, 4];
        let x = normal::<B, 2>([9, 5], 0.0, 1.0, 5, &device).cast(dtype).require_grad();
        let weights = normal::<B, 3>([4, 5, 6], 0.0, 0.5, 6, &device).cast(dtype).require_grad();
        let r = normal::<B, 2>([9, 6], 0.0, 1.0, 7, &device);
        let run = |out: Tensor<B, 2>| {
            let grads = (out.clone().cast(FloatDType::F32) * r.clone()).sum().backward();
            [values(out), values(x.grad(&grads).expect("d x")), values(weights.grad(&grads).expect("d weights"))]
        };
        let op = run(B::grouped_matmul(x.clone(), weights.clone(), &counts));
        (op, run(grouped_matmul_forward(x.clone(), weights.clone(), &counts)))
    }

    #[test]
    fn the_grouped_matmul_and_its_backward_equal_the_composition() {
        for dtype in [FloatDType::F32, FloatDType::BF16] {
            let (op, composed) = grouped::<CpuTrain>(dtype);
            assert_eq!(op[0], composed[0], "{dtype:?}: the forward is the composition");
            // The same products either way: gradients equal to rounding (bf16: the same bf16 matmuls).
            for (name, (a, b)) in ["output", "d x", "d weights"].iter().zip(op.iter().zip(&composed)).skip(1) {
                assert_close(&format!("{dtype:?} {name}"), a, b, 1e-6);
            }
            // The expert without rows gets a zero gradient: weights [1, .., ..] are entries 30..60.
            assert!(op[2][30..60].iter().all(|&g| g == 0.0));
        }
        let (op, composed) = grouped::<CpuTrainCheckpointed>(FloatDType::F32);
        for (name, (a, b)) in ["output", "d x", "d weights"].iter().zip(op.iter().zip(&composed)) {
            assert_close(&format!("checkpointed {name}"), a, b, 1e-6);
        }
    }

    /// Parts and the split tensor's gradient through `split_last` and through `narrow_last`, for a loss
    /// that weighs every part but the `unused` one and, with `other_consumer`, reads the split tensor
    /// itself too. The split tensor is a leaf, or with `computed` the output of an op (as a projection's is).
    fn splits<B: ModelBackend + AutodiffBackend>(
        dtype: FloatDType,
        unused: Option<usize>,
        other_consumer: bool,
        computed: bool,
    ) -> [Vec<Vec<f32>>; 2] {
        let device = Default::default();
        let widths = [3, 5, 3, 2];
        let leaf = normal::<B, 4>([2, 3, 2, 13], 0.0, 1.0, 21, &device).cast(dtype).require_grad();
        let r = |seed: u64, width: usize| normal::<B, 4>([2, 3, 2, width], 0.0, 1.0, seed, &device);
        let run = |split: fn(Tensor<B, 4>, [usize; 4]) -> [Tensor<B, 4>; 4]| {
            let x = if computed { leaf.clone() * 1.5 } else { leaf.clone() };
            let parts = split(x.clone(), widths);
            let mut loss = Tensor::<B, 1>::zeros([1], &device);
            for (i, part) in parts.iter().enumerate().filter(|(i, _)| Some(*i) != unused) {
                loss = loss + (part.clone().cast(FloatDType::F32) * r(30 + i as u64, widths[i])).sum();
            }
            if other_consumer {
                loss = loss + (x.cast(FloatDType::F32) * r(40, 13)).sum();
            }
            let grads = loss.backward();
            let mut out: Vec<Vec<f32>> = parts.into_iter().map(values).collect();
            out.push(values(leaf.grad(&grads).expect("d x")));
            out
        };
        [run(B::split_last), run(narrow_last)]
    }

    #[test]
    fn the_split_and_its_backward_equal_narrowing_each_part() {
        // Each entry of the gradient gets one part's value plus the other consumer's: no rounding differs.
        for dtype in [FloatDType::F32, FloatDType::BF16] {
            for (unused, other_consumer, computed) in
                [(None, false, true), (Some(1), true, true), (Some(0), false, true), (None, true, false)]
            {
                let [op, composed] = splits::<CpuTrain>(dtype, unused, other_consumer, computed);
                let case = format!("{dtype:?}, part {unused:?} unused, other consumer {other_consumer}");
                assert_eq!(op, composed, "{case}, computed {computed}");
                let d_x = op.last().expect("d x");
                assert!(d_x.iter().any(|&g| g != 0.0), "{case}: a gradient to compare");
            }
        }
        let [op, composed] = splits::<CpuTrainCheckpointed>(FloatDType::F32, Some(2), true, true);
        assert_eq!(op, composed, "checkpointed");
    }

    /// Output and gradient of `Σ rope(x) ⊙ R + Σ x ⊙ R'` through the op and through `apply_rope`, with `x`
    /// the head-swapped view of a `[batch, seq, heads, d]` leaf (as the models' q and k are) under a
    /// partial rotary width and documents restarting the positions.
    fn ropes<B: ModelBackend + AutodiffBackend>(dtype: FloatDType) -> [[Vec<f32>; 2]; 2] {
        use crate::models::layers::{RopeTables, SequenceLayout};
        let device = Default::default();
        let layout = SequenceLayout::from_doc_lengths(&[vec![3, 4], vec![2, 5]], 7);
        let tables = RopeTables::<B>::new(&layout, 12, 8, 1e4, dtype, &device);
        let leaf = normal::<B, 4>([2, 7, 3, 12], 0.0, 1.0, 41, &device).cast(dtype).require_grad();
        let weights = normal::<B, 4>([2, 3, 7, 12], 0.0, 1.0, 42, &device).cast(dtype);
        let other = normal::<B, 4>([2, 7, 3, 12], 0.0, 1.0, 43, &device).cast(dtype);
        let run = |rope: &dyn Fn(Tensor<B, 4>) -> Tensor<B, 4>| {
            let out = rope(leaf.clone().swap_dims(1, 2));
            let grads = ((out.clone() * weights.clone()).sum() + (leaf.clone() * other.clone()).sum()).backward();
            [values(out), values(leaf.grad(&grads).expect("a gradient"))]
        };
        [run(&|x| B::rope(x, &tables)), run(&|x| apply_rope(x, &tables))]
    }

    #[test]
    fn the_rope_and_its_backward_equal_the_composition_bit_for_bit() {
        for dtype in [FloatDType::F32, FloatDType::BF16] {
            let [op, composed] = ropes::<CpuTrain>(dtype);
            assert_eq!(op, composed, "{dtype:?}");
        }
        let [op, composed] = ropes::<CpuTrainCheckpointed>(FloatDType::F32);
        assert_eq!(op, composed, "checkpointed");
    }

    #[test]
    fn a_plain_backend_runs_the_same_forward() {
        let device = Default::default();
        let tensor = |seed: u64| normal::<Cpu, 2>([4, 6], 0.0, 2.0, seed, &device);
        let (gate, up) = (tensor(1), tensor(2));
        for act in [GateActivation::Silu, GateActivation::GeluTanh] {
            let plain = values(Cpu::glu(gate.clone(), up.clone(), act));
            let tracked =
                CpuTrain::glu(Tensor::from_inner(gate.clone()).require_grad(), Tensor::from_inner(up.clone()), act);
            assert_eq!(plain, values(tracked), "{act:?}");
            assert_close("the composition", &plain, &values(glu_forward(gate.clone(), up.clone(), act)), 1e-6);
        }
    }
}
