//! The trainer on the CPU: three steps equal PyTorch's AdamW run on the same tiny LFM2 and batch, the loss is
//! normalized over the whole optimizer step (micro-batching changes nothing), a stopped and resumed run
//! equals the uninterrupted one bit for bit, epoch checkpoints reload to the in-memory model's logits, a
//! batch can be overfit, and a non-finite loss stops the run naming where.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use burn::tensor::{Int, Tensor, TensorData};
use kiln::backend::{Cpu, CpuTrain};
use kiln::models::hf::{ExportDtype, hf_tensors};
use kiln::models::{SequenceLayout, load_lfm2};
use kiln::tokens::TokenSample;
use kiln::tokens::shards::{Layout, ShardWriter};
use kiln::train::schedule::Decay;
use kiln::train::{TrainConfig, train};
use safetensors::SafeTensors;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lfm2")
}

fn f32s(v: &safetensors::tensor::TensorView) -> Vec<f32> {
    v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The fixture batch (2 rows × 12 tokens, its loss mask) written as a shard.
fn fixture_shards(dir: &Path, copies: usize) -> PathBuf {
    let bytes = std::fs::read(fixture_dir().join("lfm2-tiny/fixture.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let i64s = |k: &str| -> Vec<u32> {
        st.tensor(k).unwrap().data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
    };
    let (ids, mask) = (i64s("input_ids"), i64s("loss_mask"));
    let out = dir.join("data");
    let mut w = ShardWriter::new(&out, Layout::Packed, 12, 0).unwrap();
    for c in 0..copies {
        for r in 0..2 {
            let sample = TokenSample {
                id: format!("row{r}-{c}"),
                input_ids: ids[r * 12..(r + 1) * 12].to_vec(),
                loss_mask: mask[r * 12..(r + 1) * 12].iter().map(|&m| m as u8).collect(),
            };
            w.add(&sample, "fixture").unwrap();
        }
    }
    w.finish().unwrap();
    out
}

fn parity_config() -> TrainConfig {
    TrainConfig {
        epochs: 3,
        lr: 1e-3,
        min_lr_ratio: 0.0,
        warmup_ratio: 0.0,
        warmup_steps: Some(0),
        decay: Decay::Constant,
        global_batch: 2,
        micro_batch: 1,
        max_grad_norm: Some(1.0),
        seed: 7,
        save_every: None,
        export_dtype: ExportDtype::F32,
        ..TrainConfig::default()
    }
}

fn run(
    cfg: &TrainConfig,
    data: &Path,
    run_dir: &Path,
    resume: bool,
    halt: Option<usize>,
) -> (kiln::train::TrainSummary, kiln::models::CausalLm<CpuTrain>) {
    let device = Default::default();
    train::<CpuTrain>(
        cfg,
        &fixture_dir().join("lfm2-tiny"),
        data,
        run_dir,
        resume,
        &AtomicBool::new(false),
        halt,
        false,
        &device,
    )
    .unwrap()
}

fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("train/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn three_steps_match_pytorch_adamw() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixture_shards(dir.path(), 1);
    let (summary, model) = run(&parity_config(), &data, &dir.path().join("run"), false, None);
    assert_eq!(summary.steps, 3);
    let bytes = std::fs::read(fixture_dir().join("train_fixture.safetensors")).unwrap();
    let want = SafeTensors::deserialize(&bytes).unwrap();
    let losses = f32s(&want.tensor("losses").unwrap());
    let norms = f32s(&want.tensor("grad_norms").unwrap());
    for (m, (l, n)) in metrics(&dir.path().join("run")).iter().zip(losses.iter().zip(&norms)) {
        let (got_l, got_n) = (m["loss"].as_f64().unwrap() as f32, m["grad_norm"].as_f64().unwrap() as f32);
        assert!(((got_l - l) / l).abs() <= 1e-4, "loss {got_l} vs torch {l}");
        assert!(((got_n - n) / n).abs() <= 1e-4, "grad norm {got_n} vs torch {n}");
    }
    let ours = hf_tensors(&model);
    for (name, view) in want.tensors() {
        let Some(key) = name.strip_prefix("param.") else { continue };
        let want = f32s(&view);
        let got = &ours[key].data;
        let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max) / scale;
        assert!(err <= 1e-4, "{key}: {err} relative after 3 steps");
    }
}

#[test]
fn micro_batching_does_not_change_the_update() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixture_shards(dir.path(), 2);
    let cfg = TrainConfig { epochs: 1, global_batch: 4, micro_batch: 4, ..parity_config() };
    let (_, whole) = run(&cfg, &data, &dir.path().join("whole"), false, None);
    let (_, split) = run(&TrainConfig { micro_batch: 1, ..cfg.clone() }, &data, &dir.path().join("split"), false, None);
    let (a, b) = (hf_tensors(&whole), hf_tensors(&split));
    for (k, t) in &a {
        let err = t.data.iter().zip(&b[k].data).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(err <= 1e-6, "{k}: {err}");
    }
    let (m1, m2) = (metrics(&dir.path().join("whole")), metrics(&dir.path().join("split")));
    assert!((m1[0]["loss"].as_f64().unwrap() - m2[0]["loss"].as_f64().unwrap()).abs() < 1e-5);
}

