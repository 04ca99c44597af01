//! A step as a Chrome trace (the Trace Event Format that Perfetto and
//! chrome://tracing open): one track of phase spans (forward, backward,
//! update), one track per stream with every launch, each named by its kernel
//! and carrying its source lines, ops, bytes, FLOPs and achieved rate beside
//! the roofline's prediction.
//!
//! The times come from whoever ran the step (`fusec bench --trace` on a GPU);
//! this module only lays them out, so the layout is tested without one.

use super::report::{call_stack_lines, source_lines};
use super::roofline::Estimate;
use super::LaunchKind;
use super::Plan;
use crate::ir::graph::Phase;
use crate::ir::Graph;
use crate::kernel::{Kernel, Program};
use serde_json::{json, Value};

/// When a launch ran: milliseconds after the step began, and for how long.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    pub start_ms: f64,
    pub ms: f64,
}

/// The phase a kernel serves: the one most of its ops belong to (a fused
/// kernel can hold the tail of one phase and the head of the next; ties go
/// to the later phase, the one the kernel finishes).
pub fn phase_of(g: &Graph, k: &Kernel) -> Phase {
    let mut count = [0usize; 3];
    for &n in &k.nodes {
        count[g.g[n].phase as usize] += 1;
    }
    let phases = [Phase::Forward, Phase::Backward, Phase::Update];
    // `max_by_key` keeps the last of equal keys: the later phase.
    let best = (0..3).max_by_key(|&i| count[i]).unwrap_or(0);
    if count.iter().all(|&c| c == 0) {
        Phase::Forward
    } else {
        phases[best]
    }
}

/// Where a step's launches are labelled for profilers: each launch's phase
/// and `kernel file:lines` name, in launch order.
pub fn labels(g: &Graph, p: &Program, source: Option<(&str, &str)>) -> Vec<(Phase, String)> {
    p.kernels
        .iter()
        .map(|k| {
            let lines = source.and_then(|(file, text)| source_lines(g, k, file, text));
            let name = match lines {
                Some(l) => format!("{} {l}", k.name),
                None => k.name.clone(),
            };
            (phase_of(g, k), name)
        })
        .collect()
}

const PID: u64 = 1;
const PHASES: u64 = 0;
const COMPUTE: u64 = 1;
const COMMUNICATION: u64 = 2;

fn us(ms: f64) -> f64 {
    // Whole nanoseconds: the format's unit is the microsecond.
    (ms * 1e6).round() / 1e3
}

