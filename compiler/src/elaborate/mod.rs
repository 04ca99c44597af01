//! Elaboration: the syntax tree becomes the forward graph. Constants are
//! folded, blocks are inlined (each call its own parameters), `repeat` is
//! unrolled, and every op's shape rule runs as its node is added, so a
//! mistake is reported at the place in the file that caused it.

mod args;
pub mod builtins;
mod expr;
mod items;
mod options;
mod train;

pub use options::Options;

use crate::diag::{Diagnostic, Errors};
use crate::dsl::ast::{BlockDef, Expr, ExprKind, Ident, Item, Module, Span};
use crate::ir::graph::{Init, ParamInfo, Phase, Role};
use crate::ir::types::{DType, TensorType};
use crate::ir::{Dim, Graph, Value};
use crate::model::structure;
use crate::model::values::Val;
use crate::model::Model;
use crate::ops::{Cast, Input, Op, OpError, Param};
use std::collections::{HashMap, HashSet};

/// For a dimension that came out as a fraction.
const FRACTION_HELP: &str = "this value is a floating-point number, not an integer: a `/` that does not divide exactly \
     gives one (`10 / 4` is 2.5), and so does anything computed from it; check the constants it uses";

/// Past this many nodes the model is certainly a mistake (or an attack);
/// stopping keeps a bad `repeat` from eating the machine. A GPT-2 layer is
/// about 45 forward ops, so this is over 5,000 layers; it is reached in about
/// half a second, where 2,000,000 took 4 s and 3.6 GB before the error.
const MAX_NODES: usize = 250_000;

/// Deepest nesting of block calls (a block calling a block ...). Real models
/// nest a few levels; each level is a deep recursion of the elaborator.
const MAX_BLOCK_DEPTH: usize = 32;

/// Deepest nesting of expressions being evaluated, counted through block
/// calls: the parser bounds one expression, this bounds a chain of blocks
/// each nesting its call of the next deep inside an expression.
const MAX_EVAL_DEPTH: usize = 500;

/// Most "in this call of block" notes on one error.
const MAX_CALL_NOTES: usize = 8;

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
    /// The block call this frame elaborates (`Span::call`; 0 at the top).
    call: u32,
}

pub(crate) struct Elab<'m> {
    pub graph: Graph,
    pub precision: DType,
    precision_override: Option<DType>,
    /// `Options::ranks`, at least 1.
    pub ranks: u32,
    pub zero_rank: Option<u32>,
    /// `Options::shard_group`, `ranks` where it is 0.
    pub shard_group: u32,
    blocks: HashMap<String, &'m BlockDef>,
    frames: Vec<Frame>,
    overrides: HashMap<String, (String, bool)>,
    instances: HashSet<String>,
    consts_out: Vec<(String, String)>,
    calls: Vec<String>,
    /// Expressions being evaluated, counted across block calls.
    depth: usize,
    pub(crate) structure: structure::Structure,
    /// The step's dropout key (`ops::DROPOUT_KEY_INPUT`), made by the first
    /// `dropout` call, and the sites numbered so far.
    dropout_key: Option<Value>,
    dropout_sites: u32,
}

pub fn elaborate(module: &Module, name: &str, opts: &Options) -> Result<Model, Errors> {
    let mut e = Elab {
        graph: Graph::new(name),
        precision: DType::F32,
        precision_override: opts.precision,
        ranks: opts.ranks.max(1),
        zero_rank: opts.zero_rank.filter(|_| opts.ranks > 1),
        shard_group: match opts.shard_group {
            0 => opts.ranks.max(1),
            g => g,
        },
        blocks: HashMap::new(),
        frames: vec![Frame {
            vars: HashMap::new(),
            prefix: String::new(),
            block: None,
            call: 0,
        }],
        overrides: opts
            .overrides
            .iter()
            .map(|(k, v)| (k.clone(), (v.clone(), false)))
            .collect(),
        instances: HashSet::new(),
        consts_out: Vec::new(),
        calls: Vec::new(),
        depth: 0,
        structure: structure::Structure::default(),
        dropout_key: None,
        dropout_sites: 0,
    };
    e.run(module).map_err(Errors::from)
}