#[test]
fn a_resumed_run_equals_the_uninterrupted_one_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixture_shards(dir.path(), 3);
    let cfg = TrainConfig { epochs: 2, warmup_steps: Some(2), decay: Decay::Cosine, ..parity_config() };
    let (straight, _) = run(&cfg, &data, &dir.path().join("straight"), false, None);
    let (stopped, _) = run(&cfg, &data, &dir.path().join("resumed"), false, Some(4));
    assert!(stopped.interrupted && stopped.steps == 4);
    let (resumed, _) = run(&cfg, &data, &dir.path().join("resumed"), true, None);
    assert_eq!(resumed.steps, straight.steps);
    for epoch in ["epoch-1", "epoch-2"] {
        let a = std::fs::read(dir.path().join("straight/checkpoints").join(epoch).join("model.safetensors")).unwrap();
        let b = std::fs::read(dir.path().join("resumed/checkpoints").join(epoch).join("model.safetensors")).unwrap();
        assert!(a == b, "{epoch} differs after resume");
    }
    let losses = |d: &str| metrics(&dir.path().join(d)).iter().map(|m| m["loss"].as_f64().unwrap()).collect::<Vec<_>>();
    assert_eq!(losses("straight"), losses("resumed"));
}

#[test]
fn epoch_checkpoints_reload_to_the_trained_model_and_a_batch_overfits() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixture_shards(dir.path(), 1);
    let cfg = TrainConfig { epochs: 60, lr: 1e-2, max_grad_norm: None, ..parity_config() };
    let (summary, model) = run(&cfg, &data, &dir.path().join("run"), false, None);
    let losses: Vec<f64> = metrics(&dir.path().join("run")).iter().map(|m| m["loss"].as_f64().unwrap()).collect();
    assert!(losses[0] > 4.0 && *losses.last().unwrap() < 0.05, "first {} last {}", losses[0], losses.last().unwrap());
    let last = summary.checkpoints.last().unwrap();
    let device = Default::default();
    let (_, reloaded) = kiln::models::load_model::<Cpu>(last, &device).unwrap();
    let ids: Vec<i64> = (0..12).map(|i| (i * 7 % 256) as i64).collect();
    let logits = |m: &kiln::models::CausalLm<Cpu>| -> Vec<f32> {
        m.forward(
            Tensor::<Cpu, 2, Int>::from_data(TensorData::new(ids.clone(), [1, 12]), &device),
            &SequenceLayout::single(1, 12),
        )
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap()
    };
    use burn::module::AutodiffModule;
    assert_eq!(logits(&model.valid()), logits(&reloaded));
}

#[test]
fn a_non_finite_loss_stops_the_run_and_names_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixture_shards(dir.path(), 1);
    let cfg = TrainConfig { epochs: 3, lr: 1e30, max_grad_norm: None, ..parity_config() };
    let device = Default::default();
    let err = train::<CpuTrain>(
        &cfg,
        &fixture_dir().join("lfm2-tiny"),
        &data,
        &dir.path().join("run"),
        false,
        &AtomicBool::new(false),
        None,
        false,
        &device,
    )
    .expect_err("the run must stop")
    .to_string();
    assert!(err.contains("non-finite loss") && err.contains("at step 2") && err.contains("samples row"), "{err}");
    // The blown-up step exported nothing; the state on disk is the last good one (after epoch 2).
    assert!(!dir.path().join("run/checkpoints/epoch-3").exists());
    let position: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("run/train/state/position.json")).unwrap())
            .unwrap();
    assert_eq!(position["epoch"], 2);
}

