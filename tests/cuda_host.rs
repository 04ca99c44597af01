//! The generated CUDA C, run. A host C++ compiler builds every generated
//! kernel of the shipped models (pointwise chains and op templates) (tests/cuda_host/shim.h stands in for the
//! CUDA runtime: one thread walks each grid-stride loop), runs it on the
//! buffers the kernel IR's interpreter computed, and the results must match
//! the interpreter's: within 2 bf16/f16 ulps (1e-2 relative) an element and
//! 5e-3 of the tensor's norm as a whole for 16-bit outputs (a 1% error
//! fails), and 1e-5 relative for f32 (the C code rounds in f32, the
//! interpreter in f64). This checks the emitted index arithmetic and
//! conversions, not just that they compile. Skipped, with a message, where
//! no `c++` compiler exists.

mod common;

use common::host;

use fusec_compiler::emit::cuda::emit_program;
use fusec_compiler::emit::{expand_includes, PRELUDE, PRELUDE_NAME};
use fusec_compiler::ir::DType;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::Program;
use std::fmt::Write;

/// One C++ program holding every pointwise kernel and a `main` that runs
/// the one named on its command line on files in a folder.
fn harness(g: &fusec_compiler::ir::Graph, p: &Program, kernels: &[(String, String)]) -> String {
    let mut s = String::from("#include \"shim.h\"\n");
    s.push_str(PRELUDE);
    for (_, text) in kernels {
        // Templates from kernels/ (each behind its include guard) inline.
        s.push_str(&expand_includes(
            &text.replace(&format!("#include \"{PRELUDE_NAME}\""), ""),
        ));
    }
    s.push_str(host::FILE_IO);
    s.push_str("int main(int argc, char** argv) {\n  const char* dir = argv[2];\n");
    for (i, d) in g.dims.iter().enumerate() {
        let _ = writeln!(s, "  const fs_i64 dim_{d} = atoll(argv[{}]);", i + 3);
    }
    for k in &p.kernels {
        if !kernels.iter().any(|(n, _)| *n == k.name) {
            continue;
        }
        let _ = writeln!(s, "  if (!strcmp(argv[1], \"{}\")) {{", k.name);
        let (args, writes) = host::kernel_buffers(&mut s, p, k, &g.dims, true);
        // The plan gives a cache write's output its cache's storage (it
        // writes the new rows alone): the output starts as the cache, in
        // a write's own kernel or a group of them.
        for (i, o) in k.cache_writes(g) {
            let ty = &p.buffers[k.outputs[o]].ty;
            let _ = writeln!(
                s,
                "    memcpy(out{o}, in{i}, (size_t){} * {});",
                ty.numel().to_c(),
                ty.dtype.size_bytes()
            );
        }
        let _ = writeln!(s, "    {}({});", k.name, args.join(", "));
        s.push_str(&writes);
        let _ = writeln!(s, "    return 0;\n  }}");
    }
    s.push_str("  fprintf(stderr, \"unknown kernel %s\\n\", argv[1]);\n  return 2;\n}\n");
    s
}

/// Runs every generated kernel of `src` at sizes `dims` on the host against
/// the interpreter; returns how many ran.
fn check_model(
    work: &std::path::Path,
    name: &str,
    src: &str,
    sets: &[(&str, &str)],
    dims: &[(&str, i64)],
) -> usize {
    let c = common::compile_with(src, name, sets);
    check_compiled(work, name, &c, dims)
}

/// [`check_model`] for a model compiled already.
fn check_compiled(
    work: &std::path::Path,
    name: &str,
    c: &fusec_compiler::driver::Compiled,
    dims: &[(&str, i64)],
) -> usize {
    check_graph(work, name, &c.optimized, dims)
}

