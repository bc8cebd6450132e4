//! The checkpoint's tokenizer (`tokenizer.json` through the tokenizers crate) and the special ids the
//! pipeline needs, read from the checkpoint's own files — never hard-coded.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::TokenError;
use crate::chat::SpecialTokens;

/// Turn-closing tokens of the supported template families, tried in order when the config names none.
const END_OF_TURN_CANDIDATES: &[&str] = &["<|im_end|>", "<turn|>", "<end_of_turn>", "<|eot_id|>"];

pub struct TextTokenizer {
    pub inner: tokenizers::Tokenizer,
    pub path: PathBuf,
    pub sha256: String,
    /// The token that closes an assistant turn; it must be the last supervised non-whitespace token of a turn.
    pub end_of_turn: String,
    pub end_of_turn_id: u32,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Padding id: `pad_token`, else `eos_token`, else the end-of-turn token.
    pub pad_id: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenizerInfo {
    pub path: PathBuf,
    pub sha256: String,
    pub vocab_size: usize,
    pub end_of_turn: String,
    pub end_of_turn_id: u32,
    pub pad_id: u32,
}

impl TextTokenizer {
    /// Loads `<model_dir>/tokenizer.json`; `end_of_turn` overrides the end-of-turn token.
    pub fn load(model_dir: &Path, special: &SpecialTokens, end_of_turn: Option<&str>) -> Result<Self, TokenError> {
        let path = model_dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| TokenError::Io { path: path.clone(), source: e })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| TokenError::Tokenizer { path: path.clone(), message: e.to_string() })?;
        let id = |token: &str| inner.token_to_id(token);
        let (end_of_turn, end_of_turn_id) = match end_of_turn {
            Some(t) => (
                t.to_string(),
                id(t).ok_or_else(|| TokenError::Tokenizer {
                    path: path.clone(),
                    message: format!("end-of-turn token '{t}' is not in the vocabulary"),
                })?,
            ),
            None => END_OF_TURN_CANDIDATES
                .iter()
                .chain(special.get("eos_token").as_slice())
                .find_map(|t| Some((t.to_string(), id(t)?)))
                .ok_or_else(|| TokenError::Tokenizer {
                    path: path.clone(),
                    message: "no end-of-turn token: none of <|im_end|>, <turn|>, <end_of_turn>, <|eot_id|> or eos_token is in the vocabulary; set end_of_turn in the model config".into(),
                })?,
        };
        let bos_id = special.get("bos_token").and_then(id);
        let eos_id = special.get("eos_token").and_then(id);
        let pad_id = special.get("pad_token").and_then(id).or(eos_id).unwrap_or(end_of_turn_id);
        Ok(TextTokenizer {
            inner,
            sha256: crate::hub::sha256_bytes(&bytes),
            path,
            end_of_turn,
            end_of_turn_id,
            bos_id,
            eos_id,
            pad_id,
        })
    }

    /// Token ids and byte offsets of `text`, without added special tokens (templates emit BOS themselves).
    pub fn encode(&self, text: &str) -> Result<(Vec<u32>, Vec<(usize, usize)>), TokenError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenError::Tokenizer { path: self.path.clone(), message: e.to_string() })?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    pub fn info(&self) -> TokenizerInfo {
        TokenizerInfo {
            path: self.path.clone(),
            sha256: self.sha256.clone(),
            vocab_size: self.inner.get_vocab_size(true),
            end_of_turn: self.end_of_turn.clone(),
            end_of_turn_id: self.end_of_turn_id,
            pad_id: self.pad_id,
        }
    }
}
