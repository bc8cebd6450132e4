//! The gated delta rule, the state update of Gated DeltaNet (Qwen3.5's linear-attention layers), in its two
//! exact forms: the recurrent scan (one token at a time; the reference, and decoding) and the chunked form
//! (chunks of 64 tokens solved with a few matmuls; training and prefill). Documents packed into one row
//! each start from an empty state; the state a call starts from belongs to a named document per row.
//!
//! Per head, with the state `S ∈ R^{dk×dv}`: `S ← S·exp(g_t)`, `δ = β_t (v_t − Sᵀk_t)`, `S ← S + k_t δᵀ`,
//! `o_t = Sᵀ q_t`. q and k arrive L2-normalized and q scaled by 1/√dk; everything runs in f32.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, FloatDType, Tensor, TensorData};

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

fn host_tensor<B: Backend, const D: usize>(data: Vec<f32>, shape: [usize; D], device: &B::Device) -> Tensor<B, D> {
    Tensor::<B, D>::from_data(TensorData::new(data, shape), device).cast(FloatDType::F32)
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
        initial.unwrap_or_else(|| Tensor::zeros([batch, heads, dk, dv], &device)).cast(FloatDType::F32);
    let keep: Vec<f32> = (0..seq)
        .flat_map(|t| (0..batch).map(move |r| (r, t)))
        .map(|(r, t)| f32::from(u8::from(segments.continues(r, t))))
        .collect();
    let keep = host_tensor::<B, 2>(keep, [seq, batch], &device);
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
/// `outside_bridges[r]` masks everything but round `r`'s joining entries.
fn unit_lower_inverse<B: Backend>(l: Tensor<B, 5>, outside_bridges: &[Tensor<B, 5, Bool>]) -> Tensor<B, 5> {
    let size = l.dims()[4];
    let mut inverse = Tensor::<B, 2>::eye(size, &l.device()).unsqueeze::<5>().expand(l.dims());
    for outside in outside_bridges {
        let bridge = l.clone().mask_fill(outside.clone(), 0.0);
        inverse = inverse.clone() - inverse.clone().matmul(bridge).matmul(inverse);
    }
    inverse
}

/// Everything the chunked form needs from the document layout, built once per layout and shared by every
/// DeltaNet layer of a forward pass (the masks are host work).
pub struct ChunkPlan<B: Backend> {
    size: usize,
    seq: usize,
    chunks: usize,
    /// `[batch, 1, chunks, C, C]`: true unless `j ≤ i` inside one document.
    blocked: Tensor<B, 5, Bool>,
    /// `[batch, 1, chunks, C]`: position `t` still carries the state the chunk started from.
    carry: Tensor<B, 4>,
    /// `[batch, 1, chunks, C]`: position `j` is in the chunk's last document (its update reaches the end state).
    reaches_end: Tensor<B, 4>,
    /// Per doubling round of `unit_lower_inverse`, `[1, 1, 1, C, C]`.
    outside_bridges: Vec<Tensor<B, 5, Bool>>,
}

impl<B: Backend> ChunkPlan<B> {
    /// The plan for `segments` in chunks of `size` (a power of two).
    pub fn new(segments: &DocSegments, size: usize, device: &B::Device) -> Self {
        assert!(size.is_power_of_two(), "scan chunk {size} is not a power of two");
        let (batch, seq) = (segments.batch, segments.seq);
        let chunks = seq.div_ceil(size).max(1);
        let padded = chunks * size;
        let mut blocked = vec![true; batch * padded * size];
        let mut carry = vec![0.0; batch * padded];
        let mut reaches_end = vec![0.0; batch * padded];
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
                            blocked[((row * padded) + base + i) * size + j] = false;
                        }
                    }
                }
            }
        }
        let per_position = |m: Vec<f32>| host_tensor::<B, 3>(m, [batch, chunks, size], device).unsqueeze_dim::<4>(1);
        let mut outside_bridges = Vec::new();
        let mut block = 1;
        while block < size {
            // Outside the entries in the same 2s-block, below it in another s-block.
            let outside: Vec<bool> = (0..size * size)
                .map(|ij| {
                    let (i, j) = (ij / size, ij % size);
                    !(i / (2 * block) == j / (2 * block) && i / block != j / block && i > j)
                })
                .collect();
            outside_bridges
                .push(Tensor::<B, 2, Bool>::from_data(TensorData::new(outside, [size, size]), device).unsqueeze::<5>());
            block *= 2;
        }
        ChunkPlan {
            size,
            seq,
            chunks,
            blocked: Tensor::<B, 4, Bool>::from_data(TensorData::new(blocked, [batch, chunks, size, size]), device)
                .unsqueeze_dim::<5>(1),
            carry: per_position(carry),
            reaches_end: per_position(reaches_end),
            outside_bridges,
        }
    }
}

