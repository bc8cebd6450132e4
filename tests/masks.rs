//! Mask invariants on every sample of the fixture conversations, for the real templates and every sample
//! mode and thinking policy: something is supervised, every supervised turn ends with the end-of-turn
//! token, no user or tool text is supervised, and history thinking is gone where the policy strips it.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use kiln::chat::{
    ChatInput, ChatTemplate, PinnedClock, PromptRule, SampleMode, SamplePolicy, SpecialTokens, TemplateSource,
    Thinking, ToolResults, build_samples,
};
use kiln::tokens::{TextTokenizer, tokenize_sample};
use serde_json::{Value, json};

fn fixture_conversations() -> Vec<(ChatInput, serde_json::Map<String, Value>)> {
    let path = common::project_dir().join("tests/fixtures/templates/conversations.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let input = ChatInput {
                id: c["name"].as_str().unwrap().to_string(),
                messages: c["messages"].as_array().unwrap().clone(),
                tools: Some(c["tools"].clone()).filter(|t| !t.is_null()),
                source: None,
                meta: Default::default(),
            };
            (input, c["kwargs"].as_object().unwrap().clone())
        })
        .collect()
}

/// (template file, tokenizer folder or None, special tokens)
fn setups() -> Vec<(&'static str, Option<PathBuf>, BTreeMap<String, String>)> {
    let lfm: BTreeMap<String, String> =
        [("bos_token", "<|startoftext|>"), ("eos_token", "<|im_end|>"), ("pad_token", "<|pad|>")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    let qwen: BTreeMap<String, String> =
        [("eos_token", "<|im_end|>")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let tiny = common::project_dir().join("configs/models/tiny");
    let qwen_tok = common::project_dir().join("../shared/tokenizers/qwen3.5-derived");
    vec![
        ("lfm2.5.jinja", Some(tiny.clone()), lfm.clone()),
        ("lfm2.jinja", Some(tiny.clone()), lfm.clone()),
        ("lfm2_training.trl.jinja", Some(tiny.clone()), lfm.clone()),
        ("lfm2.5_vl_450m_older.jinja", Some(tiny), lfm),
        ("qwen3_5.jinja", Some(qwen_tok.clone()), qwen.clone()),
        ("qwen3_5_small_nothink.jinja", Some(qwen_tok.clone()), qwen.clone()),
        ("qwen3_5_think_training.trl.jinja", Some(qwen_tok), qwen),
    ]
}

/// Special tokens from (name, token) pairs.
fn special(pairs: &[(&str, &str)]) -> SpecialTokens {
    SpecialTokens(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
}

/// A template from ../shared/templates, rendering at the tests' pinned date.
fn shared_template(file: &str, special: SpecialTokens) -> ChatTemplate {
    let source = TemplateSource::from_file(&common::project_dir().join("../shared/templates").join(file)).unwrap();
    ChatTemplate::new(source, special, PinnedClock::parse("2026-01-01").unwrap()).unwrap()
}

fn content_of(m: &Value) -> String {
    match &m["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
        _ => String::new(),
    }
}

/// Text that is reasoning in a history turn: think blocks in content and separate reasoning fields.
fn reasoning_of(m: &Value) -> Vec<String> {
    let mut out: Vec<String> = ["reasoning_content", "reasoning", "thinking"]
        .iter()
        .filter_map(|k| m[*k].as_str().map(str::to_string))
        .collect();
    let c = content_of(m);
    if let (Some(s), Some(e)) = (c.find("<think>"), c.find("</think>")) {
        out.push(c[s + 7..e].trim().to_string());
    }
    out.retain(|r| r.len() >= 2);
    out
}

#[test]
fn every_sample_satisfies_the_mask_invariants() {
    let clock = PinnedClock::parse("2026-01-01").unwrap();
    let convs = fixture_conversations();
    let mut samples_checked = 0;
    for (file, tok_dir, special) in setups() {
        let source = TemplateSource::from_file(&common::project_dir().join("../shared/templates").join(file)).unwrap();
        let template = ChatTemplate::new(source, SpecialTokens(special.clone()), clock).unwrap();
        let tok = tok_dir.map(|d| TextTokenizer::load(&d, &SpecialTokens(special.clone()), None).unwrap());
        for mode in [SampleMode::Auto, SampleMode::PerTurn, SampleMode::Conversation] {
            for thinking in [Thinking::StripHistory, Thinking::Keep, Thinking::Drop] {
                for (input, kwargs) in &convs {
                    let policy = SamplePolicy { mode, thinking, kwargs: kwargs.clone(), ..Default::default() };
                    let at = format!("{file} {mode:?} {thinking:?} {}", input.id);
                    let samples = match build_samples(&template, input, &policy) {
                        Ok(s) => s,
                        // Conversations a template rejects (raise_exception) or without an assistant turn.
                        Err(e) => {
                            let text = e.to_string();
                            assert!(
                                text.contains("raised")
                                    || text.contains("no assistant turn")
                                    || text.contains("inference never prompts")
                                    // LFM2's template reads calls from the content, not `tool_calls`.
                                    || (file.starts_with("lfm2") && text.contains("renders none of the turn's")),
                                "{at}: {text}"
                            );
                            continue;
                        }
                    };
                    for s in &samples {
                        samples_checked += 1;
                        assert!(!s.targets.is_empty(), "{at}: no target");
                        for m in input.messages.iter().filter(|m| matches!(m["role"].as_str(), Some("user" | "tool"))) {
                            let c = content_of(m);
                            if c.trim().len() < 8 {
                                continue;
                            }
                            for (pos, _) in s.text.match_indices(c.trim()) {
                                let hit = pos..pos + c.trim().len();
                                assert!(
                                    !s.targets.iter().any(|t| t.start < hit.end && hit.start < t.end),
                                    "{at}: user/tool text {:?} is supervised",
                                    c
                                );
                            }
                        }
                        if mode == SampleMode::PerTurn && thinking != Thinking::Keep {
                            let target = s.turns[0];
                            let history = &s.text[..s.targets[0].start];
                            for m in input.messages[..target].iter().filter(|m| m["role"] == "assistant") {
                                for r in reasoning_of(m) {
                                    assert!(!history.contains(&r), "{at}: history thinking {r:?} survived stripping");
                                }
                            }
                        }
                        if let Some(tok) = &tok {
                            let t = tokenize_sample(tok, s).unwrap_or_else(|e| panic!("{at}: {e}"));
                            assert!(t.supervised() > 0);
                            let last = t.loss_mask.iter().rposition(|&m| m == 1).unwrap();
                            let tail = tok.decode(&t.input_ids[last..=last]);
                            assert!(
                                t.input_ids[last] == tok.end_of_turn_id || tail.trim().is_empty(),
                                "{at}: ends with {tail:?}"
                            );
                        }
                    }
                }
            }
        }
    }
    assert!(samples_checked > 1000, "{samples_checked}");
}

#[test]
fn auto_mode_trains_each_turn_as_inference_renders_it() {
    // LFM2.5 drops history reasoning: per-turn samples. Without reasoning every turn renders the same in
    // the whole conversation: one sample supervising all turns.
    let clock = PinnedClock::parse("2026-01-01").unwrap();
    let special: BTreeMap<String, String> =
        [("bos_token".to_string(), "<|startoftext|>".to_string())].into_iter().collect();
    let source = TemplateSource::from_file(&common::project_dir().join("../shared/templates/lfm2.5.jinja")).unwrap();
    let template = ChatTemplate::new(source, SpecialTokens(special), clock).unwrap();
    let convs = fixture_conversations();
    let get = |name: &str| convs.iter().find(|(c, _)| c.id == name).unwrap().0.clone();
    let policy = SamplePolicy::default();
    let thinking = build_samples(&template, &get("reasoning_content"), &policy).unwrap();
    assert_eq!(thinking.len(), 2, "one sample per turn");
    assert!(thinking[1].text.contains("<think>Explain.</think>It is prime."));
    assert!(!thinking[1].text.contains("Lucky."), "history reasoning is stripped");
    let plain = build_samples(&template, &get("multi"), &policy).unwrap();
    assert_eq!(plain.len(), 1);
    assert_eq!(plain[0].targets.len(), 3);
    // Forced conversation mode on reasoning data trains turns unlike inference, and says so.
    let forced = SamplePolicy { mode: SampleMode::Conversation, ..SamplePolicy::default() };
    let merged = build_samples(&template, &get("reasoning_content"), &forced).unwrap();
    assert_eq!(merged.len(), 1);
    assert_eq!(merged[0].turns_unlike_inference, 1);
}

#[test]
fn a_raising_template_names_the_conversation_and_message() {
    let clock = PinnedClock::parse("2026-01-01").unwrap();
    let source = TemplateSource::new(
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}{{ m.content }}{% endfor %}".into(),
        "inline".into(),
    );
    let template = ChatTemplate::new(source, SpecialTokens::default(), clock).unwrap();
    let input = ChatInput {
        id: "conv-7".into(),
        messages: serde_json::from_str(r#"[{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"system","content":"late"},{"role":"assistant","content":"c"}]"#).unwrap(),
        tools: None,
        source: None,
        meta: Default::default(),
    };
    let err = build_samples(&template, &input, &SamplePolicy { mode: SampleMode::Conversation, ..Default::default() })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("conversation 'conv-7', message 2") && err.contains("System message must be at the beginning"),
        "{err}"
    );
}

#[test]
fn function_calls_from_the_data_are_supervised_in_each_templates_own_format() {
    // An OpenAI-format row (arguments as a JSON string, a bare tool schema) as ingest normalizes it.
    let mapping =
        kiln::data::SchemaMapping { messages: "messages".into(), tools: Some("tools".into()), ..Default::default() };
    let row = serde_json::json!({
        "tools": "[{\"name\": \"get_weather\", \"description\": \"Weather for a city.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}]",
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": "{\"temp\": -3}"},
            {"role": "assistant", "content": "It is -3 degrees in Oslo."}]
    });
    let conv = mapping.normalize(&row, "calls", "calls:0").unwrap();
    let input = ChatInput::from(&conv);
    let clock = PinnedClock::parse("2026-01-01").unwrap();
    let lfm = special(&[("bos_token", "<|startoftext|>"), ("eos_token", "<|im_end|>")]);
    let shared = common::project_dir().join("../shared/templates");
    let cases = [
        (
            shared.join("lfm2.5.jinja"),
            lfm.clone(),
            "<|tool_call_start|>[get_weather(city='Oslo')]<|tool_call_end|>",
            "List of tools: [{\"type\": \"function\"",
        ),
        (
            shared.join("qwen3_5.jinja"),
            special(&[("eos_token", "<|im_end|>")]),
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
            "<tools>\n{\"type\": \"function\"",
        ),
        (
            shared.join("gemma4_v4.trl_vendored.jinja"),
            special(&[("bos_token", "<bos>")]),
            "<|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>}<tool_call|>",
            "<|tool>declaration:get_weather{",
        ),
        (
            common::project_dir().join("configs/models/tiny/chat_template.jinja"),
            lfm.clone(),
            "<|tool_call_start|>[get_weather(city=\"Oslo\")]<|tool_call_end|>",
            "List of tools: <|tool_list_start|>[{\"type\": \"function\"",
        ),
    ];
    for (path, special, call, tool_list) in cases {
        let template = ChatTemplate::new(TemplateSource::from_file(&path).unwrap(), special, clock).unwrap();
        let at = path.display();
        let samples =
            build_samples(&template, &input, &SamplePolicy { mode: SampleMode::PerTurn, ..Default::default() })
                .unwrap_or_else(|e| panic!("{at}: {e}"));
        let first = &samples[0];
        let target = &first.text[first.targets[0].clone()];
        assert!(target.contains(call), "{at}: the call is not supervised in its native form: {target:?}");
        let prompt = &first.text[..first.targets[0].start];
        assert!(prompt.contains(tool_list), "{at}: the tools are not in the prompt: {prompt:?}");
        // The tool's answer is history in the second turn's sample, never supervised.
        let second = &samples[1];
        let answer = second.text.find("-3}").unwrap();
        assert!(second.targets.iter().all(|t| !t.contains(&answer)), "{at}");
    }
    // LFM2's template ignores `tool_calls`: the turn is refused, not trained as an empty answer.
    let lfm2 = shared_template("lfm2.jinja", lfm);
    let err = build_samples(&lfm2, &input, &SamplePolicy::default()).unwrap_err();
    assert_eq!(err.drop_reason(), "tool_calls_unrendered");
    assert!(
        err.to_string()
            .contains("conversation 'calls:0', message 1: the template renders none of the turn's 1 tool call(s)"),
        "{err}"
    );
}

#[test]
fn results_of_calls_written_in_the_text_reach_the_model_or_the_turn_is_refused() {
    // ToolBench's ReAct form: the call is text, its result a `tool` message.
    let messages: Vec<Value> = serde_json::from_str(
        r#"[{"role": "system", "content": "Reply as Thought / Action / Action Input."},
            {"role": "user", "content": "Weather in Quito?"},
            {"role": "assistant", "content": "Thought: look it up.\nAction: get_weather\nAction Input: {\"city\": \"Quito\"}"},
            {"role": "tool", "content": "{\"temperature_c\": 28}"},
            {"role": "assistant", "content": "Thought: done.\nAction: Finish\nAction Input: {\"final_answer\": \"28 C\"}"}]"#,
    )
    .unwrap();
    let input = ChatInput { id: "react".into(), messages, tools: None, source: None, meta: Default::default() };
    let clock = PinnedClock::parse("2026-01-01").unwrap();
    let per_turn = SamplePolicy { mode: SampleMode::PerTurn, ..Default::default() };
    let as_user = SamplePolicy { tool_results: ToolResults::User, ..per_turn.clone() };

    // Gemma 4 renders tool messages only after structured calls: the result is gone from the render, and the
    // turn after it is refused, saying what to set.
    let gemma = shared_template("gemma4_v4.trl_vendored.jinja", special(&[("bos_token", "<bos>")]));
    let err = build_samples(&gemma, &input, &SamplePolicy::default()).unwrap_err();
    assert_eq!(err.drop_reason(), "tool_results_unrendered");
    let text = err.to_string();
    assert!(
        text.contains("conversation 'react', message 4: the template leaves out the tool result in message 3")
            && text.contains("`tool_results = \"user\"`"),
        "{text}"
    );
    // As a user message the result is the prompt of the next turn, as an agent loop on Gemma sends it.
    let samples = build_samples(&gemma, &input, &as_user).unwrap();
    assert_eq!(samples.len(), 2);
    let second = &samples[1];
    let prompt = &second.text[..second.targets[0].start];
    assert!(prompt.ends_with("<|turn>user\n{\"temperature_c\": 28}<turn|>\n<|turn>model\n"), "{prompt:?}");
    assert!(second.text[second.targets[0].clone()].starts_with("Thought: done."));

    // Templates that render the tool message keep it as it is; the policy changes nothing where the calls are
    // structured (Gemma 4 renders those results itself).
    for (file, special) in [
        ("lfm2.5.jinja", special(&[("bos_token", "<|startoftext|>"), ("eos_token", "<|im_end|>")])),
        ("qwen3_5_small_nothink.jinja", special(&[("eos_token", "<|im_end|>")])),
    ] {
        let samples =
            build_samples(&shared_template(file, special), &input, &per_turn).unwrap_or_else(|e| panic!("{file}: {e}"));
        let second = samples.last().unwrap();
        assert!(second.text[..second.targets[0].start].contains("{\"temperature_c\": 28}"), "{file}");
    }
    let mut structured = input.clone();
    structured.messages[2] = json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Quito"}}}]});
    structured.messages[3]["tool_call_id"] = json!("c1");
    let native = build_samples(&gemma, &structured, &per_turn).unwrap();
    assert_eq!(native, build_samples(&gemma, &structured, &as_user).unwrap());
    assert!(native[1].text.contains("<|tool_response>response:get_weather{"), "{}", native[1].text);

    // A template that escapes the result (not verbatim in the render) still renders it: the probe tells.
    let escaping = ChatTemplate::new(
        TemplateSource::new(
            "{% for m in messages %}{{ m.role }}: {{ m.content | tojson }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}".into(),
            "inline".into(),
        ),
        SpecialTokens::default(),
        clock,
    )
    .unwrap();
    let samples = build_samples(&escaping, &input, &per_turn).unwrap();
    assert!(samples.last().unwrap().text.contains(r#"tool: "{\"temperature_c\": 28}""#));
}

#[test]
fn a_generation_prompt_that_adds_to_the_turn_s_render_is_spliced_only_when_asked() {
    let messages: Vec<Value> = serde_json::from_str(
        r#"[{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "<think>ls will do.</think>Run `ls`."},
            {"role": "user", "content": "And the hidden ones?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "shell", "arguments": {"cmd": "ls -a"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": ".env"},
            {"role": "assistant", "content": "Run `ls -a`: `.env`."}]"#,
    )
    .unwrap();
    let input = ChatInput { id: "older".into(), messages, tools: None, source: None, meta: Default::default() };
    let clock = PinnedClock::parse("2026-01-01").unwrap();
    let load = |file: &str| shared_template(file, special(&[("bos_token", "<bos>")]));
    let prefix = SamplePolicy { mode: SampleMode::PerTurn, thinking: Thinking::Drop, ..Default::default() };
    let splice = SamplePolicy { prompt_rule: PromptRule::Splice, ..prefix.clone() };
    let targets = |samples: &[kiln::chat::TextSample]| -> Vec<String> {
        samples.iter().flat_map(|s| s.targets.iter().map(|t| s.text[t.clone()].to_string())).collect()
    };
    // The newest revision prompts what each turn's render extends: splicing changes nothing.
    let newest = load("gemma4_v4.trl_vendored.jinja");
    let expected = build_samples(&newest, &input, &prefix).unwrap();
    assert_eq!(build_samples(&newest, &input, &splice).unwrap(), expected);
    assert_eq!(targets(&expected)[0], "Run `ls`.<turn|>\n");

    // The older ones close an empty thought channel in the prompt and strip channels from the render.
    for file in ["gemma4.jinja", "google-gemma-4-31B-it.jinja"] {
        let older = load(file);
        let err = build_samples(&older, &input, &prefix).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("message 2: the generation prompt ends \"<|channel>thought\\n<channel|>\"")
                && text.contains("`prompt_rule = \"splice\"`"),
            "{file}: {text}"
        );
        let samples = build_samples(&older, &input, &splice).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(samples.len(), 3, "{file}");
        // The answers are trained as with the newest revision, each after the prompt inference writes; the
        // revisions end a call's turn each their own way.
        let (trained, newest) = (targets(&samples), targets(&expected));
        assert_eq!([&trained[0], &trained[2]], [&newest[0], &newest[2]], "{file}");
        assert!(trained[1].starts_with("<|tool_call>call:shell{cmd:<|\"|>ls -a<|\"|>}<tool_call|>"), "{file}");
        let mut dropped = input.messages.clone();
        dropped[2]["content"] = json!("Run `ls`.");
        for sample in &samples {
            let prompt = older.render(&dropped[..sample.turns[0]], None, true, &splice.kwargs).unwrap();
            assert_eq!(sample.text[..sample.targets[0].start], prompt.text, "{file}");
        }
        assert!(samples[0].text.ends_with("<|turn>model\n<|channel>thought\n<channel|>Run `ls`.<turn|>\n"));
    }

    // A prompt that opens the turn unlike its render (another role header) is refused under either rule.
    let unlike = ChatTemplate::new(
        TemplateSource::new(
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}bot: {% endif %}".into(),
            "inline".into(),
        ),
        SpecialTokens::default(),
        clock,
    )
    .unwrap();
    let err = build_samples(&unlike, &input, &splice).unwrap_err();
    assert!(err.to_string().contains("the generation prompt ends \"bot: \""), "{err}");
    assert!(!err.to_string().contains("prompt_rule"), "splice is already set: {err}");
}

