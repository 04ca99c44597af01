//! Which activations the backward pass keeps, and the rewrite that drops
//! some of them: each backward reader of a dropped value reads a copy of
//! its forward op instead, run again from values that are still kept.

use crate::ir::graph::{Phase, Value};
use crate::ir::Graph;
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;
use std::collections::{HashMap, HashSet};

/// Values that are never stored: parameters, inputs and state live for the
/// whole run, constants and sizes fold into the kernels that read them.
fn is_fixed(op: &Op) -> bool {
    op.is_source() || op.is_scalar()
}

/// Whether node `n` reads only parameters, state and constants (through
/// views): a weight's cast to the compute dtype.
pub fn of_parameters(g: &Graph, n: NodeIndex) -> bool {
    g.inputs(n).iter().all(|x| {
        let op = &g.g[x.node].op;
        (is_fixed(op) && !matches!(op, Op::Input(_))) || (op.is_view() && of_parameters(g, x.node))
    })
}

/// Whether a reader of `v` (through views) belongs to the backward pass.
fn read_by_backward(g: &Graph, v: Value) -> bool {
    g.users(v).iter().any(|&(u, _)| {
        let node = &g.g[u];
        if node.phase != Phase::Forward {
            true
        } else if node.op.is_view() {
            read_by_backward(g, Value { node: u, port: 0 })
        } else {
            false
        }
    })
}

/// The forward values the backward pass reads (through views): what a step
/// keeps from its forward pass, each stored value once.
pub fn saved_values(g: &Graph) -> Vec<Value> {
    let mut out = Vec::new();
    for n in g.topo_order() {
        let node = &g.g[n];
        if node.phase != Phase::Forward || is_fixed(&node.op) || node.op.is_view() {
            continue;
        }
        for port in 0..node.outputs.len() {
            let v = Value { node: n, port };
            if read_by_backward(g, v) {
                out.push(v);
            }
        }
    }
    out
}

/// Whether every backward op that reads `v` (through views) reads only
/// forward values and constants: such ops start the backward pass, so a
/// value they read would be recomputed as soon as it was dropped.
pub fn read_at_backward_start(g: &Graph, v: Value) -> bool {
    let mut readers = Vec::new();
    backward_readers(g, v, &mut readers);
    let mut memo = HashMap::new();
    !readers.is_empty()
        && readers.iter().all(|&r| {
            g.inputs(r)
                .iter()
                .all(|x| g.g[x.node].phase == Phase::Forward || constant_like(g, x.node, &mut memo))
        })
}

/// The backward ops that read `v`, looking through views of either phase.
fn backward_readers(g: &Graph, v: Value, out: &mut Vec<NodeIndex>) {
    for (u, _) in g.users(v) {
        let node = &g.g[u];
        if node.op.is_view() {
            backward_readers(g, Value { node: u, port: 0 }, out);
        } else if node.phase != Phase::Forward {
            out.push(u);
        }
    }
}

/// Whether node `n` depends on no forward value: a constant, or a
/// backward op of constants alone (the loss's seed and its scaling).
fn constant_like(g: &Graph, n: NodeIndex, memo: &mut HashMap<NodeIndex, bool>) -> bool {
    if let Some(&b) = memo.get(&n) {
        return b;
    }
    let node = &g.g[n];
    let b = is_fixed(&node.op)
        || (node.phase != Phase::Forward
            && g.inputs(n).iter().all(|x| constant_like(g, x.node, memo)));
    memo.insert(n, b);
    b
}

/// Whether recomputing `v` costs no kernel of its own: an elementwise op
/// of kept values (nothing else needs recomputing for it), read in the
/// backward pass by elementwise ops alone, into whose kernels it fuses.
pub fn recomputes_into_readers(g: &Graph, all: &Kept, v: Value) -> bool {
    let node = &g.g[v.node];
    if !node.op.is_elementwise() {
        return false;
    }
    let mut readers = Vec::new();
    backward_readers(g, v, &mut readers);
    !readers.is_empty()
        && readers.iter().all(|&r| g.g[r].op.is_elementwise())
        && all.without(&HashSet::from([v])).recipe(g, v) == vec![v.node]
}

