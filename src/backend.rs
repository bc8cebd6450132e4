//! The burn backends kiln computes on: Flex on the CPU (tests, the offline default) and, with the `cuda`
//! feature, burn's CUDA backend in bf16 (or f32). Model and trainer code is generic over the backend
//! (`models::ModelBackend`, `train::linear_ce::LinearCrossEntropy`); this module names the concrete
//! choices (CUDA with burn's fusion, or without it: `KILN_CUDA_FUSION`), reports which ones this build has
//! and what they say of device memory, and makes host values
//! into tensors of an explicit dtype: every device has a default float dtype (f32 on the CPU, bf16 on the
//! CUDA bf16 backend) that burn gives any tensor created without one, so code that names none behaves
//! differently on the GPU (tests/bf16_device.rs runs the CPU with a bf16 default to catch it).

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{Backend, Device as _, DeviceId, DeviceOps};
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};

use crate::models::attention::{
    AttentionForward, DocumentAttention, chunked_attention, chunked_attention_backward, scaled_softmax_attention,
};
use crate::models::deltanet::{self, ChunkPlan, ChunkedScan, ScanInputs};
use crate::models::layers::{RopeTables, apply_rope, apply_rope_backward};
use crate::models::ops::{
    GateActivation, NormKind, add_part_composed, glu_backward, glu_forward, narrow_last, rms_norm_backward,
    rms_norm_forward, write_cache_rows_composed,
};
use crate::models::{ModelBackend, cpu_attention, cpu_deltanet, cpu_elementwise};
use crate::train::linear_ce::CrossEntropyRows;
use crate::train::optim::OptimizerOps;

/// CPU backend: pure-Rust Flex in f32.
pub type Cpu = Flex<f32>;
/// CPU backend with gradients, for training.
pub type CpuTrain = Autodiff<Cpu>;
/// The same with burn's activation checkpointing: memory-bound activations are recomputed in the backward
/// pass instead of kept (burn checkpoints by operation, not by block).
pub type CpuTrainCheckpointed = Autodiff<Cpu, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;

/// GPU backend: burn's CUDA backend in bf16 (NVRTC at run time; no toolkit needed to build).
#[cfg(feature = "cuda")]
pub type Gpu = burn::backend::Cuda<burn::tensor::bf16>;
/// GPU training in bf16 (`precision = "bf16"`, the GPU default): bf16 weights, activations and gradients,
/// f32 master weights and moments in the optimizer; norms, softmax and the loss in f32.
#[cfg(feature = "cuda")]
pub type GpuTrain = Autodiff<Gpu>;
#[cfg(feature = "cuda")]
pub type GpuTrainCheckpointed = Autodiff<Gpu, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;
/// GPU training in f32 throughout (`precision = "f32"`), the reference for the bf16 path.
#[cfg(feature = "cuda")]
pub type GpuTrainF32 = Autodiff<burn::backend::Cuda<f32>>;
#[cfg(feature = "cuda")]
pub type GpuTrainF32Checkpointed =
    Autodiff<burn::backend::Cuda<f32>, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;

/// The CUDA backend without burn's fusion: every op its own kernel. Fusion has had NaN bugs upstream
/// (tracel-ai/burn#5202), so `KILN_CUDA_FUSION=off` runs the same bf16 model on this one to tell a fusion bug
/// from a model bug (bf16 only: each backend type is a whole second copy of the trainer in the binary).
#[cfg(feature = "cuda")]
pub type GpuUnfused = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, burn::tensor::bf16, i32, u8>;
#[cfg(feature = "cuda")]
pub type GpuTrainUnfused = Autodiff<GpuUnfused>;
#[cfg(feature = "cuda")]
pub type GpuTrainUnfusedCheckpointed =
    Autodiff<GpuUnfused, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;

/// burn's CubeCL backend over Vulkan (SPIR-V kernels) with fusion, in f32: the code path the CUDA backend
/// runs (burn-fusion's fused kernels, burn-cubecl's matmuls, reductions and autodiff on device tensors) with
/// another kernel compiler under it. On a machine without a GPU, Mesa's CPU Vulkan driver (lavapipe) runs it,
/// which is how the tests check kiln on a fused CubeCL backend without a GPU (`tests/vulkan_backend.rs`).
/// f32 only: lavapipe has no bf16, and each backend type is another copy of the trainer in the binary.
#[cfg(feature = "vulkan")]
pub type Vk = burn::backend::Vulkan<f32>;
#[cfg(feature = "vulkan")]
pub type VkTrain = Autodiff<Vk>;
#[cfg(feature = "vulkan")]
pub type VkTrainCheckpointed = Autodiff<Vk, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;
/// The Vulkan backend in f16 (`--precision f16`): lavapipe has no bf16, so f16 stands in for it to run the
/// graph CUDA's bf16 backend runs — half-precision tensors born in the device's default dtype, cast to f32
/// around norms, softmax and the loss — through burn's fusion without a GPU. The first GPU session found a
/// fusion panic (tracel-ai/burn#5292) that only half-precision graphs reach and the f32 tests could not.
#[cfg(feature = "vulkan")]
pub type VkHalf = burn::backend::Vulkan<burn::tensor::f16>;
#[cfg(feature = "vulkan")]
pub type VkHalfTrain = Autodiff<VkHalf>;
#[cfg(feature = "vulkan")]
pub type VkHalfTrainCheckpointed =
    Autodiff<VkHalf, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;

/// The Vulkan backends without burn's fusion (every op its own kernel), in f32 and f16: the unfused path
/// `KILN_CUDA_FUSION=off` takes on CUDA (`GpuUnfused`), where kiln's kernels run on `CubeBackend` directly
/// rather than as fused custom operations, checked on lavapipe by the tests (the CLI's vulkan device is the
/// fused one).
#[cfg(feature = "vulkan")]
pub type VkUnfused = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u8>;
#[cfg(feature = "vulkan")]
pub type VkHalfUnfused = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, burn::tensor::f16, i32, u8>;

/// Whether this build can compute on a Vulkan device here, in f16 (`half`) or f32: wgpu panics on burn's
/// device thread where no Vulkan driver is installed, so the first use is probed as CUDA's is (and claims
/// the device's default dtype as CUDA's probe does).
pub fn vulkan_ready(half: bool) -> Result<(), String> {
    #[cfg(feature = "vulkan")]
    {
        static PROBE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
        ready_in::<VkHalf, Vk>(half, "vulkan", &PROBE, |why| {
            format!(
                "Vulkan is not usable on this machine: {why}\n(kiln's vulkan device runs on any Vulkan driver; \
                 without a GPU, install Mesa's CPU driver: apt-get install mesa-vulkan-drivers)"
            )
        })
    }
    #[cfg(not(feature = "vulkan"))]
    {
        let _ = half;
        Err(crate::train::device_error("vulkan"))
    }
}

