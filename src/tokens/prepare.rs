//! `prepare`: normalized conversations → rendered samples → tokens and masks → shards, streamed in chunks
//! (memory bounded by the chunk, whatever the corpus), rendered and tokenized on all cores, with stats.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::TokenError;
use super::mask::{Truncation, tokenize_sample_cached, truncate};
use super::shards::{Layout, ShardWriter};
use super::tokenizer::SegmentCache;
use super::tokenizer::{TextTokenizer, TokenizerInfo};
use crate::chat::{ChatInput, ChatTemplate, SamplePolicy, TemplateSource, build_samples};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrepareConfig {
    pub seq_len: usize,
    pub layout: Layout,
    pub truncation: Truncation,
    pub policy: SamplePolicy,
    /// Conversations rendered per parallel chunk.
    pub chunk: usize,
    /// The date `strftime_now` returns in templates, pinned so renders are reproducible.
    pub template_date: String,
}

/// `data/stats.json`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PrepareStats {
    /// The conversations file the shards were made from (ingest's `conversations.jsonl`).
    pub input: PathBuf,
    pub conversations: u64,
    pub samples: u64,
    pub tokens: u64,
    pub supervised_tokens: u64,
    pub padding_tokens: u64,
    pub rows: u64,
    pub truncated: u64,
    /// Conversations or samples left out, by reason (template_error, mask_error, too_long).
    pub dropped: BTreeMap<String, u64>,
    /// The first few errors, so a person can see what went wrong without rerunning.
    pub error_examples: Vec<String>,
    pub thinking_blocks_stripped: u64,
    /// Turns trained in a form unlike their inference-time rendering (only in forced conversation mode).
    pub turns_unlike_inference: u64,
    pub per_source: BTreeMap<String, SourceCounts>,
    pub template: Option<TemplateSource>,
    pub tokenizer: Option<TokenizerInfo>,
    pub config: Option<PrepareConfig>,
    pub shards: Vec<PathBuf>,
    pub wall_seconds: f64,
    /// Peak resident memory of the process, where the OS reports it.
    pub peak_rss_bytes: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SourceCounts {
    pub samples: u64,
    pub tokens: u64,
    pub supervised_tokens: u64,
}

const MAX_ERROR_EXAMPLES: usize = 10;

impl PrepareStats {
    fn drop(&mut self, reason: &str, message: String) {
        *self.dropped.entry(reason.to_string()).or_default() += 1;
        if self.error_examples.len() < MAX_ERROR_EXAMPLES {
            self.error_examples.push(message);
        }
    }

    /// Why a run kept no sample: the conversations read, the drops by reason and the first errors.
    pub fn nothing_kept(&self) -> String {
        let mut text = format!("no sample from {} conversations", self.conversations);
        if !self.dropped.is_empty() {
            let reasons: Vec<String> = self.dropped.iter().map(|(reason, n)| format!("{n} {reason}")).collect();
            text += &format!(" (dropped: {})", reasons.join(", "));
        }
        if let (Some(cfg), true) = (&self.config, self.dropped.contains_key("too_long")) {
            text += &format!("; a sample longer than seq_len {} is dropped with truncation = drop", cfg.seq_len);
        }
        if !self.error_examples.is_empty() {
            text += &format!("; first errors: {}", self.error_examples.join("; "));
        }
        text
    }

    pub fn summary(&self) -> String {
        let dropped: u64 = self.dropped.values().sum();
        let share = if self.tokens > 0 { 100.0 * self.supervised_tokens as f64 / self.tokens as f64 } else { 0.0 };
        let secs = self.wall_seconds.max(1e-9);
        format!(
            "{} conversations → {} samples, {} tokens ({share:.1}% supervised) in {} rows; {dropped} dropped, {} truncated; {:.0} conversations/s, {:.0} tokens/s",
            self.conversations,
            self.samples,
            self.tokens,
            self.rows,
            self.truncated,
            self.conversations as f64 / secs,
            self.tokens as f64 / secs
        )
    }
}

/// What one conversation turned into, computed in parallel.
enum Outcome {
    Samples {
        source: String,
        samples: Vec<(super::TokenSample, bool)>,
        stripped: usize,
        unlike: usize,
        dropped_long: usize,
    },
    Failed {
        reason: &'static str,
        message: String,
    },
}

fn process(template: &ChatTemplate, tok: &TextTokenizer, cfg: &PrepareConfig, input: &ChatInput) -> Outcome {
    let samples = match build_samples(template, input, &cfg.policy) {
        Ok(s) => s,
        Err(e) => return Outcome::Failed { reason: "template_error", message: e.to_string() },
    };
    let mut out = Vec::with_capacity(samples.len());
    let (mut stripped, mut unlike, mut dropped_long) = (0, 0, 0);
    let mut cache = SegmentCache::new();
    for s in &samples {
        stripped += s.thinking_stripped;
        unlike += s.turns_unlike_inference;
        let tokens = match tokenize_sample_cached(tok, s, &mut cache) {
            Ok(t) => t,
            Err(e) => return Outcome::Failed { reason: "mask_error", message: e.to_string() },
        };
        match truncate(tokens, cfg.seq_len, cfg.truncation) {
            Some(t) => out.push(t),
            None => dropped_long += 1,
        }
    }
    Outcome::Samples { source: input.source.clone().unwrap_or_default(), samples: out, stripped, unlike, dropped_long }
}

