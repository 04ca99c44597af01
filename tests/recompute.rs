//! Recomputation under a memory budget: results never change, the plan
//! fits the budget, recomputed values live only in their own layer's
//! backward pass, and the command line says what it chose.

mod common;

use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::Precision;
use fusec_compiler::ir::verify::verify;
use fusec_compiler::ir::Graph;
use fusec_compiler::plan::roofline::{device, Device};
use fusec_compiler::recompute::{self, parse_size, BudgetError};
use fusec_compiler::select::Target;

fn h100() -> (Target, Device) {
    (
        Target::for_device("h100", false).unwrap(),
        device("h100").unwrap(),
    )
}

/// One model at budgets from just under its unbudgeted plan to its floor:
/// each plan fits, and the interpreter's loss, gradients and updated
/// parameters and state (f64) are bit for bit the unbudgeted step's.
/// Returns (unbudgeted peak, floor, whether any budget recomputed).
fn check_budgets(
    file: &str,
    src: &str,
    sets: &[(&str, &str)],
    dims: &[(&str, i64)],
) -> (u64, u64, bool) {
    let (target, dev) = h100();
    let c = common::compile_with(src, file, sets);
    let g = &c.optimized;
    let d = common::plan_sizes(dims);
    let feeds = random_feeds(g, &common::dims(dims), 11).expect("feeds");
    let reference = common::f64_outputs(g, &feeds);
    let peak = recompute::probe(g, &d, &target, dev).unwrap().arena_bytes;
    let floor = recompute::floor(g, &d, &target, dev).unwrap().arena_bytes;
    println!("{file}: unbudgeted {peak} bytes, floor {floor}");
    assert!(
        floor <= peak,
        "{file}: the floor {floor} is above the plan {peak}"
    );
    let mut budgets = vec![peak - 1, floor + (peak - floor) / 2, floor];
    budgets.dedup();
    let mut recomputed_any = false;
    for budget in budgets {
        let mut h = g.clone();
        let choice = match recompute::fit_budget(&mut h, &d, budget, &target, dev) {
            Ok(choice) => choice,
            // Equal floor and plan: nothing can be dropped.
            Err(BudgetError::BelowFloor { .. }) if floor == peak => continue,
            Err(e) => panic!("{file} at {budget} bytes: {e}"),
        };
        verify(&h).unwrap_or_else(|p| panic!("{file}: {}", p.join("\n")));
        let after = recompute::probe(&h, &d, &target, dev).unwrap().arena_bytes;
        assert!(after <= budget, "{file}: plan {after} over budget {budget}");
        if let Some(choice) = &choice {
            assert_eq!(choice.after.arena_bytes, after, "{file}");
            // Something recomputed, or nothing and the ops run in the
            // order that minds memory (which met the budget alone).
            if choice.dropped.is_empty() {
                assert!(choice.ops_added == 0 && h.order_by_memory, "{file}");
            } else {
                assert!(choice.ops_added > 0, "{file}");
                recomputed_any = true;
            }
        }
        let got = common::f64_outputs(&h, &feeds);
        assert_eq!(got.len(), reference.len());
        for ((role, a), (_, b)) in reference.iter().zip(&got) {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{file} at a budget of {budget} bytes: {role} differs"
            );
        }
    }
    (peak, floor, recomputed_any)
}

/// Every shipped model, at budgets from just under its unbudgeted plan to
/// its floor: the plan fits, and the results are the unbudgeted step's.
#[test]
fn budgets_never_change_results() {
    let mut models = common::tiny_models();
    // gpt2-xl is gpt2-small's file with larger constants.
    let small = models
        .iter()
        .find(|m| m.0 == "gpt2-small.dsl")
        .unwrap()
        .clone();
    models.push(("gpt2-xl.dsl", small.1, small.2));
    for (file, sets, dims) in models {
        let (name, src) = common::example(file);
        let (peak, floor, recomputed_any) = check_budgets(&name, &src, &sets, &dims);
        // A model of repeated layers always has activations to drop (the
        // MLP and the single GPT-2 block need theirs at once in the
        // backward pass, where their peak is).
        if sets.iter().any(|(k, _)| *k == "layers") {
            assert!(floor < peak, "{file}: the floor is the plan");
            assert!(recomputed_any, "{file}: no budget recomputed anything");
        }
    }
}

