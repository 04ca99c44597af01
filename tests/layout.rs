//! Layouts and kernel boundaries, as a reviewer reads them: the layout of
//! every value and the kernel list of the GPT-2 block in snapshots, and the
//! properties the fusion promises for every shipped model (attention reads
//! heads straight out of the fused QKV projection, no transpose or slice
//! is copied in a transformer, GEMMs carry their bias and GELU).

mod common;

use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::print::{layouts, print_layouts, print_program, Layout};
use fusec_compiler::kernel::Body;
use fusec_compiler::ops::Op;

#[test]
fn layout_and_kernels_of_the_gpt2_block() {
    let (name, src) = common::example("gpt2-block.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let p = fuse(&c.optimized);
    insta::assert_snapshot!("gpt2-block.layout", print_layouts(&c.optimized, &p));
    insta::assert_snapshot!("gpt2-block.kernels", print_program(&c.optimized, &p));
}

#[test]
fn transformers_read_heads_in_place_and_copy_nothing() {
    for file in [
        "gpt2-block.dsl",
        "gpt2-small.dsl",
        "llama-small.dsl",
        "bert-encoder.dsl",
    ] {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &[]);
        let g = &c.optimized;
        let p = fuse(g);
        let copies: Vec<&str> = p
            .kernels
            .iter()
            .filter(|k| k.name.ends_with("_copy"))
            .map(|k| k.name.as_str())
            .collect();
        assert!(copies.is_empty(), "{file}: copy kernels {copies:?}");
        let all = layouts(g, &p);
        let layout_of = |v| &all.iter().find(|(x, _)| *x == v).expect("every value").1;
        let mut attentions = 0;
        for k in &p.kernels {
            let Body::Op(n) = k.body else { continue };
            if !matches!(g.g[n].op, Op::Attention(_)) {
                continue;
            }
            attentions += 1;
            for q in g.inputs(n) {
                assert!(
                    matches!(layout_of(q), Layout::View(..) | Layout::Stored(_)),
                    "{file}: attention input {q:?} is {:?}",
                    layout_of(q)
                );
            }
        }
        assert!(attentions > 0, "{file}: no attention kernel");
        // Every matmul followed by a bias add carries it as an epilogue.
        for k in &p.kernels {
            if let Body::Pointwise(_) = k.body {
                let first = &g.g[k.nodes[0]].op;
                let reads_product = g
                    .inputs(k.nodes[0])
                    .iter()
                    .any(|x| matches!(g.g[x.node].op, Op::MatMul(_)) && g.users(*x).len() == 1);
                assert!(
                    !(matches!(first, Op::Binary(_)) && reads_product && k.nodes.len() == 1),
                    "{file}: {} adds to a product outside the GEMM",
                    k.name
                );
            }
        }
    }
}

#[test]
fn gpt2_gemms_carry_bias_gelu_and_residual_epilogues() {
    let (name, src) = common::example("gpt2-small.dsl");
    let c = common::compile_with(&src, &name, &[]);
    let p = fuse(&c.optimized);
    let mut names: Vec<String> = p
        .kernels
        .iter()
        .filter_map(|k| match &k.body {
            Body::Gemm(_, e) => Some(e.name()),
            _ => None,
        })
        .collect();
    names.sort();
    names.dedup();
    assert_eq!(
        names,
        ["bias", "bias+residual", "dgelu", "gelu_aux_bias"],
        "epilogues in use"
    );
}
