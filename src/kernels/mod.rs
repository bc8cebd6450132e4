//! kiln's own CubeCL kernels, for burn's CubeCL backends (CUDA, Vulkan) with and without burn-fusion, and
//! what they share: registering a kernel as one custom operation in burn-fusion's stream, the grid of one
//! cube per row, and the sources' `REVISION` every kernel takes (so no kernel cache serves an older body).
//! Each kernel replaces a tensor-op composition that stays the reference it is tested against
//! (tests/vulkan_backend.rs) and the path of every other backend: the DeltaNet scan across chunks
//! (`scan`), chunk solve (`chunk_solve`) and decay gradients (`decay_grads`), the attention's softmax rows
//! (`attention`), the cross-entropy's rows (`cross_entropy`), the RMSNorms (`norm`), the causal depthwise
//! convolution (`conv`), the gradients' squared norm (`grad_norm`) and AdamW's update (`adamw`).
//! `cuda_source` (a test) writes every one's CUDA launches as CUDA C++ and compiles them with NVRTC, no GPU needed.
//! `cublas` is no CubeCL kernel: the CUDA backends' matrix products through NVIDIA's cuBLAS (`KILN_MATMUL`),
//! ordered around cubecl's stream on the device by `stream_order`'s flag kernels.
//! `backend` wires them into `ModelBackend`, `train::linear_ce::CrossEntropyRows` and
//! `train::optim::OptimizerOps`, each behind an environment switch.
//!
//! Every kernel indexes its tensors as dense rows, so its inputs go through `into_contiguous` and its outputs
//! are allocated dense (`empty_device_contiguous_dtype`), never with burn's plain `empty_device…_dtype`: that
//! asks CubeCL for the runtime's "optimized" layout, which on CUDA pitches each row to a power-of-two byte
//! width (a row of 48 f32 takes 256 bytes; cubecl-runtime's `PitchedMemoryLayoutPolicy`) and on Vulkan is
//! dense, so lavapipe could not show it. On an H200 the pitched outputs made the tiny shapes' losses wrong
//! in f32 and NaN in bf16 (docs/BENCHMARKS.md, "Third GPU session"). burn's `CubeTensor::copy` allocates
//! its result that way too, so the copy of a tensor a kernel writes in place while another handle holds it
//! is made dense (`writable`).

pub mod adamw;
pub mod attention;
pub mod chunk_solve;
pub mod conv;
pub mod cross_entropy;
pub mod cublas;
#[cfg(all(test, feature = "vulkan"))]
mod cuda_source;
pub mod decay_grads;
pub mod grad_norm;
pub mod norm;
pub mod scan;
pub mod stream_order;

/// The revision of kiln's kernels: a hash of their sources (and of `train::rounding`, whose constants the AdamW
/// kernel compiles in), passed to every kernel as a compile-time value. CubeCL keys a compiled kernel by its
/// name and compile-time values only, not by its body, so a persistent kernel cache (`crate::kernel_cache`)
/// would otherwise hand a newer kiln the PTX or SPIR-V of an older kernel of the same name.
pub(crate) const REVISION: u64 = crate::kernel_cache::fnv1a(&[
    include_bytes!("mod.rs"),
    include_bytes!("adamw.rs"),
    include_bytes!("attention.rs"),
    include_bytes!("chunk_solve.rs"),
    include_bytes!("conv.rs"),
    include_bytes!("cross_entropy.rs"),
    include_bytes!("decay_grads.rs"),
    include_bytes!("grad_norm.rs"),
    include_bytes!("norm.rs"),
    include_bytes!("scan.rs"),
    include_bytes!("stream_order.rs"),
    include_bytes!("../train/rounding.rs"),
]);

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorPrimitive};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};
use cubecl::prelude::*;

/// Registers one of kiln's kernels in burn-fusion's stream as a custom operation named `name` on `inputs`,
/// with outputs of the given shapes and dtypes: `operation` makes the operation that runs the kernel on the
/// backend under fusion from the description (its inputs and outputs in this order). Returns the outputs.
pub(crate) fn register_custom<B: FusionBackend, O: Operation<B::FusionRuntime> + 'static>(
    name: &'static str,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: &[(Shape, DType)],
    operation: impl FnOnce(CustomOpIr) -> O,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let client = inputs.first().expect("a kernel has inputs").client.clone();
    let streams = OperationStreams::with_inputs(inputs.iter());
    let outputs: Vec<TensorIr> = outputs
        .iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape.clone(), *dtype))
        .collect();
    let inputs: Vec<TensorIr> = inputs.into_iter().map(|t| t.into_ir()).collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    client.register(streams, OperationIr::Custom(desc.clone()), operation(desc))
}

