//! `kiln prepare` on the synthetic samples and on real-format trajectories: shards whose contents equal
//! the stats, masks that supervise assistant tokens only, truncation counted, and a validation split held
//! out by task.

mod common;

use std::path::Path;

use common::{project_dir, run_kiln};
use kiln::tokens::shards::{Row, read_shard};
use serde_json::Value;

fn ingest(recipes: &str, out: &Path) {
    let (ok, _, stderr) =
        run_kiln(&["--quiet", "ingest", "--dataset", recipes, "--out", out.to_str().unwrap()], &[], &project_dir());
    assert!(ok, "{stderr}");
}

fn shard_rows(stats: &Value) -> Vec<Row> {
    stats["shards"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| read_shard(Path::new(p.as_str().unwrap())).unwrap())
        .collect()
}

/// The tiny tokenizer's text of every shard row's tokens (all, or only the supervised ones), concatenated.
fn tiny_text(stats: &Value, supervised_only: bool) -> String {
    let tok = kiln::tokens::TextTokenizer::load(
        &project_dir().join("configs/models/tiny"),
        &kiln::chat::SpecialTokens::default(),
        None,
    )
    .unwrap();
    shard_rows(stats)
        .iter()
        .map(|r| {
            let ids: Vec<u32> = r
                .input_ids
                .iter()
                .zip(&r.loss_mask)
                .filter(|(_, m)| !supervised_only || **m == 1)
                .map(|(i, _)| *i)
                .collect();
            tok.decode(&ids)
        })
        .collect()
}

/// The stats must be what the shards hold.
fn check_stats_against_shards(stats: &Value, seq_len: Option<usize>) {
    let rows = shard_rows(stats);
    assert_eq!(rows.len() as u64, stats["rows"].as_u64().unwrap());
    let tokens: u64 = rows.iter().map(|r| r.used() as u64).sum();
    let supervised: u64 = rows.iter().map(|r| r.loss_mask.iter().map(|&m| m as u64).sum::<u64>()).sum();
    let total: u64 = rows.iter().map(|r| r.input_ids.len() as u64).sum();
    let docs: u64 = rows.iter().map(|r| r.doc_lengths.len() as u64).sum();
    assert_eq!(tokens, stats["tokens"].as_u64().unwrap());
    assert_eq!(supervised, stats["supervised_tokens"].as_u64().unwrap());
    assert_eq!(total - tokens, stats["padding_tokens"].as_u64().unwrap());
    assert_eq!(docs, stats["samples"].as_u64().unwrap());
    for r in &rows {
        if let Some(n) = seq_len {
            assert_eq!(r.input_ids.len(), n);
        }
        assert!(r.loss_mask[r.used()..].iter().all(|&m| m == 0), "padding is never supervised");
        let mut start = 0;
        for &len in &r.doc_lengths {
            let doc = &r.loss_mask[start..start + len as usize];
            assert!(doc.contains(&1), "every document supervises something");
            assert_eq!(doc[0], 0, "a document never starts supervised (the prompt comes first)");
            start += len as usize;
        }
    }
}

#[test]
fn prepares_the_synthetic_samples_into_packed_shards() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    ingest("terminal-synth,toolbench-synth", &data);
    let (ok, _, stderr) = run_kiln(
        &[
            "--quiet",
            "prepare",
            "--model",
            "tiny",
            "--data",
            data.join("conversations.jsonl").to_str().unwrap(),
            "--out",
            data.to_str().unwrap(),
            "--seq-len",
            "2048",
            "--date",
            "2026-01-01",
        ],
        &[],
        &project_dir(),
    );
    assert!(ok, "{stderr}");
    let stats: Value = serde_json::from_str(&std::fs::read_to_string(data.join("stats.json")).unwrap()).unwrap();
    assert_eq!(stats["conversations"], 800);
    assert!(stats["dropped"].as_object().unwrap().is_empty(), "{}", stats["dropped"]);
    // Terminal trajectories keep thinking only in the supervised turn: one sample per assistant turn.
    assert_eq!(stats["per_source"]["terminal"]["samples"].as_u64().unwrap(), 1300);
    assert!(stats["thinking_blocks_stripped"].as_u64().unwrap() > 0);
    assert_eq!(stats["template"]["origin"], "configs/models/tiny/chat_template.jinja");
    assert_eq!(stats["config"]["template_date"], "2026-01-01");
    check_stats_against_shards(&stats, Some(2048));

    // A row too short for any target is refused; a length every sample outgrows says so, with the counts.
    let conversations = data.join("conversations.jsonl");
    let prepare_at = |seq_len: &str| {
        let out = dir.path().join(format!("at-{seq_len}"));
        let args = ["--quiet", "prepare", "--model", "tiny", "--data", conversations.to_str().unwrap()];
        let (ok, _, stderr) = run_kiln(
            &[&args[..], &["--out", out.to_str().unwrap(), "--seq-len", seq_len]].concat(),
            &[],
            &project_dir(),
        );
        assert!(!ok, "prepare at seq_len {seq_len} must fail");
        stderr
    };
    let stderr = prepare_at("1");
    assert!(stderr.contains("seq_len 1: a row needs at least 2 tokens"), "{stderr}");
    let stderr = prepare_at("8");
    assert!(
        stderr.contains("no sample from 800 conversations (dropped: ")
            && stderr.contains("too_long)")
            && stderr.contains("longer than seq_len 8"),
        "{stderr}"
    );
}

