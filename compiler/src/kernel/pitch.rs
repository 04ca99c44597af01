//! Padded rows and padded GEMM sizes. A [rows, N] matrix of 16-bit values
//! whose rows are not a multiple of 16 bytes (GPT-2's 50257-entry
//! vocabulary) makes cuBLASLt fall back to its slow unaligned kernels, and
//! an odd `n` or `k` keeps it slow even with aligned rows: on an H100 the
//! products of the output projection ran at 96 and 134 TFLOP/s where the
//! same products at 50304 run several times faster. So a buffer that only
//! GEMMs and the cross-entropy row kernel touch is stored with its rows
//! padded to a multiple of 64 elements (the row pitch; those kernels take
//! it as the leading dimension and nothing else sees it), and the GEMMs
//! over it run at the padded size where the padding they read is zero: the
//! table they multiply (a cast copy of a parameter) gets zero rows after its
//! last, which its cast writes every step, and the cross-entropy gradient
//! writes zeros into its padded columns. Zero rows give zero products, so
//! every value the model defines is unchanged; the parameters, checkpoints
//! and losses keep the model file's sizes.

use super::{Body, BufKind, GemmPad, Kernel, Program};
use crate::ir::Graph;
use crate::ops::Op;

/// Bytes a row must be a multiple of for cuBLASLt's aligned kernels.
const ROW_ALIGN: i64 = 16;

/// Elements a padded row (and a padded GEMM size) is a multiple of: the
/// sizes at which cuBLASLt's tiles divide the product (50257 becomes 50304).
const PAD_TO: i64 = 64;

/// Only rows at least this long are padded (the waste stays under 1%).
const MIN_ROW: i64 = 1024;

/// Sets `pitch` on every buffer that gains from it and whose every reader
/// and writer honours it.
pub fn pad_rows(g: &Graph, p: &mut Program) {
    for b in 0..p.buffers.len() {
        let buf = &p.buffers[b];
        let size = buf.ty.dtype.size_bytes() as i64;
        let Some(n) = buf.ty.shape.last().and_then(|d| d.as_const()) else {
            continue;
        };
        if buf.kind != BufKind::Temp
            || buf.ty.shape.len() < 2
            || n < MIN_ROW
            || n.checked_mul(size).is_none_or(|row| row % ROW_ALIGN == 0)
            || g.outputs.iter().any(|(_, v)| *v == buf.value)
        {
            continue;
        }
        let honours = p.kernels.iter().all(|k| {
            let touches = k.inputs.contains(&b) || k.outputs.contains(&b);
            !touches
                || match k.body {
                    Body::Gemm(..) => true,
                    Body::Op(op) if matches!(g.g[op].op, Op::MatMul(_)) => true,
                    // A sum over every axis but the last (a bias gradient)
                    // reading it as its one input, rows at the pitch.
                    Body::Op(op)
                        if matches!(&g.g[op].op, Op::Reduce(r) if r.axes.len() + 1 == buf.ty.shape.len())
                            && super::forms::leading_sum(g, op).is_some() =>
                    {
                        k.inputs == [b] && !k.outputs.contains(&b)
                    }
                    // The same sum as a member of a group of sums
                    // (groups::group_adjacent_sums), which reads its
                    // input's rows at the pitch as its own kernel would.
                    Body::Group(ref ms) => {
                        !k.outputs.contains(&b)
                            && ms.iter().all(|m| {
                                let reads = m.inputs.iter().any(|&s| k.inputs[s] == b);
                                !reads
                                    || (m.chain.is_none()
                                        && m.inputs.len() == 1
                                        && matches!(&g.g[m.node].op, Op::Reduce(r) if r.axes.len() + 1 == buf.ty.shape.len())
                                        && super::forms::leading_sum(g, m.node).is_some())
                            })
                    }
                    // The logits (input 0) of either cross-entropy, and
                    // the gradient (output 0) of the fused one.
                    Body::Op(op) => {
                        let grad_out = matches!(g.g[op].op, Op::CrossEntropyWithGrad(_));
                        let ce = grad_out || matches!(g.g[op].op, Op::CrossEntropy(_));
                        let read = k.inputs.iter().position(|&x| x == b);
                        let written = k.outputs.iter().position(|&x| x == b);
                        ce && k.residual.is_none()
                            && !k.inputs.iter().skip(1).any(|&x| x == b)
                            && !k.outputs.iter().skip(1).any(|&x| x == b)
                            && (read == Some(0) || written == Some(0) && grad_out)
                    }
                    _ => false,
                }
        });
        if honours {
            p.buffers[b].pitch = round_up(n);
        }
    }
    // The fused cross-entropy writes its gradient over its logits: where
    // only one of the two could be padded (a bias gradient sums the
    // logits' gradient), padding neither keeps them in one storage.
    for k in &p.kernels {
        let Body::Op(op) = k.body else { continue };
        if !matches!(g.g[op].op, Op::CrossEntropyWithGrad(_)) {
            continue;
        }
        let (x, dx) = (k.inputs[0], k.outputs[0]);
        if p.buffers[x].pitch != p.buffers[dx].pitch {
            p.buffers[x].pitch = None;
            p.buffers[dx].pitch = None;
        }
    }
}

