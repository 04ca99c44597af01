//! What check and build share: reading the model file, `--set`, compiling.

use super::CliError;
use clap::Args;
use fusec_compiler::driver::{self, Compiled};
use fusec_compiler::elaborate::Options;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct ModelArgs {
    /// The model file (.dsl)
    pub model: PathBuf,
    /// Replace a top-level constant, e.g. --set layers=2 (repeatable)
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub set: Vec<String>,
}

pub struct Loaded {
    pub path: PathBuf,
    pub source: String,
    pub compiled: Compiled,
}

pub fn read_source(path: &Path) -> Result<String, CliError> {
    let bytes = std::fs::read(path).map_err(|e| {
        CliError::usage(format!(
            "error: cannot read model file {}: {e}",
            path.display()
        ))
    })?;
    String::from_utf8(bytes).map_err(|e| {
        CliError::model(format!(
            "error: {} is not UTF-8 text (invalid byte at offset {})\n",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

pub fn options(set: &[String]) -> Result<Options, CliError> {
    let mut overrides = Vec::new();
    for s in set {
        let Some((k, v)) = s.split_once('=') else {
            return Err(CliError::usage(format!(
                "error: --set expects NAME=VALUE, found `{s}`"
            )));
        };
        overrides.push((k.trim().to_string(), v.trim().to_string()));
    }
    Ok(Options { overrides })
}

pub fn load(args: &ModelArgs) -> Result<Loaded, CliError> {
    let source = read_source(&args.model)?;
    let opts = options(&args.set)?;
    let name = driver::model_name(&args.model);
    let compiled = driver::compile(&source, &name, &opts).map_err(|f| {
        let text = f.render(&args.model.display().to_string(), &source);
        if f.is_usage() {
            CliError::usage(text)
        } else {
            CliError::model(text)
        }
    })?;
    Ok(Loaded {
        path: args.model.clone(),
        source,
        compiled,
    })
}

/// `124439808` -> `124,439,808`
pub fn thousands(n: i64) -> String {
    let s = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}
