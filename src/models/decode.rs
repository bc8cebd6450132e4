//! Cached decoding for LFM2: a KV cache for attention layers and the last `L-1` conv inputs for conv layers,
//! batched prompts of different lengths (left-padded; padding is masked out and never enters a state), and
//! greedy generation. Incremental logits equal the full forward's.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::layers::{SequenceLayout, rope_tables};
use super::lfm2::{Attention, FeedForward, Lfm2Model, Mixer, ShortConv};

enum LayerCache<B: Backend> {
    /// Last `L-1` gated conv inputs `[batch, L-1, hidden]` (zeros before a sequence starts).
    Conv(Tensor<B, 3>),
    /// Keys and values `[batch, kv_heads, cached, head_dim]` after RoPE.
    Attention { k: Option<Tensor<B, 4>>, v: Option<Tensor<B, 4>> },
}

/// The decoding state of a batch of sequences.
pub struct DecodeCache<B: Backend> {
    layers: Vec<LayerCache<B>>,
    /// Per row, per cached position: a real token (padding is not).
    valid: Vec<Vec<bool>>,
    /// Per row: real tokens so far (the next token's RoPE position).
    lengths: Vec<usize>,
}

impl<B: Backend> DecodeCache<B> {
    pub fn new(model: &Lfm2Model<B>, batch: usize, device: &B::Device) -> Self {
        let hidden = model.embed_tokens.dims()[1];
        let layers = model
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Conv(c) => LayerCache::Conv(Tensor::zeros([batch, c.conv.dims()[1] - 1, hidden], device)),
                Mixer::Attention(_) => LayerCache::Attention { k: None, v: None },
            })
            .collect();
        DecodeCache { layers, valid: vec![Vec::new(); batch], lengths: vec![0; batch] }
    }

    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }
}

impl<B: Backend> ShortConv<B> {
    fn forward_cached(&self, x: Tensor<B, 3>, valid: &Tensor<B, 3>, state: &mut Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let parts = self.in_proj.forward(x).chunk(3, 2);
        let (b, c, xx) = (parts[0].clone(), parts[1].clone(), parts[2].clone());
        let bx = b * xx * valid.clone();
        let hidden = bx.dims()[2];
        let kernel = self.conv.val();
        let taps = kernel.dims()[1];
        let full = Tensor::cat(vec![state.clone(), bx], 1); // [B, L-1+S, H]
        let mut y = Tensor::<B, 3>::zeros([batch, seq, hidden], &full.device());
        for j in 0..taps {
            y = y + full.clone().narrow(1, j, seq) * kernel.clone().narrow(1, j, 1).reshape([1, 1, hidden]);
        }
        if let Some(bias) = &self.conv_bias {
            y = y + bias.val().reshape([1, 1, hidden]);
        }
        *state = full.clone().narrow(1, seq, taps - 1);
        self.out_proj.forward(c * y)
    }
}

impl<B: Backend> Attention<B> {
    fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        tables: (&Tensor<B, 4>, &Tensor<B, 4>),
        mask: &Tensor<B, 4>,
        cache_k: &mut Option<Tensor<B, 4>>,
        cache_v: &mut Option<Tensor<B, 4>>,
    ) -> Tensor<B, 3> {
        let (q, k, v) = self.qkv(x, tables.0, tables.1);
        let append = |cache: &mut Option<Tensor<B, 4>>, new: Tensor<B, 4>| {
            let all = match cache.take() {
                Some(prev) => Tensor::cat(vec![prev, new], 2),
                None => new,
            };
            *cache = Some(all.clone());
            all
        };
        let (k, v) = (append(cache_k, k), append(cache_v, v));
        self.attend(q, k, v, mask)
    }
}

