//! Reductions whose work is cut by the compiler: the global gradient norm
//! (one launch over every gradient, a block per fixed chunk of one tensor,
//! each block writing its own partial sum: deterministic, no atomics), the
//! leading-axis column sums (every bias gradient; the tiling chosen here,
//! the kernel in kernels/column_sum.cuh, and the same tiling for the chains
//! that sum as they compute, emit/pointwise_sum.rs), and the 16-byte
//! concatenation.

use super::templates::{Ctx, Shape};
use crate::ir::Graph;
use crate::kernel::forms::leading_sum;
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

pub fn shape_of(g: &Graph, n: NodeIndex) -> Option<Shape> {
    match &g.g[n].op {
        Op::SumSquares(_) => Some(Shape::Rows(g.g[n].outputs[0].shape[0].clone())),
        _ => column_tiles(g, n).map(|t| Shape::Rows(crate::ir::Dim::constant(t))),
    }
}

/// Lanes (threads across columns) of a leading-axis sum's tile: a warp, so
/// each row of a tile is one coalesced load.
const LANES: i64 = 32;

/// Fewest lanes a tile narrows to where its sum has few blocks (four
/// 16-byte loads still fill a 64-byte stretch of each row).
const MIN_LANES: i64 = 4;

/// Blocks under which a sum takes narrower tiles.
const FEW_BLOCKS: i64 = 128;

/// Most row runs per column tile: each tile's rows are cut into runs, each
/// a block's work, so a bias gradient over B*T rows and a few hundred
/// columns still fills the GPU.
const SPLITS: i64 = 64;

/// Blocks a column sum aims for where its tiles are few (a mean of a whole
/// tensor is one tile): runs are added until the GPU is full several times.
/// (1024 gave BERT-large's [16384, 1024] bias gradients 256 runs of 64 rows
/// and 27 us each on an H200; 512, with the partials' loads below, took
/// its step's sums from 4.4 to 3.9 ms.)
const BLOCKS: i64 = 512;

/// Most f32 partials a column sum keeps in its own device memory (4 MiB):
/// wide sums (a 50257-entry bias) take fewer runs per tile.
const PARTIALS: i64 = 1 << 20;

/// Fewest rows a run sums where the rows allow: the last block of a tile
/// adds the tile's partials a column a thread, in run order, so short runs
/// cost more there than they spread (a [256, 1024] sum in 128 runs of 2
/// rows took 12.9 us on an H200, a tenth of the copy bandwidth).
pub(crate) const MIN_RUN_ROWS: i64 = 64;

/// The work of a sum over leading axes with a known number of outputs
/// (every bias gradient): `vec` columns a lane (one 16-byte load where the
/// rows allow it), `lanes` lanes a tile, column tiles, and runs of rows per
/// tile.
pub(crate) struct ColumnSum {
    pub(crate) cols: i64,
    pub(crate) vec: i64,
    pub(crate) lanes: i64,
    pub(crate) tiles: i64,
    pub(crate) splits: i64,
}

impl ColumnSum {
    /// Runs of rows a tile takes over `rows` rows, as
    /// kernels/column_sum.cuh's `fs_column_sum_splits` cuts them.
    pub(crate) fn splits_at(&self, rows: i64) -> i64 {
        (rows / MIN_RUN_ROWS).clamp(1, self.splits)
    }
}

/// The tiling of a column sum of `cols` columns, `vec` a lane, over
/// `rows` rows where they are known at build time (symbolic rows bound the
/// runs in the kernel, at the size it runs with).
pub(crate) fn layout(cols: i64, vec: i64, rows: Option<i64>) -> ColumnSum {
    // A sum of few columns (a mean of a whole tensor has one) gives its
    // threads to more rows instead of idle lanes.
    let lanes = ((cols + vec - 1) / vec).min(LANES) as u64;
    let mut lanes = lanes.next_power_of_two() as i64;
    let runs = |lanes: i64| {
        let tiles = (cols + lanes * vec - 1) / (lanes * vec);
        let splits = (PARTIALS / cols).clamp(1, SPLITS.max(BLOCKS / tiles));
        let splits = rows.map_or(splits, |rows| splits.min((rows / MIN_RUN_ROWS).max(1)));
        (tiles, splits)
    };
    // Few rows (a norm backward's [256, C] partials) make few runs: narrower
    // tiles then give the GPU more blocks (32 blocks of 64 rows took 8 us
    // for 1 MiB on an H200, a 20th of the copy bandwidth).
    while lanes > MIN_LANES && runs(lanes).0 * runs(lanes).1 < FEW_BLOCKS {
        lanes /= 2;
    }
    let (tiles, splits) = runs(lanes);
    ColumnSum {
        cols,
        vec,
        lanes,
        tiles,
        splits,
    }
}

