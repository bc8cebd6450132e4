//! The training loop and its run directory: `train/metrics.jsonl` (one line per optimizer step),
//! `train/validation.jsonl` (the held-out split's loss, `validation`), both also as TensorBoard events
//! (`tensorboard`), `train/state/` (weights, AdamW moments and position, for `--resume`;
//! `train/state.previous/` while a new state replaces it), `checkpoints/epoch-<k>/` (HF exports).

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use super::TrainError;
use super::data::TrainData;
use super::disk::{
    CheckpointBytes, DiskNeed, check_enabled as disk_check_enabled, folder_bytes, free_bytes, size_text,
};
use super::linear_ce::LinearCrossEntropy;
use super::optim::{AdamW, AdamWConfig, StateMemory};
use super::replicas::{GradientSync, ReplicaWork, Replicas, Share, ShareOutcome, ValidationOutcome, ValidationShare};
use super::schedule::{Decay, Schedule};
use super::state::{
    Position, TrainSource, is_complete_state, param_names, read_moments, read_position, restore_previous_state,
    write_state,
};
use super::step::{MicroBatch, NonFiniteLoss, ShardOutcome, StepOutcome, StepRule, optimizer_step, shard_step};
use super::tensorboard::EventLog;
use super::validation::Validator;
use crate::backend::DeviceMemory;
use crate::models::hf::{COMPANION_FILES, ExportDtype};
use crate::models::routing::LoadBalance;
use crate::models::weights::kept_in_f32;
use crate::models::{CausalLm, ModelConfig, checkpoint_carried_bytes, checkpoint_tensor_sizes, load_model};
use crate::tokens::shards::Row;

/// The dtype parameters, activations and gradients are stored in. The optimizer's master weights and moments
/// stay f32 either way (bf16 or 8-bit moments are `adamw.moments`); norms, softmax and the loss run in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 on the CPU, bf16 on CUDA.
    #[default]
    Auto,
    F32,
    Bf16,
    /// The vulkan device's stand-in for bf16 (lavapipe has none): the half-precision graph checked without a
    /// GPU. Not offered elsewhere: f16 training wants loss scaling, which kiln does not do.
    F16,
}

impl Precision {
    /// What `Auto` means on `device`.
    pub fn resolve(self, device: &str) -> Precision {
        match self {
            Precision::Auto if device == "cuda" => Precision::Bf16,
            Precision::Auto => Precision::F32,
            other => other,
        }
    }

    /// The parameters' dtype (`None` for `Auto`: whatever the backend loads).
    pub fn dtype(self) -> Option<FloatDType> {
        match self {
            Precision::Auto => None,
            Precision::F32 => Some(FloatDType::F32),
            Precision::Bf16 => Some(FloatDType::BF16),
            Precision::F16 => Some(FloatDType::F16),
        }
    }
}

/// `max_grad_norm` as read: 0 (or null, as a saved config writes no clipping) is none.
fn clip_norm<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.filter(|&n| n != 0.0))
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    pub epochs: usize,
    pub lr: f64,
    pub min_lr_ratio: f64,
    /// Warmup as a share of all optimizer steps (`warmup_steps` wins when set).
    pub warmup_ratio: f64,
    pub warmup_steps: Option<usize>,
    pub decay: Decay,
    /// The share of all steps, at the end, over which the rate decays (rounded up, never into the warmup);
    /// before it the rate holds at the peak (warmup-stable-decay). 1, the default, decays over every step
    /// after warmup, and is left out of the saved config, so configs written before it read and hash as
    /// they did.
    #[serde(skip_serializing_if = "is_one")]
    pub decay_ratio: f64,
    pub adamw: AdamWConfig,
    /// Sequences (packed rows) per optimizer step.
    pub global_batch: usize,
    /// The global batch in tokens instead: rows per step = this / sequence length (wins when set).
    pub global_batch_tokens: Option<usize>,
    /// Sequences per forward pass; `global_batch` must be a multiple.
    pub micro_batch: usize,
    /// Each forward pass runs at its longest row's tokens rounded up to a multiple of this, the rows' trailing
    /// padding dropped (`step::batch_length`); 0 runs whole rows.
    pub pad_multiple: usize,
    /// Clip gradients to this global norm; 0 in a config turns clipping off (as transformers' Trainer reads
    /// it), since an absent key means the default.
    #[serde(deserialize_with = "clip_norm")]
    pub max_grad_norm: Option<f64>,
    pub seed: u64,
    /// Save the resumable state every this many optimizer steps (and at every epoch end).
    pub save_every: Option<usize>,
    /// Keep a resumable state at all (at epoch ends, `save_every` steps and a stop). Off, a run writes only
    /// its epoch exports: a model whose state outgrows the disk can train, and an interrupted run starts
    /// over.
    pub save_state: bool,
    pub export_dtype: ExportDtype,
    /// The accelerator's dense peak in TFLOP/s, for MFU (none on the CPU).
    pub peak_tflops: Option<f64>,
    pub precision: Precision,
    /// Keep each layer's input alone and recompute the layer's activations in the backward pass (burn's
    /// balanced checkpointing over kiln's recomputable ops, `models::ops`): less memory, about one forward
    /// pass more, the same updates, so a run may resume with it switched either way.
    pub activation_checkpointing: bool,
    /// Data-parallel replicas, one a device (`cuda` devices 0..N; on the CPU they share its one device, which
    /// checks the path and adds no compute): each runs its share of a step's micro-batches and burn's
    /// collective sums their gradients, so the updates are those of one device up to the order of the f32
    /// sums. A step's micro-batches (global batch / micro batch) must be a multiple of it.
    pub devices: usize,
    /// Measure the validation split's loss every this many optimizer steps, besides the base model's and each
    /// epoch end's (which run whenever the data has a validation split).
    pub validation_every: Option<usize>,
    /// After every step, move each MoE layer's expert bias this much toward an even load (up for experts the
    /// step gave fewer tokens than the mean, down for busier ones: DeepSeek-V3's auxiliary-loss-free
    /// balancing). 0, the default, keeps the checkpoint's bias, as transformers does. Left out of the saved
    /// config at 0, so configs written before it read and hash as they did.
    #[serde(skip_serializing_if = "is_zero")]
    pub expert_bias_rate: f64,
}

