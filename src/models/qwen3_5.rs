//! Qwen3.5's text tower (`Qwen3_5ForConditionalGeneration` minus vision, or `Qwen3_5ForCausalLM`): per layer
//! input_layernorm → Gated DeltaNet or gated full attention → residual → post_attention_layernorm → SwiGLU →
//! residual; final `norm`; head tied (0.8B, 2B) or `lm_head`. Norms are zero-centered `(1+w)` RMSNorms except
//! the DeltaNet output norm. Module and weight names mirror the checkpoint's (`linear_attn.in_proj_qkv`, …).

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::activation::{sigmoid, silu};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor};

use super::attention::{DocumentAttention, merge_heads};
use super::config::{Qwen35Config, Qwen35LayerKind};
use super::deltanet::{ChunkPlan, DocSegments, ScanInputs};
use super::layers::{
    ConvShifts, Project, RmsNorm, RopeTables, SequenceLayout, SwiGlu, ZeroCenteredRmsNorm, head_logits, softplus,
};
use super::ops::{GateActivation, ModelBackend};
use super::weights::{TensorSource, device_tensor, load_linear, load_param};

/// Tokens per chunk of the DeltaNet scan (transformers' and FLA's training path).
pub const SCAN_CHUNK: usize = 64;

/// The Gated DeltaNet mixer: `in_proj_qkv` → causal depthwise conv + SiLU → q | k | v; L2-normalized q, k;
/// rates `β = σ(in_proj_b x)`, log-decays `g = −exp(A_log)·softplus(in_proj_a x + dt_bias)`; the gated delta
/// rule per value head; output `RMSNorm(o)·SiLU(in_proj_z x)` → `out_proj`.
#[derive(Module, Debug)]
pub struct GatedDeltaNet<B: Backend> {
    pub in_proj_qkv: Linear<B>,
    pub in_proj_z: Linear<B>,
    pub in_proj_b: Linear<B>,
    pub in_proj_a: Linear<B>,
    /// Depthwise kernel `[conv_dim, L]` (the checkpoint's `[conv_dim, 1, L]`).
    pub conv1d: Param<Tensor<B, 2>>,
    pub dt_bias: Param<Tensor<B, 1>>,
    /// `A_log` in the checkpoint (kept in f32 there).
    pub a_log: Param<Tensor<B, 1>>,
    /// Plain `w·x̂` RMSNorm over each value head (weight stored in f32), then gated.
    pub norm: RmsNorm<B>,
    pub out_proj: Linear<B>,
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub head_k_dim: usize,
    pub head_v_dim: usize,
}

/// The per-token quantities of a DeltaNet layer before the scan.
pub struct DeltaNetInputs<B: Backend> {
    pub scan: ScanInputs<B>,
    /// The output gate `[batch, seq, value_heads, dv]`.
    pub z: Tensor<B, 4>,
}

impl<B: ModelBackend> GatedDeltaNet<B> {
    /// Everything the scan needs, from the (already convolved and activated) `mixed` q | k | v and the
    /// layer input `x`.
    pub fn scan_inputs(&self, x: Tensor<B, 3>, mixed: Tensor<B, 3>) -> DeltaNetInputs<B> {
        let [batch, seq, _] = x.dims();
        let (nk, nv, dk, dv) = (self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim);
        let key_dim = nk * dk;
        // Each key head serves nv / nk consecutive value heads (repeat_interleave).
        let heads = |t: Tensor<B, 3>| {
            let t = t.reshape([batch, seq, nk, dk]);
            let t =
                if nv == nk { t } else { t.unsqueeze_dim::<5>(3).repeat_dim(3, nv / nk).reshape([batch, seq, nv, dk]) };
            B::l2_norm(t, 1e-6).swap_dims(1, 2)
        };
        let [q, k, v] = B::split_last(mixed, [key_dim, key_dim, nv * dv]);
        let q = heads(q) * (1.0 / (dk as f64).sqrt());
        let k = heads(k);
        let v = v.reshape([batch, seq, nv, dv]).swap_dims(1, 2);
        let z = self.in_proj_z.project(x.clone()).reshape([batch, seq, nv, dv]);
        let beta = sigmoid(self.in_proj_b.project(x.clone())).swap_dims(1, 2);
        let per_head = |p: Tensor<B, 1>| B::broadcast_rows(p, [batch, seq, nv]);
        let a = self.in_proj_a.project(x).cast(FloatDType::F32) + per_head(self.dt_bias.val().cast(FloatDType::F32));
        let rate = per_head(self.a_log.val().cast(FloatDType::F32).exp());
        let g = (softplus(a) * rate).neg().swap_dims(1, 2);
        DeltaNetInputs { scan: ScanInputs { q, k, v, g, beta }, z }
    }

