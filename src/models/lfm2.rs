//! LiquidAI LFM2 / LFM2.5 (dense) and LFM2-MoE (LFM2.5-8B-A1B): per layer operator_norm → short causal
//! conv or GQA attention → residual → ffn_norm → SwiGLU or sparse MoE → residual; final `embedding_norm`;
//! tied head. Module and weight names mirror the checkpoint's (`model.layers.{i}.conv.in_proj`, …).

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::IndexingUpdateOp;
use burn::tensor::activation::sigmoid;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};

use super::attention::{DocumentAttention, merge_heads};
use super::config::{LayerKind, Lfm2Config};
use super::layers::{ConvShifts, Project, RmsNorm, RopeTables, SequenceLayout, SwiGlu, head_logits};
use super::ops::{GateActivation, ModelBackend};
use super::routing::{self, ExpertLoad};
use super::weights::{TensorSource, device_tensor, load_linear, load_param};
use crate::backend::zeros_in;

/// The gated short convolution: `in_proj` → B | C | x, `y = conv(B·x)` (depthwise, causal, kernel L),
/// `out_proj(C·y)`.
#[derive(Module, Debug)]
pub struct ShortConv<B: Backend> {
    pub in_proj: Linear<B>,
    /// Depthwise kernel `[hidden, L]` (the checkpoint's `[hidden, 1, L]` without the group axis).
    pub conv: Param<Tensor<B, 2>>,
    pub conv_bias: Option<Param<Tensor<B, 1>>>,
    pub out_proj: Linear<B>,
}

impl<B: ModelBackend> ShortConv<B> {
    pub fn forward(&self, x: Tensor<B, 3>, shifts: &ConvShifts<B>) -> Tensor<B, 3> {
        let bcx = self.in_proj.project(x);
        let Some(bias) = &self.conv_bias else {
            return self.out_proj.project(B::gated_conv(bcx, self.conv.val(), shifts));
        };
        // A conv bias (no released LFM2 has one) sits between the conv and the output gate.
        let hidden = self.out_proj.weight.dims()[0];
        let [b, c, xx] = B::split_last(bcx, [hidden; 3]);
        let y = B::causal_conv(b * xx, self.conv.val(), shifts);
        let y = y.clone() + B::broadcast_rows(bias.val(), y.dims());
        self.out_proj.project(c * y)
    }
}

/// Grouped-query attention with per-head RMSNorm on q and k before RoPE.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub out_proj: Linear<B>,
    pub q_layernorm: RmsNorm<B>,
    pub k_layernorm: RmsNorm<B>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl<B: ModelBackend> Attention<B> {
    /// Queries `[batch, heads, seq, head_dim]` and keys, values `[batch, kv_heads, seq, head_dim]`, with the
    /// per-head norms and RoPE applied.
    pub fn qkv(&self, x: Tensor<B, 3>, rope: &RopeTables<B>) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
        let [batch, seq, _] = x.dims();
        let hd = self.head_dim;
        let heads = |t: Tensor<B, 3>, norm: Option<&RmsNorm<B>>, n: usize| {
            let t = t.reshape([batch, seq, n, hd]);
            let t = match norm {
                Some(norm) => norm.forward(t),
                None => t,
            };
            t.swap_dims(1, 2)
        };
        let q = heads(self.q_proj.project(x.clone()), Some(&self.q_layernorm), self.num_heads);
        let k = heads(self.k_proj.project(x.clone()), Some(&self.k_layernorm), self.num_kv_heads);
        let v = heads(self.v_proj.project(x), None, self.num_kv_heads);
        (B::rope(q, rope), B::rope(k, rope), v)
    }

    /// Attention over the whole sequence, inside each document (the training and full-forward path).
    pub fn forward(&self, x: Tensor<B, 3>, rope: &RopeTables<B>, docs: &DocumentAttention<B>) -> Tensor<B, 3> {
        let (q, k, v) = self.qkv(x, rope);
        self.out_proj.project(merge_heads(B::document_attention(q, k, v, docs)))
    }
}

/// Sparse MoE: sigmoid router, top-k chosen on `p + expert_bias` (selection only), weights renormalized and
/// scaled; experts kept fused (`gate_up [E, H, 2F]`, `down [E, F, H]`) and run on their tokens only.
#[derive(Module, Debug)]
pub struct MoeBlock<B: Backend> {
    pub gate: Linear<B>,
    pub expert_bias: Option<Param<Tensor<B, 1>>>,
    pub gate_up: Param<Tensor<B, 3>>,
    pub down: Param<Tensor<B, 3>>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    /// The decoder layer's index, under which its routing load is counted (`routing::record`).
    pub layer: usize,
}

