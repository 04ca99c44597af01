//! Reads the text form `print::print_graph` writes back into a `Graph`, so
//! a graph can be written by hand (the filetests under `tests/filetests/`)
//! or saved and read again. `print_graph(parse_graph(t))` gives `t` back
//! for any printed graph, less the `@line:col` positions: those point into
//! a model file the text does not carry, so nodes come back without spans.
//!
//! ```text
//! graph NAME (B, T)
//! params:
//!   [0] w: f32[16, 16] = normal(std=0.02)  # 256 values
//! forward:
//!   %0: f32[B, 16] = input "x"
//!   %1: f32[16, 16] = param "w"
//!   %2: f32[B, 16] = matmul(%0, %1)
//!   %3: f32[B, 16], %4: f32[B] = some_op(%2) key=value  recomputed  @3:9
//! outputs:
//!   loss = %4
//! ```
//!
//! `;` (and `#`, which the printer uses after a parameter) start comments;
//! blank lines are skipped. Value names are `%` and any word, defined
//! before use. Every node is added through `Graph::add`, so its op checks
//! its inputs, and the types a line declares must be the ones the op gives.

mod lex;
mod ops;

use super::graph::{Graph, Init, ParamInfo, Phase, Role, Value};
use super::types::TensorType;
use crate::dsl::ast::Span;
use lex::{Cursor, Tok};
use std::collections::HashMap;
use std::fmt;

/// Where the text stops making sense, and what was expected there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// 1-based.
    pub line: usize,
    /// 1-based, in characters.
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.line, self.col, self.message)
    }
}

impl std::error::Error for ParseError {}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Section {
    /// After the header, before any heading.
    Start,
    Params,
    Nodes,
    Outputs,
}

/// A `params:` line, resolved to its node once the nodes are read.
struct ParamLine {
    line: usize,
    name: String,
    ty: TensorType,
    init: Init,
    decay: bool,
}

struct Parser {
    g: Graph,
    section: Section,
    phase: Option<Phase>,
    values: HashMap<String, Value>,
    params: Vec<ParamLine>,
    /// Line of each graph output, for messages.
    output_lines: Vec<(usize, usize)>,
}

pub fn parse_graph(text: &str) -> Result<Graph, ParseError> {
    let mut lines = text.lines().enumerate();
    let (name, dims) = loop {
        let Some((i, line)) = lines.next() else {
            return Err(ParseError {
                line: text.lines().count().max(1),
                col: 1,
                message: "expected a header `graph NAME (DIMS)`, found no graph".into(),
            });
        };
        let mut c = Cursor::new(i + 1, line, &[]);
        if !c.at_end() {
            break header(&mut c)?;
        }
    };
    let mut p = Parser {
        g: Graph::new(&name),
        section: Section::Start,
        phase: None,
        values: HashMap::new(),
        params: Vec::new(),
        output_lines: Vec::new(),
    };
    for (i, line) in lines {
        let mut c = Cursor::new(i + 1, line, &dims);
        if !c.at_end() {
            p.line(&mut c)?;
        }
    }
    p.g.dims = dims;
    p.finish()
}

/// `graph NAME (B, T)`: the name and the dimensions.
fn header(c: &mut Cursor) -> Result<(String, Vec<String>), ParseError> {
    if c.peek()? != Some(Tok::Ident("graph")) {
        return Err(c.expected("a header `graph NAME (DIMS)`"));
    }
    c.word("graph")?;
    let name = c.raw_until_last('(', "the graph's name and its dimensions in `(...)`")?;
    c.punct('(')?;
    let mut dims: Vec<String> = Vec::new();
    if !c.eat(')')? {
        loop {
            let col = c.col();
            let d = c.ident("a dimension name")?;
            if dims.iter().any(|x| x == d) {
                return Err(c.error_at(col, format!("dimension `{d}` is declared twice")));
            }
            dims.push(d.to_string());
            if c.eat(')')? {
                break;
            }
            if !c.eat(',')? {
                return Err(c.expected("`,` or `)`"));
            }
        }
    }
    if !c.at_end() {
        return Err(c.expected("the end of the line"));
    }
    Ok((name.to_string(), dims))
}

impl Parser {
    fn line(&mut self, c: &mut Cursor) -> Result<(), ParseError> {
        let col = c.col();
        match c.peek()? {
            Some(Tok::Ident(w @ ("params" | "forward" | "backward" | "update" | "outputs"))) => {
                c.next()?;
                if !c.eat(':')? {
                    return Err(c.expected(&format!("`:` after `{w}`")));
                }
                if !c.at_end() {
                    return Err(c.expected("the end of the line"));
                }
                let (section, phase) = match w {
                    "params" => (Section::Params, None),
                    "forward" => (Section::Nodes, Some(Phase::Forward)),
                    "backward" => (Section::Nodes, Some(Phase::Backward)),
                    "update" => (Section::Nodes, Some(Phase::Update)),
                    _ => (Section::Outputs, None),
                };
                let out_of_order = section < self.section
                    || (section == self.section && section != Section::Nodes);
                if out_of_order {
                    return Err(c.error_at(
                        col,
                        format!(
                            "`{w}:` out of place: the sections go params, phases (forward, backward, update), outputs, each section once"
                        ),
                    ));
                }
                self.section = section;
                self.phase = phase.or(self.phase);
                Ok(())
            }
            _ => match self.section {
                Section::Params => self.param(c),
                Section::Start | Section::Nodes => self.node(c),
                Section::Outputs => self.output(c),
            },
        }
    }

