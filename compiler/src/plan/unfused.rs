//! Why two kernels that share a tensor were not fused: every boundary
//! (a stored buffer one kernel writes and another reads) with the rule
//! that kept them apart, for the build report. What a user can change in
//! the model file, or what fusec lacks, starts here.

use super::Plan;
use crate::ir::Graph;
use crate::kernel::buckets::is_collective;
use crate::kernel::{Body, BufKind, Kernel, Program};
use crate::ops::Op;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Why kernel `w`'s output is stored for kernel `r`.
fn reason(g: &Graph, w: &Kernel, r: &Kernel, readers: usize) -> &'static str {
    let op = |k: &Kernel| match &k.body {
        Body::Op(n) | Body::Gemm(n, _) => Some(&g.g[*n].op),
        _ => None,
    };
    let gemm =
        |k: &Kernel| matches!(k.body, Body::Gemm(..)) || matches!(op(k), Some(Op::MatMul(_)));
    let template = |k: &Kernel| matches!(op(k), Some(Op::Attention(_) | Op::AttentionGrad(_)));
    if is_collective(g, w) || is_collective(g, r) {
        "an all-reduce across the ranks"
    } else if template(w) || template(r) {
        "the attention kernels (a template: they load and store whole tiles)"
    } else if gemm(r) {
        "a GEMM operand (cuBLASLt reads it whole from memory)"
    } else if gemm(w) {
        "a GEMM's product that no epilogue can take (cuBLASLt folds bias, residual and GELU only)"
    } else if matches!(r.body, Body::Group(_)) || matches!(w.body, Body::Group(_)) {
        "a multi-tensor kernel (the optimizer update, the casts of the weights)"
    } else if matches!(r.body, Body::Op(_)) {
        "a reduction or row kernel reads it (norms, softmax, cross-entropy, sums, embeddings)"
    } else if matches!(w.body, Body::Op(_)) {
        "a reduction or row kernel's result (its elements are not computed one by one)"
    } else if readers > 1 {
        "several kernels read it (fusing would compute it again for each)"
    } else {
        "read in another shape or order (a layout change a view cannot express)"
    }
}

/// The report's section: the boundaries' bytes by reason, then the
/// largest boundaries.
pub fn section(s: &mut String, g: &Graph, p: &Program, plan: &Plan) {
    let mut writer = BTreeMap::new();
    let mut readers: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (k, kernel) in p.kernels.iter().enumerate() {
        for &b in &kernel.outputs {
            writer.insert(b, k);
        }
        for &b in &kernel.inputs {
            readers.entry(b).or_default().push(k);
        }
    }
    let grads: std::collections::BTreeSet<usize> = g
        .outputs
        .iter()
        .filter(|(role, _)| matches!(role, crate::ir::graph::Role::Grad(_)))
        .filter_map(|(_, v)| p.buffer_of(*v))
        .collect();
    // (bytes, buffer, writer, reader, reason)
    let mut edges = Vec::new();
    for (&b, rs) in &readers {
        if p.buffers[b].kind != BufKind::Temp {
            continue;
        }
        let Some(&w) = writer.get(&b) else { continue };
        let mut distinct = rs.clone();
        distinct.dedup();
        for &r in &distinct {
            let why = if grads.contains(&b) {
                "a gradient: the optimizer update reads it after the backward pass (with clipping, after the norm of them all)"
            } else {
                reason(g, &p.kernels[w], &p.kernels[r], distinct.len())
            };
            edges.push((plan.buffers[b].bytes, b, w, r, why));
        }
    }
    if edges.is_empty() {
        return;
    }
    let mut by_reason: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for e in &edges {
        let x = by_reason.entry(e.4).or_default();
        x.0 += 1;
        x.1 += e.0;
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let _ = writeln!(
        s,
        "\nwhy not fused: {} places where one kernel stores a tensor another reads ({:.1} MiB written and read again), by reason:",
        edges.len(),
        mib(edges.iter().map(|e| e.0).sum())
    );
    let mut reasons: Vec<_> = by_reason.into_iter().collect();
    reasons.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(b.0)));
    for (why, (n, bytes)) in &reasons {
        let _ = writeln!(s, "  {n:>4} x {:>10.1} MiB  {why}", mib(*bytes));
    }
    edges.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.3.cmp(&b.3)));
    let _ = writeln!(s, "  the largest:");
    for (bytes, b, w, r, why) in edges.iter().take(8) {
        let _ = writeln!(
            s,
            "    {:>9.2} MiB  {} -> {}, {}: {why}",
            mib(*bytes),
            p.kernels[*w].name,
            p.kernels[*r].name,
            plan.buffers[*b].name
        );
    }
}
