//! Dropout on the CPU reference: gradients against finite differences,
//! the share dropped, the backward pass reusing the forward's mask, keys
//! that change the masks, validation without dropout, and the model file's
//! errors. The GPU kernels' masks are checked against these in
//! tests/cuda_host.rs (host-run) and runtime/tests/step_gpu.rs.

mod common;

use fusec_compiler::autodiff::add_backward;
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
        let report = common::gradcheck(&c, &[("B", 2), ("T", 7)], 7, 6).expect("evaluates");
        println!(
            "p = {p}: {} entries, max rel error {:.2e}",
            report.checked, report.max_rel_err
        );
        assert!(report.checked > 0);
        assert!(report.failures.is_empty(), "{:?}", report.failures);
    }
}

/// Attention dropout: the same check on an encoder whose attention drops
/// probabilities (causal and padded keys), at p = 0.1 and 0.5; and the
/// loss with dropout differs from the loss without (the mask is in use).
#[test]
fn attention_dropout_gradients_match_finite_differences() {
    let src = "
const d = 12
dim B, T
input x: f32[B, T, d]
input lens: i32[B]
param wq: [d, d] = normal(0.5)
param wk: [d, d] = normal(0.5)
param wv: [d, d] = normal(0.5)
let a = attention(heads(x @ wq, 2), heads(x @ wk, 2), heads(x @ wv, 2), causal = CAUSAL, lengths = lens, dropout = P)
let y = merge_heads(a)
train {
    loss = mean(y * y)
    optimizer = sgd(lr = 0.1)
}
";
    for (p, causal) in [("0.1", "true"), ("0.5", "false")] {
        let text = src.replace("CAUSAL", causal).replace('P', p);
        let c = common::compile_with(&text, "attn-dropout.dsl", &[]);
        let report = common::gradcheck(&c, &[("B", 2), ("T", 9)], 7, 6).expect("evaluates");
        println!(
            "p = {p}, causal {causal}: {} entries, max rel error {:.2e}",
            report.checked, report.max_rel_err
        );
        assert!(report.checked > 0);
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        // Without the key's mask (the forward-only step) the loss differs.
        let dims = common::dims(&[("B", 2), ("T", 9)]);
        let feeds = random_feeds(&c.model.graph, &dims, 4).unwrap();
        let fwd = fusec_compiler::driver::forward_graph(&c).unwrap();
        let loss = |g: &fusec_compiler::ir::Graph| {
            run(g, &feeds, Precision::F64).unwrap()[&g.output(&Role::Loss).unwrap()].data[0]
        };
        assert_ne!(
            loss(&c.model.graph),
            loss(&fwd),
            "p = {p}: the mask changes nothing"
        );
    }
}

/// With dropout, O = (P Z) V for the mask's factors Z: the interpreter's
/// attention with p = 0.4 equals a hand computation of softmax, mask and
/// product from `philox::attention_draw` directly, and about 40% of the
/// probabilities are dropped.
#[test]
fn attention_dropout_applies_the_documented_mask() {
    use fusec_compiler::ops::philox::{attention_draw, attention_scale, attention_threshold};
    let src = "
dim B, T
input q: f32[B, T, 2, 8]
input k: f32[B, T, 2, 8]
input v: f32[B, T, 2, 8]
let o = attention(q, k, v, dropout = 0.4)
train {
    loss = mean(o * o)
}
";
    let c = common::compile_with(src, "attn-mask.dsl", &[]);
    let g = &c.model.graph;
    let (b, t, h, d) = (2usize, 19usize, 2usize, 8usize);
    let dims = common::dims(&[("B", b as i64), ("T", t as i64)]);
    let mut feeds = random_feeds(g, &dims, 11).unwrap();
    feeds.inputs.insert(
        DROPOUT_KEY_INPUT.into(),
        Tensor::new(vec![2], vec![123.0, -77.0]),
    );
    let vals = run(g, &feeds, Precision::F64).unwrap();
    let site =
        g.g.node_weights()
            .find_map(|n| match &n.op {
                Op::Attention(a) => a.dropout.map(|d| d.site),
                _ => None,
            })
            .expect("the attention drops");
    let o_node =
        g.g.node_indices()
            .find(|&n| matches!(g.g[n].op, Op::Attention(_)))
            .unwrap();
    let o = &vals[&fusec_compiler::ir::Value {
        node: o_node,
        port: 0,
    }]
        .data;
    let (q, k, v) = (
        &feeds.inputs["q"].data,
        &feeds.inputs["k"].data,
        &feeds.inputs["v"].data,
    );
    let key = [123u32, (-77i32) as u32];
    let at = |bb: usize, i: usize, hh: usize| ((bb * t + i) * h + hh) * d;
    let (mut dropped, mut all) = (0, 0);
    for bb in 0..b {
        for hh in 0..h {
            for i in 0..t {
                let s: Vec<f64> = (0..t)
                    .map(|j| {
                        (0..d)
                            .map(|c| q[at(bb, i, hh) + c] * k[at(bb, j, hh) + c])
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                for c in 0..d {
                    let mut want = 0.0;
                    for j in 0..t {
                        let kept =
                            attention_draw(key, site, (bb * h + hh) as u64, i as u64, j as u64)
                                >= attention_threshold(0.4);
                        if c == 0 {
                            all += 1;
                            dropped += !kept as usize;
                        }
                        if kept {
                            want += (s[j] - mx).exp() / sum
                                * attention_scale(0.4)
                                * v[at(bb, j, hh) + c];
                        }
                    }
                    let got = o[at(bb, i, hh) + c];
                    assert!(
                        (got - want).abs() <= 1e-12 * want.abs().max(1.0),
                        "({bb}, {hh}, {i}, {c}): {got} vs {want}"
                    );
                }
            }
        }
    }
    // 1,444 draws: sigma = sqrt(0.24 / 1444) = 0.0129; 5 sigma = 0.064.
    let rate = dropped as f64 / all as f64;
    assert!((rate - 0.4).abs() < 0.064, "dropped {rate}");
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
