//! Group kernels: several independent ops of one kind in one launch (every
//! parameter's optimizer update).

/// Elements per chunk of a group kernel's work: 64 per thread of a block.
/// (4096 made blocks too short-lived: BERT-large's AdamW ran at 68% of the
/// copy bandwidth on an H200 and its casts to bf16 at 43%; 16384 took the
/// update from 2.7 to 2.1 ms and the casts from 0.9 to 0.7.)
pub const GROUP_CHUNK: i64 = 16384;

use super::cuda::{float_lit, header};
use super::templates::{op_body, shape_of, Ctx, Shape};
use crate::ir::types::DType;
use crate::ir::Graph;
use crate::kernel::{Kernel, Program};
use crate::ops::Op;
use std::fmt::Write;

/// One kernel running several independent ops of one kind (every
/// parameter's optimizer update), each over its own elements in turn.
pub fn group_kernel(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    members: &[crate::kernel::Member],
    source: Option<&str>,
) -> Option<String> {
    if members
        .iter()
        .all(|m| matches!(g.g[m.node].op, Op::Reduce(_)))
    {
        return sum_group_kernel(g, p, k, members, source);
    }
    let mut s = header(g, p, k, source);
    // Every member is cut into chunks of GROUP_CHUNK elements, numbered one
    // member after another; block b takes chunks b, b + gridDim.x, ... So
    // each block does a member's setup (the bias corrections) once per
    // chunk, and a one-element bias costs one block, not a pass of the grid.
    // Every buffer f32 but the gradient (input 1), which may be bf16 where
    // the ranks average in bf16 (`fs_adamw`/`fs_sgd` take either).
    let f32_only = |m: &crate::kernel::Member| {
        let dt = |b: usize| p.buffers[b].ty.dtype;
        m.inputs.iter().enumerate().all(|(slot, &i)| {
            let d = dt(k.inputs[i]);
            d == DType::F32 || (slot == 1 && d == DType::BF16)
        }) && m.outputs.iter().all(|&o| dt(k.outputs[o]) == DType::F32)
    };
    // Updates of f32 parameters call kernels/optim.cuh's one copy of the update
    // (one per gradient type), so compile time stays flat in the number of
    // parameters.
    // Zeros a member writes after its output's last row (a table a padded
    // GEMM reads past its end, kernel::pitch), as more elements of its own.
    // A member over a piece of its output (ZeRO) writes none: its output
    // is a parameter, whose zero rows nothing else writes.
    let tail = |m: &crate::kernel::Member| -> i64 {
        if g.g[m.node].op.update_range().is_some() {
            return 0;
        }
        m.outputs.first().map_or(0, |&o| {
            let b = &p.buffers[k.outputs[o]];
            // A row's elements (a vector's rows are its elements).
            let cols = b.ty.shape[1.min(b.ty.shape.len())..]
                .iter()
                .try_fold(1i64, |a, d| d.as_const().map(|x| a * x))
                .unwrap_or(0);
            b.zero_rows * cols
        })
    };
    // The headers the members' code needs (kernels/optim.cuh for the
    // updates), each once, before the kernel.
    let mut scope: Vec<String> = Vec::new();
    for m in members {
        let c = Ctx {
            p,
            k,
            ins: m.inputs.clone(),
            outs: m.outputs.clone(),
        };
        if let Some(decls) = super::lower::of(&g.g[m.node].op).file_scope(g, &c, m.node) {
            if !scope.contains(&decls) {
                scope.push(decls);
            }
        }
    }
    if !scope.is_empty() {
        let at = s.find("extern \"C\"")?;
        s.insert_str(at, &scope.concat());
    }
    // Casts of whole tensors eight elements a thread (kernels/cast.cuh).
    let casts: Vec<Option<String>> = members
        .iter()
        .map(|m| cast_call(g, p, k, m, tail(m)))
        .collect();
    if casts.iter().any(Option::is_some) {
        let at = s.find("extern \"C\"")?;
        s.insert_str(at, "#include \"cast.cuh\"\n\n");
    }
    let calls: Option<Vec<String>> =
        if members.iter().all(f32_only) && members.iter().all(|m| tail(m) == 0) {
            members.iter().map(|m| update_call(g, m)).collect()
        } else {
            None
        };
    let _ = writeln!(
        s,
        "    for (fs_i64 chunk = blockIdx.x; ; chunk += gridDim.x) {{\n        fs_i64 b = chunk;"
    );
    for (i, m) in members.iter().enumerate() {
        let n = match (g.g[m.node].op.update_range(), &m.chain) {
            (Some((lo, hi)), _) => format!("{}LL", hi - lo),
            (None, Some(chain)) => chain.1.n.to_c(),
            // The op's own elements: a cache write's new rows, not the
            // cache it writes them into.
            (None, None) => match shape_of(g, m.node) {
                Some(Shape::Elements(n)) => n.to_c(),
                _ => g.g[m.node].outputs[0].numel().to_c(),
            },
        };
        let work = match (&calls, &casts[i], &m.chain) {
            (Some(calls), _, _) => format!("                {}", calls[i].trim_start()),
            (None, Some(cast), _) => format!("                {cast}\n"),
            (None, None, Some(chain)) => chain_work(p, k, m, &chain.1),
            (None, None, None) => {
                let c = Ctx {
                    p,
                    k,
                    ins: m.inputs.clone(),
                    outs: m.outputs.clone(),
                };
                let Shape::Elements(_) = shape_of(g, m.node)? else {
                    return None;
                };
                let body: String = op_body(g, &c, m.node)?
                    .lines()
                    .map(|l| format!("            {l}\n"))
                    .collect();
                let zeros = tail(m);
                if zeros == 0 {
                    format!(
                        "                for (fs_i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {{\n{body}                }}\n"
                    )
                } else {
                    let logical = g.g[m.node].outputs[0].numel().to_c();
                    let zero = c.st(0, "i", "0.0f");
                    let body: String = body.lines().map(|l| format!("    {l}\n")).collect();
                    format!(
                        "                for (fs_i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {{\n                    if (i < {logical}) {{\n{body}                    }} else {{\n                        {zero}  // the zero rows after the last\n                    }}\n                }}\n"
                    )
                }
            }
        };
        let n = match tail(m) {
            0 => n,
            zeros => format!("{n} + {zeros}LL"),
        };
        let _ = write!(
            s,
            "        {{  // member {i}\n            const fs_i64 n = {n}, chunks = (n + {GROUP_CHUNK} - 1) / {GROUP_CHUNK};\n            if (b < chunks) {{\n                const fs_i64 lo = b * {GROUP_CHUNK}, hi = lo + {GROUP_CHUNK} < n ? lo + {GROUP_CHUNK} : n;\n{work}                continue;\n            }}\n            b -= chunks;\n        }}\n"
        );
    }
    s.push_str("        break;  // past the last member's chunks\n    }\n}\n");
    Some(s)
}

