//! `fusec bench` and `fusec bench-attention`: the compiled step and the
//! attention kernels timed on a GPU.

use super::common::{fit_memory, load, load_ranks, BudgetArgs, Loaded, ModelArgs, SizeArgs};
use super::open::{runtime_err, start};
use super::CliError;
use clap::Args;
use fusec::backend::GpuOptions;
use fusec::backend::{self, Backend};
use fusec_compiler::ir::dim::{BATCH, SEQ};
use fusec_compiler::ir::types::DType;
use fusec_compiler::plan::roofline::{estimate, Device, Estimate};
use fusec_compiler::plan::trace::Timing;
use fusec_runtime::device;
use fusec_runtime::exec::LaunchTime;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sizes: SizeArgs,
    #[command(flatten)]
    pub budget: BudgetArgs,
    /// Timed steps (after three warm-up steps)
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: u64,
    /// Also time every kernel of one step and print the costliest (and
    /// write all of them, as JSON lines, to this file). With --gpus: every
    /// rank's launches and each gradient bucket's collective beside them,
    /// and how long the step waits for the collectives
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// Also write one step as a Chrome trace (open it in
    /// https://ui.perfetto.dev or chrome://tracing): phases and every
    /// launch with its source lines, bytes, FLOPs and achieved rate
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Peak dense bf16 rate for MFU, in TFLOP/s (default: the GPU's datasheet figure when known)
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Time the deterministic step (as `fusec train --deterministic` runs it)
    #[arg(long)]
    pub deterministic: bool,
    /// f32 products as `fusec train --tf32` or `--exact-f32` run them
    #[command(flatten)]
    pub f32: super::f32_math::F32Args,
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    #[command(flatten)]
    pub parallel: super::parallel::ParallelArgs,
    /// Attention `lengths` inputs: every sequence full length (the step as
    /// unpadded data runs it), or random lengths (padded batches, whose
    /// padded key tiles attention skips)
    #[arg(long, value_enum, default_value_t = LengthsFill::Full)]
    pub lengths: LengthsFill,
}

/// What `fusec bench` feeds attention's `lengths`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum LengthsFill {
    Full,
    Random,
}

#[derive(Args, Debug)]
pub struct BenchAttentionArgs {
    /// Head dimensions to sweep
    #[arg(long, value_delimiter = ',', default_value = "64,80,96,128,256")]
    pub head_dims: Vec<usize>,
    /// Sequence lengths to sweep (B = 16384 / T, H = 2048 / D, as torch_reference.py --attn-sweep)
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,8192")]
    pub seqs: Vec<usize>,
    /// Sequences per batch (default 16384 / T, so every T moves the same tokens)
    #[arg(long)]
    pub batch: Option<usize>,
    /// Keys per sequence, S (default T): cross-attention where it differs
    #[arg(long)]
    pub kv_seq: Option<usize>,
    /// Query heads per key/value head (grouped-query attention; the heads
    /// are rounded down to a multiple of it)
    #[arg(long, default_value_t = 1)]
    pub group: usize,
    /// The masks to time: causal, none, or both (`causal,none`)
    #[arg(long, value_delimiter = ',', default_value = "causal")]
    pub masks: Vec<MaskArg>,
    /// What q, k, v and their gradients are: bf16, or f32 (on TF32 tensor
    /// cores, 3xTF32 products; as torch_reference.py --dtype float32)
    #[arg(long, value_enum, default_value_t = AttnPrecision::Bf16)]
    pub precision: AttnPrecision,
    /// The simple attention forward instead of the tensor-core one
    #[arg(long)]
    pub simple: bool,
    /// The tensor-core backward without atomics (as `fusec train
    /// --deterministic` runs it)
    #[arg(long)]
    pub deterministic: bool,
    /// f32 in one TF32 product instead of three (as `fusec train --tf32`)
    #[arg(long)]
    pub tf32: bool,
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
}

/// The element type `fusec bench-attention` times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AttnPrecision {
    Bf16,
    F32,
}

/// An attention mask `fusec bench-attention` times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MaskArg {
    Causal,
    None,
}

