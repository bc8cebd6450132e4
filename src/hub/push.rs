//! Uploading a checkpoint folder to a Hub model repo (`kiln push`, the sft pipeline's push stage). The token
//! is checked before anything else (and, by the pipeline, before any training): it must be there, valid, and
//! allowed to write to the repo (`account`: the token's role or scopes, the account's namespaces and its role
//! in the org). The repo, and the branch, are created when missing. The upload is one commit, made on top of
//! the commit it was planned against: it adds every file of the folder that commit does not already hold as
//! it is (compared by git object id, as the Hub lists them: a new card is sent without the gigabytes of
//! unchanged weights) and deletes the weight files of that commit the folder does not hold, so a repo never
//! mixes two exports (a 2-shard export over a 3-shard one would otherwise keep a stale third shard). Other
//! files a user added on the Hub stay. With nothing to add or delete, nothing is committed. The new commit is
//! listed back to confirm every file is there.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use hf_hub::progress::{ProgressEvent, ProgressHandler, UploadEvent};
use hf_hub::repository::{CommitOperation, RepoTreeEntry};
use hf_hub::{HFError, HFRepositorySync, RepoTypeModel};
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};
use sha1::Sha1;
use sha2::Digest;

use super::account::{Account, Refusal, WriteAccess};
use super::{Hub, HubError, RepoInfo, describe, error_code, is_commit_hash, is_repo_id, name, owner, sha256_file};

/// Where and how to push.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushSpec {
    /// `owner/name` of a model repo.
    pub repo: String,
    /// The branch the commit goes to; created from the default branch when missing.
    pub revision: String,
    /// Create the repo private when it does not exist yet (an existing repo keeps its visibility).
    pub private: bool,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushedFile {
    /// Path inside the repo.
    pub path: String,
    pub size: u64,
    pub sha256: String,
}

/// The record of one push, as written to `push.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushedRepo {
    pub repo: String,
    pub revision: String,
    pub endpoint: String,
    /// The account the token belongs to.
    pub user: String,
    /// The folder pushed (symbolic links resolved).
    pub folder: PathBuf,
    pub created_repo: bool,
    pub created_branch: bool,
    /// The commit the push was planned against: the new commit's parent.
    pub parent: String,
    pub commit: String,
    pub url: String,
    pub files: Vec<PushedFile>,
    /// The files this commit sent: those the parent did not hold as they are.
    #[serde(default)]
    pub sent: Vec<String>,
    /// Weight files of the parent commit that the folder does not hold, deleted by the same commit.
    pub deleted: Vec<String>,
    /// The branch's head already held every file as it is, and no stale weights: no commit was made (`commit`
    /// is that head).
    #[serde(default)]
    pub unchanged: bool,
}

impl PushedRepo {
    /// One line for the terminal.
    pub fn describe(&self) -> String {
        let target = format!("{}@{}", self.repo, self.revision);
        if self.unchanged {
            return format!(
                "{target} already holds these {} files at its head, {}: nothing committed",
                self.files.len(),
                self.url
            );
        }
        let sent: Vec<&PushedFile> = self.files.iter().filter(|f| self.sent.contains(&f.path)).collect();
        let bytes = indicatif::HumanBytes(sent.iter().map(|f| f.size).sum());
        let mut line = if sent.len() == self.files.len() {
            format!("{} files ({bytes}) to {target} as {}", sent.len(), self.url)
        } else {
            let kept = self.files.len() - sent.len();
            format!(
                "{} of {} files ({bytes}) to {target} as {}, {kept} already there",
                sent.len(),
                self.files.len(),
                self.url
            )
        };
        for (done, what) in [(self.created_repo, "a new repo"), (self.created_branch, "a new branch")] {
            if done {
                line += &format!(", {what}");
            }
        }
        if !self.deleted.is_empty() {
            line += &format!(", {} stale weight files deleted", self.deleted.len());
        }
        line
    }
}

/// Whether a repo file is (part of) a model's weights, as transformers and vLLM look for them: a stale one
/// beside a new export would be loaded, or its index followed.
pub fn is_weights_file(path: &str) -> bool {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.ends_with(".safetensors")
        || file.ends_with(".safetensors.index.json")
        || (file.starts_with("pytorch_model") && (file.ends_with(".bin") || file.ends_with(".bin.index.json")))
}

/// The weight files of `remote` that `local` does not hold.
pub fn stale_weights<'a>(remote: impl IntoIterator<Item = &'a String>, local: &[PushedFile]) -> Vec<String> {
    remote
        .into_iter()
        .filter(|path| is_weights_file(path) && !local.iter().any(|f| &f.path == *path))
        .cloned()
        .collect()
}

