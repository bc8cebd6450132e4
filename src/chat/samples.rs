//! From a conversation to supervised text samples: the thinking policy (what becomes of `<think>` blocks in
//! history and in targets), the sample mode (one sample per conversation or one per assistant turn), and the
//! byte spans each sample supervises — from `{% generation %}` blocks where the template has them, else by
//! rendering the prompt (with the generation prompt) and the prompt plus the turn and taking the difference.

use std::borrow::Cow;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::ChatError;
use super::template::{ChatTemplate, Rendered};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SampleMode {
    /// One sample, every assistant turn supervised (only exact when the template renders history as inference will).
    Conversation,
    /// One sample per assistant turn, rendered as at that turn's inference time, only that turn supervised.
    PerTurn,
    /// Per-turn semantics, merged into one conversation sample whenever every turn renders identically there.
    Auto,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Thinking {
    /// Strip thinking from history turns; keep it in the supervised turn.
    StripHistory,
    /// Keep thinking everywhere (the template may still drop it).
    Keep,
    /// Strip thinking from history and from the supervised turn.
    Drop,
}

/// What the template gets for a `tool` message that answers calls written in the text of the assistant turn
/// before it (ReAct's `Action:` lines, as ToolBench writes them) rather than in its `tool_calls`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ToolResults {
    /// The `tool` message as it is.
    #[default]
    Tool,
    /// A `user` message with its content: for templates that render tool messages only after structured calls
    /// (Gemma 4's leaves them out otherwise), so the result reaches the model as the next user turn, as an
    /// agent loop on such a template must send it.
    User,
}

impl ToolResults {
    pub fn is_tool(&self) -> bool {
        *self == ToolResults::Tool
    }
}

/// What to do when the generation prompt is not where the turn's render begins: the prefix rule refuses the
/// turn, and some templates' prompts add text the render of a turn leaves out (Gemma 4's older revisions close
/// an empty thought channel in the prompt when thinking is off, and strip channels from every rendered turn).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PromptRule {
    /// The render of history and turn must extend the generation prompt; the turn is refused otherwise.
    #[default]
    Prefix,
    /// Where it does not, the turn's own text (its render past the role header) follows the generation prompt
    /// as inference will prompt it: the prompt's additions are context, not target. Refused when the render and
    /// the prompt do not share history and role header.
    Splice,
}

impl PromptRule {
    pub fn is_prefix(&self) -> bool {
        *self == PromptRule::Prefix
    }
}

/// How conversations become samples: the model config's template policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplePolicy {
    pub mode: SampleMode,
    pub thinking: Thinking,
    /// Extra template variables (`enable_thinking`, `preserve_thinking`, …).
    #[serde(default)]
    pub kwargs: Map<String, Value>,
    /// What the template gets for results of calls written in the text.
    #[serde(default)]
    pub tool_results: ToolResults,
    /// Where the generation prompt is not a prefix of the turn's render.
    #[serde(default)]
    pub prompt_rule: PromptRule,
}

impl Default for SamplePolicy {
    fn default() -> Self {
        SamplePolicy {
            mode: SampleMode::Auto,
            thinking: Thinking::StripHistory,
            kwargs: Map::new(),
            tool_results: ToolResults::Tool,
            prompt_rule: PromptRule::Prefix,
        }
    }
}

/// A conversation as the template sees it: raw JSON messages (tool calls and all) and optional tools.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatInput {
    #[serde(default)]
    pub id: String,
    pub messages: Vec<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The source columns ingest carried along (`task`, `episode`, …); the template never sees them.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub meta: Map<String, Value>,
}

impl ChatInput {
    /// What decides the conversation's side of the validation split: its task where the source names one
    /// (every trial of a task falls on one side, so a validation loss is not flattered by near-copies of its
    /// conversations in training), else its id.
    pub fn split_key(&self) -> &str {
        self.meta.get("task").and_then(Value::as_str).unwrap_or(&self.id)
    }
}

