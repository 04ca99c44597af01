//! One whole training step on the CPU: evaluate the training graph, then
//! write the updated parameters and optimizer state back into the feeds.
//! This is the reference a GPU step is compared with.

use super::tensor::Tensor;
use super::{run, Feeds, InterpError, Precision};
use crate::autodiff::{APPLY_INPUT, LOSS_SCALE_INPUT, LR_INPUT, STEP_INPUT};
use crate::ir::graph::{Graph, Role};

#[derive(Clone, Debug)]
pub struct StepResult {
    pub loss: f64,
    pub grad_norm: Option<f64>,
    /// Each parameter's gradient output (by parameter index), as the
    /// update reads it (fp16: still times the loss scale).
    pub grads: Vec<(usize, Tensor)>,
    /// The logits a decode step outputs.
    pub logits: Option<Tensor>,
    /// The per-token losses a scoring step outputs.
    pub token_losses: Option<Tensor>,
    /// The greedy picks a greedy decode step outputs.
    pub next_tokens: Option<Tensor>,
}

/// Runs step number `step` (counting from 1) with learning rate `lr`.
pub fn train_step(
    g: &Graph,
    feeds: &mut Feeds,
    lr: f64,
    step: u64,
    precision: Precision,
) -> Result<StepResult, InterpError> {
    feeds.inputs.insert(LR_INPUT.into(), Tensor::scalar(lr));
    feeds
        .inputs
        .insert(STEP_INPUT.into(), Tensor::scalar(step as f64));
    feeds
        .inputs
        .entry(LOSS_SCALE_INPUT.into())
        .or_insert_with(|| Tensor::scalar(1.0));
    // One call is one micro-batch; unless told otherwise, the last.
    feeds
        .inputs
        .entry(APPLY_INPUT.into())
        .or_insert_with(|| Tensor::scalar(1.0));
    let vals = run(g, feeds, precision)?;
    let mut result = StepResult {
        loss: f64::NAN,
        grad_norm: None,
        grads: Vec::new(),
        logits: None,
        token_losses: None,
        next_tokens: None,
    };
    for (role, v) in &g.outputs {
        let t = &vals[v];
        match role {
            Role::Loss => result.loss = t.data[0],
            Role::GradNorm => result.grad_norm = Some(t.data[0]),
            Role::NewParam(i) => {
                let name = &g.params[*i].name;
                feeds.params.insert(name.clone(), t.clone());
            }
            Role::NewState(name) => {
                feeds.state.insert(name.clone(), t.clone());
            }
            Role::Grad(i) => result.grads.push((*i, t.clone())),
            Role::Logits => result.logits = Some(t.clone()),
            Role::TokenLosses => result.token_losses = Some(t.clone()),
            Role::NextTokens => result.next_tokens = Some(t.clone()),
        }
    }
    Ok(result)
}
