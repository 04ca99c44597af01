//! f32 GEMMs as three TF32 products (`select::F32Math::ThreeTf32`): each
//! operand copied three times along K into the plan's scratch, as hi, lo
//! and hi parts (A) or hi, hi and lo (B), by the kernels of
//! `kernels/gemm/split_tf32.cuh`; then one cuBLASLt TF32 product over K
//! tripled sums hi*hi + lo*hi + hi*lo. On an H200 that runs an f32 product
//! of BERT-large's sizes 2.3 to 2.7 times as fast as cuBLASLt's f32 one.

use crate::gemm::GemmShape;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use fusec_compiler::emit::gemm_split::{split_function, Operand, SPLIT_BLOCK};

/// The split kernels, loaded from the step's `SPLIT_SOURCE` module.
pub struct SplitKernels {
    /// By [`index`]: operand, K along the rows, float4s.
    funcs: Vec<CudaFunction>,
}

fn index(operand: Operand, k_inner: bool, vec4: bool) -> usize {
    (operand == Operand::B) as usize * 4 + (!k_inner) as usize * 2 + (!vec4) as usize
}

impl SplitKernels {
    /// Every variant, found by `load` (function name -> function).
    pub fn load<E>(mut load: impl FnMut(&str) -> Result<CudaFunction, E>) -> Result<Self, E> {
        let mut funcs = Vec::with_capacity(8);
        for operand in [Operand::A, Operand::B] {
            for k_inner in [true, false] {
                for vec4 in [true, false] {
                    debug_assert_eq!(index(operand, k_inner, vec4), funcs.len());
                    funcs.push(load(&split_function(operand, k_inner, vec4))?);
                }
            }
        }
        Ok(SplitKernels { funcs })
    }
}

/// One operand as stored: `batch` matrices of `rows` x `cols`, rows `ld`
/// elements apart and matrices `stride` apart (a shared matrix: batch 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stored {
    pub batch: u64,
    pub rows: u64,
    pub cols: u64,
    pub ld: u64,
    pub stride: u64,
    /// K runs along the rows.
    pub k_inner: bool,
}

impl Stored {
    fn elems(&self) -> u64 {
        self.batch * self.rows * self.cols
    }
}

/// How the operands of `spec` are stored, and the product over their
/// packed, tripled copies (K three times as long, no pitch).
pub fn tripled(spec: &GemmShape) -> (Stored, Stored, GemmShape) {
    let batched = |stride: u64| spec.batch > 1 && stride != 0;
    let stored = |t: bool, outer: u64, inner: u64, k_inner: bool, pitch: u64, stride: u64| {
        let (rows, cols) = if t { (inner, outer) } else { (outer, inner) };
        Stored {
            batch: if batched(stride) { spec.batch } else { 1 },
            rows,
            cols,
            ld: if pitch == 0 { cols } else { pitch },
            stride: if batched(stride) { stride } else { 0 },
            k_inner,
        }
    };
    // A is [m, k] (K along the rows) or, transposed, stored [k, m].
    let a = stored(
        spec.a_transposed,
        spec.m,
        spec.k,
        !spec.a_transposed,
        spec.pitch_a,
        spec.batch_stride_a,
    );
    // B is [k, n] or, transposed, stored [n, k] (K along the rows).
    let b = stored(
        spec.b_transposed,
        spec.k,
        spec.n,
        spec.b_transposed,
        spec.pitch_b,
        spec.batch_stride_b,
    );
    let per = |s: &Stored| if s.batch > 1 { 3 * s.rows * s.cols } else { 0 };
    let out = GemmShape {
        k: 3 * spec.k,
        batch_stride_a: per(&a),
        batch_stride_b: per(&b),
        pitch_a: 0,
        pitch_b: 0,
        ..*spec
    };
    (a, b, out)
}

/// The product [`split_operands`] enqueued: over the copies in the scratch.
pub struct Tripled {
    pub spec: GemmShape,
    pub a: u64,
    pub b: u64,
}

