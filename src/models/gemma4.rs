//! Gemma 4's text tower (`Gemma4ForConditionalGeneration` minus vision and audio, or `Gemma4ForCausalLM`),
//! the E-series form: embeddings scaled by `√hidden`; per-layer embeddings (PLE: a second token table and a
//! projection of the embeddings, one `hidden_size_per_layer_input` slice per layer); per layer sandwich
//! norms around attention and a GeGLU MLP (tanh GELU), then the PLE branch, then `layer_scalar`; sliding-
//! window layers (`head_dim`, default RoPE) and full-attention layers (`global_head_dim`, proportional RoPE),
//! both with q/k norms, a weightless v norm and unscaled scores; the last `num_kv_shared_layers` layers reuse
//! the keys and values of the last earlier layer of their kind; final norm, tied head, `c·tanh(logits/c)`.
//! Module and weight names mirror the checkpoint's. Norms are `w·x̂` (no `1 +` offset), scaled in f32 and
//! then cast, as transformers computes them.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Int, Tensor};

use super::attention::{DocumentAttention, merge_heads};
use super::config::{Gemma4Config, Gemma4LayerKind, Gemma4Rope, shared_kv_key};
use super::layers::{F32ScaledRmsNorm, Project, RopeTables, SequenceLayout, head_logits, soft_cap};
use super::ops::{GateActivation, ModelBackend, NormKind};
use super::weights::{HostTensor, TensorSource, load_linear, load_param};

/// A scale rounded to the weights' dtype, as transformers multiplies embeddings by `scale.to(weight.dtype)`.
fn in_dtype(scale: f64, dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => half::bf16::from_f64(scale).to_f64(),
        DType::F16 => half::f16::from_f64(scale).to_f64(),
        _ => scale as f32 as f64,
    }
}

/// `gate_proj`, `up_proj`, `down_proj`: `down(gelu_tanh(gate x) · up x)`.
#[derive(Module, Debug)]
pub struct GeGlu<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

impl<B: ModelBackend> GeGlu<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let gated = B::glu(self.gate_proj.project(x.clone()), self.up_proj.project(x), GateActivation::GeluTanh);
        self.down_proj.project(gated)
    }
}

/// The keys and values a layer computes (`None` on a KV-sharing layer, which reads those of `kv_source`).
#[derive(Module, Debug)]
pub struct Gemma4Kv<B: Backend> {
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub k_norm: F32ScaledRmsNorm<B>,
}

#[derive(Module, Debug)]
pub struct Gemma4Attention<B: Backend> {
    pub q_proj: Linear<B>,
    pub q_norm: F32ScaledRmsNorm<B>,
    pub kv: Option<Gemma4Kv<B>>,
    pub o_proj: Linear<B>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub sliding: bool,
    /// The earlier layer whose keys and values this one reads.
    pub kv_source: Option<usize>,
    pub eps: f64,
}

impl<B: ModelBackend> Gemma4Attention<B> {
    /// Queries `[batch, heads, seq, hd]` of `x` (normed, rotated).
    pub fn queries(&self, x: Tensor<B, 3>, rope: &RopeTables<B>) -> Tensor<B, 4> {
        let [batch, seq, _] = x.dims();
        let q = self.q_proj.project(x).reshape([batch, seq, self.num_heads, self.head_dim]);
        B::rope(self.q_norm.forward(q).swap_dims(1, 2), rope)
    }

    /// Keys `[batch, kv_heads, seq, hd]` (normed, rotated) and values (weightless-normed) of `x`, for a
    /// layer that computes its own.
    pub fn keys_values(&self, x: Tensor<B, 3>, rope: &RopeTables<B>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let kv = self.kv.as_ref().expect("a layer that computes its keys and values holds their weights");
        let [batch, seq, _] = x.dims();
        let (nkv, hd) = (self.num_kv_heads, self.head_dim);
        let k = kv.k_norm.forward(kv.k_proj.project(x.clone()).reshape([batch, seq, nkv, hd])).swap_dims(1, 2);
        let v = kv.v_proj.project(x).reshape([batch, seq, nkv, hd]);
        let unit = Tensor::<B, 1>::ones([hd], &v.device()).cast(FloatDType::from(v.dtype()));
        let v = B::rms_norm(v, unit, self.eps, NormKind::ScaledInF32).swap_dims(1, 2);
        (B::rope(k, rope), v)
    }

