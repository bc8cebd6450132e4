//! One optimizer step, shared by `kiln train` and the training benchmark: micro-batches of packed rows →
//! forward with document boundaries → next-token cross-entropy in f32 on the supervised targets, normalized
//! by the whole step's supervised count → backward → gradients summed in f32 → global-norm clipping → AdamW.

use burn::optim::GradientsParams;
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};

use super::data::target_weights;
use super::linear_ce::{LinearCrossEntropy, chunk_rows_for};
use super::optim::{AdamW, ClipScale, F32Accumulator, read_scalars, squared_norm, step_scaled};
use crate::backend::host_tensor;
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

/// `masked_loss` without the full logits: the output projection and the cross-entropy run only on the
/// positions with a non-zero weight (the supervised targets, 30–40 % of tokens in chat SFT), and there as
/// the fused chunked op of `linear_ce`, so at most one chunk of `[rows, vocab]` logits is ever alive. `None`
/// when nothing in `weights` is supervised.
pub fn supervised_loss<B: LinearCrossEntropy>(
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
    let chunk = chunk_rows_for(head.dims()[0]);
    Some(B::linear_cross_entropy(rows, head, &picked_targets, &picked_weights, normalizer, chunk))
}

/// The packed rows of one forward pass, flattened for the model.
pub struct MicroBatch {
    pub rows: usize,
    pub seq: usize,
    pub ids: Vec<i64>,
    /// The next token of each position (0 after a row's last token, never supervised).
    pub targets: Vec<i64>,
    /// 1 where the next token is supervised and in the same document (`target_weights`).
    pub weights: Vec<f32>,
    pub doc_lengths: Vec<Vec<u32>>,
    /// Non-padding tokens.
    pub tokens: u64,
}

impl MicroBatch {
    pub fn from_rows(rows: &[&Row]) -> Self {
        let seq = rows.first().map_or(0, |r| r.input_ids.len());
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
            batch.ids.extend(row.input_ids.iter().map(|&x| x as i64));
            batch.targets.extend(row.input_ids.iter().skip(1).map(|&x| x as i64).chain([0]));
            batch.weights.extend(target_weights(row));
            batch.doc_lengths.push(row.doc_lengths.clone());
            batch.tokens += row.used() as u64;
        }
        batch
    }

    pub fn supervised(&self) -> f32 {
        self.weights.iter().sum()
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy)]
pub struct StepOutcome {
    /// The step's loss (summed over micro-batches, each normalized by the step's supervised count).
    pub loss: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
}

/// A micro-batch whose loss was NaN or infinite. The step's update was queued before the loss was read (the
/// device does not wait for the host inside a step), so the model it made is dropped and the optimizer's
/// state is no longer the last good step's: the caller stops, keeping its last saved checkpoint and state.
#[derive(Debug, Clone, Copy)]
pub struct NonFiniteLoss {
    pub micro: usize,
    pub loss: f32,
}

/// Runs one optimizer step over `batches` (the loss of each normalized by the supervised count of all of
/// them) and updates `model` with AdamW at `lr` after clipping to `max_norm`. A step with nothing supervised
/// returns the model unchanged and `None`. The device is synchronized once, after the update is queued,
/// to read the losses and the gradient norm.
pub fn optimizer_step<B: LinearCrossEntropy>(
    model: CausalLm<B>,
    opt: &mut AdamW<B::InnerBackend>,
    batches: &[MicroBatch],
    lr: f64,
    max_norm: Option<f64>,
    device: &B::Device,
) -> Result<(CausalLm<B>, Option<StepOutcome>), NonFiniteLoss> {
    let supervised: f32 = batches.iter().map(MicroBatch::supervised).sum();
    if supervised == 0.0 {
        return Ok((model, None));
    }
    // The loss values stay on the device until the step's one read: reading each before its backward
    // would leave the device idle while the host queues the backward pass.
    let mut losses = Vec::new();
    let mut accumulator = F32Accumulator::<B>::default();
    for (micro, batch) in batches.iter().enumerate() {
        let layout = SequenceLayout::from_doc_lengths(&batch.doc_lengths, batch.seq);
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(batch.ids.clone(), [batch.rows, batch.seq]), device);
        let hidden = model.forward_hidden(input, &layout);
        // A micro-batch with nothing supervised adds nothing to the step's loss or gradients.
        let Some(loss) = supervised_loss(hidden, model.head_weight(), &batch.targets, &batch.weights, supervised)
        else {
            continue;
        };
        losses.push((micro, loss.clone().inner()));
        accumulator.add(&model, GradientsParams::from_grads(loss.backward(), &model));
    }
    let grads = accumulator.finish();
    let squared = squared_norm::<B, _>(&model, &grads);
    // Clipped on the device and queued behind the backward pass; the one read comes after.
    let scale = max_norm.zip(squared.clone()).map(|(max, squared)| ClipScale::new(squared, max));
    let model = step_scaled::<B, _>(model, opt, &grads, lr, scale.as_ref());
    let (micros, mut scalars): (Vec<usize>, Vec<_>) = losses.into_iter().unzip();
    scalars.extend(squared);
    let values = read_scalars(scalars);
    let (loss_values, squared) = values.split_at(micros.len().min(values.len()));
    let mut loss_sum = 0.0f64;
    for (&micro, &value) in micros.iter().zip(loss_values) {
        if !value.is_finite() {
            return Err(NonFiniteLoss { micro, loss: value });
        }
        loss_sum += value as f64;
    }
    let grad_norm = squared.first().map_or(0.0, |&s| f64::from(s).sqrt());
    Ok((model, Some(StepOutcome { loss: loss_sum, grad_norm })))
}
