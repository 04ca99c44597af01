//! `fusec train`'s flags.

use super::common::{BudgetArgs, ModelArgs, SizeArgs};
use super::schedule::ScheduleArgs;
use clap::Args;
use std::path::PathBuf;

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
    #[command(flatten)]
    pub samples: super::samples::SampleArgs,
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
