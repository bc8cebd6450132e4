#!/usr/bin/env python3
"""Per-kernel device times of one training step, from CubeCL's profiling log.

With `[profiling.logger] level = "basic"` in a cubecl.toml (tests/bench/gpu_session.sh writes one), CubeCL
times every kernel on the device and, at each device synchronization, logs a table of the kernels run since
the last one (name, total duration, count, share). kiln's bench-train synchronizes once a step, so each table
is one step; the last complete one is a steady step (warmup steps carry autotuning's trial kernels).

    kernel_profile.py profile.log [--top 30] [--bench RESULT.json]    → markdown on stdout

Prints every table's total (steps should agree), then the last table's kernels, and the same grouped by
kernel family (the kernel's type without its generic parameters), largest first. With --bench (an
unprofiled `bench-train` result of the same shape and settings: the training table's row), it also says
what share of that step's wall time the kernels fill: what is left is the device waiting on the host
(burn's graph building, fusion, launches) — the lever then is fewer ops, not faster kernels.
"""

import argparse
import json
import re
import sys
from collections import defaultdict

UNITS = {"s": 1e3, "ms": 1.0, "µs": 1e-3, "us": 1e-3, "ns": 1e-6}
DURATION = re.compile(r"^([0-9.]+)(s|ms|µs|us|ns)$")


def milliseconds(text):
    """Rust's `Debug` form of a `Duration` ("1.5ms", "830.2µs", "12ns", "2.01s") in milliseconds."""
    match = DURATION.match(text.strip())
    if not match:
        raise ValueError(f"not a duration: {text!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def tables(lines):
    """Every complete summary table: a list of (name, milliseconds, count) rows and its total row.

    CubeCL names a kernel by its type with the generics as " | "-separated cells ("KernelBinop | MulOp |
    CudaRuntime"), so a row is the name's cells then duration, count and share; per-kernel lines ("| 1.2ms |
    name ...") and rule lines end in no share and are passed over.
    """
    found, rows, inside = [], [], False
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells == ["Name", "Duration", "Num Computed", "Ratio"]:
            rows, inside = [], True
            continue
        if not inside or len(cells) < 4 or not cells[-1].endswith("%") or not DURATION.match(cells[-3]):
            continue
        name, duration, count = " | ".join(cells[:-3]), milliseconds(cells[-3]), int(cells[-2])
        if name == "Total":
            found.append((rows, (duration, count)))
            inside = False
        else:
            rows.append((name, duration, count))
    return found


def family(name):
    """A kernel's type without its generic parameters ("KernelBinop | MulOp | CudaRuntime" → KernelBinop)."""
    return name.split(" | ", 1)[0]


# Generic parameters that say how a kernel is launched, not which kernel it is (CubeCL's argument plumbing).
PLUMBING = {"TensorArgs", "Option", "()"}


def short(name):
    """A kernel's name for a table: its type and the generic parameters that tell kernels apart (a matmul's
    families and tiling, an elementwise op), without argument plumbing or the runtime, cut to fit."""
    cells = name.split(" | ")
    kept = [cells[0]]
    for cell in cells[1:]:
        plumbing = cell in PLUMBING or cell.startswith(("__", "Dynamic")) or cell.endswith("Runtime")
        if not plumbing and cell != kept[-1]:
            kept.append(cell)
    text = " \\| ".join(kept)  # a pipe inside a markdown cell is escaped
    return text if len(text) <= 160 else text[:157] + "..."


def busy_share(kernel_ms, bench):
    """The line saying how much of the unprofiled step (`bench`: bench-train's result) the kernels fill."""
    step_ms = 1e3 * bench["median_step_seconds"]
    return (
        f"The unprofiled step ({bench.get('shape', bench['model_type'])}, {bench['precision']}, median of "
        f"{len(bench['step_seconds'])}) takes {step_ms:.2f} ms: the kernels fill {100 * kernel_ms / step_ms:.1f} % "
        f"of it, and the device waits on the host for the other {max(step_ms - kernel_ms, 0.0):.2f} ms.\n"
    )


def report(found, top, bench=None):
    out = []
    totals = ", ".join(f"{ms:.2f} ms ({n} kernels)" for _, (ms, n) in found)
    out.append(f"{len(found)} profiled steps: {totals}\n")
    rows, (total, count) = found[-1]
    out.append(f"Last step: {total:.2f} ms of kernel time in {count} kernels.\n")
    if bench is not None:
        out.append(busy_share(total, bench))
    out.append("| kernel | ms | count | share |\n|---|---|---|---|")
    for name, ms, n in sorted(rows, key=lambda r: -r[1])[:top]:
        out.append(f"| `{short(name)}` | {ms:.3f} | {n} | {100 * ms / total:.1f} % |")
    groups = defaultdict(lambda: [0.0, 0])
    for name, ms, n in rows:
        groups[family(name)][0] += ms
        groups[family(name)][1] += n
    out.append("\n| kernel family | ms | count | share |\n|---|---|---|---|")
    for name, (ms, n) in sorted(groups.items(), key=lambda g: -g[1][0])[:top]:
        out.append(f"| `{name}` | {ms:.3f} | {n} | {100 * ms / total:.1f} % |")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--bench", help="an unprofiled bench-train result of the same shape and settings")
    args = parser.parse_args()
    bench = None
    if args.bench:
        try:
            with open(args.bench, encoding="utf-8") as f:
                bench = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"{args.bench}: {e}")
    try:
        with open(args.log, encoding="utf-8", errors="replace") as f:
            found = tables(f)
    except OSError as e:
        sys.exit(f"{args.log}: {e.strerror} (CubeCL writes it only on a CubeCL device, with profiling on)")
    if not found:
        sys.exit(f"{args.log}: no complete profiling table (was CubeCL's profiling on, and did a step finish?)")
    print(report(found, args.top, bench))


if __name__ == "__main__":
    main()