/// Shapes nobody chose for the examples: head dim 80 with 8 query heads a
/// key/value head, an MLP width of 1713 and a vocabulary of 5003 (padded
/// inside the step); cross-attention with S != T; a wide MLP with no
/// blocks at all.
#[test]
fn odd_shapes_keep_their_results_under_budgets() {
    let twins = common::root().join("tests/models/twins");
    for (file, dims) in [
        ("gqa-hd80.dsl", vec![("B", 2), ("T", 7)]),
        ("cross-attention.dsl", vec![("B", 2), ("T", 5), ("S", 9)]),
        ("wide-mlp.dsl", vec![("B", 6)]),
    ] {
        let src = std::fs::read_to_string(twins.join(file)).unwrap();
        let (peak, floor, recomputed_any) =
            check_budgets(&format!("tests/models/twins/{file}"), &src, &[], &dims);
        println!("{file}: {peak} -> floor {floor}, recomputed: {recomputed_any}");
        if file == "gqa-hd80.dsl" {
            assert!(recomputed_any && floor < peak, "{file}: nothing recomputed");
        }
    }
}

/// GPT-2 small at the sizes: each budget is met, the predicted
/// time grows as the budget shrinks, the cheapest recomputations (GELU,
/// norms) come first, and a budget under the floor names the floor.
#[test]
fn gpt2_small_fits_12_10_and_8_gib_at_batch_32() {
    let (target, dev) = h100();
    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let d = common::plan_sizes(&[("B", 32), ("T", 1024)]);
    let mut last_seconds = 0.0;
    for gib in [12u64, 10, 8] {
        let mut g = c.optimized.clone();
        let budget = gib << 30;
        let choice = recompute::fit_budget(&mut g, &d, budget, &target, dev)
            .unwrap()
            .expect("gpt2-small at B = 32 needs 14.5 GiB");
        assert!(choice.after.arena_bytes <= budget);
        assert!(choice.before.arena_bytes > budget);
        assert!(choice.after.seconds > last_seconds);
        last_seconds = choice.after.seconds;
        let ops: Vec<&str> = choice.dropped.iter().map(|x| x.op).collect();
        assert!(ops.contains(&"gelu"), "{gib} GiB: {ops:?}");
        if gib == 12 {
            assert!(
                ops.iter().all(|o| matches!(*o, "gelu" | "layernorm")),
                "12 GiB needs only the cheap ones: {ops:?}"
            );
        }
    }
    let mut g = c.optimized.clone();
    match recompute::fit_budget(&mut g, &d, 4 << 30, &target, dev) {
        Err(e @ BudgetError::BelowFloor { floor, .. }) => {
            assert!(floor > 4 << 30 && floor < 8 << 30, "{e}");
            assert!(e.to_string().contains("give a budget of at least"), "{e}");
        }
        other => panic!("4 GiB should be under the floor: {other:?}"),
    }
}

/// A recomputed value is made in the backward pass of its own layer: at
/// the floor, every recomputed op comes after the forward pass, and is
/// placed after the backward ops of every later layer that run before it.
#[test]
fn recomputed_ops_run_just_before_their_readers() {
    let (_, dev) = h100();
    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[("layers", "4")]);
    let d = common::plan_sizes(&[("B", 4), ("T", 64)]);
    let mut g = c.optimized.clone();
    recompute::drop_every_candidate(&mut g, &d, dev);
    let order = g.topo_order();
    let pos: std::collections::HashMap<_, _> =
        order.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let first_backward = order
        .iter()
        .position(|&n| g.g[n].phase != fusec_compiler::ir::graph::Phase::Forward)
        .unwrap();
    let mut recomputed = 0;
    for &n in &order {
        if !g.g[n].recompute {
            continue;
        }
        recomputed += 1;
        assert!(pos[&n] > first_backward);
        let layer = g
            .call_stack(g.g[n].span.unwrap())
            .last()
            .map(|c| c.path.clone());
        // Between a recomputed op and its first reader lie only other
        // recomputed ops, free views, and ops of the same layer.
        let first_reader = (0..g.g[n].outputs.len())
            .flat_map(|port| g.users(fusec_compiler::ir::graph::Value { node: n, port }))
            .map(|(r, _)| pos[&r])
            .min()
            .unwrap();
        for &m in &order[pos[&n] + 1..first_reader] {
            let other = g.g[m]
                .span
                .and_then(|s| g.call_stack(s).last().map(|c| c.path.clone()));
            assert!(
                g.g[m].recompute || other == layer || other.is_none(),
                "a recomputed op of {layer:?} waits across {other:?}"
            );
        }
    }
    assert!(recomputed > 0);
}

