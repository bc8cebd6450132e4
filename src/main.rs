//! The `kiln` command line: one subcommand per stage. Errors get their context here and end the process
//! with one message that says what failed and where.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use kiln::chat::{
    ChatInput, ChatTemplate, PinnedClock, PromptRule, SampleMode, SamplePolicy, Thinking, ToolResults, build_samples,
};
use kiln::data::{DataError, EvalIndex, Recipe};
use kiln::hub::{Hub, HubConfig, PulledRepo, RepoKind, RepoSpec};
use kiln::synth::{SynthConfig, write_all};
use kiln::tokens::mask::{Truncation, ansi_view, tokenize_sample};
use kiln::tokens::prepare::{PrepareConfig, prepare};
use kiln::tokens::shards::Layout;
use kiln::tokens::{TextTokenizer, TokenSample};

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
    /// Render conversations with a model's chat template into text, token ids and loss masks.
    Render(RenderArgs),
    /// Turn normalized conversations into token shards with assistant-only loss masks, and stats.
    Prepare(PrepareArgs),
    /// The whole pipeline: pull → prepare → inspect → train → export → eval → select → card (→ push), resumable.
    Sft(SftArgs),
    /// Write the model card (README.md, card/*.png) of a run that has been evaluated and selected.
    Card(CardArgs),
    /// Upload a checkpoint folder (a run's best/, its card included) to a Hub model repo as one commit of the
    /// files that changed (HF_TOKEN).
    Push(PushArgs),
    /// Write the dataset inspection report of a prepared run (report/index.html, summary.md, summary.json).
    Inspect(InspectArgs),
    /// Train the offline default's byte-level BPE tokenizer on conversations.
    Tokenizer(TokenizerArgs),
    /// One forward pass of a checkpoint; writes the logits as safetensors (tensor `logits`, f32, [seq, vocab]).
    Logits(LogitsArgs),
    /// Generate from a prompt with the cached decoder, greedy or sampled as the checkpoint's
    /// generation_config.json says (the flags override it); the text streams to stdout.
    Generate(GenerateArgs),
    /// Talk with a checkpoint: each line of input is a user message, the reply streams back and the
    /// conversation goes on (`/reset` starts over, `/exit` or end of input ends it).
    Chat(ChatArgs),
    /// Load a checkpoint and write it back as an HF directory (dtype, sharding), as the trainer exports.
    Convert(ConvertArgs),
    /// Write a seeded random-init checkpoint for a config.json (the offline default's tiny model).
    InitModel(InitModelArgs),
    /// Full fine-tuning on prepared shards, exporting a checkpoint every epoch.
    Train(TrainArgs),
    /// Training-step benchmark of a random-init model of a config.json shape (tokens/s, MFU, peak memory)
    /// as JSON; tests/bench/train.sh runs it beside the PyTorch reference.
    BenchTrain(BenchTrainArgs),
    /// Score predictions on the TB2-lite replay set exactly as the reference evaluator.
    Score(ScoreArgs),
    /// Evaluate a checkpoint on the TB2-lite replay set (render, greedy decode, score).
    Eval(EvalArgs),
    /// Evaluate a run's base model and epochs (where not yet done) and choose the best epoch.
    Select(SelectArgs),
    /// Show the build's backends and the Hub settings in effect.
    Info,
}

#[derive(Args)]
struct SftArgs {
    /// A model name in configs/models/ (or a path to a model config TOML).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Set a key of the model config for this run, as a TOML value or else a string: `train.lr=1e-5`,
    /// `train.adamw.moments=bf16`, `data.seq_len=4096`, `eval.max_tokens=512`; `KEY=` removes the key, so its
    /// default applies (repeatable, applied in order; the flags below must agree with it).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<kiln::pipeline::ConfigOverride>,
    /// Fine-tune this checkpoint folder (an earlier run's best/, say) instead of the model config's model; the
    /// config's template, data, training and eval settings still apply.
    #[arg(long, value_name = "DIR")]
    base: Option<PathBuf>,
    /// Epochs (default: the model config's, else the pipeline's, 2).
    #[arg(long)]
    epochs: Option<usize>,
    /// Dataset recipes instead of the model config's mix (comma-separated).
    #[arg(long, value_delimiter = ',')]
    data: Option<Vec<String>>,
    /// Replay set for eval instead of the model config's.
    #[arg(long)]
    replay: Option<PathBuf>,
    /// Run name: the run goes to runs/<run> (default: the model name).
    #[arg(long)]
    run: Option<String>,
    /// Run this stage and every later one even when up to date.
    #[arg(long, value_enum)]
    from: Option<kiln::pipeline::Stage>,
    /// Stop after this stage.
    #[arg(long, value_enum)]
    until: Option<kiln::pipeline::Stage>,
    /// cpu, cuda, vulkan (--features vulkan; f32), or auto (cuda when this build has it and a GPU is visible).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Keep each layer's input alone and recompute the layer in the backward pass (as the model config's
    /// `train.activation_checkpointing`): less activation memory, about one forward pass more, the same
    /// training.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Train data-parallel on this many devices (cuda 0..N), as the model config's `train.devices`.
    #[arg(long)]
    devices: Option<usize>,
    #[arg(long, default_value = "pipelines/sft.toml")]
    pipeline: PathBuf,
    #[arg(long, env = "KILN_CONFIGS", default_value = "configs/models")]
    configs_dir: PathBuf,
    /// Stop training after N steps as Ctrl-C would (for testing resume).
    #[arg(long, hide = true)]
    halt_after: Option<usize>,
    /// Say which stages would run and why (what changed since their manifests), and which are up to date;
    /// run nothing, write nothing. The plan as JSON on stdout.
    #[arg(long)]
    dry_run: bool,
}

#[derive(Args)]
struct PushArgs {
    /// The checkpoint folder: config.json and safetensors weights (runs/<run>/best, a checkpoints/epoch-<k>).
    dir: PathBuf,
    /// The model repo to push to (owner/name); created when it does not exist.
    #[arg(long)]
    repo: String,
    /// The branch to commit to; created from the default branch when missing.
    #[arg(long, default_value = "main")]
    revision: String,
    /// Create the repo private (an existing repo keeps its visibility).
    #[arg(long)]
    private: bool,
    /// The commit message (default: "Upload <folder> with kiln").
    #[arg(long)]
    message: Option<String>,
    /// Write the record (commit, files and their sha256, deleted stale weights) here as JSON instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct CardArgs {
    /// The run folder (runs/<run>) written by `kiln sft`.
    #[arg(long)]
    run: PathBuf,
}

#[derive(Args)]
struct InspectArgs {
    /// The run folder (runs/<run>), holding data/stats.json, the shards and data/conversations.jsonl.
    #[arg(long)]
    run: PathBuf,
    /// Random examples shown beside the first and the longest sample.
    #[arg(long, default_value_t = 3)]
    examples: usize,
    /// Seed of the random example choice.
    #[arg(long, default_value_t = 0)]
    seed: u64,
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
    /// Drop a conversation identical (messages, calls, reasoning, tools; not its id) to one already kept from
    /// any of the recipes, counted as `duplicate`.
    #[arg(long)]
    dedupe: bool,
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

/// How conversations become samples (shared by render and prepare).
#[derive(Args)]
struct TemplateArgs {
    /// A model directory (tokenizer.json + tokenizer_config.json / chat_template.jinja) or a model name
    /// with a directory in configs/models/.
    #[arg(long)]
    model: String,
    /// Use this chat template file instead of the model's.
    #[arg(long)]
    template: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "auto")]
    mode: SampleMode,
    #[arg(long, value_enum, default_value = "strip-history")]
    thinking: Thinking,
    /// The date templates see through strftime_now (YYYY-MM-DD); default: today, recorded in the output.
    #[arg(long)]
    date: Option<String>,
    /// Template variables as KEY=JSON (e.g. enable_thinking=false), repeatable.
    #[arg(long = "template-var", value_parser = parse_var)]
    vars: Vec<(String, serde_json::Value)>,
    /// The token that closes an assistant turn (default: read from the tokenizer).
    #[arg(long)]
    end_of_turn: Option<String>,
    /// What the template gets for results of calls written in the text (ReAct): `tool` messages as they are,
    /// or `user` messages (for templates that render tool messages only after structured calls: Gemma 4's).
    #[arg(long, value_enum, default_value = "tool")]
    tool_results: ToolResults,
    /// Where the generation prompt is not a prefix of a turn's render: refuse the turn, or `splice` its text
    /// after the prompt (for prompts that add what a turn's render leaves out: Gemma 4's empty thought channel).
    #[arg(long, value_enum, default_value = "prefix")]
    prompt_rule: PromptRule,
}

fn parse_var(s: &str) -> Result<(String, serde_json::Value), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))?;
    let value = serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.to_string()));
    Ok((k.to_string(), value))
}

#[derive(Args)]
struct RenderArgs {
    #[command(flatten)]
    template: TemplateArgs,
    /// JSON lines of {"id"?, "messages": [...], "tools"?: [...]}.
    #[arg(long)]
    input: PathBuf,
    /// One line per sample: {"id", "text", "input_ids", "loss_mask"}.
    #[arg(long)]
    out: PathBuf,
    /// Render each input as a prompt for the next assistant turn (mask all 0).
    #[arg(long)]
    generation_prompt: bool,
    /// Do not print the colored view of the first sample.
    #[arg(long)]
    no_view: bool,
}