/// [`check_model`] for a step graph.
fn check_graph(
    work: &std::path::Path,
    name: &str,
    g: &fusec_compiler::ir::Graph,
    dims: &[(&str, i64)],
) -> usize {
    let program = fuse(g);
    let dims_map = common::dims(dims);
    let bufs = host::program_values(g, &program, &dims_map, 21);
    let kernels = emit_program(g, &program, None);
    let stem = std::path::Path::new(name)
        .file_stem()
        .unwrap()
        .to_string_lossy()
        .to_string();
    let exe = host::build(work, &stem, &harness(g, &program, &kernels));
    let dim_args: Vec<String> = g.dims.iter().map(|d| dims_map[d].to_string()).collect();
    let mut checked = 0;
    for k in program
        .kernels
        .iter()
        .filter(|k| kernels.iter().any(|(n, _)| *n == k.name))
    {
        let dir = work.join(format!("{stem}-{}", k.name));
        let written = host::run_kernel(&exe, &dir, &program, k, &bufs, &dim_args)
            .unwrap_or_else(|e| panic!("{name} {}: {e}", k.name));
        for (&b, got) in k.outputs.iter().zip(written) {
            let dt = program.buffers[b].ty.dtype;
            let want = &bufs[b].data;
            assert_eq!(got.len(), want.len(), "{name} {}", k.name);
            // A gradient norm's partials are f32 sums of squares over
            // chunks of up to a whole table (a 9000-row embedding is 144K
            // terms, summed by one thread in the host emulation): 1e-4.
            let tol = if matches!(dt, DType::BF16 | DType::F16) {
                1e-2
            } else if k.name.contains("sum_squares") {
                1e-4
            } else {
                1e-5
            };
            for (i, (x, y)) in want.iter().zip(&got).enumerate() {
                // Equal infinities (the lse of a row with no visible key) are equal.
                let ok =
                    x == y || (x - y).abs() <= tol * x.abs().max(1.0) || (x.is_nan() && y.is_nan());
                assert!(
                    ok,
                    "{name} {} element {i}: interpreter {x}, generated code {y}",
                    k.name
                );
            }
            // And as a whole, relative to the tensor's size: an output of
            // small values (a loss gradient scaled by 1 / rows) is judged
            // by its own scale, not by the absolute floor above.
            let (mut diff, mut norm) = (0.0f64, 0.0f64);
            for (x, y) in want.iter().zip(&got).filter(|(x, _)| x.is_finite()) {
                diff += (x - y) * (x - y);
                norm += x * x;
            }
            // f32 sums of many terms drift from the f64 interpreter's by
            // more than one f32 rounding: 1e-4 there. 16-bit outputs: both
            // round the same values to bf16 or f16 and part only where the
            // kernel's f32 and the interpreter's f64 fall on either side of
            // a rounding boundary, a unit in the last place (2^-8) at a few
            // entries: 1.7e-3 of the tensor's norm at most over every kernel
            // here (an add of near-cancelling residuals), the norms within
            // 4e-7; 5e-3, under the 1e-2 a 1% error gives.
            let whole = if tol < 1e-3 { 1e-4 } else { 5e-3 };
            // A tensor that is exactly zero in real arithmetic (a key
            // bias's gradient: softmax ignores a shift shared by every key)
            // is rounding noise in both, so its relative difference means
            // nothing; its floor is the rounding of the terms that cancel,
            // 1e-2 x `whole` of the kernel's inputs' norm (at most a few
            // hundred f32 roundings of them in these tiny models), far
            // below any tensor that is not such a cancellation. Only the
            // float inputs count: token ids (an embedding's) are indices,
            // and their size would raise the floor above a 1% error in the
            // gradient they route.
            let inputs: f64 = k
                .inputs
                .iter()
                .filter(|&&i| program.buffers[i].ty.dtype.is_float())
                .flat_map(|&i| bufs[i].data.iter())
                .filter(|x| x.is_finite())
                .map(|x| x * x)
                .sum::<f64>()
                .sqrt();
            assert!(
                diff.sqrt() <= whole * norm.sqrt().max(1e-2 * inputs) + 1e-30,
                "{name} {}: relative L2 difference {:.2e} from the interpreter",
                k.name,
                diff.sqrt() / norm.sqrt()
            );
        }
        checked += 1;
    }
    checked
}

#[test]
fn generated_kernels_compute_what_the_interpreter_computes() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("cuda-host");
    let mut checked = 0;
    for (file, sets, dims) in common::tiny_models() {
        let (name, src) = common::example(file);
        checked += check_model(&work, &name, &src, &sets, &dims);
    }
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} generated kernels ran on the host and matched the interpreter");
    assert!(checked > 0);
}

