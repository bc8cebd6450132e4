//! The trainer's fixture run, shared by the CPU trainer tests and the fused-backend tests: the LFM2 parity
//! batch as a shard, the settings of the PyTorch run in tests/fixtures/lfm2/make_fixtures.py (`train_fixture`),
//! and the checks that a backend trains to PyTorch's losses and parameters and resumes bit for bit; and the
//! tiny shapes' benchmark steps on the vulkan device against the CPU's.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use kiln::backend::DeviceMemory;
use kiln::models::CausalLm;
use kiln::models::hf::{ExportDtype, hf_tensors};
use kiln::tokens::TokenSample;
use kiln::tokens::shards::{Layout, ShardWriter};
use kiln::train::bench::{BenchConfig, bench_on_device};
use kiln::train::linear_ce::LinearCrossEntropy;
use kiln::train::schedule::Decay;
use kiln::train::tensorboard::{Event, EventBody, encode_event, record};
use kiln::train::{Precision, TrainConfig, TrainSummary, train};
use safetensors::SafeTensors;

pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lfm2")
}

pub fn f32s(v: &safetensors::tensor::TensorView) -> Vec<f32> {
    v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The fixture batch (2 rows × 12 tokens, its loss mask) written as a shard, `copies` times.
pub fn fixture_shards(dir: &Path, copies: usize) -> PathBuf {
    fixture_shards_packed(dir, copies, 12)
}

/// The fixture's 12-token rows as documents packed into shard rows of `seq_len` tokens, the rest padding.
pub fn fixture_shards_packed(dir: &Path, copies: usize, seq_len: usize) -> PathBuf {
    let out = dir.join("data");
    write_fixture_shards(&out, copies, seq_len, &["fixture"]);
    out
}

/// The fixture's rows written `copies` times as shards of `seq_len`-token rows into `out`, each document's
/// source the next of `sources` in turn.
pub fn write_fixture_shards(out: &Path, copies: usize, seq_len: usize, sources: &[&str]) {
    let bytes = std::fs::read(fixture_dir().join("lfm2-tiny/fixture.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let i64s = |k: &str| -> Vec<u32> {
        st.tensor(k).unwrap().data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
    };
    let (ids, mask) = (i64s("input_ids"), i64s("loss_mask"));
    let mut w = ShardWriter::new(out, Layout::Packed, seq_len, 0).unwrap();
    for c in 0..copies {
        for r in 0..2 {
            let sample = TokenSample {
                id: format!("row{r}-{c}"),
                input_ids: ids[r * 12..(r + 1) * 12].to_vec(),
                loss_mask: mask[r * 12..(r + 1) * 12].iter().map(|&m| m as u8).collect(),
            };
            w.add(&sample, sources[(c * 2 + r) % sources.len()]).unwrap();
        }
    }
    w.finish().unwrap();
}

/// The settings of the PyTorch run in train_fixture.safetensors: one step per epoch of the fixture batch.
pub fn parity_config() -> TrainConfig {
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

/// `kiln train` of the tiny LFM2 fixture on backend `B`'s default device.
pub fn run<B: LinearCrossEntropy + DeviceMemory>(
    cfg: &TrainConfig,
    data: &Path,
    run_dir: &Path,
    resume: bool,
    halt: Option<usize>,
) -> (TrainSummary, CausalLm<B>) {
    run_model::<B>(&fixture_dir().join("lfm2-tiny"), cfg, data, run_dir, resume, halt)
}

/// `kiln train` of the checkpoint in `model_dir` on backend `B`'s default device.
pub fn run_model<B: LinearCrossEntropy + DeviceMemory>(
    model_dir: &Path,
    cfg: &TrainConfig,
    data: &Path,
    run_dir: &Path,
    resume: bool,
    halt: Option<usize>,
) -> (TrainSummary, CausalLm<B>) {
    train::<B>(cfg, model_dir, data, run_dir, resume, &AtomicBool::new(false), halt, false, &Default::default())
        .unwrap()
}

/// The error of a `kiln train` run of `model_dir` that must fail.
pub fn failed_run<B: LinearCrossEntropy + DeviceMemory>(
    model_dir: &Path,
    cfg: &TrainConfig,
    data: &Path,
    run_dir: &Path,
) -> String {
    match train::<B>(cfg, model_dir, data, run_dir, false, &AtomicBool::new(false), None, false, &Default::default()) {
        Ok(_) => panic!("the run of {} must fail", model_dir.display()),
        Err(e) => e.to_string(),
    }
}

pub fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("train/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Three steps on `B` give PyTorch's losses, gradient norms and parameters within 1e-4 relative.
pub fn assert_three_steps_match_pytorch<B: LinearCrossEntropy + DeviceMemory>() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixture_shards(dir.path(), 1);
    let (summary, model) = run::<B>(&parity_config(), &data, &dir.path().join("run"), false, None);
    assert_eq!(summary.steps, 3);
    let bytes = std::fs::read(fixture_dir().join("train_fixture.safetensors")).unwrap();
    let want = SafeTensors::deserialize(&bytes).unwrap();
    let losses = f32s(&want.tensor("losses").unwrap());
    let norms = f32s(&want.tensor("grad_norms").unwrap());
    let got = metrics(&dir.path().join("run"));
    assert_eq!(got.len(), losses.len());
    for (m, (l, n)) in got.iter().zip(losses.iter().zip(&norms)) {
        let (got_l, got_n) = (m["loss"].as_f64().unwrap() as f32, m["grad_norm"].as_f64().unwrap() as f32);
        assert!(((got_l - l) / l).abs() <= 1e-4, "loss {got_l} vs torch {l}");
        assert!(((got_n - n) / n).abs() <= 1e-4, "grad norm {got_n} vs torch {n}");
    }
    let ours = hf_tensors(&model);
    for (name, view) in want.tensors() {
        let Some(key) = name.strip_prefix("param.") else { continue };
        let want = f32s(&view);
        let err = super::parity::error_relative_to_largest(&want, &ours[key].data);
        assert!(err <= 1e-4, "{key}: {err} relative after 3 steps");
    }
}

/// How closely a resumed run must reproduce the uninterrupted one.
#[derive(Clone, Copy, Debug)]
pub enum Agreement {
    /// Checkpoint bytes and losses identical (the CPU: every kernel deterministic).
    BitForBit,
    /// Every parameter within this relative error (to the tensor's largest entry) and every loss within it
    /// relative: a GPU backend's fused kernels are not bit-reproducible from run to run (burn-fusion's
    /// blocks and atomic reductions can add in another order), and a state restored wrongly (moments, data
    /// order, schedule) moves parameters by a fraction of the learning rate's step, orders above this.
    Within(f32),
}

/// A run on `B` halted after 4 steps and resumed writes the uninterrupted run's checkpoints and losses.
/// Two data-parallel replicas on `B`'s device train each of the LFM2 fixtures `models` as one device does:
/// every loss and gradient norm, and every parameter (relative to its tensor's largest entry), within
/// `tolerance`; the token counts equal.
pub fn assert_replicas_train_as_one_device<B: LinearCrossEntropy + DeviceMemory>(models: &[&str], tolerance: f64) {
    let dir = tempfile::tempdir().unwrap();
    let data = fixture_shards(dir.path(), 2);
    for name in models {
        let train = |devices: usize| {
            let run_dir = dir.path().join(format!("{name}-{devices}"));
            let cfg = TrainConfig { epochs: 2, global_batch: 4, micro_batch: 1, devices, ..parity_config() };
            let (summary, model) = run_model::<B>(&fixture_dir().join(name), &cfg, &data, &run_dir, false, None);
            assert_eq!(summary.steps, 2, "{name} on {devices} devices");
            (hf_tensors(&model), metrics(&run_dir))
        };
        let ((one, one_metrics), (two, two_metrics)) = (train(1), train(2));
        for (k, t) in &one {
            let err = super::parity::error_relative_to_largest(&t.data, &two[k].data);
            assert!(f64::from(err) <= tolerance, "{name} {k}: {err} relative");
        }
        assert_eq!(one_metrics.len(), two_metrics.len());
        for (a, b) in one_metrics.iter().zip(&two_metrics) {
            for field in ["loss", "grad_norm"] {
                let (a, b) = (a[field].as_f64().unwrap(), b[field].as_f64().unwrap());
                assert!((a - b).abs() <= tolerance * a.abs(), "{name}: {field} {a} on one device, {b} on two");
            }
            // The routing is counted in integers, each replica its own micro-batches' share.
            for counted in ["tokens", "supervised_tokens", "experts"] {
                assert_eq!(a[counted], b[counted], "{name}: {counted}");
            }
        }
    }
}

/// What TensorBoard shows of the run at `run_dir` (its `train/` event files) is what its metrics.jsonl and
/// validation.jsonl hold: every step and measure once, in order, whatever stops and resumes the run took.
pub fn assert_events_show_the_records(run_dir: &Path) {
    use kiln::train::tensorboard::{scalars_as_shown, step_scalars, validation_scalars};
    let train = run_dir.join("train");
    let mut want: std::collections::BTreeMap<String, Vec<(i64, f32)>> = Default::default();
    for m in kiln::train::trainer::read_metrics(&train.join("metrics.jsonl")).unwrap() {
        for (tag, value) in step_scalars(&m) {
            want.entry(tag).or_default().push((m.step as i64 + 1, value));
        }
    }
    for p in kiln::train::validation::read_points(&kiln::train::validation::points_path(&train)).unwrap() {
        for (tag, value) in validation_scalars(&p) {
            want.entry(tag).or_default().push((p.step as i64, value));
        }
    }
    assert!(want.contains_key("train/loss"), "a run that took steps");
    let shown = scalars_as_shown(&train).unwrap();
    assert_eq!(shown.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{}", train.display());
    for (tag, want) in &want {
        let steps = |points: &[(i64, f32)]| points.iter().map(|&(step, _)| step).collect::<Vec<_>>();
        assert_eq!(steps(&shown[tag]), steps(want), "{tag} in {}", train.display());
        // The events hold the f64 figures as f32; the JSON lines' text parses back to an f64 that may be an ulp
        // off (serde_json's fast float parsing), which can round to the neighbouring f32.
        for (&(step, got), &(_, value)) in shown[tag].iter().zip(want) {
            assert!((got - value).abs() <= 2.5e-7 * value.abs(), "{tag} at step {step}: {got} vs {value}");
        }
    }
}

pub fn assert_resume_is_exact<B: LinearCrossEntropy + DeviceMemory>(cfg: &TrainConfig) {
    assert_resume_agrees::<B>(cfg, Agreement::BitForBit);
}

pub fn assert_resume_agrees<B: LinearCrossEntropy + DeviceMemory>(cfg: &TrainConfig, agreement: Agreement) {
    let dir = tempfile::tempdir().unwrap();
    let data = fixture_shards(dir.path(), 3);
    let (straight, _) = run::<B>(cfg, &data, &dir.path().join("straight"), false, None);
    let (stopped, _) = run::<B>(cfg, &data, &dir.path().join("resumed"), false, Some(4));
    assert!(stopped.interrupted && stopped.steps == 4);
    // As a run killed after its last saved state leaves them: a step past it, and a line cut off mid-write.
    let metrics_path = dir.path().join("resumed/train/metrics.jsonl");
    let mut text = std::fs::read_to_string(&metrics_path).unwrap();
    let last = text.lines().last().unwrap().replace("\"step\":3", "\"step\":4");
    assert!(last.contains("\"step\":4"), "{last}");
    text.push_str(&format!("{last}\n{{\"step\":5,\"ep"));
    std::fs::write(&metrics_path, text).unwrap();
    // As a run killed while it saved a state leaves it: the last complete state renamed aside, the new one
    // half-written. The resume takes the complete one.
    let train_dir = dir.path().join("resumed/train");
    std::fs::rename(train_dir.join("state"), train_dir.join("state.previous")).unwrap();
    std::fs::create_dir(train_dir.join("state.partial")).unwrap();
    std::fs::write(train_dir.join("state.partial/model.safetensors"), b"cut off").unwrap();
    assert!(kiln::train::state::saved_state(&dir.path().join("resumed")).is_some(), "the pipeline resumes it");
    // Its TensorBoard events likewise: the step past the state, and a record cut off mid-write.
    let events = kiln::train::tensorboard::event_files(&train_dir).unwrap();
    let mut file = std::fs::OpenOptions::new().append(true).open(events.last().unwrap()).unwrap();
    let stale = Event { wall_time: 1.0, step: 5, body: EventBody::Scalars(vec![("train/loss".into(), 99.0)]) };
    file.write_all(&record(&encode_event(&stale))).unwrap();
    file.write_all(&record(&encode_event(&stale))[..10]).unwrap();
    let (resumed, _) = run::<B>(cfg, &data, &dir.path().join("resumed"), true, None);
    assert!(!train_dir.join("state.previous").exists() && !train_dir.join("state.partial").exists());
    assert_events_show_the_records(&dir.path().join("straight"));
    assert_events_show_the_records(&dir.path().join("resumed"));
    assert_eq!(resumed.steps, straight.steps);
    let losses = |d: &str| metrics(&dir.path().join(d)).iter().map(|m| m["loss"].as_f64().unwrap()).collect::<Vec<_>>();
    let (a_losses, b_losses) = (losses("straight"), losses("resumed"));
    assert_eq!(a_losses.len(), b_losses.len());
    for epoch in ["epoch-1", "epoch-2"] {
        let file =
            |d: &str| std::fs::read(dir.path().join(d).join("checkpoints").join(epoch).join("model.safetensors"));
        let (a, b) = (file("straight").unwrap(), file("resumed").unwrap());
        match agreement {
            Agreement::BitForBit => assert!(a == b, "{epoch} differs after resume"),
            Agreement::Within(tolerance) => {
                let (a, b) = (SafeTensors::deserialize(&a).unwrap(), SafeTensors::deserialize(&b).unwrap());
                assert_eq!(a.len(), b.len());
                for (name, want) in a.tensors() {
                    let (want, got) = (f32s(&want), f32s(&b.tensor(&name).unwrap()));
                    let err = super::parity::error_relative_to_largest(&want, &got);
                    assert!(err <= tolerance, "{epoch} {name}: {err} relative after resume");
                }
            }
        }
    }
    match agreement {
        Agreement::BitForBit => assert_eq!(a_losses, b_losses),
        Agreement::Within(tolerance) => {
            for (step, (a, b)) in a_losses.iter().zip(&b_losses).enumerate() {
                assert!((a - b).abs() <= f64::from(tolerance) * a.abs(), "step {step}: loss {a} straight, {b} resumed");
            }
        }
    }
}

/// Each tiny shape's three benchmark steps (micro-batches accumulated) on backend `B` in `precision`, against
/// the CPU's f32 losses within `tolerance(shape)` relative: for backends the CLI does not name (burn's
/// unfused CubeCL backend on Vulkan).
pub fn assert_tiny_shapes_train_on<B: LinearCrossEntropy + DeviceMemory>(
    precision: Precision,
    tolerance: fn(&str) -> f64,
) {
    let cfg = super::tiny_bench_config(Precision::F32, 2);
    for (shape, config) in super::tiny_shapes() {
        let cpu = bench_on_device(&config, &cfg, "cpu").unwrap();
        let device = kiln::train::bench::bench_train::<B>(
            &config,
            &BenchConfig { precision, ..cfg.clone() },
            "vulkan",
            &Default::default(),
        )
        .unwrap_or_else(|e| panic!("{shape}: {e}"));
        super::assert_losses_agree(&format!("{shape} {precision:?}, cpu f32"), &device, &cpu, tolerance(shape));
    }
}

/// Each tiny shape's three benchmark steps on the vulkan device in `precision`, against the CPU's f32
/// losses within `tolerance(shape)` relative: micro-batches accumulated (`accumulation`), one micro-batch
/// with activation checkpointing, and one with burn's plain compositions.
pub fn assert_tiny_shapes_train_as_on_the_cpu(precision: Precision, accumulation: usize, tolerance: fn(&str) -> f64) {
    let cfg = super::tiny_bench_config(Precision::F32, accumulation);
    let variants = [
        ("ops", cfg.clone()),
        ("checkpointed", BenchConfig { activation_checkpointing: true, accumulation: 1, ..cfg.clone() }),
        ("reference ops", BenchConfig { reference_ops: true, accumulation: 1, ..cfg.clone() }),
    ];
    for (shape, config) in super::tiny_shapes() {
        for (label, cfg) in &variants {
            let cpu = bench_on_device(&config, cfg, "cpu").unwrap();
            let device = bench_on_device(&config, &BenchConfig { precision, ..cfg.clone() }, "vulkan")
                .unwrap_or_else(|e| panic!("{shape} {label}: {e}"));
            assert_eq!(device.run.device, "vulkan");
            let what = format!("{shape} {label}: vulkan {precision:?}, cpu f32");
            super::assert_losses_agree(&what, &device, &cpu, tolerance(shape));
        }
    }
}
