//! Cached decoding: per layer a KV cache (attention; Gemma 4's KV-sharing layers read their source's), the
//! last `L-1` conv inputs (LFM2 conv, DeltaNet conv) and the `[dk × dv]` state per head (DeltaNet); batched
//! prompts of different lengths (left-padded; padding is masked out and never enters an attention cache)
//! and generation, greedy or sampled (`sampling`). A prompt into an empty cache attends as the full forward
//! does, in chunks of queries; later calls through a mask over the cache (`StepAttention`). Incremental
//! logits equal the full forward's.

use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};

use super::attention::{DocumentAttention, default_scale, merge_heads};
use super::deltanet::{self, ChunkPlan, DocSegments};
use super::gemma4::Gemma4Model;
use super::layers::{Project, RopeTables, SequenceLayout, causal_depthwise_conv_cached, head_logits, soft_cap};
use super::lfm2::{Attention, FeedForward, Lfm2Model, Mixer, ShortConv};
use super::ops::ModelBackend;
use super::qwen3_5::{GatedAttention, GatedDeltaNet, Qwen35Mixer, Qwen35Model, SCAN_CHUNK};
use super::sampling::TokenPicker;
use crate::backend::{host_tensor, zeros_in};

/// What a batch has decoded so far: per row, which cached positions are real tokens (padding is not).
#[derive(Debug, Clone)]
struct History {
    valid: Vec<Vec<bool>>,
    /// Per row: real tokens so far (the next token's RoPE position).
    lengths: Vec<usize>,
}

/// The positions, attention and padding mask of one decoding call.
struct Step<B: Backend> {
    layout: SequenceLayout,
    /// What a new token sees: earlier real tokens and itself.
    attention: StepAttention<B>,
    /// `[batch, seq, 1]`: 1 for real tokens.
    valid: Tensor<B, 3>,
}

/// How the tokens of one decoding call attend. Prompts run into an empty cache (left-padded) attend within
/// themselves as a training forward does (`ModelBackend::document_attention`, a chunk of queries at a time):
/// an explicit mask and the scores of a whole prompt are `[seq, seq]` a row and a head, 2.2 GB of f32 mask a
/// row for TB2-lite's longest prompt (23.5k tokens). A call continuing a cache (the next token, a chat's next turn) attends to
/// every cached position through an additive mask `[batch, 1, seq, cached + seq]`, small while `seq` is.
enum StepAttention<B: Backend> {
    Prompt(DocumentAttention<B>),
    Cached {
        mask: Tensor<B, 4>,
        /// The scores' scale; `None`: `1/√d`.
        scale: Option<f64>,
    },
}

impl<B: ModelBackend> StepAttention<B> {
    /// Each head's output `[batch, heads, seq, d]` for the new tokens' queries and every cached key and value.
    fn attend(&self, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
        match self {
            StepAttention::Prompt(docs) => B::document_attention(q, k, v, docs),
            StepAttention::Cached { mask, scale } => {
                let scale = scale.unwrap_or_else(|| default_scale(q.dims()[3]));
                B::masked_attention(q, k, v, mask, scale)
            }
        }
    }
}

impl History {
    fn new(batch: usize) -> Self {
        History { valid: vec![Vec::new(); batch], lengths: vec![0; batch] }
    }