/// One JSON line per configuration, as torch_reference.py --attn-sweep prints.
pub fn bench_attention(args: &BenchAttentionArgs) -> Result<(), CliError> {
    // The sizes first: a mistake is a usage error with or without a GPU.
    if args.head_dims.contains(&0)
        || args.seqs.contains(&0)
        || args.batch == Some(0)
        || args.kv_seq == Some(0)
        || args.group == 0
    {
        return Err(CliError::usage(
            "error: head dims, sequence lengths, the batch and the group must be positive",
        ));
    }
    let gpu = device::open(args.gpu).map_err(runtime_err)?;
    let causal: Vec<bool> = args.masks.iter().map(|m| *m == MaskArg::Causal).collect();
    for &d in &args.head_dims {
        for &t in &args.seqs {
            for &c in &causal {
                let cfg = super::attn_bench::Config::sweep(
                    d,
                    t,
                    args.kv_seq,
                    args.batch,
                    args.group,
                    c,
                    match args.precision {
                        AttnPrecision::Bf16 => DType::BF16,
                        AttnPrecision::F32 => DType::F32,
                    },
                );
                let r =
                    super::attn_bench::run(&gpu, cfg, !args.simple, args.deterministic, args.tf32)
                        .map_err(runtime_err)?;
                println!("{}", r.json());
            }
        }
    }
    Ok(())
}

pub fn bench(args: &BenchArgs) -> Result<(), CliError> {
    let job = super::parallel::job(&args.parallel)?;
    if job.world() > 1 {
        if args.trace.is_some() {
            return Err(CliError::usage(
                "error: --trace draws one GPU's step launch by launch; run it without --gpus (or a launcher). With --gpus, --profile times each rank's launches and collectives".to_string(),
            ));
        }
        return bench_ranks(args, &job);
    }
    let (loaded, dims) = load_fitted(args)?;
    let (mut b, about) = open_step(args, &loaded, &dims)?;
    for step in 1..=3 {
        b.step(1e-4, step).map_err(runtime_err)?;
    }
    let s = &mut b;
    let ms = time_steps(s, args.steps)?;
    print_summary(s, &about, &dims, ms, args.peak_tflops)?;
    if let Some(note) = &s.session.graph_note {
        eprintln!("note: {note}");
    }
    if args.profile.is_some() || args.trace.is_some() {
        let times = s.session.exec.profile_step().map_err(runtime_err)?;
        let source = Some((
            loaded.path.to_str().unwrap_or("model"),
            loaded.source.as_str(),
        ));
        let labels = fusec_compiler::plan::trace::labels(&s.graph, &s.program, source);
        let est = estimate(
            &s.graph,
            &s.program,
            &s.session.plan,
            roofline_device(&s.session.exec.gpu.name),
        );
        if let Some(path) = &args.profile {
            super::profile::write_for(path, s, &times, &labels, &est)?;
        }
        if let Some(path) = &args.trace {
            let title = format!(
                "fusec bench {} {} on {about}",
                s.graph.name,
                serde_json::json!(dims)
            );
            write_trace(path, s, &times, source, &est, &title)?;
        }
    }
    Ok(())
}

/// The model loaded for one GPU and fitted to the memory budget, and its
/// sizes.
fn load_fitted(args: &BenchArgs) -> Result<(Loaded, BTreeMap<String, i64>), CliError> {
    let mut loaded = load(&args.model)?;
    let dims = args.sizes.resolve_all(&loaded.compiled.optimized.dims)?;
    super::common::check_sizes(&loaded, &dims)?;
    super::common::announce_fitted(
        fit_memory(
            &mut loaded,
            &args.budget,
            &dims,
            1,
            false,
            super::common::planning_device(device::gpu_name(args.gpu).as_deref()),
            args.deterministic,
        )?,
        &loaded,
    );
    Ok((loaded, dims))
}

/// The step loaded on the GPU with weights drawn from seed 1 and random
/// values in every input, and what the GPU is.
fn open_step(
    args: &BenchArgs,
    loaded: &Loaded,
    dims: &BTreeMap<String, i64>,
) -> Result<(backend::Gpu, String), CliError> {
    let options = GpuOptions {
        deterministic: args.deterministic,
        f32_math: args.f32.math(),
    };
    let (s, about) = start(loaded, dims, device::Opening::here(args.gpu), options)?;
    let dmap = dims.iter().map(|(k, v)| (k.clone(), *v)).collect();
    let mut feeds = fusec_compiler::interp::random::random_feeds(&s.graph, &dmap, 1)
        .map_err(|e| CliError::usage(format!("error: {}", e.0)))?;
    if args.lengths == LengthsFill::Full {
        fusec_compiler::interp::random::fill_lengths_full(&s.graph, &mut feeds);
    }
    let mut b = s;
    backend::init_params(&mut b, 1).map_err(runtime_err)?;
    // Every input, the update's included: each timed launch is one
    // micro-batch whose update is applied (`update.apply` = 1), at a loss
    // scale of 1.
    let names: Vec<String> = b.session.exec.inputs.keys().cloned().collect();
    for name in &names {
        b.set(name, &feeds.inputs[name].data).map_err(runtime_err)?;
    }
    Ok((b, about))
}

