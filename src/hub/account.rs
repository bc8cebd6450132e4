//! The token's account and what it may write and read. `/api/whoami-v2` is read whole: hf-hub's `User` keeps
//! the name and the orgs but drops the token's role, its fine-grained scopes and the account's role in each
//! org, and those decide whether a push can succeed. A read token, a read-only org membership or a
//! fine-grained token without `repo.write` where the repo lives is refused when the token is checked (by the
//! pipeline, before it trains), not by the Hub's 403 at the push hours later. What the Hub does not say (an
//! older server, an OAuth token) is not guessed at: the push finds out. A gated repo the Hub refused is
//! explained the same way: the account that must accept its terms, or the fine-grained token's missing grant.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use super::{Hub, HubError, owner};

/// The account behind a token and what the token lets it do.
#[derive(Debug, Clone, PartialEq)]
pub struct Account {
    pub user: String,
    pub orgs: Vec<Membership>,
    pub token: TokenAccess,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Membership {
    pub org: String,
    /// `admin`, `write`, `contributor` or `read`; `None` where the Hub did not say.
    pub role: Option<String>,
}

/// What a token may write, as its role says.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenAccess {
    Read,
    Write,
    FineGrained(Grants),
    /// The Hub did not say: the push finds out.
    Unstated,
}

impl TokenAccess {
    /// What kind of token this is, in words.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenAccess::Read => "a read token",
            TokenAccess::Write => "a write token",
            TokenAccess::FineGrained(_) => "a fine-grained token",
            TokenAccess::Unstated => "a token whose role the Hub did not say",
        }
    }
}

/// What a fine-grained token's scopes grant.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Grants {
    /// `repo.write` on every repo (a global grant).
    pub write_everywhere: bool,
    /// Namespaces (user and org scopes) granted `repo.write`.
    pub write_namespaces: Vec<String>,
    /// Repos (`owner/name`) granted `repo.write`.
    pub write_repos: Vec<String>,
    /// The public gated repos the account was let into (`canReadGatedRepos`).
    pub read_gated: bool,
    /// Namespaces and repos granted `repo.content.read`.
    pub read_scopes: Vec<String>,
}

/// How a token may write to a repo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteAccess {
    /// Anywhere in the repo's namespace, creating the repo included.
    Namespace,
    /// To this one repo (a fine-grained token scoped to it): it must exist, the token cannot create it.
    ThisRepoOnly,
}

/// Why a token may not write to a repo; its display is the second half of a sentence that names the account.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    OtherNamespace { writable: Vec<String> },
    ReadToken,
    ReadOnlyMember { org: String, user: String },
    NotGranted { namespace: String, granted: Vec<String> },
    NotCreatable { repo: String },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::OtherNamespace { writable } if writable.is_empty() => {
                write!(f, "it can write to no namespace. Use a token of the repo's owner")
            }
            Refusal::OtherNamespace { writable } => write!(
                f,
                "it can write to {}. Use a repo id under one of them, or a token of the repo's owner",
                writable.join(", ")
            ),
            Refusal::ReadToken => write!(
                f,
                "it is a read token. Create a token with the write role (huggingface.co/settings/tokens) and set \
                 HF_TOKEN to it"
            ),
            Refusal::ReadOnlyMember { org, user } => write!(
                f,
                "'{user}' has the read role in the organization '{org}', and pushing there needs the contributor, \
                 write or admin role (an admin of '{org}' grants it). Or use a repo id under {user}"
            ),
            Refusal::NotGranted { namespace, granted } => write!(
                f,
                "it is a fine-grained token that grants repo.write {}, not in '{namespace}'. Add '{namespace}' to \
                 the token's write permissions (huggingface.co/settings/tokens), or use a token with the write role",
                if granted.is_empty() { "nowhere".to_string() } else { format!("to {}", granted.join(", ")) }
            ),
            Refusal::NotCreatable { repo } => write!(
                f,
                "it is a fine-grained token that may write to '{repo}' but not create repos in '{}', and '{repo}' \
                 does not exist. Create the repo on the Hub first, or grant the token repo.write on '{}'",
                owner(repo),
                owner(repo)
            ),
        }
    }
}

