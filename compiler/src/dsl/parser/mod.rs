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
}

mod expr;
#[cfg(test)]
mod tests;
