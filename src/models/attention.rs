//! Causal, same-document softmax attention over whole sequences (training and the full forward pass),
//! computed exactly but one chunk of queries at a time, as FlashAttention organizes it: each chunk's scores
//! see only the keys it may attend to (from the earliest document start among its queries to its last
//! query), softmax runs in f32 with a per-query log-sum-exp, and no `[batch, heads, seq, seq]` tensor ever
//! exists. Under autodiff the backward pass is written by hand (scores recomputed per chunk from the saved
//! log-sum-exp), so training keeps `O(seq)` per head instead of burn's composed backward that holds the
//! full scores and probabilities of every attention layer until the end of the step. Between the matmuls,
//! each chunk's softmax rows go through the backend (`ModelBackend::attention_probs`,
//! `attention_score_grads`): the tensor ops here (`softmax_rows`, `score_grads`), one CubeCL kernel each on
//! the CubeCL backends (`kernels::attention`). The tensor ops' additive chunk masks are built once a layout
//! (a forward pass) and shared by its layers, forwards and back (`ChunkMasks`). The queries are laid out
//! once a pass so that each chunk's rows are one block (`query_rows`), and the chunks write the output
//! positions first (`positions_first`): no chunk copies its operands.
//!
//! `grouped_attention` (one softmax over an explicit additive mask) is the reference the tests hold the
//! chunked computation to; cached decoding's calls that continue a cache attend through such a mask
//! (`ModelBackend::masked_attention`), and its prompts into an empty cache through the chunked path
//! (`models::decode`). The models reach this through `ops::ModelBackend::document_attention`.

use std::any::{Any, TypeId};
use std::sync::{Arc, Mutex};

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::tensor::activation::softmax;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, DType, FloatDType, Int, Tensor, TensorData, TensorPrimitive};

use super::SequenceLayout;
use super::ops::{ModelBackend, record_op};
use crate::backend::zeros_in;

/// The f32 scores one chunk of queries may hold (all heads and rows of the batch together), unless
/// `KILN_ATTENTION_CHUNK_MIB` says otherwise.
pub const CHUNK_SCORE_BYTES: usize = 256 << 20;

/// The environment variable that sets a process's chunk budget in MiB of f32 scores: the trade between the
/// attention's transient memory (a chunk's scores, probabilities and their gradients) and its kernels (on
/// lavapipe about 13 a chunk and layer forwards and back with kiln's kernels, 30 without). LFM2.5-1.2B at
/// sequence 4096 (32 heads) runs 5 chunks a layer at the default 256 (`chunk_spans`), 2 at 1024. The results
/// are the same to f32 rounding (the key and value gradients sum over chunks).
pub const CHUNK_MIB_ENV: &str = "KILN_ATTENTION_CHUNK_MIB";

/// The chunk budget in bytes from `KILN_ATTENTION_CHUNK_MIB` (`CHUNK_SCORE_BYTES` when unset); malformed
/// values are an error (`main` checks before any command runs).
pub fn chunk_score_budget() -> Result<usize, String> {
    std::env::var_os(CHUNK_MIB_ENV).map_or(Ok(CHUNK_SCORE_BYTES), |value| parse_chunk_mib(&value.to_string_lossy()))
}

/// A chunk budget in MiB, a whole number from 1 to 1 TiB's worth, as bytes; empty is the default.
fn parse_chunk_mib(value: &str) -> Result<usize, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(CHUNK_SCORE_BYTES);
    }
    match value.parse::<usize>() {
        Ok(mib @ 1..=1_048_576) => Ok(mib << 20),
        _ => Err(format!(
            "{CHUNK_MIB_ENV}={value:?}: use a whole number of MiB from 1 to 1048576 (unset: {})",
            CHUNK_SCORE_BYTES >> 20
        )),
    }
}

/// The scores' scale `1/√d` for heads of `d` dims, unless an architecture sets its own.
pub fn default_scale(d: usize) -> f64 {
    1.0 / (d as f64).sqrt()
}

/// `chunk_score_budget()` read once, for the models (the CLI has rejected a malformed value before they run).
pub fn chunk_score_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| chunk_score_budget().unwrap_or(CHUNK_SCORE_BYTES))
}

/// `ModelBackend::document_attention` on an autodiff backend: the inner backend's `attention_forward`,
/// recorded as one op whose backward is its `attention_backward`.
pub(super) fn tracked_document_attention<B: ModelBackend, C: CheckpointStrategy>(
    q: Tensor<Autodiff<B, C>, 4>,
    k: Tensor<Autodiff<B, C>, 4>,
    v: Tensor<Autodiff<B, C>, 4>,
    docs: &DocumentAttention<Autodiff<B, C>>,
) -> Tensor<Autodiff<B, C>, 4> {
    let (q, k, v) = (q.into_primitive().tensor(), k.into_primitive().tensor(), v.into_primitive().tensor());
    let inner = |t: &FloatTensor<B>| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t.clone()));
    let inner_docs = docs.inner();
    let forward = B::attention_forward(inner(&q.primitive), inner(&k.primitive), inner(&v.primitive), &inner_docs);
    let out = forward.out.into_primitive().tensor();
    let lse = forward.lse.into_primitive().tensor();
    let saved_out = out.clone();
    let output = record_op::<C, _, _, _, _>(ChunkedAttentionBackward, [&q, &k, &v], out, |[q, k, v]| SavedAttention {
        q,
        k,
        v,
        out: saved_out,
        lse,
        docs: inner_docs,
    });
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// What attention may see in one forward pass and how it weighs it: the `[batch, seq]` document ids on the
/// device, and per query the first key it may attend to (its document's first token, or the first of the
/// last `window` tokens for a sliding-window layer), from which each chunk's keys are bounded
/// (`first_key`); and the scale of the scores (`1/√d` unless the architecture sets its own).
#[derive(Debug, Clone)]
pub struct DocumentAttention<B: Backend> {
    docs: Tensor<B, 2, Int>,
    /// `[batch * seq]`: the first key each query may attend to.
    starts: Vec<usize>,
    /// How the queries are cut into chunks.
    chunking: Chunking,
    /// A query sees at most this many keys, itself included (Gemma's sliding-window layers).
    window: Option<usize>,
    /// The scores' scale; `None`: `1/√d`.
    scale: Option<f64>,
    /// The chunk masks built so far (`chunk_mask`).
    masks: ChunkMasks,
}

