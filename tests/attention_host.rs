//! The attention and convolution kernels, run on the host (through
//! tests/cuda_host/shim.h, one thread per block) on small models built for
//! their edge cases, against the kernel-IR interpreter: head dims 8 and 20
//! (several feature passes), sequence lengths 1, 5 and 17, causal and not,
//! grouped-query ratios 1, 2 and 4, keys longer and shorter than queries,
//! a value head dim different from the query's, q/k/v read as strided
//! slices of one fused projection, and convolutions with stride 2 and
//! padding 1 (also where the window does not tile the image) next to a
//! patch convolution. f32 within 1e-5 relative, bf16 within 1e-2.
//! Skipped, with a message, where no `c++` compiler exists.

mod common;

use common::host;

use fusec_compiler::emit::cuda::emit_program;
use fusec_compiler::emit::{PRELUDE, PRELUDE_NAME};
use fusec_compiler::ir::{DType, Graph};
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::{Body, Kernel, Program};
use fusec_compiler::ops::Op;
use std::fmt::Write;
use std::path::Path;

/// Every attention variant at once; T and S are bound per run.
const ATTENTION: &str = "
const d = 16
dim B, T, S
input x: f32[B, T, d]
input mem: f32[B, S, d]
# Fused projection, equal split: heads are strided views, ratio 1, D = 8.
param w_qkv: [d, 48] = normal(0.4)
# Fused projection, unequal split: 4 query heads on 1 kv head, D = 20.
param w_gqa: [d, 120] = normal(0.4)
# Separate projections (contiguous heads): 4 query heads on 2, D = 8.
param w_q: [d, 32] = normal(0.4)
param w_k: [d, 16] = normal(0.4)
param w_v: [d, 16] = normal(0.4)
# Cross-attention to S keys: D = 20 for q and k, Dv = 8.
param c_q: [d, 40] = normal(0.4)
param c_k: [d, 40] = normal(0.4)
param c_v: [d, 16] = normal(0.4)
param w_o2: [80, d] = normal(0.4)
param w_o3: [32, d] = normal(0.4)

let q1, k1, v1 = split(x @ w_qkv, 3)
let a1 = merge_heads(attention(heads(q1, 2), heads(k1, 2), heads(v1, 2), causal = true))
let q2, k2, v2 = split(x @ w_gqa, [80, 20, 20])
let a2 = merge_heads(attention(heads(q2, 4), heads(k2, 1), heads(v2, 1)))
let a6 = merge_heads(attention(heads(q2, 4), heads(k2, 1), heads(v2, 1), causal = true))
let a3 = merge_heads(attention(heads(x @ w_q, 4), heads(x @ w_k, 2), heads(x @ w_v, 2), causal = true))
let a4 = merge_heads(attention(heads(x @ c_q, 2), heads(mem @ c_k, 2), heads(mem @ c_v, 2), causal = true))
let a5 = merge_heads(attention(heads(x @ c_q, 2), heads(mem @ c_k, 2), heads(mem @ c_v, 2)))
let y = a1 + a3 @ w_o3 + a4 + a5 + (a2 + a6) @ w_o2
train {
    loss = mean(y * y)
    precision = PRECISION
}
";

/// Attention with dropout on the probabilities (p = 0.3, so a fair share
/// of every row is dropped at these sizes): causal strided heads, 4 query
/// heads on 1 at D = 20, and cross-attention to S padded keys, each
/// drawing its own mask, which the backward draws again.
const ATTENTION_DROPOUT: &str = "
const d = 16
dim B, T, S
input x: f32[B, T, d]
input mem: f32[B, S, d]
input mem_len: i32[B]
param w_qkv: [d, 48] = normal(0.4)
param w_gqa: [d, 120] = normal(0.4)
param c_q: [d, 40] = normal(0.4)
param c_k: [d, 40] = normal(0.4)
param c_v: [d, 16] = normal(0.4)
param w_o2: [80, d] = normal(0.4)
let q1, k1, v1 = split(x @ w_qkv, 3)
let a1 = merge_heads(attention(heads(q1, 2), heads(k1, 2), heads(v1, 2), causal = true, dropout = 0.3))
let q2, k2, v2 = split(x @ w_gqa, [80, 20, 20])
let a2 = merge_heads(attention(heads(q2, 4), heads(k2, 1), heads(v2, 1), dropout = 0.3))
let a4 = merge_heads(attention(heads(x @ c_q, 2), heads(mem @ c_k, 2), heads(mem @ c_v, 2), lengths = mem_len, dropout = 0.3))
let y = a1 + a4 + a2 @ w_o2
train {
    loss = mean(y * y)
    precision = PRECISION
}
";

