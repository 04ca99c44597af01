//! The build report a person reads: the kernels of one step with the ops
//! each holds and the bytes it moves, and the memory plan by kind.

use super::roofline::{estimate, Device};
use super::LaunchKind;
use super::{MemKind, Plan};
use crate::ir::Graph;
use crate::kernel::Program;
use std::fmt::Write;

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
}

pub fn report(g: &Graph, p: &Program, plan: &Plan, ops_before: usize, device: Device) -> String {
    report_with_source(g, p, plan, ops_before, device, None, None)
}

/// The lines of the model file a kernel's ops come from (an op without a
/// place of its own, such as an optimizer update, by the places of the
/// nearest ops it reads), as `file:26, 32`, and the block calls they were
/// made in, as instance paths: `file:26, 32 in h.3.mlp`.
pub(crate) fn source_lines(
    g: &Graph,
    k: &crate::kernel::Kernel,
    file: &str,
    text: &str,
) -> Option<String> {
    let mut spans = Vec::new();
    for &n in &k.nodes {
        match g.g[n].span {
            Some(sp) => spans.extend(g.places(sp)),
            None => {
                // The nearest ops before it with a place (the clip's norm
                // from the gradients, an update from its parameter).
                let mut front = vec![n];
                for _ in 0..8 {
                    let next: Vec<_> = front
                        .iter()
                        .flat_map(|&m| g.inputs(m))
                        .map(|v| v.node)
                        .collect();
                    let before = spans.len();
                    spans.extend(next.iter().filter_map(|&m| g.g[m].span));
                    if spans.len() > before {
                        break;
                    }
                    front = next;
                }
            }
        }
    }
    // What has no place at all (a constant the step writes out) serves the
    // train section: the loss's line.
    if spans.is_empty() {
        let loss = g.output(&crate::ir::graph::Role::Loss)?;
        spans.push(g.g[loss.node].span?);
    }
    let lines: std::collections::BTreeSet<usize> = spans
        .iter()
        .map(|sp| crate::ir::print::line_col(text, sp.start).0)
        .collect();
    let mut paths: Vec<&str> = Vec::new();
    for sp in &spans {
        if let Some(c) = g.call_stack(*sp).first() {
            if !paths.contains(&c.path.as_str()) {
                paths.push(&c.path);
            }
        }
    }
    let shown: Vec<String> = lines.iter().take(4).map(|l| l.to_string()).collect();
    let more = if lines.len() > 4 {
        format!(" and {} more", lines.len() - 4)
    } else {
        String::new()
    };
    let within = match paths.len() {
        0 => String::new(),
        1 | 2 => format!(" in {}", paths.join(", ")),
        n => format!(" in {}, {} and {} more", paths[0], paths[1], n - 2),
    };
    let name = std::path::Path::new(file)
        .file_name()
        .map_or(file.to_string(), |f| f.to_string_lossy().to_string());
    Some(format!("{name}:{}{more}{within}", shown.join(", ")))
}

/// The call stack of a place, outermost last, for a reader:
/// `gpt2-small.dsl:27 linear`, `:58 mlp as h.3.mlp`, `:71 repeat as h.3`.
pub fn call_stack_lines(
    g: &Graph,
    span: crate::dsl::ast::Span,
    what: &str,
    file: &str,
    text: &str,
) -> Vec<String> {
    let name = std::path::Path::new(file)
        .file_name()
        .map_or(file.to_string(), |f| f.to_string_lossy().to_string());
    let line = |sp: crate::dsl::ast::Span| crate::ir::print::line_col(text, sp.start).0;
    let mut out = vec![format!("{name}:{} {what}", line(span))];
    for c in g.call_stack(span) {
        out.push(format!("{name}:{} {} as {}", line(c.site), c.block, c.path));
    }
    out
}

