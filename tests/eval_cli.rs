//! `fusec eval` on the CPU reference: the loss and perplexity of known
//! weights over a token file, against the cross-entropy computed here
//! from the same weights, and what it says of input it cannot use.

mod common;

use common::fusec;
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    common::host::work_dir("eval-cli").join(name)
}

const FEATURES: usize = 8;

/// A bigram language model of `vocab` ids: logits = emb[token] @ w.
fn bigram(vocab: usize, extra_input: bool) -> PathBuf {
    let model = tmp(&format!("bigram-{vocab}-{extra_input}.dsl"));
    let extra = if extra_input {
        "input mask: f32[B, T]\n"
    } else {
        ""
    };
    let loss = if extra_input {
        "cross_entropy(embedding(emb, tokens) @ w, targets) + sum(mask) * 0.0"
    } else {
        "cross_entropy(embedding(emb, tokens) @ w, targets)"
    };
    std::fs::write(
        &model,
        format!(
            "dim B, T\ninput tokens: i32[B, T]\ninput targets: i32[B, T]\n{extra}\
             param emb: [{vocab}, {FEATURES}] = normal(0.1)\nparam w: [{FEATURES}, {vocab}] = normal(0.1)\n\
             train {{\n loss = {loss}\n optimizer = adamw(lr = 1e-2)\n}}\n"
        ),
    )
    .unwrap();
    model
}

fn weights(n: usize, seed: u64) -> Vec<f32> {
    common::drawn_f32(n, seed)
}

/// A checkpoint of `tensors` (name, shape, values) in the temp folder.
fn checkpoint(name: &str, tensors: &[(&str, Vec<usize>, &[f32])]) -> PathBuf {
    let path = tmp(name);
    common::write_safetensors(&path, tensors);
    path
}

/// The mean cross-entropy of the bigram over consecutive windows of
/// `t + 1` tokens (at most `limit`), in f64 from the f32 weights.
fn reference(tokens: &[u8], emb: &[f32], w: &[f32], vocab: usize, t: usize, limit: usize) -> f64 {
    let windows = ((tokens.len() - 1) / t).min(limit);
    let (mut sum, mut n) = (0.0, 0usize);
    for i in 0..windows {
        for k in 0..t {
            let (x, y) = (tokens[i * t + k] as usize, tokens[i * t + k + 1] as usize);
            let logits: Vec<f64> = (0..vocab)
                .map(|v| {
                    (0..FEATURES)
                        .map(|f| emb[x * FEATURES + f] as f64 * w[f * vocab + v] as f64)
                        .sum()
                })
                .collect();
            let max = logits.iter().cloned().fold(f64::MIN, f64::max);
            let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            sum += lse - logits[y];
            n += 1;
        }
    }
    sum / n as f64
}

