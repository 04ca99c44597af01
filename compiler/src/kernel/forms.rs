//! Which specialised kernel forms an op takes at its shape: facts fusion
//! decides by (what a chain may fold into) and the emitter writes by, kept
//! here so that fusion need not ask the emitter.

use crate::ir::types::DType;
use crate::ir::Graph;
use crate::ops::{Op, ReduceKind};
use petgraph::stable_graph::NodeIndex;

/// Most 8-feature chunks a lane of the one-warp-a-row norms holds (4: rows
/// of up to 1024 features; kernels/norm.cuh).
pub(crate) const NORM_CHUNKS: i64 = 4;

/// A sum or mean over the leading axes (a bias gradient, the column sums
/// of kernels/column_sum.cuh): its column count and whether it is a mean.
pub(crate) fn leading_sum(g: &Graph, n: NodeIndex) -> Option<(i64, bool)> {
    let Op::Reduce(r) = &g.g[n].op else {
        return None;
    };
    let leading = r.axes.iter().enumerate().all(|(i, &a)| i == a);
    let cols = g.g[n].outputs[0].numel().as_const()?;
    (leading && matches!(r.kind, ReduceKind::Sum | ReduceKind::Mean) && cols > 0)
        .then_some((cols, r.kind == ReduceKind::Mean))
}

/// The row length where a norm's forward runs one warp a row (16-bit rows
/// of up to 1024 features, a multiple of 8).
pub(crate) fn norm_forward_rows(g: &Graph, n: NodeIndex) -> Option<i64> {
    if !matches!(g.g[n].op, Op::LayerNorm(_) | Op::RmsNorm(_)) {
        return None;
    }
    let x = g.ty(g.inputs(n)[0]);
    let c = x.shape.last()?.as_const()?;
    (matches!(x.dtype, DType::BF16 | DType::F16)
        && g.g[n].outputs[0].dtype == x.dtype
        && c > 0
        && c % 8 == 0
        && (c + 255) / 256 <= NORM_CHUNKS)
        .then_some(c)
}