    /// The gated output norm and projection of the scan's output `[batch, heads, seq, dv]`.
    pub fn output(&self, core: Tensor<B, 4>, z: Tensor<B, 4>, dtype: FloatDType) -> Tensor<B, 3> {
        let [batch, nv, seq, dv] = core.dims();
        let normed = self.norm.forward(core.swap_dims(1, 2).cast(dtype));
        // In f32 as transformers gates; through the gate op, which keeps the two f32 inputs only.
        let gated = B::glu(z.cast(FloatDType::F32), normed.cast(FloatDType::F32), GateActivation::Silu).cast(dtype);
        self.out_proj.project(gated.reshape([batch, seq, nv * dv]))
    }

    pub fn forward(&self, x: Tensor<B, 3>, shifts: &ConvShifts<B>, plan: &ChunkPlan<B>) -> Tensor<B, 3> {
        let dtype = FloatDType::from(x.dtype());
        let mixed = silu(B::causal_conv(self.in_proj_qkv.project(x.clone()), self.conv1d.val(), shifts));
        let inputs = self.scan_inputs(x, mixed);
        let core = B::gated_delta_rule(inputs.scan, plan);
        self.output(core, inputs.z, dtype)
    }
}

/// Gated full attention: `q_proj` gives per head `[query | gate]`; (1+w) norms on q and k; RoPE on the first
/// `rotary_dim` dims; grouped-query softmax attention; output `· σ(gate)` → `o_proj`.
#[derive(Module, Debug)]
pub struct GatedAttention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub q_norm: ZeroCenteredRmsNorm<B>,
    pub k_norm: ZeroCenteredRmsNorm<B>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl<B: ModelBackend> GatedAttention<B> {
    /// Queries `[batch, heads, seq, hd]`, keys and values `[batch, kv_heads, seq, hd]` (normed, rotated), and
    /// the output gate `[batch, seq, heads * hd]`.
    pub fn qkv_gate(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeTables<B>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 3>) {
        let [batch, seq, _] = x.dims();
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let query_gate = self.q_proj.project(x.clone()).reshape([batch, seq, nh, 2 * hd]);
        let [query, gate] = B::split_last(query_gate, [hd, hd]);
        let q = self.q_norm.forward(query).swap_dims(1, 2);
        let gate = gate.reshape([batch, seq, nh * hd]);
        let k = self.k_norm.forward(self.k_proj.project(x.clone()).reshape([batch, seq, nkv, hd])).swap_dims(1, 2);
        let v = self.v_proj.project(x).reshape([batch, seq, nkv, hd]).swap_dims(1, 2);
        (B::rope(q, rope), B::rope(k, rope), v, gate)
    }

    /// `o_proj(heads · sigmoid(gate))`: the heads' outputs `[batch, heads, seq, d]` merged and gated.
    pub fn gated_output(&self, heads: Tensor<B, 4>, gate: Tensor<B, 3>) -> Tensor<B, 3> {
        self.o_proj.project(merge_heads(heads) * sigmoid(gate))
    }

    /// Attention over the whole sequence, inside each document (the training and full-forward path).
    pub fn forward(&self, x: Tensor<B, 3>, rope: &RopeTables<B>, docs: &DocumentAttention<B>) -> Tensor<B, 3> {
        let (q, k, v, gate) = self.qkv_gate(x, rope);
        self.gated_output(B::document_attention(q, k, v, docs), gate)
    }
}

#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Qwen35Mixer<B: Backend> {
    Linear(GatedDeltaNet<B>),
    Full(GatedAttention<B>),
}

#[derive(Module, Debug)]
pub struct Qwen35Layer<B: Backend> {
    pub input_layernorm: ZeroCenteredRmsNorm<B>,
    pub mixer: Qwen35Mixer<B>,
    pub post_attention_layernorm: ZeroCenteredRmsNorm<B>,
    /// gate_proj = w1, up_proj = w3, down_proj = w2.
    pub mlp: SwiGlu<B>,
}

