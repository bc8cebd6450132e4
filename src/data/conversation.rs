//! The one conversation type every source is normalized into, and the role aliases that map onto it.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// Maps the role names used across public SFT datasets (ShareGPT, OpenBMB ToolBench, ChatML, Gemma)
    /// onto the four canonical roles; case-insensitive. `None` for a name no source uses.
    pub fn from_alias(name: &str) -> Option<Role> {
        let role = match name.trim().to_ascii_lowercase().as_str() {
            "system" | "developer" => Role::System,
            "user" | "human" | "prompter" => Role::User,
            "assistant" | "gpt" | "model" | "bot" | "chatgpt" | "ai" => Role::Assistant,
            "tool" | "function" | "observation" | "ipython" | "tool_response" | "function_response" => Role::Tool,
            _ => return None,
        };
        Some(role)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// Reasoning kept apart from `content` by the source (`reasoning_content`, `reasoning`, `thinking`).
    /// Reasoning inline in `content` as `<think>…</think>` stays in `content`; the chat stage decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// An assistant turn's structured function calls, in the shape chat templates read.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool message's function name, as the source gave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The call a tool message answers, as the source gave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// False for an assistant turn the source marks as not to be trained on (`schema.train`): it stays in
    /// the history of later turns, but is never supervised.
    #[serde(default = "trained", skip_serializing_if = "is_trained")]
    pub train: bool,
}

fn trained() -> bool {
    true
}

fn is_trained(train: &bool) -> bool {
    *train
}

impl Message {
    /// An assistant turn that is trained on.
    pub fn is_trained_turn(&self) -> bool {
        self.role == Role::Assistant && self.train
    }

    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
            reasoning: None,
            tool_calls: Vec::new(),
            name: None,
            tool_call_id: None,
            train: true,
        }
    }
}

/// One function call of an assistant turn, serialized as OpenAI's API and transformers' templates have it:
/// `{"id", "type": "function", "function": {"name", "arguments": {…}}}`. The arguments are always an
/// object: templates iterate them (LFM2.5's `.items()`, Qwen3.5's `|items`, Gemma 4's `dictsort`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    #[serde(default)]
    pub arguments: Map<String, Value>,
}

fn function_type() -> String {
    "function".into()
}

impl ToolCall {
    pub fn new(id: Option<String>, name: impl Into<String>, arguments: Map<String, Value>) -> Self {
        ToolCall { id, kind: function_type(), function: FunctionCall { name: name.into(), arguments } }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Conversation {
    pub id: String,
    /// Name of the recipe source the conversation came from.
    pub source: String,
    pub messages: Vec<Message>,
    /// The function schemas offered to the model (`{"type": "function", "function": {name, description,
    /// parameters}}` each), which templates render into the system prompt.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<Value>,
    /// Source columns carried along (task, episode, trial_name, …), in the source's order.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub meta: Map<String, Value>,
}

impl Conversation {
    pub fn first_user_message(&self) -> Option<&str> {
        self.messages.iter().find(|m| m.role == Role::User).map(|m| m.content.as_str())
    }

    /// The task name, when the source records one (Terminus-2 corpora do, in `task`).
    pub fn task(&self) -> Option<&str> {
        self.meta.get("task").and_then(Value::as_str)
    }

    pub fn assistant_turns(&self) -> usize {
        self.messages.iter().filter(|m| m.role == Role::Assistant).count()
    }

    /// Assistant turns that are trained on (not marked otherwise by the source).
    pub fn trained_turns(&self) -> usize {
        self.messages.iter().filter(|m| m.is_trained_turn()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_cover_public_schemas() {
        for (alias, role) in [
            ("human", Role::User),
            ("GPT", Role::Assistant),
            ("model", Role::Assistant),
            ("function", Role::Tool),
            ("observation", Role::Tool),
            ("system", Role::System),
        ] {
            assert_eq!(Role::from_alias(alias), Some(role), "{alias}");
        }
        assert_eq!(Role::from_alias("narrator"), None);
    }

    #[test]
    fn serializes_without_empty_optionals() {
        let conv = Conversation {
            id: "a".into(),
            source: "s".into(),
            messages: vec![Message::new(Role::User, "hi")],
            tools: Vec::new(),
            meta: Map::new(),
        };
        let json = serde_json::to_string(&conv).unwrap();
        assert_eq!(json, r#"{"id":"a","source":"s","messages":[{"role":"user","content":"hi"}]}"#);
        let back: Conversation = serde_json::from_str(&json).unwrap();
        assert_eq!(back, conv);
    }
}
