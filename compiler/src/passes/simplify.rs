//! Algebraic simplification: rewrites that make the graph smaller without
//! changing what it computes. Each rule reads a node and, when it applies,
//! points the node's readers at a simpler value; the node itself is left for
//! dead-code elimination.

use super::{key_sums, replace_uses, Pass};
use crate::ir::graph::Node;
use crate::ir::Dim;
use crate::ir::{Graph, Value};
use crate::ops::{
    BinaryKind, Broadcast, Concat, Constant, MatMul, Op, Permute, ReduceKind, Reshape, UnaryKind,
};
use petgraph::stable_graph::NodeIndex;

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

/// What a node can be replaced by: an existing value, or a new op on
/// existing values.
enum Rewrite {
    Value(Value),
    Op(Op, Vec<Value>),
    /// Several new ops in order, each reading existing values or the
    /// results of earlier ones; the last is the replacement.
    Ops(Vec<(Op, Vec<Arg>)>),
}

enum Arg {
    Existing(Value),
    Earlier(usize),
}

/// A sum over the batch axes of a batched product, `sum_b a[b] @ b[b]`
/// (every weight gradient of a layer applied to [B, T, C] activations), is
/// one product with the batch folded into the contracted axis:
/// `[M, B*K] @ [B*K, N]`. One GEMM accumulating in f32 instead of B
/// products, a [B, M, N] temporary and a reduction kernel; the operands are
/// views of the stored tensors (no copies).
fn batched_product_sum(g: &Graph, node: &Node, ins: &[Value]) -> Option<Rewrite> {
    let Op::Reduce(r) = &node.op else { return None };
    if r.kind != ReduceKind::Sum || r.keepdim {
        return None;
    }
    let mm = ins[0];
    if !matches!(g.g[mm.node].op, Op::MatMul(_)) || g.users(mm).len() != 1 {
        return None;
    }
    let ab = g.inputs(mm.node);
    let (ta, tb) = (g.ty(ab[0]), g.ty(ab[1]));
    let rank = ta.rank();
    if rank < 3 || tb.rank() != rank || ta.shape[..rank - 2] != tb.shape[..rank - 2] {
        return None;
    }
    if r.axes != (0..rank - 2).collect::<Vec<_>>() {
        return None;
    }
    let batch = ta.shape[..rank - 2]
        .iter()
        .try_fold(Dim::constant(1), |acc, d| acc.checked_mul(d))?;
    let (m, k, n) = (
        ta.shape[rank - 2].clone(),
        ta.shape[rank - 1].clone(),
        tb.shape[rank - 1].clone(),
    );
    let bk = batch.checked_mul(&k)?;
    // a: [..batch, M, K] -> [M, ..batch, K] -> [M, B*K]
    let mut perm = vec![rank - 2];
    perm.extend(0..rank - 2);
    perm.push(rank - 1);
    Some(Rewrite::Ops(vec![
        (Permute { perm }.into(), vec![Arg::Existing(ab[0])]),
        (
            Reshape {
                shape: vec![m, bk.clone()],
            }
            .into(),
            vec![Arg::Earlier(0)],
        ),
        (
            Reshape { shape: vec![bk, n] }.into(),
            vec![Arg::Existing(ab[1])],
        ),
        (MatMul.into(), vec![Arg::Earlier(1), Arg::Earlier(2)]),
    ]))
}

/// The leaves of a tree of adds.
fn add_leaves(g: &Graph, v: Value, out: &mut Vec<Value>) {
    match &g.g[v.node].op {
        Op::Binary(b)
            if b.kind == BinaryKind::Add
                && g.ty(v) == g.ty(g.inputs(v.node)[0])
                && g.ty(v) == g.ty(g.inputs(v.node)[1]) =>
        {
            for x in g.inputs(v.node) {
                add_leaves(g, x, out);
            }
        }
        _ => out.push(v),
    }
}

