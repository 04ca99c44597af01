//! The elementwise ops that also run as kernels of their own: a cast as a
//! member of a group kernel (the master weights to the compute dtype), and
//! the two scalar steps of gradient clipping and loss scaling.

use super::*;
use crate::emit::cuda::float_lit;
use crate::ops::{Cast, ClipCoef, Unscale};

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

/// One thread: kernels/clip.cuh's `fs_unscale`.
impl Lower for Unscale {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some("#include \"clip.cuh\"\n\n".to_string())
    }
    /// fp16: the clip coefficient over the loss scale, whether the step
    /// applies (no overflow), and the true norm.
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        // A negative bound is no clipping (max_norm is never negative).
        let max_norm = float_lit(self.max_norm.unwrap_or(-1.0));
        Some(format!(
            "        const FsUnscaled u = fs_unscale({}, {}, {}, {max_norm});\n        {}\n        {}\n        {}\n",
            c.ld(0, "0"),
            c.ld(1, "0"),
            c.ld(2, "0"),
            c.st(0, "i", "u.coef"),
            c.st(1, "i", "u.apply"),
            c.st(2, "i", "u.norm")
        ))
    }
}

/// One thread: kernels/clip.cuh's `fs_clip_coef`.
impl Lower for ClipCoef {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some("#include \"clip.cuh\"\n\n".to_string())
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        let coef = format!(
            "fs_clip_coef(sqrtf({}), {})",
            c.ld(0, "0"),
            float_lit(self.max_norm)
        );
        Some(format!("        {}\n", c.st(0, "i", &coef)))
    }
}
