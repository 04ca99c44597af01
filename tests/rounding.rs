//! How far one bf16 step lands from f64: fusec's kernel program (values
//! rounded as its kernels store them) beside the graph with every op's
//! result rounded as stored (what PyTorch's bf16 ops do). The vit-tiny
//! figures in docs/benchmarks.md come from this test's output
//! (`cargo test --release --test rounding -- --nocapture`).

mod common;

use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::{run, Precision};
use fusec_compiler::ir::graph::Role;

/// Relative change of a tensor's sum of squares against the f64 one.
fn sumsq_bias(got: &[f64], exact: &[f64]) -> f64 {
    let ss = |a: &[f64]| a.iter().map(|x| x * x).sum::<f64>();
    ss(got) / ss(exact) - 1.0
}

/// vit-tiny with 2 layers and 2 classes, B = 16: the kernel program's
/// global gradient norm is no further from f64 than op-by-op rounding's
/// (within 1.5x), and no parameter's gradient is off by more than 2%.
#[test]
fn one_vit_bf16_step_rounds_no_worse_than_op_by_op() {
    let (name, src) = common::example("vit-tiny.dsl");
    let c = common::compile_with(&src, &name, &[("layers", "2"), ("classes", "2")]);
    let g = &c.optimized;
    let feeds = random_feeds(g, &common::dims(&[("B", 16)]), 1).unwrap();
    let exact = run(g, &feeds, Precision::F64).unwrap();
    let by_op = run(g, &feeds, Precision::AsStored).unwrap();
    let p = fusec_compiler::kernel::fuse::fuse(g);
    let kernels =
        fusec_compiler::kernel::interp::run_program(g, &p, &feeds, Precision::AsStored).unwrap();
    let mut norm = (0.0, 0.0);
    for (role, v) in &g.outputs {
        let name = match role {
            Role::Grad(i) => g.params[*i].name.clone(),
            Role::GradNorm => "global norm".into(),
            _ => continue,
        };
        let b = p.buffers.iter().position(|b| b.value == *v).unwrap();
        let (op, k) = (
            sumsq_bias(&by_op[v].data, &exact[v].data),
            sumsq_bias(&kernels[b].data, &exact[v].data),
        );
        println!("{name:24} sum of squares vs f64: op by op {op:+.2e}, kernels {k:+.2e}");
        assert!(k.abs() < 2e-2, "{name}: {k}");
        if matches!(role, Role::GradNorm) {
            norm = (op, k);
        }
    }
    assert!(norm.1.abs() <= 1.5 * norm.0.abs(), "{norm:?}");
}
