//! The compiler's top-level modules form layers: no module imports one that
//! imports it back, so each stage can be read, tested and changed without
//! the ones above it. The one cycle allowed is the IR itself: a graph holds
//! ops, and an op's shape and gradient rules read and build graphs (as
//! Cranelift's `ir` holds its instruction set). A new import that closes a
//! loop (an op writing CUDA through `emit`, the interpreter calling the
//! compiler's passes...) fails here with the files that make it.

use petgraph::algo::tarjan_scc;
use petgraph::graphmap::DiGraphMap;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The cycles the design allows: a graph and its op set.
const ALLOWED: &[&[&str]] = &[&["ir", "ops"]];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("compiler/src is readable") {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `crate::name` paths outside the file's unit tests (which may reach
/// anywhere: a test of the emitter builds models with the elaborator).
fn imports(text: &str) -> BTreeSet<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        // `fusec_compiler::` or `$crate::` are not this crate's paths.
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let name: String = code[at + "crate::".len()..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            found.insert(name);
        }
    }
    found
}

/// Module -> module -> the files whose imports make that edge.
type Edges = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

fn module_edges(src: &Path) -> Edges {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut edges = Edges::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let first = rel.components().next().unwrap().as_os_str();
        let module = first.to_string_lossy().trim_end_matches(".rs").to_string();
        if module == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        for target in imports(&text) {
            if target != module {
                edges
                    .entry(module.clone())
                    .or_default()
                    .entry(target)
                    .or_default()
                    .insert(rel.display().to_string());
            }
        }
    }
    edges
}

/// The cycles of the module graph, each as its sorted module names.
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    let mut g = DiGraphMap::<&str, ()>::new();
    for (from, tos) in edges {
        for to in tos.keys() {
            g.add_edge(from.as_str(), to.as_str(), ());
        }
    }
    let mut found: Vec<Vec<String>> = tarjan_scc(&g)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut names: Vec<String> = c.iter().map(|s| s.to_string()).collect();
            names.sort();
            names
        })
        .collect();
    found.sort();
    found
}

fn describe(cycle: &[String], edges: &Edges) -> String {
    let mut out = format!("cycle among {cycle:?}:\n");
    for from in cycle {
        for (to, files) in &edges[from] {
            if cycle.contains(to) {
                let files: Vec<&str> = files.iter().map(|s| s.as_str()).collect();
                out += &format!("  {from} -> {to}: {}\n", files.join(", "));
            }
        }
    }
    out
}

#[test]
fn the_compiler_modules_import_each_other_only_downwards() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = module_edges(&src);
    // The scan sees the tree: the pipeline's stages are all there.
    for stage in [
        "dsl",
        "elaborate",
        "autodiff",
        "passes",
        "kernel",
        "emit",
        "plan",
    ] {
        assert!(edges.contains_key(stage), "no imports found in {stage}/");
    }
    let allowed: Vec<Vec<String>> = ALLOWED
        .iter()
        .map(|c| c.iter().map(|s| s.to_string()).collect())
        .collect();
    let unexpected: Vec<String> = cycles(&edges)
        .iter()
        .filter(|c| !allowed.contains(c))
        .map(|c| describe(c, &edges))
        .collect();
    assert!(unexpected.is_empty(), "{}", unexpected.join("\n"));
}

#[test]
fn the_scan_finds_a_cycle_where_there_is_one() {
    let mut edges = Edges::new();
    let mut add = |a: &str, b: &str| {
        edges
            .entry(a.to_string())
            .or_default()
            .entry(b.to_string())
            .or_default()
            .insert(format!("{a}/x.rs"));
    };
    add("ops", "ir");
    add("ir", "ops");
    add("emit", "ops");
    add("ops", "emit");
    add("plan", "emit");
    assert_eq!(cycles(&edges), vec![vec!["emit", "ir", "ops"]]);
    assert_eq!(
        imports("use crate::emit::cuda;\nfusec_compiler::x; $crate::y; crate::ir::Graph"),
        BTreeSet::from(["emit".to_string(), "ir".to_string()])
    );
}
