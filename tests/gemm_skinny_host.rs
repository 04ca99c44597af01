//! The skinny GEMM (kernels/gemm/skinny.cuh), run on the host with real
//! thread blocks (tests/cuda_host/threads_shim.h: a block's threads are OS
//! threads meeting at barriers, blocks one after another, so the splits'
//! counting and the last split's sum run as on a GPU).
//!
//! 1. The template alone, against products in f64 of the same stored
//!    values: both forms of B, 16-bit and f32 elements, rows in one pass
//!    and in several, tiles cut short by n, k not a multiple of the staged
//!    chunk or of a 16-byte load, one split and several, every epilogue,
//!    the wrapper's block and grid and others (any block of a power of two
//!    and any grid must give the same values). Each case runs twice: the
//!    second launch must find its counts back at zero and give the same
//!    bits.
//! 2. The wrappers the compiler writes for decode steps (`select_at` at
//!    the steps' sizes), on the kernel interpreter's inputs, against its
//!    outputs.
//!
//! Skipped, with a message, where no `c++` compiler exists.

mod common;

use common::host;
use std::fmt::Write;

/// One case of the template: its C++ instantiation and sizes.
struct Case {
    ei: &'static str,
    eo: &'static str,
    nk: bool,
    rows: u32,
    splits: u32,
    vec: bool,
    bias: bool,
    resid: bool,
    gelu: bool,
    m: u32,
    n: u32,
    k: u32,
    /// Threads a block and blocks (0: the wrapper's tiles x splits).
    block: u32,
    grid: u32,
}

impl Case {
    fn name(&self) -> String {
        format!(
            "{}{}->{} m{} n{} k{} rows{} splits{} vec{} bias{} resid{} gelu{} block{} grid{}",
            if self.nk { "nk " } else { "kn " },
            self.ei,
            self.eo,
            self.m,
            self.n,
            self.k,
            self.rows,
            self.splits,
            self.vec as u8,
            self.bias as u8,
            self.resid as u8,
            self.gelu as u8,
            self.block,
            self.grid
        )
    }
}

