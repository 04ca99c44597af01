//! The tensor-core attention: which `kernels/attention/` template runs each
//! `attention` and `attention_grad` op on an architecture, with which
//! parameters, and how it is launched. The algorithms live in the templates
//! (CUDA C++ a person can read and compile on their own); what is written
//! here is the choice and a small `extern "C"` wrapper per op
//! (`wrapper.rs`) that fills the template's arguments from the op's views.
//!
//! Any bf16, f16 or f32 attention whose head dims (of q and k, and of v)
//! are multiples of 8 up to 256, with constant head counts and 16-byte
//! aligned contiguous rows, runs on tensor cores; the head dims are padded
//! to whole tensor-core steps inside the tiles. Anything else keeps the
//! plan's simple kernels (`emit/attention.rs`), and the build report names
//! it.
//!
//! - f32: `ForwardF32`; backward `Delta`, `DkDvF32<ATOMIC>`, `DqStore`
//!   (atomic) or `Delta`, `DkDvF32`, `DqF32` (deterministic), up to 256
//!   features in D + Dv (wider heads' backward keeps the simple kernels):
//!   TF32 mma.sync with 3xTF32 products (about f32's precision; one product
//!   with `tf32`), on every architecture from sm_80.
//! - Forward: `ForwardSm90` (wgmma, TMA, warp-specialized) on sm_90a where
//!   q, k and v can be described to the tensor copies, else `ForwardSm80`
//!   (mma.sync).
//! - Backward, atomic scheme (the default): `Delta` (which also clears an
//!   f32 dQ sum), the dK/dV kernel adding each tile's dS K into that sum by
//!   atomics (on sm_90a `DkDvDqSm90` up to 128 padded features and
//!   `DkDvDqSm90Wide` above, both split over blocks with `DkvStore` after
//!   them for groups of more than 4 query heads; else `DkDvSm80<ATOMIC>`), then
//!   `DqStore`. Deterministic scheme: `Delta`, `DkDvSm80`, `DqSm80`, no
//!   atomics.
//! - Dropout (`DROPOUT`, the templates' last parameter): both forwards (on
//!   Hopper the per-tile one), `DkDvDqSm90` up to 192 padded features in all (D = Dv = 96) and
//!   the mma.sync backward for every head dim (wider heads' Hopper backward
//!   drops on it).
//!
//! # Launch contract
//!
//! Every kernel takes the plan kernel's arguments (its inputs and outputs
//! as arena addresses, the kernel applying the views itself, then every
//! symbolic size as `long long`); backward kernels then one `float*`
//! scratch of [`KernelLaunch::scratch_f32`] elements, the same buffer for
//! the launches of one op (its contents on entry irrelevant: the
//! first writes what the others read); Hopper kernels last their tensor
//! maps by value. Grid, block and dynamic shared memory are the launch's.
//! Every buffer is 16-byte aligned (the arena aligns to 256).

pub mod templates;
pub mod tma;
mod wrapper;

use super::access::Access;
use super::launch::{GridAxis, KernelLaunch};
use super::templates::Ctx;
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::kernel::{Kernel, Program};
use crate::ops::{AttnDropout, Op};
use petgraph::stable_graph::NodeIndex;
use templates::Instance;
use tma::TensorMap;
use wrapper::{fill_sizes, Fill};

/// Which tensor-core instructions the attention kernels are written with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashArch {
    /// `mma.sync.m16n8k16` and `ldmatrix`: sm_80 and newer.
    Sm80,
    /// `wgmma.mma_async` from shared-memory descriptors and bulk tensor
    /// copies: sm_90a only, compiled for `sm_90a`.
    Sm90a,
}

impl FlashArch {
    /// The best kernel family for a GPU of compute capability `cap`; `None`
    /// before sm_80 (no bf16 mma).
    pub fn for_capability(cap: (i32, i32)) -> Option<FlashArch> {
        match cap {
            (9, 0) => Some(FlashArch::Sm90a),
            c if c >= (8, 0) => Some(FlashArch::Sm80),
            _ => None,
        }
    }
}

/// Which job a launch does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// O and the log-sum-exp.
    Forward,
    /// delta = rowsum(dO * O) into the scratch (and, atomic scheme, the dQ
    /// sum cleared).
    Delta,
    /// dK and dV.
    DkDv,
    /// dQ (deterministic scheme).
    Dq,
    /// dK and dV, and dQ summed with atomics into the scratch.
    DkDvDq,
    /// dQ = scale * the scratch's sum, in dQ's type.
    DqStore,
    /// dK and dV from the parts of a split dK/dV/dQ kernel.
    DkvStore,
}

