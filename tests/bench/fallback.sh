# Sourced by train.sh and gpu_session.sh: what a kiln run on CUDA is tried again without after it fails, and
# the mark file that carries what worked to the runs after it.
#
# Two parts of kiln's CUDA step have never run on a GPU: burn's fusion (it panicked in every step of the first
# GPU session, tracel-ai/burn#5292; fixed since and checked on lavapipe) and kiln's own CubeCL kernels (the
# attention's and the loss's softmax rows, the DeltaNet's three, the RMSNorms, the causal conv,
# the optimizer's gradient norm and AdamW update: checked on lavapipe, and compiled by NVRTC 13.0 for sm_90a
# without a GPU (src/kernels/cuda_source.rs), but never launched on one).
# Since the third GPU session (2026-12-04) kiln's kernels are off by default on CUDA (their outputs were pitched
# there; backend::KernelsByDefault), so the kernel variants below change a CUDA run only where it turned them
# on (train.sh's `kernels` rows, gpu_session.sh's `kernels` stage); `fallback_runs` leaves them out elsewhere.
# Each has a switch that runs the same binary without it. A device session is minutes long, so a failure in
# one must not cost the figures of the rest: the run is tried again with the switches below, in order, and
# the first set that works is marked for the runs after it.
#
# Mark file lines: "<scope> NAME=off …", scope a benchmark shape or "*" (every shape: what gpu_session.sh's
# parity stage finds with the tiny shapes).

# kiln's own kernels off (burn's fused kernels kept: the figures stay close to the fused step's), then burn's
# fusion off (kiln's kernels kept), then both.
KILN_KERNELS_OFF="KILN_ATTENTION_KERNEL=off KILN_LOSS_KERNEL=off KILN_NORM_KERNEL=off"
KILN_KERNELS_OFF+=" KILN_OPTIM_KERNEL=off KILN_SCAN_KERNEL=off KILN_CONV_KERNEL=off"
FALLBACK_VARIANTS=("$KILN_KERNELS_OFF" "KILN_CUDA_FUSION=off" "KILN_CUDA_FUSION=off $KILN_KERNELS_OFF")
# For finding which part failed (gpu_session.sh's parity stage, on tiny shapes where a run takes seconds):
# each kernel alone first.
# The MoE's batched experts (burn's gathers and a batched matmul, new on a GPU too) are tried alone as well.
FALLBACK_DIAGNOSIS=("KILN_ATTENTION_KERNEL=off" "KILN_LOSS_KERNEL=off" "KILN_NORM_KERNEL=off" "KILN_OPTIM_KERNEL=off"
    "KILN_SCAN_KERNEL=off" "KILN_CONV_KERNEL=off" "KILN_EXPERTS_BATCHED=off" "${FALLBACK_VARIANTS[@]}")

# The switches marked in file $1 for scope $2 ("*" lines apply to every scope; no $2: every line), on one
# line, without repeats.
marked_switches() {
    [[ -n ${1:-} && -s $1 ]] || return 0
    awk -v scope="${2:-}" 'scope == "" || $1 == scope || $1 == "*" { for (i = 2; i <= NF; i++) print $i }' "$1" \
        | sort -u | paste -sd' '
}

# The switches $1 with those of a fallback variant $2 added, on one line; nothing when $2 adds none (the run
# already had them, so trying it again would change nothing).
switches_with() {
    local union
    # shellcheck disable=SC2086  # word lists
    union=$(printf '%s\n' $1 $2 | sort -u | paste -sd' ')
    [[ $union != "$1" ]] && echo "$union"
}

# Whether $KILN runs its own kernels on CUDA where their switches are unset (`kiln info`;
# backend::KernelsByDefault): asked once.
cuda_kernels_by_default() {
    if [[ -z ${KILN_CUDA_KERNELS_DEFAULT:-} ]]; then
        KILN_CUDA_KERNELS_DEFAULT=off
        "$KILN" info 2>/dev/null | grep -q '"scan_kernel": "unset: on on cuda' && KILN_CUDA_KERNELS_DEFAULT=on
    fi
    [[ $KILN_CUDA_KERNELS_DEFAULT == on ]]
}

# $1 without its KILN_<NAME>_KERNEL=off switches.
without_kernel_switches() {
    local switch kept=()
    for switch in $1; do
        [[ $switch == KILN_*_KERNEL=off ]] || kept+=("$switch")
    done
    echo "${kept[*]}"
}

# The switch sets to try after a CUDA run with the switches $2 (what was marked) failed, one a line: each
# variant of the array named $1 added to $2, those that change nothing left out. Unless $3 is 1 (the run
# turned kiln's kernels on) and where CUDA runs them only when asked, the variants' kernel switches change
# nothing either and are dropped, so "kernels off" is not run again and "fusion off, kernels off" is "fusion off".
fallback_runs() {
    local -n variant_list=$1
    local marked=$2 kernels_on=${3:-0} variant switches tried=" "
    for variant in "${variant_list[@]}"; do
        if [[ $kernels_on != 1 ]] && ! cuda_kernels_by_default; then
            variant=$(without_kernel_switches "$variant")
        fi
        switches=$(switches_with "$marked" "$variant") || continue
        [[ $tried == *" [$switches] "* ]] && continue
        tried+="[$switches] "
        echo "$switches"
    done
}

# A short label of a set of switches, for file names and messages ("nokernels", "unfused-noattn", …).
switches_label() {
    local label="" kernel
    [[ " $1 " == *" KILN_CUDA_FUSION=off "* ]] && label+="-unfused"
    if [[ " $1 " == *" KILN_ATTENTION_KERNEL=off "* && " $1 " == *" KILN_LOSS_KERNEL=off "* \
        && " $1 " == *" KILN_NORM_KERNEL=off "* && " $1 " == *" KILN_OPTIM_KERNEL=off "* \
        && " $1 " == *" KILN_SCAN_KERNEL=off "* && " $1 " == *" KILN_CONV_KERNEL=off "* ]]; then
        label+="-nokernels"
    else
        for kernel in ATTENTION:noattn LOSS:noloss NORM:nonorm OPTIM:nooptim SCAN:noscan CONV:noconv; do
            [[ " $1 " == *" KILN_${kernel%%:*}_KERNEL=off "* ]] && label+="-${kernel#*:}"
        done
    fi
    [[ " $1 " == *" KILN_EXPERTS_BATCHED=off "* ]] && label+="-noexperts"
    echo "${label#-}"
}

# Runs "$2" "$3" … (a command or a shell function) in a subshell with the NAME=off assignments in $1 exported.
with_switches() {
    local switches=$1
    shift
    # shellcheck disable=SC2086  # NAME=off assignments
    ( if [[ -n $switches ]]; then export $switches; fi; "$@" )
}
