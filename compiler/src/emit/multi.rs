//! Multi-tensor kernels: one launch over many tensors. The global gradient
//! norm reads every gradient once, one block per fixed chunk, each block
//! writing its own partial sum (deterministic: no atomics, fixed order).

use super::templates::{Ctx, Shape};
use crate::ir::Graph;
use crate::ops::{Op, ReduceKind};
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

pub fn shape_of(g: &Graph, n: NodeIndex) -> Option<Shape> {
    match &g.g[n].op {
        Op::SumSquares(_) => Some(Shape::Rows(g.g[n].outputs[0].shape[0].clone())),
        _ => column_tiles(g, n).map(|t| Shape::Rows(crate::ir::Dim::constant(t))),
    }
}

/// Columns per tile of a leading-axis sum: a warp's worth, so each row of
/// a tile is one coalesced load.
const TILE: i64 = 32;

/// Most row runs per column tile: each tile's rows are cut into runs, each
/// a block's work, so a bias gradient over B*T rows and a few hundred
/// columns still fills the GPU.
const SPLITS: i64 = 64;

/// Most f32 partials a column sum keeps in its own device memory (4 MiB):
/// wide sums (a 50257-entry bias) take fewer runs per tile.
const PARTIALS: i64 = 1 << 20;

/// The work of a sum over leading axes with a known number of outputs
/// (every bias gradient): column tiles, and runs of rows per tile.
struct ColumnSum {
    cols: i64,
    tiles: i64,
    splits: i64,
}

fn column_sum_of(g: &Graph, n: NodeIndex) -> Option<ColumnSum> {
    let Op::Reduce(r) = &g.g[n].op else {
        return None;
    };
    let leading = r.axes.iter().enumerate().all(|(i, &a)| i == a);
    let cols = g.g[n].outputs[0].numel().as_const()?;
    (leading && matches!(r.kind, ReduceKind::Sum | ReduceKind::Mean) && cols > 0).then(|| {
        ColumnSum {
            cols,
            tiles: (cols + TILE - 1) / TILE,
            splits: (PARTIALS / cols).clamp(1, SPLITS),
        }
    })
}

/// How many blocks a leading-axis sum's kernel takes (tiles times runs),
/// where it has one.
pub fn column_tiles(g: &Graph, n: NodeIndex) -> Option<i64> {
    column_sum_of(g, n).map(|w| w.tiles * w.splits)
}

/// File-scope storage of a column sum: each (tile, run)'s f32 partials
/// and each tile's count of finished runs. The last run of a tile to
/// finish resets its count, so the next launch (or a graph replay) starts
/// from zero.
pub(crate) fn file_scope(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let w = column_sum_of(g, n)?;
    let k = &c.k.name;
    Some(format!(
        "// The row splits' partial sums and each column tile's finished splits.\n\
         __device__ float {k}_part[{}];\n__device__ unsigned {k}_done[{}] = {{0}};\n\n",
        w.splits * w.cols,
        w.tiles
    ))
}