/// In a custom operation's `execute`: the kernel's results as the description's outputs, in order.
pub(crate) fn register_float_outputs<B: FusionBackend>(
    handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    outputs: &[TensorIr],
    results: impl IntoIterator<Item = FloatTensor<B>>,
) {
    for (out, result) in outputs.iter().zip(results) {
        handles.register_float_tensor::<B>(&out.id, result);
    }
}

/// A tensor a kernel writes in place: as is when it is contiguous and held nowhere else, else a dense copy.
pub(crate) fn writable<R: burn_cubecl::CubeRuntime>(
    t: burn_cubecl::tensor::CubeTensor<R>,
) -> burn_cubecl::tensor::CubeTensor<R> {
    if !t.is_contiguous() {
        burn_cubecl::kernel::into_contiguous(t)
    } else if t.can_mut() {
        t
    } else {
        dense_copy(t)
    }
}

/// A copy of `t` in a dense buffer of its own. burn's `CubeTensor::copy` allocates its result in the
/// runtime's optimized layout, which CUDA pitches (module comment); cubecl's `into_contiguous` always copies
/// into a dense buffer (burn's wrapper of it hands a contiguous tensor back as it is).
fn dense_copy<R: burn_cubecl::CubeRuntime>(
    t: burn_cubecl::tensor::CubeTensor<R>,
) -> burn_cubecl::tensor::CubeTensor<R> {
    let (client, device, dtype) = (t.client.clone(), t.device.clone(), t.dtype);
    let copy = cubecl::std::tensor::into_contiguous(&client, t.binding(), dtype.into());
    burn_cubecl::tensor::CubeTensor::new(client, copy.handle, *copy.metadata, device, dtype)
}

/// A kernel's float result as a burn tensor (cubecl's prelude has its own `Tensor`, hence the path).
pub(crate) fn float_tensor<B: Backend, const D: usize>(t: FloatTensor<B>) -> burn::tensor::Tensor<B, D> {
    burn::tensor::Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `n` outputs of `register_custom` as an array.
pub(crate) fn outputs<T, const N: usize>(results: Vec<T>) -> [T; N] {
    let count = results.len();
    results.try_into().unwrap_or_else(|_| panic!("a kernel registered {count} outputs, not {N}"))
}

/// One cube per row for `rows` rows: the grid's x dimension holds at most 65,535 cubes on some devices
/// (Vulkan's usual limit), so rows wrap onto y; kernels find their row with `grid_row` and leave when it is
/// `rows` or more.
pub(crate) fn row_grid(rows: usize) -> CubeCount {
    let wide = rows.clamp(1, 65_535);
    let narrow = |n: usize| u32::try_from(n).expect("a kernel's row count fits in u32");
    CubeCount::Static(narrow(wide), narrow(rows.div_ceil(wide)), 1)
}

/// The row of the running cube in a `row_grid`.
#[cube]
pub(crate) fn grid_row() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// The start of a running maximum (online softmax): below any value, finite, so no `inf − inf` arises.
pub(crate) const LOWEST: f32 = -3.0e38;

/// Adds `x` to a running maximum `max` and sum of exponentials `sum = Σ exp(v − max)` (online softmax),
/// rescaling the sum when `x` is the new maximum. Start from `LOWEST` and 0.
#[cube]
pub(crate) fn exp_sum_add(max: &mut f32, sum: &mut f32, x: f32) {
    if x > *max {
        *sum = *sum * (*max - x).exp() + 1.0;
        *max = x;
    } else {
        *sum += (x - *max).exp();
    }
}

/// `log Σ exp` over every unit's values in the cube, by halving in shared memory (`units`, the cube's size,
/// a power of two); every unit gets it.
#[cube]
pub(crate) fn cube_log_sum_exp(max: f32, sum: f32, #[comptime] units: usize) -> f32 {
    let unit = UNIT_POS_X as usize;
    let mut maxes = SharedMemory::<f32>::new(units);
    let mut sums = SharedMemory::<f32>::new(units);
    maxes[unit] = max;
    sums[unit] = sum;
    sync_cube();
    // From the launch's cube size (`units`, known when compiling, would make it a constant).
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if unit < stride {
            let a = maxes[unit];
            let b = maxes[unit + stride];
            let mut top = b;
            if a > b {
                top = a;
            }
            sums[unit] = sums[unit] * (a - top).exp() + sums[unit + stride] * (b - top).exp();
            maxes[unit] = top;
        }
        sync_cube();
        stride /= 2;
    }
    maxes[0] + sums[0].ln()
}

