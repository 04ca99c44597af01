//! The norms (layernorm and RMSNorm) one warp per row, for 16-bit rows of
//! up to 1024 features (every transformer width up to 1024), as calls of
//! kernels/norm.cuh's templates: where they apply, the launch shapes, and
//! the wrappers. A lane holds its features of the row in registers, read
//! once with 16-byte loads; the statistics come from warp shuffles; the
//! backward sums its parameter gradients over each group of rows as it
//! goes, so they need no second pass over the rows (see the header).
//!
//! The general kernel (templates.rs) reads x six times per row and walks
//! each group's rows again for the parameter gradients; on an H200 it ran
//! GPT-2's [16384, 768] layernorm backward in 174 us, about 8x its bytes.

use super::cuda::float_lit;
use super::templates::{element, Ctx};
use crate::ir::types::DType;
use crate::ir::Graph;
use crate::ops::{Op, NORM_GROUPS};
use petgraph::stable_graph::NodeIndex;

use crate::kernel::forms::norm_forward_rows;
use crate::kernel::forms::NORM_CHUNKS as CHUNKS;

/// The row length, where this kernel runs the op.
pub(crate) fn applies(g: &Graph, n: NodeIndex) -> Option<i64> {
    if !matches!(g.g[n].op, Op::LayerNormGrad(_) | Op::RmsNormGrad(_)) {
        return None;
    }
    let ins = g.inputs(n);
    let x = g.ty(ins[0]);
    let dy = g.ty(ins[2]);
    let sixteen = |d: DType| matches!(d, DType::BF16 | DType::F16);
    let c = x.shape.last()?.as_const()?;
    (sixteen(x.dtype)
        && dy.dtype == x.dtype
        && g.g[n].outputs[0].dtype == x.dtype
        && c > 0
        && c % 8 == 0
        && (c + 255) / 256 <= CHUNKS)
        .then_some(c)
}

/// Threads of a block (the plan's): a row of dbeta sums in shared memory
/// for each warp of them (each thread on the host, where a warp is one).
const BLOCK: u64 = super::templates::BLOCK;

/// Two blocks an SM: ptxas holds the kernel to 128 registers. A lane's x,
/// dy and its columns' dgamma and dbeta sums took 168 registers, one block
/// of 8 warps an SM, and BERT-large's [16384, 1024] backward ran at a third
/// of the copy bandwidth (76 us on an H200); with dbeta's sums in shared
/// memory it fits in 128 without spilling.
pub(crate) fn backward_bounds(g: &Graph, n: NodeIndex) -> Option<String> {
    applies(g, n).map(|_| format!("{BLOCK}, 2"))
}

/// The include of kernels/norm.cuh, where the op runs there.
/// And the Philox draws' where the kernel's prologue drops.
pub(crate) fn file_scope(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    if applies(g, n).is_none() && norm_forward_rows(g, n).is_none() {
        return None;
    }
    let drops = c.k.prologue.as_ref().is_some_and(|pro| {
        pro.chain
            .exprs
            .iter()
            .any(|e| matches!(e, crate::kernel::PExpr::Dropout { .. }))
    });
    Some(match drops {
        true => "#include \"norm.cuh\"\n#include \"random/philox.cuh\"\n\n".to_string(),
        false => "#include \"norm.cuh\"\n\n".to_string(),
    })
}

/// The rows of the op's input 0 (every axis but the last), as C.
fn rows_c(g: &Graph, n: NodeIndex) -> Option<String> {
    let shape = &g.ty(g.inputs(n)[0]).shape;
    Some(
        shape[..shape.len() - 1]
            .iter()
            .try_fold(crate::ir::Dim::constant(1), |a, d| a.checked_mul(d))?
            .to_c(),
    )
}

/// The kernel's body, a call of kernels/norm.cuh's `fs_norm_backward`, or
/// `None` where its buffers do not allow it (padded rows, an input read
/// through a view, a residual of another dtype).
pub(crate) fn kernel_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let cols = applies(g, n)?;
    let unpadded =
        c.k.inputs
            .iter()
            .chain(&c.k.outputs)
            .all(|&b| c.p.buffers[b].pitch.is_none() && c.p.buffers[b].zero_rows == 0);
    let plain = c.k.input_views.iter().all(|v| v.is_none());
    let residual = c.k.residual;
    if !unpadded
        || !plain
        || residual.is_some_and(|r| c.p.buffers[c.k.inputs[r]].ty.dtype != c.in_dt(0))
    {
        return None;
    }
    let layer = matches!(g.g[n].op, Op::LayerNormGrad(_));
    let eps = match &g.g[n].op {
        Op::LayerNormGrad(l) => float_lit(l.eps),
        Op::RmsNormGrad(r) => float_lit(r.eps),
        _ => return None,
    };
    let rows = rows_c(g, n)?;
    let (x, gamma, dy) = (c.ins[0], c.ins[1], c.ins[2]);
    let res = residual.map_or("nullptr".to_string(), |r| format!("in{r}"));
    let dbeta = match layer {
        true => format!("out{}", c.outs.get(2).copied().unwrap_or(2)),
        false => "nullptr".to_string(),
    };
    Some(format!(
        "    // One warp a row (kernels/norm.cuh): dx, and the parameter gradients' partials by {NORM_GROUPS} groups of rows.
    fs_norm_backward<{t}, {g}, {cols}, {layer}, {has_res}, {BLOCK}, {NORM_GROUPS}>(in{x}, in{gamma}, in{dy}, {res},
        out{o0}, out{o1}, {dbeta}, {rows}, {eps});
",
        t = element(c.in_dt(0)),
        g = element(c.in_dt(1)),
        has_res = residual.is_some(),
        o0 = c.outs[0],
        o1 = c.outs[1],
    ))
}

