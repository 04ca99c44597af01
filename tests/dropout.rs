//! Dropout on the CPU reference: gradients against finite differences,
//! the share dropped, the backward pass reusing the forward's mask, keys
//! that change the masks, validation without dropout, and the model file's
//! errors. The GPU kernels' masks are checked against these in
//! tests/cuda_host.rs (host-run) and runtime/tests/step_gpu.rs.

mod common;

use fusec_compiler::autodiff::add_backward;
use fusec_compiler::gradcheck::{check_model, Tolerance};
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::{run, Precision};
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ops::{Op, DROPOUT_KEY_INPUT};

fn encoder() -> String {
    std::fs::read_to_string(common::root().join("tests/models/encoder-dropout.dsl")).unwrap()
}

/// Dropout with a fixed key is linear in x, so central differences see the
/// same mask as autodiff: the usual f64 bound holds at every p.
#[test]
fn gradients_match_finite_differences_with_dropout_on() {
    for p in ["0.1", "0.5"] {
        let c = common::compile_with(&encoder(), "encoder-dropout.dsl", &[("p", p)]);
        let backward = add_backward(&c.model).expect("differentiates");
        let report = check_model(
            &c.model,
            &backward,
            &common::dims(&[("B", 2), ("T", 7)]),
            7,
            6,
            Tolerance::default(),
        )
        .expect("evaluates");
        println!(
            "p = {p}: {} entries, max rel error {:.2e}",
            report.checked, report.max_rel_err
        );
        assert!(report.checked > 0);
        assert!(report.failures.is_empty(), "{:?}", report.failures);
    }
}

const ONE_DROPOUT: &str = "
param w: [64, 50] = normal(1.0)
let y = dropout(w, P)
train {
    loss = mean(y * y)
    optimizer = sgd(lr = 0.1)
}
";

/// For loss = mean(dropout(w)^2) the gradient of w is
/// 2 / n * mask * w / (1 - p)^2: zero exactly where the forward pass
/// dropped, w scaled by the same factor everywhere else. A backward pass
/// that drew its own mask, or none, breaks both.
#[test]
fn the_backward_pass_reuses_the_forward_mask() {
    for p in [0.1, 0.3, 0.75] {
        let src = ONE_DROPOUT.replace('P', &p.to_string());
        let c = common::compile_with(&src, "one-dropout.dsl", &[]);
        let g = add_backward(&c.model).unwrap();
        let feeds = random_feeds(&g, &common::dims(&[]), 3).unwrap();
        let vals = run(&g, &feeds, Precision::F64).unwrap();
        let grad = &vals[&g.output(&Role::Grad(0)).unwrap()].data;
        let w = &feeds.params["w"].data;
        let n = w.len() as f64;
        let factor = 2.0 / n / ((1.0 - p) * (1.0 - p));
        let mut dropped = 0;
        for (g, w) in grad.iter().zip(w) {
            if *g == 0.0 {
                dropped += 1;
            } else {
                assert!(
                    (g - factor * w).abs() <= 1e-12 * (factor * w).abs(),
                    "p {p}: a kept element's gradient {g} is not {}",
                    factor * w
                );
            }
        }
        // The share dropped is p within 5 binomial standard deviations of
        // 3,200 draws (sigma <= 0.0089).
        let rate = dropped as f64 / n;
        let sigma = (p * (1.0 - p) / n).sqrt();
        assert!(
            (rate - p).abs() < 5.0 * sigma,
            "p {p}: dropped {rate}, 5 sigma {}",
            5.0 * sigma
        );
        // And the loss saw the same elements: mean of the kept squares.
        let loss = vals[&g.output(&Role::Loss).unwrap()].data[0];
        let want: f64 = grad
            .iter()
            .zip(w)
            .filter(|(g, _)| **g != 0.0)
            .map(|(_, w)| (w / (1.0 - p)).powi(2))
            .sum::<f64>()
            / n;
        assert!(
            (loss - want).abs() <= 1e-12 * want,
            "p {p}: loss {loss} vs {want}"
        );
    }
}

