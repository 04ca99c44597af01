//! The loss head in chunks of rows (`fusec_compiler::loss_head`): the step
//! computes the same loss, gradients and update in f64 (to 1e-12 relative:
//! only the order of the weight gradient's sum over rows changes), its
//! plan never holds the whole logits, each chunk's logits die before the
//! next chunk's are made, and a head that is not a plain product keeps its
//! logits whole and says why.

mod common;

use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::ir::Graph;
use fusec_compiler::loss_head::{chunk, Rows};
use fusec_compiler::ops::Op;
use fusec_compiler::select::Target;

fn count(g: &Graph, what: fn(&Op) -> bool) -> usize {
    g.g.node_indices().filter(|&n| what(&g.g[n].op)).count()
}

fn is_ce(op: &Op) -> bool {
    matches!(op, Op::CrossEntropyWithGrad(_))
}

/// Every tiny shipped model whose loss is a cross-entropy of one product:
/// in chunks of 3 rows (the last shorter: 10 rows are 3 + 3 + 3 + 1) and
/// of 4 the step gives the unchunked step's outputs in f64; so does the
/// kernel program as fused and planned (values rounded as stored, the
/// same as the unchunked program's to bf16's rounding of the sums).
#[test]
fn chunks_change_no_result() {
    let mut chunked = Vec::new();
    // Beside the shipped models: grouped queries at head dim 8 of 2 heads
    // and an untied head of 1003 classes, which pad-dims widens to 1008
    // (the cross-entropy reads the first 1003 of each chunk's rows).
    let (file, sets) = common::awkward_gqa();
    let odd = (file, sets, vec![("B", 2), ("T", 5)]);
    for (file, sets, dims) in common::tiny_models().into_iter().chain([odd]) {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        let d = common::plan_sizes(&dims);
        let feeds = random_feeds(&c.optimized, &common::dims(&dims), 11).unwrap();
        let whole = common::f64_outputs(&c.optimized, &feeds);
        for rows in [3, 4] {
            let mut g = c.optimized.clone();
            let (done, left) = chunk(&mut g, &d, Rows::At(rows)).unwrap();
            if done.is_empty() {
                println!("{file}: whole ({left:?})");
                continue;
            }
            fusec_compiler::ir::verify::verify(&g).unwrap();
            let n = done[0].total_rows;
            assert_eq!(done[0].chunks as u64, n.div_ceil(rows), "{file}");
            assert_eq!(count(&g, is_ce), done[0].chunks, "{file}");
            let got = common::f64_outputs(&g, &feeds);
            assert_eq!(whole.len(), got.len());
            for ((role, x), (_, y)) in whole.iter().zip(&got) {
                assert_eq!(x.len(), y.len(), "{file}: {role}");
                for (a, b) in x.iter().zip(y) {
                    // Only the weight gradient's sum over rows is taken in
                    // another order: f64 rounding, far under 1e-12.
                    let ok = (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0);
                    assert!(ok, "{file}, chunks of {rows}: {role}: {a} vs {b}");
                }
            }
            chunked.push(file);
        }
    }
    // GPT-2 (tied embedding), LLaMA (a head of its own), the odd sizes.
    for m in [
        "gpt2-small.dsl",
        "llama-small.dsl",
        "../tests/models/twins/gqa-hd80.dsl",
    ] {
        assert!(chunked.contains(&m), "{m} was not chunked: {chunked:?}");
    }
}

