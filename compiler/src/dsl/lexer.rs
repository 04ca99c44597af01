//! Tokens of the model-file language.
//!
//! The lexer is a `logos` DFA, so it runs in linear time on any input. It is
//! pull-based ([`Lexer::next_token`]) so that the parser holds only a couple of
//! tokens at a time and reports errors in source order: a bad character near
//! the end of the file does not hide a syntax error near its start.

use crate::diag::Diagnostic;
use crate::dsl::ast::Span;
use logos::Logos;

/// Why `logos` rejected a piece of the input.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum LexError {
    #[default]
    UnexpectedChar,
    IntTooLarge,
    FloatOutOfRange,
    TwoDecimalPoints,
}

#[derive(Logos, Clone, Copy, Debug, PartialEq)]
#[logos(error = LexError)]
#[logos(skip r"[ \t\r\n\f]+")]
#[logos(skip r"#[^\n]*")]
pub enum Token {
    #[token("const")]
    Const,
    #[token("dim")]
    Dim,
    #[token("input")]
    Input,
    #[token("param")]
    Param,
    #[token("let")]
    Let,
    #[token("block")]
    Block,
    #[token("return")]
    Return,
    #[token("repeat")]
    Repeat,
    #[token("train")]
    Train,
    #[token("true")]
    True,
    #[token("false")]
    False,

    /// The name itself is the source text under the token's span; keeping it
    /// out of the token keeps `Token` `Copy` and the lexer allocation-free.
    #[regex("[A-Za-z_][A-Za-z0-9_]*")]
    Ident,
    /// `123`; never negative, `-1` is `Minus` then `Int(1)`.
    Int(i64),
    /// `1.5`, `1e-5`, `6.0E+4`.
    Float(f64),
    /// Only a hook for the `number` callback, which always turns it into `Int` or
    /// `Float`: a plain `[0-9]+` compiles to a loop, whereas regexes for the
    /// float forms make `logos` recurse once per digit in unoptimised builds,
    /// overflowing the stack on a long run of digits.
    #[doc(hidden)]
    #[regex("[0-9]+", number)]
    Number,

    #[token("(")]
    LParen,
    #[token(")")]
    RParen,
    #[token("[")]
    LBracket,
    #[token("]")]
    RBracket,
    #[token("{")]
    LBrace,
    #[token("}")]
    RBrace,
    #[token(",")]
    Comma,
    #[token(":")]
    Colon,
    #[token(";")]
    Semi,
    #[token("=")]
    Eq,
    /// Not part of the language: lexed as one token only so that the parser
    /// can say "found '=='" and suggest a single `=`.
    #[token("==")]
    EqEq,
    #[token("+")]
    Plus,
    #[token("-")]
    Minus,
    #[token("*")]
    Star,
    #[token("/")]
    Slash,
    #[token("@")]
    At,
    #[token(".")]
    Dot,
    #[token("...")]
    Ellipsis,

    /// End of input; never matched by `logos`, produced by [`Lexer::next_token`].
    Eof,
    /// Never produced by this module: the parser's stand-in for a token that
    /// failed to lex, so that it can keep a uniform token stream.
    Invalid,
}

fn number(lex: &mut logos::Lexer<Token>) -> Result<Token, LexError> {
    let rest = lex.remainder().as_bytes();
    let digits_from = |i: usize| {
        rest.iter()
            .skip(i)
            .take_while(|b| b.is_ascii_digit())
            .count()
    };
    let mut len = 0;
    if rest.first() == Some(&b'.') && digits_from(1) > 0 {
        len = 1 + digits_from(1);
    }
    if matches!(rest.get(len), Some(b'e' | b'E')) {
        let sign = usize::from(matches!(rest.get(len + 1), Some(b'+' | b'-')));
        let exp = digits_from(len + 1 + sign);
        if exp > 0 {
            len += 1 + sign + exp;
        }
    }
    // `3.0.4`: a second point followed by a digit is a typo, not a field access.
    if len > 0 && rest[0] == b'.' && rest.get(len) == Some(&b'.') && digits_from(len + 1) > 0 {
        lex.bump(len + 1 + digits_from(len + 1));
        return Err(LexError::TwoDecimalPoints);
    }
    lex.bump(len);
    if len == 0 {
        return lex
            .slice()
            .parse()
            .map(Token::Int)
            .map_err(|_| LexError::IntTooLarge);
    }
    match lex.slice().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(Token::Float(v)),
        _ => Err(LexError::FloatOutOfRange),
    }
}

