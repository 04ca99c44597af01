//! The functions a model file can call. Each is a thin layer that reads its
//! arguments and adds op nodes; the shape rules live with the ops.
//!
//! Long (some 730 lines) because it is one table: a builtin's signature,
//! doc line and handler sit together, and `tests/docs.rs` reads the table
//! against docs/dsl.md.

use super::args::Args;
use super::Elab;
use crate::diag::Diagnostic;
use crate::dsl::ast::Span;
use crate::ir::{Dim, Value};
use crate::model::values::Val;
use crate::ops::*;

type Handler = fn(&mut Elab, &mut Args) -> Result<Val, Diagnostic>;

pub struct Builtin {
    pub name: &'static str,
    pub sig: &'static str,
    pub doc: &'static str,
    f: Call,
}

#[derive(Clone, Copy)]
enum Call {
    Fn(Handler),
    /// The unary functions come from their table (ops/unary.rs).
    Unary(UnaryKind),
}

/// Every builtin: the functions below, and one for each entry of the unary
/// table that a model file may call.
pub static BUILTINS: std::sync::LazyLock<Vec<Builtin>> = std::sync::LazyLock::new(|| {
    let unary = UnaryKind::ALL.iter().filter_map(|&k| {
        let (sig, doc) = k.def().builtin?;
        Some(Builtin {
            name: k.name(),
            sig,
            doc,
            f: Call::Unary(k),
        })
    });
    let copy = |b: &Builtin| Builtin { f: b.f, ..*b };
    // After the norms, as the language reference lists them.
    let (norms, rest) = FUNCTIONS.split_at(4);
    norms
        .iter()
        .map(copy)
        .chain(unary)
        .chain(rest.iter().map(copy))
        .collect()
});

const FUNCTIONS: &[Builtin] = &[
    Builtin { name: "linear", sig: "linear(x, weight, bias?)", doc: "x @ weight + bias; weight is [in, out]", f: Call::Fn(linear) },
    Builtin { name: "embedding", sig: "embedding(table, indices)", doc: "rows of table [V, C] picked by i32 indices", f: Call::Fn(embedding) },
    Builtin { name: "layernorm", sig: "layernorm(x, weight, bias, eps = 1e-5)", doc: "LayerNorm over the last axis", f: Call::Fn(layernorm) },
    Builtin { name: "rmsnorm", sig: "rmsnorm(x, weight, eps = 1e-6)", doc: "RMSNorm over the last axis", f: Call::Fn(rmsnorm) },
    Builtin { name: "swiglu", sig: "swiglu(gate, up)", doc: "silu(gate) * up", f: Call::Fn(swiglu) },
    Builtin { name: "softmax", sig: "softmax(x, axis = -1)", doc: "softmax along an axis", f: Call::Fn(softmax) },
    Builtin { name: "sum", sig: "sum(x, axis = all, keepdim = false)", doc: "sum over an axis or a list of axes", f: Call::Fn(|e, a| reduce(e, a, ReduceKind::Sum)) },
    Builtin { name: "mean", sig: "mean(x, axis = all, keepdim = false)", doc: "mean over an axis or a list of axes", f: Call::Fn(|e, a| reduce(e, a, ReduceKind::Mean)) },
    Builtin { name: "reshape", sig: "reshape(x, [d0, d1, ...])", doc: "same elements, new shape; one -1 is inferred", f: Call::Fn(reshape) },
    Builtin { name: "heads", sig: "heads(x, n)", doc: "[..., n*D] -> [..., n, D]", f: Call::Fn(heads) },
    Builtin { name: "merge_heads", sig: "merge_heads(x)", doc: "[..., H, D] -> [..., H*D]", f: Call::Fn(merge_heads) },
    Builtin { name: "transpose", sig: "transpose(x, a = -2, b = -1)", doc: "swap two axes", f: Call::Fn(transpose) },
    Builtin { name: "permute", sig: "permute(x, [axes...])", doc: "reorder the axes", f: Call::Fn(permute) },
    Builtin { name: "concat", sig: "concat([a, b, ...], axis = 0)", doc: "join tensors along an axis", f: Call::Fn(concat) },
    Builtin { name: "split", sig: "split(x, n or [sizes...], axis = -1)", doc: "cut into equal parts or given sizes", f: Call::Fn(split) },
    Builtin { name: "broadcast", sig: "broadcast(x, [d0, d1, ...])", doc: "repeat along size-1 or new leading axes", f: Call::Fn(broadcast_fn) },
    Builtin { name: "rope", sig: "rope(x, theta = 10000)", doc: "rotary position embedding of [B, T, H, D] heads", f: Call::Fn(rope) },
    Builtin { name: "attention", sig: "attention(q, k, v, causal = false, scale = 1/sqrt(D), lengths?, dropout = 0)", doc: "softmax(q k^T * scale) v over [B, T, H, D] heads; grouped-query when k, v have fewer heads; keys at or past lengths[b] (i32 [B]) are padding; dropout p on the probabilities (training steps only)", f: Call::Fn(attention) },
    Builtin { name: "causal_mask", sig: "causal_mask(scores)", doc: "-inf above the diagonal of the last two axes", f: Call::Fn(causal_mask) },
    Builtin { name: "conv2d", sig: "conv2d(x, weight, stride = 1, padding = 0)", doc: "NHWC convolution; weight is [KH, KW, Cin, Cout]", f: Call::Fn(conv2d) },
    Builtin { name: "dropout", sig: "dropout(x, p)", doc: "zero each element with probability p and scale the rest by 1/(1-p) (training steps only)", f: Call::Fn(dropout) },
    Builtin { name: "cross_entropy", sig: "cross_entropy(logits, targets, ignore_index = none, label_smoothing = 0)", doc: "mean cross-entropy of logits [..., V] and i32 targets [...], over the targets that are not ignore_index", f: Call::Fn(cross_entropy) },
];

