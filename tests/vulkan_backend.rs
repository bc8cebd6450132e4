//! kiln on a fused CubeCL backend, checked without a GPU: the `vulkan` device is burn's CubeCL backend with
//! burn-fusion, its kernels compiled to SPIR-V, here run by Mesa's CPU Vulkan driver (lavapipe). CUDA runs
//! the same fusion and the same kernels with another compiler under them, so a model, an op, a trainer step
//! or the kernel profiler that goes wrong on a fused CubeCL backend shows here before any GPU session:
//! the architectures against transformers (logits and gradients), the trainer against PyTorch's AdamW run,
//! resume, data-parallel replicas through burn's collective, every tiny shape's training steps against the
//! CPU's, activation checkpointing's recomputed layers and the memory they give back, kiln's own CubeCL kernels (the DeltaNet scan, chunk solve and decay gradients, the attention's softmax rows, the
//! cross-entropy's rows, the RMSNorms, the causal conv, the gradients' squared norm, AdamW's update) against
//! the tensor ops they replace, the MoE's experts batched into one matmul against a matmul per expert, and the
//! per-kernel profile that tests/bench/gpu_session.sh takes on the GPU.
//! Built with `--features vulkan` (`make test` adds it where a Vulkan driver is installed; .ci/run installs
//! lavapipe).
#![cfg(feature = "vulkan")]

mod common;

use std::path::PathBuf;

use burn::tensor::FloatDType;
use burn::tensor::Tensor;
use common::convs::{conv_parts, conv_parts_by_tensor_ops, gated_conv_parts, gated_conv_parts_by_tensor_ops};
use common::norms::{l2_parts, l2_parts_by_tensor_ops, norm_parts, norm_parts_by_tensor_ops};
use common::parity::{self, KernelComparison, KernelResults, ids_tensor, masked_ce, max_abs_diff, spread, values};
use kiln::backend::{Cpu, Vk, VkTrain, VkUnfused};
use kiln::kernels::attention as attention_kernel;
use kiln::kernels::cross_entropy as kernel_cross_entropy;
use kiln::models::attention::{ChunkRows, score_grads, softmax_rows_into};
use kiln::models::deltanet::{
    ChunkPlan, ChunkRecurrence, DecayGradInputs, Direction, DocSegments, decay_grads, recurrence_by_chunk,
    unit_lower_inverse,
};
use kiln::models::hf::hf_gradients;
use kiln::models::ops::NormKind;
use kiln::models::{CausalLm, DocumentAttention, ModelBackend, SequenceLayout, load_model};
use kiln::train::linear_ce::cross_entropy_rows;
use kiln::train::schedule::Decay;
use kiln::train::{Precision, TrainConfig};

/// The transformers fixtures and the document lengths of each one's packed row.
const FIXTURES: [(&str, &[u32]); 4] = [
    ("lfm2/lfm2-tiny", &[5, 7]),
    ("lfm2/lfm2-moe-tiny", &[5, 7]),
    ("qwen3_5/qwen3_5-tiny", &[40, 30]),
    ("gemma4/gemma4-tiny", &[14, 10]),
];

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn logits<B: ModelBackend>(model: &CausalLm<B>, ids: &[i64], shape: [usize; 2], layout: &SequenceLayout) -> Vec<f32> {
    values(model.forward(ids_tensor::<B>(ids, shape, &Default::default()), layout))
}

#[test]
fn the_device_computes() {
    kiln::backend::vulkan_ready(false).unwrap();
}

/// Logits within 1e-4 of transformers' (and of the CPU's), packed rows as the CPU packs them, and the
/// masked loss's gradients within 1e-4 relative, for LFM2, LFM2-MoE, Qwen3.5 and Gemma 4.
#[test]
fn the_architectures_match_transformers_on_the_fused_backend() {
    for (name, docs) in FIXTURES {
        let dir = fixture_dir(name);
        let f = parity::fixture(&dir);
        let shape = f.shape();
        let single = SequenceLayout::single(shape[0], shape[1]);
        let (_, model) = load_model::<Vk>(&dir, &Default::default()).unwrap();
        let (_, cpu) = load_model::<Cpu>(&dir, &Default::default()).unwrap();
        let got = logits(&model, &f.ids.0, shape, &single);
        let (err, cpu_err) =
            (max_abs_diff(&got, &f.logits.0), max_abs_diff(&got, &logits(&cpu, &f.ids.0, shape, &single)));
        eprintln!("{name}: logits max-abs error {err:.2e} vs transformers, {cpu_err:.2e} vs the CPU");
        assert!(err <= 1e-4 && cpu_err <= 1e-4, "{name}: logits off by {err} (transformers), {cpu_err} (CPU)");

        let seq = f.packed_ids.len();
        let packed = SequenceLayout::from_doc_lengths(&[docs.to_vec()], seq);
        let got = logits(&model, &f.packed_ids, [1, seq], &packed);
        let err = max_abs_diff(&got, &logits(&cpu, &f.packed_ids, [1, seq], &packed));
        assert!(err <= 1e-4, "{name}: packed row off the CPU's by {err}");

        let (_, model) = load_model::<VkTrain>(&dir, &Default::default()).unwrap();
        let loss = masked_ce(
            model.forward(ids_tensor::<VkTrain>(&f.ids.0, shape, &Default::default()), &single),
            &f.ids.0,
            &f.mask,
            shape,
        );
        let value = values(loss.clone())[0];
        assert!((value - f.loss).abs() <= 1e-4, "{name}: loss {value} vs {}", f.loss);
        let grads = loss.backward();
        parity::check_gradients(name, &f, &hf_gradients(&model, &grads), 1e-4);
    }
}

/// The trainer's fixture run: three steps give PyTorch's losses, gradient norms and parameters.
#[test]
fn three_steps_match_pytorch_adamw_on_the_fused_backend() {
    common::training::assert_three_steps_match_pytorch::<VkTrain>();
}