/// The chunked form (transformers' `torch_chunk_gated_delta_rule` with document resets): inside a chunk the
/// delta-rule updates are one triangular solve, across chunks a scan over `seq / size` steps. Equal to
/// `recurrent` up to float rounding. Returns the outputs `[batch, heads, seq, dv]` (f32) and the final state.
pub fn chunked<B: Backend>(
    inputs: ScanInputs<B>,
    plan: &ChunkPlan<B>,
    initial: Option<Tensor<B, 4>>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let ScanInputs { q, k, v, g, beta } = inputs.into_f32();
    let [batch, heads, seq, dk] = k.dims();
    assert_eq!(seq, plan.seq, "the plan was made for another sequence length");
    let (size, chunks) = (plan.size, plan.chunks);
    let dv = v.dims()[3];
    let device = q.device();
    let pad = chunks * size - seq;
    let pad4 = |x: Tensor<B, 4>| {
        if pad == 0 {
            return x;
        }
        let [b, h, _, d] = x.dims();
        Tensor::cat(vec![x, Tensor::<B, 4>::zeros([b, h, pad, d], &device).cast(FloatDType::F32)], 2)
    };
    let pad3 = |x: Tensor<B, 3>| {
        if pad == 0 {
            return x;
        }
        let [b, h, _] = x.dims();
        Tensor::cat(vec![x, Tensor::<B, 3>::zeros([b, h, pad], &device).cast(FloatDType::F32)], 2)
    };
    let split = |x: Tensor<B, 4>, d: usize| x.reshape([batch, heads, chunks, size, d]);
    let (q, k, v) = (split(pad4(q), dk), split(pad4(k), dk), split(pad4(v), dv));
    let beta = pad3(beta).reshape([batch, heads, chunks, size]);
    let cum = pad3(g).reshape([batch, heads, chunks, size]).cumsum(3);
    let (blocked, carry, reaches_end) = (plan.blocked.clone(), plan.carry.clone(), plan.reaches_end.clone());

    // decay[i, j] = exp(cum_i − cum_j) for j ≤ i in one document, else 0 (masked before exp: no overflow).
    let gap = cum.clone().unsqueeze_dim::<5>(4) - cum.clone().unsqueeze_dim::<5>(3);
    let decay = gap.mask_fill(blocked, f32::NEG_INFINITY).exp();
    let k_beta = k.clone() * beta.clone().unsqueeze_dim::<5>(4);
    let v_beta = v * beta.unsqueeze_dim::<5>(4);
    // `tril_mask(-1)` is true on and above the diagonal: only the strictly lower part stays.
    let diagonal_and_above = Tensor::<B, 2, Bool>::tril_mask([size, size], -1, &device).unsqueeze::<5>();
    let lower = (k_beta.clone().matmul(k.clone().swap_dims(3, 4)) * decay.clone()).mask_fill(diagonal_and_above, 0.0);
    let inverse = unit_lower_inverse(lower, &plan.outside_bridges);
    let from_start = cum.clone().exp() * carry; // decay since the chunk began, 0 once a new document began
    let new_values = inverse.clone().matmul(v_beta);
    let state_reads = inverse.matmul(k_beta * from_start.clone().unsqueeze_dim::<5>(4));
    let intra = q.clone().matmul(k.clone().swap_dims(3, 4)) * decay;
    let q_decayed = q * from_start.clone().unsqueeze_dim::<5>(4);
    let last = cum.clone().narrow(3, size - 1, 1);
    let to_end = (last.clone() - cum).exp() * reaches_end;
    let k_decayed = k * to_end.unsqueeze_dim::<5>(4);
    let chunk_decay = from_start.narrow(3, size - 1, 1); // [B, H, N, 1]

    let mut state =
        initial.unwrap_or_else(|| Tensor::zeros([batch, heads, dk, dv], &device)).cast(FloatDType::F32);
    let mut outputs = Vec::with_capacity(chunks);
    let chunk = |x: &Tensor<B, 5>, n: usize| {
        let [b, h, _, c, d] = x.dims();
        x.clone().narrow(2, n, 1).reshape([b, h, c, d])
    };
    for n in 0..chunks {
        let corrected = chunk(&new_values, n) - chunk(&state_reads, n).matmul(state.clone());
        let out = chunk(&q_decayed, n).matmul(state.clone()) + chunk(&intra, n).matmul(corrected.clone());
        outputs.push(out);
        let carried = chunk_decay.clone().narrow(2, n, 1).reshape([batch, heads, 1, 1]);
        state = state * carried + chunk(&k_decayed, n).swap_dims(2, 3).matmul(corrected);
    }
    let out = Tensor::cat(outputs, 2).narrow(2, 0, seq);
    (out, state)
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
}
