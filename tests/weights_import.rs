//! Pretrained weights through a name map (`--init-from FILE --name-map
//! MAP`): a randomly initialised Hugging Face GPT-2 and LLaMA, saved with
//! `save_pretrained`, load into the shipped model files through the shipped
//! maps (dsl-examples/maps), and fusec's first loss on a text equals
//! transformers' on the same windows (fp32, 1e-5 relative). Runs where
//! Python has torch and transformers (it says so and passes over it
//! elsewhere); the errors for weights that do not fit run everywhere.

mod common;

use common::fusec;

const TEXT: &str = "dsl-examples/data/founding-texts.txt";

fn tmp(name: &str) -> std::path::PathBuf {
    common::host::work_dir("weights-import").join(name)
}

/// transformers' loss for a fresh `kind` model saved into `dir`, or `None`
/// where Python lacks torch or transformers.
fn reference(kind: &str, dir: &std::path::Path, windows: u32) -> Option<f64> {
    common::hf_reference(kind, dir, std::path::Path::new(TEXT), 32, windows, None)?["loss"].as_f64()
}

fn first_loss(model: &str, sets: &[&str], weights: &std::path::Path, map: &str) -> f64 {
    let stem = std::path::Path::new(model)
        .file_stem()
        .unwrap()
        .to_string_lossy()
        .to_string();
    let log = tmp(&format!("{stem}.jsonl"));
    let mut args = vec![
        "train",
        model,
        "--cpu",
        "--precision",
        "fp32",
        "--batch",
        "1",
        "--seq",
        "32",
        "--steps",
        "1",
        "--data",
        TEXT,
        "--init-from",
        weights.to_str().unwrap(),
        "--name-map",
        map,
        "--log",
        log.to_str().unwrap(),
    ];
    args.extend_from_slice(sets);
    let (code, _, err) = fusec(&args);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("through dsl-examples/maps/"), "{err}");
    let line = std::fs::read_to_string(&log).unwrap();
    let v: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    v["loss"].as_f64().unwrap()
}

#[test]
fn hugging_face_gpt2_and_llama_load_through_the_shipped_maps() {
    let dir = tmp("hf-gpt2");
    let Some(want) = reference("gpt2", &dir, 1) else {
        return;
    };
    let sets = [
        "--set",
        "layers=2",
        "--set",
        "d=64",
        "--set",
        "n_heads=4",
        "--set",
        "vocab=256",
        "--set",
        "ctx=64",
    ];
    let got = first_loss(
        "dsl-examples/gpt2-small.dsl",
        &sets,
        &dir.join("model.safetensors"),
        "dsl-examples/maps/hf-gpt2.json",
    );
    assert!(
        (got - want).abs() <= 1e-5 * want,
        "GPT-2: fusec {got}, transformers {want}"
    );
    let gpt2 = got;
    // llama-small runs two micro-batches a step: its first loss is the
    // mean over the first two windows.
    let dir = tmp("hf-llama");
    let want = reference("llama", &dir, 2).expect("transformers imported a moment ago");
    let sets = [
        "--set",
        "layers=2",
        "--set",
        "d=64",
        "--set",
        "n_heads=4",
        "--set",
        "n_kv_heads=2",
        "--set",
        "ffn=128",
        "--set",
        "vocab=256",
    ];
    let got = first_loss(
        "dsl-examples/llama-small.dsl",
        &sets,
        &dir.join("model.safetensors"),
        "dsl-examples/maps/hf-llama.json",
    );
    assert!(
        (got - want).abs() <= 1e-5 * want,
        "LLaMA: fusec {got}, transformers {want}"
    );
    println!("first losses equal transformers': GPT-2 {gpt2:.6}, LLaMA {got:.6}");
}

/// `fusec train` of a one-layer llama-small for one step on the text, with `extra`.
fn small_llama(extra: &[&str]) -> (i32, String, String) {
    let mut a = vec![
        "train",
        "dsl-examples/llama-small.dsl",
        "--cpu",
        "--set",
        "layers=1",
        "--set",
        "d=32",
        "--set",
        "n_heads=2",
        "--set",
        "n_kv_heads=1",
        "--set",
        "ffn=64",
        "--set",
        "vocab=256",
        "--batch",
        "1",
        "--seq",
        "8",
        "--steps",
        "1",
        "--data",
        TEXT,
    ];
    a.extend_from_slice(extra);
    fusec(&a)
}

#[test]
fn weights_that_do_not_fit_are_listed_by_name_before_anything_runs() {
    // LLaMA's weights offered to GPT-2: every missing and extra name listed.
    let llama = tmp("llama-init.safetensors");
    let (code, _, err) = small_llama(&["--save-init", llama.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = fusec(&[
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--cpu",
        "--set",
        "layers=1",
        "--set",
        "d=32",
        "--set",
        "n_heads=2",
        "--set",
        "vocab=256",
        "--set",
        "ctx=64",
        "--batch",
        "1",
        "--seq",
        "8",
        "--steps",
        "1",
        "--data",
        TEXT,
        "--init-from",
        llama.to_str().unwrap(),
        "--name-map",
        "dsl-examples/maps/hf-gpt2.json",
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("does not fit the model"), "{err}");
    assert!(err.contains("missing `wte` [256, 32]"), "{err}");
    assert!(
        err.contains("`tok_embeddings` [256, 32] is not a parameter of the model"),
        "{err}"
    );
    assert!(!err.contains("step "), "nothing ran: {err}");
    // A bad map is named.
    let map = tmp("bad-map.json");
    std::fs::write(&map, r#"{"rename": [["a.{i}", "b.{j}"]]}"#).unwrap();
    let (code, _, err) = small_llama(&[
        "--init-from",
        llama.to_str().unwrap(),
        "--name-map",
        map.to_str().unwrap(),
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("`{j}` is not in `a.{i}`"), "{err}");
}
