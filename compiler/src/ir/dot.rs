//! Graphviz export: `fusec build --dump <stage> --format dot | dot -Tsvg`.

use super::graph::{Graph, Phase, Value};
use super::print::Names;
use std::fmt::Write;

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

pub fn to_dot(g: &Graph) -> String {
    let names = Names::of(g);
    let mut out = String::new();
    let _ = writeln!(out, "digraph \"{}\" {{", escape(&g.name));
    let _ = writeln!(
        out,
        "  node [shape=box, fontname=\"monospace\", fontsize=10];"
    );
    for n in g.topo_order() {
        let node = &g.g[n];
        let color = match node.phase {
            Phase::Forward => "#dbe9f6",
            Phase::Backward => "#f6e3db",
            Phase::Update => "#e2f0d9",
        };
        let mut label = node.op.name().to_string();
        let attrs = node.op.attrs();
        if !attrs.is_empty() {
            label.push(' ');
            label.push_str(&attrs.join(" "));
        }
        let _ = writeln!(
            out,
            "  n{} [label=\"{}\", style=filled, fillcolor=\"{color}\"];",
            n.index(),
            escape(&label)
        );
    }
    for n in g.topo_order() {
        for (slot, v) in g.inputs(n).into_iter().enumerate() {
            let label = format!("{} {}", names.get(v), g.ty(v));
            let _ = writeln!(
                out,
                "  n{} -> n{} [label=\"{}\", taillabel=\"{}\"];",
                v.node.index(),
                n.index(),
                escape(&label),
                slot
            );
        }
    }
    for (role, v) in &g.outputs {
        let id = format!(
            "out_{}",
            escape(&role.to_string()).replace(['[', ']', ' ', '"'], "_")
        );
        let _ = writeln!(
            out,
            "  {id} [label=\"{}\", shape=ellipse];",
            escape(&role.to_string())
        );
        let Value { node, .. } = v;
        let _ = writeln!(out, "  n{} -> {id};", node.index());
    }
    let _ = writeln!(out, "}}");
    out
}
