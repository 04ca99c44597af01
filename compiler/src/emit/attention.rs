//! The simple, exact attention forward and backward (one block per query
//! row, and per key row for the backward), which never stores a score
//! matrix: `kernels/attention/simple.cuh`, instantiated here, where the
//! tensor-core kernels (`emit/flash`, whose module comment says what they
//! take) do not apply: head dims that are not multiples of 8 or are over
//! 256, rows that are not contiguous and 16-byte aligned, an f32 backward
//! past 256 features in D + Dv; and under `FUSEC_ATTENTION=simple`.

use super::access::Access;
use super::cuda::float_lit;
use super::lower::Lower;
use super::templates::{element, Ctx, Shape, BLOCK};
use crate::ir::{Dim, Graph};
use crate::ops::{AttnDropout, Op};
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

fn product(ds: &[&Dim]) -> Dim {
    ds.iter()
        .try_fold(Dim::constant(1), |a, d| a.checked_mul(d))
        .unwrap_or_default()
}

/// Sizes of one attention op: q [B, T, Hq, D], k [B, S, Hkv, D],
/// v [B, S, Hkv, Dv].
struct Sizes {
    b: Dim,
    t: Dim,
    s: Dim,
    hq: Dim,
    hkv: Dim,
    d: Dim,
    dv: Dim,
}

fn sizes(g: &Graph, n: NodeIndex) -> Option<(Sizes, bool, f64)> {
    let (causal, scale) = match &g.g[n].op {
        Op::Attention(a) => (a.causal, a.scale),
        Op::AttentionGrad(a) => (a.causal, a.scale),
        _ => return None,
    };
    let ins = g.inputs(n);
    let (q, k, v) = (
        &g.ty(ins[0]).shape,
        &g.ty(ins[1]).shape,
        &g.ty(ins[2]).shape,
    );
    let s = Sizes {
        b: q[0].clone(),
        t: q[1].clone(),
        s: k[1].clone(),
        hq: q[2].clone(),
        hkv: k[2].clone(),
        d: q[3].clone(),
        dv: v[3].clone(),
    };
    Some((s, causal, scale))
}

/// Launch shape of an attention kernel; `None` for other ops.
pub fn shape_of(g: &Graph, n: NodeIndex) -> Option<Shape> {
    let (s, _, _) = sizes(g, n)?;
    let q_rows = product(&[&s.b, &s.hq, &s.t]);
    Some(Shape::Rows(match &g.g[n].op {
        Op::Attention(_) => q_rows,
        // Query rows (dq), then key rows (dk, dv).
        _ => q_rows.checked_add(&product(&[&s.b, &s.hkv, &s.s]))?,
    }))
}

/// The kernel body (everything after the signature, before the closing
/// brace): the operands as the template's views, the sizes, and the call;
/// `None` for other ops.
pub(crate) fn kernel_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let (s, causal, scale) = sizes(g, n)?;
    let group = s.hq.as_const()? / s.hkv.as_const().filter(|&h| h > 0)?;
    let forward = matches!(g.g[n].op, Op::Attention(_));
    let e = element(Access::input(g, c, n, 0).dt);
    let mut b = String::new();
    let _ = writeln!(
        b,
        "    // Simple exact attention {} (kernels/attention/simple.cuh).",
        if forward { "forward" } else { "backward" }
    );
    let _ = writeln!(b, "    fs_attn_simple::Sizes s = {{}};");
    for (field, d) in [
        ("batch", &s.b),
        ("q_len", &s.t),
        ("kv_len", &s.s),
        ("q_heads", &s.hq),
        ("kv_heads", &s.hkv),
        ("head_dim", &s.d),
        ("v_dim", &s.dv),
    ] {
        let _ = writeln!(b, "    s.{field} = {};", d.to_c());
    }
    let _ = writeln!(b, "    s.group = {group};");
    let _ = writeln!(b, "    s.scale = {};", float_lit(scale));
    let _ = writeln!(b, "    s.causal = {causal};");
    // With lengths (an input), batch entry b's keys end at its length.
    let lens_slot = match &g.g[n].op {
        Op::Attention(a) => a.extra_slots().0,
        Op::AttentionGrad(a) => a.extra_slots().0,
        _ => None,
    };
    if let Some(l) = lens_slot {
        let _ = writeln!(b, "    s.kv_lens = {};", c.in_ptr(l));
    }
    if let Some((drop, key)) = dropout_of(g, c, n) {
        let _ = writeln!(b, "    // Dropout p = {}.", drop.p);
        let _ = writeln!(b, "    s.drop_key = in{key};");
        let _ = writeln!(b, "    s.drop_site = {}u;", drop.site);
        let _ = writeln!(b, "    s.drop_threshold = {}u;", drop.threshold());
        let _ = writeln!(b, "    s.keep_scale = {};", float_lit(drop.scale()));
    }
    let view = |kind: &str, name: &str, a: Access| {
        format!("    const fs_attn_simple::{kind} {name} = {};\n", a.init())
    };
    let input = format!("In<{e}>");
    let output = format!("Out<{e}>");
    if forward {
        for (i, name) in ["q", "k", "v"].iter().enumerate() {
            b += &view(&input, name, Access::input(g, c, n, i));
        }
        b += &view(&output, "o", Access::output(g, c, n, 0));
        b += &view("Lse<float>", "lse", Access::output(g, c, n, 1));
        let _ = writeln!(
            b,
            "    fs_attn_simple::forward<{e}, {BLOCK}>(q, k, v, o, lse, s);"
        );
    } else {
        for (i, name) in ["q", "k", "v", "o"].iter().enumerate() {
            b += &view(&input, name, Access::input(g, c, n, i));
        }
        b += &view("Lse<const float>", "lse", Access::input(g, c, n, 4));
        b += &view(&input, "dout", Access::input(g, c, n, 5));
        for (o, name) in ["dq", "dk", "dv"].iter().enumerate() {
            b += &view(&output, name, Access::output(g, c, n, o));
        }
        let _ = writeln!(
            b,
            "    fs_attn_simple::backward<{e}, {BLOCK}>(q, k, v, o, lse, dout, dq, dk, dv, s);"
        );
    }
    Some(b)
}

/// The op's dropout and the kernel slot of the step's key (its last input).
pub(crate) fn dropout_of(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<(AttnDropout, usize)> {
    let (drop, key) = match &g.g[n].op {
        Op::Attention(a) => (a.dropout?, a.extra_slots().1?),
        Op::AttentionGrad(a) => (a.dropout?, a.extra_slots().1?),
        _ => return None,
    };
    Some((drop, c.ins[key]))
}

/// The template's header, before the kernel.
pub(crate) fn file_scope(g: &Graph, _: &Ctx, n: NodeIndex) -> Option<String> {
    sizes(g, n).map(|_| "#include \"attention/simple.cuh\"\n\n".to_string())
}

/// The tensor-core kernels instantiate `kernels/attention/` templates
/// (emit/flash); the generated kernel here is the simple one that runs
/// where they do not apply.
macro_rules! attention_lowering {
    ($($op:ident),*) => {$(
        impl Lower for crate::ops::$op {
            fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
                shape_of(g, n)
            }
            fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
                kernel_body(g, c, n)
            }
            fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
                file_scope(g, c, n)
            }
        }
    )*};
}

attention_lowering!(Attention, AttentionGrad);
