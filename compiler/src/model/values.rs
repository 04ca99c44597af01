//! What an expression evaluates to while a model file is elaborated:
//! compile-time numbers and dimensions, or tensors in the graph.

use crate::dsl::ast::Span;
use crate::ir::types::shape_string;
use crate::ir::{Dim, Graph, Value};

#[derive(Clone, Debug)]
pub enum Val {
    Int(i64),
    Float(f64),
    Bool(bool),
    /// A symbolic dimension expression such as `T` or `B*T`.
    Dim(Dim),
    Tensor(Value),
    /// `[a, b]` or `(a, b)`, or the several results of `split`.
    List(Vec<(Val, Span)>),
}

impl Val {
    /// A short description for messages: `an integer (12)`, `a tensor f32[B, T, 768]`.
    pub fn describe(&self, g: &Graph) -> String {
        match self {
            Val::Int(i) => format!("the integer {i}"),
            // `64.0`, not `64`: a fraction where an integer is expected must look like one.
            Val::Float(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("the number {f:.1}"),
            Val::Float(f) => format!("the number {}", crate::ir::print::num(*f)),
            Val::Bool(b) => format!("`{b}`"),
            Val::Dim(d) => format!("the dimension {d}"),
            Val::Tensor(v) => format!("a tensor {}", g.ty(*v)),
            Val::List(items) => format!("a list of {} items", items.len()),
        }
    }

    /// A dimension, if this is an integer or a dimension expression.
    pub fn as_dim(&self) -> Option<Dim> {
        match self {
            Val::Int(i) => Some(Dim::constant(*i)),
            Val::Dim(d) => Some(d.clone()),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Val::Int(i) => Some(*i as f64),
            Val::Float(f) => Some(*f),
            Val::Dim(d) => d.as_const().map(|c| c as f64),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Val::Int(i) => Some(*i),
            Val::Dim(d) => d.as_const(),
            _ => None,
        }
    }
}

/// Normalises a dimension to an integer when it no longer has symbols.
pub fn dim_val(d: Dim) -> Val {
    match d.as_const() {
        Some(c) => Val::Int(c),
        None => Val::Dim(d),
    }
}

pub fn shape_text(shape: &[Dim]) -> String {
    shape_string(shape)
}
