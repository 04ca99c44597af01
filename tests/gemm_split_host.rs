//! `kernels/gemm/split_tf32.cuh` run as host C++ (tests/cuda_host/shim.h:
//! one thread walks every loop): each variant (A or B, K along the rows or
//! down the columns, float4s or floats) copies a batched, pitched operand
//! three times, and every copy must sit where `fusec_runtime::gemm_split::
//! tripled` says the product reads it, holding the part it should: hi a
//! TF32 value (its low 13 bits zero) within half a TF32 unit of x, lo
//! exactly x - hi. Infinities and NaN keep their hi with a lo of 0, and a
//! value that would round past f32's largest stays finite.

mod common;

use common::host;
use fusec_compiler::emit::gemm_split::Operand;
use fusec_runtime::gemm::{GemmElem, GemmShape};
use fusec_runtime::gemm_split::tripled;

const HARNESS: &str = r#"#include "shim.h"
struct float4 { float x, y, z, w; };
#include "gemm/split_tf32.cuh"
#include <cstdio>
#include <cstdlib>
#include <cstring>
int main(int argc, char** argv) {
    const int variant = atoi(argv[1]);
    long long v[5];
    for (int i = 0; i < 5; ++i) v[i] = atoll(argv[i + 2]);
    const long long batch = v[0], rows = v[1], cols = v[2], ld = v[3], stride = v[4];
    const long long in_n = (batch - 1) * stride + (rows - 1) * ld + cols, out_n = 3 * batch * rows * cols;
    float* in = (float*)calloc(in_n + 4, sizeof(float));
    float* out = (float*)calloc(out_n + 4, sizeof(float));
    if (fread(in, sizeof(float), in_n, stdin) != (size_t)in_n) return 2;
    for (long long i = 0; i < out_n; ++i) out[i] = __uint_as_float(0x7fc01234u);
    switch (variant) {
        case 0: fs_split_tf32<true, 1, 4>(in, out, batch, rows, cols, ld, stride); break;
        case 1: fs_split_tf32<true, 1, 1>(in, out, batch, rows, cols, ld, stride); break;
        case 2: fs_split_tf32<false, 1, 4>(in, out, batch, rows, cols, ld, stride); break;
        case 3: fs_split_tf32<false, 1, 1>(in, out, batch, rows, cols, ld, stride); break;
        case 4: fs_split_tf32<true, 2, 4>(in, out, batch, rows, cols, ld, stride); break;
        case 5: fs_split_tf32<true, 2, 1>(in, out, batch, rows, cols, ld, stride); break;
        case 6: fs_split_tf32<false, 2, 4>(in, out, batch, rows, cols, ld, stride); break;
        case 7: fs_split_tf32<false, 2, 1>(in, out, batch, rows, cols, ld, stride); break;
        default: return 3;
    }
    fwrite(out, sizeof(float), out_n, stdout);
    return 0;
}
"#;

