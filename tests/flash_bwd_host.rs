//! The tensor-core FlashAttention-2 backward (compiler/src/emit/flash_bwd.rs),
//! verified without a GPU:
//!
//! - its three kernels' exact text runs on the host, in order, 128 OS threads
//!   per block with real barriers (tests/flash_host/block_shim.h), the
//!   warp-level PTX emulated with the PTX ISA's fragment layouts
//!   (tests/flash_host/mma_emu.h), and dQ, dK, dV must match what the
//!   kernel-IR interpreter computes for the `attention_grad` op: head dims
//!   64 and 128, T = S in {1, 17, 64, 100}, causal and not, grouped-query
//!   ratios 1 and 4, q/k/v as strided slices of a fused projection (and as
//!   contiguous heads), bf16 (f16 on one size), and cross-attention S != T;
//!   each output within 3e-2 of its max |ref|;
//! - deliberate breakages (causal bounds, dropped delta terms, fragment
//!   halves swapped, a dropped scale) fail that comparison;
//! - NVRTC compiles every kernel for sm_80 and sm_90 without spills (skipped,
//!   saying so, where libnvrtc is missing);
//! - one kernel set's text is held in a snapshot.
//!
//! The host runs are skipped, with a message, where no `c++` compiler exists.

mod common;

use common::host;

use fusec_compiler::emit::flash::FlashArch;
use fusec_compiler::emit::flash_bwd::{flash_backward, FlashBwdLaunch, THREADS};
use fusec_compiler::emit::{PRELUDE, PRELUDE_NAME};
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::ir::Graph;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::{Body, Kernel, Program};
use fusec_compiler::ops::Op;
use std::collections::HashMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

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

/// The kernel set the snapshot holds (and the mutation test breaks): fused
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

struct Set {
    /// Index into `Program::kernels`.
    kernel: usize,
    /// The scheme: dQ without atomics, or summed by them.
    deterministic: bool,
    launches: Vec<FlashBwdLaunch>,
    /// (head dim, group ratio, causal, strided) for messages and coverage.
    what: String,
}

struct Built {
    g: Graph,
    program: Program,
    sets: Vec<Set>,
}

fn is_grad(g: &Graph, k: &Kernel) -> bool {
    matches!(k.body, Body::Op(n) if matches!(g.g[n].op, Op::AttentionGrad(_)))
}

fn build(src: &str, precision: &str) -> Built {
    build_for(src, precision, FlashArch::Sm80)
}

/// Both schemes for `FlashArch::Sm80`; the atomic one alone (whose dK/dV/dQ
/// kernel is Hopper's own) for `FlashArch::Sm90a`.
fn build_for(src: &str, precision: &str, arch: FlashArch) -> Built {
    let src = src.replace("PRECISION", precision);
    let c = common::compile_with(&src, "flash_bwd.dsl", &[]);
    let g = c.optimized;
    let program = fuse(&g);
    let mut sets = Vec::new();
    for (i, k) in program.kernels.iter().enumerate() {
        let Body::Op(n) = k.body else {
            continue;
        };
        if !is_grad(&g, k) {
            continue;
        }
        let schemes: &[bool] = match arch {
            FlashArch::Sm80 => &[false, true],
            FlashArch::Sm90a => &[false],
        };
        for &deterministic in schemes {
            let launches = flash_backward(&g, &program, k, n, None, deterministic, arch)
                .unwrap_or_else(|| {
                    panic!("{}: no flash backward for a supported attention", k.name)
                });
            let ins = g.inputs(n);
            let (q, kk) = (g.ty(ins[0]), g.ty(ins[1]));
            let causal = matches!(&g.g[n].op, Op::AttentionGrad(a) if a.causal);
            let strided = k.input_views[..3].iter().any(|v| v.is_some());
            let what = format!(
                "D={} ratio={} causal={causal} {} {}",
                q.shape[3],
                q.shape[2].as_const().unwrap() / kk.shape[2].as_const().unwrap(),
                if strided { "strided" } else { "contiguous" },
                if deterministic {
                    "deterministic"
                } else {
                    "atomic"
                }
            );
            sets.push(Set {
                kernel: i,
                deterministic,
                launches,
                what,
            });
        }
    }
    Built { g, program, sets }
}