    /// The layout, attention and validity of the next tokens, in `dtype` (the model's); `scale`: the attention
    /// scores' (`None`: `1/√d`).
    fn step<B: ModelBackend>(
        &self,
        valid: &[Vec<bool>],
        scale: Option<f64>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Step<B> {
        let batch = valid.len();
        let seq = valid.first().map_or(0, Vec::len);
        // Positions continue each row's real-token count; padding takes position 0. Real tokens are document
        // 0, each padding token a document of its own (what attention over a prompt keeps apart).
        let (mut positions, mut doc_ids) = (Vec::with_capacity(batch * seq), Vec::with_capacity(batch * seq));
        for (row_valid, &done) in valid.iter().zip(&self.lengths) {
            let mut n = done;
            for (at, &ok) in row_valid.iter().enumerate() {
                positions.push(if ok { n as u32 } else { 0 });
                doc_ids.push(if ok { 0 } else { at as u32 + 1 });
                n += usize::from(ok);
            }
        }
        let layout = SequenceLayout { batch, seq, doc_ids, positions };
        let valid_f: Vec<f32> = valid.iter().flatten().map(|&v| if v { 1.0 } else { 0.0 }).collect();
        Step {
            attention: self.attention(valid, &layout, None, scale, dtype, device),
            layout,
            valid: host_tensor(valid_f, [batch, seq, 1], dtype, device),
        }
    }

    /// How the next tokens (laid out as `layout`) attend, within `window` real tokens where given: a prompt into
    /// an empty cache, left-padded, as a training forward; anything else through `mask`.
    fn attention<B: ModelBackend>(
        &self,
        valid: &[Vec<bool>],
        layout: &SequenceLayout,
        window: Option<usize>,
        scale: Option<f64>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> StepAttention<B> {
        let empty = self.valid.iter().all(Vec::is_empty);
        let left_padded = valid.iter().all(|row| row.iter().skip_while(|&&ok| !ok).all(|&ok| ok));
        if !(empty && left_padded) {
            return StepAttention::Cached { mask: self.mask(valid, window, dtype, device), scale };
        }
        let docs = DocumentAttention::new(layout, device);
        let docs = match window {
            Some(window) => docs.with_window(window),
            None => docs,
        };
        StepAttention::Prompt(match scale {
            Some(scale) => docs.with_scale(scale),
            None => docs,
        })
    }

    /// The additive mask `[batch, 1, seq, cached + seq]` of the next tokens: a new token sees earlier real
    /// tokens and itself; with a `window`, only those fewer than `window` real tokens behind it (a sliding-
    /// window layer, as in training, where padding is never in the window).
    fn mask<B: Backend>(
        &self,
        valid: &[Vec<bool>],
        window: Option<usize>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Tensor<B, 4> {
        let batch = valid.len();
        let seq = valid.first().map_or(0, Vec::len);
        let past = self.valid.first().map_or(0, Vec::len);
        let total = past + seq;
        let mut mask = vec![f32::NEG_INFINITY; batch * seq * total];
        for row in 0..batch {
            let seen: Vec<bool> = self.valid[row].iter().chain(&valid[row]).copied().collect();
            // Each cached position's real-token index (padding shares the next real token's).
            let position: Vec<usize> = seen
                .iter()
                .scan(0, |n, &ok| {
                    let at = *n;
                    *n += usize::from(ok);
                    Some(at)
                })
                .collect();
            for i in 0..seq {
                let query = past + i;
                for j in 0..=query {
                    let near = window.is_none_or(|w| position[query] - position[j] < w);
                    if (seen[j] || j == query) && near {
                        mask[(row * seq + i) * total + j] = 0.0;
                    }
                }
            }
        }
        host_tensor(mask, [batch, 1, seq, total], dtype, device)
    }

    fn push(&mut self, valid: &[Vec<bool>]) {
        for ((seen, length), row_valid) in self.valid.iter_mut().zip(self.lengths.iter_mut()).zip(valid) {
            seen.extend_from_slice(row_valid);
            *length += row_valid.iter().filter(|&&v| v).count();
        }
    }
}

/// An attention layer's keys and values after RoPE, `[batch, kv_heads, capacity, head_dim]` each, of which
/// the first `len` positions are filled. New positions are written into spare capacity
/// (`ModelBackend::write_cache_rows`, in place), which grows by half again when full: a decoded token costs
/// its own keys and values, not a copy of the whole cache (`cat` per token was a tenth of a CPU evaluation).
/// A clone shares the buffers until one side writes (burn copies a shared buffer before writing into it), so
/// a kept state (`KeptStates`) stays as it was.
#[derive(Clone)]
struct KvCache<B: Backend> {
    keys: Option<Tensor<B, 4>>,
    values: Option<Tensor<B, 4>>,
    len: usize,
}

impl<B: ModelBackend> KvCache<B> {
    fn new() -> Self {
        KvCache { keys: None, values: None, len: 0 }
    }

    /// Appends `k` and `v` (`[batch, kv_heads, new, head_dim]`) and returns every cached key and value
    /// (views of the filled positions).
    fn append(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let len = self.len + k.dims()[2];
        let keys = append_rows(self.keys.take(), self.len, k);
        let values = append_rows(self.values.take(), self.len, v);
        self.len = len;
        let filled = (keys.clone().narrow(2, 0, len), values.clone().narrow(2, 0, len));
        (self.keys, self.values) = (Some(keys), Some(values));
        filled
    }
}

impl<B: Backend> KvCache<B> {
    /// Every cached key and value (views of the filled positions).
    fn filled(&self) -> Option<(Tensor<B, 4>, Tensor<B, 4>)> {
        let (keys, values) = (self.keys.as_ref()?, self.values.as_ref()?);
        Some((keys.clone().narrow(2, 0, self.len), values.clone().narrow(2, 0, self.len)))
    }
}

/// Room for `needed` positions and half as many again (at least 64): a generation copies its cache a
/// logarithmic number of times.
fn grown_capacity(needed: usize) -> usize {
    needed + (needed / 2).max(64)
}

/// `rows [batch, heads, new, d]` written after the first `len` positions of `cache`, into a larger cache
/// when it has no room left.
fn append_rows<B: ModelBackend>(cache: Option<Tensor<B, 4>>, len: usize, rows: Tensor<B, 4>) -> Tensor<B, 4> {
    let [batch, heads, new, d] = rows.dims();
    let needed = len + new;
    let cache = match cache {
        Some(cache) if cache.dims()[2] >= needed => cache,
        previous => {
            let shape = [batch, heads, grown_capacity(needed), d];
            let larger = zeros_in(shape, rows.dtype().into(), &rows.device());
            match previous {
                Some(previous) => B::write_cache_rows(larger, 0, previous.narrow(2, 0, len)),
                None => larger,
            }
        }
    };
    B::write_cache_rows(cache, len, rows)
}

/// A model that can run a few tokens after what its cache holds.
pub trait CachedDecoding<B: Backend> {
    /// Clone keeps a state to continue later (`KeptStates`).
    type Cache: Clone;
    fn new_cache(&self, batch: usize, device: &B::Device) -> Self::Cache;
    /// Runs `ids [batch, seq]` after what `cache` holds and returns their final normalized hidden states
    /// `[batch, seq, hidden]`. `valid[row][t]` is false for padding (left padding for prompts of different
    /// lengths).
    fn hidden_cached(&self, ids: Tensor<B, 2, Int>, valid: &[Vec<bool>], cache: &mut Self::Cache) -> Tensor<B, 3>;
    /// The logits `[batch, seq, vocab]` of final hidden states. Decoding takes them at each row's last
    /// position only: a prompt's other positions would cost `seq × hidden × vocab` multiply-adds for nothing
    /// (a fifth of an LFM2-350M prefill).
    fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3>;
    /// `logits(hidden_cached(…))`: every position's logits.
    fn forward_cached(&self, ids: Tensor<B, 2, Int>, valid: &[Vec<bool>], cache: &mut Self::Cache) -> Tensor<B, 3> {
        let hidden = self.hidden_cached(ids, valid, cache);
        self.logits(hidden)
    }
}

// ---- LFM2 ----------------------------------------------------------------------------------------

#[derive(Clone)]
enum Lfm2LayerCache<B: Backend> {
    /// Last `L-1` gated conv inputs `[batch, L-1, hidden]` (zeros before a sequence starts).
    Conv(Tensor<B, 3>),
    Attention(KvCache<B>),
}

/// The decoding state of a batch of sequences on an LFM2 model.
#[derive(Clone)]
pub struct DecodeCache<B: Backend> {
    layers: Vec<Lfm2LayerCache<B>>,
    history: History,
}

impl<B: Backend> DecodeCache<B> {
    pub fn lengths(&self) -> &[usize] {
        &self.history.lengths
    }
}

impl<B: ModelBackend> ShortConv<B> {
    fn forward_cached(&self, x: Tensor<B, 3>, valid: &Tensor<B, 3>, state: &mut Tensor<B, 3>) -> Tensor<B, 3> {
        let parts = self.in_proj.project(x).chunk(3, 2);
        let (b, c, xx) = (parts[0].clone(), parts[1].clone(), parts[2].clone());
        let (mut y, next) = causal_depthwise_conv_cached(b * xx * valid.clone(), self.conv.val(), state.clone());
        *state = next;
        if let Some(bias) = &self.conv_bias {
            let hidden = y.dims()[2];
            y = y + bias.val().reshape([1, 1, hidden]);
        }
        self.out_proj.project(c * y)
    }
}

impl<B: ModelBackend> Attention<B> {
    fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeTables<B>,
        attention: &StepAttention<B>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let (q, k, v) = self.qkv(x, rope);
        let (k, v) = cache.append(k, v);
        self.out_proj.project(merge_heads(attention.attend(q, k, v)))
    }
}

impl<B: ModelBackend> CachedDecoding<B> for Lfm2Model<B> {
    type Cache = DecodeCache<B>;

    fn new_cache(&self, batch: usize, device: &B::Device) -> DecodeCache<B> {
        let hidden = self.embed_tokens.dims()[1];
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Conv(c) => Lfm2LayerCache::Conv(zeros_in(
                    [batch, c.conv.dims()[1] - 1, hidden],
                    c.conv.val().dtype().into(),
                    device,
                )),
                Mixer::Attention(_) => Lfm2LayerCache::Attention(KvCache::new()),
            })
            .collect();
        DecodeCache { layers, history: History::new(batch) }
    }

