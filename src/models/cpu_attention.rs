//! The document attention of `attention` over f32 host slices, for the CPU backend: each document's queries
//! go in blocks of `BLOCK`, and a block scores only its document's keys up to its last query (a packed row
//! costs about the sum of its documents' triangles; no full `[queries, keys]` tensor or broadcast mask is
//! built). A block's scores, output and gradients are matrix products (`host_slices::matmul`), and each
//! row's softmax one pass of `host_slices::exp`, which vectorizes. Forward (output and per-query
//! log-sum-exp) and backward follow the equations of `attention::chunked_attention{,_backward}`. Work is
//! split over (row, head) or (row, kv head) with rayon, the products run single-threaded inside each task and
//! each task sums in a fixed order, so the results do not depend on the number of threads. Flex in f32 runs
//! it (`backend.rs`); other dtypes and backends keep the chunked tensor ops. Cached decoding's attention over
//! a mask (`masked_forward`: the prompt, then a token at a time) goes in blocks the same way, reading the
//! cache in place, and `write_cache_rows` appends a token's keys and values to it in place.

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};
use rayon::prelude::*;

use super::attention::{AttentionForward, DocumentAttention};
use super::host_slices::{FlexValues, HeadRows, MatRef, dot, exp, host, matmul, row, row_mut};
use crate::backend::host_tensor;

/// The sizes of one attention call: queries `[batch, heads, seq, d]`, keys and values
/// `[batch, kv_heads, seq, d]`, each kv head serving `heads / kv_heads` consecutive query heads; and the
/// scores' scale (`1/√d` unless the architecture sets its own).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionDims {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq: usize,
    pub d: usize,
    pub scale: f32,
}

impl AttentionDims {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// Queries per block: a block's scores `[queries, keys]` are one matrix product and its rows one softmax.
const BLOCK: usize = 64;

/// A batch row's queries cut into blocks of at most `BLOCK` consecutive queries whose first keys stay or
/// advance one at a time (one document; a sliding window moves by one), each block with its first query's
/// first key: block `(start, i0..i1)` scores keys `start..i1`, query `i` those of `seen(starts, start, i)`.
/// A document's first token, whose first key jumps ahead, starts a new block.
fn query_blocks(starts: &[usize]) -> Vec<(usize, std::ops::Range<usize>)> {
    let mut blocks = Vec::new();
    let mut i0 = 0;
    while i0 < starts.len() {
        let start = starts[i0];
        let mut i1 = i0 + 1;
        while i1 < starts.len() && i1 - i0 < BLOCK && starts[i1] <= starts[i1 - 1] + 1 && starts[i1] < i1 {
            i1 += 1;
        }
        blocks.push((start, i0..i1));
        i0 = i1;
    }
    blocks
}

/// The keys query `i` sees among its block's, which start at key `start`: from its own first key through
/// itself.
fn seen(starts: &[usize], start: usize, i: usize) -> std::ops::Range<usize> {
    starts[i] - start..i - start + 1
}

/// Rows `range` of a `[rows, d]` slice as a matrix.
fn rows_of(x: &[f32], range: std::ops::Range<usize>, d: usize) -> MatRef<'_> {
    MatRef::rows(&x[range.start * d..range.end * d], range.len(), d)
}

