//! Why a stage of `kiln sft` runs or is skipped: its manifest set against its plan now. The runner prints
//! the reasons beside "running"; `kiln sft --dry-run` decides every stage this way and writes nothing.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::Value;

use super::{Manifest, Stage, StagePlan};

/// The one reason of a stage that has not finished in the run folder before.
pub const FIRST_RUN: &str = "not run here before";

/// What the runner does with a stage.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "action", rename_all = "lowercase")]
pub enum Decision {
    /// Up to date: its manifest vouches for it (the same fingerprint; before `--from`, the same settings and
    /// inputs, whichever kiln wrote it).
    Skip {
        fingerprint: String,
    },
    Run {
        reasons: Vec<String>,
    },
    /// Left out of the pipeline by the config (`push = false`).
    Off {
        why: String,
    },
}

/// What a stage's decision is made from.
pub struct Judgement<'a> {
    pub stage: Stage,
    /// Its manifest from an earlier run, if it finished one.
    pub previous: Option<&'a Manifest>,
    pub plan: &'a StagePlan,
    pub fingerprint: &'a str,
    /// The outputs `previous` lists that are not on disk.
    pub missing_outputs: Vec<String>,
    pub from: Option<Stage>,
    /// The stages it reads that will run before it (a dry run's; in a run they have run, and their manifests
    /// have changed).
    pub upstream_running: Vec<Stage>,
}

/// The runner's rule: a stage runs when it has not finished here before, when `--from` forces it, when a stage
/// it reads runs first, or when what it would compute from (its settings, its inputs' contents, kiln itself)
/// has changed or an output of it is missing; each of these is a reason given. A stage before `--from` is
/// judged the same way, kiln's version aside (`--from` is how a newer kiln rewrites the last stages alone):
/// a reason there means `--from` would build on outputs that no longer match the run (the runner refuses it).
pub fn decide(j: &Judgement) -> Decision {
    let forced = j.from.is_some_and(|f| j.stage >= f);
    let before_from = j.from.is_some_and(|f| j.stage < f);
    let mut reasons = Vec::new();
    if let Some(from) = j.from.filter(|_| forced) {
        reasons.push(format!("--from {}", from.name()));
    }
    let Some(m) = j.previous else {
        reasons.push(FIRST_RUN.into());
        return Decision::Run { reasons };
    };
    reasons.extend(j.upstream_running.iter().map(|up| format!("{} runs first", up.name())));
    // The upstream stages that ran first, then the stage's own settings, then its other inputs.
    let running: BTreeSet<String> = j.upstream_running.iter().map(|up| upstream_key(*up)).collect();
    let part = |inputs: &BTreeMap<String, String>| -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        inputs.clone().into_iter().filter(|(k, _)| !running.contains(k)).partition(|(k, _)| k.starts_with("manifests/"))
    };
    let ((up_before, own_before), (up_now, own_now)) = (part(&m.inputs), part(&j.plan.inputs));
    reasons.extend(input_changes(&up_before, &up_now));
    if m.kiln != env!("CARGO_PKG_VERSION") && !before_from {
        reasons.push(format!("kiln {} → {}", m.kiln, env!("CARGO_PKG_VERSION")));
    }
    reasons.extend(param_changes(&m.params, &j.plan.params));
    reasons.extend(input_changes(&own_before, &own_now));
    reasons.extend(j.missing_outputs.iter().map(|o| format!("{o} is missing")));
    if reasons.is_empty() && m.fingerprint != j.fingerprint && !before_from {
        reasons.push("its fingerprint changed".into());
    }
    if reasons.is_empty() { Decision::Skip { fingerprint: m.fingerprint.clone() } } else { Decision::Run { reasons } }
}

/// The input key under which a stage's manifest is read by the stages after it.
pub fn upstream_key(stage: Stage) -> String {
    format!("manifests/{}.json", stage.name())
}

/// Each parameter whose value differs, as `key old → new` with the `--set` key's dotted path.
pub fn param_changes(before: &Value, now: &Value) -> Vec<String> {
    let (mut old, mut new) = (BTreeMap::new(), BTreeMap::new());
    leaves("", before, &mut old);
    leaves("", now, &mut new);
    let keys: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    keys.into_iter()
        .filter(|k| old.get(*k) != new.get(*k))
        .map(|k| match (old.get(k), new.get(k)) {
            // Long strings (the command line) by where they differ, else both would show the same start.
            (Some(Value::String(a)), Some(Value::String(b))) if a.chars().count().max(b.chars().count()) > WIDTH => {
                let (a, b) = around_difference(a, b);
                format!("{k} {} → {}", shown(Some(&Value::String(a))), shown(Some(&Value::String(b))))
            }
            (a, b) => format!("{k} {} → {}", shown(a), shown(b)),
        })
        .collect()
}

