//! Padded batches on the CPU reference: `attention(..., lengths = L)` masks
//! each sequence's padded keys, and with `cross_entropy(..., ignore_index)`
//! a batch padded to a longer length gives the unpadded batch's loss and
//! gradients (f64, 1e-12). Gradients with lengths against finite
//! differences; the kernels run on the host in tests/cuda_host.rs.

mod common;

use fusec_compiler::autodiff::add_backward;
use fusec_compiler::gradcheck::{check_model, Tolerance};
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::{run, Feeds, Precision};
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::Graph;

fn source() -> String {
    std::fs::read_to_string(common::root().join("tests/models/padded-encoder.dsl")).unwrap()
}

fn step(g: &Graph, feeds: &Feeds) -> (f64, Vec<Vec<f64>>) {
    let vals = run(g, feeds, Precision::F64).unwrap();
    let loss = vals[&g.output(&Role::Loss).unwrap()].data[0];
    let grads = (0..g.params.len())
        .map(|i| vals[&g.output(&Role::Grad(i)).unwrap()].data.clone())
        .collect();
    (loss, grads)
}

/// Sequences of lengths `lens` padded to `t` (token and target 0 after
/// each one's end).
fn batch(g: &Graph, lens: &[usize], t: usize) -> Feeds {
    let b = lens.len();
    let mut feeds = random_feeds(g, &common::dims(&[("B", b as i64), ("T", t as i64)]), 3).unwrap();
    let mut tokens = Vec::new();
    let mut targets = Vec::new();
    for (r, &len) in lens.iter().enumerate() {
        for i in 0..t {
            let real = i < len;
            tokens.push(if real {
                (1 + (r * 5 + i * 3) % 28) as f64
            } else {
                0.0
            });
            targets.push(if real {
                (1 + (r * 7 + i * 11) % 28) as f64
            } else {
                0.0
            });
        }
    }
    feeds
        .inputs
        .insert("tokens".into(), Tensor::new(vec![b, t], tokens));
    feeds
        .inputs
        .insert("targets".into(), Tensor::new(vec![b, t], targets));
    feeds.inputs.insert(
        "lengths".into(),
        Tensor::new(vec![b], lens.iter().map(|&l| l as f64).collect()),
    );
    feeds
}

/// Padding changes nothing: lengths 5 and 3 at T = 5 and at T = 9 (the
/// second also padded inside the shorter batch), the same loss and
/// gradients to 1e-12; without the lengths the padded keys are seen and
/// the loss moves.
#[test]
fn a_longer_padding_changes_nothing() {
    let c = common::compile_with(&source(), "padded-encoder.dsl", &[]);
    let g = add_backward(&c.model).unwrap();
    let (l1, g1) = step(&g, &batch(&g, &[5, 3], 5));
    let (l2, g2) = step(&g, &batch(&g, &[5, 3], 9));
    assert!((l1 - l2).abs() <= 1e-12 * l1.abs(), "loss {l1} vs {l2}");
    for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
        let scale = a.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-12 * scale,
                "{}: gradient {x} vs {y}",
                g.params[i].name
            );
        }
    }
    // The lengths matter: all keys visible at T = 9 is another loss.
    let (l3, _) = step(
        &g,
        &batch(&g, &[9, 9], 9).with_targets_of(&batch(&g, &[5, 3], 9)),
    );
    assert!((l1 - l3).abs() > 1e-6, "lengths had no effect");
}

trait WithTargets {
    fn with_targets_of(self, other: &Feeds) -> Feeds;
}

impl WithTargets for Feeds {
    /// These feeds with `other`'s tokens and targets (only the lengths of
    /// these).
    fn with_targets_of(mut self, other: &Feeds) -> Feeds {
        for name in ["tokens", "targets"] {
            self.inputs.insert(name.into(), other.inputs[name].clone());
        }
        self
    }
}

/// A sequence alone gives what it gives inside a padded batch: the first
/// entry of a batch with lengths [3, 5] at T = 5 against the batch of that
/// one sequence at T = 3 (the loss is a mean over the batch's counted
/// targets, so the single sequence is compared through its logits).
#[test]
fn each_sequence_sees_only_its_own_keys() {
    let c = common::compile_with(&source(), "padded-encoder.dsl", &[]);
    let g = &c.model.graph;
    let logits_of = |feeds: &Feeds| -> Vec<f64> {
        let vals = run(g, feeds, Precision::F64).unwrap();
        // The logits are the head matmul's output: the value read by the
        // cross-entropy.
        let ce =
            g.g.node_indices()
                .find(|&n| matches!(g.g[n].op, fusec_compiler::ops::Op::CrossEntropy(_)))
                .unwrap();
        vals[&g.inputs(ce)[0]].data.clone()
    };
    let padded = batch(g, &[3, 5], 5);
    let mut alone = batch(g, &[3], 3);
    // The same tokens as the padded batch's first entry.
    alone.inputs.insert(
        "tokens".into(),
        Tensor::new(vec![1, 3], padded.inputs["tokens"].data[..3].to_vec()),
    );
    let (a, b) = (logits_of(&padded), logits_of(&alone));
    let v = 29;
    for (x, y) in a[..3 * v].iter().zip(&b) {
        assert!((x - y).abs() <= 1e-12 * x.abs().max(1.0), "{x} vs {y}");
    }
}

#[test]
fn gradients_with_lengths_match_finite_differences() {
    let c = common::compile_with(&source(), "padded-encoder.dsl", &[]);
    let backward = add_backward(&c.model).unwrap();
    let report = check_model(
        &c.model,
        &backward,
        &common::dims(&[("B", 3), ("T", 6)]),
        11,
        6,
        Tolerance::default(),
    )
    .unwrap();
    assert!(report.checked > 0);
    assert!(report.failures.is_empty(), "{:?}", report.failures);
}

/// Lengths that are not i32 [B] are an error at the argument.
#[test]
fn lengths_of_the_wrong_shape_name_their_place() {
    let src = source().replace("input lengths: i32[B]", "input lengths: i32[B, T]");
    let err = common::compile_error(&src, "pe.dsl", "lengths [B, T]");
    assert!(
        err.contains("takes the keys' lengths as i32 [B], one per batch entry"),
        "{err}"
    );
    assert!(err.contains("pe.dsl:25:90"), "{err}");
}

/// `fusec bench --lengths full` (its default) feeds every lengths input
/// its key count, so a benchmark of full sequences does the full work;
/// random lengths run from 0 to T, and the other inputs stay as drawn.
#[test]
fn benchmarks_can_fill_every_length() {
    let c = common::compile_with(&source(), "padded-encoder.dsl", &[]);
    let g = add_backward(&c.model).unwrap();
    let mut feeds = random_feeds(&g, &common::dims(&[("B", 64), ("T", 9)]), 5).unwrap();
    let drawn = feeds.inputs["lengths"].data.clone();
    assert!(drawn.iter().all(|&l| (0.0..=9.0).contains(&l)));
    assert!(drawn.iter().any(|&l| l < 9.0), "random lengths: {drawn:?}");
    let tokens = feeds.inputs["tokens"].data.clone();
    fusec_compiler::interp::random::fill_lengths_full(&g, &mut feeds);
    assert_eq!(feeds.inputs["lengths"].data, vec![9.0; 64]);
    assert_eq!(feeds.inputs["tokens"].data, tokens);
}
