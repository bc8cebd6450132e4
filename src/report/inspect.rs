//! `kiln inspect`: the I/O shell of the inspection report. One streaming pass over the run's normalized
//! conversations (in parallel chunks) and one over its shards (a record batch at a time), so memory stays
//! bounded by the per-item value lists (4 bytes a sample) and the duplicate-key sets (≈ 16 bytes a turn).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::figures::*;
use super::{ReportError, read_json};
use crate::data::conversation::Conversation;
use crate::data::ingest::IngestStats;
use crate::tokens::prepare::PrepareStats;
use crate::tokens::shards::{Row, ShardRows};

#[derive(Debug, Clone)]
pub struct InspectOptions {
    /// Random examples shown beside the first and the longest sample.
    pub random_examples: usize,
    pub seed: u64,
    /// Conversations observed per parallel chunk.
    pub chunk: usize,
}

impl Default for InspectOptions {
    fn default() -> Self {
        InspectOptions { random_examples: 3, seed: 0, chunk: 1024 }
    }
}

/// One token (or the few tokens that decode to one piece of text together) of a shown example.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub text: String,
    pub ids: Vec<u32>,
    pub supervised: bool,
}

/// The figures, the values behind the plots, and each example cut into decoded pieces.
pub struct InspectResult {
    pub inspection: Inspection,
    pub values: Values,
    pub pieces: Vec<Vec<Piece>>,
}

/// Reads `runs/<run>/data` (stats.json, ingest.json, conversations.jsonl, the shards) into figures.
pub fn inspect_run(run: &Path, opts: &InspectOptions, progress: &ProgressBar) -> Result<InspectResult, ReportError> {
    let started = std::time::Instant::now();
    let data = run.join("data");
    let stats_path = data.join("stats.json");
    if !stats_path.is_file() {
        return Err(ReportError::Missing {
            path: stats_path,
            hint: "not a prepared run; run `kiln prepare --out <run>/data` (or `kiln sft`) first".into(),
        });
    }
    let stats: PrepareStats = read_json(&stats_path)?;
    let mut ins = Inspection { run: run.display().to_string(), ..Default::default() };

    let ingest_path = data.join("ingest.json");
    if ingest_path.is_file() {
        let ingests: Vec<IngestStats> = read_json(&ingest_path)?;
        source_figures(&mut ins, &ingests);
    } else {
        ins.warnings
            .push(format!("{} is missing: source and decontamination figures unavailable", ingest_path.display()));
    }

    let conversations = [data.join("conversations.jsonl"), stats.input.clone()]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| ReportError::Missing {
            path: data.join("conversations.jsonl"),
            hint: format!(
                "the normalized conversations the shards were made from (stats.json names {})",
                stats.input.display()
            ),
        })?;
    let mut values = Values::default();
    progress.set_message("conversations");
    observe_conversations(&conversations, opts, &mut ins, &mut values, progress)?;
    if ins.conversations.total != stats.conversations {
        ins.warnings.push(format!(
            "{} holds {} conversations but stats.json counts {}: the shards may come from other data",
            conversations.display(),
            ins.conversations.total,
            stats.conversations
        ));
    }

    template_figures(&mut ins, &stats);
    ins.validation = stats.validation.clone();
    let tokenizer = load_tokenizer(&stats, &mut ins.warnings);
    let think = tokenizer.as_ref().and_then(|t| Some((t.token_to_id("<think>")?, t.token_to_id("</think>")?)));
    progress.set_message("shards");
    let shard_paths: Vec<PathBuf> =
        stats.shards.iter().map(|p| p.file_name().map_or_else(|| p.clone(), |name| data.join(name))).collect();
    scan_shards(&shard_paths, think, opts, &mut ins, &mut values, progress)?;
    cross_check(&mut ins, &stats);

    let pieces = ins.examples.iter().map(|e| decode_pieces(tokenizer.as_ref(), &e.input_ids, &e.loss_mask)).collect();
    ins.wall_seconds = started.elapsed().as_secs_f64();
    Ok(InspectResult { inspection: ins, values, pieces })
}

