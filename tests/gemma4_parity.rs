//! Gemma 4's text tower against transformers 5.23.0 on a tiny random-init Gemma4ForConditionalGeneration
//! (tests/fixtures/gemma4/make_fixtures.py): per-layer embeddings, sliding-window layers with a window of 5
//! over rows of 24 tokens, full-attention layers with wider heads and proportional RoPE, three layers that
//! reuse earlier layers' keys and values (with double-wide MLPs), layer scalars and the logit softcap. f32
//! logits within 1e-4 of the exact (f64) answer, a row packed with two documents equal to each run alone,
//! the gradients of a masked cross-entropy (the shared K/V weights' included) through the composition and
//! through the trainer's fused loss with the soft-cap, cached decoding equal to the full forward, and
//! export carrying the vision tower byte for byte (and transformers reloading it: export_check.json).

mod common;

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Flex};
use common::parity::{self, ids_tensor, values};
use kiln::models::config::Gemma4LayerKind;
use kiln::models::hf::ExportDtype;
use kiln::models::hf::{hf_gradients, hf_tensors};
use kiln::models::{CausalLm, Gemma4Config, Gemma4Model, ModelConfig, SequenceLayout, WeightStore, load_model};
use kiln::train::step::supervised_loss;

type Cpu = Flex<f32>;
type Train = Autodiff<Cpu>;

const NAME: &str = "gemma4-tiny";
const VOCAB: usize = 256;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4").join(NAME)
}

fn load<B: burn::tensor::backend::Backend>(dir: &Path) -> (Gemma4Config, Gemma4Model<B>) {
    match load_model::<B>(dir, &Default::default()).expect("the fixture loads") {
        (ModelConfig::Gemma4(c), CausalLm::Gemma4(m)) => (c, m),
        _ => panic!("the Gemma 4 fixture loaded as another architecture"),
    }
}

#[test]
fn config_and_weights_load_the_text_tower_only() {
    let (c, model) = load::<Cpu>(&fixture_dir());
    assert_eq!(c.text_prefix, "model.language_model.");
    let kinds: Vec<_> = c.layers.iter().map(|l| l.kind).collect();
    use Gemma4LayerKind::{FullAttention as F, SlidingAttention as S};
    assert_eq!(kinds, [S, S, F, S, S, F]);
    assert_eq!(c.layers.iter().map(|l| l.kv_source).collect::<Vec<_>>(), [None, None, None, Some(1), Some(1), Some(2)]);
    assert_eq!(c.layers.iter().map(|l| l.head_dim).collect::<Vec<_>>(), [16, 16, 32, 16, 16, 32]);
    assert_eq!(c.layers.iter().map(|l| l.intermediate_size).collect::<Vec<_>>(), [96, 96, 96, 192, 192, 192]);
    assert!(c.full_rope.proportional && !c.sliding_rope.proportional);
    assert_eq!((c.sliding_window, c.final_logit_softcapping), (5, Some(30.0)));
    // Every text tensor is a parameter, except the layer scalars (buffers); the vision tower stays put.
    let store = WeightStore::open(&fixture_dir()).unwrap();
    let names = hf_tensors(&model);
    let text: Vec<&String> = store.keys().filter(|k| !c.is_other_tower(k)).collect();
    assert!(store.keys().any(|k| k.starts_with("model.vision_tower.")));
    assert_eq!(names.len() + c.num_hidden_layers, text.len());
    assert!(text.iter().all(|k| names.contains_key(k.as_str()) || k.ends_with(".layer_scalar")));
    let scalars: Vec<f64> = model.layers.iter().map(|l| l.layer_scalar).collect();
    assert!(scalars.iter().all(|&s| s != 1.0), "the fixture's layer scalars are not all 1: {scalars:?}");
}

#[test]
fn logits_match_transformers() {
    // Two documents in one row: attention (windowed and full) restarts at the second, RoPE too.
    parity::assert_logits_match_transformers(NAME, &fixture_dir(), VOCAB, &[14, 10]);
}

#[test]
fn gradients_match_transformers() {
    parity::assert_gradients_match_transformers(NAME, &fixture_dir());
}

