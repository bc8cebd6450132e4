//! Matrix products through NVIDIA's cuBLAS on the CUDA backends, behind `KILN_MATMUL=cublas`: the models'
//! projections and their gradients, the attention's chunk products, the loss's head products and the MoE's
//! expert products (`ModelBackend::matmul`, `ModelBackend::projection`).
//!
//! Without burn's autotune, burn 0.21 runs every matmul on CUDA with one cubek kernel (single-buffered
//! tensor-core tiles); the third GPU session's steps ran 5.6× (LFM2-350M) to 8.7× (LFM2.5-1.2B) slower than
//! PyTorch, the larger model the further behind, as a step spent in matmuls would be. PyTorch's matmuls are
//! cuBLAS's; this module gives kiln the same kernels, loaded at run time from the `libcublas.so.<major>` that
//! PyTorch's wheels ship (cudarc's dynamic loading), so the build still needs no CUDA toolkit.
//!
//! cubecl keeps its CUDA stream to itself, so cuBLAS runs on a stream of kiln's, ordered around cubecl's
//! work on the device (`KILN_MATMUL=cublas`): a one-unit kernel on cubecl's stream sets a flag once the
//! operands are written, cuBLAS's stream waits for it (`cuStreamWaitValue32`), multiplies and sets the flag
//! again, and a kernel on cubecl's stream holds the kernels after it until then (`kernels::stream_order`).
//! The host waits for neither and runs ahead as it does with burn's kernels. `KILN_MATMUL=cublas-host`
//! orders them from the host instead: cubecl's stream is synchronized before cuBLAS reads the operands and
//! cuBLAS's after it writes the output, two host waits a product, a few hundred a training step, each of
//! which drains the device's queue, so that the device then runs no faster than the host dispatches.
//!
//! What is pure is `GemmPlan`: a row-major product of strided views (transposed, sliced, batched or
//! broadcast over the batch) as one column-major `cublasGemmStridedBatchedEx` call, tested on the CPU against
//! a reading of cuBLAS's documented semantics. An operand whose rows and columns both have strides, or whose
//! batch dimensions no one stride steps through (a head-major view of token-major rows, cut into chunks), is
//! copied dense first (`operand_to_copy`); what even that leaves unreadable (a batch broadcast over some
//! dimensions only) runs burn's matmul.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burn::tensor::{DType, Tensor};

use crate::backend::{CublasTally, cublas_enabled};

static PRODUCTS: AtomicU64 = AtomicU64::new(0);
static OPERAND_WAIT_NS: AtomicU64 = AtomicU64::new(0);
static PRODUCT_NS: AtomicU64 = AtomicU64::new(0);

/// The process's tally so far (`backend::cublas_tally`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn tally() -> CublasTally {
    let seconds = |ns: &AtomicU64| ns.load(Ordering::Relaxed) as f64 * 1e-9;
    CublasTally {
        products: PRODUCTS.load(Ordering::Relaxed),
        operand_wait_s: seconds(&OPERAND_WAIT_NS),
        product_s: seconds(&PRODUCT_NS),
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn record(operand_wait: Duration, product: Duration) {
    let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    PRODUCTS.fetch_add(1, Ordering::Relaxed);
    OPERAND_WAIT_NS.fetch_add(nanos(operand_wait), Ordering::Relaxed);
    PRODUCT_NS.fetch_add(nanos(product), Ordering::Relaxed);
}

/// How cuBLAS transforms an operand: as stored (`N`) or transposed (`T`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    N,
    T,
}

/// A strided view of a tensor: its dimensions and its strides, in elements.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    pub dims: &'a [usize],
    pub strides: &'a [usize],
}

/// One `cublasGemmStridedBatchedEx` call, in cuBLAS's column-major terms, that writes the row-major product
/// `lhs · rhs` (`[batch…, rows, inner] · [batch…, inner, cols]`) densely: column-major, that output is its
/// transpose, `(lhs · rhs)ᵀ = rhsᵀ · lhsᵀ`, so cuBLAS's `A` is `rhs` and its `B` is `lhs`, `m` is the product's
/// columns and `n` its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GemmPlan {
    pub transa: Op,
    pub transb: Op,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
    pub batch: usize,
    /// The product's dimensions: the batch dimensions broadcast, then rows and columns.
    pub out_dims: Vec<usize>,
}

/// Why no single call reads the operands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unplannable {
    /// Shapes burn's matmul would reject (ranks, inner dimensions, batch dimensions that do not broadcast).
    Shapes,
    /// The operand (`"lhs"` or `"rhs"`) has strides along both its rows and its columns: a dense copy reads.
    Layout(&'static str),
    /// The operand's batch is broadcast over some batch dimensions only, or its batch dimensions do not merge
    /// into one stride: burn's matmul reads it.
    Batch(&'static str),
    /// A size past cuBLAS's 32-bit arguments.
    TooLarge,
}

/// A matrix's storage order: element `(r, c)` at `r · ld + c` (row-major) or `r + c · ld` (column-major).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    Rows(usize),
    Columns(usize),
}

