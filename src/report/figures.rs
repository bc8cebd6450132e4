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
use crate::data::calls::{CallVerdict, Offered, judge_turn, tool_calls};
use crate::data::conversation::{Conversation, Message, Role};
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
    /// Assistant turns ingest kept as history only for a call off its schema (`off_schema_calls`).
    #[serde(default)]
    pub turns_off_schema_untrained: u64,
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
    /// The trained turns' calls checked against the schemas their conversation offers.
    #[serde(default)]
    pub checks: CallChecks,
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

    /// Counts the verdicts on one trained turn's calls (`data::calls::judge_turn`), judged against a list in
    /// the prompt when `in_prompt`.
    pub fn count(&mut self, conversation: &str, verdicts: Vec<CallVerdict>, in_prompt: bool) {
        for verdict in verdicts {
            self.calls += 1;
            self.from_text += u64::from(verdict.from_text);
            let Some(problems) = verdict.problems else {
                self.no_tools_offered += 1;
                continue;
            };
            self.against_prompt_list += u64::from(in_prompt);
            if problems.is_empty() {
                continue;
            }
            self.off_schema += 1;
            self.unoffered += u64::from(problems.unoffered);
            self.unreadable += u64::from(problems.unreadable.is_some());
            self.undeclared_arguments += u64::from(!problems.undeclared.is_empty());
            self.missing_required += u64::from(!problems.missing_required.is_empty());
            self.null_arguments += u64::from(!problems.nulls.is_empty());
            self.undeclared_nulls += u64::from(problems.undeclared_null);
            if self.examples.len() < CALL_EXAMPLES {
                let name = if verdict.name.is_empty() { "(no name)" } else { verdict.name.as_str() };
                self.examples.push(format!("{conversation}: {name}: {}", problems.describe()));
            }
        }
    }
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
    let offered = if kind == ConversationKind::ToolUse { Offered::of(conv) } else { Offered::default() };
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
                        let verdicts = judge_turn(m, &offered);
                        obs.tool_calls.extend(verdicts.iter().filter(|v| !v.name.is_empty()).map(|v| v.name.clone()));
                        obs.call_checks.count(&conv.id, verdicts, offered.in_prompt);
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
    fn toolbench_calls_are_checked_against_the_apis_its_prompt_lists() {
        let system = "You are AutoGPT...\nSpecifically, you have access to the following APIs: [{'name': 'search_for_books', 'description': 'This is the subfunction for tool \"books\".', 'parameters': {'type': 'object', 'properties': {'author': {'type': 'string', 'example_value': 'Calvino'}}, 'required': ['author'], 'optional': []}}, {'name': 'Finish', 'parameters': {'type': 'object', 'properties': {'return_type': {'type': 'string'}, 'final_answer': {'type': 'string'}}, 'required': ['return_type']}}]";
        let conv = Conversation {
            id: "tb".into(),
            source: "toolbench".into(),
            messages: vec![
                Message::new(Role::System, system),
                Message::new(Role::User, "Books by Calvino?"),
                Message::new(
                    Role::Assistant,
                    "Thought: look up\nAction: search_for_books\nAction Input: {\n  \"author\": \"Calvino\"\n}",
                ),
                Message::new(Role::Tool, "{\"response\": [\"Invisible Cities\"]}"),
                Message::new(
                    Role::Assistant,
                    "Thought: more\nAction: search_for_films\nAction Input: {\"author\": \"Calvino\"}",
                ),
                Message::new(Role::Tool, "{\"error\": \"no such function\"}"),
                Message::new(
                    Role::Assistant,
                    "Thought: done\nAction: Finish\nAction Input: {\"final_answer\": \"Invisible Cities\"}",
                ),
            ],
            tools: Vec::new(),
            meta: Default::default(),
        };
        let obs = observe(&conv);
        assert_eq!(obs.tool_calls, ["search_for_books", "search_for_films", "Finish"]);
        let c = &obs.call_checks;
        assert_eq!((c.calls, c.from_text, c.against_prompt_list, c.off_schema), (3, 3, 3, 2));
        assert_eq!(c.examples, ["tb: search_for_films: not offered", "tb: Finish: return_type: required, left out"]);
        // A conversation's own `tools` come first: the prompt's list is read only without them.
        let mut structured = conv.clone();
        structured.tools = vec![serde_json::json!({"type": "function", "function": {"name": "search_for_films"}})];
        let c = observe(&structured).call_checks;
        assert_eq!((c.against_prompt_list, c.unoffered), (0, 2));
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
