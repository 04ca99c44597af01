//! A whole training step run the way the GPU runtime runs it, on the host:
//! one byte arena of the plan's size, every buffer at its planned offset
//! (in-place updates and results written over dead operands included), the
//! generated kernels called in plan order with the runtime's argument
//! convention, and every GEMM computed from the `GemmShape` the runtime
//! derives, with its epilogue. The loss, the gradients and the updated
//! parameters must match the kernel-IR interpreter (values rounded as
//! stored). One host thread per block (tests/cuda_host/shim.h), so this
//! checks the memory plan, the launch order and the wiring, not races.
//! `FUSEC_DEBUG_DUMP=1` prints the first values of a result that fails.

use fusec_compiler::autodiff::LR_INPUT;
use fusec_compiler::driver::Compiled;
use fusec_compiler::emit::cuda::{c_type, emit_program};
use fusec_compiler::emit::{PRELUDE, PRELUDE_NAME};
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::Precision;
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::DType;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::interp::run_program;
use fusec_compiler::kernel::{Body, GemmPad};
use fusec_compiler::ops::Op;
use fusec_compiler::plan::plan;
use fusec_runtime::gemm::GemmElem;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;
use std::process::Command;

fn elem_code(e: GemmElem) -> u32 {
    match e {
        GemmElem::F32 => 0,
        GemmElem::BF16 => 1,
        GemmElem::F16 => 2,
    }
}

/// Bound on an f32 model's update's difference from the interpreter's, as a
/// share of the update's norm, beyond the weights' f32 rounding (see the
/// check). The runs differ by summation order alone: the largest seen is
/// 8.3e-7 over the shipped models and 7.5e-4 over the 50 drawn ones
/// (zoo-46). A missing update is 1, a sign-flipped one 2, Adam's bias
/// correction a step off 0.26.
pub const UPDATE_F32: f64 = 2e-3;

/// The same bound in bf16 and fp16 models, over the entries whose gradient
/// is clear of bf16 noise (see `ill_conditioned`): their gradients differ
/// by bf16 rounding (2^-8 a value, a few percent of a tensor's norm after
/// sums), which an SGD step carries over as it is: 1.6e-2 at most over the
/// shipped and the 50 drawn models. A missing update is 1, a sign-flipped
/// one 2, Adam's bias correction a step off 0.26.
pub const UPDATE_16: f64 = 0.1;

/// What one whole step on the host showed.
pub struct StepOutcome {
    pub launches: usize,
    /// Buffers stored with padded rows, and with zero rows after their end.
    pub pitches: usize,
    pub zero_rows: usize,
    /// The products run at padded sizes.
    pub pads: Vec<GemmPad>,
    /// The largest difference of any step result from the interpreter's,
    /// as a share of its bound (1 fails).
    pub worst: f64,
    /// The largest difference of an update from the interpreter's, as a
    /// share of its norm (bound UPDATE_F32, or UPDATE_16 in 16-bit models).
    pub updates: f64,
    /// Outputs of kernels made 1% wrong (`run_step_perturbed`).
    pub perturbed: usize,
}

/// The parameter optimizer state `name` belongs to (`<param>.adam_m`,
/// `.adam_v`, `.momentum`, `.grad_acc`): the longest parameter name that
/// is a prefix of it, so that `a.b`'s state is not taken for `a`'s.
fn state_owner(g: &fusec_compiler::ir::Graph, name: &str) -> Option<usize> {
    (0..g.params.len())
        .filter(|&i| name.starts_with(&format!("{}.", g.params[i].name)))
        .max_by_key(|&i| g.params[i].name.len())
}

/// Scales kernel `k`'s float outputs by 1.01 in the harness, where it
/// computes an op named `perturb`; returns how many it scaled that hold a
/// value other than zero in this step (scaling zeros changes nothing: a
/// micro-batch accumulator that the step's last micro-batch clears).
fn perturb_outputs(
    s: &mut String,
    g: &fusec_compiler::ir::Graph,
    program: &fusec_compiler::kernel::Program,
    pl: &fusec_compiler::plan::Plan,
    reference: &[fusec_compiler::interp::tensor::Tensor],
    k: &fusec_compiler::kernel::Kernel,
    perturb: Option<&str>,
) -> usize {
    let Some(op) = perturb else { return 0 };
    if !k.nodes.iter().any(|&n| g.g[n].op.name() == op) {
        return 0;
    }
    let mut scaled = 0;
    for &b in &k.outputs {
        let (code, size) = match program.buffers[b].ty.dtype {
            DType::F32 => (0, 4),
            DType::BF16 => (1, 2),
            DType::F16 => (2, 2),
            _ => continue,
        };
        let pb = &pl.buffers[b];
        let _ = writeln!(
            s,
            "  for (long long e = 0; e < {}; ++e) fs_put(arena + {}, {code}, e, fs_get(arena + {}, {code}, e) * 1.01f); // perturbed",
            pb.bytes / size,
            pb.offset,
            pb.offset
        );
        if reference[b].data.iter().any(|&x| x != 0.0) {
            scaled += 1;
        }
    }
    scaled
}

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

