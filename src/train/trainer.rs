//! The training loop and its run directory: `train/metrics.jsonl` (one line per optimizer step),
//! `train/state/` (weights, AdamW moments and position, for `--resume`), `checkpoints/epoch-<k>/` (HF
//! exports).

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::module::ParamId;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use super::TrainError;
use super::data::{TrainData, target_weights};
use super::optim::{AdamW, AdamWConfig, step};
use super::schedule::{Decay, Schedule};
use crate::models::hf::{ExportDtype, HfNamed, write_safetensors};
use crate::models::weights::HostTensor;
use crate::models::{CausalLm, SequenceLayout, load_model};

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
    pub adamw: AdamWConfig,
    /// Sequences (packed rows) per optimizer step.
    pub global_batch: usize,
    /// The global batch in tokens instead: rows per step = this / sequence length (wins when set).
    pub global_batch_tokens: Option<usize>,
    /// Sequences per forward pass; `global_batch` must be a multiple.
    pub micro_batch: usize,
    pub max_grad_norm: Option<f64>,
    pub seed: u64,
    /// Save the resumable state every this many optimizer steps (and at every epoch end).
    pub save_every: Option<usize>,
    pub export_dtype: ExportDtype,
    /// The accelerator's dense peak in TFLOP/s, for MFU (none on the CPU).
    pub peak_tflops: Option<f64>,
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
            adamw: AdamWConfig::default(),
            global_batch: 8,
            global_batch_tokens: None,
            micro_batch: 1,
            max_grad_norm: Some(1.0),
            seed: 42,
            save_every: None,
            export_dtype: ExportDtype::Bf16,
            peak_tflops: None,
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
}

/// The training config a run's saved state was written with (None without a saved state): a resume is
/// exact only with the same config.
pub fn saved_config(run_dir: &Path) -> Option<TrainConfig> {
    let text = std::fs::read_to_string(run_dir.join("train/state/position.json")).ok()?;
    serde_json::from_str::<Position>(&text).ok().map(|p| p.config)
}

/// Tokens and supervised tokens over every step of a `metrics.jsonl` (0, 0 when it is unreadable).
pub fn metrics_totals(path: &Path) -> (u64, u64) {
    read_metrics(path).iter().fold((0, 0), |(t, s), m| (t + m.tokens, s + m.supervised_tokens))
}