/// `kiln prepare` of `conversations` into `out` with extra arguments; its stats.
fn prepare_tiny(conversations: &Path, out: &Path, extra: &[&str]) -> Value {
    let args = ["--quiet", "prepare", "--model", "tiny", "--data", conversations.to_str().unwrap()];
    let out_args = ["--out", out.to_str().unwrap(), "--seq-len", "2048", "--date", "2026-01-01"];
    let (ok, _, stderr) = run_kiln(&[&args[..], &out_args, extra].concat(), &[], &project_dir());
    assert!(ok, "{stderr}");
    serde_json::from_str(&std::fs::read_to_string(out.join("stats.json")).unwrap()).unwrap()
}

/// `--validation-share` holds out whole tasks: the two splits' samples and tokens add up to the unsplit
/// run's, the validation shards hold what its stats count, no task is on both sides, and the split is the
/// same however often it is made; at 0 no split is left behind.
#[test]
fn a_validation_share_holds_out_whole_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    ingest("terminal-synth,toolbench-synth", &data);
    let conversations = data.join("conversations.jsonl");
    let whole = prepare_tiny(&conversations, &dir.path().join("whole"), &[]);
    assert!(whole["validation"].is_null() && !dir.path().join("whole/validation").exists());
    let out = dir.path().join("split");
    let split = prepare_tiny(&conversations, &out, &["--validation-share", "0.1"]);
    let held = &split["validation"];
    let n = |v: &Value, key: &str| v[key].as_u64().unwrap();
    assert!((50..=110).contains(&n(held, "conversations")), "{held}");
    for key in ["samples", "tokens", "supervised_tokens"] {
        assert_eq!(n(&split, key) + n(held, key), n(&whole, key), "{key}");
    }
    check_stats_against_shards(&split, Some(2048));
    check_stats_against_shards(held, Some(2048));
    assert!(held["shards"].as_array().unwrap().iter().all(|p| p.as_str().unwrap().contains("/validation/")));

    let task_of: std::collections::HashMap<String, String> = std::fs::read_to_string(&conversations)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|c| {
            let id = c["id"].as_str().unwrap().to_string();
            (id.clone(), c["meta"]["task"].as_str().map_or(id, str::to_string))
        })
        .collect();
    let tasks = |stats: &Value| -> std::collections::BTreeSet<String> {
        shard_rows(stats)
            .iter()
            .flat_map(|r| r.sample_ids.clone())
            .map(|id| {
                let conversation = id.rsplit_once('@').map_or(id.as_str(), |(c, _)| c);
                task_of[conversation].clone()
            })
            .collect()
    };
    let (trained, held_out) = (tasks(&split), tasks(held));
    assert_eq!(held_out.len() as u64, n(held, "conversations"), "one conversation a task in the synthetic data");
    assert!(trained.is_disjoint(&held_out), "a task on both sides");

    let again = prepare_tiny(&conversations, &out, &["--validation-share", "0.1"]);
    assert_eq!(tasks(&again["validation"]), held_out, "the split moves between runs");
    // A share that leaves nothing to train on says so.
    let one = dir.path().join("one");
    std::fs::write(&one, std::fs::read_to_string(&conversations).unwrap().lines().next().unwrap()).unwrap();
    let args = ["--quiet", "prepare", "--model", "tiny", "--data", one.to_str().unwrap(), "--out"];
    let (ok, _, stderr) = run_kiln(
        &[&args[..], &[out.to_str().unwrap(), "--validation-share", "0.999999"]].concat(),
        &[],
        &project_dir(),
    );
    assert!(!ok && stderr.contains("were all held out for validation"), "{stderr}");
    let none = prepare_tiny(&conversations, &out, &["--validation-share", "0"]);
    assert!(none["validation"].is_null() && !out.join("validation").exists());
    assert_eq!(n(&none, "samples"), n(&whole, "samples"));
}

/// A folder with ../shared's Qwen3.5-derived tokenizer, which has no tokenizer_config.json: the special tokens
/// Qwen's template names, as Qwen's has.
fn qwen_tokenizer_dir(dir: &Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::os::unix::fs::symlink(
        project_dir().join("../shared/tokenizers/qwen3.5-derived/tokenizer.json").canonicalize().unwrap(),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}"#)
        .unwrap();
    dir.to_path_buf()
}

/// A model folder with a real template and tokenizer from ../shared.
fn qwen_model_dir(dir: &Path) -> std::path::PathBuf {
    let model = qwen_tokenizer_dir(&dir.join("qwen3.5"));
    std::fs::copy(project_dir().join("../shared/templates/qwen3_5.jinja"), model.join("chat_template.jinja")).unwrap();
    model
}

