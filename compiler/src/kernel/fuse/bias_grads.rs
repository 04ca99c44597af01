//! A bias's gradient computed by the weight-gradient GEMM beside it: the
//! column sums of `dy` (`sum` over every axis but the last), where a later
//! product `x^T @ dy` reads the same `dy` as stored, become that GEMM's
//! cuBLASLt BGRADA epilogue, which sums `dy` while it reads it for the
//! product. One pass over `dy` and one launch fewer per bias; a transformer
//! layer has six. Only 16-bit `dy`: an f32 product takes three TF32
//! products (`select::Choice::SplitGemm`), whose copies of B do not sum to
//! B, and cuBLASLt has no BGRADA for a transposed B.

use super::*;
use crate::ops::ReduceKind;

/// `kernels` with every such sum moved into its GEMM (the sum's kernel
/// removed, its output the GEMM's second).
pub(super) fn bias_grads_into_gemms(
    g: &Graph,
    buffers: &[Buffer],
    mut kernels: Vec<Kernel>,
) -> Vec<Kernel> {
    if !g.lowering_on("bias-grad-epilogues") {
        return kernels;
    }
    let mut si = 0;
    while si < kernels.len() {
        match gemm_for_sum(g, buffers, &kernels, si) {
            Some(mi) => {
                let sum = kernels.remove(si);
                let m = &mut kernels[mi - 1];
                m.outputs.push(sum.outputs[0]);
                m.nodes.extend(sum.nodes);
                let n = match m.body {
                    Body::Op(n) | Body::Gemm(n, _) => n,
                    _ => unreachable!("gemm_for_sum found a product"),
                };
                m.body = Body::Gemm(
                    n,
                    Epilogue {
                        bias_grad: Some(1),
                        ..Epilogue::default()
                    },
                );
            }
            None => si += 1,
        }
    }
    kernels
}

/// The position of the GEMM that can take kernel `si`'s sum, if it is a
/// bias gradient and there is one.
fn gemm_for_sum(g: &Graph, buffers: &[Buffer], kernels: &[Kernel], si: usize) -> Option<usize> {
    let s = &kernels[si];
    let Body::Op(sn) = s.body else { return None };
    let Op::Reduce(r) = &g.g[sn].op else {
        return None;
    };
    let dy_ty = g.ty(g.inputs(sn)[0]);
    // Summed over leading axes: the rest (a bias of q's heads is [H, Dh])
    // is one row of the product's B.
    let lead = r.axes.len();
    let column_sums = r.kind == ReduceKind::Sum
        && !r.keepdim
        && (1..dy_ty.rank()).contains(&lead)
        && r.axes == (0..lead).collect::<Vec<_>>();
    if !column_sums
        || s.inputs.len() != 1
        || s.outputs.len() != 1
        || s.input_views[0].is_some()
        || s.residual.is_some()
    {
        return None;
    }
    let (dy, out) = (s.inputs[0], s.outputs[0]);
    // Read whole, as stored (a reshape of the buffer at most).
    if !matches!(buffers[dy].ty.dtype, DType::BF16 | DType::F16)
        || buffers[dy].ty.numel() != dy_ty.numel()
    {
        return None;
    }
    for (mi, m) in kernels.iter().enumerate().skip(si + 1) {
        let product = match &m.body {
            Body::Op(n) => Some(*n),
            Body::Gemm(n, e) if e.is_empty() => Some(*n),
            _ => None,
        }
        .filter(|n| matches!(g.g[*n].op, Op::MatMul(_)));
        if let Some(mn) = product {
            let b_ty = g.ty(g.inputs(mn)[1]);
            let fits = m.inputs.len() == 2
                && m.inputs[1] == dy
                && m.input_views[1].is_none()
                && m.outputs.len() == 1
                && m.residual.is_none()
                && b_ty.rank() == 2
                && g.g[mn].outputs[0].rank() == 2
                && row_of(&dy_ty.shape[lead..]) == b_ty.shape.last().and_then(|d| d.as_const())
                && b_ty.numel() == dy_ty.numel()
                && buffers[m.outputs[0]].ty.dtype == buffers[out].ty.dtype
                && !m.inputs.contains(&out);
            if fits {
                return Some(mi);
            }
        }
        // The sum's result must not be read before it would be written.
        if m.inputs.contains(&out) || m.outputs.contains(&out) {
            return None;
        }
    }
    None
}

/// The element count of `dims` where every size is known.
fn row_of(dims: &[Dim]) -> Option<i64> {
    dims.iter().try_fold(1i64, |n, d| Some(n * d.as_const()?))
}
