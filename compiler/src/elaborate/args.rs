//! Arguments of a builtin call, fetched by position or keyword, with the
//! errors a person needs when they are missing, extra or of the wrong kind.

use crate::diag::Diagnostic;
use crate::dsl::ast::{Ident, Span};
use crate::ir::{Dim, Graph, Value};
use crate::model::values::Val;

#[derive(Default)]
pub struct Args {
    pub func: String,
    pub sig: &'static str,
    pub span: Span,
    pub func_span: Span,
    pub pos: Vec<(Val, Span)>,
    pub kw: Vec<(Ident, Val, Span)>,
    used_kw: Vec<String>,
    max_pos: usize,
}

impl Args {
    fn help(&self, d: Diagnostic) -> Diagnostic {
        d.with_help(format!("usage: {}", self.sig))
    }

    /// Argument `i` by position, or by keyword `name`.
    pub fn get(&mut self, i: usize, name: &str) -> Result<Option<(Val, Span)>, Diagnostic> {
        self.max_pos = self.max_pos.max(i + 1);
        self.used_kw.push(name.to_string());
        let mut named = self.kw.iter().filter(|(n, _, _)| n.name == name);
        let by_kw = named.next();
        if let (Some((first, _, _)), Some((again, _, _))) = (by_kw, named.next()) {
            return Err(self.help(
                Diagnostic::new(
                    format!("`{name}` is given twice"),
                    again.span,
                    "given again here",
                )
                .with_note(first.span, "first given here"),
            ));
        }
        match (self.pos.get(i), by_kw) {
            (Some((_, ps)), Some((n, _, _))) => Err(self.help(
                Diagnostic::new(
                    format!("`{name}` is given twice"),
                    n.span,
                    format!("already given by position, as argument {}", i + 1),
                )
                .with_note(*ps, format!("`{name}` by position")),
            )),
            (Some(p), None) => Ok(Some(p.clone())),
            (None, Some((_, v, s))) => Ok(Some((v.clone(), *s))),
            (None, None) => Ok(None),
        }
    }

    pub fn required(&mut self, i: usize, name: &str) -> Result<(Val, Span), Diagnostic> {
        match self.get(i, name)? {
            Some(v) => Ok(v),
            None => Err(self.help(Diagnostic::new(
                format!("`{}` is missing its argument `{name}`", self.func),
                self.span,
                format!("`{name}` not given"),
            ))),
        }
    }

    pub fn tensor(&mut self, g: &Graph, i: usize, name: &str) -> Result<(Value, Span), Diagnostic> {
        let (v, s) = self.required(i, name)?;
        match v {
            Val::Tensor(t) => Ok((t, s)),
            other => Err(self.help(Diagnostic::new(
                format!("`{}` needs a tensor for `{name}`", self.func),
                s,
                format!("found {}", other.describe(g)),
            ))),
        }
    }

    pub fn opt_tensor(
        &mut self,
        g: &Graph,
        i: usize,
        name: &str,
    ) -> Result<Option<(Value, Span)>, Diagnostic> {
        if self.get(i, name)?.is_none() {
            return Ok(None);
        }
        self.tensor(g, i, name).map(Some)
    }

    pub fn float(
        &mut self,
        g: &Graph,
        i: usize,
        name: &str,
        default: Option<f64>,
    ) -> Result<f64, Diagnostic> {
        let v = match (self.get(i, name)?, default) {
            (Some(v), _) => v,
            (None, Some(d)) => return Ok(d),
            (None, None) => self.required(i, name)?,
        };
        match v.0.as_f64() {
            Some(x) if x.is_finite() => Ok(x),
            _ => Err(self.help(Diagnostic::new(
                format!("`{}` needs a number for `{name}`", self.func),
                v.1,
                format!("found {}", v.0.describe(g)),
            ))),
        }
    }

    pub fn int(
        &mut self,
        g: &Graph,
        i: usize,
        name: &str,
        default: Option<i64>,
    ) -> Result<(i64, Span), Diagnostic> {
        let v = match (self.get(i, name)?, default) {
            (Some(v), _) => v,
            (None, Some(d)) => return Ok((d, self.span)),
            (None, None) => self.required(i, name)?,
        };
        match v.0.as_i64() {
            Some(x) => Ok((x, v.1)),
            None => Err(self.help(Diagnostic::new(
                format!("`{}` needs an integer for `{name}`", self.func),
                v.1,
                format!("found {}", v.0.describe(g)),
            ))),
        }
    }

    pub fn bool(
        &mut self,
        g: &Graph,
        i: usize,
        name: &str,
        default: bool,
    ) -> Result<bool, Diagnostic> {
        match self.get(i, name)? {
            None => Ok(default),
            Some((Val::Bool(b), _)) => Ok(b),
            Some((v, s)) => Err(self.help(Diagnostic::new(
                format!("`{}` needs `true` or `false` for `{name}`", self.func),
                s,
                format!("found {}", v.describe(g)),
            ))),
        }
    }

    /// A list of dimensions, e.g. a target shape.
    pub fn dims(
        &mut self,
        g: &Graph,
        i: usize,
        name: &str,
    ) -> Result<(Vec<(Dim, Span)>, Span), Diagnostic> {
        let (v, s) = self.required(i, name)?;
        let Val::List(items) = v else {
            return Err(self.help(Diagnostic::new(
                format!("`{}` needs a list of dimensions for `{name}`", self.func),
                s,
                format!("found {}", v.describe(g)),
            )));
        };
        let mut out = Vec::new();
        for (it, is) in items {
            match it.as_dim() {
                Some(d) => out.push((d, is)),
                None => {
                    return Err(Diagnostic::new(
                        "expected a dimension",
                        is,
                        format!("found {}", it.describe(g)),
                    ));
                }
            }
        }
        Ok((out, s))
    }

    /// Rejects arguments that no parameter consumed.
    pub fn finish(&self) -> Result<(), Diagnostic> {
        if self.pos.len() > self.max_pos {
            let (_, s) = &self.pos[self.max_pos];
            return Err(self.help(Diagnostic::new(
                format!(
                    "`{}` takes at most {} positional argument{}",
                    self.func,
                    self.max_pos,
                    if self.max_pos == 1 { "" } else { "s" }
                ),
                *s,
                format!("argument {} is one too many", self.max_pos + 1),
            )));
        }
        for (n, _, _) in &self.kw {
            if !self.used_kw.contains(&n.name) {
                let mut d = Diagnostic::new(
                    format!("`{}` has no argument named `{}`", self.func, n.name),
                    n.span,
                    "unknown keyword",
                );
                if let Some(s) = super::suggest(&n.name, self.used_kw.iter().map(|k| k.as_str())) {
                    d = d.with_help(format!("did you mean `{s}`?"));
                }
                return Err(self.help(d));
            }
        }
        Ok(())
    }
}
