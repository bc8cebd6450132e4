//! The CPU backend's (Flex, f32) element-wise ops as single passes over contiguous slices: a gated MLP's
//! gate `act(gate) · up` (SwiGLU, GeGLU), the RMSNorms and RoPE, each with its gradients, and the parts of a
//! fused projection made contiguous. burn's compositions take a pass and a new tensor per op, evaluate σ
//! with a libm call per element, and walk a strided or broadcast view (a part of a split projection, q and
//! k after the head swap, the RoPE tables shared by the heads) one computed index at a time: together over
//! a third of a tiny model's training step. Work is split into fixed pieces over rayon; each element
//! (and each piece's share of a weight gradient, summed in piece order) is computed alone, so the results do
//! not depend on the number of threads. Other dtypes keep burn's compositions (`backend.rs`).

use burn::backend::Flex;
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use super::host_slices::{axpy, dot, exp};
use super::layers::RopeTables;
use super::ops::{GELU_TANH_CUBIC, GELU_TANH_SCALE, GateActivation, NormKind};
use crate::backend::host_tensor;

/// Elements per rayon task: large enough to amortize the task, small enough to share out a layer's work.
const PIECE: usize = 1 << 14;

/// Whether the slice forms take tensors of these dtypes (all f32).
pub fn takes(dtypes: impl IntoIterator<Item = DType>) -> bool {
    dtypes.into_iter().all(|dtype| dtype == DType::F32)
}

/// The tensor with its elements in row-major order from offset 0 (a copy only where it is a strided view).
pub fn contiguous<const D: usize>(t: Tensor<Flex, D>) -> Tensor<Flex, D> {
    Tensor::from_primitive(TensorPrimitive::Float(storage(t)))
}

fn storage<const D: usize>(t: Tensor<Flex, D>) -> FlexTensor {
    t.into_primitive().tensor().to_contiguous()
}

fn slice(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>().expect("a contiguous f32 tensor (checked by `takes`)")
}

/// `σ(x) = 1 / (1 + e⁻ˣ)`, as burn's `sigmoid` composes it.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `gelu_tanh(g)` and its derivative, in f32 (`ops::GateActivation::GeluTanh`).
#[inline(always)]
fn gelu_tanh_and_slope(g: f32) -> (f32, f32) {
    let (scale, cubic) = (GELU_TANH_SCALE as f32, GELU_TANH_CUBIC as f32);
    let square = g * g;
    let t = (scale * (g + cubic * square * g)).tanh();
    let half_one_plus_t = 0.5 * (1.0 + t);
    (g * half_one_plus_t, half_one_plus_t + 0.5 * g * (1.0 - t * t) * scale * (1.0 + 3.0 * cubic * square))
}

/// `act(gate) · up` (`ops::glu_forward`).
pub fn glu<const D: usize>(gate: Tensor<Flex, D>, up: Tensor<Flex, D>, act: GateActivation) -> Tensor<Flex, D> {
    match act {
        GateActivation::Silu => gate_pass(gate, up, |g| g * sigmoid(g)),
        GateActivation::GeluTanh => gate_pass(gate, up, |g| gelu_tanh_and_slope(g).0),
    }
}

fn gate_pass<const D: usize>(
    gate: Tensor<Flex, D>,
    up: Tensor<Flex, D>,
    act: impl Fn(f32) -> f32 + Sync,
) -> Tensor<Flex, D> {
    let shape = gate.dims();
    let (gate, up) = (storage(gate), storage(up));
    let (gate, up) = (slice(&gate), slice(&up));
    let mut out = vec![0.0f32; gate.len()];
    out.par_chunks_mut(PIECE).zip(gate.par_chunks(PIECE).zip(up.par_chunks(PIECE))).for_each(|(out, (gate, up))| {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = act(g) * u;
        }
    });
    host_tensor(out, shape, FloatDType::F32, &Default::default())
}

