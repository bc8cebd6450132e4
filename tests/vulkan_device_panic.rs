//! A panic on burn's device thread, as the first GPU session met it, ends in one summary that names it.
//! burn 0.21's fused reduction panics when its layout reference is one of its outputs (tracel-ai/burn#5292):
//! a half-precision tensor over a reshaped view, cast to f32 once and kept past a mean over its last axis,
//! does it (kiln's norms no longer do: `ops::f32_of`). The device's stream is poisoned afterwards, so this
//! test has a process of its own. Should burn fix the bug, the composition computes and this test says so.
#![cfg(feature = "vulkan")]

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