fn round_up(n: i64) -> Option<i64> {
    n.checked_add(PAD_TO - 1).map(|x| x / PAD_TO * PAD_TO)
}

/// Runs the products of an awkward size at the padded one where their
/// padding reads as zero: `n` where the product's rows are as long as the
/// pitch and its `B` is a table read transposed (`x @ wte^T`), `k` where
/// `A` is a cross-entropy gradient (zero past its last column) and `B` the
/// table (`dlogits @ wte`). The table is a parameter's cast copy, computed
/// each step, whose cast writes the zero rows after it.
pub fn pad_gemm_sizes(g: &Graph, p: &mut Program) {
    for ki in 0..p.kernels.len() {
        let k = &p.kernels[ki];
        // A plain product, or one whose epilogue adds a bias alone (BERT's
        // `h @ transpose(wte) + bias`): the bias, a cast copy too, gets
        // zeros after its last element, so the padded columns stay zero.
        let (op, bias) = match &k.body {
            Body::Op(op) if k.inputs.len() == 2 => (*op, None),
            Body::Gemm(op, e)
                if e.bias.is_some()
                    && e.residual.is_none()
                    && !e.gelu
                    && e.dgelu.is_none()
                    && k.inputs.len() == 3 =>
            {
                (*op, e.bias.map(|slot| k.inputs[slot]))
            }
            _ => continue,
        };
        if !matches!(g.g[op].op, Op::MatMul(_)) || k.residual.is_some() {
            continue;
        }
        let (a, b, d) = (k.inputs[0], k.inputs[1], k.outputs[0]);
        let b_transposed = k.input_views.get(1).is_some_and(|v| v.is_some());
        let a_transposed = k.input_views.first().is_some_and(|v| v.is_some());
        // The table's gradient, `dlogits^T @ x`: m over the logits' padded
        // columns (zeros), into rows of zeros after the gradient's last.
        if bias.is_none() && a_transposed && !b_transposed {
            if let Some(pad) = weight_gradient_rows(g, p, a, d) {
                p.buffers[d].zero_rows = pad - p.buffers[d].ty.shape[0].as_const().unwrap_or(pad);
                p.gemm_pads.insert(
                    ki,
                    GemmPad {
                        m: Some(pad),
                        ..GemmPad::default()
                    },
                );
            }
            continue;
        }
        let Some(table_rows) = cast_table_rows(g, p, b) else {
            continue;
        };
        let Some(padded) = round_up(table_rows).filter(|&x| x != table_rows) else {
            continue;
        };
        let out_cols = p.buffers[d].ty.shape.last().and_then(|x| x.as_const());
        let a_cols = p.buffers[a].ty.shape.last().and_then(|x| x.as_const());
        let pad =
            if b_transposed && out_cols == Some(table_rows) && p.buffers[d].pitch == Some(padded) {
                // n: the padded columns of the product are x . 0 (+ 0) = 0.
                GemmPad {
                    n: Some(padded),
                    ..GemmPad::default()
                }
            } else if bias.is_none()
                && !b_transposed
                && !a_transposed
                && a_cols == Some(table_rows)
                && p.buffers[a].pitch == Some(padded)
                && zero_past_columns(g, p, a)
            {
                GemmPad {
                    k: Some(padded),
                    ..GemmPad::default()
                }
            } else {
                continue;
            };
        if let Some(bias) = bias {
            if cast_vector_len(g, p, bias) != Some(table_rows) {
                continue;
            }
            p.buffers[bias].zero_rows = padded - table_rows;
        }
        p.buffers[b].zero_rows = padded - table_rows;
        p.gemm_pads.insert(ki, pad);
    }
}

