//! ZeRO stage 1: the optimizer state split over the data-parallel ranks.
//! The parameters, laid end to end in model order, are cut into `ranks`
//! equal runs of elements (multiples of 64, so every piece starts 256-byte
//! aligned); rank r owns run r. A rank keeps the optimizer state of its
//! pieces alone and updates only them; after the update each piece's owner
//! sends the new values to the other ranks (an NCCL broadcast per piece,
//! or `interp::peers::Peers::share` on the CPU reference). Every rank
//! computes the same pieces from the model alone, and each holds 1/N of
//! the state however the parameters' sizes fall (GPT-2's embedding is 31%
//! of its parameters: dealt whole, it would leave one rank 31% of the state).

use crate::ir::graph::{Graph, ParamInfo, Value};

use crate::ir::types::DType;
use crate::ops::Op;
use std::collections::{BTreeMap, BTreeSet};

pub use crate::shard::{Piece, ZeroStage, ALIGN};

/// Each parameter's pieces, in rank order (consecutive ranks).
pub fn pieces(params: &[ParamInfo], ranks: u32) -> Vec<Vec<Piece>> {
    let numels: Vec<u64> = params.iter().map(ParamInfo::numel).collect();
    crate::shard::pieces(&numels, ranks)
}

/// Why ZeRO cannot split these parameters over `ranks`: a rank would own
/// none of them (fewer than 64 elements a rank), and would then have no
/// state of its own to keep, update or gather.
pub fn unsplittable(params: &[ParamInfo], ranks: u32) -> Option<String> {
    let all = pieces(params, ranks);
    let owners: std::collections::BTreeSet<u32> = all.iter().flatten().map(|p| p.rank).collect();
    let total: u64 = params.iter().map(ParamInfo::numel).sum();
    (owners.len() < ranks as usize).then(|| {
        format!(
            "the model's {total} parameter elements leave {} of {ranks} ranks nothing to own (ZeRO cuts them in runs of at least {ALIGN})",
            ranks as usize - owners.len()
        )
    })
}

/// Rank `rank`'s piece of parameter `i`, if it owns one.
pub fn piece(params: &[ParamInfo], ranks: u32, rank: u32, i: usize) -> Option<Piece> {
    pieces(params, ranks)[i]
        .iter()
        .copied()
        .find(|p| p.rank == rank)
}

/// Whether `piece` is all of parameter `p`.
pub fn whole(p: &ParamInfo, piece: Piece) -> bool {
    piece.lo == 0 && piece.hi == p.numel()
}

/// Whether, under ZeRO with compute dtype `precision`, the ranks keep
/// parameter `i` in the compute dtype alone and its owners the f32 master
/// of their pieces as optimizer state: where the model computes in 16 bits
/// and the step reads the f32 parameter only through its one cast to the
/// compute dtype. Then each rank holds 2 bytes an element of it plus 4/N
/// of the master, and the owners send each other 16-bit pieces after the
/// update (Megatron-LM's distributed optimizer, DeepSpeed's ZeRO-1).
/// The same on every rank: it reads the graph alone.
pub fn keeps_master(g: &Graph, i: usize, precision: DType) -> bool {
    let p = &g.params[i];
    let users = g.users(Value {
        node: p.node,
        port: 0,
    });
    precision != DType::F32
        && p.ty.dtype == DType::F32
        && !users.is_empty()
        && users
            .iter()
            .all(|&(n, _)| matches!(&g.g[n].op, Op::Cast(c) if c.to == precision))
}

/// The optimizer state holding a parameter's f32 master pieces.
pub fn master_name(param: &str) -> String {
    format!("{param}.master")
}

/// Whether the ranks keep parameter `i` of `g` (a rank's step) in the
/// compute dtype and its owners an f32 master of it ([`keeps_master`] then
/// [`store_param_as`] made it so): its `param` node is stored in another
/// type than the model gives it.
pub fn has_master(g: &Graph, i: usize) -> bool {
    let p = &g.params[i];
    g.g[p.node].outputs[0].dtype != p.ty.dtype
}

/// Stores parameter `i` in `dtype`: its `param` node's type, which the
/// plan sizes its buffer by (the checkpoint's type stays the model's,
/// `ParamInfo::ty`).
pub fn store_param_as(g: &mut Graph, i: usize, dtype: DType) {
    let node = g.params[i].node;
    let ty = crate::ir::types::TensorType::new(dtype, g.params[i].ty.shape.clone());
    if let Op::Param(p) = &mut g.g[node].op {
        p.ty = ty.clone();
    }
    g.g[node].outputs[0] = ty;
}

