//! Parity with transformers 5.23.0: every template in ../shared/templates and kiln's own (the offline
//! default's, configs/models/tiny), rendered by kiln over the
//! fixture conversations, equals transformers' render byte for byte (text, {% generation %} spans, the
//! generation prompt, each turn's prefix render), and tokenizes to the same ids with the same assistant
//! masks where a real tokenizer is available. Fixtures: tests/fixtures/templates/make_fixtures.py.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln::chat::{ChatTemplate, PinnedClock, SpecialTokens, TemplateSource};
use kiln::tokens::TextTokenizer;
use kiln::tokens::mask::mask_from_spans;
use kiln::tokens::tokenizer::SegmentCache;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

fn fixtures_dir() -> PathBuf {
    common::project_dir().join("tests/fixtures/templates")
}

fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

struct Conv {
    name: String,
    messages: Vec<Value>,
    tools: Option<Value>,
    kwargs: Map<String, Value>,
}

fn conversations() -> (Vec<Conv>, PinnedClock) {
    let v = read(&fixtures_dir().join("conversations.json"));
    let clock = PinnedClock::parse(v["pinned_date"].as_str().unwrap()).unwrap();
    let convs = v["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Conv {
            name: c["name"].as_str().unwrap().to_string(),
            messages: c["messages"].as_array().unwrap().clone(),
            tools: Some(c["tools"].clone()).filter(|t| !t.is_null()),
            kwargs: c["kwargs"].as_object().unwrap().clone(),
        })
        .collect();
    (convs, clock)
}

