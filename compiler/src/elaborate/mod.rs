//! Elaboration: the syntax tree becomes the forward graph. Constants are
//! folded, blocks are inlined (each call its own parameters), `repeat` is
//! unrolled, and every op's shape rule runs as its node is added, so a
//! mistake is reported at the place in the file that caused it.

mod args;
pub mod builtins;
mod expr;
mod train;
pub mod values;

use crate::diag::{Diagnostic, Errors};
use crate::dsl::ast::{BlockDef, Expr, ExprKind, Ident, Item, Module, Span};
use crate::ir::graph::{Init, ParamInfo, Phase, Role};
use crate::ir::types::{DType, TensorType};
use crate::ir::{Dim, Graph, Value};
use crate::model::Model;
use crate::ops::{Cast, Input, Op, OpError, Param};
use std::collections::{HashMap, HashSet};
use values::Val;

/// Past this many nodes the model is certainly a mistake (or an attack);
/// stopping keeps a bad `repeat` from eating the machine.
const MAX_NODES: usize = 2_000_000;

#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `--set name=value`: replaces a top-level constant.
    pub overrides: Vec<(String, String)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Const,
    Dim,
    Input,
    Param,
    Let,
    Arg,
}

#[derive(Clone, Debug)]
struct Binding {
    val: Val,
    span: Span,
    kind: Kind,
}

struct Frame {
    vars: HashMap<String, Binding>,
    /// Dotted prefix for parameter names declared in this frame.
    prefix: String,
    block: Option<String>,
}

pub(crate) struct Elab<'m> {
    pub graph: Graph,
    pub precision: DType,
    blocks: HashMap<String, &'m BlockDef>,
    frames: Vec<Frame>,
    overrides: HashMap<String, (String, bool)>,
    instances: HashSet<String>,
    consts_out: Vec<(String, String)>,
    calls: Vec<String>,
}

pub fn elaborate(module: &Module, name: &str, opts: &Options) -> Result<Model, Errors> {
    let mut e = Elab {
        graph: Graph::new(name),
        precision: DType::F32,
        blocks: HashMap::new(),
        frames: vec![Frame {
            vars: HashMap::new(),
            prefix: String::new(),
            block: None,
        }],
        overrides: opts.overrides.iter().map(|(k, v)| (k.clone(), (v.clone(), false))).collect(),
        instances: HashSet::new(),
        consts_out: Vec::new(),
        calls: Vec::new(),
    };
    e.run(module).map_err(Errors::from)
}

impl<'m> Elab<'m> {
    fn run(&mut self, module: &'m Module) -> Result<Model, Diagnostic> {
        // Blocks may be used before they are defined; collect them first.
        for item in &module.items {
            if let Item::Block(b) = item {
                if let Some(prev) = self.blocks.insert(b.name.name.clone(), b) {
                    return Err(Diagnostic::new(
                        format!("block `{}` is defined twice", b.name.name),
                        b.name.span,
                        "second definition",
                    )
                    .with_note(prev.name.span, "first defined here"));
                }
            }
        }
        let trains: Vec<_> = module
            .items
            .iter()
            .filter_map(|i| if let Item::Train(t) = i { Some(t) } else { None })
            .collect();
        let Some(section) = trains.first() else {
            let end = module.items.last().map_or(Span::default(), |i| i.span());
            return Err(Diagnostic::new("the model has no `train` section", Span::new(end.end, end.end), "expected `train { loss = ... }` in this file")
                .with_help("add a section such as:\n    train {\n        loss = cross_entropy(logits, targets)\n        optimizer = adamw(lr = 3e-4)\n    }"));
        };
        if let Some(second) = trains.get(1) {
            return Err(Diagnostic::new("the model has two `train` sections", second.span, "second section")
                .with_note(section.span, "first section here"));
        }
        // Precision decides how parameters are read, so it is settled before any item.
        self.precision = train::precision(section)?;
        let mut config = None;
        for item in &module.items {
            match item {
                Item::Block(_) => {}
                Item::Train(t) => config = Some(train::section(self, t)?),
                other => self.item(other)?,
            }
        }
        if let Some((name, _)) = self.overrides.iter().find(|(_, (_, used))| !used) {
            let mut known: Vec<&str> = self.consts_out.iter().map(|(n, _)| n.as_str()).collect();
            known.sort();
            return Err(Diagnostic::new(
                format!("`--set {name}=...` names no top-level constant of this model"),
                Span::default(),
                "",
            )
            .with_help(format!("the constants are: {}", known.join(", "))));
        }
        let config = config.expect("the train section was found above");
        Ok(Model {
            graph: std::mem::replace(&mut self.graph, Graph::new("")),
            train: config,
            consts: std::mem::take(&mut self.consts_out),
        })
    }

