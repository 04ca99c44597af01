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
        p.check().unwrap_or_else(|e| panic!("{file}: {e}"));
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
        if let Optimizer::AdamW { .. } = c.model.train.optimizer {
            assert!(
                kind(MemKind::OptimizerState) >= 8 * params
                    && kind(MemKind::OptimizerState) <= 8 * params + 2 * slack,
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