fn column_sum_of(g: &Graph, n: NodeIndex) -> Option<ColumnSum> {
    let Op::Reduce(r) = &g.g[n].op else {
        return None;
    };
    let (cols, _) = leading_sum(g, n)?;
    // 16 bytes a lane where every row starts 16-byte aligned (the arena
    // aligns each buffer to 256).
    let size = g.ty(g.inputs(n)[0]).dtype.size_bytes() as i64;
    let vec = if cols % (16 / size) == 0 {
        16 / size
    } else {
        1
    };
    let rows = g.ty(g.inputs(n)[0]).shape[..r.axes.len()]
        .iter()
        .try_fold(crate::ir::Dim::constant(1), |a, d| a.checked_mul(d))
        .and_then(|d| d.as_const());
    Some(layout(cols, vec, rows))
}

/// The work items of a leading-axis sum at the sizes `env` gives: tiles
/// times runs, as kernels/column_sum.cuh's `fs_column_sum_splits` cuts them.
pub(crate) fn items(g: &Graph, n: NodeIndex, env: &dyn Fn(&str) -> Option<i64>) -> Option<u64> {
    let Op::Reduce(r) = &g.g[n].op else {
        return None;
    };
    let w = column_sum_of(g, n)?;
    let rows = g.ty(g.inputs(n)[0]).shape[..r.axes.len()]
        .iter()
        .try_fold(1i64, |a, d| Some(a * d.eval(env)?))?;
    Some((w.tiles * w.splits_at(rows)) as u64)
}

/// How many blocks a leading-axis sum's kernel takes (tiles times runs),
/// where it has one.
pub fn column_tiles(g: &Graph, n: NodeIndex) -> Option<i64> {
    column_sum_of(g, n).map(|w| w.tiles * w.splits)
}

/// File-scope storage of a column sum: each (tile, run)'s f32 partials
/// and each tile's count of finished runs, after the template's include
/// (kernels/column_sum.cuh).
pub(crate) fn file_scope(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    column_sum_of(g, n).map(|w| partials(&c.k.name, &w))
}

/// The include of the column-sum template and the file-scope partials and
/// counts of a column sum in kernel `k`.
pub(crate) fn partials(k: &str, w: &ColumnSum) -> String {
    format!("#include \"column_sum.cuh\"\n\n{}", partial_decls(k, w))
}

/// The file-scope partials and counts of a column sum named `k`.
fn partial_decls(k: &str, w: &ColumnSum) -> String {
    format!(
        "// The row splits' partial sums and each column tile's finished splits.\n\
         __device__ float {k}_part[{}];\n__device__ unsigned {k}_done[{}] = {{0}};\n\n",
        w.splits * w.cols,
        w.tiles
    )
}

/// A group kernel's leading-axis sums (emit/group.rs), member by member:
/// each sum's partials named after its member, and its code for one work
/// item `b` of its own (`fs_column_sum_item`), with the number of its items
/// as a C expression.
pub(crate) struct GroupSum {
    pub(crate) decls: String,
    pub(crate) items: String,
    pub(crate) code: String,
}

pub(crate) fn group_sum(g: &Graph, c: &Ctx, n: NodeIndex, name: &str) -> Option<GroupSum> {
    let w = column_sum_of(g, n)?;
    let Op::Reduce(r) = &g.g[n].op else {
        return None;
    };
    let rows = g.ty(g.inputs(n)[0]).shape[..r.axes.len()]
        .iter()
        .try_fold(crate::ir::Dim::constant(1), |a, d| a.checked_mul(d))?
        .to_c();
    Some(GroupSum {
        decls: partial_decls(name, &w),
        items: format!(
            "{}LL * fs_column_sum_splits({rows}, {}LL)",
            w.tiles, w.splits
        ),
        code: column_sum_code(g, c, n, name, Some("b"))?,
    })
}