#[derive(Args)]
struct PrepareArgs {
    #[command(flatten)]
    template: TemplateArgs,
    /// Normalized conversations (ingest's conversations.jsonl).
    #[arg(long)]
    data: PathBuf,
    /// Output folder for the shards and stats.json.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 4096)]
    seq_len: usize,
    #[arg(long, value_enum, default_value = "packed")]
    layout: Layout,
    #[arg(long, value_enum, default_value = "drop")]
    truncation: Truncation,
    /// Hold out this share of the conversations (by task where the data names one) as the validation split
    /// (`<out>/validation/`), whose loss `kiln train` reports; 0 holds out none.
    #[arg(long, default_value_t = 0.0)]
    validation_share: f64,
}

#[derive(Args)]
struct TokenizerArgs {
    /// Conversations (JSON lines with messages) to train on.
    #[arg(long, required = true)]
    data: Vec<PathBuf>,
    #[arg(long, default_value_t = 4096)]
    vocab_size: usize,
    /// `model_max_length` written to tokenizer_config.json.
    #[arg(long, default_value_t = 8192, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_length: usize,
    /// Output model directory (tokenizer.json, tokenizer_config.json).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct ModelDirArgs {
    /// An HF checkpoint directory (config.json, safetensors, tokenizer files).
    #[arg(long)]
    model_dir: PathBuf,
    /// Where to compute: cpu, cuda (builds with --features cuda) or vulkan (--features vulkan; f32).
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args)]
struct LogitsArgs {
    #[command(flatten)]
    model: ModelDirArgs,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', conflicts_with = "text")]
    ids: Vec<u32>,
    /// Text, tokenized with the checkpoint's tokenizer (no special tokens added).
    #[arg(long)]
    text: Option<String>,
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelDirArgs,
    #[arg(long)]
    prompt: String,
    /// Render the prompt as one user message with the checkpoint's chat template and generation prompt.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// How tokens are chosen: the checkpoint's generation_config.json (transformers' defaults for what it lacks:
/// greedy; top-k 50 once sampling), then these.
#[derive(Args)]
struct SamplingArgs {
    /// Greedy decoding whatever the checkpoint's generation_config.json says.
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p", "min_p"])]
    greedy: bool,
    /// Sampling temperature; 0 means greedy. Any of these four given turns sampling on.
    #[arg(long)]
    temperature: Option<f32>,
    /// Keep the K most likely tokens (0: no limit).
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the most likely tokens whose probabilities add up to P (1: all).
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one.
    #[arg(long)]
    min_p: Option<f32>,
    /// Penalize tokens already in the prompt or reply (above 1), as transformers does; greedy too.
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Seed of the draws (default: a fresh one, printed so the output can be had again).
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The checkpoint's settings with these applied, and the seed.
    fn picker(&self, model_dir: &Path) -> Result<(kiln::models::sampling::TokenPicker, u64)> {
        use kiln::models::sampling::{GenerationSettings, SamplingOverrides, TokenPicker};
        let overrides = SamplingOverrides {
            greedy: self.greedy,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
        };
        let settings = GenerationSettings::from_checkpoint(model_dir)?;
        let settings = settings.overridden(&overrides).context("the sampling flags")?;
        let seed = self.seed.unwrap_or_else(rand::random);
        Ok((TokenPicker::new(settings, seed), seed))
    }
}

#[derive(Args)]
struct ChatArgs {
    #[command(flatten)]
    model: ModelDirArgs,
    /// A system message opening the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Tools offered on every turn: a JSON list of function schemas (OpenAI's `tools`; a bare `{name,
    /// description, parameters}` is wrapped as `{"type": "function", "function": …}`). A reply's call stays in
    /// its text; `/tool RESULT` answers it.
    #[arg(long, value_name = "FILE")]
    tools: Option<PathBuf>,
    /// Most tokens a reply may take.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Template thinking switch (`enable_thinking`); default: the template's own.
    #[arg(long)]
    enable_thinking: Option<bool>,
    /// Write each conversation as a line of conversation JSONL (what `kiln render --input` reads), after
    /// every reply.
    #[arg(long)]
    transcript: Option<PathBuf>,
    /// Run each turn's whole prompt instead of continuing the states earlier turns kept (slower; to
    /// measure them, or to rule them out).
    #[arg(long)]
    no_kept_states: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
}

#[derive(Args)]
struct EvalOptionArgs {
    /// Replay steps (JSONL).
    #[arg(long)]
    replay: PathBuf,
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// At most this many prompt tokens a batch (its rows times its longest prompt; one row at least).
    #[arg(long, default_value_t = kiln::eval::run::default_batch_tokens())]
    batch_tokens: usize,
    /// Template thinking switch (`enable_thinking`); default: the template's own.
    #[arg(long)]
    enable_thinking: Option<bool>,
    /// Strip <think> blocks from assistant history before rendering.
    #[arg(long)]
    strip_thinking_history: bool,
    #[arg(long, value_enum, default_value = "v2")]
    scorer: kiln::eval::ScorerVersion,
    /// Only the first N steps.
    #[arg(long)]
    limit: Option<usize>,
    /// Only these task ids (comma-separated).
    #[arg(long, value_delimiter = ',')]
    tasks: Vec<String>,
    /// cpu, cuda (builds with --features cuda) or vulkan (--features vulkan; f32).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Decode on this many GPUs at once (cuda 0..N), each with a copy of the model; the result is the same.
    #[arg(long, default_value_t = 1)]
    devices: usize,
}

impl EvalOptionArgs {
    fn options(&self) -> kiln::eval::run::EvalOptions {
        kiln::eval::run::EvalOptions {
            max_tokens: self.max_tokens,
            batch_size: self.batch_size,
            batch_tokens: self.batch_tokens,
            enable_thinking: self.enable_thinking,
            strip_thinking_history: self.strip_thinking_history,
            scorer: self.scorer,
            limit: self.limit,
            tasks: self.tasks.clone(),
        }
    }
}

#[derive(Args)]
struct EvalArgs {
    /// The checkpoint directory.
    #[arg(long)]
    checkpoint: PathBuf,
    #[command(flatten)]
    eval: EvalOptionArgs,
    /// The name recorded in the result (default: the checkpoint folder's name).
    #[arg(long)]
    name: Option<String>,
    /// Result file (default: eval/<name>.json).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct SelectArgs {
    /// The run directory (checkpoints/epoch-<k>/).
    #[arg(long)]
    run: PathBuf,
    /// The base model, evaluated for comparison.
    #[arg(long)]
    base: Option<PathBuf>,
    #[command(flatten)]
    eval: EvalOptionArgs,
}

#[derive(Args)]
struct ScoreArgs {
    /// Replay steps (JSONL, the TB2-lite record schema).
    #[arg(long)]
    replay: PathBuf,
    /// JSONL of {task_id, step_idx, text}, or another evaluator's result JSON.
    #[arg(long)]
    predictions: PathBuf,
    #[arg(long, value_enum, default_value = "v2")]
    scorer: kiln::eval::ScorerVersion,
    #[arg(long)]
    out: PathBuf,
    /// The model name recorded in the result.
    #[arg(long, default_value = "external")]
    model: String,
}

#[derive(Args)]
struct TrainArgs {
    /// The checkpoint to fine-tune (HF directory).
    #[arg(long)]
    model_dir: PathBuf,
    /// Folder of token shards (kiln prepare's output).
    #[arg(long)]
    data: PathBuf,
    /// Run directory: train/metrics.jsonl, train/state/, checkpoints/epoch-<k>/.
    #[arg(long)]
    run: PathBuf,
    /// A TOML file whose [train] table sets the hyper-parameters (flags override it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Continue from run/train/state exactly where it stopped.
    #[arg(long)]
    resume: bool,
    /// cpu, cuda (builds with --features cuda) or vulkan (--features vulkan; f32, or f16 standing in for bf16).
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long)]
    epochs: Option<usize>,
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    warmup_ratio: Option<f64>,
    #[arg(long, value_enum)]
    decay: Option<kiln::train::schedule::Decay>,
    /// Decay over the last this share of the steps, the peak held before it (warmup-stable-decay; 1: every
    /// step after warmup).
    #[arg(long)]
    decay_ratio: Option<f64>,
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Sequences per optimizer step.
    #[arg(long)]
    global_batch: Option<usize>,
    /// Tokens per optimizer step (sequences = tokens / sequence length); wins over --global-batch.
    #[arg(long)]
    global_batch_tokens: Option<usize>,
    /// Sequences per forward pass.
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Run each forward pass at its longest row's tokens rounded up to a multiple of this, dropping the rows'
    /// trailing padding (default 64); 0 runs whole rows.
    #[arg(long)]
    pad_multiple: Option<usize>,
    /// 0 disables clipping (as `max_grad_norm = 0` in the config).
    #[arg(long)]
    max_grad_norm: Option<f64>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    save_every: Option<usize>,
    /// Measure the validation split's loss (shards under `<data>/validation/`, from `kiln prepare
    /// --validation-share`) every this many steps, besides the base model's and each epoch end's.
    #[arg(long)]
    validation_every: Option<usize>,
    /// Keep no resumable state (`train.save_state = false`): only the epoch exports are written, and an
    /// interrupted run starts over.
    #[arg(long)]
    no_state: bool,
    #[arg(long, value_enum)]
    export_dtype: Option<kiln::models::hf::ExportDtype>,
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Keep each layer's input alone and recompute the layer in the backward pass: less activation memory,
    /// about one forward pass more.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Data-parallel replicas, one a device (cuda 0..N): a step's micro-batches are shared among them and their
    /// gradients summed by burn's collective. On the CPU they share its one device (a check, not a speed-up).
    #[arg(long)]
    devices: Option<usize>,
    /// Parameter / activation dtype: auto is f32 on the CPU, bf16 (with f32 master weights) on CUDA.
    #[arg(long, value_enum)]
    precision: Option<kiln::train::Precision>,
    /// How AdamW keeps its moments between steps: f32, bf16 (4 bytes a parameter less) or q8 (block-wise 8-bit,
    /// 6 less, as bitsandbytes' AdamW8bit; tensors under 4,096 values keep f32).
    #[arg(long, value_enum)]
    moments: Option<kiln::train::optim::MomentDtype>,
    /// How the update reaches bf16 parameters: f32 (an f32 master copy of each) or stochastic (no master,
    /// 4 bytes a parameter less: the f32 update rounded into bf16 stochastically, unbiased).
    #[arg(long, value_enum)]
    masters: Option<kiln::train::optim::Masters>,
    /// burn's plain compositions instead of kiln's ops with hand-written backward passes (attention,
    /// norms, SwiGLU, convolution, expert matmul, DeltaNet scan, projection splits, loss): same results
    /// to rounding, more memory; an A/B switch.
    #[arg(long)]
    reference_ops: bool,
}