/// The order a `rows × cols` matrix with strides `(row_stride, col_stride)` is stored in, with a leading
/// dimension cuBLAS accepts (at least the stored rows' length, and 1); row-major first. A stride along a
/// dimension of size 1 is never used, so it is free.
fn order(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Option<Order> {
    if col_stride == 1 || cols == 1 {
        let ld = if rows == 1 { cols.max(1) } else { row_stride };
        if ld >= cols.max(1) {
            return Some(Order::Rows(ld));
        }
    }
    if row_stride == 1 || rows == 1 {
        let ld = if cols == 1 { rows.max(1) } else { col_stride };
        if ld >= rows.max(1) {
            return Some(Order::Columns(ld));
        }
    }
    None
}

/// The one stride that steps an operand through the flattened batch `out` (the broadcast batch dimensions),
/// or why there is none: 0 where the operand is broadcast over all of it.
fn batch_stride(dims: &[usize], strides: &[usize], out: &[usize], which: &'static str) -> Result<usize, Unplannable> {
    let live: Vec<usize> = (0..out.len()).filter(|&i| out[i] > 1).collect();
    let broadcast = live.iter().filter(|&&i| dims[i] == 1).count();
    if broadcast == live.len() {
        return Ok(0);
    }
    if broadcast > 0 {
        return Err(Unplannable::Batch(which));
    }
    // Innermost first: each live dimension steps over all the live ones inside it.
    let mut expected = None;
    for &i in live.iter().rev() {
        if let Some(step) = expected
            && strides[i] != step
        {
            return Err(Unplannable::Batch(which));
        }
        expected = Some(strides[i] * dims[i]);
    }
    Ok(live.last().map_or(0, |&i| strides[i]))
}

/// The call that computes `lhs · rhs` as burn's matmul does (batch dimensions broadcast where one side has
/// 1), or why no single call can.
pub fn plan(lhs: View, rhs: View) -> Result<GemmPlan, Unplannable> {
    let rank = lhs.dims.len();
    if rank < 2 || rhs.dims.len() != rank || lhs.strides.len() != rank || rhs.strides.len() != rank {
        return Err(Unplannable::Shapes);
    }
    let (rows, inner) = (lhs.dims[rank - 2], lhs.dims[rank - 1]);
    let (rhs_inner, cols) = (rhs.dims[rank - 2], rhs.dims[rank - 1]);
    if inner != rhs_inner {
        return Err(Unplannable::Shapes);
    }
    let mut out_dims = Vec::with_capacity(rank);
    for (&a, &b) in lhs.dims[..rank - 2].iter().zip(&rhs.dims[..rank - 2]) {
        out_dims.push(match (a, b) {
            _ if a == b => a,
            (1, _) => b,
            (_, 1) => a,
            _ => return Err(Unplannable::Shapes),
        });
    }
    let batch: usize = out_dims.iter().product();
    let stride_b = batch_stride(&lhs.dims[..rank - 2], &lhs.strides[..rank - 2], &out_dims, "lhs")?;
    let stride_a = batch_stride(&rhs.dims[..rank - 2], &rhs.strides[..rank - 2], &out_dims, "rhs")?;
    let lhs_order =
        order(rows, inner, lhs.strides[rank - 2], lhs.strides[rank - 1]).ok_or(Unplannable::Layout("lhs"))?;
    let rhs_order =
        order(inner, cols, rhs.strides[rank - 2], rhs.strides[rank - 1]).ok_or(Unplannable::Layout("rhs"))?;
    // Column-major, a row-major matrix reads as its transpose: as stored (N) it is the transposed operand
    // cuBLAS needs, and a column-major one needs cuBLAS to transpose it (T).
    let (transa, lda) = match rhs_order {
        Order::Rows(ld) => (Op::N, ld),
        Order::Columns(ld) => (Op::T, ld),
    };
    let (transb, ldb) = match lhs_order {
        Order::Rows(ld) => (Op::N, ld),
        Order::Columns(ld) => (Op::T, ld),
    };
    out_dims.extend([rows, cols]);
    let plan = GemmPlan {
        transa,
        transb,
        m: cols,
        n: rows,
        k: inner,
        lda,
        ldb,
        ldc: cols.max(1),
        stride_a,
        stride_b,
        stride_c: rows * cols,
        batch,
        out_dims,
    };
    let fits = |v: usize| i32::try_from(v).is_ok();
    let sizes = [plan.m, plan.n, plan.k, plan.lda, plan.ldb, plan.ldc, plan.batch];
    if !sizes.into_iter().all(fits) {
        return Err(Unplannable::TooLarge);
    }
    Ok(plan)
}

/// The operand (`"lhs"` or `"rhs"`) whose dense copy may let one call read the product, where `plan` found
/// none: a layout with strides along both matrix dimensions, or batch dimensions that do not merge into one
/// stride. A dense copy merges them unless the operand is broadcast over some of them only; `None` for shapes.
pub fn operand_to_copy(why: &Unplannable) -> Option<&'static str> {
    match why {
        Unplannable::Layout(which) | Unplannable::Batch(which) => Some(which),
        Unplannable::Shapes | Unplannable::TooLarge => None,
    }
}

/// The dtypes cuBLAS multiplies here: both operands in one of f32, bf16 and f16.
pub fn supported(lhs: DType, rhs: DType) -> bool {
    lhs == rhs && matches!(lhs, DType::F32 | DType::BF16 | DType::F16)
}

/// The product's dimensions as burn's matmul broadcasts them (`None` where it would reject the shapes).
pub fn product_dims(lhs: &[usize], rhs: &[usize]) -> Option<Vec<usize>> {
    let dense = |dims: &[usize]| {
        let mut strides = vec![1; dims.len()];
        for i in (0..dims.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * dims[i + 1];
        }
        strides
    };
    let (ls, rs) = (dense(lhs), dense(rhs));
    plan(View { dims: lhs, strides: &ls }, View { dims: rhs, strides: &rs }).ok().map(|p| p.out_dims)
}

/// `ModelBackend::matmul` on the CUDA backends: cuBLAS where `KILN_MATMUL=cublas` and the dtypes allow,
/// burn's matmul otherwise.
pub fn matmul<B: CublasMatmul, const D: usize>(lhs: Tensor<B, D>, rhs: Tensor<B, D>) -> Tensor<B, D> {
    if !cublas_enabled() || !supported(lhs.dtype(), rhs.dtype()) {
        return lhs.matmul(rhs);
    }
    let Some(dims) = product_dims(&lhs.dims(), &rhs.dims()) else {
        return lhs.matmul(rhs); // burn's message for shapes that do not multiply
    };
    if dims.iter().product::<usize>() == 0 || lhs.dims()[D - 1] == 0 {
        return lhs.matmul(rhs);
    }
    let out = B::cublas_matmul(lhs.into_primitive().tensor(), rhs.into_primitive().tensor(), dims.into());
    super::float_tensor(out)
}

