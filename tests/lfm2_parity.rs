//! LFM2 and LFM2-MoE against transformers 5.23.0 on tiny random-init checkpoints
//! (tests/fixtures/lfm2/make_fixtures.py): f32 logits within 1e-4, a row packed with two documents equal to
//! each document run alone, gradients of a masked cross-entropy within 1e-4 relative, both expert layouts,
//! export → reload bit-identical, and clear errors for broken checkpoints.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::backend::{Autodiff, Flex};
use common::parity::{self, Fixture, ids_tensor, masked_ce, max_abs_diff, read_f32};
use kiln::models::hf::{ExportDtype, export_dir, hf_gradients, hf_tensors};
use kiln::models::{Lfm2Model, ModelBackend, SequenceLayout, load_lfm2};
use safetensors::SafeTensors;

type Cpu = Flex<f32>;
type Train = Autodiff<Cpu>;

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lfm2").join(name)
}

fn fixture(name: &str) -> Fixture {
    parity::fixture(&fixture_dir(name))
}

fn logits_of<B: ModelBackend>(
    model: &Lfm2Model<B>,
    ids: &[i64],
    shape: [usize; 2],
    layout: &SequenceLayout,
) -> Vec<f32> {
    let device = Default::default();
    model.forward(ids_tensor::<B>(ids, shape, &device), layout).into_data().convert::<f32>().to_vec().unwrap()
}

fn check_logits(name: &str) {
    let f = fixture(name);
    let device = Default::default();
    let (_, model) = load_lfm2::<Cpu>(&fixture_dir(name), &device).unwrap();
    let shape = [f.ids.1[0], f.ids.1[1]];
    let got = logits_of(&model, &f.ids.0, shape, &SequenceLayout::single(shape[0], shape[1]));
    assert_eq!(f.logits.1, [shape[0], shape[1], 256]);
    let err = max_abs_diff(&got, &f.logits.0);
    let peak = f.logits.0.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    eprintln!("{name}: logits max-abs error {err:.2e} (logits up to {peak:.2})");
    assert!(err <= 1e-4, "{name}: logits max-abs error {err}");

    let packed = SequenceLayout::from_doc_lengths(&[vec![5, 7]], 12);
    let got = logits_of(&model, &f.packed_ids, [1, 12], &packed);
    let err = max_abs_diff(&got, &f.packed_logits);
    assert!(err <= 1e-4, "{name}: packed documents leak into each other (max-abs {err})");
}

#[test]
fn lfm2_logits_match_transformers() {
    check_logits("lfm2-tiny");
}

#[test]
fn lfm2_moe_logits_match_transformers() {
    check_logits("lfm2-moe-tiny");
}

fn check_gradients(name: &str) {
    let f = fixture(name);
    let device = Default::default();
    let (_, model) = load_lfm2::<Train>(&fixture_dir(name), &device).unwrap();
    let shape = [f.ids.1[0], f.ids.1[1]];
    let logits =
        model.forward(ids_tensor::<Train>(&f.ids.0, shape, &device), &SequenceLayout::single(shape[0], shape[1]));
    let loss = masked_ce(logits, &f.ids.0, &f.mask, shape);
    let value: f32 = loss.clone().into_data().convert::<f32>().to_vec::<f32>().unwrap()[0];
    assert!((value - f.loss).abs() <= 1e-4, "{name}: loss {value} vs {}", f.loss);
    let grads = loss.backward();
    parity::check_gradients(name, &f, &hf_gradients(&model, &grads), 1e-4);
}

#[test]
fn lfm2_gradients_match_transformers() {
    check_gradients("lfm2-tiny");
}

#[test]
fn lfm2_moe_gradients_match_transformers() {
    check_gradients("lfm2-moe-tiny");
}

