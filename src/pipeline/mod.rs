//! `kiln sft`: the stage runner. Runs a pipeline definition's stages in order into `runs/<run>/`, each
//! writing `manifests/<stage>.json` (what went in, by content hash; parameters; counts; wall time). A
//! stage whose inputs fingerprint equals its manifest's, and whose outputs are all present, is skipped, so
//! a re-run resumes where it stopped; an interrupted train stage resumes from its saved state. A dry run
//! (`kiln sft --dry-run`) decides every stage the same way and writes nothing.

pub mod config;
pub mod stages;
pub mod status;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use config::{ConfigOverride, ModelConfig, PipelineDef, known_models};
pub use status::Decision;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Pull,
    Prepare,
    Inspect,
    Train,
    Export,
    Eval,
    Select,
    Card,
    Push,
}

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Pull => "pull",
            Stage::Prepare => "prepare",
            Stage::Inspect => "inspect",
            Stage::Train => "train",
            Stage::Export => "export",
            Stage::Eval => "eval",
            Stage::Select => "select",
            Stage::Card => "card",
            Stage::Push => "push",
        }
    }

    /// The stages whose outputs this one reads: their manifests are part of its inputs.
    pub fn upstream(self) -> &'static [Stage] {
        match self {
            Stage::Pull => &[],
            Stage::Prepare => &[Stage::Pull],
            Stage::Inspect => &[Stage::Prepare],
            Stage::Train => &[Stage::Pull, Stage::Prepare],
            Stage::Export => &[Stage::Train],
            Stage::Eval => &[Stage::Pull, Stage::Export],
            Stage::Select => &[Stage::Eval],
            Stage::Card => &[Stage::Pull, Stage::Prepare, Stage::Inspect, Stage::Train, Stage::Select],
            Stage::Push => &[Stage::Select, Stage::Card],
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("unknown model '{name}': known models are {known} (configs in {dir})")]
    UnknownModel { name: String, dir: PathBuf, known: String },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    /// A `--set` that the model config `path` cannot take.
    #[error("--set {setting} (over {path}): {message}")]
    Override { setting: String, path: PathBuf, message: String },
    /// A setting the command's flags gave (or left) that the model config's own check would refuse.
    #[error("model '{model}' with the flags given: {message}")]
    Flags { model: String, message: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "model '{model}'{size} needs a GPU for full fine-tuning, and {why}; nothing was downloaded. Run it on a machine with an NVIDIA GPU (make builds with --features cuda when nvcc or a CUDA driver is present), or try MODEL=tiny"
    )]
    NeedsGpu { model: String, size: String, why: String },
    #[error("stage {stage}: {message}")]
    Stage { stage: &'static str, message: String },
    /// The train stage's failure as the trainer said it (a caller tells a model the device's memory cannot
    /// hold, `TrainError::OutOfMemory`, from other failures).
    #[error("stage train: {0}")]
    Train(crate::train::TrainError),
    #[error("training stopped after step {step}{}", if *.saved {
        " with its state saved; run the same command again to resume where it stopped"
    } else {
        " without a state to resume from (train.save_state = false); the same command again trains from the start"
    })]
    Interrupted { step: usize, saved: bool },
    #[error(transparent)]
    RunLock(#[from] crate::files::RunLockError),
}

impl PipelineError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        PipelineError::Io { path: path.to_path_buf(), source }
    }
}

pub(crate) fn write_json(path: &Path, value: &impl Serialize) -> Result<(), PipelineError> {
    crate::files::write_json(path, value).map_err(|e| PipelineError::io(path, e))
}

/// `manifests/<stage>.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub stage: Stage,
    pub kiln: String,
    /// sha256 of the stage, its parameters and its inputs' hashes: equal fingerprints mean the stage would
    /// compute the same thing.
    pub fingerprint: String,
    pub inputs: BTreeMap<String, String>,
    pub params: Value,
    /// Files and folders the stage wrote (relative to the run); all must exist for a skip.
    pub outputs: Vec<String>,
    pub counts: Value,
    pub wall_seconds: f64,
    pub finished_at: String,
}

pub fn manifest_path(run_dir: &Path, stage: Stage) -> PathBuf {
    run_dir.join("manifests").join(format!("{}.json", stage.name()))
}

