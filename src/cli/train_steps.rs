//! The named steps of `fusec train` before and around its loop: loading the
//! model, what a launched job's other ranks leave out, opening the backend
//! and the validation step, setting the starting weights, the log file, and
//! what each step reports.

use super::checkpoints::{load_checked, save};
use super::common::{fit_memory, is_input, json_num, load_ranks, Loaded};
use super::feed::token_bound;
use super::open::{runtime_err, start};
use super::parallel;
use super::train_args::TrainArgs;
use super::validate::Validation;
use super::CliError;
use fusec::backend::GpuOptions;
use fusec::backend::{self, Backend};
use fusec_compiler::interp::Precision;
use fusec_runtime::checkpoint;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Instant;

/// The initial weights being drawn on the host: each parameter's bytes,
/// by name, sent as soon as it is drawn (`backend::draw_params_each`).
pub(super) struct Drawing {
    params: std::sync::mpsc::Receiver<(String, Vec<u8>)>,
    /// `None` where a parameter's size is not a constant (nothing sent).
    thread: std::thread::JoinHandle<Option<()>>,
}

/// The model loaded for `job`'s ranks and fitted to the memory budget,
/// each rank's sizes, and the peak learning rate.
pub(super) fn load_fitted(
    args: &TrainArgs,
    job: &super::parallel::Job,
    opening: Option<&mut fusec_runtime::device::Opening>,
) -> Result<(Loaded, BTreeMap<String, i64>, f64), CliError> {
    let world = job.world();
    let mut loaded = load_ranks(&args.model, world as u32, args.parallel.reduce_dtype)?;
    args.parallel
        .shape_buckets(&mut loaded.compiled.options.lower);
    let lr = args
        .lr
        .unwrap_or(loaded.compiled.model.train.optimizer.lr());
    // Each rank's sizes; the data is fed for all of them together.
    let dims = args.sizes.resolve_all(&loaded.compiled.optimized.dims)?;
    super::common::check_sizes(&loaded, &dims)?;
    // Under ZeRO each rank compiles its own step, which `parallel::start`
    // fits.
    let per_rank = args
        .parallel
        .zero(job, &loaded.compiled.optimized.params)?
        .is_some();
    super::common::announce_fitted(
        fit_memory(
            &mut loaded,
            &args.budget,
            &dims,
            world as u32,
            per_rank,
            // The GPU this run opens (its name comes before the opening ends).
            super::common::planning_device(opening.and_then(|o| o.gpu_name()).as_deref()),
            args.deterministic,
        )?,
        &loaded,
    );
    Ok((loaded, dims, lr))
}

/// The arguments this rank runs with: a `quiet` rank (not rank 0 of a
/// launched job) writes no files. It keeps `--save`, `--save-every` and
/// `--save-init`, whose checkpoints it helps gather (ZeRO: its ranks' state)
/// at the steps rank 0 writes them; `save` writes nothing there.
pub(super) fn this_ranks_args(args: &TrainArgs, quiet: bool) -> Cow<'_, TrainArgs> {
    if quiet {
        let mut args_here = args.clone();
        args_here.save_data = None;
        args_here.log = None;
        Cow::Owned(args_here)
    } else {
        Cow::Borrowed(args)
    }
}

/// One GPU: the initial weights are drawn on the host while the GPU
/// opens and the kernels load.
pub(super) fn draw_while_opening(
    args: &TrainArgs,
    loaded: &Loaded,
    world: usize,
) -> Option<Drawing> {
    (world == 1 && !args.cpu).then(|| {
        let g = loaded.compiled.optimized.clone();
        let seed = args.seed;
        let (send, params) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            backend::draw_params_beside(&g, seed, &mut |name, bytes| {
                // A receiver gone means the run stopped: nothing to do.
                let _ = send.send((name, bytes));
            })
        });
        Drawing { params, thread }
    })
}

/// The backend the step runs on: several GPUs (`--gpus N` or a launcher's
/// ranks), the CPU reference interpreter, or one GPU.
pub(super) fn open_backend(
    args: &TrainArgs,
    loaded: &Loaded,
    dims: &BTreeMap<String, i64>,
    job: &parallel::Job,
    opening: Option<fusec_runtime::device::Opening>,
) -> Result<Box<dyn Backend>, CliError> {
    let options = GpuOptions {
        deterministic: args.deterministic,
        f32_math: args.f32.math(),
    };
    if job.world() > 1 {
        let zero = args.parallel.zero(job, &loaded.compiled.optimized.params)?;
        Ok(Box::new(parallel::start(
            loaded, dims, job, args.gpu, args.cpu, options, &args.data, zero,
        )?))
    } else if args.cpu {
        eprintln!("CPU reference interpreter (values rounded to their dtypes as stored): slow, for small models");
        let g = &loaded.compiled.optimized;
        Ok(Box::new(
            backend::Cpu::new(g, dims, Precision::AsStored).map_err(runtime_err)?,
        ))
    } else {
        let gpu = opening.unwrap_or_else(|| fusec_runtime::device::Opening::here(args.gpu));
        let (s, _) = start(loaded, dims, gpu, options)?;
        Ok(Box::new(s))
    }
}

