//! The validation loss: the held-out split's shards (`data/validation/`, which `kiln prepare` writes at a
//! `validation_share`), the mean cross-entropy of their supervised tokens under the model as it stands
//! (forward passes only, no graph kept), over the whole split and per data source, with an MoE's routing
//! load over the split, and `train/validation.jsonl`: a line for the base model before the first step, one at
//! every epoch end (for `checkpoints/epoch-<k>`) and one every `validation_every` steps.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData};
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use super::TrainError;
use super::data::{TrainData, target_weights};
use super::linear_ce::LinearCrossEntropy;
use super::optim::read_scalars;
use super::replicas::{Replicas, ValidationShare, split};
use super::step::{MicroBatch, supervised_loss};
use crate::models::routing::{self, ExpertLoad, LoadBalance};
use crate::models::{CausalLm, SequenceLayout};
use crate::tokens::prepare::VALIDATION_DIR;
use crate::tokens::shards::Row;

/// One line of `train/validation.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationPoint {
    /// Optimizer steps taken when it was measured (0: the base model).
    pub step: usize,
    /// Epochs done, with the fraction of the current one.
    pub epoch: f64,
    /// The checkpoint these weights are: `base`, `epoch-<k>`; none between epoch ends.
    pub checkpoint: Option<String>,
    /// Mean next-token cross-entropy over the split's supervised tokens.
    pub loss: f64,
    pub supervised_tokens: u64,
    /// The same by the source each document came from (ingest's source names: `terminal`, `toolbench`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sources: BTreeMap<String, SourceLoss>,
    /// Tokens of the split each expert of each MoE layer was given (none for a dense model): the same split
    /// under every checkpoint, so the base's and the epochs' loads compare as they are.
    #[serde(default, skip_serializing_if = "ExpertLoad::is_empty")]
    pub expert_tokens: ExpertLoad,
    pub seconds: f64,
}

/// The mean cross-entropy of some supervised targets and their count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SourceLoss {
    pub loss: f64,
    pub supervised_tokens: u64,
}

/// The validation split under the shards' folder `data_dir`, when prepare held one out; one without a
/// supervised target is an error (its loss would be no number).
pub fn load_split(data_dir: &Path) -> Result<Option<TrainData>, TrainError> {
    let dir = data_dir.join(VALIDATION_DIR);
    if !dir.is_dir() {
        return Ok(None);
    }
    let data = TrainData::load(&dir)?;
    if !data.rows.iter().any(|row| target_weights(row).contains(&1.0)) {
        return Err(TrainError::Data {
            path: dir,
            message: "the validation split has no supervised target: prepare again with another validation_share"
                .into(),
        });
    }
    Ok(Some(data))
}

/// Measures and records the validation loss of a training run; with data-parallel replicas, each runs its
/// share of the split's micro-batches.
pub struct Validator {
    data: Arc<TrainData>,
    micro_batch: usize,
    pad_multiple: usize,
    every: Option<usize>,
    steps_per_epoch: usize,
    path: PathBuf,
    show_progress: bool,
}

impl Validator {
    /// For the run configured by `cfg` with `train_dir` as its `train/` folder; `show_progress` prints each
    /// measure.
    pub fn new(
        data: TrainData,
        cfg: &super::TrainConfig,
        train_dir: &Path,
        steps_per_epoch: usize,
        show_progress: bool,
    ) -> Self {
        Validator {
            data: Arc::new(data),
            micro_batch: cfg.micro_batch,
            pad_multiple: cfg.pad_multiple,
            every: cfg.validation_every,
            steps_per_epoch,
            path: points_path(train_dir),
            show_progress,
        }
    }

    /// Starts the record afresh, or, resuming at `resumed_at`, keeps what was measured through that step.
    pub fn keep_through_resumed(&self, resumed_at: Option<usize>) -> Result<(), TrainError> {
        let kept = match resumed_at {
            Some(step) => keep_through(&self.path, step),
            None => crate::files::remove_if_present(&self.path),
        };
        kept.map_err(|e| self.state_error(e))
    }

