//! Full fine-tuning on burn: the loop (seeded epochs of shard rows, cross-entropy on supervised tokens in f32
//! normalized by the whole optimizer step's supervised count, gradient accumulation, global-norm clipping,
//! AdamW, warmup + decay), per-epoch HF exports, exact resume, and per-step metrics.

pub mod data;
pub mod optim;
pub mod schedule;
pub mod trainer;

use std::path::PathBuf;

pub use trainer::{TrainConfig, TrainSummary, train};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{path}: {message}")]
    Data { path: PathBuf, message: String },
    #[error(transparent)]
    Model(#[from] crate::models::ModelError),
    #[error("{path}: {message}")]
    State { path: PathBuf, message: String },
    #[error(
        "non-finite loss ({loss}) at step {step} (epoch {epoch}), micro-batch {micro} with samples {samples}; the last good checkpoint is left as it was"
    )]
    NonFinite { loss: f32, step: usize, epoch: usize, micro: usize, samples: String },
    #[error("{0}")]
    Config(String),
}
