//! Diagnostics: every mistake a user can make in a model file becomes one of
//! these, rendered with file:line:col, the source line and a caret under the
//! place. Rendering is plain text (no colour) so that messages are stable
//! enough to hold in snapshot tests.

use crate::dsl::ast::Span;
use codespan_reporting::diagnostic::{Diagnostic as CsDiagnostic, Label};
use codespan_reporting::files::SimpleFile;
use codespan_reporting::term::{self, termcolor::NoColor, Config};

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
        let file = SimpleFile::new(file_name, source);
        let clamp = |s: Span| {
            let end = s.end.min(source.len());
            let start = s.start.min(end);
            // codespan slices the source; keep both ends on char boundaries.
            let start = floor_char_boundary(source, start);
            let end = floor_char_boundary(source, end).max(start);
            start..end
        };
        let mut labels = vec![Label::primary((), clamp(self.span)).with_message(&self.label)];
        for n in &self.secondary {
            labels.push(Label::secondary((), clamp(n.span)).with_message(&n.message));
        }
        let diag = CsDiagnostic::error()
            .with_message(&self.message)
            .with_labels(labels)
            .with_notes(self.help.clone());
        let mut out = NoColor::new(Vec::new());
        let config = Config {
            chars: term::Chars::ascii(),
            ..Config::default()
        };
        if term::emit(&mut out, &config, &file, &diag).is_err() {
            // Rendering only fails on spans outside the file, which clamp() rules out;
            // fall back to the bare message rather than lose the error.
            return format!("error: {}\n", self.message);
        }
        String::from_utf8_lossy(&out.into_inner()).into_owned()
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// A model file error: one or more diagnostics.
#[derive(Clone, Debug, PartialEq)]
pub struct Errors(pub Vec<Diagnostic>);

impl Errors {
    pub fn render(&self, file_name: &str, source: &str) -> String {
        self.0
            .iter()
            .map(|d| d.render(file_name, source))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl From<Diagnostic> for Errors {
    fn from(d: Diagnostic) -> Self {
        Errors(vec![d])
    }
}
