//! kiln's kernels compiled for CUDA without a GPU (a test). Each kernel file lists the variants its CUDA
//! launches make (dtypes, compile-time values, cube sizes) as CubeCL kernel definitions; cubecl-cpp's CUDA
//! dialect writes their CUDA C++ with the compilation options burn's CUDA backend takes on an H100 (sm_90),
//! and NVRTC, where this machine has it, compiles each to PTX as the backend does on its first launch. A
//! kernel that CubeCL cannot write for CUDA, or that NVRTC rejects, fails here rather than in a GPU session.
//!
//! Defining a kernel takes a compute client, and the only one a machine without a GPU has is Vulkan's
//! (lavapipe): the definitions are CubeCL's IR, the same for every runtime, so the test builds them on it.
//! NVRTC is loaded from `KILN_NVRTC` (the library's path) with CUDA's headers from `KILN_CUDA_INCLUDE`
//! (directories joined by `:`), and its `libnvrtc-builtins` from the loader's path (`LD_LIBRARY_PATH`);
//! .ci/run installs them from NVIDIA's pip wheels (CUDA 13.0, the GPU machines' version) and sets all three.
//! Without them the kernels' CUDA C++ is still written and checked, and the test says that NVRTC did not run.
//! `KILN_CUDA_SOURCE_OUT=<dir>` keeps each variant's CUDA C++ there (`<variant name>.cu`), to read what a GPU runs.

use std::ffi::{CStr, CString, c_char, c_int, c_void};

use cubecl::Compiler;
use cubecl::prelude::*;
use cubecl::wgpu::WgpuRuntime;
use cubecl_cpp::cuda::CudaDialect;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::shared::{CompilationOptions, CppCompiler, CppSupportedFeatures};

type CudaCompiler = CppCompiler<CudaDialect<CudaWmmaCompiler>>;

/// The runtime and compute client the definitions are built with.
pub(super) type Runtime = WgpuRuntime;
pub(super) type Client = ComputeClient<Runtime>;

/// A tensor argument as a kernel's definition sees it: not written in place of an input.
pub(super) fn tensor() -> TensorCompilationArg {
    TensorCompilationArg { inplace: None }
}

/// A sequence of `count` tensor arguments.
pub(super) fn tensors<C: CubePrimitive>(count: usize) -> SequenceCompilationArg<Tensor<C>> {
    SequenceCompilationArg { values: (0..count).map(|_| tensor()).collect() }
}

/// A sequence of `count` scalar arguments.
pub(super) fn scalars<C: LaunchArg<CompilationArg = ()>>(count: usize) -> SequenceCompilationArg<C> {
    SequenceCompilationArg { values: (0..count).map(|_| ()).collect() }
}

/// One launch configuration of a kernel: a name for the report, its definition and its address type, and
/// the id CubeCL files its compiled form under.
pub(super) struct Variant {
    pub(super) name: String,
    pub(super) definition: KernelDefinition,
    pub(super) address_type: StorageType,
    pub(super) id: KernelId,
}

impl Variant {
    pub(super) fn new<K: CubeKernel>(name: impl Into<String>, kernel: K) -> Self {
        Variant { name: name.into(), definition: kernel.define(), address_type: kernel.address_type(), id: kernel.id() }
    }
}

/// The settings a kernel's generated `launch` starts from (32-bit addresses, the macro's default), with its
/// cube of `units` units.
pub(super) fn settings(units: u32) -> KernelSettings {
    KernelSettings::default().cube_dim(CubeDim::new_1d(units)).address_type(AddressType::U32)
}

/// The compilation options burn's CUDA backend sets on an sm_90 device (cubecl-cuda's `CudaServer::init`).
fn sm90_options() -> CompilationOptions {
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            grid_constants: true,
            clusters: true,
            fast_math: true,
            fast_tanh: true,
            elect_sync: true,
        },
    }
}

/// A variant's CUDA C++ source, as the backend writes it in checked mode (kiln launches with bounds checks).
fn cuda_source(variant: Variant) -> Result<String, String> {
    let mut compiler = CudaCompiler::default();
    compiler
        .compile(variant.definition, &sm90_options(), ExecutionMode::Checked, variant.address_type)
        .map(|kernel| kernel.to_string())
        .map_err(|e| e.to_string())
}

type Program = *mut c_void;

/// NVRTC, loaded by path: the calls that compile one program and read its log and PTX size.
struct Nvrtc {
    library: libloading::Library,
    include_dirs: Vec<String>,
}

impl Nvrtc {
    /// From `KILN_NVRTC` and `KILN_CUDA_INCLUDE`; `None` where `KILN_NVRTC` is unset.
    fn from_env() -> Option<Result<Self, String>> {
        let path = std::env::var("KILN_NVRTC").ok().filter(|p| !p.is_empty())?;
        let include_dirs = std::env::var("KILN_CUDA_INCLUDE")
            .unwrap_or_default()
            .split(':')
            .filter(|d| !d.is_empty())
            .map(String::from)
            .collect();
        // SAFETY: loading NVRTC runs no initialisers beyond the library's own.
        let library = unsafe { libloading::Library::new(&path) };
        Some(library.map(|library| Nvrtc { library, include_dirs }).map_err(|e| format!("KILN_NVRTC={path}: {e}")))
    }

