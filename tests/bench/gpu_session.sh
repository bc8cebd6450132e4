#!/usr/bin/env bash
# What the GPU halves of the trainer, training-speed and Qwen3.5 issues need, in one device call with the
# carried CUDA build (the GPU machine has no toolchain and no network; PyTorch + transformers are there).
# Stages, run in the order STAGES names them, each under STAGE_TIMEOUT seconds (a device call has a hard
# limit: a stage that hangs or compiles for ever must not cost the ones after it):
#
#   warm     one step of every parity and table run at once, in parallel processes, into the kernel cache
#            (below): NVRTC compiles a process's kernels one after another at ~1 s each, so the stages after
#            it load them instead of spending their limits compiling;
#   parity   correctness first: three training steps of each tiny shape (LFM2, LFM2-MoE, Qwen3.5, Gemma 4) with
#            `kiln bench-train` on the CPU in f32 and on DEVICE in f32 and bf16, losses side by side
#            (tests/bench/parity.py: f32 within 1e-4 relative of the CPU, bf16 within 1e-2) — the fused
#            backend's kernels and layouts checked against the reference before any speed is measured;
#   kernels  kiln's CubeCL kernels (off by default on CUDA: backend::KernelsByDefault) each alone on, then
#            all on, then the products through cuBLAS (KILN_MATMUL=cublas, off by default too; ordered on the
#            device, and cublas-host, ordered by the host's waits), KERNEL_REPEATS
#            runs of three steps of each of KERNEL_CONFIGS in KERNEL_PRECISIONS, KERNEL_JOBS (6) at once,
#            losses against the CPU's (kernels.md): whether dense outputs mended the NaN of 2026-12-04, and if
#            not, where;
#   sanitize the tiny LFM2 with every kernel on under compute-sanitizer (SANITIZE_TOOLS: initcheck, memcheck,
#            racecheck), two bf16 steps: the kernel and the access at fault; skipped when the kernels
#            stage before it passed (SANITIZE_WHEN=failed, the default; "always" runs it whatever came before);
#   table    the training-step table (tests/bench/train.sh): kiln with each of KILN_OPS, and transformers +
#            PyTorch (bf16, amp) on the benchmark SHAPES;
#   train    `kiln train` on the device for EPOCHS epochs of the offline pipeline's shards (`kiln sft --model
#            tiny --until prepare`: synthetic data, seconds) with a random-init TRAIN_SHAPE model (LFM2-350M by
#            default; the tiny tokenizer's ids fit any vocabulary): metrics, per-epoch exports; a failure or
#            a non-finite loss there re-runs it with KILN_CUDA_FUSION=off (burn's unfused backend) to tell a
#            fusion bug from a model bug;
#   pipeline the whole pipeline (`kiln sft`: prepare → train → export → eval → select → card) on the device for
#            each of PIPELINE_MODELS: tiny as `make sft` runs it; another model config (qwen3.5-0.8b: issue
#            10's end to end where no Hub is) on a random-init bf16 base of its benchmark shape, with its own
#            template and tokenizer (PIPELINE_BASES/from-<model>, which `make gpu-carry` packs for GPU_BASES),
#            on the synthetic data and the shipped replay sample (PIPELINE_SET): the chunked prompt attention of
#            eval's decoding, the export and the selection on the device; sft-<model>.log and sft-<model>/;
#   profile  per-kernel device times of one training step for each of PROFILE_SHAPES
#            (tests/bench/kernel_profile.sh: CubeCL's profiler switched on by a cubecl.toml in a scratch
#            directory, the log tabulated): what the step spends its time on, and beside the table's row of
#            the shape (run before), the share of its step the kernels fill — the rest is the device waiting
#            on the host;
#   (The kernel A/B stages below switch one kernel off against the device's default: on CUDA, where the
#   kernels are off by default, they change nothing until the kernels are cleared and on again.)
#   noscan   for each of SCAN_AB, kiln's row again with the DeltaNet's three kernels as tensor ops
#            instead of kiln's kernels (KILN_OPS=noscan: KILN_SCAN_KERNEL=off), into table-noscan.md: what
#            the kernels buy;
#   noattn   for each of ATTN_AB, kiln's row again with the attention's softmax rows as tensor ops instead
#            of kiln's kernels (KILN_OPS=noattn: KILN_ATTENTION_KERNEL=off), into table-noattn.md;
#   noloss   for each of LOSS_AB, kiln's row again with the cross-entropy's rows as tensor ops instead of
#            kiln's kernel (KILN_OPS=noloss: KILN_LOSS_KERNEL=off), into table-noloss.md;
#   nonorm   for each of NORM_AB, kiln's row again with the RMSNorms as tensor ops instead of kiln's kernels
#            (KILN_OPS=nonorm: KILN_NORM_KERNEL=off), into table-nonorm.md;
#   noconv   for each of CONV_AB, kiln's row again with the causal conv as tensor ops instead of kiln's
#            kernels (KILN_OPS=noconv: KILN_CONV_KERNEL=off), into table-noconv.md;
#   nooptim  for each of OPTIM_AB, kiln's row again with the optimizer (the gradients' norm, AdamW's update)
#            as tensor ops, two to six kernels a parameter, instead of kiln's kernels over many tensors
#            (KILN_OPS=nooptim: KILN_OPTIM_KERNEL=off), into table-nooptim.md;
#   moments  for each of MOMENTS_SHAPES, kiln's row again with bf16 and with 8-bit AdamW moments, and with
#            bf16 moments and no f32 masters (stochastic rounding: PyTorch's plain bf16 AdamW footprint; also
#            with activation checkpointing), into table-moments.md: the peak memory beside the table's
#            f32-moment row and PyTorch's;
#   autotune for each of AUTOTUNE_SHAPES, kiln's row again (KILN_OPS=$AUTOTUNE_OPS) with the build that has burn's
#            autotune (KILN_AUTOTUNE: gpu/kiln-autotune.xz, `GPU_FEATURES=autotune make gpu-carry`), into
#            table-autotune.md: its warm-up steps compile and time each matmul shape's candidate kernels (the
#            picks kept in the kernel cache's autotune file, which KERNEL_CACHE_OUT brings back for the next
#            session), its timed steps run the fastest — beside the table's row on cubek's default kernels;
#   fit      each of FIT_SHAPES (LFM2.5-8B-A1B; gemma-4-e4b, Gemma 4 E4B's 7.5 B-parameter text tower, on
#            request) as its recipe trains it: sequence FIT_SEQ (8192), two micro-batches accumulated (the
#            f32 gradient sum the recipe's global batch needs), 8-bit moments, two steps, without and with
#            activation checkpointing, and for a MoE shape once with a matmul per expert instead of the
#            padded batch (KILN_OPS=noexperts), into table-fit.md: does it fit one GPU, how fast (a row the
#            GPU's memory cannot hold reads "out of memory", and the rows after it still run).
#
# A kiln run that fails on CUDA is run again without what has never run on a GPU before (tests/bench/
# fallback.sh: kiln's own CubeCL kernels, burn's fusion, both), so the session still brings back kiln's
# figures and says whose bug it was. The parity stage also catches a run that completes with wrong losses, and
# finds the switch that mends it (each kernel alone first); what it finds holds for the runs after it of the
# shapes of that architecture (PARITY_SCOPE). The
# table stages run a failed shape's other rows with the switches that worked for it, and the train, pipeline
# and profile stages run with every switch marked before (FALLBACK_MARK, $OUT/fallback: "<shape|*> NAME=off …").
#
#   KILN=gpu/kiln.xz OUT=$OUT PACK=$OUT/session.tgz tests/bench/gpu_session.sh   (make gpu-carry packs gpu/kiln.xz)
#
# KILN and KILN_AUTOTUNE may be packed with xz or gzip (the CUDA build is over the device tool's 64 MiB carry
# limit; xz brings it to ~19 MB): they are unpacked to $TMPDIR first (by python's lzma where the machine has
# no xz), and the unpacked binaries' paths are passed on to the stages.
#
# CubeCL compiles every kernel when a process first launches it (NVRTC on CUDA: ~1 s a kernel on the H100 machines, so a
# first step spends minutes compiling), and each stage runs several kiln processes. The script keeps three caches in the
# directory KERNEL_CACHE (runs/kernel-cache, which the device tool leaves in place between the calls of a warm machine;
# `off` for none): CubeCL's compiled kernels (PTX) and burn's autotune results, both switched on by a cubecl.toml it
# writes into the working directory (where none is there already; removed at the end), and the driver's PTX →
# machine-code cache (CUDA_CACHE_PATH). The machine is fresh every session, so the caches travel: KERNEL_CACHE_IN
# (gpu/kernel-cache.tgz where it exists) is unpacked into an empty KERNEL_CACHE first, and KERNEL_CACHE_OUT (a .tgz
# path, e.g. $OUT/kernel-cache.tgz of the device tool) receives them at the end, under the 16 MiB the tool brings back a
# file (without the driver's cache when that is too large): copy it to gpu/ for the next session.
#
# Settings (environment): DEVICE (cuda); STAGES ("warm parity table train pipeline profile noscan"); STAGE_TIMEOUT
# (600), and STAGE_TIMEOUTS for stages that need another limit ("table=220 train=100"); PARITY_CONFIGS (the
# tiny LFM2, Qwen3.5, Gemma 4 and LFM2-MoE) and PARITY_PRECISIONS ("f32 bf16"; "bf16+stochastic" is bf16 without
# f32 masters, AdamW rounding into the weights stochastically) for the parity and warm stages;
# KERNEL_CACHE, KERNEL_CACHE_IN and KERNEL_CACHE_OUT (above);
# SHAPES ("lfm2-350m lfm2.5-1.2b qwen3.5-0.8b") and KILN_OPS ("ops reference") for the table, where
# train.sh's SEQ, MICRO, ACC, STEPS, WARMUP, PRECISION, MOMENTS, MASTERS and REFERENCE pass through; TRAIN_SHAPE
# (lfm2-350m), EPOCHS (2), TRAIN_MICRO (4), TRAIN_BATCH (8 sequences a step), TRAIN_LR (2e-5); PROFILE_SHAPES
# ("lfm2.5-1.2b qwen3.5-0.8b", at SEQ or 4096); SCAN_AB and OPTIM_AB (qwen3.5-0.8b); ATTN_AB, LOSS_AB,
# NORM_AB, CONV_AB and MOMENTS_SHAPES (lfm2.5-1.2b); KILN_AUTOTUNE (gpu/kiln-autotune.xz where it exists),
# AUTOTUNE_SHAPES (lfm2.5-1.2b) and AUTOTUNE_OPS ("ops");
# FIT_SHAPES (lfm2.5-8b-a1b), FIT_SEQ (8192); PIPELINE_MODELS (tiny), PIPELINE_BASES (gpu) and PIPELINE_SET
# (the other models' `kiln sft --set` list, space-separated: below); OUT (runs/gpu-session), where
# everything worth keeping is copied; PACK, a .tgz path to pack OUT into at the end (the device tool brings
# back at most 8 files).
set -uo pipefail
self=$(realpath "$0")
cd "$(dirname "$0")/../.."
: "${DEVICE:=cuda}" "${STAGES:=warm parity table train pipeline profile noscan}" "${STAGE_TIMEOUT:=600}"
: "${SHAPES=lfm2-350m lfm2.5-1.2b qwen3.5-0.8b}" "${KILN_OPS:=ops reference}"
: "${TRAIN_SHAPE:=lfm2-350m}" "${EPOCHS:=2}" "${TRAIN_MICRO:=4}" "${TRAIN_BATCH:=8}" "${TRAIN_LR:=2e-5}"
: "${PROFILE_SHAPES=lfm2.5-1.2b qwen3.5-0.8b}" "${OUT:=runs/gpu-session}" "${PACK:=}"
: "${PIPELINE_MODELS=tiny}" "${PIPELINE_BASES:=gpu}"
# The model configs' mixes and replay need the Hub; the synthetic data and the replay sample are in the project.
synthetic_pipeline='data.recipes=["terminal-synth","toolbench-synth"] data.weights={terminal-synth=0.1,toolbench-synth=0.1}
    data.decontaminate=["datasets/samples/replay.jsonl"] data.seq_len=4096 eval.replay=datasets/samples/replay.jsonl
    train.global_batch=8 eval.max_tokens=64 eval.limit=16'