fn same_name(a: &str, b: &str) -> bool {
    // Hub names are unique regardless of case, and its answers do not always keep the case a user typed.
    a.eq_ignore_ascii_case(b)
}

impl Account {
    /// The account and token of a `/api/whoami-v2` answer.
    pub fn from_whoami(answer: &str) -> Result<Account, String> {
        let who: WhoAmI = serde_json::from_str(answer).map_err(|e| e.to_string())?;
        let orgs = who
            .orgs
            .into_iter()
            .filter_map(|o| o.name.map(|org| Membership { org, role: o.role_in_org.map(|r| r.to_ascii_lowercase()) }))
            .collect();
        let token = match who.auth.and_then(|a| a.access_token) {
            None => TokenAccess::Unstated,
            Some(t) => match t.role.as_deref() {
                Some("read") => TokenAccess::Read,
                Some("write" | "admin") => TokenAccess::Write,
                Some("fineGrained") => TokenAccess::FineGrained(Grants::from(t.fine_grained.unwrap_or_default())),
                _ => TokenAccess::Unstated,
            },
        };
        Ok(Account { user: who.name, orgs, token })
    }

    /// The namespaces the account may create repos in with this token.
    pub fn writable_namespaces(&self) -> Vec<String> {
        let member = self.orgs.iter().filter(|m| m.role.as_deref() != Some("read")).map(|m| m.org.clone());
        let namespaces = std::iter::once(self.user.clone()).chain(member);
        match &self.token {
            TokenAccess::Read => Vec::new(),
            TokenAccess::Write | TokenAccess::Unstated => namespaces.collect(),
            TokenAccess::FineGrained(g) if g.write_everywhere => namespaces.collect(),
            TokenAccess::FineGrained(g) => {
                namespaces.filter(|n| g.write_namespaces.iter().any(|w| same_name(w, n))).collect()
            }
        }
    }

    /// Whether the token may write to `repo` (`owner/name`), and how.
    pub fn write_access(&self, repo: &str) -> Result<WriteAccess, Refusal> {
        if self.token == TokenAccess::Read {
            return Err(Refusal::ReadToken);
        }
        let namespace = owner(repo);
        let membership = self.orgs.iter().find(|m| same_name(&m.org, namespace));
        if !same_name(&self.user, namespace) && membership.is_none() {
            return Err(Refusal::OtherNamespace { writable: self.writable_namespaces() });
        }
        if let Some(m) = membership.filter(|m| m.role.as_deref() == Some("read")) {
            return Err(Refusal::ReadOnlyMember { org: m.org.clone(), user: self.user.clone() });
        }
        match &self.token {
            TokenAccess::FineGrained(g) => {
                if g.write_everywhere || g.write_namespaces.iter().any(|n| same_name(n, namespace)) {
                    Ok(WriteAccess::Namespace)
                } else if g.write_repos.iter().any(|r| same_name(r, repo)) {
                    Ok(WriteAccess::ThisRepoOnly)
                } else {
                    let granted = g.write_namespaces.iter().chain(&g.write_repos).cloned().collect();
                    Err(Refusal::NotGranted { namespace: namespace.to_string(), granted })
                }
            }
            _ => Ok(WriteAccess::Namespace),
        }
    }

    /// What to do about the gated `repo` (its page at `page`) the Hub refused this token: the sentence after
    /// "is gated or private: ".
    pub fn gated_advice(&self, repo: &str, page: &str, token_from: &str) -> String {
        let user = &self.user;
        let terms = format!("accept its terms on {page} signed in as '{user}' (or ask its owners for access)");
        match &self.token {
            TokenAccess::FineGrained(g)
                if !g.read_gated && !g.read_scopes.iter().any(|s| same_name(s, repo) || same_name(s, owner(repo))) =>
            {
                format!(
                    "the token from {token_from} is a fine-grained token of '{user}' that may not read gated repos. \
                     Turn on \"Read access to contents of all public gated repos you can access\" for it \
                     (huggingface.co/settings/tokens), and {terms}"
                )
            }
            _ => format!("the token from {token_from} belongs to '{user}', who has no access to it yet: {terms}"),
        }
    }
}

