//! Supervised byte spans → a per-token loss mask, by one rule: a token is supervised when its byte range
//! overlaps a supervised span (so a token straddling a span edge is trained, as transformers'
//! `char_to_token(start)..=char_to_token(end-1)` does). Every supervised turn must end with the end-of-turn
//! token, and a sample with nothing supervised is an error, never a silent zero mask.

use std::ops::Range;

use serde::Serialize;

use super::TokenError;
use super::tokenizer::{SegmentCache, TextTokenizer};
use crate::chat::TextSample;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenSample {
    pub id: String,
    pub input_ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
}

impl TokenSample {
    pub fn supervised(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m == 1).count()
    }
}

/// The mask of `offsets` under `spans` (both in bytes of the same text).
pub fn mask_from_spans(offsets: &[(usize, usize)], spans: &[Range<usize>]) -> Vec<u8> {
    offsets
        .iter()
        .map(|&(start, end)| u8::from(end > start && spans.iter().any(|s| start < s.end && end > s.start)))
        .collect()
}

/// Tokenizes a rendered sample once and masks it; checks each supervised turn ends in the end-of-turn token.
pub fn tokenize_sample(tok: &TextTokenizer, sample: &TextSample) -> Result<TokenSample, TokenError> {
    tokenize_sample_cached(tok, sample, &mut SegmentCache::new())
}

/// `tokenize_sample` sharing tokenized segments with the other samples of the same conversation.
pub fn tokenize_sample_cached(
    tok: &TextTokenizer,
    sample: &TextSample,
    cache: &mut SegmentCache,
) -> Result<TokenSample, TokenError> {
    let (ids, offsets) = tok.encode_cached(&sample.text, cache)?;
    let mask = mask_from_spans(&offsets, &sample.targets);
    let fail = |message: String| TokenError::Mask { id: sample.id.clone(), message };
    for span in &sample.targets {
        let covered: Vec<usize> =
            (0..ids.len()).filter(|&i| mask[i] == 1 && offsets[i].0 < span.end && offsets[i].1 > span.start).collect();
        let Some(&last) = covered.iter().rev().find(|&&i| !tok.decode(&ids[i..=i]).trim().is_empty()) else {
            return Err(fail(format!("supervised span {span:?} covers no token")));
        };
        if ids[last] != tok.end_of_turn_id {
            return Err(fail(format!(
                "supervised turn ends with {:?}, not the end-of-turn token {}: the template and the end-of-turn setting disagree",
                tok.decode(&ids[last..=last]),
                tok.end_of_turn
            )));
        }
    }
    if !mask.contains(&1) {
        return Err(fail("no supervised token".into()));
    }
    Ok(TokenSample { id: sample.id.clone(), input_ids: ids, loss_mask: mask })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Truncation {
    /// Drop a sample longer than the sequence length (counted).
    Drop,
    /// Keep the end of the sample (the supervised turn) and cut history from the left; drop it if even the
    /// supervised tokens do not fit.
    KeepTarget,
}

/// Applies the truncation rule; `None` means the sample is dropped.
pub fn truncate(sample: TokenSample, max_len: usize, rule: Truncation) -> Option<(TokenSample, bool)> {
    if sample.input_ids.len() <= max_len {
        return Some((sample, false));
    }
    match rule {
        Truncation::Drop => None,
        Truncation::KeepTarget => {
            let cut = sample.input_ids.len() - max_len;
            let first_supervised = sample.loss_mask.iter().position(|&m| m == 1)?;
            // Keep at least one prompt token before the target: a sample that starts supervised has no context.
            if first_supervised <= cut {
                return None;
            }
            Some((
                TokenSample {
                    id: sample.id,
                    input_ids: sample.input_ids[cut..].to_vec(),
                    loss_mask: sample.loss_mask[cut..].to_vec(),
                },
                true,
            ))
        }
    }
}

/// A terminal view of a sample: supervised tokens on green, others dim, alternating shades so token
/// boundaries show; control characters made visible.
pub fn ansi_view(tok: &TextTokenizer, sample: &TokenSample) -> String {
    let mut out = String::new();
    for (i, (&id, &m)) in sample.input_ids.iter().zip(&sample.loss_mask).enumerate() {
        let piece = tok.decode(&[id]).replace('\n', "↵\n").replace('\t', "→");
        let style = match (m, i % 2) {
            (1, 0) => "\x1b[30;42m",
            (1, _) => "\x1b[30;102m",
            (_, 0) => "\x1b[2m",
            _ => "\x1b[2;4m",
        };
        out.push_str(style);
        out.push_str(&piece);
        out.push_str("\x1b[0m");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_tokens_are_supervised() {
        // "ab|cd|ef" with the span covering "c..e": tokens 1 and 2 overlap it.
        let offsets = [(0, 2), (2, 4), (4, 6), (6, 6)];
        assert_eq!(mask_from_spans(&offsets, &[Range { start: 3, end: 5 }]), [0, 1, 1, 0]);
        assert_eq!(mask_from_spans(&offsets, &[Range { start: 2, end: 4 }]), [0, 1, 0, 0]);
        assert_eq!(mask_from_spans(&offsets, &[]), [0, 0, 0, 0]);
    }

    #[test]
    fn truncation_keeps_the_target_or_drops() {
        let s =
            TokenSample { id: "s".into(), input_ids: (0..10).collect(), loss_mask: vec![0, 0, 0, 0, 0, 0, 0, 1, 1, 1] };
        let (cut, truncated) = truncate(s.clone(), 5, Truncation::KeepTarget).unwrap();
        assert!(truncated);
        assert_eq!(cut.input_ids, [5, 6, 7, 8, 9]);
        assert!(truncate(s.clone(), 5, Truncation::Drop).is_none());
        assert!(truncate(s.clone(), 2, Truncation::KeepTarget).is_none());
        assert_eq!(truncate(s, 10, Truncation::Drop).map(|(_, t)| t), Some(false));
    }
}