    /// `[0] h.0.w: f32[16, 16] = normal(std=0.02) no_decay`.
    fn param(&mut self, c: &mut Cursor) -> Result<(), ParseError> {
        if c.peek()? != Some(Tok::Punct('[')) {
            return Err(c.expected("a parameter `[i] NAME: TYPE = INIT` or a phase heading"));
        }
        c.punct('[')?;
        let col = c.col();
        let i = c.usize()?;
        if i != self.params.len() {
            return Err(c.error_at(
                col,
                format!(
                    "parameters are numbered in order: expected [{}], found [{i}]",
                    self.params.len()
                ),
            ));
        }
        c.punct(']')?;
        let col = c.col();
        let name = c.raw_until(':', "a parameter name followed by `:`")?;
        if self.params.iter().any(|p| p.name == name) {
            return Err(c.error_at(col, format!("parameter `{name}` is listed twice")));
        }
        c.punct(':')?;
        let ty = c.tensor_type()?;
        c.punct('=')?;
        let init = init(c)?;
        let decay = !c.flag("no_decay")?;
        if !c.at_end() {
            return Err(c.expected("`no_decay` or the end of the line"));
        }
        self.params.push(ParamLine {
            line: c.line,
            name: name.to_string(),
            ty,
            init,
            decay,
        });
        Ok(())
    }

    /// `%3: f32[B, 16] = add(%1, %2) attrs  recomputed  @4:7`.
    fn node(&mut self, c: &mut Cursor) -> Result<(), ParseError> {
        let Some(phase) = self.phase else {
            return Err(c.expected("a phase heading (`forward:`, `backward:` or `update:`)"));
        };
        let mut outs: Vec<(String, usize, TensorType, usize)> = Vec::new();
        loop {
            let col = c.col();
            let name = match c.peek()? {
                Some(Tok::Value(s)) => {
                    c.next()?;
                    s
                }
                _ if outs.is_empty() => {
                    return Err(c.expected("a node `%k: TYPE = op(...)`, a heading or `outputs:`"))
                }
                _ => return Err(c.expected("another result `%k: TYPE`")),
            };
            if self.values.contains_key(name) || outs.iter().any(|o| o.0 == name) {
                return Err(c.error_at(col, format!("value `%{name}` is defined twice")));
            }
            c.punct(':')?;
            let ty_col = c.col();
            let ty = c.tensor_type()?;
            outs.push((name.to_string(), col, ty, ty_col));
            if c.eat('=')? {
                break;
            }
            if !c.eat(',')? {
                return Err(c.expected("`=` or `,` and another result"));
            }
        }
        let op_col = c.col();
        let op_name = c.ident("an op name")?;
        let mut inputs = Vec::new();
        if c.eat('(')? && !c.eat(')')? {
            loop {
                let col = c.col();
                let name = c.value_name()?;
                match self.values.get(name) {
                    Some(&v) => inputs.push(v),
                    None => {
                        return Err(c.error_at(
                            col,
                            format!("value `%{name}` is not defined on an earlier line"),
                        ))
                    }
                }
                if c.eat(')')? {
                    break;
                }
                if !c.eat(',')? {
                    return Err(c.expected("`,` or `)`"));
                }
            }
        }
        let types: Vec<TensorType> = outs.iter().map(|o| o.2.clone()).collect();
        let op = ops::op(c, op_name, op_col, &types)?;
        let recompute_col = c.col();
        let recompute = c.flag("recomputed")?;
        if recompute && phase != Phase::Backward {
            return Err(c.error_at(
                recompute_col,
                format!(
                    "only a backward node can be recomputed; this one is in the {} phase",
                    phase.name()
                ),
            ));
        }
        if c.eat('@')? {
            // The model-file position: no model file here, so no span.
            c.usize()?;
            c.punct(':')?;
            c.usize()?;
        }
        if !c.at_end() {
            return Err(c.expected(&format!(
                "the end of the line (after `{op_name}` and its attributes)"
            )));
        }
        let got = self
            .g
            .add(op, &inputs, None, phase)
            .map_err(|e| c.error_at(op_col, format!("`{op_name}` rejects its inputs: {e}")))?;
        if got.len() != outs.len() {
            return Err(c.error_at(
                op_col,
                format!(
                    "`{op_name}` gives {} result{} here, the line names {}",
                    got.len(),
                    if got.len() == 1 { "" } else { "s" },
                    outs.len()
                ),
            ));
        }
        let node = got[0].node;
        self.g.g[node].recompute = recompute;
        for ((name, _, ty, ty_col), v) in outs.into_iter().zip(got) {
            if *self.g.ty(v) != ty {
                return Err(c.error_at(
                    ty_col,
                    format!(
                        "`{op_name}` gives {} here, the line says {ty}",
                        self.g.ty(v)
                    ),
                ));
            }
            self.values.insert(name, v);
        }
        Ok(())
    }

