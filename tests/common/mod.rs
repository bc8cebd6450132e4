//! Test helpers: a loopback server that answers the Hugging Face Hub's routes, and paths to the binary,
//! the project's recipes and the shared reference data.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use sha2::{Digest, Sha256};

pub mod convs;
pub mod norms;
pub mod optim;
pub mod optimizer_ops;
pub mod parity;
pub mod training;

pub fn kiln_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kiln"))
}

pub fn project_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// ../shared/data/tb2lite beside the checkout (CI clones with shared/ beside it).
pub fn shared_tb2lite() -> PathBuf {
    project_dir().join("../shared/data/tb2lite")
}

/// One commit of a repo: path → bytes.
pub type Tree = BTreeMap<String, Vec<u8>>;

#[derive(Default, Clone)]
pub struct FakeRepo {
    /// Branch or tag → commit sha.
    pub refs: BTreeMap<String, String>,
    pub commits: BTreeMap<String, Tree>,
    /// Requests need `Authorization: Bearer <token>`.
    pub gated_token: Option<String>,
    /// Paths listed by the API but answering 404 on download (a listing that went stale).
    pub broken: Vec<String>,
    /// Paths whose body arrives with a byte changed while the ETag still names the right content.
    pub corrupt: Vec<String>,
    /// Paths whose next N downloads break off: redirected to a server that announces the whole length,
    /// sends the first half and closes the connection, as a dropped transfer does.
    pub cut_short: BTreeMap<String, usize>,
    /// The `Range` headers of the downloads asked for, in order (a range is answered 206 with those bytes).
    pub ranges_asked: Vec<String>,
    /// Answers a range with the whole file (200), as a server without range support does.
    pub ignores_range: bool,
    /// Commit → its message, for the commits pushed to the repo.
    pub messages: BTreeMap<String, String>,
    /// Set when a push created the repo private.
    pub private: bool,
    /// Paths stored in Xet: their HEAD names an `X-Xet-Hash` (here their sha256) and their bytes come from the
    /// loopback CAS alone (a GET of their resolve URL is refused), one xorb of `XET_CHUNK`-byte chunks each.
    pub xet: Vec<String>,
    /// The reconstructions the CAS was asked for these files, in order: the `Range` header.
    pub xet_asked: Vec<String>,
    /// The CAS answers 404 for the chunks of a Xet file from this byte on (the next N reconstructions), as a
    /// transfer broken off there does to hf-hub's Xet client.
    pub xet_lost_from: Option<(usize, usize)>,
}

impl FakeRepo {
    /// A repo whose `main` points at one commit holding `files`.
    pub fn single(commit: &str, files: Tree) -> FakeRepo {
        let mut repo = FakeRepo::default();
        repo.refs.insert("main".into(), commit.into());
        repo.commits.insert(commit.into(), files);
        repo
    }
}

/// A token of the account `kiln-tester` with the write role. The account has the write role in `kiln-org`
/// and the read role in `kiln-readers`.
pub const WRITE_TOKEN: &str = "hf_kiln_writer";
/// A token of the same account with the read role: every write is refused (403).
pub const READ_TOKEN: &str = "hf_kiln_reader";
/// A fine-grained token of the same account: repo.write on `kiln-tester` and on the repo `kiln-org/granted`,
/// read alone on `kiln-org`, and no read access to gated repos.
pub const FINE_TOKEN: &str = "hf_kiln_fine";
/// A token of the same account whose whoami says nothing of its role (as an older server would), and whose
/// every write is refused: the push finds out.
pub const UNSTATED_TOKEN: &str = "hf_kiln_unstated";

/// The whoami answer for `token`, as the Hub's `/api/whoami-v2` gives it.
fn whoami(token: &str) -> Option<serde_json::Value> {
    let access = match token {
        WRITE_TOKEN => serde_json::json!({"displayName": "writer", "role": "write"}),
        READ_TOKEN => serde_json::json!({"displayName": "reader", "role": "read"}),
        FINE_TOKEN => {
            let scoped = serde_json::json!([
                {"entity": {"_id": "u1", "type": "user", "name": "kiln-tester"},
                 "permissions": ["repo.content.read", "repo.write"]},
                {"entity": {"_id": "o1", "type": "org", "name": "kiln-org"}, "permissions": ["repo.content.read"]},
                {"entity": {"_id": "m1", "type": "model", "name": "kiln-org/granted"}, "permissions": ["repo.write"]}
            ]);
            let grants =
                serde_json::json!({"canReadGatedRepos": false, "global": ["discussion.write"], "scoped": scoped});
            serde_json::json!({"displayName": "fine", "role": "fineGrained", "fineGrained": grants})
        }
        UNSTATED_TOKEN => serde_json::Value::Null,
        _ => return None,
    };
    let mut answer = serde_json::json!({"type": "user", "name": "kiln-tester", "orgs": [
        {"type": "org", "name": "kiln-org", "roleInOrg": "write"},
        {"type": "org", "name": "kiln-readers", "roleInOrg": "read"}
    ]});
    if !access.is_null() {
        answer["auth"] = serde_json::json!({"type": "access_token", "accessToken": access});
    }
    Some(answer)
}

