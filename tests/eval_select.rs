//! `kiln eval` of the tiny model on the synthetic replay set writes a complete result JSON, and `kiln select`
//! evaluates what has no usable result (none, a checkpoint changed since, measured otherwise) and picks the
//! planted better epoch with the spec's tie-breaks.

mod common;

use std::path::Path;

use common::{project_dir, run_kiln};
use serde_json::Value;

fn kiln(args: &[&str]) -> String {
    let (ok, _, stderr) = run_kiln(args, &[], &project_dir());
    assert!(ok, "{args:?}: {stderr}");
    stderr
}

fn init(out: &Path, seed: &str) {
    kiln(&["init-model", "--from", "configs/models/tiny", "--out", out.to_str().unwrap(), "--seed", seed]);
}

#[test]
fn eval_writes_a_complete_result() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    init(&model, "1");
    let out = dir.path().join("result.json");
    let stderr = kiln(&[
        "--quiet",
        "eval",
        "--checkpoint",
        model.to_str().unwrap(),
        "--replay",
        "datasets/samples/replay.jsonl",
        "--limit",
        "4",
        "--max-tokens",
        "8",
        "--batch-size",
        "3",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(stderr.contains("Score") && stderr.contains("s/step"), "{stderr}");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    for key in [
        "model",
        "model_path",
        "model_short",
        "eval_path",
        "timestamp",
        "load_time_sec",
        "gen_time_sec",
        "avg_sec_per_step",
        "sampling",
        "prompt_template",
        "aggregate",
        "per_step",
    ] {
        assert!(r.get(key).is_some(), "missing {key}");
    }
    assert_eq!(r["per_step"].as_array().unwrap().len(), 4);
    assert_eq!(r["prompt_template"]["template_status"], "chat_template");
    assert_eq!(r["prompt_template"]["rank_eligible"], true);
    assert!(r["prompt_template"]["prompt_tokens_max"].as_u64().unwrap() > 100);
    assert_eq!(r["sampling"]["max_tokens"], 8);
    let step = &r["per_step"][0];
    for key in [
        "task_id",
        "step_idx",
        "bucket",
        "source_group",
        "valid_json",
        "ref_command_units",
        "pred_command_units",
        "command_f1",
        "pred_preview",
        "finish_reason",
    ] {
        assert!(step.get(key).is_some(), "per_step missing {key}");
    }
    assert!(!step["ref_command_units"].as_array().unwrap().is_empty());
    assert_eq!(r["aggregate"]["steps"], 4);

    // A prompt longer than the context is refused before any generation.
    let err = run_kiln(
        &[
            "eval",
            "--checkpoint",
            model.to_str().unwrap(),
            "--replay",
            "datasets/samples/replay.jsonl",
            "--limit",
            "1",
            "--max-tokens",
            "9000",
        ],
        &[],
        &project_dir(),
    );
    assert!(!err.0 && err.2.contains("exceeds the context length 8192"), "{}", err.2);
    let eval_args = ["eval", "--checkpoint", model.to_str().unwrap(), "--replay", "datasets/samples/replay.jsonl"];
    let err = run_kiln(&[&eval_args[..], &["--devices", "0"]].concat(), &[], &project_dir());
    assert!(!err.0 && err.2.contains("eval on 0 devices: it needs at least 1"), "{}", err.2);
}

/// A result whose aggregate says `score` / `recall`.
fn planted(template: &Value, name: &str, score: f64, recall: f64) -> String {
    let mut r = template.clone();
    r["model"] = Value::String(name.into());
    r["aggregate"]["score"] = score.into();
    r["aggregate"]["avg_command_f1"] = (score / 100.0).into();
    r["aggregate"]["avg_command_recall"] = recall.into();
    serde_json::to_string(&r).unwrap()
}

#[test]
fn select_evaluates_what_is_missing_and_picks_the_better_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let base = dir.path().join("base");
    init(&base, "0");
    for (k, seed) in [(1, "1"), (2, "2"), (3, "3")] {
        init(&run.join("checkpoints").join(format!("epoch-{k}")), seed);
    }
    // A real result to plant numbers into.
    let template_path = dir.path().join("t.json");
    kiln(&[
        "--quiet",
        "eval",
        "--checkpoint",
        base.to_str().unwrap(),
        "--replay",
        "datasets/samples/replay.jsonl",
        "--limit",
        "2",
        "--max-tokens",
        "4",
        "--out",
        template_path.to_str().unwrap(),
    ]);
    let template: Value = serde_json::from_str(&std::fs::read_to_string(&template_path).unwrap()).unwrap();
    let eval_dir = run.join("eval");
    std::fs::create_dir_all(&eval_dir).unwrap();
    std::fs::write(eval_dir.join("base.json"), planted(&template, "base", 20.0, 0.2)).unwrap();
    std::fs::write(eval_dir.join("epoch-1.json"), planted(&template, "epoch-1", 52.30, 0.5431)).unwrap();
    std::fs::write(eval_dir.join("epoch-2.json"), planted(&template, "epoch-2", 50.48, 0.5296)).unwrap();
    // epoch-3 has no result: select evaluates it.
    let stderr = kiln(&[
        "--quiet",
        "select",
        "--run",
        run.to_str().unwrap(),
        "--base",
        base.to_str().unwrap(),
        "--replay",
        "datasets/samples/replay.jsonl",
        "--limit",
        "2",
        "--max-tokens",
        "4",
    ]);
    assert!(stderr.contains("evaluating epoch-3"), "{stderr}");
    assert!(eval_dir.join("epoch-3.json").is_file());
    let selection: Value = serde_json::from_str(&std::fs::read_to_string(run.join("selection.json")).unwrap()).unwrap();
    assert_eq!(selection["chosen"], "epoch-1");
    assert_eq!(selection["margin"], 1.82);
    assert_eq!(selection["candidates"].as_array().unwrap().len(), 4);
    assert!(selection["reason"].as_str().unwrap().contains("ahead of epoch-2 by Score"), "{}", selection["reason"]);
    assert_eq!(std::fs::read_link(run.join("best")).unwrap(), Path::new("checkpoints/epoch-1"));

    // Tied Scores: recall decides.
    std::fs::write(eval_dir.join("epoch-2.json"), planted(&template, "epoch-2", 52.30, 0.60)).unwrap();
    let (r, b) = (run.to_str().unwrap(), base.to_str().unwrap());
    let select = |max_tokens: &str| {
        let replay = "datasets/samples/replay.jsonl";
        kiln(&[
            "--quiet",
            "select",
            "--run",
            r,
            "--base",
            b,
            "--replay",
            replay,
            "--limit",
            "2",
            "--max-tokens",
            max_tokens,
        ])
    };
    let stderr = select("4");
    assert!(!stderr.contains("evaluating"), "every result is this select's measure: {stderr}");
    let selection: Value = serde_json::from_str(&std::fs::read_to_string(run.join("selection.json")).unwrap()).unwrap();
    assert_eq!(selection["chosen"], "epoch-2");
    assert!(selection["reason"].as_str().unwrap().contains("recall"), "{}", selection["reason"]);

    // A checkpoint written after its result is evaluated again, and only that one.
    init(&run.join("checkpoints/epoch-2"), "4");
    let stderr = select("4");
    assert!(stderr.contains("epoch-2 changed after") && stderr.matches("evaluating").count() == 1, "{stderr}");
    // Its model card, written after the result (the card stage does so), is not a change of the checkpoint.
    std::fs::write(run.join("checkpoints/epoch-2/README.md"), "# card\n").unwrap();
    std::fs::create_dir_all(run.join("checkpoints/epoch-2/card")).unwrap();
    let stderr = select("4");
    assert!(!stderr.contains("evaluating"), "{stderr}");
    // Choosing again removes the card of every epoch not chosen.
    let selection: Value = serde_json::from_str(&std::fs::read_to_string(run.join("selection.json")).unwrap()).unwrap();
    let card_kept = run.join("checkpoints/epoch-2/README.md").exists();
    assert_eq!(card_kept, selection["chosen"] == "epoch-2", "{selection}");
    assert_eq!(run.join("checkpoints/epoch-2/card").exists(), card_kept);
    // Results measured otherwise than this select asks (more new tokens) are evaluated again.
    let stderr = select("5");
    assert!(stderr.contains("epoch-1.json was measured otherwise (max_tokens 4 there, 5 now)"), "{stderr}");
    assert_eq!(stderr.matches("evaluating").count(), 4, "{stderr}");
    // Where nothing says how they should be measured (the pipeline's select stage), results measured unlike
    // each other are refused.
    let mut epoch_1: Value =
        serde_json::from_str(&std::fs::read_to_string(eval_dir.join("epoch-1.json")).unwrap()).unwrap();
    epoch_1["sampling"]["max_tokens"] = 6.into();
    std::fs::write(eval_dir.join("epoch-1.json"), epoch_1.to_string()).unwrap();
    let err = kiln::eval::select::select_run(&run, Some(&base), None, &mut |_, _| unreachable!(), &mut |_, _| {})
        .unwrap_err();
    assert!(
        err.contains("epoch-1.json and")
            && err.contains("base.json were measured differently (max_tokens 6 here, 5 there)"),
        "{err}"
    );
}