/// A chain member's loop over its chunk [lo, hi): its own kernel's
/// expressions and stores, in 16-byte vectors where its own kernel takes
/// them and then an element at a time, its slots named as its own
/// kernel named them (`in0`, `out0`, ...) by pointers declared in the
/// member's scope over the group's.
fn chain_work(
    p: &Program,
    k: &Kernel,
    m: &crate::kernel::Member,
    pw: &crate::kernel::Pointwise,
) -> String {
    let own = Kernel {
        name: k.name.clone(),
        nodes: Vec::new(),
        inputs: m.inputs.iter().map(|&s| k.inputs[s]).collect(),
        outputs: m.outputs.iter().map(|&s| k.outputs[s]).collect(),
        input_views: Vec::new(),
        residual: None,
        prologue: None,
        body: crate::kernel::Body::Pointwise(pw.clone()),
    };
    let mut s = String::new();
    for (j, &slot) in m.inputs.iter().enumerate() {
        let _ = writeln!(s, "                const auto* in{j}_ = in{slot};");
    }
    for (j, &slot) in m.outputs.iter().enumerate() {
        let _ = writeln!(s, "                auto* out{j}_ = out{slot};");
    }
    let _ = writeln!(s, "                {{");
    for j in 0..m.inputs.len() {
        let _ = writeln!(s, "                    const auto* in{j} = in{j}_;");
    }
    for j in 0..m.outputs.len() {
        let _ = writeln!(s, "                    auto* out{j} = out{j}_;");
    }
    // Whole vectors of the chain's width first (chunks start at multiples
    // of GROUP_CHUNK, so of the width), then the rest one by one.
    let vec = super::cuda::vector_width(p, &own, pw);
    let ind = "                        ";
    let _ = writeln!(
        s,
        "                    const fs_i64 whole = lo + (hi - lo) / {vec} * {vec};\n                    for (fs_i64 i0 = lo + {vec} * (fs_i64)threadIdx.x; i0 < whole; i0 += {vec} * (fs_i64)blockDim.x) {{"
    );
    s.push_str(&super::cuda::vector_elements(p, &own, pw, vec, ind, ""));
    for (slot, _) in pw.stores.iter() {
        let _ = writeln!(s, "{ind}fs_vstore(&out{slot}[i0], s{slot});");
    }
    let _ = writeln!(s, "                    }}");
    let _ = writeln!(
        s,
        "                    for (fs_i64 i = whole + threadIdx.x; i < hi; i += blockDim.x) {{"
    );
    s.push_str(&super::cuda::element_body(
        p,
        &own,
        pw,
        "                        ",
        &|input, view| format!("in{input}[{}]", super::cuda::index(view)),
        &|_, _, _| unreachable!("no dropout in a grouped chain"),
    ));
    for &(slot, e) in &pw.stores {
        let dt = p.buffers[own.outputs[slot]].ty.dtype;
        let _ = writeln!(
            s,
            "                        out{slot}[i] = {};",
            super::cuda::store(dt, &format!("v{e}"))
        );
    }
    s.push_str(
        "                    }
                }
",
    );
    s
}

