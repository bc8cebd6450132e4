//! Chat templates: where a model's template comes from (the checkpoint's `chat_template.jinja`, else
//! `tokenizer_config.json`'s `chat_template` string or named list, or an override file), the special-token
//! variables, and rendering messages to text with the byte spans of `{% generation %}` blocks.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::Environment;
use minijinja::value::{Serde, Value as JinjaValue};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::ChatError;
use super::env::{self, GEN_END, GEN_START, PinnedClock};

/// The template text and where it came from; its sha256 goes into the stats and the model card.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateSource {
    pub text: String,
    /// `path` or `path#name` for a named template in tokenizer_config.json.
    pub origin: String,
    pub sha256: String,
}

impl TemplateSource {
    pub fn new(text: String, origin: String) -> Self {
        let sha256 = crate::hub::sha256_bytes(text.as_bytes());
        TemplateSource { text, origin, sha256 }
    }

    pub fn from_file(path: &Path) -> Result<Self, ChatError> {
        let text = std::fs::read_to_string(path).map_err(|e| ChatError::io(path, e))?;
        Ok(TemplateSource::new(text, path.display().to_string()))
    }
}

fn read_json(path: &Path) -> Result<Value, ChatError> {
    let text = std::fs::read_to_string(path).map_err(|e| ChatError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ChatError::Config { path: path.to_path_buf(), message: e.to_string() })
}

/// The template a checkpoint ships: `override_path` if given, else `chat_template.jinja`, else
/// `tokenizer_config.json`'s `chat_template` (a string, or a list of `{name, template}` where `name`
/// picks one, `default` otherwise).
pub fn find_template(
    model_dir: &Path,
    override_path: Option<&Path>,
    name: Option<&str>,
) -> Result<TemplateSource, ChatError> {
    if let Some(path) = override_path {
        return TemplateSource::from_file(path);
    }
    let jinja = model_dir.join("chat_template.jinja");
    if jinja.is_file() {
        return TemplateSource::from_file(&jinja);
    }
    let config_path = model_dir.join("tokenizer_config.json");
    if !config_path.is_file() {
        return Err(ChatError::NoTemplate { dir: model_dir.to_path_buf() });
    }
    let config = read_json(&config_path)?;
    let origin = config_path.display().to_string();
    match config.get("chat_template") {
        Some(Value::String(text)) => Ok(TemplateSource::new(text.clone(), origin)),
        Some(Value::Array(list)) => {
            let wanted = name.unwrap_or("default");
            let names: Vec<&str> = list.iter().filter_map(|t| t.get("name")?.as_str()).collect();
            list.iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some(wanted))
                .and_then(|t| t.get("template")?.as_str())
                .map(|text| TemplateSource::new(text.to_string(), format!("{origin}#{wanted}")))
                .ok_or_else(|| ChatError::Config {
                    path: config_path.clone(),
                    message: format!("no chat template named '{wanted}' (it has: {})", names.join(", ")),
                })
        }
        _ => Err(ChatError::NoTemplate { dir: model_dir.to_path_buf() }),
    }
}

/// The named special tokens transformers passes to templates (`bos_token`, `eos_token`, …).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SpecialTokens(pub BTreeMap<String, String>);

const SPECIAL_ATTRIBUTES: &[&str] =
    &["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

impl SpecialTokens {
    /// Reads them from `tokenizer_config.json`, falling back to `special_tokens_map.json`; values are either
    /// strings or `{"content": …}` objects.
    pub fn load(model_dir: &Path) -> Result<Self, ChatError> {
        let mut tokens = BTreeMap::new();
        for file in ["special_tokens_map.json", "tokenizer_config.json"] {
            let path = model_dir.join(file);
            if !path.is_file() {
                continue;
            }
            let config = read_json(&path)?;
            for attr in SPECIAL_ATTRIBUTES {
                let value = match config.get(*attr) {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(str::to_string),
                    _ => None,
                };
                if let Some(v) = value {
                    tokens.insert(attr.to_string(), v);
                }
            }
        }
        Ok(SpecialTokens(tokens))
    }

    pub fn get(&self, attr: &str) -> Option<&str> {
        self.0.get(attr).map(String::as_str)
    }
}

/// Rendered text and the byte ranges of its `{% generation %}` blocks.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rendered {
    pub text: String,
    pub spans: Vec<Range<usize>>,
}

pub struct ChatTemplate {
    pub source: TemplateSource,
    pub special: SpecialTokens,
    /// True when the template marks assistant output with `{% generation %}`.
    pub has_generation: bool,
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.source.origin)
            .field("sha256", &self.source.sha256)
            .finish()
    }
}

/// Fields transformers reads a message's reasoning from; the first is what templates read.
const REASONING_FIELDS: &[&str] = &["reasoning_content", "thinking", "reasoning"];

