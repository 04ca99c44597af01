//! The forward's kernel: one launch per op, its template picked by
//! architecture, dtype and whether the persistent Hopper forward applies.
//! Apart from the backward (backward.rs), with which it shares only the
//! config and the launch helpers of mod.rs.

use super::config::forward_config;
use super::templates;
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

/// The forward's kernel for attention op `n` in plan kernel `k` (its inputs
/// q, k, v and outputs O, lse in op order) on `arch`, under the plan
/// kernel's name; `None` when the op is not supported (see the module docs).
/// `multiprocessors`: the GPU's, which bound the persistent Hopper
/// forward's grid (any count is correct; the GPU's own keeps every
/// multiprocessor busy with one block). `tf32`: f32 products in one TF32
/// mma rather than three.
#[allow(clippy::too_many_arguments)]
pub fn flash_forward(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    n: NodeIndex,
    source: Option<&str>,
    arch: FlashArch,
    multiprocessors: u32,
    tf32: bool,
) -> Option<FlashKernel> {
    let c = Ctx::for_op(g, p, k, n);
    let cfg = forward_config(g, &c, n).ok()?;
    let (dt, d, dv, causal, fold) = (cfg.dt, cfg.d, cfg.dv, cfg.causal, cfg.scale_in_exp());
    let mut f = Fill::new();
    f.heads("q", &Access::input(g, &c, n, 0));
    f.heads("k", &Access::input(g, &c, n, 1));
    f.heads("v", &Access::input(g, &c, n, 2));
    f.heads("o", &Access::output(g, &c, n, 0));
    f.rows("lse", &Access::output(g, &c, n, 1));
    fill_sizes(&mut f, &cfg);
    let hopper = if arch == FlashArch::Sm90a && dt != DType::F32 {
        // The persistent forward's warpgroups take turns item after item,
        // which assumes every item's key tiles alike: with lengths, the
        // forward that keeps a block a query tile; dropout is in that one too.
        let persistent_ok = cfg.lengths.is_none() && cfg.dropout.is_none();
        let (inst, tile_k, persistent) = templates::forward_sm90(
            dt,
            d,
            dv,
            causal,
            fold,
            persistent_ok,
            cfg.dropout.is_some(),
        );
        let maps = [
            (1, "tm_k", templates::swizzle_pad(d)),
            (2, "tm_v", templates::swizzle_pad(dv)),
        ]
        .into_iter()
        .map(|(i, name, padded)| TensorMap::of_input(g, &c, n, i, name, tile_k, padded))
        .collect::<Option<Vec<_>>>();
        maps.map(|m| (inst, m, persistent))
    } else {
        None
    };
    let persistent = matches!(hopper, Some((_, _, true)));
    let (inst, maps, about) = match hopper {
        _ if dt == DType::F32 => (
            templates::forward_f32(d, dv, causal, fold, cfg.dropout.is_some(), !tf32),
            Vec::new(),
            "FlashAttention-2 forward for f32 on TF32 tensor cores (kernels/attention/forward_f32.cuh)",
        ),
        Some((inst, maps, _)) => (
            inst,
            maps,
            if persistent {
                "FlashAttention forward on Hopper tensor cores, persistent (kernels/attention/forward_sm90_persistent.cuh)"
            } else {
                "FlashAttention forward on Hopper tensor cores (kernels/attention/forward_sm90.cuh)"
            },
        ),
        None => (
            cfg.drop(templates::forward_sm80(dt, d, dv, causal, fold)),
            Vec::new(),
            "FlashAttention-2 forward on tensor cores (kernels/attention/forward_sm80.cuh)",
        ),
    };
    let about = format!("{about}:\n{}.", cfg.about());
    let grid = if persistent {
        // Persistent: a block a multiprocessor walks the (query tile, head,
        // batch) items in the template's order.
        let rows = cfg.q_heads.checked_mul(&cfg.batch)?;
        let one = || GridAxis::new(Dim::constant(1), 1);
        [
            GridAxis::persistent(cfg.q_len.clone(), inst.tile, rows, multiprocessors as u64),
            one(),
            one(),
        ]
    } else {
        [
            GridAxis::new(cfg.q_len.clone(), inst.tile),
            GridAxis::new(cfg.q_heads.clone(), 1),
            GridAxis::new(cfg.batch.clone(), 1),
        ]
    };
    let source = wrapper::kernel(
        g,
        &c,
        source,
        &k.name,
        &about,
        &inst,
        &args_type("ForwardArgs", dt),
        &f,
        false,
        &maps,
    );
    Some(FlashKernel {
        stage: Stage::Forward,
        launch: launch(&k.name, source, &inst, grid, None, maps),
    })
}
