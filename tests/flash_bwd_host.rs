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
//! - deliberate breakages of the templates fail that comparison
//!   (`flash_bwd_mutations.rs`);
//! - NVRTC compiles every instantiation for sm_80 and sm_90, or sm_90a,
//!   without spills or serialized wgmma (skipped, saying so, where libnvrtc
//!   is missing);
//! - the wrappers' text is held in snapshots.
//!
//! The host runs are skipped, with a message, where no `c++` compiler exists.

mod common;

use common::flash::{
    build_harness, compile_all, head_dims_model, reference, Built, HEAD_DIMS, LENGTHS_MODEL,
    LENGTHS_RUNS,
};
use common::flash_bwd::{backward, run_and_compare, SNAPSHOT_MODEL};
use common::host;
use fusec_compiler::emit::flash::{flash_backward, FlashArch};
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::Body;
use fusec_compiler::ops::Op;
use std::fmt::Write;

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

/// Padded keys (`lengths`): dQ takes nothing from them and their dK, dV
/// rows are zero, on both schemes on mma.sync and the atomic one on Hopper.
#[test]
fn flash_backward_with_lengths_matches_the_reference() {
    if !host::have_cxx() {
        return;
    }
    for arch in [FlashArch::Sm80, FlashArch::Sm90a] {
        let b = backward(LENGTHS_MODEL, "bf16", arch);
        assert!(b.sets.len() >= 3, "every attention_grad on tensor cores");
        let checked = check_all(&format!("lengths-{arch:?}"), &b, LENGTHS_RUNS);
        println!("{arch:?}: {checked} kernel-set runs with lengths matched the reference");
    }
}

/// Dropout: dV takes (P Z)^T dO and dS = P (Z dP - delta) with the
/// forward's mask Z, on both schemes (the key-major dK/dV kernel and the
/// query-major dQ kernel draw the same cells), on every head dim family.
#[test]
fn flash_backward_with_dropout_matches_the_reference() {
    if !host::have_cxx() {
        return;
    }
    let src = common::flash::dropout_model();
    let b = backward(&src, "bf16", FlashArch::Sm80);
    assert_eq!(
        b.sets.len(),
        2 * (common::flash::DROPOUT_VARIANTS.len() + 1),
        "both schemes for every attention_grad"
    );
    let checked = check_all("dropout", &b, common::flash::DROPOUT_RUNS);
    println!("{checked} kernel-set runs with dropout matched the reference");
    // Hopper: DkDvDqSm90 up to 192 features in all (split over blocks for the group
    // of 8), the mma.sync kernel for the wider heads.
    let b = backward(&src, "bf16", FlashArch::Sm90a);
    let hopper = b
        .sets
        .iter()
        .filter(|s| {
            s.kernels.iter().any(|k| {
                k.launch
                    .template
                    .as_deref()
                    .is_some_and(|t| t.contains("DkDvDqSm90<"))
            })
        })
        .count();
    assert_eq!(
        hopper, 5,
        "Hopper's own backward for heads up to 192 features in all"
    );
    let checked = check_all("dropout-hopper", &b, common::flash::DROPOUT_RUNS);
    println!("Hopper: {checked} kernel-set runs with dropout matched the reference");
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
    // Every head dim with dropout, on mma.sync (for sm_90) and on Hopper.
    let dropping = common::flash::with_dropout(&head_dims_model(HEAD_DIMS));
    for (family, arch) in [(FlashArch::Sm80, "sm_90"), (FlashArch::Sm90a, "sm_90a")] {
        for set in backward(&dropping, "bf16", family).sets {
            for k in set.kernels {
                jobs.push(("bf16", arch, set.what.clone(), k.launch.clone()));
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

/// Head dims that are not multiples of 8 or are over 256 get no
/// tensor-core backward in any scheme, nor f32 past 256 features in D + Dv
/// (f32 at D = 192); f32 within them gets both schemes on every
/// architecture.
#[test]
fn unsupported_attention_gets_no_flash_backward() {
    let f32 = SNAPSHOT_MODEL.replace("precision = bf16", "precision = f32");
    let cases = [
        (f32, true),
        (
            head_dims_model(&[(192, 192, 2, 1, true, false)]).replace("PRECISION", "f32"),
            false,
        ),
        (
            head_dims_model(&[(36, 36, 2, 1, true, false)]).replace("PRECISION", "bf16"),
            false,
        ),
        (
            head_dims_model(&[(264, 264, 2, 1, true, false)]).replace("PRECISION", "bf16"),
            false,
        ),
    ];
    for (src, supported) in &cases {
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
                let got = flash_backward(
                    &c.optimized,
                    &program,
                    k,
                    n,
                    None,
                    deterministic,
                    arch,
                    false,
                );
                let want = *supported;
                assert_eq!(
                    got.is_some(),
                    want,
                    "deterministic {deterministic} on {arch:?}"
                );
            }
        }
        assert_eq!(seen, 1);
    }
}
