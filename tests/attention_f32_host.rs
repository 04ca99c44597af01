//! The f32 attention on tensor cores (kernels/attention/forward_f32.cuh,
//! backward_f32.cuh and tf32.cuh, 3xTF32 products), verified without a GPU:
//!
//! - the forward and both schemes of the backward run on the host (every
//!   thread an OS thread, mma.sync.m16n8k8.tf32 emulated with the PTX ISA's
//!   layouts, tests/flash_host/mma_emu.h) and must compute what the
//!   interpreter computes (in f64 on the f32 inputs) to near f32 precision:
//!   every head dim the bf16 kernels take (the backward up to 256 features
//!   in all), causal and not, grouped queries, strided and contiguous
//!   heads, T = S in {1, 17, 100, 130}, cross-attention S != T, padded keys
//!   (lengths) and dropout;
//! - one TF32 product instead of three, a wrong fragment mapping and a
//!   wrong dQ split each fail that comparison (mutations of copies of the
//!   headers);
//! - NVRTC compiles every instantiation for sm_80, sm_86 and sm_90 without
//!   spills (skipped, saying so, where libnvrtc is missing).
//!
//! The host runs are skipped, with a message, where no `c++` compiler exists.

mod common;

use common::flash::{
    build, build_harness, build_with, compile_all, dropout_model, head_dims_model, reference,
    run_set, with_dropout, Built, Mutation, Which, DROPOUT_RUNS, DROPOUT_VARIANTS, HEAD_DIMS,
    LENGTHS_MODEL, LENGTHS_RUNS,
};
use common::host;
use fusec_compiler::emit::flash::FlashArch;
use std::collections::HashMap;
use std::path::Path;

/// How far O (and dQ, dK, dV) may be from the f64 reference, relative to
/// the tensor's largest magnitude. 3xTF32 keeps each operand to 2^-21 of
/// itself (hi rounded to TF32, lo = x - hi truncated by the mma) and drops
/// lo * lo (2^-22), so a product is good to about 2^-20 (1e-6); a score
/// sums up to 256 of them in f32 (another 256 * 2^-24 = 1.5e-5 of the sum
/// of magnitudes at worst, 1e-6 for a random walk), and the exponent turns
/// a score's absolute error into a relative error of P of the same size
/// (scores here are O(1)). 2e-5 is that worst case with room; one TF32
/// product (2^-11 = 4.9e-4 an operand) is off by 6e-5 to 2e-4 on these
/// shapes (mutation 0 below), and a wrong mapping by whole entries.
const TOL: f64 = 2e-5;
/// The log-sum-exp, absolute: the same score errors, unscaled by exp.
const TOL_LSE: f64 = 2e-5;

fn forward(src: &str) -> Built {
    build(src, "f32", FlashArch::Sm80, Which::Forward)
}

/// Both schemes: atomic (sets 0, 2, ...) and deterministic (1, 3, ...).
fn backward(src: &str) -> Built {
    build(src, "f32", FlashArch::Sm80, BOTH)
}

const BOTH: Which = Which::Backward {
    atomic: true,
    deterministic: true,
};

/// The largest error of each output of set `f` relative to its reference's
/// largest magnitude (absolute for the forward's lse), or where one is
/// past the bounds.
fn run_and_compare(
    exe: &Path,
    dir: &Path,
    b: &Built,
    f: usize,
    bufs: &[fusec_compiler::interp::tensor::Tensor],
    dims: &HashMap<String, i64>,
    (tol, tol_lse): (f64, f64),
) -> Result<Vec<f64>, String> {
    let k = &b.program.kernels[b.sets[f].kernel];
    let written = run_set(exe, dir, b, f, bufs, dims)?;
    let forward = written.len() == 2;
    let names: &[&str] = if forward {
        &["O", "LSE"]
    } else {
        &["dQ", "dK", "dV"]
    };
    let maxes: Vec<f64> = (0..written.len())
        .map(|slot| {
            bufs[k.outputs[slot]].data.iter().fold(0.0f64, |m, x| {
                if x.is_finite() {
                    m.max(x.abs())
                } else {
                    m
                }
            })
        })
        .collect();
    // With one visible key (S = 1) dQ and dK are exactly zero: their errors
    // are then measured against the largest of the outputs.
    let largest = maxes.iter().cloned().fold(0.0, f64::max);
    if largest == 0.0 {
        return Err("every reference output is all zero: the case tests nothing".into());
    }
    let mut errs = Vec::new();
    for (slot, got) in written.iter().enumerate() {
        let want = &bufs[k.outputs[slot]].data;
        assert_eq!(got.len(), want.len());
        let lse = forward && slot == 1;
        let (scale, tol) = match lse {
            true => (1.0, tol_lse),
            false if maxes[slot] > 0.0 => (maxes[slot], tol),
            false => (largest, tol),
        };
        let mut worst = 0.0f64;
        for (i, (x, y)) in want.iter().zip(got).enumerate() {
            if x.is_infinite() && x == y {
                continue;
            }
            // An exact zero of the reference is a zero in real arithmetic (a
            // query that sees one key, a padded key): exactly 0 here too, as
            // in common/flash_bwd.rs.
            if *x == 0.0 && *y != 0.0 {
                return Err(format!(
                    "{} element {i}: exactly 0 in the reference, kernel {y} (max {scale:.3e})",
                    names[slot]
                ));
            }
            let err = (x - y).abs() / scale;
            if err.is_nan() || err > tol {
                return Err(format!(
                    "{} element {i}: reference {x}, kernel {y} (error {err:.2e} of {scale:.3e}, bound {tol:.0e})",
                    names[slot]
                ));
            }
            worst = worst.max(err);
        }
        errs.push(worst);
    }
    Ok(errs)
}

