//! The `kiln` command line: one subcommand per stage. Errors get their context here and end the process
//! with one message that says what failed and where.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use kiln::data::ingest::ingest;
use kiln::data::{Conversation, DataError, EvalIndex, Recipe};
use kiln::hub::{Hub, HubConfig, PulledRepo, RepoKind, RepoSpec};
use kiln::synth::{SynthConfig, write_all};

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Fine-tune terminal-agent language models: Hub → native template → assistant-only loss → burn → eval → model card"
)]
struct Cli {
    /// Folder of dataset recipes (`<name>.toml`).
    #[arg(long, global = true, env = "KILN_DATASETS", default_value = "datasets")]
    datasets_dir: PathBuf,
    /// No progress bars (logs and CI).
    #[arg(long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download dataset or model repos from the Hub into the HF cache (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE).
    Pull(PullArgs),
    /// Read a recipe's sources into normalized, decontaminated conversations (JSONL) with stats.
    Ingest(IngestArgs),
    /// Write the project's synthetic sample data (terminal, toolbench, held-out replay set).
    Synth(SynthArgs),
    /// Show the build's backends and the Hub settings in effect.
    Info,
}

#[derive(Args)]
struct PullArgs {
    /// A dataset recipe name or path: pulls its Hub sources.
    #[arg(long, conflicts_with = "model")]
    dataset: Option<String>,
    /// Only these sources of the recipe (repeatable).
    #[arg(long = "source")]
    sources: Vec<String>,
    /// A model repo id, e.g. LiquidAI/LFM2-350M.
    #[arg(long)]
    model: Option<String>,
    /// Branch, tag or commit of --model.
    #[arg(long, default_value = "main")]
    revision: String,
    /// Globs of --model files to pull (default: config.json, plus the tokenizer, template and
    /// safetensors files the repo has).
    #[arg(long = "files")]
    files: Vec<String>,
    /// Write the pull record (resolved commits, file hashes) here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct IngestArgs {
    /// Dataset recipe names or paths, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    dataset: Vec<String>,
    /// Only these sources (repeatable).
    #[arg(long = "source")]
    sources: Vec<String>,
    /// Eval sets (JSONL replay steps or trajectories) whose tasks must not be trained on (repeatable).
    #[arg(long = "decontaminate")]
    eval_sets: Vec<PathBuf>,
    /// Output folder: conversations.jsonl and ingest.json.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct SynthArgs {
    #[arg(long, default_value = "datasets/samples")]
    out: PathBuf,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    train_tasks: Option<usize>,
    #[arg(long)]
    eval_tasks: Option<usize>,
    #[arg(long)]
    toolbench: Option<usize>,
}

/// Model files a fine-tune needs; weights in either layout, tokenizer and template in every known place.
const MODEL_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
];

fn main() {
    let cli = Cli::parse();
    if let Err(err) = run(cli) {
        eprintln!("error: {err}");
        for cause in err.chain().skip(1) {
            eprintln!("  caused by: {cause}");
        }
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Pull(args) => pull(args, &cli.datasets_dir, cli.quiet),
        Command::Ingest(args) => ingest_cmd(args, &cli.datasets_dir, cli.quiet),
        Command::Synth(args) => synth(args),
        Command::Info => info(),
    }
}

fn hub(quiet: bool) -> Result<Hub> {
    let mut config = HubConfig::from_env();
    config.show_progress = !quiet;
    Ok(Hub::new(config)?)
}

fn write_json(path: Option<&Path>, value: &impl serde::Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)? + "\n";
    match path {
        Some(p) => {
            if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))
        }
        None => {
            std::io::stdout().write_all(text.as_bytes())?;
            Ok(())
        }
    }
}

fn pull(args: PullArgs, datasets_dir: &Path, quiet: bool) -> Result<()> {
    let started = Instant::now();
    let hub = hub(quiet)?;
    let specs: Vec<RepoSpec> = match (&args.dataset, &args.model) {
        (Some(name), None) => {
            let recipe = Recipe::find(name, datasets_dir)?;
            let sources = recipe.select(&args.sources)?;
            let specs: Vec<RepoSpec> = sources.iter().filter_map(|s| s.hub.as_ref().map(|h| h.spec())).collect();
            if specs.is_empty() {
                eprintln!("{}: every selected source is local; nothing to pull", recipe.name);
            }
            specs
        }
        (None, Some(repo)) => {
            let (files, optional_files) = if args.files.is_empty() {
                (vec!["config.json".to_string()], MODEL_FILES.iter().map(|s| s.to_string()).collect())
            } else {
                (args.files.clone(), vec![])
            };
            vec![RepoSpec {
                kind: RepoKind::Model,
                repo: repo.clone(),
                revision: args.revision.clone(),
                files,
                optional_files,
            }]
        }
        _ => bail!("say what to pull: --dataset <recipe> or --model <repo id>"),
    };
    let mut pulled: Vec<PulledRepo> = Vec::new();
    for spec in &specs {
        let record = hub.pull(spec)?;
        let bytes: u64 = record.files.iter().map(|f| f.size).sum();
        eprintln!(
            "pulled {} {}@{} → {} ({} files, {}{})",
            record.kind,
            record.repo,
            record.revision,
            &record.commit[..record.commit.len().min(12)],
            record.files.len(),
            indicatif::HumanBytes(bytes),
            if record.from_cache { ", from cache" } else { "" }
        );
        pulled.push(record);
    }
    write_json(args.out.as_deref(), &pulled)?;
    eprintln!("pull: {} repos in {:.1}s", pulled.len(), started.elapsed().as_secs_f64());
    Ok(())
}

