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
use std::fmt;
use std::sync::Arc;
use sys::cublasLtMatmulDescAttributes_t as DescAttr;
use sys::cublasLtMatmulDesc_t as Desc;
use sys::cublasLtMatmulPreferenceAttributes_t as PrefAttr;
use sys::cublasLtMatmulPreference_t as Pref;
use sys::cublasLtMatrixLayoutAttribute_t as LayoutAttr;
use sys::cublasLtMatrixLayout_t as Layout;
type Algo = sys::cublasLtMatmulAlgo_t;

use crate::gemm_tuning::{self, Tuning, TuningStats};

/// The workspace cuBLASLt may use (NVIDIA's recommendation for Hopper;
/// more than enough for earlier GPUs).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Element types of the operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    F32,
    BF16,
    F16,
}

impl Elem {
    pub fn bytes(self) -> u64 {
        match self {
            Elem::F32 => 4,
            Elem::BF16 | Elem::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::BF16 => "bf16",
            Elem::F16 => "f16",
        }
    }

    fn cuda(self) -> sys::cudaDataType {
        match self {
            Elem::F32 => sys::cudaDataType::CUDA_R_32F,
            Elem::BF16 => sys::cudaDataType::CUDA_R_16BF,
            Elem::F16 => sys::cudaDataType::CUDA_R_16F,
        }
    }
}

/// One (batched) product `D[m, n] = A[m, k] @ B[k, n]`, all row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmSpec {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// 1 for a plain product.
    pub batch: u64,
    /// A is stored as `[k, m]` row-major and read transposed.
    pub a_transposed: bool,
    /// B is stored as `[n, k]` row-major and read transposed.
    pub b_transposed: bool,
    /// Element strides between batches; 0 reuses one matrix for every batch.
    pub batch_stride_a: u64,
    pub batch_stride_b: u64,
    pub batch_stride_d: u64,
    /// Elements from one stored row of A, B and D to the next where rows
    /// are padded (a row pitch); 0 for packed rows.
    pub pitch_a: u64,
    pub pitch_b: u64,
    pub pitch_d: u64,
    /// Type of A and B.
    pub in_type: Elem,
    /// Type of D and of the residual, bias and GELU aux buffers.
    pub out_type: Elem,
}

impl GemmSpec {
    /// An unbatched product of contiguous, untransposed operands.
    pub fn plain(m: u64, n: u64, k: u64, in_type: Elem, out_type: Elem) -> GemmSpec {
        GemmSpec {
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

    /// The checks cuBLASLt would fail on less helpfully (or not at all).
    pub fn validate(&self, ep: &EpiloguePtrs) -> Result<(), GemmError> {
        let bad = |reason: &str| {
            Err(GemmError::Invalid {
                product: describe(self, ep),
                reason: reason.to_string(),
            })
        };
        if self.m == 0 || self.n == 0 || self.k == 0 || self.batch == 0 {
            return bad("m, n, k and batch must all be at least 1");
        }
        if self.batch > i32::MAX as u64 {
            return bad("cuBLASLt's batch count is a 32-bit int");
        }
        if self.batch > 1 && self.batch_stride_d < self.m * self.n {
            return bad("batch_stride_d is smaller than m * n, so the batches' outputs overlap");
        }
        let row = |t: bool, a: u64, b: u64| if t { a } else { b };
        if (self.pitch_a != 0 && self.pitch_a < row(self.a_transposed, self.m, self.k))
            || (self.pitch_b != 0 && self.pitch_b < row(self.b_transposed, self.k, self.n))
            || (self.pitch_d != 0 && self.pitch_d < self.n)
        {
            return bad("a row pitch is shorter than its row");
        }
        // The residual and GELU aux buffers take D's packed layout.
        let aux = ep.gelu_aux_out.is_some() || ep.dgelu_aux_in.is_some();
        if self.pitch_d != 0 && (aux || ep.residual.is_some()) {
            return bad("a padded D takes no residual or GELU aux buffer");
        }
        if ep.gelu_aux_out.is_some() && ep.dgelu_aux_in.is_some() {
            return bad("gelu_aux_out and dgelu_aux_in exclude each other");
        }
        if ep.dgelu_aux_in.is_some() && (ep.bias.is_some() || ep.residual.is_some()) {
            return bad("cuBLASLt's DGELU takes no bias or residual");
        }
        // CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD and _BATCH_STRIDE "must be
        // divisible by 8"; the aux buffer is D-shaped: they are n and D's.
        if aux && !self.n.is_multiple_of(8) {
            return bad("cuBLASLt needs n divisible by 8 for a GELU aux buffer");
        }
        if aux && self.batch > 1 && !self.batch_stride_d.is_multiple_of(8) {
            return bad("cuBLASLt needs batch_stride_d divisible by 8 for a GELU aux buffer");
        }
        Ok(())
    }
}

/// Raw device addresses (`CUdeviceptr` as u64) of the epilogue's operands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EpiloguePtrs {
    /// `[n]`, added to every row.
    pub bias: Option<u64>,
    /// D-shaped (same strides), added before the bias (C with beta = 1).
    pub residual: Option<u64>,
    /// Written with the pre-activation; D becomes gelu_tanh(pre).
    pub gelu_aux_out: Option<u64>,
    /// Pre-activation read; D becomes gelu'(aux) * (a @ b).
    pub dgelu_aux_in: Option<u64>,
}

/// The cuBLASLt epilogue a set of pointers asks for (the residual is
/// orthogonal: it is C, not an epilogue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Default,
    Bias,
    GeluAux,
    GeluAuxBias,
    DGelu,
}