/// `ModelBackend::projection` on the CUDA backends: with cuBLAS, every leading dimension of `x` taken as rows
/// of one product with the weight `[in, out]`; burn's `linear` otherwise.
pub fn projection<B: CublasMatmul, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 2>) -> Tensor<B, D> {
    if !cublas_enabled() {
        return burn::tensor::module::linear(x, weight, None);
    }
    let mut dims = x.dims();
    let [d_in, d_out] = weight.dims();
    let rows = dims[..D - 1].iter().product();
    dims[D - 1] = d_out;
    matmul(x.reshape([rows, d_in]), weight).reshape(dims)
}

/// The backends whose matrix products cuBLAS can compute: `cublas_matmul` takes operands of one supported
/// dtype whose product has dimensions `out` (`product_dims`).
pub trait CublasMatmul: burn::tensor::backend::Backend {
    fn cublas_matmul(
        lhs: burn::tensor::ops::FloatTensor<Self>,
        rhs: burn::tensor::ops::FloatTensor<Self>,
        out: burn::tensor::Shape,
    ) -> burn::tensor::ops::FloatTensor<Self>;
}

#[cfg(feature = "cuda")]
pub use device::{cublas_library, self_check};

#[cfg(feature = "cuda")]
mod device {
    use std::cell::RefCell;
    use std::ffi::c_void;
    use std::time::{Duration, Instant};

    use burn::tensor::backend::Backend;
    use burn::tensor::ops::{FloatTensor, FloatTensorOps};
    use burn::tensor::{DType, Distribution, Shape, Tensor, TensorMetadata};
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
    use burn_fusion::stream::Operation;
    use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
    use burn_ir::{CustomOpIr, HandleContainer};
    use cubecl::client::ComputeClient;
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cudarc::cublas::sys as blas;
    use cudarc::driver::result as driver;
    use cudarc::driver::sys as stream_sys;

    use super::{CublasMatmul, GemmPlan, Op, Unplannable, View, operand_to_copy, plan};
    use crate::backend::{MATMUL_ENV, MatmulKernels, matmul_kernels};
    use crate::kernels::stream_order::StreamFlag;
    use crate::kernels::{outputs, register_custom, register_float_outputs};

    /// Whether cuBLAS loads here: `Ok` with what the loader looked for, or an error that says how to provide
    /// it (cudarc panics at the first call into a library it cannot find).
    pub fn cublas_library() -> Result<(), String> {
        // SAFETY: opens and closes the library by name, as cudarc's own lookup does; nothing of it is called.
        if unsafe { blas::is_culib_present() } {
            return Ok(());
        }
        let names: Vec<String> =
            cudarc::get_lib_name_candidates("cublas").into_iter().filter(|n| n.starts_with("libcublas.so")).collect();
        Err(format!(
            "{MATMUL_ENV}={}, but cuBLAS is not found under the names cudarc loads it by ({}): add the \
             directory of PyTorch's nvidia-cublas wheel (site-packages/nvidia/cu13/lib or nvidia/cublas/lib) to \
             LD_LIBRARY_PATH, or unset {MATMUL_ENV}",
            matmul_kernels().name(),
            names.join(", ")
        ))
    }

    /// A cuBLAS handle on its own stream, in one device's primary context (cubecl's), for one thread, and
    /// the flag that orders the stream around cubecl's (made at the first device-ordered product).
    struct DeviceBlas {
        ordinal: usize,
        context: cudarc::driver::sys::CUcontext,
        handle: blas::cublasHandle_t,
        stream: cudarc::driver::sys::CUstream,
        order: RefCell<Option<OrderFlag>>,
    }

    /// The flag that orders cuBLAS's stream around cubecl's, and its device address: fixed while the flag's
    /// tensor holds the memory, so asked of cubecl's device thread (a blocking round trip) once, not per
    /// product.
    struct OrderFlag {
        flag: StreamFlag<CudaRuntime>,
        at: u64,
    }

    impl OrderFlag {
        fn new(client: ComputeClient<CudaRuntime>, device: CudaDevice) -> Self {
            let flag = StreamFlag::new(client, device);
            let at = device_address(flag.tensor());
            OrderFlag { flag, at }
        }
    }

    /// The address of `t`'s device memory, valid while `t` (or a clone of its handle) holds that memory:
    /// cubecl's pools never move a live allocation.
    fn device_address(t: &CubeTensor<CudaRuntime>) -> u64 {
        let memory = t.client.get_resource(t.handle.clone());
        memory.unwrap_or_else(|e| panic!("cuBLAS matmul: a tensor's memory: {e:?}")).resource().ptr
    }

    thread_local! {
        static HANDLES: RefCell<Vec<DeviceBlas>> = const { RefCell::new(Vec::new()) };
    }

    fn check<E: std::fmt::Debug>(what: &str, result: Result<(), E>) {
        if let Err(e) = result {
            panic!("cuBLAS matmul: {what} failed: {e:?} (unset {} to run burn's matmul)", MATMUL_ENV);
        }
    }