    /// The output projection of the attended heads `[batch, heads, seq, hd]`.
    pub fn output(&self, heads: Tensor<B, 4>) -> Tensor<B, 3> {
        self.o_proj.project(merge_heads(heads))
    }
}

/// The per-layer-embedding branch: `h + norm(proj(gelu_tanh(gate h) · ple_i))`.
#[derive(Module, Debug)]
pub struct Gemma4PerLayer<B: Backend> {
    pub per_layer_input_gate: Linear<B>,
    pub per_layer_projection: Linear<B>,
    pub post_per_layer_input_norm: F32ScaledRmsNorm<B>,
}

#[derive(Module, Debug)]
pub struct Gemma4Layer<B: Backend> {
    pub input_layernorm: F32ScaledRmsNorm<B>,
    pub self_attn: Gemma4Attention<B>,
    pub post_attention_layernorm: F32ScaledRmsNorm<B>,
    pub pre_feedforward_layernorm: F32ScaledRmsNorm<B>,
    pub mlp: GeGlu<B>,
    pub post_feedforward_layernorm: F32ScaledRmsNorm<B>,
    pub per_layer: Option<Gemma4PerLayer<B>>,
    /// The checkpoint's `layer_scalar` buffer (not trained, as in transformers).
    pub layer_scalar: f64,
}

impl<B: ModelBackend> Gemma4Layer<B> {
    /// The layer on `h`, with `attend` mapping the normed input to the attention's output (over the whole
    /// sequence in training, over the cache in decoding) and this layer's per-layer input `[batch, seq, ple]`.
    pub fn forward(
        &self,
        h: Tensor<B, 3>,
        attend: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 3>,
        per_layer_input: Option<Tensor<B, 3>>,
    ) -> Tensor<B, 3> {
        let h = h.clone() + self.post_attention_layernorm.forward(attend(self.input_layernorm.forward(h)));
        let y = self.mlp.forward(self.pre_feedforward_layernorm.forward(h.clone()));
        let mut h = h + self.post_feedforward_layernorm.forward(y);
        if let (Some(branch), Some(input)) = (&self.per_layer, per_layer_input) {
            let gated = B::glu(branch.per_layer_input_gate.project(h.clone()), input, GateActivation::GeluTanh);
            h = h.clone() + branch.post_per_layer_input_norm.forward(branch.per_layer_projection.project(gated));
        }
        h * self.layer_scalar
    }
}

#[derive(Module, Debug)]
pub struct Gemma4Model<B: Backend> {
    pub embed_tokens: Param<Tensor<B, 2>>,
    /// `[vocab_per_layer, layers · ple]` (none without PLE).
    pub embed_tokens_per_layer: Option<Param<Tensor<B, 2>>>,
    pub per_layer_model_projection: Option<Linear<B>>,
    pub per_layer_projection_norm: Option<F32ScaledRmsNorm<B>>,
    pub layers: Vec<Gemma4Layer<B>>,
    pub norm: F32ScaledRmsNorm<B>,
    /// `None` when the head is tied to `embed_tokens`.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    pub ple_dim: usize,
    pub sliding_window: usize,
    pub final_logit_softcapping: Option<f64>,
    pub sliding_theta: f64,
    pub sliding_rotary_factor: f64,
    pub sliding_proportional: bool,
    pub full_theta: f64,
    pub full_rotary_factor: f64,
    pub full_proportional: bool,
    /// `model.language_model.` or `model.`: where the text tower's tensors sit in the checkpoint.
    pub text_prefix: String,
}

/// The inverse frequencies of `rope` for heads of `head_dim`: `head_dim / 2` slots, the first
/// `factor · head_dim / 2` of them `θ^(−2j/head_dim)` and the rest 0 (proportional RoPE), or `head_dim ·
/// factor / 2` slots over the rotary dims (default RoPE, transformers' `partial_rotary_factor`).
pub fn gemma4_inv_freq(head_dim: usize, theta: f64, factor: f64, proportional: bool) -> Vec<f32> {
    if proportional {
        let rotated = (factor * head_dim as f64 / 2.0) as usize;
        (0..head_dim / 2)
            .map(|j| if j < rotated { (1.0 / theta.powf((2 * j) as f64 / head_dim as f64)) as f32 } else { 0.0 })
            .collect()
    } else {
        let dim = (head_dim as f64 * factor) as usize;
        (0..dim / 2).map(|j| (1.0 / theta.powf((2 * j) as f64 / dim as f64)) as f32).collect()
    }
}

