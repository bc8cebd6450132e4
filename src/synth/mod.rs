//! `kiln synth`: the project's own deterministic sample data in the real schemas — Terminus-2 terminal
//! trajectories (parquet, like the Nemotron-derived corpora), ToolBench tool-use conversations (one JSON
//! array, like OpenBMB's release), held-out trajectories and their TB2-lite replay set.

pub mod replay;
pub mod terminal;
pub mod toolbench;

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{ArrayRef, ListBuilder, RecordBatch, StringBuilder, StructBuilder};
use arrow::datatypes::{DataType, Field, Fields};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use serde_json::Value;

use crate::data::Conversation;

#[derive(Debug, Clone, Serialize)]
pub struct SynthConfig {
    pub seed: u64,
    /// Terminal trajectories for training.
    pub train_tasks: usize,
    /// Held-out terminal trajectories, the source of the replay set.
    pub eval_tasks: usize,
    pub toolbench: usize,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig { seed: 20260612, train_tasks: 560, eval_tasks: 28, toolbench: 240 }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SynthSummary {
    pub config: SynthConfig,
    pub families: Vec<&'static str>,
    pub terminal: PathBuf,
    pub terminal_heldout: PathBuf,
    pub replay: PathBuf,
    pub toolbench: PathBuf,
    pub train_conversations: usize,
    pub heldout_conversations: usize,
    pub replay_steps: usize,
    pub toolbench_conversations: usize,
}

/// Draws task `index` until `accept` takes it; a family too small for the request is an error, not a hang.
fn draw(
    rng: &mut ChaCha8Rng,
    index: usize,
    mut accept: impl FnMut(&terminal::Task) -> bool,
) -> Result<terminal::Task, SynthError> {
    const ATTEMPTS: usize = 1000;
    let mut family = "";
    for _ in 0..ATTEMPTS {
        let task = terminal::task(rng, index);
        if accept(&task) {
            return Ok(task);
        }
        family = task.family;
    }
    Err(SynthError::Exhausted { family, attempts: ATTEMPTS })
}

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("task family '{family}' has no new distinct task after {attempts} draws: ask for fewer held-out tasks")]
    Exhausted { family: &'static str, attempts: usize },
    #[error("{path}: {message}")]
    Write { path: PathBuf, message: String },
}

fn werr(path: &Path, e: impl std::fmt::Display) -> SynthError {
    SynthError::Write { path: path.to_path_buf(), message: e.to_string() }
}

/// Independent streams per output, so changing one count leaves the others' content unchanged.
fn stream(seed: u64, id: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(id);
    rng
}

/// Held-out tasks are numbered after the training ones, so their names never collide.
pub fn train_task_name(family: &str, i: usize) -> String {
    format!("synth_{family}_{i:05}")
}

pub fn write_all(out: &Path, config: &SynthConfig) -> Result<SynthSummary, SynthError> {
    std::fs::create_dir_all(out).map_err(|e| werr(out, e))?;

    // Held-out tasks first: training tasks that happen to repeat one are drawn again, so the replay set
    // measures generalization and decontamination finds nothing in the samples.
    let mut rng = stream(config.seed, 2);
    let mut heldout = Vec::new();
    let mut heldout_prompts = HashSet::new();
    let mut replay_rows = Vec::new();
    for k in 0..config.eval_tasks {
        let task = draw(&mut rng, k, |t| heldout_prompts.insert(t.description.clone()))?;
        let task_id = format!("task-{k:03}");
        let name = train_task_name(task.family, config.train_tasks + k);
        let conv = task.conversation(&task_id, &name);
        let mut row = serde_json::json!({
            "conversations": conv.messages.iter().map(|m| serde_json::json!({"role": m.role.as_str(), "content": m.content})).collect::<Vec<_>>(),
            "agent": "terminus-2",
            "task": name,
            "task_id": task_id,
        });
        if let Some(obj) = row.as_object_mut() {
            obj.extend(conv.meta.iter().filter(|(k, _)| k.as_str() != "task").map(|(k, v)| (k.clone(), v.clone())));
        }
        heldout.push(row);
        replay_rows.extend(replay::records(&task, k, &task_id));
    }
    let heldout_path = out.join("terminal_heldout.jsonl");
    write_jsonl(&heldout_path, &heldout)?;
    let replay_path = out.join("replay.jsonl");
    write_jsonl(&replay_path, &replay_rows)?;

    let mut rng = stream(config.seed, 1);
    let train: Vec<Conversation> = (0..config.train_tasks)
        .map(|i| {
            let task = draw(&mut rng, i, |t| !heldout_prompts.contains(&t.description))?;
            Ok(task.conversation(&format!("synth-train-{i:05}"), &train_task_name(task.family, i)))
        })
        .collect::<Result<_, SynthError>>()?;
    let terminal_path = out.join("terminal.parquet");
    write_terminal_parquet(&terminal_path, &train)?;

    let mut rng = stream(config.seed, 3);
    let tools: Vec<Value> = (0..config.toolbench).map(|i| toolbench::conversation(&mut rng, i)).collect();
    let toolbench_path = out.join("toolbench.json");
    write_json_array(&toolbench_path, &tools)?;

    let summary = SynthSummary {
        config: config.clone(),
        families: terminal::family_names(),
        terminal: terminal_path,
        terminal_heldout: heldout_path,
        replay: replay_path,
        toolbench: toolbench_path,
        train_conversations: train.len(),
        heldout_conversations: heldout.len(),
        replay_steps: replay_rows.len(),
        toolbench_conversations: tools.len(),
    };
    let manifest = out.join("synth.json");
    let text = serde_json::to_string_pretty(&summary).map_err(|e| werr(&manifest, e))?;
    std::fs::write(&manifest, text + "\n").map_err(|e| werr(&manifest, e))?;
    Ok(summary)
}

