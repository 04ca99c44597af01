//! `fusec eval --choices FILE.jsonl`: multiple-choice accuracy, scored as
//! HellaSwag is. Each line is `{"context": ..., "endings": [...], "label":
//! i}`; an ending's score is the sum of its tokens' log-probabilities after
//! the context (each ending encoded as given, after the context's tokens),
//! and the prediction is the best-scoring ending; the length-normalised
//! accuracy divides each score by its ending's length in characters. One
//! step a question: its endings are the batch's rows, each padded after
//! its last token (a causal model's earlier positions never see padding),
//! run through the scoring step (`driver::token_losses_graph`: each
//! position's cross-entropy of its target, on the GPU), and the rows'
//! losses over each ending's positions are summed here.

use super::decoding::Codec;
use super::eval::EvalArgs;
use super::open::runtime_err;
use super::CliError;
use fusec_compiler::ir::dim;
use std::collections::BTreeMap;
use std::path::Path;

/// One question: the context's tokens, each ending's tokens and length in
/// characters, the right ending, and its line in the file.
struct Question {
    context: Vec<u32>,
    endings: Vec<(Vec<u32>, usize)>,
    label: usize,
    line: usize,
}

fn read_questions(
    path: &Path,
    codec: &Codec,
    limit: Option<u64>,
) -> Result<Vec<Question>, CliError> {
    let text = std::fs::read_to_string(path).map_err(|e| CliError {
        message: format!("error: cannot read --choices {}: {e}", path.display()),
        code: 3,
    })?;
    let bad = |line: usize, what: String| CliError {
        message: format!("error: --choices {}:{line}: {what}", path.display()),
        code: 3,
    };
    let mut out = Vec::new();
    for (i, l) in text.lines().enumerate() {
        let line = i + 1;
        if l.trim().is_empty() {
            continue;
        }
        if limit.is_some_and(|n| out.len() as u64 >= n) {
            break;
        }
        let v: serde_json::Value =
            serde_json::from_str(l).map_err(|e| bad(line, format!("not JSON: {e}")))?;
        let context = v["context"]
            .as_str()
            .ok_or_else(|| bad(line, "no \"context\" string".into()))?;
        let endings: Vec<&str> = v["endings"]
            .as_array()
            .and_then(|a| a.iter().map(|e| e.as_str()).collect())
            .ok_or_else(|| bad(line, "no \"endings\" list of strings".into()))?;
        if endings.len() < 2 {
            return Err(bad(
                line,
                format!("{} ending; a question needs two or more", endings.len()),
            ));
        }
        let label = v["label"]
            .as_u64()
            .map(|x| x as usize)
            .filter(|&x| x < endings.len())
            .ok_or_else(|| {
                bad(
                    line,
                    format!(
                        "\"label\" must be the right ending's index, 0 to {}",
                        endings.len() - 1
                    ),
                )
            })?;
        let context = codec.encode(context)?;
        let endings = endings
            .iter()
            .map(|e| Ok((codec.encode(e)?, e.chars().count().max(1))))
            .collect::<Result<Vec<_>, CliError>>()?;
        if context.is_empty() || endings.iter().any(|(e, _)| e.is_empty()) {
            return Err(bad(
                line,
                "the context and every ending need one token or more".into(),
            ));
        }
        out.push(Question {
            context,
            endings,
            label,
            line,
        });
    }
    if out.is_empty() {
        return Err(CliError {
            message: format!(
                "error: --choices {} holds no questions (one JSON line each: {{\"context\": ..., \"endings\": [...], \"label\": i}})",
                path.display()
            ),
            code: 3,
        });
    }
    Ok(out)
}

/// Each ending's summed log-probability, from the step's per-token losses
/// `[B, T]` (row i the context and ending i).
fn scores(q: &Question, losses: &[f64], t: usize) -> Vec<f64> {
    let c = q.context.len();
    q.endings
        .iter()
        .enumerate()
        .map(|(i, (e, _))| {
            // Position p's target is token p + 1: the ending's tokens are
            // the targets of positions c - 1 .. c + len - 2.
            (c - 1..c - 1 + e.len()).map(|p| -losses[i * t + p]).sum()
        })
        .collect()
}