#[test]
fn fused_expert_layout_loads_to_the_same_model() {
    // Rewrite the per-expert checkpoint in the fused layout transformers uses in memory.
    let dir = tempfile::tempdir().unwrap();
    common::copy_dir(&fixture_dir("lfm2-moe-tiny"), dir.path());
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: BTreeMap<String, (Vec<u8>, Vec<usize>)> = BTreeMap::new();
    let mut fused: BTreeMap<String, BTreeMap<usize, BTreeMap<String, Vec<f32>>>> = BTreeMap::new();
    let (ff, hidden) = (32, 64);
    for (key, view) in st.tensors() {
        if let Some(pos) = key.find(".experts.") {
            let prefix = key[..pos].to_string();
            let rest: Vec<&str> = key[pos + 9..].split('.').collect();
            fused
                .entry(prefix)
                .or_default()
                .entry(rest[0].parse().unwrap())
                .or_default()
                .insert(rest[1].to_string(), read_f32(&view));
        } else {
            out.insert(key, (view.data().to_vec(), view.shape().to_vec()));
        }
    }
    for (prefix, experts) in fused {
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for (_, w) in experts.iter() {
            gate_up.extend(&w["w1"]);
            gate_up.extend(&w["w3"]);
            down.extend(&w["w2"]);
        }
        let e = experts.len();
        let to_bytes = |v: Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        out.insert(format!("{prefix}.experts.gate_up_proj"), (to_bytes(gate_up), vec![e, 2 * ff, hidden]));
        out.insert(format!("{prefix}.experts.down_proj"), (to_bytes(down), vec![e, hidden, ff]));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = out
        .iter()
        .map(|(k, (b, s))| {
            (k.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();

    let device = Default::default();
    let (_, fused_model) = load_lfm2::<Cpu>(dir.path(), &device).unwrap();
    let (_, per_expert) = load_lfm2::<Cpu>(&fixture_dir("lfm2-moe-tiny"), &device).unwrap();
    let f = fixture("lfm2-moe-tiny");
    let layout = SequenceLayout::single(2, 12);
    assert_eq!(logits_of(&fused_model, &f.ids.0, [2, 12], &layout), logits_of(&per_expert, &f.ids.0, [2, 12], &layout));
}

#[test]
fn export_then_reload_is_bit_identical() {
    for name in ["lfm2-tiny", "lfm2-moe-tiny"] {
        let device = Default::default();
        let src = fixture_dir(name);
        let (_, model) = load_lfm2::<Cpu>(&src, &device).unwrap();
        let out = tempfile::tempdir().unwrap();
        let tensors = hf_tensors(&model);
        // Tiny shards force the sharded layout with its index.
        let files =
            export_dir(&tensors, &Default::default(), &src, out.path(), ExportDtype::F32, &|_| false, 200_000).unwrap();
        assert!(out.path().join("model.safetensors.index.json").is_file() && files.len() > 2, "{files:?}");
        assert!(out.path().join("config.json").is_file());
        // Same key set as the source checkpoint, same bytes after a reload.
        let src_bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let src_keys: std::collections::BTreeSet<String> =
            SafeTensors::deserialize(&src_bytes).unwrap().names().into_iter().map(str::to_string).collect();
        assert_eq!(tensors.keys().cloned().collect::<std::collections::BTreeSet<_>>(), src_keys, "{name}");
        let (_, again) = load_lfm2::<Cpu>(out.path(), &device).unwrap();
        let again_tensors = hf_tensors(&again);
        for (k, t) in &tensors {
            assert_eq!(t.data, again_tensors[k].data, "{name}: {k}");
        }

        // Exported again into the same folder, one file and then shards: only the new layout's files stay.
        let weight_files = || {
            let mut names: Vec<String> = std::fs::read_dir(out.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("model"))
                .collect();
            names.sort();
            names
        };
        export_dir(&tensors, &Default::default(), &src, out.path(), ExportDtype::Bf16, &|_| false, usize::MAX).unwrap();
        assert_eq!(weight_files(), ["model.safetensors"], "{name}");
        let files =
            export_dir(&tensors, &Default::default(), &src, out.path(), ExportDtype::F32, &|_| false, 200_000).unwrap();
        let mut written: Vec<String> =
            files.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        written.sort();
        assert_eq!(weight_files(), written, "{name}");
        let (_, again) = load_lfm2::<Cpu>(out.path(), &device).unwrap();
        assert_eq!(hf_tensors(&again)[tensors.keys().next().unwrap()].data, tensors.values().next().unwrap().data);
    }
}

#[test]
fn broken_checkpoints_fail_with_what_and_where() {
    let device = burn::backend::flex::FlexDevice;
    let dir = tempfile::tempdir().unwrap();
    common::copy_dir(&fixture_dir("lfm2-tiny"), dir.path());
    let weights = dir.path().join("model.safetensors");
    let full = std::fs::read(&weights).unwrap();

    std::fs::write(&weights, &full[..full.len() / 2]).unwrap();
    let err = load_lfm2::<Cpu>(dir.path(), &device).unwrap_err().to_string();
    assert!(err.contains("model.safetensors") && err.contains("not a readable safetensors file"), "{err}");

    // Wrong shapes and missing keys are listed together.
    let st = SafeTensors::deserialize(&full).unwrap();
    let mut kept: Vec<(String, safetensors::tensor::TensorView)> =
        st.tensors().into_iter().filter(|(k, _)| !k.ends_with("layers.1.self_attn.q_proj.weight")).collect();
    let bad = vec![0u8; 4 * 10];
    kept.retain(|(k, _)| k != "model.embedding_norm.weight");
    kept.push((
        "model.embedding_norm.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![10], &bad).unwrap(),
    ));
    kept.push((
        "model.layers.9.extra.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![10], &bad).unwrap(),
    ));
    safetensors::serialize_to_file(kept, None, &weights).unwrap();
    let err = load_lfm2::<Cpu>(dir.path(), &device).unwrap_err().to_string();
    assert!(err.contains("missing keys (1): model.layers.1.self_attn.q_proj.weight"), "{err}");
    assert!(err.contains("unexpected keys (1): model.layers.9.extra.weight"), "{err}");
    assert!(err.contains("model.embedding_norm.weight: checkpoint [10], model expects [64]"), "{err}");

    // A sharded checkpoint whose shard is gone.
    let sharded = tempfile::tempdir().unwrap();
    let (_, model) = load_lfm2::<Cpu>(&fixture_dir("lfm2-tiny"), &device).unwrap();
    export_dir(
        &hf_tensors(&model),
        &Default::default(),
        &fixture_dir("lfm2-tiny"),
        sharded.path(),
        ExportDtype::F32,
        &|_| false,
        200_000,
    )
    .unwrap();
    std::fs::remove_file(sharded.path().join("model-00002-of-00005.safetensors")).ok();
    let err = load_lfm2::<Cpu>(sharded.path(), &device).unwrap_err().to_string();
    assert!(err.contains("model-0000") && err.contains("shard missing"), "{err}");

    // Unknown architecture.
    std::fs::write(dir.path().join("config.json"), r#"{"model_type": "mamba"}"#).unwrap();
    let err = load_lfm2::<Cpu>(dir.path(), &device).unwrap_err().to_string();
    assert!(err.contains("'mamba' is not supported") && err.contains("lfm2, lfm2_moe"), "{err}");
}

fn check_cached_decoding(name: &str) {
    use kiln::models::decode::{CachedDecoding, generate_greedy};
    let device = Default::default();
    let (_, model) = load_lfm2::<Cpu>(&fixture_dir(name), &device).unwrap();
    let f = fixture(name);
    let row: Vec<i64> = f.ids.0[..12].to_vec();
    let full = logits_of(&model, &row, [1, 12], &SequenceLayout::single(1, 12));
    let vocab = 256;
    // Prefill 5 tokens, then one token at a time: every step's logits equal the full forward's.
    let mut cache = model.new_cache(1, &device);
    let prefill = model.forward_cached(ids_tensor::<Cpu>(&row[..5], [1, 5], &device), &[vec![true; 5]], &mut cache);
    let got: Vec<f32> = prefill.into_data().convert::<f32>().to_vec().unwrap();
    assert!(max_abs_diff(&got, &full[..5 * vocab]) <= 1e-4, "{name}: prefill");
    for t in 5..12 {
        let step = model.forward_cached(ids_tensor::<Cpu>(&row[t..=t], [1, 1], &device), &[vec![true]], &mut cache);
        let got: Vec<f32> = step.into_data().convert::<f32>().to_vec().unwrap();
        let err = max_abs_diff(&got, &full[t * vocab..(t + 1) * vocab]);
        assert!(err <= 1e-4, "{name}: step {t} differs by {err}");
    }
    assert_eq!(cache.lengths(), [12]);
    parity::assert_turns_continue_kept_states(&model, &row, &full, &device);

    // Prompts of different lengths in one batch: each row's last logits equal that prompt alone.
    let prompts: Vec<Vec<u32>> =
        vec![row[..5].iter().map(|&x| x as u32).collect(), row[2..11].iter().map(|&x| x as u32).collect()];
    let mut cache = model.new_cache(2, &device);
    let mut ids = vec![0i64; 4];
    ids.extend(prompts[0].iter().map(|&x| x as i64));
    ids.extend(prompts[1].iter().map(|&x| x as i64));
    let valid = vec![[vec![false; 4], vec![true; 5]].concat(), vec![true; 9]];
    let batched: Vec<f32> = model
        .forward_cached(ids_tensor::<Cpu>(&ids, [2, 9], &device), &valid, &mut cache)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap();
    for (r, p) in prompts.iter().enumerate() {
        let alone_ids: Vec<i64> = p.iter().map(|&x| x as i64).collect();
        let alone = logits_of(&model, &alone_ids, [1, p.len()], &SequenceLayout::single(1, p.len()));
        let last_alone = &alone[(p.len() - 1) * vocab..];
        let last_batched = &batched[(r * 9 + 8) * vocab..(r * 9 + 9) * vocab];
        assert!(max_abs_diff(last_alone, last_batched) <= 1e-4, "{name}: row {r} of a padded batch differs");
    }
    // Greedy generation of the batch equals generating each prompt alone.
    let together = generate_greedy(&model, &prompts, 6, &[], &device);
    for (r, p) in prompts.iter().enumerate() {
        let alone = generate_greedy(&model, std::slice::from_ref(p), 6, &[], &device);
        assert_eq!(together[r], alone[0], "{name}: row {r}");
        assert_eq!(together[r].len(), 6);
    }
}

#[test]
fn lfm2_cached_decoding_equals_full_forward() {
    check_cached_decoding("lfm2-tiny");
}

#[test]
fn lfm2_moe_cached_decoding_equals_full_forward() {
    check_cached_decoding("lfm2-moe-tiny");
}