/// A run with no epoch checkpoint: select fails naming the run, and writes neither a selection nor `best`.
#[test]
fn select_without_epochs_names_the_run_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("empty-run");
    std::fs::create_dir_all(&run).unwrap();
    let (ok, _, stderr) = run_kiln(
        &["--quiet", "select", "--run", run.to_str().unwrap(), "--replay", "datasets/samples/replay.jsonl"],
        &[],
        &project_dir(),
    );
    assert!(!ok && stderr.contains("no epoch checkpoint") && stderr.contains("empty-run"), "{stderr}");
    assert!(!run.join("selection.json").exists() && !run.join("best").exists());
}

/// An eval stopped midway goes on from its journal: the batches it holds are taken as recorded (not decoded
/// again), the rest decoded and recorded after them, and the result is the uninterrupted eval's; a journal of
/// another identity is started afresh.
#[test]
fn a_stopped_eval_goes_on_from_its_finished_batches() {
    use kiln::eval::journal::Journal;
    use kiln::eval::run::{EvalOptions, evaluate};
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    init(&model, "1");
    let replay = project_dir().join("datasets/samples/replay.jsonl");
    let steps = kiln::eval::result::read_replay(&replay).unwrap();
    let opts = EvalOptions { max_tokens: 6, batch_size: 1, limit: Some(4), ..Default::default() };
    let steps = kiln::eval::run::select_steps(steps, &opts).unwrap();
    let path = dir.path().join("tiny.partial.jsonl");
    let eval = |journal: &mut Journal| {
        let workers = [Default::default()];
        evaluate::<kiln::backend::Cpu>("tiny", &model, &replay, &steps, &opts, false, &workers, Some(journal)).unwrap()
    };
    let previews = |r: &kiln::eval::result::EvalResult| -> Vec<String> {
        r.per_step.iter().map(|s| format!("{} {}", s.pred_preview, s.finish_reason)).collect()
    };
    let whole = eval(&mut Journal::open(&path, "a").unwrap());
    let recorded = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = recorded.lines().collect();
    assert_eq!(lines.len(), 5, "the identity and the four batches: {recorded}");

    // Stopped after two batches, the second's tokens replaced by none, and a third cut off mid-write.
    let mut second: Value = serde_json::from_str(lines[2]).unwrap();
    second["ids"] = serde_json::json!([[]]);
    let stopped_step = second["steps"][0].as_u64().unwrap() as usize;
    std::fs::write(&path, format!("{}\n{}\n{second}\n{}", lines[0], lines[1], &lines[3][..10])).unwrap();
    let resumed = eval(&mut Journal::open(&path, "a").unwrap());
    let (a, b) = (previews(&whole), previews(&resumed));
    for i in 0..4 {
        if i == stopped_step {
            assert_eq!(b[i], " length", "step {i} is the recorded (emptied) batch, not decoded again");
        } else {
            assert_eq!(a[i], b[i], "step {i}");
        }
    }
    assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 5, "two kept, two decoded and recorded");
    // The same journal complete: nothing is decoded, the result is what it holds.
    let again = eval(&mut Journal::open(&path, "a").unwrap());
    assert_eq!(previews(&again), b);
    // Another identity (another checkpoint or settings) decodes everything again.
    let fresh = eval(&mut Journal::open(&path, "b").unwrap());
    assert_eq!(previews(&fresh), a);
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `kiln eval` killed midway goes on from its journal beside the result (`<out>.partial.jsonl`): the next run
/// says how many batches it takes from there, ends with the uninterrupted eval's replies, and removes the
/// journal.
#[test]
fn kiln_eval_killed_midway_goes_on_from_its_journal() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    init(&model, "1");
    let out = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let (whole, stopped) = (out("whole.json"), out("stopped.json"));
    let args = |out: &str| {
        let m = model.to_str().unwrap();
        ["eval", "--checkpoint", m, "--replay", "datasets/samples/replay.jsonl", "--limit", "8", "--max-tokens", "64"]
            .into_iter()
            .chain(["--batch-size", "1", "--out"])
            .map(String::from)
            .chain([out.to_string()])
            .collect::<Vec<_>>()
    };
    kiln(&strs(&args(&whole)));
    assert!(!dir.path().join("whole.partial.jsonl").exists(), "the journal goes once the result is written");

    let journal = dir.path().join("stopped.partial.jsonl");
    kill_once_a_batch_is_recorded(&args(&stopped), &journal);
    assert!(!Path::new(&stopped).exists());

    let stderr = kiln(&strs(&args(&stopped)));
    let taken = batches_taken(&stderr);
    assert!((1..8).contains(&taken), "{taken} of 8 batches taken: {stderr}");
    assert_eq!(replies(Path::new(&stopped)), replies(Path::new(&whole)));
    assert!(!journal.exists());
}