#[test]
fn sizes_parse_with_binary_units() {
    assert_eq!(parse_size("12GiB"), Ok(12 << 30));
    assert_eq!(parse_size("12G"), Ok(12 << 30));
    assert_eq!(parse_size("12"), Ok(12 << 30));
    assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
    assert_eq!(parse_size("9000MiB"), Ok(9000 << 20));
    assert_eq!(parse_size("512k"), Ok(512 << 10));
    assert_eq!(parse_size("1TiB"), Ok(1 << 40));
    for bad in ["", "GiB", "12 parsecs", "-3GiB", "0", "1e400"] {
        assert!(parse_size(bad).is_err(), "{bad:?} parsed");
    }
}

#[test]
fn build_reports_what_the_budget_recomputes() {
    let out = std::env::temp_dir().join(format!("fusec-budget-{}", std::process::id()));
    let out_s = out.to_str().unwrap();
    // `fusec build` of gpt2-small with `extra` arguments.
    let build = |extra: &[&str]| {
        let mut args = vec!["build", "dsl-examples/gpt2-small.dsl", "-o", out_s];
        args.extend_from_slice(extra);
        common::fusec(&args)
    };
    let at_32 = ["--batch", "32", "--seq", "1024"];
    let (code, stdout, stderr) = build(&[&at_32[..], &["--memory-budget", "10GiB"]].concat());
    assert_eq!(code, 0, "{stderr}");
    let report = std::fs::read_to_string(out.join("report.txt")).unwrap();
    let para: String = report
        .lines()
        .skip_while(|l| !l.starts_with("recompute for a memory budget"))
        .take_while(|l| !l.is_empty() && !l.starts_with("roofline"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(stdout.contains("recompute for a memory budget of 10.000 GiB"));
    insta::assert_snapshot!(para);
    // The arena the last build's plan.json gives.
    let arena = || -> u64 {
        let plan = std::fs::read_to_string(out.join("plan.json")).unwrap();
        plan.lines()
            .find_map(|l| l.trim().strip_prefix("\"arena_bytes\": "))
            .and_then(|v| v.trim_end_matches(',').parse().ok())
            .unwrap()
    };
    let a = arena();
    assert!(a <= 10 << 30, "{a}");

    let (code, _, stderr) = build(&[&at_32[..], &["--memory-budget", "3GiB"]].concat());
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("the memory budget of 3.000 GiB cannot be met")
            && stderr.contains("give a budget of at least"),
        "{stderr}"
    );
    let (code, _, stderr) = build(&["--batch", "32", "--memory-budget", "3GiB"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("give the size of T"), "{stderr}");
    let (code, _, stderr) = build(&["--memory-budget", "lots"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("`lots` is not a size"), "{stderr}");
    // Over ranks: each rank's own step (ZeRO stage 1 and 2) fitted.
    for zero in ["1", "2"] {
        let (code, stdout, stderr) = build(
            &[
                &at_32[..],
                &["--gpus", "2", "--zero", zero, "--memory-budget", "8GiB"],
            ]
            .concat(),
        );
        assert_eq!(code, 0, "--zero {zero}: {stderr}");
        assert!(
            stdout.contains("recompute for a memory budget of 8.000 GiB"),
            "--zero {zero}: {stdout}"
        );
        let a = arena();
        assert!(a <= 8 << 30, "--zero {zero}: {a}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// Without a budget, what is free: llama's `silu(gate)`, read in the
/// backward pass only by the SwiGLU product's gradient, is recomputed
/// there; the peak falls, the predicted time does not rise, and the
/// results are the same. GPT-2's GELU output feeds a weight-gradient GEMM,
/// so nothing of GPT-2's is free.
#[test]
fn without_a_budget_only_free_recomputation_happens() {
    let (target, dev) = h100();
    let (file, sets, dims) = common::tiny_models()
        .into_iter()
        .find(|m| m.0 == "llama-small.dsl")
        .unwrap();
    let (name, src) = common::example(file);
    let c = common::compile_with(&src, &name, &sets);
    let d = common::plan_sizes(&dims);
    let mut g = c.optimized.clone();
    let choice = recompute::free_drops(&mut g, &d, &target, dev)
        .unwrap()
        .expect("llama's silu is free to recompute");
    assert!(choice.budget.is_none());
    assert!(
        choice.dropped.iter().all(|x| x.op == "silu"),
        "{:?}",
        choice.dropped
    );
    assert!(choice.after.arena_bytes < choice.before.arena_bytes);
    assert!(choice.after.seconds <= choice.before.seconds);
    let feeds = random_feeds(&c.optimized, &common::dims(&dims), 4).unwrap();
    let (a, b) = (
        common::f64_outputs(&c.optimized, &feeds),
        common::f64_outputs(&g, &feeds),
    );
    for ((role, x), (_, y)) in a.iter().zip(&b) {
        assert!(
            x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{role} differs"
        );
    }
    // As the kernels round (the kernel-program interpreter, values rounded
    // as stored): the forward pass now keeps silu(gate) in f32 registers
    // where it stored it as bf16, so the bf16 step's loss moves by about
    // bf16's rounding, no more.
    let loss = |h: &Graph| {
        let p = fusec_compiler::kernel::fuse::fuse(h);
        let vals = fusec_compiler::kernel::interp::run_program(h, &p, &feeds, Precision::AsStored)
            .unwrap();
        let v = h.output(&fusec_compiler::ir::graph::Role::Loss).unwrap();
        vals[p.buffers.iter().position(|b| b.value == v).unwrap()].data[0]
    };
    let (before, after) = (loss(&c.optimized), loss(&g));
    println!("llama-small loss as stored: {before} unbudgeted, {after} with silu recomputed");
    assert!(
        (before - after).abs() <= 4e-3 * before.abs(),
        "{before} vs {after}"
    );

    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let mut g = c.optimized.clone();
    let d = common::plan_sizes(&[("B", 8), ("T", 1024)]);
    assert!(recompute::free_drops(&mut g, &d, &target, dev)
        .unwrap()
        .is_none());
}

/// The peak does not always fall as more is dropped (llama's
/// weight-gradient products run late, so values recomputed for them live
/// long): any budget from the least peak seen up to the plan is still met.
#[test]
fn llama_budgets_down_to_its_floor_are_met() {
    let (target, dev) = h100();
    let (name, src) = common::example("llama-small.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let d = common::plan_sizes(&[("B", 32), ("T", 1024)]);
    let peak = recompute::probe(&c.optimized, &d, &target, dev)
        .unwrap()
        .arena_bytes;
    let floor = recompute::floor(&c.optimized, &d, &target, dev)
        .unwrap()
        .arena_bytes;
    assert!(floor < peak);
    for budget in [floor, (floor + peak) / 2, peak - 1] {
        let mut g = c.optimized.clone();
        let choice = recompute::fit_budget(&mut g, &d, budget, &target, dev)
            .unwrap_or_else(|e| panic!("{budget}: {e}"))
            .expect("over budget");
        assert!(choice.after.arena_bytes <= budget);
    }
}

/// `--dump-after recompute` prints the step graph with its recomputed ops
/// marked, in the backward pass; it needs the sizes.
#[test]
fn the_graph_after_recompute_is_dumped() {
    let args = [
        "build",
        "dsl-examples/gpt2-small.dsl",
        "--set",
        "layers=2",
        "--batch",
        "32",
        "--seq",
        "1024",
        "--memory-budget",
        "2.8GiB",
        "--dump-after",
        "recompute",
    ];
    let (code, out, err) = common::fusec(&args);
    assert_eq!(code, 0, "{err}");
    let backward = out.find("\nbackward:").expect("a backward section");
    let first = out.find("  recomputed").expect("recomputed ops");
    assert!(
        first > backward,
        "a recomputed op outside the backward pass"
    );
    assert!(out.contains("= gelu(") && out.contains("gelu(%"), "{out}");
    let (code, _, err) = common::fusec(
        &args[..6]
            .iter()
            .chain(&args[10..])
            .copied()
            .collect::<Vec<_>>(),
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--dump-after recompute") && err.contains("give the size of T"),
        "{err}"
    );
}

/// Dropout's masks are drawn again, not stored: a forward dropout copied
/// into the backward pass by a budget draws the mask the step drew (the
/// results are the unbudgeted step's bit for bit, check_budgets).
#[test]
fn recomputed_dropout_draws_the_same_mask() {
    let path = common::root().join("tests/models/encoder-dropout.dsl");
    let src = std::fs::read_to_string(&path).unwrap();
    let (peak, floor, recomputed_any) = check_budgets(
        "tests/models/encoder-dropout.dsl",
        &src,
        &[("p", "0.3")],
        &[("B", 2), ("T", 7)],
    );
    assert!(recomputed_any && floor < peak, "nothing recomputed");
    // The floor's plan copies dropouts into the backward pass.
    let c = common::compile_with(&src, "encoder-dropout.dsl", &[("p", "0.3")]);
    let mut g = c.optimized.clone();
    let d = common::plan_sizes(&[("B", 2), ("T", 7)]);
    let count = |g: &Graph| {
        g.g.node_weights()
            .filter(|n| matches!(n.op, fusec_compiler::ops::Op::Dropout(_)) && n.recompute)
            .count()
    };
    recompute::drop_every_candidate(&mut g, &d, h100().1);
    assert!(count(&g) > 0, "no dropout was recomputed");
}
