//! Learning-rate schedules: linear warmup from 0, then the peak held (warmup-stable-decay) until the decay
//! phase, cosine, linear or 1-sqrt down to a floor.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    Cosine,
    Linear,
    /// `1 − √progress` (Hägele et al. 2024), the usual decay of a warmup-stable-decay schedule.
    #[serde(rename = "1-sqrt")]
    #[value(name = "1-sqrt")]
    OneMinusSqrt,
    Constant,
}

impl Decay {
    /// The name a config writes.
    pub fn name(self) -> &'static str {
        match self {
            Decay::Cosine => "cosine",
            Decay::Linear => "linear",
            Decay::OneMinusSqrt => "1-sqrt",
            Decay::Constant => "constant",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub peak: f64,
    /// The floor, as a fraction of the peak.
    pub min_ratio: f64,
    pub warmup_steps: usize,
    /// The last steps, over which the rate decays; before them (after warmup) it holds at the peak.
    pub decay_steps: usize,
    pub total_steps: usize,
    pub decay: Decay,
}

impl Schedule {
    /// The schedule of `total_steps` with `warmup_steps`, decaying over the last `decay_ratio` of all steps
    /// (rounded up; never into the warmup): 1 decays over every step after warmup.
    pub fn new(
        peak: f64,
        min_ratio: f64,
        warmup_steps: usize,
        decay_ratio: f64,
        total_steps: usize,
        decay: Decay,
    ) -> Self {
        let after_warmup = total_steps.saturating_sub(warmup_steps);
        let decay_steps = ((decay_ratio * total_steps as f64).ceil() as usize).min(after_warmup);
        Schedule { peak, min_ratio, warmup_steps, decay_steps, total_steps, decay }
    }

    /// The rate of optimizer step `step` (0-based). Warmup reaches the peak at its last step
    /// (`(step + 1) / warmup`), so no step is taken at rate 0; the decay runs as transformers' schedules do
    /// (`progress = steps into the decay / decay steps`, so the last step sits just above the floor).
    pub fn lr(&self, step: usize) -> f64 {
        let floor = self.peak * self.min_ratio;
        if step < self.warmup_steps {
            return self.peak * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let decay_from = self.total_steps - self.decay_steps.min(self.total_steps);
        if step < decay_from {
            return self.peak;
        }
        let progress = ((step - decay_from) as f64 / self.decay_steps.max(1) as f64).clamp(0.0, 1.0);
        let factor = match self.decay {
            Decay::Constant => return self.peak,
            Decay::Linear => 1.0 - progress,
            Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            Decay::OneMinusSqrt => 1.0 - progress.sqrt(),
        };
        floor + (self.peak - floor) * factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let s = Schedule::new(1.0, 0.1, 4, 1.0, 14, Decay::Cosine);
        assert_eq!(s.decay_steps, 10);
        assert_eq!(s.lr(0), 0.25);
        assert_eq!(s.lr(3), 1.0);
        assert!((s.lr(4) - 1.0).abs() < 1e-12);
        assert!((s.lr(9) - 0.55).abs() < 1e-12);
        assert!((s.lr(14) - 0.1).abs() < 1e-12);
        let l = Schedule { decay: Decay::Linear, ..s };
        assert!((l.lr(9) - 0.55).abs() < 1e-12);
    }

    /// Warmup-stable-decay as transformers' `get_wsd_schedule(num_warmup_steps=2, num_decay_steps=6,
    /// num_training_steps=20, min_lr_ratio=0.1, decay_type=…)` gives it after warmup (its warmup starts a step
    /// earlier, at 0): the values below are its `_get_wsd_scheduler_lambda`'s (transformers 5.23.0).
    #[test]
    fn warmup_stable_decay_matches_transformers() {
        let expected = [
            (Decay::Linear, [1.0, 1.0, 1.0, 0.85, 0.55, 0.24999999999999997, 0.1]),
            (Decay::Cosine, [1.0, 1.0, 1.0, 0.9397114317029974, 0.55, 0.16028856829700258, 0.1]),
            (Decay::OneMinusSqrt, [1.0, 1.0, 1.0, 0.6325765385825233, 0.36360389693210715, 0.17841616374225078, 0.1]),
        ];
        for (decay, values) in expected {
            // 0.3 of 20 steps: the last 6 decay.
            let s = Schedule::new(1.0, 0.1, 2, 0.3, 20, decay);
            assert_eq!((s.decay_steps, s.lr(1)), (6, 1.0));
            for (step, want) in [2, 13, 14, 15, 17, 19, 20].into_iter().zip(values) {
                assert!((s.lr(step) - want).abs() < 1e-12, "{decay:?} step {step}: {} vs {want}", s.lr(step));
            }
        }
        // A decay share longer than what follows warmup starts where warmup ends.
        let whole = Schedule::new(1.0, 0.0, 5, 0.9, 10, Decay::Linear);
        assert_eq!((whole.decay_steps, whole.lr(4), whole.lr(5)), (5, 1.0, 1.0));
        assert!((whole.lr(7) - 0.6).abs() < 1e-12);
    }
}