fn ingest_cmd(args: IngestArgs, datasets_dir: &Path, quiet: bool) -> Result<()> {
    let started = Instant::now();
    let eval = if args.eval_sets.is_empty() {
        None
    } else {
        let index = EvalIndex::load(&args.eval_sets)?;
        eprintln!("decontaminating against {} eval tasks from {}", index.len(), index.sources.join(", "));
        Some(index)
    };
    let needs_hub = args.dataset.iter().map(|d| Recipe::find(d, datasets_dir)).collect::<Result<Vec<_>, _>>()?;
    let hub =
        if needs_hub.iter().any(|r| r.sources.iter().any(|s| s.hub.is_some())) { Some(hub(quiet)?) } else { None };

    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let conv_path = args.out.join("conversations.jsonl");
    let tmp_path = args.out.join("conversations.jsonl.partial");
    let file = File::create(&tmp_path).with_context(|| format!("creating {}", tmp_path.display()))?;
    let mut writer = BufWriter::new(file);
    let mut write = |conv: Conversation| -> Result<(), DataError> {
        let io = |e: std::io::Error| DataError::Io { path: tmp_path.clone(), source: e };
        serde_json::to_writer(&mut writer, &conv).map_err(|e| io(e.into()))?;
        writer.write_all(b"\n").map_err(io)
    };
    let mut all = Vec::new();
    for recipe in &needs_hub {
        let sources = recipe.select(&args.sources)?;
        let stats = ingest(recipe, &sources, hub.as_ref(), eval.as_ref(), !quiet, &mut write)?;
        eprintln!("{}", stats.summary());
        all.push(stats);
    }
    writer.flush().with_context(|| format!("writing {}", tmp_path.display()))?;
    drop(writer);
    std::fs::rename(&tmp_path, &conv_path).with_context(|| format!("moving {} into place", conv_path.display()))?;
    let stats_path = args.out.join("ingest.json");
    write_json(Some(&stats_path), &all)?;
    let emitted: u64 = all.iter().map(|s| s.emitted).sum();
    eprintln!(
        "ingest: {emitted} conversations → {} ({:.1}s; stats in {})",
        conv_path.display(),
        started.elapsed().as_secs_f64(),
        stats_path.display()
    );
    Ok(())
}

fn synth(args: SynthArgs) -> Result<()> {
    let defaults = SynthConfig::default();
    let config = SynthConfig {
        seed: args.seed.unwrap_or(defaults.seed),
        train_tasks: args.train_tasks.unwrap_or(defaults.train_tasks),
        eval_tasks: args.eval_tasks.unwrap_or(defaults.eval_tasks),
        toolbench: args.toolbench.unwrap_or(defaults.toolbench),
    };
    let summary = write_all(&args.out, &config)?;
    eprintln!(
        "synth: {} terminal trajectories ({} families), {} held-out → {} replay steps, {} toolbench conversations → {}",
        summary.train_conversations,
        summary.families.len(),
        summary.heldout_conversations,
        summary.replay_steps,
        summary.toolbench_conversations,
        args.out.display()
    );
    Ok(())
}

fn info() -> Result<()> {
    let config = HubConfig::from_env();
    kiln::backend::smoke_test::<kiln::backend::Cpu>(&Default::default()).map_err(anyhow::Error::msg)?;
    let report = serde_json::json!({
        "kiln": env!("CARGO_PKG_VERSION"),
        "backends": kiln::backend::compiled(),
        "cpu_smoke_test": "ok",
        "hub": {
            "endpoint": config.endpoint,
            "cache_dir": config.cache_dir,
            "offline": config.offline,
            "token": config.token_source.unwrap_or_else(|| "none".into()),
        },
    });
    write_json(None, &report)
}
