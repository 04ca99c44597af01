//! `fusec export-torch`: the model file as a standalone PyTorch module.

use super::common::{load, options, ModelArgs};
use super::CliError;
use clap::Args;
use fusec_compiler::diag::Diagnostic;
use fusec_compiler::driver;
use fusec_compiler::export::torch;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ExportArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The Python file to write (`-` for standard output); default: the
    /// model file's name with `_twin.py`
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

pub fn run(args: &ExportArgs) -> Result<(), CliError> {
    // The whole compile first, so that a model fusec rejects gets the same
    // errors here as from `fusec build`.
    let loaded = load(&args.model)?;
    let name = driver::model_name(&args.model.model);
    let file = args.model.model.display().to_string();
    let opts = options(&args.model)?;
    let model = driver::elaborate_only(&loaded.source, &name, &opts)
        .map_err(|f| CliError::model(f.render(&file, &loaded.source)))?;
    let shown = args
        .model
        .model
        .file_name()
        .map_or(file.clone(), |f| f.to_string_lossy().into_owned());
    let text = torch::twin(&model, &shown).map_err(|e| {
        let message = format!("no PyTorch twin: {}", e.message);
        let Some(span) = e.span else {
            let help = e.help.map_or(String::new(), |h| format!("\n  = {h}"));
            return CliError::model(format!("error: {message}\n  --> {file}{help}\n"));
        };
        let mut d = Diagnostic::new(message, span, "here");
        if let Some(h) = e.help {
            d = d.with_help(h);
        }
        CliError::model(d.render(&file, &loaded.source))
    })?;
    let out = args.output.clone().unwrap_or_else(|| {
        let stem = args
            .model
            .model
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().replace('-', "_"));
        PathBuf::from(format!("{stem}_twin.py"))
    });
    if out.as_os_str() == "-" {
        print!("{text}");
        return Ok(());
    }
    std::fs::write(&out, &text)
        .map_err(|e| CliError::usage(format!("error: cannot write {}: {e}", out.display())))?;
    let params = model.graph.params.len();
    println!(
        "wrote {} ({} lines; {params} parameters under fusec's names)",
        out.display(),
        text.lines().count()
    );
    println!("smoke run: python3 {} --steps 3", out.display());
    Ok(())
}