/// The steps of a `metrics.jsonl`; unreadable lines are skipped.
pub fn read_metrics(path: &Path) -> Vec<StepMetrics> {
    std::fs::read_to_string(path)
        .map(|text| text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
        .unwrap_or_default()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Position {
    epoch: usize,
    step_in_epoch: usize,
    global_step: usize,
    optimizer_steps: usize,
    config: TrainConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainSummary {
    pub steps: usize,
    pub epochs_done: usize,
    pub final_loss: Option<f64>,
    pub checkpoints: Vec<PathBuf>,
    pub interrupted: bool,
    pub seconds: f64,
}

/// Mean next-token cross-entropy over the rows' supervised targets, summed and divided by `normalizer`
/// (the supervised count of the whole optimizer step), computed in f32.
pub fn masked_loss<B: burn::tensor::backend::Backend>(
    logits: Tensor<B, 3>,
    targets: &[i64],
    weights: &[f32],
    normalizer: f32,
) -> Tensor<B, 1> {
    let [b, s, _] = logits.dims();
    let device = logits.device();
    let logp = log_softmax(logits.cast(FloatDType::F32), 2);
    let target = Tensor::<B, 3, Int>::from_data(TensorData::new(targets.to_vec(), [b, s, 1]), &device);
    let nll = logp.gather(2, target).neg().reshape([b * s]);
    let w = Tensor::<B, 1>::from_data(TensorData::new(weights.to_vec(), [b * s]), &device);
    (nll * w).sum() / normalizer
}

/// `masked_loss` without the full logits: the output projection and the softmax run only on the positions
/// with a non-zero weight (the supervised targets, 30–40 % of tokens in chat SFT), so the `[tokens, vocab]`
/// logits — the memory peak of large-vocabulary models — shrink by that share. `None` when nothing in
/// `weights` is supervised.
pub fn supervised_loss<B: burn::tensor::backend::Backend>(
    hidden: Tensor<B, 3>,
    head: Tensor<B, 2>,
    targets: &[i64],
    weights: &[f32],
    normalizer: f32,
) -> Option<Tensor<B, 1>> {
    let [b, s, h] = hidden.dims();
    let device = hidden.device();
    let positions: Vec<i64> = (0..weights.len()).filter(|&i| weights[i] != 0.0).map(|i| i as i64).collect();
    if positions.is_empty() {
        return None;
    }
    let n = positions.len();
    let picked_targets: Vec<i64> = positions.iter().map(|&i| targets[i as usize]).collect();
    let picked_weights: Vec<f32> = positions.iter().map(|&i| weights[i as usize]).collect();
    let index = Tensor::<B, 1, Int>::from_data(TensorData::new(positions, [n]), &device);
    let rows = hidden.reshape([b * s, h]).select(0, index);
    let logits = rows.matmul(head.transpose());
    let logp = log_softmax(logits.cast(FloatDType::F32), 1);
    let target = Tensor::<B, 2, Int>::from_data(TensorData::new(picked_targets, [n, 1]), &device);
    let nll = logp.gather(1, target).neg().reshape([n]);
    let w = Tensor::<B, 1>::from_data(TensorData::new(picked_weights, [n]), &device);
    Some((nll * w).sum() / normalizer)
}

fn param_names<B: burn::tensor::backend::Backend>(model: &CausalLm<B>) -> HashMap<ParamId, String> {
    let mut names = HashMap::new();
    for e in model.hf_entries() {
        names.entry(e.id).or_insert(e.key);
    }
    names
}

fn write_state<B: AutodiffBackend>(
    dir: &Path,
    model: &CausalLm<B>,
    opt: &AdamW<B::InnerBackend>,
    position: &Position,
    source_dir: &Path,
) -> Result<(), TrainError> {
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    model.export(source_dir, &tmp, ExportDtype::F32, usize::MAX)?;
    let moments = opt.export_moments(&param_names(model));
    let moments: std::collections::BTreeMap<String, HostTensor> = moments.into_iter().collect();
    let moments_dir = tmp.join("optimizer");
    write_safetensors(&moments, &Default::default(), &moments_dir, ExportDtype::F32, &|_| false, usize::MAX)?;
    let text = serde_json::to_string_pretty(position).unwrap_or_default() + "\n";
    let state_err = |e: std::io::Error| TrainError::State { path: tmp.clone(), message: e.to_string() };
    std::fs::write(tmp.join("position.json"), text).map_err(state_err)?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir).map_err(|e| TrainError::State { path: dir.to_path_buf(), message: e.to_string() })
}

fn read_moments(dir: &Path) -> Result<HashMap<String, HostTensor>, TrainError> {
    use crate::models::TensorSource;
    let store = crate::models::WeightStore::open(dir)?;
    let keys: Vec<String> = store.keys().cloned().collect();
    let mut out = HashMap::new();
    for k in keys {
        let shape = store.shape(&k).map(<[usize]>::to_vec).unwrap_or_default();
        out.insert(k.clone(), store.take(&k, &shape));
    }
    store.finish(&[])?;
    Ok(out)
}

/// Trains the checkpoint in `model_dir` on the shards in `data_dir`, writing into `run_dir`.
/// `resume` continues from `run_dir/train/state` exactly where it stopped. `stop` (Ctrl-C) and `halt_after`
/// (a step count) save the state and return early. Returns the summary and the trained model.
#[allow(clippy::too_many_arguments)]
pub fn train<B: AutodiffBackend>(
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
    let data = TrainData::load(data_dir)?;
    let global_batch = match cfg.global_batch_tokens {
        Some(tokens) => (tokens / data.seq_len.max(1)).max(1),
        None => cfg.global_batch,
    };
    if cfg.micro_batch == 0 || !global_batch.is_multiple_of(cfg.micro_batch) {
        return Err(TrainError::Config(format!(
            "a global batch of {global_batch} sequences is not a multiple of the micro batch {}",
            cfg.micro_batch
        )));
    }
    let train_dir = run_dir.join("train");
    let state_dir = train_dir.join("state");
    std::fs::create_dir_all(&train_dir)
        .map_err(|e| TrainError::State { path: train_dir.clone(), message: e.to_string() })?;

    let (mut position, load_dir) = if resume && state_dir.join("position.json").is_file() {
        let text = std::fs::read_to_string(state_dir.join("position.json"))
            .map_err(|e| TrainError::State { path: state_dir.clone(), message: e.to_string() })?;
        let p: Position = serde_json::from_str(&text)
            .map_err(|e| TrainError::State { path: state_dir.clone(), message: e.to_string() })?;
        if p.config != *cfg {
            return Err(TrainError::Config(format!(
                "{} was written with another training config; resume with the same settings",
                state_dir.display()
            )));
        }
        (p, state_dir.clone())
    } else {
        if resume {
            return Err(TrainError::State { path: state_dir.clone(), message: "no saved state to resume from".into() });
        }
        (
            Position { epoch: 0, step_in_epoch: 0, global_step: 0, optimizer_steps: 0, config: cfg.clone() },
            model_dir.to_path_buf(),
        )
    };
    let (config, mut model) = load_model::<B>(&load_dir, device)?;
    let mut opt = AdamW::<B::InnerBackend>::new(cfg.adamw);
    if load_dir == state_dir {
        opt.steps = position.optimizer_steps;
        opt.import_moments(&param_names(&model), &read_moments(&state_dir.join("optimizer"))?, device)
            .map_err(|message| TrainError::State { path: state_dir.clone(), message })?;
    }
    if !resume {
        let _ = std::fs::remove_file(train_dir.join("metrics.jsonl"));
    }

    let steps_per_epoch = data.rows.len().div_ceil(global_batch);
    let total_steps = steps_per_epoch * cfg.epochs;
    let warmup = cfg.warmup_steps.unwrap_or_else(|| (cfg.warmup_ratio * total_steps as f64).ceil() as usize);
    let schedule =
        Schedule { peak: cfg.lr, min_ratio: cfg.min_lr_ratio, warmup_steps: warmup, total_steps, decay: cfg.decay };
    // Counted on the module, not by copying every weight to the host.
    let n_params = burn::module::Module::num_params(&model);
    let (params_f, attn_width) = (n_params as f64, config.attention_width() as f64);

    let bar = if show_progress { ProgressBar::new(total_steps as u64) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(position.global_step as u64);
    let mut metrics = OpenOptions::new()
        .create(true)
        .append(true)
        .open(train_dir.join("metrics.jsonl"))
        .map_err(|e| TrainError::State { path: train_dir.clone(), message: e.to_string() })?;
    let mut checkpoints = Vec::new();
    let mut last_loss = None;
    let seq = data.seq_len;

    while position.epoch < cfg.epochs {
        let order = data.order(cfg.seed, position.epoch);
        while position.step_in_epoch < steps_per_epoch {
            if stop.load(Ordering::SeqCst) || halt_after.is_some_and(|n| position.global_step >= n) {
                write_state(&state_dir, &model, &opt, &position, model_dir)?;
                bar.abandon_with_message("interrupted: state saved, continue with --resume");
                let summary = TrainSummary {
                    steps: position.global_step,
                    epochs_done: position.epoch,
                    final_loss: last_loss,
                    checkpoints,
                    interrupted: true,
                    seconds: started.elapsed().as_secs_f64(),
                };
                write_summary(&train_dir, &summary)?;
                return Ok((summary, model));
            }
            let step_started = Instant::now();
            let start = position.step_in_epoch * global_batch;
            let rows: Vec<usize> = order[start..(start + global_batch).min(order.len())].to_vec();
            let weights: Vec<Vec<f32>> = rows.iter().map(|&r| target_weights(&data.rows[r])).collect();
            let supervised: f32 = weights.iter().flatten().sum();
            let lr = schedule.lr(position.global_step);
            let mut loss_value = 0.0f64;
            let mut accumulator = GradientsAccumulator::<CausalLm<B>>::new();
            let mut tokens = 0u64;
            if supervised > 0.0 {
                for (micro, (chunk, chunk_weights)) in
                    rows.chunks(cfg.micro_batch).zip(weights.chunks(cfg.micro_batch)).enumerate()
                {
                    let b = chunk.len();
                    let mut ids = Vec::with_capacity(b * seq);
                    let mut targets = Vec::with_capacity(b * seq);
                    let mut w = Vec::with_capacity(b * seq);
                    let mut docs = Vec::with_capacity(b);
                    for (&r, row_weights) in chunk.iter().zip(chunk_weights) {
                        let row = &data.rows[r];
                        ids.extend(row.input_ids.iter().map(|&x| x as i64));
                        targets.extend(row.input_ids.iter().skip(1).map(|&x| x as i64).chain([0]));
                        w.extend_from_slice(row_weights);
                        docs.push(row.doc_lengths.clone());
                        tokens += row.used() as u64;
                    }
                    let layout = SequenceLayout::from_doc_lengths(&docs, seq);
                    let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, seq]), device);
                    let hidden = model.forward_hidden(input, &layout);
                    // A micro-batch with nothing supervised adds nothing to the step's loss or gradients.
                    let Some(loss) = supervised_loss(hidden, model.head_weight(), &targets, &w, supervised) else {
                        continue;
                    };
                    let value: f32 = loss
                        .clone()
                        .into_data()
                        .convert::<f32>()
                        .to_vec::<f32>()
                        .unwrap_or_default()
                        .first()
                        .copied()
                        .unwrap_or(f32::NAN);
                    if !value.is_finite() {
                        let samples: Vec<String> =
                            chunk.iter().flat_map(|&r| data.rows[r].sample_ids.clone()).collect();
                        return Err(TrainError::NonFinite {
                            loss: value,
                            step: position.global_step,
                            epoch: position.epoch,
                            micro,
                            samples: samples.join(", "),
                        });
                    }
                    loss_value += value as f64;
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    accumulator.accumulate(&model, grads);
                }
                let grads = accumulator.grads();
                let (updated, norm) = step::<B, _>(model, &mut opt, &grads, lr, cfg.max_grad_norm);
                model = updated;
                let secs = step_started.elapsed().as_secs_f64();
                let tokens_f = tokens as f64;
                let flops = 6.0 * params_f * tokens_f + 12.0 * attn_width * seq as f64 * tokens_f;
                let line = StepMetrics {
                    step: position.global_step,
                    epoch: position.epoch,
                    loss: loss_value,
                    lr,
                    grad_norm: norm,
                    tokens,
                    supervised_tokens: supervised as u64,
                    tokens_per_s: tokens_f / secs.max(1e-9),
                    mfu: cfg.peak_tflops.map(|p| flops / (secs.max(1e-9) * p * 1e12)),
                    peak_memory_bytes: crate::data::readers::peak_rss_bytes(),
                };
                writeln!(metrics, "{}", serde_json::to_string(&line).unwrap_or_default())
                    .map_err(|e| TrainError::State { path: train_dir.clone(), message: e.to_string() })?;
                bar.set_message(format!("loss {loss_value:.4} lr {lr:.2e}"));
                last_loss = Some(loss_value);
            }
            position.step_in_epoch += 1;
            position.global_step += 1;
            position.optimizer_steps = opt.steps;
            bar.inc(1);
            if cfg.save_every.is_some_and(|n| n > 0 && position.global_step % n == 0) {
                write_state(&state_dir, &model, &opt, &position, model_dir)?;
            }
        }
        position.epoch += 1;
        position.step_in_epoch = 0;
        let out = run_dir.join("checkpoints").join(format!("epoch-{}", position.epoch));
        model.export(model_dir, &out, cfg.export_dtype, crate::models::hf::SHARD_BYTES)?;
        checkpoints.push(out);
        write_state(&state_dir, &model, &opt, &position, model_dir)?;
    }
    bar.finish_and_clear();
    let summary = TrainSummary {
        steps: position.global_step,
        epochs_done: position.epoch,
        final_loss: last_loss,
        checkpoints,
        interrupted: false,
        seconds: started.elapsed().as_secs_f64(),
    };
    write_summary(&train_dir, &summary)?;
    Ok((summary, model))
}

/// `train/summary.json`, written at every return so a stopped run says where it stopped.
fn write_summary(train_dir: &Path, summary: &TrainSummary) -> Result<(), TrainError> {
    let path = train_dir.join("summary.json");
    crate::files::write_json(&path, summary).map_err(|e| TrainError::State { path, message: e.to_string() })
}
