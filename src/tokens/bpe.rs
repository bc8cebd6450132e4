//! The offline default's tokenizer: a small byte-level BPE trained on the synthetic conversations, with the
//! LFM2 special tokens at LFM2's ids (0–13) and `<think>` / `</think>` as added tokens, written with the
//! `tokenizer_config.json` transformers reads. Training is deterministic for the same input.

use std::path::Path;

use serde_json::json;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use super::TokenError;

/// LFM2's special tokens, in id order.
pub const LFM2_SPECIAL_TOKENS: &[&str] = &[
    "<|pad|>",
    "<|startoftext|>",
    "<|endoftext|>",
    "<|fim_pre|>",
    "<|fim_mid|>",
    "<|fim_suf|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tool_list_start|>",
    "<|tool_list_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|tool_response_start|>",
    "<|tool_response_end|>",
];

/// Added (non-special) tokens: they survive decoding without special tokens, as in LFM2.5.
pub const THINK_TOKENS: &[&str] = &["<think>", "</think>"];

/// The smallest vocabulary `train_bpe` can make: the 256 bytes and the special tokens, no merge.
pub const MIN_VOCAB: usize = 256 + LFM2_SPECIAL_TOKENS.len();

/// A byte-level BPE of `vocab_size` tokens (LFM2's special tokens first, the think tokens added after them)
/// trained on `texts`.
pub fn train_bpe(texts: impl Iterator<Item = String> + Send, vocab_size: usize) -> Result<Tokenizer, TokenError> {
    let err = |e: &dyn std::fmt::Display| TokenError::Tokenizer { path: "(training)".into(), message: e.to_string() };
    if vocab_size < MIN_VOCAB {
        return Err(err(&format!(
            "a vocabulary of {vocab_size} is below the {MIN_VOCAB} tokens the bytes and special tokens take"
        )));
    }
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let special: Vec<AddedToken> = LFM2_SPECIAL_TOKENS.iter().map(|t| AddedToken::from(*t, true)).collect();
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(special)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer.train(&mut trainer, texts).map_err(|e| err(&e))?;
    tokenizer.add_tokens(THINK_TOKENS.iter().map(|t| AddedToken::from(*t, false))).map_err(|e| err(&e))?;
    Ok(tokenizer)
}

/// Writes `tokenizer.json` and a `tokenizer_config.json` naming LFM2's bos / eos / pad tokens.
pub fn write_tokenizer_files(dir: &Path, tokenizer: &Tokenizer, max_length: usize) -> Result<(), TokenError> {
    std::fs::create_dir_all(dir).map_err(|e| TokenError::Io { path: dir.to_path_buf(), source: e })?;
    let path = dir.join("tokenizer.json");
    tokenizer.save(&path, true).map_err(|e| TokenError::Tokenizer { path: path.clone(), message: e.to_string() })?;
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "add_bos_token": false,
        "add_eos_token": false,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": false,
    });
    let config_path = dir.join("tokenizer_config.json");
    let text = serde_json::to_string_pretty(&config).unwrap_or_default() + "\n";
    std::fs::write(&config_path, text).map_err(|e| TokenError::Io { path: config_path, source: e })
}
