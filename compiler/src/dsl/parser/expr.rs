//! Expressions: precedence climbing over `+ -`, `* / @`, unary minus,
//! calls, indexing and the bracketed forms.

use super::*;

impl<'a> Parser<'a> {
    // ---- expressions ----------------------------------------------------
    //
    // The recursive path (expr, unary, primary and the bracketed forms) passes
    // boxed trees around and builds diagnostics in separate cold functions:
    // without optimisation every local gets its own stack slot, and this keeps
    // MAX_DEPTH levels well inside a 2 MiB thread stack even in debug builds.

    fn enter(&mut self) -> PResult<()> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.too_deep_here());
        }
        Ok(())
    }

    /// Whether only blanks stand between the start of its line and `span`.
    fn starts_line(&self, span: Span) -> bool {
        let before = self.src.get(..span.start).unwrap_or("");
        before
            .bytes()
            .rev()
            .find(|b| !matches!(b, b' ' | b'\t' | b'\r'))
            .is_none_or(|b| b == b'\n')
    }

    pub(super) fn expr(&mut self) -> PResult<Parsed> {
        self.enter()?;
        let result = self.binary();
        self.depth -= 1;
        result
    }

    /// Both precedence levels in one loop, which saves a frame per nesting
    /// level: `pending` is the sum so far with the additive operator after it.
    fn binary(&mut self) -> PResult<Parsed> {
        let mut pending: Option<(Parsed, BinOp, Span)> = None;
        let mut term = self.unary()?;
        loop {
            let (op, additive) = match self.peek() {
                Token::Plus => (BinOp::Add, true),
                Token::Minus => (BinOp::Sub, true),
                Token::Star => (BinOp::Mul, false),
                Token::Slash => (BinOp::Div, false),
                Token::At => (BinOp::MatMul, false),
                _ => break,
            };
            let at = self.bump();
            if !self.peek().starts_expr() {
                return Err(self.missing_operand(op));
            }
            let rhs = self.unary()?;
            if additive {
                let sum = match pending.take() {
                    Some((sum, sum_op, sum_at)) => combine(sum_op, sum, term, sum_at)?,
                    None => term,
                };
                pending = Some((sum, op, at));
                term = rhs;
            } else {
                term = combine(op, term, rhs, at)?;
            }
        }
        match pending {
            Some((sum, op, at)) => combine(op, sum, term, at),
            None => Ok(term),
        }
    }

    /// Prefix minus (a loop, not recursion), then a primary with its calls
    /// and indexing. Trees are assembled in helpers outside the recursive
    /// path so that this frame stays small.
    fn unary(&mut self) -> PResult<Parsed> {
        let minus = self.minus_signs()?;
        let mut e = if self.peek() == Token::Ident {
            let name = self.ident();
            if self.peek() == Token::LParen {
                let args = self.call_args(&name)?;
                finish_call(name, args)?
            } else {
                name_expr(name)
            }
        } else {
            self.primary()?
        };
        loop {
            match self.peek() {
                Token::LBracket => e = self.index(e)?,
                Token::LParen => return Err(self.not_callable(e.0.span)),
                _ => return negate(e, minus),
            }
        }
    }

    fn minus_signs(&mut self) -> PResult<Vec<Span>> {
        let mut minus = Vec::new();
        while self.peek() == Token::Minus {
            let at = self.bump();
            minus.push(at);
            // Each minus is one level above its operand, which is at least one.
            if minus.len() + 1 > MAX_DEPTH {
                return Err(too_deep(at));
            }
        }
        Ok(minus)
    }

    /// `( args )` after a callee: the arguments, the closing paren and the
    /// tallest argument.
    fn call_args(&mut self, func: &Ident) -> PResult<(Vec<Arg>, Span, usize)> {
        let open = self.bump();
        let close_desc = format!("')' to close the call to '{}'", snippet(&func.name));
        let list = List {
            close: Token::RParen,
            close_desc: &close_desc,
            opened: "the argument list starts here",
            items: "arguments",
        };
        let mut tallest = 0;
        let mut keyword: Option<Span> = None;
        let (args, close) = self.delimited(open, &list, |p| {
            let name = if p.peek() == Token::Ident && p.peek2() == Token::Eq {
                let name = p.ident();
                p.bump();
                keyword = Some(name.span);
                Some(name)
            } else {
                None
            };
            let (value, h) = p.expr()?;
            tallest = tallest.max(h);
            match (&name, keyword) {
                (None, Some(kw)) => Err(positional_after_keyword(value.span, kw)),
                _ => Ok(Arg {
                    name,
                    value: *value,
                }),
            }
        })?;
        Ok((args, close, tallest))
    }

    fn index(&mut self, base: Parsed) -> PResult<Parsed> {
        const INDEX: List = List {
            close: Token::RBracket,
            close_desc: "']' to close the index",
            opened: "the index starts here",
            items: "indices",
        };
        let open = self.bump();
        let mut tallest = base.1;
        let (indices, close) = self.delimited(open, &INDEX, |p| {
            let (item, h) = p.index_item()?;
            tallest = tallest.max(h);
            Ok(item)
        })?;
        finish_index(base.0, indices, open, close, tallest)
    }

    fn index_item(&mut self) -> PResult<(IndexItem, usize)> {
        if let Some(span) = self.eat(Token::Ellipsis) {
            return Ok((IndexItem::Ellipsis(span), 0));
        }
        let (start, colon) = match self.eat(Token::Colon) {
            Some(colon) => (None, colon),
            None => {
                let e = self.expr()?;
                match self.eat(Token::Colon) {
                    Some(colon) => (Some(e), colon),
                    None => return Ok(single_index(e)),
                }
            }
        };
        let end = match self.peek().starts_expr() {
            true => Some(self.expr()?),
            false => None,
        };
        if self.peek() == Token::Colon {
            return Err(self.index_step());
        }
        Ok(range_index(start, colon, end))
    }

    /// A literal, name, parenthesis, list or `repeat`; no call or index.
    fn primary(&mut self) -> PResult<Parsed> {
        let (tok, span) = self.peek_full();
        let kind = match tok {
            Token::Int(v) => ExprKind::Int(v),
            Token::Float(v) => ExprKind::Float(v),
            Token::True => ExprKind::Bool(true),
            Token::False => ExprKind::Bool(false),
            Token::Ident => ExprKind::Name(self.text(span).to_string()),
            Token::LParen => return self.paren(),
            Token::LBracket => return self.list(),
            Token::Repeat => return self.repeat(),
            _ => return Err(self.not_expr("an expression")),
        };
        self.bump();
        Ok(node(kind, span, 1))
    }

    /// Grouping `(e)`, tuple `(a, b)` / `(a,)`, or the empty tuple `()`.
    fn paren(&mut self) -> PResult<Parsed> {
        const PAREN: List = List {
            close: Token::RParen,
            close_desc: "')' to close the parenthesis",
            opened: "the parenthesis opens here",
            items: "tuple elements",
        };
        let open = self.bump();
        if let Some(close) = self.eat(Token::RParen) {
            return Ok(node(ExprKind::Tuple(Vec::new()), open.to(close), 1));
        }
        let (mut first, first_height) = self.expr()?;
        if let Some(close) = self.eat(Token::RParen) {
            // Widened over the parentheses, so that `(a + b) * c` spans all of it.
            first.span = open.to(close);
            return Ok((first, first_height));
        }
        if self.eat(Token::Comma).is_none() {
            return Err(self.unclosed(open, &PAREN));
        }
        let (rest, close, tallest) = self.exprs(open, &PAREN)?;
        let h = check(tallest.max(first_height) + 1, open)?;
        let mut items = vec![*first];
        items.extend(rest);
        Ok(node(ExprKind::Tuple(items), open.to(close), h))
    }

    fn list(&mut self) -> PResult<Parsed> {
        const LIST: List = List {
            close: Token::RBracket,
            close_desc: "']' to close the list",
            opened: "the list starts here",
            items: "list elements",
        };
        let open = self.bump();
        let (items, close, tallest) = self.exprs(open, &LIST)?;
        let h = check(tallest + 1, open)?;
        Ok(node(ExprKind::List(items), open.to(close), h))
    }

    /// Comma-separated expressions up to the closing token, and the tallest.
    pub(super) fn exprs(&mut self, open: Span, list: &List) -> PResult<(Vec<Expr>, Span, usize)> {
        let mut tallest = 0;
        let (items, close) = self.delimited(open, list, |p| {
            let (e, h) = p.expr()?;
            tallest = tallest.max(h);
            Ok(*e)
        })?;
        Ok((items, close, tallest))
    }

    fn repeat(&mut self) -> PResult<Parsed> {
        let kw = self.bump();
        if !self.peek().starts_expr() || self.peek() == Token::Minus {
            return Err(self.repeat_error(None, "the repeat count after 'repeat'"));
        }
        // `repeat repeat repeat ...` recurses through here, not through `expr`.
        self.enter()?;
        let (count, count_height) = self.primary()?;
        self.depth -= 1;
        if self.peek() != Token::Ident {
            return Err(self.repeat_error(Some(&count), "the name of the block to repeat"));
        }
        let func = self.ident();
        if self.peek() != Token::LParen {
            return Err(self.repeat_error(None, "'(' and the arguments of the block to repeat"));
        }
        let (args, close, args_height) = self.call_args(&func)?;
        let h = check(count_height.max(args_height) + 1, kw)?;
        let kind = ExprKind::Repeat { count, func, args };
        Ok(node(kind, kw.to(close), h))
    }

    // ---- cold error paths of the recursive part ---------------------------

    #[cold]
    #[inline(never)]
    fn too_deep_here(&mut self) -> Box<Diagnostic> {
        too_deep(self.peek_span())
    }

    #[cold]
    #[inline(never)]
    fn missing_operand(&mut self, op: BinOp) -> Box<Diagnostic> {
        self.not_expr(&format!("an expression after '{}'", op.symbol()))
    }

    #[cold]
    #[inline(never)]
    fn not_callable(&mut self, callee: Span) -> Box<Diagnostic> {
        let at = self.peek_span();
        let d = Diagnostic::new(
            "only a function or block name can be called",
            at,
            "unexpected '('",
        );
        Box::new(d.with_note(callee, "this is not a name"))
    }

    #[cold]
    #[inline(never)]
    fn index_step(&mut self) -> Box<Diagnostic> {
        let at = self.peek_span();
        let d = Diagnostic::new("index steps are not supported", at, "a second ':'");
        Box::new(
            d.with_help("write `start:end`; strides like `a:b:c` are not part of the language"),
        )
    }

    #[cold]
    #[inline(never)]
    fn not_expr(&mut self, expected: &str) -> Box<Diagnostic> {
        let tok = self.peek();
        let d = self.unexpected(expected);
        Box::new(match tok {
            Token::Ellipsis => {
                d.with_help("`...` can only appear inside an index, as in `x[..., 0]`")
            }
            Token::Dot => d.with_help("a number needs a digit before the point: `0.5`"),
            // `softmax(x, dim = -1)`: a keyword where an argument name goes.
            Token::Dim | Token::Input | Token::Param if self.peek2() == Token::Eq => {
                let kw = tok.keyword().unwrap_or("?");
                let mut d = Diagnostic::new(
                    format!("`{kw}` is a keyword and cannot name an argument"),
                    d.span,
                    "expected an argument name",
                );
                if tok == Token::Dim {
                    d = d.with_help("to choose an axis, write `axis = ...`");
                }
                d
            }
            // `let h = x +` at the end of a line: the statement is unfinished.
            Token::Const
            | Token::Dim
            | Token::Input
            | Token::Param
            | Token::Let
            | Token::Block
            | Token::Return
            | Token::Train
            | Token::RBrace
            | Token::Eof
                if self.starts_line(d.span) =>
            {
                d.with_help(
                    "the expression is unfinished: complete it, or remove the operator or comma before this point",
                )
            }
            _ => match keyword_help(tok) {
                Some(h) => d.with_help(h),
                None => d,
            },
        })
    }

    /// `count` is given when the block name is missing after it.
    #[cold]
    #[inline(never)]
    fn repeat_error(&mut self, count: Option<&Expr>, expected: &str) -> Box<Diagnostic> {
        const HELP: &str = "write `repeat COUNT block(args)`, e.g. `repeat 12 mlp(x)`";
        if let (Some(count), Token::LParen) = (count, self.peek()) {
            if let ExprKind::Name(block) = &count.kind {
                let help = format!(
                    "put the count before the block: `repeat 12 {}(...)`",
                    snippet(block)
                );
                let d = Diagnostic::new(
                    "missing repeat count",
                    count.span,
                    "this is the block to repeat",
                );
                return Box::new(d.with_help(help));
            }
        }
        Box::new(self.not_expr(expected).with_help(HELP))
    }
}