/// Whether `token` may write to `repo` (`owner/name`), creating it when `creating`: what the Hub enforces.
fn may_write(token: Option<&str>, repo: &str, creating: bool) -> bool {
    let namespace = repo.split('/').next().unwrap_or("");
    match token {
        Some(WRITE_TOKEN) => ["kiln-tester", "kiln-org"].contains(&namespace),
        Some(FINE_TOKEN) => namespace == "kiln-tester" || (!creating && repo == "kiln-org/granted"),
        _ => false,
    }
}

pub fn sha(label: &str) -> String {
    let digest = hex::encode(Sha256::digest(label.as_bytes()));
    digest[..40].to_string()
}

/// Serves `/api/{models,datasets}/<id>/revision/<rev>` and `[datasets/]<id>/resolve/<rev>/<path>` like the
/// Hub: X-Repo-Commit and ETag headers, X-Error-Code on 4xx. Stops when dropped.
pub struct FakeHub {
    pub url: String,
    pub requests: Arc<AtomicUsize>,
    /// The repos as served: pushes change them.
    pub repos: Arc<Mutex<BTreeMap<(String, String), FakeRepo>>>,
    /// How many whoami requests to answer 429 (too many requests) before answering.
    pub whoami_throttled: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    /// The Hub's, the broken CDN's and the Xet CAS's.
    threads: Vec<JoinHandle<()>>,
}

impl FakeHub {
    /// `repos`: ("datasets" | "models", "owner/name") → repo.
    pub fn start(repos: BTreeMap<(String, String), FakeRepo>) -> FakeHub {
        let server = tiny_http::Server::http("127.0.0.1:0").expect("bind loopback");
        let url = format!("http://{}", server.server_addr().to_ip().expect("ip address"));
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(AtomicUsize::new(0));
        let repos = Arc::new(Mutex::new(repos));
        let (cdn, broken_cdn) = broken_cdn(stop.clone(), repos.clone());
        let (cas, xet_cas) = xet_cas_server(stop.clone(), repos.clone());
        let whoami_throttled = Arc::new(AtomicUsize::new(0));
        let (stop2, requests2, repos2, base) = (stop.clone(), requests.clone(), repos.clone(), url.clone());
        let throttled = whoami_throttled.clone();
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::SeqCst) {
                let Ok(Some(mut req)) = server.recv_timeout(Duration::from_millis(50)) else { continue };
                requests2.fetch_add(1, Ordering::SeqCst);
                if req.url() == "/api/whoami-v2"
                    && throttled.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
                {
                    let _ = req.respond(error(429, "TooManyRequests", "rate limit reached for whoami"));
                    continue;
                }
                let mut body = Vec::new();
                let _ = std::io::Read::read_to_end(req.as_reader(), &mut body);
                let mut repos = repos2.lock().unwrap();
                let response = match write_route(&mut repos, &req, &body, &base) {
                    Some(response) => response,
                    None => answer(&mut repos, &req, &cdn, &cas),
                };
                drop(repos);
                let _ = req.respond(response);
            }
        });
        let servers = vec![thread, broken_cdn, xet_cas];
        FakeHub { url, requests, repos, whoami_throttled, stop, threads: servers }
    }

    /// The files of `repo` (a model) at the head of `branch`.
    pub fn model_tree(&self, repo: &str, branch: &str) -> Option<Tree> {
        let repos = self.repos.lock().unwrap();
        let r = repos.get(&("models".to_string(), repo.to_string()))?;
        r.commits.get(r.refs.get(branch)?).cloned()
    }
}

fn bearer(req: &tiny_http::Request) -> Option<String> {
    req.headers()
        .iter()
        .find(|h| h.field.equiv("Authorization"))
        .and_then(|h| h.value.as_str().strip_prefix("Bearer ").map(str::to_string))
}

fn json_response(value: serde_json::Value) -> Response {
    tiny_http::Response::from_data(value.to_string().into_bytes())
        .with_header(header("Content-Type", "application/json"))
}

