//! `kiln inspect` on a run prepared from the synthetic samples: every figure in the report equals what the
//! test recomputes from the shards and the conversations, the page is well-formed, and (with Chromium
//! installed) it renders to a screenshot that is not blank.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{project_dir, run_kiln};
use kiln::report::Inspection;
use kiln::tokens::shards::{Row, read_shard};
use serde_json::{Value, json};

fn kiln(args: &[&str]) -> String {
    let (ok, _, stderr) = run_kiln(args, &[], &project_dir());
    assert!(ok, "kiln {args:?}: {stderr}");
    stderr
}

/// A run prepared from the synthetic samples, decontaminated against an eval file that holds three of its
/// terminal tasks, at a sequence length that drops the longest samples.
fn prepared_run(dir: &Path) -> PathBuf {
    let run = dir.join("run");
    let data = run.join("data");
    let plain = dir.join("plain");
    kiln(&["--quiet", "ingest", "--dataset", "terminal-synth", "--out", plain.to_str().unwrap()]);
    let text = std::fs::read_to_string(plain.join("conversations.jsonl")).unwrap();
    let tasks: Vec<String> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).unwrap()["meta"]["task"].as_str().map(str::to_string))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .take(3)
        .collect();
    let eval = dir.join("eval.jsonl");
    let mut f = std::fs::File::create(&eval).unwrap();
    for task in &tasks {
        let row = json!({"task": task, "conversations": [{"role": "user", "content": format!("held out {task}")}]});
        writeln!(f, "{row}").unwrap();
    }
    drop(f);
    let (data_s, eval_s) = (data.to_str().unwrap(), eval.to_str().unwrap());
    kiln(&[
        "--quiet",
        "ingest",
        "--dataset",
        "terminal-synth,toolbench-synth",
        "--decontaminate",
        eval_s,
        "--out",
        data_s,
    ]);
    let conversations = data.join("conversations.jsonl");
    kiln(&[
        "--quiet",
        "prepare",
        "--model",
        "tiny",
        "--data",
        conversations.to_str().unwrap(),
        "--out",
        data_s,
        "--seq-len",
        "768",
        "--date",
        "2026-01-01",
    ]);
    run
}

fn nearest_rank(sorted: &[u64], p: f64) -> u64 {
    let n = sorted.len();
    sorted[((p * n as f64).ceil() as usize).clamp(1, n) - 1]
}

