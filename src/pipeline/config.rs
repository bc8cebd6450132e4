//! The pipeline's inputs as files: model configs (`configs/models/<name>.toml`: where the model comes from,
//! its template policy, data mix, eval and training recipe) and pipeline definitions
//! (`pipelines/<name>.toml`: which stages, in what order, with what defaults).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::PipelineError;
use crate::chat::{PromptRule, SampleMode, Thinking, ToolResults};
use crate::eval::ScorerVersion;
use crate::tokens::mask::Truncation;
use crate::tokens::shards::Layout;
use crate::train::TrainConfig;

/// Where the base model comes from: a Hub repo (pulled at a revision) or a local folder of config, tokenizer
/// and template initialized with random weights (the offline default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSource {
    pub hub: Option<String>,
    #[serde(default = "main_revision")]
    pub revision: String,
    /// File globs that must be in the repo (the pull stage also takes the usual optional files: generation
    /// config, special tokens, template, index, README and LICENSE).
    #[serde(default = "model_files")]
    pub files: Vec<String>,
    /// A checkpoint folder on disk (config.json, safetensors weights, tokenizer and template: an earlier
    /// run's `best/`, or a model fetched by other means), fine-tuned from its weights as they are and read in
    /// place (relative to the project). `kiln sft --base DIR` puts one in place of the config's model.
    pub checkpoint: Option<PathBuf>,
    /// A folder with config.json and the tokenizer / template files, initialized randomly (relative to the
    /// project).
    pub local: Option<PathBuf>,
    #[serde(default)]
    pub init_seed: u64,
    /// Full fine-tuning needs a GPU: the pipeline refuses to start without one, before downloading anything.
    #[serde(default)]
    pub gpu: bool,
    /// Parameter count as published, for messages and the card.
    pub parameters: Option<String>,
}

fn main_revision() -> String {
    "main".into()
}

