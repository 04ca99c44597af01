//! A checked model: the forward graph plus what the `train` section asks for.

pub mod structure;
pub mod values;

use crate::dsl::ast::Span;
use crate::ir::print::num;
use crate::ir::{DType, Graph};

#[derive(Clone, Debug, PartialEq)]
pub enum Optimizer {
    AdamW {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    },
}

impl Optimizer {
    pub fn lr(&self) -> f64 {
        match self {
            Optimizer::AdamW { lr, .. } | Optimizer::Sgd { lr, .. } => *lr,
        }
    }
}

impl Optimizer {
    /// The optimizer's name and its settings as `key=value` words with
    /// round-tripping numbers (`betas=(0.9, 0.95)`): what `fusec check`
    /// prints and what the PyTorch twin passes to `torch.optim`.
    pub fn settings(&self) -> (&'static str, Vec<String>) {
        match self {
            Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => (
                "adamw",
                vec![
                    format!("lr={}", num(*lr)),
                    format!("betas=({}, {})", num(*beta1), num(*beta2)),
                    format!("eps={}", num(*eps)),
                    format!("weight_decay={}", num(*weight_decay)),
                ],
            ),
            Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
            } => (
                "sgd",
                vec![
                    format!("lr={}", num(*lr)),
                    format!("momentum={}", num(*momentum)),
                    format!("weight_decay={}", num(*weight_decay)),
                ],
            ),
        }
    }
}

impl std::fmt::Display for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (name, settings) = self.settings();
        write!(f, "{name}({})", settings.join(", "))
    }
}

/// How the rate falls after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decay {
    Constant,
    Cosine,
    Linear,
    /// lr * sqrt(warmup / step) after the warmup: the Annotated
    /// Transformer's rate d^-0.5 * min(step^-0.5, step * warmup^-1.5) times
    /// a factor is this schedule with lr = factor / sqrt(d * warmup), and
    /// fairseq's `inverse_sqrt` is it as written.
    InverseSqrt,
}

/// The learning rate over the steps (counted from 1): a linear warmup from
/// lr/warmup to lr at step `warmup`, then constant, or a cosine or linear
/// decay from lr at step warmup + 1 to `min_lr` at step `steps` (nanoGPT's
/// and llm.c's schedule), `min_lr` after it. The rate is an
/// input of the step graph, so a schedule changes no kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    pub decay: Decay,
    pub warmup: u64,
    /// The step the decay ends at; `None`: the run's last step.
    pub steps: Option<u64>,
    pub min_lr: f64,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            decay: Decay::Constant,
            warmup: 0,
            steps: None,
            min_lr: 0.0,
        }
    }
}

impl Schedule {
    /// The rate of step `step` (counted from 1) for the peak rate `lr`,
    /// where the decay ends at `horizon` unless the schedule names a step.
    pub fn rate(&self, lr: f64, step: u64, horizon: u64) -> f64 {
        if step <= self.warmup {
            return lr * step as f64 / self.warmup as f64;
        }
        let end = self.steps.unwrap_or(horizon);
        match self.decay {
            Decay::Constant => return lr,
            Decay::InverseSqrt => return lr * (self.warmup.max(1) as f64 / step as f64).sqrt(),
            _ => {}
        }
        if step >= end {
            return self.min_lr;
        }
        // The first step after the warmup is at the peak, `end` at min_lr.
        let ratio = (step - self.warmup - 1) as f64 / (end - self.warmup - 1) as f64;
        let coeff = match self.decay {
            Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos()),
            _ => 1.0 - ratio,
        };
        self.min_lr + coeff * (lr - self.min_lr)
    }

    /// `cosine(warmup=100, steps=5000, min_lr=6e-05)`, as the model file writes it.
    pub fn describe(&self) -> String {
        let name = match self.decay {
            Decay::Constant => "constant",
            Decay::Cosine => "cosine",
            Decay::Linear => "linear",
            Decay::InverseSqrt => "inverse_sqrt",
        };
        let mut parts = vec![format!("warmup={}", self.warmup)];
        if matches!(self.decay, Decay::Cosine | Decay::Linear) {
            parts.push(match self.steps {
                Some(s) => format!("steps={s}"),
                None => "steps=the run's last".into(),
            });
            parts.push(format!("min_lr={}", num(self.min_lr)));
        }
        format!("{name}({})", parts.join(", "))
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    pub optimizer: Optimizer,
    /// The learning rate over the steps.
    pub schedule: Schedule,
    /// Clip gradients to this global L2 norm before the update.
    pub clip_grad_norm: Option<f64>,
    /// Compute dtype: f32, or bf16/f16 with f32 master weights and optimizer state.
    pub precision: DType,
    /// Micro-batches whose gradients are accumulated before one update.
    pub micro_batches: u32,
    /// Bytes the step may take on the device (`memory_budget`, in GiB in
    /// the file; `--memory-budget` replaces it): activations are recomputed
    /// to fit (`recompute`).
    pub memory_budget: Option<u64>,
    /// Data-parallel ranks the step is built for (`--gpus`, never the model
    /// file): above 1, gradients and the loss are averaged over the ranks.
    pub ranks: u32,
    /// ZeRO stage 1 (`--zero 1`): this rank keeps and updates only the
    /// parameters it owns (`autodiff::zero::owners`); `None` without.
    pub zero_rank: Option<u32>,
    /// What ZeRO splits beyond the optimizer state (`--zero 2`: the
    /// gradients), where `zero_rank` is set.
    pub zero_stage: crate::shard::ZeroStage,
    /// Ranks ZeRO splits each parameter's pieces over (`--shard-within`):
    /// `ranks` where every rank holds its own piece, else a group of
    /// consecutive ranks (a host's), the groups holding the same pieces;
    /// `zero_rank` is then the rank's place in its group. The gradients'
    /// means are still over all `ranks`.
    pub shard_group: u32,
    /// The type gradients are averaged over the ranks in (`--reduce-dtype`,
    /// never the model file): f32, or bf16 for a bf16 model, whose weight
    /// gradients come out of bf16 products, so that each collective moves
    /// half the bytes (FSDP's `reduce_dtype`, Megatron-LM's and DeepSpeed's
    /// bf16 gradient reduction), at the price of a bf16 rounding of each
    /// rank's gradient and of the sum.
    pub reduce_dtype: DType,
    /// Where the loss was written, for errors about it.
    pub loss_span: Span,
}

