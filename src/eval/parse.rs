//! Reading a model's reply the way the reference TB2-lite scorer does: fence or brace extraction, JSON with
//! Python `json.loads` rules, command units (scorer v1 and v2), and the keystroke fallback with Python's
//! `unicode_escape` decoding. Pure functions; no regex engine whose behaviour could differ from Python's.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::chat::python::{float_repr, str_repr};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, Default)]
#[serde(rename_all = "lowercase")]
pub enum ScorerVersion {
    /// The original scorer (commit 16748ba).
    V1,
    /// The current scorer (June 2026 results): also top-level `keystrokes`/`command`/`cmd` fields and their
    /// `arguments`/`args`, and a fallback that accepts a string cut off by max_tokens.
    #[default]
    V2,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Parsed {
    pub valid_json: bool,
    pub has_analysis: bool,
    pub has_plan: bool,
    pub task_complete: Option<bool>,
    pub command_units: Vec<String>,
}

/// Python's `str.isspace` for the characters `str.split()` / `strip()` / `\s` treat as whitespace.
pub fn is_py_space(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\u{0b}' | '\u{0c}' | '\r' | '\u{1c}'..='\u{1f}' | ' ' | '\u{85}' | '\u{a0}' | '\u{1680}' | '\u{2000}'..='\u{200a}' | '\u{2028}' | '\u{2029}' | '\u{202f}' | '\u{205f}' | '\u{3000}')
}

pub fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

/// The `{…}` part of a reply: inside the first ```` ``` ```` / ```` ```json ```` fence that holds one (greedy:
/// to the last `}` followed by a closing fence), else from the first `{` to the last `}`.
pub fn extract_braces(text: &str) -> Option<&str> {
    let mut search = 0;
    while let Some(rel) = text[search..].find("```") {
        let fence = search + rel;
        let mut j = fence + 3;
        if text.len() >= j + 4 && text[j..j + 4].eq_ignore_ascii_case("json") {
            j += 4;
        }
        let rest = &text[j..];
        let skipped = rest.len() - rest.trim_start_matches(is_py_space).len();
        let open = j + skipped;
        if text[open..].starts_with('{') {
            // The last '}' that only whitespace separates from a closing fence.
            let mut best = None;
            for (k, _) in text[open..].match_indices('}') {
                let after = &text[open + k + 1..];
                if after.trim_start_matches(is_py_space).starts_with("```") {
                    best = Some(open + k);
                }
            }
            if let Some(close) = best {
                return Some(&text[open..=close]);
            }
        }
        search = fence + 1;
    }
    let first = text.find('{')?;
    let last = text.rfind('}')?;
    (first < last).then(|| &text[first..=last])
}

/// Marks for the non-finite numbers Python's `json.loads` accepts, kept as strings that cannot occur in
/// valid JSON text unescaped.
const NAN: &str = "\u{0}NaN";
const INF: &str = "\u{0}Infinity";
const NEG_INF: &str = "\u{0}-Infinity";

/// Rewrites bare `NaN`, `Infinity`, `-Infinity` outside strings into marked strings so serde_json accepts
/// what Python accepts.
fn mark_non_finite(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let (mut i, mut in_string, mut escaped) = (0, false, false);
    while i < bytes.len() {
        let c = bytes[i];
        if in_string {
            out.push(c as char);
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_string = false;
            }
            i += 1;
            continue;
        }
        let rest = &text[i..];
        let (token, mark) = if rest.starts_with("-Infinity") {
            ("-Infinity", NEG_INF)
        } else if rest.starts_with("Infinity") {
            ("Infinity", INF)
        } else if rest.starts_with("NaN") {
            ("NaN", NAN)
        } else {
            ("", "")
        };
        if !token.is_empty() {
            out.push_str(&serde_json::to_string(mark).unwrap_or_default());
            i += token.len();
            continue;
        }
        // Copy one whole UTF-8 character.
        let ch = rest.chars().next().unwrap_or(' ');
        if ch == '"' {
            in_string = true;
        }
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

/// `json.loads` semantics: strict strings, non-finite numbers accepted, duplicate keys last-wins.
pub fn py_json_loads(text: &str) -> Option<Value> {
    serde_json::from_str(&mark_non_finite(text)).ok()
}

/// Python `str(value)` of a parsed JSON value.
pub fn py_str(v: &Value) -> String {
    match v {
        Value::String(s) => match s.as_str() {
            NAN => "nan".into(),
            INF => "inf".into(),
            NEG_INF => "-inf".into(),
            _ => s.clone(),
        },
        other => py_repr(other),
    }
}

fn py_repr(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.to_string(),
            (_, Some(u)) => u.to_string(),
            _ => float_repr(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => match s.as_str() {
            NAN | INF | NEG_INF => py_str(v),
            _ => str_repr(s),
        },
        Value::Array(a) => format!("[{}]", a.iter().map(py_repr).collect::<Vec<_>>().join(", ")),
        Value::Object(o) => format!(
            "{{{}}}",
            o.iter().map(|(k, v)| format!("{}: {}", str_repr(k), py_repr(v))).collect::<Vec<_>>().join(", ")
        ),
    }
}

fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|f| f != 0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// Lines of a keystroke string: CRLF / CR → LF, split, stripped, empty lines dropped.
pub fn lines_of(keystrokes: &str) -> Vec<String> {
    keystrokes
        .replace("\r\n", "\n")
        .replace('\r', "\n")
        .split('\n')
        .map(py_strip)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

fn units_from_object(obj: &serde_json::Map<String, Value>, version: ScorerVersion) -> Vec<String> {
    let mut units = Vec::new();
    if let Some(Value::Array(commands)) = obj.get("commands") {
        for cmd in commands {
            let Value::Object(c) = cmd else { continue };
            let keystrokes = c.get("keystrokes").map(py_str).unwrap_or_default();
            let lines = lines_of(&keystrokes);
            if lines.is_empty() {
                units.push("<WAIT>".into());
            } else {
                units.extend(lines);
            }
        }
    }
    if version == ScorerVersion::V2 {
        let mut scopes = vec![obj];
        if let Some(Value::Object(args)) = obj.get("arguments").or_else(|| obj.get("args")) {
            scopes.push(args);
        }
        for scope in scopes {
            for key in ["keystrokes", "command", "cmd"] {
                if let Some(Value::String(s)) = scope.get(key) {
                    units.extend(lines_of(s));
                }
            }
        }
    }
    units
}

/// Python's `unicode_escape` codec over the UTF-8 bytes of `body` (non-ASCII bytes read as Latin-1);
/// `None` where Python raises (a truncated `\x`, `\u`, `\U`, or `\N{…}`, which kiln does not resolve).
pub fn unicode_escape(body: &str) -> Option<String> {
    let bytes = body.as_bytes();
    let mut out = String::with_capacity(bytes.len());
    let mut i = 0;
    let hex = |s: &[u8]| -> Option<u32> {
        std::str::from_utf8(s)
            .ok()
            .and_then(|t| u32::from_str_radix(t, 16).ok())
            .filter(|_| s.iter().all(u8::is_ascii_hexdigit))
    };
    while i < bytes.len() {
        let b = bytes[i];
        if b != b'\\' {
            out.push(b as char); // Latin-1: byte value = code point
            i += 1;
            continue;
        }
        let &e = bytes.get(i + 1)?;
        i += 2;
        match e {
            b'\n' => {}
            b'\\' => out.push('\\'),
            b'\'' => out.push('\''),
            b'"' => out.push('"'),
            b'a' => out.push('\u{7}'),
            b'b' => out.push('\u{8}'),
            b'f' => out.push('\u{c}'),
            b'n' => out.push('\n'),
            b'r' => out.push('\r'),
            b't' => out.push('\t'),
            b'v' => out.push('\u{b}'),
            b'0'..=b'7' => {
                let mut n = (e - b'0') as u32;
                let mut taken = 0;
                while taken < 2 && i < bytes.len() && (b'0'..=b'7').contains(&bytes[i]) {
                    n = n * 8 + (bytes[i] - b'0') as u32;
                    i += 1;
                    taken += 1;
                }
                out.push(char::from_u32(n)?);
            }
            b'x' | b'u' | b'U' => {
                let width = match e {
                    b'x' => 2,
                    b'u' => 4,
                    _ => 8,
                };
                let digits = bytes.get(i..i + width)?;
                out.push(char::from_u32(hex(digits)?)?);
                i += width;
            }
            b'N' => return None,
            other => {
                out.push('\\');
                out.push(other as char);
            }
        }
    }
    Some(out)
}

/// `"key"\s*:\s*"(body)"` matches over `text` (closing quote optional in v2), bodies in order.
fn scan_key(text: &str, key: &str, closing_optional: bool) -> Vec<String> {
    let needle = format!("\"{key}\"");
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(rel) = text[from..].find(&needle) {
        let start = from + rel;
        from = start + 1;
        let mut rest = text[start + needle.len()..].trim_start_matches(is_py_space);
        let Some(after_colon) = rest.strip_prefix(':') else { continue };
        rest = after_colon.trim_start_matches(is_py_space);
        let Some(body_start) = rest.strip_prefix('"') else { continue };
        // Body: non-quote non-backslash characters (newlines included), or a backslash and a non-newline.
        let mut end = 0;
        let mut chars = body_start.char_indices().peekable();
        let mut closed = false;
        while let Some((k, c)) = chars.next() {
            match c {
                '"' => {
                    end = k;
                    closed = true;
                    break;
                }
                '\\' => match chars.peek() {
                    Some(&(_, n)) if n != '\n' => {
                        chars.next();
                    }
                    _ => {
                        end = k;
                        break;
                    }
                },
                _ => {}
            }
            end = k + c.len_utf8();
        }
        if closed || closing_optional {
            found.push(body_start[..end].to_string());
            from = text.len() - body_start.len() + end;
        }
    }
    found
}

fn fallback_units(text: &str, version: ScorerVersion) -> Vec<String> {
    let (keys, optional): (&[&str], bool) = match version {
        ScorerVersion::V1 => (&["keystrokes"], false),
        ScorerVersion::V2 => (&["keystrokes", "command", "cmd"], true),
    };
    let mut units = Vec::new();
    for key in keys {
        for body in scan_key(text, key, optional) {
            let decoded = unicode_escape(&body).unwrap_or(body);
            units.extend(lines_of(&decoded));
        }
    }
    units
}

/// Parses one reply (a prediction or a reference's raw text).
pub fn parse_response(text: &str, version: ScorerVersion) -> Parsed {
    parse_response_object(text, version).0
}

/// `parse_response`, also returning the reply's JSON object when it has one (for callers that look at
/// more keys than the scorer does).
pub fn parse_response_object(text: &str, version: ScorerVersion) -> (Parsed, Option<serde_json::Map<String, Value>>) {
    let trimmed = py_strip(text);
    let object = extract_braces(trimmed).and_then(py_json_loads).and_then(|v| match v {
        Value::Object(o) => Some(o),
        _ => None,
    });
    let (valid_json, has_analysis, has_plan, task_complete, mut units) = match &object {
        Some(o) => (
            true,
            truthy(o.get("analysis")),
            truthy(o.get("plan")),
            o.get("task_complete").and_then(Value::as_bool),
            units_from_object(o, version),
        ),
        None => (false, false, false, None, Vec::new()),
    };
    if units.is_empty() {
        units = fallback_units(text, version);
    }
    (Parsed { valid_json, has_analysis, has_plan, task_complete, command_units: units }, object)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unicode_escape_like_python() {
        assert_eq!(unicode_escape(r#"echo caf\u00e9 \"q\"\n"#).unwrap(), "echo café \"q\"\n");
        assert_eq!(unicode_escape("echo café").unwrap(), "echo cafÃ©");
        assert_eq!(unicode_escape(r"\101\x41\q").unwrap(), "AA\\q");
        assert_eq!(unicode_escape(r"bad \x4"), None);
    }

    #[test]
    fn fences_and_braces() {
        assert_eq!(extract_braces("x ```json\n{\"a\": {}}\n``` y"), Some("{\"a\": {}}"));
        assert_eq!(extract_braces("pre {\"a\": 1} post }"), Some("{\"a\": 1} post }"));
        assert_eq!(extract_braces("} no {"), None);
    }

    #[test]
    fn python_json_quirks() {
        assert!(py_json_loads(r#"{"d": NaN, "e": -Infinity}"#).is_some());
        assert_eq!(py_json_loads(r#"{"k": 1, "k": 2}"#).unwrap()["k"], 2);
        assert!(py_json_loads("{\"a\": \"x\ny\"}").is_none(), "raw control characters are invalid");
        assert_eq!(py_str(&serde_json::json!([1, "a", null, 2.5])), "[1, 'a', None, 2.5]");
    }
}
