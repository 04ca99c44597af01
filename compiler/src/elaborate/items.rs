//! Items: constants, dimensions, inputs, parameters with their
//! initialisers and shapes, and `let` bindings.

use super::*;

impl<'m> Elab<'m> {
    pub(super) fn item(&mut self, item: &'m Item) -> Result<(), Diagnostic> {
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
                if !matches!(
                    val,
                    Val::Int(_) | Val::Float(_) | Val::Bool(_) | Val::Dim(_)
                ) {
                    return Err(Diagnostic::new(
                        "a constant must be a number",
                        value.span,
                        format!("expected a number, found {}", val.describe(&self.graph)),
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
                        return Err(Diagnostic::new(
                            "`dim` belongs at the top level",
                            n.span,
                            "inside a block",
                        ));
                    }
                    self.graph.dims.push(n.name.clone());
                    self.bind(n, Val::Dim(Dim::symbol(&n.name)), Kind::Dim)?;
                }
                Ok(())
            }
            Item::Input {
                name,
                dtype,
                dims,
                span,
            } => {
                if self.frames.len() > 1 {
                    return Err(Diagnostic::new(
                        "`input` belongs at the top level",
                        *span,
                        "inside a block",
                    )
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
                let scope = self.frame().prefix.trim_end_matches('.').to_string();
                if names.len() == 1 {
                    self.structure.name(&scope, &val, &names[0].name);
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
                    self.structure.name(&scope, &v, &n.name);
                    self.bind(n, v, Kind::Let)?;
                }
                Ok(())
            }
            Item::Block(b) => Err(Diagnostic::new(
                "blocks cannot be nested",
                b.name.span,
                "defined inside a block",
            )
            .with_help("define every block at the top level")),
            Item::Train(t) => Err(Diagnostic::new(
                "`train` belongs at the top level",
                t.span,
                "inside a block",
            )),
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
                format!("expected f32 (or no dtype), found {dt}"),
            )
            .with_help("set the compute precision with `precision = bf16` in the train section; master weights stay f32"));
        }
        let shape = self.shape(dims, false)?;
        let init = self.init(init)?;
        let full = format!("{}{}", self.frame().prefix, name.name);
        let ty = TensorType::new(dt, shape);
        // 2^40 f32 values is 4 TiB: far past any GPU, and past this the
        // element count may no longer fit the arithmetic downstream.
        if ty.numel().as_const().is_none_or(|n| n >= 1 << 40) {
            let all = dims
                .first()
                .map_or(span, |f| f.span.to(dims.last().map_or(f.span, |l| l.span)));
            return Err(Diagnostic::new(
                format!("parameter `{}` is too large", name.name),
                all,
                format!("{} has more than 2^40 elements", ty),
            )
            .with_help("check the sizes; a parameter this large cannot be allocated"));
        }
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
        let bad = |name: &str, found: &str| {
            let d = Diagnostic::new(
                "unknown initialiser",
                e.span,
                format!("expected zeros, ones, normal(std), uniform(bound) or constant(value), found {found}"),
            );
            let meant = match name {
                "gaussian" | "randn" | "normal_" | "trunc_normal" => Some("normal".to_string()),
                "xavier" | "xavier_uniform" | "xavier_normal" | "kaiming" | "kaiming_uniform"
                | "kaiming_normal" | "he" | "glorot" | "orthogonal" => {
                    return d.with_help(format!(
                        "`{name}` is not built in: give the scale yourself with `normal(std)` or `uniform(bound)`, e.g. `normal(0.02)`"
                    ));
                }
                "zero" | "zeros_" => Some("zeros".to_string()),
                "one" | "ones_" => Some("ones".to_string()),
                _ => suggest(
                    name,
                    ["zeros", "ones", "normal", "uniform", "constant"].into_iter(),
                ),
            };
            match meant {
                Some(m) if m == "normal" => {
                    d.with_help("did you mean `normal(std)`? e.g. `normal(0.02)`")
                }
                Some(m) => d.with_help(format!("did you mean `{m}`?")),
                None => d,
            }
        };
        match &e.kind {
            ExprKind::Name(n) if n == "zeros" => Ok(Init::Constant(0.0)),
            ExprKind::Name(n) if n == "ones" => Ok(Init::Constant(1.0)),
            ExprKind::Call { func, args } => {
                let kind = func.name.as_str();
                if !matches!(kind, "normal" | "uniform" | "constant") {
                    return Err(bad(kind, &format!("`{kind}(...)`")));
                }
                if args.len() != 1 || args[0].name.is_some() {
                    let found = match args.first().and_then(|a| a.name.as_ref()) {
                        Some(n) if args.len() == 1 => {
                            format!("found `{}` given by keyword", n.name)
                        }
                        _ => format!("found {} arguments", args.len()),
                    };
                    return Err(Diagnostic::new(
                        format!("`{kind}` takes one number, by position"),
                        e.span,
                        found,
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
                    return Err(Diagnostic::new(
                        format!("`{kind}` needs a non-negative scale"),
                        args[0].value.span,
                        format!("expected a number >= 0, found {}", crate::ir::print::num(x)),
                    ));
                }
                Ok(match kind {
                    "normal" => Init::Normal { std: x },
                    "uniform" => Init::Uniform { bound: x },
                    _ => Init::Constant(x),
                })
            }
            ExprKind::Name(n) => Err(bad(n, &format!("`{n}`"))),
            _ => Err(bad("", "an expression")),
        }
    }

    /// A list of dimension expressions. Inputs may use symbolic dimensions;
    /// parameters need fixed sizes.
    fn shape(&mut self, dims: &[Expr], symbolic_ok: bool) -> Result<Vec<Dim>, Diagnostic> {
        let mut out = Vec::new();
        for d in dims {
            let v = self.eval(d)?;
            let Some(dim) = v.as_dim() else {
                let d = Diagnostic::new(
                    "expected a dimension",
                    d.span,
                    format!("found {}", v.describe(&self.graph)),
                )
                .with_help("a dimension is a positive integer, a constant, or a symbolic `dim`");
                return Err(match v {
                    Val::Float(_) => d.with_help(FRACTION_HELP),
                    _ => d,
                });
            };
            match dim.as_const() {
                Some(c) if c <= 0 => {
                    return Err(Diagnostic::new(
                        "dimensions must be positive",
                        d.span,
                        format!("expected a size of 1 or more, found {c}"),
                    ));
                }
                None if !symbolic_ok => {
                    return Err(Diagnostic::new(
                        "a parameter's shape must be fixed",
                        d.span,
                        format!("expected a fixed size, found `{dim}`, which is known only when the model runs"),
                    )
                    .with_help(
                        "parameters are allocated once, before any batch is seen: size them with constants \
                         (e.g. `const ctx = 1024`, `param pos: [ctx, d]`) and slice what a batch needs (`pos[0:T]`)",
                    ));
                }
                _ => {}
            }
            out.push(dim);
        }
        Ok(out)
    }
}
