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
#   PRECISION   kiln's precision (auto: bf16 on cuda, f32 on cpu); MOMENTS kiln's AdamW moments (f32, bf16, q8)
#   KILN_OPS    "ops" (kiln's hand-written attention / SwiGLU / loss ops), "reference" (burn's plain
#               compositions, `--reference-ops`), "unfused" (the ops without burn's fusion on CUDA,
#               KILN_CUDA_FUSION=off), "noscan" (the ops with the DeltaNet scan as tensor ops, not kiln's
#               kernel: KILN_SCAN_KERNEL=off), "noattn" (the ops with the attention's softmax rows as tensor
#               ops, not kiln's kernels: KILN_ATTENTION_KERNEL=off), "noloss" (the ops with the
#               cross-entropy's rows as tensor ops: KILN_LOSS_KERNEL=off), "checkpointed" (the ops with
#               --activation-checkpointing), or several: "ops reference unfused noscan noattn noloss checkpointed"
#   REFERENCE   the PyTorch precisions to run ("bf16 amp" on cuda, "f32" on cpu; see train_python.py), or none
#   PYTHON      a python with torch and transformers (python3); without them the reference is skipped
#   FALLBACK_UNFUSED  1: after a kiln row of a shape fails on CUDA with burn's fusion, it and the shape's
#               other rows run without fusion (KILN_CUDA_FUSION=off, labelled "unfused"); 0: not
#   FUSION_MARK a file of "<shape> <ops>" lines, one per shape whose fused row failed and unfused one ran:
#               appended to here, and read first (those shapes run unfused from the start)
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
: "${FALLBACK_UNFUSED:=1}" "${FUSION_MARK:=}" "${MICRO:=1}" "${ACC:=1}" "${PRECISION:=auto}" "${MOMENTS:=f32}" "${KILN_OPS:=ops}" "${OUT:=runs/bench-train}"
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
# Shapes whose kiln run failed with burn's fusion and ran without it (here or, through FUSION_MARK, before).
unfused_shapes=" "
[[ -n $FUSION_MARK && -s $FUSION_MARK ]] && unfused_shapes=" $(cut -d' ' -f1 "$FUSION_MARK" | paste -sd' ') "
results=()
# One kiln row into $out, with the loop's settings; the result is labelled with its shape.
kiln_row() {
    KILN_CUDA_FUSION=$fusion KILN_SCAN_KERNEL=$scan KILN_ATTENTION_KERNEL=$attn KILN_LOSS_KERNEL=$loss \
        "$KILN" --quiet bench-train --config "$config" --device "$DEVICE" \
        --precision "$PRECISION" --moments "$MOMENTS" "${switch[@]}" "${common[@]}" --out "$out" >/dev/null \
        && python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r['shape']=sys.argv[2]; json.dump(r, open(sys.argv[1],'w'))" \
            "$out" "$shape"
}
for shape in "${shapes[@]}"; do
    config=tests/bench/shapes/$shape.json
    [[ -f $config ]] || config=configs/models/$shape/config.json
    if [[ ! -f $config ]]; then
        echo "unknown shape '$shape': no tests/bench/shapes/$shape.json or configs/models/$shape/config.json" >&2
        exit 2
    fi
    for ops in $KILN_OPS; do
        attn=on loss=on
        case $ops in
            ops) out=$OUT/$shape-kiln.json; switch=(); fusion=on; scan=on ;;
            reference) out=$OUT/$shape-kiln-reference.json; switch=(--reference-ops); fusion=on; scan=on ;;
            unfused) out=$OUT/$shape-kiln-unfused.json; switch=(); fusion=off; scan=on ;;
            noscan) out=$OUT/$shape-kiln-noscan.json; switch=(); fusion=on; scan=off ;;
            noattn) out=$OUT/$shape-kiln-noattn.json; switch=(); fusion=on; scan=on; attn=off ;;
            noloss) out=$OUT/$shape-kiln-noloss.json; switch=(); fusion=on; scan=on; loss=off ;;
            checkpointed) out=$OUT/$shape-kiln-checkpointed.json; switch=(--activation-checkpointing); fusion=on; scan=on ;;
            *) echo "KILN_OPS: unknown '$ops' (ops, reference, unfused, noscan, noattn, noloss or checkpointed)" >&2; exit 2 ;;
        esac
        if [[ $unfused_shapes == *" $shape "* && $fusion == on ]]; then
            out=${out%.json}-unfused.json fusion=off
            echo "== $shape: kiln ($DEVICE, $PRECISION, $ops) without burn's fusion, which failed before" >&2
        else
            echo "== $shape: kiln ($DEVICE, $PRECISION, $ops)" >&2
        fi
        if kiln_row; then
            results+=("$out")
        else
            echo "kiln failed on $shape ($ops)" >&2
            failures=$((failures + 1))
            # A failure on burn's fused CUDA backend (tracel-ai/burn#5292 stopped every step of the first GPU
            # session): this row and the shape's others without fusion, so the table still has kiln's figures,
            # and the unfused row says whose bug it was.
            if [[ $DEVICE == cuda && $fusion == on && $FALLBACK_UNFUSED == 1 ]]; then
                echo "== $shape: kiln again without burn's fusion (KILN_CUDA_FUSION=off)" >&2
                out=${out%.json}-unfused.json fusion=off
                if kiln_row; then
                    results+=("$out") unfused_shapes+="$shape "
                    [[ -n $FUSION_MARK ]] && echo "$shape $ops" >>"$FUSION_MARK"
                fi
            fi
        fi
    done
    ((have_torch)) || continue
    for precision in $REFERENCE; do
        out=$OUT/$shape-pytorch-$precision.json
        echo "== $shape: PyTorch ($DEVICE, $precision)" >&2
        if "$PYTHON" tests/bench/train_python.py --config "$config" --device "$DEVICE" --precision "$precision" \
            "${common[@]}" --shape "$shape" --out "$out" >/dev/null; then
            results+=("$out")
        else
            echo "PyTorch failed on $shape ($precision)" >&2
            failures=$((failures + 1))
        fi
    done
done
((${#results[@]})) && python3 tests/bench/train_python.py table "${results[@]}"
exit $((failures > 0))
