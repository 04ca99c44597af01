//! The text form of every shipped model's graphs, held in snapshots: the
//! forward graph as elaborated, and the whole training step (forward,
//! backward, clipping, optimizer update). A change to elaboration, autodiff
//! or the printer shows up here as a readable diff.

mod common;

use fusec_compiler::ir::print::print_graph;

const MODELS: &[&str] = &[
    "mlp.dsl",
    "gpt2-block.dsl",
    "gpt2-small.dsl",
    "llama-small.dsl",
    "bert-encoder.dsl",
    "vit-tiny.dsl",
];

#[test]
fn forward_and_training_graphs_of_every_shipped_model() {
    for file in MODELS {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &[]);
        let stem = file.trim_end_matches(".dsl");
        insta::assert_snapshot!(
            format!("{stem}.forward"),
            print_graph(&c.model.graph, Some(&src))
        );
        insta::assert_snapshot!(
            format!("{stem}.train"),
            print_graph(&c.training, Some(&src))
        );
    }
}

#[test]
fn the_text_form_is_stable_across_compiles() {
    let (name, src) = common::example("llama-small.dsl");
    let a = print_graph(&common::compile_with(&src, &name, &[]).training, Some(&src));
    let b = print_graph(&common::compile_with(&src, &name, &[]).training, Some(&src));
    assert_eq!(a, b);
}