/// Row kernels with block reductions: layernorm, rmsnorm, softmax and their
/// backward passes (the norms' parameter gradients by row groups), the
/// fused cross-entropy and the gradient norm.
const ROWS: &str = "
const d = 16
dim B, T
input xin: f32[B, T, d]
input tokens: i32[B, T]
input targets: i32[B, T]
# 7 rows: most are picked by several tokens, from several tiles of a block.
param emb: [7, d] = normal(0.5)
param g1: [d] = normal(1.0)
param b1: [d] = normal(0.2)
param g2: [d] = normal(1.0)
param w2: [d, d] = normal(0.4)
param w: [d, 11] = normal(0.4)
let x = embedding(emb, tokens) + xin
let h = layernorm(x, g1, b1)
let r = rmsnorm(h * 1.5, g2)
let p = softmax(r @ w2)
train {
    loss = cross_entropy((r + p) @ w, targets)
    optimizer = adamw(lr = 1e-3)
    clip_grad_norm = 1.0
    precision = PRECISION
}
";

/// Convolutions: stride 2 with padding 1 (one that tiles the image, one
/// whose window leaves the last row and column unused), and a patch conv.
const CONV: &str = "
dim B
input img: f32[B, 9, 9, 3]
param w1: [3, 3, 3, 4] = normal(0.4)
param w2: [3, 3, 4, 6] = normal(0.4)
param w3: [4, 4, 4, 5] = normal(0.4)
param w4: [3, 3, 3, 5] = normal(0.4)
let y1 = gelu(conv2d(img, w1, padding = 1))          # [B, 9, 9, 4]
let y2 = conv2d(y1, w2, stride = 2, padding = 1)      # [B, 5, 5, 6]
let y3 = conv2d(y1, w3, stride = 2, padding = 1)      # [B, 4, 4, 5]
let y4 = conv2d(img, w4, stride = 3)                  # [B, 3, 3, 5], patches
train {
    loss = mean(y2 * y2) + mean(y3 * y3) + mean(y4 * y4)
    precision = PRECISION
}
";

const BLOCK_REDUCTIONS: &str = "
static float fs_block_reduce(float v, bool max) {
    static float part[1024];
    __syncthreads();
    part[threadIdx.x] = v;
    __syncthreads();
    float r = part[0];
    for (unsigned i = 1; i < blockDim.x; ++i) r = max ? fmaxf(r, part[i]) : r + part[i];
    return r;
}
inline float fs_block_sum(float v) { return fs_block_reduce(v, false); }
inline float fs_block_max(float v) { return fs_block_reduce(v, true); }
static int fs_block_scan(int v, int* total) {
    static int part[1024];
    __syncthreads();
    part[threadIdx.x] = v;
    __syncthreads();
    int before = 0, all = 0;
    for (unsigned i = 0; i < blockDim.x; ++i) {
        all += part[i];
        if (i < threadIdx.x) before += part[i];
    }
    *total = all;
    return before;
}
";

/// Launch configurations: (grid, block, threaded shim). One thread as
/// tests/cuda_host/shim.h runs it; 4 threads (chunks of 4 keys, head dims
/// over several feature passes, 3 blocks striding over the rows); the
/// real 256-thread block.
const LAUNCHES: [(u32, u32, bool); 3] = [(1, 1, false), (3, 4, true), (1, 256, true)];