/// Writes `report/summary.json`, `report/summary.md` and `report/index.html` under the run; returns the page.
pub fn write_report(run: &Path, result: &InspectResult) -> Result<PathBuf, ReportError> {
    let dir = run.join("report");
    std::fs::create_dir_all(&dir).map_err(ReportError::io(&dir))?;
    let write = |name: &str, text: String| -> Result<PathBuf, ReportError> {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(ReportError::io(&path))?;
        Ok(path)
    };
    let summary = dir.join("summary.json");
    crate::files::write_json(&summary, &result.inspection).map_err(ReportError::io(&summary))?;
    write("summary.md", super::html::summary_markdown(&result.inspection))?;
    write("index.html", super::html::render_page(result)?)
}

impl Inspection {
    /// One line for the terminal.
    pub fn summary(&self) -> String {
        let s = &self.samples;
        format!(
            "{} conversations → {} samples, {} tokens ({:.1}% supervised), p95 {} tokens/sample, {:.1}% padding, {} warnings",
            self.conversations.total,
            s.samples,
            s.tokens,
            100.0 * s.supervised_share,
            s.tokens_per_sample.p95,
            100.0 * s.padding_share,
            self.warnings.len()
        )
    }
}

fn source_figures(ins: &mut Inspection, ingests: &[IngestStats]) {
    for ingest in ingests {
        for set in &ingest.eval_sets {
            if !ins.eval_sets.contains(set) {
                ins.eval_sets.push(set.clone());
            }
        }
        ins.warnings.extend(ingest.warnings());
        ins.sources.extend(ingest.sources.iter().map(|s| SourceFigures {
            recipe: ingest.recipe.clone(),
            name: s.name.clone(),
            rows_read: s.rows_read,
            kept: s.kept,
            dropped: s.dropped.clone(),
            decontaminated: s.decontamination.dropped,
            eval_tasks_hit: s.decontamination.eval_tasks_hit.clone(),
            weight: s.weight,
            emitted: s.emitted,
            turns_off_schema_untrained: s.turns_off_schema_untrained,
        }));
    }
}

#[derive(Default)]
struct Tallies {
    first_words: HashMap<String, u64>,
    tools: HashMap<String, u64>,
    seen_conversations: std::collections::HashSet<u64>,
    target_counts: HashMap<u64, u64>,
    target_snippets: HashMap<u64, String>,
}

fn observe_conversations(
    path: &Path,
    opts: &InspectOptions,
    ins: &mut Inspection,
    values: &mut Values,
    progress: &ProgressBar,
) -> Result<(), ReportError> {
    let file = File::open(path).map_err(ReportError::io(path))?;
    let mut lines = BufReader::with_capacity(1 << 20, file).lines();
    let mut tallies = Tallies::default();
    let mut line_no = 0usize;
    loop {
        let mut chunk = Vec::with_capacity(opts.chunk);
        for line in lines.by_ref() {
            line_no += 1;
            let line = line.map_err(ReportError::io(path))?;
            if line.trim().is_empty() {
                continue;
            }
            let conv: Conversation = serde_json::from_str(&line).map_err(|e| ReportError::Input {
                path: path.to_path_buf(),
                line: line_no,
                message: e.to_string(),
            })?;
            chunk.push(conv);
            if chunk.len() >= opts.chunk {
                break;
            }
        }
        if chunk.is_empty() {
            break;
        }
        let observations: Vec<ConversationObservation> = chunk.par_iter().map(observe).collect();
        progress.inc(observations.len() as u64);
        for obs in observations {
            merge(obs, ins, values, &mut tallies);
        }
    }
    ins.conversations.messages = Distribution::of(&mut values.messages_per_conversation);
    ins.conversations.assistant_turns = Distribution::of(&mut values.assistant_turns_per_conversation);
    ins.terminus.command_units_per_turn = Distribution::of(&mut values.command_units_per_turn);
    ins.tools.calls_per_conversation = Distribution::of(&mut values.tool_calls_per_conversation);
    ins.terminus.top_first_words = top_k(tallies.first_words, 15);
    ins.tools.top_tools = top_k(tallies.tools, 15);
    let repeated: HashMap<String, u64> = tallies
        .target_snippets
        .into_iter()
        .map(|(hash, snippet)| (snippet, tallies.target_counts.get(&hash).copied().unwrap_or(0)))
        .collect();
    ins.duplicates.top_repeated_targets = top_k(repeated, 5);
    let checks = &ins.tools.checks;
    if checks.undeclared_nulls > 0 {
        ins.warnings.push(format!(
            "{} tool call(s) pass null for arguments their function's schema does not declare (examples under Targets): \
             the mark of a parquet file's union of keys written out as JSON (a `datasets` export); templates print these nulls \
             into the trained calls. Read the parquet itself (kiln leaves a struct's null fields out), or set \
             `drop_nulls = true` in the source's [source.schema] (docs/RECIPES.md)",
            checks.undeclared_nulls
        ));
    }
    Ok(())
}

