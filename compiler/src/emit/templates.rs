//! CUDA C for single ops that are not elementwise chains: row-wise
//! normalisations and softmax, the cross-entropy gradient, embedding
//! lookup, sums over leading axes, masking, rotary embedding and the
//! optimizer updates. Each is one clear kernel, specialised for the op's
//! shapes and dtypes, with the same signature convention as the generated
//! pointwise kernels (inputs, outputs, symbolic sizes), and checked against
//! the op's CPU reference by `tests/cuda_host.rs`.
//!
//! Row kernels run one thread block per row (grid-stride over rows) and
//! reduce across the block; element kernels one thread per element.

use super::cuda::{float_lit, header, load, store, NEG_INF};
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::kernel::{Kernel, Program};

use crate::ops::{Op, ReduceKind, NORM_GROUPS};
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

/// How a template kernel is launched.
#[derive(Clone, Debug, PartialEq)]
pub enum Shape {
    /// One thread per element.
    Elements(Dim),
    /// One block per row.
    Rows(Dim),
    /// One block for the whole job (a reduction to a scalar).
    Single,
}

/// The op's inputs and outputs as kernel parameters: `ins[i]` is the kernel
/// input slot of the op's input `i` (the identity for a one-op kernel).
pub(crate) struct Ctx<'a> {
    pub(crate) p: &'a Program,
    pub(crate) k: &'a Kernel,
    pub(crate) ins: Vec<usize>,
    pub(crate) outs: Vec<usize>,
}

impl<'a> Ctx<'a> {
    /// A kernel that is one op: its slots are the op's inputs and outputs
    /// in order.
    pub(crate) fn for_op(g: &Graph, p: &'a Program, k: &'a Kernel, n: NodeIndex) -> Ctx<'a> {
        Ctx {
            p,
            k,
            ins: (0..g.inputs(n).len()).collect(),
            outs: (0..g.g[n].outputs.len()).collect(),
        }
    }

    pub(crate) fn in_dt(&self, i: usize) -> DType {
        self.p.buffers[self.k.inputs[self.ins[i]]].ty.dtype
    }
    pub(crate) fn out_dt(&self, i: usize) -> DType {
        self.p.buffers[self.k.outputs[self.outs[i]]].ty.dtype
    }
    pub(crate) fn ld(&self, i: usize, idx: &str) -> String {
        load(self.in_dt(i), &format!("in{}[{idx}]", self.ins[i]))
    }
    pub(crate) fn st(&self, o: usize, idx: &str, v: &str) -> String {
        format!("out{}[{idx}] = {};", self.outs[o], store(self.out_dt(o), v))
    }
}

/// `v`, plus the kernel's residual input at the same element where it has
/// one (row-major `r * C + j`).
fn with_residual(c: &Ctx, v: String) -> String {
    match c.k.residual {
        Some(slot) => format!(
            "{v} + {}",
            load(
                c.p.buffers[c.k.inputs[slot]].ty.dtype,
                &format!("in{slot}[r * C + j]")
            )
        ),
        None => v,
    }
}

fn numel(d: &[Dim]) -> Dim {
    d.iter()
        .try_fold(Dim::constant(1), |a, x| a.checked_mul(x))
        .unwrap_or_default()
}

/// The row's maximum `m` and `sum` of exp(x - m), the two passes every
/// softmax-like kernel starts with.
fn max_sumexp(b: &mut String, x: &str, indent: &str) {
    let _ = writeln!(b, "{indent}float m = {NEG_INF};");
    let _ = writeln!(
        b,
        "{indent}for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) m = fmaxf(m, {x});"
    );
    let _ = writeln!(b, "{indent}m = fs_block_max(m);\n{indent}float sum = 0.0f;");
    let _ = writeln!(
        b,
        "{indent}for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) sum += expf({x} - m);"
    );
    let _ = writeln!(b, "{indent}sum = fs_block_sum(sum);");
}

/// Mean and reciprocal standard deviation of one row into `mean`, `rstd`;
/// `x` reads the row at loop variable `var`.
fn stats(b: &mut String, x: &str, eps: &str, indent: &str, var: &str) {
    let each = format!("for (fs_i64 {var} = threadIdx.x; {var} < C; {var} += blockDim.x)");
    let _ = writeln!(b, "{indent}float sum = 0.0f;");
    let _ = writeln!(b, "{indent}{each} sum += {x};");
    let _ = writeln!(
        b,
        "{indent}const float mean = fs_block_sum(sum) / (float)C;"
    );
    let _ = writeln!(b, "{indent}float sq = 0.0f;");
    let _ = writeln!(
        b,
        "{indent}{each} {{ const float d = {x} - mean; sq += d * d; }}"
    );
    let _ = writeln!(
        b,
        "{indent}const float rstd = rsqrtf(fs_block_sum(sq) / (float)C + {eps});"
    );
}

/// `name` = 1 / sqrt(mean(x^2) + eps) of one row; `x` reads the row at
/// loop variable `var`.
fn rms(b: &mut String, x: &str, eps: &str, indent: &str, var: &str, name: &str) {
    let _ = writeln!(b, "{indent}float sq = 0.0f;");
    let _ = writeln!(
        b,
        "{indent}for (fs_i64 {var} = threadIdx.x; {var} < C; {var} += blockDim.x) sq += {x} * {x};"
    );
    let _ = writeln!(
        b,
        "{indent}const float {name} = rsqrtf(fs_block_sum(sq) / (float)C + {eps});"
    );
}