#[derive(Args)]
struct BenchTrainArgs {
    /// A config.json, or a folder holding one (tests/bench/shapes/ has the benchmark shapes).
    #[arg(long)]
    config: PathBuf,
    /// cpu, cuda (builds with --features cuda) or vulkan (--features vulkan; f32, or f16 standing in for bf16).
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long, value_enum, default_value = "auto")]
    precision: kiln::train::Precision,
    #[arg(long, default_value_t = 4096)]
    seq: usize,
    #[arg(long, default_value_t = 1)]
    micro_batch: usize,
    /// Forward passes per optimizer step.
    #[arg(long, default_value_t = 1)]
    accumulation: usize,
    /// Timed optimizer steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first (kernel compilation, autotuning, allocator growth).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Documents packed per row (1 = one causal document, as the PyTorch reference).
    #[arg(long, default_value_t = 1)]
    docs_per_row: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value_t = 1e-5)]
    lr: f64,
    /// Dense bf16 peak of the accelerator in TFLOP/s, for MFU (H100/H200 SXM: 989).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Keep each layer's input alone and recompute the layer in the backward pass.
    #[arg(long)]
    activation_checkpointing: bool,
    /// How AdamW keeps its moments: f32, bf16 (4 bytes a parameter less) or q8 (block-wise 8-bit, 6 less).
    #[arg(long, value_enum, default_value = "f32")]
    moments: kiln::train::optim::MomentDtype,
    /// How the update reaches bf16 parameters: f32 masters, or stochastic rounding without them (4 bytes less).
    #[arg(long, value_enum, default_value = "f32")]
    masters: kiln::train::optim::Masters,
    /// burn's plain compositions instead of kiln's ops with hand-written backward passes (to measure what
    /// the ops buy).
    #[arg(long)]
    reference_ops: bool,
    /// Write the result JSON here too (it is always printed on stdout).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct InitModelArgs {
    /// A folder with config.json and the tokenizer / template files to ship beside the weights.
    #[arg(long)]
    from: PathBuf,
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: kiln::models::hf::ExportDtype,
}

#[derive(Args)]
struct ConvertArgs {
    #[command(flatten)]
    model: ModelDirArgs,
    #[arg(long)]
    out: PathBuf,
    /// On-disk dtype; default: the source checkpoint's (bf16 for f16 / bf16 sources).
    #[arg(long, value_enum)]
    dtype: Option<kiln::models::hf::ExportDtype>,
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
    let host_allocator = kiln::backend::tune_host_allocator();
    let cli = Cli::parse();
    kiln::device_panics::install();
    // Before any CubeCL runtime reads its settings (the first device does).
    kiln::kernel_cache::install();
    // A panic (above all one on a GPU backend's device thread, which kills the command from there) ends in
    // one error line that names the first panic instead of its echoes.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(cli, host_allocator))) {
        Ok(Ok(())) => {}
        Ok(Err(err)) => {
            for line in error_lines(&err) {
                eprintln!("{line}");
            }
            // A device thread's panic may come back as an error (its echo, from a sync or a read): name it.
            if kiln::device_panics::panicked() {
                eprintln!("error: {}", kiln::device_panics::summary());
            }
            std::process::exit(exit_status(Some(&err)));
        }
        Err(_) => {
            eprintln!("error: {}", kiln::device_panics::summary());
            std::process::exit(exit_status(None));
        }
    }
}

/// The exit status of a command the device's memory could not hold (kiln's check of the weights, gradients
/// and optimizer state, or a failed device allocation), apart from other failures (1, and 101 for a panic):
/// a benchmark script learns that a shape does not fit, which no fallback switch mends.
const EXIT_OUT_OF_MEMORY: i32 = 3;

/// The error, then each cause whose text the lines before it do not already hold (a library error that
/// writes its source into its own message would otherwise print it twice).
fn error_lines(err: &anyhow::Error) -> Vec<String> {
    let mut lines = vec![format!("error: {err}")];
    for cause in err.chain().skip(1).map(|c| c.to_string()) {
        if !lines.iter().any(|line| line.contains(&cause)) {
            lines.push(format!("  caused by: {cause}"));
        }
    }
    lines
}

/// How a failed command exits: `err` is its error, `None` when it ended in a panic.
fn exit_status(err: Option<&anyhow::Error>) -> i32 {
    use kiln::pipeline::PipelineError;
    use kiln::train::TrainError;
    let refused = err.is_some_and(|err| {
        err.chain().any(|cause| {
            matches!(cause.downcast_ref(), Some(TrainError::OutOfMemory(_)))
                || matches!(cause.downcast_ref(), Some(PipelineError::Train(TrainError::OutOfMemory(_))))
        })
    });
    if refused || kiln::device_panics::out_of_memory().is_some() {
        EXIT_OUT_OF_MEMORY
    } else if err.is_none() || kiln::device_panics::panicked() {
        101
    } else {
        1
    }
}

