//! The compiled step opened on a GPU, saying what it does, and the
//! runtime's errors as the command line's.

use super::common::Loaded;
use super::CliError;
use fusec::backend::{Gpu, GpuOptions};
use fusec_runtime::device;
use fusec_runtime::RuntimeError;
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

/// A runtime error: exit status 3.
pub(super) fn runtime_err(e: RuntimeError) -> CliError {
    CliError {
        message: format!("error: {e}"),
        code: 3,
    }
}

/// Plans and loads the compiled step on the GPU, saying what it does.
pub(super) fn start(
    loaded: &Loaded,
    dims: &BTreeMap<String, i64>,
    gpu: device::Opening,
    options: GpuOptions,
) -> Result<(Gpu, String), CliError> {
    start_graph(
        &loaded.compiled.optimized,
        &loaded.compiled.options.lower,
        &loaded.compiled.model.graph.name,
        dims,
        gpu,
        options,
        Some((&loaded.path.display().to_string(), &loaded.source)),
    )
}

/// A step of the model other than training's (`what` names it: "forward
/// only", "decode step", ...), on the CPU reference or on GPU `gpu`. On a
/// GPU the step has run once on zeros and been captured before it is
/// returned (`Session::warm_up`), so the first step a caller times or
/// waits for is like every other: the kernels' first loads, cuBLASLt's
/// choices and the capture (tens to hundreds of milliseconds) are paid
/// here, before the caller writes its weights.
pub(super) fn open_step(
    g: &fusec_compiler::ir::Graph,
    loaded: &Loaded,
    what: &str,
    dims: &BTreeMap<String, i64>,
    cpu: bool,
    gpu: usize,
) -> Result<Box<dyn fusec::backend::Backend>, CliError> {
    if cpu {
        let precision = fusec_compiler::interp::Precision::AsStored;
        let cpu = fusec::backend::Cpu::new(g, dims, precision).map_err(runtime_err)?;
        return Ok(Box::new(cpu));
    }
    let what = format!("{} ({what})", loaded.compiled.model.graph.name);
    let path = loaded.path.display().to_string();
    let (mut s, _) = start_graph(
        g,
        &loaded.compiled.options.lower,
        &what,
        dims,
        device::Opening::here(gpu),
        GpuOptions::default(),
        Some((path.as_str(), loaded.source.as_str())),
    )?;
    fusec::backend::Backend::warm_up(&mut s).map_err(runtime_err)?;
    Ok(Box::new(s))
}

/// [`start`] for any graph of the model (`what` names it in the messages).
pub(super) fn start_graph(
    g: &fusec_compiler::ir::Graph,
    lower: &fusec_compiler::optimisation::LowerOptions,
    what: &str,
    dims: &BTreeMap<String, i64>,
    gpu: device::Opening,
    options: GpuOptions,
    source: Option<(&str, &str)>,
) -> Result<(Gpu, String), CliError> {
    let t_open = gpu.started();
    let gpu = gpu.wait().map_err(runtime_err)?;
    fusec_runtime::startup::mark("GPU open");
    let about = format!(
        "{} ({}, {:.0} GiB)",
        gpu.name,
        gpu.arch(),
        gpu.total_bytes as f64 / (1u64 << 30) as f64
    );
    eprintln!(
        "{about}, opened in {:.1} s: compiling the kernels of {}",
        t_open.elapsed().as_secs_f64(),
        what
    );
    let t0 = Instant::now();
    let progress = |done: usize, total: usize| {
        if done == total || done.is_multiple_of(16) {
            eprint!("\r  kernels {done}/{total}");
            let _ = std::io::stderr().flush();
        }
    };
    let mut b = Gpu::open(
        gpu,
        g,
        lower,
        dims,
        Some(&fusec_runtime::cache::default_dir()),
        &progress,
        options,
    )
    .map_err(runtime_err)?;
    let s = &mut b.session;
    eprintln!(
        "\r  {} kernels ready in {:.1} s ({} distinct: {} from the cache, {} compiled); arena {:.2} GiB",
        s.kernels_generated,
        t0.elapsed().as_secs_f64(),
        s.cache.hits + s.cache.compiled,
        s.cache.hits,
        s.cache.compiled,
        s.plan.arena_bytes as f64 / (1u64 << 30) as f64
    );
    if fusec_runtime::marks::wanted() {
        let launches = fusec_compiler::plan::trace::labels(&b.graph, &b.program, source)
            .into_iter()
            .map(|(phase, label)| (phase.name(), label))
            .collect();
        s.exec
            .set_marks(fusec_runtime::marks::StepMarks { launches });
        s.use_graph = false;
        eprintln!(
            "  NVTX ranges on (a profiler is attached, or FUSEC_NVTX=1): each step, phase and kernel is a range, and the step runs launch by launch instead of as a CUDA graph"
        );
    }
    Ok((b, about))
}
