//! q, k and v projected from one input by three products, as BERT and
//! Hugging Face's attention write them:
//!
//! ```text
//! q = heads(x @ wq + bq, H)   k = heads(x @ wk + bk, Hkv)   v = heads(x @ wv + bv, Hkv)
//! attention(q, k, v, ...)
//! ```
//!
//! become one product against the weights side by side, whose output's
//! slices the heads read in place, as a model written with one fused QKV
//! projection (GPT-2's `c_attn`) has it:
//!
//! ```text
//! qkv = x @ concat([wq, wk, wv], axis = 1) + concat([bq, bk, bv])
//! ```
//!
//! A product of N = 3d runs at the wide products' rate where three of N = d
//! did not (BERT-large on an H100: 601 against 745 TFLOP/s), and the
//! backward pass autodiff builds from it is one product for the input's
//! gradient (K = 3d, in place of three chained through residual
//! epilogues), one for the weights' and one sum for the biases', over the
//! packed gradient the attention backward writes
//! (`passes::PackAttentionGrads`). The parameters stay as the model names
//! them: checkpoints, name maps and the optimizer see wq, wk and wv. It
//! runs on the forward graph, before autodiff; a chain read by anything
//! else, or whose weights depend on x, stays as written.

use super::{reaches, replace_uses, Pass};
use crate::ir::{Graph, Value};
use crate::ops::{BinaryKind, Concat, MatMul, Op, Slice};
use petgraph::stable_graph::NodeIndex;

pub struct FuseProjections;

/// One of the three projections: `x @ weight (+ bias)`, read by `reshape`.
struct Projection {
    x: Value,
    matmul: NodeIndex,
    weight: Value,
    /// The add and the bias vector.
    bias: Option<(NodeIndex, Value)>,
    /// The value the head split reads: the add's output, or the product's.
    out: Value,
}

fn only_reader(g: &Graph, v: Value, n: NodeIndex) -> bool {
    matches!(g.users(v)[..], [(u, _)] if u == n) && !g.outputs.iter().any(|(_, o)| *o == v)
}

/// The projection behind attention input `slot` of `attn`, if the chain is
/// read by nothing else.
fn projection(g: &Graph, attn: NodeIndex, slot: usize) -> Option<Projection> {
    let heads = g.inputs(attn)[slot];
    if !matches!(g.g[heads.node].op, Op::Reshape(_)) || !only_reader(g, heads, attn) {
        return None;
    }
    let out = g.inputs(heads.node)[0];
    if !only_reader(g, out, heads.node) || g.ty(out).rank() < 2 {
        return None;
    }
    let (product, bias) = match &g.g[out.node].op {
        Op::MatMul(_) => (out, None),
        Op::Binary(b) if b.kind == BinaryKind::Add => {
            let ins = g.inputs(out.node);
            let n = g.ty(out).shape.last()?.clone();
            let is_product = |v: Value| matches!(g.g[v.node].op, Op::MatMul(_));
            let is_bias = |v: Value| {
                g.ty(v).rank() == 1 && g.ty(v).shape[0] == n && g.ty(v).dtype == g.ty(out).dtype
            };
            let (p, b) = if is_product(ins[0]) && is_bias(ins[1]) {
                (ins[0], ins[1])
            } else if is_product(ins[1]) && is_bias(ins[0]) {
                (ins[1], ins[0])
            } else {
                return None;
            };
            if !only_reader(g, p, out.node) {
                return None;
            }
            (p, Some((out.node, b)))
        }
        _ => return None,
    };
    let ins = g.inputs(product.node);
    if g.ty(ins[1]).rank() != 2 {
        return None;
    }
    Some(Projection {
        x: ins[0],
        matmul: product.node,
        weight: ins[1],
        bias,
        out,
    })
}

/// `concat(parts, axis)`. The parts are the weights as the products read
/// them (the master weights' copies in the compute type, which the cast
/// group kernel makes): one copy of those, a few MiB, where the products
/// they replace read as much.
fn joined(g: &mut Graph, parts: &[Value], axis: usize, at: NodeIndex) -> Option<Value> {
    let (span, phase) = (g.g[at].span, g.g[at].phase);
    let v = g.add(Concat { axis }.into(), parts, span, phase).ok()?;
    g.take_turn(&v, at);
    Some(v[0])
}