/// One row of cross-entropy over logits (input 0) against targets (input
/// 1): the loss into output `loss`, and/or the gradient (softmax -
/// onehot(t)) * dloss[row] (dloss input 2) into output `grad`, the
/// probabilities never stored.
/// The classes of a cross-entropy whose logits `pad-dims` padded.
fn ce_classes(op: &Op) -> Option<i64> {
    match op {
        Op::CrossEntropy(ce) => ce.classes,
        Op::CrossEntropyGrad(ce) => ce.classes,
        Op::CrossEntropyWithGrad(ce) => ce.classes,
        _ => None,
    }
}

/// Elements from one row of a cross-entropy's logits (or gradient) to the
/// next, where that is not its classes `C`: the buffer's pitch (rows padded
/// for the GEMMs around it, kernel::pitch), or the padded row of logits
/// with more columns than classes (pad-dims).
fn ce_row_pitch(c: &Ctx, buf: usize, classes: Option<i64>) -> Option<i64> {
    let b = &c.p.buffers[buf];
    b.pitch.or_else(|| {
        classes?;
        b.ty.shape.last()?.as_const()
    })
}

fn cross_entropy_row(
    b: &mut String,
    c: &Ctx,
    loss: Option<usize>,
    grad: Option<usize>,
    classes: Option<i64>,
) {
    let pitch =
        |buf: usize| ce_row_pitch(c, buf, classes).map_or("C".to_string(), |p| format!("{p}LL"));
    let _ = writeln!(
        b,
        "        const fs_i64 xrow = row * {};",
        pitch(c.k.inputs[c.ins[0]])
    );
    if let Some(o) = grad {
        let _ = writeln!(
            b,
            "        const fs_i64 grow = row * {};",
            pitch(c.k.outputs[c.outs[o]])
        );
    }
    if let (Some(o), Some(v)) = (grad, vector_rows(c, grad)) {
        cross_entropy_row_vector(b, c, loss, o, &v);
        return;
    }
    let x = c.ld(0, "xrow + j");
    max_sumexp(b, &x, "        ");
    let _ = writeln!(b, "        const fs_i64 t = in1[row];");
    if grad.is_some() {
        let _ = writeln!(b, "        const float scale = {};", c.ld(2, "row"));
    }
    if let Some(o) = loss {
        let picked = c.ld(0, "xrow + t");
        let _ = writeln!(
            b,
            "        if (threadIdx.x == 0) {}",
            c.st(
                o,
                "row",
                &format!(
                    "(t >= 0 && t < C) ? m + logf(sum) - {picked} : __int_as_float(0x7fc00000)"
                )
            )
        );
    }
    if let Some(o) = grad {
        if loss.is_some() {
            // Every thread has read its logits of this row (the loss above
            // reads one more) before any overwrites them in place.
            let _ = writeln!(b, "        __syncthreads();");
        }
        let v = format!("(expf({x} - m) / sum - (j == t ? 1.0f : 0.0f)) * scale");
        let _ = writeln!(
            b,
            "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
            c.st(o, "grow + j", &v)
        );
        // Zeros in the padded columns: a GEMM run at the padded k reads
        // them (kernel::pitch::pad_gemm_sizes).
        if let Some(p) = ce_row_pitch(c, c.k.outputs[c.outs[o]], classes) {
            let _ = writeln!(
                b,
                "        for (fs_i64 j = C + threadIdx.x; j < {p}LL; j += blockDim.x) {}",
                c.st(o, "grow + j", "0.0f")
            );
        }
    }
}

/// How a cross-entropy kernel with a gradient reads and writes its rows
/// eight 16-bit values at a time.
struct VectorRows {
    /// `fs_bf16` or `fs_f16`.
    elem: &'static str,
    load: &'static str,
    store: &'static str,
    /// Elements from one gradient row to the next (padding included): the
    /// vector loop writes them all, zeros past the classes.
    out_row: i64,
}

/// The 16-byte path, where both the logits and the gradient are 16-bit
/// with rows a constant multiple of 8 apart (every row then starts 16-byte
/// aligned, and a row's last vector stays inside its padded row).
fn vector_rows(c: &Ctx, grad: Option<usize>) -> Option<VectorRows> {
    let o = grad?;
    let (elem, load, store) = match c.in_dt(0) {
        DType::BF16 => ("fs_bf16", "fs_load_bf16", "fs_to_bf16"),
        DType::F16 => ("fs_f16", "fs_load_f16", "fs_to_f16"),
        _ => return None,
    };
    if c.out_dt(o) != c.in_dt(0) || c.k.input_views.get(c.ins[0]).is_some_and(|v| v.is_some()) {
        return None;
    }
    let row = |buf: usize| -> Option<i64> {
        let b = &c.p.buffers[buf];
        b.pitch
            .or_else(|| b.ty.shape.last()?.as_const())
            .filter(|r| r % 8 == 0)
    };
    let (in_row, out_row) = (row(c.k.inputs[c.ins[0]])?, row(c.k.outputs[c.outs[o]])?);
    (in_row >= out_row).then_some(VectorRows {
        elem,
        load,
        store,
        out_row,
    })
}

