//! Hugging Face Hub access through hf-hub: endpoint and token from the environment, a revision resolved to
//! its commit and recorded, files selected by glob, the standard HF cache layout (shared with Python tools),
//! and `HF_HUB_OFFLINE=1` served from that cache alone. A transfer that breaks off is taken up again (three
//! attempts in all), an LFS or Xet-stored file from the bytes it has (as Python's huggingface_hub does for
//! LFS), also in a later pull. Every failure names the repo, revision and file. Uploads: `push`.

use std::fmt;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use globset::{GlobSet, GlobSetBuilder};
use hf_hub::progress::{DownloadEvent, ProgressEvent, ProgressHandler};
use hf_hub::{HFClientBuilder, HFClientSync, HFError, HFRepositorySync, RepoType};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub mod account;
pub mod push;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RepoKind {
    Model,
    Dataset,
}

impl RepoKind {
    fn plural(self) -> &'static str {
        match self {
            RepoKind::Model => "models",
            RepoKind::Dataset => "datasets",
        }
    }
}

impl fmt::Display for RepoKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RepoKind::Model => "model",
            RepoKind::Dataset => "dataset",
        })
    }
}

/// What to pull: a repo at a revision (branch, tag or commit) and the files wanted, as globs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepoSpec {
    pub kind: RepoKind,
    pub repo: String,
    pub revision: String,
    /// Globs over repo paths (`*` stays within a folder, `**` crosses folders); each must match a file.
    /// Empty, with no optional globs either, means every file.
    pub files: Vec<String>,
    /// Globs pulled when present (a model's chat_template.jinja, say) and skipped when not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub optional_files: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PulledFile {
    /// Path inside the repo.
    pub path: String,
    /// Path in the local HF cache (`…/snapshots/<commit>/<path>`).
    pub local: PathBuf,
    pub size: u64,
    pub sha256: String,
}

/// The record of one pull, as written to `pull.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PulledRepo {
    pub kind: RepoKind,
    pub repo: String,
    /// The revision asked for.
    pub revision: String,
    /// The commit it resolved to.
    pub commit: String,
    pub endpoint: String,
    /// True when served from the local cache without contacting the Hub.
    pub from_cache: bool,
    pub files: Vec<PulledFile>,
}

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "{kind} repo '{repo}' was not found at {endpoint} (revision '{revision}'). Check the id; if it is private, {token_hint}"
    )]
    RepoNotFound { kind: RepoKind, repo: String, revision: String, endpoint: String, token_hint: String },
    #[error(
        "revision '{revision}' does not exist in {kind} repo '{repo}'. Use a branch, tag or full commit sha that exists on the Hub"
    )]
    RevisionNotFound { kind: RepoKind, repo: String, revision: String },
    #[error("{kind} repo '{repo}' (revision '{revision}') is gated or private: {token_hint}")]
    AccessDenied { kind: RepoKind, repo: String, revision: String, token_hint: String },
    #[error("file '{file}' does not exist in {kind} repo '{repo}' at revision '{revision}'")]
    FileNotFound { kind: RepoKind, repo: String, revision: String, file: String },
    #[error(
        "pattern '{pattern}' matches no file of {kind} repo '{repo}' at revision '{revision}' ({count} files there, e.g. {examples})"
    )]
    NoFilesMatch { kind: RepoKind, repo: String, revision: String, pattern: String, count: usize, examples: String },
    #[error(
        "offline (HF_HUB_OFFLINE=1): {kind} repo '{repo}' revision '{revision}'{file} is not in the cache at {cache}. Pull it once with network access (`kiln pull`), or unset HF_HUB_OFFLINE"
    )]
    NotCached { kind: RepoKind, repo: String, revision: String, file: String, cache: PathBuf },
    #[error("could not reach the Hub at {endpoint} for {kind} repo '{repo}' (revision '{revision}'{file}): {message}")]
    Network { kind: RepoKind, repo: String, revision: String, file: String, endpoint: String, message: String },
    #[error(
        "{kind} repo '{repo}' (revision '{revision}'): the Hub answered {what}, which would be written outside the cache; nothing was downloaded"
    )]
    Unsafe { kind: RepoKind, repo: String, revision: String, what: String },
    #[error(
        "{kind} repo '{repo}' (revision '{revision}'): file '{file}' arrived with sha256 {actual}, not the {announced} the Hub announced; it was removed from the cache, pull again"
    )]
    Corrupt { kind: RepoKind, repo: String, revision: String, file: String, announced: String, actual: String },
    #[error("invalid file pattern '{pattern}': {message}")]
    BadPattern { pattern: String, message: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("Hub client setup failed: {0}")]
    Setup(String),
    #[error("offline (HF_HUB_OFFLINE=1): nothing can be pushed to model repo '{repo}'; unset HF_HUB_OFFLINE")]
    PushOffline { repo: String },
    #[error(
        "pushing to model repo '{repo}' needs a Hub token with write access: set HF_TOKEN, or write the token to {}",
        token_file.display()
    )]
    NoToken { repo: String, token_file: PathBuf },
    #[error("'{repo}' is not a Hub repo id (owner/name)")]
    BadRepoId { repo: String },
    #[error(
        "the token from {token_from} was refused by {endpoint}: check that it is valid (huggingface.co/settings/tokens)"
    )]
    TokenRefused { token_from: String, endpoint: String },
    #[error("the token from {token_from} belongs to '{user}', who may not push to '{repo}': {why}")]
    CannotWrite { repo: String, token_from: String, user: String, why: Box<account::Refusal> },
    #[error(
        "the Hub refused {doing} for model repo '{repo}' (branch '{revision}') with the token from {token_from}: {message}. The token needs write access to the repo"
    )]
    WriteDenied { repo: String, revision: String, doing: String, token_from: String, message: String },
    #[error("pushing to model repo '{repo}' (branch '{revision}') failed while {doing} at {endpoint}: {message}")]
    PushFailed { repo: String, revision: String, doing: String, endpoint: String, message: String },
    #[error("model repo '{repo}' (branch '{revision}'): the Hub answered {what}")]
    PushUnexpected { repo: String, revision: String, what: String },
    #[error("{}: no file to push", folder.display())]
    NothingToPush { folder: PathBuf },
}

