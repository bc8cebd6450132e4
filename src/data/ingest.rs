//! Ingest: a recipe's sources → normalized, decontaminated, capped and weighted conversations, with
//! counts of everything read, kept and dropped (by reason) for the stats and the inspection report.

use std::collections::{BTreeMap, HashSet};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::DataError;
use super::calls::turns_off_schema;
use super::conversation::Conversation;
use super::decontam::{DecontamStats, EvalIndex};
use super::readers::{Location, for_each_row, local_files};
use super::recipe::{OffSchemaCalls, Recipe, SourceSpec};
use crate::hub::{Hub, PulledRepo};

/// The drop reason of a conversation seen before in the same ingest (with dedupe on).
pub const DUPLICATE: &str = "duplicate";

/// The drop reason of a conversation whose calls leave their schema, under `off_schema_calls = "drop"`, or
/// under `"history"` when no trained turn is left.
pub const CALLS_OFF_SCHEMA: &str = "calls_off_schema";

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `conv` under the source's `off_schema_calls`, with how many turns it made history only; `None` when the
/// conversation is to be dropped.
fn apply_call_policy(mut conv: Conversation, policy: OffSchemaCalls) -> Option<(Conversation, u64)> {
    if policy == OffSchemaCalls::Keep {
        return Some((conv, 0));
    }
    let faulted = turns_off_schema(&conv);
    if faulted.is_empty() {
        return Some((conv, 0));
    }
    if policy == OffSchemaCalls::Drop {
        return None;
    }
    for &i in &faulted {
        conv.messages[i].train = false;
    }
    conv.messages.iter().any(|m| m.is_trained_turn()).then_some((conv, faulted.len() as u64))
}

#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceStats {
    pub name: String,
    pub files: Vec<String>,
    pub rows_read: u64,
    /// Rows that normalized cleanly and were not contaminated (before the cap and weight).
    pub kept: u64,
    /// Dropped rows by reason (missing_column, unknown_role, non_string_content, empty_conversation,
    /// no_assistant_turn, bad_tool_call, bad_tools, bad_train_flag, calls_off_schema, duplicate).
    pub dropped: BTreeMap<String, u64>,
    /// Assistant turns kept as history only because a call of theirs left its schema
    /// (`off_schema_calls = "history"`), in the conversations kept.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub turns_off_schema_untrained: u64,
    pub decontamination: DecontamStats,
    /// True when `max_rows` stopped the read early.
    pub capped: bool,
    pub weight: f64,
    /// Conversations written after weighting.
    pub emitted: u64,
    /// Columns the recipe names (id, task, meta) that no row of a file held: most often a typo in the
    /// recipe, which would otherwise go unseen (a `task` column that is never read turns off decontamination
    /// by task name).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub absent_columns: Vec<AbsentColumn>,
}

/// A recipe column that none of a file's rows held (absent, or null in every row read).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbsentColumn {
    pub column: String,
    /// What the column feeds: `id`, `task`, `tools` or `meta`.
    pub feeds: String,
    pub file: String,
    /// Rows of the file read (all of them unless `max_rows` stopped the read).
    pub rows: u64,
}

impl AbsentColumn {
    pub fn warning(&self, source: &str) -> String {
        let consequence = match self.feeds.as_str() {
            "id" => "conversation ids fall back to row positions",
            "task" => {
                "its conversations carry no task name, so decontamination matches them by first user message only"
            }
            "tools" => "its conversations offer the model no function schemas",
            _ => "meta lacks it",
        };
        format!(
            "source '{source}': column '{}' (schema.{}) is in none of the {} rows read from {}; {consequence}",
            self.column, self.feeds, self.rows, self.file
        )
    }
}

#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct IngestStats {
    pub recipe: String,
    pub eval_sets: Vec<String>,
    pub sources: Vec<SourceStats>,
    pub rows_read: u64,
    pub kept: u64,
    pub dropped: u64,
    pub contaminated: u64,
    pub emitted: u64,
    pub pulls: Vec<PulledRepo>,
}