/// The mean time of a step, in ms, over `steps` launched back to back.
fn time_steps(s: &mut backend::Gpu, steps: u64) -> Result<f64, CliError> {
    let t0 = Instant::now();
    for _ in 0..steps {
        s.session.exec.run_step().map_err(runtime_err)?;
    }
    s.session.exec.synchronize().map_err(runtime_err)?;
    Ok(t0.elapsed().as_secs_f64() * 1e3 / steps as f64)
}

/// The JSON line of the timing: rates, MFU against `peak_tflops` (or the
/// datasheet's), and memory.
fn print_summary(
    s: &backend::Gpu,
    about: &str,
    dims: &BTreeMap<String, i64>,
    ms: f64,
    peak_tflops: Option<f64>,
) -> Result<(), CliError> {
    let tokens = dims.get(BATCH).copied().unwrap_or(1) * dims.get(SEQ).copied().unwrap_or(1);
    let flops = s.session.flops;
    let tflops = flops / (ms / 1e3) / 1e12;
    let peak = peak_tflops.or_else(|| datasheet_peak(&s.session.exec.gpu.name));
    let used =
        s.session.exec.gpu.total_bytes - s.session.exec.gpu.free_bytes().map_err(runtime_err)?;
    let gib = |b: u64| digits(b as f64 / (1u64 << 30) as f64, 3);
    println!(
        "{}",
        serde_json::json!({
            "model": s.graph.name,
            "device": about,
            "dims": dims,
            "ms_per_step": digits(ms, 3),
            "tokens_per_s": (tokens as f64 / (ms / 1e3)).round() as i64,
            "tflops": digits(tflops, 1),
            "mfu": peak.map(|p| digits(tflops / p, 3)),
            "peak_memory_gib": gib(used),
            "step_memory_gib": gib(used.saturating_sub(s.session.exec.gpu.used_at_open)),
            "plan_arena_gib": gib(s.session.plan.arena_bytes),
            "cuda_graph": s.session.exec.has_graph(),
            // How cuBLASLt's algorithms were chosen (runtime/src/gemm_tuning.rs).
            "gemm_algos": s.session.exec.gemm_tuning_stats().map(|t| serde_json::json!({
                "timed": t.timed,
                "from_cache": t.cached,
                "not_first_choice": t.changed,
                "untimed": t.untimed,
            })),
        })
    );
    Ok(())
}

/// `--trace`: the step as a Chrome trace, and its picture beside it.
fn write_trace(
    path: &Path,
    s: &backend::Gpu,
    times: &[LaunchTime],
    source: Option<(&str, &str)>,
    est: &Estimate,
    title: &str,
) -> Result<(), CliError> {
    let timings: Vec<Timing> = times
        .iter()
        .map(|t| Timing {
            start_ms: t.start_ms,
            ms: t.ms,
        })
        .collect();
    let trace = fusec_compiler::plan::trace::chrome_trace(
        &s.graph,
        &s.program,
        &s.session.plan,
        est,
        source,
        &timings,
        title,
    );
    let picture = path.with_extension("svg");
    for (to, text) in [
        (path, trace.to_string()),
        (picture.as_path(), fusec_compiler::plan::trace::svg(&trace)),
    ] {
        std::fs::write(to, text)
            .map_err(|e| CliError::usage(format!("error: cannot write {}: {e}", to.display())))?;
    }
    eprintln!(
        "wrote {} ({} launches; open it in https://ui.perfetto.dev or chrome://tracing) and its picture {}",
        path.display(),
        times.len(),
        picture.display()
    );
    Ok(())
}

