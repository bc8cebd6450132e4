//! The half-precision graph CUDA's bf16 backend runs, checked without a GPU: the vulkan device in f16
//! (`--precision f16`; Mesa's lavapipe has no bf16). The f32 tests (tests/vulkan_backend.rs) cannot see what
//! only half precision builds — half tensors born in the device's default dtype, cast to f32 around norms,
//! softmax and the loss — and burn's fusion panicked there (tracel-ai/burn#5292) in every step of the first
//! GPU session. A process of its own: burn fixes a device's default float dtype at its first use for the
//! whole process (`backend::cuda_ready` says more), so every test here claims the device in f16 first.
#![cfg(feature = "vulkan")]

mod common;

use burn::tensor::FloatDType;
use common::convs::{conv_parts, conv_parts_by_tensor_ops, gated_conv_parts, gated_conv_parts_by_tensor_ops};
use common::norms::{l2_parts, l2_parts_by_tensor_ops, norm_parts, norm_parts_by_tensor_ops};
use common::parity::{self, ids_tensor, values};
use kiln::backend::{VkHalf, VkHalfTrain};
use kiln::models::ops::NormKind;
use kiln::models::{CausalLm, SequenceLayout, load_model};
use kiln::train::optim::{AdamWConfig, MomentDtype};
use kiln::train::schedule::Decay;
use kiln::train::{Precision, TrainConfig};

fn claim_f16() {
    kiln::backend::vulkan_ready(true).unwrap();
}

/// The process's device computes in f16, and asking it for f32 afterwards is an error that says why.
#[test]
fn the_device_is_claimed_in_f16_and_refuses_f32_after() {
    claim_f16();
    let err = kiln::backend::vulkan_ready(false).unwrap_err();
    assert!(err.contains("already computes in F16") && err.contains("process of its own"), "{err}");
}

/// How far a tiny shape's half-precision losses may be from the CPU's f32 ones after an update (the first
/// loss, before any, within a tenth: `common::assert_losses_agree`): 1e-3 relative (f16 rounding; seen within
/// 2e-4). Gemma 4 within 5e-3 (seen 1.8e-3 after one update, 3.0e-3 after two; its first losses within
/// 4e-5, as the others'): Adam's first steps move every parameter by about the learning rate whatever its
/// gradient's size, so rounding flips the direction of the ones with small gradients, and Gemma's unscaled
/// attention (scores of tens: tests/reference_ops.rs) turns that into loss differences of the order of a
/// step's own change. bf16 on the CPU against f32, 8 seeds, shows the same spread with its GeGLU as one op
/// (up to 4.1e-3 after one update) and as burn's composition (3.5e-3), while the op's forward is the nearer.
fn half_precision_tolerance(shape: &str) -> f64 {
    if shape.ends_with("tiny-gemma4") { 5e-3 } else { 1e-3 }
}

/// Every tiny shape trains three steps with kiln's ops, with activation checkpointing and with burn's plain
/// compositions, each loss within `half_precision_tolerance` of the CPU's f32 one.
#[test]
fn the_tiny_shapes_train_in_half_precision_on_the_fused_backend() {
    claim_f16();
    common::training::assert_tiny_shapes_train_as_on_the_cpu(Precision::F16, 2, half_precision_tolerance);
}

/// The half-precision graph on burn's unfused backend (`KILN_CUDA_FUSION=off`'s path on CUDA).
#[test]
fn the_tiny_shapes_train_in_half_precision_on_the_unfused_backend() {
    claim_f16();
    common::training::assert_tiny_shapes_train_on::<burn::backend::Autodiff<kiln::backend::VkHalfUnfused>>(
        Precision::F16,
        half_precision_tolerance,
    );
}

/// kiln's RMSNorm kernels in half precision against the tensor ops they replace on the same device, fused
/// and unfused: both forms with an f16 weight, and the plain form with an f32 weight (Qwen3.5's DeltaNet
/// output norm), whose output is f32. Outputs rounded to f16 may differ by an ulp where the order of the
/// sum of squares moves a value across a rounding boundary; the gradients are summed in f32 and rounded once.
#[test]
fn the_norm_kernels_equal_the_tensor_op_norms_in_half_precision() {
    claim_f16();
    let (f16, f32) = (FloatDType::F16, FloatDType::F32);
    for dims in [[3, 5, 64], [2, 9, 96], [1, 40, 1024]] {
        for (kind, dtypes) in [
            (NormKind::Plain, [f16, f16]),
            (NormKind::ZeroCentered, [f16, f16]),
            (NormKind::Plain, [f16, f32]),
            (NormKind::ScaledInF32, [f16, f16]),
        ] {
            let fused = norm_parts::<VkHalf>(dims, kind, dtypes);
            let unfused = norm_parts::<kiln::backend::VkHalfUnfused>(dims, kind, dtypes);
            let device_ops = norm_parts_by_tensor_ops::<VkHalf>(dims, kind, dtypes);
            parity::assert_kernel_results(
                &format!("{dims:?} {kind:?} {dtypes:?}"),
                ["output", "d x", "d weight"],
                &[("fused", &fused, &device_ops), ("unfused", &unfused, &device_ops)],
                [1.0 / 512.0; 3],
            );
        }
    }
}