fn work_dir(label: &str) -> PathBuf {
    host::work_dir(&format!("flash-bwd-{label}"))
}

/// A broken copy of one of the kernels' lines: (pattern, replacement).
type Mutation = (&'static str, &'static str);

/// A launch's function name in the harness: both schemes of one op share
/// names (`_delta`), so each set's copies are told apart by its index.
fn host_name(l: &FlashBwdLaunch, set: usize) -> String {
    format!("{}_s{set}", l.name)
}

/// One C++ program holding the kernel sets `sets` (indices into `b.sets`)
/// and a `main` that runs the set named on its command line (the op's
/// kernel and the scheme, the last argument), its three kernels in order,
/// on the files in a folder.
fn harness(b: &Built, sets: &[usize], mutation: Option<Mutation>) -> String {
    let mut s = String::from("#include \"block_shim.h\"\n#include \"mma_emu.h\"\n");
    s.push_str(PRELUDE);
    for &f in sets {
        for l in &b.sets[f].launches {
            let mut text = l
                .source
                .replace(&format!("#include \"{PRELUDE_NAME}\""), "")
                .replace(&format!(" {}(", l.name), &format!(" {}(", host_name(l, f)));
            if let Some((from, to)) = mutation {
                text = text.replace(from, to);
            }
            s.push_str(&text);
        }
    }
    s.push_str(host::FILE_IO);
    // argv: set name, folder, 3 x 3 grid extents, 3 blocks, the sizes, the scheme.
    s.push_str(
        "int main(int argc, char** argv) {\n  const char* dir = argv[2];\n\
         \x20 fs_dim3 grids[3];\n\
         \x20 for (int l = 0; l < 3; ++l) grids[l] = {(unsigned)atoi(argv[3 + 3 * l]), (unsigned)atoi(argv[4 + 3 * l]), (unsigned)atoi(argv[5 + 3 * l])};\n\
         \x20 unsigned blocks[3];\n\
         \x20 for (int l = 0; l < 3; ++l) blocks[l] = atoi(argv[12 + l]);\n",
    );
    for (i, d) in b.g.dims.iter().enumerate() {
        let _ = writeln!(s, "  const fs_i64 {d} = atoll(argv[{}]);", i + 15);
    }
    let _ = writeln!(
        s,
        "  const int deterministic = atoi(argv[{}]);",
        15 + b.g.dims.len()
    );
    for &f in sets {
        let set = &b.sets[f];
        let k = &b.program.kernels[set.kernel];
        let _ = writeln!(
            s,
            "  if (!strcmp(argv[1], \"{}\") && deterministic == {}) {{",
            k.name, set.deterministic as u8
        );
        // Unwritten outputs read back as NaN.
        let (mut args, writes) = host::kernel_buffers(&mut s, &b.program, k, &b.g.dims, true);
        // The scratch buffer starts as NaN: the delta kernel must write it all.
        let scratch = set.launches[0].scratch_f32_elems.to_c();
        let _ = writeln!(
            s,
            "    float* scratch = (float*)malloc((size_t)({scratch}) * 4 + 16); memset(scratch, 0xff, (size_t)({scratch}) * 4);"
        );
        args.push("scratch".into());
        for (l, launch) in set.launches.iter().enumerate() {
            let _ = writeln!(
                s,
                "    fs_launch(grids[{l}], blocks[{l}], [&] {{ {}({}); }});",
                host_name(launch, f),
                args.join(", ")
            );
        }
        s.push_str(&writes);
        let _ = writeln!(s, "    return 0;\n  }}");
    }
    s.push_str("  fprintf(stderr, \"unknown kernel %s\\n\", argv[1]);\n  return 2;\n}\n");
    s
}

/// The interpreter's buffers at the sizes `dims`.
fn reference(b: &Built, dims: &HashMap<String, i64>) -> Vec<Tensor> {
    host::program_values(&b.g, &b.program, dims, 11)
}