#[test]
fn prepares_real_terminal_trajectories_with_a_real_template_and_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    // The first 8 real trajectories, in their Hub schema.
    let text = std::fs::read_to_string(common::shared_tb2lite().join("eval_dataset.jsonl")).unwrap();
    let rows: Vec<&str> = text.lines().take(8).collect();
    let raw = dir.path().join("real.jsonl");
    std::fs::write(&raw, rows.join("\n")).unwrap();
    let recipe = dir.path().join("real.toml");
    std::fs::write(&recipe, "name = \"real\"\n[[source]]\nname = \"terminal\"\nformat = \"jsonl\"\npath = \"real.jsonl\"\n[source.schema]\ntask = \"task\"\nid = \"trial_name\"\n").unwrap();
    let data = dir.path().join("data");
    ingest(recipe.to_str().unwrap(), &data);
    let model = qwen_model_dir(dir.path());
    let run = |extra: &[&str], out: &Path| -> Value {
        let conv = data.join("conversations.jsonl");
        let mut args = vec!["--quiet", "prepare", "--model", model.to_str().unwrap(), "--data", conv.to_str().unwrap()];
        args.extend(["--out", out.to_str().unwrap(), "--date", "2026-01-01"]);
        args.extend_from_slice(extra);
        let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
        assert!(ok, "{stderr}");
        serde_json::from_str(&std::fs::read_to_string(out.join("stats.json")).unwrap()).unwrap()
    };
    let assistant_turns: u64 = rows
        .iter()
        .map(|r| {
            serde_json::from_str::<Value>(r).unwrap()["conversations"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["role"] == "assistant")
                .count() as u64
        })
        .sum();

    let full = run(&["--seq-len", "32768", "--layout", "bucketed"], &dir.path().join("full"));
    assert_eq!(
        full["samples"].as_u64().unwrap(),
        assistant_turns,
        "Qwen3.5 drops history reasoning: one sample per turn"
    );
    assert!(full["dropped"].as_object().unwrap().is_empty(), "{}", full["error_examples"]);
    check_stats_against_shards(&full, None);

    // At 4096 tokens long samples are dropped (counted), or kept with their history cut.
    let dropped = run(&["--seq-len", "4096", "--truncation", "drop"], &dir.path().join("drop"));
    let too_long = dropped["dropped"]["too_long"].as_u64().unwrap();
    assert!(too_long > 0);
    assert_eq!(dropped["samples"].as_u64().unwrap() + too_long, assistant_turns);
    let kept = run(&["--seq-len", "4096", "--truncation", "keep-target"], &dir.path().join("keep"));
    assert!(kept["truncated"].as_u64().unwrap() > 0);
    assert!(kept["samples"].as_u64().unwrap() > dropped["samples"].as_u64().unwrap());
    check_stats_against_shards(&kept, Some(4096));
}

#[test]
fn kiln_render_writes_text_ids_and_masks_and_generation_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(
        &input,
        concat!(
            r#"{"id": "a", "messages": [{"role": "user", "content": "ls?"}, {"role": "assistant", "content": "<think>list</think>ls -la"}]}"#,
            "\n",
            r#"{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}"#,
            "\n"
        ),
    )
    .unwrap();
    let out = dir.path().join("out.jsonl");
    let args = [
        "render",
        "--model",
        "tiny",
        "--input",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--date",
        "2026-01-01",
        "--mode",
        "per-turn",
    ];
    let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
    // The second conversation has no assistant turn: rendering it for training is an error that names it.
    assert!(!ok && stderr.contains("line-2") && stderr.contains("no assistant turn"), "{stderr}");

    let mut prompt_args = args.to_vec();
    prompt_args.push("--generation-prompt");
    let (ok, _, stderr) = run_kiln(&prompt_args, &[], &project_dir());
    assert!(ok, "{stderr}");
    let lines: Vec<Value> =
        std::fs::read_to_string(&out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    assert!(lines[1]["text"].as_str().unwrap().ends_with("<|im_start|>assistant\n"));
    assert!(lines[1]["loss_mask"].as_array().unwrap().iter().all(|m| m == 0));

    std::fs::write(&input, std::fs::read_to_string(&input).unwrap().lines().next().unwrap()).unwrap();
    let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
    assert!(ok, "{stderr}");
    assert!(stderr.contains("supervised"), "the colored view is printed: {stderr}");
    let line: Value = serde_json::from_str(std::fs::read_to_string(&out).unwrap().lines().next().unwrap()).unwrap();
    let text = line["text"].as_str().unwrap();
    assert_eq!(
        text,
        "<|startoftext|><|im_start|>user\nls?<|im_end|>\n<|im_start|>assistant\n<think>list</think>ls -la<|im_end|>\n"
    );
    let ids = line["input_ids"].as_array().unwrap();
    let mask = line["loss_mask"].as_array().unwrap();
    assert_eq!(ids.len(), mask.len());
    assert!(mask.iter().filter(|m| *m == 1).count() > 3);
    assert_eq!(mask.last().unwrap(), 1, "the newline after <|im_end|> is inside the generation block");
}

