//! The generated CUDA C, run. A host C++ compiler builds every generated
//! kernel of the shipped models (pointwise chains and op templates) (tests/cuda_host/shim.h stands in for the
//! CUDA runtime: one thread walks each grid-stride loop), runs it on the
//! buffers the kernel IR's interpreter computed, and the results must match
//! the interpreter's: within 2 bf16/f16 ulps (1e-2 relative) for 16-bit
//! outputs and 1e-5 relative for f32 (the C code rounds in f32, the
//! interpreter in f64). This checks the emitted index arithmetic and
//! conversions, not just that they compile. Skipped, with a message, where
//! no `c++` compiler exists.

mod common;

use fusec_compiler::emit::cuda::{c_type, emit_program};
use fusec_compiler::emit::{PRELUDE, PRELUDE_NAME};
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::Precision;
use fusec_compiler::ir::DType;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::interp::run_program;
use fusec_compiler::kernel::Program;
use std::fmt::Write;
use std::process::Command;

/// One C++ program holding every pointwise kernel and a `main` that runs
/// the one named on its command line on files in a folder.
fn harness(g: &fusec_compiler::ir::Graph, p: &Program, kernels: &[(String, String)]) -> String {
    let mut s = String::from("#include \"shim.h\"\n");
    s.push_str(PRELUDE);
    for (_, text) in kernels {
        s.push_str(&text.replace(&format!("#include \"{PRELUDE_NAME}\""), ""));
    }
    s.push_str(
        "static void* fs_read(const char* dir, const char* name, size_t bytes) {\n\
         char path[4096]; snprintf(path, sizeof path, \"%s/%s\", dir, name);\n\
         FILE* f = fopen(path, \"rb\"); if (!f) { perror(path); exit(2); }\n\
         void* p = calloc(1, bytes + 16); size_t got = fread(p, 1, bytes, f); fclose(f);\n\
         if (got != bytes) { fprintf(stderr, \"%s: %zu of %zu bytes\\n\", path, got, bytes); exit(2); }\n\
         return p; }\n\
         static void fs_write(const char* dir, const char* name, const void* p, size_t bytes) {\n\
         char path[4096]; snprintf(path, sizeof path, \"%s/%s\", dir, name);\n\
         FILE* f = fopen(path, \"wb\"); fwrite(p, 1, bytes, f); fclose(f); }\n",
    );
    s.push_str("int main(int argc, char** argv) {\n  const char* dir = argv[2];\n");
    for (i, d) in g.dims.iter().enumerate() {
        let _ = writeln!(s, "  const fs_i64 {d} = atoll(argv[{}]);", i + 3);
    }
    for k in &p.kernels {
        if !kernels.iter().any(|(n, _)| *n == k.name) {
            continue;
        }
        let _ = writeln!(s, "  if (!strcmp(argv[1], \"{}\")) {{", k.name);
        let mut args = Vec::new();
        for (slot, &b) in k.inputs.iter().chain(&k.outputs).enumerate() {
            let ty = &p.buffers[b].ty;
            let is_in = slot < k.inputs.len();
            let name = if is_in {
                format!("in{slot}")
            } else {
                format!("out{}", slot - k.inputs.len())
            };
            let bytes = format!(
                "(size_t){} * sizeof({})",
                ty.numel().to_c(),
                c_type(ty.dtype)
            );
            if is_in {
                let _ = writeln!(
                    s,
                    "    {t}* {name} = ({t}*)fs_read(dir, \"{name}\", {bytes});",
                    t = c_type(ty.dtype)
                );
            } else {
                let _ = writeln!(
                    s,
                    "    {t}* {name} = ({t}*)calloc(1, {bytes} + 16);",
                    t = c_type(ty.dtype)
                );
            }
            args.push(name);
        }
        args.extend(g.dims.iter().cloned());
        let _ = writeln!(s, "    {}({});", k.name, args.join(", "));
        for slot in 0..k.outputs.len() {
            let ty = &p.buffers[k.outputs[slot]].ty;
            let _ = writeln!(
                s,
                "    fs_write(dir, \"out{slot}\", out{slot}, (size_t){} * sizeof({}));",
                ty.numel().to_c(),
                c_type(ty.dtype)
            );
        }
        let _ = writeln!(s, "    return 0;\n  }}");
    }
    s.push_str("  fprintf(stderr, \"unknown kernel %s\\n\", argv[1]);\n  return 2;\n}\n");
    s
}

#[test]
fn generated_kernels_compute_what_the_interpreter_computes() {
    if Command::new("c++").arg("--version").output().is_err() {
        println!("skipped: no c++ compiler on PATH");
        return;
    }
    let work = std::env::temp_dir().join(format!("fusec-cuda-host-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    std::fs::copy(
        common::root().join("tests/cuda_host/shim.h"),
        work.join("shim.h"),
    )
    .unwrap();
    let mut checked = 0;
    for (file, sets, dims) in common::tiny_models() {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        let g = &c.optimized;
        let program = fuse(g);
        let dims_map = common::dims(&dims);
        let feeds = random_feeds(g, &dims_map, 21).expect("feeds");
        let bufs = run_program(g, &program, &feeds, Precision::AsStored).expect("interpreter");
        let kernels = emit_program(g, &program, None);
        let stem = file.trim_end_matches(".dsl");
        let cpp = work.join(format!("{stem}.cpp"));
        std::fs::write(&cpp, harness(g, &program, &kernels)).unwrap();
        let exe = work.join(stem);
        let out = Command::new("c++")
            .args(["-std=c++17", "-O1", "-w", "-o"])
            .arg(&exe)
            .arg(&cpp)
            .output()
            .expect("c++ runs");
        assert!(
            out.status.success(),
            "{file}: c++ failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dim_args: Vec<String> = g.dims.iter().map(|d| dims_map[d].to_string()).collect();
        for k in program
            .kernels
            .iter()
            .filter(|k| kernels.iter().any(|(n, _)| *n == k.name))
        {
            let dir = work.join(format!("{stem}-{}", k.name));
            std::fs::create_dir_all(&dir).unwrap();
            for (slot, &b) in k.inputs.iter().enumerate() {
                let dt = program.buffers[b].ty.dtype;
                std::fs::write(
                    dir.join(format!("in{slot}")),
                    common::to_bytes(dt, &bufs[b].data),
                )
                .unwrap();
            }
            let run = Command::new(&exe)
                .arg(&k.name)
                .arg(&dir)
                .args(&dim_args)
                .output()
                .unwrap();
            assert!(
                run.status.success(),
                "{file} {}: {}",
                k.name,
                String::from_utf8_lossy(&run.stderr)
            );
            for (slot, &b) in k.outputs.iter().enumerate() {
                let dt = program.buffers[b].ty.dtype;
                let got =
                    common::from_bytes(dt, &std::fs::read(dir.join(format!("out{slot}"))).unwrap());
                let want = &bufs[b].data;
                assert_eq!(got.len(), want.len(), "{file} {}", k.name);
                let tol = if matches!(dt, DType::BF16 | DType::F16) {
                    1e-2
                } else {
                    1e-5
                };
                for (i, (x, y)) in want.iter().zip(&got).enumerate() {
                    let ok = (x - y).abs() <= tol * x.abs().max(1.0) || (x.is_nan() && y.is_nan());
                    assert!(
                        ok,
                        "{file} {} element {i}: interpreter {x}, generated code {y}",
                        k.name
                    );
                }
            }
            checked += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    println!("{checked} generated kernels ran on the host and matched the interpreter");
    assert!(checked > 0);
}
