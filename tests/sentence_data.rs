//! `fusec train` on sentences as a user runs it, on the CPU reference: the
//! shipped translator on the shipped English-German pairs and the shipped
//! BERT classifier on the shipped labelled sentences (both made small with
//! `--set`), their losses falling; a resumed run reading on from the batch
//! where the first stopped; what `--save-data` records of a padded batch;
//! and bad data files named by file and line.

mod common;

use common::fusec;
use std::path::{Path, PathBuf};

const PAIRS: &str = "dsl-examples/data/pairs-en-de.tsv";
const SENTIMENT: &str = "dsl-examples/data/sentiment.tsv";
const TOKENIZER: &str = "dsl-examples/data/tokenizer-sentences.json";

/// The translator, small: 1 + 1 layers of width 32 over the shipped
/// tokenizer's 793 ids (a vocabulary of 800).
const TRANSLATOR: &[&str] = &[
    "train",
    "dsl-examples/translator.dsl",
    "--cpu",
    "--tokenizer",
    TOKENIZER,
    "--set",
    "d=32",
    "--set",
    "layers=1",
    "--set",
    "n_heads=2",
    "--set",
    "ffn=64",
    "--set",
    "vocab=800",
    "--batch",
    "16",
    "--dim",
    "S=16",
    "--dim",
    "T=16",
    "--lr",
    "3e-3",
    "--schedule",
    "constant",
    "--warmup",
    "0",
];

/// The BERT classifier, small in the same way.
const CLASSIFIER: &[&str] = &[
    "train",
    "dsl-examples/bert-classifier.dsl",
    "--cpu",
    "--tokenizer",
    TOKENIZER,
    "--set",
    "d=32",
    "--set",
    "layers=1",
    "--set",
    "n_heads=2",
    "--set",
    "vocab=800",
    "--set",
    "ctx=32",
    "--batch",
    "16",
    "--dim",
    "T=32",
    "--lr",
    "2e-3",
    "--schedule",
    "constant",
];

fn tmp(name: &str) -> PathBuf {
    common::host::work_dir("sentence-data").join(name)
}

fn train(base: &[&str], extra: &[&str]) -> (i32, String, String) {
    let mut args = base.to_vec();
    args.extend_from_slice(extra);
    fusec(&args)
}