/// Test models with ops the shipped ones lack: a mean over the sequence
/// of [B, T, C] (a reduction between kept axes), cross-attention with
/// S != T, a strided padded conv2d with SGD.
#[test]
fn kernels_of_the_twin_test_models_compute_what_the_interpreter_computes() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("cuda-host-twins");
    let mut checked = 0;
    for (file, dims) in [
        ("hd96-fp16.dsl", vec![("B", 2), ("T", 3)]),
        ("cross-attention.dsl", vec![("B", 2), ("T", 3), ("S", 5)]),
        ("conv-sgd.dsl", vec![("B", 2)]),
    ] {
        let path = common::root().join("tests/models/twins").join(file);
        let src = std::fs::read_to_string(&path).unwrap();
        checked += check_model(
            &work,
            &format!("tests/models/twins/{file}"),
            &src,
            &[],
            &dims,
        );
    }
    // GPT-2's cross-entropy with its gradient on the 16-byte path: a
    // vocabulary padded to 64 (61 classes) and one already a multiple of 8;
    // and a table of rows enough that the embedding's backward gives each
    // group of rows one block over all the tokens (9000 rows: 563 groups).
    let (name, src) = common::example("gpt2-small.dsl");
    for vocab in ["61", "64", "9000"] {
        let sets = [
            ("vocab", vocab),
            ("ctx", "8"),
            ("d", "16"),
            ("n_heads", "2"),
            ("layers", "1"),
        ];
        let renamed = name.replace("gpt2-small", &format!("gpt2-vocab{vocab}"));
        checked += check_model(&work, &renamed, &src, &sets, &[("B", 2), ("T", 5)]);
    }
    // A reshape of a transposed tensor read in place by chains (flat views).
    let reshaped =
        std::fs::read_to_string(common::root().join("tests/models/reshaped-transpose.dsl"))
            .unwrap();
    checked += check_model(
        &work,
        "tests/models/reshaped-transpose.dsl",
        &reshaped,
        &[],
        &[("B", 3)],
    );
    // Sizes named as the kernels name their own variables (C, S, n, rows).
    let names = std::fs::read_to_string(common::root().join("tests/models/dim-names.dsl")).unwrap();
    checked += check_model(
        &work,
        "tests/models/dim-names.dsl",
        &names,
        &[],
        &[("C", 3), ("S", 5), ("n", 2), ("rows", 7)],
    );
    // ZeRO stage 1: the updates of rank 1's pieces of GPT-2's parameters
    // (the group kernel from each piece's start, the state the piece alone).
    let opts = fusec_compiler::elaborate::Options {
        overrides: [
            ("vocab", "61"),
            ("ctx", "8"),
            ("d", "16"),
            ("n_heads", "2"),
            ("layers", "1"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        ranks: 3,
        zero_rank: Some(1),
        ..Default::default()
    };
    let zero = fusec_compiler::driver::compile(&src, "gpt2-small", &opts).unwrap();
    let ranged = zero.optimized.g.node_indices().any(|n| {
        matches!(&zero.optimized.g[n].op, fusec_compiler::ops::Op::AdamW(a) if a.range.is_some())
    });
    assert!(ranged, "rank 1 of 3 updates pieces of parameters");
    // A bf16 model: the rank keeps its parameters in bf16, updates the f32
    // masters of its pieces and stores each new piece into its parameter.
    let count = |g: &fusec_compiler::ir::Graph, f: &dyn Fn(&fusec_compiler::ops::Op) -> bool| {
        g.g.node_indices().filter(|&n| f(&g.g[n].op)).count()
    };
    let zg = &zero.optimized;
    let updates = count(zg, &|op| matches!(op, fusec_compiler::ops::Op::AdamW(_)));
    assert!(updates > 0);
    assert_eq!(
        count(
            zg,
            &|op| matches!(op, fusec_compiler::ops::Op::AdamW(a) if a.master)
        ),
        updates
    );
    assert_eq!(
        count(zg, &|op| matches!(
            op,
            fusec_compiler::ops::Op::StorePiece(_)
        )),
        updates
    );
    checked += check_compiled(&work, "gpt2-zero-rank1", &zero, &[("B", 2), ("T", 5)]);
    // Gradients averaged in bf16 (`--reduce-dtype bf16`): the norm and the
    // update group read the bf16 means as they are, the group through the
    // prelude's `fs_adamw` / `fs_sgd` for bf16 gradients.
    let opts = fusec_compiler::elaborate::Options {
        zero_rank: None,
        ranks: 2,
        reduce_dtype: Some(fusec_compiler::ir::DType::BF16),
        ..opts
    };
    let narrow = fusec_compiler::driver::compile(&src, "gpt2-small", &opts).unwrap();
    let g = &narrow.optimized;
    let bf16_grads =
        g.g.node_indices()
            .filter(|&n| matches!(&g.g[n].op, fusec_compiler::ops::Op::AdamW(_)))
            .filter(|&n| g.ty(g.inputs(n)[1]).dtype == fusec_compiler::ir::DType::BF16)
            .count();
    assert_eq!(bf16_grads, g.params.len(), "every update reads a bf16 mean");
    let calls = |c: &fusec_compiler::driver::Compiled, f: &str| -> usize {
        let p = fuse(&c.optimized);
        emit_program(&c.optimized, &p, None)
            .iter()
            .map(|(_, text)| text.matches(f).count())
            .sum()
    };
    assert_eq!(calls(&narrow, "fs_adamw("), g.params.len());
    checked += check_compiled(&work, "gpt2-reduce-bf16", &narrow, &[("B", 2), ("T", 5)]);
    let sgd_src = src.replace(
        "optimizer = adamw(lr = 6e-4, betas = (0.9, 0.95), eps = 1e-8, weight_decay = 0.1)",
        "optimizer = sgd(lr = 0.1, momentum = 0.9, weight_decay = 0.01)",
    );
    assert_ne!(sgd_src, src, "the model's optimizer line moved");
    let sgd = fusec_compiler::driver::compile(&sgd_src, "gpt2-small", &opts).unwrap();
    assert_eq!(calls(&sgd, "fs_sgd("), sgd.optimized.params.len());
    checked += check_compiled(&work, "gpt2-reduce-bf16-sgd", &sgd, &[("B", 2), ("T", 5)]);
    // SGD's master pieces under ZeRO (rank 0 of 3).
    let opts = fusec_compiler::elaborate::Options {
        ranks: 3,
        zero_rank: Some(0),
        reduce_dtype: None,
        ..opts
    };
    let sgd_zero = fusec_compiler::driver::compile(&sgd_src, "gpt2-small", &opts).unwrap();
    let sg = &sgd_zero.optimized;
    assert!(
        count(
            sg,
            &|op| matches!(op, fusec_compiler::ops::Op::Sgd(s) if s.master)
        ) > 0
    );
    checked += check_compiled(&work, "gpt2-zero-sgd", &sgd_zero, &[("B", 2), ("T", 5)]);
    // ZeRO stage 2: the updates read each gradient's piece alone (a buffer
    // of the piece's size, indexed as the state), AdamW on rank 1 of 3 and
    // SGD's master pieces on rank 0.
    let stage2 = |source: &str, rank: u32| {
        let opts = fusec_compiler::elaborate::Options {
            zero_rank: Some(rank),
            zero_stage: fusec_compiler::autodiff::zero::ZeroStage::Two,
            ..opts.clone()
        };
        fusec_compiler::driver::compile(source, "gpt2-small", &opts).unwrap()
    };
    for (name, c) in [
        ("gpt2-zero2-adamw", stage2(&src, 1)),
        ("gpt2-zero2-sgd", stage2(&sgd_src, 0)),
    ] {
        let g = &c.optimized;
        let pieced = count(g, &|op| {
            matches!(op, fusec_compiler::ops::Op::AdamW(a) if a.grad_piece)
                || matches!(op, fusec_compiler::ops::Op::Sgd(s) if s.grad_piece)
        });
        assert!(pieced > 0, "{name}: an update reads a piece of a gradient");
        checked += check_compiled(&work, name, &c, &[("B", 2), ("T", 5)]);
    }
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} generated kernels of the twin test models matched the interpreter");
    assert!(checked > 0);
}

