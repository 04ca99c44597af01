//! `fusec export-torch`: the model file as a standalone PyTorch module.
//!
//! The twin is written from the forward graph as elaboration left it (no
//! pass has run), so it computes what the file means, op for op. The
//! [`Structure`] that elaboration recorded gives the graph back its shape:
//! each block call becomes an `nn.Module` (calls that elaborate to the same
//! code share one class), each `repeat` an `nn.ModuleList` and a loop, and
//! `let` names name the Python variables. Parameter paths therefore match
//! fusec's (`h.3.attn.c_attn_w`), which is what lets weights move both ways.
//! The helpers the classes call and the training step are Python in
//! `prelude.py` and `train.py`, copied in verbatim.

mod expr;
mod scope;

use crate::dsl::ast::Span;
use crate::interp::random::index_bound;
use crate::ir::{DType, Graph, Value};
use crate::model::Model;
use crate::ops::Op;
use expr::float;
use std::collections::HashMap;
use std::fmt::Write;

const PRELUDE: &str = include_str!("prelude.py");
const TRAIN: &str = include_str!("train.py");

/// Why a model has no twin: a construct PyTorch code cannot state the same way.
#[derive(Clone, Debug)]
pub struct ExportError {
    pub message: String,
    pub span: Option<Span>,
    pub help: Option<String>,
}

impl ExportError {
    pub(crate) fn new(message: impl Into<String>, span: Option<Span>) -> ExportError {
        ExportError {
            message: message.into(),
            span,
            help: None,
        }
    }
    pub(crate) fn help(mut self, h: impl Into<String>) -> ExportError {
        self.help = Some(h.into());
        self
    }
}

/// The twin of `model` as Python source. `source_name` is the model file as
/// the user named it, for the header.
pub fn twin(model: &Model, source_name: &str) -> Result<String, ExportError> {
    let g = &model.graph;
    let mut gen = scope::Gen::new(g, &model.structure);
    let root_class = class_name(&g.name, "Model");
    let loss = g
        .outputs
        .iter()
        .find(|(r, _)| *r == crate::ir::Role::Loss)
        .map(|(_, v)| *v)
        .ok_or_else(|| ExportError::new("the graph has no loss", None))?;
    let root_class = gen.root(&root_class, loss)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\"\"\"PyTorch twin of `{source_name}`, written by `fusec export-torch`.\n\n\
         `{root_class}` computes the model file's loss op for op, with fusec's parameter names\n\
         (its state_dict loads fusec's safetensors). The `train` section is below the classes:\n\
         `make_optimizer` and `train_step` do what `fusec train` does for one step.\n\
         Run `python3 {{this file}} --steps 3` for a smoke run on random data.\n\"\"\""
    );
    out.push_str(PRELUDE);
    for text in gen.class_texts() {
        out.push_str("\n\n");
        out.push_str(&text);
    }
    out.push_str("\n\n");
    out.push_str(&train_config(model, &root_class));
    out.push_str(TRAIN);
    Ok(out)
}

/// `gpt2-small` -> `Gpt2Small`; `attn` -> `Attn`.
pub(crate) fn class_name(name: &str, fallback: &str) -> String {
    let mut out = String::new();
    let mut up = true;
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            if up {
                out.extend(c.to_uppercase());
            } else {
                out.push(c);
            }
            up = false;
        } else {
            up = true;
        }
    }
    if out.is_empty() || out.starts_with(|c: char| c.is_ascii_digit()) {
        out = format!("{fallback}{out}");
    }
    out
}

fn dtype_word(d: DType) -> &'static str {
    match d {
        DType::F32 => "fp32",
        DType::BF16 => "bf16",
        DType::F16 => "fp16",
        DType::I32 => "i32",
    }
}

/// The `train` section as Python constants, and the inputs with their
/// shapes and, for indices, the bound their consumers give them.
fn train_config(model: &Model, root: &str) -> String {
    let g = &model.graph;
    let t = &model.train;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# ---- the model file's `train` section and inputs ----\n"
    );
    let _ = writeln!(s, "MODEL = {root}");
    let _ = writeln!(
        s,
        "FUSEC_MODEL = \"{}\"  # the name fusec's checkpoints carry",
        g.name
    );
    let dims: Vec<String> = g.dims.iter().map(|d| format!("\"{d}\"")).collect();
    let _ = writeln!(s, "DIMS = [{}]", dims.join(", "));
    let _ = writeln!(
        s,
        "# name: (dtype, shape, exclusive bound of the values of an index input)"
    );
    let _ = writeln!(s, "INPUTS = {{");
    for (name, ty, high) in inputs(g) {
        let shape: Vec<String> = ty
            .shape
            .iter()
            .map(|d| match d.as_const() {
                Some(c) => c.to_string(),
                None => format!("\"{d}\""),
            })
            .collect();
        let shape = if shape.len() == 1 {
            format!("({},)", shape[0])
        } else {
            format!("({})", shape.join(", "))
        };
        let high = high.map_or("None".to_string(), |h| h.to_string());
        let _ = writeln!(
            s,
            "    \"{name}\": (\"{}\", {shape}, {high}),",
            ty.dtype.name()
        );
    }
    let _ = writeln!(s, "}}");
    let (kind, settings) = t.optimizer.settings();
    let opt = format!("dict(kind=\"{kind}\", {})", settings.join(", "));
    let _ = writeln!(s, "OPTIMIZER = {opt}");
    let _ = writeln!(
        s,
        "CLIP_GRAD_NORM = {}",
        t.clip_grad_norm.map_or("None".to_string(), float)
    );
    let _ = writeln!(s, "PRECISION = \"{}\"", dtype_word(t.precision));
    let _ = writeln!(s, "MICRO_BATCHES = {}", t.micro_batches);
    let sc = &t.schedule;
    let kind = match sc.decay {
        crate::model::Decay::Constant => "constant",
        crate::model::Decay::Cosine => "cosine",
        crate::model::Decay::Linear => "linear",
        crate::model::Decay::InverseSqrt => "inverse_sqrt",
    };
    let _ = writeln!(
        s,
        "SCHEDULE = dict(kind=\"{kind}\", warmup={}, steps={}, min_lr={})",
        sc.warmup,
        sc.steps.map_or("None".to_string(), |n| n.to_string()),
        float(sc.min_lr)
    );
    s
}

/// Each input with its type and, for `i32` inputs, the bound its readers
/// give it (as `fusec train --data random` draws them).
fn inputs(g: &Graph) -> Vec<(String, crate::ir::TensorType, Option<i64>)> {
    let mut out = Vec::new();
    for n in g.topo_order() {
        let Op::Input(i) = &g.g[n].op else { continue };
        if i.name == crate::ops::DROPOUT_KEY_INPUT {
            continue;
        }
        let high = (i.ty.dtype == DType::I32)
            .then(|| index_bound(g, Value { node: n, port: 0 }, &HashMap::new()))
            .flatten();
        out.push((i.name.clone(), i.ty.clone(), high));
    }
    out
}
