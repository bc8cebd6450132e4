//! Building blocks shared by the architectures, written to match transformers' numerics: HF-style RMSNorms
//! (LFM2's `w·x̂`, Qwen3.5's zero-centered `(1+w)·x̂`), rotate-half RoPE (full or partial) from precomputed
//! tables, the causal depthwise convolution, SwiGLU, and the sequence layout
//! (documents, positions) that keeps attention and recurrent state inside each document.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{FloatDType, Int, Tensor, TensorData};

use super::ops::{GateActivation, ModelBackend, NormKind, f32_of};
use crate::backend::host_tensor;

/// `weight * x / sqrt(mean(x²) + eps)` over the last dimension (LFM2's form: no `1 +` offset), normalized
/// in f32 whatever the compute dtype, then cast back before the weight, as transformers does. A weight kept
/// in f32 under a bf16 compute dtype (Qwen3.5's DeltaNet norm) promotes the product to f32, as torch does.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: ModelBackend> RmsNorm<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        B::rms_norm(x, self.weight.val(), self.eps, NormKind::Plain)
    }
}

/// `x / sqrt(mean(x²) + eps) * weight`, normalized and scaled in f32, then cast back (Gemma 4's form, as
/// transformers computes it; an absent weight is ones: the weightless v norm).
#[derive(Module, Debug)]
pub struct F32ScaledRmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: ModelBackend> F32ScaledRmsNorm<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        B::rms_norm(x, self.weight.val(), self.eps, NormKind::ScaledInF32)
    }
}

/// `x / sqrt(mean(x²) + eps) * (1 + weight)` (Qwen3.5's form: the weight is stored as an offset from 1 and
/// initialized at 0), normalized and scaled in f32, then cast back, as transformers does.
#[derive(Module, Debug)]
pub struct ZeroCenteredRmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: ModelBackend> ZeroCenteredRmsNorm<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        B::rms_norm(x, self.weight.val(), self.eps, NormKind::ZeroCentered)
    }
}

/// `cap · tanh(logits / cap)` (Gemma's final logit soft-cap), in the logits' dtype; the logits as they are
/// without a cap.
pub fn soft_cap<B: Backend, const D: usize>(logits: Tensor<B, D>, cap: Option<f64>) -> Tensor<B, D> {
    match cap {
        Some(cap) => burn::tensor::activation::tanh(logits / cap) * cap,
        None => logits,
    }
}

/// `x / sqrt(Σx² + eps)` over the last dimension, in f32 (the L2 norm of the FLA kernels transformers
/// mirrors, eps 1e-6).
pub fn l2_normalize<B: Backend, const D: usize>(x: Tensor<B, D>, eps: f64) -> Tensor<B, D> {
    let inv = (f32_of(&x).powf_scalar(2.0).sum_dim(D - 1) + eps).sqrt().recip();
    f32_of(&x) * inv
}

/// Gradient of `l2_normalize` with respect to `x` (in its dtype) for the output gradient `grad`, in f32
/// from `x` alone: with `r = 1 / sqrt(Σx² + eps)` and `y = x r`, `d x = r (g − y Σ(g · y))`.
pub fn l2_normalize_backward<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    eps: f64,
    grad: Tensor<B, D>,
) -> Tensor<B, D> {
    let dtype = FloatDType::from(x.dtype());
    // Recomputed per use rather than kept across the reductions (`ops::f32_of` says why).
    let inv = (f32_of(&x).powf_scalar(2.0).sum_dim(D - 1) + eps).sqrt().recip();
    let y = || f32_of(&x) * inv.clone();
    let projection = (f32_of(&grad) * y()).sum_dim(D - 1);
    ((f32_of(&grad) - y() * projection) * inv).cast(dtype)
}

/// `log(1 + exp(x))` without overflow: `max(x, 0) + log1p(exp(−|x|))`.
pub fn softplus<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    x.clone().clamp_min(0.0) + x.abs().neg().exp().log1p()
}

/// What the causal depthwise convolution needs of a layout, built once per forward pass and shared by its
/// convolution layers: for each lag from 1, the position `lag` steps back (`select` indices `[seq]`, clamped
/// at 0), whether that position is in the token's document (`[batch, seq, 1]`), and the same from the other
/// side for the backward pass (the position `lag` ahead, clamped at the end, and whether the token there
/// reads this one). Shifting by an indexed read keeps each lag inside the fused backends' element-wise
/// kernel, where a zero-padded concatenation cost a fill and two slice writes of the whole input per lag.
/// kiln's conv kernels (`kernels::conv`) read each token's reach instead: how many tokens back it may read.
#[derive(Debug, Clone)]
pub struct ConvShifts<B: Backend> {
    lags: Vec<LagShift<B>>,
    /// `[batch · seq]` in f32: each token's position in its document, capped at the lags built.
    reach: Tensor<B, 1>,
}

