//! `fusec generate`: what a trained language model says after a prompt,
//! a token at a time: greedy by default, or sampled with a temperature,
//! top-k and top-p from a seeded generator (the same seed, the same
//! tokens). It runs the model's logits graph (`driver::logits_graph`: the
//! forward pass up to the logits its loss reads) on the CPU reference over
//! the whole sequence so far for each new token: exact and slow, for small
//! models and for checking. Decoding on a GPU with a key/value cache is
//! not built yet.

use super::common::{load, ModelArgs};
use super::CliError;
use clap::Args;
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::{self, Feeds, Precision};
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::{dim, Graph};
use fusec_compiler::ops::Op;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
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
    /// Run on the CPU reference interpreter (needed for now)
    #[arg(long)]
    pub cpu: bool,
}

/// How the next token is chosen from a row of logits.
#[derive(Clone, Copy, Debug)]
struct Sampling {
    temperature: f64,
    top_k: Option<u32>,
    top_p: Option<f64>,
}

impl Sampling {
    /// The next token: the first most likely one (greedy), or one drawn
    /// from the softmax of `row / temperature` restricted to the `top_k`
    /// most likely and then to the fewest whose probabilities reach `top_p`.
    fn pick(&self, row: &[f64], rng: &mut rand_chacha::ChaCha8Rng) -> u32 {
        let first_max = |r: &[f64]| {
            r.iter()
                .enumerate()
                .fold((0, f64::NEG_INFINITY), |best, (i, &x)| {
                    if x > best.1 {
                        (i, x)
                    } else {
                        best
                    }
                })
                .0 as u32
        };
        if self.temperature <= 0.0 {
            return first_max(row);
        }
        let mut order: Vec<usize> = (0..row.len()).collect();
        // Most likely first; equal logits by id, so the draw is repeatable.
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        if let Some(k) = self.top_k {
            order.truncate(k as usize);
        }
        let top = row[order[0]];
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| ((row[i] - top) / self.temperature).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if let Some(p) = self.top_p {
            let mut sum = 0.0;
            let keep = probs
                .iter()
                .position(|&q| {
                    sum += q;
                    sum >= p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            order.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut u = rng.random::<f64>() * total;
        for (&i, &q) in order.iter().zip(&probs) {
            if u < q {
                return i as u32;
            }
            u -= q;
        }
        order[probs.len() - 1] as u32
    }
}

/// Text to ids and back: a Hugging Face tokenizer, or UTF-8 bytes.
enum Codec {
    Tokenizer(Box<tokenizers::Tokenizer>),
    Bytes,
}

impl Codec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, CliError> {
        match self {
            Codec::Tokenizer(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| CliError::usage(format!("error: cannot encode the prompt: {e}"))),
            Codec::Bytes => Ok(text.bytes().map(u32::from).collect()),
        }
    }
    fn decode(&self, ids: &[u32]) -> String {
        match self {
            Codec::Tokenizer(t) => t.decode(ids, false).unwrap_or_default(),
            Codec::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i.min(255) as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
        }
    }
}

/// The model's input names: the token ids (`tokens`, i32 `[B, T]`) and
/// any other input, fed zeros (a training target the logits do not read).
fn check_inputs(g: &Graph, file: &str) -> Result<Vec<String>, CliError> {
    let mut others = Vec::new();
    let mut tokens = false;
    for n in g.g.node_indices() {
        if let Op::Input(i) = &g.g[n].op {
            if i.name == "tokens"
                && i.ty.to_string() == format!("i32[{}, {}]", dim::BATCH, dim::SEQ)
            {
                tokens = true;
            } else {
                others.push(i.name.clone());
            }
        }
    }
    if !tokens {
        return Err(CliError::usage(format!(
            "error: fusec generate feeds token ids to a language model's `tokens` (i32[B, T], as dsl-examples/gpt2-small.dsl declares it); {file} has none"
        )));
    }
    Ok(others)
}

/// The weights of `args.weights` (through `--name-map`), checked against
/// the parameters of `g`, as the interpreter's feeds.
fn weights(args: &GenerateArgs, g: &Graph) -> Result<HashMap<String, Tensor>, CliError> {
    let needed: Vec<(String, Vec<usize>)> = g
        .params
        .iter()
        .map(|p| {
            let shape =
                p.ty.shape
                    .iter()
                    .map(|d| d.as_const().unwrap_or(0).max(0) as usize)
                    .collect();
            (p.name.clone(), shape)
        })
        .collect();
    let ck = super::checkpoints::load_weights(&args.weights, args.name_map.as_deref(), &needed)?;
    Ok(needed
        .into_iter()
        .map(|(name, shape)| {
            let t = ck.get(&name).expect("checked above");
            let data = t.data.iter().map(|&x| x as f64).collect();
            (name, Tensor::new(shape, data))
        })
        .collect())
}

pub fn run(args: &GenerateArgs) -> Result<(), CliError> {
    if !args.cpu {
        return Err(CliError::usage(
            "error: fusec generate runs on the CPU reference for now: add --cpu (decoding on a GPU, with a key/value cache, is not built yet)".to_string(),
        ));
    }
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
    let g = fusec_compiler::driver::logits_graph(&loaded.compiled)
        .map_err(|e| CliError::usage(format!("error: {file}: {e}")))?;
    let zeros = check_inputs(&g, &file)?;
    let codec = match &args.tokenizer {
        Some(t) => Codec::Tokenizer(Box::new(super::tokenize::load(t)?)),
        None => Codec::Bytes,
    };
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
    if prompts.iter().any(Vec::is_empty) {
        return Err(CliError::usage("error: a prompt encodes to no tokens"));
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + args.max_new_tokens;
    let sizes = |t: usize| {
        std::collections::BTreeMap::from([
            (dim::BATCH.to_string(), 1i64),
            (dim::SEQ.to_string(), t as i64),
        ])
    };
    super::common::check_sizes(&loaded, &sizes(longest)).map_err(|e| {
        CliError::usage(format!(
            "error: the longest prompt and --max-new-tokens {} make {longest} positions, which the model cannot take:\n{}",
            args.max_new_tokens, e.message
        ))
    })?;
    let vocab = super::feed::token_bound(&loaded.compiled.optimized, &sizes(longest));
    if let (Some(v), Codec::Tokenizer(t)) = (vocab, &codec) {
        let n = t.get_vocab_size(true);
        if n > v as usize {
            return Err(CliError::usage(format!(
                "error: the tokenizer has {n} ids and the model's vocabulary {v}: it is not the tokenizer the model was trained with"
            )));
        }
    }
    if let Some(v) = vocab {
        if let Some(&bad) = prompts.iter().flatten().find(|&&x| x >= v) {
            return Err(CliError::usage(format!(
                "error: the prompt holds token id {bad}, and the model's vocabulary has {v} ids (0 to {})",
                v - 1
            )));
        }
    }
    let eos = args.eos_id.or(match &codec {
        Codec::Tokenizer(t) => t.token_to_id("<|endoftext|>"),
        Codec::Bytes => None,
    });
    let params = weights(args, &g)?;
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    let logits_of = |ids: &[u32]| -> Result<Vec<f64>, CliError> {
        let t = ids.len();
        let mut feeds = Feeds {
            dims: sizes(t).into_iter().collect(),
            params: params.clone(),
            ..Feeds::default()
        };
        let tokens = ids.iter().map(|&x| x as f64).collect();
        feeds
            .inputs
            .insert("tokens".into(), Tensor::new(vec![1, t], tokens));
        for name in &zeros {
            feeds
                .inputs
                .insert(name.clone(), Tensor::new(vec![1, t], vec![0.0; t]));
        }
        let vals = interp::run(&g, &feeds, Precision::AsStored)
            .map_err(|e| CliError::usage(format!("error: the CPU reference failed: {}", e.0)))?;
        let out = g
            .outputs
            .iter()
            .find(|(r, _)| *r == Role::Logits)
            .map(|(_, v)| &vals[v])
            .expect("the logits graph outputs its logits");
        let v = out.data.len() / t;
        Ok(out.data[(t - 1) * v..].to_vec())
    };
    let stdout = std::io::stdout();
    for prompt in &prompts {
        for _ in 0..args.num_samples {
            let mut ids = prompt.clone();
            let mut shown = codec.decode(&ids);
            if !args.json {
                print!("{shown}");
                let _ = stdout.lock().flush();
            }
            for _ in 0..args.max_new_tokens {
                let next = sampling.pick(&logits_of(&ids)?, &mut rng);
                ids.push(next);
                if !args.json {
                    // The text so far, less what is already shown: a token
                    // may complete a character the last one began.
                    let text = codec.decode(&ids);
                    if let Some(new) = text.strip_prefix(&shown) {
                        print!("{new}");
                        let _ = stdout.lock().flush();
                        shown = text;
                    }
                }
                if Some(next) == eos {
                    break;
                }
            }
            if args.json {
                let new = &ids[prompt.len()..];
                println!(
                    "{}",
                    serde_json::json!({
                        "prompt_ids": prompt,
                        "ids": new,
                        "text": codec.decode(new),
                    })
                );
            } else {
                println!();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Greedy takes the first most likely token; sampling keeps to top-k
    /// and top-p, and one seed draws the same tokens again.
    #[test]
    fn greedy_and_sampled_picks_keep_to_their_rules() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let row = [0.5, 2.0, 2.0, -1.0, 1.9];
        let greedy = Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: None,
        };
        assert_eq!(greedy.pick(&row, &mut rng), 1);
        let top2 = Sampling {
            temperature: 1.0,
            top_k: Some(2),
            top_p: None,
        };
        let draws: Vec<u32> = (0..200).map(|_| top2.pick(&row, &mut rng)).collect();
        assert!(draws.iter().all(|&d| d == 1 || d == 2), "{draws:?}");
        assert!(draws.contains(&1) && draws.contains(&2));
        // Probabilities .315, .315, .285 of the top three: 0.5 keeps two.
        let nucleus = Sampling {
            temperature: 1.0,
            top_k: None,
            top_p: Some(0.5),
        };
        assert!((0..200).all(|_| matches!(nucleus.pick(&row, &mut rng), 1 | 2)));
        let again = |seed| {
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            (0..20).map(|_| top2.pick(&row, &mut r)).collect::<Vec<_>>()
        };
        assert_eq!(again(7), again(7));
        assert_ne!(again(7), again(8));
    }
}
