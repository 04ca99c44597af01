//! Multi-tensor kernels: one launch over many tensors. The global gradient
//! norm reads every gradient once, one block per fixed chunk, each block
//! writing its own partial sum (deterministic: no atomics, fixed order).

use super::templates::{Ctx, Shape};
use crate::ir::Graph;
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

pub fn shape_of(g: &Graph, n: NodeIndex) -> Option<Shape> {
    match &g.g[n].op {
        Op::SumSquares(_) => Some(Shape::Rows(g.g[n].outputs[0].shape[0].clone())),
        _ => None,
    }
}

pub(crate) fn kernel_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let Op::SumSquares(op) = &g.g[n].op else {
        return None;
    };
    let ins = g.inputs(n);
    let tys: Vec<_> = ins.iter().map(|&x| g.ty(x).clone()).collect();
    let chunks = op.chunks(&tys)?;
    let mut b = String::new();
    let rows: i64 = chunks.iter().sum();
    let _ = writeln!(
        b,
        "    // Block `row` sums the squares of one chunk of {} elements of one tensor.",
        op.chunk
    );
    let _ = writeln!(b, "    const fs_i64 rows = {rows};");
    let _ = writeln!(
        b,
        "    for (fs_i64 row = blockIdx.x; row < rows; row += gridDim.x) {{"
    );
    let _ = writeln!(b, "        float acc = 0.0f;");
    let mut first = 0i64;
    for (i, (t, &nc)) in tys.iter().zip(&chunks).enumerate() {
        let numel = t.numel().as_const().unwrap_or(0);
        let cond = if i == 0 { "if" } else { "else if" };
        let x = c.ld(i, "j");
        let _ = writeln!(
            b,
            "        {cond} (row < {}) {{  // input {i}: {numel} elements",
            first + nc
        );
        let _ = writeln!(
            b,
            "            const fs_i64 start = (row - {first}) * {}, end = start + {} < {numel} ? start + {} : {numel};",
            op.chunk, op.chunk, op.chunk
        );
        let _ = writeln!(
            b,
            "            for (fs_i64 j = start + threadIdx.x; j < end; j += blockDim.x) {{ const float x = {x}; acc += x * x; }}"
        );
        let _ = writeln!(b, "        }}");
        first += nc;
    }
    let _ = writeln!(b, "        acc = fs_block_sum(acc);");
    let _ = writeln!(b, "        if (threadIdx.x == 0) {}", c.st(0, "row", "acc"));
    let _ = writeln!(b, "    }}");
    Some(b)
}
