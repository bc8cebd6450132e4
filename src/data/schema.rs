//! Schema mapping: how one source's rows (as JSON objects) become `Conversation`s, and why a row is dropped.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::conversation::{Conversation, Message, Role, ToolCall};

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
    /// Key inside an assistant message holding its structured function calls (OpenAI's `tool_calls`).
    #[serde(default = "default_tool_calls")]
    pub tool_calls: String,
    /// Column holding the function schemas offered to the model: a list, or a JSON string of one.
    #[serde(default)]
    pub tools: Option<String>,
    /// Key inside a message saying whether an assistant turn is trained on: false or 0 keeps it as history
    /// only (ShareGPT's `weight`, a `train` flag); true, a nonzero number, null or absent trains it.
    #[serde(default)]
    pub train: Option<String>,
    /// Leave out null-valued keys of calls' arguments and of tool schemas, at every depth: for JSON written
    /// from a parquet file's union of keys (`datasets`' `to_json`), where every call carries the other calls'
    /// argument names as nulls. Parquet sources need it not (their reader leaves a struct's null fields out).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drop_nulls: bool,
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
fn default_tool_calls() -> String {
    "tool_calls".into()
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
            tool_calls: default_tool_calls(),
            tools: None,
            train: None,
            drop_nulls: false,
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
    /// A function call without a name, with arguments that are not a JSON object, or on a non-assistant turn.
    BadToolCall(String),
    /// A tools column that is not a list of function schemas with names.
    BadTools(String),
    /// A training flag that is neither a boolean, a number nor null.
    BadTrainFlag,
}

impl DropReason {
    pub fn label(&self) -> &'static str {
        match self {
            DropReason::MissingColumn(_) => "missing_column",
            DropReason::UnknownRole(_) => "unknown_role",
            DropReason::NonStringContent => "non_string_content",
            DropReason::EmptyConversation => "empty_conversation",
            DropReason::NoAssistantTurn => "no_assistant_turn",
            DropReason::BadToolCall(_) => "bad_tool_call",
            DropReason::BadTools(_) => "bad_tools",
            DropReason::BadTrainFlag => "bad_train_flag",
        }
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DropReason::MissingColumn(c) => write!(f, "missing column '{c}'"),
            DropReason::UnknownRole(r) => write!(f, "unknown role '{r}'"),
            DropReason::BadToolCall(why) => write!(f, "bad tool call: {why}"),
            DropReason::BadTools(why) => write!(f, "bad tools: {why}"),
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

    /// The optional columns the recipe names, each with what it feeds (`id`, `task`, `tools` or `meta`), in the
    /// order of `columns()`. A column named twice is listed under its first use.
    pub fn optional_columns(&self) -> Vec<(String, &'static str)> {
        let named = self
            .id
            .iter()
            .map(|c| (c, "id"))
            .chain(self.task.iter().map(|c| (c, "task")))
            .chain(self.tools.iter().map(|c| (c, "tools")));
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
        let mut tools = match self.tools.as_ref().and_then(|c| obj.get(c)) {
            Some(v) => tools_of(v)?,
            None => Vec::new(),
        };
        if self.drop_nulls {
            tools.iter_mut().for_each(drop_null_keys);
        }
        if !messages.iter().any(Message::is_trained_turn) {
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
        Ok(Conversation { id, source: source.to_string(), messages, tools, meta })
    }

    fn message(&self, m: &Value) -> Result<Message, DropReason> {
        let obj = m.as_object().ok_or(DropReason::EmptyConversation)?;
        let role_name = match obj.get(&self.role) {
            Some(Value::String(s)) => s,
            Some(_) => return Err(DropReason::NonStringContent),
            None => return Err(DropReason::MissingColumn(format!("{}.{}", self.messages, self.role))),
        };
        let role = self.role_of(role_name).ok_or_else(|| DropReason::UnknownRole(role_name.clone()))?;
        let mut tool_calls = match obj.get(&self.tool_calls) {
            Some(v) => tool_calls_of(v)?,
            None => Vec::new(),
        };
        if self.drop_nulls {
            tool_calls.iter_mut().for_each(|call| drop_null_keys_in(&mut call.function.arguments));
        }
        if !tool_calls.is_empty() && role != Role::Assistant {
            return Err(DropReason::BadToolCall(format!("a {} message has tool calls", role.as_str())));
        }
        let content = match obj.get(&self.content) {
            // A turn that only calls functions has no text (OpenAI writes null).
            None | Some(Value::Null) if !tool_calls.is_empty() => String::new(),
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
        let field = |key: &str| obj.get(key).and_then(scalar_to_string).filter(|s| !s.is_empty());
        let (name, tool_call_id) =
            if role == Role::Tool { (field("name"), field("tool_call_id")) } else { (None, None) };
        // Only assistant turns are ever supervised; a flag on another role (ShareGPT's weight 0 on human
        // turns) says nothing.
        let flag = self.train.as_ref().filter(|_| role == Role::Assistant).and_then(|k| obj.get(k));
        let train = match flag {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(Value::Number(n)) => n.as_f64() != Some(0.0),
            Some(_) => return Err(DropReason::BadTrainFlag),
        };
        Ok(Message { role, content, reasoning, tool_calls, name, tool_call_id, train })
    }
}

/// A message's function calls: a list (or a JSON string of one) of OpenAI-style calls
/// (`{"id", "type", "function": {"name", "arguments"}}`) or flat ones (`{"name", "arguments"}`, as Hermes and
/// xLAM-style sets write them).
fn tool_calls_of(v: &Value) -> Result<Vec<ToolCall>, DropReason> {
    let calls = list_or_json_list(v).map_err(|why| DropReason::BadToolCall(format!("the calls are {why}")))?;
    calls.iter().map(tool_call).collect()
}

/// A list given as is or as a JSON string of one (Hub exports do both); null and "" are an empty list.
/// The error says what the value is instead.
fn list_or_json_list(v: &Value) -> Result<Vec<Value>, &'static str> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::String(s) if s.trim().is_empty() => Ok(Vec::new()),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Array(list)) => Ok(list),
            Ok(_) => Err("not a list"),
            Err(_) => Err("a string that is not JSON"),
        },
        Value::Array(list) => Ok(list.clone()),
        _ => Err("not a list"),
    }
}

