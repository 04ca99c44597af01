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
fn every_generated_kernel_compiles_for_sm80_and_sm90_without_spills_or_local_arrays() {
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
                    if c.local_arrays() {
                        failures.push(format!(
                            "{name} ({arch}): an array in local memory\n{}",
                            c.log
                        ));
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
        "{} distinct kernels compiled for sm_80 and sm_90; at most {max_regs} registers, no spills, no arrays in local memory",
        sources.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Every header in `kernels/` (the prelude, and each template after the
/// prelude it needs) compiles alone with NVRTC's default options, for
/// sm_80 and sm_90a: no `-default-device` (a constexpr helper without
/// `__host__ __device__` is a host function there, refused in JIT mode),
/// nothing but what the header includes itself.
#[test]
fn every_kernels_header_compiles_alone_with_nvrtc_defaults() {
    if !common::nvrtc_ready() {
        return;
    }
    use fusec_compiler::emit::{HEADERS, PRELUDE_NAME};
    let mut failures = Vec::new();
    let headers = std::iter::once(PRELUDE_NAME).chain(HEADERS.iter().map(|(p, _)| *p));
    let mut count = 0;
    for path in headers {
        let source = match path {
            PRELUDE_NAME => format!("#include \"{PRELUDE_NAME}\"\n"),
            _ => format!("#include \"{PRELUDE_NAME}\"\n#include \"{path}\"\n"),
        };
        for arch in ["sm_80", "sm_90a"] {
            if let Err(e) = nvrtc::compile_with(path, &source, arch, &[]) {
                failures.push(format!("{path} ({arch}): {e}"));
            }
        }
        count += 1;
    }
    println!("{count} headers compiled alone for sm_80 and sm_90a with NVRTC's defaults");
    assert!(count > HEADERS.len(), "the prelude and every header");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Every header in `kernels/` compiles alone with `nvcc -c` and its
/// defaults for sm_80 and sm_90a, both of nvcc's passes (the host pass
/// sees the prelude too: its plain-C++ emulations are for compilers without
/// `__CUDACC__`). nvcc is the one `FUSEC_NVCC` names (`.ci/run` installs it
/// from PyPI); skipped where none is named, failing instead under
/// FUSEC_REQUIRE_NVCC.
#[test]
fn every_kernels_header_compiles_alone_with_nvcc() {
    let Some(nvcc) = std::env::var_os("FUSEC_NVCC").filter(|p| std::path::Path::new(p).exists())
    else {
        assert!(
            std::env::var("FUSEC_REQUIRE_NVCC").is_err(),
            "FUSEC_REQUIRE_NVCC is set but FUSEC_NVCC names no nvcc"
        );
        common::skip("no nvcc (FUSEC_NVCC names none)");
        return;
    };
    use fusec_compiler::emit::HEADERS;
    let kernels = common::root().join("kernels");
    let dir = std::env::temp_dir().join(format!("fusec-nvcc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    let headers = std::iter::once("prelude.cuh").chain(HEADERS.iter().map(|(p, _)| *p));
    for path in headers {
        let src = dir.join("h.cu");
        let text = match path {
            "prelude.cuh" => "#include \"prelude.cuh\"\n".to_string(),
            _ => format!("#include \"prelude.cuh\"\n#include \"{path}\"\n"),
        };
        std::fs::write(&src, text).unwrap();
        for arch in ["sm_80", "sm_90a"] {
            let out = std::process::Command::new(&nvcc)
                .arg("-c")
                .arg(format!("-arch={arch}"))
                .arg("-I")
                .arg(&kernels)
                .arg(&src)
                .arg("-o")
                .arg(dir.join("h.o"))
                .output()
                .expect("nvcc runs");
            if !out.status.success() {
                failures.push(format!(
                    "{path} ({arch}):\n{}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
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

/// Every shipped and test model built for each device of
/// `device::DEVICES` with the mma.sync attention (sm_80 class: the A100,
/// and the consumer and workstation GPUs of 99 KiB of shared memory a
/// block): every kernel the build selects, generated or a `kernels/`
/// template instance, compiles with NVRTC for the device's architecture,
/// and its shared memory (static, as ptxas reports it, plus the launch's
/// dynamic) fits the device's limit. Hopper's instances are compiled by
/// the flash tests.
#[test]
fn every_kernel_fits_every_device() {
    if !common::nvrtc_ready() {
        return;
    }
    use fusec_compiler::device::DEVICES;
    use fusec_compiler::select::{select, Choice, Target};
    let root = common::root();
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    for dir in ["dsl-examples", "tests/models", "tests/models/twins"] {
        let mut found: Vec<_> = std::fs::read_dir(root.join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "dsl"))
            .collect();
        found.sort();
        files.extend(found);
    }
    let mut models: Vec<(String, String)> = files
        .iter()
        .map(|f| (f.display().to_string(), std::fs::read_to_string(f).unwrap()))
        .collect();
    // The widest heads, whose attention kernels take the most shared memory.
    for (d, causal) in [(256, true), (192, false), (96, true)] {
        let src = common::attention_model_dv(d, d, 4, 2, causal, "bf16");
        models.push((format!("attention at D = {d}"), src));
    }
    let mut failures = Vec::new();
    // Devices of one architecture and limit (the RTX 4090 and the L40S)
    // are checked once.
    let mut seen = Vec::new();
    for d in DEVICES {
        let (device, arch, flash, limit) = (d.name, d.arch, d.flash, d.max_shared_per_block);
        if flash != Some(fusec_compiler::emit::flash::FlashArch::Sm80)
            || seen.contains(&(arch, limit))
        {
            continue;
        }
        seen.push((arch, limit));
        let target = Target::for_device(device, false).unwrap();
        // (source without its name) -> (name, dynamic shared memory).
        let mut sources: BTreeMap<String, (String, u64)> = BTreeMap::new();
        let mut instances = 0;
        for (label, src) in &models {
            let c = compile(src, "m", &Options::default())
                .unwrap_or_else(|e| panic!("{}", e.render(label, src)));
            let program = fuse(&c.optimized);
            let sel = select(&c.optimized, &program, &target, None);
            let mut dynamic: BTreeMap<String, u64> = BTreeMap::new();
            for choice in &sel.choices {
                if let Choice::Templates(ks) = choice {
                    for k in ks {
                        dynamic.insert(k.launch.name.clone(), k.launch.dynamic_smem_bytes);
                        instances += 1;
                    }
                }
            }
            for (name, text) in &sel.sources {
                let smem = dynamic.get(name).copied().unwrap_or(0);
                sources
                    .entry(text.replace(name.as_str(), "KERNEL"))
                    .or_insert((name.clone(), smem));
            }
        }
        assert!(instances > 0, "{device}: no template instance was selected");
        // The f32 models' GEMMs split their operands for TF32 (fp32 is
        // the default precision of the models without one).
        let split = fusec_compiler::emit::gemm_split::SPLIT_SOURCE;
        assert!(
            sources.values().any(|(name, _)| name == split),
            "{device}: no f32 GEMM was split for three TF32 products"
        );
        use rayon::prelude::*;
        let results: Vec<Result<(u64, String), String>> = sources
            .par_iter()
            .map(|(key, (name, dynamic))| {
                let text = key.replace("KERNEL", name);
                let c = nvrtc::compile(name, &text, arch)
                    .map_err(|e| format!("{device} ({arch}): {e}"))?;
                let total = c.static_smem_bytes as u64 + dynamic;
                if total > limit {
                    return Err(format!(
                        "{device} ({arch}): {name} takes {total} bytes of shared memory, over {limit}"
                    ));
                }
                Ok((total, name.clone()))
            })
            .collect();
        let mut largest = (0u64, String::new());
        for r in results {
            match r {
                Ok(t) => largest = largest.max(t),
                Err(e) => failures.push(e),
            }
        }
        println!(
            "{device} ({arch}): {} distinct kernels compiled, the largest shared memory {} bytes ({}) of {limit}",
            sources.len(),
            largest.0,
            largest.1
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