/// The padded rows of a product `a^T @ x` into `d` ([rows, cols]) where `a`
/// is a cross-entropy gradient with padded columns that hold zeros, one per
/// row of `d`, and `d` a temporary that only this kernel writes: the
/// product's extra rows are zeros, stored after `d`'s last.
fn weight_gradient_rows(g: &Graph, p: &Program, a: usize, d: usize) -> Option<i64> {
    let (ab, db) = (&p.buffers[a], &p.buffers[d]);
    let rows = db.ty.shape.first()?.as_const()?;
    let pitch = ab.pitch?;
    let writers = p.kernels.iter().filter(|k| k.outputs.contains(&d)).count();
    (db.ty.shape.len() == 2
        && db.kind == BufKind::Temp
        && db.pitch.is_none()
        && writers == 1
        && !g.outputs.iter().any(|(_, v)| *v == db.value)
        && ab.ty.shape.last()?.as_const()? == rows
        && round_up(rows) == Some(pitch)
        && zero_past_columns(g, p, a))
    .then_some(pitch)
}

/// The one writer of `b`, where it is the parameter-cast group and one of
/// its casts writes `b` (so it can write zeros after `b`'s end each step);
/// or `b` is a parameter kept in the compute dtype (ZeRO's master weights),
/// which only the stores of the owners' pieces write, never past its end,
/// and whose zero rows the runtime writes with its values
/// (`Executor::write`).
fn cast_writer(g: &Graph, p: &Program, b: usize) -> bool {
    let buf = &p.buffers[b];
    if buf.kind == BufKind::Param {
        return buf.ty.dtype.size_bytes() == 2
            && p.kernels
                .iter()
                .filter(|k| k.outputs.contains(&b))
                .all(|k| {
                    let store = |n: petgraph::stable_graph::NodeIndex| {
                        matches!(g.g[n].op, Op::StorePiece(_))
                    };
                    match &k.body {
                        Body::Group(ms) => ms.iter().all(|m| store(m.node)),
                        Body::Op(n) => store(*n),
                        _ => false,
                    }
                });
    }
    if buf.kind != BufKind::Temp || g.outputs.iter().any(|(_, v)| *v == buf.value) {
        return false;
    }
    let writers: Vec<&Kernel> = p
        .kernels
        .iter()
        .filter(|k| k.outputs.contains(&b))
        .collect();
    let [writer] = writers.as_slice() else {
        return false;
    };
    let Body::Group(members) = &writer.body else {
        return false;
    };
    members.iter().any(|m| {
        matches!(g.g[m.node].op, Op::Cast(_))
            && m.outputs.len() == 1
            && writer.outputs[m.outputs[0]] == b
    })
}

/// The length of a [len] vector that a cast in the parameter-cast group
/// writes and nothing else does.
fn cast_vector_len(g: &Graph, p: &Program, b: usize) -> Option<i64> {
    let shape = &p.buffers[b].ty.shape;
    if shape.len() != 1 || !cast_writer(g, p, b) {
        return None;
    }
    shape[0].as_const()
}

/// The rows of a [rows, cols] buffer that a cast in the parameter-cast group
/// writes and nothing else does: one whose rows past the last can be zeroed
/// each step by its writer.
fn cast_table_rows(g: &Graph, p: &Program, b: usize) -> Option<i64> {
    let buf = &p.buffers[b];
    if buf.ty.shape.len() != 2 || !cast_writer(g, p, b) {
        return None;
    }
    buf.ty.shape[0].as_const().filter(|&r| r >= MIN_ROW)
}

/// Whether every writer of `a` leaves zeros in its padded columns: the
/// cross-entropy gradient, which writes them.
fn zero_past_columns(g: &Graph, p: &Program, a: usize) -> bool {
    let writers: Vec<&Kernel> = p
        .kernels
        .iter()
        .filter(|k| k.outputs.contains(&a))
        .collect();
    !writers.is_empty()
        && writers.iter().all(|k| {
            matches!(k.body, Body::Op(op) if matches!(g.g[op].op, Op::CrossEntropyWithGrad(_)))
                && k.outputs.first() == Some(&a)
        })
}
