//! The CUDA C that fusec generates for every shipped model, held in
//! snapshots. Layers repeat, so each distinct kernel appears once, headed by
//! the names of every launch that runs it; the text is byte-identical
//! across runs. The build report of GPT-2 small at B=8, T=1024 for an H100
//! (with its tensor-core attention kernels) is held too.

mod common;

use fusec_compiler::emit::cuda::emit_program;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::plan::plan_with;
use fusec_compiler::plan::roofline::device;
use fusec_compiler::select::{select, Target};
use std::collections::BTreeMap;

const MODELS: &[&str] = &[
    "mlp.dsl",
    "gpt2-block.dsl",
    "gpt2-small.dsl",
    "llama-small.dsl",
    "bert-encoder.dsl",
    "vit-tiny.dsl",
];

fn distinct_kernels(file: &str) -> String {
    let (name, src) = common::example(file);
    let c = common::compile_with(&src, &name, &[]);
    let program = fuse(&c.optimized);
    // Kernel text without its name and without source positions (which
    // differ per layer), in first-launch order.
    let mut order: Vec<String> = Vec::new();
    let mut names: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (kname, text) in emit_program(&c.optimized, &program, None) {
        let key = text.replace(&kname, "KERNEL");
        if !names.contains_key(&key) {
            order.push(key.clone());
        }
        names.entry(key).or_default().push(kname);
    }
    let mut out = String::new();
    for key in order {
        let ks = &names[&key];
        out.push_str(&format!(
            "// ===== {} launch(es): {}\n",
            ks.len(),
            ks.join(" ")
        ));
        out.push_str(&key);
        out.push('\n');
    }
    out
}

#[test]
fn generated_cuda_of_every_shipped_model() {
    for file in MODELS {
        let text = distinct_kernels(file);
        assert_eq!(
            text,
            distinct_kernels(file),
            "{file}: emission is not deterministic"
        );
        insta::assert_snapshot!(file.trim_end_matches(".dsl"), text);
    }
}

/// The build report of a shipped model at B = 8, T = 1024, as `fusec build
/// --device h100` writes it (the Hopper attention kernels), each kernel with
/// the lines of the model file its ops come from.
fn attributed_report(file: &str) -> String {
    let (name, src) = common::example(file);
    let c = common::compile_with(&src, &name, &[]);
    let program = fuse(&c.optimized);
    let dims = BTreeMap::from([("B".to_string(), 8), ("T".to_string(), 1024)]);
    let target = Target::for_device("h100", false).unwrap();
    let selection = select(&c.optimized, &program, &target, None);
    let p = plan_with(&c.optimized, &program, Some(&selection), &dims).unwrap();
    fusec_compiler::plan::report::report_with_source(
        &c.optimized,
        &program,
        &p,
        c.training.g.node_count(),
        device("h100").unwrap(),
        Some((&name, &src)),
        None,
    )
}

#[test]
fn build_report_of_gpt2_small() {
    insta::assert_snapshot!("gpt2-small.report", attributed_report("gpt2-small.dsl"));
}

#[test]
fn build_report_of_gpt2_block() {
    insta::assert_snapshot!("gpt2-block.report", attributed_report("gpt2-block.dsl"));
}

/// Every kernel in the report of every shipped model names the lines of the
/// model file its ops come from.
#[test]
fn every_kernel_in_every_shipped_report_names_its_source_lines() {
    for (file, sets, dims) in common::tiny_models() {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        let program = fuse(&c.optimized);
        let dims: BTreeMap<String, i64> = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let p = plan_with(&c.optimized, &program, None, &dims).unwrap();
        let text = fusec_compiler::plan::report::report_with_source(
            &c.optimized,
            &program,
            &p,
            c.training.g.node_count(),
            device("h100").unwrap(),
            Some((&name, &src)),
            None,
        );
        let rows: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with("kernels in launch order"))
            .skip(1)
            .filter(|l| l.starts_with("  k"))
            .collect();
        assert_eq!(rows.len(), program.kernels.len(), "{file}");
        for r in rows {
            assert!(r.contains(&format!("@{file}:")), "{file}: {r}");
        }
    }
}

/// Every kernel of every model file in the repository has something to run
/// it on a GPU (generated code, cuBLASLt, a template or a collective), for
/// both kernel families and in fp32 as well as the file's own precision: a
/// kernel with nothing would stop `fusec train` at its first step.
#[test]
fn every_kernel_of_every_model_file_has_code_to_run_it() {
    use fusec_compiler::emit::flash::FlashArch;
    use fusec_compiler::select::Choice;
    let root = common::root();
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    for dir in ["dsl-examples", "tests/models", "tests/models/twins"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "dsl") {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut checked = 0;
    for path in &files {
        let src = std::fs::read_to_string(path).unwrap();
        for precision in [None, Some(fusec_compiler::ir::DType::F32)] {
            let name = path.display().to_string();
            let opts = fusec_compiler::elaborate::Options {
                precision,
                ..Default::default()
            };
            let c = fusec_compiler::driver::compile(&src, "m", &opts)
                .unwrap_or_else(|f| panic!("{}", f.render(&name, &src)));
            let program = fuse(&c.optimized);
            for arch in [None, Some(FlashArch::Sm80), Some(FlashArch::Sm90a)] {
                let target = Target {
                    arch,
                    deterministic: false,
                    multiprocessors: 132,
                    f32_math: Default::default(),
                    lower: Default::default(),
                };
                let s = select(&c.optimized, &program, &target, None);
                for (k, choice) in program.kernels.iter().zip(&s.choices) {
                    assert!(
                        !matches!(choice, Choice::Missing),
                        "{name} ({precision:?}, {arch:?}): kernel {} has nothing to run it",
                        k.name
                    );
                }
                checked += 1;
            }
        }
    }
    println!(
        "{} model files, {checked} selections: every kernel runs",
        files.len()
    );
    assert!(files.len() >= 15);
}