    /// Runs `f` with this thread's handle for device `ordinal`, its context made current.
    fn with_blas<T>(ordinal: usize, f: impl FnOnce(&DeviceBlas) -> T) -> T {
        HANDLES.with(|cell| {
            let mut handles = cell.borrow_mut();
            let at = match handles.iter().position(|h| h.ordinal == ordinal) {
                Some(at) => at,
                None => {
                    handles.push(open(ordinal));
                    handles.len() - 1
                }
            };
            let blas = &handles[at];
            // SAFETY: the device's primary context, retained in `open` and never released.
            check("making the device's context current", unsafe { driver::ctx::set_current(blas.context) });
            f(blas)
        })
    }

    fn open(ordinal: usize) -> DeviceBlas {
        let index = i32::try_from(ordinal).expect("a CUDA device index fits in i32");
        let device = driver::device::get(index);
        let device = device.unwrap_or_else(|e| panic!("cuBLAS matmul: CUDA device {ordinal}: {e:?}"));
        // SAFETY: a device the driver returned; the primary context is the one cubecl computes in.
        let context = unsafe { driver::primary_ctx::retain(device) };
        let context = context.unwrap_or_else(|e| panic!("cuBLAS matmul: device {ordinal}'s context: {e:?}"));
        // SAFETY: a context just retained.
        check("making the device's context current", unsafe { driver::ctx::set_current(context) });
        let stream = driver::stream::create(driver::stream::StreamKind::NonBlocking);
        let stream = stream.unwrap_or_else(|e| panic!("cuBLAS matmul: a stream on device {ordinal}: {e:?}"));
        let handle = cudarc::cublas::result::create_handle();
        let handle = handle.unwrap_or_else(|e| panic!("cuBLAS matmul: cublasCreate on device {ordinal}: {e:?}"));
        // SAFETY: the handle and stream were just created in the current context.
        check("cublasSetStream", unsafe { cudarc::cublas::result::set_stream(handle, stream as blas::cudaStream_t) });
        DeviceBlas { ordinal, context, handle, stream, order: RefCell::new(None) }
    }

    /// How long `self_check` may take.
    const CHECK_LIMIT: Duration = Duration::from_secs(120);
    const WAIT_AT_LEAST: u32 = stream_sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32;
    const WRITE_DEFAULT: u32 = stream_sys::CUstreamWriteValue_flags_enum::CU_STREAM_WRITE_VALUE_DEFAULT as u32;

    fn data_type(dtype: DType) -> blas::cudaDataType {
        match dtype {
            DType::F32 => blas::cudaDataType::CUDA_R_32F,
            DType::BF16 => blas::cudaDataType::CUDA_R_16BF,
            DType::F16 => blas::cudaDataType::CUDA_R_16F,
            other => panic!("cuBLAS matmul: no {other:?} products (super::supported)"),
        }
    }

    fn operation(op: Op) -> blas::cublasOperation_t {
        match op {
            Op::N => blas::cublasOperation_t::CUBLAS_OP_N,
            Op::T => blas::cublasOperation_t::CUBLAS_OP_T,
        }
    }

    /// `lhs · rhs` into a dense `out` by one cuBLAS call, ordered after cubecl's work on the operands and
    /// before cubecl's next; accumulated in f32 (exact f32 products for f32, no TF32).
    fn gemm(
        lhs: &CubeTensor<CudaRuntime>,
        rhs: &CubeTensor<CudaRuntime>,
        out: &CubeTensor<CudaRuntime>,
        plan: &GemmPlan,
    ) {
        let started = Instant::now();
        if matmul_kernels() == MatmulKernels::CublasHostOrdered {
            // The operands' writers, and any reader of the output's memory before it, are done.
            check("waiting for cubecl's stream", cubecl::future::block_on(out.client.sync()));
            let memory = operand_memory(lhs, rhs, out);
            let operands_ready = Instant::now();
            with_blas(out.device.index, |blas| {
                launch_gemm(blas, plan, out.dtype, memory);
                // SAFETY: this thread's stream, created in `open`.
                check("waiting for cuBLAS's stream", unsafe { driver::stream::synchronize(blas.stream) });
            });
            super::record(operands_ready - started, operands_ready.elapsed());
        } else {
            with_blas(out.device.index, |blas| {
                let mut order = blas.order.borrow_mut();
                let order = order.get_or_insert_with(|| OrderFlag::new(out.client.clone(), out.device.clone()));
                let (flag, at) = (&mut order.flag, order.at);
                let (ready, done) = match flag.next_marks() {
                    Some(marks) => marks,
                    None => {
                        // cuBLAS's stream idle: every "done" written, so no wait for an old mark is left queued
                        // on either stream once `restart` has drained cubecl's.
                        // SAFETY: this thread's stream, created in `open`.
                        check("waiting for cuBLAS's stream", unsafe { driver::stream::synchronize(blas.stream) });
                        flag.restart();
                        flag.next_marks().expect("marks after a restart")
                    }
                };
                // Queued on cubecl's stream after the operands' writers (and any reader of the output's memory
                // before it). The addresses are blocking round trips to cubecl's device thread, which takes its
                // commands in order: once they return, the set is on cubecl's stream, before the wait for it
                // is queued below (`stream_order`: no wait is queued before what satisfies it).
                flag.set(ready);
                let memory = operand_memory(lhs, rhs, out);
                // SAFETY: the flag's memory, held by `flag` for the thread's life; this thread's stream.
                let waited = unsafe { stream_sys::cuStreamWaitValue32_v2(blas.stream, at, ready, WAIT_AT_LEAST) };
                check(
                    "cuStreamWaitValue32 (KILN_MATMUL=cublas-host orders the products from the host instead)",
                    waited.result(),
                );
                launch_gemm(blas, plan, out.dtype, memory);
                // SAFETY: as the wait above.
                let written = unsafe { stream_sys::cuStreamWriteValue32_v2(blas.stream, at, done, WRITE_DEFAULT) };
                check(
                    "cuStreamWriteValue32 (KILN_MATMUL=cublas-host orders the products from the host instead)",
                    written.result(),
                );
                // Queued only now that the "done" it waits for is on cuBLAS's stream.
                flag.wait(done);
            });
            super::record(Duration::ZERO, started.elapsed());
        }
        // The operands and the output stay held by the caller's tensors; any later cubecl kernel that reuses
        // their memory once those are dropped is queued after the wait above, or after the host's waits.
    }