/// The output `[batch, heads, seq, d]` and log-sum-exp `[batch, heads, seq]` of `softmax(q kᵀ · scale) v`
/// where query `i` of batch row `b` sees keys `starts[b · seq + i] ..= i`: per block of queries, the scores
/// and the output are matrix products (`host_slices::matmul`) and each row's softmax one vectorized pass.
pub fn forward(q: &[f32], k: &[f32], v: &[f32], starts: &[usize], dims: AttentionDims) -> (Vec<f32>, Vec<f32>) {
    let AttentionDims { heads, seq, d, .. } = dims;
    let (group, scale) = (dims.group(), dims.scale);
    let mut out = vec![0.0f32; q.len()];
    let mut lse = vec![0.0f32; q.len() / d];
    let blocks: Vec<_> = (0..dims.batch).map(|b| query_blocks(&starts[b * seq..(b + 1) * seq])).collect();
    out.par_chunks_mut(seq * d).zip(lse.par_chunks_mut(seq)).enumerate().for_each(|(bh, (out, lse))| {
        let (b, h) = (bh / heads, bh % heads);
        let kv = b * dims.kv_heads + h / group;
        let head = seq * d;
        let (q, k, v) = (row(q, bh, head), row(k, kv, head), row(v, kv, head));
        let mut probs = Vec::new();
        for (start, queries) in &blocks[b] {
            let (start, keys) = (*start, queries.end - start);
            probs.clear();
            probs.resize(queries.len() * keys, 0.0);
            matmul(&mut probs, rows_of(q, queries.clone(), d), rows_of(k, start..queries.end, d).t(), scale, false);
            for (i, scores) in queries.clone().zip(probs.chunks_exact_mut(keys)) {
                let range = seen(&starts[b * seq..(b + 1) * seq], start, i);
                let (before, rest) = scores.split_at_mut(range.start);
                let (seen, unseen) = rest.split_at_mut(range.len());
                before.fill(0.0);
                let max = seen.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for p in seen.iter_mut() {
                    *p = exp(*p - max);
                    sum += *p;
                }
                for p in seen.iter_mut() {
                    *p /= sum;
                }
                unseen.fill(0.0);
                lse[i] = max + sum.ln();
            }
            let out = &mut out[queries.start * d..queries.end * d];
            matmul(out, MatRef::rows(&probs, queries.len(), keys), rows_of(v, start..queries.end, d), 1.0, false);
        }
    });
    (out, lse)
}

/// The keys a mask row leaves (not −∞): from the first to one past the last.
fn visible_keys(mask: &[f32]) -> std::ops::Range<usize> {
    let open = |m: &f32| *m > f32::NEG_INFINITY;
    match (mask.iter().position(open), mask.iter().rposition(open)) {
        (Some(first), Some(last)) => first..last + 1,
        _ => 0..0,
    }
}

/// The query rows of one kv head's task in `masked_forward` (its `group` heads' `seq` queries, head by
/// head), cut into blocks of at most `BLOCK` rows: a long prompt's queries in blocks of one head, a decoded
/// token's heads stacked into one block (one product reads the head's keys once for all of them).
fn masked_blocks(group: usize, seq: usize) -> Vec<std::ops::Range<usize>> {
    if seq >= BLOCK {
        (0..group)
            .flat_map(|g| (0..seq).step_by(BLOCK).map(move |i| g * seq + i..g * seq + (i + BLOCK).min(seq)))
            .collect()
    } else {
        let heads = BLOCK / seq;
        (0..group).step_by(heads).map(|g| g * seq..(g + heads).min(group) * seq).collect()
    }
}

/// `softmax(q kᵀ / √d + mask) v` (`attention::softmax_attention`: cached decoding's attention) for queries
/// `q [batch, heads, seq, d]` (row-major), keys and values `[batch · kv_heads]` heads of `[keys, d]` and an
/// additive mask `[batch, seq, keys]` shared by the heads. Per kv head, its query heads' rows go in blocks
/// (`masked_blocks`) whose scores and output are matrix products over the keys the block's mask rows leave
/// (a causal prompt costs about its triangle, left padding is skipped), and each row's softmax is one
/// vectorized pass. A query with no key left (which decoding never makes: a token always sees itself) gets
/// zeros.
pub fn masked_forward(q: &[f32], k: HeadRows, v: HeadRows, mask: &[f32], dims: AttentionDims, keys: usize) -> Vec<f32> {
    let AttentionDims { batch, kv_heads, seq, d, .. } = dims;
    let (group, scale) = (dims.group(), dims.scale);
    let visible: Vec<_> = (0..batch * seq).map(|r| visible_keys(row(mask, r, keys))).collect();
    let blocks = masked_blocks(group, seq);
    let mut out = vec![0.0f32; q.len()];
    out.par_chunks_mut(group * seq * d).enumerate().for_each(|(bkv, out)| {
        let b = bkv / kv_heads;
        let q = row(q, bkv, group * seq * d);
        let (k, v) = (k.head(bkv), v.head(bkv));
        let query = |r: usize| b * seq + r % seq;
        let mut probs = Vec::new();
        for rows in &blocks {
            let reach = rows.clone().map(|r| &visible[query(r)]).filter(|range| !range.is_empty());
            let (first, end) =
                reach.fold((keys, 0), |(first, end), range| (first.min(range.start), end.max(range.end)));
            if first >= end {
                continue;
            }
            let width = end - first;
            probs.clear();
            probs.resize(rows.len() * width, 0.0);
            matmul(&mut probs, rows_of(q, rows.clone(), d), rows_of(k, first..end, d).t(), scale, false);
            for (r, scores) in rows.clone().zip(probs.chunks_exact_mut(width)) {
                for (s, m) in scores.iter_mut().zip(&row(mask, query(r), keys)[first..end]) {
                    *s += m;
                }
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                if max == f32::NEG_INFINITY {
                    scores.fill(0.0);
                    continue;
                }
                // A masked key's −∞ becomes exactly 0.
                let mut sum = 0.0f32;
                for s in scores.iter_mut() {
                    *s = exp(*s - max);
                    sum += *s;
                }
                for s in scores.iter_mut() {
                    *s /= sum;
                }
            }
            let out = &mut out[rows.start * d..rows.end * d];
            matmul(out, MatRef::rows(&probs, rows.len(), width), rows_of(v, first..end, d), 1.0, false);
        }
    });
    out
}

