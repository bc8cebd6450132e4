//! The inspection report's figures and the pure functions that compute them: distributions, what one
//! conversation contributes (thinking, Terminus-2 actions, tool calls, duplicate keys) and what one shard
//! document contributes (tokens, supervised tokens, thinking tokens in targets). `inspect` streams the run
//! through these; `summary.json` is `Inspection` serialized.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::chat::strip_thinking;
use crate::data::conversation::{Conversation, Message, Role, ToolCall};
use crate::eval::parse::{ScorerVersion, parse_response_object};

/// Count, mean and nearest-rank percentiles (the smallest value with at least p % of values at or below it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Distribution {
    pub count: u64,
    pub mean: f64,
    pub min: u64,
    pub p50: u64,
    pub p95: u64,
    pub p99: u64,
    pub max: u64,
}

impl Distribution {
    /// Sorts `values` in place.
    pub fn of(values: &mut [u32]) -> Distribution {
        if values.is_empty() {
            return Distribution::default();
        }
        values.sort_unstable();
        let n = values.len();
        let rank = |p: f64| u64::from(values[((p * n as f64).ceil() as usize).clamp(1, n) - 1]);
        Distribution {
            count: n as u64,
            mean: values.iter().map(|&v| v as f64).sum::<f64>() / n as f64,
            min: u64::from(values[0]),
            p50: rank(0.50),
            p95: rank(0.95),
            p99: rank(0.99),
            max: u64::from(values[n - 1]),
        }
    }
}

