//! What docs/snapshots.md tells users to do, done on a shipped model.

use fusec_compiler::driver::generated_kernels;
use fusec_compiler::elaborate::Options;

#[test]
fn my_model_kernels() {
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/dsl-examples/mlp.dsl"))
            .unwrap();
    let kernels = generated_kernels(&source, "my-model", &Options::default())
        .unwrap_or_else(|e| panic!("{}", e.render("models/my-model.dsl", &source)));
    assert!(!kernels.is_empty());
    for (name, text) in kernels {
        insta::assert_snapshot!(name, text);
    }
}
