//! Dynamic loss scaling for fp16, as torch.cuda.amp.GradScaler does it:
//! start high, halve the scale and skip the step when the gradients
//! overflow, double it after a run of good steps.

#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    pub scale: f64,
    /// Good steps since the scale last changed.
    pub good: u64,
    pub growth_interval: u64,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler {
            scale: 65536.0,
            good: 0,
            growth_interval: 2000,
        }
    }
}

impl LossScaler {
    /// Records one step's outcome (`finite`: its gradient norm was finite,
    /// so the update applied); returns whether the scale changed.
    pub fn update(&mut self, finite: bool) -> bool {
        if !finite {
            self.scale = (self.scale / 2.0).max(1.0);
            self.good = 0;
            return true;
        }
        self.good += 1;
        if self.good >= self.growth_interval {
            self.scale = (self.scale * 2.0).min(f32::MAX as f64 / 2.0);
            self.good = 0;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_on_overflow_and_doubles_after_a_good_run() {
        let mut s = LossScaler {
            growth_interval: 3,
            ..Default::default()
        };
        assert!(s.update(false));
        assert_eq!(s.scale, 32768.0);
        assert!(!s.update(true));
        assert!(!s.update(true));
        assert!(s.update(true));
        assert_eq!((s.scale, s.good), (65536.0, 0));
        let mut tiny = LossScaler {
            scale: 1.0,
            ..Default::default()
        };
        tiny.update(false);
        assert_eq!(tiny.scale, 1.0);
    }
}