/// The environment variable that turns burn's fusion off on CUDA (`off`/`0`/`false`; `on` is the default).
pub const FUSION_ENV: &str = "KILN_CUDA_FUSION";

/// Whether CUDA work runs fused, from `KILN_CUDA_FUSION`; a value that is neither on nor off is an error
/// rather than a silent default, since the switch exists to A/B a numerical problem.
pub fn cuda_fusion() -> Result<bool, String> {
    switch(FUSION_ENV)
}

/// kiln's own CubeCL kernels, each behind a switch `KILN_<NAME>_KERNEL` (`on`/`1`/`true` runs it,
/// `off`/`0`/`false` runs its tensor ops instead; unset: the runtime's `KernelsByDefault`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// The DeltaNet's scan across chunks, its chunk solve and its backward pass's decay gradients
    /// (`kernels::scan`, `kernels::chunk_solve`, `kernels::decay_grads`).
    Scan,
    /// The attention's softmax rows (`kernels::attention`).
    Attention,
    /// The cross-entropy's rows (`kernels::cross_entropy`).
    Loss,
    /// The RMSNorms and the L2 norms (`kernels::norm`).
    Norm,
    /// The causal depthwise convolution (`kernels::conv`).
    Conv,
    /// The optimizer: the gradients' global norm and AdamW's update (`kernels::grad_norm`, `kernels::adamw`).
    Optim,
}

impl Kernel {
    pub const ALL: [Kernel; 6] =
        [Kernel::Scan, Kernel::Attention, Kernel::Loss, Kernel::Norm, Kernel::Conv, Kernel::Optim];

    /// Its name in `KILN_<NAME>_KERNEL` (lower case), in `kiln info` and in benchmark rows (`<name>_kernel`).
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scan => "scan",
            Kernel::Attention => "attention",
            Kernel::Loss => "loss",
            Kernel::Norm => "norm",
            Kernel::Conv => "conv",
            Kernel::Optim => "optim",
        }
    }

    /// The environment variable that switches it.
    pub fn env(self) -> &'static str {
        match self {
            Kernel::Scan => "KILN_SCAN_KERNEL",
            Kernel::Attention => "KILN_ATTENTION_KERNEL",
            Kernel::Loss => "KILN_LOSS_KERNEL",
            Kernel::Norm => "KILN_NORM_KERNEL",
            Kernel::Conv => "KILN_CONV_KERNEL",
            Kernel::Optim => "KILN_OPTIM_KERNEL",
        }
    }

    /// Its switch as the environment sets it: `None` where unset; a malformed value is an error (`main`
    /// checks before any command runs).
    pub fn setting(self) -> Result<Option<bool>, String> {
        kernel_switch_checked(self.env())
    }

    /// Whether it runs on a device whose default is `default`: the switch read once per process, for the
    /// models, the loss and the optimizer (the CLI has rejected a malformed value before they run).
    pub fn enabled(self, default: KernelsByDefault) -> bool {
        static SETTINGS: [std::sync::OnceLock<Option<bool>>; 6] = [const { std::sync::OnceLock::new() }; 6];
        kernel_switch_once(&SETTINGS[self as usize], self.env(), default)
    }
}

/// The switch of the MoE's experts batched into one matmul over padded groups (`models::experts`) on the
/// CubeCL backends; off runs a matmul per expert.
pub const EXPERTS_BATCHED_ENV: &str = "KILN_EXPERTS_BATCHED";

/// Whether the CubeCL backends batch the MoE's experts, from `KILN_EXPERTS_BATCHED`; malformed values are
/// an error (`main` checks before any command runs).
pub fn experts_batched() -> Result<bool, String> {
    switch(EXPERTS_BATCHED_ENV)
}

/// The switch of the CUDA backends' matrix products: `KILN_MATMUL=cublas` runs them through NVIDIA's cuBLAS
/// (`kernels::cublas`) ordered around cubecl's kernels on the device, `cublas-host` the same products
/// ordered by the host waiting on both streams (two waits a product), `cubecl` (or unset) through burn's own
/// kernels. Other devices ignore it.
pub const MATMUL_ENV: &str = "KILN_MATMUL";

/// Which kernels compute the CUDA backends' matrix products (`MATMUL_ENV`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernels {
    /// burn's (cubek's) kernels, fused with their neighbours by burn-fusion where it can.
    Cubecl,
    /// cuBLAS's, loaded at run time, on a stream of kiln's that waits for cubecl's on the device and holds
    /// it until the product is written (`kernels::stream_order`): the host runs ahead as with burn's kernels.
    Cublas,
    /// cuBLAS's, the host waiting for cubecl's stream before each product and for cuBLAS's after it: the
    /// plain ordering, to set beside `Cublas` (what the device-side ordering buys, or a fallback where the
    /// device lacks CUDA's stream memory operations).
    CublasHostOrdered,
}

impl MatmulKernels {
    /// The setting of `KILN_MATMUL`: unset is `Cubecl`; anything but `cubecl`, `cublas` or `cublas-host` is
    /// an error that says so (`main` checks before any command runs).
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(MATMUL_ENV) {
            Err(_) => Ok(MatmulKernels::Cubecl),
            Ok(value) => Self::parse(&value),
        }
    }

    fn parse(value: &str) -> Result<Self, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "cubecl" => Ok(MatmulKernels::Cubecl),
            "cublas" => Ok(MatmulKernels::Cublas),
            "cublas-host" => Ok(MatmulKernels::CublasHostOrdered),
            _ => Err(format!(
                "{MATMUL_ENV}={value:?}: use cubecl (burn's kernels, the default), cublas or cublas-host (cuBLAS \
                 ordered by the host)"
            )),
        }
    }

    /// Its name in `KILN_MATMUL`, `kiln info` and benchmark rows.
    pub fn name(self) -> &'static str {
        match self {
            MatmulKernels::Cubecl => "cubecl",
            MatmulKernels::Cublas => "cublas",
            MatmulKernels::CublasHostOrdered => "cublas-host",
        }
    }
}

/// The kernels in force for the CUDA backends' products: `KILN_MATMUL` read once per process (a malformed
/// value reads as burn's kernels here; the CLI has rejected it before any model runs).
pub fn matmul_kernels() -> MatmulKernels {
    static KERNELS: std::sync::OnceLock<MatmulKernels> = std::sync::OnceLock::new();
    *KERNELS.get_or_init(|| MatmulKernels::from_env().unwrap_or(MatmulKernels::Cubecl))
}

/// Whether the CUDA backends' products run through cuBLAS (`matmul_kernels`), however ordered.
pub fn cublas_enabled() -> bool {
    matches!(matmul_kernels(), MatmulKernels::Cublas | MatmulKernels::CublasHostOrdered)
}

