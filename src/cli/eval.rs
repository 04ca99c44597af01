//! `fusec eval`: a trained model's loss and perplexity over a token file.
//! The file is cut into consecutive windows of T + 1 tokens (each window's
//! first T are the inputs, its last T the targets, as training reads
//! them), every window once, in order; the forward-only step (the one
//! validation runs) evaluates them B at a time, and the windows left over
//! after the last whole batch one at a time, so that every window counts.
//! The mean is over the targets: each batch's loss (the model's mean
//! cross-entropy over its B x T targets) weighted by its rows.

use super::common::{load, ModelArgs, SizeArgs};
use super::open::runtime_err;
use super::CliError;
use clap::Args;
use fusec::backend::Backend;
use fusec_compiler::ir::{dim, Graph};
use fusec_compiler::ops::Op;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The weights to evaluate: a checkpoint `fusec train --save` wrote, a
    /// `--save-init` file, or another program's through --name-map
    #[arg(long, value_name = "FILE")]
    pub weights: PathBuf,
    /// A name map from the weights' names to the model's (as `fusec train
    /// --init-from` takes), e.g. dsl-examples/maps/hf-gpt2.json
    #[arg(long, value_name = "MAP")]
    pub name_map: Option<PathBuf>,
    /// The tokens: an llm.c shard (.bin), any other file as bytes, or text
    /// through --tokenizer
    #[arg(long, value_name = "FILE", required_unless_present = "choices")]
    pub data: Option<PathBuf>,
    /// Multiple-choice questions instead, one JSON line each:
    /// {"context": ..., "endings": [...], "label": i}; reports accuracy
    /// (each ending scored by the sum of its tokens' log-probabilities,
    /// as HellaSwag is) and length-normalised accuracy
    #[arg(long, value_name = "FILE.jsonl", conflicts_with_all = ["data", "max_batches"])]
    pub choices: Option<PathBuf>,
    /// With --choices: score the first N questions alone
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_questions: Option<u64>,
    /// Tokenize the text of --data with this Hugging Face tokenizer.json
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    #[command(flatten)]
    pub sizes: SizeArgs,
    /// Evaluate the first N batches' windows alone (default: every window
    /// of the file)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_batches: Option<u64>,
    /// Run on the CPU reference interpreter (slow; for small models)
    #[arg(long)]
    pub cpu: bool,
    /// The GPU to run on
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Print one JSON line (loss, perplexity, tokens, windows) instead of a
    /// sentence
    #[arg(long)]
    pub json: bool,
}

/// The windows of `tokens` evaluated: consecutive runs of `t + 1` tokens
/// (each starting where the last one's targets end), at most `limit`.
fn windows(tokens: &[u32], t: usize, limit: Option<usize>) -> Vec<&[u32]> {
    let n = tokens.len().saturating_sub(1) / t;
    let n = limit.map_or(n, |l| n.min(l));
    (0..n).map(|i| &tokens[i * t..i * t + t + 1]).collect()
}

/// A batch of windows as the step's `tokens` and `targets`.
fn feeds(batch: &[&[u32]]) -> (Vec<f64>, Vec<f64>) {
    let inputs = batch
        .iter()
        .flat_map(|w| &w[..w.len() - 1])
        .map(|&x| x as f64);
    let targets = batch.iter().flat_map(|w| &w[1..]).map(|&x| x as f64);
    (inputs.collect(), targets.collect())
}

/// Why `g` cannot read a token file as `fusec eval` feeds it: its inputs
/// must be `tokens` and `targets`, i32 `[B, T]`.
fn token_inputs(g: &Graph, file: &str) -> Result<(), CliError> {
    let mut found = BTreeMap::new();
    for n in g.g.node_indices() {
        if let Op::Input(i) = &g.g[n].op {
            found.insert(i.name.clone(), i.ty.to_string());
        }
    }
    let want = format!("i32[{}, {}]", dim::BATCH, dim::SEQ);
    let fits = ["tokens", "targets"]
        .iter()
        .all(|name| found.get(*name) == Some(&want));
    if fits && found.len() == 2 {
        return Ok(());
    }
    let listed: Vec<String> = found.iter().map(|(n, t)| format!("{n}: {t}")).collect();
    Err(CliError::usage(format!(
        "error: fusec eval reads a token file into a language model's `tokens` and `targets` ({want} each, as dsl-examples/gpt2-small.dsl declares them); {file} has inputs {}",
        listed.join(", ")
    )))
}

/// The forward-only step at sizes `dims`, on the CPU or a GPU.
fn open_step(
    args: &EvalArgs,
    loaded: &super::common::Loaded,
    forward: &Graph,
    dims: &BTreeMap<String, i64>,
) -> Result<Box<dyn Backend>, CliError> {
    super::open::open_step(forward, loaded, "forward only", dims, args.cpu, args.gpu)
}