#[test]
fn kiln_train_lowers_the_loss_on_the_synthetic_sample() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let root = common::project_dir();
    let kiln = |args: &[&str]| {
        let (ok, _, stderr) = common::run_kiln(args, &[], &root);
        assert!(ok, "{args:?}: {stderr}");
        stderr
    };
    let data = p.join("data");
    kiln(&["--quiet", "ingest", "--dataset", "terminal-synth", "--out", data.to_str().unwrap()]);
    let some: String = std::fs::read_to_string(data.join("conversations.jsonl"))
        .unwrap()
        .lines()
        .take(24)
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(p.join("conv.jsonl"), some).unwrap();
    let shards = p.join("shards");
    kiln(&[
        "--quiet",
        "prepare",
        "--model",
        "tiny",
        "--data",
        p.join("conv.jsonl").to_str().unwrap(),
        "--out",
        shards.to_str().unwrap(),
        "--seq-len",
        "512",
        "--date",
        "2026-01-01",
    ]);
    let base = p.join("base");
    kiln(&["init-model", "--from", "configs/models/tiny", "--out", base.to_str().unwrap()]);
    let config = p.join("train.toml");
    std::fs::write(&config, "[train]\nepochs = 1\nlr = 3e-3\nglobal_batch = 4\nmicro_batch = 2\nwarmup_ratio = 0.0\nexport_dtype = \"f32\"\n").unwrap();
    let run_dir = p.join("run");
    let stderr = kiln(&[
        "--quiet",
        "train",
        "--model-dir",
        base.to_str().unwrap(),
        "--data",
        shards.to_str().unwrap(),
        "--run",
        run_dir.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ]);
    assert!(stderr.contains("checkpoints:") && stderr.contains("epoch-1"), "{stderr}");
    let m = metrics(&run_dir);
    assert!(m.len() >= 4, "{} steps", m.len());
    let first = m[0]["loss"].as_f64().unwrap();
    let last = m.last().unwrap()["loss"].as_f64().unwrap();
    assert!(last < first - 0.5, "loss {first} → {last}");
    assert_eq!(m[0]["lr"].as_f64().unwrap(), 3e-3);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("train/summary.json")).unwrap()).unwrap();
    assert_eq!(summary["epochs_done"], 1);
    // The exported epoch is a checkpoint the model tools load.
    kiln(&[
        "generate",
        "--model-dir",
        run_dir.join("checkpoints/epoch-1").to_str().unwrap(),
        "--prompt",
        "ls",
        "--max-tokens",
        "3",
    ]);
}

#[test]
fn activation_checkpointing_gives_the_same_training() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixture_shards(dir.path(), 1);
    let cfg = TrainConfig { epochs: 2, ..parity_config() };
    let device = Default::default();
    let (_, plain) = run(&cfg, &data, &dir.path().join("plain"), false, None);
    let (_, recomputed) = train::<kiln::backend::CpuTrainCheckpointed>(
        &cfg,
        &fixture_dir().join("lfm2-tiny"),
        &data,
        &dir.path().join("ckpt"),
        false,
        &AtomicBool::new(false),
        None,
        false,
        &device,
    )
    .unwrap();
    let (a, b) = (hf_tensors(&plain), hf_tensors(&recomputed));
    for (k, t) in &a {
        let err = t.data.iter().zip(&b[k].data).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(err <= 1e-6, "{k}: {err}");
    }
}

/// The loss on supervised positions only equals the full-logits loss, in value and in every gradient.
#[test]
fn supervised_only_logits_give_the_full_logits_loss_and_gradients() {
    use kiln::train::trainer::{masked_loss, supervised_loss};
    let device = Default::default();
    let (_, model) = load_lfm2::<CpuTrain>(&fixture_dir().join("lfm2-tiny"), &device).unwrap();
    let (b, s) = (2, 12);
    let ids: Vec<i64> = (0..b * s).map(|i| (i * 37 % 251) as i64).collect();
    let targets: Vec<i64> = ids.iter().skip(1).copied().chain([0]).collect();
    let weights: Vec<f32> = (0..b * s).map(|i| if i % 3 == 1 || i == 20 { 1.0 } else { 0.0 }).collect();
    let layout = SequenceLayout::from_doc_lengths(&[vec![7, 5], vec![12]], s);
    let input = || Tensor::<CpuTrain, 2, Int>::from_data(TensorData::new(ids.clone(), [b, s]), &device);
    let full = masked_loss(model.forward(input(), &layout), &targets, &weights, 9.0);
    let picked = supervised_loss(model.forward_hidden(input(), &layout), model.head_weight(), &targets, &weights, 9.0)
        .expect("something is supervised");
    let value = |t: &Tensor<CpuTrain, 1>| t.clone().into_data().convert::<f32>().to_vec::<f32>().unwrap()[0];
    let (a, p) = (value(&full), value(&picked));
    assert!((a - p).abs() <= 1e-6 * a.abs(), "full {a} vs supervised-only {p}");
    let ga = kiln::models::hf::hf_gradients(&model, &full.backward());
    let gp = kiln::models::hf::hf_gradients(&model, &picked.backward());
    assert_eq!(ga.keys().collect::<Vec<_>>(), gp.keys().collect::<Vec<_>>());
    let mut compared = 0;
    for (key, x) in &ga {
        let y = &gp[key];
        assert_eq!(x.shape, y.shape, "{key}");
        for (u, v) in x.data.iter().zip(&y.data) {
            assert!((u - v).abs() <= 1e-5 * (1.0 + u.abs()), "{key}: {u} vs {v}");
        }
        compared += 1;
    }
    assert!(compared > 10, "gradients compared for {compared} parameters");
    assert!(
        supervised_loss(model.forward_hidden(input(), &layout), model.head_weight(), &targets, &[0.0; 24], 1.0)
            .is_none()
    );
}