/// Every set of `b` at every size in `runs` within the 3xTF32 bounds: the
/// number checked.
fn check_all(label: &str, b: &Built, runs: &[&[(&str, i64)]]) -> usize {
    check_within(label, b, runs, (TOL, TOL_LSE)).0
}

/// Every set of `b` at every size in `runs` within `tol`: the number
/// checked, and the largest error of each output.
fn check_within(
    label: &str,
    b: &Built,
    runs: &[&[(&str, i64)]],
    tol: (f64, f64),
) -> (usize, Vec<f64>) {
    let work = host::work_dir(&format!("attn-f32-{label}"));
    let all: Vec<usize> = (0..b.sets.len()).collect();
    let exe = build_harness(b, &all, &work, "f32", None);
    let mut checked = 0;
    let mut worst: Vec<f64> = Vec::new();
    for (r, sizes) in runs.iter().enumerate() {
        let dims = common::dims(sizes);
        let bufs = reference(b, &dims);
        for (f, set) in b.sets.iter().enumerate() {
            let dir = work.join(format!("{f}-{r}"));
            match run_and_compare(&exe, &dir, b, f, &bufs, &dims, tol) {
                Ok(e) => {
                    worst.resize(e.len(), 0.0);
                    for (w, e) in worst.iter_mut().zip(e) {
                        *w = w.max(e);
                    }
                }
                Err(e) => panic!("{label} {} at {sizes:?}: {e}", set.what),
            }
            checked += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    let shown: Vec<String> = worst.iter().map(|e| format!("{e:.2e}")).collect();
    println!(
        "{label}: {checked} runs, largest errors {}",
        shown.join(", ")
    );
    (checked, worst)
}

/// Head dims 64 and 128, ratio 1 (fused projection, strided) and 4
/// (contiguous heads), causal and not, and a negative scale (applied before
/// the row max).
const MODEL: &str = "
const d = 16
dim B, T
input x: f32[B, T, d]
param f64a: [d, 384] = normal(0.3)
param q128: [d, 1024] = normal(0.3)
param k128: [d, 256] = normal(0.3)
param v128: [d, 256] = normal(0.3)
let q1, k1, v1 = split(x @ f64a, 3)
let y1 = merge_heads(attention(heads(q1, 2), heads(k1, 2), heads(v1, 2), causal = true))
let y2 = merge_heads(attention(heads(q1, 2), heads(k1, 2), heads(v1, 2)))
let y3 = merge_heads(attention(heads(x @ q128, 8), heads(x @ k128, 2), heads(x @ v128, 2), causal = true))
let y4 = merge_heads(attention(heads(x @ q128, 8), heads(x @ k128, 2), heads(x @ v128, 2), scale = -0.1))
train {
    loss = mean(y1 * y1) + mean(y2 * y2) + mean(y3 * y3) + mean(y4 * y4)
    precision = PRECISION
}
";

const RUNS: &[&[(&str, i64)]] = &[
    &[("B", 2), ("T", 1)],
    &[("B", 2), ("T", 17)],
    &[("B", 1), ("T", 130)],
];

/// The every-head-dim variants whose backward the f32 kernel holds (up to
/// 256 padded features in all).
fn backward_head_dims() -> Vec<(u32, u32, u32, u32, bool, bool)> {
    HEAD_DIMS
        .iter()
        .copied()
        .filter(|v| v.0.div_ceil(8) * 8 + v.1.div_ceil(8) * 8 <= 256)
        .collect()
}

#[test]
fn f32_forward_matches_the_reference_on_the_host() {
    if !host::have_cxx() {
        return;
    }
    let b = forward(MODEL);
    assert_eq!(b.sets.len(), 4, "every attention on tensor cores");
    check_all("fwd", &b, RUNS);
    let b = forward(&head_dims_model(HEAD_DIMS));
    assert_eq!(b.sets.len(), HEAD_DIMS.len());
    // T = 100: a partial second tile (MODEL's runs take T = 1, 17, 130).
    check_all("fwd-dims", &b, &[&[("B", 1), ("T", 100)]]);
}

#[test]
fn f32_backward_matches_the_reference_on_the_host() {
    if !host::have_cxx() {
        return;
    }
    let b = backward(MODEL);
    assert_eq!(
        b.sets.len(),
        8,
        "every attention gradient on tensor cores, both schemes"
    );
    check_all("bwd", &b, RUNS);
    let dims = backward_head_dims();
    let b = backward(&head_dims_model(&dims));
    assert_eq!(b.sets.len(), 2 * dims.len());
    // T = 100: a partial second tile (MODEL's runs take T = 1, 17, 130).
    check_all("bwd-dims", &b, &[&[("B", 1), ("T", 100)]]);
}

/// Padded keys (cross-attention S != T, causal self-attention) and dropout
/// (the interpreter's mask, drawn tile by tile), forward and backward.
#[test]
fn f32_attention_with_lengths_and_dropout_matches_the_reference() {
    if !host::have_cxx() {
        return;
    }
    let lengths = LENGTHS_MODEL.replace("precision = bf16", "precision = PRECISION");
    assert!(lengths.contains("PRECISION"));
    check_all("fwd-lengths", &forward(&lengths), LENGTHS_RUNS);
    // The backward without the D = 192 attention (384 features in all).
    let narrow = lengths
        .lines()
        .filter(|l| !l.contains("w192") && !l.contains("y3 = "))
        .collect::<Vec<_>>()
        .join("\n")
        .replace(" + mean(y3 * y3)", "");
    let b = backward(&narrow);
    assert_eq!(b.sets.len(), 4);
    check_all("bwd-lengths", &b, LENGTHS_RUNS);
    check_all("fwd-dropout", &forward(&dropout_model()), DROPOUT_RUNS);
    let narrow: Vec<_> = DROPOUT_VARIANTS
        .iter()
        .copied()
        .filter(|v| v.0 + v.1 <= 256)
        .collect();
    let b = backward(&with_dropout(&head_dims_model(&narrow)));
    assert_eq!(b.sets.len(), 2 * narrow.len());
    check_all("bwd-dropout", &b, DROPOUT_RUNS);
}

/// With `--tf32` (one TF32 product): within TF32's bounds, and past the
/// 3xTF32 ones, so the option reaches the kernels. TF32 keeps 2^-11 of an
/// operand, a product 2^-10 (1e-3); a score's sum of up to 128 of them as a
/// random walk 1e-2 of a typical term, O(1e-3) of the scores here, which
/// the exponent carries into P: 5e-3 of max |O| (and absolute on the lse)
/// is that with room.
#[test]
fn tf32_runs_one_product() {
    if !host::have_cxx() {
        return;
    }
    const TF32_TOL: (f64, f64) = (5e-3, 5e-3);
    let runs: &[&[(&str, i64)]] = &[&[("B", 1), ("T", 100)]];
    for which in [
        Which::Forward,
        Which::Backward {
            atomic: true,
            deterministic: false,
        },
    ] {
        let b = build_with(MODEL, "f32", FlashArch::Sm80, which, true);
        let (_, worst) = check_within(&format!("tf32-{which:?}"), &b, runs, TF32_TOL);
        let largest = worst.iter().cloned().fold(0.0, f64::max);
        assert!(
            largest > TOL,
            "{which:?}: errors {worst:?} are 3xTF32's, not one TF32 product's"
        );
    }
}

/// Each mutation, on set `f` of `b` at B = 1, T = 130 (two query tiles of
/// the forward, three key blocks of the backward, partial tails), must fail.
fn check_mutations(label: &str, b: &Built, f: usize, mutations: &[Mutation]) {
    let dims = common::dims(&[("B", 1), ("T", 130)]);
    let bufs = reference(b, &dims);
    let work = host::work_dir(&format!("attn-f32-{label}"));
    let exe = build_harness(b, &[0], &work, "good", None);
    run_and_compare(
        &exe,
        &work.join("good-run"),
        b,
        0,
        &bufs,
        &dims,
        (TOL, TOL_LSE),
    )
    .expect("the unbroken kernel");
    for (i, &m) in mutations.iter().enumerate() {
        let stem = format!("broken{i}");
        let exe = build_harness(b, &[f], &work, &stem, Some(m));
        let got = run_and_compare(
            &exe,
            &work.join(format!("{stem}-run")),
            b,
            f,
            &bufs,
            &dims,
            (TOL, TOL_LSE),
        );
        let e = got.expect_err(&format!("mutation {i} ({}: `{}`) went unnoticed", m.0, m.1));
        println!("mutation {i} ({}) caught: {e}", m.0);
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// One causal attention at D = 64, 2 heads a fused projection.
const ONE: &str = "
const d = 16
dim B, T
input x: f32[B, T, d]
param w: [d, 384] = normal(0.3)
let q, k, v = split(x @ w, 3)
let y = merge_heads(attention(heads(q, 2), heads(k, 2), heads(v, 2), causal = true))
train {
    loss = mean(y * y)
    precision = f32
}
";

#[test]
fn a_broken_f32_kernel_is_caught() {
    if !host::have_cxx() {
        return;
    }
    const TF32: &str = "attention/tf32.cuh";
    const BWD: &str = "attention/backward_f32.cuh";
    let shared: [Mutation; 4] = [
        // One TF32 product instead of 3xTF32: the tolerance must see it.
        (
            TF32,
            "    if (PRECISE) {\n#pragma unroll",
            "    if (false) {\n#pragma unroll",
        ),
        // The accumulator as A: keys 2t and 2t + 1 of the lower rows swapped.
        (
            TF32,
            "tf32_split<PRECISE>(a, 1, c[2]);",
            "tf32_split<PRECISE>(a, 1, c[3]);",
        ),
        // The pairs' B fragment reading row t instead of 2t.
        (
            TF32,
            "tf32_split<PRECISE>(b, 0, at[2 * t * row + g]);",
            "tf32_split<PRECISE>(b, 0, at[t * row + g]);",
        ),
        // The emulator's tf32 A layout with a1 and a2 exchanged (still a bijection).
        (
            "mma_emu.h",
            "row = (lane >> 2) + (i & 1) * 8;\n    col = (lane % 4) + (i >> 1) * 4;",
            "row = (lane >> 2) + (i >> 1) * 8;\n    col = (lane % 4) + (i & 1) * 4;",
        ),
    ];
    check_mutations("fwd-mutations", &forward(ONE), 0, &shared);
    let b = backward(ONE);
    let mut bwd = shared.to_vec();
    bwd.extend([
        // dQ's A read from the wrong query rows.
        (
            BWD,
            "a_cols_pairs<PRECISE>(dsa, ds_tile + kk * 8 * DS_ROW + m0, DS_ROW);",
            "a_cols_pairs<PRECISE>(dsa, ds_tile + kk * 8 * DS_ROW, DS_ROW);",
        ),
        // The key-major dropout and delta: dS without delta.
        (
            BWD,
            "dp[n][e] = s[n][e] * (dp[n][e] - delta_tile[n * 8 + frag_col + (e & 1)]);",
            "dp[n][e] = s[n][e] * dp[n][e];",
        ),
    ]);
    check_mutations("bwd-mutations", &b, 0, &bwd);
    // The deterministic scheme's dQ: dS without delta, the wrong query rows'
    // lse, the causal mask off by one.
    check_mutations(
        "dq-mutations",
        &b,
        1,
        &[
            (
                BWD,
                "dp[n][e] = p * (dp[n][e] - dlt[r]);",
                "dp[n][e] = p * dp[n][e];",
            ),
            (
                BWD,
                "lse2[r] = i < q_len ? a.lse.at(b, h, i) * LOG2E : 0.0f;",
                "lse2[r] = i < q_len ? a.lse.at(b, h, i_lo) * LOG2E : 0.0f;",
            ),
            (
                BWD,
                "if (j >= kv_len || (CAUSAL && j > i)) p = 0.0f;",
                "if (j >= kv_len || (CAUSAL && j > i + 1)) p = 0.0f;",
            ),
        ],
    );
}

#[test]
fn f32_attention_compiles_with_nvrtc_without_spills() {
    if !common::nvrtc_ready() {
        return;
    }
    let all = head_dims_model(HEAD_DIMS);
    let narrow = head_dims_model(&backward_head_dims());
    let dropping = with_dropout(&narrow);
    let mut jobs = Vec::new();
    for (src, which) in [
        (MODEL.to_string(), Which::Forward),
        (all.clone(), Which::Forward),
        (with_dropout(&all), Which::Forward),
        (MODEL.to_string(), BOTH),
        (narrow, BOTH),
        (dropping, BOTH),
    ] {
        for set in build(&src, "f32", FlashArch::Sm80, which).sets {
            for k in set.kernels {
                for arch in ["sm_80", "sm_86", "sm_90"] {
                    jobs.push(("f32", arch, set.what.clone(), k.launch.clone()));
                }
            }
        }
    }
    jobs.sort_by(|a, b| (a.1, &a.3.template).cmp(&(b.1, &b.3.template)));
    jobs.dedup_by(|a, b| a.1 == b.1 && a.3.template == b.3.template);
    println!("{} instantiations", jobs.len());
    let failures = compile_all(&jobs);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
