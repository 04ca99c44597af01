//! The tensor-core attention backward (kernels/attention/backward.cuh,
//! backward_sm80.cuh and backward_sm90.cuh, instantiated by
//! compiler/src/emit/flash/), verified without a GPU:
//!
//! - each scheme's three kernels run on the host in order (every thread an
//!   OS thread with real barriers, the warp-level PTX emulated with the PTX
//!   ISA's layouts), and dQ, dK, dV must match what the kernel-IR
//!   interpreter computes for the `attention_grad` op: head dims 64 and 128,
//!   T = S in {1, 17, 64, 100}, causal and not, grouped-query ratios 1 and
//!   4, q/k/v as strided slices of a fused projection (and as contiguous
//!   heads), bf16 (f16 on one size), cross-attention S != T, and every
//!   other head dim the kernels take (8 to 256, Dv != D); each output
//!   within 3e-2 of its max |ref|; both schemes on mma.sync, the atomic
//!   one on Hopper (wgmma up to 128 features, mma.sync above);
//! - deliberate breakages of the templates and the emulator (causal bounds,
//!   dropped delta terms, fragment halves swapped, a dropped scale, wrong
//!   descriptor strides) fail that comparison;
//! - NVRTC compiles every instantiation for sm_80 and sm_90, or sm_90a,
//!   without spills or serialized wgmma (skipped, saying so, where libnvrtc
//!   is missing);
//! - the wrappers' text is held in snapshots.
//!
//! The host runs are skipped, with a message, where no `c++` compiler exists.

mod common;

use common::flash::{
    build, build_harness, compile_all, head_dims_model, reference, run_set, Built, Mutation, Which,
    HEAD_DIMS,
};
use common::host;
use fusec_compiler::emit::flash::{flash_backward, FlashArch};
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::Body;
use fusec_compiler::ops::Op;
use std::collections::HashMap;
use std::fmt::Write;
use std::path::Path;

/// Head dims 64 and 128 x ratios 1 and 4 x causal or not. D = 64 and the
/// D = 128 ratio-1 pair read q/k/v as strided slices of a fused projection;
/// the D = 128 ratio-4 pair reads separate projections (contiguous heads).
const MODEL: &str = "
const d = 16
dim B, T
input x: f32[B, T, d]
param f64a: [d, 384] = normal(0.3)
param f64b: [d, 384] = normal(0.3)
param f128a: [d, 768] = normal(0.3)
param q128b: [d, 1024] = normal(0.3)
param k128b: [d, 256] = normal(0.3)
param v128b: [d, 256] = normal(0.3)

let q1, k1, v1 = split(x @ f64a, 3)
let q2, k2, v2 = split(x @ f64b, [256, 64, 64])
let q3, k3, v3 = split(x @ f128a, 3)
let y1 = merge_heads(attention(heads(q1, 2), heads(k1, 2), heads(v1, 2), causal = true))
let y2 = merge_heads(attention(heads(q1, 2), heads(k1, 2), heads(v1, 2)))
let y3 = merge_heads(attention(heads(q2, 4), heads(k2, 1), heads(v2, 1), causal = true))
let y4 = merge_heads(attention(heads(q2, 4), heads(k2, 1), heads(v2, 1)))
let y5 = merge_heads(attention(heads(q3, 2), heads(k3, 2), heads(v3, 2), causal = true))
let y6 = merge_heads(attention(heads(q3, 2), heads(k3, 2), heads(v3, 2)))
let y7 = merge_heads(attention(heads(x @ q128b, 8), heads(x @ k128b, 2), heads(x @ v128b, 2), causal = true))
let y8 = merge_heads(attention(heads(x @ q128b, 8), heads(x @ k128b, 2), heads(x @ v128b, 2)))
train {
    loss = mean(y1 * y1) + mean(y2 * y2) + mean(y3 * y3) + mean(y4 * y4) + mean(y5 * y5) + mean(y6 * y6) + mean(y7 * y7) + mean(y8 * y8)
    precision = PRECISION
}
";

