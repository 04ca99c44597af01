//! The loss head in chunks of rows: a language model's last product (the
//! logits, B x T x V) with its cross-entropy and their gradients, run a
//! block of rows at a time, so that the whole logits (and their gradient,
//! which takes their storage) are never stored at once. For GPT-2 small at
//! B = 32, T = 1024 they are 3.1 GiB of bf16, the largest buffer of the
//! step; in chunks of 4096 rows, 393 MiB.
//!
//! A stage at the step's sizes, after the pass pipeline (the fused
//! `cross_entropy_with_grad` is its anchor): for each chunk of rows the
//! product, the loss and its gradient, the input's gradient (concatenated
//! after the last chunk) and the weight's gradient (the chunks' products
//! summed after the last).
//! The chunks take their turns one after the other where the cross-entropy
//! had its turn (`Node::sub_turn`), so each chunk's logits are dead before
//! the next chunk's are made, and the arena reuses their storage.
//!
//! The rewrite is taken only where the graph is exactly that: the logits
//! read by the cross-entropy alone, their gradient read by two products
//! (through reshapes and transposes that keep the rows in order) and
//! nothing else. Anything else (a bias on the logits, the logits returned
//! as an output) keeps the whole logits, and `chunk` says why.

use crate::ir::graph::{Phase, Value};
use crate::ir::{Dim, Graph};
use crate::ops::{BinaryKind, Concat, MatMul, Op, Permute, Reshape, Slice};
use petgraph::stable_graph::NodeIndex;
use std::collections::BTreeMap;

/// One line for `fusec passes`.
pub const ABOUT: &str = "a language model's logits, their cross-entropy and their gradients made a chunk of rows at a time, so the whole B x T x V logits are never stored: where they would take over 512 MiB, or as --loss-head-rows says (report.txt says how)";

/// How many rows of logits the step computes at a time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rows {
    /// In chunks where the whole logits would be large ([`auto_rows`]).
    #[default]
    Auto,
    /// All rows at once (the step as autodiff made it).
    All,
    /// At most this many rows a chunk.
    At(u64),
}

impl std::str::FromStr for Rows {
    type Err = String;
    fn from_str(s: &str) -> Result<Rows, String> {
        match s.trim() {
            "auto" => Ok(Rows::Auto),
            "all" => Ok(Rows::All),
            n => match n.parse::<u64>() {
                Ok(0) | Err(_) => Err(format!(
                    "`{s}` is not a number of rows: give auto, all, or a positive number such as 4096"
                )),
                Ok(r) => Ok(Rows::At(r)),
            },
        }
    }
}

/// Chunks are whole multiples of this many rows (the products' tiles),
/// except the last.
pub const ROW_ALIGN: u64 = 128;

/// Under [`Rows::Auto`], the logits are chunked where the whole would
/// exceed this many bytes.
pub const AUTO_ABOVE_BYTES: u64 = 512 << 20;

/// Under [`Rows::Auto`], chunks of at most this many bytes, and at least
/// two: each chunk adds a weight-gradient partial kept to the end (GPT-2:
/// 74 MiB) and products of fewer rows, which run further from the GPU's
/// rate (H100, gpt2-small at B = 32: seven chunks of 4736 rows cost 4.6%
/// of the step, most of it in the partials' running sum since removed;
/// two of 4096 at B = 8 nothing measurable).
pub const AUTO_CHUNK_BYTES: u64 = 1 << 30;

/// The rows of a chunk under [`Rows::Auto`] for `rows` rows of `row_bytes`
/// bytes: `None` (all at once) where the whole is within
/// [`AUTO_ABOVE_BYTES`]; else the rows split evenly into as few chunks
/// (two or more) as keep each within [`AUTO_CHUNK_BYTES`], rounded up to
/// [`ROW_ALIGN`].
pub fn auto_rows(rows: u64, row_bytes: u64) -> Option<u64> {
    let whole = rows.checked_mul(row_bytes)?;
    if whole <= AUTO_ABOVE_BYTES || row_bytes == 0 {
        return None;
    }
    let chunks = whole.div_ceil(AUTO_CHUNK_BYTES).max(2);
    let per = rows.div_ceil(chunks).div_ceil(ROW_ALIGN) * ROW_ALIGN;
    (per < rows).then_some(per)
}

/// What the stage did to one loss head.
#[derive(Clone, Debug, PartialEq)]
pub struct Chunked {
    pub chunks: usize,
    /// Rows of every chunk but the last.
    pub rows: u64,
    /// Rows in all.
    pub total_rows: u64,
    /// The whole logits' bytes, and one chunk's.
    pub whole_bytes: u64,
    pub chunk_bytes: u64,
}