/// Resume on the device: the state's moments, master weights, data position and schedule carry over, so the
/// resumed run ends where the uninterrupted one does. Not bit for bit: fused kernels may add in another order
/// from run to run (burn's full `sum` adds the cubes' partial sums atomically, and the clipping norm is one;
/// a fresh-clone CI run under load saw an epoch checkpoint differ, idle runs repeat exactly).
#[test]
fn a_resumed_run_on_the_fused_backend_equals_the_uninterrupted_one() {
    let cfg =
        TrainConfig { epochs: 2, warmup_steps: Some(2), decay: Decay::Cosine, ..common::training::parity_config() };
    common::training::assert_resume_agrees::<VkTrain>(&cfg, common::training::Agreement::Within(1e-5));
}

/// burn's unfused CubeCL backend (what `KILN_CUDA_FUSION=off` runs on CUDA: every op its own kernel, kiln's
/// DeltaNet scan kernel launched directly instead of as a fused custom operation) trains every tiny shape as
/// the CPU does.
#[test]
fn the_tiny_shapes_train_on_the_unfused_backend_as_on_the_cpu() {
    common::training::assert_tiny_shapes_train_on::<burn::backend::Autodiff<kiln::backend::VkUnfused>>(
        Precision::F32,
        |_| 1e-4,
    );
}

/// 8-bit moments on the device (u8 code tensors, the map looked up with gathers, the quantizer's float
/// arithmetic in SPIR-V): bitsandbytes' codes and AdamW8bit parameters (tests/fixtures/optim).
/// Data-parallel replicas on the fused backend (two, sharing lavapipe's one device): burn's collective sums
/// the fusion backend's gradients, and the run follows the one-device run.
#[test]
fn two_replicas_train_as_one_device_on_the_fused_backend() {
    common::training::assert_replicas_train_as_one_device::<VkTrain>(&["lfm2-tiny"], 1e-5);
}

#[test]
fn adamw_with_8bit_moments_follows_bitsandbytes_on_the_fused_backend() {
    common::optim::assert_8bit_adamw_follows_bitsandbytes::<VkTrain>(1e-5);
}

/// Every tiny shape (LFM2 convolutions, Qwen3.5's DeltaNet scan, LFM2-MoE's grouped expert matmuls) trains
/// three steps to the CPU's losses through the benchmark's step: micro-batches accumulated, with and
/// without activation checkpointing, and with burn's plain compositions in place of kiln's ops.
#[test]
fn the_tiny_shapes_train_on_the_fused_backend_as_on_the_cpu() {
    common::training::assert_tiny_shapes_train_as_on_the_cpu(Precision::F32, 2, |_| 1e-4);
}

/// Qwen3.5's cached decoding on the fused backend: a prefill of a chunk and a bit (the scan kernel from an
/// empty state, its last state kept in the cache), then the recurrent form a token at a time, each position
/// equal to the full forward.
#[test]
fn cached_decoding_follows_the_full_forward_on_the_fused_backend() {
    let dir = fixture_dir("qwen3_5/qwen3_5-tiny");
    let f = parity::fixture(&dir);
    let row = &f.ids.0[..f.shape()[1]];
    let (_, model) = load_model::<Vk>(&dir, &Default::default()).unwrap();
    let full = logits(&model, row, [1, row.len()], &SequenceLayout::single(1, row.len()));
    let CausalLm::Qwen35(model) = model else { panic!("the Qwen3.5 fixture loaded as another architecture") };
    parity::assert_cached_decoding_follows(&model, row, 66, &full, 1e-4, &Default::default());
}

fn scan_inputs<B: ModelBackend>(
    [b, h, n, c, dk, dv]: [usize; 6],
    direction: Direction,
    device: &B::Device,
) -> ChunkRecurrence<B> {
    let f32_tensor = |values: Vec<f32>, shape: Vec<usize>| {
        kiln::backend::host_tensor::<B, 1>(values, [shape.iter().product()], FloatDType::F32, device)
    };
    let five = |seed, shape: [usize; 5], scale: f32| {
        f32_tensor(spread(shape.iter().product(), seed, -scale, scale), shape.to_vec()).reshape(shape)
    };
    ChunkRecurrence {
        reads: five(1, [b, h, n, c, dk], 0.3),
        base: five(2, [b, h, n, c, dv], 1.0),
        writes: five(3, [b, h, n, c, dk], 0.3),
        decay: f32_tensor(spread(b * h * n, 4, 0.5, 1.0), vec![b * h * n]).reshape([b, h, n]),
        extra: (direction == Direction::Backward).then(|| five(5, [b, h, n, dk, dv], 1.0)),
        initial: f32_tensor(spread(b * h * dk * dv, 6, -1.0, 1.0), vec![b * h * dk * dv]).reshape([b, h, dk, dv]),
        direction,
    }
}

/// kiln's DeltaNet scan kernel (`kernels::scan`, what `chunk_recurrence` runs on the device) against
/// the chunk-by-chunk tensor-op scan it replaces, on the device and on the CPU, in both passes: several rows
/// and heads, a state width that is not a multiple of the kernel's column tile, a key width below the chunk
/// size, the model's chunk of 64.
#[test]
fn the_scan_kernel_equals_the_chunk_by_chunk_scan() {
    for dims in [[2, 3, 5, 8, 16, 12], [1, 2, 3, 64, 32, 40]] {
        for direction in [Direction::Forward, Direction::Backward] {
            let kernel = Vk::chunk_recurrence(scan_inputs::<Vk>(dims, direction, &Default::default()));
            let by_chunk = recurrence_by_chunk(scan_inputs::<Vk>(dims, direction, &Default::default()));
            let cpu = recurrence_by_chunk(scan_inputs::<Cpu>(dims, direction, &Default::default()));
            let parts = [
                ("states", values(kernel.states), values(by_chunk.states), values(cpu.states)),
                ("corrections", values(kernel.corrections), values(by_chunk.corrections), values(cpu.corrections)),
                ("last", values(kernel.last), values(by_chunk.last), values(cpu.last)),
            ];
            for (name, kernel, by_chunk, cpu) in parts {
                let scale = cpu.iter().fold(1.0f32, |m, x| m.max(x.abs()));
                let (device_err, cpu_err) = (max_abs_diff(&kernel, &by_chunk), max_abs_diff(&kernel, &cpu));
                eprintln!(
                    "{dims:?} {direction:?} {name}: {device_err:.2e} vs the device's tensor ops, {cpu_err:.2e} vs the CPU (scale {scale:.1})"
                );
                assert!(
                    device_err <= 1e-5 * scale && cpu_err <= 1e-5 * scale,
                    "{dims:?} {direction:?} {name}: off by {device_err} (device tensor ops), {cpu_err} (CPU)"
                );
            }
        }
    }
}

