//! The kernel of one op that is not an elementwise chain. Each op writes
//! its own kernel's body in its lowering (`ops::Lower`, beside the op);
//! this file wraps that body in the kernel's signature and loop (a block a
//! row, grid-stride over the rows, or a thread an element), and holds what
//! those bodies share: the row statistics of the norms and the softmax, the
//! cross-entropy row, row groups for parameter gradients, the launch shapes
//! and grid. Every such kernel is checked against its op's CPU reference by
//! `tests/cuda_host.rs`.

use super::cuda::{header, load, store};
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::kernel::{Kernel, Program};

use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

/// How a template kernel is launched.
#[derive(Clone, Debug, PartialEq)]
pub enum Shape {
    /// One thread per element.
    Elements(Dim),
    /// One block per row.
    Rows(Dim),
    /// One block for the whole job (a reduction to a scalar).
    Single,
}

/// The op's inputs and outputs as kernel parameters: `ins[i]` is the kernel
/// input slot of the op's input `i` (the identity for a one-op kernel).
pub struct Ctx<'a> {
    pub(crate) p: &'a Program,
    pub(crate) k: &'a Kernel,
    pub(crate) ins: Vec<usize>,
    pub(crate) outs: Vec<usize>,
}

impl<'a> Ctx<'a> {
    /// A kernel that is one op: its slots are the op's inputs and outputs
    /// in order.
    /// Where the kernel's prologue computes the op's input 0, the op's
    /// other inputs are its first slots and `ins[0]` names none (only the
    /// body that runs the prologue reads it, through the prologue).
    pub(crate) fn for_op(g: &Graph, p: &'a Program, k: &'a Kernel, n: NodeIndex) -> Ctx<'a> {
        let count = g.inputs(n).len();
        let ins = match k.prologue {
            Some(_) => std::iter::once(usize::MAX).chain(0..count - 1).collect(),
            None => (0..count).collect(),
        };
        Ctx {
            p,
            k,
            ins,
            outs: (0..g.g[n].outputs.len()).collect(),
        }
    }

    pub(crate) fn in_dt(&self, i: usize) -> DType {
        self.p.buffers[self.k.inputs[self.ins[i]]].ty.dtype
    }
    pub(crate) fn out_dt(&self, i: usize) -> DType {
        self.p.buffers[self.k.outputs[self.outs[i]]].ty.dtype
    }
    pub(crate) fn ld(&self, i: usize, idx: &str) -> String {
        load(self.in_dt(i), &format!("in{}[{idx}]", self.ins[i]))
    }
    pub(crate) fn st(&self, o: usize, idx: &str, v: &str) -> String {
        format!("out{}[{idx}] = {};", self.outs[o], store(self.out_dt(o), v))
    }
    /// The element type (kernels/elements.cuh) of input `i`, for a template.
    pub(crate) fn in_el(&self, i: usize) -> &'static str {
        element(self.in_dt(i))
    }
    /// The element type of output `o`, for a template.
    pub(crate) fn out_el(&self, o: usize) -> &'static str {
        element(self.out_dt(o))
    }
    /// Input `i`'s kernel parameter, as a template's pointer argument.
    pub(crate) fn in_ptr(&self, i: usize) -> String {
        format!("in{}", self.ins[i])
    }
    /// Output `o`'s kernel parameter.
    pub(crate) fn out_ptr(&self, o: usize) -> String {
        format!("out{}", self.outs[o])
    }
}

/// The element type a template takes for a buffer of `dt` (kernels/elements.cuh).
pub(crate) fn element(dt: DType) -> &'static str {
    match dt {
        DType::BF16 => "fs_el::Bf16",
        DType::F16 => "fs_el::F16",
        _ => "fs_el::F32",
    }
}

pub(crate) fn numel(d: &[Dim]) -> Dim {
    d.iter()
        .try_fold(Dim::constant(1), |a, x| a.checked_mul(x))
        .unwrap_or_default()
}

/// Threads per block of every generated kernel.
pub const BLOCK: u64 = 256;

/// Grid size for a launch shape: one block per row, or enough blocks for one
/// thread per element, capped (the loops stride over the rest).
pub fn grid(shape: &Shape, env: &dyn Fn(&str) -> Option<i64>) -> Option<u64> {
    let cap = 1u64 << 20;
    Some(match shape {
        Shape::Rows(r) => (r.eval(env)? as u64).clamp(1, cap),
        Shape::Elements(n) => (n.eval(env)? as u64).div_ceil(BLOCK).clamp(1, cap),
        Shape::Single => 1,
    })
}

