//! The tensor-core attention kernels run on the host: every attention op
//! of a model gets its kernel set (the forward's one kernel, or the
//! backward's three in one scheme), one C++ program holds them with a
//! `main` that runs the set named on its command line on buffers read from
//! files, and the same `kernels/attention/` templates compile there against
//! the shims (tests/flash_host/block_shim.h: every thread an OS thread;
//! mma_emu.h: the warp-level PTX emulated with the ISA's layouts). A
//! mutation breaks a copy of one header (a template, or a shim) on purpose.

use super::host;
use fusec_compiler::emit::flash::{flash_backward, flash_forward, FlashArch, FlashKernel};
use fusec_compiler::emit::{HEADERS, PRELUDE, PRELUDE_NAME};
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::ir::Graph;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::{Body, Program};
use fusec_compiler::ops::Op;
use std::collections::HashMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// One attention of the every-head-dim model: head dims of q/k and of v,
/// query and key/value heads, causal, and whether q, k, v are slices of
/// one fused projection (strided views).
type Variant = (u32, u32, u32, u32, bool, bool);

/// Every other head dim the tensor-core kernels take, each once: the
/// padded ones (8, 24, 40: not multiples of 16; 144 for the wide Hopper
/// backward, which pads to 32), the 32- and 64-byte swizzles on Hopper (80,
/// 96, 112, 160), the wide heads that take smaller tiles and the wide
/// Hopper backward (144 to 256), Dv != D both ways, ratios 1 to 8.
pub const HEAD_DIMS: &[Variant] = &[
    (8, 8, 2, 1, true, false),
    (24, 24, 3, 1, false, false),
    (32, 32, 2, 2, true, false),
    (40, 40, 4, 1, false, false),
    (48, 48, 2, 1, true, false),
    (80, 80, 8, 1, true, true),
    (96, 96, 2, 2, false, true),
    (112, 112, 4, 2, true, false),
    (144, 144, 2, 2, true, false),
    (160, 160, 2, 1, false, false),
    (192, 192, 2, 2, true, false),
    (256, 256, 2, 1, true, false),
    (256, 128, 4, 1, true, false),
    (64, 128, 2, 1, true, false),
    (128, 64, 4, 2, false, false),
    (96, 64, 2, 2, true, false),
    // 16 query heads a key/value head, two of those: the Hopper backward
    // splits each group over 4 blocks.
    (64, 64, 32, 2, true, false),
    // 6 on 1: two blocks of 3 heads, in the narrow and the wide kernel.
    (32, 32, 6, 1, false, false),
    (144, 144, 6, 1, true, false),
];

/// The multiprocessors the host runs launch the persistent forward for.
/// The host runs blocks one after another, so block 0 takes item 0 and then
/// every item the counter hands out, and blocks 1 and 2 their first items
/// only: one block walks many items (the ring, the query prefetch, the
/// turns from item to item). The counter's reset is checked on a GPU
/// (runtime/tests/flash_gpu.rs checks a second launch).
pub const HOST_MULTIPROCESSORS: u32 = 3;

/// A model holding one attention per variant.
pub fn head_dims_model(variants: &[Variant]) -> String {
    let mut s = String::from("const d = 16\ndim B, T\ninput x: f32[B, T, d]\n");
    let mut loss = Vec::new();
    for (i, &(dq, dv, hq, hk, causal, fused)) in variants.iter().enumerate() {
        let heads = |t: &str, h: u32| format!("heads({t}, {h})");
        let (q, k, v) = if fused {
            let _ = writeln!(
                s,
                "param w{i}: [d, {}] = normal(0.3)\nlet q{i}, k{i}, v{i} = split(x @ w{i}, [{}, {}, {}])",
                dq * hq + dq * hk + dv * hk,
                dq * hq,
                dq * hk,
                dv * hk
            );
            (format!("q{i}"), format!("k{i}"), format!("v{i}"))
        } else {
            let _ = writeln!(
                s,
                "param q{i}: [d, {}] = normal(0.3)\nparam k{i}: [d, {}] = normal(0.3)\nparam v{i}: [d, {}] = normal(0.3)",
                dq * hq,
                dq * hk,
                dv * hk
            );
            (
                format!("x @ q{i}"),
                format!("x @ k{i}"),
                format!("x @ v{i}"),
            )
        };
        let _ = writeln!(
            s,
            "let y{i} = merge_heads(attention({}, {}, {}, causal = {causal}))",
            heads(&q, hq),
            heads(&k, hk),
            heads(&v, hk)
        );
        loss.push(format!("mean(y{i} * y{i})"));
    }
    let _ = write!(
        s,
        "train {{\n    loss = {}\n    precision = PRECISION\n}}\n",
        loss.join(" + ")
    );
    s
}

