//! Model configs parsed from a checkpoint's `config.json`: LFM2 / LFM2-MoE with every legacy alias the
//! released checkpoints use, Qwen3.5 (its text tower, nested under `text_config` in the vision-language
//! checkpoints), the derived quantities (effective FFN width, layer kinds, rotary width) the weights depend
//! on, and `ModelConfig`, which picks the architecture from `model_type`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ModelError;

/// The `model_type`s kiln loads.
pub const SUPPORTED: &[&str] = &["lfm2", "lfm2_moe", "qwen3_5", "qwen3_5_text", "gemma4", "gemma4_text"];
const LFM2_TYPES: &[&str] = &["lfm2", "lfm2_moe"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    Conv,
    FullAttention,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Layers below this index use a dense SwiGLU.
    pub num_dense_layers: usize,
    pub use_expert_bias: bool,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
}

/// LFM2 / LFM2-MoE hyper-parameters (transformers `Lfm2Config`, `Lfm2MoeConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lfm2Config {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The raw `intermediate_size` of config.json.
    pub intermediate_size: usize,
    /// The width the dense FFN weights actually have (after `block_auto_adjust_ff_dim`).
    pub ff_dim: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub conv_bias: bool,
    pub conv_l_cache: usize,
    pub layer_types: Vec<LayerKind>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub moe: Option<MoeConfig>,
}

/// A config.json object read key by key. A key that is absent or null takes its default; one set to a
/// value of the wrong type, or to a size of 0, is an error naming it (`at` prefixes nested keys), rather
/// than the default silently standing in for what the checkpoint says.
struct Fields<'a> {
    v: &'a Value,
    at: String,
}

impl<'a> Fields<'a> {
    fn new(v: &'a Value, at: &str) -> Self {
        Fields { v, at: at.to_string() }
    }

    /// The first of `keys` that is set, with its value.
    fn value<'k>(&self, keys: &[&'k str]) -> Option<(&'k str, &'a Value)> {
        keys.iter().find_map(|&k| self.v.get(k).filter(|x| !x.is_null()).map(|x| (k, x)))
    }

    fn has(&self, key: &str) -> bool {
        self.value(&[key]).is_some()
    }

    fn typed<T>(&self, keys: &[&str], what: &str, read: impl Fn(&'a Value) -> Option<T>) -> Result<Option<T>, String> {
        match self.value(keys) {
            None => Ok(None),
            Some((key, x)) => read(x).map(Some).ok_or_else(|| format!("`{}{key}` is {x}, not {what}", self.at)),
        }
    }

    fn usize(&self, keys: &[&str]) -> Result<Option<usize>, String> {
        self.typed(keys, "a non-negative integer", |x| x.as_u64().and_then(|n| usize::try_from(n).ok()))
    }

    fn f64(&self, keys: &[&str]) -> Result<Option<f64>, String> {
        self.typed(keys, "a number", Value::as_f64)
    }

    fn bool(&self, keys: &[&str]) -> Result<Option<bool>, String> {
        self.typed(keys, "true or false", Value::as_bool)
    }

    fn str(&self, keys: &[&str]) -> Result<Option<&'a str>, String> {
        self.typed(keys, "a string", Value::as_str)
    }

    /// A list under `key`, or None when it is not set.
    fn list(&self, key: &str) -> Result<Option<&'a Vec<Value>>, String> {
        self.typed(&[key], "a list", Value::as_array)
    }

    /// A required size: a positive integer.
    fn size(&self, keys: &[&str]) -> Result<usize, String> {
        let n = self.usize(keys)?.ok_or_else(|| format!("missing `{}{}`", self.at, keys[0]))?;
        self.positive(keys, n)
    }

    /// A size that defaults to `default` when not set.
    fn size_or(&self, keys: &[&str], default: usize) -> Result<usize, String> {
        self.positive(keys, self.usize(keys)?.unwrap_or(default))
    }

    fn positive(&self, keys: &[&str], n: usize) -> Result<usize, String> {
        if n == 0 {
            let key = self.value(keys).map_or(keys[0], |(k, _)| k);
            return Err(format!("`{}{key}` is 0: a model needs at least one", self.at));
        }
        Ok(n)
    }

    /// A positive, finite number that defaults to `default` when not set (epsilons, RoPE bases).
    fn positive_f64_or(&self, keys: &[&str], default: f64) -> Result<f64, String> {
        let x = self.f64(keys)?.unwrap_or(default);
        if x > 0.0 && x.is_finite() {
            Ok(x)
        } else {
            let key = self.value(keys).map_or(keys[0], |(k, _)| k);
            Err(format!("`{}{key}` is {x}: it must be a positive number", self.at))
        }
    }

    /// A token id: a number, or the first of a list of them (`eos_token_id: [1, 106]`).
    fn token_id(&self, key: &str) -> Result<Option<u32>, String> {
        let id = |x: &Value| x.as_u64().and_then(|n| u32::try_from(n).ok());
        self.typed(&[key], "a token id or a list of them", |x| match x {
            Value::Array(ids) => match ids.first() {
                None => Some(None),
                Some(first) => id(first).map(Some),
            },
            other => id(other).map(Some),
        })
        .map(Option::flatten)
    }

    /// The object under `key`, read with its path as the prefix; None when it is not set.
    fn nested(&self, key: &str) -> Result<Option<Fields<'a>>, String> {
        match self.value(&[key]) {
            None => Ok(None),
            Some((_, x)) if x.is_object() => Ok(Some(Fields::new(x, &format!("{}{key}.", self.at)))),
            Some((_, x)) => Err(format!("`{}{key}` is {x}, not an object", self.at)),
        }
    }

    /// `nested`, with an unset object read as one that sets nothing.
    fn nested_or_empty(&self, key: &str) -> Result<Fields<'a>, String> {
        static UNSET: Value = Value::Null;
        Ok(self.nested(key)?.unwrap_or_else(|| Fields::new(&UNSET, &format!("{}{key}.", self.at))))
    }
}

