//! The gated delta rule of `deltanet` as per-token loops over f32 host slices, for the CPU backend. The
//! chunked form exists to turn the scan into matmuls a GPU runs well; on a CPU the recurrence itself is
//! the cheaper form (about `4·dk·dv` multiply-adds per token and head, against the chunked form's extra
//! `C·(dk + dv)` for its in-chunk products and triangular solve) and builds no `[C, C]` tensors.
//! Forward: the outputs and the state each chunk of `C` tokens starts from (what the autodiff op keeps, as
//! the chunked form's does), from an empty state or a decoding cache's. Backward: per chunk, last to
//! first, the chunk's states are recomputed from its saved start and the token recurrence is
//! differentiated in reverse. Work is split over (row, head) with rayon and each task runs in one fixed
//! order, so results do not depend on the number of threads. Flex with all inputs f32 runs it
//! (`backend.rs`); other dtypes and backends keep the chunked tensor ops.
//!
//! Per token, with the state `S ∈ R^{dk×dv}` (row-major): `S' = a·S` (`a = exp(g)`, 0 where a document
//! starts), `r = v − S'ᵀk`, `δ = β r`, `S = S' + k δᵀ`, `o = Sᵀq`.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor};
use rayon::prelude::*;

use super::deltanet::{ChunkPlan, ChunkedScan, ScanInputs};
use super::host_slices::{axpy, dot, host, row, row_mut};
use crate::backend::host_tensor;

/// The sizes of one scan: q, k `[batch, heads, seq, dk]`, v `[batch, heads, seq, dv]`, g and β
/// `[batch, heads, seq]`, states saved every `chunk` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanDims {
    pub batch: usize,
    pub heads: usize,
    pub seq: usize,
    pub dk: usize,
    pub dv: usize,
    pub chunk: usize,
}

impl ScanDims {
    fn chunks(&self) -> usize {
        self.seq.div_ceil(self.chunk).max(1)
    }

    fn state(&self) -> usize {
        self.dk * self.dv
    }
}

/// One head's inputs, sliced from the whole scan's.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    /// Whether each position carries the state of the one before it.
    carries: &'a [bool],
}

/// The whole scan's inputs as host slices, row-major in the shapes of `ScanDims`; `carries` is
/// `[batch, seq]`.
pub struct HostScan<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub carries: &'a [bool],
    pub dims: ScanDims,
}

impl HostScan<'_> {
    fn head(&self, bh: usize) -> Head<'_> {
        let ScanDims { heads, seq, dk, dv, .. } = self.dims;
        Head {
            q: row(self.q, bh, seq * dk),
            k: row(self.k, bh, seq * dk),
            v: row(self.v, bh, seq * dv),
            g: row(self.g, bh, seq),
            beta: row(self.beta, bh, seq),
            carries: row(self.carries, bh / heads, seq),
        }
    }
}

impl Head<'_> {
    /// The decay token `t` applies to the state before it.
    fn decay(&self, t: usize) -> f32 {
        if self.carries[t] { self.g[t].exp() } else { 0.0 }
    }

    /// Token `t`'s update of `state` (`S ← S'`, then `S' + k δᵀ`), leaving `r = v − S'ᵀk` in `residual`,
    /// `δ` in `delta` and, when asked, `S'` in `decayed`.
    fn step(&self, t: usize, dims: ScanDims, state: &mut [f32], out: StepOut) {
        let ScanDims { dk, dv, .. } = dims;
        let StepOut { residual, delta, decayed } = out;
        let a = self.decay(t);
        state.iter_mut().for_each(|s| *s *= a);
        if let Some(decayed) = decayed {
            decayed.copy_from_slice(state);
        }
        let (k, v) = (row(self.k, t, dk), row(self.v, t, dv));
        residual.copy_from_slice(v);
        for (i, &ki) in k.iter().enumerate() {
            axpy(-ki, row(state, i, dv), residual);
        }
        for (d, r) in delta.iter_mut().zip(residual.iter()) {
            *d = self.beta[t] * r;
        }
        for (i, &ki) in k.iter().enumerate() {
            axpy(ki, delta, row_mut(state, i, dv));
        }
    }
}

/// Where `Head::step` leaves what the backward pass needs of a token.
struct StepOut<'a> {
    residual: &'a mut [f32],
    delta: &'a mut [f32],
    decayed: Option<&'a mut [f32]>,
}