/// `fusec bench --gpus N` (or under a launcher): every rank steps at once;
/// the step time is the slowest rank's, the tokens every rank's together.
fn bench_ranks(args: &BenchArgs, job: &super::parallel::Job) -> Result<(), CliError> {
    use super::parallel;
    let world = job.world();
    let mut loaded = load_ranks(&args.model, world as u32, args.parallel.reduce_dtype)?;
    args.parallel
        .shape_buckets(&mut loaded.compiled.options.lower);
    let dims = args.sizes.resolve_all(&loaded.compiled.optimized.dims)?;
    super::common::check_sizes(&loaded, &dims)?;
    // Under ZeRO each rank compiles its own step, which `start` fits.
    let zero = args.parallel.zero(job, &loaded.compiled.optimized.params)?;
    super::common::announce_fitted(
        fit_memory(
            &mut loaded,
            &args.budget,
            &dims,
            world as u32,
            zero.is_some(),
            fusec_compiler::device::DEFAULT,
            args.deterministic,
        )?,
        &loaded,
    );
    let loaded = loaded;
    let options = GpuOptions {
        deterministic: args.deterministic,
        f32_math: args.f32.math(),
    };
    let mut ranks = parallel::start(
        &loaded, &dims, job, args.gpu, false, options, "random", zero,
    )?;
    let whole = parallel::whole_batch(&dims, world);
    let dmap = whole.iter().map(|(k, v)| (k.clone(), *v)).collect();
    let mut feeds = fusec_compiler::interp::random::random_inputs(ranks.graph(), &dmap, 1, 0)
        .map_err(|e| CliError::usage(format!("error: {}", e.0)))?;
    if args.lengths == LengthsFill::Full {
        fusec_compiler::interp::random::fill_lengths_full(ranks.graph(), &mut feeds);
    }
    backend::init_params(&mut ranks, 1).map_err(runtime_err)?;
    let names: Vec<String> = feeds
        .inputs
        .keys()
        .filter(|n| ranks.shapes().contains_key(*n))
        .cloned()
        .collect();
    for name in &names {
        ranks
            .set(name, &feeds.inputs[name].data)
            .map_err(runtime_err)?;
    }
    for step in 1..=3 {
        ranks.step(1e-4, step).map_err(runtime_err)?;
    }
    let steps = args.steps;
    let times = ranks
        .try_each(move |_, b| b.time_steps(steps))
        .map_err(runtime_err)?;
    let ms = times.iter().copied().fold(0.0, f64::max);
    let memory = ranks
        .try_each(|_, b| b.memory_used())
        .map_err(runtime_err)?;
    let peak = memory.iter().flatten().copied().max().unwrap_or(0);
    let tokens = whole.get(BATCH).copied().unwrap_or(1) * whole.get(SEQ).copied().unwrap_or(1);
    if let Some(path) = &args.profile {
        let profiles = ranks
            .try_each(|_, b| b.profile_step_full())
            .map_err(runtime_err)?;
        let local: Vec<(usize, fusec_runtime::exec::StepProfile)> = ranks
            .local_ranks()
            .into_iter()
            .zip(profiles)
            .filter_map(|(r, p)| p.map(|p| (r, p)))
            .collect();
        // Under a launcher each process holds its own ranks: rank 0's
        // process writes the file (and prints), the others keep theirs.
        if job.writes() {
            super::comm_profile::write(path, &local)?;
        }
    }
    if job.writes() {
        println!(
            "{}",
            serde_json::json!({
                "model": ranks.graph().name,
                "gpus": world,
                "zero": zero.map_or(0, |z| z.stage.number()),
                "shard_group": zero.map_or(world as u32, |z| z.group),
                "ranks_here": ranks.local_ranks().len(),
                "dims_per_gpu": dims,
                "ms_per_step": digits(ms, 3),
                "tokens_per_s": (tokens as f64 / (ms / 1e3)).round() as i64,
                "tokens_per_s_per_gpu": (tokens as f64 / (ms / 1e3) / world as f64).round() as i64,
                "peak_memory_gib_per_gpu": digits(peak as f64 / (1u64 << 30) as f64, 3),
                "rank_ms": times.iter().map(|&t| digits(t, 3)).collect::<Vec<_>>(),
            })
        );
    }
    Ok(())
}

/// The roofline's figures for the GPU by its name (an H100's where unknown).
pub(super) fn roofline_device(name: &str) -> Device {
    fusec_compiler::plan::roofline::device_of_gpu(name)
}

/// `x` to `places` decimals, as the JSON line prints it.
fn digits(x: f64, places: i32) -> f64 {
    let k = 10f64.powi(places);
    (x * k).round() / k
}

/// Dense bf16 tensor-core TFLOP/s from the device table's datasheet
/// figures, for MFU; none for a GPU the table does not know.
fn datasheet_peak(name: &str) -> Option<f64> {
    fusec_compiler::device::find_gpu(name).map(|d| d.tensor_flops / 1e12)
}
