//! How generation picks each next token: greedy, or transformers' multinomial sampling, with its logits
//! processors in its order (repetition penalty, then temperature, top-k, top-p, min-p) and a seeded draw.
//! The settings are a checkpoint's generation_config.json read as transformers' `generate()` reads it (its
//! defaults for the keys a file lacks: greedy, and top-k 50 once sampling is on), then the caller's overrides.
//! One row of f32 logits at a time, on the host. The TB2-lite eval stays greedy whatever a checkpoint says.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// What transformers' `generate()` does when a checkpoint's generation_config.json does not say otherwise.
const DEFAULT_TOP_K: usize = 50;

#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    #[error("{path}: {message}")]
    Config { path: String, message: String },
    #[error("{key} = {value}: {rule}")]
    Setting { key: &'static str, value: String, rule: &'static str },
}

/// How to choose tokens. `top_k` 0 and `top_p` 1 turn those filters off, `repetition_penalty` 1 the penalty;
/// the penalty applies to greedy decoding too, as in transformers.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GenerationSettings {
    pub do_sample: bool,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: Option<f32>,
    pub repetition_penalty: f32,
}

impl Default for GenerationSettings {
    fn default() -> Self {
        GenerationSettings {
            do_sample: false,
            temperature: 1.0,
            top_k: DEFAULT_TOP_K,
            top_p: 1.0,
            min_p: None,
            repetition_penalty: 1.0,
        }
    }
}

/// The keys of generation_config.json that choose tokens; absent or null keys take transformers' defaults.
#[derive(Debug, Default, Deserialize)]
struct GenerationConfigKeys {
    do_sample: Option<bool>,
    temperature: Option<f64>,
    top_k: Option<i64>,
    top_p: Option<f64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
}

/// The caller's choices over a checkpoint's: `greedy` forces greedy decoding; a temperature of 0 means
/// greedy, and any other sampling value given turns sampling on (transformers would ignore it without
/// `do_sample`, a common surprise).
#[derive(Clone, Debug, Default)]
pub struct SamplingOverrides {
    pub greedy: bool,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl GenerationSettings {
    /// The settings of a generation_config.json's keys, checked.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, SamplingError> {
        let keys: GenerationConfigKeys = serde_json::from_value(value.clone())
            .map_err(|e| SamplingError::Config { path: "generation_config.json".into(), message: e.to_string() })?;
        let defaults = GenerationSettings::default();
        let top_k = match keys.top_k {
            None => defaults.top_k,
            Some(k) if k >= 0 => k as usize,
            Some(k) => return Err(setting("top_k", k, "must be 0 (off) or more")),
        };
        let settings = GenerationSettings {
            do_sample: keys.do_sample.unwrap_or(defaults.do_sample),
            temperature: keys.temperature.map_or(defaults.temperature, |t| t as f32),
            top_k,
            top_p: keys.top_p.map_or(defaults.top_p, |p| p as f32),
            min_p: keys.min_p.map(|p| p as f32),
            repetition_penalty: keys.repetition_penalty.map_or(defaults.repetition_penalty, |r| r as f32),
        };
        settings.checked()
    }

