//! Per-step rows, aggregates and the result JSON of a TB2-lite run, in the reference evaluator's field names
//! and rounding: step values rounded to 4 decimals before aggregation, percentages to 1, counts to 2.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::parse::{Parsed, ScorerVersion, parse_response};
use super::score::{py_round, score_units};

/// One replay step (the fields scoring needs; the rest of the record is ignored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayStep {
    pub task_id: String,
    #[serde(default)]
    pub sample_idx: i64,
    pub step_idx: i64,
    #[serde(default)]
    pub source_group: String,
    #[serde(default)]
    pub messages: Vec<Value>,
    pub ref_raw: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    pub task_id: String,
    pub sample_idx: i64,
    pub step_idx: i64,
    pub bucket: String,
    pub source_group: String,
    pub valid_json: bool,
    pub has_analysis: bool,
    pub has_plan: bool,
    pub ref_task_complete: Option<bool>,
    pub pred_task_complete: Option<bool>,
    pub pred_task_complete_true: bool,
    pub ref_command_units: Vec<String>,
    pub pred_command_units: Vec<String>,
    pub first_cmd_exact: f64,
    pub command_precision: f64,
    pub command_recall: f64,
    pub command_f1: f64,
    pub pred_preview: String,
    pub finish_reason: String,
}

pub fn bucket(step_idx: i64) -> &'static str {
    match step_idx {
        i if i <= 1 => "early",
        i if i <= 4 => "mid",
        _ => "late",
    }
}

