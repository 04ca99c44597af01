//! Recursive-descent parser for model files.
//!
//! Two rules shape this file: no input may panic or hang, and every error is
//! one precise diagnostic (parsing stops at the first). Recursion is bounded
//! by [`MAX_DEPTH`], checked both on the parser's own recursion and on the
//! height of every tree it builds, because later passes (and even `Drop`)
//! walk the tree recursively: a 10 MB `1+1+1...` must not become a tree that
//! overflows the stack after parsing succeeded. Tokens are pulled lazily with
//! at most two of lookahead, so memory and time stay linear.

use super::ast::*;
use super::lexer::{snippet, Lexer, Token};
use crate::diag::{Diagnostic, Errors};
use std::collections::VecDeque;

/// Deepest expression tree accepted, counting every node on the way down.
pub const MAX_DEPTH: usize = 200;

/// Boxed so that the deep recursion of nested expressions keeps small frames.
type PResult<T> = Result<T, Box<Diagnostic>>;
/// An expression and the height of its tree.
type Parsed = (Box<Expr>, usize);

/// Parses a whole model file. An empty file is an empty module.
pub fn parse(source: &str) -> Result<Module, Errors> {
    let mut p = Parser {
        src: source,
        lexer: Lexer::new(source),
        ahead: VecDeque::new(),
        stuck: None,
        lex_error: None,
        depth: 0,
    };
    let result = p.module();
    // The token that failed to lex can never be consumed, so a syntax error
    // at or after it was caused by it: report the lexer's precise message.
    match (result, p.lex_error) {
        (Ok(m), None) => Ok(m),
        (Ok(_), Some(lex)) => Err(lex.into()),
        (Err(d), Some(lex)) if lex.span.start <= d.span.start => Err(lex.into()),
        (Err(d), _) => Err((*d).into()),
    }
}

fn fail<T>(d: Diagnostic) -> PResult<T> {
    Err(Box::new(d))
}

#[cold]
#[inline(never)]
fn too_deep(at: Span) -> Box<Diagnostic> {
    let d = Diagnostic::new(
        format!("expression nested too deeply (more than {MAX_DEPTH} levels)"),
        at,
        "the limit is reached here",
    );
    Box::new(d.with_help("split the expression into several `let` bindings"))
}

fn check(height: usize, at: Span) -> PResult<usize> {
    if height > MAX_DEPTH {
        Err(too_deep(at))
    } else {
        Ok(height)
    }
}

fn help_if(d: Diagnostic, cond: bool, help: impl Into<String>) -> Diagnostic {
    if cond {
        d.with_help(help)
    } else {
        d
    }
}

fn node(kind: ExprKind, span: Span, height: usize) -> Parsed {
    (Box::new(Expr { kind, span }), height)
}

fn keyword_help(tok: Token) -> Option<String> {
    tok.keyword()
        .map(|kw| format!("`{kw}` is a keyword and cannot be used as a name"))
}

/// How a bracketed, comma-separated list is described in errors.
struct List<'s> {
    close: Token,
    /// Completes "expected ...", e.g. "']' to close the shape".
    close_desc: &'s str,
    /// Note at the opening bracket.
    opened: &'s str,
    /// Plural noun for "separate ... with ','".
    items: &'s str,
}

struct Parser<'a> {
    src: &'a str,
    lexer: Lexer<'a>,
    ahead: VecDeque<(Token, Span)>,
    /// Set once a token fails to lex: the stream repeats it forever after.
    stuck: Option<(Token, Span)>,
    lex_error: Option<Diagnostic>,
    depth: usize,
}

impl<'a> Parser<'a> {
    // ---- token stream -------------------------------------------------

    fn fill(&mut self, n: usize) {
        while self.ahead.len() < n {
            let next = match self.stuck {
                Some(t) => t,
                None => match self.lexer.next_token() {
                    Ok(t) => t,
                    Err(d) => {
                        let t = (Token::Invalid, d.span);
                        self.stuck = Some(t);
                        self.lex_error = Some(d);
                        t
                    }
                },
            };
            self.ahead.push_back(next);
        }
    }

    fn eof_span(&self) -> Span {
        Span::new(self.src.len(), self.src.len())
    }

    fn peek_full(&mut self) -> (Token, Span) {
        self.fill(1);
        let eof = (Token::Eof, self.eof_span());
        self.ahead.front().copied().unwrap_or(eof)
    }

    fn peek(&mut self) -> Token {
        self.peek_full().0
    }

    fn peek_span(&mut self) -> Span {
        self.peek_full().1
    }

    fn peek2(&mut self) -> Token {
        self.fill(2);
        self.ahead.get(1).map_or(Token::Eof, |t| t.0)
    }

    fn bump(&mut self) -> Span {
        self.fill(1);
        let eof = self.eof_span();
        self.ahead.pop_front().map_or(eof, |t| t.1)
    }

    fn eat(&mut self, tok: Token) -> Option<Span> {
        (self.peek() == tok).then(|| self.bump())
    }