fn shard_rows(run: &Path) -> Vec<Row> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(run.join("data"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    paths.sort();
    paths.iter().flat_map(|p| read_shard(p).unwrap()).collect()
}

fn check_against_shards(ins: &Inspection, run: &Path) {
    let rows = shard_rows(run);
    let tok = tokenizers::Tokenizer::from_file(project_dir().join("configs/models/tiny/tokenizer.json")).unwrap();
    let (open, close) = (tok.token_to_id("<think>").unwrap(), tok.token_to_id("</think>").unwrap());
    let mut lengths = Vec::new();
    let mut supervised_per = Vec::new();
    let mut per_source: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    let (mut thinking, mut slots) = (0u64, 0u64);
    for row in &rows {
        slots += row.input_ids.len() as u64;
        let mut start = 0usize;
        for (d, &len) in row.doc_lengths.iter().enumerate() {
            let end = start + len as usize;
            let mask = &row.loss_mask[start..end];
            let sup = mask.iter().filter(|&&m| m == 1).count() as u64;
            let mut inside = false;
            for (&id, &m) in row.input_ids[start..end].iter().zip(mask) {
                inside |= id == open;
                thinking += u64::from(inside && m == 1);
                inside &= id != close;
            }
            lengths.push(u64::from(len));
            supervised_per.push(sup);
            let e = per_source.entry(row.sources[d].clone()).or_default();
            *e = (e.0 + 1, e.1 + u64::from(len), e.2 + sup);
            start = end;
        }
    }
    let tokens: u64 = lengths.iter().sum();
    let supervised: u64 = supervised_per.iter().sum();
    let s = &ins.samples;
    assert_eq!((s.samples, s.tokens, s.supervised_tokens), (lengths.len() as u64, tokens, supervised));
    assert_eq!((s.rows, s.slots, s.padding_tokens), (rows.len() as u64, slots, slots - tokens));
    assert!((s.supervised_share - supervised as f64 / tokens as f64).abs() < 1e-12);
    lengths.sort();
    supervised_per.sort();
    let t = &s.tokens_per_sample;
    assert_eq!(
        (t.min, t.p50, t.p95, t.p99, t.max),
        (
            lengths[0],
            nearest_rank(&lengths, 0.5),
            nearest_rank(&lengths, 0.95),
            nearest_rank(&lengths, 0.99),
            *lengths.last().unwrap()
        )
    );
    assert!(t.max <= 768);
    assert_eq!(s.supervised_per_sample.p50, nearest_rank(&supervised_per, 0.5));
    for (source, (n, tok_n, sup_n)) in &per_source {
        let got = &s.per_source[source];
        assert_eq!((got.samples, got.tokens, got.supervised_tokens), (*n, *tok_n, *sup_n), "{source}");
    }
    assert_eq!(ins.thinking.thinking_tokens_in_targets, thinking);
    assert!(thinking > 0, "the synthetic terminal targets carry thinking");
}

fn check_against_conversations(ins: &Inspection, run: &Path) {
    let text = std::fs::read_to_string(run.join("data/conversations.jsonl")).unwrap();
    let convs: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(ins.conversations.total, convs.len() as u64);
    let mut seen = HashSet::new();
    let mut duplicates = 0;
    let mut with_thinking = 0;
    let mut assistant = 0;
    for c in &convs {
        if !seen.insert(c["messages"].to_string()) {
            duplicates += 1;
        }
        for m in c["messages"].as_array().unwrap() {
            if m["role"] == "assistant" {
                assistant += 1;
                with_thinking += u64::from(m["content"].as_str().unwrap().contains("<think>"));
            }
        }
    }
    assert_eq!(ins.duplicates.duplicate_conversations, duplicates);
    assert_eq!((ins.thinking.assistant_turns, ins.thinking.turns_with_thinking), (assistant, with_thinking));
    let terminal = convs.iter().filter(|c| c["source"] == "terminal").count() as u64;
    assert_eq!(ins.conversations.per_source["terminal"], terminal);
    assert_eq!(ins.terminus.conversations, terminal, "every synthetic terminal conversation is Terminus-2 style");
    // The synthetic replies are all well-formed actions; toolbench ends every conversation with Finish.
    assert_eq!(ins.terminus.valid_json, ins.terminus.assistant_turns);
    let toolbench = ins.conversations.per_source["toolbench"];
    assert_eq!(ins.tools.conversations, toolbench);
    assert!(ins.tools.top_tools.contains(&("Finish".to_string(), toolbench)));
    // Its ReAct calls are read from the text and checked against the JSON list its system prompt prints.
    let checks = &ins.tools.checks;
    assert_eq!(checks.calls, ins.tools.tool_calls);
    assert_eq!((checks.from_text, checks.against_prompt_list), (checks.calls, checks.calls));
    assert_eq!((checks.off_schema, checks.no_tools_offered), (0, 0), "{:?}", checks.examples);
}

fn check_against_stats(ins: &Inspection, run: &Path) {
    let stats: Value = serde_json::from_str(&std::fs::read_to_string(run.join("data/stats.json")).unwrap()).unwrap();
    let ingest: Value = serde_json::from_str(&std::fs::read_to_string(run.join("data/ingest.json")).unwrap()).unwrap();
    assert!(ins.warnings.is_empty(), "{:?}", ins.warnings);
    assert_eq!(ins.samples.dropped.get("too_long").copied(), stats["dropped"]["too_long"].as_u64());
    assert!(ins.samples.dropped["too_long"] > 0, "sequence 768 drops the longest samples");
    assert_eq!(ins.thinking.blocks_stripped_from_history, stats["thinking_blocks_stripped"].as_u64().unwrap());
    assert_eq!(ins.template.sha256, stats["template"]["sha256"].as_str().unwrap());
    assert_eq!((ins.template.thinking.as_str(), ins.template.mode.as_str()), ("strip-history", "auto"));
    let terminal = ins.sources.iter().find(|s| s.name == "terminal").unwrap();
    let recorded = &ingest[0]["sources"][0];
    assert_eq!(terminal.rows_read, recorded["rows_read"].as_u64().unwrap());
    assert_eq!(terminal.decontaminated, recorded["decontamination"]["dropped"].as_u64().unwrap());
    assert!(terminal.decontaminated >= 3, "each planted eval task removes its conversations");
    assert_eq!(terminal.eval_tasks_hit.len(), 3);
}

/// Parses the page as XML (it is written well-formed) and checks its parts.
fn check_page(ins: &Inspection, html: &str) {
    let doc = roxmltree::Document::parse_with_options(
        html,
        roxmltree::ParsingOptions { allow_dtd: true, ..Default::default() },
    )
    .unwrap_or_else(|e| panic!("index.html is not well-formed: {e}"));
    let svgs = doc.descendants().filter(|n| n.has_tag_name("svg")).count();
    assert!(svgs >= 3, "the histograms are inline SVG ({svgs})");
    let boxes: Vec<_> = doc.descendants().filter(|n| n.attribute("class") == Some("ex")).collect();
    assert_eq!(boxes.len(), ins.examples.len());
    assert!(ins.examples.len() >= 4, "first, longest and random examples");
    for (node, example) in boxes.iter().zip(&ins.examples) {
        let (mut ids, mut supervised_ids) = (0u64, 0u64);
        for span in node.children().filter(|n| n.has_tag_name("span")) {
            let title = span.attribute("title").expect("every token has a hover title");
            let n = title.split(" · ").next().unwrap().split_whitespace().count() as u64 - 1;
            ids += n;
            if span.attribute("class").unwrap().starts_with('s') {
                supervised_ids += n;
            }
        }
        assert_eq!(ids, example.tokens, "{}: every token is shown", example.sample_id);
        assert!(supervised_ids >= example.supervised && supervised_ids <= example.supervised + 4);
    }
    let text: String = doc.root_element().descendants().filter_map(|n| n.text()).collect();
    for key in ["Key figures", "Sources", "Duplicates", "Template", "Examples", &ins.template.sha256] {
        assert!(text.contains(key), "page lacks {key}");
    }
}

fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"].into_iter().find_map(|name| {
        let out = Command::new("which").arg(name).output().ok()?;
        out.status.success().then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    })
}