/// The kernel set the snapshots hold (and the mutation tests break): fused
/// projection, 4 query heads on 1, D = 64, causal (and a non-causal twin).
const SNAPSHOT_MODEL: &str = "
const d = 16
dim B, T
input x: f32[B, T, d]
param w: [d, 384] = normal(0.3)
let q, k, v = split(x @ w, [256, 64, 64])
let y = merge_heads(attention(heads(q, 4), heads(k, 1), heads(v, 1), causal = true))
train {
    loss = mean(y * y)
    precision = bf16
}
";

/// Sequence lengths (T = S) and the batch each runs with.
const RUNS: &[&[(&str, i64)]] = &[
    &[("B", 2), ("T", 1)],
    &[("B", 2), ("T", 17)],
    &[("B", 1), ("T", 64)],
    &[("B", 1), ("T", 100)],
];

/// Cross-attention (S keys, T queries), D = 64, 2 query heads on 1 key/value
/// head of a fused projection of the memory; causal and not.
const CROSS_MODEL: &str = "
const d = 16
dim B, T, S
input x: f32[B, T, d]
input mem: f32[B, S, d]
param wq: [d, 128] = normal(0.3)
param wkv: [d, 128] = normal(0.3)
let k, v = split(mem @ wkv, 2)
let y1 = merge_heads(attention(heads(x @ wq, 2), heads(k, 1), heads(v, 1), causal = true))
let y2 = merge_heads(attention(heads(x @ wq, 2), heads(k, 1), heads(v, 1)))
train {
    loss = mean(y1 * y1) + mean(y2 * y2)
    precision = bf16
}
";

/// Both schemes on mma.sync; the atomic one alone (whose dK/dV/dQ kernel
/// is Hopper's own where it fits) on Hopper.
fn backward(src: &str, precision: &str, arch: FlashArch) -> Built {
    let which = match arch {
        FlashArch::Sm80 => Which::Backward {
            atomic: true,
            deterministic: true,
        },
        FlashArch::Sm90a => Which::Backward {
            atomic: true,
            deterministic: false,
        },
    };
    build(src, precision, arch, which)
}

/// Runs set `f` and compares dQ, dK, dV with the interpreter's: the largest
/// error of each relative to its max |ref|, or where they differ.
fn run_and_compare(
    exe: &Path,
    dir: &Path,
    b: &Built,
    f: usize,
    bufs: &[fusec_compiler::interp::tensor::Tensor],
    dims: &HashMap<String, i64>,
) -> Result<[f64; 3], String> {
    let k = &b.program.kernels[b.sets[f].kernel];
    let written = run_set(exe, dir, b, f, bufs, dims)?;
    let mut outs = Vec::new();
    for (slot, got) in written.into_iter().enumerate() {
        let want = &bufs[k.outputs[slot]].data;
        assert_eq!(got.len(), want.len());
        let max = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        outs.push((got, want, max));
    }
    // With one visible key per query (S = 1), dQ and dK are exactly zero
    // (P = 1, dP = delta): their errors are then measured against max |dV|.
    let largest = outs.iter().fold(0.0f64, |m, o| m.max(o.2));
    if largest == 0.0 {
        return Err("every reference output is all zero: the case tests nothing".into());
    }
    let mut errs = [0.0f64; 3];
    for (slot, (got, want, max)) in outs.iter().enumerate() {
        let name = ["dQ", "dK", "dV"][slot];
        let max = if *max > 0.0 { *max } else { largest };
        for (i, (x, y)) in want.iter().zip(got).enumerate() {
            let err = (x - y).abs() / max;
            if err.is_nan() || err > 3e-2 {
                return Err(format!(
                    "{name} element {i}: reference {x}, kernel {y} (max |{name}| {max})"
                ));
            }
            errs[slot] = errs[slot].max(err);
        }
    }
    Ok(errs)
}