fn merge(obs: ConversationObservation, ins: &mut Inspection, values: &mut Values, t: &mut Tallies) {
    let c = &mut ins.conversations;
    c.total += 1;
    *c.per_source.entry(obs.source.clone()).or_default() += 1;
    values.messages_per_conversation.push(obs.messages);
    values.assistant_turns_per_conversation.push(obs.assistant_turns);
    c.untrained_turns += u64::from(obs.untrained_turns);

    ins.thinking.assistant_turns += u64::from(obs.assistant_turns);
    ins.thinking.turns_with_thinking += u64::from(obs.turns_with_thinking);

    match obs.kind {
        ConversationKind::Terminus => {
            let term = &mut ins.terminus;
            term.conversations += 1;
            for a in &obs.actions {
                term.assistant_turns += 1;
                term.valid_json += u64::from(a.valid_json);
                term.with_analysis += u64::from(a.analysis);
                term.with_plan += u64::from(a.plan);
                term.with_commands += u64::from(a.commands);
                term.with_task_complete += u64::from(a.task_complete.is_some());
                term.task_complete_true += u64::from(a.task_complete == Some(true));
                if a.valid_json && a.command_units.is_empty() {
                    term.empty_command_turns += 1;
                    term.empty_command_turns_completing += u64::from(a.task_complete == Some(true));
                }
                values.command_units_per_turn.push(a.command_units.len() as u32);
                for word in a.command_units.iter().filter_map(|u| first_word(u)) {
                    *t.first_words.entry(word.to_string()).or_default() += 1;
                }
            }
        }
        ConversationKind::ToolUse => {
            let tools = &mut ins.tools;
            tools.conversations += 1;
            tools.tool_messages += u64::from(obs.tool_messages);
            tools.tool_calls += obs.tool_calls.len() as u64;
            values.tool_calls_per_conversation.push(obs.tool_calls.len() as u32);
            for name in obs.tool_calls {
                *t.tools.entry(name).or_default() += 1;
            }
            tools.checks.add(obs.call_checks);
        }
        ConversationKind::Other => {}
    }

    if !t.seen_conversations.insert(obs.key) {
        ins.duplicates.duplicate_conversations += 1;
    }
    for (hash, snippet) in obs.targets {
        ins.duplicates.assistant_turns += 1;
        let count = t.target_counts.entry(hash).or_default();
        *count += 1;
        if *count == 2 {
            t.target_snippets.insert(hash, snippet);
        }
        if *count >= 2 {
            ins.duplicates.duplicate_targets += 1;
        }
    }
}