    fn text(&self, span: Span) -> &'a str {
        self.src.get(span.range()).unwrap_or("")
    }

    /// Consumes the identifier the caller has just peeked.
    fn ident(&mut self) -> Ident {
        let span = self.bump();
        Ident {
            name: self.text(span).to_string(),
            span,
        }
    }

    // ---- errors ---------------------------------------------------------

    /// "expected X" at the next token, labelled with what was found there.
    fn unexpected(&mut self, expected: &str) -> Diagnostic {
        let (tok, span) = self.peek_full();
        if tok == Token::Eof {
            return Diagnostic::new(
                format!("unexpected end of file: expected {expected}"),
                span,
                "the file ends here",
            );
        }
        let found = format!("found '{}'", snippet(self.text(span)));
        let d = Diagnostic::new(format!("expected {expected}"), span, found);
        let help = "there is no `==`: a single `=` binds a name or passes a keyword argument";
        help_if(d, tok == Token::EqEq, help)
    }

    /// Expects the `=` of a binding; `colon_help` explains a `name: type` mistake.
    fn expect_eq(&mut self, expected: &str, colon_help: &str) -> PResult<()> {
        if self.eat(Token::Eq).is_some() {
            return Ok(());
        }
        let colon = self.peek() == Token::Colon;
        fail(help_if(self.unexpected(expected), colon, colon_help))
    }

    fn name(&mut self, what: &str) -> PResult<Ident> {
        let tok = self.peek();
        if tok == Token::Ident {
            return Ok(self.ident());
        }
        let d = self.unexpected(what);
        fail(match keyword_help(tok) {
            Some(h) => d.with_help(h),
            None => d,
        })
    }

    #[cold]
    #[inline(never)]
    fn unclosed(&mut self, open: Span, list: &List) -> Box<Diagnostic> {
        let tok = self.peek();
        let d = self
            .unexpected(list.close_desc)
            .with_note(open, list.opened);
        let help = format!("separate {} with ','", list.items);
        Box::new(help_if(d, tok.starts_expr(), help))
    }

    /// Elements up to and including the closing token; the opening one is
    /// already consumed. A trailing comma is allowed.
    fn delimited<T>(
        &mut self,
        open: Span,
        list: &List,
        mut elem: impl FnMut(&mut Self) -> PResult<T>,
    ) -> PResult<(Vec<T>, Span)> {
        let mut out = Vec::new();
        loop {
            if let Some(close) = self.eat(list.close) {
                return Ok((out, close));
            }
            if self.peek() == Token::Eof {
                return Err(self.unclosed(open, list));
            }
            out.push(elem(self)?);
            if self.eat(Token::Comma).is_some() {
                continue;
            }
            if let Some(close) = self.eat(list.close) {
                return Ok((out, close));
            }
            return Err(self.unclosed(open, list));
        }
    }

    // ---- items ----------------------------------------------------------

    fn module(&mut self) -> PResult<Module> {
        let mut items = Vec::new();
        loop {
            let item = match self.peek() {
                Token::Eof => return Ok(Module { items }),
                Token::Semi => {
                    self.bump();
                    continue;
                }
                Token::Const => self.const_item()?,
                Token::Dim => self.dim_item()?,
                Token::Input => self.input_item()?,
                Token::Param => self.param_item()?,
                Token::Let => self.let_item()?,
                Token::Block => Item::Block(self.block()?),
                Token::Train => Item::Train(self.train()?),
                tok => return fail(self.bad_statement(tok)),
            };
            items.push(item);
        }
    }

    fn bad_statement(&mut self, tok: Token) -> Diagnostic {
        let span = self.peek_span();
        let assigns = self.peek2() == Token::Eq;
        let d = self.unexpected("a statement (const, dim, input, param, let, block or train)");
        match tok {
            Token::Ident if assigns => {
                let name = snippet(self.text(span));
                d.with_help(format!("to define `{name}`, write `let {name} = ...`"))
            }
            Token::Ident => d.with_help(
                "every statement starts with a keyword: `const`, `dim`, `input`, `param`, `let`, `block` or `train`",
            ),
            Token::Return => d.with_help("`return` can only end a block"),
            Token::RBrace => d.with_help("this '}' has no matching '{'"),
            _ => d,
        }
    }

    fn const_item(&mut self) -> PResult<Item> {
        let kw = self.bump();
        let name = self.name("a name after 'const'")?;
        let expected = format!("'=' after 'const {}'", snippet(&name.name));
        self.expect_eq(&expected, "a constant has no type: `const NAME = value`")?;
        let value = *self.expr()?.0;
        Ok(Item::Const {
            span: kw.to(value.span),
            name,
            value,
        })
    }

    fn dim_item(&mut self) -> PResult<Item> {
        let kw = self.bump();
        let mut names = vec![self.name("a dimension name after 'dim'")?];
        while self.eat(Token::Comma).is_some() {
            names.push(self.name("a dimension name after ','")?);
        }
        let end = names.last().map_or(kw, |n| n.span);
        Ok(Item::Dim {
            names,
            span: kw.to(end),
        })
    }

    fn shape(&mut self) -> PResult<(Vec<Expr>, Span)> {
        let open = self.bump();
        let list = List {
            close: Token::RBracket,
            close_desc: "']' to close the shape",
            opened: "the shape starts here",
            items: "dimensions",
        };
        let (dims, close, _) = self.exprs(open, &list)?;
        Ok((dims, close))
    }

    fn input_item(&mut self) -> PResult<Item> {
        const HELP: &str =
            "an input is declared as `input NAME: DTYPE[dims]`, e.g. `input tokens: i32[B, T]`";
        let kw = self.bump();
        let name = self.name("a name after 'input'")?;
        let n = snippet(&name.name);
        if self.eat(Token::Colon).is_none() {
            return fail(
                self.unexpected(&format!("':' and a type after 'input {n}'"))
                    .with_help(HELP),
            );
        }
        if self.peek() == Token::LBracket {
            let what = format!("the element type of '{n}' (like 'i32' or 'f32') before '['");
            return fail(self.unexpected(&what).with_help(HELP));
        }
        let dtype = self.name(&format!("the element type of '{n}', like 'i32' or 'f32'"))?;
        if self.peek() != Token::LBracket {
            let d = self.unexpected(&format!("'[' and the shape of '{n}'"));
            return fail(d.with_help("the shape follows the type; a scalar has the shape `[]`"));
        }
        let (dims, close) = self.shape()?;
        Ok(Item::Input {
            name,
            dtype,
            dims,
            span: kw.to(close),
        })
    }

    fn param_item(&mut self) -> PResult<Item> {
        const HELP: &str =
            "a parameter is declared as `param NAME: [dims] = init`, e.g. `param w: [d, d] = normal(0.02)`";
        let kw = self.bump();
        let name = self.name("a name after 'param'")?;
        let n = snippet(&name.name);
        if self.eat(Token::Colon).is_none() {
            return fail(
                self.unexpected(&format!("':' and a shape after 'param {n}'"))
                    .with_help(HELP),
            );
        }
        let dtype = match self.peek() {
            Token::Ident => Some(self.ident()),
            _ => None,
        };
        if self.peek() != Token::LBracket {
            let d = self.unexpected(&format!("the shape of '{n}', like '[d, 4 * d]'"));
            return fail(d.with_help(HELP));
        }
        let (dims, _) = self.shape()?;
        if self.eat(Token::Eq).is_none() {
            let d = self.unexpected(&format!("'=' and an initializer after the shape of '{n}'"));
            return fail(d.with_help(
                "every parameter needs an initializer, e.g. `= zeros` or `= normal(0.02)`",
            ));
        }
        let init = *self.expr()?.0;
        Ok(Item::Param {
            span: kw.to(init.span),
            name,
            dtype,
            dims,
            init,
        })
    }

    fn let_item(&mut self) -> PResult<Item> {
        let kw = self.bump();
        let first = self.name("a name after 'let'")?;
        let help = format!(
            "a `let` binds names to an expression: `let {} = ...`",
            snippet(&first.name)
        );
        let mut shown = first.name.clone();
        let mut names = vec![first];
        while self.eat(Token::Comma).is_some() {
            let name = self.name("a name after ','")?;
            // Bounded: a 10 MB `let a, a, a, ...` only needs the start for the message.
            if shown.len() < 64 {
                shown = format!("{shown}, {}", name.name);
            }
            names.push(name);
        }
        self.expect_eq(&format!("'=' after 'let {}'", snippet(&shown)), &help)?;
        let value = *self.expr()?.0;
        Ok(Item::Let {
            span: kw.to(value.span),
            names,
            value,
        })
    }

    fn block(&mut self) -> PResult<BlockDef> {
        let kw = self.bump();
        let name = self.name("a block name after 'block'")?;
        let n = snippet(&name.name);
        if self.peek() != Token::LParen {
            let d = self.unexpected(&format!("'(' and the parameters of block '{n}'"));
            return fail(
                d.with_help("a block is written `block NAME(x, y) { ... return <expr> }`"),
            );
        }
        let open = self.bump();
        let list = List {
            close: Token::RParen,
            close_desc: &format!("')' to close the parameters of block '{n}'"),
            opened: "the parameter list starts here",
            items: "parameters",
        };
        let (params, _) = self.delimited(open, &list, |p| p.name("a parameter name"))?;
        if self.peek() != Token::LBrace {
            return fail(self.unexpected(&format!("'{{' to start the body of block '{n}'")));
        }
        let open = self.bump();
        let close_desc = format!("'}}' to close block '{n}'");
        let mut body = Vec::new();
        let ret = loop {
            let tok = self.peek();
            match tok {
                Token::Semi => {
                    self.bump();
                }
                Token::Const => body.push(self.const_item()?),
                Token::Param => body.push(self.param_item()?),
                Token::Let => body.push(self.let_item()?),
                Token::Return => {
                    self.bump();
                    break *self.expr()?.0;
                }
                Token::Eof => {
                    let d = self.unexpected(&close_desc);
                    return fail(
                        d.with_note(open, "the block starts here")
                            .with_help("a block ends with `return <expr>`"),
                    );
                }
                Token::RBrace => {
                    let span = self.peek_span();
                    let d = Diagnostic::new(
                        format!("block '{n}' has no return"),
                        span,
                        "expected `return <expr>` before this '}'",
                    );
                    return fail(
                        d.with_note(open, "the block starts here")
                            .with_help("a block ends with `return <expr>`"),
                    );
                }
                Token::Dim | Token::Input | Token::Block | Token::Train => {
                    let kw = tok.keyword().unwrap_or("");
                    let span = self.peek_span();
                    let d = Diagnostic::new(
                        format!("'{kw}' is not allowed inside a block"),
                        span,
                        "not allowed here",
                    );
                    return fail(d.with_note(open, format!("inside block '{n}'")).with_help(format!(
                        "write `{kw}` at the top level; a block holds only `const`, `param` and `let`, then `return <expr>`"
                    )));
                }
                _ => {
                    let d = self.unexpected(&format!(
                        "'const', 'param', 'let' or 'return' in block '{n}'"
                    ));
                    return fail(d.with_note(open, "the block starts here"));
                }
            }
        };
        while self.eat(Token::Semi).is_some() {}
        let Some(close) = self.eat(Token::RBrace) else {
            let tok = self.peek();
            let d = self
                .unexpected(&close_desc)
                .with_note(open, "the block starts here");
            let expression = matches!(tok, Token::Repeat | Token::True | Token::False);
            let statement = tok.keyword().is_some() && !expression;
            let help = "`return` ends a block: close it with '}' before the next statement";
            return fail(help_if(d, statement, help));
        };
        Ok(BlockDef {
            name,
            params,
            body,
            ret,
            span: kw.to(close),
        })
    }

    fn train(&mut self) -> PResult<TrainSection> {
        let kw = self.bump();
        if self.peek() != Token::LBrace {
            let d = self.unexpected("'{' after 'train'");
            return fail(d.with_help("settings are written `train { key = value ... }`"));
        }
        let open = self.bump();
        let mut entries = Vec::new();
        loop {
            let tok = self.peek();
            match tok {
                Token::Comma | Token::Semi => {
                    self.bump();
                }
                Token::RBrace => {
                    let close = self.bump();
                    return Ok(TrainSection {
                        entries,
                        span: kw.to(close),
                    });
                }
                Token::Ident => {
                    let key = self.ident();
                    let expected = format!("'=' after '{}'", snippet(&key.name));
                    self.expect_eq(&expected, "train settings are written `key = value`")?;
                    let value = *self.expr()?.0;
                    entries.push(TrainEntry { key, value });
                }
                _ => {
                    let expected = if tok == Token::Eof {
                        "'}' to close the train section"
                    } else {
                        "a setting name or '}' in the train section"
                    };
                    let d = self
                        .unexpected(expected)
                        .with_note(open, "the train section starts here");
                    return fail(match keyword_help(tok) {
                        Some(h) if tok != Token::Eof => d.with_help(h),
                        _ => d,
                    });
                }
            }
        }
    }

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

    fn expr(&mut self) -> PResult<Parsed> {
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
    fn exprs(&mut self, open: Span, list: &List) -> PResult<(Vec<Expr>, Span, usize)> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"# GPT-2 small
const vocab = 50257
const d = 768
const heads = 12
dim B, T
input tokens: i32[B, T]
input targets: i32[B, T]
block mlp(x) {
    param fc_w: [d, 4 * d] = normal(0.02)
    param fc_b: [4 * d] = zeros
    param proj_w: [4 * d, d] = normal(0.02 / sqrt(2 * 12))
    let h = gelu(x @ fc_w + fc_b)
    return x + linear(h, proj_w)
}
param wte: [vocab, d] = normal(0.02)
param wpe: [1024, d] = normal(0.01)
let x = embedding(wte, tokens) + wpe[0:T]
let x = repeat 12 mlp(x)
let q, k, v = split(x, 3, axis = -1)
let y = x[:, 0, ...] + x[..., 1:, :-1]
train {
    loss = cross_entropy(x @ transpose(wte, 0, 1), targets)
    optimizer = adamw(lr = 6e-4, betas = (0.9, 0.95), eps = 1e-8, weight_decay = 0.1)
    clip_grad_norm = 1.0
    precision = bf16
    micro_batches = 1
}
"#;

    fn join<T>(xs: &[T], f: impl Fn(&T) -> String, sep: &str) -> String {
        xs.iter().map(f).collect::<Vec<_>>().join(sep)
    }

    /// A compact rendering that makes precedence and grouping visible.
    fn sexp(e: &Expr) -> String {
        let args = |a: &[Arg]| {
            join(
                a,
                |a| match &a.name {
                    Some(n) => format!("{}={}", n.name, sexp(&a.value)),
                    None => sexp(&a.value),
                },
                ", ",
            )
        };
        let opt = |e: &Option<Expr>| e.as_ref().map_or(String::new(), sexp);
        match &e.kind {
            ExprKind::Int(v) => v.to_string(),
            ExprKind::Float(v) => format!("{v:?}"),
            ExprKind::Bool(b) => b.to_string(),
            ExprKind::Name(n) => n.clone(),
            ExprKind::Neg(x) => format!("(neg {})", sexp(x)),
            ExprKind::Binary { op, lhs, rhs } => {
                format!("({} {} {})", op.symbol(), sexp(lhs), sexp(rhs))
            }
            ExprKind::Call { func, args: a } => format!("{}({})", func.name, args(a)),
            ExprKind::Index { base, indices } => {
                let items = join(
                    indices,
                    |i| match i {
                        IndexItem::Single(e) => sexp(e),
                        IndexItem::Range { start, end, .. } => {
                            format!("{}:{}", opt(start), opt(end))
                        }
                        IndexItem::Ellipsis(_) => "...".into(),
                    },
                    ", ",
                );
                format!("{}[{}]", sexp(base), items)
            }
            ExprKind::List(es) => format!("[{}]", join(es, sexp, " ")),
            ExprKind::Tuple(es) => format!("(tuple {})", join(es, sexp, " ")),
            ExprKind::Repeat {
                count,
                func,
                args: a,
            } => {
                format!("(repeat {} {}({}))", sexp(count), func.name, args(a))
            }
        }
    }

    fn item(i: &Item) -> String {
        let names = |ns: &[Ident]| join(ns, |n| n.name.clone(), ", ");
        match i {
            Item::Const { name, value, .. } => format!("const {} = {}", name.name, sexp(value)),
            Item::Dim { names: ns, .. } => format!("dim {}", names(ns)),
            Item::Input {
                name, dtype, dims, ..
            } => {
                format!(
                    "input {}: {}[{}]",
                    name.name,
                    dtype.name,
                    join(dims, sexp, ", ")
                )
            }
            Item::Param {
                name,
                dtype,
                dims,
                init,
                ..
            } => {
                let dtype = dtype.as_ref().map_or("", |d| &d.name);
                format!(
                    "param {}: {dtype}[{}] = {}",
                    name.name,
                    join(dims, sexp, ", "),
                    sexp(init)
                )
            }
            Item::Let {
                names: ns, value, ..
            } => format!("let {} = {}", names(ns), sexp(value)),
            Item::Block(b) => {
                let body = join(&b.body, item, "; ");
                format!(
                    "block {}({}) {{ {body}; return {} }}",
                    b.name.name,
                    names(&b.params),
                    sexp(&b.ret)
                )
            }
            Item::Train(t) => {
                let entries = join(
                    &t.entries,
                    |e| format!("{} = {}", e.key.name, sexp(&e.value)),
                    "; ",
                );
                format!("train {{ {entries} }}")
            }
        }
    }

    /// Spans nest, leaves span exactly their text, and operators sit between operands.
    fn check_spans(src: &str, e: &Expr) {
        // A grouped expression's span covers its parentheses.
        let raw = &src[e.span.range()];
        let text = raw.trim_matches(|c| c == '(' || c == ')' || c == ' ');
        let inside = |c: &Expr| {
            assert!(
                e.span.start <= c.span.start && c.span.end <= e.span.end,
                "{text}"
            );
            check_spans(src, c);
        };
        match &e.kind {
            ExprKind::Name(n) => assert_eq!(text, n),
            ExprKind::Int(v) => assert_eq!(text.parse::<i64>().ok(), Some(*v)),
            ExprKind::Float(_) | ExprKind::Bool(_) => assert!(!text.contains(' ')),
            ExprKind::Neg(x) => (assert!(text.starts_with('-')), inside(x)).1,
            ExprKind::Binary { op, lhs, rhs } => {
                assert!(
                    src[lhs.span.end..rhs.span.start].trim() == op.symbol(),
                    "{text}"
                );
                (inside(lhs), inside(rhs)).1
            }
            ExprKind::Call { func, args } | ExprKind::Repeat { func, args, .. } => {
                assert_eq!(&src[func.span.range()], func.name);
                assert!(raw.ends_with(')'));
                args.iter().for_each(|a| inside(&a.value));
            }
            ExprKind::Index { base, indices } => {
                inside(base);
                for i in indices {
                    match i {
                        IndexItem::Single(x) => inside(x),
                        IndexItem::Range { start, end, span } => {
                            assert!(src[span.range()].contains(':'));
                            start.iter().chain(end).for_each(inside);
                        }
                        IndexItem::Ellipsis(s) => assert_eq!(&src[s.range()], "..."),
                    }
                }
            }
            ExprKind::List(es) | ExprKind::Tuple(es) => es.iter().for_each(inside),
        }
    }

    fn module(src: &str) -> Vec<String> {
        let m = parse(src).unwrap_or_else(|e| panic!("{}", e.render("m", src)));
        for it in &m.items {
            let mut exprs: Vec<&Expr> = Vec::new();
            match it {
                Item::Const { value, .. } | Item::Let { value, .. } => exprs.push(value),
                Item::Input { dims, .. } => exprs.extend(dims),
                Item::Param { dims, init, .. } => exprs.extend(dims.iter().chain([init])),
                Item::Block(b) => exprs.push(&b.ret),
                Item::Train(t) => exprs.extend(t.entries.iter().map(|e| &e.value)),
                Item::Dim { .. } => {}
            }
            exprs.into_iter().for_each(|e| check_spans(src, e));
        }
        m.items.iter().map(item).collect()
    }

    fn show(expr: &str) -> String {
        let items = module(&format!("let v = {expr}"));
        items[0].trim_start_matches("let v = ").to_string()
    }

    /// The single error for `src`, checked to have this message and a
    /// primary span over `at` (the empty string for the end of the file).
    fn fails(src: &str, message: &str, at: &str) -> Diagnostic {
        let errors = parse(src).expect_err("should not parse");
        assert_eq!(errors.0.len(), 1);
        let d = errors.0[0].clone();
        assert_eq!(d.message, message, "for {src:?}");
        for s in std::iter::once(d.span).chain(d.secondary.iter().map(|n| n.span)) {
            assert!(
                s.start <= s.end && s.end <= src.len(),
                "{s:?} in {} bytes",
                src.len()
            );
            assert!(src.is_char_boundary(s.start) && src.is_char_boundary(s.end));
        }
        assert_eq!(&src[d.span.range()], at, "span of {message:?}");
        if at.is_empty() {
            assert_eq!(d.span.start, src.len());
        }
        assert!(errors.render("m.fuse", src).contains(&d.message));
        d
    }

    #[test]
    fn example_program() {
        let expected = [
            "const vocab = 50257",
            "const d = 768",
            "const heads = 12",
            "dim B, T",
            "input tokens: i32[B, T]",
            "input targets: i32[B, T]",
            "block mlp(x) { param fc_w: [d, (* 4 d)] = normal(0.02); param fc_b: [(* 4 d)] = zeros; \
             param proj_w: [(* 4 d), d] = normal((/ 0.02 sqrt((* 2 12)))); \
             let h = gelu((+ (@ x fc_w) fc_b)); return (+ x linear(h, proj_w)) }",
            "param wte: [vocab, d] = normal(0.02)",
            "param wpe: [1024, d] = normal(0.01)",
            "let x = (+ embedding(wte, tokens) wpe[0:T])",
            "let x = (repeat 12 mlp(x))",
            "let q, k, v = split(x, 3, axis=(neg 1))",
            "let y = (+ x[:, 0, ...] x[..., 1:, :(neg 1)])",
            "train { loss = cross_entropy((@ x transpose(wte, 0, 1)), targets); \
             optimizer = adamw(lr=0.0006, betas=(tuple 0.9 0.95), eps=1e-8, weight_decay=0.1); \
             clip_grad_norm = 1.0; precision = bf16; micro_batches = 1 }",
        ];
        assert_eq!(module(EXAMPLE), expected);
        let m = parse(EXAMPLE).unwrap();
        let spans: Vec<&str> = m.items.iter().map(|i| &EXAMPLE[i.span().range()]).collect();
        assert_eq!(spans[0], "const vocab = 50257");
        assert_eq!(spans[3], "dim B, T");
        assert_eq!(spans[4], "input tokens: i32[B, T]");
        assert!(spans[6].starts_with("block mlp(x) {") && spans[6].ends_with("proj_w)\n}"));
        assert_eq!(spans[11], "let q, k, v = split(x, 3, axis = -1)");
        assert!(spans[13].starts_with("train {") && spans[13].ends_with("micro_batches = 1\n}"));
        let Item::Block(b) = &m.items[6] else {
            panic!()
        };
        assert_eq!(&EXAMPLE[b.params[0].span.range()], "x");
        assert_eq!(
            &EXAMPLE[b.body[2].span().range()],
            "param proj_w: [4 * d, d] = normal(0.02 / sqrt(2 * 12))"
        );
    }

    #[test]
    fn items() {
        assert!(module("").is_empty());
        assert!(module("  # nothing\n\n;;").is_empty());
        assert_eq!(module("const a = 1; const b = 2;").len(), 2);
        assert_eq!(module("dim B const x = B"), ["dim B", "const x = B"]);
        assert_eq!(
            module("param w: f32[C] = zeros"),
            ["param w: f32[C] = zeros"]
        );
        assert_eq!(
            module("input s: f32[]\nlet a, b = f(x)"),
            ["input s: f32[]", "let a, b = f(x)"]
        );
        assert_eq!(
            module("block g() { const k = 2 return k }"),
            ["block g() { const k = 2; return k }"]
        );
        assert_eq!(
            module("block f(a, b,) { return a; }"),
            ["block f(a, b) { ; return a }"]
        );
        assert_eq!(
            module("train { a = 1, b = [2]; c = x d = -1 }"),
            ["train { a = 1; b = [2]; c = x; d = (neg 1) }"]
        );
        assert_eq!(module("train {}"), ["train {  }"]);
    }

    #[test]
    fn expressions() {
        let cases = [
            ("a + b * c @ d", "(+ a (@ (* b c) d))"),
            ("-x @ w", "(@ (neg x) w)"),
            ("a - b - c", "(- (- a b) c)"),
            ("a * b + c * d - e", "(- (+ (* a b) (* c d)) e)"),
            ("a / b * c @ d", "(@ (* (/ a b) c) d)"),
            ("--x[0]", "(neg (neg x[0]))"),
            ("a - -1", "(- a (neg 1))"),
            ("(a + b) * c", "(* (+ a b) c)"),
            ("f(x)[0][1:]", "f(x)[0][1:]"),
            ("(a)", "a"),
            ("(a,)", "(tuple a)"),
            ("(a, b,)", "(tuple a b)"),
            ("()", "(tuple )"),
            ("[]", "[]"),
            ("[1, 2.5, true, false,]", "[1 2.5 true false]"),
            ("[[1], (2, 3)][0]", "[[1] (tuple 2 3)][0]"),
            ("f()", "f()"),
            ("f(a, b = 1, c = g(2),)", "f(a, b=1, c=g(2))"),
            ("f (x)", "f(x)"),
            ("repeat n blk(x, k = 2)", "(repeat n blk(x, k=2))"),
            (
                "repeat (2 * L) blk(x)[0] + 1",
                "(+ (repeat (* 2 L) blk(x))[0] 1)",
            ),
            ("repeat 3 f(repeat 2 g(x))", "(repeat 3 f((repeat 2 g(x))))"),
            ("x[0]", "x[0]"),
            ("x[:]", "x[:]"),
            ("x[a:b, a:, :b, ..., -1,]", "x[a:b, a:, :b, ..., (neg 1)]"),
            ("x[0][1]", "x[0][1]"),
            ("x[f(1):T - 1]", "x[f(1):(- T 1)]"),
        ];
        for (src, expected) in cases {
            assert_eq!(show(src), expected, "{src}");
        }
        let m = parse("let v = (a + b) * c\nlet w = x[1:, :T]").unwrap();
        let Item::Let { value, .. } = &m.items[0] else {
            panic!()
        };
        assert_eq!(value.span, Span::new(8, 19));
        let ExprKind::Binary { lhs, .. } = &value.kind else {
            panic!()
        };
        assert_eq!(lhs.span, Span::new(8, 15), "grouping spans its parentheses");
        let Item::Let { value, .. } = &m.items[1] else {
            panic!()
        };
        let ExprKind::Index { indices, .. } = &value.kind else {
            panic!()
        };
        let Some(IndexItem::Range { span, .. }) = indices.first() else {
            panic!()
        };
        assert_eq!(*span, Span::new(30, 32));
    }

    #[test]
    fn syntax_errors() {
        let src = "block f(x) {\n  param w: [d, 4 return x\n}";
        let d = fails(src, "expected ']' to close the shape", "return");
        assert_eq!(d.label, "found 'return'");
        assert_eq!(
            (d.secondary[0].span, d.secondary[0].message.as_str()),
            (Span::new(24, 25), "the shape starts here")
        );
        let d = fails("input x: i32[B T]", "expected ']' to close the shape", "T");
        assert_eq!(d.help, ["separate dimensions with ','"]);

        let src = "block mlp(x) {\n  let h = x\n";
        let d = fails(
            src,
            "unexpected end of file: expected '}' to close block 'mlp'",
            "",
        );
        assert_eq!(d.secondary[0].span, Span::new(13, 14));
        assert_eq!(d.help, ["a block ends with `return <expr>`"]);
        fails(
            "let x = a +",
            "unexpected end of file: expected an expression after '+'",
            "",
        );
        let d = fails(
            "let x = f(a, ",
            "unexpected end of file: expected ')' to close the call to 'f'",
            "",
        );
        assert_eq!(d.secondary[0].span, Span::new(9, 10));
        fails(
            "train { loss = x",
            "unexpected end of file: expected '}' to close the train section",
            "",
        );
        fails(
            "param w: [d]",
            "unexpected end of file: expected '=' and an initializer after the shape of 'w'",
            "",
        );

        let d = fails("let x: f32 = 1", "expected '=' after 'let x'", ":");
        assert_eq!(
            d.help,
            ["a `let` binds names to an expression: `let x = ...`"]
        );
        let d = fails("const x == 1", "expected '=' after 'const x'", "==");
        assert!(d.label == "found '=='" && d.help[0].contains("single `=`"));
        let d = fails(
            "let x = f(a == 1)",
            "expected ')' to close the call to 'f'",
            "==",
        );
        assert!(d.help[0].contains("single `=`"));
        let d = fails("block f(x) { let y = x }", "block 'f' has no return", "}");
        assert_eq!(d.help, ["a block ends with `return <expr>`"]);
        let d = fails("let input = 3", "expected a name after 'let'", "input");
        assert_eq!(
            d.help,
            ["`input` is a keyword and cannot be used as a name"]
        );
        let d = fails("let x = f(dim)", "expected an expression", "dim");
        assert_eq!(d.help, ["`dim` is a keyword and cannot be used as a name"]);
        let d = fails(
            "x = 1",
            "expected a statement (const, dim, input, param, let, block or train)",
            "x",
        );
        assert_eq!(d.help, ["to define `x`, write `let x = ...`"]);
        let d = fails(
            "block f(x) { return x let y = 1 }",
            "expected '}' to close block 'f'",
            "let",
        );
        assert!(d.help[0].starts_with("`return` ends a block"));
        fails(
            "block f(x) { input t: i32[B] return x }",
            "'input' is not allowed inside a block",
            "input",
        );
        let d = fails("train { loss: x }", "expected '=' after 'loss'", ":");
        assert_eq!(d.help, ["train settings are written `key = value`"]);

        let d = fails(
            "let x = f(a = 1, b + 1)",
            "positional argument after keyword argument",
            "b + 1",
        );
        assert_eq!(d.secondary[0].span, Span::new(10, 11));
        let d = fails(
            "...",
            "expected a statement (const, dim, input, param, let, block or train)",
            "...",
        );
        assert_eq!(d.label, "found '...'");
        let d = fails("let x = ...", "expected an expression", "...");
        assert!(d.help[0].contains("inside an index"));
        let d = fails(
            "let x = (a b)",
            "expected ')' to close the parenthesis",
            "b",
        );
        assert_eq!(d.help, ["separate tuple elements with ','"]);
        fails("let x = y[]", "empty index", "[]");
        fails("let x = y[1:2:3]", "index steps are not supported", ":");
        fails("let x = repeat mlp(x)", "missing repeat count", "mlp");
        fails(
            "let x = repeat 2 3",
            "expected the name of the block to repeat",
            "3",
        );
        fails(
            "let x = repeat 2 f + 1",
            "expected '(' and the arguments of the block to repeat",
            "+",
        );
        fails(
            "let x = (f)(x)",
            "only a function or block name can be called",
            "(",
        );
        fails(
            "let x = f(x)(y)",
            "only a function or block name can be called",
            "(",
        );
        fails("let x = [1, 2}", "expected ']' to close the list", "}");
        fails("let x = .5", "expected an expression", ".");
    }

    #[test]
    fn lexer_errors_in_source_order() {
        fails("let x = 1 $", "unexpected character '$'", "$");
        fails("let = $", "expected a name after 'let'", "=");
        fails(
            "f $",
            "expected a statement (const, dim, input, param, let, block or train)",
            "f",
        );
        let big = "99999999999999999999999";
        fails(
            &format!("const n = {big}"),
            &format!("integer literal '{big}' is too large"),
            big,
        );
        fails("let é = 1", "unexpected character 'é'", "é");
    }

    #[test]
    fn nesting_limit_without_stack_overflow() {
        const DEEP: &str = "expression nested too deeply (more than 200 levels)";
        // The default 2 MiB thread stack, as in any caller's thread.
        let run = std::thread::Builder::new().stack_size(2 << 20);
        run.spawn(|| {
            let d = MAX_DEPTH - 1;
            let ok = [
                format!("let x = {}x{}", "(".repeat(d), ")".repeat(d)),
                format!("let x = {}x{}", "[".repeat(d), "]".repeat(d)),
                format!("let x = {}x{}", "f(".repeat(d), ")".repeat(d)),
                format!("let x = {}x{}", "(".repeat(d), ",)".repeat(d)),
                format!("let x = {}x{}", "x[".repeat(d), "]".repeat(d)),
                format!("let x = {}x", "-".repeat(d)),
                format!("let x = {}1", "1 + ".repeat(d)),
                format!("let x = x{}", "[0]".repeat(d)),
                format!(
                    "let x = {}x{}",
                    "repeat 2 f(".repeat(d / 2),
                    ")".repeat(d / 2)
                ),
            ];
            for src in &ok {
                assert!(parse(src).is_ok(), "{}", &src[..40]);
            }
            let n = 100_000;
            let bad = [
                format!("let x = {}", "(".repeat(n)),
                format!("let x = {}x{}", "(".repeat(n), ")".repeat(n)),
                format!("let x = {}x", "-".repeat(n)),
                format!("let x = {}", "[".repeat(n)),
                format!("let x = {}", "f(".repeat(n)),
                format!("let x = {}", "x[".repeat(n)),
                format!("let x = {}", "repeat ".repeat(n)),
                format!("let x = {}", "repeat (".repeat(n)),
                format!("let x = x{}", "[0]".repeat(n)),
                format!("let x = {}1", "1 @ ".repeat(10 * n)),
                format!("let x = {}1", "- 1 + ".repeat(n)),
                format!("let x = {}x", "-(".repeat(n)),
                format!(
                    "let x = {}x{}",
                    "(".repeat(MAX_DEPTH),
                    ")".repeat(MAX_DEPTH)
                ),
                format!("let x = {}x", "-".repeat(MAX_DEPTH)),
            ];
            for src in &bad {
                let start = std::time::Instant::now();
                let e = parse(src).unwrap_err();
                assert_eq!(e.0[0].message, DEEP);
                assert!(start.elapsed().as_secs() < 2);
            }
            // Trees at the limit are dropped here, on this stack, too.
            drop(ok.map(|s| parse(&s)));
        })
        .unwrap()
        .join()
        .unwrap();
    }

    #[test]
    fn huge_inputs() {
        let start = std::time::Instant::now();
        let long = "a".repeat(10 << 20);
        let d = fails(
            &long,
            "expected a statement (const, dim, input, param, let, block or train)",
            &long,
        );
        assert!(d.label.len() < 50);
        fails(
            &format!("let {long} 1"),
            "expected '=' after 'let aaaaaaaaaaaaaaaaaaaaaaaaaaaaa...'",
            "1",
        );
        assert!(parse(&format!("# {long}")).unwrap().items.is_empty());
        assert!(parse(&format!("let x = [{}]", "1, ".repeat(1 << 20))).is_ok());
        assert_eq!(
            parse(&"let x = f(x, 2)\n".repeat(100_000))
                .unwrap()
                .items
                .len(),
            100_000
        );
        fails(
            &format!("let x = {}", ")".repeat(10 << 20)),
            "expected an expression",
            ")",
        );
        assert!(start.elapsed().as_secs() < 20);
    }

    #[test]
    fn no_input_panics() {
        // Every prefix of a real file, then random token soup.
        for (i, _) in EXAMPLE.char_indices() {
            if let Err(e) = parse(&EXAMPLE[..i]) {
                assert!(e.0[0].span.end <= i);
                e.render("m.fuse", &EXAMPLE[..i]);
            }
        }
        let pieces = [
            "(",
            ")",
            "[",
            "]",
            "{",
            "}",
            ",",
            ":",
            "...",
            ".",
            "-",
            "+",
            "@",
            "=",
            "==",
            ";",
            "x",
            "f",
            "1",
            "2.5",
            "let",
            "const",
            "block",
            "return",
            "repeat",
            "train",
            "input",
            "param",
            "dim",
            "é",
            "$",
            " ",
            "\n",
            "#",
            "99999999999999999999",
        ];
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..5000 {
            let len = next() % 40;
            let src: String = (0..len)
                .map(|_| pieces[(next() % pieces.len() as u64) as usize])
                .collect();
            if let Err(e) = parse(&src) {
                let d = &e.0[0];
                assert!(
                    d.span.end <= src.len() && src.is_char_boundary(d.span.start),
                    "{src:?}"
                );
                e.render("m.fuse", &src);
            }
        }
    }
}
