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
use sys::cublasLtMatmulDesc_t as Desc;
use sys::cublasLtMatrixLayout_t as Layout;
type Algo = sys::cublasLtMatmulAlgo_t;

use crate::gemm_tuning::{Tuning, TuningStats};

mod plan;
mod request;
mod tune;
use plan::set_pointers;
use request::{describe, Kind};
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
