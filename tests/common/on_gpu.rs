//! Helpers of the tests that run steps on a GPU (or compile for one): the
//! GPU or a reason to skip, shipped models compiled with overrides, small
//! attention models, sizes. Shared by the runtime's tests and the
//! end-to-end ones (each `common` gives `root()` and `skip`).

use super::{root, skip};
use fusec_compiler::driver::{compile, Compiled};
use fusec_compiler::elaborate::Options;
use fusec_runtime::device;
use std::collections::{BTreeMap, HashMap};

/// The GPU, or None with the reason printed (a failure instead when
/// FUSEC_REQUIRE_GPU is set, so a GPU run cannot pass by skipping).
pub fn gpu() -> Option<device::Gpu> {
    let skip = |why: String| {
        assert!(
            std::env::var_os("FUSEC_REQUIRE_GPU").is_none(),
            "FUSEC_REQUIRE_GPU is set: {why}"
        );
        skip(&why);
        None
    };
    if !device::driver_present() {
        return skip("no CUDA driver on this machine".into());
    }
    device::open(0).map_or_else(|e| skip(e.to_string()), Some)
}

/// A shipped model compiled with `--set` overrides.
pub fn model(file: &str, sets: &[(&str, &str)]) -> Compiled {
    model_edited(file, sets, |src| src)
}

/// A shipped model with its text changed by `edit` (e.g. another
/// precision), compiled with `--set` overrides.
pub fn model_edited(
    file: &str,
    sets: &[(&str, &str)],
    edit: impl Fn(String) -> String,
) -> Compiled {
    let path = root().join("dsl-examples").join(file);
    let src = edit(std::fs::read_to_string(&path).unwrap());
    let opts = Options {
        overrides: sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Options::default()
    };
    let name = std::path::Path::new(file)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(file);
    match compile(&src, name, &opts) {
        Ok(c) => c,
        Err(f) => panic!("{}", f.render(file, &src)),
    }
}

/// One attention over heads of a fused projection: `heads` query heads on
/// `heads / ratio` key/value heads of size `d`, in `precision`.
pub fn attention_model(
    d: usize,
    heads: usize,
    ratio: usize,
    causal: bool,
    precision: &str,
) -> String {
    attention_model_dv(d, d, heads, ratio, causal, precision)
}

/// [`attention_model`] with values of head dim `dv`.
pub fn attention_model_dv(
    d: usize,
    dv: usize,
    heads: usize,
    ratio: usize,
    causal: bool,
    precision: &str,
) -> String {
    let kv = heads / ratio;
    let (q, k, v) = (heads * d, kv * d, kv * dv);
    format!(
        "dim B, T\ninput x: f32[B, T, 32]\nparam w: [32, {}] = normal(0.3)\n\
         let q, k, v = split(x @ w, [{q}, {k}, {v}])\n\
         let y = attention(heads(q, {heads}), heads(k, {kv}), heads(v, {kv}), causal = {causal})\n\
         train {{\n loss = mean(y * y)\n precision = {precision}\n}}\n",
        q + k + v
    )
}

/// Sizes as the interpreter takes them and as a plan takes them.
pub fn sizes(dims: &[(&str, i64)]) -> (HashMap<String, i64>, BTreeMap<String, i64>) {
    let h = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    (h, plan_sizes(dims))
}

/// Sizes as a plan (and the stages at sizes) take them.
pub fn plan_sizes(dims: &[(&str, i64)]) -> BTreeMap<String, i64> {
    dims.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}