fn sha(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

fn spans_json(spans: &[std::ops::Range<usize>]) -> Value {
    Value::Array(spans.iter().map(|s| serde_json::json!([s.start, s.end])).collect())
}

/// Checks every fixture whose family is in `families`; returns the mismatches found.
fn check(families: &[&str]) -> Vec<String> {
    let (convs, clock) = conversations();
    let mut tokenizers: BTreeMap<String, Option<std::rc::Rc<TextTokenizer>>> = BTreeMap::new();
    // Segment caches are per tokenizer: the same text has other ids under another vocabulary.
    let mut caches: BTreeMap<String, SegmentCache> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut checked = 0;
    let (mut tokens_checked, mut masks_checked) = (0, 0);
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json") && !p.ends_with("conversations.json"))
        .collect();
    files.sort();
    for file in files {
        let fixture = read(&file);
        if !families.contains(&fixture["family"].as_str().unwrap()) {
            continue;
        }
        let name = fixture["template"].as_str().unwrap();
        // kiln's own templates name their path; the collected ones live in ../shared/templates.
        let template_path = match fixture.get("path").and_then(Value::as_str) {
            Some(rel) => common::project_dir().join(rel),
            None => common::project_dir().join("../shared/templates").join(name),
        };
        let source = TemplateSource::from_file(&template_path).unwrap();
        assert_eq!(source.sha256, fixture["sha256"].as_str().unwrap(), "{name} changed since the fixtures were made");
        let special: BTreeMap<String, String> = serde_json::from_value(fixture["special"].clone()).unwrap();
        let template = ChatTemplate::new(source, SpecialTokens(special), clock).unwrap();
        assert_eq!(template.has_generation, fixture["has_generation"].as_bool().unwrap(), "{name}");
        let tokenizer = fixture["tokenizer"].as_str().map(|rel| {
            tokenizers
                .entry(rel.to_string())
                .or_insert_with(|| {
                    let dir = common::project_dir().join(rel).parent().unwrap().to_path_buf();
                    TextTokenizer::load(&dir, &SpecialTokens::default(), None).ok().map(std::rc::Rc::new)
                })
                .clone()
        });
        for (case, conv) in fixture["cases"].as_array().unwrap().iter().zip(&convs) {
            checked += 1;
            let at = format!("{name} / {}", conv.name);
            let full = template.render(&conv.messages, conv.tools.as_ref(), false, &conv.kwargs);
            if let Some(err) = case.get("error") {
                if full.is_ok() {
                    problems.push(format!("{at}: transformers raised ({err}) but kiln rendered"));
                }
                continue;
            }
            let full = match full {
                Ok(r) => r,
                Err(e) => {
                    problems.push(format!("{at}: kiln failed: {e}"));
                    continue;
                }
            };
            if full.text != case["text"].as_str().unwrap() {
                problems.push(format!("{at}: text differs\n kiln: {:?}\n   hf: {:?}", full.text, case["text"]));
                continue;
            }
            if spans_json(&full.spans) != case["spans"] {
                problems.push(format!("{at}: generation spans {:?} != {}", full.spans, case["spans"]));
            }
            let history: Vec<Value> = if conv.messages.last().and_then(|m| m["role"].as_str()) == Some("assistant") {
                conv.messages[..conv.messages.len() - 1].to_vec()
            } else {
                conv.messages.clone()
            };
            let prompt = template.render(&history, conv.tools.as_ref(), true, &conv.kwargs);
            match (case.get("generation_prompt"), prompt) {
                (Some(want), Ok(got)) if want.as_str() != Some(got.text.as_str()) => {
                    problems.push(format!("{at}: generation prompt differs\n kiln: {:?}\n   hf: {want:?}", got.text))
                }
                (None, Ok(_)) => {
                    problems.push(format!("{at}: the generation prompt raised in transformers, not in kiln"))
                }
                (Some(_), Err(e)) => problems.push(format!("{at}: generation prompt failed in kiln: {e}")),
                _ => {}
            }
            for turn in case["turns"].as_array().unwrap() {
                let t = turn["index"].as_u64().unwrap() as usize;
                if turn.get("error").is_some() {
                    continue;
                }
                let upto = template.render(&conv.messages[..=t], conv.tools.as_ref(), false, &conv.kwargs).unwrap();
                if sha(&upto.text) != turn["sha256"].as_str().unwrap() {
                    problems.push(format!("{at}: render up to turn {t} differs"));
                    continue;
                }
                let last = upto.spans.last().map(|s| serde_json::json!([s.start, s.end])).unwrap_or(Value::Null);
                if last != turn["last_span"] {
                    problems.push(format!("{at}: turn {t} span {last} != {}", turn["last_span"]));
                }
                let prompt = template.render(&conv.messages[..t], conv.tools.as_ref(), true, &conv.kwargs).unwrap();
                let prompt_len = upto.text.starts_with(&prompt.text).then_some(prompt.text.len());
                if serde_json::json!(prompt_len) != turn["prompt_len"] {
                    problems.push(format!(
                        "{at}: turn {t} prefix-rule prompt length {prompt_len:?} != {}",
                        turn["prompt_len"]
                    ));
                }
            }
            if let (Some(Some(tok)), Some(want_ids)) = (&tokenizer, case.get("input_ids")) {
                let cache = caches.entry(fixture["tokenizer"].as_str().unwrap_or_default().to_string()).or_default();
                let (ids, offsets) = tok.encode_cached(&full.text, cache).unwrap();
                tokens_checked += 1;
                if (ids.clone(), offsets.clone()) != tok.encode(&full.text).unwrap() {
                    problems.push(format!("{at}: segment-cached tokenization differs from one-pass tokenization"));
                }
                if serde_json::json!(ids) != *want_ids {
                    problems.push(format!("{at}: token ids differ"));
                    continue;
                }
                if let Some(want_mask) = case.get("assistant_masks") {
                    masks_checked += 1;
                    let mask = mask_from_spans(&offsets, &full.spans);
                    if serde_json::json!(mask) != *want_mask {
                        problems.push(format!("{at}: assistant mask differs\n kiln: {mask:?}\n   hf: {want_mask}"));
                    }
                }
            }
        }
    }
    assert!(checked >= 30, "only {checked} cases checked for {families:?}");
    eprintln!("{families:?}: {checked} cases, {tokens_checked} tokenized, {masks_checked} masks compared");
    assert!(tokens_checked > 0, "no tokenizer was available for {families:?}");
    problems
}

fn assert_parity(families: &[&str]) {
    let problems = check(families);
    assert!(problems.is_empty(), "{} mismatches:\n{}", problems.len(), problems.join("\n"));
}

#[test]
fn lfm_templates_match_transformers() {
    assert_parity(&["lfm"]);
}

#[test]
fn qwen_templates_match_transformers() {
    assert_parity(&["qwen3", "qwen3.5"]);
}

#[test]
fn gemma_templates_match_transformers() {
    assert_parity(&["gemma"]);
}
