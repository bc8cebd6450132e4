//! Python's text forms of template values, so minijinja renders what Jinja2 under transformers renders:
//! `json.dumps` (the `tojson` filter), `str()` / `repr()` (the `string` filter and `{{ list }}`), and
//! `repr(float)`.

use minijinja::value::{Value, ValueKind};

/// `repr(float)`: shortest round-trip digits; fixed notation for exponents in [-4, 16), else `1e+20` style.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let mant = if digits.len() == 1 { digits.clone() } else { format!("{}.{}", &digits[..1], &digits[1..]) };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mant}e{esign}{:02}", exp.abs())
    }
}

fn number_text(v: &Value, for_json: bool) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    match f64::try_from(v.clone()) {
        Ok(f) if for_json && f.is_nan() => "NaN".into(),
        Ok(f) if for_json && f.is_infinite() => if f > 0.0 { "Infinity" } else { "-Infinity" }.into(),
        Ok(f) => float_repr(f),
        Err(_) => v.to_string(),
    }
}

/// Characters `str.isprintable()` rejects beyond the C0/C1 controls: separators and format characters.
fn is_unprintable(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{00a0}' | '\u{00ad}' | '\u{1680}' | '\u{2000}'..='\u{200f}' | '\u{2028}'..='\u{202f}'
            | '\u{205f}'..='\u{2064}' | '\u{2066}'..='\u{206f}' | '\u{3000}' | '\u{feff}'
            | '\u{e000}'..='\u{f8ff}' | '\u{fff9}'..='\u{fffb}')
}

/// `repr(str)`: single quotes unless the text has a single quote and no double quote; Python escapes.
pub fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_unprintable(c) => {
                let n = c as u32;
                if n < 0x100 {
                    out.push_str(&format!("\\x{n:02x}"));
                } else if n < 0x10000 {
                    out.push_str(&format!("\\u{n:04x}"));
                } else {
                    out.push_str(&format!("\\U{n:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// `repr(value)`: containers recurse, strings quoted, `True`/`False`/`None`.
pub fn repr(v: &Value) -> String {
    match v.kind() {
        ValueKind::String => str_repr(v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<String> = v.try_iter().map(|it| it.map(|x| repr(&x)).collect()).unwrap_or_default();
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let items: Vec<String> = v
                .try_iter()
                .map(|keys| {
                    keys.map(|k| format!("{}: {}", repr(&k), repr(&v.get_item(&k).unwrap_or_default()))).collect()
                })
                .unwrap_or_default();
            format!("{{{}}}", items.join(", "))
        }
        _ => str(v),
    }
}

/// `str(value)`: strings as they are, everything else as `repr`.
pub fn str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => number_text(v, false),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable => repr(v),
        _ => v.to_string(),
    }
}

/// Options of `json.dumps` as transformers' `tojson` passes them.
#[derive(Debug, Clone)]
pub struct JsonStyle {
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
    pub ensure_ascii: bool,
}

impl Default for JsonStyle {
    fn default() -> Self {
        JsonStyle {
            indent: None,
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            sort_keys: false,
            ensure_ascii: false,
        }
    }
}

impl JsonStyle {
    /// With an indent, Python's default item separator loses its trailing space.
    pub fn with_indent(indent: Option<String>) -> Self {
        let item_separator = if indent.is_some() { "," } else { ", " }.to_string();
        JsonStyle { indent, item_separator, ..Default::default() }
    }
}

fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `json.dumps(value, ...)` with transformers' defaults (`ensure_ascii=False`).
pub fn json_dumps(v: &Value, style: &JsonStyle) -> String {
    let mut out = String::new();
    write_json(v, style, 0, &mut out);
    out
}

fn newline(style: &JsonStyle, level: usize, out: &mut String) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_json(v: &Value, style: &JsonStyle, level: usize, out: &mut String) {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number_text(v, true)),
        ValueKind::String => json_string(v.as_str().unwrap_or_default(), style.ensure_ascii, out),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter().map(|it| it.collect()).unwrap_or_default();
            if style.sort_keys {
                keys.sort_by_key(str);
            }
            if keys.is_empty() {
                out.push_str("{}");
                return;
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline(style, level + 1, out);
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_string(),
                    ValueKind::Bool => if k.is_true() { "true" } else { "false" }.into(),
                    ValueKind::None => "null".into(),
                    _ => str(k),
                };
                json_string(&key, style.ensure_ascii, out);
                out.push_str(&style.key_separator);
                write_json(&v.get_item(k).unwrap_or_default(), style, level + 1, out);
            }
            newline(style, level, out);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter().map(|it| it.collect()).unwrap_or_default();
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline(style, level + 1, out);
                write_json(item, style, level + 1, out);
            }
            newline(style, level, out);
            out.push(']');
        }
        _ => json_string(&v.to_string(), style.ensure_ascii, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e20, "1e+20"),
            (123456789012345.6, "123456789012345.6"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (1234.5e-10, "1.2345e-07"),
            (100.0, "100.0"),
            (3.0e15, "3000000000000000.0"),
        ] {
            assert_eq!(float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn containers_print_like_python_str() {
        let v =
            Value::from(minijinja::value::Serde(serde_json::json!({"k": [1, "a'b", null, true, 2.0], "s": "x\"y'z"})));
        assert_eq!(str(&v), r#"{'k': [1, "a'b", None, True, 2.0], 's': 'x"y\'z'}"#);
        assert_eq!(str(&Value::from("plain")), "plain");
        assert_eq!(str_repr("tab\there\u{1}é"), "'tab\\there\\x01é'");
    }

    #[test]
    fn json_dumps_matches_python_defaults_and_indent() {
        let v = Value::from(minijinja::value::Serde(
            serde_json::json!({"name": "f", "args": {"q": "é<&>", "n": [1, 2.5]}, "e": {}}),
        ));
        assert_eq!(
            json_dumps(&v, &JsonStyle::default()),
            r#"{"name": "f", "args": {"q": "é<&>", "n": [1, 2.5]}, "e": {}}"#
        );
        let indented = json_dumps(&v, &JsonStyle::with_indent(Some("  ".into())));
        assert_eq!(
            indented,
            "{\n  \"name\": \"f\",\n  \"args\": {\n    \"q\": \"é<&>\",\n    \"n\": [\n      1,\n      2.5\n    ]\n  },\n  \"e\": {}\n}"
        );
        let ascii = JsonStyle { ensure_ascii: true, ..Default::default() };
        assert_eq!(json_dumps(&Value::from("é😀\n"), &ascii), r#""\u00e9\ud83d\ude00\n""#);
    }
}
