//! The back half as one call: the kernel stages after the graph passes, in
//! order, each verified in every build as the graph is after every pass.
//!
//! 1. `fuse` (with `layout`): the graph cut into kernels that read views
//!    in place, `kernel::Program` (`Program::verify`);
//! 2. `select`: what runs each kernel on the target, `select::Selection`
//!    (`Selection::verify`);
//! 3. `plan`: the arena and every launch at the step's sizes, `plan::Plan`
//!    (`Plan::verify`).
//!
//! Each stage's function runs its verifier itself, so a result is checked
//! whoever asks for it; a failure is an internal error (fusion and
//! selection panic, the plan returns it).
//!
//! `fusec build --dump-after layout|fuse|select|plan` prints each stage's
//! result; the optimisations inside them (`optimisation::Optimisation`) can be
//! turned off one by one with `--disable-pass`.

use crate::ir::graph::Role;
use crate::ir::Graph;
use crate::kernel::fuse::fuse_with;
use crate::kernel::Program;
use crate::plan::roofline::step_flops;
use crate::plan::{plan_with, CompiledStep, Plan, PlanError, StepParam};
use crate::select::{select_at, Selection, Target};
use std::collections::BTreeMap;

/// What the kernel stages made of a step.
pub struct Lowered {
    pub program: Program,
    pub selection: Selection,
    pub plan: Plan,
}

/// Fusion and kernel selection for `target` (`source` is the model file,
/// for the kernels' comments), at the step's sizes where they are known
/// (`dims`: some kernels are chosen by them, `select::select_at`).
pub fn select_kernels(
    g: &Graph,
    target: &Target,
    source: Option<&str>,
    dims: Option<&BTreeMap<String, i64>>,
) -> (Program, Selection) {
    let program = fuse_with(g, &target.lower);
    let selection = select_at(g, &program, target, source, dims);
    (program, selection)
}

/// Every kernel stage of `g` at the sizes `dims`, each verified.
pub fn lower(
    g: &Graph,
    target: &Target,
    dims: &BTreeMap<String, i64>,
    source: Option<&str>,
) -> Result<Lowered, PlanError> {
    let (program, selection) = select_kernels(g, target, source, Some(dims));
    let plan = plan_with(g, &program, Some(&selection), dims)?;
    Ok(Lowered {
        program,
        selection,
        plan,
    })
}

impl Lowered {
    /// The step the runtime runs: this lowering's plan and sources, with
    /// what the runtime needs of `g` (its parameters and their gradients'
    /// buffers) and of the program (the step's FLOPs) as data; and the
    /// program, for what describes the step (trace labels, the roofline).
    pub fn into_step(self, g: &Graph) -> (CompiledStep, Program) {
        let params = g
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| StepParam {
                name: p.name.clone(),
                numel: p.numel(),
                grad: g
                    .output(&Role::Grad(i))
                    .and_then(|v| self.program.buffer_of(v)),
            })
            .collect();
        let flops = step_flops(g, &self.program, &self.plan);
        let step = CompiledStep {
            plan: self.plan,
            sources: self.selection.sources,
            params,
            target: self.selection.target,
            flops,
        };
        (step, self.program)
    }
}
