//! Scoring one step as the reference scorer does: unit normalization, POSIX shell-word tokens with Python
//! `shlex.split` semantics, multiset token F1 between units, and precision / recall / F1 / first-command
//! exactness over the unit lists, rounded half-to-even to 4 decimals.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::parse::{is_py_space, py_strip};

/// Strip, collapse whitespace runs to one space; an empty unit becomes `<WAIT>`.
pub fn normalize_unit(unit: &str) -> String {
    let joined = unit.split(is_py_space).filter(|p| !p.is_empty()).collect::<Vec<_>>().join(" ");
    if joined.is_empty() { "<WAIT>".into() } else { joined }
}

/// `shlex.split(s)` (POSIX, no comments); `None` where Python raises (unclosed quote, trailing backslash).
pub fn shlex_split(s: &str) -> Option<Vec<String>> {
    let mut tokens = Vec::new();
    let mut token = String::new();
    let mut in_token = false;
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' | '\r' | '\n' => {
                if in_token {
                    tokens.push(std::mem::take(&mut token));
                    in_token = false;
                }
            }
            '\\' => {
                token.push(chars.next()?);
                in_token = true;
            }
            '\'' => {
                in_token = true;
                loop {
                    match chars.next()? {
                        '\'' => break,
                        ch => token.push(ch),
                    }
                }
            }
            '"' => {
                in_token = true;
                loop {
                    match chars.next()? {
                        '"' => break,
                        '\\' => {
                            let next = chars.next()?;
                            if next != '"' && next != '\\' {
                                token.push('\\');
                            }
                            token.push(next);
                        }
                        ch => token.push(ch),
                    }
                }
            }
            other => {
                token.push(other);
                in_token = true;
            }
        }
    }
    if in_token {
        tokens.push(token);
    }
    Some(tokens)
}

/// Tokens of a normalized unit: lowercase; `<wait>` alone; shell words, or plain whitespace split if the
/// shell syntax is broken.
pub fn unit_tokens(unit: &str) -> Vec<String> {
    let lowered = unit.to_lowercase();
    let text = py_strip(&lowered);
    if text.is_empty() {
        return Vec::new();
    }
    if text == "<wait>" {
        return vec!["<wait>".into()];
    }
    shlex_split(text).unwrap_or_else(|| text.split(is_py_space).filter(|p| !p.is_empty()).map(str::to_string).collect())
}

/// Multiset-token F1 of two units' token ids, each sorted: both empty → 1, one empty → 0, else
/// 2PR/(P+R) of the multiset overlap.
pub fn similarity_sorted(a: &[u32], b: &[u32]) -> f64 {
    match (a.is_empty(), b.is_empty()) {
        (true, true) => return 1.0,
        (true, false) | (false, true) => return 0.0,
        _ => {}
    }
    let (mut i, mut j, mut overlap) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                overlap += 1;
                i += 1;
                j += 1;
            }
        }
    }
    if overlap == 0 {
        return 0.0;
    }
    let p = overlap as f64 / a.len() as f64;
    let r = overlap as f64 / b.len() as f64;
    2.0 * p * r / (p + r)
}

/// Python's `round(x, digits)`: the decimal nearest the binary value, ties to even.
pub fn py_round(x: f64, digits: usize) -> f64 {
    format!("{x:.digits$}").parse().unwrap_or(x)
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepScore {
    pub first_cmd_exact: f64,
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
}

/// Scores predicted against reference units (both raw); `legacy_empty` gives 1s when both are empty, as the
/// pre-correction scorer did.
pub fn score_units(pred: &[String], reference: &[String], legacy_empty: bool) -> StepScore {
    let pred: Vec<String> = pred.iter().map(|u| normalize_unit(u)).collect();
    let refs: Vec<String> = reference.iter().map(|u| normalize_unit(u)).collect();
    let zero = StepScore { first_cmd_exact: 0.0, precision: 0.0, recall: 0.0, f1: 0.0 };
    if pred.is_empty() && refs.is_empty() {
        return if legacy_empty {
            StepScore { first_cmd_exact: 1.0, precision: 1.0, recall: 1.0, f1: 1.0 }
        } else {
            zero
        };
    }
    if pred.is_empty() || refs.is_empty() {
        return zero;
    }
    let first = if pred[0].to_lowercase() == refs[0].to_lowercase() { 1.0 } else { 0.0 };
    // Tokens interned to ids and sorted per unit: multiset overlap becomes a merge, with no allocation per pair.
    let mut interner: HashMap<String, u32> = HashMap::new();
    let mut ids = |units: &[String]| -> Vec<Vec<u32>> {
        units
            .iter()
            .map(|u| {
                let mut v: Vec<u32> = unit_tokens(u)
                    .into_iter()
                    .map(|t| {
                        let next = interner.len() as u32;
                        *interner.entry(t).or_insert(next)
                    })
                    .collect();
                v.sort_unstable();
                v
            })
            .collect()
    };
    let pt = ids(&pred);
    let rt = ids(&refs);
    let best = |from: &[Vec<u32>], to: &[Vec<u32>]| -> f64 {
        from.iter().map(|a| to.iter().map(|b| similarity_sorted(a, b)).fold(0.0, f64::max)).sum::<f64>()
            / from.len() as f64
    };
    let recall = best(&rt, &pt);
    let precision = best(&pt, &rt);
    let f1 = if precision + recall > 0.0 { 2.0 * precision * recall / (precision + recall) } else { 0.0 };
    StepScore {
        first_cmd_exact: first,
        precision: py_round(precision, 4),
        recall: py_round(recall, 4),
        f1: py_round(f1, 4),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn shlex_like_python() {
        assert_eq!(shlex_split(r#"grep -r 'foo bar' ."#).unwrap(), s(&["grep", "-r", "foo bar", "."]));
        assert_eq!(shlex_split(r#"echo "a\"b\c" d\ e ''"#).unwrap(), s(&["echo", "a\"b\\c", "d e", ""]));
        assert_eq!(shlex_split("a|b;c && d # e").unwrap(), s(&["a|b;c", "&&", "d", "#", "e"]));
        assert_eq!(shlex_split("echo 'open"), None);
        assert_eq!(shlex_split("echo a\\"), None);
        assert_eq!(shlex_split("x\u{a0}y").unwrap(), s(&["x\u{a0}y"]), "shlex splits on ASCII whitespace only");
    }

    #[test]
    fn rounding_is_half_to_even_on_the_binary_value() {
        assert_eq!(py_round(0.12345, 4), 0.1235); // the binary value is above the tie
        assert_eq!(py_round(2.0 / 3.0, 4), 0.6667);
        assert_eq!(py_round(0.00005, 4), 0.0001);
        assert_eq!(py_round(0.5, 0), 0.0);
    }
}
