//! `prepare`: normalized conversations → rendered samples → tokens and masks → shards, streamed in chunks
//! (memory bounded by the chunk, whatever the corpus), rendered and tokenized on all cores, with stats; a
//! share of the conversations held out as the validation split (`validation/`), by task.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

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
    /// The share of conversations held out for the validation loss (`held_out`), in [0, 1).
    #[serde(default)]
    pub validation_share: f64,
}

/// The folder under the shards' folder that holds the validation split's shards.
pub const VALIDATION_DIR: &str = "validation";

/// Whether the conversation of `split_key` (`ChatInput::split_key`) is held out at `share`: by the first 8
/// bytes of its key's sha256 as a fraction of 2⁶⁴, so a conversation keeps its side whatever the order, the
/// chunking or the rest of the data, and a larger share only moves conversations into validation.
pub fn held_out(split_key: &str, share: f64) -> bool {
    if share <= 0.0 {
        return false;
    }
    let digest = Sha256::digest(split_key.as_bytes());
    let mut head = [0u8; 8];
    head.copy_from_slice(&digest[..8]);
    (u64::from_be_bytes(head) as f64) < share * 2f64.powi(64)
}

/// Refuses a validation share that holds out nothing usable or everything.
pub fn check_validation_share(share: f64) -> Result<(), String> {
    if share.is_finite() && (0.0..1.0).contains(&share) {
        Ok(())
    } else {
        Err(format!("validation_share is {share}: it must be at least 0 and below 1"))
    }
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
    /// Conversations or samples left out, by reason (template_error, tool_calls_unrendered, mask_error, too_long).
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
    /// The held-out split; `samples`, `tokens`, `supervised_tokens`, `rows`, `per_source` and `shards` above
    /// count the training split only.
    pub validation: Option<ValidationSplit>,
    pub wall_seconds: f64,
    /// Peak resident memory of the process, where the OS reports it.
    pub peak_rss_bytes: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SourceCounts {
    pub samples: u64,
    pub tokens: u64,
    pub supervised_tokens: u64,
}

impl SourceCounts {
    fn add(&mut self, sample: &super::TokenSample) {
        self.samples += 1;
        self.tokens += sample.input_ids.len() as u64;
        self.supervised_tokens += sample.supervised() as u64;
    }
}

/// The conversations held out for the validation loss and the shards made of them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ValidationSplit {
    pub conversations: u64,
    /// Its samples, tokens and supervised tokens (at the top level of the JSON).
    #[serde(flatten)]
    pub counts: SourceCounts,
    pub padding_tokens: u64,
    pub rows: u64,
    pub shards: Vec<PathBuf>,
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
        if let Some(v) = &self.validation {
            text += &format!(
                "; the {} samples of {} conversations were all held out for validation (a validation_share too large \
                 for this data)",
                v.counts.samples, v.conversations
            );
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
        let validation = self.validation.as_ref().map_or(String::new(), |v| {
            format!(
                "; {} conversations held out for validation ({} samples, {} tokens, {} rows)",
                v.conversations, v.counts.samples, v.counts.tokens, v.rows
            )
        });
        let all_tokens = self.tokens + self.validation.as_ref().map_or(0, |v| v.counts.tokens);
        format!(
            "{} conversations → {} samples, {} tokens ({share:.1}% supervised) in {} rows{validation}; {dropped} dropped, {} truncated; {:.0} conversations/s, {:.0} tokens/s",
            self.conversations,
            self.samples,
            self.tokens,
            self.rows,
            self.truncated,
            self.conversations as f64 / secs,
            all_tokens as f64 / secs
        )
    }
}