pub(crate) fn call(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let Some(b) = BUILTINS.iter().find(|b| b.name == a.func) else {
        let mut d = Diagnostic::new(
            format!("unknown function `{}`", a.func),
            a.func_span,
            "not a builtin or a block",
        );
        let blocks = e.blocks.keys().map(|k| k.as_str());
        if let Some(s) = super::suggest(&a.func, BUILTINS.iter().map(|b| b.name).chain(blocks)) {
            let what = if e.is_block(&s) {
                "the block"
            } else {
                "the builtin"
            };
            d = d.with_help(format!("did you mean {what} `{s}`?"));
        }
        return Err(d);
    };
    a.sig = b.sig;
    // A shape or dtype error is easier to fix with the argument order at hand.
    let usage = |d: Diagnostic| {
        if d.help.iter().any(|h| h.starts_with("usage:")) {
            d
        } else {
            d.with_help(format!("usage: {}", b.sig))
        }
    };
    let v = match b.f {
        Call::Fn(f) => f(e, a),
        Call::Unary(kind) => unary(e, a, kind),
    }
    .map_err(usage)?;
    a.finish()?;
    Ok(v)
}

fn t(v: Value) -> Val {
    Val::Tensor(v)
}

fn add1(
    e: &mut Elab,
    op: impl Into<Op>,
    ins: &[(Value, Span)],
    span: Span,
) -> Result<Value, Diagnostic> {
    let vals: Vec<Value> = ins.iter().map(|x| x.0).collect();
    let spans: Vec<Span> = ins.iter().map(|x| x.1).collect();
    Ok(e.add_at(op.into(), &vals, span, &spans)?[0])
}

fn rank(e: &Elab, v: Value) -> usize {
    e.graph.ty(v).rank()
}