/// What this process's cuBLAS products have cost the host so far: whether the host ordering around them
/// (`kernels::cublas`'s module doc) is what a step spends its time on. All zero where none ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CublasTally {
    pub products: u64,
    /// Seconds waiting for cubecl's stream before the products: its kernels that had not finished yet (the
    /// device's work, which the host would otherwise have run ahead of). Zero when the products are ordered
    /// on the device (`MatmulKernels::Cublas`).
    pub operand_wait_s: f64,
    /// Seconds from each call to the end of its stream: the products on the device, their launches and
    /// the waits for them; ordered on the device, only what the host spends queueing them and the flag
    /// kernels around them.
    pub product_s: f64,
}

impl CublasTally {
    /// What was tallied after `earlier`.
    pub fn since(self, earlier: CublasTally) -> CublasTally {
        CublasTally {
            products: self.products.saturating_sub(earlier.products),
            operand_wait_s: self.operand_wait_s - earlier.operand_wait_s,
            product_s: self.product_s - earlier.product_s,
        }
    }

    /// The tally spread over `steps` steps.
    pub fn per_step(self, steps: usize) -> CublasTally {
        let n = steps.max(1) as f64;
        CublasTally {
            products: self.products / steps.max(1) as u64,
            operand_wait_s: self.operand_wait_s / n,
            product_s: self.product_s / n,
        }
    }
}

/// This process's cuBLAS tally so far (`kernels::cublas`); zero in builds without CUDA.
pub fn cublas_tally() -> CublasTally {
    #[cfg(feature = "cuda")]
    return crate::kernels::cublas::tally();
    #[cfg(not(feature = "cuda"))]
    CublasTally::default()
}

/// An on/off switch from the environment: on when unset.
fn switch(name: &str) -> Result<bool, String> {
    kernel_switch(name).map(|set| set.unwrap_or(true)).map_err(|why| format!("{why} (unset: on)"))
}

/// A kernel's on/off switch from the environment: `None` when unset (the runtime's `KernelsByDefault`
/// decides).
fn kernel_switch(name: &str) -> Result<Option<bool>, String> {
    std::env::var_os(name).map(|value| parse_switch(name, &value.to_string_lossy())).transpose()
}

/// `kernel_switch` as the CLI reports a malformed value.
fn kernel_switch_checked(name: &str) -> Result<Option<bool>, String> {
    kernel_switch(name).map_err(|why| format!("{why} (unset: the device's default, see `kiln info`)"))
}

/// Whether kiln's own CubeCL kernels (the scan and chunk solve, the attention's and the loss's rows, the
/// RMSNorms, the causal conv, the optimizer's) run where their switch is unset, per runtime.
///
/// On Vulkan they do: the tests check each against its tensor-op reference on lavapipe. On CUDA they do
/// not, until a GPU session clears them: on an H200 (2026-12-04) bf16 steps of the tiny shapes with them on
/// turned NaN at a step that changed from run to run, and an f32 step with the attention kernel on was 2e-3
/// off the CPU's loss from the first forward; the same steps on burn's fused ops alone matched the CPU
/// within 1.3e-4 (bf16) and 5e-6 (f32). The cause found since (CUDA pitches the rows of the outputs the
/// kernels wrote densely: `kernels` module comment) is mended but not yet run on a GPU.
/// `KILN_<NAME>_KERNEL=on` runs one on CUDA all the same (tests/bench/gpu_session.sh's `kernels` stage
/// tries each alone).
#[derive(Debug, Clone, Copy)]
pub enum KernelsByDefault {
    On,
    Off,
}

/// Vulkan's default (`KernelsByDefault`).
pub const VULKAN_KERNELS: KernelsByDefault = KernelsByDefault::On;
/// CUDA's default (`KernelsByDefault`).
pub const CUDA_KERNELS: KernelsByDefault = KernelsByDefault::Off;

/// The default of kiln's kernels on device `device` (a CLI device name): CUDA's or Vulkan's; the CPU runs
/// none of them.
pub fn kernels_by_default(device: &str) -> KernelsByDefault {
    if device == "cuda" { CUDA_KERNELS } else { VULKAN_KERNELS }
}

fn parse_switch(name: &str, value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "on" | "1" | "true" => Ok(true),
        "off" | "0" | "false" => Ok(false),
        _ => Err(format!("{name}={value:?}: use on or off")),
    }
}

/// The CUDA backend to run on: `Ok(true)` for the fused one, `Ok(false)` for `GpuUnfused`; an error where
/// the switch is malformed, fusion is off for a precision the unfused build lacks, or CUDA is unusable
/// (checked in that order, so a wrong setting is reported on any machine).
pub fn cuda_choice(bf16: bool) -> Result<bool, String> {
    let fused = fusion_for(bf16, cuda_fusion())?;
    cuda_ready(bf16)?;
    Ok(fused)
}

fn fusion_for(bf16: bool, setting: Result<bool, String>) -> Result<bool, String> {
    let fused = setting?;
    if !fused && !bf16 {
        return Err(format!(
            "{FUSION_ENV}=off runs the bf16 CUDA backend only; f32 on CUDA is always fused in this build \
             (drop --precision f32, or unset {FUSION_ENV})"
        ));
    }
    Ok(fused)
}