impl From<FineGrainedAnswer> for Grants {
    fn from(answer: FineGrainedAnswer) -> Grants {
        let has = |permissions: &[String], wanted: &str| permissions.iter().any(|p| p == wanted);
        let mut grants = Grants {
            write_everywhere: has(&answer.global, "repo.write"),
            read_gated: answer.can_read_gated_repos,
            ..Grants::default()
        };
        for scope in &answer.scoped {
            let Some(name) = scope.entity.name.clone() else { continue };
            if has(&scope.permissions, "repo.content.read") {
                grants.read_scopes.push(name.clone());
            }
            if has(&scope.permissions, "repo.write") {
                match scope.entity.kind.as_deref() {
                    Some("user" | "org") => grants.write_namespaces.push(name),
                    _ if name.contains('/') => grants.write_repos.push(name),
                    _ => {}
                }
            }
        }
        grants
    }
}

#[derive(Deserialize)]
struct WhoAmI {
    name: String,
    #[serde(default)]
    orgs: Vec<OrgAnswer>,
    auth: Option<AuthAnswer>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrgAnswer {
    name: Option<String>,
    role_in_org: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AuthAnswer {
    access_token: Option<TokenAnswer>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TokenAnswer {
    role: Option<String>,
    fine_grained: Option<FineGrainedAnswer>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct FineGrainedAnswer {
    #[serde(default)]
    can_read_gated_repos: bool,
    #[serde(default)]
    global: Vec<String>,
    #[serde(default)]
    scoped: Vec<ScopeAnswer>,
}

#[derive(Deserialize)]
struct ScopeAnswer {
    entity: EntityAnswer,
    #[serde(default)]
    permissions: Vec<String>,
}

#[derive(Deserialize)]
struct EntityAnswer {
    #[serde(rename = "type")]
    kind: Option<String>,
    name: Option<String>,
}

impl Hub {
    /// The token's account, from the Hub's whoami. `repo` only names the push in errors.
    pub(super) fn whoami(&self, token: &str, token_from: &str, repo: &str) -> Result<Account, HubError> {
        let url = format!("{}/api/whoami-v2", self.config.endpoint);
        let failed = |message: String| HubError::PushFailed {
            repo: repo.to_string(),
            revision: "main".to_string(),
            doing: "checking the token (whoami)".to_string(),
            endpoint: self.config.endpoint.clone(),
            message,
        };
        let client = reqwest::blocking::Client::builder()
            .user_agent(format!("kiln/{}", env!("CARGO_PKG_VERSION")))
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| HubError::Setup(e.to_string()))?;
        let attempts = self.config.retries.max(1);
        let mut attempt = 1;
        let answer = loop {
            let outcome = client.get(&url).bearer_auth(token).send().and_then(|r| {
                let status = r.status();
                r.text().map(|body| (status, body))
            });
            match outcome {
                Ok((status, body)) if status.is_success() => break body,
                Ok((status, _)) if status.as_u16() == 401 || status.as_u16() == 403 => {
                    return Err(HubError::TokenRefused {
                        token_from: token_from.to_string(),
                        endpoint: self.config.endpoint.clone(),
                    });
                }
                // The Hub limits whoami's rate (429) more tightly than other routes.
                Ok((status, _)) if (status.is_server_error() || status.as_u16() == 429) && attempt < attempts => {}
                Err(e) if (e.is_connect() || e.is_timeout() || e.is_request()) && attempt < attempts => {}
                Ok((status, body)) => return Err(failed(format!("HTTP {status}: {}", first_line(&body)))),
                Err(e) => return Err(failed(crate::errors::chain(&e))),
            }
            std::thread::sleep(Duration::from_millis(200 << attempt.min(6)));
            attempt += 1;
        };
        Account::from_whoami(&answer).map_err(|e| HubError::PushUnexpected {
            repo: repo.to_string(),
            revision: "main".to_string(),
            what: format!("a whoami that names no account ({e}): {}", first_line(&answer)),
        })
    }
}

fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or("");
    let cut: String = line.chars().take(200).collect();
    if cut.len() < line.len() { format!("{cut}…") } else { cut }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(token: &str, orgs: &str) -> Account {
        let answer = format!(
            r#"{{"type": "user", "name": "Ada", "orgs": {orgs}, "auth": {{"type": "access_token", "accessToken": {token}}}}}"#
        );
        Account::from_whoami(&answer).unwrap()
    }

    const ORGS: &str = r#"[{"name": "lab", "roleInOrg": "write"}, {"name": "guild", "roleInOrg": "read"},
        {"name": "club", "roleInOrg": "contributor"}]"#;

    #[test]
    fn a_write_token_writes_to_its_account_and_the_orgs_it_may_write_in() {
        let ada = account(r#"{"displayName": "w", "role": "write"}"#, ORGS);
        assert_eq!(ada.token, TokenAccess::Write);
        assert_eq!(ada.writable_namespaces(), ["Ada", "lab", "club"]);
        for repo in ["Ada/tiny", "ada/tiny", "lab/tiny", "club/tiny"] {
            assert_eq!(ada.write_access(repo), Ok(WriteAccess::Namespace), "{repo}");
        }
        let other = ada.write_access("other/tiny").unwrap_err();
        assert_eq!(other, Refusal::OtherNamespace { writable: vec!["Ada".into(), "lab".into(), "club".into()] });
        assert!(other.to_string().starts_with("it can write to Ada, lab, club. Use a repo id"), "{other}");
        assert!(matches!(ada.write_access("adalab/tiny"), Err(Refusal::OtherNamespace { .. })));
        let guild = ada.write_access("guild/tiny").unwrap_err();
        assert_eq!(guild, Refusal::ReadOnlyMember { org: "guild".into(), user: "Ada".into() });
        assert!(guild.to_string().contains("'Ada' has the read role in the organization 'guild'"), "{guild}");
    }

    #[test]
    fn a_read_token_writes_nowhere() {
        let ada = account(r#"{"role": "read"}"#, ORGS);
        assert_eq!(ada.writable_namespaces(), Vec::<String>::new());
        for repo in ["Ada/tiny", "lab/tiny", "other/tiny"] {
            assert_eq!(ada.write_access(repo), Err(Refusal::ReadToken), "{repo}");
        }
        assert!(Refusal::ReadToken.to_string().contains("a read token. Create a token with the write role"));
    }

    #[test]
    fn a_fine_grained_token_writes_where_its_scopes_grant_repo_write() {
        let token = r#"{"role": "fineGrained", "fineGrained": {"canReadGatedRepos": true, "global": ["discussion.write"],
            "scoped": [
              {"entity": {"_id": "1", "type": "user", "name": "ada"}, "permissions": ["repo.content.read", "repo.write"]},
              {"entity": {"_id": "2", "type": "org", "name": "lab"}, "permissions": ["repo.content.read"]},
              {"entity": {"_id": "3", "type": "model", "name": "lab/granted"}, "permissions": ["repo.write"]},
              {"entity": {"_id": "4", "type": "org", "name": "club"}, "permissions": ["repo.write"]}]}}"#;
        let ada = account(token, ORGS);
        assert_eq!(
            ada.token,
            TokenAccess::FineGrained(Grants {
                write_everywhere: false,
                write_namespaces: vec!["ada".into(), "club".into()],
                write_repos: vec!["lab/granted".into()],
                read_gated: true,
                read_scopes: vec!["ada".into(), "lab".into()],
            })
        );
        assert_eq!(ada.writable_namespaces(), ["Ada", "club"]);
        assert_eq!(ada.write_access("Ada/tiny"), Ok(WriteAccess::Namespace));
        assert_eq!(ada.write_access("club/tiny"), Ok(WriteAccess::Namespace));
        assert_eq!(ada.write_access("lab/granted"), Ok(WriteAccess::ThisRepoOnly));
        let lab = ada.write_access("lab/tiny").unwrap_err();
        let granted = vec!["ada".to_string(), "club".into(), "lab/granted".into()];
        assert_eq!(lab, Refusal::NotGranted { namespace: "lab".into(), granted });
        assert!(
            lab.to_string().contains("grants repo.write to ada, club, lab/granted, not in 'lab'. Add 'lab'"),
            "{lab}"
        );
        // Org membership still decides: a scope cannot lift the read role.
        assert!(matches!(ada.write_access("guild/tiny"), Err(Refusal::ReadOnlyMember { .. })));

        let nowhere = account(r#"{"role": "fineGrained", "fineGrained": {"scoped": []}}"#, "[]");
        let refusal = nowhere.write_access("Ada/tiny").unwrap_err();
        assert!(refusal.to_string().contains("grants repo.write nowhere, not in 'Ada'"), "{refusal}");
        let global = account(r#"{"role": "fineGrained", "fineGrained": {"global": ["repo.write"]}}"#, ORGS);
        assert_eq!(global.write_access("lab/tiny"), Ok(WriteAccess::Namespace));
        let not_creatable = Refusal::NotCreatable { repo: "lab/granted".into() }.to_string();
        assert!(
            not_creatable.contains("not create repos in 'lab', and 'lab/granted' does not exist"),
            "{not_creatable}"
        );
    }

    #[test]
    fn a_refused_gated_repo_names_the_account_and_a_missing_fine_grained_grant() {
        let page = "https://huggingface.co/google/gemma";
        let write = account(r#"{"role": "write"}"#, "[]").gated_advice("google/gemma", page, "HF_TOKEN");
        assert_eq!(
            write,
            "the token from HF_TOKEN belongs to 'Ada', who has no access to it yet: accept its terms on \
             https://huggingface.co/google/gemma signed in as 'Ada' (or ask its owners for access)"
        );
        let blind = r#"{"role": "fineGrained", "fineGrained": {"canReadGatedRepos": false, "scoped": []}}"#;
        let advice = account(blind, "[]").gated_advice("google/gemma", page, "HF_TOKEN");
        let start = "the token from HF_TOKEN is a fine-grained token of 'Ada' that may not read gated repos. Turn on \
                     \"Read access to contents of all public gated repos you can access\" for it";
        assert!(advice.starts_with(start), "{advice}");
        assert!(
            advice
                .ends_with("on https://huggingface.co/google/gemma signed in as 'Ada' (or ask its owners for access)")
        );
        // Granted the gated repos, or read on the repo itself: the terms are what is left.
        let scoped = r#"{"role": "fineGrained", "fineGrained": {"scoped": [
            {"entity": {"type": "model", "name": "google/gemma"}, "permissions": ["repo.content.read"]}]}}"#;
        let gated = r#"{"role": "fineGrained", "fineGrained": {"canReadGatedRepos": true}}"#;
        for token in [scoped, gated] {
            let advice = account(token, "[]").gated_advice("google/gemma", page, "HF_TOKEN");
            assert!(advice.contains("belongs to 'Ada', who has no access to it yet"), "{advice}");
        }
    }

    #[test]
    fn what_the_hub_does_not_say_is_left_to_the_push() {
        let bare = Account::from_whoami(r#"{"type": "user", "name": "ada", "orgs": [{"name": "lab"}]}"#).unwrap();
        assert_eq!((bare.token.clone(), bare.orgs[0].role.clone()), (TokenAccess::Unstated, None));
        assert_eq!(bare.write_access("lab/tiny"), Ok(WriteAccess::Namespace));
        let oauth = account(r#"{"role": "somethingNew"}"#, "[]");
        assert_eq!(oauth.token, TokenAccess::Unstated);
        let err = Account::from_whoami(r#"{"error": "no"}"#).unwrap_err();
        assert!(err.contains("missing field `name`"), "{err}");
    }
}