/// The RoPE tables of a forward pass, one per (sliding, head width) pair.
pub struct RopeSet<B: Backend>(Vec<((bool, usize), RopeTables<B>)>);

impl<B: Backend> RopeSet<B> {
    pub fn get(&self, attn: &Gemma4Attention<B>) -> &RopeTables<B> {
        let key = (attn.sliding, attn.head_dim);
        &self.0.iter().find(|(k, _)| *k == key).expect("a table for every layer's kind").1
    }
}

impl<B: Backend> Gemma4Model<B> {
    /// The `layer_scalar` buffers as checkpoint tensors `[1]`.
    pub fn buffers(&self) -> std::collections::BTreeMap<String, HostTensor> {
        let pre = &self.text_prefix;
        let scalar = |s: f64| HostTensor { shape: vec![1], data: vec![s as f32] };
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| (format!("{pre}layers.{i}.layer_scalar"), scalar(l.layer_scalar)))
            .collect()
    }

    /// Whether `key` is a K/V weight of a KV-sharing layer, which such a layer never reads.
    pub fn is_unused_kv(&self, key: &str) -> bool {
        shared_kv_key(&self.text_prefix, key, |i| self.layers.get(i).is_some_and(|l| l.self_attn.kv_source.is_some()))
    }

    /// The output projection `[vocab, hidden]` (the embedding when tied).
    pub fn head_weight(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(w) => w.val(),
            None => self.embed_tokens.val(),
        }
    }

    fn lookup(table: &Param<Tensor<B, 2>>, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, seq] = ids.dims();
        let width = table.dims()[1];
        table.val().select(0, ids.reshape([batch * seq])).reshape([batch, seq, width])
    }

    /// The RoPE tables of one layer kind for heads of `head_dim`.
    fn rope_tables(
        &self,
        sliding: bool,
        head_dim: usize,
        layout: &SequenceLayout,
        dtype: FloatDType,
        device: &B::Device,
    ) -> RopeTables<B> {
        let (theta, factor, proportional) = if sliding {
            (self.sliding_theta, self.sliding_rotary_factor, self.sliding_proportional)
        } else {
            (self.full_theta, self.full_rotary_factor, self.full_proportional)
        };
        RopeTables::from_inv_freq(
            layout,
            head_dim,
            gemma4_inv_freq(head_dim, theta, factor, proportional),
            dtype,
            device,
        )
    }
}

impl<B: ModelBackend> Gemma4Model<B> {
    /// The embeddings `[batch, seq, hidden]` (scaled by `√hidden` in the weights' dtype) and each layer's
    /// per-layer input `[batch, seq, layers, ple]`: `(norm(proj(h₀)/√hidden) + E_ple[ids]·√ple)/√2`.
    pub fn embed(&self, ids: Tensor<B, 2, Int>) -> (Tensor<B, 3>, Option<Tensor<B, 4>>) {
        let hidden = self.embed_tokens.dims()[1];
        let scale = in_dtype((hidden as f64).sqrt(), self.embed_tokens.val().dtype());
        let embedded = Self::lookup(&self.embed_tokens, ids.clone()) * scale;
        let (Some(table), Some(projection), Some(norm)) =
            (&self.embed_tokens_per_layer, &self.per_layer_model_projection, &self.per_layer_projection_norm)
        else {
            return (embedded, None);
        };
        let [batch, seq, _] = embedded.dims();
        let (layers, ple) = (self.layers.len(), self.ple_dim);
        let tokens = Self::lookup(table, ids) * in_dtype((ple as f64).sqrt(), table.val().dtype());
        let context = projection.project(embedded.clone()) * (hidden as f64).powf(-0.5);
        let context = norm.forward(context.reshape([batch, seq, layers, ple]));
        let per_layer = (context + tokens.reshape([batch, seq, layers, ple])) * 0.5f64.sqrt();
        (embedded, Some(per_layer))
    }