/// A strictly lower `L` `[b, h, n, c, c]` with entries in `±scale` (what is on and above the diagonal is
/// filled too: the solve must not read it), and the plan the tensor-op solve takes.
fn chunk_solve_inputs<B: ModelBackend>(
    [b, h, n, c]: [usize; 4],
    scale: f32,
    device: &B::Device,
) -> (Tensor<B, 5>, ChunkPlan<B>) {
    let count = b * h * n * c * c;
    let lower = kiln::backend::host_tensor::<B, 1>(spread(count, 7, -scale, scale), [count], FloatDType::F32, device)
        .reshape([b, h, n, c, c]);
    let below = Tensor::<B, 2, burn::tensor::Bool>::tril_mask([c, c], -1, device).unsqueeze::<5>();
    let segments = DocSegments::from_doc_ids(b, n * c, vec![0; b * n * c]);
    (lower.mask_fill(below, 0.0), ChunkPlan::new(&segments, c, device))
}

/// kiln's chunk-solve kernel (`kernels::chunk_solve`, forward substitution) against the tensor ops' block
/// doubling it replaces, on the fused and unfused device backends and on the CPU: tiny chunks, the model's
/// chunk of 64, and more chunks than a grid row holds (65,600: the grid wraps).
#[test]
fn the_chunk_solve_kernel_equals_the_block_doubling() {
    for (dims, scale) in [([2, 3, 5, 8], 0.3), ([1, 2, 3, 64], 0.05), ([1, 1, 65_600, 4], 0.3)] {
        let (lower, plan) = chunk_solve_inputs::<Vk>(dims, scale, &Default::default());
        let fused = values(Vk::unit_lower_inverse(lower.clone(), &plan));
        let doubling = values(unit_lower_inverse(lower, &plan));
        let (lower, plan) = chunk_solve_inputs::<VkUnfused>(dims, scale, &Default::default());
        let unfused = values(VkUnfused::unit_lower_inverse(lower, &plan));
        let (lower, plan) = chunk_solve_inputs::<Cpu>(dims, scale, &Default::default());
        let cpu = values(unit_lower_inverse(lower, &plan));
        let size = cpu.iter().fold(1.0f32, |m, x| m.max(x.abs()));
        let errors = [max_abs_diff(&fused, &doubling), max_abs_diff(&fused, &cpu), max_abs_diff(&unfused, &cpu)];
        let [a, b, c] = errors;
        eprintln!(
            "{dims:?}: {a:.2e}, {b:.2e}, {c:.2e} (fused vs device doubling, vs CPU; unfused vs CPU; largest {size:.2})"
        );
        assert!(errors.iter().all(|&e| e <= 1e-5 * size), "{dims:?}: off by {errors:?} (largest entry {size})");
    }
}

/// What the chunked backward's decay gradients read, `[b, h, n, c, ·]` with entries in ±1 (the pairs, the
/// decays' gradient, the chunk decays' gradient) or in (0, 1] (the decays), and the plan the tensor ops take.
fn decay_grad_inputs<B: ModelBackend>(
    [b, h, n, c, dk, dv]: [usize; 6],
    device: &B::Device,
) -> (DecayGradInputs<B>, ChunkPlan<B>) {
    let tensor = |seed, shape: [usize; 5], low: f32| {
        let count = shape.iter().product();
        kiln::backend::host_tensor::<B, 1>(spread(count, seed, low, 1.0), [count], FloatDType::F32, device)
            .reshape(shape)
    };
    let keys = |seed| tensor(seed, [b, h, n, c, dk], -1.0);
    let decays = |seed| tensor(seed, [b, h, n, c, 1], 0.05).reshape([b, h, n, c]);
    let segments = DocSegments::from_doc_ids(b, n * c, vec![0; b * n * c]);
    let inputs = DecayGradInputs {
        d_k_decayed: keys(11),
        k: keys(12),
        d_q_decayed: keys(13),
        q: keys(14),
        neg_d_keys_from_start: keys(15),
        k_beta: keys(16),
        d_k_beta: keys(17),
        d_v_beta: tensor(18, [b, h, n, c, dv], -1.0),
        v: tensor(19, [b, h, n, c, dv], -1.0),
        d_gap: tensor(20, [b, h, n, c, c], -1.0),
        to_end: decays(21),
        from_start: decays(22),
        d_chunk_decay: tensor(23, [b, h, n, 1, 1], -1.0).reshape([b, h, n, 1]),
    };
    (inputs, ChunkPlan::new(&segments, c, device))
}

