//! How the updates become code: a thread an element of the parameter (or
//! of this rank's piece of it), as members of one group kernel for every
//! parameter; each runs kernels/optim.cuh's one copy of its arithmetic.

use super::*;
use crate::emit::cuda::float_lit;
use crate::emit::templates::pass_through;
use crate::ops::{AdamW, Sgd, StorePiece, SumSquares};
use std::fmt::Write;

/// The include of kernels/optim.cuh, which every update kernel runs.
const OPTIM_INCLUDE: &str = "#include \"optim.cuh\"\n\n";

/// The launch shape of an update: the piece of its parameter it runs on
/// (ZeRO), or all of it.
fn update_shape(g: &Graph, n: NodeIndex, range: Option<(i64, i64)>) -> Option<Shape> {
    Some(Shape::Elements(match range {
        Some((lo, hi)) => Dim::constant(hi - lo),
        None => g.g[n].outputs[0].numel(),
    }))
}

/// The parameter's element an update thread works on: `i` itself, or past
/// the start of this rank's piece (ZeRO; the state holds the piece alone).
fn param_index(range: Option<(i64, i64)>) -> String {
    range.map_or("i".to_string(), |(lo, _)| format!("{lo}LL + i"))
}

/// The element of an update's input and output 0 and of its gradient: a
/// master piece is indexed as its state, the gradient as the parameter
/// (or, ZeRO stage 2's piece of it, as the state).
fn update_indices(range: Option<(i64, i64)>, master: bool, grad_piece: bool) -> (String, String) {
    let p = param_index(range);
    let state = "i".to_string();
    (
        if master { state.clone() } else { p.clone() },
        if grad_piece { state } else { p },
    )
}

impl Lower for StorePiece {
    fn shape(&self, _: &Graph, _: NodeIndex) -> Option<Shape> {
        let (lo, hi) = self.range;
        Some(Shape::Elements(Dim::constant(hi - lo)))
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let mut body = String::new();
        pass_through(&mut body, c, g, n, Some(self.range));
        let _ = writeln!(
            body,
            "        {}",
            c.st(0, &param_index(Some(self.range)), &c.ld(1, "i"))
        );
        Some(body)
    }
}

impl Lower for AdamW {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        update_shape(g, n, self.range)
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some(OPTIM_INCLUDE.to_string())
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let mut body = String::new();
        let b = &mut body;
        let (pi, gi) = update_indices(self.range, self.master, self.grad_piece);
        let (pi, gi) = (pi.as_str(), gi.as_str());
        if !self.master {
            pass_through(b, c, g, n, self.range);
        }
        if g.inputs(n).len() == 8 {
            // A micro-batch that only accumulates: the state stays.
            let _ = writeln!(
                b,
                "        if ({} == 0.0f) {{ {} {} {} continue; }}",
                c.ld(7, "0"),
                c.st(0, pi, &c.ld(0, pi)),
                c.st(1, "i", &c.ld(2, "i")),
                c.st(2, "i", &c.ld(3, "i"))
            );
        }
        // kernels/optim.cuh's one copy of the update, on this element.
        let _ = writeln!(
            b,
            "        const float g = {} * {}, lr = {}, t = {};\n        float m = {}, v = {}, p = {}, bc1, bc2;",
            c.ld(1, gi),
            c.ld(6, "0"),
            c.ld(4, "0"),
            c.ld(5, "0"),
            c.ld(2, "i"),
            c.ld(3, "i"),
            c.ld(0, pi)
        );
        let log1p_neg = |beta: f64| (-(1.0 - beta)).ln_1p();
        let _ = writeln!(
            b,
            "        fs_adamw_corrections(t, {}, {}, bc1, bc2);",
            float_lit(log1p_neg(self.beta1)),
            float_lit(log1p_neg(self.beta2))
        );
        let _ = writeln!(
            b,
            "        fs_adamw_step(p, m, v, g, lr, bc1, bc2, {}, {}, {}, {}, {}, {});",
            float_lit(self.beta1),
            float_lit(self.beta2),
            float_lit(self.eps),
            float_lit(self.weight_decay),
            float_lit(1.0 - self.beta1),
            float_lit(1.0 - self.beta2)
        );
        let _ = writeln!(
            b,
            "        {}\n        {}\n        {}",
            c.st(0, pi, "p"),
            c.st(1, "i", "m"),
            c.st(2, "i", "v")
        );
        Some(body)
    }
}

impl Lower for Sgd {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        update_shape(g, n, self.range)
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some(OPTIM_INCLUDE.to_string())
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let mut body = String::new();
        let b = &mut body;
        let (pi, gi) = update_indices(self.range, self.master, self.grad_piece);
        let (pi, gi) = (pi.as_str(), gi.as_str());
        if !self.master {
            pass_through(b, c, g, n, self.range);
        }
        if g.inputs(n).len() == 6 {
            let _ = writeln!(
                b,
                "        if ({} == 0.0f) {{ {} {} continue; }}",
                c.ld(5, "0"),
                c.st(0, pi, &c.ld(0, pi)),
                c.st(1, "i", &c.ld(2, "i"))
            );
        }
        // kernels/optim.cuh's one copy of the update, on this element.
        let _ = writeln!(
            b,
            "        float p = {};\n        const float lr = {};\n        float buf = {};\n        fs_sgd_step(p, buf, {} * {}, lr, {}, {});",
            c.ld(0, pi),
            c.ld(3, "0"),
            c.ld(2, "i"),
            c.ld(1, gi),
            c.ld(4, "0"),
            float_lit(self.momentum),
            float_lit(self.weight_decay)
        );
        let _ = writeln!(
            b,
            "        {}\n        {}",
            c.st(0, pi, "p"),
            c.st(1, "i", "buf")
        );
        Some(body)
    }
}

/// Each tensor's sum of squares by chunks (emit/multi.rs, kernels/sum_squares.cuh).
impl Lower for SumSquares {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        crate::emit::multi::shape_of(g, n)
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some("#include \"sum_squares.cuh\"\n\n".to_string())
    }
    fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        crate::emit::multi::kernel_body(g, c, n)
    }
}
