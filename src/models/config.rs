//! Model configs parsed from a checkpoint's `config.json`, with every legacy alias the released LFM2
//! checkpoints use, and the derived quantities (effective FFN width, layer kinds) the weights depend on.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ModelError;

pub const SUPPORTED: &[&str] = &["lfm2", "lfm2_moe"];

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

fn get<'a>(v: &'a Value, keys: &[&str]) -> Option<&'a Value> {
    keys.iter().find_map(|k| v.get(*k).filter(|x| !x.is_null()))
}

fn usize_of(v: &Value, keys: &[&str]) -> Option<usize> {
    get(v, keys).and_then(Value::as_u64).map(|x| x as usize)
}

fn f64_of(v: &Value, keys: &[&str]) -> Option<f64> {
    get(v, keys).and_then(Value::as_f64)
}

fn bool_of(v: &Value, keys: &[&str]) -> Option<bool> {
    get(v, keys).and_then(Value::as_bool)
}

fn token_id(v: &Value, key: &str) -> Option<u32> {
    match v.get(key)? {
        Value::Number(n) => n.as_u64().map(|x| x as u32),
        Value::Array(a) => a.first()?.as_u64().map(|x| x as u32),
        _ => None,
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

impl Lfm2Config {
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config { path: path.to_path_buf(), message: e.to_string() })?;
        Self::from_json(&v).map_err(|message| ModelError::Config { path: path.to_path_buf(), message })
    }

    pub fn from_json(v: &Value) -> Result<Self, String> {
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or_default().to_string();
        if !SUPPORTED.contains(&model_type.as_str()) {
            return Err(format!("model_type '{model_type}' is not supported; supported: {}", SUPPORTED.join(", ")));
        }
        let need = |keys: &[&str]| usize_of(v, keys).ok_or_else(|| format!("missing `{}`", keys[0]));
        let hidden_size = need(&["hidden_size"])?;
        let num_hidden_layers = need(&["num_hidden_layers"])?;
        let num_attention_heads = need(&["num_attention_heads"])?;
        let num_key_value_heads = usize_of(v, &["num_key_value_heads"]).unwrap_or(num_attention_heads);
        if hidden_size % num_attention_heads != 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(format!(
                "hidden_size {hidden_size}, num_attention_heads {num_attention_heads} and num_key_value_heads {num_key_value_heads} do not divide"
            ));
        }
        let intermediate_size = need(&["intermediate_size", "block_ff_dim"])?;
        let is_moe = model_type == "lfm2_moe";
        // The MoE class has no auto-adjust: its dense layers use intermediate_size as is.
        let auto_adjust = !is_moe && bool_of(v, &["block_auto_adjust_ff_dim"]).unwrap_or(true);
        let ff_dim = effective_ff_dim(
            intermediate_size,
            auto_adjust,
            Some(f64_of(v, &["block_ffn_dim_multiplier"]).unwrap_or(1.0)),
            usize_of(v, &["block_multiple_of"]).unwrap_or(256),
        );
        let layer_types = match v.get("layer_types").and_then(Value::as_array) {
            Some(list) => list
                .iter()
                .map(|t| match t.as_str() {
                    Some("conv") => Ok(LayerKind::Conv),
                    Some("full_attention" | "attention") => Ok(LayerKind::FullAttention),
                    other => Err(format!("unknown layer type {other:?} in layer_types")),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                let idxs: Vec<usize> = v
                    .get("full_attn_idxs")
                    .and_then(Value::as_array)
                    .ok_or("neither `layer_types` nor `full_attn_idxs` is given")?
                    .iter()
                    .filter_map(|x| x.as_u64().map(|i| i as usize))
                    .collect();
                (0..num_hidden_layers)
                    .map(|i| if idxs.contains(&i) { LayerKind::FullAttention } else { LayerKind::Conv })
                    .collect()
            }
        };
        if layer_types.len() != num_hidden_layers {
            return Err(format!("layer_types has {} entries for {num_hidden_layers} layers", layer_types.len()));
        }
        let rope_theta = v
            .get("rope_parameters")
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .or_else(|| f64_of(v, &["rope_theta", "theta"]))
            .unwrap_or(1e6);
        let moe = if is_moe {
            Some(MoeConfig {
                num_experts: need(&["num_experts"])?,
                num_experts_per_tok: need(&["num_experts_per_tok"])?,
                moe_intermediate_size: need(&["moe_intermediate_size"])?,
                num_dense_layers: usize_of(v, &["num_dense_layers"]).unwrap_or(2),
                use_expert_bias: bool_of(v, &["use_expert_bias"]).unwrap_or(true),
                norm_topk_prob: bool_of(v, &["norm_topk_prob"]).unwrap_or(true),
                routed_scaling_factor: f64_of(v, &["routed_scaling_factor"]).unwrap_or(1.0),
            })
        } else {
            None
        };
        Ok(Lfm2Config {
            model_type,
            vocab_size: need(&["vocab_size"])?,
            hidden_size,
            intermediate_size,
            ff_dim,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim: usize_of(v, &["head_dim"]).unwrap_or(hidden_size / num_attention_heads),
            norm_eps: f64_of(v, &["norm_eps", "rms_norm_eps"]).unwrap_or(1e-5),
            rope_theta,
            conv_bias: bool_of(v, &["conv_bias"]).unwrap_or(false),
            conv_l_cache: usize_of(v, &["conv_L_cache", "conv_l_cache"]).unwrap_or(3),
            layer_types,
            tie_word_embeddings: bool_of(v, &["tie_word_embeddings", "tie_embedding"]).unwrap_or(true),
            max_position_embeddings: usize_of(v, &["max_position_embeddings"]).unwrap_or(128_000),
            bos_token_id: token_id(v, "bos_token_id"),
            eos_token_id: token_id(v, "eos_token_id"),
            pad_token_id: token_id(v, "pad_token_id"),
            moe,
        })
    }

    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| layer >= m.num_dense_layers)
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
    }
}