impl IngestStats {
    fn add(&mut self, s: SourceStats) {
        self.rows_read += s.rows_read;
        self.kept += s.kept;
        self.dropped += s.dropped.values().sum::<u64>();
        self.contaminated += s.decontamination.dropped;
        self.emitted += s.emitted;
        self.sources.push(s);
    }

    /// One line per recipe column a file lacked, for the CLI and the inspection report.
    pub fn warnings(&self) -> Vec<String> {
        self.sources.iter().flat_map(|s| s.absent_columns.iter().map(|a| a.warning(&s.name))).collect()
    }

    pub fn summary(&self) -> String {
        format!(
            "{}: read {} rows, kept {}, dropped {} bad, {} contaminated, wrote {} conversations",
            self.recipe, self.rows_read, self.kept, self.dropped, self.contaminated, self.emitted
        )
    }
}

/// The conversations an ingest has kept so far, by content (messages with their calls, reasoning and training
/// flags, and the offered tools; ids and sources aside), to drop exact repeats across all its sources and
/// recipes: a mix of two releases of one corpus (gyung/LFM2-Terminal-SFT-Processed is a part of
/// nvidia/Nemotron-Terminal-Corpus) would otherwise train the shared conversations twice.
#[derive(Debug, Default)]
pub struct Dedupe {
    seen: HashSet<[u8; 16]>,
}

impl Dedupe {
    /// True the first time a conversation with this content is offered.
    pub fn first_time(&mut self, conv: &Conversation) -> bool {
        let mut h = Sha256::new();
        // Streamed into the hash, not buffered.
        serde_json::to_writer(&mut h, &(&conv.messages, &conv.tools)).expect("a Conversation serializes");
        let digest = h.finalize();
        let mut key = [0u8; 16];
        key.copy_from_slice(&digest[..16]);
        self.seen.insert(key)
    }
}

/// How many times a kept conversation is emitted under `weight`: the whole part always, the fractional
/// part for a deterministic, seed-dependent subset of ids.
pub fn copies(weight: f64, id: &str, seed: u64) -> u64 {
    let whole = weight.floor();
    let frac = weight - whole;
    let mut n = whole as u64;
    if frac > 0.0 {
        let mut h = Sha256::new();
        h.update(seed.to_le_bytes());
        h.update(id.as_bytes());
        let digest = h.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        let unit = (u64::from_le_bytes(first) >> 11) as f64 / (1u64 << 53) as f64;
        if unit < frac {
            n += 1;
        }
    }
    n
}

/// The local files of a source: pulled through the Hub for hub sources, listed for local ones.
pub fn source_files(
    spec: &SourceSpec,
    base: &Path,
    hub: Option<&Hub>,
) -> Result<(Vec<PathBuf>, Option<PulledRepo>), DataError> {
    if let Some(h) = &spec.hub {
        let hub = match hub {
            Some(hub) => hub,
            None => {
                return Err(DataError::Recipe {
                    path: base.to_path_buf(),
                    message: format!("source '{}' is on the Hub but no Hub client was given", spec.name),
                });
            }
        };
        let pulled = hub.pull(&h.spec())?;
        let files = pulled.files.iter().map(|f| f.local.clone()).collect();
        return Ok((files, Some(pulled)));
    }
    let path = spec.local_path(base).unwrap_or_default();
    let files = local_files(&path, spec.format)?;
    if files.is_empty() {
        return Err(DataError::Text {
            path,
            location: format!("source '{}'", spec.name),
            message: format!("no {:?} files found", spec.format).to_lowercase(),
        });
    }
    Ok((files, None))
}

