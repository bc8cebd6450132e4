//! Learning-rate schedules: linear warmup from 0, then cosine or linear decay to a floor.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    Cosine,
    Linear,
    Constant,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub peak: f64,
    /// The floor, as a fraction of the peak.
    pub min_ratio: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
    pub decay: Decay,
}

impl Schedule {
    /// The rate of optimizer step `step` (0-based). Warmup reaches the peak at its last step
    /// (`(step + 1) / warmup`), so no step is taken at rate 0.
    pub fn lr(&self, step: usize) -> f64 {
        let floor = self.peak * self.min_ratio;
        if step < self.warmup_steps {
            return self.peak * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / span as f64).clamp(0.0, 1.0);
        match self.decay {
            Decay::Constant => self.peak,
            Decay::Linear => floor + (self.peak - floor) * (1.0 - progress),
            Decay::Cosine => floor + (self.peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let s = Schedule { peak: 1.0, min_ratio: 0.1, warmup_steps: 4, total_steps: 14, decay: Decay::Cosine };
        assert_eq!(s.lr(0), 0.25);
        assert_eq!(s.lr(3), 1.0);
        assert!((s.lr(4) - 1.0).abs() < 1e-12);
        assert!((s.lr(9) - 0.55).abs() < 1e-12);
        assert!((s.lr(14) - 0.1).abs() < 1e-12);
        let l = Schedule { decay: Decay::Linear, ..s };
        assert!((l.lr(9) - 0.55).abs() < 1e-12);
    }
}