impl From<&crate::data::Conversation> for ChatInput {
    /// The conversation as its JSON line reads back (what prepare renders): messages with their reasoning and
    /// tool calls, the tools beside them.
    fn from(c: &crate::data::Conversation) -> Self {
        let messages = c.messages.iter().map(|m| serde_json::to_value(m).expect("a Message serializes")).collect();
        let tools = (!c.tools.is_empty()).then(|| Value::Array(c.tools.clone()));
        ChatInput { id: c.id.clone(), messages, tools, source: Some(c.source.clone()), meta: c.meta.clone() }
    }
}

/// One rendered training sample and what it supervises.
#[derive(Debug, Clone, PartialEq)]
pub struct TextSample {
    pub id: String,
    pub text: String,
    /// Byte ranges of `text` that are trained on.
    pub targets: Vec<Range<usize>>,
    /// Message indices of the supervised assistant turns.
    pub turns: Vec<usize>,
    /// `<think>` blocks removed by the policy.
    pub thinking_stripped: usize,
    /// Turns trained in a form that differs from their inference-time rendering (forced conversation mode).
    pub turns_unlike_inference: usize,
}

/// What a tool result is replaced by to see whether the template renders it.
const RESULT_PROBE: &str = "kiln: is this tool result rendered?";
/// The content of an assistant turn rendered to find where a turn's own text begins (past its role header).
const TURN_PROBE: &str = "kiln: where does the turn's text begin?";

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CHANNEL_OPEN: &str = "<|channel>";
const CHANNEL_CLOSE: &str = "<channel|>";

/// Removes `<think>…</think>` blocks (and Gemma's `<|channel>…<channel|>` segments) from a message's text;
/// text after a bare `</think>` (thinking opened by the prompt) is kept alone. When anything was removed the
/// rest is trimmed, as the LFM2.5 and Qwen3.5 templates do. Returns the text and the blocks removed.
pub fn strip_thinking(content: &str) -> (String, usize) {
    let mut removed = 0;
    let mut text = content.to_string();
    for (open, close) in [(THINK_OPEN, THINK_CLOSE), (CHANNEL_OPEN, CHANNEL_CLOSE)] {
        while let Some(start) = text.find(open) {
            let Some(rel_end) = text[start..].find(close) else { break };
            text.replace_range(start..start + rel_end + close.len(), "");
            removed += 1;
        }
    }
    if let Some(end) = text.rfind(THINK_CLOSE) {
        text = text[end + THINK_CLOSE.len()..].to_string();
        removed += 1;
    }
    if removed > 0 {
        text = text.trim().to_string();
    }
    (text, removed)
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

/// kiln's per-message flag (`"train": false`, from a recipe's `schema.train`): the turn is history only.
const TRAIN_FLAG: &str = "train";

/// An assistant turn not marked `"train": false`.
fn trained(m: &Value) -> bool {
    role(m) == "assistant" && m.get(TRAIN_FLAG) != Some(&Value::Bool(false))
}

/// The messages as the template gets them: without kiln's training flag (borrowed when none has one, as
/// almost no conversation does).
fn without_train_flags(messages: &[Value]) -> Cow<'_, [Value]> {
    if !messages.iter().any(|m| m.get(TRAIN_FLAG).is_some()) {
        return Cow::Borrowed(messages);
    }
    let mut owned = messages.to_vec();
    for m in &mut owned {
        if let Some(obj) = m.as_object_mut() {
            obj.shift_remove(TRAIN_FLAG);
        }
    }
    Cow::Owned(owned)
}

/// An assistant turn without structured `tool_calls`: whatever calls it makes are in its text (ReAct).
fn calls_in_text(m: &Value) -> bool {
    role(m) == "assistant" && m.get("tool_calls").and_then(Value::as_array).is_none_or(Vec::is_empty)
}

