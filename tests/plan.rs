//! The memory plan of every shipped model: no two buffers alive at the same
//! time share memory, updates land in place, and the whole-run buffers hold
//! exactly 16 bytes per parameter (f32 master, gradient, two AdamW moments)
//! for the models trained with AdamW.

mod common;

use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::model::Optimizer;
use fusec_compiler::plan::{plan, MemKind, ALIGN};
use std::collections::BTreeMap;

#[test]
fn every_models_plan_is_sound() {
    for (file, _, _) in common::tiny_models() {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &[]);
        let g = &c.optimized;
        let program = fuse(g);
        let dims: BTreeMap<String, i64> = g
            .dims
            .iter()
            .map(|d| (d.clone(), if d == "B" { 4 } else { 128 }))
            .collect();
        let p = plan(g, &program, &dims).unwrap_or_else(|e| panic!("{file}: {e}"));
        p.verify()
            .unwrap_or_else(|e| panic!("{file}: {}", e.join("\n")));
        let shared = p.buffers.iter().filter(|b| b.shares_with.is_some()).count();
        assert!(
            file == "mlp.dsl" || shared > 0,
            "{file}: no kernel wrote in place"
        );
        let params = c.model.graph.param_count().unwrap() as u64;
        let kind = |k: MemKind| p.bytes_by_kind.get(&k).copied().unwrap_or(0);
        // Alignment adds at most ALIGN per tensor.
        let slack = ALIGN * c.model.graph.params.len() as u64;
        assert!(
            kind(MemKind::Param) >= 4 * params && kind(MemKind::Param) <= 4 * params + slack,
            "{file}"
        );
        assert!(
            kind(MemKind::Grad) >= 4 * params && kind(MemKind::Grad) <= 4 * params + slack,
            "{file}"
        );
        // AdamW's two moments, plus an f32 gradient accumulator when the
        // step is split into micro-batches.
        let acc = if c.model.train.micro_batches > 1 {
            4
        } else {
            0
        };
        if let Optimizer::AdamW { .. } = c.model.train.optimizer {
            assert!(
                kind(MemKind::OptimizerState) >= (8 + acc) * params
                    && kind(MemKind::OptimizerState) <= (8 + acc) * params + 3 * slack,
                "{file}"
            );
        }
        // Every new parameter is written over its old value.
        let in_place = p.buffers.iter().filter(|b| b.alias_of.is_some()).count();
        assert!(
            in_place >= c.model.graph.params.len(),
            "{file}: {in_place} in-place buffers"
        );
        // Sharing memory between temporaries makes the arena smaller than their sum.
        let temps: u64 = p
            .buffers
            .iter()
            .filter(|b| b.kind == MemKind::Activation && b.alias_of.is_none())
            .map(|b| b.bytes)
            .sum();
        assert!(
            kind(MemKind::Activation) < temps,
            "{file}: no reuse ({} of {temps})",
            kind(MemKind::Activation)
        );
        let json: serde_json::Value = serde_json::from_str(&p.to_json()).expect("plan.json parses");
        assert_eq!(
            json["launches"].as_array().unwrap().len(),
            program.kernels.len()
        );
    }
}

/// Runs a model's whole step with every buffer living at its planned offset
/// in one byte arena (values stored in their dtype's bytes): if the plan let
/// two live buffers overlap, a kernel would read a clobbered value and the
/// outputs would differ from a run with separate buffers.
#[test]
fn a_step_run_inside_the_planned_arena_gives_the_same_outputs() {
    use fusec_compiler::interp::random::random_feeds;
    use fusec_compiler::interp::tensor::Tensor;
    use fusec_compiler::interp::Precision;
    use fusec_compiler::ir::DType;
    use fusec_compiler::kernel::interp::{run_kernel, run_program};
    use fusec_compiler::kernel::BufKind;
    use fusec_compiler::ops::Op;

    // A buffer's values, stored at its offset in the arena.
    fn put(arena: &mut [u8], at: usize, dt: DType, data: &[f64]) {
        let bytes = common::to_bytes(dt, data);
        arena[at..at + bytes.len()].copy_from_slice(&bytes);
    }
    fn get(arena: &[u8], at: usize, dt: DType, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::new(
            shape.to_vec(),
            common::from_bytes(dt, &arena[at..at + n * dt.size_bytes()]),
        )
    }

    for (file, sets, dims) in common::tiny_models() {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        let g = &c.optimized;
        let program = fuse(g);
        let dims_map = common::dims(&dims);
        let plan = plan(g, &program, &dims_map.clone().into_iter().collect()).unwrap();
        // Values rounded to f32 first, so the arena's f32 storage is exact.
        let mut feeds = random_feeds(g, &dims_map, 4).unwrap();
        for t in feeds.params.values_mut().chain(feeds.inputs.values_mut()) {
            *t = t.map(|x| x as f32 as f64);
        }
        let reference = run_program(g, &program, &feeds, Precision::AsStored).unwrap();
        let mut arena = vec![0u8; plan.arena_bytes as usize];
        let shape = |b: usize| {
            plan.buffers[b]
                .shape
                .iter()
                .map(|&d| d as usize)
                .collect::<Vec<_>>()
        };
        for (b, buf) in program.buffers.iter().enumerate() {
            let fed = match (&g.g[buf.value.node].op, buf.kind) {
                (Op::Input(x), BufKind::Input) => &feeds.inputs[&x.name],
                (Op::Param(x), BufKind::Param) => &feeds.params[&x.name],
                (Op::State(x), BufKind::State) => &feeds.state[&x.name],
                _ => continue,
            };
            put(
                &mut arena,
                plan.buffers[b].offset as usize,
                buf.ty.dtype,
                &fed.data,
            );
        }
        for k in &program.kernels {
            let ins: Vec<Tensor> = k
                .inputs
                .iter()
                .map(|&b| {
                    get(
                        &arena,
                        plan.buffers[b].offset as usize,
                        program.buffers[b].ty.dtype,
                        &shape(b),
                    )
                })
                .collect();
            let refs: Vec<&Tensor> = ins.iter().collect();
            let outs = run_kernel(g, &program, k, &refs, &feeds, Precision::AsStored).unwrap();
            for (&b, t) in k.outputs.iter().zip(outs) {
                put(
                    &mut arena,
                    plan.buffers[b].offset as usize,
                    program.buffers[b].ty.dtype,
                    &t.data,
                );
            }
        }
        for (role, v) in &g.outputs {
            let b = program.buffer_of(*v).unwrap();
            let got = get(
                &arena,
                plan.buffers[b].offset as usize,
                program.buffers[b].ty.dtype,
                &shape(b),
            );
            assert_eq!(
                got.data, reference[b].data,
                "{file}: output {role} differs when run in the arena"
            );
        }
    }
}