    fn frame(&mut self) -> &mut Frame {
        self.frames.last_mut().expect("the global frame is never popped")
    }

    fn bind(&mut self, name: &Ident, val: Val, kind: Kind) -> Result<(), Diagnostic> {
        if let Some(prev) = self.frame().vars.get(&name.name) {
            // `let` may shadow a `let` (x = x + ...); anything else is a clash.
            if !(kind == Kind::Let && matches!(prev.kind, Kind::Let | Kind::Arg)) {
                let what = kind_word(prev.kind);
                return Err(Diagnostic::new(
                    format!("`{}` is already defined", name.name),
                    name.span,
                    "defined again here",
                )
                .with_note(prev.span, format!("first defined here as {what}"))
                .with_help("choose another name; only `let` may rebind a `let`"));
            }
        }
        let b = Binding {
            val,
            span: name.span,
            kind,
        };
        self.frame().vars.insert(name.name.clone(), b);
        Ok(())
    }

    fn lookup(&self, name: &str, span: Span) -> Result<Val, Diagnostic> {
        let top = self.frames.last().expect("a frame");
        if let Some(b) = top.vars.get(name) {
            return Ok(b.val.clone());
        }
        if self.frames.len() > 1 {
            if let Some(b) = self.frames[0].vars.get(name) {
                if matches!(b.kind, Kind::Const | Kind::Dim) {
                    return Ok(b.val.clone());
                }
                let block = top.block.clone().unwrap_or_default();
                return Err(Diagnostic::new(
                    format!("`{name}` is not visible inside block `{block}`"),
                    span,
                    format!("`{name}` is a {} of the top level", kind_word(b.kind)),
                )
                .with_note(b.span, "defined here")
                .with_help("blocks see top-level constants and dimensions; pass tensors in as arguments"));
            }
        }
        if self.blocks.contains_key(name) {
            return Err(Diagnostic::new(format!("block `{name}` used as a value"), span, "call it: `name(x)`"));
        }
        let mut d = Diagnostic::new(format!("unknown name `{name}`"), span, "not defined before this point");
        let candidates = self.frames.iter().flat_map(|f| f.vars.keys()).map(|s| s.as_str());
        if let Some(s) = suggest(name, candidates) {
            d = d.with_help(format!("did you mean `{s}`?"));
        }
        Err(d)
    }

