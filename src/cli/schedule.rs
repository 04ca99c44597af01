//! The learning-rate schedule's command-line overrides (`fusec train
//! --schedule cosine --warmup 100 ...`) over the model file's `schedule`.

use super::CliError;
use clap::Args;
use fusec_compiler::model::{Decay, Schedule};

#[derive(Args, Debug, Default, Clone)]
pub struct ScheduleArgs {
    /// Learning-rate schedule after the warmup: constant, cosine or linear
    /// decay to --min-lr, or inverse_sqrt (lr * sqrt(warmup / step), the
    /// Transformer's) (default: the model file's `schedule`, or constant)
    #[arg(long, value_name = "KIND", value_parser = ["constant", "cosine", "linear", "inverse_sqrt"])]
    pub schedule: Option<String>,
    /// Steps of linear warmup from lr/N to lr
    #[arg(long, value_name = "N")]
    pub warmup: Option<u64>,
    /// The step the decay ends at (default: the run's last step; a resumed
    /// run keeps the first run's)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub decay_steps: Option<u64>,
    /// The rate the decay ends at (default 0)
    #[arg(long, value_name = "LR")]
    pub min_lr: Option<f64>,
}

impl ScheduleArgs {
    /// The model file's schedule with these overrides, checked against the
    /// peak rate `lr`.
    pub fn resolve(&self, model: Schedule, lr: f64) -> Result<Schedule, CliError> {
        let mut s = model;
        if let Some(kind) = &self.schedule {
            s.decay = match kind.as_str() {
                "cosine" => Decay::Cosine,
                "linear" => Decay::Linear,
                "inverse_sqrt" => Decay::InverseSqrt,
                _ => Decay::Constant,
            };
        }
        if let Some(w) = self.warmup {
            s.warmup = w;
        }
        if let Some(n) = self.decay_steps {
            s.steps = Some(n);
        }
        if let Some(m) = self.min_lr {
            s.min_lr = m;
        }
        if !(s.min_lr >= 0.0 && s.min_lr <= lr) {
            return Err(CliError::usage(format!(
                "error: the schedule's minimum rate {} must be from 0 to the peak rate {lr}",
                s.min_lr
            )));
        }
        if s.decay == Decay::InverseSqrt && s.warmup == 0 {
            return Err(CliError::usage(
                "error: the inverse_sqrt schedule needs --warmup of at least 1 step (its rate after the warmup is lr * sqrt(warmup / step))".to_string(),
            ));
        }
        if let Some(n) = s
            .steps
            .filter(|&n| n <= s.warmup && matches!(s.decay, Decay::Cosine | Decay::Linear))
        {
            return Err(CliError::usage(format!(
                "error: the decay ends at step {n}, which is not after the {} warmup steps; give --decay-steps past --warmup",
                s.warmup
            )));
        }
        Ok(s)
    }
}
