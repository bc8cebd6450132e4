//! The gated delta rule, the state update of Gated DeltaNet (Qwen3.5's linear-attention layers), in its two
//! exact forms: the recurrent scan (one token at a time; the reference, and decoding) and the chunked form
//! (chunks of 64 tokens solved with a few matmuls; training and prefill). Documents packed into one row
//! each start from an empty state; the state a call starts from belongs to a named document per row.
//! Training records the chunked form as one autodiff op (`ModelBackend::gated_delta_rule`) whose backward
//! pass (`chunked_backward`) is written by hand and recomputes the chunk solve from the inputs.
//!
//! Per head, with the state `S ∈ R^{dk×dv}`: `S ← S·exp(g_t)`, `δ = β_t (v_t − Sᵀk_t)`, `S ← S + k_t δᵀ`,
//! `o_t = Sᵀ q_t`. q and k arrive L2-normalized and q scaled by 1/√dk; everything runs in f32.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};

use super::ops::{ModelBackend, record_op};
use crate::backend::{host_tensor, zeros_in};

/// Which document each position of a `[batch, seq]` block belongs to, and which document the state a call
/// starts from belongs to (per row): a position continues that state only inside the same document.
#[derive(Debug, Clone, PartialEq)]
pub struct DocSegments {
    pub batch: usize,
    pub seq: usize,
    /// `[batch * seq]`, row-major.
    pub doc_ids: Vec<u32>,
    /// Per row: the document of the initial state.
    pub initial_doc: Vec<u32>,
}

impl DocSegments {
    /// Documents as a training layout gives them; the (empty) initial state belongs to each row's first one.
    pub fn from_doc_ids(batch: usize, seq: usize, doc_ids: Vec<u32>) -> Self {
        let initial_doc = (0..batch).map(|r| doc_ids.get(r * seq).copied().unwrap_or(0)).collect();
        DocSegments { batch, seq, doc_ids, initial_doc }
    }

    fn doc(&self, row: usize, t: usize) -> u32 {
        self.doc_ids[row * self.seq + t]
    }

    /// Whether position `t` of `row` carries the state of position `t − 1` (or the initial state at `t = 0`).
    fn continues(&self, row: usize, t: usize) -> bool {
        let before = if t == 0 { self.initial_doc[row] } else { self.doc(row, t - 1) };
        self.doc(row, t) == before
    }
}

/// The inputs of one scan, heads first: `q`, `k` `[batch, heads, seq, dk]`, `v` `[batch, heads, seq, dv]`,
/// log-decays `g` and rates `beta` `[batch, heads, seq]`.
pub struct ScanInputs<B: Backend> {
    pub q: Tensor<B, 4>,
    pub k: Tensor<B, 4>,
    pub v: Tensor<B, 4>,
    pub g: Tensor<B, 3>,
    pub beta: Tensor<B, 3>,
}

impl<B: Backend> ScanInputs<B> {
    fn into_f32(self) -> Self {
        ScanInputs {
            q: self.q.cast(FloatDType::F32),
            k: self.k.cast(FloatDType::F32),
            v: self.v.cast(FloatDType::F32),
            g: self.g.cast(FloatDType::F32),
            beta: self.beta.cast(FloatDType::F32),
        }
    }
}

/// The reference: one token at a time. Returns the outputs `[batch, heads, seq, dv]` (f32) and the final
/// state `[batch, heads, dk, dv]`.
pub fn recurrent<B: Backend>(
    inputs: ScanInputs<B>,
    segments: &DocSegments,
    initial: Option<Tensor<B, 4>>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let ScanInputs { q, k, v, g, beta } = inputs.into_f32();
    let [batch, heads, seq, dk] = k.dims();
    let dv = v.dims()[3];
    let device = q.device();
    let mut state =
        initial.unwrap_or_else(|| zeros_in([batch, heads, dk, dv], FloatDType::F32, &device)).cast(FloatDType::F32);
    let keep: Vec<f32> = (0..seq)
        .flat_map(|t| (0..batch).map(move |r| (r, t)))
        .map(|(r, t)| f32::from(u8::from(segments.continues(r, t))))
        .collect();
    let keep = host_tensor::<B, 2>(keep, [seq, batch], FloatDType::F32, &device);
    let mut outputs = Vec::with_capacity(seq);
    for t in 0..seq {
        let at = |x: &Tensor<B, 4>| x.clone().narrow(2, t, 1); // [B, H, 1, d]
        let (q_t, k_t, v_t) = (at(&q), at(&k), at(&v));
        let decay = g.clone().narrow(2, t, 1).exp().unsqueeze_dim::<4>(3); // [B, H, 1, 1]
        let keep_t = keep.clone().narrow(0, t, 1).reshape([batch, 1, 1, 1]);
        state = state * decay * keep_t;
        let beta_t = beta.clone().narrow(2, t, 1).unsqueeze_dim::<4>(3);
        let predicted = k_t.clone().matmul(state.clone()); // [B, H, 1, dv]
        let delta = (v_t - predicted) * beta_t;
        state = state + k_t.swap_dims(2, 3).matmul(delta);
        outputs.push(q_t.matmul(state.clone()));
    }
    (Tensor::cat(outputs, 2), state)
}

/// `(I + L)⁻¹` for strictly lower-triangular `L` `[..., C, C]` (C a power of two) by recursive block
/// doubling: with `T` the inverse of the block-diagonal part at block size `s`, `N` the part of `L` joining
/// pairs of those blocks, `(M + N)⁻¹ = T − T N T` exactly (`N T N = 0`). log₂ C rounds of two matmuls, each
/// block solved from exact sub-solutions as forward substitution would: no power series, no cancellation.
/// `bridges_kept[r]` keeps round `r`'s joining entries only. The CubeCL backends solve by
/// forward substitution in one kernel instead (`ModelBackend::unit_lower_inverse`, `kernels::chunk_solve`).
pub fn unit_lower_inverse<B: Backend>(l: Tensor<B, 5>, plan: &ChunkPlan<B>) -> Tensor<B, 5> {
    // Every round's bridge first: one element-wise kernel on the fused backends.
    let mut bridges = plan.bridges_kept.iter().map(|kept| l.clone() * kept.clone()).collect::<Vec<_>>().into_iter();
    // The first round's blocks are 1×1 with inverse 1: `I − I N I` is `I − N`, no matmul needed.
    let mut inverse = match bridges.next() {
        Some(first) => plan.identity.clone() - first,
        None => l.zeros_like() + plan.identity.clone(),
    };
    for bridge in bridges {
        inverse = inverse.clone() - inverse.clone().matmul(bridge).matmul(inverse);
    }
    inverse
}

