//! CUDA C for pointwise kernels: one thread per element in a grid-stride
//! loop, loads through their views, arithmetic in f32, one store per
//! output. The text is deterministic (it depends only on the graph) and
//! names the ops it holds and where the model file wrote them.

use super::PRELUDE_NAME;
use crate::ir::print::line_col;
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::kernel::view::View;
use crate::kernel::{Body, Kernel, PExpr, Pointwise, Program};
use crate::ops::{BinaryKind, UnaryKind};
use std::fmt::Write;

/// The C type a buffer of `dt` has in generated code.
pub fn c_type(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "float",
        DType::BF16 => "fs_bf16",
        DType::F16 => "fs_f16",
        DType::I32 => "int",
    }
}

pub(crate) fn load(dt: DType, ptr: &str) -> String {
    match dt {
        DType::F32 | DType::I32 => format!("fs_load(&{ptr})"),
        DType::BF16 => format!("fs_load_bf16(&{ptr})"),
        DType::F16 => format!("fs_load_f16(&{ptr})"),
    }
}

/// -infinity as C (no header defines INFINITY for NVRTC here).
pub(crate) const NEG_INF: &str = "(-__int_as_float(0x7f800000))";

pub(crate) fn store(dt: DType, v: &str) -> String {
    match dt {
        DType::F32 => v.to_string(),
        DType::BF16 => format!("fs_to_bf16({v})"),
        DType::F16 => format!("fs_to_f16({v})"),
        DType::I32 => format!("(int){v}"),
    }
}

pub(crate) fn float_lit(x: f64) -> String {
    let f = x as f32;
    if f.is_infinite() {
        return if f > 0.0 {
            "__int_as_float(0x7f800000)".into()
        } else {
            "__int_as_float(0xff800000)".into()
        };
    }
    if f.is_nan() {
        return "__int_as_float(0x7fc00000)".into();
    }
    format!("{f:?}f")
}

/// The buffer offset a load reads for element `i` (of `view.shape`).
fn index(view: &View) -> String {
    if view.is_contiguous() {
        return "i".into();
    }
    let r = view.shape.len();
    let mut terms: Vec<String> = Vec::new();
    let mut inner = Dim::constant(1);
    for k in (0..r).rev() {
        let stride = &view.strides[k];
        if stride.as_const() != Some(0) && !view.shape[k].is_one() {
            let coord = match (k == 0, inner.is_one()) {
                (true, true) => "i".to_string(),
                (true, false) => format!("(i / {})", inner.to_c()),
                (false, true) => format!("(i % {})", view.shape[k].to_c()),
                (false, false) => format!("((i / {}) % {})", inner.to_c(), view.shape[k].to_c()),
            };
            terms.push(if stride.is_one() {
                coord
            } else {
                format!("{coord} * {}", stride.to_c())
            });
        }
        inner = inner.checked_mul(&view.shape[k]).unwrap_or_default();
    }
    if view.offset.as_const() != Some(0) {
        terms.push(view.offset.to_c());
    }
    if terms.is_empty() {
        "0".into()
    } else {
        terms.reverse();
        terms.join(" + ")
    }
}

fn unary(k: UnaryKind, x: &str) -> String {
    match k {
        UnaryKind::Neg => format!("-{x}"),
        UnaryKind::Exp => format!("expf({x})"),
        UnaryKind::Log => format!("logf({x})"),
        UnaryKind::Sqrt => format!("sqrtf({x})"),
        UnaryKind::Rsqrt => format!("rsqrtf({x})"),
        UnaryKind::Tanh => format!("tanhf({x})"),
        UnaryKind::Sigmoid => format!("fs_sigmoid({x})"),
        UnaryKind::Gelu => format!("fs_gelu({x})"),
        UnaryKind::Relu => format!("fmaxf({x}, 0.0f)"),
        UnaryKind::Silu => format!("fs_silu({x})"),
    }
}

fn unary_grad(k: UnaryKind, x: &str, dy: &str) -> String {
    match k {
        UnaryKind::Neg => format!("-{dy}"),
        UnaryKind::Exp => format!("expf({x}) * {dy}"),
        UnaryKind::Log => format!("{dy} / {x}"),
        UnaryKind::Sqrt => format!("0.5f * rsqrtf({x}) * {dy}"),
        UnaryKind::Rsqrt => format!("-0.5f * rsqrtf({x}) / {x} * {dy}"),
        UnaryKind::Tanh => format!("(1.0f - tanhf({x}) * tanhf({x})) * {dy}"),
        UnaryKind::Sigmoid => format!("fs_sigmoid({x}) * (1.0f - fs_sigmoid({x})) * {dy}"),
        UnaryKind::Gelu => format!("fs_gelu_grad({x}) * {dy}"),
        UnaryKind::Relu => format!("({x} > 0.0f ? {dy} : 0.0f)"),
        UnaryKind::Silu => format!("fs_silu_grad({x}) * {dy}"),
    }
}

