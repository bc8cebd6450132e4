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
    let (_, model) = load::<Cpu>(&fixture_dir());
    // Prefill 7 tokens (past the window of 5), then one at a time: the sliding layers' window moves along
    // the cache, and the KV-sharing layers read their sources' caches. The padded prompts are both longer
    // than the window (padding is never inside one).
    parity::assert_decoding_follows_the_forward(&model, |ids, layout| model.forward(ids, layout), &fixture_dir(), 7);
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
    let architecture = "Gemma4ForConditionalGeneration";
    parity::assert_export_carries_the_other_towers(
        NAME,
        &fixture_dir(),
        architecture,
        &["carried_identical"],
        |dtype, model, out| {
            if dtype == ExportDtype::F32 {
                // The layer scalars (buffers) come back exactly too.
                let (_, again) = load::<Cpu>(out);
                assert_eq!(model.buffers().len(), 6);
                assert!(model.buffers().iter().all(|(k, t)| again.buffers()[k].data == t.data));
            }
        },
    );
}
