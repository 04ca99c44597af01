//! What the runtime may read of the compiler: the compiled step
//! (`plan`: the memory plan, its launches, the parameters and ZeRO's
//! pieces, the step's own inputs), the target it was built for, dtypes,
//! and the emitted sources' helpers it compiles kernels with (`emit`'s
//! include expansion, split-GEMM and TMA descriptors). Never the graph, its
//! ops, autodiff, the interpreter, fusion or the stages that make a step
//! (those run before the runtime is handed one: `fusec::backend`). A name
//! of any other compiler module in `runtime/src` fails here, with the file
//! named.

use std::path::Path;

/// The compiler modules a file of the runtime may name.
const ALLOWED: &[&str] = &["dtype", "emit", "plan", "target"];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every `fusec_compiler::MODULE` a source names, grouped imports
/// (`fusec_compiler::{ir, plan::Plan}`) included.
fn named_modules(src: &str) -> Vec<String> {
    let ident = |t: &str| -> String {
        t.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    for (i, m) in src.match_indices("fusec_compiler::") {
        let rest = &src[i + m.len()..];
        let Some(group) = rest.strip_prefix('{') else {
            out.push(ident(rest));
            continue;
        };
        // The group's top-level entries: commas inside nested braces
        // belong to their entry.
        let mut depth = 0;
        let mut start = 0;
        for (k, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    out.push(ident(&group[start..k]));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.push(ident(&group[start..k]));
                    start = k + 1;
                }
                _ => {}
            }
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

#[test]
fn the_runtime_reads_the_compiled_step_alone() {
    let mut files = Vec::new();
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    assert!(files.len() > 10, "{} runtime sources", files.len());
    let mut bad = Vec::new();
    for f in &files {
        let src = std::fs::read_to_string(f).unwrap();
        for m in named_modules(&src) {
            if !ALLOWED.contains(&m.as_str()) {
                bad.push(format!("{}: fusec_compiler::{m}", f.display()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "the runtime reads more of the compiler than the compiled step:\n{}",
        bad.join("\n")
    );
}

/// The scan finds what it looks for (a test that could not fail would
/// pass on any runtime).
#[test]
fn the_scan_finds_a_named_module() {
    let src = "use fusec_compiler::driver::compile;\nlet x = fusec_compiler::passes::Dce;";
    assert_eq!(named_modules(src), ["driver", "passes"]);
    let grouped = "use fusec_compiler::{\n    ir::{Graph, Role},\n    plan::Plan,\n};";
    assert_eq!(named_modules(grouped), ["ir", "plan"]);
    assert!(named_modules("use crate::plan;").is_empty());
}