/// A sum over leading axes, [rows, C] -> [C]. Work item w is a tile of 32
/// columns and one of `splits` runs of the rows; a block's threads split into
/// 32 lanes (columns) by blockDim/32 row slices, each thread sums every
/// slices-th row of its run and column, the slices add up in a fixed order
/// into the run's partial, and the last run of a tile to finish (counted
/// with an atomic) adds the tile's partials in run order. Coalesced, and
/// deterministic: the atomic only counts.
fn column_sum(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let Op::Reduce(r) = &g.g[n].op else {
        return None;
    };
    let ColumnSum { tiles, splits, .. } = column_sum_of(g, n)?;
    let ins = g.inputs(n);
    let sh = &g.ty(ins[0]).shape;
    let rows = sh[..r.axes.len()]
        .iter()
        .try_fold(crate::ir::Dim::constant(1), |a, d| a.checked_mul(d))?;
    let cols = g.g[n].outputs[0].numel();
    let k = &c.k.name;
    let mut b = String::new();
    let _ = writeln!(
        b,
        "    // Sum over the leading axes: column j of a [rows, C] matrix, by tiles of columns and runs of rows."
    );
    let _ = writeln!(
        b,
        "    const fs_i64 rows = {}, C = {}, tiles = {tiles}, splits = {splits};",
        rows.to_c(),
        cols.to_c()
    );
    let _ = writeln!(b, "    const int lanes = blockDim.x < {TILE} ? blockDim.x : {TILE}, slices = blockDim.x / lanes;");
    let _ = writeln!(
        b,
        "    const int lane = threadIdx.x % lanes, slice = threadIdx.x / lanes;"
    );
    let _ = writeln!(
        b,
        "    __shared__ float part[256];\n    __shared__ bool last;"
    );
    let _ = writeln!(
        b,
        "    for (fs_i64 w = blockIdx.x; w < tiles * splits; w += gridDim.x) {{"
    );
    let _ = writeln!(
        b,
        "        const fs_i64 tile = w / splits, run = w % splits;"
    );
    let _ = writeln!(
        b,
        "        const fs_i64 r0 = run * rows / splits, r1 = (run + 1) * rows / splits;"
    );
    let _ = writeln!(b, "        for (fs_i64 j0 = tile * {TILE}; j0 < tile * {TILE} + {TILE} && j0 < C; j0 += lanes) {{");
    let _ = writeln!(b, "            const fs_i64 j = j0 + lane;");
    let _ = writeln!(b, "            float acc = 0.0f;");
    let _ = writeln!(
        b,
        "            if (j < C && slice < slices) for (fs_i64 r = r0 + slice; r < r1; r += slices) acc += {};",
        c.ld(0, "r * C + j")
    );
    let _ = writeln!(b, "            part[threadIdx.x] = acc;");
    let _ = writeln!(b, "            __syncthreads();");
    let _ = writeln!(b, "            if (slice == 0 && j < C) {{");
    let _ = writeln!(b, "                float total = 0.0f;");
    let _ = writeln!(
        b,
        "                for (int s = 0; s < slices; ++s) total += part[s * lanes + lane];"
    );
    let _ = writeln!(b, "                {k}_part[run * C + j] = total;");
    let _ = writeln!(b, "            }}");
    let _ = writeln!(b, "            __syncthreads();");
    let _ = writeln!(b, "        }}");
    let _ = writeln!(
        b,
        "        __threadfence();  // this run's partials are visible before it is counted"
    );
    let _ = writeln!(b, "        __syncthreads();");
    let _ = writeln!(b, "        if (threadIdx.x == 0) last = atomicAdd(&{k}_done[tile], 1u) == (unsigned)(splits - 1);");
    let _ = writeln!(b, "        __syncthreads();");
    let _ = writeln!(b, "        if (last) {{");
    let _ = writeln!(b, "            __threadfence();");
    let _ = writeln!(b, "            for (fs_i64 j = tile * {TILE} + threadIdx.x; j < tile * {TILE} + {TILE} && j < C; j += blockDim.x) {{");
    let _ = writeln!(b, "                float total = 0.0f;");
    let _ = writeln!(b, "                for (fs_i64 s = 0; s < splits; ++s) total += ((volatile float*){k}_part)[s * C + j];");
    let v = if r.kind == ReduceKind::Mean {
        "total / (float)rows"
    } else {
        "total"
    };
    let _ = writeln!(b, "                {}", c.st(0, "j", v));
    let _ = writeln!(b, "            }}");
    let _ = writeln!(b, "            if (threadIdx.x == 0) {k}_done[tile] = 0;");
    let _ = writeln!(b, "        }}");
    let _ = writeln!(
        b,
        "        __syncthreads();  // `last` and `part` are reused by the next item"
    );
    let _ = writeln!(b, "    }}");
    Some(b)
}

pub(crate) fn kernel_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let Op::SumSquares(op) = &g.g[n].op else {
        return column_sum(g, c, n);
    };
    let ins = g.inputs(n);
    let tys: Vec<_> = ins.iter().map(|&x| g.ty(x).clone()).collect();
    let chunks = op.chunks(&tys)?;
    let mut b = String::new();
    let rows: i64 = chunks.iter().sum();
    let _ = writeln!(
        b,
        "    // Block `row` sums the squares of one chunk of {} elements of one tensor.",
        op.chunk
    );
    let _ = writeln!(b, "    const fs_i64 rows = {rows};");
    let _ = writeln!(
        b,
        "    for (fs_i64 row = blockIdx.x; row < rows; row += gridDim.x) {{"
    );
    let _ = writeln!(b, "        float acc = 0.0f;");
    let mut first = 0i64;
    for (i, (t, &nc)) in tys.iter().zip(&chunks).enumerate() {
        let numel = t.numel().as_const().unwrap_or(0);
        let cond = if i == 0 { "if" } else { "else if" };
        let x = c.ld(i, "j");
        let _ = writeln!(
            b,
            "        {cond} (row < {}) {{  // input {i}: {numel} elements",
            first + nc
        );
        let _ = writeln!(
            b,
            "            const fs_i64 start = (row - {first}) * {}, end = start + {} < {numel} ? start + {} : {numel};",
            op.chunk, op.chunk, op.chunk
        );
        let _ = writeln!(
            b,
            "            for (fs_i64 j = start + threadIdx.x; j < end; j += blockDim.x) {{ const float x = {x}; acc += x * x; }}"
        );
        let _ = writeln!(b, "        }}");
        first += nc;
    }
    let _ = writeln!(b, "        acc = fs_block_sum(acc);");
    let _ = writeln!(b, "        if (threadIdx.x == 0) {}", c.st(0, "row", "acc"));
    let _ = writeln!(b, "    }}");
    Some(b)
}