/// Writes `rows [a, b, n, d]` into positions `at..at + n` of `cache [a, b, capacity, d]` (cached decoding's
/// keys or values, `ModelBackend::write_cache_rows`), in place when the cache holds its storage alone (as a
/// decoding step leaves it), else into a copy.
pub fn write_cache_rows(cache: Tensor<Flex, 4>, at: usize, rows: Tensor<Flex, 4>) -> Tensor<Flex, 4> {
    let [a, b, capacity, d] = cache.dims();
    let n = rows.dims()[2];
    assert!(rows.dims() == [a, b, n, d] && at + n <= capacity, "rows that fit the cache");
    // `to_contiguous` keeps the storage of a tensor laid out from its start; the handle it came from is
    // dropped at the end of the statement, so the storage is not shared on its account.
    let mut cache = cache.into_primitive().tensor().to_contiguous();
    let mut rows = FlexValues::new(rows);
    let (src, dst) = (rows.values(), cache.storage_mut::<f32>());
    for h in 0..a * b {
        dst[(h * capacity + at) * d..(h * capacity + at + n) * d].copy_from_slice(row(src, h, n * d));
    }
    Tensor::from_primitive(TensorPrimitive::Float(cache))
}

/// Gradients `(dq, dk, dv)` of `forward` for the output gradient `grad_out`, from its output `out` and
/// log-sum-exp `lse`: `P = exp(S − lse)`, `dV += Pᵀ dO`, `dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)) / √d`,
/// `dQ = dS K`, `dK += dSᵀ Q`, each product over a block of queries and its keys. One task per (batch row,
/// kv head) owns that head's dk, dv and its query heads' dq.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    grad_out: &[f32],
    starts: &[usize],
    dims: AttentionDims,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttentionDims { kv_heads, seq, d, .. } = dims;
    let (group, scale) = (dims.group(), dims.scale);
    let head = seq * d;
    let blocks: Vec<_> = (0..dims.batch).map(|b| query_blocks(&starts[b * seq..(b + 1) * seq])).collect();
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; q.len()], vec![0.0f32; k.len()], vec![0.0f32; v.len()]);
    let tasks = dq.par_chunks_mut(group * head).zip(dk.par_chunks_mut(head)).zip(dv.par_chunks_mut(head));
    tasks.enumerate().for_each(|(bkv, ((dq, dk), dv))| {
        let b = bkv / kv_heads;
        let (k, v) = (row(k, bkv, head), row(v, bkv, head));
        let (mut probs, mut grads) = (Vec::new(), Vec::new());
        for g in 0..group {
            let bh = bkv * group + g;
            let (q, out, grad_out) = (row(q, bh, head), row(out, bh, head), row(grad_out, bh, head));
            let dq = row_mut(dq, g, head);
            for (start, queries) in &blocks[b] {
                let (start, n, keys) = (*start, queries.len(), queries.end - start);
                let (q_rows, do_rows) = (rows_of(q, queries.clone(), d), rows_of(grad_out, queries.clone(), d));
                let (k_rows, v_rows) = (rows_of(k, start..queries.end, d), rows_of(v, start..queries.end, d));
                for buffer in [&mut probs, &mut grads] {
                    buffer.clear();
                    buffer.resize(n * keys, 0.0);
                }
                matmul(&mut probs, q_rows, k_rows.t(), scale, false);
                matmul(&mut grads, do_rows, v_rows.t(), 1.0, false);
                for (i, (p, ds)) in queries.clone().zip(probs.chunks_exact_mut(keys).zip(grads.chunks_exact_mut(keys)))
                {
                    let (seen, lse_i) = (seen(&starts[b * seq..(b + 1) * seq], start, i), lse[bh * seq + i]);
                    let delta = dot(row(grad_out, i, d), row(out, i, d));
                    for p in &mut p[seen.clone()] {
                        *p = exp(*p - lse_i);
                    }
                    for (ds, &p) in ds[seen.clone()].iter_mut().zip(&p[seen.clone()]) {
                        *ds = p * (*ds - delta) * scale;
                    }
                    for unseen in [0..seen.start, seen.end..keys] {
                        p[unseen.clone()].fill(0.0);
                        ds[unseen].fill(0.0);
                    }
                }
                let (p_rows, ds_rows) = (MatRef::rows(&probs, n, keys), MatRef::rows(&grads, n, keys));
                matmul(&mut dv[start * d..queries.end * d], p_rows.t(), do_rows, 1.0, true);
                matmul(&mut dk[start * d..queries.end * d], ds_rows.t(), q_rows, 1.0, true);
                matmul(&mut dq[queries.start * d..queries.end * d], ds_rows, k_rows, 1.0, false);
            }
        }
    });
    (dq, dk, dv)
}