/// One recipe source as ingest saw it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SourceFigures {
    pub recipe: String,
    pub name: String,
    pub rows_read: u64,
    pub kept: u64,
    pub dropped: BTreeMap<String, u64>,
    pub decontaminated: u64,
    pub eval_tasks_hit: BTreeMap<String, u64>,
    pub weight: f64,
    pub emitted: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConversationFigures {
    pub total: u64,
    pub per_source: BTreeMap<String, u64>,
    pub messages: Distribution,
    pub assistant_turns: Distribution,
    /// Assistant turns the source marks not to be trained on (`schema.train`): history only.
    #[serde(default)]
    pub untrained_turns: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SourceSamples {
    pub samples: u64,
    pub tokens: u64,
    pub supervised_tokens: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SampleFigures {
    pub samples: u64,
    pub tokens: u64,
    pub supervised_tokens: u64,
    /// supervised_tokens / tokens.
    pub supervised_share: f64,
    pub per_source: BTreeMap<String, SourceSamples>,
    pub tokens_per_sample: Distribution,
    pub supervised_per_sample: Distribution,
    /// Samples cut to the sequence length (prepare's keep-target truncation).
    pub truncated: u64,
    /// Conversations or samples prepare left out, by reason (too_long, template_error, mask_error).
    pub dropped: BTreeMap<String, u64>,
    pub rows: u64,
    /// Token slots in all rows (rows × their length).
    pub slots: u64,
    pub padding_tokens: u64,
    /// padding_tokens / slots: the share of compute spent on padding.
    pub padding_share: f64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ThinkingFigures {
    pub assistant_turns: u64,
    /// Assistant turns carrying reasoning (a separate field or `<think>` in the content).
    pub turns_with_thinking: u64,
    /// Thinking blocks the template policy removed from history (prepare's count).
    pub blocks_stripped_from_history: u64,
    /// Supervised tokens inside `<think>…</think>` (tags included): reasoning the model is trained to write.
    pub thinking_tokens_in_targets: u64,
    pub samples_with_thinking_targets: u64,
}

/// Terminus-2 style conversations: the prompt asks for a JSON action with `keystrokes`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TerminusFigures {
    pub conversations: u64,
    pub assistant_turns: u64,
    pub valid_json: u64,
    pub with_analysis: u64,
    pub with_plan: u64,
    pub with_commands: u64,
    pub with_task_complete: u64,
    pub task_complete_true: u64,
    pub command_units_per_turn: Distribution,
    /// Turns with parseable JSON and no command unit.
    pub empty_command_turns: u64,
    /// Of those, turns that mark the task complete (an empty final action is expected there).
    pub empty_command_turns_completing: u64,
    pub top_first_words: Vec<(String, u64)>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolFigures {
    pub conversations: u64,
    pub tool_messages: u64,
    pub tool_calls: u64,
    pub calls_per_conversation: Distribution,
    pub top_tools: Vec<(String, u64)>,
    /// The trained turns' structured calls checked against the schemas their conversation offers.
    #[serde(default)]
    pub checks: CallChecks,
}

/// How the structured calls of trained turns agree with the function schemas offered in their conversation
/// (text-format calls, ReAct or Hermes, name tools the prompt describes in prose: they are not checked).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CallChecks {
    /// Structured calls in trained turns.
    pub calls: u64,
    /// Of them, calls in a conversation that offers no tools: the prompt never shows what they call.
    pub no_tools_offered: u64,
    /// Calls with any of the problems below (a call may have several).
    pub off_schema: u64,
    /// Calls to a function the conversation does not offer.
    pub unoffered: u64,
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
        self.no_tools_offered += other.no_tools_offered;
        self.off_schema += other.off_schema;
        self.unoffered += other.unoffered;
        self.undeclared_arguments += other.undeclared_arguments;
        self.missing_required += other.missing_required;
        self.null_arguments += other.null_arguments;
        self.undeclared_nulls += other.undeclared_nulls;
        let room = CALL_EXAMPLES.saturating_sub(self.examples.len());
        self.examples.extend(other.examples.into_iter().take(room));
    }

    /// Checks one call against the functions `offered` (name → its `parameters` schema, or null).
    fn check(&mut self, conversation: &str, call: &ToolCall, offered: &HashMap<&str, &Value>) {
        self.calls += 1;
        if offered.is_empty() {
            self.no_tools_offered += 1;
            return;
        }
        let name = call.function.name.as_str();
        let args = &call.function.arguments;
        let Some(parameters) = offered.get(name) else {
            self.unoffered += 1;
            self.off_schema += 1;
            self.example(conversation, name, "not offered");
            return;
        };
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
        if !problems.is_empty() {
            self.off_schema += 1;
            self.example(conversation, name, &problems.join("; "));
        }
    }

    fn example(&mut self, conversation: &str, function: &str, what: &str) {
        if self.examples.len() < CALL_EXAMPLES {
            self.examples.push(format!("{conversation}: {function}: {what}"));
        }
    }
}

/// The functions a conversation offers: name → its `parameters` schema (null where it has none).
fn offered_functions(tools: &[Value]) -> HashMap<&str, &Value> {
    tools
        .iter()
        .filter_map(|t| t.get("function"))
        .filter_map(|f| Some((f.get("name")?.as_str()?, f.get("parameters").unwrap_or(&Value::Null))))
        .collect()
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DuplicateFigures {
    /// Conversations identical (roles, contents, calls, reasoning, training flags, offered tools) to an
    /// earlier one, mixing-weight copies included.
    pub duplicate_conversations: u64,
    pub assistant_turns: u64,
    /// Assistant turns whose text equals an earlier assistant turn's.
    pub duplicate_targets: u64,
    /// The most repeated targets (first 120 characters) and how often each occurs.
    pub top_repeated_targets: Vec<(String, u64)>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TemplateFigures {
    pub origin: String,
    /// The Hub revision, when the template came from a snapshot in the Hub cache.
    pub revision: Option<String>,
    pub sha256: String,
    pub tokenizer: String,
    pub tokenizer_sha256: String,
    pub mode: String,
    pub thinking: String,
    pub kwargs: serde_json::Map<String, Value>,
    pub seq_len: u64,
    pub layout: String,
    pub truncation: String,
}

/// A sample shown in the report with its mask.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Example {
    /// first | longest | random
    pub kind: String,
    pub sample_id: String,
    pub source: String,
    pub tokens: u64,
    pub supervised: u64,
    #[serde(skip)]
    pub input_ids: Vec<u32>,
    #[serde(skip)]
    pub loss_mask: Vec<u8>,
}

/// Everything the report shows; `report/summary.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Inspection {
    pub run: String,
    pub eval_sets: Vec<String>,
    pub sources: Vec<SourceFigures>,
    pub conversations: ConversationFigures,
    pub samples: SampleFigures,
    pub thinking: ThinkingFigures,
    pub terminus: TerminusFigures,
    pub tools: ToolFigures,
    pub duplicates: DuplicateFigures,
    pub template: TemplateFigures,
    /// The conversations prepare held out for the validation loss (not in the shards the figures count).
    #[serde(default)]
    pub validation: Option<crate::tokens::prepare::ValidationSplit>,
    pub examples: Vec<Example>,
    /// Disagreements between the files of the run (stats.json vs the shards, say): each one is a reason to
    /// distrust the run until explained.
    pub warnings: Vec<String>,
    pub wall_seconds: f64,
}

/// Raw per-item values kept for plots and percentiles (4 bytes per sample / conversation / turn), sorted
/// once the distributions are taken.
#[derive(Debug, Clone, Default)]
pub struct Values {
    pub tokens_per_sample: Vec<u32>,
    pub supervised_per_sample: Vec<u32>,
    pub messages_per_conversation: Vec<u32>,
    pub assistant_turns_per_conversation: Vec<u32>,
    pub command_units_per_turn: Vec<u32>,
    pub tool_calls_per_conversation: Vec<u32>,
}

/// What kind of data a conversation is, for the target checks that apply to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConversationKind {
    Terminus,
    ToolUse,
    #[default]
    Other,
}