#[derive(Module, Debug)]
pub struct Qwen35Model<B: Backend> {
    pub embed_tokens: Param<Tensor<B, 2>>,
    pub layers: Vec<Qwen35Layer<B>>,
    pub norm: ZeroCenteredRmsNorm<B>,
    /// `None` when the head is tied to `embed_tokens`.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// `model.language_model.` or `model.`: where the text tower's tensors sit in the checkpoint.
    pub text_prefix: String,
}

impl<B: Backend> Qwen35Model<B> {
    /// The output projection `[vocab, hidden]` (the embedding when tied).
    pub fn head_weight(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(w) => w.val(),
            None => self.embed_tokens.val(),
        }
    }

    pub fn embed(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, seq] = ids.dims();
        let hidden = self.embed_tokens.dims()[1];
        self.embed_tokens.val().select(0, ids.reshape([batch * seq])).reshape([batch, seq, hidden])
    }

    pub fn max_conv_lag(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Qwen35Mixer::Linear(d) => Some(d.conv1d.dims()[1] - 1),
                Qwen35Mixer::Full(_) => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// RoPE over the first `rotary_dim` dims of the full-attention heads.
    pub(super) fn rope_tables(&self, layout: &SequenceLayout, dtype: FloatDType, device: &B::Device) -> RopeTables<B> {
        let head_dim = self
            .layers
            .iter()
            .find_map(|l| match &l.mixer {
                Qwen35Mixer::Full(attn) => Some(attn.head_dim),
                Qwen35Mixer::Linear(_) => None,
            })
            .unwrap_or(self.rotary_dim);
        RopeTables::new(layout, head_dim, self.rotary_dim, self.rope_theta, dtype, device)
    }
}

impl<B: ModelBackend> Qwen35Model<B> {
    /// The final normalized hidden states `[batch, seq, hidden]` for `ids` laid out as `layout` says.
    pub fn forward_hidden(&self, ids: Tensor<B, 2, Int>, layout: &SequenceLayout) -> Tensor<B, 3> {
        let device = ids.device();
        let mut h = self.embed(ids);
        // Everything the forward pass builds (RoPE tables, masks) follows the weights' dtype.
        let dtype = FloatDType::from(h.dtype());
        let needs_attention = self.layers.iter().any(|l| matches!(l.mixer, Qwen35Mixer::Full(_)));
        let (rope, docs) = if needs_attention {
            (Some(self.rope_tables(layout, dtype, &device)), Some(DocumentAttention::<B>::new(layout, &device)))
        } else {
            (None, None)
        };
        let shifts = ConvShifts::<B>::new(layout, self.max_conv_lag(), &device);
        let segments = DocSegments::from_doc_ids(layout.batch, layout.seq, layout.doc_ids.clone());
        let plan = ChunkPlan::new(&segments, SCAN_CHUNK, &device);
        for layer in &self.layers {
            let x = layer.input_layernorm.forward(h.clone());
            let y = match &layer.mixer {
                Qwen35Mixer::Linear(net) => net.forward(x, &shifts, &plan),
                Qwen35Mixer::Full(attn) => attn.forward(
                    x,
                    rope.as_ref().expect("tables built for attention"),
                    docs.as_ref().expect("documents built for attention"),
                ),
            };
            h = h + y;
            h = B::layer_output(h.clone() + layer.mlp.forward(layer.post_attention_layernorm.forward(h)));
        }
        self.norm.forward(h)
    }

    /// Logits `[batch, seq, vocab]`.
    pub fn forward(&self, ids: Tensor<B, 2, Int>, layout: &SequenceLayout) -> Tensor<B, 3> {
        head_logits(self.forward_hidden(ids, layout), self.head_weight())
    }
}

// ---- construction from a checkpoint ----------------------------------------------------------------

fn centered_norm<B: Backend>(
    store: &dyn TensorSource,
    key: &str,
    dim: usize,
    eps: f64,
    device: &B::Device,
) -> ZeroCenteredRmsNorm<B> {
    ZeroCenteredRmsNorm { weight: load_param(store, &format!("{key}.weight"), [dim], device), eps }
}

