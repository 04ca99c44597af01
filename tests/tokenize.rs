//! `fusec tokenize` and `fusec train --tokenizer`: a byte-level BPE
//! tokenizer trained here (no downloads exist here) on a few MB of real
//! text (the Python standard library's sources), the text turned into llm.c
//! shards, and the shards decoded back into exactly the text. Where the
//! Python `tokenizers` package imports, its ids for the same tokenizer.json
//! must be fusec's.

mod common;

use common::fusec;
use std::path::{Path, PathBuf};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer, TokenizerBuilder,
};

fn tmp(name: &str) -> PathBuf {
    common::host::work_dir("tokenize").join(name)
}

/// Text files to tokenize: about 3 MB of the Python standard library
/// (sorted, so every run sees the same), or this repository's sources
/// where Python is not installed.
fn corpus() -> Vec<PathBuf> {
    let stdlib = std::process::Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['stdlib'])",
        ])
        .output()
        .ok()
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let mut files = Vec::new();
    let mut walk = |dir: &Path, ext: &str| {
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == ext)
                    && std::fs::read_to_string(&p).is_ok()
                {
                    files.push(p);
                }
            }
        }
    };
    match stdlib.filter(|p| p.join("email").is_dir()) {
        Some(lib) => {
            for sub in [
                "email",
                "json",
                "asyncio",
                "unittest",
                "xml",
                "http",
                "multiprocessing",
            ] {
                walk(&lib.join(sub), "py");
            }
        }
        None => walk(&common::root().join("compiler/src"), "rs"),
    }
    files.sort();
    files
}

/// A byte-level BPE of 1000 tokens, `<|endoftext|>` among them, trained on `files`.
fn train_tokenizer(files: &[PathBuf], out: &Path) {
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(1000)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let byte_level = ByteLevel::new(false, true, true);
    let mut tok = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(byte_level.into()))
    .with_post_processor(Some(byte_level.into()))
    .with_decoder(Some(byte_level.into()))
    .build()
    .unwrap();
    let names = files.iter().map(|p| p.display().to_string()).collect();
    tok.train_from_files(&mut trainer, names).unwrap();
    tok.save(out, false).unwrap();
}

fn shard_ids(path: &Path) -> Vec<u32> {
    fusec_runtime::data::parse_bin(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn text_round_trips_through_shards_and_matches_python_tokenizers() {
    let files = corpus();
    let bytes: u64 = files
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert!(bytes > 500_000, "{} files, {bytes} bytes", files.len());
    let tj = tmp("tokenizer.json");
    train_tokenizer(&files, &tj);
    let out = tmp("shards");
    let _ = std::fs::remove_dir_all(&out);
    let mut args = vec![
        "tokenize".to_string(),
        "--tokenizer".into(),
        tj.display().to_string(),
        "-o".into(),
        out.display().to_string(),
        "--val-fraction".into(),
        "0.1".into(),
        "--shard-tokens".into(),
        "200000".into(),
    ];
    args.extend(files.iter().map(|p| p.display().to_string()));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, stdout, err) = fusec(&argv);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("vocabulary 1000"), "{stdout}");
    // Validation first, then the training shards in order.
    let mut shards: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    shards.sort();
    let val: Vec<&PathBuf> = shards
        .iter()
        .filter(|p| p.to_string_lossy().contains("val_"))
        .collect();
    let train: Vec<&PathBuf> = shards
        .iter()
        .filter(|p| p.to_string_lossy().contains("train_"))
        .collect();
    assert_eq!(val.len(), 1);
    assert!(train.len() >= 2, "{train:?}");
    let mut ids: Vec<u32> = shard_ids(val[0]);
    let n_val = ids.len();
    for t in &train {
        let part = shard_ids(t);
        assert!(part.len() <= 200_000);
        ids.extend(part);
    }
    let share = n_val as f64 / ids.len() as f64;
    assert!((share - 0.1).abs() < 1e-3, "validation share {share}");
    // Documents: each file after one <|endoftext|>, decoded to its text.
    let tok = Tokenizer::from_file(&tj).unwrap();
    let eot = tok.token_to_id("<|endoftext|>").unwrap();
    let docs: Vec<&[u32]> = ids.split(|&t| t == eot).skip(1).collect();
    assert_eq!(docs.len(), files.len());
    for (doc, file) in docs.iter().zip(&files) {
        let text = tok.decode(doc, false).unwrap();
        assert!(
            text == std::fs::read_to_string(file).unwrap(),
            "{} does not decode back to itself",
            file.display()
        );
    }
    println!(
        "{} files, {bytes} bytes, {} tokens ({:.2} bytes a token) round-trip exactly",
        files.len(),
        ids.len(),
        bytes as f64 / ids.len() as f64
    );
    // The Python package's ids for the same tokenizer.json and files.
    let list = tmp("files.txt");
    std::fs::write(
        &list,
        files
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    let py = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys\ntry:\n    from tokenizers import Tokenizer\nexcept ImportError:\n    print('missing'); sys.exit(0)\nt = Tokenizer.from_file(sys.argv[1])\neot = t.token_to_id('<|endoftext|>')\nout = []\nfor f in open(sys.argv[2]).read().split('\\n'):\n    out.append(eot)\n    out.extend(t.encode(open(f, encoding='utf-8').read(), add_special_tokens=False).ids)\nprint(' '.join(map(str, out)))",
            tj.to_str().unwrap(),
            list.to_str().unwrap(),
        ])
        .output();
    match py {
        Ok(o) if o.status.success() => {
            let text = String::from_utf8_lossy(&o.stdout);
            if text.trim() == "missing" {
                common::skip("the comparison: the Python tokenizers package is not installed");
            } else {
                let theirs: Vec<u32> = text
                    .split_whitespace()
                    .map(|x| x.parse().unwrap())
                    .collect();
                assert_eq!(
                    theirs.len(),
                    ids.len(),
                    "Python tokenizers gives another count"
                );
                let first = theirs.iter().zip(&ids).position(|(a, b)| a != b);
                assert_eq!(first, None, "first differing id at {first:?}");
                println!("Python tokenizers gives the same {} ids", ids.len());
            }
        }
        other => common::skip(&format!("the comparison: python3 did not run ({other:?})")),
    }
}