/// One Terminus-2 assistant turn, read as the TB2-lite scorer reads a reply.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ActionCheck {
    pub valid_json: bool,
    pub analysis: bool,
    pub plan: bool,
    pub commands: bool,
    pub task_complete: Option<bool>,
    pub command_units: Vec<String>,
}

/// What one conversation contributes to the figures; computed in parallel, merged in order.
#[derive(Debug, Clone, Default)]
pub struct ConversationObservation {
    pub source: String,
    pub messages: u32,
    pub assistant_turns: u32,
    pub untrained_turns: u32,
    pub turns_with_thinking: u32,
    pub kind: ConversationKind,
    pub actions: Vec<ActionCheck>,
    pub tool_messages: u32,
    pub tool_calls: Vec<String>,
    pub call_checks: CallChecks,
    pub key: u64,
    /// (hash, first 120 characters) of each trained assistant turn's text.
    pub targets: Vec<(u64, String)>,
}

fn stable_hash(parts: &[&str]) -> u64 {
    // DefaultHasher::new() uses fixed keys, so the hash is the same on every run.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in parts {
        p.hash(&mut h);
    }
    h.finish()
}

pub fn has_thinking(role: Role, content: &str, reasoning: Option<&str>) -> bool {
    role == Role::Assistant && (reasoning.is_some_and(|r| !r.trim().is_empty()) || content.contains("<think>"))
}

pub fn classify(conv: &Conversation) -> ConversationKind {
    let tool_use = !conv.tools.is_empty()
        || conv.messages.iter().any(|m| m.role == Role::Tool || !m.tool_calls.is_empty())
        || conv.messages.iter().any(|m| m.role == Role::Assistant && !tool_calls(&m.content).is_empty());
    if tool_use {
        ConversationKind::ToolUse
    } else if conv
        .messages
        .iter()
        .any(|m| matches!(m.role, Role::System | Role::User) && m.content.contains("keystrokes"))
    {
        ConversationKind::Terminus
    } else {
        ConversationKind::Other
    }
}

/// Reads a Terminus-2 reply: which fields the JSON action has and its command units (scorer v2 rules).
pub fn check_action(reply: &str) -> ActionCheck {
    let (parsed, object) = parse_response_object(reply, ScorerVersion::V2);
    ActionCheck {
        valid_json: parsed.valid_json,
        analysis: parsed.has_analysis,
        plan: parsed.has_plan,
        commands: object.is_some_and(|o| o.contains_key("commands")),
        task_complete: parsed.task_complete,
        command_units: parsed.command_units,
    }
}

