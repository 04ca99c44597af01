//! The decode step's ops as kernels: the key/value cache write, a thread an
//! element of the new rows (kernels/kv_cache.cuh), and attention over the
//! cache, a block a (batch entry, query row, cache head, chunk of its
//! query heads) (kernels/attention/decode.cuh). Both read their inputs
//! through any view whose rows are contiguous (heads straight out of a
//! fused projection). Greedy decoding's pick is a block a row of logits
//! (kernels/argmax.cuh).

use super::*;
use crate::emit::access::Access;
use crate::emit::cuda::float_lit;
use crate::emit::templates::rows_of;
use crate::emit::templates::{element, BLOCK};
use crate::ops::{ArgMax, CachedAttention, KvWrite};
use std::fmt::Write;

/// Query heads of one cache head a block takes at most: their queries and
/// accumulators live in registers.
pub const DECODE_HEADS: i64 = 4;
/// Keys a warp has in flight at once: 16 registers' worth of each key's
/// and value's features a lane, at most 8 keys. At 2 keys gpt2-small's
/// cached attention at batch 1 and 264 positions took 30 us a layer
/// (H100), its warps waiting on one load after another.
fn unroll(feats: i64) -> i64 {
    (16 / feats.max(1)).clamp(1, 8)
}

impl Lower for KvWrite {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(Shape::Elements(g.ty(g.inputs(n)[1]).numel()))
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some("#include \"kv_cache.cuh\"\n\n".to_string())
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let cache = &g.ty(g.inputs(n)[0]).shape;
        let new = &g.ty(g.inputs(n)[1]).shape;
        let src = Access::input(g, c, n, 1);
        let st = src.strides();
        let ptr = match src.offset().as_const() {
            Some(0) => src.ptr.clone(),
            _ => format!("{} + {}", src.ptr, src.offset().to_c()),
        };
        Some(format!(
            "        fs_kv_write<{}, {}>(i, {}, {}, {}, {}, {}, {ptr}, {}, {}, {}, {}, {});\n",
            element(src.dt),
            c.out_el(0),
            new[1].to_c(),
            new[2].to_c(),
            new[3].to_c(),
            cache[1].to_c(),
            c.in_ptr(2),
            st[0].to_c(),
            st[1].to_c(),
            st[2].to_c(),
            st[3].to_c(),
            c.out_ptr(0)
        ))
    }
}

/// Sizes of a cached attention: q [B, S, Hq, D], caches [B, C, Hkv, D|Dv].
fn sizes(g: &Graph, n: NodeIndex) -> [Dim; 7] {
    let ins = g.inputs(n);
    let (q, k, v) = (
        &g.ty(ins[0]).shape,
        &g.ty(ins[1]).shape,
        &g.ty(ins[2]).shape,
    );
    [
        q[0].clone(),
        q[1].clone(),
        k[1].clone(),
        q[2].clone(),
        k[2].clone(),
        q[3].clone(),
        v[3].clone(),
    ]
}

/// Features a lane holds: the wider of D and Dv over a warp's 32 lanes.
fn feats(d: i64, dv: i64) -> i64 {
    (d.max(dv) + 31) / 32
}

/// Query heads a block takes: up to DECODE_HEADS of a group, fewer where
/// the warps' partial accumulators (`BLOCK / 32` warps x heads x 32 x
/// feats floats, 1 KiB a head and feature) would pass 46 KiB of the 48
/// KiB of static shared memory a block may declare.
fn heads_per_block(group: i64, feats: i64) -> i64 {
    group.min(DECODE_HEADS).min(46 / feats.max(1)).max(1)
}

/// The group size, features a lane and heads a block of a cached attention.
fn layout(g: &Graph, n: NodeIndex) -> Option<(i64, i64, i64)> {
    let [_, _, _, hq, hkv, d, dv] = sizes(g, n);
    let group = hq.as_const()? / hkv.as_const().filter(|&h| h > 0)?;
    let feats = feats(d.as_const()?, dv.as_const()?);
    Some((group, feats, heads_per_block(group, feats)))
}

impl Lower for CachedAttention {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        let [b, s, _, _, hkv, _, _] = sizes(g, n);
        let (group, _, heads) = layout(g, n)?;
        let chunks = Dim::constant((group + heads - 1) / heads);
        Some(Shape::Rows(
            b.checked_mul(&s)?.checked_mul(&hkv)?.checked_mul(&chunks)?,
        ))
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some("#include \"attention/decode.cuh\"\n\n".to_string())
    }
    fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let [b, s, cache, hq, hkv, d, dv] = sizes(g, n);
        let (group, feats, heads) = layout(g, n)?;
        let e = element(Access::input(g, c, n, 0).dt);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "    // Attention over the key/value cache (kernels/attention/decode.cuh)."
        );
        let _ = writeln!(out, "    fs_attn_decode::Sizes s = {{}};");
        for (field, x) in [
            ("batch", &b),
            ("q_len", &s),
            ("cache_len", &cache),
            ("q_heads", &hq),
            ("kv_heads", &hkv),
            ("head_dim", &d),
            ("v_dim", &dv),
        ] {
            let _ = writeln!(out, "    s.{field} = {};", x.to_c());
        }
        let _ = writeln!(out, "    s.group = {group};");
        let _ = writeln!(out, "    s.scale = {};", float_lit(self.scale));
        let _ = writeln!(out, "    s.positions = {};", c.in_ptr(3));
        let storage = format!("{e}::Storage");
        for (i, name) in ["q", "k", "v"].iter().enumerate() {
            let _ = writeln!(
                out,
                "    const fs_attn_decode::View<const {storage}> {name} = {};",
                Access::input(g, c, n, i).init()
            );
        }
        let _ = writeln!(
            out,
            "    const fs_attn_decode::View<{storage}> o = {};",
            Access::output(g, c, n, 0).init()
        );
        let _ = writeln!(
            out,
            "    fs_attn_decode::forward<{e}, {feats}, {heads}, {}, {}>(q, k, v, o, s);",
            BLOCK / 32,
            unroll(feats)
        );
        Some(out)
    }
}

/// A block a row of logits (kernels/argmax.cuh).
impl Lower for ArgMax {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(Shape::Rows(rows_of(g, n)))
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some("#include \"argmax.cuh\"\n\n".to_string())
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        Some(format!(
            "        fs_argmax_row<{}>({} + row * C, {}, {} + row);\n",
            c.in_el(0),
            c.in_ptr(0),
            self.classes,
            c.out_ptr(0)
        ))
    }
}
