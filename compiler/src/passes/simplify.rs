//! Algebraic simplification: rewrites that make the graph smaller without
//! changing what it computes. Each rule reads a node and, when it applies,
//! points the node's readers at a simpler value; the node itself is left for
//! dead-code elimination.

use super::{replace_uses, Pass};
use crate::ir::graph::Node;
use crate::ir::{Graph, Value};
use crate::ops::{BinaryKind, Op, Permute, Reshape, UnaryKind};

pub struct Simplify;

/// Most rounds of rewriting; each round can only shrink the graph, so this
/// bound is never reached in practice.
const MAX_ROUNDS: usize = 16;

fn constant(g: &Graph, v: Value) -> Option<f64> {
    match &g.g[v.node].op {
        Op::Constant(c) => Some(c.value),
        _ => None,
    }
}

/// What a node can be replaced by: an existing value, or a new op on one.
enum Rewrite {
    Value(Value),
    Op(Op, Value),
}

fn rule(g: &Graph, node: &Node, ins: &[Value]) -> Option<Rewrite> {
    let out = &node.outputs[0];
    let same = |v: Value| g.ty(v) == out;
    match &node.op {
        Op::Cast(_) | Op::Reshape(_) | Op::Broadcast(_) if same(ins[0]) => {
            Some(Rewrite::Value(ins[0]))
        }
        Op::Reshape(r) => match &g.g[ins[0].node].op {
            Op::Reshape(_) => {
                let inner = g.inputs(ins[0].node)[0];
                Some(Rewrite::Op(
                    Reshape {
                        shape: r.shape.clone(),
                    }
                    .into(),
                    inner,
                ))
            }
            _ => None,
        },
        Op::Permute(p) => {
            if p.perm.iter().enumerate().all(|(i, &a)| i == a) {
                return Some(Rewrite::Value(ins[0]));
            }
            match &g.g[ins[0].node].op {
                Op::Permute(q) => {
                    let inner = g.inputs(ins[0].node)[0];
                    let perm: Vec<usize> = p.perm.iter().map(|&i| q.perm[i]).collect();
                    if perm.iter().enumerate().all(|(i, &a)| i == a) {
                        Some(Rewrite::Value(inner))
                    } else {
                        Some(Rewrite::Op(Permute { perm }.into(), inner))
                    }
                }
                _ => None,
            }
        }
        Op::Unary(u) if u.kind == UnaryKind::Neg => match &g.g[ins[0].node].op {
            Op::Unary(v) if v.kind == UnaryKind::Neg => {
                Some(Rewrite::Value(g.inputs(ins[0].node)[0]))
            }
            _ => None,
        },
        Op::Binary(b) => {
            let (x, y) = (ins[0], ins[1]);
            let (cx, cy) = (constant(g, x), constant(g, y));
            let keep = |v: Value| same(v).then_some(Rewrite::Value(v));
            match b.kind {
                BinaryKind::Mul if cy == Some(1.0) => keep(x),
                BinaryKind::Mul if cx == Some(1.0) => keep(y),
                BinaryKind::Add if cy == Some(0.0) => keep(x),
                BinaryKind::Add if cx == Some(0.0) => keep(y),
                BinaryKind::Sub if cy == Some(0.0) => keep(x),
                BinaryKind::Div if cy == Some(1.0) => keep(x),
                _ => None,
            }
        }
        _ => None,
    }
}

impl Pass for Simplify {
    fn name(&self) -> &'static str {
        "simplify"
    }
    fn about(&self) -> &'static str {
        "algebraic simplification: x*1, x+0, reshape of reshape, permute of permute, no-op casts"
    }
    fn run(&self, g: &mut Graph) -> usize {
        let mut total = 0;
        for _ in 0..MAX_ROUNDS {
            let mut changed = 0;
            for n in g.topo_order() {
                if !g.g.contains_node(n)
                    || g.g[n].outputs.len() != 1
                    || g.users(Value { node: n, port: 0 }).is_empty()
                        && !g.outputs.iter().any(|(_, v)| v.node == n)
                {
                    continue;
                }
                let ins = g.inputs(n);
                let node = g.g[n].clone();
                let Some(rw) = rule(g, &node, &ins) else {
                    continue;
                };
                let to = match rw {
                    Rewrite::Value(v) => v,
                    Rewrite::Op(op, input) => match g.add(op, &[input], node.span, node.phase) {
                        Ok(v) => v[0],
                        Err(_) => continue,
                    },
                };
                replace_uses(g, Value { node: n, port: 0 }, to);
                changed += 1;
            }
            total += changed;
            if changed == 0 {
                break;
            }
        }
        total
    }
}