/// Names of the tools an assistant turn calls, in the formats of the public tool-use sets: ReAct
/// (`Action: name`), Hermes / Qwen (`<tool_call>{"name": …}</tool_call>`) and LFM
/// (`<|tool_call_start|>[name(…), …]<|tool_call_end|>`).
pub fn tool_calls(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.trim_start().strip_prefix("Action:") {
            let name = rest.trim();
            if !name.is_empty() {
                names.push(name.to_string());
            }
        }
    }
    for body in between(text, "<tool_call>", "</tool_call>") {
        if let Some(name) = serde_json::from_str::<Value>(body.trim()).ok().as_ref().and_then(|v| v.get("name")) {
            names.push(name.as_str().map_or_else(|| name.to_string(), str::to_string));
        }
    }
    for body in between(text, "<|tool_call_start|>", "<|tool_call_end|>") {
        match serde_json::from_str::<Value>(body.trim()) {
            Ok(Value::Array(calls)) => {
                names.extend(calls.iter().filter_map(|c| c.get("name").and_then(Value::as_str)).map(str::to_string))
            }
            _ => names.extend(pythonic_call_names(body)),
        }
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

const SNIPPET_CHARS: usize = 120;

pub fn observe(conv: &Conversation) -> ConversationObservation {
    let kind = classify(conv);
    let mut obs = ConversationObservation {
        source: conv.source.clone(),
        messages: conv.messages.len() as u32,
        kind,
        ..Default::default()
    };
    let tools = serde_json::to_string(&conv.tools).unwrap_or_default();
    let offered = offered_functions(&conv.tools);
    let targets: Vec<Cow<str>> = conv.messages.iter().map(target_text).collect();
    let mut key_parts = Vec::with_capacity(conv.messages.len() * 4 + 1);
    key_parts.push(tools.as_str());
    for (m, target) in conv.messages.iter().zip(&targets) {
        let train = if m.train { "" } else { "untrained" };
        key_parts.extend([m.role.as_str(), target, m.reasoning.as_deref().unwrap_or("\u{0}"), train]);
        match m.role {
            Role::Tool => obs.tool_messages += 1,
            Role::Assistant => {
                obs.assistant_turns += 1;
                obs.turns_with_thinking += u32::from(has_thinking(m.role, &m.content, m.reasoning.as_deref()));
                if !m.train {
                    // History only: the target checks are about what is trained.
                    obs.untrained_turns += 1;
                    continue;
                }
                obs.targets.push((stable_hash(&[target]), target.chars().take(SNIPPET_CHARS).collect()));
                match kind {
                    ConversationKind::Terminus => obs.actions.push(check_action(&strip_thinking(&m.content).0)),
                    ConversationKind::ToolUse => {
                        obs.tool_calls.extend(m.tool_calls.iter().map(|c| c.function.name.clone()));
                        for call in &m.tool_calls {
                            obs.call_checks.check(&conv.id, call, &offered);
                        }
                        obs.tool_calls.extend(tool_calls(&m.content));
                    }
                    ConversationKind::Other => {}
                }
            }
            _ => {}
        }
    }
    obs.key = stable_hash(&key_parts);
    obs
}

/// A message's text with its structured calls written after it (`name({"arg": …})`), so that two turns
/// calling different functions with no text are told apart.
fn target_text(m: &Message) -> Cow<'_, str> {
    if m.tool_calls.is_empty() {
        return Cow::Borrowed(&m.content);
    }
    let mut text = m.content.clone();
    for call in &m.tool_calls {
        let args = serde_json::to_string(&call.function.arguments).unwrap_or_default();
        text += &format!("{}{}({args})", if text.is_empty() { "" } else { "\n" }, call.function.name);
    }
    Cow::Owned(text)
}

