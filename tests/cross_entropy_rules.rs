//! `cross_entropy(..., ignore_index = N, label_smoothing = e)` on the CPU
//! reference, as PyTorch's `F.cross_entropy` defines them: against the
//! formula written out here, against finite differences, and a batch
//! padded with ignored rows giving the unpadded batch's loss and gradients.
//! The kernels run on the host in tests/cuda_host.rs.

mod common;

use fusec_compiler::autodiff::add_backward;
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::{run, Feeds, Precision};
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::Graph;

fn source() -> String {
    std::fs::read_to_string(common::root().join("tests/models/ce-rules.dsl")).unwrap()
}

fn graph(sets: &[(&str, &str)]) -> Graph {
    let c = common::compile_with(&source(), "ce-rules.dsl", sets);
    add_backward(&c.model).unwrap()
}

/// Loss and every gradient, f64.
fn step(g: &Graph, feeds: &Feeds) -> (f64, Vec<Vec<f64>>) {
    let vals = run(g, feeds, Precision::F64).unwrap();
    let loss = vals[&g.output(&Role::Loss).unwrap()].data[0];
    let grads = (0..g.params.len())
        .map(|i| vals[&g.output(&Role::Grad(i)).unwrap()].data.clone())
        .collect();
    (loss, grads)
}

/// Targets with every fifth one the padding id.
fn with_padding(feeds: &mut Feeds, b: usize, t: usize) {
    let targets = (0..b * t)
        .map(|i| {
            if i % 5 == 2 {
                0.0
            } else {
                (1 + (i * 7) % 60) as f64
            }
        })
        .collect();
    feeds
        .inputs
        .insert("targets".into(), Tensor::new(vec![b, t], targets));
}

/// The loss written out from PyTorch's definition: over the rows whose
/// target is not ignored, lse - (1 - e) x_t - e mean(x), summed and divided
/// by their count.
#[test]
fn the_loss_is_pytorchs() {
    for (e, ignore) in [("0.1", "0"), ("0", "0"), ("0.25", "-100"), ("0.1", "7")] {
        let g = graph(&[("smoothing", e), ("pad", ignore)]);
        let (b, t) = (3usize, 5usize);
        let mut feeds = random_feeds(&g, &common::dims(&[("B", 3), ("T", 5)]), 4).unwrap();
        with_padding(&mut feeds, b, t);
        let vals = run(&g, &feeds, Precision::F64).unwrap();
        let loss = vals[&g.output(&Role::Loss).unwrap()].data[0];
        // The logits: the model's last matmul + bias, recomputed here.
        let emb = &feeds.params["emb"].data;
        let w = &feeds.params["w"].data;
        let bias = &feeds.params["b"].data;
        let (v, d) = (61usize, 24usize);
        // GELU as fusec's `gelu` is: the tanh approximation.
        let gelu = |x: f64| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
        };
        let (eps, ig) = (e.parse::<f64>().unwrap(), ignore.parse::<f64>().unwrap());
        let (mut sum, mut count) = (0.0, 0.0);
        for r in 0..b * t {
            let tok = feeds.inputs["tokens"].data[r] as usize;
            let target = feeds.inputs["targets"].data[r];
            if target == ig {
                continue;
            }
            let h: Vec<f64> = (0..d).map(|k| gelu(emb[tok * d + k])).collect();
            let x: Vec<f64> = (0..v)
                .map(|j| bias[j] + (0..d).map(|k| h[k] * w[k * v + j]).sum::<f64>())
                .collect();
            let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + x.iter().map(|y| (y - m).exp()).sum::<f64>().ln();
            let mean = x.iter().sum::<f64>() / v as f64;
            sum += lse - (1.0 - eps) * x[target as usize] - eps * mean;
            count += 1.0;
        }
        let want = sum / count;
        println!("e {e}, ignore {ignore}: loss {loss} (formula {want})");
        // f64 on both sides: only the order of the sums differs.
        assert!(
            (loss - want).abs() <= 1e-9 * want.abs(),
            "e {e}, ignore {ignore}: loss {loss}, PyTorch's formula {want}"
        );
    }
}

#[test]
fn gradients_match_finite_differences() {
    for e in ["0.1", "0.6"] {
        let c = common::compile_with(&source(), "ce-rules.dsl", &[("smoothing", e), ("pad", "3")]);
        let report = common::gradcheck(&c, &[("B", 2), ("T", 7)], 5, 8).unwrap();
        assert!(report.checked > 0);
        assert!(report.failures.is_empty(), "{:?}", report.failures);
    }
}

/// A batch padded with rows whose targets are ignored (longer sequences,
/// as a bucketed batch pads them) gives the unpadded batch's loss and
/// gradients: the mean is over the targets that count.
#[test]
fn padding_rows_change_nothing() {
    let g = graph(&[]);
    let (b, t, extra) = (2usize, 5usize, 3usize);
    let mut short = random_feeds(&g, &common::dims(&[("B", 2), ("T", 5)]), 8).unwrap();
    with_padding(&mut short, b, t);
    let mut long = short.clone();
    long.dims.insert("T".into(), (t + extra) as i64);
    for name in ["tokens", "targets"] {
        let s = &short.inputs[name].data;
        let mut data = Vec::new();
        for r in 0..b {
            data.extend_from_slice(&s[r * t..(r + 1) * t]);
            // Padding: token 0 with the ignored target.
            data.extend(std::iter::repeat_n(0.0, extra));
        }
        long.inputs
            .insert(name.into(), Tensor::new(vec![b, t + extra], data));
    }
    let (l1, g1) = step(&g, &short);
    let (l2, g2) = step(&g, &long);
    assert!((l1 - l2).abs() <= 1e-12 * l1.abs(), "loss {l1} vs {l2}");
    for (i, (a, c)) in g1.iter().zip(&g2).enumerate() {
        for (x, y) in a.iter().zip(c) {
            assert!(
                (x - y).abs() <= 1e-12 * x.abs().max(1e-12),
                "gradient {i}: {x} vs {y}"
            );
        }
    }
    // Without ignore_index the padded rows count, and the loss moves.
    let plain = graph(&[("pad", "-1")]);
    let (p1, _) = step(&plain, &short);
    let (p2, _) = step(&plain, &long);
    assert!((p1 - p2).abs() > 1e-6, "padding rows were not counted");
}

#[test]
fn a_bad_smoothing_names_its_place() {
    let src = source().replace("label_smoothing = smoothing", "label_smoothing = 1.5");
    let err = common::compile_error(&src, "ce.dsl", "a smoothing of 1.5");
    assert!(err.contains("label smoothing from 0 to 1"), "{err}");
    assert!(err.contains("ce.dsl:21:"), "{err}");
}
