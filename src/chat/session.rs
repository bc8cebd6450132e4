//! A conversation with a checkpoint, turn by turn (`kiln chat`): the messages so far, rendered with the
//! model's own template for the next reply, and the input lines that make a message. Replies are kept
//! without their thinking, as the templates keep history and as kiln trains (`strip_thinking`).

use serde_json::{Map, Value, json};

use super::{ChatError, ChatInput, ChatTemplate, strip_thinking};

/// What a line of input asks for.
#[derive(Debug, PartialEq)]
pub enum ChatLine {
    Message(String),
    Reset,
    Exit,
}

/// The next message or command from input lines: a line ending in `\` goes on in the next line (the
/// backslash becomes a newline), blank lines are skipped, `/reset` and `/exit` (or `/quit`) alone on a line
/// are commands. `None` at the end of the input.
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
            _ => return Ok(Some(ChatLine::Message(message))),
        }
    }
    let rest = message.trim_end();
    Ok((!rest.is_empty()).then(|| ChatLine::Message(rest.to_string())))
}

/// The messages of one conversation and how they are rendered.
pub struct ChatSession {
    template: ChatTemplate,
    system: Option<String>,
    kwargs: Map<String, Value>,
    messages: Vec<Value>,
}

impl ChatSession {
    /// A conversation with an optional system message; `enable_thinking` is passed to the template where
    /// given (Qwen3.5's and LFM2.5's read it), else the template's default holds.
    pub fn new(template: ChatTemplate, system: Option<String>, enable_thinking: Option<bool>) -> Self {
        let mut kwargs = Map::new();
        if let Some(on) = enable_thinking {
            kwargs.insert("enable_thinking".into(), Value::Bool(on));
        }
        let mut session = ChatSession { template, system, kwargs, messages: Vec::new() };
        session.reset();
        session
    }

    /// The text the model continues to reply to `user`: the conversation so far and `user`, with the
    /// template's generation prompt. The conversation itself is unchanged until `record`.
    pub fn prompt(&self, user: &str) -> Result<String, ChatError> {
        self.render_with(user, true)
    }

    /// The conversation so far and `user` without the generation prompt: the part of `prompt(user)` that
    /// the next turn's prompt repeats when the template renders history as it rendered the turn (where a
    /// reply is re-rendered differently, its prompt's generation prompt is not repeated).
    pub fn settled(&self, user: &str) -> Result<String, ChatError> {
        self.render_with(user, false)
    }

    fn render_with(&self, user: &str, add_generation_prompt: bool) -> Result<String, ChatError> {
        let mut messages = self.messages.clone();
        messages.push(json!({"role": "user", "content": user}));
        Ok(self.template.render(&messages, None, add_generation_prompt, &self.kwargs)?.text)
    }

    /// Adds a finished turn: `user` and the model's `reply`, its thinking removed.
    pub fn record(&mut self, user: &str, reply: &str) {
        self.messages.push(json!({"role": "user", "content": user}));
        self.messages.push(json!({"role": "assistant", "content": strip_thinking(reply).0}));
    }

    /// Starts over, the system message kept.
    pub fn reset(&mut self) {
        self.messages.clear();
        if let Some(system) = &self.system {
            self.messages.push(json!({"role": "system", "content": system}));
        }
    }

    /// Turns recorded (user messages answered).
    pub fn turns(&self) -> usize {
        self.messages.iter().filter(|m| m["role"] == "user").count()
    }

    /// The conversation as a line of kiln's conversation JSONL (`kiln render --input` reads it).
    pub fn transcript(&self, id: &str) -> ChatInput {
        ChatInput { id: id.to_string(), messages: self.messages.clone(), tools: None, source: None, meta: Map::new() }
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
        let mut input = lines("\n  \nls -la\ncat <<EOF\\\nhello\\\nEOF\r\n /reset \n/resets\n/exit\nlast\\\n");
        let mut read = || read_line(&mut input).unwrap();
        assert_eq!(read(), Some(ChatLine::Message("ls -la".into())));
        assert_eq!(read(), Some(ChatLine::Message("cat <<EOF\nhello\nEOF".into())));
        assert_eq!(read(), Some(ChatLine::Reset));
        assert_eq!(read(), Some(ChatLine::Message("/resets".into())));
        assert_eq!(read(), Some(ChatLine::Exit));
        // A continued line the input ends in is still a message.
        assert_eq!(read(), Some(ChatLine::Message("last".into())));
        assert_eq!(read(), None);
    }

    #[test]
    fn a_turn_renders_the_history_with_the_reply_without_its_thinking() {
        let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/tiny");
        let template = || ChatTemplate::load(&tiny, None, PinnedClock::parse("2026-12-04").unwrap()).unwrap();
        let mut session = ChatSession::new(template(), Some("You run commands.".into()), None);
        let first = session.prompt("list files").unwrap();
        assert_eq!(session.turns(), 0, "a prompt records nothing");
        session.record("list files", "<think>ls is the one</think>\n\nls -la");
        let second = session.prompt("and the hidden ones?").unwrap();
        let expected = json!([
            {"role": "system", "content": "You run commands."},
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": "ls -la"},
            {"role": "user", "content": "and the hidden ones?"},
        ]);
        let messages = expected.as_array().unwrap();
        assert_eq!(second, template().render(messages, None, true, &Map::new()).unwrap().text);
        assert!(second.starts_with(&first), "the first turn's prompt opens the second's");
        let settled = session.settled("and the hidden ones?").unwrap();
        assert!(second.starts_with(&settled) && second.len() > settled.len(), "{settled:?} opens {second:?}");
        assert_eq!(settled, template().render(messages, None, false, &Map::new()).unwrap().text);
        assert_eq!(session.transcript("chat-1").messages, messages[..3]);
        session.reset();
        assert_eq!(session.turns(), 0);
        assert_eq!(session.prompt("list files").unwrap(), first);
    }
}
