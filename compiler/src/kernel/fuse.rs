//! Fusion: cuts the graph into kernels.
//!
//! Elementwise ops (unary, their gradients, binary arithmetic, casts) fuse
//! into chains: an op joins the kernel of its producer when it is that
//! value's only reader and computes the same number of elements, reached
//! through nothing but reshapes. A chain therefore stores only its last
//! value; everything before it stays in registers. Scalars (constants,
//! symbolic sizes) are folded into the expressions, and reshapes, permutes,
//! slices and broadcasts become views that the loads read through. Every
//! other op is a kernel of its own.

use super::view::View;
use super::{Body, BufKind, Buffer, ColumnSum, Epilogue, Kernel, PExpr, Pointwise, Program};
use crate::ir::graph::Value;
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::ops::{BinaryKind, UnaryKind};
use crate::ops::{FusionClass, Op};
use crate::optimisation::{LowerOptions, Optimisation};
use petgraph::stable_graph::NodeIndex;
use std::collections::HashMap;

mod epilogues;
mod prologues;

struct Fuser<'g> {
    g: &'g Graph,
    opts: &'g LowerOptions,
    /// Chain (group) of each pointwise node.
    group: HashMap<NodeIndex, usize>,
    chains: Vec<Vec<NodeIndex>>,
    buffers: Vec<Buffer>,
    buffer_of: HashMap<Value, usize>,
    outputs: std::collections::HashSet<Value>,
    /// Op outputs stored straight into the buffer of the cast reading them.
    cast_into: HashMap<Value, NodeIndex>,
    /// Chains folded into the GEMM before them.
    absorbed: std::collections::HashSet<usize>,
    /// Column sums performed by the chain kernel that stores their input.
    summed: std::collections::HashSet<NodeIndex>,
    /// Each node's place in the launch order.
    position: HashMap<NodeIndex, usize>,
    /// Chains run by the norm that reads them (norm -> chain).
    deferred: HashMap<NodeIndex, usize>,
}

impl<'g> Fuser<'g> {
    fn class(&self, n: NodeIndex) -> FusionClass {
        self.g.g[n].op.class()
    }

    /// Follows view ops back to the value they view: (base, view ops in
    /// application order).
    fn base(&self, mut v: Value) -> (Value, Vec<NodeIndex>) {
        let mut chain = Vec::new();
        while self.class(v.node) == FusionClass::View {
            chain.push(v.node);
            v = self.g.inputs(v.node)[0];
        }
        chain.reverse();
        (v, chain)
    }

    /// The non-view readers of `v`, looking through view ops.
    fn readers(&self, v: Value) -> Vec<NodeIndex> {
        let mut out = Vec::new();
        for (u, _) in self.g.users(v) {
            if self.class(u) == FusionClass::View {
                out.extend(self.readers(Value { node: u, port: 0 }));
            } else {
                out.push(u);
            }
        }
        out
    }

    /// Whether `x`, read by `n`, is the previous op's value seen unchanged:
    /// only reshapes between, and the same shape as `n`'s result.
    fn same_elements(&self, x: Value, n: NodeIndex) -> bool {
        let (_, chain) = self.base(x);
        chain
            .iter()
            .all(|v| matches!(self.g.g[*v].op, Op::Reshape(_)))
            && self.g.ty(x).shape == self.g.g[n].outputs[0].shape
    }

    /// A widening cast (bf16 gradient to its f32 buffer) that the op
    /// kernel before it performs as it stores: the op computes in f32, so
    /// the narrow value is never written. Not after a collective: NCCL
    /// stores in the type it reads, so a cast after one must stay a kernel.
    fn absorbed_cast(&self, n: NodeIndex) -> Option<Value> {
        let Op::Cast(c) = &self.g.g[n].op else {
            return None;
        };
        if !self.opts.on(Optimisation::CastsIntoProducers) {
            return None;
        }
        let x = self.g.inputs(n)[0];
        let absorbs = c.to == DType::F32
            && self.class(x.node) == FusionClass::Kernel
            && !matches!(
                self.g.g[x.node].op,
                Op::AdamW(_) | Op::Sgd(_) | Op::AllReduce(_)
            )
            && self.g.users(x).len() == 1
            && !self.outputs.contains(&x);
        absorbs.then_some(x)
    }