    fn hidden_cached(&self, ids: Tensor<B, 2, Int>, valid: &[Vec<bool>], cache: &mut DecodeCache<B>) -> Tensor<B, 3> {
        let device = ids.device();
        let [batch, seq] = ids.dims();
        let hidden = self.embed_tokens.dims()[1];
        let dtype = FloatDType::from(self.embed_tokens.val().dtype());
        let step = cache.history.step::<B>(valid, None, dtype, &device);
        let rope = RopeTables::<B>::new(&step.layout, self.head_dim, self.head_dim, self.rope_theta, dtype, &device);
        let mut h = self.embed_tokens.val().select(0, ids.reshape([batch * seq])).reshape([batch, seq, hidden]);
        for (layer, state) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let x = layer.operator_norm.forward(h.clone());
            let y = match (&layer.mixer, state) {
                (Mixer::Conv(conv), Lfm2LayerCache::Conv(s)) => conv.forward_cached(x, &step.valid, s),
                (Mixer::Attention(attn), Lfm2LayerCache::Attention(kv)) => {
                    attn.forward_cached(x, &rope, &step.attention, kv)
                }
                _ => unreachable!("the cache is built from this model's layers"),
            };
            h = h + y;
            let x = layer.ffn_norm.forward(h.clone());
            h = h + match &layer.feed_forward {
                FeedForward::Dense(mlp) => mlp.forward(x),
                FeedForward::Moe(moe) => moe.forward(x),
            };
        }
        cache.history.push(valid);
        self.embedding_norm.forward(h)
    }

    fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        head_logits(hidden, self.head_weight())
    }
}

