//! Choosing the epoch to keep: the base model and every epoch checkpoint of a run are scored on the replay
//! set (results cached in `eval/<name>.json`), the best epoch by Score wins (ties: recall, then precision,
//! then valid JSON), and `selection.json` records every candidate, the choice, its margin and why. Results
//! are compared only when they were measured alike, and a cached one only stands for the checkpoint as it
//! was when it was written (its model card aside). Only the chosen epoch keeps a card. The candidates'
//! figures also go to TensorBoard events in `eval/`, at the steps their checkpoints were taken.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ScorerVersion;
use super::result::{Aggregate, EvalResult, ReplayStep};
use super::run::EvalOptions;
use crate::train::tensorboard::EventLog;

/// How a result was measured: on which replay file and steps, by which scorer, with the decoding settings
/// that change what is generated (batch size, dtype and backend do not, beyond rounding).
#[derive(Debug, Clone, PartialEq)]
pub struct Measure {
    pub replay: String,
    pub scorer: ScorerVersion,
    pub decoding: Vec<(&'static str, Value)>,
    /// (task, sample, step) of every step scored, sorted.
    pub steps: Vec<(String, i64, i64)>,
}

const DECODING: [&str; 6] =
    ["temperature", "top_p", "repetition_penalty", "max_tokens", "thinking_mode", "strip_thinking_history"];

impl Measure {
    pub fn of(result: &EvalResult) -> Measure {
        let steps = result.per_step.iter().map(|r| (r.task_id.clone(), r.sample_idx, r.step_idx)).collect();
        Measure::new(&result.eval_path, result.scorer, &result.sampling, steps)
    }

    /// What an eval of `steps` from `replay` with `opts` would record.
    pub fn planned(replay: &Path, steps: &[ReplayStep], opts: &EvalOptions) -> Measure {
        let steps = steps.iter().map(|s| (s.task_id.clone(), s.sample_idx, s.step_idx)).collect();
        Measure::new(&replay.display().to_string(), opts.scorer, &super::run::sampling(opts, 0), steps)
    }

    fn new(replay: &str, scorer: ScorerVersion, sampling: &Value, mut steps: Vec<(String, i64, i64)>) -> Measure {
        steps.sort();
        // The same file named by another path (relative, absolute) is the same replay set.
        let replay = std::fs::canonicalize(replay).map_or_else(|_| replay.to_string(), |p| p.display().to_string());
        let decoding = DECODING.iter().map(|&k| (k, sampling.get(k).cloned().unwrap_or(Value::Null))).collect();
        Measure { replay, scorer, decoding, steps }
    }

    /// Where `self` departs from `other`, as `max_tokens 4 there, 1024 now` with `labels` ["there", "now"].
    pub fn differences(&self, other: &Measure, labels: [&str; 2]) -> Vec<String> {
        let [mine, theirs] = labels;
        let mut out = Vec::new();
        let mut differ = |what: &str, a: &dyn std::fmt::Display, b: &dyn std::fmt::Display| {
            out.push(format!("{what} {a} {mine}, {b} {theirs}"));
        };
        if self.replay != other.replay {
            differ("replay", &self.replay, &other.replay);
        }
        if self.scorer != other.scorer {
            let name = |s: ScorerVersion| serde_json::to_value(s).unwrap_or_default();
            differ("scorer", &name(self.scorer), &name(other.scorer));
        }
        for ((key, a), (_, b)) in self.decoding.iter().zip(&other.decoding) {
            if a != b {
                differ(key, a, b);
            }
        }
        if self.steps != other.steps {
            out.push(format!("{} steps {mine}, {} other ones {theirs}", self.steps.len(), other.steps.len()));
        }
        out
    }
}

/// The newest modification time of the files in a checkpoint folder (links followed), its card left out.
fn changed_at(dir: &Path) -> Option<SystemTime> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| !crate::models::hf::CARD_ENTRIES.iter().any(|card| e.file_name() == *card))
        .filter_map(|e| std::fs::metadata(e.path()).ok()?.modified().ok())
        .max()
}