/// Settings read from the environment, the same variables the Python `huggingface_hub` reads.
#[derive(Debug, Clone)]
pub struct HubConfig {
    pub endpoint: String,
    pub cache_dir: PathBuf,
    pub offline: bool,
    /// Where the token came from (`HF_TOKEN`, a file path), never the token itself.
    pub token_source: Option<String>,
    pub show_progress: bool,
    pub retries: usize,
    /// Bytes asked for in each ranged request when a download goes on from a partial file.
    pub resume_chunk: u64,
}

fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
        .unwrap_or(false)
}

impl HubConfig {
    pub fn from_env() -> HubConfig {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        HubConfig {
            endpoint,
            cache_dir: hf_hub::resolve_cache_dir(),
            offline: env_flag("HF_HUB_OFFLINE"),
            token_source: token_source(),
            show_progress: true,
            retries: 3,
            resume_chunk: 64 << 20,
        }
    }

    fn token_hint(&self) -> String {
        match &self.token_source {
            None => format!(
                "no token is set: accept the repo's terms on its Hub page, then set HF_TOKEN or write the token to {}",
                hf_hub::hf_home().join("token").display()
            ),
            Some(src) => {
                format!("the token from {src} was refused: check that it is valid and has access to this repo")
            }
        }
    }
}

/// Where the token came from (`HF_TOKEN`, a file's path), for messages.
fn token_source() -> Option<String> {
    read_token().map(|(source, _)| source)
}

/// hf-hub's own token lookup (HF_TOKEN, HF_TOKEN_PATH, `$HF_HOME/token`): where the token came from, and the
/// token.
fn read_token() -> Option<(String, String)> {
    if env_flag("HF_HUB_DISABLE_IMPLICIT_TOKEN") {
        return None;
    }
    if let Some(token) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        return Some(("HF_TOKEN".into(), token));
    }
    let files =
        std::env::var("HF_TOKEN_PATH").ok().map(PathBuf::from).into_iter().chain([hf_hub::hf_home().join("token")]);
    for path in files {
        if let Some(token) = std::fs::read_to_string(&path).ok().filter(|t| !t.trim().is_empty()) {
            return Some((path.display().to_string(), token.trim().to_string()));
        }
    }
    None
}