impl<B: Backend> Qwen35Model<B> {
    /// Builds the text tower from a checkpoint's tensors; vision and multi-token-prediction tensors are left
    /// where they are, and every missing, unexpected or misshapen text tensor is listed.
    pub fn from_source(
        config: &Qwen35Config,
        store: &dyn TensorSource,
        device: &B::Device,
    ) -> Result<Self, super::ModelError> {
        let (h, eps, pre) = (config.hidden_size, config.rms_norm_eps, config.text_prefix.as_str());
        let (nh, nkv, hd) = (config.num_attention_heads, config.num_key_value_heads, config.head_dim);
        let (nk, nv) = (config.linear_num_key_heads, config.linear_num_value_heads);
        let (dk, dv, taps) = (config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for (i, kind) in config.layer_types.iter().enumerate() {
            let p = format!("{pre}layers.{i}");
            let mixer = match kind {
                Qwen35LayerKind::LinearAttention => {
                    let a = format!("{p}.linear_attn");
                    let conv_dim = 2 * nk * dk + nv * dv;
                    let kernel: Tensor<B, 3> =
                        device_tensor(store.take(&format!("{a}.conv1d.weight"), &[conv_dim, 1, taps]), device);
                    Qwen35Mixer::Linear(GatedDeltaNet {
                        in_proj_qkv: load_linear(store, &format!("{a}.in_proj_qkv"), h, conv_dim, device),
                        in_proj_z: load_linear(store, &format!("{a}.in_proj_z"), h, nv * dv, device),
                        in_proj_b: load_linear(store, &format!("{a}.in_proj_b"), h, nv, device),
                        in_proj_a: load_linear(store, &format!("{a}.in_proj_a"), h, nv, device),
                        conv1d: Param::from_tensor(kernel.reshape([conv_dim, taps])),
                        dt_bias: load_param(store, &format!("{a}.dt_bias"), [nv], device),
                        a_log: load_param(store, &format!("{a}.A_log"), [nv], device),
                        norm: RmsNorm { weight: load_param(store, &format!("{a}.norm.weight"), [dv], device), eps },
                        out_proj: load_linear(store, &format!("{a}.out_proj"), nv * dv, h, device),
                        num_k_heads: nk,
                        num_v_heads: nv,
                        head_k_dim: dk,
                        head_v_dim: dv,
                    })
                }
                Qwen35LayerKind::FullAttention => {
                    let a = format!("{p}.self_attn");
                    Qwen35Mixer::Full(GatedAttention {
                        q_proj: load_linear(store, &format!("{a}.q_proj"), h, 2 * nh * hd, device),
                        k_proj: load_linear(store, &format!("{a}.k_proj"), h, nkv * hd, device),
                        v_proj: load_linear(store, &format!("{a}.v_proj"), h, nkv * hd, device),
                        o_proj: load_linear(store, &format!("{a}.o_proj"), nh * hd, h, device),
                        q_norm: centered_norm(store, &format!("{a}.q_norm"), hd, eps, device),
                        k_norm: centered_norm(store, &format!("{a}.k_norm"), hd, eps, device),
                        num_heads: nh,
                        num_kv_heads: nkv,
                        head_dim: hd,
                    })
                }
            };
            let ff = config.intermediate_size;
            layers.push(Qwen35Layer {
                input_layernorm: centered_norm(store, &format!("{p}.input_layernorm"), h, eps, device),
                mixer,
                post_attention_layernorm: centered_norm(
                    store,
                    &format!("{p}.post_attention_layernorm"),
                    h,
                    eps,
                    device,
                ),
                mlp: SwiGlu {
                    w1: load_linear(store, &format!("{p}.mlp.gate_proj"), h, ff, device),
                    w3: load_linear(store, &format!("{p}.mlp.up_proj"), h, ff, device),
                    w2: load_linear(store, &format!("{p}.mlp.down_proj"), ff, h, device),
                },
            });
        }
        let lm_head =
            (!config.tie_word_embeddings).then(|| load_param(store, "lm_head.weight", [config.vocab_size, h], device));
        let model = Qwen35Model {
            embed_tokens: load_param(store, &format!("{pre}embed_tokens.weight"), [config.vocab_size, h], device),
            layers,
            norm: centered_norm(store, &format!("{pre}norm"), h, eps, device),
            lm_head,
            rotary_dim: config.rotary_dim,
            rope_theta: config.rope_theta,
            text_prefix: config.text_prefix.clone(),
        };
        let tied_copy: &[&str] = if config.tie_word_embeddings { &["lm_head.weight"] } else { &[] };
        store.finish_except(tied_copy, &|key| config.is_other_tower(key))?;
        Ok(model)
    }
}