    /// A checkpoint folder's generation_config.json (transformers' defaults where the folder has none).
    pub fn from_checkpoint(dir: &Path) -> Result<Self, SamplingError> {
        let path = dir.join("generation_config.json");
        let config_error = |message: String| SamplingError::Config { path: path.display().to_string(), message };
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(GenerationSettings::default()),
            Err(e) => return Err(config_error(e.to_string())),
        };
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| config_error(e.to_string()))?;
        GenerationSettings::from_json(&value).map_err(|e| match e {
            SamplingError::Config { message, .. } => config_error(message),
            setting => config_error(setting.to_string()),
        })
    }

    /// These settings with the caller's overrides applied, checked.
    pub fn overridden(mut self, overrides: &SamplingOverrides) -> Result<Self, SamplingError> {
        if let Some(t) = overrides.temperature {
            if t == 0.0 {
                self.do_sample = false;
            } else {
                self.temperature = t;
                self.do_sample = true;
            }
        }
        if let Some(k) = overrides.top_k {
            self.top_k = k;
            self.do_sample = true;
        }
        if let Some(p) = overrides.top_p {
            self.top_p = p;
            self.do_sample = true;
        }
        if let Some(p) = overrides.min_p {
            self.min_p = Some(p);
            self.do_sample = true;
        }
        if let Some(r) = overrides.repetition_penalty {
            self.repetition_penalty = r;
        }
        if overrides.greedy {
            self.do_sample = false;
        }
        self.checked()
    }

    /// transformers' own limits on these values.
    fn checked(self) -> Result<Self, SamplingError> {
        let positive = |x: f32| x.is_finite() && x > 0.0;
        let unit = |x: f32| (0.0..=1.0).contains(&x);
        if self.do_sample && !positive(self.temperature) {
            return Err(setting("temperature", self.temperature, "must be a number above 0 to sample (0: greedy)"));
        }
        if !unit(self.top_p) {
            return Err(setting("top_p", self.top_p, "must lie in [0, 1] (1: off)"));
        }
        if let Some(p) = self.min_p.filter(|p| !unit(*p)) {
            return Err(setting("min_p", p, "must lie in [0, 1]"));
        }
        if !positive(self.repetition_penalty) {
            return Err(setting("repetition_penalty", self.repetition_penalty, "must be a number above 0 (1: off)"));
        }
        Ok(self)
    }

    /// Greedy decoding with nothing to change in the logits: the model's argmax, taken on the device.
    pub fn is_plain_greedy(&self) -> bool {
        !self.do_sample && self.repetition_penalty == 1.0
    }

    /// One line for the user: `greedy` or `sampling (temperature 0.6, top-k 20, top-p 0.95)`, and the penalty.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.do_sample {
            parts.push(format!("temperature {}", self.temperature));
            if self.top_k > 0 {
                parts.push(format!("top-k {}", self.top_k));
            }
            if self.top_p < 1.0 {
                parts.push(format!("top-p {}", self.top_p));
            }
            if let Some(p) = self.min_p {
                parts.push(format!("min-p {p}"));
            }
        }
        if self.repetition_penalty != 1.0 {
            parts.push(format!("repetition penalty {}", self.repetition_penalty));
        }
        let mode = if self.do_sample { "sampling" } else { "greedy" };
        if parts.is_empty() { mode.to_string() } else { format!("{mode} ({})", parts.join(", ")) }
    }

    /// `scores` (one row's logits) as transformers processes them before it draws (sampling) or takes the
    /// argmax (greedy) after `history` (the prompt and the tokens generated so far): removed tokens at -inf.
    pub fn process(&self, scores: &mut [f32], history: &[u32]) {
        if self.repetition_penalty != 1.0 {
            penalize_repeats(scores, history, self.repetition_penalty);
        }
        if !self.do_sample {
            return;
        }
        if self.temperature != 1.0 {
            scores.iter_mut().for_each(|s| *s /= self.temperature);
        }
        if self.top_k > 0 {
            keep_top_k(scores, self.top_k);
        }
        if self.top_p < 1.0 {
            keep_top_p(scores, self.top_p);
        }
        if let Some(min_p) = self.min_p {
            keep_min_p(scores, min_p);
        }
    }
}

fn setting(key: &'static str, value: impl std::fmt::Display, rule: &'static str) -> SamplingError {
    SamplingError::Setting { key, value: value.to_string(), rule }
}

/// Each token seen in `history` once: its score divided by `penalty` if positive, multiplied if negative.
fn penalize_repeats(scores: &mut [f32], history: &[u32], penalty: f32) {
    let mut seen = vec![false; scores.len()];
    for &id in history {
        // Ids past the output vocabulary (an embedding larger than the head) cannot be generated.
        if let Some(s) = seen.get_mut(id as usize).filter(|s| !**s) {
            *s = true;
            let score = &mut scores[id as usize];
            *score = if *score < 0.0 { *score * penalty } else { *score / penalty };
        }
    }
}

