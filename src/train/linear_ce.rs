//! The output projection and the cross-entropy as one differentiable op that never holds the whole
//! `[tokens, vocab]` logits: rows go through in chunks, and each chunk's gradients (of the hidden rows and
//! of the head) are taken while its logits are alive, in the forward pass. The backward pass then only
//! scales the stored gradients by the loss's incoming gradient, so the op costs the three matmuls of the
//! plain composition and its memory peak is one chunk of logits instead of several full `[tokens, vocab]`
//! tensors in f32 (the peak of 65k–248k vocabularies). The loss is in f32 whatever the compute dtype. Each
//! chunk's rows (loss and logit gradients from the logits) are the backend's (`CrossEntropyRows`): the
//! tensor ops here, one CubeCL kernel on the CubeCL backends (`kernels::cross_entropy`).
//!
//! The plain composition (`step::masked_loss`: matmul → f32 → log-softmax → gather) is the reference the
//! tests compare this op with, in value and in both gradients, and what runs under
//! `models::set_reference_ops(true)`.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
use burn::tensor::activation::tanh;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, IndexingUpdateOp, Int, Tensor, TensorData, TensorPrimitive};

use super::optim::OptimizerOps;
use super::step::masked_loss;
use crate::backend::host_tensor;
use crate::models::ModelBackend;
use crate::models::layers::soft_cap;
use crate::models::ops::reference_ops;

/// The f32 logits one chunk may hold (256 MiB: 1024 rows of a 65k vocabulary, 264 of Qwen3.5's 248k).
pub const CHUNK_LOGIT_BYTES: usize = 256 << 20;

/// Rows per chunk for a vocabulary, so that a chunk's f32 logits stay within `CHUNK_LOGIT_BYTES`.
pub fn chunk_rows_for(vocab: usize) -> usize {
    (CHUNK_LOGIT_BYTES / vocab.max(1).saturating_mul(4)).max(1)
}

/// A training backend: the models' attention with its hand-written backward (`ModelBackend`), the fused
/// projection + cross-entropy, and the gradient norm's sum of squares on the backend under it (`OptimizerOps`).
pub trait LinearCrossEntropy: AutodiffBackend<InnerBackend: OptimizerOps> + ModelBackend {
    /// `Σᵢ weightsᵢ · CE(cap(hiddenᵢ · headᵀ), targetsᵢ) / normalizer` as a `[1]` f32 tensor, differentiable
    /// in `hidden` (`[rows, width]`) and `head` (`[vocab, width]`), with `chunk_rows` rows of logits at a time;
    /// `cap` is the logits' soft-cap `c·tanh(x/c)` where `softcap` gives `c` (Gemma 4), else none.
    fn linear_cross_entropy(
        hidden: Tensor<Self, 2>,
        head: Tensor<Self, 2>,
        softcap: Option<f64>,
        targets: &[i64],
        weights: &[f32],
        normalizer: f32,
        chunk_rows: usize,
    ) -> Tensor<Self, 1>;
}

/// The loss of `chunked_cross_entropy` and the gradients it was asked for (of the loss with respect to
/// the hidden rows and to the head, in their dtypes).
pub struct ChunkedCrossEntropy<B: Backend> {
    pub loss: Tensor<B, 1>,
    pub grad_hidden: Option<Tensor<B, 2>>,
    pub grad_head: Option<Tensor<B, 2>>,
}

