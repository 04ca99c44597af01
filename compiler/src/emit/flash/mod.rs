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

mod backward;
mod config;
mod forward;

pub use backward::flash_backward;
pub(crate) use config::Config;
pub use config::MAX_HEAD_DIM;
pub use forward::flash_forward;

use super::launch::{GridAxis, KernelLaunch};
use super::templates::Ctx;
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::kernel::{Kernel, Program};
use crate::ops::Op;
use config::{backward_config, forward_config};
use petgraph::stable_graph::NodeIndex;
use templates::Instance;
use tma::TensorMap;

pub use crate::target::FlashArch;

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

/// The templates' argument struct for elements of `dt` (`common.cuh`).
fn args_type(base: &str, dt: DType) -> String {
    match dt {
        DType::F32 => format!("{base}F32"),
        _ => base.to_string(),
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