/// The call of kernels/column_sum.cuh's `fs_column_sums` for tiling `w`
/// over a [rows, C] matrix, after the lambda `add_row` the caller defines:
/// its row loop unrolled `unroll` times (0: as the compiler likes), column
/// `j`'s total stored by `store` (a C statement from the value `total`);
/// the partials named `k`, and with `item` the call for that one work item
/// (`fs_column_sum_item`, a group kernel's member) rather than the grid's.
pub(crate) fn call_sums(
    b: &mut String,
    (k, item): (&str, Option<&str>),
    w: &ColumnSum,
    unroll: u32,
    (rows, cols): (&str, &str),
    mean: bool,
    store: &str,
) {
    let _ = match item {
        None => writeln!(
            b,
            "    fs_column_sums<{}, {}, {unroll}>(add_row, [&](fs_i64 j, float total) {{ {store} }},\n        {rows}, {cols}, {}, {}, {k}_part, {k}_done, {mean});",
            w.vec, w.lanes, w.tiles, w.splits
        ),
        Some(item) => writeln!(
            b,
            "    fs_column_sum_item<{}, {}, {unroll}>(add_row, [&](fs_i64 j, float total) {{ {store} }},\n        {rows}, {cols}, {}, {k}_part, {k}_done, {mean}, {item});",
            w.vec, w.lanes, w.splits
        ),
    };
}

/// A sum over leading axes, [rows, C] -> [C], by kernels/column_sum.cuh:
/// each lane's V columns of a row read as one 16-byte load where the rows
/// allow.
fn column_sum(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    column_sum_code(g, c, n, &c.k.name, None)
}

/// [`column_sum`]'s code, its partials named `name`; with `item`, for that
/// one work item (a group kernel's member) rather than a grid of them.
fn column_sum_code(
    g: &Graph,
    c: &Ctx,
    n: NodeIndex,
    name: &str,
    item: Option<&str>,
) -> Option<String> {
    let Op::Reduce(r) = &g.g[n].op else {
        return None;
    };
    let w = column_sum_of(g, n)?;
    let (_, mean) = leading_sum(g, n)?;
    let ins = g.inputs(n);
    let sh = &g.ty(ins[0]).shape;
    let rows = sh[..r.axes.len()]
        .iter()
        .try_fold(crate::ir::Dim::constant(1), |a, d| a.checked_mul(d))?;
    let cols = g.g[n].outputs[0].numel();
    let mut b = String::new();
    let _ = writeln!(
        b,
        "    // Sum over the leading axes: column j of a [rows, C] matrix, by tiles of {} columns ({} lanes of {}) and runs of rows.",
        w.lanes * w.vec,
        w.lanes,
        w.vec
    );
    // Rows `row_stride` apart: the input's pitch where its rows are padded for the
    // GEMMs that share it (kernel::pitch), else C.
    let stride = c.p.buffers[c.k.inputs[c.ins[0]]]
        .pitch
        .map_or_else(|| cols.to_c(), |x| format!("{x}LL"));
    let _ = writeln!(b, "    const fs_i64 row_stride = {stride};");
    let x = c.ins[0];
    let _ = writeln!(
        b,
        "    auto add_row = [&](fs_i64 r, fs_i64 j, float (&acc)[{}]) {{",
        w.vec
    );
    if w.vec > 1 {
        let ty = super::cuda::c_type(c.in_dt(0));
        let one = super::cuda::load(c.in_dt(0), "v[q]");
        let _ = writeln!(b, "        {ty} v[{}];", w.vec);
        let _ = writeln!(b, "        fs_vload(v, &in{x}[r * row_stride + j]);");
        let _ = writeln!(
            b,
            "        for (int q = 0; q < {}; ++q) acc[q] += {one};",
            w.vec
        );
    } else {
        let _ = writeln!(b, "        acc[0] += {};", c.ld(0, "r * row_stride + j"));
    }
    let _ = writeln!(b, "    }};");
    let store = c.st(0, "j", "total");
    call_sums(
        &mut b,
        (name, item),
        &w,
        4,
        (&rows.to_c(), &cols.to_c()),
        mean,
        &store,
    );
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
        "    // Block `row` sums the squares of one chunk of {} elements of one tensor (kernels/sum_squares.cuh).",
        op.chunk
    );
    let _ = writeln!(b, "    const fs_i64 rows = {rows}, chunk = {}LL;", op.chunk);
    let _ = writeln!(
        b,
        "    for (fs_i64 row = blockIdx.x; row < rows; row += gridDim.x) {{"
    );
    let _ = writeln!(b, "        float acc;");
    let mut first = 0i64;
    for (i, (t, &nc)) in tys.iter().zip(&chunks).enumerate() {
        let numel = t.numel().as_const().unwrap_or(0);
        // The elements of this tensor the step's norm covers (a ZeRO rank's
        // own piece, or all of them).
        let (lo, hi) = op.span(i, numel);
        let cond = if i == 0 { "if" } else { "else if" };
        let what = if (lo, hi) == (0, numel) {
            format!("{numel} elements")
        } else {
            format!("elements {lo}..{hi} of {numel}")
        };
        let _ = writeln!(
            b,
            "        {cond} (row < {}) {{  // input {i}: {what}",
            first + nc
        );
        let _ = writeln!(
            b,
            "            const fs_i64 start = {lo}LL + (row - {first}) * chunk;"
        );
        let _ = writeln!(
            b,
            "            acc = fs_sum_squares_chunk<{}>({}, start, start + chunk < {hi}LL ? start + chunk : {hi}LL);",
            c.in_el(i),
            c.in_ptr(i)
        );
        let _ = writeln!(b, "        }}");
        first += nc;
    }
    let _ = writeln!(b, "        else acc = 0.0f;");
    let _ = writeln!(b, "        if (threadIdx.x == 0) {}", c.st(0, "row", "acc"));
    let _ = writeln!(b, "    }}");
    Some(b)
}