// ---- Qwen3.5 -------------------------------------------------------------------------------------

#[derive(Clone)]
enum QwenLayerCache<B: Backend> {
    /// The last `L-1` conv inputs `[batch, L-1, conv_dim]` and the delta-rule state `[batch, heads, dk, dv]`.
    DeltaNet {
        conv: Tensor<B, 3>,
        state: Option<Tensor<B, 4>>,
    },
    Attention(KvCache<B>),
}

/// The decoding state of a batch of sequences on a Qwen3.5 model.
#[derive(Clone)]
pub struct QwenDecodeCache<B: Backend> {
    layers: Vec<QwenLayerCache<B>>,
    history: History,
}

/// Real tokens continue the cached state (document 0); each padding token is a document of its own.
fn decoding_segments(valid: &[Vec<bool>]) -> DocSegments {
    let (batch, seq) = (valid.len(), valid.first().map_or(0, Vec::len));
    let mut doc_ids = Vec::with_capacity(batch * seq);
    for row in valid {
        let mut pad_doc = 0;
        doc_ids.extend(row.iter().map(|&ok| {
            if ok {
                0
            } else {
                pad_doc += 1;
                pad_doc
            }
        }));
    }
    DocSegments { batch, seq, doc_ids, initial_doc: vec![0; batch] }
}

impl<B: ModelBackend> GatedDeltaNet<B> {
    fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        segments: &DocSegments,
        plan: Option<&ChunkPlan<B>>,
        conv: &mut Tensor<B, 3>,
        state: &mut Option<Tensor<B, 4>>,
    ) -> Tensor<B, 3> {
        let dtype = burn::tensor::FloatDType::from(x.dtype());
        let (y, next) =
            causal_depthwise_conv_cached(self.in_proj_qkv.project(x.clone()), self.conv1d.val(), conv.clone());
        *conv = next;
        let inputs = self.scan_inputs(x, silu(y));
        let (core, last) = match plan {
            Some(plan) => {
                let scan = B::delta_rule_scan(inputs.scan, plan, state.take());
                (scan.out, scan.last)
            }
            None => deltanet::recurrent(inputs.scan, segments, state.take()),
        };
        *state = Some(last);
        self.output(core, inputs.z, dtype)
    }
}