/// A sum of slice gradients that tile their axis exactly (the gradient of
/// `split`) is the concatenation of the pieces: no zero-filled full-size
/// tensors, one kernel instead of one per piece plus the adds.
fn slice_grads_to_concat(g: &Graph, root: Value) -> Option<Rewrite> {
    let mut leaves = Vec::new();
    add_leaves(g, root, &mut leaves);
    if leaves.len() < 2 {
        return None;
    }
    let mut pieces = Vec::new();
    for l in &leaves {
        match &g.g[l.node].op {
            Op::SliceGrad(sg) => pieces.push((sg.clone(), g.inputs(l.node)[0])),
            _ => return None,
        }
    }
    let (axis, full) = (pieces[0].0.axis, pieces[0].0.full.clone());
    // Order by start; starts must be constants to sort.
    let mut keyed = Vec::new();
    for (sg, x) in pieces {
        if sg.axis != axis || sg.full != full {
            return None;
        }
        keyed.push((sg.start.as_const()?, sg.start, x));
    }
    keyed.sort_by_key(|k| k.0);
    let mut at = crate::ir::Dim::constant(0);
    for (_, start, x) in &keyed {
        if *start != at {
            return None;
        }
        at = at.checked_add(&g.ty(*x).shape[axis])?;
    }
    if at != full {
        return None;
    }
    Some(Rewrite::Op(
        Concat { axis }.into(),
        keyed.into_iter().map(|k| k.2).collect(),
    ))
}

/// `cast(slice(x))` to f32 where every reader of x is a slice that only
/// such casts read (the weight gradients of q, k and v out of one fused
/// projection's): `slice(cast(x))`, the same values, with one cast of x
/// (cse merges the pieces') that its producer stores (a GEMM writes the
/// f32 gradient as it did for each projection on its own, with no
/// rounding to 16 bits on the way).
fn widened_before_slicing(
    g: &Graph,
    c: &crate::ops::Cast,
    s: &crate::ops::Slice,
    sliced: Value,
) -> Option<Rewrite> {
    let x = g.inputs(sliced.node)[0];
    let widened = |n: NodeIndex| matches!(&g.g[n].op, Op::Cast(rc) if rc.to == c.to);
    // Readers already rewritten are that cast of x.
    let all_widened = g.users(x).iter().all(|&(u, _)| {
        widened(u)
            || matches!(g.g[u].op, Op::Slice(_))
                && g.users(Value { node: u, port: 0 })
                    .iter()
                    .all(|&(r, _)| widened(r))
    });
    (all_widened && g.ty(x).dtype != c.to).then(|| {
        Rewrite::Ops(vec![
            (c.clone().into(), vec![Arg::Existing(x)]),
            (s.clone().into(), vec![Arg::Earlier(0)]),
        ])
    })
}

/// A tensor of zeros of type `ty`: a scalar broadcast, which fusion turns
/// into a store of zeros (or folds into the reader).
fn zeros(ty: &crate::ir::types::TensorType) -> Rewrite {
    Rewrite::Ops(vec![
        (
            Constant {
                value: 0.0,
                dtype: ty.dtype,
            }
            .into(),
            vec![],
        ),
        (
            Broadcast {
                shape: ty.shape.clone(),
            }
            .into(),
            vec![Arg::Earlier(0)],
        ),
    ])
}