fn axis_arg(e: &Elab, a: &Args, axis: i64, r: usize, span: Span) -> Result<usize, Diagnostic> {
    norm_axis(&a.func, axis, r).map_err(|err| {
        let mut d = Diagnostic::new(err.message, span, err.detail);
        if let Some(h) = err.help {
            d = d.with_help(h);
        }
        let _ = e;
        d
    })
}

fn unary(e: &mut Elab, a: &mut Args, kind: UnaryKind) -> Result<Val, Diagnostic> {
    let (v, s) = a.required(0, "x")?;
    if let (Some(x), false) = (v.as_f64(), matches!(v, Val::Dim(_))) {
        if kind.def().on_numbers {
            let y = kind.apply(x);
            if !y.is_finite() {
                return Err(Diagnostic::new(
                    format!("`{}({x})` has no finite value", kind.name()),
                    s,
                    format!(
                        "expected a number in the domain of `{}`, found {x}",
                        kind.name()
                    ),
                ));
            }
            return Ok(Val::Float(y));
        }
    }
    let x = a.tensor(&e.graph, 0, "x")?;
    Ok(t(add1(e, Unary { kind }, &[x], a.span)?))
}

fn linear(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let w = a.tensor(&e.graph, 1, "weight")?;
    let b = a.opt_tensor(&e.graph, 2, "bias")?;
    let y = add1(e, MatMul, &[x, w], a.span)?;
    Ok(t(match b {
        Some(b) => add1(
            e,
            Binary {
                kind: BinaryKind::Add,
            },
            &[(y, a.span), b],
            a.span,
        )?,
        None => y,
    }))
}

fn embedding(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let table = a.tensor(&e.graph, 0, "table")?;
    let idx = a.tensor(&e.graph, 1, "indices")?;
    Ok(t(add1(e, Embedding, &[table, idx], a.span)?))
}

fn layernorm(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let w = a.tensor(&e.graph, 1, "weight")?;
    let b = a.tensor(&e.graph, 2, "bias")?;
    let eps = a.float(&e.graph, 3, "eps", Some(1e-5))?;
    Ok(t(add1(e, LayerNorm { eps }, &[x, w, b], a.span)?))
}

fn rmsnorm(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let w = a.tensor(&e.graph, 1, "weight")?;
    let eps = a.float(&e.graph, 2, "eps", Some(1e-6))?;
    Ok(t(add1(e, RmsNorm { eps }, &[x, w], a.span)?))
}

fn swiglu(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let g = a.tensor(&e.graph, 0, "gate")?;
    let u = a.tensor(&e.graph, 1, "up")?;
    let s = add1(
        e,
        Unary {
            kind: UnaryKind::Silu,
        },
        &[g],
        a.span,
    )?;
    Ok(t(add1(
        e,
        Binary {
            kind: BinaryKind::Mul,
        },
        &[(s, g.1), u],
        a.span,
    )?))
}

fn softmax(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let (ax, s) = a.int(&e.graph, 1, "axis", Some(-1))?;
    let axis = axis_arg(e, a, ax, rank(e, x.0), s)?;
    Ok(t(add1(e, Softmax { axis }, &[x], a.span)?))
}

fn reduce(e: &mut Elab, a: &mut Args, kind: ReduceKind) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let r = rank(e, x.0);
    let mut axes = Vec::new();
    match a.get(1, "axis")? {
        None => axes.extend(0..r),
        Some((Val::List(items), _)) => {
            for (v, s) in items {
                let ax = v.as_i64().ok_or_else(|| {
                    Diagnostic::new(
                        "an axis must be an integer",
                        s,
                        format!("found {}", v.describe(&e.graph)),
                    )
                })?;
                axes.push(axis_arg(e, a, ax, r, s)?);
            }
        }
        Some((v, s)) => {
            let ax = v.as_i64().ok_or_else(|| {
                Diagnostic::new(
                    "an axis must be an integer",
                    s,
                    format!("found {}", v.describe(&e.graph)),
                )
            })?;
            axes.push(axis_arg(e, a, ax, r, s)?);
        }
    }
    axes.sort();
    axes.dedup();
    let keepdim = a.bool(&e.graph, 2, "keepdim", false)?;
    Ok(t(add1(
        e,
        Reduce {
            kind,
            axes,
            keepdim,
        },
        &[x],
        a.span,
    )?))
}