impl Chunked {
    /// The report's paragraph.
    pub fn describe(&self) -> String {
        format!(
            "loss head in {} chunks of {} rows (of {}): logits and their gradient {} a chunk, never the whole {}\n",
            self.chunks,
            self.rows,
            self.total_rows,
            crate::recompute::size(self.chunk_bytes),
            crate::recompute::size(self.whole_bytes),
        )
    }
}

/// A tensor seen through reshapes and transposes as a matrix of rows (one
/// a position of the leading axes, in order) and features: `Rows` is
/// [rows, features], `Cols` its transpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    Rows,
    Cols,
}

/// Follows `v` back through views to `base`, if it is reached through
/// reshapes and permutations that keep the rows of `base` (its leading
/// axes flattened) in order and its last axis (`features` long) whole:
/// how `v` lays those rows out.
fn rows_of(g: &Graph, v: Value, base: Value, features: &Dim) -> Option<Layout> {
    if v == base {
        return Some(Layout::Rows);
    }
    // Only through views: anything else ends the walk here, rather than
    // recursing back through the whole network to its inputs.
    if v.port != 0 || !matches!(g.g[v.node].op, Op::Reshape(_) | Op::Permute(_)) {
        return None;
    }
    let from = rows_of(g, g.inputs(v.node)[0], base, features)?;
    let t = g.ty(v);
    let r = t.rank();
    match (&g.g[v.node].op, from) {
        (Op::Reshape(_), Layout::Rows) => {
            (t.shape.last() == Some(features)).then_some(Layout::Rows)
        }
        (Op::Reshape(_), Layout::Cols) => {
            (t.shape.first() == Some(features)).then_some(Layout::Cols)
        }
        (Op::Permute(p), Layout::Rows) if r >= 2 => {
            // The features to the front, the rows' axes in order.
            let front: Vec<usize> = std::iter::once(r - 1).chain(0..r - 1).collect();
            (p.perm == front).then_some(Layout::Cols)
        }
        (Op::Permute(p), Layout::Cols) if r >= 2 => {
            let back: Vec<usize> = (1..r).chain(std::iter::once(0)).collect();
            (p.perm == back).then_some(Layout::Rows)
        }
        _ => None,
    }
}

/// Whether `a` and `b` are one matrix and its transpose (through 2-D
/// transposes of one base).
fn transposes(g: &Graph, a: Value, b: Value) -> bool {
    let strip = |mut v: Value| {
        let mut flips = 0;
        while v.port == 0 {
            match &g.g[v.node].op {
                Op::Permute(p) if p.perm == [1, 0] => {
                    flips += 1;
                    v = g.inputs(v.node)[0];
                }
                _ => break,
            }
        }
        (v, flips % 2)
    };
    let (ba, fa) = strip(a);
    let (bb, fb) = strip(b);
    (ba == bb || same_gather(g, ba, bb)) && fa != fb && g.ty(a).rank() == 2
}

/// Whether `a` and `b` are gathers of one parameter in one type (ZeRO
/// stage 3 gathers a weight again for the backward pass): the same values.
fn same_gather(g: &Graph, a: Value, b: Value) -> bool {
    match (&g.g[a.node].op, &g.g[b.node].op) {
        (Op::AllGather(x), Op::AllGather(y)) => x == y && g.ty(a) == g.ty(b),
        _ => false,
    }
}

/// The product a value flows into through views each read only by the
/// next: (the product, the value as the product reads it).
fn product_after(g: &Graph, v: Value) -> Option<(NodeIndex, Value)> {
    let mut at = v;
    loop {
        let users = g.users(at);
        if users.len() != 1 {
            return None;
        }
        let (u, _) = users[0];
        match &g.g[u].op {
            Op::MatMul(_) => return Some((u, at)),
            Op::Reshape(_) | Op::Permute(_) => at = Value { node: u, port: 0 },
            _ => return None,
        }
    }
}

/// Why a loss head keeps its whole logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Whole {
    /// Something besides the cross-entropy reads the logits (or the step
    /// returns them).
    LogitsShared,
    /// The logits are not a product alone (a bias added to them, say).
    NotOneProduct,
    /// The product is not activations [.., C] times a matrix [C, V].
    NotTimesWeight,
    /// The step returns the logits' gradient.
    GradientIsOutput,
    /// Something besides the backward pass's two products reads the
    /// logits' gradient.
    GradientShared,
    /// A product reading the logits' gradient is not the input's or the
    /// weight's gradient as autodiff writes them.
    UnknownProduct,
}

