//! `kiln pull` and `kiln push` against a loopback server answering the Hub's routes: download (over HTTP or
//! a loopback Xet CAS), revision pinning, cache reuse without network, offline mode, gated repos; an upload as
//! one commit that creates the repo or branch and deletes stale weights; and the failures a user must be able
//! to act on.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{
    FINE_TOKEN, FakeHub, FakeRepo, READ_TOKEN, Tree, UNSTATED_TOKEN, WRITE_TOKEN, project_dir, run_kiln, sha,
};
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
        resume_chunk: 64 << 20,
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
    // With a token the Hub refused there, whoami says which account must accept the terms, or which grant a
    // fine-grained token lacks.
    let page = format!("{}/google/gated-model", server.url);
    for (token, says) in [
        (
            WRITE_TOKEN,
            "the token from HF_TOKEN belongs to 'kiln-tester', who has no access to it yet: accept its terms",
        ),
        (FINE_TOKEN, "the token from HF_TOKEN is a fine-grained token of 'kiln-tester' that may not read gated repos"),
    ] {
        let refused = [("HF_ENDPOINT", server.url.as_str()), ("HF_HOME", home_str), ("HF_TOKEN", token)];
        let (ok, _, stderr) = run_kiln(&gated, &refused, home.path());
        assert!(!ok && stderr.contains(says), "{stderr}");
        assert!(stderr.contains(&format!("on {page} signed in as 'kiln-tester'")), "{stderr}");
    }
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

/// A Hub that cannot be reached: the error names the endpoint, the URL once, and the cause a user acts on.
#[test]
fn an_unreachable_hub_is_named_with_the_cause() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let cache = tempfile::tempdir().unwrap();
    let hub = Hub::new(HubConfig { retries: 1, ..config(&url, cache.path(), false) }).unwrap();
    let text = hub.pull(&dataset_spec("main", &["*"])).unwrap_err().to_string();
    assert!(text.contains(&format!("could not reach the Hub at {url}")), "{text}");
    assert!(text.ends_with("tcp connect error: Connection refused (os error 111)"), "{text}");
    assert_eq!(text.matches("/revision/main").count(), 1, "the URL said once: {text}");
}

