//! Padded rows. A [rows, N] matrix of 16-bit values whose rows are not a
//! multiple of 16 bytes (GPT-2's 50257-entry vocabulary) makes cuBLASLt
//! fall back to its slow unaligned kernels: on an H100 the three products
//! of the output projection ran at about 100 TFLOP/s instead of 600. A
//! buffer that only GEMMs and the cross-entropy row kernel touch is stored
//! with its rows padded to 16 bytes (the row pitch, in elements); those
//! kernels take the pitch as the leading dimension, nothing else ever sees
//! the padding.

use super::{Body, BufKind, Program};
use crate::ir::Graph;
use crate::ops::Op;

/// Bytes a padded row is a multiple of.
const ROW_ALIGN: i64 = 16;

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
            let per_row = ROW_ALIGN / size.max(1);
            p.buffers[b].pitch = n.checked_add(per_row - 1).map(|x| x / per_row * per_row);
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
