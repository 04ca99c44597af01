//! The backward's kernels: which stages run under the deterministic or
//! the atomic scheme on each architecture, their grids, and the scratch
//! they share. Apart because the backward plans several launches an op,
//! each with its own tile, grid and tensor maps, and a scratch layout the
//! templates rely on: the largest part of the choice.

use super::config::backward_config;
use super::templates::{self, Instance};
use super::tma::TensorMap;
use super::wrapper::{self, fill_sizes, Fill};
use super::{args_type, launch, FlashArch, FlashKernel, Stage};
use crate::emit::access::Access;
use crate::emit::launch::GridAxis;
use crate::emit::templates::Ctx;
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::kernel::{Kernel, Program};
use petgraph::stable_graph::NodeIndex;

// What each backward kernel does, for its source's comment.
const ABOUT_DELTA: &str =
    "FlashAttention-2 backward, kernel 1 of 3: delta = rowsum(dO * O) (kernels/attention/backward.cuh)";
const ABOUT_DK_DV: &str =
    "FlashAttention-2 backward, kernel 2 of 3: dK and dV on tensor cores (kernels/attention/backward_sm80.cuh)";
const ABOUT_DQ: &str =
    "FlashAttention-2 backward, kernel 3 of 3: dQ on tensor cores (kernels/attention/backward_sm80.cuh)";
const ABOUT_DKDVDQ_SM80: &str =
    "FlashAttention-2 backward, kernel 2 of 3: dK, dV and dQ by atomics on tensor cores (kernels/attention/backward_sm80.cuh)";
const ABOUT_DK_DV_F32: &str =
    "FlashAttention-2 backward, kernel 2 of 3: dK and dV on TF32 tensor cores (kernels/attention/backward_f32.cuh)";
const ABOUT_DQ_F32: &str =
    "FlashAttention-2 backward, kernel 3 of 3: dQ on TF32 tensor cores (kernels/attention/backward_f32.cuh)";
const ABOUT_DKDVDQ_F32: &str =
    "FlashAttention-2 backward, kernel 2 of 3: dK, dV and dQ by atomics on TF32 tensor cores (kernels/attention/backward_f32.cuh)";
const ABOUT_DKV_STORE: &str =
    "FlashAttention backward on Hopper, grouped queries split over blocks: dK and dV = the sum of the blocks' parts (kernels/attention/backward.cuh)";
const ABOUT_DQ_STORE: &str =
    "FlashAttention-2 backward, kernel 3 of 3: dQ = scale * the f32 sum (kernels/attention/backward.cuh)";

/// One backward kernel chosen.
struct Planned {
    stage: Stage,
    instance: Instance,
    grid: [GridAxis; 3],
    tensor_maps: Vec<TensorMap>,
    /// What it does, for its source's comment.
    about: &'static str,
}

impl Planned {
    /// A kernel that takes no tensor maps, its grid from its tile.
    fn new(stage: Stage, instance: Instance, grid: [GridAxis; 3], about: &'static str) -> Self {
        Planned {
            stage,
            instance,
            grid,
            tensor_maps: Vec::new(),
            about,
        }
    }
}

