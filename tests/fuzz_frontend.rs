//! Fuzzing the front half (lexer, parser, elaboration, autodiff): no input,
//! however broken, may panic or hang. Three sources of inputs: arbitrary
//! text, soups of the language's own tokens, and mutations of the shipped
//! models (which reach deep into elaboration and shape checking).
//!
//! The quick tests run on every `cargo test` (proptest, a few hundred cases
//! each). The long run is ignored by default:
//!
//! ```sh
//! FUSEC_FUZZ_SECONDS=600 cargo test --release --test fuzz_frontend -- --ignored --nocapture
//! ```
//!
//! It mutates the examples for that many seconds, and on a panic or a case
//! slower than 10 s writes the input to `target/fuzz-failure.dsl`.

mod common;

use fusec_compiler::driver::compile;
use fusec_compiler::elaborate::Options;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TOKENS: &[&str] = &[
    "const",
    "dim",
    "input",
    "param",
    "let",
    "block",
    "return",
    "repeat",
    "train",
    "true",
    "false",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    "=",
    "+",
    "-",
    "*",
    "/",
    "@",
    ".",
    "...",
    ";",
    "\n",
    " ",
    "#",
    "x",
    "B",
    "T",
    "w",
    "f32",
    "i32",
    "bf16",
    "0",
    "1",
    "2",
    "-1",
    "3",
    "1e-5",
    "0.02",
    "99999999999999999999",
    "1e400",
    "normal(0.02)",
    "zeros",
    "ones",
    "loss",
    "optimizer",
    "adamw(lr = 1e-3)",
    "sgd(lr = 0.1)",
    "precision",
    "micro_batches",
    "clip_grad_norm",
    "linear",
    "embedding",
    "layernorm",
    "rmsnorm",
    "gelu",
    "softmax",
    "attention",
    "heads",
    "merge_heads",
    "split",
    "concat",
    "reshape",
    "rope",
    "conv2d",
    "cross_entropy",
    "sum",
    "mean",
    "transpose",
    "permute",
    "broadcast",
    "causal_mask",
    "causal = true",
    "axis = -1",
];

fn compile_str(src: &str) {
    let _ = compile(src, "fuzz", &Options::default()).map_err(|f| f.render("fuzz.dsl", src));
}

fn examples() -> Vec<String> {
    common::tiny_models()
        .iter()
        .map(|(f, _, _)| common::example(f).1)
        .collect()
}

/// One random edit: delete, duplicate or replace a span, or insert a token.
fn mutate(rng: &mut impl Rng, src: &str) -> String {
    let chars: Vec<char> = src.chars().collect();
    let n = chars.len().max(1);
    let a = rng.random_range(0..n);
    let b = (a + rng.random_range(0..40)).min(chars.len());
    let mut out: Vec<char> = chars[..a.min(chars.len())].to_vec();
    match rng.random_range(0..5) {
        0 => {}
        1 => out.extend_from_slice(&chars[a.min(chars.len())..b]),
        2 => out.extend(TOKENS[rng.random_range(0..TOKENS.len())].chars()),
        3 => {
            let c = char::from_u32(rng.random_range(0..0x11000)).unwrap_or('\u{fffd}');
            out.push(c);
        }
        _ => out.extend(chars[a.min(chars.len())..b].iter().rev()),
    }
    let rest = if rng.random_bool(0.5) {
        b
    } else {
        a.min(chars.len())
    };
    out.extend_from_slice(&chars[rest..]);
    out.into_iter().collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_text_never_panics(s in "\\PC{0,300}") {
        compile_str(&s);
    }

    #[test]
    fn token_soup_never_panics(toks in proptest::collection::vec(0..TOKENS.len(), 0..80)) {
        let s: String = toks.iter().map(|&i| TOKENS[i]).collect::<Vec<_>>().join(" ");
        compile_str(&s);
    }

    #[test]
    fn mutated_examples_never_panic(seed in any::<u64>(), which in 0usize..6, edits in 1usize..6) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let ex = examples();
        let mut s = ex[which % ex.len()].clone();
        for _ in 0..edits {
            s = mutate(&mut rng, &s);
        }
        compile_str(&s);
    }
}