fn remove_manifest(run_dir: &Path, stage: Stage) -> Result<(), PipelineError> {
    let path = manifest_path(run_dir, stage);
    crate::files::remove_if_present(&path).map_err(|e| PipelineError::io(&path, e))
}

pub fn read_manifest(run_dir: &Path, stage: Stage) -> Option<Manifest> {
    serde_json::from_str(&std::fs::read_to_string(manifest_path(run_dir, stage)).ok()?).ok()
}

pub fn fingerprint(stage: Stage, params: &Value, inputs: &BTreeMap<String, String>) -> String {
    let doc =
        serde_json::json!({"stage": stage, "params": params, "inputs": inputs, "kiln": env!("CARGO_PKG_VERSION")});
    crate::hub::sha256_bytes(doc.to_string().as_bytes())
}

/// What a stage will compute from: its parameters and its inputs' content hashes.
pub struct StagePlan {
    pub params: Value,
    pub inputs: BTreeMap<String, String>,
}

/// What a stage did.
pub struct StageOutcome {
    pub outputs: Vec<String>,
    pub counts: Value,
    /// One line for the terminal.
    pub summary: String,
}

/// A `kiln sft` invocation.
#[derive(Debug, Clone)]
pub struct SftRequest {
    pub model: String,
    /// Model-config keys set for this run (`--set train.lr=1e-5`), applied in order before the flags below.
    pub overrides: Vec<ConfigOverride>,
    /// A checkpoint folder to fine-tune in place of the model config's model (`--base`).
    pub base: Option<PathBuf>,
    pub epochs: Option<usize>,
    pub data: Option<Vec<String>>,
    pub replay: Option<PathBuf>,
    pub run: Option<String>,
    pub from: Option<Stage>,
    pub until: Option<Stage>,
    /// cpu, cuda, or auto (cuda when built with it and a GPU is present).
    pub device: String,
    /// Activation checkpointing on, whatever the model config says.
    pub activation_checkpointing: bool,
    /// Data-parallel devices, instead of the model config's `train.devices`.
    pub devices: Option<usize>,
    pub pipeline: PathBuf,
    pub configs_dir: PathBuf,
    pub datasets_dir: PathBuf,
    /// Stop training after this many steps, as Ctrl-C would (tests of resume).
    pub halt_after: Option<usize>,
    pub show_progress: bool,
    /// The command line that reproduces the run, for the card (`reproduce_command`).
    pub command: String,
}

/// The command line that reproduces a run from `args` (the program's name first): the flags that choose
/// which of its stages run now or how they report (`--from`, `--until`, `--dry-run`, `--quiet`, the tests'
/// `--halt-after`) are left out, so that a run finished with `--from card` documents the command that makes
/// it whole, and rerunning with another of them does not rewrite the card.
pub fn reproduce_command(args: &[String]) -> String {
    const ALONE: [&str; 2] = ["--quiet", "--dry-run"];
    const WITH_VALUE: [&str; 3] = ["--from", "--until", "--halt-after"];
    let mut kept: Vec<&str> = Vec::with_capacity(args.len());
    let mut rest = args.iter().map(String::as_str);
    while let Some(arg) = rest.next() {
        let flag = arg.split_once('=').map_or(arg, |(flag, _)| flag);
        if ALONE.contains(&arg) || (WITH_VALUE.contains(&flag) && flag != arg) {
            continue;
        }
        if WITH_VALUE.contains(&arg) {
            rest.next();
            continue;
        }
        kept.push(arg);
    }
    // Quoting fails only on a NUL byte, which no argument can hold.
    shlex::try_join(kept.iter().copied()).unwrap_or_else(|_| kept.join(" "))
}

/// The end of a run: what was chosen and where everything is.
#[derive(Debug, Clone, Serialize)]
pub struct SftSummary {
    pub run_dir: PathBuf,
    pub stages_run: Vec<Stage>,
    pub stages_skipped: Vec<Stage>,
    pub selected: Option<String>,
    pub selected_score: Option<f64>,
    pub report: Option<PathBuf>,
    pub card: Option<PathBuf>,
    /// The commit of the selected checkpoint on the Hub, where the push stage ran or was up to date.
    pub pushed: Option<String>,
    pub wall_seconds: f64,
}