    /// Layer `i`'s slice `[batch, seq, ple]` of the per-layer inputs.
    pub fn per_layer_input(inputs: &Option<Tensor<B, 4>>, i: usize) -> Option<Tensor<B, 3>> {
        inputs.as_ref().map(|t| {
            let [batch, seq, _, ple] = t.dims();
            t.clone().narrow(2, i, 1).reshape([batch, seq, ple])
        })
    }

    /// One RoPE table per (sliding, head width) pair the layers use, in layer order of first use.
    pub fn rope_set(&self, layout: &SequenceLayout, dtype: FloatDType, device: &B::Device) -> RopeSet<B> {
        let mut tables: Vec<((bool, usize), RopeTables<B>)> = Vec::new();
        for attn in self.layers.iter().map(|l| &l.self_attn) {
            let key = (attn.sliding, attn.head_dim);
            if !tables.iter().any(|(k, _)| *k == key) {
                tables.push((key, self.rope_tables(attn.sliding, attn.head_dim, layout, dtype, device)));
            }
        }
        RopeSet(tables)
    }

    /// The final normalized hidden states `[batch, seq, hidden]` for `ids` laid out as `layout` says.
    pub fn forward_hidden(&self, ids: Tensor<B, 2, Int>, layout: &SequenceLayout) -> Tensor<B, 3> {
        let device = ids.device();
        let (mut h, per_layer) = self.embed(ids);
        let ropes = self.rope_set(layout, FloatDType::from(h.dtype()), &device);
        // Scores are not scaled: the q and k norms set their size.
        let full_docs = DocumentAttention::<B>::new(layout, &device).with_scale(1.0);
        let sliding_docs = full_docs.clone().with_window(self.sliding_window);
        let mut kv_states: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>> = vec![None; self.layers.len()];
        let sources: Vec<usize> = self.layers.iter().filter_map(|l| l.self_attn.kv_source).collect();
        for (i, layer) in self.layers.iter().enumerate() {
            let attn = &layer.self_attn;
            let rope = ropes.get(attn);
            let docs = if attn.sliding { &sliding_docs } else { &full_docs };
            let attend = |x: Tensor<B, 3>| {
                let q = attn.queries(x.clone(), rope);
                let (k, v) = match attn.kv_source {
                    Some(j) => kv_states[j].clone().expect("a KV source comes before the layers that share it"),
                    None => attn.keys_values(x, rope),
                };
                if sources.contains(&i) {
                    kv_states[i] = Some((k.clone(), v.clone()));
                }
                attn.output(B::document_attention(q, k, v, docs))
            };
            h = B::layer_output(layer.forward(h, attend, Self::per_layer_input(&per_layer, i)));
        }
        self.norm.forward(h)
    }

    /// Logits `[batch, seq, vocab]`, soft-capped as `c·tanh(logits/c)` where the config sets `c`.
    pub fn forward(&self, ids: Tensor<B, 2, Int>, layout: &SequenceLayout) -> Tensor<B, 3> {
        soft_cap(head_logits(self.forward_hidden(ids, layout), self.head_weight()), self.final_logit_softcapping)
    }
}

// ---- construction from a checkpoint ----------------------------------------------------------------

fn norm<B: Backend>(
    store: &dyn TensorSource,
    key: &str,
    dim: usize,
    eps: f64,
    device: &B::Device,
) -> F32ScaledRmsNorm<B> {
    F32ScaledRmsNorm { weight: load_param(store, &format!("{key}.weight"), [dim], device), eps }
}