impl Stage {
    /// The suffix of a backward launch's kernel name.
    pub fn suffix(self) -> &'static str {
        match self {
            Stage::Forward => "",
            Stage::Delta => "delta",
            Stage::DkDv => "dkdv",
            Stage::Dq => "dq",
            Stage::DkDvDq => "dkdvdq",
            Stage::DqStore => "dqstore",
            Stage::DkvStore => "dkvstore",
        }
    }
}

/// One tensor-core attention kernel and its launch.
#[derive(Clone, Debug, PartialEq)]
pub struct FlashKernel {
    pub stage: Stage,
    pub launch: KernelLaunch,
}

/// An attention op's sizes when the tensor-core kernels support it.
pub(crate) struct Config {
    pub(crate) batch: Dim,
    pub(crate) q_len: Dim,
    pub(crate) kv_len: Dim,
    pub(crate) q_heads: Dim,
    pub(crate) kv_heads: Dim,
    pub(crate) d: u64,
    pub(crate) dv: u64,
    pub(crate) group: i64,
    pub(crate) causal: bool,
    pub(crate) scale: f64,
    pub(crate) dt: DType,
    /// The kernel parameter holding each batch entry's key count, where
    /// the op masks padded keys by their lengths.
    pub(crate) lengths: Option<String>,
    /// The op's dropout and the kernel parameter holding the step's key.
    pub(crate) dropout: Option<(AttnDropout, String)>,
}

/// The largest head dim on tensor cores.
pub const MAX_HEAD_DIM: u64 = 256;

impl Config {
    /// For op `n` with q, k, v its inputs 0..3, or why the tensor-core
    /// kernels do not take it: they need bf16 or f16 with head dims that are
    /// multiples of 8 up to 256, constant head counts, the inputs in `tiled`
    /// in 16-byte aligned contiguous rows, the inputs and outputs listed as
    /// f32 in f32 and every other one in q's dtype.
    fn of(
        g: &Graph,
        c: &Ctx,
        n: NodeIndex,
        (causal, scale): (bool, f64),
        tiled: &[usize],
        f32_in: &[usize],
        f32_out: &[usize],
    ) -> Result<Config, String> {
        let ins = g.inputs(n);
        if c.ins.len() != ins.len() || c.outs.len() != g.g[n].outputs.len() {
            return Err("it shares its kernel with other ops".into());
        }
        let ((lengths, key), dropout) = match &g.g[n].op {
            Op::Attention(a) => (a.extra_slots(), a.dropout),
            Op::AttentionGrad(a) => (a.extra_slots(), a.dropout),
            _ => ((None, None), None),
        };
        let key = dropout.zip(key);
        let (q, k, v) = (g.ty(ins[0]), g.ty(ins[1]), g.ty(ins[2]));
        let dt = q.dtype;
        if !matches!(dt, DType::BF16 | DType::F16 | DType::F32) {
            return Err(format!(
                "it computes in {} (tensor cores take bf16, f16 or f32)",
                dt.name()
            ));
        }
        let want = |i: usize| {
            if Some(i) == lengths || Some(i) == key.map(|k| k.1) {
                DType::I32
            } else if f32_in.contains(&i) {
                DType::F32
            } else {
                dt
            }
        };
        let want_out = |f32: bool| if f32 { DType::F32 } else { dt };
        if (0..ins.len()).any(|i| c.in_dt(i) != want(i))
            || (0..c.outs.len()).any(|o| c.out_dt(o) != want_out(f32_out.contains(&o)))
        {
            return Err(
                "an input or output is stored in another type (a cast fused into its kernel)"
                    .into(),
            );
        }
        let size = |t: &crate::ir::TensorType, what: &str| {
            t.shape[3]
                .as_const()
                .and_then(|x| u64::try_from(x).ok())
                .ok_or_else(|| format!("the head dim of {what} is not a constant"))
        };
        let (d, dv) = (size(q, "q")?, size(v, "v")?);
        for (x, what) in [(d, "q and k"), (dv, "v")] {
            if x == 0 || !x.is_multiple_of(8) || x > MAX_HEAD_DIM {
                return Err(format!(
                    "the head dim of {what} is {x} (the tensor-core kernels take multiples of 8 up to {MAX_HEAD_DIM})"
                ));
            }
        }
        if k.shape[3].as_const() != Some(d as i64) {
            return Err("the head dims of q and k differ".into());
        }
        let heads = |t: &crate::ir::TensorType| t.shape[2].as_const().filter(|&h| h > 0);
        let (Some(hq), Some(hk)) = (heads(q), heads(k)) else {
            return Err("its head counts are not constants".into());
        };
        if let Some(&i) = tiled
            .iter()
            .find(|&&i| !Access::input(g, c, n, i).rows_aligned())
        {
            return Err(format!(
                "input {} is not read in contiguous rows starting 16-byte aligned",
                i + 1
            ));
        }
        Ok(Config {
            batch: q.shape[0].clone(),
            q_len: q.shape[1].clone(),
            kv_len: k.shape[1].clone(),
            q_heads: q.shape[2].clone(),
            kv_heads: k.shape[2].clone(),
            d,
            dv,
            group: hq / hk,
            causal,
            scale,
            dt,
            lengths: lengths.map(|i| Access::input(g, c, n, i).ptr),
            dropout: key.map(|(d, i)| (d, Access::input(g, c, n, i).ptr)),
        })
    }