/// Whether a CUDA device can be used by this build.
pub fn gpu_available() -> bool {
    cfg!(feature = "cuda") && Path::new("/dev/nvidiactl").exists()
}

pub fn resolve_device(requested: &str) -> String {
    match requested {
        "auto" if gpu_available() => "cuda".into(),
        "auto" => "cpu".into(),
        other => other.into(),
    }
}

/// A flag (`--epochs`) and a `--set` of its key that disagree are refused: neither may silently lose.
fn check_flag_agrees(
    overrides: &[ConfigOverride],
    key: &str,
    flag: Option<usize>,
    from_config: usize,
) -> Result<(), String> {
    match (flag, overrides.iter().rfind(|o| o.key() == key)) {
        (Some(value), Some(set)) if value != from_config => {
            let name = key.rsplit('.').next().unwrap_or(key);
            Err(format!("--{name} {value} and --set {} disagree: give one of them", set.text))
        }
        _ => Ok(()),
    }
}

/// The pipeline, the effective model config, the device and the run folder of `req`, every setting checked.
fn resolve(req: &SftRequest) -> Result<(PipelineDef, ModelConfig, String, PathBuf), PipelineError> {
    let def = PipelineDef::load(&req.pipeline)?;
    // The pipeline's epochs where the model config names none; `--set`, then the flags, over both.
    let default_epochs: ConfigOverride = format!("train.epochs={}", def.defaults.epochs)
        .parse()
        .map_err(|message| PipelineError::Config { path: req.pipeline.clone(), message })?;
    let mut config = ModelConfig::find_with(&req.model, &req.configs_dir, &[default_epochs], &req.overrides)?;
    let flags = |message: String| PipelineError::Flags { model: req.model.clone(), message };
    check_flag_agrees(&req.overrides, "train.epochs", req.epochs, config.train.epochs).map_err(flags)?;
    check_flag_agrees(&req.overrides, "train.devices", req.devices, config.train.devices).map_err(flags)?;
    config.train.epochs = req.epochs.unwrap_or(config.train.epochs);
    config.train.devices = req.devices.unwrap_or(config.train.devices);
    config.train.activation_checkpointing |= req.activation_checkpointing;
    if let Some(dir) = &req.base {
        config.model = config::ModelSource { hub: None, local: None, checkpoint: Some(dir.clone()), ..config.model };
    }
    if let Some(data) = &req.data {
        config.data.recipes = data.clone();
        config.data.weights.retain(|k, _| data.contains(k));
    }
    if let Some(replay) = &req.replay {
        config.eval.replay = replay.clone();
    }
    // The flags above may have set what the config file's check passed.
    config.train.check().map_err(flags)?;
    let device = resolve_device(&req.device);
    if config.model.gpu && device != "cuda" {
        let why = if !cfg!(feature = "cuda") {
            "this kiln was built without CUDA".to_string()
        } else if req.device != "auto" {
            format!("--device {} was asked for", req.device)
        } else {
            "no NVIDIA GPU is visible (/dev/nvidiactl is missing)".to_string()
        };
        let size = config.model.parameters.as_ref().map(|p| format!(" ({p} parameters)")).unwrap_or_default();
        return Err(PipelineError::NeedsGpu { model: config.name.clone(), size, why });
    }
    let run_name = req.run.clone().unwrap_or_else(|| config.name.clone());
    let run_dir = def.defaults.runs_dir.join(&run_name);
    Ok((def, config, device, run_dir))
}

/// The stages `req` goes through, in order (those after `--until` left out).
fn stages_of<'a>(def: &'a PipelineDef, req: &'a SftRequest) -> impl Iterator<Item = Stage> + 'a {
    def.stages.iter().copied().filter(|s| req.until.is_none_or(|u| *s <= u))
}

