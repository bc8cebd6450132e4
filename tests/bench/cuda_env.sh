# Sourced by the benchmark scripts on a GPU machine. kiln's CUDA build loads the NVIDIA driver (libcuda) and
# NVRTC (libnvrtc.so.<major>) by name at run time. A machine whose only CUDA toolkit is the one PyTorch's pip
# wheels bring keeps NVRTC under site-packages/nvidia/.../lib, off the loader's path: add those directories
# to LD_LIBRARY_PATH (PyTorch finds them itself; kiln cannot).
# cuBLAS (`KILN_MATMUL=cublas`) is loaded the same way, from the same wheels.
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so' || ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so'; then
    nvrtc_dirs=$("${PYTHON:-python3}" - 2>/dev/null <<'PY'
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
dirs = {os.path.dirname(p) for r in roots for lib in ("libnvrtc.so*", "libcublas.so*")
        for p in glob.glob(os.path.join(r, "nvidia", "**", lib), recursive=True)}
print(":".join(sorted(dirs)))
PY
    )
    if [[ -n $nvrtc_dirs ]]; then
        export LD_LIBRARY_PATH=$nvrtc_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        echo "cuda_env: NVRTC and cuBLAS from PyTorch's wheels: $nvrtc_dirs" >&2
    fi
fi