pub struct Hub {
    config: HubConfig,
    client: Option<HFClientSync>,
    /// Where the token came from, and the token: read once, so that whoami and hf-hub's transfers use the same.
    token: Option<(String, String)>,
}

impl Hub {
    pub fn from_env() -> Result<Hub, HubError> {
        Hub::new(HubConfig::from_env())
    }

    pub fn new(config: HubConfig) -> Result<Hub, HubError> {
        let token = read_token();
        let client = if config.offline {
            None
        } else {
            // The token kiln found, handed over rather than looked up again: hf-hub reads
            // HF_HUB_DISABLE_IMPLICIT_TOKEN=0 as set, Python's huggingface_hub (and kiln) as not.
            let builder = match &token {
                Some((_, token)) => HFClientBuilder::new().token(token),
                None => HFClientBuilder::new(),
            };
            let client = builder
                .endpoint(config.endpoint.clone())
                .cache_dir(config.cache_dir.clone())
                .retry_max_attempts(config.retries.max(1))
                .retry_base_delay(Duration::from_millis(200))
                .user_agent(format!("kiln/{}", env!("CARGO_PKG_VERSION")))
                .build_sync()
                .map_err(|e| HubError::Setup(e.to_string()))?;
            Some(client)
        };
        Ok(Hub { config, client, token })
    }

    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    /// Downloads (or finds in the cache) the files of `spec` and records what was pulled.
    pub fn pull(&self, spec: &RepoSpec) -> Result<PulledRepo, HubError> {
        let patterns =
            Patterns { required: compile_patterns(&spec.files)?, optional: compile_patterns(&spec.optional_files)? };
        match &self.client {
            None => self.pull_from_cache(spec, &patterns),
            Some(client) => match spec.kind {
                RepoKind::Model => self.pull_online(client.model(owner(&spec.repo), name(&spec.repo)), spec, &patterns),
                RepoKind::Dataset => {
                    self.pull_online(client.dataset(owner(&spec.repo), name(&spec.repo)), spec, &patterns)
                }
            },
        }
    }

    fn pull_online<T: RepoType>(
        &self,
        repo: HFRepositorySync<T>,
        spec: &RepoSpec,
        patterns: &Patterns,
    ) -> Result<PulledRepo, HubError>
    where
        HFRepositorySync<T>: RepoInfo,
    {
        let (commit, listing) = match repo.commit_and_files(&spec.revision) {
            Ok(found) => found,
            // Hub unreachable: serve the pinned snapshot from the cache when it is there, as Python does.
            Err(e) if is_transport(&e) => {
                return self.pull_from_cache(spec, patterns).map_err(|cache_err| match cache_err {
                    HubError::NotCached { .. } => self.map_error(e, spec, None),
                    other => other,
                });
            }
            Err(e) => return Err(self.map_error(e, spec, None)),
        };
        let selected = select(spec, &listing, patterns)?;
        // hf-hub joins the commit and each file's path onto the cache folder as the server wrote them.
        let unsafe_answer = |what: String| HubError::Unsafe {
            kind: spec.kind,
            repo: spec.repo.clone(),
            revision: spec.revision.clone(),
            what,
        };
        if !is_commit_hash(&commit) {
            return Err(unsafe_answer(format!("commit '{commit}', which is not a commit hash")));
        }
        if let Some(path) = selected.iter().find(|p| !is_repo_relative(p)) {
            return Err(unsafe_answer(format!("the file path '{path}'")));
        }
        let bar = self.file_bar();
        let mut files = Vec::with_capacity(selected.len());
        let snapshot = self.config.cache_dir.join(repo_folder(spec.kind, &spec.repo)).join("snapshots").join(&commit);
        for path in selected {
            let cached = snapshot.join(&path).exists();
            let local = self.download(&repo, spec, &commit, &path, &bar)?;
            let announced = lfs_blob_sha256(&local);
            let file = describe_file(&path, &local, announced.clone().filter(|_| cached))?;
            if let Some(announced) = announced.filter(|name| *name != file.sha256) {
                // Removed so that the next pull downloads it again instead of trusting its name.
                if let Ok(blob) = std::fs::canonicalize(&local) {
                    let _ = std::fs::remove_file(blob);
                }
                let _ = std::fs::remove_file(&local);
                return Err(HubError::Corrupt {
                    kind: spec.kind,
                    repo: spec.repo.clone(),
                    revision: spec.revision.clone(),
                    file: path,
                    announced,
                    actual: file.sha256,
                });
            }
            files.push(file);
        }
        bar.finish_and_clear();
        // Python's snapshot_download records branch → commit the same way, so offline runs resolve it.
        if commit != spec.revision {
            let folder = self.config.cache_dir.join(repo_folder(spec.kind, &spec.repo));
            write_ref(&folder, &spec.revision, &commit)?;
        }
        Ok(self.record(spec, commit, false, files))
    }