/// Each `--log` line's loss.
fn losses(log: &Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

#[test]
fn the_translator_learns_the_shipped_pairs_and_counts_real_tokens() {
    let log = tmp("translator.jsonl");
    let (code, _, err) = train(
        TRANSLATOR,
        &[
            "--data",
            PAIRS,
            "--steps",
            "60",
            "--log",
            log.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("4000 sentence pairs"), "{err}");
    assert!(err.contains("tok/s (real, not padded)"), "{err}");
    let l = losses(&log);
    // ln(800) = 6.68 at the start; the pairs are regular enough that a
    // tenth of an epoch takes the mean loss well below it.
    assert!(l[0] > 6.0, "{l:?}");
    assert!(
        mean(&l[50..]) < 0.8 * mean(&l[..10]),
        "the loss does not fall: {l:?}"
    );
}

#[test]
fn the_classifier_learns_the_shipped_sentences_under_a_token_budget() {
    let log = tmp("classifier.jsonl");
    let (code, _, err) = train(
        CLASSIFIER,
        &[
            "--data",
            SENTIMENT,
            "--steps",
            "120",
            "--max-tokens",
            "256",
            "--log",
            log.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("3000 labelled sentences"), "{err}");
    assert!(err.contains("at most 256 padded tokens a batch"), "{err}");
    let l = losses(&log);
    // Two classes: ln 2 = 0.69 at the start.
    assert!((l[0] - 0.69).abs() < 0.15, "{l:?}");
    assert!(
        mean(&l[70..]) < 0.85 * mean(&l[..10]),
        "the loss does not fall: {l:?}"
    );
}

#[test]
fn a_resumed_run_reads_on_from_the_batch_where_the_first_stopped() {
    let (whole, first, second) = (tmp("whole.jsonl"), tmp("first.jsonl"), tmp("second.jsonl"));
    let ck = tmp("pairs.safetensors");
    let run = |extra: &[&str]| {
        let mut a = vec!["--data", PAIRS];
        a.extend_from_slice(extra);
        let (code, _, err) = train(TRANSLATOR, &a);
        assert_eq!(code, 0, "{err}");
    };
    run(&["--steps", "6", "--log", whole.to_str().unwrap()]);
    run(&[
        "--steps",
        "3",
        "--log",
        first.to_str().unwrap(),
        "--save",
        ck.to_str().unwrap(),
    ]);
    run(&[
        "--steps",
        "3",
        "--log",
        second.to_str().unwrap(),
        "--resume",
        ck.to_str().unwrap(),
    ]);
    let mut resumed = losses(&first);
    resumed.extend(losses(&second));
    assert_eq!(
        resumed,
        losses(&whole),
        "dropout, batches and schedule all follow the step"
    );
}

#[test]
fn a_padded_batch_holds_lengths_padding_and_ignored_targets() {
    let saved = tmp("batches.safetensors");
    let (code, _, err) = train(
        TRANSLATOR,
        &[
            "--data",
            PAIRS,
            "--steps",
            "1",
            "--save-data",
            saved.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let bytes = std::fs::read(&saved).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| -> (Vec<usize>, Vec<i32>) {
        let t = st.tensor(name).unwrap();
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (t.shape().to_vec(), v)
    };
    let (shape, src) = ints("src");
    assert_eq!(shape, vec![1, 16, 16]);
    let (_, src_len) = ints("src_len");
    let (_, tgt_in) = ints("tgt_in");
    let (_, tgt_len) = ints("tgt_len");
    let (_, tgt_out) = ints("tgt_out");
    // The shipped tokenizer's <pad>, <s> and </s> are 0, 1 and 2; the
    // translator ignores target 0.
    for r in 0..16 {
        let (ls, lt) = (src_len[r] as usize, tgt_len[r] as usize);
        assert!(ls > 1 && lt > 1, "row {r}: every row holds a pair");
        assert_eq!(
            src[r * 16 + ls - 1],
            2,
            "row {r}: the source ends with </s>"
        );
        assert!(
            src[r * 16 + ls..(r + 1) * 16].iter().all(|&x| x == 0),
            "row {r}: padding"
        );
        assert_eq!(tgt_in[r * 16], 1, "row {r}: the target begins with <s>");
        assert_eq!(
            tgt_out[r * 16 + lt - 1],
            2,
            "row {r}: the target ends with </s>"
        );
        assert_eq!(
            &tgt_in[r * 16 + 1..r * 16 + lt],
            &tgt_out[r * 16..r * 16 + lt - 1]
        );
        assert!(tgt_out[r * 16 + lt..(r + 1) * 16].iter().all(|&x| x == 0));
    }
    // Bucketing: the batch's lengths are close together.
    let spread = src_len.iter().max().unwrap() - src_len.iter().min().unwrap();
    assert!(spread <= 3, "source lengths {src_len:?}");
}

/// A data file in the temp folder.
fn data(name: &str, text: &str) -> String {
    let p = tmp(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

fn fails(base: &[&str], extra: &[&str], want: &str) {
    let (code, _, err) = train(base, extra);
    assert_ne!(code, 0, "{extra:?} should fail");
    assert!(err.contains(want), "{extra:?}: wanted `{want}` in:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_sentence_data_is_named_by_file_and_line() {
    let no_tab = data("no-tab.tsv", "A dog.\tEin Hund.\nA cat. Eine Katze.\n");
    fails(
        TRANSLATOR,
        &["--data", &no_tab],
        "no-tab.tsv:2: no tab between the source and the target",
    );
    let long = data(
        "long.tsv",
        &format!("a\tb\n{}\tc\n", "the dog sees the ball ".repeat(6)),
    );
    fails(
        TRANSLATOR,
        &["--data", &long],
        "long.tsv:2: the source with its end token has",
    );
    fails(TRANSLATOR, &["--data", &long], "--dim S=");
    let label = data("label.tsv", "Good film.\t1\nBad film.\t2\n");
    fails(
        CLASSIFIER,
        &["--data", &label],
        "label.tsv:2: label 2 is out of range: the model has 2 classes",
    );
    let word = data("word.tsv", "Good film.\tyes\n");
    fails(
        CLASSIFIER,
        &["--data", &word],
        "word.tsv:1: the label `yes` is not a class number",
    );
    // Without a tokenizer: the model's inputs say what it reads.
    let mut no_tok: Vec<&str> = TRANSLATOR.to_vec();
    let at = no_tok.iter().position(|a| *a == "--tokenizer").unwrap();
    no_tok.drain(at..at + 2);
    fails(
        &no_tok,
        &["--data", PAIRS],
        "reads sentence pairs (inputs src, src_len, tgt_in, tgt_len, tgt_out); give --tokenizer",
    );
    // Two files line by line must match.
    let a = data("a.txt", "one\ntwo\n");
    let b = data("b.txt", "eins\n");
    fails(
        TRANSLATOR,
        &["--data", &a, "--data-target", &b],
        "has 2 lines and",
    );
    fails(
        CLASSIFIER,
        &["--data", SENTIMENT, "--data-target", &b],
        "--data-target gives the targets of sentence pairs",
    );
    // A budget below the longest sentence, and a budget for token windows.
    fails(
        TRANSLATOR,
        &["--data", PAIRS, "--max-tokens", "4"],
        "below the longest sentence",
    );
    let (code, _, err) = fusec(&[
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--cpu",
        "--data",
        "dsl-examples/data/founding-texts.txt",
        "--max-tokens",
        "64",
        "--set",
        "layers=1",
        "--set",
        "d=32",
        "--set",
        "n_heads=2",
        "--batch",
        "1",
        "--seq",
        "8",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--max-tokens sets how many sentences a batch holds"),
        "{err}"
    );
}

#[test]
fn two_files_line_by_line_train_as_one_tab_separated_file() {
    let text = std::fs::read_to_string(common::root().join(PAIRS)).unwrap();
    let (src, tgt): (Vec<&str>, Vec<&str>) =
        text.lines().map(|l| l.split_once('\t').unwrap()).unzip();
    let (a, b) = (
        data("src.en", &src.join("\n")),
        data("tgt.de", &tgt.join("\n")),
    );
    let (one, two) = (tmp("one.jsonl"), tmp("two.jsonl"));
    for (extra, log) in [
        (vec!["--data", PAIRS], &one),
        (vec!["--data", &a, "--data-target", &b], &two),
    ] {
        let mut args = extra.clone();
        args.extend(["--steps", "3", "--log", log.to_str().unwrap()]);
        let (code, _, err) = train(TRANSLATOR, &args);
        assert_eq!(code, 0, "{err}");
    }
    assert_eq!(losses(&one), losses(&two));
}
