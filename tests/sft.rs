//! `kiln sft` end to end on a fast variant of the offline default (a few conversations, a few eval steps):
//! every artifact and manifest is written, a run stopped during training resumes, a second run skips every
//! stage, and the card's figures are the eval and stats files' figures; a failed stage is never skipped,
//! and a run folder is one kiln's at a time. Also the early, clear failures.

mod common;

use std::path::{Path, PathBuf};

use common::{FakeHub, FakeRepo, READ_TOKEN, Tree, WRITE_TOKEN, project_dir, run_kiln, sha};
use serde_json::{Value, json};

const STAGES: [&str; 8] = ["pull", "prepare", "inspect", "train", "export", "eval", "select", "card"];

/// A pipeline file whose runs go into `dir`, and a model config like tiny.toml but small enough for CI.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    setup_model(dir, "tiny", "fast")
}

/// As `setup`, from `configs/models/<model>.toml`, written as `<name>.toml`.
fn setup_model(dir: &Path, model: &str, name: &str) -> (PathBuf, PathBuf) {
    let project = project_dir();
    let pipeline = std::fs::read_to_string(project.join("pipelines/sft.toml"))
        .unwrap()
        .replace("runs_dir = \"runs\"", &format!("runs_dir = \"{}\"", dir.join("runs").display()));
    let pipeline_path = dir.join("sft.toml");
    std::fs::write(&pipeline_path, pipeline).unwrap();
    let configs = dir.join("configs");
    std::fs::create_dir_all(&configs).unwrap();
    let abs = |p: &str| project.join(p).display().to_string();
    let local = format!("configs/models/{model}");
    let tiny = std::fs::read_to_string(project.join(format!("configs/models/{model}.toml")))
        .unwrap()
        .replace(&format!("name = \"{model}\""), &format!("name = \"{name}\""))
        .replace(&format!("local = \"{local}\""), &format!("local = \"{}\"", abs(&local)))
        .replace("\"datasets/samples/replay.jsonl\"", &format!("\"{}\"", abs("datasets/samples/replay.jsonl")))
        .replace(
            "\"datasets/samples/terminal_heldout.jsonl\"",
            &format!("\"{}\"", abs("datasets/samples/terminal_heldout.jsonl")),
        )
        .replace("terminal-synth = 0.4, toolbench-synth = 0.4", "terminal-synth = 0.03, toolbench-synth = 0.03")
        .replace("max_tokens = 256", "max_tokens = 16\nlimit = 3")
        // A share that holds out a few of the few conversations.
        .replace("validation_share = 0.05", "validation_share = 0.3");
    assert!(
        tiny.contains("limit = 3") && tiny.contains("0.03") && tiny.contains("validation_share = 0.3"),
        "{model}.toml changed shape: update this test"
    );
    std::fs::write(configs.join(format!("{name}.toml")), tiny).unwrap();
    (pipeline_path, configs)
}

/// The Qwen3.5 architecture through every stage: a CI-sized tiny-qwen3.5 is initialized, trained, exported
/// as a Qwen3.5 checkpoint each epoch, evaluated and carded.
#[test]
fn a_qwen3_5_model_runs_the_whole_pipeline() {
    assert_the_architecture_runs_the_whole_pipeline("tiny-qwen3.5", "fastqwen", "qwen3_5_text", "qwen3_5");
}

/// The same for Gemma 4 (tiny-gemma4: sliding-window layers, per-layer embeddings, shared keys and values,
/// the logit soft-cap in the training loss and in decoding).
#[test]
fn a_gemma4_model_runs_the_whole_pipeline() {
    assert_the_architecture_runs_the_whole_pipeline("tiny-gemma4", "fastgemma", "gemma4_text", "gemma4");
}

/// The same for LFM2-MoE (tiny-moe: dense layers, then MoE layers with the expert bias), whose routing load
/// goes into every step's metrics, every validation point and the card.
#[test]
fn an_lfm2_moe_model_runs_the_whole_pipeline() {
    let (_dir, run, stderr) =
        assert_the_architecture_runs_the_whole_pipeline("tiny-moe", "fastmoe", "lfm2_moe", "lfm2_moe");
    let train_line = stderr.lines().find(|l| l.contains("train    done")).unwrap_or_default();
    assert!(train_line.contains(", expert MaxVio ") && train_line.contains(" (base) → "), "{stderr}");
    let metrics = std::fs::read_to_string(run.join("train/metrics.jsonl")).unwrap();
    for line in metrics.lines() {
        let m: Value = serde_json::from_str(line).unwrap();
        assert!(m["experts"]["max_vio"].as_f64().is_some_and(|v| (0.0..=7.0).contains(&v)), "{line}");
    }
    let validation = std::fs::read_to_string(run.join("train/validation.jsonl")).unwrap();
    let layers: Vec<Vec<String>> = validation
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["expert_tokens"].as_object().unwrap().keys().cloned().collect()
        })
        .collect();
    assert_eq!(layers.len(), 3, "base, epoch-1, epoch-2");
    assert!(layers.iter().all(|l| l == &["2", "3", "4", "5"]), "{layers:?}");
    // TensorBoard shows the routing's MaxVio among the curves.
    let shown = kiln::train::tensorboard::scalars_as_shown(&run.join("train")).unwrap();
    assert_eq!(shown["validation/expert_max_vio"].len(), 3);
    assert_eq!(shown["train/expert_max_vio"].len(), metrics.lines().count());
    let md = std::fs::read_to_string(run.join("README.md")).unwrap();
    assert!(
        md.contains("| checkpoint | MaxVio, mean over layers | least even layer | experts given no token |"),
        "{md}"
    );
    assert!(md.contains("| base | ") && md.contains(" of 32 |"), "{md}");
    assert!(md.contains("| MoE expert bias | kept as the base model had it (no balancing, as transformers) |"), "{md}");
}