    /// Whether `validation_every` asks for a measure after `step` steps.
    pub fn due(&self, step: usize) -> bool {
        self.every.is_some_and(|n| step.is_multiple_of(n))
    }

    /// The loss of `model` after `step` steps, recorded as `checkpoint` and printed above `bar`; `replicas`
    /// (the other data-parallel replicas, whose models equal `model` between steps) take their shares of the
    /// micro-batches. A non-finite loss is an error: the weights give no number on held-out data.
    pub fn measure<B: LinearCrossEntropy>(
        &self,
        model: &CausalLm<B>,
        device: &B::Device,
        replicas: Option<&mut Replicas<B>>,
        step: usize,
        checkpoint: Option<String>,
        bar: &ProgressBar,
    ) -> Result<ValidationPoint, TrainError> {
        let started = Instant::now();
        let SplitSums { sources, expert_load } = match replicas {
            None => split_sums(model, &self.data, self.micro_batch, self.pad_multiple, device),
            Some(replicas) => self.shared_sums(model, device, replicas)?,
        };
        let supervised_tokens: u64 = sources.values().map(|s| s.supervised_tokens).sum();
        let sum: f64 = sources.values().map(|s| s.loss * s.supervised_tokens as f64).sum();
        let loss = sum / supervised_tokens.max(1) as f64;
        let what = checkpoint.as_deref().map_or(format!("step {step}"), |c| format!("{c} (step {step})"));
        if !loss.is_finite() {
            return Err(TrainError::Data {
                path: self.path.clone(),
                message: format!("the validation loss of {what} is {loss}: the weights give non-finite values"),
            });
        }
        let point = ValidationPoint {
            step,
            epoch: step as f64 / self.steps_per_epoch.max(1) as f64,
            checkpoint,
            loss,
            supervised_tokens,
            sources,
            expert_tokens: expert_load,
            seconds: started.elapsed().as_secs_f64(),
        };
        record(&self.path, &point).map_err(|e| self.state_error(e))?;
        if self.show_progress {
            let routing = point.expert_tokens.balance().map_or(String::new(), |b| {
                format!(", expert MaxVio {:.3} (worst layer {} at {:.3})", b.max_vio, b.worst_layer, b.worst_max_vio)
            });
            bar.suspend(|| {
                eprintln!(
                    "train: validation loss {loss:.4} at {what} over {supervised_tokens} supervised tokens{routing} \
                     ({:.1} s)",
                    point.seconds
                )
            });
        }
        Ok(point)
    }

    /// `split_sums` with micro-batch `i` on replica `i mod N` (round robin, as a step's), this one's share
    /// run here while the others run theirs; the sums added in batch order, as on one device.
    fn shared_sums<B: LinearCrossEntropy>(
        &self,
        model: &CausalLm<B>,
        device: &B::Device,
        replicas: &mut Replicas<B>,
    ) -> Result<SplitSums, TrainError> {
        let numbers = |share: Vec<(usize, usize)>| share.into_iter().map(|(_, batch)| batch).collect::<Vec<_>>();
        let mut shares = split(0..batch_count(&self.data, self.micro_batch), replicas.count()).into_iter();
        let own = numbers(shares.next().unwrap_or_default());
        let theirs = shares.map(|share| ValidationShare {
            data: self.data.clone(),
            batches: numbers(share),
            micro_batch: self.micro_batch,
            pad_multiple: self.pad_multiple,
        });
        replicas.send_validation(theirs.collect())?;
        let mut sums = batch_sums(model, &self.data, &own, self.micro_batch, self.pad_multiple, device);
        // Collected whatever this share gave: every replica must be done before the next job.
        for outcome in replicas.collect_validation() {
            sums.extend(outcome?);
        }
        Ok(merge_sums(sums))
    }