/// GPT-2 small at B = 8, T = 1024 on an H100: by default the logits (786
/// MiB of bf16) are made in two chunks of 4096 rows and the arena falls by
/// at least a chunk's logits; no buffer of the plan is as large as the
/// whole logits; and in launch order each chunk's cross-entropy runs
/// before the next chunk's logits are made (else both chunks' logits would
/// be live at once and nothing would be saved).
#[test]
fn gpt2_small_never_stores_its_whole_logits() {
    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let d = common::plan_sizes(&[("B", 8), ("T", 1024)]);
    let target = Target::for_device("h100", false).unwrap();
    let plan_of = |g: &Graph| fusec_compiler::lowering::lower(g, &target, &d, None).unwrap();
    let before = plan_of(&c.optimized);
    let mut g = c.optimized.clone();
    let (done, _) = chunk(&mut g, &d, Rows::Auto).unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!((done[0].chunks, done[0].rows), (2, 4096));
    let after = plan_of(&g);
    let logits = 8 * 1024 * 50257 * 2u64;
    let largest = |p: &fusec_compiler::plan::Plan| p.buffers.iter().map(|b| b.bytes).max().unwrap();
    assert!(largest(&before.plan) >= logits);
    assert!(
        largest(&after.plan) < logits / 2 + (4 << 20),
        "a buffer of {} bytes",
        largest(&after.plan)
    );
    let saved = before.plan.arena_bytes - after.plan.arena_bytes;
    println!(
        "arena {} -> {} bytes ({saved} saved)",
        before.plan.arena_bytes, after.plan.arena_bytes
    );
    // Half the logits, less what the chunked plan holds beside a chunk's
    // logits where it peaks (the first chunk's weight-gradient product:
    // its output, bf16 [50257, 768], and the chunk's input gradient and
    // slice, 6 MiB each, live there and not at the whole head's peak).
    // Both chunks' logits live at once would fail this by 320 MiB.
    let slack = 50257 * 768 * 2;
    assert!(saved >= logits / 2 - (24 << 20) - slack, "saved {saved}");
    // The launch order: product, loss, product, loss.
    let order: Vec<&str> = after
        .plan
        .launches
        .iter()
        .filter_map(|l| {
            if l.ops.iter().any(|o| o == "cross_entropy_with_grad") {
                Some("loss")
            } else if l.gemm.as_ref().is_some_and(|g| g.n >= 50257) {
                Some("logits")
            } else {
                None
            }
        })
        .collect();
    assert_eq!(order, ["logits", "loss", "logits", "loss"]);
}

/// `all` leaves the head as it is; a head whose logits are not one
/// product (a classifier with a bias) stays whole under a number of rows
/// and says why; `auto` leaves logits under 512 MiB whole.
#[test]
fn what_is_not_chunked_says_why() {
    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let d = common::plan_sizes(&[("B", 4), ("T", 1024)]);
    let mut g = c.optimized.clone();
    assert_eq!(chunk(&mut g, &d, Rows::All).unwrap(), (vec![], vec![]));
    assert_eq!(g.g.node_count(), c.optimized.g.node_count());
    // 4 x 1024 rows of 50257 bf16 logits: 393 MiB, under `auto`'s 512.
    assert!(chunk(&mut g, &d, Rows::Auto).unwrap().0.is_empty());

    let src = "dim B
input x: f32[B, 8]
input y: i32[B]
param w: [8, 5] = normal(0.3)
param b: [5] = zeros
train {
    loss = cross_entropy(x @ w + b, y)
}
";
    let c = fusec_compiler::driver::compile(src, "biased", &Default::default())
        .unwrap_or_else(|f| panic!("{}", f.render("biased.dsl", src)));
    let mut g = c.optimized.clone();
    let (done, left) = chunk(&mut g, &common::plan_sizes(&[("B", 12)]), Rows::At(4)).unwrap();
    assert!(done.is_empty());
    assert_eq!(left.len(), 1);
    assert_eq!(left, [fusec_compiler::loss_head::Whole::NotOneProduct]);
    assert!(left[0].to_string().contains("bias"), "{left:?}");
}

/// The losses a `fusec train --log` wrote.
fn logged_losses(log: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["loss"].as_f64().unwrap()
        })
        .collect()
}