/// [`report`], each kernel with the lines of the model file (`file`, its
/// `text`) its ops come from.
pub fn report_with_source(
    g: &Graph,
    p: &Program,
    plan: &Plan,
    ops_before: usize,
    device: Device,
    source: Option<(&str, &str)>,
    recompute: Option<&str>,
) -> String {
    let est = estimate(g, p, plan, device);
    let mut s = String::new();
    let dims: Vec<String> = plan.dims.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(
        s,
        "fusec build report: {} at {}",
        g.name,
        if dims.is_empty() {
            "fixed sizes".into()
        } else {
            dims.join(", ")
        }
    );
    let count = |kind: LaunchKind| {
        plan.launches
            .iter()
            .filter(|l| l.kind == kind)
            .map(|l| l.steps.len())
            .sum::<usize>()
    };
    let (generated, templates) = (count(LaunchKind::Generated), count(LaunchKind::Template));
    let other =
        |l: &&super::Launch| !matches!(l.kind, LaunchKind::Generated | LaunchKind::Template);
    let others_n = plan.launches.iter().filter(other).count();
    let _ = writeln!(
        s,
        "\none step launches {} kernels: {generated} generated, {templates} template instances, {others_n} other ({} ops in the step graph before fusion)",
        generated + templates + others_n,
        ops_before
    );
    if let Some(t) = &plan.target {
        let _ = writeln!(s, "attention: {t}");
    }
    for (k, why) in &plan.fallbacks {
        let _ = writeln!(
            s,
            "  {k} runs the simple attention kernels (one thread a query row, no tensor cores): {why}"
        );
    }
    let mut others: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for l in plan.launches.iter().filter(other) {
        *others.entry(l.kind.as_str()).or_default() += 1;
    }
    if !others.is_empty() {
        let list: Vec<String> = others.iter().map(|(k, n)| format!("{k} x{n}")).collect();
        let _ = writeln!(
            s,
            "other kernels (library calls, or ops with no generated kernel yet): {}",
            list.join(", ")
        );
    }
    // Values computed inside a kernel and never stored: chain links, GEMM
    // products consumed by their epilogue, narrow values cast as stored.
    let fused: usize = p
        .kernels
        .iter()
        .filter(|k| !matches!(k.body, crate::kernel::Body::Group(_)))
        .map(|k| {
            let made: usize = k.nodes.iter().map(|&n| g.g[n].outputs.len()).sum();
            made.saturating_sub(k.outputs.len())
        })
        .sum();
    let _ = writeln!(
        s,
        "fusion kept {fused} intermediate tensors out of device memory"
    );
    let _ = writeln!(s, "\nmemory plan: arena of {}", gib(plan.arena_bytes));
    // ZeRO with master weights: the parameters are kept in the compute
    // dtype, their f32 masters (this rank's pieces) are optimizer state.
    let narrow_params = g
        .params
        .iter()
        .enumerate()
        .any(|(i, _)| crate::autodiff::zero::has_master(g, i));
    for (kind, bytes) in &plan.bytes_by_kind {
        let name = match kind {
            MemKind::Param if narrow_params => "parameters (compute dtype)",
            MemKind::OptimizerState if narrow_params => "optimizer state (+ f32 masters)",
            k => k.name(),
        };
        let _ = writeln!(s, "  {:<30} {:>14}", name, gib(*bytes));
    }
    if let Some(t) = super::textbook_bytes(g, &plan.dims) {
        let _ = writeln!(
            s,
            "  textbook count {} (f32 weights and gradients, optimizer state, activations kept for backward): the plan is {:.2}x{}",
            gib(t),
            plan.arena_bytes as f64 / t as f64,
            if g.g.node_weights().any(|n| n.recompute) {
                " (values recomputed in the backward pass come on top of the count)"
            } else {
                ""
            }
        );
    }
    let params: u64 = plan
        .bytes_by_kind
        .get(&MemKind::Param)
        .copied()
        .unwrap_or(0);
    if !narrow_params {
        let _ = writeln!(s, "  (parameters are {} in f32)", gib(params));
    }
    padded_sizes(&mut s, g, p, plan);
    padding(&mut s, p, plan);
    buckets(&mut s, g, p, plan);
    let compute: f64 = est
        .kernels
        .iter()
        .filter(|k| k.compute_bound)
        .map(|k| k.seconds)
        .sum();
    // What the memory budget (or the free choice) recomputes
    // (`recompute::Choice::describe`), after the memory plan's paragraph.
    if let Some(para) = recompute {
        let _ = write!(s, "\n{}", para.trim_end());
    }
    let _ = writeln!(s, "\nroofline estimate on {}:", device.about);
    let _ = writeln!(
        s,
        "  {:.2} ms per step ({:.2} ms in compute-bound kernels, {:.2} ms in memory-bound ones); {:.2} TFLOP and {} moved per step",
        est.seconds * 1e3,
        compute * 1e3,
        (est.seconds - compute) * 1e3,
        est.flops / 1e12,
        gib(est.bytes as u64)
    );
    let _ = writeln!(
        s,
        "\nkernels in launch order (bytes read / written, GFLOP, estimated time, bound):"
    );
    let width = plan
        .launches
        .iter()
        .map(|l| l.kernel.len())
        .max()
        .unwrap_or(8);
    for ((l, cost), k) in plan.launches.iter().zip(&est.kernels).zip(&p.kernels) {
        let read = super::roofline::distinct_bytes(plan, &l.inputs);
        let written = super::roofline::distinct_bytes(plan, &l.outputs);
        let templates = || {
            let ts: Vec<String> = l
                .steps
                .iter()
                .map(|t| t.template.clone().unwrap_or_else(|| t.function.clone()))
                .collect();
            ts.join(", ")
        };
        let what = match (&l.epilogue, &l.kind) {
            // A product run by a template of ours (a skinny GEMM).
            (Some(e), LaunchKind::Template) => format!("[{}, epilogue {}]", templates(), e.name),
            (Some(e), kind) => format!("[{kind}, epilogue {}]", e.name),
            (None, LaunchKind::Generated) => crate::kernel::print::op_runs(&l.ops, 3),
            (None, LaunchKind::Template) => format!("[{}]", templates()),
            (None, kind) => format!("[{kind}]"),
        };
        let at = source
            .and_then(|(file, text)| source_lines(g, k, file, text))
            .map_or(String::new(), |at| format!("  @{at}"));
        let _ = writeln!(
            s,
            "  {:<width$}  {:>11} / {:>11}  {:>9.3}  {:>8.1} us  {}  {what}{at}",
            l.kernel,
            mib(read),
            mib(written),
            cost.flops / 1e9,
            cost.seconds * 1e6,
            if cost.compute_bound {
                "compute"
            } else {
                "memory "
            }
        );
    }
    super::unfused::section(&mut s, g, p, plan);
    s
}

