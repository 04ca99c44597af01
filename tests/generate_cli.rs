//! `fusec generate` on the CPU reference (the decode step the GPU runs,
//! interpreted): greedy continuations against the argmax computed here
//! from known weights and against transformers' `generate(do_sample=False)`,
//! repeatable sampling, and what it refuses.

mod common;

use common::fusec;
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    common::host::work_dir("generate-cli").join(name)
}

const FEATURES: usize = 8;
const VOCAB: usize = 64;

/// A bigram language model: logits = emb[token] @ w.
fn bigram() -> PathBuf {
    let model = tmp("bigram.dsl");
    std::fs::write(
        &model,
        format!(
            "dim B, T\ninput tokens: i32[B, T]\ninput targets: i32[B, T]\n\
             param emb: [{VOCAB}, {FEATURES}] = normal(0.1)\nparam w: [{FEATURES}, {VOCAB}] = normal(0.1)\n\
             train {{\n loss = cross_entropy(embedding(emb, tokens) @ w, targets)\n optimizer = adamw(lr = 1e-2)\n}}\n"
        ),
    )
    .unwrap();
    model
}

fn weights(n: usize, seed: u64) -> Vec<f32> {
    common::drawn_f32(n, seed)
}

fn checkpoint(path: &Path, tensors: &[(&str, Vec<usize>, &[f32])]) {
    common::write_safetensors(path, tensors)
}

