//! The syntax tree of a model file. Every node keeps the byte span it came
//! from so that any later stage (elaboration, shape checking, autodiff) can
//! point a diagnostic at the exact place in the source.

pub use crate::diag::Span;

#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

/// A whole model file.
#[derive(Clone, Debug, PartialEq)]
pub struct Module {
    pub items: Vec<Item>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    /// `const NAME = expr`
    Const {
        name: Ident,
        value: Expr,
        span: Span,
    },
    /// `dim B, T`: symbolic dimensions, bound only when the model is built or run.
    Dim { names: Vec<Ident>, span: Span },
    /// `input tokens: i32[B, T]`
    Input {
        name: Ident,
        dtype: Ident,
        dims: Vec<Expr>,
        span: Span,
    },
    /// `param w: [C, 4*C] = normal(0.02)`; the dtype before `[` is optional.
    Param {
        name: Ident,
        dtype: Option<Ident>,
        dims: Vec<Expr>,
        init: Expr,
        span: Span,
    },
    /// `let x = expr` or `let q, k, v = expr`
    Let {
        names: Vec<Ident>,
        value: Expr,
        span: Span,
    },
    /// `block name(a, b) { items... return expr }`
    Block(BlockDef),
    /// `train { loss = ..., optimizer = adamw(...), ... }`
    Train(TrainSection),
}

impl Item {
    pub fn span(&self) -> Span {
        match self {
            Item::Const { span, .. }
            | Item::Dim { span, .. }
            | Item::Input { span, .. }
            | Item::Param { span, .. }
            | Item::Let { span, .. } => *span,
            Item::Block(b) => b.span,
            Item::Train(t) => t.span,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct BlockDef {
    pub name: Ident,
    pub params: Vec<Ident>,
    /// Only `Const`, `Param` and `Let` items appear here.
    pub body: Vec<Item>,
    pub ret: Expr,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TrainSection {
    pub entries: Vec<TrainEntry>,
    pub span: Span,
}

/// `key = value` inside `train { }`.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainEntry {
    pub key: Ident,
    pub value: Expr,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    MatMul,
}

impl BinOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::MatMul => "@",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    Int(i64),
    Float(f64),
    Bool(bool),
    Name(String),
    Neg(Box<Expr>),
    Binary {
        op: BinOp,
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    /// `f(a, b, key = c)`
    Call {
        func: Ident,
        args: Vec<Arg>,
    },
    /// `x[0, :, 1:T, ...]`
    Index {
        base: Box<Expr>,
        indices: Vec<IndexItem>,
    },
    /// `[a, b, c]`
    List(Vec<Expr>),
    /// `(a, b)`; a single parenthesised expression is not a tuple.
    Tuple(Vec<Expr>),
    /// `repeat N f(x, ...)`: apply the block `f` N times, threading the first argument.
    Repeat {
        count: Box<Expr>,
        func: Ident,
        args: Vec<Arg>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    pub name: Option<Ident>,
    pub value: Expr,
}

#[derive(Clone, Debug, PartialEq)]
pub enum IndexItem {
    /// `i`: picks one position and drops the axis.
    Single(Expr),
    /// `a:b`, `a:`, `:b` or `:`: keeps the axis.
    Range {
        start: Option<Expr>,
        end: Option<Expr>,
        span: Span,
    },
    /// `...`: as many full axes as needed.
    Ellipsis(Span),
}