fn model_files() -> Vec<String> {
    ["config.json", "tokenizer.json", "tokenizer_config.json", "*.safetensors"].map(String::from).to_vec()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplatePolicy {
    #[serde(default = "default_thinking")]
    pub thinking: Thinking,
    #[serde(default = "default_mode")]
    pub mode: SampleMode,
    /// Template variables (`enable_thinking`, …) for training renders.
    #[serde(default)]
    pub vars: Map<String, Value>,
    /// A template file used instead of the checkpoint's (relative to the project).
    pub file: Option<PathBuf>,
    pub end_of_turn: Option<String>,
    /// What the template gets for results of calls written in the text (ReAct): `tool` (as they are) or
    /// `user` messages. Left out of the stage fingerprint when `tool`, so older runs stay up to date.
    #[serde(default, skip_serializing_if = "ToolResults::is_tool")]
    pub tool_results: ToolResults,
    /// Where the generation prompt is not a prefix of a turn's render: refuse the turn (`prefix`) or train its
    /// text after the prompt (`splice`). Left out of the stage fingerprint when `prefix`, as `tool_results`.
    #[serde(default, skip_serializing_if = "PromptRule::is_prefix")]
    pub prompt_rule: PromptRule,
}

fn default_thinking() -> Thinking {
    Thinking::StripHistory
}

fn default_mode() -> SampleMode {
    SampleMode::Auto
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataPlan {
    /// Dataset recipes (names in datasets/ or paths).
    pub recipes: Vec<String>,
    /// Mixing weight per recipe, applied to each of its sources (1.0 when absent).
    #[serde(default)]
    pub weights: BTreeMap<String, f64>,
    /// Eval sets whose tasks are removed from the training data (relative to the project).
    #[serde(default)]
    pub decontaminate: Vec<PathBuf>,
    /// Drop conversations identical (messages, calls, reasoning, tools; not their ids) to one already kept
    /// from any recipe, as `duplicate`: mixes of overlapping releases of one corpus train each once.
    #[serde(default)]
    pub dedupe: bool,
    pub seq_len: usize,
    #[serde(default = "default_layout")]
    pub layout: Layout,
    #[serde(default = "default_truncation")]
    pub truncation: Truncation,
    /// The date templates see through `strftime_now`, pinned so renders are reproducible.
    #[serde(default = "default_date")]
    pub template_date: String,
    /// The share of conversations (by task where the data names one) held out as the validation split,
    /// whose loss the trainer reports for the base model and every epoch; 0 holds out none.
    #[serde(default)]
    pub validation_share: f64,
}

fn default_layout() -> Layout {
    Layout::Packed
}

fn default_truncation() -> Truncation {
    Truncation::Drop
}

fn default_date() -> String {
    "2026-01-01".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalPlan {
    /// TB2-lite replay steps (JSONL, relative to the project).
    pub replay: PathBuf,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    #[serde(default = "default_eval_batch")]
    pub batch_size: usize,
    /// At most this many prompt tokens a batch (`EvalOptions::batch_tokens`).
    #[serde(default = "crate::eval::run::default_batch_tokens")]
    pub batch_tokens: usize,
    #[serde(default)]
    pub scorer: ScorerVersion,
    pub enable_thinking: Option<bool>,
    #[serde(default)]
    pub strip_thinking_history: bool,
    /// Only the first N steps (smoke runs).
    pub limit: Option<usize>,
}

impl EvalPlan {
    /// The evaluation settings of every candidate (all replay tasks).
    pub fn options(&self) -> crate::eval::run::EvalOptions {
        crate::eval::run::EvalOptions {
            max_tokens: self.max_tokens,
            batch_size: self.batch_size,
            batch_tokens: self.batch_tokens,
            enable_thinking: self.enable_thinking,
            strip_thinking_history: self.strip_thinking_history,
            scorer: self.scorer,
            limit: self.limit,
            tasks: Vec::new(),
        }
    }
}

fn default_max_tokens() -> usize {
    1024
}

fn default_eval_batch() -> usize {
    8
}

/// `configs/models/<name>.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    pub description: String,
    pub architecture: String,
    /// The base model's license (the card copies it; a Hub base's own README front matter wins).
    pub license: Option<String>,
    #[serde(default)]
    pub languages: Vec<String>,
    /// The Hub repo the fine-tuned model is to be published as (`owner/name`): the checkpoint's own card loads
    /// it from there in its quickstart, and the push stage uploads the selected checkpoint there.
    pub publish_repo: Option<String>,
    /// The push stage uploads the selected checkpoint (`best/`, its card included) to `publish_repo`.
    #[serde(default)]
    pub push: bool,
    /// A `publish_repo` the push creates is private (an existing repo keeps its visibility).
    #[serde(default)]
    pub publish_private: bool,
    pub model: ModelSource,
    pub template: TemplatePolicy,
    pub data: DataPlan,
    pub eval: EvalPlan,
    pub train: TrainConfig,
}

const ARCHITECTURES: &[&str] = &["lfm2", "lfm2_moe", "qwen3_5", "gemma4"];

impl ModelConfig {
    /// `name` in `configs_dir` (`<name>.toml`), or a path to a TOML file.
    pub fn find(name: &str, configs_dir: &Path) -> Result<ModelConfig, PipelineError> {
        Self::find_with(name, configs_dir, &[], &[])
    }

    /// As `find`, with `defaults` set where the file leaves their keys out (the pipeline's epochs), then
    /// `overrides` (`kiln sft --set`) applied in order and checked together; a refusal names the setting at
    /// fault.
    pub fn find_with(
        name: &str,
        configs_dir: &Path,
        defaults: &[ConfigOverride],
        overrides: &[ConfigOverride],
    ) -> Result<ModelConfig, PipelineError> {
        let path = config_path(name, configs_dir)?;
        let text = std::fs::read_to_string(&path).map_err(|e| PipelineError::io(&path, e))?;
        let file_error = |message: String| PipelineError::Config { path: path.clone(), message };
        // Read from the text first for a syntax or schema error that points at the file's line.
        toml::from_str::<ModelConfig>(&text).map_err(|e| file_error(e.to_string()))?;
        let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| file_error(e.to_string()))?;
        for default in defaults {
            default.apply(&mut table, false).map_err(&file_error)?;
        }
        let config = Self::from_table(table.clone()).map_err(&file_error)?;
        if overrides.is_empty() {
            return Ok(config);
        }
        // Checked together, as a setting may only make sense beside another (`model.local=` with
        // `model.checkpoint=…`); a refusal names the setting that fails alone in the same way, else all of them.
        let all: Vec<&ConfigOverride> = overrides.iter().collect();
        Self::with_settings(&table, &all).map_err(|(mut setting, message)| {
            let alone =
                |o: &&ConfigOverride| Self::with_settings(&table, &[o]).err().is_some_and(|(_, m)| m == message);
            if let Some(culprit) = overrides.iter().find(alone) {
                setting = culprit.text.clone();
            }
            PipelineError::Override { setting, path: path.clone(), message }
        })
    }

    /// `table` with `settings` applied, read and checked; a refusal comes with the settings it is about.
    fn with_settings(table: &toml::Table, settings: &[&ConfigOverride]) -> Result<ModelConfig, (String, String)> {
        let mut changed = table.clone();
        for o in settings {
            o.apply(&mut changed, true).map_err(|message| (o.text.clone(), message))?;
        }
        let texts: Vec<&str> = settings.iter().map(|o| o.text.as_str()).collect();
        Self::from_table(changed).map_err(|message| (texts.join(" --set "), message))
    }

    fn from_table(table: toml::Table) -> Result<ModelConfig, String> {
        let config: ModelConfig = table.try_into().map_err(|e: toml::de::Error| e.message().to_string())?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        if !ARCHITECTURES.contains(&self.architecture.as_str()) {
            return Err(format!(
                "architecture '{}' is not supported yet (supported: {})",
                self.architecture,
                ARCHITECTURES.join(", ")
            ));
        }
        let sources = [self.model.hub.is_some(), self.model.checkpoint.is_some(), self.model.local.is_some()];
        if sources.into_iter().filter(|&given| given).count() != 1 {
            return Err(
                "[model] needs exactly one of `hub` (a Hub repo), `checkpoint` (a checkpoint folder) or `local` \
                 (a folder to initialize); `kiln sft --base DIR` replaces the model with a checkpoint folder"
                    .into(),
            );
        }
        if let Some(repo) = self.publish_repo.as_deref().filter(|r| !crate::hub::is_repo_id(r)) {
            return Err(format!("publish_repo '{repo}' is not a Hub repo id (owner/name)"));
        }
        if self.push && self.publish_repo.is_none() {
            return Err("push = true needs publish_repo, the Hub repo (owner/name) to push to".into());
        }
        if self.data.seq_len < 2 {
            return Err(format!("[data] seq_len is {}: a row needs at least 2 tokens", self.data.seq_len));
        }
        if self.data.recipes.is_empty() {
            return Err("[data] recipes is empty".into());
        }
        if let Some(bad) = self.data.weights.keys().find(|k| !self.data.recipes.contains(k)) {
            return Err(format!("[data] weights names '{bad}', which is not in recipes"));
        }
        crate::tokens::prepare::check_validation_share(self.data.validation_share)
            .map_err(|e| format!("[data] {e}"))?;
        self.eval.options().check().map_err(|e| format!("[eval] {e}"))?;
        self.train.check()
    }
}

/// The model names with a config in `configs_dir`, sorted.
pub fn known_models(configs_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(configs_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let path = e.path();
            if path.extension()? != "toml" {
                return None;
            }
            Some(path.file_stem()?.to_string_lossy().into_owned())
        })
        .collect();
    names.sort();
    names
}