#[test]
fn the_tiny_tokenizer_is_reproducible_from_the_samples() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    ingest("terminal-synth,toolbench-synth", &data);
    let out = dir.path().join("tok");
    let conv = data.join("conversations.jsonl");
    let (ok, _, stderr) =
        run_kiln(&["tokenizer", "--data", conv.to_str().unwrap(), "--out", out.to_str().unwrap()], &[], &project_dir());
    assert!(ok, "{stderr}");
    // Every offline model shares the tokenizer.
    for model in ["tiny", "tiny-qwen3.5", "tiny-gemma4", "tiny-moe"] {
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            assert_eq!(
                std::fs::read(out.join(file)).unwrap(),
                std::fs::read(project_dir().join("configs/models").join(model).join(file)).unwrap(),
                "configs/models/{model}/{file} is stale: run `make samples`"
            );
        }
    }

    // A vocabulary smaller than the bytes and special tokens, or no text at all, is refused.
    let small = dir.path().join("small");
    let (ok, _, stderr) = run_kiln(
        &["tokenizer", "--data", conv.to_str().unwrap(), "--vocab-size", "100", "--out", small.to_str().unwrap()],
        &[],
        &project_dir(),
    );
    let floor = format!("a vocabulary of 100 is below the {} tokens", kiln::tokens::bpe::MIN_VOCAB);
    assert!(!ok && stderr.contains(&floor), "{stderr}");
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let (ok, _, stderr) = run_kiln(
        &["tokenizer", "--data", empty.to_str().unwrap(), "--out", small.to_str().unwrap()],
        &[],
        &project_dir(),
    );
    assert!(!ok && stderr.contains("no message content to train a tokenizer on in"), "{stderr}");
    assert!(!small.exists());
}