/// Which kernels of each attention op a build takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    Forward,
    /// The backward in the deterministic scheme, the atomic one, or both.
    Backward {
        atomic: bool,
        deterministic: bool,
    },
}

/// One op's kernels, in launch order.
pub struct Set {
    /// Index into `Program::kernels`.
    pub kernel: usize,
    pub deterministic: bool,
    pub kernels: Vec<FlashKernel>,
    /// Head dims, group ratio, causal, strided or not, scheme: for messages.
    pub what: String,
}

pub struct Built {
    pub g: Graph,
    pub program: Program,
    pub sets: Vec<Set>,
}

/// A broken copy of one line: (file, pattern, replacement). The file is a
/// header under `kernels/` (`attention/forward_sm80.cuh`), a shim of
/// tests/flash_host (`mma_emu.h`), or `kernel` for a set's own wrapper text.
pub type Mutation = (&'static str, &'static str, &'static str);

/// Compiles `src` (its `PRECISION` replaced) and takes every attention op's
/// kernels for `arch`; panics if a supported op gets none.
pub fn build(src: &str, precision: &str, arch: FlashArch, which: Which) -> Built {
    build_with(src, precision, arch, which, false)
}

/// [`build`] with f32 in one TF32 product where `tf32`.
pub fn build_with(src: &str, precision: &str, arch: FlashArch, which: Which, tf32: bool) -> Built {
    let src = src.replace("PRECISION", precision);
    // The models lay q, k and v out as written: separate projections read
    // contiguous heads, a split one strided slices (fuse-projections would
    // make every projection the latter); a split one's gradients are packed.
    let opts = fusec_compiler::elaborate::Options {
        disabled_passes: vec!["fuse-projections".into()],
        ..Default::default()
    };
    let c = fusec_compiler::driver::compile(&src, "flash", &opts)
        .unwrap_or_else(|f| panic!("{}", f.render("flash.dsl", &src)));
    let g = c.optimized;
    let program = fuse(&g);
    let mut sets = Vec::new();
    for (i, k) in program.kernels.iter().enumerate() {
        let Body::Op(n) = k.body else { continue };
        let (forward, causal) = match &g.g[n].op {
            Op::Attention(a) => (true, a.causal),
            Op::AttentionGrad(a) => (false, a.causal),
            _ => continue,
        };
        let schemes: Vec<bool> = match which {
            Which::Forward if forward => vec![false],
            Which::Backward {
                atomic,
                deterministic,
            } if !forward => [(atomic, false), (deterministic, true)]
                .into_iter()
                .filter(|(on, _)| *on)
                .map(|(_, d)| d)
                .collect(),
            _ => continue,
        };
        for deterministic in schemes {
            let kernels = if forward {
                flash_forward(&g, &program, k, n, None, arch, HOST_MULTIPROCESSORS, tf32)
                    .map(|f| vec![f])
            } else {
                flash_backward(&g, &program, k, n, None, deterministic, arch, tf32)
            }
            .unwrap_or_else(|| {
                panic!(
                    "{}: no tensor-core kernels for a supported attention",
                    k.name
                )
            });
            let ins = g.inputs(n);
            let (q, kk, v) = (g.ty(ins[0]), g.ty(ins[1]), g.ty(ins[2]));
            let strided = k.input_views[..3].iter().any(|v| v.is_some());
            let what = format!(
                "D={} Dv={} ratio={} causal={causal} {}{}",
                q.shape[3],
                v.shape[3],
                q.shape[2].as_const().unwrap() / kk.shape[2].as_const().unwrap(),
                if strided { "strided" } else { "contiguous" },
                match (forward, deterministic) {
                    (true, _) => "",
                    (false, true) => " deterministic",
                    (false, false) => " atomic",
                }
            );
            sets.push(Set {
                kernel: i,
                deterministic,
                kernels,
                what,
            });
        }
    }
    Built { g, program, sets }
}

/// A kernel's function name in the harness: both schemes of one op share
/// names (`_delta`), so each set's copies are told apart by its index.
fn host_name(f: &FlashKernel, set: usize) -> String {
    format!("{}_s{set}", f.launch.name)
}

/// One C++ program holding the kernel sets `sets` (indices into `b.sets`)
/// and a `main` that runs the set whose index is its first argument, its
/// kernels in order, on the files in the folder its second names; then
/// each kernel's grid (x, y, z) and block, then the sizes.
/// `kernel_mutation` changes the sets' wrapper text.
pub fn harness(b: &Built, sets: &[usize], kernel_mutation: Option<(&str, &str)>) -> String {
    let mut s = String::from("#include \"block_shim.h\"\n#include \"mma_emu.h\"\n");
    s.push_str(PRELUDE);
    for &f in sets {
        for k in &b.sets[f].kernels {
            let l = &k.launch;
            let mut text = l
                .source
                .replace(&format!("#include \"{PRELUDE_NAME}\""), "")
                .replace(&format!(" {}(", l.name), &format!(" {}(", host_name(k, f)))
                .replace(&format!("{}_t", l.name), &format!("{}_t", host_name(k, f)));
            if let Some((from, to)) = kernel_mutation {
                text = text.replace(from, to);
            }
            s.push_str(&text);
        }
    }
    s.push_str(host::FILE_IO);
    let per = 4; // grid x, y, z and block of each kernel
    let most = b.sets.iter().map(|s| s.kernels.len()).max().unwrap_or(1);
    let first_size = 3 + per * most;
    s.push_str("int main(int argc, char** argv) {\n  const int set = atoi(argv[1]);\n  const char* dir = argv[2];\n");
    for (i, d) in b.g.dims.iter().enumerate() {
        let _ = writeln!(
            s,
            "  const fs_i64 dim_{d} = atoll(argv[{}]);",
            first_size + i
        );
    }
    s.push_str("  auto grid = [&](int l) { return fs_dim3{(unsigned)atoi(argv[3 + 4 * l]), (unsigned)atoi(argv[4 + 4 * l]), (unsigned)atoi(argv[5 + 4 * l])}; };\n");
    s.push_str("  auto block = [&](int l) { return (unsigned)atoi(argv[6 + 4 * l]); };\n");
    for &f in sets {
        let set = &b.sets[f];
        let k = &b.program.kernels[set.kernel];
        let _ = writeln!(s, "  if (set == {f}) {{");
        // Unwritten outputs read back as NaN.
        let (mut args, writes) = host::kernel_buffers(&mut s, &b.program, k, &b.g.dims, true);
        let scratch = set.kernels[0].launch.scratch_f32.as_ref().map(|e| e.to_c());
        if let Some(elems) = &scratch {
            // The scratch starts as NaN: the first kernel must write what the others read.
            let _ = writeln!(
                s,
                "    float* scratch = (float*)malloc((size_t)({elems}) * 4 + 16); memset(scratch, 0xff, (size_t)({elems}) * 4);"
            );
        }
        for (l, kernel) in set.kernels.iter().enumerate() {
            let mut call_args = args.clone();
            if kernel.launch.scratch_f32.is_some() {
                call_args.push("scratch".into());
            }
            let _ = writeln!(
                s,
                "    fs_launch(grid({l}), block({l}), [&] {{ {}({}); }});",
                host_name(kernel, f),
                call_args.join(", ")
            );
        }
        args.clear();
        s.push_str(&writes);
        let _ = writeln!(s, "    return 0;\n  }}");
    }
    s.push_str("  fprintf(stderr, \"unknown kernel set %d\\n\", set);\n  return 2;\n}\n");
    s
}

/// Builds `cpp` in `work/<stem>/`, with `mutation` (if any, and not of the
/// wrapper text) applied to a copy of the header it names, which the build
/// finds before the original.
pub fn compile(work: &Path, stem: &str, cpp: &str, mutation: Option<Mutation>) -> PathBuf {
    let dir = work.join(stem);
    std::fs::create_dir_all(&dir).unwrap();
    if let Some((file, from, to)) = mutation.filter(|m| m.0 != "kernel") {
        let change = |text: &str| {
            assert!(text.contains(from), "{file} has no `{from}`");
            text.replace(from, to)
        };
        if let Some((_, text)) = HEADERS.iter().find(|(path, _)| *path == file) {
            // The whole folder, so the copy's own includes find its neighbours.
            for (path, text) in HEADERS {
                let out = dir.join(path);
                std::fs::create_dir_all(out.parent().unwrap()).unwrap();
                std::fs::write(&out, text).unwrap();
            }
            std::fs::write(dir.join(file), change(text)).unwrap();
        } else {
            let shim = super::root().join("tests/flash_host").join(file);
            let text = std::fs::read_to_string(&shim)
                .unwrap_or_else(|e| panic!("{}: {e}", shim.display()));
            std::fs::write(dir.join(file), change(&text)).unwrap();
        }
    }
    host::build(&dir, stem, cpp)
}

/// The harness for `sets` with `mutation`, built in `work/<stem>/`.
pub fn build_harness(
    b: &Built,
    sets: &[usize],
    work: &Path,
    stem: &str,
    mutation: Option<Mutation>,
) -> PathBuf {
    let kernel_mutation = mutation.filter(|m| m.0 == "kernel").map(|m| (m.1, m.2));
    if let Some((from, _)) = kernel_mutation {
        let text: String = sets
            .iter()
            .flat_map(|&f| b.sets[f].kernels.iter().map(|k| k.launch.source.as_str()))
            .collect();
        assert!(text.contains(from), "the kernels have no `{from}`");
    }
    compile(work, stem, &harness(b, sets, kernel_mutation), mutation)
}

/// The interpreter's buffers at the sizes `dims`.
pub fn reference(b: &Built, dims: &HashMap<String, i64>) -> Vec<Tensor> {
    host::program_values(&b.g, &b.program, dims, 11)
}

/// Runs set `f` of a harness on the interpreter's values of its inputs, in
/// folder `dir`: every output as the run wrote it, or why it failed.
pub fn run_set(
    exe: &Path,
    dir: &Path,
    b: &Built,
    f: usize,
    bufs: &[Tensor],
    dims: &HashMap<String, i64>,
) -> Result<Vec<Vec<f64>>, String> {
    let set = &b.sets[f];
    let k = &b.program.kernels[set.kernel];
    let mut args = Vec::new();
    let most = b.sets.iter().map(|s| s.kernels.len()).max().unwrap_or(1);
    for l in 0..most {
        match set.kernels.get(l) {
            Some(kernel) => {
                let grid = kernel
                    .launch
                    .grid(&|s: &str| dims.get(s).copied())
                    .expect("grid");
                args.extend(grid.iter().map(|x| x.to_string()));
                args.push(kernel.launch.block.to_string());
            }
            None => args.extend(["1", "1", "1", "32"].map(String::from)),
        }
    }
    args.extend(b.g.dims.iter().map(|d| dims[d].to_string()));
    // The harness takes the set's index where run_kernel passes a name.
    let mut named = k.clone();
    named.name = f.to_string();
    host::run_kernel(exe, dir, &b.program, &named, bufs, &args)
}

/// Compiles each launch with NVRTC for its architecture (a job: precision,
/// architecture, what it is, the launch), on every core: the failures,
/// spills and serialized wgmma as messages, and a line per kernel printed.
pub fn compile_all(
    jobs: &[(
        &str,
        &str,
        String,
        fusec_compiler::emit::launch::KernelLaunch,
    )],
) -> Vec<String> {
    use fusec_runtime::nvrtc;
    use std::sync::Mutex;
    let failures = Mutex::new(Vec::new());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((precision, arch, what, l)) = jobs.get(i) else {
                    break;
                };
                let fail = |m: String| failures.lock().unwrap().push(m);
                match nvrtc::compile(&l.name, &l.source, arch) {
                    Ok(c) => {
                        super::keep_cubin(&l.name, &format!("{precision} {arch} {what}"), &c.image);
                        println!(
                            "{precision} {arch} {}: {} registers, spills {}/{} bytes, {} bytes dynamic shared",
                            l.template.as_deref().unwrap_or(&l.name),
                            c.registers.unwrap_or(0),
                            c.spill_store_bytes,
                            c.spill_load_bytes,
                            l.dynamic_smem_bytes
                        );
                        // ptxas serializes wgmma it cannot prove safe to
                        // overlap, and says so ("Potential Performance Loss").
                        if c.log.contains("Performance Loss") {
                            fail(format!("{} {what} ({arch}): {}", l.name, c.log));
                        }
                        if c.spill_store_bytes > 0 || c.spill_load_bytes > 0 {
                            fail(format!("{} {what} ({arch}): spills\n{}", l.name, c.log));
                        }
                        if c.local_arrays() {
                            fail(format!("{} {what} ({arch}): an array in local memory\n{}", l.name, c.log));
                        }
                    }
                    Err(e) => fail(format!("{what} ({arch}): {e}")),
                }
            });
        }
    });
    failures.into_inner().unwrap()
}