/// What one conversation turned into, computed in parallel.
enum Outcome {
    Samples {
        source: String,
        held_out: bool,
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
        Err(e) => return Outcome::Failed { reason: e.drop_reason(), message: e.to_string() },
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
    Outcome::Samples {
        source: input.source.clone().unwrap_or_default(),
        held_out: held_out(input.split_key(), cfg.validation_share),
        samples: out,
        stripped,
        unlike,
        dropped_long,
    }
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

/// Reads conversations (JSON lines of `{id, messages, tools?, source?, meta?}`, which ingest's output is)
/// from `input`, writes shards and `stats.json` into `out_dir`, and the held-out conversations' shards into
/// `out_dir/validation/` (removed when none is held out, so no earlier split is left behind).
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
    check_validation_share(cfg.validation_share).map_err(TokenError::Config)?;
    let file = File::open(input).map_err(|e| TokenError::Io { path: input.to_path_buf(), source: e })?;
    let mut lines = BufReader::with_capacity(1 << 20, file).lines();
    let mut writer = ShardWriter::new(out_dir, cfg.layout, cfg.seq_len, tok.pad_id)?;
    let validation_dir = out_dir.join(VALIDATION_DIR);
    if validation_dir.exists() {
        std::fs::remove_dir_all(&validation_dir)
            .map_err(|e| TokenError::Io { path: validation_dir.clone(), source: e })?;
    }
    let mut validation = (cfg.validation_share > 0.0)
        .then(|| ShardWriter::new(&validation_dir, cfg.layout, cfg.seq_len, tok.pad_id))
        .transpose()?;
    let mut held = ValidationSplit::default();
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
                Outcome::Samples { source, held_out, samples, stripped, unlike, dropped_long } => {
                    stats.thinking_blocks_stripped += stripped as u64;
                    stats.turns_unlike_inference += unlike as u64;
                    // Counted only: over-long samples are expected at a short --seq-len, not errors to show.
                    if dropped_long > 0 {
                        *stats.dropped.entry("too_long".into()).or_default() += dropped_long as u64;
                    }
                    let (shards, counts) = match (held_out, validation.as_mut()) {
                        (true, Some(held_shards)) => {
                            held.conversations += u64::from(!samples.is_empty());
                            (held_shards, &mut held.counts)
                        }
                        _ => (&mut writer, stats.per_source.entry(source.clone()).or_default()),
                    };
                    for (sample, truncated) in &samples {
                        counts.add(sample);
                        stats.truncated += u64::from(*truncated);
                        shards.add(sample, &source)?;
                    }
                }
            }
        }
    }
    // The training split's totals are its sources'.
    for counts in stats.per_source.values() {
        stats.samples += counts.samples;
        stats.tokens += counts.tokens;
        stats.supervised_tokens += counts.supervised_tokens;
    }
    let shard_stats = writer.finish()?;
    stats.rows = shard_stats.rows;
    stats.padding_tokens = shard_stats.padding_tokens;
    stats.shards = shard_stats.files;
    if let Some(writer) = validation {
        let written = writer.finish()?;
        held.rows = written.rows;
        held.padding_tokens = written.padding_tokens;
        held.shards = written.files;
        if held.counts.samples > 0 {
            stats.validation = Some(held);
        } else {
            // Too few conversations for the share to catch one: no split, said in the stats by its absence.
            std::fs::remove_dir_all(&validation_dir)
                .map_err(|e| TokenError::Io { path: validation_dir.clone(), source: e })?;
        }
    }
    stats.wall_seconds = started.elapsed().as_secs_f64();
    stats.peak_rss_bytes = crate::host::peak_rss_bytes();
    let stats_path = out_dir.join("stats.json");
    let text = serde_json::to_string_pretty(&stats)
        .map_err(|e| TokenError::Shard { path: stats_path.clone(), message: e.to_string() })?;
    std::fs::write(&stats_path, text + "\n").map_err(|e| TokenError::Io { path: stats_path, source: e })?;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split holds out about the share asked for, the same keys every time, and a larger share only adds
    /// keys to the held-out side; 0 holds out none, and shares outside [0, 1) are refused.
    #[test]
    fn the_split_is_a_stable_hash_of_the_key() {
        let keys: Vec<String> = (0..10_000).map(|i| format!("task-{i}")).collect();
        let held = |share: f64| -> Vec<&String> { keys.iter().filter(|k| held_out(k, share)).collect() };
        let (small, large) = (held(0.05), held(0.1));
        assert!((450..=550).contains(&small.len()), "{}", small.len());
        assert!((900..=1100).contains(&large.len()), "{}", large.len());
        assert!(small.iter().all(|k| large.contains(k)));
        assert_eq!(held(0.1), large);
        assert!(held(0.0).is_empty());
        for bad in [1.0, -0.1, f64::NAN] {
            assert!(check_validation_share(bad).unwrap_err().contains("validation_share is"), "{bad}");
        }
        assert_eq!(check_validation_share(0.0), Ok(()));
    }
}
