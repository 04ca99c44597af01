//! Validation during `fusec train`: the mean loss over a fixed set of
//! windows of `--val-data` (the first `--eval-batches` batches its reader
//! cuts), computed by a forward-only step of its own (the forward graph
//! alone: no gradients, no optimizer state, its own arena) that takes the
//! training step's weights before each evaluation (device to device on a
//! GPU).

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
    /// Each batch's tokens and targets.
    batches: Vec<(Vec<f64>, Vec<f64>)>,
    pub every: u64,
    pub tokens: usize,
}

impl Validation {
    /// Whether to evaluate after step `step` of a run ending at `last`.
    pub fn due(&self, step: u64, last: u64) -> bool {
        step == last || (self.every > 0 && step.is_multiple_of(self.every))
    }

    pub fn batches(&self) -> usize {
        self.batches.len()
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
    if world > 1 {
        return Err(CliError::usage(
            "error: --val-data with data parallelism is not built yet: validate from a one-GPU run of a checkpoint".to_string(),
        ));
    }
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
    let batches = (0..args.eval_batches)
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
        every: args.eval_every,
        tokens: args.eval_batches as usize * b * t,
    }))
}