/// How a layout cuts its queries into chunks: within a budget of f32 scores (`chunk_spans`; `None`: the
/// process's `chunk_score_bytes()`), or a fixed number of queries a chunk.
#[derive(Debug, Clone, Copy)]
enum Chunking {
    Budget(Option<usize>),
    Rows(usize),
}

/// The additive chunk masks a layout has built, shared by every layer's forward and backward pass over it
/// and by its inner backend's copy (`inner`): a `[batch, len, keys]` f32 tensor a chunk, built once a
/// step, where each layer's chunk built its own forwards and again backwards — on CUDA without kiln's kernels
/// seven kernels each time (the document comparison, the causal and window masks, their union, the fill).
/// Keyed by the backend's type and the chunk's `(start, len, first, keys)`; held while any pass that may
/// read them lives (about 41 MB a sequence of 4096 for LFM2.5-1.2B's 5 chunks, the causal half skipped).
#[derive(Clone, Default)]
struct ChunkMasks(Arc<Mutex<Vec<ChunkMask>>>);

type ChunkMask = ((TypeId, [usize; 4]), Box<dyn Any + Send>);

impl ChunkMasks {
    /// The mask of `key` on backend `B`, built by `build` the first time.
    fn get_or_build<B: Backend>(&self, key: [usize; 4], build: impl FnOnce() -> Tensor<B, 3>) -> Tensor<B, 3> {
        let key = (TypeId::of::<B>(), key);
        // A pass that panicked holding the lock left whole entries: the masks stay usable.
        let mut masks = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(mask) = masks.iter().find(|(k, _)| *k == key).and_then(|(_, m)| m.downcast_ref::<Tensor<B, 3>>()) {
            return mask.clone();
        }
        let mask = build();
        masks.push((key, Box::new(mask.clone())));
        mask
    }
}

impl std::fmt::Debug for ChunkMasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let built = self.0.lock().map_or(0, |masks| masks.len());
        write!(f, "ChunkMasks({built} built)")
    }
}

impl<B: Backend> DocumentAttention<B> {
    pub fn new(layout: &SequenceLayout, device: &B::Device) -> Self {
        let (batch, seq) = (layout.batch, layout.seq);
        let ids: Vec<i64> = layout.doc_ids.iter().map(|&d| d as i64).collect();
        let starts =
            layout.positions.iter().enumerate().map(|(at, &p)| (at % seq).saturating_sub(p as usize)).collect();
        DocumentAttention {
            docs: Tensor::from_data(TensorData::new(ids, [batch, seq]), device),
            starts,
            chunking: Chunking::Budget(None),
            window: None,
            scale: None,
            masks: ChunkMasks::default(),
        }
    }

    /// The same documents seen through a sliding window: a query attends to at most the last `window`
    /// tokens of its document, itself included (at least one).
    pub fn with_window(mut self, window: usize) -> Self {
        let window = window.max(1);
        let [_, seq] = self.docs.dims();
        for (at, start) in self.starts.iter_mut().enumerate() {
            *start = (*start).max((at % seq + 1).saturating_sub(window));
        }
        self.window = Some(window);
        // Another layout's masks: not the ones a clone of it without the window built.
        self.masks = ChunkMasks::default();
        self
    }

    /// The same documents with the scores scaled by `scale` instead of `1/√d`.
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The scores' scale for heads of `d` dims.
    pub fn scale(&self, d: usize) -> f64 {
        self.scale.unwrap_or_else(|| default_scale(d))
    }

    /// The `[batch, seq]` document ids on the device: a query sees the keys of its own document up to itself.
    pub fn ids(&self) -> &Tensor<B, 2, Int> {
        &self.docs
    }

    /// Per query (`[batch * seq]`, row-major), the first key it may attend to: its document's first token.
    pub fn query_starts(&self) -> &[usize] {
        &self.starts
    }

    /// The first key any row's query at position `i` may attend to: the earliest document start among the
    /// rows there (non-decreasing along the sequence).
    fn first_key(&self, i: usize) -> usize {
        let [batch, seq] = self.docs.dims();
        (0..batch).map(|b| self.starts[b * seq + i]).min().unwrap_or(i)
    }

    /// The same with a fixed number of queries per chunk (at least one).
    pub fn with_chunk_rows(mut self, rows: usize) -> Self {
        self.chunking = Chunking::Rows(rows.max(1));
        self
    }

    /// The same with chunks whose scores stay within `bytes` instead of `chunk_score_bytes()`.
    pub fn with_chunk_budget(mut self, bytes: usize) -> Self {
        self.chunking = Chunking::Budget(Some(bytes));
        self
    }

    /// The query chunks `(start, len, first_key)` for `heads` heads: each chunk attends to keys
    /// `first_key..start + len`.
    fn chunks(&self, heads: usize) -> Vec<(usize, usize, usize)> {
        let [batch, seq] = self.docs.dims();
        match self.chunking {
            Chunking::Rows(rows) => {
                (0..seq).step_by(rows).map(|start| (start, rows.min(seq - start), self.first_key(start))).collect()
            }
            Chunking::Budget(bytes) => {
                let score_bytes = batch.max(1).saturating_mul(heads.max(1)).saturating_mul(4);
                chunk_spans(seq, |i| self.first_key(i), score_bytes, bytes.unwrap_or_else(chunk_score_bytes))
            }
        }
    }

