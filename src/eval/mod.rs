//! TB2-lite replay evaluation: parsing replies and scoring steps exactly as the reference evaluator
//! (`parse`, `score`), aggregates and the result JSON (`result`), running a checkpoint on the replay set
//! (`run`, its finished batches recorded by `journal`) and choosing the best epoch (`select`).

pub mod journal;
pub mod parse;
pub mod result;
pub mod run;
pub mod score;
pub mod select;

pub use parse::{Parsed, ScorerVersion, parse_response};
pub use score::{StepScore, score_units};