/// The outermost block call a node was elaborated in (0: the top level).
fn outer_call(g: &Graph, n: NodeIndex) -> u32 {
    let Some(span) = g.g[n].span else {
        return 0;
    };
    let mut at = span.call;
    // Each call's site lies in an earlier call (see `Graph::call_stack`);
    // the bound guards a graph built by hand.
    for _ in 0..=g.calls.len() {
        match g.calls.get((at as usize).wrapping_sub(1)) {
            Some(c) if c.site.call > 0 => at = c.site.call,
            _ => break,
        }
    }
    at
}

/// The values passed from one outermost block call to another (a layer's
/// input and output): these are always kept, so a recomputation never
/// reaches back past the start of its own layer.
pub fn checkpoints(g: &Graph) -> HashSet<Value> {
    let mut out = HashSet::new();
    for n in g.g.node_indices() {
        let node = &g.g[n];
        if node.phase != Phase::Forward || is_fixed(&node.op) || node.op.is_view() {
            continue;
        }
        let here = outer_call(g, n);
        for port in 0..node.outputs.len() {
            let v = Value { node: n, port };
            if forward_readers(g, v)
                .into_iter()
                .any(|u| outer_call(g, u) != here)
            {
                out.insert(v);
            }
        }
    }
    out
}

/// The forward nodes that read `v`, through views (the views included).
fn forward_readers(g: &Graph, v: Value) -> Vec<NodeIndex> {
    let mut out = Vec::new();
    for (u, _) in g.users(v) {
        if g.g[u].phase != Phase::Forward {
            continue;
        }
        out.push(u);
        if g.g[u].op.is_view() {
            out.extend(forward_readers(g, Value { node: u, port: 0 }));
        }
    }
    out
}

/// What stays stored for the backward pass once `dropped` is dropped: the
/// other saved values and the checkpoints. Anything else a recomputation
/// needs is recomputed too.
#[derive(Clone)]
pub struct Kept {
    /// Every saved value and checkpoint, shared between the sets made
    /// from one graph.
    all: std::rc::Rc<HashSet<Value>>,
    dropped: HashSet<Value>,
}

impl Kept {
    pub fn new(g: &Graph, dropped: &HashSet<Value>) -> Kept {
        Kept::everything(g).without(dropped)
    }

    /// Every saved value and checkpoint: what the step keeps unbudgeted.
    pub fn everything(g: &Graph) -> Kept {
        let mut all: HashSet<Value> = saved_values(g).into_iter().collect();
        all.extend(checkpoints(g));
        Kept {
            all: std::rc::Rc::new(all),
            dropped: HashSet::new(),
        }
    }

    /// These kept values but `dropped` (which must not be checkpoints).
    pub fn without(&self, dropped: &HashSet<Value>) -> Kept {
        Kept {
            all: self.all.clone(),
            dropped: self.dropped.union(dropped).copied().collect(),
        }
    }

    fn contains(&self, v: &Value) -> bool {
        self.all.contains(v) && !self.dropped.contains(v)
    }

    /// Whether reading `v` in the backward pass needs its op run again.
    pub fn needs_recompute(&self, g: &Graph, v: Value) -> bool {
        let node = &g.g[v.node];
        let op = &node.op;
        if node.phase != Phase::Forward || is_fixed(op) {
            false
        } else if op.is_view() {
            self.needs_recompute(g, g.inputs(v.node)[0])
        } else {
            // A vector (a bias, or its cast) is read where it is: kept
            // longer it costs next to nothing, and recomputed it would no
            // longer be a buffer a GEMM's epilogue adds. A value of
            // parameters alone (a weight's bf16 copy) is made with them at
            // the start of the step, and so would its recomputation be.
            !self.contains(&v) && g.ty(v).rank() > 1 && !of_parameters(g, v.node)
        }
    }