/// Cross-entropy with its gradient in two passes over the row instead of
/// three, eight logits per 16-byte load: first the running maximum and
/// sum of exponentials together (the sum rescaled when the maximum grows),
/// then the gradient, stored eight at a time with the padded columns' zeros.
fn cross_entropy_row_vector(
    b: &mut String,
    c: &Ctx,
    loss: Option<usize>,
    o: usize,
    v: &VectorRows,
) {
    let (elem, ld, st) = (v.elem, v.load, v.store);
    let x = format!("in{}", c.ins[0]);
    let _ = write!(
        b,
        "        float m = {NEG_INF}, sum = 0.0f;
        for (fs_i64 j0 = (fs_i64)threadIdx.x * 8; j0 < C; j0 += (fs_i64)blockDim.x * 8) {{
            {elem} v[8];
            fs_vload(v, &{x}[xrow + j0]);
            float x8[8], vm = {NEG_INF};
            for (int e = 0; e < 8; ++e) {{
                x8[e] = j0 + e < C ? {ld}(&v[e]) : {NEG_INF};
                vm = fmaxf(vm, x8[e]);
            }}
            if (vm > m) {{
                sum *= expf(m - vm);
                m = vm;
            }}
            for (int e = 0; e < 8; ++e) sum += expf(x8[e] - m);
        }}
        {{
            const float bm = fs_block_max(m);
            sum = fs_block_sum(m == {NEG_INF} ? 0.0f : sum * expf(m - bm));
            m = bm;
        }}
        const fs_i64 t = in{t}[row];
        const float scale = {scale};
",
        t = c.ins[1],
        scale = c.ld(2, "row")
    );
    if let Some(lo) = loss {
        let picked = c.ld(0, "xrow + t");
        let _ = writeln!(
            b,
            "        if (threadIdx.x == 0) {}
        __syncthreads();",
            c.st(
                lo,
                "row",
                &format!(
                    "(t >= 0 && t < C) ? m + logf(sum) - {picked} : __int_as_float(0x7fc00000)"
                )
            )
        );
    }
    let out = format!("out{}", c.outs[o]);
    let _ = write!(
        b,
        "        const float inv = 1.0f / sum;
        for (fs_i64 j0 = (fs_i64)threadIdx.x * 8; j0 < {row}LL; j0 += (fs_i64)blockDim.x * 8) {{
            {elem} v[8], g[8];
            if (j0 < C) fs_vload(v, &{x}[xrow + j0]);
            for (int e = 0; e < 8; ++e) {{
                const fs_i64 j = j0 + e;
                g[e] = {st}(j < C ? (expf({ld}(&v[e]) - m) * inv - (j == t ? 1.0f : 0.0f)) * scale : 0.0f);
            }}
            fs_vstore(&{out}[grow + j0], g);
        }}
",
        row = v.out_row
    );
}

/// Closes the row loop and opens the parameter-gradient phase of a norm
/// backward: block `grp` owns rows [grp * per, (grp + 1) * per) and walks
/// them in chunks of up to 256, first computing each row's statistics
/// (`stats` declares them, `keep` stores them into the `__shared__` arrays
/// named in `shared`), then summing over the chunk with one thread per
/// feature `j` between `r = c0..c1`. Its partial sums start at zero and
/// accumulate in `out1`/`out2` [NORM_GROUPS, C]; deterministic.
fn row_groups(
    b: &mut String,
    zero: &str,
    keep: &str,
    shared: &[&str],
    stats: &dyn Fn(&mut String),
) {
    let _ = writeln!(b, "    }}");
    let arrays: Vec<String> = shared.iter().map(|n| format!("{n}_s[256]")).collect();
    let _ = writeln!(b, "    __shared__ float {};", arrays.join(", "));
    let _ = writeln!(
        b,
        "    const fs_i64 groups = {NORM_GROUPS}, per = (rows + groups - 1) / groups;"
    );
    let _ = writeln!(
        b,
        "    for (fs_i64 grp = blockIdx.x; grp < groups; grp += gridDim.x) {{"
    );
    let _ = writeln!(
        b,
        "        const fs_i64 g0 = grp * per, g1 = g0 + per < rows ? g0 + per : rows;"
    );
    let _ = writeln!(
        b,
        "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {{ {zero} }}"
    );
    let _ = writeln!(b, "        for (fs_i64 c0 = g0; c0 < g1; c0 += 256) {{");
    let _ = writeln!(
        b,
        "            const fs_i64 c1 = c0 + 256 < g1 ? c0 + 256 : g1;"
    );
    let _ = writeln!(b, "            for (fs_i64 r = c0; r < c1; ++r) {{");
    stats(b);
    let _ = writeln!(b, "                if (threadIdx.x == 0) {{ {keep} }}");
    let _ = writeln!(b, "            }}");
    let _ = writeln!(b, "            __syncthreads();");
}

/// Ends a chunk and the group loop opened by `row_groups`.
fn close_row_groups(b: &mut String) {
    // Every thread is done with the chunk's statistics before the next
    // chunk overwrites them.
    let _ = writeln!(b, "            __syncthreads();");
    let _ = writeln!(b, "        }}");
}

