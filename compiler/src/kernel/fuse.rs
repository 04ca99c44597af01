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

mod chains;
mod epilogues;
mod materialise;
mod ops;
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
            let updates = super::groups::group_optimizer_updates(g, casts);
            let sums = super::groups::group_adjacent_sums(g, updates);
            let writes = super::groups::group_cache_writes(g, sums);
            super::groups::group_elementwise(g, writes)
        }
        false => kernels,
    };
    let kernels = super::buckets::bucket_collectives(g, &f.buffers, kernels, opts.bucket_bytes);
    let kernels = number(super::gathers::prefetch_gathers(g, kernels));
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