/// A transfer that breaks off midway leaves `blobs/<sha256>.incomplete` with the bytes it got, and the next
/// attempt (in the same pull while `retries` last, or a later pull) asks only for the rest, in ranges of
/// `resume_chunk` bytes; a server that answers a range with the whole file has it written over; bytes that
/// are not the file's start end as a refused sha256. With no attempt to spare the pull fails, naming the file.
#[test]
fn a_transfer_that_breaks_off_goes_on_from_the_bytes_it_has() {
    use sha2::Digest;
    let key = ("datasets".to_string(), TERMINAL.to_string());
    let file = "data/train-00000-of-00001.parquet";
    let repos = hub_repos();
    let bytes = repos[&key].commits[&repos[&key].refs["main"]][file].clone();
    let (want, size, half) = (hex::encode(sha2::Sha256::digest(&bytes)), bytes.len(), bytes.len() / 2);
    let spec = dataset_spec("main", &["data/*.parquet"]);
    let with = |cut: usize, ignores_range: bool| {
        let mut repos = hub_repos();
        let repo = repos.get_mut(&key).unwrap();
        repo.cut_short.insert(file.into(), cut);
        repo.ignores_range = ignores_range;
        FakeHub::start(repos)
    };
    let asked = |server: &FakeHub| server.repos.lock().unwrap()[&key].ranges_asked.clone();
    let pull = |server: &FakeHub, cache: &Path, retries: usize, resume_chunk: u64| {
        let hub = Hub::new(HubConfig { retries, resume_chunk, ..config(&server.url, cache, false) }).unwrap();
        hub.pull(&spec).map_err(Box::new)
    };
    let check = |pulled: kiln::hub::PulledRepo| {
        assert_eq!(pulled.files[0].sha256, want);
        assert_eq!(kiln::hub::sha256_file(&pulled.files[0].local).unwrap(), want);
    };
    let blobs = |cache: &Path| cache.join("datasets--gyung--LFM2-Terminal-SFT-Processed/blobs");

    // Stopped with no attempt to spare: the bytes received stay; the next pull asks for the rest alone.
    let cache = tempfile::tempdir().unwrap();
    let server = with(1, false);
    let err = pull(&server, cache.path(), 1, 64 << 20).unwrap_err();
    assert!(matches!(*err, HubError::Network { .. }) && err.to_string().contains(file), "{err}");
    let partial = blobs(cache.path()).join(format!("{want}.incomplete"));
    assert_eq!(std::fs::read(&partial).unwrap(), bytes[..half], "the first half, as received");
    drop(server);
    let server = with(0, false);
    check(pull(&server, cache.path(), 1, 64 << 20).unwrap());
    assert_eq!(asked(&server), [format!("bytes={half}-{}", size - 1)]);
    assert!(!partial.exists());

    // Within one pull: the second attempt goes on from the first one's bytes, in ranges of 1,000 bytes.
    let cache = tempfile::tempdir().unwrap();
    let server = with(1, false);
    check(pull(&server, cache.path(), 2, 1000).unwrap());
    let ranges: Vec<String> =
        (half..size).step_by(1000).map(|first| format!("bytes={first}-{}", (first + 999).min(size - 1))).collect();
    assert!(ranges.len() > 1);
    assert_eq!(asked(&server), ranges);

    // A server without ranges answers with the whole file, which is written from the start.
    let cache = tempfile::tempdir().unwrap();
    let server = with(1, true);
    check(pull(&server, cache.path(), 2, 64 << 20).unwrap());
    assert_eq!(asked(&server), [format!("bytes={half}-{}", size - 1)]);

    // Bytes left there that are not the file's start: the completed file's sha256 is refused and removed,
    // and the next pull downloads it whole.
    let cache = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(blobs(cache.path())).unwrap();
    std::fs::write(blobs(cache.path()).join(format!("{want}.incomplete")), vec![b'x'; half]).unwrap();
    let server = with(0, false);
    let err = pull(&server, cache.path(), 1, 64 << 20).unwrap_err();
    assert!(matches!(*err, HubError::Corrupt { .. }), "{err}");
    assert_eq!(std::fs::read_dir(blobs(cache.path())).unwrap().count(), 0, "nothing of it is left");
    check(pull(&server, cache.path(), 1, 64 << 20).unwrap());
}