impl Kind {
    fn of(ep: &EpiloguePtrs) -> Kind {
        match (
            ep.bias.is_some(),
            ep.gelu_aux_out.is_some(),
            ep.dgelu_aux_in.is_some(),
        ) {
            (_, _, true) => Kind::DGelu,
            (true, true, _) => Kind::GeluAuxBias,
            (false, true, _) => Kind::GeluAux,
            (true, false, _) => Kind::Bias,
            (false, false, _) => Kind::Default,
        }
    }

    /// cuBLASLt's epilogue, and the compiler's name for it (`Epilogue::name`).
    fn cublas(self) -> (sys::cublasLtEpilogue_t, &'static str) {
        use sys::cublasLtEpilogue_t::*;
        match self {
            Kind::Default => (CUBLASLT_EPILOGUE_DEFAULT, "default"),
            Kind::Bias => (CUBLASLT_EPILOGUE_BIAS, "bias"),
            Kind::GeluAux => (CUBLASLT_EPILOGUE_GELU_AUX, "gelu_aux"),
            Kind::GeluAuxBias => (CUBLASLT_EPILOGUE_GELU_AUX_BIAS, "gelu_aux_bias"),
            Kind::DGelu => (CUBLASLT_EPILOGUE_DGELU, "dgelu"),
        }
    }
}

/// `m=37 n=45 k=29 batch=3 (A transposed) bf16 -> f32, epilogue bias+residual`
fn describe(s: &GemmSpec, ep: &EpiloguePtrs) -> String {
    let trans = match (s.a_transposed, s.b_transposed) {
        (false, false) => "",
        (true, false) => " (A transposed)",
        (false, true) => " (B transposed)",
        (true, true) => " (A and B transposed)",
    };
    let residual = ["", "+residual"][ep.residual.is_some() as usize];
    format!(
        "m={} n={} k={} batch={}{trans} {} -> {}, epilogue {}{residual}",
        s.m,
        s.n,
        s.k,
        s.batch,
        s.in_type.name(),
        s.out_type.name(),
        Kind::of(ep).cublas().1
    )
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GemmError {
    /// libcublasLt could not be loaded.
    NotLoaded,
    /// A CUDA driver call around the GEMM failed.
    Driver { what: &'static str, detail: String },
    /// The request is malformed; found before cuBLASLt was called.
    Invalid { product: String, reason: String },
    /// cuBLASLt returned a failure status.
    Cublas {
        product: String,
        call: &'static str,
        status: sys::cublasStatus_t,
    },
}

impl fmt::Display for GemmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GemmError::NotLoaded => write!(
                f,
                "cuBLASLt (libcublasLt.so) could not be loaded: install CUDA's cuBLAS (or the nvidia-cublas wheel) and put its lib folder on LD_LIBRARY_PATH"
            ),
            GemmError::Driver { what, detail } => {
                write!(f, "CUDA driver error while {what}: {detail}")
            }
            GemmError::Invalid { product, reason } => {
                write!(f, "invalid GEMM {product}: {reason}")
            }
            GemmError::Cublas {
                product,
                call,
                status,
            } => {
                write!(f, "cuBLASLt {call} failed with {status:?}")?;
                if !product.is_empty() {
                    write!(f, " for GEMM {product}")?;
                }
                if *status == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED {
                    write!(f, " (no algorithm for this combination of types, transposes, alignment and epilogue)")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for GemmError {}

/// What one cached product is planned with: everything but the addresses.
/// Its `Debug` text keys the on-disk choice of algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    spec: GemmSpec,
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
type Mat = (Elem, u64, u64, u64, u64);

/// cuBLASLt's view of the product (see the module doc): its TRANSA and
/// TRANSB, and for its A (our B), B (our A) and D the type, rows, columns
/// and batch stride of the column-major matrix as stored (packed, so the
/// leading dimension is the row count). Our B stored `[k, n]` row-major is
/// `n x k` column-major, read as is; stored `[n, k]` it is `k x n`, read
/// transposed. Our A likewise; D is `n x m`.
fn column_major(s: &GemmSpec) -> ([i32; 2], [Mat; 3]) {
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
        spec: &GemmSpec,
        a: u64,
        b: u64,
        d: u64,
        ep: &EpiloguePtrs,
    ) -> Result<(), GemmError> {
        let tf32 = self.allow_tf32 && spec.in_type == Elem::F32;
        self.run_with(spec, a, b, d, ep, tf32)
    }

    /// [`Gemm::run`] for f32 operands as three TF32 products: the split
    /// kernels copy A and B into `scratch` (address, f32 elements) three
    /// times along K, as hi, lo and hi parts (`kernels/gemm/
    /// split_tf32.cuh`), and one TF32 product over K tripled takes them.
    pub fn run_split(
        &mut self,
        spec: &GemmSpec,
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
        spec: &GemmSpec,
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
        let bytes = |stride: u64, t: Elem| stride * t.bytes() * (spec.batch > 1) as u64;
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
                let l = result::create_matrix_layout(t.cuda(), rows, cols, ld as i64)?;
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
            let s = GemmSpec {
                batch,
                a_transposed: at,
                b_transposed: bt,
                batch_stride_a: m * k + 1,
                batch_stride_b: 0,
                batch_stride_d: m * n + 2,
                ..GemmSpec::plain(m, n, k, Elem::F32, Elem::F32)
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