/// Everything the chunked form needs from the document layout, built once per layout and shared by every
/// DeltaNet layer of a forward pass (the masks are host work).
#[derive(Debug, Clone)]
pub struct ChunkPlan<B: Backend> {
    size: usize,
    seq: usize,
    chunks: usize,
    /// `[batch, seq]` on the host: position `t` carries the state of `t − 1` (the loop form's reset).
    carries: Vec<bool>,
    /// `[batch, 1, chunks, C, C]`, f32: 0 where `j ≤ i` inside one document, else −∞ (added before `exp`).
    ///
    /// The plan's masks are float factors and terms, not bool masks: on CUDA, burn-fusion 0.21 fuses a
    /// `mask_fill` after a matmul into the matmul and picks the bool operand's 16-wide vectors (one byte an
    /// element), which the matmul's 8-wide tiles reject when the kernel compiles (a Qwen3.5 step failed so on
    /// an H200).
    blocked_bias: Tensor<B, 5>,
    /// `[batch, 1, chunks, C]`: position `t` still carries the state the chunk started from.
    carry: Tensor<B, 4>,
    /// `[batch, 1, chunks, C]`: position `j` is in the chunk's last document (its update reaches the end state).
    reaches_end: Tensor<B, 4>,
    /// Per doubling round of `unit_lower_inverse`, `[1, 1, 1, C, C]`, f32: 1 on the round's joining entries.
    bridges_kept: Vec<Tensor<B, 5>>,
    /// `[1, 1, 1, C, C]`: the identity, f32.
    identity: Tensor<B, 5>,
    /// `[1, 1, 1, C, C]`, f32: 1 below the diagonal, 0 on and above it (where a strictly lower matrix is 0).
    strictly_lower: Tensor<B, 5>,
    /// `[1, 1, 1, C]`: 1 at a chunk's last position, else 0.
    last_position: Tensor<B, 4>,
}

impl<B: Backend> ChunkPlan<B> {
    /// The plan for `segments` in chunks of `size` (a power of two).
    pub fn new(segments: &DocSegments, size: usize, device: &B::Device) -> Self {
        assert!(size.is_power_of_two(), "scan chunk {size} is not a power of two");
        let (batch, seq) = (segments.batch, segments.seq);
        let chunks = seq.div_ceil(size).max(1);
        let padded = chunks * size;
        let mut blocked_bias = vec![f32::NEG_INFINITY; batch * padded * size];
        let mut carry = vec![0.0; batch * padded];
        let mut reaches_end = vec![0.0; batch * padded];
        let carries = (0..batch * seq).map(|rt| segments.continues(rt / seq, rt % seq)).collect();
        for row in 0..batch {
            // Padding past the sequence continues the last document with zero keys: it changes nothing.
            let docs: Vec<u32> = (0..padded).map(|t| segments.doc(row, t.min(seq.saturating_sub(1)))).collect();
            let continues = |t: usize| t >= seq || segments.continues(row, t);
            for n in 0..chunks {
                let base = n * size;
                let mut carried = true;
                for i in 0..size {
                    carried = carried && continues(base + i);
                    carry[row * padded + base + i] = f32::from(u8::from(carried));
                    reaches_end[row * padded + base + i] = f32::from(u8::from(docs[base + i] == docs[base + size - 1]));
                    for j in 0..=i {
                        if docs[base + i] == docs[base + j] {
                            blocked_bias[((row * padded) + base + i) * size + j] = 0.0;
                        }
                    }
                }
            }
        }
        let per_position =
            |m: Vec<f32>| host_tensor::<B, 3>(m, [batch, chunks, size], FloatDType::F32, device).unsqueeze_dim::<4>(1);
        let square = |m: Vec<f32>| host_tensor::<B, 5>(m, [1, 1, 1, size, size], FloatDType::F32, device);
        let mut bridges_kept = Vec::new();
        let mut block = 1;
        while block < size {
            // The entries in the same 2s-block, below it in another s-block.
            let kept = (0..size * size).map(|ij| {
                let (i, j) = (ij / size, ij % size);
                f32::from(u8::from(i / (2 * block) == j / (2 * block) && i / block != j / block && i > j))
            });
            bridges_kept.push(square(kept.collect()));
            block *= 2;
        }
        ChunkPlan {
            size,
            seq,
            chunks,
            carries,
            blocked_bias: host_tensor::<B, 4>(blocked_bias, [batch, chunks, size, size], FloatDType::F32, device)
                .unsqueeze_dim::<5>(1),
            carry: per_position(carry),
            reaches_end: per_position(reaches_end),
            bridges_kept,
            identity: Tensor::<B, 2>::eye(size, device).cast(FloatDType::F32).unsqueeze::<5>(),
            strictly_lower: square((0..size * size).map(|ij| f32::from(u8::from(ij / size > ij % size))).collect()),
            last_position: host_tensor::<B, 4>(
                (0..size).map(|i| f32::from(u8::from(i == size - 1))).collect(),
                [1, 1, 1, size],
                FloatDType::F32,
                device,
            ),
        }
    }
}

impl<B: Backend> ChunkPlan<B> {
    /// Tokens per chunk.
    pub fn size(&self) -> usize {
        self.size
    }

    /// `[batch, seq]`: whether each position carries the state of the one before it.
    pub fn carries(&self) -> &[bool] {
        &self.carries
    }
}

impl<B: AutodiffBackend> ChunkPlan<B> {
    /// The same plan on the inner backend (the masks carry no gradient).
    fn inner(&self) -> ChunkPlan<B::InnerBackend> {
        ChunkPlan {
            size: self.size,
            seq: self.seq,
            chunks: self.chunks,
            carries: self.carries.clone(),
            blocked_bias: self.blocked_bias.clone().inner(),
            carry: self.carry.clone().inner(),
            reaches_end: self.reaches_end.clone().inner(),
            bridges_kept: self.bridges_kept.iter().map(|m| m.clone().inner()).collect(),
            identity: self.identity.clone().inner(),
            strictly_lower: self.strictly_lower.clone().inner(),
            last_position: self.last_position.clone().inner(),
        }
    }
}

