#!/usr/bin/env bash
# Prepare throughput: kiln vs transformers' apply_chat_template on the 50 real TB2-lite trajectories, same
# template (TRL's Qwen3.5 training template, which has {% generation %}), same tokenizer, same machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
KILN=${KILN:-target/release/kiln}
SHARED=../shared
WORK=runs/bench-prepare
source tests/bench/qwen_model.sh
"$KILN" --quiet ingest --dataset tb2lite-trajectories --out "$WORK/data"
DATA=$WORK/data/conversations.jsonl
printf '| engine | mode | conversations | samples | tokens | conv/s | tokens/s | peak RSS MiB | wall s |\n|---|---|---|---|---|---|---|---|---|\n'
for mode in conversation per-turn; do
    "$KILN" --quiet prepare --model "$WORK/model" --data "$DATA" --out "$WORK/kiln-$mode" --mode "$mode" \
        --thinking keep --seq-len 65536 --layout bucketed --date 2026-01-01 2>/dev/null
    python3 - "$WORK/kiln-$mode/stats.json" "$mode" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
w = s["wall_seconds"]
print(f"| kiln | {sys.argv[2]} | {s['conversations']} | {s['samples']} | {s['tokens']} | {s['conversations']/w:.1f} | {s['tokens']/w:,.0f} | {(s['peak_rss_bytes'] or 0)/2**20:.0f} | {w:.2f} |")
PY
    "$VENV/bin/python" tests/bench/prepare_python.py --data "$DATA" --template "$TEMPLATE" --tokenizer "$TOKENIZER" --mode "$mode" 2>/dev/null \
        | python3 -c "
import json, sys
s = json.loads(sys.stdin.read())
print(f\"| transformers | {s['mode']} | {s['conversations']} | {s['samples']} | {s['tokens']} | {s['conversations_per_s']:.1f} | {s['tokens_per_s']:,.0f} | {s['peak_rss_bytes']/2**20:.0f} | {s['wall_seconds']:.2f} |\")"
done
