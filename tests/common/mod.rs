//! Helpers shared by the end-to-end tests.
#![allow(dead_code)]

pub mod browser;
pub mod flash;
pub mod flash_bwd;
pub mod host;
mod nvrtc_ready;
mod on_gpu;
pub mod skip;
pub mod step_host;
mod tiny;
pub mod update_reference;
pub mod zoo;

#[allow(unused_imports)]
pub use nvrtc_ready::{keep_cubin, nvrtc_ready};
#[allow(unused_imports)]
pub use on_gpu::*;
#[allow(unused_imports)]
pub use skip::skip;

use fusec_compiler::driver::{compile, Compiled};
use fusec_compiler::elaborate::Options;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The repository as built, or (a test binary carried to another machine)
/// as named by FUSEC_ROOT or the working directory.
pub fn root() -> PathBuf {
    std::env::var_os("FUSEC_ROOT")
        .map(PathBuf::from)
        .or_else(|| {
            let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
            built.join("dsl-examples").exists().then_some(built)
        })
        .unwrap_or_else(|| std::env::current_dir().unwrap())
}

pub fn example(name: &str) -> (String, String) {
    let path = root().join("dsl-examples").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (format!("dsl-examples/{name}"), text)
}

/// Compiles a model; `name` is its path for messages, the model is named by the file stem.
pub fn compile_with(source: &str, name: &str, sets: &[(&str, &str)]) -> Compiled {
    let model_name = fusec_compiler::driver::model_name(std::path::Path::new(name));
    let opts = Options {
        overrides: sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Options::default()
    };
    match compile(source, &model_name, &opts) {
        Ok(c) => c,
        Err(f) => panic!("{}", f.render(name, source)),
    }
}

/// Autodiff against central differences in f64 for model `c` at sizes
/// `dims` (`fusec_compiler::gradcheck`, its default tolerance): `samples`
/// entries a parameter, feeds drawn from `seed`. `Err` where the model
/// cannot be differentiated or its step evaluated.
pub fn gradcheck(
    c: &Compiled,
    dims: &[(&str, i64)],
    seed: u64,
    samples: usize,
) -> Result<fusec_compiler::gradcheck::Report, String> {
    let backward =
        fusec_compiler::autodiff::add_backward(&c.model).map_err(|e| format!("autodiff: {e:?}"))?;
    fusec_compiler::gradcheck::check_model(
        &c.model,
        &backward,
        &self::dims(dims),
        seed,
        samples,
        fusec_compiler::gradcheck::Tolerance::default(),
    )
    .map_err(|e| e.to_string())
}

/// The rendered error of a model that must not compile (`file` names it in
/// the message); panics, naming `what`, where it compiles.
#[allow(dead_code)]
pub fn compile_error(source: &str, file: &str, what: &str) -> String {
    match compile(source, "m", &Options::default()) {
        Ok(_) => panic!("{what} was accepted"),
        Err(f) => f.render(file, source),
    }
}

pub fn dims(pairs: &[(&str, i64)]) -> HashMap<String, i64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// Every output of `g` by role, evaluated in f64 on `feeds`.
pub fn f64_outputs(
    g: &fusec_compiler::ir::Graph,
    feeds: &fusec_compiler::interp::Feeds,
) -> Vec<(String, Vec<f64>)> {
    let vals = fusec_compiler::interp::run(g, feeds, fusec_compiler::interp::Precision::F64)
        .expect("evaluates");
    g.outputs
        .iter()
        .map(|(r, v)| (r.to_string(), vals[v].data.clone()))
        .collect()
}

#[allow(unused_imports)]
pub use tiny::{tiny_models, TinyModel};

/// Values as the bytes a device buffer holds, and back: the runtime's own
/// codec (little-endian; 16-bit floats rounded to nearest even).
#[allow(unused_imports)]
pub use fusec_runtime::exec::{decode as from_bytes, encode as to_bytes};

/// The shipped models' file names (dsl-examples/*.dsl), sorted.
#[allow(dead_code)]
pub fn shipped_models() -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(root().join("dsl-examples"))
        .expect("dsl-examples/ lists")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|f| f.ends_with(".dsl"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "dsl-examples/ has the shipped models");
    files
}

