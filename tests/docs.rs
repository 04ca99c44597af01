//! The language reference (docs/dsl.md) stays true to the compiler.
//!
//! Fenced blocks in the reference follow the convention stated at its top:
//!
//! - ```` ```dsl ```` is a complete model file (it has a `train {` section)
//!   and must compile;
//! - ```` ```dsl fragment ```` is a piece of a model and is not compiled;
//! - ```` ```dsl error ```` is a complete model that must fail to compile;
//!   when a ```` ```text ```` block follows it directly, its first line is
//!   the first line of the error (`error: ...`).
//!
//! Every builtin function must be documented: its name in backticks or in a
//! heading, and a heading whose text is its signature as `sig` spells it.

use fusec_compiler::driver::compile;
use fusec_compiler::elaborate::builtins::BUILTINS;
use fusec_compiler::elaborate::Options;
use std::path::PathBuf;

const DOC: &str = "docs/dsl.md";

fn doc() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(DOC);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One fenced code block.
struct Fence {
    /// The info string after the opening backticks: `dsl`, `dsl fragment`, `text`.
    info: String,
    /// 1-based line of the opening ```.
    line: usize,
    body: String,
}

fn fences(text: &str) -> Vec<Fence> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(info) = lines[i].strip_prefix("```") else {
            i += 1;
            continue;
        };
        let open = i;
        let mut body = String::new();
        i += 1;
        while i < lines.len() && lines[i].trim_end() != "```" {
            body.push_str(lines[i]);
            body.push('\n');
            i += 1;
        }
        assert!(
            i < lines.len(),
            "{DOC}:{}: the code block is never closed",
            open + 1
        );
        out.push(Fence {
            info: info.trim().to_string(),
            line: open + 1,
            body,
        });
        i += 1;
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Model,
    Fragment,
    Error,
}

/// The kind of a ```dsl block, or None for other languages.
fn kind(f: &Fence) -> Option<Kind> {
    let mut words = f.info.split_whitespace();
    if words.next() != Some("dsl") {
        return None;
    }
    Some(match words.next() {
        None => Kind::Model,
        Some("fragment") => Kind::Fragment,
        Some("error") => Kind::Error,
        Some(other) => panic!(
            "{DOC}:{}: unknown kind `{other}` of dsl block; use ```dsl, ```dsl fragment or ```dsl error",
            f.line
        ),
    })
}

/// The block's text preceded by blank lines, so that a diagnostic's
/// line numbers are the reference's own.
fn source_at_doc_lines(f: &Fence) -> String {
    format!("{}{}", "\n".repeat(f.line), f.body)
}