impl<'m> Elab<'m> {
    fn run(&mut self, module: &'m Module) -> Result<Model, Diagnostic> {
        // Blocks may be used before they are defined; collect them first.
        for item in &module.items {
            if let Item::Block(b) = item {
                if builtins::BUILTINS.iter().any(|f| f.name == b.name.name) {
                    return Err(Diagnostic::new(
                        format!("block `{}` has the name of a builtin function", b.name.name),
                        b.name.span,
                        "expected a name that is not a builtin",
                    )
                    .with_help("rename the block; calls would otherwise be ambiguous"));
                }
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
            .filter_map(|i| {
                if let Item::Train(t) = i {
                    Some(t)
                } else {
                    None
                }
            })
            .collect();
        let Some(section) = trains.first() else {
            let end = module.items.last().map_or(Span::default(), |i| i.span());
            return Err(Diagnostic::new("the model has no `train` section", Span::new(end.end, end.end), "expected `train { loss = ... }` in this file")
                .with_help("add a section such as:\n    train {\n        loss = cross_entropy(logits, targets)\n        optimizer = adamw(lr = 3e-4)\n    }"));
        };
        if let Some(second) = trains.get(1) {
            return Err(Diagnostic::new(
                "the model has two `train` sections",
                second.span,
                "second section",
            )
            .with_note(section.span, "first section here"));
        }
        // Precision decides how parameters are read, so it is settled before any item.
        // The section's own setting is checked even where `--precision` replaces it.
        let written = train::precision(section)?;
        self.precision = self.precision_override.unwrap_or(written);
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
            structure: std::mem::take(&mut self.structure),
        })
    }

