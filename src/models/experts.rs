//! The MoE's grouped matmul: rows grouped by expert (`counts[e]` consecutive rows for expert `e`) times each
//! expert's weights `[experts, in, out]`, forward and backward, in two forms with the same results.
//!
//! - **A matmul per expert** (`grouped_matmul_forward`, `grouped_matmul_backward`): exact work, but each
//!   expert costs its own matmuls, slices and copies — several ops an expert per pass, 32 experts a layer
//!   for LFM2.5-8B-A1B. The CPU runs it: an op costs it nothing beyond its arithmetic.
//! - **One batched matmul over padded groups** (`batched_forward`, `batched_backward`; `ExpertBatch` plans
//!   it): each expert's first `capacity` rows gathered into `[experts, capacity, in]` (short groups padded),
//!   one batched matmul with the weights as they are, the rows gathered back. Experts with more rows than the
//!   capacity run their extra rows as matmuls of their own. The CubeCL backends run this form: there every
//!   op pays a launch and the host's dispatch, and a few batched ops replace hundreds of small ones.
//!
//! Padding is wasted arithmetic, so the plan weighs it against the ops it saves, with a launch costed as
//! `LAUNCH_FLOPS` of arithmetic. That constant is an estimate, not a measurement (`KILN_EXPERTS_BATCHED=off`
//! runs the per-expert form on the CubeCL backends, for the GPU to measure against).
//!
//! Every product of both forms is `ModelBackend::matmul`: on CUDA with `KILN_MATMUL=cublas`, cuBLAS's
//! strided batched GEMM (`kernels::cublas`), the expert weights and their transposes read in place.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::backend::zeros_in;
use crate::models::ops::ModelBackend;

/// The grouped matmul as burn composes it: one slice of rows and one expert's weights per group.
pub fn grouped_matmul_forward<B: ModelBackend>(
    x: Tensor<B, 2>,
    weights: Tensor<B, 3>,
    counts: &[usize],
) -> Tensor<B, 2> {
    let [experts, _, out] = weights.dims();
    assert_eq!(counts.len(), experts, "one row count per expert");
    assert_eq!(counts.iter().sum::<usize>(), x.dims()[0], "the counts cover every row");
    let mut start = 0;
    let mut groups = Vec::new();
    for (e, &n) in counts.iter().enumerate().filter(|(_, n)| **n > 0) {
        groups.push(B::matmul(x.clone().narrow(0, start, n), expert_weights(&weights, e)));
        start += n;
    }
    if groups.is_empty() {
        return zeros_in([0, out], x.dtype().into(), &x.device());
    }
    Tensor::cat(groups, 0)
}

/// Gradients of `grouped_matmul_forward` for the output gradient `grad` `[n, out]`: per group
/// `d x_e = grad_e W_eᵀ`, `d W_e = x_eᵀ grad_e` (zero for experts without rows), written once as the whole
/// `[experts, in, out]` gradient instead of one full-size gradient per expert slice.
pub fn grouped_matmul_backward<B: ModelBackend>(
    x: Tensor<B, 2>,
    weights: Tensor<B, 3>,
    counts: &[usize],
    grad: Tensor<B, 2>,
) -> (Tensor<B, 2>, Tensor<B, 3>) {
    let [_, width, out] = weights.dims();
    let device = x.device();
    let mut start = 0;
    let (mut grad_x, mut grad_w) = (Vec::new(), Vec::with_capacity(counts.len()));
    for (e, &n) in counts.iter().enumerate() {
        if n == 0 {
            grad_w.push(zeros_in([width, out], weights.dtype().into(), &device));
            continue;
        }
        let rows = x.clone().narrow(0, start, n);
        let grad_rows = grad.clone().narrow(0, start, n);
        let expert = expert_weights(&weights, e);
        grad_x.push(B::matmul(grad_rows.clone(), expert.transpose()));
        grad_w.push(B::matmul(rows.transpose(), grad_rows));
        start += n;
    }
    let grad_x = if grad_x.is_empty() { x.zeros_like() } else { Tensor::cat(grad_x, 0) };
    (grad_x, Tensor::stack(grad_w, 0))
}

/// What a matmul launch costs beyond its arithmetic (the launch, the host's dispatch through fusion and
/// autodiff, a tile grid that a small group fills badly), counted as arithmetic: about 20 µs of an H100 or
/// H200 at 400 TFLOP/s. An estimate; it decides only how much padding a batch may carry.
pub const LAUNCH_FLOPS: f64 = 8e9;