/// `host_allocator`: the malloc settings `main` applied (`backend::tune_host_allocator`), for `kiln info`.
fn run(cli: Cli, host_allocator: Option<&str>) -> Result<()> {
    // Read deep inside the models, where no error can surface: a malformed value stops any command that
    // could run them here (`info` reports it).
    if !matches!(cli.command, Command::Info) {
        for kernel in kiln::backend::Kernel::ALL {
            kernel.setting().map_err(anyhow::Error::msg)?;
        }
        kiln::backend::experts_batched().map_err(anyhow::Error::msg)?;
        kiln::backend::MatmulKernels::from_env().map_err(anyhow::Error::msg)?;
        kiln::models::attention::chunk_score_budget().map_err(anyhow::Error::msg)?;
    }
    match cli.command {
        Command::Pull(args) => pull(args, &cli.datasets_dir, cli.quiet),
        Command::Ingest(args) => ingest_cmd(args, &cli.datasets_dir, cli.quiet),
        Command::Synth(args) => synth(args),
        Command::Render(args) => render(args, cli.quiet),
        Command::Prepare(args) => prepare_cmd(args, cli.quiet),
        Command::Sft(args) => sft_cmd(args, &cli.datasets_dir, cli.quiet),
        Command::Card(args) => card_cmd(args),
        Command::Push(args) => push_cmd(args, cli.quiet),
        Command::Inspect(args) => inspect_cmd(args, cli.quiet),
        Command::Tokenizer(args) => tokenizer_cmd(args),
        Command::Logits(args) => on_device(&args.model.device.clone(), Job::Logits(args)),
        Command::Generate(args) => on_device(&args.model.device.clone(), Job::Generate(args)),
        Command::Chat(args) => on_device(&args.model.device.clone(), Job::Chat(args)),
        Command::Convert(args) => on_device(&args.model.device.clone(), Job::Convert(args)),
        Command::InitModel(args) => init_model(args),
        Command::Train(args) => train_cmd(args, cli.quiet),
        Command::BenchTrain(args) => bench_train_cmd(args),
        Command::Score(args) => score_cmd(args),
        Command::Eval(args) => eval_cmd(args, cli.quiet),
        Command::Select(args) => select_cmd(args, cli.quiet),
        Command::Info => info(host_allocator),
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
        Some(p) => kiln::files::write_json(p, value).with_context(|| format!("writing {}", p.display())),
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

/// Ctrl-C during a training: it finishes its step, saves its state and returns; a second Ctrl-C, or one
/// while nothing trains (a download, the data, an eval: nothing to save), ends the process at once.
fn stop_on_ctrl_c() -> std::sync::Arc<kiln::train::StopRequest> {
    let stop = std::sync::Arc::new(kiln::train::StopRequest::default());
    let request = stop.clone();
    let _ = ctrlc::set_handler(move || {
        if !request.request() {
            std::process::exit(130);
        }
        eprintln!("\nstopping after this training step, with the state saved (Ctrl-C again to abort)…");
    });
    stop
}

/// This invocation as a shell would take it again (the card's reproduce line, the run lock's holder), each
/// argument quoted where it needs it (`--set 'data.recipes=["terminal"]'`).
/// This process's arguments, with the program named `kiln` whatever its path.
fn arguments() -> Vec<String> {
    std::iter::once("kiln".to_string()).chain(std::env::args().skip(1)).collect()
}

fn command_line() -> String {
    let args = arguments();
    // Quoting fails only on a NUL byte, which no argument can hold.
    shlex::try_join(args.iter().map(String::as_str)).unwrap_or_else(|_| args.join(" "))
}

/// The lock of an existing run folder, for the commands that write into one made by `kiln sft` (a folder
/// that is not there is left to the command's own error).
fn lock_run(run: &Path) -> Result<Option<kiln::files::RunLock>> {
    if !run.is_dir() {
        return Ok(None);
    }
    Ok(Some(kiln::files::RunLock::acquire(run, &command_line())?))
}

fn sft_cmd(args: SftArgs, datasets_dir: &Path, quiet: bool) -> Result<()> {
    let command = kiln::pipeline::reproduce_command(&arguments());
    let req = kiln::pipeline::SftRequest {
        model: args.model,
        overrides: args.set,
        base: args.base,
        epochs: args.epochs,
        data: args.data,
        replay: args.replay,
        run: args.run,
        from: args.from,
        until: args.until,
        device: args.device,
        activation_checkpointing: args.activation_checkpointing,
        devices: args.devices,
        pipeline: args.pipeline,
        configs_dir: args.configs_dir,
        datasets_dir: datasets_dir.to_path_buf(),
        halt_after: args.halt_after,
        show_progress: !quiet,
        command,
    };
    if args.dry_run {
        return sft_dry_run(&req);
    }
    let stop = stop_on_ctrl_c();
    let s = kiln::pipeline::run_sft(&req, &stop)?;
    let show = |p: &Option<PathBuf>| p.as_ref().map_or_else(|| "-".to_string(), |p| p.display().to_string());
    eprintln!(
        "sft: {} stages run, {} skipped in {:.1}s; selected {} (Score {}); report {}; card {}",
        s.stages_run.len(),
        s.stages_skipped.len(),
        s.wall_seconds,
        s.selected.as_deref().unwrap_or("-"),
        s.selected_score.map_or_else(|| "-".to_string(), |x| format!("{x:.2}")),
        show(&s.report),
        show(&s.card)
    );
    if let Some(url) = &s.pushed {
        eprintln!("sft: the selected checkpoint is on the Hub as {url}");
    }
    Ok(())
}

/// `kiln sft --dry-run`: each stage and why it would run, the plan as JSON on stdout.
fn sft_dry_run(req: &kiln::pipeline::SftRequest) -> Result<()> {
    use kiln::pipeline::Decision;
    let plan = kiln::pipeline::plan_sft(req)?;
    let total = plan.stages.len();
    let mut running = 0;
    for (i, s) in plan.stages.iter().enumerate() {
        let what = match &s.decision {
            Decision::Off { why } => format!("off: {why}"),
            Decision::Skip { fingerprint } => {
                format!("up to date (manifest {})", &fingerprint[..fingerprint.len().min(12)])
            }
            Decision::Run { reasons } => {
                running += 1;
                match reasons.as_slice() {
                    [one] => format!("would run: {one}"),
                    many => format!(
                        "would run:\n{}",
                        many.iter().map(|r| format!("          {r}")).collect::<Vec<_>>().join("\n")
                    ),
                }
            }
        };
        eprintln!("[{}/{total}] {:<8} {what}", i + 1, s.stage.name());
        if let Some(candidates) = &s.candidates {
            eprintln!("          {}", kiln::pipeline::stages::candidates_line(candidates));
        }
    }
    eprintln!(
        "sft --dry-run: {running} of {total} stages would run in {} on {}; nothing was run or written",
        plan.run_dir.display(),
        plan.device
    );
    println!("{}", serde_json::to_string_pretty(&plan)?);
    Ok(())
}

fn push_cmd(args: PushArgs, quiet: bool) -> Result<()> {
    let started = Instant::now();
    let has_weights = std::fs::read_dir(&args.dir)
        .with_context(|| format!("reading the checkpoint folder {}", args.dir.display()))?
        .flatten()
        .any(|e| e.file_name().to_string_lossy().ends_with(".safetensors"));
    if !args.dir.join("config.json").is_file() || !has_weights {
        bail!(
            "{} is not a checkpoint folder: it needs config.json and safetensors weights (a run's best/, or checkpoints/epoch-<k>/)",
            args.dir.display()
        );
    }
    let folder = args.dir.canonicalize().with_context(|| format!("resolving {}", args.dir.display()))?;
    let name = folder.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let spec = kiln::hub::push::PushSpec {
        repo: args.repo,
        revision: args.revision,
        private: args.private,
        message: args.message.unwrap_or_else(|| format!("Upload {name} with kiln")),
    };
    let pushed = hub(quiet)?.push(&args.dir, &spec)?;
    write_json(args.out.as_deref(), &pushed)?;
    eprintln!("push: {} in {:.1}s", pushed.describe(), started.elapsed().as_secs_f64());
    Ok(())
}

fn card_cmd(args: CardArgs) -> Result<()> {
    let _lock = lock_run(&args.run)?;
    let path = args.run.join("sft.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading {} (the card needs a run made by `kiln sft`)", path.display()))?;
    let saved: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let config: kiln::pipeline::ModelConfig = serde_json::from_value(saved["config"].clone())
        .with_context(|| format!("{}: no model config", path.display()))?;
    let base = kiln::pipeline::stages::base_model_dir(&args.run, &config)
        .with_context(|| format!("no base checkpoint recorded in {}", args.run.display()))?;
    let command = saved["command"].as_str().unwrap_or("kiln sft").to_string();
    let card = kiln::report::card::write_card(&args.run, &config, &base, &command)?;
    eprintln!(
        "card: {} and the selected checkpoint's {} ({} checkpoints in the eval table)",
        card.path.display(),
        card.checkpoint_card.display(),
        card.figures
    );
    Ok(())
}

fn inspect_cmd(args: InspectArgs, quiet: bool) -> Result<()> {
    let _lock = lock_run(&args.run)?;
    let opts = kiln::report::InspectOptions { random_examples: args.examples, seed: args.seed, ..Default::default() };
    let bar = if quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new_spinner() };
    bar.set_style(indicatif::ProgressStyle::with_template("{spinner} inspect {msg}: {pos} [{elapsed}]")?);
    let result = kiln::report::inspect_run(&args.run, &opts, &bar)
        .with_context(|| format!("inspecting {}", args.run.display()))?;
    let page = kiln::report::write_report(&args.run, &result)?;
    bar.finish_and_clear();
    for warning in &result.inspection.warnings {
        eprintln!("warning: {warning}");
    }
    eprintln!("inspect: {} → {} ({:.2}s)", result.inspection.summary(), page.display(), result.inspection.wall_seconds);
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
    let recipes = args.dataset.iter().map(|d| Recipe::find(d, datasets_dir)).collect::<Result<Vec<_>, _>>()?;
    let hub = if recipes.iter().any(|r| r.sources.iter().any(|s| s.hub.is_some())) { Some(hub(quiet)?) } else { None };

    let chosen = recipes.iter().map(|r| Ok((r, r.select(&args.sources)?))).collect::<Result<Vec<_>, DataError>>()?;
    let all = kiln::data::ingest::ingest_to_dir(&chosen, hub.as_ref(), eval.as_ref(), args.dedupe, !quiet, &args.out)?;
    for warning in all.iter().flat_map(|s| s.warnings()) {
        eprintln!("warning: {warning}");
    }
    let (conv_path, stats_path) = (args.out.join("conversations.jsonl"), args.out.join("ingest.json"));
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

/// A kernel's switch for `kiln info`: as set, or each runtime's default where unset.
fn kernel_setting(setting: Result<Option<bool>, String>) -> String {
    use kiln::backend::{CUDA_KERNELS, KernelsByDefault, VULKAN_KERNELS};
    let label = |default| match default {
        KernelsByDefault::On => "on",
        KernelsByDefault::Off => "off",
    };
    match setting {
        Err(why) => why,
        Ok(Some(on)) => if on { "on" } else { "off" }.into(),
        Ok(None) => format!("unset: {} on cuda, {} on vulkan", label(CUDA_KERNELS), label(VULKAN_KERNELS)),
    }
}

fn info(host_allocator: Option<&str>) -> Result<()> {
    let config = HubConfig::from_env();
    kiln::backend::smoke_test::<kiln::backend::Cpu>(&Default::default()).map_err(anyhow::Error::msg)?;
    // The CPU trainer's device memory (what it checks the training state against), to a tenth of a GiB.
    let host_memory_gib =
        kiln::host::host_memory_bytes().map(|b| (b as f64 / (1u64 << 30) as f64 * 10.0).round() / 10.0);
    let mut report = serde_json::json!({
        "kiln": env!("CARGO_PKG_VERSION"),
        "backends": kiln::backend::compiled(),
        "cpu_smoke_test": "ok",
        "cpu_matmul_simd": kiln::backend::cpu_matmul_simd(),
        "host_allocator": host_allocator.unwrap_or("the platform's defaults"),
        "host_memory_gib": host_memory_gib,
        "cuda_smoke_test": if cfg!(feature = "cuda") {
            kiln::backend::cuda_ready(true).map_or_else(|why| why, |()| "ok".into())
        } else {
            "not built".to_string()
        },
        "vulkan_smoke_test": if cfg!(feature = "vulkan") {
            kiln::backend::vulkan_ready(false).map_or_else(|why| why, |()| "ok".into())
        } else {
            "not built".to_string()
        },
        "cuda_autotune": if cfg!(feature = "autotune") { "on" } else { "off" },
        "kernel_cache": kiln::kernel_cache::install().describe(),
        "cuda_fusion": kiln::backend::cuda_fusion().map_or_else(|why| why, |on| if on { "on" } else { "off" }.into()),
    });
    let switches = report.as_object_mut().expect("a JSON object");
    for kernel in kiln::backend::Kernel::ALL {
        switches.insert(format!("{}_kernel", kernel.name()), kernel_setting(kernel.setting()).into());
    }
    let experts_batched =
        kiln::backend::experts_batched().map_or_else(|why| why, |on| if on { "on" } else { "off" }.into());
    switches.insert("experts_batched".into(), experts_batched.into());
    let matmul = kiln::backend::MatmulKernels::from_env().map_or_else(|why| why, |kernels| kernels.name().into());
    switches.insert("matmul".into(), matmul.into());
    let chunk_mib =
        kiln::models::attention::chunk_score_budget().map_or_else(|why| why.into(), |bytes| (bytes >> 20).into());
    switches.insert("attention_chunk_mib".into(), chunk_mib);
    let hub = serde_json::json!({
        "endpoint": config.endpoint,
        "cache_dir": config.cache_dir,
        "offline": config.offline,
        "token": config.token_source.unwrap_or_else(|| "none".into()),
    });
    switches.insert("hub".into(), hub);
    write_json(None, &report)
}

/// A model directory, or a name with a directory under configs/models/.
fn model_dir(model: &str) -> Result<PathBuf> {
    let direct = PathBuf::from(model);
    if direct.is_dir() {
        return Ok(direct);
    }
    let named = Path::new("configs/models").join(model);
    if named.is_dir() {
        return Ok(named);
    }
    bail!("model '{model}' is neither a directory nor a folder in configs/models/")
}

struct Loaded {
    template: ChatTemplate,
    tokenizer: TextTokenizer,
    policy: SamplePolicy,
    date: String,
}

fn load_template(args: &TemplateArgs) -> Result<Loaded> {
    let dir = model_dir(&args.model)?;
    let date = args.date.clone().unwrap_or_else(|| chrono::Local::now().format("%Y-%m-%d").to_string());
    let (template, tokenizer) = kiln::tokens::prepare::load_template_and_tokenizer(
        &dir,
        args.template.as_deref(),
        &date,
        args.end_of_turn.as_deref(),
    )?;
    let policy = SamplePolicy {
        mode: args.mode,
        thinking: args.thinking,
        kwargs: args.vars.iter().cloned().collect(),
        tool_results: args.tool_results,
        prompt_rule: args.prompt_rule,
    };
    Ok(Loaded { template, tokenizer, policy, date })
}

fn render(args: RenderArgs, quiet: bool) -> Result<()> {
    let loaded = load_template(&args.template)?;
    let text = std::fs::read_to_string(&args.input).with_context(|| format!("reading {}", args.input.display()))?;
    let mut out = BufWriter::new(File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?);
    let mut first: Option<TokenSample> = None;
    let mut count = 0usize;
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let mut input: ChatInput = serde_json::from_str(line)
            .with_context(|| format!("{}: line {}: not a conversation", args.input.display(), i + 1))?;
        if input.id.is_empty() {
            input.id = format!("line-{}", i + 1);
        }
        let samples: Vec<(String, TokenSample)> = if args.generation_prompt {
            let rendered = loaded
                .template
                .render(&input.messages, input.tools.as_ref(), true, &loaded.policy.kwargs)
                .with_context(|| format!("conversation '{}'", input.id))?;
            let (ids, _) = loaded.tokenizer.encode(&rendered.text)?;
            let mask = vec![0; ids.len()];
            vec![(rendered.text, TokenSample { id: input.id.clone(), input_ids: ids, loss_mask: mask })]
        } else {
            build_samples(&loaded.template, &input, &loaded.policy)?
                .iter()
                .map(|s| Ok((s.text.clone(), tokenize_sample(&loaded.tokenizer, s)?)))
                .collect::<Result<_>>()?
        };
        for (text, sample) in samples {
            let row = serde_json::json!({"id": sample.id, "text": text, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask});
            serde_json::to_writer(&mut out, &row)?;
            out.write_all(b"\n")?;
            count += 1;
            if first.is_none() {
                first = Some(sample);
            }
        }
    }
    out.flush()?;
    if let (Some(sample), false) = (&first, args.no_view || quiet) {
        eprintln!("{}\n", ansi_view(&loaded.tokenizer, sample));
        eprintln!(
            "(green: supervised, {} of {} tokens; template {} sha256 {:.12})",
            sample.supervised(),
            sample.input_ids.len(),
            loaded.template.source.origin,
            loaded.template.source.sha256
        );
    }
    eprintln!("render: {count} samples → {} (template date {})", args.out.display(), loaded.date);
    Ok(())
}