/// The outputs `[batch, heads, seq, dv]`, the state every chunk starts from `[batch, heads, chunks, dk, dv]`
/// and the final state `[batch, heads, dk, dv]`, from `initial` (same shape as the final state) or an empty
/// state.
pub fn forward(scan: &HostScan, initial: Option<&[f32]>) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let dims = scan.dims;
    let ScanDims { batch, heads, seq, dk, dv, chunk } = dims;
    let state_len = dims.state();
    let mut out = vec![0.0f32; batch * heads * seq * dv];
    let mut states = vec![0.0f32; batch * heads * dims.chunks() * state_len];
    let mut last = match initial {
        Some(initial) => initial.to_vec(),
        None => vec![0.0f32; batch * heads * state_len],
    };
    let tasks = out.par_chunks_mut(seq * dv).zip(states.par_chunks_mut(dims.chunks() * state_len));
    tasks.zip(last.par_chunks_mut(state_len)).enumerate().for_each(|(bh, ((out, states), state))| {
        let head = scan.head(bh);
        let (mut residual, mut delta) = (vec![0.0f32; dv], vec![0.0f32; dv]);
        for t in 0..seq {
            if t % chunk == 0 {
                row_mut(states, t / chunk, state_len).copy_from_slice(state);
            }
            head.step(t, dims, state, StepOut { residual: &mut residual, delta: &mut delta, decayed: None });
            let o = row_mut(out, t, dv);
            for (i, &qi) in row(head.q, t, dk).iter().enumerate() {
                axpy(qi, row(state, i, dv), o);
            }
        }
    });
    (out, states, last)
}

/// The gradients of one scan, row-major like its inputs.
pub struct ScanGradients {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
}

/// Gradients of `forward`'s outputs for `grad_out` `[batch, heads, seq, dv]`, given the chunk start states
/// `forward` returned. Backwards through token `t`, with `dS` the gradient of the state after it:
/// `dq = S do`; `dS += q doᵀ`; `dδ = dSᵀk`, `dk = dS δ`; `dv = β dδ`, `dβ = dδ·r`; `dp = −β dδ`;
/// `dS' = dS + k dpᵀ`, `dk += S' dp`; `dg = ⟨dS', S'⟩`; `dS ← a dS'`.
pub fn backward(scan: &HostScan, chunk_states: &[f32], grad_out: &[f32]) -> ScanGradients {
    let dims = scan.dims;
    let ScanDims { seq, dk, dv, chunk, .. } = dims;
    let state_len = dims.state();
    let mut d = ScanGradients {
        q: vec![0.0; scan.q.len()],
        k: vec![0.0; scan.k.len()],
        v: vec![0.0; scan.v.len()],
        g: vec![0.0; scan.g.len()],
        beta: vec![0.0; scan.beta.len()],
    };
    let key_tasks = d.q.par_chunks_mut(seq * dk).zip(d.k.par_chunks_mut(seq * dk));
    let tasks =
        key_tasks.zip(d.v.par_chunks_mut(seq * dv)).zip(d.g.par_chunks_mut(seq)).zip(d.beta.par_chunks_mut(seq));
    tasks.enumerate().for_each(|(bh, ((((dq, dkey), dval), dg), dbeta))| {
        let head = scan.head(bh);
        let grad_out = row(grad_out, bh, seq * dv);
        let starts = row(chunk_states, bh, dims.chunks() * state_len);
        // Per position of the chunk: S' (the state after the decay), r and δ.
        let mut decayed = vec![0.0f32; chunk * state_len];
        let (mut residuals, mut deltas) = (vec![0.0f32; chunk * dv], vec![0.0f32; chunk * dv]);
        let mut state = vec![0.0f32; state_len];
        let mut d_state = vec![0.0f32; state_len];
        let (mut d_delta, mut d_read) = (vec![0.0f32; dv], vec![0.0f32; dv]);
        for n in (0..dims.chunks()).rev() {
            let positions = n * chunk..((n + 1) * chunk).min(seq);
            state.copy_from_slice(row(starts, n, state_len));
            for t in positions.clone() {
                let at = t - n * chunk;
                let out = StepOut {
                    residual: row_mut(&mut residuals, at, dv),
                    delta: row_mut(&mut deltas, at, dv),
                    decayed: Some(row_mut(&mut decayed, at, state_len)),
                };
                head.step(t, dims, &mut state, out);
            }
            for t in positions.rev() {
                let at = t - n * chunk;
                let (before, residual, delta) =
                    (row(&decayed, at, state_len), row(&residuals, at, dv), row(&deltas, at, dv));
                let (q, k, d_out) = (row(head.q, t, dk), row(head.k, t, dk), row(grad_out, t, dv));
                let beta = head.beta[t];
                // dq = S do with S = S' + k δᵀ.
                let through_delta = dot(delta, d_out);
                for ((dq, &ki), i) in row_mut(dq, t, dk).iter_mut().zip(k).zip(0..) {
                    *dq = dot(row(before, i, dv), d_out) + ki * through_delta;
                }
                for (i, &qi) in q.iter().enumerate() {
                    axpy(qi, d_out, row_mut(&mut d_state, i, dv));
                }
                d_delta.fill(0.0);
                for (i, &ki) in k.iter().enumerate() {
                    axpy(ki, row(&d_state, i, dv), &mut d_delta);
                }
                let d_key = row_mut(dkey, t, dk);
                for (i, dki) in d_key.iter_mut().enumerate() {
                    *dki = dot(row(&d_state, i, dv), delta);
                }
                for ((dvj, dr), &dd) in row_mut(dval, t, dv).iter_mut().zip(d_read.iter_mut()).zip(&d_delta) {
                    *dvj = beta * dd;
                    *dr = -beta * dd;
                }
                dbeta[t] = dot(&d_delta, residual);
                for ((i, &ki), dki) in k.iter().enumerate().zip(d_key.iter_mut()) {
                    axpy(ki, &d_read, row_mut(&mut d_state, i, dv));
                    *dki += dot(row(before, i, dv), &d_read);
                }
                dg[t] = dot(&d_state, before);
                let a = head.decay(t);
                d_state.iter_mut().for_each(|s| *s *= a);
            }
        }
    });
    d
}