/// Reading an expert's weights once, in rows of its own arithmetic (`2·in·out` FLOPs a row): a bf16 value
/// at 4.8 TB/s takes as long as 160 FLOPs at 400 TFLOP/s, so `in·out` values cost 80 rows. A batch reads
/// every expert's weights, the per-expert form only those of experts with rows; this is what keeps a
/// decoding step's few rows (a handful of experts chosen) on the per-expert form.
pub const WEIGHT_READ_ROWS: f64 = 80.0;

/// How the rows of a grouped matmul are batched: each expert's first `capacity` rows in one padded batch,
/// the rest of a longer group (`overflow`: expert, first row, rows) in matmuls of their own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertBatch {
    pub counts: Vec<usize>,
    pub capacity: usize,
    pub overflow: Vec<(usize, usize, usize)>,
}

impl ExpertBatch {
    /// The batch for `counts` whose estimated cost is least, in rows of arithmetic: the rows computed
    /// (padding included), `LAUNCH_FLOPS` a matmul, `WEIGHT_READ_ROWS` an expert's weights read.
    /// Capacities are the group sizes rounded up to 16 rows (tensor-core tiles). `None` where the
    /// per-expert form costs least.
    pub fn plan(counts: &[usize], width: usize, out: usize) -> Option<Self> {
        let launch_rows = LAUNCH_FLOPS / (2.0 * width.max(1) as f64 * out.max(1) as f64);
        let matmuls = |rows: usize, launches: usize, weights_read: usize| {
            rows as f64 + launches as f64 * launch_rows + weights_read as f64 * WEIGHT_READ_ROWS
        };
        let per_expert = {
            let groups = counts.iter().filter(|&&n| n > 0).count();
            matmuls(counts.iter().sum(), groups, groups)
        };
        let batched = |capacity: usize| {
            let overflow: Vec<usize> = counts.iter().filter(|&&n| n > capacity).map(|&n| n - capacity).collect();
            let rows = counts.len() * capacity + overflow.iter().sum::<usize>();
            matmuls(rows, 1 + overflow.len(), counts.len() + overflow.len())
        };
        let mut candidates: Vec<usize> = counts.iter().map(|&n| n.div_ceil(16) * 16).filter(|&c| c > 0).collect();
        candidates.sort_unstable();
        candidates.dedup();
        let best = candidates.into_iter().min_by(|&a, &b| batched(a).total_cmp(&batched(b)))?;
        (batched(best) < per_expert).then(|| Self::with_capacity(counts, best))
    }

    /// The batch of `counts` with `capacity` (≥ 1) rows an expert.
    pub fn with_capacity(counts: &[usize], capacity: usize) -> Self {
        assert!(capacity > 0, "a batch holds at least one row an expert");
        let mut start = 0;
        let mut overflow = Vec::new();
        for (e, &n) in counts.iter().enumerate() {
            if n > capacity {
                overflow.push((e, start + capacity, n - capacity));
            }
            start += n;
        }
        Self { counts: counts.to_vec(), capacity, overflow }
    }

    fn rows(&self) -> usize {
        self.counts.iter().sum()
    }

    /// For each padded slot `e·capacity + j`, the row it holds: expert `e`'s `j`-th row, or `pad` past the
    /// end of a short group.
    fn gather(&self, pad: usize) -> Vec<i64> {
        let mut index = Vec::with_capacity(self.counts.len() * self.capacity);
        let mut start = 0;
        for &n in &self.counts {
            let taken = n.min(self.capacity);
            index.extend((start..start + taken).map(|r| r as i64));
            index.extend(std::iter::repeat_n(pad as i64, self.capacity - taken));
            start += n;
        }
        index
    }

    /// For each row, its place in the padded batch's rows followed by the overflow groups' rows, in order.
    fn places(&self) -> Vec<i64> {
        let mut place = vec![0i64; self.rows()];
        let (mut start, mut next_overflow) = (0, self.counts.len() * self.capacity);
        for (e, &n) in self.counts.iter().enumerate() {
            for j in 0..n {
                place[start + j] = if j < self.capacity {
                    (e * self.capacity + j) as i64
                } else {
                    next_overflow += 1;
                    (next_overflow - 1) as i64
                };
            }
            start += n;
        }
        place
    }
}

fn index_tensor<B: Backend>(index: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let len = index.len();
    Tensor::from_data(TensorData::new(index, [len]), device)
}

fn expert_weights<B: Backend>(weights: &Tensor<B, 3>, expert: usize) -> Tensor<B, 2> {
    let [_, width, out] = weights.dims();
    weights.clone().narrow(0, expert, 1).reshape([width, out])
}