/// The gradients `(d gate, d up)` of `glu` for the output gradient `grad` (`ops::glu_backward`):
/// `d up = grad · act(gate)`, `d gate = grad · up · act'(gate)`.
pub fn glu_grads<const D: usize>(
    gate: Tensor<Flex, D>,
    up: Tensor<Flex, D>,
    grad: Tensor<Flex, D>,
    act: GateActivation,
) -> (Tensor<Flex, D>, Tensor<Flex, D>) {
    match act {
        GateActivation::Silu => gate_grads_pass(gate, up, grad, |g, u, d| {
            let s = sigmoid(g);
            (d * u * s * (g * (1.0 - s) + 1.0), d * g * s)
        }),
        GateActivation::GeluTanh => gate_grads_pass(gate, up, grad, |g, u, d| {
            let (value, slope) = gelu_tanh_and_slope(g);
            (d * u * slope, d * value)
        }),
    }
}

/// `(d gate, d up)` from `grads(gate, up, grad)` element by element.
fn gate_grads_pass<const D: usize>(
    gate: Tensor<Flex, D>,
    up: Tensor<Flex, D>,
    grad: Tensor<Flex, D>,
    grads: impl Fn(f32, f32, f32) -> (f32, f32) + Sync,
) -> (Tensor<Flex, D>, Tensor<Flex, D>) {
    let shape = gate.dims();
    let (gate, up, grad) = (storage(gate), storage(up), storage(grad));
    let (gate, up, grad) = (slice(&gate), slice(&up), slice(&grad));
    let (mut d_gate, mut d_up) = (vec![0.0f32; gate.len()], vec![0.0f32; gate.len()]);
    let outs = d_gate.par_chunks_mut(PIECE).zip(d_up.par_chunks_mut(PIECE));
    let ins = gate.par_chunks(PIECE).zip(up.par_chunks(PIECE)).zip(grad.par_chunks(PIECE));
    outs.zip(ins).for_each(|((d_gate, d_up), ((gate, up), grad))| {
        for (((dg, du), &g), (&u, &d)) in d_gate.iter_mut().zip(d_up.iter_mut()).zip(gate).zip(up.iter().zip(grad)) {
            (*dg, *du) = grads(g, u, d);
        }
    });
    let device = Default::default();
    (host_tensor(d_gate, shape, FloatDType::F32, &device), host_tensor(d_up, shape, FloatDType::F32, &device))
}

/// What multiplies the normalized rows: the weight, or `1 + w` (`NormKind`).
fn norm_scale(weight: &[f32], kind: NormKind) -> Vec<f32> {
    if kind.adds_one() { weight.iter().map(|w| w + 1.0).collect() } else { weight.to_vec() }
}

/// `1 / sqrt(mean(x²) + eps)` of a row.
fn inverse_rms(x: &[f32], eps: f64) -> f32 {
    (dot(x, x) / x.len() as f32 + eps as f32).sqrt().recip()
}

/// The elements of the whole rows of `width` one rayon task takes (`rows_per_task`).
fn rows_per_piece(width: usize) -> usize {
    width * rows_per_task(width)
}

/// How many rows of `width` one rayon task takes (at least one).
fn rows_per_task(width: usize) -> usize {
    (PIECE / width.max(1)).max(1)
}

/// RMSNorm over the last dimension in f32 (`ops::rms_norm_forward`): `x · r · s` per row, with
/// `r = 1 / sqrt(mean(x²) + eps)` and `s` the weight or `1 + w`.
pub fn rms_norm<const D: usize>(
    x: Tensor<Flex, D>,
    weight: Tensor<Flex, 1>,
    eps: f64,
    kind: NormKind,
) -> Tensor<Flex, D> {
    let shape = x.dims();
    let (x, weight) = (storage(x), storage(weight));
    let (x, scale) = (slice(&x), norm_scale(slice(&weight), kind));
    let (width, mut out) = (scale.len(), vec![0.0f32; x.len()]);
    let piece = rows_per_piece(width);
    out.par_chunks_mut(piece).zip(x.par_chunks(piece)).for_each(|(out, x)| {
        for (out, x) in out.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
            let r = inverse_rms(x, eps);
            for ((o, &x), &s) in out.iter_mut().zip(x).zip(&scale) {
                *o = x * r * s;
            }
        }
    });
    host_tensor(out, shape, FloatDType::F32, &Default::default())
}

