//! What each stage of `kiln sft` reads (its plan: parameters and input hashes) and does, by calling the
//! stage modules: hub, data, tokens, report, train, models, eval.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Value, json};

use super::config::{ModelConfig, PipelineDef};
use super::{PipelineError, SftRequest, Stage, StageOutcome, StagePlan, manifest_path};
use crate::data::{EvalIndex, Recipe};
use crate::eval::journal::Journal;
use crate::eval::result::EvalResult;
use crate::eval::select::Candidate;
use crate::hub::push::PushSpec;
use crate::hub::{Hub, HubConfig, HubError, PulledRepo, RepoKind, RepoSpec};
use crate::train::state::TrainSource;

pub struct Context<'a> {
    pub req: &'a SftRequest,
    pub def: &'a PipelineDef,
    pub config: &'a ModelConfig,
    pub run_dir: &'a Path,
    pub device: &'a str,
    pub stop: &'a crate::train::StopRequest,
}

const OPTIONAL_MODEL_FILES: &[&str] = &[
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
    // Vision-language checkpoints (Qwen3.5, Gemma 4): the processors vLLM and transformers need to load the
    // export.
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "README.md",
    "LICENSE",
];

fn fail(stage: Stage) -> impl Fn(&dyn std::fmt::Display) -> PipelineError {
    move |e| PipelineError::Stage { stage: stage.name(), message: e.to_string() }
}

fn hash_file(path: &Path) -> Result<String, PipelineError> {
    crate::hub::sha256_file(path).map_err(|e| PipelineError::io(path, e))
}

/// Hashes of the files directly in `dir` (sorted by name).
fn hash_dir(dir: &Path, prefix: &str, into: &mut BTreeMap<String, String>) -> Result<(), PipelineError> {
    let entries = std::fs::read_dir(dir).map_err(|e| PipelineError::io(dir, e))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_file() {
            into.insert(format!("{prefix}{}", entry.file_name().to_string_lossy()), hash_file(&path)?);
        }
    }
    Ok(())
}

fn upstream_inputs(ctx: &Context, stage: Stage, inputs: &mut BTreeMap<String, String>) -> Result<(), PipelineError> {
    for &up in stage.upstream() {
        let path = manifest_path(ctx.run_dir, up);
        if path.is_file() {
            inputs.insert(super::status::upstream_key(up), hash_file(&path)?);
        }
    }
    Ok(())
}

fn hub(ctx: &Context) -> Result<Hub, PipelineError> {
    let mut config = HubConfig::from_env();
    config.show_progress = ctx.req.show_progress;
    Hub::new(config).map_err(|e| fail(Stage::Pull)(&e))
}

fn recipes(ctx: &Context) -> Result<Vec<Recipe>, PipelineError> {
    let mut out = Vec::new();
    for name in &ctx.config.data.recipes {
        let mut recipe = Recipe::find(name, &ctx.req.datasets_dir).map_err(|e| fail(Stage::Prepare)(&e))?;
        if let Some(&w) = ctx.config.data.weights.get(name) {
            for s in &mut recipe.sources {
                s.weight *= w;
            }
        }
        out.push(recipe);
    }
    Ok(out)
}

/// The replay steps the eval stage scores, as the model config selects them.
fn replay_steps(ctx: &Context) -> Result<Vec<crate::eval::result::ReplayStep>, PipelineError> {
    let err = fail(Stage::Eval);
    let replay = &ctx.config.eval.replay;
    let steps = crate::eval::result::read_replay(replay).map_err(|e| err(&e))?;
    crate::eval::run::select_steps(steps, &ctx.config.eval.options())
        .map_err(|e| err(&format!("{}: {e}", replay.display())))
}

/// What the stages to run need that can be checked before anything is downloaded or trained: a `--from`
/// not past `--until`, the data recipes, and the replay set the eval scores on. A typo there would
/// otherwise surface after the pull, or after the training.
pub fn preflight(ctx: &Context) -> Result<(), PipelineError> {
    let req = ctx.req;
    if let (Some(from), Some(until)) = (req.from, req.until)
        && from > until
    {
        return Err(PipelineError::Flags {
            model: req.model.clone(),
            message: format!("--from {} comes after --until {}: no stage would run", from.name(), until.name()),
        });
    }
    if let Some(dir) = &ctx.config.model.checkpoint {
        let refuse = |message: String| PipelineError::Stage { stage: Stage::Pull.name(), message };
        check_base(dir, ctx.config).map_err(refuse)?;
        if let (Ok(base), Ok(run)) = (dir.canonicalize(), ctx.run_dir.canonicalize())
            && base.starts_with(&run)
        {
            return Err(refuse(format!(
                "the checkpoint {} lies in the run folder {}, which this run rewrites: give the run another name (--run)",
                dir.display(),
                ctx.run_dir.display()
            )));
        }
    }
    let runs = |stage: Stage| ctx.def.stages.contains(&stage) && req.until.is_none_or(|u| stage <= u);
    if runs(Stage::Prepare) {
        recipes(ctx)?;
    }
    if runs(Stage::Eval) {
        replay_steps(ctx)?;
    }
    if runs(Stage::Push) && ctx.config.push {
        check_push(ctx)?;
    }
    Ok(())
}

