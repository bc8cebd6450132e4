#!/usr/bin/env bash
# Function-calling data through kiln ingest + prepare, beside transformers' apply_chat_template on the same
# conversations (then the same rows as parquet structs, below): OpenAI-format rows (calls with JSON-string arguments, a tools column of bare schemas) made
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

# The same rows as the Hub holds them once uploaded through Hugging Face `datasets`: arguments and tool
# schemas as nested dicts in a parquet (Arrow gives each struct the union of every row's keys, so each call
# carries the other tools' argument names as nulls), and that parquet's `to_json` export, read as is and with
# `drop_nulls`. kiln must read the parquet, and the export with `drop_nulls`, as the rows above.
# (-P: the project's own datasets/ folder must not shadow the package.)
"$VENV/bin/python" -P -c "import datasets" 2>/dev/null || "$VENV/bin/pip" install -q datasets==5.2.0
"$VENV/bin/python" -P - "$WORK/calls.jsonl" "$WORK" <<'PY'
import json, sys, datasets
datasets.disable_progress_bars()
rows = []
for line in open(sys.argv[1]):
    r = json.loads(line)
    r["tools"] = json.loads(r["tools"])
    for m in r["messages"]:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    rows.append(r)
datasets.Dataset.from_list(rows).to_parquet(f"{sys.argv[2]}/union.parquet")
datasets.Dataset.from_parquet(f"{sys.argv[2]}/union.parquet").to_json(f"{sys.argv[2]}/union.to_json.jsonl")
PY
printf '\n| source | calls with a null argument | tokens | supervised | calls off their schema | report warnings |\n|---|---|---|---|---|---|\n'
for case in "parquet union.parquet" "jsonl union.to_json.jsonl" "jsonl union.to_json.jsonl drop_nulls"; do
    read -r format file drop <<< "$case"
    name=${file%.*}${drop:+-$drop}
    printf 'name = "%s"\n[[source]]\nname = "calls"\nformat = "%s"\npath = "%s"\n[source.schema]\nmessages = "messages"\nid = "id"\ntools = "tools"\n%s\n' \
        "$name" "$format" "$file" "${drop:+drop_nulls = true}" > "$WORK/$name.toml"
    "$KILN" --quiet ingest --dataset "$WORK/$name.toml" --out "$WORK/$name/data" 2> "$WORK/$name.log"
    "$KILN" --quiet prepare --model "$WORK/model" --data "$WORK/$name/data/conversations.jsonl" --out "$WORK/$name/data" \
        --mode per-turn --thinking keep --seq-len 65536 --layout bucketed --validation-share 0 --date 2026-01-01 2>/dev/null
    "$KILN" --quiet inspect --run "$WORK/$name" >/dev/null 2>> "$WORK/$name.log"
    python3 - "$WORK/$name" "$file${drop:+, drop_nulls}" <<'PY'
import json, sys
run, label = sys.argv[1], sys.argv[2]
s = json.load(open(f"{run}/data/stats.json"))
r = json.load(open(f"{run}/report/summary.json"))
calls = [c for l in open(f"{run}/data/conversations.jsonl") for m in json.loads(l)["messages"] for c in m.get("tool_calls", [])]
nulls = sum(any(v is None for v in c["function"]["arguments"].values()) for c in calls)
c = r["tools"]["checks"]
print(f"| {label} | {nulls} of {len(calls)} | {s['tokens']} | {s['supervised_tokens']} | {c['off_schema']} | {len(r['warnings'])} |")
PY
done
