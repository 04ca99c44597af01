//! Recomputation under a memory budget.

mod common;

use fusec_compiler::recompute;
use std::collections::BTreeMap;

fn bdims(pairs: &[(&str, i64)]) -> BTreeMap<String, i64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

#[test]
fn debug_gpt2() {
    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let g = &c.optimized;
    let saved = recompute::saved_values(g);
    let cps = recompute::checkpoints(g);
    println!("saved {} checkpoints {}", saved.len(), cps.len());
    let dims = bdims(&[("B", 32), ("T", 1024)]);
    let dev = fusec_compiler::plan::roofline::device("h100").unwrap();
    let order = recompute::candidates(g, &dims, dev);
    for d in order.iter().take(40) {
        println!(
            "{} {:?} {} {}",
            d.op,
            d.span
                .map(|s| fusec_compiler::ir::print::line_col(&src, s.start).0),
            d.bytes >> 20,
            d.span.map_or(0, |s| s.call)
        );
    }
    for v in cps.iter().take(10) {
        println!(
            "cp {} {:?}",
            g.g[v.node].op.name(),
            g.g[v.node]
                .span
                .map(|s| (fusec_compiler::ir::print::line_col(&src, s.start).0, s.call))
        );
    }
}

#[test]
fn debug_floor() {
    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[("layers", "2")]);
    let mut g = c.optimized.clone();
    let dims = bdims(&[("B", 32), ("T", 1024)]);
    let dev = fusec_compiler::plan::roofline::device("h100").unwrap();
    let order = recompute::candidates(&g, &dims, dev);
    let before = g.g.node_count();
    let added = recompute::drop_saved(&mut g, &order.iter().map(|d| d.value).collect());
    println!("nodes {before} + {added}");
    let p = fusec_compiler::kernel::fuse::fuse(&g);
    let t = fusec_compiler::select::Target::for_device("h100", false).unwrap();
    let sel = fusec_compiler::select::select(&g, &p, &t, None);
    let plan = fusec_compiler::plan::plan_with(&g, &p, Some(&sel), &dims).unwrap();
    println!("arena {}", plan.arena_bytes >> 20);
    let mut bs: Vec<_> = plan.buffers.iter().filter(|b| b.live.is_some()).collect();
    bs.sort_by_key(|b| std::cmp::Reverse(b.bytes));
    for b in bs.iter().take(30) {
        println!(
            "{} {} MiB live {:?} off {}",
            b.name,
            b.bytes >> 20,
            b.live,
            b.offset >> 20
        );
    }
    for (i, l) in plan.launches.iter().enumerate() {
        println!("{i} {} {:?}", l.kernel, l.ops);
    }
}