/// Leading-axis sums side by side (kernel::groups::group_adjacent_sums):
/// each member's work items (a run of rows of a tile of columns, as its own
/// kernel would cut them, emit/multi.rs) numbered one member after another,
/// block b taking items b, b + gridDim.x, ...; each member keeps its own
/// partials and counts, so each sum is the one its own kernel makes.
fn sum_group_kernel(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    members: &[crate::kernel::Member],
    source: Option<&str>,
) -> Option<String> {
    let mut s = header(g, p, k, source);
    let mut decls = String::from("#include \"column_sum.cuh\"\n\n");
    let mut body = String::new();
    let _ = writeln!(
        body,
        "    for (fs_i64 chunk = blockIdx.x; ; chunk += gridDim.x) {{\n        fs_i64 b = chunk;"
    );
    for (i, m) in members.iter().enumerate() {
        let c = Ctx {
            p,
            k,
            ins: m.inputs.clone(),
            outs: m.outputs.clone(),
        };
        let sum = super::multi::group_sum(g, &c, m.node, &format!("{}_m{i}", k.name))?;
        decls.push_str(&sum.decls);
        let code: String = sum
            .code
            .lines()
            .map(|l| format!("            {l}\n"))
            .collect();
        let _ = write!(
            body,
            "        {{  // member {i}\n            const fs_i64 items = {};\n            if (b < items) {{\n{code}                continue;\n            }}\n            b -= items;\n        }}\n",
            sum.items
        );
    }
    body.push_str("        break;  // past the last member's items\n    }\n}\n");
    let at = s.find("extern \"C\"")?;
    s.insert_str(at, &decls);
    s.push_str(&body);
    Some(s)
}

/// Blocks of a group of leading-axis sums: every member's work items.
pub fn sum_group_blocks(
    g: &Graph,
    members: &[crate::kernel::Member],
    env: &dyn Fn(&str) -> Option<i64>,
) -> Option<u64> {
    members
        .iter()
        .map(|m| super::multi::items(g, m.node, env))
        .sum::<Option<u64>>()
        .map(|n| n.clamp(1, 1 << 20))
}