/// A Xet-stored file comes through hf-hub's Xet client (the loopback CAS: a token, a reconstruction, the
/// xorb's chunks; the loopback Hub refuses to serve its bytes at the resolve URL). A transfer the CAS breaks off leaves the file's
/// start in the blob's `.incomplete` (the client writes in file order), and the next pull reconstructs the rest
/// alone; bytes there that are not the file's start end as a refused sha256. Through `kiln pull`, with
/// `HF_HOME` (and so Xet's own cache) in a temporary folder.
#[test]
fn a_xet_stored_file_is_pulled_through_the_cas_and_goes_on_from_a_partial_blob() {
    use sha2::Digest;
    let repo = "kiln-org/xet-model";
    let key = ("models".to_string(), repo.to_string());
    let weights: Vec<u8> = (0..5155u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let (want, size) = (hex::encode(sha2::Sha256::digest(&weights)), weights.len());
    assert!(size > 4 * common::XET_CHUNK, "a file of several chunks: {size} bytes");
    let start = |lost_from: Option<(usize, usize)>| {
        let mut xet = FakeRepo::single(&sha("X"), tree(&[("config.json", b"{}"), ("model.safetensors", &weights)]));
        xet.xet.push("model.safetensors".into());
        xet.xet_lost_from = lost_from;
        FakeHub::start(BTreeMap::from([(key.clone(), xet)]))
    };
    let asked = |server: &FakeHub| std::mem::take(&mut server.repos.lock().unwrap().get_mut(&key).unwrap().xet_asked);
    let pull = |server: &FakeHub, home: &Path| {
        let env = [("HF_ENDPOINT", server.url.as_str()), ("HF_HOME", home.to_str().unwrap())];
        run_kiln(&["--quiet", "pull", "--model", repo, "--files", "model.safetensors"], &env, home)
    };
    let pulled = |server: &FakeHub, home: &Path| {
        let (ok, stdout, stderr) = pull(server, home);
        assert!(ok, "{stderr}");
        let record: Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(record[0]["files"][0]["sha256"], want.as_str());
        let local = record[0]["files"][0]["local"].as_str().unwrap().to_string();
        assert_eq!(std::fs::read(local).unwrap(), weights);
        stderr
    };
    let blobs = |home: &Path| home.join("hub/models--kiln-org--xet-model/blobs");
    let partial = |home: &Path| blobs(home).join(format!("{want}.incomplete"));
    let reconstructed = |first: usize| vec![format!("bytes={first}-{}", size - 1)];

    let server = start(None);
    let home = tempfile::tempdir().unwrap();
    pulled(&server, home.path());
    assert_eq!(asked(&server), reconstructed(0), "one reconstruction of the whole file, through the CAS");
    assert!(home.path().join("xet").is_dir(), "Xet's cache under HF_HOME");

    // A transfer broken off at 3/4 of the file (the CAS loses the rest) fails the pull, leaving the start the
    // client wrote; the next pull goes on from its end.
    let broken = start(Some((size * 3 / 4, 1)));
    let home = tempfile::tempdir().unwrap();
    let (ok, _, stderr) = pull(&broken, home.path());
    assert!(!ok && stderr.contains("model.safetensors") && stderr.contains("Xet download failed"), "{stderr}");
    let left = std::fs::read(partial(home.path())).unwrap();
    // What the client had written of the chunks before (most often some of them: it buffers what it writes).
    let whole_chunks = size * 3 / 4 / common::XET_CHUNK * common::XET_CHUNK;
    assert!(
        left.len() <= whole_chunks && weights.starts_with(&left),
        "{} bytes left, not the start of the file before the chunk lost",
        left.len()
    );
    assert_eq!(asked(&broken), reconstructed(0));
    let stderr = pulled(&broken, home.path());
    assert!(stderr.contains(&format!("going on from byte {} of {size}", left.len())), "{stderr}");
    assert_eq!(asked(&broken), reconstructed(left.len()), "the rest alone");
    assert!(!partial(home.path()).exists());

    // Half the file left there: the rest alone is reconstructed.
    let home = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(blobs(home.path())).unwrap();
    std::fs::write(partial(home.path()), &weights[..size / 2]).unwrap();
    let stderr = pulled(&server, home.path());
    assert!(stderr.contains(&format!("going on from byte {} of {size}", size / 2)), "{stderr}");
    assert_eq!(asked(&server), reconstructed(size / 2));

    // Bytes that are not the file's start: refused by the sha256, nothing left; the next pull takes it whole.
    let home = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(blobs(home.path())).unwrap();
    std::fs::write(partial(home.path()), vec![b'x'; size / 2]).unwrap();
    let (ok, _, stderr) = pull(&server, home.path());
    assert!(!ok && stderr.contains("not the") && stderr.contains("the Hub announced"), "{stderr}");
    assert_eq!(asked(&server), reconstructed(size / 2));
    assert_eq!(std::fs::read_dir(blobs(home.path())).unwrap().count(), 0, "nothing of it is left");
    pulled(&server, home.path());
    assert_eq!(asked(&server), reconstructed(0));
}

/// A checkpoint folder as the pipeline's `best/` holds it, with a hidden file that is not pushed.
fn checkpoint_folder(dir: &Path) -> Tree {
    let files = tree(&[
        ("config.json", b"{\"model_type\": \"lfm2\"}"),
        ("model.safetensors", b"new weights"),
        ("tokenizer.json", b"{}"),
        ("README.md", b"---\nlicense: apache-2.0\n---\n# tiny terminal\n"),
        ("card/loss.png", b"png bytes"),
    ]);
    for (path, bytes) in &files {
        std::fs::create_dir_all(dir.join(path).parent().unwrap()).unwrap();
        std::fs::write(dir.join(path), bytes).unwrap();
    }
    std::fs::write(dir.join(".kiln.lock"), b"not pushed").unwrap();
    files
}

fn push_env<'a>(server: &'a FakeHub, home: &'a Path, token: Option<&'a str>) -> Vec<(&'a str, &'a str)> {
    let mut env = vec![("HF_ENDPOINT", server.url.as_str()), ("HF_HOME", home.to_str().unwrap())];
    env.extend(token.map(|t| ("HF_TOKEN", t)));
    env
}

