#!/usr/bin/env bash
# The folder `kiln init-model --from` makes a random-init base of MODEL (a name in configs/models) from, for
# a machine without the Hub (the GPU session's pipeline stage): the model's benchmark shape (tests/bench/shapes/,
# or CONFIG), its own chat template from ../shared/templates, and a tokenizer with its special tokens. The
# tokenizer is packed with xz (the Qwen3.5-derived one is 16 MB, 3.2 MB packed: the device tool carries at most 64 MiB);
# gpu_session.sh unpacks it. PACK=none copies it as it is, for an init-model here (tests/bench/chat.sh).
#
#   tests/bench/base_source.sh qwen3.5-0.8b gpu/from-qwen3.5-0.8b     (make gpu-carry runs this for GPU_BASES)
set -euo pipefail
model=${1:?usage: base_source.sh MODEL OUT_DIR}
out=${2:?usage: base_source.sh MODEL OUT_DIR}
cd "$(dirname "$0")/../.."
: "${SHARED:=../shared}"
: "${PACK:=xz}"
[[ $PACK == xz || $PACK == none ]] || { echo "base_source.sh: PACK is xz or none, not $PACK" >&2; exit 2; }

# Each model's template as its checkpoint ships it, and the tokenizer: the Qwen3.5-derived one for Qwen3.5
# (its 248k ids are the prompts' real lengths); for LFM the tiny model's, whose ids fit any vocabulary.
case $model in
    qwen3.5-0.8b | qwen3.5-2b)
        template=qwen3_5_small_nothink.jinja tokenizer=$SHARED/tokenizers/qwen3.5-derived/tokenizer.json ;;
    qwen3.5-9b) template=qwen3_5.jinja tokenizer=$SHARED/tokenizers/qwen3.5-derived/tokenizer.json ;;
    lfm2-350m) template=lfm2.jinja tokenizer=configs/models/tiny/tokenizer.json ;;
    lfm2.5-1.2b) template=lfm2.5.jinja tokenizer=configs/models/tiny/tokenizer.json ;;
    lfm2.5-8b) template=LFM2.5-8B-A1B.jinja tokenizer=configs/models/tiny/tokenizer.json shape=lfm2.5-8b-a1b ;;
    *) echo "base_source.sh: no template and tokenizer known for $model" >&2; exit 2 ;;
esac
: "${CONFIG:=tests/bench/shapes/${shape:-$model}.json}"
for file in "$CONFIG" "$SHARED/templates/$template" "$tokenizer"; do
    [[ -f $file ]] || { echo "base_source.sh: $file is missing (SHARED=$SHARED)" >&2; exit 2; }
done

rm -rf "$out.partial" && mkdir -p "$out.partial"
# By content, not mode: ../shared is read-only, and a later run must be able to replace the copies.
cat "$CONFIG" >"$out.partial/config.json"
cat "$SHARED/templates/$template" >"$out.partial/chat_template.jinja"
if [[ $PACK == xz ]]; then
    xz -9 -c "$tokenizer" >"$out.partial/tokenizer.json.xz"
else
    cat "$tokenizer" >"$out.partial/tokenizer.json"
fi
case $model in
    qwen3.5-*) echo '{"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}' >"$out.partial/tokenizer_config.json" ;;
    *) cat configs/models/tiny/tokenizer_config.json >"$out.partial/tokenizer_config.json" ;;
esac
rm -rf "$out" && mv "$out.partial" "$out"
echo "$out: $model ($(basename "$CONFIG"), $template, $(du -sb "$out" | cut -f1) bytes)"