/// The harness: a generic checker, then one call a case.
const CHECKER: &str = r#"
#include <vector>
static unsigned fs_rng = 12345u;
static float fs_uniform() { fs_rng = fs_rng * 1664525u + 1013904223u; return (float)(fs_rng >> 8) / (float)(1u << 24) * 2.0f - 1.0f; }
template <class E> static bool fs_el_is_bf16() { return false; }
template <> bool fs_el_is_bf16<fs_el::Bf16>() { return true; }
static double fs_gelu_ref(double x) { return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

// Runs the case twice and prints the worst |got - want| over its
// tolerance, then whether the two launches gave the same bits and left
// every count at zero.
template <class EI, class EO, bool NK, int ROWS, int SPLITS, bool VEC, bool BIAS, bool RESID, bool GELU>
static void run_case(const char* name, long m, long n, long k, unsigned block, unsigned grid) {
    typedef typename EI::Storage TI;
    typedef typename EO::Storage TO;
    std::vector<TI> a(m * k), b(k * n);
    std::vector<TO> bias(n), resid(m * n), d(m * n), aux(m * n), first(m * n);
    for (auto& x : a) x = EI::store(fs_uniform());
    for (auto& x : b) x = EI::store(fs_uniform());
    for (auto& x : bias) x = EO::store(fs_uniform());
    for (auto& x : resid) x = EO::store(fs_uniform());
    const int V = fs_skinny::Width<EI, VEC>::V;
    const long width = NK ? fs_skinny::NK_COLS : fs_skinny::LANES * V;
    const long tiles = (n + width - 1) / width;
    std::vector<float> part(SPLITS * m * n + 1);
    std::vector<unsigned> done(tiles + 1, 0u);
    fs_skinny::Problem<EI, EO> p;
    p.a = a.data(); p.lda = k;
    p.b = b.data(); p.ldb = NK ? k : n;
    p.bias = BIAS ? bias.data() : nullptr;
    p.resid = RESID ? resid.data() : nullptr; p.ldr = n;
    p.d = d.data(); p.ldd = n;
    p.aux = GELU ? aux.data() : nullptr; p.ldx = n;
    p.m = m; p.n = n; p.k = k;
    p.part = part.data(); p.done = done.data();
    // The tolerance: the output's rounding, half a unit in its last place
    // (at most 2^-8 of the value in bf16's 8 bits, 2^-11 in f16's 11; one
    // unit, 2^-7 and 2^-10, allows for GELU's f32 and the rounding of its
    // input), and the f32 sum's rounding, at most k units of 2^-24 of the
    // terms' magnitudes (k <= 600 here: 3.6e-5): 1e-4 of them. f32
    // outputs: 1e-6, a few of f32's units.
    const double unit = sizeof(TO) == 4 ? 1e-6 : fs_el_is_bf16<EO>() ? 0.0078125 : 0.0009765625;
    double worst = 0.0;
    bool same = true, zeroed = true;
    for (int rep = 0; rep < 2; ++rep) {
        memset(d.data(), 0xff, d.size() * sizeof(TO));
        memset(aux.data(), 0xff, aux.size() * sizeof(TO));
        fs_launch(grid ? grid : (unsigned)(tiles * SPLITS), block, [&] {
            if constexpr (NK) fs_skinny::nk<EI, EO, ROWS, SPLITS, VEC, BIAS, RESID, GELU>(p);
            else fs_skinny::kn<EI, EO, ROWS, SPLITS, VEC, BIAS, RESID, GELU>(p);
        });
        for (long t = 0; t <= tiles; ++t) zeroed = zeroed && done[t] == 0u;
        for (long i = 0; i < m; ++i)
            for (long j = 0; j < n; ++j) {
                double s = 0.0, mag = 0.0;
                for (long q = 0; q < k; ++q) {
                    const double x = EI::load(&a[i * k + q]);
                    const double y = EI::load(&b[NK ? j * k + q : q * n + j]);
                    s += x * y;
                    mag += fabs(x * y);
                }
                if (BIAS) { s += EO::load(&bias[j]); mag += fabs(EO::load(&bias[j])); }
                if (RESID) { s += EO::load(&resid[i * n + j]); mag += fabs(EO::load(&resid[i * n + j])); }
                const double want = GELU ? fs_gelu_ref(s) : s;
                const double tol = unit * fabs(want) + 1e-4 * mag + 1e-30;
                const double got = EO::load(&d[i * n + j]);
                double e = fabs(got - want) / tol;
                if (got != got) e = 1e30;
                if (e > worst) worst = e;
                if (GELU) {
                    const double pre = EO::load(&aux[i * n + j]);
                    double ea = fabs(pre - s) / (unit * fabs(s) + 1e-4 * mag + 1e-30);
                    if (pre != pre) ea = 1e30;
                    if (ea > worst) worst = ea;
                }
            }
        if (rep == 0) first = d;
        else same = memcmp(first.data(), d.data(), d.size() * sizeof(TO)) == 0;
    }
    printf("%s: %.4g %d %d\n", name, worst, same ? 1 : 0, zeroed ? 1 : 0);
}
"#;

fn el(e: &str) -> &'static str {
    match e {
        "bf16" => "fs_el::Bf16",
        "f16" => "fs_el::F16",
        _ => "fs_el::F32",
    }
}

