//! Awkward sizes padded inside the step. A product whose `n` or `k` is not a
//! multiple of 8 (an MLP width of 1713) has rows that are not 16-byte
//! multiples in 16-bit types, and cuBLASLt runs it on its unaligned kernels
//! at a tenth of the tensor cores' rate. Where the awkward size enters the
//! step through weights alone, the weights are read padded with zeros
//! (`slice_grad`, the zero-padding op, on the compute copy) and every tensor
//! between them is widened to the padded size:
//!
//! ```text
//! m @ w_gate, m @ w_up      [.., 1713]  ->  [.., 1728]   padded columns 0
//! silu(a) * b               [.., 1728]                   f(0) = 0
//! s @ w_down                k = 1728 over zero rows       unchanged result
//! ```
//!
//! The padded entries are exactly zero in the forward pass (a product with
//! zero columns, then ops that map zeros to zeros), and the padded rows of
//! the weights they meet are zero, so every value outside the region is the
//! same, bit for bit, and so is every gradient: the backward pass of the
//! padding is a slice, whose padded entries (zero as well) never reach a
//! parameter. The parameters, checkpoints and losses keep the model file's
//! sizes. A cross-entropy over padded logits (an untied head of 5003
//! classes) is told its classes and leaves the padded columns out of the
//! softmax, with a zero gradient there. Any other reader that cannot take
//! the padded size (a norm or a softmax over it) reads the tensor sliced
//! back to the model's size: a view, with a zero-padding copy of its
//! gradient in the backward pass.
//!
//! It runs on the forward graph, before autodiff, so the backward products
//! are built at the padded sizes too.

use super::Pass;
use crate::ir::graph::{PaddedSize, Phase};
use crate::ir::{Dim, Graph, Value};
use crate::ops::{BinaryKind, Op, Slice, SliceGrad};
use petgraph::stable_graph::NodeIndex;
use std::collections::{BTreeMap, BTreeSet, HashMap};

pub struct PadDims;

/// Sizes below this are left alone (their products are small).
const MIN_SIZE: i64 = 128;

/// The padded size of an awkward `n`, or None if it needs none: a multiple
/// of 64 from 1024 up (where cuBLASLt's tiles divide it; under 6% more),
/// of 8 below.
pub fn padded_size(n: i64) -> Option<i64> {
    if n < MIN_SIZE || n % 8 == 0 {
        return None;
    }
    let to = if n >= 1024 { 64 } else { 8 };
    Some((n + to - 1) / to * to)
}

/// A value read as a weight: a parameter, or its compute copy (a cast).
fn weight_param(g: &Graph, v: Value) -> Option<usize> {
    let node = match &g.g[v.node].op {
        Op::Cast(_) => g.inputs(v.node).first()?.node,
        _ => v.node,
    };
    g.params.iter().position(|p| p.node == node)
}

/// What padding size `n` changes, found in one walk of the forward graph
/// in order.
struct Region {
    n: i64,
    /// Widened values and the axis that grows.
    widened: HashMap<Value, usize>,
    /// Weights to read padded: (weight, axis) -> the readers (node, slot).
    pads: BTreeMap<(Value, usize), Vec<(NodeIndex, usize)>>,
    /// Readers that cannot take a widened value read it sliced back to the
    /// model's size (a view where the reader takes one): value -> readers.
    slices: BTreeMap<Value, Vec<(NodeIndex, usize)>>,
    /// Cross-entropies that read padded logits, told their classes.
    cross_entropies: Vec<NodeIndex>,
}

impl Region {
    fn axis_of(&self, v: Value) -> Option<usize> {
        self.widened.get(&v).copied()
    }

    /// Whether weight `w` can be read padded on `axis`: a weight whose axis
    /// has the size, not already padded on its other axis (a square awkward
    /// weight is left alone).
    fn can_pad(&self, g: &Graph, w: Value, axis: usize) -> bool {
        weight_param(g, w).is_some()
            && g.ty(w).shape.get(axis) == Some(&Dim::constant(self.n))
            && !self.pads.keys().any(|&(v, a)| v == w && a != axis)
    }

