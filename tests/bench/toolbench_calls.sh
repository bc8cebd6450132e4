#!/usr/bin/env bash
# ToolBench-form conversations (the OpenBMB release's shape: a system prompt printing its APIs as a Python list,
# ReAct `Action:` / `Action Input:` turns, function results, a Finish call) made here with a fixed seed and
# flaws planted at known rates: an Action Input written as a Python dict (not JSON), a function the prompt does
# not list, a required argument left out, an argument the schema does not declare. The inspection report
# must find exactly the planted ones; the table also gives inspect's wall time (and, with KILN_BEFORE set to
# an older binary, that binary's on the same run).
set -euo pipefail
cd "$(dirname "$0")/../.."
KILN=${KILN:-target/release/kiln}
SHARED=../shared
ROWS=${ROWS:-5000}
WORK=runs/bench-toolbench-calls
source tests/bench/qwen_model.sh
python3 - "$ROWS" "$WORK/toolbench.json" "$WORK/planted.json" <<'PY'
import json, random, sys
rows, out, planted_out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rng = random.Random(11)
WORDS = "city author ticker query date limit page lang country genre year team league symbol currency".split()
def api(i):
    params = rng.sample(WORDS, rng.randint(1, 4))
    required = params[: rng.randint(1, len(params))]
    tool = rng.choice(["books", "weather", "sports", "finance", "movies", "music"])
    return {
        "name": f"get_{params[0]}_{i}_for_{tool}",
        "description": f'This is the subfunction for tool "{tool}", you can use this tool.The description of this function is: "It\'s the {params[0]} lookup of {tool} number {i}."',
        "parameters": {"type": "object",
                       "properties": {p: {"type": "string", "description": f"The {p}.", "example_value": p.upper()} for p in params},
                       "required": required, "optional": [p for p in params if p not in required]},
    }
FINISH = {"name": "Finish", "description": "If you believe that you have obtained a result that can answer the task, please call this function to provide the final answer.",
          "parameters": {"type": "object", "properties": {"return_type": {"type": "string", "enum": ["give_answer", "give_up_and_restart"]},
                                                          "final_answer": {"type": "string", "description": "The final answer you want to give the user."}},
                         "required": ["return_type"]}}
planted = {"calls": 0, "bad_json": 0, "unoffered": 0, "missing_required": 0, "undeclared": 0, "flawed_conversations": 0}
convs = []
for i in range(rows):
    apis = [api(i * 10 + k) for k in range(rng.randint(2, 6))]
    system = ("You are AutoGPT, you can use many tools(functions) to do the following task.\nAt each step, you need to give your thought to analyze the status now and what to do next, with a function call to actually excute your step.\nYour output should follow this format:\nThought:\nAction:\nAction Input:\n\n"
              "Specifically, you have access to the following APIs: " + str(apis + [FINISH]))
    msgs = [{"from": "system", "value": system}, {"from": "user", "value": f"Task {i}: find what the {apis[0]['name']} API knows.\nBegin!\n"}]
    flawed = False
    for step in range(rng.randint(1, 3)):
        a = rng.choice(apis)
        args = {p: f"{p} {i}" for p in a["parameters"]["required"]}
        name, flaw = a["name"], rng.choices(["", "bad_json", "unoffered", "missing_required", "undeclared"], [88, 3, 3, 3, 3])[0]
        if flaw == "unoffered":
            name += "_v2"
        elif flaw == "missing_required":
            args.pop(a["parameters"]["required"][0])
        elif flaw == "undeclared":
            args["verbose"] = "yes"
        text = str(args) if flaw == "bad_json" else json.dumps(args, indent=2)
        planted["calls"] += 1
        if flaw:
            planted[flaw] += 1
            flawed = True
        msgs.append({"from": "assistant", "value": f"\nThought: I should call {name} for step {step}.\nAction: {name}\nAction Input: {text}"})
        msgs.append({"from": "function", "value": json.dumps({"error": "", "response": f"result {i}.{step}"})})
    planted["calls"] += 1
    msgs.append({"from": "assistant", "value": "\nThought: I have the answer.\nAction: Finish\nAction Input: " + json.dumps({"return_type": "give_answer", "final_answer": f"Answer {i}."}, indent=2)})
    planted["flawed_conversations"] += flawed
    convs.append({"id": f"Step {i}", "conversations": msgs})