: "${PIPELINE_SET=${synthetic_pipeline//$'\n'/ }}"
: "${PARITY_CONFIGS=configs/models/tiny configs/models/tiny-qwen3.5 configs/models/tiny-gemma4 tests/fixtures/lfm2/lfm2-moe-tiny}"
: "${PARITY_PRECISIONS=f32 bf16}"
[[ " $SHAPES " == *" qwen3.5-0.8b "* ]] && : "${SCAN_AB=qwen3.5-0.8b}" || : "${SCAN_AB=}"
: "${ATTN_AB=lfm2.5-1.2b}" "${LOSS_AB=lfm2.5-1.2b}" "${NORM_AB=lfm2.5-1.2b}" "${OPTIM_AB=qwen3.5-0.8b}"
: "${KERNEL_CONFIGS=configs/models/tiny configs/models/tiny-qwen3.5}" "${KERNEL_PRECISIONS=bf16}" "${KERNEL_REPEATS:=3}"
: "${KERNEL_JOBS:=6}"
: "${SANITIZE_TOOLS=initcheck memcheck racecheck}" "${SANITIZE_WHEN:=failed}"
: "${AUTOTUNE_SHAPES=lfm2.5-1.2b}" "${AUTOTUNE_OPS:=ops}"
: "${CONV_AB=lfm2.5-1.2b}" "${MOMENTS_SHAPES=lfm2.5-1.2b}" "${FIT_SHAPES=lfm2.5-8b-a1b}" "${FIT_SEQ:=8192}"
run=gpu-session
step() { echo "== $*" >&2; }

