//! How the neural-network ops become kernels: a block a row for the
//! softmax, the norms and the cross-entropy (reducing across the block),
//! a thread an element for the lookups, masks and rotations; the norms'
//! backward and forward over many rows, and the embedding backward, as the
//! specialised kernels of emit/norm_rows.rs and emit/embedding_grad.rs.

use super::*;
use crate::emit::cross_entropy::{self, Stores};
use crate::emit::cuda::float_lit;
use crate::emit::templates::{
    close_row_groups, rms, row_groups, row_length_of, rows_of, stats, with_residual,
};
use crate::emit::{embedding_grad, norm_rows};
use crate::ops::*;
use std::fmt::Write;

/// A block a row where the op runs along the last axis (none otherwise).
fn last_axis_rows(axis: usize, g: &Graph, n: NodeIndex) -> Option<Shape> {
    let rank = g.ty(g.inputs(n)[0]).rank();
    (axis + 1 == rank).then(|| Shape::Rows(rows_of(g, n)))
}

/// A norm's forward: norm_rows's blocks of many short rows where it
/// applies, else a block a row.
fn norm_forward_shape(g: &Graph, n: NodeIndex) -> Shape {
    match crate::kernel::forms::norm_forward_rows(g, n) {
        Some(_) => Shape::Rows(Dim::constant(norm_rows::FORWARD_BLOCKS)),
        None => Shape::Rows(rows_of(g, n)),
    }
}

/// A norm's backward: a block a group of rows (NORM_GROUPS, each summing
/// its rows' parameter gradients) where norm_rows applies, else a block a
/// row.
fn norm_backward_shape(g: &Graph, n: NodeIndex) -> Shape {
    match norm_rows::applies(g, n) {
        Some(_) => Shape::Rows(Dim::constant(NORM_GROUPS as i64)),
        None => Shape::Rows(rows_of(g, n)),
    }
}

/// Along the last axis only: a block a row (kernels/softmax.cuh).
impl Lower for Softmax {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        last_axis_rows(self.axis, g, n)
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some(SOFTMAX_INCLUDE.to_string())
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        Some(format!(
            "        fs_softmax_row<{}, {}>({} + row * C, {} + row * C, C);\n",
            c.in_el(0),
            c.out_el(0),
            c.in_ptr(0),
            c.out_ptr(0)
        ))
    }
}

impl Lower for SoftmaxGrad {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        last_axis_rows(self.axis, g, n)
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some(SOFTMAX_INCLUDE.to_string())
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        Some(format!(
            "        fs_softmax_grad_row<{}, {}, {}>({} + row * C, {} + row * C, {} + row * C, C);\n",
            c.in_el(0),
            c.in_el(1),
            c.out_el(0),
            c.in_ptr(0),
            c.in_ptr(1),
            c.out_ptr(0)
        ))
    }
}

const SOFTMAX_INCLUDE: &str = "#include \"softmax.cuh\"\n\n";

/// Many rows a block where the rows are short (norm_rows), else a block a row.
impl Lower for LayerNorm {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(norm_forward_shape(g, n))
    }
    fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        norm_rows::forward_body(g, c, n)
    }
    fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        norm_rows::file_scope(g, c, n)
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        let mut body = String::new();
        let b = &mut body;
        let x = c.ld(0, "row * C + j");
        stats(b, &x, &float_lit(self.eps), "        ", "j");
        let v = format!("({x} - mean) * rstd * {} + {}", c.ld(1, "j"), c.ld(2, "j"));
        let _ = writeln!(
            b,
            "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
            c.st(0, "row * C + j", &v)
        );
        Some(body)
    }
}

impl Lower for RmsNorm {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(norm_forward_shape(g, n))
    }
    fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        norm_rows::forward_body(g, c, n)
    }
    fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        norm_rows::file_scope(g, c, n)
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        let mut body = String::new();
        let b = &mut body;
        let x = c.ld(0, "row * C + j");
        rms(b, &x, &float_lit(self.eps), "        ", "j", "r");
        let v = format!("{x} * r * {}", c.ld(1, "j"));
        let _ = writeln!(
            b,
            "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
            c.st(0, "row * C + j", &v)
        );
        Some(body)
    }
}

