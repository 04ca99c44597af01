//! Every pass keeps the function: the training graph of every shipped model
//! (at tiny sizes) gives the same outputs, evaluated in f64 on the same
//! random inputs, before and after each pass, to 1e-12 relative.

mod common;

use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::{run, Precision};
use fusec_compiler::ir::Graph;
use fusec_compiler::passes::{default_pipeline, run_pipeline};

fn outputs(g: &Graph, feeds: &fusec_compiler::interp::Feeds) -> Vec<(String, Vec<f64>)> {
    let vals = run(g, feeds, Precision::F64).expect("evaluates");
    g.outputs
        .iter()
        .map(|(r, v)| (r.to_string(), vals[v].data.clone()))
        .collect()
}

fn assert_same(what: &str, a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)]) {
    assert_eq!(a.len(), b.len(), "{what}: output count");
    for ((ra, va), (rb, vb)) in a.iter().zip(b) {
        assert_eq!(ra, rb, "{what}");
        for (x, y) in va.iter().zip(vb) {
            let ok = (x - y).abs() <= 1e-12 * x.abs().max(y.abs()).max(1.0);
            assert!(ok, "{what}: output {ra} differs: {x} vs {y}");
        }
    }
}

#[test]
fn every_pass_preserves_every_models_outputs() {
    let mut removed = 0;
    for (file, sets, dims) in common::tiny_models() {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        let mut g = c.training.clone();
        let feeds = random_feeds(&g, &common::dims(&dims), 5).expect("feeds");
        let reference = outputs(&g, &feeds);
        let mut after = Vec::new();
        let stats = run_pipeline(&mut g, &default_pipeline(), |pass, g| {
            after.push((pass.to_string(), outputs(g, &feeds)))
        })
        .unwrap_or_else(|e| panic!("{file}: {e}"));
        for (pass, out) in &after {
            assert_same(&format!("{file} after {pass}"), &reference, out);
        }
        let first = stats.first().unwrap().1.nodes_before;
        let last = stats.last().unwrap().1.nodes_after;
        println!("{file}: {first} -> {last} nodes ({stats:?})");
        removed += first - last;
    }
    // `err * err` in gpt2-block differentiates into two equal products.
    assert!(removed > 0, "the passes removed nothing from any model");
}