impl<B: ModelBackend> GatedAttention<B> {
    fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeTables<B>,
        attention: &StepAttention<B>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let (q, k, v, gate) = self.qkv_gate(x, rope);
        let (k, v) = cache.append(k, v);
        self.gated_output(attention.attend(q, k, v), gate)
    }
}

impl<B: ModelBackend> CachedDecoding<B> for Qwen35Model<B> {
    type Cache = QwenDecodeCache<B>;

    fn new_cache(&self, batch: usize, device: &B::Device) -> QwenDecodeCache<B> {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Qwen35Mixer::Linear(d) => {
                    let [channels, taps] = d.conv1d.dims();
                    QwenLayerCache::DeltaNet {
                        conv: zeros_in([batch, taps - 1, channels], d.conv1d.val().dtype().into(), device),
                        state: None,
                    }
                }
                Qwen35Mixer::Full(_) => QwenLayerCache::Attention(KvCache::new()),
            })
            .collect();
        QwenDecodeCache { layers, history: History::new(batch) }
    }

    fn hidden_cached(
        &self,
        ids: Tensor<B, 2, Int>,
        valid: &[Vec<bool>],
        cache: &mut QwenDecodeCache<B>,
    ) -> Tensor<B, 3> {
        let device = ids.device();
        let dtype = FloatDType::from(self.head_weight().dtype());
        let step = cache.history.step::<B>(valid, None, dtype, &device);
        let rope = self.rope_tables(&step.layout, dtype, &device);
        let segments = decoding_segments(valid);
        // Prefill runs the whole-sequence scan (`ModelBackend::delta_rule_scan`), single tokens the recurrent one.
        let plan = (segments.seq > 1).then(|| ChunkPlan::new(&segments, SCAN_CHUNK, &device));
        let mut h = self.embed(ids);
        for (layer, state) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let x = layer.input_layernorm.forward(h.clone());
            let y = match (&layer.mixer, state) {
                // Padding enters the DeltaNet as zeros, as transformers masks it.
                (Qwen35Mixer::Linear(net), QwenLayerCache::DeltaNet { conv, state }) => {
                    net.forward_cached(x * step.valid.clone(), &segments, plan.as_ref(), conv, state)
                }
                (Qwen35Mixer::Full(attn), QwenLayerCache::Attention(kv)) => {
                    attn.forward_cached(x, &rope, &step.attention, kv)
                }
                _ => unreachable!("the cache is built from this model's layers"),
            };
            h = h + y;
            h = h.clone() + layer.mlp.forward(layer.post_attention_layernorm.forward(h));
        }
        cache.history.push(valid);
        self.norm.forward(h)
    }

    fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        head_logits(hidden, self.head_weight())
    }
}

// ---- Gemma 4 --------------------------------------------------------------------------------------

/// The decoding state of a batch of sequences on a Gemma 4 model: a KV cache per layer that computes its
/// keys and values (KV-sharing layers read their source's).
#[derive(Clone)]
pub struct Gemma4DecodeCache<B: Backend> {
    layers: Vec<Option<KvCache<B>>>,
    history: History,
}

impl<B: ModelBackend> CachedDecoding<B> for Gemma4Model<B> {
    type Cache = Gemma4DecodeCache<B>;

    fn new_cache(&self, batch: usize, _device: &B::Device) -> Gemma4DecodeCache<B> {
        let layers = self.layers.iter().map(|l| l.self_attn.kv_source.is_none().then(KvCache::new)).collect();
        Gemma4DecodeCache { layers, history: History::new(batch) }
    }

