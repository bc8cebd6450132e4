//! How kiln writes into a run folder: the one way the stages write a JSON artifact (pretty-printed,
//! newline-terminated, parent folders made), how a JSON-lines record is read and cut back on resume, and the
//! lock that keeps a run folder to one kiln at a time.

use std::fs::{File, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

pub fn write_json(path: &Path, value: &impl serde::Serialize) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)? + "\n";
    std::fs::write(path, text)
}

/// Removes the file at `path`; one that is not there is no error.
pub fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The values of a JSON-lines text; a line that is not one is an error naming its number (`InvalidData`).
pub fn parse_json_lines<T: serde::de::DeserializeOwned>(text: &str) -> std::io::Result<Vec<T>> {
    text.lines()
        .enumerate()
        .map(|(i, line)| {
            serde_json::from_str(line)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("line {}: {e}", i + 1)))
        })
        .collect()
}

/// Keeps the lines of the JSON-lines file at `path` whose value `keep` accepts, as they were, and drops a last
/// line cut off mid-write (no newline after it). The file is rewritten (beside it, then renamed) only when a
/// line goes, and only once every complete line has been read; a missing file has nothing to keep.
pub fn retain_json_lines<T: serde::de::DeserializeOwned>(
    path: &Path,
    keep: impl Fn(&T) -> bool,
) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let complete = &text[..text.rfind('\n').map_or(0, |end| end + 1)];
    let values: Vec<T> = parse_json_lines(complete)?;
    let mut kept = String::with_capacity(complete.len());
    for (line, value) in complete.lines().zip(&values) {
        if keep(value) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    if kept.len() != text.len() {
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        std::fs::write(&partial, kept)?;
        std::fs::rename(&partial, path)?;
    }
    Ok(())
}

/// The file in a run folder whose lock a kiln holds while it writes there.
pub const RUN_LOCK_FILE: &str = ".kiln.lock";

#[derive(Debug, thiserror::Error)]
pub enum RunLockError {
    #[error(
        "{dir} is in use by another kiln ({holder}); wait for it to finish or stop it, or give this run another name"
    )]
    InUse { dir: PathBuf, holder: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// An exclusive lock on a run folder, held until dropped. Two kilns writing one run would interleave
/// its metrics, train from one another's half-written state and vouch for each other's outputs in the
/// manifests. The lock is the operating system's (flock), so a kiln that is killed releases it too; the
/// file stays, holding the last holder's pid and command for the message a second kiln shows.
#[derive(Debug)]
pub struct RunLock {
    _file: Option<File>,
}

impl RunLock {
    /// Locks `dir` (which must exist) for `command`, or says who holds it.
    pub fn acquire(dir: &Path, command: &str) -> Result<RunLock, RunLockError> {
        let path = dir.join(RUN_LOCK_FILE);
        let io = |source| RunLockError::Io { path: path.clone(), source };
        let mut file =
            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.is_empty() { "pid unknown" } else { holder };
                return Err(RunLockError::InUse { dir: dir.to_path_buf(), holder: holder.to_string() });
            }
            // A file system without locks (some network mounts) must not stop the run; it runs unguarded.
            Err(TryLockError::Error(e)) => {
                eprintln!("warning: {}: cannot lock the run folder ({e}); running without the lock", path.display());
                return Ok(RunLock { _file: None });
            }
        }
        let since = chrono::Local::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let holder = format!("pid {}, `{command}`, since {since}\n", std::process::id());
        file.set_len(0).and_then(|()| file.rewind()).and_then(|()| file.write_all(holder.as_bytes())).map_err(io)?;
        Ok(RunLock { _file: Some(file) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_locked_run_folder_is_refused_naming_its_holder_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path(), "kiln sft --model tiny").unwrap();
        let err = RunLock::acquire(dir.path(), "kiln card").unwrap_err().to_string();
        let pid = format!("pid {}, `kiln sft --model tiny`, since ", std::process::id());
        assert!(err.contains("is in use by another kiln") && err.contains(&pid), "{err}");
        drop(first);
        let second = RunLock::acquire(dir.path(), "kiln card").unwrap();
        let text = std::fs::read_to_string(dir.path().join(RUN_LOCK_FILE)).unwrap();
        assert!(text.starts_with(&format!("pid {}, `kiln card`, since ", std::process::id())), "{text}");
        assert_eq!(text.lines().count(), 1, "the holder line replaces the last one: {text}");
        drop(second);
        let missing = RunLock::acquire(&dir.path().join("nosuch"), "kiln card").unwrap_err().to_string();
        assert!(missing.contains("nosuch/.kiln.lock: No such file"), "{missing}");
    }
}
