//! Gemma 4's text tower against transformers 5.23.0 on a tiny random-init Gemma4ForConditionalGeneration
//! (tests/fixtures/gemma4/make_fixtures.py): per-layer embeddings, sliding-window layers with a window of 5
//! over rows of 24 tokens, full-attention layers with wider heads and proportional RoPE, three layers that
//! reuse earlier layers' keys and values (with double-wide MLPs), layer scalars and the logit softcap. f32
//! logits within 1e-4 of the exact (f64) answer, a row packed with two documents equal to each run alone,
//! and the gradients of a masked cross-entropy, the shared K/V weights' included.

mod common;

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Flex};
use common::parity::{self, ids_tensor, masked_ce, max_abs_diff, values};
use kiln::models::config::Gemma4LayerKind;
use kiln::models::hf::{hf_gradients, hf_tensors};
use kiln::models::{Gemma4Config, Gemma4Model, SequenceLayout, WeightStore};

type Cpu = Flex<f32>;
type Train = Autodiff<Cpu>;

const NAME: &str = "gemma4-tiny";
const VOCAB: usize = 256;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4").join(NAME)
}

fn load<B: burn::tensor::backend::Backend>(dir: &Path) -> (Gemma4Config, Gemma4Model<B>) {
    let config = Gemma4Config::from_file(&dir.join("config.json")).expect("the fixture's config");
    let store = WeightStore::open(dir).expect("the fixture's weights");
    let model = Gemma4Model::from_source(&config, &store, &Default::default()).expect("the text tower loads");
    (config, model)
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
    let f = parity::fixture(&fixture_dir());
    let device = Default::default();
    let (_, model) = load::<Cpu>(&fixture_dir());
    let shape = f.shape();
    assert_eq!(f.logits.1, [shape[0], shape[1], VOCAB]);
    let got =
        values(model.forward(ids_tensor::<Cpu>(&f.ids.0, shape, &device), &SequenceLayout::single(shape[0], shape[1])));
    let exact = parity::tensor_f32(&fixture_dir(), "logits_f64");
    let (err, err_exact, reference_err) =
        (max_abs_diff(&got, &f.logits.0), max_abs_diff(&got, &exact), max_abs_diff(&f.logits.0, &exact));
    let peak = f.logits.0.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    eprintln!(
        "{NAME}: logits max-abs error {err:.2e} vs transformers f32, {err_exact:.2e} vs exact (transformers f32: \
         {reference_err:.2e}); logits up to {peak:.2}"
    );
    assert!(err_exact <= 1e-4, "logits max-abs error {err_exact} from the exact answer");
    assert!(err <= 1e-4 + reference_err, "logits max-abs error {err} from transformers");

    // Two documents in one row: attention (windowed and full) restarts at the second, RoPE too.
    let seq = shape[1];
    let packed = SequenceLayout::from_doc_lengths(&[vec![14, 10]], seq);
    let got = values(model.forward(ids_tensor::<Cpu>(&f.packed_ids, [1, seq], &device), &packed));
    let err = max_abs_diff(&got, &f.packed_logits);
    assert!(err <= 1e-4, "packed documents leak into each other (max-abs {err})");
}

#[test]
fn gradients_match_transformers() {
    let f = parity::fixture(&fixture_dir());
    let device = Default::default();
    let (_, model) = load::<Train>(&fixture_dir());
    let shape = f.shape();
    let logits =
        model.forward(ids_tensor::<Train>(&f.ids.0, shape, &device), &SequenceLayout::single(shape[0], shape[1]));
    let loss = masked_ce(logits, &f.ids.0, &f.mask, shape);
    let value = values(loss.clone())[0];
    assert!((value - f.loss).abs() <= 1e-4, "loss {value} vs {}", f.loss);
    let grads = loss.backward();
    parity::check_gradients(NAME, &f, &hf_gradients(&model, &grads), 1e-4);
}