/// dx by rows, then the weight and bias gradients by groups of rows, in
/// one kernel (norm_rows's where it applies).
impl Lower for LayerNormGrad {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(norm_backward_shape(g, n))
    }
    fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        norm_rows::kernel_body(g, c, n)
    }
    fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        norm_rows::file_scope(g, c, n)
    }
    fn launch_bounds(&self, g: &Graph, n: NodeIndex) -> Option<String> {
        norm_rows::backward_bounds(g, n)
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        let mut body = String::new();
        let b = &mut body;
        // Rows: dx. Then column tiles: dgamma and dbeta, each row's
        // statistics recomputed by the block.
        let eps = float_lit(self.eps);
        let x = c.ld(0, "r * C + j");
        let dy = c.ld(2, "r * C + j");
        let g = c.ld(1, "j");
        let _ = writeln!(b, "        const fs_i64 r = row;");
        stats(b, &x, &eps, "        ", "j");
        let _ = writeln!(b, "        float m1 = 0.0f, m2 = 0.0f;");
        let _ = writeln!(b, "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {{ const float d = {dy} * {g}; m1 += d; m2 += d * ({x} - mean) * rstd; }}");
        let _ = writeln!(b, "        m1 = fs_block_sum(m1) / (float)C;");
        let _ = writeln!(b, "        m2 = fs_block_sum(m2) / (float)C;");
        let v = with_residual(
            c,
            format!("rstd * ({dy} * {g} - m1 - ({x} - mean) * rstd * m2)"),
        );
        let _ = writeln!(
            b,
            "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
            c.st(0, "r * C + j", &v)
        );
        // Then the parameter gradients by row groups: each block sums
        // its group's rows into one f32 partial per feature.
        let zero = "out1[grp * C + j] = 0.0f; out2[grp * C + j] = 0.0f;";
        row_groups(
            b,
            zero,
            "mean_s[r - c0] = mean; rstd_s[r - c0] = rstd;",
            &["mean", "rstd"],
            &|b| {
                stats(b, &c.ld(0, "r * C + jj"), &eps, "                ", "jj");
            },
        );
        let _ = writeln!(
            b,
            "            for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {{"
        );
        let _ = writeln!(b, "                float dg = 0.0f, db = 0.0f;");
        let _ = writeln!(b, "                for (fs_i64 r = c0; r < c1; ++r) {{ const float d = {dy}; dg += d * ({x} - mean_s[r - c0]) * rstd_s[r - c0]; db += d; }}");
        let _ = writeln!(
            b,
            "                out1[grp * C + j] += dg; out2[grp * C + j] += db;"
        );
        let _ = writeln!(b, "            }}");
        close_row_groups(b);
        Some(body)
    }
}

impl Lower for RmsNormGrad {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(norm_backward_shape(g, n))
    }
    fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        norm_rows::kernel_body(g, c, n)
    }
    fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        norm_rows::file_scope(g, c, n)
    }
    fn launch_bounds(&self, g: &Graph, n: NodeIndex) -> Option<String> {
        norm_rows::backward_bounds(g, n)
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        let mut body = String::new();
        let b = &mut body;
        let eps = float_lit(self.eps);
        let x = c.ld(0, "r * C + j");
        let dy = c.ld(2, "r * C + j");
        let g = c.ld(1, "j");
        let _ = writeln!(b, "        const fs_i64 r = row;");
        let _ = writeln!(b, "        float sq = 0.0f, dot = 0.0f;");
        let _ = writeln!(b, "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {{ const float v = {x}; sq += v * v; dot += {dy} * {g} * v; }}");
        let _ = writeln!(
            b,
            "        const float rs = rsqrtf(fs_block_sum(sq) / (float)C + {eps});"
        );
        let _ = writeln!(b, "        dot = fs_block_sum(dot) / (float)C;");
        let v = with_residual(c, format!("{dy} * {g} * rs - {x} * rs * rs * rs * dot"));
        let _ = writeln!(
            b,
            "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
            c.st(0, "r * C + j", &v)
        );
        row_groups(
            b,
            "out1[grp * C + j] = 0.0f;",
            "rs_s[r - c0] = rs;",
            &["rs"],
            &|b| {
                rms(
                    b,
                    &c.ld(0, "r * C + jj"),
                    &eps,
                    "                ",
                    "jj",
                    "rs",
                )
            },
        );
        let _ = writeln!(
            b,
            "            for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {{"
        );
        let _ = writeln!(b, "                float dg = 0.0f;");
        let _ = writeln!(
            b,
            "                for (fs_i64 r = c0; r < c1; ++r) dg += {dy} * {x} * rs_s[r - c0];"
        );
        let _ = writeln!(b, "                out1[grp * C + j] += dg;");
        let _ = writeln!(b, "            }}");
        close_row_groups(b);
        Some(body)
    }
}

impl Lower for Embedding {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let ins = g.inputs(n);
        let in_shape = |i: usize| g.ty(ins[i]).shape.clone();
        let last = |s: &[Dim]| s.last().cloned().unwrap_or(Dim::constant(1));
        let mut body = String::new();
        let b = &mut body;
        let (v, cc) = (in_shape(0)[0].to_c(), last(&in_shape(0)).to_c());
        let _ = writeln!(
            b,
            "        const fs_i64 C = {cc}, r = i / C, j = i % C, idx = in1[r];"
        );
        let _ = writeln!(
            b,
            "        // An index outside the table gives NaN, as the reference does."
        );
        let val = format!(
            "(idx >= 0 && idx < {v}) ? {} : __int_as_float(0x7fc00000)",
            c.ld(0, "idx * C + j")
        );
        let _ = writeln!(b, "        {}", c.st(0, "i", &val));
        Some(body)
    }
}

