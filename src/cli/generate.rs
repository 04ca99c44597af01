//! `fusec generate`: what a trained language model says after a prompt,
//! a token at a time: greedy by default, or sampled with a temperature,
//! top-k and top-p from a seeded generator (the same seed, the same
//! tokens). It compiles the model's decode step (`fusec_compiler::decode`:
//! the forward pass up to the logits its loss reads, run a position at a
//! time against key/value caches the plan places) and runs it on a GPU,
//! captured as a CUDA graph, or on the CPU reference (`--cpu`); the
//! continuations of every prompt run together, `--batch` at a time
//! (`decoding`).

use super::common::{load, Loaded, ModelArgs};
use super::decoding::{decode, prepare, Codec, Limits, Prepared, Row, Sampling, StepOptions};
use super::open::runtime_err;
use super::CliError;
use clap::Args;
use fusec::backend::Backend;
use fusec_compiler::decode::CACHE_DIM;
use fusec_compiler::ir::{dim, Graph};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The weights: a checkpoint `fusec train --save` wrote, or another
    /// program's through --name-map
    #[arg(long, value_name = "FILE")]
    pub weights: PathBuf,
    /// A name map from the weights' names to the model's, e.g.
    /// dsl-examples/maps/hf-gpt2.json
    #[arg(long, value_name = "MAP")]
    pub name_map: Option<PathBuf>,
    /// Encode the prompt and decode the output with this Hugging Face
    /// tokenizer.json (without one, text is its UTF-8 bytes, one id each,
    /// as `fusec train` reads a text file)
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// The prompt, as text
    #[arg(long, value_name = "TEXT", conflicts_with_all = ["prompt_ids", "prompts"])]
    pub prompt: Option<String>,
    /// The prompt as token ids, e.g. 464,2068,7586
    #[arg(
        long,
        value_name = "IDS",
        value_delimiter = ',',
        conflicts_with = "prompts"
    )]
    pub prompt_ids: Option<Vec<u32>>,
    /// A file of prompts, one a line, each continued in turn
    #[arg(long, value_name = "FILE")]
    pub prompts: Option<PathBuf>,
    /// Tokens to add after each prompt
    #[arg(long, value_name = "N", default_value_t = 50)]
    pub max_new_tokens: usize,
    /// Sample with this temperature (0, the default: greedy, the most
    /// likely token each time)
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample among the K most likely tokens only
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..))]
    pub top_k: Option<u32>,
    /// Sample among the most likely tokens whose probabilities add up to P
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,
    /// The sampling generator's seed: the same seed gives the same tokens
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Continuations of each prompt
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub num_samples: u32,
    /// Stop at this token id (default: the tokenizer's <|endoftext|> where
    /// it has one)
    #[arg(long, value_name = "ID")]
    pub eos_id: Option<u32>,
    /// Print one JSON line a continuation (prompt, ids, text) instead of
    /// streaming the text
    #[arg(long)]
    pub json: bool,
    /// Continuations decoded together (default: all of them, up to 32)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: Option<u32>,
    /// Run on the CPU reference interpreter instead of a GPU (small models)
    #[arg(long)]
    pub cpu: bool,
    /// The GPU to run on
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub gpu: usize,
    /// After decoding, time every kernel of one decode step and write
    /// them to FILE (one JSON line a launch), as `fusec bench --profile`
    /// does for a training step (GPU only)
    #[arg(long, value_name = "FILE", conflicts_with = "cpu")]
    pub profile: Option<PathBuf>,
}

/// The decode step (or its prefill) at `dims`, on the CPU reference or a GPU.
fn open_step(
    args: &GenerateArgs,
    loaded: &Loaded,
    step: &Graph,
    dims: &BTreeMap<String, i64>,
) -> Result<Box<dyn Backend>, CliError> {
    super::open::open_step(step, loaded, "decode step", dims, args.cpu, args.gpu)
}