/// Why a stage of the pipeline is left out of this run, when it is.
pub fn off(ctx: &Context, stage: Stage) -> Option<&'static str> {
    (stage == Stage::Push && !ctx.config.push)
        .then_some("not asked for (--set publish_repo=owner/name --set push=true)")
}

/// The push's token, checked before anything is trained: missing, refused, or not allowed to write to the
/// repo (hub::account) stops the run now. A Hub that cannot be reached now is only noted: the push tries at
/// the end.
fn check_push(ctx: &Context) -> Result<(), PipelineError> {
    let Some(repo) = &ctx.config.publish_repo else { return Ok(()) };
    let hub = hub(ctx)?;
    match hub.check_push(repo) {
        Ok(account) => {
            if ctx.req.show_progress {
                let from = hub.config().token_source.as_ref().map(|s| format!(", from {s}")).unwrap_or_default();
                eprintln!("push: to {repo} as '{}' ({}{from})", account.user, account.token.kind());
            }
            Ok(())
        }
        Err(e @ HubError::PushFailed { .. }) => {
            eprintln!("note: the push's token could not be checked now ({e}); the push stage tries at the end");
            Ok(())
        }
        Err(e) => Err(fail(Stage::Push)(&e)),
    }
}

/// Whether `dir` is a checkpoint of `config`'s architecture that can be fine-tuned: its config.json loads,
/// and its weights and tokenizer are there.
fn check_base(dir: &Path, config: &ModelConfig) -> Result<(), String> {
    let model = crate::models::ModelConfig::from_file(&dir.join("config.json")).map_err(|e| e.to_string())?;
    if model.architecture() != config.architecture {
        return Err(format!(
            "{} is a {} checkpoint (model_type {}), but the model config '{}' is for {}",
            dir.display(),
            model.architecture(),
            model.model_type(),
            config.name,
            config.architecture
        ));
    }
    let has = |suffix: &str| {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(suffix))
    };
    for (suffix, what) in [(".safetensors", "no *.safetensors weights"), ("tokenizer.json", "no tokenizer.json")] {
        if !has(suffix) {
            return Err(format!("{} has {what}", dir.display()));
        }
    }
    Ok(())
}

/// A checkpoint folder's `files` (repo path, path) by content, as `stage`'s inputs under `prefix`: the small
/// ones whole, the weights as `TrainSource` samples them (name, size, first and last MiB), so that deciding
/// whether a run is current reads no gigabytes.
fn fingerprint_checkpoint(
    stage: Stage,
    dir: &Path,
    prefix: &str,
    files: &[(String, PathBuf)],
    inputs: &mut BTreeMap<String, String>,
) -> Result<(), PipelineError> {
    let sampled = TrainSource::of(dir, &[]).map_err(|e| fail(stage)(&e))?;
    inputs.insert(format!("{prefix}config.json+*.safetensors"), sampled.model);
    for (name, path) in files.iter().filter(|(name, _)| !name.ends_with(".safetensors")) {
        inputs.insert(format!("{prefix}{name}"), hash_file(path)?);
    }
    Ok(())
}

/// The files directly in a base checkpoint folder, its card left out: the card is documentation (a card
/// rewritten in the run it came from retrains nothing here); the card stage, which reads the card's license and
/// origin, hashes it for itself.
fn base_checkpoint_files(dir: &Path) -> Result<Vec<(String, PathBuf)>, PipelineError> {
    let entries = std::fs::read_dir(dir).map_err(|e| PipelineError::io(dir, e))?;
    Ok(entries
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .filter(|(name, path)| path.is_file() && !crate::models::hf::CARD_ENTRIES.contains(&name.as_str()))
        .collect())
}

/// The base checkpoint of a run: the random-init folder of a local model, a checkpoint folder as it is, or
/// the pulled Hub snapshot.
pub fn base_model_dir(run_dir: &Path, config: &ModelConfig) -> Option<PathBuf> {
    if config.model.local.is_some() {
        return Some(run_dir.join("base"));
    }
    if let Some(dir) = &config.model.checkpoint {
        return Some(dir.clone());
    }
    let pulled: Vec<PulledRepo> =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("pull.json")).ok()?).ok()?;
    let model = pulled.iter().find(|p| p.kind == RepoKind::Model)?;
    model.files.iter().find(|f| f.path == "config.json")?.local.parent().map(Path::to_path_buf)
}

fn require_base(ctx: &Context, stage: Stage) -> Result<PathBuf, PipelineError> {
    base_model_dir(ctx.run_dir, ctx.config).filter(|d| d.join("config.json").is_file()).ok_or_else(|| {
        PipelineError::Stage {
            stage: stage.name(),
            message: format!("no base checkpoint in {} (run the pull stage)", ctx.run_dir.display()),
        }
    })
}