/// kiln's L2-norm kernels on an f16 input (Qwen3.5's DeltaNet q and k in half-precision training) against the
/// tensor ops they replace on the same device, fused and unfused: the output is f32 from f32 sums, the input
/// gradient rounded once to f16.
#[test]
fn the_l2_norm_kernels_equal_the_tensor_op_norms_in_half_precision() {
    claim_f16();
    for dims in [[3, 5, 128], [2, 9, 16]] {
        let f16 = FloatDType::F16;
        let fused = l2_parts::<VkHalf>(dims, f16);
        let unfused = l2_parts::<kiln::backend::VkHalfUnfused>(dims, f16);
        let device_ops = l2_parts_by_tensor_ops::<VkHalf>(dims, f16);
        parity::assert_kernel_results(
            &format!("{dims:?} L2"),
            ["output", "d x"],
            &[("fused", &fused, &device_ops), ("unfused", &unfused, &device_ops)],
            [2e-6, 1.0 / 512.0],
        );
    }
}

/// kiln's causal-conv kernels in half precision against the tensor ops they replace on the same device, fused
/// and unfused: both sum in f32 and round once to f16, so they differ by at most an f16 ulp where the order
/// of a sum moves a value across a rounding boundary (the kernel gradient's, over every token).
#[test]
fn the_conv_kernels_equal_the_tensor_op_conv_in_half_precision() {
    claim_f16();
    for case in common::convs::conv_cases() {
        let f16 = FloatDType::F16;
        let fused = conv_parts::<VkHalf>(&case, f16);
        let unfused = conv_parts::<kiln::backend::VkHalfUnfused>(&case, f16);
        let device_ops = conv_parts_by_tensor_ops::<VkHalf>(&case, f16);
        parity::assert_kernel_results(
            &format!("{case:?}"),
            ["output", "d x", "d kernel"],
            &[("fused", &fused, &device_ops), ("unfused", &unfused, &device_ops)],
            [1.0 / 1024.0; 3],
        );
    }
}

/// The gated conv kernels (LFM2's `C ⊙ conv(B ⊙ x)`) in half precision against the tensor ops they replace:
/// the kernels round once, the tensor ops round `B ⊙ x`, the conv's output and every product to f16, so they
/// differ by an f16 ulp or two of the largest value.
#[test]
fn the_gated_conv_kernels_equal_the_tensor_ops_in_half_precision() {
    claim_f16();
    for case in common::convs::conv_cases() {
        let f16 = FloatDType::F16;
        let fused = gated_conv_parts::<VkHalf>(&case, f16);
        let unfused = gated_conv_parts::<kiln::backend::VkHalfUnfused>(&case, f16);
        let device_ops = gated_conv_parts_by_tensor_ops::<VkHalf>(&case, f16);
        parity::assert_kernel_results(
            &format!("gated {case:?}"),
            ["output", "d projection", "d kernel"],
            &[("fused", &fused, &device_ops), ("unfused", &unfused, &device_ops)],
            [1.0 / 512.0; 3],
        );
    }
}

/// kiln's AdamW kernel on half-precision parameters (f32 masters kept, as for bf16 on CUDA; and without
/// them, rounded into stochastically) against the CPU's tensor ops in f16: masters and moments within f32
/// rounding, parameters within an f16 ulp.
#[test]
fn the_adamw_kernel_steps_half_precision_parameters_as_the_cpu_tensor_ops() {
    use kiln::train::optim::Masters;
    claim_f16();
    for masters in [Masters::F32, Masters::Stochastic] {
        common::optimizer_ops::assert_adamw_matches_the_cpu::<VkHalfTrain>(
            FloatDType::F16,
            MomentDtype::F32,
            masters,
            1e-3,
        );
        common::optimizer_ops::assert_adamw_matches_the_cpu::<burn::backend::Autodiff<kiln::backend::VkHalfUnfused>>(
            FloatDType::F16,
            MomentDtype::F32,
            masters,
            1e-3,
        );
    }
}