/// OpenAI-format function-calling rows (calls with JSON-string arguments, a tools column) go through ingest
/// and prepare with their calls and tool schemas: the calls are supervised in the template's own format, the
/// schemas are in the prompt, a row with a broken call is counted out, and a template that ignores
/// `tool_calls` drops its turns by name instead of training them as empty answers.
#[test]
fn function_calling_rows_are_trained_with_their_calls() {
    let dir = tempfile::tempdir().unwrap();
    let tools = r#"[{\"name\": \"get_weather\", \"description\": \"Weather for a city.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}]"#;
    let row = |city: &str, args: &str| {
        format!(
            r#"{{"id": "{city}", "tools": "{tools}", "messages": [{{"role": "user", "content": "Weather in {city}?"}}, {{"role": "assistant", "content": null, "tool_calls": [{{"id": "c1", "type": "function", "function": {{"name": "get_weather", "arguments": "{args}"}}}}]}}, {{"role": "tool", "tool_call_id": "c1", "content": "cold"}}, {{"role": "assistant", "content": "It is cold in {city}."}}]}}"#
        )
    };
    let rows = [
        row("Oslo", r#"{\"city\": \"Oslo\"}"#),
        row("Quito", r#"{\"city\": \"Quito\"}"#),
        row("Nowhere", "city=Nowhere"),
    ];
    std::fs::write(dir.path().join("calls.jsonl"), rows.join("\n")).unwrap();
    let recipe = dir.path().join("calls.toml");
    std::fs::write(&recipe, "name = \"calls\"\n[[source]]\nname = \"calls\"\nformat = \"jsonl\"\npath = \"calls.jsonl\"\n[source.schema]\nmessages = \"messages\"\nid = \"id\"\ntools = \"tools\"\n").unwrap();
    let data = dir.path().join("data");
    ingest(recipe.to_str().unwrap(), &data);
    let ingested: Value = serde_json::from_str(&std::fs::read_to_string(data.join("ingest.json")).unwrap()).unwrap();
    assert_eq!(ingested[0]["sources"][0]["dropped"], serde_json::json!({"bad_tool_call": 1}), "{ingested}");
    let first: Value = serde_json::from_str(
        std::fs::read_to_string(data.join("conversations.jsonl")).unwrap().lines().next().unwrap(),
    )
    .unwrap();
    assert_eq!(first["messages"][1]["tool_calls"][0]["function"]["arguments"], serde_json::json!({"city": "Oslo"}));
    assert_eq!(first["tools"][0]["function"]["name"], "get_weather");

    let conversations = data.join("conversations.jsonl");
    let stats = prepare_tiny(&conversations, &dir.path().join("tiny"), &["--validation-share", "0"]);
    assert!(stats["dropped"].as_object().unwrap().is_empty(), "{}", stats["error_examples"]);
    let all = tiny_text(&stats, true);
    for city in ["Oslo", "Quito"] {
        let call = format!("<|tool_call_start|>[get_weather(city=\"{city}\")]<|tool_call_end|>");
        assert!(all.contains(&call), "{call} is not supervised in {all:?}");
        assert!(all.contains(&format!("It is cold in {city}.")));
    }
    let text = tiny_text(&stats, false);
    assert!(text.contains("List of tools: <|tool_list_start|>[{\"type\": \"function\""), "{text}");
    assert!(!all.contains("List of tools") && !all.contains("<|tool_response_start|>"), "prompt text is supervised");

    // LFM2's original template reads calls from the content only: nothing is left to train on, and the error
    // says why.
    let lfm2 = project_dir().join("../shared/templates/lfm2.jinja");
    let out = dir.path().join("lfm2");
    let args = ["--quiet", "prepare", "--model", "tiny", "--data", conversations.to_str().unwrap()];
    let more = ["--out", out.to_str().unwrap(), "--template", lfm2.to_str().unwrap(), "--mode", "per-turn"];
    let (ok, _, stderr) = run_kiln(&[&args[..], &more].concat(), &[], &project_dir());
    assert!(!ok);
    assert!(
        stderr.contains("no sample from 2 conversations (dropped: 2 tool_calls_unrendered)")
            && stderr
                .contains("conversation 'Oslo', message 1: the template renders none of the turn's 1 tool call(s)"),
        "{stderr}"
    );
}

/// The function-calling rows of tests/fixtures/datasets, made by Hugging Face `datasets`. Read from their
/// parquet, the calls are trained as the rows have them and the report finds every call on its schema. Read
/// from `datasets`' JSON export of that parquet (the union's nulls written out, which no reader can tell from
/// the row's own), the report counts the calls passing null for arguments their tool does not declare, and
/// warns.
#[test]
fn the_report_checks_calls_against_their_schemas_and_tells_a_unions_nulls() {
    let fixtures = project_dir().join("tests/fixtures/datasets");
    let dir = tempfile::tempdir().unwrap();
    let mut checked = Vec::new();
    let mut conversations = Vec::new();
    let sources = [
        ("parquet", "function_calls.parquet", ""),
        ("jsonl", "function_calls.to_json.jsonl", ""),
        ("jsonl", "function_calls.to_json.jsonl", "drop_nulls = true\n"),
    ];
    for (i, (format, file, drop_nulls)) in sources.into_iter().enumerate() {
        let recipe = dir.path().join(format!("{i}.toml"));
        let source = fixtures.join(file);
        let schema = format!("[source.schema]\nmessages = \"messages\"\ntools = \"tools\"\n{drop_nulls}");
        let text = format!(
            "name = \"fc\"\n[[source]]\nname = \"fc\"\nformat = \"{format}\"\npath = \"{}\"\n{schema}",
            source.display()
        );
        std::fs::write(&recipe, text).unwrap();
        let run = dir.path().join(i.to_string());
        let data = run.join("data");
        ingest(recipe.to_str().unwrap(), &data);
        let stats = prepare_tiny(&data.join("conversations.jsonl"), &data, &["--validation-share", "0"]);
        let supervised = tiny_text(&stats, true);
        conversations.push(conversation_bodies(&data.join("conversations.jsonl")));
        let (ok, _, stderr) = run_kiln(&["--quiet", "inspect", "--run", run.to_str().unwrap()], &[], &project_dir());
        assert!(ok, "{stderr}");
        let summary: Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("report/summary.json")).unwrap()).unwrap();
        let md = std::fs::read_to_string(run.join("report/summary.md")).unwrap();
        // The page stays well-formed, and shows the checks as a table of their own.
        let html = std::fs::read_to_string(run.join("report/index.html")).unwrap();
        let options = roxmltree::ParsingOptions { allow_dtd: true, ..Default::default() };
        let page = roxmltree::Document::parse_with_options(&html, options).unwrap();
        let cells: Vec<&str> = page.descendants().filter(|n| n.has_tag_name("td")).filter_map(|n| n.text()).collect();
        assert!(cells.contains(&"passing null for an undeclared argument"), "{cells:?}");
        checked.push((supervised, summary["tools"]["checks"].clone(), summary["warnings"].clone(), md));
    }
    let [(parquet, parquet_checks, parquet_warnings, _), (exported, exported_checks, exported_warnings, md), dropped] =
        &checked[..]
    else {
        unreachable!()
    };
    assert!(parquet.contains("[get_weather(city=\"Oslo\")]") && !parquet.contains("null"), "{parquet}");
    let counts = |c: &Value| {
        [
            "calls",
            "from_text",
            "no_tools_offered",
            "off_schema",
            "unoffered",
            "unreadable",
            "undeclared_arguments",
            "null_arguments",
            "undeclared_nulls",
        ]
        .map(|k| c[k].as_u64().unwrap())
    };
    assert_eq!(counts(parquet_checks), [4, 0, 0, 0, 0, 0, 0, 0, 0], "{parquet_checks}");
    assert_eq!(parquet_warnings, &serde_json::json!([]));

    assert!(exported.contains("origin=null"), "the exported nulls are trained: {exported}");
    assert_eq!(counts(exported_checks), [4, 0, 0, 4, 0, 0, 4, 4, 4], "{exported_checks}");
    assert_eq!(
        exported_checks["examples"][0],
        "fc/function_calls.to_json.jsonl#l1: get_weather: origin: not in its schema; origin: null"
    );
    let warning = exported_warnings[0].as_str().unwrap();
    assert!(warning.starts_with("4 tool call(s) pass null for arguments their function's schema does not declare"));
    assert!(md.contains("| tool calls off their offered schema | 4 (100.0 %) |"), "{md}");

    // `drop_nulls = true` reads the export back as the parquet: the same conversations, calls and report.
    assert_eq!(conversations[2], conversations[0]);
    assert_eq!((&dropped.0, &dropped.1, &dropped.2), (parquet, parquet_checks, parquet_warnings));
}

/// A run's conversations without their ids and sources (which name the file they came from).
fn conversation_bodies(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut rows: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    for row in &mut rows {
        let row = row.as_object_mut().unwrap();
        row.remove("id");
        row.remove("source");
    }
    rows
}