#[test]
fn a_template_that_renders_only_some_calls_of_a_turn_is_refused() {
    let clock = PinnedClock::parse("2026-01-01").unwrap();
    let call =
        |id: &str, name: &str| json!({"id": id, "type": "function", "function": {"name": name, "arguments": {}}});
    let messages = vec![
        json!({"role": "user", "content": "weather and time in Oslo?"}),
        json!({"role": "assistant", "content": "", "tool_calls": [call("a", "get_weather"), call("b", "get_time")]}),
    ];
    let input = ChatInput { id: "two".into(), messages, tools: None, source: None, meta: Default::default() };
    let template = |calls: &str| {
        let text = format!(
            "{{% for m in messages %}}{{% if m.role == 'assistant' %}}A: {{% generation %}}{{{{ m.content }}}}{calls}<end>{{% endgeneration %}}{{% else %}}U: {{{{ m.content }}}}\n{{% endif %}}{{% endfor %}}{{% if add_generation_prompt %}}A: {{% endif %}}"
        );
        ChatTemplate::new(TemplateSource::new(text, "inline".into()), SpecialTokens::default(), clock).unwrap()
    };
    let every = template("{% for c in m.tool_calls %}[{{ c.function.name }}]{% endfor %}");
    let samples = build_samples(&every, &input, &SamplePolicy::default()).unwrap();
    let first = &samples[0];
    assert_eq!(&first.text[first.targets[0].clone()], "[get_weather][get_time]<end>");
    // Only the first call, only the last: the turn would train without the other; both are refused, naming it.
    for (calls, missing) in [
        (
            "{% if m.tool_calls %}[{{ m.tool_calls[0].function.name }}]{% endif %}",
            "does not render call 1 (`get_time`)",
        ),
        (
            "{% if m.tool_calls %}[{{ m.tool_calls[-1].function.name }}]{% endif %}",
            "does not render call 0 (`get_weather`)",
        ),
    ] {
        let err = build_samples(&template(calls), &input, &SamplePolicy::default()).unwrap_err();
        assert_eq!(err.drop_reason(), "tool_calls_unrendered");
        let text = err.to_string();
        assert!(
            text.contains(&format!(
                "conversation 'two', message 1: the template {missing} of the turn's 2 tool call(s)"
            )),
            "{text}"
        );
        assert!(text.contains("without all its calls"), "{text}");
    }
    let none = build_samples(&template(""), &input, &SamplePolicy::default()).unwrap_err();
    assert!(none.to_string().contains("renders none of the turn's 2 tool call(s)"), "{none}");
}

