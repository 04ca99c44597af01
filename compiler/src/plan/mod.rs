//! The memory plan: every stored buffer of a kernel program gets an offset
//! in one device arena, for concrete sizes of the symbolic dimensions.
//!
//! Parameters, their gradients, the optimizer state and the data inputs live
//! for the whole run and sit first. Every other buffer lives from the kernel
//! that writes it to the last kernel that reads it; those intervals are
//! packed greedily (largest first, lowest free offset), so buffers whose
//! lives do not overlap share memory. The optimizer writes new parameters
//! and state in place.

use crate::emit::templates::shape_of;
use crate::ir::graph::{Graph, Role};
use crate::kernel::{Body, Program};
use crate::ops::Op;
use crate::select::Selection;
use std::collections::BTreeMap;

mod arena;
pub mod collectives;
mod compiled;
pub use crate::kernel::gemm;
mod launches;
pub mod picture;
pub mod report;
pub mod roofline;
mod step;
pub mod trace;
pub mod unfused;
mod verify;

pub use compiled::{pieces, CompiledStep, StepParam};
// What the runtime reads of a step beside the plan: leaves of the crate,
// so that the ops and autodiff that make them need not import the plan.
pub use crate::{inputs, shard};
pub use step::*;

/// Offsets are multiples of this (cuBLASLt and 16-byte vector loads want it).
pub const ALIGN: u64 = 256;

/// The buffer holding the graph's output of this role, if any.
fn output_buffer(g: &Graph, p: &Program, role: &Role) -> Option<usize> {
    g.outputs
        .iter()
        .find(|(r, _)| r == role)
        .and_then(|(_, v)| p.buffer_of(*v))
}

/// No buffer, and no arena, is planned past this (sizes stay far from
/// u64 overflow in every offset sum).
const MAX_BYTES: u64 = 1 << 60;

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// The plan of program `p` with the generated kernels only (the simple
/// attention kernels, no tensor-core templates): [`plan_with`] without a
/// selection.
pub fn plan(g: &Graph, p: &Program, dims: &BTreeMap<String, i64>) -> Result<Plan, PlanError> {
    plan_with(g, p, None, dims)
}

/// The plan of program `p` for the kernels `selection` chose (its template
/// launches, with their scratch buffers placed in the arena), at the sizes
/// `dims`.
pub fn plan_with(
    g: &Graph,
    p: &Program,
    selection: Option<&Selection>,
    dims: &BTreeMap<String, i64>,
) -> Result<Plan, PlanError> {
    let missing: Vec<&str> = g
        .dims
        .iter()
        .filter(|d| !dims.contains_key(*d))
        .map(|s| s.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(PlanError(format!(
            "the memory plan needs a size for {}",
            missing.join(", ")
        )));
    }
    crate::ir::sizes::check(g, dims)
        .map_err(|d| PlanError(format!("{} ({})", d.message, d.help.join("; "))))?;
    let env = |s: &str| dims.get(s).copied();
    let mut out = arena::buffers(g, p, &env)?;
    let scratch_of = arena::add_scratch(p, selection, &env, &mut out)?;
    let outputs = arena::lifetimes(g, p, &mut out);
    let buckets = collectives::collectives(g, p, &out);
    collectives::place(&buckets, &mut out);
    let base = arena::place_whole_run(&mut out, &buckets)?;
    arena::share_in_place(g, p, &mut out, &outputs);
    let top = arena::place_temps(&mut out, base, p.kernels.len());
    let bytes_by_kind = arena::bytes_by_kind(&out, base, top);
    written_in_place(g, p, &out)?;
    let launches = launches::launches(g, p, selection, dims, &scratch_of)?;
    let plan = Plan {
        model: g.name.clone(),
        dims: dims.clone(),
        arena_bytes: top,
        bytes_by_kind,
        buffers: out,
        launches,
        target: selection.map(|s| s.target.describe()),
        fallbacks: selection.map_or(Vec::new(), |s| s.fallbacks.clone()),
        collectives: buckets,
        size_args: g.dims.clone(),
        loss: output_buffer(g, p, &Role::Loss),
        grad_norm: output_buffer(g, p, &Role::GradNorm),
        logits: output_buffer(g, p, &Role::Logits),
        token_losses: output_buffer(g, p, &Role::TokenLosses),
        next_tokens: output_buffer(g, p, &Role::NextTokens),
    };
    // Checked in every build: the check is linear in the buffers but for
    // the ones that overlap in the arena, and a clash would corrupt values
    // on the GPU without an error.
    plan.verify().map_err(|problems| {
        PlanError(format!(
            "internal error: the memory plan is invalid:\n  {}\nthis is a bug in fusec; please report it with the model file",
            problems.join("\n  ")
        ))
    })?;
    Ok(plan)
}

