//! TB2-lite replay evaluation: parsing replies and scoring steps exactly as the reference evaluator
//! (`parse`, `score`), aggregates and the result JSON (`result`).

pub mod parse;
pub mod result;
pub mod score;

pub use parse::{Parsed, ScorerVersion, parse_response};
pub use score::{StepScore, score_units};
