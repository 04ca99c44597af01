//! CUDA C for convolution and its gradients, NHWC (`ops/conv.rs`): one
//! thread per output element, each summing over its taps in a fixed order
//! in f32, so every result is deterministic and needs no atomics. Direct
//! loops, not implicit GEMM: correct first, fast later.

use super::attention::Access;
use super::lower::Lower;
use super::templates::{Ctx, Shape};
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
/// brace); `None` for other ops.
pub(crate) fn kernel_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let ins = g.inputs(n);
    let out = &g.g[n].outputs[0].shape;
    let (about, x_shape, w_shape, y_shape, stride, pad) = match &g.g[n].op {
        Op::Conv2d(o) => (
            "conv2d (NHWC): y[b, oy, ox, co] = sum over ky, kx, ci of x[b, oy*stride + ky - pad, ox*stride + kx - pad, ci] * w[ky, kx, ci, co]",
            g.ty(ins[0]).shape.clone(),
            g.ty(ins[1]).shape.clone(),
            out.clone(),
            o.stride,
            o.padding,
        ),
        Op::Conv2dGradInput(o) => (
            "conv2d input gradient: dx[b, iy, ix, ci] = sum over the outputs whose window covers (iy, ix) of dy[b, oy, ox, co] * w[ky, kx, ci, co]",
            out.clone(),
            g.ty(ins[1]).shape.clone(),
            g.ty(ins[0]).shape.clone(),
            o.stride,
            o.padding,
        ),
        Op::Conv2dGradWeight(o) => (
            "conv2d weight gradient: dw[ky, kx, ci, co] = sum over b, oy, ox of x[b, iy, ix, ci] * dy[b, oy, ox, co]",
            g.ty(ins[0]).shape.clone(),
            out.clone(),
            g.ty(ins[1]).shape.clone(),
            o.stride,
            o.padding,
        ),
        _ => return None,
    };
    let mut b = String::new();
    let _ = writeln!(b, "    // {about}; one thread per output element.");
    let _ = writeln!(
        b,
        "    const fs_i64 batch = {}, in_h = {}, in_w = {}, c_in = {};",
        x_shape[0].to_c(),
        x_shape[1].to_c(),
        x_shape[2].to_c(),
        x_shape[3].to_c()
    );
    let _ = writeln!(
        b,
        "    const fs_i64 k_h = {}, k_w = {}, out_h = {}, out_w = {}, c_out = {};",
        w_shape[0].to_c(),
        w_shape[1].to_c(),
        y_shape[1].to_c(),
        y_shape[2].to_c(),
        y_shape[3].to_c()
    );
    let _ = writeln!(
        b,
        "    const fs_i64 stride = {stride}, pad = {pad}, n = {};",
        g.g[n].outputs[0].numel().to_c()
    );
    let _ = writeln!(
        b,
        "    for (fs_i64 i = (fs_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (fs_i64)gridDim.x * blockDim.x) {{"
    );
    let x = "b, iy, ix, ci";
    let w = "ky, kx, ci, co";
    let y = "b, oy, ox, co";
    let input = |k: usize, coords: &str| {
        let a = Access::input(g, c, n, k);
        let cs: Vec<&str> = coords.split(", ").collect();
        a.load(&a.at(&cs))
    };
    let result = Access::output(g, c, n, 0);
    let body = match &g.g[n].op {
        Op::Conv2d(_) => format!(
            "        const fs_i64 co = i % c_out, ox = (i / c_out) % out_w, oy = (i / (c_out * out_w)) % out_h, b = i / (c_out * out_w * out_h);
        float acc = 0.0f;
        for (fs_i64 ky = 0; ky < k_h; ++ky) {{
            const fs_i64 iy = oy * stride + ky - pad;
            if (iy < 0 || iy >= in_h) continue;  // zero padding
            for (fs_i64 kx = 0; kx < k_w; ++kx) {{
                const fs_i64 ix = ox * stride + kx - pad;
                if (ix < 0 || ix >= in_w) continue;
                for (fs_i64 ci = 0; ci < c_in; ++ci) acc += {} * {};
            }}
        }}
",
            input(0, x),
            input(1, w)
        ),
        // Output (oy, ox) reads input row oy*stride + ky - pad, so input row
        // iy is read by tap ky from output row (iy + pad - ky) / stride when
        // that divides exactly.
        Op::Conv2dGradInput(_) => format!(
            "        const fs_i64 ci = i % c_in, ix = (i / c_in) % in_w, iy = (i / (c_in * in_w)) % in_h, b = i / (c_in * in_w * in_h);
        float acc = 0.0f;
        for (fs_i64 ky = 0; ky < k_h; ++ky) {{
            const fs_i64 ty = iy + pad - ky, oy = ty / stride;
            if (ty < 0 || ty % stride != 0 || oy >= out_h) continue;
            for (fs_i64 kx = 0; kx < k_w; ++kx) {{
                const fs_i64 tx = ix + pad - kx, ox = tx / stride;
                if (tx < 0 || tx % stride != 0 || ox >= out_w) continue;
                for (fs_i64 co = 0; co < c_out; ++co) acc += {} * {};
            }}
        }}
",
            input(0, y),
            input(1, w)
        ),
        _ => format!(
            "        const fs_i64 co = i % c_out, ci = (i / c_out) % c_in, kx = (i / (c_out * c_in)) % k_w, ky = i / (c_out * c_in * k_w);
        float acc = 0.0f;
        for (fs_i64 b = 0; b < batch; ++b) {{
            for (fs_i64 oy = 0; oy < out_h; ++oy) {{
                const fs_i64 iy = oy * stride + ky - pad;
                if (iy < 0 || iy >= in_h) continue;  // zero padding
                for (fs_i64 ox = 0; ox < out_w; ++ox) {{
                    const fs_i64 ix = ox * stride + kx - pad;
                    if (ix < 0 || ix >= in_w) continue;
                    acc += {} * {};
                }}
            }}
        }}
",
            input(0, x),
            input(1, y)
        ),
    };
    b.push_str(&body);
    let _ = writeln!(b, "        {}\n    }}", result.store("i", "acc"));
    Some(b)
}

macro_rules! conv_lowering {
    ($($op:ident),*) => {$(
        /// Direct convolution loops.
        impl Lower for crate::ops::$op {
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
