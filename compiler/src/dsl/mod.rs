//! The model-file language: lexer, syntax tree and parser.
pub mod ast;
pub mod lexer;
pub mod parser;

pub use parser::parse;
