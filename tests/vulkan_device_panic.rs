//! A panic on burn's device thread, as the first GPU session met it, ends in one summary that names it.
//! burn 0.21's fused reduction panics when its layout reference is one of its outputs (tracel-ai/burn#5292):
//! a half-precision tensor over a reshaped view, cast to f32 once and kept past a mean over its last axis,
//! does it (kiln's norms no longer do: `ops::f32_of`). The device's stream is poisoned afterwards, so this
//! test has a process of its own. Should burn fix the bug, the composition computes and this test says so.
//! A failed device allocation, which also panics on the device thread, is told apart from a bug: exit status 3
//! and, for `bench-train`, a row that says the shape did not fit.
#![cfg(feature = "vulkan")]

mod common;

use burn::tensor::{FloatDType, Tensor, TensorData};
use kiln::backend::Vk;

#[test]
fn a_device_thread_panic_ends_in_one_summary_that_names_it() {
    kiln::device_panics::install();
    let device = Default::default();
    let outcome = std::panic::catch_unwind(|| {
        let values: Vec<f32> = (0..2 * 8 * 4 * 8).map(|i| (i % 13) as f32 / 13.0 - 0.5).collect();
        let x = Tensor::<Vk, 1>::from_data(TensorData::new(values, [512]), &device)
            .reshape([2, 8, 32])
            .cast(FloatDType::F16)
            .reshape([2, 8, 4, 8]);
        let f32_copy = x.clone().cast(FloatDType::F32);
        let mean_square = f32_copy.clone().powf_scalar(2.0).mean_dim(3);
        let normed = f32_copy * (mean_square + 1e-5).sqrt().recip();
        let total = normed.sum().into_scalar();
        drop(x);
        total
    });
    assert!(outcome.is_err(), "burn computed the composition of tracel-ai/burn#5292: the bug is fixed upstream");
    let summary = kiln::device_panics::summary();
    eprintln!("{summary}");
    assert!(summary.starts_with("kiln stopped on a panic: 'index out of bounds"), "{summary}");
    assert!(summary.contains("on thread 'DSU-") && summary.contains("ir.rs:500"), "{summary}");
    assert!(summary.contains("KILN_CUDA_FUSION=off"), "{summary}");
}

/// wgpu refuses a buffer past its limit as CUDA refuses one past its memory, on the device thread
/// ("can't allocate buffer of size"), and burn hands the main thread the poisoned stream's error: the command
/// still names the allocation, exits with status 3, and `bench-train` writes what ran and `out_of_memory`
/// where its result would have gone. The tiny LFM2 with a 65,536 × 1,024 embedding (256 MiB in f32) and one
/// layer is such a shape on lavapipe.
#[test]
fn a_failed_device_allocation_exits_with_status_3_and_leaves_an_out_of_memory_row() {
    let dir = tempfile::tempdir().unwrap();
    let root = common::project_dir();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("configs/models/tiny/config.json")).unwrap()).unwrap();
    let layer = config["layer_types"][0].clone();
    for (key, value) in [
        ("vocab_size", 65_536.into()),
        ("hidden_size", 1_024.into()),
        ("num_hidden_layers", 1.into()),
        ("layer_types", serde_json::json!([layer])),
    ] {
        config[key] = value;
    }
    let (config_path, row_path) = (dir.path().join("wide.json"), dir.path().join("row.json"));
    std::fs::write(&config_path, config.to_string()).unwrap();
    let (config_arg, row_arg) = (config_path.to_str().unwrap(), row_path.to_str().unwrap());
    let args = ["--quiet", "bench-train", "--config", config_arg, "--device", "vulkan", "--seq", "8"];
    let args = [&args[..], &["--steps", "1", "--warmup", "0", "--out", row_arg]].concat();
    let (status, _, stderr) = common::run_kiln_status(&args, &[], dir.path());
    assert_eq!(status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("error: kiln stopped: the device could not allocate memory"), "{stderr}");
    let row: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&row_path).unwrap()).unwrap();
    assert_eq!(
        (row["framework"].as_str(), row["device"].as_str(), row["seq"].as_u64()),
        (Some("kiln"), Some("vulkan"), Some(8))
    );
    let why = row["out_of_memory"].as_str().unwrap_or_default();
    assert!(why.contains("can't allocate buffer of size"), "{row}");
    assert!(row.get("tokens_per_s").is_none(), "nothing was measured: {row}");
}