/// `[experts · capacity, width]`: `rows`' padded batch, the padding slots filled with row `pad` of `rows`.
fn padded<B: Backend>(rows: Tensor<B, 2>, batch: &ExpertBatch, pad: usize) -> Tensor<B, 3> {
    let width = rows.dims()[1];
    let device = rows.device();
    rows.select(0, index_tensor(batch.gather(pad), &device)).reshape([batch.counts.len(), batch.capacity, width])
}

/// The padded batch's output rows and the overflow groups' outputs, put back in the rows' order.
fn unpadded<B: Backend>(batched: Tensor<B, 3>, overflow: Vec<Tensor<B, 2>>, batch: &ExpertBatch) -> Tensor<B, 2> {
    let [experts, capacity, out] = batched.dims();
    let device = batched.device();
    let mut parts = vec![batched.reshape([experts * capacity, out])];
    parts.extend(overflow);
    let all = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(parts, 0) };
    all.select(0, index_tensor(batch.places(), &device))
}

/// `grouped_matmul_forward` as one batched matmul over `batch`'s padded groups (the padding slots hold copies
/// of row 0, whose outputs are dropped), plus a matmul per overflow group.
pub fn batched_forward<B: ModelBackend>(x: Tensor<B, 2>, weights: Tensor<B, 3>, batch: &ExpertBatch) -> Tensor<B, 2> {
    assert_eq!(batch.counts.len(), weights.dims()[0], "one row count per expert");
    assert_eq!(batch.rows(), x.dims()[0], "the counts cover every row");
    let overflow = batch
        .overflow
        .iter()
        .map(|&(e, first, n)| B::matmul(x.clone().narrow(0, first, n), expert_weights(&weights, e)))
        .collect();
    let batched = B::matmul(padded(x, batch, 0), weights);
    unpadded(batched, overflow, batch)
}

/// Gradients of `batched_forward` (equal to `grouped_matmul_backward`'s): the output gradient padded with
/// zero rows (so the row-0 copies in the padding add nothing to `d W`), `d W = x_padᵀ grad_pad` for all
/// experts in one batched matmul, `d x` back through the weights as the forward pass went, and each overflow
/// group's terms added to its expert.
pub fn batched_backward<B: ModelBackend>(
    x: Tensor<B, 2>,
    weights: Tensor<B, 3>,
    batch: &ExpertBatch,
    grad: Tensor<B, 2>,
) -> (Tensor<B, 2>, Tensor<B, 3>) {
    let [n, out] = grad.dims();
    let width = weights.dims()[1];
    let zero_row = zeros_in([1, out], grad.dtype().into(), &grad.device());
    let grad_padded = padded(Tensor::cat(vec![grad.clone(), zero_row], 0), batch, n);
    let mut grad_w = B::matmul(padded(x.clone(), batch, 0).swap_dims(1, 2), grad_padded.clone());
    let mut overflow = Vec::with_capacity(batch.overflow.len());
    for &(e, first, rows) in &batch.overflow {
        let expert = expert_weights(&weights, e);
        let grad_rows = grad.clone().narrow(0, first, rows);
        overflow.push(B::matmul(grad_rows.clone(), expert.transpose()));
        let extra = B::matmul(x.clone().narrow(0, first, rows).transpose(), grad_rows).reshape([1, width, out]);
        let summed = grad_w.clone().narrow(0, e, 1) + extra;
        grad_w = grad_w.slice_assign([e..e + 1, 0..width, 0..out], summed);
    }
    let grad_x = unpadded(B::matmul(grad_padded, weights.swap_dims(1, 2)), overflow, batch);
    (grad_x, grad_w)
}

/// The padded batch both passes of `grouped_matmul` run, where `batched` allows one and it pays.
fn batch_for<B: Backend>(counts: &[usize], weights: &Tensor<B, 3>, batched: bool) -> Option<ExpertBatch> {
    let [_, width, out] = weights.dims();
    batched.then(|| ExpertBatch::plan(counts, width, out)).flatten()
}

/// The grouped matmul in the form `batched` asks for, where a padded batch pays (`ExpertBatch::plan`).
pub fn grouped_matmul<B: ModelBackend>(
    x: Tensor<B, 2>,
    weights: Tensor<B, 3>,
    counts: &[usize],
    batched: bool,
) -> Tensor<B, 2> {
    match batch_for(counts, &weights, batched) {
        Some(batch) => batched_forward(x, weights, &batch),
        None => grouped_matmul_forward(x, weights, counts),
    }
}

