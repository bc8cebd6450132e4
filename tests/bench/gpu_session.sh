#!/usr/bin/env bash
# What the GPU halves of the trainer, training-speed and Qwen3.5 issues need, in one device call with the
# carried CUDA build (the GPU machine has no toolchain and no network; PyTorch + transformers are there):
#
#   1. the training-step table (tests/bench/train.sh): kiln with its ops, kiln with --reference-ops, and
#      transformers + PyTorch (bf16, amp) on the benchmark shapes;
#   1a. for each of SCAN_AB (qwen3.5-0.8b), kiln's row again with the DeltaNet scan as tensor ops instead of
#      kiln's kernel (KILN_OPS=noscan: KILN_SCAN_KERNEL=off), into table-noscan.md: what the kernel buys;
#   1b. per-kernel device times of one training step for each of PROFILE_SHAPES (tests/bench/kernel_profile.sh:
#      CubeCL's profiler switched on by a cubecl.toml in a scratch directory, the log tabulated): what the
#      step spends its time on, the first thing the training-speed issue asks to measure;
#   2. the offline pipeline's shards (`kiln sft --model tiny --until prepare`: synthetic data, seconds);
#   3. `kiln train` on the device for EPOCHS epochs of those shards with a random-init TRAIN_SHAPE model
#      (LFM2-350M by default; the tiny tokenizer's ids fit any vocabulary): metrics, per-epoch exports;
#      a non-finite loss there re-runs it with KILN_CUDA_FUSION=off (burn's unfused backend) to tell a
#      fusion bug from a model bug;
#   4. with PIPELINE=1, the rest of the tiny pipeline on the device (train → eval → select → card).
#
#   KILN=gpu/kiln.gz OUT=$OUT tests/bench/gpu_session.sh      (make gpu-carry packs gpu/kiln.gz here)
#
# KILN may be gzipped (the CUDA build is over the device tool's 64 MiB carry limit; packed it is ~26 MB): it
# is unpacked to $TMPDIR first, and the unpacked binary's path is passed on to train.sh.
#
# Settings (environment): DEVICE (cuda); SHAPES ("lfm2-350m lfm2.5-1.2b qwen3.5-0.8b"; empty: no table) and
# KILN_OPS ("ops reference") for the table, where train.sh's SEQ, MICRO, ACC, STEPS, WARMUP, PRECISION,
# MOMENTS and REFERENCE pass through; TRAIN_SHAPE (lfm2-350m), EPOCHS (2), TRAIN_MICRO (4), TRAIN_BATCH (8
# sequences a step), TRAIN_LR (2e-5); PROFILE_SHAPES ("lfm2.5-1.2b qwen3.5-0.8b" on cuda, at SEQ or 4096);
# PIPELINE (1 on cuda); SCAN_AB (qwen3.5-0.8b if it is in SHAPES); OUT (runs/gpu-session). Everything worth keeping is copied under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
KILN=${KILN:-target/release/kiln}
: "${DEVICE:=cuda}" "${SHAPES=lfm2-350m lfm2.5-1.2b qwen3.5-0.8b}" "${KILN_OPS:=ops reference}"
: "${TRAIN_SHAPE:=lfm2-350m}" "${EPOCHS:=2}" "${TRAIN_MICRO:=4}" "${TRAIN_BATCH:=8}" "${TRAIN_LR:=2e-5}"
: "${OUT:=runs/gpu-session}"
[[ $DEVICE == cuda ]] && : "${PIPELINE:=1}" || : "${PIPELINE:=0}"
[[ $DEVICE == cuda ]] && : "${PROFILE_SHAPES=lfm2.5-1.2b qwen3.5-0.8b}" || : "${PROFILE_SHAPES=}"
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
# shellcheck source=tests/bench/cuda_env.sh
[[ $DEVICE == cuda ]] && source tests/bench/cuda_env.sh
if [[ $KILN == *.gz ]]; then
    unpacked=${TMPDIR:-/tmp}/kiln-$$
    gzip -dc "$KILN" >"$unpacked" && chmod +x "$unpacked" || { echo "cannot unpack $KILN" >&2; exit 2; }
    KILN=$unpacked
fi
KILN=$(realpath "$KILN")
failures=0
step() { echo "== $*" >&2; }
fail() { echo "FAILED: $*" >&2; failures=$((failures + 1)); }

step "machine"
{
    date -u +%FT%TZ
    git rev-parse --short HEAD 2>/dev/null || echo "(no git)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    "$KILN" info  # cuda_smoke_test: "ok", or what is missing
} >"$OUT/machine.txt" 2>&1