#[test]
fn turns_marked_untrained_are_history_in_every_mode() {
    let clock = PinnedClock::parse("2026-01-01").unwrap();
    let messages: Vec<Value> = serde_json::from_str(
        r#"[{"role": "user", "content": "list files"}, {"role": "assistant", "content": "rm -rf /", "train": false},
            {"role": "user", "content": "that was wrong"}, {"role": "assistant", "content": "ls -la"},
            {"role": "user", "content": "and now?"}, {"role": "assistant", "content": "done"}]"#,
    )
    .unwrap();
    let input = ChatInput { id: "c".into(), messages, tools: None, source: None, meta: Default::default() };
    let lfm: BTreeMap<String, String> =
        [("bos_token".to_string(), "<|startoftext|>".to_string())].into_iter().collect();
    let shared = common::project_dir().join("../shared/templates");
    // A template that prints every message key shows the flag never reaches the template.
    let keys = TemplateSource::new(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m | tojson }}\n{% endgeneration %}{% else %}{{ m | tojson }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}".into(),
        "inline".into(),
    );
    let templates = [
        ("lfm2.5 (generation tags)", TemplateSource::from_file(&shared.join("lfm2.5.jinja")).unwrap()),
        ("qwen3.5 (prefix rule)", TemplateSource::from_file(&shared.join("qwen3_5_small_nothink.jinja")).unwrap()),
        ("keys", keys),
    ];
    for (name, source) in templates {
        let template = ChatTemplate::new(source, SpecialTokens(lfm.clone()), clock).unwrap();
        for mode in [SampleMode::Auto, SampleMode::PerTurn, SampleMode::Conversation] {
            let at = format!("{name} {mode:?}");
            let samples = build_samples(&template, &input, &SamplePolicy { mode, ..Default::default() })
                .unwrap_or_else(|e| panic!("{at}: {e}"));
            let turns: Vec<usize> = samples.iter().flat_map(|s| s.turns.clone()).collect();
            assert_eq!(turns, [3, 5], "{at}");
            for s in &samples {
                assert!(!s.text.contains("\"train\""), "{at}: the flag reached the template");
                let supervised: String = s.targets.iter().map(|t| &s.text[t.clone()]).collect();
                assert!(!supervised.contains("rm -rf"), "{at}: the untrained turn is supervised");
                assert!(s.text.contains("rm -rf /"), "{at}: the untrained turn is not in the history");
            }
            let supervised: String =
                samples.iter().flat_map(|s| s.targets.iter().map(|t| s.text[t.clone()].to_string())).collect();
            assert!(supervised.contains("done"), "{at}");
            // Forced conversation mode cannot place a turn the whole conversation renders unlike its own
            // inference form (Qwen3.5 drops history's empty think block); it counts it instead.
            let unlike: usize = samples.iter().map(|s| s.turns_unlike_inference).sum();
            assert!(supervised.contains("ls -la") || (mode == SampleMode::Conversation && unlike > 0), "{at}");
        }
    }
    let none: Vec<Value> = input
        .messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if m["role"] == "assistant" {
                m["train"] = Value::Bool(false);
            }
            m
        })
        .collect();
    let source = TemplateSource::from_file(&shared.join("lfm2.5.jinja")).unwrap();
    let template = ChatTemplate::new(source, SpecialTokens(lfm), clock).unwrap();
    let err = build_samples(&template, &ChatInput { messages: none, ..input }, &SamplePolicy::default()).unwrap_err();
    assert!(err.to_string().contains("every assistant turn is marked not to be trained on"), "{err}");
}