/// Threads per block of every generated kernel.
pub const BLOCK: u64 = 256;

/// Grid size for a launch shape: one block per row, or enough blocks for one
/// thread per element, capped (the loops stride over the rest).
pub fn grid(shape: &Shape, env: &dyn Fn(&str) -> Option<i64>) -> Option<u64> {
    let cap = 1u64 << 20;
    Some(match shape {
        Shape::Rows(r) => (r.eval(env)? as u64).clamp(1, cap),
        Shape::Elements(n) => (n.eval(env)? as u64).div_ceil(BLOCK).clamp(1, cap),
        Shape::Single => 1,
    })
}

/// A concatenation's 16-byte chunks, where it copies in them.
fn concat_chunks(g: &Graph, n: NodeIndex) -> Option<Dim> {
    let vec = super::multi::concat_chunk(g, n)?;
    g.g[n].outputs[0].numel().checked_div(&Dim::constant(vec))
}

/// The kernel's launch shape, for ops that have a template.
pub fn shape_of(g: &Graph, n: NodeIndex) -> Option<Shape> {
    let ins = g.inputs(n);
    let t = |i: usize| g.ty(ins[i]).shape.clone();
    let rows_of = |s: &[Dim]| numel(&s[..s.len().saturating_sub(1)]);
    Some(match &g.g[n].op {
        Op::Softmax(s) if s.axis + 1 == t(0).len() => Shape::Rows(rows_of(&t(0))),
        Op::SoftmaxGrad(s) if s.axis + 1 == t(0).len() => Shape::Rows(rows_of(&t(0))),
        Op::LayerNormGrad(_) | Op::RmsNormGrad(_) if super::norm_rows::applies(g, n).is_some() => {
            Shape::Rows(Dim::constant(crate::ops::NORM_GROUPS as i64))
        }
        Op::LayerNorm(_) | Op::RmsNorm(_) if super::norm_rows::forward_applies(g, n).is_some() => {
            Shape::Rows(Dim::constant(super::norm_rows::FORWARD_BLOCKS))
        }
        Op::LayerNorm(_)
        | Op::RmsNorm(_)
        | Op::CrossEntropy(_)
        | Op::CrossEntropyGrad(_)
        | Op::CrossEntropyWithGrad(_)
        | Op::LayerNormGrad(_)
        | Op::RmsNormGrad(_) => Shape::Rows(rows_of(&t(0))),
        // Groups of table rows with their sums in shared memory, times
        // runs of the tokens (emit/embedding_grad.rs).
        Op::EmbeddingGrad(_) if super::embedding_grad::blocks(g, n).is_some() => {
            Shape::Rows(super::embedding_grad::blocks(g, n)?)
        }
        Op::Embedding(_) | Op::CausalMask(_) => Shape::Elements(g.g[n].outputs[0].numel()),
        // A thread per rotated pair (i, i + D/2).
        Op::Rope(_) => Shape::Elements(g.g[n].outputs[0].numel().checked_div(&Dim::constant(2))?),
        Op::AdamW(_) | Op::Sgd(_) | Op::Cast(_) => match update_range(&g.g[n].op) {
            Some((lo, hi)) => Shape::Elements(Dim::constant(hi - lo)),
            None => Shape::Elements(g.g[n].outputs[0].numel()),
        },
        Op::Reduce(_) if super::multi::column_tiles(g, n).is_some() => {
            return super::multi::shape_of(g, n)
        }
        // One run of adjacent axes (leading, or between kept ones: a mean
        // over the sequence of [B, T, C]): a loop per output element.
        Op::Reduce(r) if !r.axes.is_empty() && r.axes.windows(2).all(|w| w[1] == w[0] + 1) => {
            Shape::Elements(g.g[n].outputs[0].numel())
        }
        // A thread per 16-byte chunk where the parts allow (multi::concat_body;
        // the element loop strides over the rest).
        Op::Concat(_) if concat_chunks(g, n).is_some() => Shape::Elements(concat_chunks(g, n)?),
        Op::SliceGrad(_) | Op::Concat(_) | Op::ClipCoef(_) | Op::Unscale(_) => {
            Shape::Elements(g.g[n].outputs[0].numel())
        }
        _ => {
            return super::attention::shape_of(g, n)
                .or_else(|| super::conv::shape_of(g, n))
                .or_else(|| super::multi::shape_of(g, n))
        }
    })
}

/// A ZeRO update not in place: the parameter's elements outside the piece
/// copied through, by the thread of the piece's first element (the plan
/// always updates in place, where this does nothing).
fn pass_through(b: &mut String, c: &Ctx, g: &Graph, n: NodeIndex, range: Option<(i64, i64)>) {
    if let Some((lo, hi)) = range {
        let total = g.g[n].outputs[0].numel().to_c();
        let (o, x) = (c.outs[0], c.ins[0]);
        let _ = writeln!(
            b,
            "        if (i == 0 && (const void*)out{o} != (const void*)in{x}) {{ for (fs_i64 k = 0; k < {lo}LL; ++k) out{o}[k] = in{x}[k]; for (fs_i64 k = {hi}LL; k < {total}; ++k) out{o}[k] = in{x}[k]; }}"
        );
    }
}