fn best(xs: impl Iterator<Item = f64>) -> usize {
    xs.enumerate()
        .fold(
            (0, f64::NEG_INFINITY),
            |b, (i, x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

pub fn run(args: &EvalArgs, path: &Path) -> Result<(), CliError> {
    let loaded = super::common::load(&args.model)?;
    let file = args.model.model.display().to_string();
    let codec = match &args.tokenizer {
        Some(t) => Codec::Tokenizer(Box::new(super::tokenize::load(t)?)),
        None => Codec::Bytes,
    };
    let questions = read_questions(path, &codec, args.max_questions)?;
    let rows = questions.iter().map(|q| q.endings.len()).max().unwrap_or(2);
    let (longest, at) = questions
        .iter()
        .flat_map(|q| {
            q.endings
                .iter()
                .map(move |(e, _)| (q.context.len() + e.len() - 1, q.line))
        })
        .max()
        .unwrap_or((1, 0));
    let t = longest;
    let dims = BTreeMap::from([
        (dim::BATCH.to_string(), rows as i64),
        (dim::SEQ.to_string(), t as i64),
    ]);
    super::common::check_sizes(&loaded, &dims).map_err(|e| {
        CliError::usage(format!(
            "error: --choices {}:{at} needs {t} positions, which the model cannot take:\n{}",
            path.display(),
            e.message
        ))
    })?;
    if let Some(v) = super::feed::token_bound(&loaded.compiled.optimized, &dims) {
        for q in &questions {
            let all = q
                .context
                .iter()
                .chain(q.endings.iter().flat_map(|(e, _)| e));
            if let Some(&bad) = all.clone().find(|&&x| x >= v) {
                return Err(CliError::usage(format!(
                    "error: --choices {}:{}: token id {bad}, and the model's vocabulary has {v} ids: score with the tokenizer the model was trained with",
                    path.display(),
                    q.line
                )));
            }
        }
    }
    let g = fusec_compiler::driver::token_losses_graph(&loaded.compiled)
        .map_err(|e| CliError::usage(format!("error: {file}: {e}")))?;
    let mut step = super::open::open_step(&g, &loaded, "scoring", &dims, args.cpu, args.gpu)?;
    super::checkpoints::restore_weights(step.as_mut(), &args.weights, args.name_map.as_deref())?;
    let bar = indicatif::ProgressBar::new(questions.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("scoring {pos}/{len} questions {wide_bar} {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let (mut right, mut right_norm) = (0usize, 0usize);
    let mut predictions = Vec::new();
    for q in &questions {
        let mut tokens = vec![0.0; rows * t];
        let mut targets = vec![0.0; rows * t];
        for (i, (e, _)) in q.endings.iter().enumerate() {
            let seq: Vec<u32> = q.context.iter().chain(e).copied().collect();
            for p in 0..seq.len() - 1 {
                tokens[i * t + p] = seq[p] as f64;
                targets[i * t + p] = seq[p + 1] as f64;
            }
        }
        step.set("tokens", &tokens).map_err(runtime_err)?;
        step.set("targets", &targets).map_err(runtime_err)?;
        step.step(0.0, 1).map_err(runtime_err)?;
        let s = scores(q, &step.token_losses().map_err(runtime_err)?, t);
        let pick = best(s.iter().copied());
        let norm = best(
            s.iter()
                .zip(&q.endings)
                .map(|(x, (_, chars))| x / *chars as f64),
        );
        right += usize::from(pick == q.label);
        right_norm += usize::from(norm == q.label);
        predictions
            .push(serde_json::json!({"line": q.line, "scores": s, "pick": pick, "label": q.label}));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let n = questions.len();
    let (acc, acc_norm) = (right as f64 / n as f64, right_norm as f64 / n as f64);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": loaded.compiled.model.graph.name,
                "weights": args.weights.display().to_string(),
                "questions": n,
                "accuracy": acc,
                "accuracy_norm": acc_norm,
                "predictions": predictions,
            })
        );
    } else {
        println!(
            "accuracy {acc:.4} ({right}/{n}), length-normalised {acc_norm:.4} ({right_norm}/{n})"
        );
    }
    Ok(())
}