impl<B: ModelBackend> MoeBlock<B> {
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, hidden] = x.dims();
        let tokens = batch * seq;
        let x = x.reshape([tokens, hidden]);
        let probs = sigmoid(self.gate.project(x.clone()));
        let choice = match &self.expert_bias {
            // Selection in f32, as the fp32 `expert_bias` buffer promotes it in transformers.
            Some(bias) => probs.clone().cast(FloatDType::F32) + bias.val().cast(FloatDType::F32).unsqueeze::<2>(),
            None => probs.clone(),
        };
        let (_, selected) = choice.detach().topk_with_indices(self.top_k, 1);
        let mut weights = probs.gather(1, selected.clone());
        if self.norm_topk_prob {
            weights = weights.clone() / (weights.sum_dim(1) + 1e-6);
        }
        weights = weights * self.routed_scaling_factor;
        let flat_weights = weights.reshape([tokens * self.top_k]);
        let chosen: Vec<i64> = selected.into_data().convert::<i64>().to_vec().unwrap_or_default();
        let experts = self.gate_up.dims()[0];
        routing::record(self.layer, experts, &chosen, self.top_k);
        let ff = self.down.dims()[1];
        let device = x.device();
        // Group tokens by expert on the host (the rows of the grouped matmuls), then add every weighted expert
        // output to its token in a single scatter.
        let mut rows: Vec<Vec<i64>> = vec![Vec::new(); experts];
        let mut slots: Vec<Vec<i64>> = vec![Vec::new(); experts];
        for (slot, &e) in chosen.iter().enumerate() {
            rows[e as usize].push((slot / self.top_k) as i64);
            slots[e as usize].push(slot as i64);
        }
        let zeros = zeros_in::<B, 2>([tokens, hidden], x.dtype().into(), &device);
        let counts: Vec<usize> = rows.iter().map(Vec::len).collect();
        let n = chosen.len();
        if n == 0 {
            return zeros.reshape([batch, seq, hidden]);
        }
        let index = |ids: Vec<Vec<i64>>| Tensor::<B, 1, Int>::from_data(TensorData::new(ids.concat(), [n]), &device);
        let (token, slot) = (index(rows), index(slots));
        let h = B::grouped_matmul(x.select(0, token.clone()), self.gate_up.val(), &counts);
        let [gate, up] = B::split_last(h, [ff, ff]);
        let act = B::glu(gate, up, GateActivation::Silu);
        let weighted = B::grouped_matmul(act, self.down.val(), &counts) * flat_weights.select(0, slot).reshape([n, 1]);
        zeros.select_assign(0, token, weighted, IndexingUpdateOp::Add).reshape([batch, seq, hidden])
    }
}

impl<B: Backend> MoeBlock<B> {
    /// The block with its expert bias moved by `routing::bias_steps` of `counts`, the tokens a step gave its
    /// experts (a no-op without a bias).
    fn shift_expert_bias(mut self, counts: &[u64], rate: f64) -> Self {
        self.expert_bias = self.expert_bias.map(|bias| {
            bias.map(|b| {
                let steps = routing::bias_steps(counts, rate);
                let steps = Tensor::<B, 1>::from_data(TensorData::new(steps, [counts.len()]), &b.device());
                let dtype = FloatDType::from(b.dtype());
                (b.cast(FloatDType::F32) + steps).cast(dtype)
            })
        });
        self
    }
}

#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Mixer<B: Backend> {
    Conv(ShortConv<B>),
    Attention(Attention<B>),
}

#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum FeedForward<B: Backend> {
    Dense(SwiGlu<B>),
    Moe(MoeBlock<B>),
}

#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    pub operator_norm: RmsNorm<B>,
    pub mixer: Mixer<B>,
    pub ffn_norm: RmsNorm<B>,
    pub feed_forward: FeedForward<B>,
}

#[derive(Module, Debug)]
pub struct Lfm2Model<B: Backend> {
    pub embed_tokens: Param<Tensor<B, 2>>,
    pub layers: Vec<DecoderLayer<B>>,
    pub embedding_norm: RmsNorm<B>,
    /// `None` when the head is tied to `embed_tokens`.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    pub head_dim: usize,
    pub rope_theta: f64,
}

impl<B: Backend> Lfm2Model<B> {
    /// Each MoE layer's expert bias moved toward an even load by `rate` (`routing::bias_steps`), from the
    /// tokens `load` counts for that layer; a layer `load` does not count is left as it is.
    pub fn shift_expert_bias(mut self, load: &ExpertLoad, rate: f64) -> Self {
        self.layers = self
            .layers
            .into_iter()
            .map(|mut layer| {
                layer.feed_forward = match layer.feed_forward {
                    FeedForward::Moe(moe) => match load.0.get(&moe.layer) {
                        Some(counts) => FeedForward::Moe(moe.shift_expert_bias(counts, rate)),
                        None => FeedForward::Moe(moe),
                    },
                    dense => dense,
                };
                layer
            })
            .collect();
        self
    }