/// What a backend says of its device memory, for the trainer's and the benchmark's peak-memory figures.
pub trait DeviceMemory: Backend {
    /// Bytes the backend's allocator holds on the device (its pools, as `torch.cuda.memory_reserved`);
    /// `None` where the backend keeps tensors in host memory (the CPU: the process's RSS says it).
    fn reserved_bytes(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// The device's whole memory in bytes, where the backend knows it (CUDA, and the host's for the CPU);
    /// `None` elsewhere.
    fn total_bytes(_device: &Self::Device) -> Option<u64> {
        None
    }
}

impl DeviceMemory for Flex {
    fn total_bytes(_device: &Self::Device) -> Option<u64> {
        crate::host::host_memory_bytes()
    }
}

impl<B: DeviceMemory, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy> DeviceMemory
    for Autodiff<B, C>
{
    fn reserved_bytes(device: &Self::Device) -> Option<u64> {
        B::reserved_bytes(device)
    }

    fn total_bytes(device: &Self::Device) -> Option<u64> {
        B::total_bytes(device)
    }
}

/// The CubeCL backends' allocator reserved bytes (one body per runtime for all its element types: burn does
/// not export the element bounds a generic impl over `CubeBackend<R, F, I, B>` needs), and the device's whole
/// memory where the runtime says it (`total`, a function of the runtime's client).
#[cfg(any(feature = "cuda", feature = "vulkan"))]
macro_rules! cubecl_device_memory {
    ($runtime:ty, $total:expr; $($backend:ty),*) => {$(
        impl DeviceMemory for $backend {
            fn reserved_bytes(device: &Self::Device) -> Option<u64> {
                use cubecl::Runtime;
                <$runtime>::client(device).memory_usage().ok().map(|usage| usage.bytes_reserved)
            }

            fn total_bytes(device: &Self::Device) -> Option<u64> {
                use cubecl::Runtime;
                $total(&<$runtime>::client(device))
            }
        }
    )*};
}
/// cubecl-cuda 0.10 sets its largest allocation to a quarter of `cuDeviceTotalMem` (its `runtime.rs`), and
/// exposes no other figure of the device's memory.
#[cfg(feature = "cuda")]
fn cuda_total_bytes(client: &cubecl::client::ComputeClient<cubecl::cuda::CudaRuntime>) -> Option<u64> {
    Some(client.properties().memory.max_page_size * 4)
}
#[cfg(feature = "cuda")]
cubecl_device_memory!(cubecl::cuda::CudaRuntime, cuda_total_bytes; burn::backend::Cuda<f32>, Gpu, GpuUnfused);
// wgpu reports its largest buffer binding, not the device's memory (lavapipe's is the host's).
#[cfg(feature = "vulkan")]
cubecl_device_memory!(cubecl::wgpu::WgpuRuntime, |_| None; Vk, VkHalf, VkUnfused, VkHalfUnfused);

// The CPU backend runs the models' attention in f32 as matrix products over blocks of each document's
// queries (`models::cpu_attention`), the DeltaNet scan as loops over tokens (`models::cpu_deltanet`), SwiGLU's
// gate, the RMSNorms, RoPE, the split parts' gradients and the loss rows in one pass each, and makes the parts
// of a split projection contiguous (`models::cpu_elementwise`); the CubeCL backends (and the CPU in other
// dtypes) use the chunked tensor ops (the trait's defaults); their autodiff wrappers record each with its backward (`models::attention`, `models::deltanet`).
// The CubeCL backends run the DeltaNet scan across chunks, the chunk solve and the decay gradients as kernels
// (`kernels::scan`, `kernels::chunk_solve`, `kernels::decay_grads`) unless `KILN_SCAN_KERNEL=off`, the attention's softmax rows as kernels
// (`kernels::attention`) unless `KILN_ATTENTION_KERNEL=off`, the cross-entropy's rows as one
// (`kernels::cross_entropy`) unless `KILN_LOSS_KERNEL=off`, the RMSNorms and L2 norms as kernels (`kernels::norm`)
// unless `KILN_NORM_KERNEL=off`, the causal depthwise convolution as kernels (`kernels::conv`) unless
// `KILN_CONV_KERNEL=off`, the MoE's experts as one batched matmul over padded groups (`models::experts`)
// unless `KILN_EXPERTS_BATCHED=off`, and the optimizer's gradient norm and AdamW update as kernels over many
// tensors at once (`kernels::grad_norm`, `kernels::adamw`) unless `KILN_OPTIM_KERNEL=off`.
impl CrossEntropyRows for Flex {
    fn cross_entropy_rows(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 2, Int>,
        coef: Tensor<Self, 2>,
        with_grads: bool,
    ) -> (Tensor<Self, 2>, Option<Tensor<Self, 2>>) {
        if cpu_elementwise::takes([logits.dtype(), coef.dtype()]) {
            cpu_elementwise::cross_entropy_rows(logits, targets, coef, with_grads)
        } else {
            crate::train::linear_ce::cross_entropy_rows(logits, targets, coef, with_grads)
        }
    }
}

impl OptimizerOps for Flex {}

impl ModelBackend for Flex {
    fn glu<const D: usize>(gate: Tensor<Self, D>, up: Tensor<Self, D>, act: GateActivation) -> Tensor<Self, D> {
        if cpu_elementwise::takes([gate.dtype(), up.dtype()]) {
            cpu_elementwise::glu(gate, up, act)
        } else {
            glu_forward(gate, up, act)
        }
    }

    fn glu_grads<const D: usize>(
        gate: Tensor<Self, D>,
        up: Tensor<Self, D>,
        grad: Tensor<Self, D>,
        act: GateActivation,
    ) -> (Tensor<Self, D>, Tensor<Self, D>) {
        if cpu_elementwise::takes([gate.dtype(), up.dtype(), grad.dtype()]) {
            cpu_elementwise::glu_grads(gate, up, grad, act)
        } else {
            glu_backward(gate, up, grad, act)
        }
    }

    fn rms_norm<const D: usize>(
        x: Tensor<Self, D>,
        weight: Tensor<Self, 1>,
        eps: f64,
        kind: NormKind,
    ) -> Tensor<Self, D> {
        if cpu_elementwise::takes([x.dtype(), weight.dtype()]) {
            cpu_elementwise::rms_norm(x, weight, eps, kind)
        } else {
            rms_norm_forward(x, weight, eps, kind)
        }
    }

    fn rms_norm_grads<const D: usize>(
        x: Tensor<Self, D>,
        weight: Tensor<Self, 1>,
        eps: f64,
        kind: NormKind,
        grad: Tensor<Self, D>,
    ) -> (Tensor<Self, D>, Tensor<Self, 1>) {
        if cpu_elementwise::takes([x.dtype(), weight.dtype(), grad.dtype()]) {
            cpu_elementwise::rms_norm_grads(x, weight, eps, kind, grad)
        } else {
            rms_norm_backward(x, weight, eps, kind, grad)
        }
    }

    fn split_last<const D: usize, const N: usize>(x: Tensor<Self, D>, widths: [usize; N]) -> [Tensor<Self, D>; N] {
        narrow_last(x, widths).map(cpu_elementwise::contiguous)
    }

    fn add_part<const D: usize>(
        whole: Option<Tensor<Self, D>>,
        dims: [usize; D],
        range: std::ops::Range<usize>,
        grad: Tensor<Self, D>,
    ) -> Tensor<Self, D> {
        let whole_dtype = whole.as_ref().map_or(grad.dtype(), |w| w.dtype());
        if cpu_elementwise::takes([whole_dtype, grad.dtype()]) {
            cpu_elementwise::add_part(whole, dims, range, grad)
        } else {
            add_part_composed(whole, dims, range, grad)
        }
    }

    fn rope(x: Tensor<Self, 4>, tables: &RopeTables<Self>) -> Tensor<Self, 4> {
        if cpu_elementwise::takes([x.dtype(), tables.dtype()]) {
            cpu_elementwise::rope(x, tables)
        } else {
            apply_rope(x, tables)
        }
    }

    fn rope_grad(grad: Tensor<Self, 4>, tables: &RopeTables<Self>) -> Tensor<Self, 4> {
        if cpu_elementwise::takes([grad.dtype(), tables.dtype()]) {
            cpu_elementwise::rope_grad(grad, tables)
        } else {
            apply_rope_backward(grad, tables)
        }
    }