json.dump(convs, open(out, "w"))
json.dump(planted, open(planted_out, "w"))
PY
printf 'name = "toolbench-form"\n[[source]]\nname = "toolbench"\nformat = "json"\npath = "toolbench.json"\n[source.schema]\nmessages = "conversations"\nrole = "from"\ncontent = "value"\nid = "id"\n' > "$WORK/toolbench.toml"
"$KILN" --quiet ingest --dataset "$WORK/toolbench.toml" --out "$WORK/run/data" 2>/dev/null
"$KILN" --quiet prepare --model "$WORK/model" --data "$WORK/run/data/conversations.jsonl" --out "$WORK/run/data" \
    --mode per-turn --thinking keep --seq-len 65536 --layout bucketed --validation-share 0 --date 2026-01-01 2>/dev/null
printf '| binary | conversations | calls (planted flaws) | read from text | against the prompt'"'"'s list | off schema | not offered | unreadable | missing required | undeclared | inspect s |\n|---|---|---|---|---|---|---|---|---|---|---|\n'
for bin in ${KILN_BEFORE:+"$KILN_BEFORE"} "$KILN"; do
    /usr/bin/time -f '%e' -o "$WORK/inspect.time" "$bin" --quiet inspect --run "$WORK/run" >/dev/null 2>&1
    python3 - "$WORK" "$bin" <<'PY'
import json, sys
work, binary = sys.argv[1], sys.argv[2]
p = json.load(open(f"{work}/planted.json"))
r = json.load(open(f"{work}/run/report/summary.json"))
secs = open(f"{work}/inspect.time").read().split()[-1]
c = r["tools"].get("checks", {})
flaws = p["bad_json"] + p["unoffered"] + p["missing_required"] + p["undeclared"]
g = lambda k: c.get(k, "–")
print(f"| {binary} | {r['conversations']['total']} | {p['calls']} ({flaws}) | {g('from_text')} | {g('against_prompt_list')} | {g('off_schema')} | {g('unoffered')} | {g('unreadable')} | {g('missing_required')} | {g('undeclared_arguments')} | {secs} |")
if "from_text" in c:
    found = (c["calls"], c["off_schema"], c["unoffered"], c["unreadable"], c["missing_required"], c["undeclared_arguments"])
    want = (p["calls"], flaws, p["unoffered"], p["bad_json"], p["missing_required"], p["undeclared"])
    assert found == want, f"the report found {found}, the generator planted {want}"
PY
done

# The source's `off_schema_calls`: the faulted turns kept as history (each flawed call is a turn of its own,
# and every conversation ends with a sound Finish, so none is left without a trained turn), or the
# conversations with one dropped. Either way the report then finds no trained call off its schema.
printf '\n| off_schema_calls | conversations kept | dropped | turns made history | samples | supervised tokens | calls off schema in the report |\n|---|---|---|---|---|---|---|\n'
for policy in keep history drop; do
    sed "s/^\[source.schema\]/off_schema_calls = \"$policy\"\n[source.schema]/" "$WORK/toolbench.toml" > "$WORK/toolbench-$policy.toml"
    "$KILN" --quiet ingest --dataset "$WORK/toolbench-$policy.toml" --out "$WORK/$policy/data" 2>/dev/null
    "$KILN" --quiet prepare --model "$WORK/model" --data "$WORK/$policy/data/conversations.jsonl" --out "$WORK/$policy/data" \
        --mode per-turn --thinking keep --seq-len 65536 --layout bucketed --validation-share 0 --date 2026-01-01 2>/dev/null
    "$KILN" --quiet inspect --run "$WORK/$policy" >/dev/null 2>&1
    python3 - "$WORK" "$policy" <<'PY'
import json, sys
work, policy = sys.argv[1], sys.argv[2]
p = json.load(open(f"{work}/planted.json"))
src = json.load(open(f"{work}/{policy}/data/ingest.json"))[0]["sources"][0]
s = json.load(open(f"{work}/{policy}/data/stats.json"))
c = json.load(open(f"{work}/{policy}/report/summary.json"))["tools"]["checks"]
untrained, dropped = src.get("turns_off_schema_untrained", 0), src["dropped"].get("calls_off_schema", 0)
print(f"| {policy} | {src['kept']} | {dropped} | {untrained} | {s['samples']} | {s['supervised_tokens']} | {c['off_schema']} |")
flaws = p["bad_json"] + p["unoffered"] + p["missing_required"] + p["undeclared"]
want = {"keep": (0, 0, flaws), "history": (0, flaws, 0), "drop": (p["flawed_conversations"], 0, 0)}[policy]
assert (dropped, untrained, c["off_schema"]) == want, f"{policy}: {(dropped, untrained, c['off_schema'])} != {want}"
PY
done
