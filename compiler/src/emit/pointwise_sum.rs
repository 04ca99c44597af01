//! A pointwise chain that also sums one of its values over the leading
//! axes: a bias gradient taken from the chain that makes its input
//! (dropout's backward, GELU's), so the gradient is not read back from
//! memory by a sum kernel of its own, nor stored at all where the sum is
//! its one reader. The chain's elements are walked as the column sum walks
//! a [rows, C] matrix (kernels/column_sum.cuh, with emit/multi.rs's
//! tiling: tiles of columns, runs of rows, each run's partials added in a
//! fixed order); the generated `add_row` computes a row's elements with the
//! chain's own code (`cuda::vector_elements`), stores what the chain
//! stores, and adds each element, rounded as the summed tensor would store
//! it, to its column's sum. Deterministic, as the sum kernel is.

use super::cuda::{store, vector_elements, vector_width};
use super::multi::{call_sums, layout, partials, ColumnSum};
use crate::ir::Graph;
use crate::kernel::{Kernel, Pointwise, Program};
use std::fmt::Write;

/// The tiling of the kernel's sum and the elements a thread takes at once:
/// the chain's vector width where the columns are whole vectors of it, else
/// one (every load one element).
fn tiling(p: &Program, k: &Kernel, pw: &Pointwise) -> Option<ColumnSum> {
    let sum = pw.sum.as_ref()?;
    let vec = vector_width(p, k, pw) as i64;
    let vec = if sum.cols % vec == 0 { vec } else { 1 };
    let rows = pw.n.as_const().map(|n| n / sum.cols);
    Some(layout(sum.cols, vec, rows))
}

/// `__launch_bounds__` of the kernel: four blocks an SM. Its column sums
/// add registers to the chain's (GELU's backward took 66, three blocks an
/// SM, and ran slower than the chain and a sum kernel apart); held to 64,
/// BERT-large's step took 78.9 and 79.1 ms against 79.6 and 79.9 unbounded
/// (an H200, one call; the row loop unrolled twice, as the sum kernel's is,
/// took more registers again, and is not).
pub const BOUNDS: &str = "256, 4";

/// Blocks of the launch: a tile of columns by a run of rows each, as the
/// kernel's loop counts them.
pub fn blocks(
    p: &Program,
    k: &Kernel,
    pw: &Pointwise,
    env: &dyn Fn(&str) -> Option<i64>,
) -> Option<u64> {
    let w = tiling(p, k, pw)?;
    let rows = pw.n.eval(env)? / w.cols;
    let splits = w.splits_at(rows);
    Some(((w.tiles * splits) as u64).clamp(1, 1 << 20))
}

/// The file-scope partials of the kernel's sum, before its signature.
pub(crate) fn file_scope(p: &Program, k: &Kernel, pw: &Pointwise) -> String {
    tiling(p, k, pw).map_or(String::new(), |w| partials(&k.name, &w))
}

/// The kernel's body after `n` (its elements) is declared: the chain's
/// code for one row's `V` elements from column `j` as kernels/column_sum.cuh's
/// `add_row`, then the template's call.
pub(crate) fn body(_g: &Graph, p: &Program, k: &Kernel, pw: &Pointwise) -> String {
    let (Some(sum), Some(w)) = (pw.sum.as_ref(), tiling(p, k, pw)) else {
        return String::new();
    };
    let vec = w.vec as u64;
    let cols = format!("{}LL", sum.cols);
    let out_dt = |slot: usize| p.buffers[k.outputs[slot]].ty.dtype;
    let mut b = String::new();
    let _ = writeln!(
        b,
        "    // The elements as a [rows, C] matrix, by tiles of {} columns ({} lanes of {vec}) and runs of rows; column sums of v{} as a {} tensor stores it, into out{}.",
        w.lanes * w.vec,
        w.lanes,
        sum.expr,
        sum.dtype,
        sum.out
    );
    let _ = writeln!(
        b,
        "    auto add_row = [&](fs_i64 r, fs_i64 j, float (&acc)[{vec}]) {{"
    );
    let ind = "        ";
    let _ = writeln!(b, "{ind}const fs_i64 i0 = r * {cols} + j;");
    b.push_str(&vector_elements(p, k, pw, vec, ind, ""));
    for (slot, _) in pw.stores.iter() {
        if vec > 1 {
            let _ = writeln!(b, "{ind}fs_vstore(&out{slot}[i0], s{slot});");
        } else {
            let _ = writeln!(b, "{ind}out{slot}[i0] = s{slot}[0];");
        }
    }
    let _ = writeln!(b, "    }};");
    let o = sum.out;
    let store = format!("out{o}[j] = {};", store(out_dt(o), "total"));
    call_sums(
        &mut b,
        (&k.name, None),
        &w,
        0,
        (&format!("n / {cols}"), &cols),
        sum.mean,
        &store,
    );
    b.push_str("}\n");
    b
}
