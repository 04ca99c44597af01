//! The tensor-core attention forward (kernels/attention/forward_sm80.cuh
//! and forward_sm90.cuh, instantiated by compiler/src/emit/flash/),
//! verified without a GPU:
//!
//! - the generated wrappers and the templates run on the host (every thread
//!   of a block an OS thread with real barriers, tests/flash_host/
//!   block_shim.h; the warp-level PTX emulated with the PTX ISA's layouts,
//!   mma_emu.h) and must compute what the kernel-IR interpreter computes:
//!   head dims 64 and 128 in every combination of causal, grouped-query
//!   ratio 1 and 4, strided slices of a fused projection and contiguous
//!   heads, T = S in {1, 17, 64, 100, 130} (and 300 on Hopper), bf16 and
//!   f16, cross-attention with S != T; and every other head dim the
//!   kernels take (8 to 256, Dv != D, ratios 1 to 8); O within 2e-2 of
//!   max |O|, LSE within 1e-2;
//! - a wrong fragment mapping, descriptor step, swizzle or copy (in a
//!   template or in the emulator), and a few plain logic bugs, fail that
//!   comparison (mutation tests on copies of the headers);
//! - NVRTC compiles every instantiation for sm_80 and sm_90 (mma.sync) and
//!   sm_90a (wgmma) without spills or serialized wgmma (skipped, saying so,
//!   where libnvrtc is missing);
//! - the wrappers' text is held in snapshots.
//!
//! The host runs are skipped, with a message, where no `c++` compiler exists.

mod common;

use common::flash::{
    build, build_harness, compile_all, head_dims_model, reference, run_set, Built, Mutation, Which,
    HEAD_DIMS, LENGTHS_MODEL, LENGTHS_RUNS,
};
use common::host;
use fusec_compiler::emit::flash::{flash_forward, FlashArch};
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::Body;
use fusec_compiler::ops::Op;
use std::collections::HashMap;
use std::path::Path;

/// Head dims 64 and 128; fused projections read as strided views (ratio 1:
/// 2 heads each; ratio 4: 4 query heads on 1) and separate projections with
/// contiguous heads (ratio 1: 2 on 2; ratio 4: 8 on 2); each causal and
/// not; and the non-causal 8-on-2 D = 64 one again with a negative scale
/// (which the kernels apply before the row max instead of in the exponent).
const MODEL: &str = "
const d = 32
dim B, T
input x: f32[B, T, d]
param f64a: [d, 384] = normal(0.3)
param f64b: [d, 384] = normal(0.3)
param q64a: [d, 128] = normal(0.3)
param k64a: [d, 128] = normal(0.3)
param v64a: [d, 128] = normal(0.3)
param q64b: [d, 512] = normal(0.3)
param k64b: [d, 128] = normal(0.3)
param v64b: [d, 128] = normal(0.3)
param f128a: [d, 768] = normal(0.3)
param f128b: [d, 768] = normal(0.3)
param q128a: [d, 256] = normal(0.3)
param k128a: [d, 256] = normal(0.3)
param v128a: [d, 256] = normal(0.3)
param q128b: [d, 1024] = normal(0.3)
param k128b: [d, 256] = normal(0.3)
param v128b: [d, 256] = normal(0.3)

