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
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message { role, content: content.into(), reasoning: None }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Conversation {
    pub id: String,
    /// Name of the recipe source the conversation came from.
    pub source: String,
    pub messages: Vec<Message>,
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
            meta: Map::new(),
        };
        let json = serde_json::to_string(&conv).unwrap();
        assert_eq!(json, r#"{"id":"a","source":"s","messages":[{"role":"user","content":"hi"}]}"#);
        let back: Conversation = serde_json::from_str(&json).unwrap();
        assert_eq!(back, conv);
    }
}