#[test]
fn every_complete_model_in_the_reference_compiles() {
    let fences = fences(&doc());
    let mut failures = Vec::new();
    let mut compiled = 0;
    for f in &fences {
        if kind(f) != Some(Kind::Model) {
            continue;
        }
        if !f.body.contains("train {") {
            failures.push(format!(
                "{DOC}:{}: this ```dsl block has no `train {{` section, so it is not a complete model; \
                 mark it ```dsl fragment",
                f.line
            ));
            continue;
        }
        let src = source_at_doc_lines(f);
        match compile(&src, "doc", &Options::default()) {
            Ok(_) => compiled += 1,
            Err(e) => failures.push(format!(
                "{DOC}:{}: the model in this block does not compile:\n{}",
                f.line,
                e.render(DOC, &src)
            )),
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
    assert!(
        compiled >= 10,
        "only {compiled} complete models found in {DOC}"
    );
}

#[test]
fn every_error_example_in_the_reference_fails_as_shown() {
    let fences = fences(&doc());
    let text = doc();
    let lines: Vec<&str> = text.lines().collect();
    let mut failures = Vec::new();
    let mut checked = 0;
    for (i, f) in fences.iter().enumerate() {
        if kind(f) != Some(Kind::Error) {
            continue;
        }
        let src = source_at_doc_lines(f);
        let rendered = match compile(&src, "doc", &Options::default()) {
            Ok(_) => {
                failures.push(format!(
                    "{DOC}:{}: this ```dsl error block compiles, but it is shown as an error",
                    f.line
                ));
                continue;
            }
            Err(e) => e.render(DOC, &src),
        };
        checked += 1;
        // The ```text block right after it (only blank lines between) shows the message.
        let Some(next) = fences.get(i + 1) else {
            continue;
        };
        let end = f.line + f.body.lines().count() + 1; // 1-based line of the closing ```
        let between = &lines[end..next.line - 1];
        if next.info != "text" || !between.iter().all(|l| l.trim().is_empty()) {
            continue;
        }
        let shown = next.body.lines().next().unwrap_or("");
        let actual = rendered.lines().next().unwrap_or("");
        if shown != actual {
            failures.push(format!(
                "{DOC}:{}: the error shown is\n    {shown}\nbut fusec says\n    {actual}\nfull error:\n{rendered}",
                next.line
            ));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
    assert!(checked > 0, "no ```dsl error blocks found in {DOC}");
}

#[test]
fn every_builtin_is_documented() {
    let text = doc();
    let headings: Vec<&str> = text.lines().filter(|l| l.starts_with('#')).collect();
    let mut missing = Vec::new();
    for b in BUILTINS.iter() {
        let word = |s: &str| {
            s.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .any(|w| w == b.name)
        };
        let in_backticks =
            text.contains(&format!("`{}`", b.name)) || text.contains(&format!("`{}(", b.name));
        let in_heading = headings.iter().any(|h| word(h));
        if !in_backticks && !in_heading {
            missing.push(format!("`{}` is not mentioned", b.name));
            continue;
        }
        let sig_heading = format!("`{}`", b.sig);
        if !headings.iter().any(|h| h.contains(&sig_heading)) {
            missing.push(format!(
                "`{}` has no heading with its signature; expected a heading containing {sig_heading}",
                b.name
            ));
        }
    }
    assert!(
        missing.is_empty(),
        "{DOC} is missing builtins (compiler/src/elaborate/builtins.rs):\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn every_documented_builtin_exists() {
    // A heading "### `name(...)`" documents a builtin; it must still be one.
    let text = doc();
    let stale: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("### `"))
        .filter_map(|rest| {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest[name.len()..].starts_with('(').then_some(name)
        })
        .filter(|name| !BUILTINS.iter().any(|b| b.name == name))
        .collect();
    assert!(
        stale.is_empty(),
        "{DOC} documents functions that are not builtins: {}",
        stale.join(", ")
    );
}

#[test]
fn the_convention_is_stated_at_the_top() {
    let text = doc();
    assert!(
        text.starts_with("<!--"),
        "{DOC} should open with the HTML comment that states its code-block convention"
    );
    let comment = &text[..text.find("-->").expect("the comment is closed")];
    for kind in ["```dsl ", "```dsl fragment", "```dsl error"] {
        assert!(
            comment.contains(kind),
            "the comment at the top of {DOC} does not explain {kind}"
        );
    }
}

/// A ```` ```text ```` block that starts with `$ fusec check ...` or
/// `$ fusec passes` shows that command's output, exactly: the test runs it.
#[test]
fn command_transcripts_match_the_binary() {
    let text = doc();
    let mut checked = 0;
    for f in fences(&text).into_iter().filter(|f| f.info == "text") {
        let Some((first, expected)) = f.body.split_once('\n') else {
            continue;
        };
        let Some(cmd) = first.strip_prefix("$ fusec ") else {
            continue;
        };
        let args: Vec<&str> = cmd.split_whitespace().collect();
        if !matches!(args.first(), Some(&"check") | Some(&"passes")) {
            continue;
        }
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fusec"))
            .args(&args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("fusec runs");
        let got = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            got.trim_end(),
            expected.trim_end(),
            "{DOC}:{}: the transcript of `fusec {cmd}` differs from what the command prints",
            f.line
        );
        checked += 1;
    }
    assert!(checked > 0, "no command transcript found in {DOC}");
}
