//! Finite-difference gradient checks in f64 for every op's gradient rule.
//! Each case is a small model whose operands are parameters with random
//! values; the loss weighs every output element by a random parameter `r`,
//! so no output is left out of the check. Tolerance: central differences
//! with h = 1e-6 must agree with autodiff within 1e-8 + 1e-5 * |gradient|
//! (`Tolerance::default()`), for every entry of every parameter.

use fusec_compiler::autodiff::add_backward;
use fusec_compiler::driver::compile;
use fusec_compiler::elaborate::Options;
use fusec_compiler::gradcheck::{check_model, Tolerance};
use fusec_compiler::ir::graph::Phase;
use std::collections::HashMap;

/// Builds a model from declarations, the output expression `y` and the
/// shape of `y`, then checks all gradients.
fn check(name: &str, decls: &str, y: &str, y_shape: &str, extra_train: &str) {
    let src = format!(
        "dim B, T\n{decls}\nlet y = {y}\nparam r: {y_shape} = normal(1.0)\ntrain {{\n    loss = sum(y * r) + 0.5 * sum(y * y)\n    {extra_train}\n}}\n"
    );
    let c = compile(&src, name, &Options::default())
        .unwrap_or_else(|f| panic!("{}", f.render(name, &src)));
    let backward = add_backward(&c.model).expect("differentiates");
    let dims: HashMap<String, i64> = [("B".to_string(), 2), ("T".to_string(), 5)].into();
    let report =
        check_model(&c.model, &backward, &dims, 11, 1000, Tolerance::default()).expect("evaluates");
    assert!(report.checked > 0);
    assert!(
        report.failures.is_empty(),
        "{name}:\n{}\n--- model ---\n{src}",
        report.failures.join("\n")
    );
    // The case must really exercise a backward op, not only reshape grads.
    assert!(backward
        .g
        .node_weights()
        .any(|n| n.phase == Phase::Backward));
}

#[test]
fn binary_arithmetic_with_broadcasting() {
    check(
        "binary",
        "param a: [2, 3] = normal(1.0)\nparam b: [3] = normal(1.0)\nparam c: [2, 1] = normal(1.0)",
        "(a + b) * c - a / (b * b + 2.0) + (c - 1.5) / 3",
        "[2, 3]",
        "",
    );
}

/// Every unary builtin of the table (ops/unary.rs), so a function added
/// there is checked here; those that need a positive argument get one.
#[test]
fn unary_functions() {
    use fusec_compiler::ops::UnaryKind;
    let table = UnaryKind::ALL.iter().filter(|k| k.def().builtin.is_some());
    let calls: Vec<String> = table
        .map(|k| match k.def().keeps_zero {
            true => format!("{}(x)", k.name()),
            false => format!("{}(x * x + 1)", k.name()),
        })
        .collect();
    for f in calls
        .iter()
        .map(String::as_str)
        .chain(["-x", "swiglu(x, x * 2)"])
    {
        check(f, "param x: [3, 4] = normal(1.0)", f, "[3, 4]", "");
    }
}

#[test]
fn matmul_batched_and_broadcast() {
    check(
        "matmul_2d",
        "param a: [3, 4] = normal(1.0)\nparam w: [4, 5] = normal(1.0)",
        "a @ w",
        "[3, 5]",
        "",
    );
    check(
        "matmul_bcast",
        "param a: [2, 3, 4] = normal(1.0)\nparam w: [4, 5] = normal(1.0)",
        "a @ w",
        "[2, 3, 5]",
        "",
    );
    check(
        "matmul_batched",
        "param a: [2, 2, 3, 4] = normal(1.0)\nparam w: [2, 1, 4, 3] = normal(1.0)",
        "a @ w",
        "[2, 2, 3, 3]",
        "",
    );
    check("linear", "param a: [2, 3, 4] = normal(1.0)\nparam w: [4, 5] = normal(1.0)\nparam b: [5] = normal(1.0)", "linear(a, w, b)", "[2, 3, 5]", "");
}

