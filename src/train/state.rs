//! The resumable training state on disk, `train/state/`: the weights (f32 safetensors), the AdamW moments by
//! parameter name (`optimizer/`), and `position.json` (where in the data the run is, the config it trains
//! with, and the base model and data it started from, by content). A state resumes only the run it belongs
//! to, and a save never leaves a run without a whole state.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use burn::module::ParamId;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::TrainError;
use super::optim::{AdamW, CODES_SUFFIX};
use super::trainer::TrainConfig;
use crate::models::CausalLm;
use crate::models::hf::{HfNamed, write_streamed};
use crate::models::weights::HostTensor;

/// What a training run started from. A state trained from another checkpoint (a run folder reused for
/// another model) or on other shards must not be resumed as if it were this run's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainSource {
    /// sha256 of the base checkpoint's config.json and, per weight file, its name, size and first and last
    /// MiB (enough to tell checkpoints apart without reading gigabytes).
    pub model: String,
    /// sha256 of the token shards, whole.
    pub data: String,
}

/// The bytes of a weight file that stand for it: its header and first tensors, and its last tensors.
const SAMPLED_BYTES: u64 = 1 << 20;

impl TrainSource {
    pub fn of(model_dir: &Path, shards: &[PathBuf]) -> Result<TrainSource, TrainError> {
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |e: std::io::Error| TrainError::State { path: path.clone(), message: e.to_string() }
        };
        let mut model = Sha256::new();
        let config = model_dir.join("config.json");
        model.update(std::fs::read(&config).map_err(err(&config))?);
        let mut weights: Vec<PathBuf> = std::fs::read_dir(model_dir)
            .map_err(err(model_dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(".safetensors")))
            .collect();
        weights.sort();
        for path in &weights {
            sample_file(path, &mut model).map_err(err(path))?;
        }
        let mut data = Sha256::new();
        for path in shards {
            data.update(path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
            let mut file = std::fs::File::open(path).map_err(err(path))?;
            std::io::copy(&mut file, &mut data).map_err(err(path))?;
        }
        Ok(TrainSource { model: hex::encode(model.finalize()), data: hex::encode(data.finalize()) })
    }

    /// What of `saved` this source differs in, in words ("another base model", "other data").
    pub fn differences(&self, saved: &TrainSource) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.model != saved.model {
            out.push("from another base model");
        }
        if self.data != saved.data {
            out.push("on other data");
        }
        out
    }
}

fn sample_file(path: &Path, into: &mut Sha256) -> std::io::Result<()> {
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    into.update(path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
    into.update(len.to_le_bytes());
    let head = len.min(SAMPLED_BYTES);
    let tail = head.max(len.saturating_sub(SAMPLED_BYTES));
    for (start, end) in [(0, head), (tail, len)] {
        let mut buf = vec![0u8; (end - start) as usize];
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut buf)?;
        into.update(&buf);
    }
    Ok(())
}

/// A run's saved state, as the pipeline decides between resuming it and starting over.
#[derive(Debug, Clone)]
pub struct SavedState {
    pub dir: PathBuf,
    pub config: TrainConfig,
    pub source: Option<TrainSource>,
}

impl SavedState {
    /// Why a run of `cfg` from `source` cannot resume this state (None: it can).
    pub fn refusal(&self, cfg: &TrainConfig, source: &TrainSource) -> Option<String> {
        let mut why = Vec::new();
        if !cfg.continues(&self.config) {
            why.push(format!("with another training config ({})", cfg.changes_from(&self.config).join("; ")));
        }
        if let Some(saved) = &self.source {
            why.extend(source.differences(saved).into_iter().map(str::to_string));
        }
        (!why.is_empty()).then(|| format!("{} was trained {}", self.dir.display(), why.join(", and ")))
    }
}

/// The whole state of the run in `run_dir`, where it has one.
pub fn saved_state(run_dir: &Path) -> Option<SavedState> {
    let train_dir = run_dir.join("train");
    let dir = [train_dir.join("state"), train_dir.join(PREVIOUS_STATE)].into_iter().find(|d| is_complete_state(d))?;
    let text = std::fs::read_to_string(dir.join("position.json")).ok()?;
    let position = serde_json::from_str::<Position>(&text).ok()?;
    Some(SavedState { dir: train_dir.join("state"), config: position.config, source: position.source })
}