/// `first` when it is set (or wrong), else `then`.
fn first_set<T>(
    first: Result<Option<T>, String>,
    then: impl FnOnce() -> Result<Option<T>, String>,
) -> Result<Option<T>, String> {
    match first {
        Ok(None) => then(),
        other => other,
    }
}

/// `Lfm2MLP`'s width rule: with auto-adjust, 2/3 of the raw width, times the multiplier, rounded up to a
/// multiple of `block_multiple_of` (6656 → 4608 for LFM2-350M; 12288 → 8192 for 1.2B).
pub fn effective_ff_dim(intermediate: usize, auto_adjust: bool, multiplier: Option<f64>, multiple_of: usize) -> usize {
    if !auto_adjust {
        return intermediate;
    }
    let mut ff = (2 * intermediate) / 3;
    if let Some(m) = multiplier {
        ff = (m * ff as f64) as usize;
        let multiple = multiple_of.max(1);
        ff = multiple * ff.div_ceil(multiple);
    }
    ff
}

fn unsupported(model_type: &str) -> String {
    format!("model_type '{model_type}' is not supported; supported: {}", SUPPORTED.join(", "))
}

fn read_config_json(path: &Path) -> Result<Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::Config { path: path.to_path_buf(), message: e.to_string() })
}

impl Lfm2Config {
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        Self::from_json(&read_config_json(path)?)
            .map_err(|message| ModelError::Config { path: path.to_path_buf(), message })
    }

    pub fn from_json(v: &Value) -> Result<Self, String> {
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or_default().to_string();
        if !LFM2_TYPES.contains(&model_type.as_str()) {
            return Err(unsupported(&model_type));
        }
        let f = Fields::new(v, "");
        let hidden_size = f.size(&["hidden_size"])?;
        let num_hidden_layers = f.size(&["num_hidden_layers"])?;
        let num_attention_heads = f.size(&["num_attention_heads"])?;
        let num_key_value_heads = f.size_or(&["num_key_value_heads"], num_attention_heads)?;
        if !hidden_size.is_multiple_of(num_attention_heads) || !num_attention_heads.is_multiple_of(num_key_value_heads)
        {
            return Err(format!(
                "hidden_size {hidden_size}, num_attention_heads {num_attention_heads} and num_key_value_heads {num_key_value_heads} do not divide"
            ));
        }
        let intermediate_size = f.size(&["intermediate_size", "block_ff_dim"])?;
        let is_moe = model_type == "lfm2_moe";
        // The MoE class has no auto-adjust: its dense layers use intermediate_size as is.
        let auto_adjust = !is_moe && f.bool(&["block_auto_adjust_ff_dim"])?.unwrap_or(true);
        let ff_dim = effective_ff_dim(
            intermediate_size,
            auto_adjust,
            Some(f.positive_f64_or(&["block_ffn_dim_multiplier"], 1.0)?),
            f.size_or(&["block_multiple_of"], 256)?,
        );
        let layer_types = match f.list("layer_types")? {
            Some(list) => list
                .iter()
                .map(|t| match t.as_str() {
                    Some("conv") => Ok(LayerKind::Conv),
                    Some("full_attention" | "attention") => Ok(LayerKind::FullAttention),
                    other => Err(format!("unknown layer type {other:?} in layer_types")),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                let idxs = f.list("full_attn_idxs")?.ok_or("neither `layer_types` nor `full_attn_idxs` is given")?;
                let idxs = idxs
                    .iter()
                    .map(|x| match x.as_u64() {
                        Some(i) if (i as usize) < num_hidden_layers => Ok(i as usize),
                        _ => Err(format!("full_attn_idxs: {x} is not a layer of {num_hidden_layers}")),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                (0..num_hidden_layers)
                    .map(|i| if idxs.contains(&i) { LayerKind::FullAttention } else { LayerKind::Conv })
                    .collect()
            }
        };
        if layer_types.len() != num_hidden_layers {
            return Err(format!("layer_types has {} entries for {num_hidden_layers} layers", layer_types.len()));
        }
        let rope_theta = match f.nested("rope_parameters")?.filter(|p| p.has("rope_theta")) {
            Some(rope) => rope.positive_f64_or(&["rope_theta"], 1e6)?,
            None => f.positive_f64_or(&["rope_theta", "theta"], 1e6)?,
        };
        let moe = if is_moe {
            let num_experts = f.size(&["num_experts"])?;
            let num_experts_per_tok = f.size(&["num_experts_per_tok"])?;
            if num_experts_per_tok > num_experts {
                return Err(format!(
                    "num_experts_per_tok {num_experts_per_tok} is more than num_experts {num_experts}"
                ));
            }
            Some(MoeConfig {
                num_experts,
                num_experts_per_tok,
                moe_intermediate_size: f.size(&["moe_intermediate_size"])?,
                num_dense_layers: f.usize(&["num_dense_layers"])?.unwrap_or(2),
                use_expert_bias: f.bool(&["use_expert_bias"])?.unwrap_or(true),
                norm_topk_prob: f.bool(&["norm_topk_prob"])?.unwrap_or(true),
                routed_scaling_factor: f.positive_f64_or(&["routed_scaling_factor"], 1.0)?,
            })
        } else {
            None
        };
        Ok(Lfm2Config {
            model_type,
            vocab_size: f.size(&["vocab_size"])?,
            hidden_size,
            intermediate_size,
            ff_dim,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim: f.size_or(&["head_dim"], hidden_size / num_attention_heads)?,
            norm_eps: f.positive_f64_or(&["norm_eps", "rms_norm_eps"], 1e-5)?,
            rope_theta,
            conv_bias: f.bool(&["conv_bias"])?.unwrap_or(false),
            conv_l_cache: f.size_or(&["conv_L_cache", "conv_l_cache"], 3)?,
            layer_types,
            tie_word_embeddings: f.bool(&["tie_word_embeddings", "tie_embedding"])?.unwrap_or(true),
            max_position_embeddings: f.size_or(&["max_position_embeddings"], 128_000)?,
            bos_token_id: f.token_id("bos_token_id")?,
            eos_token_id: f.token_id("eos_token_id")?,
            pad_token_id: f.token_id("pad_token_id")?,
            moe,
        })
    }

    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| layer >= m.num_dense_layers)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Qwen35LayerKind {
    /// Gated DeltaNet.
    LinearAttention,
    /// Gated full attention.
    FullAttention,
}

/// Qwen3.5's text tower (transformers `Qwen3_5TextConfig`), read from `text_config` of a `qwen3_5`
/// (vision-language) checkpoint or from the top level of a text-only `qwen3_5_text` one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen35Config {
    pub model_type: String,
    /// Where the text tower's tensors live: `model.language_model.` (vision-language) or `model.` (text-only).
    pub text_prefix: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each attention head that RoPE rotates (`head_dim * partial_rotary_factor`).
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub layer_types: Vec<Qwen35LayerKind>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub eos_token_id: Option<u32>,
    pub initializer_range: f64,
}

impl Qwen35Config {
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or_default().to_string();
        let top = Fields::new(v, "");
        let (text, text_prefix) = match model_type.as_str() {
            "qwen3_5" => {
                (top.nested("text_config")?.ok_or("a qwen3_5 config without `text_config`")?, "model.language_model.")
            }
            "qwen3_5_text" => (Fields::new(v, ""), "model."),
            other => return Err(unsupported(other)),
        };
        let num_hidden_layers = text.size(&["num_hidden_layers"])?;
        let num_attention_heads = text.size(&["num_attention_heads"])?;
        let num_key_value_heads = text.size_or(&["num_key_value_heads"], num_attention_heads)?;
        let linear_num_key_heads = text.size_or(&["linear_num_key_heads"], 16)?;
        let linear_num_value_heads = text.size_or(&["linear_num_value_heads"], 32)?;
        if !num_attention_heads.is_multiple_of(num_key_value_heads)
            || !linear_num_value_heads.is_multiple_of(linear_num_key_heads)
        {
            return Err(format!(
                "heads do not group: {num_attention_heads} attention / {num_key_value_heads} kv, \
                 {linear_num_value_heads} linear value / {linear_num_key_heads} linear key"
            ));
        }
        let layer_types = match text.list("layer_types")? {
            Some(list) => list
                .iter()
                .map(|t| match t.as_str() {
                    Some("linear_attention") => Ok(Qwen35LayerKind::LinearAttention),
                    Some("full_attention") => Ok(Qwen35LayerKind::FullAttention),
                    other => Err(format!("unknown layer type {other:?} in layer_types")),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                let interval = text.size_or(&["full_attention_interval"], 4)?;
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            Qwen35LayerKind::FullAttention
                        } else {
                            Qwen35LayerKind::LinearAttention
                        }
                    })
                    .collect()
            }
        };
        if layer_types.len() != num_hidden_layers {
            return Err(format!("layer_types has {} entries for {num_hidden_layers} layers", layer_types.len()));
        }
        // RoPE settings from `rope_parameters`, else from the text config's top level.
        let rope = text.nested("rope_parameters")?;
        let rope_fields = |key: &str| match rope.as_ref().filter(|p| p.has(key)) {
            Some(rope) => rope,
            None => &text,
        };
        let head_dim = text.size_or(&["head_dim"], 256)?;
        let partial = rope_fields("partial_rotary_factor").positive_f64_or(&["partial_rotary_factor"], 1.0)?;
        let rotary_dim = (head_dim as f64 * partial) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(format!("partial_rotary_factor {partial} gives {rotary_dim} rotary dims of {head_dim}"));
        }
        Ok(Qwen35Config {
            model_type,
            text_prefix: text_prefix.to_string(),
            vocab_size: text.size(&["vocab_size"])?,
            hidden_size: text.size(&["hidden_size"])?,
            intermediate_size: text.size(&["intermediate_size"])?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rotary_dim,
            rope_theta: rope_fields("rope_theta").positive_f64_or(&["rope_theta"], 1e7)?,
            rms_norm_eps: text.positive_f64_or(&["rms_norm_eps"], 1e-6)?,
            linear_num_key_heads,
            linear_num_value_heads,
            linear_key_head_dim: text.size_or(&["linear_key_head_dim"], 128)?,
            linear_value_head_dim: text.size_or(&["linear_value_head_dim"], 128)?,
            linear_conv_kernel_dim: text.size_or(&["linear_conv_kernel_dim"], 4)?,
            layer_types,
            // The composite config's flag decides for the vision-language class.
            tie_word_embeddings: first_set(top.bool(&["tie_word_embeddings"]), || text.bool(&["tie_word_embeddings"]))?
                .unwrap_or(false),
            max_position_embeddings: text.size_or(&["max_position_embeddings"], 32768)?,
            eos_token_id: first_set(text.token_id("eos_token_id"), || top.token_id("eos_token_id"))?,
            initializer_range: text.positive_f64_or(&["initializer_range"], 0.02)?,
        })
    }

    /// Whether `key` is a checkpoint tensor outside the text tower (vision tower, multi-token prediction),
    /// which kiln neither loads nor trains but carries into its exports unchanged.
    pub fn is_other_tower(&self, key: &str) -> bool {
        outside_text_tower(&self.text_prefix, key)
    }
}

