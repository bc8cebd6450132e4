//! `kiln pull` against a loopback server answering the Hub's routes: download, revision pinning, cache
//! reuse without network, offline mode, gated repos, and the failures a user must be able to act on.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{FakeHub, FakeRepo, Tree, project_dir, run_kiln, sha};
use kiln::hub::{Hub, HubConfig, HubError, RepoKind, RepoSpec};
use serde_json::Value;

const TERMINAL: &str = "gyung/LFM2-Terminal-SFT-Processed";

fn terminal_parquet() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.parquet");
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(1);
    let convs: Vec<_> = (0..5)
        .map(|i| kiln::synth::terminal::task(&mut rng, i).conversation(&format!("c{i}"), &format!("task_{i}")))
        .collect();
    kiln::synth::write_terminal_parquet(&path, &convs).unwrap();
    std::fs::read(path).unwrap()
}

fn tree(files: &[(&str, &[u8])]) -> Tree {
    files.iter().map(|(p, b)| (p.to_string(), b.to_vec())).collect()
}

/// A terminal dataset (main → commit B; tag v1 → commit A with other data) and a small model repo.
fn hub_repos() -> BTreeMap<(String, String), FakeRepo> {
    let parquet = terminal_parquet();
    let mut terminal = FakeRepo::default();
    terminal.commits.insert(
        sha("A"),
        tree(&[("README.md", b"v1"), ("data/train-00000-of-00001.parquet", b"old bytes, not parquet")]),
    );
    terminal.commits.insert(
        sha("B"),
        tree(&[("README.md", b"card"), ("data/train-00000-of-00001.parquet", &parquet), ("extra/notes.txt", b"x")]),
    );
    terminal.refs.insert("main".into(), sha("B"));
    terminal.refs.insert("v1".into(), sha("A"));

    let mut model = FakeRepo::single(
        &sha("M"),
        tree(&[
            ("config.json", b"{\"model_type\": \"lfm2\"}"),
            ("model.safetensors", b"weights"),
            ("tokenizer.json", b"{}"),
        ]),
    );
    model.broken.push("tokenizer.json".into());
    let gated = {
        let mut r = FakeRepo::single(&sha("G"), tree(&[("config.json", b"{}")]));
        r.gated_token = Some("hf_secret".into());
        r
    };
    let mut repos = BTreeMap::new();
    repos.insert(("datasets".to_string(), TERMINAL.to_string()), terminal);
    repos.insert(("models".to_string(), "LiquidAI/LFM2-350M".to_string()), model);
    repos.insert(("models".to_string(), "google/gated-model".to_string()), gated);
    repos
}

fn config(endpoint: &str, cache: &Path, offline: bool) -> HubConfig {
    HubConfig {
        endpoint: endpoint.to_string(),
        cache_dir: cache.to_path_buf(),
        offline,
        token_source: None,
        show_progress: false,
        retries: 1,
    }
}

fn dataset_spec(revision: &str, files: &[&str]) -> RepoSpec {
    RepoSpec {
        kind: RepoKind::Dataset,
        repo: TERMINAL.into(),
        revision: revision.into(),
        files: files.iter().map(|s| s.to_string()).collect(),
        optional_files: vec![],
    }
}

#[test]
fn downloads_into_the_standard_cache_and_records_commit_and_hashes() {
    let server = FakeHub::start(hub_repos());
    let cache = tempfile::tempdir().unwrap();
    let hub = Hub::new(config(&server.url, cache.path(), false)).unwrap();
    let pulled = hub.pull(&dataset_spec("main", &["data/*.parquet"])).unwrap();
    assert_eq!(pulled.commit, sha("B"));
    assert!(!pulled.from_cache);
    assert_eq!(pulled.files.len(), 1, "only the glob's files");
    let file = &pulled.files[0];
    let folder = cache.path().join("datasets--gyung--LFM2-Terminal-SFT-Processed");
    assert_eq!(file.local, folder.join("snapshots").join(sha("B")).join("data/train-00000-of-00001.parquet"));
    let bytes = std::fs::read(&file.local).unwrap();
    assert_eq!(bytes, terminal_parquet());
    assert_eq!(file.sha256, kiln::hub::sha256_file(&file.local).unwrap());
    assert_eq!(std::fs::read_to_string(folder.join("refs/main")).unwrap(), sha("B"));
    // Blobs are content-addressed, so Python tools sharing the cache find the same file.
    assert!(std::fs::canonicalize(&file.local).unwrap().starts_with(folder.join("blobs")));
}