    /// Downloads one file of `commit` into the cache. A transfer that breaks off (hf-hub retries only the
    /// request, not a body cut short) is taken up again, up to `retries` attempts in all, waiting longer each
    /// time; an LFS file goes on from the bytes it has (`go_on`), in this attempt or a later pull. Other
    /// failures are final.
    fn download<T: RepoType>(
        &self,
        repo: &HFRepositorySync<T>,
        spec: &RepoSpec,
        commit: &str,
        path: &str,
        bar: &ProgressBar,
    ) -> Result<PathBuf, HubError> {
        let attempts = self.config.retries.max(1);
        let mut attempt = 1;
        let folder = self.config.cache_dir.join(repo_folder(spec.kind, &spec.repo));
        loop {
            match self.fetch(repo, &folder, commit, path, bar) {
                Ok(local) => return Ok(local),
                Err(e) if is_transport(&e) && attempt < attempts => {
                    let wait = Duration::from_millis(500 << attempt.min(6));
                    let note = format!(
                        "  {path}: the transfer broke off ({}); taking it up again in {:.1} s (attempt {} of {attempts})",
                        describe(&e),
                        wait.as_secs_f64(),
                        attempt + 1
                    );
                    bar.suspend(|| eprintln!("{note}"));
                    std::thread::sleep(wait);
                    attempt += 1;
                }
                Err(e) => return Err(self.map_error(e, spec, Some(path))),
            }
        }
    }

    /// One attempt at `path` of the repo cached in `folder`: an LFS file (its blob named by its sha256, which
    /// the pull then checks) whose earlier transfer left `blobs/<sha256>.incomplete` goes on from there, over
    /// HTTP ranges or, for a Xet-stored file, ranged reconstructions (hf-hub's Xet client writes a blob in file
    /// order, so what it left is the file's start); anything else is hf-hub's download, which starts a file
    /// over.
    fn fetch<T: RepoType>(
        &self,
        repo: &HFRepositorySync<T>,
        folder: &Path,
        commit: &str,
        path: &str,
        bar: &ProgressBar,
    ) -> Result<PathBuf, HFError> {
        let download = || {
            repo.download_file()
                .filename(path.to_string())
                .revision(commit.to_string())
                .progress(BarHandler::new(bar.clone(), path))
                .send()
        };
        // Cached, or nothing left by a transfer to go on from: hf-hub's download alone (no HEAD of our own).
        let partials = std::fs::read_dir(folder.join("blobs"))
            .map(|entries| entries.flatten().any(|e| e.file_name().to_string_lossy().ends_with(".incomplete")))
            .unwrap_or(false);
        if folder.join("snapshots").join(commit).join(path).exists() || !partials {
            return download();
        }
        let meta = repo.get_file_metadata().filepath(path.to_string()).revision(commit).send()?;
        let lfs = meta.etag.len() == 64 && meta.etag.bytes().all(|b| b.is_ascii_hexdigit());
        let blob = folder.join("blobs").join(&meta.etag);
        let partial = PathBuf::from(format!("{}.incomplete", blob.display()));
        if !lfs || blob.exists() || !partial.is_file() {
            return download();
        }
        let lock = folder.join(".locks").join(format!("{}.lock", meta.etag));
        self.go_on(repo, commit, path, meta.file_size, &partial, &lock, bar)?;
        std::fs::rename(&partial, &blob)?;
        // The blob is complete: hf-hub finds it and links the snapshot's path to it, as for any cached file.
        download()
    }