fn is_zero(value: &f64) -> bool {
    *value == 0.0
}

fn is_one(value: &f64) -> bool {
    *value == 1.0
}

impl TrainConfig {
    /// The config as it runs on `device` (`precision = "auto"` resolved): what a saved state records and a
    /// resume compares against.
    pub fn for_device(&self, device: &str) -> TrainConfig {
        TrainConfig { precision: self.precision.resolve(device), ..self.clone() }
    }

    /// The settings that make no run, whatever the data: checked before anything loads or is written, so a
    /// typo in a config or a flag fails at once instead of after the pull, or as a division by zero or a NaN
    /// loss many steps in.
    pub fn check(&self) -> Result<(), String> {
        let positive = |name: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(format!("train.{name} is {value}: it must be a finite number above 0"))
            }
        };
        let fraction = |name: &str, value: f64, below_one: bool| {
            let within = if below_one { (0.0..1.0).contains(&value) } else { (0.0..=1.0).contains(&value) };
            let upper = if below_one { "below" } else { "at most" };
            if within { Ok(()) } else { Err(format!("train.{name} is {value}: it must be at least 0 and {upper} 1")) }
        };
        let at_least_one = |name: &str, value: usize| {
            if value >= 1 { Ok(()) } else { Err(format!("train.{name} is 0: it must be at least 1")) }
        };
        at_least_one("epochs", self.epochs)?;
        at_least_one("micro_batch", self.micro_batch)?;
        at_least_one("devices", self.devices)?;
        if let Some(every) = self.validation_every {
            at_least_one("validation_every", every)?;
        }
        match self.global_batch_tokens {
            Some(tokens) => at_least_one("global_batch_tokens", tokens)?,
            None => at_least_one("global_batch", self.global_batch)?,
        }
        positive("lr", self.lr)?;
        fraction("min_lr_ratio", self.min_lr_ratio, false)?;
        fraction("warmup_ratio", self.warmup_ratio, false)?;
        if !(self.decay_ratio.is_finite() && self.decay_ratio > 0.0 && self.decay_ratio <= 1.0) {
            return Err(format!("train.decay_ratio is {}: it must be above 0 and at most 1", self.decay_ratio));
        }
        if self.decay == Decay::Constant && self.decay_ratio != 1.0 {
            return Err(format!(
                "train.decay_ratio is {} with decay = \"constant\": a constant rate has no decay phase",
                self.decay_ratio
            ));
        }
        if let Some(norm) = self.max_grad_norm {
            positive("max_grad_norm", norm)?;
        }
        if let Some(peak) = self.peak_tflops {
            positive("peak_tflops", peak)?;
        }
        fraction("adamw.beta1", self.adamw.beta1, true)?;
        fraction("adamw.beta2", self.adamw.beta2, true)?;
        positive("adamw.eps", self.adamw.eps)?;
        for (name, value) in
            [("adamw.weight_decay", self.adamw.weight_decay), ("expert_bias_rate", self.expert_bias_rate)]
        {
            if !(value.is_finite() && value >= 0.0) {
                return Err(format!("train.{name} is {value}: it must be a finite number, 0 or more"));
            }
        }
        Ok(())
    }

    /// Whether a state saved with `saved` continues as this config would train: every setting equal but
    /// activation checkpointing, which changes memory, not the updates, the device count, which changes
    /// only the order of the gradients' f32 sums (bit for bit, a resume wants the same count), whether
    /// states are saved, and how often the validation loss is measured.
    pub fn continues(&self, saved: &TrainConfig) -> bool {
        *self == self.as_resumed(saved)
    }

    /// `saved` with the settings a resume may change taken from this config.
    fn as_resumed(&self, saved: &TrainConfig) -> TrainConfig {
        TrainConfig {
            activation_checkpointing: self.activation_checkpointing,
            devices: self.devices,
            save_state: self.save_state,
            validation_every: self.validation_every,
            ..saved.clone()
        }
    }

    /// The settings in which this config departs from a state saved with `saved`, as `train.lr 0.004 there,
    /// 0.002 now` (those `continues` allows left out), for the error that refuses the resume.
    pub fn changes_from(&self, saved: &TrainConfig) -> Vec<String> {
        let there: std::collections::BTreeMap<_, _> = settings(&self.as_resumed(saved)).into_iter().collect();
        let unset = serde_json::Value::Null;
        settings(self)
            .into_iter()
            .filter_map(|(name, now)| {
                let before = there.get(&name).unwrap_or(&unset);
                (*before != now).then(|| format!("{name} {before} there, {now} now"))
            })
            .collect()
    }
}

/// Every setting of `cfg` as `(train.name, value)`, nested tables by their dotted path, in a fixed order.
fn settings(cfg: &TrainConfig) -> Vec<(String, serde_json::Value)> {
    fn walk(path: &str, value: serde_json::Value, out: &mut Vec<(String, serde_json::Value)>) {
        match value {
            serde_json::Value::Object(map) => map.into_iter().for_each(|(k, v)| walk(&format!("{path}.{k}"), v, out)),
            leaf => out.push((path.to_string(), leaf)),
        }
    }
    let mut out = Vec::new();
    walk("train", serde_json::to_value(cfg).unwrap_or_default(), &mut out);
    // The keys a saved config leaves out at their defaults (so configs from before them hash the same) are
    // settings all the same.
    for (name, value) in [("train.decay_ratio", cfg.decay_ratio), ("train.expert_bias_rate", cfg.expert_bias_rate)] {
        if !out.iter().any(|(n, _)| n == name) {
            out.push((name.to_string(), serde_json::json!(value)));
        }
    }
    out
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 1,
            lr: 2e-5,
            min_lr_ratio: 0.0,
            warmup_ratio: 0.03,
            warmup_steps: None,
            decay: Decay::Cosine,
            decay_ratio: 1.0,
            adamw: AdamWConfig::default(),
            global_batch: 8,
            global_batch_tokens: None,
            micro_batch: 1,
            pad_multiple: 64,
            max_grad_norm: Some(1.0),
            seed: 42,
            save_every: None,
            save_state: true,
            export_dtype: ExportDtype::Bf16,
            peak_tflops: None,
            precision: Precision::Auto,
            activation_checkpointing: false,
            devices: 1,
            validation_every: None,
            expert_bias_rate: 0.0,
        }
    }
}