/// What a stage computes from.
pub fn plan(ctx: &Context, stage: Stage) -> Result<StagePlan, PipelineError> {
    let c = ctx.config;
    let mut inputs = BTreeMap::new();
    upstream_inputs(ctx, stage, &mut inputs)?;
    let params = match stage {
        Stage::Pull => {
            if let Some(local) = &c.model.local {
                hash_dir(local, "model/", &mut inputs)?;
            }
            if let Some(dir) = &c.model.checkpoint {
                fingerprint_checkpoint(Stage::Pull, dir, "checkpoint/", &base_checkpoint_files(dir)?, &mut inputs)?;
            }
            json!({"model": c.model, "recipes": c.data.recipes})
        }
        Stage::Prepare => {
            for recipe in recipes(ctx)? {
                inputs.insert(
                    format!("recipe/{}", recipe.name),
                    crate::hub::sha256_bytes(serde_json::to_string(&recipe.sources).unwrap_or_default().as_bytes()),
                );
                for s in recipe.sources.iter().filter(|s| s.hub.is_none()) {
                    if let Some(p) = &s.path {
                        let path = recipe.base_dir().join(p);
                        if path.is_file() {
                            inputs.insert(format!("source/{}", path.display()), hash_file(&path)?);
                        }
                    }
                }
            }
            for set in &c.data.decontaminate {
                inputs.insert(format!("eval-set/{}", set.display()), hash_file(set)?);
            }
            if let Some(file) = &c.template.file {
                inputs.insert(format!("template/{}", file.display()), hash_file(file)?);
            }
            json!({"data": c.data, "template": c.template})
        }
        Stage::Inspect => json!({"examples": ctx.def.defaults.inspect_examples, "seed": 0}),
        Stage::Train => json!({"train": c.train, "device": ctx.device}),
        Stage::Export => json!({}),
        Stage::Eval => {
            inputs.insert(format!("replay/{}", c.eval.replay.display()), hash_file(&c.eval.replay)?);
            json!({"eval": c.eval, "device": ctx.device})
        }
        Stage::Select => json!({}),
        Stage::Card => {
            // The base's README gives the card its license and origin.
            let readme = base_model_dir(ctx.run_dir, c).map(|d| d.join("README.md")).filter(|p| p.is_file());
            if let Some(readme) = readme {
                inputs.insert("base/README.md".into(), hash_file(&readme)?);
            }
            json!({"model": c.name, "command": ctx.req.command, "publish_repo": c.publish_repo})
        }
        Stage::Push => {
            // What is pushed: the selected checkpoint as it is now, its card included; the weights sampled as
            // the pull stage samples a checkpoint's, so that deciding reads no gigabytes.
            let best = ctx.run_dir.join("best");
            if best.is_dir() {
                let files = crate::hub::push::folder_paths(&best).map_err(|e| fail(Stage::Push)(&e))?;
                fingerprint_checkpoint(Stage::Push, &best, "best/", &files, &mut inputs)?;
            }
            json!({"publish_repo": c.publish_repo, "private": c.publish_private})
        }
    };
    Ok(StagePlan { params, inputs })
}

pub fn run(ctx: &Context, stage: Stage) -> Result<StageOutcome, PipelineError> {
    match stage {
        Stage::Pull => pull(ctx),
        Stage::Prepare => prepare(ctx),
        Stage::Inspect => inspect(ctx),
        Stage::Train => train(ctx),
        Stage::Export => export(ctx),
        Stage::Eval => eval(ctx),
        Stage::Select => select(ctx),
        Stage::Card => card(ctx),
        Stage::Push => push(ctx),
    }
}

fn pull(ctx: &Context) -> Result<StageOutcome, PipelineError> {
    let c = ctx.config;
    let err = fail(Stage::Pull);
    let mut pulled: Vec<PulledRepo> = Vec::new();
    let recipes = recipes(ctx)?;
    let needs_hub = c.model.hub.is_some() || recipes.iter().any(|r| r.sources.iter().any(|s| s.hub.is_some()));
    let hub = if needs_hub { Some(hub(ctx)?) } else { None };
    let (base, summary, parameters) = match (&c.model.hub, &c.model.checkpoint, &c.model.local) {
        (Some(repo), _, _) => {
            let spec = RepoSpec {
                kind: RepoKind::Model,
                repo: repo.clone(),
                revision: c.model.revision.clone(),
                files: c.model.files.clone(),
                optional_files: OPTIONAL_MODEL_FILES.iter().map(|s| s.to_string()).collect(),
            };
            let record = hub.as_ref().ok_or_else(|| err(&"no hub"))?.pull(&spec).map_err(|e| err(&e))?;
            let summary = format!("{repo}@{} → {}", c.model.revision, &record.commit[..record.commit.len().min(12)]);
            pulled.push(record);
            (None, summary, Value::Null)
        }
        (None, Some(dir), _) => (None, format!("checkpoint {}", dir.display()), Value::Null),
        (None, None, Some(local)) => {
            let base = ctx.run_dir.join("base");
            let (model_type, params) = crate::models::init_random_checkpoint(
                local,
                &base,
                c.model.init_seed,
                crate::models::hf::ExportDtype::F32,
            )
            .map_err(|e| err(&e))?;
            let summary = format!("random-init {model_type} ({params} parameters, seed {}) → base/", c.model.init_seed);
            (Some(base), summary, json!(params))
        }
        (None, None, None) => return Err(err(&"[model] has no hub, checkpoint or local")),
    };
    for recipe in &recipes {
        for spec in recipe.sources.iter().filter_map(|s| s.hub.as_ref()) {
            pulled.push(hub.as_ref().ok_or_else(|| err(&"no hub"))?.pull(&spec.spec()).map_err(|e| err(&e))?);
        }
    }
    let path = ctx.run_dir.join("pull.json");
    super::write_json(&path, &pulled)?;
    let mut outputs = vec!["pull.json".to_string()];
    if base.is_some() {
        outputs.push("base".into());
    }
    let commits: BTreeMap<String, String> = pulled.iter().map(|p| (p.repo.clone(), p.commit.clone())).collect();
    let base_dir = base_model_dir(ctx.run_dir, ctx.config).ok_or_else(|| err(&"no base checkpoint after the pull"))?;
    check_base(&base_dir, c).map_err(|message| err(&message))?;
    let base_dir = base_dir.display().to_string();
    Ok(StageOutcome {
        outputs,
        counts: json!({"base_model": base_dir, "parameters": parameters, "repos": commits}),
        summary: format!("{summary}; {} repos pulled", pulled.len()),
    })
}

