//! Attention written out by hand becomes one attention op:
//!
//! ```text
//! softmax(causal_mask?(q @ transpose(k) * c)) @ v     q, k, v: [B, H, T, D]
//! ```
//!
//! is rewritten to `attention(q', k', v', causal, scale = c)` on the
//! feature-innermost views `[B, T, H, D]` (permutes, which loads read in
//! place), so it gets the same kernels, forward and backward, as the
//! builtin, and the T x T scores are never stored. It runs on the forward
//! graph, before autodiff; the spelled-out chain must be read only by the
//! next op of the chain, or it stays as written.

use super::{replace_uses, Pass};
use crate::ir::graph::Node;
use crate::ir::{Graph, Value};
use crate::ops::{Attention, BinaryKind, Op, Permute};
use petgraph::stable_graph::NodeIndex;

pub struct FoldAttention;

fn only_reader(g: &Graph, v: Value, n: NodeIndex) -> bool {
    let users = g.users(v);
    !users.is_empty()
        && users.iter().all(|(u, _)| *u == n)
        && !g.outputs.iter().any(|(_, o)| *o == v)
}

fn producer(g: &Graph, v: Value) -> &Node {
    &g.g[v.node]
}

/// (q, k, v, causal, scale) of a spelled-out attention ending at `n`.
fn matches(g: &Graph, n: NodeIndex) -> Option<(Value, Value, Value, bool, f64)> {
    let Op::MatMul(_) = g.g[n].op else {
        return None;
    };
    let ins = g.inputs(n);
    let (p, v) = (ins[0], ins[1]);
    let rank = g.ty(p).rank();
    if rank != 4 || g.ty(v).rank() != 4 {
        return None;
    }
    let Op::Softmax(sm) = &producer(g, p).op else {
        return None;
    };
    if sm.axis != rank - 1 || !only_reader(g, p, n) {
        return None;
    }
    let mut s = g.inputs(p.node)[0];
    let mut reader = p.node;
    let mut causal = false;
    if let Op::CausalMask(m) = &producer(g, s).op {
        if m.fill != f64::NEG_INFINITY || !only_reader(g, s, reader) {
            return None;
        }
        causal = true;
        reader = s.node;
        s = g.inputs(s.node)[0];
    }
    let mut scale = 1.0;
    if let Op::Binary(b) = &producer(g, s).op {
        let bi = g.inputs(s.node);
        let constant = match &producer(g, bi[1]).op {
            Op::Constant(c) => Some(c.value),
            _ => None,
        };
        let c = constant?;
        scale = match b.kind {
            BinaryKind::Mul => c,
            BinaryKind::Div if c != 0.0 => 1.0 / c,
            _ => return None,
        };
        if !only_reader(g, s, reader) {
            return None;
        }
        reader = s.node;
        s = bi[0];
    }
    let Op::MatMul(_) = producer(g, s).op else {
        return None;
    };
    if !only_reader(g, s, reader) {
        return None;
    }
    let mi = g.inputs(s.node);
    let (q, kt) = (mi[0], mi[1]);
    let Op::Permute(pm) = &producer(g, kt).op else {
        return None;
    };
    if pm.perm != [0, 1, 3, 2] {
        return None;
    }
    let k = g.inputs(kt.node)[0];
    // Heads must match exactly (no broadcasting between q, k and v).
    let (tq, tk, tv) = (g.ty(q), g.ty(k), g.ty(v));
    if tq.rank() != 4
        || tq.shape[..2] != tk.shape[..2]
        || tk.shape[..3] != tv.shape[..3]
        || tq.shape[3] != tk.shape[3]
    {
        return None;
    }
    Some((q, k, v, causal, scale))
}

impl Pass for FoldAttention {
    fn name(&self) -> &'static str {
        "fold-attention"
    }
    fn about(&self) -> &'static str {
        "attention written as softmax(q @ k^T * c) @ v becomes one attention op (forward graph)"
    }
    fn run(&self, g: &mut Graph) -> usize {
        let mut folded = 0;
        for n in g.topo_order() {
            if !g.g.contains_node(n) {
                continue;
            }
            let Some((q, k, v, causal, scale)) = matches(g, n) else {
                continue;
            };
            let (span, phase) = (g.g[n].span, g.g[n].phase);
            let to_heads_inner = || Permute {
                perm: vec![0, 2, 1, 3],
            };
            let add = |g: &mut Graph, op: Op, ins: &[Value]| {
                g.add(op, ins, span, phase).ok().map(|v| v[0])
            };
            let Some(q2) = add(g, to_heads_inner().into(), &[q]) else {
                continue;
            };
            let Some(k2) = add(g, to_heads_inner().into(), &[k]) else {
                continue;
            };
            let Some(v2) = add(g, to_heads_inner().into(), &[v]) else {
                continue;
            };
            let Some(o) = add(
                g,
                Attention {
                    causal,
                    scale,
                    lengths: false,
                    dropout: None,
                }
                .into(),
                &[q2, k2, v2],
            ) else {
                continue;
            };
            let Some(back) = add(g, to_heads_inner().into(), &[o]) else {
                continue;
            };
            replace_uses(g, Value { node: n, port: 0 }, back);
            folded += 1;
        }
        if folded > 0 {
            super::Dce.run(g);
        }
        folded
    }
}