fn prepare_cmd(args: PrepareArgs, quiet: bool) -> Result<()> {
    let started = Instant::now();
    let loaded = load_template(&args.template)?;
    let config = PrepareConfig {
        seq_len: args.seq_len,
        layout: args.layout,
        truncation: args.truncation,
        policy: loaded.policy.clone(),
        chunk: 256,
        template_date: loaded.date.clone(),
        validation_share: args.validation_share,
    };
    let bar = if quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new_spinner() };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} prepare {pos} conversations ({per_sec}) {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    let stats = prepare(&args.data, &loaded.template, &loaded.tokenizer, &config, &args.out, &bar)?;
    bar.finish_and_clear();
    if stats.samples == 0 {
        bail!("prepare of {}: {}", args.data.display(), stats.nothing_kept());
    }
    for e in &stats.error_examples {
        eprintln!("  skipped: {e}");
    }
    eprintln!(
        "prepare: {} ({:.1}s; stats in {})",
        stats.summary(),
        started.elapsed().as_secs_f64(),
        args.out.join("stats.json").display()
    );
    Ok(())
}

fn tokenizer_cmd(args: TokenizerArgs) -> Result<()> {
    let mut texts = Vec::new();
    for path in &args.data {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let input: ChatInput =
                serde_json::from_str(line).with_context(|| format!("{}: line {}", path.display(), i + 1))?;
            for m in &input.messages {
                if let Some(c) = m.get("content").and_then(|c| c.as_str()) {
                    texts.push(c.to_string());
                }
            }
        }
    }
    if texts.is_empty() {
        let files: Vec<String> = args.data.iter().map(|p| p.display().to_string()).collect();
        bail!("no message content to train a tokenizer on in {}", files.join(", "));
    }
    let tokenizer = kiln::tokens::bpe::train_bpe(texts.into_iter(), args.vocab_size)?;
    kiln::tokens::bpe::write_tokenizer_files(&args.out, &tokenizer, args.max_length)?;
    eprintln!("tokenizer: {} tokens → {}", tokenizer.get_vocab_size(true), args.out.join("tokenizer.json").display());
    Ok(())
}

enum Job {
    Logits(LogitsArgs),
    Generate(GenerateArgs),
    Chat(ChatArgs),
    Convert(ConvertArgs),
}

/// Runs a model job on the requested backend.
fn on_device(device: &str, job: Job) -> Result<()> {
    match device {
        "cpu" => run_job::<kiln::backend::Cpu>(&Default::default(), job),
        #[cfg(feature = "cuda")]
        "cuda" if kiln::backend::cuda_choice(true).map_err(anyhow::Error::msg)? => {
            run_job::<kiln::backend::Gpu>(&Default::default(), job)
        }
        #[cfg(feature = "cuda")]
        "cuda" => run_job::<kiln::backend::GpuUnfused>(&Default::default(), job),
        #[cfg(feature = "vulkan")]
        "vulkan" => {
            kiln::backend::vulkan_ready(false).map_err(anyhow::Error::msg)?;
            run_job::<kiln::backend::Vk>(&Default::default(), job)
        }
        other => bail!(kiln::train::device_error(other)),
    }
}

fn model_tokenizer(dir: &Path) -> Result<(TextTokenizer, kiln::chat::SpecialTokens)> {
    let special = kiln::chat::SpecialTokens::load(dir)?;
    Ok((TextTokenizer::load(dir, &special, None)?, special))
}