/// The file of model `name`: `<configs_dir>/<name>.toml`, or `name` itself when it is a TOML file.
fn config_path(name: &str, configs_dir: &Path) -> Result<PathBuf, PipelineError> {
    let direct = Path::new(name);
    let path = if direct.extension().is_some_and(|e| e == "toml") && direct.is_file() {
        direct.to_path_buf()
    } else {
        configs_dir.join(format!("{name}.toml"))
    };
    if !path.is_file() {
        return Err(PipelineError::UnknownModel {
            name: name.to_string(),
            dir: configs_dir.to_path_buf(),
            known: known_models(configs_dir).join(", "),
        });
    }
    Ok(path)
}

/// One `kiln sft --set KEY=VALUE`: a dotted key into the model config (`train.lr`, `train.adamw.moments`,
/// `data.weights.terminal`, `eval.max_tokens`) and its value, a TOML literal (`2e-5`, `true`, `["a", "b"]`,
/// `"text"`) or else the text as a string (`linear`, `bf16`, a path), so a shell needs no extra quotes. No
/// value (`eval.limit=`) removes the key, so its default applies.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigOverride {
    path: Vec<String>,
    /// `None`: remove the key.
    value: Option<toml::Value>,
    /// As given, for messages.
    pub text: String,
}

impl std::str::FromStr for ConfigOverride {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (key, raw) =
            text.split_once('=').ok_or_else(|| format!("'{text}' is not KEY=VALUE (for example train.lr=1e-5)"))?;
        let key = key.trim();
        let path: Vec<String> = key.split('.').map(str::to_string).collect();
        let is_key_part =
            |p: &String| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || "_-".contains(c));
        if !path.iter().all(is_key_part) {
            return Err(format!("'{key}' is not a dotted config key (for example train.lr or train.adamw.moments)"));
        }
        let raw = raw.trim();
        let value = (!raw.is_empty()).then(|| toml_literal(raw));
        Ok(ConfigOverride { path, value, text: text.to_string() })
    }
}