/// Every unary function of the table (ops/unary.rs), forward and backward,
/// in generated kernels run on the host against the interpreter. The model
/// is written from the table, so a function added there is checked here.
#[test]
fn every_unary_function_computes_what_the_interpreter_computes() {
    if !host::have_cxx() {
        return;
    }
    use fusec_compiler::ops::UnaryKind;
    let work = host::work_dir("cuda-host-unary");
    // x * x + 0.5 keeps log, sqrt and rsqrt in their domains; x itself
    // covers both signs for the rest. Each term is its own chain (a sum
    // ends it), so every function is a kernel's last op at least once.
    let terms: Vec<String> = UnaryKind::ALL
        .iter()
        .filter(|k| k.def().builtin.is_some())
        .map(|k| {
            let arg = if k.def().keeps_zero {
                "h"
            } else {
                "h * h + 0.5"
            };
            format!("sum({}({arg}))", k.name())
        })
        .collect();
    let src = format!(
        "dim B\ninput x: f32[B, 13]\nparam w: [13] = normal(0.7)\nlet h = x * w\n\
         train {{\n    loss = {} / B\n    optimizer = sgd(lr = 0.1)\n}}\n",
        terms.join(" + ")
    );
    let checked = check_model(&work, "unary.dsl", &src, &[], &[("B", 3)]);
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} kernels of the unary functions matched the interpreter");
    assert!(checked > 0);
}

