//! The gradient of an attention's keys summed over the key positions is
//! zero. A score row s_i = scale q_i . k_j shifted by the same amount for
//! every key j leaves softmax unchanged, and so does the dropout and the
//! masks (they act on each (i, j) alone): dS's rows sum to zero,
//! sum_j dS_ij = sum_j P_ij (dP_ij - delta_i) = 0 with delta_i = sum_j P_ij
//! dP_ij, and sum_j dK_j = scale sum_i q_i sum_j dS_ij = 0. A bias added to
//! the keys (BERT's key bias, Hugging Face's `k_proj.bias`) therefore has a
//! zero gradient in real arithmetic; computed, it is rounding noise (two
//! sums of the same terms in different orders), which Adam, dividing by its
//! own square root, turns into updates of a sizeable part of the learning
//! rate in random directions. The rule writes the exact zero.
//!
//! It matches only a sum that covers the key axis of an `attention_grad`'s
//! dk, through reshapes, permutes, casts and a slice of a concatenation (the
//! bias gradient of q, k and v fused into one product): anything between
//! the bias and the attention that depends on the position (RoPE) puts an op
//! there that the walk does not pass.

use crate::ir::{Dim, Graph, Value};
use crate::ops::{Op, ReduceKind};
use std::collections::BTreeSet;

/// The key axis of `attention_grad`'s dk ([B, S, Hkv, D]).
const KEY_AXIS: usize = 1;

/// Whether `v` summed over `axes` is exactly zero because the sum covers
/// the key positions of an attention's key gradient.
pub(super) fn sums_keys_out(g: &Graph, v: Value, axes: &BTreeSet<usize>) -> bool {
    let mut v = v;
    let mut axes = axes.clone();
    // Each step moves to the op's input; a chain is short (a reshape, a cast).
    for _ in 0..16 {
        let ins = g.inputs(v.node);
        match &g.g[v.node].op {
            Op::AttentionGrad(a) => return v.port == 1 && !a.packed && axes.contains(&KEY_AXIS),
            Op::Cast(_) => v = ins[0],
            Op::Permute(p) => {
                axes = axes.iter().map(|&i| p.perm[i]).collect();
                v = ins[0];
            }
            Op::Reshape(_) => {
                let (from, to) = (&g.ty(ins[0]).shape, &g.ty(v).shape);
                let Some(groups) = axis_groups(from, to) else {
                    return false;
                };
                let mut mapped = BTreeSet::new();
                for (i, o) in groups {
                    // A group is summed whole or not at all; a part of a
                    // merged axis is not an axis of the input.
                    if o.clone().all(|a| axes.contains(&a)) {
                        mapped.extend(i);
                    }
                }
                axes = mapped;
                v = ins[0];
            }
            _ => return false,
        }
    }
    false
}

/// Pairs runs of input axes with runs of output axes of equal size, in
/// order (a reshape that merges or splits neighbouring axes); None where the
/// sizes do not line up. Axes of size 1 join the run before them.
#[allow(clippy::type_complexity)]
fn axis_groups(
    from: &[Dim],
    to: &[Dim],
) -> Option<Vec<(std::ops::Range<usize>, std::ops::Range<usize>)>> {
    let (mut i, mut o) = (0, 0);
    let mut groups: Vec<(std::ops::Range<usize>, std::ops::Range<usize>)> = Vec::new();
    while i < from.len() && o < to.len() {
        let (i0, o0) = (i, o);
        let (mut a, mut b) = (from[i].clone(), to[o].clone());
        (i, o) = (i + 1, o + 1);
        while a != b {
            // The smaller side (a proper factor of the other) takes its
            // next axis.
            if b.checked_div(&a).is_some_and(|q| !q.is_one()) {
                a = a.checked_mul(from.get(i)?)?;
                i += 1;
            } else if a.checked_div(&b).is_some_and(|q| !q.is_one()) {
                b = b.checked_mul(to.get(o)?)?;
                o += 1;
            } else {
                return None;
            }
        }
        groups.push((i0..i, o0..o));
    }
    // What is left on either side must be axes of size 1.
    if from[i..].iter().chain(&to[o..]).any(|d| !d.is_one()) {
        return None;
    }
    if let Some(last) = groups.last_mut() {
        last.0.end = from.len();
        last.1.end = to.len();
    }
    Some(groups)
}

/// `slice(sum(concat(..)))` taking exactly one piece along the concatenated
/// axis, where that piece sums a key gradient over its keys.
pub(super) fn slice_of_summed_keys(g: &Graph, sliced: Value, s: &crate::ops::Slice) -> bool {
    let Op::Reduce(r) = &g.g[sliced.node].op else {
        return false;
    };
    if r.kind != ReduceKind::Sum || r.keepdim {
        return false;
    }
    let cat = g.inputs(sliced.node)[0];
    let Op::Concat(c) = &g.g[cat.node].op else {
        return false;
    };
    if r.axes.contains(&c.axis) {
        return false;
    }
    let axis_after = c.axis - r.axes.iter().filter(|&&a| a < c.axis).count();
    if s.axis != axis_after {
        return false;
    }
    let mut at = Dim::constant(0);
    for piece in g.inputs(cat.node) {
        let len = g.ty(piece).shape[c.axis].clone();
        let Some(end) = at.checked_add(&len) else {
            return false;
        };
        if at == s.start && end == s.end {
            return sums_keys_out(g, piece, &r.axes.iter().copied().collect());
        }
        at = end;
    }
    false
}