/// kiln's decay-gradient kernel (`kernels::decay_grads`) against the tensor ops it replaces, on the fused and
/// unfused device backends and on the CPU: a small chunk with key and value widths that differ, the model's
/// chunk of 64, and more chunks than a grid row holds (65,600: the grid wraps).
#[test]
fn the_decay_grads_kernel_equals_the_tensor_ops() {
    for dims in [[2, 3, 5, 8, 16, 12], [1, 2, 3, 64, 32, 40], [1, 1, 65_600, 4, 2, 3]] {
        let (inputs, plan) = decay_grad_inputs::<Vk>(dims, &Default::default());
        let [fused_g, fused_beta] = Vk::delta_rule_decay_grads(inputs, &plan).map(values);
        let (inputs, plan) = decay_grad_inputs::<VkUnfused>(dims, &Default::default());
        let [unfused_g, unfused_beta] = VkUnfused::delta_rule_decay_grads(inputs, &plan).map(values);
        let (inputs, plan) = decay_grad_inputs::<Vk>(dims, &Default::default());
        let [ops_g, ops_beta] = decay_grads(inputs, &plan).map(values);
        let (inputs, plan) = decay_grad_inputs::<Cpu>(dims, &Default::default());
        let [cpu_g, cpu_beta] = decay_grads(inputs, &plan).map(values);
        let parts =
            [("d g", fused_g, unfused_g, ops_g, cpu_g), ("d beta", fused_beta, unfused_beta, ops_beta, cpu_beta)];
        for (name, fused, unfused, ops, cpu) in parts {
            let scale = cpu.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let errors = [max_abs_diff(&fused, &ops), max_abs_diff(&fused, &cpu), max_abs_diff(&unfused, &cpu)];
            let [a, b, c] = errors;
            eprintln!(
                "{dims:?} {name}: {a:.2e}, {b:.2e}, {c:.2e} (fused vs the device's tensor ops, vs CPU; unfused vs CPU; largest {scale:.1})"
            );
            assert!(errors.iter().all(|&e| e <= 1e-5 * scale), "{dims:?} {name}: off by {errors:?} (largest {scale})");
        }
    }
}

/// kiln's RMSNorm kernels (`kernels::norm`) against the tensor ops they replace, on the fused and unfused
/// device backends and on the CPU, in both forms: a q/k norm's width, a width that is not a power of two
/// with a row count that leaves the last block of the backward pass part-filled, a hidden width, and more
/// rows than a grid row holds (70,000: the grid wraps).
#[test]
fn the_norm_kernels_equal_the_tensor_op_norms() {
    for dims in [[3, 5, 64], [2, 9, 96], [1, 40, 1024], [1, 70_000, 8]] {
        for kind in [NormKind::Plain, NormKind::ZeroCentered, NormKind::ScaledInF32] {
            let f32 = [FloatDType::F32; 2];
            let fused = norm_parts::<Vk>(dims, kind, f32);
            let unfused = norm_parts::<VkUnfused>(dims, kind, f32);
            let device_ops = norm_parts_by_tensor_ops::<Vk>(dims, kind, f32);
            let cpu = norm_parts_by_tensor_ops::<Cpu>(dims, kind, f32);
            // The weight gradient sums a column over every row, in another order on each side.
            parity::assert_kernel_results(
                &format!("{dims:?} {kind:?}"),
                ["output", "d x", "d weight"],
                &kernel_comparisons(&fused, &unfused, &device_ops, &cpu),
                [2e-6, 2e-6, 1e-5],
            );
        }
    }
}

/// kiln's L2-norm kernels (`kernels::norm`, Qwen3.5's DeltaNet q and k) against the tensor ops they replace,
/// on the fused and unfused device backends and on the CPU: a key head's width, a narrow width with idle
/// units, a width that is not a power of two, and more rows than a grid row holds.
#[test]
fn the_l2_norm_kernels_equal_the_tensor_op_norms() {
    for dims in [[3, 5, 128], [2, 9, 16], [1, 7, 96], [1, 70_000, 8]] {
        let f32 = FloatDType::F32;
        let fused = l2_parts::<Vk>(dims, f32);
        let unfused = l2_parts::<VkUnfused>(dims, f32);
        let device_ops = l2_parts_by_tensor_ops::<Vk>(dims, f32);
        let cpu = l2_parts_by_tensor_ops::<Cpu>(dims, f32);
        parity::assert_kernel_results(
            &format!("{dims:?} L2"),
            ["output", "d x"],
            &kernel_comparisons(&fused, &unfused, &device_ops, &cpu),
            [2e-6, 2e-6],
        );
    }
}

/// kiln's causal-conv kernels (`kernels::conv`) against the tensor ops they replace, on the fused and
/// unfused device backends and on the CPU (`common::convs::conv_cases`: 3 and 4 taps, packed rows with
/// padding, part-filled and several cubes of channels, several backward blocks).
#[test]
fn the_conv_kernels_equal_the_tensor_op_conv() {
    for case in common::convs::conv_cases() {
        let f32 = FloatDType::F32;
        let fused = conv_parts::<Vk>(&case, f32);
        let unfused = conv_parts::<VkUnfused>(&case, f32);
        let device_ops = conv_parts_by_tensor_ops::<Vk>(&case, f32);
        let cpu = conv_parts_by_tensor_ops::<Cpu>(&case, f32);
        // The kernel gradient sums a column over every token, in another order on each side.
        parity::assert_kernel_results(
            &format!("{case:?}"),
            ["output", "d x", "d kernel"],
            &kernel_comparisons(&fused, &unfused, &device_ops, &cpu),
            [1e-6, 1e-6, 1e-5],
        );
    }
}

/// The gated conv kernels (LFM2's `C ⊙ conv(B ⊙ x)` read from the projection, its whole gradient written
/// at once) against the split, products and tensor-op conv they replace, on the same cases.
#[test]
fn the_gated_conv_kernels_equal_the_tensor_ops() {
    for case in common::convs::conv_cases() {
        let f32 = FloatDType::F32;
        let fused = gated_conv_parts::<Vk>(&case, f32);
        let unfused = gated_conv_parts::<VkUnfused>(&case, f32);
        let device_ops = gated_conv_parts_by_tensor_ops::<Vk>(&case, f32);
        let cpu = gated_conv_parts_by_tensor_ops::<Cpu>(&case, f32);
        // The kernels round once where the tensor ops round B ⊙ x and the conv's output: equal in f32 but for
        // the order of a product of three and of the kernel gradient's sum.
        parity::assert_kernel_results(
            &format!("gated {case:?}"),
            ["output", "d projection", "d kernel"],
            &kernel_comparisons(&fused, &unfused, &device_ops, &cpu),
            [1e-6, 1e-6, 1e-5],
        );
    }
}

