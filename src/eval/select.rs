//! Choosing the epoch to keep: the base model and every epoch checkpoint of a run are scored on the replay
//! set (results cached in `eval/<name>.json`), the best epoch by Score wins (ties: recall, then precision,
//! then valid JSON), and `selection.json` records every candidate, the choice, its margin and why.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::result::{Aggregate, EvalResult};

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

/// Evaluates every candidate of `run_dir` whose `eval/<name>.json` is missing (with `evaluate`), chooses,
/// and writes `selection.json` and the `best` link. `report` hears each candidate's name and result.
pub fn select_run(
    run_dir: &Path,
    base: Option<&Path>,
    evaluate: &mut dyn FnMut(&Candidate) -> Result<EvalResult, String>,
    report: &mut dyn FnMut(&str, &EvalResult),
) -> Result<Selection, String> {
    let mut results = Vec::new();
    for c in candidates(run_dir, base) {
        let path = run_dir.join("eval").join(format!("{}.json", c.name));
        let result: EvalResult = if path.is_file() {
            let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            serde_json::from_str(&text).map_err(|e| format!("{} is not an eval result: {e}", path.display()))?
        } else {
            let r = evaluate(&c)?;
            write_json(&path, &r)?;
            r
        };
        report(&c.name, &result);
        results.push((c, result));
    }
    let selection = choose(&results).map_err(|e| format!("{}: {e}", run_dir.display()))?;
    write_json(&run_dir.join("selection.json"), &selection)?;
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

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), String> {
    crate::files::write_json(path, value).map_err(|e| format!("{}: {e}", path.display()))
}