#[test]
fn reductions() {
    let d = "param x: [2, 3, 4] = normal(1.0)";
    check("sum_axis", d, "sum(x, axis = 1)", "[2, 4]", "");
    check(
        "sum_keep",
        d,
        "sum(x, axis = [0, 2], keepdim = true)",
        "[1, 3, 1]",
        "",
    );
    check("mean_axis", d, "mean(x, axis = -1)", "[2, 3]", "");
    check("mean_all", d, "mean(x) * x", "[2, 3, 4]", "");
}

#[test]
fn data_movement() {
    let d = "param x: [2, 3, 4] = normal(1.0)";
    check("reshape", d, "reshape(x, [6, -1])", "[6, 4]", "");
    check("permute", d, "permute(x, [2, 0, 1])", "[4, 2, 3]", "");
    check("transpose", d, "transpose(x, 0, 2)", "[4, 3, 2]", "");
    check("slice", d, "x[:, 1:3, ...]", "[2, 2, 4]", "");
    check("index", d, "x[1, :, -1]", "[3]", "");
    let dz = "param x: [2, 3, 4] = normal(1.0)\nparam z: [2, 3, 2] = normal(1.0)";
    check(
        "concat",
        dz,
        "concat([x, z, x], axis = -1)",
        "[2, 3, 10]",
        "",
    );
    check(
        "split",
        d,
        "concat(split(x, [1, 3], axis = 2), axis = 2) * x",
        "[2, 3, 4]",
        "",
    );
    let d2 = "param x: [3, 1] = normal(1.0)";
    check("broadcast", d2, "broadcast(x, [2, 3, 4])", "[2, 3, 4]", "");
    check(
        "heads",
        "param x: [2, 3, 8] = normal(1.0)",
        "merge_heads(permute(heads(x, 2), [0, 1, 3, 2]))",
        "[2, 3, 8]",
        "",
    );
}

#[test]
fn softmax_along_any_axis() {
    let d = "param x: [2, 3, 4] = normal(1.0)";
    check("softmax_last", d, "softmax(x)", "[2, 3, 4]", "");
    check("softmax_mid", d, "softmax(x, axis = 1)", "[2, 3, 4]", "");
}

#[test]
fn norms() {
    let d =
        "param x: [2, 3, 6] = normal(1.0)\nparam g: [6] = normal(1.0)\nparam b: [6] = normal(1.0)";
    check("layernorm", d, "layernorm(x, g, b)", "[2, 3, 6]", "");
    check("rmsnorm", d, "rmsnorm(x, g) + b", "[2, 3, 6]", "");
}

#[test]
fn embedding_and_cross_entropy() {
    check(
        "embedding",
        "input tok: i32[B, T]\nparam table: [7, 4] = normal(1.0)",
        "embedding(table, tok)",
        "[4]",
        "",
    );
    check(
        "cross_entropy",
        "input tgt: i32[2, 5]\nparam logits: [2, 5, 7] = normal(1.0)",
        "cross_entropy(logits, tgt) * logits",
        "[2, 5, 7]",
        "",
    );
}

#[test]
fn rotary_embedding() {
    check(
        "rope",
        "param x: [2, 5, 2, 6] = normal(1.0)",
        "rope(x, theta = 100)",
        "[2, 5, 2, 6]",
        "",
    );
}

#[test]
fn attention_variants() {
    let qkv = "param q: [2, 5, 4, 3] = normal(1.0)\nparam k: [2, 5, 4, 3] = normal(1.0)\nparam v: [2, 5, 4, 3] = normal(1.0)";
    check("attention", qkv, "attention(q, k, v)", "[2, 5, 4, 3]", "");
    check(
        "attention_causal",
        qkv,
        "attention(q, k, v, causal = true)",
        "[2, 5, 4, 3]",
        "",
    );
    let gqa = "param q: [2, 5, 4, 3] = normal(1.0)\nparam k: [2, 5, 2, 3] = normal(1.0)\nparam v: [2, 5, 2, 2] = normal(1.0)";
    check(
        "attention_gqa",
        gqa,
        "attention(q, k, v, causal = true, scale = 0.3)",
        "[2, 5, 4, 2]",
        "",
    );
    let cross = "param q: [2, 3, 2, 3] = normal(1.0)\nparam k: [2, 6, 1, 3] = normal(1.0)\nparam v: [2, 6, 1, 3] = normal(1.0)";
    check(
        "attention_cross",
        cross,
        "attention(q, k, v)",
        "[2, 3, 2, 3]",
        "",
    );
}