    fn attention_forward(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        docs: &DocumentAttention<Self>,
    ) -> AttentionForward<Self> {
        if cpu_attention::takes([&q, &k, &v]) {
            cpu_attention::forward_on_host(q, k, v, docs)
        } else {
            chunked_attention(q, k, v, docs)
        }
    }

    fn attention_backward(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        docs: &DocumentAttention<Self>,
        forward: AttentionForward<Self>,
        grad_out: Tensor<Self, 4>,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>, Tensor<Self, 4>) {
        if cpu_attention::takes([&q, &k, &v]) {
            cpu_attention::backward_on_host(q, k, v, docs, forward, grad_out)
        } else {
            chunked_attention_backward(q, k, v, docs, forward, grad_out)
        }
    }

    fn masked_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        mask: &Tensor<Self, 4>,
        scale: f64,
    ) -> Tensor<Self, 4> {
        if cpu_attention::takes([&q, &k, &v]) {
            cpu_attention::masked_on_host(q, k, v, mask, scale)
        } else {
            scaled_softmax_attention(q, k, v, mask, scale)
        }
    }

    fn write_cache_rows(cache: Tensor<Self, 4>, at: usize, rows: Tensor<Self, 4>) -> Tensor<Self, 4> {
        if cpu_attention::takes([&cache, &rows]) {
            cpu_attention::write_cache_rows(cache, at, rows)
        } else {
            write_cache_rows_composed(cache, at, rows)
        }
    }

    fn delta_rule_scan(
        inputs: ScanInputs<Self>,
        plan: &ChunkPlan<Self>,
        initial: Option<Tensor<Self, 4>>,
    ) -> ChunkedScan<Self> {
        if cpu_deltanet::takes(&inputs) {
            cpu_deltanet::scan_on_host(inputs, plan, initial)
        } else {
            deltanet::chunked_scan(inputs, plan, initial)
        }
    }

    fn delta_rule_backward(
        inputs: ScanInputs<Self>,
        plan: &ChunkPlan<Self>,
        chunk_states: Tensor<Self, 5>,
        grad_out: Tensor<Self, 4>,
    ) -> ScanInputs<Self> {
        if cpu_deltanet::takes(&inputs) {
            cpu_deltanet::backward_on_host(inputs, plan, chunk_states, grad_out)
        } else {
            deltanet::chunked_backward(inputs, plan, chunk_states, grad_out)
        }
    }
}

