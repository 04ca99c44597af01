//! Running generated kernels as host C++ (tests/cuda_host/shim.h and the
//! threaded shims stand in for CUDA): the pieces every such harness shares.

use fusec_compiler::emit::cuda::c_type;
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::Precision;
use fusec_compiler::ir::Graph;
use fusec_compiler::kernel::interp::run_program;
use fusec_compiler::kernel::{Kernel, Program};
use std::collections::HashMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Whether a host C++ compiler exists (the tests that need one skip,
/// saying so, without it; they fail instead where FUSEC_REQUIRE_CXX is set,
/// as `.ci/run` sets it after installing one).
pub fn have_cxx() -> bool {
    let ok = Command::new("c++").arg("--version").output().is_ok();
    if !ok {
        assert!(
            std::env::var_os("FUSEC_REQUIRE_CXX").is_none(),
            "FUSEC_REQUIRE_CXX is set but no c++ compiler is on PATH"
        );
        super::skip("no c++ compiler on PATH");
    }
    ok
}

/// A fresh folder for one test's files.
pub fn work_dir(label: &str) -> PathBuf {
    let work = std::env::temp_dir().join(format!("fusec-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    work
}

/// `fs_read` / `fs_write`: a harness's kernel buffers from and to files.
pub const FILE_IO: &str = "static void* fs_read(const char* dir, const char* name, size_t bytes) {\n\
    char path[4096]; snprintf(path, sizeof path, \"%s/%s\", dir, name);\n\
    FILE* f = fopen(path, \"rb\"); if (!f) { perror(path); exit(2); }\n\
    void* p = calloc(1, bytes + 16); size_t got = fread(p, 1, bytes, f); fclose(f);\n\
    if (got != bytes) { fprintf(stderr, \"%s: %zu of %zu bytes\\n\", path, got, bytes); exit(2); }\n\
    return p; }\n\
    static void fs_write(const char* dir, const char* name, const void* p, size_t bytes) {\n\
    char path[4096]; snprintf(path, sizeof path, \"%s/%s\", dir, name);\n\
    FILE* f = fopen(path, \"wb\"); fwrite(p, 1, bytes, f); fclose(f); }\n";

/// Declares kernel `k`'s buffers in a harness's `main`: inputs `inN` read
/// from files of that name, outputs `outN` allocated (filled with NaN when
/// `poison`, so an unwritten element shows, else zeros). Returns the call's
/// arguments (buffers, then `sizes`) and the lines that write the outputs
/// back to files.
pub fn kernel_buffers(
    s: &mut String,
    p: &Program,
    k: &Kernel,
    sizes: &[String],
    poison: bool,
) -> (Vec<String>, String) {
    let mut args = Vec::new();
    let mut writes = String::new();
    for (slot, &buf) in k.inputs.iter().chain(&k.outputs).enumerate() {
        let ty = &p.buffers[buf].ty;
        let t = c_type(ty.dtype);
        let bytes = format!("(size_t){} * sizeof({t})", ty.numel().to_c());
        let name = if slot < k.inputs.len() {
            let name = format!("in{slot}");
            let _ = writeln!(
                s,
                "    {t}* {name} = ({t}*)fs_read(dir, \"{name}\", {bytes});"
            );
            name
        } else {
            let name = format!("out{}", slot - k.inputs.len());
            if poison {
                let _ = writeln!(
                    s,
                    "    {t}* {name} = ({t}*)malloc({bytes} + 16); memset({name}, 0xff, {bytes});"
                );
            } else {
                let _ = writeln!(s, "    {t}* {name} = ({t}*)calloc(1, {bytes} + 16);");
            }
            let _ = writeln!(writes, "    fs_write(dir, \"{name}\", {name}, {bytes});");
            name
        };
        args.push(name);
    }
    args.extend(sizes.iter().map(|d| format!("dim_{d}")));
    (args, writes)
}

/// The host compiler's command for one harness (C++20, threads, light
/// optimisation, no warnings: generated code is not written for a host).
/// The shims are found in tests/cuda_host and tests/flash_host and the
/// templates in kernels/, after the harness's own folder (where a test may
/// put a changed copy).
pub fn cxx(src: &Path, exe: &Path) -> Command {
    let mut c = Command::new("c++");
    c.args(["-std=c++20", "-pthread", "-O1", "-w"]);
    for dir in ["tests/cuda_host", "tests/flash_host", "kernels"] {
        c.arg("-I").arg(super::root().join(dir));
    }
    c.arg("-o").arg(exe).arg(src);
    c
}

/// Every buffer of `program` as the kernel-IR interpreter computes it, on
/// random feeds drawn with `seed` (the values a host run is compared with).
pub fn program_values(
    g: &Graph,
    program: &Program,
    dims: &HashMap<String, i64>,
    seed: u64,
) -> Vec<Tensor> {
    let feeds = random_feeds(g, dims, seed).expect("feeds");
    run_program(g, program, &feeds, Precision::AsStored).expect("interpreter")
}

/// Builds `cpp`, written to `work/<stem>.cpp`, into `work/<stem>`.
pub fn build(work: &Path, stem: &str, cpp: &str) -> PathBuf {
    let src = work.join(format!("{stem}.cpp"));
    std::fs::write(&src, cpp).unwrap();
    let exe = work.join(stem);
    let out = cxx(&src, &exe).output().expect("c++ runs");
    assert!(
        out.status.success(),
        "c++ failed on {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// Runs kernel `k` of a harness built from `kernel_buffers` on the
/// interpreter's values of its inputs (`bufs`, by buffer), in folder `dir`,
/// with `args` after the kernel name and folder; returns every output as the
/// host run wrote it, or why the run failed.
pub fn run_kernel(
    exe: &Path,
    dir: &Path,
    p: &Program,
    k: &Kernel,
    bufs: &[fusec_compiler::interp::tensor::Tensor],
    args: &[String],
) -> Result<Vec<Vec<f64>>, String> {
    std::fs::create_dir_all(dir).unwrap();
    for (slot, &b) in k.inputs.iter().enumerate() {
        let bytes = super::to_bytes(p.buffers[b].ty.dtype, &bufs[b].data);
        std::fs::write(dir.join(format!("in{slot}")), bytes).unwrap();
    }
    // The command line beside the inputs, to rerun a failing case by hand.
    let line: Vec<String> = [
        exe.display().to_string(),
        k.name.clone(),
        dir.display().to_string(),
    ]
    .into_iter()
    .chain(args.iter().cloned())
    .collect();
    std::fs::write(dir.join("run.sh"), line.join(" ") + "\n").unwrap();
    let run = Command::new(exe)
        .arg(&k.name)
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    if !run.status.success() {
        return Err(format!(
            "the host run failed ({}): {}",
            run.status,
            String::from_utf8_lossy(&run.stderr)
        ));
    }
    Ok(k.outputs
        .iter()
        .enumerate()
        .map(|(slot, &b)| {
            let bytes = std::fs::read(dir.join(format!("out{slot}"))).unwrap();
            super::from_bytes(p.buffers[b].ty.dtype, &bytes)
        })
        .collect())
}