/// Whether the host loops take these inputs (all five f32); the callers keep the tensor ops otherwise.
pub fn takes<B: Backend>(inputs: &ScanInputs<B>) -> bool {
    [inputs.q.dtype(), inputs.k.dtype(), inputs.v.dtype(), inputs.g.dtype(), inputs.beta.dtype()]
        .iter()
        .all(|d| *d == DType::F32)
}

/// The inputs' host values and sizes.
struct Loaded {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    dims: ScanDims,
}

impl Loaded {
    fn new<B: Backend>(inputs: ScanInputs<B>, chunk: usize) -> Self {
        let [batch, heads, seq, dk] = inputs.k.dims();
        let dv = inputs.v.dims()[3];
        Loaded {
            q: host(inputs.q),
            k: host(inputs.k),
            v: host(inputs.v),
            g: host(inputs.g),
            beta: host(inputs.beta),
            dims: ScanDims { batch, heads, seq, dk, dv, chunk },
        }
    }

    fn scan<'a>(&'a self, carries: &'a [bool]) -> HostScan<'a> {
        HostScan { q: &self.q, k: &self.k, v: &self.v, g: &self.g, beta: &self.beta, carries, dims: self.dims }
    }
}

/// `deltanet::chunked_scan` through `forward`: the same outputs and states, in f32.
pub fn scan_on_host<B: Backend>(
    inputs: ScanInputs<B>,
    plan: &ChunkPlan<B>,
    initial: Option<Tensor<B, 4>>,
) -> ChunkedScan<B> {
    let device = inputs.q.device();
    let loaded = Loaded::new(inputs, plan.size());
    let initial = initial.map(|s| host(s.cast(FloatDType::F32)));
    let (out, states, last) = forward(&loaded.scan(plan.carries()), initial.as_deref());
    let ScanDims { batch, heads, seq, dk, dv, .. } = loaded.dims;
    ChunkedScan {
        out: host_tensor(out, [batch, heads, seq, dv], FloatDType::F32, &device),
        chunk_states: host_tensor(states, [batch, heads, loaded.dims.chunks(), dk, dv], FloatDType::F32, &device),
        last: host_tensor(last, [batch, heads, dk, dv], FloatDType::F32, &device),
    }
}