impl std::fmt::Display for Whole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Whole::LogitsShared => "the logits are read by more than the cross-entropy",
            Whole::NotOneProduct => "the logits are not one product (a bias added to them, say)",
            Whole::NotTimesWeight => "the logits' product is not activations times a weight matrix",
            Whole::GradientIsOutput => "the logits' gradient is an output of the step",
            Whole::GradientShared => {
                "the logits' gradient is read by more than the two products of the backward pass"
            }
            Whole::UnknownProduct => {
                "a product reading the logits' gradient is not the input's or the weight's gradient"
            }
        })
    }
}

/// One loss head as the rewrite needs it.
struct Head {
    ce: NodeIndex,
    /// The activations [.., C] and the weight as the product reads it [C, V].
    a: Value,
    w: Value,
    /// The input gradient's product (dlogits x w^T) and the weight
    /// gradient's, with whether it is [V, C] (dlogits^T x a) rather than
    /// [C, V] (a^T x dlogits).
    da: NodeIndex,
    w_t: Value,
    dw: NodeIndex,
    dw_vc: bool,
}

/// Why the head at `ce` cannot be chunked, or what it is.
fn head(g: &Graph, ce: NodeIndex) -> Result<Head, Whole> {
    let ins = g.inputs(ce);
    let logits = ins[0];
    if g.users(logits).len() != 1 || g.outputs.iter().any(|(_, v)| *v == logits) {
        return Err(Whole::LogitsShared);
    }
    if !matches!(g.g[logits.node].op, Op::MatMul(_)) {
        return Err(Whole::NotOneProduct);
    }
    let mm = g.inputs(logits.node);
    let (a, w) = (mm[0], mm[1]);
    let (at, wt) = (g.ty(a), g.ty(w));
    if wt.rank() != 2 || at.rank() < 2 {
        return Err(Whole::NotTimesWeight);
    }
    let c = wt.shape[0].clone();
    let v = wt.shape[1].clone();
    if at.shape.last() != Some(&c) {
        return Err(Whole::NotTimesWeight);
    }
    let dl = Value { node: ce, port: 0 };
    if g.outputs.iter().any(|(_, x)| *x == dl) {
        return Err(Whole::GradientIsOutput);
    }
    let users = g.users(dl);
    if users.len() != 2 {
        return Err(Whole::GradientShared);
    }
    let (mut da, mut dw) = (None, None);
    for &(u, _) in &users {
        let first = Value { node: u, port: 0 };
        let (p, read) = match &g.g[u].op {
            Op::MatMul(_) => (u, dl),
            _ => product_after(g, first).ok_or(Whole::GradientShared)?,
        };
        let pin = g.inputs(p);
        let out = g.ty(Value { node: p, port: 0 });
        if read == dl && pin[0] == dl && out.shape == at.shape && transposes(g, pin[1], w) {
            da = Some((p, pin[1]));
            continue;
        }
        // dlogits^T a ([V, C]) or a^T dlogits ([C, V]), each as [F, N] x [N, F'].
        let lay = |x: Value, base: Value, f: &Dim| rows_of(g, x, base, f);
        let vc =
            lay(pin[0], dl, &v) == Some(Layout::Cols) && lay(pin[1], a, &c) == Some(Layout::Rows);
        let cv =
            lay(pin[0], a, &c) == Some(Layout::Cols) && lay(pin[1], dl, &v) == Some(Layout::Rows);
        if (vc || cv) && out.rank() == 2 {
            dw = Some((p, vc));
            continue;
        }
        return Err(Whole::UnknownProduct);
    }
    let ((da, w_t), (dw, dw_vc)) = da.zip(dw).ok_or(Whole::UnknownProduct)?;
    Ok(Head {
        ce,
        a,
        w,
        da,
        w_t,
        dw,
        dw_vc,
    })
}