/// Enqueues the copies of `a` and `b` into `scratch` (address, f32
/// elements) on `stream`; the product to run over them.
pub fn split_operands(
    spec: &GemmShape,
    a: u64,
    b: u64,
    scratch: (u64, u64),
    kernels: &SplitKernels,
    stream: &std::sync::Arc<CudaStream>,
) -> Result<Tripled, String> {
    let (sa, sb, out) = tripled(spec);
    let (base, room) = scratch;
    if 3 * (sa.elems() + sb.elems()) > room {
        return Err(format!(
            "its operands' three copies take {} f32s and the plan gave {room} (a bug in fusec's memory plan; --exact-f32 avoids the split)",
            3 * (sa.elems() + sb.elems())
        ));
    }
    let b_copy = base + 4 * 3 * sa.elems();
    for (operand, s, src, dst) in [(Operand::A, sa, a, base), (Operand::B, sb, b, b_copy)] {
        let vec4 = [s.cols, s.ld, s.stride, src / 4, dst / 4]
            .iter()
            .all(|x| x % 4 == 0);
        let f = &kernels.funcs[index(operand, s.k_inner, vec4)];
        let lines = s.batch * s.rows;
        let cfg = LaunchConfig {
            grid_dim: (lines.clamp(1, 1 << 20) as u32, 1, 1),
            block_dim: (SPLIT_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let sizes = [s.batch, s.rows, s.cols, s.ld, s.stride].map(|x| x as i64);
        let mut l = stream.launch_builder(f);
        l.arg(&src).arg(&dst);
        for x in &sizes {
            l.arg(x);
        }
        // SAFETY: the arguments match the wrappers' signature (two
        // pointers, five long longs); the source spans what the spec reads
        // (the caller's contract) and the copies fit the scratch (checked).
        unsafe { l.launch(cfg) }.map_err(|e| format!("launching the TF32 split: {e:?}"))?;
    }
    Ok(Tripled {
        spec: out,
        a: base,
        b: b_copy,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::GemmElem;

    /// The kernel's copies, done on the CPU from [`tripled`]'s layouts,
    /// multiplied as the new spec reads them: the sum of the three part
    /// products, for every transpose, with batches, a shared B and pitches.
    #[test]
    fn tripled_copies_multiply_to_the_three_part_products() {
        let hi = |x: f64| ((x * 8.0).round()) / 8.0; // any split x = hi + lo
        for (at, bt) in [(false, false), (true, false), (false, true), (true, true)] {
            let (m, n, k, batch) = (3u64, 5u64, 4u64, 2u64);
            let (pa, pb) = (if at { m + 2 } else { k + 1 }, 0);
            let rows_a = if at { k } else { m };
            let spec = GemmShape {
                batch,
                a_transposed: at,
                b_transposed: bt,
                batch_stride_a: rows_a * pa + 3,
                batch_stride_b: 0,
                batch_stride_d: m * n,
                pitch_a: pa,
                pitch_b: pb,
                ..GemmShape::plain(m, n, k, GemmElem::F32, GemmElem::F32)
            };
            let a: Vec<f64> = (0..batch * spec.batch_stride_a)
                .map(|x| ((x * 37 % 23) as f64 - 11.0) / 7.0)
                .collect();
            let b: Vec<f64> = (0..k * n)
                .map(|x| ((x * 29 % 19) as f64 - 9.0) / 5.0)
                .collect();
            let (sa, sb, out) = tripled(&spec);
            assert_eq!(out.k, 3 * k);
            // The split kernel on the CPU.
            let copy = |s: &Stored, src: &[f64], lo: usize| {
                let per = s.rows * s.cols;
                let mut dst = vec![f64::NAN; (3 * s.batch * per) as usize];
                for bb in 0..s.batch {
                    for r in 0..s.rows {
                        for c in 0..s.cols {
                            let x = src[(bb * s.stride + r * s.ld + c) as usize];
                            let parts = [hi(x), x - hi(x)];
                            for i in 0..3u64 {
                                let v = parts[(i as usize == lo) as usize];
                                let at = if s.k_inner {
                                    3 * bb * per + r * 3 * s.cols + i * s.cols + c
                                } else {
                                    3 * bb * per + i * per + r * s.cols + c
                                };
                                dst[at as usize] = v;
                            }
                        }
                    }
                }
                dst
            };
            let (a3, b3) = (copy(&sa, &a, 1), copy(&sb, &b, 2));
            assert!(
                a3.iter().chain(&b3).all(|x| !x.is_nan()),
                "every copy written"
            );
            // Row-major reads through the new spec (packed, K tripled).
            let read_a = |p: u64, i: u64, l: u64| {
                let off = p * out.batch_stride_a;
                a3[(off + if at { l * m + i } else { i * 3 * k + l }) as usize]
            };
            let read_b = |p: u64, l: u64, j: u64| {
                let off = p * out.batch_stride_b;
                b3[(off + if bt { j * 3 * k + l } else { l * n + j }) as usize]
            };
            let orig_a = |p: u64, i: u64, l: u64| {
                a[(p * spec.batch_stride_a + if at { l * pa + i } else { i * pa + l }) as usize]
            };
            let orig_b = |l: u64, j: u64| b[if bt { j * k + l } else { l * n + j } as usize];
            for p in 0..batch {
                for i in 0..m {
                    for j in 0..n {
                        let got: f64 = (0..3 * k).map(|l| read_a(p, i, l) * read_b(p, l, j)).sum();
                        let want: f64 = (0..k)
                            .map(|l| {
                                let (x, y) = (orig_a(p, i, l), orig_b(l, j));
                                let (xl, yl) = (x - hi(x), y - hi(y));
                                hi(x) * hi(y) + xl * hi(y) + hi(x) * yl
                            })
                            .sum();
                        assert!((got - want).abs() < 1e-12, "aT={at} bT={bt} [{p},{i},{j}]");
                    }
                }
            }
        }
    }
}