    /// Whether add `n` should start a chain of its own rather than join
    /// the chain of `x`, its other operand: `n` adds the product of a GEMM
    /// that `n` alone reads to a value stored before that GEMM runs, so
    /// the GEMM adds it as its residual (cuBLASLt's C) and a sum of many
    /// products (a layer input's gradient from its query, key and value
    /// projections) becomes a run of residual epilogues, not an add kernel
    /// reading every product back.
    fn residual_for_gemm(&self, n: NodeIndex, x: Value, at: &HashMap<NodeIndex, usize>) -> bool {
        let is_add = matches!(&self.g.g[n].op, Op::Binary(b) if b.kind == BinaryKind::Add);
        if !is_add || !self.opts.on(Optimisation::GemmEpilogues) {
            return false;
        }
        let ins = self.g.inputs(n);
        let Some(&m) = ins.iter().find(|&&v| v != x) else {
            return false;
        };
        let out = self.g.ty(Value { node: n, port: 0 });
        matches!(self.g.g[m.node].op, Op::MatMul(_))
            && m.port == 0
            && self.g.users(m).len() == 1
            && !self.outputs.contains(&m)
            && self.g.ty(m) == out
            && self.g.ty(x) == out
            && at.get(&self.base(x).0.node) < at.get(&m.node)
    }

    fn form_chains(&mut self) {
        let order = self.g.topo_order();
        let at = self.position.clone();
        for n in order {
            if self.class(n) != FusionClass::Elementwise {
                continue;
            }
            if let Some(x) = self.absorbed_cast(n) {
                self.cast_into.insert(x, n);
                continue;
            }
            let mut joined = None;
            let chains = self.opts.on(Optimisation::ElementwiseChains);
            for x in self.g.inputs(n).into_iter().filter(|_| chains) {
                let (b, _) = self.base(x);
                let Some(&gi) = self.group.get(&b.node) else {
                    continue;
                };
                let tail = *self.chains[gi].last().expect("chains are not empty");
                let only_reader = self.readers(b).iter().all(|&r| r == n);
                if tail == b.node
                    && only_reader
                    && !self.outputs.contains(&b)
                    && self.same_elements(x, n)
                    && !self.residual_for_gemm(n, x, &at)
                {
                    joined = Some(gi);
                    break;
                }
            }
            let gi = joined.unwrap_or_else(|| {
                self.chains.push(Vec::new());
                self.chains.len() - 1
            });
            self.chains[gi].push(n);
            self.group.insert(n, gi);
        }
    }

    fn store(&mut self, v: Value, kind: BufKind) -> usize {
        if let Some(&b) = self.buffer_of.get(&v) {
            return b;
        }
        self.buffers.push(Buffer {
            value: v,
            ty: self.g.ty(v).clone(),
            kind,
            pitch: None,
            zero_rows: 0,
        });
        self.buffer_of.insert(v, self.buffers.len() - 1);
        self.buffers.len() - 1
    }