fn reshape(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let (dims, list_span) = a.dims(&e.graph, 1, "shape")?;
    let numel = e.graph.ty(x.0).numel();
    if let Some((d, s)) = dims
        .iter()
        .find(|(d, _)| d.as_const().is_some_and(|c| c <= 0 && c != -1))
    {
        return Err(Diagnostic::new(
            "dimensions must be positive",
            *s,
            format!("expected a size of 1 or more (or -1 to infer one), found {d}"),
        ));
    }
    let _ = list_span;
    let holes: Vec<usize> = (0..dims.len())
        .filter(|&i| dims[i].0.as_const() == Some(-1))
        .collect();
    if holes.len() > 1 {
        return Err(Diagnostic::new(
            "only one dimension can be inferred",
            dims[holes[1]].1,
            "second -1",
        )
        .with_note(dims[holes[0]].1, "first -1"));
    }
    let mut shape: Vec<Dim> = dims.iter().map(|d| d.0.clone()).collect();
    if let Some(&h) = holes.first() {
        let known = shape
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != h)
            .try_fold(Dim::constant(1), |acc, (_, d)| acc.checked_mul(d));
        let inferred = known.as_ref().and_then(|k| numel.checked_div(k));
        match inferred {
            Some(d) => shape[h] = d,
            None => {
                return Err(Diagnostic::new(
                    "the -1 dimension cannot be inferred",
                    dims[h].1,
                    format!(
                        "{} has {numel} elements, not a multiple of {}",
                        e.graph.ty(x.0),
                        known.map_or("the other dimensions".to_string(), |k| k.to_string())
                    ),
                ));
            }
        }
    }
    Ok(t(add1(e, Reshape { shape }, &[x], a.span)?))
}

fn heads(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let (n, ns) = a.int(&e.graph, 1, "n", None)?;
    let ty = e.graph.ty(x.0).clone();
    if ty.rank() == 0 || n <= 0 {
        return Err(Diagnostic::new(
            "`heads` splits the last axis into n heads",
            ns,
            format!("cannot split {ty} into {n}"),
        ));
    }
    let c = ty.shape[ty.rank() - 1].clone();
    let Some(d) = c.checked_div(&Dim::constant(n)) else {
        return Err(Diagnostic::new(
            format!("`heads`: {c} features do not split evenly into {n} heads"),
            ns,
            format!("expected a head count that divides {c}, found {n}"),
        )
        .with_note(x.1, format!("the last axis of {ty} is split")));
    };
    let mut shape = ty.shape[..ty.rank() - 1].to_vec();
    shape.extend([Dim::constant(n), d]);
    Ok(t(add1(e, Reshape { shape }, &[x], a.span)?))
}

fn merge_heads(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let ty = e.graph.ty(x.0).clone();
    if ty.rank() < 2 {
        return Err(Diagnostic::new(
            "`merge_heads` joins the last two axes",
            x.1,
            format!("found {ty}"),
        ));
    }
    let r = ty.rank();
    let merged = ty.shape[r - 2]
        .checked_mul(&ty.shape[r - 1])
        .unwrap_or_default();
    let mut shape = ty.shape[..r - 2].to_vec();
    shape.push(merged);
    Ok(t(add1(e, Reshape { shape }, &[x], a.span)?))
}

fn transpose(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let r = rank(e, x.0);
    let (i, si) = a.int(&e.graph, 1, "a", Some(-2))?;
    let (j, sj) = a.int(&e.graph, 2, "b", Some(-1))?;
    let i = axis_arg(e, a, i, r, si)?;
    let j = axis_arg(e, a, j, r, sj)?;
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(i, j);
    Ok(t(add1(e, Permute { perm }, &[x], a.span)?))
}