    fn call<T>(&self, name: &str) -> libloading::Symbol<'_, T> {
        // SAFETY: the symbol's type is NVRTC's documented signature for `name` (nvrtc.h).
        unsafe { self.library.get(name.as_bytes()) }.unwrap_or_else(|e| panic!("NVRTC has no {name}: {e}"))
    }

    /// Compiles `source` for sm_90a with the backend's options; the PTX's size in bytes, or NVRTC's log.
    fn compile(&self, source: &str) -> Result<usize, String> {
        type Create = unsafe extern "C" fn(
            *mut Program,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> c_int;
        type Compile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
        type Size = unsafe extern "C" fn(Program, *mut usize) -> c_int;
        type Log = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
        type Destroy = unsafe extern "C" fn(*mut Program) -> c_int;

        let source = CString::new(source).map_err(|e| e.to_string())?;
        let mut options = vec!["--gpu-architecture=sm_90a".to_string(), "-lineinfo".to_string()];
        options.extend(self.include_dirs.iter().map(|d| format!("--include-path={d}")));
        let options: Vec<CString> = options.into_iter().map(|o| CString::new(o).expect("no NUL in options")).collect();
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: NVRTC's C API as documented: the strings outlive the calls, the log buffer has the size
        // NVRTC reported, and the program is destroyed once.
        unsafe {
            let status = self.call::<Create>("nvrtcCreateProgram")(
                &mut program,
                source.as_ptr(),
                c"kernel.cu".as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if status != 0 {
                return Err(format!("nvrtcCreateProgram failed ({status})"));
            }
            let status =
                self.call::<Compile>("nvrtcCompileProgram")(program, option_ptrs.len() as c_int, option_ptrs.as_ptr());
            let result = if status == 0 {
                let mut size = 0usize;
                self.call::<Size>("nvrtcGetPTXSize")(program, &mut size);
                Ok(size)
            } else {
                let mut size = 0usize;
                self.call::<Size>("nvrtcGetProgramLogSize")(program, &mut size);
                let mut log = vec![0 as c_char; size.max(1)];
                self.call::<Log>("nvrtcGetProgramLog")(program, log.as_mut_ptr());
                Err(CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned())
            };
            self.call::<Destroy>("nvrtcDestroyProgram")(&mut program);
            result
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kilns_kernels_compile_for_cuda() {
        if let Err(why) = crate::backend::vulkan_ready(false) {
            eprintln!("skipped: {why}");
            return;
        }
        let client = <WgpuRuntime as cubecl::Runtime>::client(&Default::default());
        let variants: Vec<Variant> = [
            super::super::adamw::cuda_variants,
            super::super::attention::cuda_variants,
            super::super::chunk_solve::cuda_variants,
            super::super::conv::cuda_variants,
            super::super::cross_entropy::cuda_variants,
            super::super::decay_grads::cuda_variants,
            super::super::grad_norm::cuda_variants,
            super::super::norm::cuda_variants,
            super::super::scan::cuda_variants,
            super::super::stream_order::cuda_variants,
        ]
        .iter()
        .flat_map(|f| f(&client))
        .collect();
        let nvrtc = Nvrtc::from_env().map(|n| n.expect("KILN_NVRTC names a loadable NVRTC"));
        if let Some(nvrtc) = &nvrtc {
            // A pass below means NVRTC compiled the kernels, not that it accepts anything.
            let rejected = nvrtc.compile("extern \"C\" __global__ void k() { not_declared(); }");
            assert!(rejected.as_ref().is_err_and(|log| log.contains("not_declared")), "NVRTC: {rejected:?}");
        }
        let mut failures = Vec::new();
        let count = variants.len();
        for variant in variants {
            let name = variant.name.clone();
            // A persistent kernel cache files kernels by id, not body: the id must change with the sources.
            let id = format!("{:?}", variant.id);
            assert!(id.contains(&super::super::REVISION.to_string()), "{name}: its id has no revision: {id}");
            let source = match cuda_source(variant) {
                Ok(source) => source,
                Err(why) => {
                    failures.push(format!("{name}: CubeCL could not write CUDA C++: {why}"));
                    continue;
                }
            };
            assert!(source.contains("extern \"C\" __global__"), "{name}: no kernel entry point in\n{source}");
            if let Some(dir) = std::env::var_os("KILN_CUDA_SOURCE_OUT") {
                let file = std::path::Path::new(&dir).join(format!("{}.cu", name.replace([' ', '/'], "_")));
                std::fs::write(&file, &source).unwrap_or_else(|e| panic!("writing {}: {e}", file.display()));
            }
            if let Some(nvrtc) = &nvrtc {
                match nvrtc.compile(&source) {
                    Ok(ptx) => eprintln!("{name}: {ptx} bytes of PTX"),
                    Err(log) => failures.push(format!("{name}: NVRTC rejected it:\n{log}\n{source}")),
                }
            }
        }
        assert!(failures.is_empty(), "{} of {count} variants failed:\n{}", failures.len(), failures.join("\n\n"));
        if nvrtc.is_none() {
            eprintln!("{count} kernels written as CUDA C++; NVRTC did not run (set KILN_NVRTC and KILN_CUDA_INCLUDE)");
        }
    }
}