fn name_expr(name: Ident) -> Parsed {
    node(ExprKind::Name(name.name), name.span, 1)
}

fn finish_call(func: Ident, (args, close, tallest): (Vec<Arg>, Span, usize)) -> PResult<Parsed> {
    let h = check(tallest + 1, func.span)?;
    let span = func.span.to(close);
    Ok(node(ExprKind::Call { func, args }, span, h))
}

fn negate((mut e, mut h): Parsed, minus: Vec<Span>) -> PResult<Parsed> {
    for at in minus.into_iter().rev() {
        h = check(h + 1, at)?;
        let span = at.to(e.span);
        e = Box::new(Expr {
            kind: ExprKind::Neg(e),
            span,
        });
    }
    Ok((e, h))
}

fn finish_index(
    base: Box<Expr>,
    indices: Vec<IndexItem>,
    open: Span,
    close: Span,
    tallest: usize,
) -> PResult<Parsed> {
    if indices.is_empty() {
        return Err(empty_index(open.to(close)));
    }
    let h = check(tallest + 1, open)?;
    let span = base.span.to(close);
    Ok(node(ExprKind::Index { base, indices }, span, h))
}

fn single_index((e, h): Parsed) -> (IndexItem, usize) {
    (IndexItem::Single(*e), h)
}