fn rule(g: &Graph, n: NodeIndex, node: &Node, ins: &[Value]) -> Option<Rewrite> {
    let out = &node.outputs[0];
    let same = |v: Value| g.ty(v) == out;
    match &node.op {
        Op::Cast(_) | Op::Reshape(_) | Op::Broadcast(_) if same(ins[0]) => {
            Some(Rewrite::Value(ins[0]))
        }
        // An f32 value cast to a 16-bit type and straight back (a norm's
        // parameter gradient, summed in f32, on its way to the f32
        // gradient buffer) keeps its f32 value: as PyTorch's autocast,
        // which keeps such sums in f32, and one rounding less.
        Op::Cast(c) if c.to == crate::ir::DType::F32 => match &g.g[ins[0].node].op {
            Op::Cast(inner)
                if matches!(inner.to, crate::ir::DType::BF16 | crate::ir::DType::F16) =>
            {
                let orig = g.inputs(ins[0].node)[0];
                same(orig).then_some(Rewrite::Value(orig))
            }
            Op::Slice(s) => widened_before_slicing(g, c, s, ins[0]),
            _ => None,
        },
        Op::Reshape(r) => match &g.g[ins[0].node].op {
            Op::Reshape(_) => {
                let inner = g.inputs(ins[0].node)[0];
                Some(Rewrite::Op(
                    Reshape {
                        shape: r.shape.clone(),
                    }
                    .into(),
                    vec![inner],
                ))
            }
            _ => None,
        },
        Op::Permute(p) => {
            if p.perm.iter().enumerate().all(|(i, &a)| i == a) {
                return Some(Rewrite::Value(ins[0]));
            }
            match &g.g[ins[0].node].op {
                // (a @ b)^T = b^T @ a^T: the product is stored the way it
                // is read (the tied output projection's weight gradient,
                // [d, V] transposed into the [V, d] table, becomes one
                // GEMM writing [V, d] rows, not a strided copy after it).
                Op::MatMul(_) if p.perm == [1, 0] && g.users(ins[0]).len() == 1 => {
                    let ab = g.inputs(ins[0].node);
                    let t = || Permute { perm: vec![1, 0] }.into();
                    (g.ty(ab[0]).rank() == 2 && g.ty(ab[1]).rank() == 2).then(|| {
                        Rewrite::Ops(vec![
                            (t(), vec![Arg::Existing(ab[1])]),
                            (t(), vec![Arg::Existing(ab[0])]),
                            (MatMul.into(), vec![Arg::Earlier(0), Arg::Earlier(1)]),
                        ])
                    })
                }
                Op::Permute(q) => {
                    let inner = g.inputs(ins[0].node)[0];
                    let perm: Vec<usize> = p.perm.iter().map(|&i| q.perm[i]).collect();
                    if perm.iter().enumerate().all(|(i, &a)| i == a) {
                        Some(Rewrite::Value(inner))
                    } else {
                        Some(Rewrite::Op(Permute { perm }.into(), vec![inner]))
                    }
                }
                _ => None,
            }
        }
        Op::Reduce(r)
            if r.kind == ReduceKind::Sum
                && !r.keepdim
                && key_sums::sums_keys_out(g, ins[0], &r.axes.iter().copied().collect()) =>
        {
            Some(zeros(out))
        }
        Op::Reduce(_) => batched_product_sum(g, node, ins),
        Op::Slice(s) if key_sums::slice_of_summed_keys(g, ins[0], s) => Some(zeros(out)),
        Op::Unary(u) if u.kind == UnaryKind::Neg => match &g.g[ins[0].node].op {
            Op::Unary(v) if v.kind == UnaryKind::Neg => {
                Some(Rewrite::Value(g.inputs(ins[0].node)[0]))
            }
            _ => None,
        },
        Op::Binary(b) => {
            if b.kind == BinaryKind::Add {
                if let Some(r) = slice_grads_to_concat(g, Value { node: n, port: 0 }) {
                    return Some(r);
                }
            }
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
        "algebraic simplification: x*1, x+0, reshape of reshape, permute of permute, no-op casts and f32 round trips through 16 bits, sums of slice gradients as concat, batch-summed products as one GEMM, a transposed product as the product of the transposes, an attention's key gradient summed over the keys (a key bias's gradient) as the exact zero it is"
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
                let Some(rw) = rule(g, n, &node, &ins) else {
                    continue;
                };
                let to = match rw {
                    Rewrite::Value(v) => v,
                    Rewrite::Op(op, inputs) => match g.add(op, &inputs, node.span, node.phase) {
                        Ok(v) => {
                            g.take_turn(&v, n);
                            v[0]
                        }
                        Err(_) => continue,
                    },
                    Rewrite::Ops(ops) => {
                        let mut made: Vec<Value> = Vec::new();
                        let wanted = ops.len();
                        for (op, args) in ops {
                            let inputs: Vec<Value> = args
                                .iter()
                                .map(|a| match a {
                                    Arg::Existing(v) => *v,
                                    Arg::Earlier(i) => made[*i],
                                })
                                .collect();
                            match g.add(op, &inputs, node.span, node.phase) {
                                Ok(v) => {
                                    g.take_turn(&v, n);
                                    made.push(v[0])
                                }
                                Err(_) => break,
                            }
                        }
                        // A failed build leaves dead nodes for DCE and no rewrite.
                        if made.len() != wanted || wanted == 0 {
                            continue;
                        }
                        *made.last().expect("not empty")
                    }
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