/// AdamW's bias corrections 1 - beta^t as the update kernel computes them in
/// f32, against f64, for every step to 100,000: within 3e-7 relative. With
/// 0.999 (the default beta2), `1 - powf(0.999f, t)` is off by about 1.3e-5
/// at every step (0.999f is not 0.999, and the subtraction cancels the
/// digits), which moved every update of every parameter the same way and
/// showed as a growing distance from PyTorch's run.
#[test]
fn adamw_bias_corrections_hold_f32_precision() {
    if !host::have_cxx() {
        return;
    }
    let src = "
dim B
input x: f32[B, 4]
param w: [4, 4] = normal(0.5)
train {
    loss = mean(x @ w)
    optimizer = adamw(lr = 1e-3, betas = (0.9, 0.999))
}
";
    let c = fusec_compiler::driver::compile(src, "adamw", &Default::default()).unwrap();
    let program = fuse(&c.optimized);
    let kernels = emit_program(&c.optimized, &program, None);
    let line = kernels
        .iter()
        .flat_map(|(_, text)| text.lines())
        .find(|l| l.contains("fs_adamw_corrections("))
        .expect("the update kernel works out the bias corrections")
        .trim()
        .to_string();
    // The emitted call (its constants worked out by the emitter) through
    // kernels/optim.cuh's function, as the kernel runs it.
    let cpp = format!(
        "#include \"shim.h\"\n{}\n#include <cstdio>\n\
         int main() {{\n\
             double worst1 = 0, worst2 = 0;\n\
             for (int step = 1; step <= 100000; ++step) {{\n\
                 const float t = (float)step;\n\
                 float bc1, bc2;\n\
                 {line}\n\
                 const double e1 = 1.0 - std::pow(0.9, step), e2 = 1.0 - std::pow(0.999, step);\n\
                 worst1 = std::fmax(worst1, std::fabs(bc1 - e1) / e1);\n\
                 worst2 = std::fmax(worst2, std::fabs(bc2 - e2) / e2);\n\
             }}\n\
             std::printf(\"%.3e %.3e\\n\", worst1, worst2);\n\
         }}\n",
        optim_source()
    );
    let work = host::work_dir("adamw-bias");
    let exe = host::build(&work, "bias", &cpp);
    let out = std::process::Command::new(&exe).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let _ = std::fs::remove_dir_all(&work);
    let worst: Vec<f64> = text
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    println!(
        "bias corrections' largest relative error: beta1 0.9 {:.2e}, beta2 0.999 {:.2e} ({line})",
        worst[0], worst[1]
    );
    assert!(
        worst.iter().all(|&e| e < 3e-7),
        "the bias corrections are off by {worst:?} relative: {line}"
    );
}

/// The prelude and kernels/optim.cuh as one text, for a host program.
fn optim_source() -> String {
    fusec_compiler::emit::expand_includes(&format!(
        "#include \"{}\"\n#include \"optim.cuh\"\n",
        fusec_compiler::emit::PRELUDE_NAME
    ))
}

/// The same in the group kernels' AdamW (`fs_adamw` in kernels/optim.cuh), which
/// every model with more than one parameter runs: the emitted call, run on
/// the host with fresh state (m = v = 0, g = 1, lr = 1), gives the update
/// (1 - b1) / bc1 / sqrt((1 - b2) / bc2), within 1e-6 of f64 for every step
/// to 100,000. With `1.0f - b` in f32 it is off by 6.8e-6 (half of
/// 1.3e-5, through the square root: measured with the bias corrections
/// already in f64), and so it was with `1 - powf(b, t)` as well at large t.
#[test]
fn group_adamw_bias_corrections_hold_f32_precision() {
    if !host::have_cxx() {
        return;
    }
    let src = "
dim B
input x: f32[B, 4]
param w: [4, 4] = normal(0.5)
param u: [4, 4] = normal(0.5)
train {
    loss = mean(x @ w @ u)
    optimizer = adamw(lr = 1e-3, betas = (0.9, 0.999))
}
";
    let c = fusec_compiler::driver::compile(src, "adamw2", &Default::default()).unwrap();
    let program = fuse(&c.optimized);
    let kernels = emit_program(&c.optimized, &program, None);
    let call = kernels
        .iter()
        .flat_map(|(_, text)| text.lines())
        .find(|l| l.contains("fs_adamw("))
        .expect("a group kernel updates both parameters")
        .trim()
        .to_string();
    // fs_adamw(..., lo, hi, b1, b2, eps, wd, 1 - b1, 1 - b2, log1p_b1, log1p_b2);
    let consts: Vec<&str> = call
        .trim_end_matches(");")
        .rsplit(", ")
        .take(8)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let [b1, b2, _eps, _wd, c1, c2, l1, l2] = consts[..] else {
        panic!("unexpected call {call}")
    };
    let cpp = format!(
        "#include \"shim.h\"\n{}\n#include <cstdio>\n\
         int main() {{\n\
             double worst = 0;\n\
             for (int step = 1; step <= 100000; ++step) {{\n\
                 float p = 0, m = 0, v = 0, g = 1, po, mo, vo;\n\
                 fs_adamw<float>(&po, &mo, &vo, &p, &g, &m, &v, 1.0f, (float)step, 1.0f, 1.0f, 0, 1, {b1}, {b2}, 0.0f, 0.0f, {c1}, {c2}, {l1}, {l2});\n\
                 const double e1 = 1.0 - std::pow(0.9, step), e2 = 1.0 - std::pow(0.999, step);\n\
                 const double want = ((1.0 - 0.9) / e1) / std::sqrt((1.0 - 0.999) / e2);\n\
                 worst = std::fmax(worst, std::fabs(-(double)po - want) / want);\n\
             }}\n\
             std::printf(\"%.3e\\n\", worst);\n\
         }}\n",
        optim_source()
    );
    let work = host::work_dir("group-adamw-bias");
    let exe = host::build(&work, "bias", &cpp);
    let out = std::process::Command::new(&exe).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let _ = std::fs::remove_dir_all(&work);
    let worst: f64 = text.trim().parse().unwrap();
    println!("group AdamW's update with fresh state: largest relative error {worst:.2e} ({call})");
    assert!(
        worst < 1e-6,
        "the group update is off by {worst:.2e} relative: {call}"
    );
}