/// The part of two strings between their common start and end, with a little of each either side.
fn around_difference(a: &str, b: &str) -> (String, String) {
    const CONTEXT: usize = 12;
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let prefix = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let room = a.len().min(b.len()) - prefix;
    let suffix = a.iter().rev().zip(b.iter().rev()).take(room).take_while(|(x, y)| x == y).count();
    let start = prefix.saturating_sub(CONTEXT);
    let cut = |s: &[char]| {
        let end = (s.len() - suffix + CONTEXT).min(s.len());
        let middle: String = s[start..end].iter().collect();
        format!("{}{middle}{}", if start > 0 { "…" } else { "" }, if end < s.len() { "…" } else { "" })
    };
    (cut(&a), cut(&b))
}

/// Each input whose content hash differs, is new or is gone; a manifest of an upstream stage by its stage.
pub fn input_changes(before: &BTreeMap<String, String>, now: &BTreeMap<String, String>) -> Vec<String> {
    let keys: BTreeSet<&String> = before.keys().chain(now.keys()).collect();
    keys.into_iter()
        .filter_map(|k| {
            let upstream = k.strip_prefix("manifests/").and_then(|s| s.strip_suffix(".json"));
            match (before.get(k), now.get(k), upstream) {
                (Some(a), Some(b), _) if a == b => None,
                (Some(_), Some(_), Some(up)) => Some(format!("{up} ran again")),
                (Some(_), Some(_), None) => Some(format!("{k} changed")),
                (None, _, Some(up)) => Some(format!("{up} has run since")),
                (None, _, None) => Some(format!("{k} is new")),
                (_, None, Some(up)) => Some(format!("{up}'s manifest is gone")),
                (_, None, None) => Some(format!("{k} is gone")),
            }
        })
        .collect()
}

/// Objects flattened to dotted keys (an empty one has none); any other value (arrays too) is one leaf.
fn leaves(prefix: &str, value: &Value, out: &mut BTreeMap<String, Value>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                leaves(&key, v, out);
            }
        }
        _ => {
            out.insert(prefix.to_string(), value.clone());
        }
    }
}

/// The widest value a reason shows.
const WIDTH: usize = 48;

fn shown(value: Option<&Value>) -> String {
    let Some(value) = value else { return "(unset)".into() };
    let text = value.to_string();
    if text.chars().count() <= WIDTH {
        return text;
    }
    let cut: String = text.chars().take(WIDTH - 1).collect();
    format!("{cut}…")
}

