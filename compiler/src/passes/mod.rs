//! Graph passes. A pass is a value with a name and a `run`; the pipeline is
//! a list of them, and the verifier runs after each one, so a broken pass is
//! caught where it broke the graph. `fusec build --dump-after <pass>` prints
//! the graph after any of them.

mod attention;
mod cross_entropy;
mod cse;
mod dce;
mod dropout;
mod fuse_projections;
mod key_sums;
mod pack_grads;
mod pad_dims;
mod simplify;

pub use attention::FoldAttention;
pub use cross_entropy::FuseCrossEntropy;
pub use cse::Cse;
pub use dce::Dce;
pub use dropout::remove_dropout;
pub use fuse_projections::FuseProjections;
pub use pack_grads::PackAttentionGrads;
pub use pad_dims::{padded_size, PadDims};
pub use simplify::Simplify;

use crate::ir::verify::verify;
use crate::ir::Graph;

/// What a pass did, for the build report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassStats {
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub rewrites: usize,
}

pub trait Pass {
    fn name(&self) -> &'static str;
    /// One line for `--help` and the docs.
    fn about(&self) -> &'static str;
    /// Rewrites the graph; returns how many rewrites it made.
    fn run(&self, g: &mut Graph) -> usize;
}

/// The passes in the order `fusec build` runs them.
pub fn default_pipeline() -> Vec<Box<dyn Pass>> {
    vec![
        Box::new(Simplify),
        Box::new(Cse),
        Box::new(FuseCrossEntropy),
        Box::new(Dce),
        // After dce: it packs only gradients nothing else reads.
        Box::new(PackAttentionGrads),
    ]
}

/// Passes over the forward graph, before autodiff (so the backward pass is
/// built from what they produce).
pub fn forward_pipeline() -> Vec<Box<dyn Pass>> {
    vec![
        Box::new(FoldAttention),
        Box::new(PadDims),
        Box::new(FuseProjections),
    ]
}

pub fn pass_names() -> Vec<&'static str> {
    forward_pipeline()
        .iter()
        .chain(default_pipeline().iter())
        .map(|p| p.name())
        .collect()
}

/// A pass that left an invalid graph: a bug in fusec.
#[derive(Debug)]
pub struct PassError {
    pub pass: &'static str,
    pub problems: Vec<String>,
}

impl std::fmt::Display for PassError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "internal error: the graph is invalid after pass `{}`:\n  {}",
            self.pass,
            self.problems.join("\n  ")
        )
    }
}

/// Runs the passes in order, verifying after each; `after` sees the graph
/// after every pass (for `--dump-after`).
pub fn run_pipeline(
    g: &mut Graph,
    passes: &[Box<dyn Pass>],
    mut after: impl FnMut(&str, &Graph),
) -> Result<Vec<(&'static str, PassStats)>, PassError> {
    let mut stats = Vec::new();
    for p in passes {
        let before = g.g.node_count();
        let rewrites = p.run(g);
        verify(g).map_err(|problems| PassError {
            pass: p.name(),
            problems,
        })?;
        after(p.name(), g);
        stats.push((
            p.name(),
            PassStats {
                nodes_before: before,
                nodes_after: g.g.node_count(),
                rewrites,
            },
        ));
    }
    Ok(stats)
}

/// Whether `target` is an ancestor of `from` (or `from` itself).
pub(crate) fn reaches(
    g: &Graph,
    from: petgraph::stable_graph::NodeIndex,
    target: petgraph::stable_graph::NodeIndex,
) -> bool {
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![from];
    while let Some(n) = stack.pop() {
        if n == target {
            return true;
        }
        if seen.insert(n) {
            stack.extend(g.g.neighbors_directed(n, petgraph::Direction::Incoming));
        }
    }
    false
}

/// Points every reader of `from` at `to` instead (and any graph output).
pub(crate) fn replace_uses(g: &mut Graph, from: crate::ir::Value, to: crate::ir::Value) {
    for reader in g.users(from) {
        replace_use(g, from, to, reader);
    }
    for (_, v) in g.outputs.iter_mut() {
        if *v == from {
            *v = to;
        }
    }
}

/// Points one reader (node, input slot) of `from` at `to` instead.
pub(crate) fn replace_use(
    g: &mut Graph,
    from: crate::ir::Value,
    to: crate::ir::Value,
    (user, slot): (petgraph::stable_graph::NodeIndex, usize),
) {
    let e =
        g.g.edges_connecting(from.node, user)
            .find(|e| e.weight().src_port == from.port && e.weight().dst_slot == slot)
            .map(|e| petgraph::visit::EdgeRef::id(&e));
    if let Some(e) = e {
        let w = g.g.remove_edge(e).expect("edge exists");
        g.g.add_edge(
            to.node,
            user,
            crate::ir::graph::Edge {
                src_port: to.port,
                dst_slot: w.dst_slot,
            },
        );
    }
}
