//! Filetests: small graphs written in the IR's text form, each run through
//! the stages its header names and compared with the text written after
//! it. Every `*.fir` file under `tests/filetests/` is one test:
//!
//! ```text
//! ; What the file checks (one or more comment lines).
//! ; run: simplify dce
//! graph t (B)
//! forward:
//!   ...
//! outputs:
//!   ...
//! ; expect:
//! graph t (B)
//! ...
//! ```
//!
//! The stages, in order: any graph pass by its name (`fusec passes` lists
//! them; each is verified after it runs), then optionally `fuse` (the
//! kernel program, as `fusec build --dump kernels` prints it) or `layout`
//! (where each value lives, as `--dump layout`), which end the list; `parse`
//! alone prints the graph as read. The output is the printed graph (or
//! program), or `error: ...` where the text does not parse or a pass
//! breaks the graph. Everything after the `; expect:` line is the expected
//! output. A line `; off: NAME...` turns optimisations of the kernel
//! stages off (`optimisation::Optimisation`, as `--disable-pass` does), to
//! test what the program is without them.
//!
//! `FUSEC_BLESS=1 cargo test --release --test filetests` writes each
//! file's actual output in place of its expected section;
//! `FUSEC_FILETESTS=word` runs only the files whose path contains `word`.

use fusec_compiler::ir::parse::parse_graph;
use fusec_compiler::ir::print::print_graph;
use fusec_compiler::kernel::fuse::fuse_with;
use fusec_compiler::kernel::print::{print_layouts, print_program};
use fusec_compiler::optimisation::{LowerOptions, Optimisation};
use fusec_compiler::passes::{default_pipeline, forward_pipeline, run_pipeline, Pass};
use std::path::{Path, PathBuf};

const RUN: &str = "; run:";
const OFF: &str = "; off:";
const EXPECT: &str = "; expect:";

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for e in entries {
        let path = e.expect("a directory entry").path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|x| x == "fir") {
            out.push(path);
        }
    }
}

/// A file cut at its `; expect:` line: the input (through that line) and
/// the expected output, if the file has one yet.
struct FileTest {
    input: String,
    expected: Option<String>,
}

fn split(text: &str) -> FileTest {
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        at += line.len();
        if line.trim_end() == EXPECT {
            return FileTest {
                input: text[..at].to_string(),
                expected: Some(text[at..].to_string()),
            };
        }
    }
    FileTest {
        input: text.to_string(),
        expected: None,
    }
}

fn pass(name: &str) -> Option<Box<dyn Pass>> {
    forward_pipeline()
        .into_iter()
        .chain(default_pipeline())
        .find(|p| p.name() == name)
}

/// The file's output; `Err` for a file that cannot run (no stages, an
/// unknown one), which blessing cannot mend.
fn run(input: &str) -> Result<String, String> {
    let stages: Vec<&str> = input
        .lines()
        .filter_map(|l| l.trim().strip_prefix(RUN))
        .flat_map(|s| s.split([' ', ',']).filter(|w| !w.is_empty()))
        .collect();
    if stages.is_empty() {
        return Err(format!(
            "no stages: the header needs a line `{RUN} STAGE...`"
        ));
    }
    for (i, s) in stages.iter().enumerate() {
        let last = i + 1 == stages.len();
        let known = match *s {
            "parse" => stages.len() == 1,
            "fuse" | "layout" => last,
            _ => pass(s).is_some(),
        };
        if !known {
            let mut names = fusec_compiler::passes::pass_names();
            names.extend(["fuse", "layout", "parse"]);
            return Err(format!(
                "stage `{s}` is unknown or out of place: the stages are graph passes ({}), then at most one of `fuse` or `layout`; `parse` stands alone",
                names[..names.len() - 3].join(", ")
            ));
        }
    }
    let mut off = Vec::new();
    for o in input
        .lines()
        .filter_map(|l| l.trim().strip_prefix(OFF))
        .flat_map(|s| s.split([' ', ',']).filter(|w| !w.is_empty()))
    {
        let Some(opt) = Optimisation::from_name(o) else {
            let names: Vec<&str> = Optimisation::ALL.iter().map(|x| x.name()).collect();
            return Err(format!(
                "`{OFF} {o}`: no such optimisation; they are: {}",
                names.join(", ")
            ));
        };
        off.push(opt);
    }
    let mut g = match parse_graph(input) {
        Ok(g) => g,
        Err(e) => return Ok(format!("error: {e}\n")),
    };
    let lower = LowerOptions {
        off: off.into_iter().collect(),
        bucket_bytes: None,
    };
    for s in &stages {
        match *s {
            "parse" => {}
            "fuse" => return Ok(print_program(&g, &fuse_with(&g, &lower))),
            "layout" => return Ok(print_layouts(&g, &fuse_with(&g, &lower))),
            _ => {
                let p = pass(s).expect("checked above");
                if let Err(e) = run_pipeline(&mut g, &[p], |_, _| {}) {
                    return Ok(format!("error: {e}\n"));
                }
            }
        }
    }
    Ok(print_graph(&g, None))
}