fn run_job<B: kiln::models::ModelBackend>(device: &B::Device, job: Job) -> Result<()> {
    use burn::tensor::{Int, Tensor, TensorData};
    use kiln::models::{SequenceLayout, load_model};
    match job {
        Job::Logits(args) => {
            let dir = &args.model.model_dir;
            let ids: Vec<u32> = match &args.text {
                Some(text) => model_tokenizer(dir)?.0.encode(text)?.0,
                None => args.ids.clone(),
            };
            if ids.is_empty() {
                bail!("nothing to run: give --ids or --text");
            }
            let (config, model) = load_model::<B>(dir, device)?;
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= config.vocab_size()) {
                bail!("token id {bad} is outside the vocabulary ({} ids)", config.vocab_size());
            }
            let n = ids.len();
            let input = Tensor::<B, 2, Int>::from_data(
                TensorData::new(ids.iter().map(|&i| i as i64).collect::<Vec<_>>(), [1, n]),
                device,
            );
            let logits = model.forward(input, &SequenceLayout::single(1, n));
            let vocab = logits.dims()[2];
            let data: Vec<f32> = logits.into_data().convert::<f32>().to_vec().map_err(|e| anyhow::anyhow!("{e:?}"))?;
            let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n, vocab], &bytes)?;
            safetensors::serialize_to_file(vec![("logits".to_string(), view)], None, &args.out)
                .with_context(|| format!("writing {}", args.out.display()))?;
            eprintln!("logits: [{n}, {vocab}] → {}", args.out.display());
        }
        Job::Generate(args) => {
            let dir = &args.model.model_dir;
            let (tokenizer, _) = model_tokenizer(dir)?;
            let text = if args.chat {
                let template = ChatTemplate::load(dir, None, PinnedClock::now())?;
                let messages = vec![serde_json::json!({"role": "user", "content": args.prompt})];
                template.render(&messages, None, true, &serde_json::Map::new())?.text
            } else {
                args.prompt.clone()
            };
            let prompt = tokenizer.encode(&text)?.0;
            if prompt.is_empty() {
                bail!(
                    "the prompt is empty: there is nothing to continue (give --prompt text, or --chat for the template)"
                );
            }
            if args.max_tokens == 0 {
                bail!("--max-tokens is 0: there is nothing to generate");
            }
            let (mut picker, seed) = args.sampling.picker(dir)?;
            let (config, model) = load_model::<B>(dir, device)?;
            check_context(prompt.len(), args.max_tokens, config.max_position_embeddings(), dir)?;
            let stop = stop_ids(&tokenizer, &config);
            // Ctrl-C stops the stream; what was generated is shown and summed up, and the exit status is 130.
            let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let flag = interrupted.clone();
            ctrlc::set_handler(move || flag.store(true, std::sync::atomic::Ordering::SeqCst))
                .context("installing the Ctrl-C handler")?;
            let started = Instant::now();
            let mut fresh = kiln::models::decode::KeptStates::default();
            let reply = stream_reply(
                &model,
                &mut fresh,
                &tokenizer,
                &prompt,
                &[],
                args.max_tokens,
                &stop,
                &mut picker,
                &interrupted,
                device,
            )?;
            println!();
            let stopped = interrupted.load(std::sync::atomic::Ordering::SeqCst);
            eprintln!(
                "generate: {} tokens in {:.2}s{}, {}",
                reply.ids.len(),
                started.elapsed().as_secs_f64(),
                if stopped { " (stopped by Ctrl-C)" } else { "" },
                decoding_summary(&picker, seed)
            );
            if stopped {
                std::process::exit(130);
            }
        }
        Job::Chat(args) => chat::<B>(args, device)?,
        Job::Convert(args) => {
            let dir = &args.model.model_dir;
            let dtype = match args.dtype {
                Some(d) => d,
                // The source's dtype, read off its embedding.
                None => {
                    let store = kiln::models::WeightStore::open(dir)?;
                    let embedding = store.keys().find(|k| k.ends_with("embed_tokens.weight")).cloned();
                    match embedding.and_then(|k| store.dtype(&k)) {
                        Some(safetensors::Dtype::F32) => kiln::models::hf::ExportDtype::F32,
                        _ => kiln::models::hf::ExportDtype::Bf16,
                    }
                }
            };
            let (_, model) = load_model::<B>(dir, device)?;
            // fp32 tensors (expert_bias, A_log) stay fp32 in bf16 exports, as in the released checkpoints;
            // towers kiln does not hold (vision) are copied as they are.
            let files = model.export(dir, &args.out, dtype, kiln::models::hf::SHARD_BYTES)?;
            eprintln!("convert: {} → {} ({} files)", dir.display(), args.out.display(), files.len());
        }
    }
    Ok(())
}

/// Refuses a prompt that would run past the model's context with `max_tokens` more.
fn check_context(prompt: usize, max_tokens: usize, context: usize, dir: &Path) -> Result<()> {
    if prompt + max_tokens > context {
        bail!(
            "the prompt has {prompt} tokens; with --max-tokens {max_tokens} it exceeds the context length {context} \
             of {} (at most {} new tokens)",
            dir.display(),
            context.saturating_sub(prompt)
        );
    }
    Ok(())
}

/// The ids that end a reply: the template's end-of-turn token and the model's EOS.
fn stop_ids(tokenizer: &TextTokenizer, config: &kiln::models::ModelConfig) -> Vec<u32> {
    let mut stop = vec![tokenizer.end_of_turn_id];
    stop.extend(config.eos_token_id());
    stop
}

/// `greedy` or the sampling settings with the seed that repeats the draws.
fn decoding_summary(picker: &kiln::models::sampling::TokenPicker, seed: u64) -> String {
    let settings = &picker.settings;
    if settings.do_sample { format!("{}, --seed {seed}", settings.describe()) } else { settings.describe() }
}

/// Generates a reply to `prompt`, its text printed to stdout as it comes (the stop token not shown), until a
/// stop token, `max_tokens`, or `interrupt` is raised; returns its ids (the stop token included when
/// reached) and how much of the prompt continued the conversation's `kept` states (states kept at `marks`
/// too: see `decode::generate_continuing`).
#[allow(clippy::too_many_arguments)]
fn stream_reply<B: kiln::models::ModelBackend>(
    model: &kiln::models::CausalLm<B>,
    kept: &mut kiln::models::decode::KeptStates<kiln::models::CausalLmCache<B>>,
    tokenizer: &TextTokenizer,
    prompt: &[u32],
    marks: &[usize],
    max_tokens: usize,
    stop: &[u32],
    picker: &mut kiln::models::sampling::TokenPicker,
    interrupt: &std::sync::atomic::AtomicBool,
    device: &B::Device,
) -> Result<kiln::models::decode::Continued> {
    let mut stream = tokenizer.stream();
    let mut stdout = std::io::stdout().lock();
    let mut failed = None;
    let mut show = |piece: String, stdout: &mut std::io::StdoutLock| {
        if failed.is_none() {
            failed = stdout.write_all(piece.as_bytes()).and_then(|_| stdout.flush()).err();
        }
    };
    let on_token = |id| {
        if !stop.contains(&id) {
            show(stream.push(id), &mut stdout);
        }
        !interrupt.load(std::sync::atomic::Ordering::SeqCst)
    };
    let reply = kiln::models::decode::generate_continuing(
        model, kept, prompt, marks, max_tokens, stop, picker, on_token, device,
    );
    show(stream.finish(), &mut stdout);
    if let Some(e) = failed {
        return Err(e).context("writing the reply to stdout");
    }
    Ok(reply)
}