    /// The buffer an op kernel reads for `x`: a stored value, or a view of
    /// one copied out by a small pointwise kernel.
    fn materialise(&mut self, x: Value, kernels: &mut Vec<Kernel>) -> usize {
        if let Some(&b) = self.buffer_of.get(&x) {
            return b;
        }
        if self.scalar_expr(x).is_some() && self.class(x.node) == FusionClass::Scalar {
            return self.materialise_scalar(x, kernels);
        }
        // A view of a scalar no kernel stores (a constant broadcast to a
        // shape: the loss's seed, a key bias's zero gradient): one fill of
        // the whole tensor, not a one-element fill and a copy of it.
        let (base, _) = self.base(x);
        if base != x
            && self.class(base.node) == FusionClass::Scalar
            && !self.buffer_of.contains_key(&base)
        {
            if let Some(e) = self.scalar_expr(base) {
                return self.fill(x, e, kernels);
            }
        }
        let shape = self.g.ty(x).shape.clone();
        let (src, view) = if let Some(view) = self.flat_view(x, &shape) {
            // A reshape of a strided view, copied in one pass: element i of
            // the reshape is element i of its input's view.
            let (base, _) = self.base(x);
            let src = match self.buffer_of.get(&base) {
                Some(&b) => b,
                None => self.materialise_scalar(base, kernels),
            };
            (src, view)
        } else if self.needs_copy(x) {
            // Anything else no view says: copy the inner view out first,
            // then the reshape reads it contiguously.
            let inner = self.g.inputs(x.node)[0];
            let src = self.materialise(inner, kernels);
            let v = View::contiguous(&self.g.ty(inner).shape);
            let v = v.apply(&self.g.g[x.node].op).unwrap_or(v);
            (src, v)
        } else {
            let (base, _) = self.base(x);
            let src = match self.buffer_of.get(&base) {
                Some(&b) => b,
                None => self.materialise_scalar(base, kernels),
            };
            (src, self.view_of(x))
        };
        let out = self.store(x, BufKind::Temp);
        let n = self.g.ty(x).numel();
        kernels.push(Kernel {
            name: format!("k{}_copy", kernels.len()),
            nodes: vec![x.node],
            inputs: vec![src],
            outputs: vec![out],
            input_views: Vec::new(),
            residual: None,
            prologue: None,
            body: Body::Pointwise(Pointwise {
                n,
                exprs: vec![PExpr::Load { input: 0, view }],
                stores: vec![(0, 0)],
                sum: None,
            }),
        });
        out
    }

    /// How `x` reads its base value's buffer, when a view can say it.
    fn try_view(&self, x: Value) -> Option<View> {
        let (base, chain) = self.base(x);
        chain
            .iter()
            .try_fold(View::contiguous(&self.g.ty(base).shape), |v, &n| {
                v.apply(&self.g.g[n].op)
            })
    }

    /// How `x` reads its base value's buffer (callers first check
    /// `needs_copy`).
    fn view_of(&self, x: Value) -> View {
        self.try_view(x)
            .unwrap_or_else(|| View::contiguous(&self.g.ty(x).shape))
    }

    /// A view chain a load cannot express (a reshape of a permuted view).
    fn needs_copy(&self, x: Value) -> bool {
        self.try_view(x).is_none()
    }

    /// Where no view of `x` exists because it reshapes a strided view, a
    /// pointwise kernel of `x`'s shape can still read it in place: a
    /// reshape keeps the row-major order, so element `i` of `x` is element
    /// `i` of the reshape's input, which a load reads through the input's
    /// own view (its shape unravels `i`). `None` where `x` has a view, or
    /// is read broadcast.
    fn flat_view(&self, x: Value, out_shape: &[Dim]) -> Option<View> {
        if !self.needs_copy(x) || self.g.ty(x).shape != out_shape {
            return None;
        }
        let mut v = x;
        while matches!(self.g.g[v.node].op, Op::Reshape(_)) {
            v = self.g.inputs(v.node)[0];
            if let Some(view) = self.try_view(v) {
                return Some(view);
            }
        }
        None
    }

    fn scalar_expr(&self, x: Value) -> Option<PExpr> {
        let (b, _) = self.base(x);
        match &self.g.g[b.node].op {
            Op::Constant(c) => Some(PExpr::Const(c.value)),
            Op::DimValue(d) => Some(PExpr::Dim(d.dim.clone())),
            _ => None,
        }
    }