/// Attention over padded keys (`lengths`, drawn at random from 0 to the
/// keys' count by the reference's feeds): cross-attention at D = 64 with 2
/// query heads on 1 (S keys), causal self-attention at D = 128, and
/// self-attention at D = 192 (the widest kernels), bf16.
#[allow(dead_code)]
pub const LENGTHS_MODEL: &str = "
const d = 32
dim B, T, S
input x: f32[B, T, d]
input mem: f32[B, S, d]
input src_len: i32[B]
input tgt_len: i32[B]
param wq: [d, 128] = normal(0.3)
param wkv: [d, 128] = normal(0.3)
param w128: [d, 384] = normal(0.3)
param w192: [d, 576] = normal(0.3)
let k, v = split(mem @ wkv, 2)
let y1 = merge_heads(attention(heads(x @ wq, 2), heads(k, 1), heads(v, 1), lengths = src_len))
let q2, k2, v2 = split(x @ w128, 3)
let y2 = merge_heads(attention(heads(q2, 1), heads(k2, 1), heads(v2, 1), causal = true, lengths = tgt_len))
let q3, k3, v3 = split(x @ w192, 3)
let y3 = merge_heads(attention(heads(q3, 1), heads(k3, 1), heads(v3, 1), lengths = tgt_len))
train {
    loss = mean(y1 * y1) + mean(y2 * y2) + mean(y3 * y3)
    precision = bf16
}
";

