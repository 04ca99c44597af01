//! A checked model: the forward graph plus what the `train` section asks for.

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

#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    pub optimizer: Optimizer,
    /// Clip gradients to this global L2 norm before the update.
    pub clip_grad_norm: Option<f64>,
    /// Compute dtype: f32, or bf16/f16 with f32 master weights and optimizer state.
    pub precision: DType,
    /// Micro-batches whose gradients are accumulated before one update.
    pub micro_batches: u32,
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
    pub structure: crate::elaborate::structure::Structure,
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