fn prepare(ctx: &Context) -> Result<StageOutcome, PipelineError> {
    let c = ctx.config;
    let err = fail(Stage::Prepare);
    let data_dir = ctx.run_dir.join("data");
    // Shards of an earlier prepare with other settings must not mix with these.
    if data_dir.is_dir() {
        std::fs::remove_dir_all(&data_dir).map_err(|e| PipelineError::io(&data_dir, e))?;
    }
    let recipes = recipes(ctx)?;
    let chosen = recipes.iter().map(|r| (r, r.sources.iter().collect::<Vec<_>>())).collect::<Vec<_>>();
    let eval = if c.data.decontaminate.is_empty() {
        None
    } else {
        Some(EvalIndex::load(&c.data.decontaminate).map_err(|e| err(&e))?)
    };
    let needs_hub = recipes.iter().any(|r| r.sources.iter().any(|s| s.hub.is_some()));
    let hub = if needs_hub { Some(hub(ctx)?) } else { None };
    let ingests = crate::data::ingest::ingest_to_dir(
        &chosen,
        hub.as_ref(),
        eval.as_ref(),
        c.data.dedupe,
        ctx.req.show_progress,
        &data_dir,
    )
    .map_err(|e| err(&e))?;
    for w in ingests.iter().flat_map(|s| s.warnings()) {
        eprintln!("  warning: {w}");
    }

    let base = require_base(ctx, Stage::Prepare)?;
    let (template, tokenizer) = crate::tokens::prepare::load_template_and_tokenizer(
        &base,
        c.template.file.as_deref(),
        &c.data.template_date,
        c.template.end_of_turn.as_deref(),
    )
    .map_err(|e| err(&e))?;
    let cfg = crate::tokens::prepare::PrepareConfig {
        seq_len: c.data.seq_len,
        layout: c.data.layout,
        truncation: c.data.truncation,
        policy: crate::chat::SamplePolicy {
            mode: c.template.mode,
            thinking: c.template.thinking,
            kwargs: c.template.vars.clone(),
            tool_results: c.template.tool_results,
            prompt_rule: c.template.prompt_rule,
        },
        chunk: 256,
        template_date: c.data.template_date.clone(),
        validation_share: c.data.validation_share,
    };
    let bar =
        if ctx.req.show_progress { indicatif::ProgressBar::new_spinner() } else { indicatif::ProgressBar::hidden() };
    let stats = crate::tokens::prepare::prepare(
        &data_dir.join("conversations.jsonl"),
        &template,
        &tokenizer,
        &cfg,
        &data_dir,
        &bar,
    )
    .map_err(|e| err(&e))?;
    bar.finish_and_clear();
    if stats.samples == 0 {
        return Err(err(&stats.nothing_kept()));
    }
    let emitted: u64 = ingests.iter().map(|s| s.emitted).sum();
    Ok(StageOutcome {
        outputs: vec!["data/stats.json".into(), "data/conversations.jsonl".into(), "data/ingest.json".into()],
        counts: json!({"conversations": emitted, "samples": stats.samples, "tokens": stats.tokens, "supervised_tokens": stats.supervised_tokens, "rows": stats.rows}),
        summary: stats.summary(),
    })
}

fn inspect(ctx: &Context) -> Result<StageOutcome, PipelineError> {
    let err = fail(Stage::Inspect);
    let opts =
        crate::report::InspectOptions { random_examples: ctx.def.defaults.inspect_examples, ..Default::default() };
    let result =
        crate::report::inspect_run(ctx.run_dir, &opts, &indicatif::ProgressBar::hidden()).map_err(|e| err(&e))?;
    crate::report::write_report(ctx.run_dir, &result).map_err(|e| err(&e))?;
    for w in &result.inspection.warnings {
        eprintln!("  warning: {w}");
    }
    Ok(StageOutcome {
        outputs: vec!["report/index.html".into(), "report/summary.md".into(), "report/summary.json".into()],
        counts: json!({"warnings": result.inspection.warnings.len(), "examples": result.inspection.examples.len()}),
        summary: result.inspection.summary(),
    })
}

