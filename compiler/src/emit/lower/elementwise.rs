//! The elementwise ops that also run as kernels of their own: a cast as a
//! member of a group kernel (the master weights to the compute dtype), and
//! the two scalar steps of gradient clipping and loss scaling.

use super::*;
use crate::emit::cuda::float_lit;
use crate::ops::{Cast, ClipCoef, Unscale};
use std::fmt::Write;

impl Lower for Cast {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    /// Casts run on their own only as members of a group kernel (the
    /// master weights to the compute dtype); elsewhere they fuse into
    /// chains.
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        Some(format!("        {}\n", c.st(0, "i", &c.ld(0, "i"))))
    }
}

impl Lower for Unscale {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    /// fp16: the true norm, the clip coefficient over the loss scale, and
    /// whether the step applies (no overflow).
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        let mut b = String::new();
        let _ = writeln!(
            b,
            "        const float sumsq = {}, scale = {};",
            c.ld(0, "0"),
            c.ld(1, "0")
        );
        let _ = writeln!(
            b,
            "        const float norm = sqrtf(sumsq) / scale;\n        const bool finite = fs_isfinite(sumsq);"
        );
        let coef = match self.max_norm {
            Some(m) => format!(
                "(finite ? fminf(1.0f, {} / (norm + 1e-6f)) : 1.0f)",
                float_lit(m)
            ),
            None => "1.0f".to_string(),
        };
        let _ = writeln!(b, "        {}", c.st(0, "i", &format!("{coef} / scale")));
        let _ = writeln!(
            b,
            "        {}",
            c.st(1, "i", &format!("finite ? {} : 0.0f", c.ld(2, "0")))
        );
        let _ = writeln!(b, "        {}", c.st(2, "i", "norm"));
        Some(b)
    }
}

impl Lower for ClipCoef {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        let mut b = String::new();
        let _ = writeln!(b, "        const float norm = sqrtf({});", c.ld(0, "0"));
        let _ = writeln!(
            b,
            "        {}",
            c.st(
                0,
                "i",
                &format!("fminf(1.0f, {} / (norm + 1e-6f))", float_lit(self.max_norm))
            )
        );
        Some(b)
    }
}
