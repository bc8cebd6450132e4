//! Qwen3.5 against transformers 5.23.0 on a tiny random-init Qwen3_5ForConditionalGeneration
//! (tests/fixtures/qwen3_5/make_fixtures.py; rows of 70 tokens, so the DeltaNet scan spans two chunks):
//! f32 logits within 1e-4, a row packed with two documents (one crossing a chunk boundary) equal to each
//! document run alone, gradients of a masked cross-entropy, cached decoding equal to the full forward,
//! export carrying the vision tower and mtp tensors byte for byte (and transformers reloading it:
//! export_check.json), and the chunked scan's gradients equal to the recurrent reference's.

mod common;

use std::path::PathBuf;

use burn::backend::{Autodiff, Flex};
use burn::tensor::Distribution;
use burn::tensor::Tensor;
use common::parity::{self, max_abs_diff, values};
use kiln::models::deltanet::{self, ChunkPlan, DocSegments, ScanInputs};
use kiln::models::hf::{ExportDtype, hf_tensors};
use kiln::models::weights::kept_in_f32;
use kiln::models::{CausalLm, ModelBackend, ModelConfig, Qwen35Model, WeightStore, load_model};

type Cpu = Flex<f32>;
type Train = Autodiff<Cpu>;

const NAME: &str = "qwen3_5-tiny";
const VOCAB: usize = 256;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_5").join(NAME)
}

fn qwen<B: burn::tensor::backend::Backend>(model: CausalLm<B>) -> Qwen35Model<B> {
    match model {
        CausalLm::Qwen35(m) => m,
        CausalLm::Lfm2(_) | CausalLm::Gemma4(_) => panic!("loaded as another architecture"),
    }
}

#[test]
fn config_and_weights_load_the_text_tower_only() {
    let (config, model) = load_model::<Cpu>(&fixture_dir(), &Default::default()).unwrap();
    let ModelConfig::Qwen35(c) = &config else { panic!("not qwen3_5") };
    assert_eq!((c.rotary_dim, c.linear_num_value_heads, c.text_prefix.as_str()), (8, 4, "model.language_model."));
    // The checkpoint's vision tower and mtp tensor are neither loaded nor unexpected.
    let store = WeightStore::open(&fixture_dir()).unwrap();
    let carried: Vec<&String> = store.keys().filter(|k| model.is_carried(k)).collect();
    assert!(
        carried.iter().any(|k| k.starts_with("model.visual.")) && carried.iter().any(|k| k.as_str() == "mtp.fc.weight")
    );
    let names = hf_tensors(&model);
    assert!(names.keys().all(|k| k.starts_with("model.language_model.")), "tied: no lm_head");
    assert_eq!(names.len() + carried.len(), store.keys().count());
}

#[test]
fn logits_match_transformers() {
    // transformers' f32 run is itself ~1e-4 from the exact (f64) logits at this depth of decays. Two
    // documents in one row: conv history, DeltaNet state and attention all restart at the second.
    parity::assert_logits_match_transformers(NAME, &fixture_dir(), VOCAB, &[40, 30]);
}

#[test]
fn gradients_match_transformers() {
    parity::assert_gradients_match_transformers(NAME, &fixture_dir());
}

#[test]
fn cached_decoding_equals_full_forward() {
    let (_, model) = load_model::<Cpu>(&fixture_dir(), &Default::default()).unwrap();
    let model = qwen(model);
    // Prefill 66 tokens (a chunk and a bit), then one token at a time through the recurrent form.
    parity::assert_decoding_follows_the_forward(&model, |ids, layout| model.forward(ids, layout), &fixture_dir(), 66);
}

