//! `fusec train`: the compiled step run over the data, on a GPU or the CPU reference.

use super::common::{fit_memory, load_ranks, BudgetArgs, Loaded, ModelArgs, SizeArgs};
use super::parallel;
use super::schedule::ScheduleArgs;
use super::train_steps::{open_backend, open_log, set_weights, StepLine};
use super::CliError;
use clap::Args;
use fusec_runtime::backend::{self, Backend};
use fusec_runtime::batch_log::BatchLog;
use fusec_runtime::checkpoint;
use fusec_runtime::data::Prefetch;
use fusec_runtime::device;
use fusec_runtime::session::{Session, SessionOptions};
use fusec_runtime::RuntimeError;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Training data: an llm.c token shard (.bin), any other file as bytes
    /// (one token per byte), `random` (one fixed random batch) or
    /// `random-stream` (a fresh random batch every micro-batch: nothing to
    /// memorize)
    #[arg(long, value_name = "FILE")]
    pub data: String,
    /// Steps to run
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: u64,
    #[command(flatten)]
    pub sizes: SizeArgs,
    #[command(flatten)]
    pub budget: BudgetArgs,
    /// Learning rate (the model file's optimizer settings are used otherwise)
    #[arg(long)]
    pub lr: Option<f64>,
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Seed for the initial weights (and the random batch)
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Append one JSON line per step (step, lr, loss, grad_norm, ms, tokens_per_s)
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// GPU to use
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Run on the CPU with the reference interpreter (small models; for
    /// checking against the GPU or PyTorch)
    #[arg(long)]
    pub cpu: bool,
    /// Write a safetensors checkpoint here at the end (and every --save-every steps)
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// Also checkpoint every N steps
    #[arg(long, value_name = "N", requires = "save", value_parser = clap::value_parser!(u64).range(1..))]
    pub save_every: Option<u64>,
    /// Write the initial weights (before step 1) to this safetensors file
    #[arg(long, value_name = "FILE")]
    pub save_init: Option<PathBuf>,
    /// Continue from a checkpoint: weights, optimizer state, step count and
    /// data position, as if the run had not stopped
    #[arg(long, value_name = "FILE", conflicts_with = "init_from")]
    pub resume: Option<PathBuf>,
    /// Start from these weights (a `--save-init` file, a checkpoint, or what
    /// a PyTorch twin's `save_fusec` wrote): the parameters only, with fresh
    /// optimizer state, from step 1
    #[arg(long, value_name = "FILE")]
    pub init_from: Option<PathBuf>,
    /// Bit-for-bit repeatable runs: the attention backward recomputes its
    /// tiles for dQ instead of summing dQ with atomics (slower). Every other
    /// kernel is deterministic anyway (no atomics; each GEMM keeps the
    /// cuBLASLt algorithm chosen for it)
    #[arg(long)]
    pub deterministic: bool,
    /// Write the batches the run feeds to this safetensors file, each data
    /// input with a leading axis over the batches in the order fed (the one
    /// fixed batch of `--data random`; every micro-batch's windows of a
    /// token file), so that another implementation can train on exactly
    /// the same data
    #[arg(long, value_name = "FILE")]
    pub save_data: Option<PathBuf>,
    #[command(flatten)]
    pub parallel: super::parallel::ParallelArgs,
    #[command(flatten)]
    pub validation: super::validate::ValidationArgs,
    /// With --init-from: a name map (JSON: rename rules, tensors to
    /// transpose, tensors to drop) from another program's names to the
    /// model's, e.g. dsl-examples/maps/hf-gpt2.json
    #[arg(long, value_name = "MAP", requires = "init_from")]
    pub name_map: Option<PathBuf>,
    /// Tokenize the text of --data with this Hugging Face tokenizer.json
    /// (`fusec tokenize` writes shards once instead)
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
}

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
    gpu: usize,
    options: SessionOptions,
) -> Result<(Session, String), CliError> {
    start_graph(
        &loaded.compiled.optimized,
        &loaded.compiled.model.graph.name,
        dims,
        gpu,
        options,
        Some((&loaded.path.display().to_string(), &loaded.source)),
    )
}

