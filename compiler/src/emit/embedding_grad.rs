//! The embedding's backward, `dW[v] = sum of dY[t] over the tokens t with
//! id v` (deterministic, no float atomics), as a call into
//! kernels/embedding.cuh, whose work items and algorithm that header
//! describes. This file chooses the template's sizes: how many table rows a
//! group sums in shared memory, and into how many runs the tokens are cut so
//! that a table of few rows (token types, a small position table) still
//! fills the GPU; and it declares the runs' partials where there are runs.

use super::templates::Ctx;
use crate::ir::{Dim, Graph};
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;

/// Shared memory for the group's sums (40 KiB: with the 4 KiB list, under
/// the 48 KiB a block may declare statically); kernels/embedding.cuh's
/// `FS_EMBEDDING_SUMS`, which its `static_assert` holds a group to.
const SUMS_FLOATS: i64 = 10240;

/// What an embedding-gradient kernel's file includes.
const INCLUDE: &str = "#include \"embedding.cuh\"\n\n";

/// Most rows a group sums.
const ROWS: i64 = 16;

/// Blocks enough to fill a GPU a few times over.
const BLOCKS: i64 = 528;

/// Most f32 partials a table's runs keep (4 MiB).
const PARTIALS: i64 = 1 << 20;

/// Widest row this kernel takes (one row's sums in shared memory).
pub(crate) const MAX_COLS: i64 = SUMS_FLOATS;

struct Work {
    rows: i64,
    cols: i64,
    per_group: i64,
    groups: i64,
    splits: i64,
}

fn work(g: &Graph, n: NodeIndex) -> Option<Work> {
    if !matches!(g.g[n].op, Op::EmbeddingGrad(_)) {
        return None;
    }
    let shape = &g.g[n].outputs[0].shape;
    let (rows, cols) = (shape[0].as_const()?, shape[1].as_const()?);
    if rows <= 0 || cols <= 0 || cols > MAX_COLS {
        return None;
    }
    let per_group = (SUMS_FLOATS / cols).clamp(1, ROWS).min(rows);
    let groups = (rows + per_group - 1) / per_group;
    let splits = if groups >= BLOCKS {
        1
    } else {
        ((BLOCKS + groups - 1) / groups)
            .min(64)
            .min(PARTIALS / (rows * cols))
            .max(1)
    };
    Some(Work {
        rows,
        cols,
        per_group,
        groups,
        splits,
    })
}

/// Blocks of the launch: groups times runs.
pub(crate) fn blocks(g: &Graph, n: NodeIndex) -> Option<Dim> {
    work(g, n).map(|w| Dim::constant(w.groups * w.splits))
}

/// The runs' partials and each group's count of finished runs, where the
/// tokens are cut into runs.
pub(crate) fn file_scope(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let w = work(g, n)?;
    if w.splits == 1 {
        return Some(INCLUDE.to_string());
    }
    let k = &c.k.name;
    Some(format!(
        "{INCLUDE}// Each run's sums of the table's rows, and each row group's finished runs.\n\
         __device__ float {k}_part[{}];\n__device__ unsigned {k}_done[{}] = {{0}};\n\n",
        w.splits * w.rows * w.cols,
        w.groups
    ))
}

pub(crate) fn kernel_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let w = work(g, n)?;
    let k = &c.k.name;
    let tokens = g
        .ty(g.inputs(n)[0])
        .shape
        .iter()
        .try_fold(Dim::constant(1), |a, d| a.checked_mul(d))?;
    let (part, done) = if w.splits > 1 {
        (format!("{k}_part"), format!("{k}_done"))
    } else {
        ("nullptr".to_string(), "nullptr".to_string())
    };
    Some(format!(
        "    // Table rows in groups of {r} (their sums in shared memory), the tokens in {s} run(s).\n    \
         fs_embedding_grad<{dy}, {dw}, {v}LL, {cols}LL, {r}, {s}>({ids}, {dyp}, {dwp}, {t}, {part}, {done});\n",
        r = w.per_group,
        s = w.splits,
        dy = c.in_el(1),
        dw = c.out_el(0),
        v = w.rows,
        cols = w.cols,
        ids = c.in_ptr(0),
        dyp = c.in_ptr(1),
        dwp = c.out_ptr(0),
        t = tokens.to_c(),
    ))
}
