//! Every pass keeps the function: the training graph of every shipped model
//! (at tiny sizes) gives the same outputs, evaluated in f64 on the same
//! random inputs, before and after each pass, to 1e-12 relative.

mod common;

use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::{run, Precision};
use fusec_compiler::ir::Graph;
use fusec_compiler::passes::{default_pipeline, run_pipeline};

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
        let reference = common::f64_outputs(&g, &feeds);
        let mut after = Vec::new();
        let stats = run_pipeline(&mut g, &default_pipeline(), |pass, g| {
            after.push((pass.to_string(), common::f64_outputs(g, &feeds)))
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

const SPELLED_OUT: &str = "dim B, T
input x: f32[B, T, 16]
param wq: [16, 16] = normal(0.3)
param wk: [16, 16] = normal(0.3)
param wv: [16, 16] = normal(0.3)
let q = permute(heads(x @ wq, 4), [0, 2, 1, 3])
let k = permute(heads(x @ wk, 4), [0, 2, 1, 3])
let v = permute(heads(x @ wv, 4), [0, 2, 1, 3])
let p = softmax(causal_mask(q @ transpose(k) * 0.5))
let y = p @ v
train {
    loss = mean(y * y) EXTRA
}
";

fn fold(extra: &str) -> (fusec_compiler::ir::Graph, fusec_compiler::ir::Graph) {
    use fusec_compiler::passes::{forward_pipeline, run_pipeline};
    let src = SPELLED_OUT.replace("EXTRA", extra);
    let ast = fusec_compiler::dsl::parse(&src).unwrap();
    let model = fusec_compiler::elaborate::elaborate(&ast, "att", &Default::default()).unwrap();
    let mut folded = model.graph.clone();
    run_pipeline(&mut folded, &forward_pipeline(), |_, _| {}).unwrap();
    (model.graph, folded)
}

fn count(g: &fusec_compiler::ir::Graph, name: &str) -> usize {
    g.g.node_weights().filter(|n| n.op.name() == name).count()
}

/// Attention written out by hand becomes one attention op computing the
/// same loss (1e-12 relative, f64); with the probabilities read elsewhere it
/// stays as written.
#[test]
fn spelled_out_attention_becomes_one_op() {
    let (plain, folded) = fold("");
    assert_eq!(
        (
            count(&folded, "attention"),
            count(&folded, "softmax"),
            count(&folded, "causal_mask")
        ),
        (1, 0, 0)
    );
    let feeds = random_feeds(&plain, &common::dims(&[("B", 2), ("T", 5)]), 3).unwrap();
    let (a, b) = (
        common::f64_outputs(&plain, &feeds),
        common::f64_outputs(&folded, &feeds),
    );
    assert_same("fold-attention", &a, &b);
    let attention = folded
        .g
        .node_weights()
        .find(|n| n.op.name() == "attention")
        .unwrap();
    assert_eq!(
        attention.op.attrs(),
        vec!["causal=true".to_string(), "scale=0.5".to_string()]
    );

    let (_, kept) = fold("+ mean(p)");
    assert_eq!(
        (count(&kept, "attention"), count(&kept, "softmax")),
        (0, 1),
        "p is read twice"
    );
}

/// Compiles a model with or without the passes named.
fn compile_without(file: &str, sets: &[(&str, &str)], disabled: &[&str]) -> Graph {
    let (name, src) = common::example(file);
    let opts = fusec_compiler::elaborate::Options {
        overrides: sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        disabled_passes: disabled.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let stem = fusec_compiler::driver::model_name(std::path::Path::new(&name));
    fusec_compiler::driver::compile(&src, &stem, &opts)
        .unwrap_or_else(|f| panic!("{}", f.render(&name, &src)))
        .training
}

/// Padding awkward sizes changes no result: the training step (loss,
/// gradients, updated parameters and optimizer state) of models whose MLP
/// width and untied head are awkward is the same with and without the
/// `pad-dims` pass, in f64 on the same random inputs, to 1e-12 relative;
/// the parameters and gradients keep the model file's shapes.
#[test]
fn padding_awkward_sizes_changes_no_result() {
    // (sizes, the sizes padded): an MLP width of 1713 (a multiple of 64
    // from 1024 up) and of 131, an untied head of 1003 classes.
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [(i64, i64)]);
    let cases: [Case; 3] = [
        (
            &[("vocab", "1003"), ("ffn", "131")],
            &[(131, 136), (1003, 1008)],
        ),
        (&[("vocab", "96"), ("ffn", "1713")], &[(1713, 1728)]),
        // Sizes already multiples of 8, and a vocabulary under 128.
        (&[("vocab", "101"), ("ffn", "136")], &[]),
    ];
    let file = "../tests/models/twins/gqa-hd80.dsl";
    let small = [("n_heads", "2"), ("n_kv_heads", "1"), ("head_dim", "8")];
    for (sets, want) in cases {
        let sets: Vec<(&str, &str)> = sets.iter().chain(&small).copied().collect();
        let plain = compile_without(file, &sets, &["pad-dims"]);
        let padded = compile_without(file, &sets, &[]);
        let got: Vec<(i64, i64)> = padded.padded.iter().map(|p| (p.size, p.to)).collect();
        assert_eq!(got, want, "{sets:?}: sizes padded");
        assert!(plain.padded.is_empty());
        let feeds = random_feeds(&plain, &common::dims(&[("B", 2), ("T", 3)]), 7).unwrap();
        assert_same(
            &format!("{sets:?}"),
            &common::f64_outputs(&plain, &feeds),
            &common::f64_outputs(&padded, &feeds),
        );
        for (r, v) in &padded.outputs {
            let before = plain.outputs.iter().find(|(r2, _)| r2 == r).unwrap().1;
            assert_eq!(padded.ty(*v), plain.ty(before), "{r} keeps its type");
        }
    }
}

/// Where a norm reads the awkward size, the padded tensor is sliced back
/// for it (a view), and the step is still the same.
#[test]
fn padding_slices_back_for_a_norm_over_the_padded_size() {
    let src = "dim B, T
input x: f32[B, T, 16]
param w1: [16, 131] = normal(0.3)
param g: [131] = ones
param beta: [131] = zeros
param w2: [131, 16] = normal(0.3)
let h = layernorm(gelu(x @ w1), g, beta, eps = 1e-5)
let y = h @ w2
train {
    loss = mean(y * y)
}
";
    let compile = |disabled: Vec<String>| {
        let opts = fusec_compiler::elaborate::Options {
            disabled_passes: disabled,
            ..Default::default()
        };
        fusec_compiler::driver::compile(src, "norm", &opts)
            .unwrap_or_else(|f| panic!("{}", f.render("norm.dsl", src)))
            .training
    };
    let plain = compile(vec!["pad-dims".into()]);
    let padded = compile(vec![]);
    assert_eq!(padded.padded.len(), 1);
    let forward_slices = padded
        .g
        .node_weights()
        .filter(|n| n.op.name() == "slice" && n.phase == fusec_compiler::ir::graph::Phase::Forward)
        .count();
    assert_eq!(forward_slices, 1, "the norm reads a slice");
    let feeds = random_feeds(&plain, &common::dims(&[("B", 2), ("T", 3)]), 9).unwrap();
    assert_same(
        "norm",
        &common::f64_outputs(&plain, &feeds),
        &common::f64_outputs(&padded, &feeds),
    );
}

/// In f32 (weights read as parameters, no compute copy), with biases and
/// relu: a padded hidden width (both layers' weights, the first bias), and
/// padded classes (the last weight's columns and bias, a cross-entropy
/// told its classes). A square awkward weight is read padded along one
/// axis only. Every case's step is the same with and without padding.
#[test]
fn padding_an_f32_mlp_with_biases_changes_no_result() {
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: [Case; 3] = [
        (
            &[("d_hidden", "131"), ("classes", "10")],
            &["w1", "b1", "w2"],
        ),
        (&[("d_hidden", "64"), ("classes", "131")], &["w2", "b2"]),
        (
            &[("d_hidden", "131"), ("classes", "131")],
            &["w1", "b1", "w2"],
        ),
    ];
    for (sets, params) in cases {
        let sets: Vec<(&str, &str)> = [("d_in", "37")].iter().chain(sets).copied().collect();
        let plain = compile_without("mlp.dsl", &sets, &["pad-dims"]);
        let padded = compile_without("mlp.dsl", &sets, &[]);
        let got: Vec<(i64, i64)> = padded.padded.iter().map(|p| (p.size, p.to)).collect();
        assert_eq!(got, [(131, 136)], "{sets:?}");
        assert_eq!(padded.padded[0].params, params, "{sets:?}");
        let feeds = random_feeds(&plain, &common::dims(&[("B", 5)]), 11).unwrap();
        assert_same(
            &format!("{sets:?}"),
            &common::f64_outputs(&plain, &feeds),
            &common::f64_outputs(&padded, &feeds),
        );
    }
}

/// Counts of the forward graph's products and the step's concatenations
/// and packed attention gradients.
fn projection_counts(g: &Graph) -> (usize, usize, usize) {
    let forward_products = g
        .g
        .node_weights()
        .filter(|n| n.op.name() == "matmul" && n.phase == fusec_compiler::ir::graph::Phase::Forward)
        .count();
    let packed = g
        .g
        .node_weights()
        .filter(|n| n.op.name() == "attention_grad" && n.op.attrs().iter().any(|a| a == "packed"))
        .count();
    (forward_products, count(g, "concat"), packed)
}

/// q, k and v projected from one input by three products become one
/// product against the weights side by side, and their gradients are
/// written packed (no concatenation copies them): the step (loss,
/// gradients, updated parameters, optimizer state) is the same as with
/// each pass off, in f64 on the same random inputs, to 1e-12 relative.
/// Biases or none, grouped-query heads of other widths, dropout on the
/// probabilities and padded keys; a cross-attention (q from another
/// input) and a projection read twice stay as written.
#[test]
fn separate_projections_become_one_product_and_their_gradients_one_tensor() {
    const GQA: &str = "const d = 24
dim B, T
input x: f32[B, T, d]
input y: f32[B, T, d]
param wq: [d, 32] = normal(0.3)
param wk: [d, 16] = normal(0.3)
param wv: [d, 24] = normal(0.3)
param cq: [d, 32] = normal(0.3)
param ck: [d, 16] = normal(0.3)
param cv: [d, 16] = normal(0.3)
let a = merge_heads(attention(heads(x @ wq, 4), heads(x @ wk, 2), heads(x @ wv, 2), causal = true))
let c = merge_heads(attention(heads(y @ cq, 4), heads(x @ ck, 2), heads(x @ cv, 2)))
train {
    loss = mean(a * a) + mean(c * c) EXTRA
    precision = PRECISION
}
";
    let compile = |src: &str, disabled: &[&str]| {
        let opts = fusec_compiler::elaborate::Options {
            disabled_passes: disabled.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        fusec_compiler::driver::compile(src, "qkv", &opts)
            .unwrap_or_else(|f| panic!("{}", f.render("qkv.dsl", src)))
            .optimized
    };
    let bert = [
        ("d", "32"),
        ("layers", "2"),
        ("n_heads", "2"),
        ("vocab", "50"),
        ("ctx", "16"),
    ];
    // (what, plain, fused, forward products fused away, packed gradients,
    // concatenations of weights and biases)
    let mut cases: Vec<(String, Graph, Graph, usize, usize, usize)> = Vec::new();
    for precision in ["fp32", "bf16"] {
        let src = GQA.replace("EXTRA", "").replace("PRECISION", precision);
        cases.push((
            format!("grouped heads, {precision}"),
            compile(&src, &["fuse-projections", "pack-attention-grads"]),
            compile(&src, &[]),
            2,
            1,
            1,
        ));
    }
    // q read beside the attention: nothing fused, nothing packed.
    let read_twice = GQA
        .replace("EXTRA", "+ mean(q)")
        .replace("PRECISION", "fp32")
        .replace(
            "let a = merge_heads(attention(heads(x @ wq, 4),",
            "let q = x @ wq\nlet a = merge_heads(attention(heads(q, 4),",
        );
    cases.push((
        "q read twice".into(),
        compile(&read_twice, &["fuse-projections", "pack-attention-grads"]),
        compile(&read_twice, &[]),
        0,
        0,
        0,
    ));
    let (name, src) = common::example("bert-classifier.dsl");
    let sets: Vec<(String, String)> = bert
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let bert_compile = |disabled: &[&str]| {
        let opts = fusec_compiler::elaborate::Options {
            overrides: sets.clone(),
            disabled_passes: disabled.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        fusec_compiler::driver::compile(&src, "bert-classifier", &opts)
            .unwrap_or_else(|f| panic!("{}", f.render(&name, &src)))
            .optimized
    };
    cases.push((
        "bert-classifier, biases, padded keys, dropout".into(),
        bert_compile(&["fuse-projections", "pack-attention-grads"]),
        bert_compile(&[]),
        4,
        2,
        4,
    ));
    for (what, plain, fused, fewer, packed, joined) in cases {
        let (p, f) = (projection_counts(&plain), projection_counts(&fused));
        assert_eq!(p.0 - f.0, fewer, "{what}: forward products fused away");
        assert_eq!((p.2, f.2), (0, packed), "{what}: packed gradients");
        assert_eq!(
            f.1,
            p.1 + joined,
            "{what}: concatenations of weights and biases, none of gradients"
        );
        let feeds = random_feeds(&plain, &common::dims(&[("B", 2), ("T", 5)]), 13).unwrap();
        assert_same(
            &what,
            &common::f64_outputs(&plain, &feeds),
            &common::f64_outputs(&fused, &feeds),
        );
    }
}

/// A bias added to the keys shifts each score row by one amount, which
/// softmax (and the masks and dropout after it) ignores: its gradient is
/// zero in real arithmetic. `simplify` writes that zero; computed, it would
/// be rounding noise that Adam turns into updates. Self- and
/// cross-attention, causal or not, padded keys, dropout, grouped heads,
/// projections fused or not. With RoPE between the bias and the attention
/// the shift depends on the position and the gradient is real: the rule
/// must leave it.
#[test]
fn a_key_bias_gradient_is_the_exact_zero_it_is() {
    const SRC: &str = "const d = 24
dim B, T, S
input x: f32[B, T, d]
input y: f32[B, S, d]
input n: i32[B]
param wq: [d, 32] = normal(0.3)
param bq: [32] = normal(0.3)
param wk: [d, 16] = normal(0.3)
param bk: [16] = normal(0.3)
param wv: [d, 16] = normal(0.3)
param bv: [16] = normal(0.3)
param ck: [d, 32] = normal(0.3)
param cb: [32] = normal(0.3)
param rk: [d, 16] = normal(0.3)
param rb: [16] = normal(0.3)
let a = merge_heads(attention(heads(x @ wq + bq, 4), heads(x @ wk + bk, 2), heads(x @ wv + bv, 2), causal = true, dropout = 0.2))
let c = merge_heads(attention(heads(x @ wq, 4), heads(y @ ck + cb, 4), heads(y @ ck, 4), lengths = n))
let r = merge_heads(attention(rope(heads(x @ wq, 4)), rope(heads(x @ rk + rb, 2)), heads(x @ wv, 2), causal = true))
train {
    loss = mean(a * a) + mean(c * c) + mean(r * r)
    precision = PRECISION
}
";
    let dims = common::dims(&[("B", 3), ("T", 7), ("S", 5)]);
    for precision in ["fp32", "bf16"] {
        for disabled in [&[][..], &["fuse-projections", "pack-attention-grads"][..]] {
            let what = format!("{precision}, {disabled:?} off");
            let opts = fusec_compiler::elaborate::Options {
                disabled_passes: disabled.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            };
            let src = SRC.replace("PRECISION", precision);
            let c = fusec_compiler::driver::compile(&src, "keys", &opts)
                .unwrap_or_else(|f| panic!("{}", f.render("keys.dsl", &src)));
            let grad =
                |g: &Graph,
                 vals: &std::collections::HashMap<_, fusec_compiler::interp::tensor::Tensor>,
                 name: &str| {
                    let i = g.params.iter().position(|p| p.name == name).expect(name);
                    let (_, v) = g
                        .outputs
                        .iter()
                        .find(|(r, _)| *r == fusec_compiler::ir::graph::Role::Grad(i))
                        .expect("a gradient");
                    vals[v].data.clone()
                };
            let feeds = random_feeds(&c.training, &dims, 21).unwrap();
            let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
            // The premise, on the graph as autodiff made it: in f64 the key
            // biases' gradients vanish beside the query bias's (1e-12: f64
            // rounding of sums of a few hundred terms), RoPE's does not;
            // rounded to the stored types they are noise, not zero.
            let f64v = run(&c.training, &feeds, Precision::F64).unwrap();
            let scale = norm(&grad(&c.training, &f64v, "bq"));
            assert!(scale > 1e-3, "{what}: the query bias gets a gradient");
            for b in ["bk", "cb"] {
                let g = norm(&grad(&c.training, &f64v, b));
                assert!(
                    g <= 1e-12 * scale,
                    "{what}: {b}'s gradient in f64 is {g:e}, not 0"
                );
            }
            assert!(
                norm(&grad(&c.training, &f64v, "rb")) > 1e-3 * scale,
                "{what}: RoPE's key bias"
            );
            let stored = run(&c.training, &feeds, Precision::AsStored).unwrap();
            assert!(
                grad(&c.training, &stored, "bk").iter().any(|&x| x != 0.0),
                "{what}: rounded, the unsimplified gradient should be noise"
            );
            // The step as built: exact zeros, and RoPE's bias as before.
            let opt = run(&c.optimized, &feeds, Precision::AsStored).unwrap();
            for b in ["bk", "cb"] {
                let g = grad(&c.optimized, &opt, b);
                assert!(
                    g.iter().all(|&x| x == 0.0),
                    "{what}: {b}'s gradient is {g:?}"
                );
            }
            let (r0, r1) = (
                grad(&c.training, &f64v, "rb"),
                grad(
                    &c.optimized,
                    &run(&c.optimized, &feeds, Precision::F64).unwrap(),
                    "rb",
                ),
            );
            for (x, y) in r0.iter().zip(&r1) {
                assert!(
                    (x - y).abs() <= 1e-12 * scale,
                    "{what}: RoPE's key bias {x} vs {y}"
                );
            }
        }
    }
}