#[test]
fn a_tag_or_commit_pins_the_revision() {
    let server = FakeHub::start(hub_repos());
    let cache = tempfile::tempdir().unwrap();
    let hub = Hub::new(config(&server.url, cache.path(), false)).unwrap();
    let by_tag = hub.pull(&dataset_spec("v1", &["data/*.parquet"])).unwrap();
    assert_eq!(by_tag.commit, sha("A"));
    assert_eq!(std::fs::read(&by_tag.files[0].local).unwrap(), b"old bytes, not parquet");
    let by_sha = hub.pull(&dataset_spec(&sha("A"), &["README.md"])).unwrap();
    assert_eq!(by_sha.commit, sha("A"));
    assert_eq!(std::fs::read(&by_sha.files[0].local).unwrap(), b"v1");
}

#[test]
fn the_cache_serves_when_the_hub_is_gone_and_in_offline_mode() {
    let cache = tempfile::tempdir().unwrap();
    let first = {
        let server = FakeHub::start(hub_repos());
        let hub = Hub::new(config(&server.url, cache.path(), false)).unwrap();
        hub.pull(&dataset_spec("main", &["data/*.parquet"])).unwrap()
    };
    // The server is gone: the same pull falls back to the cached snapshot.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let hub = Hub::new(config(&dead, cache.path(), false)).unwrap();
    let again = hub.pull(&dataset_spec("main", &["data/*.parquet"])).unwrap();
    assert!(again.from_cache);
    assert_eq!(again.files, first.files);

    let offline = Hub::new(config(&dead, cache.path(), true)).unwrap();
    let cached = offline.pull(&dataset_spec("main", &["data/*.parquet"])).unwrap();
    assert_eq!((cached.commit.as_str(), cached.from_cache), (sha("B").as_str(), true));
    assert_eq!(cached.files, first.files);

    let missing = offline.pull(&dataset_spec("main", &["extra/*.txt"])).unwrap_err().to_string();
    assert!(missing.contains("offline") && missing.contains("extra/*.txt") && missing.contains(TERMINAL), "{missing}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn failures_name_repo_revision_and_file() {
    let server = FakeHub::start(hub_repos());
    let cache = tempfile::tempdir().unwrap();
    let hub = Hub::new(config(&server.url, cache.path(), false)).unwrap();

    let err = hub.pull(&dataset_spec("no-such-branch", &["data/*.parquet"])).unwrap_err();
    assert!(matches!(err, HubError::RevisionNotFound { .. }), "{err}");
    assert!(err.to_string().contains("no-such-branch") && err.to_string().contains(TERMINAL));

    let err = hub.pull(&dataset_spec("v1", &["extra/*.txt"])).unwrap_err();
    assert!(matches!(err, HubError::NoFilesMatch { .. }), "{err}");
    assert!(err.to_string().contains("extra/*.txt") && err.to_string().contains("'v1'"), "{err}");

    let mut unknown = dataset_spec("main", &["*"]);
    unknown.repo = "nobody/nothing".into();
    let err = hub.pull(&unknown).unwrap_err();
    assert!(matches!(err, HubError::RepoNotFound { .. }), "{err}");
    assert!(err.to_string().contains("nobody/nothing"));

    let model = RepoSpec {
        kind: RepoKind::Model,
        repo: "LiquidAI/LFM2-350M".into(),
        revision: "main".into(),
        files: vec!["tokenizer.json".into()],
        optional_files: vec![],
    };
    let err = hub.pull(&model).unwrap_err();
    assert!(matches!(err, HubError::FileNotFound { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json") && err.to_string().contains("LiquidAI/LFM2-350M"), "{err}");

    let gated = RepoSpec { repo: "google/gated-model".into(), files: vec!["config.json".into()], ..model };
    let err = hub.pull(&gated).unwrap_err();
    assert!(matches!(err, HubError::AccessDenied { .. }), "{err}");
    assert!(err.to_string().contains("HF_TOKEN"), "{err}");
}

#[test]
fn kiln_pull_dataset_downloads_then_reruns_from_cache_and_fails_clearly_offline() {
    let server = FakeHub::start(hub_repos());
    let home = tempfile::tempdir().unwrap();
    let home_str = home.path().to_str().unwrap();
    let datasets = project_dir().join("datasets");
    let datasets_str = datasets.to_str().unwrap();
    let out = home.path().join("pull.json");
    let env = [("HF_ENDPOINT", server.url.as_str()), ("HF_HOME", home_str)];
    let args =
        ["--quiet", "--datasets-dir", datasets_str, "pull", "--dataset", "terminal", "--out", out.to_str().unwrap()];

    let (ok, _, stderr) = run_kiln(&args, &env, home.path());
    assert!(ok, "{stderr}");
    let record: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(record[0]["commit"], sha("B"));
    assert_eq!(record[0]["from_cache"], false);
    assert_eq!(record[0]["files"][0]["path"], "data/train-00000-of-00001.parquet");
    let served = server.requests.load(std::sync::atomic::Ordering::SeqCst);

    // Offline: served from the cache alone, without a single request.
    let offline = [("HF_ENDPOINT", server.url.as_str()), ("HF_HOME", home_str), ("HF_HUB_OFFLINE", "1")];
    let (ok, _, stderr) = run_kiln(&args, &offline, home.path());
    assert!(ok, "{stderr}");
    assert!(stderr.contains("from cache"), "{stderr}");
    assert_eq!(server.requests.load(std::sync::atomic::Ordering::SeqCst), served);
    let again: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(again[0]["files"], record[0]["files"]);

    // Offline with an empty cache: one clear message naming repo, revision and what to do.
    let empty = tempfile::tempdir().unwrap();
    let offline_empty = [("HF_HOME", empty.path().to_str().unwrap()), ("HF_HUB_OFFLINE", "1")];
    let (ok, _, stderr) = run_kiln(&args, &offline_empty, home.path());
    assert!(!ok);
    assert!(stderr.contains(TERMINAL) && stderr.contains("'main'") && stderr.contains("HF_HUB_OFFLINE"), "{stderr}");

    // A gated model: refused without a token, pulled with one.
    let gated = ["--quiet", "pull", "--model", "google/gated-model"];
    let (ok, _, stderr) = run_kiln(&gated, &env, home.path());
    assert!(!ok && stderr.contains("gated") && stderr.contains("HF_TOKEN"), "{stderr}");
    let with_token = [("HF_ENDPOINT", server.url.as_str()), ("HF_HOME", home_str), ("HF_TOKEN", "hf_secret")];
    let (ok, stdout, stderr) = run_kiln(&gated, &with_token, home.path());
    assert!(ok, "{stderr}");
    assert!(stdout.contains("config.json"));
}

#[test]
fn model_pulls_take_the_optional_files_the_repo_has() {
    let mut repos = hub_repos();
    repos.get_mut(&("models".to_string(), "LiquidAI/LFM2-350M".to_string())).unwrap().broken.clear();
    let server = FakeHub::start(repos);
    let home = tempfile::tempdir().unwrap();
    let env = [("HF_ENDPOINT", server.url.as_str()), ("HF_HOME", home.path().to_str().unwrap())];
    let (ok, stdout, stderr) = run_kiln(&["--quiet", "pull", "--model", "LiquidAI/LFM2-350M"], &env, home.path());
    assert!(ok, "{stderr}");
    let record: Value = serde_json::from_str(&stdout).unwrap();
    let files: Vec<&str> = record[0]["files"].as_array().unwrap().iter().map(|f| f["path"].as_str().unwrap()).collect();
    assert_eq!(files, ["config.json", "model.safetensors", "tokenizer.json"]);
}

#[test]
fn files_already_in_a_python_populated_cache_are_not_downloaded_again() {
    let server = FakeHub::start(hub_repos());
    let cache = tempfile::tempdir().unwrap();
    // The layout huggingface_hub writes: blobs/<etag>, snapshots/<commit>/<path> → ../../blobs/<etag>, refs/main.
    let folder = cache.path().join("datasets--gyung--LFM2-Terminal-SFT-Processed");
    let bytes = terminal_parquet();
    let etag = kiln::hub::sha256_bytes(&bytes);
    std::fs::create_dir_all(folder.join("blobs")).unwrap();
    std::fs::write(folder.join("blobs").join(&etag), &bytes).unwrap();
    let snapshot = folder.join("snapshots").join(sha("B")).join("data");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::os::unix::fs::symlink(format!("../../../blobs/{etag}"), snapshot.join("train-00000-of-00001.parquet"))
        .unwrap();
    std::fs::create_dir_all(folder.join("refs")).unwrap();
    std::fs::write(folder.join("refs/main"), sha("B")).unwrap();

    let hub = Hub::new(config(&server.url, cache.path(), false)).unwrap();
    let pulled = hub.pull(&dataset_spec("main", &["data/*.parquet"])).unwrap();
    assert_eq!(pulled.files[0].sha256, etag);
    // One request: the revision lookup. The file itself came from the cache.
    assert_eq!(server.requests.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A Hub (or a mirror behind HF_ENDPOINT) that answers a file path or a commit leaving the repository is
/// refused before anything is downloaded: those names become paths under the cache.
#[test]
fn paths_and_commits_that_leave_the_cache_are_refused() {
    let escape = "../../../../escape.txt";
    let mut repos = BTreeMap::new();
    repos.insert(
        ("models".to_string(), "evil/paths".to_string()),
        FakeRepo::single(&sha("P"), tree(&[("config.json", b"{}"), (escape, b"x")])),
    );
    repos.insert(
        ("models".to_string(), "evil/commit".to_string()),
        FakeRepo::single("../../../outside", tree(&[("config.json", b"{}")])),
    );
    let server = FakeHub::start(repos);
    let root = tempfile::tempdir().unwrap();
    let cache = root.path().join("cache");
    let hub = Hub::new(config(&server.url, &cache, false)).unwrap();
    let spec = |repo: &str| RepoSpec {
        kind: RepoKind::Model,
        repo: repo.into(),
        revision: "main".into(),
        files: vec![],
        optional_files: vec![],
    };
    let err = hub.pull(&spec("evil/paths")).unwrap_err();
    assert!(matches!(err, HubError::Unsafe { .. }) && err.to_string().contains(escape), "{err}");
    let err = hub.pull(&spec("evil/commit")).unwrap_err();
    assert!(matches!(err, HubError::Unsafe { .. }) && err.to_string().contains("../../../outside"), "{err}");
    let left: Vec<_> = std::fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.iter().all(|name| name == "cache"), "written outside the cache: {left:?}");
    // Nothing was downloaded: the only requests were the two revision lookups.
    assert_eq!(server.requests.load(std::sync::atomic::Ordering::SeqCst), 2);
}

#[test]
fn a_download_that_differs_from_its_announced_sha256_is_removed_and_refused() {
    use sha2::Digest;
    let mut repos = hub_repos();
    let key = ("datasets".to_string(), TERMINAL.to_string());
    repos.get_mut(&key).unwrap().corrupt.push("data/train-00000-of-00001.parquet".into());
    let server = FakeHub::start(repos.clone());
    let cache = tempfile::tempdir().unwrap();
    let hub = Hub::new(config(&server.url, cache.path(), false)).unwrap();
    let spec = dataset_spec("main", &["data/*.parquet"]);
    let err = hub.pull(&spec).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, HubError::Corrupt { .. }), "{text}");
    let repo = &repos[&key];
    let want =
        hex::encode(sha2::Sha256::digest(&repo.commits[&repo.refs["main"]]["data/train-00000-of-00001.parquet"]));
    assert!(text.contains("data/train-00000-of-00001.parquet") && text.contains(&want), "{text}");
    for entry in walk(cache.path()) {
        let name = entry.file_name().unwrap().to_string_lossy().into_owned();
        assert!(!name.ends_with(".parquet") && name != want, "left in the cache: {}", entry.display());
    }
    drop(server);

    // The Hub serves it right again: the next pull downloads it instead of trusting what was left.
    repos.get_mut(&key).unwrap().corrupt.clear();
    let server = FakeHub::start(repos);
    let hub = Hub::new(config(&server.url, cache.path(), false)).unwrap();
    let pulled = hub.pull(&spec).unwrap();
    assert_eq!(pulled.files[0].sha256, want);
    assert_eq!(kiln::hub::sha256_file(&pulled.files[0].local).unwrap(), want);
}

/// A transfer that breaks off midway is downloaded again while attempts remain (`retries`), and the pull
/// ends with the whole file; with no attempt to spare it fails, naming the file.
#[test]
fn a_transfer_that_breaks_off_is_downloaded_again() {
    use sha2::Digest;
    let mut repos = hub_repos();
    let key = ("datasets".to_string(), TERMINAL.to_string());
    let file = "data/train-00000-of-00001.parquet";
    repos.get_mut(&key).unwrap().cut_short.insert(file.into(), 1);
    let cache = tempfile::tempdir().unwrap();
    let spec = dataset_spec("main", &["data/*.parquet"]);
    let server = FakeHub::start(repos.clone());
    let err = Hub::new(config(&server.url, cache.path(), false)).unwrap().pull(&spec).unwrap_err();
    assert!(matches!(err, HubError::Network { .. }) && err.to_string().contains(file), "{err}");
    drop(server);

    let server = FakeHub::start(repos.clone());
    let hub = Hub::new(HubConfig { retries: 2, ..config(&server.url, cache.path(), false) }).unwrap();
    let pulled = hub.pull(&spec).unwrap();
    let requests = server.requests.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(requests, 5, "the revision, then the file's HEAD and GET twice");
    let repo = &repos[&key];
    let want = hex::encode(sha2::Sha256::digest(&repo.commits[&repo.refs["main"]][file]));
    assert_eq!(pulled.files[0].sha256, want);
    assert_eq!(kiln::hub::sha256_file(&pulled.files[0].local).unwrap(), want);
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() && !path.is_symlink() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}