/// Reads one source's files, normalizing, decontaminating, capping and weighting, and hands each
/// conversation to `sink`. A bad row is counted and skipped; a bad file stops with its error. With `dedupe`,
/// a conversation it has seen before (in this source or an earlier one) is dropped as `duplicate`, before
/// the cap and the weight.
pub fn ingest_source(
    spec: &SourceSpec,
    files: &[PathBuf],
    eval: Option<&EvalIndex>,
    mut dedupe: Option<&mut Dedupe>,
    seed: u64,
    progress: &ProgressBar,
    sink: &mut dyn FnMut(Conversation) -> Result<(), DataError>,
) -> Result<SourceStats, DataError> {
    let mut stats = SourceStats { name: spec.name.clone(), weight: spec.weight, ..Default::default() };
    let columns = spec.schema.columns();
    let optional = spec.schema.optional_columns();
    for file in files {
        stats.files.push(file.display().to_string());
        let stem = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let mut sink_error = None;
        let mut seen = vec![false; optional.len()];
        let rows_before = stats.rows_read;
        for_each_row(file, spec.format, Some(&columns), |row, location| {
            stats.rows_read += 1;
            progress.inc(1);
            note_present(&row, &optional, &mut seen);
            let fallback_id = format!("{}/{}#{}", spec.name, stem, location_key(location));
            let conv = match spec.schema.normalize(&row, &spec.name, &fallback_id) {
                Ok(c) => c,
                Err(reason) => {
                    *stats.dropped.entry(reason.label().to_string()).or_default() += 1;
                    return ControlFlow::Continue(());
                }
            };
            if let Some(hit) = eval.and_then(|e| e.check(&conv)) {
                stats.decontamination.record(&hit);
                return ControlFlow::Continue(());
            }
            let (conv, untrained) = match apply_call_policy(conv, spec.off_schema_calls) {
                Some(kept) => kept,
                None => {
                    *stats.dropped.entry(CALLS_OFF_SCHEMA.to_string()).or_default() += 1;
                    return ControlFlow::Continue(());
                }
            };
            if let Some(d) = dedupe.as_deref_mut()
                && !d.first_time(&conv)
            {
                *stats.dropped.entry(DUPLICATE.to_string()).or_default() += 1;
                return ControlFlow::Continue(());
            }
            if spec.max_rows.is_some_and(|cap| stats.kept >= cap) {
                stats.capped = true;
                return ControlFlow::Break(());
            }
            stats.kept += 1;
            stats.turns_off_schema_untrained += untrained;
            for k in 0..copies(spec.weight, &conv.id, seed) {
                let mut copy = conv.clone();
                if k > 0 {
                    copy.id = format!("{}#{k}", conv.id);
                }
                if let Err(e) = sink(copy) {
                    sink_error = Some(e);
                    return ControlFlow::Break(());
                }
                stats.emitted += 1;
            }
            ControlFlow::Continue(())
        })?;
        if let Some(e) = sink_error {
            return Err(e);
        }
        let rows = stats.rows_read - rows_before;
        if rows > 0 {
            let absent = optional.iter().zip(&seen).filter(|(_, seen)| !**seen);
            stats.absent_columns.extend(absent.map(|((column, feeds), _)| AbsentColumn {
                column: column.clone(),
                feeds: (*feeds).to_string(),
                file: file.display().to_string(),
                rows,
            }));
        }
        if stats.capped {
            break;
        }
    }
    Ok(stats)
}

