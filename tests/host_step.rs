//! A whole training step run the way the GPU runtime runs it, on the host:
//! one byte arena of the plan's size, every buffer at its planned offset
//! (in-place updates and results written over dead operands included), the
//! generated kernels called in plan order with the runtime's argument
//! convention, and every GEMM computed from the `GemmSpec` the runtime
//! derives, with its epilogue. The loss, the gradients and the updated
//! parameters must match the kernel-IR interpreter (values rounded as
//! stored). One host thread per block (tests/cuda_host/shim.h), so this
//! checks the memory plan, the launch order and the wiring, not races.

mod common;

use common::host;

use fusec_compiler::emit::cuda::{c_type, emit_program};
use fusec_compiler::emit::{PRELUDE, PRELUDE_NAME};
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::Precision;
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::DType;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::interp::run_program;
use fusec_compiler::kernel::Body;
use fusec_compiler::ops::Op;
use fusec_compiler::plan::plan;
use fusec_runtime::exec::gemm_spec;
use fusec_runtime::gemm::Elem;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::process::Command;

fn elem_code(e: Elem) -> u32 {
    match e {
        Elem::F32 => 0,
        Elem::BF16 => 1,
        Elem::F16 => 2,
    }
}

/// Bound on an f32 model's update's difference from the interpreter's, as a
/// share of the update's norm (see the check). The runs differ by summation
/// order alone: the largest seen over the shipped models is 2.2e-4 (the
/// MLP). A missing update is 1, a sign-flipped one 2, Adam's bias
/// correction a step off 0.26.
const UPDATE_F32: f64 = 2e-3;

/// A row-major GEMM with the runtime's epilogues, on raw arena pointers.
const GEMM: &str = r#"
static float fs_get(const void* p, int t, long long i) {
    if (t == 0) return ((const float*)p)[i];
    if (t == 1) return fs_load_bf16(&((const fs_bf16*)p)[i]);
    return fs_load_f16(&((const fs_f16*)p)[i]);
}
static void fs_put(void* p, int t, long long i, float v) {
    if (t == 0) ((float*)p)[i] = v;
    else if (t == 1) ((fs_bf16*)p)[i] = fs_to_bf16(v);
    else ((fs_f16*)p)[i] = fs_to_f16(v);
}
static void fs_gemm(long long m, long long n, long long k, long long batch, int at, int bt,
                    long long sa, long long sb, long long sd, long long pa, long long pb, long long pd, int ti, int to,
                    const void* a, const void* b, void* d, const void* bias, const void* res,
                    void* aux_out, const void* aux_in) {
    float* tmp = (float*)malloc(sizeof(float) * m * n);
    for (long long bi = 0; bi < batch; ++bi) {
        long long oa = bi * sa, ob = bi * sb, od = batch == 1 ? 0 : bi * sd;
        // Row pitches: 0 is packed rows.
        const long long la = pa ? pa : (at ? m : k), lb = pb ? pb : (bt ? k : n), ld = pd ? pd : n;
        for (long long i = 0; i < m; ++i)
            for (long long j = 0; j < n; ++j) {
                float acc = 0.0f;
                for (long long kk = 0; kk < k; ++kk)
                    acc += fs_get(a, ti, oa + (at ? kk * la + i : i * la + kk)) *
                           fs_get(b, ti, ob + (bt ? j * lb + kk : kk * lb + j));
                tmp[i * n + j] = acc;
            }
        // Read every residual and pre-activation before writing (D may
        // share storage with them).
        for (long long i = 0; i < m * n; ++i) {
            float x = tmp[i];
            if (res) x += fs_get(res, to, od + i);
            if (bias) x += fs_get(bias, to, i % n);
            if (aux_in) x *= fs_gelu_grad(fs_get(aux_in, to, od + i));
            tmp[i] = x;
        }
        for (long long i = 0; i < m * n; ++i) {
            if (aux_out) { fs_put(aux_out, to, od + i, tmp[i]); fs_put(d, to, od + i, fs_gelu(tmp[i])); }
            else fs_put(d, to, od + (i / n) * ld + i % n, tmp[i]);
        }
    }
    free(tmp);
}
"#;

