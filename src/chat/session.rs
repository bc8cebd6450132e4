//! A conversation with a checkpoint, turn by turn (`kiln chat`): the messages so far and the tools offered,
//! rendered with the model's own template for the next reply, and the input lines that make a message (the
//! user's, or a tool's result). Replies are kept without their thinking, as the templates keep history and as
//! kiln trains (`strip_thinking`); a call a reply makes stays in its text, as the model wrote it.

use serde_json::{Map, Value, json};

use super::{ChatError, ChatInput, ChatTemplate, strip_thinking};

/// What a line of input asks for.
#[derive(Debug, PartialEq)]
pub enum ChatLine {
    Message(Sender, String),
    Reset,
    Exit,
}

/// Whose message a line is: the user's, or (`/tool …`) the result of a call the last reply made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sender {
    User,
    Tool,
}

impl Sender {
    fn message(self, content: &str) -> Value {
        let role = match self {
            Sender::User => "user",
            Sender::Tool => "tool",
        };
        json!({"role": role, "content": content})
    }
}

/// The command that marks a message as a tool's result.
const TOOL_COMMAND: &str = "/tool";

/// The next message or command from input lines: a line ending in `\` goes on in the next line (the
/// backslash becomes a newline), blank lines are skipped, `/reset` and `/exit` (or `/quit`) alone on a line
/// are commands, and a message opening with `/tool` is a tool's result (the rest of it, which may be empty:
/// a command that printed nothing). `None` at the end of the input.
pub fn read_line(lines: &mut impl Iterator<Item = std::io::Result<String>>) -> std::io::Result<Option<ChatLine>> {
    let mut message = String::new();
    for line in lines {
        let line = line?;
        let line = line.strip_suffix('\r').unwrap_or(&line);
        if let Some(head) = line.strip_suffix('\\') {
            message.push_str(head);
            message.push('\n');
            continue;
        }
        message.push_str(line);
        match message.trim() {
            "" => message.clear(),
            "/reset" => return Ok(Some(ChatLine::Reset)),
            "/exit" | "/quit" => return Ok(Some(ChatLine::Exit)),
            _ => return Ok(Some(message_line(message))),
        }
    }
    let rest = message.trim_end();
    Ok((!rest.is_empty()).then(|| message_line(rest.to_string())))
}

fn message_line(message: String) -> ChatLine {
    match message.trim_start().strip_prefix(TOOL_COMMAND) {
        // `/tool` alone, or followed by a space or the continued line's newline (not `/tools`).
        Some(result) if result.is_empty() || result.starts_with([' ', '\t', '\n']) => {
            let result = result.strip_prefix([' ', '\t', '\n']).unwrap_or(result);
            ChatLine::Message(Sender::Tool, result.to_string())
        }
        _ => ChatLine::Message(Sender::User, message),
    }
}

/// The messages of one conversation and how they are rendered.
pub struct ChatSession {
    template: ChatTemplate,
    system: Option<String>,
    /// The function schemas offered on every turn (the template's `tools`).
    tools: Option<Value>,
    kwargs: Map<String, Value>,
    messages: Vec<Value>,
}

impl ChatSession {
    /// A conversation with an optional system message and tools (function schemas, as the template's
    /// `tools`); `enable_thinking` is passed to the template where given (Qwen3.5's and LFM2.5's read it),
    /// else the template's default holds.
    pub fn new(
        template: ChatTemplate,
        system: Option<String>,
        tools: Option<Vec<Value>>,
        enable_thinking: Option<bool>,
    ) -> Self {
        let mut kwargs = Map::new();
        if let Some(on) = enable_thinking {
            kwargs.insert("enable_thinking".into(), Value::Bool(on));
        }
        let tools = tools.map(Value::Array);
        let mut session = ChatSession { template, system, tools, kwargs, messages: Vec::new() };
        session.reset();
        session
    }

    /// The text the model continues to reply to `text` from `sender`: the conversation so far and the new
    /// message, with the template's generation prompt. The conversation itself is unchanged until `record`.
    pub fn prompt(&self, sender: Sender, text: &str) -> Result<String, ChatError> {
        self.render_with(sender, text, true)
    }

    /// The conversation so far and the new message without the generation prompt: the part of `prompt` that
    /// the next turn's prompt repeats when the template renders history as it rendered the turn (where a
    /// reply is re-rendered differently, its prompt's generation prompt is not repeated).
    pub fn settled(&self, sender: Sender, text: &str) -> Result<String, ChatError> {
        self.render_with(sender, text, false)
    }

    fn render_with(&self, sender: Sender, text: &str, add_generation_prompt: bool) -> Result<String, ChatError> {
        let mut messages = self.messages.clone();
        messages.push(sender.message(text));
        Ok(self.template.render(&messages, self.tools.as_ref(), add_generation_prompt, &self.kwargs)?.text)
    }

    /// Adds a finished turn: the message from `sender` and the model's `reply`, its thinking removed.
    pub fn record(&mut self, sender: Sender, text: &str, reply: &str) {
        self.messages.push(sender.message(text));
        self.messages.push(json!({"role": "assistant", "content": strip_thinking(reply).0}));
    }

