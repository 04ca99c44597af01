//! The front half as one call: source text to a checked model and its
//! training graph, with every stage's result kept for `--dump`.

use crate::autodiff;
use crate::diag::Errors;
use crate::dsl::{self, ast::Module};
use crate::elaborate::{self, Options};
use crate::ir::verify::verify;
use crate::ir::Graph;
use crate::model::Model;

/// The stages whose result `fusec build --dump <stage>` can print.
pub const STAGES: &[(&str, &str)] = &[
    ("ast", "the syntax tree, as parsed"),
    ("forward", "the forward graph, after elaboration"),
    ("backward", "forward and backward: the loss and every parameter's gradient"),
    ("train", "the whole step: forward, backward, clipping and the optimizer update"),
];

pub struct Compiled {
    pub ast: Module,
    pub model: Model,
    pub training: Graph,
}

/// A failure with the text it came from, so it can be rendered.
#[derive(Debug)]
pub struct Failure {
    pub errors: Errors,
}

impl Failure {
    pub fn render(&self, file_name: &str, source: &str) -> String {
        self.errors.render(file_name, source)
    }
}

pub fn compile(source: &str, model_name: &str, opts: &Options) -> Result<Compiled, Failure> {
    let ast = dsl::parse(source).map_err(|errors| Failure { errors })?;
    let model = elaborate::elaborate(&ast, model_name, opts).map_err(|errors| Failure { errors })?;
    check_verified(&model.graph, "elaboration")?;
    let backward = autodiff::add_backward(&model).map_err(|errors| Failure { errors })?;
    check_verified(&backward, "autodiff")?;
    let mut training = backward;
    autodiff::add_update(&mut training, &model.train).map_err(|e| Failure {
        errors: crate::diag::Diagnostic::new(format!("internal error building the update: {e}"), model.train.loss_span, "").into(),
    })?;
    check_verified(&training, "the optimizer update")?;
    Ok(Compiled { ast, model, training })
}

/// The verifier guards the compiler's own invariants: a failure is a bug in
/// fusec, never in the model file, and is reported as such.
fn check_verified(g: &Graph, after: &str) -> Result<(), Failure> {
    verify(g).map_err(|problems| Failure {
        errors: crate::diag::Diagnostic::new(
            format!("internal error: the graph is invalid after {after}"),
            crate::dsl::ast::Span::default(),
            "",
        )
        .with_help(problems.join("\n"))
        .with_help("this is a bug in fusec; please report it with the model file")
        .into(),
    })
}

/// Derives a model name from a file path: `dsl-examples/gpt2-small.dsl` -> `gpt2-small`.
pub fn model_name(path: &std::path::Path) -> String {
    path.file_stem().map_or("model".into(), |s| s.to_string_lossy().into_owned())
}