/// `Σ value` over every unit of the cube, by halving in shared memory (`units`, the cube's size, a power of
/// two); every unit gets it. It waits for every unit first, so that it may run again in a loop while units
/// still read the last sum.
#[cube]
pub(crate) fn cube_sum(value: f32, #[comptime] units: usize) -> f32 {
    let unit = UNIT_POS_X as usize;
    let mut sums = SharedMemory::<f32>::new(units);
    sync_cube();
    sums[unit] = value;
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if unit < stride {
            sums[unit] += sums[unit + stride];
        }
        sync_cube();
        stride /= 2;
    }
    sums[0]
}

/// Units per cube of the kernels over many tensors (`CubeLayout`).
pub(crate) const UNITS: usize = 256;
/// Values one cube of them takes at least: 32 a unit.
const MIN_VALUES_PER_CUBE: usize = UNITS * 32;
/// Cubes over all tensors, beyond one a tensor: past it, each cube takes more values. As partial sums, far below
/// the ~65,530 entries from which burn 0.21's reductions along a dimension drop values on wgpu
/// (`ops::column_sums`), and enough cubes to fill any GPU.
const MAX_CUBES: usize = 16_384;

/// How the cubes of a kernel over many tensors (`grad_norm`, `adamw`) split tensors of `lens` values: each
/// cube takes `per_cube` values (a multiple of the units), and `starts[i]` to `starts[i + 1]` are tensor `i`'s
/// cubes (one at least, so that an empty tensor still has its slot); `starts` ends with the total.
#[derive(Debug, PartialEq)]
pub(crate) struct CubeLayout {
    pub(crate) per_cube: usize,
    pub(crate) starts: Vec<usize>,
}

impl CubeLayout {
    pub(crate) fn new(lens: &[usize]) -> Self {
        let values: usize = lens.iter().sum();
        let per_cube = values.div_ceil(MAX_CUBES).next_multiple_of(UNITS).max(MIN_VALUES_PER_CUBE);
        let mut starts = Vec::with_capacity(lens.len() + 1);
        let mut next = 0;
        starts.push(next);
        for &len in lens {
            next += len.div_ceil(per_cube).max(1);
            starts.push(next);
        }
        CubeLayout { per_cube, starts }
    }

    pub(crate) fn cubes(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// The launches that cover the tensors when each takes `bindings_per_tensor` of the device's
    /// `max_bindings` (four are kept for the kernel's outputs, metadata and scalars) and a launch takes at
    /// most `max_tensors`.
    pub(crate) fn launches(&self, bindings_per_tensor: usize, max_bindings: u32, max_tensors: usize) -> Vec<Launch> {
        let per_launch = ((max_bindings as usize).saturating_sub(4) / bindings_per_tensor.max(1)).clamp(1, max_tensors);
        let narrow = |n: usize| u32::try_from(n).expect("cube indices and values a cube that fit in u32");
        let tensors = self.starts.len().saturating_sub(1);
        (0..tensors)
            .step_by(per_launch)
            .map(|from| {
                let to = (from + per_launch).min(tensors);
                Launch {
                    tensors: from..to,
                    base: narrow(self.starts[from]),
                    cubes: self.starts[to] - self.starts[from],
                    per_cube: narrow(self.per_cube),
                    starts: self.starts[from..=to].iter().map(|&s| narrow(s)).collect(),
                }
            })
            .collect()
    }
}

/// One launch of a kernel over many tensors: its tensors, its first cube's index in the layout, its cube count,
/// the values a cube takes and its tensors' `starts` (the layout's, one past the last included).
#[derive(Debug, PartialEq)]
pub(crate) struct Launch {
    pub(crate) tensors: std::ops::Range<usize>,
    pub(crate) base: u32,
    pub(crate) cubes: usize,
    pub(crate) per_cube: u32,
    pub(crate) starts: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_outputs_are_allocated_dense() {
        // The pitched allocations (module comment) by name, split so that this file does not hold them:
        // burn's plain empty tensor, and `CubeTensor::copy`, whose result it allocates.
        let pitched = [concat!("empty_device", "_dtype"), concat!(".co", "py()")];
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels");
        let mut files = 0;
        for entry in std::fs::read_dir(&dir).expect("src/kernels is readable") {
            let path = entry.expect("a directory entry").path();
            let source = std::fs::read_to_string(&path).expect("a kernel source is readable");
            for call in pitched {
                assert!(!source.contains(call), "{} allocates with {call}: CUDA may pitch its rows", path.display());
            }
            files += 1;
        }
        assert!(files >= 9, "{files} files in {}", dir.display());
    }