/// The gradients of `grouped_matmul` in the form its forward pass took.
pub fn grouped_matmul_grads<B: ModelBackend>(
    x: Tensor<B, 2>,
    weights: Tensor<B, 3>,
    counts: &[usize],
    grad: Tensor<B, 2>,
    batched: bool,
) -> (Tensor<B, 2>, Tensor<B, 3>) {
    match batch_for(counts, &weights, batched) {
        Some(batch) => batched_backward(x, weights, &batch, grad),
        None => grouped_matmul_backward(x, weights, counts, grad),
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::Tolerance;

    use super::*;

    fn spread<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Flex, D> {
        crate::testing::normal(shape, 0.0, 0.5, seed, &Default::default())
    }

    #[test]
    fn the_plan_batches_what_pays_and_leaves_the_rest_to_matmuls_of_their_own() {
        // LFM2.5-8B-A1B's gate_up at sequence 8192: 32 experts, top-4, nearly balanced.
        let balanced: Vec<usize> = (0..32).map(|e| 1000 + (e * 7) % 50).collect();
        let plan = ExpertBatch::plan(&balanced, 2048, 3584).expect("balanced groups batch");
        assert_eq!((plan.capacity, plan.overflow.len()), (1056, 0));
        // One expert takes nearly everything: padding every group to it would multiply the arithmetic.
        let mut collapsed = vec![4; 32];
        collapsed[3] = 32_000;
        let plan = ExpertBatch::plan(&collapsed, 2048, 3584).expect("the small groups still batch");
        assert_eq!((plan.capacity, plan.overflow), (16, vec![(3, 3 * 4 + 16, 32_000 - 16)]));
        // Unequal groups of large matmuls: the padding costs more than the launches a batch saves.
        assert_eq!(ExpertBatch::plan(&[1000, 8192, 12288, 16384], 4096, 4096), None);
        // A decoding step: four rows, four experts; a batch would read all 32 experts' weights.
        let mut decoding = vec![0; 32];
        for e in [2, 9, 17, 30] {
            decoding[e] = 1;
        }
        assert_eq!(ExpertBatch::plan(&decoding, 2048, 3584), None);
        // Tiny matmuls: a launch outweighs any padding.
        let tiny = ExpertBatch::plan(&[1, 9, 0, 30], 8, 24).expect("tiny groups batch");
        assert_eq!((tiny.capacity, tiny.overflow.len()), (32, 0));
    }

    #[test]
    fn gathers_and_places_follow_the_groups() {
        let batch = ExpertBatch::with_capacity(&[2, 0, 5, 1], 3);
        assert_eq!(batch.overflow, vec![(2, 5, 2)]);
        assert_eq!(batch.gather(99), vec![0, 1, 99, 99, 99, 99, 2, 3, 4, 7, 99, 99]);
        // Rows 0..2 → slots 0, 1; rows 2..7 (expert 2) → slots 6, 7, 8 then overflow 12, 13; row 7 → slot 9.
        assert_eq!(batch.places(), vec![0, 1, 6, 7, 8, 12, 13, 9]);
    }

    /// Every capacity (groups padded, groups split into overflow, empty groups, no batch at all) gives the
    /// per-expert form's outputs and gradients.
    #[test]
    fn the_batched_form_equals_the_matmul_per_expert() {
        let counts = [3usize, 0, 7, 1, 5];
        let n: usize = counts.iter().sum();
        let (width, out) = (6, 4);
        let x = spread([n, width], 1);
        let weights = spread([counts.len(), width, out], 2);
        let grad = spread([n, out], 3);
        let forward = grouped_matmul_forward(x.clone(), weights.clone(), &counts);
        let (grad_x, grad_w) = grouped_matmul_backward(x.clone(), weights.clone(), &counts, grad.clone());
        for capacity in [1, 3, 5, 7, 16] {
            let batch = ExpertBatch::with_capacity(&counts, capacity);
            let tolerance = Tolerance::<f32>::absolute(1e-6);
            batched_forward(x.clone(), weights.clone(), &batch)
                .into_data()
                .assert_approx_eq::<f32>(&forward.to_data(), tolerance);
            let (bx, bw) = batched_backward(x.clone(), weights.clone(), &batch, grad.clone());
            bx.into_data().assert_approx_eq::<f32>(&grad_x.to_data(), tolerance);
            bw.into_data().assert_approx_eq::<f32>(&grad_w.to_data(), tolerance);
        }
    }
}
