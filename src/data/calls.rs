//! Tool calls in training targets, and the functions offered for them. Calls are structured (`tool_calls`) or
//! written in a turn's text in the forms of the public tool-use sets: ReAct (`Action:` / `Action Input:`),
//! Hermes / Qwen (`<tool_call>` with JSON, or Qwen3.5's `<function=…>` parameters) and LFM
//! (`<|tool_call_start|>[name(arg=…)]<|tool_call_end|>`). Functions are offered as a conversation's `tools`,
//! or in a list its prompt prints (Hermes' `<tools>`, LFM's tool list, ToolBench's Python list of APIs).
//! Each call is judged against the schema offered for it: the inspection report counts the verdicts, and a
//! source's `off_schema_calls` keeps the turns they fault as history, or drops their conversations.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::{Conversation, Message, Role};
use crate::chat::python::literal_eval;

/// A call written in a turn's text: the function's name (empty when the call's text names none) and its
/// arguments, or why they do not read as an object.
#[derive(Debug, Clone, PartialEq)]
pub struct TextCall {
    pub name: String,
    pub arguments: Result<Map<String, Value>, String>,
}

impl TextCall {
    fn unreadable(name: &str, why: impl Into<String>) -> TextCall {
        TextCall { name: name.to_string(), arguments: Err(why.into()) }
    }
}

/// The calls written in a turn's text, in the order of their formats: ReAct, Hermes / Qwen, LFM.
pub fn text_calls(text: &str) -> Vec<TextCall> {
    let mut calls = react_calls(text);
    calls.extend(between(text, "<tool_call>", "</tool_call>").into_iter().map(tagged_call));
    for body in between(text, "<|tool_call_start|>", "<|tool_call_end|>") {
        calls.extend(lfm_calls(body));
    }
    calls
}

/// Names of the functions a turn's text calls.
pub fn tool_calls(text: &str) -> Vec<String> {
    text_calls(text).into_iter().map(|c| c.name).filter(|n| !n.is_empty()).collect()
}

/// The lines that start a ReAct field: an `Action Input` runs until one of them.
const REACT_FIELDS: [&str; 4] = ["Action:", "Thought:", "Observation:", "Final Answer:"];

/// `Action: name` lines, each with the `Action Input:` after it (JSON, as ToolBench's runtime reads it).
fn react_calls(text: &str) -> Vec<TextCall> {
    let lines: Vec<&str> = text.lines().collect();
    let mut calls = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let name = lines[i].trim_start().strip_prefix("Action:").map(str::trim).filter(|n| !n.is_empty());
        i += 1;
        let Some(name) = name else { continue };
        let mut input: Option<String> = None;
        while let Some(line) = lines.get(i) {
            let field = line.trim_start();
            if REACT_FIELDS.iter().any(|f| field.starts_with(f)) {
                break;
            }
            match (&mut input, field.strip_prefix("Action Input:")) {
                (None, Some(first)) => input = Some(first.to_string()),
                (Some(text), _) => {
                    text.push('\n');
                    text.push_str(line);
                }
                (None, None) => {}
            }
            i += 1;
        }
        let arguments = match input.as_deref().map(str::trim) {
            None => Err("no Action Input".to_string()),
            // A function without parameters may be called with nothing after `Action Input:`.
            Some("") => Ok(Map::new()),
            Some(json) => match serde_json::from_str::<Value>(json) {
                Ok(Value::Object(args)) => Ok(args),
                Ok(_) => Err("Action Input is not a JSON object".to_string()),
                Err(_) => Err("Action Input is not JSON".to_string()),
            },
        };
        calls.push(TextCall { name: name.to_string(), arguments });
    }
    calls
}