/// The Hub's routes a push takes: whoami, repo and branch creation, preupload, the LFS batch (which offers
/// no Xet transfer, so hf-hub sends every file inline) and the NDJSON commit, checked against its parent.
/// `None` for the read routes.
fn write_route(
    repos: &mut BTreeMap<(String, String), FakeRepo>,
    req: &tiny_http::Request,
    body: &[u8],
    base: &str,
) -> Option<Response> {
    let path = req.url().split('?').next().unwrap_or("").to_string();
    let parts: Vec<String> = path.trim_start_matches('/').split('/').map(decode).collect();
    let token = bearer(req);
    let denied = || error(403, "Forbidden", "You don't have the rights to write to this repo");
    if parts == ["api", "whoami-v2"] {
        return Some(match token.as_deref().and_then(whoami) {
            Some(answer) => json_response(answer),
            None => error(401, "Unauthorized", "Invalid credentials in Authorization header"),
        });
    }
    if req.method() != &tiny_http::Method::Post {
        return None;
    }
    let json_body = || serde_json::from_slice::<serde_json::Value>(body).unwrap_or_default();
    if parts == ["api", "repos", "create"] {
        let b = json_body();
        let namespace = b["organization"].as_str().unwrap_or("kiln-tester").to_string();
        let key = ("models".to_string(), format!("{namespace}/{}", b["name"].as_str().unwrap_or("")));
        if !may_write(token.as_deref(), &key.1, true) {
            return Some(denied());
        }
        if repos.contains_key(&key) {
            return Some(error(409, "Conflict", "You already created this model repo"));
        }
        let initial = sha(&format!("initial {}", key.1));
        let mut repo =
            FakeRepo::single(&initial, [(".gitattributes".to_string(), b"*.safetensors filter=lfs\n".to_vec())].into());
        repo.private = b["private"].as_bool().unwrap_or(false);
        repos.insert(key.clone(), repo);
        return Some(json_response(serde_json::json!({"url": format!("{base}/{}", key.1)})));
    }
    // /<owner>/<name>.git/info/lfs/objects/batch
    if parts.len() == 6 && parts[1].ends_with(".git") && parts[2..] == ["info", "lfs", "objects", "batch"] {
        return Some(json_response(serde_json::json!({"transfer": "basic", "objects": []})));
    }
    // /api/models/<owner>/<name>/{branch,preupload,commit}/<rev>
    if parts.len() < 6 || parts[0] != "api" || parts[1] != "models" {
        return None;
    }
    let key = ("models".to_string(), format!("{}/{}", parts[2], parts[3]));
    let rev = parts[5..].join("/");
    let Some(repo) = repos.get_mut(&key) else { return Some(error(404, "RepoNotFound", "Repository not found")) };
    match parts[4].as_str() {
        "preupload" => {
            let files = json_body()["files"].as_array().cloned().unwrap_or_default();
            let modes: Vec<_> = files
                .iter()
                .map(|f| {
                    let path = f["path"].as_str().unwrap_or("");
                    let mode = if path.ends_with(".safetensors") { "lfs" } else { "regular" };
                    serde_json::json!({"path": path, "uploadMode": mode, "shouldIgnore": false})
                })
                .collect();
            Some(json_response(serde_json::json!({"files": modes})))
        }
        "branch" => {
            if !may_write(token.as_deref(), &key.1, false) {
                return Some(denied());
            }
            let Some(head) = repo.refs.get("main").cloned() else {
                return Some(error(404, "RevisionNotFound", "no main"));
            };
            repo.refs.insert(rev, head);
            Some(json_response(serde_json::json!({})))
        }
        "commit" => {
            if !may_write(token.as_deref(), &key.1, false) {
                return Some(denied());
            }
            let Some(head) = repo.refs.get(&rev).cloned() else {
                return Some(error(404, "RevisionNotFound", "Invalid rev id"));
            };
            let mut tree = repo.commits[&head].clone();
            let mut message = String::new();
            for line in body.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                let op: serde_json::Value = serde_json::from_slice(line).unwrap_or_default();
                let value = &op["value"];
                let file = value["path"].as_str().unwrap_or("").to_string();
                match op["key"].as_str().unwrap_or("") {
                    "header" => {
                        message = value["summary"].as_str().unwrap_or("").to_string();
                        if value["parentCommit"].as_str().is_some_and(|p| p != head) {
                            return Some(error(
                                412,
                                "PreconditionFailed",
                                "A commit has happened since. Please refresh and try again.",
                            ));
                        }
                    }
                    "file" => {
                        use base64::Engine;
                        let content = value["content"].as_str().unwrap_or("");
                        let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(content) else {
                            return Some(error(400, "BadRequest", "content is not base64"));
                        };
                        tree.insert(file, bytes);
                    }
                    "deletedFile" => {
                        if tree.remove(&file).is_none() {
                            return Some(error(404, "EntryNotFound", "no such file to delete"));
                        }
                    }
                    other => return Some(error(400, "BadRequest", &format!("unexpected commit line '{other}'"))),
                }
            }
            let digest: Vec<String> =
                tree.iter().map(|(p, b)| format!("{p}:{}", hex::encode(Sha256::digest(b)))).collect();
            let commit = sha(&format!("{head}\n{message}\n{}", digest.join("\n")));
            repo.commits.insert(commit.clone(), tree);
            repo.messages.insert(commit.clone(), message);
            repo.refs.insert(rev, commit.clone());
            Some(json_response(serde_json::json!({
                "success": true,
                "commitOid": commit,
                "commitUrl": format!("{base}/{}/commit/{commit}", key.1),
            })))
        }
        _ => None,
    }
}