/// The git object id of a blob of `len` bytes read from `content`: what the Hub's tree lists as a file's `oid`.
fn git_blob_id(len: u64, mut content: impl Read) -> std::io::Result<String> {
    let mut hasher = Sha1::new();
    hasher.update(format!("blob {len}\0").as_bytes());
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = content.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// The Git LFS pointer that git holds for a file stored in LFS (or Xet) on the Hub.
pub fn lfs_pointer(sha256: &str, size: u64) -> String {
    format!("version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n")
}

/// A file of a commit as the Hub's tree lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteFile {
    /// The git object id: of the content, or of its LFS pointer for a file stored in LFS.
    pub oid: String,
    pub lfs: bool,
}

/// Whether `remote` is `file` as it is: the same git object id, of the content or of the LFS pointer its
/// sha256 and size make (read from `local` only for a file git holds whole, the small ones).
pub fn already_there(file: &PushedFile, local: &Path, remote: Option<&RemoteFile>) -> std::io::Result<bool> {
    let Some(remote) = remote else { return Ok(false) };
    let ours = if remote.lfs {
        let pointer = lfs_pointer(&file.sha256, file.size);
        git_blob_id(pointer.len() as u64, pointer.as_bytes())?
    } else {
        git_blob_id(file.size, std::fs::File::open(local)?)?
    };
    Ok(ours == remote.oid)
}