#[test]
fn kiln_push_creates_the_repo_commits_the_folder_and_deletes_only_stale_weights() {
    let server = FakeHub::start(BTreeMap::new());
    let home = tempfile::tempdir().unwrap();
    let folder = home.path().join("best");
    let files = checkpoint_folder(&folder);
    let env = push_env(&server, home.path(), Some(WRITE_TOKEN));
    let repo = "kiln-org/tiny-terminal";
    let push = |extra: &[&str]| {
        let mut args = vec!["--quiet", "push", folder.to_str().unwrap(), "--repo", repo];
        args.extend(extra);
        let (ok, stdout, stderr) = run_kiln(&args, &env, home.path());
        assert!(ok, "{stderr}");
        serde_json::from_str::<Value>(&stdout).unwrap()
    };

    let requests = || server.requests.load(std::sync::atomic::Ordering::SeqCst);
    // A new repo, created private: every file but the hidden one, in one commit on top of the initial one.
    // Requests: whoami, the branch (not found), the repo created, the branch, preupload, LFS batch, the commit,
    // the new commit listed back.
    let record = push(&["--private"]);
    assert_eq!(requests(), 8);
    assert_eq!((record["created_repo"].as_bool(), record["user"].as_str()), (Some(true), Some("kiln-tester")));
    let pushed = server.model_tree(repo, "main").unwrap();
    let mut want = files.clone();
    want.insert(".gitattributes".into(), pushed[".gitattributes"].clone());
    assert_eq!(pushed, want);
    let listed: Vec<(&str, &str)> = record["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["path"].as_str().unwrap(), f["sha256"].as_str().unwrap()))
        .collect();
    let hashes: Vec<(String, String)> = files.iter().map(|(p, b)| (p.clone(), kiln::hub::sha256_bytes(b))).collect();
    assert_eq!(listed, hashes.iter().map(|(p, h)| (p.as_str(), h.as_str())).collect::<Vec<_>>());
    assert_eq!(record["deleted"], serde_json::json!([]));
    assert_eq!(record["sent"], serde_json::json!(files.keys().collect::<Vec<_>>()), "a new repo: every file");
    {
        let repos = server.repos.lock().unwrap();
        let served = &repos[&("models".to_string(), repo.to_string())];
        let head = &served.refs["main"];
        assert!(served.private);
        assert_eq!(
            (record["commit"].as_str(), served.messages[head].as_str()),
            (Some(head.as_str()), "Upload best with kiln")
        );
        assert_eq!(record["url"], format!("{}/{repo}/commit/{head}", server.url));
    }

    // Over an earlier 2-shard export (and a file the user added on the Hub): the shards and their index go in
    // the same commit, the user's file stays; the files the head holds as they are (by git object id, the
    // tree's listing) are not sent again.
    let earlier = {
        let mut repos = server.repos.lock().unwrap();
        let served = repos.get_mut(&("models".to_string(), repo.to_string())).unwrap();
        let mut tree = served.commits[&served.refs["main"]].clone();
        tree.remove("model.safetensors");
        for shard in ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] {
            tree.insert(shard.into(), b"old".to_vec());
        }
        tree.insert("model.safetensors.index.json".into(), b"{}".to_vec());
        tree.insert("LICENSE".into(), b"the user's".to_vec());
        served.commits.insert(sha("sharded"), tree);
        served.refs.insert("main".into(), sha("sharded"));
        sha("sharded")
    };
    let record = push(&["--message", "epoch-2 of tiny"]);
    assert_eq!(requests(), 8 + 7, "whoami, the branch, its tree, preupload, LFS batch, the commit, the listing");
    assert_eq!(record["created_repo"], false);
    assert_eq!(record["sent"], serde_json::json!(["model.safetensors"]));
    assert_eq!(record["parent"], earlier.as_str());
    assert_eq!(
        record["deleted"],
        serde_json::json!([
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json"
        ])
    );
    let pushed = server.model_tree(repo, "main").unwrap();
    want.insert("LICENSE".into(), b"the user's".to_vec());
    assert_eq!(pushed, want);

    let head = |branch: &str| {
        let repos = server.repos.lock().unwrap();
        repos[&("models".to_string(), repo.to_string())].refs[branch].clone()
    };
    // Pushed again as it is: no commit (the Hub would record an empty one), whoami, the branch and its tree.
    let main_head = head("main");
    let record = push(&[]);
    assert_eq!(requests(), 15 + 3);
    assert_eq!((record["unchanged"].as_bool(), record["commit"].as_str()), (Some(true), Some(main_head.as_str())));
    assert_eq!((record["sent"].as_array().unwrap().len(), head("main")), (0, main_head.clone()));

    // A changed card alone: the card alone is sent, in a commit on top.
    std::fs::write(folder.join("README.md"), "---\nlicense: apache-2.0\n---\n# tiny terminal, epoch 2\n").unwrap();
    let record = push(&[]);
    assert_eq!(record["sent"], serde_json::json!(["README.md"]));
    assert_eq!((record["parent"].as_str(), record["unchanged"].as_bool()), (Some(main_head.as_str()), Some(false)));
    want.insert("README.md".into(), std::fs::read(folder.join("README.md")).unwrap());
    assert_eq!(server.model_tree(repo, "main").unwrap(), want);
    let after_card = requests();
    assert_eq!(after_card, 18 + 6, "whoami, the branch, its tree, preupload, the commit, the listing: no LFS batch");

    // A branch that does not exist is made from main; main stays as it was. It holds the folder already:
    // nothing committed.
    let record = push(&["--revision", "epoch-1"]);
    assert_eq!(requests(), after_card + 5, "whoami, the branch (not found), made, read again, its tree");
    assert_eq!((record["created_branch"].as_bool(), record["revision"].as_str()), (Some(true), Some("epoch-1")));
    assert_eq!(record["unchanged"], true);
    assert_eq!(server.model_tree(repo, "epoch-1").unwrap(), want);
    assert_eq!(server.model_tree(repo, "main").unwrap(), want);
    let after_branch = requests();

    // A new repo and a new branch at once: the repo, then the branch from its initial commit.
    let args = ["--quiet", "push", folder.to_str().unwrap(), "--repo", "kiln-tester/other", "--revision", "dev"];
    let (ok, stdout, stderr) = run_kiln(&args, &env, home.path());
    assert!(ok, "{stderr}");
    let record: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!((record["created_repo"].as_bool(), record["created_branch"].as_bool()), (Some(true), Some(true)));
    assert_eq!(requests(), after_branch + 10, "no tree to compare with in a new repo");
    assert_eq!(server.model_tree("kiln-tester/other", "main").unwrap().keys().collect::<Vec<_>>(), [".gitattributes"]);
    assert_eq!(server.model_tree("kiln-tester/other", "dev").unwrap().len(), files.len() + 1);
}