/// [`start`] for any graph of the model (`what` names it in the messages).
pub(super) fn start_graph(
    g: &fusec_compiler::ir::Graph,
    what: &str,
    dims: &BTreeMap<String, i64>,
    gpu: usize,
    options: SessionOptions,
    source: Option<(&str, &str)>,
) -> Result<(Session, String), CliError> {
    let t_open = Instant::now();
    let gpu = device::open(gpu).map_err(runtime_err)?;
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
    let s = Session::with_options(
        gpu,
        g,
        dims,
        Some(&fusec_runtime::cache::default_dir()),
        &progress,
        options,
    )
    .map_err(runtime_err)?;
    eprintln!(
        "\r  {} kernels ready in {:.1} s ({} distinct: {} from the cache, {} compiled); arena {:.2} GiB",
        s.kernels_generated,
        t0.elapsed().as_secs_f64(),
        s.cache.hits + s.cache.compiled,
        s.cache.hits,
        s.cache.compiled,
        s.plan.arena_bytes as f64 / (1u64 << 30) as f64
    );
    let mut s = s;
    if fusec_runtime::marks::wanted() {
        let launches = fusec_compiler::plan::trace::labels(&s.graph, &s.program, source)
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
    Ok((s, about))
}

pub fn train(args: &TrainArgs) -> Result<(), CliError> {
    let job = parallel::job(&args.parallel)?;
    let world = job.world();
    let mut loaded = load_ranks(&args.model, world as u32)?;
    let lr = args
        .lr
        .unwrap_or(loaded.compiled.model.train.optimizer.lr());
    // Each rank's sizes; the data is fed for all of them together.
    let dims = args.sizes.resolve_all(&loaded.compiled.optimized.dims)?;
    super::common::check_sizes(&loaded, &dims)?;
    super::common::announce_budget(
        fit_memory(
            &mut loaded,
            &args.budget,
            &dims,
            world as u32,
            "h100",
            args.deterministic,
        )?,
        &loaded,
    );
    let loaded = loaded;
    let data_dims = parallel::whole_batch(&dims, world);
    // Only rank 0 of a launched job writes files and progress.
    let quiet = !job.writes();
    let mut args_here;
    let args = if quiet {
        args_here = args.clone();
        args_here.save = None;
        args_here.save_init = None;
        args_here.save_data = None;
        args_here.log = None;
        &args_here
    } else {
        args
    };
    // One GPU: the initial weights are drawn on the host while the GPU
    // opens and the kernels load.
    let drawing = (world == 1 && !args.cpu).then(|| {
        let g = loaded.compiled.optimized.clone();
        let seed = args.seed;
        std::thread::spawn(move || backend::draw_params(&g, seed))
    });
    let mut backend = open_backend(args, &loaded, &dims, &job)?;
    let b = backend.as_mut();
    let mut validation = super::validate::prepare(
        &args.validation,
        &loaded,
        &dims,
        args.tokenizer.as_deref(),
        args.cpu,
        args.gpu,
        world,
        token_bound(b.graph(), &dims),
    )?;
    let data_inputs: Vec<String> = b
        .shapes()
        .keys()
        .filter(|k| is_input(b.graph(), k) && !k.starts_with("update."))
        .cloned()
        .collect();
    if args.deterministic && !args.cpu {
        eprintln!(
            "deterministic: the attention backward runs without atomics and every other kernel is deterministic (GEMMs keep one cuBLASLt algorithm each), so a run repeats bit for bit on the same GPU and software"
        );
    }
    let resumed = set_weights(args, b, drawing)?;
    let first = resumed.as_ref().map_or(1, |ck| ck.step + 1);
    // Each optimizer step runs `micro` micro-batches of B rows, adding up
    // their gradients, and applies the update on the last.
    let micro = loaded.compiled.model.train.micro_batches.max(1) as u64;
    // Tokens per step: the rows of `tokens` where the model reads them.
    let tokens_shape = b.shapes().get("tokens").cloned();
    let tokens_per_step = tokens_shape
        .as_ref()
        .map_or(1, |s| s.iter().product::<usize>()) as i64
        * micro as i64;
    // Data: a token file feeds `tokens` and `targets`; `random` feeds every input once.
    let super::feed::Feed {
        batches,
        mut record,
    } = super::feed::prepare(
        args,
        b,
        &super::feed::Where {
            data_inputs: &data_inputs,
            data_dims: &data_dims,
            dims: &dims,
            tokens_shape: tokens_shape.as_deref(),
            micro,
            first,
            resumed: resumed.as_ref(),
        },
    )?;
    // The next batch into `tokens` and `targets`: copied to the GPU while
    // the current step computes, in place when the next one launches.
    let window = tokens_shape.clone().unwrap_or_default();
    let stage_next = |b: &mut dyn Backend,
                      pf: &Prefetch,
                      record: &mut Option<BatchLog>|
     -> Result<(), CliError> {
        let buf = pf.next().map_err(|e| CliError {
            message: format!("error: {e}"),
            code: 3,
        })?;
        if let Some(log) = record {
            let ids = buf.read().map_err(runtime_err)?;
            let (tokens, targets) = ids.split_at(ids.len() / 2);
            log.push_i32("tokens", &window, tokens)
                .and_then(|_| log.push_i32("targets", &window, targets))
                .map_err(|e| CliError::usage(format!("error: --save-data: {e}")))?;
        }
        b.stage(&["tokens", "targets"], &buf).map_err(runtime_err)?;
        pf.give_back(buf);
        Ok(())
    };
    if let Some(pf) = &batches {
        stage_next(b, pf, &mut record)?;
    }
    let mut log = open_log(args)?;
    // fp16: dynamic loss scaling. An overflowing step is skipped (the
    // optimizer's own step count does not advance) and the scale halves.
    let fp16 = is_input(b.graph(), fusec_compiler::autodiff::LOSS_SCALE_INPUT);
    let mut scaler = fusec_runtime::scaler::LossScaler::default();
    let mut opt_step = first - 1;
    if let Some(ck) = &resumed {
        if let Some(v) = ck.extra.get("loss_scale").and_then(|v| v.parse().ok()) {
            scaler.scale = v;
        }
        if let Some(v) = ck.extra.get("optimizer_step").and_then(|v| v.parse().ok()) {
            opt_step = v;
        }
    }
    let last = first + args.steps - 1;
    // The decay ends at the model's or the command line's step, else at
    // the run's last; a resumed run keeps the first run's end.
    let schedule = args
        .schedule
        .resolve(loaded.compiled.model.train.schedule, lr)?;
    let horizon = resumed
        .as_ref()
        .and_then(|ck| ck.extra.get("schedule_end"))
        .and_then(|v| v.parse().ok())
        .unwrap_or(last);
    let scheduled = schedule != Default::default();
    if scheduled {
        eprintln!(
            "learning rate: {} from {lr}{}",
            schedule.describe(),
            if ends_with_the_run(&schedule) {
                format!(", ending at step {horizon}")
            } else {
                String::new()
            }
        );
    }
    // Windows of the token file read by the end of each step (all ranks').
    let resumed_windows: Option<u64> = resumed
        .as_ref()
        .and_then(|ck| ck.extra.get(WINDOWS_READ))
        .and_then(|v| v.parse().ok());
    let rows = tokens_shape
        .as_ref()
        .and_then(|s| s.first().copied())
        .unwrap_or(0) as u64;
    let windows_at = |step: u64| match resumed_windows {
        Some(w) => w + (step + 1 - first) * micro * rows,
        None => step * micro * rows,
    };
    let state = |scaler: &fusec_runtime::scaler::LossScaler, opt_step: u64, step: u64| {
        let mut m = run_state(scaler, opt_step, fp16);
        if batches.is_some() {
            m.insert(WINDOWS_READ.into(), windows_at(step).to_string());
        }
        if ends_with_the_run(&schedule) {
            m.insert("schedule_end".into(), horizon.to_string());
        }
        m
    };
    for step in first..=last {
        let rate = schedule.rate(lr, step, horizon);
        if fp16 {
            b.set(fusec_compiler::autodiff::LOSS_SCALE_INPUT, &[scaler.scale])
                .map_err(runtime_err)?;
        }
        let t0 = Instant::now();
        let mut st = fusec_runtime::session::StepStats {
            loss: 0.0,
            grad_norm: None,
        };
        for mb in 0..micro {
            if micro > 1 {
                let apply = if mb + 1 == micro { 1.0 } else { 0.0 };
                b.set(fusec_compiler::autodiff::APPLY_INPUT, &[apply])
                    .map_err(runtime_err)?;
            }
            if args.data == RANDOM_STREAM {
                let k = (step - 1) * micro + mb;
                super::feed::feed_random(b, &data_inputs, &data_dims, args.seed, k, &mut record)?;
            }
            b.launch(rate, opt_step + 1).map_err(runtime_err)?;
            if let Some(pf) = &batches {
                if step < last || mb + 1 < micro {
                    stage_next(b, pf, &mut record)?;
                }
            }
            let one = b.finish().map_err(runtime_err)?;
            st.loss += one.loss / micro as f64;
            st.grad_norm = one.grad_norm;
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let applied = !fp16 || st.grad_norm.is_some_and(f64::is_finite);
        if applied {
            opt_step += 1;
        }
        if fp16 && scaler.update(applied) {
            eprintln!(
                "{}loss scale now {}",
                if applied {
                    ""
                } else {
                    "gradients overflowed, step skipped; "
                },
                scaler.scale
            );
        }
        let line = StepLine {
            step,
            last,
            rate,
            scheduled,
            loss: st.loss,
            grad_norm: st.grad_norm,
            ms,
            tokens_per_s: tokens_per_step as f64 / (ms / 1e3),
        };
        if !quiet {
            eprintln!("{}", line.progress());
        }
        if let Some(f) = &mut log {
            let _ = writeln!(f, "{}", line.json());
        }
        if !st.loss.is_finite() {
            return Err(CliError {
                message: format!(
                    "error: the loss is {} at step {step}; lower the learning rate",
                    st.loss
                ),
                code: 3,
            });
        }
        if let Some(v) = validation.as_mut().filter(|v| v.due(step, last)) {
            let val = v.loss(b)?;
            if !quiet {
                eprintln!(
                    "step {step:>5}/{last}  val loss {val:.4}  ({} batches, {} tokens)",
                    v.batches(),
                    v.tokens
                );
            }
            if let Some(f) = &mut log {
                let _ = writeln!(f, "{{\"step\":{step},\"val_loss\":{}}}", json_num(val));
            }
        }
        if let (Some(path), Some(every)) = (&args.save, args.save_every) {
            if step % every == 0 && step != last {
                save(b, path, step, &state(&scaler, opt_step, step))?;
            }
        }
    }
    if let Some(path) = &args.save {
        save(b, path, last, &state(&scaler, opt_step, last))?;
        eprintln!("saved {} (step {last})", path.display());
    }
    if let (Some(path), Some(log)) = (&args.save_data, &record) {
        log.save(path).map_err(|e| CliError {
            message: format!("error: --save-data: {e}"),
            code: 3,
        })?;
        eprintln!("saved the batches fed to {}", path.display());
    }
    Ok(())
}

/// Whether the schedule's end is the run's (and so recorded for a resume).
fn ends_with_the_run(s: &fusec_compiler::model::Schedule) -> bool {
    s.steps.is_none() && s.decay != fusec_compiler::model::Decay::Constant
}

/// What a checkpoint records beyond the tensors.
fn run_state(
    scaler: &fusec_runtime::scaler::LossScaler,
    opt_step: u64,
    fp16: bool,
) -> BTreeMap<String, String> {
    let mut m = BTreeMap::from([("optimizer_step".to_string(), opt_step.to_string())]);
    if fp16 {
        m.insert("loss_scale".into(), scaler.scale.to_string());
    }
    m
}

pub(super) fn save(
    b: &dyn Backend,
    path: &std::path::Path,
    step: u64,
    extra: &BTreeMap<String, String>,
) -> Result<(), CliError> {
    let mut ck = backend::checkpoint(b, step).map_err(runtime_err)?;
    ck.extra = extra.clone();
    checkpoint::save(path, &ck).map_err(|e| CliError {
        message: format!("error: {e}"),
        code: 3,
    })
}

pub(super) fn is_input(g: &fusec_compiler::ir::Graph, name: &str) -> bool {
    input_type(g, name).is_some()
}

/// The declared type of the input `name`.
pub(super) fn input_type<'g>(
    g: &'g fusec_compiler::ir::Graph,
    name: &str,
) -> Option<&'g fusec_compiler::ir::TensorType> {
    g.g.node_indices().find_map(|n| match &g.g[n].op {
        fusec_compiler::ops::Op::Input(i) if i.name == name => Some(&i.ty),
        _ => None,
    })
}