#[cfg(any(feature = "cuda", feature = "vulkan"))]
macro_rules! cubecl_model_backend {
    ($backend:ty, $kernels:expr, $matmul:path, $projection:path) => {
        impl CrossEntropyRows for $backend {
            fn cross_entropy_rows(
                logits: Tensor<Self, 2>,
                targets: Tensor<Self, 2, burn::tensor::Int>,
                coef: Tensor<Self, 2>,
                with_grads: bool,
            ) -> (Tensor<Self, 2>, Option<Tensor<Self, 2>>) {
                if Kernel::Loss.enabled($kernels) {
                    crate::kernels::cross_entropy::cross_entropy_rows(logits, targets, coef, with_grads)
                } else {
                    crate::train::linear_ce::cross_entropy_rows(logits, targets, coef, with_grads)
                }
            }
        }

        impl OptimizerOps for $backend {
            fn squared_norm(tensors: Vec<burn::tensor::ops::FloatTensor<Self>>) -> Option<Tensor<Self, 1>> {
                if Kernel::Optim.enabled($kernels) {
                    crate::kernels::grad_norm::squared_norm(tensors)
                } else {
                    crate::train::optim::squared_sums_in_order(tensors)
                }
            }

            fn adamw_update(
                slots: Vec<crate::train::optim::AdamWSlot<Self>>,
                clip: Option<burn::tensor::ops::FloatTensor<Self>>,
                scalars: crate::train::optim::AdamWScalars,
            ) -> Result<Vec<crate::train::optim::AdamWUpdated<Self>>, Vec<crate::train::optim::AdamWSlot<Self>>> {
                if Kernel::Optim.enabled($kernels) {
                    Ok(crate::kernels::adamw::adamw_update(slots, clip, scalars))
                } else {
                    Err(slots)
                }
            }
        }

        impl ModelBackend for $backend {
            fn matmul<const D: usize>(lhs: Tensor<Self, D>, rhs: Tensor<Self, D>) -> Tensor<Self, D> {
                $matmul(lhs, rhs)
            }

            fn projection<const D: usize>(x: Tensor<Self, D>, weight: Tensor<Self, 2>) -> Tensor<Self, D> {
                $projection(x, weight)
            }

            fn attention_probs(
                scores: Tensor<Self, 4>,
                lse: Tensor<Self, 4>,
                docs: &DocumentAttention<Self>,
                rows: crate::models::attention::ChunkRows,
            ) -> [Tensor<Self, 4>; 2] {
                if Kernel::Attention.enabled($kernels) {
                    crate::kernels::attention::attention_probs(scores, lse, docs, rows)
                } else {
                    crate::models::attention::softmax_rows_into(scores, lse, docs, rows)
                }
            }

            fn attention_score_grads(
                scores: Tensor<Self, 4>,
                grad_probs: Tensor<Self, 4>,
                lse: Tensor<Self, 4>,
                delta: Tensor<Self, 4>,
                docs: &DocumentAttention<Self>,
                rows: crate::models::attention::ChunkRows,
            ) -> [Tensor<Self, 4>; 2] {
                if Kernel::Attention.enabled($kernels) {
                    crate::kernels::attention::attention_score_grads([scores, grad_probs, lse, delta], docs, rows)
                } else {
                    crate::models::attention::score_grads(scores, grad_probs, lse, delta, docs, rows)
                }
            }

            fn attention_add_key_grads(
                grads: [Tensor<Self, 4>; 2],
                parts: [Tensor<Self, 4>; 2],
                first: usize,
            ) -> [Tensor<Self, 4>; 2] {
                if Kernel::Attention.enabled($kernels) {
                    crate::kernels::attention::attention_add_key_grads(grads, parts, first)
                } else {
                    crate::models::attention::add_key_grads(grads, parts, first)
                }
            }

            fn chunk_recurrence(
                rec: crate::models::deltanet::ChunkRecurrence<Self>,
            ) -> crate::models::deltanet::RecurrenceOut<Self> {
                if Kernel::Scan.enabled($kernels) {
                    crate::kernels::scan::chunk_recurrence(rec)
                } else {
                    crate::models::deltanet::recurrence_by_chunk(rec)
                }
            }

            fn rms_norm<const D: usize>(
                x: Tensor<Self, D>,
                weight: Tensor<Self, 1>,
                eps: f64,
                kind: crate::models::ops::NormKind,
            ) -> Tensor<Self, D> {
                if Kernel::Norm.enabled($kernels) {
                    crate::kernels::norm::rms_norm(x, weight, eps, kind)
                } else {
                    crate::models::ops::rms_norm_forward(x, weight, eps, kind)
                }
            }

            fn rms_norm_grads<const D: usize>(
                x: Tensor<Self, D>,
                weight: Tensor<Self, 1>,
                eps: f64,
                kind: crate::models::ops::NormKind,
                grad: Tensor<Self, D>,
            ) -> (Tensor<Self, D>, Tensor<Self, 1>) {
                if Kernel::Norm.enabled($kernels) {
                    crate::kernels::norm::rms_norm_grads(x, weight, eps, kind, grad)
                } else {
                    crate::models::ops::rms_norm_backward(x, weight, eps, kind, grad)
                }
            }

            fn l2_norm<const D: usize>(x: Tensor<Self, D>, eps: f64) -> Tensor<Self, D> {
                if Kernel::Norm.enabled($kernels) {
                    crate::kernels::norm::l2_norm(x, eps)
                } else {
                    crate::models::layers::l2_normalize(x, eps)
                }
            }

            fn l2_norm_grads<const D: usize>(x: Tensor<Self, D>, eps: f64, grad: Tensor<Self, D>) -> Tensor<Self, D> {
                if Kernel::Norm.enabled($kernels) {
                    crate::kernels::norm::l2_norm_grads(x, eps, grad)
                } else {
                    crate::models::layers::l2_normalize_backward(x, eps, grad)
                }
            }

            fn causal_conv(
                x: Tensor<Self, 3>,
                kernel: Tensor<Self, 2>,
                shifts: &crate::models::layers::ConvShifts<Self>,
            ) -> Tensor<Self, 3> {
                if Kernel::Conv.enabled($kernels) {
                    crate::kernels::conv::causal_conv(x, kernel, shifts)
                } else {
                    crate::models::layers::causal_depthwise_conv(x, kernel, shifts)
                }
            }

            fn causal_conv_grads(
                x: Tensor<Self, 3>,
                kernel: Tensor<Self, 2>,
                shifts: &crate::models::layers::ConvShifts<Self>,
                grad: Tensor<Self, 3>,
            ) -> (Tensor<Self, 3>, Tensor<Self, 2>) {
                if Kernel::Conv.enabled($kernels) {
                    crate::kernels::conv::causal_conv_grads(x, kernel, shifts, grad)
                } else {
                    crate::models::layers::causal_depthwise_conv_backward(x, kernel, shifts, grad)
                }
            }

            fn gated_conv(
                bcx: Tensor<Self, 3>,
                kernel: Tensor<Self, 2>,
                shifts: &crate::models::layers::ConvShifts<Self>,
            ) -> Tensor<Self, 3> {
                if Kernel::Conv.enabled($kernels) {
                    crate::kernels::conv::gated_conv(bcx, kernel, shifts)
                } else {
                    crate::models::layers::gated_conv(bcx, kernel, shifts)
                }
            }

            fn gated_conv_grads(
                bcx: Tensor<Self, 3>,
                kernel: Tensor<Self, 2>,
                shifts: &crate::models::layers::ConvShifts<Self>,
                grad: Tensor<Self, 3>,
            ) -> (Tensor<Self, 3>, Tensor<Self, 2>) {
                if Kernel::Conv.enabled($kernels) {
                    crate::kernels::conv::gated_conv_grads(bcx, kernel, shifts, grad)
                } else {
                    crate::models::layers::gated_conv_backward(bcx, kernel, shifts, grad)
                }
            }

            fn grouped_matmul(x: Tensor<Self, 2>, weights: Tensor<Self, 3>, counts: &[usize]) -> Tensor<Self, 2> {
                crate::models::experts::grouped_matmul(x, weights, counts, experts_batched_enabled())
            }

            fn grouped_matmul_grads(
                x: Tensor<Self, 2>,
                weights: Tensor<Self, 3>,
                counts: &[usize],
                grad: Tensor<Self, 2>,
            ) -> (Tensor<Self, 2>, Tensor<Self, 3>) {
                crate::models::experts::grouped_matmul_grads(x, weights, counts, grad, experts_batched_enabled())
            }

            fn unit_lower_inverse(
                lower: Tensor<Self, 5>,
                plan: &crate::models::deltanet::ChunkPlan<Self>,
            ) -> Tensor<Self, 5> {
                if Kernel::Scan.enabled($kernels) {
                    crate::kernels::chunk_solve::unit_lower_inverse(lower)
                } else {
                    crate::models::deltanet::unit_lower_inverse(lower, plan)
                }
            }

            fn delta_rule_decay_grads(
                inputs: crate::models::deltanet::DecayGradInputs<Self>,
                plan: &crate::models::deltanet::ChunkPlan<Self>,
            ) -> [Tensor<Self, 4>; 2] {
                if Kernel::Scan.enabled($kernels) {
                    crate::kernels::decay_grads::decay_grads(inputs)
                } else {
                    crate::models::deltanet::decay_grads(inputs, plan)
                }
            }
        }
    };
}
// CUDA's products go through cuBLAS where `KILN_MATMUL=cublas` (`kernels::cublas`); Vulkan's are burn's.
#[cfg(feature = "cuda")]
use crate::kernels::cublas;
#[cfg(feature = "cuda")]
cubecl_model_backend!(burn::backend::Cuda<f32>, CUDA_KERNELS, cublas::matmul, cublas::projection);
#[cfg(feature = "cuda")]
cubecl_model_backend!(Gpu, CUDA_KERNELS, cublas::matmul, cublas::projection);
#[cfg(feature = "cuda")]
cubecl_model_backend!(GpuUnfused, CUDA_KERNELS, cublas::matmul, cublas::projection);
#[cfg(feature = "vulkan")]
cubecl_model_backend!(Vk, VULKAN_KERNELS, Tensor::matmul, burn_projection);
#[cfg(feature = "vulkan")]
cubecl_model_backend!(VkHalf, VULKAN_KERNELS, Tensor::matmul, burn_projection);
#[cfg(feature = "vulkan")]
cubecl_model_backend!(VkUnfused, VULKAN_KERNELS, Tensor::matmul, burn_projection);
#[cfg(feature = "vulkan")]
cubecl_model_backend!(VkHalfUnfused, VULKAN_KERNELS, Tensor::matmul, burn_projection);

/// burn's `linear` without a bias, `ModelBackend::projection`'s default, for the macro's Vulkan backends.
#[cfg(feature = "vulkan")]
fn burn_projection<B: Backend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 2>) -> Tensor<B, D> {
    burn::tensor::module::linear(x, weight, None)
}

/// `experts_batched()` read once, for the models (the CLI has rejected a malformed value before they run).
pub fn experts_batched_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch_once(&ENABLED, EXPERTS_BATCHED_ENV)
}