/// Dropout's kernels draw the interpreter's masks: every element kept or
/// dropped alike (a wrong word, site or threshold drops other elements and
/// misses the 1e-5 bound by the element's whole value), forward and
/// backward, in f32 and bf16, at a size whose elements are not a multiple
/// of four (B T d = 2 * 7 * 20, so a Philox block straddles rows), and at
/// a width of 22 whose element counts leave a tail past the fused kernels'
/// vectors (1 * 7 * 22 = 154: two elements past 4- and 8-wide loads),
/// which draws element by element.
#[test]
fn dropout_kernels_draw_the_interpreters_masks() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("cuda-host-dropout");
    let src =
        std::fs::read_to_string(common::root().join("tests/models/encoder-dropout.dsl")).unwrap();
    let bf16 = src.replace(
        "optimizer = adamw(lr = 1e-3, weight_decay = 0.01)",
        "optimizer = adamw(lr = 1e-3, weight_decay = 0.01)\n    precision = bf16",
    );
    assert_ne!(src, bf16);
    let mut checked = 0;
    for (name, text) in [("encoder-dropout", &src), ("encoder-dropout-bf16", &bf16)] {
        for p in ["0.1", "0.5"] {
            checked += check_model(
                &work,
                &format!("{name}-p{p}.dsl"),
                text,
                &[("p", p)],
                &[("B", 2), ("T", 7)],
            );
        }
        checked += check_model(
            &work,
            &format!("{name}-d22.dsl"),
            text,
            &[("p", "0.3"), ("d", "22")],
            &[("B", 1), ("T", 7)],
        );
    }
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} kernels of the dropout model ran on the host and matched the interpreter");
    assert!(checked > 0);
}

/// Cross-entropy with ignored targets and smoothed labels: the row kernels
/// (the loss, the fused loss and gradient, f32 and the 16-byte bf16 path)
/// and the count of targets against the interpreter; a vocabulary padded
/// to 64 (61 classes) and one of 64.
#[test]
fn cross_entropy_rules_compute_what_the_interpreter_computes() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("cuda-host-ce-rules");
    let src = std::fs::read_to_string(common::root().join("tests/models/ce-rules.dsl")).unwrap();
    let bf16 = src.replace(
        "optimizer = adamw(lr = 1e-3)",
        "optimizer = adamw(lr = 1e-3)\n    precision = bf16",
    );
    assert_ne!(src, bf16);
    let mut checked = 0;
    for (name, text) in [("ce-rules", &src), ("ce-rules-bf16", &bf16)] {
        for vocab in ["61", "64"] {
            // pad 5: random targets (0..vocab) hit it now and then.
            checked += check_model(
                &work,
                &format!("{name}-v{vocab}.dsl"),
                text,
                &[("vocab", vocab), ("pad", "5"), ("smoothing", "0.2")],
                // 600 rows: about ten of them target the ignored id.
                &[("B", 3), ("T", 200)],
            );
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} kernels of the cross-entropy rules ran on the host");
    assert!(checked > 0);
}