    /// Starts over, the system message kept.
    pub fn reset(&mut self) {
        self.messages.clear();
        if let Some(system) = &self.system {
            self.messages.push(json!({"role": "system", "content": system}));
        }
    }

    /// Turns recorded (replies given).
    pub fn turns(&self) -> usize {
        self.messages.iter().filter(|m| m["role"] == "assistant").count()
    }

    /// The conversation as a line of kiln's conversation JSONL (`kiln render --input` reads it).
    pub fn transcript(&self, id: &str) -> ChatInput {
        let (messages, tools) = (self.messages.clone(), self.tools.clone());
        ChatInput { id: id.to_string(), messages, tools, source: None, meta: Map::new() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::PinnedClock;
    use std::path::Path;

    fn lines(text: &str) -> impl Iterator<Item = std::io::Result<String>> + '_ {
        text.lines().map(|l| Ok(l.to_string()))
    }

    #[test]
    fn lines_become_messages_and_commands() {
        let mut input = lines(
            "\n  \nls -la\ncat <<EOF\\\nhello\\\nEOF\r\n /reset \n/resets\n/tool total 0\n/tool\n/tool\\\na\\\nb\n/tools\n/exit\nlast\\\n",
        );
        let mut read = || read_line(&mut input).unwrap();
        let user = |text: &str| Some(ChatLine::Message(Sender::User, text.into()));
        let tool = |text: &str| Some(ChatLine::Message(Sender::Tool, text.into()));
        assert_eq!(read(), user("ls -la"));
        assert_eq!(read(), user("cat <<EOF\nhello\nEOF"));
        assert_eq!(read(), Some(ChatLine::Reset));
        assert_eq!(read(), user("/resets"));
        assert_eq!(read(), tool("total 0"));
        assert_eq!(read(), tool(""), "a command that printed nothing");
        assert_eq!(read(), tool("a\nb"), "a result over several lines");
        assert_eq!(read(), user("/tools"));
        assert_eq!(read(), Some(ChatLine::Exit));
        // A continued line the input ends in is still a message.
        assert_eq!(read(), user("last"));
        assert_eq!(read(), None);
    }

    fn tiny_template() -> ChatTemplate {
        let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/tiny");
        ChatTemplate::load(&tiny, None, PinnedClock::parse("2026-12-04").unwrap()).unwrap()
    }

    #[test]
    fn a_turn_renders_the_history_with_the_reply_without_its_thinking() {
        let template = tiny_template;
        let mut session = ChatSession::new(template(), Some("You run commands.".into()), None, None);
        let first = session.prompt(Sender::User, "list files").unwrap();
        assert_eq!(session.turns(), 0, "a prompt records nothing");
        session.record(Sender::User, "list files", "<think>ls is the one</think>\n\nls -la");
        let second = session.prompt(Sender::User, "and the hidden ones?").unwrap();
        let expected = json!([
            {"role": "system", "content": "You run commands."},
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": "ls -la"},
            {"role": "user", "content": "and the hidden ones?"},
        ]);
        let messages = expected.as_array().unwrap();
        assert_eq!(second, template().render(messages, None, true, &Map::new()).unwrap().text);
        assert!(second.starts_with(&first), "the first turn's prompt opens the second's");
        let settled = session.settled(Sender::User, "and the hidden ones?").unwrap();
        assert!(second.starts_with(&settled) && second.len() > settled.len(), "{settled:?} opens {second:?}");
        assert_eq!(settled, template().render(messages, None, false, &Map::new()).unwrap().text);
        assert_eq!(session.transcript("chat-1").messages, messages[..3]);
        assert_eq!(session.transcript("chat-1").tools, None);
        session.reset();
        assert_eq!(session.turns(), 0);
        assert_eq!(session.prompt(Sender::User, "list files").unwrap(), first);
    }

    #[test]
    fn tools_are_offered_every_turn_and_their_results_answered() {
        let tools = vec![json!({"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}})];
        let mut session = ChatSession::new(tiny_template(), None, Some(tools.clone()), None);
        let call = "<|tool_call_start|>[bash(command=\"ls\")]<|tool_call_end|>";
        session.record(Sender::User, "list files", call);
        let prompt = session.prompt(Sender::Tool, "a.txt").unwrap();
        let messages = json!([
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": "a.txt"},
        ]);
        let messages = messages.as_array().unwrap();
        let offered = Value::Array(tools.clone());
        assert_eq!(prompt, tiny_template().render(messages, Some(&offered), true, &Map::new()).unwrap().text);
        assert!(prompt.contains("<|tool_list_start|>") && prompt.contains("\"bash\""), "{prompt}");
        assert!(prompt.contains("<|tool_response_start|>a.txt<|tool_response_end|>"), "{prompt}");
        session.record(Sender::Tool, "a.txt", "There is a.txt.");
        assert_eq!(session.turns(), 2);
        let transcript = session.transcript("chat-1");
        assert_eq!((transcript.messages.len(), transcript.tools), (4, Some(offered)));
        assert_eq!(transcript.messages[2], messages[2]);
    }
}