    /// The additive mask `[batch, len, keys]` (0 allowed, -inf blocked) of queries `start..start + len`
    /// against keys `first..first + keys`: same document, not in the future, and within the window. In f32.
    fn chunk_mask(&self, start: usize, len: usize, first: usize, keys: usize) -> Tensor<B, 3> {
        self.masks.get_or_build([start, len, first, keys], || self.build_chunk_mask(start, len, first, keys))
    }

    fn build_chunk_mask(&self, start: usize, len: usize, first: usize, keys: usize) -> Tensor<B, 3> {
        let [batch, _] = self.docs.dims();
        let device = self.docs.device();
        let query_docs = self.docs.clone().narrow(1, start, len).unsqueeze_dim::<3>(2);
        let key_docs = self.docs.clone().narrow(1, first, keys).unsqueeze_dim::<3>(1);
        let other_doc = query_docs.not_equal(key_docs);
        // `tril_mask(offset)` is true where key − query > offset: with the chunk's origins, the future keys.
        let offset = start as i64 - first as i64;
        let mut blocked = Tensor::<B, 2, Bool>::tril_mask([len, keys], offset, &device);
        if let Some(window) = self.window {
            // `triu_mask(offset)` is true where key − query < offset: the keys `window` or more behind.
            blocked = blocked.bool_or(Tensor::triu_mask([len, keys], offset - window as i64 + 1, &device));
        }
        let blocked = blocked.unsqueeze::<3>().expand([batch, len, keys]);
        zeros_in::<B, 3>([batch, len, keys], FloatDType::F32, &device)
            .mask_fill(other_doc.bool_or(blocked), f32::NEG_INFINITY)
    }

    /// The whole `[batch, 1, seq, seq]` additive mask in `dtype` (for the single-softmax reference path).
    pub fn full_mask(&self, dtype: FloatDType) -> Tensor<B, 4> {
        let [_, seq] = self.docs.dims();
        // Built afresh: kept, the whole `[seq, seq]` mask would outlive the layer that reads it.
        self.build_chunk_mask(0, seq, 0, seq).cast(dtype).unsqueeze_dim(1)
    }
}

impl<B: AutodiffBackend> DocumentAttention<B> {
    /// The same layout on the inner backend (the document ids carry no gradient).
    fn inner(&self) -> DocumentAttention<B::InnerBackend> {
        DocumentAttention {
            docs: self.docs.clone().inner(),
            starts: self.starts.clone(),
            chunking: self.chunking,
            window: self.window,
            scale: self.scale,
            masks: self.masks.clone(),
        }
    }
}

/// The query chunks `(start, len, first_key)` of a sequence of `seq` queries whose scores cost
/// `score_bytes` a query and key (all heads and rows of the batch): each chunk as long as its own scores,
/// `len · (start + len − first_key(start))`, stay within `budget` bytes. A chunk sees only the keys up to its
/// last query, so the causal triangle's early chunks take more queries than its late ones (LFM2.5-1.2B at 4096:
/// 5 chunks of at most 256 MiB where equal chunks sized for all 4096 keys took 8), and packed documents
/// (a later `first_key`) longer ones still. Lengths are multiples of 16 (matmul tile rows) where 16 fit and
/// the chunk is not the last; at least one query.
pub fn chunk_spans(
    seq: usize,
    first_key: impl Fn(usize) -> usize,
    score_bytes: usize,
    budget: usize,
) -> Vec<(usize, usize, usize)> {
    let mut spans = Vec::new();
    let mut start = 0;
    while start < seq {
        let first = first_key(start).min(start);
        let fits = |len: usize| len.saturating_mul(start + len - first).saturating_mul(score_bytes) <= budget;
        // The longest length that fits: `fits` holds for 1..=len and fails after it.
        let (mut len, mut over) = (1, seq - start + 1);
        while over - len > 1 {
            let mid = len + (over - len) / 2;
            if fits(mid) { len = mid } else { over = mid }
        }
        if start + len < seq && len >= 16 {
            len -= len % 16;
        }
        spans.push((start, len, first));
        start += len;
    }
    spans
}

/// The chunked forward pass: the output `[batch, heads, seq, d]` and each query's log-sum-exp of its
/// scaled, masked scores `[batch, kv_heads, seq, group, 1]` in f32, in the order of `query_rows` (what the
/// backward pass needs to rebuild the probabilities).
pub struct AttentionForward<B: Backend> {
    pub out: Tensor<B, 4>,
    pub lse: Tensor<B, 5>,
}

/// Queries `[batch, heads, seq, d]` as the score rows of their kv head, `[batch, kv_heads, seq · group, d]`
/// dense: position by position, each position's `group` query heads side by side. A chunk of positions is
/// then one block of rows, which the matmuls read in place; grouped head by head instead, every chunk's
/// queries (and, backwards, their output gradients, log-sum-exps and `δ`) were copied out before each matmul.
fn query_rows<B: Backend>(q: Tensor<B, 4>, kv_heads: usize) -> Tensor<B, 4> {
    let [batch, heads, seq, d] = q.dims();
    let group = heads / kv_heads;
    dense_rows(q.reshape([batch, kv_heads, group, seq, d]).swap_dims(2, 3).reshape([batch, kv_heads, seq * group, d]))
}

/// `[batch, heads, rows, d]` with each head's rows one dense block (a copy only where they are not), so that
/// a chunk of rows goes to a matmul as it is: burn's CubeCL matmul copies any operand whose batch strides
/// are smaller than its row stride, as keys and values viewed out of `[batch, seq, heads, d]` are.
fn dense_rows<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    let [batch, heads, rows, d] = x.dims();
    x.reshape([batch, heads, rows * d]).reshape([batch, heads, rows, d])
}

/// A chunk's rows `[batch, kv_heads, len · group, d]` (`query_rows`' order) viewed positions first, `[batch,
/// len, kv_heads, group, d]`: concatenated along positions (`heads_of_positions`), the chunks write `[batch,
/// seq, heads, d]` directly, the layout the output projection reads.
fn positions_first<B: Backend>(rows: Tensor<B, 4>, group: usize) -> Tensor<B, 5> {
    let [batch, kv_heads, group_len, d] = rows.dims();
    rows.reshape([batch, kv_heads, group_len / group, group, d]).permute([0, 2, 1, 3, 4])
}