fn tool_call(v: &Value) -> Result<ToolCall, DropReason> {
    let obj = v.as_object().ok_or_else(|| DropReason::BadToolCall("a call is not an object".into()))?;
    let function = match obj.get("function") {
        Some(Value::Object(f)) => f,
        _ => obj,
    };
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.trim().is_empty())
        .ok_or_else(|| DropReason::BadToolCall("a call has no function name".into()))?;
    let not_an_object = || DropReason::BadToolCall(format!("the arguments of '{name}' are not a JSON object"));
    let arguments = match function.get("arguments").or_else(|| function.get("parameters")) {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(args)) => args.clone(),
        Some(Value::String(s)) if s.trim().is_empty() => Map::new(),
        // OpenAI's API sends the arguments as a JSON string; templates iterate them as a mapping.
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(args)) => args,
            _ => return Err(not_an_object()),
        },
        Some(_) => return Err(not_an_object()),
    };
    let id = obj.get("id").and_then(scalar_to_string).filter(|s| !s.is_empty());
    Ok(ToolCall::new(id, name, arguments))
}

/// A tools list given by hand (`kiln chat --tools`), checked and wrapped as a row's are (`tools_of`): the
/// reason it is refused otherwise, where the list has no tools.
pub fn function_tools(list: &Value) -> Result<Vec<Value>, String> {
    if !list.is_array() {
        return Err("not a list of function schemas".into());
    }
    let tools = function_schemas(list)?;
    if tools.is_empty() {
        return Err("an empty list: no tools to offer".into());
    }
    Ok(tools)
}

/// The function schemas of a row, each as `{"type": "function", "function": {…}}`: a bare `{name,
/// description, parameters}` is wrapped, as OpenAI's API and vLLM hand tools to the template at inference
/// (LFM2.5's and Gemma 4's templates read `tool.function.name`).
fn tools_of(v: &Value) -> Result<Vec<Value>, DropReason> {
    function_schemas(v).map_err(DropReason::BadTools)
}

fn function_schemas(v: &Value) -> Result<Vec<Value>, String> {
    let list = list_or_json_list(v)?;
    let named = |o: &Map<String, Value>| o.get("name").and_then(Value::as_str).is_some_and(|n| !n.trim().is_empty());
    list.into_iter()
        .map(|tool| match &tool {
            Value::Object(o) if o.get("function").and_then(Value::as_object).is_some_and(named) => Ok(tool),
            Value::Object(o) if !o.contains_key("function") && named(o) => {
                Ok(serde_json::json!({"type": "function", "function": tool}))
            }
            _ => Err("a tool that is not a function schema with a name".into()),
        })
        .collect()
}