    /// `loss = %3`, `grad[0] = %9`, `param[0] = %12`, `state "w.adam_m" =
    /// %13`, `grad_norm = %8`.
    fn output(&mut self, c: &mut Cursor) -> Result<(), ParseError> {
        let col = c.col();
        let role =
            match c.peek()? {
                Some(Tok::Ident("loss")) => {
                    c.next()?;
                    Role::Loss
                }
                Some(Tok::Ident("grad_norm")) => {
                    c.next()?;
                    Role::GradNorm
                }
                Some(Tok::Ident("logits")) => {
                    c.next()?;
                    Role::Logits
                }
                Some(Tok::Ident("token_losses")) => {
                    c.next()?;
                    Role::TokenLosses
                }
                Some(Tok::Ident("next_tokens")) => {
                    c.next()?;
                    Role::NextTokens
                }
                Some(Tok::Ident(w @ ("grad" | "param"))) => {
                    c.next()?;
                    c.punct('[')?;
                    let i_col = c.col();
                    let i = c.usize()?;
                    c.punct(']')?;
                    if i >= self.params.len() {
                        return Err(c.error_at(
                            i_col,
                            format!(
                                "there is no parameter [{i}] (the graph lists {})",
                                self.params.len()
                            ),
                        ));
                    }
                    if w == "grad" {
                        Role::Grad(i)
                    } else {
                        Role::NewParam(i)
                    }
                }
                Some(Tok::Ident("state")) => {
                    c.next()?;
                    Role::NewState(c.string_lit("the state's name in quotes")?)
                }
                _ => return Err(c.expected(
                    "an output (`loss`, `grad[i]`, `param[i]`, `state \"NAME\"` or `grad_norm`)",
                )),
            };
        c.punct('=')?;
        let v_col = c.col();
        let name = c.value_name()?;
        let Some(&v) = self.values.get(name) else {
            return Err(c.error_at(v_col, format!("value `%{name}` is not defined")));
        };
        if !c.at_end() {
            return Err(c.expected("the end of the line"));
        }
        if self.g.outputs.iter().any(|(r, _)| *r == role) {
            return Err(c.error_at(col, format!("output `{role}` is listed twice")));
        }
        if self.g.g[v.node].recompute {
            return Err(c.error_at(
                v_col,
                format!("output `{role}` is a recomputed value; no output may be"),
            ));
        }
        self.g.outputs.push((role, v));
        self.output_lines.push((c.line, col));
        Ok(())
    }

    /// Ties each parameter line to its `param` node, then verifies.
    fn finish(mut self) -> Result<Graph, ParseError> {
        for p in std::mem::take(&mut self.params) {
            let node =
                self.g.g.node_indices().find(
                    |&n| matches!(&self.g.g[n].op, crate::ops::Op::Param(q) if q.name == p.name),
                );
            let Some(node) = node else {
                return Err(ParseError {
                    line: p.line,
                    col: 1,
                    message: format!("parameter `{}` has no node `param \"{}\"`", p.name, p.name),
                });
            };
            self.g.params.push(ParamInfo {
                name: p.name,
                ty: p.ty,
                init: p.init,
                decay: p.decay,
                span: Span::default(),
                node,
            });
        }
        if let Err(problems) = super::verify::verify(&self.g) {
            // Every node and output was checked as it was read; what is
            // left is the graph as a whole (a cycle cannot be written).
            let (line, col) = self.output_lines.first().copied().unwrap_or((1, 1));
            return Err(ParseError {
                line,
                col,
                message: format!("the graph is invalid: {}", problems.join("; ")),
            });
        }
        Ok(self.g)
    }
}

/// `normal(std=0.02)`, `uniform(bound=0.1)`, `zeros`, `ones`, `constant(0.5)`.
fn init(c: &mut Cursor) -> Result<Init, ParseError> {
    let what =
        "an initialiser (`normal(std=..)`, `uniform(bound=..)`, `zeros`, `ones` or `constant(..)`)";
    let col = c.col();
    let word = c.ident(what)?;
    let init = match word {
        "zeros" => return Ok(Init::Constant(0.0)),
        "ones" => return Ok(Init::Constant(1.0)),
        "normal" => {
            c.punct('(')?;
            c.key("std")?;
            Init::Normal { std: c.float()? }
        }
        "uniform" => {
            c.punct('(')?;
            c.key("bound")?;
            Init::Uniform { bound: c.float()? }
        }
        "constant" => {
            c.punct('(')?;
            Init::Constant(c.float()?)
        }
        _ => return Err(c.error_at(col, format!("expected {what}, found `{word}`"))),
    };
    c.punct(')')?;
    Ok(init)
}

#[cfg(test)]
mod tests;
