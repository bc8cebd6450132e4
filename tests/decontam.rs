//! Decontamination against the real TB2-lite eval set drops exactly the planted overlaps: by task name, by
//! the first user message after whitespace normalization, and nothing else (near misses stay).

mod common;

use std::io::Write;

use indicatif::ProgressBar;
use kiln::data::decontam::normalize_whitespace;
use kiln::data::ingest::ingest_source;
use kiln::data::recipe::SourceSpec;
use kiln::data::{EvalIndex, Format, SchemaMapping};
use serde_json::{Value, json};

fn eval_trajectories() -> Vec<Value> {
    let text =
        std::fs::read_to_string(common::shared_tb2lite().join("eval_dataset.jsonl")).expect("../shared/data/tb2lite");
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn row(task: &str, first_user: &str) -> Value {
    json!({"task": task, "trial_name": format!("{task}__x"), "conversations": [
        {"role": "user", "content": first_user}, {"role": "assistant", "content": "{}"}]})
}

#[test]
fn drops_exactly_the_planted_overlaps() {
    let eval = eval_trajectories();
    assert_eq!(eval.len(), 50);
    let first_user = |i: usize| eval[i]["conversations"][0]["content"].as_str().unwrap().to_string();
    let task = |i: usize| eval[i]["task"].as_str().unwrap().to_string();

    let mut rows = Vec::new();
    for i in 0..40 {
        rows.push(row(&format!("clean_task_{i}"), &format!("Task Description:\nDo clean thing {i}")));
    }
    // Planted: 3 by task name (different text), 2 by first message re-wrapped under another task name.
    for i in [0, 17, 49] {
        rows.push(row(&task(i), "a rewritten prompt that matches nothing"));
    }
    for i in [5, 30] {
        let rewrapped = first_user(i).split_whitespace().collect::<Vec<_>>().join("\n  ");
        rows.push(row(&format!("renamed_{i}"), &rewrapped));
    }
    // Near misses that must stay: one word changed, and a task name that only shares a prefix.
    let mut near = first_user(8);
    near.push_str(" (variant)");
    rows.push(row("near_miss_text", &near));
    rows.push(row(&format!("{}_v2", task(3)), "other text"));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.jsonl");
    let mut f = std::fs::File::create(&path).unwrap();
    for r in &rows {
        writeln!(f, "{r}").unwrap();
    }
    drop(f);

    let index = EvalIndex::load(&[
        common::shared_tb2lite().join("eval_dataset.jsonl"),
        common::shared_tb2lite().join("replay_full.jsonl"),
    ])
    .unwrap();
    let spec = SourceSpec {
        name: "terminal".into(),
        format: Format::Jsonl,
        hub: None,
        path: None,
        max_rows: None,
        weight: 1.0,
        license: None,
        schema: SchemaMapping { task: Some("task".into()), id: Some("trial_name".into()), ..Default::default() },
        off_schema_calls: Default::default(),
    };
    let mut kept = Vec::new();
    let stats = ingest_source(&spec, &[path], Some(&index), None, 0, &ProgressBar::hidden(), &mut |c| {
        kept.push(c);
        Ok(())
    })
    .unwrap();
    let d = &stats.decontamination;
    assert_eq!((d.dropped, d.by_task_name, d.by_first_user_message), (5, 3, 2));
    // Hits are reported by eval task: names for trajectories, task ids for replay steps.
    let expected: Vec<String> = vec![task(0), task(17), task(49), task(5), task(30)];
    let mut hit: Vec<&String> = d.eval_tasks_hit.keys().collect();
    hit.sort();
    let mut want: Vec<&String> = expected.iter().collect();
    want.sort();
    assert_eq!(hit, want);
    assert_eq!(kept.len(), rows.len() - 5);
    assert!(kept.iter().any(|c| c.task() == Some("near_miss_text")));
    assert_eq!(normalize_whitespace(" a \n\t b "), "a b");
}

#[test]
fn replay_steps_alone_catch_first_message_copies() {
    let index = EvalIndex::load(&[common::shared_tb2lite().join("replay_full.jsonl")]).unwrap();
    let replay = std::fs::read_to_string(common::shared_tb2lite().join("replay_full.jsonl")).unwrap();
    let first: Value = serde_json::from_str(replay.lines().next().unwrap()).unwrap();
    let text = first["messages"][0]["content"].as_str().unwrap();
    let conv = SchemaMapping::default().normalize(&row("some_task", text), "t", "t:0").unwrap();
    let hit = index.check(&conv).unwrap();
    assert_eq!(hit.eval_task, first["task_id"].as_str().unwrap());
}

#[test]
fn an_empty_eval_set_is_an_error_not_a_silent_pass() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.jsonl");
    std::fs::write(&path, "\n").unwrap();
    let err = EvalIndex::load(&[path]).unwrap_err().to_string();
    assert!(err.contains("empty.jsonl") && err.contains("no records"), "{err}");
}