/// `ModelBackend::gated_delta_rule` on an autodiff backend: `chunked_scan` from an empty state on the inner
/// backend, recorded as one op whose backward is `chunked_backward`. It keeps the five inputs (through the
/// checkpointer) and the state each chunk starts from, where burn's composition keeps every intermediate of
/// the chunk solve and, per chunk of the scan, gives each slice it reads a full-size gradient.
pub(super) fn tracked_gated_delta_rule<B: ModelBackend, C: CheckpointStrategy>(
    inputs: ScanInputs<Autodiff<B, C>>,
    plan: &ChunkPlan<Autodiff<B, C>>,
) -> Tensor<Autodiff<B, C>, 4> {
    let ScanInputs { q, k, v, g, beta } = inputs;
    let (q, k, v) = (q.into_primitive().tensor(), k.into_primitive().tensor(), v.into_primitive().tensor());
    let (g, beta) = (g.into_primitive().tensor(), beta.into_primitive().tensor());
    let inner_plan = plan.inner();
    let float = |t: &FloatTensor<B>| TensorPrimitive::Float(t.clone());
    let scan = B::delta_rule_scan(
        ScanInputs {
            q: Tensor::from_primitive(float(&q.primitive)),
            k: Tensor::from_primitive(float(&k.primitive)),
            v: Tensor::from_primitive(float(&v.primitive)),
            g: Tensor::from_primitive(float(&g.primitive)),
            beta: Tensor::from_primitive(float(&beta.primitive)),
        },
        &inner_plan,
        None,
    );
    let out = scan.out.into_primitive().tensor();
    let chunk_states = scan.chunk_states.into_primitive().tensor();
    let output = record_op::<C, _, _, _, _>(GatedDeltaRuleBackward, [&q, &k, &v, &g, &beta], out, |inputs| SavedScan {
        inputs,
        chunk_states,
        plan: inner_plan,
    });
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// What the backward pass needs: q, k, v, g, β through the checkpointer, the chunk states, the plan.
#[derive(Debug, Clone)]
struct SavedScan<B: Backend> {
    inputs: [NodeId; 5],
    chunk_states: FloatTensor<B>,
    plan: ChunkPlan<B>,
}

#[derive(Debug)]
struct GatedDeltaRuleBackward;

impl<B: ModelBackend> Backward<B, 5> for GatedDeltaRuleBackward {
    type State = SavedScan<B>;

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let saved = ops.state;
        let grad_out = grads.consume::<B>(&ops.node);
        if ops.parents.iter().all(Option::is_none) {
            return;
        }
        let [q, k, v, g, beta] = saved.inputs.map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        let inputs = ScanInputs {
            q: Tensor::from_primitive(TensorPrimitive::Float(q)),
            k: Tensor::from_primitive(TensorPrimitive::Float(k)),
            v: Tensor::from_primitive(TensorPrimitive::Float(v)),
            g: Tensor::from_primitive(TensorPrimitive::Float(g)),
            beta: Tensor::from_primitive(TensorPrimitive::Float(beta)),
        };
        let chunk_states = Tensor::from_primitive(TensorPrimitive::Float(saved.chunk_states));
        let d = B::delta_rule_backward(
            inputs,
            &saved.plan,
            chunk_states,
            Tensor::from_primitive(TensorPrimitive::Float(grad_out)),
        );
        let gradients = [
            d.q.into_primitive().tensor(),
            d.k.into_primitive().tensor(),
            d.v.into_primitive().tensor(),
            d.g.into_primitive().tensor(),
            d.beta.into_primitive().tensor(),
        ];
        for (parent, grad) in ops.parents.into_iter().zip(gradients) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Every quantity of the chunked form inside the chunks, `[batch, heads, chunks, C, ·]` in f32 (inputs
/// padded to whole chunks): what the scan across chunks consumes, and what the hand-written backward pass
/// (`chunked_backward`) recomputes instead of keeping.
struct ChunkForm<B: Backend> {
    q: Tensor<B, 5>,
    k: Tensor<B, 5>,
    v: Tensor<B, 5>,
    beta: Tensor<B, 4>,
    /// `exp(cum_i − cum_j)` for `j ≤ i` in one document, else 0 (`cum` the in-chunk cumulative log-decay).
    decay: Tensor<B, 5>,
    k_beta: Tensor<B, 5>,
    v_beta: Tensor<B, 5>,
    /// `k_β kᵀ` before the decay and the strictly-lower mask.
    key_products: Tensor<B, 5>,
    /// `T = (I + L)⁻¹`, `L` the strictly lower `k_β kᵀ ⊙ decay`.
    inverse: Tensor<B, 5>,
    /// `exp(cum)`, 0 once a new document began in the chunk.
    from_start: Tensor<B, 4>,
    /// `exp(cum_last − cum)` for positions in the chunk's last document, else 0.
    to_end: Tensor<B, 4>,
    /// `U = T v_β`: the chunk's value corrections before the carried state is subtracted.
    new_values: Tensor<B, 5>,
    /// `k_β ⊙ from_start`.
    keys_from_start: Tensor<B, 5>,
    /// `W = T (k_β ⊙ from_start)`: how much of the carried state each correction subtracts.
    state_reads: Tensor<B, 5>,
    /// `q kᵀ`, and `intra = q kᵀ ⊙ decay`: the chunk's own contributions to its outputs.
    scores: Tensor<B, 5>,
    intra: Tensor<B, 5>,
    q_decayed: Tensor<B, 5>,
    k_decayed: Tensor<B, 5>,
    /// `[batch, heads, chunks]`: the decay across the whole chunk.
    chunk_decay: Tensor<B, 3>,
}

/// The chunked form's outputs and states.
pub struct ChunkedScan<B: Backend> {
    /// `[batch, heads, seq, dv]`, f32.
    pub out: Tensor<B, 4>,
    /// The state each chunk starts from, `[batch, heads, chunks, dk, dv]`.
    pub chunk_states: Tensor<B, 5>,
    /// The state after the last position, `[batch, heads, dk, dv]`.
    pub last: Tensor<B, 4>,
}

/// `x` padded with zeros along dim 2 to `len`.
fn pad_to<B: Backend, const D: usize>(x: Tensor<B, D>, len: usize) -> Tensor<B, D> {
    let mut dims = x.dims();
    if dims[2] >= len {
        return x;
    }
    dims[2] = len - dims[2];
    let zeros = zeros_in::<B, D>(dims, FloatDType::F32, &x.device());
    Tensor::cat(vec![x, zeros], 2)
}

/// `[batch, heads, seq, d]` → `[batch, heads, chunks, C, d]`, padded with zeros (the padding continues the
/// last document with zero keys, values and rates: it changes nothing).
fn into_chunks<B: Backend>(x: Tensor<B, 4>, plan: &ChunkPlan<B>) -> Tensor<B, 5> {
    let [batch, heads, _, d] = x.dims();
    pad_to(x, plan.chunks * plan.size).reshape([batch, heads, plan.chunks, plan.size, d])
}

/// The inverse of `into_chunks`.
fn from_chunks<B: Backend>(x: Tensor<B, 5>, seq: usize) -> Tensor<B, 4> {
    let [batch, heads, chunks, size, d] = x.dims();
    x.reshape([batch, heads, chunks * size, d]).narrow(2, 0, seq)
}

// The fused CubeCL backends compile a run of element-wise ops with one output shape into one kernel and end
// it where the shape changes (or at a matmul, slice or scan): the quantities are computed grouped by shape —
// per position `[b, h, n, C]`, per pair `[.., C, C]`, per key `[.., C, dk]` — rather than as the formulas
// first need them, which made many of them kernels of their own. The decays come before q, k and v are cut
// into chunks: burn-fusion 0.21 runs every op of a block opened by one it cannot fuse (the cumulative sum)
// as a kernel of its own, and the block stays open to the ops that follow while another (those reshapes) is
// still being explored.
fn chunk_form<B: ModelBackend>(inputs: ScanInputs<B>, plan: &ChunkPlan<B>) -> ChunkForm<B> {
    let ScanInputs { q, k, v, g, beta } = inputs.into_f32();
    let [batch, heads, seq, _] = k.dims();
    assert_eq!(seq, plan.seq, "the plan was made for another sequence length");
    let (size, chunks) = (plan.size, plan.chunks);
    let per_position = |x: Tensor<B, 3>| pad_to(x, chunks * size).reshape([batch, heads, chunks, size]);
    let cum = per_position(g).cumsum(3);
    let last = cum.clone().narrow(3, size - 1, 1);
    let from_start = cum.clone().exp() * plan.carry.clone();
    let to_end = (last - cum.clone()).exp() * plan.reaches_end.clone();
    // Masked before exp: no overflow from the blocked (future or other-document) entries.
    let gap = cum.clone().unsqueeze_dim::<5>(4) - cum.unsqueeze_dim::<5>(3);
    let decay = (gap + plan.blocked_bias.clone()).exp();
    let beta = per_position(beta);
    let (q, k, v) = (into_chunks(q, plan), into_chunks(k, plan), into_chunks(v, plan));
    let along = |x: &Tensor<B, 4>| x.clone().unsqueeze_dim::<5>(4);
    let k_beta = k.clone() * along(&beta);
    let q_decayed = q.clone() * along(&from_start);
    let k_decayed = k.clone() * along(&to_end);
    let keys_from_start = k_beta.clone() * along(&from_start);
    let v_beta = v.clone() * along(&beta);
    let key_products = k_beta.clone().matmul(k.clone().swap_dims(3, 4));
    let scores = q.clone().matmul(k.clone().swap_dims(3, 4));
    let lower = key_products.clone() * decay.clone() * plan.strictly_lower.clone();
    let intra = scores.clone() * decay.clone();
    let inverse = B::unit_lower_inverse(lower, plan);
    let new_values = inverse.clone().matmul(v_beta.clone());
    let state_reads = inverse.clone().matmul(keys_from_start.clone());
    let chunk_decay = from_start.clone().narrow(3, size - 1, 1).reshape([batch, heads, chunks]);
    ChunkForm {
        q,
        k,
        v,
        beta,
        decay,
        k_beta,
        v_beta,
        key_products,
        inverse,
        from_start,
        to_end,
        new_values,
        keys_from_start,
        state_reads,
        scores,
        intra,
        q_decayed,
        k_decayed,
        chunk_decay,
    }
}

/// Chunk `n` of a `[batch, heads, chunks, C, d]` tensor, `[batch, heads, C, d]`.
fn chunk_at<B: Backend>(x: &Tensor<B, 5>, n: usize) -> Tensor<B, 4> {
    let [b, h, _, c, d] = x.dims();
    x.clone().narrow(2, n, 1).reshape([b, h, c, d])
}

/// Chunk `n`'s decay `[batch, heads, 1, 1]`.
fn decay_at<B: Backend>(chunk_decay: &Tensor<B, 3>, n: usize) -> Tensor<B, 4> {
    let [b, h, _] = chunk_decay.dims();
    chunk_decay.clone().narrow(2, n, 1).reshape([b, h, 1, 1])
}

/// The chunked form (transformers' `torch_chunk_gated_delta_rule` with document resets): inside a chunk the
/// delta-rule updates are one triangular solve, across chunks a scan over `seq / size` steps that carries
/// only the state; the outputs are then one batched product over all chunks. Equal to `recurrent` up to
/// float rounding. Returns the outputs `[batch, heads, seq, dv]` (f32) and the final state.
pub fn chunked<B: ModelBackend>(
    inputs: ScanInputs<B>,
    plan: &ChunkPlan<B>,
    initial: Option<Tensor<B, 4>>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let scan = chunked_scan(inputs, plan, initial);
    (scan.out, scan.last)
}

/// `chunked`, also returning the state every chunk starts from (what its backward pass needs).
pub fn chunked_scan<B: ModelBackend>(
    inputs: ScanInputs<B>,
    plan: &ChunkPlan<B>,
    initial: Option<Tensor<B, 4>>,
) -> ChunkedScan<B> {
    let seq = inputs.q.dims()[2];
    let form = chunk_form(inputs, plan);
    let [batch, heads, _, _, dk] = form.k.dims();
    let dv = form.v.dims()[4];
    let initial = initial
        .unwrap_or_else(|| zeros_in([batch, heads, dk, dv], FloatDType::F32, &form.q.device()))
        .cast(FloatDType::F32);
    let scan = B::chunk_recurrence(ChunkRecurrence {
        reads: form.state_reads,
        base: form.new_values,
        writes: form.k_decayed,
        decay: form.chunk_decay,
        extra: None,
        initial,
        direction: Direction::Forward,
    });
    let out = form.q_decayed.matmul(scan.states.clone()) + form.intra.matmul(scan.corrections);
    ChunkedScan { out: from_chunks(out, seq), chunk_states: scan.states, last: scan.last }
}

/// Which pass of the scan across chunks a `ChunkRecurrence` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// The state forwards: `c_n = base_n − R_n S`, `S ← a_n S + Q_nᵀ c_n`.
    Forward,
    /// The state gradient backwards from the last chunk (from zero):
    /// `c_n = base_n + R_n S`, `S ← a_n S + extra_n − Q_nᵀ c_n`.
    Backward,
}

/// The sequential part of the chunked form, the scan across chunks, in either pass (`Direction`) — every
/// tensor f32, `B, H` batch and heads, `N` chunks of `C` positions. Everything else is batched over all
/// chunks; this part runs chunk after chunk, so as tensor ops it costs several kernel launches per chunk
/// (`recurrence_by_chunk`; `ModelBackend::chunk_recurrence` may run it as one kernel instead).
pub struct ChunkRecurrence<B: Backend> {
    /// `R` `[B, H, N, C, dk]`: forwards the state reads `W`, backwards the decayed keys.
    pub reads: Tensor<B, 5>,
    /// `base` `[B, H, N, C, dv]`: forwards the corrections `U`, backwards their share of the outputs' gradient.
    pub base: Tensor<B, 5>,
    /// `Q` `[B, H, N, C, dk]`: forwards the decayed keys, backwards the state reads.
    pub writes: Tensor<B, 5>,
    /// `a` `[B, H, N]`: each chunk's decay of the state.
    pub decay: Tensor<B, 3>,
    /// `extra` `[B, H, N, dk, dv]` added to the state at each chunk (backwards: the outputs' gradient into
    /// the state); none forwards.
    pub extra: Option<Tensor<B, 5>>,
    /// The state before the first chunk of the pass, `[B, H, dk, dv]`.
    pub initial: Tensor<B, 4>,
    pub direction: Direction,
}

/// What a `ChunkRecurrence` produces.
pub struct RecurrenceOut<B: Backend> {
    /// The state each chunk is entered with, `[B, H, N, dk, dv]` (backwards: the gradient of the state that
    /// chunk leaves).
    pub states: Tensor<B, 5>,
    /// `c_n`, `[B, H, N, C, dv]`.
    pub corrections: Tensor<B, 5>,
    /// The state after the pass's last chunk, `[B, H, dk, dv]`.
    pub last: Tensor<B, 4>,
}

/// The scan across chunks as tensor ops, one chunk at a time: the reference every backend can run.
pub fn recurrence_by_chunk<B: Backend>(rec: ChunkRecurrence<B>) -> RecurrenceOut<B> {
    let chunks = rec.reads.dims()[2];
    let forward = rec.direction == Direction::Forward;
    let mut state = rec.initial;
    let (mut states, mut corrections) = (Vec::with_capacity(chunks), Vec::with_capacity(chunks));
    let order: Box<dyn Iterator<Item = usize>> =
        if forward { Box::new(0..chunks) } else { Box::new((0..chunks).rev()) };
    for n in order {
        states.push(state.clone());
        let read = chunk_at(&rec.reads, n).matmul(state.clone());
        let correction = if forward { chunk_at(&rec.base, n) - read } else { chunk_at(&rec.base, n) + read };
        let written = chunk_at(&rec.writes, n).swap_dims(2, 3).matmul(correction.clone());
        let decayed = state * decay_at(&rec.decay, n);
        state = match (&rec.extra, forward) {
            (None, true) => decayed + written,
            (None, false) => decayed - written,
            (Some(extra), true) => decayed + chunk_at(extra, n) + written,
            (Some(extra), false) => decayed + chunk_at(extra, n) - written,
        };
        corrections.push(correction);
    }
    if !forward {
        states.reverse();
        corrections.reverse();
    }
    RecurrenceOut { states: Tensor::stack(states, 2), corrections: Tensor::stack(corrections, 2), last: state }
}

/// `Σ` over the last dimension of a `[.., C, d]` tensor, `[.., C]`.
fn row_sums<B: Backend>(x: Tensor<B, 5>) -> Tensor<B, 4> {
    let [b, h, n, c, _] = x.dims();
    x.sum_dim(4).reshape([b, h, n, c])
}

/// What the per-position gradients of `chunked_backward` read, all f32 and cut into chunks: pairs of
/// `[batch, heads, chunks, C, d]` tensors whose rows' dot products they take, the gradient of the decays'
/// exponents `d_gap` `[.., C, C]`, the per-position decays `[batch, heads, chunks, C]`, and the gradient of
/// each chunk's decay `[batch, heads, chunks, 1]` (from the states, reduced where they are last read).
pub struct DecayGradInputs<B: Backend> {
    pub d_k_decayed: Tensor<B, 5>,
    pub k: Tensor<B, 5>,
    pub d_q_decayed: Tensor<B, 5>,
    pub q: Tensor<B, 5>,
    pub neg_d_keys_from_start: Tensor<B, 5>,
    pub k_beta: Tensor<B, 5>,
    pub d_k_beta: Tensor<B, 5>,
    pub d_v_beta: Tensor<B, 5>,
    pub v: Tensor<B, 5>,
    pub d_gap: Tensor<B, 5>,
    pub to_end: Tensor<B, 4>,
    pub from_start: Tensor<B, 4>,
    pub d_chunk_decay: Tensor<B, 4>,
}

/// The gradients of the log-decays `g` and the rates `β` per position, `[batch, heads, chunks, C]` each (f32):
/// the rows' dot products, the decays' exponents through the within-chunk cumulative sum (`dg` is the
/// reverse cumulative sum of `d cum`), as tensor ops. The CubeCL backends run it as one kernel
/// (`kernels::decay_grads`), where these are some twenty kernels a DeltaNet layer.
pub fn decay_grads<B: Backend>(x: DecayGradInputs<B>, plan: &ChunkPlan<B>) -> [Tensor<B, 4>; 2] {
    // Per position: to_end = exp(cum_last − cum) on the last document, from_start = exp(cum) (0 after a
    // document start), whose last entry is the chunk's decay; both added at the last position as a one-hot
    // product (a slice and a concatenation would be three kernels).
    let d_end_gap = row_sums(x.d_k_decayed * x.k.clone()) * x.to_end;
    let d_from_start = row_sums(x.d_q_decayed * x.q) - row_sums(x.neg_d_keys_from_start * x.k_beta)
        + x.d_chunk_decay * plan.last_position.clone();
    let d_beta = row_sums(x.d_k_beta * x.k) + row_sums(x.d_v_beta * x.v);
    let [b, h, n, c, _] = x.d_gap.dims();
    let (gap_rows, gap_columns) =
        (x.d_gap.clone().sum_dim(4).reshape([b, h, n, c]), x.d_gap.sum_dim(3).reshape([b, h, n, c]));
    let d_last = d_end_gap.clone().sum_dim(3);
    let d_cum =
        d_end_gap.neg() + gap_rows - gap_columns + d_from_start * x.from_start + d_last * plan.last_position.clone();
    // cum = cumsum(g) within the chunk.
    [d_cum.flip([3]).cumsum(3).flip([3]), d_beta]
}

/// Gradients of `chunked_scan(inputs, plan, None).out` for the output gradient `grad_out`
/// `[batch, heads, seq, dv]`, given the state every chunk started from (`chunk_states`), as `ScanInputs`
/// in the inputs' dtypes. Everything inside the chunks is recomputed; across chunks the state gradient
/// runs backwards, `dS_n = a_n dS_{n+1} + Qd_nᵀ dO_n − W_nᵀ dU'_n` with `dU'_n = A_nᵀ dO_n + Kd_n dS_{n+1}`;
/// the rest is batched over all chunks: through the triangular solve (`dL = −Tᵀ dT Tᵀ`), the decays
/// (`d cum` from every `exp` of a cumulative-sum difference) and the cumulative sum itself (`dg` its
/// reverse cumulative sum).
pub fn chunked_backward<B: ModelBackend>(
    inputs: ScanInputs<B>,
    plan: &ChunkPlan<B>,
    chunk_states: Tensor<B, 5>,
    grad_out: Tensor<B, 4>,
) -> ScanInputs<B> {
    let dtypes = [&inputs.q, &inputs.k, &inputs.v].map(|x| FloatDType::from(x.dtype()));
    let (g_dtype, beta_dtype) = (FloatDType::from(inputs.g.dtype()), FloatDType::from(inputs.beta.dtype()));
    let seq = inputs.q.dims()[2];
    let f = chunk_form(inputs, plan);
    let [batch, heads, chunks, size, dk] = f.k.dims();
    let dv = f.v.dims()[4];
    let device = f.q.device();
    let d_out = into_chunks(grad_out.cast(FloatDType::F32), plan);

    // The scan across chunks.
    let corrected = f.new_values.clone() - f.state_reads.clone().matmul(chunk_states.clone());
    let d_intra = d_out.clone().matmul(corrected.clone().swap_dims(3, 4));
    let d_q_decayed = d_out.clone().matmul(chunk_states.clone().swap_dims(3, 4));
    let from_outputs = f.intra.clone().swap_dims(3, 4).matmul(d_out.clone());
    let into_states = f.q_decayed.clone().swap_dims(3, 4).matmul(d_out);
    let scan = B::chunk_recurrence(ChunkRecurrence {
        reads: f.k_decayed.clone(),
        base: from_outputs,
        writes: f.state_reads.clone(),
        decay: f.chunk_decay.clone(),
        extra: Some(into_states),
        initial: zeros_in::<B, 4>([batch, heads, dk, dv], FloatDType::F32, &device),
        direction: Direction::Backward,
    });
    let (d_next, d_new_values) = (scan.states, scan.corrections);
    // Grouped by output shape as `chunk_form` is; the gradients of `state_reads` and `keys_from_start` are
    // carried negated (`neg_…`), so that no negation follows a matmul as a kernel of its own.
    let neg_d_state_reads = d_new_values.clone().matmul(chunk_states.clone().swap_dims(3, 4));
    let d_k_decayed = corrected.matmul(d_next.clone().swap_dims(3, 4));
    let d_chunk_decay = (chunk_states * d_next).sum_dim(4).sum_dim(3).reshape([batch, heads, chunks, 1]);
    let along = |x: &Tensor<B, 4>| x.clone().unsqueeze_dim::<5>(4);

    // intra = (q kᵀ) ⊙ decay.
    let d_scores = d_intra.clone() * f.decay.clone();
    let d_decay_of_scores = d_intra * f.scores;
    let d_q_of_scores = d_scores.clone().matmul(f.k.clone());
    let d_k_of_scores = d_scores.swap_dims(3, 4).matmul(f.q.clone());
    // new_values = T v_β, state_reads = T (k_β ⊙ from_start).
    let inverse_t = f.inverse.swap_dims(3, 4);
    let d_v_beta = inverse_t.clone().matmul(d_new_values.clone());
    let neg_d_keys_from_start = inverse_t.clone().matmul(neg_d_state_reads.clone());
    let d_inverse =
        d_new_values.matmul(f.v_beta.swap_dims(3, 4)) - neg_d_state_reads.matmul(f.keys_from_start.swap_dims(3, 4));
    // T = (I + L)⁻¹, L strictly lower: dL = −Tᵀ dT Tᵀ. L = (k_β kᵀ) ⊙ decay; decay = exp(cum_i − cum_j) (0
    // where blocked).
    let d_lower = inverse_t.clone().matmul(d_inverse).matmul(inverse_t).neg() * plan.strictly_lower.clone();
    let d_products = d_lower.clone() * f.decay.clone();
    let d_gap = (d_decay_of_scores + d_lower * f.key_products) * f.decay;
    let d_k_beta_of_products = d_products.clone().matmul(f.k.clone());
    let d_k_of_products = d_products.swap_dims(3, 4).matmul(f.k_beta.clone());

    // Per key: k_decayed = k ⊙ to_end, q_decayed = q ⊙ from_start, k_β = k ⊙ β, v_β = v ⊙ β.
    let beta = along(&f.beta);
    let d_k_beta = d_k_beta_of_products - neg_d_keys_from_start.clone() * along(&f.from_start);
    let d_q = d_q_decayed.clone() * along(&f.from_start) + d_q_of_scores;
    let d_k =
        d_k_decayed.clone() * along(&f.to_end) + d_k_of_scores + d_k_of_products + d_k_beta.clone() * beta.clone();
    let d_v = d_v_beta.clone() * beta;
    let [d_g, d_beta] = B::delta_rule_decay_grads(
        DecayGradInputs {
            d_k_decayed,
            k: f.k,
            d_q_decayed,
            q: f.q,
            neg_d_keys_from_start,
            k_beta: f.k_beta,
            d_k_beta,
            d_v_beta,
            v: f.v,
            d_gap,
            to_end: f.to_end,
            from_start: f.from_start,
            d_chunk_decay,
        },
        plan,
    );
    let per_position = |x: Tensor<B, 4>| x.reshape([batch, heads, chunks * size]).narrow(2, 0, seq);
    ScanInputs {
        q: from_chunks(d_q, seq).cast(dtypes[0]),
        k: from_chunks(d_k, seq).cast(dtypes[1]),
        v: from_chunks(d_v, seq).cast(dtypes[2]),
        g: per_position(d_g).cast(g_dtype),
        beta: per_position(d_beta).cast(beta_dtype),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use burn::tensor::Distribution;

    type B = Cpu;

    fn l2(x: Tensor<B, 4>) -> Tensor<B, 4> {
        let norm = (x.clone().powf_scalar(2.0).sum_dim(3) + 1e-6).sqrt();
        x / norm
    }

    fn random_inputs(batch: usize, heads: usize, seq: usize, dk: usize, dv: usize) -> ScanInputs<B> {
        let device = Default::default();
        let n = |shape: [usize; 4]| Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let u = |shape: [usize; 3]| Tensor::<B, 3>::random(shape, Distribution::Uniform(0.0, 1.0), &device);
        ScanInputs {
            q: l2(n([batch, heads, seq, dk])) * (1.0 / (dk as f64).sqrt()),
            k: l2(n([batch, heads, seq, dk])),
            v: n([batch, heads, seq, dv]),
            g: u([batch, heads, seq]).neg() * 0.5,
            beta: u([batch, heads, seq]),
        }
    }

    fn clone_inputs(x: &ScanInputs<B>) -> ScanInputs<B> {
        ScanInputs { q: x.q.clone(), k: x.k.clone(), v: x.v.clone(), g: x.g.clone(), beta: x.beta.clone() }
    }

    fn max_abs_diff<const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    #[test]
    fn chunked_equals_recurrent_across_chunks_and_documents() {
        // Rows: one document over 2.5 chunks; three documents, one crossing a chunk boundary; padding tail.
        let (batch, heads, seq, dk, dv, size) = (3, 2, 21, 4, 3, 8);
        let mut docs = vec![0u32; seq];
        docs.extend((0..seq).map(|t| {
            if t < 5 {
                0
            } else if t < 13 {
                1
            } else {
                2
            }
        }));
        docs.extend((0..seq).map(|t| if t < 17 { 0 } else { t as u32 - 16 }));
        let segments = DocSegments::from_doc_ids(batch, seq, docs);
        let inputs = random_inputs(batch, heads, seq, dk, dv);
        let (a, sa) = recurrent(clone_inputs(&inputs), &segments, None);
        let (b, sb) = chunked(inputs, &ChunkPlan::new(&segments, size, &Default::default()), None);
        assert!(max_abs_diff(a, b) < 1e-5);
        assert!(max_abs_diff(sa, sb) < 1e-5);
    }

    #[test]
    fn documents_start_from_an_empty_state() {
        // A row of two documents gives the second document's outputs it would give alone.
        let (heads, dk, dv) = (2, 4, 4);
        let inputs = random_inputs(1, heads, 12, dk, dv);
        let packed = DocSegments::from_doc_ids(1, 12, (0..12).map(|t| u32::from(t >= 7)).collect());
        let (out, _) = chunked(clone_inputs(&inputs), &ChunkPlan::new(&packed, 4, &Default::default()), None);
        let tail = |x: Tensor<B, 4>| x.narrow(2, 7, 5);
        let alone = ScanInputs {
            q: tail(inputs.q),
            k: tail(inputs.k),
            v: tail(inputs.v),
            g: inputs.g.narrow(2, 7, 5),
            beta: inputs.beta.narrow(2, 7, 5),
        };
        let (reference, _) = recurrent(alone, &DocSegments::from_doc_ids(1, 5, vec![0; 5]), None);
        assert!(max_abs_diff(out.narrow(2, 7, 5), reference) < 1e-5);
    }

    #[test]
    fn a_scan_continues_from_its_initial_state() {
        // Running 10 tokens, then 5 more from the state, equals running the 15 at once; a row whose new tokens
        // belong to another document than the state ignores it.
        let inputs = random_inputs(2, 2, 15, 4, 3);
        let all = DocSegments::from_doc_ids(2, 15, vec![0; 30]);
        let (full, _) = recurrent(clone_inputs(&inputs), &all, None);
        let part = |x: &ScanInputs<B>, from: usize, len: usize| ScanInputs {
            q: x.q.clone().narrow(2, from, len),
            k: x.k.clone().narrow(2, from, len),
            v: x.v.clone().narrow(2, from, len),
            g: x.g.clone().narrow(2, from, len),
            beta: x.beta.clone().narrow(2, from, len),
        };
        let first = DocSegments::from_doc_ids(2, 10, vec![0; 20]);
        let (_, state) = chunked(part(&inputs, 0, 10), &ChunkPlan::new(&first, 4, &Default::default()), None);
        let next = DocSegments { batch: 2, seq: 5, doc_ids: vec![0; 10], initial_doc: vec![0, 1] };
        let (tail, _) = chunked(part(&inputs, 10, 5), &ChunkPlan::new(&next, 4, &Default::default()), Some(state));
        let continued = tail.clone().narrow(0, 0, 1);
        assert!(max_abs_diff(continued, full.narrow(2, 10, 5).narrow(0, 0, 1)) < 1e-5);
        let fresh = part(&inputs, 10, 5);
        let (alone, _) = recurrent(fresh, &DocSegments::from_doc_ids(2, 5, vec![0; 10]), None);
        assert!(max_abs_diff(tail.narrow(0, 1, 1), alone.narrow(0, 1, 1)) < 1e-5);
    }

    /// Outputs and the gradients of `Σ out ⊙ R` (q, k, v, g, β) through the op and through burn's
    /// composition of `chunked`, on the same leaves: three rows (one document over 2.6 chunks; three
    /// documents, one across a chunk boundary; single-token documents at the end), padding in the last chunk.
    fn op_and_composition<A>(dtype: FloatDType) -> ([Vec<f32>; 6], [Vec<f32>; 6])
    where
        A: crate::models::ModelBackend + burn::tensor::backend::AutodiffBackend,
    {
        let (batch, heads, seq, dk, dv, size) = (3, 2, 21, 4, 3, 8);
        let mut docs = vec![0u32; seq];
        docs.extend((0..seq).map(|t| u32::from(t >= 5) + u32::from(t >= 13)));
        docs.extend((0..seq).map(|t| if t < 17 { 0 } else { t as u32 - 16 }));
        let segments = DocSegments::from_doc_ids(batch, seq, docs);
        B::seed(&Default::default(), 11);
        let ScanInputs { q, k, v, g, beta } = random_inputs(batch, heads, seq, dk, dv);
        let device = A::Device::default();
        let leaf4 = |x: Tensor<B, 4>| Tensor::<A, 4>::from_data(x.into_data(), &device).cast(dtype).require_grad();
        let leaf3 =
            |x: Tensor<B, 3>, dtype| Tensor::<A, 3>::from_data(x.into_data(), &device).cast(dtype).require_grad();
        // g stays f32, as the model computes it.
        let leaves = ScanInputs {
            q: leaf4(q),
            k: leaf4(k),
            v: leaf4(v),
            g: leaf3(g, FloatDType::F32),
            beta: leaf3(beta, dtype),
        };
        let weights = crate::testing::normal::<A, 4>([batch, heads, seq, dv], 0.0, 1.0, 12, &device);
        let plan = ChunkPlan::<A>::new(&segments, size, &device);
        let run = |out: Tensor<A, 4>| {
            let grads = (out.clone() * weights.clone()).sum().backward();
            let grad4 = |t: &Tensor<A, 4>| crate::testing::values(t.grad(&grads).expect("a gradient"));
            let grad3 = |t: &Tensor<A, 3>| crate::testing::values(t.grad(&grads).expect("a gradient"));
            [
                crate::testing::values(out),
                grad4(&leaves.q),
                grad4(&leaves.k),
                grad4(&leaves.v),
                grad3(&leaves.g),
                grad3(&leaves.beta),
            ]
        };
        let copy = || ScanInputs {
            q: leaves.q.clone(),
            k: leaves.k.clone(),
            v: leaves.v.clone(),
            g: leaves.g.clone(),
            beta: leaves.beta.clone(),
        };
        (run(A::gated_delta_rule(copy(), &plan)), run(chunked(copy(), &plan, None).0))
    }

    const NAMES: [&str; 6] = ["output", "d q", "d k", "d v", "d g", "d beta"];

    #[test]
    fn the_scan_op_and_its_backward_equal_the_composition() {
        use crate::backend::{CpuTrain, CpuTrainCheckpointed};
        let (op, composed) = op_and_composition::<CpuTrain>(FloatDType::F32);
        for (name, (a, b)) in NAMES.iter().zip(op.iter().zip(&composed)) {
            crate::testing::assert_close(name, a, b, 1e-5);
        }
        let (op, composed) = op_and_composition::<CpuTrainCheckpointed>(FloatDType::F32);
        for (name, (a, b)) in NAMES.iter().zip(op.iter().zip(&composed)) {
            crate::testing::assert_close(&format!("checkpointed {name}"), a, b, 1e-5);
        }
    }

    #[test]
    fn the_scan_op_in_bf16_returns_gradients_in_the_inputs_dtypes() {
        let (op, composed) = op_and_composition::<crate::backend::CpuTrain>(FloatDType::BF16);
        // Both compute in f32 from the same bf16 inputs; the op rounds each gradient to bf16 once, the
        // composition after its f32 → bf16 casts: within two bf16 ulps of the largest value.
        for (name, (a, b)) in NAMES.iter().zip(op.iter().zip(&composed)) {
            crate::testing::assert_close(name, a, b, 1.0 / 128.0);
        }
    }

    #[test]
    fn the_cpu_backend_runs_the_token_loops_in_f32_and_the_chunked_form_otherwise() {
        let segments = DocSegments::from_doc_ids(1, 10, vec![0; 10]);
        let inputs = random_inputs(1, 2, 10, 4, 3);
        let plan = ChunkPlan::new(&segments, 4, &Default::default());
        let (reference, _) = recurrent(clone_inputs(&inputs), &segments, None);
        let loops = crate::models::cpu_deltanet::scan_on_host(clone_inputs(&inputs), &plan, None).out;
        let out = <B as crate::models::ModelBackend>::gated_delta_rule(clone_inputs(&inputs), &plan);
        assert_eq!(crate::testing::values(out.clone()), crate::testing::values(loops));
        assert!(max_abs_diff(out, reference) < 1e-5);
        let bf16 = ScanInputs {
            q: inputs.q.cast(FloatDType::BF16),
            k: inputs.k.cast(FloatDType::BF16),
            v: inputs.v.cast(FloatDType::BF16),
            g: inputs.g,
            beta: inputs.beta.cast(FloatDType::BF16),
        };
        let (chunked_form, _) = chunked(clone_inputs(&bf16), &plan, None);
        let out = <B as crate::models::ModelBackend>::gated_delta_rule(bf16, &plan);
        assert_eq!(crate::testing::values(out), crate::testing::values(chunked_form));
    }
}
