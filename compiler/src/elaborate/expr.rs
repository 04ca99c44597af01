//! Expressions: constant folding for numbers and dimensions, graph nodes
//! for tensors, block calls, `repeat`, and indexing.

use super::args::Args;
use super::{builtins, Elab};
use crate::diag::Diagnostic;
use crate::dsl::ast::{Arg, BinOp, Expr, ExprKind, Ident, IndexItem, Span};
use crate::ir::{Dim, Value};
use crate::model::values::{dim_val, Val};
use crate::ops::{Binary, BinaryKind, Constant, DimValue, MatMul, Reshape, Slice};

/// Most layers a `repeat` may unroll.
const MAX_REPEAT: i64 = 10_000;

impl<'m> Elab<'m> {
    pub(crate) fn eval(&mut self, e: &Expr) -> Result<Val, Diagnostic> {
        if self.depth >= super::MAX_EVAL_DEPTH {
            return Err(Diagnostic::new(
                format!("expressions nested too deeply through blocks (more than {} levels)", super::MAX_EVAL_DEPTH),
                e.span,
                "the limit is reached here",
            )
            .with_help("split deep expressions into several `let` bindings, and call blocks one after another"));
        }
        self.depth += 1;
        let v = self.eval_here(e);
        self.depth -= 1;
        v
    }

    fn eval_here(&mut self, e: &Expr) -> Result<Val, Diagnostic> {
        match &e.kind {
            ExprKind::Int(i) => Ok(Val::Int(*i)),
            ExprKind::Float(f) => Ok(Val::Float(*f)),
            ExprKind::Bool(b) => Ok(Val::Bool(*b)),
            ExprKind::Name(n) => self.lookup(n, e.span),
            ExprKind::Neg(inner) => {
                let v = self.eval(inner)?;
                self.negate(v, inner.span, e.span)
            }
            ExprKind::Binary { op, lhs, rhs } => {
                let a = self.eval(lhs)?;
                let b = self.eval(rhs)?;
                self.binary(*op, (a, lhs.span), (b, rhs.span), e.span)
            }
            ExprKind::List(items) | ExprKind::Tuple(items) => {
                let mut out = Vec::with_capacity(items.len());
                for it in items {
                    out.push((self.eval(it)?, it.span));
                }
                Ok(Val::List(out))
            }
            ExprKind::Call { func, args } => self.call(func, args, e.span),
            ExprKind::Repeat { count, func, args } => self.repeat(count, func, args, e.span),
            ExprKind::Index { base, indices } => {
                let v = self.eval(base)?;
                let Val::Tensor(t) = v else {
                    return Err(Diagnostic::new(
                        "only tensors can be indexed",
                        base.span,
                        format!("expected a tensor, found {}", v.describe(&self.graph)),
                    ));
                };
                self.index(t, indices, base.span, e.span)
            }
        }
    }

    fn negate(&mut self, v: Val, inner: Span, span: Span) -> Result<Val, Diagnostic> {
        match v {
            Val::Int(i) => i.checked_neg().map(Val::Int).ok_or_else(|| overflow(span)),
            Val::Float(f) => Ok(Val::Float(-f)),
            Val::Dim(d) => d
                .checked_mul(&Dim::constant(-1))
                .map(dim_val)
                .ok_or_else(|| overflow(span)),
            Val::Tensor(t) => {
                let n = self.add(
                    crate::ops::Unary {
                        kind: crate::ops::UnaryKind::Neg,
                    }
                    .into(),
                    &[t],
                    span,
                )?;
                Ok(Val::Tensor(n[0]))
            }
            other => Err(Diagnostic::new(
                "cannot negate this",
                inner,
                format!(
                    "expected a number, a dimension or a tensor, found {}",
                    other.describe(&self.graph)
                ),
            )),
        }
    }

