//! The norm backwards (layernorm and RMSNorm) one warp per row, for 16-bit
//! rows of up to 1024 features (every transformer width up to 1024): a
//! lane holds its columns of x and dy in registers, read once with 16-byte
//! loads; the row's statistics and the two means the gradient needs come
//! from warp shuffles (no block barrier per row); and each lane sums its
//! columns' dgamma (in registers) and dbeta (in its warp's row of shared
//! memory) over the rows of the block's group, so the parameter gradients
//! need no second pass over the rows. The warps of a block then add their
//! sums in warp order (deterministic) into the group's partials, `out1`
//! (and `out2`) [NORM_GROUPS, C].
//!
//! The general kernel (templates.rs) reads x six times per row and walks
//! each group's rows again for the parameter gradients; on an H200 it ran
//! GPT-2's [16384, 768] layernorm backward in 174 us, about 8x its bytes.

use super::cuda::float_lit;
use super::templates::Ctx;
use crate::ir::types::DType;
use crate::ir::Graph;
use crate::ops::{Op, NORM_GROUPS};
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

/// Most 8-feature chunks a lane holds (4: rows of up to 1024 features).
const CHUNKS: i64 = 4;

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

/// A parameter vector's 8 features at `j0` in one load (two for f32): the
/// declaration and the expression of feature `e` (one 2-byte load a feature
/// cost as much L1 traffic as the rows themselves).
fn vec_param(c: &Ctx, i: usize, name: &str) -> (String, String) {
    let slot = c.ins[i];
    let (elem, value) = match c.in_dt(i) {
        DType::F32 => ("float", format!("{name}[e]")),
        dt => (names(dt).0, format!("{}(&{name}[e])", names(dt).1)),
    };
    (
        format!("{elem} {name}[8];\n                    fs_vload({name}, &in{slot}[j0]);\n                    "),
        value,
    )
}

