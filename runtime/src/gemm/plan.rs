//! Turning a product into cuBLASLt objects: the column-major view of our
//! row-major product (see the parent module's doc), the descriptors and
//! layouts built from it, and the heuristic's candidate algorithms. Kept
//! apart because it is the one place that speaks cuBLASLt's attribute API.

use super::request::{cuda_type, Kind};
use super::{Algo, EpiloguePtrs, Gemm, GemmElem, GemmShape, Key, Plan, WORKSPACE_BYTES};
use crate::gemm_tuning;
use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys;
use std::ffi::c_void;
use sys::cublasLtMatmulDescAttributes_t as DescAttr;
use sys::cublasLtMatmulDesc_t as Desc;
use sys::cublasLtMatmulPreferenceAttributes_t as PrefAttr;
use sys::cublasLtMatmulPreference_t as Pref;
use sys::cublasLtMatrixLayoutAttribute_t as LayoutAttr;
use sys::cublasLtMatrixLayout_t as Layout;

// Attribute setters taking a value of the attribute's documented C type.
// SAFETY (all three): the object is live and `v` has the attribute's type.
unsafe fn desc_attr<T>(d: Desc, a: DescAttr, v: T) -> Result<(), CublasError> {
    result::set_matmul_desc_attribute(d, a, &v as *const T as *const c_void, size_of::<T>())
}

unsafe fn layout_attr<T>(l: Layout, a: LayoutAttr, v: T) -> Result<(), CublasError> {
    result::set_matrix_layout_attribute(l, a, &v as *const T as *const c_void, size_of::<T>())
}

unsafe fn pref_attr<T>(p: Pref, a: PrefAttr, v: T) -> Result<(), CublasError> {
    result::set_matmul_pref_attribute(p, a, &v as *const T as *const c_void, size_of::<T>())
}

/// Points the descriptor at this call's bias and aux buffers.
///
/// # Safety
/// `desc` is live.
pub(super) unsafe fn set_pointers(desc: Desc, ep: &EpiloguePtrs) -> Result<(), CublasError> {
    use DescAttr::*;
    if let Some(bias) = ep.bias {
        desc_attr(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias)?;
    }
    if let Some(aux) = ep.gelu_aux_out.or(ep.dgelu_aux_in) {
        desc_attr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux)?;
    }
    Ok(())
}

/// A column-major matrix as cuBLASLt sees it: type, rows, columns, batch
/// stride and leading dimension.
type Mat = (GemmElem, u64, u64, u64, u64);

/// cuBLASLt's view of the product (see the `gemm` module's doc): its TRANSA and
/// TRANSB, and for its A (our B), B (our A) and D the type, rows, columns
/// and batch stride of the column-major matrix as stored (packed, so the
/// leading dimension is the row count). Our B stored `[k, n]` row-major is
/// `n x k` column-major, read as is; stored `[n, k]` it is `k x n`, read
/// transposed. Our A likewise; D is `n x m`.
fn column_major(s: &GemmShape) -> ([i32; 2], [Mat; 3]) {
    let (op_a, rows_a, cols_a) = [(0, s.n, s.k), (1, s.k, s.n)][s.b_transposed as usize];
    let (op_b, rows_b, cols_b) = [(0, s.k, s.m), (1, s.m, s.k)][s.a_transposed as usize];
    // A stored row is a column here: the leading dimension is the row
    // length, or the row pitch where rows are padded.
    let ld = |rows: u64, pitch: u64| if pitch == 0 { rows } else { pitch };
    let mats = [
        (
            s.in_type,
            rows_a,
            cols_a,
            s.batch_stride_b,
            ld(rows_a, s.pitch_b),
        ),
        (
            s.in_type,
            rows_b,
            cols_b,
            s.batch_stride_a,
            ld(rows_b, s.pitch_a),
        ),
        (s.out_type, s.n, s.m, s.batch_stride_d, ld(s.n, s.pitch_d)),
    ];
    ([op_a, op_b], mats)
}

