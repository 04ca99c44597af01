//! Validation during `fusec train`: the mean loss over a fixed set of
//! windows of `--val-data` (the first `--eval-batches` batches its reader
//! cuts), computed by a forward-only step of its own (the forward graph
//! alone: no gradients, no optimizer state, its own arena) that takes the
//! training step's weights before each evaluation (device to device on a
//! GPU). With data parallelism it runs in the process that writes (rank
//! 0's), on its first rank's GPU, over the windows one GPU with the whole
//! batch reads: `--eval-batches` whole batches, a rank's rows at a time.

use super::common::Loaded;
use super::open::runtime_err;
use super::CliError;
use clap::Args;
use fusec::backend::Backend;
use fusec_runtime::data::Batches;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Args, Debug, Clone, Default)]
pub struct ValidationArgs {
    /// Validation data, read as --data is (a token shard, bytes, or text
    /// through --tokenizer)
    #[arg(long, value_name = "FILE")]
    pub val_data: Option<PathBuf>,
    /// Evaluate every N steps (and after the last); 0: after the last only
    #[arg(long, value_name = "N", default_value_t = 0, requires = "val_data")]
    pub eval_every: u64,
    /// Batches of validation windows in each evaluation (the same ones every time)
    #[arg(long, value_name = "K", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..), requires = "val_data")]
    pub eval_batches: u64,
}

pub struct Validation {
    step: Box<dyn Backend>,
    /// Each batch's tokens and targets (a rank's rows each).
    batches: Vec<(Vec<f64>, Vec<f64>)>,
    /// Whole batches (every rank's rows) the batches make.
    whole: u64,
    pub tokens: usize,
}

/// Whether `--val-data` asks for an evaluation after step `step` of a run
/// ending at `last` (every process of a job asks alike).
pub fn due(args: &ValidationArgs, step: u64, last: u64) -> bool {
    args.val_data.is_some()
        && (step == last || (args.eval_every > 0 && step.is_multiple_of(args.eval_every)))
}

impl Validation {
    /// Whole batches in each evaluation.
    pub fn batches(&self) -> u64 {
        self.whole
    }

    /// The mean loss over the validation batches with `train`'s weights.
    pub fn loss(&mut self, train: &dyn Backend) -> Result<f64, CliError> {
        self.step.copy_params_from(train).map_err(runtime_err)?;
        let mut total = 0.0;
        for (tokens, targets) in &self.batches {
            self.step.set("tokens", tokens).map_err(runtime_err)?;
            self.step.set("targets", targets).map_err(runtime_err)?;
            total += self.step.step(0.0, 1).map_err(runtime_err)?.loss;
        }
        Ok(total / self.batches.len() as f64)
    }
}

/// The validation step and its batches, where `--val-data` asks for them.
#[allow(clippy::too_many_arguments)]
pub fn prepare(
    args: &ValidationArgs,
    loaded: &Loaded,
    dims: &BTreeMap<String, i64>,
    tokenizer: Option<&std::path::Path>,
    cpu: bool,
    gpu: usize,
    world: usize,
    vocab: Option<u32>,
) -> Result<Option<Validation>, CliError> {
    let Some(path) = &args.val_data else {
        return Ok(None);
    };
    let forward = fusec_compiler::driver::forward_graph(&loaded.compiled).map_err(|e| {
        CliError::model(format!(
            "internal error building the forward-only step: {e}\nthis is a bug in fusec; please report it with the model file"
        ))
    })?;
    let tokens = super::tokenize::read_tokens(path, tokenizer)?;
    let (b, t) = (
        dims.get(fusec_compiler::ir::dim::BATCH)
            .copied()
            .unwrap_or(1) as usize,
        dims.get(fusec_compiler::ir::dim::SEQ).copied().unwrap_or(1) as usize,
    );
    let mut src = Batches::new(tokens, b, t, vocab).map_err(|e| CliError {
        message: format!("error: --val-data {}: {e}", path.display()),
        code: 3,
    })?;
    // Consecutive windows: `world` batches of a rank's rows are one whole
    // batch's, and each batch's loss is its mean over the same number of
    // tokens, so their mean is the one-GPU run's.
    let batches = (0..args.eval_batches * world as u64)
        .map(|_| {
            let batch = src.next_batch();
            let f = |v: Vec<i32>| v.into_iter().map(f64::from).collect();
            (f(batch.inputs), f(batch.targets))
        })
        .collect();
    let step =
        super::open::open_step(&forward, loaded, "validation, forward only", dims, cpu, gpu)?;
    Ok(Some(Validation {
        step,
        batches,
        whole: args.eval_batches,
        tokens: args.eval_batches as usize * world * b * t,
    }))
}