/// The reasons as one terminal line: the first few, then how many more.
pub fn brief(reasons: &[String]) -> String {
    const SHOWN: usize = 3;
    let mut line = reasons.iter().take(SHOWN).cloned().collect::<Vec<_>>().join("; ");
    if reasons.len() > SHOWN {
        line.push_str(&format!("; and {} more (kiln sft --dry-run lists them)", reasons.len() - SHOWN));
    }
    line
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn manifest(stage: Stage, params: Value, inputs: &[(&str, &str)], fingerprint: &str) -> Manifest {
        Manifest {
            stage,
            kiln: env!("CARGO_PKG_VERSION").into(),
            fingerprint: fingerprint.into(),
            inputs: inputs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            params,
            outputs: vec!["eval/base.json".into()],
            counts: Value::Null,
            wall_seconds: 1.0,
            finished_at: String::new(),
        }
    }

    fn plan(params: Value, inputs: &[(&str, &str)]) -> StagePlan {
        StagePlan { params, inputs: inputs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect() }
    }

    fn judge<'a>(stage: Stage, previous: Option<&'a Manifest>, plan: &'a StagePlan, fp: &'a str) -> Judgement<'a> {
        Judgement {
            stage,
            previous,
            plan,
            fingerprint: fp,
            missing_outputs: Vec::new(),
            from: None,
            upstream_running: Vec::new(),
        }
    }

    fn reasons(d: Decision) -> Vec<String> {
        match d {
            Decision::Run { reasons } => reasons,
            other => panic!("expected a run, got {other:?}"),
        }
    }

    #[test]
    fn an_unchanged_stage_is_skipped_and_a_changed_one_says_what_changed() {
        let params = json!({"eval": {"limit": 3, "scorer": "v2", "tasks": []}, "device": "cpu"});
        let inputs = [("manifests/export.json", "aa"), ("replay/r.jsonl", "bb")];
        let m = manifest(Stage::Eval, params.clone(), &inputs, "f1");
        let same = plan(params, &inputs);
        assert_eq!(decide(&judge(Stage::Eval, Some(&m), &same, "f1")), Decision::Skip { fingerprint: "f1".into() });

        let changed = plan(
            json!({"eval": {"limit": 2, "scorer": "v2", "tasks": ["a"], "batch": 4}, "device": "cpu"}),
            &[("manifests/export.json", "a2"), ("manifests/pull.json", "cc"), ("replay/s.jsonl", "bb")],
        );
        assert_eq!(
            reasons(decide(&judge(Stage::Eval, Some(&m), &changed, "f2"))),
            [
                "export ran again",
                "pull has run since",
                "eval.batch (unset) → 4",
                "eval.limit 3 → 2",
                "eval.tasks [] → [\"a\"]",
                "replay/r.jsonl is gone",
                "replay/s.jsonl is new",
            ]
        );
    }

    #[test]
    fn forced_missing_and_first_runs_say_so() {
        let m = manifest(Stage::Eval, json!({}), &[], "f1");
        let p = plan(json!({}), &[]);
        let forced = Judgement { from: Some(Stage::Export), ..judge(Stage::Eval, Some(&m), &p, "f1") };
        assert_eq!(reasons(decide(&forced)), ["--from export"]);
        // Before --from, a manifest of another kiln vouches for the stage; a changed setting does not.
        let older = Manifest { kiln: "0.0.1".into(), ..m.clone() };
        let before = Judgement { from: Some(Stage::Card), ..judge(Stage::Eval, Some(&older), &p, "f-other") };
        assert!(matches!(decide(&before), Decision::Skip { .. }));
        let p2 = plan(json!({"limit": 2}), &[]);
        let before = Judgement { from: Some(Stage::Card), ..judge(Stage::Eval, Some(&m), &p2, "f-other") };
        assert_eq!(reasons(decide(&before)), ["limit (unset) → 2"]);
        let lost =
            Judgement { missing_outputs: vec!["eval/base.json".into()], ..judge(Stage::Eval, Some(&m), &p, "f1") };
        assert_eq!(reasons(decide(&lost)), ["eval/base.json is missing"]);
        let first = Judgement { upstream_running: vec![Stage::Export], ..judge(Stage::Eval, None, &p, "f1") };
        assert_eq!(reasons(decide(&first)), [FIRST_RUN], "a first run needs no other reason");
        let old = Manifest { kiln: "0.0.1".into(), ..m.clone() };
        assert_eq!(
            reasons(decide(&judge(Stage::Eval, Some(&old), &p, "f2"))),
            [format!("kiln 0.0.1 → {}", env!("CARGO_PKG_VERSION"))]
        );
    }

    #[test]
    fn a_dry_run_says_which_upstream_stages_run_first_and_what_else_changed() {
        let m = manifest(Stage::Train, json!({"train": {"lr": 0.003}}), &[("manifests/prepare.json", "aa")], "f1");
        let p = plan(json!({"train": {"lr": 1e-5}}), &[("manifests/prepare.json", "aa")]);
        let j = Judgement { upstream_running: vec![Stage::Prepare], ..judge(Stage::Train, Some(&m), &p, "f1") };
        assert_eq!(reasons(decide(&j)), ["prepare runs first", "train.lr 0.003 → 0.00001"]);
        // An upstream stage that runs makes its readers run, whatever their own inputs say.
        let same = plan(json!({"train": {"lr": 0.003}}), &[("manifests/prepare.json", "aa")]);
        let j = Judgement { upstream_running: vec![Stage::Prepare], ..judge(Stage::Train, Some(&m), &same, "f1") };
        assert_eq!(reasons(decide(&j)), ["prepare runs first"]);
    }

    #[test]
    fn long_values_and_many_reasons_are_cut_for_the_terminal() {
        let long = "x".repeat(100);
        let changes = param_changes(&json!({"a": long}), &json!({"a": "y"}));
        assert_eq!(changes[0].chars().filter(|c| *c == 'x').count(), 46, "{changes:?}");
        assert!(changes[0].ends_with("x… → \"y\""), "{changes:?}");
        let a = format!("kiln sft --model fast --device cpu --pipeline {} --set x=1", "p/".repeat(20));
        let b = a.replace("x=1", "x=2 --set y=3");
        assert_eq!(
            param_changes(&json!({"c": a}), &json!({"c": b})),
            ["c \"…/p/ --set x=1\" → \"…/p/ --set x=2 --set y=3\""]
        );
        let reasons: Vec<String> = (0..5).map(|i| format!("r{i}")).collect();
        assert_eq!(brief(&reasons), "r0; r1; r2; and 2 more (kiln sft --dry-run lists them)");
        assert_eq!(brief(&reasons[..2]), "r0; r1");
    }
}