#[derive(Debug, Clone)]
struct LagShift<B: Backend> {
    back: Tensor<B, 1, Int>,
    reads_back: Tensor<B, 3>,
    ahead: Tensor<B, 1, Int>,
    read_from_ahead: Tensor<B, 3>,
}

impl<B: Backend> ConvShifts<B> {
    /// The shifts of lags `1..=max_lag` for `layout`, masks in f32 (the convolution sums in f32).
    pub fn new(layout: &SequenceLayout, max_lag: usize, device: &B::Device) -> Self {
        let (batch, seq) = (layout.batch, layout.seq);
        let index = |f: &dyn Fn(usize) -> usize| {
            Tensor::<B, 1, Int>::from_data(TensorData::new((0..seq).map(|t| f(t) as i64).collect(), [seq]), device)
        };
        let lags = (1..=max_lag)
            .map(|lag| {
                // Token t reads t − lag when it is at least `lag` into its document.
                let reads = |row: usize, t: usize| t < seq && layout.positions[row * seq + t] as usize >= lag;
                let mask = |f: &dyn Fn(usize, usize) -> bool| {
                    let keep = (0..batch * seq).map(|i| f32::from(u8::from(f(i / seq, i % seq)))).collect();
                    host_tensor::<B, 3>(keep, [batch, seq, 1], FloatDType::F32, device)
                };
                LagShift {
                    back: index(&|t| t.saturating_sub(lag)),
                    reads_back: mask(&reads),
                    ahead: index(&|t| (t + lag).min(seq.saturating_sub(1))),
                    read_from_ahead: mask(&|row, t| reads(row, t + lag)),
                }
            })
            .collect();
        let reach = layout.positions.iter().map(|&p| p.min(max_lag as u32) as f32).collect();
        let reach = host_tensor::<B, 1>(reach, [batch * seq], FloatDType::F32, device);
        ConvShifts { lags, reach }
    }

    /// The same shifts on the inner backend of an autodiff one.
    pub fn inner(&self) -> ConvShifts<B::InnerBackend>
    where
        B: AutodiffBackend,
    {
        let lags = self
            .lags
            .iter()
            .map(|l| LagShift {
                back: l.back.clone().inner(),
                reads_back: l.reads_back.clone().inner(),
                ahead: l.ahead.clone().inner(),
                read_from_ahead: l.read_from_ahead.clone().inner(),
            })
            .collect();
        ConvShifts { lags, reach: self.reach.clone().inner() }
    }

    /// The lags built: a kernel may have one tap more.
    pub fn max_lag(&self) -> usize {
        self.lags.len()
    }

    /// Each token's reach `[batch · seq]` (f32): how many tokens back it may read, its position in its
    /// document capped at `max_lag`.
    pub fn reach(&self) -> &Tensor<B, 1> {
        &self.reach
    }

    /// Lag `lag`'s shift (from 1); the kernel's taps must not outnumber the lags built plus one.
    fn lag(&self, lag: usize) -> &LagShift<B> {
        &self.lags[lag - 1]
    }
}

/// `kernel`'s taps as `[1, 1, channels]` tensors, all made before the element-wise work that uses them (a
/// slice among that work would end the fused kernel there). The kernel is copied once into tap-major order:
/// each tap is then a whole row, which the CubeCL backends slice as a view of the copy (its offset aligned)
/// where a column of `[channels, L]` took a slice kernel of its own.
fn kernel_taps<B: Backend>(kernel: &Tensor<B, 2>) -> Vec<Tensor<B, 3>> {
    let [channels, taps] = kernel.dims();
    let rows = kernel.clone().swap_dims(0, 1).reshape([taps * channels]);
    (0..taps).map(|i| rows.clone().narrow(0, i * channels, channels).reshape([1, 1, channels])).collect()
}