#[test]
fn train_reads_text_through_a_tokenizer_and_bad_input_is_named() {
    let files: Vec<PathBuf> = corpus().into_iter().take(20).collect();
    let tj = tmp("small-tokenizer.json");
    train_tokenizer(&files, &tj);
    let data = files[0].display().to_string();
    let (code, _, err) = fusec(&[
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--cpu",
        "--set",
        "vocab=1024",
        "--set",
        "layers=1",
        "--set",
        "d=32",
        "--set",
        "n_heads=2",
        "--set",
        "ctx=32",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "3",
        "--data",
        &data,
        "--tokenizer",
        tj.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("step     3/3"), "{err}");
    // A vocabulary too small for the tokenizer's ids is named.
    let (code, _, err) = fusec(&[
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--cpu",
        "--set",
        "vocab=256",
        "--set",
        "layers=1",
        "--set",
        "d=32",
        "--set",
        "n_heads=2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "1",
        "--data",
        &data,
        "--tokenizer",
        tj.to_str().unwrap(),
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("outside the model's vocabulary of 256"),
        "{err}"
    );
    // Not UTF-8; no tokenizer file; a tokenizer for random data.
    let bad = tmp("bad.txt");
    std::fs::write(&bad, b"ok \xff\xfe").unwrap();
    let out = tmp("bad-out");
    let (code, _, err) = fusec(&[
        "tokenize",
        bad.to_str().unwrap(),
        "--tokenizer",
        tj.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("is not UTF-8 text (invalid byte at offset 3)"),
        "{err}"
    );
    let (code, _, err) = fusec(&[
        "tokenize",
        &data,
        "--tokenizer",
        "no-such.json",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no tokenizer file at no-such.json"), "{err}");
    let (code, _, err) = fusec(&[
        "train",
        "dsl-examples/mlp.dsl",
        "--cpu",
        "--batch",
        "2",
        "--data",
        "random",
        "--tokenizer",
        tj.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--data random has none"), "{err}");
}

/// The shipped tokenizer (docs/walkthrough.md) reads and round-trips the
/// shipped text.
#[test]
fn the_shipped_tokenizer_round_trips_the_shipped_text() {
    let out = tmp("shipped");
    let (code, stdout, err) = fusec(&[
        "tokenize",
        "--tokenizer",
        "dsl-examples/data/tokenizer-512.json",
        "dsl-examples/data/founding-texts.txt",
        "-o",
        out.to_str().unwrap(),
        "--val-fraction",
        "0.1",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("vocabulary 512"), "{stdout}");
    let tok =
        Tokenizer::from_file(common::root().join("dsl-examples/data/tokenizer-512.json")).unwrap();
    let mut ids = shard_ids(&out.join("val_000000.bin"));
    ids.extend(shard_ids(&out.join("train_000000.bin")));
    assert_eq!(ids[0], tok.token_to_id("<|endoftext|>").unwrap());
    let text = tok.decode(&ids[1..], false).unwrap();
    assert_eq!(
        text,
        std::fs::read_to_string(common::root().join("dsl-examples/data/founding-texts.txt"))
            .unwrap()
    );
}