    fn hidden_cached(
        &self,
        ids: Tensor<B, 2, Int>,
        valid: &[Vec<bool>],
        cache: &mut Gemma4DecodeCache<B>,
    ) -> Tensor<B, 3> {
        let device = ids.device();
        let dtype = FloatDType::from(self.head_weight().dtype());
        // Scores are not scaled: the q and k norms set their size.
        let step = cache.history.step::<B>(valid, Some(1.0), dtype, &device);
        let sliding =
            cache.history.attention::<B>(valid, &step.layout, Some(self.sliding_window), Some(1.0), dtype, &device);
        let ropes = self.rope_set(&step.layout, dtype, &device);
        let (mut h, per_layer) = self.embed(ids);
        for (i, layer) in self.layers.iter().enumerate() {
            let attn = &layer.self_attn;
            let rope = ropes.get(attn);
            let attention = if attn.sliding { &sliding } else { &step.attention };
            let layers = &mut cache.layers;
            let attend = |x: Tensor<B, 3>| {
                let q = attn.queries(x.clone(), rope);
                let (k, v) = match (attn.kv_source, &mut layers[i]) {
                    (None, Some(kv)) => {
                        let (k, v) = attn.keys_values(x, rope);
                        kv.append(k, v)
                    }
                    (Some(j), _) => layers[j].as_ref().and_then(KvCache::filled).expect("a KV source runs first"),
                    (None, None) => unreachable!("the cache is built from this model's layers"),
                };
                attn.output(attention.attend(q, k, v))
            };
            h = layer.forward(h, attend, Self::per_layer_input(&per_layer, i));
        }
        cache.history.push(valid);
        self.norm.forward(h)
    }

    fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        soft_cap(head_logits(hidden, self.head_weight()), self.final_logit_softcapping)
    }
}

/// Greedy decoding of a batch of prompts: each row stops at any of `stop` ids or after `max_tokens`.
/// Returns the generated ids per prompt (stop token included when reached).
pub fn generate_greedy<B: Backend, M: CachedDecoding<B>>(
    model: &M,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    stop: &[u32],
    device: &B::Device,
) -> Vec<Vec<u32>> {
    generate(model, prompts, max_tokens, stop, &mut TokenPicker::greedy(), |_, _| true, device)
}

/// Decoding of a batch of prompts with `picker`'s settings (`sampling`): each row stops at any of `stop` ids
/// or after `max_tokens`, and `on_token(row, id)` hears every token as it is chosen (to stream it) and
/// answers whether to go on (false ends every row there: a user's interrupt). Returns the generated ids per
/// prompt (stop token included when reached). Plain greedy decoding takes the argmax on the device; anything
/// else reads each step's last logits back and processes them on the host.
pub fn generate<B: Backend, M: CachedDecoding<B>>(
    model: &M,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    stop: &[u32],
    picker: &mut TokenPicker,
    on_token: impl FnMut(usize, u32) -> bool,
    device: &B::Device,
) -> Vec<Vec<u32>> {
    let batch = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(batch * longest);
    let mut valid = vec![Vec::with_capacity(longest); batch];
    for (row, p) in prompts.iter().enumerate() {
        let padding = longest - p.len();
        ids.extend(std::iter::repeat_n(PAD, padding));
        ids.extend(p.iter().map(|&t| t as i64));
        valid[row].extend(std::iter::repeat_n(false, padding));
        valid[row].extend(std::iter::repeat_n(true, p.len()));
    }
    let mut cache = model.new_cache(batch, device);
    let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, longest]), device);
    let run = Run { max_tokens, stop, device };
    run.decode(model, &mut cache, input, valid, prompts.to_vec(), picker, on_token, |_| {})
}

/// The id fed for padding and for rows that have finished (nothing attends to it).
const PAD: i64 = 0;

/// How far a decoding goes and where it runs.
struct Run<'a, B: Backend> {
    max_tokens: usize,
    stop: &'a [u32],
    device: &'a B::Device,
}