    fn frame(&mut self) -> &mut Frame {
        self.frames
            .last_mut()
            .expect("the global frame is never popped")
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
                    format!("`{name}` is {} of the top level", kind_word(b.kind)),
                )
                .with_note(b.span, "defined here")
                .with_help(
                    "blocks see top-level constants and dimensions; pass tensors in as arguments",
                ));
            }
        }
        if self.blocks.contains_key(name) {
            return Err(Diagnostic::new(
                format!("block `{name}` used as a value"),
                span,
                format!("expected a value, found the block `{name}`"),
            )
            .with_help(format!(
                "call it: `{name}({})`",
                block_params(self.blocks[name])
            )));
        }
        let mut d = Diagnostic::new(
            format!("unknown name `{name}`"),
            span,
            "not defined before this point",
        );
        let candidates = self
            .frames
            .iter()
            .flat_map(|f| f.vars.keys())
            .map(|s| s.as_str());
        if let Some(s) = suggest(name, candidates) {
            d = d.with_help(format!("did you mean `{s}`?"));
        } else if crate::ir::DType::parse(name).is_some() {
            d = d.with_help(format!("`{name}` is a dtype: it goes in `input x: {name}[...]`, or `precision = {name}` in the train section"));
        } else if matches!(name, "zeros" | "ones") {
            d = d.with_help(format!(
                "`{name}` is an initialiser: it goes after `=` in `param w: [...] = {name}`"
            ));
        }
        Err(d)
    }

    /// Adds a node, turning a shape-rule error into a diagnostic at `span`.
    pub(crate) fn add(
        &mut self,
        op: Op,
        inputs: &[Value],
        span: Span,
    ) -> Result<Vec<Value>, Diagnostic> {
        self.add_at(op, inputs, span, &[])
    }

    /// As `add`, with the spans of the arguments so that an error can point at
    /// the one at fault and show the types of the others.
    /// The step's dropout key: one input for the whole model, added at
    /// the first `dropout` (the runtime sets it before every micro-batch).
    pub(crate) fn dropout_key(&mut self, span: Span) -> Result<Value, Diagnostic> {
        if let Some(k) = self.dropout_key {
            return Ok(k);
        }
        let input = Input {
            name: crate::ops::DROPOUT_KEY_INPUT.into(),
            ty: crate::ops::dropout_key_type(),
        };
        let k = self.add(input.into(), &[], span)?[0];
        self.dropout_key = Some(k);
        Ok(k)
    }

    /// A new dropout site: each call draws a mask of its own.
    pub(crate) fn next_dropout_site(&mut self) -> u32 {
        self.dropout_sites += 1;
        self.dropout_sites - 1
    }

    pub(crate) fn add_at(
        &mut self,
        op: Op,
        inputs: &[Value],
        span: Span,
        arg_spans: &[Span],
    ) -> Result<Vec<Value>, Diagnostic> {
        if self.graph.g.node_count() >= MAX_NODES {
            return Err(Diagnostic::new(
                format!("the model is too large: more than {MAX_NODES} ops"),
                span,
                "the limit is reached here",
            )
            .with_help("a transformer layer is about 50 ops; check the `repeat` counts"));
        }
        // The node's place carries the block call it is made in; the
        // diagnostics below keep the plain place.
        let place = span.in_call(self.frame().call);
        let outs = match self.graph.add(op, inputs, Some(place), Phase::Forward) {
            Ok(outs) => outs,
            Err(e) => {
                // A failed add leaves the graph as it was; the types are only needed here.
                let types: Vec<TensorType> =
                    inputs.iter().map(|v| self.graph.ty(*v).clone()).collect();
                return Err(op_error(e, span, arg_spans, &types));
            }
        };
        for v in &outs {
            let ty = self.graph.ty(*v);
            let fits = ty
                .shape
                .iter()
                .try_fold(Dim::constant(1), |acc, d| acc.checked_mul(d))
                .is_some();
            if !fits {
                return Err(Diagnostic::new(
                    "tensor too large",
                    span,
                    format!("expected at most 2^63 elements, but {ty} has more"),
                )
                .with_help(
                    "check the sizes: the element count of every tensor must fit in 64 bits",
                ));
            }
        }
        Ok(outs)
    }

    pub(crate) fn call_block(
        &mut self,
        func: &Ident,
        args: Vec<(Val, Span)>,
        instance: String,
        span: Span,
    ) -> Result<Val, Diagnostic> {
        let b: &'m BlockDef = self.blocks[&func.name];
        if self.calls.contains(&func.name) {
            return Err(Diagnostic::new(
                format!("block `{}` calls itself", func.name),
                func.span,
                "recursive call",
            )
            .with_help("use `repeat N block(x)` to stack layers"));
        }
        if self.calls.len() >= MAX_BLOCK_DEPTH {
            // Each level is a deep recursion of the elaborator: stop well before the stack does.
            return Err(Diagnostic::new(
                format!("blocks nested too deeply (more than {MAX_BLOCK_DEPTH} levels)"),
                func.span,
                format!("expected at most {MAX_BLOCK_DEPTH} blocks inside one another, found a call of `{}` at level {}", func.name, self.calls.len() + 1),
            )
            .with_help("call the blocks one after another rather than each from inside the last"));
        }
        if args.len() != b.params.len() {
            return Err(Diagnostic::new(
                format!(
                    "block `{}` takes {} argument{}",
                    func.name,
                    b.params.len(),
                    if b.params.len() == 1 { "" } else { "s" }
                ),
                span,
                format!("expected {}, found {}", b.params.len(), args.len()),
            )
            .with_note(
                b.name.span,
                format!(
                    "defined here as `{}({})`",
                    func.name,
                    b.params
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        let prefix = format!("{}{}.", self.frame().prefix, instance);
        let first = self.graph.g.node_count();
        let record_args: Vec<(String, Val)> = b
            .params
            .iter()
            .zip(&args)
            .map(|(p, (v, _))| (p.name.clone(), v.clone()))
            .collect();
        let outer = self.frame().call;
        self.graph.calls.push(crate::ir::graph::CallSite {
            block: func.name.clone(),
            path: prefix.trim_end_matches('.').to_string(),
            site: span.in_call(outer),
        });
        let call = self.graph.calls.len() as u32;
        self.frames.push(Frame {
            vars: HashMap::new(),
            prefix: prefix.clone(),
            block: Some(func.name.clone()),
            call,
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
        if let Ok(val) = &result {
            self.structure.calls.push(structure::CallRecord {
                block: func.name.clone(),
                path: prefix.trim_end_matches('.').to_string(),
                args: record_args,
                result: val.clone(),
                first,
                end: self.graph.g.node_count(),
            });
        }
        result.map_err(|d| {
            // The innermost calls explain the error; past a few, the notes are noise.
            if d.secondary.len() >= MAX_CALL_NOTES {
                return d;
            }
            d.with_note(span, format!("in this call of block `{}`", func.name))
        })
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

/// `x, residual`: a block's parameter names, for messages.
fn block_params(b: &BlockDef) -> String {
    b.params
        .iter()
        .map(|p| p.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
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
        let d = Diagnostic::new(
            format!("unknown dtype `{}`", id.name),
            id.span,
            format!("expected f32, bf16, f16 or i32, found `{}`", id.name),
        );
        // The spellings of other frameworks.
        let meant = match id.name.as_str() {
            "float32" | "float" | "fp32" => Some("f32".to_string()),
            "bfloat16" => Some("bf16".to_string()),
            "float16" | "half" | "fp16" => Some("f16".to_string()),
            "int32" | "int" | "int64" | "long" | "i64" => Some("i32".to_string()),
            other => suggest(other, ["f32", "bf16", "f16", "i32"].into_iter()),
        };
        match meant {
            Some(m) => d.with_help(format!("did you mean `{m}`?")),
            None => d,
        }
    })
}

fn parse_override(name: &Ident, text: &str, current: &Val) -> Result<Val, Diagnostic> {
    let bad = |what: &str| {
        Diagnostic::new(
            format!("`--set {}={text}` does not fit this constant", name.name),
            name.span,
            what,
        )
    };
    match current {
        Val::Int(_) => text
            .parse::<i64>()
            .map(Val::Int)
            .map_err(|_| bad("this constant is an integer")),
        Val::Float(_) => text
            .parse::<f64>()
            .map(Val::Float)
            .map_err(|_| bad("this constant is a number")),
        Val::Bool(_) => text
            .parse::<bool>()
            .map(Val::Bool)
            .map_err(|_| bad("this constant is true or false")),
        _ => Err(bad("only number constants can be set")),
    }
}

/// Places a shape-rule error: at the argument at fault, or at the whole
/// call with the types of its arguments shown beneath.
fn op_error(e: OpError, span: Span, arg_spans: &[Span], types: &[TensorType]) -> Diagnostic {
    let primary = e
        .arg
        .and_then(|i| arg_spans.get(i).copied())
        .unwrap_or(span);
    let mut d = Diagnostic::new(e.message, primary, e.detail.clone());
    if arg_spans.len() <= 3 {
        // The type of each argument under it; when one argument is at fault,
        // only the others, and only where its label does not already say it.
        for (i, (s, t)) in arg_spans.iter().zip(types).enumerate() {
            let ty = t.to_string();
            if e.arg.is_some() && (e.arg == Some(i) || *s == primary || e.detail.contains(&ty)) {
                continue;
            }
            d = d.with_note(*s, ty);
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
        // A typo, or a name cut short or run on (`clip_grad` for `clip_grad_norm`).
        // Replacing every letter of a short name is no typo (`v` is not `B`).
        let close = (d <= (name.len().max(2) / 3).max(1) && d < name.chars().count())
            || (name.len().min(c.len()) >= 3 && (c.starts_with(name) || name.starts_with(c)));
        let d = if close {
            d.min(name.len().abs_diff(c.len()))
        } else {
            d
        };
        if close && best.is_none_or(|(bd, bc)| d < bd || (d == bd && c < bc)) {
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
    // Optimal string alignment: a swap of two neighbours (`mpl` for `mlp`) is one edit.
    let mut before: Vec<usize> = Vec::new();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut cur = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let sub = prev[j - 1] + usize::from(a[i - 1] != b[j - 1]);
            cur[j] = sub.min(prev[j] + 1).min(cur[j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                cur[j] = cur[j].min(before[j - 2] + 1);
            }
        }
        before = std::mem::replace(&mut prev, cur);
    }
    prev[b.len()]
}
