//! What a product asks of cuBLASLt, before any of it is called: the
//! operands' types, the row-major product with its strides and pitches,
//! the epilogue's buffers, the checks cuBLASLt would fail less helpfully,
//! and the errors, each naming the product.

use cudarc::cublaslt::sys;
use std::fmt;

pub use fusec_compiler::plan::gemm::{GemmElem, GemmShape};

/// cuBLASLt's data type for an element type.
pub(crate) fn cuda_type(e: GemmElem) -> sys::cudaDataType {
    match e {
        GemmElem::F32 => sys::cudaDataType::CUDA_R_32F,
        GemmElem::BF16 => sys::cudaDataType::CUDA_R_16BF,
        GemmElem::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

/// What the runtime checks of a product before cuBLASLt sees it.
pub trait GemmChecks {
    /// The checks cuBLASLt would fail on less helpfully (or not at all).
    fn validate(&self, ep: &EpiloguePtrs) -> Result<(), GemmError>;
}

impl GemmChecks for GemmShape {
    fn validate(&self, ep: &EpiloguePtrs) -> Result<(), GemmError> {
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
pub(crate) enum Kind {
    Default,
    Bias,
    GeluAux,
    GeluAuxBias,
    DGelu,
}

impl Kind {
    pub(crate) fn of(ep: &EpiloguePtrs) -> Kind {
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
    pub(crate) fn cublas(self) -> (sys::cublasLtEpilogue_t, &'static str) {
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
pub(crate) fn describe(s: &GemmShape, ep: &EpiloguePtrs) -> String {
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