/// A file server whose every transfer breaks: asked for `/broken/<plural>/<owner>/<name>/<commit>/<path>`, it
/// announces the file's whole length, sends its first half and closes the connection (1 MiB announced and a
/// few bytes sent for a file it does not know).
fn broken_cdn(
    stop: Arc<AtomicBool>,
    repos: Arc<Mutex<BTreeMap<(String, String), FakeRepo>>>,
) -> (String, JoinHandle<()>) {
    loopback_server(stop, move |mut stream, _| {
        use std::io::Write;
        let head = request_head(&stream);
        let target = head.first().and_then(|l| l.split(' ').nth(1)).unwrap_or_default();
        let parts: Vec<String> = target.trim_start_matches("/broken/").split('/').map(decode).collect();
        let bytes = (parts.len() >= 5)
            .then(|| {
                let repos = repos.lock().unwrap();
                let repo = repos.get(&(parts[0].clone(), format!("{}/{}", parts[1], parts[2])))?;
                repo.commits.get(&parts[3])?.get(&parts[4..].join("/")).cloned()
            })
            .flatten();
        let (announced, sent) = match &bytes {
            Some(b) => (b.len(), b[..b.len() / 2].to_vec()),
            None => (1 << 20, b"PAR1 then nothing".to_vec()),
        };
        let _ = stream.write_all(format!("HTTP/1.1 200 OK\r\nContent-Length: {announced}\r\n\r\n").as_bytes());
        let _ = stream.write_all(&sent);
        let _ = stream.shutdown(std::net::Shutdown::Both);
    })
}

/// A server on a loopback port of its own (its URL returned) that hands each connection, on a thread of its
/// own, to `answer` with the server's URL, until `stop`.
fn loopback_server(
    stop: Arc<AtomicBool>,
    answer: impl Fn(std::net::TcpStream, &str) + Clone + Send + 'static,
) -> (String, JoinHandle<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    listener.set_nonblocking(true).expect("non-blocking listener");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let base = url.clone();
    let thread = std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            let Ok((stream, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            let _ = stream.set_nonblocking(false);
            let (answer, base) = (answer.clone(), base.clone());
            std::thread::spawn(move || answer(stream, &base));
        }
    });
    (url, thread)
}

/// The request line and header lines of the request on `stream` (its body, if any, left unread).
fn request_head(stream: &std::net::TcpStream) -> Vec<String> {
    use std::io::BufRead;
    let mut reader = std::io::BufReader::new(stream);
    let mut head = Vec::new();
    let mut line = String::new();
    while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
        head.push(std::mem::take(&mut line).trim_end().to_string());
    }
    head
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

type Response = tiny_http::Response<std::io::Cursor<Vec<u8>>>;

fn header(name: &str, value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("valid header")
}

fn error(status: u16, code: &str, message: &str) -> Response {
    tiny_http::Response::from_data(serde_json::json!({"error": message}).to_string().into_bytes())
        .with_status_code(status)
        .with_header(header("X-Error-Code", code))
        .with_header(header("Content-Type", "application/json"))
}