impl<B: Backend> Run<'_, B> {
    /// Decodes from `cache`, which holds what came before `input [batch, seq]` (`valid` marks its real ids),
    /// and `seen`, per row every id so far (the repetition penalty reads them). `prefilled` sees the cache
    /// once `input` has run, before any generated token has. Every generated token but the last is run
    /// into the cache (the last is only chosen).
    #[allow(clippy::too_many_arguments)]
    fn decode<M: CachedDecoding<B>>(
        &self,
        model: &M,
        cache: &mut M::Cache,
        mut input: Tensor<B, 2, Int>,
        mut valid: Vec<Vec<bool>>,
        mut seen: Vec<Vec<u32>>,
        picker: &mut TokenPicker,
        mut on_token: impl FnMut(usize, u32) -> bool,
        mut prefilled: impl FnMut(&M::Cache),
    ) -> Vec<Vec<u32>> {
        let batch = valid.len();
        let mut out = vec![Vec::new(); batch];
        let mut done = vec![false; batch];
        for step in 0..self.max_tokens {
            let hidden = model.hidden_cached(input, &valid, cache);
            if step == 0 {
                prefilled(cache);
            }
            let s = hidden.dims()[1];
            let logits = model.logits(hidden.narrow(1, s - 1, 1));
            let vocab = logits.dims()[2];
            let last = logits.reshape([batch, vocab]);
            let next: Vec<u32> = if picker.settings.is_plain_greedy() {
                let ids: Vec<i64> = last.argmax(1).into_data().convert::<i64>().to_vec().unwrap_or_default();
                ids.into_iter().map(|t| t as u32).collect()
            } else {
                let mut scores: Vec<f32> = last.into_data().convert::<f32>().to_vec().unwrap_or_default();
                let rows = scores.chunks_mut(vocab).zip(&seen);
                // Finished rows draw nothing, so a row's tokens do not depend on when the others stop.
                rows.zip(&done)
                    .map(|((row, seen), &finished)| if finished { 0 } else { picker.pick(row, seen) })
                    .collect()
            };
            let mut go_on = true;
            for row in 0..batch {
                if !done[row] {
                    let t = next[row];
                    out[row].push(t);
                    seen[row].push(t);
                    go_on &= on_token(row, t);
                    done[row] = self.stop.contains(&t);
                }
            }
            if !go_on || done.iter().all(|&d| d) || step + 1 == self.max_tokens {
                break;
            }
            // Finished rows keep decoding a padding token that nothing attends to.
            let tokens: Vec<i64> = (0..batch).map(|r| if done[r] { PAD } else { next[r] as i64 }).collect();
            valid = (0..batch).map(|r| vec![!done[r]]).collect();
            input = Tensor::from_data(TensorData::new(tokens, [batch, 1]), self.device);
        }
        out
    }
}

/// The decoding states a conversation keeps between its turns, each beside the ids it has run. The next
/// turn's prompt repeats the conversation so far, so it continues the longest state it opens with and runs
/// only the rest (`generate_continuing`). Kept states share their buffers with the live cache until it
/// writes, so keeping one costs at most a copy of its attention caches.
pub struct KeptStates<C> {
    states: Vec<(Vec<u32>, C)>,
}

impl<C> Default for KeptStates<C> {
    fn default() -> Self {
        KeptStates { states: Vec::new() }
    }
}

impl<C> KeptStates<C> {
    /// Forgets every state (a new conversation).
    pub fn clear(&mut self) {
        self.states.clear();
    }

    /// The ids of each kept state, shortest first.
    pub fn kept_ids(&self) -> Vec<&[u32]> {
        let mut ids: Vec<&[u32]> = self.states.iter().map(|(ids, _)| ids.as_slice()).collect();
        ids.sort_by_key(|ids| ids.len());
        ids
    }

    /// The longest state whose ids open `prompt` and leave at least one id of it to run (the logits of the
    /// next token come from running one); the others are dropped, as the turn makes new ones.
    fn take_longest(&mut self, prompt: &[u32]) -> Option<(Vec<u32>, C)> {
        let fits = |ids: &Vec<u32>| ids.len() < prompt.len() && prompt.starts_with(ids);
        let longest =
            (0..self.states.len()).filter(|&i| fits(&self.states[i].0)).max_by_key(|&i| self.states[i].0.len());
        let taken = longest.map(|i| self.states.swap_remove(i));
        self.states.clear();
        taken
    }
}

/// A reply decoded after a conversation's kept state.
#[derive(Debug, Clone, PartialEq)]
pub struct Continued {
    /// The generated ids (stop token included when reached).
    pub ids: Vec<u32>,
    /// How many ids of the prompt came from a kept state rather than being run.
    pub reused: usize,
}