/// The messages with each `tool` message that answers a turn writing its calls in the text (no `tool_calls`)
/// turned into a `user` message of the same content; `None` when there is none (conversations without tools).
fn text_call_results_as_user(messages: &[Value]) -> Option<Vec<Value>> {
    let answers_text_calls = |i: usize| {
        role(&messages[i]) == "tool"
            && messages[..i].iter().rev().find(|m| role(m) != "tool").is_some_and(calls_in_text)
    };
    let answering: Vec<usize> = (0..messages.len()).filter(|&i| answers_text_calls(i)).collect();
    if answering.is_empty() {
        return None;
    }
    let mut owned = messages.to_vec();
    for i in answering {
        let content = owned[i].get("content").cloned().unwrap_or(Value::Null);
        owned[i] = serde_json::json!({"role": "user", "content": content});
    }
    Some(owned)
}

/// Strips thinking from one message (content and separate reasoning fields); returns blocks removed.
fn strip_message(m: &mut Value) -> usize {
    let Some(obj) = m.as_object_mut() else { return 0 };
    let mut removed = 0;
    for key in ["reasoning_content", "reasoning", "thinking"] {
        if obj.remove(key).is_some_and(|v| v.as_str().is_some_and(|s| !s.is_empty())) {
            removed += 1;
        }
    }
    if let Some(Value::String(content)) = obj.get_mut("content") {
        let (stripped, n) = strip_thinking(content);
        if n > 0 {
            *content = stripped;
            removed += n;
        }
    }
    removed
}

/// The messages of the sample whose supervised turn is `target`, with the thinking policy applied:
/// assistant turns before `target` are history.
fn policy_messages(messages: &[Value], target: usize, thinking: Thinking) -> (Vec<Value>, usize) {
    let mut out: Vec<Value> = messages[..=target].to_vec();
    let mut stripped = 0;
    for (i, m) in out.iter_mut().enumerate() {
        if role(m) != "assistant" {
            continue;
        }
        let strip = match thinking {
            Thinking::Keep => false,
            Thinking::StripHistory => i < target,
            Thinking::Drop => true,
        };
        if strip {
            stripped += strip_message(m);
        }
    }
    (out, stripped)
}

/// All messages with the thinking policy applied as one sample sees them: assistant turns before the last user
/// message are history, later ones are targets.
fn conversation_messages(messages: &[Value], thinking: Thinking) -> (Vec<Value>, usize) {
    let last_user = messages.iter().rposition(|m| role(m) == "user");
    let mut out = messages.to_vec();
    let mut stripped = 0;
    for (i, m) in out.iter_mut().enumerate() {
        let history = last_user.is_some_and(|u| i < u);
        let strip = match thinking {
            Thinking::Keep => false,
            Thinking::StripHistory => history,
            Thinking::Drop => true,
        };
        if role(m) == "assistant" && strip {
            stripped += strip_message(m);
        }
    }
    (out, stripped)
}

struct Renderer<'a> {
    template: &'a ChatTemplate,
    input: &'a ChatInput,
    kwargs: &'a Map<String, Value>,
    prompt_rule: PromptRule,
}

