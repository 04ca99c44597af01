//! Dropout is for training steps alone: a forward-only step (the
//! validation loss) reads every dropout's input as it is.

use super::replace_uses;
use crate::ir::{Graph, Value};
use crate::ops::Op;
use petgraph::visit::EdgeRef;

/// Removes every `dropout` (its readers read its input instead), the
/// dropout of every attention (and its key input, the last), and the
/// step's key with them; returns how many were removed.
pub fn remove_dropout(g: &mut Graph) -> usize {
    let drops: Vec<_> =
        g.g.node_indices()
            .filter(|&n| matches!(g.g[n].op, Op::Dropout(_)))
            .collect();
    for &n in &drops {
        let x = g.inputs(n)[0];
        replace_uses(g, Value { node: n, port: 0 }, x);
        g.g.remove_node(n);
    }
    let attention: Vec<_> =
        g.g.node_indices()
            .filter(|&n| match &g.g[n].op {
                Op::Attention(a) => a.dropout.is_some(),
                Op::AttentionGrad(a) => a.dropout.is_some(),
                _ => false,
            })
            .collect();
    for &n in &attention {
        let last = g.inputs(n).len() - 1;
        let edge =
            g.g.edges_directed(n, petgraph::Direction::Incoming)
                .find(|e| e.weight().dst_slot == last)
                .map(|e| e.id());
        if let Some(e) = edge {
            g.g.remove_edge(e);
        }
        match &mut g.g[n].op {
            Op::Attention(a) => a.dropout = None,
            Op::AttentionGrad(a) => a.dropout = None,
            _ => {}
        }
    }
    let keys: Vec<_> =
        g.g.node_indices()
            .filter(|&n| {
                matches!(&g.g[n].op, Op::Input(i) if i.name == crate::ops::DROPOUT_KEY_INPUT)
                    && g.users(Value { node: n, port: 0 }).is_empty()
            })
            .collect();
    for n in keys {
        g.g.remove_node(n);
    }
    drops.len() + attention.len()
}
