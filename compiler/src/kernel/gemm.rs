//! The row-major product each GEMM launch runs, with the plan's sizes
//! bound: what the runtime hands cuBLASLt (and what selection sizes a
//! skinny product by), worked out here from the operands' types and the
//! views the kernel reads them through, so the runtime never reads the
//! graph for it. The plan carries it (`plan::gemm`).

use super::{Kernel, Program};
use crate::ir::graph::Graph;
use crate::ir::types::DType;
use crate::ir::Dim;
use petgraph::stable_graph::NodeIndex;
use serde::Serialize;
use std::collections::BTreeMap;

/// The element types of a product's operands: cuBLASLt takes no integer
/// products, so none is representable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GemmElem {
    F32,
    BF16,
    F16,
}

impl GemmElem {
    /// The element type of a buffer of `d`; `None` for integers.
    pub fn of(d: DType) -> Option<GemmElem> {
        match d {
            DType::F32 => Some(GemmElem::F32),
            DType::BF16 => Some(GemmElem::BF16),
            DType::F16 => Some(GemmElem::F16),
            DType::I32 => None,
        }
    }

    /// The same type as the graph names it.
    pub fn dtype(self) -> DType {
        match self {
            GemmElem::F32 => DType::F32,
            GemmElem::BF16 => DType::BF16,
            GemmElem::F16 => DType::F16,
        }
    }

    pub fn bytes(self) -> u64 {
        self.dtype().size_bytes() as u64
    }

    pub fn name(self) -> &'static str {
        self.dtype().name()
    }
}

/// One (batched) product `D[m, n] = A[m, k] @ B[k, n]`, all row-major: what
/// a GEMM launch of the plan runs and what the runtime asks of cuBLASLt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct GemmShape {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// 1 for a plain product.
    pub batch: u64,
    /// A is stored as `[k, m]` and read transposed.
    pub a_transposed: bool,
    /// B is stored as `[n, k]` and read transposed.
    pub b_transposed: bool,
    /// Element strides between batches; 0 reuses one matrix for every batch.
    pub batch_stride_a: u64,
    pub batch_stride_b: u64,
    pub batch_stride_d: u64,
    /// Elements from one stored row to the next where rows are padded
    /// (kernel::pitch); 0 for packed rows.
    pub pitch_a: u64,
    pub pitch_b: u64,
    pub pitch_d: u64,
    /// Type of A and B.
    pub in_type: GemmElem,
    /// Type of D (and of the epilogue's buffers).
    pub out_type: GemmElem,
}

impl GemmShape {
    /// An unbatched product of contiguous, untransposed operands.
    pub fn plain(m: u64, n: u64, k: u64, in_type: GemmElem, out_type: GemmElem) -> GemmShape {
        GemmShape {
            m,
            n,
            k,
            batch: 1,
            a_transposed: false,
            b_transposed: false,
            batch_stride_a: 0,
            batch_stride_b: 0,
            batch_stride_d: 0,
            pitch_a: 0,
            pitch_b: 0,
            pitch_d: 0,
            in_type,
            out_type,
        }
    }
}

/// The product matmul node `n` of kernel `k` computes at sizes `dims`;
/// why not where a size is unbound or the product is not one cuBLASLt
/// takes.
pub fn gemm_shape(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    n: NodeIndex,
    dims: &BTreeMap<String, i64>,
) -> Result<GemmShape, String> {
    let eval = |d: &Dim| -> Result<u64, String> {
        d.eval(&|s| dims.get(s).copied())
            .and_then(|v| u64::try_from(v).ok())
            .ok_or_else(|| format!("the size {d} is not known"))
    };
    let ins = g.inputs(n);
    let (ta, tb) = (g.ty(ins[0]).clone(), g.ty(ins[1]).clone());
    let out = &g.g[n].outputs[0];
    let r = out.shape.len();
    let (ra, rb) = (ta.rank(), tb.rank());
    // An awkward m, n or k runs rounded up where the operands' padding is
    // zero (kernel::pitch::pad_gemm_sizes).
    let pad = p
        .kernels
        .iter()
        .position(|x| x.name == k.name)
        .and_then(|i| p.gemm_pads.get(&i))
        .copied()
        .unwrap_or_default();
    let m = pad
        .m
        .map_or_else(|| eval(&out.shape[r - 2]), |m| Ok(m as u64))?;
    let nn = pad
        .n
        .map_or_else(|| eval(&out.shape[r - 1]), |n| Ok(n as u64))?;
    let kk = pad
        .k
        .map_or_else(|| eval(&ta.shape[ra - 1]), |k| Ok(k as u64))?;
    let numel =
        |s: &[Dim]| -> Result<u64, String> { s.iter().try_fold(1u64, |acc, d| Ok(acc * eval(d)?)) };
    let batch = numel(&out.shape[..r - 2])?;
    let a_transposed = k.input_views.first().is_some_and(|v| v.is_some());
    let b_transposed = k.input_views.get(1).is_some_and(|v| v.is_some());
    let batch_a = numel(&ta.shape[..ra - 2])?;
    let batch_b = numel(&tb.shape[..rb - 2])?;
    if (batch_a != 1 && batch_a != batch) || (batch_b != 1 && batch_b != batch) {
        return Err("a product whose operands broadcast only some batch axes".into());
    }
    let (Some(in_type), Some(out_type)) = (
        GemmElem::of(ta.dtype),
        GemmElem::of(p.buffers[k.outputs[0]].ty.dtype),
    ) else {
        return Err("a matrix product of integers".into());
    };
    // Padded rows (kernel::pitch): the leading dimension is the pitch.
    let pitch = |b: usize| p.buffers[b].pitch.map_or(0, |x| x as u64);
    let (pitch_a, pitch_b, pitch_d) = (pitch(k.inputs[0]), pitch(k.inputs[1]), pitch(k.outputs[0]));
    // Elements of one stored matrix: its rows times their pitch or length.
    let span = |rows: u64, len: u64, pitch: u64| rows * if pitch == 0 { len } else { pitch };
    let plain = GemmShape {
        m,
        n: nn,
        k: kk,
        batch,
        a_transposed,
        b_transposed,
        batch_stride_a: 0,
        batch_stride_b: 0,
        batch_stride_d: 0,
        pitch_a,
        pitch_b,
        pitch_d,
        in_type,
        out_type,
    };
    // A stack of rows times one matrix is one tall product.
    if batch_b == 1 && batch > 1 && !a_transposed {
        return Ok(GemmShape {
            m: m * batch,
            batch: 1,
            ..plain
        });
    }
    let (rows_a, len_a) = if a_transposed { (kk, m) } else { (m, kk) };
    let (rows_b, len_b) = if b_transposed { (nn, kk) } else { (kk, nn) };
    let stride = |shared: bool, s: u64| if shared { 0 } else { s };
    Ok(GemmShape {
        batch_stride_a: stride(batch_a == 1, span(rows_a, len_a, pitch_a)),
        batch_stride_b: stride(batch_b == 1, span(rows_b, len_b, pitch_b)),
        batch_stride_d: span(m, nn, pitch_d),
        ..plain
    })
}