/// The chunks' `positions_first` views concatenated: `[batch, heads, seq, d]`, a view of a dense `[batch,
/// seq, heads, d]` (so `merge_heads` copies nothing).
fn heads_of_positions<B: Backend>(chunks: Vec<Tensor<B, 5>>) -> Tensor<B, 4> {
    let whole = Tensor::cat(chunks, 1);
    let [batch, seq, kv_heads, group, d] = whole.dims();
    whole.reshape([batch, seq, kv_heads * group, d]).swap_dims(1, 2)
}

/// Which queries and keys one chunk's score rows cover: queries `start..start + len` (of each batch row and
/// kv head, each position's `group` query heads in consecutive rows: `query_rows`), keys `first..start +
/// len`, the window bounding what a query sees (`DocumentAttention::with_window`), and the scale of their
/// scores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkRows {
    pub start: usize,
    pub len: usize,
    pub group: usize,
    pub first: usize,
    pub window: Option<usize>,
    pub scale: f64,
}

impl ChunkRows {
    fn new<B: Backend>(
        (start, len, first): (usize, usize, usize),
        group: usize,
        docs: &DocumentAttention<B>,
        d: usize,
    ) -> Self {
        ChunkRows { start, len, group, first, window: docs.window(), scale: docs.scale(d) }
    }

    /// Where the chunk's rows lie along dim 2 of a `[batch, kv_heads, seq · group, width]` tensor in
    /// `query_rows`' order.
    fn row_range(&self) -> std::ops::Range<usize> {
        self.start * self.group..(self.start + self.len) * self.group
    }

    /// The chunk's rows of a `[batch, kv_heads, seq · group, width]` tensor in `query_rows`' order: a view.
    fn of<B: Backend>(&self, rows: &Tensor<B, 4>) -> Tensor<B, 4> {
        let range = self.row_range();
        rows.clone().narrow(2, range.start, range.len())
    }

    /// Keys per score row.
    pub fn keys(&self) -> usize {
        self.start + self.len - self.first
    }
}

/// One chunk's queries `[batch, kv_heads, len · group, d]` (`query_rows`), keys and values `[batch,
/// kv_heads, keys, d]`, all views, and its unscaled scores `q kᵀ` in the inputs' dtype `[batch, kv_heads,
/// len · group, keys]`.
struct Chunk<B: Backend> {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    scores: Tensor<B, 4>,
}

impl<B: ModelBackend> Chunk<B> {
    /// From the queries as `query_rows` lays them out and dense keys and values (`dense_rows`).
    fn new(q_rows: &Tensor<B, 4>, k: &Tensor<B, 4>, v: &Tensor<B, 4>, rows: ChunkRows) -> Self {
        let q = rows.of(q_rows);
        let k = k.clone().narrow(2, rows.first, rows.keys());
        let v = v.clone().narrow(2, rows.first, rows.keys());
        let scores = B::matmul(q.clone(), k.clone().swap_dims(2, 3));
        Chunk { q, k, v, scores }
    }
}

/// A chunk's scaled, masked scores in f32 `[batch, kv_heads, len, group, keys]` from its unscaled ones.
fn masked_scores<B: Backend>(scores: Tensor<B, 4>, docs: &DocumentAttention<B>, rows: ChunkRows) -> Tensor<B, 5> {
    let [batch, kv_heads, _, keys] = scores.dims();
    let ChunkRows { start, len, group, first, scale, .. } = rows;
    let mask = docs.chunk_mask(start, len, first, keys).reshape([batch, 1, len, 1, keys]);
    (scores.cast(FloatDType::F32) * scale).reshape([batch, kv_heads, len, group, keys]) + mask
}

/// A chunk's softmax rows as tensor ops (`softmax_rows_into`'s, and the reference of the kernels): the softmax
/// of each score row over the keys its query may see, in the scores' dtype, and its log-sum-exp
/// `[batch, kv_heads, len · group, 1]` in f32.
pub fn softmax_rows<B: Backend>(
    scores: Tensor<B, 4>,
    docs: &DocumentAttention<B>,
    rows: ChunkRows,
) -> [Tensor<B, 4>; 2] {
    let shape = scores.dims();
    let dtype = FloatDType::from(scores.dtype());
    let masked = masked_scores(scores, docs, rows);
    let max = masked.clone().max_dim(4);
    let exp = (masked - max.clone()).exp();
    let sum = exp.clone().sum_dim(4);
    let probs = (exp / sum.clone()).cast(dtype).reshape(shape);
    [probs, (max + sum.log()).reshape([shape[0], shape[1], shape[2], 1])]
}

/// `ModelBackend::attention_score_grads` as tensor ops: from a chunk's unscaled scores `S`, the gradient
/// `dP = dO Vᵀ` of its probabilities, and the whole sequence's log-sum-exp and `δ = rowsum(dO ⊙ O)` per
/// query row (`[batch, kv_heads, seq · group, 1]` in `query_rows`' order, f32; the chunk reads its rows in
/// place), the probabilities `P = exp(S/√d − lse)` (0 where masked) and the scores' gradient
/// `P ⊙ (dP − δ) / √d`, both in the scores' dtype.
pub fn score_grads<B: Backend>(
    scores: Tensor<B, 4>,
    grad_probs: Tensor<B, 4>,
    lse: Tensor<B, 4>,
    delta: Tensor<B, 4>,
    docs: &DocumentAttention<B>,
    rows: ChunkRows,
) -> [Tensor<B, 4>; 2] {
    let shape = scores.dims();
    let [batch, kv_heads, _, keys] = shape;
    let dtype = FloatDType::from(scores.dtype());
    let five = |t: Tensor<B, 4>, width| t.reshape([batch, kv_heads, rows.len, rows.group, width]);
    let probs = (masked_scores(scores, docs, rows) - five(rows.of(&lse), 1)).exp();
    let grad_probs = five(grad_probs.cast(FloatDType::F32), keys);
    let grad_scores = (probs.clone() * (grad_probs - five(rows.of(&delta), 1))) * rows.scale;
    [probs.cast(dtype).reshape(shape), grad_scores.cast(dtype).reshape(shape)]
}

