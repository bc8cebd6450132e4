#!/usr/bin/env bash
# Function-calling data through kiln ingest + prepare, beside transformers' apply_chat_template on the same
# conversations: OpenAI-format rows (calls with JSON-string arguments, a tools column of bare schemas) made
# here with a fixed seed, TRL's Qwen3.5 training template (it has {% generation %}), the Qwen3.5-derived
# tokenizer, one sample per assistant turn. Samples, tokens and supervised tokens must agree; kiln's time
# includes its check that every supervised turn's calls are rendered (one more render per turn with calls).
set -euo pipefail
cd "$(dirname "$0")/../.."
KILN=${KILN:-target/release/kiln}
SHARED=../shared
ROWS=${ROWS:-2000}
WORK=runs/bench-function-calls
source tests/bench/qwen_model.sh
python3 - "$ROWS" "$WORK/calls.jsonl" <<'PY'
import json, random, sys
rows, out = int(sys.argv[1]), sys.argv[2]
rng = random.Random(7)
TOOLS = {
    "get_weather": ({"city": "string", "days": "integer"}, lambda: {"city": rng.choice(["Oslo", "Quito", "Lagos", "Hanoi"]), "days": rng.randint(1, 7)}),
    "run_shell": ({"cmd": "string"}, lambda: {"cmd": rng.choice(["ls -la", "df -h", "grep -rn TODO src", "git status"])}),
    "search_files": ({"pattern": "string", "path": "string"}, lambda: {"pattern": rng.choice(["*.rs", "*.py", "Makefile"]), "path": rng.choice([".", "src", "/etc"])}),
    "read_file": ({"path": "string", "max_lines": "integer"}, lambda: {"path": rng.choice(["README.md", "setup.cfg", "/etc/hosts"]), "max_lines": rng.randint(10, 200)}),
}
def schema(name):
    props, _ = TOOLS[name]
    return {"name": name, "description": f"{name.replace('_', ' ')}.", "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": list(props)}}
with open(out, "w") as f:
    for i in range(rows):
        offered = rng.sample(sorted(TOOLS), rng.randint(2, 4))
        msgs = [{"role": "system", "content": "You are a careful assistant with tools."}, {"role": "user", "content": f"Task {i}: " + " ".join(rng.choice(["check", "the", "files", "weather", "disk", "and", "report"]) for _ in range(rng.randint(6, 30)))}]
        for r in range(rng.randint(1, 3)):
            calls = []
            for k in range(rng.randint(1, 2)):
                name = rng.choice(offered)
                calls.append({"id": f"call_{i}_{r}_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(TOOLS[name][1]())}})
            msgs.append({"role": "assistant", "content": rng.choice([None, "Let me look."]), "tool_calls": calls})
            for c in calls:
                msgs.append({"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": json.dumps({"ok": True, "lines": rng.randint(1, 99)})})
        msgs.append({"role": "assistant", "content": "Done: " + " ".join(rng.choice(["all", "good", "disk", "is", "full", "sunny"]) for _ in range(rng.randint(5, 40)))})
        f.write(json.dumps({"id": f"fc{i}", "tools": json.dumps([schema(n) for n in offered]), "messages": msgs}) + "\n")
PY
printf 'name = "calls"\n[[source]]\nname = "calls"\nformat = "jsonl"\npath = "calls.jsonl"\n[source.schema]\nmessages = "messages"\nid = "id"\ntools = "tools"\n' > "$WORK/calls.toml"
/usr/bin/time -f '%e %M' -o "$WORK/ingest.time" "$KILN" --quiet ingest --dataset "$WORK/calls.toml" --out "$WORK/data"
read -r ingest_s ingest_kb < "$WORK/ingest.time"
echo "ingest: $ROWS rows in ${ingest_s} s, peak RSS $((ingest_kb / 1024)) MiB"
DATA=$WORK/data/conversations.jsonl
printf '| engine | conversations | samples | tokens | supervised | conv/s | tokens/s | peak RSS MiB | wall s |\n|---|---|---|---|---|---|---|---|---|\n'
"$KILN" --quiet prepare --model "$WORK/model" --data "$DATA" --out "$WORK/kiln" --mode per-turn \
    --thinking keep --seq-len 65536 --layout bucketed --validation-share 0 --date 2026-01-01 2>/dev/null
python3 - "$WORK/kiln/stats.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
w = s["wall_seconds"]
assert not s["dropped"], s["dropped"]
print(f"| kiln | {s['conversations']} | {s['samples']} | {s['tokens']} | {s['supervised_tokens']} | {s['conversations']/w:.1f} | {s['tokens']/w:,.0f} | {(s['peak_rss_bytes'] or 0)/2**20:.0f} | {w:.2f} |")
PY
"$VENV/bin/python" tests/bench/prepare_python.py --data "$DATA" --template "$TEMPLATE" --tokenizer "$TOKENIZER" --mode per-turn 2>/dev/null \
    | python3 -c "
import json, sys
s = json.loads(sys.stdin.read())
print(f\"| transformers | {s['conversations']} | {s['samples']} | {s['tokens']} | {s['supervised_tokens']} | {s['conversations_per_s']:.1f} | {s['tokens_per_s']:,.0f} | {s['peak_rss_bytes']/2**20:.0f} | {s['wall_seconds']:.2f} |\")"