/// Chunks each loss head of `g` at sizes `dims` as `rows` says. Returns
/// what was chunked, and for each head left whole where chunks were asked
/// for, why.
pub fn chunk(
    g: &mut Graph,
    dims: &BTreeMap<String, i64>,
    rows: Rows,
) -> Result<(Vec<Chunked>, Vec<Whole>), String> {
    if rows == Rows::All {
        return Ok((Vec::new(), Vec::new()));
    }
    let env = |s: &str| dims.get(s).copied();
    let heads: Vec<NodeIndex> =
        g.g.node_indices()
            .filter(|&n| matches!(g.g[n].op, Op::CrossEntropyWithGrad(_)))
            .collect();
    let (mut done, mut left) = (Vec::new(), Vec::new());
    for ce in heads {
        let mut h = match head(g, ce) {
            Ok(h) => h,
            Err(why) => {
                if matches!(rows, Rows::At(_)) {
                    left.push(why);
                }
                continue;
            }
        };
        let lt = g.ty(Value { node: ce, port: 0 }).clone();
        let n_dim = lt.shape[..lt.rank() - 1]
            .iter()
            .try_fold(Dim::constant(1), |acc, d| acc.checked_mul(d))
            .ok_or("dimension overflow")?;
        let (Some(n), Some(v)) = (
            n_dim.eval(&env).and_then(|n| u64::try_from(n).ok()),
            lt.shape[lt.rank() - 1]
                .eval(&env)
                .and_then(|v| u64::try_from(v).ok()),
        ) else {
            continue;
        };
        let row_bytes = v.saturating_mul(lt.dtype.size_bytes() as u64);
        let per = match rows {
            Rows::Auto => auto_rows(n, row_bytes),
            Rows::At(r) => (r < n).then_some(r),
            Rows::All => None,
        };
        let Some(per) = per else { continue };
        let chunks = n.div_ceil(per) as usize;
        share_forward_gather(g, &mut h);
        rewrite(g, &h, &n_dim, per, chunks).map_err(|e| {
            format!("internal error: chunking the loss head failed: {e}; this is a bug in fusec")
        })?;
        done.push(Chunked {
            chunks,
            rows: per,
            total_rows: n,
            whole_bytes: n.saturating_mul(row_bytes),
            chunk_bytes: per.saturating_mul(row_bytes),
        });
    }
    if !done.is_empty() {
        crate::passes::Pass::run(&crate::passes::Dce, g);
    }
    Ok((done, left))
}

/// ZeRO stage 3 gathers a tied weight again for the backward pass, but
/// the chunks' input-gradient products run while the forward pass's
/// gather still lives (the next chunk's logits read it): they read that
/// one, and the backward pass's copy, read by nothing else, goes (the
/// dead-code pass after the chunks removes it). Two copies of GPT-2's
/// table would otherwise be the step's peak.
fn share_forward_gather(g: &mut Graph, h: &mut Head) {
    let base = |g: &Graph, mut v: Value| {
        while g.g[v.node].op.is_view() {
            v = g.inputs(v.node)[0];
        }
        v
    };
    let (fw, bw) = (base(g, h.w), base(g, h.w_t));
    if fw == bw || !same_gather(g, fw, bw) {
        return;
    }
    if h.w_t == bw {
        h.w_t = fw;
        return;
    }
    let mut v = h.w_t;
    loop {
        let x = g.inputs(v.node)[0];
        if x == bw {
            crate::passes::replace_use(g, bw, fw, (v.node, 0));
            return;
        }
        v = x;
    }
}

