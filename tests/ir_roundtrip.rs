//! The text form reads back: every shipped model's forward, training and
//! optimized graphs, printed, parsed and printed again, give the same text
//! (with or without the model-file positions, which parsing drops), and so
//! does a step with recomputed ops, in the file's order or the one that
//! minds memory. Malformed text is an error at its line and column.

mod common;

use fusec_compiler::ir::parse::parse_graph;
use fusec_compiler::ir::print::print_graph;
use fusec_compiler::ir::Graph;
use fusec_compiler::plan::roofline::device;
use fusec_compiler::recompute;
use std::collections::BTreeMap;

fn shipped_models() -> Vec<String> {
    common::shipped_models()
}

/// Panics at the first line where `got` leaves `want`.
fn same_text(what: &str, want: &str, got: &str) {
    if want == got {
        return;
    }
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    let at = w
        .iter()
        .zip(&g)
        .position(|(a, b)| a != b)
        .unwrap_or(w.len().min(g.len()));
    panic!(
        "{what}: the text read back differs at line {}:\n  printed:   {}\n  read back: {}",
        at + 1,
        w.get(at).unwrap_or(&"(the end)"),
        g.get(at).unwrap_or(&"(the end)")
    );
}

/// Print, parse, print: the same text. Also from the text with positions.
fn reads_back(what: &str, g: &Graph, src: &str) {
    let text = print_graph(g, None);
    let back = parse_graph(&text).unwrap_or_else(|e| panic!("{what}: {e}"));
    same_text(what, &text, &print_graph(&back, None));
    let placed = print_graph(g, Some(src));
    let back = parse_graph(&placed).unwrap_or_else(|e| panic!("{what} (with positions): {e}"));
    same_text(
        &format!("{what} (with positions)"),
        &text,
        &print_graph(&back, None),
    );
}

#[test]
fn every_shipped_models_graphs_read_back() {
    for file in shipped_models() {
        let (name, src) = common::example(&file);
        let c = common::compile_with(&src, &name, &[]);
        reads_back(&format!("{file} forward"), &c.model.graph, &src);
        reads_back(&format!("{file} train"), &c.training, &src);
        reads_back(&format!("{file} optimized"), &c.optimized, &src);
    }
}

#[test]
fn a_step_with_recomputed_ops_reads_back() {
    let mut recomputed = 0;
    for (file, sets, dims) in common::tiny_models() {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        let dims: BTreeMap<String, i64> = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let mut g = c.optimized.clone();
        recomputed +=
            recompute::drop_every_candidate(&mut g, &dims, device("h100").expect("a device"));
        reads_back(&format!("{file} recomputed"), &g, &src);
        // The order that minds memory is no flag in the text, but the
        // parsed graph's nodes are numbered in it, which gives it back.
        g.order_by_memory = true;
        reads_back(&format!("{file} recomputed, ordered by memory"), &g, &src);
    }
    assert!(recomputed > 0, "no model recomputed anything");
}

#[test]
fn parse_errors_carry_line_and_column() {
    let (name, src) = common::example("mlp.dsl");
    let text = print_graph(&common::compile_with(&src, &name, &[]).training, None);
    let lines: Vec<&str> = text.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.contains("= matmul("))
        .expect("a product");
    let line = lines[at];
    // The product's line spoilt, where the error must point, what it says.
    let cases = [
        (
            line.replace("matmul", "matmult"),
            "matmult",
            "unknown op `matmult`",
        ),
        (
            format!("{line} transposed"),
            "transposed",
            "expected the end of the line",
        ),
        (
            line.replacen("(%", "(%nope, %", 1),
            "%nope",
            "value `%nope` is not defined",
        ),
        (line.replacen("f32[", "f33[", 1), "f33", "expected a dtype"),
        (line.replacen(" = ", " ", 1), "matmul", "expected `=`"),
    ];
    for (edited, word, message) in cases {
        let mut broken = lines.clone();
        broken[at] = &edited;
        let e = parse_graph(&broken.join("\n")).expect_err(&edited);
        let col = edited[..edited.find(word).expect("the word")]
            .chars()
            .count()
            + 1;
        assert_eq!((e.line, e.col), (at + 1, col), "{edited}: {e}");
        assert!(e.message.contains(message), "{edited}: {e}");
        assert!(
            e.to_string().starts_with(&format!("{}:{col}: ", at + 1)),
            "{e}"
        );
    }
}
