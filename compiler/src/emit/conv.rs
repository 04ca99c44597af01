//! CUDA C for convolution and its gradients.

use super::templates::{Ctx, Shape};
use crate::ir::Graph;
use petgraph::stable_graph::NodeIndex;

/// Launch shape of a convolution kernel; `None` for other ops.
pub fn shape_of(_g: &Graph, _n: NodeIndex) -> Option<Shape> {
    None
}

/// The kernel body (everything after the signature, before the closing
/// brace); `None` for other ops.
pub(crate) fn kernel_body(_g: &Graph, _c: &Ctx, _n: NodeIndex) -> Option<String> {
    None
}