/// Replaces head `h` by `chunks` chunks of `per` rows (the last the rest
/// of `n` rows).
fn rewrite(g: &mut Graph, h: &Head, n: &Dim, per: u64, chunks: usize) -> Result<(), String> {
    let e = |x: crate::ops::OpError| x.to_string();
    let ins = g.inputs(h.ce);
    let (logits, t, dloss) = (ins[0], ins[1], ins[2]);
    let Op::CrossEntropyWithGrad(ce_op) = g.g[h.ce].op.clone() else {
        unreachable!("the anchor is a cross_entropy_with_grad")
    };
    let ce_span = g.g[h.ce].span;
    let mm_span = g.g[logits.node].span;
    let da_span = g.g[h.da].span;
    let dw_span = g.g[h.dw].span;
    let turn = g.turn_of(h.ce);
    let a_ty = g.ty(h.a).clone();
    let c = a_ty.shape[a_ty.rank() - 1].clone();
    let t_shape = g.ty(t).shape.clone();
    let old_da = Value {
        node: h.da,
        port: 0,
    };
    let old_dw = Value {
        node: h.dw,
        port: 0,
    };
    let old_loss = Value {
        node: h.ce,
        port: 1,
    };
    let bw = Phase::Backward;
    let mut sub = 1u32;
    let add =
        |g: &mut Graph, op: Op, ins: &[Value], span, sub: u32| -> Result<Vec<Value>, String> {
            let out = g.add(op, ins, span, bw).map_err(e)?;
            for v in &out {
                g.g[v.node].turn = Some(turn);
                g.g[v.node].sub_turn = sub;
            }
            Ok(out)
        };
    let flat = |shape: Vec<Dim>| Op::from(Reshape { shape });
    let a2 = add(g, flat(vec![n.clone(), c.clone()]), &[h.a], mm_span, sub)?[0];
    let t1 = add(g, flat(vec![n.clone()]), &[t], ce_span, sub)?[0];
    let dl1 = add(g, flat(vec![n.clone()]), &[dloss], ce_span, sub)?[0];
    let (mut das, mut losses, mut dws) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..chunks {
        let start = Dim::constant((i as u64 * per) as i64);
        let end = if i + 1 == chunks {
            n.clone()
        } else {
            Dim::constant(((i as u64 + 1) * per) as i64)
        };
        let rows = |axis| {
            Op::from(Slice {
                axis,
                start: start.clone(),
                end: end.clone(),
            })
        };
        let ac = add(g, rows(0), &[a2], mm_span, sub)?[0];
        let tc = add(g, rows(0), &[t1], ce_span, sub)?[0];
        let dlc = add(g, rows(0), &[dl1], ce_span, sub)?[0];
        let lc = add(g, MatMul.into(), &[ac, h.w], mm_span, sub)?[0];
        let out = add(g, ce_op.clone().into(), &[lc, tc, dlc], ce_span, sub)?;
        let (dlogits, loss) = (out[0], out[1]);
        das.push(add(g, MatMul.into(), &[dlogits, h.w_t], da_span, sub)?[0]);
        losses.push(loss);
        let tr = || Op::from(Permute { perm: vec![1, 0] });
        let dwc = if h.dw_vc {
            let dlt = add(g, tr(), &[dlogits], dw_span, sub)?[0];
            add(g, MatMul.into(), &[dlt, ac], dw_span, sub)?[0]
        } else {
            let act = add(g, tr(), &[ac], dw_span, sub)?[0];
            add(g, MatMul.into(), &[act, dlogits], dw_span, sub)?[0]
        };
        dws.push(dwc);
        sub += 1;
    }
    let da = add(g, Concat { axis: 0 }.into(), &das, da_span, sub)?[0];
    let da = add(g, flat(a_ty.shape.clone()), &[da], da_span, sub)?[0];
    let loss = add(g, Concat { axis: 0 }.into(), &losses, ce_span, sub)?[0];
    let loss = add(g, flat(t_shape), &[loss], ce_span, sub)?[0];
    // The weight's gradient: the chunks' products summed after the last,
    // from the last back, so no add reads a product beside a sum made
    // before it and fusion adds them all in the kernel that reads the sum
    // (with the tied embedding's gradient, for GPT-2) instead of as each
    // next product's residual: cuBLASLt ran that product with its residual
    // at half the plain product's rate (H100, 4736 x 768 x 50304: 837
    // against 468 us), more time than the partials' memory is worth.
    let mut dw = *dws.last().expect("at least one chunk");
    for &p in dws.iter().rev().skip(1) {
        let sum = crate::ops::Binary {
            kind: BinaryKind::Add,
        };
        dw = add(g, sum.into(), &[p, dw], dw_span, sub)?[0];
    }
    if g.ty(dw) != g.ty(old_dw) || g.ty(da) != g.ty(old_da) || g.ty(loss) != g.ty(old_loss) {
        return Err("the chunks' results do not have the types of what they replace".into());
    }
    crate::passes::replace_uses(g, old_da, da);
    crate::passes::replace_uses(g, old_dw, dw);
    crate::passes::replace_uses(g, old_loss, loss);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_rows_split_large_logits_evenly_on_tile_multiples() {
        // GPT-2's vocabulary padded to 50304 columns of bf16.
        let row = 50304 * 2;
        // B = 4 (402 MiB): whole.
        assert_eq!(auto_rows(4096, row), None);
        // B = 8 (786 MiB): two chunks of 4096 rows.
        assert_eq!(auto_rows(8192, row), Some(4096));
        // B = 32 (3.1 GiB): four chunks of 8192 rows, at most 1 GiB each.
        assert_eq!(auto_rows(32768, row), Some(8192));
        // B = 24 (2.4 GiB): three chunks of 8192 rows.
        assert_eq!(auto_rows(24576, row), Some(8192));
        // Rows that split unevenly: tile multiples, the last chunk shorter.
        let per = auto_rows(3 * 1000 * 1023, row).unwrap();
        assert_eq!(per % ROW_ALIGN, 0);
        assert!(per * row <= AUTO_CHUNK_BYTES + ROW_ALIGN * row, "{per}");
    }

    #[test]
    fn rows_parse_as_the_flag_takes_them() {
        assert_eq!("auto".parse::<Rows>(), Ok(Rows::Auto));
        assert_eq!("all".parse::<Rows>(), Ok(Rows::All));
        assert_eq!("4096".parse::<Rows>(), Ok(Rows::At(4096)));
        assert!("0".parse::<Rows>().unwrap_err().contains("positive"));
        assert!("lots".parse::<Rows>().is_err());
    }
}