/// What a kernel test compares: the fused kernels with the tensor ops on the device and on the CPU, and the
/// unfused kernels with the CPU's.
fn kernel_comparisons<'a, const N: usize>(
    fused: &'a KernelResults<N>,
    unfused: &'a KernelResults<N>,
    device_ops: &'a KernelResults<N>,
    cpu: &'a KernelResults<N>,
) -> [KernelComparison<'a, N>; 3] {
    [("fused vs device ops", fused, device_ops), ("fused vs CPU", fused, cpu), ("unfused vs CPU", unfused, cpu)]
}

/// kiln's gradient-norm kernel (`kernels::grad_norm`, what the trainer's clipping runs on the device) against
/// the tensor ops it replaces and an f64 sum, on the fused and unfused device backends: tensors of every rank,
/// a transposed and a narrowed one, one over several cubes, and more than one launch takes.
#[test]
fn the_squared_norm_kernel_equals_the_tensor_op_sums() {
    common::optimizer_ops::assert_squared_norm_matches::<Vk>(&[FloatDType::F32]);
    common::optimizer_ops::assert_squared_norm_matches::<VkUnfused>(&[FloatDType::F32]);
}

/// kiln's AdamW kernel (`kernels::adamw`, the trainer's update on the device) against the CPU's tensor ops:
/// three steps (two clipped) of parameters of ranks 1 to 3 (one gradient a transposed view, more parameters than
/// one launch takes), with f32 moments and with 8-bit ones (the large parameter's by tensor ops, the rest by
/// the kernel), fused and unfused. lavapipe has no bf16, so bf16 moments wait for CUDA.
#[test]
fn the_adamw_kernel_steps_as_the_cpu_tensor_ops() {
    use kiln::train::optim::MomentDtype;
    for moments in [MomentDtype::F32, MomentDtype::Q8] {
        let masters = kiln::train::optim::Masters::F32;
        common::optimizer_ops::assert_adamw_matches_the_cpu::<VkTrain>(FloatDType::F32, moments, masters, 1e-6);
        common::optimizer_ops::assert_adamw_matches_the_cpu::<burn::backend::Autodiff<VkUnfused>>(
            FloatDType::F32,
            moments,
            masters,
            1e-6,
        );
    }
}

/// One attention chunk's inputs for the softmax-row kernels: unscaled scores and `dP`
/// `[batch, kv_heads, len · group, keys]` in `dtype`, and the whole sequence's log-sum-exp and `δ`
/// `[batch, kv_heads, seq · group, 1]` in f32.
fn chunk_rows_inputs<B: ModelBackend>(
    [batch, kv_heads, group]: [usize; 3],
    seq: usize,
    rows: ChunkRows,
    dtype: FloatDType,
    device: &B::Device,
) -> [Tensor<B, 4>; 4] {
    let (len, keys) = (rows.len, rows.keys());
    let tensor = |seed, shape: [usize; 4], lo, hi, dtype| {
        let values = spread(shape.iter().product(), seed, lo, hi);
        kiln::backend::host_tensor::<B, 1>(values, [shape.iter().product()], dtype, device).reshape(shape)
    };
    let scores = tensor(11, [batch, kv_heads, len * group, keys], -6.0, 6.0, dtype);
    let grad_probs = tensor(12, [batch, kv_heads, len * group, keys], -1.0, 1.0, dtype);
    // A log-sum-exp at or above each row's largest scaled score, as the forward pass leaves it.
    let lse = tensor(13, [batch, kv_heads, seq * group, 1], 1.0, 3.0, FloatDType::F32) + 6.0 * rows.scale;
    let delta = tensor(14, [batch, kv_heads, seq * group, 1], -0.5, 0.5, FloatDType::F32);
    [scores, grad_probs, lse, delta]
}

/// kiln's attention kernels (`kernels::attention`, what `attention_probs` and `attention_score_grads`
/// run on the device) against the tensor ops they replace, in f32 and f16: packed documents with padding,
/// chunks that start mid-sequence and skip keys before `first`, rows longer than a cube's units, more
/// rows than one grid dimension holds (they wrap onto a second), and sliding windows (Gemma 4) shorter than
/// the documents.
#[test]
fn the_attention_kernels_equal_the_tensor_op_softmax_rows() {
    // Document lengths per batch row, sequence, [batch, kv heads, group], the chunk.
    type Case<'a> = (&'a [Vec<u32>], usize, [usize; 3], ChunkRows);
    // Each case's group is its third head count (set below).
    let chunk = |start, len, first, window, scale| ChunkRows { start, len, group: 1, first, window, scale };
    let cases: [Case; 7] = [
        (&[vec![3, 5, 2], vec![9, 3]], 12, [2, 2, 2], chunk(0, 12, 0, None, 0.35)),
        (&[vec![3, 5, 2], vec![9, 3]], 12, [2, 2, 2], chunk(9, 3, 8, None, 0.35)),
        (&[vec![150, 200]], 350, [1, 2, 3], chunk(200, 150, 150, None, 0.125)),
        (&[vec![40, 30]], 70, [1, 1, 1024], chunk(0, 70, 0, None, 0.25)),
        (&[vec![3, 5, 2], vec![9, 3]], 12, [2, 2, 2], chunk(0, 12, 0, Some(3), 1.0)),
        (&[vec![3, 5, 2], vec![9, 3]], 12, [2, 2, 2], chunk(6, 6, 4, Some(3), 1.0)),
        (&[vec![150, 200]], 350, [1, 2, 3], chunk(200, 150, 150, Some(130), 0.5)),
    ];
    let device = Default::default();
    for (docs, seq, heads, rows) in cases {
        let rows = ChunkRows { group: heads[2], ..rows };
        let layout = SequenceLayout::from_doc_lengths(docs, seq);
        for dtype in [FloatDType::F32, FloatDType::F16] {
            // f16 results are rounded to f16 (2⁻¹¹ relative) on both sides, at different points.
            let tolerance = if dtype == FloatDType::F32 { 2e-6 } else { 2e-3 };
            let attention = DocumentAttention::<Vk>::new(&layout, &device);
            let attention = match rows.window {
                Some(window) => attention.with_window(window).with_scale(rows.scale),
                None => attention,
            };
            let [scores, grad_probs, lse, delta] = chunk_rows_inputs::<Vk>(heads, seq, rows, dtype, &device);
            // The forward writes the chunk's rows of the whole sequence's log-sum-exp (here the backward's, still
            // held, so the kernel writes a copy); the rest of it stays as it was.
            let lse_before = values(lse.clone());
            let kernel = attention_kernel::attention_probs(scores.clone(), lse.clone(), &attention, rows);
            let [probs, log_sum] = softmax_rows_into(scores.clone(), lse.clone(), &attention, rows);
            assert_eq!(values(lse.clone()), lse_before, "{heads:?} {rows:?}: the log-sum-exp held elsewhere");
            let inputs = [scores.clone(), grad_probs.clone(), lse.clone(), delta.clone()];
            let kernel_grads = attention_kernel::attention_score_grads(inputs, &attention, rows);
            let [grad_p, grad_s] = score_grads(scores, grad_probs, lse, delta, &attention, rows);
            let [kernel_probs, kernel_lse] = kernel;
            let [kernel_grad_p, kernel_grad_s] = kernel_grads;
            let parts = [
                ("probs", kernel_probs, probs),
                ("lse", kernel_lse, log_sum),
                ("backward probs", kernel_grad_p, grad_p),
                ("score grads", kernel_grad_s, grad_s),
            ];
            for (name, kernel, ops) in parts {
                let (kernel, ops) = (values(kernel), values(ops));
                let scale = ops.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
                let err = max_abs_diff(&kernel, &ops);
                eprintln!("{heads:?} {rows:?} {dtype:?} {name}: {err:.2e} (scale {scale:.2})");
                assert!(err <= tolerance * scale, "{heads:?} {rows:?} {dtype:?} {name}: off by {err}");
            }
        }
    }
}

