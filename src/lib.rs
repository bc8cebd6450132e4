//! kiln: a supervised fine-tuning pipeline for terminal-agent language models, on burn.
//!
//! Stages and where they live (see the README's stage table): `hub` (Hub access) → `data` (recipes,
//! readers, normalization, decontamination) → `chat` (native templates, thinking policy, supervised spans)
//! → `tokens` (tokenizer, token masks, shards, `prepare`). `synth` makes the project's own sample data;
//! `backend` names the burn backends compiled in, `kernels` holds kiln's CubeCL kernels for the CubeCL ones
//! and `kernel_cache` where CubeCL keeps compiled kernels between processes;
//! `device_panics` shapes what a panic on one of their device threads shows; `errors` tells an error with
//! its causes in one line.

pub mod backend;
pub mod chat;
pub mod data;
pub mod device_panics;
pub mod errors;
pub mod eval;
pub mod files;
pub mod host;
pub mod hub;
pub mod kernel_cache;
#[cfg(any(feature = "cuda", feature = "vulkan"))]
pub mod kernels;
pub mod models;
pub mod pipeline;
pub mod report;
pub mod synth;
#[cfg(test)]
pub(crate) mod testing;
pub mod tokens;
pub mod train;