/// Removes every score below the `k`-th highest (ties with it stay, as `torch.topk`'s threshold keeps them).
fn keep_top_k(scores: &mut [f32], k: usize) {
    if k >= scores.len() {
        return;
    }
    let mut sorted = scores.to_vec();
    let (_, kth, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let threshold = *kth;
    scores.iter_mut().filter(|s| **s < threshold).for_each(|s| *s = f32::NEG_INFINITY);
}

/// Keeps the most likely tokens whose probabilities add up to `top_p`: from the least likely up, a token is
/// removed while the mass up to and including it is at most `1 − top_p`; the most likely always stays.
fn keep_top_p(scores: &mut [f32], top_p: f32) {
    let probs = softmax(scores);
    // Tokens already removed carry no mass: only the others are ordered (after top-k, a few dozen of a
    // vocabulary of 10⁵).
    let mut order: Vec<usize> = (0..scores.len()).filter(|&i| scores[i] > f32::NEG_INFINITY).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let limit = 1.0 - top_p as f64;
    let mut mass = 0.0;
    for &i in &order[..order.len().saturating_sub(1)] {
        mass += probs[i];
        if mass > limit {
            break;
        }
        scores[i] = f32::NEG_INFINITY;
    }
}

/// Removes tokens less likely than `min_p` times the most likely one.
fn keep_min_p(scores: &mut [f32], min_p: f32) {
    let probs = softmax(scores);
    let top = probs.iter().copied().fold(0.0, f64::max);
    let floor = min_p as f64 * top;
    for (s, p) in scores.iter_mut().zip(&probs) {
        if *p < floor {
            *s = f32::NEG_INFINITY;
        }
    }
}

/// Probabilities of a row of scores, in f64 (removed tokens get 0).
fn softmax(scores: &[f32]) -> Vec<f64> {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let exps: Vec<f64> = scores.iter().map(|&s| (s as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// The first index of the highest score (`torch.argmax`'s choice among ties).
pub fn argmax(scores: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &s) in scores.iter().enumerate() {
        if s > scores[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks tokens with one generation's settings and its own seeded random stream: the same seed, settings
/// and logits give the same tokens.
pub struct TokenPicker {
    pub settings: GenerationSettings,
    rng: ChaCha8Rng,
}

impl TokenPicker {
    pub fn new(settings: GenerationSettings, seed: u64) -> Self {
        TokenPicker { settings, rng: ChaCha8Rng::seed_from_u64(seed) }
    }

    pub fn greedy() -> Self {
        TokenPicker::new(GenerationSettings::default(), 0)
    }

    /// The next token after `history` from one row's logits (processed in place).
    pub fn pick(&mut self, scores: &mut [f32], history: &[u32]) -> u32 {
        self.settings.process(scores, history);
        if !self.settings.do_sample {
            return argmax(scores);
        }
        draw(&softmax(scores), self.rng.random::<f64>())
    }
}

/// The token whose stretch of the cumulative distribution holds `u` ∈ [0, 1); the most likely one should
/// rounding leave `u` past the last stretch.
fn draw(probs: &[f64], u: f64) -> u32 {
    let mut mass = 0.0;
    for (i, &p) in probs.iter().enumerate() {
        mass += p;
        if p > 0.0 && u < mass {
            return i as u32;
        }
    }
    let scores: Vec<f32> = probs.iter().map(|&p| p as f32).collect();
    argmax(&scores)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// tests/fixtures/sampling/processors.json (make_fixture.py): what transformers 5.23.0's `generate()` did to
    /// each step's logits for each case's generation_config.json keys.
    #[test]
    fn logits_are_processed_as_transformers_generate_does() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sampling/processors.json");
        let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = fixture["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 8);
        let mut removed_somewhere = 0;
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let settings = GenerationSettings::from_json(&case["generation_config"]).unwrap();
            for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
                let history: Vec<u32> = serde_json::from_value(step["ids"].clone()).unwrap();
                let mut scores: Vec<f32> = serde_json::from_value(step["logits"].clone()).unwrap();
                let theirs: Vec<Option<f32>> = serde_json::from_value(step["scores"].clone()).unwrap();
                settings.process(&mut scores, &history);
                for (t, (ours, theirs)) in scores.iter().zip(&theirs).enumerate() {
                    match theirs {
                        None => {
                            assert_eq!(*ours, f32::NEG_INFINITY, "{name} step {i} token {t}: kept, they removed it")
                        }
                        Some(v) => assert!(
                            (ours - v).abs() <= 1e-5 * v.abs().max(1.0),
                            "{name} step {i} token {t}: {ours} vs their {v}"
                        ),
                    }
                }
                removed_somewhere += theirs.iter().filter(|v| v.is_none()).count();
            }
        }
        assert!(removed_somewhere > 1000, "the cases filter: {removed_somewhere} removals");
    }

    #[test]
    fn generation_config_keys_take_transformers_defaults_and_limits() {
        let settings = |v: serde_json::Value| GenerationSettings::from_json(&v);
        assert_eq!(settings(serde_json::json!({})).unwrap(), GenerationSettings::default());
        let qwen =
            settings(serde_json::json!({"do_sample": true, "temperature": 0.6, "top_p": 0.95, "bos_token_id": 1}));
        assert_eq!(qwen.unwrap().describe(), "sampling (temperature 0.6, top-k 50, top-p 0.95)");
        let nulls = settings(serde_json::json!({"do_sample": true, "top_k": null, "temperature": null})).unwrap();
        assert_eq!((nulls.top_k, nulls.temperature), (50, 1.0));
        let refusals = [
            (serde_json::json!({"do_sample": true, "temperature": 0.0}), "temperature = 0: must be a number above 0"),
            (serde_json::json!({"top_p": 1.5}), "top_p = 1.5: must lie in [0, 1]"),
            (serde_json::json!({"min_p": -0.1}), "min_p = -0.1: must lie in [0, 1]"),
            (serde_json::json!({"top_k": -3}), "top_k = -3: must be 0 (off) or more"),
            (serde_json::json!({"repetition_penalty": 0}), "repetition_penalty = 0: must be a number above 0"),
            (serde_json::json!({"do_sample": "yes"}), "invalid type: string \"yes\", expected a boolean"),
        ];
        for (keys, message) in refusals {
            let error = settings(keys.clone()).unwrap_err().to_string();
            assert!(error.contains(message), "{keys}: {error}");
        }
        // A greedy checkpoint's temperature is kept for when sampling is asked for, as transformers keeps it.
        let greedy = settings(serde_json::json!({"temperature": 0.0})).unwrap();
        assert!(greedy.is_plain_greedy());
    }

    #[test]
    fn a_checkpoint_folder_without_the_file_is_greedy_and_a_broken_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(GenerationSettings::from_checkpoint(dir.path()).unwrap(), GenerationSettings::default());
        let path = dir.path().join("generation_config.json");
        std::fs::write(&path, "{\"do_sample\": true, ").unwrap();
        let error = GenerationSettings::from_checkpoint(dir.path()).unwrap_err().to_string();
        assert!(error.starts_with(&path.display().to_string()) && error.contains("EOF"), "{error}");
        std::fs::write(&path, "{\"do_sample\": true, \"top_p\": 2}").unwrap();
        let error = GenerationSettings::from_checkpoint(dir.path()).unwrap_err().to_string();
        assert_eq!(error, format!("{}: top_p = 2: must lie in [0, 1] (1: off)", path.display()));
    }

    #[test]
    fn overrides_turn_sampling_on_and_off() {
        let greedy = GenerationSettings::default();
        let hot = greedy.clone().overridden(&SamplingOverrides { top_p: Some(0.9), ..Default::default() }).unwrap();
        assert_eq!(hot.describe(), "sampling (temperature 1, top-k 50, top-p 0.9)");
        let cold = hot.clone().overridden(&SamplingOverrides { temperature: Some(0.0), ..Default::default() }).unwrap();
        assert_eq!(cold.describe(), "greedy");
        let forced = SamplingOverrides {
            greedy: true,
            temperature: Some(0.7),
            repetition_penalty: Some(1.1),
            ..Default::default()
        };
        assert_eq!(hot.overridden(&forced).unwrap().describe(), "greedy (repetition penalty 1.1)");
        let negative = SamplingOverrides { temperature: Some(-1.0), ..Default::default() };
        assert_eq!(
            greedy.overridden(&negative).unwrap_err().to_string(),
            "temperature = -1: must be a number above 0 to sample (0: greedy)"
        );
    }

    /// The draws follow the processed distribution: 40,000 draws of a fixed seed land on each kept token within
    /// 1.5 % (absolute) of its probability, never on a removed one; the same seed repeats them.
    #[test]
    fn draws_follow_the_processed_probabilities_and_repeat_with_the_seed() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, 3.0, -4.0];
        let settings = GenerationSettings { do_sample: true, top_k: 4, ..Default::default() };
        let mut expected = logits.to_vec();
        settings.process(&mut expected, &[]);
        let probs = softmax(&expected);
        assert_eq!(probs.iter().filter(|&&p| p > 0.0).count(), 4);
        let run = |seed| {
            let mut picker = TokenPicker::new(settings.clone(), seed);
            (0..40_000).map(|_| picker.pick(&mut logits.to_vec(), &[])).collect::<Vec<u32>>()
        };
        let drawn = run(7);
        assert_eq!(drawn, run(7));
        assert_ne!(drawn, run(8));
        for (token, p) in probs.iter().enumerate() {
            let share = drawn.iter().filter(|&&t| t as usize == token).count() as f64 / drawn.len() as f64;
            assert!((share - p).abs() < 0.015, "token {token}: drawn {share:.4}, probability {p:.4}");
            if *p == 0.0 {
                assert_eq!(share, 0.0, "token {token} was removed");
            }
        }
    }

    #[test]
    fn greedy_takes_the_first_highest_score_after_the_penalty() {
        let mut picker = TokenPicker::greedy();
        assert_eq!(picker.pick(&mut [0.5, 2.0, 2.0, -1.0], &[]), 1);
        let mut penalized = TokenPicker::new(GenerationSettings { repetition_penalty: 2.0, ..Default::default() }, 0);
        // 2.0 / 2 = 1.0 for the repeated token 1; token 2 (2.0) wins.
        assert_eq!(penalized.pick(&mut [0.5, 2.0, 2.0, -1.0], &[1, 1, 3]), 2);
        assert_eq!(draw(&[0.0, 0.25, 0.75], 0.9999999999), 2);
        assert_eq!(draw(&[0.0, 0.25, 0.75], 0.0), 1);
    }
}
