//! Recomputation under a memory budget: the stage between the pass
//! pipeline and fusion that trades the activations a step keeps for its
//! backward pass against running their forward ops again.
//!
//! The choice is made on the plan itself, at the sizes the step runs at:
//! the candidates are the kept forward values (never a value passed from
//! one outermost block call to the next, so a recomputation reaches back
//! no further than the start of its own layer, nor one only the first
//! backward ops read, which would be recomputed at once, nor a vector or a
//! weight's cast), ordered by the predicted time their recomputation adds
//! per byte they free (`cost`). A scan of prefix lengths finds the first
//! whose plan fits, a binary search below it the shortest, each probe
//! fused and planned as it would run; this in the file's order and in one
//! that minds memory (`Graph::order_by_memory`), the faster plan taken.
//! What it adds, and the peak before and after, come from those plans and
//! the roofline estimate, so the report's figures are the plan's own.

pub mod cost;
pub mod ranks;
pub mod rewrite;

use crate::ir::graph::Value;
use crate::ir::Graph;
use crate::lowering::Lowered;
use crate::plan::roofline::{estimate, Device};
use crate::plan::PlanError;
use crate::select::Target;
use std::collections::{BTreeMap, HashSet};
use std::fmt::Write;

pub use ranks::fit_ranks;
pub use rewrite::{checkpoints, drop_saved, saved_values, Kept};

/// One line for `fusec passes`.
pub const ABOUT: &str = "activations the backward pass keeps are dropped and their forward ops run again just before their readers: what fuses into a backward kernel at no cost always, and with --memory-budget (or memory_budget) the cheapest per byte until the plan fits (report.txt says what and what it costs)";

/// A step's plan as the budget sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Probe {
    /// The arena: everything the step allocates on the device.
    pub arena_bytes: u64,
    /// The roofline estimate of one step.
    pub seconds: f64,
    pub flops: f64,
}

/// Fuses, selects kernels for and plans `g` as the step would run (after
/// the graph verifier: a rewrite that broke the graph is a bug in fusec).
pub fn probe(
    g: &Graph,
    dims: &BTreeMap<String, i64>,
    target: &Target,
    device: Device,
) -> Result<Probe, PlanError> {
    crate::ir::verify::verify(g).map_err(|p| {
        PlanError(format!(
            "internal error: the graph is invalid after recomputation:\n  {}\nthis is a bug in fusec; please report it with the model file",
            p.join("\n  ")
        ))
    })?;
    let Lowered { program, plan, .. } = crate::lowering::lower(g, target, dims, None)?;
    let est = estimate(g, &program, &plan, device);
    Ok(Probe {
        arena_bytes: plan.arena_bytes,
        seconds: est.seconds,
        flops: est.flops,
    })
}

/// One dropped activation.
#[derive(Clone, Debug)]
pub struct Dropped {
    pub value: Value,
    /// The op that makes it (`layernorm`, `matmul`, ...).
    pub op: &'static str,
    pub span: Option<crate::dsl::ast::Span>,
    pub bytes: u64,
}

/// What the stage chose, for the report.
#[derive(Clone, Debug)]
pub struct Choice {
    /// `None`: what is free to recompute, without a budget.
    pub budget: Option<u64>,
    pub dropped: Vec<Dropped>,
    /// Ops added to the backward pass to recompute them.
    pub ops_added: usize,
    pub before: Probe,
    pub after: Probe,
}

#[derive(Clone, Debug, PartialEq)]
pub enum BudgetError {
    /// The least peak any probed choice gave is `floor` bytes.
    BelowFloor {
        budget: u64,
        floor: u64,
        peak: u64,
    },
    Plan(PlanError),
}

impl std::fmt::Display for BudgetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BudgetError::BelowFloor {
                budget,
                floor,
                peak,
            } => write!(
                f,
                "the memory budget of {} cannot be met: the least the step needs with activations recomputed is {} (without a budget: {}; each layer's input, vectors, weights' casts and what the backward pass reads first are always kept); give a budget of at least {}, or a smaller batch",
                size(*budget),
                size(*floor),
                size(*peak),
                size_in(*floor, true)
            ),
            BudgetError::Plan(e) => write!(f, "{e}"),
        }
    }
}

impl From<PlanError> for BudgetError {
    fn from(e: PlanError) -> Self {
        BudgetError::Plan(e)
    }
}

