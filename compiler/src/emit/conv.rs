//! Convolution and its gradients, NHWC (`ops/conv.rs`), as instances of
//! `kernels/conv.cuh` (a thread an output element, direct loops).

use super::access::Access;
use super::lower::Lower;
use super::templates::{element, Ctx, Shape};
use crate::ir::Graph;
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

/// Launch shape of a convolution kernel; `None` for other ops.
pub fn shape_of(g: &Graph, n: NodeIndex) -> Option<Shape> {
    match &g.g[n].op {
        Op::Conv2d(_) | Op::Conv2dGradInput(_) | Op::Conv2dGradWeight(_) => {
            Some(Shape::Elements(g.g[n].outputs[0].numel()))
        }
        _ => None,
    }
}

/// The kernel body (everything after the signature, before the closing
/// brace): the operands as `kernels/conv.cuh`'s views, the sizes, and the
/// call; `None` for other ops.
pub(crate) fn kernel_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let ins = g.inputs(n);
    let out = &g.g[n].outputs[0].shape;
    let (call, x_shape, w_shape, y_shape, stride, pad) = match &g.g[n].op {
        Op::Conv2d(o) => (
            "forward",
            &g.ty(ins[0]).shape,
            &g.ty(ins[1]).shape,
            out,
            o.stride,
            o.padding,
        ),
        Op::Conv2dGradInput(o) => (
            "grad_input",
            out,
            &g.ty(ins[1]).shape,
            &g.ty(ins[0]).shape,
            o.stride,
            o.padding,
        ),
        Op::Conv2dGradWeight(o) => (
            "grad_weight",
            &g.ty(ins[0]).shape,
            out,
            &g.ty(ins[1]).shape,
            o.stride,
            o.padding,
        ),
        _ => return None,
    };
    let mut b = String::new();
    let _ = writeln!(
        b,
        "    // Convolution {call}, a thread an output element (kernels/conv.cuh)."
    );
    let _ = writeln!(b, "    fs_conv::Sizes s;");
    for (field, d) in [
        ("batch", &x_shape[0]),
        ("in_h", &x_shape[1]),
        ("in_w", &x_shape[2]),
        ("c_in", &x_shape[3]),
        ("k_h", &w_shape[0]),
        ("k_w", &w_shape[1]),
        ("out_h", &y_shape[1]),
        ("out_w", &y_shape[2]),
        ("c_out", &y_shape[3]),
    ] {
        let _ = writeln!(b, "    s.{field} = {};", d.to_c());
    }
    let _ = writeln!(b, "    s.stride = {stride};\n    s.pad = {pad};");
    let mut types = Vec::new();
    for (i, name) in ["a", "b"].iter().enumerate() {
        let a = Access::input(g, c, n, i);
        let e = element(a.dt);
        let _ = writeln!(b, "    const fs_conv::View<{e}> {name} = {};", a.init());
        types.push(e);
    }
    let result = Access::output(g, c, n, 0);
    types.push(element(result.dt));
    let _ = writeln!(
        b,
        "    fs_conv::{call}<{}>(a, b, {}, s);",
        types.join(", "),
        result.ptr
    );
    Some(b)
}

macro_rules! conv_lowering {
    ($($op:ident),*) => {$(
        /// Direct convolution loops.
        impl Lower for crate::ops::$op {
            fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
                Some("#include \"conv.cuh\"\n\n".to_string())
            }
            fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
                shape_of(g, n)
            }
            fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
                kernel_body(g, c, n)
            }
        }
    )*};
}

conv_lowering!(Conv2d, Conv2dGradInput, Conv2dGradWeight);