fn permute(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let r = rank(e, x.0);
    let (axes, _) = a.dims(&e.graph, 1, "axes")?;
    let mut perm = Vec::new();
    for (d, s) in axes {
        let ax = d.as_const().unwrap_or(i64::MAX);
        perm.push(axis_arg(e, a, ax, r, s)?);
    }
    Ok(t(add1(e, Permute { perm }, &[x], a.span)?))
}

fn concat(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let (v, s) = a.required(0, "tensors")?;
    let Val::List(items) = v else {
        return Err(Diagnostic::new(
            "`concat` takes a list of tensors",
            s,
            format!("found {}", v.describe(&e.graph)),
        )
        .with_help("write concat([a, b], axis = 1)"));
    };
    let mut ins = Vec::new();
    for (v, is) in items {
        match v {
            Val::Tensor(x) => ins.push((x, is)),
            other => {
                return Err(Diagnostic::new(
                    "`concat` takes a list of tensors",
                    is,
                    format!("found {}", other.describe(&e.graph)),
                ))
            }
        }
    }
    if ins.is_empty() {
        return Err(Diagnostic::new(
            "`concat` needs at least one tensor",
            s,
            "empty list",
        ));
    }
    let (ax, axs) = a.int(&e.graph, 1, "axis", Some(0))?;
    let axis = axis_arg(e, a, ax, rank(e, ins[0].0), axs)?;
    let vals: Vec<Value> = ins.iter().map(|x| x.0).collect();
    let spans: Vec<Span> = ins.iter().map(|x| x.1).collect();
    Ok(t(e.add_at(
        Concat { axis }.into(),
        &vals,
        a.span,
        &spans,
    )?[0]))
}

fn split(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let (ax, axs) = a.int(&e.graph, 2, "axis", Some(-1))?;
    let ty = e.graph.ty(x.0).clone();
    let axis = axis_arg(e, a, ax, ty.rank(), axs)?;
    let size = ty.shape[axis].clone();
    let (sec, ss) = a.required(1, "sections")?;
    let sizes: Vec<Dim> = match &sec {
        Val::List(items) => {
            let mut out = Vec::new();
            for (v, is) in items {
                out.push(v.as_dim().ok_or_else(|| {
                    Diagnostic::new(
                        "expected a size",
                        *is,
                        format!(
                            "expected an integer or a dimension, found {}",
                            v.describe(&e.graph)
                        ),
                    )
                })?);
            }
            let total = out
                .iter()
                .try_fold(Dim::constant(0), |acc, d| acc.checked_add(d));
            if total.as_ref() != Some(&size) {
                return Err(Diagnostic::new(
                    "the sizes do not add up to the axis",
                    ss,
                    format!(
                        "expected sizes adding up to {size}, found a total of {}",
                        total.map_or("more than fits in 64 bits".into(), |t| t.to_string())
                    ),
                )
                .with_note(x.1, format!("axis {axis} of {ty} is split")));
            }
            out
        }
        v => {
            let n = v.as_i64().filter(|n| *n > 0).ok_or_else(|| {
                Diagnostic::new(
                    "`split` needs a count or a list of sizes",
                    ss,
                    format!(
                        "expected a positive count or a list, found {}",
                        v.describe(&e.graph)
                    ),
                )
            })?;
            // Each part is an op of its own; a count past this is a mistake.
            const MAX_PARTS: i64 = 65536;
            if n > MAX_PARTS {
                return Err(Diagnostic::new(
                    format!("`split` makes at most {MAX_PARTS} parts"),
                    ss,
                    format!("expected a count from 1 to {MAX_PARTS}, found {n}"),
                )
                .with_help("to view a long axis in groups, use `reshape(x, [..., groups, -1])`"));
            }
            let part = size.checked_div(&Dim::constant(n)).ok_or_else(|| {
                Diagnostic::new(
                    format!("`split`: an axis of size {size} does not split into {n} equal parts"),
                    ss,
                    format!("expected a count that divides {size}, found {n}"),
                )
                .with_note(x.1, format!("axis {axis} of {ty} is split"))
                .with_help("to cut unequal parts, give their sizes: `split(x, [a, b, ...])`")
            })?;
            vec![part; n as usize]
        }
    };
    let mut start = Dim::constant(0);
    let mut parts = Vec::new();
    for d in sizes {
        let end = start.checked_add(&d).unwrap_or_default();
        let v = add1(
            e,
            Slice {
                axis,
                start: start.clone(),
                end: end.clone(),
            },
            &[x],
            a.span,
        )?;
        parts.push((Val::Tensor(v), a.span));
        start = end;
    }
    Ok(Val::List(parts))
}