/// A size in the largest binary unit it reaches (GiB to 3 places, MiB
/// and KiB to 1), rounded up when `up` (a budget to ask for).
fn size_in(bytes: u64, up: bool) -> String {
    let (unit, scale, places) = if bytes >= 1 << 30 {
        ("GiB", (1u64 << 30) as f64, 1000.0)
    } else if bytes >= 1 << 20 {
        ("MiB", (1u64 << 20) as f64, 10.0)
    } else {
        ("KiB", 1024.0, 10.0)
    };
    let x = bytes as f64 / scale;
    let x = if up { (x * places).ceil() / places } else { x };
    if places == 1000.0 {
        format!("{x:.3} {unit}")
    } else {
        format!("{x:.1} {unit}")
    }
}

/// A size as the stage reports it: in the largest binary unit it reaches
/// (`plan::report` gives the memory plan in GiB throughout).
pub fn size(bytes: u64) -> String {
    size_in(bytes, false)
}

/// Parses a size as `--memory-budget` takes it: `12GiB`, `12G`, `9000MiB`,
/// `512M`, `1.5TiB`, or a bare number of GiB.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size; write it as e.g. 12GiB, 9000MiB or 12 (GiB)"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "g" | "gb" | "gib" => 1u64 << 30,
        "m" | "mb" | "mib" => 1 << 20,
        "k" | "kb" | "kib" => 1 << 10,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(format!(
                "`{other}` in `{s}` is not a unit of size; use KiB, MiB, GiB or TiB"
            ))
        }
    };
    let bytes = x * scale as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < (1u64 << 60) as f64) {
        return Err(format!(
            "`{s}` is not a usable size: give a positive size below 1 EiB, e.g. 12GiB"
        ));
    }
    Ok(bytes as u64)
}

/// The candidates in the order they are dropped: least added time per
/// byte freed first (ties in graph order, so the choice is reproducible).
pub fn candidates(g: &Graph, dims: &BTreeMap<String, i64>, device: Device) -> Vec<Dropped> {
    let env = |s: &str| dims.get(s).copied();
    let fixed = checkpoints(g);
    let all = Kept::everything(g);
    let mut scored: Vec<(f64, usize, Dropped)> = Vec::new();
    for (i, v) in saved_values(g).into_iter().enumerate() {
        // Vectors (biases, norm weights, their casts) free next to nothing,
        // and a recomputed bias would no longer be a buffer the GEMM's
        // epilogue adds as it stores; a weight's cast would be recomputed
        // with the other casts at the start of the step, freeing nothing.
        if fixed.contains(&v)
            || g.ty(v).rank() <= 1
            || rewrite::of_parameters(g, v.node)
            || rewrite::read_at_backward_start(g, v)
        {
            continue;
        }
        let bytes = cost::value_bytes(g, v, &env);
        if bytes == 0 {
            continue;
        }
        let seconds: f64 = all
            .without(&HashSet::from([v]))
            .recipe(g, v)
            .into_iter()
            .map(|n| cost::node_seconds(g, n, &env, device))
            .sum();
        let node = &g.g[v.node];
        scored.push((
            seconds / bytes as f64,
            i,
            Dropped {
                value: v,
                op: node.op.name(),
                span: node.span,
                bytes,
            },
        ));
    }
    scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    scored.into_iter().map(|(_, _, d)| d).collect()
}

/// Prefix lengths probed before the search narrows: the plan's peak does
/// not always fall as more is dropped (a recomputed value read far apart
/// lives between its readers), so the search starts from a scan.
const SCAN: usize = 16;

/// The prefix lengths of `n` candidates the search probes first.
fn scan_points(n: usize) -> Vec<usize> {
    let mut points: Vec<usize> = (1..=SCAN).map(|i| (n * i).div_ceil(SCAN)).collect();
    points.dedup();
    points
}

/// `g` with the first `k` of `order` dropped, planned: the graph, the ops
/// added and its probe.
fn dropping(
    g: &Graph,
    order: &[Dropped],
    k: usize,
    dims: &BTreeMap<String, i64>,
    target: &Target,
    device: Device,
) -> Result<(Graph, usize, Probe), PlanError> {
    let mut h = g.clone();
    let added = drop_saved(&mut h, &order[..k].iter().map(|d| d.value).collect());
    let p = probe(&h, dims, target, device)?;
    Ok((h, added, p))
}