fn binary(k: BinaryKind, a: &str, b: &str) -> String {
    match k {
        BinaryKind::KeepIf => format!("({b} != 0.0f ? {a} : 0.0f)"),
        _ => format!("{a} {} {b}", k.symbol()),
    }
}

/// CUDA C for every kernel the emitter generates (pointwise chains and the
/// ops with a template; GEMMs and the rest are library calls or to come),
/// as (kernel name, source).
pub fn emit_program(g: &Graph, p: &Program, source: Option<&str>) -> Vec<(String, String)> {
    p.kernels
        .iter()
        .filter(|k| !crate::kernel::buckets::is_collective(g, k))
        .filter_map(|k| match &k.body {
            Body::Pointwise(pw) => Some((k.name.clone(), pointwise(g, p, k, pw, source))),
            Body::Op(n) => {
                super::templates::op_kernel(g, p, k, *n, source).map(|text| (k.name.clone(), text))
            }
            Body::Group(members) => super::group::group_kernel(g, p, k, members, source)
                .map(|text| (k.name.clone(), text)),
            // cuBLASLt, with its epilogue.
            Body::Gemm(..) => None,
        })
        .collect()
}

/// The comment naming the ops, the prelude include and the signature:
/// inputs, then outputs, then every symbolic size; ends after the `{`.
/// No `__restrict__`: the memory plan may place an output over an input
/// (optimizer updates in place, results over dead operands).
pub(crate) fn header(g: &Graph, p: &Program, k: &Kernel, source: Option<&str>) -> String {
    let mut s = header_comment(g, k, &k.name, source);
    let _ = writeln!(s, "#include \"{PRELUDE_NAME}\"\n");
    s.push_str(&signature(g, p, k, &k.name, None, &[]));
    s
}

/// The first lines of a kernel's source: `name` and the ops of `k`, each
/// with where the model file wrote it.
pub(crate) fn header_comment(g: &Graph, k: &Kernel, name: &str, source: Option<&str>) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "// {name}: generated by fusec; do not edit.");
    for &n in &k.nodes {
        let node = &g.g[n];
        let at = match (source, node.span) {
            (Some(src), Some(span)) => {
                let (l, c) = line_col(src, span.start);
                format!(" @{l}:{c}")
            }
            _ => String::new(),
        };
        let _ = writeln!(s, "//   {} {}{at}", node.op.name(), node.outputs[0]);
    }
    s
}

/// `extern "C" __global__ void [__launch_bounds__(bounds)] name(...)` with
/// `k`'s buffers (inputs, then outputs), every symbolic size, then `extra`
/// parameters (each written with its leading comma); ends after the `{`.
pub(crate) fn signature(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    name: &str,
    bounds: Option<&str>,
    extra: &[String],
) -> String {
    let mut params: Vec<String> = Vec::new();
    for (slot, &b) in k.inputs.iter().enumerate() {
        params.push(format!(
            "const {}* in{slot} /* {} */",
            c_type(p.buffers[b].ty.dtype),
            p.buffers[b].ty
        ));
    }
    for (slot, &b) in k.outputs.iter().enumerate() {
        params.push(format!(
            "{}* out{slot} /* {} */",
            c_type(p.buffers[b].ty.dtype),
            p.buffers[b].ty
        ));
    }
    for d in &g.dims {
        params.push(format!("fs_i64 dim_{d}"));
    }
    let bounds = bounds.map_or(String::new(), |b| format!("__launch_bounds__({b}) "));
    format!(
        "extern \"C\" __global__ void {bounds}{name}(\n    {}{})\n{{\n",
        params.join(",\n    "),
        extra.concat()
    )
}

