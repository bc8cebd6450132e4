//! Full fine-tuning on burn: the loop (seeded epochs of shard rows, cross-entropy on supervised tokens in f32
//! normalized by the whole optimizer step's supervised count, gradient accumulation, global-norm clipping,
//! AdamW, warmup + decay), per-epoch HF exports, exact resume, and per-step metrics (JSON lines and TensorBoard
//! events); on one device or as data-parallel replicas on several (`replicas`).

pub mod bench;
pub mod data;
pub mod disk;
pub mod linear_ce;
pub mod optim;
pub mod quant8;
pub mod replicas;
pub mod rounding;
pub mod schedule;
pub mod state;
pub mod step;
pub mod tensorboard;
pub mod trainer;
pub mod validation;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

pub use trainer::{Precision, TrainConfig, TrainSummary, train};

/// Ctrl-C as kiln takes it. While a training runs, a stop waits for the end of the current step, where the
/// state is saved; anywhere else (a download, the data, an eval) there is nothing a stop would save, so the
/// process may end at once, and a stage cut short runs again on the next run.
#[derive(Debug, Default)]
pub struct StopRequest {
    requested: AtomicBool,
    training: AtomicBool,
}

impl StopRequest {
    /// Runs `train` with stops deferred to it: it watches the flag it is given.
    pub fn defer<T>(&self, train: impl FnOnce(&AtomicBool) -> T) -> T {
        self.training.store(true, Ordering::SeqCst);
        let out = train(&self.requested);
        self.training.store(false, Ordering::SeqCst);
        out
    }

    /// A Ctrl-C: true when a training takes it (it stops after its step), false when the process should end
    /// now (no training runs, or this is the second Ctrl-C).
    pub fn request(&self) -> bool {
        self.training.load(Ordering::SeqCst) && !self.requested.swap(true, Ordering::SeqCst)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{path}: {message}")]
    Data { path: PathBuf, message: String },
    #[error(transparent)]
    Model(#[from] crate::models::ModelError),
    /// A token shard that cannot be read (its error names the file).
    #[error(transparent)]
    Shards(#[from] crate::tokens::TokenError),
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
    /// The weights, gradients and optimizer state alone outgrow the device's memory
    /// (`optim::tensors_fit_device`, checked before the model loads or the first step).
    #[error("{0}")]
    OutOfMemory(String),
    /// The exports and states still to be written outgrow the run folder's free disk space (`disk`,
    /// checked before the model loads).
    #[error("{0}")]
    NoDiskSpace(String),
}

/// Runs `$go!(Backend)` with the autodiff backend for `$device` (`&str`), `$precision` (resolved) and
/// activation checkpointing (`bool`); an unknown or uncompiled device is a `TrainError::Device`. On the CPU
/// the parameters are cast to the precision on Flex; on CUDA the backend's default dtype is the precision,
/// so every tensor the model builds is born in it, and `KILN_CUDA_FUSION=off` picks the unfused backend.
macro_rules! with_train_backend {
    ($device:expr, $precision:expr, $checkpointing:expr, $go:ident) => {{
        #[cfg(feature = "cuda")]
        let bf16 = $precision == $crate::train::Precision::Bf16;
        match ($device, $precision) {
            (device, $crate::train::Precision::F16) if device != "vulkan" => {
                Err($crate::train::TrainError::Device($crate::train::F16_ONLY_ON_VULKAN.into()))
            }
            ("cpu", _) if $checkpointing => $go!($crate::backend::CpuTrainCheckpointed),
            ("cpu", _) => $go!($crate::backend::CpuTrain),
            #[cfg(feature = "cuda")]
            ("cuda", _) => match ($crate::backend::cuda_choice(bf16), bf16, $checkpointing) {
                (Err(why), _, _) => Err($crate::train::TrainError::Device(why)),
                (Ok(true), true, false) => $go!($crate::backend::GpuTrain),
                (Ok(true), true, true) => $go!($crate::backend::GpuTrainCheckpointed),
                (Ok(true), false, false) => $go!($crate::backend::GpuTrainF32),
                (Ok(true), false, true) => $go!($crate::backend::GpuTrainF32Checkpointed),
                (Ok(false), _, false) => $go!($crate::backend::GpuTrainUnfused),
                (Ok(false), _, true) => $go!($crate::backend::GpuTrainUnfusedCheckpointed),
            },
            #[cfg(feature = "vulkan")]
            ("vulkan", precision) => match (
                $crate::backend::vulkan_ready(precision == $crate::train::Precision::F16),
                precision,
                $checkpointing,
            ) {
                (Err(why), _, _) => Err($crate::train::TrainError::Device(why)),
                (Ok(()), $crate::train::Precision::Bf16, _) => Err($crate::train::TrainError::Device(
                    "the vulkan device has no bf16: train in f32, or in f16 (--precision f16), its stand-in".into(),
                )),
                (Ok(()), $crate::train::Precision::F16, false) => $go!($crate::backend::VkHalfTrain),
                (Ok(()), $crate::train::Precision::F16, true) => $go!($crate::backend::VkHalfTrainCheckpointed),
                (Ok(()), _, false) => $go!($crate::backend::VkTrain),
                (Ok(()), _, true) => $go!($crate::backend::VkTrainCheckpointed),
            },
            (other, _) => Err($crate::train::TrainError::Device($crate::train::device_error(other))),
        }
    }};
}
pub(crate) use with_train_backend;

/// Why `--precision f16` stops on any device but vulkan.
pub const F16_ONLY_ON_VULKAN: &str = "--precision f16 is the vulkan device's stand-in for bf16 (Mesa's lavapipe has \
    no bf16); f16 training wants loss scaling, which kiln does not do: use bf16 on cuda, f32 on the cpu";

/// The message for `--device cuda` or `vulkan` in a build without that feature, and for unknown devices.
pub fn device_error(device: &str) -> String {
    match device {
        "cuda" => "this kiln was built without CUDA: rebuild with `cargo build --release --features cuda` (make does when nvcc or a CUDA driver is present)".into(),
        "vulkan" => "this kiln was built without Vulkan: rebuild with `cargo build --release --features vulkan`".into(),
        _ => format!("unknown device '{device}': use cpu, cuda or vulkan"),
    }
}

/// `train` on the named device (`cpu`, or `cuda` in a CUDA build) with `cfg.precision` resolved for it,
/// optionally with activation checkpointing.
#[allow(clippy::too_many_arguments)]
pub fn train_on_device(
    device: &str,
    cfg: &TrainConfig,
    model_dir: &std::path::Path,
    data_dir: &std::path::Path,
    run_dir: &std::path::Path,
    resume: bool,
    stop: &std::sync::atomic::AtomicBool,
    halt_after: Option<usize>,
    show_progress: bool,
) -> Result<TrainSummary, TrainError> {
    let cfg = &cfg.for_device(device);
    macro_rules! go {
        ($backend:ty) => {
            replicas::check_gpus::<$backend>(device, cfg.devices).and_then(|()| {
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
            })
        };
    }
    with_train_backend!(device, cfg.precision, cfg.activation_checkpointing, go)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_waits_for_the_step_only_while_training_runs() {
        let stop = StopRequest::default();
        assert!(!stop.request(), "nothing trains: end now");
        let taken = stop.defer(|flag| {
            assert!(!flag.load(Ordering::SeqCst), "an earlier Ctrl-C does not stop a later training");
            let first = stop.request();
            (first, flag.load(Ordering::SeqCst), stop.request())
        });
        assert_eq!(taken, (true, true, false), "the first Ctrl-C is the trainer's, a second one ends at once");
        assert!(!stop.request(), "training is over: end now");
    }
}