impl<B: Backend> Lfm2Model<B> {
    /// Runs `ids [batch, seq]` after what `cache` holds and returns their logits `[batch, seq, vocab]`.
    /// `valid[row][t]` is false for padding (left padding for prompts of different lengths).
    pub fn forward_cached(
        &self,
        ids: Tensor<B, 2, Int>,
        valid: &[Vec<bool>],
        cache: &mut DecodeCache<B>,
    ) -> Tensor<B, 3> {
        let device = ids.device();
        let [batch, seq] = ids.dims();
        let hidden = self.embed_tokens.dims()[1];
        // Positions continue each row's real-token count; padding takes position 0.
        let mut positions = Vec::with_capacity(batch * seq);
        for (row_valid, &done) in valid.iter().zip(&cache.lengths) {
            let mut n = done;
            for &ok in row_valid {
                positions.push(if ok { n as u32 } else { 0 });
                n += usize::from(ok);
            }
        }
        let layout = SequenceLayout { batch, seq, doc_ids: vec![0; batch * seq], positions };
        let (cos, sin) = rope_tables::<B>(&layout, self.head_dim, self.rope_theta, &device);
        let valid_f: Vec<f32> = valid.iter().flatten().map(|&v| if v { 1.0 } else { 0.0 }).collect();
        let valid_t = Tensor::<B, 3>::from_data(TensorData::new(valid_f, [batch, seq, 1]), &device);
        // New token i of a row sees earlier real tokens and itself.
        let past = cache.valid[0].len();
        let total = past + seq;
        let mut mask = vec![f32::NEG_INFINITY; batch * seq * total];
        for row in 0..batch {
            let seen: Vec<bool> = cache.valid[row].iter().chain(&valid[row]).copied().collect();
            for i in 0..seq {
                for j in 0..=past + i {
                    if seen[j] || j == past + i {
                        mask[(row * seq + i) * total + j] = 0.0;
                    }
                }
            }
        }
        let mask = Tensor::<B, 4>::from_data(TensorData::new(mask, [batch, 1, seq, total]), &device);
        let mut h = self.embed_tokens.val().select(0, ids.reshape([batch * seq])).reshape([batch, seq, hidden]);
        for (layer, state) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let x = layer.operator_norm.forward(h.clone());
            let y = match (&layer.mixer, state) {
                (Mixer::Conv(conv), LayerCache::Conv(s)) => conv.forward_cached(x, &valid_t, s),
                (Mixer::Attention(attn), LayerCache::Attention { k, v }) => {
                    attn.forward_cached(x, (&cos, &sin), &mask, k, v)
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
        for ((seen, length), row_valid) in cache.valid.iter_mut().zip(cache.lengths.iter_mut()).zip(valid) {
            seen.extend_from_slice(row_valid);
            *length += row_valid.iter().filter(|&&v| v).count();
        }
        let h = self.embedding_norm.forward(h);
        let head = match &self.lm_head {
            Some(w) => w.val(),
            None => self.embed_tokens.val(),
        };
        h.matmul(head.transpose().unsqueeze::<3>())
    }

    /// Greedy decoding of a batch of prompts: each row stops at any of `stop` ids or after `max_tokens`.
    /// Returns the generated ids per prompt (stop token included when reached).
    pub fn generate_greedy(
        &self,
        prompts: &[Vec<u32>],
        max_tokens: usize,
        stop: &[u32],
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
        let mut cache = DecodeCache::new(self, batch, device);
        let mut out = vec![Vec::new(); batch];
        let mut done = vec![false; batch];
        let mut input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, longest]), device);
        let mut step_valid = valid;
        for _ in 0..max_tokens {
            let logits = self.forward_cached(input, &step_valid, &mut cache);
            let [_, s, vocab] = logits.dims();
            let last = logits.narrow(1, s - 1, 1).reshape([batch, vocab]);
            let next: Vec<i64> = last.argmax(1).into_data().convert::<i64>().to_vec().unwrap_or_default();
            for row in 0..batch {
                if !done[row] {
                    let t = next[row] as u32;
                    out[row].push(t);
                    done[row] = stop.contains(&t);
                }
            }
            if done.iter().all(|&d| d) {
                break;
            }
            // Finished rows keep decoding a padding token that nothing attends to.
            let tokens: Vec<i64> = (0..batch).map(|r| if done[r] { pad } else { next[r] }).collect();
            step_valid = (0..batch).map(|r| vec![!done[r]]).collect();
            input = Tensor::from_data(TensorData::new(tokens, [batch, 1]), device);
        }
        out
    }
}