/// A cache write's kernel writes only the new rows, so its output must be
/// its cache's storage (a state whose new value it is: `decode_graph`
/// makes it so).
fn written_in_place(g: &Graph, p: &Program, out: &[PlannedBuffer]) -> Result<(), PlanError> {
    for k in &p.kernels {
        let writes = k
            .cache_writes(g)
            .into_iter()
            .map(|(i, o)| (k.inputs[i], k.outputs[o]));
        for (cache, written) in writes {
            if out[written].alias_of == Some(cache) {
                continue;
            }
            return Err(PlanError(format!(
                "internal error: {} writes a key/value cache's new rows, and its output is not the cache's storage\nthis is a bug in fusec; please report it with the model file",
                k.name
            )));
        }
    }
    Ok(())
}

/// Whether `kernel` reads input `slot` only at the element (or row) it
/// writes, after which the output may take that input's storage.
fn in_place_ok(g: &Graph, kernel: &crate::kernel::Kernel, slot: usize) -> bool {
    use crate::kernel::PExpr;
    match &kernel.body {
        Body::Pointwise(pw) => pw.exprs.iter().all(|e| match e {
            PExpr::Load { input, view } => *input != slot || view.is_contiguous(),
            _ => true,
        }),
        // A prologue's inputs are read as its chain reads them.
        Body::Op(_) if kernel.prologue.is_some() => false,
        // The residual is read at the element out0 writes.
        Body::Op(_) if kernel.residual == Some(slot) => true,
        Body::Op(n) => {
            shape_of(g, *n).is_some()
                && match &g.g[*n].op {
                    Op::Softmax(_)
                    | Op::LayerNorm(_)
                    | Op::RmsNorm(_)
                    | Op::CrossEntropyGrad(_)
                    | Op::CrossEntropyWithGrad(_)
                    | Op::CausalMask(_) => slot == 0,
                    Op::SoftmaxGrad(_) => slot <= 1,
                    _ => false,
                }
        }
        Body::Group(_) | Body::Gemm(..) => false,
    }
}

/// The textbook count for mixed-precision training with the plan's
/// optimizer: 4 bytes per parameter each for the f32 master weights and
/// gradients, plus the optimizer state as planned (8 bytes per parameter for
/// AdamW), plus every forward value the backward pass reads (the activations
/// kept for it), at its dtype.
pub fn textbook_bytes(g: &Graph, dims: &BTreeMap<String, i64>) -> Option<u64> {
    use crate::ir::graph::Phase;
    // A step that trains nothing (a decode step) has no such count.
    g.output(&Role::Loss)?;
    let env = |s: &str| dims.get(s).copied();
    let params = g.param_count()? as u64;
    let state: u64 = g
        .topo_order()
        .into_iter()
        .filter_map(|n| match &g.g[n].op {
            Op::State(st) => Some(st.ty.numel().eval(&env)? as u64 * 4),
            _ => None,
        })
        .sum();
    let mut kept = 0u64;
    for n in g.topo_order() {
        let node = &g.g[n];
        if node.phase != Phase::Forward || node.op.is_source() {
            continue;
        }
        for (port, ty) in node.outputs.iter().enumerate() {
            let v = crate::ir::Value { node: n, port };
            if g.users(v)
                .iter()
                .any(|(u, _)| g.g[*u].phase == Phase::Backward)
            {
                kept += ty.numel().eval(&env)? as u64 * ty.dtype.size_bytes() as u64;
            }
        }
    }
    Some(8 * params + state + kept)
}

/// Elements a buffer of `n` values of `shape` takes with its rows `pitch`
/// apart and `zero_rows` more rows after the last (a vector's rows are its
/// elements).
fn padded(n: u64, shape: &[i64], pitch: Option<i64>, zero_rows: i64) -> Option<u64> {
    if shape.len() == 1 {
        return n.checked_add(zero_rows as u64);
    }
    let Some(&last) = shape.last().filter(|&&l| l > 0) else {
        return Some(n);
    };
    let rows = (n / last as u64).checked_add(zero_rows as u64)?;
    rows.checked_mul(pitch.unwrap_or(last) as u64)
}
