//! Reports a person reads: the dataset inspection report (`inspect`: figures in `figures`, page in `html`,
//! plots in `plots`) and, later in the pipeline, the model card. Reports only read what the other stages
//! wrote; nothing here feeds back into training.

pub mod card;
pub mod figures;
pub mod html;
pub mod inspect;
pub mod plots;

use std::path::PathBuf;

pub use figures::Inspection;
pub use inspect::{InspectOptions, InspectResult, inspect_run, write_report};

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: line {line}: {message}")]
    Input { path: PathBuf, line: usize, message: String },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{path} not found: {hint}")]
    Missing { path: PathBuf, hint: String },
    #[error(transparent)]
    Tokens(#[from] crate::tokens::TokenError),
    #[error("plot '{name}': {message}")]
    Plot { name: String, message: String },
    #[error(transparent)]
    Sampling(#[from] crate::models::sampling::SamplingError),
}

/// A JSON file another stage wrote.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T, ReportError> {
    let text = std::fs::read_to_string(path).map_err(ReportError::io(path))?;
    serde_json::from_str(&text).map_err(|e| ReportError::Invalid { path: path.to_path_buf(), message: e.to_string() })
}

impl ReportError {
    pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> ReportError + '_ {
        move |source| ReportError::Io { path: path.to_path_buf(), source }
    }
}