/// The trace of one step. `times[i]` is launch `i`'s; `title` names the run
/// (model, sizes, device).
pub fn chrome_trace(
    g: &Graph,
    p: &Program,
    plan: &Plan,
    est: &Estimate,
    source: Option<(&str, &str)>,
    times: &[Timing],
    title: &str,
) -> Value {
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": PID, "args": {"name": title}}),
        json!({"name": "thread_name", "ph": "M", "pid": PID, "tid": PHASES, "args": {"name": "phases"}}),
        json!({"name": "thread_name", "ph": "M", "pid": PID, "tid": COMPUTE, "args": {"name": "compute stream"}}),
        json!({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": PHASES, "args": {"sort_index": 0}}),
        json!({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": COMPUTE, "args": {"sort_index": 1}}),
    ];
    let communicates = plan.launches.iter().any(|l| l.kind.communicates());
    if communicates {
        events.push(json!({"name": "thread_name", "ph": "M", "pid": PID, "tid": COMMUNICATION, "args": {"name": "communication stream"}}));
        events.push(json!({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": COMMUNICATION, "args": {"sort_index": 2}}));
    }
    // Runs of launches in one phase, as (phase, first, last).
    let mut runs: Vec<(Phase, usize, usize)> = Vec::new();
    for (i, (k, l)) in p.kernels.iter().zip(&plan.launches).enumerate() {
        let Some(t) = times.get(i) else { break };
        let phase = phase_of(g, k);
        match runs.last_mut() {
            Some((ph, _, last)) if *ph == phase => *last = i,
            _ => runs.push((phase, i, i)),
        }
        let cost = &est.kernels[i];
        let mut args = serde_json::Map::new();
        if let Some((file, text)) = source {
            if let Some(lines) = source_lines(g, k, file, text) {
                args.insert("source".into(), json!(lines));
            }
            // The call stack of its first op with a place of its own.
            if let Some(&n) = k.nodes.iter().find(|&&n| g.g[n].span.is_some()) {
                let node = &g.g[n];
                let stack = call_stack_lines(g, node.span.unwrap(), node.op.name(), file, text);
                args.insert("stack".into(), json!(stack));
            }
        }
        args.insert("phase".into(), json!(phase.name()));
        args.insert("kind".into(), json!(l.kind));
        args.insert("ops".into(), json!(l.ops.join(", ")));
        args.insert("bytes".into(), json!(cost.bytes as u64));
        args.insert("flops".into(), json!(cost.flops as u64));
        let seconds = t.ms / 1e3;
        if seconds > 0.0 {
            args.insert("GB/s".into(), json!(round1(cost.bytes / seconds / 1e9)));
            if cost.flops > 0.0 {
                args.insert("TFLOP/s".into(), json!(round1(cost.flops / seconds / 1e12)));
            }
        }
        args.insert(
            format!("roofline us ({})", est.device.name),
            json!(round1(cost.seconds * 1e6)),
        );
        args.insert(
            "bound by".into(),
            json!(if cost.compute_bound {
                "compute"
            } else {
                "memory"
            }),
        );
        for st in &l.steps {
            if let Some(t) = &st.template {
                args.insert("template".into(), json!(t));
            }
        }
        let tid = if l.kind.communicates() {
            COMMUNICATION
        } else {
            COMPUTE
        };
        events.push(json!({
            "name": k.name,
            "cat": l.kind,
            "ph": "X",
            "ts": us(t.start_ms),
            "dur": us(t.ms),
            "pid": PID,
            "tid": tid,
            "args": Value::Object(args),
        }));
    }
    for (phase, first, last) in runs {
        let start = times[first].start_ms;
        let end = times[last].start_ms + times[last].ms;
        events.push(json!({
            "name": phase.name(),
            "cat": "phase",
            "ph": "X",
            "ts": us(start),
            "dur": us(end - start),
            "pid": PID,
            "tid": PHASES,
            "args": {"launches": last - first + 1},
        }));
    }
    let total: f64 = times.iter().map(|t| t.ms).sum();
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "title": title,
            "model": g.name,
            "dims": plan.dims,
            "launches": plan.launches.len(),
            "launch_ms_total": total,
        },
    })
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Launch times the roofline predicts, back to back: a trace to read before
/// running, and what the tests lay out.
pub fn predicted(est: &Estimate) -> Vec<Timing> {
    let mut at = 0.0;
    est.kernels
        .iter()
        .map(|k| {
            let t = Timing {
                start_ms: at,
                ms: k.seconds * 1e3,
            };
            at += t.ms;
            t
        })
        .collect()
}

/// The colour of a launch by its kind: GEMMs, generated kernels, attention
/// templates, collectives, the rest.
fn colour(kind: &str) -> (&'static str, &'static str) {
    match kind {
        "generated" => ("#54a24b", "generated kernels"),
        "template" => ("#b279a2", "templates (attention, skinny GEMMs)"),
        "all_reduce" => ("#e45756", "collectives"),
        k if k == LaunchKind::Gemm.as_str() => ("#4c78a8", "GEMMs (cuBLASLt)"),
        _ => ("#9d9d9d", "other"),
    }
}

fn phase_colour(name: &str) -> &'static str {
    match name {
        "forward" => "#9ecae9",
        "backward" => "#ffbf79",
        _ => "#d6a5c9",
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A picture of a trace (as [`chrome_trace`] writes it) for reading without
/// a trace viewer: phases on top, then one row per stream, every launch a
/// rectangle as wide as its time, hovering it naming the kernel, its source
/// lines, time and rate. Each launch's rectangle has class `launch`.
pub fn svg(trace: &Value) -> String {
    use std::fmt::Write;
    let events = trace["traceEvents"].as_array().cloned().unwrap_or_default();
    let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let end_us = spans
        .iter()
        .map(|e| e["ts"].as_f64().unwrap_or(0.0) + e["dur"].as_f64().unwrap_or(0.0))
        .fold(0.0, f64::max)
        .max(1e-3);
    let tracks: Vec<(u64, String)> = {
        let mut t: Vec<(u64, String)> = events
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
            .map(|e| {
                (
                    e["tid"].as_u64().unwrap_or(0),
                    e["args"]["name"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect();
        t.sort();
        t
    };
    let (left, width, row, gap) = (150.0, 1250.0, 46.0, 10.0);
    let top = 56.0;
    let height = top + tracks.len() as f64 * (row + gap) + 90.0;
    let x = |us: f64| left + us / end_us * width;
    let mut s = String::new();
    let title = trace["otherData"]["title"].as_str().unwrap_or("fusec step");
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="12">"#,
        left + width + 30.0
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="10" y="20" font-size="15" font-weight="bold">{}</text>"#,
        escape(title)
    );
    let launches = spans.iter().filter(|e| e["cat"] != "phase").count();
    let _ = writeln!(
        s,
        r##"<text x="10" y="38" fill="#555">{launches} launches, {:.3} ms from the first to the last (hover a launch for its source lines, time and rate)</text>"##,
        end_us / 1e3
    );
    let y_of = |tid: u64| {
        let i = tracks.iter().position(|t| t.0 == tid).unwrap_or(0);
        top + i as f64 * (row + gap)
    };
    for (tid, name) in &tracks {
        let _ = writeln!(
            s,
            r##"<text x="10" y="{}" fill="#333">{}</text>"##,
            y_of(*tid) + row / 2.0 + 4.0,
            escape(name)
        );
    }
    let mut kinds: Vec<(&str, &str)> = Vec::new();
    for e in &spans {
        let (ts, dur) = (
            e["ts"].as_f64().unwrap_or(0.0),
            e["dur"].as_f64().unwrap_or(0.0),
        );
        let name = e["name"].as_str().unwrap_or("");
        let y = y_of(e["tid"].as_u64().unwrap_or(0));
        let w = (x(ts + dur) - x(ts)).max(0.6);
        if e["cat"] == "phase" {
            let _ = writeln!(
                s,
                r##"<rect class="phase" x="{:.2}" y="{y}" width="{w:.2}" height="{row}" fill="{}" stroke="white"><title>{name}: {:.3} ms</title></rect>"##,
                x(ts),
                phase_colour(name),
                dur / 1e3
            );
            if w > 60.0 {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.2}" y="{}">{name}</text>"#,
                    x(ts) + 4.0,
                    y + row / 2.0 + 4.0
                );
            }
            continue;
        }
        let kind = e["cat"].as_str().unwrap_or("");
        let (fill, what) = colour(kind);
        if !kinds.iter().any(|k| k.1 == what) {
            kinds.push((fill, what));
        }
        let a = &e["args"];
        let mut tip = format!("{name} ({kind}): {:.1} us", dur);
        if let Some(src) = a["source"].as_str() {
            let _ = write!(tip, "\n{src}");
        }
        if let Some(ops) = a["ops"].as_str() {
            let _ = write!(tip, "\nops: {ops}");
        }
        if let Some(r) = a["GB/s"].as_f64() {
            let _ = write!(tip, "\n{r} GB/s");
        }
        if let Some(r) = a["TFLOP/s"].as_f64() {
            let _ = write!(tip, ", {r} TFLOP/s");
        }
        let _ = writeln!(
            s,
            r##"<rect class="launch" x="{:.2}" y="{y}" width="{w:.2}" height="{row}" fill="{fill}" stroke="#fff" stroke-width="0.3"><title>{}</title></rect>"##,
            x(ts),
            escape(&tip)
        );
    }
    // A time axis in round steps.
    let axis_y = top + tracks.len() as f64 * (row + gap) + 8.0;
    let step = (-3..8)
        .flat_map(|p| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(p)))
        .find(|st| end_us / st <= 12.0)
        .unwrap_or(end_us);
    let _ = writeln!(
        s,
        r##"<line x1="{left}" y1="{axis_y}" x2="{}" y2="{axis_y}" stroke="#333"/>"##,
        left + width
    );
    let mut t = 0.0;
    while t <= end_us + 1e-9 {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.2}" y1="{axis_y}" x2="{0:.2}" y2="{1}" stroke="#333"/><text x="{0:.2}" y="{2}" text-anchor="middle" fill="#333">{3} ms</text>"##,
            x(t),
            axis_y + 5.0,
            axis_y + 18.0,
            crate::ir::print::num(t / 1e3)
        );
        t += step;
    }
    let mut lx = left;
    for (fill, what) in kinds {
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="{}" width="14" height="14" fill="{fill}"/><text x="{}" y="{}">{what}</text>"#,
            axis_y + 34.0,
            lx + 20.0,
            axis_y + 46.0
        );
        lx += 40.0 + 7.5 * what.len() as f64;
    }
    s.push_str("</svg>\n");
    s
}