fn train(ctx: &Context) -> Result<StageOutcome, PipelineError> {
    let cfg = &ctx.config.train;
    let base = require_base(ctx, Stage::Train)?;
    let data_dir = ctx.run_dir.join("data");
    // `--from` at or before train asks for the training again, not for a resume of it (which, for a finished
    // one, would be nothing).
    let forced = ctx.req.from.filter(|&from| from <= Stage::Train);
    let resume = match (crate::train::state::saved_state(ctx.run_dir), forced) {
        (None, _) => false,
        (Some(_), Some(from)) => {
            eprintln!("  --from {}: the training starts over", from.name());
            false
        }
        (Some(saved), None) => {
            let shards = crate::train::data::shard_files(&data_dir).map_err(PipelineError::Train)?;
            let source = TrainSource::of(&base, &shards).map_err(PipelineError::Train)?;
            match saved.refusal(&cfg.for_device(ctx.device), &source) {
                None => true,
                Some(why) => {
                    eprintln!("  {why}: starting over");
                    false
                }
            }
        }
    };
    if resume {
        eprintln!("  resuming from {}", ctx.run_dir.join("train/state").display());
        // The card of an earlier selection no longer holds once training goes on.
        crate::eval::select::remove_checkpoint_cards(ctx.run_dir, None)
            .map_err(|(path, e)| PipelineError::io(&path, e))?;
    } else {
        // A fresh start: checkpoints of an earlier run must not be evaluated as this run's epochs.
        for dir in ["train", "checkpoints"] {
            let path = ctx.run_dir.join(dir);
            if path.exists() {
                std::fs::remove_dir_all(&path).map_err(|e| PipelineError::io(&path, e))?;
            }
        }
    }
    let summary = ctx
        .stop
        .defer(|stop| {
            crate::train::train_on_device(
                ctx.device,
                cfg,
                &base,
                &data_dir,
                ctx.run_dir,
                resume,
                stop,
                ctx.req.halt_after,
                ctx.req.show_progress,
            )
        })
        .map_err(PipelineError::Train)?;
    if summary.interrupted {
        return Err(PipelineError::Interrupted { step: summary.steps, saved: cfg.save_state });
    }
    let mut outputs = vec!["train/metrics.jsonl".to_string(), "train/summary.json".to_string()];
    outputs.extend((1..=summary.epochs_done).map(|k| format!("checkpoints/epoch-{k}")));
    let metrics = ctx.run_dir.join("train/metrics.jsonl");
    let totals = crate::train::trainer::metrics_totals(&metrics).map_err(|e| PipelineError::io(&metrics, e))?;
    let points_path = crate::train::validation::points_path(&ctx.run_dir.join("train"));
    let points = crate::train::validation::read_points(&points_path).map_err(|e| PipelineError::io(&points_path, e))?;
    let validation: BTreeMap<String, f64> = crate::train::validation::checkpoint_losses(&points).into_iter().collect();
    if !points.is_empty() {
        outputs.push("train/validation.jsonl".into());
    }
    let validation_text = summary.validation_loss.map(|l| format!(", validation loss {l:.4}")).unwrap_or_default();
    let routing_text = routing_change(&points);
    Ok(StageOutcome {
        outputs,
        counts: json!({"steps": summary.steps, "epochs": summary.epochs_done, "final_loss": summary.final_loss, "validation_loss": validation, "tokens": totals.0, "supervised_tokens": totals.1, "train_seconds": summary.seconds, "device": ctx.device}),
        summary: format!(
            "{} steps, {} epochs, final loss {}{validation_text}{routing_text}",
            summary.steps,
            summary.epochs_done,
            summary.final_loss.map_or("-".into(), |l| format!("{l:.4}"))
        ),
    })
}

/// Checks every exported epoch: the weights load, hold exactly the base checkpoint's tensor names, and
/// the tokenizer and template files travelled with them.
/// For an MoE, how its routing's MaxVio over the validation split went from the base to the last checkpoint
/// measured (`, expert MaxVio 0.957 (base) → 1.475 (epoch-2)`); empty for a dense model.
fn routing_change(points: &[crate::train::validation::ValidationPoint]) -> String {
    let balances = crate::train::validation::checkpoint_balances(points);
    match (balances.first(), balances.last()) {
        (Some((first, a)), Some((last, b))) if balances.len() > 1 => {
            format!(", expert MaxVio {:.3} ({first}) → {:.3} ({last})", a.max_vio, b.max_vio)
        }
        (Some((name, b)), _) => format!(", expert MaxVio {:.3} ({name})", b.max_vio),
        _ => String::new(),
    }
}