fn template_figures(ins: &mut Inspection, stats: &PrepareStats) {
    let t = &mut ins.template;
    if let Some(src) = &stats.template {
        t.origin = src.origin.clone();
        t.sha256 = src.sha256.clone();
        t.revision = hub_revision(&src.origin);
    }
    if let Some(tok) = &stats.tokenizer {
        t.tokenizer = tok.path.display().to_string();
        t.tokenizer_sha256 = tok.sha256.clone();
    }
    if let Some(cfg) = &stats.config {
        t.mode = serde_name(&cfg.policy.mode);
        t.thinking = serde_name(&cfg.policy.thinking);
        t.kwargs = cfg.policy.kwargs.clone();
        t.seq_len = cfg.seq_len as u64;
        t.layout = serde_name(&cfg.layout);
        t.truncation = serde_name(&cfg.truncation);
    }
}

/// The serde name of a unit enum value (`strip-history`, `packed`).
fn serde_name<T: serde::Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}

/// The commit of a file in the Hub cache (`…/snapshots/<40 hex>/…`).
fn hub_revision(path: &str) -> Option<String> {
    let (_, after) = path.split_once("/snapshots/")?;
    let commit = after.split('/').next()?;
    (commit.len() == 40 && commit.chars().all(|c| c.is_ascii_hexdigit())).then(|| commit.to_string())
}

fn load_tokenizer(stats: &PrepareStats, warnings: &mut Vec<String>) -> Option<tokenizers::Tokenizer> {
    let info = stats.tokenizer.as_ref()?;
    let bytes = match std::fs::read(&info.path) {
        Ok(b) => b,
        Err(e) => {
            warnings.push(format!("tokenizer {}: {e}; examples are shown as token ids", info.path.display()));
            return None;
        }
    };
    let digest = crate::hub::sha256_bytes(&bytes);
    if digest != info.sha256 {
        warnings.push(format!(
            "tokenizer {} changed since prepare (sha256 {} there, {digest} now): examples may decode wrongly",
            info.path.display(),
            info.sha256
        ));
    }
    match tokenizers::Tokenizer::from_bytes(&bytes) {
        Ok(t) => Some(t),
        Err(e) => {
            warnings.push(format!("tokenizer {}: {e}; examples are shown as token ids", info.path.display()));
            None
        }
    }
}

fn check_row(row: &Row, path: &Path, index: usize) -> Result<(), ReportError> {
    let bad = |message: String| {
        Err(ReportError::Invalid { path: path.to_path_buf(), message: format!("row {index}: {message}") })
    };
    let used = row.used();
    if row.loss_mask.len() != row.input_ids.len() {
        return bad(format!("{} mask values for {} tokens", row.loss_mask.len(), row.input_ids.len()));
    }
    if used > row.input_ids.len() {
        return bad(format!("documents span {used} tokens but the row has {}", row.input_ids.len()));
    }
    if row.sample_ids.len() != row.doc_lengths.len() || row.sources.len() != row.doc_lengths.len() {
        return bad(format!(
            "{} documents but {} sample ids and {} sources",
            row.doc_lengths.len(),
            row.sample_ids.len(),
            row.sources.len()
        ));
    }
    Ok(())
}

