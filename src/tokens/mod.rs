//! Tokens: the checkpoint's tokenizer, supervised byte spans mapped to a per-token loss mask, packed or
//! bucketed parquet shards with document boundaries, and `prepare`, which streams conversations into them.

pub mod bpe;
pub mod mask;
pub mod prepare;
pub mod shards;
pub mod tokenizer;

use std::path::PathBuf;

pub use mask::{TokenSample, tokenize_sample};
pub use tokenizer::{TextStream, TextTokenizer};

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("sample '{id}': {message}")]
    Mask { id: String, message: String },
    #[error("{path}: {message}")]
    Shard { path: PathBuf, message: String },
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    #[error("{path}: line {line}: {message}")]
    Input { path: PathBuf, line: usize, message: String },
    #[error("{0}")]
    Config(String),
}
