//! The wrappers of `kernels/gemm/split_tf32.cuh`: the kernels that split an
//! f32 GEMM's operands for three TF32 products (see the header). One
//! source holds every variant the runtime may launch; which one a product
//! takes (its operand, whether K runs along its rows, float4s or floats)
//! is known only from its layout at run time.

use std::fmt::Write;

/// The source's name, and the start of every function in it.
pub const SPLIT_SOURCE: &str = "fs_gemm_split_tf32";

/// Which operand of the product a split is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    /// A: copies (hi, lo, hi).
    A,
    /// B: copies (hi, hi, lo).
    B,
}

/// The function splitting `operand` where K runs along its stored rows
/// (`k_inner`), moving float4s (`vec4`) or floats.
pub fn split_function(operand: Operand, k_inner: bool, vec4: bool) -> String {
    let op = match operand {
        Operand::A => "a",
        Operand::B => "b",
    };
    let k = if k_inner { "k_inner" } else { "k_outer" };
    let v = if vec4 { "v4" } else { "v1" };
    format!("{SPLIT_SOURCE}_{op}_{k}_{v}")
}

/// Threads a block of the split kernels.
pub const SPLIT_BLOCK: u32 = 256;

/// The source: the header and one `extern "C"` wrapper a variant, each
/// taking (in, out, batch, rows, cols, ld, stride).
pub fn split_source() -> String {
    let mut s = String::from(
        "// The operands of f32 GEMMs split for three TF32 products (kernels/gemm/split_tf32.cuh).\n\
         #include \"gemm/split_tf32.cuh\"\n",
    );
    for operand in [Operand::A, Operand::B] {
        for k_inner in [true, false] {
            for vec4 in [true, false] {
                let lo = match operand {
                    Operand::A => 1,
                    Operand::B => 2,
                };
                let _ = write!(
                    s,
                    "\nextern \"C\" __global__ void __launch_bounds__({SPLIT_BLOCK}) {}(const float* __restrict__ in, float* __restrict__ out,\n    \
                     long long batch, long long rows, long long cols, long long ld, long long stride) {{\n    \
                     fs_split_tf32<{k_inner}, {lo}, {}>(in, out, batch, rows, cols, ld, stride);\n}}\n",
                    split_function(operand, k_inner, vec4),
                    if vec4 { 4 } else { 1 },
                );
            }
        }
    }
    s
}