/// The causal depthwise convolution over the sequence: `y[t] = Σ_lag w[L-1-lag] · x[t-lag]` with `x[t-lag]`
/// zero before the token's document starts (`shifts`). `kernel` is `[channels, L]`, the checkpoint's
/// `[channels, 1, L]` without the group axis. Summed in f32 and rounded once to `x`'s dtype, as the
/// convolutions transformers runs (cuDNN's, the causal-conv1d kernels) accumulate a half-precision input.
pub fn causal_depthwise_conv<B: Backend>(
    x: Tensor<B, 3>,
    kernel: Tensor<B, 2>,
    shifts: &ConvShifts<B>,
) -> Tensor<B, 3> {
    let dtype = FloatDType::from(x.dtype());
    let (x, kernel) = (f32_of(&x), kernel.cast(FloatDType::F32));
    let w = kernel_taps(&kernel);
    let taps = w.len();
    let mut y = x.clone() * w[taps - 1].clone();
    for lag in 1..taps {
        let shift = shifts.lag(lag);
        y = y + x.clone().select(1, shift.back.clone()) * shift.reads_back.clone() * w[taps - 1 - lag].clone();
    }
    y.cast(dtype)
}

/// Gradients of `causal_depthwise_conv` with respect to `x` and `kernel` (in their dtypes) for the output
/// gradient `grad`, in f32: each lag's masked output gradient flows back `lag` positions,
/// `d x[t] += w[L−1−lag] · m_lag[t + lag] · g[t + lag]`, and `d w[L−1−lag] = Σ_{rows, t} m_lag[t] · g[t] · x[t − lag]`.
pub fn causal_depthwise_conv_backward<B: Backend>(
    x: Tensor<B, 3>,
    kernel: Tensor<B, 2>,
    shifts: &ConvShifts<B>,
    grad: Tensor<B, 3>,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let (x_dtype, kernel_dtype) = (FloatDType::from(x.dtype()), FloatDType::from(kernel.dtype()));
    let [batch, seq, channels] = x.dims();
    let (x, kernel, grad) = (x.cast(FloatDType::F32), kernel.cast(FloatDType::F32), grad.cast(FloatDType::F32));
    let w = kernel_taps(&kernel);
    let taps = w.len();
    let mut grad_x = grad.clone() * w[taps - 1].clone();
    for lag in 1..taps {
        let shift = shifts.lag(lag);
        grad_x = grad_x
            + grad.clone().select(1, shift.ahead.clone()) * shift.read_from_ahead.clone() * w[taps - 1 - lag].clone();
    }
    let channel_sums =
        |t: Tensor<B, 3>| super::ops::column_sums(t.reshape([batch * seq, channels])).reshape([channels, 1]);
    // Kernel gradient columns, last tap first.
    let mut grad_taps = vec![channel_sums(grad.clone() * x.clone())];
    for lag in 1..taps {
        let shift = shifts.lag(lag);
        let shifted = x.clone().select(1, shift.back.clone()) * shift.reads_back.clone();
        grad_taps.push(channel_sums(grad.clone() * shifted));
    }
    grad_taps.reverse();
    (grad_x.cast(x_dtype), Tensor::cat(grad_taps, 1).cast(kernel_dtype))
}

/// LFM2's gated short convolution on its in-projection `bcx` `[batch, seq, 3 · hidden]` (`B | C | x`):
/// `C ⊙ conv(B ⊙ x)`, through the backend's split, products and convolution (`ModelBackend::gated_conv`'s
/// composition; the CubeCL backends run one kernel, `kernels::conv`).
pub fn gated_conv<B: ModelBackend>(bcx: Tensor<B, 3>, kernel: Tensor<B, 2>, shifts: &ConvShifts<B>) -> Tensor<B, 3> {
    let hidden = bcx.dims()[2] / 3;
    let [b, c, x] = B::split_last(bcx, [hidden; 3]);
    c * B::causal_conv(b * x, kernel, shifts)
}

/// Gradients of `gated_conv` with respect to `bcx` (`d B | d C | d x`, in its dtype) and the kernel for the
/// output gradient `grad`, with `B ⊙ x` and the conv's output recomputed: `d C = g ⊙ y`,
/// `d u = conv_grads(u, g ⊙ C)`, `d B = d u ⊙ x`, `d x = d u ⊙ B`, the products burn's autodiff would take.
pub fn gated_conv_backward<B: ModelBackend>(
    bcx: Tensor<B, 3>,
    kernel: Tensor<B, 2>,
    shifts: &ConvShifts<B>,
    grad: Tensor<B, 3>,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let hidden = bcx.dims()[2] / 3;
    let [b, c, x] = B::split_last(bcx, [hidden; 3]);
    let u = b.clone() * x.clone();
    let y = B::causal_conv(u.clone(), kernel.clone(), shifts);
    let grad_c = grad.clone() * y;
    let (grad_u, grad_kernel) = B::causal_conv_grads(u, kernel, shifts, grad * c);
    let (grad_b, grad_x) = (grad_u.clone() * x, grad_u * b);
    (Tensor::cat(vec![grad_b, grad_c, grad_x], 2), grad_kernel)
}