/// The gradients `(d x, d w)` of `rms_norm` for the output gradient `grad` (`ops::rms_norm_backward`):
/// with `n = x · r`, `d x = r · (grad · s − n · mean(grad · s · n))` per row and `d w = Σ grad · n` over
/// the rows, summed per piece of rows and then over the pieces in order.
pub fn rms_norm_grads<const D: usize>(
    x: Tensor<Flex, D>,
    weight: Tensor<Flex, 1>,
    eps: f64,
    kind: NormKind,
    grad: Tensor<Flex, D>,
) -> (Tensor<Flex, D>, Tensor<Flex, 1>) {
    let shape = x.dims();
    let (x, weight, grad) = (storage(x), storage(weight), storage(grad));
    let (x, grad, scale) = (slice(&x), slice(&grad), norm_scale(slice(&weight), kind));
    let (width, mut d_x) = (scale.len(), vec![0.0f32; x.len()]);
    let piece = rows_per_piece(width);
    let partial_sums: Vec<Vec<f32>> = d_x
        .par_chunks_mut(piece)
        .zip(x.par_chunks(piece).zip(grad.par_chunks(piece)))
        .map(|(d_x, (x, grad))| {
            let mut d_w = vec![0.0f32; width];
            for ((d_x, x), grad) in d_x.chunks_exact_mut(width).zip(x.chunks_exact(width)).zip(grad.chunks_exact(width))
            {
                let r = inverse_rms(x, eps);
                let mut projection = 0.0f32;
                for (((dw, &x), &g), &s) in d_w.iter_mut().zip(x).zip(grad).zip(&scale) {
                    let n = x * r;
                    *dw += g * n;
                    projection += g * s * n;
                }
                projection /= width as f32;
                for (((dx, &x), &g), &s) in d_x.iter_mut().zip(x).zip(grad).zip(&scale) {
                    *dx = (g * s - x * r * projection) * r;
                }
            }
            d_w
        })
        .collect();
    let mut d_w = vec![0.0f32; width];
    for partial in &partial_sums {
        axpy(1.0, partial, &mut d_w);
    }
    let device = Default::default();
    (host_tensor(d_x, shape, FloatDType::F32, &device), host_tensor(d_w, [width], FloatDType::F32, &device))
}

/// `train::linear_ce::cross_entropy_rows` for f32 logits `[rows, vocab]`, targets and coefficients
/// `[rows, 1]`: per row one pass for the maximum, one for `exp(l − max)` and its sum, and with `with_grads`
/// one writing `dlogits = coef · exp(l − max) / sum` with `− coef` at the target; the negative
/// log-likelihood is `ln(sum) − (l[target] − max)`. The composition takes a full-size tensor per step and a
/// scatter. A target outside the vocabulary panics, as the composition's gather does.
pub fn cross_entropy_rows(
    logits: Tensor<Flex, 2>,
    targets: Tensor<Flex, 2, burn::tensor::Int>,
    coef: Tensor<Flex, 2>,
    with_grads: bool,
) -> (Tensor<Flex, 2>, Option<Tensor<Flex, 2>>) {
    let [rows, vocab] = logits.dims();
    let logits = storage(logits);
    let logits = slice(&logits);
    let targets = targets.into_data().convert::<i64>();
    let targets = targets.as_slice::<i64>().expect("i64 targets after the conversion");
    let coef = storage(coef);
    let coef = slice(&coef);
    let target_of = |r: usize| {
        usize::try_from(targets[r]).ok().filter(|&t| t < vocab).unwrap_or_else(|| {
            panic!("cross-entropy target {} of row {r} outside the vocabulary of {vocab}", targets[r])
        })
    };
    let mut nll = vec![0.0f32; rows];
    let mut dlogits = vec![0.0f32; if with_grads { rows * vocab } else { 0 }];
    let mut exps = Vec::new();
    let row_loss = |r: usize, logits: &[f32], exps: &mut Vec<f32>| {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        exps.clear();
        exps.extend(logits.iter().map(|&l| exp(l - max)));
        let sum: f32 = exps.iter().sum();
        (sum.ln() - (logits[target_of(r)] - max), sum)
    };
    if with_grads {
        let rows_per = rows_per_task(vocab);
        nll.par_chunks_mut(rows_per).zip(dlogits.par_chunks_mut(rows_per * vocab)).enumerate().for_each_init(
            Vec::new,
            |exps, (piece, (nll, dlogits))| {
                for (i, (nll, dlogits)) in nll.iter_mut().zip(dlogits.chunks_exact_mut(vocab)).enumerate() {
                    let r = piece * rows_per + i;
                    let (loss, sum) = row_loss(r, &logits[r * vocab..(r + 1) * vocab], exps);
                    *nll = loss;
                    for (d, &e) in dlogits.iter_mut().zip(exps.iter()) {
                        *d = e / sum * coef[r];
                    }
                    dlogits[target_of(r)] += -coef[r];
                }
            },
        );
    } else {
        for (r, nll) in nll.iter_mut().enumerate() {
            *nll = row_loss(r, &logits[r * vocab..(r + 1) * vocab], &mut exps).0;
        }
    }
    let device = Default::default();
    let dlogits = with_grads.then(|| host_tensor(dlogits, [rows, vocab], FloatDType::F32, &device));
    (host_tensor(nll, [rows, 1], FloatDType::F32, &device), dlogits)
}