/// The causal mask as a kernel of its own (kernels/mask.cuh): under a
/// softmax the fold-attention pass turns it into attention, so here it
/// feeds an exponential, over T queries and S keys (S > T and S < T), f32
/// and bf16. A mask one column off (col >= q) fails here.
#[test]
fn causal_mask_kernels_compute_what_the_interpreter_computes() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("cuda-host-mask");
    let src = "dim B, T, S\ninput x: f32[B, T, 8]\ninput m: f32[B, S, 8]\nparam w: [8, 8] = normal(0.3)\nlet s = causal_mask((x @ w) @ transpose(m))\ntrain {\n    loss = mean(exp(s))\n    precision = PRECISION\n}\n";
    let mut checked = 0;
    for precision in ["f32", "bf16"] {
        let text = src.replace("PRECISION", precision);
        let c = common::compile_with(&text, "mask.dsl", &[]);
        let p = fusec_compiler::kernel::fuse::fuse(&c.optimized);
        assert!(
            p.kernels.iter().any(|k| k.name.contains("causal_mask")),
            "{precision}: no causal_mask kernel"
        );
        for (t, s) in [(5, 7), (7, 5)] {
            checked += check_compiled(&work, "mask.dsl", &c, &[("B", 2), ("T", t), ("S", s)]);
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} kernels of the mask model ran on the host");
    assert!(checked > 0);
}

/// The count of the targets a cross-entropy with an ignored index means
/// over (kernels/cross_entropy.cuh's `fs_counted`) against the
/// interpreter, on targets drawn from two classes so that both the ignored
/// index and the other occur (checked: a draw of one class alone would not
/// test the ignoring).
#[test]
fn counted_targets_are_what_the_interpreter_counts() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("cuda-host-counted");
    let src = "dim B, T\ninput x: f32[B, T, 8]\ninput t: i32[B, T]\nparam w: [8, 2] = normal(0.3)\ntrain {\n    loss = cross_entropy(x @ w, t, ignore_index = 1)\n}\n";
    let c = common::compile_with(src, "counted.dsl", &[]);
    let g = &c.optimized;
    let program = fuse(g);
    let dims = [("B", 3), ("T", 5)];
    let bufs = host::program_values(g, &program, &common::dims(&dims), 21);
    let counted = program
        .kernels
        .iter()
        .find(|k| k.name.contains("counted"))
        .expect("a counted kernel");
    let want = &bufs[counted.outputs[0]].data;
    assert!(
        want.contains(&0.0) && want.contains(&1.0),
        "the drawn targets do not include both an ignored one and a counted one: {want:?}"
    );
    let checked = check_compiled(&work, "counted.dsl", &c, &dims);
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} kernels of the counted model ran on the host");
    assert!(checked > 0);
}

/// The 16-byte concatenation (kernels/concat.cuh) at parts of sizes no
/// shipped model has, three of them (the gradient of a split into 24, 8
/// and 40 columns, bf16: each a run of whole 16-byte chunks), over an odd
/// number of rows, against the interpreter.
#[test]
fn concatenations_of_unequal_parts_are_what_the_interpreter_makes() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("cuda-host-concat");
    let src = "dim B, T\ninput x: f32[B, T, 8]\nparam w: [8, 72] = normal(0.3)\nlet a, b, c = split(x @ w, [24, 8, 40])\ntrain {\n    loss = mean(a * a) + mean(exp(b)) + mean(c * c * c)\n    precision = bf16\n}\n";
    let c = common::compile_with(src, "concat.dsl", &[]);
    let program = fuse(&c.optimized);
    let kernels = emit_program(&c.optimized, &program, None);
    assert!(
        kernels
            .iter()
            .any(|(_, text)| text.contains("fs_concat_chunk<fs_bf16, 8, 3>")),
        "no three-part 16-byte concatenation"
    );
    let checked = check_compiled(&work, "concat.dsl", &c, &[("B", 3), ("T", 7)]);
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} kernels of the concatenation model ran on the host");
    assert!(checked > 0);
}

/// Attention with key lengths (the simple kernels, forward and backward;
/// the tensor-core ones do not take lengths yet) against the interpreter,
/// f32 and bf16, at a T of 7 with random lengths 0..=7 (a sequence of
/// length 0 included whenever drawn: output 0, no NaN).
#[test]
fn attention_with_lengths_computes_what_the_interpreter_computes() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("cuda-host-lengths");
    let src =
        std::fs::read_to_string(common::root().join("tests/models/padded-encoder.dsl")).unwrap();
    let bf16 = src.replace(
        "optimizer = adamw(lr = 1e-3)",
        "optimizer = adamw(lr = 1e-3)\n    precision = bf16",
    );
    assert_ne!(src, bf16);
    let mut checked = 0;
    for (name, text) in [("padded-encoder", &src), ("padded-encoder-bf16", &bf16)] {
        checked += check_model(
            &work,
            &format!("{name}.dsl"),
            text,
            &[],
            &[("B", 4), ("T", 7)],
        );
    }
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} kernels of the padded encoder ran on the host");
    assert!(checked > 0);
}