fn diff(expected: &str, actual: &str) -> String {
    similar::TextDiff::from_lines(expected, actual)
        .unified_diff()
        .context_radius(3)
        .header("expected", "actual")
        .to_string()
}

#[test]
fn filetests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("tests/filetests");
    let mut paths = Vec::new();
    files(&dir, &mut paths);
    paths.sort();
    assert!(!paths.is_empty(), "no *.fir files under {}", dir.display());
    let only = std::env::var("FUSEC_FILETESTS").unwrap_or_default();
    let bless = std::env::var_os("FUSEC_BLESS").is_some_and(|v| v != "0");
    let (mut ran, mut blessed) = (0, Vec::new());
    let mut failures: Vec<(String, String)> = Vec::new();
    for path in &paths {
        let name = path
            .strip_prefix(root)
            .unwrap_or(path)
            .display()
            .to_string();
        if !name.contains(&only) {
            continue;
        }
        ran += 1;
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{name}: {e}"));
        let file = split(&text);
        if !text.starts_with(';') {
            failures.push((
                name,
                "the file must start with a comment saying what it checks".into(),
            ));
            continue;
        }
        let input = file.input.clone();
        let actual = match std::panic::catch_unwind(|| run(&input)) {
            Ok(Ok(out)) => out,
            Ok(Err(why)) => {
                failures.push((name, why));
                continue;
            }
            Err(_) => {
                failures.push((name, "panicked (its message is above)".into()));
                continue;
            }
        };
        let expected = file.expected.as_deref().unwrap_or("");
        if expected.trim_end() == actual.trim_end() {
            continue;
        }
        if bless {
            let mut new = file.input.clone();
            if file.expected.is_none() {
                if !new.ends_with('\n') {
                    new.push('\n');
                }
                new.push_str(EXPECT);
                new.push('\n');
            }
            new.push_str(&actual);
            std::fs::write(path, new).unwrap_or_else(|e| panic!("{name}: {e}"));
            blessed.push(name);
        } else if file.expected.is_none() {
            failures.push((
                name,
                format!("no `{EXPECT}` line; the output is:\n{actual}"),
            ));
        } else {
            failures.push((name, diff(expected, &actual)));
        }
    }
    for name in &blessed {
        println!("blessed {name}");
    }
    println!("{ran} filetests, {} failed", failures.len());
    if !failures.is_empty() {
        let report: Vec<String> = failures
            .iter()
            .map(|(name, why)| format!("---- {name}\n{why}"))
            .collect();
        panic!(
            "{} of {ran} filetests failed (FUSEC_BLESS=1 rewrites the expected output):\n\n{}",
            failures.len(),
            report.join("\n")
        );
    }
}
