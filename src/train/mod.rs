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
    #[error("{0}")]
    Device(String),
}

/// The message for `--device cuda` in a build without the `cuda` feature, and for unknown devices.
pub fn device_error(device: &str) -> String {
    if device == "cuda" {
        "this kiln was built without CUDA: rebuild with `cargo build --release --features cuda` (make does when nvcc or a CUDA driver is present)".into()
    } else {
        format!("unknown device '{device}': use cpu or cuda")
    }
}

/// `train` on the named device (`cpu`, or `cuda` in a CUDA build), optionally with activation checkpointing.
#[allow(clippy::too_many_arguments)]
pub fn train_on_device(
    device: &str,
    activation_checkpointing: bool,
    cfg: &TrainConfig,
    model_dir: &std::path::Path,
    data_dir: &std::path::Path,
    run_dir: &std::path::Path,
    resume: bool,
    stop: &std::sync::atomic::AtomicBool,
    halt_after: Option<usize>,
    show_progress: bool,
) -> Result<TrainSummary, TrainError> {
    macro_rules! go {
        ($backend:ty) => {
            train::<$backend>(
                cfg,
                model_dir,
                data_dir,
                run_dir,
                resume,
                stop,
                halt_after,
                show_progress,
                &Default::default(),
            )
            .map(|(summary, _)| summary)
        };
    }
    match (device, activation_checkpointing) {
        ("cpu", false) => go!(crate::backend::CpuTrain),
        ("cpu", true) => go!(crate::backend::CpuTrainCheckpointed),
        #[cfg(feature = "cuda")]
        ("cuda", false) => go!(crate::backend::GpuTrain),
        #[cfg(feature = "cuda")]
        ("cuda", true) => go!(crate::backend::GpuTrainCheckpointed),
        (other, _) => Err(TrainError::Device(device_error(other))),
    }
}