/// A CI-sized `model` (as `name`) is initialized, trained with a falling loss, exported as a `model_type`
/// checkpoint each epoch, evaluated and carded with the `architecture` tag; returns the folder that holds the
/// run (removed when dropped), the run's, and what the run printed.
fn assert_the_architecture_runs_the_whole_pipeline(
    model: &str,
    name: &str,
    model_type: &str,
    architecture: &str,
) -> (tempfile::TempDir, PathBuf, String) {
    let dir = tempfile::tempdir().unwrap();
    let (pipeline, configs) = setup_model(dir.path(), model, name);
    let (p, c) = (pipeline.to_str().unwrap(), configs.to_str().unwrap());
    let args = ["--quiet", "sft", "--model", name, "--device", "cpu", "--pipeline", p, "--configs-dir", c];
    let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
    assert!(ok, "{stderr}");
    let run = dir.path().join("runs").join(name);
    for stage in STAGES {
        assert!(run.join(format!("manifests/{stage}.json")).is_file(), "{stage}");
    }
    for epoch in ["epoch-1", "epoch-2"] {
        let config = json(&run.join(format!("checkpoints/{epoch}/config.json")));
        assert_eq!(config["model_type"], model_type, "{epoch}");
        let result = json(&run.join(format!("eval/{epoch}.json")));
        assert_eq!(result["aggregate"]["steps"], 3, "{epoch}");
    }
    let metrics = std::fs::read_to_string(run.join("train/metrics.jsonl")).unwrap();
    let losses: Vec<f64> =
        metrics.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["loss"].as_f64().unwrap()).collect();
    assert!(losses.iter().all(|l| l.is_finite()) && losses.len() >= 4, "{losses:?}");
    let first = losses[..2].iter().sum::<f64>() / 2.0;
    let last = losses[losses.len() - 2..].iter().sum::<f64>() / 2.0;
    assert!(last < first, "training does not lower the loss: {first} → {last}");
    let md = std::fs::read_to_string(run.join("README.md")).unwrap();
    assert!(md.contains(&format!("- {architecture}\n")), "{md}");
    // TensorBoard: the steps and measures in train/, and the Scores in eval/ at the steps their checkpoints
    // were taken (validation.jsonl's labels say which).
    common::training::assert_events_show_the_records(&run);
    let points = kiln::train::validation::read_points(&run.join("train/validation.jsonl")).unwrap();
    let step_of = |name: &str| points.iter().find(|p| p.checkpoint.as_deref() == Some(name)).unwrap().step as i64;
    let candidates = json(&run.join("selection.json"))["candidates"].as_array().unwrap().clone();
    let scores: Vec<(i64, f32)> = candidates
        .iter()
        .map(|c| (step_of(c["name"].as_str().unwrap()), c["score"].as_f64().unwrap() as f32))
        .collect();
    assert_eq!(scores.len(), 3, "base, epoch-1, epoch-2");
    let shown = kiln::train::tensorboard::scalars_as_shown(&run.join("eval")).unwrap();
    assert_eq!(shown["eval/score"], scores);
    assert_eq!(shown.len(), 6, "{:?}", shown.keys());
    (dir, run, stderr)
}