/// Writes the weights of `args.weights` (through `--name-map`) into `b`.
fn load_weights(args: &EvalArgs, b: &mut dyn Backend) -> Result<(), CliError> {
    super::checkpoints::restore_weights(b, &args.weights, args.name_map.as_deref())
}

pub fn run(args: &EvalArgs) -> Result<(), CliError> {
    let data = match (&args.data, &args.choices) {
        (_, Some(choices)) => return super::choices::run(args, choices),
        (Some(data), None) => data,
        (None, None) => {
            return Err(CliError::usage(
                "error: give --data FILE (tokens) or --choices FILE.jsonl (questions)",
            ))
        }
    };
    let loaded = load(&args.model)?;
    let file = args.model.model.display().to_string();
    token_inputs(&loaded.compiled.model.graph, &file)?;
    let dims = args.sizes.resolve(&loaded.compiled.optimized.dims)?;
    super::common::check_sizes(&loaded, &dims)?;
    let size = |name: &str| dims.get(name).copied().unwrap_or(1).max(1) as usize;
    let (b, t) = (size(dim::BATCH), size(dim::SEQ));
    let forward = fusec_compiler::driver::forward_graph(&loaded.compiled).map_err(|e| {
        CliError::model(format!(
            "internal error building the forward-only step: {e}\nthis is a bug in fusec; please report it with the model file"
        ))
    })?;
    let tokens = super::tokenize::read_tokens(data, args.tokenizer.as_deref())?;
    let data = data.display();
    let limit = args.max_batches.map(|k| k as usize * b);
    let all = windows(&tokens, t, limit);
    if all.is_empty() {
        return Err(CliError {
            message: format!(
                "error: --data {data} has {} tokens; one window of --seq {t} needs {}",
                tokens.len(),
                t + 1
            ),
            code: 3,
        });
    }
    if let Some(vocab) = super::feed::token_bound(&loaded.compiled.optimized, &dims) {
        let used = &tokens[..all.len() * t + 1];
        if let Some(at) = used.iter().position(|&x| x >= vocab) {
            return Err(CliError {
                message: format!(
                    "error: --data {data}: token {at} is id {}, and the model's vocabulary has {vocab} ids (0 to {}): evaluate it with the tokenizer the model was trained with",
                    used[at],
                    vocab - 1
                ),
                code: 3,
            });
        }
    }
    let (whole, tail) = all.split_at(all.len() / b * b);
    let mut step = open_step(args, &loaded, &forward, &dims)?;
    load_weights(args, step.as_mut())?;
    let bar = indicatif::ProgressBar::new(all.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("evaluating {pos}/{len} windows {wide_bar} {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // Sum of each batch's mean loss times its rows.
    let mut sum = 0.0;
    let mut rows = 0usize;
    let mut run = |step: &mut dyn Backend, batch: &[&[u32]]| -> Result<(), CliError> {
        let (inputs, targets) = feeds(batch);
        step.set("tokens", &inputs).map_err(runtime_err)?;
        step.set("targets", &targets).map_err(runtime_err)?;
        let loss = step.step(0.0, 1).map_err(runtime_err)?.loss;
        sum += loss * batch.len() as f64;
        rows += batch.len();
        bar.inc(batch.len() as u64);
        Ok(())
    };
    for batch in whole.chunks(b) {
        run(step.as_mut(), batch)?;
    }
    if !tail.is_empty() {
        // The windows after the last whole batch, one at a time.
        drop(step);
        let mut one = dims.clone();
        one.insert(dim::BATCH.to_string(), 1);
        let mut single = open_step(args, &loaded, &forward, &one)?;
        load_weights(args, single.as_mut())?;
        for w in tail {
            run(single.as_mut(), std::slice::from_ref(w))?;
        }
    }
    bar.finish_and_clear();
    let loss = sum / rows as f64;
    let evaluated = rows * t;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": loaded.compiled.model.graph.name,
                "weights": args.weights.display().to_string(),
                "loss": loss,
                "perplexity": loss.exp(),
                "tokens": evaluated,
                "windows": rows,
                "seq": t,
            })
        );
    } else {
        let left = tokens.len() - 1 - evaluated;
        println!(
            "loss {loss:.4}, perplexity {:.2} over {evaluated} tokens ({rows} windows of {t}{})",
            loss.exp(),
            if left > 0 {
                format!("; {left} tokens after the last window not evaluated")
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Consecutive windows of T + 1 sharing one token with the next, every
    /// token up to the last whole window once as a target.
    #[test]
    fn windows_cover_the_file_once() {
        let tokens: Vec<u32> = (0..11).collect();
        let w = windows(&tokens, 3, None);
        assert_eq!(w, vec![&[0, 1, 2, 3][..], &[3, 4, 5, 6], &[6, 7, 8, 9]]);
        assert_eq!(windows(&tokens, 3, Some(2)).len(), 2);
        assert!(windows(&tokens[..3], 3, None).is_empty());
        let (inputs, targets) = feeds(&w[..2]);
        assert_eq!(inputs, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(targets, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }
}