fn decode(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(v) = u8::from_str_radix(&segment[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn answer(
    repos: &mut BTreeMap<(String, String), FakeRepo>,
    req: &tiny_http::Request,
    cdn: &str,
    cas: &str,
) -> Response {
    let path = req.url().split('?').next().unwrap_or("").to_string();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let authorized = |repo: &FakeRepo| match &repo.gated_token {
        None => true,
        Some(token) => req
            .headers()
            .iter()
            .any(|h| h.field.equiv("Authorization") && h.value.as_str() == format!("Bearer {token}")),
    };
    // API: /api/<plural>/<owner>/<name>/xet-read-token/<rev>: where the CAS is and a token for it.
    if parts.len() >= 6 && parts[0] == "api" && parts[4] == "xet-read-token" {
        let key = (parts[1].to_string(), format!("{}/{}", parts[2], parts[3]));
        let Some(repo) = repos.get(&key) else { return error(404, "RepoNotFound", "Repository not found") };
        if !authorized(repo) {
            return error(401, "GatedRepo", "Access to this repo is restricted");
        }
        return json_response(serde_json::json!({"accessToken": "xet-read", "exp": 4_000_000_000u64, "casUrl": cas}));
    }
    // API: /api/<plural>/<owner>/<name>/tree/<rev>?recursive=true: files by git object id (of the LFS pointer
    // for an LFS file: safetensors, as preupload says), folders too, as the Hub lists them.
    if parts.len() >= 6 && parts[0] == "api" && parts[4] == "tree" {
        let key = (parts[1].to_string(), format!("{}/{}", parts[2], parts[3]));
        let Some(repo) = repos.get(&key) else { return error(404, "RepoNotFound", "Repository not found") };
        let Some(commit) = resolve(repo, &decode(&parts[5..].join("/"))) else {
            return error(404, "RevisionNotFound", "Invalid rev id");
        };
        let blob_id = |bytes: &[u8]| {
            let mut hasher = sha1::Sha1::new();
            hasher.update(format!("blob {}\0", bytes.len()).as_bytes());
            hasher.update(bytes);
            hex::encode(hasher.finalize())
        };
        let mut entries = Vec::new();
        let mut folders = std::collections::BTreeSet::new();
        for (path, bytes) in &repo.commits[&commit] {
            let mut folder = path.as_str();
            while let Some((parent, _)) = folder.rsplit_once('/') {
                folders.insert(parent.to_string());
                folder = parent;
            }
            let size = bytes.len();
            let entry = if path.ends_with(".safetensors") {
                let sha256 = hex::encode(Sha256::digest(bytes));
                let pointer = format!("version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n");
                serde_json::json!({"type": "file", "oid": blob_id(pointer.as_bytes()), "size": size, "path": path,
                    "lfs": {"oid": sha256, "size": size, "pointerSize": pointer.len()}})
            } else {
                serde_json::json!({"type": "file", "oid": blob_id(bytes), "size": size, "path": path})
            };
            entries.push(entry);
        }
        entries.extend(folders.iter().map(|f| serde_json::json!({"type": "directory", "oid": sha(f), "path": f})));
        return json_response(serde_json::Value::Array(entries));
    }
    // API: /api/<plural>/<owner>/<name>[/revision/<rev>] (the default branch, main, without one)
    if (parts.len() == 4 || (parts.len() >= 6 && parts[4] == "revision")) && parts[0] == "api" {
        let key = (parts[1].to_string(), format!("{}/{}", parts[2], parts[3]));
        let Some(repo) = repos.get(&key) else { return error(404, "RepoNotFound", "Repository not found") };
        if !authorized(repo) {
            return error(401, "GatedRepo", "Access to this repo is restricted");
        }
        let rev = if parts.len() == 4 { "main".to_string() } else { decode(&parts[5..].join("/")) };
        let Some(commit) = resolve(repo, &rev) else { return error(404, "RevisionNotFound", "Invalid rev id") };
        let siblings: Vec<_> = repo.commits[&commit].keys().map(|p| serde_json::json!({"rfilename": p})).collect();
        let body = serde_json::json!({"id": key.1, "sha": commit, "siblings": siblings});
        return tiny_http::Response::from_data(body.to_string().into_bytes())
            .with_header(header("Content-Type", "application/json"));
    }
    // Files: [datasets/]<owner>/<name>/resolve/<rev>/<path…>
    let (plural, rest) =
        if parts.first() == Some(&"datasets") { ("datasets", &parts[1..]) } else { ("models", &parts[..]) };
    if rest.len() >= 5 && rest[2] == "resolve" {
        let key = (plural.to_string(), format!("{}/{}", rest[0], rest[1]));
        let Some(repo) = repos.get(&key) else { return error(404, "RepoNotFound", "Repository not found") };
        if !authorized(repo) {
            return error(401, "GatedRepo", "Access to this repo is restricted");
        }
        let Some(commit) = resolve(repo, &decode(rest[3])) else {
            return error(404, "RevisionNotFound", "Invalid rev id");
        };
        let file = rest[4..].iter().map(|s| decode(s)).collect::<Vec<_>>().join("/");
        // A Xet-stored file's bytes come from the CAS alone (a download that asked here would fail).
        if req.method() == &tiny_http::Method::Get && repos.get(&key).is_some_and(|r| r.xet.contains(&file)) {
            return error(409, "XetStored", "the loopback Hub serves Xet-stored files from its CAS alone");
        }
        if req.method() == &tiny_http::Method::Get
            && let Some(left) = repos.get_mut(&key).and_then(|r| r.cut_short.get_mut(&file)).filter(|n| **n > 0)
        {
            *left -= 1;
            let location = format!("{cdn}/broken/{plural}/{}/{}/{commit}/{file}", rest[0], rest[1]);
            return tiny_http::Response::from_data(Vec::new())
                .with_status_code(302)
                .with_header(header("Location", &location));
        }
        let range = req.headers().iter().find(|h| h.field.equiv("Range")).map(|h| h.value.as_str().to_string());
        if let (Some(range), tiny_http::Method::Get, Some(repo)) = (&range, req.method(), repos.get_mut(&key)) {
            repo.ranges_asked.push(range.clone());
        }
        let repo = &repos[&key];
        let tree = &repo.commits[&commit];
        let Some(bytes) = tree.get(&file).filter(|_| !repo.broken.contains(&file)) else {
            return error(404, "EntryNotFound", "Entry not found");
        };
        // LFS-style files (parquet, safetensors) carry their sha256 as ETag; small files a git-style id.
        let digest = hex::encode(Sha256::digest(bytes));
        let etag = if file.ends_with(".parquet") || file.ends_with(".safetensors") {
            digest.clone()
        } else {
            digest[..40].to_string()
        };
        let mut body = if req.method() == &tiny_http::Method::Head { Vec::new() } else { bytes.clone() };
        if repo.corrupt.contains(&file)
            && let Some(first) = body.first_mut()
        {
            *first ^= 0xff;
        }
        // `bytes=<first>-<last>`, both inclusive, as hf-hub asks.
        let asked = range.filter(|_| !repo.ignores_range && req.method() == &tiny_http::Method::Get).and_then(|r| {
            let (first, last) = r.strip_prefix("bytes=")?.split_once('-')?;
            Some((first.parse::<usize>().ok()?, last.parse::<usize>().ok()?))
        });
        let whole = body.len();
        if let Some((first, last)) = asked.filter(|(first, last)| first <= last && *last < whole) {
            return tiny_http::Response::from_data(body[first..=last].to_vec())
                .with_status_code(206)
                .with_header(header("Content-Range", &format!("bytes {first}-{last}/{whole}")))
                .with_header(header("ETag", &format!("\"{etag}\"")))
                .with_header(header("X-Repo-Commit", &commit));
        }
        let mut response = tiny_http::Response::from_data(body)
            .with_header(header("ETag", &format!("\"{etag}\"")))
            .with_header(header("X-Repo-Commit", &commit));
        if req.method() == &tiny_http::Method::Head {
            response = response.with_header(header("X-Linked-Size", &bytes.len().to_string()));
            if repo.xet.contains(&file) {
                response = response.with_header(header("X-Xet-Hash", &digest));
            }
        }
        return response;
    }
    error(404, "NotFound", "no such route")
}

/// The loopback CAS's chunk size: a file's xorb is its bytes in chunks of this many.
pub const XET_CHUNK: usize = 1024;

/// The loopback Xet CAS, on a server of its own that answers each connection on a thread and closes it (hf-hub's
/// Xet client asks for chunks side by side): `v2/reconstructions` is not offered (the client falls back to v1),
/// `v1/reconstructions/<hash>` (a `Range` of the file's bytes) names the xorb chunks that hold them, and
/// `xorbs/<hash>` serves a xorb's bytes by range.
fn xet_cas_server(
    stop: Arc<AtomicBool>,
    repos: Arc<Mutex<BTreeMap<(String, String), FakeRepo>>>,
) -> (String, JoinHandle<()>) {
    loopback_server(stop, move |stream, base| {
        use std::io::Write;
        let head = request_head(&stream);
        let target = head.first().and_then(|l| l.split(' ').nth(1)).unwrap_or_default();
        let range = head.iter().find_map(|h| {
            let (name, value) = h.split_once(':')?;
            name.eq_ignore_ascii_case("range").then(|| value.trim().to_string())
        });
        let parts: Vec<&str> =
            target.split('?').next().unwrap_or_default().trim_start_matches('/').split('/').collect();
        let (status, extra, body) = xet_cas(&mut repos.lock().unwrap(), &parts, range, base);
        let mut stream = &stream;
        let _ = write!(
            stream,
            "HTTP/1.1 {status} CAS\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
            body.len()
        );
        let _ = stream.write_all(&body);
        let _ = stream.shutdown(std::net::Shutdown::Both);
    })
}

/// The CAS's answer to `parts` of a request's path: status, header lines, body.
fn xet_cas(
    repos: &mut BTreeMap<(String, String), FakeRepo>,
    parts: &[&str],
    range: Option<String>,
    base: &str,
) -> (u16, String, Vec<u8>) {
    let json = |value: serde_json::Value| {
        (200, "Content-Type: application/json\r\n".to_string(), value.to_string().into_bytes())
    };
    let not_found = || (404, String::new(), b"not found".to_vec());
    // `bytes=<first>-<last>`, both inclusive.
    let inclusive = |range: &str| -> Option<(usize, usize)> {
        let (first, last) = range.strip_prefix("bytes=")?.split_once('-')?;
        Some((first.parse().ok()?, last.parse().ok()?))
    };
    let hash = parts.last().copied().unwrap_or_default();
    let stored = repos.values_mut().find_map(|repo| {
        let bytes = repo.commits.values().flat_map(|tree| tree.iter()).find_map(|(path, bytes)| {
            (repo.xet.contains(path) && hex::encode(Sha256::digest(bytes)) == hash).then(|| bytes.clone())
        })?;
        Some((repo, bytes))
    });
    match parts {
        ["v1", "reconstructions", _] => {
            let Some((repo, bytes)) = stored else { return not_found() };
            repo.xet_asked.push(range.clone().unwrap_or_else(|| "whole".into()));
            let lost_from = match &mut repo.xet_lost_from {
                Some((from, left)) if *left > 0 => {
                    *left -= 1;
                    Some(*from)
                }
                _ => None,
            };
            let (first, last) = match range.as_deref().map(inclusive) {
                None => (0, bytes.len() - 1),
                Some(Some((first, last))) if first < bytes.len() => (first, last.min(bytes.len() - 1)),
                Some(_) => return (416, String::new(), Vec::new()),
            };
            let (chunk_start, chunk_end) = (first / XET_CHUNK, last / XET_CHUNK + 1);
            let chunk_len = |c: usize| XET_CHUNK.min(bytes.len() - c * XET_CHUNK);
            // Each chunk is stored behind an 8-byte header.
            let xorb_offset = |c: usize| (0..c).map(|k| 8 + chunk_len(k)).sum::<usize>();
            // A term and a fetch for each chunk; a lost chunk's URL is one the CAS does not know.
            let chunks = chunk_start..chunk_end;
            let terms: Vec<_> = chunks
                .clone()
                .map(|c| serde_json::json!({"hash": hash, "unpacked_length": chunk_len(c), "range": {"start": c, "end": c + 1}}))
                .collect();
            let fetches: Vec<_> = chunks
                .map(|c| {
                    let lost = lost_from.is_some_and(|from| (c + 1) * XET_CHUNK > from);
                    let url = format!("{base}/xorbs/{}", if lost { "lost" } else { hash });
                    serde_json::json!({"range": {"start": c, "end": c + 1}, "url": url,
                        "url_range": {"start": xorb_offset(c), "end": xorb_offset(c + 1) - 1}})
                })
                .collect();
            json(serde_json::json!({
                "offset_into_first_range": first - chunk_start * XET_CHUNK,
                "terms": terms,
                "fetch_info": {hash: fetches},
            }))
        }
        ["xorbs", "lost"] => {
            // Lost after a while, as a transfer that stalls and breaks: the chunks before it arrive first.
            std::thread::sleep(Duration::from_millis(500));
            not_found()
        }
        ["xorbs", _] => {
            let Some((_, bytes)) = stored else { return not_found() };
            let mut xorb = Vec::new();
            for chunk in bytes.chunks(XET_CHUNK) {
                let len = (chunk.len() as u32).to_le_bytes();
                xorb.extend([0, len[0], len[1], len[2], 0, len[0], len[1], len[2]]);
                xorb.extend_from_slice(chunk);
            }
            match range.as_deref().and_then(inclusive).filter(|(first, last)| first <= last && *last < xorb.len()) {
                Some((first, last)) => (
                    206,
                    format!("Content-Range: bytes {first}-{last}/{}\r\n", xorb.len()),
                    xorb[first..=last].to_vec(),
                ),
                None => (200, String::new(), xorb),
            }
        }
        _ => not_found(),
    }
}

fn resolve(repo: &FakeRepo, rev: &str) -> Option<String> {
    if repo.commits.contains_key(rev) {
        return Some(rev.to_string());
    }
    repo.refs.get(rev).cloned()
}

/// Runs the kiln binary with `args` and `envs`, returning (success, stdout, stderr).
pub fn run_kiln(args: &[&str], envs: &[(&str, &str)], cwd: &Path) -> (bool, String, String) {
    let (status, stdout, stderr) = run_kiln_status(args, envs, cwd);
    (status.success(), stdout, stderr)
}

/// `run_kiln` (no Hub variables, the given ones set) with `stdin` as its input.
pub fn run_kiln_with_input(args: &[&str], stdin: &str, cwd: &Path) -> (bool, String, String) {
    use std::io::Write;
    let mut child = std::process::Command::new(kiln_bin())
        .args(args)
        .current_dir(cwd)
        .env_remove("HF_TOKEN")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kiln");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().expect("kiln ends");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// `run_kiln` with the exit status itself (kiln's are 1 for an error, 3 for a run the device's memory
/// cannot hold, 101 for a panic).
pub fn run_kiln_status(args: &[&str], envs: &[(&str, &str)], cwd: &Path) -> (std::process::ExitStatus, String, String) {
    let mut cmd = std::process::Command::new(kiln_bin());
    cmd.args(args).current_dir(cwd);
    for var in [
        "HF_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_OFFLINE",
        "HF_ENDPOINT",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "XDG_CACHE_HOME",
        "KILN_CUDA_FUSION",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run kiln");
    (out.status, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Every distinct parameter of `model` by checkpoint key, with its dtype and values.
pub fn named_params<B: burn::tensor::backend::Backend>(
    model: &kiln::models::CausalLm<B>,
) -> Vec<(String, burn::tensor::DType, Vec<f32>)> {
    use burn::module::{Module, ModuleVisitor, Param};
    use kiln::models::hf::HfNamed;
    struct Params(std::collections::HashMap<burn::module::ParamId, (burn::tensor::DType, Vec<f32>)>);
    impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Params {
        fn visit_float<const D: usize>(&mut self, param: &Param<burn::tensor::Tensor<B, D>>) {
            let t = param.val();
            let dtype = t.dtype();
            self.0.insert(param.id, (dtype, t.into_data().convert::<f32>().to_vec::<f32>().unwrap()));
        }
    }
    let mut v = Params(Default::default());
    model.visit(&mut v);
    let mut seen = std::collections::HashSet::new();
    model
        .hf_entries()
        .into_iter()
        .filter(|e| seen.insert(e.id))
        .map(|e| {
            let (dtype, values) = v.0[&e.id].clone();
            (e.key, dtype, values)
        })
        .collect()
}

/// The tiny LFM2, Qwen3.5 (DeltaNet scan op) and LFM2-MoE (grouped expert matmuls) shapes.
pub const TINY_SHAPES: [&str; 4] = [
    "configs/models/tiny",
    "configs/models/tiny-qwen3.5",
    "tests/fixtures/lfm2/lfm2-moe-tiny",
    "configs/models/tiny-gemma4",
];

/// Each tiny shape's path and config.
pub fn tiny_shapes() -> impl Iterator<Item = (&'static str, kiln::models::ModelConfig)> {
    TINY_SHAPES.into_iter().map(|shape| {
        let path = project_dir().join(shape).join("config.json");
        (shape, kiln::models::ModelConfig::from_file(&path).unwrap())
    })
}

/// The three losses of benchmark run `a` against run `b`'s (`what` names both): the two after an update
/// within `tolerance` relative, and the first, a forward pass of the same parameters, within a tenth of it
/// (seen within 4e-5 of f32 in half precision), so that a tolerance wide enough for the updates' spread still
/// holds the forward pass tight.
pub fn assert_losses_agree(
    what: &str,
    a: &kiln::train::bench::BenchResult,
    b: &kiln::train::bench::BenchResult,
    tolerance: f64,
) {
    assert_eq!(a.losses.len(), 3, "{what}");
    for (step, (x, y)) in a.losses.iter().zip(&b.losses).enumerate() {
        eprintln!("{what} step {step}: {x} vs {y}");
        let tolerance = if step == 0 { tolerance / 10.0 } else { tolerance };
        assert!((x - y).abs() <= tolerance * y.abs(), "{what} step {step}: {x} vs {y} (tolerance {tolerance:e})");
    }
}

/// 3 steps of 2 rows of 48 tokens, 3 documents a row, `accumulation` micro-batches a step, kiln's ops: the
/// tiny shapes' training comparisons.
pub fn tiny_bench_config(precision: kiln::train::Precision, accumulation: usize) -> kiln::train::bench::BenchConfig {
    kiln::train::bench::BenchConfig {
        seq: 48,
        micro_batch: 2,
        accumulation,
        steps: 3,
        warmup: 0,
        docs_per_row: 3,
        seed: 5,
        lr: 3e-3,
        peak_tflops: None,
        activation_checkpointing: false,
        precision,
        moments: kiln::train::optim::MomentDtype::F32,
        masters: kiln::train::optim::Masters::F32,
        reference_ops: false,
    }
}

/// Trains each tiny shape for 3 steps (2 rows of 48 tokens, 3 documents a row, `accumulation` micro-batches
/// a step) through the benchmark's step with kiln's hand-written ops and with burn's compositions
/// (`--reference-ops`), and checks that the losses agree within `tolerance(shape)` relative. Steps 1 and 2
/// run on parameters each path updated itself: forward, backward and update agree.
pub fn assert_reference_ops_agree(precision: kiln::train::Precision, accumulation: usize, tolerance: fn(&str) -> f64) {
    use kiln::train::bench::{BenchConfig, bench_on_device};
    let cfg = tiny_bench_config(precision, accumulation);
    for (shape, config) in tiny_shapes() {
        let ops = bench_on_device(&config, &cfg, "cpu").unwrap();
        let reference = bench_on_device(&config, &BenchConfig { reference_ops: true, ..cfg.clone() }, "cpu").unwrap();
        assert!(!ops.run.reference_ops && reference.run.reference_ops, "{shape}: the results say which ran");
        assert!(!kiln::models::ops::reference_ops(), "{shape}: the switch is restored after the run");
        assert_losses_agree(&format!("{shape}: ops, reference ops"), &ops, &reference, tolerance(shape));
    }
}

/// Copies the files of `from` (a flat folder: a checkpoint fixture) into `to`, creating it.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}