/// `--val-data`: the validation step and its batches.
pub(super) fn open_validation(
    args: &TrainArgs,
    loaded: &Loaded,
    dims: &BTreeMap<String, i64>,
    world: usize,
    gpu: usize,
    b: &dyn Backend,
) -> Result<Option<Validation>, CliError> {
    super::validate::prepare(
        &args.validation,
        loaded,
        dims,
        args.tokenizer.as_deref(),
        args.cpu,
        gpu,
        world,
        token_bound(b.graph(), dims),
    )
}

/// The inputs the data feeds: the step's inputs but the update's.
pub(super) fn data_inputs(b: &dyn Backend) -> Vec<String> {
    b.shapes()
        .keys()
        .filter(|k| is_input(b.graph(), k) && !fusec_compiler::autodiff::is_step_input(k))
        .cloned()
        .collect()
}

/// `--deterministic` on a GPU: what it changes.
pub(super) fn announce_deterministic(args: &TrainArgs) {
    if args.deterministic && !args.cpu {
        eprintln!(
            "deterministic: the attention backward runs without atomics and every other kernel is deterministic (each GEMM on cuBLASLt's first choice of algorithm, not one chosen by timing), so a run repeats bit for bit on the same GPU and software"
        );
    }
    if let Some(what) = args.f32.describe(args.cpu) {
        eprintln!("{what}");
    }
}

/// The weights the run starts from: drawn (on a thread while the GPU
/// opened, or here from the seed), then a checkpoint's (`--resume`, which
/// is returned) or another file's (`--init-from`, through `--name-map`);
/// `--save-init` writes them.
pub(super) fn set_weights(
    args: &TrainArgs,
    b: &mut dyn Backend,
    drawing: Option<Drawing>,
    writes: bool,
) -> Result<Option<checkpoint::Checkpoint>, CliError> {
    let t_init = Instant::now();
    // Each drawn parameter is copied while the next is drawn.
    let drawn = match drawing {
        Some(d) => {
            backend::init_params_drawn(b, d.params.iter()).map_err(runtime_err)?;
            d.thread.join().ok().flatten().is_some()
        }
        None => false,
    };
    if !drawn {
        backend::init_params(b, args.seed).map_err(runtime_err)?;
    }
    fusec_runtime::startup::mark("weights in place");
    if !args.cpu {
        eprintln!(
            "  weights initialized in {:.1} s",
            t_init.elapsed().as_secs_f64()
        );
    }
    let mut resumed = None;
    if let Some(path) = &args.resume {
        let ck = load_checked(path, &backend::needed(b))?;
        backend::restore(b, &ck).map_err(runtime_err)?;
        eprintln!("resuming {} after step {}", path.display(), ck.step);
        resumed = Some(ck);
    }
    if let Some(path) = &args.init_from {
        let ck = super::checkpoints::load_weights(
            path,
            args.name_map.as_deref(),
            &backend::needed_params(b),
        )?;
        backend::restore_params(b, &ck).map_err(runtime_err)?;
        eprintln!(
            "weights from {}{}",
            path.display(),
            args.name_map
                .as_ref()
                .map_or(String::new(), |m| format!(" through {}", m.display()))
        );
    }
    if let Some(path) = &args.save_init {
        save(b, path, 0, &Default::default(), writes)?;
    }
    Ok(resumed)
}

/// `--log`: one JSON line a step, appended to when resuming.
pub(super) fn open_log(args: &TrainArgs) -> Result<Option<std::fs::File>, CliError> {
    let Some(p) = &args.log else {
        return Ok(None);
    };
    std::fs::OpenOptions::new()
        .create(true)
        .append(args.resume.is_some())
        .write(true)
        .truncate(args.resume.is_none())
        .open(p)
        .map(Some)
        .map_err(|e| CliError::usage(format!("error: cannot write {}: {e}", p.display())))
}

/// What a step reports: a progress line on stderr and a `--log` line.
pub(super) struct StepLine {
    pub(super) step: u64,
    pub(super) last: u64,
    pub(super) rate: f64,
    /// Whether the rate changes (then the progress line shows it).
    pub(super) scheduled: bool,
    pub(super) loss: f64,
    pub(super) grad_norm: Option<f64>,
    pub(super) ms: f64,
    pub(super) tokens_per_s: f64,
    /// Batches of padded sentences: `tokens_per_s` counts only the tokens
    /// that are not padding.
    pub(super) padded: bool,
}

impl StepLine {
    pub(super) fn progress(&self) -> String {
        format!(
            "step {:>5}/{}  {}loss {:.4}  {}{:.1} ms  {:.0} tok/s{}",
            self.step,
            self.last,
            if self.scheduled {
                format!("lr {:.3e}  ", self.rate)
            } else {
                String::new()
            },
            self.loss,
            self.grad_norm
                .map_or(String::new(), |n| format!("norm {n:.3}  ")),
            self.ms,
            self.tokens_per_s,
            if self.padded {
                " (real, not padded)"
            } else {
                ""
            }
        )
    }

    pub(super) fn json(&self) -> String {
        format!(
            "{{\"step\":{},\"lr\":{},\"loss\":{},\"grad_norm\":{},\"ms\":{:.3},\"tokens_per_s\":{:.1}}}",
            self.step,
            json_num(self.rate),
            json_num(self.loss),
            self.grad_norm.map_or("null".into(), json_num),
            self.ms,
            self.tokens_per_s
        )
    }
}
