//! Reverse-mode automatic differentiation and the optimizer update: the
//! forward graph becomes the training graph of one step.
//!
//! Gradients are accumulated per value, so a parameter used twice (an
//! embedding tied to the output projection) receives one summed gradient.
//! The loss gradient is seeded with `1 / micro_batches`, so that summing the
//! gradients of the micro-batches gives the gradient of their mean loss.

mod update;

use crate::diag::{Diagnostic, Errors};
use crate::ir::graph::{Graph, Phase, Role, Value};
use crate::model::Model;
use crate::ops::{Builder, Constant, OpError};
use std::collections::HashMap;

pub use update::{add_update, LR_INPUT, STEP_INPUT};

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
    let mut grads: HashMap<Value, Value> = HashMap::new();
    {
        let mut b = Builder::new(&mut g, Some(model.train.loss_span), Phase::Backward);
        let dtype = b.ty(loss).dtype;
        let seed = b
            .op1(
                Constant {
                    value: 1.0 / model.train.micro_batches as f64,
                    dtype,
                },
                &[],
            )
            .map_err(internal)?;
        grads.insert(loss, seed);
    }
    for &n in order.iter().rev() {
        let node = g.g[n].clone();
        let outputs: Vec<Value> = (0..node.outputs.len())
            .map(|port| Value { node: n, port })
            .collect();
        let douts: Vec<Option<Value>> = outputs.iter().map(|v| grads.get(v).copied()).collect();
        if douts.iter().all(Option::is_none) || node.op.is_source() {
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
            // A gradient has its value's dtype (f32 for master weights).
            let dx = b.cast(dx, b.ty(*x).dtype).map_err(internal)?;
            let total = match grads.get(x) {
                Some(&prev) => b.add(prev, dx).map_err(internal)?,
                None => dx,
            };
            grads.insert(*x, total);
        }
    }

    let mut missing = Vec::new();
    for (i, p) in g.params.iter().enumerate() {
        match grads.get(&Value {
            node: p.node,
            port: 0,
        }) {
            Some(&gv) => g.outputs.push((Role::Grad(i), gv)),
            None => missing.push(
                Diagnostic::new(
                    format!("parameter `{}` gets no gradient", p.name),
                    p.span,
                    "declared here, but the loss does not depend on it",
                )
                .with_help("use it in the computation of the loss, or remove it"),
            ),
        }
    }
    if !missing.is_empty() {
        return Err(Errors(missing));
    }
    Ok(g)
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