/// Runs model `c`'s whole step at sizes `dims` on the host (files in `work`
/// named after `stem`) and compares every result with the interpreter's.
pub fn run_step(
    work: &Path,
    stem: &str,
    c: &Compiled,
    dims: &[(&str, i64)],
) -> Result<StepOutcome, String> {
    run_step_perturbed(work, stem, c, dims, None)
}

/// [`run_step`], with every float output of each kernel that computes an
/// op named `perturb` (`Op::name`) made 1% too large after it runs: a
/// kernel that is wrong by that much, to show the comparison catches it.
pub fn run_step_perturbed(
    work: &Path,
    stem: &str,
    c: &Compiled,
    dims: &[(&str, i64)],
    perturb: Option<&str>,
) -> Result<StepOutcome, String> {
    let g = &c.optimized;
    let program = fuse(g);
    let mut out = StepOutcome {
        launches: program.kernels.len(),
        pitches: program.buffers.iter().filter(|b| b.pitch.is_some()).count(),
        zero_rows: program.buffers.iter().filter(|b| b.zero_rows > 0).count(),
        pads: program.gemm_pads.values().copied().collect(),
        worst: 0.0,
        updates: 0.0,
        perturbed: 0,
    };
    let dmap = super::dims(dims);
    let bdims: BTreeMap<String, i64> = dmap.iter().map(|(k, v)| (k.clone(), *v)).collect();
    let pl = plan(g, &program, &bdims).map_err(|e| format!("plan: {e:?}"))?;
    let feeds = random_feeds(g, &dmap, 13).map_err(|e| format!("feeds: {e}"))?;
    let reference = run_program(g, &program, &feeds, Precision::AsStored)
        .map_err(|e| format!("interpreter: {e}"))?;
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
            let bytes = super::to_bytes(b.ty.dtype, &t.data);
            let at = pl.buffers[i].offset as usize;
            arena[at..at + bytes.len()].copy_from_slice(&bytes);
        }
    }
    let arena_in = work.join(format!("{stem}.arena"));
    std::fs::write(&arena_in, &arena).unwrap();

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
    for (k, launch) in program.kernels.iter().zip(&pl.launches) {
        let typed = |b: usize, out: bool| {
            let t = c_type(program.buffers[b].ty.dtype);
            if out {
                format!("({t}*){}", ptr(b))
            } else {
                format!("(const {t}*){}", ptr(b))
            }
        };
        let gemm = match &k.body {
            Body::Gemm(_, e) => Some(Some(e.clone())),
            Body::Op(n) if matches!(g.g[*n].op, Op::MatMul(_)) => Some(None),
            _ => None,
        };
        if let Some(ep) = gemm {
            let shape = launch
                .gemm
                .as_ref()
                .ok_or_else(|| format!("{}: no product in the plan", k.name))?;
            let sp = *shape;
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
            out.perturbed += perturb_outputs(&mut s, g, &program, &pl, &reference, k, perturb);
            continue;
        }
        if !kernels.iter().any(|(n, _)| *n == k.name) {
            return Err(format!("{} has no code", k.name));
        }
        let mut args: Vec<String> = k.inputs.iter().map(|&b| typed(b, false)).collect();
        args.extend(k.outputs.iter().map(|&b| typed(b, true)));
        args.extend(g.dims.iter().map(|d| format!("dim_{d}")));
        let _ = writeln!(s, "  {}({});", k.name, args.join(", "));
        out.perturbed += perturb_outputs(&mut s, g, &program, &pl, &reference, k, perturb);
    }
    let _ = writeln!(
        s,
        "  f = fopen(argv[2], \"wb\"); fwrite(arena, 1, bytes, f); fclose(f);\n  return 0;\n}}"
    );
    let exe = super::host::build(work, stem, &s);
    let after = work.join(format!("{stem}.out"));
    let run = Command::new(&exe)
        .arg(&arena_in)
        .arg(&after)
        .output()
        .unwrap();
    if !run.status.success() {
        return Err(format!(
            "the host run failed: {}",
            String::from_utf8_lossy(&run.stderr)
        ));
    }
    let arena = std::fs::read(&after).unwrap();

    // Gradients that are zero in real arithmetic (a key bias's: softmax
    // ignores a shift shared by every key; a query's where its row sees one
    // key) are rounding noise in both runs, of opposite signs as likely as
    // not: their value in f64 arithmetic is below 1e-12 of the largest
    // gradient (f32 rounding leaves them near 1e-9 of it).
    let exact = run_program(g, &program, &feeds, Precision::F64)
        .map_err(|e| format!("interpreter in f64: {e}"))?;
    let grad_max = |i: usize| -> Option<f64> {
        let v = g.output(&Role::Grad(i))?;
        let b = program.buffer_of(v)?;
        Some(exact[b].data.iter().fold(0.0f64, |m, x| m.max(x.abs())))
    };
    let largest = (0..g.params.len())
        .filter_map(grad_max)
        .fold(0.0f64, f64::max);
    let cancels = |i: usize| grad_max(i).is_some_and(|m| m <= 1e-12 * largest);
    let precision = c.model.train.precision;
    // A gradient's rounding noise, absolute: the compute precision's unit
    // roundoff times the largest gradient, summed over tens of terms: f32
    // 1e-5 (2^-24 = 6e-8 a rounding, with room for the sums), bf16 2^-8,
    // f16 2^-11.
    let noise_floor = largest
        * match precision {
            DType::F32 => 1e-5,
            DType::BF16 => 3.9e-3,
            _ => 4.9e-4,
        };
    // The factor clipping scales every gradient by (from the f64 values).
    let clip_factor = match c.model.train.clip_grad_norm {
        Some(max) => {
            let sq: f64 = (0..g.params.len())
                .filter_map(|i| g.output(&Role::Grad(i)).and_then(|v| program.buffer_of(v)))
                .flat_map(|b| exact[b].data.iter().map(|x| x * x))
                .sum();
            (max / (sq.sqrt() + 1e-6)).min(1.0)
        }
        None => 1.0,
    };
    let lr = feeds.inputs.get(LR_INPUT).map_or(1e-3, |t| t.data[0]);
    // Entries of parameter i whose Adam step is ill-conditioned: its first
    // step moves an entry by lr g / (|g| + eps), so where the gradient (as
    // clipped) is within 100 eps of zero, or noise, the gradient's rounding
    // decides the move, anywhere from -lr to lr. Elsewhere the move is
    // within 1% of lr sign(g) and any difference is the optimizer's.
    let adam_eps = match &c.model.train.optimizer {
        fusec_compiler::model::Optimizer::AdamW { eps, .. } => Some(*eps),
        _ => None,
    };
    let ill_conditioned = |i: usize| -> Option<Vec<bool>> {
        let eps = adam_eps?;
        let b = g
            .output(&Role::Grad(i))
            .and_then(|v| program.buffer_of(v))?;
        let floor = (100.0 * eps).max(2.0 * noise_floor * clip_factor);
        Some(
            exact[b]
                .data
                .iter()
                .map(|x| (x * clip_factor).abs() < floor)
                .collect(),
        )
    };
    // The step's results, read back at their offsets.
    for (role, v) in &g.outputs {
        let b = program.buffer_of(*v).unwrap();
        let pb = &pl.buffers[b];
        let dt = program.buffers[b].ty.dtype;
        let got = super::from_bytes(
            dt,
            &arena[pb.offset as usize..(pb.offset + pb.bytes) as usize],
        );
        let want = &reference[b].data;
        let largest_value = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-6);
        // f32 models sum in another order; in bf16 models every value is
        // rounded where the kernels store it (the GEMM epilogues and fused
        // chains round less often than the graph), so even their f32
        // gradients carry bf16-sized differences.
        let tol: f64 = match (precision, role) {
            (DType::F32, _) => 2e-3,
            (_, Role::NewParam(_)) => 1e-2,
            _ => 5e-2,
        };
        let mut allowed = tol * largest_value;
        // Adam moves each weight by about lr whatever the gradient's size:
        // where a 16-bit model's gradient is noise (a zero-initialised
        // bias), the runs may move it up to 2 lr apart, so new weights are
        // judged against a size of at least 0.25 (2.5 lr at 1e-2).
        if matches!(role, Role::NewParam(_)) && precision != DType::F32 {
            allowed = allowed.max(tol * 0.25);
        }
        // A gradient that cancels (zero in real arithmetic) and its
        // optimizer state are noise in both runs.
        let noise = match role {
            Role::NewParam(i) | Role::Grad(i) => cancels(*i),
            Role::NewState(s) => state_owner(g, s).is_some_and(cancels),
            _ => false,
        };
        match role {
            Role::Grad(_) if noise => allowed = allowed.max(noise_floor),
            // Adam's m (and SGD's momentum) is a share of the gradient,
            // Adam's v a share of its square.
            Role::NewState(s) if noise => {
                let a = if s.ends_with("adam_v") {
                    noise_floor * noise_floor
                } else {
                    noise_floor
                };
                allowed = allowed.max(a);
            }
            _ => {}
        }
        // Per entry: an ill-conditioned Adam step may part by 2 lr (and
        // its weight decay).
        let loose = match role {
            Role::NewParam(i) => ill_conditioned(*i),
            _ => None,
        };
        let mut err: f64 = 0.0;
        for (e, (x, y)) in got.iter().zip(want).enumerate() {
            let a = match &loose {
                Some(l) if l[e] => allowed.max(2.5 * lr),
                _ => allowed,
            };
            err = err.max((x - y).abs() / a);
        }
        if err.is_nan() || err > 1.0 {
            if std::env::var_os("FUSEC_DEBUG_DUMP").is_some() {
                eprintln!(
                    "got  {:?}\nwant {:?}",
                    &got[..got.len().min(64)],
                    &want[..want.len().min(64)]
                );
            }
            let what = match role {
                Role::Grad(i) | Role::NewParam(i) => format!("{role} ({})", g.params[*i].name),
                _ => role.to_string(),
            };
            return Err(format!(
                "{what} differs by {:.2} times its bound ({tol:.0e} of its largest value {largest_value:.3e}, or the noise allowances)",
                err
            ));
        }
        out.worst = out.worst.max(err);
        // The update itself, new minus old: the bound above is of the
        // weight's size, which a missing or sign-flipped update (lr = 1e-3
        // of it) passes. In 16-bit models bf16 rounding flips the sign of
        // many near-zero gradients, whose Adam steps then part by 2 lr (a
        // tensor's update by up to its whole norm, as a missing one would):
        // those entries are the ill-conditioned ones left out below.
        let old = match role {
            Role::NewParam(i) => feeds.params.get(&g.params[*i].name),
            Role::NewState(s) => feeds.state.get(s),
            _ => None,
        };
        let bound = if precision == DType::F32 {
            UPDATE_F32
        } else {
            UPDATE_16
        };
        if let (Some(old), false) = (old, noise) {
            // Ill-conditioned Adam entries are left out. Each run rounds
            // its new weight to f32 (half an ulp, at most 2^-24 |w|, each),
            // so a small step (SGD's, clipped) differs by up to 2^-23 |w| an
            // entry however right both runs are: allowed on top.
            let (mut diff, mut norm, mut rounding) = (0.0f64, 0.0f64, 0.0f64);
            for (e, ((x, y), o)) in got.iter().zip(want).zip(&old.data).enumerate() {
                if loose.as_ref().is_some_and(|l| l[e]) {
                    continue;
                }
                diff += ((x - o) - (y - o)).powi(2);
                norm += (y - o).powi(2);
                rounding += (y.abs().max(o.abs()) * 2f64.powi(-23)).powi(2);
            }
            if norm > 0.0 {
                let rel = ((diff - rounding).max(0.0) / norm).sqrt();
                out.updates = out.updates.max(rel);
                if diff.is_nan() || diff > (bound * bound) * norm + rounding {
                    let role = match role {
                        Role::NewParam(i) => format!("{role} ({})", g.params[*i].name),
                        _ => role.to_string(),
                    };
                    return Err(format!(
                        "{role}: the update differs by {:.3e} of its norm beyond the weights' rounding (bound {bound})",
                        rel
                    ));
                }
            }
        }
    }
    Ok(out)
}