/// The generated ids of one `--json` line.
fn ids(line: &str) -> Vec<u32> {
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn generate(model: &Path, ck: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut a = vec![
        "generate",
        model.to_str().unwrap(),
        "--weights",
        ck.to_str().unwrap(),
        "--cpu",
    ];
    a.extend_from_slice(extra);
    fusec(&a)
}

/// Greedy continuation of a bigram from known weights: each next id is the
/// first argmax of emb[last] @ w, computed here in f64 (the logits differ
/// from the CPU reference's f32 by rounding alone; the test's weights leave
/// no two best logits of a row within 1e-4, checked). Sampling: one seed,
/// one continuation; two samples of one prompt differ.
#[test]
fn greedy_follows_the_argmax_and_a_seed_repeats_its_samples() {
    let model = bigram();
    let (emb, w) = (weights(VOCAB * FEATURES, 5), weights(FEATURES * VOCAB, 6));
    let ck = tmp("bigram.safetensors");
    checkpoint(
        &ck,
        &[
            ("emb", vec![VOCAB, FEATURES], &emb),
            ("w", vec![FEATURES, VOCAB], &w),
        ],
    );
    let logits = |x: usize| -> Vec<f64> {
        (0..VOCAB)
            .map(|v| {
                (0..FEATURES)
                    .map(|f| emb[x * FEATURES + f] as f64 * w[f * VOCAB + v] as f64)
                    .sum()
            })
            .collect()
    };
    let mut want = Vec::new();
    let mut last = 7usize;
    for _ in 0..12 {
        let row = logits(last);
        let mut sorted = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert!(
            sorted[0] - sorted[1] > 1e-4,
            "a near tie: pick other weights"
        );
        last = row.iter().position(|&x| x == sorted[0]).unwrap();
        want.push(last as u32);
    }
    let (code, out, err) = generate(
        &model,
        &ck,
        &["--prompt-ids", "3,7", "--max-new-tokens", "12", "--json"],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(ids(out.trim()), want);

    let sample = |seed: &str, n: &str| {
        let (code, out, err) = generate(
            &model,
            &ck,
            &[
                "--prompt-ids",
                "3,7",
                "--max-new-tokens",
                "12",
                "--json",
                "--temperature",
                "1.5",
                "--top-k",
                "20",
                "--seed",
                seed,
                "--num-samples",
                n,
            ],
        );
        assert_eq!(code, 0, "{err}");
        out.lines().map(ids).collect::<Vec<_>>()
    };
    let two = sample("11", "2");
    assert_eq!(two.len(), 2);
    assert_eq!(
        sample("11", "2"),
        two,
        "the same seed draws the same tokens"
    );
    assert_ne!(two[0], two[1], "two samples of one prompt");
    assert_ne!(sample("12", "1")[0], two[0]);
    // A stop id ends the continuation.
    let (_, out, _) = generate(
        &model,
        &ck,
        &[
            "--prompt-ids",
            "3,7",
            "--max-new-tokens",
            "12",
            "--json",
            "--eos-id",
            &want[2].to_string(),
        ],
    );
    assert_eq!(ids(out.trim()), want[..3].to_vec());
}

/// A checkpoint of the small GPT-2 trained for one step here.
fn small_gpt2() -> (Vec<&'static str>, PathBuf) {
    let sets = vec![
        "--set",
        "vocab=256",
        "--set",
        "layers=1",
        "--set",
        "d=32",
        "--set",
        "n_heads=2",
        "--set",
        "ctx=16",
    ];
    let ck = tmp("gpt2.safetensors");
    let mut a = vec![
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--cpu",
        "--data",
        "dsl-examples/data/founding-texts.txt",
        "--batch",
        "1",
        "--seq",
        "16",
        "--steps",
        "1",
        "--save",
        ck.to_str().unwrap(),
    ];
    a.extend_from_slice(&sets);
    let (code, _, err) = fusec(&a);
    assert_eq!(code, 0, "{err}");
    (sets, ck)
}

/// What generate cannot do, said with a non-zero exit: more positions than
/// the model has, an id beyond its vocabulary, weights that do not fit, no
/// --cpu (the GPU decoder is not built), no prompt.
#[test]
fn what_generate_cannot_do_is_said() {
    let (sets, ck) = small_gpt2();
    let run = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "dsl-examples/gpt2-small.dsl",
            "--weights",
            ck.to_str().unwrap(),
        ];
        a.extend_from_slice(&sets);
        a.extend_from_slice(extra);
        let (code, out, err) = fusec(&a);
        (code, out, err)
    };
    let (code, out, err) = run(&["--cpu", "--prompt", "We the", "--max-new-tokens", "5"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("We the") && out.len() > "We the".len(),
        "{out}"
    );
    let (code, _, err) = run(&[
        "--cpu",
        "--prompt",
        "We the People",
        "--max-new-tokens",
        "10",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("make 23 positions, which the model cannot take"),
        "{err}"
    );
    assert!(
        err.contains("this slice [0:23] runs past the end of an axis of 16"),
        "{err}"
    );
    let (code, _, err) = run(&["--cpu", "--prompt-ids", "1,300", "--max-new-tokens", "2"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("token id 300, and the model's vocabulary has 256 ids"),
        "{err}"
    );
    // Attention that is not causal cannot be decoded a token at a time:
    // said at its line and column.
    let open = tmp("open.dsl");
    std::fs::write(
        &open,
        "dim B, T\ninput tokens: i32[B, T]\ninput targets: i32[B, T]\n\
         param emb: [64, 8] = normal(0.1)\nparam w: [8, 24] = normal(0.1)\n\
         let q, k, v = split(embedding(emb, tokens) @ w, 3)\n\
         let y = merge_heads(attention(heads(q, 2), heads(k, 2), heads(v, 2)))\n\
         train {\n loss = cross_entropy(y @ transpose(emb), targets)\n optimizer = adamw(lr = 1e-2)\n}\n",
    )
    .unwrap();
    let (code, _, err) = generate(&open, &tmp("none.safetensors"), &["--prompt-ids", "1"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("this attention is not causal") && err.contains("open.dsl:7:"),
        "{err}"
    );
    let (code, _, err) = run(&["--cpu"]);
    assert_ne!(code, 0);
    assert!(err.contains("give a prompt"), "{err}");
    let bigram_ck = tmp("bigram.safetensors");
    let emb = weights(VOCAB * FEATURES, 5);
    checkpoint(&bigram_ck, &[("emb", vec![VOCAB, FEATURES], &emb)]);
    let (code, _, err) = generate(&bigram(), &bigram_ck, &["--prompt-ids", "1"]);
    assert_ne!(code, 0);
    assert!(err.contains("missing `w` [8, 64]"), "{err}");
}

/// Random Hugging Face GPT-2 and grouped-query LLaMA weights through the
/// shipped name maps: greedy `fusec generate` of 100 tokens after three
/// prompts of 32, 27 and 21 bytes of the shipped text, decoded together
/// (the shorter prompts fed while the longest is), gives the ids
/// transformers' `generate(do_sample=False)` gives each prompt alone, in
/// fp32: on the CPU reference, and on the GPU where there is one. Needs
/// Python with torch and transformers (else a skip, said).
#[test]
fn greedy_ids_match_transformers_generate() {
    let text = "dsl-examples/data/founding-texts.txt";
    for (kind, model, map, sets) in [
        (
            "gpt2",
            "dsl-examples/gpt2-small.dsl",
            "dsl-examples/maps/hf-gpt2.json",
            &["layers=2", "d=64", "n_heads=4", "vocab=256", "ctx=160"][..],
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
        let Some(v) = common::hf_reference(kind, &dir, Path::new(text), 32, 1, Some(100)) else {
            return;
        };
        let list = |key: &str| -> Vec<Vec<u32>> {
            v[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    p.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_u64().unwrap() as u32)
                        .collect()
                })
                .collect()
        };
        let (prompts, want) = (list("prompts"), list("generated"));
        // The prompts as lines of bytes (ASCII, newlines made spaces).
        let lines: Vec<String> = prompts
            .iter()
            .map(|p| p.iter().map(|&b| char::from(b as u8)).collect())
            .collect();
        let file = dir.join("prompts.txt");
        std::fs::write(&file, lines.join("\n")).unwrap();
        let weights = dir.join("model.safetensors");
        let mut places = vec!["--cpu"];
        if gpu_here() {
            places.push("--gpu=0");
        }
        for place in places {
            let mut a = vec![
                "generate",
                model,
                "--weights",
                weights.to_str().unwrap(),
                "--name-map",
                map,
                place,
                "--precision",
                "fp32",
                "--prompts",
                file.to_str().unwrap(),
                "--max-new-tokens",
                "100",
                "--json",
            ];
            for s in sets {
                a.extend(["--set", s]);
            }
            let (code, out, err) = fusec(&a);
            assert_eq!(code, 0, "{err}");
            let got: Vec<Vec<u32>> = out.trim().lines().map(ids).collect();
            assert_eq!(got.len(), 3, "{out}");
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{kind} {place}: prompt {k}");
            }
            println!("{kind} {place}: fusec generate's 3 x 100 greedy ids are transformers'");
        }
    }
}

/// Whether a GPU run belongs here: a CUDA driver is present (required
/// where FUSEC_REQUIRE_GPU is set).
fn gpu_here() -> bool {
    let present = fusec_runtime::device::driver_present();
    assert!(
        present || std::env::var_os("FUSEC_REQUIRE_GPU").is_none(),
        "FUSEC_REQUIRE_GPU is set and there is no CUDA driver"
    );
    if !present {
        common::skip("the GPU half of the transformers check: no CUDA driver");
    }
    present
}

/// A small GPT-2 (`layers`, 64 positions) on the CPU reference: the model
/// file and its options, as `train` and `generate` take them.
fn small_gpt2_model(layers: &str) -> Vec<&str> {
    vec![
        "dsl-examples/gpt2-small.dsl",
        "--set",
        "vocab=256",
        "--set",
        layers,
        "--set",
        "d=32",
        "--set",
        "n_heads=2",
        "--set",
        "ctx=64",
        "--cpu",
    ]
}

/// `fusec train --sample-every 2` prints a greedy continuation after steps
/// 2 and 4 (the last) and logs them; the last is what `fusec generate`
/// makes from the checkpoint the run saves (the same decode step on the
/// same weights, so the same ids). A run with no prompt is refused.
#[test]
fn samples_during_training_are_what_generate_makes_from_the_checkpoint() {
    samples_against_generate("samples", &["--batch", "2"]);
    let mut bad = vec!["train"];
    bad.extend(small_gpt2_model("layers=1"));
    bad.extend([
        "--data",
        "dsl-examples/data/founding-texts.txt",
        "--sample-every",
        "2",
    ]);
    let (code, _, err) = fusec(&bad);
    assert_ne!(code, 0);
    assert!(err.contains("--sample-prompt"), "{err}");
}

/// With data parallelism (two ranks of one row), rank 0's process samples
/// with the weights the ranks hold: at ZeRO stage 1 (each rank's compute
/// copy) and at stage 3 (the weights in pieces, read whole as a checkpoint
/// reads them).
#[test]
fn data_parallel_samples_are_what_generate_makes_from_the_checkpoint() {
    samples_against_generate("samples-dp", &["--batch", "1", "--gpus", "2"]);
    samples_against_generate(
        "samples-dp-z3",
        &["--batch", "1", "--gpus", "2", "--zero", "3"],
    );
}

/// A 4-step run with `batch` sampling after steps 2 and 4; its last sample
/// against `fusec generate` from its checkpoint.
fn samples_against_generate(name: &str, batch: &[&str]) {
    let (log, ck) = (
        tmp(&format!("{name}.jsonl")),
        tmp(&format!("{name}.safetensors")),
    );
    let model = small_gpt2_model("layers=1");
    let mut a = vec!["train"];
    a.extend(&model);
    a.extend(batch);
    a.extend([
        "--data",
        "dsl-examples/data/founding-texts.txt",
        "--seq",
        "16",
        "--steps",
        "4",
        "--lr",
        "3e-3",
        "--sample-every",
        "2",
        "--sample-prompt",
        "The ",
        "--sample-tokens",
        "12",
        "--log",
        log.to_str().unwrap(),
        "--save",
        ck.to_str().unwrap(),
    ]);
    let (code, _, err) = fusec(&a);
    assert_eq!(code, 0, "{err}");
    let printed: Vec<&str> = err.lines().filter(|l| l.contains("sample: ")).collect();
    assert_eq!(printed.len(), 2, "{err}");
    assert!(
        printed[0].contains("step     2/4") && printed[1].contains("step     4/4"),
        "{err}"
    );
    let samples: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            Some(v.get("sample")?.as_str()?.to_string())
        })
        .collect();
    assert_eq!(samples.len(), 2);
    let mut g = vec!["generate"];
    g.extend(&model);
    g.extend([
        "--weights",
        ck.to_str().unwrap(),
        "--prompt",
        "The ",
        "--max-new-tokens",
        "12",
        "--json",
    ]);
    let (code, out, err) = fusec(&g);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["ids"].as_array().unwrap().len(), 12);
    assert_eq!(samples[1], format!("The {}", v["text"].as_str().unwrap()));
}

