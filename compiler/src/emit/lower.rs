//! How an op becomes code. Every op implements [`Lower`] in its own module
//! (`ops/*`), beside its `OpDef`: what fusion does with it, and, for an op
//! that runs as a kernel of its own, the kernel's launch shape and CUDA C
//! (written inline, or an instance of a `kernels/` template). Fusion and
//! the emitter ask the op (`Op::lower`); neither holds a list of ops.

use super::templates::{Ctx, Shape};
use crate::ir::{Dim, Graph};
use petgraph::stable_graph::NodeIndex;

/// What fusion does with an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusionClass {
    /// An input, parameter or state: stored before the step.
    Source,
    /// A constant or a symbolic size: folded into the kernels that read it,
    /// never stored.
    Scalar,
    /// Another way of reading its input's elements: read in place as a
    /// strided view, no kernel of its own.
    View,
    /// One output element from the same element of each input: fuses into
    /// chains (a pointwise kernel computes the chain per element).
    Elementwise,
    /// A kernel of its own: a library call, a generated loop or a template
    /// instance (see the methods below), possibly with elementwise work
    /// folded in (GEMM epilogues).
    Kernel,
}

pub trait Lower {
    fn class(&self) -> FusionClass {
        FusionClass::Kernel
    }

    /// The launch shape of the op's own generated kernel, or `None` where
    /// it has none (a library call, or not generated at these sizes).
    fn shape(&self, _g: &Graph, _n: NodeIndex) -> Option<Shape> {
        None
    }

    /// The length `C` of a row for a row kernel: the last axis of input 0
    /// unless the op says otherwise.
    fn row_length(&self, g: &Graph, n: NodeIndex) -> Dim {
        super::templates::row_length_of(g, n)
    }

    /// The body of the op's loop, over `row` (a `Shape::Rows` kernel, with
    /// `C` its length) or over element `i` (`Shape::Elements`); the emitter
    /// closes it in the loop, and a group kernel runs it over each chunk of
    /// a member.
    fn loop_body(&self, _g: &Graph, _c: &Ctx, _n: NodeIndex) -> Option<String> {
        None
    }

    /// A whole kernel body with its own loop structure (template
    /// instances), used in place of the loop where it is `Some`.
    fn kernel_body(&self, _g: &Graph, _c: &Ctx, _n: NodeIndex) -> Option<String> {
        None
    }

    /// `__launch_bounds__`'s arguments for the kernel `kernel_body` writes,
    /// where it needs them (a register budget that buys occupancy).
    fn launch_bounds(&self, _g: &Graph, _n: NodeIndex) -> Option<String> {
        None
    }

    /// The piece of its parameter an update runs on (ZeRO stage 1; `None`:
    /// all of it, and for every op that is not an update).
    fn update_range(&self) -> Option<(i64, i64)> {
        None
    }

    /// Whether an update reads and writes its f32 master piece (indexed as
    /// its state) rather than the parameter (ZeRO with a 16-bit compute
    /// dtype; `false` for every op that is not such an update).
    fn update_master(&self) -> bool {
        false
    }

    /// Device-global storage the kernel keeps between its blocks, written
    /// at file scope before it.
    fn file_scope(&self, _g: &Graph, _c: &Ctx, _n: NodeIndex) -> Option<String> {
        None
    }
}
