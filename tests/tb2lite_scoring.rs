//! The TB2-lite scorer against the reference: every parse and score case of
//! ../shared/data/tb2lite/replay_metrics_reference_cases.jsonl (both scorer versions, corrected and legacy
//! empty rules), the real per-step rows and aggregate arithmetic of the published result excerpt, and edge
//! cases of our own.

mod common;

use std::path::Path;

use kiln::eval::parse::{ScorerVersion, parse_response};
use kiln::eval::result::{aggregate, next_action_score};
use kiln::eval::score::{score_units, unit_tokens};
use serde_json::Value;

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(common::shared_tb2lite().join("replay_metrics_reference_cases.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

#[test]
fn every_reference_parse_case_matches_both_versions() {
    let mut checked = 0;
    for case in cases().iter().filter(|c| c["kind"] == "parse") {
        let text = case["text"].as_str().unwrap();
        for (version, key) in [(ScorerVersion::V1, "expected_v1_16748ba"), (ScorerVersion::V2, "expected_v2_latest")] {
            let want = &case[key];
            let got = parse_response(text, version);
            let name = case["name"].as_str().unwrap();
            assert_eq!(got.valid_json, want["valid_json"].as_bool().unwrap(), "{name} {version:?} valid_json");
            assert_eq!(got.has_analysis, want["has_analysis"].as_bool().unwrap(), "{name} {version:?} has_analysis");
            assert_eq!(got.has_plan, want["has_plan"].as_bool().unwrap(), "{name} {version:?} has_plan");
            assert_eq!(got.task_complete, want["task_complete"].as_bool(), "{name} {version:?} task_complete");
            assert_eq!(got.command_units, strings(&want["command_units"]), "{name} {version:?} units");
            checked += 1;
        }
    }
    assert_eq!(checked, 58);
}

#[test]
fn every_reference_score_case_matches_both_empty_rules() {
    let mut checked = 0;
    for case in cases().iter().filter(|c| c["kind"] == "score") {
        let name = case["name"].as_str().unwrap();
        let (pred, refs) = (strings(&case["pred_units"]), strings(&case["ref_units"]));
        for (legacy, key) in [(false, "expected_corrected"), (true, "expected_legacy_both_empty_is_1")] {
            let want = &case[key];
            let got = score_units(&pred, &refs, legacy);
            for (field, value) in [
                ("first_cmd_exact", got.first_cmd_exact),
                ("precision", got.precision),
                ("recall", got.recall),
                ("f1", got.f1),
            ] {
                assert_eq!(value, want[field].as_f64().unwrap(), "{name} {key} {field}");
            }
            checked += 1;
        }
        let tokens = |units: &[String]| -> Value {
            serde_json::json!(
                units.iter().map(|u| unit_tokens(&kiln::eval::score::normalize_unit(u))).collect::<Vec<_>>()
            )
        };
        assert_eq!(tokens(&pred), case["pred_tokens"], "{name} pred tokens");
        assert_eq!(tokens(&refs), case["ref_tokens"], "{name} ref tokens");
    }
    assert_eq!(checked, 40);
}

#[test]
fn the_published_rows_and_aggregate_reproduce() {
    let text =
        std::fs::read_to_string(common::shared_tb2lite().join("lfm25-raw-base-no-sft-rerun-20260612.excerpt.json"))
            .unwrap();
    let excerpt: Value = serde_json::from_str(&text).unwrap();
    for row in excerpt["per_step_excerpt"].as_array().unwrap() {
        let got = score_units(&strings(&row["pred_command_units"]), &strings(&row["ref_command_units"]), false);
        assert_eq!(got.first_cmd_exact, row["first_cmd_exact"].as_f64().unwrap());
        assert_eq!(got.precision, row["command_precision"].as_f64().unwrap(), "step {}", row["step_idx"]);
        assert_eq!(got.recall, row["command_recall"].as_f64().unwrap(), "step {}", row["step_idx"]);
        assert_eq!(got.f1, row["command_f1"].as_f64().unwrap(), "step {}", row["step_idx"]);
    }
    let agg = &excerpt["aggregate"];
    assert_eq!(
        next_action_score(agg["avg_command_f1"].as_f64().unwrap(), agg["first_cmd_exact_pct"].as_f64().unwrap()),
        agg["next_action_score"].as_f64().unwrap()
    );
    // Aggregating the four rows: each figure is the mean of the rounded step values, rounded as specified.
    let rows: Vec<kiln::eval::result::StepRow> = excerpt["per_step_excerpt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r["pred_preview"] = Value::String(String::new());
            serde_json::from_value(r).unwrap()
        })
        .collect();
    let a = aggregate(&rows);
    assert_eq!(a.steps, 4);
    assert_eq!(a.tasks, 1);
    // sum(values) / len(values) in row order, as Python's sum: 0.33284999…, which rounds to 0.3328.
    assert_eq!(a.avg_command_f1, 0.3328);
    assert_eq!(a.valid_json_pct, 25.0);
    assert_eq!(a.first_cmd_exact_pct, 25.0);
    assert_eq!(a.by_bucket["early"].steps, 2);
    assert_eq!(a.by_bucket["mid"].steps, 2);
    assert_eq!(a.score, 33.28);
}

#[test]
fn edge_cases_of_our_own() {
    let v2 = ScorerVersion::V2;
    // Fences with nested braces and prose; non-dict JSON; a string cut off mid-escape.
    let fenced = "Plan:\n```json\n{\"commands\": [{\"keystrokes\": \"awk '{print $1}' f\\n\"}]}\n```\nthanks }";
    assert_eq!(parse_response(fenced, v2).command_units, ["awk '{print $1}' f"]);
    // A list reply: the first '{' to the last '}' is the object inside it, as the reference extracts it.
    let list = "[{\"keystrokes\": \"ls\\n\"}]";
    let p = parse_response(list, v2);
    assert!(p.valid_json);
    assert_eq!(p.command_units, ["ls"], "top-level keystrokes (v2)");
    assert!(parse_response(list, ScorerVersion::V1).command_units == ["ls"], "v1 finds them by the fallback");
    let cut = "{\"commands\": [{\"keystrokes\": \"echo a\\";
    assert_eq!(parse_response(cut, v2).command_units, ["echo a"]);
    assert!(parse_response(cut, ScorerVersion::V1).command_units.is_empty());
    // Unicode whitespace around units and inside them.
    let s = score_units(&["\u{3000}LS\u{a0}-LA ".into()], &["ls -la".into()], false);
    assert_eq!((s.first_cmd_exact, s.f1), (1.0, 1.0));
    // An empty keystroke is a <WAIT>, which only matches a <WAIT>.
    assert_eq!(parse_response(r#"{"commands": [{"keystrokes": "  \n"}]}"#, v2).command_units, ["<WAIT>"]);
    assert_eq!(score_units(&["<WAIT>".into()], &["".into()], false).f1, 1.0);
    // Python truthiness: an empty analysis is absent.
    let p = parse_response(r#"{"analysis": "", "plan": [], "commands": []}"#, v2);
    assert!(p.valid_json && !p.has_analysis && !p.has_plan);
}

/// `kiln score`: whether it succeeded, and its stderr.
fn kiln_score(replay: &Path, predictions: &Path, out: &Path) -> (bool, String) {
    let [replay, predictions, out] = [replay, predictions, out].map(|p| p.to_str().unwrap());
    let args = ["score", "--replay", replay, "--predictions", predictions, "--out", out];
    let (ok, _, stderr) = common::run_kiln(&args, &[], &common::project_dir());
    (ok, stderr)
}

#[test]
fn kiln_score_on_the_real_replay_set() {
    let dir = tempfile::tempdir().unwrap();
    let replay = common::shared_tb2lite().join("replay_full.jsonl");
    let text = std::fs::read_to_string(&replay).unwrap();
    // The references as predictions: a perfect run, whose reference-side figures equal the published ones.
    let preds = dir.path().join("preds.jsonl");
    let mut lines = String::new();
    for l in text.lines() {
        let r: Value = serde_json::from_str(l).unwrap();
        lines.push_str(
            &serde_json::json!({"task_id": r["task_id"], "step_idx": r["step_idx"], "text": r["ref_raw"]}).to_string(),
        );
        lines.push('\n');
    }
    std::fs::write(&preds, &lines).unwrap();
    let out = dir.path().join("result.json");
    let (ok, stderr) = kiln_score(&replay, &preds, &out);
    assert!(ok, "{stderr}");
    let result: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let a = &result["aggregate"];
    let published: Value = serde_json::from_str(
        &std::fs::read_to_string(common::shared_tb2lite().join("lfm25-raw-base-no-sft-rerun-20260612.excerpt.json"))
            .unwrap(),
    )
    .unwrap();
    let p = &published["aggregate"];
    assert_eq!(
        (a["steps"].clone(), a["tasks"].clone(), a["avg_ref_cmds"].clone()),
        (p["steps"].clone(), p["tasks"].clone(), p["avg_ref_cmds"].clone())
    );
    for bucket in ["early", "mid", "late"] {
        assert_eq!(a["by_bucket"][bucket]["steps"], p["by_bucket"][bucket]["steps"], "{bucket}");
    }
    for (group, g) in p["by_source_group"].as_object().unwrap() {
        assert_eq!(a["by_source_group"][group]["steps"], g["steps"], "{group}");
    }
    assert_eq!(a["score"], 100.0);
    assert_eq!(result["per_step"].as_array().unwrap().len(), 303);

    // Our own result JSON is accepted as predictions (re-scoring another evaluator's output).
    let again = dir.path().join("again.json");
    let (ok, stderr) = kiln_score(&replay, &out, &again);
    assert!(ok, "{stderr}");
    let rescored: Value = serde_json::from_str(&std::fs::read_to_string(&again).unwrap()).unwrap();
    assert_eq!(rescored["aggregate"], result["aggregate"]);

    // A missing prediction names the step.
    let partial = dir.path().join("partial.jsonl");
    std::fs::write(&partial, lines.lines().skip(1).collect::<Vec<_>>().join("\n")).unwrap();
    let (ok, stderr) = kiln_score(&replay, &partial, &again);
    assert!(!ok && stderr.contains("no prediction for 1 of 303 steps"), "{stderr}");

    // A replay file without steps scores nothing: an error, not a Score of 0 written as a result.
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    let fresh = dir.path().join("from-empty.json");
    let (ok, stderr) = kiln_score(&empty, &empty, &fresh);
    assert!(!ok && stderr.contains("empty.jsonl: no replay step to score"), "{stderr}");
    assert!(!fresh.exists());
}
