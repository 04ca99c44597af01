//! `--tf32` and `--exact-f32`: how an f32 model's products run on the GPU
//! (`select::F32Math`), shared by `build`, `train` and `bench`.

use clap::Args;
use fusec_compiler::select::F32Math;

#[derive(Args, Debug, Clone, Copy, Default)]
pub struct F32Args {
    /// f32 products in one TF32 product, as PyTorch's allow_tf32 (10
    /// mantissa bits an operand). Without it (or --exact-f32) f32 GEMMs
    /// and attention take three TF32 products on tensor cores: each
    /// operand's TF32 part and remainder (3xTF32, about f32's precision)
    #[arg(long, conflicts_with = "exact_f32")]
    pub tf32: bool,
    /// f32 GEMMs in f32 on CUDA cores (cuBLASLt's CUBLAS_COMPUTE_32F, as
    /// PyTorch's default): 2 to 3 times slower than three TF32 products,
    /// rounding errors about a tenth as large. The attention keeps its
    /// three TF32 products
    #[arg(long)]
    pub exact_f32: bool,
}

impl F32Args {
    pub fn math(&self) -> F32Math {
        match (self.tf32, self.exact_f32) {
            (true, _) => F32Math::Tf32,
            (false, true) => F32Math::Exact,
            (false, false) => F32Math::ThreeTf32,
        }
    }

    /// What `fusec train` says about the flags given (none without them).
    pub fn describe(&self, cpu: bool) -> Option<&'static str> {
        if !(self.tf32 || self.exact_f32) {
            return None;
        }
        Some(match (cpu, self.math()) {
            (true, _) => "f32 products: no effect with --cpu (the interpreter computes in f64 and rounds to each value's type)",
            (false, F32Math::Tf32) => "tf32: f32 GEMMs and attention run on TF32 tensor cores in one product (10 mantissa bits an operand), as PyTorch's allow_tf32; bf16 and fp16 models are unchanged",
            (false, _) => "exact-f32: f32 GEMMs run in f32 on CUDA cores (cuBLASLt's CUBLAS_COMPUTE_32F), the attention in three TF32 products; bf16 and fp16 models are unchanged",
        })
    }
}
