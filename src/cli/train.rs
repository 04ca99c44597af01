//! `fusec train`: the compiled step run over the data, on a GPU or the CPU reference.

use super::common::{BudgetArgs, Loaded, ModelArgs, SizeArgs};
use super::feed::Where;
use super::parallel;
use super::schedule::ScheduleArgs;
use super::train_loop::{Feeder, OptimizerSteps, Rates, StepLoop};
use super::train_steps::{
    announce_deterministic, data_inputs, draw_while_opening, load_fitted, open_backend, open_log,
    open_validation, set_weights, this_ranks_args,
};
use super::CliError;
use clap::Args;
use fusec_runtime::backend::{self, Backend};
use fusec_runtime::checkpoint;
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
    #[command(flatten)]
    pub f32: super::f32_math::F32Args,
    /// Write the batches the run feeds to this safetensors file, each data
    /// input with a leading axis over the batches in the order fed (the one
    /// fixed batch of `--data random`; every micro-batch's windows of a
    /// token file), so that another implementation can train on exactly
    /// the same data
    #[arg(long, value_name = "FILE")]
    pub save_data: Option<PathBuf>,
    /// Write the last step's gradients to this safetensors file, one f32
    /// tensor per parameter under its name: the gradient of the step's mean
    /// loss (over its micro-batches), before clipping, the fp16 loss scale
    /// divided out, so that another implementation's can be compared tensor
    /// by tensor. One GPU or --cpu
    #[arg(long, value_name = "FILE", conflicts_with = "gpus")]
    pub save_grads: Option<PathBuf>,
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
    /// (`fusec tokenize` writes shards once instead). Sentence data (pairs,
    /// labelled sentences) needs one
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Sentence pairs from two files line by line: --data holds the
    /// sources, this file the targets (otherwise --data holds
    /// `source<TAB>target` lines)
    #[arg(long, value_name = "FILE")]
    pub data_target: Option<PathBuf>,
    /// Sentence data: at most this many padded tokens a batch (sentences x
    /// the longest of them, as fairseq's --max-tokens), at most B
    /// sentences; the rows left over are empty
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_tokens: Option<u64>,
    /// Sentence pairs: the token that begins each target (default: the
    /// tokenizer's <s>, [CLS] or <|endoftext|>)
    #[arg(long, value_name = "TOKEN")]
    pub bos: Option<String>,
    /// Sentence pairs: the token that ends each source and target (default:
    /// the tokenizer's </s>, [SEP] or <|endoftext|>)
    #[arg(long, value_name = "TOKEN")]
    pub eos: Option<String>,
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
    gpu: device::Opening,
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
    gpu: device::Opening,
    options: SessionOptions,
    source: Option<(&str, &str)>,
) -> Result<(Session, String), CliError> {
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
    // One GPU's driver starts while the model compiles.
    let mut opening = (world == 1 && !args.cpu).then(|| device::Opening::begin(args.gpu));
    let (loaded, dims, lr) = load_fitted(args, world, opening.as_mut())?;
    fusec_runtime::startup::mark("model compiled");
    let data_dims = parallel::whole_batch(&dims, world);
    // Only rank 0 of a launched job writes files and progress.
    let quiet = !job.writes();
    let args_here = this_ranks_args(args, quiet);
    let args: &TrainArgs = &args_here;
    let drawing = draw_while_opening(args, &loaded, world);
    let mut backend = open_backend(args, &loaded, &dims, &job, opening)?;
    let b = backend.as_mut();
    // While the initial weights are still being drawn.
    b.warm_up().map_err(runtime_err)?;
    let validation = open_validation(args, &loaded, &dims, world, b)?;
    let data_inputs = data_inputs(b);
    announce_deterministic(args);
    let resumed = set_weights(args, b, drawing, !quiet)?;
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
    let mut feed = Feeder::prepare(
        args,
        b,
        &Where {
            data_inputs: &data_inputs,
            data_dims: &data_dims,
            dims: &dims,
            tokens_shape: tokens_shape.as_deref(),
            micro,
            first,
            resumed: resumed.as_ref(),
        },
    )?;
    feed.stage_next(b)?;
    let log = open_log(args)?;
    let optimizer = OptimizerSteps::resume(b, first, resumed.as_ref());
    let last = first + args.steps - 1;
    let rates = Rates::plan(args, &loaded, lr, resumed.as_ref(), last)?;
    let mut run = StepLoop {
        log,
        feed,
        validation,
        args,
        quiet,
        last,
        micro,
        tokens_per_step,
        rates,
        optimizer,
        grads: None,
    };
    for step in first..=last {
        let line = run.step(b, step)?;
        run.report(&line)?;
        run.validate(b, step)?;
        run.save_every(b, step)?;
    }
    let done = run.finish(b);
    fusec_runtime::startup::mark("run finished");
    done
}

/// A checkpoint of the run after `step`, written to `path` where this
/// process `writes` (rank 0 of a launched job; the others only help gather
/// what their ranks keep).
pub(super) fn save(
    b: &mut dyn Backend,
    path: &std::path::Path,
    step: u64,
    extra: &BTreeMap<String, String>,
    writes: bool,
) -> Result<(), CliError> {
    b.gather_for_checkpoint().map_err(runtime_err)?;
    if !writes {
        return Ok(());
    }
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
    super::sentences::bound_of(g, "tokens", dims)
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