/// Every file under `folder` with its repo path (`/`-separated), sorted by path. Entries whose name starts
/// with a dot (`.git`, an editor's swap file, a lock) are left out.
pub fn folder_paths(folder: &Path) -> Result<Vec<(String, PathBuf)>, HubError> {
    fn walk(root: &Path, dir: &Path, depth: usize, out: &mut Vec<(String, PathBuf)>) -> Result<(), HubError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| HubError::Io { path, source }
        };
        // Symbolic links are followed (a folder of the HF cache is links to blobs); one that loops is not.
        if depth > 32 {
            let loop_error = std::io::Error::other("folders nested over 32 deep: a symbolic link loop?");
            return Err(io(dir)(loop_error));
        }
        for entry in std::fs::read_dir(dir).map_err(io(dir))? {
            let path = entry.map_err(io(dir))?.path();
            if path.file_name().is_none_or(|n| n.to_string_lossy().starts_with('.')) {
                continue;
            }
            let meta = std::fs::metadata(&path).map_err(io(&path))?;
            if meta.is_dir() {
                walk(root, &path, depth + 1, out)?;
            } else if meta.is_file() {
                let relative = path.strip_prefix(root).unwrap_or(&path);
                let parts: Vec<_> = relative.components().map(|c| c.as_os_str().to_string_lossy()).collect();
                out.push((parts.join("/"), path));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(folder, folder, 0, &mut out)?;
    out.sort();
    Ok(out)
}

/// `folder_paths` with each file's size and sha256; `bar` advances by each file's bytes (a 16 GB checkpoint
/// takes a while to hash).
pub fn folder_files(folder: &Path, bar: &ProgressBar) -> Result<Vec<(PushedFile, PathBuf)>, HubError> {
    let paths = folder_paths(folder)?;
    let mut sized = Vec::with_capacity(paths.len());
    for (repo_path, path) in paths {
        let size = std::fs::metadata(&path).map_err(|source| HubError::Io { path: path.clone(), source })?.len();
        sized.push((repo_path, path, size));
    }
    bar.set_length(sized.iter().map(|(_, _, size)| size).sum());
    let mut out = Vec::with_capacity(sized.len());
    for (repo_path, path, size) in sized {
        let sha256 = sha256_file(&path).map_err(|source| HubError::Io { path: path.clone(), source })?;
        bar.inc(size);
        out.push((PushedFile { path: repo_path, size, sha256 }, path));
    }
    Ok(out)
}

impl Hub {
    /// The client and the token's account, refused when the token is missing or refused, or may not write to
    /// `repo` (as `account` tells it). A token that may write to `repo` alone (a fine-grained one scoped to it)
    /// cannot create it: the repo must exist.
    fn client_for_push(&self, repo: &str) -> Result<(&hf_hub::HFClientSync, Account), HubError> {
        let client = self.client.as_ref().ok_or_else(|| HubError::PushOffline { repo: repo.to_string() })?;
        let Some((token_from, token)) = &self.token else {
            return Err(HubError::NoToken { repo: repo.to_string(), token_file: hf_hub::hf_home().join("token") });
        };
        if !is_repo_id(repo) {
            return Err(HubError::BadRepoId { repo: repo.to_string() });
        }
        let account = self.whoami(token, token_from, repo)?;
        let refuse = |why: Refusal| HubError::CannotWrite {
            repo: repo.to_string(),
            token_from: token_from.clone(),
            user: account.user.clone(),
            why: Box::new(why),
        };
        match account.write_access(repo).map_err(refuse)? {
            WriteAccess::Namespace => {}
            WriteAccess::ThisRepoOnly => match client.model(owner(repo), name(repo)).info().send() {
                Ok(_) => {}
                Err(e) if is_not_found(&e, "RepoNotFound") => {
                    return Err(refuse(Refusal::NotCreatable { repo: repo.to_string() }));
                }
                Err(e) => return Err(self.push_error(e, repo, "main", "looking the repo up")),
            },
        }
        Ok((client, account))
    }

    /// The account behind the token, refused when it may not write to `repo`'s namespace. The pipeline asks
    /// this before it trains, so that a missing or wrong token is not found out hours later.
    pub fn check_push(&self, repo: &str) -> Result<Account, HubError> {
        self.client_for_push(repo).map(|(_, account)| account)
    }

    /// Pushes the files of `folder` to `spec` as one commit and lists them back; files the branch's head already
    /// holds as they are are not sent, and where that is all of them (and no stale weights are there) nothing is
    /// committed: the Hub would record an empty commit.
    pub fn push(&self, folder: &Path, spec: &PushSpec) -> Result<PushedRepo, HubError> {
        let (client, account) = self.client_for_push(&spec.repo)?;
        let folder = folder.canonicalize().map_err(|source| HubError::Io { path: folder.to_path_buf(), source })?;
        let hashing = self.bar(format!("{}: hashing", spec.repo));
        let files = folder_files(&folder, &hashing);
        hashing.finish_and_clear();
        let files = files?;
        if files.is_empty() {
            return Err(HubError::NothingToPush { folder });
        }
        let repo = client.model(owner(&spec.repo), name(&spec.repo));
        let fail = |e: HFError, doing: &str| self.push_error(e, &spec.repo, &spec.revision, doing);

        let mut created_repo = false;
        let head = match repo.commit_and_files(&spec.revision) {
            Err(e) if is_not_found(&e, "RepoNotFound") => {
                client
                    .create_repository()
                    .repo_id(&spec.repo)
                    .repo_type(RepoTypeModel)
                    .private(spec.private)
                    .exist_ok(true)
                    .send()
                    .map_err(|e| fail(e, "creating the repo"))?;
                created_repo = true;
                repo.commit_and_files(&spec.revision)
            }
            found => found,
        };
        let mut created_branch = false;
        let (parent, _) = match head {
            Ok(found) => found,
            Err(e) if is_not_found(&e, "RevisionNotFound") => {
                repo.create_branch().branch(&spec.revision).send().map_err(|e| fail(e, "creating the branch"))?;
                created_branch = true;
                repo.commit_and_files(&spec.revision).map_err(|e| fail(e, "reading the new branch"))?
            }
            Err(e) => return Err(fail(e, "reading the repo")),
        };
        if !is_commit_hash(&parent) {
            return Err(fail_unexpected(spec, format!("a head commit '{parent}', which is not a commit hash")));
        }
        let local: Vec<PushedFile> = files.iter().map(|(f, _)| f.clone()).collect();
        // What the head holds, by path and git object id: the files not to send again, and the stale weights. A
        // repo created just now holds only the Hub's .gitattributes: nothing to compare with, no weights.
        let present = if created_repo {
            BTreeMap::new()
        } else {
            remote_files(&repo, &parent).map_err(|e| fail(e, "listing the head's files"))?
        };
        let mut to_send = Vec::new();
        for (file, path) in &files {
            let same = already_there(file, path, present.get(&file.path))
                .map_err(|source| HubError::Io { path: path.clone(), source })?;
            if !same {
                to_send.push((file, path));
            }
        }
        let deleted = stale_weights(present.keys(), &local);
        let record = |commit: String, url: String, sent: Vec<String>| PushedRepo {
            repo: spec.repo.clone(),
            revision: spec.revision.clone(),
            endpoint: self.config.endpoint.clone(),
            user: account.user.clone(),
            folder: folder.clone(),
            created_repo,
            created_branch,
            parent: parent.clone(),
            unchanged: sent.is_empty() && deleted.is_empty(),
            commit,
            url,
            files: local.clone(),
            sent,
            deleted: deleted.clone(),
        };
        if to_send.is_empty() && deleted.is_empty() {
            let url = format!("{}/{}/commit/{parent}", self.config.endpoint, spec.repo);
            return Ok(record(parent.clone(), url, Vec::new()));
        }
        let mut operations: Vec<CommitOperation> =
            to_send.iter().map(|(f, path)| CommitOperation::add_file(f.path.clone(), (*path).clone())).collect();
        operations.extend(deleted.iter().map(CommitOperation::delete));

        let bar = self.bar(format!("{}: {} files", spec.repo, to_send.len()));
        bar.set_length(to_send.iter().map(|(f, _)| f.size).sum());
        let info = repo
            .create_commit()
            .operations(operations)
            .commit_message(spec.message.clone())
            .revision(spec.revision.clone())
            .parent_commit(parent.clone())
            .progress(UploadBar { bar: bar.clone() })
            .send()
            .map_err(|e| fail(e, "committing"));
        bar.finish_and_clear();
        let info = info?;
        let commit = info
            .commit_oid
            .filter(|c| is_commit_hash(c))
            .ok_or_else(|| fail_unexpected(spec, "no commit hash for the upload".to_string()))?;
        // Listed back at the new commit: everything sent is there, nothing deleted is.
        let (_, listed) = repo.commit_and_files(&commit).map_err(|e| fail(e, "listing the new commit"))?;
        if let Some(missing) = local.iter().find(|f| !listed.contains(&f.path)) {
            return Err(fail_unexpected(spec, format!("commit {commit} without the pushed file '{}'", missing.path)));
        }
        if let Some(kept) = deleted.iter().find(|p| listed.contains(p)) {
            return Err(fail_unexpected(spec, format!("commit {commit} still holding the stale file '{kept}'")));
        }
        let url = info.commit_url.unwrap_or_else(|| format!("{}/{}/commit/{commit}", self.config.endpoint, spec.repo));
        Ok(record(commit, url, to_send.iter().map(|(f, _)| f.path.clone()).collect()))
    }
}

/// The files of `commit` by path, as the Hub's tree lists them.
fn remote_files(repo: &HFRepositorySync<RepoTypeModel>, commit: &str) -> Result<BTreeMap<String, RemoteFile>, HFError> {
    let entries = repo.list_tree().revision(commit.to_string()).recursive(true).send()?;
    Ok(entries
        .into_iter()
        .filter_map(|entry| match entry {
            RepoTreeEntry::File { oid, path, lfs, .. } => Some((path, RemoteFile { oid, lfs: lfs.is_some() })),
            RepoTreeEntry::Directory { .. } => None,
        })
        .collect())
}

impl Hub {
    fn push_error(&self, err: HFError, repo: &str, revision: &str, doing: &str) -> HubError {
        let (repo, revision, doing) = (repo.to_string(), revision.to_string(), doing.to_string());
        match err {
            HFError::AuthRequired { .. } | HFError::Forbidden { .. } => HubError::WriteDenied {
                repo,
                revision,
                doing,
                token_from: self.config.token_source.clone().unwrap_or_default(),
                message: describe(&err),
            },
            other => HubError::PushFailed {
                repo,
                revision,
                doing,
                endpoint: self.config.endpoint.clone(),
                message: describe(&other),
            },
        }
    }

    fn bar(&self, message: String) -> ProgressBar {
        let bar = self.file_bar();
        bar.set_message(message);
        bar
    }
}

fn fail_unexpected(spec: &PushSpec, what: String) -> HubError {
    HubError::PushUnexpected { repo: spec.repo.clone(), revision: spec.revision.clone(), what }
}

/// A 404 the Hub marks with `code` (RepoNotFound, RevisionNotFound), or hf-hub's own variant of it.
fn is_not_found(err: &HFError, code: &str) -> bool {
    match (err, error_code(err).as_deref()) {
        (_, Some(c)) => c == code,
        (HFError::RepoNotFound { .. }, None) => code == "RepoNotFound",
        (HFError::RevisionNotFound { .. }, None) => code == "RevisionNotFound",
        _ => false,
    }
}

/// Feeds hf-hub's upload events (byte progress comes from its Xet transfers) into one indicatif bar.
struct UploadBar {
    bar: ProgressBar,
}

impl ProgressHandler for UploadBar {
    fn on_progress(&self, event: &ProgressEvent) {
        let ProgressEvent::Upload(event) = event else { return };
        match event {
            UploadEvent::Start { total_bytes, .. } => self.bar.set_length(*total_bytes),
            UploadEvent::Progress { bytes_completed, .. } => self.bar.set_position(*bytes_completed),
            UploadEvent::Committing => {
                self.bar.set_position(self.bar.length().unwrap_or(0));
                self.bar.set_message(format!("{} (committing)", self.bar.message()));
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str) -> PushedFile {
        PushedFile { path: path.into(), size: 1, sha256: String::new() }
    }

    #[test]
    fn files_are_compared_by_git_object_id_of_the_content_or_of_the_lfs_pointer() {
        // Ids as `git hash-object` gives them.
        assert_eq!(git_blob_id(0, &b""[..]).unwrap(), "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391");
        assert_eq!(git_blob_id(6, &b"hello\n"[..]).unwrap(), "ce013625030ba8dba906f756967f9e9ca394464a");
        let dir = tempfile::tempdir().unwrap();
        let (small, weights) = (dir.path().join("config.json"), dir.path().join("model.safetensors"));
        std::fs::write(&small, "hello\n").unwrap();
        std::fs::write(&weights, "abc").unwrap();
        let describe = |path: &Path, name: &str| PushedFile {
            path: name.into(),
            size: std::fs::metadata(path).unwrap().len(),
            sha256: sha256_file(path).unwrap(),
        };
        let (config, model) = (describe(&small, "config.json"), describe(&weights, "model.safetensors"));
        let held = |oid: &str, lfs: bool| RemoteFile { oid: oid.into(), lfs };
        assert!(
            already_there(&config, &small, Some(&held("ce013625030ba8dba906f756967f9e9ca394464a", false))).unwrap()
        );
        assert!(
            !already_there(&config, &small, Some(&held("e69de29bb2d1d6434b8b29ae775ad8c2e48c5391", false))).unwrap()
        );
        assert!(!already_there(&config, &small, None).unwrap());
        // In LFS, git holds the pointer: `git hash-object` of the pointer for "abc" (3 bytes).
        let pointer = "80d7d501c2b256023dc42e46d958b9ac2ec283ee";
        assert!(already_there(&model, &weights, Some(&held(pointer, true))).unwrap());
        assert!(!already_there(&model, &weights, Some(&held(pointer, false))).unwrap(), "not the content's id");
    }

    #[test]
    fn weight_files_are_those_loaders_pick_up() {
        for path in ["model.safetensors", "model-00002-of-00003.safetensors", "model.safetensors.index.json"] {
            assert!(is_weights_file(path), "{path}");
        }
        for path in ["pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"] {
            assert!(is_weights_file(path), "{path}");
        }
        for path in ["config.json", "README.md", "tokenizer.json", "card/loss.png", "LICENSE", "training_args.bin"] {
            assert!(!is_weights_file(path), "{path}");
        }
    }

    #[test]
    fn only_weights_the_folder_lacks_are_stale() {
        let remote: Vec<String> = ["model-00001-of-00002.safetensors", "model.safetensors", "LICENSE", "notes.md"]
            .into_iter()
            .map(String::from)
            .collect();
        assert_eq!(
            stale_weights(&remote, &[file("model.safetensors"), file("config.json")]),
            ["model-00001-of-00002.safetensors"]
        );
    }

    #[test]
    fn folder_files_are_sorted_repo_paths_without_hidden_entries() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("card")).unwrap();
        std::fs::create_dir_all(dir.path().join(".cache")).unwrap();
        for (path, text) in [("config.json", "{}"), ("card/loss.png", "png"), (".kiln.lock", "x"), (".cache/a", "y")] {
            std::fs::write(dir.path().join(path), text).unwrap();
        }
        let bar = ProgressBar::hidden();
        let files = folder_files(dir.path(), &bar).unwrap();
        assert_eq!((bar.position(), bar.length()), (5, Some(5)), "the bar counts the bytes hashed");
        let paths: Vec<&str> = files.iter().map(|(f, _)| f.path.as_str()).collect();
        assert_eq!(paths, ["card/loss.png", "config.json"]);
        assert_eq!(files[1].0.sha256, crate::hub::sha256_bytes(b"{}"));
        assert_eq!(files[1].0.size, 2);
        // A link back up is followed until it is plainly a loop, then refused.
        std::os::unix::fs::symlink(dir.path(), dir.path().join("card/up")).unwrap();
        let err = folder_paths(dir.path()).unwrap_err().to_string();
        assert!(err.contains("a symbolic link loop?"), "{err}");
    }
}
