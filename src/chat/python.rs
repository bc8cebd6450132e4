//! Python's text forms of values. Written, so minijinja renders what Jinja2 under transformers renders:
//! `json.dumps` (the `tojson` filter), `str()` / `repr()` (the `string` filter and `{{ list }}`), and
//! `repr(float)`. Read back, as `ast.literal_eval` reads them: data sets print tool lists and call arguments
//! with Python's `str()` (ToolBench's API lists, LFM's pythonic calls).

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

/// Reads the Python literal at the start of `text` (white space before it skipped) as `ast.literal_eval`
/// would: dicts, lists, tuples (as lists), quoted strings with Python's escapes, numbers, `True` / `False` /
/// `None`, and JSON's spellings (`true` / `false` / `null`, `\uXXXX` surrogate pairs) too, so that one reader
/// takes either. Returns the value as JSON and the bytes read; the text after it is left alone.
pub fn literal_eval(text: &str) -> Result<(serde_json::Value, usize), String> {
    let mut reader = LiteralReader { text, pos: 0 };
    let value = reader.value(0)?;
    Ok((value, reader.pos))
}

/// How deep containers may nest: a bound on the recursion, far above any tool schema.
const LITERAL_DEPTH: usize = 128;

struct LiteralReader<'a> {
    text: &'a str,
    pos: usize,
}