/// Blocks of the one-warp-a-row forward: 8 warps each, 16384 rows in
/// flight (GPT-2 at B = 16 in one pass); more rows loop.
pub(crate) const FORWARD_BLOCKS: i64 = 2048;

/// The forward norm one warp a row, a call of kernels/norm.cuh's
/// `fs_norm_forward` reading its stored input.
pub(crate) fn forward_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let cols = norm_forward_rows(g, n)?;
    if let Some(pro) = &c.k.prologue {
        return prologue_forward(g, c, n, cols, pro);
    }
    let plain = c.k.input_views.iter().all(|v| v.is_none())
        && [c.k.inputs[c.ins[0]], c.k.outputs[c.outs[0]]]
            .iter()
            .all(|&b| c.p.buffers[b].pitch.is_none() && c.p.buffers[b].zero_rows == 0)
        && c.out_dt(0) == c.in_dt(0);
    if !plain {
        return None;
    }
    let (layer, eps) = match &g.g[n].op {
        Op::LayerNorm(l) => (true, float_lit(l.eps)),
        Op::RmsNorm(r) => (false, float_lit(r.eps)),
        _ => return None,
    };
    let t = element(c.in_dt(0));
    let (beta_t, beta) = match layer {
        true => (element(c.in_dt(2)), format!("in{}", c.ins[2])),
        false => (element(c.in_dt(1)), "nullptr".to_string()),
    };
    Some(format!(
        "    // One warp a row (kernels/norm.cuh).
    fs_norm_forward<{t}, {g}, {beta_t}, {cols}, {layer}>(fs_norm_stored<{t}, {cols}>{{in{x}}}, in{gamma}, {beta},
        out{o}, {rows}, {eps});
",
        g = element(c.in_dt(1)),
        x = c.ins[0],
        gamma = c.ins[1],
        o = c.outs[0],
        rows = rows_c(g, n)?,
    ))
}

/// The norm's type parameters and arguments after its row loader: (the
/// element, gamma's and beta's types, beta's argument).
fn norm_params(
    g: &Graph,
    c: &Ctx,
    n: NodeIndex,
    layer: bool,
) -> (&'static str, &'static str, &'static str, String) {
    let t = element(g.ty(g.inputs(n)[0]).dtype);
    let gamma = element(c.in_dt(1));
    match layer {
        true => (t, gamma, element(c.in_dt(2)), format!("in{}", c.ins[2])),
        false => (t, gamma, gamma, "nullptr".to_string()),
    }
}

/// The forward norm running its kernel's prologue chain as it loads each
/// row's 8 features at a time (`cuda::vector_elements`), storing the
/// chain's value where the kernel keeps it, and normalising it as stored.
fn prologue_forward(
    g: &Graph,
    c: &Ctx,
    n: NodeIndex,
    cols: i64,
    pro: &crate::kernel::Prologue,
) -> Option<String> {
    if c.p.buffers[c.k.outputs[c.outs[0]]].pitch.is_some() || c.out_dt(0) != pro.dtype {
        return None;
    }
    let (layer, eps) = match &g.g[n].op {
        Op::LayerNorm(l) => (true, float_lit(l.eps)),
        Op::RmsNorm(r) => (false, float_lit(r.eps)),
        _ => return None,
    };
    let (t, gamma_t, beta_t, beta) = norm_params(g, c, n, layer);
    let ind = "        ";
    let value = super::cuda::rounded(pro.dtype, &format!("v{}", pro.value));
    let mut b = format!(
        "    // One warp a row (kernels/norm.cuh), each row's 8 features at a time computed by the chain before the norm as they are loaded{}.
    auto load_row = [&](fs_i64 r, int j0, float* v) {{
{ind}const fs_i64 i0 = r * {cols} + j0;
",
        if pro.chain.stores.is_empty() { "" } else { ", and stored" }
    );
    b.push_str(&super::cuda::vector_elements(
        c.p,
        c.k,
        &pro.chain,
        8,
        ind,
        &format!("v[e] = {value};"),
    ));
    for (slot, _) in &pro.chain.stores {
        b.push_str(&format!("{ind}fs_vstore(&out{slot}[i0], s{slot});\n"));
    }
    b.push_str(&format!(
        "    }};
    fs_norm_forward<{t}, {gamma_t}, {beta_t}, {cols}, {layer}>(load_row, in{gamma}, {beta},
        out{o}, {rows}, {eps});
",
        gamma = c.ins[1],
        o = c.outs[0],
        rows = rows_c(g, n)?,
    ));
    Some(b)
}
