//! Row-major GEMMs with fused epilogues through cuBLASLt (loaded at run time
//! like the rest of CUDA). cudarc's safe `Matmul` cannot express the GELU
//! aux output, DGELU or a residual in C, so this drives the `result`/`sys`
//! level directly.
//!
//! cuBLASLt is column-major. A row-major `[r, c]` buffer is the same bytes
//! as a column-major `c x r` matrix, so `D = A @ B` (row-major) is computed
//! as `D^T = B^T @ A^T` (column-major): our B becomes cuBLASLt's A, our A its
//! B, and m and n swap. cuBLASLt's bias is per row of its (column-major)
//! output, which is per column `j` of our row-major D: exactly a bias of
//! length n added to every row.

use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, DriverError};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use sys::cublasLtMatmulDescAttributes_t as DescAttr;
use sys::cublasLtMatmulDesc_t as Desc;
use sys::cublasLtMatmulPreferenceAttributes_t as PrefAttr;
use sys::cublasLtMatmulPreference_t as Pref;
use sys::cublasLtMatrixLayoutAttribute_t as LayoutAttr;
use sys::cublasLtMatrixLayout_t as Layout;
type Algo = sys::cublasLtMatmulAlgo_t;

use crate::gemm_tuning::{self, Tuning, TuningStats};

mod request;
use request::{cuda_type, describe, Kind};
pub use request::{EpiloguePtrs, GemmChecks, GemmElem, GemmError, GemmShape};

/// The workspace cuBLASLt may use (NVIDIA's recommendation for Hopper;
/// more than enough for earlier GPUs).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// What one cached product is planned with: everything but the addresses.
/// Its `Debug` text keys the on-disk choice of algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    spec: GemmShape,
    kind: Kind,
    residual: bool,
    tf32: bool,
    /// Byte alignment of cuBLASLt's A, B, C, D, bias and aux: the heuristic
    /// only picks kernels valid for the alignment it is told (default 256),
    /// so an algorithm chosen for aligned buffers may be wrong for others.
    align: [u32; 6],
}

/// The largest power of two (at most 256) dividing the address and the
/// batch stride in bytes, i.e. the alignment every batch's matrix has.
fn alignment(addr: u64, stride_bytes: u64) -> u32 {
    1 << (addr | stride_bytes | 256).trailing_zeros()
}

/// cuBLASLt objects for one key; whatever was created is destroyed on drop,
/// so a plan that fails halfway leaks nothing.
struct Plan {
    desc: Desc,
    /// cuBLASLt's A (our B), B (our A) and D (also C: the residual is D-shaped).
    layouts: [Layout; 3],
    algo: Algo,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once by cuBLASLt and is destroyed
        // once here; drop cannot report errors, so they are ignored.
        unsafe {
            for l in self.layouts.into_iter().filter(|l| !l.is_null()) {
                let _ = result::destroy_matrix_layout(l);
            }
            if !self.desc.is_null() {
                let _ = result::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// A cuBLASLt handle, its workspace and the plans of products already run.
pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    _workspace: CudaSlice<u8>,
    workspace_ptr: u64,
    plans: HashMap<Key, Plan>,
    /// Lets F32 products use TF32 tensor cores (about 10 mantissa bits).
    pub allow_tf32: bool,
    /// What [`Gemm::run_split`] copies the operands with.
    pub split_kernels: Option<crate::gemm_split::SplitKernels>,
    /// How each product's algorithm is chosen (set before the first step).
    pub tuning: Tuning,
    stats: TuningStats,
}

/// The addresses one product runs with: cuBLASLt's A (our B), B (our A),
/// C and D.
#[derive(Clone, Copy)]
struct Ptrs {
    a: u64,
    b: u64,
    c: u64,
    d: u64,
}

// SAFETY: the handle and descriptors are host objects cuBLASLt lets move
// between threads; `run` takes `&mut self`, so no two threads share them.
unsafe impl Send for Gemm {}

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
unsafe fn set_pointers(desc: Desc, ep: &EpiloguePtrs) -> Result<(), CublasError> {
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

/// cuBLASLt's view of the product (see the module doc): its TRANSA and
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

/// Maps cuBLASLt's library (hundreds of megabytes: some 100 ms) ahead of
/// its first use, on whatever thread calls it; nothing where it is absent.
pub fn preload_library() {
    // SAFETY: only the dynamic loader; `culib` keeps the library mapped
    // for the process's life, after `is_culib_present` made sure it exists
    // (`culib` panics otherwise).
    unsafe {
        if sys::is_culib_present() {
            sys::culib();
        }
    }
}

impl Gemm {
    /// A handle and a 32 MiB workspace on `stream`, where every `run` goes.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Gemm, GemmError> {
        // SAFETY: only probes the dynamic loader. Checked first because
        // cudarc panics when a missing library is first used.
        if !unsafe { sys::is_culib_present() } {
            return Err(GemmError::NotLoaded);
        }
        let driver = |what| {
            move |e: DriverError| GemmError::Driver {
                what,
                detail: format!("{e:?}"),
            }
        };
        // cuBLASLt works in the thread's current context.
        stream
            .context()
            .bind_to_thread()
            .map_err(driver("binding the CUDA context"))?;
        // SAFETY: the workspace is scratch; uninitialised is fine.
        let mut workspace = unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) }
            .map_err(driver("allocating the cuBLASLt workspace"))?;
        // Only this stream uses the workspace, so its address can be kept.
        let workspace_ptr = workspace.device_ptr_mut(stream).0;
        let handle = result::create_handle().map_err(|e| GemmError::Cublas {
            product: String::new(),
            call: "cublasLtCreate",
            status: e.0,
        })?;
        Ok(Gemm {
            handle,
            stream: stream.clone(),
            _workspace: workspace,
            workspace_ptr,
            plans: HashMap::new(),
            allow_tf32: false,
            split_kernels: None,
            tuning: Tuning::First,
            stats: TuningStats::default(),
        })
    }

