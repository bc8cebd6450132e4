#!/usr/bin/env bash
# Per-kernel device times of a training step on a CubeCL device (cuda, or vulkan in a build with it): runs
# `kiln bench-train` of one shape in a scratch directory whose cubecl.toml switches CubeCL's profiler on
# (CubeCL reads cubecl.toml from the working directory or a parent when the device starts; it then logs a
# per-kernel table at every device sync, once a step in bench-train), and tabulates the last complete table
# with kernel_profile.py.
#
#   KILN=target/release/kiln DEVICE=cuda SEQ=4096 tests/bench/kernel_profile.sh SHAPE.json OUT/profile-NAME [FLAG…]
#
# writes OUT/profile-NAME.md (the table), .json (bench-train's result), .stdout (its output) and .log.gz
# (CubeCL's log); exits non-zero, saying why on stderr, when a step fails. STEPS (2) and WARMUP (2) set the
# steps: the warmup steps' tables carry autotuning's trial kernels. FLAGs go to bench-train as they are
# (--reference-ops, --micro-batch 2, …). BENCH, an unprofiled bench-train result of the same shape and
# settings, adds what share of its step the kernels fill (kernel_profile.py --bench).
set -uo pipefail
(($# >= 2)) || { echo "usage: kernel_profile.sh SHAPE.json OUT_PREFIX [bench-train flag…]" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
config=$(realpath "$1")
out=$(realpath -m "$2")
shift 2
KILN=$(realpath "${KILN:-target/release/kiln}")
mkdir -p "$(dirname "$out")"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
printf '[profiling.logger]\nlevel = "basic"\nfile = "%s"\nappend = false\n' "$out.log" >"$scratch/cubecl.toml"
# gpu_session.sh's kernel and autotune caches, when it keeps them (its cubecl.toml is not read from the scratch
# directory).
[[ ${KERNEL_CACHE:-off} != off ]] && printf '[compilation]\ncache = { file = "%s" }\n[autotune]\ncache = { file = "%s" }\n' \
    "$KERNEL_CACHE" "$KERNEL_CACHE" >>"$scratch/cubecl.toml"
if ! (cd "$scratch" && "$KILN" --quiet bench-train --config "$config" --device "${DEVICE:-cuda}" \
    --seq "${SEQ:-4096}" --steps "${STEPS:-2}" --warmup "${WARMUP:-2}" --out "$out.json" "$@") >"$out.stdout" 2>&1; then
    echo "kernel_profile.sh: profiled bench-train failed (see $out.stdout)" >&2
    exit 1
fi
bench=()
[[ -n ${BENCH:-} ]] && bench=(--bench "$BENCH")
python3 "$here/kernel_profile.py" "$out.log" "${bench[@]}" >"$out.md" || { echo "kernel_profile.sh: kernel_profile.py failed" >&2; exit 1; }
gzip -f "$out.log"