    fn item(&mut self, item: &'m Item) -> Result<(), Diagnostic> {
        match item {
            Item::Const { name, value, .. } => {
                let top = self.frames.len() == 1;
                let mut val = self.eval(value)?;
                if top {
                    if let Some((text, used)) = self.overrides.get_mut(&name.name) {
                        *used = true;
                        val = parse_override(name, text, &val)?;
                    }
                }
                if !matches!(val, Val::Int(_) | Val::Float(_) | Val::Bool(_) | Val::Dim(_)) {
                    return Err(Diagnostic::new(
                        "a constant must be a number",
                        value.span,
                        format!("this is {}", val.describe(&self.graph)),
                    )
                    .with_help("use `let` to name a tensor"));
                }
                if top {
                    let text = match &val {
                        Val::Int(i) => i.to_string(),
                        Val::Float(f) => crate::ir::print::num(*f),
                        Val::Bool(b) => b.to_string(),
                        Val::Dim(d) => d.to_string(),
                        _ => String::new(),
                    };
                    self.consts_out.push((name.name.clone(), text));
                }
                self.bind(name, val, Kind::Const)
            }
            Item::Dim { names, .. } => {
                for n in names {
                    if self.frames.len() > 1 {
                        return Err(Diagnostic::new("`dim` belongs at the top level", n.span, "inside a block"));
                    }
                    self.graph.dims.push(n.name.clone());
                    self.bind(n, Val::Dim(Dim::symbol(&n.name)), Kind::Dim)?;
                }
                Ok(())
            }
            Item::Input { name, dtype, dims, span } => {
                if self.frames.len() > 1 {
                    return Err(Diagnostic::new("`input` belongs at the top level", *span, "inside a block")
                        .with_help("declare inputs at the top and pass them to the block"));
                }
                let dt = parse_dtype(dtype)?;
                let shape = self.shape(dims, true)?;
                let ty = TensorType::new(dt, shape);
                let v = self.add(
                    Input {
                        name: name.name.clone(),
                        ty,
                    }
                    .into(),
                    &[],
                    *span,
                )?[0];
                let v = self.compute_copy(v, *span)?;
                self.bind(name, Val::Tensor(v), Kind::Input)
            }
            Item::Param {
                name,
                dtype,
                dims,
                init,
                span,
            } => self.param(name, dtype.as_ref(), dims, init, *span),
            Item::Let { names, value, span } => {
                let val = self.eval(value)?;
                if names.len() == 1 {
                    return self.bind(&names[0], val, Kind::Let);
                }
                let items = match val {
                    Val::List(items) if items.len() == names.len() => items,
                    other => {
                        let found = match &other {
                            Val::List(items) => format!("{} values", items.len()),
                            v => v.describe(&self.graph),
                        };
                        return Err(Diagnostic::new(
                            format!("`let` expects {} values here", names.len()),
                            value.span,
                            format!("this gives {found}"),
                        )
                        .with_note(*span, "names listed here"));
                    }
                };
                for (n, (v, _)) in names.iter().zip(items) {
                    self.bind(n, v, Kind::Let)?;
                }
                Ok(())
            }
            Item::Block(b) => Err(Diagnostic::new("blocks cannot be nested", b.name.span, "defined inside a block")
                .with_help("define every block at the top level")),
            Item::Train(t) => Err(Diagnostic::new("`train` belongs at the top level", t.span, "inside a block")),
        }
    }

    fn param(
        &mut self,
        name: &Ident,
        dtype: Option<&Ident>,
        dims: &[Expr],
        init: &Expr,
        span: Span,
    ) -> Result<(), Diagnostic> {
        let dt = match dtype {
            Some(d) => parse_dtype(d)?,
            None => DType::F32,
        };
        if dt != DType::F32 {
            return Err(Diagnostic::new(
                "parameters are stored in f32",
                dtype.map_or(span, |d| d.span),
                format!("found {dt}"),
            )
            .with_help("set the compute precision with `precision = bf16` in the train section; master weights stay f32"));
        }
        let shape = self.shape(dims, false)?;
        let init = self.init(init)?;
        let full = format!("{}{}", self.frame().prefix, name.name);
        let ty = TensorType::new(dt, shape);
        let decay = ty.rank() >= 2;
        let v = self.add(
            Param {
                name: full.clone(),
                ty: ty.clone(),
            }
            .into(),
            &[],
            span,
        )?[0];
        self.graph.params.push(ParamInfo {
            name: full,
            ty,
            init,
            decay,
            span: name.span,
            node: v.node,
        });
        let v = self.compute_copy(v, span)?;
        self.bind(name, Val::Tensor(v), Kind::Param)
    }

    /// Floating tensors enter the computation in the compute precision.
    fn compute_copy(&mut self, v: Value, span: Span) -> Result<Value, Diagnostic> {
        let dt = self.graph.ty(v).dtype;
        if dt.is_float() && dt != self.precision {
            return Ok(self.add(Cast { to: self.precision }.into(), &[v], span)?[0]);
        }
        Ok(v)
    }

