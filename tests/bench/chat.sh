#!/usr/bin/env bash
# `kiln chat` turn by turn on a seeded random model of a real shape: each turn continuing the states earlier
# turns kept, beside the same conversation with every turn's whole prompt run (`--no-kept-states`, what chat
# did before it kept states). Same greedy replies, so the same prompts; the table puts each turn's seconds
# side by side. Then the prefill of one long prompt (`kiln generate --max-tokens 1`), and with KILN_BEFORE
# (an older kiln binary) the same prefill by it.
#
#   KILN=target/release/kiln tests/bench/chat.sh
#
# Settings (environment): SHAPE (tests/bench/shapes/lfm2-350m.json), TURNS (5), REPLY (32 tokens),
# DEVICE (cpu), OUT (runs/bench-chat). The tokenizer and template: for a Qwen3.5 shape, the Qwen3.5-derived
# tokenizer and Qwen3.5's small-model template (thinking off: each generation prompt opens an empty think
# block the history does not keep) from ../shared; else the offline default's (configs/models/tiny), whose
# ids the model's larger vocabulary holds.
set -euo pipefail
cd "$(dirname "$0")/../.."
KILN=${KILN:-target/release/kiln}
SHAPE=${SHAPE:-tests/bench/shapes/lfm2-350m.json}
TURNS=${TURNS:-5}
REPLY=${REPLY:-32}
DEVICE=${DEVICE:-cpu}
OUT=${OUT:-runs/bench-chat}
model=$OUT/$(basename "$SHAPE" .json)
if [[ ! -f $model/model.safetensors && ! -f $model/model.safetensors.index.json ]]; then
    source=$OUT/source-$(basename "$SHAPE" .json)
    if grep -q '"qwen3_5' "$SHAPE"; then
        CONFIG=$SHAPE PACK=none tests/bench/base_source.sh qwen3.5-0.8b "$source" >/dev/null
    else
        mkdir -p "$source"
        cp configs/models/tiny/{chat_template.jinja,tokenizer.json,tokenizer_config.json} "$source/"
        cp "$SHAPE" "$source/config.json"
    fi
    "$KILN" --quiet init-model --from "$source" --out "$model" --seed 0
fi

# A user message of about 150 tokens a turn: a command's output pasted back, as in a terminal session.
messages=$OUT/messages.txt
: >"$messages"
for turn in $(seq 1 "$TURNS"); do
    line="here is the output of step $turn, what next? \\"$'\n'
    for i in $(seq 1 6); do
        line+="-rw-r--r-- 1 app app $((turn * 1000 + i * 37)) Dec  4 10:0$i /app/staging/part-$turn-$i.csv \\"$'\n'
    done
    printf '%s\n' "${line%\\$'\n'}" >>"$messages"
done

run_chat() {
    "$KILN" chat --model-dir "$model" --device "$DEVICE" --greedy --max-tokens "$REPLY" "$@" <"$messages" 2>&1 >/dev/null |
        grep '^\[' || true
}
kept=$(run_chat)
rerun=$(run_chat --no-kept-states)
python3 - "$kept" "$rerun" <<'PY'
import re, sys
def turns(text):
    rows = []
    for line in text.splitlines():
        m = re.match(r"\[(\d+) tokens in ([\d.]+)s.*; (\d+) of the prompt's (\d+) tokens", line)
        rows.append(tuple(float(g) if "." in g else int(g) for g in m.groups()))
    return rows
kept, rerun = turns(sys.argv[1]), turns(sys.argv[2])
print("| turn | prompt tokens | continued | reply tokens | s, kept states | s, whole prompt | speed-up |")
print("|---|---|---|---|---|---|---|")
for i, (k, r) in enumerate(zip(kept, rerun), 1):
    print(f"| {i} | {k[3]} | {k[2]} | {k[0]} | {k[1]:.2f} | {r[1]:.2f} | {r[1] / k[1]:.2f}× |")
total = lambda rows: sum(r[1] for r in rows)
print(f"| all | | | | {total(kept):.2f} | {total(rerun):.2f} | {total(rerun) / total(kept):.2f}× |")
PY

# One long prompt's prefill and first token: the whole conversation's messages as one prompt.
prompt=$(tr '\\' ' ' <"$messages")
prefill() {
    "$1" generate --model-dir "$model" --device "$DEVICE" --greedy --prompt "$prompt" --max-tokens 1 2>&1 >/dev/null |
        sed -n 's/^generate: \(.*\) tokens in \([0-9.]*\)s.*/\2/p'
}
printf '\n| binary | prompt prefill + 1 token, s |\n|---|---|\n'
printf '| %s | %s |\n' "$KILN" "$(prefill "$KILN")"
if [[ -n ${KILN_BEFORE:-} ]]; then
    printf '| %s | %s |\n' "$KILN_BEFORE" "$(prefill "$KILN_BEFORE")"
fi