impl Renderer<'_> {
    fn render(&self, messages: &[Value], generation_prompt: bool) -> Result<Rendered, ChatError> {
        self.template
            .render(messages, self.input.tools.as_ref(), generation_prompt, self.kwargs)
            .map_err(|e| self.locate(messages, e))
    }

    /// Names the conversation and the first message whose prefix no longer renders.
    fn locate(&self, messages: &[Value], err: ChatError) -> ChatError {
        let message_index = (1..=messages.len())
            .find(|&n| self.template.render(&messages[..n], self.input.tools.as_ref(), false, self.kwargs).is_err())
            .map(|n| n - 1);
        ChatError::Sample { id: self.input.id.clone(), message_index, source: Box::new(err) }
    }

    /// The calls of the last message, `calls`, that its render `full` does not show: the text is the same with the
    /// call left out (index in the turn, function name). A template that reads calls only from the content
    /// (LFM2's) shows none, one that renders only the first shows only that one: training such a turn would
    /// teach the answer minus its calls. One render per call (most turns make one).
    fn unrendered_calls(
        &self,
        messages: &[Value],
        calls: &[Value],
        full: &str,
    ) -> Result<Vec<(usize, String)>, ChatError> {
        let turn = messages.len() - 1;
        let mut without = messages.to_vec();
        let mut ignored = Vec::new();
        for (i, call) in calls.iter().enumerate() {
            let rest: Vec<Value> = calls.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, c)| c.clone()).collect();
            if let Some(obj) = without[turn].as_object_mut() {
                if rest.is_empty() {
                    obj.remove("tool_calls");
                } else {
                    obj.insert("tool_calls".into(), Value::Array(rest));
                }
            }
            if self.render(&without, false)?.text == full {
                let name = call.pointer("/function/name").or_else(|| call.get("name")).and_then(Value::as_str);
                ignored.push((i, name.unwrap_or("?").to_string()));
            }
        }
        Ok(ignored)
    }

    /// The results the turn answers (the `tool` messages since the assistant turn before it) that its render
    /// `full` does not show: the text is the same with the result's content replaced. A result whose text shows
    /// in the render verbatim is shown; only the others cost a render.
    fn unrendered_results(&self, messages: &[Value], full: &str) -> Result<Vec<usize>, ChatError> {
        let turn = messages.len() - 1;
        let since = messages[..turn].iter().rposition(|m| role(m) == "assistant").map_or(0, |i| i + 1);
        let mut unrendered = Vec::new();
        for i in (since..turn).filter(|&i| role(&messages[i]) == "tool") {
            let content = messages[i].get("content");
            match content {
                None | Some(Value::Null) => continue,
                Some(Value::String(text)) if text.trim().is_empty() || full.contains(text.as_str()) => continue,
                _ => {}
            }
            let mut probe = messages.to_vec();
            if let Some(obj) = probe[i].as_object_mut() {
                obj.insert("content".into(), Value::String(RESULT_PROBE.into()));
            }
            if self.render(&probe, false)?.text == full {
                unrendered.push(i);
            }
        }
        Ok(unrendered)
    }

    /// The supervised byte span of the last message (an assistant turn) of `messages`, and the full render.
    fn target_span(&self, messages: &[Value]) -> Result<(Rendered, Range<usize>), ChatError> {
        let full = self.render(messages, false)?;
        let turn = messages.len() - 1;
        let at_turn = |e: ChatError| ChatError::Sample {
            id: self.input.id.clone(),
            message_index: Some(turn),
            source: Box::new(e),
        };
        let no_target = |why: &str| at_turn(ChatError::Mask(why.to_string()));
        // Before the prefix rule: a template that leaves a result out may also prompt unlike the render (Gemma 4
        // opens a new turn after a text-call result, and continues the model's turn in the render).
        let unrendered = self.unrendered_results(messages, &full.text)?;
        if !unrendered.is_empty() {
            let answered = messages[..turn].iter().rfind(|m| role(m) == "assistant");
            let calls_in_text = answered.is_some_and(calls_in_text);
            return Err(at_turn(ChatError::ToolResultsUnrendered { messages: unrendered, calls_in_text }));
        }
        let (text, span) = if self.template.has_generation {
            let span = full
                .spans
                .last()
                .cloned()
                .ok_or_else(|| no_target("the template marked no {% generation %} block for this turn"))?;
            (None, span)
        } else {
            let prompt = self.render(&messages[..turn], true)?;
            if full.text.starts_with(&prompt.text) {
                (None, prompt.text.len()..full.text.len())
            } else if let Some(text) = self.splice(messages, &prompt.text, &full.text)? {
                let span = prompt.text.len()..text.len();
                (Some(text), span)
            } else {
                let at = full.text.bytes().zip(prompt.text.bytes()).take_while(|(a, b)| a == b).count();
                let excerpt = |t: &str| t.get(at..).unwrap_or("").chars().take(40).collect::<String>();
                let splice = if self.prompt_rule.is_prefix() {
                    "; or, where the prompt adds what the render of a turn leaves out (Gemma 4's empty thought channel), train the turn's text after it: `prompt_rule = \"splice\"`, `--prompt-rule splice`"
                } else {
                    ""
                };
                return Err(no_target(&format!(
                    "the generation prompt ends {:?} but the turn renders {:?} there: training it would teach what inference never prompts (set enable_thinking to match the data, or drop the reasoning: `thinking = \"drop\"` in the model config's [template], `--thinking drop` for kiln prepare{splice})",
                    excerpt(&prompt.text),
                    excerpt(&full.text)
                )));
            }
        };
        if span.is_empty() {
            return Err(no_target("the supervised turn renders to no text"));
        }
        if let Some(calls) = messages[turn].get("tool_calls").and_then(Value::as_array).filter(|c| !c.is_empty()) {
            let ignored = self.unrendered_calls(messages, calls, &full.text)?;
            if !ignored.is_empty() {
                return Err(at_turn(ChatError::ToolCallsIgnored { calls: calls.len(), ignored }));
            }
        }
        Ok((text.map_or(full, |text| Rendered { text, spans: Vec::new() }), span))
    }

    /// Under `PromptRule::Splice`, the sample that puts the last turn's own text (its render `full` past history
    /// and role header) after the generation prompt `prompt`; `None` under the prefix rule, or when the render and
    /// the prompt do not both open the turn with the history and the header an assistant turn renders with.
    fn splice(&self, messages: &[Value], prompt: &str, full: &str) -> Result<Option<String>, ChatError> {
        if self.prompt_rule.is_prefix() {
            return Ok(None);
        }
        let history = &messages[..messages.len() - 1];
        let before = self.render(history, false)?.text;
        let mut probe = history.to_vec();
        probe.push(serde_json::json!({"role": "assistant", "content": TURN_PROBE}));
        let probed = self.render(&probe, false)?.text;
        let Some(header) =
            probed.strip_prefix(before.as_str()).and_then(|rest| rest.find(TURN_PROBE).map(|at| &rest[..at]))
        else {
            return Ok(None);
        };
        let opened = format!("{before}{header}");
        if !full.starts_with(&opened) || !prompt.starts_with(&opened) {
            return Ok(None);
        }
        Ok(Some(format!("{prompt}{}", &full[opened.len()..])))
    }
}