/// The bound token ids must respect: the embedding's rows.
pub(super) fn token_bound(
    g: &fusec_compiler::ir::Graph,
    dims: &BTreeMap<String, i64>,
) -> Option<u32> {
    let node = g
        .g
        .node_indices()
        .find(|&n| matches!(&g.g[n].op, fusec_compiler::ops::Op::Input(i) if i.name == "tokens"))?;
    let d = dims.iter().map(|(k, v)| (k.clone(), *v)).collect();
    fusec_compiler::interp::random::index_bound(g, fusec_compiler::ir::Value { node, port: 0 }, &d)
        .map(|v| v as u32)
}

pub(super) fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        "null".into()
    }
}

/// A checkpoint or weights file, checked to hold `needed` by name and shape;
/// a problem is exit status 3 with the file and the tensor named.
pub(super) fn load_checked(
    path: &std::path::Path,
    needed: &[(String, Vec<usize>)],
) -> Result<checkpoint::Checkpoint, CliError> {
    let err = |e: checkpoint::CheckpointError| CliError {
        message: format!("error: {e}"),
        code: 3,
    };
    let ck = checkpoint::load(path).map_err(err)?;
    checkpoint::check_against(&ck, path, needed).map_err(err)?;
    Ok(ck)
}

/// The checkpoint entry counting the token file's windows read so far.
pub(super) const WINDOWS_READ: &str = "windows_read";

/// `--data random-stream`: a new random batch for every micro-batch.
pub(super) const RANDOM_STREAM: &str = "random-stream";