/// The kernel's launch shape, for ops that have a generated kernel.
pub fn shape_of(g: &Graph, n: NodeIndex) -> Option<Shape> {
    super::lower::of(&g.g[n].op).shape(g, n)
}

/// A thread an element of the op's (first) result.
pub(crate) fn per_element(g: &Graph, n: NodeIndex) -> Shape {
    Shape::Elements(g.g[n].outputs[0].numel())
}

/// The rows of a row kernel over input 0: every axis but the last.
pub(crate) fn rows_of(g: &Graph, n: NodeIndex) -> Dim {
    let s = &g.ty(g.inputs(n)[0]).shape;
    numel(&s[..s.len().saturating_sub(1)])
}

/// The length of a row of input 0: its last axis.
pub(crate) fn row_length_of(g: &Graph, n: NodeIndex) -> Dim {
    let ins = g.inputs(n);
    ins.first()
        .and_then(|&x| g.ty(x).shape.last().cloned())
        .unwrap_or(Dim::constant(1))
}

/// A ZeRO update not in place: the parameter's elements outside the piece
/// copied through, by the thread of the piece's first element (the plan
/// always updates in place, where this does nothing).
pub(crate) fn pass_through(
    b: &mut String,
    c: &Ctx,
    g: &Graph,
    n: NodeIndex,
    range: Option<(i64, i64)>,
) {
    if let Some((lo, hi)) = range {
        let total = g.g[n].outputs[0].numel().to_c();
        let (o, x) = (c.outs[0], c.ins[0]);
        let _ = writeln!(
            b,
            "        if (i == 0 && (const void*)out{o} != (const void*)in{x}) {{ for (fs_i64 k = 0; k < {lo}LL; ++k) out{o}[k] = in{x}[k]; for (fs_i64 k = {hi}LL; k < {total}; ++k) out{o}[k] = in{x}[k]; }}"
        );
    }
}

pub fn op_kernel(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    n: NodeIndex,
    source: Option<&str>,
) -> Option<String> {
    let c = Ctx::for_op(g, p, k, n);
    let mut s = header(g, p, k, source);
    // Device-global storage some templates keep between their blocks goes
    // before the kernel (after the prelude's include).
    if let Some(decls) = super::lower::of(&g.g[n].op).file_scope(g, &c, n) {
        let at = s.find("extern \"C\"")?;
        s.insert_str(at, &decls);
    }
    // Template instances have their own loop structure.
    let body = super::lower::of(&g.g[n].op).kernel_body(g, &c, n);
    let body = match body {
        Some(b) => {
            if let Some(bounds) = super::lower::of(&g.g[n].op).launch_bounds(g, n) {
                s = s.replacen(
                    "__global__ void ",
                    &format!("__global__ void __launch_bounds__({bounds}) "),
                    1,
                );
            }
            b
        }
        None => op_loop(g, &c, n)?,
    };
    s.push_str(&body);
    s.push_str("}\n");
    Some(s)
}

/// The body of one op's loop: over `row` (with `C` its length) for row
/// ops, over element `i` for element ops; `op_loop` closes it in its loop,
/// and a group kernel runs it over each chunk of a member.
pub(crate) fn op_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    super::lower::of(&g.g[n].op).loop_body(g, c, n)
}

/// The loop (rows or elements) and body of one op, closed.
pub(crate) fn op_loop(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let shape = shape_of(g, n)?;
    let body = op_body(g, c, n)?;
    let mut s = String::new();
    match shape {
        Shape::Rows(rows) => {
            let _ = writeln!(s, "    const fs_i64 rows = {};", rows.to_c());
            let cols = super::lower::of(&g.g[n].op).row_length(g, n);
            let _ = writeln!(s, "    const fs_i64 C = {};", cols.to_c());
            let _ = writeln!(
                s,
                "    for (fs_i64 row = blockIdx.x; row < rows; row += gridDim.x) {{"
            );
        }
        Shape::Single => {
            let _ = writeln!(s, "    if (blockIdx.x == 0) {{");
        }
        Shape::Elements(n) => {
            let _ = writeln!(s, "    const fs_i64 n = {};", n.to_c());
            let _ = writeln!(
                s,
                "    for (fs_i64 i = (fs_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (fs_i64)gridDim.x * blockDim.x) {{"
            );
        }
    }
    s.push_str(&body);
    s.push_str("    }\n");
    Some(s)
}