    /// The forward nodes that run again for the backward pass to read `v`
    /// (empty if it is kept), inputs before readers.
    pub fn recipe(&self, g: &Graph, v: Value) -> Vec<NodeIndex> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        self.collect(g, v, &mut seen, &mut out);
        out
    }

    fn collect(
        &self,
        g: &Graph,
        v: Value,
        seen: &mut HashSet<NodeIndex>,
        out: &mut Vec<NodeIndex>,
    ) {
        if !self.needs_recompute(g, v) || !seen.insert(v.node) {
            return;
        }
        for x in g.inputs(v.node) {
            self.collect(g, x, seen, out);
        }
        out.push(v.node);
    }
}

/// Drops the saved values `dropped`: every backward reader of one (or of a
/// view of one) reads a recomputed copy instead, made of copies of the
/// forward ops between it and the values still kept. The copies are
/// backward nodes marked `recompute`, so the schedule runs them just
/// before their first reader. Returns how many nodes it added.
pub fn drop_saved(g: &mut Graph, dropped: &HashSet<Value>) -> usize {
    let kept = Kept::new(g, dropped);
    // Every (value, reader, slot) to redirect, found before the graph changes.
    let mut redirect = Vec::new();
    for n in g.g.node_indices() {
        if g.g[n].phase == Phase::Forward || g.g[n].recompute {
            continue;
        }
        for (slot, x) in g.inputs(n).into_iter().enumerate() {
            if kept.needs_recompute(g, x) {
                redirect.push((x, n, slot));
            }
        }
    }
    let mut copies: HashMap<NodeIndex, NodeIndex> = HashMap::new();
    let before = g.g.node_count();
    for (x, reader, slot) in redirect {
        let copy = copy_of(g, &kept, x, &mut copies);
        crate::passes::replace_use(g, x, copy, (reader, slot));
        // A backward view of a recomputed value waits with it: placed
        // early, it would pull the recomputation to the start of the
        // backward pass.
        let mut view = reader;
        while g.g[view].op.is_view() && !g.g[view].recompute {
            g.g[view].recompute = true;
            match g.users(Value {
                node: view,
                port: 0,
            })[..]
            {
                [(only, _)] => view = only,
                _ => break,
            }
        }
    }
    g.g.node_count() - before
}

fn copy_of(
    g: &mut Graph,
    kept: &Kept,
    v: Value,
    copies: &mut HashMap<NodeIndex, NodeIndex>,
) -> Value {
    // ZeRO stage 3: the forward pass's gather of a parameter dies with its
    // last forward reader; a recomputed op reads the backward pass's.
    if !of_forward_gather(g, v) && !kept.needs_recompute(g, v) {
        return v;
    }
    if let Some(&c) = copies.get(&v.node) {
        return Value {
            node: c,
            port: v.port,
        };
    }
    if let Some(b) = backward_gather(g, v) {
        copies.insert(v.node, b.node);
        return b;
    }
    let inputs: Vec<Value> = g
        .inputs(v.node)
        .into_iter()
        .map(|x| copy_of(g, kept, x, copies))
        .collect();
    let node = &g.g[v.node];
    let (op, span) = (node.op.clone(), node.span);
    let out = g
        .add(op, &inputs, span, Phase::Backward)
        .expect("a copy of an op on copies of its inputs has their types");
    let c = out[0].node;
    g.g[c].recompute = true;
    copies.insert(v.node, c);
    Value {
        node: c,
        port: v.port,
    }
}

/// Whether `v` is the forward pass's gather of a parameter (ZeRO stage
/// 3), or a view of one.
fn of_forward_gather(g: &Graph, v: Value) -> bool {
    let node = &g.g[v.node];
    match &node.op {
        Op::AllGather(_) => node.phase == Phase::Forward,
        op if op.is_view() => of_forward_gather(g, g.inputs(v.node)[0]),
        _ => false,
    }
}

/// The backward pass's gather of the parameter forward gather `v` gathers,
/// in the same type, if the step has one.
fn backward_gather(g: &Graph, v: Value) -> Option<Value> {
    let Op::AllGather(a) = &g.g[v.node].op else {
        return None;
    };
    g.g.node_indices()
        .find(|&n| {
            matches!(&g.g[n].op, Op::AllGather(b) if b.param == a.param)
                && g.g[n].phase == Phase::Backward
                && g.g[n].outputs[0] == g.g[v.node].outputs[0]
        })
        .map(|n| Value { node: n, port: 0 })
}