/// The key and value gradients' sums over the attention's chunks, kiln's kernel (one launch for both, in place)
/// against the tensor ops on the same device (a slice, an addition and a slice write each), fused and unfused,
/// with parts in f32 and f16; a whole still held elsewhere is copied, not written.
fn add_key_grads_on<B: ModelBackend + attention_kernel::AttentionRowKernels>(part_dtype: FloatDType) {
    let device = Default::default();
    let (batch, kv_heads, seq, d) = (2, 3, 70, 16);
    let tensor = |dims: [usize; 4], seed: u64| {
        let data = burn::tensor::TensorData::new(spread(dims.iter().product(), seed, -2.0, 2.0), dims);
        Tensor::<B, 4>::from_data(data, &device)
    };
    for (first, keys) in [(0, 70), (5, 40), (69, 1), (30, 33)] {
        let wholes = || [tensor([batch, kv_heads, seq, d], 1), tensor([batch, kv_heads, seq, d], 2)];
        let parts = [3, 4].map(|seed| tensor([batch, kv_heads, keys, d], seed).cast(part_dtype));
        let expected = kiln::models::attention::add_key_grads(wholes(), parts.clone(), first).map(values);
        // Wholes held nowhere else (written in place), and wholes still held (copied first).
        let in_place = attention_kernel::attention_add_key_grads(wholes(), parts.clone(), first).map(values);
        let kept = wholes();
        let before = kept.clone().map(values);
        let copied = attention_kernel::attention_add_key_grads(kept.clone(), parts, first).map(values);
        for (how, kernel) in [("in place", in_place), ("copied", copied)] {
            for (name, (got, want)) in ["dk", "dv"].iter().zip(kernel.iter().zip(&expected)) {
                let err = max_abs_diff(got, want);
                eprintln!("{part_dtype:?} {first} {how} {name} {err:e}");
                assert!(err <= 1e-6, "{part_dtype:?}, keys {first}..{}, {how}: {name} off by {err}", first + keys);
            }
        }
        assert_eq!(kept.map(values), before, "a whole held elsewhere is left as it was");
    }
}

#[test]
fn the_key_grads_kernel_adds_the_chunks_as_the_tensor_ops() {
    for dtype in [FloatDType::F32, FloatDType::F16] {
        add_key_grads_on::<Vk>(dtype);
        add_key_grads_on::<VkUnfused>(dtype);
    }
}

/// kiln's cross-entropy kernel (`kernels::cross_entropy`, what `CrossEntropyRows` runs on the device), and
/// the tensor ops it replaces run on the device (`KILN_LOSS_KERNEL=off`), against those tensor ops on the
/// CPU in f32, in f32 and f16, with and without the gradient: a tiny vocabulary, rows longer than a cube's
/// units, more rows than one grid dimension holds, fractional and zero coefficients. The device's tensor
/// ops were wrong here once: burn-fusion read a gathered tensor before writing it (`linear_ce`).
#[test]
fn the_cross_entropy_kernel_equals_the_tensor_op_rows() {
    let device = Default::default();
    let cpu = Default::default();
    for (rows, vocab) in [(3, 37), (5, 64), (5, 1000), (70_000, 5)] {
        let logit_values = spread(rows * vocab, 21, -8.0, 8.0);
        let ids: Vec<i64> = (0..rows).map(|i| (i * 7 % vocab) as i64).collect();
        let coef: Vec<f32> = (0..rows).map(|i| [0.25, 0.0, 1.5][i % 3]).collect();
        for dtype in [FloatDType::F32, FloatDType::F16] {
            // f16 gradients are rounded to f16 (2⁻¹¹ relative); the reference reads the same rounded logits.
            let tolerance = if dtype == FloatDType::F32 { 2e-6 } else { 2e-3 };
            let logits = kiln::backend::host_tensor::<Vk, 2>(logit_values.clone(), [rows, vocab], dtype, &device);
            let rounded = values(logits.clone());
            let reference_logits = kiln::backend::host_tensor::<Cpu, 2>(rounded, [rows, vocab], FloatDType::F32, &cpu);
            let reference_coef = kiln::backend::host_tensor::<Cpu, 2>(coef.clone(), [rows, 1], FloatDType::F32, &cpu);
            let reference_targets = ids_tensor::<Cpu>(&ids, [rows, 1], &cpu);
            let (reference_nll, reference_grads) =
                cross_entropy_rows(reference_logits, reference_targets, reference_coef, true);
            let reference = [values(reference_nll), values(reference_grads.expect("asked for the gradient"))];
            for with_grads in [true, false] {
                let targets = ids_tensor::<Vk>(&ids, [rows, 1], &device);
                let coef = kiln::backend::host_tensor::<Vk, 2>(coef.clone(), [rows, 1], FloatDType::F32, &device);
                let args = (logits.clone(), targets, coef);
                let kernel = kernel_cross_entropy::cross_entropy_rows(
                    args.0.clone(),
                    args.1.clone(),
                    args.2.clone(),
                    with_grads,
                );
                let ops = cross_entropy_rows(args.0, args.1, args.2, with_grads);
                let mut parts = Vec::new();
                for (path, (nll, grads)) in [("kernel", kernel), ("device tensor ops", ops)] {
                    assert_eq!(grads.is_some(), with_grads);
                    parts.push((path, "nll", values(nll), &reference[0]));
                    parts.extend(grads.map(|g| (path, "dlogits", values(g), &reference[1])));
                }
                for (path, name, kernel, reference) in parts {
                    let scale = reference.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
                    let err = max_abs_diff(&kernel, reference);
                    eprintln!("{rows} × {vocab} {dtype:?} {path} {name}: {err:.2e} (scale {scale:.2})");
                    assert!(err <= tolerance * scale, "{rows} × {vocab} {dtype:?} {path} {name}: off by {err}");
                }
            }
        }
    }
}