/// One `<tool_call>` body: Hermes' JSON `{"name", "arguments"}`, or Qwen3.5's
/// `<function=name><parameter=key>value</parameter></function>`.
fn tagged_call(body: &str) -> TextCall {
    let body = body.trim();
    if let Some(rest) = body.strip_prefix("<function=") {
        let Some((name, mut params)) = rest.split_once('>') else {
            return TextCall::unreadable("", "a `<function=` tag not closed");
        };
        let mut args = Map::new();
        while let Some(start) = params.find("<parameter=") {
            let after = &params[start + "<parameter=".len()..];
            let Some((key, value)) = after.split_once('>') else {
                return TextCall::unreadable(name, "a `<parameter=` tag not closed");
            };
            let Some((value, rest)) = value.split_once("</parameter>") else {
                return TextCall::unreadable(name, format!("parameter `{key}` without `</parameter>`"));
            };
            // The template writes strings as they are and other values as JSON, each on lines of its own.
            let value = value.strip_prefix('\n').unwrap_or(value);
            let value = value.strip_suffix('\n').unwrap_or(value);
            let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()));
            args.insert(key.to_string(), value);
            params = rest;
        }
        return TextCall { name: name.trim().to_string(), arguments: Ok(args) };
    }
    match serde_json::from_str::<Value>(body) {
        Ok(call) => object_call(&call),
        Err(_) => TextCall::unreadable("", "a `<tool_call>` that is not JSON"),
    }
}

/// A call as a JSON object: `name`, and `arguments` (or `parameters`) as an object or a JSON string of one.
fn object_call(call: &Value) -> TextCall {
    let Some(name) = call.get("name").and_then(Value::as_str) else {
        return TextCall::unreadable("", "a call without a `name`");
    };
    let arguments = match call.get("arguments").or_else(|| call.get("parameters")) {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(args)) => Ok(args.clone()),
        Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(args)) => Ok(args),
            _ => Err("`arguments` is a string that is not a JSON object".to_string()),
        },
        Some(_) => Err("`arguments` is not an object".to_string()),
    };
    TextCall { name: name.to_string(), arguments }
}

/// An LFM call list: JSON objects, or pythonic `[name(key=literal, …), …]`.
fn lfm_calls(body: &str) -> Vec<TextCall> {
    if let Ok(Value::Array(calls)) = serde_json::from_str::<Value>(body.trim()) {
        return calls.iter().map(object_call).collect();
    }
    match pythonic_calls(body) {
        Ok(calls) => calls,
        Err(why) => {
            let names = pythonic_call_names(body);
            if names.is_empty() {
                return vec![TextCall::unreadable("", why)];
            }
            names.into_iter().map(|name| TextCall::unreadable(&name, why.clone())).collect()
        }
    }
}

/// Reads `[name(key=literal, …), …]` with Python's literal rules for the values.
fn pythonic_calls(body: &str) -> Result<Vec<TextCall>, String> {
    let mut rest = body.trim().strip_prefix('[').ok_or("a call list that does not start with `[`")?;
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix(']') {
            return if after.trim().is_empty() { Ok(calls) } else { Err("text after the call list".into()) };
        }
        let name_end =
            rest.find(|c: char| !(c.is_alphanumeric() || matches!(c, '_' | '.' | '-'))).unwrap_or(rest.len());
        let name = &rest[..name_end];
        rest = rest[name_end..].trim_start().strip_prefix('(').ok_or_else(|| format!("`(` expected after `{name}`"))?;
        let mut args = Map::new();
        loop {
            rest = rest.trim_start();
            if let Some(after) = rest.strip_prefix(')') {
                rest = after;
                break;
            }
            let key_end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
            let key = &rest[..key_end];
            let after_key = rest[key_end..].trim_start();
            let Some(value_text) = after_key.strip_prefix('=').filter(|_| !key.is_empty()) else {
                return Err(format!("`{name}` has an argument that is not `key=value`"));
            };
            let (value, used) = literal_eval(value_text).map_err(|e| format!("`{name}({key}=…)`: {e}"))?;
            args.insert(key.to_string(), value);
            rest = value_text[used..].trim_start();
            rest = rest.strip_prefix(',').unwrap_or(rest);
        }
        calls.push(TextCall { name: name.to_string(), arguments: Ok(args) });
        rest = rest.trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

/// Function names of a pythonic call list `[a(x=1), b(y="(")]`: identifiers followed by `(` at the top level.
fn pythonic_call_names(body: &str) -> Vec<String> {
    let mut names = Vec::new();
    let (mut depth, mut quote, mut escaped) = (0i32, None::<char>, false);
    let mut ident = String::new();
    for c in body.chars() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '\'' => quote = Some(c),
            '(' => {
                if depth == 0 && !ident.is_empty() {
                    names.push(std::mem::take(&mut ident));
                }
                depth += 1;
            }
            ')' => depth -= 1,
            c if depth == 0 && (c.is_alphanumeric() || c == '_' || c == '.') => {
                ident.push(c);
                continue;
            }
            _ => {}
        }
        ident.clear();
    }
    names
}