/// The position of the state in `state_dir`, checked to continue a run of `cfg` from `source`.
pub(super) fn read_position(state_dir: &Path, cfg: &TrainConfig, source: &TrainSource) -> Result<Position, TrainError> {
    let err = |e: &dyn std::fmt::Display| TrainError::State { path: state_dir.to_path_buf(), message: e.to_string() };
    let text = std::fs::read_to_string(state_dir.join("position.json")).map_err(|e| err(&e))?;
    let position: Position = serde_json::from_str(&text).map_err(|e| err(&e))?;
    let saved =
        SavedState { dir: state_dir.to_path_buf(), config: position.config.clone(), source: position.source.clone() };
    match saved.refusal(cfg, source) {
        Some(why) => Err(TrainError::Config(format!(
            "{why}; resume with the same settings, base and data, or start over without --resume"
        ))),
        None => Ok(position),
    }
}

/// Where `write_state` keeps the state it replaces until the new one has its name: a kill at any moment of
/// a save leaves one complete state, at `train/state/` or here.
const PREVIOUS_STATE: &str = "state.previous";

/// `position.json` is written last, so a state folder that has it is whole.
pub(super) fn is_complete_state(dir: &Path) -> bool {
    dir.join("position.json").is_file()
}

/// Puts the previous state back in its place when a save was killed between its two renames.
pub(super) fn restore_previous_state(state_dir: &Path) -> Result<(), TrainError> {
    let previous = state_dir.with_file_name(PREVIOUS_STATE);
    if is_complete_state(state_dir) || !is_complete_state(&previous) {
        return Ok(());
    }
    let err = |e: std::io::Error| TrainError::State { path: previous.clone(), message: e.to_string() };
    if state_dir.exists() {
        std::fs::remove_dir_all(state_dir).map_err(err)?;
    }
    std::fs::rename(&previous, state_dir).map_err(err)
}

/// `position.json`: where the run is, the config it trains with, and what it started from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Position {
    pub epoch: usize,
    pub step_in_epoch: usize,
    pub global_step: usize,
    pub optimizer_steps: usize,
    pub config: TrainConfig,
    /// None in states written before it was recorded: those resume unchecked.
    #[serde(default)]
    pub source: Option<TrainSource>,
    /// Wall seconds the training took up to this state, over every invocation, so that a resumed run's
    /// summary counts them all.
    #[serde(default)]
    pub seconds: f64,
}

pub(super) fn param_names<B: burn::tensor::backend::Backend>(model: &CausalLm<B>) -> HashMap<ParamId, String> {
    let mut names = HashMap::new();
    for e in model.hf_entries() {
        names.entry(e.id).or_insert(e.key);
    }
    names
}

pub(super) fn write_state<B: AutodiffBackend>(
    dir: &Path,
    model: &CausalLm<B>,
    opt: &AdamW<B::InnerBackend>,
    position: &Position,
    seconds: f64,
    source_dir: &Path,
) -> Result<(), TrainError> {
    let position = Position { seconds, ..position.clone() };
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    model.export_exact(source_dir, &tmp)?;
    write_streamed(opt.state_tensors(&param_names(model)), &tmp.join("optimizer"), usize::MAX)?;
    let text = serde_json::to_string_pretty(&position).unwrap_or_default() + "\n";
    let state_err = |e: std::io::Error| TrainError::State { path: tmp.clone(), message: e.to_string() };
    std::fs::write(tmp.join("position.json"), text).map_err(state_err)?;
    // The last complete state is renamed aside, not removed, until the new one is in place.
    let previous = dir.with_file_name(PREVIOUS_STATE);
    let err = |e: std::io::Error| TrainError::State { path: dir.to_path_buf(), message: e.to_string() };
    if is_complete_state(dir) {
        let _ = std::fs::remove_dir_all(&previous);
        std::fs::rename(dir, &previous).map_err(err)?;
    } else if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(err)?;
    }
    std::fs::rename(&tmp, dir).map_err(err)?;
    let _ = std::fs::remove_dir_all(&previous);
    Ok(())
}

pub(super) fn read_moments(dir: &Path) -> Result<HashMap<String, HostTensor>, TrainError> {
    use crate::models::TensorSource;
    let store = crate::models::WeightStore::open(dir)?;
    let keys: Vec<String> = store.keys().cloned().collect();
    let mut out = HashMap::new();
    for k in keys {
        let shape = store.shape(&k).map(<[usize]>::to_vec).unwrap_or_default();
        let tensor = if store.dtype(&k) == Some(safetensors::Dtype::U8) {
            let raw = store.raw(&k)?;
            HostTensor { shape, data: raw.bytes.iter().map(|&b| f32::from(b)).collect() }
        } else {
            store.take(&k, &shape)
        };
        out.insert(k, tensor);
    }
    // The u8 codes were read raw, as nothing else in a state is.
    store.finish_except(&[], &|key| key.ends_with(CODES_SUFFIX))?;
    Ok(out)
}