/// The model folder's chat template (or `template_file` instead) with `strftime_now` pinned to `date`
/// (YYYY-MM-DD), and its tokenizer; `end_of_turn` overrides the turn-closing token.
pub fn load_template_and_tokenizer(
    model_dir: &Path,
    template_file: Option<&Path>,
    date: &str,
    end_of_turn: Option<&str>,
) -> Result<(ChatTemplate, TextTokenizer), TokenError> {
    let clock = crate::chat::PinnedClock::parse(date)
        .ok_or_else(|| TokenError::Config(format!("template date {date:?} is not YYYY-MM-DD")))?;
    let template = ChatTemplate::load(model_dir, template_file, clock)?;
    let tokenizer = TextTokenizer::load(model_dir, &template.special, end_of_turn)?;
    Ok((template, tokenizer))
}

/// Reads conversations (JSON lines of `{id, messages, tools?, source?}`, which ingest's output is) from
/// `input`, writes shards and `stats.json` into `out_dir`.
pub fn prepare(
    input: &Path,
    template: &ChatTemplate,
    tok: &TextTokenizer,
    cfg: &PrepareConfig,
    out_dir: &Path,
    progress: &ProgressBar,
) -> Result<PrepareStats, TokenError> {
    if cfg.seq_len < 2 {
        return Err(TokenError::Config(format!(
            "seq_len {}: a row needs at least 2 tokens (an input and the target after it)",
            cfg.seq_len
        )));
    }
    let file = File::open(input).map_err(|e| TokenError::Io { path: input.to_path_buf(), source: e })?;
    let mut lines = BufReader::with_capacity(1 << 20, file).lines();
    let mut writer = ShardWriter::new(out_dir, cfg.layout, cfg.seq_len, tok.pad_id)?;
    let mut stats = PrepareStats {
        input: input.to_path_buf(),
        template: Some(template.source.clone()),
        tokenizer: Some(tok.info()),
        config: Some(cfg.clone()),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let mut line_no = 0usize;
    loop {
        let mut chunk = Vec::with_capacity(cfg.chunk);
        for line in lines.by_ref() {
            line_no += 1;
            let line = line.map_err(|e| TokenError::Io { path: input.to_path_buf(), source: e })?;
            if line.trim().is_empty() {
                continue;
            }
            let mut conv: ChatInput = serde_json::from_str(&line).map_err(|e| TokenError::Input {
                path: input.to_path_buf(),
                line: line_no,
                message: e.to_string(),
            })?;
            if conv.id.is_empty() {
                conv.id = format!("line-{line_no}");
            }
            chunk.push(conv);
            if chunk.len() >= cfg.chunk {
                break;
            }
        }
        if chunk.is_empty() {
            break;
        }
        let outcomes: Vec<Outcome> = chunk.par_iter().map(|c| process(template, tok, cfg, c)).collect();
        for outcome in outcomes {
            stats.conversations += 1;
            progress.inc(1);
            match outcome {
                Outcome::Failed { reason, message } => stats.drop(reason, message),
                Outcome::Samples { source, samples, stripped, unlike, dropped_long } => {
                    stats.thinking_blocks_stripped += stripped as u64;
                    stats.turns_unlike_inference += unlike as u64;
                    // Counted only: over-long samples are expected at a short --seq-len, not errors to show.
                    if dropped_long > 0 {
                        *stats.dropped.entry("too_long".into()).or_default() += dropped_long as u64;
                    }
                    let counts = stats.per_source.entry(source.clone()).or_default();
                    for (sample, truncated) in &samples {
                        let supervised = sample.supervised() as u64;
                        counts.samples += 1;
                        counts.tokens += sample.input_ids.len() as u64;
                        counts.supervised_tokens += supervised;
                        stats.samples += 1;
                        stats.tokens += sample.input_ids.len() as u64;
                        stats.supervised_tokens += supervised;
                        stats.truncated += u64::from(*truncated);
                        writer.add(sample, &source)?;
                    }
                }
            }
        }
    }
    let shard_stats = writer.finish()?;
    stats.rows = shard_stats.rows;
    stats.padding_tokens = shard_stats.padding_tokens;
    stats.shards = shard_stats.files;
    stats.wall_seconds = started.elapsed().as_secs_f64();
    stats.peak_rss_bytes = crate::host::peak_rss_bytes();
    let stats_path = out_dir.join("stats.json");
    let text = serde_json::to_string_pretty(&stats)
        .map_err(|e| TokenError::Shard { path: stats_path.clone(), message: e.to_string() })?;
    std::fs::write(&stats_path, text + "\n").map_err(|e| TokenError::Io { path: stats_path, source: e })?;
    Ok(stats)
}