    /// The expressions of `chain`, their loads reading the buffers of the
    /// returned inputs by position, and the expression of its last value.
    fn chain_exprs(
        &mut self,
        chain: &[NodeIndex],
        kernels: &mut Vec<Kernel>,
    ) -> (Vec<PExpr>, Vec<usize>, usize) {
        let mut exprs: Vec<PExpr> = Vec::new();
        let mut inputs: Vec<usize> = Vec::new();
        let mut prev: Option<(NodeIndex, usize)> = None;
        for &n in chain {
            let out_shape = self.g.g[n].outputs[0].shape.clone();
            let mut args = Vec::new();
            let mut key_slot = None;
            for (at, x) in self.g.inputs(n).into_iter().enumerate() {
                // Dropout's key is read whole, not as an element.
                if at == 1 && matches!(self.g.g[n].op, Op::Dropout(_)) {
                    let (b, _) = self.base(x);
                    let src = match self.buffer_of.get(&b) {
                        Some(&src) => src,
                        None => self.materialise(x, kernels),
                    };
                    key_slot = Some(match inputs.iter().position(|&i| i == src) {
                        Some(s) => s,
                        None => {
                            inputs.push(src);
                            inputs.len() - 1
                        }
                    });
                    continue;
                }
                let (b, _) = self.base(x);
                let e = match prev {
                    Some((p, e)) if b.node == p && self.same_elements(x, n) => e,
                    _ => {
                        let ex = match self.scalar_expr(x) {
                            Some(s) => s,
                            None => {
                                let flat = self.flat_view(x, &out_shape);
                                let src = match (&flat, self.needs_copy(x)) {
                                    (None, true) => self.materialise(x, kernels),
                                    _ => self.buffer_of[&b],
                                };
                                // A flat view has the kernel's elements in
                                // another shape; the others broadcast to it.
                                let view = match (flat, self.needs_copy(x)) {
                                    (Some(v), _) => v,
                                    (None, true) => {
                                        View::contiguous(&self.g.ty(x).shape).expand_to(&out_shape)
                                    }
                                    (None, false) => self.view_of(x).expand_to(&out_shape),
                                };
                                let slot = match inputs.iter().position(|&i| i == src) {
                                    Some(s) => s,
                                    None => {
                                        inputs.push(src);
                                        inputs.len() - 1
                                    }
                                };
                                PExpr::Load { input: slot, view }
                            }
                        };
                        exprs.push(ex);
                        exprs.len() - 1
                    }
                };
                args.push(e);
            }
            let e = match &self.g.g[n].op {
                Op::Unary(u) => PExpr::Unary(u.kind, args[0]),
                Op::UnaryGrad(u) => PExpr::UnaryGrad(u.kind, args[0], args[1]),
                Op::Binary(b) => PExpr::Binary(b.kind, args[0], args[1]),
                Op::Cast(c) => PExpr::Round(c.to, args[0]),
                Op::Dropout(d) => PExpr::Dropout {
                    op: d.clone(),
                    x: args[0],
                    key: key_slot.expect("dropout reads its key"),
                },
                other => unreachable!("{} is not pointwise", other.name()),
            };
            exprs.push(e);
            prev = Some((n, exprs.len() - 1));
        }
        (exprs, inputs, prev.expect("a chain has ops").1)
    }