fn between<'a>(text: &'a str, open: &str, close: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(open) {
        let after = &rest[start + open.len()..];
        let Some(end) = after.find(close) else { break };
        out.push(&after[..end]);
        rest = &after[end + close.len()..];
    }
    out
}

/// A function's name and `parameters` schema (null where it has none), from the OpenAI form
/// `{"type": "function", "function": {…}}` or a bare `{"name", "parameters"}`.
fn function_of(tool: &Value) -> Option<(&str, &Value)> {
    let f = tool.get("function").unwrap_or(tool);
    Some((f.get("name")?.as_str()?, f.get("parameters").unwrap_or(&Value::Null)))
}

/// The functions a prompt's text lists: in `<tools>…</tools>` (Hermes, Qwen: a list, or objects a line each),
/// in LFM's `<|tool_list_start|>…<|tool_list_end|>`, or else the first JSON or Python list of function objects
/// printed anywhere (ToolBench: "…you have access to the following APIs: [{'name': …}]").
pub fn listed_tools(text: &str) -> Vec<Value> {
    for (open, close) in [("<tools>", "</tools>"), ("<|tool_list_start|>", "<|tool_list_end|>")] {
        let listed: Vec<Value> = between(text, open, close)
            .into_iter()
            .flat_map(literals)
            .flat_map(|v| match v {
                Value::Array(items) => items,
                other => vec![other],
            })
            .filter(|v| function_of(v).is_some())
            .collect();
        if !listed.is_empty() {
            return listed;
        }
    }
    let mut from = 0;
    while let Some(at) = text[from..].find('[') {
        let start = from + at;
        if text[start + 1..].trim_start().starts_with('{')
            && let Ok((Value::Array(items), _)) = literal_eval(&text[start..])
            && !items.is_empty()
            && items.iter().all(|v| function_of(v).is_some())
        {
            return items;
        }
        from = start + 1;
    }
    Vec::new()
}

