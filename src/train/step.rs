//! One optimizer step, shared by `kiln train` and the training benchmark: micro-batches of packed rows →
//! forward with document boundaries → next-token cross-entropy in f32 on the supervised targets, normalized
//! by the whole step's supervised count → backward → gradients summed in f32 (and across data-parallel
//! replicas) → global-norm clipping → AdamW.

use burn::optim::GradientsParams;
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};

use super::TrainError;
use super::data::target_weights;
use super::linear_ce::{LinearCrossEntropy, chunk_rows_for};
use super::optim::{AdamW, ClipScale, F32Accumulator, read_scalars, squared_norm, step_scaled};
use super::replicas::{GradientSync, catch};
use crate::backend::host_tensor;
use crate::models::routing::{self, ExpertLoad};
use crate::models::{CausalLm, SequenceLayout};
use crate::tokens::shards::Row;

/// Mean next-token cross-entropy over the rows' supervised targets, summed and divided by `normalizer`
/// (the supervised count of the whole optimizer step), computed in f32.
pub fn masked_loss<B: Backend>(
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
    let w = host_tensor::<B, 1>(weights.to_vec(), [b * s], FloatDType::F32, &device);
    (nll * w).sum() / normalizer
}

/// `masked_loss` without the full logits (of `hidden · headᵀ`, soft-capped where `softcap` says): the
/// output projection and the cross-entropy run only on the
/// positions with a non-zero weight (the supervised targets, 30–40 % of tokens in chat SFT), and there as
/// the fused chunked op of `linear_ce`, so at most one chunk of `[rows, vocab]` logits is ever alive. `None`
/// when nothing in `weights` is supervised.
pub fn supervised_loss<B: LinearCrossEntropy>(
    hidden: Tensor<B, 3>,
    head: Tensor<B, 2>,
    softcap: Option<f64>,
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
    let chunk = chunk_rows_for(head.dims()[0]);
    Some(B::linear_cross_entropy(rows, head, softcap, &picked_targets, &picked_weights, normalizer, chunk))
}

/// The packed rows of one forward pass, flattened for the model.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    pub rows: usize,
    pub seq: usize,
    pub ids: Vec<i64>,
    /// The next token of each position (0 past the row's end); a target only where `weights` says so.
    pub targets: Vec<i64>,
    /// 1 where the next token is supervised and in the same document (`target_weights`).
    pub weights: Vec<f32>,
    pub doc_lengths: Vec<Vec<u32>>,
    /// Non-padding tokens.
    pub tokens: u64,
}

/// `pad_multiple` that keeps whole rows: every micro-batch runs at the shards' sequence length.
pub const WHOLE_ROWS: usize = 0;

/// The positions one forward pass over `rows` needs: its longest row's tokens rounded up to a multiple of
/// `pad_multiple`, at most the rows' length (all of it for `WHOLE_ROWS`). Padding sits at a row's end and
/// nothing before it reads it (attention and the convolutions are causal, its targets are unsupervised), so
/// dropping it leaves the loss and the gradients as they were.
pub fn batch_length(rows: &[&Row], pad_multiple: usize) -> usize {
    let full = rows.first().map_or(0, |r| r.input_ids.len());
    if pad_multiple == WHOLE_ROWS {
        return full;
    }
    let used = rows.iter().map(|r| r.used()).max().unwrap_or(0).max(1);
    used.div_ceil(pad_multiple).saturating_mul(pad_multiple).min(full)
}

impl MicroBatch {
    /// The rows as one forward pass of `batch_length(rows, pad_multiple)` positions.
    pub fn from_rows(rows: &[&Row], pad_multiple: usize) -> Self {
        let seq = batch_length(rows, pad_multiple);
        let mut batch = MicroBatch {
            rows: rows.len(),
            seq,
            ids: Vec::with_capacity(rows.len() * seq),
            targets: Vec::with_capacity(rows.len() * seq),
            weights: Vec::with_capacity(rows.len() * seq),
            doc_lengths: Vec::with_capacity(rows.len()),
            tokens: 0,
        };
        for row in rows {
            batch.ids.extend(row.input_ids.iter().take(seq).map(|&x| x as i64));
            batch.targets.extend(row.input_ids.iter().skip(1).map(|&x| x as i64).chain([0]).take(seq));
            batch.weights.extend(target_weights(row).into_iter().take(seq));
            batch.doc_lengths.push(row.doc_lengths.clone());
            batch.tokens += row.used() as u64;
        }
        batch
    }

