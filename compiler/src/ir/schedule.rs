//! The order a graph's nodes run in: topological, deterministic, following
//! the model file, with recomputed nodes placed where they cost least
//! memory.

use super::graph::Graph;
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};

/// (phase, tier, turn, sub-turn, index): the smallest ready key runs
/// first. Without `Graph::order_by_memory` every tier is 0, and the order
/// is the file's: a node's turn is when it was added, or that of the node
/// a pass replaced with it (`Node::turn`), and within a turn the steps of
/// a rewrite that runs in steps (`Node::sub_turn`) go in order.
type Key = Reverse<(u8, u8, NodeIndex, u32, NodeIndex)>;

struct Order<'g> {
    g: &'g Graph,
    indeg: HashMap<NodeIndex, usize>,
    ready: BinaryHeap<Key>,
    /// Recomputed nodes whose inputs are all placed, not placed themselves.
    waiting: BTreeSet<NodeIndex>,
    placed: HashSet<NodeIndex>,
    order: Vec<NodeIndex>,
    /// `Graph::order_by_memory`: the order also runs first what frees
    /// memory (`tier`).
    by_memory: bool,
    /// Per stored node, its readers (through views, the views left out)
    /// not yet placed.
    unread: HashMap<NodeIndex, usize>,
}

/// Nodes in a deterministic topological order: among the ready nodes,
/// forward before backward before update, then the one added first, so the
/// order follows the model file. Recomputed nodes (`Node::recompute`) wait
/// until a node that reads them is taken and go just before it (or before
/// a product whose epilogue reads them). With `Graph::order_by_memory`
/// (the recompute stage sets it where it plans a smaller step), the order
/// also minds memory, since a recomputed value read by ops far apart lives
/// between them: among ready nodes of a phase, views (free) go first, then
/// ops that are the last reader of a stored value or read a recomputed one
/// already made, then the rest. (A weight-gradient product
/// whose operands are reshaped late would otherwise wait until the end of
/// the backward pass, keeping its operands alive: llama-small at B = 32
/// could not go under 12.7 GiB that way, and fits 8 GiB this way.)
pub fn topo_order(g: &Graph) -> Vec<NodeIndex> {
    let indeg: HashMap<NodeIndex, usize> =
        g.g.node_indices()
            .map(|n| (n, g.g.edges_directed(n, Direction::Incoming).count()))
            .collect();
    let mut o = Order {
        g,
        ready: BinaryHeap::new(),
        waiting: BTreeSet::new(),
        placed: HashSet::new(),
        order: Vec::with_capacity(indeg.len()),
        indeg,
        by_memory: g.order_by_memory,
        unread: HashMap::new(),
    };
    if o.by_memory {
        for n in g.g.node_indices() {
            if !g.g[n].op.is_view() {
                for b in o.bases(n) {
                    *o.unread.entry(b).or_default() += 1;
                }
            }
        }
    }
    let mut sources: Vec<NodeIndex> = o
        .indeg
        .iter()
        .filter(|(_, d)| **d == 0)
        .map(|(n, _)| *n)
        .collect();
    sources.sort();
    for n in sources {
        o.became_ready(n);
    }
    while let Some(Reverse((_, _, _, _, n))) = o.ready.pop() {
        if o.placed.contains(&n) {
            continue; // an earlier entry, raised since
        }
        o.place_waiting_inputs(n);
        // A product's epilogue reads what the op after it reads (the GELU
        // backward's pre-activation, a gathered bias): have it made before.
        if !o.waiting.is_empty() && matches!(g.g[n].op, Op::MatMul(_)) {
            let after: Vec<NodeIndex> =
                g.g.edges_directed(n, Direction::Outgoing)
                    .map(|e| e.target())
                    .collect();
            for t in after {
                if matches!(g.g[t].op, Op::UnaryGrad(_)) {
                    o.place_waiting_inputs(t);
                } else {
                    o.place_waiting_gathers(t);
                }
            }
        }
        o.place(n);
        o.release(n);
    }
    // Recomputed nodes nothing reads (none after dead-code elimination).
    while let Some(n) = o.waiting.pop_first() {
        o.place_waiting_inputs(n);
        o.place(n);
    }
    o.order
}

