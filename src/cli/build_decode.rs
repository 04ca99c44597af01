//! `fusec build --decode`: the decode step `fusec generate` runs (greedy,
//! its weights kept as the passes read them), lowered for `--device` at
//! `--batch` rows of `--seq` new positions against caches of `--dim KV=N`
//! positions, written as a training build is: the kernels' CUDA C (with
//! the headers they include), plan.json and report.txt.

use super::build::{report_head, write, write_kernels, BuildArgs};
use super::common::Loaded;
use super::decoding::{prepare, Codec, Prepared, StepOptions};
use super::CliError;
use fusec_compiler::decode::CACHE_DIM;
use fusec_compiler::ir::dim;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Cache positions where `--dim KV=N` is not given.
const DEFAULT_POSITIONS: i64 = 256;

pub(super) fn run(
    args: &BuildArgs,
    loaded: &Loaded,
    target: fusec_compiler::select::Target,
) -> Result<(), CliError> {
    let declared = [dim::BATCH, dim::SEQ, CACHE_DIM].map(String::from);
    let given = args.sizes.resolve(&declared)?;
    let at = |name: &str, default: i64| given.get(name).copied().unwrap_or(default);
    let (batch, rows, positions) = (
        at(dim::BATCH, 1),
        at(dim::SEQ, 1),
        at(CACHE_DIM, DEFAULT_POSITIONS),
    );
    if rows > positions {
        return Err(CliError::usage(format!(
            "error: --seq {rows} new positions a step do not fit caches of {positions} (--dim {CACHE_DIM}=N)"
        )));
    }
    // The step as `fusec generate` prepares it, for a prompt of one token
    // continued to the caches' end.
    let Prepared { step, .. } = prepare(
        loaded,
        &Codec::Bytes,
        &[vec![0]],
        positions as usize - 1,
        "--decode",
        &format!("the caches (--dim {CACHE_DIM}={positions})"),
        StepOptions {
            greedy: true,
            weights_as_read: true,
        },
    )?;
    let dims = BTreeMap::from([
        (dim::BATCH.to_string(), batch),
        (dim::SEQ.to_string(), rows),
        (CACHE_DIM.to_string(), positions),
    ]);
    let file = loaded.path.display().to_string();
    let lowered = fusec_compiler::lowering::lower(&step, &target, &dims, Some(&loaded.source))
        .map_err(|e| CliError::usage(format!("error: {file}: the decode step: {e}")))?;
    // The kernels' folder makes the output folder too.
    let kdir = args.out.join("kernels");
    write_kernels(&kdir, &lowered.selection.sources)?;
    let mut written: Vec<PathBuf> = vec![kdir.join(format!(
        "*.cu ({} kernels for {})",
        lowered.selection.sources.len(),
        args.device
    ))];
    let p = args.out.join("plan.json");
    write(&p, &lowered.plan.to_json())?;
    written.push(p);
    let text = fusec_compiler::plan::report::report_with_source(
        &step,
        &lowered.program,
        &lowered.plan,
        step.g.node_count(),
        fusec_compiler::plan::roofline::device(&args.device).expect("checked by clap"),
        Some((&file, &loaded.source)),
        None,
    );
    let p = args.out.join("report.txt");
    write(&p, &text)?;
    written.push(p);
    println!(
        "the decode step of {file} (greedy, as fusec generate runs it): batch {batch}, {rows} new position{} a step, caches of {positions} positions\n",
        if rows == 1 { "" } else { "s" }
    );
    println!("{}", report_head(&text));
    println!("\nwrote:");
    for p in written {
        println!("  {}", p.display());
    }
    Ok(())
}