/// One line of `train/metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: usize,
    pub epoch: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens: u64,
    pub supervised_tokens: u64,
    pub tokens_per_s: f64,
    /// (6·params·tokens + 12·attention_layers·heads·head_dim·seq·tokens) / (seconds · peak); null on the CPU.
    pub mfu: Option<f64>,
    pub peak_memory_bytes: Option<u64>,
    /// How evenly the step's MoE layers spread its tokens over their experts (`routing::LoadBalance`); absent
    /// for a dense model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<LoadBalance>,
}

/// Tokens and supervised tokens over every step of a `metrics.jsonl`.
pub fn metrics_totals(path: &Path) -> std::io::Result<(u64, u64)> {
    Ok(read_metrics(path)?.iter().fold((0, 0), |(t, s), m| (t + m.tokens, s + m.supervised_tokens)))
}

/// The steps of a `metrics.jsonl`. A line that is not a step is an error naming it (`InvalidData`): the card
/// and the stage counts would otherwise leave its tokens out without a word.
pub fn read_metrics(path: &Path) -> std::io::Result<Vec<StepMetrics>> {
    crate::files::parse_json_lines(&std::fs::read_to_string(path)?)
}

/// The steps taken when each epoch of `metrics` (a run's `metrics.jsonl`, in order) ended: `[k - 1]` is where
/// `checkpoints/epoch-<k>` was exported. The last is where the metrics end, an epoch's end when the run
/// finished it (as it did if that epoch's checkpoint exists).
pub fn epoch_end_steps(metrics: &[StepMetrics]) -> Vec<usize> {
    let ends = metrics.windows(2).filter(|pair| pair[1].epoch > pair[0].epoch).map(|pair| pair[0].step + 1);
    ends.chain(metrics.last().map(|m| m.step + 1)).collect()
}