/// The awkward sizes the `pad-dims` pass padded: what reads them padded,
/// and the cost: the padded share of every planned buffer with an axis of
/// the padded size (forward and backward tensors alike, each counted once
/// whatever its lifetime).
fn padded_sizes(s: &mut String, g: &Graph, p: &Program, plan: &Plan) {
    for pd in &g.padded {
        let padded = crate::ir::Dim::constant(pd.to);
        let extra: u64 = plan
            .buffers
            .iter()
            .enumerate()
            .take(p.buffers.len())
            .filter(|(b, pb)| {
                pb.alias_of.is_none()
                    && pb.shares_with.is_none()
                    && p.buffers[*b].ty.shape.contains(&padded)
            })
            .map(|(_, pb)| pb.bytes * (pd.to - pd.size) as u64 / pd.to as u64)
            .sum();
        let _ = writeln!(
            s,
            "padded size {} -> {} (pad-dims): {} tensors of the forward pass {:.1}% larger (+{} over the buffers of that size), their products aligned",
            pd.size,
            pd.to,
            pd.widened,
            100.0 * (pd.to - pd.size) as f64 / pd.size as f64,
            kib(extra)
        );
        let _ = writeln!(
            s,
            "  read with zeros after their last row or column: {}",
            pd.params.join(", ")
        );
    }
}

/// What kernel::pitch padded, what it costs in memory, and the GEMMs that
/// run at padded sizes.
fn padding(s: &mut String, p: &Program, plan: &Plan) {
    let mut lines = Vec::new();
    let mut extra = 0u64;
    for (b, pb) in plan.buffers.iter().enumerate().take(p.buffers.len()) {
        let buf = &p.buffers[b];
        if buf.pitch.is_none() && buf.zero_rows == 0 {
            continue;
        }
        let packed =
            pb.shape.iter().product::<i64>().max(0) as u64 * buf.ty.dtype.size_bytes() as u64;
        let cost = pb.bytes.saturating_sub(packed);
        extra += cost;
        let what = match (buf.pitch, buf.zero_rows) {
            (Some(pitch), 0) => format!("rows padded to {pitch}"),
            (None, z) if buf.ty.shape.len() == 1 => format!("{z} zero elements after the last"),
            (None, z) => format!("{z} zero rows after the last"),
            (Some(pitch), z) => format!("rows padded to {pitch}, {z} zero rows after the last"),
        };
        lines.push(format!("  {:<44} {what} (+{})", pb.name, kib(cost)));
    }
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "padding for aligned and padded GEMMs (kernel::pitch): +{} in all",
        kib(extra)
    );
    for l in lines {
        let _ = writeln!(s, "{l}");
    }
    for (k, pad) in &p.gemm_pads {
        let sizes: Vec<String> = [("m", pad.m), ("n", pad.n), ("k", pad.k)]
            .iter()
            .filter_map(|(x, v)| v.map(|v| format!("{x} = {v}")))
            .collect();
        let _ = writeln!(s, "  {} runs at {}", p.kernels[*k].name, sizes.join(", "));
    }
}

