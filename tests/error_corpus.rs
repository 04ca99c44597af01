//! The error corpus: every file in `tests/errors/` is a small model with one
//! mistake (its first line says which). Each must fail to compile, and its
//! rendered message is held in a snapshot, `tests/snapshots/error_corpus__<file>.snap`,
//! so that any change to what a person sees is reviewed. Every message must
//! name the file, line and column and show a caret under the place.
//!
//! After changing a message: `INSTA_UPDATE=always cargo test --release --test error_corpus`
//! (or `cargo insta review`), then read the changed snapshots.

use fusec_compiler::driver::compile;
use fusec_compiler::elaborate::Options;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The corpus covers every category of mistake; it must not quietly shrink.
const MIN_FILES: usize = 45;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `(file name, source)` for every `tests/errors/*.dsl`, sorted by name.
fn corpus() -> Vec<(String, String)> {
    let dir = root().join("tests").join("errors");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "dsl"))
        .map(|p| {
            let name = p
                .file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned();
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (name, text)
        })
        .collect();
    files.sort();
    files
}

fn stem(file: &str) -> &str {
    file.strip_suffix(".dsl").unwrap_or(file)
}

/// The path a message names, as the command line shows it when run from the repository root.
fn shown_path(file: &str) -> String {
    format!("tests/errors/{file}")
}

/// Compiles a corpus file, which must fail, and renders the failure.
fn rendered(file: &str, source: &str) -> String {
    match compile(source, stem(file), &Options::default()) {
        Ok(_) => panic!(
            "tests/errors/{file} compiled, but it is meant to fail: {}",
            source.lines().next().unwrap_or("")
        ),
        Err(failure) => failure.render(&shown_path(file), source),
    }
}

/// The `LINE:COL` after the first `--> tests/errors/<file>:`, if any.
fn location(text: &str, path: &str) -> Option<(usize, usize)> {
    let at = text.find(&format!("--> {path}:"))? + "--> ".len() + path.len() + 1;
    let rest = &text[at..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit() && c != ':')
        .unwrap_or(rest.len());
    let (line, col) = rest[..end].split_once(':')?;
    Some((line.parse().ok()?, col.parse().ok()?))
}

/// Whether some source-gutter line holds a caret: `  |     ^^^ label`.
fn has_caret(text: &str) -> bool {
    text.lines()
        .filter_map(|l| l.split_once('|'))
        .any(|(gutter, rest)| {
            gutter.trim().chars().all(|c| c.is_ascii_digit()) && rest.contains('^')
        })
}