/// Chooses what to recompute for `budget` bytes and rewrites `g` so.
/// Returns `None` if the step fits without recomputing anything.
pub fn fit_budget(
    g: &mut Graph,
    dims: &BTreeMap<String, i64>,
    budget: u64,
    target: &Target,
    device: Device,
) -> Result<Option<Choice>, BudgetError> {
    let before = probe(g, dims, target, device)?;
    if before.arena_bytes <= budget {
        return Ok(None);
    }
    // Both orders (`Graph::order_by_memory`): minding memory lowers the
    // floor where products run late (llama-small), and can cost fusion
    // elsewhere; the faster plan that fits is taken.
    let mut best: Option<Choice> = None;
    let mut floor = u64::MAX;
    for by_memory in [false, true] {
        let mut h = g.clone();
        h.order_by_memory = by_memory;
        match fit_in_order(&h, dims, budget, target, device, before) {
            Ok((h, choice)) => {
                if best
                    .as_ref()
                    .is_none_or(|b| choice.after.seconds < b.after.seconds)
                {
                    *g = h;
                    best = Some(choice);
                }
            }
            Err(BudgetError::BelowFloor { floor: f, .. }) => floor = floor.min(f),
            Err(e) => return Err(e),
        }
    }
    match best {
        Some(c) => Ok(Some(c)),
        None => Err(BudgetError::BelowFloor {
            budget,
            floor,
            peak: before.arena_bytes,
        }),
    }
}

/// [`fit_budget`] in the order `g.order_by_memory` gives: the rewritten
/// graph and the choice.
fn fit_in_order(
    g: &Graph,
    dims: &BTreeMap<String, i64>,
    budget: u64,
    target: &Target,
    device: Device,
    before: Probe,
) -> Result<(Graph, Choice), BudgetError> {
    let order = candidates(g, dims, device);
    let with = |k: usize| dropping(g, &order, k, dims, target, device);
    // A scan of prefix lengths: the first that fits, and the one before.
    let (mut lo, mut found, mut floor) = (0usize, None, before.arena_bytes);
    for k in scan_points(order.len()) {
        let r = with(k)?;
        floor = floor.min(r.2.arena_bytes);
        if r.2.arena_bytes <= budget {
            found = Some((k, r));
            break;
        }
        lo = k;
    }
    let Some((mut hi, mut best)) = found else {
        return Err(BudgetError::BelowFloor {
            budget,
            floor,
            peak: before.arena_bytes,
        });
    };
    // Then the shortest prefix between that fits (`lo` does not, `hi` does).
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        let r = with(mid)?;
        if r.2.arena_bytes <= budget {
            hi = mid;
            best = r;
        } else {
            lo = mid;
        }
    }
    let (h, ops_added, after) = best;
    let choice = Choice {
        budget: Some(budget),
        dropped: order[..hi].to_vec(),
        ops_added,
        before,
        after,
    };
    Ok((h, choice))
}

/// Without a budget: drops the kept values whose recomputation is free,
/// those made by elementwise ops from kept values and read in the backward
/// pass only by elementwise ops, which the recomputation fuses into (a
/// SwiGLU's `silu(gate)` beside the product's gradient), where the plan's
/// peak falls and its predicted time does not rise. `None` where nothing
/// qualifies or it would not pay.
pub fn free_drops(
    g: &mut Graph,
    dims: &BTreeMap<String, i64>,
    target: &Target,
    device: Device,
) -> Result<Option<Choice>, PlanError> {
    let all = Kept::everything(g);
    let free: Vec<Dropped> = candidates(g, dims, device)
        .into_iter()
        .filter(|d| rewrite::recomputes_into_readers(g, &all, d.value))
        .collect();
    if free.is_empty() {
        return Ok(None);
    }
    let before = probe(g, dims, target, device)?;
    let (h, ops_added, after) = dropping(g, &free, free.len(), dims, target, device)?;
    if after.arena_bytes >= before.arena_bytes || after.seconds > before.seconds * (1.0 + 1e-9) {
        return Ok(None);
    }
    *g = h;
    Ok(Some(Choice {
        budget: None,
        dropped: free,
        ops_added,
        before,
        after,
    }))
}

