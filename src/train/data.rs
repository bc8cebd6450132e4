//! Training data: the rows of prepared shards, visited in a seeded order per epoch, cut into micro-batches
//! and optimizer steps. Targets are next tokens inside the same document, supervised where the shard's
//! loss mask says so.

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::seq::SliceRandom;

use super::TrainError;
use crate::tokens::shards::{Row, is_shard_name, read_shard};

pub struct TrainData {
    pub rows: Vec<Row>,
    pub seq_len: usize,
    pub files: Vec<PathBuf>,
}

/// The token shards in `dir` (the files `kiln prepare` names `packed-*` / `bucket-*.parquet`), in name
/// order; none is an error.
pub fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, TrainError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| TrainError::Data { path: dir.to_path_buf(), message: e.to_string() })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(is_shard_name))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(TrainError::Data {
            path: dir.to_path_buf(),
            message: "no token shards (packed-<len>-<k>.parquet): run `kiln prepare` first".into(),
        });
    }
    Ok(files)
}

impl TrainData {
    /// Loads every shard of `dir` (`shard_files`; rows of one length: packed shards).
    pub fn load(dir: &Path) -> Result<Self, TrainError> {
        let files = shard_files(dir)?;
        let mut rows = Vec::new();
        for f in &files {
            rows.extend(read_shard(f)?);
        }
        let seq_len = rows.first().map(|r| r.input_ids.len()).unwrap_or(0);
        if let Some(bad) = rows.iter().find(|r| r.input_ids.len() != seq_len) {
            return Err(TrainError::Data {
                path: dir.to_path_buf(),
                message: format!(
                    "rows of different lengths ({seq_len} and {}): train on packed shards of one --seq-len",
                    bad.input_ids.len()
                ),
            });
        }
        Ok(TrainData { rows, seq_len, files })
    }

    /// An error naming the first token id at or beyond `vocab` (shards prepared with another tokenizer): on
    /// a GPU such an id would read past the embedding and the loss's rows instead of failing.
    pub fn check_vocabulary(&self, dir: &Path, vocab: usize) -> Result<(), TrainError> {
        for (index, row) in self.rows.iter().enumerate() {
            if let Some((position, &id)) = row.input_ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
                let sample = row.sample_ids.first().map_or(String::new(), |s| format!(" (sample {s})"));
                return Err(TrainError::Data {
                    path: dir.to_path_buf(),
                    message: format!(
                        "token id {id} at row {index}, position {position}{sample} is outside the model's \
                         vocabulary of {vocab} ids: were the shards prepared with another model's tokenizer?"
                    ),
                });
            }
        }
        Ok(())
    }

    /// An error naming the first document longer than the model's `context` (max_position_embeddings):
    /// positions past it are ones the model was never trained at, and its eval refuses them too.
    pub fn check_context(&self, dir: &Path, context: usize) -> Result<(), TrainError> {
        for (index, row) in self.rows.iter().enumerate() {
            let long = row.doc_lengths.iter().zip(&row.sample_ids).find(|(len, _)| **len as usize > context);
            if let Some((len, sample)) = long {
                return Err(TrainError::Data {
                    path: dir.to_path_buf(),
                    message: format!(
                        "sample {sample} in row {index} has {len} tokens, more than the model's context length of \
                         {context} (max_position_embeddings): prepare with --seq-len {context} or less"
                    ),
                });
            }
        }
        Ok(())
    }

    /// The row order of `epoch`: a permutation seeded by `seed` and the epoch, so a resumed run sees the same.
    pub fn order(&self, seed: u64, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.rows.len()).collect();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        order.shuffle(&mut rng);
        order
    }
}

/// Per-position target weights of a row: 1 where the next token is supervised and in the same document.
pub fn target_weights(row: &Row) -> Vec<f32> {
    let n = row.input_ids.len();
    let mut doc_end = vec![0usize; n];
    let mut start = 0;
    for &len in &row.doc_lengths {
        for slot in doc_end.iter_mut().skip(start).take(len as usize) {
            *slot = start + len as usize;
        }
        start += len as usize;
    }
    (0..n).map(|t| if t + 1 < n && t + 1 < doc_end[t] && row.loss_mask[t + 1] == 1 { 1.0 } else { 0.0 }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder without shards and a shard that is not parquet are errors that name the folder or the file
    /// once.
    #[test]
    fn missing_and_unreadable_shards_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = TrainData::load(dir.path()).err().unwrap().to_string();
        assert!(err.contains("no token shards") && err.contains("kiln prepare"), "{err}");
        let shard = dir.path().join("packed-1024-00000.parquet");
        std::fs::write(&shard, b"PAR1 cut short").unwrap();
        let err = TrainData::load(dir.path()).err().unwrap().to_string();
        assert_eq!(err.matches(&*shard.to_string_lossy()).count(), 1, "{err}");
        assert!(err.contains("Parquet error"), "{err}");
    }

    #[test]
    fn targets_stay_inside_documents() {
        let row = Row {
            input_ids: vec![1, 2, 3, 4, 5, 6, 0],
            loss_mask: vec![0, 1, 1, 0, 1, 1, 0],
            doc_lengths: vec![3, 3],
            sample_ids: vec!["a".into(), "b".into()],
            sources: vec!["s".into(), "s".into()],
        };
        // Position 2 → 3 crosses into the next document: never a target.
        assert_eq!(target_weights(&row), [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn an_id_outside_the_vocabulary_is_named_with_its_row_and_position() {
        let row = |ids: Vec<u32>| Row {
            loss_mask: vec![1; ids.len()],
            doc_lengths: vec![ids.len() as u32],
            input_ids: ids,
            sample_ids: vec!["terminal-7".into()],
            sources: vec!["s".into()],
        };
        let data = TrainData { rows: vec![row(vec![0, 5, 9]), row(vec![3, 10, 2])], seq_len: 3, files: Vec::new() };
        let dir = Path::new("shards");
        assert!(data.check_vocabulary(dir, 11).is_ok());
        let message = data.check_vocabulary(dir, 10).unwrap_err().to_string();
        assert!(
            message.starts_with("shards: token id 10 at row 1, position 1 (sample terminal-7) is outside"),
            "{message}"
        );
        assert!(message.contains("vocabulary of 10 ids"), "{message}");
    }

    #[test]
    fn a_document_past_the_context_length_is_named() {
        let row = Row {
            input_ids: vec![1; 8],
            loss_mask: vec![1; 8],
            doc_lengths: vec![3, 5],
            sample_ids: vec!["a".into(), "b".into()],
            sources: vec!["s".into(), "s".into()],
        };
        let data = TrainData { rows: vec![row], seq_len: 8, files: Vec::new() };
        let dir = Path::new("shards");
        assert!(data.check_context(dir, 5).is_ok(), "a packed row may be longer than the context");
        let message = data.check_context(dir, 4).unwrap_err().to_string();
        assert!(message.starts_with("shards: sample b in row 0 has 5 tokens, more than"), "{message}");
        assert!(message.contains("--seq-len 4 or less"), "{message}");
    }
}