/// The dims of `q` and `k` with the scores' scale (`None`: `1/√d`).
fn dims_of<B: Backend>(q: &Tensor<B, 4>, k: &Tensor<B, 4>, scale: Option<f64>) -> AttentionDims {
    let [batch, heads, seq, d] = q.dims();
    let scale = scale.unwrap_or_else(|| 1.0 / (d as f64).sqrt()) as f32;
    AttentionDims { batch, heads, kv_heads: k.dims()[1], seq, d, scale }
}

/// Whether the host paths here take these inputs (all f32); the callers keep the tensor ops otherwise.
pub fn takes<B: Backend, const N: usize>(tensors: [&Tensor<B, 4>; N]) -> bool {
    tensors.iter().all(|t| t.dtype() == DType::F32)
}

/// `attention::chunked_attention` through `forward`: the same output and log-sum-exp (`[batch, kv_heads,
/// seq, group, 1]`, a view of `forward`'s head-by-head order), in f32.
pub fn forward_on_host<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    docs: &DocumentAttention<B>,
) -> AttentionForward<B> {
    let dims = dims_of(&q, &k, Some(docs.scale(q.dims()[3])));
    let device = q.device();
    let (out, lse) = forward(&host(q), &host(k), &host(v), docs.query_starts(), dims);
    let AttentionDims { batch, heads, kv_heads, seq, d, .. } = dims;
    AttentionForward {
        out: host_tensor(out, [batch, heads, seq, d], FloatDType::F32, &device),
        lse: host_tensor::<B, 5>(lse, [batch, kv_heads, dims.group(), seq, 1], FloatDType::F32, &device)
            .swap_dims(2, 3),
    }
}