/// `ModelBackend::attention_add_key_grads` as tensor ops: a chunk's key and value gradients `[batch,
/// kv_heads, keys, d]` (keys `first..first + keys`) added into the whole sequence's `[batch, kv_heads, seq, d]`
/// (f32), each a slice, an addition and a slice write.
pub fn add_key_grads<B: Backend>(
    [grad_k, grad_v]: [Tensor<B, 4>; 2],
    [part_k, part_v]: [Tensor<B, 4>; 2],
    first: usize,
) -> [Tensor<B, 4>; 2] {
    let add = |whole: Tensor<B, 4>, part: Tensor<B, 4>| {
        let [batch, kv_heads, keys, d] = part.dims();
        let at = [0..batch, 0..kv_heads, first..first + keys, 0..d];
        whole.clone().slice_assign(at.clone(), whole.slice(at) + part.cast(FloatDType::F32))
    };
    [add(grad_k, part_k), add(grad_v, part_v)]
}

/// The exact attention of `ModelBackend::document_attention`, chunk by chunk, on any backend: the matmuls
/// as tensor ops, each chunk's softmax rows by the backend (`ModelBackend::attention_probs`).
pub fn chunked_attention<B: ModelBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    docs: &DocumentAttention<B>,
) -> AttentionForward<B> {
    let [batch, heads, seq, d] = q.dims();
    let kv_heads = k.dims()[1];
    let group = heads / kv_heads;
    let (q_rows, k, v) = (query_rows(q, kv_heads), dense_rows(k), dense_rows(v));
    let mut outs = Vec::new();
    // Every row is written by the chunk of its query (the chunks cover the sequence).
    let mut lse = Tensor::<B, 4>::empty([batch, kv_heads, seq * group, 1], (&q_rows.device(), DType::F32));
    for chunk in docs.chunks(heads) {
        let rows = ChunkRows::new(chunk, group, docs, d);
        let Chunk { v, scores, .. } = Chunk::new(&q_rows, &k, &v, rows);
        let probs;
        [probs, lse] = B::attention_probs(scores, lse, docs, rows);
        outs.push(positions_first(B::matmul(probs, v), group));
    }
    AttentionForward { out: heads_of_positions(outs), lse: lse.reshape([batch, kv_heads, seq, group, 1]) }
}

/// `ModelBackend::attention_probs` as tensor ops: `softmax_rows`, its log-sum-exp written into the chunk's
/// rows of the whole sequence's `lse` (a slice write).
pub fn softmax_rows_into<B: Backend>(
    scores: Tensor<B, 4>,
    lse: Tensor<B, 4>,
    docs: &DocumentAttention<B>,
    rows: ChunkRows,
) -> [Tensor<B, 4>; 2] {
    let [probs, chunk_lse] = softmax_rows(scores, docs, rows);
    let [batch, kv_heads, ..] = lse.dims();
    let at = [0..batch, 0..kv_heads, rows.row_range(), 0..1];
    [probs, lse.slice_assign(at, chunk_lse)]
}

/// Gradients of `chunked_attention` with respect to q, k and v (in their dtypes) for the output gradient
/// `grad_out`, from the saved output and log-sum-exp: per chunk `P = exp(S − lse)`, `dV += Pᵀ dO`,
/// `dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)) / √d` (`ModelBackend::attention_score_grads`), `dQ = dS K`,
/// `dK += dSᵀ Q` (dK, dV summed in f32).
pub fn chunked_attention_backward<B: ModelBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    docs: &DocumentAttention<B>,
    forward: AttentionForward<B>,
    grad_out: Tensor<B, 4>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let [batch, heads, seq, d] = q.dims();
    let kv_heads = k.dims()[1];
    let group = heads / kv_heads;
    let dtype = FloatDType::from(q.dtype());
    let device = q.device();
    let (q_rows, k, v) = (query_rows(q, kv_heads), dense_rows(k), dense_rows(v));
    let grad_out = grad_out.cast(dtype);
    let delta =
        query_rows((grad_out.clone().cast(FloatDType::F32) * forward.out.cast(FloatDType::F32)).sum_dim(3), kv_heads);
    let grad_rows = query_rows(grad_out, kv_heads);
    let lse = forward.lse.reshape([batch, kv_heads, seq * group, 1]);
    let zeros = || zeros_in::<B, 4>([batch, kv_heads, seq, d], FloatDType::F32, &device);
    let (mut grad_k, mut grad_v) = (zeros(), zeros());
    let mut grad_q = Vec::new();
    for chunk in docs.chunks(heads) {
        let rows = ChunkRows::new(chunk, group, docs, d);
        let Chunk { q, k, v, scores } = Chunk::new(&q_rows, &k, &v, rows);
        let grad_o = rows.of(&grad_rows);
        let grad_probs = B::matmul(grad_o.clone(), v.swap_dims(2, 3));
        let [probs, grad_s] = B::attention_score_grads(scores, grad_probs, lse.clone(), delta.clone(), docs, rows);
        let part_v = B::matmul(probs.swap_dims(2, 3), grad_o);
        grad_q.push(positions_first(B::matmul(grad_s.clone(), k), group));
        let part_k = B::matmul(grad_s.swap_dims(2, 3), q);
        [grad_k, grad_v] = B::attention_add_key_grads([grad_k, grad_v], [part_k, part_v], rows.first);
    }
    (heads_of_positions(grad_q), grad_k.cast(dtype), grad_v.cast(dtype))
}

/// The inputs the backward pass needs: q, k, v through the checkpointer (recomputed or kept, as the
/// checkpointing strategy decides), the output and log-sum-exp, and the document layout.
#[derive(Debug, Clone)]
struct SavedAttention<B: Backend> {
    q: NodeId,
    k: NodeId,
    v: NodeId,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    docs: DocumentAttention<B>,
}