/// The piece of its parameter a ZeRO update runs on (`None`: all of it).
pub(crate) fn update_range(op: &Op) -> Option<(i64, i64)> {
    match op {
        Op::AdamW(a) => a.range,
        Op::Sgd(s) => s.range,
        _ => None,
    }
}

pub fn op_kernel(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    n: NodeIndex,
    source: Option<&str>,
) -> Option<String> {
    let c = Ctx::for_op(g, p, k, n);
    let mut s = header(g, p, k, source);
    // Device-global storage some templates keep between their blocks goes
    // before the kernel (after the prelude's include).
    if let Some(decls) =
        super::multi::file_scope(g, &c, n).or_else(|| super::embedding_grad::file_scope(g, &c, n))
    {
        let at = s.find("extern \"C\"")?;
        s.insert_str(at, &decls);
    }
    // Attention, convolution and multi-tensor kernels have their own loop
    // structure.
    let body = super::attention::kernel_body(g, &c, n)
        .or_else(|| super::conv::kernel_body(g, &c, n))
        .or_else(|| super::multi::kernel_body(g, &c, n))
        .or_else(|| super::multi::concat_body(g, &c, n))
        .or_else(|| super::embedding_grad::kernel_body(g, &c, n))
        .or_else(|| super::norm_rows::kernel_body(g, &c, n))
        .or_else(|| super::norm_rows::forward_body(g, &c, n));
    let body = match body {
        Some(b) => b,
        None => op_loop(g, &c, n)?,
    };
    s.push_str(&body);
    s.push_str("}\n");
    Some(s)
}