/// Groups of table rows with their sums in shared memory, times runs of
/// the tokens (emit/embedding_grad.rs).
impl Lower for EmbeddingGrad {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        embedding_grad::blocks(g, n).map(Shape::Rows)
    }
    fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        embedding_grad::kernel_body(g, c, n)
    }
    fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        embedding_grad::file_scope(g, c, n)
    }
}

/// The three cross-entropy ops share one row kernel (emit::cross_entropy,
/// kernels/cross_entropy.cuh); they differ in what it stores (Stores).
macro_rules! cross_entropy_lowering {
    ($($op:ident: $stores:expr;)*) => {$(
        impl Lower for $op {
            fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
                Some(Shape::Rows(rows_of(g, n)))
            }
            /// A cross-entropy over padded logits counts its classes only.
            fn row_length(&self, g: &Graph, n: NodeIndex) -> Dim {
                match self.classes {
                    Some(c) => Dim::constant(c),
                    None => row_length_of(g, n),
                }
            }
            fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
                Some(cross_entropy::INCLUDE.to_string())
            }
            fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
                Some(cross_entropy::row(c, $stores, self.classes, &self.rule))
            }
        }
    )*};
}

// logsumexp(row) - row[target] (NaN for a target outside the row); its
// gradient; and both from one pass over the logits.
cross_entropy_lowering! {
    CrossEntropy: Stores::Loss(0);
    CrossEntropyGrad: Stores::Grad(0);
    CrossEntropyWithGrad: Stores::Both { loss: 1, grad: 0 };
}

/// A thread a target.
impl Lower for Counted {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        let v = format!("in{}[i] == {}LL ? 0.0f : 1.0f", c.ins[0], self.ignore_index);
        Some(format!("        {}\n", c.st(0, "i", &v)))
    }
}

impl Lower for Rope {
    /// A thread per rotated pair (i, i + D/2).
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(Shape::Elements(
            g.g[n].outputs[0].numel().checked_div(&Dim::constant(2))?,
        ))
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let ins = g.inputs(n);
        let in_shape = |i: usize| g.ty(ins[i]).shape.clone();
        let mut body = String::new();
        let b = &mut body;
        // One thread per pair: one angle, one sine and cosine for both
        // of its elements (a thread per element computed them twice,
        // with powf, and ran at a tenth of the memory bandwidth).
        let sh = in_shape(0);
        let rk = sh.len();
        let (t, h, d) = (sh[rk - 3].to_c(), sh[rk - 2].to_c(), sh[rk - 1].to_c());
        let _ = writeln!(b, "        const fs_i64 D = {d}, half = D / 2, pair = i / half, f = i % half, pos = (pair / {h}) % {t}, lo_at = pair * D + f;");
        // theta^(-2f/D) as exp2(-2f/D * log2(theta)).
        let _ = writeln!(
            b,
            "        const float angle = (float)pos * exp2f(-2.0f * (float)f / (float)D * {});",
            float_lit(self.theta.log2())
        );
        let _ = writeln!(
            b,
            "        float sn, cs;\n        sincosf(angle, &sn, &cs);"
        );
        if self.inverse {
            // The gradient rotates the other way.
            let _ = writeln!(b, "        sn = -sn;");
        }
        let lo = c.ld(0, "lo_at");
        let hi = c.ld(0, "lo_at + half");
        let _ = writeln!(b, "        const float lo = {lo}, hi = {hi};");
        let _ = writeln!(b, "        {}", c.st(0, "lo_at", "lo * cs - hi * sn"));
        let _ = writeln!(
            b,
            "        {}",
            c.st(0, "lo_at + half", "lo * sn + hi * cs")
        );
        Some(body)
    }
}

impl Lower for CausalMask {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let ins = g.inputs(n);
        let in_shape = |i: usize| g.ty(ins[i]).shape.clone();
        let mut body = String::new();
        let b = &mut body;
        let sh = in_shape(0);
        let (t, sz) = (sh[sh.len() - 2].to_c(), sh[sh.len() - 1].to_c());
        let _ = writeln!(
            b,
            "        const fs_i64 col = i % {sz}, q = (i / {sz}) % {t};"
        );
        let val = format!("col > q ? {} : {}", float_lit(self.fill), c.ld(0, "i"));
        let _ = writeln!(b, "        {}", c.st(0, "i", &val));
        Some(body)
    }
}