/// The sizes the lengths model runs at: batches of 3 (three random lengths
/// each), tails of partial tiles on both sides.
#[allow(dead_code)]
pub const LENGTHS_RUNS: &[&[(&str, i64)]] = &[
    &[("B", 3), ("T", 17), ("S", 130)],
    &[("B", 3), ("T", 130), ("S", 17)],
    &[("B", 3), ("T", 100), ("S", 64)],
];

/// Attention with dropout p = 0.3 on the tensor-core templates: head dims
/// where the queries stay in registers (64, 80, Dv != D), where they go to
/// shared memory with 32-key tiles (192, 256 over 128: the backward in two
/// feature parts with 16-query tiles), grouped-query ratio 4, causal and
/// not, a group Hopper's backward splits over blocks, and a
/// cross-attention over padded keys (S != T, lengths), each
/// drawing its own mask.
#[allow(dead_code)]
pub const DROPOUT_VARIANTS: &[Variant] = &[
    (64, 64, 2, 2, true, true),
    (80, 80, 4, 1, false, false),
    (64, 128, 2, 1, true, false),
    (192, 192, 2, 2, false, true),
    (256, 128, 4, 1, true, false),
    // 8 query heads on 1: Hopper's backward splits the group over blocks.
    (32, 32, 8, 1, false, false),
];

