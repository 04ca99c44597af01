//! Words of one line of the text form, read on demand with their columns.

use super::ParseError;
use crate::ir::dim::Dim;
use crate::ir::types::{DType, Layout, TensorType};

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Tok<'a> {
    /// `f32`, `eps`, `cross_entropy`.
    Ident(&'a str),
    /// `768`, `0.02`, `1e-5` (a sign is a `Punct` of its own).
    Number(&'a str),
    /// `"h.0.attn.w"`, escapes undone.
    Str(String),
    /// `%12` or `%x`: the text after the `%`.
    Value(&'a str),
    /// `..` in a range.
    DotDot,
    /// One of `[ ] ( ) { } , : = * + - @`.
    Punct(char),
}

impl Tok<'_> {
    fn describe(&self) -> String {
        match self {
            Tok::Ident(s) | Tok::Number(s) => format!("`{s}`"),
            Tok::Str(s) => format!("the string {s:?}"),
            Tok::Value(s) => format!("`%{s}`"),
            Tok::DotDot => "`..`".into(),
            Tok::Punct(c) => format!("`{c}`"),
        }
    }
}

/// A position in one line. `;` and `#` start a comment outside strings,
/// so the end of the line is the end of its code.
pub(super) struct Cursor<'a> {
    pub line: usize,
    text: &'a str,
    pos: usize,
    /// The graph's symbolic sizes: a dimension names one of them.
    pub dims: &'a [String],
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

impl<'a> Cursor<'a> {
    pub fn new(line: usize, text: &'a str, dims: &'a [String]) -> Cursor<'a> {
        Cursor {
            line,
            text,
            pos: 0,
            dims,
        }
    }

    fn rest(&self) -> &'a str {
        &self.text[self.pos..]
    }

    fn skip_space(&mut self) {
        let r = self.rest();
        self.pos += r.len() - r.trim_start().len();
    }

    /// 1-based column (in characters) of the next word.
    pub fn col(&mut self) -> usize {
        self.skip_space();
        self.text[..self.pos].chars().count() + 1
    }

    pub fn error_at(&self, col: usize, message: impl Into<String>) -> ParseError {
        ParseError {
            line: self.line,
            col,
            message: message.into(),
        }
    }

    pub fn error(&mut self, message: impl Into<String>) -> ParseError {
        let col = self.col();
        self.error_at(col, message)
    }

    /// "expected X, found Y" at the next word.
    pub fn expected(&mut self, what: &str) -> ParseError {
        let found = match self.peek() {
            Ok(Some(t)) => t.describe(),
            Ok(None) => "the end of the line".into(),
            Err(e) => return e,
        };
        self.error(format!("expected {what}, found {found}"))
    }

    pub fn at_end(&mut self) -> bool {
        self.skip_space();
        self.rest().is_empty() || self.rest().starts_with([';', '#'])
    }

    /// The next word and its length in bytes, without taking it.
    fn lex(&mut self) -> Result<Option<(Tok<'a>, usize)>, ParseError> {
        if self.at_end() {
            return Ok(None);
        }
        let r = self.rest();
        let c = r.chars().next().expect("not at the end");
        let word_len = |from: usize, ok: fn(char) -> bool| {
            r[from..]
                .find(|c: char| !ok(c))
                .map_or(r.len(), |n| n + from)
        };
        if is_ident_start(c) {
            let n = word_len(0, is_ident_char);
            return Ok(Some((Tok::Ident(&r[..n]), n)));
        }
        if c.is_ascii_digit() {
            return Ok(Some((Tok::Number(&r[..number_len(r)]), number_len(r))));
        }
        match c {
            '%' => {
                let n = word_len(1, is_ident_char);
                if n == 1 {
                    return Err(self.error("expected a value name after `%`, such as `%3`"));
                }
                Ok(Some((Tok::Value(&r[1..n]), n)))
            }
            '"' => self.string().map(|(s, n)| Some((Tok::Str(s), n))),
            '.' if r.starts_with("..") => Ok(Some((Tok::DotDot, 2))),
            '[' | ']' | '(' | ')' | '{' | '}' | ',' | ':' | '=' | '*' | '+' | '-' | '@' => {
                Ok(Some((Tok::Punct(c), 1)))
            }
            _ => Err(self.error(format!("unexpected character `{c}`"))),
        }
    }

    /// A string in Rust's debug form (how the printer quotes names).
    fn string(&mut self) -> Result<(String, usize), ParseError> {
        let r = self.rest();
        let mut out = String::new();
        let mut chars = r.char_indices().skip(1);
        while let Some((i, c)) = chars.next() {
            match c {
                '"' => return Ok((out, i + 1)),
                '\\' => match chars.next().map(|(_, e)| e) {
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    Some('r') => out.push('\r'),
                    Some('0') => out.push('\0'),
                    Some(e @ ('\\' | '"' | '\'')) => out.push(e),
                    Some('u') => {
                        let hex: String = chars
                            .by_ref()
                            .map(|(_, c)| c)
                            .take_while(|&c| c != '}')
                            .collect();
                        let ch = hex
                            .strip_prefix('{')
                            .and_then(|h| u32::from_str_radix(h, 16).ok())
                            .and_then(char::from_u32);
                        match ch {
                            Some(ch) => out.push(ch),
                            None => return Err(self.error("bad `\\u{...}` escape in a string")),
                        }
                    }
                    _ => return Err(self.error("unknown escape in a string")),
                },
                c => out.push(c),
            }
        }
        Err(self.error("a string runs to the end of the line (no closing `\"`)"))
    }

    pub fn peek(&mut self) -> Result<Option<Tok<'a>>, ParseError> {
        Ok(self.lex()?.map(|(t, _)| t))
    }

    pub fn next(&mut self) -> Result<Option<Tok<'a>>, ParseError> {
        let t = self.lex()?;
        if let Some((_, n)) = &t {
            self.pos += n;
        }
        Ok(t.map(|(t, _)| t))
    }

    /// Takes `c` if it comes next.
    pub fn eat(&mut self, c: char) -> Result<bool, ParseError> {
        if self.peek()? == Some(Tok::Punct(c)) {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    pub fn punct(&mut self, c: char) -> Result<(), ParseError> {
        if self.eat(c)? {
            Ok(())
        } else {
            Err(self.expected(&format!("`{c}`")))
        }
    }

    /// Takes the word `w` if it comes next (an optional flag).
    pub fn flag(&mut self, w: &str) -> Result<bool, ParseError> {
        if self.peek()? == Some(Tok::Ident(w)) {
            self.pos += w.len();
            return Ok(true);
        }
        Ok(false)
    }

    pub fn word(&mut self, w: &str) -> Result<(), ParseError> {
        if self.flag(w)? {
            Ok(())
        } else {
            Err(self.expected(&format!("`{w}`")))
        }
    }

    /// `key=`, before an attribute's value.
    pub fn key(&mut self, k: &str) -> Result<(), ParseError> {
        if self.peek()? != Some(Tok::Ident(k)) {
            return Err(self.expected(&format!("`{k}=`")));
        }
        self.word(k)?;
        self.punct('=')
    }

    pub fn ident(&mut self, what: &str) -> Result<&'a str, ParseError> {
        match self.peek()? {
            Some(Tok::Ident(s)) => {
                self.pos += s.len();
                Ok(s)
            }
            _ => Err(self.expected(what)),
        }
    }

    pub fn value_name(&mut self) -> Result<&'a str, ParseError> {
        match self.peek()? {
            Some(Tok::Value(s)) => {
                self.next()?;
                Ok(s)
            }
            _ => Err(self.expected("a value such as `%3`")),
        }
    }

    pub fn string_lit(&mut self, what: &str) -> Result<String, ParseError> {
        match self.peek()? {
            Some(Tok::Str(s)) => {
                self.next()?;
                Ok(s)
            }
            _ => Err(self.expected(what)),
        }
    }

    /// The text up to `c` (not taken), trimmed: a name the printer writes
    /// raw (a graph's, a parameter's dotted path).
    pub fn raw_until(&mut self, c: char, what: &str) -> Result<&'a str, ParseError> {
        self.skip_space();
        let r = self.rest();
        let end = r.find([c, ';', '#']).filter(|&i| r[i..].starts_with(c));
        match end.map(|i| r[..i].trim_end()) {
            Some(s) if !s.is_empty() => {
                self.pos += r[..end.expect("found")].len();
                Ok(s)
            }
            _ => Err(self.expected(what)),
        }
    }

    /// Like `raw_until`, up to the last `c` of the line's code.
    pub fn raw_until_last(&mut self, c: char, what: &str) -> Result<&'a str, ParseError> {
        self.skip_space();
        let r = self.rest();
        let code = &r[..r.find([';', '#']).unwrap_or(r.len())];
        match code.rfind(c).map(|i| (i, code[..i].trim_end())) {
            Some((i, s)) if !s.is_empty() => {
                self.pos += i;
                Ok(s)
            }
            _ => Err(self.expected(what)),
        }
    }

    pub fn float(&mut self) -> Result<f64, ParseError> {
        let col = self.col();
        let neg = self.eat('-')?;
        let text = match self.peek()? {
            Some(Tok::Number(s)) => s,
            Some(Tok::Ident(s @ ("inf" | "NaN"))) => s,
            _ => return Err(self.expected("a number")),
        };
        self.next()?;
        let x: f64 = text
            .parse()
            .map_err(|_| self.error_at(col, format!("`{text}` is not a number")))?;
        Ok(if neg { -x } else { x })
    }

    pub fn int(&mut self) -> Result<i64, ParseError> {
        let col = self.col();
        let neg = self.eat('-')?;
        let Some(Tok::Number(text)) = self.peek()? else {
            return Err(self.expected("an integer"));
        };
        self.next()?;
        let s = if neg {
            format!("-{text}")
        } else {
            text.to_string()
        };
        s.parse()
            .map_err(|_| self.error_at(col, format!("expected an integer, found `{s}`")))
    }

    pub fn usize(&mut self) -> Result<usize, ParseError> {
        let col = self.col();
        let Some(Tok::Number(text)) = self.peek()? else {
            return Err(self.expected("a non-negative integer"));
        };
        self.next()?;
        text.parse().map_err(|_| {
            self.error_at(
                col,
                format!("expected a non-negative integer, found `{text}`"),
            )
        })
    }

    pub fn bool(&mut self) -> Result<bool, ParseError> {
        match self.peek()? {
            Some(Tok::Ident("true")) => {
                self.next()?;
                Ok(true)
            }
            Some(Tok::Ident("false")) => {
                self.next()?;
                Ok(false)
            }
            _ => Err(self.expected("`true` or `false`")),
        }
    }

    /// `[0,2,1,3]`.
    pub fn usize_list(&mut self) -> Result<Vec<usize>, ParseError> {
        self.punct('[')?;
        let mut out = Vec::new();
        if self.eat(']')? {
            return Ok(out);
        }
        loop {
            out.push(self.usize()?);
            if self.eat(']')? {
                return Ok(out);
            }
            if !self.eat(',')? {
                return Err(self.expected("`,` or `]`"));
            }
        }
    }

    /// A dimension as `Dim` prints it: `768`, `B*T`, `T + 1`, `-B + 3`.
    pub fn dim(&mut self) -> Result<Dim, ParseError> {
        let col = self.col();
        let overflow = |c: &Self| c.error_at(col, "the dimension overflows");
        let mut total = Dim::constant(0);
        let mut neg = self.eat('-')?;
        loop {
            let mut term = self.dim_factor()?;
            while self.eat('*')? {
                let f = self.dim_factor()?;
                term = term.checked_mul(&f).ok_or_else(|| overflow(self))?;
            }
            total = if neg {
                total.checked_sub(&term)
            } else {
                total.checked_add(&term)
            }
            .ok_or_else(|| overflow(self))?;
            if self.eat('+')? {
                neg = false;
            } else if self.eat('-')? {
                neg = true;
            } else {
                return Ok(total);
            }
        }
    }

    fn dim_factor(&mut self) -> Result<Dim, ParseError> {
        let col = self.col();
        match self.peek()? {
            Some(Tok::Number(_)) => Ok(Dim::constant(self.int()?)),
            Some(Tok::Ident(s)) => {
                if !self.dims.iter().any(|d| d == s) {
                    let known = if self.dims.is_empty() {
                        "the header declares none".to_string()
                    } else {
                        format!("the header declares {}", self.dims.join(", "))
                    };
                    return Err(self.error_at(col, format!("unknown dimension `{s}` ({known})")));
                }
                self.next()?;
                Ok(Dim::symbol(s))
            }
            _ => Err(self.expected("a dimension (a size or a symbol such as `B`)")),
        }
    }

    /// `[B, T, 768]`.
    pub fn shape(&mut self) -> Result<Vec<Dim>, ParseError> {
        self.punct('[')?;
        let mut out = Vec::new();
        if self.eat(']')? {
            return Ok(out);
        }
        loop {
            out.push(self.dim()?);
            if self.eat(']')? {
                return Ok(out);
            }
            if !self.eat(',')? {
                return Err(self.expected("`,` or `]`"));
            }
        }
    }

    pub fn dtype(&mut self) -> Result<DType, ParseError> {
        let col = self.col();
        let name = self.ident("a dtype (f32, bf16, f16 or i32)")?;
        DType::parse(name).ok_or_else(|| {
            self.error_at(
                col,
                format!("expected a dtype (f32, bf16, f16 or i32), found `{name}`"),
            )
        })
    }

    /// `bf16[B, T, 768]`, with `{1,0}` after it for another axis order.
    pub fn tensor_type(&mut self) -> Result<TensorType, ParseError> {
        let dtype = self.dtype()?;
        let shape = self.shape()?;
        let mut ty = TensorType::new(dtype, shape);
        if self.peek()? == Some(Tok::Punct('{')) {
            let col = self.col();
            self.punct('{')?;
            let mut order = Vec::new();
            loop {
                order.push(self.usize()?);
                if self.eat('}')? {
                    break;
                }
                if !self.eat(',')? {
                    return Err(self.expected("`,` or `}`"));
                }
            }
            let mut sorted = order.clone();
            sorted.sort_unstable();
            if sorted != (0..ty.rank()).collect::<Vec<_>>() {
                return Err(self.error_at(
                    col,
                    format!(
                        "the axis order must list each of the {} axes once",
                        ty.rank()
                    ),
                ));
            }
            ty.layout = Layout(order);
        }
        Ok(ty)
    }
}

/// Bytes of a number at the start of `r`: digits, a fraction, an exponent.
fn number_len(r: &str) -> usize {
    let b = r.as_bytes();
    let digits = |mut i: usize| {
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        i
    };
    let mut i = digits(0);
    if i + 1 < b.len() && b[i] == b'.' && b[i + 1].is_ascii_digit() {
        i = digits(i + 1);
    }
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        let mut j = i + 1;
        if j < b.len() && (b[j] == b'+' || b[j] == b'-') {
            j += 1;
        }
        if j < b.len() && b[j].is_ascii_digit() {
            i = digits(j);
        }
    }
    i
}