/// A checkpoint served from a loopback Hub: `hubtiny.toml` is fast.toml with `hub = "kiln-test/tiny-lfm2"`.
#[test]
fn a_hub_model_is_pulled_trained_and_carded_with_its_license() {
    let dir = tempfile::tempdir().unwrap();
    let (pipeline, configs) = setup(dir.path());
    let ckpt = dir.path().join("ckpt");
    let (ok, _, stderr) = run_kiln(
        &["init-model", "--from", "configs/models/tiny", "--out", ckpt.to_str().unwrap(), "--seed", "3"],
        &[],
        &project_dir(),
    );
    assert!(ok, "{stderr}");
    let mut files: Tree = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect();
    files.insert("README.md".into(), b"---\nlicense: other\nlicense_name: test\n---\n# tiny\n".to_vec());
    // A base that samples by default: the eval stays greedy, and the card says both.
    files
        .insert("generation_config.json".into(), br#"{"do_sample": true, "temperature": 0.6, "top_p": 0.95}"#.to_vec());
    let commit = sha("tiny-lfm2");
    let repos = [(("models".to_string(), "kiln-test/tiny-lfm2".to_string()), FakeRepo::single(&commit, files))];
    let hub = FakeHub::start(repos.into_iter().collect());
    let fast = std::fs::read_to_string(configs.join("fast.toml")).unwrap();
    let local_line = fast.lines().find(|l| l.starts_with("local = ")).unwrap();
    let hubtiny = fast
        .replace("name = \"fast\"", "name = \"hubtiny\"")
        .replace(local_line, "hub = \"kiln-test/tiny-lfm2\"\nrevision = \"main\"")
        .replace("license = \"apache-2.0\"", "license = \"apache-2.0\"  # the base README's wins");
    std::fs::write(configs.join("hubtiny.toml"), hubtiny).unwrap();
    let home = dir.path().join("hf");
    let (p, c) = (pipeline.to_str().unwrap(), configs.to_str().unwrap());
    let env = [("HF_ENDPOINT", hub.url.as_str()), ("HF_HOME", home.to_str().unwrap()), ("HF_TOKEN", WRITE_TOKEN)];
    let publish = ["--set", "publish_repo=kiln-tester/hubtiny-terminal", "--set", "push=true"];
    let args = ["--quiet", "sft", "--model", "hubtiny", "--device", "cpu", "--pipeline", p, "--configs-dir", c];
    // A token that may not write there stops the run before anything is pulled: whoami says so.
    let read_only = [env[0], env[1], ("HF_TOKEN", READ_TOKEN)];
    let (ok, _, stderr) = run_kiln(&[&args[..], &publish].concat(), &read_only, &project_dir());
    assert!(!ok && stderr.contains("stage push:") && stderr.contains("it is a read token"), "{stderr}");
    assert_eq!(hub.requests.load(std::sync::atomic::Ordering::SeqCst), 1, "whoami alone");
    // The plan names the account that will push, and the token.
    let (ok, _, stderr) = run_kiln(&[&args[1..], &publish, &["--dry-run"]].concat(), &env, &project_dir());
    assert!(
        ok && stderr.contains("push: to kiln-tester/hubtiny-terminal as 'kiln-tester' (a write token, from HF_TOKEN)"),
        "{stderr}"
    );
    let (ok, _, stderr) = run_kiln(&[&args[..], &publish].concat(), &env, &project_dir());
    assert!(ok, "{stderr}");
    let run = dir.path().join("runs/hubtiny");

    // The push stage uploaded the selected checkpoint, its own card (loading from the repo) included.
    let pushed = hub.model_tree("kiln-tester/hubtiny-terminal", "main").expect("the repo was created");
    let record = json(&run.join("push.json"));
    let best_files: Vec<String> =
        record["files"].as_array().unwrap().iter().map(|f| f["path"].as_str().unwrap().to_string()).collect();
    assert!(best_files.contains(&"model.safetensors".to_string()) && best_files.contains(&"card/loss.png".to_string()));
    for path in &best_files {
        assert_eq!(&pushed[path], &std::fs::read(run.join("best").join(path)).unwrap(), "{path}");
    }
    let card = String::from_utf8(pushed["README.md"].clone()).unwrap();
    assert!(card.contains("path = \"kiln-tester/hubtiny-terminal\""), "{card}");
    assert!(
        stderr.contains("sft: the selected checkpoint is on the Hub as ")
            && stderr.contains(record["url"].as_str().unwrap()),
        "{stderr}"
    );
    // Again: nothing changed, nothing pushed.
    let served = hub.requests.load(std::sync::atomic::Ordering::SeqCst);
    let (ok, _, stderr) = run_kiln(&[&args[..], &publish].concat(), &env, &project_dir());
    assert!(ok && stderr.contains("0 stages run, 9 skipped"), "{stderr}");
    let whoami_and_pull = hub.requests.load(std::sync::atomic::Ordering::SeqCst) - served;
    assert_eq!(whoami_and_pull, 1, "the token check alone");
    // A card written again (its reproduce command changed) is pushed again, as a commit on top of the first.
    let rewritten = [&args[..], &publish, &["--set", "eval.scorer=\"v2\""]].concat();
    let (ok, _, stderr) = run_kiln(&rewritten, &env, &project_dir());
    assert!(ok && stderr.contains("2 stages run, 7 skipped"), "{stderr}");
    let again = json(&run.join("push.json"));
    assert_eq!((&again["parent"], &again["deleted"]), (&record["commit"], &serde_json::json!([])));
    assert_ne!(again["commit"], record["commit"]);
    assert_eq!(again["sent"], serde_json::json!(["README.md"]), "the card alone, not the weights again");
    // Pushed again with nothing changed: no empty commit.
    let (ok, _, stderr) = run_kiln(&[&rewritten[..], &["--from", "push"]].concat(), &env, &project_dir());
    assert!(ok && stderr.contains("already holds these") && stderr.contains("files at its head"), "{stderr}");
    let same = json(&run.join("push.json"));
    assert_eq!((&same["commit"], &same["unchanged"]), (&again["commit"], &Value::Bool(true)));
    let key = ("models".to_string(), "kiln-tester/hubtiny-terminal".to_string());
    let head = hub.repos.lock().unwrap()[&key].refs["main"].clone();
    assert_eq!(head, again["commit"].as_str().unwrap(), "no new commit");
    let pulled = json(&run.join("pull.json"));
    assert_eq!(pulled[0]["commit"], commit.as_str());
    let base = json(&run.join("manifests/pull.json"))["counts"]["base_model"].as_str().unwrap().to_string();
    assert!(base.contains(&format!("snapshots/{commit}")), "{base}");
    assert!(!run.join("base").exists(), "a Hub model is used from the cache, not copied");
    let md = std::fs::read_to_string(run.join("README.md")).unwrap();
    assert!(md.contains("license: other\n") && md.contains("base_model: kiln-test/tiny-lfm2"), "{md}");
    assert!(json(&run.join("eval/epoch-2.json"))["aggregate"]["steps"] == 3);
    let own = std::fs::read_to_string(run.join("best/README.md")).unwrap();
    assert!(own.contains("license: other\n") && own.contains("base_model: kiln-test/tiny-lfm2"), "{own}");
    for card in [&md, &own] {
        assert!(card.contains("sets `generate()` to sampling (temperature 0.6, top-k 50, top-p 0.95)"), "{card}");
    }

    // A second stage from that checkpoint reads its card: the Hub model it came from and that model's license
    // (fast.toml says apache-2.0).
    let best = run.join("best");
    let b = best.to_str().unwrap();
    let (ok, stderr) =
        sft(&pipeline, &configs, &["--base", b, "--run", "hub-2", "--epochs", "1", "--set", "eval.limit=1"]);
    assert!(ok, "{stderr}");
    let md = std::fs::read_to_string(dir.path().join("runs/hub-2/README.md")).unwrap();
    assert!(md.contains("license: other\n") && md.contains("base_model: kiln-test/tiny-lfm2\n"), "{md}");
    assert!(md.contains(&format!("Full fine-tune of the checkpoint `{b}`, itself a fine-tune of kiln-test/tiny-lfm2")));
}

fn sft(pipeline: &Path, configs: &Path, extra: &[&str]) -> (bool, String) {
    let mut args = vec!["--quiet", "sft", "--model", "fast", "--device", "cpu"];
    let (p, c) = (pipeline.to_str().unwrap(), configs.to_str().unwrap());
    args.extend(["--pipeline", p, "--configs-dir", c]);
    args.extend(extra);
    let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
    (ok, stderr)
}

/// `kiln sft --dry-run`'s plan (stdout), after checking that its stderr says nothing was run or written.
fn dry_run(pipeline: &Path, configs: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["sft", "--model", "fast", "--device", "cpu", "--dry-run"];
    let (p, c) = (pipeline.to_str().unwrap(), configs.to_str().unwrap());
    args.extend(["--pipeline", p, "--configs-dir", c]);
    args.extend(extra);
    let (ok, stdout, stderr) = run_kiln(&args, &[], &project_dir());
    assert!(ok && stderr.contains("nothing was run or written"), "{stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// The stages of a dry run's plan with the action `action`, each with its reasons (null where it has none).
fn planned(plan: &Value, action: &str) -> Vec<(String, Value)> {
    let stages = plan["stages"].as_array().unwrap();
    stages
        .iter()
        .filter(|s| s["action"] == action)
        .map(|s| (s["stage"].as_str().unwrap().to_string(), s["reasons"].clone()))
        .collect()
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// The cells of the markdown table row starting with `| <first> |`.
fn table_row(md: &str, first: &str) -> Vec<String> {
    let line = md.lines().find(|l| l.starts_with(&format!("| {first} |"))).unwrap_or_else(|| panic!("no row {first}"));
    line.trim_matches('|').split(" | ").map(|c| c.trim().to_string()).collect()
}

/// The selected checkpoint's own card: the run card's front matter and tables, loading from the checkpoint,
/// with its figures beside it and no link out of the folder; no other epoch has one.
fn check_checkpoint_card(run: &Path) {
    let chosen = json(&run.join("selection.json"))["chosen"].as_str().unwrap().to_string();
    let (md, own) = (
        std::fs::read_to_string(run.join("README.md")).unwrap(),
        std::fs::read_to_string(run.join("best/README.md")).unwrap(),
    );
    let front = |md: &str| md.split("\n---\n").next().unwrap().to_string();
    assert_eq!(front(&own), front(&md));
    assert_eq!(table_row(&own, &chosen), table_row(&md, &chosen));
    assert!(own.contains(&format!("These weights are the run's `{chosen}`")), "{own}");
    assert!(own.contains(&format!("path = \"{}\"", run.join("best").display())), "{own}");
    assert!(!own.contains("](report/") && own.contains(&run.join("report/index.html").display().to_string()));
    for png in ["loss.png", "scores.png"] {
        assert_eq!(
            std::fs::read(run.join("best/card").join(png)).unwrap(),
            std::fs::read(run.join("card").join(png)).unwrap()
        );
    }
    for other in std::fs::read_dir(run.join("checkpoints")).unwrap().map(|e| e.unwrap().path()) {
        if !other.ends_with(&chosen) {
            assert!(!other.join("README.md").exists() && !other.join("card").exists(), "{}", other.display());
        }
    }
}

fn check_card(run: &Path) {
    check_checkpoint_card(run);
    let md = std::fs::read_to_string(run.join("README.md")).unwrap();
    let front = md.strip_prefix("---\n").and_then(|b| b.split_once("\n---\n")).expect("YAML front matter").0;
    for key in
        ["language:", "library_name: transformers", "pipeline_tag: text-generation", "license: apache-2.0", "tags:"]
    {
        assert!(front.contains(key), "front matter lacks {key}:\n{front}");
    }
    let selection = json(&run.join("selection.json"));
    for name in ["base", "epoch-1", "epoch-2"] {
        let e = json(&run.join("eval").join(format!("{name}.json")));
        let a = &e["aggregate"];
        let f = |k: &str| a[k].as_f64().unwrap();
        let row = table_row(&md, name);
        assert_eq!(row[1], format!("{:.2}", f("score")), "{name} Score");
        assert_eq!(row[2], format!("{:.4}", f("avg_command_f1")));
        assert_eq!(row[3], format!("{:.4}", f("avg_command_precision")));
        assert_eq!(row[4], format!("{:.4}", f("avg_command_recall")));
        assert_eq!(row[5], format!("{:.1} %", f("first_cmd_exact_pct")));
        assert_eq!(row[6], format!("{:.1} %", f("valid_json_pct")));
        assert_eq!(row[7], format!("{:.3}", e["avg_sec_per_step"].as_f64().unwrap()));
        assert_eq!(row[8], format!("{} / {}", a["steps"], a["tasks"]));
        assert_eq!(row[9], e["prompt_template"]["template_status"].as_str().unwrap());
    }
    assert!(md.contains(&format!("**Selected: {}.**", selection["chosen"].as_str().unwrap())));
    let stats = json(&run.join("data/stats.json"));
    let row = table_row(&md, "samples / tokens / supervised tokens");
    assert!(
        row[1].starts_with(&format!("{} / {} / {} (", stats["samples"], stats["tokens"], stats["supervised_tokens"])),
        "{row:?}"
    );
    let ingest = json(&run.join("data/ingest.json"));
    let terminal = &ingest[0]["sources"][0];
    let row = table_row(&md, "terminal-synth");
    assert_eq!(row[2], terminal["rows_read"].to_string());
    assert_eq!(row[4], terminal["emitted"].to_string());
    let summary = json(&run.join("report/summary.json"));
    assert_eq!(table_row(&md, "conversations")[1], summary["conversations"]["total"].to_string());

    // The validation split: held out in prepare, measured for the base model and each epoch, in the card.
    let held = &stats["validation"];
    assert!(held["conversations"].as_u64().unwrap() > 0, "{held}");
    assert_eq!(summary["validation"], *held);
    let row = table_row(&md, "validation split");
    assert!(row[1].starts_with(&format!("{} conversations held out by task", held["conversations"])), "{row:?}");
    let points: Vec<Value> = std::fs::read_to_string(run.join("train/validation.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let labels: Vec<&str> = points.iter().map(|p| p["checkpoint"].as_str().unwrap()).collect();
    assert_eq!(labels, ["base", "epoch-1", "epoch-2"]);
    for p in &points {
        let row = table_row(&md, p["checkpoint"].as_str().unwrap());
        assert_eq!(row.last().unwrap(), &format!("{:.4}", p["loss"].as_f64().unwrap()), "{row:?}");
        assert_eq!(p["supervised_tokens"], held["supervised_tokens"], "every held-out target is measured");
    }
    assert!(points[2]["loss"].as_f64().unwrap() < points[0]["loss"].as_f64().unwrap(), "{points:?}");
    // By source: the held-out terminal and toolbench conversations, their counts adding up, in their own table.
    let sources = points[0]["sources"].as_object().unwrap();
    let counts: Vec<u64> = sources.values().map(|s| s["supervised_tokens"].as_u64().unwrap()).collect();
    assert_eq!(counts.iter().sum::<u64>(), held["supervised_tokens"].as_u64().unwrap());
    assert_eq!(sources.keys().collect::<Vec<_>>(), ["terminal", "toolbench"]);
    let header = md.lines().skip_while(|l| !l.starts_with("The validation loss by data source")).nth(2).unwrap();
    let expected: Vec<String> = std::iter::once("checkpoint".to_string())
        .chain(counts.iter().zip(sources.keys()).map(|(n, s)| format!("{s} ({n} tokens)")))
        .collect();
    assert_eq!(header, format!("| {} |", expected.join(" | ")));
    let by_source: Vec<&str> = md.lines().skip_while(|l| *l != header).skip(2).take(3).collect();
    for (line, p) in by_source.iter().zip(&points) {
        let cells: Vec<String> =
            sources.keys().map(|s| format!("{:.4}", p["sources"][s]["loss"].as_f64().unwrap())).collect();
        assert_eq!(*line, format!("| {} | {} |", p["checkpoint"].as_str().unwrap(), cells.join(" | ")));
    }
    assert!(md.contains("](card/loss.png)") && md.contains("](card/scores.png)") && md.contains("report/index.html"));
    // The command that makes the whole run: not how the last invocation chose its stages or its output.
    let reproduce = md.lines().skip_while(|l| *l != "## Reproduce").nth(3).unwrap_or_default();
    assert!(reproduce.starts_with("kiln sft --model fast --device cpu --pipeline "), "{md}");
    for png in ["loss", "scores"] {
        let file = std::fs::File::open(run.join("card").join(format!("{png}.png"))).unwrap();
        let info = png::Decoder::new(std::io::BufReader::new(file)).read_info().unwrap().info().clone();
        assert_eq!((info.width, info.height), (800, 360));
    }
}

#[test]
fn the_pipeline_runs_resumes_skips_and_documents() {
    let dir = tempfile::tempdir().unwrap();
    let (pipeline, configs) = setup(dir.path());
    let run = dir.path().join("runs/fast");

    // A dry run of a new run: every stage would run for the first time; nothing is written.
    let plan = dry_run(&pipeline, &configs, &[]);
    let first: Vec<(String, Value)> = STAGES.iter().map(|s| (s.to_string(), json!(["not run here before"]))).collect();
    assert_eq!(planned(&plan, "run"), first, "{plan}");
    assert_eq!(plan["stages"][8]["action"], "off", "push: {plan}");
    assert!(!dir.path().join("runs").exists(), "a dry run writes nothing");

    // A state trained from another base model (here the run folder's first model had another init seed) is
    // not resumed: the training starts over.
    let config = configs.join("fast.toml");
    let fast = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, fast.replace("init_seed = 0", "init_seed = 1")).unwrap();
    let (ok, stderr) = sft(&pipeline, &configs, &["--halt-after", "1"]);
    assert!(!ok && stderr.contains("run the same command again to resume"), "{stderr}");
    std::fs::write(&config, &fast).unwrap();

    // Stopped during training (as Ctrl-C would): the state is saved and the error says how to go on.
    let (ok, stderr) = sft(&pipeline, &configs, &["--halt-after", "2"]);
    assert!(stderr.contains("train/state was trained from another base model: starting over"), "{stderr}");
    assert!(!ok && stderr.contains("run the same command again to resume"), "{stderr}");
    for stage in ["pull", "prepare", "inspect"] {
        assert!(run.join("manifests").join(format!("{stage}.json")).is_file(), "{stage}");
    }
    assert!(!run.join("manifests/train.json").exists());
    assert!(run.join("train/state/position.json").is_file());

    let (ok, stderr) = sft(&pipeline, &configs, &[]);
    assert!(ok, "{stderr}");
    for stage in ["pull", "prepare", "inspect"] {
        assert!(stderr.contains(&format!("{stage:<8} up to date")), "{stage} should be skipped:\n{stderr}");
    }
    assert!(stderr.contains("resuming from"), "{stderr}");
    let metrics: Vec<Value> = std::fs::read_to_string(run.join("train/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<u64> = metrics.iter().map(|m| m["step"].as_u64().unwrap()).collect();
    let rows = json(&run.join("data/stats.json"))["rows"].as_u64().unwrap();
    let batch = json(&run.join("sft.json"))["config"]["train"]["global_batch"].as_u64().unwrap();
    assert_eq!(steps, (0..2 * rows.div_ceil(batch)).collect::<Vec<_>>(), "every step once, as if never stopped");

    for path in [
        "sft.json",
        "pull.json",
        "base/model.safetensors",
        "data/stats.json",
        "report/index.html",
        "report/summary.md",
        "train/summary.json",
        "checkpoints/epoch-1/model.safetensors",
        "checkpoints/epoch-2/chat_template.jinja",
        "eval/base.json",
        "eval/epoch-1.json",
        "eval/epoch-2.json",
        "selection.json",
        "best/config.json",
        "README.md",
    ] {
        assert!(run.join(path).exists(), "missing {path}");
    }
    for stage in STAGES {
        let m = json(&run.join("manifests").join(format!("{stage}.json")));
        assert_eq!(m["stage"], stage);
        assert_eq!(m["fingerprint"].as_str().unwrap().len(), 64);
        assert!(m["wall_seconds"].as_f64().unwrap() >= 0.0);
        for output in m["outputs"].as_array().unwrap() {
            assert!(run.join(output.as_str().unwrap()).exists(), "{stage}: {output}");
        }
    }
    let prepare = json(&run.join("manifests/prepare.json"));
    assert!(prepare["inputs"].as_object().unwrap().keys().any(|k| k.starts_with("source/")), "{prepare}");
    check_card(&run);

    // Nothing changed: every stage is skipped, as the dry run says.
    let plan = dry_run(&pipeline, &configs, &[]);
    assert_eq!(planned(&plan, "skip").len(), 8, "{plan}");
    let (ok, stderr) = sft(&pipeline, &configs, &[]);
    assert!(ok && stderr.contains("0 stages run, 8 skipped"), "{stderr}");

    // `kiln card` rewrites the same card from the run's files.
    let before = std::fs::read_to_string(run.join("README.md")).unwrap();
    let (ok, _, stderr) = run_kiln(&["card", "--run", run.to_str().unwrap()], &[], &project_dir());
    assert!(ok, "{stderr}");
    assert_eq!(std::fs::read_to_string(run.join("README.md")).unwrap(), before);
    // A metrics line that is not a step stops the card (its tokens would be missing from it), naming the line.
    let metrics = run.join("train/metrics.jsonl");
    let good = std::fs::read_to_string(&metrics).unwrap();
    std::fs::write(&metrics, format!("{good}garbage\n")).unwrap();
    let (ok, _, stderr) = run_kiln(&["card", "--run", run.to_str().unwrap()], &[], &project_dir());
    let line = good.lines().count() + 1;
    assert!(!ok && stderr.contains(&format!("metrics.jsonl: line {line}: expected value")), "{stderr}");
    assert_eq!(std::fs::read_to_string(run.join("README.md")).unwrap(), before);
    std::fs::write(&metrics, good).unwrap();

    // The published name goes into the checkpoint's own card only: the card alone is written again.
    let (ok, stderr) = sft(&pipeline, &configs, &["--set", "publish_repo=me/fast-sft"]);
    assert!(ok && stderr.contains("1 stages run, 7 skipped"), "{stderr}");
    let published = std::fs::read_to_string(run.join("best/README.md")).unwrap();
    assert!(
        published.contains("path = \"me/fast-sft\"") && published.contains("vllm serve me/fast-sft "),
        "{published}"
    );
    let run_card = std::fs::read_to_string(run.join("README.md")).unwrap();
    assert!(run_card.contains(&format!("path = \"{}\"", run.join("best").display())), "loads from best/: {run_card}");
    let (ok, stderr) = sft(&pipeline, &configs, &["--set", "publish_repo=fast-sft"]);
    assert!(!ok && stderr.contains("publish_repo 'fast-sft' is not a Hub repo id (owner/name)"), "{stderr}");
    // A push asked for without a repo, or without a token, stops before any stage runs.
    let (ok, stderr) = sft(&pipeline, &configs, &["--set", "push=true"]);
    assert!(!ok && stderr.contains("push = true needs publish_repo"), "{stderr}");
    let (ok, stderr) = sft(&pipeline, &configs, &["--set", "publish_repo=me/fast-sft", "--set", "push=true"]);
    assert!(!ok && stderr.contains("stage push: pushing to model repo 'me/fast-sft' needs a Hub token"), "{stderr}");
    assert!(!stderr.contains("running"), "{stderr}");

    // A changed eval setting reruns eval and what follows it, nothing before; the dry run and the run say why,
    // and the dry run leaves every manifest as it was.
    let text = std::fs::read_to_string(&config).unwrap().replace("limit = 3", "limit = 2");
    std::fs::write(&config, text).unwrap();
    let manifests = |run: &Path| -> Vec<Vec<u8>> {
        STAGES.iter().map(|s| std::fs::read(run.join("manifests").join(format!("{s}.json"))).unwrap()).collect()
    };
    let before = manifests(&run);
    let plan = dry_run(&pipeline, &configs, &[]);
    let mut why = planned(&plan, "run");
    // The card runs for what the last run set, too: the published repo, in the command and on its own.
    let card = why.pop().unwrap();
    assert_eq!(
        (card.0.as_str(), &card.1[0], &card.1[2]),
        ("card", &json!("select runs first"), &json!("publish_repo \"me/fast-sft\" → null"))
    );
    let command = card.1[1].as_str().unwrap();
    assert!(
        command.starts_with("command \"…") && command.contains("--set 'publish_repo=me/fast-sft'\" → \"…"),
        "{plan}"
    );
    let why_not_card = [("eval", json!(["eval.limit 3 → 2"])), ("select", json!(["eval runs first"]))];
    assert_eq!(why, why_not_card.map(|(s, r)| (s.to_string(), r)), "{plan}");
    assert_eq!(manifests(&run), before);
    let (ok, stderr) = sft(&pipeline, &configs, &[]);
    assert!(ok && stderr.contains("3 stages run, 5 skipped") && !stderr.contains("kept from before"), "{stderr}");
    for line in
        ["eval     running: eval.limit 3 → 2", "select   running: eval ran again", "card     running: select ran again"]
    {
        assert!(stderr.contains(line), "{line}: {stderr}");
    }
    // `--from` forces its stage and those after it; a stage before it whose settings changed since it ran is
    // refused (the run would document settings its outputs were not made with), before anything is written.
    let plan = dry_run(&pipeline, &configs, &["--from", "export"]);
    let forced = planned(&plan, "run");
    assert_eq!(forced.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(), ["export", "eval", "select", "card"]);
    assert_eq!(
        (&forced[0].1, &forced[1].1),
        (&json!(["--from export"]), &json!(["--from export", "export runs first"]))
    );
    let kept = (manifests(&run), std::fs::read(run.join("sft.json")).unwrap());
    for dry in [true, false] {
        let mut args = vec!["sft", "--model", "fast", "--device", "cpu", "--from", "export", "--set", "train.lr=0.001"];
        args.extend(["--pipeline", pipeline.to_str().unwrap(), "--configs-dir", configs.to_str().unwrap()]);
        args.extend(dry.then_some("--dry-run"));
        let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
        let refusal = "stage train: is out of date in";
        let why = "(train.lr 0.004 → 0.001): --from export would build on what it made then";
        assert!(!ok && stderr.contains(refusal) && stderr.contains(why) && !stderr.contains("running"), "{stderr}");
    }
    assert_eq!((manifests(&run), std::fs::read(run.join("sft.json")).unwrap()), kept);
    assert_eq!(json(&run.join("eval/base.json"))["aggregate"]["steps"], 2);

    // A stage forced by --from that fails leaves no manifest to vouch for what it was rewriting: the next
    // run runs it again (and fails again here) rather than skipping it.
    let tokenizer = run.join("checkpoints/epoch-2/tokenizer.json");
    let kept = std::fs::read(&tokenizer).unwrap();
    std::fs::remove_file(&tokenizer).unwrap();
    let (ok, stderr) = sft(&pipeline, &configs, &["--from", "export"]);
    assert!(!ok && stderr.contains("epoch-2 lacks tokenizer.json"), "{stderr}");
    assert!(!run.join("manifests/export.json").exists());
    let (ok, stderr) = sft(&pipeline, &configs, &[]);
    assert!(!ok && stderr.contains("epoch-2 lacks tokenizer.json"), "the failed stage is run again: {stderr}");
    std::fs::write(&tokenizer, kept).unwrap();
    let (ok, stderr) = sft(&pipeline, &configs, &[]);
    assert!(ok && stderr.contains("4 stages run, 4 skipped"), "{stderr}");

    // A run folder another kiln is writing is refused, naming that kiln; nothing is run or written.
    let lock = kiln::files::RunLock::acquire(&run, "kiln sft --model fast").unwrap();
    let holder = format!("is in use by another kiln (pid {}, `kiln sft --model fast`, since", std::process::id());
    let card = std::fs::read_to_string(run.join("README.md")).unwrap();
    let (ok, stderr) = sft(&pipeline, &configs, &["--from", "card"]);
    assert!(!ok && stderr.contains(&holder) && !stderr.contains("running"), "{stderr}");
    let (ok, _, stderr) = run_kiln(&["card", "--run", run.to_str().unwrap()], &[], &project_dir());
    assert!(!ok && stderr.contains(&holder), "{stderr}");
    assert_eq!(std::fs::read_to_string(run.join("README.md")).unwrap(), card);
    drop(lock);
    let (ok, stderr) = sft(&pipeline, &configs, &[]);
    assert!(ok && stderr.contains("0 stages run, 8 skipped"), "released, the run goes on: {stderr}");

    // `--from train` trains again (resuming the finished training would take no step), to the same end.
    let trained = json(&run.join("train/summary.json"));
    let (ok, stderr) = sft(&pipeline, &configs, &["--from", "train", "--until", "train"]);
    assert!(
        ok && stderr.contains("--from train: the training starts over") && !stderr.contains("resuming"),
        "{stderr}"
    );
    let again = json(&run.join("train/summary.json"));
    assert_eq!((&again["steps"], &again["final_loss"]), (&trained["steps"], &trained["final_loss"]));

    // A `--set` reruns the stage it changes and what follows, and shows in the effective config and in the
    // card's reproduce command, quoted for a shell (a TOML string literal: the same scorer, nothing rerun for it).
    let (ok, stderr) = sft(&pipeline, &configs, &[]);
    assert!(ok && stderr.contains("4 stages run, 4 skipped"), "the stages after the new training: {stderr}");
    let (ok, stderr) = sft(&pipeline, &configs, &["--set", "eval.limit=1", "--set", "eval.scorer=\"v2\""]);
    assert!(ok && stderr.contains("3 stages run, 5 skipped"), "{stderr}");
    assert_eq!(json(&run.join("eval/epoch-2.json"))["aggregate"]["steps"], 1);
    let effective = json(&run.join("sft.json"));
    assert_eq!(
        (&effective["config"]["eval"]["limit"], &effective["config"]["eval"]["scorer"]),
        (&1.into(), &"v2".into())
    );
    let md = std::fs::read_to_string(run.join("README.md")).unwrap();
    assert!(md.contains("--set 'eval.limit=1' --set 'eval.scorer=\"v2\"'"), "the reproduce command:\n{md}");

    // An eval stopped midway (here after epoch-1's result) goes on from there: the results whose checkpoint,
    // replay and settings are unchanged are kept as they are, the missing one is evaluated; `--from eval`
    // evaluates every candidate again.
    let same = ["--set", "eval.limit=1", "--set", "eval.scorer=\"v2\""];
    let results = || ["base", "epoch-1", "epoch-2"].map(|c| std::fs::read(run.join(format!("eval/{c}.json"))).unwrap());
    let before = results();
    std::fs::remove_file(run.join("manifests/eval.json")).unwrap();
    std::fs::remove_file(run.join("eval/epoch-2.json")).unwrap();
    // A dry run says so first.
    let eval_plan = |extra: &[&str]| dry_run(&pipeline, &configs, &[&same[..], extra].concat())["stages"][5].clone();
    let planned_eval = eval_plan(&[]);
    assert_eq!(
        (&planned_eval["stage"], &planned_eval["candidates"]),
        (
            &json!("eval"),
            &json!([{"name": "base", "action": "keep"}, {"name": "epoch-1", "action": "keep"},
                {"name": "epoch-2", "action": "evaluate", "finished_batches": 0}])
        )
    );
    let (ok, stderr) = sft(&pipeline, &configs, &same);
    assert!(ok && stderr.contains("3 stages run, 5 skipped") && stderr.contains("(2 kept from before)"), "{stderr}");
    for (name, kept) in [("base", true), ("epoch-1", true), ("epoch-2", false)] {
        let line = stderr.lines().find(|l| l.starts_with(&format!("  {name}: Score"))).unwrap_or_default();
        assert_eq!(line.contains("kept: same checkpoint, replay and settings"), kept, "{name}: {stderr}");
    }
    let after = results();
    assert_eq!(before[..2], after[..2], "kept byte for byte");
    let aggregate = |bytes: &[u8]| serde_json::from_slice::<Value>(bytes).unwrap()["aggregate"].clone();
    assert_eq!(aggregate(&before[2]), aggregate(&after[2]), "evaluated again, to the same result");
    // Stopped within a candidate: the batches its journal holds (here the one step, its reply emptied) are
    // taken from there, and the journal goes once the result is written.
    std::fs::remove_file(run.join("manifests/eval.json")).unwrap();
    std::fs::remove_file(run.join("eval/epoch-2.json")).unwrap();
    let identity = std::fs::read_to_string(run.join("eval/epoch-2.identity")).unwrap();
    let journal = run.join("eval/epoch-2.partial.jsonl");
    let batch = r#"{"steps": [0], "ids": [[]], "seconds": 0.5}"#;
    std::fs::write(&journal, format!("{}\n{batch}\n", json!({"identity": identity.trim()}))).unwrap();
    let journal_text = std::fs::read(&journal).unwrap();
    assert_eq!(
        eval_plan(&[])["candidates"][2],
        json!({"name": "epoch-2", "action": "evaluate", "finished_batches": 1})
    );
    let forced = eval_plan(&["--from", "eval"])["candidates"].clone();
    assert!(forced.as_array().unwrap().iter().all(|c| c["action"] == "evaluate"), "{forced}");
    assert_eq!(std::fs::read(&journal).unwrap(), journal_text, "a dry run writes nothing");
    let (ok, stderr) = sft(&pipeline, &configs, &same);
    assert!(
        ok && stderr.contains("epoch-2: going on after the 1 batch(es) finished before it was stopped"),
        "{stderr}"
    );
    let resumed = json(&run.join("eval/epoch-2.json"));
    assert_eq!((&resumed["per_step"][0]["pred_preview"], &resumed["gen_time_sec"]), (&json!(""), &json!(0.5)));
    assert!(!journal.exists());
    // `kiln select` with the run's eval settings goes on from the stage's journal and writes the identity the
    // stage would, so the stage keeps what it measured.
    std::fs::remove_file(run.join("manifests/eval.json")).unwrap();
    std::fs::remove_file(run.join("eval/epoch-2.json")).unwrap();
    std::fs::write(&journal, &journal_text).unwrap();
    let (replay, run_base) = (project_dir().join("datasets/samples/replay.jsonl"), run.join("base"));
    let select = [
        "--quiet",
        "select",
        "--run",
        run.to_str().unwrap(),
        "--base",
        run_base.to_str().unwrap(),
        "--replay",
        replay.to_str().unwrap(),
        "--limit",
        "1",
        "--max-tokens",
        "16",
        "--scorer",
        "v2",
    ];
    let (ok, _, stderr) = run_kiln(&select, &[], &project_dir());
    assert!(ok && stderr.contains("eval epoch-2: going on after the 1 batch(es)"), "{stderr}");
    assert_eq!(json(&run.join("eval/epoch-2.json"))["per_step"][0]["pred_preview"], json!(""));
    assert_eq!(std::fs::read_to_string(run.join("eval/epoch-2.identity")).unwrap(), identity);
    assert!(!journal.exists());
    let (ok, stderr) = sft(&pipeline, &configs, &same);
    assert!(ok && stderr.contains("(3 kept from before)"), "{stderr}");
    let (ok, stderr) = sft(&pipeline, &configs, &[&same[..], &["--from", "eval"]].concat());
    assert!(ok && stderr.contains("3 stages run, 5 skipped") && !stderr.contains("kept from before"), "{stderr}");

    // A second stage from the first one's selected checkpoint (`--base`), read in place: its base row is the
    // checkpoint's own eval under the same settings, and the card names the checkpoint.
    let best = run.join("best");
    let b = best.to_str().unwrap();
    let (ok, stderr) =
        sft(&pipeline, &configs, &["--base", b, "--run", "fast-2", "--epochs", "1", "--set", "eval.limit=1"]);
    assert!(ok && stderr.contains(&format!("checkpoint {b}")), "{stderr}");
    let second = dir.path().join("runs/fast-2");
    let chosen = json(&run.join("selection.json"))["chosen"].as_str().unwrap().to_string();
    let previews = |path: &Path| -> Vec<Value> {
        json(path)["per_step"].as_array().unwrap().iter().map(|s| s["pred_preview"].clone()).collect()
    };
    let (evaluated, base_eval) = (run.join("eval").join(format!("{chosen}.json")), second.join("eval/base.json"));
    assert_eq!(json(&base_eval)["aggregate"], json(&evaluated)["aggregate"]);
    assert_eq!(previews(&base_eval), previews(&evaluated), "the checkpoint's own replies");
    assert_ne!(previews(&base_eval), previews(&run.join("eval/base.json")), "not the random-init model's");
    assert!(!second.join("base").exists() && second.join("checkpoints/epoch-1/model.safetensors").is_file());
    let md = std::fs::read_to_string(second.join("README.md")).unwrap();
    assert!(md.contains(&format!("Full fine-tune of the checkpoint `{b}`")), "{md}");
    // A checkpoint inside the run folder it would rewrite is refused, and left as it was.
    let weights = std::fs::read(best.join("model.safetensors")).unwrap();
    let (ok, stderr) = sft(&pipeline, &configs, &["--base", b, "--from", "train"]);
    assert!(!ok && stderr.contains("lies in the run folder") && !stderr.contains("running"), "{stderr}");
    assert_eq!(std::fs::read(best.join("model.safetensors")).unwrap(), weights);
    // So is one of another architecture than the model config's, before anything runs.
    let p = pipeline.to_str().unwrap();
    let args = ["sft", "--model", "tiny-qwen3.5", "--pipeline", p, "--base", b, "--run", "q", "--device", "cpu"];
    let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
    assert!(
        !ok && stderr
            .contains("is a lfm2 checkpoint (model_type lfm2), but the model config 'tiny-qwen3.5' is for qwen3_5"),
        "{stderr}"
    );
    assert!(!dir.path().join("runs/q").exists());
}

#[test]
fn unknown_models_missing_gpus_and_flags_that_make_no_run_fail_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (pipeline, _) = setup(dir.path());
    let p = pipeline.to_str().unwrap();
    let (ok, _, stderr) = run_kiln(&["sft", "--model", "gpt-17", "--pipeline", p], &[], &project_dir());
    assert!(
        !ok && stderr.contains("unknown model 'gpt-17'")
            && stderr.contains("lfm2.5-8b, qwen3.5-0.8b")
            && stderr.contains("tiny, tiny-gemma4, tiny-moe, tiny-qwen3.5"),
        "{stderr}"
    );

    // No download is tried: the endpoint is unreachable and the error is about the GPU.
    let (ok, _, stderr) = run_kiln(
        &["sft", "--model", "lfm2.5-8b", "--device", "cpu", "--pipeline", p],
        &[("HF_ENDPOINT", "http://127.0.0.1:9")],
        &project_dir(),
    );
    assert!(!ok && stderr.contains("needs a GPU") && stderr.contains("nothing was downloaded"), "{stderr}");
    assert!(!dir.path().join("runs/lfm2.5-8b").exists());

    // Flags that make no run fail before any stage, and write nothing.
    for (flag, value, expected) in [("--epochs", "0", "train.epochs is 0"), ("--devices", "0", "train.devices is 0")] {
        let (ok, _, stderr) =
            run_kiln(&["sft", "--model", "tiny", "--pipeline", p, "--run", "zero", flag, value], &[], &project_dir());
        assert!(!ok && stderr.contains("model 'tiny' with the flags given") && stderr.contains(expected), "{stderr}");
        assert!(!dir.path().join("runs/zero").exists());
    }
    // So do a stage order that runs nothing, an unknown recipe, a replay set that is not there (found before
    // the pull, not after the training), and a `--set` the model config cannot take or a flag contradicts.
    for (flags, expected) in [
        (&["--from", "card", "--until", "pull"][..], "--from card comes after --until pull"),
        (&["--set", "train.lrr=1e-5"], "--set train.lrr=1e-5 (over configs/models/tiny.toml): unknown field `lrr`"),
        (&["--set", "data.seq_len=1"], "--set data.seq_len=1 (over configs/models/tiny.toml): [data] seq_len is 1"),
        (&["--set", "train.lr=fast"], "invalid type: string \"fast\", expected f64"),
        (&["--set", "train.lr"], "'train.lr' is not KEY=VALUE"),
        (&["--set", "train.epochs=3", "--epochs", "1"], "--epochs 1 and --set train.epochs=3 disagree"),
        (&["--base", "nosuch"], "nosuch/config.json"),
        (&["--data", "terminal-synth,nosuch"], "no such recipe 'nosuch'"),
        (&["--replay", "nosuch.jsonl"], "stage eval: nosuch.jsonl: No such file"),
    ] {
        let mut args = vec!["sft", "--model", "tiny", "--pipeline", p, "--run", "zero"];
        args.extend(flags);
        let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
        assert!(!ok && stderr.contains(expected) && !stderr.contains("running"), "{flags:?}: {stderr}");
        assert!(!dir.path().join("runs/zero").exists());
    }
}