    pub fn supervised(&self) -> f32 {
        self.weights.iter().sum()
    }

    /// Whether each position (row by row, `rows × seq`) holds a token of a document rather than padding.
    pub fn real_positions(&self) -> Vec<bool> {
        self.doc_lengths
            .iter()
            .flat_map(|docs| {
                let used = docs.iter().map(|&l| l as usize).sum::<usize>().min(self.seq);
                (0..self.seq).map(move |p| p < used)
            })
            .collect()
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone)]
pub struct StepOutcome {
    /// The step's loss (summed over micro-batches, each normalized by the step's supervised count).
    pub loss: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// The tokens its MoE layers gave each expert (none for a dense model).
    pub expert_load: ExpertLoad,
}

/// A micro-batch whose loss was NaN or infinite. The step's update was queued before the loss was read (the
/// device does not wait for the host inside a step), so the model it made is dropped and the optimizer's
/// state is no longer the last good step's: the caller stops, keeping its last saved checkpoint and state.
#[derive(Debug, Clone, Copy)]
pub struct NonFiniteLoss {
    pub micro: usize,
    pub loss: f32,
}

/// What one device's share of an optimizer step did (all of it on one device; a replica's part in data-parallel
/// training, `shard_step`).
#[derive(Debug, Clone, Default)]
pub struct ShardOutcome {
    /// The loss of each of its micro-batches that had something supervised, by index in the step.
    pub losses: Vec<(usize, f32)>,
    /// The step's global gradient norm before clipping (the same on every replica); `None` when nothing in the
    /// step was supervised and the model was left as it was.
    pub grad_norm: Option<f64>,
    /// What its MoE layers routed, over its micro-batches' real positions.
    pub expert_load: ExpertLoad,
}

impl ShardOutcome {
    /// The step's outcome from its shares': the losses summed in micro-batch order (so the sum does not depend
    /// on how the micro-batches were shared out), or the first non-finite one.
    pub fn merge(shards: impl IntoIterator<Item = ShardOutcome>) -> Result<Option<StepOutcome>, NonFiniteLoss> {
        let mut grad_norm = None;
        let mut losses = Vec::new();
        let mut expert_load = ExpertLoad::default();
        for shard in shards {
            grad_norm = grad_norm.or(shard.grad_norm);
            losses.extend(shard.losses);
            expert_load.add(&shard.expert_load);
        }
        let Some(grad_norm) = grad_norm else { return Ok(None) };
        losses.sort_by_key(|&(micro, _)| micro);
        if let Some(&(micro, loss)) = losses.iter().find(|(_, loss)| !loss.is_finite()) {
            return Err(NonFiniteLoss { micro, loss });
        }
        Ok(Some(StepOutcome { loss: losses.iter().map(|&(_, loss)| f64::from(loss)).sum(), grad_norm, expert_load }))
    }
}

/// The losses (on the device), the f32 gradient sum and the MoE routing load of `shard`'s micro-batches,
/// each loss normalized by `supervised`. A micro-batch with nothing supervised adds nothing.
#[allow(clippy::type_complexity)]
fn accumulate<B: LinearCrossEntropy>(
    model: &CausalLm<B>,
    shard: &[(usize, &MicroBatch)],
    supervised: f32,
    device: &B::Device,
) -> (Vec<(usize, Tensor<B::InnerBackend, 1>)>, GradientsParams, ExpertLoad) {
    // The loss values stay on the device until the step's one read: reading each before its backward
    // would leave the device idle while the host queues the backward pass.
    let mut losses = Vec::new();
    let mut accumulator = F32Accumulator::<B>::default();
    let mut expert_load = ExpertLoad::default();
    for &(micro, batch) in shard {
        let layout = SequenceLayout::from_doc_lengths(&batch.doc_lengths, batch.seq);
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(batch.ids.clone(), [batch.rows, batch.seq]), device);
        let hidden = routing::tally(&mut expert_load, batch.real_positions(), || model.forward_hidden(input, &layout));
        let head = model.head_weight();
        let Some(loss) =
            supervised_loss(hidden, head, model.logit_softcap(), &batch.targets, &batch.weights, supervised)
        else {
            continue;
        };
        losses.push((micro, loss.clone().inner()));
        accumulator.add(model, GradientsParams::from_grads(loss.backward(), model));
    }
    (losses, accumulator.finish(), expert_load)
}