/// Whether `key` (under `text_prefix`) is a K/V weight (`k_proj`, `v_proj`, `k_norm`, `v_norm`) of a layer
/// that `shares` says reuses another's keys and values.
pub fn shared_kv_key(text_prefix: &str, key: &str, shares: impl Fn(usize) -> bool) -> bool {
    let Some(rest) = key.strip_prefix(text_prefix).and_then(|k| k.strip_prefix("layers.")) else {
        return false;
    };
    let Some((layer, name)) = rest.split_once('.') else { return false };
    layer.parse::<usize>().is_ok_and(shares)
        && ["k_proj", "v_proj", "k_norm", "v_norm"].iter().any(|n| name.starts_with(&format!("self_attn.{n}.")))
}

/// Whether checkpoint tensor `key` lies outside a text tower whose tensors start with `text_prefix`.
pub fn outside_text_tower(text_prefix: &str, key: &str) -> bool {
    !(key.starts_with(text_prefix) || key == "lm_head.weight")
}

/// Gemma 4's attention layer kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gemma4LayerKind {
    /// Attention over the last `sliding_window` tokens, `head_dim` wide, default RoPE.
    SlidingAttention,
    /// Attention over the whole document, `global_head_dim` wide, proportional RoPE.
    FullAttention,
}

/// One Gemma 4 attention layer's shape: its kind, head width, kv heads, and the earlier layer whose keys and
/// values it reuses (`None`: it computes its own).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gemma4Layer {
    pub kind: Gemma4LayerKind,
    pub head_dim: usize,
    pub num_key_value_heads: usize,
    pub kv_source: Option<usize>,
    /// The MLP's width (twice `intermediate_size` on KV-sharing layers when `use_double_wide_mlp`).
    pub intermediate_size: usize,
}

