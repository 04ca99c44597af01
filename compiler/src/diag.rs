//! Diagnostics: every mistake a user can make in a model file becomes one of
//! these, rendered with file:line:col, the source line and a caret under the
//! place. Rendering is plain text (no colour) so that messages are stable
//! enough to hold in snapshot tests.

use codespan_reporting::diagnostic::{Diagnostic as CsDiagnostic, Label};
use codespan_reporting::term::{self, termcolor::NoColor, Config};
use std::fmt;

/// A half-open byte range `[start, end)` into the source text, and the
/// block call it was elaborated in: `call` is 1 + its index in the graph's
/// `calls` (0 outside any call), so that the twelve layers a `repeat` makes
/// from one line of a block keep apart.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Span {
    pub start: usize,
    pub end: usize,
    pub call: u32,
}

impl Span {
    pub fn new(start: usize, end: usize) -> Self {
        Span {
            start,
            end,
            call: 0,
        }
    }
    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span {
            start: self.start.min(other.start),
            end: self.end.max(other.end),
            call: self.call,
        }
    }
    /// The same place, elaborated in call `call`.
    pub fn in_call(self, call: u32) -> Span {
        Span { call, ..self }
    }
    pub fn range(self) -> std::ops::Range<usize> {
        self.start..self.end
    }
}

impl fmt::Debug for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

/// A labelled place in the source.
#[derive(Clone, Debug, PartialEq)]
pub struct Note {
    pub span: Span,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Diagnostic {
    /// One line: what went wrong.
    pub message: String,
    /// The primary place, with a short label under the caret.
    pub span: Span,
    pub label: String,
    /// Other places that explain the error (a definition, a call site).
    pub secondary: Vec<Note>,
    /// Free-standing hints: what was expected, what to do.
    pub help: Vec<String>,
}

impl Diagnostic {
    pub fn new(message: impl Into<String>, span: Span, label: impl Into<String>) -> Self {
        Diagnostic {
            message: message.into(),
            span,
            label: label.into(),
            secondary: Vec::new(),
            help: Vec::new(),
        }
    }

    pub fn with_note(mut self, span: Span, message: impl Into<String>) -> Self {
        self.secondary.push(Note {
            span,
            message: message.into(),
        });
        self
    }

    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help.push(help.into());
        self
    }

    /// Renders as `error: ...` with `--> file:line:col`, the source line and a caret.
    pub fn render(&self, file_name: &str, source: &str) -> String {
        let points: Vec<usize> = std::iter::once(self.span)
            .chain(self.secondary.iter().map(|n| n.span))
            .map(|s| s.start)
            .collect();
        self.render_in(&View::new(file_name, source, &points))
    }

    fn render_in(&self, view: &View) -> String {
        let source = view.original;
        let clamp = |s: Span| {
            let end = s.end.min(source.len());
            let start = s.start.min(end);
            // codespan slices the source; keep both ends on char boundaries.
            let start = floor_char_boundary(source, start);
            let end = floor_char_boundary(source, end).max(start);
            // A span between two operands (the operator) may carry spaces;
            // the caret belongs under the visible text only.
            let text = &source[start..end];
            let trimmed = text.trim();
            let (start, end) = if trimmed.is_empty() {
                (start, end)
            } else {
                let start = start + (text.len() - text.trim_start().len());
                (start, start + trimmed.len())
            };
            view.map(start)..view.map(end)
        };
        let mut labels =
            vec![Label::primary((), clamp(self.span)).with_message(shorten(&self.label))];
        for n in &self.secondary {
            labels.push(Label::secondary((), clamp(n.span)).with_message(shorten(&n.message)));
        }
        let diag = CsDiagnostic::error()
            .with_message(shorten(&self.message))
            .with_labels(labels)
            .with_notes(self.help.iter().map(|h| shorten(h)).collect());
        let mut out = NoColor::new(Vec::new());
        let config = Config {
            chars: term::Chars::ascii(),
            ..Config::default()
        };
        if term::emit(&mut out, &config, view, &diag).is_err() {
            // Rendering only fails on spans outside the file, which clamp() rules out;
            // fall back to the bare message rather than lose the error.
            return format!("error: {}\n", self.message);
        }
        String::from_utf8_lossy(&out.into_inner()).into_owned()
    }
}

/// Message text with every name longer than 64 characters cut short, so that
/// a 10 MB identifier does not end up in a one-line message.
fn shorten(text: &str) -> String {
    const MAX: usize = 64;
    let mut out = String::with_capacity(text.len().min(1024));
    let mut run = 0;
    for c in text.chars() {
        if c.is_alphanumeric() || c == '_' {
            run += 1;
            if run == MAX {
                out.push_str("...");
            }
            if run >= MAX {
                continue;
            }
        } else {
            run = 0;
        }
        out.push(c);
    }
    out
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Lines longer than this many bytes are shown as a window around the place
/// (a generated one-line model, a 10 MB name), not printed whole.
const MAX_LINE: usize = 200;
/// Characters of a cut line kept before the first place on it, and in all.
const BEFORE: usize = 40;
const WIDTH: usize = 120;
/// Marks the text cut from a long line.
const CUT: &str = "...";

/// One line of the source as it is shown.
struct Line {
    /// Where the line starts, and where its text (without the newline) ends, in the source.
    start: usize,
    end: usize,
    /// The shown window `[from, to)` of the source, and where it starts in the view.
    from: usize,
    to: usize,
    at: usize,
    /// Bytes of the cut mark before the window, and characters hidden before it.
    mark: usize,
    hidden: usize,
}

/// The source as a diagnostic shows it: the file itself, or with long lines
/// cut to a window. Line numbers stay; columns are those of the file.
struct View<'a> {
    name: &'a str,
    original: &'a str,
    text: std::borrow::Cow<'a, str>,
    /// Empty when nothing is cut: offsets are the file's own.
    lines: Vec<Line>,
    starts: Vec<usize>,
}