fn names(dt: DType) -> (&'static str, &'static str, &'static str) {
    match dt {
        DType::F16 => ("fs_f16", "fs_load_f16", "fs_to_f16"),
        _ => ("fs_bf16", "fs_load_bf16", "fs_to_bf16"),
    }
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

/// The kernel's body, or `None` where its buffers do not allow it (padded
/// rows, an input read through a view, a residual of another dtype).
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
    let (elem, ld, st) = names(c.in_dt(0));
    let layer = matches!(g.g[n].op, Op::LayerNormGrad(_));
    let eps = match &g.g[n].op {
        Op::LayerNormGrad(l) => float_lit(l.eps),
        Op::RmsNormGrad(r) => float_lit(r.eps),
        _ => return None,
    };
    let rows = g.ty(g.inputs(n)[0]).shape[..g.ty(g.inputs(n)[0]).shape.len() - 1]
        .iter()
        .try_fold(crate::ir::Dim::constant(1), |a, d| a.checked_mul(d))?
        .to_c();
    let (x, dy) = (c.ins[0], c.ins[2]);
    // gamma 8 features a load; the last pass reads it a feature at a time
    // again: holding its 8 there too took the kernel past 128 registers.
    let (gload, gamma) = vec_param(c, 1, "gv");
    let gamma_one = c.ld(1, "j0 + e");
    // A lane's row stays in its 16-bit form, widened where it is read.
    let (xe, de) = (format!("{ld}(&xv[k][e])"), format!("{ld}(&dv[k][e])"));
    let mut b = String::new();
    let _ = write!(
        b,
        "    // One warp a row: lane `lane` holds features [8q, 8q + 8) for q = lane, lane + FS_WARP, ...
    const fs_i64 rows = {rows};
    constexpr int C = {cols}, K = (C / 8 + FS_WARP - 1) / FS_WARP;
    // Shared sums padded by a float every 32 (j0 + e at j0 + j0 / 32 + e,
    // j0 a multiple of 8): lanes hold features 8 apart, so unpadded their
    // stores fell on 4 banks (8-way conflicts).
    constexpr int CP = C + C / 32;
    __shared__ float sdg[CP]{sdb};
    const int lane = threadIdx.x % FS_WARP, warp = threadIdx.x / FS_WARP, warps = blockDim.x / FS_WARP;
    const fs_i64 groups = {NORM_GROUPS}, per = (rows + groups - 1) / groups;
    for (fs_i64 grp = blockIdx.x; grp < groups; grp += gridDim.x) {{
        const fs_i64 g0 = grp * per, g1 = g0 + per < rows ? g0 + per : rows;
        float dg[K * 8];
        for (int e = 0; e < K * 8; ++e) dg[e] = 0.0f;{db_zero}
        for (fs_i64 r = g0 + warp; r < g1; r += warps) {{
            // The row stays in its 16-bit form, widened where it is read.
            {elem} xv[K][8], dv[K][8];
            float s = 0.0f, ss = 0.0f;
            for (int k = 0; k < K; ++k) {{
                const int j0 = (k * FS_WARP + lane) * 8;
                if (j0 < C) {{
                    fs_vload(xv[k], &in{x}[r * C + j0]);
                    fs_vload(dv[k], &in{dy}[r * C + j0]);
                    for (int e = 0; e < 8; ++e) {{
                        s += {xe};
                        ss += {xe} * {xe};
                    }}
                }}
            }}
",
        sdb = if layer {
            format!(", wdb[{BLOCK} / FS_WARP][CP]")
        } else {
            String::new()
        },
        db_zero = if layer {
            "
        for (int k = 0; k < K; ++k)
            if ((k * FS_WARP + lane) * 8 < C)
                for (int e = 0; e < 8; ++e) {
                    const int j0 = (k * FS_WARP + lane) * 8;
                    wdb[warp][j0 + j0 / 32 + e] = 0.0f;
                }"
        } else {
            ""
        },
    );
    if layer {
        // Two passes for the variance, as the reference computes it: the
        // mean first, then the squares about it (from registers).
        let _ = write!(
            b,
            "            const float mean = fs_warp_sum(s) / (float)C;
            float sq = 0.0f;
            for (int k = 0; k < K; ++k)
                if ((k * FS_WARP + lane) * 8 < C)
                    for (int e = 0; e < 8; ++e) {{ const float t = {xe} - mean; sq += t * t; }}
            const float rstd = rsqrtf(fs_warp_sum(sq) / (float)C + {eps});
            (void)ss;
            float m1 = 0.0f, m2 = 0.0f;
            for (int k = 0; k < K; ++k) {{
                const int j0 = (k * FS_WARP + lane) * 8;
                if (j0 < C) {{
                    {gload}for (int e = 0; e < 8; ++e) {{
                        const float gd = {de} * {gamma};
                        m1 += gd;
                        m2 += gd * ({xe} - mean) * rstd;
                    }}
                }}
            }}
            m1 = fs_warp_sum(m1) / (float)C;
            m2 = fs_warp_sum(m2) / (float)C;
"
        );
    } else {
        let _ = write!(
            b,
            "            (void)s;
            const float rs = rsqrtf(fs_warp_sum(ss) / (float)C + {eps});
            float dot = 0.0f;
            for (int k = 0; k < K; ++k) {{
                const int j0 = (k * FS_WARP + lane) * 8;
                if (j0 < C) {{
                    {gload}for (int e = 0; e < 8; ++e)
                        dot += {de} * {gamma} * {xe};
                }}
            }}
            dot = fs_warp_sum(dot) / (float)C;
"
        );
    }
    let dx = if layer {
        "rstd * (gd - m1 - xh * m2)".to_string()
    } else {
        format!("gd * rs - {xe} * rs * rs * rs * dot")
    };
    let xh = if layer {
        format!("({xe} - mean) * rstd")
    } else {
        format!("{xe} * rs")
    };
    let add = match residual {
        Some(_) => format!(" + {ld}(&rv[e])"),
        None => String::new(),
    };
    let res_load = match residual {
        Some(slot) => format!("{elem} rv[8];\n                    fs_vload(rv, &in{slot}[r * C + j0]);\n                    "),
        None => String::new(),
    };
    let db_acc = if layer {
        format!(" wdb[warp][j0 + j0 / 32 + e] += {de};")
    } else {
        String::new()
    };
    let _ = write!(
        b,
        "            for (int k = 0; k < K; ++k) {{
                const int j0 = (k * FS_WARP + lane) * 8;
                if (j0 < C) {{
                    {res_load}{elem} o[8];
                    for (int e = 0; e < 8; ++e) {{
                        const float gd = {de} * {gamma_one}, xh = {xh};
                        o[e] = {st}({dx}{add});
                        dg[k * 8 + e] += {de} * xh;{db_acc}
                    }}
                    fs_vstore(&out{o0}[r * C + j0], o);
                }}
            }}
        }}
        // The warps' sums into the group's partials, in warp order.
        for (int w = 0; w < warps; ++w) {{
            if (warp == w)
                for (int k = 0; k < K; ++k) {{
                    const int j0 = (k * FS_WARP + lane) * 8;
                    if (j0 < C)
                        for (int e = 0; e < 8; ++e) {{
                            // j0 is a multiple of 8: j0 + e pads as j0 does.
                            sdg[j0 + j0 / 32 + e] = (w == 0 ? 0.0f : sdg[j0 + j0 / 32 + e]) + dg[k * 8 + e];
                        }}
                }}
            __syncthreads();
        }}
        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {{
            out{o1}[grp * C + j] = sdg[j + j / 32];{db_out}
        }}
        __syncthreads();
    }}
",
        o0 = c.outs[0],
        o1 = c.outs[1],
        db_out = if layer {
            format!(
                "\n            float db = 0.0f;\n            for (int w = 0; w < warps; ++w) db += wdb[w][j + j / 32];\n            out{}[grp * C + j] = db;",
                c.outs.get(2).copied().unwrap_or(2)
            )
        } else {
            String::new()
        },
    );
    Some(b)
}