#[test]
fn export_carries_the_other_towers_and_reloads() {
    let architecture = "Qwen3_5ForConditionalGeneration";
    let flags = ["carried_identical", "fp32_kept"];
    parity::assert_export_carries_the_other_towers(NAME, &fixture_dir(), architecture, &flags, |dtype, model, out| {
        // A bf16 export keeps what the checkpoint stores in fp32 (`A_log`, the DeltaNet norm) and the towers
        // kiln does not train in their own dtypes.
        let (source, exported) = (WeightStore::open(&fixture_dir()).unwrap(), WeightStore::open(out).unwrap());
        for key in exported.keys() {
            let want = if kept_in_f32(key) || model.is_carried(key) || dtype == ExportDtype::F32 {
                source.dtype(key).unwrap()
            } else {
                safetensors::Dtype::BF16
            };
            assert_eq!(exported.dtype(key), Some(want), "{dtype:?}: {key}");
        }
        assert!(out.join("config.json").is_file());
    });
}

#[test]
fn chunked_scan_gradients_equal_the_recurrent_reference() {
    // Two rows, three documents in the second, 70 tokens: chunk boundaries, resets and the padded tail.
    let device = Default::default();
    let (batch, heads, seq, dk, dv) = (2, 2, 70, 8, 6);
    let normal = |shape: [usize; 4]| Tensor::<Cpu, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
    let uniform = |shape: [usize; 3]| Tensor::<Cpu, 3>::random(shape, Distribution::Uniform(0.0, 1.0), &device);
    let raw = (normal([batch, heads, seq, dk]), normal([batch, heads, seq, dk]), normal([batch, heads, seq, dv]));
    let (g, beta) = (uniform([batch, heads, seq]).neg() * 0.3, uniform([batch, heads, seq]));
    let mut docs = vec![0u32; seq];
    docs.extend((0..seq).map(|t| {
        if t < 30 {
            0
        } else if t < 50 {
            1
        } else {
            2
        }
    }));
    let segments = DocSegments::from_doc_ids(batch, seq, docs);
    let plan = ChunkPlan::<Train>::new(&segments, 64, &device);
    let weights = normal([batch, heads, seq, dv]);
    // The scan op (hand-written backward), burn's composition of the chunked form, the recurrent reference.
    let run = |form: &str| {
        let leaf = |t: Tensor<Cpu, 4>| Tensor::<Train, 4>::from_inner(t).require_grad();
        let (q, k, v) = (leaf(raw.0.clone()), leaf(raw.1.clone()), leaf(raw.2.clone()));
        let g = Tensor::<Train, 3>::from_inner(g.clone()).require_grad();
        let beta = Tensor::<Train, 3>::from_inner(beta.clone()).require_grad();
        let l2 = |x: Tensor<Train, 4>| kiln::models::layers::l2_normalize(x, 1e-6);
        let inputs = ScanInputs {
            q: l2(q.clone()) * (1.0 / (dk as f64).sqrt()),
            k: l2(k.clone()),
            v: v.clone(),
            g: g.clone(),
            beta: beta.clone(),
        };
        let out = match form {
            "op" => <Train as ModelBackend>::gated_delta_rule(inputs, &plan),
            "chunked" => deltanet::chunked(inputs, &plan, None).0,
            _ => deltanet::recurrent(inputs, &segments, None).0,
        };
        let loss = (out * Tensor::<Train, 4>::from_inner(weights.clone())).sum();
        let grads = loss.backward();
        let grad4 = |t: &Tensor<Train, 4>| values(t.grad(&grads).unwrap());
        let grad3 = |t: &Tensor<Train, 3>| values(t.grad(&grads).unwrap());
        [grad4(&q), grad4(&k), grad4(&v), grad3(&g), grad3(&beta)]
    };
    let recurrent = run("recurrent");
    for form in ["op", "chunked"] {
        let grads = run(form);
        for (name, (a, b)) in ["q", "k", "v", "g", "beta"].iter().zip(grads.iter().zip(&recurrent)) {
            let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let err = max_abs_diff(a, b) / scale;
            assert!(err <= 1e-4, "gradient of {name}: {form} and recurrent differ by {err} (relative)");
        }
    }
}
