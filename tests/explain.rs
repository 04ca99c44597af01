//! `fusec explain`: from a line of the model file (or a parameter) to its
//! ops, the kernels holding them, and their bytes and time. Snapshots of
//! gpt2-block's MLP line and of one parameter; a profile file's times are
//! read beside the estimate; wrong lines and names are named.

mod common;

use common::fusec;

#[test]
fn explain_a_line_and_a_parameter_of_gpt2_block() {
    let (code, line, err) = fusec(&[
        "explain",
        "dsl-examples/gpt2-block.dsl",
        "--line",
        "32",
        "--batch",
        "8",
        "--seq",
        "1024",
    ]);
    assert_eq!(code, 0, "{err}");
    insta::assert_snapshot!("explain_gpt2_block_line_32", line);
    let (code, param, err) = fusec(&["explain", "dsl-examples/gpt2-block.dsl", "--name", "c_fc_w"]);
    assert_eq!(code, 0, "{err}");
    insta::assert_snapshot!("explain_gpt2_block_c_fc_w", param);
}

#[test]
fn profile_times_are_read_and_mistakes_are_named() {
    let dir = common::host::work_dir("explain");
    let profile = dir.join("profile.jsonl");
    std::fs::write(
        &profile,
        "{\"kernel\":\"k7_matmul_add_gelu\",\"ms\":0.5000}\n{\"kernel\":\"k6_layernorm\",\"ms\":0.0250}\n",
    )
    .unwrap();
    let (code, out, err) = fusec(&[
        "explain",
        "dsl-examples/gpt2-block.dsl",
        "--line",
        "32",
        "--profile",
        profile.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("k7_matmul_add_gelu           3 of its 3 ops; measured 0.500 ms"),
        "{out}"
    );
    assert!(out.contains("0.525 ms measured"), "{out}");
    let (code, _, err) = fusec(&["explain", "dsl-examples/gpt2-block.dsl", "--line", "99"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("has 40 lines; --line 99 is past the end"),
        "{err}"
    );
    let (code, _, err) = fusec(&["explain", "dsl-examples/gpt2-block.dsl", "--line", "0"]);
    assert_eq!(code, 2);
    assert!(err.contains("--line counts from 1"), "{err}");
    let (code, _, err) = fusec(&["explain", "dsl-examples/gpt2-block.dsl", "--name", "nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("has no parameter `nope`"), "{err}");
    let (code, out, _) = fusec(&["explain", "dsl-examples/gpt2-block.dsl", "--line", "31"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("no op of the training step comes from it"),
        "{out}"
    );
}

/// q, k and v projected separately and fused into one product
/// (`fuse-projections`): each of the three lines names the fused forward
/// product and its gradients' products, and the report's line for the
/// product lists all three lines.
#[test]
fn each_line_of_fused_projections_names_the_product() {
    let mut kernels = Vec::new();
    for line in ["48", "49", "50"] {
        let (code, out, err) = fusec(&[
            "explain",
            "dsl-examples/bert-classifier.dsl",
            "--set",
            "layers=1",
            "--line",
            line,
            "--batch",
            "8",
            "--dim",
            "T=128",
        ]);
        assert_eq!(code, 0, "{err}");
        let fused: Vec<&str> = out
            .lines()
            .filter(|l| l.trim_start().starts_with('k') && l.contains("matmul"))
            .map(|l| l.split_whitespace().next().unwrap())
            .collect();
        assert!(
            out.contains("forward  matmul f32[B, T, 2304]"),
            "line {line}: {out}"
        );
        assert_eq!(
            fused.len(),
            3,
            "line {line}: the product and its two gradients' in {out}"
        );
        kernels.push(fused.join(" "));
    }
    assert!(kernels.iter().all(|k| *k == kernels[0]), "{kernels:?}");
    let dir = common::host::work_dir("explain-fused");
    let (code, _, err) = fusec(&[
        "build",
        "dsl-examples/bert-classifier.dsl",
        "--set",
        "layers=1",
        "--batch",
        "8",
        "--dim",
        "T=128",
        "-o",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let report = std::fs::read_to_string(dir.join("report.txt")).unwrap();
    assert!(
        report.lines().any(|l| l.contains("matmul_add")
            && l.contains("@bert-classifier.dsl:48, 49, 50 in layer.0")),
        "{report}"
    );
}
