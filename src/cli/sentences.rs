//! `fusec train` on sentences: pairs for a translator (a tab-separated
//! file, or two files line by line) and labelled sentences for a
//! classifier (text, a tab, the class), tokenized with a `tokenizer.json`
//! and batched by length (`fusec_runtime::sentences`).
//!
//! Which the model reads is told by its inputs: `src`, `src_len`,
//! `tgt_in`, `tgt_len` and `tgt_out` for pairs; `tokens`, `lengths` and
//! `labels` (and `segment_ids`, fed zeros, where it has one) for labelled
//! sentences.

use super::common::input_type;
use super::train_args::TrainArgs;
use super::CliError;
use fusec_compiler::ir::dim::{SEQ, SOURCE_SEQ};
use fusec_compiler::ir::{DType, Graph, Value};
use fusec_compiler::ops::Op;
use fusec_runtime::sentences::{Example, Layout, SentenceBatches};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use tokenizers::Tokenizer;

/// The kinds of sentence data, by the inputs that read them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Kind {
    Pairs,
    Labelled,
}

pub(super) const PAIR_INPUTS: [&str; 5] = ["src", "src_len", "tgt_in", "tgt_len", "tgt_out"];
pub(super) const LABELLED_INPUTS: [&str; 3] = ["tokens", "lengths", "labels"];

impl Kind {
    /// The sentence data a model's inputs ask for, if any.
    pub(super) fn of(data_inputs: &[String]) -> Option<Kind> {
        let has = |n: &str| data_inputs.iter().any(|i| i == n);
        if PAIR_INPUTS.iter().all(|n| has(n)) {
            Some(Kind::Pairs)
        } else if LABELLED_INPUTS.iter().all(|n| has(n)) {
            Some(Kind::Labelled)
        } else {
            None
        }
    }

    fn inputs(self) -> &'static [&'static str] {
        match self {
            Kind::Pairs => &PAIR_INPUTS,
            Kind::Labelled => &LABELLED_INPUTS,
        }
    }
}

/// One line of a data file, as read: where it is and its fields.
#[derive(Debug, PartialEq)]
pub(super) struct Line<'a> {
    pub(super) at: String,
    pub(super) first: &'a str,
    pub(super) second: &'a str,
}

/// The non-blank lines of `text` split at their first tab: pairs
/// (`source<TAB>target`) or labelled sentences (`text<TAB>label`).
pub(super) fn split_lines<'a>(
    text: &'a str,
    file: &str,
    what: (&str, &str),
) -> Result<Vec<Line<'a>>, CliError> {
    let mut out = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{file}:{}", n + 1);
        let Some((first, second)) = line.split_once('\t') else {
            return Err(CliError::usage(format!(
                "error: {at}: no tab between the {} and the {} (each line is `{}<TAB>{}`)",
                what.0, what.1, what.0, what.1
            )));
        };
        for (field, name) in [(first, what.0), (second, what.1)] {
            if field.trim().is_empty() {
                return Err(CliError::usage(format!("error: {at}: the {name} is empty")));
            }
        }
        out.push(Line { at, first, second });
    }
    if out.is_empty() {
        return Err(CliError::usage(format!(
            "error: {file}: no lines to train on"
        )));
    }
    Ok(out)
}