    /// A tensor another handle still holds is written in a copy: dense (on CUDA too, where burn's own copy
    /// would pitch these 48-wide rows), in a buffer of its own, with the same values; the held one untouched.
    #[cfg(feature = "vulkan")]
    #[test]
    fn a_shared_tensor_is_written_in_a_dense_copy_of_its_own() {
        use burn::tensor::{Tensor, TensorData};
        type Lavapipe = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
        if let Err(why) = crate::backend::vulkan_ready(false) {
            eprintln!("skipped: {why}");
            return;
        }
        let values: Vec<f32> = (0..6 * 48).map(|i| i as f32 * 0.5).collect();
        let data = TensorData::new(values.clone(), [6, 48]);
        let held = Tensor::<Lavapipe, 2>::from_data(data, &Default::default()).into_primitive().tensor();
        let written = writable(held.clone());
        assert_eq!(written.meta.strides().to_vec(), [48, 1]);
        assert!(written.is_contiguous_buffer());
        assert!(written.can_mut(), "the copy shares no buffer");
        let read = |t| Tensor::<Lavapipe, 2>::from_primitive(TensorPrimitive::Float(t)).into_data().to_vec::<f32>();
        assert_eq!(read(written).expect("f32 values"), values);
        assert_eq!(read(held).expect("f32 values"), values);
    }

    #[test]
    fn each_tensor_has_whole_cubes_of_its_own_and_a_large_model_few() {
        let small = CubeLayout::new(&[1, MIN_VALUES_PER_CUBE, MIN_VALUES_PER_CUBE + 1, 0]);
        assert_eq!(small, CubeLayout { per_cube: MIN_VALUES_PER_CUBE, starts: vec![0, 1, 2, 4, 5] });
        assert_eq!(CubeLayout::new(&[]).cubes(), 0);
        // LFM2.5-1.2B's 1.17 B values in 148 tensors: at most one cube more than MAX_CUBES a tensor.
        let lens: Vec<usize> = (0..148).map(|i| if i == 0 { 67_108_864 } else { 7_500_000 }).collect();
        let large = CubeLayout::new(&lens);
        assert_eq!(large.per_cube % UNITS, 0);
        assert!(large.per_cube * MAX_CUBES >= lens.iter().sum::<usize>());
        assert!((MAX_CUBES / 2..=MAX_CUBES + lens.len()).contains(&large.cubes()), "{}", large.cubes());
    }

    #[test]
    fn launches_cover_every_tensor_once_within_the_bindings() {
        let layout = CubeLayout::new(&[1, MIN_VALUES_PER_CUBE, MIN_VALUES_PER_CUBE + 1, 0, 5]);
        // lavapipe's 30 bindings, 6 a parameter: 4 parameters a launch.
        let launches = layout.launches(6, 30, 32);
        assert_eq!(
            launches,
            vec![
                Launch { tensors: 0..4, base: 0, cubes: 5, per_cube: 8192, starts: vec![0, 1, 2, 4, 5] },
                Launch { tensors: 4..5, base: 5, cubes: 1, per_cube: 8192, starts: vec![5, 6] },
            ]
        );
        // Too few bindings still make progress, one tensor a launch; many bindings stop at the cap.
        assert_eq!(layout.launches(6, 2, 32).len(), 5);
        assert_eq!(layout.launches(1, 1024, 2).len(), 3);
        assert!(CubeLayout::new(&[]).launches(1, 1024, 32).is_empty());
    }
}