fn export(ctx: &Context) -> Result<StageOutcome, PipelineError> {
    let err = fail(Stage::Export);
    let base = require_base(ctx, Stage::Export)?;
    let names = |dir: &Path| -> Result<Vec<(String, Vec<usize>)>, PipelineError> {
        let store = crate::models::WeightStore::open(dir).map_err(|e| err(&e))?;
        Ok(store.keys().map(|k| (k.clone(), store.shape(k).unwrap_or_default().to_vec())).collect())
    };
    let expected = names(&base)?;
    let checkpoints = crate::eval::select::candidates(ctx.run_dir, None);
    if checkpoints.is_empty() {
        return Err(err(&"no checkpoints/epoch-<k> to export (run the train stage)"));
    }
    let mut bytes = 0u64;
    for c in &checkpoints {
        let got = names(&c.path)?;
        if got != expected {
            return Err(err(&format!(
                "{}: its {} tensors differ in names or shapes from the base's {}",
                c.path.display(),
                got.len(),
                expected.len()
            )));
        }
        crate::models::ModelConfig::from_file(&c.path.join("config.json")).map_err(|e| err(&e))?;
        for needed in ["tokenizer.json", "tokenizer_config.json"] {
            if !c.path.join(needed).is_file() {
                return Err(err(&format!("{} lacks {needed}", c.path.display())));
            }
        }
        bytes += crate::train::disk::folder_bytes(&c.path);
    }
    Ok(StageOutcome {
        outputs: checkpoints.iter().map(|c| format!("checkpoints/{}", c.name)).collect(),
        counts: json!({"checkpoints": checkpoints.len(), "tensors": expected.len(), "bytes": bytes}),
        summary: format!(
            "{} checkpoints verified ({} tensors each, {})",
            checkpoints.len(),
            expected.len(),
            indicatif::HumanBytes(bytes)
        ),
    })
}

fn eval(ctx: &Context) -> Result<StageOutcome, PipelineError> {
    let err = fail(Stage::Eval);
    let base = require_base(ctx, Stage::Eval)?;
    let eval_dir = ctx.run_dir.join("eval");
    let candidates = crate::eval::select::candidates(ctx.run_dir, Some(&base));
    clear_eval_dir(&eval_dir, if fresh_eval(ctx) { &[] } else { &candidates })?;
    std::fs::create_dir_all(&eval_dir).map_err(|e| PipelineError::io(&eval_dir, e))?;
    let replay = &ctx.config.eval.replay;
    let opts = ctx.config.eval.options();
    let steps = replay_steps(ctx)?;
    let replay_hash = hash_file(replay)?;
    let mut lines = Vec::new();
    let mut outputs = Vec::new();
    let mut kept = 0;
    for c in candidates {
        let path = eval_dir.join(format!("{}.json", c.name));
        let identity_path = crate::eval::journal::identity_path_in(&eval_dir, &c.name);
        let (identity, earlier) = standing_result(ctx, &eval_dir, &c, &replay_hash)?;
        let was_kept = earlier.is_some();
        let result = match earlier {
            Some(result) => {
                // The result now stands for the checkpoint as it is (same content, perhaps written again since):
                // `kiln select` trusts a result no older than its checkpoint's files.
                let touched = std::fs::File::options()
                    .append(true)
                    .open(&path)
                    .and_then(|f| f.set_modified(std::time::SystemTime::now()));
                touched.map_err(|e| PipelineError::io(&path, e))?;
                kept += 1;
                result
            }
            None => {
                // No identity may vouch for a result being rewritten.
                crate::files::remove_if_present(&identity_path).map_err(|e| PipelineError::io(&identity_path, e))?;
                // The batches an eval of the same identity finished before it was stopped are taken as they are.
                let journal_path = crate::eval::journal::path_in(&eval_dir, &c.name);
                let mut journal =
                    Journal::open(&journal_path, &identity).map_err(|e| PipelineError::io(&journal_path, e))?;
                if journal.finished_batches() > 0 {
                    eprintln!(
                        "  {}: going on after the {} batch(es) finished before it was stopped",
                        c.name,
                        journal.finished_batches()
                    );
                }
                let result = crate::eval::run::evaluate_on_device(
                    ctx.device,
                    ctx.config.train.devices,
                    &c.name,
                    &c.path,
                    replay,
                    &steps,
                    &opts,
                    ctx.req.show_progress,
                    Some(&mut journal),
                )
                .map_err(|e| err(&format!("{}: {e}", c.name)))?;
                super::write_json(&path, &result)?;
                std::fs::write(&identity_path, format!("{identity}\n"))
                    .map_err(|e| PipelineError::io(&identity_path, e))?;
                journal.remove().map_err(|e| PipelineError::io(&journal_path, e))?;
                result
            }
        };
        let a = &result.aggregate;
        let how = if was_kept { ", kept: same checkpoint, replay and settings" } else { "" };
        eprintln!(
            "  {}: Score {:.2} (P {:.3} R {:.3}, valid JSON {:.1}%, {:.3} s/step{how})",
            c.name, a.score, a.avg_command_precision, a.avg_command_recall, a.valid_json_pct, result.avg_sec_per_step
        );
        lines.push(format!("{} {:.2}", c.name, a.score));
        outputs.push(format!("eval/{}.json", c.name));
    }
    let summary = match kept {
        0 => lines.join(", "),
        n => format!("{} ({n} kept from before)", lines.join(", ")),
    };
    Ok(StageOutcome {
        outputs,
        counts: json!({"steps": steps.len(), "candidates": lines.len(), "kept": kept}),
        summary,
    })
}