/// RoPE of one layer kind: `rotary_pairs` of the `head_dim / 2` frequency slots rotate with
/// `θ^(−2j/head_dim)`; the rest are 0 (proportional RoPE; default RoPE rotates all of them).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gemma4Rope {
    pub theta: f64,
    pub partial_rotary_factor: f64,
    pub proportional: bool,
}

/// Gemma 4's text tower (transformers `Gemma4TextConfig`), read from `text_config` of a `gemma4`
/// (multimodal) checkpoint or from the top level of a text-only `gemma4_text` one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gemma4Config {
    pub model_type: String,
    /// `model.language_model.` (multimodal) or `model.` (text-only).
    pub text_prefix: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub layers: Vec<Gemma4Layer>,
    pub sliding_window: usize,
    pub sliding_rope: Gemma4Rope,
    pub full_rope: Gemma4Rope,
    /// Per-layer embeddings' width (0: none).
    pub hidden_size_per_layer_input: usize,
    pub vocab_size_per_layer_input: usize,
    pub final_logit_softcapping: Option<f64>,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub eos_token_id: Option<u32>,
    pub initializer_range: f64,
}

impl Gemma4Config {
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or_default().to_string();
        let top = Fields::new(v, "");
        let (text, text_prefix) = match model_type.as_str() {
            "gemma4" => {
                (top.nested("text_config")?.ok_or("a gemma4 config without `text_config`")?, "model.language_model.")
            }
            "gemma4_text" => (Fields::new(v, ""), "model."),
            other => return Err(unsupported(other)),
        };
        let refuse = |what: &str| Err(format!("Gemma 4 with {what} is not supported (the E-series text towers are)"));
        if text.bool(&["enable_moe_block"])? == Some(true) {
            return refuse("`enable_moe_block` (the 26B-A4B MoE)");
        }
        if text.bool(&["attention_k_eq_v"])? == Some(true) {
            return refuse("`attention_k_eq_v`");
        }
        if text.bool(&["attention_bias"])? == Some(true) {
            return refuse("`attention_bias`");
        }
        if text.str(&["use_bidirectional_attention"])? == Some("all") {
            return refuse("`use_bidirectional_attention = \"all\"`");
        }
        match text.str(&["hidden_activation"])? {
            None | Some("gelu_pytorch_tanh") => {}
            Some(other) => {
                return Err(format!("Gemma 4 hidden_activation '{other}' is not supported (gelu_pytorch_tanh is)"));
            }
        }
        let num_hidden_layers = text.size(&["num_hidden_layers"])?;
        let num_attention_heads = text.size(&["num_attention_heads"])?;
        let num_key_value_heads = text.size_or(&["num_key_value_heads"], num_attention_heads)?;
        let mut kinds =
            match text.list("layer_types")? {
                Some(list) => list
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Ok(Gemma4LayerKind::SlidingAttention),
                        Some("full_attention") => Ok(Gemma4LayerKind::FullAttention),
                        other => Err(format!("unknown layer type {other:?} in layer_types")),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
                // transformers' default: every sixth layer full.
                None => (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % 6 == 0 {
                            Gemma4LayerKind::FullAttention
                        } else {
                            Gemma4LayerKind::SlidingAttention
                        }
                    })
                    .collect(),
            };
        if kinds.len() != num_hidden_layers {
            return Err(format!("layer_types has {} entries for {num_hidden_layers} layers", kinds.len()));
        }
        // transformers forces the last layer to full attention.
        if let Some(last) = kinds.last_mut() {
            *last = Gemma4LayerKind::FullAttention;
        }
        let head_dim = text.size_or(&["head_dim"], 256)?;
        let global_head_dim = text.size_or(&["global_head_dim"], 512)?;
        let per_layer_given = text.has("per_layer_config");
        let per_layer = text.nested_or_empty("per_layer_config")?;
        let shared = text.usize(&["num_kv_shared_layers"])?.unwrap_or(0);
        if shared >= num_hidden_layers && shared > 0 {
            return Err(format!(
                "num_kv_shared_layers {shared} leaves none of {num_hidden_layers} layers to compute K/V"
            ));
        }
        let first_shared = num_hidden_layers - shared;
        let intermediate_size = text.size(&["intermediate_size"])?;
        let double_wide = text.bool(&["use_double_wide_mlp"])?.unwrap_or(false);
        let mut layers = Vec::with_capacity(num_hidden_layers);
        for (i, &kind) in kinds.iter().enumerate() {
            let overrides = per_layer.nested_or_empty(&i.to_string())?;
            let full = kind == Gemma4LayerKind::FullAttention;
            let default_head = if full && !per_layer_given { global_head_dim } else { head_dim };
            let head = overrides.usize(&["head_dim"])?.unwrap_or(default_head);
            let kv = overrides.usize(&["num_key_value_heads"])?.unwrap_or(num_key_value_heads);
            if head == 0 || !head.is_multiple_of(2) || kv == 0 || !num_attention_heads.is_multiple_of(kv) {
                return Err(format!("layer {i}: head_dim {head} with {kv} kv heads for {num_attention_heads} heads"));
            }
            let kv_source = if i < first_shared {
                None
            } else {
                let source = (0..first_shared).rev().find(|&j| kinds[j] == kind);
                Some(source.ok_or_else(|| format!("layer {i} shares K/V but no earlier layer has its kind {kind:?}"))?)
            };
            let wide = double_wide && kv_source.is_some();
            layers.push(Gemma4Layer {
                kind,
                head_dim: head,
                num_key_value_heads: kv,
                kv_source,
                intermediate_size: intermediate_size * if wide { 2 } else { 1 },
            });
        }
        let rope_parameters = text.nested_or_empty("rope_parameters")?;
        let rope = |kind: &str, theta: f64, proportional: bool| -> Result<Gemma4Rope, String> {
            let p = rope_parameters.nested_or_empty(kind)?;
            let proportional = match p.str(&["rope_type"])? {
                None => proportional,
                Some("default") => false,
                Some("proportional") => true,
                Some(other) => return Err(format!("{kind}: rope_type '{other}' is not supported")),
            };
            if p.f64(&["factor"])?.is_some_and(|f| f != 1.0) {
                return Err(format!("{kind}: a RoPE `factor` is not supported"));
            }
            Ok(Gemma4Rope {
                theta: p.positive_f64_or(&["rope_theta"], theta)?,
                partial_rotary_factor: p
                    .positive_f64_or(&["partial_rotary_factor"], if proportional { 0.25 } else { 1.0 })?,
                proportional,
            })
        };
        let ple = text.usize(&["hidden_size_per_layer_input"])?.unwrap_or(0);
        let vocab_size = text.size(&["vocab_size"])?;
        Ok(Gemma4Config {
            model_type,
            text_prefix: text_prefix.to_string(),
            vocab_size,
            hidden_size: text.size(&["hidden_size"])?,
            num_hidden_layers,
            num_attention_heads,
            layers,
            sliding_window: text.size_or(&["sliding_window"], 512)?,
            sliding_rope: rope("sliding_attention", 1e4, false)?,
            full_rope: rope("full_attention", 1e6, true)?,
            hidden_size_per_layer_input: ple,
            // 0 is how a tower without per-layer embeddings may say so.
            vocab_size_per_layer_input: text.usize(&["vocab_size_per_layer_input"])?.unwrap_or(vocab_size),
            final_logit_softcapping: text.f64(&["final_logit_softcapping"])?,
            rms_norm_eps: text.positive_f64_or(&["rms_norm_eps"], 1e-6)?,
            tie_word_embeddings: first_set(top.bool(&["tie_word_embeddings"]), || text.bool(&["tie_word_embeddings"]))?
                .unwrap_or(true),
            max_position_embeddings: text.size_or(&["max_position_embeddings"], 131_072)?,
            eos_token_id: first_set(text.token_id("eos_token_id"), || top.token_id("eos_token_id"))?,
            initializer_range: text.positive_f64_or(&["initializer_range"], 0.02)?,
        })
    }

    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        Self::from_json(&read_config_json(path)?)
            .map_err(|message| ModelError::Config { path: path.to_path_buf(), message })
    }

    /// Whether `key` is a checkpoint tensor outside the text tower (vision and audio towers and their
    /// embedders), which kiln neither loads nor trains.
    pub fn is_other_tower(&self, key: &str) -> bool {
        outside_text_tower(&self.text_prefix, key)
    }

    /// Σ over the layers of `kind` of heads × head_dim (`ModelConfig::attention_width`).
    pub fn attention_width(&self, kind: Gemma4LayerKind) -> usize {
        self.layers.iter().filter(|l| l.kind == kind).map(|l| self.num_attention_heads * l.head_dim).sum()
    }

    /// Whether `key` is a K/V weight of a KV-sharing layer, which such a layer never reads (a checkpoint may
    /// still hold them; transformers ignores them on load).
    pub fn is_unused_kv(&self, key: &str) -> bool {
        shared_kv_key(&self.text_prefix, key, |i| self.layers.get(i).is_some_and(|l| l.kv_source.is_some()))
    }
}

