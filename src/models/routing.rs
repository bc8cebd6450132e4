//! The MoE routers' load: how many tokens each expert of each MoE layer was given, and how far that is from
//! an even share (MaxVio). Counted on the host from the choices the MoE forward pass reads back anyway (it
//! groups tokens by expert there), over real positions only: padding always routes alike and would show a
//! hot expert that no token made. Counting is per thread and off unless a caller runs a forward pass inside
//! `tally` (the trainer's steps, the validation measures), so decoding and evaluation pay nothing.
//!
//! transformers' LFM2-MoE keeps `expert_bias` as a buffer and has no balancing loss, so a fine-tune moves the
//! routing wherever the data pulls it; these figures say whether it stayed balanced, and `bias_steps` is the
//! trainer's optional correction (`train.expert_bias_rate`).

use std::cell::RefCell;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Tokens given to each expert, by MoE layer (the decoder layer's index → one count per expert).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ExpertLoad(pub BTreeMap<usize, Vec<u64>>);

/// How evenly a load is spread, over every MoE layer it counts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LoadBalance {
    /// MaxVio averaged over the layers: (the most tokens one expert got − the mean per expert) / that mean.
    /// 0 is a perfectly even split; with E experts it is at most E − 1 (every token on one expert).
    pub max_vio: f64,
    /// The layer whose MaxVio is highest, and that MaxVio.
    pub worst_layer: usize,
    pub worst_max_vio: f64,
    /// Experts, over all the layers, given no token at all.
    pub idle_experts: usize,
}

impl ExpertLoad {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds `other`'s counts to these, layer by layer and expert by expert.
    pub fn add(&mut self, other: &ExpertLoad) {
        for (&layer, counts) in &other.0 {
            let mine = self.0.entry(layer).or_insert_with(|| vec![0; counts.len()]);
            if mine.len() < counts.len() {
                mine.resize(counts.len(), 0);
            }
            for (m, c) in mine.iter_mut().zip(counts) {
                *m += c;
            }
        }
    }

    /// The balance over the layers that were given any token; none when no layer was.
    pub fn balance(&self) -> Option<LoadBalance> {
        let per_layer: Vec<(usize, f64)> =
            self.0.iter().filter_map(|(&layer, counts)| max_violation(counts).map(|v| (layer, v))).collect();
        let (worst_layer, worst_max_vio) =
            per_layer.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))?;
        Some(LoadBalance {
            max_vio: per_layer.iter().map(|(_, v)| v).sum::<f64>() / per_layer.len() as f64,
            worst_layer,
            worst_max_vio,
            idle_experts: self.0.values().flatten().filter(|&&c| c == 0).count(),
        })
    }
}

/// (max − mean) / mean of one layer's counts (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy
/// for Mixture-of-Experts"); none for a layer given no token.
pub fn max_violation(counts: &[u64]) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let mean = total as f64 / counts.len() as f64;
    let max = counts.iter().copied().max().unwrap_or(0) as f64;
    Some((max - mean) / mean)
}

/// How far `rate` moves each expert's bias after a step whose tokens gave this layer `counts`: up for an
/// expert given fewer than the mean, down for one given more, not at all for one at the mean (DeepSeek-V3's
/// auxiliary-loss-free balancing: `b_i += rate · sign(mean − c_i)`). Nothing moves when nothing was routed.
pub fn bias_steps(counts: &[u64], rate: f64) -> Vec<f32> {
    let total = counts.iter().map(|&c| u128::from(c)).sum::<u128>();
    if total == 0 {
        return vec![0.0; counts.len()];
    }
    // c · E against the total compares c with the mean without rounding the mean.
    counts
        .iter()
        .map(|&c| match (u128::from(c) * counts.len() as u128).cmp(&total) {
            std::cmp::Ordering::Less => rate as f32,
            std::cmp::Ordering::Greater => -(rate as f32),
            std::cmp::Ordering::Equal => 0.0,
        })
        .collect()
}

/// The count in progress on this thread: which positions of the forward pass are real, and the load so far.
struct Tally {
    real: Vec<bool>,
    load: ExpertLoad,
}

thread_local! {
    static TALLY: RefCell<Option<Tally>> = const { RefCell::new(None) };
}

/// Ends this thread's count however the forward pass ends (a panic in it is caught further up, and the next
/// pass on the thread must not add to a stale count).
struct TallyGuard;

impl Drop for TallyGuard {
    fn drop(&mut self) {
        TALLY.with_borrow_mut(|t| *t = None);
    }
}