fn eval_json(model: &Path, weights: &Path, data: &Path, extra: &[&str]) -> serde_json::Value {
    let mut a = vec![
        "eval",
        model.to_str().unwrap(),
        "--weights",
        weights.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--cpu",
        "--json",
    ];
    a.extend_from_slice(extra);
    let (code, out, err) = fusec(&a);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// Every window of a 100-byte file (19 windows of 5: six batches of 3 and
/// one window alone), and the first two batches' with --max-batches,
/// against the cross-entropy computed here; a batch of 1 gives the same.
/// Tolerance 1e-5 relative: the CPU reference rounds each op's result to
/// f32 as stored (about 6e-8 relative each), the reference does not.
#[test]
fn the_loss_over_every_window_is_the_cross_entropy_of_the_weights() {
    let vocab = 256;
    let model = bigram(vocab, false);
    let (emb, w) = (weights(vocab * FEATURES, 1), weights(FEATURES * vocab, 2));
    let ck = checkpoint(
        "bigram.safetensors",
        &[
            ("emb", vec![vocab, FEATURES], &emb),
            ("w", vec![FEATURES, vocab], &w),
        ],
    );
    let data = tmp("bytes.txt");
    let text: Vec<u8> = (0..100u32).map(|i| ((i * 37 + 11) % 251) as u8).collect();
    std::fs::write(&data, &text).unwrap();
    for (extra, windows) in [
        (&["--batch", "3", "--seq", "5"][..], 19),
        (&["--batch", "1", "--seq", "5"][..], 19),
        (&["--batch", "3", "--seq", "5", "--max-batches", "2"][..], 6),
    ] {
        let got = eval_json(&model, &ck, &data, extra);
        let want = reference(&text, &emb, &w, vocab, 5, windows);
        let loss = got["loss"].as_f64().unwrap();
        assert!(
            (loss - want).abs() <= 1e-5 * want,
            "{extra:?}: {loss} against {want}"
        );
        let ppl = got["perplexity"].as_f64().unwrap();
        assert!(
            (ppl - want.exp()).abs() <= 1e-5 * want.exp(),
            "{extra:?}: {ppl}"
        );
        assert_eq!(got["windows"], windows, "{extra:?}");
        assert_eq!(got["tokens"], windows * 5, "{extra:?}");
    }
    // Without --json: one sentence, naming what was left out.
    let (code, out, err) = fusec(&[
        "eval",
        model.to_str().unwrap(),
        "--weights",
        ck.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--cpu",
        "--batch",
        "4",
        "--seq",
        "7",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("loss "), "{out}");
    assert!(
        out.contains("over 98 tokens (14 windows of 7; 1 tokens after"),
        "{out}"
    );
}

/// Weights that do not fit (names listed), ids beyond the vocabulary, a
/// file shorter than a window, a model whose inputs are not a token
/// file's: each said, with a non-zero exit.
#[test]
fn what_eval_cannot_use_is_named() {
    let vocab = 64;
    let model = bigram(vocab, false);
    let emb = weights(vocab * FEATURES, 3);
    let half = checkpoint("half.safetensors", &[("emb", vec![vocab, FEATURES], &emb)]);
    let data = tmp("short.txt");
    std::fs::write(&data, b"\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a").unwrap();
    let run = |model: &Path, ck: &Path, data: &Path, seq: &str| {
        let (code, _, err) = fusec(&[
            "eval",
            model.to_str().unwrap(),
            "--weights",
            ck.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--cpu",
            "--batch",
            "2",
            "--seq",
            seq,
        ]);
        assert_ne!(code, 0, "{err}");
        err
    };
    let err = run(&model, &half, &data, "3");
    assert!(err.contains("missing `w` [8, 64]"), "{err}");
    let w = weights(FEATURES * vocab, 4);
    let full = checkpoint(
        "full.safetensors",
        &[
            ("emb", vec![vocab, FEATURES], &emb),
            ("w", vec![FEATURES, vocab], &w),
        ],
    );
    let err = run(&model, &full, &data, "12");
    assert!(
        err.contains("has 10 tokens; one window of --seq 12 needs 13"),
        "{err}"
    );
    let wide = tmp("wide.txt");
    std::fs::write(&wide, b"\x01\x02\x03\x50\x05\x06\x07").unwrap();
    let err = run(&model, &full, &wide, "3");
    assert!(
        err.contains("token 3 is id 80, and the model's vocabulary has 64 ids"),
        "{err}"
    );
    let masked = bigram(vocab, true);
    let err = run(&masked, &full, &data, "3");
    assert!(
        err.contains("reads a token file into a language model's `tokens` and `targets`"),
        "{err}"
    );
    assert!(err.contains("mask: f32[B, T]"), "{err}");
}

/// Random Hugging Face GPT-2 and grouped-query LLaMA weights through the
/// shipped name maps, on the first 6 x 32 + 1 bytes of the shipped text:
/// eval's loss over its six windows (a batch of 4, then two alone) is
/// transformers' within 1e-5 relative in fp32 (the two differ by f32
/// rounding in different orders: about 1e-7 a value, summed over two
/// layers). Needs Python with torch and transformers (else a skip, said);
/// on the CPU, or on a GPU with FUSEC_EVAL_GPU set.
#[test]
fn eval_matches_transformers_through_the_name_maps() {
    let on_gpu = std::env::var_os("FUSEC_EVAL_GPU").is_some();
    let text = tmp("six-windows.txt");
    let all = std::fs::read(common::root().join("dsl-examples/data/founding-texts.txt")).unwrap();
    std::fs::write(&text, &all[..6 * 32 + 1]).unwrap();
    for (kind, model, map, sets) in [
        (
            "gpt2",
            "dsl-examples/gpt2-small.dsl",
            "dsl-examples/maps/hf-gpt2.json",
            &["layers=2", "d=64", "n_heads=4", "vocab=256", "ctx=64"][..],
        ),
        (
            "llama",
            "dsl-examples/llama-small.dsl",
            "dsl-examples/maps/hf-llama.json",
            &[
                "layers=2",
                "d=64",
                "n_heads=4",
                "n_kv_heads=2",
                "ffn=128",
                "vocab=256",
            ][..],
        ),
    ] {
        let dir = tmp(&format!("hf-{kind}"));
        let Some(reference) = common::hf_reference(kind, &dir, &text, 32, 6, None) else {
            return;
        };
        let want = reference["loss"].as_f64().unwrap();
        let weights = dir.join("model.safetensors");
        let mut a = vec![
            "eval",
            model,
            "--weights",
            weights.to_str().unwrap(),
            "--name-map",
            map,
            "--data",
            text.to_str().unwrap(),
            "--precision",
            "fp32",
            "--batch",
            "4",
            "--seq",
            "32",
            "--json",
        ];
        if !on_gpu {
            a.push("--cpu");
        }
        for s in sets {
            a.extend(["--set", s]);
        }
        let (code, out, err) = fusec(&a);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        let got = v["loss"].as_f64().unwrap();
        assert_eq!(v["windows"], 6);
        assert!(
            (got - want).abs() <= 1e-5 * want,
            "{kind}: fusec eval {got}, transformers {want}"
        );
        println!(
            "{kind}: fusec eval {got:.8} ({}), transformers {want:.8}, relative {:.1e}",
            if on_gpu { "GPU" } else { "CPU" },
            (got - want).abs() / want
        );
    }
}

/// `fusec eval --choices`: each ending's score is the sum of its bytes'
/// log-probabilities after the context, computed here from the bigram's
/// weights in f64 (tolerance 1e-5 relative, the CPU reference's f32
/// rounding as above); the picks and both accuracies follow from them.
/// Questions of 3 and 4 endings of several lengths share the step's 4
/// rows. On the GPU too where there is one.
#[test]
fn multiple_choice_scores_are_the_endings_log_probabilities() {
    let vocab = 256;
    let model = bigram(vocab, false);
    let (emb, w) = (weights(vocab * FEATURES, 3), weights(FEATURES * vocab, 4));
    let ck = checkpoint(
        "choices.safetensors",
        &[
            ("emb", vec![vocab, FEATURES], &emb),
            ("w", vec![FEATURES, vocab], &w),
        ],
    );
    let logp = |x: u8, y: u8| -> f64 {
        let logits: Vec<f64> = (0..vocab)
            .map(|v| {
                (0..FEATURES)
                    .map(|f| emb[x as usize * FEATURES + f] as f64 * w[f * vocab + v] as f64)
                    .sum()
            })
            .collect();
        let max = logits.iter().cloned().fold(f64::MIN, f64::max);
        let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
        logits[y as usize] - lse
    };
    let questions: Vec<(&str, Vec<&str>, usize)> = vec![
        ("The cat sat on", vec![" the mat.", " a hat", " xyzzy!"], 0),
        (
            "We hold these",
            vec![" truths", " rocks to be", " q", " self-evident"],
            3,
        ),
        ("A", vec!["bc", "zz", "b"], 2),
    ];
    let file = tmp("questions.jsonl");
    let lines: Vec<String> = questions
        .iter()
        .map(|(c, e, l)| serde_json::json!({"context": c, "endings": e, "label": l}).to_string())
        .collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let mut want_right = (0, 0);
    let mut want_scores = Vec::new();
    for (c, endings, label) in &questions {
        let s: Vec<f64> = endings
            .iter()
            .map(|e| {
                let seq: Vec<u8> = c.bytes().chain(e.bytes()).collect();
                (c.len() - 1..seq.len() - 1)
                    .map(|p| logp(seq[p], seq[p + 1]))
                    .sum()
            })
            .collect();
        let best = |xs: Vec<f64>| (0..xs.len()).fold(0, |b, i| if xs[i] > xs[b] { i } else { b });
        want_right.0 += usize::from(best(s.clone()) == *label);
        let norm = s
            .iter()
            .zip(endings)
            .map(|(x, e)| x / e.chars().count() as f64)
            .collect();
        want_right.1 += usize::from(best(norm) == *label);
        want_scores.push(s);
    }
    // Not every question right nor every one wrong: the accuracy means something.
    assert!(want_right.0 > 0 && want_right.0 < 3, "{want_right:?}");
    let mut places = vec!["--cpu"];
    if fusec_runtime::device::driver_present() {
        places.push("--gpu=0");
    } else {
        common::skip("the GPU half of the multiple-choice check: no CUDA driver");
    }
    for place in places {
        let (code, out, err) = fusec(&[
            "eval",
            model.to_str().unwrap(),
            "--weights",
            ck.to_str().unwrap(),
            "--choices",
            file.to_str().unwrap(),
            place,
            "--json",
        ]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["questions"], 3);
        let acc = v["accuracy"].as_f64().unwrap();
        assert!(
            (acc - want_right.0 as f64 / 3.0).abs() < 1e-12,
            "{place}: {v}"
        );
        let norm = v["accuracy_norm"].as_f64().unwrap();
        assert!(
            (norm - want_right.1 as f64 / 3.0).abs() < 1e-12,
            "{place}: {v}"
        );
        for (p, want) in v["predictions"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&want_scores)
        {
            let got: Vec<f64> = p["scores"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs(),
                    "{place}: score {g}, want {w}"
                );
            }
        }
    }
    // Bad questions: said with the file and line.
    let bad = tmp("bad.jsonl");
    std::fs::write(&bad, "{\"context\": \"a\", \"endings\": [\"b\", \"c\"], \"label\": 0}\n{\"context\": \"a\", \"endings\": [\"b\", \"c\"], \"label\": 2}\n").unwrap();
    let (code, _, err) = fusec(&[
        "eval",
        model.to_str().unwrap(),
        "--weights",
        ck.to_str().unwrap(),
        "--choices",
        bad.to_str().unwrap(),
        "--cpu",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("bad.jsonl:2") && err.contains("\"label\""),
        "{err}"
    );
}