fn range_index(start: Option<Parsed>, colon: Span, end: Option<Parsed>) -> (IndexItem, usize) {
    let first = start.as_ref().map_or(colon, |e| e.0.span);
    let last = end.as_ref().map_or(colon, |e| e.0.span);
    let height = start
        .as_ref()
        .map_or(0, |e| e.1)
        .max(end.as_ref().map_or(0, |e| e.1));
    let item = IndexItem::Range {
        start: start.map(|e| *e.0),
        end: end.map(|e| *e.0),
        span: first.to(last),
    };
    (item, height)
}

fn combine(op: BinOp, (lhs, lh): Parsed, (rhs, rh): Parsed, at: Span) -> PResult<Parsed> {
    let h = check(lh.max(rh) + 1, at)?;
    let span = lhs.span.to(rhs.span);
    Ok(node(ExprKind::Binary { op, lhs, rhs }, span, h))
}

#[cold]
#[inline(never)]
fn positional_after_keyword(at: Span, keyword: Span) -> Box<Diagnostic> {
    let d = Diagnostic::new(
        "positional argument after keyword argument",
        at,
        "positional argument",
    );
    Box::new(
        d.with_note(keyword, "keyword argument here")
            .with_help("put positional arguments before keyword arguments"),
    )
}

#[cold]
#[inline(never)]
fn empty_index(span: Span) -> Box<Diagnostic> {
    let d = Diagnostic::new(
        "empty index",
        span,
        "expected at least one index between '[' and ']'",
    );
    Box::new(d.with_help("e.g. `x[0]`, `x[1:T]` or `x[..., 0]`"))
}