/// Blocks of the one-warp-a-row forward: 8 warps each, 16384 rows in
/// flight (GPT-2 at B = 16 in one pass); more rows loop.
pub(crate) const FORWARD_BLOCKS: i64 = 2048;

/// The row length, where the forward runs one warp a row.
pub(crate) fn forward_applies(g: &Graph, n: NodeIndex) -> Option<i64> {
    if !matches!(g.g[n].op, Op::LayerNorm(_) | Op::RmsNorm(_)) {
        return None;
    }
    let x = g.ty(g.inputs(n)[0]);
    let c = x.shape.last()?.as_const()?;
    (matches!(x.dtype, DType::BF16 | DType::F16)
        && g.g[n].outputs[0].dtype == x.dtype
        && c > 0
        && c % 8 == 0
        && (c + 255) / 256 <= CHUNKS)
        .then_some(c)
}

/// The forward norm one warp a row: the row read once into registers with
/// 16-byte loads, its statistics by warp shuffles, the output stored eight
/// at a time.
pub(crate) fn forward_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let cols = forward_applies(g, n)?;
    let plain = c.k.input_views.iter().all(|v| v.is_none())
        && [c.k.inputs[c.ins[0]], c.k.outputs[c.outs[0]]]
            .iter()
            .all(|&b| c.p.buffers[b].pitch.is_none() && c.p.buffers[b].zero_rows == 0)
        && c.out_dt(0) == c.in_dt(0);
    if !plain {
        return None;
    }
    let (elem, ld, st) = names(c.in_dt(0));
    let shape = &g.ty(g.inputs(n)[0]).shape;
    let rows = shape[..shape.len() - 1]
        .iter()
        .try_fold(crate::ir::Dim::constant(1), |a, d| a.checked_mul(d))?
        .to_c();
    let (gload, gamma) = vec_param(c, 1, "gv");
    let (stats, value, params) = match &g.g[n].op {
        Op::LayerNorm(l) => {
            let (bload, beta) = vec_param(c, 2, "bv");
            (
            format!(
                "const float mean = fs_warp_sum(s) / (float)C;
            float sq = 0.0f;
            for (int k = 0; k < K; ++k)
                if ((k * FS_WARP + lane) * 8 < C)
                    for (int e = 0; e < 8; ++e) {{ const float t = x[k * 8 + e] - mean; sq += t * t; }}
            const float rstd = rsqrtf(fs_warp_sum(sq) / (float)C + {});",
                float_lit(l.eps)
            ),
            format!("(x[k * 8 + e] - mean) * rstd * {gamma} + {beta}"),
            gload + &bload,
            )
        }
        Op::RmsNorm(r) => (
            format!(
                "float sq = 0.0f;
            for (int k = 0; k < K; ++k)
                if ((k * FS_WARP + lane) * 8 < C)
                    for (int e = 0; e < 8; ++e) sq += x[k * 8 + e] * x[k * 8 + e];
            (void)s;
            const float rs = rsqrtf(fs_warp_sum(sq) / (float)C + {});",
                float_lit(r.eps)
            ),
            format!("x[k * 8 + e] * rs * {gamma}"),
            gload,
        ),
        _ => return None,
    };
    let (x, o) = (c.ins[0], c.outs[0]);
    Some(format!(
        "    // One warp a row: lane `lane` holds features [8q, 8q + 8) for q = lane, lane + FS_WARP, ...
    const fs_i64 rows = {rows};
    constexpr int C = {cols}, K = (C / 8 + FS_WARP - 1) / FS_WARP;
    const int lane = threadIdx.x % FS_WARP, warp = threadIdx.x / FS_WARP, warps = blockDim.x / FS_WARP;
    for (fs_i64 r = (fs_i64)blockIdx.x * warps + warp; r < rows; r += (fs_i64)gridDim.x * warps) {{
        float x[K * 8], s = 0.0f;
        for (int k = 0; k < K; ++k) {{
            const int j0 = (k * FS_WARP + lane) * 8;
            if (j0 < C) {{
                {elem} xv[8];
                fs_vload(xv, &in{x}[r * C + j0]);
                for (int e = 0; e < 8; ++e) {{
                    x[k * 8 + e] = {ld}(&xv[e]);
                    s += x[k * 8 + e];
                }}
            }}
        }}
        {{
            {stats}
            for (int k = 0; k < K; ++k) {{
                const int j0 = (k * FS_WARP + lane) * 8;
                if (j0 < C) {{
                    {params}{elem} y[8];
                    for (int e = 0; e < 8; ++e) {{
                        y[e] = {st}({value});
                    }}
                    fs_vstore(&out{o}[r * C + j0], y);
                }}
            }}
        }}
    }}
"
    ))
}