/// The data-parallel gradient buckets: what each averages, after which
/// kernel it starts (on the communication stream) and before which the
/// compute stream waits for it.
fn buckets(s: &mut String, g: &Graph, p: &Program, plan: &Plan) {
    if plan.collectives.is_empty() {
        return;
    }
    let ranks = p
        .kernels
        .iter()
        .flat_map(|k| &k.nodes)
        .find_map(|&n| match &g.g[n].op {
            crate::ops::Op::AllReduce(a) => Some(a.ranks),
            _ => None,
        })
        .unwrap_or(1);
    // Hybrid sharding: the pieces split over a group, the groups alike.
    let hybrid = match g.shard_group() {
        Some(k) if k < ranks => format!(
            " (ZeRO within groups of {k} ranks, {} groups holding the same pieces: each piece's mean reduced to its owner in the group, then averaged over the owners of the groups; the gathers and broadcasts stay within a group)",
            ranks / k
        ),
        _ => String::new(),
    };
    // ZeRO stage 3's gathers apart from the gradients' buckets.
    let (gathers, reduces): (Vec<_>, Vec<_>) =
        plan.collectives.iter().partition(|c| c.gather.is_some());
    let total: u64 = reduces.iter().map(|c| c.bytes).sum();
    // The types the gradients are averaged in (bf16 with --reduce-dtype bf16).
    let mut types: Vec<&str> = reduces
        .iter()
        .filter(|c| !c.every_micro_batch)
        .flat_map(|c| c.dtypes(&plan.buffers))
        .collect();
    types.sort_unstable();
    types.dedup();
    // ZeRO: the gradients' means go to the owners of their pieces alone,
    // and the owners send the updated pieces in the parameters' dtype.
    let zero = plan.collectives.iter().any(|c| !c.owners_of.is_empty());
    let mut sent: Vec<&str> = plan
        .buffers
        .iter()
        .filter(|b| b.kind == MemKind::Param)
        .map(|b| b.dtype.name())
        .collect();
    sent.sort_unstable();
    sent.dedup();
    let _ = writeln!(
        s,
        "data parallel over {ranks} ranks{hybrid}: {} {} buckets (mean in {}, NCCL) of {} in all; each starts after the kernel that finishes its last gradient and runs while the backward pass goes on{}",
        reduces.len(),
        if zero { "collective" } else { "all-reduce" },
        if types.is_empty() { "f32".to_string() } else { types.join(" and ") },
        kib(total),
        if zero {
            // Stage 2 keeps no whole gradient past its bucket.
            let sharded = !plan.buffers.iter().any(|b| b.kind == MemKind::Grad);
            format!(
                "; ZeRO: each gradient's mean goes to the owners of its pieces alone (NCCL reduces rooted at them, together a reduce-scatter){}, the loss and the norm's sum of squares to every rank; {}",
                if sharded {
                    ", each owner's into a buffer of its piece's size (stages 2 and 3: the whole gradients are temporaries, joined where the next bucket starts)"
                } else {
                    ""
                },
                if gathers.is_empty() {
                    format!("after the update each owner sends its pieces of the parameters to the other ranks in {} (broadcasts, together an all-gather)", sent.join(" and "))
                } else {
                    format!(
                        "stage 3: each rank keeps its pieces of the weights alone (in {}) and updates them in place; {} gathers (broadcasts from each piece's owner, together an all-gather) of {} in all make each weight whole in the compute dtype where a pass reads it, each issued {} readers of weights ahead of its own and joined before it",
                        sent.join(" and "),
                        gathers.len(),
                        kib(gathers.iter().map(|c| c.bytes).sum()),
                        crate::kernel::gathers::LOOKAHEAD
                    )
                }
            )
        } else {
            String::new()
        }
    );
    let name = |i: usize| {
        plan.launches
            .get(i)
            .map_or("the end of the step".to_string(), |l| l.kernel.clone())
    };
    for c in &plan.collectives {
        let mut tensors: Vec<String> = c
            .tensors
            .iter()
            .map(|&(i, _)| plan.buffers[i].name.clone())
            .collect();
        let shown = tensors.len().min(4);
        let more = tensors.len() - shown;
        tensors.truncate(shown);
        let after = match c.launch {
            0 => "the start".to_string(),
            k => name(k - 1),
        };
        let _ = writeln!(
            s,
            "  {:<24} {:>10}  after {:<28} joined before {}: {}{}",
            name(c.launch),
            kib(c.bytes),
            after,
            name(c.join),
            tensors.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
    }
}

fn kib(b: u64) -> String {
    if b >= 1 << 20 {
        mib(b)
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}