fn write_jsonl(path: &Path, rows: &[Value]) -> Result<(), SynthError> {
    let mut w = BufWriter::new(File::create(path).map_err(|e| werr(path, e))?);
    for row in rows {
        serde_json::to_writer(&mut w, row).map_err(|e| werr(path, e))?;
        w.write_all(b"\n").map_err(|e| werr(path, e))?;
    }
    w.flush().map_err(|e| werr(path, e))
}

/// One JSON array, one element per line, as the OpenBMB release is laid out (one huge array).
fn write_json_array(path: &Path, rows: &[Value]) -> Result<(), SynthError> {
    let mut w = BufWriter::new(File::create(path).map_err(|e| werr(path, e))?);
    let mut write = |bytes: &[u8]| w.write_all(bytes).map_err(|e| werr(path, e));
    write(b"[\n")?;
    for (i, row) in rows.iter().enumerate() {
        if i > 0 {
            write(b",\n")?;
        }
        write(&serde_json::to_vec(row).map_err(|e| werr(path, e))?)?;
    }
    write(b"\n]\n")?;
    w.flush().map_err(|e| werr(path, e))
}

/// Rows per parquet row group: small, so even the sample file has several groups to stream.
const ROW_GROUP_ROWS: usize = 128;

/// Writes conversations with the Terminus-2 corpus columns: `conversations: list<struct<role, content>>`,
/// `agent`, `task`, `episode`, `trial_name`, `source_group`, `family`.
pub fn write_terminal_parquet(path: &Path, convs: &[Conversation]) -> Result<(), SynthError> {
    let message_fields =
        Fields::from(vec![Field::new("role", DataType::Utf8, false), Field::new("content", DataType::Utf8, false)]);
    let mut conversations = ListBuilder::new(StructBuilder::from_fields(message_fields.clone(), 0))
        .with_field(Arc::new(Field::new("item", DataType::Struct(message_fields), true)));
    let meta_columns = ["task", "episode", "trial_name", "source_group", "family"];
    let mut agent = StringBuilder::new();
    let mut metas: Vec<StringBuilder> = meta_columns.iter().map(|_| StringBuilder::new()).collect();
    for conv in convs {
        let messages = conversations.values();
        for m in &conv.messages {
            messages.field_builder::<StringBuilder>(0).expect("role builder").append_value(m.role.as_str());
            messages.field_builder::<StringBuilder>(1).expect("content builder").append_value(&m.content);
            messages.append(true);
        }
        conversations.append(true);
        agent.append_value("terminus-2");
        for (builder, col) in metas.iter_mut().zip(meta_columns) {
            builder.append_option(conv.meta.get(col).and_then(Value::as_str));
        }
    }
    let mut columns: Vec<(&str, ArrayRef)> =
        vec![("conversations", Arc::new(conversations.finish())), ("agent", Arc::new(agent.finish()))];
    for (mut builder, col) in metas.into_iter().zip(meta_columns) {
        columns.push((col, Arc::new(builder.finish())));
    }
    let batch = RecordBatch::try_from_iter(columns).map_err(|e| werr(path, e))?;
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3).map_err(|e| werr(path, e))?))
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .build();
    let file = File::create(path).map_err(|e| werr(path, e))?;
    let mut writer = ArrowWriter::try_new(file, batch.schema(), Some(props)).map_err(|e| werr(path, e))?;
    writer.write(&batch).map_err(|e| werr(path, e))?;
    writer.close().map_err(|e| werr(path, e))?;
    Ok(())
}