/// Rewrites the projections of `attn`, adding the nodes it leaves unread
/// to `dead`; false where they do not fit.
fn fuse(g: &mut Graph, attn: NodeIndex, dead: &mut Vec<NodeIndex>) -> bool {
    let Some(ps) = (0..3)
        .map(|s| projection(g, attn, s))
        .collect::<Option<Vec<_>>>()
    else {
        return false;
    };
    let x = ps[0].x;
    let same_input = ps.iter().all(|p| p.x == x);
    let dtype = g.ty(ps[0].weight).dtype;
    let same_type = ps.iter().all(|p| g.ty(p.weight).dtype == dtype);
    let biases = ps.iter().filter(|p| p.bias.is_some()).count();
    let independent = ps.iter().all(|p| {
        !reaches(g, p.weight.node, x.node)
            && p.bias.is_none_or(|(_, b)| !reaches(g, b.node, x.node))
    });
    if !same_input || !same_type || (biases != 0 && biases != 3) || !independent {
        return false;
    }
    let at = ps[0].matmul;
    let (span, phase) = (g.g[at].span, g.g[at].phase);
    let weights: Vec<Value> = ps.iter().map(|p| p.weight).collect();
    let Some(w) = joined(g, &weights, 1, at) else {
        return false;
    };
    // The biases joined before the product, so that they are stored when
    // fusion looks for the product's bias epilogue.
    let bias = match biases {
        3 => {
            let bs: Vec<Value> = ps.iter().map(|p| p.bias.expect("three biases").1).collect();
            let Some(b) = joined(g, &bs, 0, at) else {
                return false;
            };
            Some(b)
        }
        _ => None,
    };
    let Ok(y) = g.add(MatMul.into(), &[x, w], span, phase) else {
        return false;
    };
    g.take_turn(&y, at);
    let mut y = y[0];
    if let Some(b) = bias {
        let Ok(sum) = g.add(
            crate::ops::Binary {
                kind: BinaryKind::Add,
            }
            .into(),
            &[y, b],
            span,
            phase,
        ) else {
            return false;
        };
        g.take_turn(&sum, at);
        y = sum[0];
    }
    let axis = g.ty(y).rank() - 1;
    let mut start = crate::ir::Dim::constant(0);
    for p in &ps {
        let width = g.ty(p.weight).shape[1].clone();
        let Some(end) = start.checked_add(&width) else {
            return false;
        };
        let slice = Slice {
            axis,
            start: start.clone(),
            end: end.clone(),
        };
        let Ok(part) = g.add(slice.into(), &[y], span, phase) else {
            return false;
        };
        g.take_turn(&part, at);
        replace_uses(g, p.out, part[0]);
        start = end;
    }
    // The fused ops keep q's place; the report and explain name k's and
    // v's lines too.
    if let Some(keep) = span {
        let others: Vec<_> = ps[1..].iter().filter_map(|p| g.g[p.matmul].span).collect();
        g.merged.push((keep, others));
    }
    // The three chains are read by nothing now: removed once every
    // attention is done (a removed node's index is given to the next node
    // added, and the order among nodes of one turn is by index).
    for p in &ps {
        if let Some((add, _)) = p.bias {
            dead.push(add);
        }
        dead.push(p.matmul);
    }
    true
}

impl Pass for FuseProjections {
    fn name(&self) -> &'static str {
        "fuse-projections"
    }
    fn about(&self) -> &'static str {
        "attention's q, k and v projected from one input by three products become one product against the weights side by side (forward graph)"
    }
    fn run(&self, g: &mut Graph) -> usize {
        let attns: Vec<NodeIndex> = g
            .topo_order()
            .into_iter()
            .filter(|&n| matches!(g.g[n].op, Op::Attention(_)))
            .collect();
        let mut dead = Vec::new();
        let fused = attns.into_iter().filter(|&a| fuse(g, a, &mut dead)).count();
        for n in dead {
            g.g.remove_node(n);
        }
        fused
    }
}