    /// The point last recorded: its loss and, for an MoE, its routing.
    pub fn last_point(&self) -> Option<ValidationPoint> {
        read_points(&self.path).ok()?.pop()
    }

    fn state_error(&self, e: std::io::Error) -> TrainError {
        TrainError::State { path: self.path.clone(), message: e.to_string() }
    }
}

/// One validation micro-batch's supervised cross-entropy sum and target count by source, and what its MoE
/// layers routed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchSums {
    pub sources: Vec<(String, f32, u64)>,
    pub expert_load: ExpertLoad,
}

/// A whole measure's figures: the mean loss and target count per source, and the routing load.
#[derive(Debug, Clone, Default)]
pub struct SplitSums {
    pub sources: BTreeMap<String, SourceLoss>,
    pub expert_load: ExpertLoad,
}

/// The validation micro-batches of `data`: `micro_batch` rows at a time, in file order.
pub fn batch_count(data: &TrainData, micro_batch: usize) -> usize {
    data.rows.len().div_ceil(micro_batch.max(1))
}

/// The sums of the micro-batches numbered `batches` (`batch_count`'s numbering) under `model`, each run at
/// its rows' length rounded up to `pad_multiple`. The passes run on parameters that take no gradient, so no
/// autodiff graph is built. A source's targets go through the fused projection + loss on their own (the
/// sources part the positions, so this costs what one call would); each batch's sums are read back together.
pub fn batch_sums<B: LinearCrossEntropy>(
    model: &CausalLm<B>,
    data: &TrainData,
    batches: &[usize],
    micro_batch: usize,
    pad_multiple: usize,
    device: &B::Device,
) -> Vec<(usize, BatchSums)> {
    let model = model.clone().no_grad();
    let micro_batch = micro_batch.max(1);
    let mut out = Vec::with_capacity(batches.len());
    for &index in batches {
        let start = index * micro_batch;
        let Some(rows) = data.rows.get(start..(start + micro_batch).min(data.rows.len())).filter(|r| !r.is_empty())
        else {
            continue;
        };
        let rows: Vec<&Row> = rows.iter().collect();
        let batch = MicroBatch::from_rows(&rows, pad_multiple);
        let layout = SequenceLayout::from_doc_lengths(&batch.doc_lengths, batch.seq);
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(batch.ids.clone(), [batch.rows, batch.seq]), device);
        let mut expert_load = ExpertLoad::default();
        let hidden = routing::tally(&mut expert_load, batch.real_positions(), || model.forward_hidden(input, &layout));
        let mut names = Vec::new();
        let mut losses = Vec::new();
        for (source, weights) in source_weights(&rows, &batch) {
            let (head, cap) = (model.head_weight(), model.logit_softcap());
            if let Some(loss) = supervised_loss(hidden.clone(), head, cap, &batch.targets, &weights, 1.0) {
                names.push((source, weights.iter().sum::<f32>() as u64));
                losses.push(loss);
            }
        }
        let sums = names.into_iter().zip(read_scalars(losses)).map(|((s, count), sum)| (s.to_string(), sum, count));
        out.push((index, BatchSums { sources: sums.collect(), expert_load }));
    }
    out
}

/// The mean loss and target count per source from every batch's sums, added in f64 in batch order (the
/// order one device adds them in, however the batches were shared out), and the routing load of them all.
pub fn merge_sums(mut sums: Vec<(usize, BatchSums)>) -> SplitSums {
    sums.sort_by_key(|(index, _)| *index);
    let mut totals: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    let mut expert_load = ExpertLoad::default();
    for (_, batch) in sums {
        expert_load.add(&batch.expert_load);
        for (source, sum, count) in batch.sources {
            let entry = totals.entry(source).or_default();
            entry.0 += f64::from(sum);
            entry.1 += count;
        }
    }
    let sources = totals
        .into_iter()
        .map(|(source, (sum, count))| {
            (source, SourceLoss { loss: sum / count.max(1) as f64, supervised_tokens: count })
        })
        .collect();
    SplitSums { sources, expert_load }
}

