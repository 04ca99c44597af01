//! The CUDA C that fusec generates for every shipped model, held in
//! snapshots. Layers repeat, so each distinct kernel appears once, headed by
//! the names of every launch that runs it; the text is byte-identical
//! across runs. The build report of GPT-2 small at B=8, T=1024 for an H100
//! (with its tensor-core attention kernels) is held too.

mod common;

use fusec_compiler::emit::cuda::emit_program;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::plan::roofline::device;
use fusec_compiler::plan::{plan_with, report::report};
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

#[test]
fn build_report_of_gpt2_small() {
    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let program = fuse(&c.optimized);
    let dims = BTreeMap::from([("B".to_string(), 8), ("T".to_string(), 1024)]);
    // As `fusec build --device h100` reports it: the Hopper attention kernels.
    let target = Target::for_device("h100", false).unwrap();
    let selection = select(&c.optimized, &program, &target, None);
    let p = plan_with(&c.optimized, &program, Some(&selection), &dims).unwrap();
    insta::assert_snapshot!(
        "gpt2-small.report",
        report(
            &c.optimized,
            &program,
            &p,
            c.training.g.node_count(),
            device("h100").unwrap()
        )
    );
}
