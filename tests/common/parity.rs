//! Parity fixtures written by tests/fixtures/*/make_fixtures.py (transformers 5.23.0): inputs, logits,
//! a packed row, the masked loss and its gradients; and the comparisons the parity tests make.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use kiln::models::hf::{ExportDtype, hf_tensors};
use kiln::models::weights::HostTensor;
use kiln::models::{CausalLm, SequenceLayout, WeightStore, load_model};
use safetensors::SafeTensors;

/// The CPU backend the parity tests compare in f32.
pub type Cpu = burn::backend::Flex<f32>;

pub struct Fixture {
    pub ids: (Vec<i64>, Vec<usize>),
    pub mask: Vec<i64>,
    pub logits: (Vec<f32>, Vec<usize>),
    pub packed_ids: Vec<i64>,
    pub packed_logits: Vec<f32>,
    pub loss: f32,
    pub grads: BTreeMap<String, (Vec<f32>, Vec<usize>)>,
}

impl Fixture {
    pub fn shape(&self) -> [usize; 2] {
        [self.ids.1[0], self.ids.1[1]]
    }
}

pub fn read_f32(t: &safetensors::tensor::TensorView) -> Vec<f32> {
    t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

pub fn read_i64(t: &safetensors::tensor::TensorView) -> Vec<i64> {
    t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// `dir/fixture.safetensors`.
pub fn fixture(dir: &Path) -> Fixture {
    let bytes = std::fs::read(dir.join("fixture.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let get = |k: &str| st.tensor(k).unwrap();
    let mut grads = BTreeMap::new();
    for k in st.names() {
        if let Some(key) = k.strip_prefix("grad.") {
            let t = get(k);
            grads.insert(key.to_string(), (read_f32(&t), t.shape().to_vec()));
        }
    }
    Fixture {
        ids: (read_i64(&get("input_ids")), get("input_ids").shape().to_vec()),
        mask: read_i64(&get("loss_mask")),
        logits: (read_f32(&get("logits")), get("logits").shape().to_vec()),
        packed_ids: read_i64(&get("packed_ids")),
        packed_logits: read_f32(&get("packed_logits")),
        loss: read_f32(&get("loss"))[0],
        grads,
    }
}

/// One f32 tensor of `dir/fixture.safetensors`.
pub fn tensor_f32(dir: &Path, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(dir.join("fixture.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    read_f32(&st.tensor(name).unwrap())
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// `max_abs_diff` relative to `want`'s largest magnitude: how the tests compare a gradient or parameter tensor.
pub fn error_relative_to_largest(want: &[f32], got: &[f32]) -> f32 {
    max_abs_diff(got, want) / want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-12)
}

/// A kernel's output and gradients (most kernels': two), as host values.
pub type KernelResults<const N: usize = 3> = [Vec<f32>; N];

/// One comparison of `assert_kernel_results`: what it compares, the kernel's results, the reference's.
pub type KernelComparison<'a, const N: usize = 3> = (&'a str, &'a KernelResults<N>, &'a KernelResults<N>);

/// A kernel's results (`names`: its output and gradients) against references: each comparison is
/// (what it compares, the kernel's results, the reference's), and each result must lie within `relative[i]`
/// of the reference's largest magnitude (at least 1) of it. `case` names the inputs in messages.
pub fn assert_kernel_results<const N: usize>(
    case: &str,
    names: [&str; N],
    comparisons: &[KernelComparison<N>],
    relative: [f32; N],
) {
    for (i, name) in names.into_iter().enumerate() {
        for (what, got, want) in comparisons {
            let scale = want[i].iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let error = max_abs_diff(&got[i], &want[i]);
            eprintln!("{case} {name}: {error:.2e} {what} (largest {scale:.1})");
            assert!(error <= relative[i] * scale, "{case} {name}: {what} off by {error} (largest {scale})");
        }
    }
}

pub fn ids_tensor<B: Backend>(ids: &[i64], shape: [usize; 2], device: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(ids.to_vec(), shape), device)
}

pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}

/// Mean next-token cross-entropy over supervised positions, in f32.
pub fn masked_ce<B: Backend>(logits: Tensor<B, 3>, ids: &[i64], mask: &[i64], shape: [usize; 2]) -> Tensor<B, 1> {
    let [b, s] = shape;
    let device = logits.device();
    let logp = log_softmax(logits.narrow(1, 0, s - 1), 2);
    let targets: Vec<i64> = (0..b).flat_map(|r| (1..s).map(move |t| (r, t))).map(|(r, t)| ids[r * s + t]).collect();
    let weights: Vec<f32> =
        (0..b).flat_map(|r| (1..s).map(move |t| (r, t))).map(|(r, t)| mask[r * s + t] as f32).collect();
    let count: f32 = weights.iter().sum();
    let target = Tensor::<B, 3, Int>::from_data(TensorData::new(targets, [b, s - 1, 1]), &device);
    let nll = logp.gather(2, target).neg().reshape([b * (s - 1)]);
    let w = Tensor::<B, 1>::from_data(TensorData::new(weights, [b * (s - 1)]), &device);
    (nll * w).sum() / count
}

/// Every fixture gradient against ours, within `tolerance` relative to the gradient's largest entry.
pub fn check_gradients(name: &str, fixture: &Fixture, ours: &BTreeMap<String, HostTensor>, tolerance: f32) {
    assert!(!fixture.grads.is_empty());
    for (key, (want, shape)) in &fixture.grads {
        let got = ours.get(key).unwrap_or_else(|| panic!("{name}: no gradient for {key}"));
        assert_eq!(&got.shape, shape, "{key}");
        let err = error_relative_to_largest(want, &got.data);
        eprintln!("{name}: gradient of {key}: relative error {err:.2e}");
        assert!(err <= tolerance, "{name}: gradient of {key} off by {err} (relative to its max)");
    }
}

/// `prefill` tokens of `row` through `model`'s cache, then the rest one at a time: every position's logits
/// within 1e-4 of the full forward's (`full`, `[row.len() · vocab]`). On Qwen3.5 the prefill runs the
/// DeltaNet's chunked form and hands its final state to the recurrent form.
pub fn assert_cached_decoding_follows<B: Backend, M: kiln::models::decode::CachedDecoding<B>>(
    model: &M,
    row: &[i64],
    prefill: usize,
    full: &[f32],
    tolerance: f32,
    device: &B::Device,
) {
    let vocab = full.len() / row.len();
    let mut cache = model.new_cache(1, device);
    let logits = values(model.forward_cached(
        ids_tensor::<B>(&row[..prefill], [1, prefill], device),
        &[vec![true; prefill]],
        &mut cache,
    ));
    let err = max_abs_diff(&logits, &full[..prefill * vocab]);
    assert!(err <= tolerance, "prefill differs by {err}");
    for t in prefill..row.len() {
        let step =
            values(model.forward_cached(ids_tensor::<B>(&row[t..=t], [1, 1], device), &[vec![true]], &mut cache));
        let err = max_abs_diff(&step, &full[t * vocab..(t + 1) * vocab]);
        assert!(err <= tolerance, "step {t} differs by {err}");
    }
}

/// The f32 logits of the fixture in `dir` (architecture from its config.json, plain rows) within 1e-4 of the
/// exact (f64) logits, and within transformers' own f32 error plus 1e-4 of transformers' f32 ones (a deep
/// model's f32 run is itself ~1e-4 from the exact answer); and its packed row, documents of `docs` tokens,
/// equal to each document run alone.
pub fn assert_logits_match_transformers(name: &str, dir: &Path, vocab: usize, docs: &[u32]) {
    let f = fixture(dir);
    let device = Default::default();
    let (_, model) = load_model::<Cpu>(dir, &device).unwrap();
    let shape = f.shape();
    assert_eq!(f.logits.1, [shape[0], shape[1], vocab]);
    let got =
        values(model.forward(ids_tensor::<Cpu>(&f.ids.0, shape, &device), &SequenceLayout::single(shape[0], shape[1])));
    let exact = tensor_f32(dir, "logits_f64");
    let (err, err_exact, reference_err) =
        (max_abs_diff(&got, &f.logits.0), max_abs_diff(&got, &exact), max_abs_diff(&f.logits.0, &exact));
    let peak = f.logits.0.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    eprintln!(
        "{name}: logits max-abs error {err:.2e} vs transformers f32, {err_exact:.2e} vs exact (transformers f32: \
         {reference_err:.2e}); logits up to {peak:.2}"
    );
    assert!(err_exact <= 1e-4, "logits max-abs error {err_exact} from the exact answer");
    assert!(err <= 1e-4 + reference_err, "logits max-abs error {err} from transformers");

    let seq = shape[1];
    let packed = SequenceLayout::from_doc_lengths(&[docs.to_vec()], seq);
    let got = values(model.forward(ids_tensor::<Cpu>(&f.packed_ids, [1, seq], &device), &packed));
    let err = max_abs_diff(&got, &f.packed_logits);
    assert!(err <= 1e-4, "packed documents leak into each other (max-abs {err})");
}

/// The masked cross-entropy of the fixture in `dir` through the model's forward pass: the loss within 1e-4
/// of transformers' and every fixture gradient within 1e-4 relative.
pub fn assert_gradients_match_transformers(name: &str, dir: &Path) {
    type Train = burn::backend::Autodiff<burn::backend::Flex<f32>>;
    let f = fixture(dir);
    let device = Default::default();
    let (_, model) = load_model::<Train>(dir, &device).unwrap();
    let shape = f.shape();
    let logits =
        model.forward(ids_tensor::<Train>(&f.ids.0, shape, &device), &SequenceLayout::single(shape[0], shape[1]));
    let loss = masked_ce(logits, &f.ids.0, &f.mask, shape);
    let value = values(loss.clone())[0];
    assert!((value - f.loss).abs() <= 1e-4, "loss {value} vs {}", f.loss);
    let grads = loss.backward();
    check_gradients(name, &f, &kiln::models::hf::hf_gradients(&model, &grads), 1e-4);
}

/// Two left-padded prompts of different lengths cut from `row` (9 and 17 tokens) through `model`'s cache at
/// once: each row's last logits equal that prompt alone through `forward` (the full forward pass), and
/// greedy generation of the batch equals generating each prompt alone.
pub fn assert_padded_batches_follow<B: Backend, M: kiln::models::decode::CachedDecoding<B>>(
    model: &M,
    row: &[i64],
    forward: impl Fn(Tensor<B, 2, Int>, &SequenceLayout) -> Tensor<B, 3>,
    device: &B::Device,
) {
    use kiln::models::decode::generate_greedy;
    let prompts: Vec<Vec<u32>> = [&row[..9], &row[3..20]].map(|p| p.iter().map(|&x| x as u32).collect()).to_vec();
    let mut cache = model.new_cache(2, device);
    let mut ids = vec![0i64; 8];
    ids.extend(row[..9].iter().chain(&row[3..20]));
    let valid = vec![[vec![false; 8], vec![true; 9]].concat(), vec![true; 17]];
    let batched = values(model.forward_cached(ids_tensor::<B>(&ids, [2, 17], device), &valid, &mut cache));
    let vocab = batched.len() / 34;
    for (r, p) in prompts.iter().enumerate() {
        let alone_ids: Vec<i64> = p.iter().map(|&x| i64::from(x)).collect();
        let alone =
            values(forward(ids_tensor::<B>(&alone_ids, [1, p.len()], device), &SequenceLayout::single(1, p.len())));
        let err = max_abs_diff(&alone[(p.len() - 1) * vocab..], &batched[(r * 17 + 16) * vocab..(r * 17 + 17) * vocab]);
        assert!(err <= 1e-4, "row {r} of a padded batch differs by {err}");
    }
    let together = generate_greedy(model, &prompts, 5, &[], device);
    for (r, p) in prompts.iter().enumerate() {
        assert_eq!(together[r], generate_greedy(model, std::slice::from_ref(p), 5, &[], device)[0], "row {r}");
        assert_eq!(together[r].len(), 5);
    }
}

/// The fixture model in `dir` (`model`, with its full forward pass `forward`) through its KV cache: the
/// first row's `prefill` tokens, then the rest one at a time, every position within 1e-4 of the full forward
/// pass; and two left-padded prompts at once (`assert_padded_batches_follow`).
pub fn assert_decoding_follows_the_forward<M: kiln::models::decode::CachedDecoding<Cpu>>(
    model: &M,
    forward: impl Fn(Tensor<Cpu, 2, Int>, &SequenceLayout) -> Tensor<Cpu, 3>,
    dir: &Path,
    prefill: usize,
) {
    let device = Default::default();
    let f = fixture(dir);
    let row: Vec<i64> = f.ids.0[..f.shape()[1]].to_vec();
    let n = row.len();
    let full = values(forward(ids_tensor::<Cpu>(&row, [1, n], &device), &SequenceLayout::single(1, n)));
    assert_cached_decoding_follows(model, &row, prefill, &full, 1e-4, &device);
    assert_padded_batches_follow(model, &row, forward, &device);
    assert_turns_continue_kept_states(model, &row, &full, &device);
}

/// A conversation's turns through `generate_continuing`: each decodes what its whole prompt decodes from
/// nothing, running only what no kept state holds (a next turn repeating the reply; one re-rendering it,
/// from the prompt's state; one leaving the generation prompt out, from a mark; an unrelated prompt, from
/// nothing). And many ids run after a cached prefix (a turn's new messages) have the full forward's logits
/// (`full`, `[row.len() · vocab]`).
pub fn assert_turns_continue_kept_states<B: Backend, M: kiln::models::decode::CachedDecoding<B>>(
    model: &M,
    row: &[i64],
    full: &[f32],
    device: &B::Device,
) {
    use kiln::models::decode::{Continued, KeptStates, generate_continuing, generate_greedy};
    use kiln::models::sampling::TokenPicker;
    let (n, vocab) = (row.len(), full.len() / row.len());
    let mut cache = model.new_cache(1, device);
    model.forward_cached(ids_tensor::<B>(&row[..3], [1, 3], device), &[vec![true; 3]], &mut cache);
    let piece =
        values(model.forward_cached(ids_tensor::<B>(&row[3..], [1, n - 3], device), &[vec![true; n - 3]], &mut cache));
    let err = max_abs_diff(&piece, &full[3 * vocab..]);
    assert!(err <= 1e-4, "{} ids after 3 cached differ by {err}", n - 3);

    // Ids for the turns, more than a short fixture row holds.
    let pool: Vec<u32> = (0..24).map(|i| ((row[i % n] as usize + i / n * 7) % vocab) as u32).collect();
    let fresh = |prompt: &[u32]| generate_greedy(model, &[prompt.to_vec()], 4, &[], device).remove(0);
    let mut kept = KeptStates::default();
    let mut turn = |prompt: &[u32], marks: &[usize]| {
        let got =
            generate_continuing(model, &mut kept, prompt, marks, 4, &[], &mut TokenPicker::greedy(), |_| true, device);
        (got, kept.kept_ids().into_iter().map(<[u32]>::to_vec).collect::<Vec<_>>())
    };
    let p1 = &pool[..8];
    let (t1, states) = turn(p1, &[5]);
    assert_eq!(t1, Continued { ids: fresh(p1), reused: 0 });
    // At the mark, after the prompt, after the reply (its last id only chosen, not run).
    assert_eq!(states, [pool[..5].to_vec(), p1.to_vec(), [p1, &t1.ids[..3]].concat()]);

    let p2 = [p1, &t1.ids, &pool[8..12]].concat();
    let (t2, _) = turn(&p2, &[]);
    assert_eq!(t2, Continued { ids: fresh(&p2), reused: 8 + 3 }, "a turn repeating the reply");

    let p3 = [&p2[..], &pool[12..16]].concat();
    let (t3, _) = turn(&p3, &[p2.len() + 2]);
    assert_eq!(t3, Continued { ids: fresh(&p3), reused: p2.len() }, "a turn re-rendering the reply");

    let p4 = [&p3[..p2.len() + 2], &pool[16..20]].concat();
    let (t4, _) = turn(&p4, &[]);
    assert_eq!(t4, Continued { ids: fresh(&p4), reused: p2.len() + 2 }, "a turn from the mark");

    let p5: Vec<u32> = pool[16..24].iter().map(|&t| (t + 1) % vocab as u32).collect();
    let reused = if p5.starts_with(&p4[..1]) { 1 } else { 0 };
    let (t5, states) = turn(&p5, &[3]);
    assert_eq!(t5.ids, fresh(&p5), "an unrelated prompt");
    assert!(t5.reused <= reused, "{} ids of an unrelated prompt continued", t5.reused);
    // The same prompt again: nothing of it would be left to run after the prompt's state, so it continues
    // from the mark.
    assert_eq!(states[0], p5[..3]);
    let (again, _) = turn(&p5, &[]);
    assert_eq!(again, Continued { ids: t5.ids.clone(), reused: 3 }, "a prompt run again");
}

/// kiln's export of the fixture model in `dir`, in f32 and in bf16: the source's tensors, the towers kiln does
/// not train byte-identical, the f32 export reloading to the same parameters bit for bit, and `check(dtype,
/// model, exported dir)` for what an architecture adds. Then transformers' reload of kiln's exports (the
/// fixture script's export_check.json, committed): the class `architecture`, logits within 1e-5 of the
/// source's, and each of `flags` (the script's own checks) true.
pub fn assert_export_carries_the_other_towers(
    name: &str,
    dir: &Path,
    architecture: &str,
    flags: &[&str],
    check: impl Fn(ExportDtype, &CausalLm<Cpu>, &Path),
) {
    let device = Default::default();
    let (_, model) = load_model::<Cpu>(dir, &device).unwrap();
    let source = WeightStore::open(dir).unwrap();
    for dtype in [ExportDtype::F32, ExportDtype::Bf16] {
        let out = tempfile::tempdir().unwrap();
        model.export(dir, out.path(), dtype, kiln::models::hf::SHARD_BYTES).unwrap();
        let exported = WeightStore::open(out.path()).unwrap();
        assert_eq!(
            exported.keys().collect::<Vec<_>>(),
            source.keys().collect::<Vec<_>>(),
            "{dtype:?}: the same tensors"
        );
        for key in source.keys().filter(|k| model.is_carried(k)) {
            assert_eq!(exported.raw(key).unwrap(), source.raw(key).unwrap(), "{dtype:?}: {key} changed");
        }
        if dtype == ExportDtype::F32 {
            let (_, again) = load_model::<Cpu>(out.path(), &device).unwrap();
            let (a, b) = (hf_tensors(&model), hf_tensors(&again));
            assert!(a.iter().all(|(k, t)| b[k].data == t.data), "f32 export → reload is exact");
        }
        check(dtype, &model, out.path());
    }
    let path = dir.parent().unwrap().join("export_check.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let results: serde_json::Value = serde_json::from_str(&text).unwrap();
    for dtype in ["f32", "bf16"] {
        let r = &results["results"][format!("{name}/{dtype}")];
        assert_eq!(r["architecture"], architecture, "{dtype}");
        assert!(r["max_abs_logits_error"].as_f64().unwrap() <= 1e-5, "{dtype}: {r}");
        for flag in flags {
            assert_eq!(r[flag].as_bool(), Some(true), "{dtype}: {flag} in {r}");
        }
    }
}

/// Deterministic values in `[lo, hi)` (the kernel tests' inputs).
pub fn spread(len: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((x >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}
