//! How an op that runs as a kernel of its own becomes CUDA C: its launch
//! shape and its loop body or whole kernel (written here, or an instance
//! of a `kernels/` template). The op set (`ops/`) says what an op means and
//! what fusion does with it (`OpDef::class`); this module and the files
//! under it say how it is written, one `Lower` impl per op family, so that
//! `ops/` holds no CUDA (each unary function's expression, which fused
//! chains write inline, is in `emit::unary`). [`of`] is the one place that maps an op to its
//! lowering: a new op is a compile error here until it has one.

mod decode;
mod elementwise;
mod nn;
mod optim;
mod shape;

pub(crate) use super::templates::{per_element, Ctx, Shape};
pub(crate) use crate::ir::{Dim, Graph};
pub(crate) use crate::ops::Op;
pub(crate) use petgraph::stable_graph::NodeIndex;

pub trait Lower {
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

    /// Device-global storage the kernel keeps between its blocks, written
    /// at file scope before it.
    fn file_scope(&self, _g: &Graph, _c: &Ctx, _n: NodeIndex) -> Option<String> {
        None
    }
}

/// An op with no kernel of its own: a source, a scalar, a view, an
/// elementwise op (fused into chains), a library call (cuBLASLt, with its
/// epilogue) or a collective (NCCL).
struct NoKernel;

impl Lower for NoKernel {}

/// How `op` is written as a kernel.
pub fn of(op: &Op) -> &dyn Lower {
    match op {
        Op::Input(_)
        | Op::Param(_)
        | Op::State(_)
        | Op::Constant(_)
        | Op::DimValue(_)
        | Op::Unary(_)
        | Op::UnaryGrad(_)
        | Op::Binary(_)
        | Op::Dropout(_)
        | Op::Reshape(_)
        | Op::Permute(_)
        | Op::Slice(_)
        | Op::Broadcast(_)
        | Op::MatMul(_)
        | Op::AllReduce(_)
        | Op::AllGather(_) => &NoKernel,
        Op::Cast(o) => o,
        Op::ClipCoef(o) => o,
        Op::Unscale(o) => o,
        Op::Reduce(o) => o,
        Op::SliceGrad(o) => o,
        Op::Concat(o) => o,
        Op::Softmax(o) => o,
        Op::SoftmaxGrad(o) => o,
        Op::LayerNorm(o) => o,
        Op::LayerNormGrad(o) => o,
        Op::RmsNorm(o) => o,
        Op::RmsNormGrad(o) => o,
        Op::Embedding(o) => o,
        Op::EmbeddingGrad(o) => o,
        Op::CrossEntropy(o) => o,
        Op::CrossEntropyGrad(o) => o,
        Op::CrossEntropyWithGrad(o) => o,
        Op::Counted(o) => o,
        Op::Rope(o) => o,
        Op::CausalMask(o) => o,
        Op::Attention(o) => o,
        Op::AttentionGrad(o) => o,
        Op::KvWrite(o) => o,
        Op::CachedAttention(o) => o,
        Op::ArgMax(o) => o,
        Op::Conv2d(o) => o,
        Op::Conv2dGradInput(o) => o,
        Op::Conv2dGradWeight(o) => o,
        Op::AdamW(o) => o,
        Op::Sgd(o) => o,
        Op::SumSquares(o) => o,
        Op::StorePiece(o) => o,
    }
}
