# Sourced by the prepare benchmarks: the transformers venv ($VENV, made once) and a model folder under $WORK
# with TRL's Qwen3.5 training template (it has {% generation %}) and the Qwen3.5-derived tokenizer; sets
# TEMPLATE and TOKENIZER. Needs WORK and SHARED.
VENV=${BENCH_VENV:-.venv-bench}
rm -rf "$WORK" && mkdir -p "$WORK/model"
if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q transformers==5.23.0 jinja2
fi
TEMPLATE=$SHARED/templates/qwen3_5_think_training.trl.jinja
TOKENIZER=$SHARED/tokenizers/qwen3.5-derived/tokenizer.json
cp "$TEMPLATE" "$WORK/model/chat_template.jinja"
cp "$TOKENIZER" "$WORK/model/tokenizer.json"
echo '{"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}' > "$WORK/model/tokenizer_config.json"