/// The same convolution continuing `state` (the last `L-1` inputs before `x`, zeros before a sequence
/// starts), summed in f32 and rounded once as the full one is; returns the outputs and the new state.
pub fn causal_depthwise_conv_cached<B: Backend>(
    x: Tensor<B, 3>,
    kernel: Tensor<B, 2>,
    state: Tensor<B, 3>,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let [_, seq, channels] = x.dims();
    let (dtype, taps) = (FloatDType::from(x.dtype()), kernel.dims()[1]);
    let full = Tensor::cat(vec![state, x], 1); // [B, L-1+S, C]
    let (wide, kernel) = (f32_of(&full), kernel.cast(FloatDType::F32));
    let mut y = wide.clone().narrow(1, 0, seq).zeros_like();
    for j in 0..taps {
        y = y + wide.clone().narrow(1, j, seq) * kernel.clone().narrow(1, j, 1).reshape([1, 1, channels]);
    }
    let state = full.narrow(1, seq, taps - 1);
    (y.cast(dtype), state)
}

/// SwiGLU feed-forward: `w2(silu(w1 x) * w3 x)` (w1 = gate, w3 = up, w2 = down).
#[derive(Module, Debug)]
pub struct SwiGlu<B: Backend> {
    pub w1: Linear<B>,
    pub w3: Linear<B>,
    pub w2: Linear<B>,
}

impl<B: ModelBackend> SwiGlu<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.w2.project(B::glu(self.w1.project(x.clone()), self.w3.project(x), GateActivation::Silu))
    }
}

/// A checkpoint's projection applied through `ModelBackend::projection` (whose backward pass takes the weight
/// gradient in one matmul over all rows), then its bias. The models call this, not burn's `Linear::forward`.
pub trait Project<B: Backend> {
    fn project<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D>;
}

impl<B: ModelBackend> Project<B> for Linear<B> {
    fn project<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let y = B::projection(x, self.weight.val());
        match &self.bias {
            Some(bias) => {
                let dims = y.dims();
                y + B::broadcast_rows(bias.val(), dims)
            }
            None => y,
        }
    }
}

/// Where each token sits: its document (attention and conv state never cross documents) and its position
/// inside that document (RoPE restarts with each document). Padding tokens are documents of their own.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceLayout {
    pub batch: usize,
    pub seq: usize,
    /// `[batch * seq]`, row-major.
    pub doc_ids: Vec<u32>,
    pub positions: Vec<u32>,
}

impl SequenceLayout {
    /// Every row one document of `seq` tokens.
    pub fn single(batch: usize, seq: usize) -> Self {
        SequenceLayout {
            batch,
            seq,
            doc_ids: vec![0; batch * seq],
            positions: (0..batch).flat_map(|_| 0..seq as u32).collect(),
        }
    }

    /// Rows packed with documents of the given lengths; the rest of a row is padding.
    pub fn from_doc_lengths(rows: &[Vec<u32>], seq: usize) -> Self {
        let mut doc_ids = Vec::with_capacity(rows.len() * seq);
        let mut positions = Vec::with_capacity(rows.len() * seq);
        for lengths in rows {
            let start = doc_ids.len();
            let mut doc = 0u32;
            for &len in lengths {
                doc_ids.extend(std::iter::repeat_n(doc, len as usize));
                positions.extend(0..len);
                doc += 1;
            }
            assert!(doc_ids.len() <= start + seq, "documents longer than the row");
            while doc_ids.len() < start + seq {
                doc_ids.push(doc);
                positions.push(0);
                doc += 1;
            }
        }
        SequenceLayout { batch: rows.len(), seq, doc_ids, positions }
    }
}

/// Logits `[batch, seq, vocab]` from hidden states `[batch, seq, hidden]` and the (tied or untied) head
/// `[vocab, hidden]`, as one 2D product with the head's transposed view: a 3D product would reshape that
/// view, which burn-flex does by copying the whole head, at every call (every generated token).
pub fn head_logits<B: Backend>(hidden: Tensor<B, 3>, head: Tensor<B, 2>) -> Tensor<B, 3> {
    let [batch, seq, width] = hidden.dims();
    let vocab = head.dims()[0];
    hidden.reshape([batch * seq, width]).matmul(head.transpose()).reshape([batch, seq, vocab])
}

