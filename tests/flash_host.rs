//! The tensor-core FlashAttention-2 forward kernel (compiler/src/emit/flash.rs),
//! verified without a GPU:
//!
//! - its exact text runs on the host, 128 OS threads per block with real
//!   barriers (tests/flash_host/block_shim.h), its warp-level PTX (mma
//!   m16n8k16, shuffles) emulated with the PTX ISA's fragment layouts
//!   (tests/flash_host/mma_emu.h), and must compute what the kernel-IR
//!   interpreter computes (the op's CPU reference): head dims 64 and 128,
//!   T = S in {1, 17, 64, 100, 130}, causal and not, grouped-query ratios 1
//!   and 4, q/k/v as strided slices of a fused projection and as contiguous
//!   heads, bf16 (and f16 on a subset), and cross-attention with S != T
//!   (17/130, 130/17, 100/64); O within 2e-2 of max |O|, LSE within 1e-2;
//! - a wrong fragment mapping (in the kernel, or in the emulator), and a few
//!   plain logic bugs (no rescale, causal mask off by one, no tail mask),
//!   fail that comparison;
//! - NVRTC compiles every variant for sm_80 and sm_90 without spills (skipped,
//!   saying so, where libnvrtc is missing);
//! - one kernel's text is held in a snapshot.
//!
//! The host runs are skipped, with a message, where no `c++` compiler exists.

mod common;

use common::host;

use fusec_compiler::emit::flash::{flash_kernel, FlashArch, FlashLaunch};
use fusec_compiler::emit::{PRELUDE, PRELUDE_NAME};
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::ir::Graph;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::{Body, Kernel, Program};
use fusec_compiler::ops::Op;
use std::collections::HashMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// Every supported variant: head dims 64 and 128; fused projections read as
/// strided views (ratio 1: 2 heads each; ratio 4: 4 query heads on 1) and
/// separate projections with contiguous heads (ratio 1: 2 on 2; ratio 4: 8
/// on 2); each causal and not; and the non-causal 8-on-2 D = 64 one again
/// with a negative scale (which the kernels apply before the row max
/// instead of in the exponent).
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

/// The kernel the snapshot holds: fused projection, 4 query heads on 1,
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

struct Flash {
    /// Index into `Program::kernels`.
    kernel: usize,
    source: String,
    launch: FlashLaunch,
    /// (head dim, group ratio, causal, strided) for messages and coverage.
    what: String,
}

struct Built {
    g: Graph,
    program: Program,
    flash: Vec<Flash>,
}

fn is_attention(g: &Graph, k: &Kernel) -> bool {
    matches!(k.body, Body::Op(n) if matches!(g.g[n].op, Op::Attention(_)))
}

fn build(src: &str, precision: &str, arch: FlashArch) -> Built {
    let src = src.replace("PRECISION", precision);
    let c = common::compile_with(&src, "flash.dsl", &[]);
    let g = c.optimized;
    let program = fuse(&g);
    let mut flash = Vec::new();
    for (i, k) in program.kernels.iter().enumerate() {
        let Body::Op(n) = k.body else {
            continue;
        };
        if !is_attention(&g, k) {
            continue;
        }
        let (source, launch) = flash_kernel(&g, &program, k, n, None, arch)
            .unwrap_or_else(|| panic!("{}: no flash kernel for a supported attention", k.name));
        let ins = g.inputs(n);
        let (q, kk) = (g.ty(ins[0]), g.ty(ins[1]));
        let causal = matches!(&g.g[n].op, Op::Attention(a) if a.causal);
        let strided = k.input_views.iter().any(|v| v.is_some());
        let what = format!(
            "D={} ratio={} causal={causal} {}",
            q.shape[3],
            q.shape[2].as_const().unwrap() / kk.shape[2].as_const().unwrap(),
            if strided { "strided" } else { "contiguous" }
        );
        flash.push(Flash {
            kernel: i,
            source,
            launch,
            what,
        });
    }
    Built { g, program, flash }
}

fn work_dir(label: &str) -> PathBuf {
    host::work_dir(&format!("flash-host-{label}"))
}

