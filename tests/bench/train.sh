#!/usr/bin/env bash
# Training-step benchmark: kiln (`kiln bench-train`) beside transformers + PyTorch (tests/bench/train_python.py)
# on the same config shapes, sequence length, micro-batch, accumulation and step counts, on the same device,
# one after the other. Result JSON files go to $OUT; the table (with kiln / PyTorch ratios) to stdout.
#
#   KILN=target/release/kiln tests/bench/train.sh [shape ...]
#
# A shape is tests/bench/shapes/<shape>.json or configs/models/<shape>/config.json. Settings (environment):
#   DEVICE      cuda when nvidia-smi sees a GPU, else cpu
#   SEQ MICRO ACC STEPS WARMUP   4096 1 1 10 3 on cuda; 128 1 1 2 1 on cpu
#   PEAK_TFLOPS 989 on cuda (H100/H200 SXM dense bf16), for MFU
#   PRECISION   kiln's precision (auto: bf16 on cuda, f32 on cpu); MOMENTS kiln's AdamW moments (f32, bf16, q8);
#               MASTERS how bf16 weights take the update (f32 masters, or stochastic rounding without them)
#   KILN_OPS    "ops" (kiln's hand-written attention / SwiGLU / loss ops, and kiln's CubeCL kernels where the
#               device runs them by default: Vulkan, not CUDA), "kernels" (the ops with every one of kiln's
#               CubeCL kernels on, KILN_*_KERNEL=on), "optim" (the ops with kiln's optimizer kernels on,
#               KILN_OPTIM_KERNEL=on: stochastic rounding in AdamW's launch), "reference" (burn's plain
#               compositions, `--reference-ops`), "unfused" (the ops without burn's fusion on CUDA,
#               KILN_CUDA_FUSION=off), or the ops with one of kiln's CubeCL kernels switched off for its tensor
#               ops: "noscan" (the DeltaNet kernels, KILN_SCAN_KERNEL=off), "noattn" (the
#               attention's softmax rows, KILN_ATTENTION_KERNEL=off), "noloss" (the cross-entropy's rows,
#               KILN_LOSS_KERNEL=off), "nonorm" (the RMSNorms, KILN_NORM_KERNEL=off), "noconv" (the causal
#               conv, KILN_CONV_KERNEL=off), "nooptim" (the optimizer's
#               gradient norm and AdamW update, KILN_OPTIM_KERNEL=off); "noexperts" (MoE shapes only: the
#               experts as a matmul each instead of one batched matmul over padded groups, KILN_EXPERTS_BATCHED=off);
#               "checkpointed" (the ops with --activation-checkpointing); "chunk<MiB>" (the ops with the
#               attention's query chunks holding up to that many MiB of f32 scores, KILN_ATTENTION_CHUNK_MIB;
#               256 by default: chunk1024 trades memory for fewer kernels); "cublas" (the ops with the matrix
#               products through cuBLAS, KILN_MATMUL=cublas: CUDA only, ordered on the device), "cublas-host"
#               (the same products ordered by the host's waits, KILN_MATMUL=cublas-host), "cublas-kernels" (cublas
#               and every one of kiln's CubeCL kernels on); or several:
#               "ops reference unfused noscan noattn noloss nonorm noconv nooptim noexperts checkpointed chunk1024 cublas"
#   REFERENCE   the PyTorch precisions to run ("bf16 amp" on cuda, "f32" on cpu; see train_python.py), or none
#   PYTHON      a python with torch and transformers (python3); without them the reference is skipped
#   FALLBACK    1: after a kiln row of a shape fails on CUDA, it runs again without kiln's own kernels, then
#               without burn's fusion, then without both (tests/bench/fallback.sh), and the shape's other rows
#               run with the first set of switches that worked; 0: not
#   FALLBACK_MARK a file of "<shape|*> NAME=off …" lines (fallback.sh): appended to here when a fallback
#               worked, and read first (a shape's rows run with its lines' and the "*" lines' switches)
#   OUT         runs/bench-train
set -uo pipefail
cd "$(dirname "$0")/../.."
KILN=${KILN:-target/release/kiln}
PYTHON=${PYTHON:-python3}
if [[ -z ${DEVICE:-} ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi
if [[ $DEVICE == cuda ]]; then
    : "${SEQ:=4096}" "${STEPS:=10}" "${WARMUP:=3}" "${PEAK_TFLOPS:=989}" "${REFERENCE:=bf16 amp}"
    default_shapes=(lfm2-350m lfm2.5-1.2b qwen3.5-0.8b)
else
    : "${SEQ:=128}" "${STEPS:=2}" "${WARMUP:=1}" "${PEAK_TFLOPS:=}" "${REFERENCE:=f32}"
    default_shapes=(tiny tiny-qwen3.5)
fi
: "${FALLBACK:=1}" "${FALLBACK_MARK:=}" "${MICRO:=1}" "${ACC:=1}" "${PRECISION:=auto}" "${MOMENTS:=f32}" "${MASTERS:=f32}" "${KILN_OPS:=ops}" "${OUT:=runs/bench-train}"
[[ $REFERENCE == none ]] && REFERENCE=""
shapes=("$@")
((${#shapes[@]})) || shapes=("${default_shapes[@]}")
mkdir -p "$OUT"
# shellcheck source=tests/bench/cuda_env.sh
[[ $DEVICE == cuda ]] && source tests/bench/cuda_env.sh
have_torch=1
"$PYTHON" -c "import torch, transformers" 2>/dev/null || {
    have_torch=0
    echo "note: $PYTHON has no torch + transformers: the PyTorch reference is skipped" >&2
}
common=(--seq "$SEQ" --micro-batch "$MICRO" --accumulation "$ACC" --steps "$STEPS" --warmup "$WARMUP")
[[ -n $PEAK_TFLOPS ]] && common+=(--peak-tflops "$PEAK_TFLOPS")
failures=0
# shellcheck source=tests/bench/fallback.sh
source tests/bench/fallback.sh
if [[ -z $FALLBACK_MARK ]]; then
    FALLBACK_MARK=$(mktemp)
    trap 'rm -f "$FALLBACK_MARK"' EXIT
fi
results=()
# kiln and the PyTorch script exit with this status when the device's memory cannot hold the run, and write a
# row saying so (`out_of_memory`) where the result would have gone: the answer the fit stage asks for, and
# nothing a fallback switch mends, so it is neither retried nor counted as a failure.
OUT_OF_MEMORY=3
# One kiln row into $out, with the loop's settings and the switches in $1; the result (or the row of a run
# that ran out of device memory) is labelled with its shape. Returns kiln's exit status.
kiln_row() {
    rm -f "$out"
    # shellcheck disable=SC2086  # $1 is a list of NAME=off assignments
    # A kernel switch left empty stays unset: the device's default (`kiln info`).
    local kernels=() setting
    for setting in KILN_SCAN_KERNEL=$scan KILN_ATTENTION_KERNEL=$attn KILN_LOSS_KERNEL=$loss KILN_NORM_KERNEL=$norm \
        KILN_CONV_KERNEL=$conv KILN_OPTIM_KERNEL=$optim; do
        [[ -n ${setting#*=} ]] && kernels+=("$setting")
    done
    [[ -n $chunk ]] && kernels+=("KILN_ATTENTION_CHUNK_MIB=$chunk")
    env -u KILN_SCAN_KERNEL -u KILN_ATTENTION_KERNEL -u KILN_LOSS_KERNEL -u KILN_NORM_KERNEL -u KILN_CONV_KERNEL \
        -u KILN_OPTIM_KERNEL KILN_CUDA_FUSION=$fusion "${kernels[@]}" KILN_EXPERTS_BATCHED=$experts KILN_MATMUL=$matmul $1 \
        "$KILN" --quiet bench-train --config "$config" --device "$DEVICE" \
        --precision "$PRECISION" --moments "$MOMENTS" --masters "$MASTERS" "${switch[@]}" "${common[@]}" --out "$out" >/dev/null
    local status=$?
    if ((status == 0 || status == OUT_OF_MEMORY)) && [[ -f $out ]]; then
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r['shape']=sys.argv[2]; json.dump(r, open(sys.argv[1],'w'))" \
            "$out" "$shape" || return 1
    fi
    return $status
}
for shape in "${shapes[@]}"; do
    config=tests/bench/shapes/$shape.json
    [[ -f $config ]] || config=configs/models/$shape/config.json
    if [[ ! -f $config ]]; then
        echo "unknown shape '$shape': no tests/bench/shapes/$shape.json or configs/models/$shape/config.json" >&2
        exit 2
    fi
    for ops in $KILN_OPS; do
        # A matmul per expert is another row only for a MoE shape.
        if [[ $ops == noexperts ]] && ! grep -q '"num_experts"' "$config"; then
            echo "== $shape: no experts, so no noexperts row" >&2
            continue
        fi
        # Empty: unset, the device's default (kiln's kernels off on CUDA, on on Vulkan: backend::KernelsByDefault).
        scan="" attn="" loss="" norm="" conv="" optim="" chunk="" experts=on switch=() fusion=on matmul=cubecl
        case $ops in
            ops) out=$OUT/$shape-kiln.json ;;
            kernels) out=$OUT/$shape-kiln-kernels.json; scan=on attn=on loss=on norm=on conv=on optim=on ;;
            optim) out=$OUT/$shape-kiln-optim.json; optim=on ;;
            reference) out=$OUT/$shape-kiln-reference.json; switch=(--reference-ops) ;;
            unfused) out=$OUT/$shape-kiln-unfused.json; fusion=off ;;
            noscan) out=$OUT/$shape-kiln-noscan.json; scan=off ;;
            noattn) out=$OUT/$shape-kiln-noattn.json; attn=off ;;
            noloss) out=$OUT/$shape-kiln-noloss.json; loss=off ;;
            nonorm) out=$OUT/$shape-kiln-nonorm.json; norm=off ;;
            noconv) out=$OUT/$shape-kiln-noconv.json; conv=off ;;
            nooptim) out=$OUT/$shape-kiln-nooptim.json; optim=off ;;
            noexperts) out=$OUT/$shape-kiln-noexperts.json; experts=off ;;
            checkpointed) out=$OUT/$shape-kiln-checkpointed.json; switch=(--activation-checkpointing) ;;
            chunk[1-9]*) out=$OUT/$shape-kiln-$ops.json; chunk=${ops#chunk} ;;
            cublas) out=$OUT/$shape-kiln-cublas.json; matmul=cublas ;;
            cublas-host) out=$OUT/$shape-kiln-cublas-host.json; matmul=cublas-host ;;
            cublas-kernels) out=$OUT/$shape-kiln-cublas-kernels.json; matmul=cublas; scan=on attn=on loss=on norm=on conv=on optim=on ;;
            *) echo "KILN_OPS: unknown '$ops' (ops, kernels, optim, reference, unfused, noscan, noattn, noloss, nonorm, noconv, nooptim, noexperts, checkpointed, chunk<MiB>, cublas, cublas-host or cublas-kernels)" >&2; exit 2 ;;
        esac
        # What failed before (in this shape's rows, or in the parity stage's tiny runs) stays off.
        marked=$(marked_switches "$FALLBACK_MARK" "$shape")
        row_out=$out
        if [[ -n $marked ]]; then
            out=${out%.json}-$(switches_label "$marked").json
            echo "== $shape: kiln ($DEVICE, $PRECISION, $ops) with $marked, after a failure before" >&2
        else
            echo "== $shape: kiln ($DEVICE, $PRECISION, $ops)" >&2
        fi
        kiln_row "$marked"
        status=$?
        if ((status == 0)); then
            results+=("$out")
            continue
        fi
        if ((status == OUT_OF_MEMORY)); then
            echo "== $shape: kiln ($ops) ran out of device memory" >&2
            [[ -f $out ]] && results+=("$out")
            continue
        fi
        echo "kiln failed on $shape ($ops)" >&2
        failures=$((failures + 1))
        [[ $DEVICE == cuda && $FALLBACK == 1 ]] || continue
        # The row again without what has never run on a GPU before, so the table still has kiln's figures and
        # the row that worked says whose bug it was.
        kernels_on=0
        [[ " $scan $attn $loss $norm $conv $optim " == *" on "* ]] && kernels_on=1
        while read -r -u 3 switches; do
            out=${row_out%.json}-$(switches_label "$switches").json
            echo "== $shape: kiln again with $switches" >&2
            kiln_row "$switches"
            status=$?
            if ((status == 0)); then
                results+=("$out")
                echo "$shape $switches" >>"$FALLBACK_MARK"
                break
            fi
            # Without these parts the step may need more memory than with them: the row says so.
            ((status == OUT_OF_MEMORY)) && [[ -f $out ]] && results+=("$out")
        done 3< <(fallback_runs FALLBACK_VARIANTS "$marked" "$kernels_on")
    done
    ((have_torch)) || continue
    for precision in $REFERENCE; do
        out=$OUT/$shape-pytorch-$precision.json
        echo "== $shape: PyTorch ($DEVICE, $precision)" >&2
        rm -f "$out"
        "$PYTHON" tests/bench/train_python.py --config "$config" --device "$DEVICE" --precision "$precision" \
            "${common[@]}" --shape "$shape" --out "$out" >/dev/null
        status=$?
        ((status == OUT_OF_MEMORY)) && echo "== $shape: PyTorch ($precision) ran out of device memory" >&2
        if ((status == 0 || status == OUT_OF_MEMORY)) && [[ -f $out ]]; then
            results+=("$out")
        else
            echo "PyTorch failed on $shape ($precision)" >&2
            failures=$((failures + 1))
        fi
    done
done
((${#results[@]})) && python3 tests/bench/train_python.py table "${results[@]}"
exit $((failures > 0))