/// The literals written one after another in `text`, up to the first that does not read.
fn literals(text: &str) -> Vec<Value> {
    let mut values = Vec::new();
    let mut rest = text;
    while !rest.trim().is_empty() {
        let Ok((value, used)) = literal_eval(rest) else { break };
        values.push(value);
        rest = rest[used..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
    values
}

/// The functions listed in a conversation's prompt: its system messages', or else its first user message's.
fn prompt_tools(messages: &[Message]) -> Vec<Value> {
    let system =
        messages.iter().filter(|m| m.role == Role::System).map(|m| listed_tools(&m.content)).find(|t| !t.is_empty());
    system
        .or_else(|| messages.iter().find(|m| m.role == Role::User).map(|m| listed_tools(&m.content)))
        .unwrap_or_default()
}

/// The functions a conversation offers, by name, and where they were read.
#[derive(Debug, Clone, Default)]
pub struct Offered {
    functions: HashMap<String, Value>,
    /// Read from a list its prompt prints, the conversation having no `tools`.
    pub in_prompt: bool,
}

impl Offered {
    /// The conversation's own `tools` when it has any, else those its prompt lists.
    pub fn of(conv: &Conversation) -> Offered {
        if conv.tools.is_empty() {
            Offered::new(&prompt_tools(&conv.messages), true)
        } else {
            Offered::new(&conv.tools, false)
        }
    }

    pub fn new(tools: &[Value], in_prompt: bool) -> Offered {
        let functions =
            tools.iter().filter_map(function_of).map(|(name, params)| (name.to_string(), params.clone())).collect();
        Offered { functions, in_prompt }
    }
}

/// One call of a turn, judged against the functions its conversation offers.
#[derive(Debug, Clone, PartialEq)]
pub struct CallVerdict {
    /// The function's name; empty when the call's text names none.
    pub name: String,
    /// Written in the turn's text rather than structured.
    pub from_text: bool,
    /// `None` when the conversation offers no tools kiln can read: the call cannot be judged.
    pub problems: Option<CallProblems>,
}

/// How a call leaves the schema offered for it; empty when it keeps to it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallProblems {
    pub unoffered: bool,
    /// Why the arguments do not read as an object.
    pub unreadable: Option<String>,
    /// Arguments the schema's `properties` does not declare.
    pub undeclared: Vec<String>,
    /// An undeclared argument is null: the mark of a parquet union's keys written out as JSON.
    pub undeclared_null: bool,
    /// Required arguments left out.
    pub missing_required: Vec<String>,
    /// Arguments passed as null.
    pub nulls: Vec<String>,
}

impl CallProblems {
    pub fn is_empty(&self) -> bool {
        *self == CallProblems::default()
    }

    /// The problems in words, the first of each kind: `town: not in its schema; city: required, left out`.
    pub fn describe(&self) -> String {
        let mut words = Vec::new();
        if self.unoffered {
            words.push("not offered".to_string());
        }
        words.extend(self.unreadable.clone());
        if let Some(k) = self.undeclared.first() {
            words.push(format!("{k}: not in its schema"));
        }
        if let Some(k) = self.missing_required.first() {
            words.push(format!("{k}: required, left out"));
        }
        if let Some(k) = self.nulls.first() {
            words.push(format!("{k}: null"));
        }
        words.join("; ")
    }
}

/// Each call of `turn`, structured then written in its text, judged against `offered`.
pub fn judge_turn(turn: &Message, offered: &Offered) -> Vec<CallVerdict> {
    turn_calls(turn)
        .into_iter()
        .map(|(call, from_text)| {
            let problems = judge(&call, offered);
            CallVerdict { name: call.name, from_text, problems }
        })
        .collect()
}

/// A turn's calls, structured then written in its text, each with whether it was written.
fn turn_calls(turn: &Message) -> Vec<(TextCall, bool)> {
    let structured = turn
        .tool_calls
        .iter()
        .map(|c| (TextCall { name: c.function.name.clone(), arguments: Ok(c.function.arguments.clone()) }, false));
    structured.chain(text_calls(&turn.content).into_iter().map(|c| (c, true))).collect()
}

/// The trained assistant turns of `conv` with a call off the schema offered for it.
pub fn turns_off_schema(conv: &Conversation) -> Vec<usize> {
    // The offered functions are read (a prompt's list parsed) only once a trained turn has calls.
    let mut offered: Option<Offered> = None;
    let mut faulted = Vec::new();
    for (i, m) in conv.messages.iter().enumerate().filter(|(_, m)| m.is_trained_turn()) {
        let calls = turn_calls(m);
        if calls.is_empty() {
            continue;
        }
        let offered = offered.get_or_insert_with(|| Offered::of(conv));
        let off = |(call, _): &(TextCall, bool)| judge(call, offered).is_some_and(|p| !p.is_empty());
        if calls.iter().any(off) {
            faulted.push(i);
        }
    }
    faulted
}

fn judge(call: &TextCall, offered: &Offered) -> Option<CallProblems> {
    let (name, args) = (call.name.as_str(), call.arguments.as_ref());
    if offered.functions.is_empty() {
        return None;
    }
    let parameters = offered.functions.get(name);
    let mut problems = CallProblems { unoffered: parameters.is_none() && !name.is_empty(), ..Default::default() };
    match (args, parameters) {
        (Err(why), _) => problems.unreadable = Some(why.to_string()),
        (Ok(args), Some(parameters)) => judge_arguments(args, parameters, &mut problems),
        (Ok(_), None) => {}
    }
    Some(problems)
}

fn judge_arguments(args: &Map<String, Value>, parameters: &Value, problems: &mut CallProblems) {
    // A schema that lists its properties declares them all, unless it admits others.
    let declared = parameters
        .get("properties")
        .and_then(Value::as_object)
        .filter(|_| parameters.get("additionalProperties").is_none_or(|extra| extra == &Value::Bool(false)));
    // A property whose schema is null is no schema: a parquet union's key written out, as in the calls.
    let undeclared: Vec<&String> =
        declared.map(|d| args.keys().filter(|k| d.get(*k).is_none_or(Value::is_null)).collect()).unwrap_or_default();
    problems.undeclared_null = undeclared.iter().any(|k| args[k.as_str()].is_null());
    problems.undeclared = undeclared.into_iter().cloned().collect();
    problems.nulls = args.iter().filter(|(_, v)| v.is_null()).map(|(k, _)| k.clone()).collect();
    problems.missing_required = parameters
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).filter(|k| !args.contains_key(*k)).map(str::to_string).collect())
        .unwrap_or_default();
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tool_calls_in_three_formats() {
        assert_eq!(tool_calls("Thought: x\nAction: get_weather\nAction Input: {\"city\": \"Quito\"}"), ["get_weather"]);
        assert_eq!(tool_calls("<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>"), ["search"]);
        assert_eq!(
            tool_calls("<|tool_call_start|>[find(q=\"a(b\"), mod.run(x=[1, 2])]<|tool_call_end|>done"),
            ["find", "mod.run"]
        );
        assert_eq!(tool_calls("<|tool_call_start|>[{\"name\": \"f\", \"arguments\": {}}]<|tool_call_end|>"), ["f"]);
        assert!(tool_calls("no calls here; Action Input: {}").is_empty());
    }

    fn args(v: Value) -> Result<Map<String, Value>, String> {
        Ok(v.as_object().cloned().unwrap_or_default())
    }

    #[test]
    fn written_calls_read_with_their_arguments() {
        let react = "Thought: first\nAction: get_weather\nAction Input: {\n  \"city\": \"Quito\"\n}\nThought: and\nAction: Finish\nAction Input: {'return_type': 'give_answer'}";
        let calls = text_calls(react);
        assert_eq!(calls[0], TextCall { name: "get_weather".into(), arguments: args(json!({"city": "Quito"})) });
        assert_eq!(calls[1], TextCall::unreadable("Finish", "Action Input is not JSON"));
        assert_eq!(text_calls("Action: ping\nAction Input:")[0].arguments, Ok(Map::new()));
        assert_eq!(text_calls("Action: ping\nObservation: x")[0].arguments, Err("no Action Input".into()));
        assert_eq!(
            text_calls("Action: f\nAction Input: [1]")[0].arguments,
            Err("Action Input is not a JSON object".into())
        );

        let hermes = "<tool_call>\n{\"name\": \"a\", \"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call><tool_call>oops</tool_call>";
        let calls = text_calls(hermes);
        assert_eq!(calls[0], TextCall { name: "a".into(), arguments: args(json!({"x": 1})) });
        assert_eq!(calls[1], TextCall::unreadable("", "a `<tool_call>` that is not JSON"));
        let qwen = "<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(
            text_calls(qwen),
            [TextCall { name: "run".into(), arguments: args(json!({"cmd": "ls -la", "n": 3})) }]
        );

        let lfm = "<|tool_call_start|>[find(q='a(b', n=2), mod.run(x=[1, None])]<|tool_call_end|>";
        assert_eq!(
            text_calls(lfm),
            [
                TextCall { name: "find".into(), arguments: args(json!({"q": "a(b", "n": 2})) },
                TextCall { name: "mod.run".into(), arguments: args(json!({"x": [1, null]})) },
            ]
        );
        let positional = text_calls("<|tool_call_start|>[find('a'), g(x=1)]<|tool_call_end|>");
        assert_eq!(positional.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["find", "g"]);
        assert!(positional.iter().all(|c| c.arguments.as_ref().is_err_and(|e| e.contains("`find` has an argument"))));
    }

    #[test]
    fn tool_lists_are_read_from_prompts() {
        let names =
            |tools: Vec<Value>| tools.iter().filter_map(function_of).map(|(n, _)| n.to_string()).collect::<Vec<_>>();
        let toolbench = "You are AutoGPT...\nSpecifically, you have access to the following APIs: [{'name': 'get_x_for_y', 'description': 'It\\'s [live]', 'parameters': {'type': 'object', 'properties': {}, 'required': [], 'optional': []}}, {'name': 'Finish', 'parameters': {}}]";
        assert_eq!(names(listed_tools(toolbench)), ["get_x_for_y", "Finish"]);
        let hermes = "You may call: <tools>\n{\"type\": \"function\", \"function\": {\"name\": \"a\"}}\n{\"type\": \"function\", \"function\": {\"name\": \"b\"}}\n</tools> Use them.";
        assert_eq!(names(listed_tools(hermes)), ["a", "b"]);
        let lfm = "List of tools: <|tool_list_start|>[{\"name\": \"c\", \"parameters\": {}}]<|tool_list_end|>";
        assert_eq!(names(listed_tools(lfm)), ["c"]);
        // Lists of other things are not tool lists.
        assert!(listed_tools("Steps: [{'step': 1}] and [1, 2] and [{'name': 'x'}, 3]").is_empty());
        let messages = [Message::new(Role::System, "no list"), Message::new(Role::User, lfm)];
        assert_eq!(names(prompt_tools(&messages)), ["c"]);
    }

    #[test]
    fn calls_are_judged_against_the_prompts_list() {
        let system = "[{'name': 'get_weather', 'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}]";
        let turn = Message::new(
            Role::Assistant,
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"town\": null}}</tool_call><tool_call>{}</tool_call>\nAction: get_weather\nAction Input: {\"city\": \"Oslo\"}\nAction: book\nAction Input: {\"a\": 1",
        );
        let conv = Conversation {
            id: "c".into(),
            source: "s".into(),
            messages: vec![Message::new(Role::System, system), Message::new(Role::User, "go"), turn.clone()],
            tools: Vec::new(),
            meta: Default::default(),
        };
        let offered = Offered::of(&conv);
        assert!(offered.in_prompt);
        let verdicts = judge_turn(&turn, &offered);
        let shown: Vec<(&str, bool, String)> = verdicts
            .iter()
            .map(|v| {
                (v.name.as_str(), v.from_text, v.problems.as_ref().map(CallProblems::describe).unwrap_or_default())
            })
            .collect();
        assert_eq!(
            shown,
            [
                ("get_weather", true, String::new()),
                ("book", true, "not offered; Action Input is not JSON".into()),
                ("get_weather", true, "town: not in its schema; city: required, left out; town: null".into()),
                ("", true, "a call without a `name`".into()),
            ]
        );
        assert!(verdicts[2].problems.as_ref().is_some_and(|p| p.undeclared_null));
        assert_eq!(turns_off_schema(&conv), [2]);
        // Nothing offered that kiln can read: the calls are not judged.
        let bare = judge_turn(&turn, &Offered::new(&[], true));
        assert!(bare.iter().all(|v| v.problems.is_none()));
        let mut untrained = conv.clone();
        untrained.messages[2].train = false;
        assert!(turns_off_schema(&untrained).is_empty(), "history turns are not trained: not faulted");
    }
}