/// Runs kernel set `f` on the interpreter's inputs and compares dQ, dK, dV
/// with the interpreter's: the largest error of each relative to its max
/// |ref|, or where they differ.
fn run_and_compare(
    exe: &Path,
    dir: &Path,
    b: &Built,
    f: usize,
    bufs: &[Tensor],
    dims: &HashMap<String, i64>,
) -> Result<[f64; 3], String> {
    let set = &b.sets[f];
    let k = &b.program.kernels[set.kernel];
    let mut args = Vec::new();
    for l in &set.launches {
        let grid = l.grid(&|s: &str| dims.get(s).copied()).expect("grid");
        args.extend(grid.iter().map(|x| x.to_string()));
    }
    args.extend(set.launches.iter().map(|l| l.block.to_string()));
    args.extend(b.g.dims.iter().map(|d| dims[d].to_string()));
    args.push((set.deterministic as u8).to_string());
    let written = host::run_kernel(exe, dir, &b.program, k, bufs, &args)?;
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

/// Every kernel set of `b` at every size in `runs`: the number checked.
fn check_all(label: &str, b: &Built, runs: &[&[(&str, i64)]]) -> usize {
    let work = work_dir(label);
    let all: Vec<usize> = (0..b.sets.len()).collect();
    let exe = host::build(&work, "flash_bwd", &harness(b, &all, None));
    let mut checked = 0;
    let mut worst = [0.0f64; 3];
    for (r, sizes) in runs.iter().enumerate() {
        let dims = common::dims(sizes);
        let bufs = reference(b, &dims);
        for (f, set) in b.sets.iter().enumerate() {
            let name = &b.program.kernels[set.kernel].name;
            let dir = work.join(format!("{name}-{r}"));
            match run_and_compare(&exe, &dir, b, f, &bufs, &dims) {
                Ok(e) => {
                    for (w, e) in worst.iter_mut().zip(e) {
                        *w = w.max(e);
                    }
                }
                Err(e) => panic!("{label} {name} ({}) at {sizes:?}: {e}", set.what),
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
    let b = build(MODEL, "bf16");
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
}

#[test]
fn flash_backward_matches_the_reference_in_f16() {
    if !host::have_cxx() {
        return;
    }
    let b = build(MODEL, "f16");
    assert_eq!(b.sets.len(), 16);
    let checked = check_all("f16", &b, &[&[("B", 1), ("T", 100)]]);
    println!("f16: {checked} kernel-set runs matched the reference");
}

#[test]
fn flash_backward_cross_attention_matches_the_reference() {
    if !host::have_cxx() {
        return;
    }
    let b = build(CROSS_MODEL, "bf16");
    assert_eq!(b.sets.len(), 4);
    let runs: &[&[(&str, i64)]] = &[
        &[("B", 2), ("T", 17), ("S", 100)],
        &[("B", 1), ("T", 100), ("S", 17)],
    ];
    let checked = check_all("cross", &b, runs);
    println!("cross: {checked} kernel-set runs matched the reference");
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
    let b = build_for(MODEL, "bf16", FlashArch::Sm90a);
    assert_eq!(b.sets.len(), 8, "one kernel set per attention_grad op");
    let checked = check_all("hopper-bf16", &b, RUNS);
    println!("hopper bf16: {checked} kernel-set runs matched the reference");
    let b = build_for(MODEL, "f16", FlashArch::Sm90a);
    let checked = check_all("hopper-f16", &b, &[&[("B", 1), ("T", 100)]]);
    println!("hopper f16: {checked} kernel-set runs matched the reference");
    let b = build_for(CROSS_MODEL, "bf16", FlashArch::Sm90a);
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

/// Plain logic bugs of either scheme's kernels, and wrong fragment halves,
/// must make the comparison fail (else the host runs prove little). Each
/// mutation names the set it breaks: causal or not, deterministic or
/// atomic.
#[test]
fn deliberate_breakages_are_caught() {
    if !host::have_cxx() {
        return;
    }
    let b = build(&twin_model(), "bf16");
    let find = |causal: bool, deterministic: bool| {
        b.sets
            .iter()
            .position(|f| {
                f.what.contains(&format!("causal={causal}")) && f.deterministic == deterministic
            })
            .unwrap()
    };
    let (causal, plain) = (find(true, true), find(false, true));
    let (causal_atomic, plain_atomic) = (find(true, false), find(false, false));
    let mutations: [(Mutation, usize); 15] = [
        // dK/dV: the causal bound off by one.
        (
            (
                "kr > qc + diag) ? 0.0f : p;",
                "kr > qc + diag + 1) ? 0.0f : p;",
            ),
            causal,
        ),
        // dK/dV: query tiles start one tile too late.
        (
            ("(k0 / TILE_Q) * TILE_Q", "(k0 / TILE_Q + 1) * TILE_Q"),
            causal,
        ),
        // dQ: the causal bound off by one.
        (
            (
                "if (j >= kv_len || (causal && j > i)) p = 0.0f;",
                "if (j >= kv_len || (causal && j >= i)) p = 0.0f;",
            ),
            causal,
        ),
        // dK: the delta term dropped.
        (
            (
                "dp[n][e] = s[n][e] * (dp[n][e] - delta_tile[n * 8 + frag_col + (e & 1)]);",
                "dp[n][e] = s[n][e] * dp[n][e];",
            ),
            plain,
        ),
        // dQ: the delta term dropped.
        (
            (
                "dp[n][e] = p * (dp[n][e] - delta[r]);",
                "dp[n][e] = p * dp[n][e];",
            ),
            plain,
        ),
        // dQ: K^T's B fragment halves swapped.
        (
            (
                "s[n], q_frag[kk], bk[0], bk[1]",
                "s[n], q_frag[kk], bk[1], bk[0]",
            ),
            plain,
        ),
        // dV: dO's B fragments (rows 0-7 and 8-15 of the query tile) swapped.
        (
            (
                "dv_acc[n], p_frag, bo[0], bo[1]",
                "dv_acc[n], p_frag, bo[1], bo[0]",
            ),
            plain,
        ),
        // ldmatrix.trans: lanes 8-15 and 16-23 give each other's rows.
        (
            (
                "at + ((lane & 7) + ((lane >> 3) & 1) * 8) * row + (lane >> 4) * 8",
                "at + ((lane & 7) + (lane >> 4) * 8) * row + ((lane >> 3) & 1) * 8",
            ),
            plain,
        ),
        // dK: the scale dropped.
        (("dk_acc[n][2 * r] * scale", "dk_acc[n][2 * r]"), plain),
        // Atomic scheme: dS^T's quarters stored in each other's place.
        (
            (
                "(key_row + 8) * DS_ROW + kk * 16 + frag_col], ds_frag[1]",
                "(key_row + 8) * DS_ROW + kk * 16 + frag_col], ds_frag[2]",
            ),
            plain_atomic,
        ),
        // Atomic scheme: dS read back with a wrong lane-to-row mapping.
        (
            (
                "fs_ldsm_x4_t(a, at + ((lane & 7) + (lane >> 4) * 8) * row + ((lane >> 3) & 1) * 8)",
                "fs_ldsm_x4_t(a, at + ((lane & 7) + ((lane >> 3) & 1) * 8) * row + (lane >> 4) * 8)",
            ),
            plain_atomic,
        ),
        // Atomic scheme: the dQ sum not cleared (the scratch starts as NaN).
        (
            ("if (i < q_len) fs_zero16(", "if (i < 0) fs_zero16("),
            plain_atomic,
        ),
        // Atomic scheme: dQ added into the next row.
        (
            (
                "const fs_i64 i = i0 + m0 + frag_row + 8 * r;",
                "const fs_i64 i = i0 + m0 + frag_row + 8 * r + 1;",
            ),
            causal_atomic,
        ),
        // Atomic scheme: dQ's scale dropped when stored.
        (("sum[e] * scale", "sum[e]"), plain_atomic),
        // Atomic scheme: query tiles start one tile too late (dQ and dK lose them).
        (
            ("(k0 / TILE_Q) * TILE_Q", "(k0 / TILE_Q + 1) * TILE_Q"),
            causal_atomic,
        ),
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
    let work = work_dir(label);
    // The unbroken build passes, so each failure below is the mutation's.
    let exe = host::build(&work, "good", &harness(b, all, None));
    for &f in all {
        run_and_compare(&exe, &work.join(format!("good-{f}")), b, f, &bufs, &dims)
            .expect("the unbroken kernels");
    }
    for (i, &((from, to), f)) in mutations.iter().enumerate() {
        let text: String = b.sets[f]
            .launches
            .iter()
            .map(|l| l.source.as_str())
            .collect();
        assert!(
            text.contains(from),
            "mutation {i}: the kernels have no `{from}`"
        );
        let stem = format!("broken{i}");
        let cpp = harness(b, &[f], Some((from, to)));
        let exe = host::build(&work, &stem, &cpp);
        let got = run_and_compare(&exe, &work.join(format!("{stem}-run")), b, f, &bufs, &dims);
        let e = got.expect_err(&format!("mutation {i} (`{from}`) went unnoticed"));
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
    let b = build_for(&twin_model(), "bf16", FlashArch::Sm90a);
    let find = |causal: bool| {
        b.sets
            .iter()
            .position(|f| f.what.contains(&format!("causal={causal}")))
            .unwrap()
    };
    let (causal, plain) = (find(true), find(false));
    let mutations: [(Mutation, usize); 9] = [
        // dQ's A (dS, MN-major) read with its strides exchanged.
        (
            (
                "fs_make_desc(ds_tile, DS_ROW8, CORE)",
                "fs_make_desc(ds_tile, CORE, DS_ROW8)",
            ),
            plain,
        ),
        // dV's B (the swizzled dO tile, MN-major) stepping 8 queries, not 16.
        (
            (
                "fs_desc_at(dom_desc, (kk) * 2048)",
                "fs_desc_at(dom_desc, (kk) * 1024)",
            ),
            plain,
        ),
        // S^T's B (the swizzled Q tile, K-major) stepping 8 features, not 16.
        (
            (
                "fs_desc_at(qk_desc, (kk) / 4 * 8192 + (kk) % 4 * 32)",
                "fs_desc_at(qk_desc, (kk) / 4 * 8192 + (kk) % 4 * 16)",
            ),
            causal,
        ),
        // The dO tiles copied from the next query on.
        (
            (
                "tm_do, a * 64, (int)h, (int)i0, (int)b",
                "tm_do, a * 64, (int)h, (int)i0 + 1, (int)b",
            ),
            plain,
        ),
        // dS^T stored with its key halves swapped.
        (
            (
                "fs_st32(&ds_tile[ds_at(key_row, 16 * kk + frag_col)], ds_frag[kk][0]);\n            fs_st32(&ds_tile[ds_at(key_row + 8, 16 * kk + frag_col)], ds_frag[kk][1]);",
                "fs_st32(&ds_tile[ds_at(key_row + 8, 16 * kk + frag_col)], ds_frag[kk][0]);\n            fs_st32(&ds_tile[ds_at(key_row, 16 * kk + frag_col)], ds_frag[kk][1]);",
            ),
            plain,
        ),
        // Both warpgroups take the first half of dQ's features.
        (
            ("+ wg * 4 * HEAD_DIM, ROW8, CORE)", ", ROW8, CORE)"),
            plain,
        ),
        // The causal mask off by one.
        (
            (
                "kr > qc + diag) ? 0.0f : p;",
                "kr > qc + diag + 1) ? 0.0f : p;",
            ),
            causal,
        ),
        // Diagonal tiles taken for unmasked ones.
        (
            (
                "if (rows < TILE_Q || (causal && i0 < k0 + TILE_K)) {",
                "if (rows < TILE_Q) {",
            ),
            causal,
        ),
        // The writers adding all rows of a tile but the last.
        (
            (
                "for (int r = w / CPR; r < rows; r += RSTEP)",
                "for (int r = w / CPR; r < rows - 1; r += RSTEP)",
            ),
            plain,
        ),
    ];
    expect_caught(&b, "hopper-mutations", &[causal, plain], &mutations);
}

#[test]
fn flash_backward_compiles_with_nvrtc_without_spills() {
    use fusec_runtime::nvrtc;
    if !common::nvrtc_ready() {
        return;
    }
    let mut failures = Vec::new();
    for (precision, family) in [
        ("bf16", FlashArch::Sm80),
        ("f16", FlashArch::Sm80),
        ("bf16", FlashArch::Sm90a),
        ("f16", FlashArch::Sm90a),
    ] {
        let b = build_for(MODEL, precision, family);
        let archs: &[&str] = match family {
            FlashArch::Sm80 => &["sm_80", "sm_90"],
            FlashArch::Sm90a => &["sm_90a"],
        };
        for set in &b.sets {
            for l in &set.launches {
                for &arch in archs {
                    match nvrtc::compile(&l.name, &l.source, arch) {
                        Ok(c) => {
                            common::keep_cubin(
                                &l.name,
                                &format!("{precision} {arch} {}", set.what),
                                &c.image,
                            );
                            println!(
                                "{precision} {} {:?} {arch}: {} registers, spills {}/{} bytes, {} bytes static shared, {} dynamic",
                                set.what,
                                l.stage,
                                c.registers.unwrap_or(0),
                                c.spill_store_bytes,
                                c.spill_load_bytes,
                                l.static_smem_bytes,
                                l.dynamic_smem_bytes
                            );
                            if c.log.contains("Performance Loss") {
                                failures
                                    .push(format!("{} {} ({arch}): {}", l.name, set.what, c.log));
                            }
                            // Hopper's dK/dV/dQ kernel leaves its memory warpgroup
                            // 40 registers a thread at D = 128; since its copies are
                            // one thread's bulk tensor copies it spills nothing there.
                            if c.spill_store_bytes > 0 || c.spill_load_bytes > 0 {
                                failures.push(format!(
                                    "{} {} ({arch}): spills\n{}",
                                    l.name, set.what, c.log
                                ));
                            }
                        }
                        Err(e) => failures.push(format!(
                            "{e}\n--- source ---\n{}",
                            nvrtc::with_prelude(&l.source)
                        )),
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn flash_backward_kernel_text() {
    let b = build(SNAPSHOT_MODEL, "bf16");
    assert_eq!(b.sets.len(), 2);
    for set in &b.sets {
        snapshot_set(&b, set);
    }
    let b = build_for(SNAPSHOT_MODEL, "bf16", FlashArch::Sm90a);
    assert_eq!(b.sets.len(), 1);
    snapshot_set(&b, &b.sets[0]);
}

/// One kernel set's launches and texts in a snapshot (the deterministic
/// scheme under the older name).
fn snapshot_set(b: &Built, set: &Set) {
    let name = &b.program.kernels[set.kernel].name;
    let mut text = String::new();
    for l in &set.launches {
        let _ = writeln!(
            text,
            "// launch {:?}: grid ({}, {}, {}), block {}, shared {} bytes static, {} dynamic, reads in{:?}, writes out{:?}, scratch f32[{}] ({})",
            l.stage,
            l.grid_c[0],
            l.grid_c[1],
            l.grid_c[2],
            l.block,
            l.static_smem_bytes,
            l.dynamic_smem_bytes,
            l.reads,
            l.writes,
            l.scratch_f32_elems.to_c(),
            if l.writes_scratch() { "written" } else { "read" }
        );
        text.push_str(&l.source.replace(name.as_str(), "KERNEL"));
    }
    if set.launches[1].block != THREADS {
        insta::assert_snapshot!("flash_backward_sm90a_d64_gqa4_causal_bf16_atomic", text);
    } else if set.deterministic {
        insta::assert_snapshot!("flash_backward_d64_gqa4_causal_bf16", text);
    } else {
        insta::assert_snapshot!("flash_backward_d64_gqa4_causal_bf16_atomic", text);
    }
}

/// f32, head dims other than 64 and 128 get no flash backward.
#[test]
fn unsupported_attention_gets_no_flash_backward() {
    let cases = [
        SNAPSHOT_MODEL.replace("precision = bf16", "precision = f32"),
        SNAPSHOT_MODEL
            .replace("[d, 384]", "[d, 192]")
            .replace("[256, 64, 64]", "[128, 32, 32]"),
    ];
    for src in &cases {
        let c = common::compile_with(src, "flash_bwd.dsl", &[]);
        let program = fuse(&c.optimized);
        let mut seen = 0;
        for k in &program.kernels {
            if let (true, Body::Op(n)) = (is_grad(&c.optimized, k), &k.body) {
                seen += 1;
                for (deterministic, arch) in [
                    (false, FlashArch::Sm80),
                    (true, FlashArch::Sm80),
                    (false, FlashArch::Sm90a),
                ] {
                    assert!(flash_backward(
                        &c.optimized,
                        &program,
                        k,
                        *n,
                        None,
                        deterministic,
                        arch
                    )
                    .is_none());
                }
            }
        }
        assert_eq!(seen, 1);
    }
}