/// Renders the page headless and checks the screenshot shows something: many non-white pixels, several
/// colours (text, tables, the green of supervised tokens).
fn check_screenshot(page: &Path, dir: &Path) {
    let Some(browser) = chromium() else {
        eprintln!("SKIPPED: the screenshot check needs Chromium (Debian package `chromium`), which is not installed");
        return;
    };
    let shot = dir.join("shot.png");
    let mut child = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1600"])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.canonicalize().unwrap().display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // A browser that cannot start in this environment must not hang the suite.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            eprintln!("SKIPPED: Chromium did not finish a screenshot within 120 s in this environment");
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(shot.is_file(), "Chromium exited without writing the screenshot");
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    let pixels: Vec<&[u8]> = buf[..info.buffer_size()].chunks(channels).collect();
    let ink = pixels.iter().filter(|p| p[..3].iter().any(|&c| c < 200)).count();
    let colours: HashSet<&[u8]> = pixels.iter().map(|p| &p[..3]).collect();
    assert!(ink * 100 > pixels.len(), "screenshot is nearly blank: {ink} of {} pixels have ink", pixels.len());
    assert!(colours.len() > 20, "screenshot has only {} colours", colours.len());
}

#[test]
fn report_figures_equal_the_shards_and_the_page_renders() {
    let dir = tempfile::tempdir().unwrap();
    let run = prepared_run(dir.path());
    let stderr = kiln(&["inspect", "--run", run.to_str().unwrap()]);
    assert!(stderr.contains("inspect: ") && stderr.contains("index.html"), "{stderr}");
    let report = run.join("report");
    let ins: Inspection = serde_json::from_str(&std::fs::read_to_string(report.join("summary.json")).unwrap()).unwrap();
    check_against_shards(&ins, &run);
    check_against_conversations(&ins, &run);
    check_against_stats(&ins, &run);
    let html = std::fs::read_to_string(report.join("index.html")).unwrap();
    check_page(&ins, &html);
    let md = std::fs::read_to_string(report.join("summary.md")).unwrap();
    assert!(md.contains(&format!("| samples | {} |", ins.samples.samples)), "{md}");
    assert!(md.contains(&format!("| tokens | {} |", ins.samples.tokens)), "{md}");
    check_screenshot(&report.join("index.html"), dir.path());

    // The same seed picks the same examples.
    kiln(&["--quiet", "inspect", "--run", run.to_str().unwrap()]);
    let again: Inspection =
        serde_json::from_str(&std::fs::read_to_string(report.join("summary.json")).unwrap()).unwrap();
    let ids = |i: &Inspection| i.examples.iter().map(|e| e.sample_id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&again), ids(&ins));
}

#[test]
fn bad_runs_fail_with_what_and_where() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, _, stderr) = run_kiln(&["inspect", "--run", dir.path().to_str().unwrap()], &[], &project_dir());
    assert!(!ok && stderr.contains("stats.json") && stderr.contains("not a prepared run"), "{stderr}");

    let run = prepared_run(dir.path());
    // A recipe column no row held is a warning at the top of the report, not an error.
    let ingest_path = run.join("data/ingest.json");
    let mut ingest: Value = serde_json::from_str(&std::fs::read_to_string(&ingest_path).unwrap()).unwrap();
    ingest[0]["sources"][0]["absent_columns"] =
        json!([{"column": "tsk", "feeds": "task", "file": "samples/terminal.parquet", "rows": 560}]);
    std::fs::write(&ingest_path, ingest.to_string()).unwrap();
    let stderr = kiln(&["inspect", "--run", run.to_str().unwrap()]);
    assert!(stderr.contains("warning: source 'terminal': column 'tsk' (schema.task)"), "{stderr}");
    let page = std::fs::read_to_string(run.join("report/index.html")).unwrap();
    assert!(page.contains("column &#39;tsk&#39; (schema.task)"), "the page shows the warning");

    let conversations = run.join("data/conversations.jsonl");
    let mut text = std::fs::read_to_string(&conversations).unwrap();
    text.push_str("{\"id\": \"broken\", \"messages\": [\n");
    std::fs::write(&conversations, &text).unwrap();
    let (ok, _, stderr) = run_kiln(&["inspect", "--run", run.to_str().unwrap()], &[], &project_dir());
    let line = text.lines().count();
    assert!(!ok && stderr.contains(&format!("conversations.jsonl: line {line}")), "{stderr}");
    let after = std::fs::read_to_string(run.join("report/index.html")).unwrap();
    assert!(after == page, "a failed inspect leaves the last report as it was");
}