/// One part's gradient `grad` added into its `range` of the last dimension of `whole`, in place (a copy only
/// where `whole` is shared or strided), or copied into zeros of `dims` when there is none yet
/// (`ModelBackend::add_part`, `split_last`'s backward pass): one pass over the part's rows, where the
/// composition filled, sliced, added and assigned through strided views.
pub fn add_part<const D: usize>(
    whole: Option<Tensor<Flex, D>>,
    dims: [usize; D],
    range: std::ops::Range<usize>,
    grad: Tensor<Flex, D>,
) -> Tensor<Flex, D> {
    let (width, part) = (dims[D - 1], range.len());
    let grad = storage(grad);
    let grad = slice(&grad);
    let rows = rows_per_task(width);
    let Some(whole) = whole else {
        let mut out = vec![0.0f32; dims.iter().product()];
        out.par_chunks_mut(rows * width).zip(grad.par_chunks(rows * part)).for_each(|(out, grad)| {
            for (out, grad) in out.chunks_exact_mut(width).zip(grad.chunks_exact(part)) {
                out[range.clone()].copy_from_slice(grad);
            }
        });
        return host_tensor(out, dims, FloatDType::F32, &Default::default());
    };
    let mut whole = storage(whole);
    let out = whole.storage_mut::<f32>();
    out.par_chunks_mut(rows * width).zip(grad.par_chunks(rows * part)).for_each(|(out, grad)| {
        for (out, grad) in out.chunks_exact_mut(width).zip(grad.chunks_exact(part)) {
            axpy(1.0, grad, &mut out[range.clone()]);
        }
    });
    Tensor::from_primitive(TensorPrimitive::Float(whole))
}

/// Rows of `d` consecutive values of a 4-D f32 tensor, addressed by its first three indices: a view whose
/// last dimension is contiguous (q and k after the head swap) is read in place, anything else copied first.
struct Rows4 {
    tensor: FlexTensor,
    /// Element strides of the first three dimensions, and the first element's place.
    strides: [usize; 3],
    offset: usize,
    d: usize,
}

impl Rows4 {
    fn new(t: Tensor<Flex, 4>) -> Self {
        let [_, n1, n2, d] = t.dims();
        let t = t.into_primitive().tensor();
        let strides: Option<Vec<usize>> = t.layout().strides().iter().map(|&s| usize::try_from(s).ok()).collect();
        let (tensor, strides) = match strides {
            Some(s) if s[3] == 1 || d == 1 => (t, [s[0], s[1], s[2]]),
            _ => (t.to_contiguous(), [n1 * n2 * d, n2 * d, d]),
        };
        let offset = tensor.layout().start_offset();
        Rows4 { tensor, strides, offset, d }
    }