/// RoPE for a layout, HF's rotate-half form over the first `rotary_dim` dims of each head (the rest pass
/// through): `cos` and `sin` `[batch, 1, seq, head_dim]` for the layout's positions, computed in f32 and
/// cast to `dtype` (the activations' dtype) as transformers does, 1 and 0 on the passed dims. `sin` carries
/// rotate_half's sign and `swap` names the dim each dim reads (the other half of the rotary dims), so that
/// `x·cos + x[swap]·sin` (`apply_rope`) reads `x` once in one element-wise kernel on the fused backends:
/// `cat(−x₂, x₁)` was two slices and a concatenation, and their zero-filled gradients.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    pub(super) cos: Tensor<B, 4>,
    pub(super) sin: Tensor<B, 4>,
    pub(super) swap: Tensor<B, 1, Int>,
    /// Half the rotary dims: dim `i < half` reads `i + half`, `half ≤ i < 2·half` reads `i − half`.
    pub(super) half: usize,
}

impl<B: Backend> RopeTables<B> {
    pub fn new(
        layout: &SequenceLayout,
        head_dim: usize,
        rotary_dim: usize,
        theta: f64,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Self {
        let half = rotary_dim / 2;
        let inv_freq: Vec<f32> =
            (0..half).map(|i| (1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64)) as f32).collect();
        Self::from_inv_freq(layout, head_dim, inv_freq, dtype, device)
    }

    /// The tables for explicit inverse frequencies, one per rotated pair: dim `i < n` pairs with `i + n`
    /// (`n = inv_freq.len()`), dims from `2n` on pass unchanged. A frequency of 0 leaves its pair unchanged
    /// too (Gemma 4's proportional RoPE pads its frequencies with zeros).
    pub fn from_inv_freq(
        layout: &SequenceLayout,
        head_dim: usize,
        inv_freq: Vec<f32>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Self {
        let half = inv_freq.len();
        assert!(2 * half <= head_dim, "{half} rotary pairs fit heads of {head_dim}");
        let n = layout.positions.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n * head_dim), Vec::with_capacity(n * head_dim));
        for &p in &layout.positions {
            // f32 products, as transformers computes `position_ids.float() @ inv_freq`.
            let angles: Vec<f32> = inv_freq.iter().map(|f| p as f32 * f).collect();
            cos.extend(angles.iter().chain(&angles).map(|a| a.cos()));
            sin.extend(angles.iter().map(|a| -a.sin()).chain(angles.iter().map(|a| a.sin())));
            cos.extend(std::iter::repeat_n(1.0, head_dim - 2 * half));
            sin.extend(std::iter::repeat_n(0.0, head_dim - 2 * half));
        }
        let swap: Vec<i64> = (0..head_dim)
            .map(|i| match i {
                i if i < half => i + half,
                i if i < 2 * half => i - half,
                i => i,
            } as i64)
            .collect();
        let shape = [layout.batch, 1, layout.seq, head_dim];
        let table = |values: Vec<f32>| host_tensor::<B, 4>(values, shape, dtype, device);
        RopeTables {
            cos: table(cos),
            sin: table(sin),
            swap: Tensor::from_data(TensorData::new(swap, [head_dim]), device),
            half,
        }
    }

    /// The tables' dtype (the activations').
    pub fn dtype(&self) -> burn::tensor::DType {
        self.cos.dtype()
    }

    /// The same tables on the inner backend of an autodiff one.
    pub fn inner(&self) -> RopeTables<B::InnerBackend>
    where
        B: AutodiffBackend,
    {
        RopeTables {
            cos: self.cos.clone().inner(),
            sin: self.sin.clone().inner(),
            swap: self.swap.clone().inner(),
            half: self.half,
        }
    }
}

/// `x · cos + rotate_half(x) · sin` on the rotary dims of `x` `[batch, heads, seq, head_dim]`, the rest
/// unchanged, with `rotate_half(x) = cat(−x₂, x₁)` as `x[swap]` and the sign in `sin` (`RopeTables`).
pub fn apply_rope<B: Backend>(x: Tensor<B, 4>, rope: &RopeTables<B>) -> Tensor<B, 4> {
    x.clone() * rope.cos.clone() + x.select(3, rope.swap.clone()) * rope.sin.clone()
}

