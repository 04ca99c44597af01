//! The stable text form of a graph. Values are numbered in topological
//! order, so the same model always prints the same text; each line ends with
//! the model-file position it came from when the source is known.

use super::graph::{Graph, Phase, Value};
use std::collections::HashMap;
use std::fmt::Write;

/// Shortest faithful form of a number: `0.02`, `1e-8`, `-inf`.
pub fn num(x: f64) -> String {
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x != 0.0 && (x.abs() < 1e-4 || x.abs() >= 1e7) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// 1-based line and column of a byte offset.
pub fn line_col(src: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(src.len());
    let before = &src.as_bytes()[..offset];
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |p| p + 1);
    let col = String::from_utf8_lossy(&before[line_start..])
        .chars()
        .count()
        + 1;
    (line, col)
}

pub struct Names(HashMap<Value, usize>);

impl Names {
    pub fn of(g: &Graph) -> Names {
        let mut map = HashMap::new();
        for n in g.topo_order() {
            for port in 0..g.g[n].outputs.len() {
                let k = map.len();
                map.insert(Value { node: n, port }, k);
            }
        }
        Names(map)
    }
    pub fn get(&self, v: Value) -> String {
        match self.0.get(&v) {
            Some(k) => format!("%{k}"),
            None => "%?".into(),
        }
    }
}

pub fn print_graph(g: &Graph, src: Option<&str>) -> String {
    let names = Names::of(g);
    let mut out = String::new();
    let _ = writeln!(out, "graph {} ({})", g.name, g.dims.join(", "));
    if !g.params.is_empty() {
        let _ = writeln!(out, "params:");
        for (i, p) in g.params.iter().enumerate() {
            let count = p.ty.numel();
            let decay = if p.decay { "" } else { " no_decay" };
            let _ = writeln!(
                out,
                "  [{i}] {}: {} = {}{decay}  # {count} values",
                p.name, p.ty, p.init
            );
        }
    }
    let mut phase: Option<Phase> = None;
    for n in g.topo_order() {
        let node = &g.g[n];
        if phase != Some(node.phase) {
            phase = Some(node.phase);
            let _ = writeln!(out, "{}:", node.phase.name());
        }
        let outs: Vec<String> = (0..node.outputs.len())
            .map(|port| {
                format!(
                    "{}: {}",
                    names.get(Value { node: n, port }),
                    node.outputs[port]
                )
            })
            .collect();
        let args: Vec<String> = g.inputs(n).into_iter().map(|v| names.get(v)).collect();
        let mut line = if args.is_empty() {
            format!("  {} = {}", outs.join(", "), node.op.name())
        } else {
            format!(
                "  {} = {}({})",
                outs.join(", "),
                node.op.name(),
                args.join(", ")
            )
        };
        for a in node.op.attrs() {
            line.push(' ');
            line.push_str(&a);
        }
        if node.recompute {
            line.push_str("  recomputed");
        }
        if let (Some(src), Some(span)) = (src, node.span) {
            let (l, c) = line_col(src, span.start);
            let _ = write!(line, "  @{l}:{c}");
        }
        let _ = writeln!(out, "{line}");
    }
    if !g.outputs.is_empty() {
        let _ = writeln!(out, "outputs:");
        for (role, v) in &g.outputs {
            let _ = writeln!(out, "  {role} = {}", names.get(*v));
        }
    }
    out
}
