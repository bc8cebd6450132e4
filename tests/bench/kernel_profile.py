#!/usr/bin/env python3
"""Per-kernel device times of one training step, from CubeCL's profiling log.

With `[profiling.logger] level = "basic"` in a cubecl.toml (tests/bench/gpu_session.sh writes one), CubeCL
times every kernel on the device and, at each device synchronization, logs a table of the kernels run since
the last one (name, total duration, count, share). kiln's bench-train synchronizes once a step, so each table
is one step; the last complete one is a steady step (warmup steps carry autotuning's trial kernels).

    kernel_profile.py profile.log [--top 30]    → markdown on stdout

Prints every table's total (steps should agree), then the last table's kernels, and the same grouped by
kernel family (the name before its type parameters), largest first.
"""

import argparse
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
    """Every complete summary table: a list of (name, milliseconds, count) rows and its total row."""
    found, rows, inside = [], [], False
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4:
            continue  # rule lines, per-kernel lines ("| 1.2ms | name"), anything else
        name, duration, count, _ratio = cells
        if name == "Name" and duration == "Duration":
            rows, inside = [], True
        elif inside and name == "Total":
            found.append((rows, (milliseconds(duration), int(count))))
            inside = False
        elif inside:
            rows.append((name, milliseconds(duration), int(count)))
    return found


def family(name):
    """A kernel's name without its module path, type parameters or launch details."""
    bare = re.split(r"[<(\s]", name, maxsplit=1)[0]
    return bare.rsplit("::", 1)[-1] or name


def report(found, top):
    out = []
    totals = ", ".join(f"{ms:.2f} ms ({n} kernels)" for _, (ms, n) in found)
    out.append(f"{len(found)} profiled steps: {totals}\n")
    rows, (total, count) = found[-1]
    out.append(f"Last step: {total:.2f} ms of kernel time in {count} kernels.\n")
    out.append("| kernel | ms | count | share |\n|---|---|---|---|")
    for name, ms, n in sorted(rows, key=lambda r: -r[1])[:top]:
        short = name if len(name) <= 100 else name[:97] + "..."
        out.append(f"| `{short}` | {ms:.3f} | {n} | {100 * ms / total:.1f} % |")
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
    args = parser.parse_args()
    try:
        with open(args.log, encoding="utf-8", errors="replace") as f:
            found = tables(f)
    except OSError as e:
        sys.exit(f"{args.log}: {e.strerror} (CubeCL writes it only on a CubeCL device, with profiling on)")
    if not found:
        sys.exit(f"{args.log}: no complete profiling table (was CubeCL's profiling on, and did a step finish?)")
    print(report(found, args.top))


if __name__ == "__main__":
    main()