if [[ -n $SHAPES ]]; then
    step "training-step table: $SHAPES"
    # shellcheck disable=SC2086  # SHAPES is a list
    DEVICE=$DEVICE KILN=$KILN KILN_OPS=$KILN_OPS OUT=$OUT/bench tests/bench/train.sh $SHAPES >"$OUT/table.md" \
        || fail "train.sh"
    cat "$OUT/table.md"
fi

[[ " $SHAPES " == *" qwen3.5-0.8b "* ]] && : "${SCAN_AB=qwen3.5-0.8b}" || : "${SCAN_AB=}"
if [[ -n $SCAN_AB ]]; then
    step "the DeltaNet scan as tensor ops: $SCAN_AB"
    # shellcheck disable=SC2086  # SCAN_AB is a list
    DEVICE=$DEVICE KILN=$KILN KILN_OPS=noscan REFERENCE=none OUT=$OUT/bench tests/bench/train.sh $SCAN_AB \
        >"$OUT/table-noscan.md" || fail "train.sh with KILN_OPS=noscan"
    cat "$OUT/table-noscan.md"
fi

for shape in $PROFILE_SHAPES; do
    step "kernel profile: $shape"
    if DEVICE=$DEVICE KILN=$KILN SEQ=${SEQ:-4096} tests/bench/kernel_profile.sh "tests/bench/shapes/$shape.json" \
        "$OUT/profile-$shape"; then
        head -12 "$OUT/profile-$shape.md"
    else
        fail "kernel profile of $shape (see profile-$shape.stdout)"
    fi
done

step "shards of the offline pipeline"
run=gpu-session
"$KILN" --quiet sft --model tiny --run "$run" --until prepare --device "$DEVICE" >"$OUT/prepare.log" 2>&1 \
    || fail "kiln sft --until prepare (see prepare.log)"

step "kiln train: $TRAIN_SHAPE, $EPOCHS epochs on $DEVICE"
config=tests/bench/shapes/$TRAIN_SHAPE.json
[[ -f $config ]] || config=configs/models/$TRAIN_SHAPE/config.json
train_run=runs/$run-train-$TRAIN_SHAPE
rm -rf "$train_run" && mkdir -p "$train_run/from"
cp "$config" "$train_run/from/config.json"
cp configs/models/tiny/{tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} "$train_run/from/"
run_train() {
    "$KILN" --quiet train --model-dir "$train_run/base" --data "runs/$run/data" --run "$1" --device "$DEVICE" \
        --epochs "$EPOCHS" --micro-batch "$TRAIN_MICRO" --global-batch "$TRAIN_BATCH" --lr "$TRAIN_LR" \
        --peak-tflops 989
}
if "$KILN" --quiet init-model --from "$train_run/from" --out "$train_run/base" --dtype bf16 >"$OUT/train.log" 2>&1 \
    && run_train "$train_run" >>"$OUT/train.log" 2>&1; then
    tail -1 "$OUT/train.log"
else
    fail "kiln train (see train.log)"
    # A non-finite loss on the fused backend: the same run without burn's fusion says whose bug it is.
    if [[ $DEVICE == cuda ]] && grep -q "non-finite loss" "$OUT/train.log"; then
        step "kiln train again with KILN_CUDA_FUSION=off"
        KILN_CUDA_FUSION=off run_train "$train_run-unfused" >"$OUT/train-unfused.log" 2>&1
        tail -2 "$OUT/train-unfused.log"
        mkdir -p "$OUT/train-unfused"
        cp "$train_run-unfused"/train/metrics.jsonl "$OUT/train-unfused/" 2>/dev/null
    fi
fi
mkdir -p "$OUT/train"
cp "$train_run"/train/metrics.jsonl "$train_run"/train/summary.json "$OUT/train/" 2>/dev/null
ls "$train_run"/checkpoints >"$OUT/train/checkpoints.txt" 2>&1

if ((PIPELINE)); then
    step "the tiny pipeline on $DEVICE"
    if "$KILN" --quiet sft --model tiny --run "$run" --device "$DEVICE" >"$OUT/sft.log" 2>&1; then
        tail -1 "$OUT/sft.log"
    else
        fail "kiln sft (see sft.log)"
    fi
    mkdir -p "$OUT/sft"
    cp -r "runs/$run/eval" "runs/$run/README.md" "runs/$run/train/metrics.jsonl" "$OUT/sft/" 2>/dev/null
fi
echo "gpu_session: $failures failure(s); results in $OUT" >&2
exit $((failures > 0))