# The parity runs' settings: the tiny training test's (tests/common: tiny_bench_config).
PARITY_SETTINGS=(--seq 48 --micro-batch 2 --accumulation 2 --docs-per-row 3 --warmup 0 --seed 5 --lr 3e-3)

# The shapes a parity shape stands for: a switch that mends it is marked for them (and itself), not for every
# shape, so a fault of one architecture's ops leaves the others' runs as they are.
declare -A PARITY_SCOPE=(
    [tiny]="tiny lfm2-350m lfm2.5-1.2b"
    [tiny-qwen3.5]="tiny-qwen3.5 qwen3.5-0.8b"
    [tiny-gemma4]="tiny-gemma4 gemma-4-e4b"
    [lfm2-moe-tiny]="lfm2-moe-tiny lfm2.5-8b-a1b"
)

# The switches marked for any of the shapes after the first argument (the mark file), on one line.
marked_for_shapes() {
    local mark=$1 shape all=""
    shift
    for shape in "$@"; do
        all+=" $(marked_switches "$mark" "$shape")"
    done
    # shellcheck disable=SC2086  # word list
    printf '%s\n' $all | sort -u | paste -sd' '
}

# One parity run of `$config` as `$shape@$3.json` on device $1 in precision $2: three optimizer steps.
parity_run() {
    local masters=f32
    [[ $2 == *+stochastic ]] && masters=stochastic
    "$KILN" --quiet bench-train --config "$config" --device "$1" --precision "${2%+*}" --masters "$masters" \
        "${PARITY_SETTINGS[@]}" --steps 3 --out "$OUT/parity/$shape@$3.json" >/dev/null 2>>"$OUT/parity.log"
}

# Whether the parity run tagged $1 of $shape is within its precision's tolerance of the shape's CPU f32 run.
parity_ok() {
    python3 tests/bench/parity.py "$OUT/parity/$shape@cpu-f32.json" "$OUT/parity/$shape@$1.json" >/dev/null 2>&1
}

# 1 when the environment turns one of kiln's kernels on (the parity and train stages run with it), else 0.
kernels_turned_on() {
    local name
    for name in "${KERNEL_SWITCHES[@]}"; do
        [[ ${!name:-} =~ ^(on|1|true)$ ]] && { echo 1; return; }
    done
    echo 0
}

