//! Samples during `fusec train`: every `--sample-every` steps (and after
//! the last), a greedy continuation of `--sample-prompt`, as llm.c prints
//! one. It runs the model's decode step (`fusec generate`'s) in a session
//! of its own: its own arena (the weights' compute copies and the
//! key/value caches for one row), so the training step's plan is
//! untouched; the training step's weights are copied in (device to device
//! on a GPU) before each sample. With data parallelism it runs in the
//! process that writes (rank 0's), on its first rank's GPU.

use super::common::Loaded;
use super::decoding::{decode, Codec, Limits, Prepared, Row, Sampling};
use super::open::runtime_err;
use super::CliError;
use clap::Args;
use fusec::backend::Backend;
use fusec_compiler::decode::CACHE_DIM;
use fusec_compiler::ir::dim;
use std::collections::BTreeMap;

#[derive(Args, Debug, Clone, Default)]
pub struct SampleArgs {
    /// Print a greedy continuation of --sample-prompt every N steps (and
    /// after the last)
    #[arg(long, value_name = "N", requires = "sample_prompt", value_parser = clap::value_parser!(u64).range(1..))]
    pub sample_every: Option<u64>,
    /// The text the samples continue (through --tokenizer, or as UTF-8
    /// bytes, as the data is read)
    #[arg(long, value_name = "TEXT", requires = "sample_every")]
    pub sample_prompt: Option<String>,
    /// Tokens each sample adds
    #[arg(
        long,
        value_name = "N",
        default_value_t = 32,
        requires = "sample_every"
    )]
    pub sample_tokens: usize,
    /// The tokenizer.json that encodes the prompt and decodes the samples
    /// (default: --tokenizer; give it where --data is a token shard)
    #[arg(long, value_name = "FILE", requires = "sample_every")]
    pub sample_tokenizer: Option<std::path::PathBuf>,
}

pub struct Sampler {
    step: Box<dyn Backend>,
    prompt: Vec<u32>,
    codec: Codec,
    limits: Limits,
}

/// Whether `--sample-every` asks for a sample after step `step` of a run
/// ending at `last` (every process of a job asks alike).
pub fn due(args: &SampleArgs, step: u64, last: u64) -> bool {
    args.sample_every
        .is_some_and(|every| step == last || step.is_multiple_of(every))
}

impl Sampler {
    /// The prompt and its greedy continuation with `train`'s weights.
    pub fn sample(&mut self, train: &dyn Backend) -> Result<String, CliError> {
        self.step.copy_params_from(train).map_err(runtime_err)?;
        let mut rows = [Row::new(self.prompt.clone(), 0, 0)];
        decode(self.step.as_mut(), None, 1, &mut rows, &self.limits, |_| {})?;
        let all: Vec<u32> = self.prompt.iter().chain(&rows[0].made).copied().collect();
        Ok(self.codec.decode(&all))
    }
}

/// The sampler, where `--sample-every` asks for one: the decode step at
/// one row and the prompt's length plus `--sample-tokens` positions.
pub fn prepare(
    args: &SampleArgs,
    loaded: &Loaded,
    tokenizer: Option<&std::path::Path>,
    cpu: bool,
    gpu: usize,
) -> Result<Option<Sampler>, CliError> {
    let (Some(_), Some(text)) = (args.sample_every, &args.sample_prompt) else {
        return Ok(None);
    };
    let codec = match args.sample_tokenizer.as_deref().or(tokenizer) {
        Some(t) => Codec::Tokenizer(Box::new(super::tokenize::load(t)?)),
        None => Codec::Bytes,
    };
    let prompt = codec.encode(text)?;
    if prompt.is_empty() {
        return Err(CliError::usage(
            "error: --sample-prompt encodes to no tokens",
        ));
    }
    let Prepared {
        step: step_graph,
        positions,
        vocab,
    } = super::decoding::prepare(
        loaded,
        &codec,
        std::slice::from_ref(&prompt),
        args.sample_tokens,
        "--sample-prompt",
        &format!("--sample-prompt and --sample-tokens {}", args.sample_tokens),
        super::decoding::StepOptions {
            greedy: true,
            weights_as_read: false,
        },
    )?;
    let dims = BTreeMap::from([
        (dim::BATCH.to_string(), 1i64),
        (dim::SEQ.to_string(), 1),
        (CACHE_DIM.to_string(), positions as i64),
    ]);
    let step =
        super::open::open_step(&step_graph, loaded, "samples, decode step", &dims, cpu, gpu)?;
    let eos = match &codec {
        Codec::Tokenizer(t) => t.token_to_id("<|endoftext|>"),
        Codec::Bytes => None,
    };
    Ok(Some(Sampler {
        step,
        prompt,
        codec,
        limits: Limits {
            max_new: args.sample_tokens,
            eos,
            sampling: Sampling {
                temperature: 0.0,
                top_k: None,
                top_p: None,
            },
            vocab,
        },
    }))
}