/// The identity candidate `c` has now (`eval_identity`), and the result of an earlier eval that still stands
/// for it: `eval/<name>.json` written under that identity.
fn standing_result(
    ctx: &Context,
    eval_dir: &Path,
    c: &Candidate,
    replay_hash: &str,
) -> Result<(String, Option<EvalResult>), PipelineError> {
    let identity = eval_identity(&c.path, &ctx.config.eval.options(), replay_hash, ctx.device)?;
    let identity_path = crate::eval::journal::identity_path_in(eval_dir, &c.name);
    let result_path = eval_dir.join(format!("{}.json", c.name));
    let earlier = std::fs::read_to_string(&identity_path)
        .ok()
        .filter(|id| id.trim() == identity)
        .and_then(|_| serde_json::from_str::<EvalResult>(&std::fs::read_to_string(&result_path).ok()?).ok());
    Ok((identity, earlier))
}

/// What the eval stage would do with a candidate, as a dry run tells it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "action", rename_all = "lowercase")]
pub enum CandidateAction {
    /// Its result stands: the same checkpoint, replay and settings.
    Keep,
    /// Evaluated, going on after the batches its journal holds.
    Evaluate { finished_batches: usize },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalCandidate {
    pub name: String,
    #[serde(flatten)]
    pub action: CandidateAction,
}

/// What the eval stage would do with each candidate if it ran now, read without writing anything: only
/// meaningful when no stage before it runs first (those rewrite the checkpoints).
pub fn eval_candidates(ctx: &Context) -> Result<Vec<EvalCandidate>, PipelineError> {
    let base = require_base(ctx, Stage::Eval)?;
    let eval_dir = ctx.run_dir.join("eval");
    let replay_hash = hash_file(&ctx.config.eval.replay)?;
    let mut out = Vec::new();
    for c in crate::eval::select::candidates(ctx.run_dir, Some(&base)) {
        let action = if fresh_eval(ctx) {
            CandidateAction::Evaluate { finished_batches: 0 }
        } else {
            match standing_result(ctx, &eval_dir, &c, &replay_hash)? {
                (_, Some(_)) => CandidateAction::Keep,
                (identity, None) => {
                    let path = crate::eval::journal::path_in(&eval_dir, &c.name);
                    let finished_batches = Journal::peek(&path, &identity).map_err(|e| PipelineError::io(&path, e))?;
                    CandidateAction::Evaluate { finished_batches }
                }
            }
        };
        out.push(EvalCandidate { name: c.name, action });
    }
    Ok(out)
}

/// A dry run's line for the eval stage's candidates: "keeps base, epoch-1; evaluates epoch-2 (after 2 batch(es)
/// finished before)".
pub fn candidates_line(candidates: &[EvalCandidate]) -> String {
    let kept: Vec<&str> =
        candidates.iter().filter(|c| c.action == CandidateAction::Keep).map(|c| c.name.as_str()).collect();
    let evaluated: Vec<String> = candidates
        .iter()
        .filter_map(|c| match c.action {
            CandidateAction::Keep => None,
            CandidateAction::Evaluate { finished_batches: 0 } => Some(c.name.clone()),
            CandidateAction::Evaluate { finished_batches: n } => {
                Some(format!("{} (after {n} batch(es) finished before)", c.name))
            }
        })
        .collect();
    match (kept.is_empty(), evaluated.is_empty()) {
        (true, true) => "no candidate".into(),
        (true, false) => format!("evaluates {}", evaluated.join(", ")),
        (false, true) => format!("keeps {}", kept.join(", ")),
        (false, false) => format!("keeps {}; evaluates {}", kept.join(", "), evaluated.join(", ")),
    }
}

/// `--from` at or before eval asks for every result afresh; otherwise (the stage was stopped midway, the export
/// ran again) a candidate's result stands while its identity does.
fn fresh_eval(ctx: &Context) -> bool {
    ctx.req.from.is_some_and(|from| from <= Stage::Eval)
}

/// What an eval result of `checkpoint` depends on, as a hash: the checkpoint's files (the weights sampled as
/// the pull stage samples them, its card left out), the eval `settings`, the replay file, the device and
/// kiln's version. A result written under the same identity is the one evaluating again would give; the eval
/// stage, `kiln eval` and `kiln select` all name their results and journals so.
pub fn eval_identity(
    checkpoint: &Path,
    settings: &crate::eval::run::EvalOptions,
    replay_hash: &str,
    device: &str,
) -> Result<String, PipelineError> {
    let mut files = BTreeMap::new();
    fingerprint_checkpoint(Stage::Eval, checkpoint, "", &base_checkpoint_files(checkpoint)?, &mut files)?;
    let doc = json!({
        "checkpoint": files, "eval": settings, "replay": replay_hash, "device": device,
        "kiln": env!("CARGO_PKG_VERSION"),
    });
    Ok(crate::hub::sha256_bytes(doc.to_string().as_bytes()))
}

/// Empties `eval_dir` but for the results (with their identities and unfinished journals) of `keep`: a result
/// of a checkpoint that is no longer there (fewer epochs now) must not outlive it.
fn clear_eval_dir(eval_dir: &Path, keep: &[Candidate]) -> Result<(), PipelineError> {
    let Ok(entries) = std::fs::read_dir(eval_dir) else { return Ok(()) };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let stem = [".partial.jsonl", ".json", ".identity"].iter().find_map(|suffix| name.strip_suffix(suffix));
        if stem.is_some_and(|stem| keep.iter().any(|c| c.name == stem)) {
            continue;
        }
        let path = entry.path();
        let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
        removed.map_err(|e| PipelineError::io(&path, e))?;
    }
    Ok(())
}