/// Values that probe the rounding: ties, carries into the exponent, the
/// largest finite values, subnormals, signed zeros, infinities and NaN,
/// then ordinary ones.
fn values(n: usize) -> Vec<f32> {
    let special = [
        1.0 + 2f32.powi(-11),                  // a tie: rounds away, up
        1.0 + 2f32.powi(-11) - 2f32.powi(-23), // just under a tie: down
        -(1.0 + 3.0 * 2f32.powi(-11)),         // a negative tie
        2.0 - 2f32.powi(-23),                  // carries into the exponent
        f32::MAX,                              // would round to infinity
        -f32::MAX,
        f32::from_bits(1),           // the smallest subnormal
        f32::from_bits(0x007f_ffff), // the largest subnormal
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    (0..n)
        .map(|i| match special.get(i) {
            Some(&x) => x,
            None => {
                let u = ((i as u64 * 2654435761) % 1_000_003) as f32 / 1_000_003.0;
                (u - 0.5) * 10f32.powi((i % 7) as i32 - 3)
            }
        })
        .collect()
}

/// Whether `(hi, lo)` is the split of `x`.
fn is_split(x: f32, hi: f32, lo: f32) -> Result<(), String> {
    if x.is_nan() {
        return (hi.is_nan() && lo == 0.0)
            .then_some(())
            .ok_or(format!("NaN split as ({hi}, {lo})"));
    }
    if x.is_infinite() {
        return (hi == x && lo == 0.0)
            .then_some(())
            .ok_or(format!("{x} split as ({hi}, {lo})"));
    }
    if hi.to_bits() & 0x1fff != 0 {
        return Err(format!("{x:e}: hi {hi:e} is not a TF32 value"));
    }
    if !hi.is_finite() || (hi as f64 + lo as f64) != x as f64 {
        return Err(format!("{x:e}: hi {hi:e} + lo {lo:e} is not x"));
    }
    // Nearest: within half a unit of TF32's 11 significant bits, except
    // past the largest finite value, where hi is truncated (a whole unit).
    // Subnormals have TF32's fixed unit, 2^-136, whatever their size.
    let unit = if x.abs() == f32::MAX { 2.0 } else { 1.0 };
    let half = (unit * (x as f64).abs() * 2f64.powi(-11)).max(2f64.powi(-137));
    if (lo as f64).abs() > half {
        return Err(format!("{x:e}: lo {lo:e} is more than half a TF32 unit"));
    }
    Ok(())
}

#[test]
fn every_split_variant_copies_each_part_where_the_product_reads_it() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("gemm-split");
    let exe = host::build(&work, "split", HARNESS);
    let mut checked = 0;
    for (variant, (operand, k_inner, vec4)) in [Operand::A, Operand::B]
        .into_iter()
        .flat_map(|o| [true, false].map(|k| (o, k)))
        .flat_map(|(o, k)| [true, false].map(|v| (o, k, v)))
        .enumerate()
    {
        // The spec whose operand is stored so, batched and pitched.
        let (m, n, k, batch) = if vec4 { (8, 12, 4, 2) } else { (5, 7, 3, 2) };
        let pitch = |len: u64| if vec4 { len + 4 } else { len + 2 };
        let a_t = operand == Operand::A && !k_inner;
        let b_t = operand == Operand::B && k_inner;
        let (rows, cols) = match (operand, k_inner) {
            (Operand::A, true) => (m, k),
            (Operand::A, false) => (k, m),
            (Operand::B, true) => (n, k),
            (Operand::B, false) => (k, n),
        };
        let stride = rows * pitch(cols) + if vec4 { 8 } else { 3 };
        let mut spec = GemmShape {
            batch,
            a_transposed: a_t,
            b_transposed: b_t,
            batch_stride_d: m * n,
            ..GemmShape::plain(m, n, k, GemmElem::F32, GemmElem::F32)
        };
        match operand {
            Operand::A => (spec.pitch_a, spec.batch_stride_a) = (pitch(cols), stride),
            Operand::B => (spec.pitch_b, spec.batch_stride_b) = (pitch(cols), stride),
        }
        let (sa, sb, out) = tripled(&spec);
        let s = if operand == Operand::A { sa } else { sb };
        assert_eq!(
            (s.rows, s.cols, s.ld, s.stride, s.k_inner),
            (rows, cols, pitch(cols), stride, k_inner)
        );
        let in_n = ((batch - 1) * stride + (rows - 1) * s.ld + cols) as usize;
        let input = values(in_n);
        let bytes: Vec<u8> = input.iter().flat_map(|x| x.to_le_bytes()).collect();
        let args = [batch, rows, cols, s.ld, stride].map(|x| x.to_string());
        let mut child = std::process::Command::new(&exe)
            .arg(variant.to_string())
            .args(&args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(&bytes).unwrap();
        let run = child.wait_with_output().unwrap();
        assert!(run.status.success(), "variant {variant}: {:?}", run.status);
        let got: Vec<f32> = run
            .stdout
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got.len() as u64, 3 * batch * rows * cols);
        // Each element of the operand, read through the tripled spec at
        // K index l + c * k for copy c; copy 1 (A) or 2 (B) is lo.
        let lo_copy = if operand == Operand::A { 1 } else { 2 };
        let (kk, bs) = (
            out.k,
            if operand == Operand::A {
                out.batch_stride_a
            } else {
                out.batch_stride_b
            },
        );
        for p in 0..batch {
            for r in 0..rows {
                for c in 0..cols {
                    let x = input[(p * stride + r * s.ld + c) as usize];
                    // Row and K index of this element in the product.
                    let (other, l) = if k_inner { (r, c) } else { (c, r) };
                    let at = |copy: u64| {
                        let kl = l + copy * k;
                        let i = if k_inner {
                            other * kk + kl
                        } else {
                            kl * cols + other
                        };
                        got[(p * bs + i) as usize]
                    };
                    let (hi, lo) = (at(0), at(lo_copy));
                    let third = at(3 - lo_copy);
                    let label = format!("variant {variant} ({operand:?}, k_inner {k_inner}, vec4 {vec4}) [{p},{r},{c}]");
                    is_split(x, hi, lo).unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert!(
                        third.to_bits() == hi.to_bits(),
                        "{label}: the third copy {third:e} is not hi {hi:e}"
                    );
                    checked += 1;
                }
            }
        }
    }
    println!("{checked} elements split and placed, every variant");
    assert!(checked > 300);
}