/// The gradient of `apply_rope` for the output gradient `grad`: `grad·cos + (grad·sin)[swap]`, since the
/// swap is its own inverse (dim `j` is read by the dim it reads).
pub fn apply_rope_backward<B: Backend>(grad: Tensor<B, 4>, rope: &RopeTables<B>) -> Tensor<B, 4> {
    grad.clone() * rope.cos.clone() + (grad * rope.sin.clone()).select(3, rope.swap.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_restart_positions_and_isolate_padding() {
        let l = SequenceLayout::from_doc_lengths(&[vec![2, 3], vec![4]], 6);
        assert_eq!(l.positions, [0, 1, 0, 1, 2, 0, 0, 1, 2, 3, 0, 0]);
        assert_eq!(l.doc_ids, [0, 0, 1, 1, 1, 2, 0, 0, 0, 0, 1, 2]);
    }

    /// The shifted reads give the convolution a loop over each token's document computes, including lags
    /// longer than a document or the row.
    #[test]
    fn the_convolution_reads_each_lag_inside_the_document() {
        use crate::backend::Cpu;
        use crate::testing::{normal, values};
        let device = Default::default();
        let (seq, channels, taps) = (6, 3, 4);
        let layout = SequenceLayout::from_doc_lengths(&[vec![2, 4], vec![1, 1, 3]], seq);
        let x = normal::<Cpu, 3>([2, seq, channels], 0.0, 1.0, 4, &device);
        let w = normal::<Cpu, 2>([channels, taps], 0.0, 1.0, 5, &device);
        let shifts = ConvShifts::<Cpu>::new(&layout, taps - 1, &device);
        let got = values(causal_depthwise_conv(x.clone(), w.clone(), &shifts));
        let (xs, ws) = (values(x), values(w));
        for (i, &y) in got.iter().enumerate() {
            let (row, t, c) = (i / (seq * channels), i / channels % seq, i % channels);
            let position = layout.positions[row * seq + t] as usize;
            let want: f32 =
                (0..taps.min(position + 1)).map(|lag| ws[c * taps + taps - 1 - lag] * xs[i - lag * channels]).sum();
            assert!((y - want).abs() < 1e-6, "row {row} t {t} c {c}: {y} vs {want}");
        }
    }

    /// `x·cos + x[swap]·sin` is transformers' `x·cos + cat(−x₂, x₁)·sin` bit for bit, with the dims past
    /// `rotary_dim` passed through unchanged (f32 and bf16; positions restarting with each document).
    #[test]
    fn rope_by_swapped_reads_equals_rotate_half_bit_for_bit() {
        use crate::backend::Cpu;
        use crate::testing::{normal, values};
        let device = Default::default();
        let layout = SequenceLayout::from_doc_lengths(&[vec![3, 4], vec![7]], 7);
        let (head_dim, rotary) = (12, 8);
        for dtype in [FloatDType::F32, FloatDType::BF16] {
            let x = normal::<Cpu, 4>([2, 3, 7, head_dim], 0.0, 1.0, 3, &device).cast(dtype);
            let got = apply_rope(x.clone(), &RopeTables::new(&layout, head_dim, rotary, 1e4, dtype, &device));
            // The reference: HF's tables over the rotary dims, rotate_half by concatenation.
            let half = rotary / 2;
            let inv: Vec<f32> = (0..half).map(|i| (1.0 / 1e4f64.powf((2 * i) as f64 / rotary as f64)) as f32).collect();
            let table = |f: fn(f32) -> f32| {
                let v = layout.positions.iter().flat_map(|&p| (0..rotary).map(move |i| (p, i)));
                let v: Vec<f32> = v.map(|(p, i)| f(p as f32 * inv[i % half])).collect();
                host_tensor::<Cpu, 4>(v, [2, 1, 7, rotary], dtype, &device)
            };
            let rotated = x.clone().narrow(3, 0, rotary);
            let (x1, x2) = (rotated.clone().narrow(3, 0, half), rotated.clone().narrow(3, half, half));
            let turned = Tensor::cat(vec![x2.neg(), x1], 3);
            let roped = rotated * table(f32::cos) + turned * table(f32::sin);
            let want = Tensor::cat(vec![roped, x.narrow(3, rotary, head_dim - rotary)], 3);
            assert_eq!(values(got), values(want), "{dtype:?}");
        }
    }
}