    fn row(&self, i: usize, j: usize, k: usize) -> &[f32] {
        let start = self.offset + i * self.strides[0] + j * self.strides[1] + k * self.strides[2];
        &self.tensor.storage::<f32>()[start..start + self.d]
    }
}

/// `out = a · b + c · d`, element by element (each product rounded, then the sum: burn's `a·b + c·d`).
fn products_sum(out: &mut [f32], a: &[f32], b: &[f32], c: &[f32], d: &[f32]) {
    for ((o, (&a, &b)), (&c, &d)) in out.iter_mut().zip(a.iter().zip(b)).zip(c.iter().zip(d)) {
        *o = a * b + c * d;
    }
}

/// The three runs of a head's dims and where the swap sends each: the first rotary half reads the second,
/// the second reads the first, the passed dims read themselves.
fn rope_runs(d: usize, half: usize) -> [(std::ops::Range<usize>, std::ops::Range<usize>); 3] {
    [(0..half, half..2 * half), (half..2 * half, 0..half), (2 * half..d, 2 * half..d)]
}

/// RoPE (`layers::apply_rope`) for `x` `[batch, heads, seq, d]` (read in place where its last dimension is
/// contiguous, as after the head swap) with the tables' `cos`, `sin` `[batch, 1, seq, d]`:
/// `x·cos + x[swap]·sin`, contiguous, equal to the composition bit for bit.
pub fn rope(x: Tensor<Flex, 4>, tables: &RopeTables<Flex>) -> Tensor<Flex, 4> {
    let [batch, heads, seq, d] = x.dims();
    let x = Rows4::new(x);
    let (cos, sin) = (storage(tables.cos.clone()), storage(tables.sin.clone()));
    let (cos, sin) = (slice(&cos), slice(&sin));
    let runs = rope_runs(d, tables.half);
    let mut out = vec![0.0f32; batch * heads * seq * d];
    out.par_chunks_mut(seq * d).enumerate().for_each(|(bh, out)| {
        let (b, h) = (bh / heads, bh % heads);
        for (s, out) in out.chunks_exact_mut(d).enumerate() {
            let (x, t) = (x.row(b, h, s), (b * seq + s) * d);
            let (cos, sin) = (&cos[t..t + d], &sin[t..t + d]);
            for (own, read) in runs.clone() {
                products_sum(&mut out[own.clone()], &x[own.clone()], &cos[own.clone()], &x[read], &sin[own]);
            }
        }
    });
    host_tensor(out, [batch, heads, seq, d], FloatDType::F32, &Default::default())
}

/// The gradient of `rope` for `grad` `[batch, heads, seq, d]` (`layers::apply_rope_backward`):
/// `grad·cos + (grad·sin)[swap]`. Laid out `[batch, seq, heads, d]` in memory and returned as the head-swapped
/// view of that, the layout of the projections q and k come from, so the gradient flows back into them
/// without a copy.
pub fn rope_grad(grad: Tensor<Flex, 4>, tables: &RopeTables<Flex>) -> Tensor<Flex, 4> {
    let [batch, heads, seq, d] = grad.dims();
    let grad = Rows4::new(grad);
    let (cos, sin) = (storage(tables.cos.clone()), storage(tables.sin.clone()));
    let (cos, sin) = (slice(&cos), slice(&sin));
    let runs = rope_runs(d, tables.half);
    let mut out = vec![0.0f32; batch * seq * heads * d];
    out.par_chunks_mut(heads * d).enumerate().for_each(|(bs, out)| {
        let (b, s) = (bs / seq, bs % seq);
        let (cos, sin) = (&cos[bs * d..(bs + 1) * d], &sin[bs * d..(bs + 1) * d]);
        for (h, out) in out.chunks_exact_mut(d).enumerate() {
            let g = grad.row(b, h, s);
            for (own, read) in runs.clone() {
                products_sum(&mut out[own.clone()], &g[own.clone()], &cos[own], &g[read.clone()], &sin[read]);
            }
        }
    });
    host_tensor::<Flex, 4>(out, [batch, seq, heads, d], FloatDType::F32, &Default::default()).swap_dims(1, 2)
}