/// ShareGPT rows with per-turn `weight`s (`schema.train = "weight"`): a turn weighted 0 is in the history of
/// the later turns' samples but never supervised, and the inspection report counts it.
#[test]
fn turns_weighted_zero_are_history_only() {
    let dir = tempfile::tempdir().unwrap();
    let rows = [
        r#"{"id": "a", "conversations": [{"from": "human", "value": "Count the files.", "weight": 0}, {"from": "gpt", "value": "rm -rf data", "weight": 0}, {"from": "human", "value": "That deleted them."}, {"from": "gpt", "value": "ls | wc -l", "weight": 1}]}"#,
        r#"{"id": "b", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "hi"}]}"#,
        r#"{"id": "c", "conversations": [{"from": "human", "value": "Nothing to learn."}, {"from": "gpt", "value": "skip me", "weight": 0}]}"#,
    ];
    std::fs::write(dir.path().join("weighted.jsonl"), rows.join("\n")).unwrap();
    let recipe = dir.path().join("weighted.toml");
    std::fs::write(&recipe, "name = \"weighted\"\n[[source]]\nname = \"weighted\"\nformat = \"jsonl\"\npath = \"weighted.jsonl\"\n[source.schema]\nrole = \"from\"\ncontent = \"value\"\nid = \"id\"\ntrain = \"weight\"\n").unwrap();
    let run = dir.path().join("run");
    let data = run.join("data");
    ingest(recipe.to_str().unwrap(), &data);
    let ingested: Value = serde_json::from_str(&std::fs::read_to_string(data.join("ingest.json")).unwrap()).unwrap();
    assert_eq!(ingested[0]["sources"][0]["dropped"], serde_json::json!({"no_assistant_turn": 1}), "{ingested}");

    let stats = prepare_tiny(&data.join("conversations.jsonl"), &data, &["--validation-share", "0"]);
    assert_eq!(stats["samples"], 2, "{stats}");
    let supervised = tiny_text(&stats, true);
    let everything = tiny_text(&stats, false);
    assert!(supervised.contains("ls | wc -l") && supervised.contains("hi"), "{supervised:?}");
    assert!(!supervised.contains("rm -rf"), "a turn weighted 0 is supervised: {supervised:?}");
    assert!(everything.contains("rm -rf data"), "the turn weighted 0 is not in the history");

    let (ok, _, stderr) = run_kiln(&["--quiet", "inspect", "--run", run.to_str().unwrap()], &[], &project_dir());
    assert!(ok, "{stderr}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("report/summary.json")).unwrap()).unwrap();
    assert_eq!(summary["conversations"]["untrained_turns"], 1);
    assert_eq!(summary["duplicates"]["assistant_turns"], 2, "target figures cover trained turns only");
    let md = std::fs::read_to_string(run.join("report/summary.md")).unwrap();
    assert!(md.contains("| assistant turns not trained on (history only) | 1 (33.3 %) |"), "{md}");
}

/// `--dedupe` drops a conversation identical to one already kept, within a source and across recipes (ids
/// do not matter; call arguments do), before the weight.
#[test]
fn dedupe_keeps_each_conversation_once_across_recipes() {
    let dir = tempfile::tempdir().unwrap();
    let conv = |id: &str, answer: &str| {
        format!(
            r#"{{"id": "{id}", "messages": [{{"role": "user", "content": "q"}}, {{"role": "assistant", "content": "{answer}"}}]}}"#
        )
    };
    let call = |id: &str, city: &str| {
        format!(
            r#"{{"id": "{id}", "messages": [{{"role": "user", "content": "q"}}, {{"role": "assistant", "content": "", "tool_calls": [{{"name": "w", "arguments": {{"city": "{city}"}}}}]}}]}}"#
        )
    };
    // Release A: a, b, a's repeat under another id, two calls that differ only in their arguments.
    let a = [conv("a1", "yes"), conv("a2", "no"), conv("a3", "yes"), call("a4", "Oslo"), call("a5", "Quito")];
    // Release B overlaps A in two conversations and adds one; weighted 2.
    let b = [conv("b1", "no"), call("b2", "Oslo"), conv("b3", "maybe")];
    std::fs::write(dir.path().join("a.jsonl"), a.join("\n")).unwrap();
    std::fs::write(dir.path().join("b.jsonl"), b.join("\n")).unwrap();
    for (name, weight) in [("a", 1.0), ("b", 2.0)] {
        std::fs::write(
            dir.path().join(format!("{name}.toml")),
            format!("name = \"{name}\"\n[[source]]\nname = \"{name}\"\nformat = \"jsonl\"\npath = \"{name}.jsonl\"\nweight = {weight}\n[source.schema]\nmessages = \"messages\"\nid = \"id\"\n"),
        )
        .unwrap();
    }
    let recipes = format!("{},{}", dir.path().join("a.toml").display(), dir.path().join("b.toml").display());
    let run = |extra: &[&str], out: &Path| -> (Value, Vec<String>) {
        let args = ["--quiet", "ingest", "--dataset", recipes.as_str(), "--out", out.to_str().unwrap()];
        let (ok, _, stderr) = run_kiln(&[&args[..], extra].concat(), &[], &project_dir());
        assert!(ok, "{stderr}");
        let stats: Value = serde_json::from_str(&std::fs::read_to_string(out.join("ingest.json")).unwrap()).unwrap();
        let ids = std::fs::read_to_string(out.join("conversations.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["id"].as_str().unwrap().to_string())
            .collect();
        (stats, ids)
    };
    let (all, ids) = run(&[], &dir.path().join("all"));
    assert_eq!(ids.len(), 5 + 2 * 3);
    assert!(all[0]["sources"][0]["dropped"].as_object().unwrap().is_empty());

    let (once, ids) = run(&["--dedupe"], &dir.path().join("once"));
    assert_eq!(once[0]["sources"][0]["dropped"], serde_json::json!({"duplicate": 1}), "{once}");
    assert_eq!(once[1]["sources"][0]["dropped"], serde_json::json!({"duplicate": 2}), "{once}");
    assert_eq!(ids, ["a1", "a2", "a4", "a5", "b3", "b3#1"], "the first of each is kept, then weighted");
}

/// A checkpoint folder for `kiln sft --base`: `config` (a tiny config of the architecture, with the `changes`
/// to its keys: a real tokenizer's vocabulary, say) randomly initialized, beside `template` from
/// ../shared/templates and `tokenizer_dir`'s tokenizer.
fn base_with_template(
    dir: &Path,
    config: &str,
    changes: &[(&str, u64)],
    template: &str,
    tokenizer_dir: &Path,
) -> std::path::PathBuf {
    let name = template.trim_end_matches(".jinja");
    let source = dir.join(format!("source-{name}"));
    std::fs::create_dir_all(&source).unwrap();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(project_dir().join(config)).unwrap()).unwrap();
    for &(key, value) in changes {
        config[key] = value.into();
    }
    std::fs::write(source.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(project_dir().join("../shared/templates").join(template), source.join("chat_template.jinja"))
        .unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer_dir.join(file), source.join(file)).unwrap();
    }
    let base = dir.join(format!("base-{name}"));
    let args = ["--quiet", "init-model", "--from", source.to_str().unwrap(), "--out", base.to_str().unwrap()];
    let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
    assert!(ok, "{stderr}");
    base
}

/// A tokenizer folder with Gemma 4's special tokens (no Gemma 4 tokenizer ships in ../shared): the tiny
/// tokenizer's special tokens renamed to Gemma's, so the ids stay inside its vocabulary; the turn ends with
/// `<turn|>`, as Gemma 4's do.
fn gemma4_like_tokenizer(dir: &Path) -> std::path::PathBuf {
    const NAMES: [(&str, &str); 16] = [
        ("<|pad|>", "<pad>"),
        ("<|startoftext|>", "<bos>"),
        ("<|endoftext|>", "<eos>"),
        ("<|fim_pre|>", "<|\"|>"),
        ("<|fim_mid|>", "<|think|>"),
        ("<|fim_suf|>", "<|tool>"),
        ("<|im_start|>", "<|turn>"),
        ("<|im_end|>", "<turn|>"),
        ("<|tool_list_start|>", "<tool|>"),
        ("<|tool_list_end|>", "<|channel>"),
        ("<|tool_call_start|>", "<|tool_call>"),
        ("<|tool_call_end|>", "<tool_call|>"),
        ("<|tool_response_start|>", "<|tool_response>"),
        ("<|tool_response_end|>", "<tool_response|>"),
        ("<think>", "<channel|>"),
        ("</think>", "<|image|>"),
    ];
    let tiny = project_dir().join("configs/models/tiny");
    let mut tokenizer: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny.join("tokenizer.json")).unwrap()).unwrap();
    for token in tokenizer["added_tokens"].as_array_mut().unwrap() {
        let name = NAMES.iter().find(|(tiny, _)| token["content"] == *tiny).unwrap().1;
        token["content"] = name.into();
    }
    let vocab = tokenizer["model"]["vocab"].as_object_mut().unwrap();
    for (tiny, gemma) in NAMES {
        if let Some(id) = vocab.remove(tiny) {
            vocab.insert(gemma.into(), id);
        }
    }
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = r#"{"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}"#;
    std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
    dir.to_path_buf()
}