fn broadcast_fn(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let (dims, _) = a.dims(&e.graph, 1, "shape")?;
    let shape = dims.into_iter().map(|d| d.0).collect();
    Ok(t(add1(e, Broadcast { shape }, &[x], a.span)?))
}

fn rope(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let theta = a.float(&e.graph, 1, "theta", Some(10000.0))?;
    Ok(t(add1(
        e,
        Rope {
            theta,
            inverse: false,
            positions: false,
        },
        &[x],
        a.span,
    )?))
}

fn attention(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let q = a.tensor(&e.graph, 0, "q")?;
    let k = a.tensor(&e.graph, 1, "k")?;
    let v = a.tensor(&e.graph, 2, "v")?;
    let causal = a.bool(&e.graph, 3, "causal", false)?;
    let d = e.graph.ty(q.0).shape.last().and_then(|d| d.as_const());
    let default = d.filter(|d| *d > 0).map(|d| 1.0 / (d as f64).sqrt());
    if default.is_none() && a.get(4, "scale")?.is_none() {
        let ty = e.graph.ty(q.0).clone();
        return Err(Diagnostic::new(
            "`attention` needs a scale when the head dimension is not a fixed size",
            q.1,
            format!("the head dimension of {ty} is not a constant"),
        )
        .with_help("pass `scale = ...`, usually 1/sqrt(head dimension)"));
    }
    let scale = a.float(&e.graph, 4, "scale", default)?;
    let lengths = a.opt_tensor(&e.graph, 5, "lengths")?;
    let p_span = a.get(6, "dropout")?.map_or(a.span, |v| v.1);
    let p = a.float(&e.graph, 6, "dropout", Some(0.0))?;
    if !(0.0..1.0).contains(&p) {
        return Err(Diagnostic::new(
            "`attention` needs a dropout probability from 0 up to (not including) 1",
            p_span,
            format!("found {p}"),
        )
        .with_help(
            "dropout is the share of attention probabilities zeroed, e.g. `dropout = 0.1`",
        ));
    }
    let mut vals = vec![q.0, k.0, v.0];
    let mut spans = vec![q.1, k.1, v.1];
    if let Some((l, s)) = lengths {
        vals.push(l);
        spans.push(s);
    }
    // p = 0 drops nothing: no mask, no key.
    let dropout = (p > 0.0).then(|| AttnDropout {
        p,
        site: e.next_dropout_site(),
    });
    if dropout.is_some() {
        vals.push(e.dropout_key(a.span)?);
        spans.push(a.span);
    }
    let op = Attention {
        causal,
        scale,
        lengths: lengths.is_some(),
        dropout,
    };
    let out = e.add_at(op.into(), &vals, a.span, &spans)?;
    Ok(t(out[0]))
}

fn causal_mask(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "scores")?;
    Ok(t(add1(
        e,
        CausalMask {
            fill: f64::NEG_INFINITY,
        },
        &[x],
        a.span,
    )?))
}