    /// Appends the rest of `path` (`size` bytes in all) to `partial` by ranged requests of `resume_chunk`
    /// bytes, each written before the next is asked for, holding `lock` as hf-hub and Python do while they
    /// write a blob. A server that answers a range with the whole file has it written over from the start.
    #[allow(clippy::too_many_arguments)]
    fn go_on<T: RepoType>(
        &self,
        repo: &HFRepositorySync<T>,
        commit: &str,
        path: &str,
        size: u64,
        partial: &Path,
        lock: &Path,
        bar: &ProgressBar,
    ) -> Result<(), HFError> {
        if let Some(dir) = lock.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let lock = std::fs::File::create(lock)?;
        lock.lock()?;
        let mut file = std::fs::OpenOptions::new().append(true).open(partial)?;
        let mut have = file.metadata()?.len();
        if have > size {
            file.set_len(0)?;
            have = 0;
        }
        bar.set_message(path.to_string());
        bar.set_length(size);
        bar.set_position(have);
        bar.suspend(|| eprintln!("  {path}: going on from byte {have} of {size} (left by a transfer that broke off)"));
        while have < size {
            let end = (have + self.config.resume_chunk.max(1)).min(size);
            let bytes = repo
                .download_file_to_bytes()
                .filename(path.to_string())
                .revision(commit.to_string())
                .range(have..end)
                .send()?;
            match bytes.len() as u64 {
                n if n == end - have => {
                    file.write_all(&bytes)?;
                    have = end;
                }
                n if n == size => {
                    file.set_len(0)?;
                    file.write_all(&bytes)?;
                    have = size;
                }
                n => {
                    return Err(HFError::malformed_response(format!(
                        "{n} bytes for the range {have}..{end} of '{path}' ({size} bytes)"
                    )));
                }
            }
            file.flush()?;
            bar.set_position(have);
        }
        file.sync_all()?;
        Ok(())
    }