/// Every Hub model config's template policy, run through `kiln sft` with its model's own chat template
/// (../shared/templates) and a tokenizer with its special tokens, renders every turn of the Terminus-2 and
/// ToolBench-form data for training: nothing is left out because inference would prompt it otherwise. The
/// small Qwen3.5 models' generation prompt closes an empty think block, and with the reasoning of their
/// supervised turns kept every Terminus-2 turn was left out; the report says so when it happens. Gemma 4 E4B
/// runs with its newest template and with an older one whose generation prompt closes an empty thought channel.
#[test]
fn model_configs_render_every_turn_with_their_models_own_templates() {
    let dir = tempfile::tempdir().unwrap();
    let pipeline = dir.path().join("sft.toml");
    let text = std::fs::read_to_string(project_dir().join("pipelines/sft.toml")).unwrap();
    let runs = format!("runs_dir = \"{}\"", dir.path().join("runs").display());
    std::fs::write(&pipeline, text.replace("runs_dir = \"runs\"", &runs)).unwrap();
    let qwen_tokenizer = qwen_tokenizer_dir(&dir.path().join("qwen-tokenizer"));
    let tiny = project_dir().join("configs/models/tiny");
    let base = |config: &str, changes: &[(&str, u64)], template: &str, tokenizer: &Path| {
        base_with_template(dir.path(), config, changes, template, tokenizer)
    };
    let lfm2 = base("configs/models/tiny/config.json", &[], "lfm2.jinja", &tiny);
    let lfm2_5 = base("configs/models/tiny/config.json", &[], "lfm2.5.jinja", &tiny);
    let lfm2_5_moe = base("configs/models/tiny-moe/config.json", &[], "LFM2.5-8B-A1B.jinja", &tiny);
    let qwen_config = "configs/models/tiny-qwen3.5/config.json";
    // The real vocabulary in a narrow embedding (16 wide): 4 M parameters, not 34 M.
    let qwen_shape = [("vocab_size", 248_320), ("hidden_size", 16)];
    let qwen_small = base(qwen_config, &qwen_shape, "qwen3_5_small_nothink.jinja", &qwen_tokenizer);
    let qwen = base(qwen_config, &qwen_shape, "qwen3_5.jinja", &qwen_tokenizer);
    let gemma_tokenizer = gemma4_like_tokenizer(&dir.path().join("gemma-tokenizer"));
    let gemma_config = "configs/models/tiny-gemma4/config.json";
    let gemma = base(gemma_config, &[], "gemma4_v4.trl_vendored.jinja", &gemma_tokenizer);
    // An older revision (llama.cpp's): its generation prompt closes an empty thought channel.
    let gemma_older = base(gemma_config, &[], "gemma4.jinja", &gemma_tokenizer);

    let try_sft = |model: &str, base: &Path, extra: &[&str]| -> (bool, String, String) {
        let run = format!("{model}-{}-{}", base.file_name().unwrap().to_string_lossy(), extra.len());
        let mut args = vec!["--quiet", "sft", "--model", model, "--pipeline", pipeline.to_str().unwrap()];
        args.extend(["--base", base.to_str().unwrap(), "--run", run.as_str(), "--until", "inspect"]);
        args.extend(["--device", "cpu", "--set", "model.gpu=false", "--set", "data.validation_share=0"]);
        args.extend(["--set", r#"data.recipes=["terminal-synth", "toolbench-synth"]"#]);
        args.extend(["--set", "data.weights={terminal-synth = 0.1, toolbench-synth = 0.1}"]);
        args.extend(["--set", r#"data.decontaminate=["datasets/samples/replay.jsonl"]"#]);
        args.extend(extra);
        let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
        (ok, run, stderr)
    };
    let sft = |model: &str, base: &Path, extra: &[&str]| -> (Value, String) {
        let (ok, run, stderr) = try_sft(model, base, extra);
        assert!(ok, "{model}: {stderr}");
        let stats = dir.path().join("runs").join(&run).join("data/stats.json");
        (serde_json::from_str(&std::fs::read_to_string(stats).unwrap()).unwrap(), stderr)
    };
    for (model, base) in [
        ("lfm2-350m", &lfm2),
        ("lfm2.5-1.2b", &lfm2_5),
        ("lfm2.5-8b", &lfm2_5_moe),
        ("qwen3.5-0.8b", &qwen_small),
        ("qwen3.5-2b", &qwen_small),
        ("qwen3.5-9b", &qwen),
        ("gemma-4-e4b", &gemma),
        ("gemma-4-e4b", &gemma_older),
    ] {
        let (stats, stderr) = sft(model, base, &[]);
        assert!(stats["dropped"].as_object().unwrap().is_empty(), "{model}: {}", stats["error_examples"]);
        for source in ["terminal", "toolbench"] {
            assert!(stats["per_source"][source]["supervised_tokens"].as_u64().unwrap() > 0, "{model}: {stats}");
        }
        assert!(!stderr.contains("could not render"), "{model}: {stderr}");
    }

    // The small models with the reasoning kept in the supervised turn: every Terminus-2 conversation is left
    // out, and the inspection says so with the first error.
    let (stats, stderr) = sft("qwen3.5-0.8b", &qwen_small, &["--set", "template.thinking=strip-history"]);
    let left_out = stats["dropped"]["template_error"].as_u64().unwrap();
    assert!(stats["per_source"]["terminal"].is_null() && left_out > 0, "{stats}");
    assert!(
        stderr.contains(&format!("could not render for training (template_error: {left_out}; of "))
            && stderr.contains("the generation prompt ends \"\\n</think>\\n\\n\"")
            && stderr.contains("`thinking = \"drop\"` in the model config's [template]"),
        "{stderr}"
    );
    // Gemma 4 with the results of ReAct calls as tool messages: every multi-step ToolBench conversation is left
    // out, as its results would be gone from the render.
    let (stats, stderr) = sft("gemma-4-e4b", &gemma, &["--set", "template.tool_results=tool"]);
    let left_out = stats["dropped"]["tool_results_unrendered"].as_u64().unwrap();
    assert!(left_out > 0 && stats["per_source"]["terminal"]["supervised_tokens"].as_u64().unwrap() > 0, "{stats}");
    assert!(
        stderr.contains(&format!("could not render for training (tool_results_unrendered: {left_out}; of "))
            && stderr.contains("`tool_results = \"user\"`"),
        "{stderr}"
    );
    // The older revision under the prefix rule: every turn is refused, and the error names the prompt's empty
    // thought channel and the rule that trains after it.
    let (ok, _, stderr) = try_sft("gemma-4-e4b", &gemma_older, &["--set", "template.prompt_rule=prefix"]);
    assert!(
        !ok && stderr.contains("no sample from")
            && stderr.contains("the generation prompt ends \"<|channel>thought\\n<channel|>\"")
            && stderr.contains("`prompt_rule = \"splice\"`"),
        "{stderr}"
    );
}