impl Order<'_> {
    fn key(&self, n: NodeIndex) -> Key {
        let node = &self.g.g[n];
        let tier = if !self.by_memory || node.op.is_view() {
            0
        } else if self.frees(n)
            || self
                .g
                .g
                .edges_directed(n, Direction::Incoming)
                .any(|e| self.made(e.source()))
        {
            1
        } else {
            2
        };
        Reverse((node.phase as u8, tier, self.g.turn_of(n), node.sub_turn, n))
    }

    /// The stored nodes `n` reads, looking through views.
    fn bases(&self, n: NodeIndex) -> Vec<NodeIndex> {
        self.g
            .inputs(n)
            .into_iter()
            .map(|x| {
                let mut b = x.node;
                while self.g.g[b].op.is_view() {
                    b = self.g.inputs(b)[0].node;
                }
                b
            })
            .collect()
    }

    /// Whether `n` is the last reader of a value stored for it: placing it
    /// frees that value.
    fn frees(&self, n: NodeIndex) -> bool {
        !self.g.g[n].op.is_view()
            && self
                .bases(n)
                .iter()
                .any(|b| self.unread.get(b) == Some(&1) && !self.g.g[*b].op.is_source())
    }

    /// After `n` is placed: a value it read with one reader left raises that
    /// reader, if it is ready.
    fn count_reads(&mut self, n: NodeIndex) {
        if self.g.g[n].op.is_view() {
            return;
        }
        for b in self.bases(n) {
            let Some(c) = self.unread.get_mut(&b) else {
                continue;
            };
            *c -= 1;
            if *c != 1 {
                continue;
            }
            let mut stack = vec![b];
            let mut last = Vec::new();
            while let Some(x) = stack.pop() {
                for t in self.readers(x) {
                    if self.g.g[t].op.is_view() {
                        stack.push(t);
                    } else if !self.placed.contains(&t) {
                        last.push(t);
                    }
                }
            }
            for t in last {
                if self.indeg[&t] == 0 && !self.waits(t) {
                    let k = self.key(t);
                    self.ready.push(k);
                }
            }
        }
    }

    /// Whether `n` is a recomputed value already made: placed, or a view
    /// (free) of one.
    fn made(&self, n: NodeIndex) -> bool {
        let node = &self.g.g[n];
        node.recompute
            && (self.placed.contains(&n)
                || (node.op.is_view()
                    && self.waiting.contains(&n)
                    && self.g.inputs(n).iter().all(|x| self.made(x.node))))
    }

    /// All of `n`'s inputs are counted as placed: a recomputed node waits
    /// (and counts as placed for its readers), any other is ready.
    fn became_ready(&mut self, n: NodeIndex) {
        if self.waits(n) {
            self.waiting.insert(n);
            self.release(n);
        } else {
            let k = self.key(n);
            self.ready.push(k);
        }
    }

    /// Whether `n` waits for its first reader to be taken and goes just
    /// before it: a recomputed node, ZeRO stage 3's gather of a parameter
    /// (so that each pass's copy of a weight is made where it is read, not
    /// where it could first be) and the cast of the piece it gathers, and
    /// a view of any of them.
    fn waits(&self, n: NodeIndex) -> bool {
        let node = &self.g.g[n];
        node.recompute
            || self.of_gather(n)
            || (matches!(node.op, Op::Cast(_)) && self.g.only_gathered(n))
    }

    /// Whether `n` is a gather, or a view of one. (A view of a recomputed
    /// value waits only where the recompute stage marks it so.)
    fn of_gather(&self, n: NodeIndex) -> bool {
        let node = &self.g.g[n];
        matches!(node.op, Op::AllGather(_))
            || (node.op.is_view() && self.g.inputs(n).iter().any(|x| self.of_gather(x.node)))
    }

    /// The nodes that read `n` (once per edge).
    fn readers(&self, n: NodeIndex) -> Vec<NodeIndex> {
        self.g
            .g
            .edges_directed(n, Direction::Outgoing)
            .map(|e| e.target())
            .collect()
    }

    fn release(&mut self, n: NodeIndex) {
        for t in self.readers(n) {
            let d = self.indeg.get_mut(&t).expect("edge target is a node");
            *d -= 1;
            if *d == 0 {
                self.became_ready(t);
            }
        }
    }

    fn place(&mut self, n: NodeIndex) {
        self.order.push(n);
        self.placed.insert(n);
        if self.by_memory {
            self.count_reads(n);
            if self.g.g[n].recompute {
                self.raise_readers(n);
            }
        }
    }

    /// The ready readers of recomputed `n` (through views) go first.
    fn raise_readers(&mut self, n: NodeIndex) {
        for t in self.readers(n) {
            let node = &self.g.g[t];
            if node.recompute {
                if node.op.is_view() && self.waiting.contains(&t) {
                    self.raise_readers(t);
                }
            } else if self.indeg[&t] == 0 && !self.placed.contains(&t) && !self.waiting.contains(&t)
            {
                let k = self.key(t);
                self.ready.push(k);
            }
        }
    }

    /// Places the gathers `n` reads (through views) that still wait.
    fn place_waiting_gathers(&mut self, n: NodeIndex) {
        for v in self.g.inputs(n) {
            let mut base = v.node;
            while self.g.g[base].op.is_view() {
                base = self.g.inputs(base)[0].node;
            }
            if matches!(self.g.g[base].op, Op::AllGather(_)) && self.waiting.remove(&v.node) {
                self.place_waiting_inputs(v.node);
                self.place(v.node);
            }
        }
    }

    /// Places the recomputed nodes `n` reads that still wait, each after
    /// the ones it reads itself.
    fn place_waiting_inputs(&mut self, n: NodeIndex) {
        for v in self.g.inputs(n) {
            if self.waiting.remove(&v.node) {
                self.place_waiting_inputs(v.node);
                self.place(v.node);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::graph::Phase;
    use crate::ir::types::{DType, TensorType};
    use crate::ops::{Input, Unary, UnaryKind};

    /// Two chains of one turn, the second added first: its sub-turn puts
    /// the first before it, whole, whatever the nodes' indices (without
    /// it, the lower index would start and the two would interleave).
    #[test]
    fn sub_turns_run_a_turns_steps_in_order() {
        let mut g = Graph::new("t");
        let ty = TensorType::new(DType::F32, vec![crate::ir::Dim::constant(4)]);
        let x = g
            .add(
                Input {
                    name: "x".into(),
                    ty,
                }
                .into(),
                &[],
                None,
                Phase::Forward,
            )
            .unwrap()[0];
        let neg = || {
            Op::from(Unary {
                kind: UnaryKind::Neg,
            })
        };
        let mut chain = |sub: u32| {
            let a = g.add(neg(), &[x], None, Phase::Backward).unwrap()[0];
            let b = g.add(neg(), &[a], None, Phase::Backward).unwrap()[0];
            for v in [a, b] {
                g.g[v.node].turn = Some(x.node);
                g.g[v.node].sub_turn = sub;
            }
            [a.node, b.node]
        };
        let late = chain(2);
        let early = chain(1);
        let order: Vec<NodeIndex> = topo_order(&g).into_iter().skip(1).collect();
        assert_eq!(order, [early[0], early[1], late[0], late[1]]);
    }
}
