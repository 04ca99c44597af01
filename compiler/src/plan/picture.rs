//! The memory plan as a picture (`memory.html`, written by `fusec build`):
//! the arena over one step, launch order across and offset up, every
//! buffer a rectangle over the launches it is alive for, coloured by what
//! it holds. Hovering a buffer names it, its size, its life and the line of
//! the model file that made it. The peak is marked. One self-contained SVG
//! in an HTML page: no script, nothing fetched.

use super::{MemKind, Plan};
use crate::ir::graph::{Graph, Phase};
use crate::ir::print::line_col;
use crate::kernel::Program;
use std::fmt::Write;

const WIDTH: f64 = 1200.0;
const HEIGHT: f64 = 560.0;
const LEFT: f64 = 70.0;
const BOTTOM: f64 = 40.0;

/// What a buffer holds, as the picture colours it.
fn class(kind: MemKind, kept: bool) -> (&'static str, &'static str) {
    match kind {
        MemKind::Param => ("weights", "#4c78a8"),
        MemKind::Grad => ("gradients", "#f58518"),
        MemKind::OptimizerState => ("optimizer state", "#b279a2"),
        MemKind::Input => ("inputs", "#9d9d9d"),
        MemKind::Activation if kept => ("activations kept for backward", "#54a24b"),
        MemKind::Activation => ("temporaries", "#b5dca8"),
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The page, for program `p` of graph `g` planned as `plan`; `source` is
/// the model file's text (for the lines).
pub fn memory_html(
    g: &Graph,
    p: &Program,
    plan: &Plan,
    source: Option<&str>,
    file: &str,
) -> String {
    let launches = plan.launches.len().max(1) as f64;
    let top = plan.arena_bytes.max(1) as f64;
    let x = |k: f64| LEFT + k / launches * (WIDTH - LEFT - 10.0);
    let y = |b: f64| HEIGHT - BOTTOM - b / top * (HEIGHT - BOTTOM - 10.0);
    let phase_of = |k: usize| -> Option<&Phase> {
        p.kernels
            .get(k)
            .and_then(|kernel| kernel.nodes.first())
            .map(|&n| &g.g[n].phase)
    };
    let mut rects = String::new();
    let mut drawn = 0;
    // Bytes alive at each launch, for the peak.
    let mut alive = vec![0u64; plan.launches.len() + 1];
    for (i, b) in plan.buffers.iter().enumerate() {
        if b.alias_of.is_some() || b.shares_with.is_some() || b.bytes == 0 {
            continue;
        }
        let (a, z) = b.live.unwrap_or((0, plan.launches.len()));
        for slot in alive
            .iter_mut()
            .take(z.min(plan.launches.len()) + 1)
            .skip(a)
        {
            *slot += b.bytes;
        }
        let kept = b.kind == MemKind::Activation
            && matches!(phase_of(a), Some(Phase::Forward))
            && matches!(
                phase_of(z.min(plan.launches.len().saturating_sub(1))),
                Some(Phase::Backward)
            );
        let (what, colour) = class(b.kind, kept);
        let made = p
            .buffers
            .get(i)
            .and_then(|buf| g.g[buf.value.node].span.map(|s| (buf, s)))
            .and_then(|(buf, s)| {
                let (l, _) = line_col(source?, s.start);
                Some(format!(
                    ", made by {} at {file}:{l}",
                    g.g[buf.value.node].op.name()
                ))
            })
            .unwrap_or_default();
        let life = match b.live {
            Some((a, z)) => format!("launches {a}..{z}"),
            None => "the whole run".to_string(),
        };
        let (x0, x1) = (x(a as f64), x((z + 1).min(plan.launches.len()) as f64));
        let (y0, y1) = (y((b.offset + b.bytes) as f64), y(b.offset as f64));
        let _ = writeln!(
            rects,
            "<rect class=\"buffer\" x=\"{x0:.1}\" y=\"{y0:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{colour}\" stroke=\"#333\" stroke-width=\"0.3\"><title>{}</title></rect>",
            (x1 - x0).max(0.8),
            (y1 - y0).max(0.8),
            escape(&format!(
                "{} ({what}): {} {:?}, {:.2} MiB at offset {:.2} MiB, alive {life}{made}",
                b.name,
                b.dtype,
                b.shape,
                b.bytes as f64 / (1u64 << 20) as f64,
                b.offset as f64 / (1u64 << 20) as f64
            ))
        );
        drawn += 1;
    }
    let (peak_at, peak) = alive
        .iter()
        .enumerate()
        .max_by_key(|(_, &b)| b)
        .map(|(k, &b)| (k, b))
        .unwrap_or((0, 0));
    let peak_name = plan
        .launches
        .get(peak_at)
        .map_or("the end", |l| l.kernel.as_str());
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>fusec memory plan: {name}</title>\n\
         <style>body{{font-family:sans-serif;margin:16px}} .legend span{{display:inline-block;width:12px;height:12px;margin:0 4px 0 14px;vertical-align:middle}}</style></head><body>\n\
         <h2>Memory plan of {name}</h2>\n<p>Arena {arena:.3} GiB; {drawn} buffers; peak {peak:.3} GiB alive at {peak_name}. \
         Launch order across, offset in the arena up; hover a buffer for what it is.</p>\n<p class=\"legend\">",
        name = escape(&plan.model),
        arena = gib(plan.arena_bytes),
        peak = gib(peak),
    );
    for kind in [
        MemKind::Param,
        MemKind::Grad,
        MemKind::OptimizerState,
        MemKind::Input,
    ] {
        let (what, colour) = class(kind, false);
        let _ = write!(s, "<span style=\"background:{colour}\"></span>{what}");
    }
    for kept in [true, false] {
        let (what, colour) = class(MemKind::Activation, kept);
        let _ = write!(s, "<span style=\"background:{colour}\"></span>{what}");
    }
    let _ = write!(
        s,
        "</p>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" viewBox=\"0 0 {WIDTH} {HEIGHT}\">\n\
         <rect x=\"0\" y=\"0\" width=\"{WIDTH}\" height=\"{HEIGHT}\" fill=\"white\"/>\n"
    );
    s.push_str(&rects);
    let px = x(peak_at as f64);
    let _ = write!(
        s,
        "<line x1=\"{px:.1}\" y1=\"10\" x2=\"{px:.1}\" y2=\"{:.1}\" stroke=\"#d62728\" stroke-width=\"1.5\" stroke-dasharray=\"4 3\"/>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" fill=\"#d62728\" font-size=\"12\">peak {:.3} GiB</text>\n\
         <line x1=\"{LEFT}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\n\
         <text x=\"{LEFT}\" y=\"{:.1}\" font-size=\"12\">launch 0</text>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"end\">launch {}</text>\n\
         <text x=\"4\" y=\"16\" font-size=\"12\">{:.2} GiB</text>\n<text x=\"4\" y=\"{:.1}\" font-size=\"12\">0</text>\n\
         </svg>\n<p>Written by <code>fusec build</code> from {}.</p></body></html>\n",
        HEIGHT - BOTTOM,
        px + 4.0,
        HEIGHT - BOTTOM + 30.0,
        gib(peak),
        HEIGHT - BOTTOM,
        WIDTH - 10.0,
        HEIGHT - BOTTOM,
        HEIGHT - BOTTOM + 16.0,
        WIDTH - 10.0,
        HEIGHT - BOTTOM + 16.0,
        plan.launches.len(),
        gib(plan.arena_bytes),
        HEIGHT - BOTTOM,
        escape(file)
    );
    s
}