/// Supervised tokens of one document, and how many of them lie inside `<think>…</think>`.
pub fn supervised_and_thinking(ids: &[u32], mask: &[u8], think: Option<(u32, u32)>) -> (u64, u64) {
    let supervised = mask.iter().filter(|&&m| m != 0).count() as u64;
    let Some((open, close)) = think else { return (supervised, 0) };
    let mut inside = false;
    let mut thinking = 0u64;
    for (&id, &m) in ids.iter().zip(mask) {
        if id == open {
            inside = true;
        }
        if inside && m != 0 {
            thinking += 1;
        }
        if id == close {
            inside = false;
        }
    }
    (supervised, thinking)
}

/// The `k` most frequent keys, ties broken by key.
pub fn top_k(counts: HashMap<String, u64>, k: usize) -> Vec<(String, u64)> {
    let mut all: Vec<(String, u64)> = counts.into_iter().collect();
    all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    all.truncate(k);
    all
}

/// The first word of a command unit, as a person would name the program (`cd`, `python3`, `C-c`).
pub fn first_word(unit: &str) -> Option<&str> {
    unit.split_whitespace().next()
}

pub fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 { 0.0 } else { part as f64 / whole as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::conversation::Message;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<u32> = (1..=100).rev().collect();
        let d = Distribution::of(&mut v);
        assert_eq!((d.count, d.min, d.p50, d.p95, d.p99, d.max), (100, 1, 50, 95, 99, 100));
        assert!((d.mean - 50.5).abs() < 1e-12);
        let d = Distribution::of(&mut [7]);
        assert_eq!((d.p50, d.p99, d.max), (7, 7, 7));
        assert_eq!(Distribution::of(&mut []), Distribution::default());
    }

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

    #[test]
    fn structured_calls_are_counted_and_tell_turns_apart() {
        let call = |name: &str, city: &str| {
            let mut m = Message::new(Role::Assistant, "");
            let args = serde_json::json!({"city": city}).as_object().cloned().unwrap_or_default();
            m.tool_calls.push(crate::data::ToolCall::new(None, name, args));
            m
        };
        let conv = Conversation {
            id: "c".into(),
            source: "calls".into(),
            messages: vec![
                Message::new(Role::User, "Weather in Oslo and Quito?"),
                call("get_weather", "Oslo"),
                Message::new(Role::Tool, "cold"),
                call("get_weather", "Quito"),
            ],
            tools: vec![serde_json::json!({"type": "function", "function": {"name": "get_weather"}})],
            meta: Default::default(),
        };
        let obs = observe(&conv);
        assert_eq!(obs.kind, ConversationKind::ToolUse);
        assert_eq!(obs.tool_calls, ["get_weather", "get_weather"]);
        assert_eq!(obs.targets[0].1, "get_weather({\"city\":\"Oslo\"})");
        assert_ne!(obs.targets[0].0, obs.targets[1].0, "turns of calls only are not all the empty text");
        let mut other_tools = conv.clone();
        other_tools.tools.clear();
        assert_ne!(observe(&other_tools).key, obs.key, "the offered tools are part of a conversation's identity");
    }

    #[test]
    fn structured_calls_are_checked_against_the_offered_schemas() {
        let call = |name: &str, args: Value| {
            let mut m = Message::new(Role::Assistant, "");
            m.tool_calls.push(crate::data::ToolCall::new(None, name, args.as_object().cloned().unwrap_or_default()));
            m
        };
        let weather = serde_json::json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}, "origin": null},
            "required": ["city"]}}});
        let open = serde_json::json!({"type": "function", "function": {"name": "search", "parameters": {
            "type": "object", "properties": {"q": {}}, "additionalProperties": true}}});
        let conv = |id: &str, tools: Vec<Value>, messages: Vec<Message>| Conversation {
            id: id.into(),
            source: "calls".into(),
            messages: [vec![Message::new(Role::User, "go")], messages].concat(),
            tools,
            meta: Default::default(),
        };
        let offered = conv(
            "a",
            vec![weather, open],
            vec![
                call("get_weather", serde_json::json!({"city": "Oslo"})),
                // A parquet union's keys written out as JSON.
                call("get_weather", serde_json::json!({"city": "Oslo", "origin": null, "unit": null})),
                call("get_weather", serde_json::json!({"unit": "celsius"})),
                call("book_flight", serde_json::json!({})),
                // The schema admits other properties.
                call("search", serde_json::json!({"q": "x", "lang": "no"})),
            ],
        );
        let bare = conv("b", vec![], vec![call("get_weather", serde_json::json!({"city": "Oslo"}))]);
        let mut checks = observe(&offered).call_checks;
        checks.add(observe(&bare).call_checks);
        let counts = (
            checks.calls,
            checks.no_tools_offered,
            checks.off_schema,
            checks.unoffered,
            checks.undeclared_arguments,
            checks.missing_required,
            checks.null_arguments,
            checks.undeclared_nulls,
        );
        assert_eq!(counts, (6, 1, 3, 1, 1, 1, 1, 1));
        assert_eq!(
            checks.examples,
            [
                "a: get_weather: origin: not in its schema; origin: null",
                "a: get_weather: city: required, left out",
                "a: book_flight: not offered"
            ]
        );
        // Untrained turns are history: not checked.
        let mut history = offered.clone();
        history.messages.iter_mut().for_each(|m| m.train = false);
        history.messages.push(Message::new(Role::Assistant, "done"));
        assert_eq!(observe(&history).call_checks, CallChecks::default());
    }

    #[test]
    fn terminus_actions_and_thinking() {
        let reply = "<think>look first</think>\n{\"analysis\": \"a\", \"plan\": \"p\", \"commands\": [{\"keystrokes\": \"ls -la\\ncd /app\\n\"}], \"task_complete\": false}";
        let conv = Conversation {
            id: "c".into(),
            source: "terminal".into(),
            messages: vec![
                Message::new(Role::User, "Reply with JSON with keystrokes"),
                Message::new(Role::Assistant, reply),
                Message::new(Role::User, "screen"),
                Message::new(Role::Assistant, "{\"analysis\": \"done\", \"commands\": [], \"task_complete\": true}"),
                Message::new(Role::User, "screen"),
                Message::new(Role::Assistant, "I think we are done"),
            ],
            tools: Vec::new(),
            meta: Default::default(),
        };
        let obs = observe(&conv);
        assert_eq!(obs.kind, ConversationKind::Terminus);
        assert_eq!((obs.assistant_turns, obs.turns_with_thinking, obs.messages), (3, 1, 6));
        let a = &obs.actions;
        assert!(a[0].valid_json && a[0].analysis && a[0].plan && a[0].commands);
        assert_eq!(a[0].command_units, ["ls -la", "cd /app"]);
        assert_eq!(a[0].task_complete, Some(false));
        assert!(a[1].valid_json && a[1].commands && !a[1].plan && a[1].command_units.is_empty());
        assert_eq!(a[1].task_complete, Some(true));
        assert!(!a[2].valid_json);
        let mut copy = conv.clone();
        copy.id = "other id".into();
        assert_eq!(observe(&copy).key, obs.key, "identity ignores ids");
        copy.messages[2].content.push('!');
        assert_ne!(observe(&copy).key, obs.key);
    }

    #[test]
    fn thinking_tokens_counted_inside_supervised_blocks() {
        // ids: 5=<think>, 6=</think>; history block (unsupervised) and a target block.
        let ids = [1, 5, 9, 6, 2, 5, 9, 9, 6, 3, 4];
        let mask = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1];
        assert_eq!(supervised_and_thinking(&ids, &mask, Some((5, 6))), (6, 4));
        assert_eq!(supervised_and_thinking(&ids, &mask, None), (6, 0));
    }

    #[test]
    fn top_k_orders_by_count_then_name() {
        let counts = HashMap::from([("b".to_string(), 2), ("a".to_string(), 2), ("c".to_string(), 5)]);
        assert_eq!(top_k(counts, 2), [("c".to_string(), 5), ("a".to_string(), 2)]);
    }
}
