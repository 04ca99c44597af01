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

/// (phase, 0 if it reads a recomputed value already made else 1, index):
/// the smallest ready key runs first.
type Key = Reverse<(u8, u8, NodeIndex)>;

struct Order<'g> {
    g: &'g Graph,
    indeg: HashMap<NodeIndex, usize>,
    ready: BinaryHeap<Key>,
    /// Recomputed nodes whose inputs are all placed, not placed themselves.
    waiting: BTreeSet<NodeIndex>,
    placed: HashSet<NodeIndex>,
    order: Vec<NodeIndex>,
}

/// Nodes in a deterministic topological order: among the ready nodes,
/// forward before backward before update, then the one added first, so the
/// order follows the model file. Recomputed nodes (`Node::recompute`) wait
/// until a node that reads them is taken and go just before it (or before
/// a product whose epilogue reads them); once one is made, its other
/// readers go first among the ready nodes of their phase, so the value
/// lives no longer than it must.
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
    };
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
    while let Some(Reverse((_, _, n))) = o.ready.pop() {
        if o.placed.contains(&n) {
            continue; // an earlier entry, raised since
        }
        o.place_waiting_inputs(n);
        // A product's epilogue reads what the op after it reads (the GELU
        // backward's pre-activation): have it made before.
        if !o.waiting.is_empty() && matches!(g.g[n].op, Op::MatMul(_)) {
            let after: Vec<NodeIndex> =
                g.g.edges_directed(n, Direction::Outgoing)
                    .map(|e| e.target())
                    .filter(|&t| matches!(g.g[t].op, Op::UnaryGrad(_)))
                    .collect();
            for t in after {
                o.place_waiting_inputs(t);
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

fn is_view(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape(_) | Op::Permute(_) | Op::Slice(_) | Op::Broadcast(_)
    )
}

impl Order<'_> {
    fn key(&self, n: NodeIndex) -> Key {
        let reads_made = self
            .g
            .g
            .edges_directed(n, Direction::Incoming)
            .any(|e| self.made(e.source()));
        Reverse((self.g.g[n].phase as u8, u8::from(!reads_made), n))
    }

    /// Whether `n` is a recomputed value already made: placed, or a view
    /// (free) of one.
    fn made(&self, n: NodeIndex) -> bool {
        let node = &self.g.g[n];
        node.recompute
            && (self.placed.contains(&n)
                || (is_view(&node.op)
                    && self.waiting.contains(&n)
                    && self.g.inputs(n).iter().all(|x| self.made(x.node))))
    }

    /// All of `n`'s inputs are counted as placed: a recomputed node waits
    /// (and counts as placed for its readers), any other is ready.
    fn became_ready(&mut self, n: NodeIndex) {
        if self.g.g[n].recompute {
            self.waiting.insert(n);
            self.release(n);
        } else {
            let k = self.key(n);
            self.ready.push(k);
        }
    }

    fn release(&mut self, n: NodeIndex) {
        let targets: Vec<NodeIndex> = self
            .g
            .g
            .edges_directed(n, Direction::Outgoing)
            .map(|e| e.target())
            .collect();
        for t in targets {
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
        if self.g.g[n].recompute {
            self.raise_readers(n);
        }
    }

    /// The ready readers of recomputed `n` (through views) go first.
    fn raise_readers(&mut self, n: NodeIndex) {
        let readers: Vec<NodeIndex> = self
            .g
            .g
            .edges_directed(n, Direction::Outgoing)
            .map(|e| e.target())
            .collect();
        for t in readers {
            let node = &self.g.g[t];
            if node.recompute {
                if is_view(&node.op) && self.waiting.contains(&t) {
                    self.raise_readers(t);
                }
            } else if self.indeg[&t] == 0 && !self.placed.contains(&t) {
                let k = self.key(t);
                self.ready.push(k);
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
