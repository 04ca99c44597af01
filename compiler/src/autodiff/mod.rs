//! Reverse-mode automatic differentiation and the optimizer update: the
//! forward graph becomes the training graph of one step.
//!
//! Gradients are accumulated per value, so a parameter used twice (an
//! embedding tied to the output projection) receives one summed gradient.
//! Each parameter's gradient is scaled by `1 / micro_batches`, so that the
//! runtime, summing the gradients of the micro-batches before it runs the
//! update phase, gets the gradient of their mean loss.

mod gather;
mod update;

use crate::diag::{Diagnostic, Errors};
use crate::ir::graph::{Graph, Phase, Role, Value};
use crate::model::Model;
use crate::ops::{Builder, OpError};
use crate::passes::Pass;
use petgraph::stable_graph::NodeIndex;
use petgraph::Direction;
use std::collections::{HashMap, HashSet};

pub mod zero;
pub use update::{add_update, APPLY_INPUT, LOSS_SCALE_INPUT, LR_INPUT, STEP_INPUT};

pub use crate::inputs::is_step_input;

/// Forward and backward: the loss and every parameter's gradient (f32).
pub fn add_backward(model: &Model) -> Result<Graph, Errors> {
    let mut g = model.graph.clone();
    let loss = g.output(&Role::Loss).expect("elaboration records the loss");
    let internal = |e: OpError| {
        Errors::from(Diagnostic::new(
            format!("internal error in autodiff: {e}"),
            model.train.loss_span,
            "while differentiating this loss",
        ))
    };

    let order = g.topo_order();
    // Only values that depend on a parameter need a gradient: data inputs
    // and whatever is computed from them alone get none.
    let mut needs: HashSet<NodeIndex> = g.params.iter().map(|p| p.node).collect();
    for &n in &order {
        if g.g
            .neighbors_directed(n, Direction::Incoming)
            .any(|m| needs.contains(&m))
        {
            needs.insert(n);
        }
    }
    let mut grads: HashMap<Value, Value> = HashMap::new();
    {
        let mut b = Builder::new(&mut g, Some(model.train.loss_span), Phase::Backward);
        let dtype = b.ty(loss).dtype;
        // fp16 gradients underflow: the backward pass starts from the loss
        // scale (an input the runtime adjusts) instead of 1, and the update
        // divides it out.
        let seed = if model.train.precision == crate::ir::DType::F16 {
            let s = b
                .op1(
                    crate::ops::Input {
                        name: LOSS_SCALE_INPUT.into(),
                        ty: crate::ir::TensorType::scalar(crate::ir::DType::F32),
                    },
                    &[],
                )
                .map_err(internal)?;
            b.cast(s, dtype).map_err(internal)?
        } else {
            b.constant(1.0, dtype).map_err(internal)?
        };
        grads.insert(loss, seed);
    }
    for &n in order.iter().rev() {
        let node = g.g[n].clone();
        let outputs: Vec<Value> = (0..node.outputs.len())
            .map(|port| Value { node: n, port })
            .collect();
        let douts: Vec<Option<Value>> = outputs.iter().map(|v| grads.get(v).copied()).collect();
        if douts.iter().all(Option::is_none) || node.op.is_source() || !needs.contains(&n) {
            continue;
        }
        let inputs = g.inputs(n);
        let mut b = Builder::new(&mut g, node.span, Phase::Backward);
        let dins = node
            .op
            .vjp(&mut b, &inputs, &outputs, &douts)
            .map_err(internal)?;
        for (x, dx) in inputs.iter().zip(dins) {
            let Some(dx) = dx else { continue };
            if !needs.contains(&x.node) {
                continue;
            }
            let dx = match crate::mutants::current() {
                Some(crate::mutants::Mutant::Backward(op)) if op == node.op.name() => {
                    b.scale(dx, 1.01).map_err(internal)?
                }
                _ => dx,
            };
            // A gradient has its value's dtype (f32 for master weights).
            let dx = b.cast(dx, b.ty(*x).dtype).map_err(internal)?;
            let total = match grads.get(x) {
                Some(&prev) => b.add(prev, dx).map_err(internal)?,
                None => dx,
            };
            grads.insert(*x, total);
        }
    }

    // Summing the gradients of k micro-batches must give the gradient of
    // their mean loss; the 1/k is applied here, in f32, not to the seed.
    let k = model.train.micro_batches;
    let mut missing = Vec::new();
    for i in 0..g.params.len() {
        let p = g.params[i].clone();
        match grads.get(&Value {
            node: p.node,
            port: 0,
        }) {
            Some(&gv) => {
                let mut b = Builder::new(&mut g, Some(p.span), Phase::Backward);
                let gv = if k > 1 {
                    b.scale(gv, 1.0 / k as f64).map_err(internal)?
                } else {
                    gv
                };
                g.outputs.push((Role::Grad(i), gv));
            }
            None => {
                // Follow the compute copy (a cast) to the first real use.
                let mut v = Value {
                    node: p.node,
                    port: 0,
                };
                let mut users = g.users(v);
                if let [(only, _)] = users[..] {
                    if matches!(g.g[only].op, crate::ops::Op::Cast(_)) {
                        v = Value {
                            node: only,
                            port: 0,
                        };
                        users = g.users(v);
                    }
                }
                let first_use = users
                    .iter()
                    .filter_map(|(u, _)| g.g[*u].span)
                    .min_by_key(|s| s.start);
                let d = Diagnostic::new(
                    format!("parameter `{}` gets no gradient", p.name),
                    p.span,
                    "",
                );
                missing.push(match first_use {
                    None => Diagnostic {
                        label: "declared here, but never used".into(),
                        ..d
                    }
                    .with_help("use it in the computation of the loss, or remove it"),
                    Some(at) => Diagnostic {
                        label: "declared here".into(),
                        ..d
                    }
                    .with_note(
                        at,
                        "used here, but nothing computed from this reaches the loss",
                    )
                    .with_help(
                        "the loss must depend on every parameter; remove it or use its result",
                    ),
                });
            }
        }
    }
    if !missing.is_empty() {
        return Err(Errors(missing));
    }
    if crate::mutants::is(&crate::mutants::Mutant::SwapGradients) {
        swap_two_gradients(&mut g);
    }
    // Gradient rules build every input's gradient; drop the unread ones.
    crate::passes::Dce.run(&mut g);
    Ok(g)
}

/// The mutant `SwapGradients`: the gradients of the first two parameters
/// of one type trade places.
fn swap_two_gradients(g: &mut Graph) {
    let grad_of = |g: &Graph, i: usize| g.outputs.iter().position(|(r, _)| *r == Role::Grad(i));
    for i in 0..g.params.len() {
        for j in i + 1..g.params.len() {
            if g.params[i].ty == g.params[j].ty {
                if let (Some(a), Some(b)) = (grad_of(g, i), grad_of(g, j)) {
                    let va = g.outputs[a].1;
                    g.outputs[a].1 = g.outputs[b].1;
                    g.outputs[b].1 = va;
                    return;
                }
            }
        }
    }
}

/// The whole training step: forward, backward, clipping and the optimizer update.
pub fn training_graph(model: &Model) -> Result<Graph, Errors> {
    let mut g = add_backward(model)?;
    add_update(&mut g, &model.train).map_err(|e| {
        Errors::from(Diagnostic::new(
            format!("internal error building the update: {e}"),
            model.train.loss_span,
            "",
        ))
    })?;
    Ok(g)
}
