//! The CUDA C each unary function's kernels compute it with, beside the
//! rest of what fusec knows of it (`ops::unary`'s table): one expression
//! for f(x) and one for f'(x) * dy, in f32 (kernels/prelude.cuh holds the
//! `fs_` helpers). Fused chains write them inline.

use crate::ops::UnaryKind;

/// (f(x), f'(x) * dy) for float variables `{x}` and `{dy}`.
fn forms(kind: UnaryKind) -> (&'static str, &'static str) {
    match kind {
        UnaryKind::Neg => ("-{x}", "-{dy}"),
        UnaryKind::Exp => ("expf({x})", "expf({x}) * {dy}"),
        UnaryKind::Log => ("logf({x})", "{dy} / {x}"),
        UnaryKind::Sqrt => ("sqrtf({x})", "0.5f * rsqrtf({x}) * {dy}"),
        UnaryKind::Rsqrt => ("rsqrtf({x})", "-0.5f * rsqrtf({x}) / {x} * {dy}"),
        UnaryKind::Tanh => ("tanhf({x})", "(1.0f - tanhf({x}) * tanhf({x})) * {dy}"),
        UnaryKind::Sigmoid => (
            "fs_sigmoid({x})",
            "fs_sigmoid({x}) * (1.0f - fs_sigmoid({x})) * {dy}",
        ),
        UnaryKind::Gelu => ("fs_gelu({x})", "fs_gelu_grad({x}) * {dy}"),
        UnaryKind::GeluErf => ("fs_gelu_erf({x})", "fs_gelu_erf_grad({x}) * {dy}"),
        UnaryKind::Relu => ("fmaxf({x}, 0.0f)", "({x} > 0.0f ? {dy} : 0.0f)"),
        UnaryKind::Silu => ("fs_silu({x})", "fs_silu_grad({x}) * {dy}"),
        UnaryKind::Softplus => (
            "(fmaxf({x}, 0.0f) + log1pf(expf(-fabsf({x}))))",
            "fs_sigmoid({x}) * {dy}",
        ),
    }
}

/// CUDA C of f(x).
pub(crate) fn cuda(kind: UnaryKind, x: &str) -> String {
    forms(kind).0.replace("{x}", x)
}

/// CUDA C of f'(x) * dy.
pub(crate) fn cuda_grad(kind: UnaryKind, x: &str, dy: &str) -> String {
    forms(kind).1.replace("{x}", x).replace("{dy}", dy)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CUDA forms name their operands (a typo leaves a `{x}` behind).
    #[test]
    fn cuda_forms_substitute_every_operand() {
        for &k in UnaryKind::ALL {
            let f = cuda(k, "v");
            let g = cuda_grad(k, "v", "dv");
            assert!(!f.contains('{') && f.contains('v'), "{}: {f}", k.name());
            assert!(!g.contains('{') && g.contains("dv"), "{}: {g}", k.name());
        }
    }
}