    fn pad(&mut self, w: Value, axis: usize, at: (NodeIndex, usize)) {
        self.pads.entry((w, axis)).or_default().push(at);
    }

    /// Node `n` reads its widened inputs sliced back; its output keeps the
    /// model's size.
    fn slice_inputs(&mut self, ins: &[Value], wide: &[Option<usize>], n: NodeIndex) {
        for (slot, (&v, w)) in ins.iter().zip(wide).enumerate() {
            if w.is_some() {
                self.slices.entry(v).or_default().push((n, slot));
            }
        }
    }

    /// Applies the rules to node `n`.
    fn visit(&mut self, g: &Graph, n: NodeIndex) {
        let ins = g.inputs(n);
        let wide: Vec<Option<usize>> = ins.iter().map(|&v| self.axis_of(v)).collect();
        if let Some(ax) = self.widens(g, n, &ins, &wide) {
            self.widened.insert(Value { node: n, port: 0 }, ax);
        }
    }

    /// The axis of `n`'s output that grows, if any, recording the weights
    /// it reads padded and the inputs it reads sliced.
    fn widens(
        &mut self,
        g: &Graph,
        n: NodeIndex,
        ins: &[Value],
        wide: &[Option<usize>],
    ) -> Option<usize> {
        let out = Value { node: n, port: 0 };
        let any_wide = wide.iter().any(|w| w.is_some());
        match &g.g[n].op {
            Op::MatMul(_) => {
                let (a, b) = (ins[0], ins[1]);
                let (ra, rb) = (g.ty(a).rank(), g.ty(b).rank());
                match (wide[0], wide[1]) {
                    // x @ w, w's columns padded: the product's columns too.
                    (None, None) => {
                        if rb == 2 && self.can_pad(g, b, 1) {
                            self.pad(b, 1, (n, 1));
                            return Some(g.ty(out).rank() - 1);
                        }
                        None
                    }
                    // h @ w over the padded k: w's rows padded with zeros.
                    (Some(ax), None) if ax == ra - 1 && rb == 2 && self.can_pad(g, b, 0) => {
                        self.pad(b, 0, (n, 1));
                        None
                    }
                    _ => {
                        self.slice_inputs(ins, wide, n);
                        None
                    }
                }
            }
            _ if !any_wide => None,
            // Padded logits: the padded columns are no class.
            Op::CrossEntropy(ce)
                if ce.classes.is_none()
                    && wide[1].is_none()
                    && wide[0] == Some(g.ty(ins[0]).rank() - 1) =>
            {
                self.cross_entropies.push(n);
                None
            }
            Op::Cast(_) => wide[0],
            Op::Unary(u) if u.kind.def().keeps_zero => wide[0],
            Op::Binary(bin) => {
                // Widened axes, counted from the right (broadcasting aligns
                // shapes there).
                let from_right: BTreeSet<usize> = ins
                    .iter()
                    .zip(wide)
                    .filter_map(|(&v, w)| w.map(|ax| g.ty(v).rank() - ax))
                    .collect();
                let zero_keeping = matches!(
                    bin.kind,
                    BinaryKind::Add | BinaryKind::Sub | BinaryKind::Mul
                );
                let mut pads = Vec::new();
                let ok = zero_keeping
                    && from_right.len() == 1
                    && ins.iter().zip(wide).enumerate().all(|(slot, (&v, w))| {
                        let r = *from_right.first().expect("one axis");
                        let rank = g.ty(v).rank();
                        if w.is_some() {
                            return true;
                        }
                        match (rank >= r).then(|| &g.ty(v).shape[rank - r]) {
                            // Of the awkward size there: a weight (a bias)
                            // read padded with zeros.
                            Some(d) if *d == Dim::constant(self.n) => {
                                pads.push((v, rank - r, slot));
                                self.can_pad(g, v, rank - r)
                            }
                            // Broadcast along it: 0 * x = 0, but 0 + x is not.
                            _ => bin.kind == BinaryKind::Mul,
                        }
                    });
                if !ok {
                    self.slice_inputs(ins, wide, n);
                    return None;
                }
                for (v, axis, slot) in pads {
                    self.pad(v, axis, (n, slot));
                }
                Some(g.ty(out).rank() - from_right.first().expect("one axis"))
            }
            _ => {
                self.slice_inputs(ins, wide, n);
                None
            }
        }
    }
}