/// What gpu_session.sh takes on the GPU, end to end: bench-train under CubeCL's profiler and the kernel
/// table kernel_profile.py makes of its log, beside an unprofiled run of the same step (the table's row).
#[test]
fn the_kernel_profile_tabulates_a_training_step() {
    let dir = tempfile::tempdir().unwrap();
    let root = common::project_dir();
    let config = root.join("configs/models/tiny/config.json");
    let unprofiled = dir.path().join("tiny-kiln.json");
    let (ok, _, stderr) = common::run_kiln(
        &[
            "--quiet",
            "bench-train",
            "--config",
            config.to_str().unwrap(),
            "--device",
            "vulkan",
            "--seq",
            "64",
            "--steps",
            "2",
            "--warmup",
            "2",
            "--out",
            unprofiled.to_str().unwrap(),
        ],
        &[],
        &root,
    );
    assert!(ok, "{stderr}");
    let prefix = dir.path().join("profile-tiny");
    let out = std::process::Command::new(root.join("tests/bench/kernel_profile.sh"))
        .args([config, prefix.clone()])
        .envs([("KILN", common::kiln_bin().as_os_str()), ("DEVICE", "vulkan".as_ref()), ("SEQ", "64".as_ref())])
        .env("BENCH", &unprofiled)
        .current_dir(&root)
        .output()
        .unwrap();
    let stdout = std::fs::read_to_string(prefix.with_extension("stdout")).unwrap_or_default();
    assert!(out.status.success(), "{}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let table = std::fs::read_to_string(prefix.with_extension("md")).unwrap();
    eprintln!("{table}");
    let kernel_rows = table.lines().filter(|l| l.starts_with("| `")).count();
    assert!(kernel_rows >= 10, "{kernel_rows} kernel rows in the profile:\n{table}");
    assert!(table.contains("| `Matmul"), "no matmul kernel in the profile:\n{table}");
    let busy = table.lines().find(|l| l.starts_with("The unprofiled step (lfm2, f32, median of 2) takes "));
    assert!(busy.is_some_and(|l| l.contains("ms: the kernels fill ")), "no busy share:\n{table}");
    let result: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(prefix.with_extension("json")).unwrap()).unwrap();
    assert_eq!(result["device"], "vulkan");
    assert!(prefix.with_extension("log.gz").exists());
}

