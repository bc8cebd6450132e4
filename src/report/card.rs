//! The model card (`kiln card`, the card stage): `README.md` in the Hub's format with YAML front matter,
//! and PNG plots of the loss and the per-epoch scores. Every figure is read from a file the run wrote
//! (eval/, selection.json, train/, data/, report/, manifests/); nothing is typed in by hand.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::figures::Inspection;
use super::html::{key_figures, percent};
use super::{ReportError, read_json};
use crate::data::ingest::IngestStats;
use crate::eval::result::EvalResult;
use crate::eval::select::Selection;
use crate::models::sampling::GenerationSettings;
use crate::pipeline::ModelConfig;
use crate::tokens::prepare::PrepareStats;
use crate::train::TrainSummary;
use crate::train::trainer::{StepMetrics, read_metrics};
use crate::train::validation::{
    ValidationPoint, checkpoint_balances, checkpoint_losses, checkpoint_points, points_path, read_points,
};

/// What the card was made from, read from the run.
pub struct CardInputs {
    pub evals: Vec<EvalResult>,
    pub selection: Selection,
    pub train: TrainSummary,
    pub metrics: Vec<StepMetrics>,
    /// The held-out split's losses (`train/validation.jsonl`); none without a split.
    pub validation: Vec<ValidationPoint>,
    pub stats: PrepareStats,
    pub ingest: Vec<IngestStats>,
    pub inspection: Option<Inspection>,
    /// Wall time of every stage that has a manifest, in pipeline order.
    pub stage_seconds: Vec<(String, f64)>,
    pub device: String,
}

pub struct CardOutput {
    pub path: PathBuf,
    /// The selected checkpoint's own card (`checkpoints/epoch-<k>/README.md`, seen as `best/README.md`).
    pub checkpoint_card: PathBuf,
    /// Rows of the evaluation table (base and epochs).
    pub figures: usize,
}

const RUN_FILES_HINT: &str = "the card is written from the run's files; run the stages before the card";

/// A run file the card needs; a missing one says which stages to run.
fn read<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ReportError> {
    read_json(path).map_err(|e| match e {
        ReportError::Io { path, .. } => ReportError::Missing { path, hint: RUN_FILES_HINT.into() },
        other => other,
    })
}

/// A run file that could not be read: missing as `read` says it, otherwise the reader's error (a bad line
/// with its number).
fn run_file_error(path: &Path, e: std::io::Error) -> ReportError {
    match e.kind() {
        std::io::ErrorKind::NotFound => ReportError::Missing { path: path.to_path_buf(), hint: RUN_FILES_HINT.into() },
        _ => ReportError::Invalid { path: path.to_path_buf(), message: e.to_string() },
    }
}

pub fn read_inputs(run_dir: &Path) -> Result<CardInputs, ReportError> {
    let selection: Selection = read(&run_dir.join("selection.json"))?;
    let mut evals = Vec::new();
    for c in &selection.candidates {
        evals.push(read::<EvalResult>(&run_dir.join("eval").join(format!("{}.json", c.name)))?);
    }
    let mut stage_seconds = Vec::new();
    let mut device = "cpu".to_string();
    for stage in ["pull", "prepare", "inspect", "train", "export", "eval", "select"] {
        if let Ok(m) = read::<crate::pipeline::Manifest>(&run_dir.join("manifests").join(format!("{stage}.json"))) {
            stage_seconds.push((stage.to_string(), m.wall_seconds));
            if let Some(d) = m.params.get("device").and_then(|d| d.as_str()) {
                device = d.to_string();
            }
        }
    }
    let inspection = read::<Inspection>(&run_dir.join("report/summary.json")).ok();
    let metrics = run_dir.join("train/metrics.jsonl");
    let validation = points_path(&run_dir.join("train"));
    Ok(CardInputs {
        evals,
        selection,
        train: read(&run_dir.join("train/summary.json"))?,
        metrics: read_metrics(&metrics).map_err(|e| run_file_error(&metrics, e))?,
        validation: read_points(&validation).map_err(|e| run_file_error(&validation, e))?,
        stats: read(&run_dir.join("data/stats.json"))?,
        ingest: read(&run_dir.join("data/ingest.json")).unwrap_or_default(),
        inspection,
        stage_seconds,
        device,
    })
}

/// The value of `key` (`license`, `base_model`) in a Hub README's front matter.
fn front_matter(readme: &str, key: &str) -> Option<String> {
    let body = readme.strip_prefix("---")?;
    let end = body.find("\n---")?;
    body[..end]
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().trim_matches('"').to_string())
        .filter(|v| !v.is_empty())
}