/// What `stage` would compute from now (its plan and fingerprint; none for a stage left out), and whether the
/// run folder already holds it. `upstream_running`: the stages it reads that a dry run found would run first.
fn judge(
    ctx: &stages::Context,
    stage: Stage,
    upstream_running: Vec<Stage>,
) -> Result<(Decision, StagePlan, String), PipelineError> {
    if let Some(why) = stages::off(ctx, stage) {
        let nothing = StagePlan { params: Value::Null, inputs: BTreeMap::new() };
        return Ok((Decision::Off { why: why.to_string() }, nothing, String::new()));
    }
    let plan = stages::plan(ctx, stage)?;
    let fp = fingerprint(stage, &plan.params, &plan.inputs);
    let previous = read_manifest(ctx.run_dir, stage);
    let missing_outputs =
        previous.iter().flat_map(|m| m.outputs.iter()).filter(|o| !ctx.run_dir.join(o).exists()).cloned().collect();
    let decision = status::decide(&status::Judgement {
        stage,
        previous: previous.as_ref(),
        plan: &plan,
        fingerprint: &fp,
        missing_outputs,
        from: ctx.req.from,
        upstream_running,
    });
    // `--from` takes the stages before it as they are, so they must be there, made as this run would make them.
    if let (Decision::Run { reasons }, Some(from)) = (&decision, ctx.req.from.filter(|f| stage < *f)) {
        let message = match reasons.as_slice() {
            [first] if first == status::FIRST_RUN => {
                format!("has not run in {} (--from needs the stages before it done)", ctx.run_dir.display())
            }
            _ => format!(
                "is out of date in {} ({}): --from {} would build on what it made then; run without --from (or --from {})",
                ctx.run_dir.display(),
                status::brief(reasons),
                from.name(),
                stage.name()
            ),
        };
        return Err(PipelineError::Stage { stage: stage.name(), message });
    }
    Ok((decision, plan, fp))
}

/// A stage and what a run does with it.
#[derive(Debug, Clone, Serialize)]
pub struct StageStatus {
    pub stage: Stage,
    #[serde(flatten)]
    pub decision: Decision,
    /// The eval stage's, when it would run with no stage before it running first: each candidate's result
    /// kept or evaluated (after the batches its journal holds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidates: Option<Vec<stages::EvalCandidate>>,
}

/// A dry run's answer: what `kiln sft` with the same arguments would run and skip, and why.
#[derive(Debug, Clone, Serialize)]
pub struct SftPlan {
    pub run_dir: PathBuf,
    pub device: String,
    pub stages: Vec<StageStatus>,
}

/// Decides every stage of `req` as `run_sft` would, after the same checks, and writes nothing: a stage that
/// reads one that would run would run too.
pub fn plan_sft(req: &SftRequest) -> Result<SftPlan, PipelineError> {
    let (def, config, device, run_dir) = resolve(req)?;
    let stop = crate::train::StopRequest::default();
    let ctx = stages::Context { req, def: &def, config: &config, run_dir: &run_dir, device: &device, stop: &stop };
    stages::preflight(&ctx)?;
    let mut planned: Vec<StageStatus> = Vec::new();
    for stage in stages_of(&def, req) {
        let runs = |up: &Stage| planned.iter().any(|p| p.stage == *up && matches!(p.decision, Decision::Run { .. }));
        let running: Vec<Stage> = stage.upstream().iter().copied().filter(runs).collect();
        let upstream_runs = !running.is_empty();
        let decision = judge(&ctx, stage, running)?.0;
        let candidates = match decision {
            Decision::Run { .. } if stage == Stage::Eval && !upstream_runs => Some(stages::eval_candidates(&ctx)?),
            _ => None,
        };
        planned.push(StageStatus { stage, decision, candidates });
    }
    Ok(SftPlan { run_dir, device, stages: planned })
}