/// Kernels whose threads cooperate (block reductions, shared memory,
/// barriers): the ones a one-thread host run cannot fully check.
fn is_template(g: &Graph, k: &Kernel) -> bool {
    matches!(k.body, Body::Op(n) if matches!(
        g.g[n].op,
        Op::Attention(_)
            | Op::AttentionGrad(_)
            | Op::Conv2d(_)
            | Op::Conv2dGradInput(_)
            | Op::Conv2dGradWeight(_)
            | Op::LayerNorm(_)
            | Op::LayerNormGrad(_)
            | Op::RmsNorm(_)
            | Op::RmsNormGrad(_)
            | Op::Softmax(_)
            | Op::SoftmaxGrad(_)
            | Op::CrossEntropyWithGrad(_)
            | Op::SumSquares(_)
            | Op::Reduce(_)
            | Op::EmbeddingGrad(_)
    ))
}

/// One C++ program holding the chosen kernels and a `main` that runs the
/// one named on its command line on the files in a folder.
fn harness(g: &Graph, p: &Program, kernels: &[(String, String)], threads: bool) -> String {
    let mut s = if threads {
        let host = "inline float fs_block_sum(float v) { return v; }\n\
                    inline float fs_block_max(float v) { return v; }\n\
                    inline int fs_block_scan(int v, int* total) { *total = v; return 0; }\n";
        assert!(
            PRELUDE.contains(host),
            "the prelude's host reductions changed"
        );
        format!(
            "#include \"threads_shim.h\"\n{}",
            PRELUDE.replace(host, BLOCK_REDUCTIONS)
        )
    } else {
        format!("#include \"shim.h\"\n#define FS_LAUNCH(grid, block, call) call\n{PRELUDE}")
    };
    for (_, text) in kernels {
        s.push_str(&text.replace(&format!("#include \"{PRELUDE_NAME}\""), ""));
    }
    s.push_str(host::FILE_IO);
    s.push_str(
        "int main(int argc, char** argv) {\n  const char* dir = argv[2];\n\
         \x20 const unsigned grid = atoi(argv[3]), block = atoi(argv[4]);\n",
    );
    for (i, d) in g.dims.iter().enumerate() {
        let _ = writeln!(s, "  const fs_i64 dim_{d} = atoll(argv[{}]);", i + 5);
    }
    for k in p
        .kernels
        .iter()
        .filter(|k| kernels.iter().any(|(n, _)| *n == k.name))
    {
        let _ = writeln!(s, "  if (!strcmp(argv[1], \"{}\")) {{", k.name);
        let (args, writes) = host::kernel_buffers(&mut s, p, k, &g.dims, true);
        let _ = writeln!(
            s,
            "    FS_LAUNCH(grid, block, {}({}));",
            k.name,
            args.join(", ")
        );
        s.push_str(&writes);
        let _ = writeln!(s, "    return 0;\n  }}");
    }
    s.push_str("  fprintf(stderr, \"unknown kernel %s\\n\", argv[1]);\n  return 2;\n}\n");
    s
}