#[cfg(test)]
mod tests {
    use burn::tensor::activation::silu;

    use super::*;
    use crate::models::ops::{gelu_tanh, glu_backward, rms_norm_backward, rms_norm_forward};
    use crate::testing::{assert_close, normal, values};

    /// The slice forms against burn's compositions on a strided input (a part of a split projection),
    /// across several pieces and a ragged end, with gates large enough to saturate σ and tanh.
    #[test]
    fn gated_activations_and_their_gradients_equal_the_compositions() {
        let device = Default::default();
        let fused = normal::<Flex, 3>([3, 2 * PIECE / 3 + 7, 6], 0.0, 6.0, 11, &device);
        let [gate, up] = [0, 3].map(|at| fused.clone().narrow(2, at, 3));
        let grad = normal::<Flex, 3>(gate.dims(), 0.0, 1.0, 12, &device);
        for (act, composed) in [
            (GateActivation::Silu, silu(gate.clone()) * up.clone()),
            (GateActivation::GeluTanh, gelu_tanh(gate.clone()) * up.clone()),
        ] {
            let got = glu(gate.clone(), up.clone(), act);
            assert_close(&format!("{act:?} output"), &values(got), &values(composed), 1e-6);
            let (d_gate, d_up) = glu_grads(gate.clone(), up.clone(), grad.clone(), act);
            let (want_gate, want_up) = glu_backward(gate.clone(), up.clone(), grad.clone(), act);
            assert_close(&format!("{act:?} d gate"), &values(d_gate), &values(want_gate), 1e-6);
            assert_close(&format!("{act:?} d up"), &values(d_up), &values(want_up), 1e-6);
        }
    }

    /// Both forms of the norm against the compositions, over several pieces of rows (the weight's gradient
    /// sums across them).
    #[test]
    fn rms_norms_and_their_gradients_equal_the_compositions() {
        let device = Default::default();
        let width = 48;
        let x = normal::<Flex, 3>([2, PIECE / width + 5, width], 0.3, 2.0, 21, &device);
        let grad = normal::<Flex, 3>(x.dims(), 0.0, 1.0, 22, &device);
        for (kind, centre) in [(NormKind::Plain, 1.0), (NormKind::ZeroCentered, 0.0), (NormKind::ScaledInF32, 1.0)] {
            let weight = normal::<Flex, 1>([width], centre, 0.3, 23, &device);
            let got = values(rms_norm(x.clone(), weight.clone(), 1e-6, kind));
            let want = values(rms_norm_forward(x.clone(), weight.clone(), 1e-6, kind));
            assert_close(&format!("{kind:?} output"), &got, &want, 1e-6);
            let (d_x, d_w) = rms_norm_grads(x.clone(), weight.clone(), 1e-6, kind, grad.clone());
            let (want_x, want_w) = rms_norm_backward(x.clone(), weight, 1e-6, kind, grad.clone());
            assert_close(&format!("{kind:?} d x"), &values(d_x), &values(want_x), 1e-6);
            assert_close(&format!("{kind:?} d w"), &values(d_w), &values(want_w), 1e-5);
        }
    }