/// `fusec train` on two CPU ranks, ZeRO's and plain data parallel, in
/// fp32: the loss head in chunks of 5 rows (each rank's 2 x 8 rows: three
/// of 5 and one of 1) trains as the whole head does, step for step, to
/// f32's rounding of the weight gradient's sum in another order (1e-5 of
/// losses near 3, over 4 steps of AdamW at 1e-3); and the command says
/// what it chunked.
#[test]
fn data_parallel_ranks_chunk_their_heads_and_train_alike() {
    let dir = std::env::temp_dir().join(format!("fusec-loss-head-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for zero in ["0", "1"] {
        let mut runs = Vec::new();
        for rows in ["all", "5"] {
            let log = dir.join(format!("z{zero}-{rows}.jsonl"));
            let (code, _, err) = common::fusec(&[
                "train",
                "dsl-examples/gpt2-small.dsl",
                "--set",
                "layers=1",
                "--set",
                "d=32",
                "--set",
                "n_heads=2",
                "--set",
                "vocab=97",
                "--set",
                "ctx=16",
                "--precision",
                "fp32",
                "--cpu",
                "--gpus",
                "2",
                "--zero",
                zero,
                "--batch",
                "2",
                "--seq",
                "8",
                "--steps",
                "4",
                "--lr",
                "1e-3",
                "--data",
                "random",
                "--loss-head-rows",
                rows,
                "--log",
                log.to_str().unwrap(),
            ]);
            assert_eq!(code, 0, "{err}");
            assert_eq!(
                err.contains("loss head in 4 chunks of 5 rows (of 16)"),
                rows == "5",
                "{err}"
            );
            runs.push(logged_losses(&log));
        }
        assert_eq!(runs[0].len(), 4);
        for (a, b) in runs[0].iter().zip(&runs[1]) {
            assert!((a - b).abs() <= 1e-5 * a.abs(), "zero {zero}: {:?}", runs);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `fusec build` of gpt2-small with `args` into a folder of its own (named
/// by `tag`): (exit code, stderr, report.txt where it was written).
fn build_gpt2(tag: &str, args: &[&str]) -> (i32, String, String) {
    let dir = std::env::temp_dir().join(format!("fusec-loss-head-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut all = vec![
        "build",
        "dsl-examples/gpt2-small.dsl",
        "-o",
        dir.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let (code, _, err) = common::fusec(&all);
    let report = std::fs::read_to_string(dir.join("report.txt")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    (code, err, report)
}

const B8: [&str; 4] = ["--batch", "8", "--seq", "1024"];

/// `fusec build` says what it chunked in report.txt, `all` leaves the head
/// whole, a number of rows that is none is refused with the forms the flag
/// takes, and rows asked for without the sizes they are cut at are refused
/// naming the size to give.
#[test]
fn build_reports_the_chunks_and_refuses_a_bad_row_count() {
    fn rows(r: &str) -> Vec<&str> {
        [&B8[..], &["--loss-head-rows", r]].concat()
    }
    let (code, err, report) = build_gpt2("auto", &rows("auto"));
    assert_eq!(code, 0, "{err}");
    assert!(
        report.contains("loss head in 2 chunks of 4096 rows (of 8192): logits and their gradient 392.6 MiB a chunk, never the whole 785.3 MiB"),
        "{report}"
    );
    let (code, err, report) = build_gpt2("all", &rows("all"));
    assert_eq!(code, 0, "{err}");
    assert!(!report.contains("loss head in"));
    for bad in ["0", "many"] {
        let (code, err, _) = build_gpt2("bad", &rows(bad));
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains("give auto, all, or a positive number"),
            "{err}"
        );
    }
    let (code, err, _) = build_gpt2("nosize", &["--batch", "8", "--loss-head-rows", "4096"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--loss-head-rows 4096") && err.contains("give the size of T"),
        "{err}"
    );
}

/// A data-parallel rank's step is chunked as one GPU's is: `fusec build
/// --gpus 2 --rank 1` (ZeRO rank 1's own step) at B = 8 a GPU says so in
/// its report.
#[test]
fn a_ranks_build_is_chunked_too() {
    let (code, err, report) =
        build_gpt2("rank", &[&B8[..], &["--gpus", "2", "--rank", "1"]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(
        report.contains("loss head in 2 chunks of 4096 rows (of 8192)"),
        "{report}"
    );
}