    /// How many distinct products have been planned.
    pub fn cached_plans(&self) -> usize {
        self.plans.len()
    }

    /// How the planned products' algorithms were chosen.
    pub fn tuning_stats(&self) -> TuningStats {
        self.stats
    }

    /// `d = epilogue(a @ b)`, enqueued on the stream. Pointers are raw
    /// device addresses; the caller keeps the buffers alive, sized as the
    /// spec says and ordered on this stream.
    pub fn run(
        &mut self,
        spec: &GemmShape,
        a: u64,
        b: u64,
        d: u64,
        ep: &EpiloguePtrs,
    ) -> Result<(), GemmError> {
        let tf32 = self.allow_tf32 && spec.in_type == GemmElem::F32;
        self.run_with(spec, a, b, d, ep, tf32)
    }

    /// [`Gemm::run`] for f32 operands as three TF32 products: the split
    /// kernels copy A and B into `scratch` (address, f32 elements) three
    /// times along K, as hi, lo and hi parts (`kernels/gemm/
    /// split_tf32.cuh`), and one TF32 product over K tripled takes them.
    pub fn run_split(
        &mut self,
        spec: &GemmShape,
        a: u64,
        b: u64,
        d: u64,
        ep: &EpiloguePtrs,
        scratch: (u64, u64),
    ) -> Result<(), GemmError> {
        spec.validate(ep)?;
        let invalid = |reason: String| GemmError::Invalid {
            product: describe(spec, ep),
            reason,
        };
        let kernels = self
            .split_kernels
            .as_ref()
            .ok_or_else(|| invalid("the TF32 split kernels were not loaded".into()))?;
        let tripled = crate::gemm_split::split_operands(spec, a, b, scratch, kernels, &self.stream)
            .map_err(invalid)?;
        self.run_with(&tripled.spec, tripled.a, tripled.b, d, ep, true)
    }

    fn run_with(
        &mut self,
        spec: &GemmShape,
        a: u64,
        b: u64,
        d: u64,
        ep: &EpiloguePtrs,
        tf32: bool,
    ) -> Result<(), GemmError> {
        spec.validate(ep)?;
        if a == 0 || b == 0 || d == 0 {
            let (product, reason) = (describe(spec, ep), "a null pointer for A, B or D".into());
            return Err(GemmError::Invalid { product, reason });
        }
        let fail = |call| {
            move |e: CublasError| GemmError::Cublas {
                product: describe(spec, ep),
                call,
                status: e.0,
            }
        };
        let bind = self.stream.context().bind_to_thread();
        bind.map_err(|e| GemmError::Driver {
            what: "binding the CUDA context",
            detail: format!("{e:?}"),
        })?;
        // Batch strides in bytes, where there are batches.
        let bytes = |stride: u64, t: GemmElem| stride * t.bytes() * (spec.batch > 1) as u64;
        let (sa, sb) = (
            bytes(spec.batch_stride_a, spec.in_type),
            bytes(spec.batch_stride_b, spec.in_type),
        );
        let sd = bytes(spec.batch_stride_d, spec.out_type);
        // With beta = 0 C is never read, so D stands in for it.
        let c = ep.residual.unwrap_or(d);
        let key = Key {
            spec: *spec,
            kind: Kind::of(ep),
            residual: ep.residual.is_some(),
            tf32,
            align: [
                alignment(b, sb),
                alignment(a, sa),
                alignment(c, sd),
                alignment(d, sd),
                alignment(ep.bias.unwrap_or(0), 0),
                alignment(ep.gelu_aux_out.or(ep.dgelu_aux_in).unwrap_or(0), sd),
            ],
        };
        let beta = if ep.residual.is_some() { 1.0f32 } else { 0.0 };
        let ptrs = Ptrs { a: b, b: a, c, d };
        if !self.plans.contains_key(&key) {
            let (mut plan, candidates) = Self::plan(self.handle, &key, ep).map_err(fail(
                "planning (descriptors, cublasLtMatmulAlgoGetHeuristic)",
            ))?;
            plan.algo = self.choose(&key, &plan, &candidates, ptrs, ep, beta);
            self.plans.insert(key, plan);
        }
        let plan = &self.plans[&key];
        // SAFETY: the descriptor is live; cuBLASLt copies the pointers at
        // enqueue time, so resetting them per call is fine.
        unsafe { set_pointers(plan.desc, ep) }.map_err(fail("setting the epilogue pointers"))?;
        // SAFETY: the layouts describe the caller's buffers (their contract).
        unsafe { self.enqueue(plan, &plan.algo, ptrs, beta) }.map_err(fail("cublasLtMatmul"))
    }