/// `fs_cast_chunk(...)` for a member that casts a whole tensor between
/// f32 and 16-bit types where eight elements at a time fit it: its
/// elements and the zeros after them whole multiples of 8 (every chunk
/// starts at a multiple of GROUP_CHUNK), neither buffer's rows padded.
fn cast_call(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    m: &crate::kernel::Member,
    zeros: i64,
) -> Option<String> {
    if !matches!(g.g[m.node].op, Op::Cast(_))
        || m.chain.is_some()
        || m.inputs.len() != 1
        || m.outputs.len() != 1
    {
        return None;
    }
    let (i, o) = (
        &p.buffers[k.inputs[m.inputs[0]]],
        &p.buffers[k.outputs[m.outputs[0]]],
    );
    let float = |d: DType| matches!(d, DType::F32 | DType::BF16 | DType::F16);
    let n = g.g[m.node].outputs[0].numel().as_const()?;
    let whole = i.ty.numel().as_const() == Some(n);
    (float(i.ty.dtype)
        && float(o.ty.dtype)
        && whole
        && n % 8 == 0
        && zeros % 8 == 0
        && GROUP_CHUNK % 8 == 0
        && i.pitch.is_none()
        && o.pitch.is_none()
        && i.zero_rows == 0)
        .then(|| {
            format!(
                "fs_cast_chunk<{}, {}>(out{}, in{}, lo, hi, {n}LL);",
                super::templates::element(i.ty.dtype),
                super::templates::element(o.ty.dtype),
                m.outputs[0],
                m.inputs[0]
            )
        })
}

/// The `apply` argument: the micro-batch flag, or 1 without micro-batches.
fn apply(slot: Option<&usize>) -> String {
    slot.map_or("1.0f".to_string(), |s| format!("*in{s}"))
}

/// `fs_adamw(...)` or `fs_sgd(...)` for one member; `None` for other ops.
fn update_call(g: &Graph, m: &crate::kernel::Member) -> Option<String> {
    let (i, o) = (&m.inputs, &m.outputs);
    // A ZeRO piece: the parameter and its gradient from the piece's start,
    // so element k of the piece is element k of the state.
    let range = g.g[m.node].op.update_range();
    let at = match range {
        Some((lo, _)) => format!(" + {lo}LL"),
        None => String::new(),
    };
    // A master piece is indexed as the state, the gradient as the parameter.
    let master = g.g[m.node].op.update_master();
    let pat = if master { String::new() } else { at.clone() };
    // ZeRO stage 2's gradient is the piece alone, indexed as the state too.
    let grad_piece = match &g.g[m.node].op {
        Op::AdamW(a) => a.grad_piece,
        Op::Sgd(sg) => sg.grad_piece,
        _ => false,
    };
    let at = if grad_piece { String::new() } else { at };
    // The rest of the parameter passes through where the update is not in
    // place (the plan always updates in place; the first chunk copies it).
    let rest = match range.filter(|_| !master) {
        Some((lo, hi)) => {
            let n = g.g[m.node].outputs[0].numel().to_c();
            format!(
                "                if (lo == 0 && (const void*)out{o0} != (const void*)in{i0}) {{\n                    for (fs_i64 k = threadIdx.x; k < {lo}LL; k += blockDim.x) out{o0}[k] = in{i0}[k];\n                    for (fs_i64 k = {hi}LL + threadIdx.x; k < {n}; k += blockDim.x) out{o0}[k] = in{i0}[k];\n                }}\n",
                o0 = o[0],
                i0 = i[0]
            )
        }
        None => String::new(),
    };
    let call = match &g.g[m.node].op {
        Op::AdamW(a) => format!(
            "fs_adamw(out{}{pat}, out{}, out{}, in{}{pat}, in{}{at}, in{}, in{}, *in{}, *in{}, *in{}, {}, lo, hi, {}, {}, {}, {}, {}, {}, {}, {});\n",
            o[0],
            o[1],
            o[2],
            i[0],
            i[1],
            i[2],
            i[3],
            i[4],
            i[5],
            i[6],
            apply(i.get(7)),
            float_lit(a.beta1),
            float_lit(a.beta2),
            float_lit(a.eps),
            float_lit(a.weight_decay),
            float_lit(1.0 - a.beta1),
            float_lit(1.0 - a.beta2),
            float_lit((-(1.0 - a.beta1)).ln_1p()),
            float_lit((-(1.0 - a.beta2)).ln_1p())
        ),
        Op::Sgd(sg) => format!(
            "fs_sgd(out{}{pat}, out{}, in{}{pat}, in{}{at}, in{}, *in{}, *in{}, {}, lo, hi, {}, {});\n",
            o[0],
            o[1],
            i[0],
            i[1],
            i[2],
            i[3],
            i[4],
            apply(i.get(5)),
            float_lit(sg.momentum),
            float_lit(sg.weight_decay)
        ),
        _ => return None,
    };
    Some(format!("{call}{rest}"))
}
