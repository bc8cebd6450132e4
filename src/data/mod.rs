//! The data path up to normalized conversations: dataset recipes, streaming readers (parquet, JSONL, JSON
//! arrays), schema normalization, tool calls judged against their offered schemas, decontamination against
//! the eval set, and the ingest that ties them.

pub mod arrow_json;
pub mod calls;
pub mod conversation;
pub mod decontam;
pub mod ingest;
pub mod readers;
pub mod recipe;
pub mod schema;

use std::path::PathBuf;

pub use conversation::{Conversation, FunctionCall, Message, Role, ToolCall};
pub use decontam::EvalIndex;
pub use readers::Format;
pub use recipe::Recipe;
pub use schema::{DropReason, SchemaMapping};

/// A file or recipe that cannot be used as a whole. Bad rows are not errors: they are skipped and counted.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {location}: {message}")]
    Text { path: PathBuf, location: String, message: String },
    #[error("{path}{}: not a readable parquet file: {message}", row_group.map(|g| format!(": row group {g}")).unwrap_or_default())]
    Parquet { path: PathBuf, row_group: Option<usize>, message: String },
    #[error("{path}: line {line}: invalid JSON: {source}")]
    JsonLine { path: PathBuf, line: usize, source: serde_json::Error },
    #[error("{path}: array element {index} (byte {offset}): {message}")]
    JsonArray { path: PathBuf, index: usize, offset: u64, message: String },
    #[error("{path}: no column '{column}' (the file has: {}); set `schema.messages` in the recipe", available.join(", "))]
    MissingColumn { path: PathBuf, column: String, available: Vec<String> },
    #[error("recipe {path}: {message}")]
    Recipe { path: PathBuf, message: String },
    #[error(transparent)]
    Hub(Box<crate::hub::HubError>),
}

impl From<crate::hub::HubError> for DataError {
    fn from(e: crate::hub::HubError) -> Self {
        DataError::Hub(Box::new(e))
    }
}