impl<B: Backend> Gemma4Model<B> {
    /// Builds the text tower from a checkpoint's tensors; other towers' tensors (and the K/V weights a
    /// KV-sharing layer's checkpoint may still hold, which transformers ignores too) are left where they are,
    /// and every missing, unexpected or misshapen text tensor is listed.
    pub fn from_source(
        config: &Gemma4Config,
        store: &dyn TensorSource,
        device: &B::Device,
    ) -> Result<Self, super::ModelError> {
        let (h, eps, pre) = (config.hidden_size, config.rms_norm_eps, config.text_prefix.as_str());
        let (nh, ple) = (config.num_attention_heads, config.hidden_size_per_layer_input);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for (i, shape) in config.layers.iter().enumerate() {
            let p = format!("{pre}layers.{i}");
            let a = format!("{p}.self_attn");
            let (hd, nkv) = (shape.head_dim, shape.num_key_value_heads);
            let kv = shape.kv_source.is_none().then(|| Gemma4Kv {
                k_proj: load_linear(store, &format!("{a}.k_proj"), h, nkv * hd, device),
                v_proj: load_linear(store, &format!("{a}.v_proj"), h, nkv * hd, device),
                k_norm: norm(store, &format!("{a}.k_norm"), hd, eps, device),
            });
            let self_attn = Gemma4Attention {
                q_proj: load_linear(store, &format!("{a}.q_proj"), h, nh * hd, device),
                q_norm: norm(store, &format!("{a}.q_norm"), hd, eps, device),
                kv,
                o_proj: load_linear(store, &format!("{a}.o_proj"), nh * hd, h, device),
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                sliding: shape.kind == Gemma4LayerKind::SlidingAttention,
                kv_source: shape.kv_source,
                eps,
            };
            let ff = shape.intermediate_size;
            let per_layer = (ple > 0).then(|| Gemma4PerLayer {
                per_layer_input_gate: load_linear(store, &format!("{p}.per_layer_input_gate"), h, ple, device),
                per_layer_projection: load_linear(store, &format!("{p}.per_layer_projection"), ple, h, device),
                post_per_layer_input_norm: norm(store, &format!("{p}.post_per_layer_input_norm"), h, eps, device),
            });
            let scalar = store.take(&format!("{p}.layer_scalar"), &[1]).data.first().copied().unwrap_or(1.0);
            layers.push(Gemma4Layer {
                input_layernorm: norm(store, &format!("{p}.input_layernorm"), h, eps, device),
                self_attn,
                post_attention_layernorm: norm(store, &format!("{p}.post_attention_layernorm"), h, eps, device),
                pre_feedforward_layernorm: norm(store, &format!("{p}.pre_feedforward_layernorm"), h, eps, device),
                mlp: GeGlu {
                    gate_proj: load_linear(store, &format!("{p}.mlp.gate_proj"), h, ff, device),
                    up_proj: load_linear(store, &format!("{p}.mlp.up_proj"), h, ff, device),
                    down_proj: load_linear(store, &format!("{p}.mlp.down_proj"), ff, h, device),
                },
                post_feedforward_layernorm: norm(store, &format!("{p}.post_feedforward_layernorm"), h, eps, device),
                per_layer,
                layer_scalar: scalar as f64,
            });
        }
        let per_layer_width = config.num_hidden_layers * ple;
        let lm_head =
            (!config.tie_word_embeddings).then(|| load_param(store, "lm_head.weight", [config.vocab_size, h], device));
        let rope = |r: &Gemma4Rope| (r.theta, r.partial_rotary_factor, r.proportional);
        let (sliding_theta, sliding_rotary_factor, sliding_proportional) = rope(&config.sliding_rope);
        let (full_theta, full_rotary_factor, full_proportional) = rope(&config.full_rope);
        let model = Gemma4Model {
            embed_tokens: load_param(store, &format!("{pre}embed_tokens.weight"), [config.vocab_size, h], device),
            embed_tokens_per_layer: (ple > 0).then(|| {
                let shape = [config.vocab_size_per_layer_input, per_layer_width];
                load_param(store, &format!("{pre}embed_tokens_per_layer.weight"), shape, device)
            }),
            per_layer_model_projection: (ple > 0)
                .then(|| load_linear(store, &format!("{pre}per_layer_model_projection"), h, per_layer_width, device)),
            per_layer_projection_norm: (ple > 0)
                .then(|| norm(store, &format!("{pre}per_layer_projection_norm"), ple, eps, device)),
            layers,
            norm: norm(store, &format!("{pre}norm"), h, eps, device),
            lm_head,
            ple_dim: ple,
            sliding_window: config.sliding_window,
            final_logit_softcapping: config.final_logit_softcapping,
            sliding_theta,
            sliding_rotary_factor,
            sliding_proportional,
            full_theta,
            full_rotary_factor,
            full_proportional,
            text_prefix: config.text_prefix.clone(),
        };
        let tied_copy: &[&str] = if config.tie_word_embeddings { &["lm_head.weight"] } else { &[] };
        store.finish_except(tied_copy, &|key| config.is_other_tower(key) || config.is_unused_kv(key))?;
        Ok(model)
    }
}
