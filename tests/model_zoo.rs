//! Models nobody chose (tests/common/zoo.rs draws them, one a seed): each
//! must check, build for a Hopper and a consumer GPU with every kernel
//! runnable and compiled by NVRTC (no spills, no local arrays), pass the f64 finite-difference gradient check, and run its
//! whole step on the host (every kernel and GEMM in plan order in one
//! arena) to the interpreter's results. Seeds 0..50 by default;
//! `FUSEC_ZOO_SEEDS=200` (or `A..B`, or a list) draws others, and
//! `FUSEC_ZOO_WRITE=DIR` keeps the model files, and `FUSEC_ZOO_FILES=A,B`
//! checks such files (changed by hand, say) in place of drawn ones.

mod common;

use common::{host, step_host, update_reference, zoo};
use fusec_compiler::driver::{compile, Compiled};
use fusec_compiler::elaborate::Options;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::plan::plan_with;
use fusec_compiler::select::{select, Choice, Target};
use fusec_runtime::nvrtc;
use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;

/// The devices each drawn model is built for: Hopper's attention kernels,
/// and the mma.sync ones in a consumer GPU's 99 KiB of shared memory.
const DEVICES: &[(&str, &str)] = &[("h100", "sm_90a"), ("rtx3090", "sm_86")];

/// Builds `c` for `device` at `dims`: every kernel has code and the plan
/// places every buffer. Returns the sources to compile.
fn build_for(
    c: &Compiled,
    device: &str,
    dims: &[(&str, i64)],
) -> Result<Vec<(String, String)>, String> {
    let g = &c.optimized;
    let program = fuse(g);
    let target = Target::for_device(device, false).expect("a known device");
    let selection = select(g, &program, &target, None);
    let missing: Vec<&str> = program
        .kernels
        .iter()
        .zip(&selection.choices)
        .filter(|(_, c)| matches!(c, Choice::Missing))
        .map(|(k, _)| k.name.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(format!("{device}: no code for {}", missing.join(", ")));
    }
    let sizes: BTreeMap<String, i64> = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    plan_with(g, &program, Some(&selection), &sizes)
        .map_err(|e| format!("{device}: plan: {e:?}"))?;
    Ok(selection.sources)
}

/// Sources already compiled for an architecture (the name replaced by
/// `KERNEL`): the same instance drawn twice compiles once.
type Seen = Mutex<HashSet<(String, String)>>;

/// Compiles every kernel of a build with NVRTC for `arch`: no errors, no
/// spills, no arrays in local memory. Returns how many were new.
fn compile_for(sources: &[(String, String)], arch: &str, seen: &Seen) -> Result<usize, String> {
    let mut compiled = 0;
    for (name, text) in sources {
        let key = (arch.to_string(), text.replace(name.as_str(), "KERNEL"));
        if !seen.lock().unwrap().insert(key) {
            continue;
        }
        let cubin = nvrtc::compile(name, text, arch).map_err(|e| format!("{arch}: {e}"))?;
        if cubin.spill_store_bytes > 0 || cubin.spill_load_bytes > 0 {
            return Err(format!("{name} ({arch}) spills:\n{}", cubin.log));
        }
        if cubin.local_arrays() {
            return Err(format!(
                "{name} ({arch}) keeps an array in local memory:\n{}",
                cubin.log
            ));
        }
        compiled += 1;
    }
    Ok(compiled)
}

/// Every check of one drawn model; the first that fails, as a message.
fn check_one(
    m: &zoo::Drawn,
    work: &std::path::Path,
    cxx: bool,
    nvrtc_on: bool,
    seen: &Seen,
) -> Result<String, String> {
    let c = compile(&m.source, &m.name, &Options::default())
        .map_err(|f| format!("does not compile:\n{}", f.render(&m.name, &m.source)))?;
    let dims = m.dims();
    let mut kernels = 0;
    for (device, arch) in DEVICES {
        let sources = build_for(&c, device, &dims)?;
        if nvrtc_on {
            kernels += compile_for(&sources, arch, seen)?;
        }
    }
    let report = common::gradcheck(&c, &dims, 7, 3).map_err(|e| format!("gradient check: {e}"))?;
    if report.checked == 0 {
        return Err("the gradient check checked nothing".into());
    }
    if let Some(f) = report.failures.first() {
        return Err(format!(
            "gradient check: {f} ({} failures)",
            report.failures.len()
        ));
    }
    match update_reference::check(&c, &dims).map_err(|e| format!("update reference: {e}"))? {
        update_reference::Verdict::Matches => {}
        update_reference::Verdict::Differs(e) => return Err(format!("update: {e}")),
    }
    let step = if cxx {
        let out =
            step_host::run_step(work, &m.name, &c, &dims).map_err(|e| format!("host step: {e}"))?;
        format!(
            "{} launches, worst {:.2} of its bound, updates {:.1e} of their norm",
            out.launches, out.worst, out.updates
        )
    } else {
        "host step not run".into()
    };
    Ok(format!(
        "{} gradient entries (max rel error {:.1e}), {step}, {kernels} new kernels compiled",
        report.checked, report.max_rel_err
    ))
}

#[test]
fn drawn_models_check_build_and_match_the_interpreter() {
    let cxx = host::have_cxx();
    let nvrtc_on = common::nvrtc_ready();
    let seen: Seen = Mutex::new(HashSet::new());
    let work = host::work_dir("zoo");
    let models: Vec<zoo::Drawn> = match zoo::files() {
        Some(files) => files,
        None => zoo::seeds(50).into_iter().map(zoo::draw).collect(),
    };
    let next = Mutex::new(models.into_iter().enumerate());
    let results = Mutex::new(Vec::new());
    // Two workers: the host compiles dominate, and CI has two cores.
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let Some((i, m)) = next.lock().unwrap().next() else {
                    break;
                };
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    check_one(&m, &work, cxx, nvrtc_on, &seen)
                }))
                .unwrap_or_else(|p| {
                    let why = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    Err(format!("panicked: {why}"))
                });
                results.lock().unwrap().push((i, m, r));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|r| r.0);
    let mut failures = Vec::new();
    for (_, m, r) in &results {
        match r {
            Ok(line) => println!("{}: {line}\n    {}", m.name, m.summary),
            Err(e) => failures.push(format!(
                "{} ({}), sizes {:?}: {e}\n--- model ---\n{}",
                m.name, m.summary, m.dims, m.source
            )),
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    assert!(
        failures.is_empty(),
        "{} of {} drawn models failed (FUSEC_ZOO_SEEDS=<seed> reruns one):\n\n{}",
        failures.len(),
        results.len(),
        failures.join("\n\n")
    );
}