fn switch_once(cell: &std::sync::OnceLock<bool>, name: &str) -> bool {
    *cell.get_or_init(|| switch(name).unwrap_or(true))
}

fn kernel_switch_once(cell: &std::sync::OnceLock<Option<bool>>, name: &str, default: KernelsByDefault) -> bool {
    cell.get_or_init(|| kernel_switch(name).ok().flatten()).unwrap_or(matches!(default, KernelsByDefault::On))
}

/// Host values as a tensor created in `dtype`. burn's `from_data` without a dtype converts to the device's
/// default float dtype first (bf16 on the CUDA bf16 backend, f32 on the CPU), which would round f32 values
/// for good before any `.cast(F32)` after it.
pub fn host_tensor<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values, shape), (device, DType::from(dtype)))
}

/// Zeros created in `dtype` rather than in the device's default and then cast.
pub fn zeros_in<B: Backend, const D: usize>(shape: [usize; D], dtype: FloatDType, device: &B::Device) -> Tensor<B, D> {
    Tensor::zeros(shape, (device, DType::from(dtype)))
}

/// Whether this build can compute on a CUDA device here, in bf16 (`bf16`) or f32: the first CUDA use loads
/// the driver (libcuda) and NVRTC by name and compiles a kernel, and a missing library panics on burn's
/// device thread. Probed once with a small matmul, panics caught (on every thread: the device thread holds
/// the reason), and turned into an error that says what is missing.
/// That first use also fixes the device's default float dtype for the rest of the process: burn keys it by
/// the device type, which `Cuda<bf16>` and `Cuda<f32>` share, and tensors created without a dtype take it.
/// So the probe runs on the precision's own backend, and asking for the other precision later in the same
/// process is an error rather than an f32 run with bf16 tensors in it.
pub fn cuda_ready(bf16: bool) -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        static PROBE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
        ready_in::<Gpu, burn::backend::Cuda<f32>>(bf16, "cuda", &PROBE, |why| {
            format!(
                "CUDA is not usable on this machine: {why}\n(kiln loads the NVIDIA driver's libcuda.so and NVRTC's \
                 libnvrtc.so.<major> at run time; where only PyTorch's pip wheels bring NVRTC, add their \
                 site-packages/nvidia/.../lib directory to LD_LIBRARY_PATH; or use --device cpu)"
            )
        })?;
        if !cublas_enabled() {
            return Ok(());
        }
        // cuBLAS's products checked against burn's once per precision before a run relies on them.
        static CUBLAS: [std::sync::OnceLock<Result<(), String>>; 2] = [const { std::sync::OnceLock::new() }; 2];
        let check: fn(&()) -> Result<(), String> = if bf16 {
            |_| crate::kernels::cublas::self_check::<Gpu>(&Default::default())
        } else {
            |_| crate::kernels::cublas::self_check::<burn::backend::Cuda<f32>>(&Default::default())
        };
        CUBLAS[usize::from(bf16)].get_or_init(|| probe(check)).clone()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = bf16;
        Err(crate::train::device_error("cuda"))
    }
}

/// A device probed once per process (the outcome kept in `probed`) with the smoke test on its half- or
/// full-precision backend, whichever `half` asks for, then `default_dtype_is` for that backend: the probe is
/// the device's first use, so it fixes the default dtype, and a later request for the other precision fails.
#[cfg(any(feature = "cuda", feature = "vulkan"))]
fn ready_in<Half, Full>(
    half: bool,
    device_name: &str,
    probed: &std::sync::OnceLock<Result<(), String>>,
    unusable: fn(String) -> String,
) -> Result<(), String>
where
    Half: Backend,
    Full: Backend<Device = Half::Device>,
    Half::Device: Default,
{
    let smoke: fn(&Half::Device) -> Result<(), String> = if half { smoke_test::<Half> } else { smoke_test::<Full> };
    probed.get_or_init(|| probe(smoke).map_err(unusable)).clone()?;
    if half { default_dtype_is::<Half>(device_name) } else { default_dtype_is::<Full>(device_name) }
}

/// Whether the default float dtype burn fixed for `B`'s device is `B`'s own (see `cuda_ready`).
#[cfg(any(feature = "cuda", feature = "vulkan"))]
fn default_dtype_is<B: Backend>(device_name: &str) -> Result<(), String> {
    use burn::tensor::Element;
    let want = FloatDType::from(<B::FloatElem as Element>::dtype());
    let have = burn::tensor::get_device_settings::<B>(&Default::default()).float_dtype;
    if have == want {
        Ok(())
    } else {
        Err(format!(
            "the {device_name} device already computes in {have:?} in this process (burn fixes a device's default \
             dtype at its first use), so {want:?} work on it needs a process of its own"
        ))
    }
}

/// Runs a device's smoke test with panics caught on every thread (a GPU runtime fails on its device
/// thread, which holds the reason) and returns why it failed.
#[cfg(any(feature = "cuda", feature = "vulkan"))]
fn probe<D: Default>(smoke: fn(&D) -> Result<(), String>) -> Result<(), String> {
    use std::sync::{Arc, Mutex};
    let messages = Arc::new(Mutex::new(Vec::<String>::new()));
    let previous = std::panic::take_hook();
    let sink = Arc::clone(&messages);
    std::panic::set_hook(Box::new(move |info| {
        let text = crate::device_panics::payload_text(info.payload());
        if let Ok(mut all) = sink.lock() {
            all.push(text);
        }
    }));
    let outcome = std::panic::catch_unwind(|| smoke(&D::default()));
    std::panic::set_hook(previous);
    let why = match outcome {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(wrong)) => wrong,
        // The first panic is the cause (the device thread's); later ones are its echo on this thread.
        Err(_) => messages.lock().ok().and_then(|m| m.first().cloned()).unwrap_or_else(|| "unknown failure".into()),
    };
    Err(why)
}

/// Keeps the CPU backend's memory in the process between ops (glibc only; the process's first call, before
/// any thread starts). burn-flex allocates every op's output afresh, a few MiB each for the models a CPU
/// trains, and glibc gives such blocks to `mmap` (until its dynamic threshold catches up, per arena) and
/// returns freed heap to the kernel, so every step faulted and zeroed its pages again: ten steps of the tiny
/// model took 320,000 page faults and 15 % of their time in the kernel. Serving blocks up to 32 MiB (glibc's
/// largest threshold) from the heap and keeping up to 256 MiB of free heap mapped cut that to 64,000 faults
/// and the step by ~10 %, with the same peak memory (docs/BENCHMARKS.md). A `GLIBC_TUNABLES` that sets
/// malloc's own values wins. Returns the settings applied, for `kiln info`.
pub fn tune_host_allocator() -> Option<&'static str> {
    const SETTINGS: &str = "glibc malloc: mmap threshold 32 MiB, trim threshold 256 MiB";
    if std::env::var("GLIBC_TUNABLES").is_ok_and(|tunables| tunables.contains("glibc.malloc.")) {
        return None;
    }
    set_malloc_thresholds().then_some(SETTINGS)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_malloc_thresholds() -> bool {
    // SAFETY: mallopt only changes malloc's thresholds; it takes no pointers.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_malloc_thresholds() -> bool {
    false
}