/// `kiln chat`: a conversation on stdin and stdout, the replies streamed, the transcript kept if asked.
fn chat<B: kiln::models::ModelBackend>(args: ChatArgs, device: &B::Device) -> Result<()> {
    use kiln::chat::session::{ChatLine, ChatSession, read_line};
    use std::io::{BufRead, IsTerminal};
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = &args.model.model_dir;
    if args.max_tokens == 0 {
        bail!("--max-tokens is 0: a reply could hold nothing");
    }
    let (tokenizer, _) = model_tokenizer(dir)?;
    let template = ChatTemplate::load(dir, None, PinnedClock::now())?;
    let tools = args.tools.as_deref().map(read_tools).transpose()?;
    let mut session = ChatSession::new(template, args.system.clone(), tools, args.enable_thinking);
    let (mut picker, seed) = args.sampling.picker(dir)?;
    let transcript = args.transcript.as_deref().map(Transcript::open).transpose()?;
    let (config, model) = kiln::models::load_model::<B>(dir, device)?;
    let context = config.max_position_embeddings();
    let stop = stop_ids(&tokenizer, &config);
    // Ctrl-C during a reply ends the reply (what was shown is kept); at the prompt it ends the chat, whose
    // transcript is already written.
    let replying = std::sync::Arc::new(AtomicBool::new(false));
    let interrupted = std::sync::Arc::new(AtomicBool::new(false));
    let (in_reply, stop_reply) = (replying.clone(), interrupted.clone());
    ctrlc::set_handler(move || {
        if in_reply.load(Ordering::SeqCst) {
            stop_reply.store(true, Ordering::SeqCst);
        } else {
            eprintln!();
            std::process::exit(130);
        }
    })
    .context("installing the Ctrl-C handler")?;
    eprintln!(
        "kiln chat: {} ({}); a line is a message, a line ending in \\ goes on; /tool RESULT answers a call; /reset \
         starts over, Ctrl-C stops a reply, /exit or end of input ends",
        dir.display(),
        decoding_summary(&picker, seed)
    );
    let interactive = std::io::stdin().is_terminal();
    let id = format!("chat-{}", chrono::Utc::now().format("%Y%m%dT%H%M%SZ"));
    let mut finished: Vec<ChatInput> = Vec::new();
    let mut kept = kiln::models::decode::KeptStates::default();
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = read_line(&mut lines).context("reading stdin")? else { break };
        let (sender, message) = match line {
            ChatLine::Exit => break,
            ChatLine::Reset => {
                if session.turns() > 0 {
                    finished.push(session.transcript(&format!("{id}-{}", finished.len() + 1)));
                }
                session.reset();
                kept.clear();
                eprintln!("(a new conversation)");
                continue;
            }
            ChatLine::Message(sender, text) => (sender, text),
        };
        // A template that refuses the message, or a conversation past the context, leaves it as it was.
        let text = match session.prompt(sender, &message) {
            Ok(text) => text,
            Err(e) => {
                eprintln!("error: {}", kiln::errors::chain(&e));
                continue;
            }
        };
        let prompt = tokenizer.encode(&text)?.0;
        if prompt.len() + args.max_tokens > context {
            eprintln!(
                "error: this turn would pass the context length {context} of {} ({} tokens of conversation, up to {} \
                 for the reply): /reset to start over, or a smaller --max-tokens",
                dir.display(),
                prompt.len(),
                args.max_tokens
            );
            continue;
        }
        // Where the conversation ends before the generation prompt: the next turn repeats it even where it
        // renders this reply differently (thinking dropped), so its state is kept too.
        let settled = session.settled(sender, &message).ok().and_then(|text| tokenizer.encode(&text).ok());
        let marks: Vec<usize> = settled
            .map(|(ids, _)| ids)
            .filter(|ids| prompt.starts_with(ids))
            .map(|ids| ids.len())
            .into_iter()
            .collect();
        if args.no_kept_states {
            kept.clear();
        }
        let started = Instant::now();
        interrupted.store(false, Ordering::SeqCst);
        replying.store(true, Ordering::SeqCst);
        let reply = stream_reply(
            &model,
            &mut kept,
            &tokenizer,
            &prompt,
            &marks,
            args.max_tokens,
            &stop,
            &mut picker,
            &interrupted,
            device,
        );
        replying.store(false, Ordering::SeqCst);
        let reply = reply?;
        let ids = &reply.ids;
        println!();
        let stopped = ids.last().is_some_and(|t| stop.contains(t));
        session.record(sender, &message, &tokenizer.decode(&ids[..ids.len() - usize::from(stopped)]));
        let seconds = started.elapsed().as_secs_f64();
        let cut = match (stopped, interrupted.load(Ordering::SeqCst)) {
            (true, _) => "",
            (false, true) => ", stopped by Ctrl-C",
            (false, false) => ", cut at --max-tokens",
        };
        eprintln!(
            "[{} tokens in {seconds:.2}s{cut}; {} of the prompt's {} tokens continued from earlier turns]",
            ids.len(),
            reply.reused,
            prompt.len()
        );
        if let Some(transcript) = &transcript {
            let current = session.transcript(&format!("{id}-{}", finished.len() + 1));
            transcript.write(finished.iter().chain([&current]))?;
        }
    }
    Ok(())
}

/// `kiln chat --tools FILE`: the function schemas, as the data readers normalize a row's tools.
fn read_tools(path: &Path) -> Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the tools file {}", path.display()))?;
    let list: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not JSON (a list of function schemas is expected)", path.display()))?;
    kiln::data::schema::function_tools(&list).map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))
}

/// A conversation JSONL file `kiln chat` keeps current: what the file held before, then this session's
/// conversations, rewritten beside it and renamed after every reply.
struct Transcript {
    path: PathBuf,
    earlier: String,
}

impl Transcript {
    fn open(path: &Path) -> Result<Self> {
        let mut earlier = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e).with_context(|| format!("reading the transcript {}", path.display())),
        };
        if !earlier.is_empty() && !earlier.ends_with('\n') {
            earlier.push('\n');
        }
        Ok(Transcript { path: path.to_path_buf(), earlier })
    }

    fn write<'a>(&self, conversations: impl Iterator<Item = &'a ChatInput>) -> Result<()> {
        let mut text = self.earlier.clone();
        for conversation in conversations {
            text.push_str(&serde_json::to_string(conversation)?);
            text.push('\n');
        }
        let mut partial = self.path.as_os_str().to_owned();
        partial.push(".partial");
        let written = std::fs::write(&partial, text).and_then(|_| std::fs::rename(&partial, &self.path));
        written.with_context(|| format!("writing the transcript {}", self.path.display()))
    }
}

fn init_model(args: InitModelArgs) -> Result<()> {
    let (model_type, params) = kiln::models::init_random_checkpoint(&args.from, &args.out, args.seed, args.dtype)?;
    eprintln!("init-model: {model_type} ({params} parameters, seed {}) → {}", args.seed, args.out.display());
    Ok(())
}

fn train_config(args: &TrainArgs) -> Result<kiln::train::TrainConfig> {
    let mut cfg = match &args.config {
        Some(path) => {
            #[derive(serde::Deserialize)]
            struct File {
                #[serde(default)]
                train: kiln::train::TrainConfig,
            }
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            toml::from_str::<File>(&text).with_context(|| format!("{}: [train]", path.display()))?.train
        }
        None => kiln::train::TrainConfig::default(),
    };
    macro_rules! set {
        ($($field:ident),*) => { $(if let Some(v) = args.$field { cfg.$field = v; })* };
    }
    set!(
        epochs,
        lr,
        warmup_ratio,
        decay,
        decay_ratio,
        global_batch,
        micro_batch,
        pad_multiple,
        seed,
        export_dtype,
        devices
    );
    if let Some(wd) = args.weight_decay {
        cfg.adamw.weight_decay = wd;
    }
    if let Some(n) = args.max_grad_norm {
        cfg.max_grad_norm = (n != 0.0).then_some(n);
    }
    if args.save_every.is_some() {
        cfg.save_every = args.save_every;
    }
    if args.validation_every.is_some() {
        cfg.validation_every = args.validation_every;
    }
    if args.global_batch_tokens.is_some() {
        cfg.global_batch_tokens = args.global_batch_tokens;
    }
    if args.peak_tflops.is_some() {
        cfg.peak_tflops = args.peak_tflops;
    }
    if let Some(p) = args.precision {
        cfg.precision = p;
    }
    if let Some(m) = args.moments {
        cfg.adamw.moments = m;
    }
    if let Some(m) = args.masters {
        cfg.adamw.masters = m;
    }
    cfg.activation_checkpointing |= args.activation_checkpointing;
    cfg.save_state &= !args.no_state;
    Ok(cfg)
}

fn bench_train_cmd(args: BenchTrainArgs) -> Result<()> {
    let path = if args.config.is_dir() { args.config.join("config.json") } else { args.config.clone() };
    let config = kiln::models::ModelConfig::from_file(&path)?;
    let cfg = kiln::train::bench::BenchConfig {
        seq: args.seq,
        micro_batch: args.micro_batch,
        accumulation: args.accumulation,
        steps: args.steps,
        warmup: args.warmup,
        docs_per_row: args.docs_per_row,
        seed: args.seed,
        lr: args.lr,
        peak_tflops: args.peak_tflops,
        activation_checkpointing: args.activation_checkpointing,
        precision: args.precision,
        moments: args.moments,
        masters: args.masters,
        reference_ops: args.reference_ops,
    };
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        kiln::train::bench::bench_on_device(&config, &cfg, &args.device)
    }));
    // A shape the device's memory cannot hold still leaves its row: the answer a fit benchmark asks for.
    let out_of_memory = match &outcome {
        Ok(Err(kiln::train::TrainError::OutOfMemory(why))) => Some(why.clone()),
        Ok(Ok(_)) => None,
        // A failed allocation panics on the device thread, and reaches here as that panic or as an error.
        _ => kiln::device_panics::out_of_memory(),
    };
    if let (Some(why), Some(out)) = (out_of_memory, &args.out) {
        let run = kiln::train::bench::BenchRun::of(&config, &cfg, &args.device);
        let row = kiln::train::bench::BenchOutOfMemory { run, out_of_memory: why };
        kiln::files::write_json(out, &row).with_context(|| format!("writing {}", out.display()))?;
    }
    let result = match outcome {
        Ok(result) => result.with_context(|| format!("benchmarking {} on {}", path.display(), args.device))?,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    if let Some(out) = &args.out {
        kiln::files::write_json(out, &result).with_context(|| format!("writing {}", out.display()))?;
    }
    println!("{}", serde_json::to_string(&result)?);
    eprintln!(
        "bench-train: {} ({:.1} M params{}, {}) on {}: {:.0} tokens/s, median step {:.3} s{}{}",
        result.run.model_type,
        result.params as f64 / 1e6,
        result
            .flops_params
            .filter(|&n| n != result.params)
            .map(|n| format!(", {:.1} M in MFU", n as f64 / 1e6))
            .unwrap_or_default(),
        result.run.precision,
        result.run.device,
        result.tokens_per_s,
        result.median_step_seconds,
        result.mfu.map(|m| format!(", MFU {:.1} %", m * 100.0)).unwrap_or_default(),
        result
            .peak_memory_bytes
            .map(|b| format!(", peak {:.2} GiB", b as f64 / (1u64 << 30) as f64))
            .unwrap_or_default(),
    );
    Ok(())
}

