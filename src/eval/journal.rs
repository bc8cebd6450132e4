//! The record of an eval's finished batches (`eval/<name>.partial.jsonl` in a run): each batch's generated
//! tokens, written as the batch finishes under the identity of what is evaluated (checkpoint, settings,
//! replay), so that an eval stopped midway (Ctrl-C, a killed process) goes on from the batches not yet
//! decoded. A batch decodes the same whatever runs beside it and the batches are the same for the same
//! identity, so the result equals an uninterrupted eval's.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Header {
    identity: String,
}

/// One finished batch: its steps (indices into the evaluated steps), the tokens generated for each, and the
/// generation seconds spent when it finished (over every invocation of the eval).
#[derive(Serialize, Deserialize)]
struct BatchLine {
    steps: Vec<usize>,
    ids: Vec<Vec<u32>>,
    seconds: f64,
}

pub struct Journal {
    path: PathBuf,
    file: File,
    finished: HashMap<Vec<usize>, Vec<Vec<u32>>>,
    seconds: f64,
}

impl Journal {
    /// The journal at `path` for `identity`: the batches a journal of the same identity holds are kept (a line
    /// cut off mid-write, or one that does not parse, ends what is kept), any other journal is started afresh.
    pub fn open(path: &Path, identity: &str) -> std::io::Result<Journal> {
        let kept = read_kept(path, identity)?;
        // Written again with what is kept, so that new lines follow a complete one.
        let mut out =
            serde_json::to_string(&Header { identity: identity.to_string() }).map_err(std::io::Error::other)?;
        out.push('\n');
        for batch in &kept {
            out.push_str(&serde_json::to_string(batch).map_err(std::io::Error::other)?);
            out.push('\n');
        }
        std::fs::write(path, out)?;
        let file = std::fs::OpenOptions::new().append(true).open(path)?;
        let seconds = kept.iter().map(|b| b.seconds).fold(0.0, f64::max);
        let finished = kept.into_iter().map(|b| (b.steps, b.ids)).collect();
        Ok(Journal { path: path.to_path_buf(), file, finished, seconds })
    }

    /// How many batches the journal at `path` holds for `identity`, read without writing anything.
    pub fn peek(path: &Path, identity: &str) -> std::io::Result<usize> {
        read_kept(path, identity).map(|kept| kept.len())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many batches an earlier invocation finished.
    pub fn finished_batches(&self) -> usize {
        self.finished.len()
    }

    /// The tokens generated for `batch` by an earlier invocation, when it finished there.
    pub fn finished(&self, batch: &[usize]) -> Option<&[Vec<u32>]> {
        self.finished.get(batch).map(Vec::as_slice)
    }

    /// The generation seconds the finished batches took.
    pub fn seconds_before(&self) -> f64 {
        self.seconds
    }

    /// Records `batch`'s tokens `ids`, `seconds` of generation in all when it finished.
    pub fn record(&mut self, batch: &[usize], ids: &[Vec<u32>], seconds: f64) -> std::io::Result<()> {
        let line = BatchLine { steps: batch.to_vec(), ids: ids.to_vec(), seconds };
        let text = serde_json::to_string(&line).map_err(std::io::Error::other)? + "\n";
        self.file.write_all(text.as_bytes())?;
        self.file.flush()
    }

    /// Removes the journal: the eval's result is written.
    pub fn remove(self) -> std::io::Result<()> {
        drop(self.file);
        crate::files::remove_if_present(&self.path)
    }
}

/// Where a run keeps the journal of candidate `name`'s eval (the pipeline's eval stage and `kiln select` alike,
/// so that either goes on from the other's finished batches when their identities agree).
pub fn path_in(eval_dir: &Path, name: &str) -> PathBuf {
    eval_dir.join(format!("{name}.partial.jsonl"))
}

/// Where a run keeps the identity `eval/<name>.json` was measured under (`pipeline::stages::eval_identity`, the
/// journal's too), written after the result by the eval stage and `kiln select`.
pub fn identity_path_in(eval_dir: &Path, name: &str) -> PathBuf {
    eval_dir.join(format!("{name}.identity"))
}

/// The batches the journal at `path` holds for `identity` (none when it is absent or another identity's), up to
/// a line cut off mid-write or one that does not parse.
fn read_kept(path: &Path, identity: &str) -> std::io::Result<Vec<BatchLine>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut lines = text.lines();
    let same =
        lines.next().and_then(|l| serde_json::from_str::<Header>(l).ok()).is_some_and(|h| h.identity == identity);
    if !same {
        return Ok(Vec::new());
    }
    Ok(lines
        .map_while(|l| serde_json::from_str::<BatchLine>(l).ok())
        .filter(|b| b.steps.len() == b.ids.len())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Batches recorded under an identity are found again under it, up to a line cut off mid-write, and new
    /// lines follow them; another identity starts afresh.
    #[test]
    fn finished_batches_are_kept_for_the_same_identity_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("epoch-1.partial.jsonl");
        let mut journal = Journal::open(&path, "a").unwrap();
        assert_eq!(journal.finished_batches(), 0);
        journal.record(&[3, 1], &[vec![5, 6], vec![7]], 1.5).unwrap();
        journal.record(&[0], &[vec![]], 2.5).unwrap();
        drop(journal);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"steps\": [2], \"ids\": [[9");
        std::fs::write(&path, text).unwrap();

        assert_eq!((Journal::peek(&path, "a").unwrap(), Journal::peek(&path, "b").unwrap()), (2, 0));
        let mut journal = Journal::open(&path, "a").unwrap();
        assert_eq!(journal.finished_batches(), 2);
        assert_eq!(journal.finished(&[3, 1]), Some(&[vec![5, 6], vec![7]][..]));
        assert_eq!(journal.finished(&[1, 3]), None);
        assert_eq!(journal.finished(&[2]), None);
        assert_eq!(journal.seconds_before(), 2.5);
        journal.record(&[2], &[vec![9]], 3.0).unwrap();
        drop(journal);
        let journal = Journal::open(&path, "a").unwrap();
        assert_eq!((journal.finished_batches(), journal.finished(&[2])), (3, Some(&[vec![9]][..])));
        drop(journal);

        let journal = Journal::open(&path, "b").unwrap();
        assert_eq!((journal.finished_batches(), journal.seconds_before()), (0, 0.0));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"identity\":\"b\"}\n");
        journal.remove().unwrap();
        assert!(!path.exists());
    }
}