fn scan_shards(
    paths: &[PathBuf],
    think: Option<(u32, u32)>,
    opts: &InspectOptions,
    ins: &mut Inspection,
    values: &mut Values,
    progress: &ProgressBar,
) -> Result<(), ReportError> {
    let s = &mut ins.samples;
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let (mut first, mut longest): (Option<Example>, Option<Example>) = (None, None);
    let mut reservoir: Vec<Example> = Vec::new();
    for path in paths {
        if !path.is_file() {
            return Err(ReportError::Missing { path: path.clone(), hint: "a shard stats.json lists".into() });
        }
        for (index, row) in ShardRows::open(path)?.enumerate() {
            let row = row?;
            check_row(&row, path, index)?;
            progress.inc(1);
            s.rows += 1;
            s.slots += row.input_ids.len() as u64;
            s.padding_tokens += (row.input_ids.len() - row.used()) as u64;
            let mut start = 0usize;
            for (d, &len) in row.doc_lengths.iter().enumerate() {
                let span = start..start + len as usize;
                start = span.end;
                let (ids, mask) = (&row.input_ids[span.clone()], &row.loss_mask[span]);
                let (supervised, thinking) = supervised_and_thinking(ids, mask, think);
                let source = &row.sources[d];
                s.samples += 1;
                s.tokens += u64::from(len);
                s.supervised_tokens += supervised;
                let per = s.per_source.entry(source.clone()).or_default();
                per.samples += 1;
                per.tokens += u64::from(len);
                per.supervised_tokens += supervised;
                values.tokens_per_sample.push(len);
                values.supervised_per_sample.push(supervised as u32);
                ins.thinking.thinking_tokens_in_targets += thinking;
                ins.thinking.samples_with_thinking_targets += u64::from(thinking > 0);

                let example = |kind: &str| Example {
                    kind: kind.into(),
                    sample_id: row.sample_ids[d].clone(),
                    source: source.clone(),
                    tokens: u64::from(len),
                    supervised,
                    input_ids: ids.to_vec(),
                    loss_mask: mask.to_vec(),
                };
                if first.is_none() {
                    first = Some(example("first"));
                }
                if longest.as_ref().is_none_or(|l| u64::from(len) > l.tokens) {
                    longest = Some(example("longest"));
                }
                // Reservoir sampling: every sample equally likely, one pass, k examples in memory.
                let n = s.samples as usize - 1;
                if reservoir.len() < opts.random_examples {
                    reservoir.push(example("random"));
                } else {
                    let j = rng.random_range(0..=n);
                    if j < opts.random_examples {
                        reservoir[j] = example("random");
                    }
                }
            }
        }
    }
    s.supervised_share = share(s.supervised_tokens, s.tokens);
    s.padding_share = share(s.padding_tokens, s.slots);
    s.tokens_per_sample = Distribution::of(&mut values.tokens_per_sample);
    s.supervised_per_sample = Distribution::of(&mut values.supervised_per_sample);
    let mut examples: Vec<Example> = first.into_iter().chain(longest).collect();
    for e in reservoir {
        if !examples.iter().any(|x| x.sample_id == e.sample_id) {
            examples.push(e);
        }
    }
    ins.examples = examples;
    Ok(())
}

fn cross_check(ins: &mut Inspection, stats: &PrepareStats) {
    let s = &mut ins.samples;
    s.truncated = stats.truncated;
    s.dropped = stats.dropped.clone();
    ins.thinking.blocks_stripped_from_history = stats.thinking_blocks_stripped;
    for (what, shards, recorded) in [
        ("samples", s.samples, stats.samples),
        ("tokens", s.tokens, stats.tokens),
        ("supervised tokens", s.supervised_tokens, stats.supervised_tokens),
        ("padding tokens", s.padding_tokens, stats.padding_tokens),
        ("rows", s.rows, stats.rows),
    ] {
        if shards != recorded {
            ins.warnings.push(format!("the shards hold {shards} {what} but stats.json records {recorded}"));
        }
    }
    ins.warnings.extend(unrenderable_warning(stats));
}

/// Conversations or turns prepare could not render for training (every reason but a length limit): the run
/// trains without them, and a template policy at odds with the data (a no-thinking generation prompt before
/// turns that reason) leaves out a whole source this way, so the report says so beside its first error.
fn unrenderable_warning(stats: &PrepareStats) -> Option<String> {
    let reasons: Vec<String> =
        stats.dropped.iter().filter(|(reason, _)| *reason != "too_long").map(|(r, n)| format!("{r}: {n}")).collect();
    if reasons.is_empty() {
        return None;
    }
    let first = stats.error_examples.first().map_or(String::new(), |e| format!(" The first: {e}."));
    Some(format!(
        "prepare left out what it could not render for training ({}; of {} conversations), and the run trains \
         without it: the model config's [template] policy (thinking, mode, vars, tool_results, prompt_rule) and \
         the data disagree, or the data is malformed (docs/CHAT.md).{first}",
        reasons.join(", "),
        stats.conversations
    ))
}

