//! The embedding's backward: the gradient of a `[V, C]` table from the
//! gradients of the rows the tokens picked, `dW[v] = sum of dY[t] over the
//! tokens t with id v`, deterministic (no float atomics).
//!
//! Work item (group, run): a group of R table rows, their sums in shared
//! memory, over one of `splits` runs of the tokens. Its block scans its run's
//! ids four a thread at a time, a block scan turns the hits into places in a
//! shared list in token order, and every thread adds the listed tokens'
//! gradient rows to the columns it owns. A table of many rows (a vocabulary)
//! has groups enough to fill the GPU and one run, so each group's block
//! writes its rows; a table of few rows (token types, a small position
//! table) has few groups, so the tokens are cut into runs, each run's sums
//! go to f32 partials, and the last run of a group to finish (counted with
//! an atomic) adds them in run order. One scan of the ids per group, where
//! a block per row scanned them once per row.

use super::templates::Ctx;
use crate::ir::{Dim, Graph};
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

/// Shared memory for the group's sums (40 KiB: with the 4 KiB list, under
/// the 48 KiB a block may declare statically).
const SUMS_FLOATS: i64 = 10240;

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
    let w = work(g, n).filter(|w| w.splits > 1)?;
    let k = &c.k.name;
    Some(format!(
        "// Each run's sums of the table's rows, and each row group's finished runs.\n\
         __device__ float {k}_part[{}];\n__device__ unsigned {k}_done[{}] = {{0}};\n\n",
        w.splits * w.rows * w.cols,
        w.groups
    ))
}

pub(crate) fn kernel_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let w = work(g, n)?;
    let k = &c.k.name;
    let ins = g.inputs(n);
    let tokens = g
        .ty(ins[0])
        .shape
        .iter()
        .try_fold(Dim::constant(1), |a, d| a.checked_mul(d))?;
    let (r, groups, splits) = (w.per_group, w.groups, w.splits);
    let mut b = String::new();
    let _ = writeln!(
        b,
        "    // Table rows in groups of {r} (their sums in shared memory), the tokens in {splits} run(s)."
    );
    let _ = writeln!(
        b,
        "    const fs_i64 V = {}LL, C = {}LL, tokens = {}, groups = {groups}, splits = {splits};",
        w.rows,
        w.cols,
        tokens.to_c()
    );
    let _ = writeln!(b, "    constexpr int R = {r};");
    let _ = writeln!(
        b,
        "    __shared__ float acc[R * {}];\n    __shared__ int list[1024];",
        w.cols
    );
    if splits > 1 {
        let _ = writeln!(b, "    __shared__ bool last;");
    }
    let _ = writeln!(
        b,
        "    for (fs_i64 item = blockIdx.x; item < groups * splits; item += gridDim.x) {{"
    );
    let _ = writeln!(
        b,
        "        const fs_i64 grp = item / splits, run = item % splits, v0 = grp * R;"
    );
    let _ = writeln!(b, "        const int nr = V - v0 < R ? (int)(V - v0) : R;");
    let _ = writeln!(
        b,
        "        for (fs_i64 i = threadIdx.x; i < R * C; i += blockDim.x) acc[i] = 0.0f;\n        __syncthreads();"
    );
    let _ = writeln!(
        b,
        "        const fs_i64 t_lo = run * tokens / splits, t_hi = (run + 1) * tokens / splits;"
    );
    let _ = writeln!(
        b,
        "        for (fs_i64 t0 = t_lo; t0 < t_hi; t0 += 4 * (fs_i64)blockDim.x) {{"
    );
    let _ = writeln!(
        b,
        "            const fs_i64 t = t0 + 4 * (fs_i64)threadIdx.x;"
    );
    let _ = writeln!(b, "            bool hit[4];\n            int mine = 0;");
    let _ = writeln!(b, "            for (int s = 0; s < 4; ++s) {{ hit[s] = t + s < t_hi && (unsigned long long)(in0[t + s] - v0) < (unsigned long long)nr; mine += hit[s]; }}");
    let _ = writeln!(
        b,
        "            int count;\n            int at = fs_block_scan(mine, &count);"
    );
    let _ = writeln!(
        b,
        "            for (int s = 0; s < 4; ++s) if (hit[s]) list[at++] = (int)(t + s - t0);"
    );
    let _ = writeln!(b, "            __syncthreads();");
    let dy = c.ld(1, "tk * C + j");
    let _ = writeln!(
        b,
        "            for (int h = 0; h < count; ++h) {{\n                const fs_i64 tk = t0 + list[h], at_row = (in0[tk] - v0) * C;"
    );
    let _ = writeln!(
        b,
        "                for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) acc[at_row + j] += {dy};"
    );
    let _ = writeln!(b, "            }}");
    let _ = writeln!(
        b,
        "            __syncthreads();  // `list` is refilled by the next tokens"
    );
    let _ = writeln!(b, "        }}");
    if splits == 1 {
        let _ = writeln!(
            b,
            "        for (fs_i64 i = threadIdx.x; i < nr * C; i += blockDim.x) {}",
            c.st(0, "v0 * C + i", "acc[i]")
        );
    } else {
        let _ = writeln!(
            b,
            "        for (fs_i64 i = threadIdx.x; i < nr * C; i += blockDim.x) {k}_part[(run * V + v0) * C + i] = acc[i];"
        );
        let _ = writeln!(
            b,
            "        __threadfence();  // this run's sums are visible before it is counted"
        );
        let _ = writeln!(b, "        __syncthreads();");
        let _ = writeln!(b, "        if (threadIdx.x == 0) last = atomicAdd(&{k}_done[grp], 1u) == (unsigned)(splits - 1);");
        let _ = writeln!(b, "        __syncthreads();");
        let _ = writeln!(b, "        if (last) {{");
        let _ = writeln!(b, "            __threadfence();");
        let _ = writeln!(
            b,
            "            for (fs_i64 i = threadIdx.x; i < nr * C; i += blockDim.x) {{"
        );
        let _ = writeln!(b, "                float total = 0.0f;");
        let _ = writeln!(b, "                for (fs_i64 s = 0; s < splits; ++s) total += ((volatile float*){k}_part)[(s * V + v0) * C + i];");
        let _ = writeln!(b, "                {}", c.st(0, "v0 * C + i", "total"));
        let _ = writeln!(b, "            }}");
        let _ = writeln!(b, "            if (threadIdx.x == 0) {k}_done[grp] = 0;");
        let _ = writeln!(b, "        }}");
    }
    let _ = writeln!(
        b,
        "        __syncthreads();  // `acc` is cleared for the next item"
    );
    let _ = writeln!(b, "    }}");
    Some(b)
}
