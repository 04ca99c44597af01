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
            let statement = tok.keyword().is_some() && tok != Token::Repeat;
            return fail(help_if(
                d,
                statement,
                "`return` must be the last statement of a block",
            ));
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
        let start = match self.peek() {
            Token::Colon => None,
            _ => Some(self.expr()?),
        };
        let Some(colon) = self.eat(Token::Colon) else {
            return Ok(single_index(start));
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

/// `start` is always present here: an item without a colon is an expression.
fn single_index(start: Option<Parsed>) -> (IndexItem, usize) {
    match start {
        Some((e, h)) => (IndexItem::Single(*e), h),
        None => (
            IndexItem::Range {
                start: None,
                end: None,
                span: Span::default(),
            },
            0,
        ),
    }
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

    /// A compact, precedence-revealing rendering of an expression.
    fn sexp(e: &Expr) -> String {
        let args = |args: &[Arg]| {
            let shown: Vec<String> = args
                .iter()
                .map(|a| match &a.name {
                    Some(n) => format!("{}={}", n.name, sexp(&a.value)),
                    None => sexp(&a.value),
                })
                .collect();
            shown.join(", ")
        };
        let all = |es: &[Expr]| es.iter().map(sexp).collect::<Vec<_>>().join(" ");
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
                let items: Vec<String> = indices
                    .iter()
                    .map(|i| match i {
                        IndexItem::Single(e) => sexp(e),
                        IndexItem::Range { start, end, .. } => {
                            format!("{}:{}", opt(start), opt(end))
                        }
                        IndexItem::Ellipsis(_) => "...".into(),
                    })
                    .collect();
                format!("{}[{}]", sexp(base), items.join(", "))
            }
            ExprKind::List(es) => format!("[{}]", all(es)),
            ExprKind::Tuple(es) => format!("(tuple {})", all(es)),
            ExprKind::Repeat {
                count,
                func,
                args: a,
            } => {
                format!("(repeat {} {}({}))", sexp(count), func.name, args(a))
            }
        }
    }

    fn value(src: &str) -> Expr {
        let module = parse(&format!("let v = {src}")).unwrap_or_else(|e| panic!("{e:?}"));
        match module.items.into_iter().next() {
            Some(Item::Let { value, .. }) => value,
            other => panic!("not a let: {other:?}"),
        }
    }

    fn show(src: &str) -> String {
        sexp(&value(src))
    }

    fn err(src: &str) -> Diagnostic {
        let mut errors = parse(src).expect_err("should not parse").0;
        assert_eq!(errors.len(), 1);
        let d = errors.remove(0);
        // Every span stays inside the source and renders without trouble.
        for s in std::iter::once(d.span).chain(d.secondary.iter().map(|n| n.span)) {
            assert!(
                s.start <= s.end && s.end <= src.len(),
                "{s:?} in {} bytes",
                src.len()
            );
            assert!(src.is_char_boundary(s.start) && src.is_char_boundary(s.end));
        }
        assert!(d.render("m.fuse", src).contains(&d.message));
        d
    }

    /// The span of the `n`th occurrence of `needle`.
    fn at(src: &str, needle: &str, n: usize) -> Span {
        let start = src.match_indices(needle).nth(n).expect("needle").0;
        Span::new(start, start + needle.len())
    }

    #[test]
    fn example_program() {
        let m = parse(EXAMPLE).unwrap();
        assert_eq!(m.items.len(), 14);
        let Item::Const { name, value, span } = &m.items[0] else {
            panic!()
        };
        assert_eq!(
            (name.name.as_str(), &value.kind),
            ("vocab", &ExprKind::Int(50257))
        );
        assert_eq!(&EXAMPLE[span.range()], "const vocab = 50257");
        assert_eq!(name.span, at(EXAMPLE, "vocab", 0));
        let Item::Dim { names, span } = &m.items[3] else {
            panic!()
        };
        assert_eq!(names.len(), 2);
        assert_eq!(&EXAMPLE[span.range()], "dim B, T");
        let Item::Input {
            name,
            dtype,
            dims,
            span,
        } = &m.items[4]
        else {
            panic!()
        };
        assert_eq!(
            (name.name.as_str(), dtype.name.as_str(), dims.len()),
            ("tokens", "i32", 2)
        );
        assert_eq!(&EXAMPLE[span.range()], "input tokens: i32[B, T]");

        let Item::Block(b) = &m.items[6] else {
            panic!()
        };
        assert_eq!(
            (b.name.name.as_str(), b.params.len(), b.body.len()),
            ("mlp", 1, 4)
        );
        assert!(EXAMPLE[b.span.range()].starts_with("block mlp(x) {"));
        assert!(EXAMPLE[b.span.range()].ends_with("proj_w)\n}"));
        assert_eq!(sexp(&b.ret), "(+ x linear(h, proj_w))");
        let Item::Param {
            name,
            dtype,
            dims,
            init,
            ..
        } = &b.body[2]
        else {
            panic!()
        };
        assert_eq!(
            (name.name.as_str(), dtype, dims.len()),
            ("proj_w", &None, 2)
        );
        assert_eq!(sexp(init), "normal((/ 0.02 sqrt((* 2 12))))");
        assert_eq!(&EXAMPLE[init.span.range()], "normal(0.02 / sqrt(2 * 12))");

        let lets: Vec<String> = m.items[9..13]
            .iter()
            .map(|item| match item {
                Item::Let { names, value, .. } => {
                    let names: Vec<&str> = names.iter().map(|n| n.name.as_str()).collect();
                    format!("{} = {}", names.join(","), sexp(value))
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            lets,
            [
                "x = (+ embedding(wte, tokens) wpe[0:T])",
                "x = (repeat 12 mlp(x))",
                "q,k,v = split(x, 3, axis=(neg 1))",
                "y = (+ x[:, 0, ...] x[..., 1:, :(neg 1)])",
            ]
        );

        let Item::Train(t) = &m.items[13] else {
            panic!()
        };
        let keys: Vec<&str> = t.entries.iter().map(|e| e.key.name.as_str()).collect();
        assert_eq!(
            keys,
            [
                "loss",
                "optimizer",
                "clip_grad_norm",
                "precision",
                "micro_batches"
            ]
        );
        assert_eq!(
            sexp(&t.entries[1].value),
            "adamw(lr=0.0006, betas=(tuple 0.9 0.95), eps=1e-8, weight_decay=0.1)"
        );
        assert!(
            EXAMPLE[t.span.range()].starts_with("train {")
                && EXAMPLE[t.span.range()].ends_with('}')
        );
    }

    #[test]
    fn empty_and_trivial_files() {
        assert_eq!(parse("").unwrap().items, vec![]);
        assert_eq!(parse("  # nothing\n\n;;").unwrap().items, vec![]);
        assert_eq!(parse("const a = 1; const b = 2;").unwrap().items.len(), 2);
        assert_eq!(parse("dim B const x = B").unwrap().items.len(), 2);
    }

    #[test]
    fn precedence() {
        assert_eq!(show("a + b * c @ d"), "(+ a (@ (* b c) d))");
        assert_eq!(show("-x @ w"), "(@ (neg x) w)");
        assert_eq!(show("a - b - c"), "(- (- a b) c)");
        assert_eq!(show("a / b * c @ d"), "(@ (* (/ a b) c) d)");
        assert_eq!(show("--x[0]"), "(neg (neg x[0]))");
        assert_eq!(show("a - -1"), "(- a (neg 1))");
        assert_eq!(show("(a + b) * c"), "(* (+ a b) c)");
        assert_eq!(show("f(x)[0][1:]"), "f(x)[0][1:]");
        let e = value("(a + b) * c");
        assert_eq!(e.span, Span::new(8, 19));
        let ExprKind::Binary { lhs, .. } = &e.kind else {
            panic!()
        };
        assert_eq!(lhs.span, Span::new(8, 15));
        let e = value("- x");
        assert_eq!(e.span, Span::new(8, 11));
    }

    #[test]
    fn literals_tuples_lists() {
        assert_eq!(show("(a)"), "a");
        assert_eq!(show("(a,)"), "(tuple a)");
        assert_eq!(show("(a, b,)"), "(tuple a b)");
        assert_eq!(show("()"), "(tuple )");
        assert_eq!(show("[]"), "[]");
        assert_eq!(show("[1, 2.5, true, false,]"), "[1 2.5 true false]");
        assert_eq!(show("[[1], (2, 3)]"), "[[1] (tuple 2 3)]");
        assert_eq!(show("1e-5"), "1e-5");
    }

    #[test]
    fn calls_and_repeat() {
        assert_eq!(show("f()"), "f()");
        assert_eq!(show("f(a, b = 1, c = g(2),)"), "f(a, b=1, c=g(2))");
        assert_eq!(show("f (x)"), "f(x)");
        assert_eq!(show("repeat n blk(x, k = 2)"), "(repeat n blk(x, k=2))");
        assert_eq!(
            show("repeat (2 * L) blk(x)[0]"),
            "(repeat (* 2 L) blk(x))[0]"
        );
        assert_eq!(
            show("repeat 3 f(repeat 2 g(x))"),
            "(repeat 3 f((repeat 2 g(x))))"
        );
        let e = value("repeat 12 mlp(x) + 1");
        let ExprKind::Binary { lhs, .. } = &e.kind else {
            panic!()
        };
        assert_eq!(lhs.span, Span::new(8, 24));
        let ExprKind::Repeat { func, .. } = &lhs.kind else {
            panic!()
        };
        assert_eq!(func.span, Span::new(18, 21));
    }

    #[test]
    fn index_forms() {
        assert_eq!(show("x[0]"), "x[0]");
        assert_eq!(show("x[:]"), "x[:]");
        assert_eq!(
            show("x[a:b, a:, :b, ..., -1,]"),
            "x[a:b, a:, :b, ..., (neg 1)]"
        );
        assert_eq!(show("x[0][1]"), "x[0][1]");
        assert_eq!(show("[1, 2][0]"), "[1 2][0]");
        let src = "let v = x[1:, :T]";
        let Item::Let { value, .. } = &parse(src).unwrap().items[0] else {
            panic!()
        };
        let ExprKind::Index { indices, .. } = &value.kind else {
            panic!()
        };
        let spans: Vec<&str> = indices
            .iter()
            .map(|i| match i {
                IndexItem::Range { span, .. } => &src[span.range()],
                _ => panic!(),
            })
            .collect();
        assert_eq!(spans, ["1:", ":T"]);
    }

    #[test]
    fn items() {
        let m =
            parse("param w: f32[C] = zeros\nlet a, b = f(x)\nblock g() { const k = 2 return k }")
                .unwrap();
        let Item::Param { dtype, .. } = &m.items[0] else {
            panic!()
        };
        assert_eq!(dtype.as_ref().map(|d| d.name.as_str()), Some("f32"));
        let Item::Let { names, span, .. } = &m.items[1] else {
            panic!()
        };
        assert_eq!((names.len(), *span), (2, Span::new(24, 39)));
        let Item::Block(b) = &m.items[2] else {
            panic!()
        };
        assert!(b.params.is_empty());
        assert!(matches!(b.body[0], Item::Const { .. }));
        let m = parse("input s: f32[]\ntrain { a = 1, b = [2]; c = x }").unwrap();
        let Item::Input { dims, .. } = &m.items[0] else {
            panic!()
        };
        assert!(dims.is_empty());
        let Item::Train(t) = &m.items[1] else {
            panic!()
        };
        assert_eq!(t.entries.len(), 3);
        assert!(parse("train {}").is_ok());
        assert!(parse("block f(a, b,) { return a; }").is_ok());
    }

    #[test]
    fn unclosed_shape() {
        let src = "block f(x) {\n  param w: [d, 4 return x\n}";
        let d = err(src);
        assert_eq!(d.message, "expected ']' to close the shape");
        assert_eq!(
            (d.span, d.label.as_str()),
            (at(src, "return", 0), "found 'return'")
        );
        assert_eq!(d.secondary[0].span, at(src, "[", 0));
        assert_eq!(d.secondary[0].message, "the shape starts here");
        let d = err("input x: i32[B T]");
        assert_eq!(d.help, ["separate dimensions with ','"]);
    }

    #[test]
    fn unexpected_end_of_file() {
        let src = "block mlp(x) {\n  let h = x\n";
        let d = err(src);
        assert_eq!(
            d.message,
            "unexpected end of file: expected '}' to close block 'mlp'"
        );
        assert_eq!(d.span, Span::new(src.len(), src.len()));
        assert_eq!(d.secondary[0].span, at(src, "{", 0));
        assert_eq!(d.help, ["a block ends with `return <expr>`"]);
        let d = err("let x = a +");
        assert_eq!(
            d.message,
            "unexpected end of file: expected an expression after '+'"
        );
        let d = err("let x = f(a, ");
        assert_eq!(
            d.message,
            "unexpected end of file: expected ')' to close the call to 'f'"
        );
        assert_eq!(d.secondary[0].span, Span::new(9, 10));
        let d = err("train { loss = x");
        assert_eq!(
            d.message,
            "unexpected end of file: expected '}' to close the train section"
        );
    }

    #[test]
    fn helpful_errors() {
        let d = err("let x: f32 = 1");
        assert_eq!(
            (d.message.as_str(), d.span),
            ("expected '=' after 'let x'", Span::new(5, 6))
        );
        assert_eq!(
            d.help,
            ["a `let` binds names to an expression: `let x = ...`"]
        );
        let d = err("const x == 1");
        assert_eq!((d.label.as_str(), d.span), ("found '=='", Span::new(8, 10)));
        assert!(d.help[0].contains("single `=`"));
        let d = err("let x = f(a == 1)");
        assert!(d.help[0].contains("single `=`"));
        let d = err("block f(x) { let y = x }");
        assert_eq!(d.message, "block 'f' has no return");
        assert_eq!(d.span, Span::new(23, 24));
        assert_eq!(d.help, ["a block ends with `return <expr>`"]);
        let d = err("let input = 3");
        assert_eq!(d.message, "expected a name after 'let'");
        assert_eq!(
            d.help,
            ["`input` is a keyword and cannot be used as a name"]
        );
        let d = err("let x = f(dim)");
        assert_eq!(d.help, ["`dim` is a keyword and cannot be used as a name"]);
        let d = err("x = 1");
        assert_eq!(d.help, ["to define `x`, write `let x = ...`"]);
        let d = err("block f(x) { return x let y = 1 }");
        assert_eq!(d.message, "expected '}' to close block 'f'");
        assert_eq!(d.help, ["`return` must be the last statement of a block"]);
        let d = err("block f(x) { input t: i32[B] return x }");
        assert_eq!(d.message, "'input' is not allowed inside a block");
        let d = err("train { loss: x }");
        assert_eq!(d.help, ["train settings are written `key = value`"]);
        let d = err("param w: [d]");
        assert_eq!(
            d.message,
            "unexpected end of file: expected '=' and an initializer after the shape of 'w'"
        );
    }

    #[test]
    fn expression_errors() {
        let d = err("let x = f(a = 1, b)");
        assert_eq!(d.message, "positional argument after keyword argument");
        assert_eq!(d.span, Span::new(17, 18));
        assert_eq!(d.secondary[0].span, Span::new(10, 11));
        let d = err("...");
        assert_eq!(
            d.message,
            "expected a statement (const, dim, input, param, let, block or train)"
        );
        assert_eq!(d.label, "found '...'");
        let d = err("let x = ...");
        assert_eq!(d.message, "expected an expression");
        assert_eq!(d.span, Span::new(8, 11));
        let d = err("let x = (a b)");
        assert_eq!(d.message, "expected ')' to close the parenthesis");
        assert_eq!(d.help, ["separate tuple elements with ','"]);
        assert_eq!(err("let x = y[]").message, "empty index");
        assert_eq!(
            err("let x = y[1:2:3]").message,
            "index steps are not supported"
        );
        let d = err("let x = repeat mlp(x)");
        assert_eq!(
            (d.message.as_str(), d.span),
            ("missing repeat count", Span::new(15, 18))
        );
        assert_eq!(
            err("let x = repeat 2 3").message,
            "expected the name of the block to repeat"
        );
        assert_eq!(
            err("let x = (f)(x)").message,
            "only a function or block name can be called"
        );
        assert_eq!(
            err("let x = f(x)(y)").message,
            "only a function or block name can be called"
        );
        let d = err("let x = [1, 2}");
        assert_eq!(d.message, "expected ']' to close the list");
        assert_eq!(d.label, "found '}'");
    }

    #[test]
    fn lexer_errors_in_source_order() {
        let d = err("let x = 1 $");
        assert_eq!(
            (d.message.as_str(), d.span),
            ("unexpected character '$'", Span::new(10, 11))
        );
        let d = err("let = $");
        assert_eq!(d.message, "expected a name after 'let'");
        let d = err("f $");
        assert_eq!(
            d.message,
            "expected a statement (const, dim, input, param, let, block or train)"
        );
        let d = err("const n = 99999999999999999999999");
        assert_eq!(
            d.message,
            "integer literal '99999999999999999999999' is too large"
        );
        assert_eq!(d.span, Span::new(10, 33));
        let d = err("let é = 1");
        assert_eq!(
            (d.message.as_str(), d.span),
            ("unexpected character 'é'", Span::new(4, 6))
        );
    }

    #[test]
    fn nesting_limit_without_stack_overflow() {
        // The default 2 MiB thread stack, as in any caller's thread.
        let run = std::thread::Builder::new().stack_size(2 << 20);
        run.spawn(|| {
            let deep = MAX_DEPTH - 1;
            let ok = [
                format!("let x = {}x{}", "(".repeat(deep), ")".repeat(deep)),
                format!("let x = {}x{}", "[".repeat(deep), "]".repeat(deep)),
                format!("let x = {}x{}", "f(".repeat(deep), ")".repeat(deep)),
                format!("let x = {}x{}", "(".repeat(deep), ",)".repeat(deep)),
                format!("let x = {}x", "-".repeat(deep)),
                format!("let x = {}1", "1 + ".repeat(deep)),
                format!("let x = x{}", "[0]".repeat(deep)),
                format!(
                    "let x = {}x{}",
                    "repeat 2 f(".repeat(deep / 2),
                    ")".repeat(deep / 2)
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
                let d = err(src);
                assert_eq!(
                    d.message,
                    "expression nested too deeply (more than 200 levels)"
                );
                assert!(start.elapsed().as_secs() < 2);
            }
            // A deep tree is dropped here too: that must not overflow either.
            drop(ok.map(|s| parse(&s)));
        })
        .unwrap()
        .join()
        .unwrap();
    }

    #[test]
    fn huge_inputs() {
        let long_name = "a".repeat(10 << 20);
        let start = std::time::Instant::now();
        let d = err(&long_name);
        assert!(d.label.len() < 50);
        assert_eq!(d.span, Span::new(0, long_name.len()));
        assert!(err(&format!("let {long_name} 1")).message.len() < 80);
        assert!(parse(&format!("# {long_name}")).unwrap().items.is_empty());
        let list = format!("let x = [{}]", "1, ".repeat(1 << 20));
        assert!(parse(&list).is_ok());
        let lets = "let x = f(x, 2)\n".repeat(100_000);
        assert_eq!(parse(&lets).unwrap().items.len(), 100_000);
        assert!(
            err(&format!("let x = {}", ")".repeat(10 << 20))).message == "expected an expression"
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
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..5000 {
            let mut src = String::new();
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            for _ in 0..(state % 40) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                src.push_str(pieces[(state % pieces.len() as u64) as usize]);
            }
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
