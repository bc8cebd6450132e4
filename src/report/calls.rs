//! Tool calls in training targets, and the functions offered for them. Calls are structured (`tool_calls`) or
//! written in a turn's text in the forms of the public tool-use sets: ReAct (`Action:` / `Action Input:`),
//! Hermes / Qwen (`<tool_call>` with JSON, or Qwen3.5's `<function=…>` parameters) and LFM
//! (`<|tool_call_start|>[name(arg=…)]<|tool_call_end|>`). Functions are offered as a conversation's `tools`,
//! or in a list its prompt prints (Hermes' `<tools>`, LFM's tool list, ToolBench's Python list of APIs).
//! `CallChecks` holds each trained call against the schema offered for it.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::chat::python::literal_eval;
use crate::data::{Message, Role};

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
pub fn prompt_tools(messages: &[Message]) -> Vec<Value> {
    let system =
        messages.iter().filter(|m| m.role == Role::System).map(|m| listed_tools(&m.content)).find(|t| !t.is_empty());
    system
        .or_else(|| messages.iter().find(|m| m.role == Role::User).map(|m| listed_tools(&m.content)))
        .unwrap_or_default()
}

/// The functions a conversation offers, by name, and where they were read.
pub struct Offered<'a> {
    functions: HashMap<&'a str, &'a Value>,
    in_prompt: bool,
}

impl<'a> Offered<'a> {
    /// `tools`: the conversation's own when it has any, else those listed in its prompt (`in_prompt`).
    pub fn new(tools: &'a [Value], in_prompt: bool) -> Offered<'a> {
        Offered { functions: tools.iter().filter_map(function_of).collect(), in_prompt }
    }
}

/// How the calls of trained turns agree with the function schemas offered in their conversation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CallChecks {
    /// Calls in trained turns, structured or written in the text.
    pub calls: u64,
    /// Of them, calls written in the turn's text (ReAct, Hermes / Qwen, LFM forms).
    pub from_text: u64,
    /// Of them, calls checked against functions read from a list in the prompt rather than `tools`.
    pub against_prompt_list: u64,
    /// Of them, calls in a conversation that offers no tools kiln can read (no `tools`, no list in the prompt).
    pub no_tools_offered: u64,
    /// Calls with any of the problems below (a call may have several).
    pub off_schema: u64,
    /// Calls to a function the conversation does not offer.
    pub unoffered: u64,
    /// Calls whose arguments do not read as an object (ReAct's `Action Input` not JSON, say), or call tags
    /// with no readable call in them.
    pub unreadable: u64,
    /// Calls passing an argument the function's schema does not declare (`parameters.properties`).
    pub undeclared_arguments: u64,
    /// Calls leaving out an argument the schema requires.
    pub missing_required: u64,
    /// Calls passing null for an argument.
    pub null_arguments: u64,
    /// Calls passing null for an argument the schema does not declare: the mark of a parquet union's keys
    /// written out as JSON (a `datasets` export to JSON lines), which trains calls with other tools' names.
    pub undeclared_nulls: u64,
    /// The first calls off their schema, as `conversation id: function: what is wrong`.
    pub examples: Vec<String>,
}

/// How many calls off their schema `CallChecks::examples` keeps.
const CALL_EXAMPLES: usize = 5;

impl CallChecks {
    pub fn add(&mut self, other: CallChecks) {
        self.calls += other.calls;
        self.from_text += other.from_text;
        self.against_prompt_list += other.against_prompt_list;
        self.no_tools_offered += other.no_tools_offered;
        self.off_schema += other.off_schema;
        self.unoffered += other.unoffered;
        self.unreadable += other.unreadable;
        self.undeclared_arguments += other.undeclared_arguments;
        self.missing_required += other.missing_required;
        self.null_arguments += other.null_arguments;
        self.undeclared_nulls += other.undeclared_nulls;
        let room = CALL_EXAMPLES.saturating_sub(self.examples.len());
        self.examples.extend(other.examples.into_iter().take(room));
    }

    /// Checks one trained turn's calls, structured and written, against the functions `offered`.
    pub fn check_turn(&mut self, conversation: &str, turn: &Message, offered: &Offered) {
        for call in &turn.tool_calls {
            self.check(conversation, &call.function.name, Ok(&call.function.arguments), offered);
        }
        for call in text_calls(&turn.content) {
            self.from_text += 1;
            self.check(conversation, &call.name, call.arguments.as_ref().map_err(String::as_str), offered);
        }
    }