/// Scores one step from the prediction's parse (and its raw text, for the preview).
pub fn score_step(
    step: &ReplayStep,
    pred: &Parsed,
    pred_text: &str,
    finish_reason: &str,
    version: ScorerVersion,
) -> StepRow {
    let reference = parse_response(&step.ref_raw, version);
    let s = score_units(&pred.command_units, &reference.command_units, false);
    StepRow {
        task_id: step.task_id.clone(),
        sample_idx: step.sample_idx,
        step_idx: step.step_idx,
        bucket: bucket(step.step_idx).into(),
        source_group: step.source_group.clone(),
        valid_json: pred.valid_json,
        has_analysis: pred.has_analysis,
        has_plan: pred.has_plan,
        ref_task_complete: reference.task_complete,
        pred_task_complete: pred.task_complete,
        pred_task_complete_true: pred.task_complete == Some(true),
        ref_command_units: reference.command_units,
        pred_command_units: pred.command_units.clone(),
        first_cmd_exact: s.first_cmd_exact,
        command_precision: s.precision,
        command_recall: s.recall,
        command_f1: s.f1,
        pred_preview: pred_text.chars().take(1200).collect(),
        finish_reason: finish_reason.into(),
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketAggregate {
    pub steps: usize,
    pub avg_command_f1: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupAggregate {
    pub steps: usize,
    pub avg_command_f1: f64,
    pub first_cmd_exact_pct: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Aggregate {
    pub steps: usize,
    pub tasks: usize,
    pub avg_ref_cmds: f64,
    pub avg_pred_cmds: f64,
    pub valid_json_pct: f64,
    pub has_analysis_pct: f64,
    pub has_plan_pct: f64,
    pub first_cmd_exact_pct: f64,
    pub avg_command_precision: f64,
    pub avg_command_recall: f64,
    pub avg_command_f1: f64,
    pub complete_true_recall_pct: f64,
    pub premature_complete_rate_pct: f64,
    pub by_bucket: BTreeMap<String, BucketAggregate>,
    pub by_source_group: BTreeMap<String, GroupAggregate>,
    /// 100 × (0.7 × avg F1 + 0.3 × first-command exactness), the legacy ranking number (reported only).
    pub next_action_score: f64,
    /// The ranking number: 100 × avg_command_f1, two decimals.
    pub score: f64,
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

fn pct(flags: impl Iterator<Item = bool>) -> f64 {
    py_round(100.0 * mean(flags.map(|b| if b { 1.0 } else { 0.0 })), 1)
}

/// The `next_action_score` of rounded aggregates.
pub fn next_action_score(avg_f1: f64, first_pct: f64) -> f64 {
    py_round(100.0 * (0.7 * avg_f1 + 0.3 * first_pct / 100.0), 2)
}

pub fn aggregate(rows: &[StepRow]) -> Aggregate {
    let tasks: BTreeSet<&str> = rows.iter().map(|r| r.task_id.as_str()).collect();
    let avg_f1 = py_round(mean(rows.iter().map(|r| r.command_f1)), 4);
    let first_pct = pct(rows.iter().map(|r| r.first_cmd_exact == 1.0));
    let mut by_bucket: BTreeMap<String, Vec<&StepRow>> = BTreeMap::new();
    let mut by_group: BTreeMap<String, Vec<&StepRow>> = BTreeMap::new();
    for r in rows {
        by_bucket.entry(r.bucket.clone()).or_default().push(r);
        by_group.entry(r.source_group.clone()).or_default().push(r);
    }
    let complete: Vec<&StepRow> = rows.iter().filter(|r| r.ref_task_complete == Some(true)).collect();
    let not_complete: Vec<&StepRow> = rows.iter().filter(|r| r.ref_task_complete != Some(true)).collect();
    Aggregate {
        steps: rows.len(),
        tasks: tasks.len(),
        avg_ref_cmds: py_round(mean(rows.iter().map(|r| r.ref_command_units.len() as f64)), 2),
        avg_pred_cmds: py_round(mean(rows.iter().map(|r| r.pred_command_units.len() as f64)), 2),
        valid_json_pct: pct(rows.iter().map(|r| r.valid_json)),
        has_analysis_pct: pct(rows.iter().map(|r| r.has_analysis)),
        has_plan_pct: pct(rows.iter().map(|r| r.has_plan)),
        first_cmd_exact_pct: first_pct,
        avg_command_precision: py_round(mean(rows.iter().map(|r| r.command_precision)), 4),
        avg_command_recall: py_round(mean(rows.iter().map(|r| r.command_recall)), 4),
        avg_command_f1: avg_f1,
        complete_true_recall_pct: pct(complete.iter().map(|r| r.pred_task_complete_true)),
        premature_complete_rate_pct: pct(not_complete.iter().map(|r| r.pred_task_complete_true)),
        by_bucket: by_bucket
            .into_iter()
            .map(|(k, v)| {
                (
                    k,
                    BucketAggregate {
                        steps: v.len(),
                        avg_command_f1: py_round(mean(v.iter().map(|r| r.command_f1)), 4),
                    },
                )
            })
            .collect(),
        by_source_group: by_group
            .into_iter()
            .map(|(k, v)| {
                let g = GroupAggregate {
                    steps: v.len(),
                    avg_command_f1: py_round(mean(v.iter().map(|r| r.command_f1)), 4),
                    first_cmd_exact_pct: pct(v.iter().map(|r| r.first_cmd_exact == 1.0)),
                };
                (k, g)
            })
            .collect(),
        next_action_score: next_action_score(avg_f1, first_pct),
        score: py_round(100.0 * avg_f1, 2),
    }
}

/// The whole result document; header fields follow the reference evaluator's.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalResult {
    pub model: String,
    pub model_path: String,
    pub model_short: String,
    pub eval_path: String,
    pub timestamp: String,
    pub load_time_sec: f64,
    pub gen_time_sec: f64,
    pub avg_sec_per_step: f64,
    pub scorer: ScorerVersion,
    pub sampling: Value,
    pub prompt_template: Value,
    pub aggregate: Aggregate,
    pub per_step: Vec<StepRow>,
}

/// A prediction for one step: raw text (JSONL `{task_id, step_idx, text}`), or already-parsed units from
/// another evaluator's result JSON.
#[derive(Debug, Clone)]
pub enum Prediction {
    Text { text: String, finish_reason: String },
    Parsed(Parsed, String),
}

/// A replay step without its history, for scoring alone (the history is skipped, not built).
#[derive(Deserialize)]
struct ScoringStep {
    task_id: String,
    #[serde(default)]
    sample_idx: i64,
    step_idx: i64,
    #[serde(default)]
    source_group: String,
    ref_raw: String,
}

/// Reads replay steps without their message histories (what scoring needs).
pub fn read_replay_for_scoring(path: &std::path::Path) -> Result<Vec<ReplayStep>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let s: ScoringStep =
                serde_json::from_str(l).map_err(|e| format!("{}: line {}: {e}", path.display(), i + 1))?;
            Ok(ReplayStep {
                task_id: s.task_id,
                sample_idx: s.sample_idx,
                step_idx: s.step_idx,
                source_group: s.source_group,
                messages: Vec::new(),
                ref_raw: s.ref_raw,
            })
        })
        .collect()
}

/// Reads replay steps (JSONL).
pub fn read_replay(path: &std::path::Path) -> Result<Vec<ReplayStep>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("{}: line {}: {e}", path.display(), i + 1)))
        .collect()
}