/// The prefill (every prompt's first tokens in one step of T = the
/// shortest prompt's length less one) writes the caches a token-a-step
/// run writes: a 23-byte prompt alone (a prefill of 22) continues as it
/// does beside a one-byte prompt (no prefill), on freshly drawn weights
/// (whose picks depend on every position).
#[test]
fn a_prefill_gives_what_a_token_a_step_gives() {
    let init = tmp("prefill-init.safetensors");
    let model = small_gpt2_model("layers=2");
    let mut a = vec!["train"];
    a.extend(&model);
    a.extend([
        "--data",
        "dsl-examples/data/founding-texts.txt",
        "--batch",
        "1",
        "--seq",
        "8",
        "--steps",
        "1",
        "--save-init",
        init.to_str().unwrap(),
    ]);
    let (code, _, err) = fusec(&a);
    assert_eq!(code, 0, "{err}");
    // Weights of the same names and shapes drawn wider than the model's
    // initialisers, so that the logits differ by more than rounding and
    // the picks follow the context.
    let bytes = std::fs::read(&init).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut named = st.tensors();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let drawn: Vec<(String, Vec<usize>, Vec<f32>)> = named
        .into_iter()
        .enumerate()
        .map(|(i, (name, t))| {
            let n = t.shape().iter().product();
            (
                name,
                t.shape().to_vec(),
                common::drawn_f32(n, 40 + i as u64),
            )
        })
        .collect();
    let tensors: Vec<(&str, Vec<usize>, &[f32])> = drawn
        .iter()
        .map(|(n, s, v)| (n.as_str(), s.clone(), v.as_slice()))
        .collect();
    common::write_safetensors(&init, &tensors);
    let prompt = "Four score and seven ye";
    let run = |lines: &[&str]| -> Vec<Vec<u32>> {
        let file = tmp(&format!("prefill-{}.txt", lines.len()));
        std::fs::write(&file, lines.join("\n")).unwrap();
        let mut g = vec!["generate"];
        g.extend(&model);
        g.extend([
            "--weights",
            init.to_str().unwrap(),
            "--prompts",
            file.to_str().unwrap(),
            "--max-new-tokens",
            "24",
            "--json",
        ]);
        let (code, out, err) = fusec(&g);
        assert_eq!(code, 0, "{err}");
        out.trim().lines().map(ids).collect()
    };
    let alone = run(&[prompt]);
    let beside = run(&[prompt, "W"]);
    assert_eq!(alone[0], beside[0]);
    // Not one token over and over: the picks follow the context.
    let mut distinct = alone[0].clone();
    distinct.sort();
    distinct.dedup();
    assert!(distinct.len() >= 2, "{:?}", alone[0]);
}