/// `attention::scaled_softmax_attention` through `masked_forward`, in f32, reading the queries, the cached
/// keys and values and the mask (`[batch, 1, seq, keys]`) where the CPU backend holds them.
pub fn masked_on_host(
    q: Tensor<Flex, 4>,
    k: Tensor<Flex, 4>,
    v: Tensor<Flex, 4>,
    mask: &Tensor<Flex, 4>,
    scale: f64,
) -> Tensor<Flex, 4> {
    let dims = dims_of(&q, &k, Some(scale));
    let (shape, keys) = (q.dims(), k.dims()[2]);
    let device = q.device();
    let (mut q, mut k, mut v) = (FlexValues::new(q), FlexValues::new(k), FlexValues::new(v));
    let mut mask = FlexValues::new(mask.clone().cast(FloatDType::F32));
    let out = masked_forward(q.values(), k.heads(), v.heads(), mask.values(), dims, keys);
    host_tensor(out, shape, FloatDType::F32, &device)
}

/// `attention::chunked_attention_backward` through `backward`, in f32.
pub fn backward_on_host<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    docs: &DocumentAttention<B>,
    forward: AttentionForward<B>,
    grad_out: Tensor<B, 4>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let dims = dims_of(&q, &k, Some(docs.scale(q.dims()[3])));
    let device = q.device();
    let (q_shape, kv_shape) = (q.dims(), k.dims());
    let grad_out = grad_out.cast(FloatDType::F32);
    let (dq, dk, dv) = backward(
        &host(q),
        &host(k),
        &host(v),
        &host(forward.out),
        &host(forward.lse.swap_dims(2, 3)),
        &host(grad_out),
        docs.query_starts(),
        dims,
    );
    let tensor = |values, shape| host_tensor::<B, 4>(values, shape, FloatDType::F32, &device);
    (tensor(dq, q_shape), tensor(dk, kv_shape), tensor(dv, kv_shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::models::SequenceLayout;
    use crate::models::attention::{chunked_attention, chunked_attention_backward};
    use crate::testing::{assert_close, normal, values};

    /// Row 0: documents of 7, 30, 1 and 2 padding tokens; row 1: one of 40; row 2: 19 and 21 (chunks of 8
    /// queries split documents and skip keys).
    fn layout() -> SequenceLayout {
        SequenceLayout::from_doc_lengths(&[vec![7, 30, 1], vec![40], vec![19, 21]], 40)
    }

    /// Documents shorter than a block of queries (`layout`), and longer ones that span several blocks, one
    /// of them part-filled (150 = 64 + 64 + 22).
    #[test]
    fn the_host_attention_equals_the_chunked_tensor_ops_forward_and_backward() {
        let device = Default::default();
        let long = SequenceLayout::from_doc_lengths(&[vec![150, 20], vec![3, 167]], 170);
        // d = 12 leaves a remainder after the eight-lane dot product.
        for (l, heads, kv_heads, d) in
            [(layout(), 4, 2, 12), (layout(), 3, 3, 16), (layout(), 2, 1, 5), (long, 4, 2, 12)]
        {
            let (batch, seq) = (l.batch, l.seq);
            let tensor = |dims: [usize; 4], seed: u64| normal::<Cpu, 4>(dims, 0.0, 1.0, seed, &device);
            let (q, k, v) = (
                tensor([batch, heads, seq, d], 1),
                tensor([batch, kv_heads, seq, d], 2),
                tensor([batch, kv_heads, seq, d], 3),
            );
            let grad_out = tensor([batch, heads, seq, d], 4);
            let docs = DocumentAttention::<Cpu>::new(&l, &device).with_chunk_rows(8);
            let reference = chunked_attention(q.clone(), k.clone(), v.clone(), &docs);
            let host = forward_on_host(q.clone(), k.clone(), v.clone(), &docs);
            let case = format!("seq {seq}, heads {heads}, kv heads {kv_heads}, d {d}");
            assert_eq!(host.lse.dims(), reference.lse.dims());
            assert_close(&format!("output, {case}"), &values(host.out.clone()), &values(reference.out.clone()), 2e-6);
            assert_close(&format!("lse, {case}"), &values(host.lse.clone()), &values(reference.lse.clone()), 2e-6);
            let expected =
                chunked_attention_backward(q.clone(), k.clone(), v.clone(), &docs, reference, grad_out.clone());
            let got = backward_on_host(q, k, v, &docs, host, grad_out);
            for (name, (a, b)) in
                ["dq", "dk", "dv"].iter().zip([(got.0, expected.0), (got.1, expected.1), (got.2, expected.2)])
            {
                assert_close(&format!("{name}, {case}"), &values(a), &values(b), 4e-6);
            }
        }
    }

    #[test]
    fn the_host_masked_attention_equals_the_softmax_composition() {
        // Two rows decoding 3 new tokens after 6 cached ones: row 0 left-padded by 2 (masked keys), row 1
        // not; each new token sees the real tokens before it and itself; one finite non-zero mask value.
        let device = Default::default();
        let (seq, keys) = (3, 9);
        let mut mask = vec![f32::NEG_INFINITY; 2 * seq * keys];
        for b in 0..2 {
            for i in 0..seq {
                for j in (2 * (1 - b))..=6 + i {
                    mask[(b * seq + i) * keys + j] = 0.0;
                }
            }
        }
        mask[keys + 4] = -0.75;
        let mask = crate::backend::host_tensor::<Cpu, 4>(mask, [2, 1, seq, keys], FloatDType::F32, &device);
        for (heads, kv_heads, d) in [(4, 2, 12), (2, 2, 8), (3, 1, 5)] {
            let q = normal::<Cpu, 4>([2, heads, seq, d], 0.0, 1.0, 1, &device);
            let (k, v) = (
                normal::<Cpu, 4>([2, kv_heads, keys, d], 0.0, 1.0, 2, &device),
                normal::<Cpu, 4>([2, kv_heads, keys, d], 0.0, 1.0, 3, &device),
            );
            let reference =
                crate::models::attention::scaled_softmax_attention(q.clone(), k.clone(), v.clone(), &mask, 0.3);
            let host = masked_on_host(q, k, v, &mask, 0.3);
            let case = format!("heads {heads}, kv heads {kv_heads}, d {d}");
            assert_close(&format!("masked attention, {case}"), &values(host), &values(reference), 2e-6);
        }
    }

    /// Causal attention masks for `seq` new tokens after `past` cached positions, two rows: row 0's first
    /// `padding` positions are left padding (masked), row 1 has none.
    fn decoding_mask(seq: usize, past: usize, padding: usize) -> Tensor<Cpu, 4> {
        let keys = past + seq;
        let mut mask = vec![f32::NEG_INFINITY; 2 * seq * keys];
        for b in 0..2 {
            let first = if b == 0 { padding } else { 0 };
            for i in 0..seq {
                mask[(b * seq + i) * keys + first..(b * seq + i) * keys + past + i + 1].fill(0.0);
            }
        }
        crate::backend::host_tensor::<Cpu, 4>(mask, [2, 1, seq, keys], FloatDType::F32, &Default::default())
    }

    /// A prompt longer than a block of queries (70 new tokens after 2 cached positions, row 0's being left
    /// padding), with the keys and values read in place from caches with spare positions (views of their
    /// first 72), equals the softmax composition; so do decoded tokens whose heads share a block.
    #[test]
    fn a_long_prompt_and_single_tokens_over_cache_views_equal_the_softmax_composition() {
        let device = Default::default();
        let capacity = 90;
        for (seq, past) in [(70, 2), (1, 71)] {
            let mask = decoding_mask(seq, past, 2);
            for (heads, kv_heads, d) in [(4, 2, 12), (2, 1, 8), (3, 3, 5)] {
                let q = normal::<Cpu, 4>([2, heads, seq, d], 0.0, 1.0, 1, &device);
                let cache = |seed| normal::<Cpu, 4>([2, kv_heads, capacity, d], 0.0, 1.0, seed, &device);
                let (k, v) = (cache(2).narrow(2, 0, past + seq), cache(3).narrow(2, 0, past + seq));
                let reference =
                    crate::models::attention::scaled_softmax_attention(q.clone(), k.clone(), v.clone(), &mask, 0.3);
                let host = masked_on_host(q, k, v, &mask, 0.3);
                let case = format!("{seq} queries after {past}, heads {heads}, kv heads {kv_heads}, d {d}");
                assert_close(&format!("masked attention, {case}"), &values(host), &values(reference), 2e-6);
            }
        }
    }

    #[test]
    fn masked_blocks_cover_each_heads_queries_once() {
        // Long prompts: blocks of one head's queries; short ones: whole heads stacked up to 64 rows.
        assert_eq!(masked_blocks(2, 70), [0..64, 64..70, 70..134, 134..140]);
        assert_eq!(masked_blocks(4, 1), vec![0..4]);
        assert_eq!(masked_blocks(5, 20), [0..60, 60..100]);
        assert_eq!(visible_keys(&[f32::NEG_INFINITY, 0.0, -1.0, f32::NEG_INFINITY]), 1..3);
        assert!(visible_keys(&[f32::NEG_INFINITY; 3]).is_empty());
    }

    /// The storage a tensor's values lie in, as an address.
    fn storage_address(t: &Tensor<Cpu, 4>) -> usize {
        FlexValues::new(t.clone()).values().as_ptr() as usize
    }

    #[test]
    fn cache_rows_are_written_in_place_unless_the_cache_is_shared() {
        let device = Default::default();
        let cache = normal::<Cpu, 4>([2, 3, 8, 4], 0.0, 1.0, 1, &device);
        let rows = normal::<Cpu, 4>([2, 3, 2, 4], 0.0, 1.0, 2, &device);
        let expected = values(cache.clone().slice_assign([0..2, 0..3, 5..7, 0..4], rows.clone()));
        // Shared: the other handle keeps its values.
        let kept = values(cache.clone());
        let shared = cache.clone();
        let written = write_cache_rows(cache, 5, rows.clone());
        assert_eq!(values(written.clone()), expected);
        assert_eq!(values(shared), kept);
        // Held alone: written where it lies.
        let before = storage_address(&written);
        let rewritten = write_cache_rows(written, 5, rows.clone());
        assert_eq!(storage_address(&rewritten), before);
        assert_eq!(values(rewritten), expected);
    }

    #[test]
    fn a_query_sees_only_its_document_up_to_itself() {
        // Changing a key or value outside a query's allowed range leaves its output alone; changing one inside
        // moves it.
        let l = SequenceLayout::from_doc_lengths(&[vec![3, 4]], 8);
        let dims = AttentionDims { batch: 1, heads: 1, kv_heads: 1, seq: 8, d: 4, scale: 0.5 };
        let docs = DocumentAttention::<Cpu>::new(&l, &Default::default());
        let starts = docs.query_starts().to_vec();
        assert_eq!(starts, [0, 0, 0, 3, 3, 3, 3, 7]);
        let q: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<f32> = (0..32).map(|i| (i as f32 * 0.11).cos()).collect();
        let v: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let (out, _) = forward(&q, &k, &v, &starts, dims);
        // The padding token (7) attends to itself alone; the first token of each document too.
        assert_eq!(&out[28..32], &v[28..32]);
        assert_eq!(&out[12..16], &v[12..16]);
        for changed in 0..8 {
            let mut v2 = v.clone();
            v2[changed * 4] += 100.0;
            let (out2, _) = forward(&q, &k, &v2, &starts, dims);
            for i in 0..8 {
                let sees = starts[i] <= changed && changed <= i;
                assert_eq!(out2[i * 4] != out[i * 4], sees, "query {i}, value {changed} changed");
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let l = layout();
        let dims = AttentionDims { batch: 3, heads: 4, kv_heads: 2, seq: 40, d: 12, scale: 0.3 };
        let docs = DocumentAttention::<Cpu>::new(&l, &Default::default());
        let starts = docs.query_starts().to_vec();
        let data = |n: usize, f: f32| (0..n).map(|i| (i as f32 * f).sin()).collect::<Vec<f32>>();
        let (q, k, v, g) = (
            data(3 * 4 * 40 * 12, 0.3),
            data(3 * 2 * 40 * 12, 0.7),
            data(3 * 2 * 40 * 12, 1.1),
            data(3 * 4 * 40 * 12, 1.3),
        );
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            pool.install(|| {
                let (out, lse) = forward(&q, &k, &v, &starts, dims);
                let grads = backward(&q, &k, &v, &out, &lse, &g, &starts, dims);
                (out, lse, grads)
            })
        };
        assert!(run(1) == run(3), "one thread and three give the same bits");
    }
}
