//! The training-step benchmark (`kiln bench-train`, run by `make bench` beside
//! `tests/bench/train_python.py`): a seeded random-init model of a config.json shape trained for warmup +
//! timed optimizer steps on seeded random tokens, through the trainer's own `step::optimizer_step`
//! (forward, f32 loss, backward, f32 gradient sum, clipping, AdamW). Reports per-step times, tokens/s, MFU by
//! the trainer's formula and peak memory as JSON with the same fields as the PyTorch script.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::linear_ce::LinearCrossEntropy;
use super::optim::{AdamW, AdamWConfig, Masters, MomentDtype};
use super::step::{MicroBatch, StepRule, WHOLE_ROWS, optimizer_step};
use super::trainer::{PeakMemory, Precision, StepFlops};
use super::{TrainError, with_train_backend};
use crate::backend::DeviceMemory;
use crate::backend::{CublasTally, Kernel, cublas_tally};
use crate::models::ops::reference_ops;
use crate::models::{ModelConfig, random_model, set_reference_ops};
use crate::tokens::shards::Row;

/// What to measure.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchConfig {
    /// Tokens per row.
    pub seq: usize,
    /// Rows per forward pass.
    pub micro_batch: usize,
    /// Forward passes per optimizer step (gradient accumulation).
    pub accumulation: usize,
    /// Timed optimizer steps.
    pub steps: usize,
    /// Untimed steps first (kernel compilation, autotuning, allocator growth).
    pub warmup: usize,
    /// Documents packed per row (1: one causal document per row, as the PyTorch reference).
    pub docs_per_row: usize,
    pub seed: u64,
    pub lr: f64,
    /// The accelerator's dense bf16 peak in TFLOP/s, for MFU.
    pub peak_tflops: Option<f64>,
    pub activation_checkpointing: bool,
    pub precision: Precision,
    /// The dtype AdamW keeps its moments in (bf16 for the 8B model on one GPU).
    pub moments: MomentDtype,
    /// Whether bf16 parameters keep f32 masters or take their update by stochastic rounding.
    #[serde(default)]
    pub masters: Masters,
    /// burn's plain compositions instead of the hand-written ops (`models::set_reference_ops`).
    #[serde(default)]
    pub reference_ops: bool,
}

/// What a benchmark row ran: the model, the device and every switch that changes the step, known before
/// it starts. The PyTorch script writes the same fields (without the kiln-only ones).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchRun {
    pub framework: String,
    pub model_type: String,
    pub device: String,
    pub precision: String,
    pub seq: usize,
    pub micro_batch: usize,
    pub accumulation: usize,
    pub docs_per_row: usize,
    /// Whether burn's plain compositions ran instead of kiln's hand-written ops (kiln only).
    #[serde(default)]
    pub reference_ops: bool,
    /// Whether burn's fusion ran (kiln on CUDA only: `KILN_CUDA_FUSION`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fusion: Option<bool>,
    /// Whether the build has burn's autotune (kiln on CUDA only: the `autotune` feature): each matmul and
    /// fused reduction timed among its candidate kernels, rather than cubek's default kernel for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autotune: Option<bool>,
    /// Which kernels ran the matrix products (kiln on CUDA only: `KILN_MATMUL`, burn's `cubecl` or `cublas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matmul: Option<String>,
    /// How AdamW kept its moments (kiln only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moments: Option<MomentDtype>,
    /// Whether bf16 parameters kept f32 masters (kiln only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masters: Option<Masters>,
    /// Whether activations were recomputed in the backward pass (burn's activation checkpointing for kiln,
    /// transformers' gradient checkpointing for PyTorch rows).
    #[serde(default)]
    pub activation_checkpointing: bool,
    /// The MiB of f32 scores a chunk of the attention's queries may hold (kiln only:
    /// `KILN_ATTENTION_CHUNK_MIB`). Absent in results older than the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_chunk_mib: Option<usize>,
    /// Whether the DeltaNet scan ran as kiln's kernel (kiln on a CubeCL device only: `KILN_SCAN_KERNEL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scan_kernel: Option<bool>,
    /// Whether the attention's softmax rows ran as kiln's kernels (kiln on a CubeCL device only:
    /// `KILN_ATTENTION_KERNEL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_kernel: Option<bool>,
    /// Whether the cross-entropy's rows ran as kiln's kernel (kiln on a CubeCL device only:
    /// `KILN_LOSS_KERNEL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_kernel: Option<bool>,
    /// Whether the RMSNorms and L2 norms ran as kiln's kernels (kiln on a CubeCL device only: `KILN_NORM_KERNEL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_kernel: Option<bool>,
    /// Whether the causal conv ran as kiln's kernels (kiln on a CubeCL device only: `KILN_CONV_KERNEL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv_kernel: Option<bool>,
    /// Whether the optimizer (the gradients' norm, AdamW's update) ran as kiln's kernels (kiln on a CubeCL
    /// device only: `KILN_OPTIM_KERNEL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optim_kernel: Option<bool>,
    /// Whether the MoE's experts ran as one batched matmul over padded groups (kiln on a CubeCL device, a
    /// model with experts: `KILN_EXPERTS_BATCHED`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts_batched: Option<bool>,
}