pub fn run(args: &GenerateArgs) -> Result<(), CliError> {
    if args.temperature.is_nan() || args.temperature < 0.0 {
        return Err(CliError::usage("error: --temperature must be 0 or more"));
    }
    if args.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        return Err(CliError::usage(
            "error: --top-p must be above 0 and at most 1",
        ));
    }
    let loaded = load(&args.model)?;
    let file = args.model.model.display().to_string();
    let codec = match &args.tokenizer {
        Some(t) => Codec::Tokenizer(Box::new(super::tokenize::load(t)?)),
        None => Codec::Bytes,
    };
    let prompts = read_prompts(args, &codec)?;
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
    };
    let Prepared {
        step,
        positions: longest,
        vocab,
    } = prepare(
        &loaded,
        &codec,
        &prompts,
        args.max_new_tokens,
        "the prompt",
        &format!(
            "the longest prompt and --max-new-tokens {}",
            args.max_new_tokens
        ),
        StepOptions {
            greedy: sampling.is_greedy(),
            weights_as_read: true,
        },
    )?;
    let eos = args.eos_id.or(match &codec {
        Codec::Tokenizer(t) => t.token_to_id("<|endoftext|>"),
        Codec::Bytes => None,
    });
    let mut rows: Vec<Row> = Vec::new();
    for p in &prompts {
        for _ in 0..args.num_samples {
            rows.push(Row::new(p.clone(), args.seed, rows.len() as u64));
        }
    }
    let batch = args.batch.map_or(rows.len().min(32), |b| b as usize);
    let dims = BTreeMap::from([
        (dim::BATCH.to_string(), batch as i64),
        (dim::SEQ.to_string(), 1),
        (CACHE_DIM.to_string(), longest as i64),
    ]);
    let mut backend = open_step(args, &loaded, &step, &dims)?;
    super::checkpoints::restore_weights(backend.as_mut(), &args.weights, args.name_map.as_deref())?;
    // The prefill: every prompt's first m tokens at once, m one less than
    // the shortest prompt (whose last token's logits pick the first new
    // one). Not worth a step of its own for a prompt of two tokens.
    let m = prompts.iter().map(Vec::len).min().unwrap_or(1) - 1;
    let mut prefill = if m >= 2 {
        let g = fusec_compiler::decode::prefill_graph(&step)
            .map_err(|f| CliError::model(f.render(&file, &loaded.source)))?;
        let mut at = dims.clone();
        at.insert(dim::SEQ.to_string(), m as i64);
        let mut p = open_step(args, &loaded, &g, &at)?;
        p.copy_params_from(backend.as_ref()).map_err(runtime_err)?;
        Some(p)
    } else {
        None
    };
    let limits = Limits {
        max_new: args.max_new_tokens,
        eos,
        sampling,
        vocab,
    };
    let mut all = super::decoding::Timing::default();
    for chunk in rows.chunks_mut(batch) {
        // One continuation streams as it is made; several print when done.
        let stream = chunk.len() == 1 && !args.json;
        let mut shown = String::new();
        if stream {
            shown = codec.decode(&chunk[0].prompt);
            print!("{shown}");
            let _ = std::io::stdout().flush();
        }
        let t = decode(
            backend.as_mut(),
            prefill.as_mut(),
            batch,
            chunk,
            &limits,
            |rows| {
                if stream {
                    let r = &rows[0];
                    let all: Vec<u32> = r.prompt.iter().chain(&r.made).copied().collect();
                    // The text so far, less what is already shown: a token
                    // may complete a character the last one began.
                    let text = codec.decode(&all);
                    if let Some(new) = text.strip_prefix(&shown) {
                        print!("{new}");
                        let _ = std::io::stdout().flush();
                        shown = text;
                    }
                }
            },
        )?;
        all.add(&t);
        for r in chunk.iter() {
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "prompt_ids": r.prompt,
                        "ids": r.made,
                        "text": codec.decode(&r.made),
                    })
                );
            } else if stream {
                println!();
            } else {
                let all: Vec<u32> = r.prompt.iter().chain(&r.made).copied().collect();
                println!("{}", codec.decode(&all));
            }
        }
    }
    if let Some(path) = &args.profile {
        let file = loaded.path.display().to_string();
        let gpu = backend.as_gpu_mut().ok_or_else(|| {
            CliError::usage("error: --profile times a GPU's kernels: run without --cpu")
        })?;
        super::profile::profile_step(path, gpu, Some((&file, &loaded.source)))?;
    }
    let per_step = |s: f64| 1e3 * s / all.steps.max(1) as f64;
    eprintln!(
        "a step: {:.3} ms feeding and launching it, {:.3} ms reading its {} back, {:.3} ms picking the tokens",
        per_step(all.in_step),
        if sampling.is_greedy() { "picks" } else { "logits" },
        per_step(all.reading),
        per_step(all.picking)
    );
    eprintln!(
        "{} new tokens in {:.2} s ({:.0} tokens/s, {} steps of batch {batch}, {:.2} ms a step) on {}",
        all.made,
        all.seconds,
        all.made as f64 / all.seconds.max(1e-9),
        all.steps,
        per_step(all.seconds),
        if args.cpu { "the CPU reference" } else { "the GPU" }
    );
    Ok(())
}

/// The prompts as token ids: `--prompt`, `--prompt-ids` or each line of
/// `--prompts`.
fn read_prompts(args: &GenerateArgs, codec: &Codec) -> Result<Vec<Vec<u32>>, CliError> {
    let prompts: Vec<Vec<u32>> = match (&args.prompt, &args.prompt_ids, &args.prompts) {
        (Some(text), _, _) => vec![codec.encode(text)?],
        (_, Some(ids), _) => vec![ids.clone()],
        (_, _, Some(path)) => std::fs::read_to_string(path)
            .map_err(|e| CliError::usage(format!("error: cannot read {}: {e}", path.display())))?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| codec.encode(l))
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(CliError::usage(
                "error: give a prompt: --prompt TEXT, --prompt-ids IDS or --prompts FILE",
            ))
        }
    };
    if prompts.is_empty() {
        return Err(CliError::usage("error: the prompts file holds no prompt"));
    }
    if prompts.iter().any(Vec::is_empty) {
        return Err(CliError::usage("error: a prompt encodes to no tokens"));
    }
    Ok(prompts)
}