#[test]
fn a_fine_grained_token_pushes_where_its_scopes_grant_repo_write() {
    let granted = FakeRepo::single(&sha("granted"), [("README.md".to_string(), b"# granted\n".to_vec())].into());
    let server = FakeHub::start([(("models".to_string(), "kiln-org/granted".to_string()), granted)].into());
    let home = tempfile::tempdir().unwrap();
    let folder = home.path().join("best");
    let files = checkpoint_folder(&folder);
    let env = push_env(&server, home.path(), Some(FINE_TOKEN));
    // "0" does not disable the token (as in Python's huggingface_hub; hf-hub alone would read it as set).
    let mut implicit = env.clone();
    implicit.push(("HF_HUB_DISABLE_IMPLICIT_TOKEN", "0"));
    // The Hub limits whoami's rate: a 429 is waited out and asked again.
    server.whoami_throttled.store(2, std::sync::atomic::Ordering::SeqCst);
    for (repo, created, env) in [("kiln-tester/fine", true, &env), ("kiln-org/granted", false, &implicit)] {
        let args = ["--quiet", "push", folder.to_str().unwrap(), "--repo", repo];
        let (ok, stdout, stderr) = run_kiln(&args, env, home.path());
        assert!(ok, "{repo}: {stderr}");
        let record: Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(record["created_repo"].as_bool(), Some(created), "{repo}");
        assert_eq!(server.whoami_throttled.load(std::sync::atomic::Ordering::SeqCst), 0);
        let tree = server.model_tree(repo, "main").unwrap();
        assert!(files.keys().all(|f| tree.contains_key(f)), "{repo}: {:?}", tree.keys());
    }
}