fn read_text(path: &Path) -> Result<String, CliError> {
    let bytes = std::fs::read(path).map_err(|e| {
        CliError::usage(format!(
            "error: cannot read the data file {}: {e}",
            path.display()
        ))
    })?;
    String::from_utf8(bytes).map_err(|e| {
        CliError::usage(format!(
            "error: {} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Two files line by line as one tab-separated text (their lines checked
/// for tabs and counted).
fn join_files(src: &Path, tgt: &Path) -> Result<String, CliError> {
    let (a, b) = (read_text(src)?, read_text(tgt)?);
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    if la.len() != lb.len() {
        return Err(CliError::usage(format!(
            "error: {} has {} lines and {} has {}: the two files of sentence pairs must match line by line",
            src.display(),
            la.len(),
            tgt.display(),
            lb.len()
        )));
    }
    let mut out = String::new();
    for (n, (x, y)) in la.iter().zip(&lb).enumerate() {
        for (line, path) in [(x, src), (y, tgt)] {
            if line.contains('\t') {
                return Err(CliError::usage(format!(
                    "error: {}:{}: a tab inside a sentence (the two-file form holds one sentence a line)",
                    path.display(),
                    n + 1
                )));
            }
        }
        out.push_str(x);
        out.push('\t');
        out.push_str(y);
        out.push('\n');
    }
    Ok(out)
}

/// The id of the first of `names` the tokenizer has, or of `given`.
fn special(
    tok: &Tokenizer,
    given: Option<&str>,
    names: &[&str],
    flag: &str,
) -> Result<u32, CliError> {
    if let Some(name) = given {
        return tok.token_to_id(name).ok_or_else(|| {
            CliError::usage(format!(
                "error: {flag} {name}: the tokenizer has no such token"
            ))
        });
    }
    names
        .iter()
        .find_map(|n| tok.token_to_id(n))
        .ok_or_else(|| {
            CliError::usage(format!(
                "error: the tokenizer has none of {}: name the token with {flag}",
                names.join(", ")
            ))
        })
}

/// The target the model's loss ignores, if it ignores one.
pub(super) fn ignore_index(g: &Graph) -> Option<i64> {
    g.g.node_indices().find_map(|n| match &g.g[n].op {
        Op::Counted(c) => Some(c.ignore_index),
        _ => None,
    })
}

/// The bound ids fed to input `name` must stay below (embedding rows, or
/// classes of the loss).
pub(super) fn bound_of(g: &Graph, name: &str, dims: &BTreeMap<String, i64>) -> Option<u32> {
    let node =
        g.g.node_indices()
            .find(|&n| matches!(&g.g[n].op, Op::Input(i) if i.name == name))?;
    let d: HashMap<String, i64> = dims.iter().map(|(k, v)| (k.clone(), *v)).collect();
    fusec_compiler::interp::random::index_bound(g, Value { node, port: 0 }, &d).map(|v| v as u32)
}

/// What the step's shapes and the model's loss allow, for the checks.
pub(super) struct Limits {
    pub(super) layout: Layout,
    /// Embedding rows of the token inputs.
    pub(super) vocab: Option<u32>,
    /// Classes of `labels`.
    pub(super) classes: Option<u32>,
}

fn too_long(at: &str, what: &str, n: usize, dim: &str, size: usize) -> CliError {
    CliError::usage(format!(
        "error: {at}: the {what} has {n} tokens and the step's {dim} is {size}: give a larger --dim {dim}={} (up to the model's positions), or shorten the line",
        n.div_ceil(64) * 64
    ))
}

fn check_ids(at: &str, ids: &[u32], vocab: Option<u32>) -> Result<(), CliError> {
    let Some(v) = vocab else { return Ok(()) };
    if let Some(bad) = ids.iter().find(|&&x| x >= v) {
        return Err(CliError::usage(format!(
            "error: {at}: token {bad} is outside the model's vocabulary of {v} (is the tokenizer the model's?)"
        )));
    }
    Ok(())
}

/// Pairs tokenized: the source with its end token, the target with its
/// begin and end tokens.
fn pairs(
    lines: &[Line],
    tok: &Tokenizer,
    args: &TrainArgs,
    lim: &Limits,
) -> Result<Vec<Example>, CliError> {
    let bos = special(
        tok,
        args.bos.as_deref(),
        &["<s>", "[CLS]", "<|endoftext|>"],
        "--bos",
    )?;
    let eos = special(
        tok,
        args.eos.as_deref(),
        &["</s>", "[SEP]", "<|endoftext|>"],
        "--eos",
    )?;
    let srcs = encode(tok, lines.iter().map(|l| l.first), false)?;
    let tgts = encode(tok, lines.iter().map(|l| l.second), false)?;
    let l = &lim.layout;
    let mut out = Vec::with_capacity(lines.len());
    for ((line, mut src), tgt) in lines.iter().zip(srcs).zip(tgts) {
        src.push(eos);
        if src.len() > l.src_len {
            return Err(too_long(
                &line.at,
                "source with its end token",
                src.len(),
                SOURCE_SEQ,
                l.src_len,
            ));
        }
        if tgt.len() + 1 > l.len {
            return Err(too_long(
                &line.at,
                "target with its begin token",
                tgt.len() + 1,
                SEQ,
                l.len,
            ));
        }
        let tgt_in: Vec<u32> = std::iter::once(bos).chain(tgt.iter().copied()).collect();
        let tgt_out: Vec<u32> = tgt.iter().copied().chain(std::iter::once(eos)).collect();
        check_ids(&line.at, &src, lim.vocab)?;
        check_ids(&line.at, &tgt_in, lim.vocab)?;
        check_ids(&line.at, &tgt_out, lim.classes.or(lim.vocab))?;
        if let Some(i) = l.ignore.filter(|&i| tgt_out.iter().any(|&x| x as i32 == i)) {
            return Err(CliError::usage(format!(
                "error: {}: the target holds token {i}, which the loss ignores (its ignore_index): padding must be an id no sentence uses",
                line.at
            )));
        }
        out.push(Example::Pair {
            src,
            tgt_in,
            tgt_out,
        });
    }
    Ok(out)
}

/// Labelled sentences tokenized with the tokenizer's own special tokens
/// (a BERT tokenizer's `[CLS] ... [SEP]`).
fn labelled(lines: &[Line], tok: &Tokenizer, lim: &Limits) -> Result<Vec<Example>, CliError> {
    let texts = encode(tok, lines.iter().map(|l| l.first), true)?;
    let l = &lim.layout;
    let mut out = Vec::with_capacity(lines.len());
    for (line, tokens) in lines.iter().zip(texts) {
        let label: u32 = line.second.trim().parse().map_err(|_| {
            CliError::usage(format!(
                "error: {}: the label `{}` is not a class number (0, 1, ...)",
                line.at,
                line.second.trim()
            ))
        })?;
        if let Some(c) = lim.classes.filter(|&c| label >= c) {
            return Err(CliError::usage(format!(
                "error: {}: label {label} is out of range: the model has {c} classes (0 to {})",
                line.at,
                c - 1
            )));
        }
        if tokens.len() > l.len {
            return Err(too_long(&line.at, "sentence", tokens.len(), SEQ, l.len));
        }
        check_ids(&line.at, &tokens, lim.vocab)?;
        out.push(Example::Labelled { tokens, label });
    }
    Ok(out)
}

fn encode<'a>(
    tok: &Tokenizer,
    texts: impl Iterator<Item = &'a str>,
    specials: bool,
) -> Result<Vec<Vec<u32>>, CliError> {
    let texts: Vec<&str> = texts.collect();
    let enc = tok.encode_batch(texts, specials).map_err(|e| CliError {
        message: format!("error: tokenizing the data: {e}"),
        code: 3,
    })?;
    Ok(enc.into_iter().map(|e| e.get_ids().to_vec()).collect())
}

/// Checks the model's sentence inputs: i32, and shaped [B, S], [B] ... as
/// the batches fill them.
fn check_inputs(
    kind: Kind,
    g: &Graph,
    shapes: &BTreeMap<String, Vec<usize>>,
    b: usize,
) -> Result<(), CliError> {
    for &name in kind.inputs() {
        if let Some(ty) = input_type(g, name) {
            if ty.dtype != DType::I32 {
                return Err(CliError::usage(format!(
                    "error: sentence data feeds ids and lengths into `{name}`, which this model declares as {ty}; declare it as i32"
                )));
            }
        }
        let want_rank = if name.ends_with("len") || name == "lengths" || name == "labels" {
            1
        } else {
            2
        };
        let shape = shapes.get(name).cloned().unwrap_or_default();
        if shape.len() != want_rank || shape[0] != b {
            return Err(CliError::usage(format!(
                "error: sentence data feeds `{name}` a {}, and this model's `{name}` has shape {shape:?}",
                if want_rank == 1 { "value per sentence [B]" } else { "row per sentence [B, length]" }
            )));
        }
    }
    Ok(())
}

/// The batches of `--data`'s sentences for a model that reads `kind`.
pub(super) fn prepare(
    kind: Kind,
    args: &TrainArgs,
    g: &Graph,
    shapes: &BTreeMap<String, Vec<usize>>,
    dims: &BTreeMap<String, i64>,
) -> Result<SentenceBatches, CliError> {
    let inputs = kind.inputs().join(", ");
    let Some(tok_path) = args.tokenizer.as_deref() else {
        return Err(CliError::usage(format!(
            "error: this model reads {} (inputs {inputs}); give --tokenizer tokenizer.json to tokenize --data {}",
            match kind {
                Kind::Pairs => "sentence pairs",
                Kind::Labelled => "labelled sentences",
            },
            args.data
        )));
    };
    let tok = super::tokenize::load(tok_path)?;
    let rows_input = if kind == Kind::Pairs { "src" } else { "tokens" };
    let rows = shapes
        .get(rows_input)
        .and_then(|s| s.first().copied())
        .unwrap_or(0);
    check_inputs(kind, g, shapes, rows)?;
    let len_of = |n: &str| shapes.get(n).and_then(|s| s.get(1).copied()).unwrap_or(0);
    let ignore = ignore_index(g).map(|i| i as i32);
    let pad_token = ["<pad>", "[PAD]", "<|pad|>"]
        .iter()
        .find_map(|n| tok.token_to_id(n));
    let layout = Layout {
        rows,
        src_len: len_of("src"),
        len: if kind == Kind::Pairs {
            len_of("tgt_in")
        } else {
            len_of("tokens")
        },
        // Padded ids are masked; a pad token keeps them readable.
        pad: pad_token.map_or(0, |p| p as i32),
        ignore,
        segments: kind == Kind::Labelled && shapes.contains_key("segment_ids"),
        max_tokens: args.max_tokens.map(|m| m as usize),
    };
    let first_tokens = if kind == Kind::Pairs { "src" } else { "tokens" };
    let limits = Limits {
        layout,
        vocab: bound_of(g, first_tokens, dims),
        classes: bound_of(
            g,
            if kind == Kind::Pairs {
                "tgt_out"
            } else {
                "labels"
            },
            dims,
        ),
    };
    let data = Path::new(&args.data);
    let text = match (&args.data_target, kind) {
        (Some(tgt), Kind::Pairs) => join_files(data, tgt)?,
        (Some(_), Kind::Labelled) => {
            return Err(CliError::usage(
                "error: --data-target gives the targets of sentence pairs; this model reads labelled sentences (text<TAB>label in --data)".to_string(),
            ))
        }
        (None, _) => read_text(data)?,
    };
    let file = args.data.as_str();
    let examples = match kind {
        Kind::Pairs => pairs(
            &split_lines(&text, file, ("source", "target"))?,
            &tok,
            args,
            &limits,
        )?,
        Kind::Labelled => labelled(&split_lines(&text, file, ("text", "label"))?, &tok, &limits)?,
    };
    let n = examples.len();
    let batches = SentenceBatches::new(examples, limits.layout, args.seed)
        .map_err(|e| CliError::usage(format!("error: {}: {}", args.data, e.0)))?;
    eprintln!(
        "data: {n} {} from {}, batched by length{}",
        match kind {
            Kind::Pairs => "sentence pairs",
            Kind::Labelled => "labelled sentences",
        },
        args.data,
        match args.max_tokens {
            Some(m) => format!(" (at most {m} padded tokens a batch)"),
            None => String::new(),
        }
    );
    Ok(batches)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_at_tabs_and_bad_ones_are_named() {
        let ok = split_lines("a b\tc d\n\n x\ty\r\n", "p.tsv", ("source", "target")).unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(
            (ok[1].at.as_str(), ok[1].first, ok[1].second),
            ("p.tsv:3", " x", "y")
        );
        let e = split_lines("a\tb\nno tab here\n", "p.tsv", ("source", "target")).unwrap_err();
        assert!(
            e.message
                .contains("p.tsv:2: no tab between the source and the target"),
            "{}",
            e.message
        );
        let e = split_lines("a\t \n", "l.tsv", ("text", "label")).unwrap_err();
        assert!(
            e.message.contains("l.tsv:1: the label is empty"),
            "{}",
            e.message
        );
        assert!(split_lines("\n\n", "e.tsv", ("a", "b")).is_err());
    }
}