/// The backward's kernels for `attention_grad` op `n` in plan kernel `k`
/// (its inputs q, k, v, o, lse, dO and outputs dq, dk, dv in op order), in
/// launch order, on `arch`; `None` when the op is not supported (see the
/// module docs). `deterministic` picks the scheme: delta, dK/dV and dQ
/// (every product recomputed where it is needed: 7 tile products, no
/// atomics, bit-identical from run to run), or delta (which also clears an
/// f32 dQ sum), dK/dV with dQ added into that sum by atomics, and a pass
/// that stores dQ (5 tile products, as FlashAttention-2 does; the order of
/// the additions, so dQ's last bits, vary between runs). `tf32`: f32
/// products in one TF32 mma rather than three.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    n: NodeIndex,
    source: Option<&str>,
    deterministic: bool,
    arch: FlashArch,
    tf32: bool,
) -> Option<Vec<FlashKernel>> {
    let c = Ctx::for_op(g, p, k, n);
    let cfg = backward_config(g, &c, n).ok()?;
    if cfg.f32_backward_problem().is_some() {
        return None;
    }
    let arch = cfg.backward_arch(arch);
    let (dt, d, dv, causal) = (cfg.dt, cfg.d, cfg.dv, cfg.causal);
    let mut f = Fill::new();
    for (i, field) in ["q", "k", "v", "o", "dout"].into_iter().enumerate() {
        f.heads(field, &Access::input(g, &c, n, if i == 4 { 5 } else { i }));
    }
    f.rows("lse", &Access::input(g, &c, n, 4));
    for (o, field) in ["dq", "dk", "dv"].into_iter().enumerate() {
        f.heads(field, &Access::output(g, &c, n, o));
    }
    fill_sizes(&mut f, &cfg);
    f.set("scale", crate::emit::cuda::float_lit(cfg.scale));
    let rows = cfg
        .batch
        .checked_mul(&cfg.q_heads)?
        .checked_mul(&cfg.q_len)?;
    // The Hopper dK/dV/dQ kernel's blocks a key tile (grouped queries at
    // high ratios).
    let split = if !deterministic && arch == FlashArch::Sm90a && dt != DType::F32 {
        templates::dkdvdq_split(cfg.group)
    } else {
        1
    };
    // Deterministic: delta [B, Hq, T]. Atomic: the dQ sum [B, Hq, T, D]
    // first (16-byte aligned rows for the vector reductions), then delta;
    // split, then from the next 16-byte boundary the dK/dV parts
    // [B, S, Hkv, split, D + Dv] (backward.cuh's `dkv_parts_of`).
    let scratch = if deterministic {
        rows
    } else if split > 1 {
        let parts = cfg
            .batch
            .checked_mul(&cfg.kv_len)?
            .checked_mul(&cfg.kv_heads)?
            .checked_mul(&Dim::constant((split * (d + dv)) as i64))?;
        rows.checked_mul(&Dim::constant(d as i64 + 1))?
            .checked_add(&Dim::constant(3))?
            .checked_add(&parts)?
    } else {
        rows.checked_mul(&Dim::constant(d as i64 + 1))?
    };
    let q_grid = |tile: u64| {
        [
            GridAxis::new(cfg.q_len.clone(), tile),
            GridAxis::new(cfg.q_heads.clone(), 1),
            GridAxis::new(cfg.batch.clone(), 1),
        ]
    };
    let kv_grid = |tile: u64| {
        [
            GridAxis::new(cfg.kv_len.clone(), tile),
            GridAxis::new(cfg.kv_heads.clone(), 1),
            GridAxis::new(cfg.batch.clone(), 1),
        ]
    };
    let kv_heads_split = cfg.kv_heads.checked_mul(&Dim::constant(split as i64))?;
    // The tensor maps of Q and dO, boxes of the widest swizzle that divides
    // `q_feats` and `do_feats` features by `rows` rows (the kernel's query
    // tile).
    let hopper_maps = |q_feats: u64, do_feats: u64, rows: u64| {
        [(0, "tm_q", q_feats), (5, "tm_do", do_feats)]
            .into_iter()
            .map(|(i, name, feats)| TensorMap::of_input(g, &c, n, i, name, rows, feats))
            .collect::<Option<Vec<_>>>()
    };
    let mut stages: Vec<Planned> = Vec::new();
    let delta = templates::delta(dt, d, dv, !deterministic);
    stages.push(Planned::new(
        Stage::Delta,
        delta.clone(),
        q_grid(delta.tile),
        ABOUT_DELTA,
    ));
    if deterministic && dt == DType::F32 {
        let drop = cfg.dropout.is_some();
        let dkdv = templates::dkdv_f32(d, dv, causal, false, drop, !tf32);
        stages.push(Planned::new(
            Stage::DkDv,
            dkdv.clone(),
            kv_grid(dkdv.tile),
            ABOUT_DK_DV_F32,
        ));
        let dq = templates::dq_f32(d, dv, causal, drop, !tf32);
        stages.push(Planned::new(
            Stage::Dq,
            dq.clone(),
            q_grid(dq.tile),
            ABOUT_DQ_F32,
        ));
    } else if deterministic {
        let dkdv = cfg.drop(templates::dkdv_sm80(dt, d, dv, causal, false));
        stages.push(Planned::new(
            Stage::DkDv,
            dkdv.clone(),
            kv_grid(dkdv.tile),
            ABOUT_DK_DV,
        ));
        let dq = templates::dq_sm80(dt, d, dv, causal, cfg.dropout.is_some());
        stages.push(Planned::new(
            Stage::Dq,
            dq.clone(),
            q_grid(dq.tile),
            ABOUT_DQ,
        ));
    } else {
        // Hopper's own dK/dV/dQ kernel: the narrow one up to 128 padded
        // features, the wide one (64 keys a block, features split between the
        // warpgroups) above; the tiles of Q and dO copied by TMA, whose boxes
        // divide what each warpgroup reads.
        let hopper = if arch != FlashArch::Sm90a || dt == DType::F32 {
            None
        } else if templates::dkdvdq_sm90_fits(d, dv) {
            let inst = templates::dkdvdq_sm90(dt, d, dv, causal, split, cfg.dropout.is_some());
            let rows = templates::dkdvdq_sm90_tile_q(d, dv, cfg.dropout.is_some());
            hopper_maps(templates::pad16(d), templates::pad16(dv), rows).map(|maps| {
                (
                    inst,
                    maps,
                    "FlashAttention backward on Hopper tensor cores, kernel 2 of 3: dK, dV and dQ (kernels/attention/backward_sm90.cuh)",
                )
            })
        } else {
            let (inst, q_half, do_half) = templates::dkdvdq_sm90_wide(dt, d, dv, causal, split);
            hopper_maps(q_half, do_half, 64).map(|maps| {
                (
                    inst,
                    maps,
                    "FlashAttention backward on Hopper tensor cores for wide heads, kernel 2 of 3: dK, dV and dQ (kernels/attention/backward_sm90_wide.cuh)",
                )
            })
        };
        match hopper {
            Some((inst, maps, about)) => {
                let mut grid = kv_grid(inst.tile);
                grid[1] = GridAxis::new(kv_heads_split.clone(), 1);
                stages.push(Planned {
                    stage: Stage::DkDvDq,
                    instance: inst.clone(),
                    grid,
                    tensor_maps: maps,
                    about,
                });
                if split > 1 {
                    let store = templates::dkv_store(dt, d, dv, split);
                    stages.push(Planned::new(
                        Stage::DkvStore,
                        store.clone(),
                        kv_grid(store.tile),
                        ABOUT_DKV_STORE,
                    ));
                }
            }
            None if dt == DType::F32 => {
                let inst = templates::dkdv_f32(d, dv, causal, true, cfg.dropout.is_some(), !tf32);
                stages.push(Planned::new(
                    Stage::DkDvDq,
                    inst.clone(),
                    kv_grid(inst.tile),
                    ABOUT_DKDVDQ_F32,
                ));
            }
            None => {
                let inst = cfg.drop(templates::dkdv_sm80(dt, d, dv, causal, true));
                stages.push(Planned::new(
                    Stage::DkDvDq,
                    inst.clone(),
                    kv_grid(inst.tile),
                    ABOUT_DKDVDQ_SM80,
                ));
            }
        }
        let store = templates::dq_store(dt, d);
        stages.push(Planned::new(
            Stage::DqStore,
            store.clone(),
            q_grid(store.tile),
            ABOUT_DQ_STORE,
        ));
    }
    let out = stages
        .into_iter()
        .map(
            |Planned {
                 stage,
                 instance: inst,
                 grid,
                 tensor_maps: maps,
                 about,
             }| {
                let name = format!("{}_{}", k.name, stage.suffix());
                let about = format!("{about}:\n{}.", cfg.about());
                let source = wrapper::kernel(
                    g,
                    &c,
                    source,
                    &name,
                    &about,
                    &inst,
                    &args_type("BackwardArgs", dt),
                    &f,
                    true,
                    &maps,
                );
                FlashKernel {
                    stage,
                    launch: launch(&name, source, &inst, grid, Some(scratch.clone()), maps),
                }
            },
        )
        .collect();
    Some(out)
}
