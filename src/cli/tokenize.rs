//! `fusec tokenize`: text files into llm.c token shards with a Hugging Face
//! `tokenizer.json` (byte-level BPE such as GPT-2's, or any other the
//! `tokenizers` library reads), the first tokens kept for validation; and
//! the same encoding for `fusec train --tokenizer`.

use super::CliError;
use clap::Args;
use fusec_runtime::data::write_bin;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Text files (UTF-8), each one document
    #[arg(required = true, value_name = "TEXT")]
    pub inputs: Vec<PathBuf>,
    /// A Hugging Face tokenizer.json (e.g. GPT-2's byte-level BPE)
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// Folder for the shards: val_000000.bin, then train_000000.bin, ...
    #[arg(short, long, value_name = "DIR")]
    pub out: PathBuf,
    /// Share of the tokens, taken from the start, kept for validation
    #[arg(long, default_value_t = 0.005, value_name = "F")]
    pub val_fraction: f64,
    /// Most tokens in one shard
    #[arg(long, default_value_t = 100_000_000, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub shard_tokens: u64,
    /// The token put before each document (default: `<|endoftext|>` where
    /// the tokenizer has it; `none` for no separator)
    #[arg(long, value_name = "TOKEN")]
    pub eot: Option<String>,
}

/// The tokenizer in `path`, or a message saying what is wrong with it.
pub fn load(path: &Path) -> Result<Tokenizer, CliError> {
    if !path.exists() {
        return Err(CliError::usage(format!(
            "error: no tokenizer file at {} (give a Hugging Face tokenizer.json)",
            path.display()
        )));
    }
    Tokenizer::from_file(path).map_err(|e| CliError {
        message: format!(
            "error: {} is not a tokenizer.json the tokenizers library can read: {e}",
            path.display()
        ),
        code: 3,
    })
}

/// The id put before each document: `eot` by name, `<|endoftext|>` where
/// the tokenizer has it when `eot` is not given, none for `none`.
pub fn separator(tok: &Tokenizer, eot: Option<&str>) -> Result<Option<u32>, CliError> {
    match eot {
        Some("none") => Ok(None),
        Some(name) => tok.token_to_id(name).map(Some).ok_or_else(|| {
            CliError::usage(format!(
                "error: --eot {name}: the tokenizer has no such token (`none` for no separator)"
            ))
        }),
        None => Ok(tok.token_to_id("<|endoftext|>")),
    }
}

/// The ids of one document: the separator, then the text's tokens.
pub fn encode_file(tok: &Tokenizer, path: &Path, sep: Option<u32>) -> Result<Vec<u32>, CliError> {
    let bytes = std::fs::read(path).map_err(|e| CliError {
        message: format!("error: cannot read {}: {e}", path.display()),
        code: 3,
    })?;
    let text = String::from_utf8(bytes).map_err(|e| CliError {
        message: format!(
            "error: {} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ),
        code: 3,
    })?;
    let enc = tok.encode(text.as_str(), false).map_err(|e| CliError {
        message: format!("error: tokenizing {}: {e}", path.display()),
        code: 3,
    })?;
    let mut ids = Vec::with_capacity(enc.get_ids().len() + 1);
    ids.extend(sep);
    ids.extend_from_slice(enc.get_ids());
    Ok(ids)
}

/// The tokens of a data file as `fusec train` reads it: an llm.c shard,
/// any other file as bytes, or (with `tokenizer`) text through it.
pub fn read_tokens(path: &Path, tokenizer: Option<&Path>) -> Result<Vec<u32>, CliError> {
    match tokenizer {
        Some(t) => {
            let tok = load(t)?;
            let sep = separator(&tok, None)?;
            encode_file(&tok, path, sep)
        }
        None => fusec_runtime::data::load_tokens(path).map_err(|e| CliError {
            message: format!("error: {e}"),
            code: 3,
        }),
    }
}

/// Ids as the 16-bit tokens of an llm.c shard, or which one does not fit.
fn narrow(ids: &[u32], vocab: usize) -> Result<Vec<u16>, CliError> {
    ids.iter()
        .map(|&t| u16::try_from(t))
        .collect::<Result<_, _>>()
        .map_err(|_| CliError {
            message: format!(
                "error: the tokenizer's vocabulary has {vocab} tokens; llm.c shards hold ids up to 65535"
            ),
            code: 3,
        })
}

pub fn run(args: &TokenizeArgs) -> Result<(), CliError> {
    if !(0.0..1.0).contains(&args.val_fraction) {
        return Err(CliError::usage(format!(
            "error: --val-fraction {} must be at least 0 and below 1",
            args.val_fraction
        )));
    }
    let tok = load(&args.tokenizer)?;
    let sep = separator(&tok, args.eot.as_deref())?;
    let vocab = tok.get_vocab_size(true);
    let total_bytes: u64 = args
        .inputs
        .iter()
        .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .sum();
    let bar = indicatif::ProgressBar::new(total_bytes);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "  tokenizing {bar:30} {bytes}/{total_bytes} ({bytes_per_sec}, {eta} left)",
        )
        .expect("a valid template"),
    );
    let mut ids: Vec<u32> = Vec::new();
    for path in &args.inputs {
        ids.extend(encode_file(&tok, path, sep)?);
        bar.inc(std::fs::metadata(path).map_or(0, |m| m.len()));
    }
    bar.finish_and_clear();
    let tokens = narrow(&ids, vocab)?;
    let n_val = (tokens.len() as f64 * args.val_fraction).round() as usize;
    let (val, train) = tokens.split_at(n_val);
    if train.is_empty() {
        return Err(CliError::usage(format!(
            "error: {} tokens in all: nothing left for training after the validation share",
            tokens.len()
        )));
    }
    std::fs::create_dir_all(&args.out).map_err(|e| {
        CliError::usage(format!(
            "error: cannot create output folder {}: {e}",
            args.out.display()
        ))
    })?;
    let mut written = Vec::new();
    let mut write = |name: String, part: &[u16]| -> Result<(), CliError> {
        let path = args.out.join(name);
        write_bin(&path, part).map_err(|e| CliError {
            message: format!("error: cannot write {}: {e}", path.display()),
            code: 3,
        })?;
        written.push((path, part.len()));
        Ok(())
    };
    if !val.is_empty() {
        write("val_000000.bin".into(), val)?;
    }
    for (i, part) in train.chunks(args.shard_tokens as usize).enumerate() {
        write(format!("train_{i:06}.bin"), part)?;
    }
    println!(
        "{} tokens from {} file{} ({:.2} bytes a token), vocabulary {vocab}{}",
        tokens.len(),
        args.inputs.len(),
        if args.inputs.len() == 1 { "" } else { "s" },
        total_bytes as f64 / tokens.len().max(1) as f64,
        match sep {
            Some(id) => format!(", documents separated by token {id}"),
            None => String::new(),
        }
    );
    for (path, n) in written {
        println!("  {} ({n} tokens)", path.display());
    }
    Ok(())
}