/// The op's forward pass on a plain backend: the weighted cross-entropy of `hidden · headᵀ` chunk by chunk
/// (soft-capped as `c·tanh(x/c)` in the compute dtype where `softcap` gives `c`, then cast to f32,
/// max-shifted log-sum-exp), and, when asked, its gradients `dlogits = coef · (softmax − onehot(target))`
/// with `coef = weight / normalizer` (times the cap's slope `1 − tanh²`), carried back through the
/// projection per chunk (`dlogits · head` for the rows, `Σ dlogitsᵀ · rows` in f32 for the head).
#[allow(clippy::too_many_arguments)]
pub fn chunked_cross_entropy<B: CrossEntropyRows>(
    hidden: Tensor<B, 2>,
    head: Tensor<B, 2>,
    softcap: Option<f64>,
    targets: &[i64],
    weights: &[f32],
    normalizer: f32,
    chunk_rows: usize,
    want_hidden: bool,
    want_head: bool,
) -> ChunkedCrossEntropy<B> {
    let [rows, _] = hidden.dims();
    assert_eq!(targets.len(), rows, "one target per hidden row");
    assert_eq!(weights.len(), rows, "one weight per hidden row");
    let device = hidden.device();
    let head_t = head.clone().transpose();
    let mut loss = f32_column::<B>(&[0.0], &device).reshape([1]);
    let mut grad_rows = Vec::new();
    let mut grad_head: Option<Tensor<B, 2>> = None;
    let chunk = chunk_rows.max(1);
    for start in (0..rows).step_by(chunk) {
        let len = chunk.min(rows - start);
        let rows_in = hidden.clone().narrow(0, start, len);
        let logits = B::matmul(rows_in.clone(), head_t.clone());
        let (logits, cap_slope) = match softcap {
            Some(cap) => {
                let t = tanh(logits / cap);
                (t.clone() * cap, Some(t.clone().mul(t).neg() + 1.0))
            }
            None => (logits, None),
        };
        let target =
            Tensor::<B, 2, Int>::from_data(TensorData::new(targets[start..start + len].to_vec(), [len, 1]), &device);
        let weight = f32_column::<B>(&weights[start..start + len], &device);
        let with_grads = want_hidden || want_head;
        let (nll, dlogits) = B::cross_entropy_rows(logits, target, weight.clone() / normalizer, with_grads);
        loss = loss + (nll * weight).sum();
        let Some(dlogits) = dlogits else {
            continue;
        };
        let dlogits = match cap_slope {
            Some(slope) => dlogits * slope,
            None => dlogits,
        };
        if want_hidden {
            grad_rows.push(B::matmul(dlogits.clone(), head.clone()));
        }
        if want_head {
            let part = B::matmul(dlogits.transpose(), rows_in).cast(FloatDType::F32);
            grad_head = Some(match grad_head {
                Some(sum) => sum + part,
                None => part,
            });
        }
    }
    let head_dtype = FloatDType::from(head.dtype());
    ChunkedCrossEntropy {
        loss: loss / normalizer,
        grad_hidden: (want_hidden && !grad_rows.is_empty()).then(|| Tensor::cat(grad_rows, 0)),
        grad_head: grad_head.map(|g| g.cast(head_dtype)),
    }
}

/// The backends' rows of `chunked_cross_entropy`: from one chunk's logits `[rows, vocab]` in the compute
/// dtype, targets `[rows, 1]` and coefficients `weight / normalizer` `[rows, 1]` in f32, each row's negative
/// log-likelihood `[rows, 1]` in f32 and, `with_grads`, `dlogits = coef · (softmax − onehot(target))` in the
/// logits' dtype. The tensor ops of `cross_entropy_rows` by default; the CubeCL backends run one kernel
/// (`kernels::cross_entropy`) unless `KILN_LOSS_KERNEL=off`.
pub trait CrossEntropyRows: ModelBackend {
    fn cross_entropy_rows(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 2, Int>,
        coef: Tensor<Self, 2>,
        with_grads: bool,
    ) -> (Tensor<Self, 2>, Option<Tensor<Self, 2>>) {
        cross_entropy_rows(logits, targets, coef, with_grads)
    }
}

/// `CrossEntropyRows::cross_entropy_rows` as tensor ops: logits cast to f32, max-shifted log-sum-exp, the
/// target's term scattered into the softmax.
pub fn cross_entropy_rows<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 2, Int>,
    coef: Tensor<B, 2>,
    with_grads: bool,
) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
    let compute = FloatDType::from(logits.dtype());
    // The target's logit is gathered from the input, not from `shifted`: burn-fusion 0.21 fuses a gather
    // into the element-wise kernel that computes the tensor it reads and then reads memory not yet written
    // (wrong losses on the fused CubeCL backends from 64 columns on; tests/vulkan_backend.rs).
    let picked = logits.clone().gather(1, targets.clone()).cast(FloatDType::F32);
    let logits = logits.cast(FloatDType::F32);
    let max = logits.clone().max_dim(1);
    let shifted = logits - max.clone();
    let exp = shifted.exp();
    let sum = exp.clone().sum_dim(1);
    let nll = sum.clone().log() - (picked - max);
    let dlogits = with_grads
        .then(|| (exp / sum * coef.clone()).scatter(1, targets, coef.neg(), IndexingUpdateOp::Add).cast(compute));
    (nll, dlogits)
}

/// `values` as an f32 `[n, 1]` column (created in f32: a bf16 backend's default dtype would round them).
fn f32_column<B: Backend>(values: &[f32], device: &B::Device) -> Tensor<B, 2> {
    host_tensor(values.to_vec(), [values.len(), 1], FloatDType::F32, device)
}

/// The stored gradient times the loss's incoming gradient (a `[1]` tensor), in the stored gradient's dtype.
fn scaled<B: Backend>(stored: FloatTensor<B>, incoming: FloatTensor<B>) -> FloatTensor<B> {
    let stored = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(stored));
    let factor =
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(incoming)).cast(FloatDType::from(stored.dtype()));
    (stored * factor.reshape([1, 1])).into_primitive().tensor()
}