    pub(crate) fn binary(
        &mut self,
        op: BinOp,
        a: (Val, Span),
        b: (Val, Span),
        span: Span,
    ) -> Result<Val, Diagnostic> {
        let sym = op.symbol();
        if op == BinOp::MatMul {
            return match (&a.0, &b.0) {
                (Val::Tensor(x), Val::Tensor(y)) => {
                    let v = self
                        .add_at(MatMul.into(), &[*x, *y], span, &[a.1, b.1])
                        .map_err(|d| at_operator(d, span, a.1, b.1))?;
                    Ok(Val::Tensor(v[0]))
                }
                _ => {
                    let (bad, s) = if matches!(a.0, Val::Tensor(_)) {
                        (&b.0, b.1)
                    } else {
                        (&a.0, a.1)
                    };
                    Err(Diagnostic::new(
                        "`@` multiplies two tensors",
                        s,
                        format!("expected a tensor, found {}", bad.describe(&self.graph)),
                    )
                    .with_help("use `*` to scale by a number"))
                }
            };
        }
        let kind = match op {
            BinOp::Add => BinaryKind::Add,
            BinOp::Sub => BinaryKind::Sub,
            BinOp::Mul => BinaryKind::Mul,
            _ => BinaryKind::Div,
        };
        match (&a.0, &b.0) {
            (Val::Tensor(_), _) | (_, Val::Tensor(_)) => {
                let dtype = match (&a.0, &b.0) {
                    (Val::Tensor(t), _) | (_, Val::Tensor(t)) => self.graph.ty(*t).dtype,
                    _ => unreachable!(),
                };
                if let (Val::Tensor(x), Val::Tensor(y)) = (&a.0, &b.0) {
                    let (tx, ty) = (self.graph.ty(*x).clone(), self.graph.ty(*y).clone());
                    if tx.dtype.is_float() != ty.dtype.is_float() {
                        // An index tensor beside a float one: say which is which.
                        let ((is, it), (fs, ft)) = if tx.dtype.is_float() {
                            ((b.1, ty), (a.1, tx))
                        } else {
                            ((a.1, tx), (b.1, ty))
                        };
                        return Err(Diagnostic::new(
                            format!("dtype mismatch in `{sym}`: {} and {}", self.graph.ty(*x), self.graph.ty(*y)),
                            is,
                            format!("this is {it}, expected {} like the other operand", ft.dtype),
                        )
                        .with_note(fs, ft.to_string())
                        .with_help("i32 tensors hold indices (token ids, labels) and take no arithmetic; turn them into vectors with `embedding(table, indices)`"));
                    }
                }
                let x = self.scalar_tensor(&a.0, a.1, dtype, sym)?;
                let y = self.scalar_tensor(&b.0, b.1, dtype, sym)?;
                let v = self
                    .add_at(Binary { kind }.into(), &[x, y], span, &[a.1, b.1])
                    .map_err(|d| at_operator(d, span, a.1, b.1))?;
                Ok(Val::Tensor(v[0]))
            }
            (Val::Int(x), Val::Int(y)) => int_arith(kind, *x, *y, span, b.1),
            (Val::Dim(_), _) | (_, Val::Dim(_))
                if a.0.as_dim().is_some() && b.0.as_dim().is_some() =>
            {
                let (x, y) = (
                    a.0.as_dim().unwrap_or_default(),
                    b.0.as_dim().unwrap_or_default(),
                );
                if kind == BinaryKind::Div && y.as_const() == Some(0) {
                    return Err(Diagnostic::new(
                        "division by zero",
                        b.1,
                        "expected a non-zero divisor, found 0",
                    ));
                }
                let r = match kind {
                    BinaryKind::Add => x.checked_add(&y),
                    BinaryKind::Sub => x.checked_sub(&y),
                    BinaryKind::Mul => x.checked_mul(&y),
                    BinaryKind::Div => x.checked_div(&y),
                    // Not in the language (the update builds it).
                    BinaryKind::KeepIf => None,
                };
                r.map(dim_val).ok_or_else(|| {
                    Diagnostic::new(
                        format!("cannot compute `{x} {sym} {y}` as a dimension"),
                        span,
                        "expected a whole dimension, found a fraction or an overflow",
                    )
                    .with_help("dimensions divide only when the result is a whole dimension")
                })
            }
            _ => match (a.0.as_f64(), b.0.as_f64()) {
                (Some(x), Some(y))
                    if !matches!(a.0, Val::Dim(_)) && !matches!(b.0, Val::Dim(_)) =>
                {
                    Ok(Val::Float(kind.apply(x, y)))
                }
                _ => {
                    let (bad, s) = if a.0.as_f64().is_none() || matches!(a.0, Val::Dim(_)) {
                        (&a.0, a.1)
                    } else {
                        (&b.0, b.1)
                    };
                    let d = Diagnostic::new(
                        format!("`{sym}` cannot use this value"),
                        s,
                        format!(
                            "expected a number or a tensor, found {}",
                            bad.describe(&self.graph)
                        ),
                    );
                    Err(if matches!(bad, Val::Dim(_)) {
                        d.with_help("a symbolic dimension combines with integers only (`B * 2`); beside a tensor it is a number (`x * B`)")
                    } else {
                        d
                    })
                }
            },
        }
    }

