//! The intermediate representation: a petgraph graph of ops over typed
//! tensors, its verifier, its text form (printed and parsed back) and its
//! Graphviz form.
pub mod dim;
pub mod dot;
pub mod graph;
pub mod parse;
pub mod print;
pub mod schedule;
pub mod sizes;
pub mod types;
pub mod verify;

pub use dim::Dim;
pub use graph::{Graph, Node, Phase, Role, Value};
pub use types::{DType, TensorType};