let q1, k1, v1 = split(x @ f64a, 3)
let q2, k2, v2 = split(x @ f64b, [256, 64, 64])
let q3, k3, v3 = split(x @ f128a, 3)
let q4, k4, v4 = split(x @ f128b, [512, 128, 128])
let y01 = merge_heads(attention(heads(q1, 2), heads(k1, 2), heads(v1, 2), causal = true))
let y02 = merge_heads(attention(heads(q1, 2), heads(k1, 2), heads(v1, 2)))
let y03 = merge_heads(attention(heads(q2, 4), heads(k2, 1), heads(v2, 1), causal = true))
let y04 = merge_heads(attention(heads(q2, 4), heads(k2, 1), heads(v2, 1)))
let y05 = merge_heads(attention(heads(x @ q64a, 2), heads(x @ k64a, 2), heads(x @ v64a, 2), causal = true))
let y06 = merge_heads(attention(heads(x @ q64a, 2), heads(x @ k64a, 2), heads(x @ v64a, 2)))
let y07 = merge_heads(attention(heads(x @ q64b, 8), heads(x @ k64b, 2), heads(x @ v64b, 2), causal = true))
let y08 = merge_heads(attention(heads(x @ q64b, 8), heads(x @ k64b, 2), heads(x @ v64b, 2)))
let y09 = merge_heads(attention(heads(q3, 2), heads(k3, 2), heads(v3, 2), causal = true))
let y10 = merge_heads(attention(heads(q3, 2), heads(k3, 2), heads(v3, 2)))
let y11 = merge_heads(attention(heads(q4, 4), heads(k4, 1), heads(v4, 1), causal = true))
let y12 = merge_heads(attention(heads(q4, 4), heads(k4, 1), heads(v4, 1)))
let y13 = merge_heads(attention(heads(x @ q128a, 2), heads(x @ k128a, 2), heads(x @ v128a, 2), causal = true))
let y14 = merge_heads(attention(heads(x @ q128a, 2), heads(x @ k128a, 2), heads(x @ v128a, 2)))
let y15 = merge_heads(attention(heads(x @ q128b, 8), heads(x @ k128b, 2), heads(x @ v128b, 2), causal = true))
let y16 = merge_heads(attention(heads(x @ q128b, 8), heads(x @ k128b, 2), heads(x @ v128b, 2)))
let y17 = merge_heads(attention(heads(x @ q64b, 8), heads(x @ k64b, 2), heads(x @ v64b, 2), scale = -0.125))
train {
    loss = mean(y01 * y01) + mean(y02 * y02) + mean(y03 * y03) + mean(y04 * y04) + mean(y05 * y05) + mean(y06 * y06) + mean(y07 * y07) + mean(y08 * y08) + mean(y09 * y09) + mean(y10 * y10) + mean(y11 * y11) + mean(y12 * y12) + mean(y13 * y13) + mean(y14 * y14) + mean(y15 * y15) + mean(y16 * y16) + mean(y17 * y17)
    precision = PRECISION
}
";

/// The kernel the snapshots hold: fused projection, 4 query heads on 1,
/// D = 64, causal.
const SNAPSHOT_MODEL: &str = "
const d = 32
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
    &[("B", 1), ("T", 130)],
];

/// Cross-attention (S keys, T queries), D = 64, 2 query heads on 1 key/value
/// head of a fused projection of the memory; causal and not.
const CROSS_MODEL: &str = "
const d = 32
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

fn forward(src: &str, precision: &str, arch: FlashArch) -> Built {
    build(src, precision, arch, Which::Forward)
}

/// Runs set `f` and compares its O and LSE with the interpreter's: the
/// largest errors, or where they differ.
fn run_and_compare(
    exe: &Path,
    dir: &Path,
    b: &Built,
    f: usize,
    bufs: &[fusec_compiler::interp::tensor::Tensor],
    dims: &HashMap<String, i64>,
) -> Result<(f64, f64), String> {
    let k = &b.program.kernels[b.sets[f].kernel];
    let outs = run_set(exe, dir, b, f, bufs, dims)?;
    let read = |slot: usize| (outs[slot].clone(), &bufs[k.outputs[slot]].data);
    let (o, want_o) = read(0);
    let (lse, want_lse) = read(1);
    assert_eq!(o.len(), want_o.len());
    assert_eq!(lse.len(), want_lse.len());
    let max = want_o.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    if max == 0.0 {
        return Err("the reference output is all zero: the case tests nothing".into());
    }
    let (mut o_err, mut lse_err) = (0.0f64, 0.0f64);
    for (i, (x, y)) in want_o.iter().zip(&o).enumerate() {
        let err = (x - y).abs() / max;
        if err.is_nan() || err > 2e-2 {
            return Err(format!(
                "O element {i}: reference {x}, kernel {y} (max |O| {max})"
            ));
        }
        o_err = o_err.max(err);
    }
    for (i, (x, y)) in want_lse.iter().zip(&lse).enumerate() {
        if x.is_infinite() && x == y {
            continue;
        }
        let err = (x - y).abs();
        if err.is_nan() || err > 1e-2 {
            return Err(format!("LSE element {i}: reference {x}, kernel {y}"));
        }
        lse_err = lse_err.max(err);
    }
    Ok((o_err, lse_err))
}