/// Marks the optional columns `row` holds a value in (null counts as absent).
fn note_present(row: &serde_json::Value, optional: &[(String, &'static str)], seen: &mut [bool]) {
    let Some(object) = row.as_object() else { return };
    for ((column, _), seen) in optional.iter().zip(seen.iter_mut()) {
        if !*seen && object.get(column).is_some_and(|v| !v.is_null()) {
            *seen = true;
        }
    }
}

fn location_key(location: Location) -> String {
    match location {
        Location::Row { row_group, row } => format!("rg{row_group}r{row}"),
        Location::Line(n) => format!("l{n}"),
        Location::Element(i) => format!("e{i}"),
    }
}

/// Ingests the chosen sources of `recipe` into `sink`, with a progress line per source.
pub fn ingest(
    recipe: &Recipe,
    sources: &[&SourceSpec],
    hub: Option<&Hub>,
    eval: Option<&EvalIndex>,
    mut dedupe: Option<&mut Dedupe>,
    show_progress: bool,
    sink: &mut dyn FnMut(Conversation) -> Result<(), DataError>,
) -> Result<IngestStats, DataError> {
    let mut stats = IngestStats {
        recipe: recipe.name.clone(),
        eval_sets: eval.map(|e| e.sources.clone()).unwrap_or_default(),
        ..Default::default()
    };
    let base = recipe.base_dir();
    for spec in sources {
        let (files, pulled) = source_files(spec, &base, hub)?;
        stats.pulls.extend(pulled);
        let bar = if show_progress { ProgressBar::new_spinner() } else { ProgressBar::hidden() };
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} {pos} rows ({per_sec})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_message(spec.name.clone());
        let s = ingest_source(spec, &files, eval, dedupe.as_deref_mut(), recipe.seed, &bar, sink)?;
        bar.finish_and_clear();
        if show_progress {
            eprintln!(
                "  {}: {} rows read, {} kept, {} dropped, {} contaminated, {} written",
                s.name,
                s.rows_read,
                s.kept,
                s.dropped.values().sum::<u64>(),
                s.decontamination.dropped,
                s.emitted
            );
        }
        stats.add(s);
    }
    Ok(stats)
}

/// Ingests each (recipe, chosen sources) into `out/conversations.jsonl` (written to a `.partial` file and
/// moved into place only when complete) and `out/ingest.json`; returns the per-recipe stats. `dedupe` drops
/// repeats across all of them.
pub fn ingest_to_dir(
    recipes: &[(&Recipe, Vec<&SourceSpec>)],
    hub: Option<&Hub>,
    eval: Option<&EvalIndex>,
    dedupe: bool,
    show_progress: bool,
    out: &std::path::Path,
) -> Result<Vec<IngestStats>, DataError> {
    use std::io::Write;
    let io = |path: &std::path::Path| {
        let path = path.to_path_buf();
        move |e: std::io::Error| DataError::Io { path: path.clone(), source: e }
    };
    std::fs::create_dir_all(out).map_err(io(out))?;
    let conv_path = out.join("conversations.jsonl");
    let tmp_path = out.join("conversations.jsonl.partial");
    let file = std::fs::File::create(&tmp_path).map_err(io(&tmp_path))?;
    let mut writer = std::io::BufWriter::new(file);
    let mut all = Vec::new();
    let mut seen = dedupe.then(Dedupe::default);
    {
        let mut write = |conv: Conversation| -> Result<(), DataError> {
            serde_json::to_writer(&mut writer, &conv).map_err(|e| io(&tmp_path)(e.into()))?;
            writer.write_all(b"\n").map_err(io(&tmp_path))
        };
        for (recipe, sources) in recipes {
            let stats = ingest(recipe, sources, hub, eval, seen.as_mut(), show_progress, &mut write)?;
            if show_progress {
                eprintln!("{}", stats.summary());
            }
            all.push(stats);
        }
    }
    writer.flush().map_err(io(&tmp_path))?;
    drop(writer);
    std::fs::rename(&tmp_path, &conv_path).map_err(io(&conv_path))?;
    let stats_path = out.join("ingest.json");
    crate::files::write_json(&stats_path, &all).map_err(io(&stats_path))?;
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_repeat_and_subsample_deterministically() {
        assert_eq!(copies(1.0, "a", 0), 1);
        assert_eq!(copies(2.0, "a", 0), 2);
        assert_eq!(copies(0.0, "a", 0), 0);
        let ids: Vec<String> = (0..4000).map(|i| format!("id{i}")).collect();
        let kept: u64 = ids.iter().map(|id| copies(0.25, id, 7)).sum();
        assert!((900..1100).contains(&kept), "{kept}");
        let again: u64 = ids.iter().map(|id| copies(0.25, id, 7)).sum();
        assert_eq!(kept, again);
        let extra: u64 = ids.iter().map(|id| copies(1.5, id, 7)).sum();
        assert!((5800..6200).contains(&extra), "{extra}");
    }
}