#[test]
fn attention_spelled_out() {
    check(
        "manual_attention",
        "param q: [2, 4, 5, 3] = normal(1.0)\nparam k: [2, 4, 5, 3] = normal(1.0)\nparam v: [2, 4, 5, 3] = normal(1.0)",
        "softmax(causal_mask(q @ transpose(k) * 0.5)) @ v",
        "[2, 4, 5, 3]",
        "",
    );
}

#[test]
fn convolution() {
    check(
        "conv2d",
        "param x: [2, 5, 5, 3] = normal(1.0)\nparam w: [3, 3, 3, 4] = normal(1.0)",
        "conv2d(x, w, stride = 2, padding = 1)",
        "[2, 3, 3, 4]",
        "",
    );
    check(
        "conv2d_patch",
        "param x: [1, 4, 4, 2] = normal(1.0)\nparam w: [2, 2, 2, 3] = normal(1.0)",
        "conv2d(x, w, stride = 2)",
        "[1, 2, 2, 3]",
        "",
    );
}

#[test]
fn symbolic_dims_in_arithmetic_and_slices() {
    check(
        "dims",
        "input tok: i32[B, T]\nparam table: [9, 4] = normal(1.0)\nparam pos: [8, 4] = normal(1.0)",
        "(embedding(table, tok) + pos[0:T]) / T",
        "[4]",
        "",
    );
}

#[test]
fn mixed_precision_casts_and_micro_batches() {
    check(
        "bf16",
        "param a: [3, 4] = normal(1.0)\nparam w: [4, 2] = normal(1.0)",
        "gelu(a @ w)",
        "[3, 2]",
        "precision = bf16\n    micro_batches = 3",
    );
}

#[test]
fn tied_parameter_accumulates_one_gradient() {
    check(
        "tied",
        "input tok: i32[B, T]\nparam e: [6, 4] = normal(1.0)",
        "embedding(e, tok) @ transpose(e)",
        "[6]",
        "",
    );
}

/// The check is only worth something if it fails on a wrong gradient: here
/// one parameter's gradient is doubled after autodiff.
#[test]
fn the_check_catches_a_wrong_gradient() {
    use fusec_compiler::ir::graph::Role;
    use fusec_compiler::ops::{Builder, Constant};
    let src = "param x: [3] = normal(1.0)\nparam w: [3] = normal(1.0)\ntrain {\n    loss = sum(tanh(x) * w)\n}\n";
    let c = compile(src, "wrong", &Options::default())
        .unwrap_or_else(|f| panic!("{}", f.render("wrong", src)));
    let mut backward = add_backward(&c.model).expect("differentiates");
    let (idx, gv) = backward
        .outputs
        .iter()
        .enumerate()
        .find_map(|(i, (r, v))| (*r == Role::Grad(0)).then_some((i, *v)))
        .expect("a gradient for x");
    let mut b = Builder::new(&mut backward, None, Phase::Backward);
    let two = b
        .op1(
            Constant {
                value: 2.0,
                dtype: fusec_compiler::ir::DType::F32,
            },
            &[],
        )
        .unwrap();
    let wrong = b.mul(gv, two).unwrap();
    backward.outputs[idx].1 = wrong;
    let report = check_model(
        &c.model,
        &backward,
        &HashMap::new(),
        3,
        10,
        Tolerance::default(),
    )
    .expect("evaluates");
    assert_eq!(
        report.failures.len(),
        3,
        "every entry of x is caught: {:?}",
        report.failures
    );
    assert!(report.failures[0].starts_with("x["));
}