/// Drops every candidate (the most the stage ever recomputes): what the
/// tests run to exercise every recomputation at once. Returns the ops added.
pub fn drop_every_candidate(g: &mut Graph, dims: &BTreeMap<String, i64>, device: Device) -> usize {
    let all = candidates(g, dims, device)
        .into_iter()
        .map(|d| d.value)
        .collect();
    drop_saved(g, &all)
}

/// The floor: the least peak over the prefixes `fit_budget` scans.
pub fn floor(
    g: &Graph,
    dims: &BTreeMap<String, i64>,
    target: &Target,
    device: Device,
) -> Result<Probe, PlanError> {
    let order = candidates(g, dims, device);
    let mut best = probe(g, dims, target, device)?;
    for by_memory in [false, true] {
        let mut h = g.clone();
        h.order_by_memory = by_memory;
        for k in scan_points(order.len()) {
            let (_, _, p) = dropping(&h, &order, k, dims, target, device)?;
            if p.arena_bytes < best.arena_bytes {
                best = p;
            }
        }
    }
    Ok(best)
}

impl Choice {
    /// `self` (what was free), then `next` (a budget's choice on top): one
    /// choice from the first's peak to the second's.
    pub fn then(self, next: Choice) -> Choice {
        Choice {
            budget: next.budget,
            dropped: self.dropped.into_iter().chain(next.dropped).collect(),
            ops_added: self.ops_added + next.ops_added,
            before: self.before,
            after: next.after,
        }
    }

    /// The report's paragraph: what is recomputed, grouped by the op and
    /// line that makes it, the memory freed and the time added.
    pub fn describe(&self, g: &Graph, source: Option<(&str, &str)>) -> String {
        let mut s = String::new();
        let saved: u64 = self.dropped.iter().map(|d| d.bytes).sum();
        let why = match self.budget {
            Some(b) => format!("for a memory budget of {}", size(b)),
            None => "where it is free (fused into the backward kernels that read it)".to_string(),
        };
        if self.dropped.is_empty() {
            // The order that minds memory alone met the budget.
            let _ = writeln!(
                s,
                "recompute {why}: nothing dropped, the step's ops reordered to free memory sooner"
            );
        } else {
            let _ = writeln!(
                s,
                "recompute {why}: {} activations dropped ({}), {} ops run again in the backward pass",
                self.dropped.len(),
                size(saved),
                self.ops_added
            );
        }
        let _ = writeln!(
            s,
            "  peak (the arena) {} -> {}; {:+.3} TFLOP and {:+.2} ms a step predicted ({:.2} -> {:.2} ms)",
            size(self.before.arena_bytes),
            size(self.after.arena_bytes),
            (self.after.flops - self.before.flops) / 1e12,
            (self.after.seconds - self.before.seconds) * 1e3,
            self.before.seconds * 1e3,
            self.after.seconds * 1e3
        );
        // Grouped by (op, line): a repeated layer's values are one line.
        let mut groups: BTreeMap<(usize, &str), (Vec<String>, u64)> = BTreeMap::new();
        for d in &self.dropped {
            let (line, path) = match (d.span, source) {
                (Some(sp), Some((_, text))) => (
                    crate::ir::print::line_col(text, sp.start).0,
                    g.call_stack(sp)
                        .first()
                        .map(|c| c.path.clone())
                        .unwrap_or_default(),
                ),
                _ => (0, String::new()),
            };
            let e = groups.entry((line, d.op)).or_default();
            e.0.push(path);
            e.1 += d.bytes;
        }
        let file = source.map_or(String::new(), |(f, _)| {
            std::path::Path::new(f)
                .file_name()
                .map_or(f.to_string(), |n| n.to_string_lossy().to_string())
        });
        for ((line, op), (paths, bytes)) in &groups {
            let at = if *line > 0 {
                format!(" @{file}:{line}")
            } else {
                String::new()
            };
            let within = paths.iter().filter(|p| !p.is_empty()).count();
            let where_ = if within < paths.len() || paths.is_empty() {
                String::new()
            } else if paths.len() <= 3 {
                format!(" in {}", paths.join(", "))
            } else {
                format!(" in {} .. {}", paths[0], paths[paths.len() - 1])
            };
            let _ = writeln!(
                s,
                "  {op}{at}{where_}: {} value{}, {}",
                paths.len(),
                if paths.len() == 1 { "" } else { "s" },
                size(*bytes)
            );
        }
        s
    }
}
