//! Schema mapping: how one source's rows (as JSON objects) become `Conversation`s, and why a row is dropped.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::conversation::{Conversation, Message, Role};

/// Which fields of a source row hold what. Defaults fit the Terminus-2 parquet corpora.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchemaMapping {
    /// Column holding the list of messages.
    #[serde(default = "default_messages")]
    pub messages: String,
    /// Key of the role inside a message (`from` in ShareGPT / OpenBMB ToolBench).
    #[serde(default = "default_role")]
    pub role: String,
    /// Key of the text inside a message (`value` in ShareGPT / OpenBMB ToolBench).
    #[serde(default = "default_content")]
    pub content: String,
    /// Keys inside a message that may hold separate reasoning, first present wins.
    #[serde(default = "default_reasoning")]
    pub reasoning: Vec<String>,
    /// Column used as the conversation id; the row position is used when absent or empty.
    #[serde(default)]
    pub id: Option<String>,
    /// Column holding the task name (used by decontamination); copied into `meta.task`.
    #[serde(default)]
    pub task: Option<String>,
    /// Further columns copied into `meta`, in this order.
    #[serde(default)]
    pub meta: Vec<String>,
    /// Extra role aliases of this source, mapped onto system | user | assistant | tool.
    #[serde(default)]
    pub roles: BTreeMap<String, String>,
}

fn default_messages() -> String {
    "conversations".into()
}
fn default_role() -> String {
    "role".into()
}
fn default_content() -> String {
    "content".into()
}
fn default_reasoning() -> Vec<String> {
    vec!["reasoning_content".into(), "reasoning".into(), "thinking".into()]
}

impl Default for SchemaMapping {
    fn default() -> Self {
        SchemaMapping {
            messages: default_messages(),
            role: default_role(),
            content: default_content(),
            reasoning: default_reasoning(),
            id: None,
            task: None,
            meta: Vec::new(),
            roles: BTreeMap::new(),
        }
    }
}

/// Why a row was skipped. Each is counted in the ingest stats under `label()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DropReason {
    /// The row is not an object, or lacks the messages column (or it is null).
    MissingColumn(String),
    /// A message's role is not one of the known aliases.
    UnknownRole(String),
    /// A message's content (or role) is not a string (nor a list of text parts).
    NonStringContent,
    /// No messages, or the messages field is not a list of objects.
    EmptyConversation,
    NoAssistantTurn,
}

impl DropReason {
    pub fn label(&self) -> &'static str {
        match self {
            DropReason::MissingColumn(_) => "missing_column",
            DropReason::UnknownRole(_) => "unknown_role",
            DropReason::NonStringContent => "non_string_content",
            DropReason::EmptyConversation => "empty_conversation",
            DropReason::NoAssistantTurn => "no_assistant_turn",
        }
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DropReason::MissingColumn(c) => write!(f, "missing column '{c}'"),
            DropReason::UnknownRole(r) => write!(f, "unknown role '{r}'"),
            other => f.write_str(other.label()),
        }
    }
}

impl SchemaMapping {
    /// The top-level columns a row needs, the messages column first (readers require it, and may drop the
    /// optional ones a file lacks); readers project to these.
    pub fn columns(&self) -> Vec<String> {
        let optional = self.optional_columns().into_iter().map(|(column, _)| column);
        std::iter::once(self.messages.clone()).chain(optional).collect()
    }

    /// The optional columns the recipe names, each with what it feeds (`id`, `task` or `meta`), in the
    /// order of `columns()`. A column named twice is listed under its first use.
    pub fn optional_columns(&self) -> Vec<(String, &'static str)> {
        let named = self.id.iter().map(|c| (c, "id")).chain(self.task.iter().map(|c| (c, "task")));
        let mut out: Vec<(String, &'static str)> = Vec::new();
        for (column, feeds) in named.chain(self.meta.iter().map(|c| (c, "meta"))) {
            if column != &self.messages && !out.iter().any(|(c, _)| c == column) {
                out.push((column.clone(), feeds));
            }
        }
        out
    }

    fn role_of(&self, name: &str) -> Option<Role> {
        match self.roles.get(name) {
            Some(mapped) => Role::from_alias(mapped),
            None => Role::from_alias(name),
        }
    }

    /// Normalizes one row. `fallback_id` names the row when the source has no id column.
    pub fn normalize(&self, row: &Value, source: &str, fallback_id: &str) -> Result<Conversation, DropReason> {
        let obj = row.as_object().ok_or_else(|| DropReason::MissingColumn(self.messages.clone()))?;
        let raw_messages = match obj.get(&self.messages) {
            None | Some(Value::Null) => return Err(DropReason::MissingColumn(self.messages.clone())),
            Some(Value::String(s)) => parse_embedded_list(s)?,
            Some(v) => v.clone(),
        };
        let list = raw_messages.as_array().ok_or(DropReason::EmptyConversation)?;
        if list.is_empty() {
            return Err(DropReason::EmptyConversation);
        }
        let messages = list.iter().map(|m| self.message(m)).collect::<Result<Vec<_>, _>>()?;
        if !messages.iter().any(|m| m.role == Role::Assistant) {
            return Err(DropReason::NoAssistantTurn);
        }

        let id = self
            .id
            .as_ref()
            .and_then(|c| obj.get(c))
            .and_then(scalar_to_string)
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| fallback_id.to_string());
        let mut meta = Map::new();
        if let Some(task_col) = &self.task
            && let Some(v) = obj.get(task_col).filter(|v| !v.is_null())
        {
            meta.insert("task".into(), v.clone());
        }
        for col in &self.meta {
            if let Some(v) = obj.get(col).filter(|v| !v.is_null()) {
                meta.insert(col.clone(), v.clone());
            }
        }
        Ok(Conversation { id, source: source.to_string(), messages, meta })
    }