stage_parity() {
    step "parity: tiny shapes on cpu f32 and $DEVICE ${PARITY_PRECISIONS// /, }"
    local config shape run status=0 marked tag variant switches scope scoped
    mkdir -p "$OUT/parity"
    for config in $PARITY_CONFIGS; do
        shape=$(basename "$config")
        for run in "cpu f32" $(printf "$DEVICE:%s " $PARITY_PRECISIONS); do
            run=${run/:/ }
            set -- $run
            marked=""
            [[ $1 != cpu ]] && marked=$(marked_switches "$FALLBACK_MARK" "$shape")
            tag=$1-$2${marked:+-$(switches_label "$marked")}
            with_switches "$marked" parity_run "$1" "$2" "$tag" && { [[ $1 == cpu ]] || parity_ok "$tag"; } && continue
            echo "bench-train of $shape on $1 $2${marked:+ ($marked)} failed or is off the CPU's losses (see parity.log)" >&2
            status=1
            [[ $1 == cuda ]] || continue
            # Which switch mends it says whose bug it is; it then holds for every run after this one.
            while read -r -u 3 switches; do
                tag=$1-$2-$(switches_label "$switches")
                if with_switches "$switches" parity_run "$1" "$2" "$tag" && parity_ok "$tag"; then
                    scope=${PARITY_SCOPE[$shape]:-*}
                    echo "$shape on $1 $2 runs with $switches: marked for the kiln runs of $scope after it" >&2
                    for scoped in $scope; do echo "$scoped $switches"; done >>"$FALLBACK_MARK"
                    break
                fi
            done 3< <(fallback_runs FALLBACK_DIAGNOSIS "$marked" "$(kernels_turned_on)")
        done
    done
    python3 tests/bench/parity.py "$OUT"/parity/*.json >"$OUT/parity.md" || status=1
    cat "$OUT/parity.md"
    return $status
}

# kiln's CubeCL kernels, off by default on CUDA since bf16 steps with them on turned NaN on an H200
# (2026-12-04, backend::KernelsByDefault; their outputs were pitched there, dense since): each alone on,
# KERNEL_REPEATS times (the NaN came at a step that changed from run to run), three steps of each of
# KERNEL_CONFIGS in KERNEL_PRECISIONS, losses against the CPU's (parity.py); then all of them on; then the
# matrix products through cuBLAS (KILN_MATMUL=cublas and cublas-host, kernels/cublas.rs: never run on a GPU
# before either; `cublas` orders them around cubecl's kernels with kernels/stream_order.rs' flag). All
# within tolerance clears them; a failure says which to look at, and `sanitize` where. The runs are small (the
# device waits on launches, not on work): KERNEL_JOBS of them at once, each shape's CPU run first; a kernel a
# shape has no layer for (the DeltaNet scan without DeltaNet layers, the conv without conv or DeltaNet layers)
# is not run for it.
KERNEL_SWITCHES=(KILN_ATTENTION_KERNEL KILN_LOSS_KERNEL KILN_NORM_KERNEL KILN_OPTIM_KERNEL KILN_SCAN_KERNEL KILN_CONV_KERNEL)

# Whether the model of config $2 (a directory with a config.json, or the file) has a layer kernel switch $1
# serves.
kernel_serves() {
    local json=$2
    [[ -d $json ]] && json=$json/config.json
    case $1 in
        KILN_SCAN_KERNEL) grep -q '"linear_attention"' "$json" ;;
        KILN_CONV_KERNEL) grep -q -e '"linear_attention"' -e '"conv"' "$json" ;;
        *) return 0 ;;
    esac
}

# One run of stage_kernels: $1 the switch (a KERNEL_SWITCHES name, all, cublas or cublas-host), $2 the precision,
# $3 the tag;
# $config and $shape from the caller. Its result goes to $OUT/kernels/ as well.
kernel_run() {
    local switches="$1=on"
    [[ $1 == all ]] && switches=$(printf '%s=on ' "${KERNEL_SWITCHES[@]}")
    [[ $1 == cublas* ]] && switches=KILN_MATMUL=$1
    with_switches "$switches" parity_run "$DEVICE" "$2" "$3" || echo "$shape $3 failed (parity.log)" >&2
    cp "$OUT/parity/$shape@$3.json" "$OUT/kernels/" 2>/dev/null
    return 0
}

stage_kernels() {
    step "kiln's kernels alone on $DEVICE: ${KERNEL_CONFIGS// /, } in $KERNEL_PRECISIONS, $KERNEL_REPEATS runs each, $KERNEL_JOBS at once"
    mkdir -p "$OUT/kernels" "$OUT/parity"
    local config shape precision switch repeat status=0
    for config in $KERNEL_CONFIGS; do
        shape=$(basename "$config")
        [[ -f $OUT/parity/$shape@cpu-f32.json ]] || parity_run cpu f32 cpu-f32 &
    done
    wait
    # Repeats last: the first round's runs differ, so they compile different kernels side by side, and the
    # repeats load them from the kernel cache.
    for ((repeat = 1; repeat <= KERNEL_REPEATS; repeat++)); do
        for config in $KERNEL_CONFIGS; do
            shape=$(basename "$config")
            for precision in $KERNEL_PRECISIONS; do
                for switch in "${KERNEL_SWITCHES[@]}" all cublas cublas-host; do
                    kernel_serves "$switch" "$config" || continue
                    while (($(jobs -rp | wc -l) >= KERNEL_JOBS)); do wait -n; done
                    kernel_run "$switch" "$precision" "$DEVICE-$precision-${switch#KILN_}-$repeat" &
                done
            done
        done
    done
    wait
    for config in $KERNEL_CONFIGS; do
        shape=$(basename "$config")
        local runs=("$OUT/kernels/$shape@"*.json)
        if [[ -f ${runs[0]} ]]; then
            python3 tests/bench/parity.py "$OUT/parity/$shape@cpu-f32.json" "${runs[@]}" >>"$OUT/kernels.md" || status=1
        else
            echo "| $shape | no $DEVICE run finished (parity.log) | | | |" >>"$OUT/kernels.md"
            status=1
        fi
    done
    cat "$OUT/kernels.md"
    echo "$status" >"$OUT/kernels.status"
    return $status
}

# The tiny LFM2 with every kernel on under NVIDIA's compute-sanitizer (SANITIZER, SANITIZE_TOOLS): reads of
# memory never written (initcheck), out-of-bounds accesses (memcheck) and shared-memory races (racecheck),
# each with the kernel's name; two steps in bf16, where the NaN came.
stage_sanitize() {
    if [[ $SANITIZE_WHEN == failed && $(cat "$OUT/kernels.status" 2>/dev/null) == 0 ]]; then
        echo "sanitize: every kernels run was within tolerance; skipped (SANITIZE_WHEN=always runs it)" >&2
        return 0
    fi
    local sanitizer=${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
    [[ -x $sanitizer ]] || { echo "sanitize: no compute-sanitizer ($sanitizer)" >&2; return 1; }
    local tool status=0
    for tool in $SANITIZE_TOOLS; do
        step "compute-sanitizer --tool $tool: the tiny LFM2, bf16, every kernel on"
        with_switches "$(printf '%s=on ' "${KERNEL_SWITCHES[@]}")" "$sanitizer" --tool "$tool" --print-limit 20 \
            --log-file "$OUT/sanitize-$tool.log" "$KILN" --quiet bench-train --config configs/models/tiny --device "$DEVICE" \
            --precision bf16 "${PARITY_SETTINGS[@]}" --steps 2 --out "$OUT/sanitize-$tool.json" >/dev/null 2>&1 || status=1
        grep -m 20 -E "ERROR SUMMARY|Uninitialized|Invalid|Race|in kernel|kernel_" "$OUT/sanitize-$tool.log" >&2
    done
    return $status
}

# One optimizer step of every kiln run the parity and table stages make, all at once in parallel processes:
# each compiles its kernels on one thread (NVRTC, ~1 s a kernel), so side by side they fill the shared kernel
# cache in the time of the slowest, and the timed runs after it load their kernels instead of compiling them.
stage_warm() {
    if [[ $KERNEL_CACHE == off ]]; then
        echo "warm: KERNEL_CACHE=off keeps no compiled kernel for the stages after it" >&2
        return 0
    fi
    step "warm: one step of each parity and table run, in parallel processes"
    mkdir -p "$OUT/warm"
    local config precision shape names=() pids=() i status=0
    for config in $PARITY_CONFIGS; do
        for precision in $PARITY_PRECISIONS; do
            names+=("$(basename "$config")@$precision")
            "$KILN" --quiet bench-train --config "$config" --device "$DEVICE" --precision "${precision%+*}" \
                "${PARITY_SETTINGS[@]}" --steps 1 --out "$OUT/warm/${names[-1]}.json" >/dev/null 2>"$OUT/warm/${names[-1]}.log" &
            pids+=($!)
        done
    done
    # The table's own script, so its settings and shape lookup hold here too; one step, no fallbacks, no PyTorch.
    for shape in $SHAPES; do
        names+=("$shape")
        DEVICE=$DEVICE KILN=$KILN KILN_OPS=$KILN_OPS REFERENCE=none STEPS=1 WARMUP=0 FALLBACK=0 OUT=$OUT/warm \
            tests/bench/train.sh "$shape" >"$OUT/warm/$shape.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        if wait "${pids[$i]}"; then
            echo "warm: ${names[$i]} done at $((SECONDS))s" >&2
        else
            echo "warm: ${names[$i]} failed (see warm/${names[$i]}.log): the stages after it compile what it did not" >&2
            status=1
        fi
    done
    return $status
}

stage_table() {
    [[ -n $SHAPES ]] || return 0
    step "training-step table: $SHAPES"
    # shellcheck disable=SC2086  # SHAPES is a list
    DEVICE=$DEVICE KILN=$KILN KILN_OPS=$KILN_OPS OUT=$OUT/bench tests/bench/train.sh $SHAPES >"$OUT/table.md"
    local status=$?
    cat "$OUT/table.md"
    return $status
}

# kiln's row of each shape after the first argument again with one of its CubeCL kernels off (KILN_OPS=$1),
# into table-$1.md: what the kernel buys, beside the table's row.
kernel_ab() {
    local ops=$1
    shift
    (($#)) || return 0
    DEVICE=$DEVICE KILN=$KILN KILN_OPS=$ops REFERENCE=none OUT=$OUT/bench tests/bench/train.sh "$@" >"$OUT/table-$ops.md"
    local status=$?
    cat "$OUT/table-$ops.md"
    return $status
}

stage_noscan() {
    step "the DeltaNet scan, chunk solve and decay gradients as tensor ops: ${SCAN_AB:-no shape}"
    # shellcheck disable=SC2086  # SCAN_AB is a list
    kernel_ab noscan $SCAN_AB
}

stage_noattn() {
    step "the attention's softmax rows as tensor ops: ${ATTN_AB:-no shape}"
    # shellcheck disable=SC2086  # ATTN_AB is a list
    kernel_ab noattn $ATTN_AB
}

stage_noloss() {
    step "the cross-entropy's rows as tensor ops: ${LOSS_AB:-no shape}"
    # shellcheck disable=SC2086  # LOSS_AB is a list
    kernel_ab noloss $LOSS_AB
}

stage_nonorm() {
    step "the RMSNorms as tensor ops: ${NORM_AB:-no shape}"
    # shellcheck disable=SC2086  # NORM_AB is a list
    kernel_ab nonorm $NORM_AB
}

stage_noconv() {
    step "the causal conv as tensor ops: ${CONV_AB:-no shape}"
    # shellcheck disable=SC2086  # CONV_AB is a list
    kernel_ab noconv $CONV_AB
}

stage_nooptim() {
    step "the optimizer as tensor ops: ${OPTIM_AB:-no shape}"
    # shellcheck disable=SC2086  # OPTIM_AB is a list
    kernel_ab nooptim $OPTIM_AB
}

stage_moments() {
    [[ -n $MOMENTS_SHAPES ]] || return 0
    local variant moments masters status=0
    : >"$OUT/table-moments.md"
    # The last: PyTorch's plain bf16 AdamW footprint (bf16 moments, no f32 masters), with stochastic rounding.
    for variant in bf16:f32 q8:f32 bf16:stochastic; do
        moments=${variant%:*} masters=${variant#*:}
        step "AdamW moments in $moments, masters $masters: $MOMENTS_SHAPES"
        # shellcheck disable=SC2086  # MOMENTS_SHAPES is a list
        # Without masters the rounding runs as tensor ops (integer hashes burn does not fuse: on lavapipe 2,662
        # kernels a tiny-LFM2 step instead of 714) unless kiln's AdamW kernel takes it (465, as with masters):
        # both rows. With that footprint, the layers recomputed in the backward pass too: the least memory kiln
        # trains in.
        local ops=ops
        [[ $masters == stochastic ]] && ops="ops optim checkpointed"
        DEVICE=$DEVICE KILN=$KILN KILN_OPS=$ops MOMENTS=$moments MASTERS=$masters REFERENCE=none \
            OUT=$OUT/bench-moments-$moments-$masters tests/bench/train.sh $MOMENTS_SHAPES >>"$OUT/table-moments.md" \
            || status=1
    done
    cat "$OUT/table-moments.md"
    return $status
}

stage_autotune() {
    [[ -n $AUTOTUNE_SHAPES ]] || return 0
    if [[ -z $KILN_AUTOTUNE ]]; then
        echo "autotune: no build with burn's autotune (KILN_AUTOTUNE; GPU_FEATURES=autotune make gpu-carry)" >&2
        return 1
    fi
    step "burn's autotune: $AUTOTUNE_SHAPES ($AUTOTUNE_OPS)"
    # shellcheck disable=SC2086  # AUTOTUNE_SHAPES is a list
    DEVICE=$DEVICE KILN=$KILN_AUTOTUNE KILN_OPS=$AUTOTUNE_OPS REFERENCE=none OUT=$OUT/bench-autotune \
        tests/bench/train.sh $AUTOTUNE_SHAPES >"$OUT/table-autotune.md"
    local status=$?
    cat "$OUT/table-autotune.md"
    return $status
}

stage_fit() {
    [[ -n $FIT_SHAPES ]] || return 0
    step "fit: $FIT_SHAPES at $FIT_SEQ, 2 micro-batches, 8-bit moments, without and with checkpointing, per expert"
    # shellcheck disable=SC2086  # FIT_SHAPES is a list
    DEVICE=$DEVICE KILN=$KILN KILN_OPS="ops checkpointed noexperts" MOMENTS=q8 REFERENCE=none SEQ=$FIT_SEQ ACC=2 \
        STEPS=2 WARMUP=1 OUT=$OUT/bench-fit tests/bench/train.sh $FIT_SHAPES >"$OUT/table-fit.md"
    local status=$?
    cat "$OUT/table-fit.md"
    return $status
}

stage_profile() {
    local shape status=0
    for shape in $PROFILE_SHAPES; do
        step "kernel profile: $shape"
        # The table's row of the shape (the same settings, unprofiled), for the share of its step the kernels fill.
        local switches row
        switches=$(marked_switches "$FALLBACK_MARK" "$shape")
        row=$OUT/bench/$shape-kiln${switches:+-$(switches_label "$switches")}.json
        [[ -f $row ]] || row=""
        if BENCH=$row DEVICE=$DEVICE KILN=$KILN SEQ=${SEQ:-4096} tests/bench/kernel_profile.sh \
            "tests/bench/shapes/$shape.json" "$OUT/profile-$shape"; then
            head -14 "$OUT/profile-$shape.md"
        else
            echo "kernel profile of $shape failed (see profile-$shape.stdout)" >&2
            status=1
        fi
    done
    return $status
}

prepare_shards() {
    [[ -f runs/$run/data/stats.json ]] && return 0
    step "shards of the offline pipeline"
    "$KILN" --quiet sft --model tiny --run "$run" --until prepare --device "$DEVICE" >"$OUT/prepare.log" 2>&1 \
        || { echo "kiln sft --until prepare failed (see prepare.log)" >&2; return 1; }
}

stage_train() {
    prepare_shards || return 1
    step "kiln train: $TRAIN_SHAPE, $EPOCHS epochs on $DEVICE"
    local config=tests/bench/shapes/$TRAIN_SHAPE.json status=0
    [[ -f $config ]] || config=configs/models/$TRAIN_SHAPE/config.json
    local train_run=runs/$run-train-$TRAIN_SHAPE
    rm -rf "$train_run" && mkdir -p "$train_run/from"
    cp "$config" "$train_run/from/config.json"
    cp configs/models/tiny/{tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} \
        "$train_run/from/"
    run_train() {
        "$KILN" --quiet train --model-dir "$train_run/base" --data "runs/$run/data" --run "$1" --device "$DEVICE" \
            --epochs "$EPOCHS" --micro-batch "$TRAIN_MICRO" --global-batch "$TRAIN_BATCH" --lr "$TRAIN_LR" \
            --peak-tflops 989
    }
    if "$KILN" --quiet init-model --from "$train_run/from" --out "$train_run/base" --dtype bf16 >"$OUT/train.log" 2>&1 \
        && run_train "$train_run" >>"$OUT/train.log" 2>&1; then
        tail -1 "$OUT/train.log"
    else
        status=1
        echo "kiln train failed (see train.log)" >&2
        tail -5 "$OUT/train.log" >&2
        # A non-finite loss or a failure on CUDA: the same run without what has never run on a GPU before
        # (fallback.sh) says whose bug it is.
        if [[ $DEVICE == cuda ]]; then
            local marked switches label
            marked=$(marked_switches "$FALLBACK_MARK" "$TRAIN_SHAPE")
            while read -r -u 3 switches; do
                label=$(switches_label "$switches")
                step "kiln train again with $switches"
                with_switches "$switches" run_train "$train_run-$label" >"$OUT/train-$label.log" 2>&1
                local ok=$?
                tail -2 "$OUT/train-$label.log"
                mkdir -p "$OUT/train-$label"
                cp "$train_run-$label"/train/metrics.jsonl "$OUT/train-$label/" 2>/dev/null
                if ((ok == 0)); then
                    echo "$TRAIN_SHAPE $switches" >>"$FALLBACK_MARK"
                    break
                fi
            done 3< <(fallback_runs FALLBACK_VARIANTS "$marked" "$(kernels_turned_on)")
        fi
    fi
    mkdir -p "$OUT/train"
    cp "$train_run"/train/metrics.jsonl "$train_run"/train/summary.json "$OUT/train/" 2>/dev/null
    ls -R "$train_run"/checkpoints >"$OUT/train/checkpoints.txt" 2>&1
    return $status
}

stage_pipeline() {
    local model status=0
    for model in $PIPELINE_MODELS; do
        pipeline_of "$model" || status=1
    done
    return $status
}

# `kiln sft` of model $1 on DEVICE, everything from prepare to the card: tiny as `make sft` runs it; any other
# model on a random-init bf16 base of its benchmark shape (init-model from $PIPELINE_BASES/from-$1, which
# base_source.sh makes: its own template, a tokenizer with its special tokens) with PIPELINE_SET.
pipeline_of() {
    local model=$1 name=$run suffix="" args=() settings=() setting
    if [[ $model != tiny ]]; then
        name=$run-$model suffix=-$model
        local from=$PIPELINE_BASES/from-$model base=runs/$run-$model-base
        [[ -d $from ]] || { echo "no $from: make gpu-carry GPU_BASES=$model (tests/bench/base_source.sh)" >&2; return 1; }
        rm -rf "$base" "$base-from" && cp -r "$from" "$base-from"
        if [[ -f $base-from/tokenizer.json.xz ]]; then
            unpack_file "$base-from/tokenizer.json.xz" "$base-from/tokenizer.json" || return 1
            rm "$base-from/tokenizer.json.xz"
        fi
        if ! "$KILN" --quiet init-model --from "$base-from" --out "$base" --dtype bf16 >"$OUT/sft$suffix.log" 2>&1; then
            echo "kiln init-model $model failed (see sft$suffix.log)" >&2
            tail -5 "$OUT/sft$suffix.log" >&2
            return 1
        fi
        args=(--base "$base")
        read -ra settings <<<"$PIPELINE_SET" # no pathname expansion of the settings' brackets
        for setting in "${settings[@]}"; do args+=(--set "$setting"); done
    fi
    step "the $model pipeline on $DEVICE"
    local status=0
    rm -rf "runs/$name" # every stage runs, none is skipped as done by an earlier call on this machine
    if "$KILN" --quiet sft --model "$model" --run "$name" --device "$DEVICE" "${args[@]}" >>"$OUT/sft$suffix.log" 2>&1; then
        tail -1 "$OUT/sft$suffix.log"
    else
        status=1
        echo "kiln sft $model failed (see sft$suffix.log)" >&2
        tail -5 "$OUT/sft$suffix.log" >&2
    fi
    mkdir -p "$OUT/sft$suffix"
    cp -r "runs/$name/eval" "runs/$name/README.md" "runs/$name/train/metrics.jsonl" "runs/$name/data/stats.json" \
        "$OUT/sft$suffix/" 2>/dev/null
    return $status
}

# Unpack file $1 (xz, by python's lzma where the machine has no xz; or gzip) into $2.
unpack_file() {
    case $1 in
        *.xz)
            if command -v xz >/dev/null; then
                xz -dc "$1" >"$2"
            else
                python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1" >"$2"
            fi ;;
        *.gz) gzip -dc "$1" >"$2" ;;
        *) false ;;
    esac || { echo "cannot unpack $1" >&2; return 1; }
}

# One stage, in a process of its own so that the parent can time it out (the parent has set up KILN and OUT).
if [[ ${1:-} == --stage ]]; then
    # shellcheck source=tests/bench/fallback.sh
    source tests/bench/fallback.sh
    if [[ $DEVICE == cuda && " train pipeline profile " == *" $2 "* ]]; then
        case $2 in
            train) marked=$(marked_switches "$FALLBACK_MARK" "$TRAIN_SHAPE") ;;
            # shellcheck disable=SC2086  # PIPELINE_MODELS is a list
            pipeline) marked=$(marked_for_shapes "$FALLBACK_MARK" $PIPELINE_MODELS) ;;
            # shellcheck disable=SC2086  # PROFILE_SHAPES is a list
            profile) marked=$(marked_for_shapes "$FALLBACK_MARK" $PROFILE_SHAPES) ;;
        esac
        if [[ -n $marked ]]; then
            echo "note: kiln runs with $marked in this stage, after failures before ($(paste -sd, "$FALLBACK_MARK"))" >&2
            # shellcheck disable=SC2086  # NAME=off assignments
            export $marked
        fi
    fi
    "stage_$2"
    exit $?
fi

mkdir -p "$OUT"
OUT=$(realpath "$OUT")
# shellcheck source=tests/bench/cuda_env.sh
[[ $DEVICE == cuda ]] && source tests/bench/cuda_env.sh
# What the script makes for its own run goes at its exit: the unpacked binaries, the cubecl.toml (below).
unpack_dir=$(mktemp -d)
made_cubecl_toml=0
trap 'rm -rf "$unpack_dir"; ((made_cubecl_toml)) && rm -f cubecl.toml' EXIT
# The path of binary $1, unpacked into $unpack_dir first where it is packed (xz or gzip).
unpacked_binary() {
    local unpacked
    case $1 in
        *.xz | *.gz) unpacked=$unpack_dir/$(basename "${1%.*}") ;;
        *) realpath "$1"; return ;;
    esac
    unpack_file "$1" "$unpacked" && chmod +x "$unpacked" && realpath "$unpacked"
}
KILN=$(unpacked_binary "${KILN:-target/release/kiln}") || exit 2
[[ -z ${KILN_AUTOTUNE+set} && -f gpu/kiln-autotune.xz ]] && KILN_AUTOTUNE=gpu/kiln-autotune.xz
if [[ -n ${KILN_AUTOTUNE:-} ]]; then
    KILN_AUTOTUNE=$(unpacked_binary "$KILN_AUTOTUNE") || exit 2
fi
: "${KERNEL_CACHE:=runs/kernel-cache}" "${KERNEL_CACHE_IN=gpu/kernel-cache.tgz}" "${KERNEL_CACHE_OUT:=}"
if [[ $KERNEL_CACHE != off ]]; then
    mkdir -p "$KERNEL_CACHE"
    KERNEL_CACHE=$(realpath "$KERNEL_CACHE")
    # Only into an empty cache: over one that an earlier call on this machine filled, the older archive's
    # files would replace newer ones.
    if [[ -f $KERNEL_CACHE_IN && -z $(ls -A "$KERNEL_CACHE") ]]; then
        tar -xzf "$KERNEL_CACHE_IN" -C "$KERNEL_CACHE" || echo "note: cannot unpack $KERNEL_CACHE_IN: kernels compile afresh" >&2
    fi
    export CUDA_CACHE_PATH=$KERNEL_CACHE/nv CUDA_CACHE_MAXSIZE=4294967296
    # compile.log: a line for each kernel compiled rather than loaded from the cache, by every process.
    if [[ ! -e cubecl.toml ]]; then
        printf '[compilation]\ncache = { file = "%s" }\n[compilation.logger]\nlevel = "basic"\nfile = "%s"\nappend = true\n[autotune]\ncache = { file = "%s" }\n' \
            "$KERNEL_CACHE" "$OUT/compile.log" "$KERNEL_CACHE" >cubecl.toml
        made_cubecl_toml=1
    fi
fi
export KERNEL_CACHE

# The caches packed into KERNEL_CACHE_OUT, under the device tool's 16 MiB a file: the driver's machine code
# is left out when all of it would not fit.
pack_kernel_cache() {
    local limit=16777216
    tar -czf "$KERNEL_CACHE_OUT" -C "$KERNEL_CACHE" . || return 1
    (($(wc -c <"$KERNEL_CACHE_OUT") < limit)) && return 0
    tar -czf "$KERNEL_CACHE_OUT" -C "$KERNEL_CACHE" --exclude=./nv . || return 1
    (($(wc -c <"$KERNEL_CACHE_OUT") < limit)) && { echo "note: $KERNEL_CACHE_OUT holds no driver cache (too large)" >&2; return 0; }
    echo "$KERNEL_CACHE_OUT is over 16 MiB: the device tool will not bring it back" >&2
    return 1
}
# Where the parity, table and train stages note the switches that mended a failed kiln run (fallback.sh;
# train.sh's FALLBACK_MARK): the later runs take them.
: "${FALLBACK_MARK:=$OUT/fallback}"
export KERNEL_CONFIGS KERNEL_PRECISIONS KERNEL_REPEATS KERNEL_JOBS SANITIZE_TOOLS SANITIZE_WHEN DEVICE STAGES SHAPES KILN_OPS TRAIN_SHAPE EPOCHS TRAIN_MICRO TRAIN_BATCH TRAIN_LR PROFILE_SHAPES SCAN_AB \
    PIPELINE_MODELS PIPELINE_BASES PIPELINE_SET MOMENTS_SHAPES FIT_SHAPES FIT_SEQ OUT KILN KILN_AUTOTUNE AUTOTUNE_SHAPES AUTOTUNE_OPS LD_LIBRARY_PATH FALLBACK_MARK

step "machine"
{
    date -u +%FT%TZ
    git rev-parse --short HEAD 2>/dev/null || echo "(no git)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    [[ $KERNEL_CACHE != off ]] && echo "kernel cache: $(find "$KERNEL_CACHE" -type f | wc -l) files, $(du -sh "$KERNEL_CACHE" | cut -f1)$([[ -f $KERNEL_CACHE_IN ]] && echo " from $KERNEL_CACHE_IN")"
    "$KILN" info  # cuda_smoke_test: "ok", or what is missing
    [[ -n ${KILN_AUTOTUNE:-} ]] && "$KILN_AUTOTUNE" info | grep -E '"(kiln|cuda_smoke_test|cuda_autotune)"'
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" >&2

for stage in $STAGES; do
    declare -F "stage_$stage" >/dev/null || { echo "STAGES: unknown stage '$stage'" >&2; exit 2; }
done
# The limit of stage $1: its STAGE_TIMEOUTS entry, else STAGE_TIMEOUT.
stage_limit() {
    local entry
    for entry in ${STAGE_TIMEOUTS:-}; do
        [[ $entry == "$1="* ]] && { echo "${entry#*=}"; return; }
    done
    echo "$STAGE_TIMEOUT"
}
failures=0
for stage in $STAGES; do
    began=$SECONDS
    limit=$(stage_limit "$stage")
    timeout -k 10 "$limit" "$self" --stage "$stage"
    status=$?
    ((status == 124 || status == 137)) && echo "FAILED: $stage ran past its limit of ${limit}s" >&2
    ((status == 0)) || { ((status == 124 || status == 137)) || echo "FAILED: $stage" >&2; failures=$((failures + 1)); }
    echo "== $stage: $((SECONDS - began)) s, exit $status" >&2
done
if [[ $KERNEL_CACHE != off && -n $KERNEL_CACHE_OUT ]]; then
    pack_kernel_cache && echo "kernel cache: $(find "$KERNEL_CACHE" -type f | wc -l) files → $KERNEL_CACHE_OUT ($(wc -c <"$KERNEL_CACHE_OUT") bytes)" >&2
fi
if [[ -n $PACK ]]; then
    tar -czf "$PACK.partial" -C "$(dirname "$OUT")" "$(basename "$OUT")" && mv "$PACK.partial" "$PACK"
fi
echo "gpu_session: $failures failure(s); results in ${PACK:-$OUT}" >&2
exit $((failures > 0))