    /// The output projection `[vocab, hidden]` (the embedding when tied).
    pub fn head_weight(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(w) => w.val(),
            None => self.embed_tokens.val(),
        }
    }
}

impl<B: ModelBackend> Lfm2Model<B> {
    /// Logits `[batch, seq, vocab]` for `ids [batch, seq]` laid out as `layout` says.
    pub fn forward(&self, ids: Tensor<B, 2, Int>, layout: &SequenceLayout) -> Tensor<B, 3> {
        head_logits(self.forward_hidden(ids, layout), self.head_weight())
    }

    /// The final normalized hidden states `[batch, seq, hidden]`, before the output projection.
    pub fn forward_hidden(&self, ids: Tensor<B, 2, Int>, layout: &SequenceLayout) -> Tensor<B, 3> {
        let device = ids.device();
        let [batch, seq] = ids.dims();
        let hidden = self.embed_tokens.dims()[1];
        let mut h = self.embed_tokens.val().select(0, ids.reshape([batch * seq])).reshape([batch, seq, hidden]);
        // Everything the forward pass builds (RoPE tables, masks) follows the weights' dtype.
        let dtype = FloatDType::from(h.dtype());
        let needs_attention = self.layers.iter().any(|l| matches!(l.mixer, Mixer::Attention(_)));
        let (rope, docs) = if needs_attention {
            let rope = RopeTables::<B>::new(layout, self.head_dim, self.head_dim, self.rope_theta, dtype, &device);
            (Some(rope), Some(DocumentAttention::<B>::new(layout, &device)))
        } else {
            (None, None)
        };
        let max_lag = self
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Conv(c) => Some(c.conv.dims()[1] - 1),
                Mixer::Attention(_) => None,
            })
            .max()
            .unwrap_or(0);
        let shifts = ConvShifts::<B>::new(layout, max_lag, &device);
        for layer in &self.layers {
            let x = layer.operator_norm.forward(h.clone());
            let y = match &layer.mixer {
                Mixer::Conv(conv) => conv.forward(x, &shifts),
                Mixer::Attention(attn) => attn.forward(
                    x,
                    rope.as_ref().expect("tables built for attention"),
                    docs.as_ref().expect("documents built for attention"),
                ),
            };
            h = h + y;
            let x = layer.ffn_norm.forward(h.clone());
            let y = match &layer.feed_forward {
                FeedForward::Dense(mlp) => mlp.forward(x),
                FeedForward::Moe(moe) => moe.forward(x),
            };
            h = B::layer_output(h + y);
        }
        self.embedding_norm.forward(h)
    }
}

// ---- construction from a checkpoint ----------------------------------------------------------------

fn norm<B: Backend>(store: &dyn TensorSource, key: &str, dim: usize, eps: f64, device: &B::Device) -> RmsNorm<B> {
    RmsNorm { weight: load_param(store, &format!("{key}.weight"), [dim], device), eps }
}

fn swiglu<B: Backend>(store: &dyn TensorSource, key: &str, hidden: usize, ff: usize, device: &B::Device) -> SwiGlu<B> {
    SwiGlu {
        w1: load_linear(store, &format!("{key}.w1"), hidden, ff, device),
        w3: load_linear(store, &format!("{key}.w3"), hidden, ff, device),
        w2: load_linear(store, &format!("{key}.w2"), ff, hidden, device),
    }
}

/// Experts in either layout on disk: per expert (`experts.{e}.w1/w3/w2`) or fused as transformers writes
/// (`experts.gate_up_proj [E, 2F, H]`, `experts.down_proj [E, H, F]`). Kept fused, in burn's in→out layout.
fn experts<B: Backend>(
    store: &dyn TensorSource,
    key: &str,
    e: usize,
    hidden: usize,
    ff: usize,
    device: &B::Device,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let fused = format!("{key}.experts.gate_up_proj");
    if store.contains(&fused) {
        let gate_up: Tensor<B, 3> = device_tensor(store.take(&fused, &[e, 2 * ff, hidden]), device);
        let down: Tensor<B, 3> =
            device_tensor(store.take(&format!("{key}.experts.down_proj"), &[e, hidden, ff]), device);
        return (gate_up.swap_dims(1, 2), down.swap_dims(1, 2));
    }
    let mut gate_ups = Vec::with_capacity(e);
    let mut downs = Vec::with_capacity(e);
    for i in 0..e {
        let w1: Tensor<B, 2> =
            device_tensor(store.take(&format!("{key}.experts.{i}.w1.weight"), &[ff, hidden]), device);
        let w3: Tensor<B, 2> =
            device_tensor(store.take(&format!("{key}.experts.{i}.w3.weight"), &[ff, hidden]), device);
        let w2: Tensor<B, 2> =
            device_tensor(store.take(&format!("{key}.experts.{i}.w2.weight"), &[hidden, ff]), device);
        gate_ups.push(Tensor::cat(vec![w1, w3], 0).transpose().unsqueeze::<3>());
        downs.push(w2.transpose().unsqueeze::<3>());
    }
    (Tensor::cat(gate_ups, 0), Tensor::cat(downs, 0))
}

