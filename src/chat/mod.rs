//! Chat rendering exactly as inference will see it: a transformers-compatible template environment, the
//! template and special tokens of a checkpoint, the thinking policy, and the samples with the byte spans
//! they supervise. Needs no weights; tokenization and masks over tokens live in `tokens`.

pub mod env;
pub mod python;
pub mod samples;
pub mod template;

use std::path::{Path, PathBuf};

pub use env::PinnedClock;
pub use samples::{ChatInput, SampleMode, SamplePolicy, TextSample, Thinking, build_samples, strip_thinking};
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
        "the template renders none of the turn's {calls} tool call(s): the text is the same without them, so training it would teach the turn without its calls. This template reads calls from the content (LFM2's does: write them there in the model's format), or render with a template that reads `tool_calls`"
    )]
    ToolCallsIgnored { calls: usize },
    #[error("conversation '{id}'{}: {source}", message_index.map(|i| format!(", message {i}")).unwrap_or_default())]
    Sample { id: String, message_index: Option<usize>, source: Box<ChatError> },
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
            _ => "template_error",
        }
    }
}