/// On resume, `metrics.jsonl` keeps only the steps before the saved position. A run killed rather than
/// stopped (no state written at the end) runs its steps since the last saved state again, and they must not
/// be counted twice; a last line cut off mid-write goes with them.
fn keep_metrics_before(path: &Path, step: usize) -> std::io::Result<()> {
    crate::files::retain_json_lines(path, |m: &StepMetrics| m.step < step)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainSummary {
    pub steps: usize,
    pub epochs_done: usize,
    pub final_loss: Option<f64>,
    pub checkpoints: Vec<PathBuf>,
    pub interrupted: bool,
    pub seconds: f64,
    #[serde(default)]
    pub precision: Precision,
    /// What the weights, gradients and optimizer state took between steps (before activations).
    #[serde(default)]
    pub state_memory: StateMemory,
    /// The validation split's loss at the last measure (`train/validation.jsonl`); none without a split.
    #[serde(default)]
    pub validation_loss: Option<f64>,
    /// An MoE's MaxVio over the validation split at the last measure (`routing::LoadBalance`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_max_vio: Option<f64>,
}

/// Why a step stopped the run: a non-finite loss, or a failure (a replica's).
enum StepFailure {
    NonFinite(NonFiniteLoss),
    Error(TrainError),
}

/// One optimizer step's micro-batches, their supervised count, and how it updates the model.
struct StepInputs {
    batches: Vec<MicroBatch>,
    supervised: f32,
    rule: StepRule,
}

/// One optimizer step on every replica: micro-batch `i` on replica `i mod N`, replica 0's share here while
/// the others run theirs; the step's outcome from all of theirs.
fn replicated_step<B: LinearCrossEntropy + DeviceMemory>(
    model: CausalLm<B>,
    opt: &mut AdamW<B::InnerBackend>,
    replicas: &mut Replicas<B>,
    sync: &GradientSync,
    step: StepInputs,
    device: &B::Device,
) -> Result<(CausalLm<B>, Option<StepOutcome>), StepFailure> {
    let StepInputs { batches, supervised, rule } = step;
    let mut shares = super::replicas::split(batches, replicas.count()).into_iter();
    let own = shares.next().unwrap_or_default();
    replicas.send(shares.map(|batches| Share { batches, supervised, rule }).collect()).map_err(StepFailure::Error)?;
    let own: Vec<(usize, &MicroBatch)> = own.iter().map(|(i, b)| (*i, b)).collect();
    let mine = shard_step(model, opt, &own, supervised, rule, device, sync);
    // Collected even when this replica failed: the others have finished the step too.
    let theirs: Result<Vec<_>, _> = replicas.collect().into_iter().collect();
    let (model, mine) = mine.map_err(StepFailure::Error)?;
    let outcome = ShardOutcome::merge(std::iter::once(mine).chain(theirs.map_err(StepFailure::Error)?));
    outcome.map(|outcome| (model, outcome)).map_err(StepFailure::NonFinite)
}

/// A replica's model, optimizer and what its state takes, as loaded for training.
struct Loaded<B: AutodiffBackend> {
    config: ModelConfig,
    model: CausalLm<B>,
    opt: AdamW<B::InnerBackend>,
    state_memory: StateMemory,
}

/// Where every replica loads from: the checkpoint, or a saved state (with its optimizer step count).
#[derive(Clone)]
struct ReplicaSource {
    cfg: TrainConfig,
    load_dir: PathBuf,
    state: Option<usize>,
    accumulating: bool,
}

impl ReplicaSource {
    /// Refuses a model whose state cannot fit `device`, by its checkpoint's headers, before loading takes
    /// the memory (an 8B model in f32 on the CPU outgrows most hosts in the loading alone).
    fn check_fits<B: LinearCrossEntropy + DeviceMemory>(&self, device: &B::Device) -> Result<(), TrainError> {
        let Some(device_bytes) = B::total_bytes(device) else { return Ok(()) };
        let sizes = checkpoint_tensor_sizes(&self.load_dir)?;
        let tensors: Vec<(usize, usize)> =
            sizes.iter().map(|(key, n)| (*n, training_dtype::<B>(self.cfg.precision, key).size())).collect();
        super::optim::tensors_fit_device(&tensors, &self.cfg.adamw, self.accumulating, Some(device_bytes))
            .map_err(TrainError::OutOfMemory)?;
        Ok(())
    }

    /// The model and optimizer on `device` (`check_fits` first: each caller checks its own device).
    fn load<B: LinearCrossEntropy + DeviceMemory>(&self, device: &B::Device) -> Result<Loaded<B>, TrainError> {
        let (cfg, load_dir) = (&self.cfg, &self.load_dir);
        let (config, mut model) = load_model::<B>(load_dir, device)?;
        if let Some(dtype) = cfg.precision.dtype() {
            model = model.cast_params(dtype);
        }
        // Before any optimizer state is allocated or read back: the loaded model's own tensors.
        let state_memory =
            super::optim::state_memory_on_device(&model, &cfg.adamw, self.accumulating, B::total_bytes(device))
                .map_err(TrainError::OutOfMemory)?;
        let mut opt = AdamW::<B::InnerBackend>::new(cfg.adamw);
        if let Some(steps) = self.state {
            opt.steps = steps;
            let sizes = super::optim::param_sizes(&model);
            let names =
                param_names(&model).into_iter().map(|(id, name)| (id, (name, sizes.get(&id).copied().unwrap_or(0))));
            opt.import_state(&names.collect(), &read_moments(&load_dir.join("optimizer"))?, device)
                .map_err(|message| TrainError::State { path: load_dir.clone(), message })?;
        }
        Ok(Loaded { config, model, opt, state_memory })
    }
}

/// The dtype checkpoint tensor `key` has while training in `precision` on backend `B`.
fn training_dtype<B: Backend>(precision: Precision, key: &str) -> DType {
    match precision.dtype() {
        _ if kept_in_f32(key) => DType::F32,
        Some(dtype) => DType::from(dtype),
        None => <B::FloatElem as burn::tensor::Element>::dtype(),
    }
}

/// Refuses a run whose exports and states still to come outgrow the free space where `run_dir` lies
/// (`disk`), saying what it needs, before the model loads; `KILN_DISK_CHECK=off` skips it.
fn check_disk<B: Backend>(
    cfg: &TrainConfig,
    load_dir: &Path,
    run_dir: &Path,
    position: &Position,
    steps: (usize, usize),
    show_progress: bool,
) -> Result<(), TrainError> {
    let (total_steps, steps_done) = steps;
    let loaded = checkpoint_tensor_sizes(load_dir)?
        .into_iter()
        .map(|(key, n)| {
            let dtype = training_dtype::<B>(cfg.precision, &key);
            (key, n, dtype)
        })
        .collect();
    let companions: u64 =
        COMPANION_FILES.iter().map(|f| std::fs::metadata(load_dir.join(f)).map_or(0, |m| m.len())).sum();
    let checkpoint = CheckpointBytes { loaded, copied_bytes: checkpoint_carried_bytes(load_dir)? + companions };
    let epochs = position.epoch + 1..=cfg.epochs;
    let replaced = epochs.clone().map(|k| folder_bytes(&run_dir.join("checkpoints").join(format!("epoch-{k}")))).sum();
    let periodic = cfg.save_every.filter(|&n| n > 0).map_or(0, |n| total_steps / n - steps_done / n);
    let saves = if cfg.save_state { epochs.clone().count() + periodic } else { 0 };
    let state_exists = is_complete_state(&run_dir.join("train").join("state"));
    let need = DiskNeed::of(&checkpoint, &cfg.adamw, cfg.export_dtype, epochs.count(), saves, state_exists, replaced);
    let Some(free) = free_bytes(run_dir) else { return Ok(()) };
    match need.verdict(run_dir, free, disk_check_enabled()).map_err(TrainError::NoDiskSpace)? {
        Some(warning) => eprintln!("warning: {warning}"),
        None if show_progress => eprintln!("train: disk: writes {}, of {} free", need.summary(), size_text(free)),
        None => {}
    }
    Ok(())
}

/// A replica beyond the trainer's own: its model between steps (taken while one runs) and optimizer.
struct ReplicaState<B: AutodiffBackend> {
    model: Option<CausalLm<B>>,
    opt: AdamW<B::InnerBackend>,
    device: B::Device,
}

impl<B: LinearCrossEntropy + DeviceMemory> ReplicaWork<B> for ReplicaSource {
    type State = ReplicaState<B>;

    fn load(&self, device: &B::Device) -> Result<ReplicaState<B>, TrainError> {
        self.check_fits::<B>(device)?;
        let Loaded { model, opt, .. } = ReplicaSource::load::<B>(self, device)?;
        Ok(ReplicaState { model: Some(model), opt, device: device.clone() })
    }

    fn run(&self, state: &mut ReplicaState<B>, share: Share, sync: &GradientSync) -> ShareOutcome {
        let model = state.model.take().ok_or_else(|| TrainError::Device("the replica lost its model".into()))?;
        let batches: Vec<(usize, &MicroBatch)> = share.batches.iter().map(|(i, b)| (*i, b)).collect();
        let (model, outcome) =
            shard_step(model, &mut state.opt, &batches, share.supervised, share.rule, &state.device, sync)?;
        state.model = Some(model);
        Ok(outcome)
    }

    fn validate(&self, state: &mut ReplicaState<B>, share: &ValidationShare) -> ValidationOutcome {
        let model = state.model.as_ref().ok_or_else(|| TrainError::Device("the replica lost its model".into()))?;
        let ValidationShare { data, batches, micro_batch, pad_multiple } = share;
        Ok(super::validation::batch_sums(model, data, batches, *micro_batch, *pad_multiple, &state.device))
    }
}

/// A nonzero `expert_bias_rate` needs a model with an expert bias to move.
fn check_expert_bias(cfg: &TrainConfig, model_dir: &Path) -> Result<(), TrainError> {
    if cfg.expert_bias_rate == 0.0 {
        return Ok(());
    }
    let config = ModelConfig::from_file(&model_dir.join("config.json"))?;
    if config.has_expert_bias() {
        return Ok(());
    }
    Err(TrainError::Config(format!(
        "train.expert_bias_rate = {} moves an MoE's expert bias, and {} has none ({}): leave it at 0",
        cfg.expert_bias_rate,
        model_dir.display(),
        if config.architecture() == "lfm2_moe" { "use_expert_bias is false" } else { "not an MoE" }
    )))
}

/// Trains the checkpoint in `model_dir` on the shards in `data_dir`, writing into `run_dir`.
/// `resume` continues from `run_dir/train/state` exactly where it stopped. `stop` (Ctrl-C) and `halt_after`
/// (a step count) save the state and return early. Returns the summary and the trained model.
#[allow(clippy::too_many_arguments)]
pub fn train<B: LinearCrossEntropy + DeviceMemory>(
    cfg: &TrainConfig,
    model_dir: &Path,
    data_dir: &Path,
    run_dir: &Path,
    resume: bool,
    stop: &AtomicBool,
    halt_after: Option<usize>,
    show_progress: bool,
    device: &B::Device,
) -> Result<(TrainSummary, CausalLm<B>), TrainError> {
    let started = Instant::now();
    cfg.check().map_err(TrainError::Config)?;
    check_expert_bias(cfg, model_dir)?;
    let data = TrainData::load(data_dir)?;
    let validation = super::validation::load_split(data_dir)?;
    let global_batch = match cfg.global_batch_tokens {
        Some(tokens) => (tokens / data.seq_len.max(1)).max(1),
        None => cfg.global_batch,
    };
    if !global_batch.is_multiple_of(cfg.micro_batch) {
        return Err(TrainError::Config(format!(
            "a global batch of {global_batch} sequences is not a multiple of the micro batch {}",
            cfg.micro_batch
        )));
    }
    let passes = global_batch / cfg.micro_batch;
    if !passes.is_multiple_of(cfg.devices) {
        return Err(TrainError::Config(format!(
            "a step of {passes} micro-batches ({global_batch} sequences in micro-batches of {}) does not share \
             out evenly over {} devices: make global batch / micro batch a multiple of train.devices",
            cfg.micro_batch, cfg.devices
        )));
    }
    // Found now rather than at the end of an epoch: an epoch's export would replace the checkpoint it trains.
    for epoch in 1..=cfg.epochs {
        let out = run_dir.join("checkpoints").join(format!("epoch-{epoch}"));
        crate::models::hf::refuse_overwriting_source(model_dir, &out)?;
    }
    let train_dir = run_dir.join("train");
    let state_dir = train_dir.join("state");
    std::fs::create_dir_all(&train_dir)
        .map_err(|e| TrainError::State { path: train_dir.clone(), message: e.to_string() })?;

    let source = TrainSource::of(model_dir, &data.files)?;
    if resume {
        restore_previous_state(&state_dir)?;
    }
    let (mut position, load_dir) = if resume && is_complete_state(&state_dir) {
        (read_position(&state_dir, cfg, &source)?, state_dir.clone())
    } else {
        if resume {
            return Err(TrainError::State { path: state_dir.clone(), message: "no saved state to resume from".into() });
        }
        let position = Position {
            epoch: 0,
            step_in_epoch: 0,
            global_step: 0,
            optimizer_steps: 0,
            config: cfg.clone(),
            source: Some(source),
            seconds: 0.0,
        };
        (position, model_dir.to_path_buf())
    };
    let devices = super::replicas::replica_devices::<B>(device, cfg.devices)?;
    let source = ReplicaSource {
        cfg: cfg.clone(),
        load_dir: load_dir.clone(),
        state: (load_dir == state_dir).then_some(position.optimizer_steps),
        accumulating: global_batch > cfg.micro_batch,
    };
    // The data against the model's config before the weights load (an 8B checkpoint takes a while).
    let config = ModelConfig::from_file(&load_dir.join("config.json"))?;
    data.check_vocabulary(data_dir, config.vocab_size())?;
    data.check_context(data_dir, config.max_position_embeddings())?;
    if let Some(held_out) = &validation {
        let dir = data_dir.join(crate::tokens::prepare::VALIDATION_DIR);
        held_out.check_vocabulary(&dir, config.vocab_size())?;
        held_out.check_context(&dir, config.max_position_embeddings())?;
    }
    let steps_per_epoch = data.rows.len().div_ceil(global_batch);
    let total_steps = steps_per_epoch * cfg.epochs;
    // Memory first (a machine that cannot hold the model is the harder refusal), then the disk, both before
    // the weights load; every other replica checks its own device's memory before it loads.
    source.check_fits::<B>(device)?;
    check_disk::<B>(cfg, &load_dir, run_dir, &position, (total_steps, position.global_step), show_progress)?;
    let Loaded { config, mut model, mut opt, state_memory } = source.load::<B>(device)?;
    // The other replicas (train.devices > 1) load the same checkpoint or state on their own threads and devices.
    let mut replicas = Replicas::<B>::start(&devices, source.clone())?;
    let metrics_path = train_dir.join("metrics.jsonl");
    if resume {
        keep_metrics_before(&metrics_path, position.global_step)
            .map_err(|e| TrainError::State { path: metrics_path.clone(), message: e.to_string() })?;
    } else {
        let _ = std::fs::remove_file(&metrics_path);
    }
    let validator = validation.map(|data| Validator::new(data, cfg, &train_dir, steps_per_epoch, show_progress));
    if let Some(v) = &validator {
        v.keep_through_resumed(resume.then_some(position.global_step))?;
    }

    let warmup = cfg.warmup_steps.unwrap_or_else(|| (cfg.warmup_ratio * total_steps as f64).ceil() as usize);
    let schedule = Schedule::new(cfg.lr, cfg.min_lr_ratio, warmup, cfg.decay_ratio, total_steps, cfg.decay);
    let flops = StepFlops::of(&model, &config, data.seq_len);
    if show_progress {
        eprintln!("train: {}", state_memory.summary());
    }

    let bar = if show_progress { ProgressBar::new(total_steps as u64) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(position.global_step as u64);
    let mut metrics = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .map_err(|e| TrainError::State { path: metrics_path.clone(), message: e.to_string() })?;
    let mut board = EventLog::open(&train_dir, resume.then_some(position.global_step))?;
    let mut checkpoints = Vec::new();
    let mut last_loss = None;
    let mut peak = PeakMemory::default();
    // The summary of a run that ends here (finished or interrupted), written to `train/summary.json`.
    // This invocation's time on top of what the state had taken.
    let seconds_before = position.seconds;
    let elapsed = || seconds_before + started.elapsed().as_secs_f64();
    // A resumed run that takes no step (it was stopped at its end) ends with the loss its metrics end with.
    let finish = |position: &Position, final_loss: Option<f64>, checkpoints, interrupted| {
        let final_loss = final_loss.or_else(|| read_metrics(&metrics_path).ok()?.last().map(|m| m.loss));
        let last_point = validator.as_ref().and_then(Validator::last_point);
        let summary = TrainSummary {
            steps: position.global_step,
            epochs_done: position.epoch,
            final_loss,
            checkpoints,
            interrupted,
            seconds: elapsed(),
            precision: cfg.precision,
            state_memory,
            validation_loss: last_point.as_ref().map(|p| p.loss),
            expert_max_vio: last_point.and_then(|p| p.expert_tokens.balance()).map(|b| b.max_vio),
        };
        write_summary(&train_dir, &summary).map(|()| summary)
    };

    // The base model's, before the first step (a run resumed at step 0 measures it again, recorded once).
    if let (Some(v), 0) = (&validator, position.global_step) {
        let point = v.measure(&model, device, replicas.as_mut().map(|(r, _)| r), 0, Some("base".into()), &bar)?;
        board.validation(&point)?;
    }
    while position.epoch < cfg.epochs {
        let order = data.order(cfg.seed, position.epoch);
        while position.step_in_epoch < steps_per_epoch {
            if stop.load(Ordering::SeqCst) || halt_after.is_some_and(|n| position.global_step >= n) {
                if cfg.save_state {
                    write_state(&state_dir, &model, &opt, &position, elapsed(), model_dir)?;
                    bar.abandon_with_message("interrupted: state saved, continue with --resume");
                } else {
                    bar.abandon_with_message("interrupted: no state saved (train.save_state = false)");
                }
                return Ok((finish(&position, last_loss, checkpoints, true)?, model));
            }
            let step_started = Instant::now();
            let start = position.step_in_epoch * global_batch;
            let rows: Vec<&Row> =
                order[start..(start + global_batch).min(order.len())].iter().map(|&r| &data.rows[r]).collect();
            let batches: Vec<MicroBatch> =
                rows.chunks(cfg.micro_batch).map(|rows| MicroBatch::from_rows(rows, cfg.pad_multiple)).collect();
            let tokens: u64 = batches.iter().map(|b| b.tokens).sum();
            let supervised: f32 = batches.iter().map(MicroBatch::supervised).sum();
            let lr = schedule.lr(position.global_step);
            let rule = StepRule { lr, max_norm: cfg.max_grad_norm, expert_bias_rate: cfg.expert_bias_rate };
            let stepped = match &mut replicas {
                None => optimizer_step(model, &mut opt, &batches, rule, device).map_err(StepFailure::NonFinite),
                Some((replicas, sync)) => {
                    replicated_step(model, &mut opt, replicas, sync, StepInputs { batches, supervised, rule }, device)
                }
            };
            let (updated, outcome) = stepped.map_err(|failure| match failure {
                StepFailure::Error(e) => e,
                StepFailure::NonFinite(NonFiniteLoss { micro, loss }) => {
                    let samples: Vec<String> = rows
                        .chunks(cfg.micro_batch)
                        .nth(micro)
                        .into_iter()
                        .flatten()
                        .flat_map(|r| r.sample_ids.clone())
                        .collect();
                    TrainError::NonFinite {
                        loss,
                        step: position.global_step,
                        epoch: position.epoch,
                        micro,
                        samples: samples.join(", "),
                    }
                }
            })?;
            model = updated;
            if let Some(outcome) = outcome {
                B::sync(device).map_err(|e| TrainError::Device(format!("{e:?}")))?;
                let secs = step_started.elapsed().as_secs_f64();
                let tokens_f = tokens as f64;
                let line = StepMetrics {
                    step: position.global_step,
                    epoch: position.epoch,
                    loss: outcome.loss,
                    lr,
                    grad_norm: outcome.grad_norm,
                    tokens,
                    supervised_tokens: supervised as u64,
                    tokens_per_s: tokens_f / secs.max(1e-9),
                    mfu: cfg
                        .peak_tflops
                        .map(|p| flops.step_flops(tokens_f) / (secs.max(1e-9) * p * 1e12 * devices.len() as f64)),
                    peak_memory_bytes: peak.observe::<B>(device),
                    experts: outcome.expert_load.balance(),
                };
                writeln!(metrics, "{}", serde_json::to_string(&line).unwrap_or_default())
                    .map_err(|e| TrainError::State { path: train_dir.clone(), message: e.to_string() })?;
                board.step(&line)?;
                let routing = line.experts.map_or(String::new(), |b| format!(" MaxVio {:.2}", b.max_vio));
                bar.set_message(format!("loss {:.4} lr {lr:.2e}{routing}", outcome.loss));
                last_loss = Some(outcome.loss);
            }
            position.step_in_epoch += 1;
            position.global_step += 1;
            position.optimizer_steps = opt.steps;
            bar.inc(1);
            // The epoch's last step is measured at the epoch end, as its checkpoint.
            if let Some(v) = &validator
                && v.due(position.global_step)
                && position.step_in_epoch < steps_per_epoch
            {
                let point =
                    v.measure(&model, device, replicas.as_mut().map(|(r, _)| r), position.global_step, None, &bar)?;
                board.validation(&point)?;
            }
            if cfg.save_state && cfg.save_every.is_some_and(|n| n > 0 && position.global_step % n == 0) {
                write_state(&state_dir, &model, &opt, &position, elapsed(), model_dir)?;
            }
        }
        position.epoch += 1;
        position.step_in_epoch = 0;
        let out = run_dir.join("checkpoints").join(format!("epoch-{}", position.epoch));
        model.export(model_dir, &out, cfg.export_dtype, crate::models::hf::SHARD_BYTES)?;
        checkpoints.push(out);
        if let Some(v) = &validator {
            let checkpoint = Some(format!("epoch-{}", position.epoch));
            let point =
                v.measure(&model, device, replicas.as_mut().map(|(r, _)| r), position.global_step, checkpoint, &bar)?;
            board.validation(&point)?;
        }
        if cfg.save_state {
            write_state(&state_dir, &model, &opt, &position, elapsed(), model_dir)?;
        }
    }
    bar.finish_and_clear();
    Ok((finish(&position, last_loss, checkpoints, false)?, model))
}

/// The FLOPs of a training step by the trainer's MFU formula: 6 · P · T for the forward and backward
/// matmuls plus 12 · (attention layers · heads · head_dim) · S · T for the attention scores and values.
#[derive(Debug, Clone, Copy)]
pub struct StepFlops {
    /// The parameters a token multiplies through (`ModelConfig::flops_share`): an MoE's experts at
    /// top_k / num_experts, lookup-only embedding tables left out.
    pub params: f64,
    pub attention_width: f64,
    pub seq: f64,
}

impl StepFlops {
    pub fn of<B: Backend>(model: &CausalLm<B>, config: &ModelConfig, seq: usize) -> Self {
        // Counted on the module's shapes, not by copying every weight to the host.
        let names = param_names(model);
        let params = super::optim::param_sizes(model)
            .into_iter()
            .map(|(id, n)| n as f64 * names.get(&id).map_or(1.0, |key| config.flops_share(key)))
            .sum();
        // A sliding-window layer's queries see at most `window` keys: its width counts in that proportion.
        let sliding = config
            .sliding_attention_width()
            .map_or(0.0, |(width, window)| width as f64 * window.min(seq) as f64 / seq.max(1) as f64);
        StepFlops { params, attention_width: config.attention_width() as f64 + sliding, seq: seq as f64 }
    }

    pub fn step_flops(&self, tokens: f64) -> f64 {
        6.0 * self.params * tokens + 12.0 * self.attention_width * self.seq * tokens
    }
}

/// Peak memory so far: the most the accelerator's allocator has reserved where the backend says (its pools
/// can shrink, so the peak is kept here), else the process's resident peak.
#[derive(Debug, Default, Clone, Copy)]
pub struct PeakMemory {
    device_bytes: Option<u64>,
}

impl PeakMemory {
    pub fn observe<B: DeviceMemory>(&mut self, device: &B::Device) -> Option<u64> {
        match B::reserved_bytes(device) {
            Some(now) => {
                let peak = self.device_bytes.map_or(now, |p| p.max(now));
                self.device_bytes = Some(peak);
                Some(peak)
            }
            None => crate::host::peak_rss_bytes(),
        }
    }
}

/// `train/summary.json`, written at every return so a stopped run says where it stopped.
fn write_summary(train_dir: &Path, summary: &TrainSummary) -> Result<(), TrainError> {
    let path = train_dir.join("summary.json");
    crate::files::write_json(&path, summary).map_err(|e| TrainError::State { path, message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics_line(step: usize) -> String {
        serde_json::to_string(&step_metrics(step, 0)).unwrap() + "\n"
    }

    fn step_metrics(step: usize, epoch: usize) -> StepMetrics {
        StepMetrics {
            step,
            epoch,
            loss: 1.0 / (step + 1) as f64,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens: 100,
            supervised_tokens: 40,
            tokens_per_s: 1e3,
            mfu: None,
            peak_memory_bytes: None,
            experts: None,
        }
    }

    #[test]
    fn epochs_end_where_the_next_begins_and_the_last_where_the_metrics_end() {
        let metrics: Vec<StepMetrics> =
            [0, 0, 0, 1, 1, 1, 2].iter().enumerate().map(|(s, &e)| step_metrics(s, e)).collect();
        assert_eq!(epoch_end_steps(&metrics), [3, 6, 7]);
        assert_eq!(epoch_end_steps(&metrics[..3]), [3]);
        assert!(epoch_end_steps(&[]).is_empty());
    }

    /// A killed run's steps after its last saved state, and its line cut off mid-write, are not kept on
    /// resume; a line that is not a step anywhere else is an error naming it.
    #[test]
    fn a_resume_keeps_the_metrics_of_the_saved_steps_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let whole: String = (0..5).map(metrics_line).collect();
        std::fs::write(&path, format!("{whole}{{\"step\": 5, \"epo")).unwrap();
        assert!(read_metrics(&path).unwrap_err().to_string().starts_with("line 6: "));
        keep_metrics_before(&path, 3).unwrap();
        let steps: Vec<usize> = read_metrics(&path).unwrap().iter().map(|m| m.step).collect();
        assert_eq!(steps, [0, 1, 2]);
        assert_eq!(metrics_totals(&path).unwrap(), (300, 120));

        std::fs::write(&path, format!("{}not a step\n{}", metrics_line(0), metrics_line(1))).unwrap();
        let err = keep_metrics_before(&path, 3).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert!(err.to_string().starts_with("line 2: "), "{err}");
        assert!(std::fs::read_to_string(&path).unwrap().contains("not a step"), "nothing rewritten");
        keep_metrics_before(&dir.path().join("none.jsonl"), 3).unwrap();
    }

    /// A resume refused for a changed setting names each one with both values; those a resume may change
    /// (activation checkpointing, the device count, whether states are saved) are not named.
    #[test]
    fn a_changed_setting_is_named_with_both_values() {
        let saved = TrainConfig { epochs: 2, lr: 4e-3, ..TrainConfig::default() };
        let now = TrainConfig {
            epochs: 1,
            adamw: AdamWConfig { beta2: 0.95, ..saved.adamw },
            activation_checkpointing: true,
            devices: 2,
            save_state: false,
            ..saved.clone()
        };
        assert!(!now.continues(&saved));
        assert_eq!(
            now.changes_from(&saved),
            ["train.epochs 2 there, 1 now", "train.adamw.beta2 0.999 there, 0.95 now"]
        );
        let resumable = TrainConfig { activation_checkpointing: true, devices: 2, save_state: false, ..saved.clone() };
        assert!(resumable.continues(&saved) && resumable.changes_from(&saved).is_empty());
    }

    /// A warmup-stable-decay config reads from TOML (`decay = "1-sqrt"`, `decay_ratio`); the default
    /// `decay_ratio` is left out of a saved config, so one saved before the key existed reads and hashes the same.
    #[test]
    fn the_decay_phase_reads_and_the_default_saves_as_before() {
        let wsd: TrainConfig = toml::from_str("decay = \"1-sqrt\"\ndecay_ratio = 0.2").unwrap();
        assert_eq!((wsd.decay, wsd.decay_ratio), (Decay::OneMinusSqrt, 0.2));
        assert!(serde_json::to_string(&wsd).unwrap().contains("\"decay\":\"1-sqrt\",\"decay_ratio\":0.2"));
        let plain = serde_json::to_value(TrainConfig::default()).unwrap();
        assert!(plain.get("decay_ratio").is_none(), "{plain}");
        assert_eq!(serde_json::from_value::<TrainConfig>(plain).unwrap(), TrainConfig::default());
        let changed = TrainConfig { decay_ratio: 0.5, ..TrainConfig::default() };
        assert_eq!(changed.changes_from(&TrainConfig::default()), ["train.decay_ratio 1.0 there, 0.5 now"]);
        assert_eq!(TrainConfig::default().changes_from(&changed), ["train.decay_ratio 0.5 there, 1.0 now"]);
    }

    /// `max_grad_norm = 0` turns clipping off; without the key the default clips at 1; a saved config (JSON,
    /// where no clipping is null) reads back the same.
    #[test]
    fn a_zero_max_grad_norm_is_no_clipping() {
        let read = |text: &str| toml::from_str::<TrainConfig>(text).unwrap().max_grad_norm;
        assert_eq!((read("max_grad_norm = 0"), read("max_grad_norm = 0.0"), read("")), (None, None, Some(1.0)));
        assert_eq!(read("max_grad_norm = 0.5"), Some(0.5));
        let off = TrainConfig { max_grad_norm: None, ..TrainConfig::default() };
        let saved: TrainConfig = serde_json::from_str(&serde_json::to_string(&off).unwrap()).unwrap();
        assert_eq!(saved, off);
        assert_eq!(off.check(), Ok(()));
    }

    /// Each setting that makes no run is refused by name; the defaults and the edges that do run pass.
    #[test]
    fn settings_that_make_no_run_are_refused_by_name() {
        let ok = TrainConfig::default();
        assert_eq!(ok.check(), Ok(()));
        let edges = [
            TrainConfig { warmup_ratio: 1.0, min_lr_ratio: 0.0, max_grad_norm: None, ..ok.clone() },
            TrainConfig { global_batch: 0, global_batch_tokens: Some(4096), ..ok.clone() },
            TrainConfig { adamw: AdamWConfig { beta1: 0.0, weight_decay: 0.0, ..ok.adamw }, ..ok.clone() },
        ];
        for cfg in edges {
            assert_eq!(cfg.check(), Ok(()), "{cfg:?}");
        }
        let bad = [
            (TrainConfig { epochs: 0, ..ok.clone() }, "train.epochs is 0"),
            (TrainConfig { micro_batch: 0, ..ok.clone() }, "train.micro_batch is 0"),
            (TrainConfig { devices: 0, ..ok.clone() }, "train.devices is 0"),
            (TrainConfig { global_batch: 0, ..ok.clone() }, "train.global_batch is 0"),
            (TrainConfig { global_batch_tokens: Some(0), ..ok.clone() }, "train.global_batch_tokens is 0"),
            (TrainConfig { lr: f64::NAN, ..ok.clone() }, "train.lr is NaN"),
            (TrainConfig { lr: -1e-5, ..ok.clone() }, "train.lr is -0.00001"),
            (TrainConfig { warmup_ratio: 2.0, ..ok.clone() }, "train.warmup_ratio is 2"),
            (TrainConfig { min_lr_ratio: -0.1, ..ok.clone() }, "train.min_lr_ratio is -0.1"),
            (TrainConfig { decay_ratio: 0.0, ..ok.clone() }, "train.decay_ratio is 0: it must be above 0"),
            (TrainConfig { decay_ratio: 1.5, ..ok.clone() }, "train.decay_ratio is 1.5"),
            (
                TrainConfig { decay: Decay::Constant, decay_ratio: 0.2, ..ok.clone() },
                "a constant rate has no decay phase",
            ),
            (TrainConfig { max_grad_norm: Some(-1.0), ..ok.clone() }, "train.max_grad_norm is -1"),
            (TrainConfig { peak_tflops: Some(f64::INFINITY), ..ok.clone() }, "train.peak_tflops is inf"),
            (TrainConfig { adamw: AdamWConfig { beta2: 1.0, ..ok.adamw }, ..ok.clone() }, "adamw.beta2 is 1"),
            (TrainConfig { adamw: AdamWConfig { eps: 0.0, ..ok.adamw }, ..ok.clone() }, "adamw.eps is 0"),
            (
                TrainConfig { adamw: AdamWConfig { weight_decay: -0.01, ..ok.adamw }, ..ok.clone() },
                "adamw.weight_decay is -0.01",
            ),
        ];
        for (cfg, expected) in bad {
            let err = cfg.check().unwrap_err();
            assert!(err.contains(expected), "{err} (expected {expected})");
        }
    }
}