impl<B: Backend> Lfm2Model<B> {
    /// Builds the model from a checkpoint's tensors; every missing, unexpected or misshapen key is listed.
    pub fn from_source(
        config: &Lfm2Config,
        store: &dyn TensorSource,
        device: &B::Device,
    ) -> Result<Self, super::ModelError> {
        let (h, eps) = (config.hidden_size, config.norm_eps);
        let (nh, nkv, hd) = (config.num_attention_heads, config.num_key_value_heads, config.head_dim);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for (i, kind) in config.layer_types.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let mixer = match kind {
                LayerKind::Conv => {
                    let taps = config.conv_l_cache;
                    let w: Tensor<B, 3> =
                        device_tensor(store.take(&format!("{p}.conv.conv.weight"), &[h, 1, taps]), device);
                    Mixer::Conv(ShortConv {
                        in_proj: load_linear(store, &format!("{p}.conv.in_proj"), h, 3 * h, device),
                        conv: Param::from_tensor(w.reshape([h, taps])),
                        conv_bias: store
                            .take_optional(&format!("{p}.conv.conv.bias"), &[h])
                            .map(|b| Param::from_tensor(device_tensor(b, device))),
                        out_proj: load_linear(store, &format!("{p}.conv.out_proj"), h, h, device),
                    })
                }
                LayerKind::FullAttention => Mixer::Attention(Attention {
                    q_proj: load_linear(store, &format!("{p}.self_attn.q_proj"), h, nh * hd, device),
                    k_proj: load_linear(store, &format!("{p}.self_attn.k_proj"), h, nkv * hd, device),
                    v_proj: load_linear(store, &format!("{p}.self_attn.v_proj"), h, nkv * hd, device),
                    out_proj: load_linear(store, &format!("{p}.self_attn.out_proj"), nh * hd, h, device),
                    q_layernorm: norm(store, &format!("{p}.self_attn.q_layernorm"), hd, eps, device),
                    k_layernorm: norm(store, &format!("{p}.self_attn.k_layernorm"), hd, eps, device),
                    num_heads: nh,
                    num_kv_heads: nkv,
                    head_dim: hd,
                }),
            };
            let feed_forward = match &config.moe {
                Some(moe) if config.is_moe_layer(i) => {
                    let key = format!("{p}.feed_forward");
                    let (gate_up, down) = experts(store, &key, moe.num_experts, h, moe.moe_intermediate_size, device);
                    FeedForward::Moe(MoeBlock {
                        gate: load_linear(store, &format!("{key}.gate"), h, moe.num_experts, device),
                        // A buffer in transformers, never trained.
                        expert_bias: if moe.use_expert_bias {
                            Some(
                                load_param(store, &format!("{key}.expert_bias"), [moe.num_experts], device)
                                    .set_require_grad(false),
                            )
                        } else {
                            None
                        },
                        gate_up: Param::from_tensor(gate_up),
                        down: Param::from_tensor(down),
                        top_k: moe.num_experts_per_tok,
                        norm_topk_prob: moe.norm_topk_prob,
                        routed_scaling_factor: moe.routed_scaling_factor,
                        layer: i,
                    })
                }
                _ => FeedForward::Dense(swiglu(store, &format!("{p}.feed_forward"), h, config.ff_dim, device)),
            };
            layers.push(DecoderLayer {
                operator_norm: norm(store, &format!("{p}.operator_norm"), h, eps, device),
                mixer,
                ffn_norm: norm(store, &format!("{p}.ffn_norm"), h, eps, device),
                feed_forward,
            });
        }
        let embed_tokens =
            Param::from_tensor(device_tensor(store.take("model.embed_tokens.weight", &[config.vocab_size, h]), device));
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(Param::from_tensor(device_tensor(store.take("lm_head.weight", &[config.vocab_size, h]), device)))
        };
        let model = Lfm2Model {
            embed_tokens,
            layers,
            embedding_norm: norm(store, "model.embedding_norm", h, eps, device),
            lm_head,
            head_dim: hd,
            rope_theta: config.rope_theta,
        };
        // A tied checkpoint may still carry lm_head.weight (a copy); it is not a separate parameter here.
        let ignored: &[&str] = if config.tie_word_embeddings { &["lm_head.weight"] } else { &[] };
        store.finish(ignored)?;
        Ok(model)
    }
}