/// The compiled-kernel cache kiln gives CubeCL (`kiln::kernel_cache`): a training step's kernels land in the
/// folder `KILN_KERNEL_CACHE` names, a second process loads every one of them instead of compiling any, and a
/// cubecl.toml in the working folder takes over from kiln.
#[test]
fn a_second_process_loads_its_kernels_from_the_cache() {
    if let Err(why) = kiln::backend::vulkan_ready(false) {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("kernels");
    let config = common::project_dir().join("configs/models/tiny/config.json");
    let env = [("KILN_KERNEL_CACHE", cache.to_str().unwrap())];
    // What `kiln info` says of the cache, run in the test's folder.
    let kernel_cache = |env: &[(&str, &str)]| {
        let (ok, stdout, stderr) = common::run_kiln(&["info"], env, dir.path());
        assert!(ok, "{stderr}");
        let info: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        info["kernel_cache"].as_str().unwrap().to_string()
    };
    let said = kernel_cache(&env);
    let folder = PathBuf::from(&said);
    assert!(folder.starts_with(&cache), "{said}");
    // The table of contents of the SPIR-V kernels: a line a kernel compiled.
    let entries = || {
        let toc = folder.join("vulkan").read_dir().ok().and_then(|mut versions| versions.next());
        let toc = toc.map(|v| v.unwrap().path().join("spirv/toc.json.log"));
        toc.and_then(|toc| std::fs::read_to_string(toc).ok()).map_or(0, |text| text.lines().count())
    };
    let out = dir.path().join("step.json");
    let args = ["--quiet", "bench-train", "--config", config.to_str().unwrap(), "--device", "vulkan", "--seq", "32"];
    let args = [&args[..], &["--steps", "1", "--warmup", "0", "--out", out.to_str().unwrap()]].concat();
    let (ok, _, stderr) = common::run_kiln(&args, &env, dir.path());
    assert!(ok, "{stderr}");
    let compiled = entries();
    assert!(compiled >= 20, "{compiled} kernels in the cache after a training step");
    let (ok, _, stderr) = common::run_kiln(&args, &env, dir.path());
    assert!(ok, "{stderr}");
    assert_eq!(entries(), compiled, "the second process compiled kernels the first had cached");

    // A folder that cannot be made leaves CubeCL's defaults, and the command runs.
    let blocked = dir.path().join("step.json/kernels");
    let said = kernel_cache(&[("KILN_KERNEL_CACHE", blocked.to_str().unwrap())]);
    assert!(said.starts_with("off (cannot make "), "{said}");

    std::fs::write(dir.path().join("cubecl.toml"), "[autotune]\nlevel = \"minimal\"\n").unwrap();
    let said = kernel_cache(&env);
    assert!(said.contains("cubecl.toml says"), "{said}");
}

/// The MoE's experts batched into one matmul over padded groups (`models::experts`, what the CubeCL backends
/// run) against a matmul per expert on the CPU, fused and unfused: outputs and both gradients, with short
/// groups padded, long groups split into overflow matmuls (their weight gradients added into the batch's
/// with `slice_assign`), and an expert without rows.
#[test]
fn the_batched_experts_equal_a_matmul_per_expert_on_the_device() {
    use kiln::models::experts::{ExpertBatch, batched_backward, batched_forward};
    use kiln::models::experts::{grouped_matmul_backward, grouped_matmul_forward};

    fn tensor<B: burn::tensor::backend::Backend, const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
        let len = shape.iter().product();
        kiln::backend::host_tensor::<B, 1>(spread(len, seed, -1.0, 1.0), [len], FloatDType::F32, &Default::default())
            .reshape(shape)
    }
    fn batched<B: kiln::models::ops::ModelBackend>(
        counts: &[usize],
        capacity: usize,
        dims: [usize; 2],
    ) -> Vec<Vec<f32>> {
        let n = counts.iter().sum();
        let [width, out] = dims;
        let (x, weights, grad) =
            (tensor::<B, 2>([n, width], 1), tensor([counts.len(), width, out], 2), tensor([n, out], 3));
        let batch = ExpertBatch::with_capacity(counts, capacity);
        let (grad_x, grad_w) = batched_backward(x.clone(), weights.clone(), &batch, grad);
        vec![values(batched_forward(x, weights, &batch)), values(grad_x), values(grad_w)]
    }

    let counts = [9usize, 0, 33, 4, 17, 1];
    let dims = [40, 24];
    let n = counts.iter().sum();
    let (x, weights, grad) =
        (tensor::<Cpu, 2>([n, dims[0]], 1), tensor([counts.len(), dims[0], dims[1]], 2), tensor([n, dims[1]], 3));
    let (grad_x, grad_w) = grouped_matmul_backward(x.clone(), weights.clone(), &counts, grad);
    let want = [values(grouped_matmul_forward(x, weights, &counts)), values(grad_x), values(grad_w)];
    for capacity in [16, 48] {
        for (backend, got) in [
            ("fused", batched::<Vk>(&counts, capacity, dims)),
            ("unfused", batched::<VkUnfused>(&counts, capacity, dims)),
        ] {
            for ((name, want), got) in ["output", "d x", "d weights"].iter().zip(&want).zip(&got) {
                let diff = max_abs_diff(got, want);
                assert!(diff < 1e-4, "{backend}, capacity {capacity}: {name} differs by {diff}");
            }
        }
    }
}

/// Activation checkpointing on the fused backend: a layer's activations are dropped after the forward pass
/// and recomputed from the layer's input when its backward pass runs. The tiny LFM2 with a 4,096-wide MLP
/// (whose gate, up and gated product are most of a layer's activations) at sequence 512, each run in its own
/// process (the allocator's pools are the process's): the peak the allocator reserves drops, the losses stay.
#[test]
fn activation_checkpointing_recomputes_the_layers_and_lowers_the_peak() {
    let dir = tempfile::tempdir().unwrap();
    let root = common::project_dir();
    let tiny = root.join("tests/fixtures/lfm2/lfm2-tiny/config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tiny).unwrap()).unwrap();
    config["intermediate_size"] = 4096.into();
    config["block_auto_adjust_ff_dim"] = false.into();
    let config_path = dir.path().join("config.json");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let run = |name: &str, more: &[&str]| {
        let out = dir.path().join(format!("{name}.json"));
        let args = ["--quiet", "bench-train", "--config", config_path.to_str().unwrap(), "--device", "vulkan"];
        let step = ["--seq", "512", "--steps", "1", "--warmup", "1", "--out", out.to_str().unwrap()];
        let (ok, _, stderr) = common::run_kiln(&[&args[..], &step[..], more].concat(), &[], &root);
        assert!(ok, "{name}: {stderr}");
        let result: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(result["activation_checkpointing"], !more.is_empty(), "{name}: {result}");
        (result["peak_memory_bytes"].as_u64().expect("a peak on the device"), result["losses"].clone())
    };
    let (plain_peak, plain_losses) = run("plain", &[]);
    let (recomputed_peak, recomputed_losses) = run("checkpointed", &["--activation-checkpointing"]);
    eprintln!("peak reserved: {plain_peak} B without, {recomputed_peak} B with activation checkpointing");
    // The recomputed outputs are the forward pass's to the bit; what fusion makes of a graph whose tensors the
    // checkpointer holds may order a sum differently (one f32 step seen on the LFM2.5-1.2B shape).
    let losses = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect::<Vec<_>>();
    let (plain_losses, recomputed_losses) = (losses(&plain_losses), losses(&recomputed_losses));
    assert_eq!(plain_losses.len(), 2);
    for (a, b) in plain_losses.iter().zip(&recomputed_losses) {
        assert!(
            (a - b).abs() <= 1e-6 * a.abs(),
            "losses {plain_losses:?} without, {recomputed_losses:?} with checkpointing"
        );
    }
    assert!(
        recomputed_peak < plain_peak,
        "activation checkpointing reserved {recomputed_peak} B at its peak, {plain_peak} B without"
    );
}