    /// Resolves `spec` from the standard cache layout only: refs/<revision> → snapshots/<commit>/….
    fn pull_from_cache(&self, spec: &RepoSpec, patterns: &Patterns) -> Result<PulledRepo, HubError> {
        let folder = self.config.cache_dir.join(repo_folder(spec.kind, &spec.repo));
        let not_cached = |file: String| HubError::NotCached {
            kind: spec.kind,
            repo: spec.repo.clone(),
            revision: spec.revision.clone(),
            file,
            cache: self.config.cache_dir.clone(),
        };
        let commit = if is_commit_hash(&spec.revision) {
            spec.revision.clone()
        } else {
            match std::fs::read_to_string(folder.join("refs").join(&spec.revision)) {
                Ok(c) => c.trim().to_string(),
                Err(_) => return Err(not_cached(String::new())),
            }
        };
        let snapshot = folder.join("snapshots").join(&commit);
        if !snapshot.is_dir() {
            return Err(not_cached(String::new()));
        }
        let mut listing = Vec::new();
        list_relative(&snapshot, &snapshot, &mut listing)
            .map_err(|e| HubError::Io { path: snapshot.clone(), source: e })?;
        listing.sort();
        let selected = select(spec, &listing, patterns).map_err(|e| match e {
            HubError::NoFilesMatch { pattern, .. } => not_cached(format!(", file '{pattern}'")),
            other => other,
        })?;
        let files = selected
            .iter()
            .map(|path| {
                let local = snapshot.join(path);
                describe_file(path, &local, lfs_blob_sha256(&local))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(self.record(spec, commit, true, files))
    }

    fn record(&self, spec: &RepoSpec, commit: String, from_cache: bool, files: Vec<PulledFile>) -> PulledRepo {
        PulledRepo {
            kind: spec.kind,
            repo: spec.repo.clone(),
            revision: spec.revision.clone(),
            commit,
            endpoint: self.config.endpoint.clone(),
            from_cache,
            files,
        }
    }

    fn file_bar(&self) -> ProgressBar {
        if !self.config.show_progress {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template("{msg:40!} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    }

    fn map_error(&self, err: HFError, spec: &RepoSpec, file: Option<&str>) -> HubError {
        let (kind, repo, revision) = (spec.kind, spec.repo.clone(), spec.revision.clone());
        let code = error_code(&err);
        let token_hint = self.config.token_hint();
        let file_note = file.map(|f| format!(", file '{f}'")).unwrap_or_default();
        match (&err, code.as_deref()) {
            (_, Some("GatedRepo")) => {
                HubError::AccessDenied { kind, repo, revision, token_hint: self.gated_hint(spec).unwrap_or(token_hint) }
            }
            (_, Some("RepoNotFound")) | (HFError::RepoNotFound { .. }, _) => {
                HubError::RepoNotFound { kind, repo, revision, endpoint: self.config.endpoint.clone(), token_hint }
            }
            (_, Some("RevisionNotFound")) => HubError::RevisionNotFound { kind, repo, revision },
            (_, Some("EntryNotFound")) | (HFError::EntryNotFound { .. }, _) => {
                HubError::FileNotFound { kind, repo, revision, file: file.unwrap_or_default().to_string() }
            }
            (HFError::RevisionNotFound { .. }, _) => HubError::RevisionNotFound { kind, repo, revision },
            (HFError::AuthRequired { .. } | HFError::Forbidden { .. }, _) => {
                HubError::AccessDenied { kind, repo, revision, token_hint }
            }
            _ => HubError::Network {
                kind,
                repo,
                revision,
                file: file_note,
                endpoint: self.config.endpoint.clone(),
                message: describe(&err),
            },
        }
    }

    /// What the token's account must do about a gated repo the Hub refused it, from whoami; `None` without a
    /// token, or where whoami does not answer.
    fn gated_hint(&self, spec: &RepoSpec) -> Option<String> {
        let (token_from, token) = self.token.as_ref()?;
        let account = self.whoami(token, token_from, &spec.repo).ok()?;
        let folder = if spec.kind == RepoKind::Dataset { "datasets/" } else { "" };
        let page = format!("{}/{folder}{}", self.config.endpoint, spec.repo);
        Some(account.gated_advice(&spec.repo, &page, token_from))
    }
}

/// Repo metadata the pull needs, over hf-hub's per-kind `info` builders.
pub trait RepoInfo {
    fn commit_and_files(&self, revision: &str) -> Result<(String, Vec<String>), HFError>;
}

macro_rules! repo_info {
    ($kind:ty) => {
        impl RepoInfo for HFRepositorySync<$kind> {
            fn commit_and_files(&self, revision: &str) -> Result<(String, Vec<String>), HFError> {
                let info = self.info().revision(revision.to_string()).send()?;
                let commit = info.sha.unwrap_or_else(|| revision.to_string());
                let files = info.siblings.unwrap_or_default().into_iter().map(|s| s.rfilename).collect();
                Ok((commit, files))
            }
        }
    };
}
repo_info!(hf_hub::RepoTypeModel);
repo_info!(hf_hub::RepoTypeDataset);

fn owner(repo: &str) -> &str {
    hf_hub::split_id(repo).0
}

fn name(repo: &str) -> &str {
    hf_hub::split_id(repo).1
}

/// The Hub's machine-readable error code (`X-Error-Code`: RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo).
fn error_code(err: &HFError) -> Option<String> {
    let ctx = match err {
        HFError::Http { context } | HFError::AuthRequired { context } | HFError::Forbidden { context } => {
            Some(context.as_ref())
        }
        HFError::RepoNotFound { context, .. }
        | HFError::RevisionNotFound { context, .. }
        | HFError::EntryNotFound { context, .. } => context.as_deref(),
        _ => None,
    }?;
    ctx.error_code.clone()
}

fn is_transport(err: &HFError) -> bool {
    matches!(err, HFError::Request { .. })
}

/// An hf-hub error in one line with its causes (a transport error's URL said once).
fn describe(err: &HFError) -> String {
    match err {
        HFError::Request { source, .. } => crate::errors::chain(source),
        other => crate::errors::chain(other),
    }
}

pub fn compile_patterns(patterns: &[String]) -> Result<Vec<(String, GlobSet)>, HubError> {
    patterns
        .iter()
        .map(|p| {
            let glob = globset::GlobBuilder::new(p)
                .literal_separator(true)
                .build()
                .map_err(|e| HubError::BadPattern { pattern: p.clone(), message: e.to_string() })?;
            let set = GlobSetBuilder::new()
                .add(glob)
                .build()
                .map_err(|e| HubError::BadPattern { pattern: p.clone(), message: e.to_string() })?;
            Ok((p.clone(), set))
        })
        .collect()
}

/// Required and optional globs of one pull.
pub struct Patterns {
    required: Vec<(String, GlobSet)>,
    optional: Vec<(String, GlobSet)>,
}

/// Files of `listing` matched by any pattern (all files when there are none), in listing order.
/// Every required pattern must match something: one that matches nothing is a mistake worth stopping for.
fn select(spec: &RepoSpec, listing: &[String], patterns: &Patterns) -> Result<Vec<String>, HubError> {
    if patterns.required.is_empty() && patterns.optional.is_empty() {
        return Ok(listing.to_vec());
    }
    for (pattern, set) in &patterns.required {
        if !listing.iter().any(|f| set.is_match(f)) {
            let examples: Vec<_> = listing.iter().take(5).cloned().collect();
            return Err(HubError::NoFilesMatch {
                kind: spec.kind,
                repo: spec.repo.clone(),
                revision: spec.revision.clone(),
                pattern: pattern.clone(),
                count: listing.len(),
                examples: if examples.is_empty() { "none".into() } else { examples.join(", ") },
            });
        }
    }
    let all = patterns.required.iter().chain(&patterns.optional);
    let wanted: Vec<&GlobSet> = all.map(|(_, s)| s).collect();
    Ok(listing.iter().filter(|f| wanted.iter().any(|s| s.is_match(f.as_str()))).cloned().collect())
}

/// `datasets--owner--name`, the cache folder name shared with Python's huggingface_hub.
pub fn repo_folder(kind: RepoKind, repo: &str) -> String {
    format!("{}--{}", kind.plural(), repo.replace('/', "--"))
}

/// Whether `path` names a file inside a repository: relative, `/`-separated, no empty, `.` or `..` part.
pub fn is_repo_relative(path: &str) -> bool {
    !path.contains('\\') && path.split('/').all(|part| !matches!(part, "" | "." | ".."))
}

/// Whether `id` is a Hub repo id as the Hub accepts one: `owner/name`, each part of letters, digits, `-`, `_`
/// and `.`, neither starting nor ending with `-` or `.`, without `--` or `..`, the name at most 96 long.
pub fn is_repo_id(id: &str) -> bool {
    let part_ok = |part: &str| {
        !part.is_empty()
            && part.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && !part.starts_with(['-', '.'])
            && !part.ends_with(['-', '.'])
            && !part.contains("--")
            && !part.contains("..")
    };
    matches!(id.split_once('/'), Some((owner, name)) if part_ok(owner) && part_ok(name) && name.len() <= 96)
}

pub fn is_commit_hash(revision: &str) -> bool {
    revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())
}

fn write_ref(folder: &Path, revision: &str, commit: &str) -> Result<(), HubError> {
    let path = folder.join("refs").join(revision);
    let io = |source| HubError::Io { path: path.clone(), source };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    std::fs::write(&path, commit).map_err(io)
}

fn list_relative(root: &Path, dir: &Path, out: &mut Vec<String>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            list_relative(root, &path, out)?;
        } else if let Ok(rel) = path.strip_prefix(root) {
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
    Ok(())
}

/// Size and sha256 of a cached file: `trusted`, where given, or else its hash. A cache hit's LFS blob is
/// trusted by its name, the sha256 the Hub announced, as Python's huggingface_hub does (a 16 GB checkpoint
/// would be read again on every pull); a fresh download is hashed so the caller can hold it to that name.
fn describe_file(path: &str, local: &Path, trusted: Option<String>) -> Result<PulledFile, HubError> {
    let io = |source| HubError::Io { path: local.to_path_buf(), source };
    let size = std::fs::metadata(local).map_err(io)?.len();
    let sha256 = match trusted {
        Some(name) => name,
        None => sha256_file(local).map_err(io)?,
    };
    Ok(PulledFile { path: path.to_string(), local: local.to_path_buf(), size, sha256 })
}

/// The sha256 an LFS file's cache blob is named by (its ETag); None for git-tracked files.
fn lfs_blob_sha256(local: &Path) -> Option<String> {
    let blob = std::fs::canonicalize(local).ok()?;
    let name = blob.file_name()?.to_string_lossy().into_owned();
    (name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit())).then_some(name)
}

pub fn sha256_bytes(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(hex::encode(hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

/// Feeds hf-hub's download events into one indicatif bar, one file at a time.
struct BarHandler {
    bar: ProgressBar,
    started: Mutex<bool>,
}

impl BarHandler {
    fn new(bar: ProgressBar, file: &str) -> Self {
        bar.set_message(file.to_string());
        bar.set_position(0);
        BarHandler { bar, started: Mutex::new(false) }
    }
}

impl ProgressHandler for BarHandler {
    fn on_progress(&self, event: &ProgressEvent) {
        let ProgressEvent::Download(event) = event else { return };
        match event {
            DownloadEvent::Start { total_bytes, .. } => {
                self.bar.set_length(*total_bytes);
                if let Ok(mut started) = self.started.lock() {
                    *started = true;
                }
            }
            DownloadEvent::Progress { files } => {
                if let Some(f) = files.last() {
                    self.bar.set_position(f.bytes_completed);
                }
            }
            DownloadEvent::AggregateProgress { bytes_completed, .. } => self.bar.set_position(*bytes_completed),
            DownloadEvent::Complete => {
                let len = self.bar.length().unwrap_or(0);
                self.bar.set_position(len);
                self.bar.println(format!("  pulled {} ({})", self.bar.message(), indicatif::HumanBytes(len)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(files: &[&str]) -> RepoSpec {
        RepoSpec {
            kind: RepoKind::Dataset,
            repo: "o/r".into(),
            revision: "main".into(),
            files: files.iter().map(|s| s.to_string()).collect(),
            optional_files: vec![],
        }
    }

    fn patterns(s: &RepoSpec) -> Patterns {
        Patterns {
            required: compile_patterns(&s.files).unwrap(),
            optional: compile_patterns(&s.optional_files).unwrap(),
        }
    }

    #[test]
    fn repo_ids_are_owner_and_name() {
        for good in ["LiquidAI/LFM2-350M", "me/tiny_sft.v2", "a/b"] {
            assert!(is_repo_id(good), "{good}");
        }
        for bad in ["", "tiny", "a/b/c", "/b", "a/", "a/-b", "a/b.", "a/b--c", "a/b..c", "a b/c", "a/ü"] {
            assert!(!is_repo_id(bad), "{bad}");
        }
        assert!(!is_repo_id(&format!("a/{}", "x".repeat(97))));
    }

    #[test]
    fn repo_paths_stay_inside_the_repository() {
        for inside in ["config.json", "data/train-00000-of-00001.parquet", "a/b/.hidden", "..x/y..z"] {
            assert!(is_repo_relative(inside), "{inside}");
        }
        for outside in ["", "/etc/passwd", "../x", "data/../../x", "a//b", "./x", "a/.", "a\\..\\b", "a/"] {
            assert!(!is_repo_relative(outside), "{outside}");
        }
    }

    #[test]
    fn globs_select_within_folders() {
        let listing: Vec<String> =
            ["README.md", "data/train-0.parquet", "data/sub/x.parquet", "skill_based_easy/a.parquet"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        let s = spec(&["data/*.parquet"]);
        let pats = patterns(&s);
        assert_eq!(select(&s, &listing, &pats).unwrap(), ["data/train-0.parquet"]);
        let s = spec(&["**/*.parquet"]);
        let pats = patterns(&s);
        assert_eq!(select(&s, &listing, &pats).unwrap().len(), 3);
        let mut s = spec(&["data/*.jsonl"]);
        let err = select(&s, &listing, &patterns(&s)).unwrap_err().to_string();
        assert!(err.contains("'data/*.jsonl' matches no file") && err.contains("README.md"), "{err}");
        s.files = vec!["README.md".into()];
        s.optional_files = vec!["*.jinja".into(), "data/*.parquet".into()];
        assert_eq!(select(&s, &listing, &patterns(&s)).unwrap(), ["README.md", "data/train-0.parquet"]);
    }

    #[test]
    fn cache_folder_names_match_python() {
        assert_eq!(
            repo_folder(RepoKind::Dataset, "gyung/LFM2-Terminal-SFT-Processed"),
            "datasets--gyung--LFM2-Terminal-SFT-Processed"
        );
        assert_eq!(repo_folder(RepoKind::Model, "LiquidAI/LFM2-350M"), "models--LiquidAI--LFM2-350M");
        assert!(is_commit_hash("0123456789abcdef0123456789abcdef01234567"));
        assert!(!is_commit_hash("main"));
    }
}