/// Runs `forward` (one forward pass over `real.len()` flattened positions, `real[p]` false for padding) and
/// adds what its MoE layers routed to `load`. Not nested: a pass inside `forward` counts into the same tally.
pub fn tally<T>(load: &mut ExpertLoad, real: Vec<bool>, forward: impl FnOnce() -> T) -> T {
    TALLY.with_borrow_mut(|t| *t = Some(Tally { real, load: ExpertLoad::default() }));
    let guard = TallyGuard;
    let out = forward();
    if let Some(counted) = TALLY.with_borrow_mut(Option::take) {
        load.add(&counted.load);
    }
    drop(guard);
    out
}

/// Called by an MoE layer (decoder layer `layer`, `experts` experts) with the experts it chose for each
/// token, `top_k` slots a token in token order; counts them when a `tally` is running on this thread.
pub fn record(layer: usize, experts: usize, chosen: &[i64], top_k: usize) {
    TALLY.with_borrow_mut(|t| {
        let Some(t) = t else { return };
        let counts = t.load.0.entry(layer).or_insert_with(|| vec![0; experts]);
        for (slot, &expert) in chosen.iter().enumerate() {
            let real = t.real.get(slot / top_k.max(1)).copied().unwrap_or(true);
            if real && let Some(count) = usize::try_from(expert).ok().and_then(|e| counts.get_mut(e)) {
                *count += 1;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(layers: &[(usize, &[u64])]) -> ExpertLoad {
        ExpertLoad(layers.iter().map(|(l, c)| (*l, c.to_vec())).collect())
    }

    #[test]
    fn max_vio_is_zero_when_even_and_experts_minus_one_when_all_on_one() {
        assert_eq!(max_violation(&[5, 5, 5, 5]), Some(0.0));
        assert_eq!(max_violation(&[8, 0, 0, 0]), Some(3.0));
        // mean 4, max 6
        assert_eq!(max_violation(&[6, 2, 4, 4]), Some(0.5));
        assert_eq!(max_violation(&[0, 0]), None);
    }

    #[test]
    fn the_balance_averages_the_layers_and_names_the_worst() {
        let b = load(&[(2, &[6, 2, 4, 4]), (3, &[8, 0, 0, 0]), (4, &[0, 0, 0, 0])]).balance().unwrap();
        assert_eq!(b.max_vio, 1.75);
        assert_eq!((b.worst_layer, b.worst_max_vio), (3, 3.0));
        // The layer given nothing counts its experts idle but adds no MaxVio.
        assert_eq!(b.idle_experts, 7);
        assert_eq!(ExpertLoad::default().balance(), None);
    }

    #[test]
    fn the_bias_moves_toward_an_even_load() {
        // mean 4: under it up, over it down, at it still.
        assert_eq!(bias_steps(&[6, 2, 4, 4], 0.01), [-0.01, 0.01, 0.0, 0.0]);
        // mean 7/3: no expert sits at it.
        assert_eq!(bias_steps(&[7, 0, 0], 0.5), [-0.5, 0.5, 0.5]);
        assert_eq!(bias_steps(&[0, 0, 0], 0.5), [0.0, 0.0, 0.0]);
    }

    #[test]
    fn loads_add_layer_by_layer() {
        let mut a = load(&[(2, &[1, 2])]);
        a.add(&load(&[(2, &[3, 4]), (5, &[1, 0])]));
        assert_eq!(a, load(&[(2, &[4, 6]), (5, &[1, 0])]));
    }

    #[test]
    fn a_tally_counts_real_positions_only_and_nothing_outside_it() {
        // Three positions, the last one padding; two slots per token.
        let chosen = [0, 1, 1, 2, 3, 3];
        record(2, 4, &chosen, 2);
        let mut counted = ExpertLoad::default();
        let out = tally(&mut counted, vec![true, true, false], || {
            record(2, 4, &chosen, 2);
            record(4, 4, &[3, 2], 2);
            7
        });
        assert_eq!(out, 7);
        assert_eq!(counted, load(&[(2, &[1, 2, 1, 0]), (4, &[0, 0, 1, 1])]));
        record(2, 4, &chosen, 2);
        let mut again = ExpertLoad::default();
        tally(&mut again, Vec::new(), || ());
        assert!(again.is_empty(), "records outside a tally are not kept: {again:?}");
    }

    #[test]
    fn a_panicking_pass_leaves_no_tally_behind() {
        let mut counted = ExpertLoad::default();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tally(&mut counted, vec![true], || {
                record(1, 2, &[0], 1);
                panic!("the device failed");
            })
        }));
        assert!(caught.is_err());
        assert!(TALLY.with_borrow(Option::is_none));
        assert!(counted.is_empty());
    }
}
