//! Chat rendering exactly as inference will see it: a transformers-compatible template environment, the
//! template and special tokens of a checkpoint, the thinking policy, the samples with the byte spans they
//! supervise, and a conversation turn by turn (`kiln chat`). Needs no weights; tokenization and masks over
//! tokens live in `tokens`.

pub mod env;
pub mod python;
pub mod samples;
pub mod session;
pub mod template;

use std::path::{Path, PathBuf};

pub use env::PinnedClock;
pub use samples::{
    ChatInput, PromptRule, SampleMode, SamplePolicy, TextSample, Thinking, ToolResults, build_samples, strip_thinking,
};
pub use template::{ChatTemplate, Rendered, SpecialTokens, TemplateSource};

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error(
        "{dir} has no chat template: no chat_template.jinja and no `chat_template` in tokenizer_config.json; give one with --template"
    )]
    NoTemplate { dir: PathBuf },
    #[error("chat template {origin} does not compile: {message}")]
    Syntax { origin: String, message: String },
    #[error("chat template {origin} failed: {message}")]
    Render { origin: String, message: String },
    #[error("message {message_index}: {message}")]
    Input { message_index: usize, message: String },
    #[error("{0}")]
    Mask(String),
    #[error(
        "the template {}: the text is the same without {}, so training it would teach the turn without {}. {}",
        unrendered_calls(ignored, *calls),
        if ignored.len() == *calls { "them" } else { "it" },
        if ignored.len() == *calls { "its calls" } else { "all its calls" },
        if ignored.len() == *calls {
            "This template reads calls from the content (LFM2's does: write them there in the model's format), or render with a template that reads `tool_calls`"
        } else {
            "The template renders only some calls of a turn (the first, say): split such turns, or render with a template that renders every call"
        }
    )]
    ToolCallsIgnored {
        calls: usize,
        /// The calls (index in the turn, function name) whose removal leaves the render unchanged.
        ignored: Vec<(usize, String)>,
    },
    #[error(
        "the template leaves out the tool result{} in message{} {}: the text is the same without {}, so training this turn would teach it without what its calls returned. {}",
        if messages.len() == 1 { "" } else { "s" },
        if messages.len() == 1 { "" } else { "s" },
        messages.iter().map(usize::to_string).collect::<Vec<_>>().join(", "),
        if messages.len() == 1 { "it" } else { "them" },
        if *calls_in_text {
            "The turn before wrote its calls in its text (no `tool_calls`), and this template renders tool messages only after structured calls: send such results as user messages (`tool_results = \"user\"` in the model config's [template], `--tool-results user` for kiln prepare), or write the calls as `tool_calls`"
        } else {
            "Render with a template that shows tool results"
        }
    )]
    ToolResultsUnrendered {
        /// The indices of the `tool` messages the render does not show.
        messages: Vec<usize>,
        /// Whether the assistant turn they answer wrote its calls in its text rather than `tool_calls`.
        calls_in_text: bool,
    },
    #[error("conversation '{id}'{}: {source}", message_index.map(|i| format!(", message {i}")).unwrap_or_default())]
    Sample { id: String, message_index: Option<usize>, source: Box<ChatError> },
}

/// "renders none of the turn's 2 tool call(s)", or which it leaves out: "does not render call 1 (`search`) of
/// the turn's 2 tool call(s)", "… calls 1 (`a`) and 2 (`b`) …".
fn unrendered_calls(ignored: &[(usize, String)], calls: usize) -> String {
    if ignored.len() == calls {
        return format!("renders none of the turn's {calls} tool call(s)");
    }
    let named: Vec<String> = ignored.iter().map(|(i, name)| format!("{i} (`{name}`)")).collect();
    let list = match named.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    };
    let plural = if ignored.len() == 1 { "" } else { "s" };
    format!("does not render call{plural} {list} of the turn's {calls} tool call(s)")
}

impl ChatError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        ChatError::Io { path: path.to_path_buf(), source }
    }

    /// The reason prepare counts a conversation this error drops under.
    pub fn drop_reason(&self) -> &'static str {
        match self {
            ChatError::Sample { source, .. } => source.drop_reason(),
            ChatError::ToolCallsIgnored { .. } => "tool_calls_unrendered",
            ChatError::ToolResultsUnrendered { .. } => "tool_results_unrendered",
            _ => "template_error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unrendered_calls_are_named_in_the_turn_s_order() {
        let named = |ignored: &[(usize, &str)], calls| {
            ChatError::ToolCallsIgnored { calls, ignored: ignored.iter().map(|(i, n)| (*i, n.to_string())).collect() }
                .to_string()
        };
        let one = named(&[(2, "ls")], 3);
        assert!(one.starts_with("the template does not render call 2 (`ls`) of the turn's 3 tool call(s): the text is the same without it, so training it would teach the turn without all its calls. The template renders only some"), "{one}");
        let three = named(&[(0, "a"), (1, "b"), (3, "d")], 4);
        assert!(
            three.starts_with("the template does not render calls 0 (`a`), 1 (`b`) and 3 (`d`) of the turn's 4"),
            "{three}"
        );
        let all = named(&[(0, "a"), (1, "b")], 2);
        assert!(all.starts_with("the template renders none of the turn's 2 tool call(s): the text is the same without them, so training it would teach the turn without its calls. This template reads calls from the content"), "{all}");
    }
}