impl BenchRun {
    /// What `bench_on_device(config, cfg, device)` runs (the process's switches as they are now).
    pub fn of(config: &ModelConfig, cfg: &BenchConfig, device: &str) -> Self {
        let cubecl = device != "cpu";
        let kernels = crate::backend::kernels_by_default(device);
        let enabled = |kernel: Kernel| cubecl.then(|| kernel.enabled(kernels));
        BenchRun {
            framework: "kiln".into(),
            model_type: config.model_type().into(),
            device: device.into(),
            precision: format!("{:?}", cfg.precision.resolve(device)).to_lowercase(),
            seq: cfg.seq,
            micro_batch: cfg.micro_batch,
            accumulation: cfg.accumulation,
            docs_per_row: cfg.docs_per_row,
            reference_ops: cfg.reference_ops,
            fusion: (device == "cuda").then(|| crate::backend::cuda_fusion().unwrap_or(true)),
            autotune: (device == "cuda").then_some(cfg!(feature = "autotune")),
            matmul: (device == "cuda").then(|| crate::backend::matmul_kernels().name().into()),
            moments: Some(cfg.moments),
            masters: Some(cfg.masters),
            activation_checkpointing: cfg.activation_checkpointing,
            attention_chunk_mib: Some(crate::models::attention::chunk_score_bytes() >> 20),
            scan_kernel: enabled(Kernel::Scan),
            attention_kernel: enabled(Kernel::Attention),
            loss_kernel: enabled(Kernel::Loss),
            norm_kernel: enabled(Kernel::Norm),
            conv_kernel: enabled(Kernel::Conv),
            optim_kernel: enabled(Kernel::Optim),
            experts_batched: (cubecl && matches!(config, ModelConfig::Lfm2(c) if c.moe.is_some()))
                .then(crate::backend::experts_batched_enabled),
        }
    }
}

/// One benchmark run; the PyTorch script writes the same fields.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchResult {
    #[serde(flatten)]
    pub run: BenchRun,
    pub params: u64,
    /// The parameters a token multiplies through, MFU's P (`ModelConfig::flops_share`: an MoE counts its
    /// active experts, lookup-only embedding tables are left out). Absent in results older than the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flops_params: Option<u64>,
    /// Weights, gradients and optimizer state between steps, in bytes (kiln only; `peak_memory_bytes` adds
    /// the activations and the step's temporaries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_memory_bytes: Option<u64>,
    pub tokens_per_step: u64,
    pub warmup: usize,
    /// Wall seconds of each warm-up step: the first holds the kernels' compilation (and with burn's
    /// autotune, the timing of each matmul's candidates). Absent in results older than the field.
    #[serde(default)]
    pub warmup_seconds: Vec<f64>,
    /// Wall seconds of each timed step (the device synchronized at its end).
    pub step_seconds: Vec<f64>,
    pub median_step_seconds: f64,
    pub tokens_per_s: f64,
    pub mfu: Option<f64>,
    /// The most the device allocator reserved (CUDA), or the process's resident peak (CPU).
    pub peak_memory_bytes: Option<u64>,
    /// Loss of every step, warmup included (random tokens: near ln(vocab) at first).
    pub losses: Vec<f64>,
    /// A timed step's cuBLAS products and the host's waits around them (`KILN_MATMUL=cublas`); absent where
    /// no product ran through cuBLAS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cublas: Option<CublasTally>,
}