/// Reads predictions keyed by (task_id, step_idx): JSONL of `{task_id, step_idx, text, finish_reason?}`,
/// or a result JSON with `per_step` rows carrying `pred_command_units` and the parse flags.
pub fn read_predictions(path: &std::path::Path) -> Result<BTreeMap<(String, i64), Prediction>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = BTreeMap::new();
    if let Ok(Value::Object(doc)) = serde_json::from_str::<Value>(&text) {
        let rows = doc
            .get("per_step")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("{}: a JSON object without `per_step`", path.display()))?;
        for (i, r) in rows.iter().enumerate() {
            let key = (r["task_id"].as_str().unwrap_or_default().to_string(), r["step_idx"].as_i64().unwrap_or(-1));
            let units = r["pred_command_units"]
                .as_array()
                .ok_or_else(|| format!("{}: per_step[{i}] has no pred_command_units", path.display()))?;
            let parsed = Parsed {
                valid_json: r["valid_json"].as_bool().unwrap_or(false),
                has_analysis: r["has_analysis"].as_bool().unwrap_or(false),
                has_plan: r["has_plan"].as_bool().unwrap_or(false),
                task_complete: r["pred_task_complete"].as_bool(),
                command_units: units.iter().filter_map(|u| u.as_str().map(str::to_string)).collect(),
            };
            let preview = r["pred_preview"].as_str().unwrap_or_default().to_string();
            out.insert(key, Prediction::Parsed(parsed, preview));
        }
        return Ok(out);
    }
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("{}: line {}: {e}", path.display(), i + 1))?;
        let (Some(task), Some(step), Some(t)) = (v["task_id"].as_str(), v["step_idx"].as_i64(), v["text"].as_str())
        else {
            return Err(format!("{}: line {}: needs task_id, step_idx and text", path.display(), i + 1));
        };
        let finish = v["finish_reason"].as_str().unwrap_or("stop").to_string();
        out.insert((task.to_string(), step), Prediction::Text { text: t.to_string(), finish_reason: finish });
    }
    Ok(out)
}

/// Scores every replay step against its prediction; a step without one is an error naming the first few.
pub fn score_all(
    steps: &[ReplayStep],
    predictions: &BTreeMap<(String, i64), Prediction>,
    version: ScorerVersion,
) -> Result<Vec<StepRow>, String> {
    let missing: Vec<String> = steps
        .iter()
        .filter(|s| !predictions.contains_key(&(s.task_id.clone(), s.step_idx)))
        .map(|s| format!("{}/{}", s.task_id, s.step_idx))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "no prediction for {} of {} steps (e.g. {})",
            missing.len(),
            steps.len(),
            missing.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(steps
        .iter()
        .map(|s| match &predictions[&(s.task_id.clone(), s.step_idx)] {
            Prediction::Text { text, finish_reason } => {
                score_step(s, &parse_response(text, version), text, finish_reason, version)
            }
            Prediction::Parsed(parsed, preview) => score_step(s, parsed, preview, "unknown", version),
        })
        .collect())
}