    /// The loss rows and their logit gradients against the composition, over several pieces of rows and
    /// with large logits (the shift by the maximum keeps them finite); without gradients too.
    #[test]
    fn cross_entropy_rows_equal_the_composition() {
        use crate::train::linear_ce::cross_entropy_rows as composed;
        let device = Default::default();
        let (rows, vocab) = (2 * PIECE / 300 + 3, 300);
        let logits = normal::<Flex, 2>([rows, vocab], 0.0, 30.0, 16, &device);
        let targets: Vec<i64> = (0..rows as i64).map(|r| (r * 37) % vocab as i64).collect();
        let targets =
            Tensor::<Flex, 2, burn::tensor::Int>::from_data(burn::tensor::TensorData::new(targets, [rows, 1]), &device);
        let coef = normal::<Flex, 2>([rows, 1], 0.5, 0.2, 17, &device);
        let (nll, dlogits) = cross_entropy_rows(logits.clone(), targets.clone(), coef.clone(), true);
        let (want_nll, want_dlogits) = composed(logits.clone(), targets.clone(), coef.clone(), true);
        assert_close("nll", &values(nll), &values(want_nll), 1e-6);
        let (got, want) = (values(dlogits.expect("asked for")), values(want_dlogits.expect("asked for")));
        assert_close("dlogits", &got, &want, 1e-6);
        let (nll, none) = cross_entropy_rows(logits.clone(), targets.clone(), coef.clone(), false);
        assert!(none.is_none());
        assert_close("nll without gradients", &values(nll), &values(composed(logits, targets, coef, false).0), 1e-6);
    }

    /// A part's gradient into zeros and into a gradient already written, against the composition, over
    /// several pieces of rows; a `whole` held elsewhere too is left as it was.
    #[test]
    fn a_part_adds_into_the_whole_as_the_composition_does() {
        use crate::models::ops::add_part_composed;
        let device = Default::default();
        let dims = [2, PIECE / 9 + 3, 9];
        let grad = normal::<Flex, 3>([2, PIECE / 9 + 3, 4], 0.0, 1.0, 14, &device);
        let first = add_part(None, dims, 5..9, grad.clone());
        assert_eq!(values(first.clone()), values(add_part_composed(None, dims, 5..9, grad.clone())));
        let whole = normal::<Flex, 3>(dims, 0.0, 1.0, 15, &device);
        let before = values(whole.clone());
        let got = add_part(Some(whole.clone()), dims, 1..5, grad.clone());
        assert_eq!(values(got), values(add_part_composed(Some(whole.clone()), dims, 1..5, grad)));
        assert_eq!(values(whole), before, "the shared input is unchanged");
    }

    /// The slice forms of RoPE and its gradient against the compositions, bit for bit: on the head-swapped
    /// view the models pass, on a contiguous input and on one whose last dimension is strided, with a
    /// partial rotary width. The gradient comes back as the head-swapped view of a contiguous tensor.
    #[test]
    fn rope_and_its_gradient_equal_the_compositions_bit_for_bit() {
        use crate::models::layers::{SequenceLayout, apply_rope, apply_rope_backward};
        let device = Default::default();
        let layout = SequenceLayout::from_doc_lengths(&[vec![5, 6], vec![11]], 11);
        let tables = RopeTables::<Flex>::new(&layout, 10, 6, 1e4, FloatDType::F32, &device);
        let seq_major = normal::<Flex, 4>([2, 11, 3, 10], 0.0, 1.0, 31, &device);
        let transposed = normal::<Flex, 4>([2, 3, 10, 11], 0.0, 1.0, 32, &device);
        let inputs =
            [seq_major.clone().swap_dims(1, 2), contiguous(seq_major.swap_dims(1, 2)), transposed.swap_dims(2, 3)];
        for (case, x) in inputs.into_iter().enumerate() {
            assert_eq!(values(rope(x.clone(), &tables)), values(apply_rope(x.clone(), &tables)), "case {case}");
            let grad = rope_grad(x.clone(), &tables);
            assert_eq!(values(grad.clone()), values(apply_rope_backward(x, &tables)), "case {case} gradient");
            assert!(grad.swap_dims(1, 2).into_primitive().tensor().as_slice::<f32>().is_some(), "case {case}");
        }
    }

    #[test]
    fn a_strided_part_becomes_contiguous_with_the_same_values() {
        let device = Default::default();
        let fused = normal::<Flex, 3>([2, 5, 9], 0.0, 1.0, 13, &device);
        let part = fused.narrow(2, 3, 4);
        let made = contiguous(part.clone());
        assert!(made.clone().into_primitive().tensor().as_slice::<f32>().is_some());
        assert_eq!(values(made), values(part));
    }
}