/// The architecture of a checkpoint, picked by its `model_type`.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    Lfm2(Lfm2Config),
    Qwen35(Qwen35Config),
    Gemma4(Gemma4Config),
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        Self::from_json(&read_config_json(path)?)
            .map_err(|message| ModelError::Config { path: path.to_path_buf(), message })
    }

    pub fn from_json(v: &Value) -> Result<Self, String> {
        match v.get("model_type").and_then(Value::as_str).unwrap_or_default() {
            t if LFM2_TYPES.contains(&t) => Lfm2Config::from_json(v).map(ModelConfig::Lfm2),
            "gemma4" | "gemma4_text" => Gemma4Config::from_json(v).map(ModelConfig::Gemma4),
            _ => Qwen35Config::from_json(v).map(ModelConfig::Qwen35),
        }
    }

    pub fn model_type(&self) -> &str {
        match self {
            ModelConfig::Lfm2(c) => &c.model_type,
            ModelConfig::Qwen35(c) => &c.model_type,
            ModelConfig::Gemma4(c) => &c.model_type,
        }
    }

    /// The architecture a pipeline model config names (`lfm2`, `lfm2_moe`, `qwen3_5`, `gemma4`): a text
    /// tower's model_type is its multimodal checkpoint's.
    pub fn architecture(&self) -> &str {
        self.model_type().trim_end_matches("_text")
    }

    /// Whether its MoE layers route with an expert bias (LFM2-MoE's `use_expert_bias`), the one
    /// `train.expert_bias_rate` moves.
    pub fn has_expert_bias(&self) -> bool {
        matches!(self, ModelConfig::Lfm2(c) if c.moe.as_ref().is_some_and(|m| m.use_expert_bias))
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Lfm2(c) => c.vocab_size,
            ModelConfig::Qwen35(c) => c.vocab_size,
            ModelConfig::Gemma4(c) => c.vocab_size,
        }
    }

    pub fn max_position_embeddings(&self) -> usize {
        match self {
            ModelConfig::Lfm2(c) => c.max_position_embeddings,
            ModelConfig::Qwen35(c) => c.max_position_embeddings,
            ModelConfig::Gemma4(c) => c.max_position_embeddings,
        }
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        match self {
            ModelConfig::Lfm2(c) => c.eos_token_id,
            ModelConfig::Qwen35(c) => c.eos_token_id,
            ModelConfig::Gemma4(c) => c.eos_token_id,
        }
    }

    /// Whether a checkpoint tensor is one the model does not load: another tower's (Qwen3.5's vision tower and
    /// mtp head, Gemma 4's vision and audio towers) or the unread K/V weights of Gemma 4's KV-sharing layers
    /// (`CausalLm::is_carried` of the loaded model).
    pub fn is_carried(&self, key: &str) -> bool {
        match self {
            ModelConfig::Lfm2(_) => false,
            ModelConfig::Qwen35(c) => c.is_other_tower(key),
            ModelConfig::Gemma4(c) => c.is_other_tower(key) || c.is_unused_kv(key),
        }
    }

    /// The share of a parameter's values that each token multiplies through, for P in the MFU formula's
    /// `6 · P · T`: a routed expert counts `top_k / num_experts` (a token runs through that many of them);
    /// an input embedding table is a lookup and counts 0, or 1 when it is also the tied LM head; Gemma 4's
    /// per-layer embedding table is a lookup too (its projection is a matmul and counts), and the router's
    /// `expert_bias` only ranks experts (transformers keeps it as a buffer, outside its parameters);
    /// everything else counts 1. `key` is the checkpoint name, which transformers' parameter names share
    /// (tests/bench/train_python.py applies the same rule to the PyTorch model).
    pub fn flops_share(&self, key: &str) -> f64 {
        let tied = match self {
            ModelConfig::Lfm2(c) => c.tie_word_embeddings,
            ModelConfig::Qwen35(c) => c.tie_word_embeddings,
            ModelConfig::Gemma4(c) => c.tie_word_embeddings,
        };
        let lookup = key.ends_with("embed_tokens_per_layer.weight") || key.ends_with(".expert_bias");
        if lookup || (key.ends_with("embed_tokens.weight") && !tied) {
            return 0.0;
        }
        match self {
            ModelConfig::Lfm2(Lfm2Config { moe: Some(moe), .. }) if key.contains(".experts.") => {
                moe.num_experts_per_tok as f64 / moe.num_experts as f64
            }
            _ => 1.0,
        }
    }

    /// Σ over softmax-attention layers of heads × head_dim: the width in the attention term of the MFU
    /// formula (`12 · width · seq` FLOPs per token). Conv and DeltaNet layers are linear in the sequence and
    /// counted by `6 · params` alone; Gemma 4's sliding-window layers see at most `sliding_window` keys and
    /// are counted in `sliding_attention_width`.
    pub fn attention_width(&self) -> usize {
        match self {
            ModelConfig::Lfm2(c) => {
                let layers = c.layer_types.iter().filter(|k| matches!(k, LayerKind::FullAttention)).count();
                layers * c.num_attention_heads * c.head_dim
            }
            ModelConfig::Qwen35(c) => {
                let layers = c.layer_types.iter().filter(|k| matches!(k, Qwen35LayerKind::FullAttention)).count();
                layers * c.num_attention_heads * c.head_dim
            }
            ModelConfig::Gemma4(c) => c.attention_width(Gemma4LayerKind::FullAttention),
        }
    }

    /// Σ over sliding-window attention layers of heads × head_dim, and their window: their attention term is
    /// `12 · width · min(seq, window)` FLOPs per token.
    pub fn sliding_attention_width(&self) -> Option<(usize, usize)> {
        match self {
            ModelConfig::Gemma4(c) => Some((c.attention_width(Gemma4LayerKind::SlidingAttention), c.sliding_window)),
            ModelConfig::Lfm2(_) | ModelConfig::Qwen35(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ffn_width_follows_the_auto_adjust_rule() {
        assert_eq!(effective_ff_dim(6656, true, Some(1.0), 256), 4608);
        assert_eq!(effective_ff_dim(12288, true, Some(1.0), 256), 8192);
        assert_eq!(effective_ff_dim(7168, false, Some(1.0), 256), 7168);
    }

    #[test]
    fn legacy_keys_and_errors() {
        let legacy = json!({"model_type": "lfm2", "vocab_size": 65536, "hidden_size": 1024, "num_hidden_layers": 4,
            "num_attention_heads": 16, "num_key_value_heads": 8, "block_ff_dim": 6656, "full_attn_idxs": [2],
            "theta": 1000000.0, "tie_embedding": true, "eos_token_id": 7});
        let c = Lfm2Config::from_json(&legacy).unwrap();
        assert_eq!(c.ff_dim, 4608);
        assert_eq!(c.layer_types, [LayerKind::Conv, LayerKind::Conv, LayerKind::FullAttention, LayerKind::Conv]);
        assert_eq!((c.head_dim, c.rope_theta, c.eos_token_id), (64, 1e6, Some(7)));
        let err = Lfm2Config::from_json(&json!({"model_type": "llama"})).unwrap_err();
        assert!(err.contains("'llama' is not supported") && err.contains("lfm2, lfm2_moe"), "{err}");
        let err = ModelConfig::from_json(&json!({"model_type": "llama"})).unwrap_err();
        assert!(err.contains("'llama' is not supported") && err.contains("qwen3_5"), "{err}");
    }

    /// A key set to the wrong type, or a size set to 0, is named in the error; before, the default stood in
    /// for it silently (or a division by zero panicked).
    #[test]
    fn wrong_types_and_zero_sizes_are_refused_by_name() {
        let lfm2 = || {
            json!({"model_type": "lfm2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
                "layer_types": ["conv", "full_attention"], "rope_parameters": {"rope_theta": 1e6}})
        };
        Lfm2Config::from_json(&lfm2()).unwrap();
        for (key, value, expected) in [
            ("num_attention_heads", json!(0), "`num_attention_heads` is 0"),
            ("num_key_value_heads", json!(0), "`num_key_value_heads` is 0"),
            ("num_key_value_heads", json!("2"), "`num_key_value_heads` is \"2\", not a non-negative integer"),
            ("hidden_size", json!("x"), "`hidden_size` is \"x\", not a non-negative integer"),
            ("hidden_size", json!(-64), "`hidden_size` is -64"),
            ("conv_L_cache", json!(0), "`conv_L_cache` is 0"),
            ("tie_word_embeddings", json!("yes"), "`tie_word_embeddings` is \"yes\", not true or false"),
            ("norm_eps", json!("1e-5"), "`norm_eps` is \"1e-5\", not a number"),
            ("norm_eps", json!(0.0), "`norm_eps` is 0: it must be a positive number"),
            ("rope_parameters", json!({"rope_theta": "x"}), "`rope_parameters.rope_theta` is \"x\""),
            ("rope_parameters", json!(5), "`rope_parameters` is 5, not an object"),
            ("eos_token_id", json!("7"), "`eos_token_id` is \"7\", not a token id"),
            ("layer_types", json!("conv"), "`layer_types` is \"conv\", not a list"),
        ] {
            let mut v = lfm2();
            v[key] = value;
            let err = Lfm2Config::from_json(&v).unwrap_err();
            assert!(err.contains(expected), "{key}: {err}");
        }
        let mut v = lfm2();
        v.as_object_mut().unwrap().remove("layer_types");
        v["full_attn_idxs"] = json!([1, 7]);
        assert!(Lfm2Config::from_json(&v).unwrap_err().contains("full_attn_idxs: 7 is not a layer of 2"));
        // Absent and null keys still take their defaults; a list of eos ids gives its first.
        let mut v = lfm2();
        v["head_dim"] = Value::Null;
        v["eos_token_id"] = json!([7, 2]);
        let c = Lfm2Config::from_json(&v).unwrap();
        assert_eq!((c.head_dim, c.eos_token_id, c.conv_l_cache, c.norm_eps), (16, Some(7), 3, 1e-5));

        let mut v = gemma4_e4b();
        v["text_config"]["rope_parameters"]["full_attention"]["rope_theta"] = json!("1e6");
        let err = Gemma4Config::from_json(&v).unwrap_err();
        assert!(err.contains("`text_config.rope_parameters.full_attention.rope_theta` is \"1e6\""), "{err}");
        let mut v = gemma4_e4b();
        v["text_config"]["sliding_window"] = json!(0);
        assert!(Gemma4Config::from_json(&v).unwrap_err().contains("`text_config.sliding_window` is 0"));
    }

    #[test]
    fn qwen3_5_reads_its_text_config() {
        // Qwen3.5-0.8B's shapes; layer types from the interval rule when not listed.
        let v = json!({"model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": {
            "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
            "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 16, "full_attention_interval": 4,
            "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
            "eos_token_id": 248044}});
        let ModelConfig::Qwen35(c) = ModelConfig::from_json(&v).unwrap() else { panic!("not qwen") };
        assert_eq!((c.rotary_dim, c.rope_theta, c.text_prefix.as_str()), (64, 1e7, "model.language_model."));
        let full: Vec<usize> = (0..24).filter(|&i| c.layer_types[i] == Qwen35LayerKind::FullAttention).collect();
        assert_eq!(full, [3, 7, 11, 15, 19, 23]);
        assert!(c.tie_word_embeddings && c.eos_token_id == Some(248044));
        assert!(c.is_other_tower("model.visual.blocks.0.attn.qkv.weight") && c.is_other_tower("mtp.fc.weight"));
        assert!(!c.is_other_tower("model.language_model.norm.weight") && !c.is_other_tower("lm_head.weight"));
        assert_eq!(ModelConfig::Qwen35(c).attention_width(), 6 * 8 * 256);
        let err = ModelConfig::from_json(&json!({"model_type": "qwen3_5"})).unwrap_err();
        assert!(err.contains("text_config"), "{err}");
        let mut wrong = v.clone();
        wrong["text_config"]["linear_num_key_heads"] = json!(0);
        let err = ModelConfig::from_json(&wrong).unwrap_err();
        assert!(err.contains("`text_config.linear_num_key_heads` is 0"), "{err}");
        let mut wrong = v;
        wrong["text_config"]["rope_parameters"]["partial_rotary_factor"] = json!("0.25");
        let err = ModelConfig::from_json(&wrong).unwrap_err();
        assert!(err.contains("`text_config.rope_parameters.partial_rotary_factor` is \"0.25\""), "{err}");
    }

    /// Gemma 4 E4B's text config as the Hub serializes it (`global_head_dim`, no `per_layer_config`).
    fn gemma4_e4b() -> Value {
        json!({"model_type": "gemma4", "text_config": {
            "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2560, "num_hidden_layers": 42,
            "intermediate_size": 10240, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "global_head_dim": 512, "sliding_window": 512, "num_kv_shared_layers": 18,
            "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144, "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh", "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}}})
    }

    #[test]
    fn gemma4_reads_its_text_config_and_refuses_what_it_lacks() {
        let c = Gemma4Config::from_json(&gemma4_e4b()).unwrap();
        let full: Vec<usize> = (0..42).filter(|&i| c.layers[i].kind == Gemma4LayerKind::FullAttention).collect();
        assert_eq!(full, [5, 11, 17, 23, 29, 35, 41]);
        assert!(
            c.layers.iter().all(|l| l.head_dim == if l.kind == Gemma4LayerKind::FullAttention { 512 } else { 256 })
        );
        // Layers 24.. reuse the last earlier layer of their kind: 22 (sliding) and 23 (full).
        assert!(c.layers[..24].iter().all(|l| l.kv_source.is_none()));
        assert!(
            c.layers[24..]
                .iter()
                .all(|l| l.kv_source == Some(if l.kind == Gemma4LayerKind::FullAttention { 23 } else { 22 }))
        );
        assert!(c.layers.iter().all(|l| l.intermediate_size == 10240), "E4B's MLPs are not double-wide");
        assert!(c.is_unused_kv("model.language_model.layers.30.self_attn.k_proj.weight"));
        assert!(!c.is_unused_kv("model.language_model.layers.3.self_attn.k_proj.weight"));
        assert!(!c.is_unused_kv("model.language_model.layers.30.self_attn.q_proj.weight"));
        assert!(c.is_other_tower("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"));
        assert!(c.is_other_tower("model.embed_audio.embedding_projection.weight"));
        assert_eq!((c.tie_word_embeddings, c.final_logit_softcapping), (true, Some(30.0)));

        for (key, value, what) in [
            ("enable_moe_block", json!(true), "enable_moe_block"),
            ("attention_k_eq_v", json!(true), "attention_k_eq_v"),
            ("hidden_activation", json!("silu"), "hidden_activation"),
            ("num_kv_shared_layers", json!(42), "num_kv_shared_layers"),
        ] {
            let mut v = gemma4_e4b();
            v["text_config"][key] = value;
            let err = Gemma4Config::from_json(&v).unwrap_err();
            assert!(err.contains(what), "{key}: {err}");
        }
        let mut v = gemma4_e4b();
        v["text_config"]["rope_parameters"]["full_attention"]["rope_type"] = json!("yarn");
        assert!(Gemma4Config::from_json(&v).unwrap_err().contains("yarn"));
        let config = ModelConfig::from_json(&gemma4_e4b()).unwrap();
        assert_eq!(config.attention_width(), 7 * 8 * 512);
        assert_eq!(config.sliding_attention_width(), Some((35 * 8 * 256, 512)));
    }

    /// The GPU benchmark's shapes (tests/bench/shapes/) are read on a machine that costs by the minute: each
    /// must parse here, and the Gemma 4 one must be E4B's text tower as the Hub's config describes it.
    #[test]
    fn every_benchmark_shape_parses_and_gemma_4_e4b_is_the_hubs() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bench/shapes");
        let mut shapes: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        shapes.sort();
        let names: Vec<String> = shapes.iter().map(|p| p.file_stem().unwrap().to_string_lossy().into()).collect();
        assert_eq!(names, ["gemma-4-e4b", "lfm2-350m", "lfm2.5-1.2b", "lfm2.5-8b-a1b", "qwen3.5-0.8b"]);
        for path in &shapes {
            ModelConfig::from_file(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        let ModelConfig::Gemma4(shape) = ModelConfig::from_file(&dir.join("gemma-4-e4b.json")).unwrap() else {
            panic!("gemma-4-e4b.json is not a Gemma 4 config")
        };
        let hub = Gemma4Config::from_json(&gemma4_e4b()).unwrap();
        // The shape is the bare text model (`gemma4_text`, no `model.language_model.` prefix) with its token ids.
        assert_eq!((shape.text_prefix.as_str(), shape.eos_token_id), ("model.", Some(1)));
        let text_model = Gemma4Config {
            model_type: shape.model_type.clone(),
            text_prefix: shape.text_prefix.clone(),
            eos_token_id: shape.eos_token_id,
            ..hub
        };
        assert_eq!(shape, text_model);
    }

    /// The Hub's LFM2-350M config.json (../shared, transformers 4.54's legacy keys: `block_ff_dim`,
    /// `full_attn_idxs`, top-level `rope_theta`) reads as the benchmark's LFM2-350M shape.
    #[test]
    fn the_hubs_lfm2_350m_config_reads_as_the_benchmark_shape() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let hub = Lfm2Config::from_file(&root.join("../shared/tokenizers/lfm2-350m-config/config.json")).unwrap();
        let full: Vec<usize> = (0..16).filter(|&i| hub.layer_types[i] == LayerKind::FullAttention).collect();
        assert_eq!(full, [2, 5, 8, 10, 12, 14]);
        assert_eq!((hub.ff_dim, hub.head_dim, hub.rope_theta, hub.eos_token_id), (4608, 64, 1e6, Some(7)));
        let shape = Lfm2Config::from_file(&root.join("tests/bench/shapes/lfm2-350m.json")).unwrap();
        assert_eq!(Lfm2Config { intermediate_size: shape.intermediate_size, ..hub }, shape);
    }

    /// MFU's parameter count by checkpoint name: LFM2.5-8B-A1B routes a token through 4 of its 32 experts;
    /// Gemma 4's per-layer table and an untied input embedding are lookups; a tied one is also the LM head.
    #[test]
    fn flops_share_counts_the_active_experts_and_the_matmul_tables() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bench/shapes");
        let moe = ModelConfig::from_file(&dir.join("lfm2.5-8b-a1b.json")).unwrap();
        assert_eq!(moe.flops_share("model.layers.3.feed_forward.experts.17.w1.weight"), 4.0 / 32.0);
        for key in ["model.layers.3.feed_forward.gate.weight", "model.layers.0.feed_forward.w1.weight"] {
            assert_eq!(moe.flops_share(key), 1.0, "{key}");
        }
        assert_eq!(moe.flops_share("model.embed_tokens.weight"), 1.0);
        assert_eq!(moe.flops_share("model.layers.3.feed_forward.expert_bias"), 0.0);
        let gemma = ModelConfig::from_file(&dir.join("gemma-4-e4b.json")).unwrap();
        assert_eq!(gemma.flops_share("model.embed_tokens_per_layer.weight"), 0.0);
        assert_eq!(gemma.flops_share("model.per_layer_model_projection.weight"), 1.0);
        assert_eq!(gemma.flops_share("model.embed_tokens.weight"), 1.0);
        let ModelConfig::Lfm2(dense) = ModelConfig::from_file(&dir.join("lfm2-350m.json")).unwrap() else {
            panic!("lfm2-350m.json is not an LFM2 config")
        };
        let untied = ModelConfig::Lfm2(Lfm2Config { tie_word_embeddings: false, ..dense });
        assert_eq!(untied.flops_share("model.embed_tokens.weight"), 0.0);
        assert_eq!(untied.flops_share("lm_head.weight"), 1.0);
        assert_eq!(untied.flops_share("model.layers.0.feed_forward.w1.weight"), 1.0);
    }
}