    fn init(&mut self, e: &Expr) -> Result<Init, Diagnostic> {
        let bad = |found: &str| {
            Diagnostic::new("unknown initialiser", e.span, format!("found {found}"))
                .with_help("use one of: zeros, ones, normal(std), uniform(bound), constant(value)")
        };
        match &e.kind {
            ExprKind::Name(n) if n == "zeros" => Ok(Init::Constant(0.0)),
            ExprKind::Name(n) if n == "ones" => Ok(Init::Constant(1.0)),
            ExprKind::Call { func, args } => {
                let kind = func.name.as_str();
                if !matches!(kind, "normal" | "uniform" | "constant") {
                    return Err(bad(&format!("`{kind}(...)`")));
                }
                if args.len() != 1 || args[0].name.is_some() {
                    return Err(Diagnostic::new(
                        format!("`{kind}` takes one number"),
                        e.span,
                        format!("found {} arguments", args.len()),
                    )
                    .with_help(format!("for example `{kind}(0.02)`")));
                }
                let v = self.eval(&args[0].value)?;
                let Some(x) = v.as_f64().filter(|x| x.is_finite()) else {
                    return Err(Diagnostic::new(
                        format!("`{kind}` needs a finite number"),
                        args[0].value.span,
                        format!("found {}", v.describe(&self.graph)),
                    ));
                };
                if kind != "constant" && x < 0.0 {
                    return Err(Diagnostic::new(format!("`{kind}` needs a non-negative scale"), args[0].value.span, format!("found {x}")));
                }
                Ok(match kind {
                    "normal" => Init::Normal { std: x },
                    "uniform" => Init::Uniform { bound: x },
                    _ => Init::Constant(x),
                })
            }
            ExprKind::Name(n) => Err(bad(&format!("`{n}`"))),
            _ => Err(bad("an expression")),
        }
    }

    /// A list of dimension expressions. Inputs may use symbolic dimensions;
    /// parameters need fixed sizes.
    fn shape(&mut self, dims: &[Expr], symbolic_ok: bool) -> Result<Vec<Dim>, Diagnostic> {
        let mut out = Vec::new();
        for d in dims {
            let v = self.eval(d)?;
            let Some(dim) = v.as_dim() else {
                return Err(Diagnostic::new("expected a dimension", d.span, format!("found {}", v.describe(&self.graph)))
                    .with_help("a dimension is a positive integer, a constant, or a symbolic `dim`"));
            };
            match dim.as_const() {
                Some(c) if c <= 0 => {
                    return Err(Diagnostic::new("dimensions must be positive", d.span, format!("this is {c}")));
                }
                None if !symbolic_ok => {
                    return Err(Diagnostic::new(
                        "a parameter's shape must be fixed",
                        d.span,
                        format!("`{dim}` depends on a symbolic dimension and cannot be inferred here"),
                    )
                    .with_help("parameters are allocated once; use constants for their sizes"));
                }
                _ => {}
            }
            out.push(dim);
        }
        Ok(out)
    }

    /// Adds a node, turning a shape-rule error into a diagnostic at `span`.
    pub(crate) fn add(&mut self, op: Op, inputs: &[Value], span: Span) -> Result<Vec<Value>, Diagnostic> {
        self.add_at(op, inputs, span, &[])
    }

    /// As `add`, with the spans of the arguments so that an error can point at
    /// the one at fault and show the types of the others.
    pub(crate) fn add_at(
        &mut self,
        op: Op,
        inputs: &[Value],
        span: Span,
        arg_spans: &[Span],
    ) -> Result<Vec<Value>, Diagnostic> {
        if self.graph.g.node_count() >= MAX_NODES {
            return Err(Diagnostic::new(
                "the model is too large",
                span,
                format!("more than {MAX_NODES} ops by this point"),
            )
            .with_help("check `repeat` counts and sizes"));
        }
        let types: Vec<TensorType> = inputs.iter().map(|v| self.graph.ty(*v).clone()).collect();
        self.graph
            .add(op, inputs, Some(span), Phase::Forward)
            .map_err(|e| op_error(e, span, arg_spans, &types))
    }