/// A benchmark row that stopped because the device's memory could not hold it (kiln's check of the
/// weights, gradients and optimizer state before the first step, or a failed device allocation): the answer
/// a fit benchmark asks for, written where the result would have gone (`kiln bench-train --out`; the
/// PyTorch script writes the same on `torch.OutOfMemoryError`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchOutOfMemory {
    #[serde(flatten)]
    pub run: BenchRun,
    /// What ran out, as the check or the device said it.
    pub out_of_memory: String,
}

/// Seeded random rows of `seq` tokens below `vocab`, every target supervised, `docs` equal documents a row.
pub fn random_rows(rows: usize, seq: usize, docs: usize, vocab: usize, seed: u64) -> Vec<Row> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let docs = docs.clamp(1, seq.max(1));
    let base = seq / docs;
    let doc_lengths: Vec<u32> = (0..docs).map(|d| (base + usize::from(d < seq % docs)) as u32).collect();
    (0..rows)
        .map(|r| Row {
            input_ids: (0..seq).map(|_| rng.random_range(0..vocab as u32)).collect(),
            loss_mask: vec![1; seq],
            doc_lengths: doc_lengths.clone(),
            sample_ids: (0..docs).map(|d| format!("random-{r}-{d}")).collect(),
            sources: vec!["random".into(); docs],
        })
        .collect()
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Runs the benchmark on backend `B` (precision already resolved in `cfg`).
pub fn bench_train<B: LinearCrossEntropy + DeviceMemory>(
    config: &ModelConfig,
    cfg: &BenchConfig,
    device_name: &str,
    device: &B::Device,
) -> Result<BenchResult, TrainError> {
    if cfg.seq < 2 || cfg.micro_batch == 0 || cfg.accumulation == 0 || cfg.steps == 0 {
        return Err(TrainError::Config("bench-train needs seq ≥ 2 and micro-batch, accumulation, steps ≥ 1".into()));
    }
    let mut model = random_model::<B>(config, cfg.seed, 0.02, device)?;
    if let Some(dtype) = cfg.precision.dtype() {
        model = model.cast_params(dtype);
    }
    let flops = StepFlops::of(&model, config, cfg.seq);
    let adamw =
        AdamWConfig { weight_decay: 0.01, moments: cfg.moments, masters: cfg.masters, ..AdamWConfig::default() };
    let state_memory_bytes =
        super::optim::state_memory_on_device(&model, &adamw, cfg.accumulation > 1, B::total_bytes(device))
            .map_err(TrainError::OutOfMemory)?
            .total();
    let mut opt = AdamW::<B::InnerBackend>::new(adamw);
    let rows_per_step = cfg.micro_batch * cfg.accumulation;
    let mut peak = PeakMemory::default();
    let (mut warmup_seconds, mut step_seconds, mut losses) = (Vec::new(), Vec::new(), Vec::new());
    let mut tokens_per_step = 0;
    let rule = StepRule { lr: cfg.lr, max_norm: Some(1.0), expert_bias_rate: 0.0 };
    let mut cublas_before_timed = cublas_tally();
    for step in 0..cfg.warmup + cfg.steps {
        if step == cfg.warmup {
            cublas_before_timed = cublas_tally();
        }
        // New tokens every step, made before the clock starts.
        let rows = random_rows(rows_per_step, cfg.seq, cfg.docs_per_row, config.vocab_size(), cfg.seed + step as u64);
        let refs: Vec<&Row> = rows.iter().collect();
        let batches: Vec<MicroBatch> =
            refs.chunks(cfg.micro_batch).map(|rows| MicroBatch::from_rows(rows, WHOLE_ROWS)).collect();
        tokens_per_step = batches.iter().map(|b| b.tokens).sum();
        let started = Instant::now();
        let (updated, outcome) = optimizer_step(model, &mut opt, &batches, rule, device)
            .map_err(|e| TrainError::Config(format!("non-finite loss {} at benchmark step {step}", e.loss)))?;
        model = updated;
        B::sync(device).map_err(|e| TrainError::Device(format!("{e:?}")))?;
        let secs = started.elapsed().as_secs_f64();
        peak.observe::<B>(device);
        losses.push(outcome.map_or(f64::NAN, |o| o.loss));
        if step >= cfg.warmup { step_seconds.push(secs) } else { warmup_seconds.push(secs) }
    }
    let median_step_seconds = median(&step_seconds);
    let tokens = tokens_per_step as f64;
    let cublas = Some(cublas_tally().since(cublas_before_timed)).filter(|t| t.products > 0);
    Ok(BenchResult {
        run: BenchRun::of(config, cfg, device_name),
        params: burn::module::Module::num_params(&model) as u64,
        flops_params: Some(flops.params.round() as u64),
        state_memory_bytes: Some(state_memory_bytes),
        tokens_per_step,
        warmup: cfg.warmup,
        median_step_seconds,
        tokens_per_s: tokens / median_step_seconds,
        mfu: cfg.peak_tflops.map(|p| flops.step_flops(tokens) / (median_step_seconds * p * 1e12)),
        peak_memory_bytes: peak.observe::<B>(device),
        warmup_seconds,
        step_seconds,
        losses,
        cublas: cublas.map(|t| t.per_step(cfg.steps)),
    })
}

