//! `fusec explain model.dsl --line N` (or `--name PARAM`): from a line of
//! the model file to what it costs. The ops that line made (forward, their
//! gradients, the update), the kernels that hold them with what else each
//! holds, and for each kernel its bytes and the roofline's time at the
//! sizes given, and the time measured where a `fusec bench --profile` file
//! is given.

use super::common::{load, ModelArgs, SizeArgs};
use super::CliError;
use clap::Args;
use fusec_compiler::ir::print::line_col;
use fusec_compiler::kernel::fuse::fuse_with;
use fusec_compiler::plan::plan;
use fusec_compiler::plan::roofline::estimate;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ExplainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The model file's line to explain
    #[arg(
        long,
        value_name = "N",
        conflicts_with = "name",
        required_unless_present = "name"
    )]
    pub line: Option<usize>,
    /// A parameter to explain instead (its ops: everything that reads it)
    #[arg(long, value_name = "PARAM")]
    pub name: Option<String>,
    #[command(flatten)]
    pub sizes: SizeArgs,
    /// Kernel times from `fusec bench --profile FILE` (JSON lines)
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
}

pub fn run(args: &ExplainArgs) -> Result<(), CliError> {
    let loaded = load(&args.model)?;
    print!("{}", explain(args, &loaded)?);
    Ok(())
}

fn explain(args: &ExplainArgs, loaded: &super::common::Loaded) -> Result<String, CliError> {
    let g = &loaded.compiled.optimized;
    let src = &loaded.source;
    let file = loaded.path.display().to_string();
    // The lines an op computes: its own, and those a pass merged into it
    // (q's, k's and v's projections as one product).
    let lines_of = |node: &fusec_compiler::ir::graph::Node| -> Vec<usize> {
        node.span.map_or_else(Vec::new, |s| {
            g.places(s)
                .iter()
                .map(|p| line_col(src, p.start).0)
                .collect()
        })
    };
    // The ops asked about.
    let (what, picked): (String, BTreeSet<_>) = match (&args.line, &args.name) {
        (Some(0), _) => return Err(CliError::usage("error: --line counts from 1".to_string())),
        (Some(l), _) => {
            let lines: Vec<&str> = src.lines().collect();
            let text = lines.get(l.wrapping_sub(1)).ok_or_else(|| {
                CliError::usage(format!(
                    "error: {file} has {} lines; --line {l} is past the end",
                    lines.len()
                ))
            })?;
            let picked =
                g.g.node_indices()
                    .filter(|&n| lines_of(&g.g[n]).contains(l) && !g.g[n].op.is_source())
                    .collect();
            (format!("{file}:{l}  {}", text.trim()), picked)
        }
        (None, Some(name)) => {
            let p = g.params.iter().find(|p| &p.name == name).ok_or_else(|| {
                let names: Vec<&str> = g.params.iter().take(6).map(|p| p.name.as_str()).collect();
                CliError::usage(format!(
                    "error: {file} has no parameter `{name}` (e.g. {}; `fusec check` lists them all)",
                    names.join(", ")
                ))
            })?;
            let picked = g
                .users(fusec_compiler::ir::Value {
                    node: p.node,
                    port: 0,
                })
                .into_iter()
                .map(|(n, _)| n)
                .collect();
            (format!("parameter {name} {}", p.ty), picked)
        }
        (None, None) => {
            return Err(CliError::usage(
                "error: give --line N or --name PARAM".to_string(),
            ))
        }
    };
    let mut out = String::new();
    let _ = writeln!(out, "{what}");
    if picked.is_empty() {
        let _ = writeln!(
            out,
            "  no op of the training step comes from it (a declaration, a comment, or folded away by a pass)"
        );
        return Ok(out);
    }
    // The ops, by phase.
    let mut by_phase: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for &n in &picked {
        let node = &g.g[n];
        by_phase.entry(node.phase.name()).or_default().push(format!(
            "{} {}",
            node.op.name(),
            node.outputs[0]
        ));
    }
    let _ = writeln!(out, "\nops ({}):", picked.len());
    for (phase, ops) in &by_phase {
        let mut counts: BTreeMap<&String, usize> = BTreeMap::new();
        for o in ops {
            *counts.entry(o).or_default() += 1;
        }
        for (o, k) in counts {
            let times = if k > 1 {
                format!(" x{k}")
            } else {
                String::new()
            };
            let _ = writeln!(out, "  {phase:<8} {o}{times}");
        }
    }
    // The kernels holding them, with bytes and times where sizes allow.
    let program = fuse_with(g, &loaded.compiled.options.lower);
    let dims = args.sizes.resolve(&g.dims)?;
    let costs = if super::common::missing(&dims, &g.dims).is_empty() {
        plan(g, &program, &dims)
            .ok()
            .map(|pl| estimate(g, &program, &pl, fusec_compiler::device::default_device()))
    } else {
        None
    };
    let measured: BTreeMap<String, f64> = match &args.profile {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| CliError::usage(format!("error: cannot read {}: {e}", p.display())))?
            .lines()
            .filter_map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).ok()?;
                Some((v["kernel"].as_str()?.to_string(), v["ms"].as_f64()?))
            })
            .collect(),
        None => BTreeMap::new(),
    };
    let kernels: Vec<usize> = (0..program.kernels.len())
        .filter(|&k| program.kernels[k].nodes.iter().any(|n| picked.contains(n)))
        .collect();
    let _ = writeln!(
        out,
        "\nkernels ({}){}:",
        kernels.len(),
        match &costs {
            Some(_) => ", bytes moved and the roofline's time on an H100 at these sizes",
            None => " (give --batch/--seq for bytes and times)",
        }
    );
    let (mut total_est, mut total_ms) = (0.0, 0.0);
    for &k in &kernels {
        let kernel = &program.kernels[k];
        let ours = kernel.nodes.iter().filter(|n| picked.contains(n)).count();
        let others: Vec<&str> = kernel
            .nodes
            .iter()
            .filter(|n| !picked.contains(n))
            .map(|&n| g.g[n].op.name())
            .collect();
        let with = if others.is_empty() {
            String::new()
        } else {
            format!(" with {}", dedup(&others).join(", "))
        };
        let mut line = format!(
            "  {:<28} {ours} of its {} ops{with}",
            kernel.name,
            kernel.nodes.len()
        );
        if let Some(c) = &costs {
            let kc = &c.kernels[k];
            total_est += kc.seconds;
            let _ = write!(
                line,
                "; {:.2} MiB, {:.1} us {}",
                kc.bytes / (1u64 << 20) as f64,
                kc.seconds * 1e6,
                if kc.compute_bound {
                    "(compute)"
                } else {
                    "(memory)"
                }
            );
        }
        if let Some(ms) = measured.get(&kernel.name) {
            total_ms += ms;
            let _ = write!(line, "; measured {ms:.3} ms");
        }
        let _ = writeln!(out, "{line}");
    }
    if costs.is_some() || !measured.is_empty() {
        let _ = write!(out, "\nin all:");
        if costs.is_some() {
            let _ = write!(out, " {:.1} us estimated", total_est * 1e6);
        }
        if !measured.is_empty() {
            let _ = write!(out, " {total_ms:.3} ms measured");
        }
        let _ = writeln!(out, " (whole kernels, the other ops they hold included)");
    }
    Ok(out)
}

fn dedup<'a>(names: &[&'a str]) -> Vec<&'a str> {
    let mut seen = Vec::new();
    for n in names {
        if !seen.contains(n) {
            seen.push(*n);
        }
    }
    seen
}
