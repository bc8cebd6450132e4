//! The template environment: minijinja configured to render chat templates exactly as transformers'
//! `apply_chat_template` does with Jinja2 (trim/lstrip blocks, Python string and dict methods, Python
//! `json.dumps` and `str()`, `raise_exception`, a pinnable `strftime_now`), plus `{% generation %}` spans.

use std::ops::Range;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

use super::python;

/// Sentinels that mark `{% generation %}` output; inputs holding them are rejected.
pub const GEN_START: char = '\u{E000}';
pub const GEN_END: char = '\u{E001}';
const GEN_MACRO: &str = "__kiln_generation";

/// Rewrites `{% generation %}` / `{% endgeneration %}` (any whitespace-control spelling) into a call block
/// of a macro that wraps its body in sentinels; transformers implements the tag as a call block too, so
/// scoping is identical. Returns the rewritten source and whether the template had the tag.
pub fn rewrite_generation_tags(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len() + 128);
    let mut found = false;
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        out.push_str(&rest[..open]);
        let tag = &rest[open..];
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            rest = "";
            break;
        };
        let inner = &tag[2..close];
        let (left_dash, body) = inner.strip_prefix('-').map_or((false, inner), |b| (true, b));
        let (right_dash, body) = body.strip_suffix('-').map_or((false, body), |b| (true, b));
        let l = if left_dash { "-" } else { "" };
        let r = if right_dash { "-" } else { "" };
        match body.trim() {
            "generation" => {
                found = true;
                out.push_str(&format!("{{%{l} call {GEN_MACRO}() {r}%}}"));
            }
            "endgeneration" => out.push_str(&format!("{{%{l} endcall {r}%}}")),
            _ => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    if found {
        let prelude = format!("{{%- macro {GEN_MACRO}() -%}}{GEN_START}{{{{ caller() }}}}{GEN_END}{{%- endmacro -%}}");
        out.insert_str(0, &prelude);
    }
    (out, found)
}

/// Removes the sentinels from rendered text and returns the byte spans they enclosed.
pub fn extract_spans(rendered: &str) -> Result<(String, Vec<Range<usize>>), String> {
    let mut text = String::with_capacity(rendered.len());
    let mut spans = Vec::new();
    let mut open: Option<usize> = None;
    for c in rendered.chars() {
        match c {
            GEN_START if open.is_none() => open = Some(text.len()),
            GEN_START => return Err("nested {% generation %} blocks".into()),
            GEN_END => match open.take() {
                Some(start) => spans.push(start..text.len()),
                None => return Err("unbalanced {% endgeneration %}".into()),
            },
            c => text.push(c),
        }
    }
    if open.is_some() {
        return Err("unclosed {% generation %} block".into());
    }
    Ok((text, spans))
}

/// A fixed date-time for `strftime_now`, so training renders are reproducible.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PinnedClock(pub chrono::NaiveDateTime);

impl PinnedClock {
    pub fn now() -> Self {
        PinnedClock(chrono::Local::now().naive_local())
    }

    pub fn parse(date: &str) -> Option<Self> {
        let date = date.trim();
        chrono::NaiveDateTime::parse_from_str(date, "%Y-%m-%dT%H:%M:%S")
            .or_else(|_| {
                chrono::NaiveDate::parse_from_str(date, "%Y-%m-%d").map(|d| d.and_hms_opt(0, 0, 0).unwrap_or_default())
            })
            .ok()
            .map(PinnedClock)
    }
}

fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::Number => Some(" ".repeat(v.as_i64().unwrap_or(0).max(0) as usize)),
        Some(v) => Some(v.as_str().unwrap_or_default().to_string()),
    };
    let mut style = python::JsonStyle::with_indent(indent);
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        if let [item, key] = parts.as_slice() {
            style.item_separator = item.as_str().unwrap_or(",").to_string();
            style.key_separator = key.as_str().unwrap_or(":").to_string();
        }
    }
    style.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    style.ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    // Marked safe: the output goes into the prompt verbatim, as with transformers (no HTML escaping).
    Ok(Value::from_safe_string(python::json_dumps(value, &style)))
}

/// Builds the environment for one template source (already rewritten for generation tags).
pub fn environment(source: String, clock: PinnedClock) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build()?);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: &Value| Value::from(python::str(v)));
    env.set_formatter(|out, state, value| match value.kind() {
        ValueKind::Undefined => Ok(()),
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            out.write_str(&python::str(value)).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    });
    env.add_function("raise_exception", |message: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, format!("template raised: {message}")))
    });
    env.add_function("strftime_now", move |format: String| -> Result<Value, Error> {
        use std::fmt::Write;
        let mut out = String::new();
        write!(out, "{}", clock.0.format(&format))
            .map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("bad strftime format {format:?}")))?;
        Ok(Value::from(out))
    });
    env.add_template_owned("chat", source)?;
    Ok(env)
}

/// Renders the template named `chat` with `ctx`.
pub fn render(env: &Environment<'static>, ctx: Value) -> Result<String, Error> {
    env.get_template("chat")?.render(ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_spans() {
        let src = "A{%- generation -%}B{{ x }}{%- endgeneration %}C{% generation %}D{% endgeneration %}";
        let (rewritten, found) = rewrite_generation_tags(src);
        assert!(found);
        let env = environment(rewritten, PinnedClock::now()).unwrap();
        let out = render(&env, minijinja::context! { x => "!" }).unwrap();
        let (text, spans) = extract_spans(&out).unwrap();
        assert_eq!(text, "AB!CD");
        assert_eq!(spans, [1..3, 4..5]);
    }

    #[test]
    fn transformers_compatible_filters_and_functions() {
        let clock = PinnedClock::parse("2026-01-02").unwrap();
        let src = "{{ d | tojson }}|{{ l | string }}|{{ d.get('k') }}|{{ 'a-b'.split('-') }}|{{ strftime_now('%d %b %Y') }}|{{ none }}|{{ true }}|{{ 1.0 }}";
        let env = environment(src.to_string(), clock).unwrap();
        let out = render(&env, minijinja::context! { d => Value::from(minijinja::value::Serde(serde_json::json!({"k": "<v>"}))), l => vec!["x", "y"] }).unwrap();
        assert_eq!(out, r#"{"k": "<v>"}|['x', 'y']|<v>|['a', 'b']|02 Jan 2026|None|True|1.0"#);
        let env = environment("{{ raise_exception('no system role') }}".into(), clock).unwrap();
        let err = render(&env, minijinja::context! {}).unwrap_err().to_string();
        assert!(err.contains("no system role"), "{err}");
    }
}
