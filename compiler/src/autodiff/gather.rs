//! ZeRO stage 3: every rank keeps its piece of each parameter alone (flat,
//! in the model's dtype: the piece is its own master weight), and the
//! whole parameter exists only while a pass reads it. For each parameter,
//! the step gathers the pieces (`all_gather`) once for the forward pass's
//! readers and once more for the backward pass's, each just before its
//! first reader (the step's order holds a gather, and the cast it
//! gathers, until a reader is taken: `ir::schedule`), so the forward
//! pass's copy dies with its last forward reader and the two never need to
//! live together. Where the model reads the parameter
//! through its cast to the compute dtype, the rank's piece is cast and the
//! gather moves the narrow values (half the bytes); the readers then take
//! the gathered value in place of the cast.
//!
//! The update (`update.rs`) reads and writes the piece in place; nothing
//! is sent after it, since the next step gathers the new pieces.

use super::zero::pieces;
use crate::ir::graph::{Graph, Phase, Value};
use crate::ir::types::{DType, TensorType};
use crate::ir::Dim;
use crate::ops::{AllGather, Cast, Op, OpError};
use petgraph::stable_graph::NodeIndex;
use std::collections::BTreeMap;

/// A reader of a parameter: (node, input slot), and whether it reads the
/// parameter's cast to the compute dtype (`true`) or the parameter itself.
type Reader = (NodeIndex, usize, bool);

/// Stores every parameter of `g` as rank `rank`'s piece (of `ranks`) and
/// gathers it whole before its readers, by pass (see the module's doc).
/// Called on the step before the update is built, so every reader is a
/// forward or backward node.
pub fn gather_params(
    g: &mut Graph,
    ranks: u32,
    rank: u32,
    precision: DType,
) -> Result<(), OpError> {
    let all = pieces(&g.params, ranks);
    for (i, owners) in all.iter().enumerate() {
        // Every rank's run, `(0, 0)` where it owns none.
        let tiles: Vec<(i64, i64)> = (0..ranks)
            .map(|r| {
                owners
                    .iter()
                    .find(|p| p.rank == r)
                    .map_or((0, 0), |p| (p.lo as i64, p.hi as i64))
            })
            .collect();
        let (lo, hi) = tiles[rank as usize];
        let whole = g.params[i].ty.clone();
        let shape: Vec<Dim> = whole.shape.clone();
        let param = Value {
            node: g.params[i].node,
            port: 0,
        };
        // A view read by both passes (the tied table's transpose, made in
        // the forward pass and read by the backward's product too) is
        // copied for the backward pass, so each pass's gather feeds views
        // of its own.
        let roots: Vec<Value> = std::iter::once(param)
            .chain(casts_of(g, param, precision))
            .collect();
        for root in roots {
            split_views(g, root)?;
        }
        let readers = readers(g, param, precision);
        // The casts that only fed the readers go with them (nothing else
        // may read a cast of the whole parameter once it is a piece).
        let casts: Vec<NodeIndex> = casts_of(g, param, precision)
            .into_iter()
            .map(|v| v.node)
            .collect();
        super::zero::store_param_piece(g, i, hi - lo);
        // One gather for each pass (and type) that reads the parameter.
        let mut groups: BTreeMap<(u8, bool), Vec<Reader>> = BTreeMap::new();
        for r in readers {
            let phase = pass_of(g, r.0);
            if phase == Phase::Update {
                return Err(OpError::new(
                    "ZeRO stage 3 gathers parameters for the forward and backward passes only",
                    format!("`{}` is read by the update", g.params[i].name),
                ));
            }
            groups.entry((phase as u8, r.2)).or_default().push(r);
        }
        let span = Some(g.params[i].span);
        for ((_, narrow), readers) in groups {
            let phase = pass_of(g, readers[0].0);
            let mut piece = param;
            if narrow {
                piece = g.add(Op::Cast(Cast { to: precision }), &[piece], span, phase)?[0];
            }
            let op = AllGather {
                rank,
                param: i,
                pieces: tiles.clone(),
                shape: shape.clone(),
            };
            let gathered = g.add(Op::AllGather(op), &[piece], span, phase)?[0];
            for (n, slot, via_cast) in readers {
                let from = if via_cast { g.inputs(n)[slot] } else { param };
                crate::passes::replace_use(g, from, gathered, (n, slot));
            }
        }
        for c in casts {
            let v = Value { node: c, port: 0 };
            if g.users(v).is_empty() && !g.outputs.iter().any(|(_, o)| *o == v) {
                g.g.remove_node(c);
            }
        }
        debug_assert_eq!(
            g.ty(param),
            &TensorType::new(whole.dtype, vec![Dim::constant(hi - lo)])
        );
    }
    Ok(())
}

/// The casts of parameter `param` to the compute dtype `precision`.
fn casts_of(g: &Graph, param: Value, precision: DType) -> Vec<Value> {
    if g.ty(param).dtype == precision {
        return Vec::new();
    }
    g.users(param)
        .into_iter()
        .filter(|&(n, _)| matches!(&g.g[n].op, Op::Cast(c) if c.to == precision))
        .map(|(n, _)| Value { node: n, port: 0 })
        .collect()
}

/// The pass a reader serves: its own, or for a view the pass of what reads
/// it (after [`split_views`], one pass), since a view stores nothing.
fn pass_of(g: &Graph, n: NodeIndex) -> Phase {
    if g.g[n].op.is_view() {
        if let Some(&(m, _)) = g.users(Value { node: n, port: 0 }).first() {
            return pass_of(g, m);
        }
    }
    g.g[n].phase
}

/// Gives every view of `root` (through chains of views) readers of one
/// pass alone: a view read by several is copied for each pass after the
/// first, the copy reading what the view reads.
fn split_views(g: &mut Graph, root: Value) -> Result<(), OpError> {
    for (n, _) in g.users(root) {
        if !g.g[n].op.is_view() {
            continue;
        }
        let view = Value { node: n, port: 0 };
        split_views(g, view)?;
        let mut by_pass: BTreeMap<u8, Vec<(NodeIndex, usize)>> = BTreeMap::new();
        for (m, slot) in g.users(view) {
            by_pass
                .entry(pass_of(g, m) as u8)
                .or_default()
                .push((m, slot));
        }
        for readers in by_pass.into_values().skip(1) {
            let phase = pass_of(g, readers[0].0);
            let (op, span) = (g.g[n].op.clone(), g.g[n].span);
            let copy = g.add(op, &g.inputs(n), span, phase)?[0];
            for r in readers {
                crate::passes::replace_use(g, view, copy, r);
            }
        }
    }
    Ok(())
}

/// Who reads parameter `param`: its readers, and the readers of its casts
/// to the compute dtype `precision` (which will read the gathered narrow
/// value instead).
fn readers(g: &Graph, param: Value, precision: DType) -> Vec<Reader> {
    let mut out = Vec::new();
    for (n, slot) in g.users(param) {
        match &g.g[n].op {
            Op::Cast(c) if c.to == precision && g.ty(param).dtype != precision => {
                let cast = Value { node: n, port: 0 };
                out.extend(g.users(cast).into_iter().map(|(m, s)| (m, s, true)));
            }
            _ => out.push((n, slot, false)),
        }
    }
    out
}