#[test]
fn kiln_push_refuses_clearly_before_uploading() {
    let server = FakeHub::start(BTreeMap::new());
    let home = tempfile::tempdir().unwrap();
    let folder = home.path().join("best");
    checkpoint_folder(&folder);
    let push = |repo: &str, env: &[(&str, &str)]| {
        let (ok, _, stderr) =
            run_kiln(&["--quiet", "push", folder.to_str().unwrap(), "--repo", repo], env, home.path());
        assert!(!ok, "{repo} was pushed");
        stderr
    };
    let requests = || server.requests.load(std::sync::atomic::Ordering::SeqCst);

    let stderr = push("kiln-tester/tiny", &push_env(&server, home.path(), None));
    assert!(stderr.contains("needs a Hub token with write access: set HF_TOKEN"), "{stderr}");
    let mut offline = push_env(&server, home.path(), Some(WRITE_TOKEN));
    offline.push(("HF_HUB_OFFLINE", "1"));
    let stderr = push("kiln-tester/tiny", &offline);
    assert!(stderr.contains("offline (HF_HUB_OFFLINE=1)"), "{stderr}");
    let stderr = push("tiny", &push_env(&server, home.path(), Some(WRITE_TOKEN)));
    assert!(stderr.contains("'tiny' is not a Hub repo id (owner/name)"), "{stderr}");
    assert_eq!(requests(), 0, "none of these asked the Hub");

    let stderr = push("kiln-tester/tiny", &push_env(&server, home.path(), Some("hf_wrong")));
    assert!(stderr.contains("the token from HF_TOKEN was refused"), "{stderr}");
    let stderr = push("someone-else/tiny", &push_env(&server, home.path(), Some(WRITE_TOKEN)));
    assert!(
        stderr.contains(
            "belongs to 'kiln-tester', who may not push to 'someone-else/tiny': it can write to kiln-tester, kiln-org"
        ),
        "{stderr}"
    );
    // What the token may write is told by whoami alone (one request each), before anything is sent.
    let before = requests();
    let stderr = push("kiln-tester/tiny", &push_env(&server, home.path(), Some(READ_TOKEN)));
    assert!(
        stderr.contains("the token from HF_TOKEN belongs to 'kiln-tester', who may not push to 'kiln-tester/tiny': it is a read token. Create a token with the write role"),
        "{stderr}"
    );
    let stderr = push("kiln-readers/tiny", &push_env(&server, home.path(), Some(WRITE_TOKEN)));
    assert!(stderr.contains("'kiln-tester' has the read role in the organization 'kiln-readers'"), "{stderr}");
    let stderr = push("kiln-org/tiny", &push_env(&server, home.path(), Some(FINE_TOKEN)));
    assert!(
        stderr.contains("a fine-grained token that grants repo.write to kiln-tester, kiln-org/granted, not in 'kiln-org'. Add 'kiln-org' to the token's write permissions"),
        "{stderr}"
    );
    assert_eq!(requests(), before + 3, "whoami only");
    // A token that may write to one repo cannot create it: the repo is looked up, and is not there.
    let stderr = push("kiln-org/granted", &push_env(&server, home.path(), Some(FINE_TOKEN)));
    assert!(
        stderr.contains("may write to 'kiln-org/granted' but not create repos in 'kiln-org', and 'kiln-org/granted' does not exist. Create the repo on the Hub first"),
        "{stderr}"
    );
    assert_eq!(requests(), before + 5, "whoami and the repo's info");
    // A whoami that does not say what the token may do leaves it to the Hub, which refuses the first write.
    let stderr = push("kiln-tester/tiny", &push_env(&server, home.path(), Some(UNSTATED_TOKEN)));
    assert!(
        stderr.contains("the Hub refused creating the repo for model repo 'kiln-tester/tiny'")
            && stderr.contains("The token needs write access"),
        "{stderr}"
    );
    assert!(server.repos.lock().unwrap().is_empty(), "nothing was created");

    // Not a checkpoint: no weights.
    std::fs::remove_file(folder.join("model.safetensors")).unwrap();
    let stderr = push("kiln-tester/tiny", &push_env(&server, home.path(), Some(WRITE_TOKEN)));
    assert!(stderr.contains("is not a checkpoint folder: it needs config.json and safetensors weights"), "{stderr}");
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