/// One prompt decoded as `generate` would (the same tokens, up to float rounding of the logits), continuing
/// the longest of `kept`'s states that the prompt opens with. Afterwards `kept` holds the state at each of
/// `marks` (prompt lengths, e.g. where the conversation before the generation prompt ends), after the whole
/// prompt, and after the reply: a next turn that re-renders this reply differently (thinking dropped) still
/// continues from the prompt or from a mark.
#[allow(clippy::too_many_arguments)]
pub fn generate_continuing<B: Backend, M: CachedDecoding<B>>(
    model: &M,
    kept: &mut KeptStates<M::Cache>,
    prompt: &[u32],
    marks: &[usize],
    max_tokens: usize,
    stop: &[u32],
    picker: &mut TokenPicker,
    mut on_token: impl FnMut(u32) -> bool,
    device: &B::Device,
) -> Continued {
    assert!(!prompt.is_empty(), "a prompt of at least one id");
    let (reused, mut cache) = match kept.take_longest(prompt) {
        Some((ids, cache)) => (ids.len(), cache),
        None => (0, model.new_cache(1, device)),
    };
    let run_ids = |ids: &[u32]| {
        let data: Vec<i64> = ids.iter().map(|&t| i64::from(t)).collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(data, [1, ids.len()]), device)
    };
    // The prompt's new part runs in pieces that end at the marks, each state kept.
    let mut at = reused;
    let mut ends: Vec<usize> = marks.iter().copied().filter(|&m| m > reused && m < prompt.len()).collect();
    ends.sort_unstable();
    ends.dedup();
    if max_tokens > 0 {
        for end in ends {
            model.hidden_cached(run_ids(&prompt[at..end]), &[vec![true; end - at]], &mut cache);
            kept.states.push((prompt[..end].to_vec(), cache.clone()));
            at = end;
        }
    }
    let rest = &prompt[at..];
    let run = Run { max_tokens, stop, device };
    let mut after_prompt = None;
    let ids = run
        .decode(
            model,
            &mut cache,
            run_ids(rest),
            vec![vec![true; rest.len()]],
            vec![prompt.to_vec()],
            picker,
            |_, t| on_token(t),
            |cache| after_prompt = Some(cache.clone()),
        )
        .into_iter()
        .next()
        .unwrap_or_default();
    match ids.split_last() {
        Some((_, ran)) => {
            // With one token generated, the cache is the state after the prompt.
            if let Some(state) = after_prompt.filter(|_| !ran.is_empty()) {
                kept.states.push((prompt.to_vec(), state));
            }
            kept.states.push(([prompt, ran].concat(), cache));
        }
        // Nothing was decoded (`max_tokens` 0): the cache holds what it continued.
        None => kept.states.push((prompt[..at].to_vec(), cache)),
    }
    Continued { ids, reused }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Cpu, CpuTrain};
    use crate::testing::{normal, values};

    /// Appends of 5, 1, 1, 70, 1 and 130 positions (three of them past the capacity the one before left) read
    /// back as everything appended so far, concatenated.
    fn appends_read_back_as_the_concatenation<B: ModelBackend>() {
        let device = Default::default();
        let mut cache = KvCache::<B>::new();
        let (mut keys, mut values_so_far) = (Vec::new(), Vec::new());
        let mut capacities = Vec::new();
        for (i, n) in [5, 1, 1, 70, 1, 130].into_iter().enumerate() {
            let k = normal::<B, 4>([2, 3, n, 4], 0.0, 1.0, i as u64, &device);
            let v = normal::<B, 4>([2, 3, n, 4], 0.0, 1.0, 100 + i as u64, &device);
            keys.push(k.clone());
            values_so_far.push(v.clone());
            let (all_k, all_v) = cache.append(k, v);
            assert_eq!(values(all_k), values(Tensor::cat(keys.clone(), 2)), "keys after append {i}");
            assert_eq!(values(all_v), values(Tensor::cat(values_so_far.clone(), 2)), "values after append {i}");
            capacities.push(cache.keys.as_ref().map(|k| k.dims()[2]));
        }
        assert_eq!(cache.len, 208);
        assert_eq!(capacities, [69, 69, 69, 141, 141, 312].map(Some));
    }

    #[test]
    fn the_cpu_kv_cache_reads_back_what_was_appended() {
        appends_read_back_as_the_concatenation::<Cpu>();
    }

    /// The autodiff backend keeps the trait's default, burn's `slice_assign` (what the CubeCL backends run).
    #[test]
    fn the_slice_assign_kv_cache_reads_back_what_was_appended() {
        appends_read_back_as_the_concatenation::<CpuTrain>();
    }
}