/// Runs the pipeline for `req`; a Ctrl-C that `stop` defers to the training saves its state and stops the run.
pub fn run_sft(req: &SftRequest, stop: &crate::train::StopRequest) -> Result<SftSummary, PipelineError> {
    let started = Instant::now();
    let (def, config, device, run_dir) = resolve(req)?;
    let ctx = stages::Context { req, def: &def, config: &config, run_dir: &run_dir, device: &device, stop };
    stages::preflight(&ctx)?;
    // The stages before `--from` are only read: judged before anything is written, so that one that is missing
    // or changed stops the run with the run folder as it was.
    let mut judged = BTreeMap::new();
    for stage in stages_of(&def, req).filter(|s| req.from.is_some_and(|f| *s < f)) {
        judged.insert(stage, judge(&ctx, stage, Vec::new())?);
    }
    std::fs::create_dir_all(run_dir.join("manifests")).map_err(|e| PipelineError::io(&run_dir, e))?;
    let _lock = crate::files::RunLock::acquire(&run_dir, &req.command)?;
    let effective = serde_json::json!({"model": req.model, "command": req.command, "device": device, "config": config});
    let effective_path = run_dir.join("sft.json");
    write_json(&effective_path, &effective)?;

    let mut summary = SftSummary {
        run_dir: run_dir.clone(),
        stages_run: Vec::new(),
        stages_skipped: Vec::new(),
        selected: None,
        selected_score: None,
        report: None,
        card: None,
        pushed: None,
        wall_seconds: 0.0,
    };
    let total = stages_of(&def, req).count();
    for (i, stage) in stages_of(&def, req).enumerate() {
        let line = |what: &str| eprintln!("[{}/{total}] {:<8} {what}", i + 1, stage.name());
        let (decision, plan, fp) = match judged.remove(&stage) {
            Some(before_from) => before_from,
            None => judge(&ctx, stage, Vec::new())?,
        };
        match decision {
            Decision::Off { why } => {
                line(&format!("off: {why}"));
                continue;
            }
            Decision::Skip { fingerprint } => {
                line(&format!("up to date (manifest {}), skipped", &fingerprint[..fingerprint.len().min(12)]));
                summary.stages_skipped.push(stage);
                continue;
            }
            // A first run needs no reason given; a rerun says what changed.
            Decision::Run { reasons } if reasons == [status::FIRST_RUN] => line("running"),
            Decision::Run { reasons } => line(&format!("running: {}", status::brief(&reasons))),
        }
        // Until the stage ends, no manifest may vouch for outputs it is rewriting: a stage forced by
        // `--from` that fails would otherwise be skipped by the next run, its old manifest still matching.
        remove_manifest(&run_dir, stage)?;
        let stage_started = Instant::now();
        let outcome = stages::run(&ctx, stage)?;
        let wall = stage_started.elapsed().as_secs_f64();
        let manifest = Manifest {
            stage,
            kiln: env!("CARGO_PKG_VERSION").into(),
            fingerprint: fp,
            inputs: plan.inputs,
            params: plan.params,
            outputs: outcome.outputs,
            counts: outcome.counts,
            wall_seconds: wall,
            finished_at: chrono::Local::now().to_rfc3339(),
        };
        let path = manifest_path(&run_dir, stage);
        write_json(&path, &manifest)?;
        eprintln!("[{}/{total}] {:<8} done in {wall:.1}s: {}", i + 1, stage.name(), outcome.summary);
        summary.stages_run.push(stage);
    }
    if let Ok(sel) = crate::eval::select::read_selection(&run_dir) {
        summary.selected_score = sel.candidates.iter().find(|c| c.name == sel.chosen).map(|c| c.score);
        summary.selected = Some(sel.chosen);
    }
    summary.report = Some(run_dir.join("report/index.html")).filter(|p| p.is_file());
    summary.card = Some(run_dir.join("README.md")).filter(|p| p.is_file());
    // An earlier run's record says nothing of this one unless its push stage ran or was up to date.
    let pushes = summary.stages_run.contains(&Stage::Push) || summary.stages_skipped.contains(&Stage::Push);
    summary.pushed = std::fs::read_to_string(run_dir.join("push.json"))
        .ok()
        .filter(|_| pushes)
        .and_then(|text| serde_json::from_str::<crate::hub::push::PushedRepo>(&text).ok())
        .map(|p| p.url);
    summary.wall_seconds = started.elapsed().as_secs_f64();
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reproduced(line: &str) -> String {
        reproduce_command(&line.split(' ').map(String::from).collect::<Vec<_>>())
    }

    #[test]
    fn the_reproduce_command_leaves_out_what_only_chooses_the_stages_run_now() {
        assert_eq!(
            reproduced("kiln --quiet sft --model tiny --from card --until=card --set train.lr=1e-5 --dry-run"),
            "kiln sft --model tiny --set 'train.lr=1e-5'"
        );
        assert_eq!(reproduced("kiln sft --halt-after 2 --epochs 1 --from=train"), "kiln sft --epochs 1");
        // A value that holds one of the flags is kept.
        assert_eq!(reproduced("kiln sft --set x=--quiet --run --from-b"), "kiln sft --set 'x=--quiet' --run --from-b");
        assert_eq!(reproduced("kiln sft --model a'b"), "kiln sft --model \"a'b\"");
    }
}