    fn check(&mut self, conversation: &str, name: &str, args: Result<&Map<String, Value>, &str>, offered: &Offered) {
        self.calls += 1;
        if offered.functions.is_empty() {
            self.no_tools_offered += 1;
            return;
        }
        self.against_prompt_list += u64::from(offered.in_prompt);
        let mut problems = Vec::new();
        let parameters = offered.functions.get(name);
        if parameters.is_none() && !name.is_empty() {
            self.unoffered += 1;
            problems.push("not offered".to_string());
        }
        match (args, parameters) {
            (Err(why), _) => {
                self.unreadable += 1;
                problems.push(why.to_string());
            }
            (Ok(args), Some(parameters)) => problems.extend(self.check_arguments(args, parameters)),
            (Ok(_), None) => {}
        }
        if !problems.is_empty() {
            self.off_schema += 1;
            let shown = if name.is_empty() { "(no name)" } else { name };
            self.example(conversation, shown, &problems.join("; "));
        }
    }

    /// Counts the ways `args` leave the function's `parameters` schema, and returns them as words.
    fn check_arguments(&mut self, args: &Map<String, Value>, parameters: &Value) -> Vec<String> {
        // A schema that lists its properties declares them all, unless it admits others.
        let declared = parameters
            .get("properties")
            .and_then(Value::as_object)
            .filter(|_| parameters.get("additionalProperties").is_none_or(|extra| extra == &Value::Bool(false)));
        // A property whose schema is null is no schema: a parquet union's key written out, as in the calls.
        let undeclared: Vec<&String> = declared
            .map(|d| args.keys().filter(|k| d.get(*k).is_none_or(Value::is_null)).collect())
            .unwrap_or_default();
        let nulls: Vec<&String> = args.iter().filter(|(_, v)| v.is_null()).map(|(k, _)| k).collect();
        let required: Vec<&str> = parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).filter(|k| !args.contains_key(*k)).collect())
            .unwrap_or_default();
        self.undeclared_arguments += u64::from(!undeclared.is_empty());
        self.missing_required += u64::from(!required.is_empty());
        self.null_arguments += u64::from(!nulls.is_empty());
        self.undeclared_nulls += u64::from(undeclared.iter().any(|k| args[k.as_str()].is_null()));
        let mut problems = Vec::new();
        if let Some(k) = undeclared.first() {
            problems.push(format!("{k}: not in its schema"));
        }
        if let Some(k) = required.first() {
            problems.push(format!("{k}: required, left out"));
        }
        if let Some(k) = nulls.first() {
            problems.push(format!("{k}: null"));
        }
        problems
    }

    fn example(&mut self, conversation: &str, function: &str, what: &str) {
        if self.examples.len() < CALL_EXAMPLES {
            self.examples.push(format!("{conversation}: {function}: {what}"));
        }
    }
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
    fn written_calls_are_checked_against_the_prompts_list() {
        let tools = listed_tools(
            "[{'name': 'get_weather', 'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}]",
        );
        let offered = Offered::new(&tools, true);
        let turn = Message::new(
            Role::Assistant,
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"town\": \"Oslo\"}}</tool_call><tool_call>{}</tool_call>\nAction: get_weather\nAction Input: {\"city\": \"Oslo\"}\nAction: book\nAction Input: {\"a\": 1",
        );
        let mut checks = CallChecks::default();
        checks.check_turn("c", &turn, &offered);
        let counts = (
            checks.calls,
            checks.from_text,
            checks.against_prompt_list,
            checks.off_schema,
            checks.unoffered,
            checks.unreadable,
            checks.undeclared_arguments,
            checks.missing_required,
        );
        assert_eq!(counts, (4, 4, 4, 3, 1, 2, 1, 1));
        assert_eq!(
            checks.examples,
            [
                "c: book: not offered; Action Input is not JSON",
                "c: get_weather: town: not in its schema; city: required, left out",
                "c: (no name): a call without a `name`",
            ]
        );
        let mut bare = CallChecks::default();
        bare.check_turn("c", &turn, &Offered::new(&[], true));
        assert_eq!((bare.calls, bare.no_tools_offered, bare.against_prompt_list, bare.off_schema), (4, 4, 0, 0));
    }
}
