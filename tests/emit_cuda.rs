//! The CUDA C that fusec generates, held in snapshots: every generated
//! kernel of GPT-2's block (the unit GPT-2 small repeats) and of the MLP,
//! concatenated in launch order. Byte-identical across runs.

mod common;

use fusec_compiler::emit::cuda::emit_program;
use fusec_compiler::kernel::fuse::fuse;

fn kernels_of(file: &str) -> String {
    let (name, src) = common::example(file);
    let c = common::compile_with(&src, &name, &[]);
    let program = fuse(&c.optimized);
    emit_program(&c.optimized, &program, Some(&src))
        .into_iter()
        .map(|(_, text)| text)
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn generated_cuda_of_shipped_models() {
    for file in ["mlp.dsl", "gpt2-block.dsl"] {
        let text = kernels_of(file);
        assert_eq!(
            text,
            kernels_of(file),
            "{file}: emission is not deterministic"
        );
        insta::assert_snapshot!(file.trim_end_matches(".dsl"), text);
    }
}