/// A new key draws a new mask; the same key the same one.
#[test]
fn the_key_decides_the_mask() {
    let src = ONE_DROPOUT.replace('P', "0.5");
    let c = common::compile_with(&src, "one-dropout.dsl", &[]);
    let g = add_backward(&c.model).unwrap();
    let mut feeds = random_feeds(&g, &common::dims(&[]), 3).unwrap();
    let mut grads = Vec::new();
    for key in [[1.0, 2.0], [1.0, 3.0], [1.0, 2.0]] {
        feeds
            .inputs
            .insert(DROPOUT_KEY_INPUT.into(), Tensor::new(vec![2], key.to_vec()));
        let vals = run(&g, &feeds, Precision::F64).unwrap();
        grads.push(vals[&g.output(&Role::Grad(0)).unwrap()].data.clone());
    }
    assert_eq!(grads[0], grads[2]);
    assert_ne!(grads[0], grads[1]);
}

/// Two dropouts of one tensor draw independent masks (each call is its own
/// site).
#[test]
fn each_call_draws_its_own_mask() {
    let src = "
param w: [40, 50] = normal(1.0)
let a = dropout(w, 0.5)
let b = dropout(w, 0.5)
train {
    loss = mean(a * b)
    optimizer = sgd(lr = 0.1)
}
";
    let c = common::compile_with(src, "two-dropouts.dsl", &[]);
    let sites: Vec<u32> = c
        .model
        .graph
        .g
        .node_weights()
        .filter_map(|n| match &n.op {
            Op::Dropout(d) => Some(d.site),
            _ => None,
        })
        .collect();
    assert_eq!(sites.len(), 2);
    assert_ne!(sites[0], sites[1]);
    let feeds = random_feeds(&c.model.graph, &common::dims(&[]), 5).unwrap();
    let vals = run(&c.model.graph, &feeds, Precision::F64).unwrap();
    // mean(a * b) keeps an element only where both masks keep it: a
    // quarter of them at p = 0.5, not half (one mask drawn twice).
    let loss = vals[&c.model.graph.output(&Role::Loss).unwrap()].data[0];
    let w = &feeds.params["w"].data;
    let all: f64 = w.iter().map(|x| 4.0 * x * x).sum::<f64>() / w.len() as f64;
    let share = loss / all;
    assert!(
        (share - 0.25).abs() < 0.1,
        "kept share {share}: the two masks are not independent"
    );
}

/// Validation runs the forward pass without dropout: its loss is the loss
/// of the same model with p = 0, at the same weights and batch.
#[test]
fn validation_runs_without_dropout() {
    let on = common::compile_with(&encoder(), "encoder-dropout.dsl", &[("p", "0.3")]);
    let off = common::compile_with(&encoder(), "encoder-dropout.dsl", &[("p", "0")]);
    let fwd = fusec_compiler::driver::forward_graph(&on).unwrap();
    assert!(fwd
        .g
        .node_weights()
        .all(|n| !matches!(&n.op, Op::Dropout(_))
            && !matches!(&n.op, Op::Input(i) if i.name == DROPOUT_KEY_INPUT)));
    assert!(on
        .model
        .graph
        .g
        .node_weights()
        .any(|n| matches!(n.op, Op::Dropout(_))));
    let dims = common::dims(&[("B", 2), ("T", 7)]);
    let feeds = random_feeds(&off.model.graph, &dims, 9).unwrap();
    let loss = |g: &fusec_compiler::ir::Graph| {
        run(g, &feeds, Precision::F64).unwrap()[&g.output(&Role::Loss).unwrap()].data[0]
    };
    let want = loss(&off.model.graph);
    assert_eq!(loss(&fwd).to_bits(), want.to_bits());
    // With dropout on, the training loss is another number.
    let mut train_feeds = feeds.clone();
    train_feeds.inputs.insert(
        DROPOUT_KEY_INPUT.into(),
        Tensor::new(vec![2], vec![5.0, 6.0]),
    );
    let train = run(&on.model.graph, &train_feeds, Precision::F64).unwrap()
        [&on.model.graph.output(&Role::Loss).unwrap()]
        .data[0];
    assert_ne!(train, want);
}

/// A probability outside [0, 1) is an error at its place in the file.
#[test]
fn a_bad_probability_names_its_place() {
    for (p, col) in [("1.0", 20), ("-0.1", 20)] {
        let src = format!(
            "param w: [4, 5] = normal(1.0)\nlet y = dropout(w, {p})\ntrain {{\n    loss = mean(y)\n    optimizer = sgd(lr = 0.1)\n}}\n"
        );
        let err = common::compile_error(&src, "m.dsl", &format!("p = {p}"));
        assert!(
            err.contains("`dropout` needs a probability from 0 up to (not including) 1"),
            "{err}"
        );
        assert!(err.contains(&format!("m.dsl:2:{col}")), "{err}");
    }
}