fn cases() -> Vec<Case> {
    let base = Case {
        ei: "bf16",
        eo: "bf16",
        nk: false,
        rows: 1,
        splits: 1,
        vec: true,
        bias: false,
        resid: false,
        gelu: false,
        m: 1,
        n: 264,
        k: 200,
        block: 256,
        grid: 0,
    };
    // NK (below): a tied embedding's product (n not a multiple of the tile), k a
    // multiple of a load and not (203), one split and several, rows in one
    // and two passes.
    let nk = Case {
        nk: true,
        n: 37,
        ..base
    };
    let mut v = vec![
        // KN: one row, one split and several; rows in one pass (3 of 4) and in
        // two (17 of 16); k past one staged chunk (200, 300 > 128).
        Case { ..base },
        Case { splits: 5, ..base },
        Case {
            m: 3,
            rows: 4,
            splits: 3,
            bias: true,
            ..base
        },
        Case {
            m: 17,
            rows: 16,
            splits: 4,
            k: 300,
            bias: true,
            resid: true,
            ..base
        },
        Case {
            m: 5,
            rows: 8,
            splits: 2,
            bias: true,
            gelu: true,
            ..base
        },
        // n not a multiple of a 16-byte load (one element a load), a tile cut
        // short; then 16-byte loads with the last tile cut short (264 of 256).
        Case {
            n: 301,
            vec: false,
            m: 2,
            rows: 2,
            splits: 3,
            resid: true,
            ..base
        },
        // Other blocks and grids: the same values from fewer threads, fewer
        // blocks (grid-stride) and one thread.
        Case {
            m: 3,
            rows: 4,
            splits: 3,
            block: 64,
            grid: 2,
            bias: true,
            ..base
        },
        Case {
            m: 3,
            rows: 4,
            splits: 3,
            block: 1,
            grid: 1,
            bias: true,
            ..base
        },
        // f32 (4 elements a load), f16, and bf16 products stored in f32.
        Case {
            ei: "f32",
            eo: "f32",
            m: 6,
            rows: 8,
            splits: 4,
            bias: true,
            resid: true,
            ..base
        },
        Case {
            ei: "f16",
            eo: "f16",
            m: 2,
            rows: 2,
            splits: 2,
            gelu: true,
            bias: true,
            ..base
        },
        Case {
            eo: "f32",
            m: 4,
            rows: 4,
            splits: 3,
            ..base
        },
    ];
    v.extend([
        Case { ..nk },
        Case {
            m: 3,
            rows: 4,
            splits: 3,
            ..nk
        },
        Case {
            k: 203,
            vec: false,
            m: 2,
            rows: 2,
            splits: 2,
            bias: true,
            resid: true,
            ..nk
        },
        Case {
            m: 18,
            rows: 16,
            splits: 2,
            k: 600,
            ..nk
        },
        Case {
            m: 3,
            rows: 4,
            splits: 3,
            block: 64,
            grid: 3,
            gelu: true,
            bias: true,
            ..nk
        },
        Case {
            m: 3,
            rows: 4,
            splits: 2,
            block: 1,
            grid: 1,
            ..nk
        },
        Case {
            ei: "f32",
            eo: "f32",
            m: 5,
            rows: 8,
            splits: 3,
            k: 198,
            ..nk
        },
    ]);
    v
}

/// The harness for `cases`, each printing one line.
fn harness(cases: &[Case]) -> String {
    let prelude = fusec_compiler::emit::PRELUDE;
    let mut s = format!("#include \"threads_shim.h\"\n{prelude}\n#include \"gemm/skinny.cuh\"\n");
    s.push_str(CHECKER);
    s.push_str("int main() {\n");
    for c in cases {
        let _ = writeln!(
            s,
            "    run_case<{}, {}, {}, {}, {}, {}, {}, {}, {}>(\"{}\", {}, {}, {}, {}, {});",
            el(c.ei),
            el(c.eo),
            c.nk,
            c.rows,
            c.splits,
            c.vec,
            c.bias,
            c.resid,
            c.gelu,
            c.name(),
            c.m,
            c.n,
            c.k,
            c.block,
            c.grid
        );
    }
    s.push_str("    return 0;\n}\n");
    s
}