    pub(crate) fn call_block(&mut self, func: &Ident, args: Vec<(Val, Span)>, instance: String, span: Span) -> Result<Val, Diagnostic> {
        let b: &'m BlockDef = self.blocks[&func.name];
        if self.calls.contains(&func.name) {
            return Err(Diagnostic::new(
                format!("block `{}` calls itself", func.name),
                func.span,
                "recursive call",
            )
            .with_help("use `repeat N block(x)` to stack layers"));
        }
        if args.len() != b.params.len() {
            return Err(Diagnostic::new(
                format!("block `{}` takes {} argument{}", func.name, b.params.len(), if b.params.len() == 1 { "" } else { "s" }),
                span,
                format!("found {}", args.len()),
            )
            .with_note(b.name.span, format!("defined here as `{}({})`", func.name, b.params.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", "))));
        }
        let prefix = format!("{}{}.", self.frame().prefix, instance);
        self.frames.push(Frame {
            vars: HashMap::new(),
            prefix,
            block: Some(func.name.clone()),
        });
        self.calls.push(func.name.clone());
        let result = (|| {
            for (p, (v, _)) in b.params.iter().zip(args) {
                self.bind(p, v, Kind::Arg)?;
            }
            for item in &b.body {
                self.item(item)?;
            }
            self.eval(&b.ret)
        })();
        self.calls.pop();
        self.frames.pop();
        result.map_err(|d| d.with_note(span, format!("in this call of block `{}`", func.name)))
    }

    /// A fresh instance name for a block call: `mlp`, then `mlp_2`, ...
    pub(crate) fn instance_name(&mut self, block: &str) -> String {
        let prefix = self.frame().prefix.clone();
        let mut name = block.to_string();
        let mut k = 1;
        while !self.instances.insert(format!("{prefix}{name}")) {
            k += 1;
            name = format!("{block}_{k}");
        }
        name
    }

    pub(crate) fn is_block(&self, name: &str) -> bool {
        self.blocks.contains_key(name)
    }

    pub(crate) fn finish_loss(&mut self, v: Value) {
        self.graph.outputs.push((Role::Loss, v));
    }
}

fn kind_word(k: Kind) -> &'static str {
    match k {
        Kind::Const => "a constant",
        Kind::Dim => "a dimension",
        Kind::Input => "an input",
        Kind::Param => "a parameter",
        Kind::Let => "a `let` value",
        Kind::Arg => "a block argument",
    }
}

fn parse_dtype(id: &Ident) -> Result<DType, Diagnostic> {
    DType::parse(&id.name).ok_or_else(|| {
        Diagnostic::new(format!("unknown dtype `{}`", id.name), id.span, "not a dtype")
            .with_help("the dtypes are f32, bf16, f16 and i32")
    })
}

fn parse_override(name: &Ident, text: &str, current: &Val) -> Result<Val, Diagnostic> {
    let bad = |what: &str| {
        Diagnostic::new(format!("`--set {}={text}` does not fit this constant", name.name), name.span, what)
    };
    match current {
        Val::Int(_) => text.parse::<i64>().map(Val::Int).map_err(|_| bad("this constant is an integer")),
        Val::Float(_) => text.parse::<f64>().map(Val::Float).map_err(|_| bad("this constant is a number")),
        Val::Bool(_) => text.parse::<bool>().map(Val::Bool).map_err(|_| bad("this constant is true or false")),
        _ => Err(bad("only number constants can be set")),
    }
}

/// Places a shape-rule error: at the argument at fault, or at the whole
/// call with the types of its arguments shown beneath.
fn op_error(e: OpError, span: Span, arg_spans: &[Span], types: &[TensorType]) -> Diagnostic {
    let primary = e.arg.and_then(|i| arg_spans.get(i).copied()).unwrap_or(span);
    let mut d = Diagnostic::new(e.message, primary, e.detail);
    if e.arg.is_none() && arg_spans.len() <= 3 {
        for (s, t) in arg_spans.iter().zip(types) {
            d = d.with_note(*s, t.to_string());
        }
    }
    if let Some(h) = e.help {
        d = d.with_help(h);
    }
    d
}

/// The closest known name, if one is close enough to be a typo.
pub(crate) fn suggest<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Option<String> {
    let mut best: Option<(usize, &str)> = None;
    for c in candidates {
        let d = edit_distance(name, c);
        if d <= (name.len().max(2) / 3).max(1) && best.is_none_or(|(bd, bc)| d < bd || (d == bd && c < bc)) {
            best = Some((d, c));
        }
    }
    best.map(|(_, c)| c.to_string())
}

fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    if a.len().abs_diff(b.len()) > 3 || a.len() > 64 || b.len() > 64 {
        return usize::MAX;
    }
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut cur = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let sub = prev[j - 1] + usize::from(a[i - 1] != b[j - 1]);
            cur[j] = sub.min(prev[j] + 1).min(cur[j - 1] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}