fn train_cmd(args: TrainArgs, quiet: bool) -> Result<()> {
    let cfg = train_config(&args)?;
    kiln::models::set_reference_ops(args.reference_ops);
    std::fs::create_dir_all(&args.run).with_context(|| format!("creating {}", args.run.display()))?;
    let _lock = lock_run(&args.run)?;
    let stop = stop_on_ctrl_c();
    let summary = stop.defer(|stop| {
        kiln::train::train_on_device(
            &args.device,
            &cfg,
            &args.model_dir,
            &args.data,
            &args.run,
            args.resume,
            stop,
            None,
            !quiet,
        )
    })?;
    eprintln!(
        "train: {} steps, {} epochs{} in {:.1}s; final loss {}{}{}; checkpoints: {}",
        summary.steps,
        summary.epochs_done,
        match (summary.interrupted, cfg.save_state) {
            (true, true) => " (interrupted, resume with --resume)",
            (true, false) => " (interrupted, no state saved: a new run starts from the beginning)",
            (false, _) => "",
        },
        summary.seconds,
        summary.final_loss.map(|l| format!("{l:.4}")).unwrap_or_else(|| "-".into()),
        summary.validation_loss.map(|l| format!(", validation loss {l:.4}")).unwrap_or_default(),
        summary.expert_max_vio.map(|v| format!(", expert MaxVio {v:.3}")).unwrap_or_default(),
        summary.checkpoints.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    );
    Ok(())
}

fn score_cmd(args: ScoreArgs) -> Result<()> {
    use kiln::eval::result::{EvalResult, aggregate, read_predictions, read_replay_for_scoring, score_all};
    let started = Instant::now();
    let steps = read_replay_for_scoring(&args.replay).map_err(anyhow::Error::msg)?;
    if steps.is_empty() {
        bail!("{}: no replay step to score", args.replay.display());
    }
    let predictions = read_predictions(&args.predictions).map_err(anyhow::Error::msg)?;
    let read_ms = started.elapsed().as_secs_f64() * 1e3;
    let scoring = Instant::now();
    let rows = score_all(&steps, &predictions, args.scorer).map_err(anyhow::Error::msg)?;
    let score_ms = scoring.elapsed().as_secs_f64() * 1e3;
    let result = EvalResult {
        model: args.model.clone(),
        model_path: args.predictions.display().to_string(),
        model_short: args.model.clone(),
        eval_path: args.replay.display().to_string(),
        timestamp: chrono::Local::now().format("%Y-%m-%dT%H:%M:%S%.6f").to_string(),
        load_time_sec: 0.0,
        gen_time_sec: 0.0,
        avg_sec_per_step: 0.0,
        scorer: args.scorer,
        sampling: serde_json::Value::Null,
        prompt_template: serde_json::Value::Null,
        aggregate: aggregate(&rows),
        per_step: rows,
    };
    write_json(Some(&args.out), &result)?;
    let a = &result.aggregate;
    eprintln!(
        "score: {} steps / {} tasks — Score {:.2} (P {:.4} R {:.4} F1 {:.4}, first exact {:.1}%, valid JSON {:.1}%); scored in {:.1} ms, inputs read in {:.1} ms → {}",
        a.steps,
        a.tasks,
        a.score,
        a.avg_command_precision,
        a.avg_command_recall,
        a.avg_command_f1,
        a.first_cmd_exact_pct,
        a.valid_json_pct,
        score_ms,
        read_ms,
        args.out.display()
    );
    Ok(())
}

/// The replay steps the eval options select.
fn eval_steps(eval: &EvalOptionArgs) -> Result<Vec<kiln::eval::result::ReplayStep>> {
    let steps = kiln::eval::result::read_replay(&eval.replay).map_err(anyhow::Error::msg)?;
    kiln::eval::run::select_steps(steps, &eval.options())
        .map_err(|e| anyhow::anyhow!("eval of {}: {e}", eval.replay.display()))
}

fn run_eval(
    name: &str,
    checkpoint: &Path,
    eval: &EvalOptionArgs,
    quiet: bool,
    journal: Option<&mut kiln::eval::journal::Journal>,
) -> Result<kiln::eval::result::EvalResult> {
    let steps = eval_steps(eval)?;
    let result = kiln::eval::run::evaluate_on_device(
        &eval.device,
        eval.devices,
        name,
        checkpoint,
        &eval.replay,
        &steps,
        &eval.options(),
        !quiet,
        journal,
    );
    result.map_err(anyhow::Error::msg).with_context(|| format!("evaluating {}", checkpoint.display()))
}

fn replay_hash(eval: &EvalOptionArgs) -> Result<String> {
    kiln::hub::sha256_file(&eval.replay).with_context(|| format!("reading the replay file {}", eval.replay.display()))
}

/// Evaluates `checkpoint`, each finished batch recorded in `journal_path` under the identity of what the result
/// depends on (`stages::eval_identity`, as the pipeline's eval stage records it): a stopped eval goes on from
/// there. The caller removes the journal once it has written the result. Returns the result and its identity.
fn eval_journaled(
    name: &str,
    checkpoint: &Path,
    eval: &EvalOptionArgs,
    quiet: bool,
    replay_hash: &str,
    journal_path: &Path,
) -> Result<(kiln::eval::result::EvalResult, String)> {
    let identity = kiln::pipeline::stages::eval_identity(checkpoint, &eval.options(), replay_hash, &eval.device)
        .with_context(|| format!("evaluating {}", checkpoint.display()))?;
    let mut journal = kiln::eval::journal::Journal::open(journal_path, &identity)
        .with_context(|| format!("opening the eval's journal {}", journal_path.display()))?;
    if journal.finished_batches() > 0 {
        eprintln!(
            "eval {name}: going on after the {} batch(es) finished before it was stopped ({})",
            journal.finished_batches(),
            journal_path.display()
        );
    }
    match run_eval(name, checkpoint, eval, quiet, Some(&mut journal)) {
        Ok(result) => Ok((result, identity)),
        Err(e) => {
            // A journal without a finished batch (the model did not load, say) is not left behind.
            if kiln::eval::journal::Journal::peek(journal_path, &identity).is_ok_and(|n| n == 0) {
                let _ = kiln::files::remove_if_present(journal_path);
            }
            Err(e)
        }
    }
}

fn eval_cmd(args: EvalArgs, quiet: bool) -> Result<()> {
    let name = args.name.clone().unwrap_or_else(|| {
        args.checkpoint.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
    });
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("eval").join(format!("{name}.json")));
    let replay_hash = replay_hash(&args.eval)?;
    // Beside the result, named after it.
    let journal = out.with_extension("partial.jsonl");
    if let Some(dir) = journal.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let (result, _) = eval_journaled(&name, &args.checkpoint, &args.eval, quiet, &replay_hash, &journal)?;
    write_json(Some(&out), &result)?;
    kiln::files::remove_if_present(&journal).with_context(|| format!("removing {}", journal.display()))?;
    let a = &result.aggregate;
    eprintln!(
        "eval {name}: Score {:.2} (P {:.4} R {:.4}, first exact {:.1}%, valid JSON {:.1}%) over {} steps, {:.3} s/step → {}",
        a.score,
        a.avg_command_precision,
        a.avg_command_recall,
        a.first_cmd_exact_pct,
        a.valid_json_pct,
        a.steps,
        result.avg_sec_per_step,
        out.display()
    );
    Ok(())
}

fn select_cmd(args: SelectArgs, quiet: bool) -> Result<()> {
    let _lock = lock_run(&args.run)?;
    let expected =
        kiln::eval::select::Measure::planned(&args.eval.replay, &eval_steps(&args.eval)?, &args.eval.options());
    let replay_hash = replay_hash(&args.eval)?;
    let eval_dir = args.run.join("eval");
    let selection = kiln::eval::select::select_run(
        &args.run,
        args.base.as_deref(),
        Some(&expected),
        &mut |c, why| {
            let why = why.map(|w| format!(": {w}")).unwrap_or_default();
            eprintln!("evaluating {} ({}){why}", c.name, c.path.display());
            std::fs::create_dir_all(&eval_dir).map_err(|e| format!("creating {}: {e}", eval_dir.display()))?;
            let journal = kiln::eval::journal::path_in(&eval_dir, &c.name);
            eval_journaled(&c.name, &c.path, &args.eval, quiet, &replay_hash, &journal).map_err(|e| format!("{e:#}"))
        },
        &mut |name, result| eprintln!("  {name}: Score {:.2}", result.aggregate.score),
    )
    .map_err(anyhow::Error::msg)?;
    eprintln!("select: {} → {}", selection.reason, args.run.join("best").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::error_lines;

    #[test]
    fn a_cause_already_in_the_message_is_not_printed_again() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let err = anyhow::Error::new(io).context("pipelines/sft.toml: No such file or directory (os error 2)");
        assert_eq!(error_lines(&err), ["error: pipelines/sft.toml: No such file or directory (os error 2)"]);
        let err = anyhow::anyhow!("invalid header length")
            .context("reading model.safetensors")
            .context("loading the base model");
        assert_eq!(
            error_lines(&err),
            [
                "error: loading the base model",
                "  caused by: reading model.safetensors",
                "  caused by: invalid header length"
            ]
        );
    }
}