fn hardware(device: &str) -> String {
    if device == "cuda" {
        let gpu = std::process::Command::new("nvidia-smi")
            .args(["--query-gpu=name", "--format=csv,noheader"])
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").trim().to_string())
            .filter(|s| !s.is_empty());
        let unfused = if crate::backend::cuda_fusion() == Ok(false) { ", burn's fusion off" } else { "" };
        return gpu.map_or_else(|| format!("an NVIDIA GPU (CUDA{unfused})"), |g| format!("1 × {g} (CUDA{unfused})"));
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("CPU: {} ({cores} cores)", crate::host::cpu_model().unwrap_or_else(|| std::env::consts::ARCH.into()))
}

/// The card's optimizer row: AdamW's settings and how its moments and bf16 weights were kept (8-bit moments
/// and stochastic rounding change the run).
fn adamw_line(a: &crate::train::optim::AdamWConfig) -> String {
    use crate::train::optim::{Masters, MomentDtype};
    let moments = match a.moments {
        MomentDtype::F32 => "",
        MomentDtype::Bf16 => ", moments in bf16",
        MomentDtype::Q8 => {
            ", moments in block-wise 8 bits (bitsandbytes' AdamW8bit scheme; f32 for tensors under 4,096 values)"
        }
    };
    let masters = match a.masters {
        Masters::F32 => "",
        Masters::Stochastic => ", bf16 weights updated by stochastic rounding instead of f32 master copies",
    };
    format!("β = ({}, {}), ε = {}, weight decay {}{moments}{masters}", a.beta1, a.beta2, a.eps, a.weight_decay)
}

/// The card's batch row: sequences (or tokens) a step and a forward pass, and how far a pass runs.
fn batch_line(c: &crate::train::TrainConfig) -> String {
    let global = c.global_batch_tokens.map_or(c.global_batch.to_string(), |t| format!("{t} tokens"));
    let length = match c.pad_multiple {
        0 => String::new(),
        m => format!("; each forward pass runs to its longest row's tokens, rounded up to a multiple of {m}"),
    };
    format!("{global} / {} sequences{length}", c.micro_batch)
}

/// The card's precision row.
fn precision_line(p: crate::train::Precision) -> String {
    use crate::train::Precision;
    match p {
        Precision::F32 => "f32 throughout".into(),
        Precision::Bf16 => {
            "bf16 weights, activations and gradients; f32 master weights, norms, softmax and loss".into()
        }
        Precision::F16 => {
            "f16 weights, activations and gradients (Vulkan); f32 master weights, norms, softmax and loss".into()
        }
        Precision::Auto => "the device's default (f32 on the CPU, bf16 on CUDA)".into(),
    }
}

/// The eval table's row for one result; the test reads these cells back against the eval files.
pub fn eval_row(r: &EvalResult) -> Vec<String> {
    let a = &r.aggregate;
    let status = r.prompt_template.get("template_status").and_then(|v| v.as_str()).unwrap_or("unknown").to_string();
    let eligible = r
        .prompt_template
        .get("rank_eligible")
        .and_then(|v| v.as_bool())
        .map_or("unknown", |b| if b { "yes" } else { "no" });
    vec![
        r.model.clone(),
        format!("{:.2}", a.score),
        format!("{:.4}", a.avg_command_f1),
        format!("{:.4}", a.avg_command_precision),
        format!("{:.4}", a.avg_command_recall),
        format!("{:.1} %", a.first_cmd_exact_pct),
        format!("{:.1} %", a.valid_json_pct),
        format!("{:.3}", r.avg_sec_per_step),
        format!("{} / {}", a.steps, a.tasks),
        status,
        eligible.to_string(),
    ]
}

const EVAL_HEADERS: [&str; 11] = [
    "checkpoint",
    "Score",
    "command F1",
    "precision",
    "recall",
    "first-command exact",
    "valid JSON",
    "sec/step",
    "steps / tasks",
    "template",
    "rank-eligible",
];

/// The validation loss of each checkpoint by data source, when the split holds more than one source.
fn source_validation_table(md: &mut String, points: &[ValidationPoint]) {
    let checkpoints = checkpoint_points(points);
    let Some((_, first)) = checkpoints.first().filter(|(_, p)| p.sources.len() > 1) else { return };
    let sources: Vec<&String> = first.sources.keys().collect();
    let headers: Vec<String> = std::iter::once("checkpoint".to_string())
        .chain(sources.iter().map(|s| format!("{s} ({} tokens)", first.sources[*s].supervised_tokens)))
        .collect();
    let rows: Vec<Vec<String>> = checkpoints
        .iter()
        .map(|(name, p)| {
            let cells = sources.iter().map(|s| p.sources.get(*s).map_or("-".into(), |l| format!("{:.4}", l.loss)));
            std::iter::once(name.to_string()).chain(cells).collect()
        })
        .collect();
    md.push_str("\nThe validation loss by data source (the held-out split's supervised tokens of each):\n\n");
    md_table(md, &headers.iter().map(String::as_str).collect::<Vec<_>>(), &rows);
}

/// An MoE's routing on the validation split under each checkpoint (`routing::LoadBalance`).
fn routing_table(md: &mut String, points: &[ValidationPoint]) {
    let rows: Vec<Vec<String>> = checkpoint_points(points)
        .into_iter()
        .filter_map(|(name, p)| {
            let b = p.expert_tokens.balance()?;
            let experts: usize = p.expert_tokens.0.values().map(Vec::len).sum();
            Some(vec![
                name.to_string(),
                format!("{:.3}", b.max_vio),
                format!("layer {}: {:.3}", b.worst_layer, b.worst_max_vio),
                format!("{} of {experts}", b.idle_experts),
            ])
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    md.push_str(
        "\nThe MoE layers' routing over the validation split's tokens (MaxVio: the busiest expert's tokens over an \
         even share, less 1; 0 is an even spread):\n\n",
    );
    md_table(md, &["checkpoint", "MaxVio, mean over layers", "least even layer", "experts given no token"], &rows);
}

fn md_table(md: &mut String, headers: &[&str], rows: &[Vec<String>]) {
    let _ = writeln!(md, "| {} |", headers.join(" | "));
    let _ = writeln!(md, "|{}", "---|".repeat(headers.len()));
    for row in rows {
        let cells: Vec<String> = row.iter().map(|c| c.replace('|', "\\|")).collect();
        let _ = writeln!(md, "| {} |", cells.join(" | "));
    }
}

/// Limitations that follow from the measured numbers.
fn limitations(
    inputs: &CardInputs,
    chosen: &EvalResult,
    base: Option<&EvalResult>,
    config: &ModelConfig,
) -> Vec<String> {
    let a = &chosen.aggregate;
    let mut out = Vec::new();
    if config.model.local.is_some() {
        out.push(format!(
            "This is the pipeline's offline default: a {}-parameter model initialized at random and trained on the project's synthetic data. It demonstrates the pipeline end to end; it is not a useful assistant.",
            config.model.parameters.clone().unwrap_or_else(|| "small".into())
        ));
    }
    if a.avg_command_recall < a.avg_command_precision {
        out.push(format!(
            "Recall ({:.4}) is below precision ({:.4}): the model more often leaves out commands the reference runs than adds wrong ones.",
            a.avg_command_recall, a.avg_command_precision
        ));
    } else if a.avg_command_precision < a.avg_command_recall {
        out.push(format!(
            "Precision ({:.4}) is below recall ({:.4}): the model adds commands the reference does not run.",
            a.avg_command_precision, a.avg_command_recall
        ));
    }
    if a.valid_json_pct < 100.0 {
        out.push(format!(
            "{:.1} % of its replies on the replay set were not valid JSON actions, and score no commands unless the keystroke fallback finds some.",
            100.0 - a.valid_json_pct
        ));
    }
    if let Some(b) = base
        && b.aggregate.score >= a.score
    {
        out.push(format!(
            "Fine-tuning did not improve the replay Score over the base model ({:.2} vs {:.2}).",
            a.score, b.aggregate.score
        ));
    }
    out.extend(routing_limitation(&inputs.validation, &chosen.model, config.train.expert_bias_rate));
    let epochs: Vec<(String, f64)> =
        checkpoint_losses(&inputs.validation).into_iter().filter(|(name, _)| name != "base").collect();
    for pair in epochs.windows(2).filter(|w| w[1].1 > w[0].1) {
        out.push(format!(
            "The validation loss rose from {:.4} ({}) to {:.4} ({}): the later epoch fits its training conversations better than held-out ones.",
            pair[0].1, pair[0].0, pair[1].1, pair[1].0
        ));
    }
    if inputs.stats.truncated > 0 || inputs.stats.dropped.get("too_long").is_some_and(|&n| n > 0) {
        out.push(format!(
            "Training saw sequences up to {} tokens: {} samples were truncated and {} dropped as too long, so longer trajectories are under-represented.",
            inputs.stats.config.as_ref().map_or(0, |c| c.seq_len),
            inputs.stats.truncated,
            inputs.stats.dropped.get("too_long").copied().unwrap_or(0)
        ));
    }
    out.push(format!(
        "TB2-lite replays single steps of recorded trajectories ({} steps over {} tasks here): it measures the next action against a reference, not whether the model finishes tasks in a live terminal.",
        a.steps, a.tasks
    ));
    out
}

/// How much MaxVio may grow over the base's before the card calls the routing less even: the figure of a
/// fixed split moves a little with any update.
const ROUTING_DRIFT: f64 = 1.25;

/// The training row of how the run treated an MoE's expert bias (`train.expert_bias_rate`).
fn expert_bias_line(rate: f64) -> String {
    if rate > 0.0 {
        format!("moved {rate} a step toward an even load (auxiliary-loss-free balancing, train.expert_bias_rate)")
    } else {
        "kept as the base model had it (no balancing, as transformers)".into()
    }
}

/// A limitation when the `chosen` checkpoint routes the validation split markedly less evenly than the base
/// model did (MaxVio up by `ROUTING_DRIFT` or more), or leaves experts without a token that the base used;
/// `rate` is the run's `expert_bias_rate`.
fn routing_limitation(points: &[ValidationPoint], chosen: &str, rate: f64) -> Option<String> {
    let balances = checkpoint_balances(points);
    let balance = |name: &str| balances.iter().find(|(n, _)| *n == name).map(|(_, b)| *b);
    let (base, now) = (balance("base")?, balance(chosen)?);
    let uneven = now.max_vio >= base.max_vio * ROUTING_DRIFT && now.max_vio > base.max_vio;
    let idle = now.idle_experts > base.idle_experts;
    (uneven || idle).then(|| {
        let idle_text = if now.idle_experts > 0 {
            let experts = if now.idle_experts == 1 { "expert" } else { "experts" };
            format!("; {} {experts} got no token (base: {})", now.idle_experts, base.idle_experts)
        } else {
            String::new()
        };
        let remedy = if rate > 0.0 {
            format!("This is with the expert bias moved {rate} a step; a larger train.expert_bias_rate corrects faster")
        } else {
            "The expert bias was kept as the base model had it; train.expert_bias_rate moves it toward an even load \
             (docs/TRAINING.md, MoE routing)"
                .into()
        };
        format!(
            "Fine-tuning made the MoE routing less even: MaxVio over the validation split went from {:.3} (base) \
             to {:.3} ({chosen}), least even in layer {} ({:.3}){idle_text}. {remedy}; the per-step figures are in \
             train/metrics.jsonl (`experts`).",
            base.max_vio, now.max_vio, now.worst_layer, now.worst_max_vio
        )
    })
}

/// Where a card is read: the run folder's overview, or the selected checkpoint's own card, which travels with
/// its weights to the Hub (`kiln push runs/<run>/best --repo owner/name`, the push stage) and so links
/// nothing outside the folder.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    Run,
    Checkpoint,
}

/// Writes `README.md` and `card/loss.png`, `card/scores.png` into `run_dir`, and the checkpoint's card (the same
/// figures and tables) into the selected epoch's folder, `best/`. No other epoch keeps a card.
pub fn write_card(
    run_dir: &Path,
    config: &ModelConfig,
    base_dir: &Path,
    command: &str,
) -> Result<CardOutput, ReportError> {
    let inputs = read_inputs(run_dir)?;
    let chosen_dir = selected_checkpoint(run_dir, &inputs.selection)?;
    let card_dir = run_dir.join("card");
    std::fs::create_dir_all(&card_dir).map_err(ReportError::io(&card_dir))?;
    loss_png(&card_dir.join("loss.png"), &inputs.metrics, &inputs.validation)?;
    scores_png(&card_dir.join("scores.png"), &inputs.evals)?;

    crate::eval::select::remove_checkpoint_cards(run_dir, Some(&chosen_dir))
        .map_err(|(path, e)| ReportError::io(&path)(e))?;
    let figures_dir = chosen_dir.join("card");
    std::fs::create_dir_all(&figures_dir).map_err(ReportError::io(&figures_dir))?;
    for png in FIGURES {
        let to = figures_dir.join(png);
        std::fs::copy(card_dir.join(png), &to).map_err(ReportError::io(&to))?;
    }
    let checkpoint_card = chosen_dir.join("README.md");
    let md = markdown(&inputs, run_dir, config, base_dir, command, Place::Checkpoint)?;
    std::fs::write(&checkpoint_card, md).map_err(ReportError::io(&checkpoint_card))?;

    let path = run_dir.join("README.md");
    let md = markdown(&inputs, run_dir, config, base_dir, command, Place::Run)?;
    std::fs::write(&path, md).map_err(ReportError::io(&path))?;
    Ok(CardOutput { path, checkpoint_card, figures: inputs.evals.len() })
}

const FIGURES: [&str; 2] = ["loss.png", "scores.png"];

/// The selected epoch's folder, which must lie in the run's `checkpoints/` (a card is never written into a
/// base model, which may be another run's checkpoint or the Hub cache).
fn selected_checkpoint(run_dir: &Path, selection: &Selection) -> Result<PathBuf, ReportError> {
    let dir = run_dir.join("checkpoints").join(&selection.chosen);
    if !dir.join("config.json").is_file() {
        return Err(ReportError::Invalid {
            path: run_dir.join("selection.json"),
            message: format!(
                "chooses '{}', which is not a checkpoint in {}: run the select stage again",
                selection.chosen,
                run_dir.join("checkpoints").display()
            ),
        });
    }
    Ok(dir)
}

/// How `generate()` decodes the selected checkpoint by its generation_config.json (servers that read the file,
/// vLLM by default, do the same), beside the evaluation's plain greedy decoding.
fn decoding_note(checkpoint: &Path) -> Result<String, ReportError> {
    const GREEDY_EVAL: &str = "as the evaluation below decoded";
    if !checkpoint.join("generation_config.json").is_file() {
        return Ok(format!("The checkpoint has no generation_config.json, so `generate()` is greedy, {GREEDY_EVAL}."));
    }
    let settings = GenerationSettings::from_checkpoint(checkpoint)?;
    if settings.is_plain_greedy() {
        return Ok(format!("Its generation_config.json keeps `generate()` greedy, {GREEDY_EVAL}."));
    }
    let (flags, request) = if settings.repetition_penalty != 1.0 {
        ("`do_sample=False, repetition_penalty=1.0`", "temperature 0 and repetition penalty 1")
    } else {
        ("`do_sample=False`", "temperature 0")
    };
    Ok(format!(
        "Its generation_config.json sets `generate()` to {}, and servers that read the file (vLLM by default) \
         follow it; the evaluation below decoded greedily without a repetition penalty: {flags} in `generate()`, \
         {request} in a server request.",
        settings.describe()
    ))
}

/// The card's markdown for `place`.
fn markdown(
    inputs: &CardInputs,
    run_dir: &Path,
    config: &ModelConfig,
    base_dir: &Path,
    command: &str,
    place: Place,
) -> Result<String, ReportError> {
    let sel = &inputs.selection;
    let chosen = inputs.evals.iter().find(|e| e.model == sel.chosen).ok_or_else(|| ReportError::Invalid {
        path: run_dir.join("selection.json"),
        message: format!("the chosen '{}' has no eval result", sel.chosen),
    })?;
    let base = inputs.evals.iter().find(|e| e.model == "base");
    let base_readme = std::fs::read_to_string(base_dir.join("README.md")).unwrap_or_default();
    let license =
        front_matter(&base_readme, "license").or_else(|| config.license.clone()).unwrap_or_else(|| "other".into());
    // A checkpoint folder that is itself a fine-tune (an earlier run's `best/`) names the Hub model it came from.
    let ancestor = config.model.checkpoint.as_ref().and_then(|_| front_matter(&base_readme, "base_model"));
    let datasets: Vec<String> = inputs
        .ingest
        .iter()
        .flat_map(|i| i.pulls.iter().map(|p| p.repo.clone()))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let template = inputs.stats.template.as_ref();
    let template_origin = template.map_or("the checkpoint's chat template".to_string(), |t| t.origin.clone());
    let run_name = run_dir.file_name().map_or_else(|| "run".into(), |n| n.to_string_lossy().into_owned());

    let mut md = String::from("---\n");
    let languages = if config.languages.is_empty() { vec!["en".to_string()] } else { config.languages.clone() };
    let _ = writeln!(md, "language:\n{}", languages.iter().map(|l| format!("- {l}")).collect::<Vec<_>>().join("\n"));
    let _ = writeln!(md, "library_name: transformers\npipeline_tag: text-generation\nlicense: {license}");
    if let Some(hub) = config.model.hub.as_ref().or(ancestor.as_ref()) {
        let _ = writeln!(md, "base_model: {hub}");
    }
    if !datasets.is_empty() {
        let _ = writeln!(md, "datasets:\n{}", datasets.iter().map(|d| format!("- {d}")).collect::<Vec<_>>().join("\n"));
    }
    let _ = writeln!(md, "tags:\n- kiln\n- sft\n- terminal-agent\n- tb2-lite\n- {}\n---\n", config.architecture);

    let _ = writeln!(md, "# {} fine-tuned with kiln (run `{run_name}`)\n", config.name);
    let base_name = match (&config.model.hub, &config.model.checkpoint) {
        (Some(hub), _) => hub.clone(),
        (None, Some(dir)) => {
            let of = ancestor.as_ref().map(|a| format!(", itself a fine-tune of {a}")).unwrap_or_default();
            format!("the checkpoint `{}`{of}", dir.display())
        }
        (None, None) => format!("a random-init {} ({})", config.architecture, config.name),
    };
    let _ = writeln!(
        md,
        "{}\n\nFull fine-tune of {base_name} on assistant turns only, rendered with the model's native chat template ({template_origin}). It is meant to act as a terminal agent in the Terminus-2 format: given a task and the terminal screen, reply with the next batch of shell keystrokes as JSON.\n",
        config.description
    );
    if place == Place::Checkpoint {
        let _ = writeln!(
            md,
            "These weights are the run's `{}`, the checkpoint its evaluation below selected.\n",
            sel.chosen
        );
    }
    let load_from = match (place, &config.publish_repo) {
        (Place::Checkpoint, Some(repo)) => repo.clone(),
        _ => run_dir.join("best").display().to_string(),
    };

    md.push_str("## Quickstart\n\nWith transformers:\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n");
    let _ = writeln!(md, "path = \"{load_from}\"  # the selected checkpoint ({})", sel.chosen);
    md.push_str("tok = AutoTokenizer.from_pretrained(path)\nmodel = AutoModelForCausalLM.from_pretrained(path, dtype=\"auto\")\nmessages = [{\"role\": \"user\", \"content\": \"<Terminus-2 prompt with the task and the terminal screen>\"}]\ninputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", return_dict=True)\nout = model.generate(**inputs, max_new_tokens=1024, do_sample=False)\nprint(tok.decode(out[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))\n```\n\nWith vLLM:\n\n```bash\n");
    let _ = writeln!(md, "vllm serve {load_from} --served-model-name {run_name}");
    let _ = writeln!(
        md,
        "```\n\nThe evaluation rendered prompts with the chat template shipped in the checkpoint ({template_origin}, sha256 `{}`); use the same template. {}\n",
        template.map_or("unknown", |t| t.sha256.as_str()),
        decoding_note(&run_dir.join("best"))?
    );

    md.push_str("## Output format\n\nOne JSON object per turn, as in the training targets:\n\n```json\n{\n  \"analysis\": \"what the terminal shows, what is done and what is left\",\n  \"plan\": \"the next steps\",\n  \"commands\": [{\"keystrokes\": \"ls -la\\n\", \"duration\": 0.1}],\n  \"task_complete\": false\n}\n```\n\n");

    let first = &inputs.evals[0];
    let _ = writeln!(
        md,
        "## Evaluation\n\nTB2-lite replay ({}, scorer {:?}, greedy decoding, {} steps over {} tasks). Score = 100 × mean command F1.\n",
        first.eval_path, first.scorer, first.aggregate.steps, first.aggregate.tasks
    );
    let mut rows: Vec<Vec<String>> = inputs.evals.iter().map(eval_row).collect();
    let mut headers = EVAL_HEADERS.to_vec();
    let validation = checkpoint_losses(&inputs.validation);
    if !validation.is_empty() {
        headers.push("validation loss");
        for (row, e) in rows.iter_mut().zip(&inputs.evals) {
            let loss = validation.iter().find(|(name, _)| *name == e.model);
            row.push(loss.map_or("-".into(), |(_, l)| format!("{l:.4}")));
        }
    }
    md_table(&mut md, &headers, &rows);
    source_validation_table(&mut md, &inputs.validation);
    routing_table(&mut md, &inputs.validation);
    let _ =
        writeln!(md, "\n**Selected: {}.** {}\n\n![per-checkpoint scores](card/scores.png)\n", sel.chosen, sel.reason);

    md.push_str("## Training\n\n");
    let source_rows: Vec<Vec<String>> = inputs
        .ingest
        .iter()
        .flat_map(|i| {
            i.sources.iter().map(|s| {
                vec![
                    i.recipe.clone(),
                    s.name.clone(),
                    s.rows_read.to_string(),
                    s.decontamination.dropped.to_string(),
                    s.emitted.to_string(),
                ]
            })
        })
        .collect();
    let st = &inputs.stats;
    let kept = if st.validation.is_some() {
        "conversations kept (training and validation)"
    } else {
        "conversations trained on"
    };
    md_table(&mut md, &["recipe", "source", "rows read", "removed as eval overlap", kept], &source_rows);
    let c = &config.train;
    let tokens_trained: u64 = inputs.metrics.iter().map(|m| m.tokens).sum();
    let train_seconds =
        inputs.stage_seconds.iter().find(|(s, _)| s == "train").map_or(inputs.train.seconds, |(_, w)| *w);
    let wall: f64 = inputs.stage_seconds.iter().map(|(_, w)| w).sum();
    let mut details = vec![
        (
            "samples / tokens / supervised tokens",
            format!(
                "{} / {} / {} ({})",
                st.samples,
                st.tokens,
                st.supervised_tokens,
                percent(crate::report::figures::share(st.supervised_tokens, st.tokens))
            ),
        ),
        (
            "sequence length / layout",
            st.config.as_ref().map_or("-".into(), |p| format!("{} / {:?}", p.seq_len, p.layout).to_lowercase()),
        ),
        ("epochs / optimizer steps", format!("{} / {}", inputs.train.epochs_done, inputs.train.steps)),
        (
            "learning rate",
            format!(
                "{} peak, {} decay{} to {} × peak, warmup {}",
                c.lr,
                c.decay.name(),
                if c.decay_ratio < 1.0 {
                    format!(" over the last {} of steps (the peak held before)", percent(c.decay_ratio))
                } else {
                    String::new()
                },
                c.min_lr_ratio,
                c.warmup_steps.map_or(format!("{} of steps", percent(c.warmup_ratio)), |s| format!("{s} steps"))
            ),
        ),
        ("AdamW", adamw_line(&c.adamw)),
        ("precision", precision_line(inputs.train.precision)),
        ("global batch / micro batch", batch_line(c)),
        ("gradient clipping", c.max_grad_norm.map_or("none".into(), |n| format!("global norm {n}"))),
        ("seed", c.seed.to_string()),
        ("hardware", hardware(&inputs.device)),
        ("tokens trained", tokens_trained.to_string()),
        (
            "training wall time",
            format!("{train_seconds:.1} s ({:.0} tokens/s)", tokens_trained as f64 / train_seconds.max(1e-9)),
        ),
        ("pipeline wall time", format!("{wall:.1} s")),
    ];
    if let Some(loss) = inputs.train.final_loss {
        details.push(("final training loss", format!("{loss:.4}")));
    }
    if let Some(v) = &st.validation {
        details.push((
            "validation split",
            format!(
                "{} conversations held out by task ({} samples, {} supervised tokens); its loss is measured for the base model and at every epoch end",
                v.conversations, v.counts.samples, v.counts.supervised_tokens
            ),
        ));
    }
    if config.architecture == "lfm2_moe" {
        details.push(("MoE expert bias", expert_bias_line(c.expert_bias_rate)));
    }
    md.push('\n');
    md_table(&mut md, &["", ""], &details.into_iter().map(|(k, v)| vec![k.to_string(), v]).collect::<Vec<_>>());
    md.push_str("\n![training loss](card/loss.png)\n\n## Dataset\n\n");
    match &inputs.inspection {
        Some(ins) => {
            md_table(
                &mut md,
                &["figure", "value"],
                &key_figures(ins).into_iter().map(|(k, v)| vec![k.to_string(), v]).collect::<Vec<_>>(),
            );
            match place {
                Place::Run => md.push_str("\nThe full inspection report, with rendered examples and their loss masks: [report/index.html](report/index.html).\n\n"),
                Place::Checkpoint => {
                    let report = run_dir.join("report/index.html");
                    let _ = writeln!(md, "\nThe full inspection report, with rendered examples and their loss masks, is in the training run's folder: `{}`.\n", report.display());
                }
            }
        }
        None => md.push_str("No inspection report in this run.\n\n"),
    }
    md.push_str("## Limitations\n\n");
    for l in limitations(inputs, chosen, base, config) {
        let _ = writeln!(md, "- {l}");
    }
    let _ = writeln!(md, "\n## Reproduce\n\n```bash\n{command}\n```\n\nMade with kiln {}.", env!("CARGO_PKG_VERSION"));
    Ok(md)
}

fn draw_err(name: &str) -> impl Fn(Box<dyn std::error::Error>) -> ReportError + '_ {
    move |e| ReportError::Plot { name: name.to_string(), message: e.to_string() }
}

/// The training loss per step, epoch boundaries, and the validation loss where the run measured one (at the
/// step count it was measured after, so the base model's sits at 0).
fn loss_png(path: &Path, metrics: &[StepMetrics], validation: &[ValidationPoint]) -> Result<(), ReportError> {
    super::plots::ensure_font()?;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (800, 360)).into_drawing_area();
        root.fill(&WHITE)?;
        let max_step = metrics.iter().map(|m| m.step + 1).max().unwrap_or(1) as f64;
        let max_loss =
            metrics.iter().map(|m| m.loss).chain(validation.iter().map(|p| p.loss)).fold(0.0f64, f64::max).max(1e-6)
                * 1.05;
        let caption = if validation.is_empty() {
            "training loss (per optimizer step)"
        } else {
            "training loss (per optimizer step) and validation loss (points)"
        };
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..max_step, 0.0..max_loss)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .label_style(("sans-serif", 12))
            .draw()?;
        chart.draw_series(LineSeries::new(
            metrics.iter().map(|m| (m.step as f64 + 1.0, m.loss)),
            RGBColor(70, 110, 170).stroke_width(2),
        ))?;
        // Points only: between two epoch ends nothing was measured, and a line would claim a path.
        let held_out = RGBColor(40, 150, 80).filled();
        chart.draw_series(validation.iter().map(|p| Circle::new((p.step as f64, p.loss), 4, held_out)))?;
        // Epoch boundaries.
        for w in metrics.windows(2).filter(|w| w[1].epoch != w[0].epoch) {
            let x = w[1].step as f64 + 0.5;
            chart.draw_series(LineSeries::new([(x, 0.0), (x, max_loss)], RGBColor(200, 80, 40)))?;
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(draw_err("loss"))
}

fn scores_png(path: &Path, evals: &[EvalResult]) -> Result<(), ReportError> {
    super::plots::ensure_font()?;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (800, 360)).into_drawing_area();
        root.fill(&WHITE)?;
        let top = evals.iter().map(|e| e.aggregate.score).fold(0.0f64, f64::max).max(1.0) * 1.15;
        let names: Vec<String> = evals.iter().map(|e| e.model.clone()).collect();
        let n = names.len();
        let mut chart = ChartBuilder::on(&root)
            .caption("TB2-lite replay Score per checkpoint", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(-0.5..(n as f64 - 0.5), 0.0..top)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    names.get(i as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc("Score (100 × command F1)")
            .label_style(("sans-serif", 12))
            .draw()?;
        chart.draw_series(evals.iter().enumerate().map(|(i, e)| {
            Rectangle::new(
                [(i as f64 - 0.3, 0.0), (i as f64 + 0.3, e.aggregate.score)],
                RGBColor(70, 110, 170).filled(),
            )
        }))?;
        chart.draw_series(evals.iter().enumerate().map(|(i, e)| {
            Text::new(
                format!("{:.2}", e.aggregate.score),
                (i as f64 - 0.12, e.aggregate.score + top * 0.07),
                ("sans-serif", 14),
            )
        }))?;
        root.present()?;
        Ok(())
    };
    draw().map_err(draw_err("scores"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::routing::ExpertLoad;

    /// A validation point of `checkpoint` whose MoE layers 2 and 3 gave their 4 experts these tokens.
    fn routed(step: usize, checkpoint: &str, layers: [[u64; 4]; 2]) -> ValidationPoint {
        ValidationPoint {
            step,
            epoch: step as f64,
            checkpoint: Some(checkpoint.into()),
            loss: 1.0,
            supervised_tokens: 10,
            sources: Default::default(),
            expert_tokens: ExpertLoad([(2, layers[0].to_vec()), (3, layers[1].to_vec())].into()),
            seconds: 0.1,
        }
    }

    /// The table has a row per checkpoint (the last measure of one measured twice); the card names the drift
    /// only past `ROUTING_DRIFT` or when an expert falls idle, and says nothing for a dense model.
    #[test]
    fn the_routing_table_and_its_limitation_come_from_the_validation_loads() {
        let base = routed(0, "base", [[5, 5, 5, 5], [6, 2, 4, 4]]); // MaxVio 0 and 0.5: mean 0.25
        let near = routed(4, "epoch-1", [[11, 9, 10, 10], [6, 2, 4, 4]]); // 0.1 and 0.5: 0.3, below 1.25 × 0.25
        let skewed = routed(8, "epoch-2", [[10, 0, 5, 5], [6, 2, 4, 4]]); // 1.0 and 0.5: 0.75, one idle
        let points = [base.clone(), routed(4, "epoch-1", [[20, 0, 0, 0], [20, 0, 0, 0]]), near, skewed];
        let mut md = String::new();
        routing_table(&mut md, &points);
        assert!(md.contains("| base | 0.250 | layer 3: 0.500 | 0 of 8 |"), "{md}");
        assert!(md.contains("| epoch-1 | 0.300 | layer 3: 0.500 | 0 of 8 |"), "{md}");
        assert!(md.contains("| epoch-2 | 0.750 | layer 2: 1.000 | 1 of 8 |"), "{md}");
        assert_eq!(md.matches("| epoch-1 |").count(), 1, "{md}");
        assert_eq!(routing_limitation(&points, "epoch-1", 0.0), None);
        let said = routing_limitation(&points, "epoch-2", 0.0).unwrap();
        assert!(
            said.contains(
                "from 0.250 (base) to 0.750 (epoch-2), least even in layer 2 (1.000); 1 expert got no token (base: 0)"
            ) && said.contains("The expert bias was kept as the base model had it"),
            "{said}"
        );
        let balanced = routing_limitation(&points, "epoch-2", 0.001).unwrap();
        assert!(balanced.contains("This is with the expert bias moved 0.001 a step"), "{balanced}");
        assert!(expert_bias_line(0.0).starts_with("kept as the base model had it"));
        assert!(expert_bias_line(0.01).starts_with("moved 0.01 a step toward an even load"));
        let dense = ValidationPoint { expert_tokens: ExpertLoad::default(), ..base };
        let mut md = String::new();
        routing_table(&mut md, std::slice::from_ref(&dense));
        assert!(md.is_empty(), "{md}");
        assert_eq!(routing_limitation(&[dense], "base", 0.0), None);
    }

    #[test]
    fn the_batch_row_says_how_far_a_forward_pass_runs() {
        use crate::train::TrainConfig;
        let trimmed = TrainConfig { global_batch: 128, micro_batch: 2, ..TrainConfig::default() };
        assert_eq!(
            batch_line(&trimmed),
            "128 / 2 sequences; each forward pass runs to its longest row's tokens, rounded up to a multiple of 64"
        );
        let whole = TrainConfig { global_batch_tokens: Some(1 << 20), pad_multiple: 0, ..trimmed };
        assert_eq!(batch_line(&whole), "1048576 tokens / 2 sequences");
    }

    #[test]
    fn the_optimizer_and_precision_rows_say_how_the_run_trained() {
        use crate::train::optim::{AdamWConfig, MomentDtype};
        let f32_moments = adamw_line(&AdamWConfig::default());
        assert_eq!(f32_moments, "β = (0.9, 0.999), ε = 0.00000001, weight decay 0.01");
        let q8 = adamw_line(&AdamWConfig { moments: MomentDtype::Q8, ..AdamWConfig::default() });
        assert!(q8.starts_with(&f32_moments) && q8.contains("block-wise 8 bits"), "{q8}");
        let sr =
            adamw_line(&AdamWConfig { masters: crate::train::optim::Masters::Stochastic, ..AdamWConfig::default() });
        assert!(
            sr.starts_with(&f32_moments) && sr.ends_with("by stochastic rounding instead of f32 master copies"),
            "{sr}"
        );
        assert!(precision_line(crate::train::Precision::Bf16).contains("f32 master weights"));
    }

    /// The note beside the quickstart for a checkpoint without the file, a greedy one, one that samples and a
    /// greedy one with a repetition penalty (which the eval did not apply); a broken file stops the card.
    #[test]
    fn the_quickstart_says_how_the_checkpoint_decodes_beside_the_greedy_eval() {
        let dir = tempfile::tempdir().unwrap();
        let note = || decoding_note(dir.path());
        assert!(note().unwrap().starts_with("The checkpoint has no generation_config.json, so `generate()` is greedy"));
        let file = dir.path().join("generation_config.json");
        std::fs::write(&file, r#"{"bos_token_id": 1, "eos_token_id": 7}"#).unwrap();
        assert!(note().unwrap().contains("keeps `generate()` greedy, as the evaluation below decoded"));
        std::fs::write(&file, r#"{"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95}"#).unwrap();
        let sampling = note().unwrap();
        assert!(
            sampling.contains("sets `generate()` to sampling (temperature 0.6, top-k 20, top-p 0.95)"),
            "{sampling}"
        );
        assert!(
            sampling.contains("`do_sample=False` in `generate()`, temperature 0 in a server request"),
            "{sampling}"
        );
        std::fs::write(&file, r#"{"repetition_penalty": 1.05}"#).unwrap();
        let penalized = note().unwrap();
        assert!(penalized.contains("to greedy (repetition penalty 1.05)"), "{penalized}");
        assert!(penalized.contains("`do_sample=False, repetition_penalty=1.0`"), "{penalized}");
        std::fs::write(&file, r#"{"top_p": -1}"#).unwrap();
        let error = note().unwrap_err().to_string();
        assert!(error.contains("generation_config.json: top_p = -1"), "{error}");
    }

    #[test]
    fn license_and_base_model_from_front_matter() {
        let readme = "---\nlibrary_name: x\nlicense: other\nbase_model: org/m\n---\n# M\nlicense: mit";
        assert_eq!(front_matter(readme, "license").as_deref(), Some("other"));
        assert_eq!(front_matter(readme, "base_model").as_deref(), Some("org/m"));
        assert_eq!(front_matter("---\nlicense_name: x\n---\n", "license"), None);
        assert_eq!(front_matter("# no front matter", "license"), None);
    }
}