#[derive(Debug)]
struct ChunkedAttentionBackward;

impl<B: ModelBackend> Backward<B, 3> for ChunkedAttentionBackward {
    type State = SavedAttention<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let saved = ops.state;
        let [parent_q, parent_k, parent_v] = ops.parents;
        let grad_out = grads.consume::<B>(&ops.node);
        if parent_q.is_none() && parent_k.is_none() && parent_v.is_none() {
            return;
        }
        let tensor4 = |t: FloatTensor<B>| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
        let q = tensor4(checkpointer.retrieve_node_output(saved.q));
        let k = tensor4(checkpointer.retrieve_node_output(saved.k));
        let v = tensor4(checkpointer.retrieve_node_output(saved.v));
        let forward = AttentionForward {
            out: tensor4(saved.out),
            lse: Tensor::from_primitive(TensorPrimitive::Float(saved.lse)),
        };
        let (grad_q, grad_k, grad_v) = B::attention_backward(q, k, v, &saved.docs, forward, tensor4(grad_out));
        for (parent, grad) in [(parent_q, grad_q), (parent_k, grad_k), (parent_v, grad_v)] {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad.into_primitive().tensor());
            }
        }
    }
}

/// `softmax(q kᵀ / √d + mask) v` for queries `[batch, heads, seq, d]` and keys, values `[batch, kv_heads,
/// total, d]`, each kv head serving `heads / kv_heads` consecutive query heads (repeat_interleave); softmax
/// in f32 whatever the compute dtype, as transformers' eager attention. Returns `[batch, heads, seq, d]`.
/// One softmax over the whole mask: cached decoding's attention (its mask spans the cache), the tests'
/// reference, and the reference ops' (`ops::set_reference_ops`).
pub fn softmax_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &Tensor<B, 4>,
) -> Tensor<B, 4> {
    let scale = 1.0 / (q.dims()[3] as f64).sqrt();
    scaled_softmax_attention(q, k, v, mask, scale)
}

/// `softmax_attention` with the scores scaled by `scale` instead of `1/√d`.
pub fn scaled_softmax_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &Tensor<B, 4>,
    scale: f64,
) -> Tensor<B, 4> {
    let [batch, nh, _, hd] = q.dims();
    let [_, nkv, total, _] = k.dims();
    let repeat = |t: Tensor<B, 4>| {
        if nh == nkv { t } else { t.unsqueeze_dim::<5>(2).repeat_dim(2, nh / nkv).reshape([batch, nh, total, hd]) }
    };
    let scores = q.matmul(repeat(k).swap_dims(2, 3)) * scale + mask.clone();
    let dtype = scores.dtype();
    softmax(scores.cast(FloatDType::F32), 3).cast(dtype).matmul(repeat(v))
}

/// The backend's `masked_attention` (`softmax_attention`, scores scaled by `1/√d`) with the heads merged:
/// `[batch, seq, heads * d]`.
pub fn grouped_attention<B: ModelBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &Tensor<B, 4>,
) -> Tensor<B, 3> {
    let scale = default_scale(q.dims()[3]);
    merge_heads(B::masked_attention(q, k, v, mask, scale))
}