    /// Enqueues one product with `algo`.
    ///
    /// # Safety
    /// `plan`'s layouts describe the buffers at `p`. The workspace outlives
    /// every enqueued matmul (it is freed on this stream, after them).
    unsafe fn enqueue(
        &self,
        plan: &Plan,
        algo: &Algo,
        p: Ptrs,
        beta: f32,
    ) -> Result<(), CublasError> {
        let alpha = 1.0f32;
        let [la, lb, ld] = plan.layouts;
        result::matmul(
            self.handle,
            plan.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            p.a as *const c_void,
            la,
            p.b as *const c_void,
            lb,
            p.c as *const c_void,
            ld,
            p.d as *mut c_void,
            ld,
            algo,
            self.workspace_ptr as *mut c_void,
            WORKSPACE_BYTES,
            self.stream.cu_stream() as sys::cudaStream_t,
        )
    }

    /// The algorithm a newly planned product runs (see `gemm_tuning`):
    /// cuBLASLt's first choice, the choice kept on disk, or the fastest of
    /// `candidates` timed here on the product's own buffers.
    fn choose(
        &mut self,
        key: &Key,
        plan: &Plan,
        candidates: &[Algo],
        p: Ptrs,
        ep: &EpiloguePtrs,
        beta: f32,
    ) -> Algo {
        let first = candidates[0];
        let Tuning::Timed { dir, gpu } = &self.tuning else {
            return first;
        };
        // SAFETY: a plain query of the loaded library.
        let version = unsafe { sys::cublasLtGetVersion() };
        let path = dir
            .as_deref()
            .map(|d| gemm_tuning::entry_path(d, gpu, version, &format!("{key:?}")));
        if let Some(data) = path.as_deref().and_then(gemm_tuning::load) {
            let algo = Algo { data };
            if self.fits(plan, &algo) {
                self.stats.cached += 1;
                self.stats.changed += usize::from(algo.data != first.data);
                return algo;
            }
        }
        let capturing = !matches!(
            self.stream.capture_status(),
            Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        );
        if capturing || gemm_tuning::writes_over_inputs(&key.spec, ep, p.b, p.a, p.d) {
            self.stats.untimed += 1;
            return first;
        }
        let times: Vec<Option<f64>> = candidates
            .iter()
            .map(|algo| self.time(plan, algo, p, beta))
            .collect();
        let chosen = candidates[gemm_tuning::pick(&times)];
        self.stats.timed += 1;
        self.stats.changed += usize::from(chosen.data != first.data);
        if let Some(path) = path {
            gemm_tuning::store(&path, &chosen.data);
        }
        chosen
    }

    /// Whether a stored algorithm is one cuBLASLt runs for this plan
    /// within our workspace.
    fn fits(&self, plan: &Plan, algo: &Algo) -> bool {
        let [la, lb, ld] = plan.layouts;
        // SAFETY: zeroed is a valid result struct for cuBLASLt to fill.
        let mut r: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: the descriptor and layouts are live; `algo` and `r` are
        // valid for the call.
        let status = unsafe {
            sys::cublasLtMatmulAlgoCheck(self.handle, plan.desc, la, lb, ld, ld, algo, &mut r)
        };
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && r.workspaceSize <= WORKSPACE_BYTES
    }

    /// Milliseconds one product takes with `algo`: a launch to warm, then
    /// the quickest of 3 rounds of 3 back-to-back launches between events.
    /// `None` where it does not run.
    fn time(&self, plan: &Plan, algo: &Algo, p: Ptrs, beta: f32) -> Option<f64> {
        use cudarc::driver::sys::CUevent_flags;
        // SAFETY: as `run_with`'s launch; the product writes only what it
        // writes anyway, and reads nothing it writes (`writes_over_inputs`).
        let launch = || unsafe { self.enqueue(plan, algo, p, beta) }.is_ok();
        let event = || {
            self.stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .ok()
        };
        if !launch() {
            return None;
        }
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let start = event()?;
            for _ in 0..3 {
                if !launch() {
                    return None;
                }
            }
            let end = event()?;
            end.synchronize().ok()?;
            best = best.min(f64::from(start.elapsed_ms(&end).ok()?) / 3.0);
        }
        Some(best)
    }

    /// The descriptor and layouts for `key`, pointed at `ep`'s buffers (the
    /// heuristic reads the bias and aux pointers' alignment), with its
    /// algorithm set to cuBLASLt's first choice; and every algorithm the
    /// heuristic offers, best ranked first (at least one).
    fn plan(
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

impl Drop for Gemm {
    fn drop(&mut self) {
        // Descriptors before the handle; the workspace is freed after, on
        // the stream, behind every matmul that used it.
        self.plans.clear();
        // SAFETY: created in `new`, destroyed once here.
        let _ = unsafe { result::destroy_handle(self.handle) };
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