/// `deltanet::chunked_backward` through `backward`, in f32.
pub fn backward_on_host<B: Backend>(
    inputs: ScanInputs<B>,
    plan: &ChunkPlan<B>,
    chunk_states: Tensor<B, 5>,
    grad_out: Tensor<B, 4>,
) -> ScanInputs<B> {
    let device = inputs.q.device();
    let (key_shape, value_shape, rate_shape) = (inputs.k.dims(), inputs.v.dims(), inputs.g.dims());
    let loaded = Loaded::new(inputs, plan.size());
    let d = backward(&loaded.scan(plan.carries()), &host(chunk_states), &host(grad_out.cast(FloatDType::F32)));
    let per_token = |values, shape| host_tensor::<B, 4>(values, shape, FloatDType::F32, &device);
    let per_rate = |values| host_tensor::<B, 3>(values, rate_shape, FloatDType::F32, &device);
    ScanInputs {
        q: per_token(d.q, key_shape),
        k: per_token(d.k, key_shape),
        v: per_token(d.v, value_shape),
        g: per_rate(d.g),
        beta: per_rate(d.beta),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::models::deltanet::{DocSegments, chunked_backward, chunked_scan};
    use crate::testing::{assert_close, normal, values};

    /// Three rows of 21 tokens in chunks of 8: one document over 2.6 chunks; three documents, one across a
    /// chunk boundary; single-token documents at the end.
    fn segments() -> DocSegments {
        let seq = 21;
        let mut docs = vec![0u32; seq];
        docs.extend((0..seq).map(|t| u32::from(t >= 5) + u32::from(t >= 13)));
        docs.extend((0..seq).map(|t| if t < 17 { 0 } else { t as u32 - 16 }));
        DocSegments::from_doc_ids(3, seq, docs)
    }

    fn inputs(heads: usize, dk: usize, dv: usize) -> ScanInputs<Cpu> {
        let device = Default::default();
        let unit = |x: Tensor<Cpu, 4>| x.clone() / (x.powf_scalar(2.0).sum_dim(3) + 1e-6).sqrt();
        let rate = |seed| normal::<Cpu, 3>([3, heads, 21], 0.0, 1.0, seed, &device);
        ScanInputs {
            q: unit(normal([3, heads, 21, dk], 0.0, 1.0, 1, &device)) * (1.0 / (dk as f64).sqrt()),
            k: unit(normal([3, heads, 21, dk], 0.0, 1.0, 2, &device)),
            v: normal([3, heads, 21, dv], 0.0, 1.0, 3, &device),
            g: -burn::tensor::activation::softplus(rate(4), 1.0) * 0.5,
            beta: burn::tensor::activation::sigmoid(rate(5)),
        }
    }

    fn copy(x: &ScanInputs<Cpu>) -> ScanInputs<Cpu> {
        ScanInputs { q: x.q.clone(), k: x.k.clone(), v: x.v.clone(), g: x.g.clone(), beta: x.beta.clone() }
    }

    #[test]
    fn the_host_scan_equals_the_chunked_form_forward_and_backward() {
        let device = Default::default();
        let plan = ChunkPlan::<Cpu>::new(&segments(), 8, &device);
        // dk ≠ dv, and widths that leave remainders after the eight-lane dot product.
        for (heads, dk, dv) in [(2, 4, 3), (3, 12, 16), (1, 9, 9)] {
            let x = inputs(heads, dk, dv);
            let case = format!("heads {heads}, dk {dk}, dv {dv}");
            let reference = chunked_scan(copy(&x), &plan, None);
            let host = scan_on_host(copy(&x), &plan, None);
            for (name, a, b) in [
                ("chunk states", values(host.chunk_states.clone()), values(reference.chunk_states.clone())),
                ("last state", values(host.last), values(reference.last)),
                ("output", values(host.out), values(reference.out)),
            ] {
                assert_close(&format!("{name}, {case}"), &a, &b, 2e-6);
            }
            let grad_out = normal::<Cpu, 4>([3, heads, 21, dv], 0.0, 1.0, 6, &device);
            let expected = chunked_backward(copy(&x), &plan, reference.chunk_states, grad_out.clone());
            let got = backward_on_host(x, &plan, host.chunk_states, grad_out);
            for (name, a, b) in [
                ("dq", values(got.q), values(expected.q)),
                ("dk", values(got.k), values(expected.k)),
                ("dv", values(got.v), values(expected.v)),
                ("dg", values(got.g), values(expected.g)),
                ("dbeta", values(got.beta), values(expected.beta)),
            ] {
                assert_close(&format!("{name}, {case}"), &a, &b, 4e-6);
            }
        }
    }

    #[test]
    fn a_scan_from_a_cached_state_equals_the_chunked_form() {
        // Row 0 continues the state; row 1's tokens belong to another document than its state (ignored).
        let device = Default::default();
        let segments = DocSegments { batch: 2, seq: 21, doc_ids: vec![0; 42], initial_doc: vec![0, 1] };
        let plan = ChunkPlan::<Cpu>::new(&segments, 8, &device);
        let x = inputs(2, 4, 3);
        let narrow = |t: Tensor<Cpu, 4>| t.narrow(0, 0, 2);
        let x = ScanInputs {
            q: narrow(x.q),
            k: narrow(x.k),
            v: narrow(x.v),
            g: x.g.narrow(0, 0, 2),
            beta: x.beta.narrow(0, 0, 2),
        };
        let initial = normal::<Cpu, 4>([2, 2, 4, 3], 0.0, 1.0, 7, &device);
        let reference = chunked_scan(copy(&x), &plan, Some(initial.clone()));
        let host = scan_on_host(x, &plan, Some(initial));
        assert_close("chunk states", &values(host.chunk_states), &values(reference.chunk_states), 2e-6);
        assert_close("last state", &values(host.last), &values(reference.last), 2e-6);
        assert_close("output", &values(host.out), &values(reference.out), 2e-6);
    }

    #[test]
    fn a_document_start_cuts_the_state_and_its_gradient() {
        // Row 1's third document starts at token 13: nothing before it reaches its outputs, and no gradient
        // of its outputs reaches the tokens before it (nor the decay of its own first token).
        let device = Default::default();
        let plan = ChunkPlan::<Cpu>::new(&segments(), 8, &device);
        let x = inputs(2, 4, 3);
        let scan = scan_on_host(copy(&x), &plan, None);
        let mut only_doc = vec![0.0f32; 3 * 2 * 21 * 3];
        for h in 0..2 {
            for t in 13..21 {
                for j in 0..3 {
                    only_doc[((2 + h) * 21 + t) * 3 + j] = 1.0;
                }
            }
        }
        let grad_out = crate::backend::host_tensor::<Cpu, 4>(only_doc, [3, 2, 21, 3], FloatDType::F32, &device);
        let d = backward_on_host(x, &plan, scan.chunk_states, grad_out);
        let (dv, dg) = (values(d.v), values(d.g));
        for h in 0..2 {
            let head = 2 + h;
            assert!((0..13 * 3).all(|i| dv[head * 21 * 3 + i] == 0.0), "head {h}: values before the document");
            assert!((0..=13).all(|t| dg[head * 21 + t] == 0.0), "head {h}: decays up to the document's start");
            assert!((13 * 3..21 * 3).any(|i| dv[head * 21 * 3 + i] != 0.0), "head {h}: the document's own values");
        }
        let other_rows = |x: &[f32], per: usize| x[..2 * 21 * per].iter().chain(&x[4 * 21 * per..]).all(|v| *v == 0.0);
        assert!(other_rows(&dv, 3) && other_rows(&dg, 1), "other rows get no gradient");
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let carries: Vec<bool> = (0..2 * 40).map(|t| t % 40 != 0 && t % 40 != 17).collect();
        let dims = ScanDims { batch: 2, heads: 3, seq: 40, dk: 12, dv: 10, chunk: 16 };
        let data = |n: usize, f: f32| (0..n).map(|i| (i as f32 * f).sin()).collect::<Vec<f32>>();
        let (q, k, v) = (data(2 * 3 * 40 * 12, 0.3), data(2 * 3 * 40 * 12, 0.7), data(2 * 3 * 40 * 10, 1.1));
        let g: Vec<f32> = data(2 * 3 * 40, 0.9).iter().map(|x| -x.abs()).collect();
        let (beta, grad_out) = (data(2 * 3 * 40, 1.7).iter().map(|x| x.abs()).collect::<Vec<_>>(), data(2400, 1.3));
        let scan = HostScan { q: &q, k: &k, v: &v, g: &g, beta: &beta, carries: &carries, dims };
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            pool.install(|| {
                let (out, states, last) = forward(&scan, None);
                let d = backward(&scan, &states, &grad_out);
                (out, states, last, d.q, d.k, d.v, d.g, d.beta)
            })
        };
        assert!(run(1) == run(3), "one thread and three give the same bits");
    }
}