    /// The device memory of `[rhs, lhs, out]`: cuBLAS's column-major `A`, `B` and `C`.
    fn operand_memory(
        lhs: &CubeTensor<CudaRuntime>,
        rhs: &CubeTensor<CudaRuntime>,
        out: &CubeTensor<CudaRuntime>,
    ) -> [u64; 3] {
        [device_address(rhs), device_address(lhs), device_address(out)]
    }

    /// The one cuBLAS call of `plan` on `blas`'s stream over the device memory of `[rhs, lhs, out]` (cuBLAS's
    /// column-major `A`, `B`, `C`).
    fn launch_gemm(blas: &DeviceBlas, plan: &GemmPlan, dtype: DType, [a, b, c]: [u64; 3]) {
        let dtype = data_type(dtype);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let narrow = |v: usize| v as i32; // `plan` checked every size against i32
        let wide = |v: usize| v as i64;
        // SAFETY: the pointers are the tensors' memory, held by the caller's tensors until the product is
        // ordered before any reuse; `plan` sized every argument against the tensors' shapes and strides;
        // alpha and beta are host f32 values as CUBLAS_COMPUTE_32F reads them (cuBLAS reads host scalars
        // before the call returns).
        let done = unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                blas.handle,
                operation(plan.transa),
                operation(plan.transb),
                narrow(plan.m),
                narrow(plan.n),
                narrow(plan.k),
                (&alpha as *const f32).cast::<c_void>(),
                a as *const c_void,
                dtype,
                narrow(plan.lda),
                wide(plan.stride_a),
                b as *const c_void,
                dtype,
                narrow(plan.ldb),
                wide(plan.stride_b),
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                dtype,
                narrow(plan.ldc),
                wide(plan.stride_c),
                narrow(plan.batch),
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check("cublasGemmStridedBatchedEx", done);
    }

    fn view(t: &CubeTensor<CudaRuntime>) -> (Vec<usize>, Vec<usize>) {
        (t.meta.shape().to_vec(), t.meta.strides().to_vec())
    }

    fn plan_of(lhs: &CubeTensor<CudaRuntime>, rhs: &CubeTensor<CudaRuntime>) -> Result<GemmPlan, Unplannable> {
        let ((ld, ls), (rd, rs)) = (view(lhs), view(rhs));
        plan(View { dims: &ld, strides: &ls }, View { dims: &rd, strides: &rs })
    }

