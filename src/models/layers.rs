//! Building blocks shared by the architectures, written to match transformers' numerics: HF-style RMSNorm,
//! rotate-half RoPE from precomputed tables, SwiGLU, and the sequence layout (documents, positions) that
//! keeps attention and recurrent state inside each document.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};

/// `weight * x / sqrt(mean(x²) + eps)` over the last dimension (LFM2's form: no `1 +` offset), normalized
/// in f32 whatever the compute dtype, then cast back before the weight, as transformers does.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = x.dtype();
        let x = x.cast(FloatDType::F32);
        let variance = x.clone().powf_scalar(2.0).mean_dim(D - 1);
        let normed = (x * (variance + self.eps).sqrt().recip()).cast(dtype);
        normed * self.weight.val().unsqueeze::<D>()
    }
}

/// SwiGLU feed-forward: `w2(silu(w1 x) * w3 x)` (w1 = gate, w3 = up, w2 = down).
#[derive(Module, Debug)]
pub struct SwiGlu<B: Backend> {
    pub w1: Linear<B>,
    pub w3: Linear<B>,
    pub w2: Linear<B>,
}

impl<B: Backend> SwiGlu<B> {
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.w2.forward(silu(self.w1.forward(x.clone())) * self.w3.forward(x))
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

    /// Additive causal, same-document attention mask `[batch, 1, seq, seq]` (0 allowed, -inf blocked).
    pub fn attention_mask<B: Backend>(&self, device: &B::Device) -> Tensor<B, 4> {
        let (b, s) = (self.batch, self.seq);
        let mut mask = vec![f32::NEG_INFINITY; b * s * s];
        for row in 0..b {
            let docs = &self.doc_ids[row * s..(row + 1) * s];
            for q in 0..s {
                for k in 0..=q {
                    if docs[k] == docs[q] {
                        mask[(row * s + q) * s + k] = 0.0;
                    }
                }
            }
        }
        Tensor::from_data(TensorData::new(mask, [b, 1, s, s]), device)
    }

    /// `[batch, seq, 1]` masks that keep token `t`'s input from `lag` steps back only inside its document.
    pub fn lag_mask<B: Backend>(&self, lag: usize, device: &B::Device) -> Tensor<B, 3> {
        let keep: Vec<f32> = self.positions.iter().map(|&p| if p as usize >= lag { 1.0 } else { 0.0 }).collect();
        Tensor::from_data(TensorData::new(keep, [self.batch, self.seq, 1]), device)
    }
}

/// `cos` and `sin` tables `[batch, 1, seq, head_dim]` for the layout's positions, HF's `cat(freqs, freqs)` form.
pub fn rope_tables<B: Backend>(
    layout: &SequenceLayout,
    head_dim: usize,
    theta: f64,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let half = head_dim / 2;
    let inv_freq: Vec<f32> = (0..half).map(|i| (1.0 / theta.powf((2 * i) as f64 / head_dim as f64)) as f32).collect();
    let n = layout.positions.len();
    let mut cos = Vec::with_capacity(n * head_dim);
    let mut sin = Vec::with_capacity(n * head_dim);
    for &p in &layout.positions {
        // f32 products, as transformers computes `position_ids.float() @ inv_freq`.
        let angles: Vec<f32> = inv_freq.iter().map(|f| p as f32 * f).collect();
        for _ in 0..2 {
            cos.extend(angles.iter().map(|a| a.cos()));
            sin.extend(angles.iter().map(|a| a.sin()));
        }
    }
    let shape = [layout.batch, 1, layout.seq, head_dim];
    (Tensor::from_data(TensorData::new(cos, shape), device), Tensor::from_data(TensorData::new(sin, shape), device))
}

/// `x * cos + rotate_half(x) * sin` with `rotate_half(x) = cat(-x2, x1)`.
pub fn apply_rope<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 4>, sin: &Tensor<B, 4>) -> Tensor<B, 4> {
    let d = x.dims()[3];
    let x1 = x.clone().narrow(3, 0, d / 2);
    let x2 = x.clone().narrow(3, d / 2, d - d / 2);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos.clone() + rotated * sin.clone()
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
}
