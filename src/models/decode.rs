//! Cached decoding: per layer a KV cache (attention; Gemma 4's KV-sharing layers read their source's), the
//! last `L-1` conv inputs (LFM2 conv, DeltaNet conv) and the `[dk × dv]` state per head (DeltaNet); batched
//! prompts of different lengths (left-padded; padding is masked out and never enters an attention cache)
//! and generation, greedy or sampled (`sampling`). Incremental logits equal the full forward's.

use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};

use super::deltanet::{self, ChunkPlan, DocSegments};
use super::gemma4::Gemma4Model;
use super::layers::{RopeTables, SequenceLayout, causal_depthwise_conv_cached, head_logits, soft_cap};
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

/// The positions, attention mask and padding mask of one decoding call.
struct Step<B: Backend> {
    layout: SequenceLayout,
    /// `[batch, 1, seq, cached + seq]`: a new token sees earlier real tokens and itself.
    mask: Tensor<B, 4>,
    /// `[batch, seq, 1]`: 1 for real tokens.
    valid: Tensor<B, 3>,
}

impl History {
    fn new(batch: usize) -> Self {
        History { valid: vec![Vec::new(); batch], lengths: vec![0; batch] }
    }

    /// The layout, mask and validity of the next tokens, in `dtype` (the model's).
    fn step<B: Backend>(&self, valid: &[Vec<bool>], dtype: FloatDType, device: &B::Device) -> Step<B> {
        let batch = valid.len();
        let seq = valid.first().map_or(0, Vec::len);
        // Positions continue each row's real-token count; padding takes position 0.
        let mut positions = Vec::with_capacity(batch * seq);
        for (row_valid, &done) in valid.iter().zip(&self.lengths) {
            let mut n = done;
            for &ok in row_valid {
                positions.push(if ok { n as u32 } else { 0 });
                n += usize::from(ok);
            }
        }
        let layout = SequenceLayout { batch, seq, doc_ids: vec![0; batch * seq], positions };
        let valid_f: Vec<f32> = valid.iter().flatten().map(|&v| if v { 1.0 } else { 0.0 }).collect();
        Step {
            layout,
            mask: self.mask(valid, None, dtype, device),
            valid: host_tensor(valid_f, [batch, seq, 1], dtype, device),
        }
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
    type Cache;
    fn new_cache(&self, batch: usize, device: &B::Device) -> Self::Cache;
    /// Runs `ids [batch, seq]` after what `cache` holds and returns their logits `[batch, seq, vocab]`.
    /// `valid[row][t]` is false for padding (left padding for prompts of different lengths).
    fn forward_cached(&self, ids: Tensor<B, 2, Int>, valid: &[Vec<bool>], cache: &mut Self::Cache) -> Tensor<B, 3>;
}

// ---- LFM2 ----------------------------------------------------------------------------------------

enum Lfm2LayerCache<B: Backend> {
    /// Last `L-1` gated conv inputs `[batch, L-1, hidden]` (zeros before a sequence starts).
    Conv(Tensor<B, 3>),
    Attention(KvCache<B>),
}

/// The decoding state of a batch of sequences on an LFM2 model.
pub struct DecodeCache<B: Backend> {
    layers: Vec<Lfm2LayerCache<B>>,
    history: History,
}

impl<B: Backend> DecodeCache<B> {
    pub fn lengths(&self) -> &[usize] {
        &self.history.lengths
    }
}

impl<B: Backend> ShortConv<B> {
    fn forward_cached(&self, x: Tensor<B, 3>, valid: &Tensor<B, 3>, state: &mut Tensor<B, 3>) -> Tensor<B, 3> {
        let parts = self.in_proj.forward(x).chunk(3, 2);
        let (b, c, xx) = (parts[0].clone(), parts[1].clone(), parts[2].clone());
        let (mut y, next) = causal_depthwise_conv_cached(b * xx * valid.clone(), self.conv.val(), state.clone());
        *state = next;
        if let Some(bias) = &self.conv_bias {
            let hidden = y.dims()[2];
            y = y + bias.val().reshape([1, 1, hidden]);
        }
        self.out_proj.forward(c * y)
    }
}

impl<B: ModelBackend> Attention<B> {
    fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeTables<B>,
        mask: &Tensor<B, 4>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let (q, k, v) = self.qkv(x, rope);
        let (k, v) = cache.append(k, v);
        self.attend(q, k, v, mask)
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