    fn chain_kernel(&mut self, chain: &[NodeIndex], kernels: &mut Vec<Kernel>) {
        let (exprs, inputs, last) = self.chain_exprs(chain, kernels);
        let tail = *chain.last().expect("chains are not empty");
        let v = Value {
            node: tail,
            port: 0,
        };
        let n = self.g.g[tail].outputs[0].numel();
        let summed = self.chain_sum(tail, &n);
        // Stored unless the sum is its one reader.
        let keep = summed.as_ref().is_none_or(|s| !s.only_reader);
        let mut nodes = chain.to_vec();
        let mut outputs = Vec::new();
        let mut stores = Vec::new();
        if keep {
            outputs.push(self.store(v, BufKind::Temp));
            stores.push((0, last));
        }
        let sum = summed.map(|s| {
            self.summed.insert(s.node);
            nodes.push(s.node);
            let r = Value {
                node: s.node,
                port: 0,
            };
            // A widening cast after the sum is its store, as for the sum's
            // own kernel.
            let stored = match self.cast_into.get(&r) {
                Some(&c) => {
                    nodes.push(c);
                    Value { node: c, port: 0 }
                }
                None => r,
            };
            outputs.push(self.store(stored, BufKind::Temp));
            ColumnSum {
                expr: last,
                dtype: self.g.ty(v).dtype,
                out: outputs.len() - 1,
                cols: s.cols,
                mean: s.mean,
            }
        });
        kernels.push(Kernel {
            name: kernel_name(self.g, kernels.len(), &nodes),
            nodes,
            inputs,
            outputs,
            input_views: Vec::new(),
            residual: None,
            prologue: None,
            body: Body::Pointwise(Pointwise {
                n,
                exprs,
                stores,
                sum,
            }),
        });
    }

    /// A sum over the leading axes that reads chain tail `tail` (of `n`
    /// elements, through reshapes alone) and that the chain's kernel can
    /// add up as it computes it.
    fn chain_sum(&self, tail: NodeIndex, n: &Dim) -> Option<ChainSum> {
        if !self.opts.on(Optimisation::SumsIntoChains) {
            return None;
        }
        let v = Value {
            node: tail,
            port: 0,
        };
        if !self.g.ty(v).dtype.is_float() {
            return None;
        }
        let readers = self.readers(v);
        readers.iter().find_map(|&r| {
            let x = *self.g.inputs(r).first()?;
            let (base, views) = self.base(x);
            let (cols, mean) = super::forms::leading_sum(self.g, r)?;
            let reshapes = views
                .iter()
                .all(|&u| matches!(self.g.g[u].op, Op::Reshape(_)));
            let viewed = views
                .iter()
                .any(|&u| self.outputs.contains(&Value { node: u, port: 0 }));
            (base == v && reshapes && self.g.ty(x).numel() == *n && !self.summed.contains(&r))
                .then_some(ChainSum {
                    node: r,
                    cols,
                    mean,
                    only_reader: readers.len() == 1 && !viewed && !self.outputs.contains(&v),
                })
        })
    }
}

/// A sum a chain's kernel performs (`Fuser::chain_sum`).
struct ChainSum {
    node: NodeIndex,
    cols: i64,
    mean: bool,
    /// The chain's value is read by the sum alone, so it is not stored.
    only_reader: bool,
}

/// A view that is a row-major buffer with its last two axes swapped: what a
/// GEMM reads as a transposed operand.
fn is_transposed_matrix(v: &View) -> bool {
    let r = v.shape.len();
    if r < 2 {
        return false;
    }
    let mut t = v.clone();
    t.shape.swap(r - 2, r - 1);
    t.strides.swap(r - 2, r - 1);
    t.is_contiguous()
}

/// `k7_add_gelu`, from the ops of `nodes`; long chains name their first
/// ops and how many more.
pub(super) fn kernel_name(g: &Graph, index: usize, nodes: &[NodeIndex]) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for op in nodes.iter().map(|&n| g.g[n].op.name()) {
        if parts.last() != Some(&op) {
            parts.push(op);
        }
    }
    let shown = parts.len().min(4);
    let mut name = format!("k{index}_{}", parts[..shown].join("_"));
    if parts.len() > shown {
        name.push_str(&format!("_and{}", parts.len() - shown));
    }
    name
}

/// [`fuse_with`] with every optimisation on and the default buckets.
pub fn fuse(g: &Graph) -> Program {
    fuse_with(g, &LowerOptions::default())
}

