//! The pipeline's inputs as files: model configs (`configs/models/<name>.toml`: where the model comes from,
//! its template policy, data mix, eval and training recipe) and pipeline definitions
//! (`pipelines/<name>.toml`: which stages, in what order, with what defaults).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::PipelineError;
use crate::chat::{SampleMode, Thinking};
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
    pub seq_len: usize,
    #[serde(default = "default_layout")]
    pub layout: Layout,
    #[serde(default = "default_truncation")]
    pub truncation: Truncation,
    /// The date templates see through `strftime_now`, pinned so renders are reproducible.
    #[serde(default = "default_date")]
    pub template_date: String,
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
        let text = std::fs::read_to_string(&path).map_err(|e| PipelineError::io(&path, e))?;
        let config: ModelConfig =
            toml::from_str(&text).map_err(|e| PipelineError::Config { path: path.clone(), message: e.to_string() })?;
        config.validate().map_err(|message| PipelineError::Config { path, message })?;
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
        match (&self.model.hub, &self.model.local) {
            (Some(_), None) | (None, Some(_)) => {}
            _ => {
                return Err(
                    "[model] needs exactly one of `hub` (a Hub repo) or `local` (a folder to initialize)".into()
                );
            }
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
                message: "stages must be listed once each, in pipeline order (pull, prepare, inspect, train, export, eval, select, card)".into(),
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
        ] {
            std::fs::write(dir.path().join(format!("{name}.toml")), shipped.replace(from, to)).unwrap();
            let err = ModelConfig::find(name, dir.path()).unwrap_err().to_string();
            assert!(err.contains(&format!("{name}.toml")) && err.contains(expected), "{err}");
        }
    }
}