fn pointwise(g: &Graph, p: &Program, k: &Kernel, pw: &Pointwise, source: Option<&str>) -> String {
    let mut s = header(g, p, k, source);
    let _ = writeln!(s, "    const fs_i64 n = {};", pw.n.to_c());
    let out_dt = |slot: usize| p.buffers[k.outputs[slot]].ty.dtype;
    let grid_stride = "i += (fs_i64)gridDim.x * blockDim.x";
    let first = "(fs_i64)blockIdx.x * blockDim.x + threadIdx.x";
    // An integer copy moves the bits: no trip through f32.
    if let ([PExpr::Load { input, view }], [(slot, 0)]) = (&pw.exprs[..], &pw.stores[..]) {
        if out_dt(*slot) == DType::I32 {
            let _ = writeln!(
                s,
                "    for (fs_i64 i = {first}; i < n; {grid_stride}) {{\n        out{slot}[i] = in{input}[{}];\n    }}\n}}",
                index(view)
            );
            return s;
        }
    }
    let in_dt = |input: usize| p.buffers[k.inputs[input]].ty.dtype;
    // Inputs read contiguously (element i of the buffer for element i).
    let mut vector_inputs: Vec<usize> = Vec::new();
    for e in &pw.exprs {
        if let PExpr::Load { input, view } = e {
            if view.is_contiguous() && !vector_inputs.contains(input) {
                vector_inputs.push(*input);
            }
        }
    }
    let vec = vector_width(p, k, pw);
    let _ = writeln!(
        s,
        "    // {vec} elements per thread in 16-byte loads and stores, then the tail one by one."
    );
    let _ = writeln!(s, "    const fs_i64 nv = n / {vec};");
    let _ = writeln!(
        s,
        "    for (fs_i64 w = {first}; w < nv; w += (fs_i64)gridDim.x * blockDim.x) {{"
    );
    let _ = writeln!(s, "        const fs_i64 i0 = w * {vec};");
    for &input in &vector_inputs {
        let _ = writeln!(
            s,
            "        alignas(16) {} l{input}[{vec}];\n        fs_vload(l{input}, &in{input}[i0]);",
            c_type(in_dt(input))
        );
    }
    for (slot, _) in pw.stores.iter() {
        let _ = writeln!(
            s,
            "        alignas(16) {} s{slot}[{vec}];",
            c_type(out_dt(*slot))
        );
    }
    let _ = writeln!(
        s,
        "#pragma unroll\n        for (int e = 0; e < {vec}; ++e) {{"
    );
    let strided = pw
        .exprs
        .iter()
        .any(|e| matches!(e, PExpr::Load { view, .. } if !view.is_contiguous()));
    if strided {
        let _ = writeln!(s, "            const fs_i64 i = i0 + e;");
    }
    let body = element_body(p, k, pw, "            ", &|input, view| {
        if view.is_contiguous() {
            format!("l{input}[e]")
        } else {
            format!("in{input}[{}]", index(view))
        }
    });
    s.push_str(&body);
    for &(slot, e) in &pw.stores {
        let _ = writeln!(
            s,
            "            s{slot}[e] = {};",
            store(out_dt(slot), &format!("v{e}"))
        );
    }
    let _ = writeln!(s, "        }}");
    for (slot, _) in pw.stores.iter() {
        let _ = writeln!(s, "        fs_vstore(&out{slot}[i0], s{slot});");
    }
    let _ = writeln!(s, "    }}");
    let _ = writeln!(
        s,
        "    for (fs_i64 i = nv * {vec} + {first}; i < n; {grid_stride}) {{"
    );
    let body = element_body(p, k, pw, "        ", &|input, view| {
        format!("in{input}[{}]", index(view))
    });
    s.push_str(&body);
    for &(slot, e) in &pw.stores {
        let _ = writeln!(
            s,
            "        out{slot}[i] = {};",
            store(out_dt(slot), &format!("v{e}"))
        );
    }
    let _ = writeln!(s, "    }}\n}}");
    s
}

/// Elements each thread of a pointwise kernel computes per iteration: 16
/// bytes of the narrowest contiguous access (8 for bf16, 4 for f32).
pub fn vector_width(p: &Program, k: &Kernel, pw: &Pointwise) -> u64 {
    let narrowest = pw
        .exprs
        .iter()
        .filter_map(|e| match e {
            PExpr::Load { input, view } if view.is_contiguous() => {
                Some(p.buffers[k.inputs[*input]].ty.dtype)
            }
            _ => None,
        })
        .chain(
            pw.stores
                .iter()
                .map(|&(slot, _)| p.buffers[k.outputs[slot]].ty.dtype),
        )
        .map(|dt| dt.size_bytes())
        .min()
        .unwrap_or(4);
    16 / narrowest.clamp(1, 16) as u64
}

/// The expressions of one element as `const float vJ = ...;` lines; `at`
/// gives the C lvalue a load reads.
fn element_body(
    p: &Program,
    k: &Kernel,
    pw: &Pointwise,
    indent: &str,
    at: &dyn Fn(usize, &View) -> String,
) -> String {
    let mut s = String::new();
    for (j, e) in pw.exprs.iter().enumerate() {
        let v = |i: &usize| format!("v{i}");
        let rhs = match e {
            PExpr::Load { input, view } => {
                load(p.buffers[k.inputs[*input]].ty.dtype, &at(*input, view))
            }
            PExpr::Const(c) => float_lit(*c),
            PExpr::Dim(d) => format!("(float){}", d.to_c()),
            PExpr::Unary(u, a) => unary(*u, &v(a)),
            PExpr::UnaryGrad(u, x, dy) => unary_grad(*u, &v(x), &v(dy)),
            PExpr::Binary(b, x, y) => binary(*b, &v(x), &v(y)),
            PExpr::Round(dt, a) => match dt {
                DType::BF16 => format!("fs_round_bf16({})", v(a)),
                DType::F16 => format!("fs_round_f16({})", v(a)),
                DType::F32 => v(a),
                DType::I32 => format!("(float)(int){}", v(a)),
            },
        };
        let _ = writeln!(s, "{indent}const float v{j} = {rhs};");
    }
    s
}