#[test]
fn the_skinny_template_computes_products_of_few_rows() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("gemm-skinny");
    let cases = cases();
    let exe = host::build(&work, "skinny", &harness(&cases));
    let out = std::process::Command::new(&exe).output().unwrap();
    assert!(
        out.status.success(),
        "the host run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), cases.len(), "{text}");
    for (c, line) in cases.iter().zip(&lines) {
        println!("{line}");
        let (name, rest) = line.rsplit_once(": ").unwrap();
        assert_eq!(name, c.name());
        let f: Vec<&str> = rest.split(' ').collect();
        let worst: f64 = f[0].parse().unwrap();
        assert!(
            worst <= 1.0,
            "{name}: an element {worst:.3} times its tolerance off"
        );
        assert_eq!(f[1], "1", "{name}: a second launch gave other bits");
        assert_eq!(
            f[2], "1",
            "{name}: a tile's count of splits was left above zero"
        );
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// A harness running the named skinny wrappers with real blocks: the
/// kernel's buffers from files, its f32 scratch where it takes one, grid
/// and block from the command line.
fn wrapper_harness(
    g: &fusec_compiler::ir::Graph,
    p: &fusec_compiler::kernel::Program,
    launches: &[(String, fusec_compiler::emit::launch::KernelLaunch)],
    env: &dyn Fn(&str) -> Option<i64>,
) -> String {
    use fusec_compiler::emit::{PRELUDE, PRELUDE_NAME};
    let mut s = format!("#include \"threads_shim.h\"\n{PRELUDE}\n");
    for (_, l) in launches {
        s.push_str(
            &l.source
                .replace(&format!("#include \"{PRELUDE_NAME}\""), ""),
        );
    }
    s.push_str(host::FILE_IO);
    s.push_str(
        "int main(int argc, char** argv) {\n  const char* dir = argv[2];\n\
         \x20 const unsigned grid = atoi(argv[3]), block = atoi(argv[4]);\n",
    );
    for (i, d) in g.dims.iter().enumerate() {
        let _ = writeln!(s, "  const fs_i64 dim_{d} = atoll(argv[{}]);", i + 5);
    }
    for (name, l) in launches {
        let k = p.kernels.iter().find(|k| k.name == *name).unwrap();
        let _ = writeln!(s, "  if (!strcmp(argv[1], \"{name}\")) {{");
        let (mut args, writes) = host::kernel_buffers(&mut s, p, k, &g.dims, true);
        if let Some(n) = &l.scratch_f32 {
            let n = n.eval(env).unwrap();
            // Garbage in the scratch: nothing may read a partial it did not write.
            let _ = writeln!(
                s,
                "    float* scratch = (float*)malloc({n} * 4 + 16); memset(scratch, 0x7f, {n} * 4);"
            );
            args.push("scratch".into());
        }
        let _ = writeln!(
            s,
            "    fs_launch(grid, block, [&] {{ {name}({}); }});",
            args.join(", ")
        );
        s.push_str(&writes);
        let _ = writeln!(s, "    return 0;\n  }}");
    }
    s.push_str("  fprintf(stderr, \"unknown kernel %s\\n\", argv[1]);\n  return 2;\n}\n");
    s
}

/// The decode steps' products (gpt2's tied head read transposed and its
/// biased, residual and GELU epilogues; a grouped-query llama's separate
/// projections and untied head; odd widths where a row is no whole number
/// of 16-byte loads) as the compiler chose them at batch 3 and one new
/// row, and at a 5-row prefill of 2: the wrappers it wrote, run on the
/// host with the launch's grid and block, against the kernel-IR
/// interpreter (16-bit outputs within 1e-2 an element, a bf16 rounding or
/// two of the f32 sums; f32 within 1e-5).
#[test]
fn the_decode_steps_skinny_products_compute_what_the_interpreter_computes() {
    use fusec_compiler::decode::{decode_graph, weights_as_read, CACHE_DIM};
    use fusec_compiler::driver::logits_graph;
    use fusec_compiler::kernel::fuse::fuse;
    use fusec_compiler::select::{select_at, Choice};
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("gemm-skinny-decode");
    let models: [(&str, Vec<(&str, &str)>); 2] = [
        (
            "gpt2-small.dsl",
            vec![
                ("vocab", "61"),
                ("ctx", "16"),
                ("d", "128"),
                ("n_heads", "2"),
                ("layers", "1"),
            ],
        ),
        (
            "llama-small.dsl",
            vec![
                ("vocab", "61"),
                ("d", "128"),
                ("n_heads", "4"),
                ("n_kv_heads", "2"),
                ("ffn", "90"),
                ("layers", "1"),
            ],
        ),
    ];
    let target = fusec_compiler::target::Target::for_device("h100", false).unwrap();
    let (mut ran, mut split) = (0, 0);
    for (file, sets) in models {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        let step = weights_as_read(&decode_graph(&logits_graph(&c).unwrap()).unwrap()).unwrap();
        let program = fuse(&step);
        for (b, t) in [(3i64, 1i64), (2, 5)] {
            let sizes = [("B", b), ("T", t), (CACHE_DIM, 8)];
            let dims: std::collections::BTreeMap<String, i64> =
                sizes.iter().map(|(k, v)| (k.to_string(), *v)).collect();
            let env = |s: &str| dims.get(s).copied();
            let selection = select_at(&step, &program, &target, None, Some(&dims));
            let launches: Vec<(String, fusec_compiler::emit::launch::KernelLaunch)> = program
                .kernels
                .iter()
                .zip(&selection.choices)
                .filter_map(|(k, c)| match c {
                    Choice::Skinny(l) => Some((k.name.clone(), (**l).clone())),
                    _ => None,
                })
                .collect();
            assert!(
                launches.len() >= 4,
                "{file} {b}x{t}: {} skinny products",
                launches.len()
            );
            let stem = format!("{}-{b}x{t}", file.trim_end_matches(".dsl"));
            let exe = host::build(
                &work,
                &stem,
                &wrapper_harness(&step, &program, &launches, &env),
            );
            let bufs = host::program_values(&step, &program, &common::dims(&sizes), 5);
            let dim_args: Vec<String> = step.dims.iter().map(|d| dims[d].to_string()).collect();
            for (kname, l) in &launches {
                let k = program.kernels.iter().find(|k| k.name == *kname).unwrap();
                let grid = l.grid(&env).unwrap();
                let args: Vec<String> = [grid[0].to_string(), l.block.to_string()]
                    .into_iter()
                    .chain(dim_args.iter().cloned())
                    .collect();
                let dir = work.join(format!("{stem}-{kname}"));
                let outs = host::run_kernel(&exe, &dir, &program, k, &bufs, &args)
                    .unwrap_or_else(|e| panic!("{stem} {kname}: {e}"));
                for (&o, got) in k.outputs.iter().zip(outs) {
                    let want = &bufs[o].data;
                    let tol = match program.buffers[o].ty.dtype {
                        fusec_compiler::ir::DType::F32 => 1e-5,
                        _ => 1e-2,
                    };
                    assert_eq!(got.len(), want.len());
                    for (i, (x, y)) in want.iter().zip(&got).enumerate() {
                        assert!(
                            (x - y).abs() <= tol * x.abs().max(1.0),
                            "{stem} {kname} ({}) element {i}: interpreter {x}, skinny {y}",
                            l.template.as_deref().unwrap_or("")
                        );
                    }
                }
                ran += 1;
                split += usize::from(l.scratch_f32.is_some());
            }
        }
    }
    println!(
        "{ran} skinny products of decode steps matched the interpreter ({split} split along k)"
    );
    assert!(split > 0, "no product was split along k");
    let _ = std::fs::remove_dir_all(&work);
}