/// How a step changes the model: AdamW at `lr` after clipping the gradients to the global norm `max_norm`,
/// then the MoE expert bias moved `expert_bias_rate` toward an even load (`routing::bias_steps`; 0 leaves it
/// as the checkpoint has it, as transformers does).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepRule {
    pub lr: f64,
    pub max_norm: Option<f64>,
    pub expert_bias_rate: f64,
}

impl StepRule {
    /// `model` with its expert bias moved by the step's routing `load` (all replicas' together).
    fn shift_expert_bias<B: Backend>(&self, model: CausalLm<B>, load: &ExpertLoad) -> CausalLm<B> {
        if self.expert_bias_rate > 0.0 { model.shift_expert_bias(load, self.expert_bias_rate) } else { model }
    }
}

/// Clips `grads` (the whole step's) and applies AdamW as `rule` says, then reads the losses and the norm
/// back in one transfer; the outcome carries `expert_load` (the shard's routing).
fn update<B: LinearCrossEntropy>(
    model: CausalLm<B>,
    opt: &mut AdamW<B::InnerBackend>,
    grads: &GradientsParams,
    losses: Vec<(usize, Tensor<B::InnerBackend, 1>)>,
    expert_load: ExpertLoad,
    rule: StepRule,
) -> (CausalLm<B>, ShardOutcome) {
    let squared = squared_norm::<B, _>(&model, grads);
    // Clipped on the device and queued behind the backward pass; the one read comes after.
    let scale = rule.max_norm.zip(squared.clone()).map(|(max, squared)| ClipScale::new(squared, max));
    let model = step_scaled::<B, _>(model, opt, grads, rule.lr, scale.as_ref());
    let (micros, mut scalars): (Vec<usize>, Vec<_>) = losses.into_iter().unzip();
    scalars.extend(squared);
    let values = read_scalars(scalars);
    let (loss_values, squared) = values.split_at(micros.len().min(values.len()));
    let grad_norm = squared.first().map_or(0.0, |&s| f64::from(s).sqrt());
    (
        model,
        ShardOutcome {
            losses: micros.into_iter().zip(loss_values.iter().copied()).collect(),
            grad_norm: Some(grad_norm),
            expert_load,
        },
    )
}

/// Runs one optimizer step over `batches` (the loss of each normalized by the supervised count of all of
/// them) and updates `model` as `rule` says. A step with nothing supervised returns the model unchanged and
/// `None`. The device is synchronized once, after the update is queued, to read the losses and the gradient
/// norm.
pub fn optimizer_step<B: LinearCrossEntropy>(
    model: CausalLm<B>,
    opt: &mut AdamW<B::InnerBackend>,
    batches: &[MicroBatch],
    rule: StepRule,
    device: &B::Device,
) -> Result<(CausalLm<B>, Option<StepOutcome>), NonFiniteLoss> {
    let supervised: f32 = batches.iter().map(MicroBatch::supervised).sum();
    if supervised == 0.0 {
        return Ok((model, None));
    }
    let shard: Vec<(usize, &MicroBatch)> = batches.iter().enumerate().collect();
    let (losses, grads, expert_load) = accumulate(&model, &shard, supervised, device);
    let (model, outcome) = update(model, opt, &grads, losses, expert_load, rule);
    let model = rule.shift_expert_bias(model, &outcome.expert_load);
    ShardOutcome::merge([outcome]).map(|outcome| (model, outcome))
}