#[test]
fn every_broken_model_fails_with_a_located_message() {
    let files = corpus();
    assert!(
        files.len() >= MIN_FILES,
        "the error corpus has {} files; it should have at least {MIN_FILES}",
        files.len()
    );
    let mut problems = Vec::new();
    for (file, source) in &files {
        assert!(
            source.starts_with('#'),
            "tests/errors/{file}: the first line should be a comment saying what is wrong"
        );
        let text = rendered(file, source);
        let path = shown_path(file);
        match location(&text, &path) {
            // Line 1 is the comment; a mistake is never there.
            Some((line, col)) if line > 1 && col >= 1 => {}
            other => problems.push(format!(
                "{path}: no `--> {path}:LINE:COL` past line 1 (found {other:?}) in\n{text}"
            )),
        }
        if !has_caret(&text) {
            problems.push(format!("{path}: no caret line in\n{text}"));
        }
        if text.contains("internal error") {
            problems.push(format!("{path}: reported as an internal error:\n{text}"));
        }
        insta::assert_snapshot!(stem(file), text);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

/// A snapshot whose corpus file was renamed or removed is stale: remove it.
#[test]
fn every_snapshot_has_its_corpus_file() {
    let files: Vec<String> = corpus()
        .into_iter()
        .map(|(f, _)| stem(&f).to_string())
        .collect();
    let dir = root().join("tests").join("snapshots");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    let mut stale = Vec::new();
    for entry in entries {
        let name = entry
            .expect("a directory entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        if let Some(snap) = name
            .strip_prefix("error_corpus__")
            .and_then(|n| n.strip_suffix(".snap"))
        {
            if !files.iter().any(|f| f == snap) {
                stale.push(name);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "snapshots without a tests/errors/ file: {stale:?}"
    );
}

fn fusec(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_fusec"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("runs fusec")
}

#[test]
fn fusec_check_prints_the_same_message_and_exits_1() {
    for file in ["matmul-inner-mismatch.dsl", "error-inside-block.dsl"] {
        let path = shown_path(file);
        let source =
            std::fs::read_to_string(root().join(Path::new(&path))).expect("reads the corpus file");
        let expected = rendered(file, &source);
        let out = fusec(&["check", &path]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "fusec check {path}: stderr:\n{stderr}"
        );
        assert_eq!(stderr.trim_end(), expected.trim_end(), "fusec check {path}");
        assert!(
            out.stdout.is_empty(),
            "fusec check {path} printed to stdout on failure"
        );
    }
}

#[test]
fn fusec_check_of_a_missing_file_exits_2() {
    let out = fusec(&["check", "tests/errors/no-such-file.dsl"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(
        stderr.contains("tests/errors/no-such-file.dsl"),
        "the message should name the file:\n{stderr}"
    );
}

/// Compiles text that must fail, and renders the failure.
fn failure_of(source: &str) -> String {
    match compile(source, "model", &Options::default()) {
        Ok(_) => panic!("compiled, but it is meant to fail"),
        Err(failure) => failure.render("model.dsl", source),
    }
}

const HEADER: &str = "const d = 8\ndim B\ninput x: f32[B, d]\nparam w: [d, d] = normal(0.02)\n";
const TRAIN: &str = "train {\n    loss = mean(y)\n}\n";

#[test]
fn a_long_line_is_shown_as_a_window_with_the_true_column() {
    let terms = vec!["gelu(x @ w)"; 60].join(" + ");
    let line = format!("let y = {terms} + gelu(x @ v) + {terms}");
    let col = line.find("x @ v").expect("the mistake") + "x @ ".len() + 1;
    let text = failure_of(&format!("{HEADER}{line}\n{TRAIN}"));
    assert!(text.contains(&format!("--> model.dsl:5:{col}\n")), "{text}");
    assert!(text.contains("gelu(x @ v)"), "the place is shown:\n{text}");
    assert!(
        text.len() < 1500,
        "the 1,700-character line is cut:\n{text}"
    );
    // A 1 MB name appears cut short, in the message and under the caret.
    let name = "a".repeat(1 << 20);
    let text = failure_of(&format!("{HEADER}let y = {name}\n{TRAIN}"));
    assert!(text.starts_with("error: unknown name `aaaa"), "{text}");
    assert!(text.len() < 2000, "{} bytes", text.len());
}

#[test]
fn thousands_of_errors_are_counted_not_all_shown() {
    let unused: String = (0..5000)
        .map(|i| format!("param p{i}: [d] = zeros\n"))
        .collect();
    let start = std::time::Instant::now();
    let text = failure_of(&format!("{HEADER}{unused}let y = x @ w\n{TRAIN}"));
    assert!(text.contains("parameter `p0` gets no gradient"), "{text}");
    assert!(
        text.contains("4980 more errors are not shown (the first 20 are above)"),
        "{text}"
    );
    assert!(
        start.elapsed().as_secs_f64() < 5.0,
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn pathological_models_fail_cleanly() {
    // A chain of 10,000 blocks, each calling the next: no stack overflow.
    let mut chain = String::from(HEADER);
    for i in 0..10_000 {
        chain += &format!("block b{i}(x) {{\n    return b{}(x)\n}}\n", i + 1);
    }
    chain += &format!("block b10000(x) {{\n    return x\n}}\nlet y = b0(x @ w)\n{TRAIN}");
    assert!(failure_of(&chain).contains("blocks nested too deeply"));
    // Blocks each nesting their call of the next deep inside an expression.
    let mut deep = String::from(HEADER);
    let wrap = |inner: &str| format!("{}{inner}{}", "gelu(".repeat(150), ")".repeat(150));
    for i in 0..8 {
        deep += &format!(
            "block b{i}(x) {{\n    return {}\n}}\n",
            wrap(&format!("b{}(x)", i + 1))
        );
    }
    deep += &format!("block b8(x) {{\n    return x\n}}\nlet y = b0(x @ w)\n{TRAIN}");
    assert!(failure_of(&deep).contains("nested too deeply"));
    // Splitting into 10^12 parts, a huge `repeat`, a parameter of 10^18 elements.
    let cases = [
        "let y = sum(split(x @ w, 1000000000000)[0])\n",
        "block l(x) {\n    param v: [d, d] = zeros\n    return x + x @ v\n}\nblock m(x) {\n    return repeat 10000 l(x)\n}\nlet y = repeat 10000 m(x @ w)\n",
        "param big: [1000000000, 1000000000] = zeros\nlet y = x @ w + sum(big)\n",
        "let y = mean(broadcast(x @ w, [4294967296, 4294967296, B, d]))\n",
    ];
    for body in cases {
        let start = std::time::Instant::now();
        let text = failure_of(&format!("{HEADER}{body}{TRAIN}"));
        assert!(text.starts_with("error: "), "{text}");
        assert!(!text.contains("internal error"), "{text}");
        assert!(
            start.elapsed().as_secs_f64() < 5.0,
            "{body}: took {:?}",
            start.elapsed()
        );
    }
}