#[test]
fn a_plan_needs_every_dimension() {
    let (name, src) = common::example("gpt2-block.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let program = fuse(&c.optimized);
    let err = plan(
        &c.optimized,
        &program,
        &BTreeMap::from([("B".to_string(), 2)]),
    )
    .unwrap_err();
    assert_eq!(err.0, "the memory plan needs a size for T");
}

/// GPT-2 small at B=8, T=1024: the planned arena is within 10% of the
/// textbook count (16 bytes per parameter for f32 master weights, gradients
/// and AdamW's two moments, plus every activation the backward pass reads).
#[test]
fn gpt2_small_plan_is_within_ten_percent_of_the_textbook_count() {
    use fusec_compiler::plan::textbook_bytes;
    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let g = &c.optimized;
    let program = fuse(g);
    let dims = BTreeMap::from([("B".to_string(), 8), ("T".to_string(), 1024)]);
    let p = plan(g, &program, &dims).unwrap();
    let textbook = textbook_bytes(g, &dims).unwrap();
    let params = c.model.graph.param_count().unwrap() as u64;
    assert!(textbook > 16 * params, "{textbook}");
    let ratio = p.arena_bytes as f64 / textbook as f64;
    println!(
        "arena {} bytes, textbook {textbook} bytes, ratio {ratio:.3}, {} kernels",
        p.arena_bytes,
        p.launches.len()
    );
    assert!(
        (0.9..=1.1).contains(&ratio),
        "plan {} vs textbook {textbook}: {ratio:.3}",
        p.arena_bytes
    );
}

/// The roofline's FLOP count for GPT-2 small at B=8, T=1024 agrees with the
/// textbook: 6 FLOPs per matmul weight per token, plus causal attention
/// (4·B·H·T²·D/2 forward, 2.5 times that backward, per layer), within 1%
/// (the rest is elementwise work).
#[test]
fn gpt2_small_flops_match_the_textbook() {
    use fusec_compiler::plan::roofline::{device, estimate};
    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let g = &c.optimized;
    let program = fuse(g);
    let dims = BTreeMap::from([("B".to_string(), 8), ("T".to_string(), 1024)]);
    let p = plan(g, &program, &dims).unwrap();
    let est = estimate(g, &program, &p, device("h100").unwrap());
    let (b, t, d, h, l, v) = (8.0, 1024.0, 768.0, 12.0, 12.0, 50257.0);
    let matmul_weights = l * (d * 3.0 * d + d * d + 2.0 * d * 4.0 * d) + d * v;
    let attention = l * 3.5 * 4.0 * b * h * t * t * (d / h) / 2.0;
    let textbook = 6.0 * b * t * matmul_weights + attention;
    let ratio = est.flops / textbook;
    println!("{:.3e} FLOP per step, textbook {textbook:.3e}, ratio {ratio:.4}; {:.2} ms on H100 by the roofline", est.flops, est.seconds * 1e3);
    assert!((1.0..1.01).contains(&ratio), "{ratio}");
}

/// Group kernels launch: every generated launch of every shipped model's
/// plan has its kernel's step, and no launch is left as a group without one
/// (a group of elementwise chains once was, which the runtime refuses).
/// llama-small's micro-batch accumulation (every parameter's gradient
/// scaled, added to its accumulator, the accumulator kept or cleared) is
/// three launches, one a kind, not one a parameter each.
#[test]
fn group_kernels_have_steps_and_micro_batch_accumulation_is_three_launches() {
    use fusec_compiler::plan::LaunchKind;
    for name in common::shipped_models() {
        let (file, src) = common::example(&name);
        let c = common::compile_with(&src, &file, &[]);
        let g = &c.optimized;
        let dims: BTreeMap<String, i64> = g
            .dims
            .iter()
            .map(|d| (d.clone(), if d == "B" { 4 } else { 64 }))
            .collect();
        let p = plan(g, &fuse(g), &dims).unwrap_or_else(|e| panic!("{name}: {e}"));
        for l in &p.launches {
            assert!(
                l.kind != LaunchKind::Group,
                "{name}: {} has no step",
                l.kernel
            );
            if l.kind == LaunchKind::Generated {
                assert_eq!(l.steps.len(), 1, "{name}: {}", l.kernel);
            }
        }
        if name == "llama-small.dsl" {
            assert!(c.model.train.micro_batches > 1);
            let params = c.model.graph.params.len();
            for kind in ["mul", "add", "keep_if"] {
                let group = format!("_{kind}_x{params}");
                let n = p
                    .launches
                    .iter()
                    .filter(|l| l.kernel.ends_with(&group))
                    .count();
                assert_eq!(
                    n, 1,
                    "{name}: one {kind} launch for the {params} accumulators"
                );
            }
        }
    }
}
