//! What the runtime may read of the compiler: the compiled step and what
//! runs it (the plan, kernels, the lowering that makes them, the emitted
//! sources' helpers, the device table), the graph and its interpreter for
//! the CPU backend, and the names of the step's inputs. Never the front of
//! the compiler (the model file, its elaboration and passes, the memory
//! budget's search, the twin's export): those belong to the command line.
//! A `use` of one of them in `runtime/src` fails here, with the file named.
//!
//! The allowed set shrinks as the runtime moves to a compiled step of its
//! own; it must not grow.

use std::path::Path;

/// Compiler modules no file of the runtime may name.
const FORBIDDEN: &[&str] = &[
    "diag",
    "driver",
    "dsl",
    "elaborate",
    "export",
    "gradcheck",
    "model",
    "mutants",
    "passes",
    "recompute",
];

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

/// Every `fusec_compiler::MODULE` a source names.
fn named_modules(src: &str) -> Vec<String> {
    src.match_indices("fusec_compiler::")
        .map(|(i, m)| {
            src[i + m.len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

#[test]
fn the_runtime_names_no_front_of_the_compiler() {
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
            if FORBIDDEN.contains(&m.as_str()) {
                bad.push(format!("{}: fusec_compiler::{m}", f.display()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "the runtime names the compiler's front:\n{}",
        bad.join("\n")
    );
}

/// The scan finds what it looks for (a test that could not fail would
/// pass on any runtime).
#[test]
fn the_scan_finds_a_named_module() {
    let src = "use fusec_compiler::driver::compile;\nlet x = fusec_compiler::passes::Dce;";
    assert_eq!(named_modules(src), ["driver", "passes"]);
    assert!(named_modules("use crate::plan;").is_empty());
}