    /// A number or dimension beside a tensor becomes a scalar tensor of its dtype.
    fn scalar_tensor(
        &mut self,
        v: &Val,
        span: Span,
        dtype: crate::ir::DType,
        sym: &str,
    ) -> Result<Value, Diagnostic> {
        let op = match v {
            Val::Tensor(t) => return Ok(*t),
            Val::Int(i) => Constant {
                value: *i as f64,
                dtype,
            }
            .into(),
            Val::Float(f) => Constant { value: *f, dtype }.into(),
            Val::Dim(d) => DimValue {
                dim: d.clone(),
                dtype,
            }
            .into(),
            other => {
                return Err(Diagnostic::new(
                    format!("`{sym}` cannot use this value"),
                    span,
                    format!(
                        "expected a number or a tensor, found {}",
                        other.describe(&self.graph)
                    ),
                ))
            }
        };
        if !dtype.is_float() {
            return Err(Diagnostic::new(
                format!("`{sym}` needs floating-point tensors"),
                span,
                format!("the tensor beside this is {dtype}"),
            ));
        }
        Ok(self.add(op, &[], span)?[0])
    }

    fn eval_args(&mut self, args: &[Arg]) -> Result<Args, Diagnostic> {
        let mut out = Args::default();
        for a in args {
            let v = self.eval(&a.value)?;
            match &a.name {
                Some(n) => out.kw.push((n.clone(), v, a.value.span)),
                None => out.pos.push((v, a.value.span)),
            }
        }
        Ok(out)
    }

    fn call(&mut self, func: &Ident, args: &[Arg], span: Span) -> Result<Val, Diagnostic> {
        if self.is_block(&func.name) {
            if let Some(a) = args.iter().find_map(|a| a.name.as_ref()) {
                return Err(self.block_keyword(func, a));
            }
            let a = self.eval_args(args)?;
            let instance = self.instance_name(&func.name);
            return self.call_block(func, a.pos, instance, span);
        }
        let mut a = self.eval_args(args)?;
        a.func = func.name.clone();
        a.span = span;
        a.func_span = func.span;
        builtins::call(self, &mut a)
    }

    fn block_keyword(&self, func: &Ident, kw: &Ident) -> Diagnostic {
        let params = super::block_params(self.blocks[&func.name]);
        Diagnostic::new(
            "blocks take positional arguments only",
            kw.span,
            format!("`{}` is given by keyword", kw.name),
        )
        .with_help(format!(
            "pass arguments in order: `{}({params})`",
            func.name
        ))
    }