/// The body of one op's loop: over `row` (with `C` its length) for row
/// ops, over element `i` for element ops; `op_loop` closes it in its loop,
/// and a group kernel runs it over each chunk of a member.
pub(crate) fn op_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let ins = g.inputs(n);
    let in_shape = |i: usize| g.ty(ins[i]).shape.clone();
    let last = |s: &[Dim]| s.last().cloned().unwrap_or(Dim::constant(1));
    let mut body = String::new();
    let b = &mut body;
    match &g.g[n].op {
        Op::Softmax(_) => {
            let x = |j: &str| c.ld(0, &format!("row * C + {j}"));
            max_sumexp(b, &x("j"), "        ");
            let _ = writeln!(
                b,
                "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
                c.st(0, "row * C + j", &format!("expf({} - m) / sum", x("j")))
            );
        }
        Op::SoftmaxGrad(_) => {
            let (y, dy) = (c.ld(0, "row * C + j"), c.ld(1, "row * C + j"));
            let _ = writeln!(b, "        float dot = 0.0f;");
            let _ = writeln!(
                b,
                "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) dot += {y} * {dy};"
            );
            let _ = writeln!(b, "        dot = fs_block_sum(dot);");
            let _ = writeln!(
                b,
                "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
                c.st(0, "row * C + j", &format!("{y} * ({dy} - dot)"))
            );
        }
        Op::LayerNorm(ln) => {
            let x = c.ld(0, "row * C + j");
            stats(b, &x, &float_lit(ln.eps), "        ", "j");
            let v = format!("({x} - mean) * rstd * {} + {}", c.ld(1, "j"), c.ld(2, "j"));
            let _ = writeln!(
                b,
                "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
                c.st(0, "row * C + j", &v)
            );
        }
        Op::RmsNorm(rn) => {
            let x = c.ld(0, "row * C + j");
            rms(b, &x, &float_lit(rn.eps), "        ", "j", "r");
            let v = format!("{x} * r * {}", c.ld(1, "j"));
            let _ = writeln!(
                b,
                "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
                c.st(0, "row * C + j", &v)
            );
        }
        Op::CrossEntropyGrad(ce) => cross_entropy_row(b, c, None, Some(0), ce.classes),
        Op::Embedding(_) => {
            let (v, cc) = (in_shape(0)[0].to_c(), last(&in_shape(0)).to_c());
            let _ = writeln!(
                b,
                "        const fs_i64 C = {cc}, r = i / C, j = i % C, idx = in1[r];"
            );
            let _ = writeln!(
                b,
                "        // An index outside the table gives NaN, as the reference does."
            );
            let val = format!(
                "(idx >= 0 && idx < {v}) ? {} : __int_as_float(0x7fc00000)",
                c.ld(0, "idx * C + j")
            );
            let _ = writeln!(b, "        {}", c.st(0, "i", &val));
        }
        Op::CausalMask(m) => {
            let sh = in_shape(0);
            let (t, sz) = (sh[sh.len() - 2].to_c(), sh[sh.len() - 1].to_c());
            let _ = writeln!(
                b,
                "        const fs_i64 col = i % {sz}, q = (i / {sz}) % {t};"
            );
            let val = format!("col > q ? {} : {}", float_lit(m.fill), c.ld(0, "i"));
            let _ = writeln!(b, "        {}", c.st(0, "i", &val));
        }
        Op::Rope(r) => {
            // One thread per pair: one angle, one sine and cosine for both
            // of its elements (a thread per element computed them twice,
            // with powf, and ran at a tenth of the memory bandwidth).
            let sh = in_shape(0);
            let rk = sh.len();
            let (t, h, d) = (sh[rk - 3].to_c(), sh[rk - 2].to_c(), sh[rk - 1].to_c());
            let _ = writeln!(b, "        const fs_i64 D = {d}, half = D / 2, pair = i / half, f = i % half, pos = (pair / {h}) % {t}, lo_at = pair * D + f;");
            // theta^(-2f/D) as exp2(-2f/D * log2(theta)).
            let _ = writeln!(
                b,
                "        const float angle = (float)pos * exp2f(-2.0f * (float)f / (float)D * {});",
                float_lit(r.theta.log2())
            );
            let _ = writeln!(
                b,
                "        float sn, cs;\n        sincosf(angle, &sn, &cs);"
            );
            if r.inverse {
                // The gradient rotates the other way.
                let _ = writeln!(b, "        sn = -sn;");
            }
            let lo = c.ld(0, "lo_at");
            let hi = c.ld(0, "lo_at + half");
            let _ = writeln!(b, "        const float lo = {lo}, hi = {hi};");
            let _ = writeln!(b, "        {}", c.st(0, "lo_at", "lo * cs - hi * sn"));
            let _ = writeln!(
                b,
                "        {}",
                c.st(0, "lo_at + half", "lo * sn + hi * cs")
            );
        }
        Op::Reduce(r) => {
            // Sum over the adjacent axes a0..a1 of the input, seen as
            // [outer, rows, inner]: output element i is (i / inner, i % inner).
            let sh = in_shape(0);
            let (a0, a1) = (r.axes[0], r.axes[r.axes.len() - 1] + 1);
            let rows = numel(&sh[a0..a1]);
            let inner = numel(&sh[a1..]);
            let _ = writeln!(
                b,
                "        const fs_i64 rows = {}, inner = {};\n        const fs_i64 base = (i / inner) * rows * inner + i % inner;\n        float acc = 0.0f;",
                rows.to_c(),
                inner.to_c()
            );
            let _ = writeln!(
                b,
                "        for (fs_i64 r = 0; r < rows; ++r) acc += {};",
                c.ld(0, "base + r * inner")
            );
            let v = if r.kind == ReduceKind::Mean {
                "acc / (float)rows"
            } else {
                "acc"
            };
            let _ = writeln!(b, "        {}", c.st(0, "i", v));
        }
        Op::AdamW(a) => {
            // The parameter's element: `i` itself, or past the start of
            // this rank's piece (ZeRO; the state holds the piece alone).
            let pi = a
                .range
                .map_or("i".to_string(), |(lo, _)| format!("{lo}LL + i"));
            let pi = pi.as_str();
            pass_through(b, c, g, n, a.range);
            if g.inputs(n).len() == 8 {
                // A micro-batch that only accumulates: the state stays.
                let _ = writeln!(
                    b,
                    "        if ({} == 0.0f) {{ {} {} {} continue; }}",
                    c.ld(7, "0"),
                    c.st(0, pi, &c.ld(0, pi)),
                    c.st(1, "i", &c.ld(2, "i")),
                    c.st(2, "i", &c.ld(3, "i"))
                );
            }
            let _ = writeln!(
                b,
                "        const float g = {} * {}, lr = {}, t = {};",
                c.ld(1, pi),
                c.ld(6, "0"),
                c.ld(4, "0"),
                c.ld(5, "0")
            );
            let _ = writeln!(
                b,
                "        const float m = {} * {} + {} * g;",
                float_lit(a.beta1),
                c.ld(2, "i"),
                float_lit(1.0 - a.beta1)
            );
            let _ = writeln!(
                b,
                "        const float v = {} * {} + {} * g * g;",
                float_lit(a.beta2),
                c.ld(3, "i"),
                float_lit(1.0 - a.beta2)
            );
            // The bias corrections 1 - beta^t as -expm1(t * log1p(-(1 - beta))),
            // the logarithm worked out here in f64: 1 - powf(0.999f, t) in
            // f32 is off by about 1e-5 relative (0.999f is not 0.999, and the
            // subtraction cancels most digits), the same way at every step
            // and in every parameter: a steady drift from an f64 run, not
            // rounding noise. This form is within 1.5e-7 (tests/cuda_host.rs).
            let log1p_neg = |beta: f64| (-(1.0 - beta)).ln_1p();
            let _ = writeln!(
                b,
                "        const float bc1 = -expm1f(t * {}), bc2 = -expm1f(t * {});",
                float_lit(log1p_neg(a.beta1)),
                float_lit(log1p_neg(a.beta2))
            );
            let _ = writeln!(
                b,
                "        const float p = {} * (1.0f - lr * {}) - lr * (m / bc1) / (sqrtf(v / bc2) + {});",
                c.ld(0, pi),
                float_lit(a.weight_decay),
                float_lit(a.eps)
            );
            let _ = writeln!(
                b,
                "        {}\n        {}\n        {}",
                c.st(0, pi, "p"),
                c.st(1, "i", "m"),
                c.st(2, "i", "v")
            );
        }
        Op::Sgd(o) => {
            let pi = o
                .range
                .map_or("i".to_string(), |(lo, _)| format!("{lo}LL + i"));
            let pi = pi.as_str();
            pass_through(b, c, g, n, o.range);
            if g.inputs(n).len() == 6 {
                let _ = writeln!(
                    b,
                    "        if ({} == 0.0f) {{ {} {} continue; }}",
                    c.ld(5, "0"),
                    c.st(0, pi, &c.ld(0, pi)),
                    c.st(1, "i", &c.ld(2, "i"))
                );
            }
            let _ = writeln!(
                b,
                "        const float p = {}, lr = {};",
                c.ld(0, pi),
                c.ld(3, "0")
            );
            let _ = writeln!(
                b,
                "        const float buf = {} * {} + {} * {} + {} * p;",
                float_lit(o.momentum),
                c.ld(2, "i"),
                c.ld(1, pi),
                c.ld(4, "0"),
                float_lit(o.weight_decay)
            );
            let _ = writeln!(
                b,
                "        {}\n        {}",
                c.st(0, pi, "p - lr * buf"),
                c.st(1, "i", "buf")
            );
        }
        Op::LayerNormGrad(ln) => {
            // Rows: dx. Then column tiles: dgamma and dbeta, each row's
            // statistics recomputed by the block.
            let eps = float_lit(ln.eps);
            let x = c.ld(0, "r * C + j");
            let dy = c.ld(2, "r * C + j");
            let g = c.ld(1, "j");
            let _ = writeln!(b, "        const fs_i64 r = row;");
            stats(b, &x, &eps, "        ", "j");
            let _ = writeln!(b, "        float m1 = 0.0f, m2 = 0.0f;");
            let _ = writeln!(b, "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {{ const float d = {dy} * {g}; m1 += d; m2 += d * ({x} - mean) * rstd; }}");
            let _ = writeln!(b, "        m1 = fs_block_sum(m1) / (float)C;");
            let _ = writeln!(b, "        m2 = fs_block_sum(m2) / (float)C;");
            let v = with_residual(
                c,
                format!("rstd * ({dy} * {g} - m1 - ({x} - mean) * rstd * m2)"),
            );
            let _ = writeln!(
                b,
                "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
                c.st(0, "r * C + j", &v)
            );
            // Then the parameter gradients by row groups: each block sums
            // its group's rows into one f32 partial per feature.
            let zero = "out1[grp * C + j] = 0.0f; out2[grp * C + j] = 0.0f;";
            row_groups(
                b,
                zero,
                "mean_s[r - c0] = mean; rstd_s[r - c0] = rstd;",
                &["mean", "rstd"],
                &|b| {
                    stats(b, &c.ld(0, "r * C + jj"), &eps, "                ", "jj");
                },
            );
            let _ = writeln!(
                b,
                "            for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {{"
            );
            let _ = writeln!(b, "                float dg = 0.0f, db = 0.0f;");
            let _ = writeln!(b, "                for (fs_i64 r = c0; r < c1; ++r) {{ const float d = {dy}; dg += d * ({x} - mean_s[r - c0]) * rstd_s[r - c0]; db += d; }}");
            let _ = writeln!(
                b,
                "                out1[grp * C + j] += dg; out2[grp * C + j] += db;"
            );
            let _ = writeln!(b, "            }}");
            close_row_groups(b);
        }
        Op::RmsNormGrad(rn) => {
            let eps = float_lit(rn.eps);
            let x = c.ld(0, "r * C + j");
            let dy = c.ld(2, "r * C + j");
            let g = c.ld(1, "j");
            let _ = writeln!(b, "        const fs_i64 r = row;");
            let _ = writeln!(b, "        float sq = 0.0f, dot = 0.0f;");
            let _ = writeln!(b, "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {{ const float v = {x}; sq += v * v; dot += {dy} * {g} * v; }}");
            let _ = writeln!(
                b,
                "        const float rs = rsqrtf(fs_block_sum(sq) / (float)C + {eps});"
            );
            let _ = writeln!(b, "        dot = fs_block_sum(dot) / (float)C;");
            let v = with_residual(c, format!("{dy} * {g} * rs - {x} * rs * rs * rs * dot"));
            let _ = writeln!(
                b,
                "        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {}",
                c.st(0, "r * C + j", &v)
            );
            row_groups(
                b,
                "out1[grp * C + j] = 0.0f;",
                "rs_s[r - c0] = rs;",
                &["rs"],
                &|b| {
                    rms(
                        b,
                        &c.ld(0, "r * C + jj"),
                        &eps,
                        "                ",
                        "jj",
                        "rs",
                    )
                },
            );
            let _ = writeln!(
                b,
                "            for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {{"
            );
            let _ = writeln!(b, "                float dg = 0.0f;");
            let _ = writeln!(
                b,
                "                for (fs_i64 r = c0; r < c1; ++r) dg += {dy} * {x} * rs_s[r - c0];"
            );
            let _ = writeln!(b, "                out1[grp * C + j] += dg;");
            let _ = writeln!(b, "            }}");
            close_row_groups(b);
        }
        Op::SliceGrad(sg) => {
            let out = &g.g[n].outputs[0].shape;
            let inner = numel(&out[sg.axis + 1..]).to_c();
            let len = in_shape(0)[sg.axis].to_c();
            let _ = writeln!(
                b,
                "        const fs_i64 inner = {inner}, full = {}, len = {len}, start = {};",
                sg.full.to_c(),
                sg.start.to_c()
            );
            let _ = writeln!(b, "        const fs_i64 a = (i / inner) % full, outer = i / (inner * full), j = i % inner;");
            let val = format!(
                "(a >= start && a < start + len) ? {} : 0.0f",
                c.ld(0, "(outer * len + a - start) * inner + j")
            );
            let _ = writeln!(b, "        {}", c.st(0, "i", &val));
        }
        Op::Concat(cat) => {
            let out = &g.g[n].outputs[0].shape;
            let inner = numel(&out[cat.axis + 1..]).to_c();
            let _ = writeln!(
                b,
                "        const fs_i64 inner = {inner}, total = {};",
                out[cat.axis].to_c()
            );
            let _ = writeln!(b, "        const fs_i64 a = (i / inner) % total, outer = i / (inner * total), j = i % inner;");
            let mut start = Dim::constant(0);
            let _ = writeln!(b, "        float v;");
            for (k, x) in ins.iter().enumerate() {
                let len = g.ty(*x).shape[cat.axis].clone();
                let end = start.checked_add(&len).unwrap_or_default();
                let idx = format!(
                    "(outer * {} + a - {}) * inner + j",
                    len.to_c(),
                    start.to_c()
                );
                let cond = if k + 1 == ins.len() {
                    "else".to_string()
                } else {
                    format!(
                        "{}if (a < {})",
                        if k == 0 { "" } else { "else " },
                        end.to_c()
                    )
                };
                let _ = writeln!(b, "        {cond} v = {};", c.ld(k, &idx));
                start = end;
            }
            let _ = writeln!(b, "        {}", c.st(0, "i", "v"));
        }
        // Casts run here only as members of a group kernel (the master
        // weights to the compute dtype); elsewhere they fuse into chains.
        Op::Cast(_) => {
            let _ = writeln!(b, "        {}", c.st(0, "i", &c.ld(0, "i")));
        }
        Op::Unscale(u) => {
            // fp16: the true norm, the clip coefficient over the loss
            // scale, and whether the step applies (no overflow).
            let _ = writeln!(
                b,
                "        const float sumsq = {}, scale = {};",
                c.ld(0, "0"),
                c.ld(1, "0")
            );
            let _ = writeln!(
                b,
                "        const float norm = sqrtf(sumsq) / scale;\n        const bool finite = fs_isfinite(sumsq);"
            );
            let coef = match u.max_norm {
                Some(m) => format!(
                    "(finite ? fminf(1.0f, {} / (norm + 1e-6f)) : 1.0f)",
                    float_lit(m)
                ),
                None => "1.0f".to_string(),
            };
            let _ = writeln!(b, "        {}", c.st(0, "i", &format!("{coef} / scale")));
            let _ = writeln!(
                b,
                "        {}",
                c.st(1, "i", &format!("finite ? {} : 0.0f", c.ld(2, "0")))
            );
            let _ = writeln!(b, "        {}", c.st(2, "i", "norm"));
        }
        Op::ClipCoef(cc) => {
            let _ = writeln!(b, "        const float norm = sqrtf({});", c.ld(0, "0"));
            let _ = writeln!(
                b,
                "        {}",
                c.st(
                    0,
                    "i",
                    &format!("fminf(1.0f, {} / (norm + 1e-6f))", float_lit(cc.max_norm))
                )
            );
        }
        // One pass over the logits: the row's loss and its gradient.
        Op::CrossEntropyWithGrad(ce) => cross_entropy_row(b, c, Some(1), Some(0), ce.classes),
        // logsumexp(row) - row[target]; NaN for a target outside the row.
        Op::CrossEntropy(ce) => cross_entropy_row(b, c, Some(0), None, ce.classes),
        _ => return None,
    }
    Some(body)
}