impl LiteralReader<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn error(&self, what: &str) -> String {
        format!("{what} at byte {}", self.pos)
    }

    fn value(&mut self, depth: usize) -> Result<serde_json::Value, String> {
        use serde_json::Value as Json;
        if depth > LITERAL_DEPTH {
            return Err(self.error("containers nested too deep"));
        }
        self.skip_space();
        match self.peek() {
            None => Err(self.error("a value expected, the text ended")),
            Some(b'{') => self.dict(depth),
            Some(b'[') => {
                self.pos += 1;
                Ok(Json::Array(self.items(b']', depth)?.0))
            }
            Some(b'(') => {
                self.pos += 1;
                let (mut items, comma) = self.items(b')', depth)?;
                // `(x)` is x; `(x,)` and `(x, y)` are tuples.
                Ok(if items.len() == 1 && !comma { items.remove(0) } else { Json::Array(items) })
            }
            Some(q @ (b'\'' | b'"')) => Ok(Json::String(self.string(q)?)),
            Some(b'-' | b'+' | b'.' | b'0'..=b'9') => self.number(),
            Some(c) if c.is_ascii_alphabetic() => {
                let start = self.pos;
                while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_') {
                    self.pos += 1;
                }
                match &self.text[start..self.pos] {
                    "True" | "true" => Ok(Json::Bool(true)),
                    "False" | "false" => Ok(Json::Bool(false)),
                    "None" | "null" => Ok(Json::Null),
                    word => {
                        self.pos = start;
                        Err(self.error(&format!("`{word}` is not a literal")))
                    }
                }
            }
            Some(_) => Err(self.error("a value expected")),
        }
    }

    /// The items up to `close` (already past the opening bracket), and whether a comma followed the last.
    fn items(&mut self, close: u8, depth: usize) -> Result<(Vec<serde_json::Value>, bool), String> {
        let mut items = Vec::new();
        let mut comma = false;
        loop {
            self.skip_space();
            if self.peek() == Some(close) {
                self.pos += 1;
                return Ok((items, comma));
            }
            items.push(self.value(depth + 1)?);
            self.skip_space();
            comma = self.peek() == Some(b',');
            if comma {
                self.pos += 1;
            } else if self.peek().is_none() {
                return Err(self.error(&format!("the text ended before `{}`", close as char)));
            } else if self.peek() != Some(close) {
                return Err(self.error(&format!("`,` or `{}` expected", close as char)));
            }
        }
    }

    fn dict(&mut self, depth: usize) -> Result<serde_json::Value, String> {
        use serde_json::Value as Json;
        self.pos += 1;
        let mut map = serde_json::Map::new();
        loop {
            self.skip_space();
            if self.peek() == Some(b'}') {
                self.pos += 1;
                return Ok(Json::Object(map));
            }
            let key = match self.value(depth + 1)? {
                Json::String(s) => s,
                // Python's dict keys may be numbers or booleans; JSON's keys are their text.
                Json::Number(n) => n.to_string(),
                Json::Bool(b) => if b { "True" } else { "False" }.to_string(),
                _ => return Err(self.error("a dict key that is not a string, number or boolean")),
            };
            self.skip_space();
            if self.peek() != Some(b':') {
                return Err(self.error("`:` expected after a dict key"));
            }
            self.pos += 1;
            let value = self.value(depth + 1)?;
            map.insert(key, value);
            self.skip_space();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {}
                None => return Err(self.error("the text ended before `}`")),
                _ => return Err(self.error("`,` or `}` expected")),
            }
        }
    }

    fn string(&mut self, quote: u8) -> Result<String, String> {
        let start = self.pos;
        let mut out = String::new();
        let mut chars = self.text[start + 1..].char_indices();
        let hex = |digits: &str| u32::from_str_radix(digits, 16).ok();
        while let Some((i, c)) = chars.next() {
            match c {
                c if c as u32 == u32::from(quote) => {
                    self.pos = start + 1 + i + 1;
                    return Ok(out);
                }
                '\n' => break,
                '\\' => {
                    let Some((j, e)) = chars.next() else { break };
                    let rest = &self.text[start + 1 + j + 1..];
                    let mut take = |n: usize| {
                        let digits = rest.get(..n).filter(|d| d.chars().all(|c| c.is_ascii_hexdigit()))?;
                        (0..n).for_each(|_| _ = chars.next());
                        hex(digits)
                    };
                    let code = match e {
                        'n' => '\n' as u32,
                        'r' => '\r' as u32,
                        't' => '\t' as u32,
                        'b' => 0x08,
                        'f' => 0x0c,
                        'v' => 0x0b,
                        'a' => 0x07,
                        '\n' => continue,
                        '0'..='7' => {
                            let digits: String = std::iter::once(e)
                                .chain(rest.chars().take(2).take_while(|c| ('0'..='7').contains(c)))
                                .collect();
                            (1..digits.len()).for_each(|_| _ = chars.next());
                            u32::from_str_radix(&digits, 8).unwrap_or(0)
                        }
                        'x' => take(2).ok_or_else(|| self.error("`\\x` without two hex digits"))?,
                        'U' => take(8).ok_or_else(|| self.error("`\\U` without eight hex digits"))?,
                        'u' => {
                            let high = take(4).ok_or_else(|| self.error("`\\u` without four hex digits"))?;
                            // JSON writes characters beyond the BMP as a surrogate pair.
                            let low = (0xd800..0xdc00).contains(&high).then(|| {
                                let pair = chars.as_str().strip_prefix("\\u")?.get(..4)?;
                                let low = hex(pair).filter(|l| (0xdc00..0xe000).contains(l))?;
                                (0..6).for_each(|_| _ = chars.next());
                                Some(low)
                            });
                            match low.flatten() {
                                Some(low) => 0x10000 + ((high - 0xd800) << 10) + (low - 0xdc00),
                                None => high,
                            }
                        }
                        '\\' | '\'' | '"' | '/' => e as u32,
                        // Python keeps an unknown escape as written.
                        other => {
                            out.push('\\');
                            other as u32
                        }
                    };
                    out.push(char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER));
                }
                c => out.push(c),
            }
        }
        Err(self.error("a string not closed on its line"))
    }

    fn number(&mut self) -> Result<serde_json::Value, String> {
        let start = self.pos;
        let bytes = self.text.as_bytes();
        let mut end = start;
        if matches!(bytes.get(end), Some(b'-' | b'+')) {
            end += 1;
        }
        let mut float = false;
        while let Some(&c) = bytes.get(end) {
            match c {
                b'0'..=b'9' | b'_' => {}
                b'.' => float = true,
                b'e' | b'E' => {
                    float = true;
                    if matches!(bytes.get(end + 1), Some(b'-' | b'+')) {
                        end += 1;
                    }
                }
                _ => break,
            }
            end += 1;
        }
        let digits: String = self.text[start..end].chars().filter(|&c| c != '_' && c != '+').collect();
        let number = if float { None } else { digits.parse::<i64>().ok().map(serde_json::Number::from) };
        let number = number
            .or_else(|| digits.parse::<f64>().ok().and_then(serde_json::Number::from_f64))
            .ok_or_else(|| self.error(&format!("`{}` is not a number", &self.text[start..end])))?;
        self.pos = end;
        Ok(serde_json::Value::Number(number))
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

    #[test]
    fn literals_read_back_as_python_and_json_print_them() {
        let read = |text: &str| literal_eval(text).map(|(v, _)| v);
        let api = r#"[{'name': 'get_weather_for_x', 'description': 'It\'s "live"', 'parameters': {'type': 'object', 'properties': {'city': {'type': 'string', 'example_value': None}}, 'required': ['city'], 'optional': [], 'n': -1.5e3, 'ok': True}}]"#;
        assert_eq!(
            read(api).unwrap(),
            serde_json::json!([{"name": "get_weather_for_x", "description": "It's \"live\"", "parameters": {
                "type": "object", "properties": {"city": {"type": "string", "example_value": null}},
                "required": ["city"], "optional": [], "n": -1500.0, "ok": true}}])
        );
        let json = r#"{"a": [1, 2.5, true, null], "s": "\u00e9\ud83d\ude00\n"}"#;
        assert_eq!(read(json).unwrap(), serde_json::from_str::<serde_json::Value>(json).unwrap());
        for s in ["tab\there\u{1}é", "it's", "both ' and \"", "back\\slash", "\u{200b}\u{1f600}"] {
            assert_eq!(read(&str_repr(s)).unwrap(), serde_json::json!(s), "{s}");
        }
        assert_eq!(read("(1,)").unwrap(), serde_json::json!([1]));
        assert_eq!(read("(1)").unwrap(), serde_json::json!(1));
        assert_eq!(read("{1: 'a', False: 2}").unwrap(), serde_json::json!({"1": "a", "False": 2}));
        assert_eq!(read(r"'\101\x41\N'").unwrap(), serde_json::json!("AA\\N"));
        assert_eq!(literal_eval("  [1] and more"), Ok((serde_json::json!([1]), 5)));
        for (bad, why) in [
            ("[1, 2", "the text ended"),
            ("{'a' 1}", "`:` expected"),
            ("'open\n'", "not closed"),
            ("[foo]", "`foo` is not a literal"),
            ("{[1]: 2}", "dict key"),
            (r"'\x4'", "two hex digits"),
        ] {
            let err = read(bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
        assert!(read(&"[".repeat(200)).unwrap_err().contains("nested too deep"));
    }
}