/// transformers' message preparation: keys whose value is null are dropped; reasoning given under any of its
/// names is also set as `thinking` (first, unless present) and `reasoning_content`.
pub fn prepare_message(message: &Value) -> Value {
    let Value::Object(obj) = message else { return message.clone() };
    let obj: Map<String, Value> =
        obj.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
    let Some(reasoning) = REASONING_FIELDS.iter().find_map(|k| obj.get(*k)).cloned() else {
        return Value::Object(obj);
    };
    let mut out = Map::new();
    if !obj.contains_key("thinking") {
        out.insert("thinking".into(), reasoning.clone());
    }
    out.extend(obj);
    out.insert("reasoning_content".into(), reasoning);
    Value::Object(out)
}

impl ChatTemplate {
    pub fn new(source: TemplateSource, special: SpecialTokens, clock: PinnedClock) -> Result<Self, ChatError> {
        let (rewritten, has_generation) = env::rewrite_generation_tags(&source.text);
        let env = env::environment(rewritten, clock)
            .map_err(|e| ChatError::Syntax { origin: source.origin.clone(), message: crate::errors::chain(&e) })?;
        Ok(ChatTemplate { source, special, has_generation, env })
    }

    /// The template and special tokens of a model directory (any folder with tokenizer_config.json and / or
    /// chat_template.jinja).
    pub fn load(model_dir: &Path, override_path: Option<&Path>, clock: PinnedClock) -> Result<Self, ChatError> {
        let source = find_template(model_dir, override_path, None)?;
        ChatTemplate::new(source, SpecialTokens::load(model_dir)?, clock)
    }

    /// Renders `messages` as `apply_chat_template(messages, tools=tools, add_generation_prompt=…, **kwargs)`.
    pub fn render(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<Rendered, ChatError> {
        let prepared: Vec<Value> = messages.iter().map(prepare_message).collect();
        if let Some(i) = prepared.iter().position(contains_sentinel) {
            return Err(ChatError::Input {
                message_index: i,
                message: "contains a reserved private-use character (U+E000 or U+E001)".into(),
            });
        }
        let mut ctx = Map::new();
        for (k, v) in &self.special.0 {
            ctx.insert(k.clone(), Value::String(v.clone()));
        }
        for (k, v) in kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Value::Array(prepared));
        ctx.insert("tools".into(), tools.cloned().unwrap_or(Value::Null));
        ctx.insert("documents".into(), Value::Null);
        ctx.insert("add_generation_prompt".into(), Value::Bool(add_generation_prompt));
        let out = env::render(&self.env, JinjaValue::from(Serde(Value::Object(ctx))))
            .map_err(|e| ChatError::Render { origin: self.source.origin.clone(), message: crate::errors::chain(&e) })?;
        let (text, spans) = env::extract_spans(&out)
            .map_err(|message| ChatError::Render { origin: self.source.origin.clone(), message })?;
        Ok(Rendered { text, spans })
    }

    pub fn dir_of(origin: &str) -> Option<PathBuf> {
        Path::new(origin.split('#').next()?).parent().map(Path::to_path_buf)
    }
}

fn contains_sentinel(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains([GEN_START, GEN_END]),
        Value::Array(a) => a.iter().any(contains_sentinel),
        Value::Object(o) => o.values().any(contains_sentinel),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reasoning_is_aliased_like_transformers() {
        let m = prepare_message(&json!({"role": "assistant", "content": "a", "reasoning": "r", "tool_calls": null}));
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"thinking":"r","role":"assistant","content":"a","reasoning":"r","reasoning_content":"r"}"#
        );
        // An explicit `thinking` wins over the alias, as `{"thinking": r, **message}` does in Python.
        let kept = prepare_message(&json!({"role": "assistant", "thinking": "t", "reasoning_content": "r"}));
        assert_eq!((kept["thinking"].as_str(), kept["reasoning_content"].as_str()), (Some("t"), Some("r")));
    }

    #[test]
    fn templates_come_from_the_checkpoint_in_transformers_order() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": [{"name": "default", "template": "{{ bos_token }}D"}, {"name": "tool_use", "template": "T"}]}"#,
        )
        .unwrap();
        let source = find_template(dir.path(), None, None).unwrap();
        assert!(source.origin.ends_with("tokenizer_config.json#default"));
        let t = ChatTemplate::new(source, SpecialTokens::load(dir.path()).unwrap(), PinnedClock::now()).unwrap();
        assert_eq!(t.render(&[], None, false, &Map::new()).unwrap().text, "<s>D");
        let err = find_template(dir.path(), None, Some("rag")).unwrap_err().to_string();
        assert!(err.contains("default, tool_use"), "{err}");
        std::fs::write(dir.path().join("chat_template.jinja"), "J").unwrap();
        assert!(find_template(dir.path(), None, None).unwrap().origin.ends_with("chat_template.jinja"));
    }
}