/// The widest SIMD the CPU's matmul kernels (gemm) use on this machine: AVX-512 (gemm's `x86-v4`) runs the
/// f32 microkernels at twice AVX2's width.
pub fn cpu_matmul_simd() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512cd") && has!("avx512dq") && has!("avx512vl") {
            return "avx512";
        }
        if has!("avx2") && has!("fma") {
            return "avx2";
        }
    }
    "baseline"
}

/// The backends compiled into this binary.
pub fn compiled() -> Vec<&'static str> {
    let mut names = vec!["flex (cpu, f32)"];
    if cfg!(feature = "cuda") {
        names.push("cuda (bf16, f32; fused)");
        names.push("cuda unfused (bf16; KILN_CUDA_FUSION=off)");
    }
    if cfg!(feature = "vulkan") {
        names.push("vulkan (f32, f16; fused)");
    }
    names
}

/// A 2×3 · 3×2 matmul on `B`, checked against the known product: proves the backend computes.
pub fn smoke_test<B: Backend>(device: &B::Device) -> Result<(), String> {
    let a = Tensor::<B, 2>::from_data(TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]), device);
    let b = Tensor::<B, 2>::from_data(TensorData::new(vec![7.0f32, 8.0, 9.0, 10.0, 11.0, 12.0], [3, 2]), device);
    let product = a.matmul(b).into_data().convert::<f32>();
    let got = product.to_vec::<f32>().map_err(|e| format!("{e:?}"))?;
    let want = [58.0f32, 64.0, 139.0, 154.0];
    if got.iter().zip(want).all(|(g, w)| (g - w).abs() < 0.5) {
        Ok(())
    } else {
        Err(format!("matmul gave {got:?}, expected {want:?}"))
    }
}

/// `count` devices of `first`'s backend from `first` on: device indices i..i+count, or `first` `count` times
/// where the backend has a single device (the CPU, one Vulkan GPU: the users share it). The devices the
/// backend sees, when they are too few.
pub fn consecutive_devices<B: Backend>(first: &B::Device, count: usize) -> Result<Vec<B::Device>, usize> {
    let DeviceId { type_id, index_id } = first.id();
    let available = B::device_count(type_id);
    if available <= 1 {
        return Ok(vec![first.clone(); count]);
    }
    if usize::from(index_id) + count > available {
        return Err(available);
    }
    Ok((0..count).map(|k| B::Device::from_id(DeviceId { type_id, index_id: index_id + k as u16 })).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cublas_tally_is_read_as_the_difference_spread_over_the_steps() {
        let earlier = CublasTally { products: 10, operand_wait_s: 0.5, product_s: 1.0 };
        let later = CublasTally { products: 40, operand_wait_s: 0.8, product_s: 1.6 };
        let per_step = later.since(earlier).per_step(3);
        assert_eq!(per_step.products, 10);
        assert!((per_step.operand_wait_s - 0.1).abs() < 1e-12 && (per_step.product_s - 0.2).abs() < 1e-12);
        // Nothing ran through cuBLAS in this process (no product, or a build without CUDA).
        let before = cublas_tally();
        assert_eq!(cublas_tally().since(before), CublasTally::default());
    }

    #[test]
    fn cpu_backend_computes() {
        smoke_test::<Cpu>(&Default::default()).unwrap();
    }

    #[test]
    fn switches_read_on_off_reject_the_rest_and_f32_unfused() {
        for on in ["", "on", "ON", "1", "true", " on "] {
            assert_eq!(parse_switch(FUSION_ENV, on), Ok(true), "{on:?}");
        }
        for off in ["off", "Off", "0", "false"] {
            assert_eq!(parse_switch(Kernel::Scan.env(), off), Ok(false), "{off:?}");
        }
        assert_eq!(fusion_for(true, Ok(false)), Ok(false));
        assert_eq!(fusion_for(false, Ok(true)), Ok(true));
        assert!(fusion_for(false, Ok(false)).unwrap_err().contains("bf16 CUDA backend only"));
        let err = parse_switch(FUSION_ENV, "unfused").unwrap_err();
        assert!(err.contains("KILN_CUDA_FUSION=\"unfused\"") && err.contains("use on or off"), "{err}");
        let err = parse_switch(Kernel::Scan.env(), "no").unwrap_err();
        assert!(err.starts_with("KILN_SCAN_KERNEL=\"no\""), "{err}");
    }

    #[test]
    fn the_matmul_switch_reads_cubecl_or_cublas_and_rejects_the_rest() {
        assert_eq!(MatmulKernels::parse(""), Ok(MatmulKernels::Cubecl));
        assert_eq!(MatmulKernels::parse(" cuBLAS "), Ok(MatmulKernels::Cublas));
        assert_eq!(MatmulKernels::parse("cublas-host"), Ok(MatmulKernels::CublasHostOrdered));
        assert_eq!(MatmulKernels::parse("cubecl"), Ok(MatmulKernels::Cubecl));
        for kernels in [MatmulKernels::Cubecl, MatmulKernels::Cublas, MatmulKernels::CublasHostOrdered] {
            assert_eq!(MatmulKernels::parse(kernels.name()), Ok(kernels), "the name reads back");
        }
        let err = MatmulKernels::parse("torch").unwrap_err();
        assert!(err.starts_with("KILN_MATMUL=\"torch\"") && err.contains("cublas-host"), "{err}");
    }

    #[test]
    fn kernels_run_by_default_on_vulkan_and_not_on_cuda() {
        assert!(matches!(kernels_by_default("cuda"), KernelsByDefault::Off));
        assert!(matches!(kernels_by_default("vulkan"), KernelsByDefault::On));
        // An unset switch is cached as unset: each runtime's default still applies after the first read.
        let unset = std::sync::OnceLock::new();
        let name = "KILN_TEST_SWITCH_NEVER_SET";
        assert!(!kernel_switch_once(&unset, name, CUDA_KERNELS));
        assert!(kernel_switch_once(&unset, name, VULKAN_KERNELS));
        // A switch that is set holds on every runtime.
        let set = std::sync::OnceLock::from(Some(true));
        assert!(kernel_switch_once(&set, name, CUDA_KERNELS));
        // Each kernel has its own switch (and cell of `Kernel::enabled`), named after it.
        for (i, kernel) in Kernel::ALL.into_iter().enumerate() {
            assert_eq!(kernel as usize, i);
            assert_eq!(kernel.env(), format!("KILN_{}_KERNEL", kernel.name().to_uppercase()));
        }
    }
}