/// `kiln select` keeps the eval stage's journal (`eval/<name>.partial.jsonl`) for what it evaluates: killed
/// midway, the next select goes on from it to the uninterrupted eval's replies. The identity beside the result
/// it replaces is replaced by the one it measured under.
#[test]
fn kiln_select_killed_midway_goes_on_from_its_journal() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let epoch = run.join("checkpoints/epoch-1");
    init(&epoch, "1");
    let settings =
        ["--replay", "datasets/samples/replay.jsonl", "--limit", "8", "--max-tokens", "64", "--batch-size", "1"];
    let whole = dir.path().join("whole.json");
    let (e, w) = (epoch.to_str().unwrap(), whole.to_str().unwrap());
    kiln(&[&["eval", "--checkpoint", e, "--out", w][..], &settings].concat());

    let select: Vec<String> =
        ["select", "--run", run.to_str().unwrap()].iter().chain(&settings).map(|s| s.to_string()).collect();
    let journal = run.join("eval/epoch-1.partial.jsonl");
    kill_once_a_batch_is_recorded(&select, &journal);
    let stale_identity = run.join("eval/epoch-1.identity");
    std::fs::write(&stale_identity, "an earlier eval stage's result\n").unwrap();

    let stderr = kiln(&strs(&select));
    let taken = batches_taken(&stderr);
    assert!((1..8).contains(&taken), "{taken} of 8 batches taken: {stderr}");
    assert_eq!(replies(&run.join("eval/epoch-1.json")), replies(&whole));
    assert!(!journal.exists());
    let identity = std::fs::read_to_string(&stale_identity).unwrap();
    assert!(identity.trim().len() == 64 && identity.trim().bytes().all(|b| b.is_ascii_hexdigit()), "{identity}");
}

/// Starts kiln with `args` and kills it once `journal` records a finished batch (its identity line and one more).
fn kill_once_a_batch_is_recorded(args: &[String], journal: &Path) {
    let mut child = std::process::Command::new(common::kiln_bin())
        .args(args)
        .current_dir(project_dir())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let finished_lines = || std::fs::read_to_string(journal).map_or(0, |t| t.matches('\n').count());
    while finished_lines() < 2 {
        assert!(child.try_wait().unwrap().is_none(), "the eval finished before it could be stopped");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// How many finished batches a resumed eval said it took from its journal.
fn batches_taken(stderr: &str) -> usize {
    stderr
        .split("going on after the ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no resume said: {stderr}"))
}

fn replies(result: &Path) -> Vec<Value> {
    let r: Value = serde_json::from_str(&std::fs::read_to_string(result).unwrap()).unwrap();
    r["per_step"].as_array().unwrap().iter().map(|s| s["pred_preview"].clone()).collect()
}