/// ZeRO stage 3: stores parameter `i` as a rank's flat piece of `n`
/// elements, in the model's dtype (`ParamInfo::ty` keeps the whole
/// parameter's type, the checkpoint's).
pub fn store_param_piece(g: &mut Graph, i: usize, n: i64) {
    let node = g.params[i].node;
    let ty =
        crate::ir::types::TensorType::new(g.params[i].ty.dtype, vec![crate::ir::Dim::constant(n)]);
    if let Op::Param(p) = &mut g.g[node].op {
        p.ty = ty.clone();
    }
    g.g[node].outputs[0] = ty;
}

/// ZeRO: the states each parameter's owners keep across the whole job, by
/// name, with the parameter's index, from one rank's graph `g` and the
/// state names `local` of the ranks one process runs: for every parameter
/// with a gradient, each kind of state those ranks keep of any parameter
/// (`adam_m`, `adam_v`, `momentum`, and `master` where the ranks keep the
/// parameter in the compute dtype). The same on every rank of the job (it
/// reads the graph's structure, which the ranks share, and every rank owns
/// a piece: `unsplittable`), so the processes gather the same states in
/// the same order. Empty without ZeRO.
pub fn job_states(g: &Graph, local: &BTreeSet<String>) -> BTreeMap<String, usize> {
    use crate::ir::graph::Role;
    // A parameter with a gradient: one the step outputs, or (stage 2,
    // which keeps none whole) one a collective reduces to its owners.
    let graded: BTreeSet<usize> = g
        .outputs
        .iter()
        .filter_map(|(r, _)| match r {
            Role::Grad(i) => Some(*i),
            _ => None,
        })
        .chain(g.g.node_indices().filter_map(|n| match &g.g[n].op {
            Op::AllReduce(a) => a.owners_of,
            _ => None,
        }))
        .collect();
    // ZeRO: a parameter with a gradient that this rank does not update
    // whole in place (another rank owns it, or a piece of it).
    let updated_whole = |i: usize| {
        g.outputs.iter().any(|(r, v)| {
            let op = &g.g[v.node].op;
            *r == Role::NewParam(i)
                && matches!(op, Op::AdamW(_) | Op::Sgd(_))
                && op.update_range().is_none()
                && !op.update_master()
        })
    };
    if graded.iter().all(|&i| updated_whole(i)) {
        return BTreeMap::new();
    }
    let kinds: BTreeSet<&str> = local
        .iter()
        .filter_map(|name| {
            let (param, kind) = name.rsplit_once('.')?;
            (kind != "grad_acc" && g.params.iter().any(|p| p.name == param)).then_some(kind)
        })
        .collect();
    let mut out = BTreeMap::new();
    for &i in &graded {
        let p = &g.params[i];
        for &kind in &kinds {
            if kind != "master" || has_master(g, i) {
                out.insert(format!("{}.{kind}", p.name), i);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::types::{DType, TensorType};
    use crate::ir::Dim;

    fn param(n: i64) -> ParamInfo {
        ParamInfo {
            name: format!("p{n}"),
            ty: TensorType::new(DType::F32, vec![Dim::constant(n)]),
            init: crate::ir::graph::Init::Constant(0.0),
            decay: false,
            span: Default::default(),
            node: petgraph::stable_graph::NodeIndex::new(0),
        }
    }

    #[test]
    fn pieces_cover_every_element_once_and_balance_the_ranks() {
        let ps: Vec<ParamInfo> = [38_597_376, 768, 2304 * 768, 10, 3000].map(param).to_vec();
        for ranks in [1u32, 2, 3, 4, 8] {
            let all = pieces(&ps, ranks);
            let mut per_rank = vec![0u64; ranks as usize];
            for (p, ps_) in ps.iter().zip(&all) {
                // Consecutive pieces tile the parameter.
                let mut at = 0;
                for pc in ps_ {
                    assert_eq!(pc.lo, at);
                    at = pc.hi;
                    per_rank[pc.rank as usize] += pc.hi - pc.lo;
                }
                assert_eq!(at, p.numel());
            }
            let total: u64 = per_rank.iter().sum();
            let most = *per_rank.iter().max().unwrap();
            assert!(
                most <= total / ranks as u64 + ALIGN,
                "{ranks}: {per_rank:?}"
            );
        }
    }

    #[test]
    fn a_model_too_small_for_its_ranks_is_named() {
        let tiny: Vec<ParamInfo> = [10, 20].map(param).to_vec();
        let why = unsplittable(&tiny, 2).expect("30 elements over 2 ranks");
        assert!(why.contains("leave 1 of 2 ranks nothing to own"), "{why}");
        let big: Vec<ParamInfo> = [38_597_376, 768].map(param).to_vec();
        assert_eq!(unsplittable(&big, 8), None);
    }
}