/// A broken copy of one of the emulator's or the kernel's lines, for the
/// mutation test: (file, pattern, replacement).
type Mutation = (&'static str, &'static str, &'static str);

/// One C++ program holding `kernels` (indices into `b.flash`) and a `main`
/// that runs the one named on its command line on the files in a folder.
fn harness(b: &Built, kernels: &[usize], kernel_mutation: Option<Mutation>) -> String {
    let mut s = String::from("#include \"block_shim.h\"\n#include \"mma_emu.h\"\n");
    s.push_str(PRELUDE);
    for &f in kernels {
        let mut text = b.flash[f]
            .source
            .replace(&format!("#include \"{PRELUDE_NAME}\""), "");
        if let Some((_, from, to)) = kernel_mutation {
            assert!(text.contains(from), "the kernel has no `{from}`");
            text = text.replace(from, to);
        }
        s.push_str(&text);
    }
    s.push_str(host::FILE_IO);
    s.push_str(
        "int main(int argc, char** argv) {\n  const char* dir = argv[2];\n\
         \x20 const fs_dim3 grid = {(unsigned)atoi(argv[3]), (unsigned)atoi(argv[4]), (unsigned)atoi(argv[5])};\n\
         \x20 const unsigned block = atoi(argv[6]);\n",
    );
    for (i, d) in b.g.dims.iter().enumerate() {
        let _ = writeln!(s, "  const fs_i64 {d} = atoll(argv[{}]);", i + 7);
    }
    for &f in kernels {
        let k = &b.program.kernels[b.flash[f].kernel];
        let _ = writeln!(s, "  if (!strcmp(argv[1], \"{}\")) {{", k.name);
        // Unwritten outputs read back as NaN.
        let (args, writes) = host::kernel_buffers(&mut s, &b.program, k, &b.g.dims, true);
        let _ = writeln!(
            s,
            "    fs_launch(grid, block, [&] {{ {}({}); }});",
            k.name,
            args.join(", ")
        );
        s.push_str(&writes);
        let _ = writeln!(s, "    return 0;\n  }}");
    }
    s.push_str("  fprintf(stderr, \"unknown kernel %s\\n\", argv[1]);\n  return 2;\n}\n");
    s
}

/// Builds the harness in `work`, with `mutation` applied to a copy of the
/// header it names (found before tests/flash_host's own).
fn compile(work: &Path, stem: &str, cpp: &str, mutation: Option<Mutation>) -> PathBuf {
    let dir = work.join(stem);
    std::fs::create_dir_all(&dir).unwrap();
    if let Some((h, from, to)) = mutation {
        let text =
            std::fs::read_to_string(common::root().join("tests/flash_host").join(h)).unwrap();
        assert!(text.contains(from), "{h} has no `{from}`");
        std::fs::write(dir.join(h), text.replace(from, to)).unwrap();
    }
    host::build(&dir, stem, cpp)
}

/// The interpreter's buffers at the sizes `dims`.
fn reference(b: &Built, dims: &HashMap<String, i64>) -> Vec<Tensor> {
    host::program_values(&b.g, &b.program, dims, 11)
}

/// Runs flash kernel `f` on the interpreter's inputs and compares its O and
/// LSE with the interpreter's. `Err` says where they differ.
fn run_and_compare(
    exe: &Path,
    dir: &Path,
    b: &Built,
    f: usize,
    bufs: &[Tensor],
    dims: &HashMap<String, i64>,
) -> Result<(f64, f64), String> {
    let flash = &b.flash[f];
    let k = &b.program.kernels[flash.kernel];
    let grid = flash
        .launch
        .grid(&|s: &str| dims.get(s).copied())
        .expect("grid");
    let mut args: Vec<String> = grid.iter().map(|x| x.to_string()).collect();
    args.push(flash.launch.block.to_string());
    args.extend(b.g.dims.iter().map(|d| dims[d].to_string()));
    let outs = host::run_kernel(exe, dir, &b.program, k, bufs, &args)?;
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

/// Every flash kernel of `b` at every size in `runs`: the number checked.
fn check_all(label: &str, b: &Built, runs: &[&[(&str, i64)]]) -> usize {
    let work = work_dir(label);
    let all: Vec<usize> = (0..b.flash.len()).collect();
    let exe = compile(&work, "flash", &harness(b, &all, None), None);
    let mut checked = 0;
    let (mut o_err, mut lse_err) = (0.0f64, 0.0f64);
    for (r, sizes) in runs.iter().enumerate() {
        let dims = common::dims(sizes);
        let bufs = reference(b, &dims);
        for (f, flash) in b.flash.iter().enumerate() {
            let name = &b.program.kernels[flash.kernel].name;
            let dir = work.join(format!("{name}-{r}"));
            match run_and_compare(&exe, &dir, b, f, &bufs, &dims) {
                Ok((o, l)) => (o_err, lse_err) = (o_err.max(o), lse_err.max(l)),
                Err(e) => panic!("{label} {name} ({}) at {sizes:?}: {e}", flash.what),
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
    let b = build(MODEL, "bf16", FlashArch::Sm80);
    assert_eq!(b.flash.len(), 17, "one flash kernel per attention op");
    let mut kinds: Vec<&str> = b.flash.iter().map(|f| f.what.as_str()).collect();
    kinds.sort();
    kinds.dedup();
    assert_eq!(
        kinds.len(),
        16,
        "every variant, one of them twice: {kinds:?}"
    );
    let checked = check_all("bf16", &b, RUNS);
    println!("bf16: {checked} flash kernel runs matched the reference ({kinds:?})");
}

#[test]
fn flash_attention_matches_the_reference_in_f16() {
    if !host::have_cxx() {
        return;
    }
    let b = build(MODEL, "f16", FlashArch::Sm80);
    assert_eq!(b.flash.len(), 17);
    let checked = check_all("f16", &b, &[&[("B", 1), ("T", 100)]]);
    println!("f16: {checked} flash kernel runs matched the reference");
}

#[test]
fn flash_cross_attention_matches_the_reference() {
    if !host::have_cxx() {
        return;
    }
    let b = build(CROSS_MODEL, "bf16", FlashArch::Sm80);
    assert_eq!(b.flash.len(), 2);
    let runs: &[&[(&str, i64)]] = &[
        &[("B", 2), ("T", 17), ("S", 130)],
        &[("B", 1), ("T", 130), ("S", 17)],
        &[("B", 1), ("T", 100), ("S", 64)],
    ];
    let checked = check_all("cross", &b, runs);
    println!("cross: {checked} flash kernel runs matched the reference");
}

/// The Hopper (wgmma) forward, `emit/flash_sm90.rs`, on the same variants
/// and sizes and T = 300: 128-key tiles in two buffers (T = 300 takes three
/// key tiles, the last partial, and reuses a buffer, as the cross run's S =
/// 520 does with five); query blocks of 128 rows
/// at D = 128 (T = 130 takes two) and 192 at D = 64 (the cross runs' T =
/// 200 take two, causal and not).
#[test]
fn hopper_flash_attention_matches_the_reference_on_the_host() {
    if !host::have_cxx() {
        return;
    }
    let b = build(MODEL, "bf16", FlashArch::Sm90a);
    assert_eq!(b.flash.len(), 17, "one flash kernel per attention op");
    let runs: Vec<&[(&str, i64)]> = RUNS
        .iter()
        .copied()
        .chain([&[("B", 1), ("T", 300)][..]])
        .collect();
    let checked = check_all("hopper-bf16", &b, &runs);
    println!("hopper bf16: {checked} flash kernel runs matched the reference");
    let b = build(MODEL, "f16", FlashArch::Sm90a);
    let checked = check_all("hopper-f16", &b, &[&[("B", 1), ("T", 100)]]);
    println!("hopper f16: {checked} flash kernel runs matched the reference");
    let b = build(CROSS_MODEL, "bf16", FlashArch::Sm90a);
    let runs: &[&[(&str, i64)]] = &[
        &[("B", 2), ("T", 17), ("S", 130)],
        &[("B", 1), ("T", 130), ("S", 17)],
        &[("B", 1), ("T", 200), ("S", 520)],
    ];
    let checked = check_all("hopper-cross", &b, runs);
    println!("hopper cross: {checked} flash kernel runs matched the reference");
}

/// The Hopper kernel's own layouts: the query tile in core matrices, the
/// swizzled key and value tiles and their copies, the descriptors' strides,
/// the emulator's reading of them, P as wgmma's register fragment, and the
/// warpgroups' causal masks.
#[test]
fn a_broken_wgmma_layout_is_caught() {
    if !host::have_cxx() {
        return;
    }
    let mutations: [(Mutation, bool); 10] = [
        // V's descriptor stepping 8 keys at a time instead of 16.
        (
            (
                "kernel",
                "fs_desc_at(vt_desc, (kk) * 2048)",
                "fs_desc_at(vt_desc, (kk) * 1024)",
            ),
            false,
        ),
        // K's descriptor stepping 8 features within a swizzled row instead of 16.
        (
            (
                "kernel",
                "fs_desc_at(kt_desc, (kk) / 4 * 16384 + (kk) % 4 * 32)",
                "fs_desc_at(kt_desc, (kk) / 4 * 16384 + (kk) % 4 * 16)",
            ),
            true,
        ),
        // The query copy stores rows row-major instead of in core matrices.
        (
            (
                "kernel",
                "const int r = (c / (8 * CHUNKS)) * 8 + (c & 7), e = ((c >> 3) % CHUNKS) * 8;\n        const fs_i64 i",
                "const int r = c / CHUNKS, e = (c % CHUNKS) * 8;\n        const fs_i64 i",
            ),
            false,
        ),
        // The key tiles copied from the next row on.
        (
            (
                "kernel",
                "fs_tma_load(kt + a * TILE_K * 64, tm_k, a * 64, (int)kv_h, k0,",
                "fs_tma_load(kt + a * TILE_K * 64, tm_k, a * 64, (int)kv_h, k0 + 1,",
            ),
            true,
        ),
        // The host copy writes rows unswizzled (the emulated wgmma still
        // reads them swizzled).
        (
            (
                "kernel",
                "memcpy(fs_swizzle128(out + r * 128 + e * 2), &v, 2)",
                "memcpy(out + r * 128 + e * 2, &v, 2)",
            ),
            false,
        ),
        // The emulator reads swizzled tiles without the swizzle.
        (
            (
                "mma_emu.h",
                "at = reinterpret_cast<const unsigned char*>(a ^ (((a >> 7) & 7) << 4));",
                "at = reinterpret_cast<const unsigned char*>(a);",
            ),
            true,
        ),
        // P's register fragment: registers 1 and 2 swapped.
        (
            (
                "kernel",
                "p_frag[kk][1] = fs_pack_bf16(s[2 * kk][2], s[2 * kk][3]);\n            p_frag[kk][2] = fs_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);",
                "p_frag[kk][2] = fs_pack_bf16(s[2 * kk][2], s[2 * kk][3]);\n            p_frag[kk][1] = fs_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);",
            ),
            true,
        ),
        // The second warpgroup's diagonal tile left unmasked.
        (
            (
                "kernel",
                "(causal && k0 + TILE_K - 1 > q0 + wg * 64 + warp * 16)",
                "(causal && k0 + TILE_K - 1 > q0 + 64 + wg * 64 + warp * 16)",
            ),
            true,
        ),
        // The emulator reads swizzled MN-major rows K-major.
        (
            (
                "mma_emu.h",
                "(mn_major ? (mn / 64) * lbo + (mn % 64) * 2 + (k % 8) * 128 + (k / 8) * sbo",
                "(!mn_major ? (mn / 64) * lbo + (mn % 64) * 2 + (k % 8) * 128 + (k / 8) * sbo",
            ),
            false,
        ),
        // The emulator's descriptor strides exchanged.
        (
            (
                "mma_emu.h",
                "p + (mn / 8) * sbo + (k / 8) * lbo",
                "p + (mn / 8) * lbo + (k / 8) * sbo",
            ),
            true,
        ),
    ];
    check_mutations("hopper-mutations", FlashArch::Sm90a, &mutations);
}

/// A wrong fragment mapping, in the kernel or in the emulator, must make the
/// comparison fail (else the host runs prove nothing about the layouts); so
/// must a few plain bugs of the kernel's logic. Each mutation names the
/// kernel it breaks: the causal one, or the other (whose keys past S only
/// the tail mask hides).
#[test]
fn a_broken_fragment_mapping_is_caught() {
    if !host::have_cxx() {
        return;
    }
    let mutations: [(Mutation, bool); 9] = [
        // The kernel reads K's B fragment halves the wrong way round.
        (("kernel", "s[n], q_frag[kk], b[0], b[1]", "s[n], q_frag[kk], b[1], b[0]"), true),
        // The kernel's P fragment: registers 1 and 2 swapped.
        (
            (
                "kernel",
                "{fs_pack_bf16(s[2 * kk][0], s[2 * kk][1]), fs_pack_bf16(s[2 * kk][2], s[2 * kk][3]),\n                                        fs_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),",
                "{fs_pack_bf16(s[2 * kk][0], s[2 * kk][1]), fs_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),\n                                        fs_pack_bf16(s[2 * kk][2], s[2 * kk][3]),",
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
        (
            (
                "mma_emu.h",
                "row = i < 2 ? group : group + 8;",
                "row = i < 2 ? group + 8 : group;",
            ),
            true,
        ),
        // Not layouts, but the same test's reach: the online softmax's
        // accumulator rescale dropped, the causal mask off by one, the mask
        // of keys past S dropped (T = 130: 3 key tiles, the last partial).
        (("kernel", "o_acc[n][2 * r] *= rescale;", ""), true),
        (("kernel", "(causal && j > i)", "(causal && j > i + 1)"), true),
        (("kernel", "if (j >= kv_len || (causal", "if ((causal"), false),
        // V's B fragments (keys 0-7 and 8-15 of the tile) swapped.
        (
            (
                "kernel",
                "o_acc[n], p_frag, b[0], b[1]",
                "o_acc[n], p_frag, b[1], b[0]",
            ),
            false,
        ),
        // The emulator's ldmatrix.trans with the two rows of a register swapped.
        (
            ("mma_emu.h", "r[i] = lo | (hi << 16);", "r[i] = hi | (lo << 16);"),
            true,
        ),
    ];
    check_mutations("mutations", FlashArch::Sm80, &mutations);
}

/// Runs each mutation on the causal kernel (`true`) or the other one of
/// the snapshot model plus its non-causal twin, at T = 130, and requires the
/// unbroken kernels to pass and every mutation to fail.
fn check_mutations(label: &str, arch: FlashArch, mutations: &[(Mutation, bool)]) {
    let src = SNAPSHOT_MODEL
        .replace(
            "train {",
            "let y2 = merge_heads(attention(heads(q, 4), heads(k, 1), heads(v, 1)))\ntrain {",
        )
        .replace("loss = mean(y * y)", "loss = mean(y * y) + mean(y2 * y2)");
    let b = build(&src, "bf16", arch);
    let causal = b
        .flash
        .iter()
        .position(|f| f.what.contains("causal=true"))
        .unwrap();
    let plain = b
        .flash
        .iter()
        .position(|f| f.what.contains("causal=false"))
        .unwrap();
    let dims = common::dims(&[("B", 1), ("T", 130)]);
    let bufs = reference(&b, &dims);
    // The unbroken build passes, so each failure below is the mutation's.
    let work = work_dir(label);
    let exe = compile(&work, "good", &harness(&b, &[causal, plain], None), None);
    for f in [causal, plain] {
        run_and_compare(
            &exe,
            &work.join(format!("good-run-{f}")),
            &b,
            f,
            &bufs,
            &dims,
        )
        .expect("the unbroken kernel");
    }
    for (i, &(m, on_causal)) in mutations.iter().enumerate() {
        let f = if on_causal { causal } else { plain };
        let (kernel_m, header_m) = if m.0 == "kernel" {
            (Some(m), None)
        } else {
            (None, Some(m))
        };
        let stem = format!("broken{i}");
        let exe = compile(&work, &stem, &harness(&b, &[f], kernel_m), header_m);
        let got = run_and_compare(&exe, &work.join(format!("{stem}-run")), &b, f, &bufs, &dims);
        let e = got.expect_err(&format!("mutation {i} ({}: `{}`) went unnoticed", m.0, m.1));
        println!("mutation {i} ({}) caught: {e}", m.0);
    }
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn flash_attention_compiles_with_nvrtc_without_spills() {
    use fusec_runtime::nvrtc;
    if !common::nvrtc_ready() {
        return;
    }
    let mut failures = Vec::new();
    for precision in ["bf16", "f16"] {
        for (family, archs) in [
            (FlashArch::Sm80, &["sm_80", "sm_90"][..]),
            (FlashArch::Sm90a, &["sm_90a"][..]),
        ] {
            let b = build(MODEL, precision, family);
            for f in &b.flash {
                let name = &b.program.kernels[f.kernel].name;
                for &arch in archs {
                    match nvrtc::compile(name, &f.source, arch) {
                        Ok(c) => {
                            common::keep_cubin(
                                name,
                                &format!("{precision} {arch} {}", f.what),
                                &c.image,
                            );
                            println!(
                            "{precision} {} {arch}: {} registers, spills {}/{} bytes, {} bytes shared",
                            f.what,
                            c.registers.unwrap_or(0),
                            c.spill_store_bytes,
                            c.spill_load_bytes,
                            f.launch.static_smem_bytes + f.launch.dynamic_smem_bytes
                        );
                            // ptxas serializes wgmma it cannot prove safe to
                            // overlap, and says so ("Potential Performance Loss").
                            if c.log.contains("Performance Loss") {
                                failures.push(format!("{name} {} ({arch}): {}", f.what, c.log));
                            }
                            if c.spill_store_bytes > 0 || c.spill_load_bytes > 0 {
                                failures
                                    .push(format!("{name} {} ({arch}): spills\n{}", f.what, c.log));
                            }
                        }
                        Err(e) => failures.push(format!(
                            "{e}\n--- source ---\n{}",
                            nvrtc::with_prelude(&f.source)
                        )),
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn flash_attention_kernel_text() {
    let b = build(SNAPSHOT_MODEL, "bf16", FlashArch::Sm80);
    assert_eq!(b.flash.len(), 1);
    let f = &b.flash[0];
    let name = &b.program.kernels[f.kernel].name;
    let launch = &f.launch;
    let text = format!(
        "// launch: grid ({}, {}, {}), block {}, static shared {} bytes, dynamic shared {}\n{}",
        launch.grid_c[0],
        launch.grid_c[1],
        launch.grid_c[2],
        launch.block,
        launch.static_smem_bytes,
        launch.dynamic_smem_bytes,
        f.source.replace(name.as_str(), "KERNEL")
    );
    insta::assert_snapshot!("flash_forward_d64_gqa4_causal_bf16", text);
}

#[test]
fn hopper_flash_attention_kernel_text() {
    let b = build(SNAPSHOT_MODEL, "bf16", FlashArch::Sm90a);
    let f = &b.flash[0];
    let name = &b.program.kernels[f.kernel].name;
    let launch = &f.launch;
    let text = format!(
        "// launch: grid ({}, {}, {}), block {}, static shared {} bytes, dynamic shared {}\n{}",
        launch.grid_c[0],
        launch.grid_c[1],
        launch.grid_c[2],
        launch.block,
        launch.static_smem_bytes,
        launch.dynamic_smem_bytes,
        f.source.replace(name.as_str(), "KERNEL")
    );
    insta::assert_snapshot!("flash_forward_sm90a_d64_gqa4_causal_bf16", text);
}

/// f32, head dims other than 64 and 128, and differing q/v head dims get no
/// flash kernel (the simple kernel stays).
#[test]
fn unsupported_attention_gets_no_flash_kernel() {
    let cases = [
        // f32
        SNAPSHOT_MODEL.replace("precision = bf16", "precision = f32"),
        // D = 32
        SNAPSHOT_MODEL
            .replace("[d, 384]", "[d, 192]")
            .replace("[256, 64, 64]", "[128, 32, 32]"),
        // Dv = 32 != D = 64
        SNAPSHOT_MODEL
            .replace("[d, 384]", "[d, 352]")
            .replace("[256, 64, 64]", "[256, 64, 32]"),
    ];
    for src in &cases {
        let c = common::compile_with(src, "flash.dsl", &[]);
        let program = fuse(&c.optimized);
        let mut seen = 0;
        for k in &program.kernels {
            if let (true, Body::Op(n)) = (is_attention(&c.optimized, k), &k.body) {
                let n = *n;
                seen += 1;
                for arch in [FlashArch::Sm80, FlashArch::Sm90a] {
                    assert!(flash_kernel(&c.optimized, &program, k, n, None, arch).is_none());
                }
            }
        }
        assert_eq!(seen, 1);
    }
}