/// The one-warp-a-row norm kernels (16-bit rows of up to 1024 features, a
/// multiple of 8) at widths past one 32-float stretch of their padded
/// shared sums and not a multiple of 32, 256 or 1024: layer and RMS norms,
/// forward and backward, the backward with the residual stream's gradient
/// added, the forward running the chain that makes its input (a post-LN
/// sum with dropout, and a scaled residual) as it loads its rows.
#[test]
fn norm_kernels_at_widths_nobody_chose_compute_what_the_interpreter_computes() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("cuda-host-norm-widths");
    let src = "const w = 104
dim B, T
input x: f32[B, T, w]
param a: [w, w] = normal(0.1)
param g: [w] = normal(1.0)
param b: [w] = normal(0.1)
param r: [w] = normal(1.0)
param c: [w] = normal(0.1)
let y = x @ a
let h = layernorm(y, g, b, eps = 1e-5) + y
let z = rmsnorm(h, r, eps = 1e-6) + h
# Norms that run the chain making their input (post-LN, with dropout).
let u = layernorm(z + dropout(z @ a + c, 0.1), g, b, eps = 1e-5)
let v = rmsnorm(u * 0.5 + z, r, eps = 1e-6)
train {
    loss = mean(v * v)
    optimizer = sgd(lr = 0.1)
    precision = bf16
}
";
    let mut checked = 0;
    for w in ["104", "1000"] {
        let name = format!("norm-width-{w}.dsl");
        checked += check_model(&work, &name, src, &[("w", w)], &[("B", 2), ("T", 3)]);
    }
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} kernels of norms at odd widths matched the interpreter");
    assert!(checked > 0);
}

/// The decode step's kernels (cache writes, a layer's two as one group
/// kernel, attention over the caches,
/// rope at the step's positions, the position table read at them) of
/// `common::decode_models` (GPT-2, LLaMA with 4 query heads over 2 cache
/// heads, and heads of 80, 40 and 392 features with 8, 3 and 4 query
/// heads a cache head), at one new row and at three, against the
/// interpreter; and the greedy step's pick (`argmax` over the logits as
/// the interpreter has them: bf16 logits tie often, so the first of equals
/// is checked too).
#[test]
fn decode_step_kernels_compute_what_the_interpreter_computes() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("cuda-host-decode");
    let mut checked = 0;
    let mut decode_ops = 0;
    for (file, sets) in common::decode_models() {
        let file = file.as_str();
        let src = std::fs::read_to_string(common::root().join(file)).unwrap();
        let c = common::compile_with(&src, file, &sets);
        let whole = fusec_compiler::driver::logits_graph(&c).unwrap();
        let step = fusec_compiler::decode::decode_graph(&whole).unwrap();
        decode_ops += step
            .g
            .node_indices()
            .filter(|&n| {
                matches!(
                    step.g[n].op,
                    fusec_compiler::ops::Op::KvWrite(_)
                        | fusec_compiler::ops::Op::CachedAttention(_)
                )
            })
            .count();
        // A layer's key and value writes run as one launch.
        let grouped = fuse(&step)
            .kernels
            .iter()
            .filter(|k| k.name.contains("kv_write_x2"))
            .count();
        assert!(grouped > 0, "{file}: no cache writes grouped");
        let width = step
            .output(&fusec_compiler::ir::graph::Role::Logits)
            .and_then(|v| step.ty(v).shape.last()?.as_const())
            .unwrap();
        // The weights kept as the passes read them, as `fusec generate`
        // builds it.
        let read = fusec_compiler::decode::weights_as_read(&step).unwrap();
        // Fewer classes than the logits' width where it is odd (a padded
        // vocabulary's classes).
        let greedy = fusec_compiler::decode::greedy_graph(&read, width - width % 2).unwrap();
        // Models of one file at other sizes get builds of their own.
        let stem = format!(
            "{}-{checked}",
            std::path::Path::new(file)
                .file_stem()
                .unwrap()
                .to_string_lossy()
        );
        // 19 positions: warps' keys in flight cut short at the last.
        for t in [1, 3] {
            checked += check_graph(
                &work,
                &format!("{stem}-decode{t}.dsl"),
                &step,
                &[("B", 2), ("T", t), ("KV", 19)],
            );
        }
        checked += check_graph(
            &work,
            &format!("{stem}-greedy.dsl"),
            &greedy,
            &[("B", 3), ("T", 2), ("KV", 19)],
        );
    }
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} decode-step kernels ran on the host and matched the interpreter");
    assert!(decode_ops >= 9 && checked > 0);
}