/// The mean cross-entropy of `data`'s supervised targets under `model` and their count, per source, and the
/// routing load, on one device.
pub fn split_sums<B: LinearCrossEntropy>(
    model: &CausalLm<B>,
    data: &TrainData,
    micro_batch: usize,
    pad_multiple: usize,
    device: &B::Device,
) -> SplitSums {
    let all: Vec<usize> = (0..batch_count(data, micro_batch)).collect();
    merge_sums(batch_sums(model, data, &all, micro_batch, pad_multiple, device))
}

/// `batch.weights` split by the source of the document each position lies in (`rows` are the batch's).
fn source_weights<'a>(rows: &[&'a Row], batch: &MicroBatch) -> BTreeMap<&'a str, Vec<f32>> {
    let mut out: BTreeMap<&str, Vec<f32>> = BTreeMap::new();
    for (r, row) in rows.iter().enumerate() {
        let mut start = 0;
        for (&len, source) in row.doc_lengths.iter().zip(&row.sources) {
            let (from, to) =
                (r * batch.seq + start.min(batch.seq), r * batch.seq + (start + len as usize).min(batch.seq));
            let weights = out.entry(source.as_str()).or_insert_with(|| vec![0.0; batch.weights.len()]);
            weights[from..to].copy_from_slice(&batch.weights[from..to]);
            start += len as usize;
        }
    }
    out
}

/// `train/validation.jsonl` of a run's `train/` folder.
pub fn points_path(train_dir: &Path) -> PathBuf {
    train_dir.join("validation.jsonl")
}