/// Removes the null-valued keys of every object in `value`, at every depth (a list's null elements stay: a
/// list has no keys to be unioned).
fn drop_null_keys(value: &mut Value) {
    match value {
        Value::Object(map) => drop_null_keys_in(map),
        Value::Array(items) => items.iter_mut().for_each(drop_null_keys),
        _ => {}
    }
}

fn drop_null_keys_in(map: &mut Map<String, Value>) {
    map.retain(|_, v| !v.is_null());
    map.values_mut().for_each(drop_null_keys);
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
    fn function_calls_and_tool_schemas_take_the_shape_templates_read() {
        let m = SchemaMapping { messages: "messages".into(), tools: Some("tools".into()), ..Default::default() };
        let row = json!({
            "tools": "[{\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}, {\"type\": \"function\", \"function\": {\"name\": \"search\"}}]",
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"C\"}"}},
                    {"name": "search", "arguments": {"q": "Oslo"}},
                    {"name": "now", "arguments": ""}]},
                {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": "-3"},
                {"role": "assistant", "content": "It is -3°C."}]});
        let conv = m.normalize(&row, "fc", "fc:0").unwrap();
        let line = serde_json::to_value(&conv).unwrap();
        assert_eq!(
            line["tools"],
            json!([
                {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "search"}}
            ])
        );
        let turn = &line["messages"][1];
        assert_eq!(turn["content"], "", "a turn of calls only has empty text");
        assert_eq!(
            turn["tool_calls"],
            json!([
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}},
                {"type": "function", "function": {"name": "search", "arguments": {"q": "Oslo"}}},
                {"type": "function", "function": {"name": "now", "arguments": {}}}
            ])
        );
        // The arguments keep the source's order, as Python's json.loads would.
        let keys: Vec<&String> = conv.messages[1].tool_calls[0].function.arguments.keys().collect();
        assert_eq!(keys, ["city", "unit"]);
        assert_eq!(
            (line["messages"][2]["name"].as_str(), line["messages"][2]["tool_call_id"].as_str()),
            (Some("get_weather"), Some("call_1"))
        );
        let back: Conversation = serde_json::from_value(line).unwrap();
        assert_eq!(back, conv);
    }

    #[test]
    fn a_hand_given_tools_list_is_checked_and_wrapped_as_a_rows() {
        let bare = json!({"name": "bash", "parameters": {"type": "object"}});
        let wrapped = json!({"type": "function", "function": {"name": "ls"}});
        let tools = function_tools(&json!([bare.clone(), wrapped.clone()])).unwrap();
        assert_eq!(tools, [json!({"type": "function", "function": bare}), wrapped]);
        assert_eq!(function_tools(&json!([])).unwrap_err(), "an empty list: no tools to offer");
        assert_eq!(function_tools(&json!({"name": "bash"})).unwrap_err(), "not a list of function schemas");
        assert_eq!(function_tools(&json!("[]")).unwrap_err(), "not a list of function schemas", "no JSON in a string");
        let unnamed = function_tools(&json!([{"description": "runs"}])).unwrap_err();
        assert_eq!(unnamed, "a tool that is not a function schema with a name");
    }

    #[test]
    fn bad_calls_and_tools_are_dropped_with_their_reason() {
        let m = SchemaMapping { tools: Some("tools".into()), ..Default::default() };
        let with = |calls: Value| json!({"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls}]});
        let cases = [
            (with(json!([{"function": {"arguments": "{}"}}])), "bad tool call: a call has no function name"),
            (
                with(json!([{"name": "f", "arguments": "[1, 2]"}])),
                "bad tool call: the arguments of 'f' are not a JSON object",
            ),
            (
                with(json!([{"name": "f", "arguments": "{not json"}])),
                "bad tool call: the arguments of 'f' are not a JSON object",
            ),
            (with(json!("call f")), "bad tool call: the calls are a string that is not JSON"),
            (with(json!({"name": "f"})), "bad tool call: the calls are not a list"),
            (
                json!({"conversations": [{"role": "user", "content": "q", "tool_calls": [{"name": "f"}]}, {"role": "assistant", "content": "a"}]}),
                "bad tool call: a user message has tool calls",
            ),
            (
                json!({"tools": "{\"name\": \"f\"}", "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
                "bad tools: not a list",
            ),
            (
                json!({"tools": [{"description": "no name"}], "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
                "bad tools: a tool that is not a function schema with a name",
            ),
        ];
        for (row, want) in cases {
            let err = m.normalize(&row, "s", "s:0").unwrap_err();
            assert_eq!(err.to_string(), want, "{row}");
        }
        // Null calls or tools are none; a turn without calls still needs its text.
        let plain = json!({"tools": null, "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": null}]});
        assert!(m.normalize(&plain, "s", "s:0").unwrap().messages[1].tool_calls.is_empty());
        let textless =
            json!({"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null}]});
        assert_eq!(m.normalize(&textless, "s", "s:0").unwrap_err().label(), "non_string_content");
    }

    #[test]
    fn drop_nulls_leaves_out_null_keys_of_arguments_and_tool_schemas_only() {
        let row = json!({
            "messages": [
                {"role": "user", "content": "Weather?", "tool_calls": null},
                {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "w",
                    "arguments": {"city": "Oslo", "origin": null, "filters": {"max": 5, "airline": null}, "days": [1, null]}}}]},
                {"role": "assistant", "content": "Cold."}],
            "tools": [{"type": "function", "function": {"name": "w", "description": null, "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "enum": null}, "origin": null}, "required": ["city"]}}}]
        });
        let mut m = SchemaMapping { messages: "messages".into(), tools: Some("tools".into()), ..Default::default() };
        let kept = m.normalize(&row, "s", "s:0").unwrap();
        assert_eq!(kept.messages[1].tool_calls[0].function.arguments["origin"], Value::Null);
        assert!(kept.messages[1].tool_calls[0].function.arguments.contains_key("origin"), "kept as written by default");
        m.drop_nulls = true;
        let conv = m.normalize(&row, "s", "s:0").unwrap();
        assert_eq!(
            Value::Object(conv.messages[1].tool_calls[0].function.arguments.clone()),
            json!({"city": "Oslo", "filters": {"max": 5}, "days": [1, null]})
        );
        assert_eq!(
            conv.tools,
            [json!({"type": "function", "function": {"name": "w", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}}, "required": ["city"]}}})]
        );
        // Serialized without the flag when it is off, so existing recipes hash as before.
        assert!(!serde_json::to_string(&SchemaMapping::default()).unwrap().contains("drop_nulls"));
    }

    #[test]
    fn turns_marked_untrained_stay_as_history() {
        let m = SchemaMapping {
            role: "from".into(),
            content: "value".into(),
            train: Some("weight".into()),
            ..Default::default()
        };
        let row = |weights: [Value; 3]| {
            json!({"conversations": [
                {"from": "human", "value": "q", "weight": 0},
                {"from": "gpt", "value": "a", "weight": weights[0]},
                {"from": "human", "value": "q2"},
                {"from": "gpt", "value": "b", "weight": weights[1]},
                {"from": "gpt", "value": "c", "weight": weights[2]}]})
        };
        let conv = m.normalize(&row([json!(0), json!(1), Value::Null]), "s", "s:0").unwrap();
        let flags: Vec<bool> = conv.messages.iter().map(|msg| msg.train).collect();
        assert_eq!(flags, [true, false, true, true, true], "a human turn's weight says nothing");
        assert_eq!(conv.trained_turns(), 2);
        let line = serde_json::to_value(&conv).unwrap();
        assert_eq!(line["messages"][1]["train"], false);
        assert!(line["messages"][3].get("train").is_none(), "trained turns carry no flag");
        let bools = m.normalize(&row([json!(true), json!(false), json!(0.0)]), "s", "s:0").unwrap();
        assert_eq!(bools.trained_turns(), 1);
        let none = m.normalize(&row([json!(0), json!(false), json!(0)]), "s", "s:0").unwrap_err();
        assert_eq!(none.label(), "no_assistant_turn");
        let bad = m.normalize(&row([json!("no"), json!(1), json!(1)]), "s", "s:0").unwrap_err();
        assert_eq!(bad.label(), "bad_train_flag");
        // Without `schema.train` a weight key is just a key.
        let plain = SchemaMapping { role: "from".into(), content: "value".into(), ..Default::default() };
        assert_eq!(plain.normalize(&row([json!(0), json!(0), json!(0)]), "s", "s:0").unwrap().trained_turns(), 3);
    }

    #[test]
    fn source_specific_role_aliases() {
        let mut m = SchemaMapping::default();
        m.roles.insert("agent".into(), "assistant".into());
        let row = json!({"conversations": [{"role": "user", "content": "a"}, {"role": "agent", "content": "b"}]});
        assert_eq!(m.normalize(&row, "s", "s:0").unwrap().messages[1].role, Role::Assistant);
    }
}