fn region(g: &Graph, n: i64, order: &[NodeIndex]) -> Option<Region> {
    let mut r = Region {
        n,
        widened: HashMap::new(),
        pads: BTreeMap::new(),
        slices: BTreeMap::new(),
        cross_entropies: Vec::new(),
    };
    for &node in order {
        if g.g[node].phase == Phase::Forward {
            r.visit(g, node);
        }
    }
    // A graph output keeps its size (the loss is a scalar; no forward
    // output is a padded product in practice).
    let outputs = g.outputs.iter().any(|(_, v)| r.widened.contains_key(v));
    (!r.pads.is_empty() && !outputs).then_some(r)
}

/// Adds `op` on `v` in the forward pass and points `readers` at it.
fn insert_for(g: &mut Graph, v: Value, op: Op, readers: &[(NodeIndex, usize)]) {
    let span = g.g[v.node].span;
    let what = op.name();
    let out = g
        .add(op, &[v], span, Phase::Forward)
        .unwrap_or_else(|e| panic!("internal: {what} of a padded tensor: {e:?}"))[0];
    for &at in readers {
        super::replace_use(g, v, out, at);
    }
}

/// Reads the region's weights padded, widens its tensors and slices them
/// back for the readers that need the model's size.
fn apply(g: &mut Graph, r: &Region, to: i64) {
    for (&(w, axis), readers) in &r.pads {
        let pad = SliceGrad {
            axis,
            start: Dim::constant(0),
            full: Dim::constant(to),
        };
        insert_for(g, w, Op::SliceGrad(pad), readers);
    }
    // Each widened node's types again, producers first.
    for node in g.topo_order() {
        if !r.widened.contains_key(&Value { node, port: 0 }) {
            continue;
        }
        let types: Vec<_> = g.inputs(node).iter().map(|&v| g.ty(v).clone()).collect();
        let outputs = g.g[node]
            .op
            .infer(&types)
            .expect("a widened op accepts its widened inputs");
        g.g[node].outputs = outputs;
    }
    for &n in &r.cross_entropies {
        if let Op::CrossEntropy(ce) = &mut g.g[n].op {
            ce.classes = Some(r.n);
        }
    }
    for (&v, readers) in &r.slices {
        let back = Slice {
            axis: r.widened[&v],
            start: Dim::constant(0),
            end: Dim::constant(r.n),
        };
        insert_for(g, v, Op::Slice(back), readers);
    }
}

impl Pass for PadDims {
    fn name(&self) -> &'static str {
        "pad-dims"
    }
    fn about(&self) -> &'static str {
        "reads weights of an awkward size (an MLP width of 1713) padded with zeros, widening the tensors between them, so their products run on aligned kernels (forward graph)"
    }
    fn run(&self, g: &mut Graph) -> usize {
        // Candidate sizes: the awkward axes of weights that products read.
        let mut sizes = BTreeSet::new();
        for n in g.g.node_indices() {
            if !matches!(g.g[n].op, Op::MatMul(_)) || g.g[n].phase != Phase::Forward {
                continue;
            }
            let b = g.inputs(n)[1];
            if weight_param(g, b).is_some() && g.ty(b).rank() == 2 {
                for d in &g.ty(b).shape {
                    if let Some(x) = d.as_const().filter(|&x| padded_size(x).is_some()) {
                        sizes.insert(x);
                    }
                }
            }
        }
        let mut rewrites = 0;
        for n in sizes {
            let to = padded_size(n).expect("a candidate size");
            let order = g.topo_order();
            let Some(r) = region(g, n, &order) else {
                continue;
            };
            let mut params: Vec<usize> = r
                .pads
                .keys()
                .filter_map(|&(w, _)| weight_param(g, w))
                .collect();
            params.sort_unstable();
            params.dedup();
            let params = params.iter().map(|&i| g.params[i].name.clone()).collect();
            apply(g, &r, to);
            rewrites += r.pads.len();
            g.padded.push(PaddedSize {
                size: n,
                to,
                params,
                widened: r.widened.len(),
            });
        }
        rewrites
    }
}
