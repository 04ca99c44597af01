//! Every kernel fusec generates for every shipped model compiles with NVRTC
//! for sm_80 and sm_90, with no register spills. NVRTC runs without a GPU;
//! where libnvrtc is missing the test says so and passes, unless
//! FUSEC_REQUIRE_NVRTC=1 (as CI sets it after installing NVRTC).

mod common;

use fusec_compiler::driver::compile;
use fusec_compiler::elaborate::Options;
use fusec_compiler::emit::cuda::emit_program;
use fusec_compiler::kernel::fuse::fuse;
use fusec_runtime::nvrtc;
use std::collections::BTreeMap;

#[test]
fn every_generated_kernel_compiles_for_sm80_and_sm90_without_spills() {
    if !common::nvrtc_ready() {
        return;
    }
    let dir = common::root().join("dsl-examples");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "dsl"))
        .collect();
    files.sort();
    // And the models of ops no shipped example uses yet.
    files.push(common::root().join("tests/models/encoder-dropout.dsl"));
    files.push(common::root().join("tests/models/ce-rules.dsl"));
    files.push(common::root().join("tests/models/padded-encoder.dsl"));
    // Identical sources (the same kernel in every layer) compile once.
    let mut sources: BTreeMap<String, String> = BTreeMap::new();
    for f in &files {
        let src = std::fs::read_to_string(f).unwrap();
        let c = compile(&src, "m", &Options::default())
            .unwrap_or_else(|e| panic!("{}", e.render("m", &src)));
        let program = fuse(&c.optimized);
        for (name, text) in emit_program(&c.optimized, &program, None) {
            // The name differs per position; compare bodies without it.
            let key = text.replace(&name, "KERNEL");
            sources.entry(key).or_insert(name);
        }
    }
    let mut failures = Vec::new();
    let mut max_regs = 0;
    for (key, name) in &sources {
        let text = key.replace("KERNEL", name);
        for arch in ["sm_80", "sm_90"] {
            match nvrtc::compile(name, &text, arch) {
                Ok(c) => {
                    assert!(!c.image.is_empty(), "{name}: empty cubin");
                    max_regs = max_regs.max(c.registers.unwrap_or(0));
                    if c.spill_store_bytes > 0 || c.spill_load_bytes > 0 {
                        failures.push(format!("{name} ({arch}): spills\n{}", c.log));
                    }
                }
                Err(e) => failures.push(format!(
                    "{e}\n--- source ---\n{}",
                    nvrtc::with_prelude(&text)
                )),
            }
        }
    }
    println!(
        "{} distinct kernels compiled for sm_80 and sm_90; at most {max_regs} registers, no spills",
        sources.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn a_compile_error_names_the_kernel_and_the_line() {
    if !common::nvrtc_ready() {
        return;
    }
    let err = nvrtc::compile(
        "broken",
        "extern \"C\" __global__ void broken() { int x = ; }",
        "sm_90",
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("kernel `broken`") && text.contains("broken.cu(1)"),
        "{text}"
    );
}