/// Compiles `src` at `precision`, builds its attention and convolution
/// kernels with the host compiler, and runs them at each size in `runs`
/// against the interpreter. Returns the kernels run and the programs'
/// template kernels (for the callers' coverage checks).
fn check(
    label: &str,
    src: &str,
    precision: &str,
    runs: &[Vec<(&str, i64)>],
) -> (usize, Program, Graph) {
    let src = src.replace("PRECISION", precision);
    let name = format!("{label}.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let g = c.optimized;
    let program = fuse(&g);
    let kernels: Vec<(String, String)> = emit_program(&g, &program, None)
        .into_iter()
        .filter(|(n, _)| {
            program
                .kernels
                .iter()
                .any(|k| k.name == *n && is_template(&g, k))
        })
        .collect();
    let templates = program
        .kernels
        .iter()
        .filter(|k| is_template(&g, k))
        .count();
    assert_eq!(
        kernels.len(),
        templates,
        "{label}: every attention and convolution kernel has generated source"
    );
    let work = host::work_dir(&format!("attention-host-{label}-{precision}"));
    // Both builds at once: the host compiler is the slow part.
    let builds: Vec<_> = [false, true]
        .into_iter()
        .map(|threads| {
            let stem = if threads { "threads" } else { "single" };
            let cpp = work.join(format!("{stem}.cpp"));
            std::fs::write(&cpp, harness(&g, &program, &kernels, threads)).unwrap();
            let child = host::cxx(&cpp, &work.join(stem))
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("c++ runs");
            (work.join(stem), child)
        })
        .collect();
    let mut exes = Vec::new();
    for (exe, child) in builds {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{label}: c++ failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        exes.push(exe);
    }
    let mut checked = 0;
    // Outputs that were not all zero in some run: (kernel, slot).
    let mut tested: Vec<(String, usize)> = Vec::new();
    for dims in runs {
        let dims_map = common::dims(dims);
        let bufs = host::program_values(&g, &program, &dims_map, 7);
        let dim_args: Vec<String> = g.dims.iter().map(|d| dims_map[d].to_string()).collect();
        for k in program.kernels.iter().filter(|k| is_template(&g, k)) {
            for (grid, block, threads) in LAUNCHES {
                let at = format!(
                    "{label} {precision} {dims:?} {} <<<{grid}, {block}>>>",
                    k.name
                );
                let dir = work.join(format!("{}-{}-{block}", k.name, dim_args.join("x")));
                let mut args = vec![grid.to_string(), block.to_string()];
                args.extend(dim_args.iter().cloned());
                let exe = &exes[threads as usize];
                for slot in run_one(exe, &dir, &program, k, &bufs, &args, &at) {
                    tested.push((k.name.clone(), slot));
                }
                checked += 1;
            }
        }
    }
    for k in program.kernels.iter().filter(|k| is_template(&g, k)) {
        for slot in 0..k.outputs.len() {
            assert!(
                tested.contains(&(k.name.clone(), slot)),
                "{label} {precision} {} out{slot}: all zero in every run, the case tests nothing",
                k.name
            );
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    (checked, program, g)
}

fn run_one(
    exe: &Path,
    dir: &Path,
    program: &Program,
    k: &Kernel,
    bufs: &[fusec_compiler::interp::tensor::Tensor],
    args: &[String],
    at: &str,
) -> Vec<usize> {
    let mut nonzero = Vec::new();
    let written =
        host::run_kernel(exe, dir, program, k, bufs, args).unwrap_or_else(|e| panic!("{at}: {e}"));
    for (slot, (&b, got)) in k.outputs.iter().zip(written).enumerate() {
        let dt = program.buffers[b].ty.dtype;
        let want = &bufs[b].data;
        assert_eq!(got.len(), want.len(), "{at} out{slot}");
        let tol = if matches!(dt, DType::BF16 | DType::F16) {
            1e-2
        } else {
            1e-5
        };
        for (i, (x, y)) in want.iter().zip(&got).enumerate() {
            // An exact zero of the interpreter is a zero in real arithmetic
            // (an attention query that sees one key, a padded key): exactly 0
            // here too, as in common/flash_bwd.rs, which says why f16 is not.
            assert!(
                *x != 0.0 || *y == 0.0 || dt == DType::F16,
                "{at} out{slot} element {i}: exactly 0 in the interpreter, generated code {y}"
            );
            let ok = (x - y).abs() <= tol * x.abs().max(1.0)
                || (x.is_nan() && y.is_nan())
                || (x.is_infinite() && x == y);
            assert!(
                ok,
                "{at} out{slot} element {i}: interpreter {x}, generated code {y}"
            );
        }
        if want.iter().any(|x| *x != 0.0) {
            nonzero.push(slot);
        }
    }
    nonzero
}

#[test]
fn attention_kernels_match_the_interpreter() {
    if !host::have_cxx() {
        return;
    }
    let runs: Vec<Vec<(&str, i64)>> = [(1, 1), (5, 5), (17, 17), (5, 17), (17, 5)]
        .iter()
        .map(|&(t, s)| vec![("B", 2), ("T", t), ("S", s)])
        .collect();
    for precision in ["f32", "bf16"] {
        let (checked, program, g) = check("attention", ATTENTION, precision, &runs);
        let count = |f: fn(&Op) -> bool| {
            program
                .kernels
                .iter()
                .filter(|k| matches!(k.body, Body::Op(n) if f(&g.g[n].op)))
                .count()
        };
        assert_eq!(count(|o| matches!(o, Op::Attention(_))), 6);
        assert_eq!(count(|o| matches!(o, Op::AttentionGrad(_))), 6);
        // The fused projections' heads are read in place, through strides.
        let strided = program
            .kernels
            .iter()
            .filter(|k| is_template(&g, k) && k.input_views.iter().any(|v| v.is_some()))
            .count();
        assert!(
            strided >= 4,
            "{strided} attention kernels read strided views"
        );
        println!("{precision}: {checked} attention kernel runs matched");
    }
}

/// The simple kernels' dropout draws the interpreter's mask (a kernel that
/// drew another, or dropped in the forward but not the backward, differs
/// by whole probabilities); sizes cross the 8- and 16-row cells of the
/// draws (T, S = 17, 5 and 20).
#[test]
fn attention_dropout_kernels_match_the_interpreter() {
    if !host::have_cxx() {
        return;
    }
    let runs: Vec<Vec<(&str, i64)>> = [(5, 5), (17, 20), (20, 17)]
        .iter()
        .map(|&(t, s)| vec![("B", 2), ("T", t), ("S", s)])
        .collect();
    for precision in ["f32", "bf16"] {
        let (checked, program, g) = check("attention-dropout", ATTENTION_DROPOUT, precision, &runs);
        let dropping = program
            .kernels
            .iter()
            .filter(|k| {
                matches!(k.body, Body::Op(n) if matches!(&g.g[n].op,
                    Op::Attention(a) if a.dropout.is_some()))
                    || matches!(k.body, Body::Op(n) if matches!(&g.g[n].op,
                    Op::AttentionGrad(a) if a.dropout.is_some()))
            })
            .count();
        assert_eq!(
            dropping, 6,
            "{precision}: every attention and its gradient drop"
        );
        println!("{precision}: {checked} attention-with-dropout kernel runs matched");
    }
}

#[test]
fn convolution_kernels_match_the_interpreter() {
    if !host::have_cxx() {
        return;
    }
    let runs = vec![vec![("B", 1)], vec![("B", 3)]];
    for precision in ["f32", "bf16"] {
        let (checked, program, g) = check("conv", CONV, precision, &runs);
        let ops: Vec<&str> = program
            .kernels
            .iter()
            .filter(|k| is_template(&g, k))
            .map(|k| match k.body {
                Body::Op(n) => g.g[n].op.name(),
                _ => unreachable!(),
            })
            .collect();
        for op in ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"] {
            assert!(ops.contains(&op), "{precision}: no {op} kernel in {ops:?}");
        }
        println!("{precision}: {checked} convolution kernel runs matched");
    }
}

#[test]
fn row_kernels_match_the_interpreter() {
    if !host::have_cxx() {
        return;
    }
    // 300 rows: the norms' parameter gradients put two rows in most groups.
    let runs = vec![vec![("B", 3), ("T", 100)], vec![("B", 1), ("T", 3)]];
    for precision in ["f32", "bf16"] {
        let (checked, program, g) = check("rows", ROWS, precision, &runs);
        let ops: Vec<&str> = program
            .kernels
            .iter()
            .filter(|k| is_template(&g, k))
            .map(|k| match k.body {
                Body::Op(n) => g.g[n].op.name(),
                _ => unreachable!(),
            })
            .collect();
        for op in [
            "layernorm_grad",
            "rmsnorm_grad",
            "softmax_grad",
            "cross_entropy_with_grad",
            "sum_squares",
            "embedding_grad",
        ] {
            assert!(ops.contains(&op), "{precision}: no {op} kernel in {ops:?}");
        }
        println!("{precision}: {checked} row kernel runs matched");
    }
}