    impl<F: FloatElement, I: IntElement, BT: BoolElement> CublasMatmul for CubeBackend<CudaRuntime, F, I, BT> {
        fn cublas_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, out: Shape) -> FloatTensor<Self> {
            // A view no call reads is copied dense, the operand named first; at most both are (a dense
            // operand's copy is itself, and the plan's answer stays).
            let (mut lhs, mut rhs) = (lhs, rhs);
            let mut planned = plan_of(&lhs, &rhs);
            for _ in 0..2 {
                match planned.as_ref().err().and_then(operand_to_copy) {
                    Some("lhs") => lhs = into_contiguous(lhs),
                    Some(_) => rhs = into_contiguous(rhs),
                    None => break,
                }
                planned = plan_of(&lhs, &rhs);
            }
            let Ok(plan) = planned else {
                return Self::float_matmul(lhs, rhs);
            };
            debug_assert_eq!(&plan.out_dims[..], &out[..], "the product's shape");
            let (client, device) = (lhs.client.clone(), lhs.device.clone());
            let product = empty_device_contiguous_dtype::<CudaRuntime>(client, device, out, lhs.dtype);
            gemm(&lhs, &rhs, &product, &plan);
            product
        }
    }

    /// The product as one custom operation of burn-fusion's stream, run on the backend under it.
    #[derive(Debug, Clone)]
    struct FusedCublas<B> {
        desc: CustomOpIr,
        _backend: std::marker::PhantomData<B>,
    }

    impl<B: FusionBackend + CublasMatmul> Operation<B::FusionRuntime> for FusedCublas<B> {
        fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
            let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
            let lhs = handles.get_float_tensor::<B>(&inputs[0]);
            let rhs = handles.get_float_tensor::<B>(&inputs[1]);
            let product = B::cublas_matmul(lhs, rhs, outputs[0].shape.clone());
            register_float_outputs::<B>(handles, outputs, [product]);
        }
    }

    impl<B: FusionBackend + CublasMatmul> CublasMatmul for Fusion<B> {
        fn cublas_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, out: Shape) -> FloatTensor<Self> {
            let dtype = lhs.dtype();
            let make = |desc| FusedCublas::<B> { desc, _backend: std::marker::PhantomData };
            let [product] =
                outputs(register_custom::<B, _>("kiln_cublas_matmul", vec![lhs, rhs], &[(out, dtype)], make));
            product
        }
    }

    /// Checks cuBLAS's products against burn's on `B` before a run relies on them: a plain product, a
    /// transposed operand, a batch, a batch broadcast on one side, and batch dimensions copied dense first,
    /// in `B`'s float dtype. An error says which differed and by how much (or that cuBLAS is missing). A
    /// check still running after `CHECK_LIMIT` (its kernels' compilation included) ends the process with
    /// what hung, rather than leaving a run waiting on a device that will not answer.
    pub fn self_check<B: CublasMatmul>(device: &B::Device) -> Result<(), String> {
        cublas_library()?;
        let (_finished, watch) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if watch.recv_timeout(CHECK_LIMIT) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                eprintln!(
                    "error: the check of cuBLAS's products ({MATMUL_ENV}={}) had not finished after {} s: the \
                     products or their ordering around cubecl's kernels hang on this device (set \
                     {MATMUL_ENV}=cublas-host to order them from the host, or unset it)",
                    matmul_kernels().name(),
                    CHECK_LIMIT.as_secs()
                );
                std::process::exit(1);
            }
        });
        let dtype = burn::tensor::get_device_settings::<B>(device).float_dtype;
        let tolerance = if dtype == burn::tensor::FloatDType::F32 { 1e-4 } else { 3e-2 };
        let random =
            |dims: [usize; 3]| Tensor::<B, 3>::random(dims, Distribution::Normal(0.0, 1.0), device).cast(dtype);
        let cases: [(&str, Tensor<B, 3>, Tensor<B, 3>); 4] = [
            ("[1, 37, 53] · [1, 53, 29]", random([1, 37, 53]), random([1, 53, 29])),
            ("[2, 37, 53] · [2, 29, 53]ᵀ", random([2, 37, 53]), random([2, 29, 53]).swap_dims(1, 2)),
            ("[3, 53, 37]ᵀ · [3, 53, 29]", random([3, 53, 37]).swap_dims(1, 2), random([3, 53, 29])),
            ("[4, 37, 53] · [1, 53, 29]", random([4, 37, 53]), random([1, 53, 29])),
        ];
        for (name, lhs, rhs) in cases {
            let want = lhs.clone().matmul(rhs.clone());
            let got = super::matmul(lhs, rhs);
            compare(name, got, want, tolerance)?;
        }
        // Swapped batch dimensions, which no one stride steps through: the operand is copied dense first.
        let random4 =
            |dims: [usize; 4]| Tensor::<B, 4>::random(dims, Distribution::Normal(0.0, 1.0), device).cast(dtype);
        let (lhs, rhs) = (random4([2, 3, 37, 53]).swap_dims(0, 1), random4([3, 2, 53, 29]));
        let want = lhs.clone().matmul(rhs.clone()).reshape([6, 37, 29]);
        let got = super::matmul(lhs, rhs).reshape([6, 37, 29]);
        compare("[2, 3, 37, 53]↔[3, 2, …] · [3, 2, 53, 29]", got, want, tolerance)?;
        Ok(())
    }

    fn compare<B: Backend>(name: &str, got: Tensor<B, 3>, want: Tensor<B, 3>, tolerance: f32) -> Result<(), String> {
        if got.dims() != want.dims() {
            return Err(format!("cuBLAS's {name} has dims {:?}, burn's {:?}", got.dims(), want.dims()));
        }
        let values = |t: Tensor<B, 3>| t.cast(burn::tensor::FloatDType::F32).into_data().to_vec::<f32>();
        let (got, want) = (values(got).map_err(|e| format!("{e:?}"))?, values(want).map_err(|e| format!("{e:?}"))?);
        let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let gap = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0f32, f32::max);
        if gap.is_nan() || gap > tolerance * scale {
            return Err(format!(
                "cuBLAS's product {name} differs from burn's by {gap} (largest value {scale}, tolerance {tolerance}): \
                 unset {} to run burn's matmul",
                MATMUL_ENV
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLAS's documented semantics of one strided batched call, read literally on host buffers (`a`, `b`
    /// and the output, column-major, with the plan's operations, leading dimensions and batch strides).
    fn run_plan(plan: &GemmPlan, a: &[f64], a_at: usize, b: &[f64], b_at: usize) -> Vec<f64> {
        let mut c = vec![f64::NAN; plan.batch * plan.stride_c];
        for p in 0..plan.batch {
            let (a0, b0, c0) = (a_at + p * plan.stride_a, b_at + p * plan.stride_b, p * plan.stride_c);
            for i in 0..plan.m {
                for j in 0..plan.n {
                    let mut sum = 0.0;
                    for l in 0..plan.k {
                        let x = match plan.transa {
                            Op::N => a[a0 + i + l * plan.lda],
                            Op::T => a[a0 + l + i * plan.lda],
                        };
                        let y = match plan.transb {
                            Op::N => b[b0 + l + j * plan.ldb],
                            Op::T => b[b0 + j + l * plan.ldb],
                        };
                        sum += x * y;
                    }
                    c[c0 + i + j * plan.ldc] = sum;
                }
            }
        }
        c
    }

    /// A strided view into a buffer: its start, dimensions and strides.
    struct Strided {
        at: usize,
        dims: Vec<usize>,
        strides: Vec<usize>,
    }

    impl Strided {
        fn dense(dims: &[usize]) -> Self {
            let mut strides = vec![1; dims.len()];
            for i in (0..dims.len() - 1).rev() {
                strides[i] = strides[i + 1] * dims[i + 1];
            }
            Strided { at: 0, dims: dims.to_vec(), strides }
        }

        /// The view with dimensions `i` and `j` swapped (burn's `swap_dims`: strides move with them).
        fn swapped(mut self, i: usize, j: usize) -> Self {
            self.dims.swap(i, j);
            self.strides.swap(i, j);
            self
        }

        /// The view's elements `from..from + len` along `dim` (burn's `narrow`: the start moves).
        fn narrowed(mut self, dim: usize, from: usize, len: usize) -> Self {
            self.at += from * self.strides[dim];
            self.dims[dim] = len;
            self
        }

        fn view(&self) -> View<'_> {
            View { dims: &self.dims, strides: &self.strides }
        }

        /// The element at a full index (batch dimensions of size 1 broadcast).
        fn get(&self, data: &[f64], batch: &[usize], r: usize, c: usize) -> f64 {
            let rank = self.dims.len();
            let mut at = self.at + r * self.strides[rank - 2] + c * self.strides[rank - 1];
            for (d, &i) in batch.iter().enumerate() {
                at += if self.dims[d] == 1 { 0 } else { i * self.strides[d] };
            }
            data[at]
        }
    }

    /// The row-major product of two views, element by element from their strides: what the plan must give.
    fn product(lhs: &Strided, l: &[f64], rhs: &Strided, r: &[f64], out_dims: &[usize]) -> Vec<f64> {
        let rank = out_dims.len();
        let (rows, cols, inner) = (out_dims[rank - 2], out_dims[rank - 1], lhs.dims[rank - 1]);
        let batch_dims = &out_dims[..rank - 2];
        let mut out = Vec::new();
        let batches: usize = batch_dims.iter().product();
        for flat in 0..batches {
            let mut index = vec![0; batch_dims.len()];
            let mut rest = flat;
            for d in (0..batch_dims.len()).rev() {
                index[d] = rest % batch_dims[d];
                rest /= batch_dims[d];
            }
            for i in 0..rows {
                for j in 0..cols {
                    out.push((0..inner).map(|t| lhs.get(l, &index, i, t) * rhs.get(r, &index, t, j)).sum());
                }
            }
        }
        out
    }

    fn buffer(len: usize, seed: u64) -> Vec<f64> {
        let mut state = seed;
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) % 17) as f64 - 8.0
            })
            .collect()
    }

    fn assert_plans(name: &str, lhs: Strided, rhs: Strided, storage: (usize, usize)) -> GemmPlan {
        let (l, r) = (buffer(storage.0, 3), buffer(storage.1, 5));
        let plan = plan(lhs.view(), rhs.view()).unwrap_or_else(|why| panic!("{name}: {why:?}"));
        let want = product(&lhs, &l, &rhs, &r, &plan.out_dims);
        let got = run_plan(&plan, &r, rhs.at, &l, lhs.at);
        assert_eq!(got, want, "{name}: {plan:?}");
        plan
    }

    #[test]
    fn plans_compute_the_row_major_product_of_every_layout_kiln_multiplies() {
        // A projection: rows · weight, both dense.
        let p = assert_plans("dense", Strided::dense(&[7, 5]), Strided::dense(&[5, 3]), (35, 15));
        assert_eq!((p.transa, p.transb, p.m, p.n, p.k, p.batch), (Op::N, Op::N, 3, 7, 5, 1));
        // Its input gradient: grad · weightᵀ (the weight's transposed view).
        let p =
            assert_plans("rhs transposed", Strided::dense(&[7, 3]), Strided::dense(&[5, 3]).swapped(0, 1), (21, 15));
        assert_eq!((p.transa, p.transb), (Op::T, Op::N));
        // Its weight gradient: xᵀ · grad.
        let p =
            assert_plans("lhs transposed", Strided::dense(&[7, 5]).swapped(0, 1), Strided::dense(&[7, 3]), (35, 21));
        assert_eq!((p.transa, p.transb), (Op::N, Op::T));
        // The attention's scores of a chunk: q rows (a block of the sequence's rows) · kᵀ, per kv head.
        let q = Strided::dense(&[1, 2, 12, 4]).narrowed(2, 4, 6);
        let k = Strided::dense(&[1, 2, 12, 4]).swapped(2, 3);
        let p = assert_plans("chunk scores", q, k, (96, 96));
        assert_eq!((p.batch, p.stride_b, p.stride_a, p.out_dims.clone()), (2, 48, 48, vec![1, 2, 6, 12]));
        // Both operands transposed, batched.
        let lhs = Strided::dense(&[3, 4, 6]).swapped(1, 2);
        let rhs = Strided::dense(&[3, 5, 4]).swapped(1, 2);
        assert_plans("both transposed", lhs, rhs, (72, 60));
        // A batch broadcast on one side: over all batch dimensions, stride 0.
        let p = assert_plans("broadcast rhs", Strided::dense(&[2, 3, 4, 5]), Strided::dense(&[1, 1, 5, 6]), (120, 30));
        assert_eq!((p.batch, p.stride_a), (6, 0));
        let p = assert_plans("broadcast lhs", Strided::dense(&[1, 4, 5]), Strided::dense(&[3, 5, 2]), (20, 30));
        assert_eq!((p.batch, p.stride_b, p.stride_a), (3, 0, 10));
        // Vectors and single rows, whose unused strides are free.
        assert_plans("row · matrix", Strided::dense(&[1, 5]), Strided::dense(&[5, 3]), (5, 15));
        assert_plans("matrix · column", Strided::dense(&[4, 5]), Strided::dense(&[5, 1]), (20, 5));
        assert_plans("column of a transpose", Strided::dense(&[4, 5]), Strided::dense(&[1, 5]).swapped(0, 1), (20, 5));
        // A slice of columns: the rows keep the whole tensor's stride as their leading dimension.
        let p =
            assert_plans("column slice", Strided::dense(&[6, 10]).narrowed(1, 3, 4), Strided::dense(&[4, 2]), (60, 8));
        assert_eq!(p.ldb, 10);
        // Batch dimensions that merge into one stride after a swap of the matrix dimensions.
        let lhs = Strided::dense(&[2, 3, 5, 4]).swapped(2, 3);
        assert_plans("merged batch", lhs, Strided::dense(&[2, 3, 5, 2]), (120, 60));
        // The MoE's experts batched (`models::experts`): padded rows · every expert's weights, then the
        // weights' gradient `x_padᵀ · grad_pad` and the rows' `grad_pad · Wᵀ`, all in place.
        let p = assert_plans("experts", Strided::dense(&[3, 4, 5]), Strided::dense(&[3, 5, 2]), (60, 30));
        assert_eq!((p.batch, p.stride_b, p.stride_a), (3, 20, 10));
        let x_t = Strided::dense(&[3, 4, 5]).swapped(1, 2);
        let p = assert_plans("experts' weight gradient", x_t, Strided::dense(&[3, 4, 2]), (60, 24));
        assert_eq!((p.transa, p.transb, p.batch), (Op::N, Op::T, 3));
        let w_t = Strided::dense(&[3, 5, 2]).swapped(1, 2);
        let p = assert_plans("experts' row gradient", Strided::dense(&[3, 4, 2]), w_t, (24, 30));
        assert_eq!((p.transa, p.transb, p.batch), (Op::T, Op::N, 3));
        // A group past the batch's capacity: its block of rows · its expert's weights (one of the stack).
        let expert = Strided { at: 10, dims: vec![5, 2], strides: vec![2, 1] };
        assert_plans("one expert's overflow", Strided::dense(&[9, 5]).narrowed(0, 2, 4), expert, (45, 30));
    }

    #[test]
    fn views_no_single_call_reads_say_why() {
        let dims = |d: &[usize]| Strided::dense(d);
        // Rows and columns both strided: a copy is needed (a column slice of the transpose's rows).
        let lhs = Strided { at: 0, dims: vec![3, 4], strides: vec![8, 2] };
        assert_eq!(plan(lhs.view(), dims(&[4, 2]).view()), Err(Unplannable::Layout("lhs")));
        let expanded = Strided { at: 0, dims: vec![4, 3], strides: vec![0, 1] };
        assert_eq!(plan(dims(&[2, 4]).view(), expanded.view()), Err(Unplannable::Layout("rhs")));
        // Broadcast over one batch dimension of two.
        assert_eq!(plan(dims(&[2, 3, 4, 5]).view(), dims(&[1, 3, 5, 6]).view()), Err(Unplannable::Batch("rhs")));
        // Batch dimensions swapped: no one stride steps through them in order.
        let lhs = dims(&[2, 3, 4, 5]).swapped(0, 1);
        assert_eq!(plan(lhs.view(), dims(&[3, 2, 5, 6]).view()), Err(Unplannable::Batch("lhs")));
        // Shapes burn rejects.
        assert_eq!(plan(dims(&[2, 3]).view(), dims(&[4, 5]).view()), Err(Unplannable::Shapes));
        assert_eq!(plan(dims(&[2, 3, 4]).view(), dims(&[3, 4, 5]).view()), Err(Unplannable::Shapes));
        assert_eq!(plan(dims(&[3]).view(), dims(&[3]).view()), Err(Unplannable::Shapes));
        assert_eq!(product_dims(&[5, 2, 3], &[1, 3, 4]), Some(vec![5, 2, 4]));
        assert_eq!(product_dims(&[2, 3], &[4, 5]), None);
    }

    #[test]
    fn a_dense_copy_of_the_named_operand_lets_one_call_read_it() {
        // A head-major view of token-major rows cut into chunks: `[1, seq, heads, d]` seen as `[1, heads,
        // chunks, C, d]` (swap, then the sequence split), whose heads and chunks no one stride steps through.
        let (heads, chunks, size, d) = (3, 4, 2, 5);
        let seq = chunks * size;
        let k = Strided {
            at: 0,
            dims: vec![1, heads, chunks, size, d],
            strides: vec![seq * heads * d, d, size * heads * d, heads * d, 1],
        };
        let q = Strided::dense(&[1, heads, chunks, size, d]);
        let why = plan(q.view(), k.swapped(3, 4).view()).expect_err("the chunked view has no batch stride");
        assert_eq!((why.clone(), operand_to_copy(&why)), (Unplannable::Batch("rhs"), Some("rhs")));
        let dense_t = Strided::dense(&[1, heads, chunks, size, d]).swapped(3, 4);
        assert_plans("the chunks copied dense", q, dense_t, (seq * heads * d, seq * heads * d));
        // Both matrix dimensions strided: the copy reads as a plain matrix.
        let lhs = Strided { at: 0, dims: vec![3, 4], strides: vec![8, 2] };
        let why = plan(lhs.view(), Strided::dense(&[4, 2]).view()).expect_err("strided rows and columns");
        assert_eq!(operand_to_copy(&why), Some("lhs"));
        assert_plans("the rows copied dense", Strided::dense(&[3, 4]), Strided::dense(&[4, 2]), (12, 8));
        // Batch dimensions swapped: dense again, they merge.
        let lhs = Strided::dense(&[2, 3, 4, 5]).swapped(0, 1);
        let why = plan(lhs.view(), Strided::dense(&[3, 2, 5, 6]).view()).expect_err("swapped batch");
        assert_eq!(operand_to_copy(&why), Some("lhs"));
        assert_plans(
            "the batch copied dense",
            Strided::dense(&[3, 2, 4, 5]),
            Strided::dense(&[3, 2, 5, 6]),
            (120, 180),
        );
        // A broadcast over one batch dimension of two stays unreadable when dense: burn's matmul runs it.
        let (lhs, rhs) = (Strided::dense(&[2, 3, 4, 5]), Strided::dense(&[1, 3, 5, 6]));
        assert_eq!(plan(lhs.view(), rhs.view()), Err(Unplannable::Batch("rhs")));
        // Shapes that do not multiply name no operand.
        let why = plan(Strided::dense(&[2, 3]).view(), Strided::dense(&[4, 5]).view()).expect_err("shapes");
        assert_eq!(operand_to_copy(&why), None);
        assert_eq!(operand_to_copy(&Unplannable::TooLarge), None);
    }

    #[test]
    fn cublas_multiplies_f32_bf16_and_f16_alike_operands_only() {
        assert!(supported(DType::BF16, DType::BF16) && supported(DType::F32, DType::F32));
        assert!(!supported(DType::F32, DType::BF16) && !supported(DType::F64, DType::F64));
    }
}