/// The graph cut into kernels, with the optimisations `opts` leaves on.
pub fn fuse_with(g: &Graph, opts: &LowerOptions) -> Program {
    let mut f = Fuser {
        g,
        opts,
        group: HashMap::new(),
        chains: Vec::new(),
        buffers: Vec::new(),
        buffer_of: HashMap::new(),
        outputs: g.outputs.iter().map(|(_, v)| *v).collect(),
        cast_into: HashMap::new(),
        absorbed: Default::default(),
        summed: Default::default(),
        position: HashMap::new(),
        deferred: HashMap::new(),
    };
    let order = g.topo_order();
    f.position = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    f.form_chains();
    let mut kernels = Vec::new();
    // Sources first: they are buffers before any kernel runs.
    for &n in &order {
        let kind = match &g.g[n].op {
            Op::Input(_) => BufKind::Input,
            Op::Param(_) => BufKind::Param,
            Op::State(_) => BufKind::State,
            _ => continue,
        };
        f.store(Value { node: n, port: 0 }, kind);
    }
    for &n in &order {
        match f.class(n) {
            FusionClass::Source => {}
            FusionClass::Scalar => {
                let v = Value { node: n, port: 0 };
                if f.outputs.contains(&v) {
                    f.materialise_scalar(v, &mut kernels);
                }
            }
            FusionClass::View => {
                // Views are read in place, except by a graph output.
                let v = Value { node: n, port: 0 };
                if f.outputs.contains(&v) {
                    f.materialise(v, &mut kernels);
                }
            }
            FusionClass::Elementwise => {
                if f.absorbed_cast(n).is_some() || f.absorbed.contains(&f.group[&n]) {
                    continue;
                }
                let chain = f.chains[f.group[&n]].clone();
                if chain.last() == Some(&n) {
                    // Run by the norm that reads it, where one can.
                    match f.prologue_norm(n) {
                        Some(norm) => {
                            f.deferred.insert(norm, f.group[&n]);
                        }
                        None => f.chain_kernel(&chain, &mut kernels),
                    }
                }
            }
            // Summed by the chain kernel that stores its input.
            FusionClass::Kernel if f.summed.contains(&n) => {}
            FusionClass::Kernel if f.deferred.contains_key(&n) => {
                f.prologue_kernel(n, &mut kernels);
            }
            FusionClass::Kernel
                if matches!(g.g[n].op, Op::MatMul(_)) && f.gemm_fold(n).is_some() =>
            {
                f.gemm_kernel(n, &mut kernels);
            }
            FusionClass::Kernel => f.op_kernel(n, &mut kernels),
        }
    }
    let kernels = match opts.on(Optimisation::GroupKernels) {
        true => {
            let casts = super::groups::group_param_casts(g, &f.buffers, kernels);
            super::groups::group_optimizer_updates(g, casts)
        }
        false => kernels,
    };
    let kernels = number(super::buckets::bucket_collectives(
        g,
        &f.buffers,
        kernels,
        opts.bucket_bytes,
    ));
    let mut program = Program {
        buffers: f.buffers,
        kernels,
        gemm_pads: Default::default(),
    };
    super::pitch::pad_rows(g, &mut program);
    super::pitch::pad_gemm_sizes(g, &mut program);
    // Checked in every build, as the graph is after every pass: the check is
    // linear in the kernels' slots, and a broken program would otherwise
    // surface as a wrong result or a fault on the GPU.
    if let Err(problems) = program.verify() {
        panic!(
            "internal error: the kernel program is invalid after fusion; this is a bug in fusec, \
             please report it with the model file:\n{}",
            problems.join("\n")
        );
    }
    program
}

/// Names lead with the launch position (`k12_add_gelu`), whatever moved.
fn number(mut kernels: Vec<Kernel>) -> Vec<Kernel> {
    for (i, k) in kernels.iter_mut().enumerate() {
        let rest = match k.name.split_once('_') {
            Some((head, rest)) if head.starts_with('k') && head[1..].parse::<usize>().is_ok() => {
                rest.to_string()
            }
            _ => k.name.clone(),
        };
        k.name = format!("k{i}_{rest}");
    }
    kernels
}

