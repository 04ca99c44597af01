//! `fusec train`: the compiled step run over the data, on a GPU or the CPU reference.

use super::feed::Where;
use super::open::runtime_err;
use super::parallel;
pub use super::train_args::TrainArgs;
use super::train_loop::{Feeder, OptimizerSteps, Rates, StepLoop};
use super::train_steps::{
    announce_deterministic, data_inputs, draw_while_opening, load_fitted, open_backend, open_log,
    open_validation, set_weights, this_ranks_args,
};
use super::CliError;
use fusec_runtime::device;

pub fn train(args: &TrainArgs) -> Result<(), CliError> {
    let job = parallel::job(&args.parallel)?;
    let world = job.world();
    // One GPU's driver starts while the model compiles.
    let mut opening = (world == 1 && !args.cpu).then(|| device::Opening::begin(args.gpu));
    let (loaded, dims, lr) = load_fitted(args, &job, opening.as_mut())?;
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
    // The validation step and the sampler run where the progress is
    // printed: the other processes of a launched job only help gather
    // what their ranks keep, when one is due.
    let eval_gpu = job.first_gpu(args.gpu);
    let validation = match quiet {
        false => open_validation(args, &loaded, &dims, world, eval_gpu, b)?,
        true => None,
    };
    let sampler = match quiet {
        false => super::samples::prepare(
            &args.samples,
            &loaded,
            args.tokenizer.as_deref(),
            args.cpu,
            eval_gpu,
        )?,
        true => None,
    };
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
        sampler,
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
        run.gather_if_evaluating(b, step)?;
        run.validate(b, step)?;
        run.sample(b, step)?;
        run.save_every(b, step)?;
    }
    let done = run.finish(b);
    fusec_runtime::startup::mark("run finished");
    if world == 1 && !args.cpu {
        // The process ends here: the driver frees a GPU's context, modules
        // and memory with it, where releasing them one by one first took
        // 0.03-0.1 s of a one-step run's 0.9 (H200, H100; five to ten runs
        // each way, docs/benchmarks.md).
        std::mem::forget(backend);
    }
    done
}