    fn forward_cached(&self, ids: Tensor<B, 2, Int>, valid: &[Vec<bool>], cache: &mut DecodeCache<B>) -> Tensor<B, 3> {
        let device = ids.device();
        let [batch, seq] = ids.dims();
        let hidden = self.embed_tokens.dims()[1];
        let dtype = FloatDType::from(self.embed_tokens.val().dtype());
        let step = cache.history.step::<B>(valid, dtype, &device);
        let rope = RopeTables::<B>::new(&step.layout, self.head_dim, self.head_dim, self.rope_theta, dtype, &device);
        let mut h = self.embed_tokens.val().select(0, ids.reshape([batch * seq])).reshape([batch, seq, hidden]);
        for (layer, state) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let x = layer.operator_norm.forward(h.clone());
            let y = match (&layer.mixer, state) {
                (Mixer::Conv(conv), Lfm2LayerCache::Conv(s)) => conv.forward_cached(x, &step.valid, s),
                (Mixer::Attention(attn), Lfm2LayerCache::Attention(kv)) => {
                    attn.forward_cached(x, &rope, &step.mask, kv)
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
        head_logits(self.embedding_norm.forward(h), self.head_weight())
    }
}

// ---- Qwen3.5 -------------------------------------------------------------------------------------

enum QwenLayerCache<B: Backend> {
    /// The last `L-1` conv inputs `[batch, L-1, conv_dim]` and the delta-rule state `[batch, heads, dk, dv]`.
    DeltaNet {
        conv: Tensor<B, 3>,
        state: Option<Tensor<B, 4>>,
    },
    Attention(KvCache<B>),
}

/// The decoding state of a batch of sequences on a Qwen3.5 model.
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
            causal_depthwise_conv_cached(self.in_proj_qkv.forward(x.clone()), self.conv1d.val(), conv.clone());
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
        mask: &Tensor<B, 4>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let (q, k, v, gate) = self.qkv_gate(x, rope);
        let (k, v) = cache.append(k, v);
        self.attend(q, k, v, gate, mask)
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

    fn forward_cached(
        &self,
        ids: Tensor<B, 2, Int>,
        valid: &[Vec<bool>],
        cache: &mut QwenDecodeCache<B>,
    ) -> Tensor<B, 3> {
        let device = ids.device();
        let dtype = FloatDType::from(self.head_weight().dtype());
        let step = cache.history.step::<B>(valid, dtype, &device);
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
                    attn.forward_cached(x, &rope, &step.mask, kv)
                }
                _ => unreachable!("the cache is built from this model's layers"),
            };
            h = h + y;
            h = h.clone() + layer.mlp.forward(layer.post_attention_layernorm.forward(h));
        }
        cache.history.push(valid);
        head_logits(self.norm.forward(h), self.head_weight())
    }
}

// ---- Gemma 4 --------------------------------------------------------------------------------------

/// The decoding state of a batch of sequences on a Gemma 4 model: a KV cache per layer that computes its
/// keys and values (KV-sharing layers read their source's).
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

    fn forward_cached(
        &self,
        ids: Tensor<B, 2, Int>,
        valid: &[Vec<bool>],
        cache: &mut Gemma4DecodeCache<B>,
    ) -> Tensor<B, 3> {
        let device = ids.device();
        let dtype = FloatDType::from(self.head_weight().dtype());
        let step = cache.history.step::<B>(valid, dtype, &device);
        let sliding_mask = cache.history.mask::<B>(valid, Some(self.sliding_window), dtype, &device);
        let ropes = self.rope_set(&step.layout, dtype, &device);
        let (mut h, per_layer) = self.embed(ids);
        for (i, layer) in self.layers.iter().enumerate() {
            let attn = &layer.self_attn;
            let rope = ropes.get(attn);
            let mask = if attn.sliding { &sliding_mask } else { &step.mask };
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
                attn.output(B::masked_attention(q, k, v, mask, 1.0))
            };
            h = layer.forward(h, attend, Self::per_layer_input(&per_layer, i));
        }
        cache.history.push(valid);
        soft_cap(head_logits(self.norm.forward(h), self.head_weight()), self.final_logit_softcapping)
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
    mut on_token: impl FnMut(usize, u32) -> bool,
    device: &B::Device,
) -> Vec<Vec<u32>> {
    let batch = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let pad = 0i64;
    let mut ids = Vec::with_capacity(batch * longest);
    let mut valid = vec![Vec::with_capacity(longest); batch];
    for (row, p) in prompts.iter().enumerate() {
        let padding = longest - p.len();
        ids.extend(std::iter::repeat_n(pad, padding));
        ids.extend(p.iter().map(|&t| t as i64));
        valid[row].extend(std::iter::repeat_n(false, padding));
        valid[row].extend(std::iter::repeat_n(true, p.len()));
    }
    let mut cache = model.new_cache(batch, device);
    let mut out = vec![Vec::new(); batch];
    let mut done = vec![false; batch];
    let mut input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, longest]), device);
    let mut step_valid = valid;
    let mut history: Vec<Vec<u32>> = prompts.to_vec();
    for _ in 0..max_tokens {
        let logits = model.forward_cached(input, &step_valid, &mut cache);
        let [_, s, vocab] = logits.dims();
        let last = logits.narrow(1, s - 1, 1).reshape([batch, vocab]);
        let next: Vec<u32> = if picker.settings.is_plain_greedy() {
            let ids: Vec<i64> = last.argmax(1).into_data().convert::<i64>().to_vec().unwrap_or_default();
            ids.into_iter().map(|t| t as u32).collect()
        } else {
            let mut scores: Vec<f32> = last.into_data().convert::<f32>().to_vec().unwrap_or_default();
            let rows = scores.chunks_mut(vocab).zip(&history);
            // Finished rows draw nothing, so a row's tokens do not depend on when the others stop.
            rows.zip(&done).map(|((row, seen), &finished)| if finished { 0 } else { picker.pick(row, seen) }).collect()
        };
        let mut go_on = true;
        for row in 0..batch {
            if !done[row] {
                let t = next[row];
                out[row].push(t);
                history[row].push(t);
                go_on &= on_token(row, t);
                done[row] = stop.contains(&t);
            }
        }
        if !go_on || done.iter().all(|&d| d) {
            break;
        }
        // Finished rows keep decoding a padding token that nothing attends to.
        let tokens: Vec<i64> = (0..batch).map(|r| if done[r] { pad } else { next[r] as i64 }).collect();
        step_valid = (0..batch).map(|r| vec![!done[r]]).collect();
        input = Tensor::from_data(TensorData::new(tokens, [batch, 1]), device);
    }
    out
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