/// The points of a `validation.jsonl`; none when there is no file. A line that is not a point is an error
/// naming it (`InvalidData`).
pub fn read_points(path: &Path) -> std::io::Result<Vec<ValidationPoint>> {
    match std::fs::read_to_string(path) {
        Ok(text) => crate::files::parse_json_lines(&text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Adds `point`, replacing one of the same step and checkpoint: a resumed run that measures again what a
/// killed one had measured after its last saved state records it once.
pub fn record(path: &Path, point: &ValidationPoint) -> std::io::Result<()> {
    crate::files::retain_json_lines(path, |p: &ValidationPoint| {
        (p.step, &p.checkpoint) != (point.step, &point.checkpoint)
    })?;
    let line = serde_json::to_string(point).map_err(std::io::Error::other)? + "\n";
    std::fs::OpenOptions::new().create(true).append(true).open(path)?.write_all(line.as_bytes())
}

/// On resume, keeps the points measured at or before the saved step: those after it belong to steps the run
/// takes again (and a line cut off mid-write goes with them).
pub fn keep_through(path: &Path, step: usize) -> std::io::Result<()> {
    crate::files::retain_json_lines(path, |p: &ValidationPoint| p.step <= step)
}

/// The last point measured for each checkpoint, labelled, in file order (a resumed run may have measured one
/// again).
pub fn checkpoint_points(points: &[ValidationPoint]) -> Vec<(&str, &ValidationPoint)> {
    let mut out: Vec<(&str, &ValidationPoint)> = Vec::new();
    for p in points {
        if let Some(name) = &p.checkpoint {
            out.retain(|(n, _)| n != name);
            out.push((name, p));
        }
    }
    out
}

/// An MoE's routing balance at each checkpoint that has one (`checkpoint_points`), in file order.
pub fn checkpoint_balances(points: &[ValidationPoint]) -> Vec<(&str, LoadBalance)> {
    checkpoint_points(points).into_iter().filter_map(|(name, p)| Some((name, p.expert_tokens.balance()?))).collect()
}

/// The checkpoint label of the last point per checkpoint, as `(checkpoint, loss)` in file order.
pub fn checkpoint_losses(points: &[ValidationPoint]) -> Vec<(String, f64)> {
    checkpoint_points(points).into_iter().map(|(name, p)| (name.to_string(), p.loss)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(step: usize, checkpoint: Option<&str>, loss: f64) -> ValidationPoint {
        ValidationPoint {
            step,
            epoch: step as f64 / 4.0,
            checkpoint: checkpoint.map(str::to_string),
            loss,
            supervised_tokens: 10,
            sources: BTreeMap::new(),
            expert_tokens: ExpertLoad::default(),
            seconds: 0.1,
        }
    }

    /// Each position's weight goes to the source of the document it lies in, in rows whose padding the batch
    /// drops too; together the sources' weights are the batch's.
    #[test]
    fn a_batch_s_targets_are_parted_by_source() {
        let row = |docs: Vec<u32>, sources: Vec<&str>, seq: usize| Row {
            input_ids: (1..=seq as u32).collect(),
            loss_mask: vec![1; seq],
            sample_ids: sources.iter().map(|s| format!("{s}-doc")).collect(),
            sources: sources.into_iter().map(str::to_string).collect(),
            doc_lengths: docs,
        };
        let rows = [row(vec![3, 4], vec!["a", "b"], 16), row(vec![2, 5, 3], vec!["b", "a", "b"], 16)];
        let refs: Vec<&Row> = rows.iter().collect();
        let batch = MicroBatch::from_rows(&refs, 4);
        assert_eq!(batch.seq, 12);
        let parts = source_weights(&refs, &batch);
        assert_eq!(parts.keys().copied().collect::<Vec<_>>(), ["a", "b"]);
        let ones = |w: &[f32]| w.iter().enumerate().filter(|(_, x)| **x == 1.0).map(|(i, _)| i).collect::<Vec<_>>();
        // A document's last position has no target in it. Row 0: a = 0..3, b = 3..7; row 1 from 12: b = 12..14,
        // a = 14..19, b = 19..22.
        assert_eq!(ones(&parts["a"]), [0, 1, 14, 15, 16, 17]);
        assert_eq!(ones(&parts["b"]), [3, 4, 5, 12, 19, 20]);
        let total: Vec<f32> = (0..batch.weights.len()).map(|i| parts["a"][i] + parts["b"][i]).collect();
        assert_eq!(total, batch.weights);
    }

    /// A point measured again (a resumed run redoing what a killed one had done after its last state) is
    /// recorded once; a resume keeps the points through its step, drops later ones and a line cut off.
    #[test]
    fn points_are_recorded_once_and_a_resume_keeps_those_through_its_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = points_path(dir.path());
        assert!(read_points(&path).unwrap().is_empty());
        record(&path, &point(0, Some("base"), 3.0)).unwrap();
        record(&path, &point(2, None, 2.5)).unwrap();
        record(&path, &point(4, Some("epoch-1"), 2.0)).unwrap();
        record(&path, &point(4, Some("epoch-1"), 2.0)).unwrap();
        assert_eq!(read_points(&path).unwrap().len(), 3);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"step\": 6, \"epo");
        std::fs::write(&path, text).unwrap();
        assert!(read_points(&path).unwrap_err().to_string().starts_with("line 4: "));
        keep_through(&path, 2).unwrap();
        let steps: Vec<usize> = read_points(&path).unwrap().iter().map(|p| p.step).collect();
        assert_eq!(steps, [0, 2]);
        record(&path, &point(4, Some("epoch-1"), 1.9)).unwrap();
        record(&path, &point(8, Some("epoch-2"), 1.7)).unwrap();
        assert_eq!(
            checkpoint_losses(&read_points(&path).unwrap()),
            [("base".to_string(), 3.0), ("epoch-1".to_string(), 1.9), ("epoch-2".to_string(), 1.7)]
        );
        keep_through(&dir.path().join("none.jsonl"), 3).unwrap();
    }
}