/// The loop (rows or elements) and body of one op, closed.
pub(crate) fn op_loop(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let shape = shape_of(g, n)?;
    let body = op_body(g, c, n)?;
    let in_shape = |i: usize| g.ty(g.inputs(n)[i]).shape.clone();
    let last = |s: &[Dim]| s.last().cloned().unwrap_or(Dim::constant(1));
    let mut s = String::new();
    match shape {
        Shape::Rows(rows) => {
            let _ = writeln!(s, "    const fs_i64 rows = {};", rows.to_c());
            // A cross-entropy over padded logits counts its classes only.
            let cols = ce_classes(&g.g[n].op).map_or_else(|| last(&in_shape(0)), Dim::constant);
            let _ = writeln!(s, "    const fs_i64 C = {};", cols.to_c());
            let _ = writeln!(
                s,
                "    for (fs_i64 row = blockIdx.x; row < rows; row += gridDim.x) {{"
            );
        }
        Shape::Single => {
            let _ = writeln!(s, "    if (blockIdx.x == 0) {{");
        }
        Shape::Elements(n) => {
            let _ = writeln!(s, "    const fs_i64 n = {};", n.to_c());
            let _ = writeln!(
                s,
                "    for (fs_i64 i = (fs_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (fs_i64)gridDim.x * blockDim.x) {{"
            );
        }
    }
    s.push_str(&body);
    s.push_str("    }\n");
    Some(s)
}
