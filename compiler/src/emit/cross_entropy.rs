//! The cross-entropy ops' row kernels: one call a row into
//! kernels/cross_entropy.cuh, whose template arguments (element types, the
//! 16-byte path, the padded row length) and rule (ops::CeRule) are chosen
//! here from the kernel's buffers.

use super::cuda::float_lit;
use super::templates::Ctx;
use crate::ir::types::DType;
use crate::ops::CeRule;

/// What a cross-entropy kernel's file includes.
pub(crate) const INCLUDE: &str = "#include \"cross_entropy.cuh\"\n\n";

/// Elements from one row of a cross-entropy's logits (or gradient) to the
/// next, where that is not its classes `C`: the buffer's pitch (rows padded
/// for the GEMMs around it, kernel::pitch), or the padded row of logits
/// with more columns than classes (pad-dims).
fn row_pitch(c: &Ctx, buf: usize, classes: Option<i64>) -> Option<i64> {
    let b = &c.p.buffers[buf];
    b.pitch.or_else(|| {
        classes?;
        b.ty.shape.last()?.as_const()
    })
}

/// The rule as the header's `fs_ce_rule` aggregate, constants the
/// compiler folds (the default rule compiles to the plain loss).
fn rule_literal(rule: &CeRule) -> String {
    let e = rule.smoothing;
    format!(
        "fs_ce_rule{{{}, {}LL, {}, {}, {}}}",
        rule.ignore_index.is_some(),
        rule.ignore_index.unwrap_or(0),
        e != 0.0,
        float_lit(1.0 - e),
        float_lit(e)
    )
}

/// Where the gradient can take the 16-byte path: logits and gradient both
/// 16-bit of one type, read plainly, with rows a constant multiple of 8
/// apart (every row then starts 16-byte aligned, and a row's last vector
/// stays inside its padded row). The gradient's row length, which the
/// vector loop writes whole (zeros past the classes).
fn vector_row(c: &Ctx, o: usize) -> Option<i64> {
    if !matches!(c.in_dt(0), DType::BF16 | DType::F16)
        || c.out_dt(o) != c.in_dt(0)
        || c.k.input_views.get(c.ins[0]).is_some_and(|v| v.is_some())
    {
        return None;
    }
    let row = |buf: usize| -> Option<i64> {
        let b = &c.p.buffers[buf];
        b.pitch
            .or_else(|| b.ty.shape.last()?.as_const())
            .filter(|r| r % 8 == 0)
    };
    let (in_row, out_row) = (row(c.k.inputs[c.ins[0]])?, row(c.k.outputs[c.outs[o]])?);
    (in_row >= out_row).then_some(out_row)
}

/// What a cross-entropy kernel stores, by output slot: the loss, the
/// logits' gradient, or both from one pass over the logits.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Stores {
    Loss(usize),
    Grad(usize),
    Both { loss: usize, grad: usize },
}

/// One row of cross-entropy over logits (input 0) against targets (input
/// 1): the loss, and/or the gradient scaled by dloss (input 2) at the row.
pub(crate) fn row(c: &Ctx, stores: Stores, classes: Option<i64>, rule: &CeRule) -> String {
    let pitch =
        |buf: usize| row_pitch(c, buf, classes).map_or("C".to_string(), |p| format!("{p}LL"));
    let x = format!("{} + row * {}", c.in_ptr(0), pitch(c.k.inputs[c.ins[0]]));
    let t = format!("{}[row]", c.in_ptr(1));
    let rule = rule_literal(rule);
    let loss_at = |o: usize| format!("{} + row", c.out_ptr(o));
    let (o, loss) = match stores {
        Stores::Loss(lo) => {
            return format!(
                "        fs_cross_entropy_row<{}, {}>({x}, {t}, {}, C, {rule});\n",
                c.in_el(0),
                c.out_el(lo),
                loss_at(lo)
            )
        }
        Stores::Grad(o) => (o, None),
        Stores::Both { loss, grad } => (grad, Some(loss)),
    };
    // Rows padded past the classes (to the gradient's pitch) get zeros: a
    // GEMM run at the padded k reads them (kernel::pitch::pad_gemm_sizes).
    let end = pitch(c.k.outputs[c.outs[o]]);
    let g = format!("{} + row * {end}", c.out_ptr(o));
    let (with_loss, l_el, l_ptr) = match loss {
        Some(lo) => ("true", c.out_el(lo), loss_at(lo)),
        None => ("false", "fs_el::F32", "nullptr".to_string()),
    };
    let dl = c.ld(2, "row");
    match vector_row(c, o) {
        Some(end) => format!(
            "        fs_cross_entropy_grad_row8<{}, {with_loss}, {l_el}>({x}, {t}, {dl}, {g}, C, {end}LL, {l_ptr}, {rule});\n",
            c.in_el(0)
        ),
        None => format!(
            "        fs_cross_entropy_grad_row<{}, {}, {with_loss}, {l_el}>({x}, {t}, {dl}, {g}, C, {end}, {l_ptr}, {rule});\n",
            c.in_el(0),
            c.out_el(o),
        ),
    }
}