impl Fuser<'_> {
    /// A kernel of op `n` alone (with a norm backward's residual add, and
    /// widening casts of its results stored as it stores them).
    fn op_kernel(&mut self, n: NodeIndex, kernels: &mut Vec<Kernel>) {
        let mut ins = Vec::new();
        let mut views = Vec::new();
        for x in self.g.inputs(n) {
            let (b, v) = self.op_input(x, n, kernels);
            ins.push(b);
            views.push(v);
        }
        let mut nodes = vec![n];
        // A norm backward's dx plus the residual stream's gradient.
        let residual = self.residual_add(n);
        let outs: Vec<usize> = (0..self.g.g[n].outputs.len())
            .map(|port| {
                let v = Value { node: n, port };
                if let (0, Some((add, _))) = (port, residual) {
                    nodes.push(add);
                    return self.store(Value { node: add, port: 0 }, BufKind::Temp);
                }
                match self.cast_into.get(&v) {
                    Some(&c) => {
                        nodes.push(c);
                        self.store(Value { node: c, port: 0 }, BufKind::Temp)
                    }
                    None => self.store(v, BufKind::Temp),
                }
            })
            .collect();
        let mut residual_slot = None;
        if let Some((add, other)) = residual {
            self.absorbed.insert(self.group[&add]);
            ins.push(self.buffer_of[&self.base(other).0]);
            views.push(None);
            residual_slot = Some(ins.len() - 1);
        }
        kernels.push(Kernel {
            name: kernel_name(self.g, kernels.len(), &nodes),
            nodes,
            inputs: ins,
            outputs: outs,
            input_views: views,
            residual: residual_slot,
            prologue: None,
            body: Body::Op(n),
        });
    }

    /// How an op kernel reads `x`: a reshape of a stored buffer is the
    /// buffer itself (same elements, same order); a GEMM reads a transposed
    /// matrix in place; anything else is copied out first.
    fn op_input(
        &mut self,
        x: Value,
        n: NodeIndex,
        kernels: &mut Vec<Kernel>,
    ) -> (usize, Option<View>) {
        if let Some(&b) = self.buffer_of.get(&x) {
            return (b, None);
        }
        let (base, _) = self.base(x);
        if self.class(base.node) != FusionClass::Scalar && !self.needs_copy(x) {
            if let Some(&b) = self.buffer_of.get(&base) {
                let view = self.view_of(x);
                if view.is_contiguous() {
                    return (b, None);
                }
                if matches!(self.g.g[n].op, Op::MatMul(_)) && is_transposed_matrix(&view) {
                    return (b, Some(view));
                }
                // Attention reads q, k, v, o and dO with any strides: heads
                // straight out of the fused QKV projection, no copies.
                if matches!(self.g.g[n].op, Op::Attention(_) | Op::AttentionGrad(_))
                    && view.strides.last().is_some_and(|s| s.is_one())
                {
                    return (b, Some(view));
                }
            }
        }
        (self.materialise(x, kernels), None)
    }

    fn materialise_scalar(&mut self, x: Value, kernels: &mut Vec<Kernel>) -> usize {
        let e = self.scalar_expr(x).expect("a scalar");
        self.fill(x, e, kernels)
    }

    /// A kernel storing `e` into every element of `x`.
    fn fill(&mut self, x: Value, e: PExpr, kernels: &mut Vec<Kernel>) -> usize {
        let out = self.store(x, BufKind::Temp);
        kernels.push(Kernel {
            name: format!("k{}_fill", kernels.len()),
            nodes: vec![x.node],
            inputs: vec![],
            outputs: vec![out],
            input_views: Vec::new(),
            residual: None,
            prologue: None,
            body: Body::Pointwise(Pointwise {
                n: self.g.ty(x).numel(),
                exprs: vec![e],
                stores: vec![(0, 0)],
                sum: None,
            }),
        });
        out
    }
}