#[test]
fn pathological_inputs_fail_cleanly_and_fast() {
    let cases: Vec<String> = vec![
        "(".repeat(100_000),
        "let x = ".to_string() + &"-".repeat(100_000) + "1",
        format!("# {}\n", "a".repeat(10_000_000)),
        format!("const x = {}", "1".repeat(100_000)),
        format!("let x = {}", "f(".repeat(50_000)),
        "param w: [10000000000, 10000000000] = zeros\ntrain { loss = sum(w) }".into(),
        "const a = 9223372036854775807\nconst b = a * a\n".into(),
        "block f(x) { return g(x) }\nblock g(x) { return f(x) }\nparam w: [2] = ones\nlet y = f(w)\ntrain { loss = sum(y) }".into(),
        "\u{0}\u{1}\u{7f}\u{feff}€𝄞".repeat(1000),
    ];
    for c in cases {
        let start = Instant::now();
        let r = compile(&c, "p", &Options::default());
        assert!(
            r.is_err(),
            "accepted a pathological input of {} bytes",
            c.len()
        );
        let _ = r.map_err(|f| f.render("p.dsl", &c));
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "took {:?} on an input of {} bytes",
            start.elapsed(),
            c.len()
        );
    }
}

#[test]
#[ignore = "long-running; set FUSEC_FUZZ_SECONDS"]
fn long_fuzz_run() {
    let secs: u64 = std::env::var("FUSEC_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let seed: u64 = std::env::var("FUSEC_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let failure_path = common::root().join("target").join("fuzz-failure.dsl");
    let current = Arc::new(Mutex::new(String::new()));
    let started = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    {
        // Watchdog: a case slower than 10 s counts as a hang.
        let (current, started, path) = (current.clone(), started.clone(), failure_path.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(500));
            let s = started.load(Ordering::SeqCst);
            if s > 0 && t0.elapsed().as_millis() as u64 > s + 10_000 {
                let input = current.lock().map(|c| c.clone()).unwrap_or_default();
                let _ = std::fs::write(&path, &input);
                eprintln!(
                    "HANG: a case ran over 10 s; input written to {}",
                    path.display()
                );
                std::process::exit(1);
            }
        });
    }
    std::panic::set_hook(Box::new(|_| {}));
    let ex = examples();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (mut cases, mut accepted) = (0u64, 0u64);
    while t0.elapsed() < Duration::from_secs(secs) {
        let mut s = ex[rng.random_range(0..ex.len())].clone();
        for _ in 0..rng.random_range(1..8) {
            s = mutate(&mut rng, &s);
        }
        if let Ok(mut c) = current.lock() {
            c.clone_from(&s);
        }
        started.store(t0.elapsed().as_millis() as u64 + 1, Ordering::SeqCst);
        let r = std::panic::catch_unwind(|| {
            compile(&s, "fuzz", &Options::default())
                .map(|_| ())
                .map_err(|f| f.render("fuzz.dsl", &s))
        });
        started.store(0, Ordering::SeqCst);
        match r {
            Ok(Ok(())) => accepted += 1,
            Ok(Err(_)) => {}
            Err(_) => {
                let _ = std::fs::write(&failure_path, &s);
                let _ = std::panic::take_hook();
                panic!(
                    "PANIC after {cases} cases; input written to {}",
                    failure_path.display()
                );
            }
        }
        cases += 1;
    }
    let _ = std::panic::take_hook();
    println!("fuzzed {cases} inputs in {:.0} s ({accepted} compiled, the rest were rejected with a diagnostic); no panic, no hang", t0.elapsed().as_secs_f64());
}