    fn message(&self, m: &Value) -> Result<Message, DropReason> {
        let obj = m.as_object().ok_or(DropReason::EmptyConversation)?;
        let role_name = match obj.get(&self.role) {
            Some(Value::String(s)) => s,
            Some(_) => return Err(DropReason::NonStringContent),
            None => return Err(DropReason::MissingColumn(format!("{}.{}", self.messages, self.role))),
        };
        let role = self.role_of(role_name).ok_or_else(|| DropReason::UnknownRole(role_name.clone()))?;
        let content = match obj.get(&self.content) {
            Some(v) => text_of(v).ok_or(DropReason::NonStringContent)?,
            None => return Err(DropReason::MissingColumn(format!("{}.{}", self.messages, self.content))),
        };
        let reasoning = self
            .reasoning
            .iter()
            .filter_map(|k| obj.get(k))
            .find_map(|v| v.as_str())
            .filter(|s| !s.is_empty())
            .map(str::to_string);
        Ok(Message { role, content, reasoning })
    }
}

/// Some exports store the message list as a JSON string; accept that, drop anything else.
fn parse_embedded_list(s: &str) -> Result<Value, DropReason> {
    match serde_json::from_str::<Value>(s) {
        Ok(v @ Value::Array(_)) => Ok(v),
        _ => Err(DropReason::NonStringContent),
    }
}

/// A message's text: a string, or a list of OpenAI-style parts whose text parts are concatenated.
fn text_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for part in parts {
                match part {
                    Value::String(s) => out.push_str(s),
                    Value::Object(p) if p.get("type").and_then(Value::as_str).unwrap_or("text") == "text" => {
                        out.push_str(p.get("text")?.as_str()?)
                    }
                    _ => return None,
                }
            }
            Some(out)
        }
        _ => None,
    }
}

fn scalar_to_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn toolbench() -> SchemaMapping {
        SchemaMapping { role: "from".into(), content: "value".into(), id: Some("id".into()), ..Default::default() }
    }

    #[test]
    fn normalizes_sharegpt_style_rows() {
        let row = json!({"id": "q1", "conversations": [
            {"from": "system", "value": "tools"},
            {"from": "user", "value": "weather?"},
            {"from": "assistant", "value": "Action: get_weather"},
            {"from": "function", "value": "{\"t\": 3}"},
            {"from": "assistant", "value": "3 degrees"}]});
        let conv = toolbench().normalize(&row, "toolbench", "toolbench:0").unwrap();
        assert_eq!(conv.id, "q1");
        let roles: Vec<_> = conv.messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::System, Role::User, Role::Assistant, Role::Tool, Role::Assistant]);
    }

    #[test]
    fn keeps_task_and_meta_and_reasoning() {
        let mapping = SchemaMapping { task: Some("task".into()), meta: vec!["episode".into()], ..Default::default() };
        let row = json!({"task": "t-1", "episode": "episode-3", "conversations": [
            {"role": "user", "content": "do"},
            {"role": "assistant", "content": "done", "reasoning_content": "why"}]});
        let conv = mapping.normalize(&row, "terminal", "terminal:7").unwrap();
        assert_eq!(conv.id, "terminal:7");
        assert_eq!(conv.task(), Some("t-1"));
        assert_eq!(conv.meta["episode"], "episode-3");
        assert_eq!(conv.messages[1].reasoning.as_deref(), Some("why"));
    }

    #[test]
    fn each_bad_row_has_its_reason() {
        let m = SchemaMapping::default();
        let cases = [
            (json!({"other": 1}), "missing_column"),
            (json!({"conversations": null}), "missing_column"),
            (json!([1, 2]), "missing_column"),
            (json!({"conversations": []}), "empty_conversation"),
            (json!({"conversations": [{"role": "narrator", "content": "x"}]}), "unknown_role"),
            (json!({"conversations": [{"role": "user", "content": 5}]}), "non_string_content"),
            (json!({"conversations": [{"role": "user", "content": "only a question"}]}), "no_assistant_turn"),
        ];
        for (row, want) in cases {
            assert_eq!(m.normalize(&row, "s", "s:0").unwrap_err().label(), want, "{row}");
        }
    }

    #[test]
    fn text_parts_and_embedded_json_lists_are_accepted() {
        let m = SchemaMapping::default();
        let row = json!({"conversations": "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]},{\"role\":\"gpt\",\"content\":\"c\"}]"});
        let conv = m.normalize(&row, "s", "s:0").unwrap();
        assert_eq!(conv.messages[0].content, "ab");
        assert_eq!(conv.messages[1].role, Role::Assistant);
    }

    #[test]
    fn source_specific_role_aliases() {
        let mut m = SchemaMapping::default();
        m.roles.insert("agent".into(), "assistant".into());
        let row = json!({"conversations": [{"role": "user", "content": "a"}, {"role": "agent", "content": "b"}]});
        assert_eq!(m.normalize(&row, "s", "s:0").unwrap().messages[1].role, Role::Assistant);
    }
}