fn conv2d(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let w = a.tensor(&e.graph, 1, "weight")?;
    let (stride, ss) = a.int(&e.graph, 2, "stride", Some(1))?;
    let (padding, ps) = a.int(&e.graph, 3, "padding", Some(0))?;
    if !(1..=1024).contains(&stride) {
        return Err(Diagnostic::new(
            "`conv2d` needs a stride from 1 to 1024",
            ss,
            format!("found {stride}"),
        ));
    }
    if !(0..=1024).contains(&padding) {
        return Err(Diagnostic::new(
            "`conv2d` needs a padding from 0 to 1024",
            ps,
            format!("found {padding}"),
        ));
    }
    Ok(t(add1(
        e,
        Conv2d {
            stride: stride as usize,
            padding: padding as usize,
        },
        &[x, w],
        a.span,
    )?))
}

fn cross_entropy(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let logits = a.tensor(&e.graph, 0, "logits")?;
    let targets = a.tensor(&e.graph, 1, "targets")?;
    let ignore_index = match a.get(2, "ignore_index")? {
        Some(_) => Some(a.int(&e.graph, 2, "ignore_index", None)?.0),
        None => None,
    };
    let s_span = a.get(3, "label_smoothing")?.map_or(a.span, |v| v.1);
    let smoothing = a.float(&e.graph, 3, "label_smoothing", Some(0.0))?;
    if !(0.0..=1.0).contains(&smoothing) {
        return Err(Diagnostic::new(
            "`cross_entropy` needs a label smoothing from 0 to 1",
            s_span,
            format!("found {smoothing}"),
        )
        .with_help(
            "the share of the target spread over every class, e.g. `label_smoothing = 0.1`",
        ));
    }
    let rule = CeRule {
        ignore_index,
        smoothing,
    };
    // Per-row losses (one block per row on the GPU), then their mean.
    let ce = CrossEntropy {
        classes: None,
        rule,
    };
    let rows = add1(e, ce, &[logits, targets], a.span)?;
    let rank = e.graph.ty(rows).rank();
    let all: Vec<usize> = (0..rank).collect();
    let Some(ignore_index) = ignore_index else {
        let mean = Reduce {
            kind: ReduceKind::Mean,
            axes: all,
            keepdim: false,
        };
        return Ok(t(add1(e, mean, &[(rows, a.span)], a.span)?));
    };
    // The mean over the rows that count, as PyTorch takes it: the sum of
    // the losses over the number of targets that are not ignored (NaN
    // where every one is).
    let sum = |axes: Vec<usize>| Reduce {
        kind: ReduceKind::Sum,
        axes,
        keepdim: false,
    };
    let total = add1(e, sum(all.clone()), &[(rows, a.span)], a.span)?;
    let counted = add1(e, Counted { ignore_index }, &[targets], a.span)?;
    let count = add1(e, sum(all), &[(counted, a.span)], a.span)?;
    let div = Binary {
        kind: BinaryKind::Div,
    };
    Ok(t(add1(
        e,
        div,
        &[(total, a.span), (count, a.span)],
        a.span,
    )?))
}

fn dropout(e: &mut Elab, a: &mut Args) -> Result<Val, Diagnostic> {
    let x = a.tensor(&e.graph, 0, "x")?;
    let p_span = a.get(1, "p")?.map_or(a.span, |v| v.1);
    let p = a.float(&e.graph, 1, "p", None)?;
    if !(0.0..1.0).contains(&p) {
        return Err(Diagnostic::new(
            "`dropout` needs a probability from 0 up to (not including) 1",
            p_span,
            format!("found {p}"),
        )
        .with_help("p is the share of elements zeroed, e.g. `dropout(x, 0.1)`"));
    }
    if p == 0.0 {
        // Nothing is dropped: no op, no key.
        return Ok(t(x.0));
    }
    let key = e.dropout_key(a.span)?;
    let site = e.next_dropout_site();
    Ok(t(add1(
        e,
        Dropout { p, site },
        &[x, (key, a.span)],
        a.span,
    )?))
}