    fn repeat(
        &mut self,
        count: &Expr,
        func: &Ident,
        args: &[Arg],
        span: Span,
    ) -> Result<Val, Diagnostic> {
        let n = self.eval(count)?;
        let n = match n.as_i64() {
            Some(n) if (1..=MAX_REPEAT).contains(&n) => n,
            _ => {
                return Err(Diagnostic::new(
                    format!("`repeat` needs a count from 1 to {MAX_REPEAT}"),
                    count.span,
                    format!(
                        "expected a layer count from 1 to {MAX_REPEAT}, found {}",
                        n.describe(&self.graph)
                    ),
                ))
            }
        };
        if !self.is_block(&func.name) {
            let name = &func.name;
            let found = if builtins::BUILTINS.iter().any(|b| b.name == *name) {
                format!("expected a block, found the builtin `{name}`")
            } else {
                format!("expected a block, found `{name}`, which is not defined")
            };
            let mut d = Diagnostic::new(
                format!("`repeat` applies a block, and `{name}` is not one"),
                func.span,
                found,
            );
            if let Some(s) = super::suggest(name, self.blocks.keys().map(|k| k.as_str())) {
                d = d.with_help(format!("did you mean the block `{s}`?"));
            }
            return Err(d.with_help(
                "define the layer with `block name(x) { ... return x }`, then `repeat N name(x)`",
            ));
        }
        if let Some(a) = args.iter().find_map(|a| a.name.as_ref()) {
            return Err(self.block_keyword(func, a));
        }
        let a = self.eval_args(args)?;
        if a.pos.is_empty() {
            return Err(Diagnostic::new(
                "`repeat` threads the first argument through each layer",
                span,
                "no arguments",
            )
            .with_help("write `repeat N block(x)`"));
        }
        let base = self.instance_name(&func.name);
        let first = self.graph.g.node_count();
        let mut pos = a.pos;
        for i in 0..n {
            let out = self.call_block(func, pos.clone(), format!("{base}.{i}"), span)?;
            if !matches!((&out, &pos[0].0), (Val::Tensor(_), Val::Tensor(_))) {
                let ret = self.blocks[&func.name].ret.span;
                return Err(Diagnostic::new(
                    "a repeated block must take and return one tensor",
                    span,
                    format!(
                        "expected a tensor, found {} passed in and {} returned",
                        pos[0].0.describe(&self.graph),
                        out.describe(&self.graph)
                    ),
                )
                .with_note(ret, "returned here")
                .with_help("the output of each layer is the first argument of the next"));
            }
            if let (Val::Tensor(new), Val::Tensor(old)) = (&out, &pos[0].0) {
                if self.graph.ty(*new) != self.graph.ty(*old) {
                    let (tn, to) = (self.graph.ty(*new).clone(), self.graph.ty(*old).clone());
                    let ret = self.blocks[&func.name].ret.span;
                    return Err(Diagnostic::new(
                        "a repeated block must return what it takes",
                        span,
                        format!("layer {i} takes {to} and returns {tn}"),
                    )
                    .with_note(
                        ret,
                        format!("block `{}` returns {tn} here, expected {to}", func.name),
                    )
                    .with_help("the output of each layer is the first argument of the next"));
                }
            }
            pos[0].0 = out;
        }
        let path = format!("{}{base}", self.frame().prefix);
        self.structure
            .repeats
            .push(crate::model::structure::RepeatRecord {
                block: func.name.clone(),
                path,
                count: n as usize,
                first,
                end: self.graph.g.node_count(),
            });
        Ok(pos.swap_remove(0).0)
    }