fn select(ctx: &Context) -> Result<StageOutcome, PipelineError> {
    let base = require_base(ctx, Stage::Select)?;
    let selection = crate::eval::select::select_run(
        ctx.run_dir,
        Some(&base),
        None,
        &mut |c, why| {
            Err(why.map_or_else(
                || format!("{} has no eval/{}.json: run the eval stage", c.path.display(), c.name),
                |why| format!("{why}: run the eval stage again (--from eval)"),
            ))
        },
        &mut |_, _| {},
    )
    .map_err(|e| fail(Stage::Select)(&e))?;
    Ok(StageOutcome {
        outputs: vec!["selection.json".into(), "best".into()],
        counts: json!({"chosen": selection.chosen, "margin": selection.margin}),
        summary: selection.reason,
    })
}

fn card(ctx: &Context) -> Result<StageOutcome, PipelineError> {
    let err = fail(Stage::Card);
    let base = require_base(ctx, Stage::Card)?;
    let card =
        crate::report::card::write_card(ctx.run_dir, ctx.config, &base, &ctx.req.command).map_err(|e| err(&e))?;
    Ok(StageOutcome {
        outputs: vec![
            "README.md".into(),
            "card/loss.png".into(),
            "card/scores.png".into(),
            "best/README.md".into(),
            "best/card/loss.png".into(),
            "best/card/scores.png".into(),
        ],
        counts: json!({"figures": card.figures}),
        summary: format!(
            "{}, and the selected checkpoint's {} ({} eval rows from the run's files)",
            card.path.display(),
            card.checkpoint_card.display(),
            card.figures
        ),
    })
}

fn push(ctx: &Context) -> Result<StageOutcome, PipelineError> {
    let err = fail(Stage::Push);
    let repo = ctx.config.publish_repo.clone().ok_or_else(|| err(&"push = true needs publish_repo"))?;
    let selection = crate::eval::select::read_selection(ctx.run_dir).map_err(|e| err(&e))?;
    let score = selection.candidates.iter().find(|c| c.name == selection.chosen).map(|c| c.score);
    let run_name = ctx.run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let spec = PushSpec {
        repo,
        revision: "main".into(),
        private: ctx.config.publish_private,
        message: format!(
            "kiln sft {run_name}: {}{} of {}",
            selection.chosen,
            score.map(|s| format!(" (TB2-lite score {s:.2})")).unwrap_or_default(),
            ctx.config.name
        ),
    };
    let record = ctx.run_dir.join("push.json");
    let pushed = hub(ctx)?.push(&ctx.run_dir.join("best"), &spec).map_err(|e| err(&e))?;
    super::write_json(&record, &pushed)?;
    Ok(StageOutcome {
        outputs: vec!["push.json".into()],
        counts: json!({
            "files": pushed.files.len(),
            "bytes": pushed.files.iter().map(|f| f.size).sum::<u64>(),
            "sent": pushed.sent.len(),
            "deleted": pushed.deleted.len(),
            "commit": pushed.commit,
            "unchanged": pushed.unchanged,
        }),
        summary: format!("{} ({}): {}", ctx.config.name, selection.chosen, pushed.describe()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_candidates_line_names_what_is_kept_and_what_is_evaluated() {
        let c = |name: &str, action| EvalCandidate { name: name.into(), action };
        let evaluate = |n| CandidateAction::Evaluate { finished_batches: n };
        let line =
            candidates_line(&[c("base", CandidateAction::Keep), c("epoch-1", evaluate(0)), c("epoch-2", evaluate(2))]);
        assert_eq!(line, "keeps base; evaluates epoch-1, epoch-2 (after 2 batch(es) finished before)");
        assert_eq!(candidates_line(&[c("base", CandidateAction::Keep)]), "keeps base");
        assert_eq!(candidates_line(&[c("base", evaluate(0))]), "evaluates base");
        let json = serde_json::to_value(c("epoch-2", evaluate(2))).unwrap();
        assert_eq!(json, json!({"name": "epoch-2", "action": "evaluate", "finished_batches": 2}));
    }
}