/// `head_dims_model(DROPOUT_VARIANTS)` with dropout 0.3 in every attention,
/// and a cross-attention over padded keys: dims B, T, S.
#[allow(dead_code)]
pub fn dropout_model() -> String {
    let s = with_dropout(&head_dims_model(DROPOUT_VARIANTS))
        .replace(
            "dim B, T\ninput x: f32[B, T, d]\n",
            "dim B, T, S\ninput x: f32[B, T, d]\ninput mem: f32[B, S, d]\ninput mem_len: i32[B]\n\
             param cq: [d, 128] = normal(0.3)\nparam ckv: [d, 128] = normal(0.3)\n\
             let ck, cv = split(mem @ ckv, 2)\n\
             let yc = merge_heads(attention(heads(x @ cq, 2), heads(ck, 1), heads(cv, 1), lengths = mem_len, dropout = 0.3))\n",
        );
    assert_eq!(
        s.matches("dropout = 0.3").count(),
        DROPOUT_VARIANTS.len() + 1
    );
    s.replace("loss = ", "loss = mean(yc * yc) + ")
}

/// `head_dims_model`'s text with dropout 0.3 in every attention.
#[allow(dead_code)]
pub fn with_dropout(src: &str) -> String {
    src.replace("causal = true))", "causal = true, dropout = 0.3))")
        .replace("causal = false))", "causal = false, dropout = 0.3))")
}

/// The sizes the dropout model runs at: T and S across the 16-row cells of
/// the draws and the tiles' tails.
#[allow(dead_code)]
pub const DROPOUT_RUNS: &[&[(&str, i64)]] = &[
    &[("B", 2), ("T", 17), ("S", 40)],
    &[("B", 1), ("T", 100), ("S", 130)],
];
