//! How the shape ops become code: the views are read in place by their
//! readers; sums over adjacent axes, slice gradients and concatenations
//! run as loops (a sum over leading axes by column tiles, emit/multi.rs).

use super::*;
use crate::emit::multi;
use crate::emit::templates::numel;
use crate::ops::{Concat, Reduce, ReduceKind, SliceGrad};
use std::fmt::Write;

impl Lower for Reduce {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        if multi::column_tiles(g, n).is_some() {
            return multi::shape_of(g, n);
        }
        // One run of adjacent axes (leading, or between kept ones: a mean
        // over the sequence of [B, T, C]): a loop per output element.
        let adjacent = self.axes.windows(2).all(|w| w[1] == w[0] + 1);
        (!self.axes.is_empty() && adjacent).then(|| per_element(g, n))
    }
    fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        multi::kernel_body(g, c, n)
    }
    fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        multi::file_scope(g, c, n)
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let ins = g.inputs(n);
        let in_shape = |i: usize| g.ty(ins[i]).shape.clone();
        let mut body = String::new();
        let b = &mut body;
        // Sum over the adjacent axes a0..a1 of the input, seen as
        // [outer, rows, inner]: output element i is (i / inner, i % inner).
        let sh = in_shape(0);
        let (a0, a1) = (self.axes[0], self.axes[self.axes.len() - 1] + 1);
        let rows = numel(&sh[a0..a1]);
        let inner = numel(&sh[a1..]);
        let _ = writeln!(
            b,
            "        const fs_i64 rows = {}, inner = {};\n        const fs_i64 base = (i / inner) * rows * inner + i % inner;\n        float acc = 0.0f;",
            rows.to_c(),
            inner.to_c()
        );
        let _ = writeln!(
            b,
            "        for (fs_i64 r = 0; r < rows; ++r) acc += {};",
            c.ld(0, "base + r * inner")
        );
        let v = if self.kind == ReduceKind::Mean {
            "acc / (float)rows"
        } else {
            "acc"
        };
        let _ = writeln!(b, "        {}", c.st(0, "i", v));
        Some(body)
    }
}

impl Lower for SliceGrad {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let ins = g.inputs(n);
        let in_shape = |i: usize| g.ty(ins[i]).shape.clone();
        let mut body = String::new();
        let b = &mut body;
        let out = &g.g[n].outputs[0].shape;
        let inner = numel(&out[self.axis + 1..]).to_c();
        let len = in_shape(0)[self.axis].to_c();
        let _ = writeln!(
            b,
            "        const fs_i64 inner = {inner}, full = {}, len = {len}, start = {};",
            self.full.to_c(),
            self.start.to_c()
        );
        let _ = writeln!(b, "        const fs_i64 a = (i / inner) % full, outer = i / (inner * full), j = i % inner;");
        let val = format!(
            "(a >= start && a < start + len) ? {} : 0.0f",
            c.ld(0, "(outer * len + a - start) * inner + j")
        );
        let _ = writeln!(b, "        {}", c.st(0, "i", &val));
        Some(body)
    }
}

impl Lower for Concat {
    /// A thread per 16-byte chunk where the parts allow (multi::concat_body;
    /// the element loop strides over the rest).
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        let numel = g.g[n].outputs[0].numel();
        let chunks =
            multi::concat_chunk(g, n).and_then(|vec| numel.checked_div(&Dim::constant(vec)));
        Some(Shape::Elements(chunks.unwrap_or(numel)))
    }
    fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        multi::concat_body(g, c, n)
    }
    fn file_scope(&self, g: &Graph, _: &Ctx, n: NodeIndex) -> Option<String> {
        multi::concat_chunk(g, n).map(|_| "#include \"concat.cuh\"\n\n".to_string())
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let ins = g.inputs(n);
        let mut body = String::new();
        let b = &mut body;
        let out = &g.g[n].outputs[0].shape;
        let inner = numel(&out[self.axis + 1..]).to_c();
        let _ = writeln!(
            b,
            "        const fs_i64 inner = {inner}, total = {};",
            out[self.axis].to_c()
        );
        let _ = writeln!(b, "        const fs_i64 a = (i / inner) % total, outer = i / (inner * total), j = i % inner;");
        let mut start = Dim::constant(0);
        let _ = writeln!(b, "        float v;");
        for (k, x) in ins.iter().enumerate() {
            let len = g.ty(*x).shape[self.axis].clone();
            let end = start.checked_add(&len).unwrap_or_default();
            let idx = format!(
                "(outer * {} + a - {}) * inner + j",
                len.to_c(),
                start.to_c()
            );
            let cond = if k + 1 == ins.len() {
                "else".to_string()
            } else {
                format!(
                    "{}if (a < {})",
                    if k == 0 { "" } else { "else " },
                    end.to_c()
                )
            };
            let _ = writeln!(b, "        {cond} v = {};", c.ld(k, &idx));
            start = end;
        }
        let _ = writeln!(b, "        {}", c.st(0, "i", "v"));
        Some(body)
    }
}
