#!/usr/bin/env python3
"""The losses of `kiln bench-train` runs of one tiny shape on several devices and precisions, side by side
against the CPU's f32 run (the reference: the parity tests tie it to transformers and PyTorch).

    parity.py SHAPE@RUN.json...   (bench-train's --out files, named by shape up to the '@'; gpu_session.sh's
                                  parity stage writes them)

Prints a markdown table; exits 1 when a run is off its reference by more than its precision allows (f32:
1e-4 relative, as the Vulkan tests ask; bf16 and f16: 1e-2) or has a non-finite loss, and 2 when a shape has
no CPU f32 run.
"""

import json
import math
import os
import sys

TOLERANCE = {"f32": 1e-4, "bf16": 1e-2, "f16": 1e-2}


def label(run: dict) -> str:
    fusion = {True: ", fused", False: ", unfused"}.get(run.get("fusion"), "")
    return f"{run['device']} {run['precision']}{fusion}{kernels(run)}{matmul(run)}" + (
        ", a matmul per expert" if run.get("experts_batched") is False else "") + (
        ", no masters (stochastic rounding)" if run.get("masters") == "stochastic" else "")


# kiln's CubeCL kernels by their JSON keys; absent on the CPU, which has none.
KERNELS = {"attention": "attention", "loss": "loss", "norm": "norm", "optim": "optimizer", "scan": "scan",
           "conv": "conv"}


def kernels(run: dict) -> str:
    """Which of kiln's kernels ran, by the shorter list: those on when fewer are (CUDA's default is none,
    gpu_session.sh's kernels stage turns them on one at a time), those off otherwise (Vulkan's default is all,
    tests/bench/fallback.sh turns them off)."""
    state = {name: run.get(f"{key}_kernel") for key, name in KERNELS.items()}
    on = [name for name, value in state.items() if value is True]
    off = [name for name, value in state.items() if value is False]
    if not off:
        return ", kiln's kernels" if on else ""
    if not on:
        return ", without kiln's kernels"
    few, phrase = (on, "kiln's {} kernel{} only") if len(on) <= len(off) else (off, "without the {} kernel{}")
    return ", " + phrase.format("/".join(few), "s" if len(few) > 1 else "")


def matmul(run: dict) -> str:
    # Recorded on CUDA only; cuBLAS's products are not the default there (KILN_MATMUL=cublas, ordered on the
    # device, or cublas-host, ordered by the host's waits).
    return {"cublas": ", cuBLAS matmuls", "cublas-host": ", cuBLAS matmuls ordered by the host"}.get(
        run.get("matmul"), "")


def main(paths: list[str]) -> int:
    runs = [dict(json.load(open(p)), path=p) for p in paths]
    by_shape: dict[str, list[dict]] = {}
    for run in runs:
        by_shape.setdefault(os.path.basename(run["path"]).split("@")[0], []).append(run)
    print("| shape | run | losses | largest gap to cpu f32 (relative) | verdict |")
    print("|---|---|---|---|---|")
    status = 0
    for shape, group in by_shape.items():
        reference = next((r for r in group if r["device"] == "cpu" and r["precision"] == "f32"), None)
        if reference is None:
            print(f"parity.py: {shape} has no cpu f32 run to compare with", file=sys.stderr)
            return 2
        for run in group:
            losses = run["losses"]
            finite = all(math.isfinite(x) for x in losses)
            gap = max((abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"])), default=0.0)
            ok = finite and len(losses) == len(reference["losses"]) and gap <= TOLERANCE.get(run["precision"], 0)
            status |= not ok
            shown = ", ".join(f"{x:.6f}" for x in losses)
            print(f"| {shape} | {label(run)} | {shown} | {gap:.2e} | {'ok' if ok else 'OFF'} |")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