impl<'a> View<'a> {
    /// `points`: offsets that must stay visible on a long line.
    fn new(name: &'a str, source: &'a str, points: &[usize]) -> View<'a> {
        let long = source.split('\n').any(|l| l.len() > MAX_LINE);
        let mut lines = Vec::new();
        let text = if !long {
            std::borrow::Cow::Borrowed(source)
        } else {
            let mut text = String::new();
            let mut start = 0;
            for line in source.split_inclusive('\n') {
                let end = start + line.trim_end_matches('\n').len();
                let (from, to) = if end - start <= MAX_LINE {
                    (start, end)
                } else {
                    let first = points
                        .iter()
                        .copied()
                        .filter(|p| (start..=end).contains(p))
                        .min()
                        .unwrap_or(start);
                    let from = back(source, floor_char_boundary(source, first), BEFORE).max(start);
                    (from, ahead(source, from, WIDTH).min(end))
                };
                let mark = if from > start { CUT.len() } else { 0 };
                let at = text.len() + mark;
                text.push_str(&CUT[..mark]);
                text.push_str(&source[from..to]);
                if to < end {
                    text.push_str(CUT);
                }
                text.push_str(&source[end..start + line.len()]);
                let hidden = source[start..from].chars().count();
                lines.push(Line {
                    start,
                    end,
                    from,
                    to,
                    at,
                    mark,
                    hidden,
                });
                start += line.len();
            }
            std::borrow::Cow::Owned(text)
        };
        let starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        View {
            name,
            original: source,
            text,
            lines,
            starts,
        }
    }

    /// Where an offset of the file is in the view.
    fn map(&self, offset: usize) -> usize {
        let i = self.lines.partition_point(|l| l.start <= offset);
        let Some(l) = i.checked_sub(1).and_then(|i| self.lines.get(i)) else {
            return offset.min(self.text.len());
        };
        if offset > l.end {
            // In the line break: after the shown text and its cut mark.
            let shown_end = l.at + (l.to - l.from) + if l.to < l.end { CUT.len() } else { 0 };
            return (shown_end + (offset - l.end)).min(self.text.len());
        }
        l.at + (offset.clamp(l.from, l.to) - l.from)
    }
}

/// The offset `n` characters before `i` (or the start).
fn back(s: &str, i: usize, n: usize) -> usize {
    s[..i]
        .char_indices()
        .rev()
        .nth(n.saturating_sub(1))
        .map_or(0, |(j, _)| j)
}

/// The offset `n` characters after `i` (or the end).
fn ahead(s: &str, i: usize, n: usize) -> usize {
    s[i..].char_indices().nth(n).map_or(s.len(), |(j, _)| i + j)
}

impl<'a> codespan_reporting::files::Files<'a> for View<'a> {
    type FileId = ();
    type Name = &'a str;
    type Source = &'a str;

    fn name(&'a self, (): ()) -> Result<&'a str, codespan_reporting::files::Error> {
        Ok(self.name)
    }

    fn source(&'a self, (): ()) -> Result<&'a str, codespan_reporting::files::Error> {
        Ok(&self.text)
    }

    fn line_index(
        &'a self,
        (): (),
        byte_index: usize,
    ) -> Result<usize, codespan_reporting::files::Error> {
        Ok(self
            .starts
            .partition_point(|&s| s <= byte_index)
            .saturating_sub(1))
    }

    fn line_range(
        &'a self,
        (): (),
        line_index: usize,
    ) -> Result<std::ops::Range<usize>, codespan_reporting::files::Error> {
        use codespan_reporting::files::Error;
        let start = *self.starts.get(line_index).ok_or(Error::LineTooLarge {
            given: line_index,
            max: self.starts.len() - 1,
        })?;
        let end = self
            .starts
            .get(line_index + 1)
            .copied()
            .unwrap_or(self.text.len());
        Ok(start..end)
    }

    /// The column in the file, not in the view of a cut line.
    fn column_number(
        &'a self,
        (): (),
        line_index: usize,
        byte_index: usize,
    ) -> Result<usize, codespan_reporting::files::Error> {
        let range = self.line_range((), line_index)?;
        let col = codespan_reporting::files::column_index(&self.text, range, byte_index) + 1;
        Ok(match self.lines.get(line_index) {
            Some(l) => (col + l.hidden).saturating_sub(l.mark),
            None => col,
        })
    }
}

/// A model file error: one or more diagnostics.
#[derive(Clone, Debug, PartialEq)]
pub struct Errors(pub Vec<Diagnostic>);

/// Past this many diagnostics (a model with thousands of unused parameters),
/// the rest are counted, not shown.
const MAX_SHOWN: usize = 20;

impl Errors {
    pub fn render(&self, file_name: &str, source: &str) -> String {
        let shown = &self.0[..self.0.len().min(MAX_SHOWN)];
        // The file's lines are indexed once for all its diagnostics.
        let shared = View::new(file_name, source, &[]);
        let mut parts: Vec<String> = shown
            .iter()
            .map(|d| {
                if shared.lines.is_empty() {
                    d.render_in(&shared)
                } else {
                    d.render(file_name, source)
                }
            })
            .collect();
        if self.0.len() > shown.len() {
            parts.push(format!(
                "error: {} more errors are not shown (the first {MAX_SHOWN} are above)\n",
                self.0.len() - shown.len()
            ));
        }
        parts.join("\n")
    }
}

impl From<Diagnostic> for Errors {
    fn from(d: Diagnostic) -> Self {
        Errors(vec![d])
    }
}