/// A LLaMA-style twin at sizes nobody chose: grouped queries at head dim 8
/// of 2 heads, an MLP width of 131 and an untied head of 1003 classes (the
/// pad-dims pass reads the weights padded to 136 and 1008, the
/// cross-entropy told its classes): its file and `--set` sizes.
#[allow(dead_code)]
pub fn awkward_gqa() -> (&'static str, Vec<(&'static str, &'static str)>) {
    (
        "../tests/models/twins/gqa-hd80.dsl",
        vec![
            ("vocab", "1003"),
            ("ffn", "131"),
            ("n_heads", "2"),
            ("n_kv_heads", "1"),
            ("head_dim", "8"),
        ],
    )
}

/// Runs the built `fusec` in the repository root, as a person would:
/// (exit code, stdout, stderr). `FUSEC_BIN` names another build of it (a
/// test binary copied to a machine without Rust, where the path it was
/// built with is not).
pub fn fusec(args: &[&str]) -> (i32, String, String) {
    let bin = std::env::var_os("FUSEC_BIN")
        .unwrap_or_else(|| std::ffi::OsString::from(env!("CARGO_BIN_EXE_fusec")));
    let out = std::process::Command::new(bin)
        .args(args)
        .current_dir(root())
        .output()
        .expect("fusec runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `n` f32 values in [-0.8, 0.8] from a fixed xorshift sequence of `seed`:
/// weights a test knows without a random-number crate.
#[allow(dead_code)]
pub fn drawn_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x % 2001) as f32 / 1000.0 - 1.0) * 0.8
        })
        .collect()
}

/// Writes f32 `tensors` (name, shape, values) as a safetensors file.
#[allow(dead_code)]
pub fn write_safetensors(path: &Path, tensors: &[(&str, Vec<usize>, &[f32])]) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .unwrap();
            (n.to_string(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// `tools/hf_reference.py`'s JSON for a fresh `kind` model saved into
/// `dir` (its loss over `windows` windows of `t` bytes of `text`, and with
/// `new`, its greedy continuation of the first window), or `None` where
/// Python lacks torch or transformers (said as a skip).
#[allow(dead_code)]
pub fn hf_reference(
    kind: &str,
    dir: &Path,
    text: &Path,
    t: usize,
    windows: u32,
    new: Option<u32>,
) -> Option<serde_json::Value> {
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(root().join("tools/hf_reference.py"))
        .args([kind, dir.to_str().unwrap(), text.to_str().unwrap()])
        .args([t.to_string(), windows.to_string()]);
    if let Some(n) = new {
        cmd.arg(n.to_string());
    }
    let out = cmd.current_dir(root()).output().ok()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.code() == Some(3) {
        skip(stdout.trim());
        return None;
    }
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim().lines().last()?).ok()
}

#[allow(dead_code)]
/// The language models decoded here: (file under the repository, --set).
/// Beside the shipped shapes: heads of 40 features, 3 query heads a
/// cache head and a vocabulary of 61; and heads of 392 features, 4 query
/// heads a cache head (13 features a lane, so a block takes 3 of them and
/// the fourth goes to a second block).
pub fn decode_models() -> Vec<(String, Vec<(&'static str, &'static str)>)> {
    let tiny: HashMap<_, _> = tiny_models()
        .into_iter()
        .map(|(f, sets, _)| (f, sets))
        .collect();
    vec![
        (
            "dsl-examples/gpt2-small.dsl".into(),
            tiny["gpt2-small.dsl"].clone(),
        ),
        (
            "dsl-examples/llama-small.dsl".into(),
            tiny["llama-small.dsl"].clone(),
        ),
        (
            "tests/models/twins/gqa-hd80.dsl".into(),
            vec![("vocab", "61"), ("ffn", "37")],
        ),
        (
            "dsl-examples/llama-small.dsl".into(),
            vec![
                ("vocab", "61"),
                ("d", "240"),
                ("n_heads", "6"),
                ("n_kv_heads", "2"),
                ("ffn", "37"),
                ("layers", "1"),
            ],
        ),
        (
            "tests/models/twins/gqa-hd80.dsl".into(),
            vec![
                ("vocab", "61"),
                ("ffn", "37"),
                ("head_dim", "392"),
                ("n_heads", "4"),
            ],
        ),
    ]
}