/// Builds the samples of one conversation under `policy`.
pub fn build_samples(
    template: &ChatTemplate,
    input: &ChatInput,
    policy: &SamplePolicy,
) -> Result<Vec<TextSample>, ChatError> {
    let renderer = Renderer { template, input, kwargs: &policy.kwargs, prompt_rule: policy.prompt_rule };
    let turns: Vec<usize> = input.messages.iter().enumerate().filter(|(_, m)| trained(m)).map(|(i, _)| i).collect();
    let assistant_turns = input.messages.iter().filter(|m| role(m) == "assistant").count();
    let all_messages = without_train_flags(&input.messages);
    let all_messages = match policy.tool_results {
        ToolResults::Tool => all_messages,
        ToolResults::User => text_call_results_as_user(&all_messages).map_or(all_messages, Cow::Owned),
    };
    if turns.is_empty() {
        return Err(ChatError::Sample {
            id: input.id.clone(),
            message_index: None,
            source: Box::new(ChatError::Mask(
                if assistant_turns == 0 {
                    "no assistant turn to supervise"
                } else {
                    "every assistant turn is marked not to be trained on"
                }
                .into(),
            )),
        });
    }
    // Each turn as its own inference-time sample.
    let mut per_turn = Vec::with_capacity(turns.len());
    for &t in &turns {
        let (messages, stripped) = policy_messages(&all_messages, t, policy.thinking);
        let (rendered, span) = renderer.target_span(&messages)?;
        per_turn.push(TextSample {
            id: if turns.len() == 1 { input.id.clone() } else { format!("{}@{t}", input.id) },
            text: rendered.text,
            targets: vec![span],
            turns: vec![t],
            thinking_stripped: stripped,
            turns_unlike_inference: 0,
        });
    }
    if policy.mode == SampleMode::PerTurn || turns.len() == 1 {
        return Ok(per_turn);
    }
    // The whole conversation: assistant turns before the last user message are history to the template.
    let (messages, stripped) = conversation_messages(&all_messages, policy.thinking);
    let full = renderer.render(&messages, false)?;
    let identical = per_turn.iter().all(|s| full.text.starts_with(&s.text));
    if identical {
        // Every turn renders in the full conversation exactly as at its own inference time: one sample.
        return Ok(vec![TextSample {
            id: input.id.clone(),
            text: full.text,
            targets: per_turn.iter().flat_map(|s| s.targets.clone()).collect(),
            turns: turns.clone(),
            thinking_stripped: stripped,
            turns_unlike_inference: 0,
        }]);
    }
    if policy.mode == SampleMode::Auto {
        return Ok(per_turn);
    }
    // Forced conversation mode on a template that renders history unlike inference: train it, but count it.
    let targets = if template.has_generation && turns.len() == assistant_turns {
        full.spans.clone()
    } else {
        // Some turns are history only: each trained turn's span from the render up to it, where the whole
        // conversation's render extends that one.
        let mut spans = Vec::new();
        for &t in &turns {
            let upto = renderer.render(&messages[..=t], false)?;
            if !full.text.starts_with(&upto.text) {
                continue;
            }
            if template.has_generation {
                spans.extend(upto.spans.last().cloned());
            } else {
                let prompt = renderer.render(&messages[..t], true)?;
                if upto.text.starts_with(&prompt.text) {
                    spans.push(prompt.text.len()..upto.text.len());
                }
            }
        }
        spans
    };
    let unlike = per_turn.iter().filter(|s| !full.text.starts_with(&s.text)).count();
    Ok(vec![TextSample {
        id: input.id.clone(),
        text: full.text,
        targets,
        turns,
        thinking_stripped: stripped,
        turns_unlike_inference: unlike,
    }])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_results_of_calls_written_in_the_text_become_user_messages() {
        let tool = |content: &str| serde_json::json!({"role": "tool", "tool_call_id": "c", "content": content});
        let messages = vec![
            serde_json::json!({"role": "user", "content": "u"}),
            serde_json::json!({"role": "assistant", "content": "Action: ls"}),
            tool("a"),
            tool("b"),
            serde_json::json!({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "ls"}}]}),
            tool("c"),
            serde_json::json!({"role": "assistant", "content": "x", "tool_calls": []}),
            tool("d"),
        ];
        let out = text_call_results_as_user(&messages).unwrap();
        let roles: Vec<&str> = out.iter().map(role).collect();
        assert_eq!(roles, ["user", "assistant", "user", "user", "assistant", "tool", "assistant", "user"]);
        assert_eq!(out[3], serde_json::json!({"role": "user", "content": "b"}));
        assert_eq!(out[5], messages[5], "a result of a structured call stays a tool message");
        assert_eq!(text_call_results_as_user(&messages[4..6]), None, "nothing to change");
    }

    #[test]
    fn strips_think_blocks_and_channels() {
        assert_eq!(strip_thinking("<think>\nplan\n</think>\n\n{\"a\": 1}"), ("{\"a\": 1}".to_string(), 1));
        assert_eq!(strip_thinking("reasoning opened by the prompt</think>\n\nanswer"), ("answer".to_string(), 1));
        assert_eq!(strip_thinking("<|channel>thought\nhm<channel|>Final"), ("Final".to_string(), 1));
        assert_eq!(strip_thinking("no thinking here "), ("no thinking here ".to_string(), 0));
        assert_eq!(strip_thinking("<think>a</think>x<think>b</think>y").1, 2);
    }
}