/// Every set of `b` at every size in `runs`: the number checked.
fn check_all(label: &str, b: &Built, runs: &[&[(&str, i64)]]) -> usize {
    let work = host::work_dir(&format!("flash-host-{label}"));
    let all: Vec<usize> = (0..b.sets.len()).collect();
    let exe = build_harness(b, &all, &work, "flash", None);
    let mut checked = 0;
    let (mut o_err, mut lse_err) = (0.0f64, 0.0f64);
    for (r, sizes) in runs.iter().enumerate() {
        let dims = common::dims(sizes);
        let bufs = reference(b, &dims);
        for (f, set) in b.sets.iter().enumerate() {
            let dir = work.join(format!("{f}-{r}"));
            match run_and_compare(&exe, &dir, b, f, &bufs, &dims) {
                Ok((o, l)) => (o_err, lse_err) = (o_err.max(o), lse_err.max(l)),
                Err(e) => panic!("{label} {} at {sizes:?}: {e}", set.what),
            }
            checked += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    println!("{label}: largest O error {o_err:.2e} of max |O|, largest LSE error {lse_err:.2e}");
    checked
}

#[test]
fn flash_attention_matches_the_reference_on_the_host() {
    if !host::have_cxx() {
        return;
    }
    let b = forward(MODEL, "bf16", FlashArch::Sm80);
    assert_eq!(b.sets.len(), 17, "one kernel per attention op");
    let mut kinds: Vec<&str> = b.sets.iter().map(|f| f.what.as_str()).collect();
    kinds.sort();
    kinds.dedup();
    assert_eq!(
        kinds.len(),
        16,
        "every variant, one of them twice: {kinds:?}"
    );
    let checked = check_all("bf16", &b, RUNS);
    println!("bf16: {checked} kernel runs matched the reference ({kinds:?})");
    let b = forward(MODEL, "f16", FlashArch::Sm80);
    let checked = check_all("f16", &b, &[&[("B", 1), ("T", 100)]]);
    println!("f16: {checked} kernel runs matched the reference");
}

#[test]
fn flash_cross_attention_matches_the_reference() {
    if !host::have_cxx() {
        return;
    }
    let b = forward(CROSS_MODEL, "bf16", FlashArch::Sm80);
    assert_eq!(b.sets.len(), 2);
    let runs: &[&[(&str, i64)]] = &[
        &[("B", 2), ("T", 17), ("S", 130)],
        &[("B", 1), ("T", 130), ("S", 17)],
        &[("B", 1), ("T", 100), ("S", 64)],
    ];
    let checked = check_all("cross", &b, runs);
    println!("cross: {checked} kernel runs matched the reference");
}

/// Every head dim of `HEAD_DIMS` on both families: T = 17 (one partial
/// tile) and T = 130 (three query tiles on mma.sync; on Hopper two query
/// blocks, and two or three key tiles, so the key and value buffers are
/// reused where the tiles are 64 keys), bf16, and f16 at T = 130.
#[test]
fn every_head_dim_matches_the_reference_on_the_host() {
    if !host::have_cxx() {
        return;
    }
    let src = head_dims_model(HEAD_DIMS);
    let runs: &[&[(&str, i64)]] = &[&[("B", 2), ("T", 17)], &[("B", 1), ("T", 130)]];
    for arch in [FlashArch::Sm80, FlashArch::Sm90a] {
        let b = forward(&src, "bf16", arch);
        assert_eq!(b.sets.len(), HEAD_DIMS.len());
        let checked = check_all(&format!("dims-{arch:?}"), &b, runs);
        println!("{arch:?} bf16: {checked} kernel runs of every head dim matched the reference");
        let b = forward(&src, "f16", arch);
        let checked = check_all(&format!("dims-f16-{arch:?}"), &b, &runs[1..]);
        println!("{arch:?} f16: {checked} kernel runs matched the reference");
    }
}

/// The Hopper (wgmma) forward on the same variants and sizes and T = 300:
/// 128-key tiles in two buffers (T = 300 takes three key tiles, the last
/// partial, and reuses a buffer, as the cross run's S = 520 does with
/// five); query blocks of 128 rows at D = 128 (T = 130 takes two) and 192
/// at D = 64 (the cross runs' T = 200 take two, causal and not).
#[test]
fn hopper_flash_attention_matches_the_reference_on_the_host() {
    if !host::have_cxx() {
        return;
    }
    let b = forward(MODEL, "bf16", FlashArch::Sm90a);
    assert_eq!(b.sets.len(), 17, "one kernel per attention op");
    let runs: Vec<&[(&str, i64)]> = RUNS
        .iter()
        .copied()
        .chain([&[("B", 1), ("T", 300)][..]])
        .collect();
    let checked = check_all("hopper-bf16", &b, &runs);
    println!("hopper bf16: {checked} kernel runs matched the reference");
    let b = forward(MODEL, "f16", FlashArch::Sm90a);
    let checked = check_all("hopper-f16", &b, &[&[("B", 1), ("T", 100)]]);
    println!("hopper f16: {checked} kernel runs matched the reference");
    let b = forward(CROSS_MODEL, "bf16", FlashArch::Sm90a);
    let runs: &[&[(&str, i64)]] = &[
        &[("B", 2), ("T", 17), ("S", 130)],
        &[("B", 1), ("T", 130), ("S", 17)],
        &[("B", 1), ("T", 200), ("S", 520)],
    ];
    let checked = check_all("hopper-cross", &b, runs);
    println!("hopper cross: {checked} kernel runs matched the reference");
}

/// Padded keys (`lengths`) on both families: every query row sees its
/// batch entry's keys alone, tiles past them are never visited, and a
/// length of 0 gives O = 0 and lse = -inf.
#[test]
fn flash_attention_with_lengths_matches_the_reference() {
    if !host::have_cxx() {
        return;
    }
    for arch in [FlashArch::Sm80, FlashArch::Sm90a] {
        let b = forward(LENGTHS_MODEL, "bf16", arch);
        assert_eq!(b.sets.len(), 3, "every attention on tensor cores");
        let checked = check_all(&format!("lengths-{arch:?}"), &b, LENGTHS_RUNS);
        println!("{arch:?}: {checked} kernel runs with lengths matched the reference");
    }
}

/// Dropout on the probabilities: the forward draws the interpreter's mask
/// (one Philox block for a thread's 8 scores of a 16 x 16 tile) on every
/// head dim family, on mma.sync and on Hopper (ForwardSm90, a block a query
/// tile). A kernel that dropped other entries, or scaled O otherwise, is
/// off by whole probabilities.
#[test]
fn flash_attention_with_dropout_matches_the_reference() {
    if !host::have_cxx() {
        return;
    }
    let src = common::flash::dropout_model();
    for arch in [FlashArch::Sm80, FlashArch::Sm90a] {
        let b = forward(&src, "bf16", arch);
        assert_eq!(b.sets.len(), common::flash::DROPOUT_VARIANTS.len() + 1);
        let checked = check_all(
            &format!("dropout-{arch:?}"),
            &b,
            common::flash::DROPOUT_RUNS,
        );
        println!("{arch:?}: {checked} kernel runs with dropout matched the reference");
    }
}

/// The forward's dropout: the cell's words, O's 1 / (1 - p) and the draws'
/// head row must each matter.
#[test]
fn a_broken_dropout_forward_is_caught() {
    if !host::have_cxx() {
        return;
    }
    const FWD: &str = "attention/forward_sm80.cuh";
    const COMMON: &str = "attention/common.cuh";
    let src = SNAPSHOT_MODEL
        .replace(
            "train {",
            "let y2 = merge_heads(attention(heads(q, 4), heads(k, 1), heads(v, 1)))\ntrain {",
        )
        .replace("loss = mean(y * y)", "loss = mean(y * y) + mean(y2 * y2)")
        .replace("causal = true))", "causal = true, dropout = 0.3))")
        .replace("heads(v, 1)))\n", "heads(v, 1), dropout = 0.3))\n");
    assert_eq!(src.matches("dropout = 0.3").count(), 2);
    let b = forward(&src, "bf16", FlashArch::Sm80);
    let mutations: [(Mutation, bool); 4] = [
        // Keys j, j + 1 and j + 8, j + 9 read each other's bytes of the block.
        (
            (
                COMMON,
                "const int byte = KEY_MAJOR ? e : (e & 1) + 2 * nb;",
                "const int byte = KEY_MAJOR ? e : (e & 1) + 2 * (1 - nb);",
            ),
            false,
        ),
        // O without 1 / (1 - p).
        ((FWD, "o_acc[n][e] *= a.drop.scale;", ";"), true),
        // Every head draws head 0's mask.
        (
            (
                FWD,
                "for_each_draw<TILE_K / 8, false>(a.drop, b * a.q_heads + h,",
                "for_each_draw<TILE_K / 8, false>(a.drop, b * a.q_heads,",
            ),
            false,
        ),
        // No mask drawn at all.
        (
            (
                FWD,
                "            if (DROPOUT) {\n                for_each_draw",
                "            if (!DROPOUT) {\n                for_each_draw",
            ),
            true,
        ),
    ];
    check_mutations("dropout-mutations", &b, &mutations);
    // Hopper's forward: O's 1 / (1 - p) and the draws' head row.
    const FWD90: &str = "attention/forward_sm90.cuh";
    let b = forward(&src, "bf16", FlashArch::Sm90a);
    check_mutations(
        "dropout-mutations-sm90",
        &b,
        &[
            ((FWD90, "o_acc[n][e] *= a.drop.scale;", ";"), true),
            (
                (
                    FWD90,
                    "for_each_draw<TILE_K / 8, false>(a.drop, b * a.q_heads + h,",
                    "for_each_draw<TILE_K / 8, false>(a.drop, b * a.q_heads,",
                ),
                false,
            ),
        ],
    );
}

/// The snapshot model and a non-causal twin of its attention, at `arch`.
fn twins(arch: FlashArch) -> Built {
    let src = SNAPSHOT_MODEL
        .replace(
            "train {",
            "let y2 = merge_heads(attention(heads(q, 4), heads(k, 1), heads(v, 1)))\ntrain {",
        )
        .replace("loss = mean(y * y)", "loss = mean(y * y) + mean(y2 * y2)");
    forward(&src, "bf16", arch)
}

/// Runs each mutation on the causal set (`true`) or the other one of `b`
/// at T = 130 (the key, value and query tiles of the second block and the
/// last, partial key tile all matter), and requires the unbroken sets to
/// pass and every mutation to fail.
fn check_mutations(label: &str, b: &Built, mutations: &[(Mutation, bool)]) {
    let causal = b
        .sets
        .iter()
        .position(|f| f.what.contains("causal=true"))
        .unwrap();
    let plain = b
        .sets
        .iter()
        .position(|f| f.what.contains("causal=false"))
        .unwrap();
    let dims = common::dims(&[("B", 1), ("T", 130)]);
    let bufs = reference(b, &dims);
    let work = host::work_dir(&format!("flash-host-{label}"));
    // The unbroken build passes, so each failure below is the mutation's.
    let exe = build_harness(b, &[causal, plain], &work, "good", None);
    for f in [causal, plain] {
        run_and_compare(
            &exe,
            &work.join(format!("good-run-{f}")),
            b,
            f,
            &bufs,
            &dims,
        )
        .expect("the unbroken kernel");
    }
    for (i, &(m, on_causal)) in mutations.iter().enumerate() {
        let f = if on_causal { causal } else { plain };
        let stem = format!("broken{i}");
        let exe = build_harness(b, &[f], &work, &stem, Some(m));
        let got = run_and_compare(&exe, &work.join(format!("{stem}-run")), b, f, &bufs, &dims);
        let e = got.expect_err(&format!("mutation {i} ({}: `{}`) went unnoticed", m.0, m.1));
        println!("mutation {i} ({}) caught: {e}", m.0);
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// A wrong fragment mapping, in the template or in the emulator, must make
/// the comparison fail (else the host runs prove nothing about the
/// layouts); so must a few plain bugs of the kernel's logic. Each mutation
/// names the kernel it breaks: the causal one, or the other (whose keys
/// past S only the tail mask hides).
#[test]
fn a_broken_fragment_mapping_is_caught() {
    if !host::have_cxx() {
        return;
    }
    const FWD: &str = "attention/forward_sm80.cuh";
    const COMMON: &str = "attention/common.cuh";
    let mutations: [(Mutation, bool); 9] = [
        // K's B fragment halves read the wrong way round.
        ((FWD, "E::mma(s[n], qa, kb[0], kb[1]);", "E::mma(s[n], qa, kb[1], kb[0]);"), true),
        // P's A fragment: registers 1 and 2 swapped.
        (
            (
                COMMON,
                "a[1] = E::pack(acc[2 * kk][2], acc[2 * kk][3]);\n    a[2] = E::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);",
                "a[2] = E::pack(acc[2 * kk][2], acc[2 * kk][3]);\n    a[1] = E::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);",
            ),
            true,
        ),
        // The emulator's A layout with a1/a2 rows and columns exchanged (still a bijection).
        (
            (
                "mma_emu.h",
                "row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;\n    col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);",
                "row = (i < 4) ? group : group + 8;\n    col = tig * 2 + (i & 1) + ((i & 2) ? 8 : 0);",
            ),
            true,
        ),
        // The emulator's accumulator layout: the row halves swapped.
        (("mma_emu.h", "row = i < 2 ? group : group + 8;", "row = i < 2 ? group + 8 : group;"), true),
        // Not layouts, but the same test's reach: the online softmax's
        // accumulator rescale dropped, the causal mask off by one, the mask
        // of keys past S dropped (T = 130: 3 key tiles, the last partial).
        ((FWD, "o_acc[n][0] *= rescale[0];", ""), true),
        ((COMMON, "(CAUSAL && j > i)) s[n][e]", "(CAUSAL && j > i + 1)) s[n][e]"), true),
        ((COMMON, "if (j >= kv_len || (CAUSAL && j > i)) s[n][e]", "if ((CAUSAL && j > i)) s[n][e]"), false),
        // V's B fragments (keys 0-7 and 8-15 of the tile) swapped.
        ((FWD, "E::mma(o_acc[n], p_frag, vb[0], vb[1]);", "E::mma(o_acc[n], p_frag, vb[1], vb[0]);"), false),
        // The emulator's ldmatrix.trans with the two rows of a register swapped.
        (("mma_emu.h", "r[i] = lo | (hi << 16);", "r[i] = hi | (lo << 16);"), true),
    ];
    check_mutations("mutations", &twins(FlashArch::Sm80), &mutations);
}

/// The Hopper kernel's own layouts: the query tile in core matrices, the
/// swizzled key and value tiles and their copies, the descriptors' steps,
/// the emulator's reading of them, P as wgmma's register fragment, and the
/// warpgroups' causal masks; at D = 64 (the 128-byte swizzle) and D = 80
/// (the 32-byte one, five boxes a tile).
#[test]
fn a_broken_wgmma_layout_is_caught() {
    if !host::have_cxx() {
        return;
    }
    const FWD: &str = "attention/forward_sm90_persistent.cuh";
    const SM90: &str = "attention/sm90.cuh";
    let mutations: [(Mutation, bool); 10] = [
        // V's descriptor stepping 8 keys at a time instead of 16.
        ((SM90, "return kk * 16 * SW; }", "return kk * 8 * SW; }"), false),
        // K's descriptor stepping 8 features within a swizzled row instead of 16.
        ((SM90, "(kk * 16) % ATOM * 2; }", "(kk * 16) % ATOM * 1; }"), true),
        // The query copy stores rows row-major instead of in core matrices.
        (
            (
                SM90,
                "r = (t / (8 * (FEATS / 8))) * 8 + (t & 7);\n        c = ((t >> 3) % (FEATS / 8)) * 8;",
                "r = t / (FEATS / 8);\n        c = (t % (FEATS / 8)) * 8;",
            ),
            false,
        ),
        // The key tiles copied from the next row on.
        ((FWD, "x * KT::ATOM, kv_h, k0, (int)b", "x * KT::ATOM, kv_h, k0 + 1, (int)b"), true),
        // The host copy writes rows unswizzled (the emulated wgmma still reads them swizzled).
        (
            (
                SM90,
                "memcpy(fs_swizzle(out + r * m.box_feats * 2 + e * 2, m.swizzle), &v, 2)",
                "memcpy(out + r * m.box_feats * 2 + e * 2, &v, 2)",
            ),
            false,
        ),
        // The emulator reads swizzled tiles without the swizzle.
        (
            (
                "mma_emu.h",
                "at = reinterpret_cast<const unsigned char*>(a ^ (((a >> 7) & mask) << 4));",
                "at = reinterpret_cast<const unsigned char*>(a);",
            ),
            true,
        ),
        // P's register fragment: registers 1 and 2 swapped.
        (
            (
                "attention/common.cuh",
                "a[1] = E::pack(acc[2 * kk][2], acc[2 * kk][3]);\n    a[2] = E::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);",
                "a[2] = E::pack(acc[2 * kk][2], acc[2 * kk][3]);\n    a[1] = E::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);",
            ),
            true,
        ),
        // The second warpgroup's diagonal tile left unmasked.
        ((FWD, "first_row = q0 + wg * 64 + warp * 16;", "first_row = q0 + 64 + wg * 64 + warp * 16;"), true),
        // The emulator reads swizzled MN-major rows K-major.
        (
            (
                "mma_emu.h",
                "(mn_major ? (mn / atom) * lbo + (mn % atom) * 2 + (k % 8) * sw + (k / 8) * sbo",
                "(!mn_major ? (mn / atom) * lbo + (mn % atom) * 2 + (k % 8) * sw + (k / 8) * sbo",
            ),
            false,
        ),
        // The emulator's descriptor strides exchanged.
        (("mma_emu.h", "p + (mn / 8) * sbo + (k / 8) * lbo", "p + (mn / 8) * lbo + (k / 8) * sbo"), true),
    ];
    check_mutations("hopper-mutations", &twins(FlashArch::Sm90a), &mutations);
    // The 32-byte swizzle: five boxes of 16 features a tile.
    let d80 = forward(
        &head_dims_model(&[(80, 80, 2, 1, true, true), (80, 80, 2, 1, false, true)]),
        "bf16",
        FlashArch::Sm90a,
    );
    let swizzle32: [(Mutation, bool); 3] = [
        // K read half a box further per 16 features (boxes of 16 features a step).
        (
            (
                SM90,
                "return (kk * 16) / ATOM * BOX +",
                "return (kk * 16) / ATOM * BOX / 2 +",
            ),
            true,
        ),
        // The emulator's 32-byte swizzle taken for none.
        (
            (
                "mma_emu.h",
                "const uintptr_t mask = sw == 128 ? 7 : sw == 64 ? 3 : 1;",
                "const uintptr_t mask = sw == 128 ? 7 : sw == 64 ? 3 : 0;",
            ),
            false,
        ),
        // V's last 16 features (the second wgmma of N = 64 + 16) read from
        // box 2 instead of box 4.
        (
            (
                SM90,
                "return n0 / ATOM * BOX; }",
                "return n0 / ATOM / 2 * BOX; }",
            ),
            false,
        ),
    ];
    check_mutations("hopper-mutations-d80", &d80, &swizzle32);
}

/// The persistent Hopper forward's order (`ForwardSchedule`), compiled on
/// the host: over query tiles, heads, batches, grouped-query ratios and key
/// lengths, some whose keys and values fill L2 several times over (so that
/// the heads fall into sections, the last one short), every (query tile,
/// head, batch) item is visited exactly once, the sections' heads in order,
/// and causal items come longest first within each section.
#[test]
fn the_persistent_forward_visits_every_item_once() {
    if !host::have_cxx() {
        return;
    }
    let cpp = String::from("#include \"block_shim.h\"\n#include \"mma_emu.h\"\n")
        + fusec_compiler::emit::PRELUDE
        + r#"
#include "attention/forward_sm90_persistent.cuh"
#include <cstdio>
#include <vector>
int main() {
    const long long lens[] = {1, 100, 1024, 8192, 100000};
    int checked = 0;
    for (long long q_len : {1LL, 17LL, 192LL, 1000LL, 4096LL})
        for (long long kv_len : lens)
            for (long long heads : {1LL, 3LL, 8LL, 25LL})
                for (long long group : {1LL, 2LL, 8LL})
                    for (long long batch : {1LL, 2LL, 5LL}) {
                        if (heads % group) continue;
                        fs_attn::ForwardArgs a{};
                        a.batch = batch, a.q_heads = heads, a.q_len = q_len, a.kv_len = kv_len, a.group = group;
                        const int tile_q = 192;
                        const fs_attn::ForwardSchedule s(a, tile_q, 256);
                        const long long tiles_q = (q_len + tile_q - 1) / tile_q;
                        if (s.items != tiles_q * heads * batch) { printf("items %d\n", s.items); return 1; }
                        std::vector<int> seen(s.items, 0);
                        long long last_hb = -1, last_rank_q0 = 0, last_section = -1;
                        for (long long i = 0; i < s.items; ++i) {
                            int q0, h, b;
                            s.at<true>(i, tile_q, q0, h, b);
                            if (q0 < 0 || q0 >= q_len || q0 % tile_q || h < 0 || h >= heads || b < 0 || b >= batch) {
                                printf("item %lld out of range: q0 %d h %d b %d\n", i, q0, h, b);
                                return 1;
                            }
                            const long long section = (b * heads + h) / s.section;
                            if (section < last_section) { printf("sections out of order at %lld\n", i); return 1; }
                            if (section == last_section && q0 > last_rank_q0) { printf("a longer tile after a shorter at %lld\n", i); return 1; }
                            last_section = section, last_rank_q0 = q0, last_hb = b * heads + h;
                            if (seen[(q0 / tile_q * batch + b) * heads + h]++) { printf("item %lld twice\n", i); return 1; }
                        }
                        (void)last_hb;
                        ++checked;
                    }
    printf("%d launches\n", checked);
    return 0;
}
"#;
    let work = host::work_dir("flash-schedule");
    let exe = host::build(&work, "schedule", &cpp);
    let out = std::process::Command::new(&exe).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    println!("{text}");
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn flash_attention_compiles_with_nvrtc_without_spills() {
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
                let b = forward(src, precision, family);
                for set in b.sets {
                    for &arch in archs {
                        jobs.push((
                            precision,
                            arch,
                            set.what.clone(),
                            set.kernels[0].launch.clone(),
                        ));
                    }
                }
            }
        }
    }
    // Every head dim with dropout, on mma.sync (for sm_90) and on Hopper.
    let dropping = common::flash::with_dropout(&head_dims_model(HEAD_DIMS));
    for (family, arch) in [(FlashArch::Sm80, "sm_90"), (FlashArch::Sm90a, "sm_90a")] {
        for set in forward(&dropping, "bf16", family).sets {
            jobs.push((
                "bf16",
                arch,
                set.what.clone(),
                set.kernels[0].launch.clone(),
            ));
        }
    }
    // Distinct instantiations once each (the wrapper text differs by views only).
    jobs.sort_by(|a, b| (a.1, &a.3.template).cmp(&(b.1, &b.3.template)));
    jobs.dedup_by(|a, b| a.1 == b.1 && a.3.template == b.3.template);
    let failures = compile_all(&jobs);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn flash_attention_kernel_text() {
    for (arch, name) in [
        (FlashArch::Sm80, "flash_forward_d64_gqa4_causal_bf16"),
        (FlashArch::Sm90a, "flash_forward_sm90a_d64_gqa4_causal_bf16"),
    ] {
        let b = forward(SNAPSHOT_MODEL, "bf16", arch);
        assert_eq!(b.sets.len(), 1);
        let l = &b.sets[0].kernels[0].launch;
        let g = l.grid_c();
        let text = format!(
            "// launch: grid ({}, {}, {}), block {}, dynamic shared {} bytes\n{}",
            g[0],
            g[1],
            g[2],
            l.block,
            l.dynamic_smem_bytes,
            l.source.replace(l.name.as_str(), "KERNEL")
        );
        insta::assert_snapshot!(name, text);
    }
}

/// Head dims that are not multiples of 8 or are over 256, and a Dv that
/// is not, get no tensor-core kernel (the simple kernel stays), in f32 as
/// in bf16.
#[test]
fn unsupported_attention_gets_no_flash_kernel() {
    let cases = [
        head_dims_model(&[(36, 36, 2, 1, true, false)]).replace("PRECISION", "f32"),
        head_dims_model(&[(36, 36, 2, 1, true, false)]).replace("PRECISION", "bf16"),
        head_dims_model(&[(264, 264, 2, 1, true, false)]).replace("PRECISION", "bf16"),
        head_dims_model(&[(64, 36, 2, 1, true, false)]).replace("PRECISION", "bf16"),
    ];
    for src in &cases {
        let c = common::compile_with(src, "flash.dsl", &[]);
        let program = fuse(&c.optimized);
        let mut seen = 0;
        for k in &program.kernels {
            let Body::Op(n) = k.body else { continue };
            if !matches!(c.optimized.g[n].op, Op::Attention(_)) {
                continue;
            }
            seen += 1;
            for arch in [FlashArch::Sm80, FlashArch::Sm90a] {
                for tf32 in [false, true] {
                    assert!(
                        flash_forward(&c.optimized, &program, k, n, None, arch, 132, tf32)
                            .is_none()
                    );
                }
            }
        }
        assert_eq!(seen, 1);
    }
}