impl Gemm {
    /// The descriptor and layouts for `key`, pointed at `ep`'s buffers (the
    /// heuristic reads the bias and aux pointers' alignment), with its
    /// algorithm set to cuBLASLt's first choice; and every algorithm the
    /// heuristic offers, best ranked first (at least one).
    pub(super) fn plan(
        handle: sys::cublasLtHandle_t,
        key: &Key,
        ep: &EpiloguePtrs,
    ) -> Result<(Plan, Vec<Algo>), CublasError> {
        use {DescAttr::*, LayoutAttr::*, PrefAttr::*};
        let s = &key.spec;
        let null = std::ptr::null_mut();
        // SAFETY: zeroed is a valid (if meaningless) algo; it is overwritten below.
        let algo = unsafe { std::mem::zeroed() };
        let mut plan = Plan {
            desc: null,
            layouts: [null.cast(); 3],
            algo,
        };
        let compute = match key.tf32 {
            true => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            false => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        plan.desc = result::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)?;
        let ([op_a, op_b], mats) = column_major(s);
        // SAFETY: every object is live once created; each value has its
        // attribute's documented C type (int32 ops and batch count, uint32
        // epilogue and alignments, int64 ld and strides, uint64 workspace).
        unsafe {
            for (i, (t, rows, cols, stride, ld)) in mats.into_iter().enumerate() {
                let l = result::create_matrix_layout(cuda_type(t), rows, cols, ld as i64)?;
                plan.layouts[i] = l;
                if s.batch > 1 {
                    layout_attr(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, s.batch as i32)?;
                    let stride = stride as i64;
                    layout_attr(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride)?;
                }
            }
            let desc = plan.desc;
            desc_attr(desc, CUBLASLT_MATMUL_DESC_TRANSA, op_a)?;
            desc_attr(desc, CUBLASLT_MATMUL_DESC_TRANSB, op_b)?;
            desc_attr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, key.kind.cublas().0)?;
            // The bias type defaults to D's and its batch stride to 0 (one
            // bias for every batch): both what we want. The aux buffer has
            // D's type (also the default), shape and strides.
            if matches!(key.kind, Kind::GeluAux | Kind::GeluAuxBias | Kind::DGelu) {
                desc_attr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, s.n as i64)?;
                let stride = s.batch_stride_d as i64;
                desc_attr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, stride)?;
            }
            set_pointers(desc, ep)?;
            // cuBLASLt's choices within our workspace and the buffers' real
            // alignment.
            let pref = result::create_matmul_pref()?;
            let prefs = [
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align[0]),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align[1]),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align[2]),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align[3]),
            ];
            let found = (|| {
                pref_attr(
                    pref,
                    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    WORKSPACE_BYTES as u64,
                )?;
                for (attr, v) in prefs {
                    pref_attr(pref, attr, v)?;
                }
                let [la, lb, ld] = plan.layouts;
                let mut results = [std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>();
                    gemm_tuning::CANDIDATES];
                let mut count = 0;
                sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    desc,
                    la,
                    lb,
                    ld,
                    ld,
                    pref,
                    gemm_tuning::CANDIDATES as i32,
                    results.as_mut_ptr(),
                    &mut count,
                )
                .result()?;
                let algos: Vec<Algo> = results[..count.max(0) as usize]
                    .iter()
                    .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                    .map(|r| r.algo)
                    .collect();
                if algos.is_empty() {
                    return Err(CublasError(
                        sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
                    ));
                }
                Ok(algos)
            })();
            let _ = result::destroy_matmul_pref(pref);
            let algos = found?;
            plan.algo = algos[0];
            Ok((plan, algos))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLASLt's column-major semantics run on the CPU with the layouts
    /// `column_major` gives must be our row-major product, for every
    /// transpose and with batch strides (the part a GPU-less machine can check).
    #[test]
    fn column_major_view_computes_the_row_major_product() {
        let (m, n, k, batch) = (3u64, 5u64, 4u64, 2u64);
        for (at, bt) in [(false, false), (true, false), (false, true), (true, true)] {
            let s = GemmShape {
                batch,
                a_transposed: at,
                b_transposed: bt,
                batch_stride_a: m * k + 1,
                batch_stride_b: 0,
                batch_stride_d: m * n + 2,
                ..GemmShape::plain(m, n, k, GemmElem::F32, GemmElem::F32)
            };
            let a: Vec<f64> = (0..2 * m * k + 1)
                .map(|x| (x * 7 % 11) as f64 - 5.0)
                .collect();
            let b: Vec<f64> = (0..k * n).map(|x| (x * 5 % 13) as f64 - 6.0).collect();
            let ([op_a, op_b], [(_, ra, ca, sa, _), (_, rb, cb, sb, _), (_, rd, cd, sd, _)]) =
                column_major(&s);
            assert_eq!((rd, cd), (n, m));
            // op(X)(r, c) of a column-major X with ld = rows.
            let op = |x: &[f64], off: u64, rows: u64, t: i32, r: u64, c: u64| match t {
                0 => x[(off + r + c * rows) as usize],
                _ => x[(off + c + r * rows) as usize],
            };
            for p in 0..batch {
                for r in 0..n {
                    for c in 0..m {
                        // cuBLASLt: D(r, c) = sum_l op(A)(r, l) op(B)(l, c), A = our b, B = our a.
                        let lt: f64 = (0..k)
                            .map(|l| {
                                op(&b, p * sa, ra, op_a, r, l) * op(&a, p * sb, rb, op_b, l, c)
                            })
                            .sum();
                        let (i, j) = (c, r); // our D[i, j] sits at i * n + j = c * rd + r
                        let ours: f64 = (0..k)
                            .map(|l| {
                                let av = if at {
                                    a[(p * (m * k + 1) + l * m + i) as usize]
                                } else {
                                    a[(p * (m * k + 1) + i * k + l) as usize]
                                };
                                let bv = if bt {
                                    b[(j * k + l) as usize]
                                } else {
                                    b[(l * n + j) as usize]
                                };
                                av * bv
                            })
                            .sum();
                        assert_eq!(lt, ours, "aT={at} bT={bt} batch {p} D[{i},{j}]");
                        assert_eq!(p * sd + c * rd + r, p * s.batch_stride_d + i * n + j);
                    }
                }
                let _ = (ca, cb);
            }
        }
    }
}