/// A replica's part of a data-parallel optimizer step: the forward and backward passes of its micro-batches
/// `shard` (normalized by `supervised`, the count of the whole step), the gradient sums (and, to move the
/// expert bias, the routing loads) added across the replicas (`sync`), then the update every replica makes
/// alike. A failure in its own passes (a panic on the device) still takes part in the sums, with nothing,
/// so no replica waits on it; it is returned after.
pub fn shard_step<B: LinearCrossEntropy>(
    model: CausalLm<B>,
    opt: &mut AdamW<B::InnerBackend>,
    shard: &[(usize, &MicroBatch)],
    supervised: f32,
    rule: StepRule,
    device: &B::Device,
    sync: &GradientSync,
) -> Result<(CausalLm<B>, ShardOutcome), TrainError> {
    if supervised == 0.0 {
        return Ok((model, ShardOutcome::default()));
    }
    let (losses, grads, expert_load, failure) =
        match catch("the forward and backward passes", || accumulate(&model, shard, supervised, device)) {
            Ok((losses, grads, load)) => (losses, grads, load, None),
            Err(e) => (Vec::new(), GradientsParams::new(), ExpertLoad::default(), Some(e)),
        };
    // Summed on the host before the gradients' collective, which may fail on one replica and not another.
    let routed = (rule.expert_bias_rate > 0.0).then(|| sync.sum_expert_loads(&expert_load));
    let grads = sync.all_reduce(&model, grads)?;
    if let Some(e) = failure {
        return Err(e);
    }
    let (model, outcome) = update(model, opt, &grads, losses, expert_load, rule);
    let model = match routed {
        Some(load) => rule.shift_expert_bias(model, &load),
        None => model,
    };
    Ok((model, outcome))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of `seq` positions holding documents of `docs` tokens (ids from 1, even ids supervised), the
    /// rest padding (id 0).
    fn row(docs: &[u32], seq: usize) -> Row {
        let used: u32 = docs.iter().sum();
        let mut input_ids: Vec<u32> = (1..=used).collect();
        input_ids.resize(seq, 0);
        Row {
            loss_mask: input_ids.iter().map(|&id| u8::from(id % 2 == 0)).collect(),
            input_ids,
            doc_lengths: docs.to_vec(),
            sample_ids: docs.iter().map(|l| format!("doc-{l}")).collect(),
            sources: docs.iter().map(|_| "test".to_string()).collect(),
        }
    }

    #[test]
    fn a_batch_runs_at_its_longest_row_rounded_up_to_the_multiple() {
        let (a, b, full) = (row(&[50, 30], 256), row(&[100], 256), row(&[200, 50], 256));
        assert_eq!(batch_length(&[&a, &b], 64), 128);
        assert_eq!(batch_length(&[&a], 64), 128);
        assert_eq!(batch_length(&[&a, &b], 10), 100);
        assert_eq!(batch_length(&[&a, &b], WHOLE_ROWS), 256);
        // Never past the rows' own length.
        assert_eq!(batch_length(&[&a, &full], 64), 256);
    }

    #[test]
    fn a_trimmed_batch_keeps_every_token_target_and_weight() {
        let rows = [row(&[50, 30], 256), row(&[100], 256)];
        let refs: Vec<&Row> = rows.iter().collect();
        let (whole, trimmed) = (MicroBatch::from_rows(&refs, WHOLE_ROWS), MicroBatch::from_rows(&refs, 64));
        assert_eq!((whole.seq, trimmed.seq), (256, 128));
        assert_eq!((trimmed.rows, trimmed.ids.len(), trimmed.weights.len()), (2, 256, 256));
        assert_eq!((trimmed.tokens, trimmed.doc_lengths.clone()), (whole.tokens, whole.doc_lengths.clone()));
        assert_eq!(trimmed.supervised(), whole.supervised());
        assert!(trimmed.supervised() > 0.0);
        for r in 0..2 {
            let (kept, dropped, part) = (r * 256..r * 256 + 128, r * 256 + 128..(r + 1) * 256, r * 128..(r + 1) * 128);
            assert_eq!(trimmed.ids[part.clone()], whole.ids[kept.clone()]);
            assert_eq!(trimmed.targets[part.clone()], whole.targets[kept.clone()]);
            assert_eq!(trimmed.weights[part], whole.weights[kept]);
            assert!(whole.weights[dropped].iter().all(|&w| w == 0.0), "row {r}: a dropped position was supervised");
        }
    }

    /// The positions a batch's rows fill with documents are real, their padding is not, row by row.
    #[test]
    fn the_real_positions_are_each_row_s_documents() {
        let rows = [row(&[3, 2], 16), row(&[7], 16), row(&[10, 6], 16)];
        let refs: Vec<&Row> = rows.iter().collect();
        let batch = MicroBatch::from_rows(&refs, 4);
        assert_eq!(batch.seq, 16);
        let real = batch.real_positions();
        let runs: Vec<usize> = real.chunks(16).map(|r| r.iter().take_while(|&&x| x).count()).collect();
        assert_eq!(runs, [5, 7, 16]);
        assert_eq!(real.iter().filter(|&&x| x).count() as u64, batch.tokens);
        // A trimmed batch: the longest row (7 tokens) runs at 8 positions.
        let short = MicroBatch::from_rows(&refs[..2], 4);
        assert_eq!(short.real_positions().iter().map(|&x| u8::from(x)).collect::<Vec<_>>(), {
            let mut expect = vec![1, 1, 1, 1, 1, 0, 0, 0];
            expect.extend([1, 1, 1, 1, 1, 1, 1, 0]);
            expect
        });
    }
}