/// `bench_train` on the named device with `cfg.precision` resolved for it, and the process-wide
/// reference-ops switch set as `cfg` says for the run (restored after).
pub fn bench_on_device(config: &ModelConfig, cfg: &BenchConfig, device: &str) -> Result<BenchResult, TrainError> {
    let cfg = BenchConfig { precision: cfg.precision.resolve(device), ..cfg.clone() };
    macro_rules! go {
        ($backend:ty) => {
            bench_train::<$backend>(config, &cfg, device, &Default::default())
        };
    }
    let before = reference_ops();
    set_reference_ops(cfg.reference_ops);
    let result = with_train_backend!(device, cfg.precision, cfg.activation_checkpointing, go);
    set_reference_ops(before);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_rows_split_documents_evenly_and_stay_in_the_vocabulary() {
        let rows = random_rows(2, 10, 3, 50, 1);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].doc_lengths, [4, 3, 3]);
        assert!(rows.iter().all(|r| r.input_ids.len() == 10 && r.input_ids.iter().all(|&t| t < 50)));
        assert_ne!(rows[0].input_ids, rows[1].input_ids);
        assert_eq!(random_rows(2, 10, 3, 50, 1)[1].input_ids, rows[1].input_ids);
    }

    #[test]
    fn f16_is_refused_off_the_vulkan_device() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/tiny/config.json");
        let config = ModelConfig::from_file(&dir).unwrap();
        let cfg = BenchConfig {
            seq: 8,
            micro_batch: 1,
            accumulation: 1,
            steps: 1,
            warmup: 0,
            docs_per_row: 1,
            seed: 1,
            lr: 1e-3,
            peak_tflops: None,
            activation_checkpointing: false,
            precision: Precision::F16,
            moments: MomentDtype::F32,
            masters: Masters::F32,
            reference_ops: false,
        };
        for device in ["cpu", "cuda"] {
            let err = bench_on_device(&config, &cfg, device).unwrap_err().to_string();
            assert!(err.contains("--precision f16 is the vulkan device's stand-in for bf16"), "{device}: {err}");
        }
    }

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