#[derive(Debug)]
struct LinearCrossEntropyBackward;

impl<B: Backend> Backward<B, 2> for LinearCrossEntropyBackward {
    /// The gradients taken in the forward pass, for the parents that track one.
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let (grad_hidden, grad_head) = ops.state;
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |incoming| scaled::<B>(grad_hidden.expect("the forward took the gradient of a tracked hidden"), incoming),
            |incoming| scaled::<B>(grad_head.expect("the forward took the gradient of a tracked head"), incoming),
        );
    }
}

impl<B: ModelBackend + CrossEntropyRows + OptimizerOps, C: CheckpointStrategy> LinearCrossEntropy for Autodiff<B, C> {
    fn linear_cross_entropy(
        hidden: Tensor<Self, 2>,
        head: Tensor<Self, 2>,
        softcap: Option<f64>,
        targets: &[i64],
        weights: &[f32],
        normalizer: f32,
        chunk_rows: usize,
    ) -> Tensor<Self, 1> {
        if reference_ops() {
            let logits = soft_cap(hidden.matmul(head.transpose()), softcap).unsqueeze::<3>();
            return masked_loss(logits, targets, weights, normalizer);
        }
        let hidden = hidden.into_primitive().tensor();
        let head = head.into_primitive().tensor();
        let inner = |t: FloatTensor<B>| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
        let out = chunked_cross_entropy(
            inner(hidden.primitive.clone()),
            inner(head.primitive.clone()),
            softcap,
            targets,
            weights,
            normalizer,
            chunk_rows,
            hidden.is_tracked(),
            head.is_tracked(),
        );
        let loss = out.loss.into_primitive().tensor();
        let output = match LinearCrossEntropyBackward
            .prepare::<C>([hidden.node.clone(), head.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (
                    out.grad_hidden.map(|g| g.into_primitive().tensor()),
                    out.grad_head.map(|g| g.into_primitive().tensor()),
                ),
                loss,
            ),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        };
        Tensor::from_primitive(TensorPrimitive::Float(output))
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::backend::{CpuTrain, CpuTrainCheckpointed};
    use crate::testing::{assert_close, normal, values};

    const ROWS: usize = 10;
    const WIDTH: usize = 8;
    const VOCAB: usize = 37;

    fn targets() -> Vec<i64> {
        (0..ROWS).map(|i| (i * 11 % VOCAB) as i64).collect()
    }

    /// Fractional and repeated weights, so the weighting is checked and not only the mean.
    fn weights() -> Vec<f32> {
        (0..ROWS).map(|i| [1.0, 0.5, 2.0][i % 3]).collect()
    }

    /// Loss and gradients (hidden, head) of the fused op and of the plain composition on the same leaves.
    #[allow(clippy::type_complexity)]
    fn both<B: LinearCrossEntropy>(
        dtype: FloatDType,
        chunk: usize,
        softcap: Option<f64>,
    ) -> ((f32, Vec<f32>, Vec<f32>), (f32, Vec<f32>, Vec<f32>)) {
        let device = Default::default();
        let leaf =
            |dims: [usize; 2], seed: u64| normal::<B, 2>(dims, 0.0, 1.0, seed, &device).cast(dtype).require_grad();
        let (hidden, head) = (leaf([ROWS, WIDTH], 1), leaf([VOCAB, WIDTH], 2));
        let (t, w) = (targets(), weights());
        let fused = B::linear_cross_entropy(hidden.clone(), head.clone(), softcap, &t, &w, 7.0, chunk);
        let logits = soft_cap(hidden.clone().matmul(head.clone().transpose()), softcap).unsqueeze::<3>();
        let plain = masked_loss(logits, &t, &w, 7.0);
        let measure = |loss: Tensor<B, 1>| {
            let grads = loss.backward();
            let grad = |x: &Tensor<B, 2>| values(x.grad(&grads).expect("a gradient"));
            (values(loss)[0], grad(&hidden), grad(&head))
        };
        (measure(fused), measure(plain))
    }

    #[test]
    fn the_fused_op_equals_the_plain_composition_in_f32_for_any_chunking() {
        // Without a cap, and with Gemma's soft-cap tight enough (2 against logits of a few units) to bend them.
        for softcap in [None, Some(2.0)] {
            for chunk in [1, 3, ROWS, 64] {
                let ((fl, fh, fw), (pl, ph, pw)) = both::<CpuTrain>(FloatDType::F32, chunk, softcap);
                assert!((fl - pl).abs() <= 1e-6 * pl.abs(), "cap {softcap:?}, chunk {chunk}: loss {fl} vs {pl}");
                assert_close(&format!("cap {softcap:?}, chunk {chunk} hidden grad"), &fh, &ph, 1e-6);
                assert_close(&format!("cap {softcap:?}, chunk {chunk} head grad"), &fw, &pw, 1e-6);
            }
        }
        let ((capped, ..), (uncapped, ..)) =
            (both::<CpuTrain>(FloatDType::F32, 3, Some(2.0)), both::<CpuTrain>(FloatDType::F32, 3, None));
        assert!((capped.0 - uncapped.0).abs() > 1e-2, "the cap changes the loss: {} vs {}", capped.0, uncapped.0);
        let ((fl, ..), (pl, ..)) = both::<CpuTrainCheckpointed>(FloatDType::F32, 4, None);
        assert!((fl - pl).abs() <= 1e-6 * pl.abs(), "checkpointed: loss {fl} vs {pl}");
    }

    #[test]
    fn the_fused_op_keeps_bf16_gradients_in_bf16_and_its_loss_in_f32() {
        let ((fl, fh, fw), (pl, ph, pw)) = both::<CpuTrain>(FloatDType::BF16, 3, None);
        // The same bf16 logits go into the same f32 softmax: the losses agree to f32 rounding.
        assert!((fl - pl).abs() <= 1e-6 * pl.abs(), "loss {fl} vs {pl}");
        // Both round dlogits to bf16 before the projection's backward; the fused op sums the head's
        // chunks in f32 where the plain matmul rounds once, so the two may differ by a bf16 ulp (2⁻⁷) of the
        // largest gradient (seen: 1.4e-4 of it).
        assert_close("hidden grad", &fh, &ph, 1.0 / 128.0);
        assert_close("head grad", &fw, &pw, 1.0 / 128.0);
    }

    #[test]
    fn an_untracked_call_gives_the_loss_and_a_half_tracked_call_one_gradient() {
        let device = Default::default();
        let hidden = normal::<CpuTrain, 2>([ROWS, WIDTH], 0.0, 1.0, 3, &device);
        let head = normal::<CpuTrain, 2>([VOCAB, WIDTH], 0.0, 1.0, 13, &device);
        let (t, w) = (targets(), weights());
        let plain =
            values(masked_loss(hidden.clone().matmul(head.clone().transpose()).unsqueeze::<3>(), &t, &w, 7.0))[0];
        let untracked = values(CpuTrain::linear_cross_entropy(hidden.clone(), head.clone(), None, &t, &w, 7.0, 4))[0];
        assert!((untracked - plain).abs() <= 1e-6 * plain.abs(), "{untracked} vs {plain}");

        let head = head.require_grad();
        let loss = CpuTrain::linear_cross_entropy(hidden.clone(), head.clone(), None, &t, &w, 7.0, 4);
        let grads = loss.backward();
        assert!(hidden.grad(&grads).is_none());
        let fused = values(head.grad(&grads).expect("the head's gradient"));
        let plain = masked_loss(hidden.matmul(head.clone().transpose()).unsqueeze::<3>(), &t, &w, 7.0);
        let expected = values(head.grad(&plain.backward()).expect("the head's gradient"));
        assert_close("head grad", &fused, &expected, 1e-6);
    }

    #[test]
    fn a_scaled_loss_scales_the_gradients() {
        let device = Default::default();
        let hidden = normal::<CpuTrain, 2>([ROWS, WIDTH], 0.0, 1.0, 4, &device).require_grad();
        let head = normal::<CpuTrain, 2>([VOCAB, WIDTH], 0.0, 1.0, 14, &device);
        let (t, w) = (targets(), weights());
        let once = CpuTrain::linear_cross_entropy(hidden.clone(), head.clone(), None, &t, &w, 7.0, 4);
        let grad = values(hidden.grad(&once.backward()).expect("a gradient"));
        let thrice = CpuTrain::linear_cross_entropy(hidden.clone(), head, None, &t, &w, 7.0, 4) * 3.0;
        let grad3 = values(hidden.grad(&thrice.backward()).expect("a gradient"));
        let tripled: Vec<f32> = grad.iter().map(|g| g * 3.0).collect();
        assert_close("3 × loss", &grad3, &tripled, 1e-6);
    }

    #[test]
    fn chunks_hold_a_bounded_share_of_logits() {
        assert_eq!(chunk_rows_for(65_536), 1024);
        assert_eq!(chunk_rows_for(248_320), 270);
        assert_eq!(chunk_rows_for(usize::MAX / 2), 1);
        assert_eq!(chunk_rows_for(0), CHUNK_LOGIT_BYTES / 4);
    }
}
