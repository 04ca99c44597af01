//! Helpers shared by the end-to-end tests.
#![allow(dead_code)]

use fusec_compiler::driver::{compile, Compiled};
use fusec_compiler::elaborate::Options;
use std::collections::HashMap;
use std::path::PathBuf;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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
    };
    match compile(source, &model_name, &opts) {
        Ok(c) => c,
        Err(f) => panic!("{}", f.render(name, source)),
    }
}

pub fn dims(pairs: &[(&str, i64)]) -> HashMap<String, i64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// Every shipped model, with the constants that shrink it to a size the
/// reference interpreter evaluates in milliseconds, and its symbolic sizes.
pub type TinyModel = (
    &'static str,
    Vec<(&'static str, &'static str)>,
    Vec<(&'static str, i64)>,
);

pub fn tiny_models() -> Vec<TinyModel> {
    vec![
        (
            "mlp.dsl",
            vec![("d_in", "6"), ("d_hidden", "8"), ("classes", "5")],
            vec![("B", 3)],
        ),
        (
            "gpt2-block.dsl",
            vec![("d", "16"), ("n_heads", "2")],
            vec![("B", 2), ("T", 5)],
        ),
        (
            "gpt2-small.dsl",
            vec![
                ("vocab", "23"),
                ("ctx", "8"),
                ("d", "16"),
                ("n_heads", "2"),
                ("layers", "2"),
            ],
            vec![("B", 2), ("T", 5)],
        ),
        (
            "llama-small.dsl",
            vec![
                ("vocab", "23"),
                ("d", "16"),
                ("n_heads", "4"),
                ("n_kv_heads", "2"),
                ("ffn", "24"),
                ("layers", "2"),
            ],
            vec![("B", 2), ("T", 5)],
        ),
        (
            "bert-encoder.dsl",
            vec![
                ("vocab", "23"),
                ("ctx", "8"),
                ("d", "16"),
                ("n_heads", "2"),
                ("layers", "2"),
            ],
            vec![("B", 2), ("T", 5)],
        ),
        (
            "vit-tiny.dsl",
            vec![
                ("image", "8"),
                ("patch", "4"),
                ("channels", "3"),
                ("d", "16"),
                ("n_heads", "2"),
                ("layers", "2"),
                ("classes", "5"),
            ],
            vec![("B", 2)],
        ),
    ]
}

/// Values as the bytes a device buffer of `dt` holds (little-endian).
pub fn to_bytes(dt: fusec_compiler::ir::DType, data: &[f64]) -> Vec<u8> {
    use fusec_compiler::ir::DType;
    let mut out = Vec::with_capacity(data.len() * dt.size_bytes());
    for &x in data {
        match dt {
            DType::F32 => out.extend((x as f32).to_le_bytes()),
            DType::I32 => out.extend((x as i32).to_le_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(x).to_bits().to_le_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(x).to_bits().to_le_bytes()),
        }
    }
    out
}

/// The inverse of `to_bytes`.
pub fn from_bytes(dt: fusec_compiler::ir::DType, b: &[u8]) -> Vec<f64> {
    use fusec_compiler::ir::DType;
    b.chunks(dt.size_bytes())
        .map(|c| match dt {
            DType::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::I32 => i32::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::BF16 => {
                half::bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64()
            }
            DType::F16 => half::f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64(),
        })
        .collect()
}
