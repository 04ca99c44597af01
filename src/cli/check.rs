//! `fusec check`: parse, elaborate and differentiate; print what a person
//! needs to know about the model before building it.

use super::common::{load, thousands, ModelArgs};
use super::CliError;
use clap::Args;
use fusec_compiler::ir::graph::Phase;
use fusec_compiler::ir::types::shape_string;
use std::fmt::Write;

#[derive(Args, Debug)]
pub struct CheckArgs {
    #[command(flatten)]
    pub model: ModelArgs,
}

pub fn run(args: &CheckArgs) -> Result<(), CliError> {
    let loaded = load(&args.model)?;
    print!(
        "{}",
        summary(&loaded.compiled, &loaded.path.display().to_string())
    );
    Ok(())
}

pub fn summary(c: &fusec_compiler::driver::Compiled, path: &str) -> String {
    let m = &c.model;
    let g = &m.graph;
    let mut out = String::new();
    let _ = writeln!(out, "model {} ({path})", g.name);
    if !g.dims.is_empty() {
        let _ = writeln!(out, "symbolic dimensions: {}", g.dims.join(", "));
    }
    let _ = writeln!(out, "\ninputs:");
    for (name, ty) in m.inputs() {
        let _ = writeln!(out, "  {name:<20} {ty}");
    }
    let name_w = g
        .params
        .iter()
        .map(|p| p.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let shape_w = g
        .params
        .iter()
        .map(|p| shape_string(&p.ty.shape).len())
        .max()
        .unwrap_or(5)
        .max(5);
    let _ = writeln!(out, "\nparameters:");
    let _ = writeln!(
        out,
        "  {:<name_w$}  {:<shape_w$}  {:>13}",
        "name", "shape", "count"
    );
    for p in &g.params {
        let count = p.ty.numel().as_const().map_or("?".into(), thousands);
        let _ = writeln!(
            out,
            "  {:<name_w$}  {:<shape_w$}  {:>13}",
            p.name,
            shape_string(&p.ty.shape),
            count
        );
    }
    match g.param_count() {
        Some(total) => {
            let mib = total as f64 * 4.0 / (1024.0 * 1024.0);
            let _ = writeln!(
                out,
                "\ntotal: {} parameters in {} tensors ({mib:.1} MiB in f32)",
                thousands(total),
                g.params.len()
            );
        }
        None => {
            let _ = writeln!(out, "\ntotal: too many parameters to count in 64 bits");
        }
    }
    let t = &m.train;
    let clip = t
        .clip_grad_norm
        .map_or("no clipping".into(), |c| format!("clip grad norm {c}"));
    let mb = if t.micro_batches == 1 {
        "1 micro-batch".to_string()
    } else {
        format!("{} micro-batches", t.micro_batches)
    };
    let _ = writeln!(
        out,
        "training: {}, {clip}, {} compute, {mb}",
        t.optimizer, t.precision
    );
    if t.schedule != Default::default() {
        let _ = writeln!(out, "learning rate: {}", t.schedule.describe());
    }
    let count = |p: Phase| c.training.g.node_weights().filter(|n| n.phase == p).count();
    let _ = writeln!(
        out,
        "step graph: {} ops forward, {} backward, {} update",
        count(Phase::Forward),
        count(Phase::Backward),
        count(Phase::Update)
    );
    let passes: Vec<String> = c
        .pass_stats
        .iter()
        .map(|(name, st)| format!("{name} {}", st.rewrites))
        .collect();
    let _ = writeln!(
        out,
        "after passes: {} ops ({})",
        c.optimized.g.node_count(),
        passes.join(", ")
    );
    out
}