/// Why the cached result at `path` cannot stand for `candidate` measured as `expected` (None: it can).
fn unusable(path: &Path, result: &EvalResult, candidate: &Candidate, expected: Option<&Measure>) -> Option<String> {
    let written = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    if let (Some(written), Some(changed)) = (written, changed_at(&candidate.path))
        && changed > written
    {
        return Some(format!("{} changed after {} was written", candidate.path.display(), path.display()));
    }
    let differences = Measure::of(result).differences(expected?, ["there", "now"]);
    (!differences.is_empty()).then(|| format!("{} was measured otherwise ({})", path.display(), differences.join("; ")))
}

/// Removes the model card (`models::hf::CARD_ENTRIES`) from every epoch folder of `run_dir` but `keep`: a
/// card describes the selection it was written for, and choosing again or training on makes it untrue. A
/// failure names the path.
pub fn remove_checkpoint_cards(run_dir: &Path, keep: Option<&Path>) -> Result<(), (PathBuf, std::io::Error)> {
    for epoch in candidates(run_dir, None).into_iter().filter(|c| Some(c.path.as_path()) != keep) {
        for entry in crate::models::hf::CARD_ENTRIES {
            let path = epoch.path.join(entry);
            let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            match removed {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err((path, e)),
                _ => {}
            }
        }
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub name: String,
    pub path: PathBuf,
    pub is_epoch: bool,
}

/// The base model (when given) and `checkpoints/epoch-<k>` of `run_dir`, epochs in order.
pub fn candidates(run_dir: &Path, base: Option<&Path>) -> Vec<Candidate> {
    let mut out: Vec<Candidate> =
        base.map(|b| Candidate { name: "base".into(), path: b.to_path_buf(), is_epoch: false }).into_iter().collect();
    let mut epochs: Vec<(usize, PathBuf)> = std::fs::read_dir(run_dir.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let k: usize = name.strip_prefix("epoch-")?.parse().ok()?;
            Some((k, e.path()))
        })
        .collect();
    epochs.sort();
    out.extend(epochs.into_iter().map(|(k, path)| Candidate { name: format!("epoch-{k}"), path, is_epoch: true }));
    out
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    pub path: PathBuf,
    pub score: f64,
    pub avg_command_precision: f64,
    pub avg_command_recall: f64,
    pub avg_command_f1: f64,
    pub first_cmd_exact_pct: f64,
    pub valid_json_pct: f64,
    pub avg_sec_per_step: f64,
    pub steps: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Selection {
    pub candidates: Vec<Entry>,
    pub chosen: String,
    pub chosen_path: PathBuf,
    /// Score points ahead of the runner-up epoch (none with a single epoch).
    pub margin: Option<f64>,
    pub reason: String,
}

/// `<run>/selection.json`, as the select stage wrote it.
pub fn read_selection(run_dir: &Path) -> Result<Selection, String> {
    let path = run_dir.join("selection.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e} (run the select stage)", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn key(a: &Aggregate) -> (f64, f64, f64, f64) {
    (a.score, a.avg_command_recall, a.avg_command_precision, a.valid_json_pct)
}

/// Picks the best epoch among `results` (base entries are reported, never chosen).
pub fn choose(results: &[(Candidate, EvalResult)]) -> Result<Selection, String> {
    let entries: Vec<Entry> = results
        .iter()
        .map(|(c, r)| Entry {
            name: c.name.clone(),
            path: c.path.clone(),
            score: r.aggregate.score,
            avg_command_precision: r.aggregate.avg_command_precision,
            avg_command_recall: r.aggregate.avg_command_recall,
            avg_command_f1: r.aggregate.avg_command_f1,
            first_cmd_exact_pct: r.aggregate.first_cmd_exact_pct,
            valid_json_pct: r.aggregate.valid_json_pct,
            avg_sec_per_step: r.avg_sec_per_step,
            steps: r.aggregate.steps,
        })
        .collect();
    let mut epochs: Vec<&(Candidate, EvalResult)> = results.iter().filter(|(c, _)| c.is_epoch).collect();
    if epochs.is_empty() {
        return Err("no epoch checkpoint to choose from (checkpoints/epoch-<k>/)".into());
    }
    epochs.sort_by(|a, b| key(&b.1.aggregate).partial_cmp(&key(&a.1.aggregate)).unwrap_or(std::cmp::Ordering::Equal));
    let (best, best_result) = (&epochs[0].0, &epochs[0].1);
    let runner = epochs.get(1);
    let margin = runner.map(|r| crate::eval::score::py_round(best_result.aggregate.score - r.1.aggregate.score, 2));
    let decided_by = match runner {
        None => "the only epoch".to_string(),
        Some(r) => {
            let (a, b) = (key(&best_result.aggregate), key(&r.1.aggregate));
            let criterion = if a.0 != b.0 {
                "Score"
            } else if a.1 != b.1 {
                "recall (Scores tied)"
            } else if a.2 != b.2 {
                "precision (Score and recall tied)"
            } else {
                "valid JSON (Score, recall and precision tied)"
            };
            format!("ahead of {} by {criterion}", r.0.name)
        }
    };
    let base = results.iter().find(|(c, _)| !c.is_epoch);
    let versus_base = base.map(|(_, r)| format!("; base scores {:.2}", r.aggregate.score)).unwrap_or_default();
    let reason = format!("{} scores {:.2}, {decided_by}{versus_base}", best.name, best_result.aggregate.score);
    Ok(Selection { candidates: entries, chosen: best.name.clone(), chosen_path: best.path.clone(), margin, reason })
}

/// How `select_run` evaluates a candidate, told why its cached result is not used (None: it has none): the
/// result and the identity it was measured under (`pipeline::stages::eval_identity`), written beside it as the
/// eval stage writes its own, so that the stage keeps the result where its settings agree. It may keep a
/// journal at `journal::path_in(run/eval, name)`: `select_run` removes it once the result is written.
pub type Evaluate<'a> = dyn FnMut(&Candidate, Option<&str>) -> Result<(EvalResult, String), String> + 'a;

/// Evaluates every candidate of `run_dir` that has no usable `eval/<name>.json` (with `evaluate`, told why a
/// cached one is not used), chooses, and writes `selection.json` and the `best` link. A cached result is used
/// when its checkpoint has not changed since and, where `expected` is given, it was measured so; results
/// measured unlike each other are refused. `report` hears each candidate's name and result.
pub fn select_run(
    run_dir: &Path,
    base: Option<&Path>,
    expected: Option<&Measure>,
    evaluate: &mut Evaluate,
    report: &mut dyn FnMut(&str, &EvalResult),
) -> Result<Selection, String> {
    let mut results: Vec<(Candidate, EvalResult)> = Vec::new();
    let mut first: Option<(PathBuf, Measure)> = None;
    let eval_dir = run_dir.join("eval");
    for c in candidates(run_dir, base) {
        let path = eval_dir.join(format!("{}.json", c.name));
        let cached: Option<EvalResult> = if path.is_file() {
            let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            Some(serde_json::from_str(&text).map_err(|e| format!("{} is not an eval result: {e}", path.display()))?)
        } else {
            None
        };
        let why = cached.as_ref().and_then(|r| unusable(&path, r, &c, expected));
        let result = match cached {
            Some(r) if why.is_none() => r,
            _ => {
                // The identity of the result being replaced must not vouch for the new one while it is written.
                let identity = crate::eval::journal::identity_path_in(&eval_dir, &c.name);
                crate::files::remove_if_present(&identity).map_err(|e| format!("{}: {e}", identity.display()))?;
                let (r, measured_as) = evaluate(&c, why.as_deref())?;
                write_json(&path, &r)?;
                std::fs::write(&identity, format!("{measured_as}\n"))
                    .map_err(|e| format!("{}: {e}", identity.display()))?;
                let journal = crate::eval::journal::path_in(&eval_dir, &c.name);
                crate::files::remove_if_present(&journal).map_err(|e| format!("{}: {e}", journal.display()))?;
                r
            }
        };
        let measure = Measure::of(&result);
        match &first {
            None => first = Some((path.clone(), measure)),
            Some((first_path, first_measure)) => {
                let differences = measure.differences(first_measure, ["here", "there"]);
                if !differences.is_empty() {
                    return Err(format!(
                        "{} and {} were measured differently ({}): their Scores do not compare; evaluate them \
                         alike (kiln select evaluates again what its options differ from; kiln sft --from eval)",
                        path.display(),
                        first_path.display(),
                        differences.join("; ")
                    ));
                }
            }
        }
        report(&c.name, &result);
        results.push((c, result));
    }
    let selection = choose(&results).map_err(|e| format!("{}: {e}", run_dir.display()))?;
    remove_checkpoint_cards(run_dir, Some(&selection.chosen_path))
        .map_err(|(path, e)| format!("removing {}: {e}", path.display()))?;
    write_json(&run_dir.join("selection.json"), &selection)?;
    write_score_events(run_dir, &selection)?;
    let best = run_dir.join("best");
    let _ = std::fs::remove_file(&best);
    let target = selection
        .chosen_path
        .strip_prefix(run_dir)
        .map(Path::to_path_buf)
        .unwrap_or_else(|_| selection.chosen_path.clone());
    std::os::unix::fs::symlink(&target, &best).map_err(|e| format!("linking {}: {e}", best.display()))?;
    Ok(selection)
}

/// The candidates' figures as TensorBoard events in `<run>/eval/`, which TensorBoard shows as a run beside the
/// training's `<run>/train`, at the steps the checkpoints were taken (0 for the base), so that Scores share
/// the loss curves' axis. Nothing is written for a run without `train/metrics.jsonl` (no steps to put them at).
fn write_score_events(run_dir: &Path, selection: &Selection) -> Result<(), String> {
    let metrics_path = run_dir.join("train").join("metrics.jsonl");
    let metrics = match crate::train::trainer::read_metrics(&metrics_path) {
        Ok(metrics) => metrics,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("{}: {e}", metrics_path.display())),
    };
    let ends = crate::train::trainer::epoch_end_steps(&metrics);
    let step_of = |name: &str| match name.strip_prefix("epoch-") {
        None => Some(0),
        Some(k) => ends.get(k.parse::<usize>().ok()?.checked_sub(1)?).copied(),
    };
    let mut log = EventLog::open(&run_dir.join("eval"), None).map_err(|e| e.to_string())?;
    for entry in &selection.candidates {
        if let Some(step) = step_of(&entry.name) {
            log.scalars(step, score_scalars(entry)).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// A candidate's replay figures under `eval/`.
fn score_scalars(entry: &Entry) -> Vec<(String, f32)> {
    [
        ("score", entry.score),
        ("command_f1", entry.avg_command_f1),
        ("command_precision", entry.avg_command_precision),
        ("command_recall", entry.avg_command_recall),
        ("first_command_exact_pct", entry.first_cmd_exact_pct),
        ("valid_json_pct", entry.valid_json_pct),
    ]
    .into_iter()
    .map(|(name, value)| (format!("eval/{name}"), value as f32))
    .collect()
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), String> {
    crate::files::write_json(path, value).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the kept epoch keeps its card; weights and other files stay, and a folder in `checkpoints/` that is
    /// not an epoch is left alone.
    #[test]
    fn a_card_is_removed_from_every_epoch_but_the_selected_one() {
        let run = tempfile::tempdir().unwrap();
        let epoch = |k: usize| run.path().join(format!("checkpoints/epoch-{k}"));
        for k in 1..=3 {
            std::fs::create_dir_all(epoch(k).join("card")).unwrap();
            for file in ["README.md", "model.safetensors", "card/loss.png"] {
                std::fs::write(epoch(k).join(file), b"x").unwrap();
            }
        }
        std::fs::remove_dir_all(epoch(3).join("card")).unwrap();
        let other = run.path().join("checkpoints/notes");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("README.md"), b"x").unwrap();
        remove_checkpoint_cards(run.path(), Some(&epoch(2))).unwrap();
        for k in [1, 3] {
            assert!(!epoch(k).join("README.md").exists() && !epoch(k).join("card").exists(), "epoch-{k}");
            assert!(epoch(k).join("model.safetensors").is_file());
        }
        assert!(epoch(2).join("README.md").is_file() && epoch(2).join("card/loss.png").is_file());
        remove_checkpoint_cards(run.path(), None).unwrap();
        assert!(!epoch(2).join("README.md").exists() && epoch(2).join("model.safetensors").is_file());
        assert!(other.join("README.md").is_file());
        remove_checkpoint_cards(&run.path().join("no-such-run"), None).unwrap();
    }
}