/// `[batch, heads, seq, d]` heads side by side: `[batch, seq, heads · d]`.
pub fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [batch, heads, seq, d] = x.dims();
    x.swap_dims(1, 2).reshape([batch, seq, heads * d])
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::backend::{Cpu, CpuTrain, CpuTrainCheckpointed};
    use crate::testing::{assert_close, normal, values};

    /// Two rows packed with documents and padding: row 0 = docs of 3, 5, 2 then 2 padding tokens; row 1 = 9, 3.
    fn layout() -> SequenceLayout {
        SequenceLayout::from_doc_lengths(&[vec![3, 5, 2], vec![9, 3]], 12)
    }

    #[test]
    fn the_mask_is_causal_within_each_document_and_chunks_skip_only_blocked_keys() {
        let l = layout();
        let docs = DocumentAttention::<Cpu>::new(&l, &Default::default());
        // Row 1's first document spans 0..9, so no query before 9 may skip a key; from 9 on, row 0's
        // documents (starting at 8, then padding at 10, 11) bound what both rows need.
        assert_eq!((0..12).map(|i| docs.first_key(i)).collect::<Vec<_>>(), [0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 9, 9]);
        assert_masks_allow(&l, docs.clone(), None);
        for window in [1, 2, 4] {
            assert_masks_allow(&l, docs.clone().with_window(window), Some(window));
        }
        // A window of 4: row 1's first document bounds the first keys from query 3 on (its queries see 4 keys).
        let windowed = docs.with_window(4);
        assert_eq!((0..12).map(|i| windowed.first_key(i)).collect::<Vec<_>>(), [0, 0, 0, 0, 1, 2, 3, 4, 5, 8, 9, 9]);
        assert_eq!(&windowed.query_starts()[12..], [0, 0, 0, 0, 1, 2, 3, 4, 5, 9, 9, 9]);
    }

    #[test]
    fn a_layout_builds_each_chunk_mask_once_for_all_its_passes() {
        let docs = DocumentAttention::<CpuTrain>::new(&layout(), &Default::default()).with_chunk_rows(5);
        let built = |masks: &ChunkMasks| masks.0.lock().map(|m| m.len()).expect("not poisoned");
        let first = values(docs.inner().chunk_mask(5, 5, 0, 10));
        // Another layer's (or the backward pass's) copy of the layout finds it.
        assert_eq!(values(docs.inner().chunk_mask(5, 5, 0, 10)), first);
        assert_eq!(built(&docs.masks), 1);
        assert_eq!(first, values(docs.inner().build_chunk_mask(5, 5, 0, 10)));
        // The same documents through a window have masks of their own.
        let windowed = docs.clone().with_window(2).inner();
        assert_ne!(values(windowed.chunk_mask(5, 5, 0, 10)), first);
        assert_eq!((built(&docs.masks), built(&windowed.masks)), (1, 1));
    }

    /// The full mask and every chunking's masks of `docs` allow exactly the keys of a query's document up to
    /// itself and, with a window, no more than `window` of them.
    fn assert_masks_allow(l: &SequenceLayout, docs: DocumentAttention<Cpu>, window: Option<usize>) {
        let full = docs.full_mask(FloatDType::F32);
        assert_eq!(full.dims(), [2, 1, 12, 12]);
        let got = values(full);
        let allowed = |row: usize, q: usize, k: usize| {
            k <= q && window.is_none_or(|w| q - k < w) && l.doc_ids[row * 12 + k] == l.doc_ids[row * 12 + q]
        };
        for row in 0..2 {
            for q in 0..12 {
                for k in 0..12 {
                    let value = got[(row * 12 + q) * 12 + k];
                    assert_eq!(value == 0.0, allowed(row, q, k), "row {row} query {q} key {k}: {value}");
                    assert!(allowed(row, q, k) || value == f32::NEG_INFINITY);
                }
            }
        }
        let by_rows = [1, 3, 5].map(|rows| docs.clone().with_chunk_rows(rows));
        for chunked in by_rows.into_iter().chain([20 * 32, 48 * 32].map(|bytes| docs.clone().with_chunk_budget(bytes)))
        {
            let chunks = chunked.chunks(4);
            let how = chunked.chunking;
            assert_eq!(chunks.iter().map(|c| c.1).sum::<usize>(), 12, "{how:?}: the chunks cover the sequence");
            for (start, len, first) in chunks {
                let mask = values(chunked.chunk_mask(start, len, first, start + len - first));
                for row in 0..2 {
                    for q in start..start + len {
                        // Every allowed key of the chunk's queries lies inside its key range …
                        assert!((0..first).chain(start + len..12).all(|k| !allowed(row, q, k)));
                        // … and inside it the chunk's mask is the full mask.
                        for k in first..start + len {
                            let value = mask[(row * len + q - start) * (start + len - first) + k - first];
                            assert_eq!(
                                value == 0.0,
                                allowed(row, q, k),
                                "{how:?}, window {window:?}, chunk at {start}: row {row} q {q} k {k}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Output, and gradients of `Σ out ⊙ R` for a random `R`, of the chunked op and of the single softmax.
    #[allow(clippy::type_complexity)]
    fn both<B: ModelBackend + burn::tensor::backend::AutodiffBackend>(
        dtype: FloatDType,
        chunking: Chunking,
        form: Form,
    ) -> ([Vec<f32>; 4], [Vec<f32>; 4]) {
        let device = Default::default();
        let l = layout();
        let (batch, heads, kv_heads, seq, d) = (2, 4, 2, 12, 8);
        let leaf =
            |dims: [usize; 4], seed: u64| normal::<B, 4>(dims, 0.0, 1.0, seed, &device).cast(dtype).require_grad();
        let q = leaf([batch, heads, seq, d], 1);
        let k = leaf([batch, kv_heads, seq, d], 2);
        let v = leaf([batch, kv_heads, seq, d], 3);
        let weights = normal::<B, 3>([batch, seq, heads * d], 0.0, 1.0, 4, &device).cast(dtype);
        let docs = DocumentAttention::<B>::new(&l, &device);
        let docs = form.apply(match chunking {
            Chunking::Rows(rows) => docs.with_chunk_rows(rows),
            Chunking::Budget(Some(bytes)) => docs.with_chunk_budget(bytes),
            Chunking::Budget(None) => docs,
        });
        let run = |out: Tensor<B, 3>| {
            let grads = (out.clone() * weights.clone()).sum().backward();
            let grad = |t: &Tensor<B, 4>| values(t.grad(&grads).expect("a gradient"));
            [values(out), grad(&q), grad(&k), grad(&v)]
        };
        let chunked = run(merge_heads(B::document_attention(q.clone(), k.clone(), v.clone(), &docs)));
        let mask = docs.full_mask(dtype);
        let plain = run(merge_heads(scaled_softmax_attention(q.clone(), k.clone(), v.clone(), &mask, docs.scale(d))));
        (chunked, plain)
    }

    /// How attention weighs and bounds what it sees: `1/√d` and whole documents, or Gemma 4's sliding
    /// window layers (scale 1, a window shorter than the documents).
    #[derive(Debug, Clone, Copy)]
    enum Form {
        Documents,
        Window(usize),
    }

    impl Form {
        fn apply<B: Backend>(self, docs: DocumentAttention<B>) -> DocumentAttention<B> {
            match self {
                Form::Documents => docs,
                Form::Window(w) => docs.with_window(w).with_scale(1.0),
            }
        }
    }

    const NAMES: [&str; 4] = ["output", "dq", "dk", "dv"];

    #[test]
    fn chunked_attention_and_its_backward_equal_the_single_softmax_in_f32() {
        // Budgets of 20 and 48 scores a query and key (2 rows, 4 heads: 32 bytes each): chunks of 4, 2, 2, 2, 2
        // and of 6, 4, 2 queries over the test's documents.
        let budgets = [20 * 32, 48 * 32];
        let docs = DocumentAttention::<Cpu>::new(&layout(), &Default::default());
        for (budget, lengths) in budgets.into_iter().zip([[4, 2, 2, 2, 2].as_slice(), &[6, 4, 2]]) {
            let spans = docs.clone().with_chunk_budget(budget).chunks(4);
            assert_eq!(spans.iter().map(|span| span.1).collect::<Vec<_>>(), lengths);
        }
        let chunkings = [1, 3, 5, 12].map(Chunking::Rows).into_iter().chain(budgets.map(|b| Chunking::Budget(Some(b))));
        for form in [Form::Documents, Form::Window(3)] {
            for chunking in chunkings.clone() {
                let (chunked, plain) = both::<CpuTrain>(FloatDType::F32, chunking, form);
                for (name, (a, b)) in NAMES.iter().zip(chunked.iter().zip(&plain)) {
                    assert_close(&format!("{name}, {form:?}, {chunking:?}"), a, b, 2e-6);
                }
            }
            let (chunked, plain) = both::<CpuTrainCheckpointed>(FloatDType::F32, Chunking::Rows(5), form);
            for (name, (a, b)) in NAMES.iter().zip(chunked.iter().zip(&plain)) {
                assert_close(&format!("{name}, {form:?}, checkpointed"), a, b, 2e-6);
            }
        }
    }

    #[test]
    fn chunked_attention_in_bf16_stays_within_bf16_rounding_of_the_single_softmax() {
        for form in [Form::Documents, Form::Window(3)] {
            let (chunked, plain) = both::<CpuTrain>(FloatDType::BF16, Chunking::Rows(5), form);
            // The reference scales the bf16 scores before its f32 softmax, the chunked op after the cast, and
            // rounds probabilities and gradients at other points: agreement to two bf16 ulps (2⁻⁷ each) of
            // the largest value (seen: one ulp, 0.6 % of it).
            for (name, (a, b)) in NAMES.iter().zip(chunked.iter().zip(&plain)) {
                assert_close(&format!("{name}, {form:?}"), a, b, 1.0 / 64.0);
            }
        }
    }

    #[test]
    fn a_plain_backend_gives_the_autodiff_forward() {
        let device = Default::default();
        let l = layout();
        let tensor = |dims: [usize; 4], seed: u64| normal::<Cpu, 4>(dims, 0.0, 1.0, seed, &device);
        let (q, k, v) = (tensor([2, 4, 12, 8], 1), tensor([2, 2, 12, 8], 2), tensor([2, 2, 12, 8], 3));
        let docs = DocumentAttention::<Cpu>::new(&l, &device).with_chunk_rows(4);
        let plain = values(merge_heads(Cpu::document_attention(q.clone(), k.clone(), v.clone(), &docs)));
        let reference = values(grouped_attention(q, k, v, &docs.full_mask(FloatDType::F32)));
        assert_close("output", &plain, &reference, 2e-6);
    }

    /// The spans of `chunk_spans`, checked: they cover the sequence in order, each within the budget (or a
    /// single query), each but the last a multiple of 16 that 16 more queries would take over the budget.
    fn checked_spans(seq: usize, first_key: impl Fn(usize) -> usize, score_bytes: usize, budget: usize) -> Vec<usize> {
        let spans = chunk_spans(seq, &first_key, score_bytes, budget);
        let scores = |start: usize, len: usize, first: usize| len * (start + len - first) * score_bytes;
        let mut next = 0;
        for (i, &(start, len, first)) in spans.iter().enumerate() {
            assert_eq!((start, first), (next, first_key(start)), "span {i} of {spans:?}");
            assert!(len == 1 || scores(start, len, first) <= budget, "span {i} over the budget: {spans:?}");
            if i + 1 < spans.len() && len >= 16 {
                assert_eq!(len % 16, 0, "span {i}: {spans:?}");
                assert!(scores(start, len + 16, first) > budget, "span {i} could be longer: {spans:?}");
            }
            next = start + len;
        }
        assert_eq!(next, seq, "the spans cover the sequence: {spans:?}");
        spans.iter().map(|span| span.1).collect()
    }

    #[test]
    fn chunks_hold_their_own_scores_within_the_budget() {
        let budget = CHUNK_SCORE_BYTES;
        let one_document = |_: usize| 0;
        // LFM2.5-1.2B at 4096 (32 heads, f32 scores): 5 chunks, where 8 equal ones sized for every key were.
        assert_eq!(checked_spans(4096, one_document, 32 * 4, budget), [1440, 896, 688, 576, 496]);
        // LFM2-350M (16 heads): 3 for 4; Qwen3.5-0.8B (8 heads): 2, as before; 1 GiB: 2 for the 1.2B shape.
        assert_eq!(checked_spans(4096, one_document, 16 * 4, budget), [2048, 1264, 784]);
        assert_eq!(checked_spans(4096, one_document, 8 * 4, budget).len(), 2);
        assert_eq!(checked_spans(4096, one_document, 32 * 4, 1 << 30).len(), 2);
        // Two rows hold twice the scores a query and key.
        assert_eq!(checked_spans(4096, one_document, 2 * 32 * 4, budget).len(), 10);
        // Packed documents of 512 tokens: a chunk's keys start at its first query's document.
        let packed = checked_spans(4096, |i| i / 512 * 512, 32 * 4, budget);
        assert!(packed.len() < 5 && packed[0] == 1440, "{packed:?}");
        // A sliding window of 512 keys (Gemma 4's local layers): past the first, chunks of the same length.
        let windowed = checked_spans(4096, |i| (i + 1).saturating_sub(512), 32 * 4, budget);
        assert_eq!(windowed, [1440, 1200, 1200, 256]);
        // Short sequences take one chunk; a budget below one query's scores takes one query a chunk.
        assert_eq!(checked_spans(12, one_document, 4 * 4, budget), [12]);
        assert_eq!(checked_spans(12, one_document, 4 * 4, 1), [1; 12]);
        assert_eq!(checked_spans(100, one_document, 4, 40 * 4 * 40), [32, 16, 16, 16, 16, 4]);
    }

    #[test]
    fn the_chunk_budget_reads_whole_mib_and_rejects_the_rest() {
        assert_eq!(parse_chunk_mib("1024"), Ok(1 << 30));
        assert_eq!(parse_chunk_mib(" 1 "), Ok(1 << 20));
        assert_eq!(parse_chunk_mib(""), Ok(CHUNK_SCORE_BYTES));
        for bad in ["0", "-1", "1.5", "1g", "1048577"] {
            let why = parse_chunk_mib(bad).expect_err(bad);
            assert!(why.contains(CHUNK_MIB_ENV) && why.contains("unset: 256"), "{bad}: {why}");
        }
    }
}
