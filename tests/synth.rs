//! `kiln synth` is deterministic, matches the committed samples, and writes data in the real schemas:
//! readable by the shipped recipes with nothing dropped, a replay set in the TB2-lite record schema, and
//! held-out tasks that do not overlap training.

mod common;

use std::path::Path;

use common::{project_dir, run_kiln};
use kiln::data::EvalIndex;
use kiln::synth::replay::command_units;
use serde_json::Value;

fn synth_into(dir: &Path) {
    let (ok, _, stderr) = run_kiln(&["synth", "--out", dir.to_str().unwrap()], &[], &project_dir());
    assert!(ok, "{stderr}");
}

#[test]
fn synth_is_deterministic_and_the_committed_samples_are_current() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    synth_into(a.path());
    synth_into(b.path());
    let committed = project_dir().join("datasets/samples");
    for name in ["terminal.parquet", "terminal_heldout.jsonl", "replay.jsonl", "toolbench.json"] {
        let first = std::fs::read(a.path().join(name)).unwrap();
        assert_eq!(first, std::fs::read(b.path().join(name)).unwrap(), "{name} differs between runs");
        assert_eq!(
            first,
            std::fs::read(committed.join(name)).unwrap(),
            "datasets/samples/{name} is stale: run `make samples`"
        );
    }
}

#[test]
fn samples_ingest_cleanly_and_held_out_tasks_never_leak() {
    let out = tempfile::tempdir().unwrap();
    let samples = project_dir().join("datasets/samples");
    let (ok, _, stderr) = run_kiln(
        &[
            "--quiet",
            "ingest",
            "--dataset",
            "terminal-synth,toolbench-synth",
            "--decontaminate",
            samples.join("replay.jsonl").to_str().unwrap(),
            "--decontaminate",
            samples.join("terminal_heldout.jsonl").to_str().unwrap(),
            "--out",
            out.path().to_str().unwrap(),
        ],
        &[],
        &project_dir(),
    );
    assert!(ok, "{stderr}");
    let stats: Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("ingest.json")).unwrap()).unwrap();
    let manifest: Value = serde_json::from_str(&std::fs::read_to_string(samples.join("synth.json")).unwrap()).unwrap();
    assert_eq!(stats[0]["emitted"], manifest["train_conversations"]);
    assert_eq!(stats[1]["emitted"], manifest["toolbench_conversations"]);
    for s in stats.as_array().unwrap() {
        assert_eq!(s["dropped"], 0, "{s}");
        assert_eq!(s["contaminated"], 0, "{s}");
    }
    let lines = std::fs::read_to_string(out.path().join("conversations.jsonl")).unwrap();
    let first: kiln::data::Conversation = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert!(first.first_user_message().unwrap().contains("Task Description:"));
    assert!(first.messages[1].content.starts_with("<think>\n"));
}

#[test]
fn replay_records_follow_the_tb2lite_schema() {
    let samples = project_dir().join("datasets/samples");
    let text = std::fs::read_to_string(samples.join("replay.jsonl")).unwrap();
    let records: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(records.len() >= 50, "{} steps", records.len());
    let tasks: std::collections::BTreeSet<&str> = records.iter().map(|r| r["task_id"].as_str().unwrap()).collect();
    assert!(tasks.len() >= 20);
    for r in &records {
        for key in [
            "task_id",
            "sample_idx",
            "step_idx",
            "total_steps",
            "is_final_step",
            "source",
            "source_group",
            "messages",
            "prompt",
            "ref_raw",
            "ref_commands",
            "ref_command_units",
            "ref_analysis",
            "ref_plan",
            "ref_task_complete",
            "ref_parse_ok",
        ] {
            assert!(r.get(key).is_some(), "missing {key}");
        }
        let messages = r["messages"].as_array().unwrap();
        assert_eq!(messages.last().unwrap()["role"], "user", "history ends before the target turn");
        assert_eq!(messages.len(), 1 + 2 * r["step_idx"].as_u64().unwrap() as usize);
        // The reference action parses back out of ref_raw, and its units match the recorded ones.
        let raw = r["ref_raw"].as_str().unwrap();
        let json_part = &raw[raw.find('{').unwrap()..=raw.rfind('}').unwrap()];
        let action: Value = serde_json::from_str(json_part).unwrap();
        let keystrokes: Vec<String> = action["commands"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["keystrokes"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(serde_json::to_value(command_units(&keystrokes)).unwrap(), r["ref_command_units"]);
        assert!(!keystrokes.is_empty());
    }
    // The eval set indexes cleanly and none of its first messages equals a training one.
    let index = EvalIndex::load(&[samples.join("replay.jsonl")]).unwrap();
    assert!(index.len() >= 20);
}