impl Token {
    /// The spelling of a keyword, used to explain "`input` is a keyword".
    pub fn keyword(self) -> Option<&'static str> {
        Some(match self {
            Token::Const => "const",
            Token::Dim => "dim",
            Token::Input => "input",
            Token::Param => "param",
            Token::Let => "let",
            Token::Block => "block",
            Token::Return => "return",
            Token::Repeat => "repeat",
            Token::Train => "train",
            Token::True => "true",
            Token::False => "false",
            _ => return None,
        })
    }

    /// Whether an expression may start with this token.
    pub fn starts_expr(self) -> bool {
        matches!(
            self,
            Token::Int(_)
                | Token::Float(_)
                | Token::True
                | Token::False
                | Token::Ident
                | Token::LParen
                | Token::LBracket
                | Token::Minus
                | Token::Repeat
        )
    }
}

/// Source text for a message, shortened so that a 10 MB identifier does not
/// end up inside a one-line error message.
pub fn snippet(text: &str) -> String {
    const MAX: usize = 32;
    if text.chars().count() <= MAX {
        return text.to_string();
    }
    let mut s: String = text.chars().take(MAX - 3).collect();
    s.push_str("...");
    s
}

/// A pull lexer: one token per call, `Token::Eof` (repeatedly) at the end.
pub struct Lexer<'a> {
    inner: logos::Lexer<'a, Token>,
    source: &'a str,
}

impl<'a> Lexer<'a> {
    pub fn new(source: &'a str) -> Self {
        Lexer {
            inner: Token::lexer(source),
            source,
        }
    }

    pub fn next_token(&mut self) -> Result<(Token, Span), Diagnostic> {
        let Some(result) = self.inner.next() else {
            let end = self.source.len();
            return Ok((Token::Eof, Span::new(end, end)));
        };
        let range = self.inner.span();
        let span = Span::new(range.start, range.end);
        match result {
            Ok(tok) => Ok((tok, span)),
            Err(e) => Err(lex_error(self.source, span, e)),
        }
    }
}

/// Lexes the whole source; the parser uses [`Lexer`] directly instead.
pub fn lex(source: &str) -> Result<Vec<(Token, Span)>, Diagnostic> {
    let mut lexer = Lexer::new(source);
    let mut out = Vec::new();
    loop {
        let (tok, span) = lexer.next_token()?;
        if tok == Token::Eof {
            return Ok(out);
        }
        out.push((tok, span));
    }
}

