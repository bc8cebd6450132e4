//! The model zoo: HF config parsing, safetensors import, and one module per architecture (LFM2 and
//! LFM2-MoE so far). Knows nothing of datasets, training or the CLI.

pub mod config;
pub mod decode;
pub mod hf;
pub mod layers;
pub mod lfm2;
pub mod weights;

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;

pub use config::{LayerKind, Lfm2Config};
pub use layers::SequenceLayout;
pub use lfm2::Lfm2Model;
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

/// Loads an LFM2 / LFM2-MoE checkpoint directory (config.json + safetensors).
pub fn load_lfm2<B: Backend>(dir: &Path, device: &B::Device) -> Result<(Lfm2Config, Lfm2Model<B>), ModelError> {
    let config = Lfm2Config::from_file(&dir.join("config.json"))?;
    let store = WeightStore::open(dir)?;
    let model = Lfm2Model::from_source(&config, &store, device)?;
    Ok((config, model))
}