    /// Whether the scale can go into the exponent after the row max: the
    /// test is on the f32 factor the kernel uses, as one that rounds to 0
    /// would make a masked score's -inf * 0 a NaN.
    fn scale_in_exp(&self) -> bool {
        (self.scale * std::f64::consts::LOG2_E) as f32 > 0.0
    }

    fn elem_name(&self) -> &'static str {
        match self.dt {
            DType::F16 => "f16",
            DType::F32 => "f32 (3xTF32 products)",
            _ => "bf16",
        }
    }

    /// Why the f32 backward does not run on tensor cores, where it does not.
    fn f32_backward_problem(&self) -> Option<String> {
        if self.dt != DType::F32 {
            None
        } else if !templates::f32_backward_fits(self.d, self.dv) {
            Some(format!(
                "its head dims {} and {} add up to more than the 256 features the f32 backward holds",
                self.d, self.dv
            ))
        } else {
            None
        }
    }

    /// One line on what the kernel computes, for its source's comment.
    fn about(&self) -> String {
        let mut s = format!(
            "{}, head dims {} (q, k) and {} (v), {}, {} query head{} per key/value head",
            self.elem_name(),
            self.d,
            self.dv,
            if self.causal { "causal" } else { "not causal" },
            self.group,
            if self.group == 1 { "" } else { "s" }
        );
        if let Some((d, _)) = &self.dropout {
            s += &format!(", dropout {} on the probabilities", d.p);
        }
        s
    }

    /// The family the backward runs on: Hopper's kernels drop only up to
    /// 192 features in all (D = Dv = 96), so wider heads drop on the
    /// mma.sync templates, which run on every GPU from sm_80.
    fn backward_arch(&self, arch: FlashArch) -> FlashArch {
        if self.dropout.is_some() && !templates::dkdvdq_sm90_drops(self.d, self.dv) {
            FlashArch::Sm80
        } else {
            arch
        }
    }

    /// `inst` with the dropout its op has (the last parameter, `DROPOUT`,
    /// of both forwards and the mma.sync backward, defaults to false).
    fn drop(&self, inst: Instance) -> Instance {
        if self.dropout.is_some() {
            inst.with_dropout()
        } else {
            inst
        }
    }
}

fn forward_config(g: &Graph, c: &Ctx, n: NodeIndex) -> Result<Config, String> {
    let Op::Attention(op) = &g.g[n].op else {
        return Err("it is not an attention".into());
    };
    Config::of(g, c, n, (op.causal, op.scale), &[0, 1, 2], &[], &[1])
}

fn backward_config(g: &Graph, c: &Ctx, n: NodeIndex) -> Result<Config, String> {
    let Op::AttentionGrad(op) = &g.g[n].op else {
        return Err("it is not an attention gradient".into());
    };
    // q, k, v, o and dO are read in 16-byte tiles; lse is f32.
    Config::of(g, c, n, (op.causal, op.scale), &[0, 1, 2, 3, 5], &[4], &[])
}

/// Why attention (or attention gradient) op `n` in plan kernel `k` does
/// not run on the tensor-core kernels; `None` when it does (or is no
/// attention).
pub fn why_not(g: &Graph, p: &Program, k: &Kernel, n: NodeIndex) -> Option<String> {
    let c = Ctx::for_op(g, p, k, n);
    match &g.g[n].op {
        Op::Attention(_) => forward_config(g, &c, n).err(),
        Op::AttentionGrad(_) => match backward_config(g, &c, n) {
            Ok(cfg) => cfg.f32_backward_problem(),
            Err(e) => Some(e),
        },
        _ => None,
    }
}

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

/// The templates' argument struct for elements of `dt` (`common.cuh`).
fn args_type(base: &str, dt: DType) -> String {
    match dt {
        DType::F32 => format!("{base}F32"),
        _ => base.to_string(),
    }
}

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

fn launch(
    name: &str,
    source: String,
    inst: &Instance,
    mut grid: [GridAxis; 3],
    scratch: Option<Dim>,
    maps: Vec<TensorMap>,
) -> KernelLaunch {
    grid[0].copies = inst.parts;
    KernelLaunch {
        name: name.to_string(),
        source,
        template: Some(inst.ty.clone()),
        arch_specific: inst.sm90,
        grid,
        block: inst.threads,
        dynamic_smem_bytes: inst.smem,
        scratch_f32: scratch,
        tensor_maps: maps,
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
