//! The model zoo: HF config parsing, safetensors import and export, and one module per architecture (LFM2
//! and LFM2-MoE in `lfm2`, Qwen3.5 in `qwen3_5` with its DeltaNet scan in `deltanet`; their full-sequence
//! attention in `attention`, the MoE's grouped expert matmul in `experts` and its routing load in `routing`,
//! the ops with hand-written backward passes in `ops`, and the CPU backend's loop forms of the attention and
//! the scan in `cpu_attention` and `cpu_deltanet`, its single-pass element-wise ops in `cpu_elementwise`; the
//! CubeCL backends' kernels are in `crate::kernels`), behind `CausalLm`.
//! Knows nothing of datasets, training or the CLI.

pub mod attention;
pub mod causal_lm;
pub mod config;
pub mod cpu_attention;
pub mod cpu_deltanet;
pub mod cpu_elementwise;
pub mod decode;
pub mod deltanet;
pub mod experts;
pub mod gemma4;
pub mod hf;
mod host_slices;
pub mod layers;
pub mod lfm2;
pub mod ops;
pub mod qwen3_5;
pub mod routing;
pub mod sampling;
pub mod weights;

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;

pub use attention::DocumentAttention;
pub use causal_lm::{
    CausalLm, CausalLmCache, checkpoint_carried_bytes, checkpoint_tensor_sizes, load_model, random_model,
};
pub use config::{Gemma4Config, LayerKind, Lfm2Config, ModelConfig, Qwen35Config, Qwen35LayerKind};
pub use gemma4::Gemma4Model;
pub use layers::SequenceLayout;
pub use lfm2::Lfm2Model;
pub use ops::{ModelBackend, set_reference_ops};
pub use qwen3_5::Qwen35Model;
pub use weights::{RandomInit, TensorSource, WeightStore};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Weights { path: PathBuf, message: String },
}

impl ModelError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        ModelError::Io { path: path.to_path_buf(), source }
    }
}

/// Writes a seeded random-init checkpoint for `from/config.json` (N(0, initializer_range), the
/// architecture's constants for norms and the like) into `out`, with the tokenizer and template files of
/// `from` beside it; returns the model type and parameter count.
pub fn init_random_checkpoint(
    from: &Path,
    out: &Path,
    seed: u64,
    dtype: hf::ExportDtype,
) -> Result<(String, usize), ModelError> {
    let config_path = from.join("config.json");
    let config = ModelConfig::from_file(&config_path)?;
    let text = std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
    let raw: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let std = raw
        .get("initializer_range")
        .or_else(|| raw.get("text_config").and_then(|t| t.get("initializer_range")))
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(0.02);
    let model = random_model::<crate::backend::Cpu>(&config, seed, std, &Default::default())?;
    let params = burn::module::Module::num_params(&model);
    model.export(from, out, dtype, hf::SHARD_BYTES)?;
    Ok((config.model_type().to_string(), params))
}

/// Loads an LFM2 / LFM2-MoE checkpoint directory (config.json + safetensors).
pub fn load_lfm2<B: Backend>(dir: &Path, device: &B::Device) -> Result<(Lfm2Config, Lfm2Model<B>), ModelError> {
    let config = Lfm2Config::from_file(&dir.join("config.json"))?;
    let store = WeightStore::open(dir)?;
    let model = Lfm2Model::from_source(&config, &store, device)?;
    Ok((config, model))
}
