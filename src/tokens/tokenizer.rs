//! The checkpoint's tokenizer (`tokenizer.json` through the tokenizers crate) and the special ids the
//! pipeline needs, read from the checkpoint's own files — never hard-coded.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use aho_corasick::{AhoCorasick, MatchKind};

use serde::{Deserialize, Serialize};

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
    /// Finds the added tokens the text can be cut at (see `encode_cached`); `None` disables the cache.
    splitter: Option<(AhoCorasick, Vec<u32>)>,
}

/// Token ids and their byte offsets in the encoded text.
pub type Encoded = (Vec<u32>, Vec<(usize, usize)>);

/// Token ids with byte offsets of one text segment, cached across the samples of a conversation.
pub type SegmentCache = HashMap<String, Encoded>;

/// The added tokens text can be cut at without changing the tokenization: matched verbatim (not
/// normalized) and without whitespace stripping or word-boundary rules. None if there are none.
fn added_token_splitter(tok: &tokenizers::Tokenizer) -> Option<(AhoCorasick, Vec<u32>)> {
    let mut tokens: Vec<(String, u32)> = tok
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| !t.normalized && !t.lstrip && !t.rstrip && !t.single_word && !t.content.is_empty())
        .map(|(id, t)| (t.content, id))
        .collect();
    if tokens.is_empty() {
        return None;
    }
    tokens.sort();
    let finder =
        AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(tokens.iter().map(|(c, _)| c)).ok()?;
    Some((finder, tokens.into_iter().map(|(_, id)| id).collect()))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
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
        let splitter = added_token_splitter(&inner);
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
            splitter,
        })
    }

    /// `encode`, but each stretch of text between added tokens is tokenized once per `cache`: the
    /// tokenizer splits on added tokens before anything else, so the pieces tokenize independently and the
    /// history shared by a conversation's per-turn samples is not tokenized again for every turn.
    pub fn encode_cached(&self, text: &str, cache: &mut SegmentCache) -> Result<Encoded, TokenError> {
        let Some((finder, ids_of)) = &self.splitter else { return self.encode(text) };
        let mut ids = Vec::new();
        let mut offsets = Vec::new();
        let mut pos = 0;
        let mut piece = |start: usize,
                         end: usize,
                         ids: &mut Vec<u32>,
                         offsets: &mut Vec<(usize, usize)>|
         -> Result<(), TokenError> {
            if start == end {
                return Ok(());
            }
            let segment = &text[start..end];
            if !cache.contains_key(segment) {
                let encoded = self.encode(segment)?;
                cache.insert(segment.to_string(), encoded);
            }
            let (seg_ids, seg_offsets) = &cache[segment];
            ids.extend_from_slice(seg_ids);
            offsets.extend(seg_offsets.iter().map(|&(a, b)| (a + start, b + start)));
            Ok(())
        };
        for m in finder.find_iter(text) {
            piece(pos, m.start(), &mut ids, &mut offsets)?;
            ids.push(ids_of[m.pattern().as_usize()]);
            offsets.push((m.start(), m.end()));
            pos = m.end();
        }
        piece(pos, text.len(), &mut ids, &mut offsets)?;
        Ok((ids, offsets))
    }

    /// Token ids and byte offsets of `text`, without added special tokens (templates emit BOS themselves).
    pub fn encode(&self, text: &str) -> Result<Encoded, TokenError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenError::Tokenizer { path: self.path.clone(), message: e.to_string() })?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    /// Text of generated tokens as they come, to print piece by piece (`TextStream`).
    pub fn stream(&self) -> TextStream<'_> {
        TextStream { tokenizer: self, ids: Vec::new(), context: 0, shown: 0 }
    }

    /// Decodes without special tokens, as generated text is read for scoring.
    pub fn decode_skip_special(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, true).unwrap_or_default()
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

/// Generated text printed as it grows, decoded a few tokens at a time as text-generation-inference does it:
/// each new token is decoded with the tokens since the last piece shown (context for the decoder's rules on
/// spaces and merges), and the text past that context is the new piece, held back while it ends in an
/// incomplete character (a byte-level token sequence cut inside a UTF-8 character decodes to U+FFFD until the
/// character's last byte comes). Linear in the reply's length, not quadratic.
pub struct TextStream<'a> {
    tokenizer: &'a TextTokenizer,
    ids: Vec<u32>,
    /// The tokens from `context` to `shown` were shown last; those after `shown` are not shown yet.
    context: usize,
    shown: usize,
}

impl TextStream<'_> {
    /// The text `id` adds that is ready to show (empty while a character is incomplete).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        let before = self.tokenizer.decode(&self.ids[self.context..self.shown]);
        let text = self.tokenizer.decode(&self.ids[self.context..]);
        match text.get(before.len()..) {
            Some(piece) if text.len() > before.len() && !text.ends_with('\u{FFFD}') => {
                let piece = piece.to_string();
                (self.context, self.shown) = (self.shown, self.ids.len());
                piece
            }
            _ => String::new(),
        }
    }

    /// What is left to show once generation ends (an incomplete character as U+FFFD).
    pub fn finish(&mut self) -> String {
        let before = self.tokenizer.decode(&self.ids[self.context..self.shown]);
        let text = self.tokenizer.decode(&self.ids[self.context..]);
        self.shown = self.ids.len();
        text.get(before.len()..).unwrap_or_default().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces add up to the decoded text, and none shows half a character, though the tiny BPE cuts
    /// multi-byte characters into byte tokens.
    #[test]
    fn a_stream_shows_whole_characters_and_adds_up_to_the_decoded_text() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/tiny");
        let tokenizer = TextTokenizer::load(&dir, &SpecialTokens::load(&dir).unwrap(), None).unwrap();
        let text = "naïve café → ü 日本語 ls -la<|im_end|>";
        let ids = tokenizer.encode(text).unwrap().0;
        assert!(
            ids.iter().any(|&id| tokenizer.decode(&[id]).contains('\u{FFFD}')),
            "some token holds part of a character"
        );
        let mut stream = tokenizer.stream();
        let mut pieces: Vec<String> = ids.iter().map(|&id| stream.push(id)).collect();
        pieces.push(stream.finish());
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert!(pieces.iter().filter(|p| p.is_empty()).count() > 1, "pieces were held back: {pieces:?}");
        assert_eq!(pieces.concat(), tokenizer.decode(&ids));
        assert_eq!(pieces.concat(), text);
    }

    /// The same with real tokenizers of other decoders: Qwen's byte-level BPE and Gemma's SentencePiece
    /// pieces with byte fallback (its decoder turns `▁` into spaces and fuses byte tokens), over spaces, runs
    /// of spaces, newlines, CJK, emoji and accents, decoded a few tokens at a time.
    #[test]
    fn a_stream_adds_up_with_byte_level_and_sentencepiece_tokenizers() {
        let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/tokenizers");
        let text = "  Hello  world!\n\tcd /app && ls -la\n日本語のテキスト 🦀🚀 naïve café — ok\n\n  end ";
        for name in ["qwen3.5-derived", "gemma3"] {
            let dir = shared.join(name);
            let tokenizer = TextTokenizer::load(&dir, &SpecialTokens::load(&dir).unwrap(), None).unwrap();
            let ids = tokenizer.encode(text).unwrap().0;
            let mut stream = tokenizer.stream();
            let mut pieces: Vec<String> = ids.iter().map(|&id| stream.push(id)).collect();
            pieces.push(stream.finish());
            assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{name}: {pieces:?}");
            assert_eq!(pieces.concat(), tokenizer.decode(&ids), "{name}");
        }
    }
}