/// A concatenation whose parts each start and end on a 16-byte boundary of
/// every output row (the QKV gradient from dQ, dK and dV: three runs of 768
/// bf16 a row), copied 16 bytes a thread and step: chunk `q` of the output
/// lies wholly in one part, contiguous there. The scalar copy (one element a
/// thread, 2-byte loads) ran at a quarter of the bandwidth. `None` where a
/// run is not a constant multiple of 16 bytes, a part is read through a view
/// or converted, or rows are padded: the element loop then does it.
/// Elements a thread of a concatenation copies at once (16 bytes), where
/// every part is a constant run of whole 16-byte chunks of each output row:
/// the launch then has a thread per chunk.
pub(crate) fn concat_chunk(g: &Graph, n: NodeIndex) -> Option<i64> {
    let Op::Concat(cat) = &g.g[n].op else {
        return None;
    };
    let out = &g.g[n].outputs[0];
    let vec = 16 / out.dtype.size_bytes() as i64;
    let inner = out.shape[cat.axis + 1..]
        .iter()
        .try_fold(1i64, |a, d| d.as_const().map(|x| a * x))?;
    g.inputs(n)
        .iter()
        .all(|&x| {
            g.ty(x).shape[cat.axis]
                .as_const()
                .is_some_and(|l| (l * inner) % vec == 0)
        })
        .then_some(vec)
}

pub(crate) fn concat_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let Op::Concat(cat) = &g.g[n].op else {
        return None;
    };
    let ins = g.inputs(n);
    let out = &g.g[n].outputs[0];
    let dt = c.out_dt(0);
    let vec = concat_chunk(g, n).filter(|&v| v == 16 / dt.size_bytes() as i64)?;
    let inner = out.shape[cat.axis + 1..]
        .iter()
        .try_fold(1i64, |a, d| d.as_const().map(|x| a * x))?;
    let plain = |b: usize| c.p.buffers[b].pitch.is_none() && c.p.buffers[b].zero_rows == 0;
    let same = (0..ins.len()).all(|k| c.in_dt(k) == dt)
        && c.k.input_views.iter().all(|v| v.is_none())
        && c.k.inputs.iter().chain(&c.k.outputs).all(|&b| plain(b));
    let lens: Vec<i64> = ins
        .iter()
        .map(|&x| g.ty(x).shape[cat.axis].as_const())
        .collect::<Option<_>>()?;
    if !same {
        return None;
    }
    let numel = out.numel().to_c();
    let ty = super::cuda::c_type(dt);
    let mut ends = Vec::with_capacity(lens.len());
    let mut end = 0i64;
    for len in &lens {
        end += len;
        ends.push(format!("{end}LL"));
    }
    let parts: Vec<String> = (0..ins.len()).map(|k| c.in_ptr(k)).collect();
    let n = ins.len();
    let mut b = String::new();
    let _ = writeln!(
        b,
        "    // Concatenation along axis {}: {vec} elements a thread and step, each chunk from one part (kernels/concat.cuh).",
        cat.axis
    );
    let _ = writeln!(
        b,
        "    const fs_i64 inner = {inner}LL, chunks = {numel} / {vec}, ends[{n}] = {{{}}};",
        ends.join(", ")
    );
    let _ = writeln!(
        b,
        "    const {ty}* const parts[{n}] = {{{}}};",
        parts.join(", ")
    );
    let _ = writeln!(
        b,
        "    for (fs_i64 q = (fs_i64)blockIdx.x * blockDim.x + threadIdx.x; q < chunks; q += (fs_i64)gridDim.x * blockDim.x)"
    );
    let _ = writeln!(
        b,
        "        fs_concat_chunk<{ty}, {vec}, {n}>(q, inner, ends, parts, {});",
        c.out_ptr(0)
    );
    Some(b)
}
