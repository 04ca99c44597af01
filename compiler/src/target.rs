//! What a step is lowered for: the GPU architecture, the multiprocessors
//! its persistent kernels fill, the arithmetic schemes asked for, and the
//! optimisations of the kernel stages left on. The kernel stages read it,
//! and the runtime takes the f32 scheme and determinism from the compiled
//! step's copy.

use crate::optimisation::LowerOptions;

/// What the kernels are chosen for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The architecture the build compiles for (`sm_90a`, `sm_80`), and the
    /// tensor-core attention family it runs; `None`: the simple attention
    /// kernels only.
    pub arch: Option<FlashArch>,
    /// The attention backward without atomics (bit-identical runs).
    pub deterministic: bool,
    /// Multiprocessors of the GPU, the persistent kernels' grid.
    pub multiprocessors: u32,
    /// How f32 products are taken on tensor cores (GEMMs and attention).
    pub f32_math: F32Math,
    /// The optimisations of the kernel stages left on, and the gradient
    /// buckets' size.
    pub lower: LowerOptions,
}

/// How an f32 model's products run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum F32Math {
    /// Three TF32 products of each operand's TF32 part and remainder
    /// (3xTF32, as CUTLASS's OpMultiplyAddFastF32), on tensor cores: GEMMs
    /// through cuBLASLt over the operands split by `kernels/gemm/
    /// split_tf32.cuh`, the attention inside its kernels.
    #[default]
    ThreeTf32,
    /// One TF32 product (10 mantissa bits an operand), as PyTorch's
    /// `allow_tf32`: `--tf32`.
    Tf32,
    /// GEMMs in f32 on CUDA cores (cuBLASLt's CUBLAS_COMPUTE_32F, PyTorch's
    /// default); the attention as under `ThreeTf32`: `--exact-f32`.
    Exact,
}

impl F32Math {
    /// The attention kernels' f32 scheme: one TF32 product or three.
    pub fn attention_tf32(self) -> bool {
        self == F32Math::Tf32
    }
}

impl Target {
    /// The simple kernels only (what runs without tensor cores).
    pub fn simple() -> Target {
        Target {
            arch: None,
            deterministic: false,
            multiprocessors: 1,
            f32_math: F32Math::default(),
            lower: LowerOptions::default(),
        }
    }

    /// One line for reports: the attention kernels this target runs.
    pub fn describe(&self) -> String {
        let family = match self.arch {
            Some(FlashArch::Sm90a) => "tensor-core attention for sm_90a (wgmma, TMA)",
            Some(FlashArch::Sm80) => "tensor-core attention for sm_80 (mma.sync)",
            None => "the simple attention kernels (no tensor cores)",
        };
        let scheme = if self.deterministic {
            ", deterministic backward"
        } else {
            ""
        };
        let tf32 = match (self.f32_math, self.arch) {
            (_, None) => "",
            (F32Math::ThreeTf32, _) => "",
            (F32Math::Tf32, _) => ", f32 in one TF32 product",
            (F32Math::Exact, _) => ", f32 GEMMs on CUDA cores",
        };
        format!("{family}{scheme}{tf32}")
    }
}

/// Which tensor-core instructions the attention kernels are written with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashArch {
    /// `mma.sync.m16n8k16` and `ldmatrix`: sm_80 and newer.
    Sm80,
    /// `wgmma.mma_async` from shared-memory descriptors and bulk tensor
    /// copies: sm_90a only, compiled for `sm_90a`.
    Sm90a,
}

impl FlashArch {
    /// The best kernel family for a GPU of compute capability `cap`; `None`
    /// before sm_80 (no bf16 mma).
    pub fn for_capability(cap: (i32, i32)) -> Option<FlashArch> {
        match cap {
            (9, 0) => Some(FlashArch::Sm90a),
            c if c >= (8, 0) => Some(FlashArch::Sm80),
            _ => None,
        }
    }
}