/// Cuts an example into decoded pieces: a token whose bytes do not end a character is joined with the
/// next, so every piece is valid text and the pieces concatenate to the decoded sample.
fn decode_pieces(tokenizer: Option<&tokenizers::Tokenizer>, ids: &[u32], mask: &[u8]) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let mut pending: Vec<u32> = Vec::new();
    let mut supervised = false;
    let mut stream = tokenizer.map(|t| t.decode_stream(false));
    for (&id, &m) in ids.iter().zip(mask) {
        pending.push(id);
        supervised |= m != 0;
        let text = match stream.as_mut() {
            Some(s) => match s.step(id) {
                Ok(Some(text)) => text,
                Ok(None) => continue,
                Err(_) => format!("⟨{id}⟩"),
            },
            None => format!("⟨{id}⟩"),
        };
        pieces.push(Piece { text, ids: std::mem::take(&mut pending), supervised });
        supervised = false;
    }
    if !pending.is_empty() {
        let text = pending.iter().map(|id| format!("⟨{id}⟩")).collect();
        pieces.push(Piece { text, ids: pending, supervised });
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revision_from_hub_cache_paths() {
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let path = format!("/h/hub/models--LiquidAI--LFM2-350M/snapshots/{commit}/chat_template.jinja");
        assert_eq!(hub_revision(&path).as_deref(), Some(commit));
        assert_eq!(hub_revision("configs/models/tiny/chat_template.jinja"), None);
    }

    #[test]
    fn only_what_could_not_be_rendered_is_warned_of() {
        let mut stats = PrepareStats { conversations: 9, ..Default::default() };
        stats.dropped.insert("too_long".into(), 4);
        assert_eq!(unrenderable_warning(&stats), None, "a length limit is the config's choice, not a fault");
        stats.dropped.insert("template_error".into(), 2);
        stats.dropped.insert("mask_error".into(), 1);
        stats.error_examples.push("conversation 'c', message 1: the turn renders …".into());
        let warning = unrenderable_warning(&stats).unwrap();
        assert!(warning.contains("(mask_error: 1, template_error: 2; of 9 conversations)"), "{warning}");
        assert!(
            warning.ends_with("The first: conversation 'c', message 1: the turn renders ….")
                && !warning.contains("too_long")
        );
    }

    #[test]
    fn pieces_are_whole_characters_that_concatenate_to_the_sample() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/tiny/tokenizer.json");
        let tok = tokenizers::Tokenizer::from_file(&path).unwrap();
        let text = "<|im_start|>assistant\ncafé → ✓ 日本 done<|im_end|>";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        let mask: Vec<u8> = (0..ids.len()).map(|i| u8::from(i >= 3)).collect();
        let pieces = decode_pieces(Some(&tok), &ids, &mask);
        assert!(pieces.len() < ids.len(), "multi-byte characters span several byte-level tokens");
        assert_eq!(pieces.iter().map(|p| p.text.as_str()).collect::<String>(), tok.decode(&ids, false).unwrap());
        assert_eq!(pieces.iter().map(|p| p.ids.len()).sum::<usize>(), ids.len());
        assert!(!pieces[0].supervised && pieces.last().unwrap().supervised);
        let unknown = decode_pieces(None, &[1, 2], &[0, 1]);
        assert_eq!(unknown.iter().map(|p| p.text.as_str()).collect::<Vec<_>>(), ["⟨1⟩", "⟨2⟩"]);
    }
}