fn lex_error(source: &str, span: Span, err: LexError) -> Diagnostic {
    let text = source.get(span.range()).unwrap_or("");
    match err {
        LexError::IntTooLarge => Diagnostic::new(
            format!("integer literal '{}' is too large", snippet(text)),
            span,
            "does not fit in a 64-bit signed integer",
        )
        .with_help(format!("the largest integer is {}", i64::MAX)),
        LexError::TwoDecimalPoints => Diagnostic::new(
            format!("number '{}' has more than one decimal point", snippet(text)),
            span,
            "expected a number such as `3.04`",
        ),
        LexError::FloatOutOfRange => Diagnostic::new(
            format!("number '{}' is out of range", snippet(text)),
            span,
            "too large for a 64-bit float",
        ),
        LexError::UnexpectedChar => {
            // logos may report more than one char (a partial match); point
            // at the first one, which is the one that cannot start a token.
            let Some(c) = source.get(span.start..).and_then(|s| s.chars().next()) else {
                let end = source.len();
                return Diagnostic::new("unexpected end of file", Span::new(end, end), "here");
            };
            let one = Span::new(span.start, span.start + c.len_utf8());
            let shown = if c.is_control() || c.is_whitespace() {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            };
            let d = Diagnostic::new(
                format!("unexpected character '{shown}'"),
                one,
                "not valid in a model file",
            );
            match c {
                '"' | '\'' => {
                    d.with_help("model files have no strings; write names and numbers directly")
                }
                '!' | '<' | '>' | '%' | '&' | '|' | '^' | '~' => {
                    d.with_help("operators are `+`, `-`, `*`, `/` and `@` (matrix product)")
                }
                c if c.is_whitespace() => d.with_help(
                    "this is an invisible non-ASCII space; replace it with a plain space",
                ),
                _ => d,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(src: &str) -> Vec<Token> {
        lex(src).unwrap().into_iter().map(|(t, _)| t).collect()
    }

    #[test]
    fn keywords_names_numbers() {
        use Token::*;
        assert_eq!(
            kinds("const constant dim _x9 12 1.5 1e-5 6e-4 2E+3 true"),
            vec![
                Const,
                Ident,
                Dim,
                Ident,
                Int(12),
                Float(1.5),
                Float(1e-5),
                Float(6e-4),
                Float(2e3),
                True
            ]
        );
    }

    #[test]
    fn punctuation_and_comments() {
        use Token::*;
        assert_eq!(
            kinds("x[:-1, ...] # a comment ) (\n@ == = ; . {}"),
            vec![
                Ident,
                LBracket,
                Colon,
                Minus,
                Int(1),
                Comma,
                Ellipsis,
                RBracket,
                At,
                EqEq,
                Eq,
                Semi,
                Dot,
                LBrace,
                RBrace
            ]
        );
        // `1.` without digits is an int and a dot; `..` is two dots.
        assert_eq!(kinds("1..x"), vec![Int(1), Dot, Dot, Ident]);
        assert_eq!(kinds("1...x"), vec![Int(1), Ellipsis, Ident]);
        assert_eq!(kinds("1e"), vec![Int(1), Ident]);
    }

    #[test]
    fn spans_are_byte_ranges() {
        assert!(lex("").unwrap().is_empty());
        assert!(lex("  # only a comment").unwrap().is_empty());
        let toks = lex("  let  x").unwrap();
        assert_eq!(toks[0].1, Span::new(2, 5));
        assert_eq!(toks[1].1, Span::new(7, 8));
        let mut lexer = Lexer::new("a");
        lexer.next_token().unwrap();
        assert_eq!(lexer.next_token().unwrap(), (Token::Eof, Span::new(1, 1)));
        assert_eq!(lexer.next_token().unwrap(), (Token::Eof, Span::new(1, 1)));
    }

    #[test]
    fn unexpected_characters() {
        let d = lex("let x = $y").unwrap_err();
        assert_eq!(d.message, "unexpected character '$'");
        assert_eq!(d.span, Span::new(8, 9));
        let d = lex("a ∑ b").unwrap_err();
        assert_eq!(d.message, "unexpected character '∑'");
        assert_eq!(d.span, Span::new(2, 5));
        let d = lex("a\u{a0}b").unwrap_err();
        assert_eq!(d.message, "unexpected character '\\u{a0}'");
        assert_eq!(d.span, Span::new(1, 3));
        assert_eq!(d.help.len(), 1);
        let d = lex("\"hi\"").unwrap_err();
        assert_eq!(d.span, Span::new(0, 1));
    }

    #[test]
    fn numbers_out_of_range() {
        let d = lex("const n = 99999999999999999999").unwrap_err();
        assert_eq!(
            d.message,
            "integer literal '99999999999999999999' is too large"
        );
        assert_eq!(d.span, Span::new(10, 30));
        assert_eq!(kinds("9223372036854775807"), vec![Token::Int(i64::MAX)]);
        let d = lex("1e999").unwrap_err();
        assert_eq!(d.message, "number '1e999' is out of range");
        let long = "9".repeat(100_000);
        let d = lex(&long).unwrap_err();
        assert_eq!(d.span, Span::new(0, long.len()));
        assert!(d.message.len() < 80);
    }

    #[test]
    fn huge_inputs_are_linear() {
        let big = "abc 1.5 # x\n".repeat(1_000_000);
        let start = std::time::Instant::now();
        assert_eq!(lex(&big).unwrap().len(), 2_000_000);
        assert!(start.elapsed().as_secs() < 10);
        // Long single tokens must not make the generated lexer recurse per
        // byte, which overflows the stack in unoptimised builds.
        let n = 2_000_000;
        for long in ["a", "const", "_9", "#", " ", "\n"] {
            assert!(lex(&long.repeat(n)).is_ok(), "{long:?}");
        }
        assert_eq!(lex(&"1".repeat(n)).unwrap_err().span, Span::new(0, n));
        let float = format!("1.{}e-{}", "0".repeat(n), "0".repeat(n));
        assert_eq!(
            lex(&float).unwrap(),
            [(Token::Float(1.0), Span::new(0, 2 * n + 4))]
        );
    }
}