#[derive(Clone, Debug)]
pub struct Model {
    pub graph: Graph,
    pub train: TrainConfig,
    /// Top-level constants with their final values (after `--set`), in file order.
    pub consts: Vec<(String, String)>,
    /// Block calls, `repeat`s and `let` names, for writing the model back out.
    pub structure: structure::Structure,
}

impl Model {
    pub fn inputs(&self) -> Vec<(String, crate::ir::TensorType)> {
        self.graph
            .topo_order()
            .into_iter()
            .filter_map(|n| match &self.graph.g[n].op {
                crate::ops::Op::Input(i) => Some((i.name.clone(), i.ty.clone())),
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-15 * b.abs().max(1e-300)
    }

    #[test]
    fn warmup_then_cosine_linear_or_constant() {
        let lr = 6e-4;
        let cos = Schedule {
            decay: Decay::Cosine,
            warmup: 10,
            steps: Some(111),
            min_lr: 6e-5,
        };
        // Warmup: lr * step / warmup, reaching lr at the last warmup step.
        assert!(close(cos.rate(lr, 1, 0), 6e-5));
        assert!(close(cos.rate(lr, 10, 0), lr));
        // The decay starts at the peak after the warmup; halfway through,
        // the cosine is at the midpoint.
        assert!(close(cos.rate(lr, 11, 0), lr));
        assert!(close(cos.rate(lr, 61, 0), (lr + 6e-5) / 2.0));
        assert!(close(
            cos.rate(lr, 36, 0),
            6e-5 + 0.5 * (1.0 + (std::f64::consts::PI * 0.25).cos()) * (lr - 6e-5)
        ));
        // The end and after it: min_lr.
        assert!(close(cos.rate(lr, 111, 0), 6e-5));
        assert!(close(cos.rate(lr, 500, 0), 6e-5));
        let lin = Schedule {
            decay: Decay::Linear,
            steps: None,
            ..cos
        };
        // Without `steps` the decay ends at the horizon given.
        assert!(close(lin.rate(lr, 36, 61), lr - 0.5 * (lr - 6e-5)));
        assert!(close(lin.rate(lr, 61, 61), 6e-5));
        let constant = Schedule {
            decay: Decay::Constant,
            ..cos
        };
        assert!(close(constant.rate(lr, 5, 0), lr / 2.0));
        assert!(close(constant.rate(lr, 1000, 0), lr));
        assert_eq!(Schedule::default().rate(lr, 1, 1), lr);
    }

    /// The Annotated Transformer's rate, d^-0.5 * min(step^-0.5, step *
    /// warmup^-1.5) (factor 1, d = 512, warmup 4000), written out
    /// independently, is inverse_sqrt with lr = 1 / sqrt(d * warmup) at
    /// every step.
    #[test]
    fn inverse_sqrt_is_the_annotated_transformers_rate() {
        let (d, warmup) = (512.0f64, 4000u64);
        let s = Schedule {
            decay: Decay::InverseSqrt,
            warmup,
            ..Schedule::default()
        };
        let lr = 1.0 / (d * warmup as f64).sqrt();
        for step in [1u64, 2, 100, 3999, 4000, 4001, 10_000, 1_000_000] {
            let st = step as f64;
            let want = d.powf(-0.5) * st.powf(-0.5).min(st * (warmup as f64).powf(-1.5));
            let got = s.rate(lr, step, 0);
            assert!(
                (got - want).abs() <= 1e-12 * want,
                "step {step}: {got} vs {want}"
            );
        }
        assert_eq!(s.describe(), "inverse_sqrt(warmup=4000)");
    }
}