#[test]
fn a_whole_step_in_one_arena_matches_the_interpreter() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("host-step");
    let mut report = Vec::new();
    // GPT-2 again with 1029 bf16 logits a row: not a multiple of 16 bytes,
    // so the logits are stored with rows padded to 1088 and the products
    // around them run at 1088 (kernel::pitch).
    let padded = (
        "gpt2-small.dsl",
        vec![
            ("vocab", "1029"),
            ("ctx", "8"),
            ("d", "16"),
            ("n_heads", "2"),
            ("layers", "1"),
        ],
        vec![("B", 2), ("T", 3)],
    );
    // BERT's head adds a bias in the GEMM's epilogue, and sums the padded
    // logits' gradient for the bias's gradient.
    let bert = (
        "bert-encoder.dsl",
        vec![
            ("vocab", "1029"),
            ("ctx", "8"),
            ("d", "16"),
            ("n_heads", "2"),
            ("layers", "1"),
        ],
        vec![("B", 2), ("T", 3)],
    );
    // LLaMA-style with an MLP width of 131 and an untied head of 1003
    // classes: the pad-dims pass reads the weights padded to 136 and 1008
    // (zero columns and rows), the cross-entropy told its classes.
    let awkward = (
        "../tests/models/twins/gqa-hd80.dsl",
        vec![
            ("vocab", "1003"),
            ("ffn", "131"),
            ("n_heads", "2"),
            ("n_kv_heads", "1"),
            ("head_dim", "8"),
        ],
        vec![("B", 2), ("T", 3)],
    );
    // In f32 with 131 classes: the bias and the last weight read padded to
    // 136, the cross-entropy's scalar (not 16-byte) path over 131 of them.
    let awkward_f32 = (
        "mlp.dsl",
        vec![("d_in", "37"), ("d_hidden", "64"), ("classes", "131")],
        vec![("B", 5)],
    );
    let (mut pitches, mut zero_rows, mut pads, mut padded_sizes) = (0, 0, Vec::new(), Vec::new());
    let mut updates: f64 = 0.0;
    for (file, sets, dims) in
        common::tiny_models()
            .into_iter()
            .chain([padded, bert, awkward, awkward_f32])
    {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        let g = &c.optimized;
        padded_sizes.extend(g.padded.iter().map(|p| (p.size, p.to)));
        let program = fuse(g);
        pitches += program.buffers.iter().filter(|b| b.pitch.is_some()).count();
        zero_rows += program.buffers.iter().filter(|b| b.zero_rows > 0).count();
        pads.extend(program.gemm_pads.values().copied());
        let dmap = common::dims(&dims);
        let bdims: BTreeMap<String, i64> = dmap.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let pl = plan(g, &program, &bdims).unwrap();
        let feeds = random_feeds(g, &dmap, 13).unwrap();
        let reference = run_program(g, &program, &feeds, Precision::AsStored).unwrap();
        let kernels = emit_program(g, &program, None);

        // The arena as the runtime fills it before a step. Padded buffers
        // start as NaN (what an earlier step may leave there): their
        // writers must write the padding a padded GEMM reads.
        let mut arena = vec![0u8; pl.arena_bytes.max(256) as usize];
        for (i, b) in program.buffers.iter().enumerate() {
            if b.pitch.is_some() || b.zero_rows > 0 {
                let at = pl.buffers[i].offset as usize;
                arena[at..at + pl.buffers[i].bytes as usize].fill(0xff);
            }
        }
        for (i, b) in program.buffers.iter().enumerate() {
            let t = match (&g.g[b.value.node].op, b.kind) {
                (Op::Input(x), _) => feeds.inputs.get(&x.name),
                (Op::Param(x), _) => feeds.params.get(&x.name),
                (Op::State(x), _) => feeds.state.get(&x.name),
                _ => None,
            };
            if let Some(t) = t {
                let bytes = common::to_bytes(b.ty.dtype, &t.data);
                let at = pl.buffers[i].offset as usize;
                arena[at..at + bytes.len()].copy_from_slice(&bytes);
            }
        }
        std::fs::write(work.join("arena.bin"), &arena).unwrap();

        // The step: every launch in order.
        let mut s = String::from("#include \"shim.h\"\n");
        s.push_str(PRELUDE);
        s.push_str(GEMM);
        for (_, text) in &kernels {
            s.push_str(&text.replace(&format!("#include \"{PRELUDE_NAME}\""), ""));
        }
        let _ = writeln!(s, "int main(int argc, char** argv) {{");
        let _ = writeln!(s, "  const size_t bytes = {};", arena.len());
        let _ = writeln!(s, "  char* arena = (char*)aligned_alloc(256, bytes);");
        let _ = writeln!(s, "  FILE* f = fopen(argv[1], \"rb\"); if (!f || fread(arena, 1, bytes, f) != bytes) return 2; fclose(f);");
        for d in &g.dims {
            let _ = writeln!(s, "  const fs_i64 dim_{d} = {};", dmap[d]);
        }
        let ptr = |b: usize| format!("(arena + {})", pl.buffers[b].offset);
        for k in &program.kernels {
            let typed = |b: usize, out: bool| {
                let t = c_type(program.buffers[b].ty.dtype);
                if out {
                    format!("({t}*){}", ptr(b))
                } else {
                    format!("(const {t}*){}", ptr(b))
                }
            };
            let gemm = match &k.body {
                Body::Gemm(n, e) => Some((*n, Some(e.clone()))),
                Body::Op(n) if matches!(g.g[*n].op, Op::MatMul(_)) => Some((*n, None)),
                _ => None,
            };
            if let Some((n, ep)) = gemm {
                let sp = gemm_spec(g, &program, k, n, &bdims).unwrap();
                let opt = |slot: Option<usize>, out: bool| match slot {
                    Some(sl) if out => ptr(k.outputs[sl]),
                    Some(sl) => ptr(k.inputs[sl]),
                    None => "nullptr".into(),
                };
                let e = ep.unwrap_or_default();
                let _ = writeln!(
                    s,
                    "  fs_gemm({}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}); // {}",
                    sp.m,
                    sp.n,
                    sp.k,
                    sp.batch,
                    sp.a_transposed as u8,
                    sp.b_transposed as u8,
                    sp.batch_stride_a,
                    sp.batch_stride_b,
                    sp.batch_stride_d,
                    sp.pitch_a,
                    sp.pitch_b,
                    sp.pitch_d,
                    elem_code(sp.in_type),
                    elem_code(sp.out_type),
                    ptr(k.inputs[0]),
                    ptr(k.inputs[1]),
                    ptr(k.outputs[0]),
                    opt(e.bias, false),
                    opt(e.residual, false),
                    opt(e.gelu.then_some(1), true),
                    opt(e.dgelu, false),
                    k.name
                );
                continue;
            }
            assert!(
                kernels.iter().any(|(n, _)| *n == k.name),
                "{file}: {} has no code",
                k.name
            );
            let mut args: Vec<String> = k.inputs.iter().map(|&b| typed(b, false)).collect();
            args.extend(k.outputs.iter().map(|&b| typed(b, true)));
            args.extend(g.dims.iter().map(|d| format!("dim_{d}")));
            let _ = writeln!(s, "  {}({});", k.name, args.join(", "));
        }
        let _ = writeln!(
            s,
            "  f = fopen(argv[2], \"wb\"); fwrite(arena, 1, bytes, f); fclose(f);\n  return 0;\n}}"
        );
        let stem = file
            .rsplit('/')
            .next()
            .unwrap_or(file)
            .trim_end_matches(".dsl");
        let exe = host::build(&work, stem, &s);
        let after = work.join(format!("{stem}.out"));
        let run = Command::new(&exe)
            .arg(work.join("arena.bin"))
            .arg(&after)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let arena = std::fs::read(&after).unwrap();

        // Gradients that are zero in real arithmetic (a key bias's:
        // softmax ignores a shift shared by every key) are rounding noise
        // in both runs, of opposite signs as likely as not: their f64
        // value is below 1e-12 of the largest gradient.
        let grad_max = |i: usize| -> Option<f64> {
            let v = g.output(&Role::Grad(i))?;
            let b = program.buffer_of(v)?;
            Some(reference[b].data.iter().fold(0.0f64, |m, x| m.max(x.abs())))
        };
        let largest = (0..g.params.len())
            .filter_map(grad_max)
            .fold(0.0f64, f64::max);
        let cancels = |i: usize| grad_max(i).is_some_and(|m| m <= 1e-12 * largest);
        // The step's results, read back at their offsets.
        let mut worst: f64 = 0.0;
        for (role, v) in &g.outputs {
            let b = program.buffer_of(*v).unwrap();
            let pb = &pl.buffers[b];
            let dt = program.buffers[b].ty.dtype;
            let got = common::from_bytes(
                dt,
                &arena[pb.offset as usize..(pb.offset + pb.bytes) as usize],
            );
            let want = &reference[b].data;
            let mut scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-6);
            // Adam moves each weight by about lr (1e-3 in these feeds)
            // whatever the gradient's size: where a gradient is bf16 noise
            // (a zero-initialised bias), the two runs may move it by up to
            // 2 lr apart. Judge new weights against at least that.
            if matches!(role, Role::NewParam(_)) && c.model.train.precision != DType::F32 {
                scale = scale.max(0.25);
            }
            // The same for a gradient that cancels, in any precision; and
            // that gradient itself is judged against f32 rounding of the
            // largest gradient (1e-5 of it, at the f32 tolerance below).
            match role {
                Role::NewParam(i) if cancels(*i) => scale = scale.max(0.25),
                Role::Grad(i) if cancels(*i) => scale = scale.max(largest * 1e-5 / 2e-3),
                _ => {}
            }
            let err = got
                .iter()
                .zip(want)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max)
                / scale;
            // f32 models sum in another order; in bf16 models every value
            // is rounded where the kernels store it (the GEMM epilogues and
            // fused chains round less often than the graph), so even their
            // f32 gradients carry bf16-sized differences. Adam's update
            // is about lr * sign(g): compared against the parameter's size.
            let tol: f64 = match (c.model.train.precision, role) {
                (DType::F32, _) => 2e-3,
                (_, Role::NewParam(_)) => 1e-2,
                _ => 5e-2,
            };
            let _ = dt;
            assert!(
                err <= tol,
                "{file}: {role} error {err:.3e} (of its largest value)"
            );
            worst = worst.max(err);
            // The update itself, new minus old, in f32 models: the bound
            // above is of the weight's size, which a missing or sign-flipped
            // update (lr = 1e-3 of it) passes. Adam's first step moves each
            // weight by about lr * sign(g). In 16-bit models bf16 rounding
            // of these tiny random models' gradients flips the sign of so
            // many near-zero gradients that some tensors' updates part by
            // their whole norm (1.08 at most, the translator), as a missing
            // update would: there the check says nothing and is not made.
            // A gradient that cancels (and its Adam state) is noise in both.
            let old = match role {
                Role::NewParam(i) => feeds.params.get(&g.params[*i].name),
                Role::NewState(s) => feeds.state.get(s),
                _ => None,
            };
            let noise = match role {
                Role::NewParam(i) => cancels(*i),
                Role::NewState(s) => (0..g.params.len())
                    .any(|i| s.starts_with(&format!("{}.", g.params[i].name)) && cancels(i)),
                _ => false,
            };
            if let (Some(old), DType::F32, false) = (old, c.model.train.precision, noise) {
                let (mut diff, mut norm) = (0.0f64, 0.0f64);
                for ((x, y), o) in got.iter().zip(want).zip(&old.data) {
                    diff += ((x - o) - (y - o)).powi(2);
                    norm += (y - o).powi(2);
                }
                if norm > 0.0 {
                    let rel = (diff / norm).sqrt();
                    updates = updates.max(rel);
                    assert!(
                        rel <= UPDATE_F32,
                        "{file}: {role}: the update differs by {rel:.3e} of its norm (bound {UPDATE_F32})"
                    );
                }
            }
        }
        report.push(format!(
            "{file}: {} launches, worst {worst:.2e}",
            program.kernels.len()
        ));
    }
    for r in report {
        println!("{r}");
    }
    println!("f32 models' updates: at most {updates:.2e} of their norm from the interpreter's");
    assert_eq!(
        padded_sizes,
        [(131, 136), (1003, 1008), (131, 136)],
        "pad-dims should pad the awkward models' MLP width, untied head and classes, and nothing in the shipped models"
    );
    // The logits and their gradient, in GPT-2 and in BERT.
    assert_eq!(
        pitches, 4,
        "the padded GPT-2 and BERT should store their logits with padded rows"
    );
    // The output projection at n = 1088 and its input gradient at k = 1088,
    // over the bf16 table with 59 zero rows after its last (and BERT's bias
    // with 59 zeros after its end), and the table's gradient at m = 1088.
    assert_eq!(
        zero_rows, 5,
        "the padded GPT-2's and BERT's table copies and tables' gradients, and BERT's bias, should end in zeros"
    );
    let want = [
        fusec_compiler::kernel::GemmPad {
            n: Some(1088),
            ..Default::default()
        },
        fusec_compiler::kernel::GemmPad {
            k: Some(1088),
            ..Default::default()
        },
        fusec_compiler::kernel::GemmPad {
            m: Some(1088),
            ..Default::default()
        },
    ];
    let want: Vec<_> = want.iter().chain(&want).copied().collect();
    assert_eq!(
        pads, want,
        "the padded GPT-2's and BERT's products should run at 1088"
    );
    let _ = std::fs::remove_dir_all(&work);
}