/// Every set of `b` at every size in `runs`: the number checked.
fn check_all(label: &str, b: &Built, runs: &[&[(&str, i64)]]) -> usize {
    let work = host::work_dir(&format!("flash-bwd-{label}"));
    let all: Vec<usize> = (0..b.sets.len()).collect();
    let exe = build_harness(b, &all, &work, "flash_bwd", None);
    let mut checked = 0;
    let mut worst = [0.0f64; 3];
    for (r, sizes) in runs.iter().enumerate() {
        let dims = common::dims(sizes);
        let bufs = reference(b, &dims);
        for (f, set) in b.sets.iter().enumerate() {
            let dir = work.join(format!("{f}-{r}"));
            match run_and_compare(&exe, &dir, b, f, &bufs, &dims) {
                Ok(e) => {
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
    println!(
        "{label}: largest errors of max |ref|: dQ {:.2e}, dK {:.2e}, dV {:.2e}",
        worst[0], worst[1], worst[2]
    );
    checked
}

#[test]
fn flash_backward_matches_the_reference_on_the_host() {
    if !host::have_cxx() {
        return;
    }
    let b = backward(MODEL, "bf16", FlashArch::Sm80);
    assert_eq!(
        b.sets.len(),
        16,
        "two kernel sets (schemes) per attention_grad op"
    );
    let mut kinds: Vec<&str> = b.sets.iter().map(|f| f.what.as_str()).collect();
    kinds.sort();
    kinds.dedup();
    assert_eq!(kinds.len(), 16, "every variant once: {kinds:?}");
    let checked = check_all("bf16", &b, RUNS);
    println!("bf16: {checked} kernel-set runs matched the reference ({kinds:?})");
    let b = backward(MODEL, "f16", FlashArch::Sm80);
    let checked = check_all("f16", &b, &[&[("B", 1), ("T", 100)]]);
    println!("f16: {checked} kernel-set runs matched the reference");
}

#[test]
fn flash_backward_cross_attention_matches_the_reference() {
    if !host::have_cxx() {
        return;
    }
    let b = backward(CROSS_MODEL, "bf16", FlashArch::Sm80);
    assert_eq!(b.sets.len(), 4);
    let runs: &[&[(&str, i64)]] = &[
        &[("B", 2), ("T", 17), ("S", 100)],
        &[("B", 1), ("T", 100), ("S", 17)],
    ];
    let checked = check_all("cross", &b, runs);
    println!("cross: {checked} kernel-set runs matched the reference");
}

/// Every head dim of `HEAD_DIMS`, both schemes on mma.sync (the widest in
/// two feature parts a key tile) and the atomic one on Hopper, at T = 17
/// and T = 130 (two or three key blocks, several query tiles each), bf16;
/// f16 at T = 130.
#[test]
fn every_head_dim_matches_the_reference_on_the_host() {
    if !host::have_cxx() {
        return;
    }
    let src = head_dims_model(HEAD_DIMS);
    let runs: &[&[(&str, i64)]] = &[&[("B", 2), ("T", 17)], &[("B", 1), ("T", 130)]];
    for arch in [FlashArch::Sm80, FlashArch::Sm90a] {
        let b = backward(&src, "bf16", arch);
        let checked = check_all(&format!("dims-{arch:?}"), &b, runs);
        println!(
            "{arch:?} bf16: {checked} kernel-set runs of every head dim matched the reference"
        );
        let b = backward(&src, "f16", arch);
        let checked = check_all(&format!("dims-f16-{arch:?}"), &b, &runs[1..]);
        println!("{arch:?} f16: {checked} kernel-set runs matched the reference");
    }
}

/// The atomic scheme with Hopper's dK/dV/dQ kernel (wgmma, 128 keys and
/// 64-query tiles): T = 100 on four query heads a kv head gives each block
/// eight query tiles, so every query buffer and both dQ tiles are reused;
/// the cross runs' S = 200 takes two key blocks, and T = S = 300 three,
/// each causal block's tiles starting at its diagonal.
#[test]
fn hopper_flash_backward_matches_the_reference_on_the_host() {
    if !host::have_cxx() {
        return;
    }
    let b = backward(MODEL, "bf16", FlashArch::Sm90a);
    assert_eq!(b.sets.len(), 8, "one kernel set per attention_grad op");
    let checked = check_all("hopper-bf16", &b, RUNS);
    println!("hopper bf16: {checked} kernel-set runs matched the reference");
    let b = backward(MODEL, "f16", FlashArch::Sm90a);
    let checked = check_all("hopper-f16", &b, &[&[("B", 1), ("T", 100)]]);
    println!("hopper f16: {checked} kernel-set runs matched the reference");
    let b = backward(CROSS_MODEL, "bf16", FlashArch::Sm90a);
    let runs: &[&[(&str, i64)]] = &[
        &[("B", 2), ("T", 17), ("S", 200)],
        &[("B", 1), ("T", 200), ("S", 17)],
        &[("B", 1), ("T", 300), ("S", 300)],
    ];
    let checked = check_all("hopper-cross", &b, runs);
    println!("hopper cross: {checked} kernel-set runs matched the reference");
}

/// The snapshot model with a non-causal twin of its attention.
fn twin_model() -> String {
    SNAPSHOT_MODEL
        .replace(
            "train {",
            "let y2 = merge_heads(attention(heads(q, 4), heads(k, 1), heads(v, 1)))\ntrain {",
        )
        .replace("loss = mean(y * y)", "loss = mean(y * y) + mean(y2 * y2)")
}

/// The set of `b` that is causal or not, in the deterministic scheme or not.
fn find(b: &Built, causal: bool, deterministic: bool) -> usize {
    b.sets
        .iter()
        .position(|f| {
            f.what.contains(&format!("causal={causal}")) && f.deterministic == deterministic
        })
        .unwrap()
}

const SM80: &str = "attention/backward_sm80.cuh";
const BWD: &str = "attention/backward.cuh";
const COMMON: &str = "attention/common.cuh";

/// Plain logic bugs of either scheme's kernels, and wrong fragment halves,
/// must make the comparison fail (else the host runs prove little). Each
/// mutation names the set it breaks: causal or not, deterministic or
/// atomic.
#[test]
fn deliberate_breakages_are_caught() {
    if !host::have_cxx() {
        return;
    }
    let b = backward(&twin_model(), "bf16", FlashArch::Sm80);
    let (causal, plain) = (find(&b, true, true), find(&b, false, true));
    let (causal_atomic, plain_atomic) = (find(&b, true, false), find(&b, false, false));
    let mutations: [(Mutation, usize); 15] = [
        // dK/dV: the causal bound off by one.
        ((COMMON, "kr > qc + diag) ? 0.0f : p;", "kr > qc + diag + 1) ? 0.0f : p;"), causal),
        // dK/dV: query tiles start one tile too late.
        ((SM80, "(k0 / TILE_Q) * TILE_Q", "(k0 / TILE_Q + 1) * TILE_Q"), causal),
        // dQ: the causal bound off by one.
        (
            (
                SM80,
                "if (j >= kv_len || (CAUSAL && j > i)) p = 0.0f;",
                "if (j >= kv_len || (CAUSAL && j >= i)) p = 0.0f;",
            ),
            causal,
        ),
        // dK: the delta term dropped.
        (
            (
                SM80,
                "dp[n][e] = s[n][e] * (dp[n][e] - delta_tile[n * 8 + frag_col + (e & 1)]);",
                "dp[n][e] = s[n][e] * dp[n][e];",
            ),
            plain,
        ),
        // dQ: the delta term dropped.
        ((SM80, "dp[n][e] = p * (dp[n][e] - dlt[r]);", "dp[n][e] = p * dp[n][e];"), plain),
        // dQ: K^T's B fragment halves swapped.
        ((SM80, "E::mma(acc[n], fa, bk[0], bk[1]);", "E::mma(acc[n], fa, bk[1], bk[0]);"), plain),
        // dV: dO's B fragments (rows 0-7 and 8-15 of the query tile) swapped.
        ((SM80, "E::mma(dv_acc[n], p_frag, bo[0], bo[1]);", "E::mma(dv_acc[n], p_frag, bo[1], bo[0]);"), plain),
        // ldmatrix.trans: lanes 8-15 and 16-23 give each other's rows.
        (
            (
                COMMON,
                "fs_ldsm_x4_t(b, at + ((lane & 7) + ((lane >> 3) & 1) * 8) * row + (lane >> 4) * 8);",
                "fs_ldsm_x4_t(b, at + ((lane & 7) + (lane >> 4) * 8) * row + ((lane >> 3) & 1) * 8);",
            ),
            plain,
        ),
        // dK: the scale dropped.
        ((COMMON, "dk_acc[n][2 * r] * a.scale", "dk_acc[n][2 * r]"), plain),
        // Atomic scheme: dS^T's quarters stored in each other's place.
        (
            (
                SM80,
                "(key_row + 8) * DS_ROW + kk * 16 + frag_col], ds_frag[1]",
                "(key_row + 8) * DS_ROW + kk * 16 + frag_col], ds_frag[2]",
            ),
            plain_atomic,
        ),
        // Atomic scheme: dS read back with a wrong lane-to-row mapping.
        (
            (
                COMMON,
                "fs_ldsm_x4_t(a, at + ((lane & 7) + (lane >> 4) * 8) * row + ((lane >> 3) & 1) * 8)",
                "fs_ldsm_x4_t(a, at + ((lane & 7) + ((lane >> 3) & 1) * 8) * row + (lane >> 4) * 8)",
            ),
            plain_atomic,
        ),
        // Atomic scheme: the dQ sum not cleared (the scratch starts as NaN).
        ((BWD, "if (i < q_len) fs_zero16(", "if (i < 0) fs_zero16("), plain_atomic),
        // Atomic scheme: dQ added into the next row.
        (
            (
                SM80,
                "const fs_i64 i = i0 + m0 + frag_row + 8 * r;",
                "const fs_i64 i = i0 + m0 + frag_row + 8 * r + 1;",
            ),
            causal_atomic,
        ),
        // Atomic scheme: dQ's scale dropped when stored.
        ((BWD, "sum[e] * a.scale", "sum[e]"), plain_atomic),
        // Atomic scheme: query tiles start one tile too late (dQ and dK lose them).
        ((SM80, "(k0 / TILE_Q) * TILE_Q", "(k0 / TILE_Q + 1) * TILE_Q"), causal_atomic),
    ];
    expect_caught(
        &b,
        "mutations",
        &[causal, plain, causal_atomic, plain_atomic],
        &mutations,
    );
}

/// The unbroken sets `all` of `b` pass at B = 1, T = 100; then each
/// mutation, applied to the set it names, must fail.
fn expect_caught(b: &Built, label: &str, all: &[usize], mutations: &[(Mutation, usize)]) {
    let dims = common::dims(&[("B", 1), ("T", 100)]);
    let bufs = reference(b, &dims);
    let work = host::work_dir(&format!("flash-bwd-{label}"));
    // The unbroken build passes, so each failure below is the mutation's.
    let exe = build_harness(b, all, &work, "good", None);
    for &f in all {
        run_and_compare(&exe, &work.join(format!("good-{f}")), b, f, &bufs, &dims)
            .expect("the unbroken kernels");
    }
    for (i, &(m, f)) in mutations.iter().enumerate() {
        let stem = format!("broken{i}");
        let exe = build_harness(b, &[f], &work, &stem, Some(m));
        let got = run_and_compare(&exe, &work.join(format!("{stem}-run")), b, f, &bufs, &dims);
        let e = got.expect_err(&format!("mutation {i} ({}: `{}`) went unnoticed", m.0, m.1));
        println!("mutation {i} caught: {e}");
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// Hopper's dK/dV/dQ kernel: its descriptors' strides, dS^T's layout, the
/// warpgroups' halves of dQ and the mask must each matter.
#[test]
fn a_broken_hopper_backward_is_caught() {
    if !host::have_cxx() {
        return;
    }
    const SM90: &str = "attention/backward_sm90.cuh";
    const TILES: &str = "attention/sm90.cuh";
    let b = backward(&twin_model(), "bf16", FlashArch::Sm90a);
    let (causal, plain) = (find(&b, true, false), find(&b, false, false));
    let mutations: [(Mutation, usize); 9] = [
        // dQ's A (dS, MN-major core matrices) read with its strides exchanged.
        (
            (
                TILES,
                "mnmajor(const void* tile) { return fs_make_desc(tile, ROW8, CORE, 0); }",
                "mnmajor(const void* tile) { return fs_make_desc(tile, CORE, ROW8, 0); }",
            ),
            plain,
        ),
        // dV's B (the swizzled dO tile, MN-major) stepping 8 queries, not 16.
        ((TILES, "return kk * 16 * SW; }", "return kk * 8 * SW; }"), plain),
        // S^T's B (the swizzled Q tile, K-major) stepping 8 features, not 16.
        ((TILES, "(kk * 16) % ATOM * 2; }", "(kk * 16) % ATOM * 1; }"), causal),
        // The dO tiles copied from the next query on.
        ((SM90, "x * DOT::ATOM, h, i0, (int)b", "x * DOT::ATOM, h, i0 + 1, (int)b"), plain),
        // dS^T stored with its key halves swapped.
        (
            (
                SM90,
                "fs_st32(&ds_tile[DST::at(key_row, 16 * kk + frag_col)], ds_frag[kk][0]);\n                fs_st32(&ds_tile[DST::at(key_row + 8, 16 * kk + frag_col)], ds_frag[kk][1]);",
                "fs_st32(&ds_tile[DST::at(key_row + 8, 16 * kk + frag_col)], ds_frag[kk][0]);\n                fs_st32(&ds_tile[DST::at(key_row, 16 * kk + frag_col)], ds_frag[kk][1]);",
            ),
            plain,
        ),
        // Both warpgroups take the first half of dQ's features.
        ((SM90, "KT::mnmajor_n(wg * (DP / 2))", "KT::mnmajor_n(0 * (DP / 2))"), plain),
        // The causal mask off by one.
        ((COMMON, "kr > qc + diag) ? 0.0f : p;", "kr > qc + diag + 1) ? 0.0f : p;"), causal),
        // Diagonal tiles taken for unmasked ones.
        (
            (
                COMMON,
                "if (rows < TILE_Q || (CAUSAL && i0 < k0 + TILE_K)) {",
                "if (rows < TILE_Q) {",
            ),
            causal,
        ),
        // The writers adding all rows of a tile but the last.
        (
            (
                SM90,
                "for (int r = r_first, c = c_first; r < rows;)",
                "for (int r = r_first, c = c_first; r < rows - 1;)",
            ),
            plain,
        ),
    ];
    expect_caught(&b, "hopper-mutations", &[causal, plain], &mutations);
    // D = 80 (the 32-byte swizzle, writers walking whole rows of 20 chunks).
    let d80 = backward(
        &head_dims_model(&[(80, 80, 2, 1, true, true), (80, 80, 2, 1, false, true)]),
        "bf16",
        FlashArch::Sm90a,
    );
    let (causal, plain) = (find(&d80, true, false), find(&d80, false, false));
    let d80_mutations: [(Mutation, usize); 2] = [
        // The writers skip each row's last 16-byte chunk.
        (
            (
                SM90,
                "fs_atomic_add4(&sum[r * D + c * 4], &dqt[r * DQ_ROW + c * 4]);",
                "if (c + 1 < CPR) fs_atomic_add4(&sum[r * D + c * 4], &dqt[r * DQ_ROW + c * 4]);",
            ),
            causal,
        ),
        // dQ's second part (N = 40 as 32 + 8) read from the first core matrix.
        (
            (TILES, "return n0 / 8 * CORE; }", "return 0 * CORE; }"),
            plain,
        ),
    ];
    expect_caught(
        &d80,
        "hopper-mutations-d80",
        &[causal, plain],
        &d80_mutations,
    );
    // 8 query heads a key/value head: two blocks a key tile, each taking
    // 4 of the group's heads and leaving its dK/dV part for DkvStore.
    let gqa = backward(
        &head_dims_model(&[(64, 64, 16, 2, true, false)]),
        "bf16",
        FlashArch::Sm90a,
    );
    let split = find(&gqa, true, false);
    let split_mutations: [(Mutation, usize); 2] = [
        // Both blocks take the group's first heads.
        (
            (
                "attention/backward_sm90.cuh",
                "int h = (int)(kv_h * a.group + part * heads)",
                "int h = (int)(kv_h * a.group + 0 * heads)",
            ),
            split,
        ),
        // The store sums only the first part.
        (
            (
                "attention/backward.cuh",
                "for (int s = 1; s < SPLIT; ++s) {",
                "for (int s = 1; s < 1; ++s) {",
            ),
            split,
        ),
    ];
    expect_caught(&gqa, "hopper-mutations-split", &[split], &split_mutations);
    // D = 160, the wide kernel: 64 keys a block, the warpgroups splitting the
    // queries of S^T and dP^T and the features of dK, dV and dQ.
    const WIDE: &str = "attention/backward_sm90_wide.cuh";
    let d160 = backward(
        &head_dims_model(&[
            (160, 160, 2, 1, true, false),
            (160, 160, 2, 1, false, false),
        ]),
        "bf16",
        FlashArch::Sm90a,
    );
    let (causal, plain) = (find(&d160, true, false), find(&d160, false, false));
    let wide_mutations: [(Mutation, usize); 4] = [
        // Both warpgroups take the first half of dV's features.
        ((WIDE, "DOT::mnmajor_n(fv0))", "DOT::mnmajor_n(0))"), plain),
        // The second warpgroup's S^T from the first half of the queries.
        (
            (
                WIDE,
                "QT::kmajor_n(wg * HALF_Q))",
                "QT::kmajor_n(0 * HALF_Q))",
            ),
            causal,
        ),
        // P^T stored without the warpgroup's query offset.
        (
            (
                WIDE,
                "const int qc = wg * HALF_Q + 16 * kk + frag_col;",
                "const int qc = 16 * kk + frag_col;",
            ),
            plain,
        ),
        // dQ's staged rows read back without the swizzle they were stored with.
        (
            (
                WIDE,
                "&stage[row * SW + (c ^ (row % CPR)) * 4]",
                "&stage[row * SW + c * 4]",
            ),
            causal,
        ),
    ];
    expect_caught(
        &d160,
        "hopper-mutations-d160",
        &[causal, plain],
        &wide_mutations,
    );
    // The wide kernel split: 6 query heads a key/value head in two blocks
    // of 3 a key tile, their dK/dV parts summed by DkvStore.
    let wide_gqa = backward(
        &head_dims_model(&[(160, 160, 12, 2, true, false)]),
        "bf16",
        FlashArch::Sm90a,
    );
    let split = find(&wide_gqa, true, false);
    let wide_split_mutations: [(Mutation, usize); 1] = [
        // The loader of both blocks copies the group's first heads.
        (
            (
                WIDE,
                "int h = (int)(kv_h * a.group + part * heads)",
                "int h = (int)(kv_h * a.group + 0 * heads)",
            ),
            split,
        ),
    ];
    expect_caught(
        &wide_gqa,
        "hopper-mutations-wide-split",
        &[split],
        &wide_split_mutations,
    );
}

#[test]
fn flash_backward_compiles_with_nvrtc_without_spills() {
    if !common::nvrtc_ready() {
        return;
    }
    let models = [MODEL.to_string(), head_dims_model(HEAD_DIMS)];
    let mut jobs = Vec::new();
    for src in &models {
        for precision in ["bf16", "f16"] {
            for (family, archs) in [
                (FlashArch::Sm80, &["sm_80", "sm_90"][..]),
                (FlashArch::Sm90a, &["sm_90a"][..]),
            ] {
                let b = backward(src, precision, family);
                for set in b.sets {
                    for k in set.kernels {
                        for &arch in archs {
                            jobs.push((precision, arch, set.what.clone(), k.launch.clone()));
                        }
                    }
                }
            }
        }
    }
    // Distinct instantiations once each (the wrapper text differs by views only).
    jobs.sort_by(|a, b| (a.1, &a.3.template).cmp(&(b.1, &b.3.template)));
    jobs.dedup_by(|a, b| a.1 == b.1 && a.3.template == b.3.template);
    let failures = compile_all(&jobs);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn flash_backward_kernel_text() {
    let b = backward(SNAPSHOT_MODEL, "bf16", FlashArch::Sm80);
    assert_eq!(b.sets.len(), 2);
    for set in &b.sets {
        snapshot_set(&b, set);
    }
    let b = backward(SNAPSHOT_MODEL, "bf16", FlashArch::Sm90a);
    assert_eq!(b.sets.len(), 1);
    snapshot_set(&b, &b.sets[0]);
}

/// One kernel set's launches and texts in a snapshot (the deterministic
/// scheme under the older name).
fn snapshot_set(b: &Built, set: &common::flash::Set) {
    let name = &b.program.kernels[set.kernel].name;
    let mut text = String::new();
    for k in &set.kernels {
        let l = &k.launch;
        let g = l.grid_c();
        let _ = writeln!(
            text,
            "// launch {:?}: grid ({}, {}, {}), block {}, {} bytes dynamic shared, scratch f32[{}]",
            k.stage,
            g[0],
            g[1],
            g[2],
            l.block,
            l.dynamic_smem_bytes,
            l.scratch_f32.as_ref().unwrap().to_c(),
        );
        text.push_str(&l.source.replace(name.as_str(), "KERNEL"));
    }
    if set.kernels[1].launch.arch_specific {
        insta::assert_snapshot!("flash_backward_sm90a_d64_gqa4_causal_bf16_atomic", text);
    } else if set.deterministic {
        insta::assert_snapshot!("flash_backward_d64_gqa4_causal_bf16", text);
    } else {
        insta::assert_snapshot!("flash_backward_d64_gqa4_causal_bf16_atomic", text);
    }
}

/// f32, and head dims that are not multiples of 8 or are over 256, get no
/// tensor-core backward.
#[test]
fn unsupported_attention_gets_no_flash_backward() {
    let cases = [
        SNAPSHOT_MODEL.replace("precision = bf16", "precision = f32"),
        head_dims_model(&[(36, 36, 2, 1, true, false)]).replace("PRECISION", "bf16"),
        head_dims_model(&[(264, 264, 2, 1, true, false)]).replace("PRECISION", "bf16"),
    ];
    for src in &cases {
        let c = common::compile_with(src, "flash_bwd.dsl", &[]);
        let program = fuse(&c.optimized);
        let mut seen = 0;
        for k in &program.kernels {
            let Body::Op(n) = k.body else { continue };
            if !matches!(c.optimized.g[n].op, Op::AttentionGrad(_)) {
                continue;
            }
            seen += 1;
            for (deterministic, arch) in [
                (false, FlashArch::Sm80),
                (true, FlashArch::Sm80),
                (false, FlashArch::Sm90a),
            ] {
                assert!(
                    flash_backward(&c.optimized, &program, k, n, None, deterministic, arch)
                        .is_none()
                );
            }
        }
        assert_eq!(seen, 1);
    }
}