    fn index(
        &mut self,
        t: Value,
        items: &[IndexItem],
        base: Span,
        span: Span,
    ) -> Result<Val, Diagnostic> {
        let shape = self.graph.ty(t).shape.clone();
        let rank = shape.len();
        let ellipses = items
            .iter()
            .filter(|i| matches!(i, IndexItem::Ellipsis(_)))
            .count();
        let explicit = items.len() - ellipses;
        let item_span = |it: &IndexItem| match it {
            IndexItem::Single(e) => e.span,
            IndexItem::Range { span, .. } | IndexItem::Ellipsis(span) => *span,
        };
        if ellipses > 1 {
            let mut dots = items
                .iter()
                .filter(|i| matches!(i, IndexItem::Ellipsis(_)))
                .map(item_span);
            let (first, second) = (dots.next().unwrap_or(span), dots.next().unwrap_or(span));
            return Err(Diagnostic::new(
                "an index can hold only one `...`",
                second,
                "second `...`",
            )
            .with_note(first, "first `...`"));
        }
        if explicit > rank {
            let ty = self.graph.ty(t).clone();
            let extra = items
                .iter()
                .filter(|i| !matches!(i, IndexItem::Ellipsis(_)))
                .nth(rank)
                .map_or(span, item_span);
            let axes = if rank == 1 { "axis" } else { "axes" };
            return Err(Diagnostic::new(
                format!("too many indices: {explicit} for a tensor with {rank} {axes}"),
                extra,
                format!(
                    "index {} of {explicit}, but {ty} has only {rank} {axes}",
                    rank + 1
                ),
            )
            .with_note(base, format!("this is {ty}")));
        }
        // One entry per axis: (axis, start, end, drop_axis, the item's span).
        let mut cuts: Vec<(usize, Dim, Dim, bool, Span)> = Vec::new();
        let mut axis = 0;
        for it in items {
            match it {
                IndexItem::Ellipsis(_) => axis += rank - explicit,
                IndexItem::Single(e) => {
                    let i = self.position(e, &shape[axis])?;
                    let end = i
                        .checked_add(&Dim::constant(1))
                        .ok_or_else(|| overflow(e.span))?;
                    cuts.push((axis, i, end, true, e.span));
                    axis += 1;
                }
                IndexItem::Range {
                    start,
                    end,
                    span: at,
                } => {
                    let s = match start {
                        Some(e) => self.position(e, &shape[axis])?,
                        None => Dim::constant(0),
                    };
                    let en = match end {
                        Some(e) => self.position(e, &shape[axis])?,
                        None => shape[axis].clone(),
                    };
                    cuts.push((axis, s, en, false, *at));
                    axis += 1;
                }
            }
        }
        let mut v = t;
        let mut dropped = Vec::new();
        for (axis, start, end, drop, at) in cuts {
            if drop {
                dropped.push(axis);
            }
            if start == Dim::constant(0) && end == shape[axis] {
                continue;
            }
            let (what, found) = match (drop, start.as_const().is_some_and(|c| c < 0)) {
                (_, true) => (
                    if drop { "index" } else { "slice" },
                    "a position before the start, counting from the end".to_string(),
                ),
                (true, false) => ("index", format!("{start}")),
                (false, false) => ("slice", format!("{start}:{end}")),
            };
            let expected = if drop {
                format!("expected an index below {} on axis {axis}", shape[axis])
            } else {
                format!(
                    "expected positions within 0..{} on axis {axis}",
                    shape[axis]
                )
            };
            let ty = self.graph.ty(t).clone();
            v = self
                .add(Slice { axis, start, end }.into(), &[v], span)
                .map_err(|d| {
                    if d.message != "slice out of range" {
                        return d;
                    }
                    Diagnostic::new(
                        format!("{what} out of range"),
                        at,
                        format!("{expected}, found {found}"),
                    )
                    .with_note(base, format!("this is {ty}"))
                })?[0];
        }
        if !dropped.is_empty() {
            let kept: Vec<Dim> = self
                .graph
                .ty(v)
                .shape
                .iter()
                .enumerate()
                .filter(|(i, _)| !dropped.contains(i))
                .map(|(_, d)| d.clone())
                .collect();
            v = self.add(Reshape { shape: kept }.into(), &[v], span)?[0];
        }
        Ok(Val::Tensor(v))
    }

    /// An index or slice bound; negative constants count from the end.
    fn position(&mut self, e: &Expr, size: &Dim) -> Result<Dim, Diagnostic> {
        let v = self.eval(e)?;
        let Some(d) = v.as_dim() else {
            return Err(Diagnostic::new(
                "an index must be an integer or a dimension",
                e.span,
                format!("found {}", v.describe(&self.graph)),
            ));
        };
        if d.as_const().is_some_and(|c| c < 0) {
            return size.checked_add(&d).ok_or_else(|| overflow(e.span));
        }
        Ok(d)
    }
}

/// Moves an error about a whole `a op b` onto the operator between the
/// operands, so that the caret does not start where the left operand's label does.
fn at_operator(mut d: Diagnostic, whole: Span, lhs: Span, rhs: Span) -> Diagnostic {
    if d.span == whole && lhs.end <= rhs.start {
        d.span = Span::new(lhs.end, rhs.start);
    }
    d
}

fn overflow(span: Span) -> Diagnostic {
    Diagnostic::new(
        "integer overflow",
        span,
        "this value does not fit in 64 bits",
    )
}

fn int_arith(kind: BinaryKind, x: i64, y: i64, span: Span, rhs: Span) -> Result<Val, Diagnostic> {
    match kind {
        BinaryKind::Add => x.checked_add(y).map(Val::Int).ok_or_else(|| overflow(span)),
        BinaryKind::Sub => x.checked_sub(y).map(Val::Int).ok_or_else(|| overflow(span)),
        BinaryKind::Mul => x.checked_mul(y).map(Val::Int).ok_or_else(|| overflow(span)),
        BinaryKind::Div => {
            if y == 0 {
                return Err(Diagnostic::new(
                    "division by zero",
                    rhs,
                    "expected a non-zero divisor, found 0",
                ));
            }
            // Exact integer division stays an integer (`d / heads` is a size).
            if x % y == 0 {
                Ok(Val::Int(x / y))
            } else {
                Ok(Val::Float(x as f64 / y as f64))
            }
        }
        BinaryKind::KeepIf => Ok(Val::Int(if y != 0 { x } else { 0 })),
    }
}