impl ConfigOverride {
    /// The dotted key.
    pub fn key(&self) -> String {
        self.path.join(".")
    }

    /// Sets the value in `table`, making the tables on its way, or removes the key; over a value already
    /// there only when `replace`.
    fn apply(&self, table: &mut toml::Table, replace: bool) -> Result<(), String> {
        let (last, parents) = self.path.split_last().ok_or("an empty key")?;
        let mut at = table;
        for (i, part) in parents.iter().enumerate() {
            let next = at.entry(part.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
            at = next.as_table_mut().ok_or_else(|| format!("{} is not a table", self.path[..=i].join(".")))?;
        }
        match &self.value {
            None if replace => {
                at.remove(last);
            }
            Some(value) if replace || !at.contains_key(last) => {
                at.insert(last.clone(), value.clone());
            }
            _ => {}
        }
        Ok(())
    }
}

/// `raw` as a TOML value where it is one, else as a string. A date or time stays the string it was typed as:
/// no config key takes TOML's date type (`data.template_date` is text).
fn toml_literal(raw: &str) -> toml::Value {
    match format!("value = {raw}").parse::<toml::Table>().map(|mut t| t.remove("value")) {
        Ok(Some(toml::Value::Datetime(_))) | Ok(None) | Err(_) => toml::Value::String(raw.to_string()),
        Ok(Some(value)) => value,
    }
}

/// `pipelines/<name>.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineDef {
    pub name: String,
    pub description: String,
    pub stages: Vec<super::Stage>,
    pub defaults: PipelineDefaults,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineDefaults {
    pub epochs: usize,
    /// Where runs go; each run is `<runs_dir>/<run>` (the run name defaults to the model name).
    pub runs_dir: PathBuf,
    /// Random examples in the inspection report.
    pub inspect_examples: usize,
}

impl PipelineDef {
    pub fn load(path: &Path) -> Result<PipelineDef, PipelineError> {
        let text = std::fs::read_to_string(path).map_err(|e| PipelineError::io(path, e))?;
        let def: PipelineDef = toml::from_str(&text)
            .map_err(|e| PipelineError::Config { path: path.to_path_buf(), message: e.to_string() })?;
        let mut sorted = def.stages.clone();
        sorted.sort();
        sorted.dedup();
        if sorted != def.stages {
            return Err(PipelineError::Config {
                path: path.to_path_buf(),
                message: "stages must be listed once each, in pipeline order (pull, prepare, inspect, train, export, eval, select, card, push)".into(),
            });
        }
        Ok(def)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every model config the project ships parses and validates; the 8–9B ones (Gemma 4 E4B: 8 B with its
    /// embeddings) keep 8-bit moments, without which they do not train on one H200 (docs/TRAINING.md,
    /// Precision).
    #[test]
    fn every_shipped_model_config_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models");
        let names = known_models(&dir);
        assert!(names.len() >= 8, "{names:?}");
        for name in &names {
            let config = ModelConfig::find(name, &dir).unwrap_or_else(|e| panic!("{name}: {e}"));
            let q8 = config.train.adamw.moments == crate::train::optim::MomentDtype::Q8;
            assert_eq!(q8, ["lfm2.5-8b", "qwen3.5-9b", "gemma-4-e4b"].contains(&name.as_str()), "{name}: moments");
        }
    }

    /// A [train] or [data] setting that makes no run is refused when the config loads, naming the file and
    /// the key.
    #[test]
    fn a_config_that_cannot_run_is_refused_on_load() {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/tiny.toml");
        let shipped = std::fs::read_to_string(&shipped).unwrap();
        let dir = tempfile::tempdir().unwrap();
        for (name, from, to, expected) in [
            ("zero-lr", "lr = 4e-3", "lr = 0.0", "train.lr is 0"),
            ("one-token", "seq_len = 1024", "seq_len = 1", "[data] seq_len is 1"),
            ("no-tokens", "max_tokens = 256", "max_tokens = 0", "[eval] max_tokens is 0"),
            ("two-sources", "init_seed = 0", "init_seed = 0\ncheckpoint = \"runs/tiny/best\"", "needs exactly one of"),
        ] {
            std::fs::write(dir.path().join(format!("{name}.toml")), shipped.replace(from, to)).unwrap();
            let err = ModelConfig::find(name, dir.path()).unwrap_err().to_string();
            assert!(err.contains(&format!("{name}.toml")) && err.contains(expected), "{err}");
        }
    }

    fn set(text: &str) -> ConfigOverride {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    /// `--set` values are TOML literals where they are one and strings otherwise; a date stays the text typed.
    #[test]
    fn a_setting_reads_its_value_as_toml_or_else_as_text() {
        for (text, value) in [
            ("train.lr=1e-5", toml::Value::Float(1e-5)),
            ("train.global_batch=64", toml::Value::Integer(64)),
            ("train.activation_checkpointing=true", toml::Value::Boolean(true)),
            ("train.decay=linear", toml::Value::String("linear".into())),
            ("train.decay=\"linear\"", toml::Value::String("linear".into())),
            ("data.template_date=2026-03-01", toml::Value::String("2026-03-01".into())),
            ("eval.replay=../shared/data/tb2lite/replay_full.jsonl", "../shared/data/tb2lite/replay_full.jsonl".into()),
            (
                "data.recipes=[\"terminal\", \"toolbench\"]",
                toml::Value::Array(vec!["terminal".into(), "toolbench".into()]),
            ),
            ("template.vars.note=a=b", toml::Value::String("a=b".into())),
            ("template.vars.note='' ", toml::Value::String(String::new())),
        ] {
            assert_eq!(set(text).value, Some(value), "{text}");
        }
        assert_eq!(set(" train.adamw.beta2 = 0.95").key(), "train.adamw.beta2");
        assert_eq!(set("eval.limit=").value, None, "no value: the key is removed");
        for (bad, expected) in [
            ("train.lr", "is not KEY=VALUE"),
            ("=1", "'' is not a dotted config key"),
            ("train..lr=1", "'train..lr' is not a dotted config key"),
            ("train lr=1", "'train lr' is not a dotted config key"),
        ] {
            let err = bad.parse::<ConfigOverride>().unwrap_err();
            assert!(err.contains(expected), "{bad}: {err}");
        }
    }

    /// Settings reach every part of the config (nested tables made on the way, maps keyed by recipe); the
    /// pipeline's epochs fill in only where the file names none; a setting the config cannot take is refused
    /// naming it and the file.
    #[test]
    fn settings_override_the_model_config_and_bad_ones_are_named() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models");
        let epochs = [set("train.epochs=2")];
        let shipped = ModelConfig::find_with("tiny", &dir, &epochs, &[]).unwrap();
        assert_eq!(
            shipped,
            ModelConfig {
                train: TrainConfig { epochs: 2, ..shipped.train.clone() },
                ..ModelConfig::find("tiny", &dir).unwrap()
            }
        );
        let overrides = [
            "train.lr=1e-3",
            "train.decay=linear",
            "train.adamw.moments=bf16",
            "train.adamw.masters=stochastic",
            "train.adamw.beta2=0.95",
            "data.seq_len=512",
            "data.weights.terminal-synth=0.1",
            "eval.limit=5",
            "template.vars.enable_thinking=false",
            "train.lr=2e-3",
            "train.max_grad_norm=0",
            "publish_repo=me/tiny-terminal",
        ]
        .map(set);
        let c = ModelConfig::find_with("tiny", &dir, &epochs, &overrides).unwrap();
        assert_eq!(
            (c.train.lr, c.train.decay, c.train.adamw.beta2),
            (2e-3, crate::train::schedule::Decay::Linear, 0.95)
        );
        assert_eq!(c.train.adamw.moments, crate::train::optim::MomentDtype::Bf16);
        assert_eq!(c.train.adamw.masters, crate::train::optim::Masters::Stochastic);
        assert_eq!((c.data.seq_len, c.data.weights["terminal-synth"], c.eval.limit), (512, 0.1, Some(5)));
        assert_eq!(c.template.vars["enable_thinking"], serde_json::Value::Bool(false));
        assert_eq!((c.train.epochs, c.train.global_batch), (2, shipped.train.global_batch));
        assert_eq!((c.train.max_grad_norm, c.publish_repo.as_deref()), (None, Some("me/tiny-terminal")), "no clipping");
        // A key set to nothing is removed, so its default applies; a model source can be swapped that way.
        let limited = ModelConfig::find_with("tiny", &dir, &epochs, &[set("eval.limit=5"), set("eval.limit=")]);
        assert_eq!(limited.unwrap().eval.limit, None);
        let swapped = [set("model.local="), set("model.checkpoint=runs/tiny/best")];
        let swapped = ModelConfig::find_with("tiny", &dir, &epochs, &swapped).unwrap().model;
        assert_eq!((swapped.local, swapped.checkpoint), (None, Some(PathBuf::from("runs/tiny/best"))));
        // Beside such a pair, a refusal still names the one setting that is wrong on its own.
        let typo = [set("model.local="), set("model.checkpoint=runs/tiny/best"), set("train.lrr=1")];
        let err = ModelConfig::find_with("tiny", &dir, &epochs, &typo).unwrap_err().to_string();
        assert!(err.starts_with("--set train.lrr=1 (over ") && err.contains("unknown field `lrr`"), "{err}");
        let err = ModelConfig::find_with("tiny", &dir, &epochs, &typo[..1]).unwrap_err().to_string();
        assert!(err.starts_with("--set model.local= (over ") && err.contains("needs exactly one of"), "{err}");
        // A `[train] epochs` in the file wins over the pipeline's default; a setting wins over both.
        let tmp = tempfile::tempdir().unwrap();
        let text =
            std::fs::read_to_string(dir.join("tiny.toml")).unwrap().replace("[train]\n", "[train]\nepochs = 3\n");
        std::fs::write(tmp.path().join("three.toml"), text).unwrap();
        assert_eq!(ModelConfig::find_with("three", tmp.path(), &epochs, &[]).unwrap().train.epochs, 3);
        assert_eq!(
            ModelConfig::find_with("three", tmp.path(), &epochs, &[set("train.epochs=1")]).unwrap().train.epochs,
            1
        );

        for (bad, expected) in [
            ("train.lrr=1e-5", "unknown field `lrr`"),
            ("train.lr=fast", "invalid type: string \"fast\""),
            ("train.lr=0", "train.lr is 0"),
            ("data.seq_len=1", "[data] seq_len is 1"),
            ("data.weights.nosuch=1.0", "weights names 'nosuch'"),
            ("data.validation_share=1", "[data] validation_share is 1: it must be at least 0 and below 1"),
            ("train.validation_every=0", "train.validation_every is 0"),
            ("train.lr.peak=1", "train.lr is not a table"),
            ("eval.max_tokens=0", "[eval] max_tokens is 0"),
            ("data.seq_len=", "missing field `seq_len`"),
        ] {
            let err = ModelConfig::find_with("tiny", &dir, &epochs, &[set("train.lr=1e-3"), set(bad)]).unwrap_err();
            let err = err.to_string();
            assert!(
                err.starts_with(&format!("--set {bad} (over ")) && err.contains("tiny.toml") && err.contains(expected),
                "{bad}: {err}"
            );
        }
    }
}