#[test]
fn cached_decoding_equals_full_forward() {
    let device = Default::default();
    let (_, model) = load::<Cpu>(&fixture_dir());
    let f = parity::fixture(&fixture_dir());
    let row: Vec<i64> = f.ids.0[..f.shape()[1]].to_vec();
    let n = row.len();
    let full = values(model.forward(ids_tensor::<Cpu>(&row, [1, n], &device), &SequenceLayout::single(1, n)));
    // Prefill 7 tokens (past the window of 5), then one at a time: the sliding layers' window moves along
    // the cache, and the KV-sharing layers read their sources' caches.
    parity::assert_cached_decoding_follows(&model, &row, 7, &full, 1e-4, &device);

    // Left-padded prompts of different lengths, both longer than the window (padding is never inside one).
    parity::assert_padded_batches_follow(&model, &row, |ids, layout| model.forward(ids, layout), &device);
}

/// The trainer's loss (`supervised_loss`: the fused projection and cross-entropy with the soft-cap inside,
/// next-token targets, weights from the mask) gives transformers' loss and gradients.
#[test]
fn the_trainers_fused_loss_matches_transformers() {
    let f = parity::fixture(&fixture_dir());
    let device = Default::default();
    let (_, model) = load_model::<Train>(&fixture_dir(), &device).unwrap();
    let [b, s] = f.shape();
    // Position t of row r predicts token t + 1, weighted by its mask; the last position predicts nothing.
    let (mut targets, mut weights) = (vec![0i64; b * s], vec![0f32; b * s]);
    for at in (0..b * s).filter(|at| at % s + 1 < s) {
        (targets[at], weights[at]) = (f.ids.0[at + 1], f.mask[at + 1] as f32);
    }
    let count: f32 = weights.iter().sum();
    let hidden = model.forward_hidden(ids_tensor::<Train>(&f.ids.0, [b, s], &device), &SequenceLayout::single(b, s));
    assert_eq!(model.logit_softcap(), Some(30.0));
    let loss = supervised_loss(hidden, model.head_weight(), model.logit_softcap(), &targets, &weights, count)
        .expect("supervised targets");
    let value = values(loss.clone())[0];
    assert!((value - f.loss).abs() <= 1e-4, "loss {value} vs {}", f.loss);
    parity::check_gradients(NAME, &f, &hf_gradients(&model, &loss.backward()), 1e-4);
}

#[test]
fn export_carries_the_other_towers_and_reloads() {
    let device = Default::default();
    let (_, model) = load_model::<Cpu>(&fixture_dir(), &device).unwrap();
    let source = WeightStore::open(&fixture_dir()).unwrap();
    for dtype in [ExportDtype::F32, ExportDtype::Bf16] {
        let out = tempfile::tempdir().unwrap();
        model.export(&fixture_dir(), out.path(), dtype, kiln::models::hf::SHARD_BYTES).unwrap();
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
            // Parameters and layer scalars come back exactly.
            let (_, again) = load_model::<Cpu>(out.path(), &device).unwrap();
            let (a, b) = (hf_tensors(&model), hf_tensors(&again));
            assert!(a.iter().all(|(k, t)| b[k].data == t.data), "f32 export → reload is exact");
            assert_eq!(model.buffers().len(), 6);
            assert!(model.buffers().iter().all(|(k, t)| again.buffers()[k].data == t.data));
        }
    }
    // transformers reloaded kiln's exports (make_fixtures.py, committed).
    let text = std::fs::read_to_string(fixture_dir().parent().unwrap().join("export_check.json")).unwrap();
    let check: serde_json::Value = serde_json::from_str(&text).unwrap();
    for dtype in ["f32", "bf16"] {
        let r = &check["results"][format!("{NAME}/{dtype}")];
        assert_eq!(r["architecture"], "Gemma4ForConditionalGeneration", "{dtype}");
        assert!(r["max_abs_logits_error"].as_f64().unwrap() <= 1e-5, "{dtype}: {r}");
        assert_eq!(r["carried_identical"].as_bool(), Some(true), "{dtype}");
    }
}