/// Stochastic rounding without masters on the fused f16 device: the noise's hash in the device's 32-bit
/// integers draws the CPU's 64-bit values bit for bit, the rounding picks what the CPU picks from the same
/// values and noise, and the tiny LFM2 trains three steps without masters within f16's tolerance of the
/// CPU's f32 losses.
#[test]
fn stochastic_rounding_on_the_fused_half_device_equals_the_cpus() {
    use burn::tensor::{DType, Tensor, TensorData};
    use kiln::backend::Cpu;
    use kiln::train::rounding::{noise, noise_key, stochastic_round};
    claim_f16();
    let (device, cpu) = (Default::default(), Default::default());
    let shape = [37, 129];
    let key = noise_key(3, 11);
    let drawn = values(noise::<VkHalf, 2>(shape, key, &device));
    assert_eq!(drawn, values(noise::<Cpu, 2>(shape, key, &cpu)), "the device's noise is not the CPU's");
    // Values between f16 ones across magnitudes, subnormals included.
    let x: Vec<f32> =
        (0..shape[0] * shape[1]).map(|i| (i as f32 * 0.618_034).sin() * 10f32.powi(i as i32 % 7 - 5)).collect();
    let on_device = Tensor::<VkHalf, 2>::from_data(TensorData::new(x.clone(), shape), (&device, DType::F32));
    let on_cpu = Tensor::<Cpu, 2>::from_data(TensorData::new(x, shape), &cpu);
    let rounded = stochastic_round(on_device, FloatDType::F16, noise::<VkHalf, 2>(shape, key, &device));
    let want = stochastic_round(on_cpu, FloatDType::F16, noise::<Cpu, 2>(shape, key, &cpu));
    assert_eq!(values(rounded.cast(FloatDType::F32)), values(want.cast(FloatDType::F32)));

    let (shape, config) = common::tiny_shapes().next().unwrap();
    let cfg = common::tiny_bench_config(Precision::F32, 1);
    let cpu_f32 = kiln::train::bench::bench_on_device(&config, &cfg, "cpu").unwrap();
    let stochastic = kiln::train::bench::BenchConfig {
        precision: Precision::F16,
        masters: kiln::train::optim::Masters::Stochastic,
        ..cfg
    };
    let half = kiln::train::bench::bench_on_device(&config, &stochastic, "vulkan").unwrap();
    assert_eq!(half.run.masters, Some(kiln::train::optim::Masters::Stochastic));
    common::assert_losses_agree(&format!("{shape} f16 without masters, cpu f32"), &half, &cpu_f32, 1e-3);
}

/// kiln's gradient-norm kernel on half-precision gradients, and on f16 and f32 ones together (Qwen3.5 keeps
/// `A_log` and its DeltaNet norm weight in f32: a launch per dtype), fused and unfused.
#[test]
fn the_squared_norm_kernel_equals_the_tensor_op_sums_in_half_precision() {
    claim_f16();
    let (f16, f32) = (FloatDType::F16, FloatDType::F32);
    common::optimizer_ops::assert_squared_norm_matches::<VkHalf>(&[f16]);
    common::optimizer_ops::assert_squared_norm_matches::<VkHalf>(&[f16, f32]);
    common::optimizer_ops::assert_squared_norm_matches::<kiln::backend::VkHalfUnfused>(&[f16, f32]);
}

/// The trainer in f16: a run stopped after 4 steps and resumed ends where the uninterrupted one does, its
/// epoch exports (written from f16 parameters) included. With 8-bit moments, as the largest models train
/// on the GPU: their u8 codes in the half-precision graph, saved and restored.
#[test]
fn a_half_precision_run_on_the_fused_backend_resumes_and_exports() {
    claim_f16();
    let cfg = TrainConfig {
        epochs: 2,
        warmup_steps: Some(2),
        decay: Decay::Cosine,
        precision: Precision::F16,
        adamw: AdamWConfig { moments: MomentDtype::Q8, ..Default::default() },
        ..common::training::parity_config()
    };
    common::training::assert_resume_agrees::<VkHalfTrain>(&cfg, common::training::Agreement::Within(1e-3));
}

/// Cached decoding in f16, the graph evaluation runs on CUDA in bf16: LFM2's and Qwen3.5's prefill and
/// single-token steps follow their own full forward within 1 % of the largest logit.
#[test]
fn cached_decoding_runs_in_half_precision_on_the_fused_backend() {
    claim_f16();
    for (name, prefill) in [("lfm2/lfm2-tiny", 5), ("qwen3_5/qwen3_5-tiny", 66), ("gemma4/gemma4-tiny", 7)] {
        let dir = common::project_dir().join("tests/fixtures").join(name);
        let f = parity::fixture(&dir);
        let row = &f.ids.0[..f.shape()[1]];
        let device = Default::default();
        let (_, model) = load_model::<VkHalf>(&dir, &device).unwrap();
        let layout = SequenceLayout::single(1, row.len());
        let full = values(model.forward(ids_tensor::<VkHalf>(row, [1, row.len()], &device), &layout));
        let tolerance = 1e-2 * full.iter().fold(0f32, |m, v| m.max(v.abs()));
        match model {
            CausalLm::Lfm2(m) => parity::assert_cached_decoding_follows(&m, row, prefill, &full, tolerance, &device),
            CausalLm::Qwen35(m) => parity::assert_cached_decoding_follows(&m, row, prefill, &full, tolerance, &device),
            CausalLm::Gemma4(m) => parity::assert_cached_decoding_follows(&m, row, prefill, &full, tolerance, &device),
        }
    }
}
